"""Every file audioclf writes and reads back: one writer per output (the lock a second process
meets, with real processes), and every reader turning a damaged file into one line naming the
file and the fix (a damaged cache is rebuilt with a warning)."""

from __future__ import annotations

import errno
import json
import logging
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from audioclf.embedding.parts import IndexOutputs, open_parts, read_part, rows_digest, write_part
from audioclf.outputs import FolderBusy, FolderLock
from tests.helpers import LockHolder


def cut_in_half(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def collection(tmp_path: Path, rows: int = 300, dim: int = 8) -> Path:
    """PREFIX.npy + PREFIX.parquet as embed --index writes them."""
    prefix = tmp_path / "emb"
    rng = np.random.default_rng(0)
    np.save(f"{prefix}.npy", rng.standard_normal((rows, dim)).astype(np.float32))
    frame = pd.DataFrame(
        {
            "row": np.arange(rows, dtype=np.int64) + 2,
            "id": [f"id{i}" for i in range(rows)],
            "class": [f"c{i % 5}" for i in range(rows)],
            "item": [f"i{i % 30}" for i in range(rows)],
            "path": [f"a/{i}.wav" for i in range(rows)],
        }
    )
    frame.to_parquet(f"{prefix}.parquet", index=False)
    return prefix


# ------------------------------------------------------------------------------------- locks


def busy_line(holder: LockHolder, what: str) -> str:
    return rf"{what} is in use by another .*\(pid {holder.pid} on .*, started .* UTC\); "


@pytest.mark.slow
def test_a_second_embed_index_into_one_prefix_is_refused_until_the_first_dies(tmp_path):
    outputs = IndexOutputs.of(tmp_path / "out" / "big")
    with LockHolder(outputs.lock().path) as holder:
        with pytest.raises(FolderBusy, match=busy_line(holder, "--save .*big") + "wait"):
            open_parts(outputs, {"version": 1}, outputs.lock())
        assert not outputs.parts.exists()  # refused before anything was written
    lock = outputs.lock()
    open_parts(outputs, {"version": 1}, lock)  # the holder died: the lock is free
    lock.release()
    assert (outputs.parts / "manifest.json").is_file()


@pytest.mark.slow
def test_a_second_search_build_of_one_index_is_refused(tmp_path):
    from audioclf.search.collection import Collection, build_saved

    found = Collection.open(collection(tmp_path))
    with LockHolder(found.index_file("exact").with_suffix(".lock")) as holder:
        with pytest.raises(FolderBusy, match=busy_line(holder, "the exact index of .*emb")):
            build_saved(found, "exact", progress=False)
        assert not found.index_file("exact").exists()
    build_saved(found, "exact", progress=False)
    assert found.index_file("exact").is_file()


@pytest.mark.slow
def test_prepare_evaluate_and_export_outputs_are_locked(tmp_path):
    from audioclf.inference.exporting import export_lock
    from audioclf.precompute.run import Shard, shard_lock

    out = tmp_path / "features"
    locks = {
        "prepare": shard_lock(out, Shard(1, 4)),
        "export": export_lock(tmp_path / "model.onnx"),
        "evaluate": FolderLock(
            tmp_path / "eval" / ".evaluate.lock", what="--out eval", by="another evaluate", fix=""
        ),
    }
    for name, lock in locks.items():
        with LockHolder(lock.path) as holder:
            with pytest.raises(FolderBusy, match=rf"another {name} \(pid {holder.pid} "):
                lock.acquire()
            other = shard_lock(out, Shard(2, 4)) if name == "prepare" else None
            if other is not None:  # the other shards of one folder run side by side
                other.acquire()
                other.release()
        lock.acquire()
        lock.release()


@pytest.mark.slow
def test_write_evaluation_refuses_a_held_out_folder(tmp_path):
    from audioclf.evaluation.report import write_evaluation

    out = tmp_path / "eval"
    with LockHolder(out / ".evaluate.lock") as holder:
        with pytest.raises(FolderBusy, match=busy_line(holder, f"--out {out}")):
            write_evaluation(out, None, projection="none", seed=0, setup={})
    assert not [p for p in out.iterdir() if p.name != ".evaluate.lock"]


def test_the_run_folder_lock_is_the_shared_one(tmp_path):
    from audioclf.training.rundir import RunLock

    first = RunLock(tmp_path).acquire()
    try:  # flock locks belong to the open file: a second open in one process is refused too
        with pytest.raises(FolderBusy, match=r"run folder .* in use by another run .*run\.sh"):
            RunLock(tmp_path).acquire()
    finally:
        first.release()
    assert json.loads((tmp_path / "run.lock").read_text())["pid"]


# ----------------------------------------------------------------------------------- readers


@pytest.mark.parametrize("method", ["exact", "ivf", "hnsw"])
def test_a_search_index_cut_in_half_is_one_line_saying_rebuild(tmp_path, method):
    from audioclf.search import faiss_available
    from audioclf.search.collection import Collection, build_saved, open_index

    if method != "exact" and not faiss_available():
        pytest.skip("faiss is not installed")
    found = Collection.open(collection(tmp_path))
    index = build_saved(found, method, progress=False, nlist=4) if method == "ivf" else None
    index = index or build_saved(found, method, progress=False)
    damaged = index.data_file(index.path) or index.path
    cut_in_half(damaged)
    with pytest.raises(ValueError, match=rf"{damaged}.*rebuild") as caught:
        open_index(found, method)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("suffix", [".npy", ".parquet"])
def test_embeddings_cut_in_half_are_one_line_naming_the_file(tmp_path, suffix):
    from audioclf.search.collection import Collection

    prefix = collection(tmp_path)
    cut_in_half(Path(f"{prefix}{suffix}"))
    with pytest.raises(ValueError, match=rf"{prefix}\{suffix} is not a readable") as caught:
        Collection.open(prefix)
    assert "\n" not in str(caught.value)


def test_a_part_cut_in_half_is_embedded_again_and_a_manifest_cut_in_half_refused(tmp_path):
    outputs = IndexOutputs.of(tmp_path / "big")
    ids, paths = np.array(["a", "b"]), np.array(["a.wav", "b.wav"])
    part = {
        "embeddings": np.ones((2, 4), np.float32),
        "positions": np.arange(2, dtype=np.int64),
        "rows": np.array(rows_digest(ids, paths)),
        "skipped": np.zeros(0, np.int64),
        "reasons": np.zeros(0, str),
    }
    open_parts(outputs, {"version": 1})
    write_part(outputs.part(0), part)
    assert read_part(outputs.part(0), ids, paths, 0, 4) is not None
    assert read_part(cut_in_half(outputs.part(0)), ids, paths, 0, 4) is None
    outputs.part(0).write_bytes(b"garbage" * 100)
    assert read_part(outputs.part(0), ids, paths, 0, 4) is None
    cut_in_half(outputs.parts / "manifest.json")
    with pytest.raises(ValueError, match=r"big\.parts holds .*manifest\.json is unreadable"):
        open_parts(outputs, {"version": 1})


def test_a_sidecar_cut_in_half_is_one_line_saying_export_again(tmp_path):
    from audioclf.inference import artefacts
    from audioclf.inference.sidecar import sidecar_path

    model = tmp_path / "model.onnx"
    model.write_bytes(b"not read: the sidecar is read first")
    sidecar_path(model).write_text(json.dumps({"format": "onnx", "file": "model.onnx"} | {
        f"field{i}": "x" * 40 for i in range(10)}))  # fmt: skip
    cut_in_half(sidecar_path(model))
    with pytest.raises(artefacts.ArtefactError, match=r"model\.onnx\.json .*cannot be read.*"):
        artefacts.load_embedder(model, "cpu")


@pytest.mark.parametrize("damage", ["cut in half", "garbage"])
def test_a_damaged_gallery_cache_is_rebuilt_with_one_warning(tmp_path, caplog, damage):
    from audioclf.embedding.gallery import _read_cache, _write_cache

    cache = tmp_path / ".audioclf_cache" / "gallery-x.npz"
    classes = np.array(["a", "b", "c"])
    _write_cache(cache, np.ones((3, 4), np.float32), classes)
    assert _read_cache(cache, classes) is not None
    if damage == "garbage":
        cache.write_bytes(b"\x00garbage" * 64)
    else:
        cut_in_half(cache)
    with caplog.at_level(logging.WARNING, logger="audioclf"):
        assert _read_cache(cache, classes) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0].getMessage()
    assert "embedding the gallery again" in warnings[0].getMessage()


