"""MPerClassSampler: batch structure, rank shares, determinism, resume, and input errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from audioclf.data.sampler import MPerClassSampler
from tests.helpers import ROOT

PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)


@dataclass
class Index:
    """A synthetic dataset index: one class and one item per row, rows in random order."""

    classes: np.ndarray
    items: np.ndarray

    @property
    def items_per_class(self) -> dict:
        seen = defaultdict(set)
        for cls, item in zip(self.classes.tolist(), self.items.tolist()):
            seen[cls].add(item)
        return {cls: len(items) for cls, items in seen.items()}


def make_index(
    layout_seed: int, n_classes: int, max_items: int, max_ids: int, names: bool
) -> Index:
    rng = np.random.default_rng(layout_seed)
    classes, items = [], []
    for cls in range(n_classes):
        for item in range(rng.integers(1, max_items + 1)):
            ids = rng.integers(1, max_ids + 1)
            # Item names repeat across classes: ("c1", "r0") and ("c2", "r0") are different items.
            classes += [f"c{cls}" if names else 7 * cls + 3] * ids
            items += [f"r{item}" if names else item] * ids
    order = rng.permutation(len(classes))
    return Index(np.asarray(classes)[order], np.asarray(items)[order])


@dataclass
class Setup:
    index: Index
    batch_size: int
    m: int
    world_size: int
    seed: int
    split: str
    small_classes: str

    def sampler(self, rank: int = 0, **overrides) -> MPerClassSampler:
        kwargs = dict(
            batch_size=self.batch_size,
            m=self.m,
            rank=rank,
            world_size=self.world_size,
            seed=self.seed,
            split=self.split,
            small_classes=self.small_classes,
        )
        kwargs.update(overrides)
        return MPerClassSampler(self.index.classes, self.index.items, **kwargs)

    def samplers(self) -> list[MPerClassSampler]:
        """One sampler per rank; index shapes a rank cannot serve are rejected, not failed."""
        with rejecting_unservable():
            return [self.sampler(rank) for rank in range(self.world_size)]


@contextmanager
def rejecting_unservable():
    """Turn the sampler's "this index cannot fill a batch" errors into Hypothesis rejections."""
    try:
        yield
    except ValueError as error:
        unservable = ("classes per batch", "0 batches", "leaves nothing to sample")
        if any(reason in str(error) for reason in unservable):
            reject()
        raise


@st.composite
def setups(draw, splits=("classes", "batches")) -> Setup:
    world_size = draw(st.integers(1, 4))
    m = draw(st.integers(2, 4))
    classes_per_batch = draw(st.integers(1, 3))
    fewest_classes = 2 * world_size * classes_per_batch
    n_classes = draw(st.integers(fewest_classes, fewest_classes + 10))
    index = make_index(
        draw(st.integers(0, 2**32 - 1)),
        n_classes,
        max_items=draw(st.integers(1, 8)),
        max_ids=draw(st.integers(1, 5)),
        names=draw(st.booleans()),
    )
    return Setup(
        index,
        classes_per_batch * m,
        m,
        world_size,
        seed=draw(st.integers(0, 2**32 - 1)),
        split=draw(st.sampled_from(splits)),
        small_classes=draw(st.sampled_from(["replace", "skip"])),
    )


def class_order(setup: Setup, batches: list[list[int]]) -> list:
    """The classes of each batch in drawing order (each class fills m consecutive rows)."""
    return [setup.index.classes[batch[:: setup.m]].tolist() for batch in batches]


# ----------------------------------------------------------------------------- properties


@PROPERTY_SETTINGS
@given(setups())
def test_every_rank_yields_equal_well_formed_batches(setup):
    samplers = setup.samplers()
    items_per_class = setup.index.items_per_class
    per_rank = [list(sampler) for sampler in samplers]

    counts = {len(batches) for batches in per_rank}
    assert counts == {samplers[0].batches_per_epoch}
    assert all(len(sampler) == samplers[0].batches_per_epoch for sampler in samplers)
    for batches in per_rank:
        for batch in batches:
            assert len(batch) == setup.batch_size
            n_rows = len(setup.index.classes)
            assert all(isinstance(row, int) and 0 <= row < n_rows for row in batch)
            groups = np.asarray(batch).reshape(-1, setup.m)
            group_classes = setup.index.classes[groups]
            assert (group_classes == group_classes[:, :1]).all(), "a group is one class"
            assert len(set(group_classes[:, 0].tolist())) == len(groups), "classes distinct"
            for cls, rows in zip(group_classes[:, 0].tolist(), groups):
                if items_per_class[cls] >= setup.m:
                    assert len(set(setup.index.items[rows].tolist())) == setup.m, "items distinct"
                if setup.small_classes == "skip":
                    assert items_per_class[cls] >= setup.m


