"""GPU throughput of the shipped GPU recipes: samples/s per precision, with and without the
data loader, and peak GPU memory.

    .venv/bin/python benchmarks/gpu_throughput.py                 # on a CUDA machine
    .venv/bin/python benchmarks/gpu_throughput.py --device cpu --steps 3 --models cnn   # smoke run

For configs/cnn.yaml and configs/conformer.yaml (model, batch size, crop and features as
shipped) and each precision (fp32, bf16, fp16):
  - synthetic: training steps (audioclf's TrainStep: forward, triplet loss, backward,
    clip, optimizer) on batches already on the device — the model's own speed;
  - loader: the same steps fed by the real pipeline (npy crops read by the shipped number of
    DataLoader workers through the m-per-class sampler, pinned memory), over a generated
    feature set on local disk — the GPU is busy `synthetic time / loader time` of the time.
Peak memory is torch.cuda.max_memory_allocated over the synthetic run.

Targets (PASS/FAIL lines): bf16 ≥ 1.8× fp32 samples/s on the Conformer recipe; the loader keeps
the GPU ≥ 90 % busy (bf16, each model). Exit status 1 when a target fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from audioclf.config import load_config  # noqa: E402
from audioclf.data.dataset import AudioDataset  # noqa: E402
from audioclf.data.loader import TrainLoader, loader_kwargs  # noqa: E402
from audioclf.losses import build_loss  # noqa: E402
from audioclf.models import build_net  # noqa: E402
from audioclf.optim import build_optimizer  # noqa: E402
from audioclf.precision import resolve_precision  # noqa: E402
from audioclf.sampler import MPerClassSampler  # noqa: E402
from audioclf.step import NonFiniteGuard, TrainStep  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16")
BF16_TARGET = 1.8
BUSY_TARGET = 0.90


def recipe(model: str, precision: str, device: torch.device, overrides: list[str]):
    cfg = load_config(
        ROOT / f"configs/{model}.yaml",
        [f"train.precision={precision}", f"train.device={device.type}", *overrides],
    )
    return cfg


def synthetic_batches(cfg, steps: int, device: torch.device, seed: int = 0):
    """Log-mel batches of the recipe's shape on the device (npy recipes take features)."""
    g = torch.Generator().manual_seed(seed)
    frames = cfg.clips.crop_frames(cfg.features)
    classes = cfg.sampler.batch_size // cfg.sampler.m
    labels = torch.arange(classes).repeat_interleave(cfg.sampler.m)
    out = []
    for _ in range(steps):
        x = torch.randn(cfg.sampler.batch_size, frames, cfg.features.n_mels, generator=g)
        out.append(
            (
                x.to(device),
                torch.full((len(x),), frames, device=device),
                labels.to(device),
                torch.arange(len(x), device=device),
            )
        )
    return out


def train_steps(cfg, device: torch.device, batches) -> tuple[float, int]:
    """(seconds for the steps after 3 warm-up steps, samples in them)."""
    torch.manual_seed(0)
    net = build_net(cfg, 0).to(device)
    optimizer = build_optimizer(net.parameters(), cfg.optim, device)
    precision = resolve_precision(cfg.train, device)
    loss_core = build_loss(cfg)

    def loss_fn(output, labels):
        return loss_core(output[0], labels, output[1])

    step = TrainStep(
        net,
        optimizer,
        precision,
        loss_fn,
        guard=NonFiniteGuard(10),
        max_grad_norm=cfg.optim.max_grad_norm,
    )
    warm = iter(batches)
    run_steps(step, [next(warm) for _ in range(3)], cfg.train.log_every_steps)
    _synchronize(device)
    start = time.perf_counter()
    result = run_steps(step, batches, cfg.train.log_every_steps)
    _synchronize(device)
    return time.perf_counter() - start, result.samples


