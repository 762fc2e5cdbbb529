"""Cases 24-29 of the fault matrix, what users and machines do to a run (issue 34): a Ctrl-C in
the launcher's first second, kill -9 of the launcher and of ./run.sh, a tracker that is down,
gone or damaged, a full disk under the writers cases 4 and 22 leave out (a new run, export,
prepare), a cohort of one clip copied, and artefacts handed to the wrong reader."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import (
    ROOT,
    Result,
    Row,
    Work,
    alive,
    audioclf_tracebacks,
    check_run,
    checkpoint_intact,
    command_line,
    console_lines,
    copy_run,
    ensure_base,
    ensure_demo,
    error_lines,
    fill,
    first_error_line,
    kill_left,
    log_line,
    mount_tmpfs,
    process_tree,
    python_train,
    read,
    run,
    start,
    tool,
    train_args,
    unmount,
    wait_for,
    worker,
)
from benchmarks.faults.outputs import ensure_embedded, expect_disk_refusal, expect_nothing_left

LAUNCHER = "python -m audioclf.train"
NOT_STARTED = f"{LAUNCHER}: stopped by SIGINT before training started; nothing was saved"
NO_CHECKPOINT = (
    f"{LAUNCHER}: stopped by SIGINT before the first checkpoint: nothing to resume; run the "
    "same command again to start over"
)


def launcher(work: Work, runs: Path, *extra: str) -> list[str]:
    """`python -m audioclf.train --nproc 2` with the tiny config."""
    return [sys.executable, "-m", "audioclf.train", "--nproc", "2", *train_args(work, runs, *extra)]


def expect_one_clean_line(row: Row, result: Result, code: int) -> list[str]:
    """Exit `code`, no traceback, no torch elastic line; returns stderr's lines."""
    lines = console_lines(result.err)
    row.code = str(result.code)
    row.expect(result.code == code, f"exit {result.code}, expected {code}")
    row.expect("Traceback" not in result.console, "the console shows a traceback")
    row.expect("death signal" not in result.console, "torch's elastic warning is shown")
    return lines


# ---------------------------------------------------------------------------------------------
# The launcher: an early Ctrl-C, kill -9 of the launcher and of ./run.sh


