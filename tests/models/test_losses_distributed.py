"""In a real 2-process gloo group: the cross-rank triplet loss, and the NT-Xent term over
unlabelled views, and their DDP gradients equal the single-process loss and gradients on the
concatenated batch; a margin head's class weights (inside the DDP-wrapped model) get the
all-reduced gradient and stay identical across ranks, also when one rank's batch has no rows."""

import pytest
import torch
import torch.nn.functional as F

from audioclf.config import LossConfig
from audioclf.losses import TripletLoss, build_loss
from audioclf.losses.unlabelled import ViewsLoss
from tests.helpers import run_in_group

pytestmark = pytest.mark.slow  # every test here starts processes

WORLD = 2
MINERS = ["batch_hard", "semi_hard", "all"]
SPLITS = {"equal": 6, "unequal": 8}  # items on rank 0 out of 12; rank 1 holds the rest
VIEW_SPLITS = {**SPLITS, "rank 1 without views": 12}


def fixed_batch():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(12, 5, generator=generator)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 3, 3, 0, 1, 2, 3])
    return x, labels


def fresh_model():
    torch.manual_seed(3)
    return torch.nn.Linear(5, 4)


def loss_and_grads(model, x, labels, miner, cross_rank):
    loss, stats = TripletLoss(
        LossConfig(margin=0.3, miner=miner, cross_rank=cross_rank)
    ).with_stats(F.normalize(model(x), dim=1), labels)
    loss.backward()
    return loss.item(), stats["triplets"], [p.grad.clone() for p in model.parameters()]


def views_loss_and_grads(model, x, clips):
    loss = ViewsLoss(temperature=0.1)(F.normalize(model(x), dim=1), clips)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def fixed_views():
    """Two views of each of six clips, a clip's views side by side (as MixedBatchSampler puts
    them in one rank's batch)."""
    x, _ = fixed_batch()
    return x, torch.arange(6).repeat_interleave(2) + 100


def _cross_rank_results(rank, world_size):
    """{(split, miner): (loss, triplets, grads)} of each rank's half of the fixed batch, and
    {(split, "views"): (loss, grads)} of its half of the fixed views."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    x, labels = fixed_batch()
    results = {}
    for split, first in SPLITS.items():
        part = slice(0, first) if rank == 0 else slice(first, None)
        for miner in MINERS:
            model = DistributedDataParallel(fresh_model())
            results[split, miner] = loss_and_grads(model, x[part], labels[part], miner, True)
    views, clips = fixed_views()
    for split, first in VIEW_SPLITS.items():
        part = slice(0, first) if rank == 0 else slice(first, None)
        model = DistributedDataParallel(fresh_model())
        results[split, "views"] = views_loss_and_grads(model, views[part], clips[part])
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    # run_in_group judges the ranks by the results they hand back. Under mp.spawn the exit
    # code also counted, and a gloo rank sometimes aborts at interpreter exit, after its work
    # and destroy_process_group ("terminate called without an active exception", no Python
    # frame; 2 in 40 runs here, never seen under torchrun).
    return run_in_group(_cross_rank_results, tmp_path_factory.mktemp("ranks"), world_size=WORLD)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("miner", MINERS)
def test_cross_rank_loss_and_grads_equal_single_process(rank_results, miner, split):
    x, labels = fixed_batch()
    loss, triplets, grads = loss_and_grads(fresh_model(), x, labels, miner, cross_rank=False)
    assert triplets > 0  # the comparison is not vacuous
    for rank, results in enumerate(rank_results):
        rank_loss, rank_triplets, rank_grads = results[split, miner]
        assert rank_triplets == triplets, f"rank {rank} mined another set of triplets"
        assert rank_loss == pytest.approx(loss, abs=1e-5)
        for expected, got in zip(grads, rank_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("split", list(VIEW_SPLITS))
def test_views_loss_and_grads_are_those_of_every_ranks_views_in_one_process(rank_results, split):
    x, clips = fixed_views()
    loss, grads = views_loss_and_grads(fresh_model(), x, clips)
    half_loss, half_grads = views_loss_and_grads(fresh_model(), x[:6], clips[:6])
    assert abs(half_loss - loss) > 1e-3 and (half_grads[0] - grads[0]).abs().max() > 1e-3
    for results in rank_results:
        rank_loss, rank_grads = results[split, "views"]
        assert rank_loss == pytest.approx(loss, abs=1e-5)
        for expected, got in zip(grads, rank_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_local_loss_differs_from_the_global_one():
    """Guards the comparison above: the halves alone do not give the global loss or gradient."""
    x, labels = fixed_batch()
    global_loss, _, global_grads = loss_and_grads(fresh_model(), x, labels, "all", cross_rank=False)
    half_loss, _, half_grads = loss_and_grads(
        fresh_model(), x[:6], labels[:6], "all", cross_rank=False
    )
    assert abs(half_loss - global_loss) > 1e-3
    assert (half_grads[0] - global_grads[0]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Margin heads under DDP: the class weights are the model's, so DDP all-reduces their gradient


HEAD_CLASSES = 4


def _margin_net(head):
    from audioclf.config import load_config
    from audioclf.models import build_net

    cfg = load_config(
        None,
        [
            "features.kind=npy",
            "features.n_mels=16",
            "spec_augment.enabled=false",
            "model.cnn.width=4",
            "model.cnn.depth=2",
            "model.cnn.dropout=0",
            "model.embedding_dim=8",
            f"model.head={head}",
            "loss.miner=all",
            "loss.margin_warmup_epochs=2",
        ],
    )
    torch.manual_seed(11)
    return build_net(cfg, HEAD_CLASSES), cfg


def _margin_batch(rank, step):
    """Each rank's own rows (8 on rank 0; on rank 1 6, then none: an unreadable batch)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    rows = 8 if rank == 0 else (6 if step == 0 else 0)
    labels = torch.arange(rows) % HEAD_CLASSES
    return torch.randn(rows, 20, 16, generator=generator), torch.full((rows,), 20), labels