def test_an_onnx_export_cut_in_half_is_one_line_saying_export_again(tmp_path):
    pytest.importorskip("onnxruntime")
    from audioclf.inference import artefacts
    from audioclf.inference.sidecar import ExportSidecar, sidecar_path

    model = tmp_path / "model.onnx"
    model.write_bytes(b"\x08\x07\x12\x07pytorch" * 50)  # the first bytes of an ONNX file, cut
    fields = dict.fromkeys(("inputs", "outputs", "features", "model", "data_columns"), {})
    meta = ExportSidecar("onnx", model.name, "waveform", **fields, output_names=["embeddings"],
                         embedding_dim=16, sample_rate=16000, classes=[], checkpoint={},
                         parity={}, versions={})  # fmt: skip
    sidecar_path(model).write_text(meta.to_json())
    with pytest.raises(artefacts.ArtefactError, match=rf"{model} is not a loadable onnx .*export"):
        artefacts.load_embedder(model, "cpu")


# ------------------------------------------------------------------------------------ writers


class FullDisk:
    """A file whose writes reach a full disk: flush raises ENOSPC."""

    def __init__(self, handle):
        self.handle = handle

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_lock_on_a_full_disk_is_one_line_naming_it_and_holds_nothing(tmp_path, monkeypatch):
    from audioclf import outputs
    from audioclf.fileio import DiskWriteError

    path = tmp_path / "emb.lock"
    monkeypatch.setattr(outputs, "open", lambda *a: FullDisk(open(*a)), raising=False)
    with pytest.raises(DiskWriteError, match=rf"cannot write {path}: No space left"):
        FolderLock(path, what="x", by="y", fix="z").acquire()
    monkeypatch.undo()
    assert not path.exists()
    FolderLock(path, what="x", by="y", fix="z").acquire().release()  # the failed one let go


