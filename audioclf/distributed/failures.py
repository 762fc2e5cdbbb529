"""When a rank fails: it leaves its one-line reason in the rendezvous store, and the ranks that
lose it mid-collective name it (instead of a bare "connection closed")."""

from __future__ import annotations

import time

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


def peer_failure(exc: BaseException, wait_seconds: float = 3.0) -> PeerFailure:
    """What to say when a collective failed because of a peer: the lowest rank that announced
    its reason within `wait_seconds`, else that a rank stopped without a word."""
    deadline = time.monotonic() + wait_seconds
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
    if reports:
        rank, reason = min(reports.items())
        return PeerFailure(f"stopped because rank {rank} failed: {reason}", reported=True)
    detail = " ".join(str(exc).split())[:200]
    return PeerFailure(
        "stopped because another rank stopped without a word (killed? out of "
        f"memory? torchrun's summary names it): {detail}",
        reported=False,
    )
