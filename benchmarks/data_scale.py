"""The whole training-data pipeline at 400k-row scale: sheet → index → split → sampler → dataset →
DataLoader workers, on real .npy feature files, in one run.

    .venv/bin/python benchmarks/data_scale.py            # 400k rows, 2,000 files (~12 GB once)
    .venv/bin/python benchmarks/data_scale.py --quick    # 20k rows, 100 files, a smoke run

What is on disk (generated once into --workdir, reused by later runs):
  features/fNNNNN.npy   --files float32 log-mel files, 16,000-22,000 frames x --bins (5-7 MB),
                        like real precomputed features;
  r<rows>_f<files>_s<seed>/index.xlsx   --rows rows, ~rows/200 classes x 3-7 items (mean 5);
                        every row has its own path samples/<class>/<item>/<id>.npy, a hard link
                        to one of the feature files (so paths are as long and as many as a real
                        set's, and the page cache is shared): each file serves ~rows/files rows.

Measured, in this order (the configuration is the trainer's: features.kind=npy, n_mels=--bins,
crop_seconds=3 -> 301 frames, sampler.batch_size=128, m=4, one rank, the default split):
  index       load_index first read (cache removed) and cached, split_index, the sampler, the
              train AudioDataset as the trainer builds it, and split_datasets (as the Trainer builds them) whole;
  ceiling     read_npy_crop in a loop in this process on the very (path, crop seed) pairs the
              loader reads: the fastest one process can go (warm and cold);
  loader      MPerClassSampler + TrainLoader (SeededBatches) + collate_padded with 0 (in
              process) and each of --workers DataLoader workers: crops/s, time to the first
              batch, workers' CPU use; warm (every file read once first, then checked resident
              with mincore) and cold (each file dropped from the page cache with posix_fadvise
              DONTNEED, checked with mincore; on a VM the hypervisor may still cache: "cold-ish");
  memory      one run of --batches batches with --memory-workers workers, every worker's memory
              from /proc at the start (once each has delivered a batch) and every 10 batches:
              VmRSS (what top shows), and USS = Private_Clean + Private_Dirty of smaps_rollup.
              A forked worker's RSS already counts the parent's pages it shares, so pages it
              copies on write (Python touching refcounts of inherited objects: copy-on-read) do
              not raise its RSS; they raise its USS, and the machine's used memory, once per
              worker. Both are held to the target, at their peak. Before forking these workers
              this process frees one batch-sized tensor on purpose, as a trainer may well have
              done: glibc's malloc then keeps blocks of that size in the heap, in the parent and
              in the workers it forks (the figure would otherwise depend on what ran before).

Targets (PASS/FAIL): worker memory growth over the --batches run <= 50 MB (RSS and USS);
one worker delivers >= 1,000 three-second crops/s from the page cache (the cold figure is
printed beside it). Throughput is printed as a fraction of the ceiling measured in the same run.
The machine's load average is printed: other processes on a shared machine slow every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import openpyxl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from audioclf.config import load_config  # noqa: E402
from audioclf.data.dataset import (  # noqa: E402
    AudioDataset,
    collate_padded,
    split_datasets,  # noqa: E402
)
from audioclf.data.index import load_index, split_index  # noqa: E402
from audioclf.data.loader import SeededBatches, TrainLoader, loader_kwargs  # noqa: E402
from audioclf.data.readers import read_npy_crop  # noqa: E402
from audioclf.data.sampler import MPerClassSampler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from feature_read import drop_from_page_cache  # noqa: E402

GROWTH_TARGET_MB = 50.0
ONE_WORKER_TARGET = 1000.0  # crops/s from the page cache
MIN_FRAMES, MAX_FRAMES = 16_000, 22_000  # 5.1-7.0 MB at 80 bins
ROWS_PER_CLASS = 200
EPOCH = 1  # every loader run and the ceiling read the same batches of this epoch
MB = 1024 * 1024


# ------------------------------------------------------------------------------ the data on disk


def feature_path(folder: Path, i: int) -> Path:
    return folder / f"f{i:05d}.npy"


def make_feature_files(folder: Path, count: int, bins: int, seed: int) -> list[Path]:
    """Files 0..count-1 (frames drawn per file, seeded); files already there are kept."""
    folder.mkdir(parents=True, exist_ok=True)
    frames = np.random.default_rng([seed, 1]).integers(MIN_FRAMES, MAX_FRAMES + 1, count)
    base = None
    paths, made, start = [], 0, time.perf_counter()
    for i in range(count):
        path = feature_path(folder, i)
        paths.append(path)
        expected = 128 + int(frames[i]) * bins * 4  # a version-1.0 header is 128 bytes here
        if path.is_file() and path.stat().st_size == expected:
            continue
        if base is None:
            base = np.random.default_rng([seed, 2]).standard_normal(
                (MAX_FRAMES, bins), dtype=np.float32
            )
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as handle:
            np.save(handle, np.roll(base, i, axis=0)[: frames[i]])
        os.replace(tmp, path)
        if path.stat().st_size != expected:
            raise RuntimeError(f"{path}: {path.stat().st_size} bytes, expected {expected}")
        made += 1
    if made:
        print(f"  wrote {made} feature files in {time.perf_counter() - start:.1f} s")
    return paths


def synthesize_rows(rows: int, files: int, seed: int) -> dict[str, np.ndarray]:
    """~rows/200 classes x 3-7 items, every item at least one row, each row one of the files."""
    rng = np.random.default_rng([seed, 3])
    n_classes = max(64, rows // ROWS_PER_CLASS)
    items_per_class = rng.integers(3, 8, n_classes)
    n_items = int(items_per_class.sum())
    if rows < n_items:
        raise SystemExit(f"--rows {rows} is fewer than the {n_items} items; use more rows")
    item_class = np.repeat(np.arange(n_classes), items_per_class)
    first = np.cumsum(items_per_class) - items_per_class
    item_number = np.arange(n_items) - np.repeat(first, items_per_class)
    row_item = np.sort(
        np.concatenate([np.arange(n_items), rng.integers(0, n_items, rows - n_items)])
    )
    classes = np.char.add("class_", np.char.zfill(item_class.astype(str), 4))
    items = np.char.add("rec_", np.char.zfill(item_number.astype(str), 2))
    ids = np.char.zfill(np.arange(rows).astype(str), 7)
    cls, item = classes[row_item], items[row_item]
    rel = np.char.add(
        np.char.add(np.char.add(np.char.add(np.char.add("samples/", cls), "/"), item), "/"),
        np.char.add(ids, ".npy"),
    )
    return {
        "a_cls": cls,
        "a_item": item,
        "a_id": ids,
        "path": rel,
        "file": rng.integers(0, files, rows),
    }


def make_index(folder: Path, features: list[Path], rows: int, seed: int) -> Path:
    """index.xlsx plus one hard link per row (symlinks where hard links are refused)."""
    sheet, done = folder / "index.xlsx", folder / "complete.json"
    if done.is_file():
        return sheet
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    data = synthesize_rows(rows, len(features), seed)
    link_kind = "hard links"
    for rel, file in zip(data["path"].tolist(), data["file"].tolist()):
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(features[file], target)
        except OSError:
            os.symlink(features[file], target)
            link_kind = "symlinks (hard links refused)"
    print(f"  made {rows} {link_kind} in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    book = openpyxl.Workbook(write_only=True)
    sheet_ws = book.create_sheet("index")
    columns = ["a_cls", "a_item", "a_id", "path"]
    sheet_ws.append(columns)
    for row in zip(*(data[c].tolist() for c in columns)):
        sheet_ws.append(row)
    tmp = sheet.with_name("index.tmp.xlsx")
    book.save(tmp)
    os.replace(tmp, sheet)
    done.write_text(json.dumps({"rows": rows, "files": len(features), "links": link_kind}))
    print(f"  wrote {sheet} with openpyxl (write-only) in {time.perf_counter() - start:.1f} s")
    return sheet


# ------------------------------------------------------------------------------ the page cache

_PAGE = mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
except (OSError, AttributeError):
    _libc = None


def resident_fraction(paths: list[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore on a mapping that is never touched);
    None where that cannot be asked."""
    if _libc is None:
        return None
    resident = total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = (size + _PAGE - 1) // _PAGE
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    return None
                resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
                total += pages
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / max(total, 1)