@PROPERTY_SETTINGS
@given(setups(splits=("classes",)))
def test_class_shares_are_disjoint_and_cycle(setup):
    samplers = setup.samplers()
    items_per_class = setup.index.items_per_class
    keep_small = setup.small_classes == "replace"
    sampleable = {cls for cls, n in items_per_class.items() if keep_small or n >= setup.m}
    shares = [set(sampler.rank_classes.tolist()) for sampler in samplers]
    assert set().union(*shares) == sampleable
    assert sum(len(share) for share in shares) == len(sampleable), "shares overlap"

    for sampler, share in zip(samplers, shares):
        stream = [cls for batch in class_order(setup, list(sampler)) for cls in batch]
        assert set(stream) <= share
        # Each run of len(share) classes is one pass over the share: no class twice in a pass.
        for start in range(0, len(stream), len(share)):
            cycle = stream[start : start + len(share)]
            assert len(set(cycle)) == len(cycle)


@PROPERTY_SETTINGS
@given(setups(), st.integers(0, 3), st.data())
def test_resume_mid_epoch_continues_identically(setup, epoch, data):
    rank = data.draw(st.integers(0, setup.world_size - 1))
    original = setup.samplers()[rank]
    with rejecting_unservable():  # shares differ per epoch, so a tiny index may empty one
        original.set_epoch(epoch)
    full = list(original)
    position = data.draw(st.integers(0, len(full)))
    state = original.state_dict(position=position)

    resumed = setup.sampler(rank)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # the usual loop calls set_epoch after loading; position survives
    assert len(resumed) == len(full) - position
    assert list(resumed) == full[position:]
    assert len(resumed) == len(full), "the position applies to one pass only"
    assert list(resumed) == full


@PROPERTY_SETTINGS
@given(setups(splits=("batches",)))
def test_batches_split_deals_the_single_process_stream(setup):
    samplers = setup.samplers()
    single = list(setup.sampler(0, world_size=1))
    items_per_class = setup.index.items_per_class
    sampleable_rows = sum(
        setup.small_classes == "replace" or items_per_class[cls] >= setup.m
        for cls in setup.index.classes.tolist()
    )
    assert len(single) == sampleable_rows // setup.batch_size
    per_rank = len(single) // setup.world_size
    for rank, sampler in enumerate(samplers):
        assert len(sampler) == per_rank
        assert list(sampler) == single[rank :: setup.world_size][:per_rank]


# ----------------------------------------------------------------------------- fixed indices


@pytest.fixture
def index() -> Index:
    return make_index(7, n_classes=40, max_items=6, max_ids=6, names=True)


def test_same_epoch_reproduces_and_other_epochs_differ(index):
    def epoch_batches(epoch, seed=0):
        sampler = MPerClassSampler(
            index.classes, index.items, batch_size=8, m=2, world_size=2, seed=seed
        )
        sampler.set_epoch(epoch)
        return list(sampler)

    assert epoch_batches(3) == epoch_batches(3)
    assert epoch_batches(3) != epoch_batches(4)
    assert epoch_batches(3) != epoch_batches(3, seed=1)


def test_shares_change_between_epochs(index):
    sampler = MPerClassSampler(index.classes, index.items, batch_size=8, m=2, world_size=2)
    shares = set()
    for epoch in range(4):
        sampler.set_epoch(epoch)
        shares.add(tuple(sampler.rank_classes.tolist()))
    assert len(shares) > 1


def test_shares_are_balanced_by_row_count():
    # Class k has k + 1 rows: dealing classes by count alone would leave shares far apart.
    classes = np.repeat(np.arange(60), np.arange(1, 61))
    items = np.arange(len(classes)) % 2
    for world_size in (2, 3, 4):
        samplers = [
            MPerClassSampler(classes, items, batch_size=4, m=2, rank=rank, world_size=world_size)
            for rank in range(world_size)
        ]
        for epoch in range(5):
            share_rows = []
            for sampler in samplers:
                sampler.set_epoch(epoch)
                share_rows.append(np.isin(classes, sampler.rank_classes).sum())
            # Greedy dealing to the lightest share keeps shares within one class's size.
            assert max(share_rows) - min(share_rows) <= 60


