"""One live run per run folder: the lock a second process meets (real processes, no mocks)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from audioclf.config import Config
from audioclf.training.rundir import LOCK_FILE, RunFolderBusy, RunLock, check_free, prepare_run_dir

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
HOLD = (
    "import sys, time\nfrom pathlib import Path\nfrom audioclf.training.rundir import RunLock\n"
    "lock = RunLock(Path(sys.argv[1]))\nlock.acquire()\nprint('held', flush=True)\n"
    "time.sleep(60)\n"
)


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_folder_is_refused_naming_its_holder_and_freed_when_it_dies(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = _holder(run_dir)
    try:
        with pytest.raises(
            RunFolderBusy,
            match=rf"in use by another run \(pid {holder.pid} on "
            r".*, started .* UTC\).*another train.name"
            r".*\./run\.sh stop run",
        ):
            check_free(run_dir)
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid}"):
            RunLock(run_dir).acquire()
    finally:
        holder.kill()  # no clean-up of its own: the kernel releases the lock
        holder.wait()
    check_free(run_dir)  # the file stays, the lock is gone
    lock = RunLock(run_dir)
    lock.acquire()
    assert str(__import__("os").getpid()) in (run_dir / LOCK_FILE).read_text()
    lock.release()


def test_a_refused_run_writes_nothing_into_the_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the first run's\n")
    holder = _holder(run_dir)
    try:
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        started = time.time()
        with pytest.raises(RunFolderBusy):
            prepare_run_dir(run_dir, Config())
        assert time.time() - started < 5  # refused at once, no waiting for the lock
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    lock, _ = prepare_run_dir(run_dir, Config())
    assert "data:" in (run_dir / "config.yaml").read_text()
    lock.release()
