"""Benchmark: embed --index on 1 and 2 ranks (gloo, CPU), the same data, one thread per rank.

    .venv/bin/python benchmarks/embed_index.py                 # 4,000 demo clips
    .venv/bin/python benchmarks/embed_index.py --clips 8000 --checkpoint runs/demo_cnn/best.pt
    .venv/bin/python benchmarks/embed_index.py --smoke         # 24 clips in a temporary folder

Generates (or reuses) a demo set of about --clips clips in --data, and a checkpoint: the one
given, or the demo CNN's architecture (configs/demo_cnn.yaml) untrained (embedding cost does not
depend on the weights). Then runs, as a user would,

    python -m audioclf.embed --model M --index SHEET --save PREFIX1 --quiet
    torchrun --standalone --nproc_per_node 2 -m audioclf.embed ... --save PREFIX2 --quiet

with OMP_NUM_THREADS=1 in both runs, so the ratio measures the sharding, not the thread count.
The time is what embed itself reports ("saved ... in T s": loading the model, embedding every
chunk, rank 0 assembling the outputs), so interpreter and torch start-up are left out; the wall
clock of each command is printed beside it. The two are run --repeats times, alternating, and
the fastest of each counts (the machine may be shared: its speed drifts between runs by tens of
percent). Also checks that both runs wrote the same bytes. On CPU each rank is pinned to its
own cores (distributed.pin_to_cores).
Target (issue 20): 2 ranks >= 1.8x the rows/s of 1 rank. Needs 2 idle cores to mean anything:
the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from audioclf.config import load_config, to_dict  # noqa: E402
from audioclf.data.demo import generate_demo  # noqa: E402
from audioclf.models import build_net  # noqa: E402

TARGET = 1.8
TIME = re.compile(r"saved .* in ([0-9.]+) s")


def untrained_checkpoint(path: Path) -> Path:
    """The demo CNN's architecture, untrained, as a checkpoint embed can load."""
    import torch  # noqa: PLC0415 - only when no checkpoint is given

    cfg = load_config(ROOT / "configs" / "demo_cnn.yaml")
    torch.manual_seed(0)
    net = build_net(cfg, 0)
    torch.save({"model": net.state_dict(), "config": to_dict(cfg), "classes": []}, path)
    return path


def embed(command: list[str], prefix: Path) -> tuple[float, float]:
    """(seconds embed reports, wall seconds) of one run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    done = subprocess.run(
        [*command, "--save", str(prefix), "--quiet"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"embed_index: {' '.join(command[:6])} failed:\n{done.stderr[-2000:]}")
    return float(TIME.search(done.stdout).group(1)), wall


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clips", type=int, default=4000, help="demo clips (about)")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "embed_bench")
    parser.add_argument("--checkpoint", type=Path, help="default: the demo CNN, untrained")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; fastest counts")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="24 clips in a temporary folder, one run each: the exit status says only whether "
        "both wrote the same bytes (the ratio of so small a run means nothing)",
    )
    args = parser.parse_args()
    classes, items = (6, 2) if args.smoke else (40, 5)
    ids = 2 if args.smoke else max(1, args.clips // (classes * items))
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data" if args.smoke else args.data
        sheet = generate_demo(data, classes=classes, items=items, ids=ids, seed=0)
        model = args.checkpoint or untrained_checkpoint(work / "model.pt")
        tool = [
            "-m",
            "audioclf.embed",
            "--model",
            str(model),
            "--index",
            str(sheet),
            "--batch-size",
            str(args.batch_size),
            "--num-workers",
            "0",
            "--device",
            "cpu",
        ]
        print(f"embed_index: {classes * items * ids} clips, load average {os.getloadavg()[0]:.1f}")
        launched = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", *tool,
        ]  # fmt: skip
        runs = [
            (embed([sys.executable, *tool], work / "one"), embed(launched, work / "two"))
            for _ in range(repeats)
        ]
        one, one_wall = min(run[0] for run in runs)
        two, two_wall = min(run[1] for run in runs)
        same = np.load(work / "one.npy").tobytes() == np.load(work / "two.npy").tobytes()
    rows = classes * items * ids
    ratio = one / two
    print("| ranks | embed s | rows/s | wall s |")
    print("|---|---|---|---|")
    print(f"| 1 | {one:.1f} | {rows / one:.1f} | {one_wall:.1f} |")
    print(f"| 2 | {two:.1f} | {rows / two:.1f} | {two_wall:.1f} |")
    print(f"2 / 1 rank throughput {ratio:.2f}x (target >= {TARGET}x); outputs identical: {same}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print("PASS" if ratio >= TARGET and same else "FAIL")
    return 0 if same and (ratio >= TARGET or args.smoke) else 1


if __name__ == "__main__":
    sys.exit(main())
