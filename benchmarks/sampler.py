"""Benchmark: audioclf's MPerClassSampler against a hand-written pandas sampler and pml's.

Run from the repository root:

    .venv/bin/python benchmarks/sampler.py            # 383k-row index, ~1-2 minutes
    .venv/bin/python benchmarks/sampler.py --quick    # small index, a few seconds (smoke check)

The index is synthetic and seeded: 8000 classes, 2-10 items per class, 1-15 ids per item, about
383k rows. Each sampler builds one epoch of one rank (world size 2, batch size 32, m = 4) as
batches of row positions. Printed: construction time, seconds per rank-epoch, the ratios
pandas / audioclf and pml / audioclf, and PASS/FAIL against the targets (<= 0.1 s per rank-epoch,
>= 150x faster than pandas). pytorch-metric-learning's sampler has no ranks or items: it gets the
flat class labels in one process and the rank's sample count as `length_before_new_iter`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

# Run as a script from anywhere: make the repository's package importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from audioclf.data.sampler import MPerClassSampler  # noqa: E402

WORLD_SIZE, BATCH_SIZE, M = 2, 32, 4
TARGET_EPOCH_S, TARGET_PANDAS_RATIO = 0.1, 150.0
PANDAS_FULL_EPOCH_LIMIT_S = 10.0


def synthetic_index(n_classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(classes, items) per row: 2-10 items per class, 1-15 ids per item, rows shuffled."""
    rng = np.random.default_rng(seed)
    items_per_class = rng.integers(2, 11, n_classes)
    item_class = np.repeat(np.arange(n_classes), items_per_class)
    # Items are numbered 0, 1, ... within each class, so item numbers repeat across classes.
    first_item_of_class = np.cumsum(items_per_class) - items_per_class
    item_number = np.arange(len(item_class)) - np.repeat(first_item_of_class, items_per_class)
    ids_per_item = rng.integers(1, 16, len(item_class))
    classes, items = np.repeat(item_class, ids_per_item), np.repeat(item_number, ids_per_item)
    order = rng.permutation(len(classes))
    return classes[order], items[order]


class PandasMPerClass:
    """The same semantics written the way users write it: group-by, per-class .loc, .sample."""

    def __init__(
        self,
        frame: pd.DataFrame,
        *,
        batch_size: int,
        m: int,
        rank: int,
        world_size: int,
        seed: int = 0,
    ):
        self.frame, self.batch_size, self.m = frame, batch_size, m
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.rows_of_class = frame.groupby("class").groups
        self.class_sizes = frame.groupby("class").size()

    def start_epoch(self, epoch: int) -> int:
        """Deal this epoch's class shares; return the batch count every rank yields."""
        epoch_rng = np.random.default_rng([self.seed, epoch])
        shuffled = self.class_sizes.sample(frac=1, random_state=epoch_rng)
        loads = [0] * self.world_size
        owner = {}
        for cls, size in shuffled.items():
            lightest = loads.index(min(loads))
            owner[cls] = lightest
            loads[lightest] += size
        self.share = [cls for cls, rank in owner.items() if rank == self.rank]
        self.rng = np.random.default_rng([self.seed, epoch, self.rank])
        self.queue = []
        return min(loads) // self.batch_size

    def next_batch(self) -> list[int]:
        chosen = []
        while len(chosen) < self.batch_size // self.m:
            if not self.queue:
                self.queue = list(pd.Series(self.share).sample(frac=1, random_state=self.rng))
            cls = self.queue.pop(0)
            if cls in chosen:  # straddles two passes: keep it for later in the new pass
                self.queue.append(cls)
                continue
            chosen.append(cls)
        batch = []
        for cls in chosen:
            rows = self.frame.loc[self.rows_of_class[cls]]
            items = rows["item"].drop_duplicates()
            picked = items.sample(self.m, replace=len(items) < self.m, random_state=self.rng)
            for item in picked:
                row = rows[rows["item"] == item].sample(1, random_state=self.rng)
                batch.append(int(row.index[0]))
        return batch


def time_audioclf(classes, items, epochs: int) -> tuple[float, float, int]:
    """(construction s, median rank-epoch s, batches per rank-epoch) over both ranks."""
    build_times, epoch_times = [], []
    for rank in range(WORLD_SIZE):
        start = time.perf_counter()
        sampler = MPerClassSampler(
            classes, items, batch_size=BATCH_SIZE, m=M, rank=rank, world_size=WORLD_SIZE
        )
        build_times.append(time.perf_counter() - start)
        for epoch in range(1, epochs + 1):
            start = time.perf_counter()
            sampler.set_epoch(epoch)
            batches = list(sampler)
            epoch_times.append(time.perf_counter() - start)
            assert len(batches) == len(sampler)
            assert all(len(batch) == BATCH_SIZE for batch in batches)
    return statistics.median(build_times), statistics.median(epoch_times), len(batches)


