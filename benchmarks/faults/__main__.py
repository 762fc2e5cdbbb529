"""`python -m benchmarks.faults`: run the cases of the matrix, print one row per case and the
summary (see the package's docstring)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import benchmarks.faults
from benchmarks.faults import agents, misuse, outputs, packs, safe_defaults, serving, training
from benchmarks.faults.harness import (
    CONSOLE_LOGS,
    Row,
    Work,
    ensure_demo,
    shorten,
    unmount,
)

CASES = [
    *training.CASES,
    *safe_defaults.CASES,
    *outputs.CASES,
    *misuse.CASES,
    *serving.CASES,
    *packs.CASES,
    *agents.CASES,
]
SMOKE = "kill-mid-write,too-few-classes"  # --smoke: the worker and the process harness, quickly


# ---------------------------------------------------------------------------------------------
# Main


def select(spec: str) -> list[tuple[int, str, Callable]]:
    numbered = [(i + 1, name, fn) for i, (name, fn) in enumerate(CASES)]
    if not spec:
        return numbered
    chosen = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        hits = [c for c in numbered if token == str(c[0]) or c[1].startswith(token)]
        if not hits:
            names = ", ".join(f"{n} {name}" for n, name, _ in numbered)
            raise SystemExit(f"benchmarks.faults: no case {token!r}; the cases are: {names}")
        chosen += [h for h in hits if h not in chosen]
    return sorted(chosen)


def print_table(rows: list[Row], work: Work) -> None:
    header = ("case", "exit", "message the user saw", "ckpt intact", "data lost")
    table = [
        (r.case, r.code, shorten(work.short(r.message)) or "-", r.intact, r.lost) for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *table]) for i in range(5)]
    for line in [header, tuple("-" * w for w in widths), *table]:
        print(" | ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.faults",
        description=benchmarks.faults.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases: " + ", ".join(f"{i + 1} {name}" for i, (name, _) in enumerate(CASES)),
    )
    parser.add_argument(
        "--cases", default="", help="comma-separated case numbers or names (prefixes); default: all"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="work in DIR and keep it (default: a temporary folder, removed)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"only cases {SMOKE} (a kill -9 inside a run by the worker, a refusal under 2 ranks;"
        " about a minute): what tests/project/test_benchmarks_smoke.py runs",
    )
    parser.add_argument(
        "--no-mount",
        action="store_true",
        help="do not mount tmpfs folders: patch ENOSPC / EROFS inside the run",
    )
    args = parser.parse_args(argv)
    cases = select(SMOKE if args.smoke else args.cases)

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        if any(args.keep.iterdir()):
            raise SystemExit(
                f"benchmarks.faults: --keep {args.keep} is not empty; choose a new folder"
            )
        root = args.keep.resolve()
    else:
        root = Path(tempfile.mkdtemp(prefix="audioclf-faults-"))
    work = Work(root, use_mounts=not args.no_mount and os.geteuid() == 0)
    CONSOLE_LOGS.append(root / "console")
    rows: list[Row] = []
    start = time.time()
    try:
        ensure_demo(work)
        for number, name, fn in cases:
            t0 = time.time()
            print(f"[{time.time() - start:5.0f} s] case {number} {name} ...", flush=True)
            try:
                new = fn(work, root / f"{number:02d}-{name}", bool(args.keep))
            except Exception as exc:  # noqa: BLE001 - a broken case is a failed row, not a crash
                new = [
                    Row(
                        f"{number} {name}",
                        "-",
                        f"benchmarks.faults: {type(exc).__name__}: {exc}",
                        problems=[f"the case itself failed: {type(exc).__name__}: {exc}"],
                    )
                ]
            for row in new:
                row.seconds = time.time() - t0
            rows += new
    finally:
        for mount in list(work.mounts):
            unmount(work, mount, bool(args.keep))
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print()
    print_table(rows, work)
    for row in rows:  # a row is as expected when its case's checks held (intact, nothing lost)
        if row.intact == "no" and not any("intact" in p or "load" in p for p in row.problems):
            row.problems.append("checkpoint not intact")
        if row.lost == "yes" and not row.problems:
            row.problems.append("data lost")
    intact = sum(r.intact in ("yes", "n.a.") for r in rows)
    kept = sum(r.lost == "no" for r in rows)
    bad = [r for r in rows if r.problems]
    print(
        f"\n{len(rows)} cases: {intact} checkpoint intact (or n.a.), {kept} nothing lost, "
        f"{len(rows) - len(bad)} as expected; {time.time() - start:.0f} s"
        + (f"; work folder kept in {root}" if args.keep else "")
    )
    for row in bad:
        print(f"NOT AS EXPECTED: {row.case}")
        for problem in row.problems:
            print(f"    - {shorten(work.short(problem), 300)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
