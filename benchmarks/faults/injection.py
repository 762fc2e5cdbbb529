"""The fault matrix's worker: `audioclf.train` (or another tool) with a fault injected inside the
run, started by the cases as

    python -m benchmarks.faults.injection --worker MODE [--at N ...] -- <the tool's arguments>

Training faults hook torch.save or the trainer (a disk filled in epoch N, ENOSPC or kill -9 in
the Nth save, a stop at step N); write faults meet every file a tool writes (EROFS under a
folder, a full disk, kill -9 halfway through the Nth write of a matching file)."""

from __future__ import annotations

import argparse
import builtins
import errno
import fnmatch
import importlib
import io
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import fill

# ---------------------------------------------------------------------------------------------
# Hidden worker mode: `audioclf.train` with a fault injected inside the run


def worker_main(argv: list[str]) -> int:
    import torch

    from audioclf import checkpoint
    from audioclf.train import main as train_main
    from audioclf.training.trainer import TrainHooks

    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults.injection")
    parser.add_argument("--worker", required=True, choices=(*TRAIN_FAULTS, *WRITE_FAULTS))
    parser.add_argument("--tool", default="train", help="the audioclf tool run (write faults)")
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--at-epoch", type=int, default=0)
    parser.add_argument("--ballast", type=Path)
    parser.add_argument("--free-kb", type=int, default=64)
    parser.add_argument("--under", type=Path)
    parser.add_argument("--file", default="*", help="kill-in-write: an fnmatch of the file name")
    args = parser.parse_args(argv[:cut])
    tool_args = argv[cut + 1 :]
    if args.worker in WRITE_FAULTS:
        patch_writes(write_fault(args))
        if args.tool != "train":
            module = "audioclf.search.cli" if args.tool == "search" else f"audioclf.{args.tool}"
            return importlib.import_module(module).main(tool_args)
        return train_main(tool_args)
    hooks = None
    real_save = torch.save
    saves = []

    if args.worker == "fill-disk":

        def on_step(trainer):
            if trainer.state.epoch + 1 == args.at_epoch and not saves:
                saves.append(1)
                fill(args.ballast, args.free_kb)

        hooks = TrainHooks(on_step=on_step)
    elif args.worker == "stop-at":
        from tests.train_hooks import stop_at

        hooks = stop_at(args.at)
    else:  # enospc, kill-in-save

        def save(obj, f, *a, **k):
            saves.append(1)
            if len(saves) != args.at:
                return real_save(obj, f, *a, **k)
            if args.worker == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device")
            buffer = io.BytesIO()
            real_save(obj, buffer, *a, **k)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = save
    assert checkpoint.save_atomic  # the module that calls torch.save is imported
    return train_main(tool_args, hooks=hooks)


# Faults inside a training run (torch.save, the trainer's hooks), and in the files any tool
# writes (patch_writes).
TRAIN_FAULTS = ("fill-disk", "enospc", "kill-in-save", "stop-at")
WRITE_FAULTS = ("erofs", "full-disk", "kill-in-write")


class DiesMidWrite:
    """A file whose first write writes half its bytes, flushes, and SIGKILLs the process."""

    def __init__(self, handle):
        self.handle = handle

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def write(self, data) -> int:
        data = bytes(data)
        self.handle.write(data[: len(data) // 2])
        self.handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        return 0


class OnAFullDisk(DiesMidWrite):
    """A file on a disk with no room left."""

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def write_fault(args: argparse.Namespace) -> Callable[[Path], type | None]:
    """For a file about to be opened for writing: the class to wrap its handle in (None: none);
    raises EROFS for a file or folder under --under (erofs)."""
    under = str(args.under.resolve()) if args.under else None
    matched = []

    def fault(path: Path) -> type | None:
        inside = under is not None and str(path.resolve()).startswith(under)
        if args.worker == "erofs" and inside:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        if args.worker == "full-disk":
            return OnAFullDisk if inside else None
        if args.worker == "kill-in-write" and fnmatch.fnmatch(path.name, args.file):
            matched.append(path)
            return DiesMidWrite if len(matched) == args.at else None
        return None

    return fault


def patch_writes(fault: Callable[[Path], type | None]) -> None:
    """Every file audioclf writes (fileio's atomic writes, the output locks, prepare's feature
    files, folders) meets `fault` first."""
    import pathlib

    import audioclf.fileio
    import audioclf.outputs
    import audioclf.precompute.files

    real_mkdir, real_open = pathlib.Path.mkdir, builtins.open

    def mkdir(self, *a, **k):
        if not self.exists():
            fault(self)
        return real_mkdir(self, *a, **k)

    def open_(path, mode="r", *a, **k):
        wrapper = fault(Path(path)) if any(c in mode for c in "wxa+") else None
        handle = real_open(path, mode, *a, **k)
        return handle if wrapper is None else wrapper(handle)

    pathlib.Path.mkdir = mkdir
    for module in (audioclf.fileio, audioclf.outputs, audioclf.precompute.files):
        module.open = open_


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
