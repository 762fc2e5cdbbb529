"""Run-directory logging: train.log, and what a killed process leaves in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_process_killed_by_abort_leaves_its_stack_in_train_log(tmp_path):
    # NCCL's watchdog ends a rank stuck in a collective with abort(): no Python handler runs.
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from audioclf.logs import setup_logging
setup_logging(Path({str(tmp_path)!r}), rank=1)
def waiting_at_the_barrier():
    os.abort()
waiting_at_the_barrier()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode != 0
    log = (tmp_path / "train.log").read_text()
    assert "Fatal Python error: Aborted" in log and "waiting_at_the_barrier" in log
