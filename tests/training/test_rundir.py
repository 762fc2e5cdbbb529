"""One live run per run folder: the lock a second process meets (real processes, no mocks)."""

from __future__ import annotations

import time

import pytest

from audioclf.config import Config
from audioclf.outputs import FolderBusy
from audioclf.training.rundir import LOCK_FILE, RunLock, check_free, prepare_run_dir
from tests.helpers import LockHolder

pytestmark = pytest.mark.slow  # every test here starts processes


def test_a_held_folder_is_refused_naming_its_holder_and_freed_when_it_dies(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = LockHolder(run_dir / LOCK_FILE)
    try:
        with pytest.raises(
            FolderBusy,
            match=rf"in use by another run \(pid {holder.pid} on "
            r".*, started .* UTC\).*another train.name"
            r".*\./run\.sh stop run",
        ):
            check_free(run_dir)
        with pytest.raises(FolderBusy, match=f"pid {holder.pid}"):
            RunLock(run_dir).acquire()
    finally:
        holder.release()  # killed, no clean-up of its own: the kernel releases the lock
    check_free(run_dir)  # the file stays, the lock is gone
    lock = RunLock(run_dir)
    lock.acquire()
    assert str(__import__("os").getpid()) in (run_dir / LOCK_FILE).read_text()
    lock.release()


def test_a_refused_run_writes_nothing_into_the_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the first run's\n")
    holder = LockHolder(run_dir / LOCK_FILE)
    try:
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        started = time.time()
        with pytest.raises(FolderBusy):
            prepare_run_dir(run_dir, Config())
        assert time.time() - started < 5  # refused at once, no waiting for the lock
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    finally:
        holder.release()
    lock, _ = prepare_run_dir(run_dir, Config())
    assert "data:" in (run_dir / "config.yaml").read_text()
    lock.release()
