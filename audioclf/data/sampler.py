"""Distributed m-per-class batch sampler for triplet training (pure numpy).

Batches are drawn hierarchically, class -> item -> id: a batch holds `batch_size / m` distinct
classes, `m` distinct items (recordings) of each class, and one id (dataset row) drawn uniformly
from each chosen item. Rank and world size are constructor arguments: this module never talks to
`torch.distributed`, yet every rank computes the same batch count from the shared plan, so DDP
never waits on a rank that ran out of batches.

Use it as `DataLoader(dataset, batch_sampler=MPerClassSampler(...))` and call `set_epoch(epoch)`
before each epoch, as with `DistributedSampler`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

SPLITS = ("classes", "batches")
SMALL_CLASS_POLICIES = ("replace", "skip")
STATE_KEYS = (
    "epoch",
    "position",
    "seed",
    "world_size",
    "rank",
    "batch_size",
    "m",
    "split",
    "small_classes",
    "num_rows",
)
# Settings that change which batches an epoch yields; a resumed state must match them. `rank` is
# not among them: every rank has the same epoch and position, so rank 0's state serves all ranks.
_MUST_MATCH = ("seed", "world_size", "batch_size", "m", "split", "small_classes", "num_rows")

# One tag per random stream. SeedSequence pads entropy with zeros, so [seed, epoch] and
# [seed, epoch, 0] would be the same stream; non-zero tags keep the purposes apart.
_SHARE_TAG, _RANK_TAG, _GLOBAL_TAG, _VIEW_TAG = 1, 2, 3, 4


@dataclass(frozen=True)
class _EpochPlan:
    epoch: int
    classes: np.ndarray  # class codes this rank draws from
    batches: int  # batches every rank yields this epoch


class MPerClassSampler:
    """Yields batches (lists of dataset row positions) of `batch_size / m` classes x `m` items.

    Args:
        classes, items: 1-D array-likes of length N; row i has class `classes[i]` and item
            `items[i]`. An item names a recording within its class, so the same item value under
            two classes is two different items. Values may be ints or strings.
        batch_size: rows per batch on this rank; a multiple of `m`.
        m: items per class in a batch (>= 2, so every anchor has a positive).
        rank, world_size: this process's place in the DDP group.
        seed: base seed; the stream depends only on (seed, epoch, rank, world_size).
        split: "classes" gives each rank a disjoint share of the classes per epoch; "batches"
            deals one global stream of batches over all classes round-robin to the ranks.
        small_classes: for classes with fewer than `m` items, "replace" draws their items with
            replacement and "skip" leaves them out of sampling altogether.

    Length rule (identical on every rank, computed without any collective):
        - split="classes": each epoch the classes are shuffled with a generator seeded by
          (seed, epoch) and dealt greedily, in that order, to the share with the fewest samples so
          far (while making sure every share gets `batch_size / m` classes). Every rank yields
          `floor(min over shares of share_samples / batch_size)` batches.
        - split="batches": every rank yields `floor(N / batch_size) // world_size` batches, where
          N counts the rows that can be sampled (rows of skipped classes excluded); the global
          batches left over after the last whole round are dropped.
    `len(sampler)` is that count minus the resume position (see `load_state_dict`).

    Within a rank-epoch in "classes" mode the classes cycle: the stream walks through a
    permutation of the share, `batch_size / m` classes per batch, and takes a fresh permutation
    only when every class of the share has been used. The m rows of a class are adjacent in a
    batch: rows [k * m, (k + 1) * m) share a class.
    """

    def __init__(
        self,
        classes,
        items,
        *,
        batch_size: int,
        m: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        split: str = "classes",
        small_classes: str = "replace",
    ) -> None:
        _check_choice("split", split, SPLITS)
        _check_choice("small_classes", small_classes, SMALL_CLASS_POLICIES)
        self.batch_size = _check_int("batch_size", batch_size, minimum=1)
        self.m = _check_int("m", m, minimum=1)
        if self.m < 2:
            raise ValueError(
                f"m={m}: triplet loss needs at least 2 items per class in a batch so every anchor "
                f"has a positive; set m >= 2"
            )
        if self.batch_size % self.m:
            raise ValueError(
                f"batch_size={batch_size} is not divisible by m={m}; a batch is "
                f"(batch_size / m) classes x m items, so pick e.g. batch_size="
                f"{(self.batch_size // self.m + 1) * self.m} or an m that divides {batch_size}"
            )
        self.world_size = _check_int("world_size", world_size, minimum=1)
        self.rank = _check_int("rank", rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank={rank} is not in [0, world_size={world_size}); pass the process's global "
                f"rank"
            )
        self.seed = _check_int("seed", seed, minimum=0)
        self.split = split
        self.small_classes = small_classes
        self.classes_per_batch = self.batch_size // self.m

        class_values, item_values = _as_column("classes", classes), _as_column("items", items)
        if len(class_values) != len(item_values):
            raise ValueError(
                f"classes has {len(class_values)} rows but items has {len(item_values)}; pass one "
                f"class and one item per dataset row"
            )
        if len(class_values) == 0:
            raise ValueError("the index is empty (0 rows); the sampler needs at least one row")
        self.num_rows = len(class_values)
        self.classes, self.items = class_values, item_values  # the rows, as given
        self._build_layout(class_values, item_values)

        self._start_position = 0
        self._plan = self._make_plan(0)

    def over(self, classes, items) -> MPerClassSampler:
        """A sampler with these settings (batch size, m, rank, seed, ...) over other rows, at
        epoch 0."""
        return MPerClassSampler(
            classes,
            items,
            batch_size=self.batch_size,
            m=self.m,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            split=self.split,
            small_classes=self.small_classes,
        )

    def _build_layout(self, class_values: np.ndarray, item_values: np.ndarray) -> None:
        """Dense codes and CSR layouts: rows grouped by item, items grouped by class."""
        self._class_names, row_class = _dense_codes("classes", class_values)
        item_names, row_item_name = _dense_codes("items", item_values)
        # An item is the (class, item) pair; sorting by this key keeps each class's items adjacent.
        pair = row_class.astype(np.int64) * len(item_names) + row_item_name
        pairs, row_item = np.unique(pair, return_inverse=True)
        row_item = row_item.reshape(-1)
        n_classes = len(self._class_names)

        self._rows_by_item = np.argsort(row_item, kind="stable")
        self._item_row_start = _offsets(np.bincount(row_item, minlength=len(pairs)))
        self._items_per_class = np.bincount(pairs // len(item_names), minlength=n_classes)
        self._class_item_start = _offsets(self._items_per_class)
        self._samples_per_class = np.bincount(row_class, minlength=n_classes)

        if self.small_classes == "skip":
            self._active_classes = np.flatnonzero(self._items_per_class >= self.m)
            if len(self._active_classes) == 0:
                raise ValueError(
                    f"every class has fewer than m={self.m} items (largest has "
                    f"{self._items_per_class.max()}), so small_classes='skip' leaves nothing to "
                    f"sample; use a smaller m or small_classes='replace'"
                )
        else:
            self._active_classes = np.arange(n_classes)

    # ----------------------------------------------------------------------------- epoch plan

    def _make_plan(self, epoch: int) -> _EpochPlan:
        """This rank's classes and the batch count all ranks share; raises if the epoch is empty."""
        per_batch, batch_size = self.classes_per_batch, self.batch_size
        if self.split == "batches":
            classes = self._active_classes
            if len(classes) < per_batch:
                raise ValueError(
                    f"batch_size / m = {batch_size} / {self.m} = {per_batch} classes per batch, "
                    f"but only {len(classes)} classes can be sampled; use a smaller batch_size or "
                    f"a larger m"
                )
            samples = int(self._samples_per_class[classes].sum())
            batches = samples // batch_size // self.world_size
            if batches == 0:
                raise ValueError(
                    f"epoch {epoch} would yield 0 batches: {samples} sampleable rows make "
                    f"{samples // batch_size} global batches of {batch_size}, fewer than "
                    f"world_size={self.world_size}; use a smaller batch_size or fewer ranks"
                )
            return _EpochPlan(epoch, classes, batches)

        n_classes = len(self._active_classes)
        if n_classes < per_batch * self.world_size:
            raise ValueError(
                f"batch_size / m = {batch_size} / {self.m} = {per_batch} classes per batch, but "
                f"{n_classes} classes split over world_size={self.world_size} ranks leave a rank "
                f"only {n_classes // self.world_size} classes (split='classes' needs "
                f"{per_batch} x {self.world_size} = {per_batch * self.world_size}); use fewer "
                f"ranks, a smaller batch_size, or split='batches'"
            )
        shares = self._class_shares(epoch)
        share_samples = [int(self._samples_per_class[share].sum()) for share in shares]
        batches = min(share_samples) // batch_size
        if batches == 0:
            poorest = int(np.argmin(share_samples))
            raise ValueError(
                f"epoch {epoch} would yield 0 batches: rank {poorest}'s class share has only "
                f"{share_samples[poorest]} rows, fewer than batch_size={batch_size}, and every "
                f"rank yields floor(min share rows / batch_size) batches; use a smaller "
                f"batch_size, fewer ranks, or split='batches'"
            )
        return _EpochPlan(epoch, shares[self.rank], batches)

    def _class_shares(self, epoch: int) -> list[np.ndarray]:
        """Disjoint class shares, one per rank, balanced by sample count; same on every rank.

        Classes go, in shuffled order, to the share with the fewest samples so far, except that
        once the classes left are just enough to give every share `batch_size / m` classes, they
        go only to shares still short of that, so every share can fill a batch in every epoch.
        """
        order = _rng(self.seed, epoch, _SHARE_TAG).permutation(self._active_classes)
        shares = range(self.world_size)
        loads = [0] * self.world_size
        lacking = [self.classes_per_batch] * self.world_size  # classes a share lacks for a batch
        total_lacking = sum(lacking)
        owners = []
        for left, samples in zip(range(len(order), 0, -1), self._samples_per_class[order].tolist()):
            candidates = shares if left > total_lacking else [s for s in shares if lacking[s]]
            owner = min(candidates, key=loads.__getitem__)
            owners.append(owner)
            loads[owner] += samples
            if lacking[owner]:
                lacking[owner] -= 1
                total_lacking -= 1
        owners = np.asarray(owners)
        return [order[owners == rank] for rank in range(self.world_size)]

    # ----------------------------------------------------------------------------- drawing

    def _epoch_rows(self, plan: _EpochPlan) -> np.ndarray:
        """Row positions of every batch this rank yields in the plan's epoch, shape (batches, B)."""
        if self.split == "classes":
            rng = _rng(self.seed, plan.epoch, _RANK_TAG, self.rank)
            stream = _cycle_classes(rng, plan.classes, plan.batches, self.classes_per_batch)
            return self._draw_rows(rng, stream).reshape(plan.batches, self.batch_size)
        # One global stream whose length does not depend on world_size, dealt round-robin, so the
        # ranks together yield exactly the batches a single process would (up to the last round).
        rng = _rng(self.seed, plan.epoch, _GLOBAL_TAG)
        global_batches = int(self._samples_per_class[plan.classes].sum()) // self.batch_size
        stream = _cycle_classes(rng, plan.classes, global_batches, self.classes_per_batch)
        rows = self._draw_rows(rng, stream).reshape(global_batches, self.batch_size)
        return rows[self.rank :: self.world_size][: plan.batches]

    def _draw_rows(self, rng: np.random.Generator, class_stream: np.ndarray) -> np.ndarray:
        """For each class in the stream, m items (distinct when it has m) and one row from each."""
        items_available = self._items_per_class[class_stream]
        local_items = _choose_items(rng.random((len(class_stream), self.m)), items_available)
        items = self._class_item_start[class_stream, None] + local_items
        first_row = self._item_row_start[items]
        rows_in_item = self._item_row_start[items + 1] - first_row
        # min() guards the one-in-2**53 case where u * n rounds up to n.
        offset = (rng.random(items.shape) * rows_in_item).astype(np.int64)
        offset = np.minimum(offset, rows_in_item - 1)
        return self._rows_by_item[first_row + offset]

    # ----------------------------------------------------------------------------- public API

    @property
    def epoch(self) -> int:
        return self._plan.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next `__iter__` yields.

        A resume position loaded by `load_state_dict` survives `set_epoch` of the same epoch, so
        the usual loop (load, then `set_epoch(epoch)` before iterating) resumes mid-epoch.
        """
        epoch = _check_int("epoch", epoch, minimum=0)
        if epoch != self._plan.epoch:
            self._plan = self._make_plan(epoch)
            self._start_position = 0

    @property
    def batches_per_epoch(self) -> int:
        """Batches in a full pass of the current epoch; equal on every rank."""
        return self._plan.batches

    @property
    def rank_classes(self) -> np.ndarray:
        """Sorted class values this rank draws from in the current epoch."""
        return self._class_names[np.sort(self._plan.classes)]

    def __len__(self) -> int:
        return self._plan.batches - self._start_position

    def __iter__(self) -> Iterator[list[int]]:
        # The resume position applies to this one pass; the next pass starts from batch 0.
        start, self._start_position = self._start_position, 0
        return iter(self._epoch_rows(self._plan)[start:].tolist())

    def state_dict(self, position: int = 0) -> dict:
        """The resume point: `position` = batches of the current epoch the caller consumed.

        The caller counts batches because DataLoader prefetching runs ahead of this sampler.
        """
        position = _check_position(position, self._plan)
        state = {key: getattr(self, key) for key in _MUST_MATCH}
        state.update(epoch=self.epoch, position=position, rank=self.rank)
        return {key: state[key] for key in STATE_KEYS}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next `__iter__` yields the batches of `state["epoch"]` after `position`."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; pass a dict from state_dict()")
        mismatched = [
            f"{key}: saved {state[key]!r}, now {getattr(self, key)!r}"
            for key in _MUST_MATCH
            if state[key] != getattr(self, key)
        ]
        if mismatched:
            raise ValueError(
                "sampler state was saved with different settings, so the resumed epoch would not "
                f"continue the saved one ({'; '.join(mismatched)}); resume with the saved "
                "settings or start the epoch afresh"
            )
        plan = self._make_plan(_check_int("epoch", state["epoch"], minimum=0))
        self._start_position = _check_position(state["position"], plan)
        self._plan = plan


class MixedBatchSampler:
    """Batches of labelled classes (with pseudo-classes) followed by views of unlabelled clips.

    Dataset positions: [0, L) are the L labelled rows (those of `labelled`, an MPerClassSampler
    over them); [L, L + U) the U unlabelled clips as members of their pseudo-class (one crop,
    the triplet term's); and [L + U, L + 2U) the same clips as views (the NT-Xent term's). A
    batch holds `labelled.batch_size` rows drawn class -> item -> id by a sampler with
    `labelled`'s settings over the labelled rows plus the clips of the pseudo-classes
    (`set_pseudo_labels`; each clip its own item, so a pseudo-class gives m distinct clips),
    then `clips_per_batch` clips twice each, adjacent: the two views differ by their slot's crop
    seed (loader.SeededBatches).

    The batch count is the labelled sampler's (equal on every rank). The views' clips are this
    rank's share (every world_size-th clip) walked in permutations seeded by (seed, epoch, rank),
    a stream of its own: with no pseudo-labels the labelled rows are exactly those `labelled`
    draws.
    """

    def __init__(self, labelled: MPerClassSampler, n_clips: int, *, clips_per_batch: int) -> None:
        self.labelled = labelled
        self.classes, self.items = labelled.classes, labelled.items
        self.n_labelled = len(self.classes)
        self.n_clips = _check_int("n_clips", n_clips, minimum=1)
        self.clips_per_batch = _check_int("clips_per_batch", clips_per_batch, minimum=1)
        rank, world_size = labelled.rank, labelled.world_size
        self.rank, self.world_size, self.seed = rank, world_size, labelled.seed
        self._shard = np.arange(rank, n_clips, world_size)
        if n_clips // world_size < clips_per_batch:  # the smallest rank's share
            raise ValueError(
                f"{n_clips} unlabelled clips over {world_size} rank(s) leave a rank fewer than "
                f"the {clips_per_batch} clips a batch takes (unlabelled.share); add unlabelled "
                "audio or lower unlabelled.share"
            )
        self.pseudo_labels = np.full(n_clips, -1, dtype=np.int64)
        self._positions = np.arange(self.n_labelled)

    @property
    def batch_size(self) -> int:
        """Rows of a full batch: the labelled part and two views of every clip."""
        return self.labelled.batch_size + 2 * self.clips_per_batch

    def set_pseudo_labels(self, labels: np.ndarray) -> None:
        """Each clip's pseudo-class (-1: none); the clips of a class join the labelled part's
        draw as one class, each clip its own item. The current epoch starts again from its
        first batch (call it before the epoch's iteration, or before `load_state_dict`)."""
        labels = np.asarray(labels, dtype=np.int64)
        if labels.shape != (self.n_clips,):
            raise ValueError(
                f"pseudo labels need one per clip ({self.n_clips}), got {labels.shape}"
            )
        epoch = self.epoch
        kept = np.flatnonzero(labels >= 0)
        classes, items = self.classes, self.items
        if len(kept):  # values after every labelled one: sorting keeps the labelled codes
            classes = np.concatenate([classes, classes.max() + 1 + labels[kept]])
            items = np.concatenate([items, items.max() + 1 + kept])
        self.labelled = self.labelled.over(classes, items)
        self.labelled.set_epoch(epoch)
        self.pseudo_labels = labels.copy()
        self._positions = np.concatenate([np.arange(self.n_labelled), self.n_labelled + kept])

    @property
    def epoch(self) -> int:
        return self.labelled.epoch

    def set_epoch(self, epoch: int) -> None:
        self.labelled.set_epoch(epoch)

    @property
    def batches_per_epoch(self) -> int:
        return self.labelled.batches_per_epoch

    def __len__(self) -> int:
        return len(self.labelled)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.labelled.batches_per_epoch - len(self.labelled)
        rows = np.asarray(list(self.labelled), dtype=np.int64).reshape(-1, self.labelled.batch_size)
        views = self._epoch_views()[start:]
        batches = np.concatenate([self._positions[rows], np.repeat(views, 2, axis=1)], axis=1)
        return iter(batches.tolist())

    def _epoch_views(self) -> np.ndarray:
        """View positions of every batch of the epoch, shape (batches, clips_per_batch)."""
        plan_batches, per_batch = self.batches_per_epoch, self.clips_per_batch
        rng = _rng(self.seed, self.epoch, _VIEW_TAG, self.rank)
        clips = _cycle_classes(rng, self._shard, plan_batches, per_batch)
        return (self.n_labelled + self.n_clips + clips).reshape(plan_batches, per_batch)

    def state_dict(self, position: int = 0) -> dict:
        """The labelled sampler's resume point, and the unlabelled layout it belongs to."""
        state = self.labelled.state_dict(position)
        return {**state, "unlabelled_clips": self.n_clips, "clips_per_batch": self.clips_per_batch}

    def load_state_dict(self, state: dict) -> None:
        """Resume (after the pseudo-labels of the saved run were set: they change the draw)."""
        saved = (state.get("unlabelled_clips"), state.get("clips_per_batch"))
        if saved != (self.n_clips, self.clips_per_batch):
            raise ValueError(
                f"sampler state was saved with {saved[0]} unlabelled clips, {saved[1]} per "
                f"batch; now {self.n_clips}, {self.clips_per_batch} (data.unlabelled, "
                "unlabelled.share)"
            )
        self.labelled.load_state_dict(state)


# --------------------------------------------------------------------------------- helpers


def _cycle_classes(
    rng: np.random.Generator, classes: np.ndarray, batches: int, per_batch: int
) -> np.ndarray:
    """`batches * per_batch` classes: whole permutations of `classes` back to back.

    Every class appears once per permutation, so none repeats before all were used. A batch that
    straddles two permutations could hold a class twice; such classes at the head of the new
    permutation are swapped with later, non-clashing ones of that permutation.
    """
    n_classes, length = len(classes), batches * per_batch
    n_permutations = -(-length // n_classes)
    stream = rng.permuted(np.tile(classes, (n_permutations, 1)), axis=1).reshape(-1)
    for start in range(n_classes, length, n_classes):
        carried = start % per_batch  # classes the straddling batch takes from the old permutation
        if carried == 0:
            continue
        head_end = start + per_batch - carried
        # Python sets: these slices hold fewer than per_batch classes, too few for numpy to pay.
        previous = set(stream[start - carried : start].tolist())
        head = stream[start:head_end].tolist()
        clashes = [start + i for i, code in enumerate(head) if code in previous]
        if clashes:
            free = ~np.isin(stream[head_end : start + n_classes], list(previous))
            swaps = head_end + np.flatnonzero(free)[: len(clashes)]
            stream[clashes], stream[swaps] = stream[swaps], stream[clashes]
    return stream[:length]


def _choose_items(uniform: np.ndarray, items_available: np.ndarray) -> np.ndarray:
    """Per row, m item indices in [0, n): distinct when n >= m (Floyd), with replacement otherwise.

    `uniform` holds one U[0, 1) draw per pick, shape (rows, m).
    """
    m = uniform.shape[1]
    chosen = np.empty(uniform.shape, dtype=np.int64)
    for k in range(m):
        # Floyd's algorithm: pick in [0, top]; if that is taken, take top, which no earlier step
        # could have picked.
        top = items_available - m + k
        pick = np.minimum((uniform[:, k] * (top + 1)).astype(np.int64), top)
        taken = (chosen[:, :k] == pick[:, None]).any(axis=1)
        chosen[:, k] = np.where(taken, top, pick)
    small = items_available < m
    if small.any():
        n = items_available[small, None]
        chosen[small] = np.minimum((uniform[small] * n).astype(np.int64), n - 1)
    return chosen


def _check_position(position: int, plan: _EpochPlan) -> int:
    position = _check_int("position", position, minimum=0)
    if position > plan.batches:
        raise ValueError(
            f"position={position} is past the end of epoch {plan.epoch}, which has "
            f"{plan.batches} batches; pass the number of batches consumed this epoch"
        )
    return position


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _as_column(name: str, values) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one value per dataset row), got shape {array.shape}")
    return array


def _dense_codes(name: str, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique values and each row's code; sorting keeps codes independent of hashing."""
    try:
        names, codes = np.unique(values, return_inverse=True)
    except TypeError as error:
        raise ValueError(
            f"{name} mixes values that cannot be sorted together ({error}); make them all str or "
            f"all int"
        ) from None
    return names, codes.reshape(-1)


def _check_int(name: str, value, *, minimum: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name}={number} must be >= {minimum}")
    return number


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