def time_pandas(classes, items, pilot_batches: int, fraction: float) -> tuple[float, float, str]:
    """(construction s, rank-epoch s, how it was measured) for rank 0, epoch 1."""
    frame = pd.DataFrame({"class": classes, "item": items})
    start = time.perf_counter()
    sampler = PandasMPerClass(frame, batch_size=BATCH_SIZE, m=M, rank=0, world_size=WORLD_SIZE)
    build = time.perf_counter() - start

    start = time.perf_counter()
    n_batches = sampler.start_epoch(1)
    plan = time.perf_counter() - start

    def time_batches(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            batch = sampler.next_batch()
            assert len(batch) == BATCH_SIZE and len(set(classes[batch])) == BATCH_SIZE // M
        return time.perf_counter() - start

    pilot = min(pilot_batches, n_batches)
    pilot_s = time_batches(pilot)
    if plan + pilot_s / pilot * n_batches <= PANDAS_FULL_EPOCH_LIMIT_S:
        rest_s = time_batches(n_batches - pilot)
        return build, plan + pilot_s + rest_s, f"full epoch, {n_batches} batches"
    timed = max(pilot, int(fraction * n_batches))
    timed_s = pilot_s + time_batches(timed - pilot)
    estimate = plan + timed_s / timed * n_batches
    return (
        build,
        estimate,
        (
            f"EXTRAPOLATED from {timed} of {n_batches} batches ({timed / n_batches:.1%}): "
            f"{timed_s / timed * 1e3:.2f} ms/batch"
        ),
    )


def time_pml(classes, epochs: int) -> tuple[float, float, int]:
    """(construction s, median epoch s, indices per epoch) for pml's flat-class sampler."""
    from pytorch_metric_learning.samplers import MPerClassSampler as PMLSampler

    rank_samples = len(classes) // WORLD_SIZE
    start = time.perf_counter()
    sampler = PMLSampler(classes, m=M, batch_size=BATCH_SIZE, length_before_new_iter=rank_samples)
    build = time.perf_counter() - start
    epoch_times = []
    for _ in range(epochs):
        start = time.perf_counter()
        indices = list(iter(sampler))
        epoch_times.append(time.perf_counter() - start)
    return build, statistics.median(epoch_times), len(indices)


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small index and fewer repeats (smoke check)"
    )
    args = parser.parse_args()
    n_classes, epochs, pilot, fraction = (400, 2, 20, 0.05) if args.quick else (8000, 5, 100, 0.05)

    classes, items = synthetic_index(n_classes)
    print(
        f"index: {len(classes):,} rows, {n_classes} classes, "
        f"{len(set(zip(classes.tolist(), items.tolist()))):,} items; world_size={WORLD_SIZE} "
        f"batch_size={BATCH_SIZE} m={M}" + (" [--quick]" if args.quick else "")
    )

    build, ours, batches = time_audioclf(classes, items, epochs)
    print(f"audioclf   construction {build * 1e3:8.1f} ms (median over {WORLD_SIZE} ranks)")
    print(
        f"audioclf   rank-epoch   {ours:8.4f} s   median of {epochs} epochs x {WORLD_SIZE} ranks, "
        f"{batches} batches of {BATCH_SIZE}"
    )

    pandas_build, pandas_epoch, how = time_pandas(classes, items, pilot, fraction)
    print(f"pandas     construction {pandas_build * 1e3:8.1f} ms")
    print(f"pandas     rank-epoch   {pandas_epoch:8.3f} s   {how}")

    pml_build, pml_epoch, pml_indices = time_pml(classes, max(1, epochs // 2))
    print(f"pml        construction {pml_build * 1e3:8.1f} ms")
    print(
        f"pml        rank-epoch   {pml_epoch:8.3f} s   {pml_indices:,} indices "
        f"(flat classes, one process)"
    )

    pandas_ratio, pml_ratio = pandas_epoch / ours, pml_epoch / ours
    print(f"ratios: pandas/audioclf = {pandas_ratio:,.0f}x, pml/audioclf = {pml_ratio:,.1f}x")
    print(
        f"{verdict(ours <= TARGET_EPOCH_S)}  audioclf rank-epoch {ours:.4f} s <= {TARGET_EPOCH_S} s"
    )
    print(
        f"{verdict(pandas_ratio >= TARGET_PANDAS_RATIO)}  pandas/audioclf {pandas_ratio:,.0f}x "
        f">= {TARGET_PANDAS_RATIO:.0f}x"
    )
    if args.quick:
        print("(--quick: targets are for the full-size index; these verdicts are indicative only)")


if __name__ == "__main__":
    main()
