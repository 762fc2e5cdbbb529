"""Running the app under uvicorn: a socket bound before the model is served (so a port in use
is one clear line, and port 0 gets a free one), and a stop on SIGTERM or Ctrl-C that stops
taking connections, answers the requests in flight, embeds what is queued and returns.

    sock = listen("127.0.0.1", 8000)
    run(build_app(service), sock)        # returns after SIGTERM / Ctrl-C; the caller exits 0
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import signal
import socket

import uvicorn

BACKLOG = 2048  # uvicorn's default
# glibc gives each thread that allocates under contention a malloc arena of its own (up to 8 per
# CPU), each keeping its high-water mark: resident memory crept up by 28-64 MB over 10k requests
# at the default settings (issue 42); two arenas keep it flat (benchmarks/serve.py's memory run)
SERVER_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
GRACE_SECONDS = 30  # a stop waits this long for requests in flight, then closes them


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stop asked for by SIGTERM / SIGINT ends `run` normally
    (uvicorn raises the signal again after its graceful shutdown, which ends the process with
    it: 130 / -15 instead of 0). A second Ctrl-C still forces the exit."""

    @contextlib.contextmanager
    def capture_signals(self):
        signals = (signal.SIGINT, signal.SIGTERM)
        try:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        except ValueError:  # not the main thread (tests run the server in a thread)
            yield
            return
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bound_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Limit glibc's malloc to `arenas` arenas for this process, as MALLOC_ARENA_MAX would;
    call it before threads start. Whether it was set: not where MALLOC_ARENA_MAX is in the
    environment already (that wins), nor on another C library (musl, macOS)."""
    if "MALLOC_ARENA_MAX" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(_M_ARENA_MAX, arenas) == 1


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one); OSError naming them when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY on the accepted sockets
    # only then; without it every answer on a kept-alive connection waits ~40 ms (Nagle's
    # algorithm against the client's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)  # connections wait from here on, also while the model loads
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port "
            "(or --host), or stop what holds it"
        ) from None
    return sock


def make_server(app, *, log_level: str = "warning", access_log: bool = False) -> _Server:
    """A uvicorn server of `app`; `server.run(sockets=[sock])` serves until stopped
    (`server.should_exit = True` from another thread, or a signal in the main thread)."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=GRACE_SECONDS,
        lifespan="on",
    )
    return _Server(config)


def run(app, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Serve `app` on `sock` until SIGTERM / Ctrl-C, then stop gracefully and return."""
    make_server(app, log_level=log_level).run(sockets=[sock])
