"""SLURM: ranks from srun's variables, node-list parsing, and the sbatch template."""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from audioclf import checkpoint
from audioclf.distributed.launch import _first_host, env_ranks
from tests.helpers import ROOT, cli_args, tiny_config

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
)


def _without_launchers(env: dict) -> dict:
    """env minus every SLURM and torchrun variable (the tests may themselves run under SLURM)."""
    return {
        k: v
        for k, v in env.items()
        if not k.startswith(("SLURM_", "SRUN_", "TORCHELASTIC_")) and k not in LAUNCH_VARS
    }


@pytest.fixture
def launch_env(monkeypatch):
    """A clean launcher environment; env_ranks' exports are undone after the test."""
    keep = _without_launchers(dict(os.environ))
    for name in [name for name in os.environ if name not in keep]:
        monkeypatch.delenv(name)
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    before = dict(os.environ)
    yield set_env
    # env_ranks exports RANK, WORLD_SIZE, MASTER_ADDR, ... that monkeypatch never saw: without
    # this, every later in-process fit() would wait for peers that never come.
    os.environ.clear()
    os.environ.update(before)


def srun_task(procid: int, ntasks: int, localid: int, **extra: str) -> dict:
    """The variables srun gives one task of a step (job 4242 on gpu01-gpu02)."""
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(localid),
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        **extra,
    }


# --- node lists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("localhost", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("gpu[01-04,07],cpu3", "gpu01"),
        ("cpu3,gpu[01-04,07]", "cpu3"),
        ("node[7]", "node7"),
        ("n[009-011,020]", "n009"),
        ("gpu[10-12]", "gpu10"),
        ("gpu-a100-[3-4]", "gpu-a100-3"),
        ("rack[2-3]-node[05-06]", "rack2-node05"),
        (" gpu01 ", "gpu01"),
    ],
)
def test_first_host_of_compressed_node_lists(nodelist, first):
    assert _first_host(nodelist) == first


@pytest.mark.parametrize(
    "nodelist", ["", "gpu[01-04", "gpu[a-b]", "gpu[]", "gpu[1-2-3]", "gpu]1", "gpu [1-2]"]
)
def test_malformed_node_lists_are_not_guessed(nodelist):
    assert _first_host(nodelist) is None


def _fake_scontrol(bin_dir: Path, output: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_unreadable_node_list_falls_back_to_scontrol(launch_env, tmp_path):
    _fake_scontrol(tmp_path / "bin", "weird-a\\nweird-b\\n")
    launch_env(
        **srun_task(1, 2, 1, SLURM_JOB_NODELIST="weird[a-b]"),
        PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
    )
    assert env_ranks() == (1, 1, 2)
    assert os.environ["MASTER_ADDR"] == "weird-a"


def test_unreadable_node_list_without_scontrol_names_the_fix(launch_env, tmp_path):
    launch_env(**srun_task(1, 2, 1, SLURM_JOB_NODELIST="weird[a-b]"), PATH=str(tmp_path))
    with pytest.raises(RuntimeError, match="set MASTER_ADDR"):
        env_ranks()


# --- which launcher wins ---------------------------------------------------------------------


def test_srun_task_takes_slurm_ranks_and_exports_the_rendezvous(launch_env):
    launch_env(**srun_task(3, 4, 1))
    assert env_ranks() == (3, 1, 4)
    assert os.environ["MASTER_ADDR"] == "gpu01"
    assert os.environ["MASTER_PORT"] == str(10000 + 4242 % 20000)
    # init_process_group("env://") reads these, and a second call gives the same answer.
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")] == ["3", "4", "1"]
    assert env_ranks() == (3, 1, 4)


@pytest.mark.slow
def test_torchrun_variables_win_over_slurm(launch_env):
    # torchrun started by srun (the sbatch template): the task sees both.
    launch_env(**srun_task(0, 2, 0), RANK="5", WORLD_SIZE="8", LOCAL_RANK="1")
    assert env_ranks() == (5, 1, 8)
    assert "MASTER_ADDR" not in os.environ


def test_legacy_local_rank_argument_still_works_under_slurm(launch_env):
    launch_env(**srun_task(0, 2, 0), RANK="1", WORLD_SIZE="2")
    assert env_ranks(local_rank_arg=1) == (1, 1, 2)


def test_master_address_and_port_already_set_are_kept(launch_env):
    launch_env(**srun_task(0, 2, 0), MASTER_ADDR="10.0.0.9", MASTER_PORT="1234")
    assert env_ranks() == (0, 0, 2)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "1234")


