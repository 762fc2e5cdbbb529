"""Who started this process, and as which rank: torchrun, the legacy launcher, or SLURM.

`env_ranks()` reads the launcher's environment (torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or
an srun task's SLURM_* variables, which it exports under torchrun's names with MASTER_ADDR and
MASTER_PORT for the env:// rendezvous). `launch_ranks` starts local ranks as torchrun does,
after `check_local_gpus` has made sure a CUDA run has a GPU for each. It does not talk to
torch.distributed: that is audioclf.distributed's job.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from audioclf.errors import AlreadyReported

log = logging.getLogger("audioclf")


def env_ranks(local_rank_arg: int | None = None) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) of this process, from whichever launcher started it.

    torchrun and the legacy launcher (which passes --local_rank) set RANK / WORLD_SIZE /
    LOCAL_RANK, and these win whenever present: torchrun started by srun sees SLURM's variables
    too. A task of `srun python -m audioclf.train` has only SLURM's; they are then exported
    under torchrun's names, with MASTER_ADDR and MASTER_PORT, for the env:// rendezvous of the
    process group (see _slurm_ranks). Anything else is one process.
    """
    if not any(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        slurm = _slurm_ranks()
        if slurm is not None:
            return slurm
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(
        os.environ.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0)
    )
    return rank, local_rank, world_size


def _slurm_ranks() -> tuple[int, int, int] | None:
    """env_ranks of a task in an srun job step of several tasks; None for anything else.

    Only srun's tasks carry SLURM_STEP_ID. The batch script and an salloc shell also have
    SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but nobody started their peers: waiting
    for them would hang until the timeout, so they train alone (with a warning).
    """
    env = os.environ
    if "SLURM_PROCID" not in env:
        return None
    # SLURM_STEP_NUM_TASKS is the step's own count, also under `srun --export-env` (-E).
    world_size = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        if world_size > 1:
            log.warning(
                "SLURM_NTASKS=%d but this process was not started by srun (no SLURM_STEP_ID): "
                "training in one process. Start one task per GPU with `srun python -m "
                "audioclf.train ...`, or one torchrun per node (scripts/slurm/train.sbatch)",
                world_size,
            )
        return None
    if world_size == 1:
        return None
    rank = int(env["SLURM_PROCID"])
    if not 0 <= rank < world_size:
        raise RuntimeError(f"SLURM_PROCID={rank} is outside the step's {world_size} tasks")
    local_rank = _slurm_device_index(int(env.get("SLURM_LOCALID", "0")))
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = _slurm_master_addr()
    env.setdefault("MASTER_PORT", _slurm_master_port())
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    return rank, local_rank, world_size


def _slurm_device_index(local_id: int) -> int:
    """The CUDA index for SLURM_LOCALID: under `srun --gpus-per-task` (or --gpu-bind) a task's
    CUDA_VISIBLE_DEVICES lists only its own GPU, which it sees as cuda:0."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return local_id if not visible or local_id < len(visible) else 0


def _slurm_master_addr() -> str:
    """First host of the step's node list: task 0 runs there under srun's block or cyclic layout."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        nodelist = os.environ.get(name, "").strip()
        if nodelist:
            return _first_host(nodelist) or _scontrol_first_host(nodelist)
    raise RuntimeError(
        "started by srun, but SLURM_JOB_NODELIST is not set: set MASTER_ADDR to "
        "the address of the node that runs SLURM_PROCID=0"
    )


def _first_host(nodelist: str) -> str | None:
    """First host of a compressed SLURM node list ("gpu[01-04,07],cpu3" → "gpu01"), or None
    when the list is malformed. Parsed here because scontrol is often absent inside containers."""
    host, rest = "", nodelist.strip()
    while rest and rest[0] != ",":
        if rest[0] == "[":
            ranges, closed, rest = rest[1:].partition("]")
            bounds = [part.split("-") for part in ranges.split(",")]
            if not closed or not all(
                len(b) <= 2 and all(x.isascii() and x.isdigit() for x in b) for b in bounds
            ):
                return None
            host += bounds[0][0]  # as written: keeps the zero padding of "gpu[01-04]"
        elif rest[0] == "]" or rest[0].isspace():
            return None
        else:
            host, rest = host + rest[0], rest[1:]
    return host or None


