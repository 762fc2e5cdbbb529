"""The fault matrix's last cases (issue 42): torch's agents under plain torchrun. Two torchrun
"nodes" on this machine (one rank each, c10d rendezvous at node 0's endpoint, as on two hosts),
then kill -9 of one node's agent or of its rank; and a one-node `torchrun --max-restarts 1` with
checkpoint.resume=auto that loses a rank and comes back from last.pt by itself.

A killed agent takes its rank with it (die_with_launcher: the kernel's parent-death signal);
the other node's rank stops with one `python -m audioclf.train: error:` line, exit 2, and its
agent ends at once (exit 1, with torch's own summary and traceback after that line), never
waiting at torch's 300 s exit barrier. Node 0 hosts the rendezvous store: when its agent dies,
node 1's agent ends itself in torch's RendezvousConnectionError traceback."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import (
    TRAIN_ERROR,
    Job,
    Result,
    Row,
    Work,
    alive,
    audioclf_tracebacks,
    check_run,
    ensure_demo,
    error_lines,
    first_error_line,
    log_line,
    read,
    start,
    train_args,
    wait_for,
)

BOUND = 60  # seconds a surviving node may take to stop once the other is gone
RANK_GONE = 10  # seconds a killed agent's rank may live on


def torchrun_node(args: list[str], port: int, *options: str, nnodes: int = 2) -> list[str]:
    """One torchrun node (one rank) of `nnodes`, rendezvous at 127.0.0.1:`port` over c10d."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={1 if nnodes > 1 else 2}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=faults",
        *options,
        "-m",
        "audioclf.train",
        *args,
    ]


def children(pid: int) -> list[int]:
    """The live children of process `pid` (a torchrun agent's ranks), from /proc."""
    found: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in listing.read_text().split()]
        except OSError:
            continue
    return [p for p in found if alive(p)]


def rank_of(pid: int) -> int:
    """The RANK torchrun gave process `pid`, from its environment; -1 when gone."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def two_nodes(work: Work, case_dir: Path, addresses: tuple[str, str]) -> list[Job]:
    """Node 0, then (once it serves the rendezvous store) node 1, each with --local-addr from
    `addresses`: the c10d rendezvous ranks the nodes by address, then by pid."""
    from tests.helpers import free_port

    port = free_port()
    args = train_args(work, case_dir / "runs", "train.epochs=300", "eval.every=0")
    jobs = []
    for address in addresses:
        jobs.append(start(torchrun_node(args, port, f"--local-addr={address}"), case_dir / "jobs"))
        deadline = time.time() + 120
        while time.time() < deadline and not _listens(port) and jobs[0].proc.poll() is None:
            time.sleep(0.1)
    return jobs


def stop_all(jobs: list[Job], ranks: dict[int, int]) -> list[Result]:
    """Each node's result (SIGKILL to whatever is left after BOUND seconds)."""
    results = [job.finish(BOUND) for job in jobs]
    for pid in ranks.values():
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    return results


def kill_and_watch(
    row: Row, jobs: list[Job], run_dir: Path, victim: int, what: str
) -> tuple[list[Result], float]:
    """Once epoch 1 has ended, kill -9 node `victim`'s agent or its rank (`what`); returns
    both nodes' results and how long the survivor took to end."""
    ranks: dict[int, int] = {}
    if row.expect(wait_for(run_dir / "train.log", "epoch 1/300:", 240), "epoch 1 never ended"):
        ranks = {n: (children(job.pid) or [-1])[0] for n, job in enumerate(jobs)}
        os.kill(jobs[victim].pid if what == "agent" else ranks[victim], signal.SIGKILL)
    killed = time.time()
    while time.time() - killed < RANK_GONE and alive(ranks.get(victim, -1)):
        time.sleep(0.1)
    row.expect(not alive(ranks.get(victim, -1)), f"node {victim}'s rank runs on, orphaned")
    survivor = jobs[1 - victim]
    try:
        survivor.proc.wait(BOUND)
    except Exception:  # noqa: BLE001 - stop_all kills it and the row says so
        pass
    took = time.time() - killed
    row.expect(took < BOUND, f"node {1 - victim} took {took:.0f} s to stop")
    return stop_all(jobs, ranks), took