def _local_head_grads(head, rank, step, weights):
    """The head gradient one rank computes alone (no DDP) from the given weights."""
    net, cfg = _margin_net(head)
    net.load_state_dict(weights)
    loss_fn = build_loss(cfg)
    loss_fn.set_epoch(1)
    x, lengths, labels = _margin_batch(rank, step)
    if len(labels) == 0:
        return torch.zeros_like(net.head.linear.weight)
    embeddings, logits = net.train()(x, lengths)
    loss_fn(embeddings, labels, logits).backward()
    return net.head.linear.weight.grad.clone()


def _margin_head_steps(rank, world_size, heads):
    """{head: two SGD steps of a DDP-wrapped EmbeddingNet with that margin head} (each rank)."""
    torch.set_num_threads(1)
    return {head: _steps_with(head, rank) for head in heads}


def _steps_with(head, rank):
    from torch.nn.parallel import DistributedDataParallel

    from audioclf.training.step import (
        _empty_output,  # the training step's cut for a batch with no rows
    )

    net, cfg = _margin_net(head)
    model = DistributedDataParallel(net)
    loss_fn = build_loss(cfg)
    loss_fn.set_epoch(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    steps = []
    for step in range(2):
        before = {k: v.clone() for k, v in net.state_dict().items()}
        x, lengths, labels = _margin_batch(rank, step)
        if len(labels):
            output = model(x, lengths)
        else:  # as TrainStep: run a placeholder, keep no rows
            output = _empty_output(model(torch.randn(2, 20, 16), torch.tensor([20, 20])))
        optimizer.zero_grad()
        embeddings, logits = output
        loss_fn(embeddings, labels, logits).backward()
        grad = net.head.linear.weight.grad.clone()
        optimizer.step()
        steps.append(
            {"before": before, "grad": grad, "weight": net.head.linear.weight.detach().clone()}
        )
    return steps


MARGIN_HEADS = ["arcface", "subcenter_arcface"]


@pytest.fixture(scope="module")
def margin_rank_results(tmp_path_factory):
    return run_in_group(_margin_head_steps, tmp_path_factory.mktemp("margin"), MARGIN_HEADS)


@pytest.mark.parametrize("head", MARGIN_HEADS)
def test_margin_head_weights_are_all_reduced_and_stay_identical(margin_rank_results, head):
    for step in range(2):
        rank0, rank1 = (r[head][step] for r in margin_rank_results)
        assert torch.equal(rank0["grad"], rank1["grad"]), f"step {step}: head gradients differ"
        assert torch.equal(rank0["weight"], rank1["weight"]), f"step {step}: head weights drifted"
        assert not torch.equal(rank0["weight"], rank0["before"]["head.linear.weight"])
        # DDP's gradient is the mean of what each rank computes alone (rank 1 has no rows at
        # step 1), so each rank's own rows moved the head
        local = [_local_head_grads(head, r, step, rank0["before"]) for r in range(WORLD)]
        assert all(g.abs().sum() > 0 for g in local[: 2 - step])
        assert not torch.allclose(local[0], local[1])  # so equal DDP gradients mean all-reduced
        torch.testing.assert_close(rank0["grad"], sum(local) / WORLD, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Cross-batch memory under DDP: filled with the global batch, so every rank holds the same


def _memory_loss(cross_rank):
    from audioclf.config import load_config

    cfg = load_config(None, ["loss.miner=all", "loss.memory_size=20",
                             "loss.memory_warmup_epochs=0", f"loss.cross_rank={cross_rank}"])  # fmt: skip
    loss = build_loss(cfg, items=torch.arange(60).numpy())
    loss.set_epoch(0)
    return loss


def _memory_steps(rank, world_size):
    """{cross_rank: the memory's state after 3 steps on this rank's rows (7 + 5 of 12)}."""
    torch.set_num_threads(1)
    x, labels = fixed_batch()
    results = {}
    for cross_rank in (False, True):
        loss = _memory_loss(cross_rank)
        for step in range(3):
            rows = torch.arange(7) if rank == 0 else torch.arange(7, 12)
            emb = F.normalize(x[rows] + step, dim=1)
            loss.objective((emb, None), labels[rows], rows + 12 * step)
        results[cross_rank] = loss.memory.state_dict()
    return results


@pytest.mark.parametrize("cross_rank", [False, True])
def test_the_memory_is_the_same_on_every_rank_and_the_single_process_one(tmp_path, cross_rank):
    ranks = run_in_group(_memory_steps, tmp_path, world_size=WORLD)
    x, labels = fixed_batch()
    single = _memory_loss(False)
    for step in range(3):  # the global batch in rank order, in one process
        single.objective((F.normalize(x + step, dim=1), None), labels, torch.arange(12) + 12 * step)
    for rank, results in enumerate(ranks):
        for key, value in single.memory.state_dict().items():
            assert torch.allclose(results[cross_rank][key].float(), value.float(), atol=1e-6), (
                rank,
                key,
            )