def read_whole_files(paths: list[Path]) -> tuple[float, int]:
    """Read every byte once (fills the page cache); (seconds, bytes)."""
    buffer = bytearray(8 * MB)
    view, total, start = memoryview(buffer), 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(view):
                total += count
    return time.perf_counter() - start, total


def fraction_text(fraction: float | None) -> str:
    return "unknown (mincore unavailable)" if fraction is None else f"{fraction:.1%}"


# ------------------------------------------------------------------------------ processes


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state, ppid, ...), or None once pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def children(pid: int) -> list[int]:
    """Live child processes of pid (the DataLoader workers of this process)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(int(entry))
        if fields is not None and int(fields[1]) == pid and fields[0] not in "ZX":
            found.append(int(entry))
    return sorted(found)


def memory_mb(pid: int) -> dict[str, float]:
    """rss (VmRSS), anon (RssAnon), shmem (RssShmem), uss (Private_Clean + Private_Dirty), pss."""
    out = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[{"VmRSS": "rss", "RssAnon": "anon", "RssShmem": "shmem"}[key]] = (
                    int(value.split()[0]) / 1024
                )
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            rollup = {}
            for line in handle:
                key, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    rollup[key] = int(value.split()[0]) / 1024
        out["uss"] = rollup["Private_Clean"] + rollup["Private_Dirty"]
        out["pss"] = rollup["Pss"]
    except (OSError, KeyError):
        out["uss"] = out["pss"] = float("nan")
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def load_text() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------ measurements


def timed(fn, repeat: int = 1):
    """(result of the last call, median seconds)."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def first_keys(sampler: MPerClassSampler, seed: int, batches: int) -> list[tuple[int, int]]:
    """The (position, crop seed) pairs of the epoch's first batches, as the loader reads them."""
    sampler.set_epoch(EPOCH)
    keys = []
    for index, batch in enumerate(SeededBatches(sampler, seed)):
        if index == batches:
            break
        keys.extend(batch)
    return keys


