"""Cases 15-19 of the fault matrix, safe by default (issue 18): checkpoints that cannot run code,
one live run per folder, a clean Ctrl-C, forgiving sheets, precision that fits the device."""

from __future__ import annotations

import argparse
import builtins
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import (
    ROOT,
    Job,
    Result,
    Row,
    Work,
    alive,
    audioclf_tracebacks,
    check_run,
    checkpoint_intact,
    command_line,
    console_lines,
    ensure_base,
    ensure_demo,
    error_lines,
    first_error_line,
    kill_left,
    log_line,
    metrics_rows,
    process_tree,
    python_train,
    read,
    run,
    start,
    tool,
    train_args,
    wait_for,
)

# ---------------------------------------------------------------------------------------------
# Safe by default (issue 18): checkpoints that cannot run code, one live run per folder, a clean
# Ctrl-C, forgiving sheets, precision that fits the device


class Payload:
    """Unpickling it creates `marker`: what a crafted checkpoint would do with os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


def checkpoint_with(source: Path, target: Path, key: str, value: object) -> Path:
    """A copy of the audioclf checkpoint `source` with one more entry, pickled by torch.save."""
    import torch

    state = torch.load(source, map_location="cpu", weights_only=True)
    state[key] = value
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, target)
    return target


def files_in(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def expect_refused_checkpoint(row: Row, result: Result, path: Path, refused: str) -> None:
    """Exit 2 with one error line that names the file, the refused object and the opt-in."""
    errors = error_lines(result.console)
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(errors) == 1, f"{len(errors)} error lines, expected 1")
    row.expect(not audioclf_tracebacks(result.console), "the console shows a traceback")
    row.expect(
        f"checkpoint {path} holds Python objects" in row.message,
        "the message does not name the file as holding Python objects",
    )
    row.expect(f"({refused})" in row.message, f"the message does not name {refused}")
    row.expect(
        "--trust-checkpoint" in row.message and "checkpoint.trust=true" in row.message,
        "the message does not name the opt-in (--trust-checkpoint / checkpoint.trust=true)",
    )


def case_payload_checkpoint(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base = ensure_base(work)
    clip = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    entry_points = {
        "evaluate --checkpoint": lambda pt, d: tool(
            "evaluate", "--checkpoint", pt, "--out", d / "eval", "--quiet"
        ),
        "embed --model": lambda pt, d: tool(
            "embed", "--model", pt, "--gallery", work.index, "--save", d / "out/new", clip
        ),
        "export --checkpoint": lambda pt, d: tool(
            "export", "--checkpoint", pt, "--format", "torchscript", "--out", d / "model.pt"
        ),
        "train model.init_from=": lambda pt, d: python_train(
            train_args(work, d / "runs", f"model.init_from={pt}", "train.epochs=1")
        ),
        "train checkpoint.resume=": lambda pt, d: python_train(
            train_args(work, d / "runs", f"checkpoint.resume={pt}", "train.epochs=3")
        ),
    }
    rows = []
    for letter, (name, command) in zip("abcde", entry_points.items()):
        folder = case_dir / letter
        marker = folder / "payload-ran"
        crafted = checkpoint_with(base / "best.pt", folder / "crafted.pt", "notes", Payload(marker))
        row = Row(f"15{letter} payload checkpoint: {name}")
        result = run(command(crafted, folder))
        expect_refused_checkpoint(row, result, crafted, "exec")
        if not name.startswith("train"):
            lines = console_lines(result.err)
            row.expect(len(lines) == 1, f"stderr has {len(lines)} lines, expected 1: {lines[:3]}")
        row.expect(not marker.exists(), "the payload ran: its marker file is there")
        written = [f for f in files_in(folder) if f != crafted.name]
        row.expect(not written, f"written: {written}")
        rows.append(row)
    return rows + trusted_foreign_rows(work, base, case_dir / "f")


def trusted_foreign_rows(work: Work, base: Path, folder: Path) -> list[Row]:
    """A harmless foreign pickle (an argparse.Namespace beside the weights, as many training
    scripts save one): refused by default, loaded with the opt-in."""
    foreign = checkpoint_with(
        base / "best.pt", folder / "foreign.pt", "args", argparse.Namespace(lr=0.003)
    )
    row = Row("15f harmless pickle: export, then --trust-checkpoint")
    refused = run(
        tool(
            "export",
            "--checkpoint",
            foreign,
            "--format",
            "state_dict",
            "--out",
            folder / "refused.pt",
        )
    )
    expect_refused_checkpoint(row, refused, foreign, "argparse.Namespace")
    out = folder / "export" / "weights.pt"
    trusted = run(
        tool("export", "--checkpoint", foreign, "--format", "state_dict", "--out", out)
        + ["--trust-checkpoint"]
    )
    row.code = f"{refused.code}, then {trusted.code}"
    row.message = first_error_line(trusted.console) or (console_lines(trusted.out) or [""])[0]
    row.expect(not (folder / "refused.pt").exists(), "the refused export wrote its file")
    row.expect(trusted.code == 0, f"export --trust-checkpoint exited {trusted.code}")
    row.intact, _, why = checkpoint_intact(out)  # the export is plain data: it loads as such
    row.expect(row.intact == "yes", why)

    init = Row("15g harmless pickle: init_from, checkpoint.trust=true")
    runs = folder / "runs"
    result = run(
        python_train(
            train_args(
                work,
                runs,
                f"model.init_from={foreign}",
                "checkpoint.trust=true",
                "train.epochs=1",
                "eval.every=0",
            )
        )
    )
    log = read(runs / "t" / "train.log")
    init.code = str(result.code)
    init.message = first_error_line(result.err) or log_line(log, "model.init_from: weights of")
    init.expect(result.code == 0, f"exit {result.code}, expected 0")
    init.expect(f"model.init_from: weights of {foreign}" in log, "train.log does not say init_from")
    check_run(init, runs / "t", epochs_done=1, checkpoint_epoch=1)
    return [row, init]


def expect_folder_busy(row: Row, result: Result, run_dir: Path, holder: int) -> None:
    """Exit 2 with one error line naming the holder (pid, host, start) and the fix."""
    errors = error_lines(result.console)
    message = first_error_line(result.console)
    row.expect(result.code == 2, f"the refused run exited {result.code}, expected 2")
    row.expect(len(errors) == 1, f"{len(errors)} error lines, expected 1")
    row.expect(
        f"{run_dir} is in use by another run (pid {holder} on {socket.gethostname()}, started "
        in message,
        f"the message does not name the holder (pid {holder}, host, start time)",
    )
    row.expect(
        "another train.name" in message and f"./run.sh stop {run_dir.name}" in message,
        "the message does not name the fix (another train.name, ./run.sh stop)",
    )


def expect_one_writer(row: Row, run_dir: Path) -> None:
    """Only one run set up the folder: one 'run directory' record, no resume, no epoch twice."""
    log = read(run_dir / "train.log")
    starts = log.count("INFO run directory ")
    row.expect(starts == 1, f"train.log records {starts} run start(s), expected 1")
    row.expect("resumed from" not in log, "train.log records a resume")
    epochs = [r["epoch"] for r in metrics_rows(run_dir)]
    row.expect(len(epochs) == len(set(epochs)), f"metrics.csv holds an epoch twice: {epochs}")


def case_one_run_per_folder(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    jobs = case_dir / "jobs"

    row = Row("16a two trains into one folder, 1 s apart")
    runs = case_dir / "runs_a"
    args = train_args(work, runs, "train.epochs=4")
    first = start(python_train(args), jobs)
    time.sleep(1)
    second = start(python_train(args), jobs)
    first_result, second_result = first.finish(), second.finish()
    row.code = f"{first_result.code}, {second_result.code}"
    row.message = first_error_line(second_result.console) or first_error_line(first_result.err)
    expect_folder_busy(row, second_result, runs / "t", first.pid)
    row.expect(first_result.code == 0, f"the first run exited {first_result.code}, expected 0")
    check_run(row, runs / "t", epochs_done=4, checkpoint_epoch=4)
    expect_one_writer(row, runs / "t")
    return [row, resume_into_live_run(work, case_dir / "runs_b", jobs), bg_twice(work, case_dir)]


def resume_into_live_run(work: Work, runs: Path, jobs: Path) -> Row:
    row = Row("16b resume=auto into a live run")
    run_dir = runs / "t"
    args = train_args(work, runs, "train.epochs=300", "eval.every=0")
    live = start(python_train(args), jobs)
    try:
        row.expect(wait_for(run_dir / "train.log", "epoch 1/300:", 150), "epoch 1 did not end")
        resume = run(python_train([*args, "checkpoint.resume=auto"]))
        live.signal(signal.SIGTERM)  # the live run stops as ./run.sh stop asks: last.pt, exit 0
        result = live.finish(150)
    finally:
        if live.proc.poll() is None:
            os.killpg(live.pid, signal.SIGKILL)
    row.code = f"{resume.code} (live run: {result.code})"
    row.message = first_error_line(resume.console) or first_error_line(result.err)
    expect_folder_busy(row, resume, run_dir, live.pid)
    row.expect(result.code == 0, f"the live run exited {result.code} after SIGTERM, expected 0")
    row.expect("stopped on request" in read(run_dir / "train.log"), "the live run did not stop")
    done = len(metrics_rows(run_dir))
    check_run(row, run_dir, epochs_done=done, checkpoint_epoch=done)
    expect_one_writer(row, run_dir)
    return row


def bg_twice(work: Work, case_dir: Path) -> Row:
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    row = Row("16c ./run.sh --bg twice into one name")
    runs = case_dir / "runs_c"
    run_dir = runs / "t"
    config = case_dir / "tiny.yaml"
    save_config(tiny_config(work.index, runs, "cnn", "train.epochs=3", "eval.every=0"), config)
    launch = [str(ROOT / "run.sh"), "--bg", "--nproc", "1", str(config)]
    first = run(launch, timeout=60)
    second = run(launch, timeout=60)
    pid = int(read(run_dir / "pid").strip() or 0)
    job = {p: command_line(p) for p in process_tree(pid)} if pid else {}
    try:
        deadline = time.time() + 150
        while pid and alive(pid) and time.time() < deadline:
            time.sleep(0.5)
        row.expect(not (pid and alive(pid)), "the first job did not end in 150 s")
    finally:
        kill_left(job)
    nohup = read(run_dir / "nohup.log")
    row.code = f"{first.code}, {second.code}"
    row.message = first_error_line(second.console) or (console_lines(second.err) or [""])[0]
    row.expect(first.code == 0 and pid > 0, f"the first ./run.sh --bg exited {first.code}")
    row.expect(second.code == 2, f"the second ./run.sh --bg exited {second.code}, expected 2")
    lines = console_lines(second.err)
    row.expect(len(lines) == 1, f"the second's stderr has {len(lines)} lines, expected 1")
    row.expect(
        f"pid {pid}" in row.message and "./run.sh stop t" in row.message,
        "the message does not name the running job's pid and ./run.sh stop",
    )
    row.expect("started" not in second.out, "the second ./run.sh --bg says it started a job")
    row.expect(
        "epoch 3/3:" in nohup and not first_error_line(nohup),
        "the first job's nohup.log does not show its whole run",
    )
    check_run(row, run_dir, epochs_done=3, checkpoint_epoch=3)
    expect_one_writer(row, run_dir)
    return row


STOP_LINE = (
    "stopped at epoch {epoch}, step {step}; last.pt saved; resume with checkpoint.resume=auto"
)
SLOW_STEPS = ["model.cnn.width=96", "clips.crop_seconds=3.0", "train.limit_batches=2"]


def stop_line(ckpt: dict | None) -> str:
    """What a stop that wrote `ckpt` (last.pt) says: the epoch it stopped in, and the step."""
    if ckpt is None:
        return "(no last.pt)"
    mid_epoch = ckpt.get("position", 0) > 0  # stopped inside epoch N+1 after N finished
    epoch = ckpt["epoch"] + 1 if mid_epoch else ckpt["epoch"]
    return STOP_LINE.format(epoch=epoch, step=ckpt["step"])


def interrupt(job: Job, log: Path, ready: str, *, presses: int, gap: float = 0.3) -> dict:
    """Wait for `ready` in train.log, then press Ctrl-C `presses` times, `gap` s apart.
    Returns the job's processes as they were before ({pid: command line})."""
    if not wait_for(log, ready, 150):
        return {}
    processes = {p: command_line(p) for p in process_tree(job.pid)}
    for press in range(presses):
        if press:
            time.sleep(gap)
        job.signal(signal.SIGINT)
    return processes


