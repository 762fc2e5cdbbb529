"""embed --index on two real gloo ranks: the same bytes as one process, resumable across rank
counts, one rank's failure stops both, and the torchrun command a user runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.helpers import ROOT, child_env, make_checkpoint, run_in_group

pytestmark = pytest.mark.slow  # every test here starts processes

CHUNK = 10  # rows per part: 48 rows are 5 chunks, dealt 3 / 2 to two ranks


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_demo) -> dict:
    """48 demo rows (4 classes) with absolute paths, and an untrained tiny CNN checkpoint."""
    root = tmp_path_factory.mktemp("embed_ranks")
    table = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl")
    table = table[table["a_cls"].isin(sorted(set(table["a_cls"]))[:4])].copy()
    table["path"] = [str(tiny_demo.parent / p) for p in table["path"]]
    sheet = root / "sheet.csv"
    table.to_csv(sheet, index=False)
    return {"sheet": sheet, "model": make_checkpoint(root / "model.pt"), "root": root}


def _embed(rank, world, model_path, sheet, prefix, bad_rows=()):
    """write_index_embeddings as embed --index runs it, on this rank's CPU (one thread)."""
    import torch

    from audioclf.embedding.index import select_rows, write_index_embeddings
    from audioclf.inference import load_embedder

    torch.set_num_threads(1)
    model = load_embedder(model_path, torch.device("cpu"))
    index = select_rows(model, sheet, root=None, split=None, skip_bad_files=False)
    for row in bad_rows:  # a file that cannot be read (a 0-byte wav) in a chunk of rank 1
        Path(index.table["path"].iloc[row]).write_bytes(b"")
    summary = write_index_embeddings(model, index, prefix, chunk_rows=CHUNK, progress=False)
    return summary.embedded, summary.resumed


class Killed(Exception):
    """The process dying after some chunks."""


def _embed_or_error(rank, world, *args):
    """_embed, or this rank's error as (type, one line): both ranks' outcomes reach the test."""
    try:
        return _embed(rank, world, *args)
    except Exception as exc:  # the test asserts on it
        return type(exc).__name__, " ".join(str(exc).split())[:400]


def _saved(prefix: Path) -> tuple[np.ndarray, pd.DataFrame]:
    return np.load(f"{prefix}.npy"), pd.read_parquet(f"{prefix}.parquet")


def test_two_ranks_write_the_bytes_of_one_process(tmp_path, inputs):
    one = _embed(0, 1, inputs["model"], inputs["sheet"], tmp_path / "one")
    two = run_in_group(_embed, tmp_path, inputs["model"], inputs["sheet"], tmp_path / "two")
    assert one == (48, 0) and two == [(48, 0), (48, 0)]
    (emb1, rows1), (emb2, rows2) = _saved(tmp_path / "one"), _saved(tmp_path / "two")
    assert emb1.tobytes() == emb2.tobytes()  # bitwise, not just close
    pd.testing.assert_frame_equal(rows1, rows2)
    assert not (tmp_path / "two.parts").exists()


def test_a_rerun_with_another_number_of_ranks_takes_every_finished_chunk(
    tmp_path, inputs, monkeypatch
):
    from audioclf.embedding import index as index_embedding

    real_write, written = index_embedding.write_part, []

    def dying_write(path, part):  # one process dies after 3 of the 5 chunks
        if len(written) == 3:
            raise Killed
        written.append(path.name)
        return real_write(path, part)

    monkeypatch.setattr(index_embedding, "write_part", dying_write)
    with pytest.raises(Killed):
        _embed(0, 1, inputs["model"], inputs["sheet"], tmp_path / "resumed")
    assert len(written) == 3
    monkeypatch.setattr(index_embedding, "write_part", real_write)
    results = run_in_group(_embed, tmp_path, inputs["model"], inputs["sheet"], tmp_path / "resumed")
    assert results == [(48, 3), (48, 3)]  # both ranks report the global count taken over
    straight = _embed(0, 1, inputs["model"], inputs["sheet"], tmp_path / "straight")
    assert straight == (48, 0)
    assert _saved(tmp_path / "resumed")[0].tobytes() == _saved(tmp_path / "straight")[0].tobytes()