def test_step_variables_win_over_the_allocation(launch_env):
    # `srun -n 2 --export-env` inside a 4-task allocation; the step runs on gpu03-gpu04.
    launch_env(**srun_task(1, 4, 1, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="gpu[03-04]"))
    assert env_ranks() == (1, 1, 2)
    assert os.environ["MASTER_ADDR"] == "gpu03"


def test_port_without_a_numeric_job_id_is_29500(launch_env):
    task = srun_task(0, 2, 0)
    del task["SLURM_JOB_ID"]
    launch_env(**task)
    env_ranks()
    assert os.environ["MASTER_PORT"] == "29500"


@pytest.mark.parametrize("visible, device", [("2", 0), ("0,1,2,3", 2), ("", 2)])
def test_task_bound_gpu_is_cuda_0(launch_env, visible, device):
    # `srun --gpus-per-task=1` leaves each task only its own GPU; --gpus-per-node, all of them.
    launch_env(**srun_task(2, 4, 2, CUDA_VISIBLE_DEVICES=visible))
    assert env_ranks() == (2, device, 4)


def test_single_task_allocation_is_one_process(launch_env):
    launch_env(**srun_task(0, 1, 0))
    assert env_ranks() == (0, 0, 1)
    assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ


@pytest.mark.slow
def test_batch_script_of_a_multi_task_job_trains_alone_and_says_why(launch_env, caplog):
    # The sbatch script itself (or an salloc shell) has SLURM_PROCID=0 and the allocation's
    # task count, but no step: its peers were never started.
    task = srun_task(0, 4, 0)
    del task["SLURM_STEP_ID"]
    launch_env(**task)
    with caplog.at_level(logging.WARNING, logger="audioclf"):
        assert env_ranks() == (0, 0, 1)
    assert "not started by srun" in caplog.text and "RANK" not in os.environ


def test_no_launcher_is_one_process(launch_env):
    assert env_ranks() == (0, 0, 1)
    assert env_ranks(local_rank_arg=2) == (0, 2, 1)


# --- a real 2-task srun launch, simulated ----------------------------------------------------


def _unused_job_id() -> int:
    """A job id whose derived MASTER_PORT (10000 + id % 20000) is free right now."""
    for _ in range(50):
        job_id = random.randrange(100_000, 10_000_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 10000 + job_id % 20000))
            except OSError:
                continue
            return job_id
    raise RuntimeError("no free port in 10000-29999")


