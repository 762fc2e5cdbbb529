"""GPU throughput of the shipped GPU recipes: samples/s per precision, with and without the
data loader, and peak GPU memory.

    python benchmarks/gpu_throughput.py              # on a CUDA machine: about 2 minutes on one H200
    python benchmarks/gpu_throughput.py --device cpu --steps 1 --files 256 \\
        --set sampler.batch_size=8 sampler.m=2 data.num_workers=0 model.cnn.width=8 \\
        model.conformer.num_layers=1 model.conformer.d_model=32 model.conformer.ffn_dim=64
                                                     # every cell, tiny: under a minute on 2 cores

For configs/cnn.yaml and configs/conformer.yaml (model, head, batch size, crop, features, loader
settings as shipped; --set changes them for every cell) and each precision — fp32 (IEEE:
train.tf32=false), tf32 (fp32 with the recipes' train.tf32=true: TF32 matmuls and convolutions
on Ampere and newer), bf16, fp16 — a one-process run is built by audioclf's own Trainer (the augmented dataset and its loader, the
net with its head over the data's classes, configure_backends for TF32 and cuDNN, the wrapped
model, the loss's objective, optimizer, schedule and TrainStep), over a generated set of random
log-mel .npy files in 64 classes on local disk:
  - synthetic: training steps on batches already on the device (the model's own speed);
  - loader: the same steps fed by the real pipeline (memory-mapped .npy crops, augmentation,
    the shipped number of DataLoader workers, the m-per-class sampler, pinned memory), at the
    precision train.precision=auto picks (bf16 on Ampere and newer, fp16 before, fp32 on a CPU).
    The files fit one epoch and sit in the page cache: this measures the workers, not the disk.
    The GPU is busy `synthetic time / loader time` of the time.
A "+pack" cell per model feeds the same steps from a feature pack of the same files (prepare
--pack features.kind=npy: float16, one positioned read per crop, whole batches read in the
workers, float32 on the GPU) at the auto precision, beside the per-file loader.
A "+compile" cell per model in --compile (default: cnn on a GPU, none on a CPU) trains with
train.compile=true at the auto precision, synthetic batches only; its compilation falls in the
warm-up steps.
Each measurement times --steps steps after 3 warm-up steps (cuDNN autotuning, worker start-up).
Peak memory is torch.cuda.max_memory_allocated over the synthetic run. x_fp32 is a cell's
synthetic samples/s over its model's IEEE fp32 cell's.

Prints a line per cell as it finishes, each `PASS|FAIL|SKIP <name>: <detail>` target line as
soon as its cells are measured (conformer bf16 >= 1.8x IEEE fp32 samples/s: against TF32, which
the recipes turn on, a host-bound step gains less, so TF32 is a cell of its own and not the
baseline; the loader keeps the GPU >= 90 % busy, each model) and per cell that could not run
(bf16 on a GPU without native bfloat16 is SKIP, an error is FAIL), then the table at the end.
The +compile cells run last: a run stopped at gpu_check.sh's time limit during a cold
compilation keeps every line printed before it. On a CPU
the targets are SKIP (a smoke run). Exit status 1 when a line is FAIL.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from audioclf import distributed  # noqa: E402
from audioclf.config import Config, load_config  # noqa: E402
from audioclf.data.pack.write import pack_features  # noqa: E402
from audioclf.precision import auto_precision, resolve_precision  # noqa: E402
from audioclf.training.rundir import StopRequested  # noqa: E402
from audioclf.training.trainer import Trainer, TrainHooks  # noqa: E402

MODELS = ("cnn", "conformer")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# Each cell's train.precision and train.tf32; fp32 is IEEE fp32, the speed-up's baseline.
CELL_SETTINGS = {
    "fp32": ("fp32", False),
    "tf32": ("fp32", True),
    "bf16": ("bf16", True),
    "fp16": ("fp16", True),
}
BF16_TARGET = 1.8
BUSY_TARGET = 0.90
WARMUP_STEPS = 3
CLASSES = 64  # of the generated feature set (more when a batch needs more)
ITEMS = 8  # per class


def recipe(model: str, cell: str, device: torch.device, index: Path, overrides) -> Config:
    """The recipe of `model` for a cell of PRECISIONS (its train.precision and train.tf32), or
    for train.precision=auto."""
    precision, tf32 = CELL_SETTINGS.get(cell, (cell, True))
    return load_config(
        ROOT / f"configs/{model}.yaml",
        [
            f"data.index={index}",
            "data.val_ratio=0",
            f"train.precision={precision}",
            f"train.tf32={str(tf32).lower()}",
            f"train.device={device.type}",
            *overrides,
        ],
    )


def write_feature_set(cfg: Config, folder: Path, files: int) -> Path:
    """`files` random log-mel .npy files (frames x n_mels float32, a crop plus 1 s) and their
    index.csv: `classes` classes x ITEMS items, ids spread over them; returns the index."""
    classes = max(CLASSES, cfg.sampler.batch_size // cfg.sampler.m)
    frames = cfg.features.frames(cfg.features.samples(cfg.clips.crop_seconds + 1.0))
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(files):
        path = folder / f"f{i:05d}.npy"
        np.save(path, rng.standard_normal((frames, cfg.features.n_mels), dtype=np.float32))
        rows.append((f"c{i % classes}", f"i{(i // classes) % ITEMS}", f"f{i:05d}", path.name))
    index = folder / "index.csv"
    pd.DataFrame(rows, columns=["a_cls", "a_item", "a_id", "path"]).to_csv(index, index=False)
    return index


def pack_feature_set(cfg: Config, index: Path) -> Path:
    """The feature set of `index` as a feature pack (audioclf.data.pack.write); its index."""
    settings = ["features.kind=npy", f"features.n_mels={cfg.features.n_mels}"]
    pack_cfg = load_config(None, [f"data.index={index}", *settings])
    summary = pack_features(
        index, index.parent / "pack", pack_cfg, workers=4, skip_bad=False, progress=False
    )
    return summary.index_path


def feature_files(cfg: Config, steps: int, files: int) -> int:
    """--files, or enough for one epoch of the warm-up and timed steps (no epoch boundary in
    the loader run), a whole number of files per class."""
    classes = max(CLASSES, cfg.sampler.batch_size // cfg.sampler.m)
    wanted = files or (steps + WARMUP_STEPS + 1) * cfg.sampler.batch_size
    return classes * math.ceil(wanted / classes)


def build_cell(cfg: Config, device: torch.device, name: str) -> Trainer:
    """The parts of a one-process run on `device`, built by the Trainer itself (seeds, the
    train split's augmented dataset and loader, the head over its classes, TF32 / cuDNN, the
    wrapped model, loss, optimizer, schedule and TrainStep) in a throwaway run folder beside
    the feature set; close() it after."""
    cfg.train.runs_dir = str(Path(cfg.data.index).parent / "runs")
    cfg.train.name = f"{cfg.model.name}-{name}".replace("+", "-")
    return Trainer(cfg, distributed.DistEnv(device=device), StopRequested(), TrainHooks())


def synthetic_batches(cfg: Config, count: int, device: torch.device) -> list:
    """`count` (x, lengths, labels, positions) batches of the recipe's shape on the device
    (batch_size / m classes x m items, full-length crops): two distinct ones in turn, so the
    peak memory holds about what a run keeps on the device."""
    g = torch.Generator().manual_seed(0)
    frames = cfg.features.frames(cfg.clips.crop_samples(cfg.features))
    batch, m = cfg.sampler.batch_size, cfg.sampler.m
    labels = torch.arange(batch // m).repeat_interleave(m).to(device)
    lengths = torch.full((batch,), frames, device=device)
    positions = torch.arange(batch, device=device)
    pool = [
        (torch.randn(batch, frames, cfg.features.n_mels, generator=g).to(device), lengths)
        for _ in range(min(2, count))
    ]
    return [(*pool[i % len(pool)], labels, positions) for i in range(count)]


def loader_batches(loader):
    """The train loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        loader.end_epoch()
        epoch += 1