def run_steps(step: TrainStep, batches, sync_every: int):
    """The Trainer's loop without a loader: an update per batch, a sync every `sync_every`."""
    step.start_epoch()
    count = 0
    for count, batch in enumerate(batches, start=1):
        step.micro_batch(batch)
        step.update()
        if count % max(1, sync_every) == 0:
            step.sync(False, count)
    step.sync(False, count)
    return step.end_epoch(0.0, stopped=False)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def feature_set(
    cfg, folder: Path, files: int, seconds: float
) -> tuple[np.ndarray, np.ndarray, list]:
    """`files` random log-mel .npy files (frames x n_mels float32) in 64 classes x 8 items."""
    rng = np.random.default_rng(0)
    frames = int(seconds * cfg.features.sample_rate / cfg.features.hop_length)
    paths, classes, items = [], [], []
    for i in range(files):
        path = folder / f"f{i:05d}.npy"
        if not path.exists():
            np.save(path, rng.standard_normal((frames, cfg.features.n_mels)).astype(np.float32))
        paths.append(str(path))
        classes.append(i % 64)
        items.append((i // 64) % 8)
    return np.array(classes), np.array(items), paths


def loader_batches(cfg, device: torch.device, classes, items, paths, steps: int):
    """The real input pipeline as the trainer builds it, cut to `steps` batches."""
    dataset = AudioDataset(paths, classes, cfg.features, cfg.clips, train=True)
    sampler = MPerClassSampler(
        classes,
        items,
        batch_size=cfg.sampler.batch_size,
        m=cfg.sampler.m,
        seed=0,
        split=cfg.sampler.split,
    )
    options = loader_kwargs(
        cfg.data.num_workers,
        cfg.data.pin_memory,
        cfg.data.persistent_workers,
        cfg.data.prefetch_factor,
        device,
    )
    loader = TrainLoader(dataset, sampler, seed=0, **options)
    served, epoch = 0, 0
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield batch
            served += 1
            if served == steps:
                return
        loader.end_epoch()
        epoch += 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--models", nargs="+", default=["cnn", "conformer"])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--files", type=int, default=2048, help="generated .npy files")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra config overrides for every run",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here; pass --device cpu for a smoke run")
        return 2
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="audioclf_gpu_") as tmp:
        for model in args.models:
            for precision in args.precisions:
                cfg = recipe(model, precision, device, args.set)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                seconds, samples = train_steps(
                    cfg, device, synthetic_batches(cfg, args.steps, device)
                )
                peak = (
                    torch.cuda.max_memory_allocated(device) / 2**30
                    if device.type == "cuda"
                    else 0.0
                )
                row = {
                    "model": model,
                    "precision": precision,
                    "synthetic_sps": samples / seconds,
                    "peak_gib": peak,
                    "loader_sps": None,
                    "busy": None,
                }
                if precision == "bf16" or device.type == "cpu":
                    folder = Path(tmp) / f"{model}_{cfg.features.n_mels}"
                    folder.mkdir(exist_ok=True)
                    data = feature_set(cfg, folder, args.files, cfg.clips.crop_seconds + 1.0)
                    loaded_seconds, loaded = train_steps(
                        cfg, device, loader_batches(cfg, device, *data, steps=args.steps + 3)
                    )
                    row["loader_sps"] = loaded / loaded_seconds
                    row["busy"] = min(1.0, row["loader_sps"] / row["synthetic_sps"])
                rows.append(row)
                print(
                    f"{model:9s} {precision:4s} synthetic {row['synthetic_sps']:9.1f} samples/s"
                    f"  peak {peak:6.2f} GiB"
                    + (
                        f"  loader {row['loader_sps']:9.1f} samples/s  GPU busy "
                        f"{100 * row['busy']:.0f} %"
                        if row["loader_sps"]
                        else ""
                    ),
                    flush=True,
                )
    table = pd.DataFrame(rows)
    print()
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    by = {(r["model"], r["precision"]): r for r in rows}
    if ("conformer", "fp32") in by and ("conformer", "bf16") in by:
        ratio = by["conformer", "bf16"]["synthetic_sps"] / by["conformer", "fp32"]["synthetic_sps"]
        ok = ratio >= BF16_TARGET
        print(
            f"{'PASS' if ok else 'FAIL'} conformer bf16 / fp32 samples/s = {ratio:.2f}x "
            f"(target >= {BF16_TARGET}x)"
        )
        failures += [] if ok else ["bf16 speed-up"]
    for row in rows:
        if row["busy"] is not None and row["precision"] == "bf16":
            ok = row["busy"] >= BUSY_TARGET
            print(
                f"{'PASS' if ok else 'FAIL'} {row['model']} data loader keeps the GPU "
                f"{100 * row['busy']:.0f} % busy (target >= {100 * BUSY_TARGET:.0f} %)"
            )
            failures += [] if ok else [f"{row['model']} loader"]
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