def _scontrol_first_host(nodelist: str) -> str:
    """First host of a node list that _first_host could not read, from `scontrol show hostnames`."""
    try:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        hosts = []
    if not hosts:
        raise RuntimeError(
            f"cannot read the first host of the SLURM node list {nodelist!r}, and `scontrol show "
            "hostnames` gave none: set MASTER_ADDR to the address of the node that runs "
            "SLURM_PROCID=0"
        )
    return hosts[0]


def _slurm_master_port() -> str:
    """10000 + job id mod 20000: jobs sharing a node get different ports, all below Linux's
    ephemeral range (32768 and up) that outgoing connections draw from."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    return str(10000 + int(job_id) % 20000) if job_id.isascii() and job_id.isdigit() else "29500"


def uses_cuda(device: str) -> bool:
    """Whether train.device (auto | cpu | cuda) trains on CUDA: auto does when a GPU is visible."""
    return torch.cuda.is_available() if device == "auto" else device == "cuda"


def check_local_gpus(nproc: int, device: str) -> None:
    """Before `nproc` local ranks start: on CUDA each takes cuda:<local rank>, so a rank past
    the visible GPUs would die in set_device ("invalid device ordinal") with only an exit code
    for the launcher to show. Raises ValueError in one line; nothing to check on the CPU."""
    if not uses_cuda(device):
        return
    visible = torch.cuda.device_count()
    if nproc <= visible:
        return
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    fix = f"use --nproc-per-node {visible} or fewer" if visible else "use train.device=cpu"
    raise ValueError(
        f"--nproc-per-node {nproc} starts a rank per GPU, but {visible} GPU(s) are visible"
        f"{'' if shown is None else f' (CUDA_VISIBLE_DEVICES={shown})'}: {fix}"
    )


LAUNCHER_PID = "AUDIOCLF_LAUNCHER_PID"  # set by launch_ranks in its ranks' environment
_PR_SET_PDEATHSIG = 1


class LaunchStopped(Exception):
    """The ranks started by `launch_ranks` were stopped by a signal (Ctrl-C, SIGTERM)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def die_with_launcher(parent_at_start: int | None = None) -> None:
    """In a rank started by torch's elastic agent (plain torchrun, on every node of a multi-node
    run, or `launch_ranks`): be killed (SIGKILL) when that agent dies, however it dies (kill -9,
    a closed terminal, an OOM killer, a scheduler), so no rank trains on alone, orphaned, holding
    the run lock (the kernel releases it with the process; last.pt stays the last one written,
    whole). The ranks of the other nodes then lose it mid-collective and stop with one line
    (distributed.failures). SIGKILL, not SIGTERM: a stop vote would end the survivors with
    exit 0, and their agents would then wait 300 s at torch's exit barrier for the dead one.

    `parent_at_start` is os.getppid() read first thing, before the seconds of imports: an agent
    that died before the prctl leaves this rank another parent, and it exits at once. Under
    `launch_ranks` the launcher's pid is known (LAUNCHER_PID). Linux only (prctl
    PR_SET_PDEATHSIG); elsewhere a no-op. Nothing outside a launch (plain python, srun)."""
    launcher = _launcher_pid(parent_at_start)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes  # noqa: PLC0415 - only ranks of a launch need it

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # it died before the prctl: nobody would kill us
        os._exit(1)


