"""Crop reads of precomputed features: read_npy_crop (reads only the window) vs np.load + crop.

    python benchmarks/feature_read.py [--n 40] [--frames 23400] [--bins 64] [--crop 200]
    python benchmarks/feature_read.py --smoke   # 4 small files, one pass: every line, no verdict

Writes N float32 .npy files of frames × bins (23,400 × 64 = 6 MB, like real feature files) in a
temporary folder and measures crops per second of both readers on the same files and offsets:

  cold-ish  each file's pages are dropped from the OS page cache (posix_fadvise DONTNEED on that
            file only; nothing else on the machine is touched) before every pass, so reads hit
            the disk (or the hypervisor's cache, on a VM: hence "-ish").
  warm      every file is already in the page cache (what repeated epochs over a small set see).

A memory-mapped crop (np.load(mmap_mode="r")) is measured too, for reference: page faults make
the kernel read around them, read_ahead_kb at a time (`cat /sys/block/*/queue/read_ahead_kb`).

PASS when read_npy_crop is at least 10× faster than np.load + crop on cold-ish reads, the case
that matters once the feature set is larger than RAM; the warm ratio is printed alongside.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audioclf.data.readers import read_npy_crop, window_starts  # noqa: E402

TARGET_RATIO = 10.0


def drop_from_page_cache(paths: list[Path]) -> bool:
    """Evict these files' pages from the page cache; False where the OS has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def crop_by_window_read(path: Path, crop: int, bins: int, rng: np.random.Generator) -> np.ndarray:
    return read_npy_crop(path, crop, int(rng.integers(2**62)), "frames_bins", bins)


def crop_by_np_mmap(path: Path, crop: int, bins: int, rng: np.random.Generator) -> np.ndarray:
    frames = np.load(path, mmap_mode="r")
    start = int(window_starts(int(rng.integers(2**62)), frames.shape[0], crop)[0])
    return np.array(frames[start : start + crop], dtype=np.float32)


def crop_by_full_load(path: Path, crop: int, bins: int, rng: np.random.Generator) -> np.ndarray:
    frames = np.load(path)
    start = int(window_starts(int(rng.integers(2**62)), frames.shape[0], crop)[0])
    return np.array(frames[start : start + crop], dtype=np.float32)


READERS = {  # the baseline, the reader under test, and a memory map for reference
    "np.load + crop": crop_by_full_load,
    "read_npy_crop": crop_by_window_read,
    "np.load(mmap_mode=r)": crop_by_np_mmap,
}


def crops_per_second(reader, paths, crop, bins, passes, cold) -> float:
    """Crops/s over `passes` passes through all files (same offsets for every reader)."""
    elapsed, count = 0.0, 0
    for p in range(passes):
        if cold:
            drop_from_page_cache(paths)
        rng = np.random.default_rng(p)
        start = time.perf_counter()
        for path in paths:
            out = reader(path, crop, bins, rng)
            assert out.shape == (crop, bins)
        elapsed += time.perf_counter() - start
        count += len(paths)
    return count / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=40, help="number of feature files")
    parser.add_argument("--frames", type=int, default=23_400, help="frames per file")
    parser.add_argument("--bins", type=int, default=64, help="mel bins per frame")
    parser.add_argument("--crop", type=int, default=200, help="frames per crop")
    parser.add_argument(
        "--passes", type=int, default=3, help="passes over the files per measurement"
    )
    parser.add_argument("--dir", default=None, help="folder for the files (default: a temp dir)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="4 files of 2,000 frames, one pass: every line is printed, the exit status does "
        "not hold the verdict",
    )
    args = parser.parse_args()
    if args.smoke:
        args.n, args.frames, args.passes = 4, 2000, 1

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rng = np.random.default_rng(0)
        paths = []
        for i in range(args.n):
            path = Path(tmp) / f"feat_{i:03d}.npy"
            np.save(path, rng.standard_normal((args.frames, args.bins), dtype=np.float32))
            paths.append(path)
        size_mb = paths[0].stat().st_size / 1e6
        print(
            f"{args.n} files of {args.frames} x {args.bins} float32 ({size_mb:.1f} MB each), "
            f"{args.crop}-frame random crops, {args.passes} passes per measurement"
        )

        can_drop = drop_from_page_cache(paths)
        results = {}
        for label, cold in (("cold-ish", True), ("warm", False)):
            if cold and not can_drop:
                print("cold-ish: skipped (no posix_fadvise on this OS)")
                continue
            if not cold:  # fill the page cache first
                for path in paths:
                    np.load(path)
            rates = {
                name: crops_per_second(reader, paths, args.crop, args.bins, args.passes, cold)
                for name, reader in READERS.items()
            }
            baseline = rates["np.load + crop"]
            results[label] = rates["read_npy_crop"] / baseline
            for name, rate in rates.items():
                print(f"{label:9s} {name:24s} {rate:9.1f} crops/s  {rate / baseline:6.1f}x")

    decisive = "cold-ish" if "cold-ish" in results else "warm"
    ratio = results[decisive]
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    print(f"{verdict}: {decisive} speed-up {ratio:.1f}x (target >= {TARGET_RATIO:.0f}x)")
    return 0 if verdict == "PASS" or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