def test_every_share_gets_enough_classes_despite_one_huge_class():
    # By row count alone the share holding the 1000-row class would take no other class.
    classes = np.repeat(["huge", "a", "b", "c"], [1000, 3, 3, 3])
    items = np.arange(len(classes)) % 3
    samplers = [
        MPerClassSampler(classes, items, batch_size=4, m=2, rank=rank, world_size=2)
        for rank in range(2)
    ]
    for epoch in range(20):
        for sampler in samplers:
            sampler.set_epoch(epoch)
            assert len(sampler.rank_classes) >= 2
            assert len(list(sampler)) == 1


def test_length_rule_matches_documented_formulas(index):
    batch_size, world_size = 8, 3
    samplers = [
        MPerClassSampler(
            index.classes,
            index.items,
            batch_size=batch_size,
            m=2,
            rank=rank,
            world_size=world_size,
        )
        for rank in range(world_size)
    ]
    share_rows = [np.isin(index.classes, s.rank_classes).sum() for s in samplers]
    assert {len(s) for s in samplers} == {min(share_rows) // batch_size}

    batches = MPerClassSampler(
        index.classes,
        index.items,
        batch_size=batch_size,
        m=2,
        world_size=world_size,
        split="batches",
    )
    assert len(batches) == len(index.classes) // batch_size // world_size


def test_small_classes_replace_draws_with_replacement_and_skip_excludes():
    # Class "solo" has one item of three rows; the others have four items each.
    classes = ["solo"] * 3 + [f"c{c}" for c in range(6) for _ in range(8)]
    items = ["only"] * 3 + [f"r{r}" for _ in range(6) for r in range(4) for _ in range(2)]
    replace = MPerClassSampler(classes, items, batch_size=6, m=3, small_classes="replace")
    skip = MPerClassSampler(classes, items, batch_size=6, m=3, small_classes="skip")
    assert "solo" in replace.rank_classes and "solo" not in skip.rank_classes
    solo_rows = {0, 1, 2}
    replaced = [batch for epoch in range(5) for batch in _epoch(replace, epoch)]
    assert any(set(batch) & solo_rows for batch in replaced)
    for batch in replaced:
        groups = [batch[i : i + 3] for i in range(0, 6, 3)]
        assert all(set(g) <= solo_rows or not set(g) & solo_rows for g in groups)
    assert not any(set(batch) & solo_rows for epoch in range(5) for batch in _epoch(skip, epoch))


def test_ids_are_uniform_within_an_item():
    # One class, items of 1, 2 and 5 rows; m=3 picks every item in every batch.
    classes = ["a"] * 8 + ["b"] * 8
    items = ["x", "y", "y", "z", "z", "z", "z", "z"] * 2
    sampler = MPerClassSampler(classes, items, batch_size=6, m=3)
    counts = Counter(
        row for epoch in range(2000) for batch in _epoch(sampler, epoch) for row in batch
    )
    draws_per_item = sum(counts[row] for row in range(8)) / 3
    for row, expected in enumerate([1, 1 / 2, 1 / 2] + [1 / 5] * 5):
        assert counts[row] == pytest.approx(draws_per_item * expected, rel=0.1)


def test_dataloader_yields_the_sampler_batches(index):
    sampler = MPerClassSampler(index.classes, index.items, batch_size=8, m=2, world_size=2, rank=1)
    dataset = TensorDataset(torch.arange(len(index.classes)))
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    sampler.set_epoch(2)
    expected = list(sampler)
    assert len(loader) == len(expected)
    assert [rows.tolist() for (rows,) in loader] == expected


@pytest.mark.slow
def test_output_does_not_depend_on_python_hash_seed():
    script = (
        "import json\n"
        "from audioclf.data.sampler import MPerClassSampler\n"
        "names = ['kick', 'snare', 'hat', 'tom', 'clap', 'ride', 'crash', 'cowbell']\n"
        "classes = [n for n in names for _ in range(12)]\n"
        "items = [f'take{i % 4}' for i in range(len(classes))]\n"
        "s = MPerClassSampler(classes, items, batch_size=6, m=2, world_size=2, rank=1, seed=5)\n"
        "s.set_epoch(1)\n"
        "print(json.dumps([list(s), s.rank_classes.tolist()]))\n"
    )
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    assert len(outputs[0][0]) > 0


# ----------------------------------------------------------------------------- errors


def _epoch(sampler: MPerClassSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def _sampler(classes=None, items=None, **kwargs) -> MPerClassSampler:
    classes = [f"c{c}" for c in range(8) for _ in range(6)] if classes is None else classes
    items = [i % 3 for i in range(len(classes))] if items is None else items
    kwargs = {"batch_size": 4, "m": 2, **kwargs}
    return MPerClassSampler(classes, items, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 8, "m": 3}, r"batch_size=8 is not divisible by m=3"),
        ({"batch_size": 4, "m": 1}, r"m=1: triplet loss needs at least 2"),
        ({"rank": 2, "world_size": 2}, r"rank=2 is not in \[0, world_size=2\)"),
        ({"rank": -1}, r"rank=-1 must be >= 0"),
        ({"split": "rows"}, r"split='rows' is not one of \['classes', 'batches'\]"),
        ({"small_classes": "drop"}, r"small_classes='drop' is not one of"),
        ({"seed": -3}, r"seed=-3 must be >= 0"),
        ({"batch_size": 2.5}, r"batch_size must be an integer"),
    ],
)
def test_bad_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _sampler(**kwargs)