def _launcher_pid(parent_at_start: int | None) -> int | None:
    """The pid of the agent that started this rank, or None outside a launch: launch_ranks
    names itself; torchrun (TORCHELASTIC_RUN_ID) starts its ranks itself, as its children."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    if launcher.isdigit():
        return int(launcher)
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return os.getppid() if parent_at_start is None else parent_at_start


class _Interrupts:
    """The launcher's Ctrl-C / SIGTERM / SIGHUP: ends torch's agent (SignalException), which
    sends the ranks SIGTERM, not the SIGINT it would pass on. A rank still importing then dies
    without a KeyboardInterrupt traceback; a training rank stops at its next stop vote and
    saves last.pt (rundir.StopRequested). `first` is the signal that asked to stop."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")

    def __init__(self, at_once: Callable[[str], None]):
        self.first: str | None = None
        self.at_once = at_once

    def install(self) -> None:
        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def uninstall(self) -> None:
        for name in self.SIGNALS:  # the launch is over: a late signal has nothing to stop
            signal.signal(getattr(signal, name), signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415

        if self.first is not None:  # a second one: the ranks die with this process
            self.at_once(self.first)
            os._exit(130 if self.first == "SIGINT" else 143)
        self.first = signal.Signals(signum).name
        raise SignalException(f"stopped by {self.first}", sigval=signal.SIGTERM)


def _silence_torch_elastic() -> None:
    """torch's agent logs warnings and one error line per failed rank (with its own
    summary) under torch.distributed.*: the ranks and this launcher say what happened."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [logging.NullHandler()]
        logger.propagate = False


def launch_ranks(
    nproc: int,
    module: str,
    argv: list[str],
    at_once: Callable[[str], None] = lambda name: None,
    noted: Callable[[], str | None] = lambda: None,
) -> None:
    """`python -m <module> <argv>` on `nproc` local ranks through torch's elastic launcher, as
        `torchrun --standalone --nproc_per_node <nproc>` does (one node, no restarts, each rank in
        a session of its own, so a Ctrl-C reaches this launcher, which asks the ranks to stop
        once, with SIGTERM; a second signal calls `at_once(first signal's name)` and exits at once,
    killing the ranks). Each rank should call `die_with_launcher` first thing. `noted()` names a
    signal the caller caught before this took the signals over (then nothing starts).

        Raises LaunchStopped when a signal stopped the ranks, RuntimeError naming the failed ranks'
        exit codes when one was killed, AlreadyReported when one failed (it printed why)."""
    import uuid  # noqa: PLC0415 - the launcher's own imports only when it launches

    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    _silence_torch_elastic()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: CPU ranks share the cores
    os.environ[LAUNCHER_PID] = str(os.getpid())
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"audioclf-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
        # torch's agent would handle these itself, passing the signal itself on to the ranks
        # (a KeyboardInterrupt traceback in a rank still importing): _Interrupts does instead.
        signals_to_handle="",
    )
    interrupts = _Interrupts(at_once)
    interrupts.install()
    if (early := noted()) is not None:
        interrupts.uninstall()
        raise LaunchStopped(early)
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except SignalException:
        raise LaunchStopped(interrupts.first or "SIGTERM") from None
    except ChildFailedError as exc:
        codes = sorted({failure.exitcode for failure in exc.failures.values()})
        if all(code > 0 for code in codes):  # the rank printed why (one line, or a traceback)
            raise AlreadyReported() from None
        raise RuntimeError(
            f"rank(s) {', '.join(map(str, sorted(exc.failures)))} died (exit status "
            f"{', '.join(map(str, codes))}: killed by a signal, e.g. out of memory)"
        ) from None
    finally:
        interrupts.uninstall()


def launch_tool(
    prog: str, nproc: int, module: str, argv: list[str], last: Path, noted=lambda: None
) -> int:
    """`launch_ranks` for the tool `prog` (python -m audioclf.train --nproc-per-node N): its
    exit status, 0, or 130 (SIGINT) / 143 after one line saying what a stop left (`last`, the
    run's last.pt, and whether this launch wrote it)."""
    started = time.time()

    def said(signal_name: str, at_once: bool = False) -> None:
        print(f"{prog}: {stopped_line(signal_name, last, started, at_once)}", file=sys.stderr)

    try:
        launch_ranks(nproc, module, argv, at_once=lambda n: said(n, True), noted=noted)
    except LaunchStopped as stop:
        said(stop.signal_name)
        return 130 if stop.signal_name == "SIGINT" else 143
    return 0


def stopped_line(signal_name: str, last: Path, started: float, at_once: bool) -> str:
    """What a stopped launch says: last.pt only when it exists, and whether this run wrote it."""
    how = f"stopped at once by a second {signal_name}" if at_once else f"stopped by {signal_name}"
    if not last.is_file():
        return (
            f"{how} before the first checkpoint: nothing to resume; run the same command "
            "again to start over"
        )
    before = " (from before this launch)" if last.stat().st_mtime < started else ""
    return f"{how}; {last}{before} is the last checkpoint saved; resume with checkpoint.resume=auto"