def left_running(processes: dict[int, str]) -> list[str]:
    """The processes of a finished job that still run, half a second after it ended."""
    time.sleep(0.5)
    return [
        f"pid {p} ({c[:60]})" for p, c in processes.items() if alive(p) and command_line(p) == c
    ]


def expect_clean_stop(row: Row, result: Result, run_dir: Path, processes: dict) -> dict | None:
    """Exit 130, no traceback, nothing of the job left running, last.pt whole, best.pt only
    from a finished epoch."""
    row.code = str(result.code)
    row.expect(bool(processes), "train.log never showed the first epoch's end")
    row.expect(result.code == 130, f"exit {result.code}, expected 130")
    row.expect(
        "Traceback" not in result.console and "SignalException" not in result.console,
        "the console shows a traceback",
    )
    left = left_running(processes)
    kill_left(processes)
    row.expect(not left, f"still running after the job ended: {', '.join(left)}")
    done = len(metrics_rows(run_dir))
    ckpt = check_run(row, run_dir, epochs_done=done, checkpoint_epoch=done)
    log = read(run_dir / "train.log")
    row.expect("best.pt is the final epoch" not in log, "best.pt was replaced after the stop")
    if (run_dir / "best.pt").exists():
        _, best, why = checkpoint_intact(run_dir / "best.pt")
        row.expect(
            best is not None and best.get("position", 0) == 0,
            why or f"best.pt holds a partial epoch (batch {best and best.get('position')})",
        )
    return ckpt