def ceiling(keys, paths: np.ndarray, cfg) -> tuple[float, float]:
    """(crops/s, CPU seconds per second) of read_npy_crop alone, in this process, on the
    loader's (path, crop seed) pairs."""
    features, clips = cfg.features, cfg.clips
    frames = clips.crop_frames(features)
    start, start_cpu = time.perf_counter(), time.process_time()
    for position, crop_seed in keys:
        crop = read_npy_crop(
            paths[position],
            frames,
            np.random.default_rng(crop_seed),
            clips.npy_layout,
            features.n_mels,
            clips.pad_mode,
        )
    elapsed = time.perf_counter() - start
    assert crop.shape == (frames, features.n_mels)
    return len(keys) / elapsed, (time.process_time() - start_cpu) / elapsed


def batch_costs(dataset, keys, batch_size: int, batches: int = 8) -> tuple[float, float, float]:
    """CPU ms per batch, in this process, of what a worker does with one batch: the dataset's
    items, collate_padded, and moving the batch into shared memory (the worker's result queue
    does that to every tensor not already there)."""
    items_s = collate_s = share_s = 0.0
    for b in range(batches):
        start = time.process_time()
        items = [dataset[key] for key in keys[b * batch_size : (b + 1) * batch_size]]
        items_s += time.process_time() - start
        start = time.process_time()
        x = collate_padded(items)[0]
        collate_s += time.process_time() - start
        start = time.process_time()
        x.share_memory_()
        share_s += time.process_time() - start
    return tuple(1e3 * t / batches for t in (items_s, collate_s, share_s))


