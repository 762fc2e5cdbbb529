"""The index under DDP, as the trainer loads it (primary_first(load_index)) in a real 2-process
gloo group: rank 0 builds the cache, rank 1 reads."""

from __future__ import annotations

import datetime
import json
import socket
import time
from pathlib import Path

import pandas as pd
import pytest
import torch.multiprocessing as mp

from audioclf.config import DataConfig
from audioclf.data.index import load_index
from tests.helpers import make_files, sample_rows, write_sheet

pytestmark = pytest.mark.slow  # every test here starts processes

WORLD_SIZE = 2
JOIN_SECONDS = 50  # below the group's 60 s timeout: a rank stuck at a barrier fails the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, sheet: str, out_dir: str) -> None:
    """Load the index on this rank; write the table, or the error, and who parsed, to out_dir."""
    import torch.distributed as dist

    from audioclf import distributed
    from audioclf.data import index as index_module

    out = Path(out_dir)
    parse = index_module.read_table

    def recording_read_table(path, cfg):
        (out / f"parsed.rank{rank}").touch()
        return parse(path, cfg)

    index_module.read_table = recording_read_table
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        index = distributed.primary_first(index_module.load_index, DataConfig(index=sheet))
        index.table.to_parquet(out / f"table.rank{rank}.parquet")
    except Exception as exc:
        (out / f"error.rank{rank}.json").write_text(
            json.dumps({"type": type(exc).__name__, "message": str(exc)})
        )
    finally:
        dist.destroy_process_group()


def run_ranks(sheet: Path, out_dir: Path) -> None:
    """Start both ranks and join them, failing if they are not done within JOIN_SECONDS. The
    ranks are judged by the files they write (see run_in_group in tests/helpers.py)."""
    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    args = (_free_port(), str(sheet), str(out_dir))
    procs = [ctx.Process(target=_rank_main, args=(rank, *args)) for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_SECONDS
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.1))
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.kill()
    assert not alive, f"ranks still running after {JOIN_SECONDS} s (a hang)"


def test_rank0_builds_the_cache_and_rank1_reads_it(tmp_path):
    frame = sample_rows()
    make_files(frame, tmp_path)
    sheet = write_sheet(frame, tmp_path / "index.xlsx")
    run_ranks(sheet, tmp_path / "out")

    out = tmp_path / "out"
    assert not list(out.glob("error.*")), [p.read_text() for p in out.glob("error.*")]
    assert sorted(p.name for p in out.glob("parsed.*")) == ["parsed.rank0"]
    tables = [pd.read_parquet(out / f"table.rank{r}.parquet") for r in range(WORLD_SIZE)]
    pd.testing.assert_frame_equal(tables[0], tables[1])
    pd.testing.assert_frame_equal(tables[0], load_index(DataConfig(index=str(sheet))).table)


def test_validation_error_reaches_every_rank_without_waiting(tmp_path):
    frame = sample_rows()
    frame.loc[4, "a_id"] = frame.loc[1, "a_id"]
    make_files(frame, tmp_path)
    sheet = write_sheet(frame, tmp_path / "index.xlsx")
    run_ranks(sheet, tmp_path / "out")

    out = tmp_path / "out"
    errors = [json.loads((out / f"error.rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert errors[0]["type"] == "IndexValidationError"
    for error in errors:
        assert "'002' at rows 3, 6" in error["message"]
    assert sorted(p.name for p in out.glob("parsed.*")) == ["parsed.rank0"]
    assert not list(tmp_path.glob(".audioclf_cache/*"))
