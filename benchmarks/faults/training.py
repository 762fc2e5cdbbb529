"""Cases 1-14 of the fault matrix: faults in and around a training run (a NaN or cut wav, a
full or read-only disk, kill -9 in torch.save, a failing rank, a mid-epoch checkpoint on another
world size, ./run.sh stop, an infinite learning rate, a corrupt model given to embed)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import (
    ROOT,
    TRAIN_ERROR,
    Row,
    Work,
    audioclf_tracebacks,
    check_run,
    checkpoint_intact,
    console_lines,
    copy_run,
    ensure_base,
    ensure_demo,
    error_lines,
    first_error_line,
    leftovers,
    log_line,
    metrics_rows,
    mount_tmpfs,
    python_train,
    read,
    remount_read_only,
    run,
    sheet_with_bad_class,
    torchrun,
    train_args,
    unmount,
    worker,
    write_nan_wav,
    write_truncated_wav,
)

# ---------------------------------------------------------------------------------------------
# The cases. Each returns its rows; `case_dir` is its own folder under the work folder.


def case_nan_wav(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    sheet, bad = sheet_with_bad_class(work, case_dir / "bad", write_nan_wav)
    runs = case_dir / "runs"
    common = [f"data.index={sheet}", "train.epochs=2", "eval.every=0", "train.limit_batches=6"]

    row = Row("1a nan-wav")
    result = run(python_train(train_args(work, runs, *common)))
    row.code, row.message = str(result.code), first_error_line(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(
        len(error_lines(result.console)) == 1,
        f"{len(error_lines(result.console))} error lines, expected 1",
    )
    row.expect(any(str(p) in row.message for p in bad), "the message names no bad file")
    row.expect("row" in row.message, "the message names no sheet row")
    row.expect("non-finite" in row.message or "NaN" in row.message, "the message does not say NaN")
    check_run(row, runs / "t", epochs_done=0, checkpoint_epoch=None)
    row.expect(not (runs / "t" / "last.pt").exists(), "a last.pt was written")

    skip = Row("1b nan-wav skip_bad_files")
    runs = case_dir / "runs_skip"
    result = run(python_train(train_args(work, runs, *common, "data.skip_bad_files=true")))
    log = read(runs / "t" / "train.log")
    skip.code = str(result.code)
    skip.message = first_error_line(result.err) or log_line(log, "unreadable file(s) skipped")
    skip.expect(result.code == 0, f"exit {result.code}, expected 0: {first_error_line(result.err)}")
    check_run(skip, runs / "t", epochs_done=2, checkpoint_epoch=2)
    rows = metrics_rows(runs / "t")
    skipped = sum(int(r.get("skipped_files") or 0) for r in rows)
    skip.expect(
        bool(rows) and "skipped_files" in rows[0], "metrics.csv has no skipped_files column"
    )
    skip.expect(skipped > 0, "metrics.csv counts no skipped file")
    skip.expect("unreadable file(s) skipped" in log, "train.log does not count the skips")
    return [row, skip]


def case_export_nan(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    import torch

    base = ensure_base(work)
    case_dir.mkdir(parents=True, exist_ok=True)
    ckpt = torch.load(base / "last.pt", map_location="cpu", weights_only=False)
    ckpt["model"] = {
        k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
        for k, v in ckpt["model"].items()
    }
    nan_pt = case_dir / "nan.pt"
    torch.save(ckpt, nan_pt)
    out_dir = case_dir / "export"

    row = Row("2a export a NaN model")
    result = run(
        [
            sys.executable,
            "-m",
            "audioclf.export",
            "--checkpoint",
            str(nan_pt),
            "--format",
            "torchscript",
            "--out",
            str(out_dir / "model.pt"),
        ]
    )
    row.code, row.message = str(result.code), first_error_line(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    lines = console_lines(result.err)
    row.expect(len(lines) == 1, f"stderr has {len(lines)} lines, expected 1: {lines[:3]}")
    written = (
        sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")) if out_dir.exists() else []
    )
    row.expect(not written, f"export wrote {written}")

    embed = Row("2b embed with a NaN model")
    clip = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    result = run(
        [
            sys.executable,
            "-m",
            "audioclf.embed",
            "--model",
            str(nan_pt),
            "--gallery",
            str(work.index),
            "--quiet",
            "--no-cache",
            str(clip),
        ]
    )
    embed.code, embed.message = str(result.code), first_error_line(result.err)
    embed.expect(result.code == 2, f"exit {result.code}, expected 2")
    embed.expect(len(error_lines(result.console)) == 1, "not one error line")
    embed.expect("NaN" in embed.message, "the message does not say NaN")
    return [row, embed]


def case_resume_architecture(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base = ensure_base(work)
    runs = case_dir / "runs"
    run_dir = copy_run(base, runs)
    resume = ["train.epochs=3", "eval.every=0", "checkpoint.resume=auto"]
    rows = []
    for name, change, key in (
        ("3a resume, cnn.width changed", "model.cnn.width=16", "model.cnn.width"),
        ("3b resume, model.name=conformer", "model.name=conformer", "model.name"),
    ):
        row = Row(name)
        result = run(python_train(train_args(work, runs, *resume, change)))
        row.code, row.message = str(result.code), first_error_line(result.err)
        row.expect(result.code == 2, f"exit {result.code}, expected 2")
        row.expect(len(error_lines(result.console)) == 1, "not one error line")
        row.expect(key in row.message, f"the message does not name {key}")
        row.expect("resume_strict=false" in row.message, "the message does not name the way out")
        check_run(row, run_dir, epochs_done=2, checkpoint_epoch=2)
        rows.append(row)

    row = Row("3c resume, width changed, resume_strict=false")
    result = run(
        python_train(
            train_args(work, runs, *resume, "model.cnn.width=16", "checkpoint.resume_strict=false")
        )
    )
    log = read(run_dir / "train.log")
    row.code = str(result.code)
    row.message = first_error_line(result.err) or log_line(log, "resume_strict=false")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(
        "resume_strict=false" in log and "model.cnn.width" in log,
        "train.log does not say it resumed with the checkpoint's settings",
    )
    check_run(row, run_dir, epochs_done=3, checkpoint_epoch=3)
    rows.append(row)
    return rows


def case_disk(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    rows = []

    # Full disk: the run folder lies on a 4 MiB tmpfs; at the first step of epoch 2 a ballast
    # file fills it to 64 KiB free (the checkpoint is ~130 kB), as another job's output would.
    row = Row("4a disk full at the epoch-2 checkpoint")
    disk = case_dir / "disk"
    mounted = mount_tmpfs(work, disk, "4m")
    try:
        runs = disk / "runs"
        args = train_args(work, runs, "train.epochs=3", "eval.every=0")
        if mounted:
            cmd = worker(
                "fill-disk",
                args,
                "--at-epoch",
                "2",
                "--ballast",
                str(disk / "ballast.bin"),
                "--free-kb",
                "64",
            )
        else:
            row.case += " [no tmpfs: ENOSPC patched]"
            cmd = worker("enospc", args, "--at", "2")
        result = run(cmd)
        row.code, row.message = str(result.code), first_error_line(result.err)
        row.expect(result.code == 2, f"exit {result.code}, expected 2")
        row.expect(
            len(error_lines(result.console)) == 1,
            f"{len(error_lines(result.console))} error lines, expected 1",
        )
        row.expect(
            "last.pt" in row.message and "GiB free on" in row.message,
            "the message does not name the path and the free space",
        )
        row.expect(
            "No space left" in row.message or "disk full" in row.message,
            "the message does not say the disk is full",
        )
        check_run(row, runs / "t", epochs_done=2, checkpoint_epoch=1)
    finally:
        unmount(work, disk, keep)
    rows.append(row)

    # A read-only runs dir: a fresh start, and a resume of a finished run.
    for name, resume in (
        ("4b read-only runs dir, fresh start", False),
        ("4c read-only runs dir, resume", True),
    ):
        row = Row(name)
        ro = case_dir / ("ro_resume" if resume else "ro_fresh")
        mounted = mount_tmpfs(work, ro, "8m")
        try:
            if resume:
                copy_run(ensure_base(work), ro)
            extra = ["train.epochs=3", "checkpoint.resume=auto"] if resume else ["train.epochs=1"]
            args = train_args(work, ro, *extra)
            if mounted and remount_read_only(ro):
                cmd = python_train(args)
            else:
                row.case += " [no tmpfs: EROFS patched]"
                cmd = worker("erofs", args, "--under", str(ro))
            result = run(cmd)
            row.code, row.message = str(result.code), first_error_line(result.err)
            row.expect(result.code == 2, f"exit {result.code}, expected 2")
            row.expect(
                len(error_lines(result.console)) == 1,
                f"{len(error_lines(result.console))} error lines, expected 1",
            )
            row.expect(
                str(ro) in row.message and "Read-only" in row.message,
                "the message does not name the path and the read-only file system",
            )
            row.expect(
                ".tmp" not in row.message,
                "the message names a temporary file, not the file that could not be "
                "written (an error while removing the temporary file hid the real one)",
            )
            if resume:
                check_run(row, ro / "t", epochs_done=2, checkpoint_epoch=2)
            else:
                row.expect(not (ro / "t").exists(), "a run folder was created")
        finally:
            unmount(work, ro, keep)
        rows.append(row)
    return rows


def case_kill_mid_write(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    run_dir = runs / "t"
    common = ["train.epochs=2", "eval.every=0", "checkpoint.every_steps=1"]
    row = Row("5 kill -9 during a checkpoint write, resume")
    # SIGKILL from inside torch.save, halfway through the 3rd write (steps 1 and 2 are saved).
    killed = run(worker("kill-in-save", train_args(work, runs, *common), "--at", "3"))
    stale = [p.name for p in run_dir.glob(".*.tmp")]
    row.expect(killed.code == -signal.SIGKILL, f"the killed run exited {killed.code}, not -9")
    row.expect(len(stale) == 1, f"expected one stale temporary file after the kill, found {stale}")
    row.intact, ckpt, why = checkpoint_intact(run_dir / "last.pt")
    row.expect(row.intact == "yes", why)
    row.expect(
        ckpt is not None and ckpt["step"] == 2,
        f"last.pt after the kill holds step {ckpt and ckpt.get('step')}, expected 2",
    )

    result = run(python_train(train_args(work, runs, *common, "checkpoint.resume=auto")))
    log = read(run_dir / "train.log")
    row.code = f"-9, then {result.code}"
    row.message = first_error_line(result.err) or log_line(log, "temporary file")
    row.expect(result.code == 0, f"the resume exited {result.code}")
    row.expect("removed 1 temporary file(s)" in log, "train.log does not say the temp was removed")
    row.expect(
        "at epoch 0, batch 2, step 2" in log,
        "the resume did not continue from the last complete checkpoint (step 2)",
    )
    after_kill = row.intact
    check_run(row, run_dir, epochs_done=2, checkpoint_epoch=2)  # and the one the resume wrote
    row.intact = "yes" if after_kill == row.intact == "yes" else "no"
    return [row]


def case_all_unreadable(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from tests.helpers import broken_copy

    ensure_demo(work)
    sheet = broken_copy(work.index, case_dir)
    runs = case_dir / "runs"
    row = Row("6 every file unreadable, skip_bad_files, 2 ranks")
    result = run(
        torchrun(
            [
                "-m",
                "audioclf.train",
                *train_args(
                    work,
                    runs,
                    f"data.index={sheet}",
                    "data.skip_bad_files=true",
                    "data.check_files=false",
                    "train.epochs=1",
                    "eval.every=0",
                ),
            ]
        ),
        timeout=180,
    )
    log = read(runs / "t" / "train.log")
    row.code = str(result.code)
    row.message = first_error_line(result.err) or log_line(log, "unreadable file(s) skipped")
    row.expect(result.code == 0, f"exit {result.code}, expected 0 (no hang)")
    rows = metrics_rows(runs / "t")
    row.expect(
        bool(rows) and int(rows[0].get("skipped_batches") or 0) > 0,
        "metrics.csv counts no skipped batch",
    )
    check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
    return [row]


def case_fail_rank1(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    row = Row("7 failure on rank 1 at step 2, 2 ranks")
    result = run(
        torchrun(
            [
                "-m",
                "tests.train_hooks",
                "--fail-at-step=2",
                "--rank=1",
                "--",
                *train_args(work, runs, "train.epochs=2", "eval.every=0"),
            ]
        )
    )
    log = read(runs / "t" / "train.log")
    errors = [line for line in console_lines(result.console) if "audioclf.train: error:" in line]
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code != 0, "exit 0 after a failure")
    row.expect(
        errors == [f"{TRAIN_ERROR} injected failure on rank 1 at step 2"],
        f"error lines on the console: {errors}",
    )
    row.expect(
        "rank 1" in log and "injected failure on rank 1" in log, "train.log does not name rank 1"
    )
    row.expect("Traceback" not in log, "train.log holds a traceback")
    row.expect(not audioclf_tracebacks(result.console), "the console shows a traceback")
    check_run(row, runs / "t", epochs_done=0, checkpoint_epoch=None)
    return [row]


def expect_one_error_line(row: Row, result) -> None:
    """Record the exit code and the first error line; expect a failure with exactly one."""
    errors = error_lines(result.console)
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code != 0, "exit 0")
    row.expect(len(errors) == 1, f"{len(errors)} error lines, expected 1")


def case_too_few_classes(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    row = Row("8 too few classes per rank (batch 16), 2 ranks")
    result = run(
        torchrun(["-m", "audioclf.train", *train_args(work, runs, "sampler.batch_size=16")])
    )
    expect_one_error_line(row, result)
    row.expect("classes per batch" in row.message, "the message does not name classes per batch")
    row.expect(not (runs / "t").exists(), "a run folder was left behind")
    row.expect(not audioclf_tracebacks(result.console), "the console shows a traceback")
    return [row]


def case_mid_epoch_world(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    run_dir = runs / "t"
    common = ["train.epochs=2", "eval.every=0"]
    stopped = run(worker("stop-at", train_args(work, runs, *common), "--at", "3"))
    if stopped.code != 0:
        return [
            Row(
                "9 mid-epoch checkpoint on 2 ranks",
                str(stopped.code),
                first_error_line(stopped.err),
                problems=["the 1-rank run did not stop cleanly"],
            )
        ]
    rows = []
    row = Row("9a mid-epoch ckpt (1 rank) resumed on 2 ranks")
    result = run(
        torchrun(
            ["-m", "audioclf.train", *train_args(work, runs, *common, "checkpoint.resume=auto")]
        )
    )
    expect_one_error_line(row, result)
    row.expect("checkpoint.restart_epoch" in row.message, "the message does not name the key")
    row.intact, ckpt, why = checkpoint_intact(run_dir / "last.pt")
    row.expect(
        row.intact == "yes" and ckpt["position"] == 3,
        why or f"last.pt is at batch {ckpt['position']}, not 3",
    )
    row.lost = "yes" if leftovers(run_dir) else "no"
    rows.append(row)

    row = Row("9b the same with checkpoint.restart_epoch=true")
    result = run(
        torchrun(
            [
                "-m",
                "audioclf.train",
                *train_args(
                    work, runs, *common, "checkpoint.resume=auto", "checkpoint.restart_epoch=true"
                ),
            ]
        )
    )
    log = read(run_dir / "train.log")
    row.code = str(result.code)
    row.message = first_error_line(result.console) or log_line(log, "starts again")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(
        "epoch 1 starts again from its first batch" in log,
        "train.log does not say the epoch restarts",
    )
    ckpt = check_run(row, run_dir, epochs_done=2, checkpoint_epoch=2)
    row.expect(ckpt is not None and ckpt.get("world_size") == 2, "last.pt is not a 2-rank one")
    rows.append(row)
    return rows


def case_stop_zombie(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    runs = case_dir / "runs"
    (runs / "t").mkdir(parents=True)
    zombie = subprocess.Popen(["true"])  # exits at once; not reaped until wait() below
    try:
        for _ in range(100):
            state = Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.02)
        (runs / "t" / "pid").write_text(f"{zombie.pid}\n")
        row = Row("10 ./run.sh stop, zombie pid in the pid file")
        result = run(
            [str(ROOT / "run.sh"), "stop", "t"], timeout=30, extra_env={"RUNS_DIR": str(runs)}
        )
    finally:
        zombie.wait()
    row.code = str(result.code)
    shown = first_error_line(result.console) or " ".join(console_lines(result.out)[:1])
    row.message = f"{shown} ({result.seconds:.1f} s)"
    row.expect(state == "Z", f"the pid was not a zombie (state {state})")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect("not running" in result.out, "does not say 'not running'")
    row.expect(result.seconds < 5, f"took {result.seconds:.1f} s")
    row.expect(not (runs / "t" / "pid").exists(), "the pid file is still there")
    return [row]


def case_run_sh_stop(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    ensure_demo(work)
    runs = case_dir / "runs"
    run_dir = runs / "t"
    config = case_dir / "tiny.yaml"
    case_dir.mkdir(parents=True, exist_ok=True)
    save_config(tiny_config(work.index, runs, "cnn", "train.epochs=100", "eval.every=0"), config)
    row = Row("11 SIGTERM: ./run.sh --bg --nproc 2, ./run.sh stop")
    started = run([str(ROOT / "run.sh"), "--bg", "--nproc", "2", str(config)], timeout=60)
    if started.code != 0:
        return [
            Row(
                row.case,
                str(started.code),
                first_error_line(started.console),
                problems=["./run.sh --bg failed: " + started.console[-500:]],
            )
        ]
    pid = int(read(run_dir / "pid").strip())
    try:
        deadline = time.time() + 150
        while time.time() < deadline and "epoch 1/100:" not in read(run_dir / "train.log"):
            time.sleep(0.5)
        row.expect("epoch 1/100:" in read(run_dir / "train.log"), "epoch 1 did not finish in 150 s")
        stop = run(
            [str(ROOT / "run.sh"), "stop", "t"], timeout=150, extra_env={"RUNS_DIR": str(runs)}
        )
    finally:
        if Path(f"/proc/{pid}").exists():  # still there: end the job we started
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log, nohup = read(run_dir / "train.log"), read(run_dir / "nohup.log")
    row.code = f"{stop.code} (stop)"
    row.message = (
        first_error_line(stop.console)
        or first_error_line(nohup)
        or log_line(log, "stopped on request")
    )
    row.expect(stop.code == 0, f"./run.sh stop exited {stop.code}")
    row.expect("stopped t" in stop.out, "./run.sh stop does not say 'stopped t'")
    row.expect("stopped on request" in log, "train.log does not say 'stopped on request'")
    row.expect(not first_error_line(nohup), f"the job's console shows {first_error_line(nohup)!r}")
    done = len(metrics_rows(run_dir))
    ckpt = check_run(row, run_dir, epochs_done=done, checkpoint_epoch=done)
    row.expect(ckpt is not None and ckpt["step"] > 0, "last.pt holds no training step")
    return [row]


def case_lr_inf(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    row = Row("12 optim.lr=inf")
    result = run(python_train(train_args(work, runs, "optim.lr=inf")))
    row.code, row.message = str(result.code), first_error_line(result.err)
    lines = console_lines(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(lines) == 1, f"stderr has {len(lines)} lines, expected 1")
    row.expect("optim.lr" in row.message, "the message does not name optim.lr")
    row.expect(not runs.exists(), "something was written")
    return [row]


def case_truncated_wav(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    sheet, bad = sheet_with_bad_class(work, case_dir / "bad", write_truncated_wav)
    runs = case_dir / "runs"
    row = Row("13 truncated wav (1 DataLoader worker)")
    result = run(
        python_train(
            train_args(
                work,
                runs,
                f"data.index={sheet}",
                "train.epochs=1",
                "eval.every=0",
                "data.num_workers=1",
            )
        )
    )
    row.code, row.message = str(result.code), first_error_line(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(
        len(error_lines(result.console)) == 1,
        f"{len(error_lines(result.console))} error lines, expected 1",
    )
    row.expect(any(str(p) in row.message for p in bad), "the message names no bad file")
    row.expect("truncated" in row.message, "the message does not say truncated")
    check_run(row, runs / "t", epochs_done=0, checkpoint_epoch=None)
    return [row]


def case_embed_corrupt(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base = ensure_base(work)
    clips = case_dir / "clips"
    clips.mkdir(parents=True)
    good = sorted((work.index.parent / "wav").rglob("*.wav"))[:2]
    for i, source in enumerate(good):
        shutil.copy(source, clips / f"good{i}.wav")
    (clips / "bad.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEnot audio at all")
    row = Row("14 embed: one corrupt file among 3")
    result = run(
        [
            sys.executable,
            "-m",
            "audioclf.embed",
            "--model",
            str(base / "best.pt"),
            "--gallery",
            str(work.index),
            "--top",
            "3",
            "--quiet",
            str(clips),
        ]
    )
    row.code = str(result.code)
    row.message = first_error_line(result.err) or (console_lines(result.err) or [""])[0]
    row.expect(result.code == 1, f"exit {result.code}, expected 1")
    for name in ("good0.wav", "good1.wav"):
        row.expect(re.search(rf"{name}\n\s+1\. ", result.out) is not None, f"{name} is not ranked")
    row.expect(
        "bad.wav" in result.err and "bad.wav" not in result.out,
        "the bad file is not named on stderr (only)",
    )
    return [row]


# (name, case) in the matrix's order: cases 1-14
CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("nan-wav", case_nan_wav),
    ("export-nan", case_export_nan),
    ("resume-architecture", case_resume_architecture),
    ("disk", case_disk),
    ("kill-mid-write", case_kill_mid_write),
    ("all-unreadable", case_all_unreadable),
    ("fail-rank1", case_fail_rank1),
    ("too-few-classes", case_too_few_classes),
    ("mid-epoch-world", case_mid_epoch_world),
    ("stop-zombie", case_stop_zombie),
    ("run-sh-stop", case_run_sh_stop),
    ("lr-inf", case_lr_inf),
    ("truncated-wav", case_truncated_wav),
    ("embed-corrupt", case_embed_corrupt),
]
