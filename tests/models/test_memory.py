"""Cross-batch memory (loss.memory_size): its item-aware mining against a brute-force reference,
the in-batch loss while the queue is empty, the queue's order, its checkpoint state, the host
syncs of a step, and a training run that stops mid-epoch and resumes bit-exactly with the
memory in use."""

import itertools
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from audioclf import checkpoint
from audioclf.config import load_config
from audioclf.losses import build_loss, gather_global
from audioclf.losses.memory import CrossBatchMemory, mine_with_items
from tests.helpers import fit, tiny_config
from tests.train_hooks import digest_hooks, stop_at

MINERS = ["batch_hard", "semi_hard", "all"]
MARGIN = 0.3


def batch(seed: int, rows: int = 10, dim: int = 6):
    generator = torch.Generator().manual_seed(seed)
    emb = F.normalize(torch.randn(rows, dim, generator=generator), dim=1)
    classes = torch.randint(0, 3, (rows,), generator=generator)
    items = classes * 10 + torch.randint(0, 2, (rows,), generator=generator)  # 2 items a class
    return emb, classes, items


def brute_force(emb, classes, items, refs, ref_classes, ref_items, miner, margin):
    """The triplets by the definitions, with plain loops."""
    sim = (emb @ refs.T).tolist()
    rows, found = range(len(emb)), set()
    for a in rows:
        positives = [p for p in range(len(refs)) if ref_classes[p] == classes[a]
                     and ref_items[p] != items[a]]  # fmt: skip
        negatives = [n for n in range(len(refs)) if ref_classes[n] != classes[a]]
        if miner == "batch_hard":
            if positives and negatives:
                p = min(positives, key=lambda j: sim[a][j])
                n = max(negatives, key=lambda j: sim[a][j])
                found.add((a, p, n))
            continue
        for p, n in itertools.product(positives, negatives):
            gap = sim[a][p] - sim[a][n]
            if gap <= margin and (miner == "all" or gap > 0):
                found.add((a, p, n))
    return found


@pytest.mark.parametrize("miner", MINERS)
def test_mining_with_items_matches_the_definitions(miner):
    emb, classes, items = batch(0)
    refs, ref_classes, ref_items = batch(1, rows=14)
    refs, ref_classes, ref_items = (torch.cat(t) for t in ((emb, refs), (classes, ref_classes),
                                                           (items, ref_items)))  # fmt: skip
    args = (emb, classes, items, refs, ref_classes, ref_items, miner, MARGIN)
    mined = set(zip(*(t.tolist() for t in mine_with_items(*args)), strict=True))
    assert mined == brute_force(*args) and mined
    # a clip's own item (the anchor itself included) is never its positive
    assert all(items[a] != ref_items[p] for a, p, _ in mined)


@pytest.mark.parametrize("miner", MINERS)
def test_an_empty_memory_gives_the_in_batch_loss(miner):
    emb, classes, _ = batch(2, rows=12)
    items = torch.arange(12)  # one clip per item, as the m-per-class sampler draws them
    plain = build_loss(load_config(None, [f"loss.miner={miner}", f"loss.margin={MARGIN}"]))
    cfg = load_config(None, [f"loss.miner={miner}", f"loss.margin={MARGIN}",
                             "loss.memory_size=32", "loss.memory_warmup_epochs=0"])  # fmt: skip
    memory = build_loss(cfg, items=items.numpy())
    for loss in (plain, memory):
        loss.set_epoch(0)
    expected, stats = plain.with_stats(emb, classes)
    got, memory_stats = memory.with_stats(emb, classes, items=items)
    assert stats["triplets"] > 0 and memory_stats["triplets"] == stats["triplets"]
    torch.testing.assert_close(got, expected)
    assert len(memory.memory) == 12  # the batch was queued
    # the next batch mines against it too: another loss than its own alone
    second = batch(5, rows=12)[:2]
    again, _ = memory.with_stats(*second, items=items + 100)
    assert abs(float(again) - float(plain.with_stats(*second)[0])) > 1e-4


def test_the_memory_waits_for_its_warm_up_epochs():
    cfg = load_config(None, ["loss.memory_size=8", "loss.memory_warmup_epochs=2"])
    loss = build_loss(cfg, items=torch.arange(12).numpy())
    emb, classes, _ = batch(3, rows=4)
    for epoch in range(3):
        loss.set_epoch(epoch)
        loss.objective((emb, None), classes, torch.arange(4))
        assert len(loss.memory) == (4 if epoch == 2 else 0)


def test_the_queue_keeps_the_newest_rows_and_skips_non_finite_batches():
    memory = CrossBatchMemory(5)
    emb = torch.arange(12.0).reshape(6, 2)
    memory.enqueue(emb[:3], torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]))
    memory.enqueue(emb[3:], torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5]))
    assert sorted(memory.classes.tolist()) == [1, 2, 3, 4, 5] and int(memory.pointer) == 1
    bad = torch.full((2, 2), float("nan"))
    memory.enqueue(bad, torch.tensor([7, 7]), torch.tensor([7, 7]))
    assert 7 not in memory.classes.tolist()
    refs, ref_classes, _ = memory.references(emb[:1], torch.tensor([9]), torch.tensor([9]))
    assert ref_classes[0] == 9 and len(refs) == 6  # the batch first, then the 5 queued
    restored = CrossBatchMemory(5)  # a fresh one, as at resume, whose width is not known yet
    restored.load_state_dict(memory.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(),
                                                  memory.state_dict().values()))  # fmt: skip


