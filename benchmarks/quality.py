"""Benchmark: retrieval quality on real spoken words, a trained config against an MFCC baseline.

Run from the repository root (needs `espeak-ng`; `flite` adds the other-engine column):

    .venv/bin/python benchmarks/quality.py --config configs/demo_cnn.yaml
    .venv/bin/python benchmarks/quality.py --config configs/demo_cnn.yaml --skip-train   # re-evaluate
    .venv/bin/python benchmarks/quality.py --checkpoint runs/x/best.pt --name x       # any checkpoint

1. Data: builds (or reuses) a spoken-word set with espeak-ng in --data (see
   benchmarks/tts_words.py): 40 training words and 20 held-out words, 14 training voices (3 of
   them the validation split) and 6 held-out voices, 4 speed/pitch variants per word and voice.
   Words are the classes; an item is one word said by one voice.
2. Train: `./run.sh --nproc N CONFIG data.index=<train.xlsx> train.name=NAME
   train.runs_dir=RUNS [--set overrides]`, timed by the wall clock (the log goes to
   RUNS/NAME.train.log; INFO lines are echoed). A run folder that already holds last.pt is not
   overwritten: use --skip-train to evaluate it, or another --name.
3. Evaluate `best.pt` on three sets, each on its own: known words said by unseen voices,
   unseen words by unseen voices, and unseen words said by flite (another engine). The metric
   is cross-item retrieval (audioclf.metrics.retrieval_metrics with items=a_item): every clip
   queries the other clips of its set, its own word+voice item excluded, so a hit is the same
   word said by another voice. The sets differ in size, so compare models within a column,
   not columns: chance P@1 is about 0.02 for the known words (40 words) and 0.04 for the other
   two sets (20 words). The baseline, computed in the same run, is untrained: 30 MFCC
   coefficients' mean and std over time, standardised with the training clips' statistics.
4. Prints a Markdown table (train time, P@1 and MAP@R per set) and writes it, with R-precision
   and set sizes, as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import soundfile
import torch
import torchaudio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tts_words  # noqa: E402

from audioclf.metrics import retrieval_metrics  # noqa: E402

EVAL_SETS = {  # tts_words sheet key -> column title
    "known": "known words, unseen voices",
    "unseen": "unseen words + voices",
    "other_engine": "other engine (flite)",
}
N_MFCC = 30
MFCC_ROW = "MFCC mean+std (untrained)"
# Console lines of the training run worth echoing: the logger's "<date> <time> LEVEL ..." lines.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


def say(message: str) -> None:
    print(f"quality: {message}", flush=True)


class BenchmarkError(RuntimeError):
    """Something the user has to fix; printed as one line, exit status 2."""


# --------------------------------------------------------------------------------------------
# Training


def train(args, train_sheet: Path, run_dir: Path) -> float:
    """Train through ./run.sh; returns the wall-clock seconds."""
    command = ["./run.sh", "--nproc", str(args.nproc), str(args.config),
               f"data.index={train_sheet}", f"train.name={run_dir.name}",
               f"train.runs_dir={run_dir.parent}", *args.set]
    log_path = run_dir.parent / f"{run_dir.name}.train.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"training: {' '.join(command)}")
    say(f"training log: {log_path}")
    start = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        for line in process.stdout:
            log.write(line)
            if LOG_LINE.match(line):
                print(f"  {line.rstrip()}", flush=True)
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        tail = log_path.read_text().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        raise BenchmarkError(f"training failed (exit {process.returncode}); see {log_path}")
    (run_dir / "quality_train.json").write_text(
        json.dumps({"train_seconds": seconds, "command": command}, indent=2) + "\n"
    )
    say(f"training took {seconds:.0f} s")
    return seconds


def previous_train_seconds(run_dir: Path) -> float | None:
    record = run_dir / "quality_train.json"
    return json.loads(record.read_text())["train_seconds"] if record.exists() else None


# --------------------------------------------------------------------------------------------
# Evaluation


def read_set(sheet: Path) -> pd.DataFrame:
    table = pd.read_excel(sheet, engine="calamine")
    table["path"] = [str(sheet.parent / path) for path in table["path"]]
    return table


def cross_item(embeddings: np.ndarray, table: pd.DataFrame) -> dict:
    labels = pd.factorize(table["a_cls"])[0]
    result = retrieval_metrics(embeddings, labels, items=table["a_item"].to_numpy())
    return {key: (float(value) if isinstance(value, float) else int(value)) for key, value in result.items()}


def mfcc_features(paths: list[str]) -> np.ndarray:
    """[clips, 2 * N_MFCC]: mean and standard deviation over time of each coefficient."""
    transform = torchaudio.transforms.MFCC(
        sample_rate=tts_words.SAMPLE_RATE, n_mfcc=N_MFCC,
        melkwargs={"n_fft": 400, "hop_length": 160, "n_mels": 40},
    )
    features = np.empty((len(paths), 2 * N_MFCC), dtype=np.float32)
    with torch.no_grad():
        for row, path in enumerate(paths):
            audio, rate = soundfile.read(path, dtype="float32")
            assert rate == tts_words.SAMPLE_RATE, (path, rate)
            coefficients = transform(torch.from_numpy(audio))  # [N_MFCC, frames]
            features[row] = torch.cat([coefficients.mean(dim=1), coefficients.std(dim=1)]).numpy()
    return features


def evaluate(args, sheets: dict[str, Path], checkpoint: Path) -> dict[str, dict]:
    """{row name: {set key: metrics}} for the MFCC baseline and the trained model."""
    from audioclf.inference import embed_files, load_trained

    sets = {key: read_set(sheets[key]) for key in EVAL_SETS if key in sheets}
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")

    say("baseline: MFCC statistics of the training clips (for standardisation)")
    train_table = read_set(sheets["train"])
    train_features = mfcc_features(train_table.loc[train_table["split"] == "train", "path"].tolist())
    mean, std = train_features.mean(axis=0), train_features.std(axis=0) + 1e-8
    results: dict[str, dict] = {MFCC_ROW: {}, args.name: {}}
    for key, table in sets.items():
        features = (mfcc_features(table["path"].tolist()) - mean) / std
        results[MFCC_ROW][key] = cross_item(features, table)
        say(f"baseline on {EVAL_SETS[key]}: {summary(results[MFCC_ROW][key])}")

    say(f"model: loading {checkpoint} on {device}")
    net, cfg, ckpt = load_trained(checkpoint, device)
    for key, table in sets.items():
        started = time.perf_counter()
        embeddings = embed_files(net, cfg, table["path"].tolist(), batch_size=args.batch_size,
                                 device=device, progress=False)
        results[args.name][key] = cross_item(embeddings, table)
        say(f"model on {EVAL_SETS[key]}: {summary(results[args.name][key])} "
            f"({len(table)} clips embedded in {time.perf_counter() - started:.1f} s)")
    return results


def summary(metrics: dict) -> str:
    return (f"P@1 {metrics['precision_at_1']:.3f}, MAP@R {metrics['map_at_r']:.3f} "
            f"({metrics['n_queries']} queries)")


# --------------------------------------------------------------------------------------------
# Report


def markdown_table(results: dict[str, dict], train_seconds: dict[str, float | None],
                   set_keys: list[str]) -> str:
    header = ["model", "train time"]
    for key in set_keys:
        header += [f"{EVAL_SETS[key]} P@1", "MAP@R"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, per_set in results.items():
        seconds = train_seconds.get(name)
        cells = [name, "—" if seconds is None else f"{seconds / 60:.1f} min"]
        for key in set_keys:
            cells += [f"{per_set[key]['precision_at_1']:.3f}", f"{per_set[key]['map_at_r']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def set_sizes(sheets: dict[str, Path]) -> dict[str, dict]:
    sizes = {}
    for key in ("train", *EVAL_SETS):
        if key in sheets:
            table = pd.read_excel(sheets[key], engine="calamine")
            sizes[key] = {"clips": len(table), "words": int(table["a_cls"].nunique()),
                          "items": int(table["a_item"].nunique())}
    return sizes


# --------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="training config (e.g. configs/demo_cnn.yaml)")
    parser.add_argument("--name", help="run name (default: quality_<config file stem>, or the "
                        "checkpoint's folder name with --checkpoint)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/quality"),
                        help="parent of the run folder (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override passed to the training run (repeatable), "
                        "e.g. --set train.epochs=5")
    parser.add_argument("--nproc", type=int, default=2, help="training processes (default: 2)")
    parser.add_argument("--checkpoint", type=Path, help="evaluate this checkpoint, no training")
    parser.add_argument("--skip-train", action="store_true",
                        help="evaluate RUNS/NAME/best.pt from an earlier run instead of training")
    parser.add_argument("--data", type=Path, default=Path("data/quality"),
                        help="dataset cache folder (default: %(default)s); the dataset lives in "
                        "a subfolder named by a hash of its parameters and is reused")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=2,
                        help="TTS processes at a time while building the dataset (default: 2)")
    parser.add_argument("--device", default="auto", help="evaluation device: auto, cpu, cuda, cuda:N")
    parser.add_argument("--batch-size", type=int, default=64, help="evaluation batch size")
    parser.add_argument("--out", type=Path, help="JSON results (default: RUNS/NAME.json)")
    args = parser.parse_args(argv)
    if args.checkpoint is None and args.config is None:
        parser.error("give --config to train (or --checkpoint to evaluate a trained model)")
    if args.checkpoint is not None and (args.skip_train or args.set):
        parser.error("--checkpoint evaluates an existing model: --skip-train and --set do not apply")
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")
    if args.checkpoint is not None and not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint} does not exist")
    if args.name is None:
        args.name = (f"quality_{args.config.stem}" if args.checkpoint is None
                     else args.checkpoint.resolve().parent.name)
    args.runs_dir = args.runs_dir.resolve()
    args.out = args.out or args.runs_dir / f"{args.name}.json"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if shutil.which("espeak-ng") is None:
        print("quality: espeak-ng is not installed; run `apt-get install espeak-ng flite` "
              "(flite for the other-engine column)")
        return 2
    if shutil.which("flite") is None:
        say("flite is not installed: the other-engine column is skipped (apt-get install flite)")

    run_dir = args.runs_dir / args.name
    if args.checkpoint is None and not args.skip_train and (run_dir / "last.pt").exists():
        raise BenchmarkError(
            f"{run_dir} already holds a run (last.pt); use --skip-train to evaluate it, "
            f"--name to train another, or rm -rf {run_dir} to retrain"
        )

    started = time.perf_counter()
    sheets = tts_words.build(args.data, seed=args.seed, jobs=args.jobs, log=say)
    say(f"dataset ready in {time.perf_counter() - started:.0f} s")

    if args.checkpoint is not None:
        checkpoint = args.checkpoint
        train_seconds = previous_train_seconds(checkpoint.parent)
    else:
        checkpoint = run_dir / "best.pt"
        if args.skip_train:
            if not checkpoint.exists():
                raise BenchmarkError(f"--skip-train: {checkpoint} does not exist; train first")
            train_seconds = previous_train_seconds(run_dir)
        else:
            train_seconds = train(args, sheets["train"].resolve(), run_dir)

    results = evaluate(args, sheets, checkpoint)
    set_keys = [key for key in EVAL_SETS if key in sheets]
    table = markdown_table(results, {args.name: train_seconds}, set_keys)
    print()
    print(table)
    print()
    report = {
        "name": args.name,
        "config": str(args.config) if args.config else None,
        "overrides": args.set,
        "checkpoint": str(checkpoint),
        "dataset": str(sheets["train"].parent),
        "set_sizes": set_sizes(sheets),
        "metric": "cross-item retrieval inside each set (query: every clip; candidates: the "
                  "set's clips of other word/voice items)",
        "rows": [
            {"model": name, "train_seconds": train_seconds if name == args.name else None,
             "results": per_set}
            for name, per_set in results.items()
        ],
        "markdown": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchmarkError as exc:
        print(f"quality: error: {exc}", file=sys.stderr)
        sys.exit(2)
