"""Plain torchrun owns audioclf's ranks as audioclf's own launcher does: kill -9 of a node's
agent takes its rank with it and the other node stops with one line, in bounded time; an
agent that may restart (--max-restarts) brings a killed rank's group back from last.pt by
itself. Two torchrun "nodes" on this machine over the c10d rendezvous; real processes (gloo
on CPU), no mocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from audioclf import checkpoint
from tests.helpers import (
    ROOT,
    child_env,
    child_pids,
    cli_args,
    free_port,
    is_alive,
    rank_of,
    tiny_config,
    torchrun_command,
    wait_for_text,
    wait_until,
)

PROG = "python -m audioclf.train"


def _start_node(cmd: list[str], console: Path) -> subprocess.Popen:
    with console.open("w") as out:  # a file: nobody need read a pipe while the test waits
        return subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _stop(procs: list[int]) -> None:
    for pid in procs:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_kill_9_of_a_nodes_agent_takes_its_rank_and_the_other_node_stops_in_one_line(
    tmp_path, tiny_demo
):
    # Node 0 (at the rendezvous endpoint) hosts torch's store; node 1 joins it and takes rank 0
    # (the c10d rendezvous ranks the nodes by address: 127.0.0.1 before localhost), so node 0's
    # rank is rank 1, which used to stay silent when it lost rank 0.
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=100", "eval.every=0")
    port = free_port()
    train = ["-m", "audioclf.train", *cli_args(cfg)]
    agents = []
    for node, address in enumerate(("localhost", "127.0.0.1")):
        options = [f"--local-addr={address}"]
        agents.append(
            _start_node(
                torchrun_command(train, nproc=1, nnodes=2, endpoint=f"127.0.0.1:{port}",
                                 extra=options),
                tmp_path / f"node{node}.txt",
            )
        )  # fmt: skip
        assert wait_until(lambda: _listens(port) or agents[0].poll() is not None, 120)
    ranks = {}
    try:
        assert wait_for_text(tmp_path / "runs" / "t" / "train.log", "epoch 1/100", 240)
        ranks = {n: child_pids(agent.pid)[0] for n, agent in enumerate(agents)}
        assert [rank_of(ranks[0]), rank_of(ranks[1])] == [1, 0]
        os.kill(agents[1].pid, signal.SIGKILL)  # an OOM killer, a scheduler, a closed terminal
        started = time.monotonic()
        assert wait_until(lambda: not is_alive(ranks[1]), 30), "node 1's rank trains on, orphaned"
        agents[0].wait(timeout=120)  # torch's exit barrier would hold it 300 s
        took = time.monotonic() - started
    finally:
        _stop([*(a.pid for a in agents), *ranks.values()])
        for agent in agents:
            agent.wait()
    node0 = (tmp_path / "node0.txt").read_text()
    lines = [line for line in node0.splitlines() if line.startswith(f"{PROG}: error:")]
    assert len(lines) == 1, node0[-4000:]
    assert lines[0].startswith(
        f"{PROG}: error: stopped because another rank stopped without a word"
    ), lines
    assert agents[0].returncode == 1 and took < 120, (agents[0].returncode, took)
    assert "frame #" not in node0, node0[-4000:]  # c10d's C++ frames of a read from a dead store


@pytest.mark.slow
def test_max_restarts_brings_a_group_that_lost_a_rank_back_from_last_pt(tmp_path, tiny_demo):
    cfg = tiny_config(
        tiny_demo,
        tmp_path / "runs",
        "cnn",
        "train.epochs=4",
        "eval.every=0",
        "checkpoint.every_steps=2",
        "checkpoint.resume=auto",
    )
    run_dir = tmp_path / "runs" / "t"
    train = ["-m", "audioclf.train", *cli_args(cfg)]
    agent = _start_node(torchrun_command(train, extra=["--max-restarts=1"]), tmp_path / "out.txt")
    ranks: list[int] = []
    try:
        assert wait_until(lambda: (run_dir / "last.pt").exists() or agent.poll() is not None, 240)
        ranks = child_pids(agent.pid)
        os.kill(next(pid for pid in ranks if rank_of(pid) == 1), signal.SIGKILL)
        agent.wait(timeout=240)
    finally:
        _stop([agent.pid, *ranks])
        agent.wait()
    console = (tmp_path / "out.txt").read_text()
    assert agent.returncode == 0, console[-4000:]
    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log, log[-3000:]
    assert checkpoint.load(run_dir / "last.pt")["epoch"] == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("torchrun_env", "parent", "code"),
    [
        ({"TORCHELASTIC_RUN_ID": "x"}, "0", 1),
        ({"TORCHELASTIC_RUN_ID": "x"}, "None", 0),
        ({}, "0", 0),
    ],
)
def test_a_rank_whose_agent_is_gone_before_the_death_signal_exits(torchrun_env, parent, code):
    # Under torchrun the parent read first thing is the agent: another parent by the time the
    # signal is set means the agent died in between, and nobody would kill this rank. Pid 0 is
    # nobody's parent. Outside a launch nothing is set.
    env = {k: v for k, v in child_env().items() if not k.startswith("TORCHELASTIC")}
    done = subprocess.run(
        [sys.executable, "-c", "from audioclf.distributed.launch import die_with_launcher; "
         f"die_with_launcher({parent})"],
        cwd=ROOT, env={**env, **torchrun_env}, timeout=120,
    )  # fmt: skip
    assert done.returncode == code


@pytest.mark.parametrize(
    ("rank", "local_rank", "says"), [(0, 0, True), (1, 0, True), (1, 1, False)]
)
def test_a_rank_lost_without_a_word_is_said_on_every_nodes_console(rank, local_rank, says):
    # Rank 0 says it, and so does the first rank of every other node (its console may be the only
    # one read there); a peer's own reason is said by that peer.
    from audioclf.distributed import DistEnv, PeerFailure
    from audioclf.errors import AlreadyReported
    from audioclf.training.rundir import reported

    env = DistEnv(rank=rank, local_rank=local_rank, world_size=4, strategy="ddp")
    vanished = PeerFailure("stopped because another rank stopped without a word", reported=False)
    shown = reported(vanished, env, setting_up=False, stopping=False)
    assert (shown is vanished) is says and (says or isinstance(shown, AlreadyReported))
    said = PeerFailure("stopped because rank 3 failed: bad file", reported=True)
    assert isinstance(reported(said, env, setting_up=False, stopping=False), AlreadyReported)