def test_the_memory_needs_the_rows_items():
    cfg = load_config(None, ["loss.memory_size=8", "loss.memory_warmup_epochs=0"])
    loss = build_loss(cfg)
    loss.set_epoch(0)
    emb, classes, _ = batch(4, rows=4)
    with pytest.raises(ValueError, match="needs each row's item"):
        loss.with_stats(emb, classes)


@pytest.mark.slow
def test_a_run_with_the_memory_resumes_bit_exactly(tmp_path, tiny_demo):
    extra = ["loss.memory_size=24", "loss.memory_warmup_epochs=0", "train.epochs=2"]
    straight = fit(tiny_config(tiny_demo, tmp_path / "a", "cnn", *extra), digest_hooks())
    stopped = fit(tiny_config(tiny_demo, tmp_path / "b", "cnn", *extra), stop_at(3))
    assert stopped["stopped"]
    resumed = fit(
        tiny_config(tiny_demo, tmp_path / "b", "cnn", *extra, "checkpoint.resume=auto"),
        digest_hooks(),
    )
    assert resumed["parameters_sha256"] == straight["parameters_sha256"]
    a, b = (checkpoint.load(tmp_path / run / "t" / checkpoint.LAST) for run in ("a", "b"))
    assert int((a["loss_memory"]["classes"] >= 0).sum()) == 24  # full: it was in use
    for key, value in a["loss_memory"].items():
        assert torch.equal(value, b["loss_memory"][key]), key


# --------------------------------------------------------------------------------------------
# Host syncs: counted on the CPU as the operations that make the host wait for a GPU
# --------------------------------------------------------------------------------------------

ATEN = torch.ops.aten
READS = {ATEN._local_scalar_dense.default, ATEN.is_nonzero.default, ATEN.equal.default}
SIZED_BY_DATA = {ATEN.nonzero.default, ATEN.masked_select.default}
INDEXING = {ATEN.index.Tensor, ATEN.index_put_.default, ATEN.index_put.default}


class SyncingOps(TorchDispatchMode):
    """Counts reads of a value (item, bool, int), ops whose output size depends on the data
    (nonzero, masked_select) and boolean-mask indexing (a nonzero inside)."""

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masks = func in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
        )
        if func in READS or func in SIZED_BY_DATA or masks:
            self.counts[f"{func}{'[bool]' * masks}"] += 1
        return func(*args, **(kwargs or {}))


class CopiesToTheHost(TorchFunctionMode):
    """Counts .cpu(), .numpy() and .tolist(): copies to the host (no-ops on a CPU tensor)."""

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist):
            self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def host_syncs():
    """A Counter of what in the block would make the host wait for a GPU."""
    counts = Counter()
    with CopiesToTheHost(counts), SyncingOps(counts):
        yield counts


def memory_loss(miner: str, size: int = 32):
    cfg = ["loss.memory_warmup_epochs=0", f"loss.memory_size={size}", f"loss.miner={miner}"]
    loss = build_loss(load_config(None, cfg), items=torch.arange(100).numpy() // 2)
    loss.set_epoch(0)
    return loss


def test_the_objective_adds_no_host_sync_to_its_terms_without_the_memory():
    # It copied the rows' positions to the host to look their items up on every step, which
    # only the memory reads.
    loss = memory_loss("semi_hard", size=0)
    emb, classes, _ = batch(0, rows=12)
    with host_syncs() as terms:
        loss.with_stats(emb, classes, stats=False)
    with host_syncs() as objective:
        loss.objective((emb, None), classes, torch.arange(12))
    assert objective == terms


@pytest.mark.parametrize("miner, mining", [("batch_hard", 1), ("semi_hard", 2), ("all", 2)])
def test_a_step_with_the_memory_syncs_only_where_the_mining_needs_it(miner, mining):
    # The queue's empty slots (class -1) go to the miner, the finite check stays on the
    # device, the item table lives on the device and one process gathers nothing: what is left
    # is the mining's torch.nonzero calls and pytorch-metric-learning's reducer (a boolean
    # index). It was 11-12 with the memory (5 reads, 4 boolean indexes, a copy to the host).
    loss = memory_loss(miner)
    for step in range(3):
        emb, classes, _ = batch(step, rows=12)
        with host_syncs() as syncs:
            loss.objective((emb, None), classes, torch.arange(12) + 12 * step)
    assert len(loss.memory) == 32  # a full queue, mined against
    assert syncs == Counter({"aten.nonzero.default": mining, "aten.index.Tensor[bool]": 1})
    memory, (emb, classes, items) = loss.memory, batch(5, rows=12)
    with host_syncs() as syncs:
        memory.references(emb, classes, items)
        memory.enqueue(emb, classes, items)
        memory.enqueue(emb * float("nan"), classes, items)  # not queued, decided on the device
        gather_global(emb, classes, items)
    assert syncs == Counter()
