"""Benchmark: AdaBN (audioclf.models.adapt) on many short clips on the CPU, before and after
issue 43: every clip on the device at once and one single-clip partial forward per clip per
BatchNorm layer (before: adapt_batchnorm with batch_size=1, the same forwards the old loop ran),
against clips on the host moved a batch of one length at a time (after: its default, 32).

    .venv/bin/python benchmarks/adabn.py                # 20,000 clips of 0.25-0.5 s (8 kHz)
    .venv/bin/python benchmarks/adabn.py --smoke        # 200 clips

Each variant runs in its own process (`--variant`), so its peak resident memory (ru_maxrss) is
its own; prints seconds and peak MiB of each, the speed-up, and whether the adapted statistics
agree (max relative difference of the running means and variances; PASS within 1e-4). The
network is configs/demo_cnn.yaml's CNN at 8 kHz, untrained (the cost does not depend on the
weights), one thread. On a CPU the device is the host, so "before" moves nothing: the memory it
would hold on a GPU (every clip) is printed as clip MiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from audioclf.config import load_config  # noqa: E402
from audioclf.models import build_net  # noqa: E402
from audioclf.models.adapt import adapt_batchnorm, batchnorm_layers  # noqa: E402

LENGTHS = (2000, 2400, 3200, 4000)  # samples at 8 kHz: 0.25-0.5 s, four evaluation lengths


def network():
    cfg = load_config(
        ROOT / "configs" / "demo_cnn.yaml", ["features.sample_rate=8000", "features.n_mels=32"]
    )
    torch.manual_seed(0)
    return build_net(cfg, 0)


def clips_of(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [0.1 * torch.randn(LENGTHS[i % len(LENGTHS)], generator=generator) for i in range(count)]


def run_variant(variant: str, count: int, out: Path) -> None:
    torch.set_num_threads(1)
    net, clips = network(), clips_of(count)
    start = time.perf_counter()
    # before issue 43: one single-clip forward per clip per layer, as batch_size=1 still runs
    adapt_batchnorm(net, clips, batch_size=1 if variant == "before" else 32)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats = {
        f"{k}.{name}": getattr(layer, name).tolist()
        for k, layer in enumerate(batchnorm_layers(net))
        for name in ("running_mean", "running_var")
    }
    out.write_text(json.dumps({"seconds": seconds, "peak_mib": peak, "stats": stats}))


def max_relative_difference(a: dict, b: dict) -> float:
    worst = 0.0
    for key, values in a.items():
        x, y = torch.tensor(values), torch.tensor(b[key])
        worst = max(worst, float(((x - y).abs() / y.abs().clamp(min=1e-6)).max()))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=20000)
    parser.add_argument("--smoke", action="store_true", help="200 clips")
    parser.add_argument("--variant", choices=("before", "after"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    count = 200 if args.smoke else args.clips
    if args.variant:
        run_variant(args.variant, count, args.out)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("before", "after"):
            out = Path(tmp) / f"{variant}.json"
            cmd = [sys.executable, __file__, "--variant", variant, "--out", str(out)]
            subprocess.run([*cmd, "--clips", str(count)], check=True)
            results[variant] = json.loads(out.read_text())
    clip_mib = sum(LENGTHS[i % len(LENGTHS)] for i in range(count)) * 4 / 2**20
    layers = len(results["before"]["stats"]) // 2
    print(f"AdaBN of {count} clips ({clip_mib:.1f} MiB of samples), {layers} BatchNorm layers, CPU")
    print(f"{'variant':<36} {'seconds':>8} {'peak MiB':>9}")
    for variant, label in (("before", "one clip at a time"), ("after", "batches of one length")):
        r = results[variant]
        print(f"{label:<36} {r['seconds']:8.2f} {r['peak_mib']:9.0f}")
    speed = results["before"]["seconds"] / results["after"]["seconds"]
    print(
        f"speed-up: {speed:.1f}x; on a GPU, clips held on the device: {clip_mib:.1f} MiB -> one batch"
    )
    diff = max_relative_difference(results["after"]["stats"], results["before"]["stats"])
    verdict = "PASS" if diff <= 1e-4 else "FAIL"
    print(f"{verdict}: statistics equal to rounding (max relative difference {diff:.1e})")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