@pytest.mark.slow
def test_two_srun_tasks_train_with_only_slurm_variables(tmp_path, tiny_demo):
    cfg = tiny_config(
        tiny_demo,
        tmp_path / "runs",
        "cnn",
        "train.epochs=1",
        "eval.every=0",
        "train.limit_batches=2",
    )
    base = dict(
        _without_launchers(dict(os.environ)),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        SLURM_NTASKS="2",
        SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_JOB_ID=str(_unused_job_id()),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "audioclf.train", *cli_args(cfg)],
            cwd=ROOT,
            env=dict(base, SLURM_PROCID=str(task), SLURM_LOCALID=str(task)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for task in range(2)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    run_dir = tmp_path / "runs" / "t"
    assert "rank 0 of 2" in (run_dir / "train.log").read_text()
    assert checkpoint.load(run_dir / "last.pt")["world_size"] == 2


# --- the sbatch template ---------------------------------------------------------------------


def run_sbatch(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(_without_launchers(dict(os.environ)), **(env or {})),
        **kwargs,
    )


@pytest.mark.slow
def test_sbatch_script_parses_and_asks_for_what_a_requeue_needs():
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    for wanted in (
        "--ntasks-per-node=1",
        "--output=logs/%x-%j.out",
        "--requeue",
        "--signal=B:USR1@120",
        "--open-mode=append",
    ):
        assert any(wanted in line for line in directives), wanted


@pytest.mark.slow
def test_dry_run_outside_slurm_prints_a_local_torchrun():
    out = run_sbatch("configs/cnn.yaml", "train.name=x", "sampler.m=4", env={"DRY_RUN": "1"})
    assert out.returncode == 0, out.stderr
    command = out.stdout.splitlines()[-1]
    assert command.startswith("+ srun ") and "-m torch.distributed.run" in command
    assert "--rdzv_endpoint=localhost:29500" in command and "--nnodes=1" in command
    assert command.endswith(
        "-m audioclf.train --config configs/cnn.yaml checkpoint.resume=auto "
        "train.name=x sampler.m=4"
    )


@pytest.mark.slow
def test_dry_run_in_a_job_rendezvous_on_the_first_node(tmp_path):
    env = {
        "DRY_RUN": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
        "SLURM_NNODES": "3",
        "SLURM_JOB_ID": "123456",
        "SLURM_GPUS_ON_NODE": "8",
        "PATH": f"{tmp_path}:/usr/bin:/bin",
    }  # no scontrol: the script reads the list itself
    out = run_sbatch("configs/cnn.yaml", "train.name=big run", env=env)
    assert out.returncode == 0, out.stderr
    command = out.stdout.splitlines()[-1]
    for part in (
        "--nnodes=3",
        "--nproc_per_node=8",
        "--rdzv_id=123456",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=gpu07:{10000 + 123456 % 20000}",
    ):
        assert part in command
    assert command.endswith(r"checkpoint.resume=auto train.name=big\ run")


@pytest.mark.slow
def test_sbatch_without_a_config_or_outside_a_job_says_how():
    assert "usage: sbatch scripts/slurm/train.sbatch CONFIG" in run_sbatch().stderr
    missing = run_sbatch("configs/nope.yaml", env={"DRY_RUN": "1"})
    assert missing.returncode == 2 and "config configs/nope.yaml not found" in missing.stderr
    outside = run_sbatch("configs/cnn.yaml")
    assert outside.returncode == 2 and "not inside a SLURM job" in outside.stderr


FAKE_SRUN = """#!/bin/bash
echo $$ > "$FAKE/srun.pid"
trap 'echo "srun tasks got TERM" >> "$FAKE/calls"; exit 0' TERM
while true; do sleep 0.1; done
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE/calls"
kill -TERM "$(cat "$FAKE/srun.pid")"
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show ]]; then echo node01; echo node02; else echo "scontrol $*" >> "$FAKE/calls"; fi
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_time_limit_signal_stops_the_step_then_requeues(tmp_path, sig, requeued):
    """USR1 (time limit near) and TERM both reach the training step through scancel — never
    through srun, which would SIGKILL its tasks — and only USR1 requeues the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(
        _without_launchers(dict(os.environ)),
        FAKE=str(tmp_path),
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        SLURM_JOB_ID="777",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "configs/cnn.yaml", "train.name=x"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not (tmp_path / "srun.pid").exists():
            time.sleep(0.05)
        assert (tmp_path / "srun.pid").exists(), "the script never started srun"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    calls = (tmp_path / "calls").read_text().splitlines()
    assert proc.returncode == 0, out
    assert "rendezvous on node01:10777" in out
    assert calls[:2] == ["scancel --signal=TERM 777", "srun tasks got TERM"]
    assert ("scontrol requeue 777" in calls) == requeued
