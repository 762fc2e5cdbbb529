"""When a rank fails: it leaves its one-line reason in the rendezvous store, and the ranks that
lose it mid-collective name it (instead of a bare "connection closed")."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator

import torch.distributed as dist

from audioclf.distributed.group import is_initialized


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed or vanished mid-collective; `reported`
    when that rank said why itself (then this one need not say it again)."""

    def __init__(self, message: str, reported: bool):
        super().__init__(message)
        self.reported = reported


_FAILED_KEY = "audioclf/failed/{}"
# How gloo and NCCL report a collective whose peer is gone (besides torch's DistError types).
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "connection refused",
)


def announce_failure(reason: str) -> None:
    """Leave this rank's one-line reason in the rendezvous store, so the ranks that lose it
    can name it (best effort; not a collective)."""
    if not is_initialized():
        return
    try:
        dist.distributed_c10d._get_default_store().set(_FAILED_KEY.format(dist.get_rank()), reason)
    except Exception:  # noqa: BLE001 - the store may be gone with the failing peer
        pass


def is_peer_failure(exc: BaseException) -> bool:
    if not is_initialized():
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_GONE)


def _announced(deadline: float) -> dict[int, str]:
    """The reasons the other ranks left in the store (announce_failure) by `deadline`, by rank:
    the first poll that finds any."""
    reports: dict[int, str] = {}
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = [_FAILED_KEY.format(r) for r in range(dist.get_world_size()) if r != dist.get_rank()]
        while not reports and time.monotonic() < deadline:
            for key in keys:
                if store.check([key]):
                    reports[int(key.rsplit("/", 1)[1])] = store.get(key).decode()
            if not reports:
                time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store went down with the failing peer
        pass
    return reports


@contextlib.contextmanager
def _c10d_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null while the store is read: a read from a store that goes
    down meanwhile prints c10d's warning and 25 lines of C++ frames there (not through Python's
    logging), before the one line this rank is about to print."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _store_answers(seconds: float = 1.0) -> bool:
    """Whether the rendezvous store still takes connections at MASTER_ADDR:MASTER_PORT (where
    torchrun's agent, or rank 0, serves it), asked by a bare connect: a read from a store that
    went down with a killed agent prints c10d's warning and 25 lines of C++ frames."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not address or not port.isdigit():
        return True  # not known here: the store's own call says
    try:
        socket.create_connection((address, int(port)), timeout=seconds).close()
    except OSError:
        return False
    return True


def peer_failure(exc: BaseException, wait_seconds: float = 3.0) -> PeerFailure:
    """What to say when a collective failed because of a peer: the lowest rank that announced
    its reason within `wait_seconds`, else that a rank stopped without a word."""
    # A store that went down with the agent (or rank 0) that hosted it holds no reasons.
    reports = {}
    if _store_answers():
        with _c10d_silenced():  # the store can still go down between the probe and the reads
            reports = _announced(time.monotonic() + wait_seconds)
    if reports:
        rank, reason = min(reports.items())
        return PeerFailure(f"stopped because rank {rank} failed: {reason}", reported=True)
    detail = " ".join(str(exc).split())[:200]
    return PeerFailure(
        "stopped because another rank stopped without a word (killed? out of memory? its "
        f"node's agent killed? torchrun's summary on its node names it): {detail}",
        reported=False,
    )
