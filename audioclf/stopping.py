"""How a run stops: on request (SIGTERM / SIGINT: finish the step, save last.pt, exit 0) and on
failure (what each rank logs and what its console shows)."""

from __future__ import annotations

import logging
import os
import signal

from audioclf import distributed
from audioclf.cli import AlreadyReported, is_user_error, one_line
from audioclf.logs import log_failure_to_file

log = logging.getLogger("audioclf")


class StopRequested:
    """SIGTERM / SIGINT set a flag; the loop finishes the step, saves last.pt and exits (0 after
    SIGTERM, 130 after Ctrl-C). A second Ctrl-C stops the process at once: last.pt stays the
    last one written (checkpoint writes are atomic, so it is whole)."""

    def __init__(self):
        self.flag = False
        self.signal: str | None = None  # the signal that asked to stop, e.g. "SIGINT"
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test thread)
                pass
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.flag and signum == signal.SIGINT:
            log.error("second Ctrl-C: stopping at once; last.pt is the last one saved")
            os._exit(130)
        if not self.flag:
            log.warning(
                "received %s: stopping at the next step boundary all ranks agree on, "
                "then saving last.pt%s",
                name,
                " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "",
            )
        self.flag = True
        self.signal = self.signal or name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def reported(
    exc: Exception, env: distributed.DistEnv, *, setting_up: bool, stopping: bool
) -> Exception:
    """Log a rank's failure once and decide what its console shows.

    The rank that failed says why (and leaves its reason for the others, whose train.log lines
    name it); the ranks that lost it say nothing more, unless it vanished without a word (rank
    0 then says so). Set-up errors are the same on every rank (same config, same sheet): rank 0
    alone prints them.
    """
    if distributed.is_peer_failure(exc):
        exc = distributed.peer_failure(exc)
    else:
        distributed.announce_failure(one_line(exc))
    log_failure_to_file(exc, env.rank, traceback=not is_user_error(exc))
    if stopping:
        log.error("last.pt was not updated by the stop request: %s", one_line(exc))
    peer = isinstance(exc, distributed.PeerFailure)
    quiet = (peer and exc.reported) or (not env.is_primary and (setting_up or peer))
    return AlreadyReported() if quiet else exc