class LoaderRun:
    """One DataLoader over the trainer's sampler and dataset, iterated batch by batch."""

    def __init__(self, cfg, dataset, sampler: MPerClassSampler, workers: int):
        sampler.set_epoch(EPOCH)
        self.sampler = sampler
        kwargs = loader_kwargs(
            workers,
            cfg.data.pin_memory,
            cfg.data.persistent_workers,
            cfg.data.prefetch_factor,
            torch.device("cpu"),
        )
        self.workers = workers
        self.loader = TrainLoader(dataset, sampler, seed=cfg.train.seed, **kwargs)
        self.batch_size = cfg.sampler.batch_size
        self.shape = (
            cfg.sampler.batch_size,
            cfg.clips.crop_frames(cfg.features),
            cfg.features.n_mels,
        )
        start = time.perf_counter()
        self.iterator = iter(self.loader)
        self.next_batch()
        self.first_batch_s = time.perf_counter() - start
        self.received = 1
        # Until every worker has delivered a batch, throughput would include start-up.
        while self.received < max(workers, 1):
            self.next_batch()
            self.received += 1
        self.pids = children(os.getpid()) if workers else []

    def next_batch(self) -> None:
        try:
            x, lengths, labels, positions = next(self.iterator)
        except StopIteration:  # the next epoch, on the same (persistent) workers
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self.iterator = iter(self.loader)
            x, lengths, labels, positions = next(self.iterator)
        if tuple(x.shape) != self.shape:
            raise RuntimeError(f"batch of shape {tuple(x.shape)}, expected {self.shape}")

    def rate(self, batches: int) -> tuple[float, float]:
        """(crops/s over the next `batches` batches, CPU seconds per second of the workers, or of
        this process with 0 workers)."""
        pids = self.pids or [os.getpid()]
        cpu0, start = cpu_seconds(pids), time.perf_counter()
        for _ in range(batches):
            self.next_batch()
        elapsed = time.perf_counter() - start
        self.received += batches
        return batches * self.batch_size / elapsed, (cpu_seconds(pids) - cpu0) / elapsed

    def close(self) -> None:
        pids = self.pids
        del self.iterator
        self.loader = None
        gc.collect()
        deadline = time.time() + 10
        while pids and time.time() < deadline and set(pids) & set(children(os.getpid())):
            time.sleep(0.05)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000, help="rows of the index sheet")
    parser.add_argument("--files", type=int, default=2_000, help="distinct .npy feature files")
    parser.add_argument("--bins", type=int, default=80, help="mel bins per frame")
    parser.add_argument("--workers", default="1,2,4", help="worker counts to time, comma-separated")
    parser.add_argument(
        "--batches",
        type=int,
        default=2_000,
        help="batches of the memory run (worker memory at start and after these)",
    )
    parser.add_argument(
        "--memory-workers",
        type=int,
        default=2,
        help="workers of the memory run (2 = data.num_workers' default)",
    )
    parser.add_argument(
        "--measure",
        type=int,
        default=60,
        help="timed batches per throughput run (after each worker's first batch)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthesized data")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/audioclf_scale"),
        help="where the files and sheet are kept between runs",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 20k rows, 100 files, workers 1,2, 200 memory batches",
    )
    args = parser.parse_args()
    if args.quick:
        args.rows, args.files, args.workers = 20_000, 100, "1,2"
        args.batches, args.measure = 200, 30
    worker_counts = [int(w) for w in args.workers.split(",") if w.strip()]
    if not worker_counts or min(worker_counts) < 1:
        raise SystemExit(f"--workers {args.workers!r}: give worker counts >= 1, e.g. 1,2,4")
    torch.set_num_threads(1)
    # More workers than CPUs is what --workers asks for; the table shows what it costs.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    began = time.perf_counter()

    print(
        f"load average {load_text()} on {os.cpu_count()} CPUs; torch {torch.__version__}"
        + ("  [--quick: a smoke run, targets are for the full size]" if args.quick else "")
    )
    args.workdir.mkdir(parents=True, exist_ok=True)
    features = make_feature_files(args.workdir / "features", args.files, args.bins, args.seed)
    sizes = [p.stat().st_size for p in features]
    sheet = make_index(
        args.workdir / f"r{args.rows}_f{args.files}_s{args.seed}", features, args.rows, args.seed
    )
    print(
        f"data: {args.files} .npy files of {MIN_FRAMES:,}-{MAX_FRAMES:,} frames x {args.bins} "
        f"float32 ({min(sizes) / 1e6:.1f}-{max(sizes) / 1e6:.1f} MB, {sum(sizes) / 1e9:.1f} GB "
        f"in all) in {args.workdir / 'features'}; {args.rows:,} rows, each with its own path "
        f"(a hard link), so every file serves ~{args.rows / args.files:.0f} rows"
    )

    cache_dir = args.workdir / f"index_cache_r{args.rows}_f{args.files}"
    cfg = load_config(
        None,
        [
            f"data.index={sheet}",
            f"data.cache_dir={cache_dir}",
            "features.kind=npy",
            f"features.n_mels={args.bins}",
            "clips.crop_seconds=3",
            "sampler.batch_size=128",
            "sampler.m=4",
        ],
    )
    feats = cfg.features

    # ---- index, split, sampler, dataset
    shutil.rmtree(cache_dir, ignore_errors=True)
    index, first_s = timed(lambda: load_index(cfg.data))
    _, cached_s = timed(lambda: load_index(cfg.data), 3)
    splits, split_s = timed(lambda: split_index(index, cfg.data))
    train = splits["train"]
    sampler, sampler_s = timed(
        lambda: MPerClassSampler(
            train.codes.class_codes,
            train.codes.item_codes,
            batch_size=cfg.sampler.batch_size,
            m=cfg.sampler.m,
            rank=0,
            world_size=1,
            seed=cfg.train.seed,
            split=cfg.sampler.split,
            small_classes=cfg.sampler.small_classes,
        )
    )
    _, dataset_s = timed(lambda: AudioDataset.from_index(train, cfg, train=True))
    (train, val, train_set, _), build_s = timed(lambda: split_datasets(cfg, load_index(cfg.data)))
    index = splits = None  # the trainer keeps only what split_datasets returns
    sampler = MPerClassSampler(  # as TrainLoader.for_run builds it, on the run's split
        train.codes.class_codes,
        train.codes.item_codes,
        batch_size=cfg.sampler.batch_size,
        m=cfg.sampler.m,
        rank=0,
        world_size=1,
        seed=cfg.train.seed,
        split=cfg.sampler.split,
        small_classes=cfg.sampler.small_classes,
    )
    paths = train.table["path"].to_numpy()
    mean_path = float(np.mean([len(p) for p in paths[:10_000]]))
    print(
        f"index: {len(train):,} train rows in {len(train.classes)} classes, "
        f"{len(val) if val else 0:,} val rows; {sampler.batches_per_epoch} batches of "
        f"{cfg.sampler.batch_size} per epoch; paths ~{mean_path:.0f} characters"
    )
    for label, seconds in (
        (
            f"load_index first read (parse, validate, check {args.rows:,} files, write cache)",
            first_s,
        ),
        ("load_index cached (median of 3)", cached_s),
        ("split_index", split_s),
        ("MPerClassSampler (with the index's codes)", sampler_s),
        ("AudioDataset.from_index of the train split", dataset_s),
        ("split_datasets (cached load, split, both datasets)", build_s),
    ):
        print(f"  {label:76s} {seconds:7.3f} s")
    main_mb = memory_mb(os.getpid())
    print(
        f"  this process after split_datasets: RSS {main_mb['rss']:.0f} MB, "
        f"{len(gc.get_objects()):,} gc-tracked objects"
    )

    # ---- warm: every file read once, then checked resident
    read_s, read_bytes = read_whole_files(features)
    warm_fraction = resident_fraction(features)
    print(
        f"warm: read all {args.files} files once ({read_bytes / 1e9:.1f} GB in {read_s:.1f} s, "
        f"{read_bytes / 1e9 / read_s:.2f} GB/s); resident in the page cache: "
        f"{fraction_text(warm_fraction)}"
        + (
            "  WARNING: the page cache did not hold them all, 'warm' reads partly hit the disk"
            if warm_fraction is not None and warm_fraction < 0.95
            else ""
        )
    )

    measure_keys = first_keys(sampler, cfg.train.seed, args.measure + max(worker_counts))
    rows = []  # (label, crops/s, cpu seconds per second, first batch s or None, ceiling crops/s)
    results = {}  # (workers, "warm" / "cold") -> (crops/s, cpu/s)

    def loader_run(workers: int, kind: str, reference: float) -> None:
        run = LoaderRun(cfg, train_set, sampler, workers)
        rate, cpu = run.rate(args.measure)
        run.close()
        results[workers, kind] = rate, cpu
        label = (
            "loader, 0 workers (in process)"
            if workers == 0
            else f"loader, {workers} worker{'s' if workers > 1 else ''}, {kind}"
        )
        rows.append((label, rate, cpu, run.first_batch_s, reference))

    ceiling_warm = ceiling(measure_keys, paths, cfg)
    rows.append(("ceiling read_npy_crop, warm", *ceiling_warm, None, ceiling_warm[0]))
    loader_run(0, "warm", ceiling_warm[0])
    for workers in worker_counts:
        loader_run(workers, "warm", ceiling_warm[0])

    items_ms, collate_ms, share_ms = batch_costs(train_set, measure_keys, cfg.sampler.batch_size)

    # ---- cold: every file dropped from the page cache before each run
    cold_ok = drop_from_page_cache(features)
    cold_fraction = resident_fraction(features) if cold_ok else None
    if not cold_ok:
        print("cold: skipped (no posix_fadvise on this OS)")
    else:
        ceiling_cold = ceiling(measure_keys, paths, cfg)
        rows.append(("ceiling read_npy_crop, cold", *ceiling_cold, None, ceiling_cold[0]))
        for workers in worker_counts:
            drop_from_page_cache(features)
            loader_run(workers, "cold", ceiling_cold[0])
        print(
            f"cold: files dropped with posix_fadvise(DONTNEED) before each run; resident after "
            f"the drop: {fraction_text(cold_fraction)}"
            + (
                "  WARNING: the drop did not work, 'cold' is warm"
                if cold_fraction is not None and cold_fraction > 0.05
                else ""
            )
        )

    print(
        f"throughput: {cfg.sampler.batch_size}-crop batches of {cfg.clips.crop_frames(feats)} x "
        f"{feats.n_mels} (3 s), {args.measure} timed batches ({args.measure * 128:,} crops) per "
        f"run; load average now {load_text()}"
    )
    print(
        f"  {'':31s} {'crops/s':>8s} {'x ceiling':>9s} {'CPU/s':>6s} {'crops/CPU-s':>11s} "
        f"{'1st batch':>9s}"
    )
    for label, rate, cpu, first, reference in rows:
        first_text = f"{first:8.2f}s" if first is not None else ""
        print(
            f"  {label:31s} {rate:8.0f} {rate / reference:9.2f} {cpu:6.2f} "
            f"{rate / max(cpu, 1e-9):11.0f} {first_text:>9s}"
        )
    print(
        f"  one batch in one process, CPU ms: {cfg.sampler.batch_size} dataset items "
        f"{items_ms:.1f}, collate_padded {collate_ms:.1f}, moving it to shared memory "
        f"{share_ms:.1f} (a worker's result queue does that to a batch not built there)"
    )
    print(
        "  x ceiling: against one process reading the same crops (warm or cold). CPU/s: CPU "
        "seconds per second used by the workers (by this process for the ceiling and 0 "
        "workers); below 1 per worker, other processes held the CPUs. crops/CPU-s: crops per "
        "CPU second, what a worker with a core of its own would deliver when reads do not wait"
        " on the disk."
    )

    # ---- memory: one long run, every worker's memory at the start and every few batches.
    # glibc raises its mmap threshold to the size of any mmap-ed block a process frees, and forked
    # workers inherit it: blocks of that size then come from the heap. This process has freed
    # batch-sized blocks already (the 0-worker run); a trainer has too whenever it built or freed
    # a batch-sized tensor before its workers fork. Doing it here on purpose keeps the figure
    # independent of what ran before.
    torch.empty(cfg.sampler.batch_size, cfg.clips.crop_frames(feats), feats.n_mels).fill_(0)
    read_whole_files(features)
    run = LoaderRun(cfg, train_set, sampler, args.memory_workers)
    start_mb = {pid: memory_mb(pid) for pid in run.pids}
    peak = {pid: {"rss": 0.0, "uss": 0.0} for pid in run.pids}
    floor = {pid: float("inf") for pid in run.pids}  # lowest USS growth in the second half
    main_start = memory_mb(os.getpid())
    marks = [m for m in (250, 500, 1000, 1500) if run.received < m < args.batches] + [args.batches]
    trail, rates, cpus, now = [], [], [], start_mb
    while run.received < args.batches:
        rate, cpu = run.rate(min(10, args.batches - run.received))
        rates.append(rate)
        cpus.append(cpu)
        now = {pid: memory_mb(pid) for pid in run.pids}
        for pid in run.pids:
            for key in ("rss", "uss"):
                peak[pid][key] = max(peak[pid][key], now[pid][key] - start_mb[pid][key])
            if run.received >= args.batches / 2:
                floor[pid] = min(floor[pid], now[pid]["uss"] - start_mb[pid]["uss"])
        if run.received >= marks[len(trail)]:
            trail.append((run.received, now))
    end_mb = now
    main_end = memory_mb(os.getpid())
    run.close()
    print(
        f"memory: {args.memory_workers} workers, {run.received} batches "
        f"({run.received * cfg.sampler.batch_size:,} crops at ~{statistics.median(rates):.0f} "
        f"crops/s, workers' CPU/s {statistics.median(cpus):.2f}), warm; the parent freed a "
        f"batch-sized tensor before forking them (see the source); MB per worker, start = once "
        f"every worker has delivered a batch, sampled every 10 batches"
    )
    print(
        f"  {'worker pid':>10s} {'RSS start':>9s} {'end':>5s} {'growth':>6s} {'peak':>5s}   "
        f"{'USS start':>9s} {'end':>5s} {'growth':>6s} {'peak':>5s} {'floor':>5s}"
    )
    for pid in run.pids:
        s, e = start_mb[pid], end_mb[pid]
        print(
            f"  {pid:10d} {s['rss']:9.0f} {e['rss']:5.0f} {e['rss'] - s['rss']:+6.0f} "
            f"{peak[pid]['rss']:+5.0f}   {s['uss']:9.0f} {e['uss']:5.0f} "
            f"{e['uss'] - s['uss']:+6.0f} {peak[pid]['uss']:+5.0f} {floor[pid]:+5.0f}"
        )
    for mark, mem in trail:
        rss = " ".join(f"{mem[p]['rss'] - start_mb[p]['rss']:+.0f}" for p in run.pids)
        uss = " ".join(f"{mem[p]['uss'] - start_mb[p]['uss']:+.0f}" for p in run.pids)
        print(f"  after {mark:5d} batches: growth RSS {rss}  USS {uss} MB")
    print(
        "  growth: at the end; peak: the largest sample; floor: the smallest sample of the "
        "second half (what stayed; pages copied from the parent never go back, heap blocks "
        "may be returned)"
    )
    print(f"  main process RSS {main_start['rss']:.0f} -> {main_end['rss']:.0f} MB")
    rss_growth = max(peak[p]["rss"] for p in run.pids)
    uss_growth = max(peak[p]["uss"] for p in run.pids)

    first_run = next(
        first for label, _, _, first, _ in rows if first is not None and label.endswith("warm")
    )
    print(
        f"start-up: split_datasets {build_s:.2f} s + sampler {sampler_s:.2f} s + first batch "
        f"{first_run:.2f} s ({worker_counts[0]} worker{'s' if worker_counts[0] > 1 else ''}, "
        f"warm) = {build_s + sampler_s + first_run:.2f} s from a cached index to the first batch "
        f"(a first read adds {first_s - cached_s:.2f} s)"
    )
    one_warm = results.get((1, "warm"))
    one_cold = results.get((1, "cold"))
    checks = [
        (
            rss_growth <= GROWTH_TARGET_MB,
            f"worker RSS growth over {args.batches} batches {rss_growth:+.0f} MB (peak, largest of "
            f"{args.memory_workers}) <= {GROWTH_TARGET_MB:.0f} MB",
        ),
        (
            uss_growth <= GROWTH_TARGET_MB,
            f"worker USS growth over {args.batches} batches {uss_growth:+.0f} MB (peak, largest of "
            f"{args.memory_workers}; private pages: heap growth and copies of the parent's) <= "
            f"{GROWTH_TARGET_MB:.0f} MB",
        ),
    ]
    if one_warm is not None:
        (rate, cpu), cold = one_warm, f"; cold {one_cold[0]:.0f} crops/s" if one_cold else ""
        checks.append(
            (
                rate >= ONE_WORKER_TARGET,
                f"one worker, page cache: {rate:.0f} crops/s >= {ONE_WORKER_TARGET:.0f} "
                f"({rate / ceiling_warm[0]:.2f} of the ceiling {ceiling_warm[0]:.0f} "
                f"crops/s{cold}; the worker used {cpu:.2f} CPU/s, {rate / cpu:.0f} crops "
                f"per CPU second)",
            )
        )
    for ok, text in checks:
        print(f"{verdict(ok)}  {text}")
    if args.quick:
        print("(--quick: targets are for the full size; these verdicts are indicative only)")
    print(f"total {time.perf_counter() - began:.0f} s")
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