def test_one_ranks_unreadable_file_stops_both_ranks_at_once(tmp_path, inputs):
    # Copy the sheet's files so that one can be broken without touching the shared demo.
    table = pd.read_csv(inputs["sheet"], dtype=str)
    folder = tmp_path / "wav"
    folder.mkdir()
    copies = []
    for i, path in enumerate(table["path"]):
        copies.append(folder / f"{i:03d}.wav")
        copies[-1].write_bytes(Path(path).read_bytes())
    table["path"] = [str(p) for p in copies]
    sheet = tmp_path / "sheet.csv"
    table.to_csv(sheet, index=False)
    # chunk 1 (rows 10-19) is rank 1's
    rank0, rank1 = run_in_group(
        _embed_or_error, tmp_path, inputs["model"], sheet, tmp_path / "out", (12,), timeout=120
    )
    assert rank0 == ("PeerFailure", "another rank's chunk failed (it said why)")
    assert rank1[0] == "AudioReadError" and "012.wav" in rank1[1] and "row 14" in rank1[1]
    assert not (tmp_path / "out.npy").exists()
    assert sorted(p.name for p in (tmp_path / "out.parts").glob("chunk-*")) == ["chunk-000000.npz"]


def _embed_adapted(rank, world, model_path, sheet, prefix, source):
    """embed --index --adapt SOURCE as the CLI runs it; rank 1 cannot read a clip (its reader
    raises), so it can only embed with statistics that rank 0 measured."""
    import torch

    from audioclf.embedding.index import select_rows, write_index_embeddings
    from audioclf.inference import adapt as adapt_module
    from audioclf.inference import load_embedder

    torch.set_num_threads(1)
    if rank == 1:

        def unreadable(*_args, **_kwargs):
            raise AssertionError("rank 1 read the adaptation clips")

        adapt_module.read_clips = unreadable
    model = adapt_module.adapt_across_ranks(
        load_embedder(model_path, torch.device("cpu")), [source]
    )
    index = select_rows(model, sheet, root=None, split=None, skip_bad_files=False)
    write_index_embeddings(model, index, prefix, chunk_rows=CHUNK, progress=False)
    return model.adaptation


def test_an_adapted_index_is_measured_once_and_embedded_with_one_network(tmp_path, inputs):
    source = Path(pd.read_csv(inputs["sheet"], dtype=str)["path"].iloc[0]).parent
    one = _embed_adapted(0, 1, inputs["model"], inputs["sheet"], tmp_path / "one", source)
    two = run_in_group(
        _embed_adapted, tmp_path, inputs["model"], inputs["sheet"], tmp_path / "two", source
    )
    assert two == [one, one] and one["clips"] > 0  # the same record on both ranks
    assert _saved(tmp_path / "one")[0].tobytes() == _saved(tmp_path / "two")[0].tobytes()
    plain = _embed(0, 1, inputs["model"], inputs["sheet"], tmp_path / "plain")
    assert plain == (48, 0)
    assert not np.allclose(_saved(tmp_path / "plain")[0], _saved(tmp_path / "one")[0])


def test_torchrun_embed_index_prints_one_summary(tmp_path, inputs):
    common = ["--model", str(inputs["model"]), "--index", str(inputs["sheet"]), "--quiet"]
    single = subprocess.run(
        [sys.executable, "-m", "audioclf.embed", *common, "--save", str(tmp_path / "one")],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "audioclf.embed",
            *common,
            "--save",
            str(tmp_path / "two"),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("saved ") == 1 and "48 rows" in launched.stdout
    assert _saved(tmp_path / "one")[0].tobytes() == _saved(tmp_path / "two")[0].tobytes()