def test_a_search_index_is_saved_with_its_data_or_not_at_all(tmp_path, monkeypatch):
    from audioclf.search import base, build, load

    rng = np.random.default_rng(0)
    first, second = (rng.standard_normal((20, 4)).astype(np.float32) for _ in range(2))
    build(first).save(tmp_path / "ix.json")
    stale = tmp_path / ".ix.json.4242.0123abcd.tmp"  # what a killed save left
    stale.write_bytes(b"{half")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(base.json, "dumps", full_disk)
    with pytest.raises(OSError, match=r"ix\.json: No space left"):
        build(second).save(tmp_path / "ix.json")
    monkeypatch.undo()
    assert np.allclose(load(tmp_path / "ix.json").search(first, 1)[0], 1.0)  # the first one's rows


@pytest.mark.slow
def test_search_build_removes_what_a_killed_build_left(tmp_path):
    from audioclf.search.collection import Collection, build_saved

    found = Collection.open(collection(tmp_path))
    stale = [tmp_path / f".emb.exact.{name}.4242.0123abcd.tmp" for name in ("json", "npy")]
    for path in stale:
        path.write_bytes(b"half")
    build_saved(found, "exact", progress=False)
    assert not [path for path in stale if path.exists()]


@pytest.mark.slow
def test_evaluate_into_a_held_out_folder_is_refused_before_any_work(tmp_path, capsys):
    from audioclf.evaluate import main

    out = tmp_path / "eval"
    with LockHolder(out / ".evaluate.lock") as holder:
        # the checkpoint does not exist: a refusal that came after the loading would say so
        code = main(["--checkpoint", str(tmp_path / "missing.pt"), "--out", str(out)])
        err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert re.search(busy_line(holder, f"--out {out}"), err) and "missing.pt" not in err


