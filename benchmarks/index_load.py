"""How fast load_index reads a 383k-row sheet: first read, cached re-read, and pandas baselines.

    python benchmarks/index_load.py                  # full size; the sheet is written once (~10 s)
    python benchmarks/index_load.py --rows 20000     # a quicker run
    python benchmarks/index_load.py --smoke          # 2,000 rows and 200 files, once, in a temp dir
    python benchmarks/index_load.py --files 100000   # also time the file-existence check

The sheet is synthesized (8000 classes, 2-10 items per class, 1-15 ids per item, seeded) with
a path template (features/{a_id}.npy) and no audio files, so data.check_files is off for the
read timings; --files times the existence check on its own, on that many empty files.
The synthesized sheet (and files) are kept in --workdir and reused by later runs.
Targets: first read <= 1.5 s (python-calamine), cached re-read <= 0.1 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openpyxl
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from audioclf.config import DataConfig  # noqa: E402
from audioclf.data import index as index_module  # noqa: E402
from audioclf.data.index import load_index  # noqa: E402

FIRST_READ_TARGET = 1.5
CACHED_TARGET = 0.1


def synthesize(seed: int) -> pd.DataFrame:
    """8000 classes, 2-10 items each, 1-15 ids per item (about 383k rows for seed 0)."""
    rng = np.random.default_rng(seed)
    items_per_class = rng.integers(2, 11, 8000)
    ids_per_item = rng.integers(1, 16, int(items_per_class.sum()))
    item_class = np.repeat(np.arange(8000), items_per_class)
    item_number = np.concatenate([np.arange(n) for n in items_per_class])
    row_item = np.repeat(np.arange(len(ids_per_item)), ids_per_item)
    classes = np.char.add("class_", np.char.zfill(item_class.astype(str), 4))
    items = np.char.add(np.char.add(classes, "_rec"), np.char.zfill(item_number.astype(str), 2))
    return pd.DataFrame(
        {
            "a_cls": classes[row_item],
            "a_item": items[row_item],
            "a_id": np.char.zfill(np.arange(len(row_item)).astype(str), 7),
        }
    )


def write_xlsx(frame: pd.DataFrame, path: Path) -> float:
    """openpyxl's write-only mode (pandas' to_excel is several times slower); returns seconds."""
    start = time.perf_counter()
    book = openpyxl.Workbook(write_only=True)
    sheet = book.create_sheet("index")
    sheet.append(list(frame.columns))
    for row in frame.itertuples(index=False):
        sheet.append(row)
    tmp = path.with_name(path.name + ".tmp")
    book.save(tmp)
    os.replace(tmp, path)
    return time.perf_counter() - start


def timed(fn, repeat: int, before=None) -> tuple[float, float]:
    """Median wall-clock and CPU seconds of `repeat` calls (CPU time shows a busy machine)."""
    wall, cpu = [], []
    for _ in range(repeat):
        if before is not None:
            before()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def verdict(seconds: float, target: float) -> str:
    return f"{'PASS' if seconds <= target else 'FAIL'} (target <= {target} s)"


def bench_file_check(workdir: Path, count: int) -> None:
    """The existence check (one os.scandir per folder) against one os.path.exists per path."""
    folder = workdir / f"files_{count}"
    paths = [str(folder / f"d{i % 400:03d}" / f"{i:07d}.npy") for i in range(count)]
    if not (folder / "complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        for d in range(min(400, count)):
            (folder / f"d{d:03d}").mkdir(parents=True)
        for path in paths:
            open(path, "wb").close()
        (folder / "complete").touch()
        print(f"created {count} empty files in 400 folders in {time.perf_counter() - start:.1f} s")
    series = pd.Series(paths, dtype=str)
    listing, _ = timed(lambda: index_module.validate._missing_files(series), 3)
    stats, _ = timed(lambda: [os.path.exists(p) for p in paths], 3)
    print(
        f"file check, {count} files   scandir per folder: {listing:.3f} s   "
        f"os.path.exists per file: {stats:.3f} s   ({stats / listing:.1f}x)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", type=int, default=0, help="keep only the first N rows (0 = all, ~383k)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthesized sheet")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "audioclf_bench_index",
        help="where the synthesized sheet is kept between runs",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median shown)")
    parser.add_argument(
        "--skip-openpyxl", action="store_true", help="skip the slow pandas/openpyxl baseline"
    )
    parser.add_argument(
        "--files",
        type=int,
        default=0,
        help="also time the existence check on this many files (0 = skip)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2,000 rows and 200 files, timed once, in a temporary --workdir",
    )
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.rows, args.repeat, args.files, args.workdir = 2000, 1, 200, Path(tmp)
            args.smoke = False
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    args.workdir.mkdir(parents=True, exist_ok=True)
    frame = synthesize(args.seed)
    if args.rows:
        frame = frame.iloc[: args.rows]
    sheet = args.workdir / f"index_{len(frame)}_seed{args.seed}.xlsx"
    print(
        f"sheet: {sheet} ({len(frame)} rows, {frame['a_cls'].nunique()} classes, "
        f"{frame['a_item'].nunique()} items)"
    )
    if sheet.exists():
        print("  reusing the sheet written by an earlier run")
    else:
        print(f"  written with openpyxl (write-only) in {write_xlsx(frame, sheet):.1f} s")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")

    cache_dir = args.workdir / "cache"
    cfg = DataConfig(
        index=str(sheet),
        path_template="features/{a_id}.npy",
        check_files=False,
        cache_dir=str(cache_dir),
    )
    parse = timed(lambda: index_module.read_table(sheet, cfg), args.repeat)
    first = timed(
        lambda: load_index(cfg),
        args.repeat,
        before=lambda: shutil.rmtree(cache_dir, ignore_errors=True),
    )
    cached = timed(lambda: load_index(cfg), max(args.repeat, 5))
    assert len(load_index(cfg)) == len(frame)
    calamine = timed(
        lambda: pd.read_excel(sheet, engine="calamine", dtype=str, keep_default_na=False),
        args.repeat,
    )

    def line(label: str, seconds: tuple[float, float], target: float | None = None) -> None:
        wall, cpu = seconds
        tail = f"  {verdict(wall, target)}" if target is not None else ""
        print(f"{label:52s} {wall:7.3f} s (cpu {cpu:6.3f} s){tail}")

    print(f"median of {args.repeat} runs (cached: {max(args.repeat, 5)}); wall clock (cpu time)")
    line("first read   load_index, python-calamine, no cache:", first, FIRST_READ_TARGET)
    line("  of which   read_table (parse only):", parse)
    line("cached       load_index, cache hit:", cached, CACHED_TARGET)
    line("baseline     pandas.read_excel(engine='calamine'):", calamine)
    ratios = (
        f"first read / cached: {first[0] / cached[0]:.0f}x   "
        f"pandas calamine / first read: {calamine[0] / first[0]:.2f}x"
    )
    if not args.skip_openpyxl:
        openpyxl_read = timed(
            lambda: pd.read_excel(sheet, engine="openpyxl", dtype=str, keep_default_na=False), 1
        )
        line("baseline     pandas.read_excel(engine='openpyxl'):", openpyxl_read)
        ratios = (
            f"openpyxl / first read: {openpyxl_read[0] / first[0]:.1f}x   "
            f"openpyxl / cached: {openpyxl_read[0] / cached[0]:.0f}x   " + ratios
        )
    print(f"ratios       {ratios}")
    if args.files:
        bench_file_check(args.workdir, args.files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
