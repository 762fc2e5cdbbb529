"""Benchmark: retrieval quality on real speech and real sounds, a trained config against MFCC.

Run from the repository root (speech needs `espeak-ng`, `flite` adds its other-engine column;
sounds needs `apt-get install fluidsynth timidity fluid-soundfont-gm minuet-data
timgm6mb-soundfont freepats`):

    .venv/bin/python benchmarks/quality.py --config configs/demo_cnn.yaml   # both domains
    .venv/bin/python benchmarks/quality.py --config configs/demo_cnn.yaml --domain sounds --seed 1
    .venv/bin/python benchmarks/quality.py --config configs/demo_cnn.yaml --skip-train   # re-evaluate
    .venv/bin/python benchmarks/quality.py --checkpoint runs/x/best.pt --name x       # any checkpoint
    .venv/bin/python benchmarks/quality.py --smoke   # the demo set, a tiny CNN, 1 epoch: seconds
    .venv/bin/python benchmarks/quality.py --config configs/cpu_small.yaml --unlabelled --seed 1

Each domain (--domain speech, sounds or both, the default) is its own benchmark: its own
dataset, its own training run, its own table.

1. Data: builds (or reuses) each domain's set in --data. Speech (benchmarks/tts_words.py): 40
   training words and 20 held-out words said by espeak-ng, 14 training voices (3 of them the
   validation split) and 6 held-out voices, 4 speed/pitch variants per word and voice; words are
   the classes, an item is one word said by one voice. Sounds (benchmarks/sound_sources.py, in
   --data/sounds): recorded instrument notes from four General-MIDI sound banks (FluidR3 and
   GeneralUser GS for training, TimGM6mb and FreePats held out), 37 training instruments (18 of
   them also played by the held-out banks) and 15 held-out ones, 45 notes per instrument and
   bank; instruments are the classes, an item is one instrument in one bank, and validation is
   4 of the 15 pitches of each training item (cross-bank, on pitches training did not play).
2. Train: `./run.sh --nproc N CONFIG data.index=<train.xlsx> train.name=NAME
   train.runs_dir=RUNS [--set overrides] [train.seed=SEED]` on that domain's training sheet,
   timed by the wall clock (the log goes to RUNS/NAME.train.log; INFO lines are echoed). Speech
   runs live in RUNS/NAME, sounds runs in RUNS/sounds/NAME. A run folder that already holds
   last.pt is not overwritten: use --skip-train to evaluate it, or another --name.
3. Evaluate `best.pt` on the domain's held-out sets, each on its own. Speech: known words said
   by unseen voices, unseen words by unseen voices, and unseen words said by flite (another
   engine). Sounds: training instruments played by the held-out banks, held-out instruments by
   the training banks, and held-out instruments by the held-out banks. The metric is cross-item
   retrieval (audioclf.metrics.retrieval_metrics with items=a_item): every clip queries the other
   clips of its set, its own item excluded, so a hit is the same word said by another voice, or
   the same instrument recorded for another bank. The sets differ in size, so compare models
   within a column, not columns: chance P@1 is about 0.02 for the known words (40 words), 0.04
   for the other speech sets (20 words), 0.06 and 0.07 for the sounds sets (18 and 15
   instruments). The baseline, computed in the same run, is untrained: 30 MFCC coefficients'
   mean and std over time, standardised with the domain's training clips' statistics. With
   --checkpoint, that one model is evaluated on every selected domain. --adapt adds a row: the
   model adapted (AdaBN, audioclf.inference.adapt) on each held-out set's own clips, without
   their labels, then evaluated on that set.
   --unlabelled (issue 45) splits each held-out source's set in two by id (not by item; a fixed
   draw, UNLABELLED_SPLIT_SEED): one half trains without labels (a data.unlabelled sheet beside
   the run, RUNS/NAME.unlabelled.csv), the other half is what that column evaluates, for every
   row (with --checkpoint or --skip-train too, so a baseline model is scored on the same half).
   The held-out sources: speech's other engine; sounds' two unseen-bank columns. The JSON then
   says how many clips each half holds and scores the run's last pseudo-labels against the
   hidden labels (NMI and purity over the kept clips, the kept share, each round's report),
   and the evaluated model's own pseudo-labels of that half cut two ways (a fixed cosine
   distance, and unlabelled.cluster_cut × the labelled classes' gap), each scored the same way.
4. Prints a Markdown table per domain (train time, P@1 and MAP@R per set) and writes them, with
   R-precision and set sizes, as JSON to --out (one "domains" entry per domain).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import soundfile
import torch
import torchaudio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sound_sources  # noqa: E402
import tts_words  # noqa: E402

from audioclf.metrics import retrieval_metrics  # noqa: E402

N_MFCC = 30
MFCC_ROW = "MFCC mean+std (untrained)"
# Console lines of the training run worth echoing: the logger's "<date> <time> LEVEL ..." lines.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


def say(message: str) -> None:
    print(f"quality: {message}", flush=True)


class BenchmarkError(RuntimeError):
    """Something the user has to fix; printed as one line, exit status 2."""


# --------------------------------------------------------------------------------------------
# Domains


@dataclass(frozen=True)
class Domain:
    """One benchmark domain: how its sets are built and what its table calls them."""

    key: str
    title: str
    eval_sets: dict[str, str]  # sheet key -> column title, in table order
    class_noun: str  # what set_sizes calls the classes
    runs_subdir: str  # under --runs-dir; "" for speech, whose runs stayed where they were
    item_noun: str  # for the JSON's metric line
    build: Callable[[argparse.Namespace], dict[str, Path]]  # {sheet key: sheet} of what exists
    check_tools: Callable[[], None]  # raises BenchmarkError when a needed program is missing
    held_out_sources: tuple[str, ...]  # eval sets from a source training never heard (--unlabelled)


def check_speech_tools() -> None:
    if shutil.which("espeak-ng") is None:
        raise BenchmarkError(
            "espeak-ng is not installed; run `apt-get install espeak-ng flite` "
            "(flite for the other-engine column)"
        )
    if shutil.which("flite") is None:
        say("flite is not installed: the other-engine column is skipped (apt-get install flite)")


def build_speech(args) -> dict[str, Path]:
    return tts_words.build(args.data, seed=args.data_seed, jobs=args.jobs, log=say)


def check_sound_tools() -> None:
    try:
        sound_sources.find_sources()
    except sound_sources.ToolMissing as exc:
        raise BenchmarkError(str(exc)) from None


def build_sounds(args) -> dict[str, Path]:
    return sound_sources.build(args.data / "sounds", seed=args.data_seed, jobs=args.jobs, log=say)


def build_demo(args) -> dict[str, Path]:
    """--smoke's set: a small procedural demo (audioclf.data.demo), trained on and evaluated."""
    from audioclf.data.demo import generate_demo  # noqa: PLC0415 - only --smoke needs it

    index = generate_demo(args.data / "demo", classes=6, items=3, ids=4, seed=args.data_seed)
    table = pd.read_excel(index, engine="calamine")
    table["split"] = np.where(table["a_id"].str.endswith("00"), "val", "train")  # 1 clip an item
    sheet = index.with_name("train.xlsx")
    table.to_excel(sheet, index=False)
    return {"train": sheet, "all": index}