def run_steps(cell: Trainer, batches, cfg: Config) -> int:
    """The Trainer's epoch loop over `batches`: micro-batches, the schedule, an update per
    train.accumulate of them, a host sync every train.log_every_steps updates; the samples."""
    step, accumulate = cell.step, cfg.train.accumulate
    sync_every = max(1, cfg.train.log_every_steps)
    cell.loss_fn.set_epoch(0)
    step.start_epoch()
    updates = 0
    for count, batch in enumerate(batches, start=1):
        closes_group = count % accumulate == 0
        step.micro_batch(batch, sync_grads=closes_group)
        if not closes_group:
            continue
        cell.schedule.apply(updates, 0)
        step.update()
        updates += 1
        if updates % sync_every == 0:
            step.sync(False, updates)
    step.sync(False, updates)
    return step.end_epoch(0.0, stopped=False).samples


def timed_steps(cell: Trainer, batches, cfg: Config, steps: int, device) -> float:
    """Samples/s of `steps` steps from `batches`, after WARMUP_STEPS untimed ones."""
    batches = iter(batches)
    run_steps(cell, islice(batches, WARMUP_STEPS), cfg)
    _synchronize(device)
    start = time.perf_counter()
    samples = run_steps(cell, islice(batches, steps), cfg)
    _synchronize(device)
    return samples / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_refused(cfg: Config, device: torch.device) -> str:
    """Why this GPU cannot run a bf16 cell (resolve_precision refuses it), or ""."""
    if cfg.train.precision != "bf16" or device.type != "cuda":
        return ""
    try:
        resolve_precision(cfg.train, device)
    except ValueError as exc:
        return str(exc)
    return ""


