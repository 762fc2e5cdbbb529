"""run.sh: help, background launch with pid file, and a clean stop that leaves last.pt."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from audioclf import checkpoint
from audioclf.config import save_config
from tests.helpers import ROOT, as_a_terminal_starts_it, tiny_config, wait_for_text

pytestmark = pytest.mark.slow  # every test here starts processes


def run_sh(
    *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["./run.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **(env or {})),
    )


def test_help_lists_the_commands():
    out = run_sh("--help")
    assert out.returncode == 0
    for word in ("demo", "test", "--bg", "stop NAME"):
        assert word in out.stdout


def test_missing_config_is_one_clear_line():
    out = run_sh("configs/nope.yaml")
    assert (
        out.returncode == 2 and out.stderr.strip() == "run.sh: config configs/nope.yaml not found"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--stage", "x"], "--stage takes a stage number from 1 to 5, got 'x'"),
        (["--stop-stage", "two"], "--stop-stage takes a stage number from 1 to 5, got 'two'"),
        (["--stage"], "--stage needs a stage number from 1 to 5"),
        (["--stage", "9"], "--stage takes a stage number from 1 to 5, got '9'"),
        (
            ["--stage", "3", "--stop-stage", "2"],
            "--stop-stage 2 is before --stage 3: nothing would run",
        ),
    ],
)
def test_a_bad_demo_stage_is_one_line_and_exit_2(args, said):
    out = run_sh("demo", *args, timeout=30)  # refused before the venv is set up or a stage runs
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.strip() == f"run.sh: demo: {said}" and "stage" not in out.stdout, out


def test_background_run_and_stop(tmp_path, tiny_demo):
    runs = tmp_path / "runs"
    cfg = tiny_config(tiny_demo, runs, "cnn", "train.epochs=500", "eval.every=0", "train.name=bg")
    save_config(cfg, tmp_path / "bg.yaml")
    started = run_sh("--bg", "--nproc", "2", str(tmp_path / "bg.yaml"))
    assert started.returncode == 0, started.stderr
    assert "./run.sh stop bg" in started.stdout and "tail -f" in started.stdout
    run_dir = runs / "bg"
    pid = int((run_dir / "pid").read_text())
    try:
        log = run_dir / "train.log"
        assert wait_for_text(log, "epoch 2/500"), (run_dir / "nohup.log").read_text()[-3000:]
        stopped = run_sh("stop", "bg", env={"RUNS_DIR": str(runs)})
        assert stopped.returncode == 0 and "stopped bg" in stopped.stdout, stopped.stderr
    finally:
        # os.killpg, not /usr/bin/kill: procps-ng 4.0.2 reads `kill -9 -PID` as kill(-<first
        # digit>, 9), which for a pid starting with 1 kills every process the user owns.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    assert not (run_dir / "pid").exists()
    ckpt = checkpoint.load(run_dir / "last.pt")
    assert ckpt["step"] > 0 and ckpt["world_size"] == 2
    assert "stopped on request" in (run_dir / "train.log").read_text()
    assert "Traceback" not in (run_dir / "nohup.log").read_text()


def test_stop_treats_a_zombie_as_stopped(tmp_path):
    # A process that exited but was never reaped (a container without an init) still answers
    # kill -0; stop must not wait 120 s for it.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
            "print(pid, flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        zombie = int(parent.stdout.readline())
        time.sleep(0.3)
        (tmp_path / "z").mkdir()
        (tmp_path / "z" / "pid").write_text(str(zombie))
        started = time.time()
        out = run_sh("stop", "z", env={"RUNS_DIR": str(tmp_path)}, timeout=30)
        assert out.returncode == 0 and "not running" in out.stdout, out.stderr
        assert time.time() - started < 10 and not (tmp_path / "z" / "pid").exists()
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["Ctrl-C", "hang-up"])
def test_ctrl_c_in_the_foreground_saves_last_pt_and_exits_130(sig, tmp_path, tiny_demo):
    # SIGHUP: the terminal closed (it reaches run.sh, not the launcher in its own session).
    runs = tmp_path / "runs"
    cfg = tiny_config(tiny_demo, runs, "cnn", "train.epochs=500", "eval.every=0", "train.name=fg")
    save_config(cfg, tmp_path / "fg.yaml")
    # A new session, as a terminal gives the foreground job; Ctrl-C reaches run.sh alone (its
    # torchrun has a session of its own).
    proc = subprocess.Popen(
        ["./run.sh", "--nproc", "2", str(tmp_path / "fg.yaml")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_a_terminal_starts_it,
    )
    log = runs / "fg" / "train.log"
    try:
        assert wait_for_text(log, "epoch 1/500")
        proc.send_signal(sig)
        try:  # a bound on a hang, not a timing: past it, what was still running
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            ps = ["ps", "-eo", "pid,ppid,sid,stat,etime,args"]
            tree = subprocess.run(ps, capture_output=True, text=True).stdout
            pytest.fail(f"run.sh ran on 120 s after {sig!r}:\n{tree}\n{log.read_text()[-2000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err
    ckpt = checkpoint.load(runs / "fg" / "last.pt")
    # Mid-epoch, the epoch in progress (ckpt["epoch"] counts completed ones); a Ctrl-C that
    # lands in an epoch's last step or its end (a loaded machine) stops after that epoch.
    epoch = ckpt["epoch"] + (1 if ckpt["position"] > 0 else 0)
    assert err.strip().splitlines()[-1] == (
        f"run.sh: stopped at epoch {epoch}, step {ckpt['step']}; last.pt saved; "
        "resume with checkpoint.resume=auto"
    )


@pytest.mark.parametrize("killed", ["the launcher", "run.sh"])
def test_kill_9_of_run_sh_or_its_launcher_takes_the_ranks_and_frees_the_run_folder(
    killed, tmp_path, tiny_demo
):
    # A closed terminal, an OOM killer, a scheduler: no rank may train on alone, holding the
    # run lock (a later checkpoint.resume=auto would be refused as "in use by another run").
    from tests.helpers import child_pids, is_alive, run_lock_is_free, wait_until

    runs = tmp_path / "runs"
    cfg = tiny_config(tiny_demo, runs, "cnn", "train.epochs=500", "eval.every=0", "train.name=k")
    save_config(cfg, tmp_path / "k.yaml")
    proc = subprocess.Popen(
        ["./run.sh", "--nproc", "2", str(tmp_path / "k.yaml")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=as_a_terminal_starts_it,
    )
    processes: list[int] = []
    try:
        assert wait_for_text(runs / "k" / "train.log", "epoch 1/500")
        (launcher,) = child_pids(proc.pid)
        ranks = child_pids(launcher)
        processes = [launcher, *ranks]
        assert len(ranks) == 2
        os.kill(launcher if killed == "the launcher" else proc.pid, signal.SIGKILL)
        assert wait_until(lambda: not any(is_alive(p) for p in ranks), 30), "the ranks train on"
        assert wait_until(lambda: not is_alive(launcher), 30), "the launcher runs on"
    finally:
        for pid in [proc.pid, *processes]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    # checkpoint.resume=auto may take the folder (once the ranks' last threads are gone: a
    # killed process shows as a zombie while its other threads still hold its files)
    assert wait_until(lambda: run_lock_is_free(runs / "k"), 30), "the run folder stays locked"


def test_demo_runs_every_stage(tmp_path):
    # The README's main command, all five stages, in a copy of the checkout whose demo config
    # trains one short epoch: a stage that ends the script early (as a foreground run once did
    # after training) leaves the later stages' outputs missing.
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    for name in ("audioclf", ".venv"):
        (repo / name).symlink_to(ROOT / name)
    for name in ("run.sh", "requirements.txt", "requirements-dev.txt"):
        (repo / name).write_bytes((ROOT / name).read_bytes())
    (repo / "run.sh").chmod(0o755)
    demo = (ROOT / "configs" / "demo_cnn.yaml").read_text()
    demo = demo.replace("epochs: 15", "epochs: 1\n  limit_batches: 2")
    assert "limit_batches: 2" in demo
    (repo / "configs" / "demo_cnn.yaml").write_text(demo)
    out = subprocess.run(
        ["./run.sh", "demo"], cwd=repo, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for stage in range(1, 6):
        assert f"== stage {stage}:" in out.stdout
    run = repo / "runs" / "demo_cnn"
    assert (run / "eval").is_dir() and any((run / "eval").iterdir())
    assert (run / "export" / "model.pt").is_file()
    ranked = out.stdout.split("== stage 5:")[1]
    assert "c00" in ranked and "each file's own item left out" in ranked
    assert re.search(r"^\d+ of 8 files ranked their own class first", ranked, flags=re.M)