# --smoke: every step of a domain (build, ./run.sh training, evaluation, table) in seconds; its
# numbers mean nothing (the model is evaluated on the clips it trained on).
SMOKE_DOMAIN = Domain(
    "demo",
    "the procedural demo set (--smoke)",
    {"all": "every clip"},
    "classes",
    "demo",
    "class/item",
    build_demo,
    lambda: None,
    ("all",),
)
SMOKE_OVERRIDES = [
    "train.epochs=1",
    "train.limit_batches=2",
    "sampler.batch_size=8",
    "sampler.m=2",
    "clips.crop_seconds=0.5",
    "eval.batch_size=16",
    "model.embedding_dim=16",
    "model.cnn.width=8",
    "model.cnn.depth=2",
]

DOMAINS = {
    "speech": Domain(
        "speech",
        "spoken words (espeak-ng, flite)",
        {
            "known": "known words, unseen voices",
            "unseen": "unseen words + voices",
            "other_engine": "other engine (flite)",
        },
        "words",
        "",
        "word/voice",
        build_speech,
        check_speech_tools,
        ("other_engine",),
    ),
    "sounds": Domain(
        "sounds",
        "recorded instrument notes (General-MIDI sound banks)",
        {
            "known_classes_unseen_source": "known instruments, unseen banks",
            "unseen_classes_train_source": "unseen instruments, training banks",
            "unseen_classes_unseen_source": "unseen instruments + banks",
        },
        "classes",
        "sounds",
        "instrument/bank",
        build_sounds,
        check_sound_tools,
        ("known_classes_unseen_source", "unseen_classes_unseen_source"),
    ),
}