def measure(cfg: Config, device: torch.device, steps: int, with_loader: bool, name: str) -> dict:
    """synthetic_sps, peak_gib and (with_loader) loader_sps, busy of the cell `name`."""
    cell = build_cell(cfg, device, name)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches = synthetic_batches(cfg, WARMUP_STEPS + steps, device)
    synthetic = timed_steps(cell, batches, cfg, steps, device)
    row = {
        "synthetic_sps": synthetic,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else math.nan,
    }
    del batches
    if with_loader:
        loaded = timed_steps(cell, loader_batches(cell.train_loader), cfg, steps, device)
        row.update(loader_sps=loaded, busy=min(1.0, loaded / synthetic))
    cell.metrics.close()
    cell.close()
    return row


def describe(row: dict) -> str:
    """The progress line of a measured cell."""
    line = (
        f"{row['model']:9s} {row['precision']:4s} synthetic {row['synthetic_sps']:9.1f} samples/s"
    )
    if not math.isnan(row["peak_gib"]):
        line += f"  peak {row['peak_gib']:6.2f} GiB"
    if not math.isnan(row["loader_sps"]):
        line += f"  loader {row['loader_sps']:9.1f} samples/s  GPU busy {100 * row['busy']:.0f} %"
    return line


def verdicts(rows: list[dict], device: torch.device, final: bool = True) -> list[str]:
    """The targets' PASS|FAIL lines (SKIP on a CPU, or without the cells they compare).
    final=False (while cells are still to run): no SKIP for a comparison whose cells may come."""
    on_gpu = device.type == "cuda"
    smoke = "" if on_gpu else "; --device cpu is a smoke run: targets are for a GPU"
    by = {(r["model"], r["precision"]): r for r in rows}
    lines = []
    fp32, bf16 = (
        by.get(("conformer", p), {}).get("synthetic_sps", math.nan) for p in ("fp32", "bf16")
    )
    ratio = bf16 / fp32
    compared = ("conformer", "fp32") in by or ("conformer", "bf16") in by
    if compared and (final or not math.isnan(ratio)):
        if math.isnan(ratio):
            status, detail = "SKIP", "no measured conformer fp32 and bf16 cells to compare"
        else:
            status = ("PASS" if ratio >= BF16_TARGET else "FAIL") if on_gpu else "SKIP"
            detail = f"{ratio:.2f}x IEEE fp32 samples/s (target >= {BF16_TARGET}x){smoke}"
        lines.append(f"{status} conformer bf16 speed-up: {detail}")
    for row in rows:
        if math.isnan(row["busy"]):
            continue
        ok = row["busy"] >= BUSY_TARGET
        status = ("PASS" if ok else "FAIL") if on_gpu else "SKIP"
        lines.append(
            f"{status} {row['model']} loader: keeps the GPU {100 * row['busy']:.0f} % busy at "
            f"{row['precision']} (target >= {100 * BUSY_TARGET:.0f} %){smoke}"
        )
    return lines


@dataclass(frozen=True)
class Cell:
    model: str
    name: str  # the table's precision column: fp32, ..., bf16+pack, bf16+compile
    precision: str
    overrides: tuple[str, ...]
    index: Path
    with_loader: bool