def test_write_evaluation_removes_the_staging_folders_of_killed_runs(tmp_path, monkeypatch):
    from audioclf.evaluation import report

    stale = tmp_path / ".eval.partial-99999"  # a killed evaluate's
    (stale / "report.json").parent.mkdir(parents=True)
    (stale / ".report.json.99999.tmp").write_text("{")
    other = tmp_path / ".evaluation.partial-1"  # of another --out: not this one's to remove
    other.mkdir()

    def write_report(staging, *args, **kwargs):
        staging.mkdir()
        (staging / "report.json").write_text("{}")
        return ["report.json"]

    monkeypatch.setattr(report, "write_report", write_report)
    out = report.write_evaluation(tmp_path / "eval", None, projection="none", seed=0, setup={})
    assert (out / "report.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".evaluation.partial-1", "eval"]


def test_a_damaged_tracker_id_is_one_line_naming_it(tmp_path):
    from audioclf.training.trackers import attach_report

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text("{}")
    (tmp_path / "tracker.json").write_text('{"mlflow": "0123')
    with pytest.raises(ValueError, match=r"tracker\.json \(the training's tracker run\) is unread"):
        attach_report(tmp_path, tmp_path / "eval")


# A model artefact handed over wrongly (issue 34): a folder stands for its run's best.pt or
# its one model file; an array, a sheet or an audio file is one line saying what it is.


def test_a_folder_stands_for_its_runs_best_pt_or_the_one_model_it_holds(tmp_path):
    import shutil

    import audioclf
    from audioclf import checkpoint
    from tests.helpers import make_checkpoint

    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    best = make_checkpoint(run / "best.pt")
    shutil.copy(best, run / "last.pt")
    assert audioclf.load(run, device="cpu").loaded.path == best
    assert checkpoint.load(run)["model"]  # export, init_from: the same file
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(best, alone / "weights.pt")
    (alone / "notes.txt").write_text("the weights of run x")
    assert audioclf.load(alone, device="cpu").loaded.path == alone / "weights.pt"
    (run / "best.pt").rename(run / "epoch_0002.pt")
    with pytest.raises(ValueError) as several:
        audioclf.load(run, device="cpu")
    assert str(several.value) == (
        f"model {run} is a folder holding 2 models and no best.pt (epoch_0002.pt, last.pt); "
        "pass one of them"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty is a folder holding no model \(no best.pt"):
        audioclf.load(empty, device="cpu")


def _wrong_artefacts(folder: Path) -> dict[str, tuple[Path, str]]:
    """{case: (a file that is not a model, what the message calls it)}."""
    import soundfile

    np.save(folder / "emb.npy", np.zeros((3, 4), dtype=np.float32))
    (folder / "emb.pt").write_bytes((folder / "emb.npy").read_bytes())  # renamed: its bytes say
    pd.DataFrame({"path": ["a.wav"], "a_cls": ["c"]}).to_excel(folder / "s.xlsx", index=False)
    (folder / "s.csv").write_text("path,a_cls\na.wav,c\n")
    soundfile.write(folder / "a.wav", np.zeros(800), 8000)
    soundfile.write(folder / "a.flac", np.zeros(800), 8000)
    (folder / "a.pt").write_bytes((folder / "a.flac").read_bytes())
    array, sheet, audio = "a NumPy array (embeddings?)", "a sheet", "an audio file"
    return {
        "array": (folder / "emb.npy", array),
        "array renamed .pt": (folder / "emb.pt", array),
        "xlsx": (folder / "s.xlsx", sheet),
        "csv": (folder / "s.csv", sheet),
        "wav": (folder / "a.wav", audio),
        "flac": (folder / "a.flac", audio),
        "flac renamed .pt": (folder / "a.pt", audio),
    }


def test_an_array_a_sheet_or_audio_given_as_a_model_is_one_line_saying_what_it_is(tmp_path):
    import audioclf
    from audioclf import checkpoint

    for case, (path, what) in _wrong_artefacts(tmp_path).items():
        with pytest.raises(ValueError) as caught:
            audioclf.load(path, device="cpu")
        message = str(caught.value)
        assert message.startswith(f"model {path} is {what}"), case
        assert message.endswith("not a model; pass a checkpoint (.pt), TorchScript or ONNX export")
        with pytest.raises(ValueError, match=rf"is {re.escape(what)}.*, not a model; pass an audi"):
            checkpoint.load(path)  # evaluate, export, model.init_from=, checkpoint.resume=


def test_the_tools_say_so_in_one_line(tmp_path, capsys):
    from audioclf.embed import main as embed
    from audioclf.evaluate import main as evaluate

    wrong = _wrong_artefacts(tmp_path)
    clip, sheet = wrong["wav"][0], wrong["xlsx"][0]
    assert embed(["--model", str(wrong["array"][0]), "--gallery", str(sheet), str(clip)]) == 2
    assert capsys.readouterr().err == (
        f"python -m audioclf.embed: error: --model {wrong['array'][0]} is a NumPy array "
        "(embeddings?), not a model; pass a checkpoint (.pt), TorchScript or ONNX export\n"
    )
    assert evaluate(["--checkpoint", str(sheet), "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{sheet} is a sheet (an index of clips?), not a m" in err