# --------------------------------------------------------------------------------------------
# --unlabelled: each held-out source's clips in two halves, by id


UNLABELLED_SPLIT_SEED = 45  # fixed: every run and checkpoint is scored on the same halves


def split_held_out(sets: dict[str, pd.DataFrame], domain: Domain) -> tuple[dict, pd.DataFrame]:
    """(the sets with each held-out source's set cut to its evaluated half, the other halves'
    clips with their hidden labels). The halves are drawn by id, not by item: an item (a word
    said by one engine's voice, an instrument in one bank) usually has clips in both."""
    evaluated, unlabelled = dict(sets), []
    for key in domain.held_out_sources:
        if key not in sets:
            continue
        table = sets[key]
        ids = np.sort(table["a_id"].astype(str).unique())
        rng = np.random.default_rng(UNLABELLED_SPLIT_SEED)
        hidden = set(rng.permutation(ids)[: len(ids) // 2].tolist())
        into_training = table["a_id"].astype(str).isin(hidden).to_numpy()
        evaluated[key] = table[~into_training].reset_index(drop=True)
        unlabelled.append(table[into_training].assign(held_out_set=key))
    if not unlabelled:
        raise BenchmarkError(f"--unlabelled: {domain.key} has no held-out source set built")
    return evaluated, pd.concat(unlabelled, ignore_index=True)


def unlabelled_sheet(args, domain: Domain, unlabelled: pd.DataFrame) -> Path:
    """The training half as a data.unlabelled sheet (path only; the labels stay here)."""
    sheet = run_dir_of(args, domain).parent / f"{args.name}.unlabelled.csv"
    sheet.parent.mkdir(parents=True, exist_ok=True)
    # absolute: data.unlabelled reads a sheet's relative paths against the sheet's own folder
    paths = unlabelled["path"].map(lambda path: str(Path(path).resolve()))
    paths.to_frame("path").to_csv(sheet, index=False)
    say(f"--unlabelled: {len(unlabelled)} held-out clips train without labels ({sheet})")
    return sheet


def pseudo_label_quality(run_dir: Path, unlabelled: pd.DataFrame) -> dict | None:
    """The run's last pseudo-labels scored against the hidden labels: NMI and purity over the
    kept clips, the kept share, and the rounds' reports (None without a checkpoint)."""
    from audioclf import checkpoint as checkpoints

    path = run_dir / "last.pt"
    if not path.exists():
        return None
    state = checkpoints.load(path).get("pseudo_labels")
    if state is None:
        return None
    labels = np.asarray(state["labels"])
    return {**scored_labels(unlabelled, labels), "rounds": state.get("rounds", [])}


def scored_labels(unlabelled: pd.DataFrame, labels: np.ndarray) -> dict:
    """Pseudo-labels (-1: not kept) against the hidden labels: the kept share, and NMI and
    purity over the kept clips (absent when none is kept)."""
    from sklearn.metrics import normalized_mutual_info_score

    truth = pd.factorize(unlabelled["a_cls"])[0]
    kept = labels >= 0
    quality = {"kept_share": float(kept.mean())}
    if kept.any():
        quality["nmi"] = float(normalized_mutual_info_score(truth[kept], labels[kept]))
        majority = sum(np.bincount(truth[labels == k]).max() for k in np.unique(labels[kept]))
        quality["purity"] = float(majority / kept.sum())
    return quality


FIXED_CUT = 0.3  # the cosine distance pseudo-labels were cut at before unlabelled.cluster_cut


def compared_cuts(args, sheets: dict[str, Path], unlabelled: pd.DataFrame, checkpoint: Path):
    """The evaluated model's pseudo-labels of the unlabelled half, cut at a fixed cosine
    distance (FIXED_CUT, every confident cluster kept: the rule before cluster_cut) and as the
    run's config cuts them now (unlabelled.cluster_cut × the labelled classes' gap on the run's
    reference sample of the training split, none below min_reference_p1; at most
    max_pseudo_classes per labelled class),
    each scored against the hidden labels: {rule: scores}. The library's own clustering."""
    from audioclf.inference import LoadedEmbedder, embed_paths
    from audioclf.training.unlabelled import (
        cluster_pseudo_labels,
        pseudo_labels_at_gap,
        reference_rows,
        round_options,
    )

    model = LoadedEmbedder.from_checkpoint(checkpoint, torch.device("cpu"))
    cfg = model.cfg
    train = read_set(sheets["train"])
    train = train[train["split"] == "train"].reset_index(drop=True)
    codes = pd.factorize(train["a_cls"], sort=True)[0]
    rows = reference_rows(codes, cfg.sampler.m, cfg.train.seed)
    batch = {"batch_size": args.batch_size}
    _, clips, _ = embed_paths(model, unlabelled["path"].tolist(), **batch)
    _, reference, _ = embed_paths(model, train["path"].iloc[rows].tolist(), **batch)
    options = round_options(cfg, codes.max() + 1)
    confident = {key: options[key] for key in ("min_size", "min_cohesion", "max_share")}
    fixed, _ = cluster_pseudo_labels(clips, threshold=FIXED_CUT, **confident)
    # the gap rule even for a run that set a fixed cut (an older checkpoint's 0.3)
    at_gap, report = pseudo_labels_at_gap(clips, reference, codes[rows], **options | {"fixed": 0})
    compared = {
        f"fixed cosine {FIXED_CUT}": scored_labels(unlabelled, fixed),
        f"{cfg.unlabelled.cluster_cut:g} x the class gap ({report['threshold']:.3f}), "
        f"{report['kept']} of {report['confident']} clusters": (scored_labels(unlabelled, at_gap)),
    }
    for rule, scores in compared.items():
        say(
            f"pseudo-labels of {checkpoint.parent.name}'s model cut at {rule}: "
            f"NMI {scores.get('nmi', 0):.3f}, purity {scores.get('purity', 0):.3f}, "
            f"{100 * scores['kept_share']:.1f}% of the clips kept"
        )
    return compared


# --------------------------------------------------------------------------------------------
# Training


def train(args, train_sheet: Path, run_dir: Path, unlabelled: Path | None = None) -> float:
    """Train through ./run.sh (with data.unlabelled when given); returns the wall-clock
    seconds."""
    seed = [] if args.seed is None else [f"train.seed={args.seed}"]
    seed += [] if unlabelled is None else [f"data.unlabelled={unlabelled}"]
    command = [
        "./run.sh",
        "--nproc",
        str(args.nproc),
        str(args.config),
        f"data.index={train_sheet}",
        f"train.name={run_dir.name}",
        f"train.runs_dir={run_dir.parent}",
        *args.set,
        *seed,
    ]
    log_path = run_dir.parent / f"{run_dir.name}.train.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"training: {' '.join(command)}")
    say(f"training log: {log_path}")
    start = time.perf_counter()
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process,
    ):
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
    return {
        key: (float(value) if isinstance(value, float) else int(value))
        for key, value in result.items()
    }


def mfcc_features(paths: list[str]) -> np.ndarray:
    """[clips, 2 * N_MFCC]: mean and standard deviation over time of each coefficient."""
    transform = torchaudio.transforms.MFCC(
        sample_rate=tts_words.SAMPLE_RATE,
        n_mfcc=N_MFCC,
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


def evaluate(
    args, domain: Domain, sheets: dict[str, Path], sets: dict[str, pd.DataFrame], checkpoint: Path
) -> dict[str, dict]:
    """{row name: {set key: metrics}} for the MFCC baseline and the trained model on `sets`."""
    from audioclf.inference import LoadedEmbedder, embed_paths

    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )

    say(f"{domain.key} baseline: MFCC statistics of the training clips (for standardisation)")
    train_table = read_set(sheets["train"])
    train_features = mfcc_features(
        train_table.loc[train_table["split"] == "train", "path"].tolist()
    )
    mean, std = train_features.mean(axis=0), train_features.std(axis=0) + 1e-8
    results: dict[str, dict] = {MFCC_ROW: {}, args.name: {}}
    for key, table in sets.items():
        features = (mfcc_features(table["path"].tolist()) - mean) / std
        results[MFCC_ROW][key] = cross_item(features, table)
        say(f"baseline on {domain.eval_sets[key]}: {summary(results[MFCC_ROW][key])}")

    say(f"model: loading {checkpoint} on {device}")
    model = LoadedEmbedder.from_checkpoint(checkpoint, torch.device(device))
    for key, table in sets.items():
        started = time.perf_counter()
        _, embeddings, _ = embed_paths(model, table["path"].tolist(), batch_size=args.batch_size)
        results[args.name][key] = cross_item(embeddings, table)
        say(
            f"model on {domain.eval_sets[key]}: {summary(results[args.name][key])} "
            f"({len(table)} clips embedded in {time.perf_counter() - started:.1f} s)"
        )
    if args.adapt:
        results[f"{args.name} + AdaBN"] = adapted_results(args, domain, sets, model)
    return results


def adapted_results(args, domain: Domain, sets: dict, model) -> dict:
    """The model adapted (AdaBN) on each held-out set's own clips, without labels, then
    evaluated on that set (each set adapts a copy: `model` is left as it is)."""
    from audioclf.inference import embed_paths
    from audioclf.inference.adapt import adapt

    per_set = {}
    for key, table in sets.items():
        paths = table["path"].tolist()
        adapted = adapt(model, paths)
        _, embeddings, _ = embed_paths(adapted, paths, batch_size=args.batch_size)
        per_set[key] = cross_item(embeddings, table)
        record = adapted.adaptation
        say(
            f"model + AdaBN on {domain.eval_sets[key]} ({record['clips']} clips, "
            f"{record['batchnorm_layers']} BatchNorm layers): {summary(per_set[key])}"
        )
    return per_set


def summary(metrics: dict) -> str:
    return (
        f"P@1 {metrics['precision_at_1']:.3f}, MAP@R {metrics['map_at_r']:.3f} "
        f"({metrics['n_queries']} queries)"
    )


# --------------------------------------------------------------------------------------------
# Report


def markdown_table(
    results: dict[str, dict],
    train_seconds: dict[str, float | None],
    eval_sets: dict[str, str],
    set_keys: list[str],
) -> str:
    header = ["model", "train time"]
    for key in set_keys:
        header += [f"{eval_sets[key]} P@1", "MAP@R"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, per_set in results.items():
        seconds = train_seconds.get(name)
        cells = [name, "—" if seconds is None else f"{seconds / 60:.1f} min"]
        for key in set_keys:
            cells += [f"{per_set[key]['precision_at_1']:.3f}", f"{per_set[key]['map_at_r']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def set_sizes(domain: Domain, sheets: dict[str, Path]) -> dict[str, dict]:
    sizes = {}
    for key in ("train", *domain.eval_sets):
        if key in sheets:
            table = pd.read_excel(sheets[key], engine="calamine")
            sizes[key] = {
                "clips": len(table),
                domain.class_noun: int(table["a_cls"].nunique()),
                "items": int(table["a_item"].nunique()),
            }
            if "source" in table:
                sizes[key]["sources"] = int(table["source"].nunique())
            if "split" in table:
                sizes[key]["val_clips"] = int((table["split"] == "val").sum())
    return sizes


# --------------------------------------------------------------------------------------------
# One domain


def run_dir_of(args, domain: Domain) -> Path:
    return args.runs_dir / domain.runs_subdir / args.name


def check_not_trained(args, domain: Domain) -> None:
    run_dir = run_dir_of(args, domain)
    if args.checkpoint is None and not args.skip_train and (run_dir / "last.pt").exists():
        raise BenchmarkError(
            f"{run_dir} already holds a run (last.pt); use --skip-train to evaluate it, "
            f"--name to train another, or rm -rf {run_dir} to retrain"
        )


def model_for(
    args, domain: Domain, sheets: dict[str, Path], unlabelled: Path | None = None
) -> tuple[Path, float | None]:
    """(checkpoint to evaluate, its training seconds or None): trains unless told not to
    (with `unlabelled` as data.unlabelled when given)."""
    if args.checkpoint is not None:
        return args.checkpoint, previous_train_seconds(args.checkpoint.parent)
    run_dir = run_dir_of(args, domain)
    checkpoint = run_dir / "best.pt"
    if not args.skip_train:
        return checkpoint, train(args, sheets["train"].resolve(), run_dir, unlabelled)
    if not checkpoint.exists():
        raise BenchmarkError(f"--skip-train: {checkpoint} does not exist; train first")
    return checkpoint, previous_train_seconds(run_dir)


def run_domain(args, domain: Domain) -> dict:
    """Build, train (or not), evaluate and print one domain; returns its JSON entry."""
    say(f"domain {domain.key}: {domain.title}")
    started = time.perf_counter()
    sheets = domain.build(args)
    say(f"dataset ready in {time.perf_counter() - started:.0f} s")
    sets = {key: read_set(sheets[key]) for key in domain.eval_sets if key in sheets}
    unlabelled = sheet = None
    if args.unlabelled:
        sets, unlabelled = split_held_out(sets, domain)
        if args.checkpoint is None and not args.skip_train:
            sheet = unlabelled_sheet(args, domain, unlabelled)
    checkpoint, train_seconds = model_for(args, domain, sheets, sheet)
    results = evaluate(args, domain, sheets, sets, checkpoint)
    set_keys = [key for key in domain.eval_sets if key in sheets]
    trained = {name: train_seconds for name in results if name != MFCC_ROW}  # adapted: the same
    table = markdown_table(results, trained, domain.eval_sets, set_keys)
    print()
    print(f"{domain.key}: {domain.title}")
    print()
    print(table)
    print()
    extra = {}
    if unlabelled is not None:
        extra = unlabelled_record(domain, sets, unlabelled, checkpoint.parent, trained=sheet)
        extra["unlabelled"]["compared_cuts"] = compared_cuts(args, sheets, unlabelled, checkpoint)
    return {
        **extra,
        "checkpoint": str(checkpoint),
        "dataset": str(sheets["train"].parent),
        "set_sizes": set_sizes(domain, sheets),
        "metric": "cross-item retrieval inside each set (query: every clip; candidates: the "
        f"set's clips of other {domain.item_noun} items)",
        "rows": [
            {
                "model": name,
                "train_seconds": trained.get(name),
                "results": per_set,
            }
            for name, per_set in results.items()
        ],
        "markdown": table,
    }


def unlabelled_record(domain: Domain, sets: dict, unlabelled: pd.DataFrame, run_dir, trained):
    """The JSON's --unlabelled entry: the halves' sizes, and the pseudo-labels' quality."""
    halves = {
        key: {
            "evaluated_clips": len(sets[key]),
            "unlabelled_clips": int((unlabelled["held_out_set"] == key).sum()),
        }
        for key in domain.held_out_sources
        if key in sets
    }
    quality = pseudo_label_quality(run_dir, unlabelled) if trained is not None else None
    if quality is not None and "nmi" in quality:
        say(
            f"pseudo-labels of the last round against the hidden labels: NMI {quality['nmi']:.3f}, "
            f"purity {quality['purity']:.3f}, {100 * quality['kept_share']:.1f}% of the clips kept"
        )
    return {"unlabelled": {"halves": halves, "pseudo_labels": quality}}


# --------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, help="training config (e.g. configs/demo_cnn.yaml)")
    parser.add_argument(
        "--domain",
        choices=("speech", "sounds", "both"),
        default="both",
        help="which benchmark domain(s) to run (default: %(default)s)",
    )
    parser.add_argument(
        "--name",
        help="run name (default: quality_<config file stem>[_seed<N>], "
        "or the checkpoint's folder name with --checkpoint)",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=Path("runs/quality"),
        help="parent of the run folders (default: %(default)s; sounds runs go "
        "in its sounds/ subfolder)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to the training run (repeatable), e.g. --set train.epochs=5",
    )
    parser.add_argument(
        "--seed", type=int, help="training seed, passed as train.seed=SEED (default: the config's)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="training processes (default: 2)")
    parser.add_argument("--checkpoint", type=Path, help="evaluate this checkpoint, no training")
    parser.add_argument(
        "--skip-train",
        action="store_true",
        help="evaluate each domain's RUNS/.../NAME/best.pt from an earlier run",
    )
    parser.add_argument(
        "--adapt",
        action="store_true",
        help="add a row: the model adapted (AdaBN) on each held-out set's own clips, no labels",
    )
    parser.add_argument(
        "--unlabelled",
        action="store_true",
        help="split each held-out source's set in two by id: one half trains as data.unlabelled "
        "(no labels), the other half is evaluated (also with --checkpoint / --skip-train, so a "
        "baseline is scored on the same half)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("data/quality"),
        help="dataset cache folder (default: %(default)s); each dataset lives in "
        "a subfolder named by a hash of its parameters and is reused",
    )
    parser.add_argument(
        "--data-seed",
        type=int,
        default=0,
        help="seed of the datasets' random variants (default: 0)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        choices=(1, 2),
        default=2,
        help="TTS or renderer processes at a time while building a dataset (default: 2)",
    )
    parser.add_argument(
        "--device", default="auto", help="evaluation device: auto, cpu, cuda, cuda:N"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="evaluation batch size")
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON results (default: RUNS/NAME.json, or "
        "RUNS/sounds/NAME.json with --domain sounds)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run, in a temporary folder: the demo set, configs/demo_cnn.yaml "
        "shrunk to a tiny CNN and 1 epoch, 1 process",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.set, args.nproc = ROOT / "configs" / "demo_cnn.yaml", SMOKE_OVERRIDES, 1
        work = Path(tempfile.mkdtemp(prefix="quality-smoke-"))
        args.data, args.runs_dir, args.out = work / "data", work / "runs", work / "smoke.json"
        args.device, args.work = "cpu", work
    check_args(parser, args)
    if args.name is None:
        seed = "" if args.seed is None else f"_seed{args.seed}"
        args.name = (
            f"quality_{args.config.stem}{seed}"
            if args.checkpoint is None
            else args.checkpoint.resolve().parent.name
        )
    args.runs_dir = args.runs_dir.resolve()
    args.domains = [DOMAINS[key] for key in DOMAINS if args.domain in (key, "both")]
    if args.smoke:
        args.domains = [SMOKE_DOMAIN]
    args.out = args.out or args.runs_dir / args.domains[0].runs_subdir / f"{args.name}.json"
    return args


def check_args(parser, args) -> None:
    if args.checkpoint is None and args.config is None:
        parser.error("give --config to train (or --checkpoint to evaluate a trained model)")
    if args.checkpoint is not None and (args.skip_train or args.set or args.seed is not None):
        parser.error(
            "--checkpoint evaluates an existing model: --skip-train, --set and --seed do not apply"
        )
    if args.seed is not None and any(item.startswith("train.seed=") for item in args.set):
        parser.error("give the training seed once: --seed N or --set train.seed=N")
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")
    if args.checkpoint is not None and not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint} does not exist")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    finally:
        if args.smoke:
            shutil.rmtree(args.work, ignore_errors=True)


def run(args) -> int:
    for domain in args.domains:  # every check before the first minute of work
        domain.check_tools()
        check_not_trained(args, domain)
    report = {
        "name": args.name,
        "config": str(args.config) if args.config else None,
        "overrides": args.set,
        "seed": args.seed,
        "domains": {},
    }
    for domain in args.domains:
        report["domains"][domain.key] = run_domain(args, domain)
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