def plan_cells(args, device: torch.device, tmp: Path) -> list[Cell]:
    """Every cell of every model (writing each model's feature set and pack under `tmp`), the
    +compile cells last: a cold compilation may outlast what is left of gpu_check.sh's time
    limit, and every cell measured before it is already printed."""
    loader_precision = auto_precision(device)[0]
    compiled = args.compile if args.compile is not None else ["cnn"] * (device.type == "cuda")
    plain, last = [], []
    for model in args.models:
        shipped = recipe(model, "auto", device, tmp / "unused.csv", args.set)
        files = feature_files(shipped, args.steps, args.files)
        index = write_feature_set(shipped, tmp / model, files)
        for p in args.precisions:
            plain.append(Cell(model, p, p, tuple(args.set), index, p == loader_precision))
        packed = pack_feature_set(shipped, index)
        pack = f"{loader_precision}+pack"
        plain.append(Cell(model, pack, loader_precision, tuple(args.set), packed, True))
        if model in compiled:
            compile_set = (*args.set, "train.compile=true")
            name = f"{loader_precision}+compile"
            last.append(Cell(model, name, loader_precision, compile_set, index, False))
    return plain + last


class Reporter:
    """Prints each line once, as soon as it is known (flushed), and keeps them: a run stopped at
    its time limit leaves every finished cell's line and verdict in the log."""

    def __init__(self, device: torch.device):
        self.device = device
        self.printed: list[str] = []

    def say(self, line: str) -> None:
        if line not in self.printed:
            self.printed.append(line)
            print(line, flush=True)

    def verdicts(self, rows: list[dict], final: bool) -> None:
        for line in verdicts(rows, self.device, final):
            self.say(line)


def measure_cells(cells: list, device: torch.device, steps: int, run=None) -> tuple:
    """(rows, reporter) of `cells` in order, each cell's lines and the verdicts it completes
    printed when it finishes. `run(cell, device, steps, reporter) -> row`: run_cell."""
    run = run or run_cell
    report = Reporter(device)
    rows = []
    for cell in cells:
        rows.append(run(cell, device, steps, report))
        report.verdicts(rows, final=False)
    report.verdicts(rows, final=True)
    return rows, report


def run_cell(cell: Cell, device: torch.device, steps: int, report: Reporter) -> dict:
    """The cell's row (NaN where it did not run); its lines printed."""
    cfg = recipe(cell.model, cell.precision, device, cell.index, list(cell.overrides))
    row = {"model": cell.model, "precision": cell.name, "synthetic_sps": math.nan}
    row.update(peak_gib=math.nan, loader_sps=math.nan, busy=math.nan)
    refused = bf16_refused(cfg, device)
    if refused:
        report.say(f"SKIP {cell.model} {cell.name}: {refused}")
        return row
    try:
        row.update(measure(cfg, device, steps, cell.with_loader, cell.name))
    except Exception as exc:  # one cell's failure (an OOM, a kernel error) is a line
        traceback.print_exc()
        report.say(f"FAIL {cell.model} {cell.name}: {type(exc).__name__}: {exc}".splitlines()[0])
        return row
    finally:
        gc.collect()  # the cell's model, optimizer and loader workers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.say(describe(row))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument(
        "--compile",
        nargs="*",
        choices=MODELS,
        help="models measured also with train.compile=true (default: cnn on a GPU, none on a CPU)",
    )
    parser.add_argument(
        "--files", type=int, default=0, help="generated .npy files (default: one epoch's worth)"
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every cell",
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here; pass --device cpu for a smoke run")
        return 2
    if device.type == "cuda" and device.index is None:  # cuda:N, as the Trainer's ranks use
        device = torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory(prefix="audioclf_gpu_") as tmp:
        cells = plan_cells(args, device, Path(tmp))
        rows, report = measure_cells(cells, device, args.steps)
    table = pd.DataFrame(rows)
    fp32 = table[table.precision == "fp32"].set_index("model").synthetic_sps
    table.insert(3, "x_fp32", table.synthetic_sps / table.model.map(fp32))
    print()
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}", na_rep="-"))
    print()
    failed = sum(line.startswith("FAIL") for line in report.printed)
    measured = int(table.synthetic_sps.notna().sum())
    print(
        f"gpu_throughput: {measured} of {len(rows)} cells measured on {device.type}, "
        f"{failed} FAIL line(s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