def case_launcher_early_ctrl_c(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    rows = []
    for letter, delay, name in (
        ("a", 0.5, "half a second in (the launcher imports)"),
        ("b", 1.0, "one second in"),
    ):
        row = Row(f"24{letter} Ctrl-C {name}: train --nproc 2")
        runs = case_dir / f"runs_{letter}"
        job = start(launcher(work, runs, "train.epochs=100", "eval.every=0"), case_dir / "jobs")
        time.sleep(delay)
        processes = {p: command_line(p) for p in process_tree(job.pid)}
        job.signal(signal.SIGINT)
        result = job.finish(120)
        time.sleep(1)
        left = [p for p, c in processes.items() if alive(p) and command_line(p) == c]
        kill_left(processes)
        lines = expect_one_clean_line(row, result, 130)
        row.message = lines[0] if lines else ""
        row.expect(lines in ([NOT_STARTED], [NO_CHECKPOINT]), f"stderr is not one line: {lines}")
        row.expect(not (runs / "t" / "last.pt").exists(), "a last.pt was written")
        row.expect("last checkpoint saved" not in result.err, "the line claims a last.pt")
        row.expect(not left, f"still running after the launcher ended: {left}")
        rows.append(row)
    return rows


def case_launcher_kill(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    ensure_demo(work)
    rows = []
    for letter, what in (("a", "the launcher (train --nproc 2)"), ("b", "./run.sh --nproc 2")):
        row = Row(f"25{letter} kill -9 of {what}, then resume=auto")
        runs = case_dir / f"runs_{letter}"
        if letter == "a":
            job = start(launcher(work, runs, "train.epochs=300", "eval.every=0"), case_dir / "jobs")
        else:
            config = case_dir / "tiny.yaml"
            save_config(tiny_config(work.index, runs, "cnn", "train.epochs=300", "eval.every=0"),
                        config)  # fmt: skip
            job = start([str(ROOT / "run.sh"), "--nproc", "2", str(config)], case_dir / "jobs")
        ranks_gone = kill_launch(row, job, runs / "t")
        _, ckpt, why = checkpoint_intact(runs / "t" / "last.pt")  # checked whole after the resume
        epochs = (ckpt or {}).get("epoch", 1) + 1
        resume = run(  # on 2 ranks again: a stop mid-epoch continues there only on as many
            launcher(work, runs, "eval.every=0", f"train.epochs={epochs}", "checkpoint.resume=auto")
        )  # fmt: skip
        row.code = f"-9, then {resume.code}"
        row.message = first_error_line(resume.console) or (
            f"ranks gone {ranks_gone:.1f} s after the kill; resume: "
            + log_line(read(runs / "t" / "train.log"), "resumed from").removeprefix("INFO ")
        )
        row.expect(ckpt is not None, f"no last.pt to resume: {why}")
        row.expect(resume.code == 0, f"the resume exited {resume.code}, expected 0")
        check_run(row, runs / "t", epochs_done=epochs, checkpoint_epoch=epochs)
        rows.append(row)
    return rows


def kill_launch(row: Row, job, run_dir: Path) -> float:
    """Once epoch 1 has ended, kill -9 the job's launcher (`python -m audioclf.train --nproc`,
    itself or under ./run.sh); returns how long its ranks then lived (a row problem over 10 s)."""
    if not row.expect(wait_for(run_dir / "train.log", "epoch 1/300:", 150), "epoch 1 never ended"):
        job.signal(signal.SIGKILL)
        return -1.0
    processes = {p: command_line(p) for p in process_tree(job.pid)}
    ranks = [p for p, c in processes.items() if "audioclf.train" in c and "--nproc" not in c]
    row.expect(len(ranks) == 2, f"{len(ranks)} ranks found, expected 2")
    os.kill(job.pid, signal.SIGKILL)  # the launcher, or ./run.sh above it
    killed = time.time()
    while time.time() - killed < 30 and any(alive(p) for p in processes if p != job.pid):
        time.sleep(0.1)
    gone = time.time() - killed
    left = [f"pid {p} ({c[:60]})" for p, c in processes.items() if alive(p)]
    kill_left(processes)
    job.finish(30)
    row.expect(not left and gone < 10, f"{gone:.0f} s after the kill still running: {left}")
    return gone


# ---------------------------------------------------------------------------------------------
# Trackers: down, the run gone, tracker.json damaged


def case_tracker(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from tests.helpers import free_port

    ensure_demo(work)
    row = Row("26a MLFLOW_TRACKING_URI at a closed port")
    runs = case_dir / "runs_a"
    uri = f"http://127.0.0.1:{free_port()}"
    args = train_args(work, runs, "train.tracker=mlflow", "train.epochs=1", "eval.every=0")
    result = run(python_train(args), extra_env={"MLFLOW_TRACKING_URI": uri})
    warned = [line for line in console_lines(result.err) if "does not answer" in line]
    row.code = str(result.code)
    row.message = first_error_line(result.err) or log_line(result.err, "does not answer")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(len(warned) == 1, f"{len(warned)} 'does not answer' lines, expected 1")
    row.expect(not audioclf_tracebacks(result.console), "the console shows a traceback")
    row.expect(result.seconds < 90, f"took {result.seconds:.0f} s")
    check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
    return [row, *tracker_store_rows(work, case_dir)]


def tracker_store_rows(work: Work, case_dir: Path) -> list[Row]:
    """A run with a local MLflow store: the store deleted, then a resume and an evaluate;
    tracker.json cut in half, then a resume."""
    runs = case_dir / "runs_b"
    run_dir = runs / "t"
    env = {}  # the run's own store (runs/t/mlruns): MLFLOW_TRACKING_URI is not set here
    first = run(python_train(train_args(work, runs, "train.tracker=mlflow", "train.epochs=1")),
                extra_env=env)  # fmt: skip
    gone = Row("26b the tracker run deleted, then resume=auto and evaluate")
    if not gone.expect(first.code == 0, f"the first run exited {first.code}"):
        return [gone]
    shutil.rmtree(run_dir / "mlruns")
    resume = run(
        python_train(train_args(work, runs, "train.tracker=mlflow", "train.epochs=2",
                                "checkpoint.resume=auto")),
        extra_env=env,
    )  # fmt: skip
    shutil.rmtree(run_dir / "mlruns", ignore_errors=True)
    evaluate = run(
        tool("evaluate", "--checkpoint", run_dir / "best.pt", "--out", case_dir / "eval",
             "--quiet"),
        extra_env=env,
    )  # fmt: skip
    said = log_line(read(run_dir / "train.log"), "is gone")
    gone.code = f"{resume.code}, {evaluate.code}"
    gone.message = first_error_line(resume.console + evaluate.console) or said
    gone.expect(resume.code == 0 and evaluate.code == 0, "the resume or evaluate failed")
    gone.expect("starting a new mlflow run" in said, "train.log does not say a new run starts")
    gone.expect("not attached to the training's mlflow run" in evaluate.console,
                "evaluate does not say it skipped attaching")  # fmt: skip
    gone.expect(not audioclf_tracebacks(resume.console + evaluate.console), "a traceback")
    check_run(gone, run_dir, epochs_done=2, checkpoint_epoch=2)

    damaged = Row("26c tracker.json cut in half, then resume=auto")
    tracker = run_dir / "tracker.json"
    tracker.write_text(read(tracker)[: len(read(tracker)) // 2])
    result = run(
        python_train(train_args(work, runs, "train.tracker=mlflow", "train.epochs=3",
                                "checkpoint.resume=auto")),
        extra_env=env,
    )  # fmt: skip
    damaged.code, damaged.message = str(result.code), first_error_line(result.console)
    damaged.expect(result.code == 2, f"exit {result.code}, expected 2")
    damaged.expect(len(error_lines(result.console)) == 1, "not one error line")
    damaged.expect(str(tracker) in damaged.message, "the message does not name tracker.json")
    check_run(damaged, run_dir, epochs_done=2, checkpoint_epoch=2)
    return [gone, damaged]


# ---------------------------------------------------------------------------------------------
# A full disk under the writers cases 4 and 22 leave out


def case_full_disk(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    model = ensure_base(work) / "best.pt"
    writers = (
        ("train", lambda d: train_args(work, d / "runs", "train.epochs=1")),
        ("export", lambda d: ["--checkpoint", model, "--format", "torchscript", "--out",
                              d / "export" / "model.pt"]),
        ("prepare", lambda d: ["--index", work.index, "--out", d / "features", "--workers", 1,
                               "--quiet"]),
    )  # fmt: skip
    rows = []
    for letter, (name, arguments) in zip("abc", writers):
        row = Row(f"27{letter} {name}: full disk")
        folder = case_dir / letter
        mounted = mount_tmpfs(work, folder, "1m")
        try:
            args = [str(a) for a in arguments(folder)]
            if mounted:
                fill(folder / "ballast.bin", 0)
                cmd = tool(name, *args)
            else:
                row.case += " [no tmpfs: ENOSPC patched]"
                cmd = worker("full-disk", args, "--tool", name, "--under", str(folder))
            expect_disk_refusal(row, run(cmd), folder, "full disk")
            expect_nothing_left(row, folder)
        finally:
            unmount(work, folder, keep)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# A cohort of one clip copied; artefacts handed to the wrong reader


def case_degenerate_cohort(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    import pandas as pd

    model = ensure_base(work) / "best.pt"
    table = pd.read_excel(work.index, dtype=str, engine="openpyxl")
    copies = table.iloc[[0, 0, 0]].copy()
    copies["path"] = [str(work.index.parent / p) for p in copies["path"]]
    copies["a_id"] = [f"copy{i}" for i in range(3)]
    case_dir.mkdir(parents=True, exist_ok=True)
    copies.to_csv(case_dir / "cohort.csv", index=False)
    out = case_dir / "eval"
    result = run(tool("evaluate", "--checkpoint", model, "--out", out, "--quiet",
                      "--cohort", case_dir / "cohort.csv"))  # fmt: skip
    report = json.loads(read(out / "report.json") or "{}")
    metrics, setup = report.get("metrics", {}), report.get("evaluation", {})
    row = Row("28 a cohort of three copies of one clip (evaluate --cohort)")
    noted = [line for line in console_lines(result.out) if "score normalisation" in line]
    row.code, row.message = str(result.code), first_error_line(result.console) or (noted or [""])[0]
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect("eer" in metrics and "min_dcf" in metrics, "the raw EER / minDCF are not reported")
    row.expect("eer_asnorm" not in metrics, "a normalised EER is reported")
    row.expect("no spread" in setup.get("score_norm_skipped", ""),
               "report.json does not say why the normalised figures are skipped")  # fmt: skip
    row.expect(len(noted) == 1, f"{len(noted)} printed notes, expected 1")
    return [row]


def case_wrong_reader(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base, prefix = ensure_base(work), ensure_embedded(work)
    clip = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    run_dir = copy_run(base, case_dir / "runs", "x")
    several = case_dir / "several"
    several.mkdir()
    for name in ("last.pt", "epoch_0002.pt"):
        shutil.copy(base / "last.pt", several / name)
    readers = (
        ("a", "evaluate --checkpoint <run folder>", ["evaluate", "--checkpoint", run_dir,
                                                     "--quiet"], None),
        ("b", "embed --model PREFIX.npy", ["embed", "--model", f"{prefix}.npy", "--gallery",
                                           work.index, clip], "is a NumPy array (embeddings?)"),
        ("c", "export --checkpoint <the sheet>", ["export", "--checkpoint", work.index,
                                                  "--format", "torchscript", "--out",
                                                  case_dir / "m.pt"], "is a sheet"),
        ("d", "embed --model <a wav>", ["embed", "--model", clip, "--gallery", work.index, clip],
         "is an audio file"),
        ("e", "embed --model <a folder of 2 checkpoints>",
         ["embed", "--model", several, "--gallery", work.index, clip],
         "is a folder holding 2 models and no best.pt (epoch_0002.pt, last.pt)"),
    )  # fmt: skip
    rows = []
    for letter, name, command, said in readers:
        row = Row(f"29{letter} {name}")
        result = run(tool(*command))
        if said is None:  # a run folder stands for its best.pt
            row.code = str(result.code)
            row.message = first_error_line(result.console) or f"report in {run_dir}/eval"
            row.expect(result.code == 0, f"exit {result.code}, expected 0")
            row.expect((run_dir / "eval" / "report.json").is_file(), "no report in <run>/eval")
            row.expect(f"{run_dir / 'best.pt'}" in result.out, "the summary does not name best.pt")
        else:
            lines = expect_one_clean_line(row, result, 2)
            row.message = first_error_line(result.console)
            row.expect(len(lines) == 1 and said in row.message, f"not one line saying {said!r}")
        rows.append(row)
    row = rows[0]
    row.intact, _, why = checkpoint_intact(run_dir / "best.pt")
    row.expect(row.intact == "yes", why)
    return rows


# (name, case) in the matrix's order: cases 24-29
CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("launcher-early-ctrl-c", case_launcher_early_ctrl_c),
    ("launcher-kill", case_launcher_kill),
    ("tracker", case_tracker),
    ("full-disk", case_full_disk),
    ("degenerate-cohort", case_degenerate_cohort),
    ("wrong-reader", case_wrong_reader),
]