def test_more_classes_per_batch_than_a_rank_has_names_the_fixes():
    # 8 classes over 4 ranks gives 2 per rank; a batch needs 3.
    message = r"3 classes per batch, but 8 classes .* world_size=4 .* only 2 classes .*fewer ranks"
    with pytest.raises(ValueError, match=message + r".*split='batches'"):
        _sampler(batch_size=6, m=2, world_size=4)
    with pytest.raises(ValueError, match=r"5 classes per batch, but only 4 classes can be sampled"):
        _sampler(classes=list("aabbccdd"), items=[0, 1] * 4, batch_size=10, m=2, split="batches")


def test_empty_index_raises():
    with pytest.raises(ValueError, match=r"index is empty"):
        _sampler(classes=[], items=[])


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match=r"classes has 3 rows but items has 2"):
        _sampler(classes=["a", "b", "c"], items=[0, 1])


def test_unsortable_or_2d_values_raise():
    with pytest.raises(ValueError, match=r"classes mixes values"):
        _sampler(classes=["a", None, "b", "b"], items=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"classes must be 1-D"):
        _sampler(classes=[["a", "b"]], items=[[0, 1]])


def test_epoch_without_a_batch_raises_and_says_why():
    # Four one-row classes: four rows cannot fill a batch of eight.
    message = r"0 batches: rank 0's class share has only 4 rows, fewer than batch_size=8"
    with pytest.raises(ValueError, match=message):
        _sampler(classes=list("abcd"), items=[0] * 4, batch_size=8, m=2)
    # Eight rows make one global batch of eight, fewer than the two ranks.
    message = r"0 batches: 8 sampleable rows make 1 global batches.*world_size=2"
    with pytest.raises(ValueError, match=message):
        _sampler(
            classes=list("aabbccdd"),
            items=[0, 1] * 4,
            batch_size=8,
            m=2,
            world_size=2,
            split="batches",
        )


def test_skip_with_no_large_class_raises():
    message = r"every class has fewer than m=4 items.*small_classes='replace'"
    with pytest.raises(ValueError, match=message):
        _sampler(m=4, batch_size=8, small_classes="skip")


def test_load_state_dict_rejects_other_settings():
    state = _sampler(seed=0).state_dict()
    for kwargs, message in [
        ({"seed": 1}, r"seed: saved 0, now 1"),
        ({"world_size": 2}, r"world_size: saved 1, now 2"),
        ({"batch_size": 6}, r"batch_size: saved 4, now 6"),
        ({"batch_size": 6, "m": 3}, r"m: saved 2, now 3"),
        ({"split": "batches"}, r"split: saved 'classes', now 'batches'"),
    ]:
        with pytest.raises(ValueError, match=message):
            _sampler(**kwargs).load_state_dict(state)
    with pytest.raises(ValueError, match=r"lacks \['seed'"):
        _sampler().load_state_dict({"epoch": 0, "position": 0})


def test_rank_zero_state_resumes_every_rank():
    rank0, rank1 = _sampler(world_size=2), _sampler(world_size=2, rank=1)
    rank1.set_epoch(2)
    full = list(rank1)
    rank0.set_epoch(2)
    rank1.load_state_dict(rank0.state_dict(position=3))
    assert list(rank1) == full[3:]


def test_position_past_the_epoch_raises():
    sampler = _sampler()
    message = rf"position={len(sampler) + 1} is past the end of epoch 0"
    with pytest.raises(ValueError, match=message):
        sampler.state_dict(position=len(sampler) + 1)
    state = sampler.state_dict()
    state["position"] = 10_000
    with pytest.raises(ValueError, match=r"position=10000 is past the end"):
        _sampler().load_state_dict(state)