def case_ctrl_c(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    ensure_demo(work)
    jobs = case_dir / "jobs"
    rows = []
    for letter, name, presses, extra in (
        ("a", "Ctrl-C: ./run.sh --nproc 2 (foreground)", 1, []),
        ("c", "Ctrl-C twice: ./run.sh --nproc 2", 2, SLOW_STEPS),
    ):
        row = Row(f"17{letter} {name}")
        runs = case_dir / f"runs_{letter}"
        config = case_dir / f"fg_{letter}.yaml"
        save_config(
            tiny_config(work.index, runs, "cnn", "train.epochs=500", "train.name=fg", *extra),
            config,
        )
        job = start([str(ROOT / "run.sh"), "--nproc", "2", str(config)], jobs)
        processes = interrupt(job, runs / "fg" / "train.log", "epoch 1/500:", presses=presses)
        result = job.finish(150)
        ckpt = expect_clean_stop(row, result, runs / "fg", processes)
        lines = console_lines(result.err)
        row.message = first_error_line(result.err) or (lines[-1] if lines else "")
        if presses == 1:
            want = "run.sh: " + stop_line(ckpt)
            row.expect(lines[-1:] == [want], f"the last console line is not {want!r}")
        else:
            row.expect(
                "run.sh: second Ctrl-C: killing the run at once" in result.err,
                "the console does not say the second Ctrl-C kills the run",
            )
            row.expect(
                bool(lines) and lines[-1].startswith("run.sh: stopped"),
                "the last console line is not run.sh's 'stopped ...' line",
            )
        rows.append(row)
    for letter, name, presses, extra in (
        ("b", "Ctrl-C: python -m audioclf.train", 1, []),
        ("d", "Ctrl-C twice: python -m audioclf.train", 2, SLOW_STEPS),
    ):
        row = Row(f"17{letter} {name}")
        runs = case_dir / f"runs_{letter}"
        job = start(python_train(train_args(work, runs, "train.epochs=500", *extra)), jobs)
        processes = interrupt(job, runs / "t" / "train.log", "epoch 1/500:", presses=presses)
        result = job.finish(150)
        ckpt = expect_clean_stop(row, result, runs / "t", processes)
        lines = [re.sub(r"^\S+ \S+ \w+ ", "", line) for line in console_lines(result.err)]
        row.message = first_error_line(result.err) or (lines[-1] if lines else "")
        if presses == 1:
            want = "stopped on request at " + stop_line(ckpt).removeprefix("stopped at ")
            row.expect(lines[-1:] == [want], f"the last console line is not {want!r}")
        else:
            row.expect(
                any("second Ctrl-C: stopping at once" in line for line in lines),
                "the console does not say the second Ctrl-C stops at once",
            )
        rows.append(row)
    return sorted(rows, key=lambda r: r.case)


def data_summary(log: str) -> str:
    """train.log's 'data: N train samples in C classes, ...' record."""
    return log_line(log, "INFO data: ").removeprefix("INFO ")


def case_sheet_header(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    import pandas as pd

    ensure_demo(work)
    table = pd.read_excel(work.index, dtype=str, engine="openpyxl")
    table["path"] = [str(work.index.parent / p) for p in table["path"]]
    case_dir.mkdir(parents=True, exist_ok=True)
    plain, upper, titled = (case_dir / f"{n}.xlsx" for n in ("plain", "upper", "titled"))
    table.to_excel(plain, index=False)
    table.rename(columns=str.upper).to_excel(upper, index=False)
    with pd.ExcelWriter(titled, engine="openpyxl") as writer:  # as spreadsheets export them
        table.to_excel(writer, index=False, startrow=1, sheet_name="recordings")
        writer.sheets["recordings"].cell(row=1, column=1, value="Recordings, exported 2026-01-02")
    common = ["train.epochs=1", "eval.every=0"]
    reference = run(
        python_train(train_args(work, case_dir / "runs_plain", f"data.index={plain}", *common))
    )
    plain_log = read(case_dir / "runs_plain" / "t" / "train.log")
    plain_rows = metrics_rows(case_dir / "runs_plain" / "t")
    rows = []
    for letter, name, sheet, said in (
        (
            "a",
            "upper-case header A_CLS, A_ITEM, A_ID, PATH",
            upper,
            "columns matched ignoring case",
        ),
        ("b", "a title row above the header", titled, "the header is row 2"),
    ):
        row = Row(f"18{letter} sheet: {name}")
        runs = case_dir / f"runs_{letter}"
        result = run(python_train(train_args(work, runs, f"data.index={sheet}", *common)))
        log = read(runs / "t" / "train.log")
        row.code = str(result.code)
        row.message = first_error_line(result.err) or log_line(result.err, said)
        row.expect(
            reference.code == 0,
            f"the plain sheet exited {reference.code}: {first_error_line(reference.err)}",
        )
        row.expect(result.code == 0, f"exit {result.code}, expected 0")
        for where, text in (("the console", result.err), ("train.log", log)):
            count = text.count(said)
            row.expect(count == 1, f"{where} says {said!r} {count} times, expected once")
        row.expect(
            data_summary(log) == data_summary(plain_log) != "",
            f"{data_summary(log)!r}, the plain sheet: {data_summary(plain_log)!r}",
        )
        losses = [r["train_loss"] for r in metrics_rows(runs / "t")]
        row.expect(
            losses == [r["train_loss"] for r in plain_rows],
            f"train_loss {losses}, the plain sheet's {[r['train_loss'] for r in plain_rows]}",
        )
        check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
        rows.append(row)
    return rows


def recipe_on_cpu(work: Work, runs: Path, config: str, *extra: str) -> list[str]:
    """A shipped GPU recipe, made small (tiny model, one batch, the demo's audio) for a CPU."""
    model = [
        "model.embedding_dim=16",
        *(
            [
                "model.conformer.d_model=32",
                "model.conformer.num_heads=2",
                "model.conformer.ffn_dim=64",
                "model.conformer.num_layers=1",
                "model.conformer.kernel_size=7",
            ]
            if "conformer" in config
            else ["model.cnn.width=8", "model.cnn.depth=2"]
        ),
    ]
    return python_train(
        [
            "--config",
            str(ROOT / config),
            f"data.index={work.index}",
            "data.num_workers=0",
            "features.kind=audio",
            "sampler.batch_size=8",
            "sampler.m=2",
            "clips.crop_seconds=0.5",
            *model,
            f"train.runs_dir={runs}",
            "train.name=t",
            "train.epochs=1",
            "train.limit_batches=1",
            "eval.every=0",
            *extra,
        ]
    )


def _bf16_warnings(console: str) -> list[str]:
    """The console's warning lines that name bf16 (the INFO line of precision auto names it too)."""
    return [line for line in console_lines(console) if "bf16" in line and "WARNING" in line.upper()]


def case_precision_cpu(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    rows = []
    for letter, config in (("a", "configs/conformer.yaml"), ("b", "configs/cnn.yaml")):
        row = Row(f"19{letter} {config} on a CPU (precision auto)")
        runs = case_dir / f"runs_{letter}"
        result = run(recipe_on_cpu(work, runs, config))
        log = read(runs / "t" / "train.log")
        row.code = str(result.code)
        row.message = first_error_line(result.err) or log_line(log, "precision fp32")
        row.message = row.message.split("; ")[-1]  # "precision fp32 (auto on cpu: ...)"
        row.expect(result.code == 0, f"exit {result.code}, expected 0")
        row.expect("precision fp32 (auto on cpu" in log, "train.log does not say it picked fp32")
        row.expect(result.seconds < 90, f"took {result.seconds:.0f} s")
        row.expect(not _bf16_warnings(result.err), "the console warns of bf16")
        check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
        rows.append(row)

    row = Row("19c conformer.yaml, train.precision=bf16 on a CPU")
    runs = case_dir / "runs_c"
    result = run(recipe_on_cpu(work, runs, "configs/conformer.yaml", "train.precision=bf16"))
    log = read(runs / "t" / "train.log")
    warned = _bf16_warnings(result.err)
    row.code = str(result.code)
    row.message = first_error_line(result.err) or (warned[0] if warned else "")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(len(warned) == 1, f"{len(warned)} bf16 warning lines on the console, expected 1")
    row.expect(
        bool(warned) and "44-51 s against 2.3-4.8 s" in warned[0],
        "the warning does not give the measured cost",
    )
    row.expect(re.search(r"precision bf16\b", log) is not None, "train.log does not say bf16")
    check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
    rows.append(row)
    return rows


# (name, case) in the matrix's order: cases 15-19
CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("payload-checkpoint", case_payload_checkpoint),
    ("one-run-per-folder", case_one_run_per_folder),
    ("ctrl-c", case_ctrl_c),
    ("sheet-header", case_sheet_header),
    ("precision-cpu", case_precision_cpu),
]
