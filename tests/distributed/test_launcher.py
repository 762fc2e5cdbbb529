"""`python -m audioclf.train --nproc-per-node N` owns its ranks: a Ctrl-C at any moment is one
line and 130 (last.pt named only when it exists), the ranks die with the launcher, and a
mistake is one line before any rank starts. Real processes (gloo on CPU), no mocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from audioclf.training.rundir import LOCK_FILE
from tests.helpers import (
    ROOT,
    LockHolder,
    as_a_terminal_starts_it,
    child_env,
    child_pids,
    cli_args,
    has_loaded,
    is_alive,
    run_lock_is_free,
    tiny_config,
    wait_for_text,
    wait_until,
)

PROG = "python -m audioclf.train"


def _launch(cfg, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "audioclf.train", "--nproc", "2", *cli_args(cfg), *extra],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_terminal_starts_it,
        start_new_session=True,  # a foreground job's group, as a terminal makes it
    )


def _finish(proc: subprocess.Popen, ranks: list[int] = ()) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=180)
    finally:
        for pid in [proc.pid, *ranks]:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _long_run(tmp_path: Path, tiny_demo: Path):
    return tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=100", "eval.every=0")


@pytest.mark.slow
def test_ctrl_c_while_the_launcher_imports_is_one_line_and_130(tmp_path, tiny_demo):
    proc = _launch(_long_run(tmp_path, tiny_demo))
    ranks: list[int] = []
    try:
        assert wait_until(lambda: has_loaded(proc.pid, "libtorch_cpu") or proc.poll() is not None)
        assert not child_pids(proc.pid)  # no rank yet: the launcher is still importing
        proc.send_signal(signal.SIGINT)
    finally:
        out, err = _finish(proc, ranks)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"{PROG}: stopped by SIGINT before training started; nothing was saved"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("delay", [1.0, 2.0])
def test_ctrl_c_at_any_moment_of_the_launchers_start_is_one_line_and_130(
    delay, tmp_path, tiny_demo
):
    # A KeyboardInterrupt raised inside numpy's lazy import of numpy.dtypes (the launcher's
    # checks import audioclf.checkpoint) once ended in a RecursionError traceback, exit 1.
    proc = _launch(_long_run(tmp_path, tiny_demo))
    ranks: list[int] = []
    try:
        time.sleep(delay)
        ranks = child_pids(proc.pid)
        proc.send_signal(signal.SIGINT)
    finally:
        out, err = _finish(proc, ranks)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines() in (
        [f"{PROG}: stopped by SIGINT before training started; nothing was saved"],
        [
            f"{PROG}: stopped by SIGINT before the first checkpoint: nothing to resume; run the "
            "same command again to start over"
        ],
    )
    assert not (tmp_path / "runs" / "t" / "last.pt").exists()


def test_an_early_ctrl_c_is_noted_where_it_lands_and_honoured_before_the_ranks(capsys):
    # Deterministic half of the test above: the signal is not raised where it lands (inside an
    # import, say), but said once the launcher's checks are done; a second one raises at once.
    from audioclf.train import EarlyStop

    handlers = {
        sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        EarlyStop.install()
        signal.raise_signal(signal.SIGINT)
        assert EarlyStop.signal == "SIGINT"
        assert EarlyStop.stopped() == 130
        assert capsys.readouterr().err == (
            f"{PROG}: stopped by SIGINT before training started; nothing was saved\n"
        )
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        EarlyStop.signal = None
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_start_says_no_checkpoint_was_saved(tmp_path, tiny_demo):
    proc = _launch(_long_run(tmp_path, tiny_demo))
    ranks: list[int] = []
    try:
        assert wait_until(lambda: len(child_pids(proc.pid)) == 2 or proc.poll() is not None)
        ranks = child_pids(proc.pid)
        assert wait_until(lambda: all(has_loaded(r, "libtorch_cpu") for r in ranks))
        proc.send_signal(signal.SIGINT)  # the ranks are importing torch
    finally:
        out, err = _finish(proc, ranks)
    last = tmp_path / "runs" / "t" / "last.pt"
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "death signal" not in err
    assert err.strip().splitlines() == [
        f"{PROG}: stopped by SIGINT before the first checkpoint: nothing to resume; run the "
        "same command again to start over"
    ]
    assert not last.exists()


@pytest.mark.slow
def test_kill_9_of_the_launcher_takes_its_ranks_and_frees_the_run_folder(tmp_path, tiny_demo):
    proc = _launch(_long_run(tmp_path, tiny_demo))
    run_dir = tmp_path / "runs" / "t"
    ranks: list[int] = []
    try:
        assert wait_for_text(run_dir / "train.log", "epoch 1/100")
        ranks = child_pids(proc.pid)
        assert len(ranks) == 2
        os.kill(proc.pid, signal.SIGKILL)  # a closed terminal, an OOM killer, a scheduler
        assert wait_until(lambda: not any(is_alive(r) for r in ranks)), "the ranks train on"
    finally:
        _finish(proc, ranks)
    assert wait_until(lambda: run_lock_is_free(run_dir), 30), "the run folder stays locked"
    assert (run_dir / LOCK_FILE).exists()


@pytest.mark.slow
def test_a_missing_sheet_is_one_line_before_any_rank_starts(tmp_path, tiny_demo):
    cfg = tiny_config(tmp_path / "nowhere.csv", tmp_path / "runs", "cnn")
    proc = _launch(cfg)
    out, err = _finish(proc)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), err[-3000:]
    assert "nowhere.csv" in lines[0]
    assert not (tmp_path / "runs" / "t").exists()  # no rank started to make it


@pytest.mark.slow
def test_a_run_name_in_use_is_one_line_before_any_rank_starts(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn")
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    with LockHolder(run_dir / LOCK_FILE, env=child_env()) as holder:
        proc = _launch(cfg)
        out, err = _finish(proc)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"{PROG}: error: run folder {run_dir} is in use by another run")
    assert f"(pid {holder.pid} on " in lines[0]
    assert not (run_dir / "train.log").exists()


@pytest.mark.parametrize(
    ("every", "when"),
    [
        (1, "stopping at the next step, then"),
        (10, "stopping within 10 steps (the ranks vote every train.log_every_steps=10), then"),
    ],
)
def test_the_stop_line_says_when_the_stop_comes(every, when, caplog):
    # The stop flag is read at the ranks' vote, every train.log_every_steps: the line says so.
    from audioclf.training.rundir import StopRequested

    stop = StopRequested(every=every)
    with caplog.at_level("WARNING", logger="audioclf"), stop:
        signal.raise_signal(signal.SIGTERM)
    assert stop.flag and stop.signal == "SIGTERM"
    assert f"received SIGTERM: {when} saving last.pt" in caplog.text