def expect_one_line(row: Row, result: Result, node: int) -> None:
    """Node `node`'s console holds one audioclf error line, no audioclf traceback."""
    lines = [line for line in error_lines(result.console) if line.startswith(TRAIN_ERROR)]
    row.expect(len(lines) == 1, f"node {node}: {len(lines)} audioclf error lines, expected 1")
    row.expect(not audioclf_tracebacks(result.console), f"node {node}: an audioclf traceback")
    row.expect("frame #" not in result.console, f"node {node}: c10d's C++ frames")


def case_agent_kill(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    rows = []
    for letter, addresses, victim, name in (
        ("a", ("localhost", "127.0.0.1"), 1, "node 1's agent (node 1 holds rank 0)"),
        ("b", ("localhost", "localhost"), 1, "node 1's agent (node 1 holds rank 1)"),
        ("c", ("localhost", "localhost"), 0, "node 0's agent (it hosts the rendezvous store)"),
    ):
        row = Row(f"agents-{letter} two torchrun nodes: kill -9 of {name}")
        folder = case_dir / letter
        jobs = two_nodes(work, folder, addresses)
        results, took = kill_and_watch(row, jobs, folder / "runs" / "t", victim, "agent")
        survivor = results[1 - victim]
        row.code = str(survivor.code)
        row.message = first_error_line(survivor.console)
        row.expect(survivor.code == 1, f"node {1 - victim} exited {survivor.code}, expected 1")
        if victim == 1:
            expect_one_line(row, survivor, 1 - victim)
            row.expect("without a word" in row.message, "the line does not say a rank vanished")
        row.message = f"after {took:.0f} s: {row.message}"
        check_run(row, folder / "runs" / "t", epochs_done=1, checkpoint_epoch=1)
        rows.append(row)
    return rows


def case_rank_kill(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    row = Row("agents-d two torchrun nodes: kill -9 of node 1's rank")
    jobs = two_nodes(work, case_dir, ("localhost", "localhost"))
    results, took = kill_and_watch(row, jobs, case_dir / "runs" / "t", 1, "rank")
    row.code = f"{results[0].code}, {results[1].code}"
    row.message = f"after {took:.0f} s: {first_error_line(results[0].console)}"
    row.expect([r.code for r in results] == [1, 1], f"exits {row.code}, expected 1, 1")
    expect_one_line(row, results[0], 0)
    check_run(row, case_dir / "runs" / "t", epochs_done=1, checkpoint_epoch=1)
    return [row]


def case_restart_resume(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from tests.helpers import free_port

    ensure_demo(work)
    row = Row("agents-e torchrun --max-restarts 1, resume=auto: kill -9 of rank 1")
    run_dir = case_dir / "runs" / "t"
    args = train_args(work, case_dir / "runs", "train.epochs=4", "eval.every=0",
                      "checkpoint.every_steps=2", "checkpoint.resume=auto")  # fmt: skip
    job = start(torchrun_node(args, free_port(), "--max-restarts=1", nnodes=1), case_dir / "jobs")
    deadline = time.time() + 240
    while time.time() < deadline and not (run_dir / "last.pt").exists() and job.proc.poll() is None:
        time.sleep(0.1)
    killed = [p for p in children(job.pid) if rank_of(p) == 1]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    result = job.finish(240)
    resumed = log_line(read(run_dir / "train.log"), "resumed from").removeprefix("INFO ")
    row.code, row.message = str(result.code), first_error_line(result.console) or resumed
    row.expect(len(killed) == 1, "rank 1 was not found running after the first checkpoint")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(bool(resumed), "train.log does not say the run resumed")
    check_run(row, run_dir, epochs_done=4, checkpoint_epoch=4)
    return [row]


# (name, case) in the matrix's order: the last cases
CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("agent-kill", case_agent_kill),
    ("agent-rank-kill", case_rank_kill),
    ("agent-restart-resume", case_restart_resume),
]
