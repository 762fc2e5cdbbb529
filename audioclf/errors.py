"""The error policy of every tool, and the errors library modules raise for it.

Every `python -m audioclf.<tool>` parses its arguments and hands its body to `run_cli`:

    def main(argv=None) -> int:
        args = parse_args(argv)
        return run_cli(PROG, lambda: run(args))

Error policy (one for all tools): bad input — a ValueError or OSError anywhere, or any error
raised by audioclf's own code — prints one line `<prog>: error: <message>` and exits 2. An
error raised inside a library (torch, numpy, ...) for another reason keeps its traceback, as a
bug should. AUDIOCLF_DEBUG=1 shows every traceback.

The flags several tools share sit here too (--trust-checkpoint, --adapt, the skip hint), so a
tool's parser needs nothing but this module before its body runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

DEBUG_ENV = "AUDIOCLF_DEBUG"  # set to 1 to get tracebacks instead of one-line errors
PACKAGE_DIR = Path(__file__).resolve().parent
SKIP_HINT = "pass --skip-bad-files"  # how a tool's unreadable-file message says to skip them


class AlreadyReported(Exception):
    """An error another process (rank 0, the failing rank) reports: exit 2 without a word."""


class UsageError(ValueError):
    """Bad command-line input (flags, paths) found by a CLI's own checks; the CLI prints it as
    one line and exits 2. The library under the tools raises plain ValueError (or a subclass)
    instead, which the same policy prints the same way."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: worker tracebacks reduced to their final message."""
    text = str(exc).strip() or type(exc).__name__
    if "Original Traceback" in text:  # raised inside a DataLoader worker
        last = [line for line in text.splitlines() if line.strip()][-1]
        head, sep, message = last.partition(": ")
        text = message if sep and "." in head and " " not in head else last
    return " ".join(text.split())


def is_user_error(exc: BaseException) -> bool:
    """Bad input with a clear message: ValueError / OSError, or raised by audioclf itself."""
    if isinstance(exc, (ValueError, OSError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE_DIR)


def run_cli(prog: str, run: Callable[[], int]) -> int:
    """Run a CLI body under the error policy above; returns the exit status."""
    try:
        return run()
    except AlreadyReported:
        return 2
    except Exception as exc:
        if getattr(exc, "reported", False):  # distributed.PeerFailure: another rank said why
            return 2
        if not is_user_error(exc) or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        # Under torchrun another rank's progress bar may hold the terminal's current line.
        fresh_line = "\n" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{fresh_line}{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2


# The flags several tools share, beside the runner they all use.


def add_trust_flag(parser) -> None:
    """--trust-checkpoint, the opt-in checkpoint.TRUST_HINT names, on a tool's argparse parser."""
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load a checkpoint that holds more than tensors and plain data "
        "(its Python objects can run code while loading): only for a file you "
        "trust",
    )


ADAPT_HELP = (
    "AdaBN first: a checkpoint's BatchNorm statistics from this folder (or file) of unlabelled "
    "audio of the new source; repeatable"
)


def add_adapt_flag(parser) -> None:
    """`--adapt DIR` (repeatable) for embed, evaluate and export. An empty DIR is refused by
    argparse with one line: Path('') would be the working folder, adapted on silently."""
    parser.add_argument("--adapt", action="append", type=_source, metavar="DIR", help=ADAPT_HELP)


def _source(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "got an empty path (''); pass the files or folders of unlabelled audio of the new source"
        )
    return Path(text)
