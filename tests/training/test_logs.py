"""Run-directory logging: train.log, and what a killed process leaves in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_a_process_killed_by_abort_leaves_its_stack_in_train_log(tmp_path):
    # NCCL's watchdog ends a rank stuck in a collective with abort(): no Python handler runs.
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from audioclf.training.logs import setup_logging
from tests.helpers import ROOT
setup_logging(Path({str(tmp_path)!r}), rank=1)
def waiting_at_the_barrier():
    os.abort()
waiting_at_the_barrier()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode != 0
    log = (tmp_path / "train.log").read_text()
    assert "Fatal Python error: Aborted" in log and "waiting_at_the_barrier" in log


# ---------------------------------------------------------------------------------------------
# TensorBoard's projector: validation embeddings at each validation


def projector_entries(tb_dir: Path) -> dict[str, Path]:
    """{tensor name: folder of its tensors.tsv / metadata.tsv} from projector_config.pbtxt."""
    import re

    text = (tb_dir / "projector_config.pbtxt").read_text()
    names = re.findall(r'tensor_name: "([^"]+)"', text)
    paths = re.findall(r'tensor_path: "([^"]+)"', text)
    assert len(names) == len(paths), text
    return {name: (tb_dir / path).parent for name, path in zip(names, paths, strict=True)}


def read_tsv(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_projector_takes_a_class_stratified_sample_with_class_and_item(tmp_path):
    import numpy as np

    from audioclf.training.logs import MetricsWriter

    rng = np.random.default_rng(0)
    classes = np.array(["big"] * 900 + ["mid\tdle"] * 90 + ["tiny"] * 10)  # a tab must not split
    items = np.array([f"rec {i % 7}\nx" for i in range(1000)])  # nor a line break
    embeddings = rng.normal(size=(1000, 8)).astype(np.float32)
    writer = MetricsWriter(tmp_path, enabled=True)
    assert writer.projector(embeddings, classes, items, epoch=3, step=120, limit=100) == 100
    writer.close()
    entries = projector_entries(tmp_path / "tensorboard")
    assert list(entries) == ["validation/epoch_003:00120"]
    metadata = read_tsv(entries["validation/epoch_003:00120"] / "metadata.tsv")
    tensors = read_tsv(entries["validation/epoch_003:00120"] / "tensors.tsv")
    assert metadata[0] == ["class", "item"] and len(metadata) == len(tensors) + 1 == 101
    assert all(len(row) == 2 for row in metadata) and all(len(row) == 8 for row in tensors)
    shown = [row[0] for row in metadata[1:]]
    # Stratified: every small class whole, the rest from the big one.
    assert shown.count("tiny") == 10 and shown.count("mid dle") == 45
    assert {row[1] for row in metadata[1:]} <= {f"rec {i} x" for i in range(7)}


def test_projector_is_a_no_op_off_rank_0_and_without_tensorboard(tmp_path, monkeypatch):
    import sys

    import numpy as np

    from audioclf.training.logs import MetricsWriter

    embeddings, names = np.zeros((4, 2), np.float32), ["a", "a", "b", "b"]
    off = MetricsWriter(tmp_path / "rank1", enabled=False)
    assert off.projector(embeddings, names, names, epoch=1, step=1) == 0
    assert not (tmp_path / "rank1").exists()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    bare = MetricsWriter(tmp_path / "bare", enabled=True)
    assert bare.projector(embeddings, names, names, epoch=1, step=1) == 0
    assert not (tmp_path / "bare" / "tensorboard").exists()


def test_a_resumed_run_keeps_the_earlier_projector_entries(tmp_path):
    import numpy as np

    from audioclf.training.logs import MetricsWriter

    embeddings, names = np.eye(4, dtype=np.float32), ["a", "a", "b", "b"]
    first = MetricsWriter(tmp_path, enabled=True)
    first.projector(embeddings, names, names, epoch=1, step=10)
    first.projector(embeddings, names, names, epoch=2, step=20)
    first.close()
    resumed = MetricsWriter(tmp_path, enabled=True)  # a new process after a restart
    resumed.projector(embeddings[:3], names[:3], names[:3], epoch=2, step=20)  # epoch 2 again
    resumed.projector(embeddings, names, names, epoch=3, step=30)
    resumed.close()
    entries = projector_entries(tmp_path / "tensorboard")
    assert sorted(entries) == [
        "validation/epoch_001:00010",
        "validation/epoch_002:00020",
        "validation/epoch_003:00030",
    ]
    assert len(read_tsv(entries["validation/epoch_002:00020"] / "tensors.tsv")) == 3  # replaced


def test_training_sends_validation_embeddings_to_the_projector(tmp_path, tiny_demo):
    from audioclf.data.index import load_index, split_index
    from audioclf.training.trainer import fit
    from tests.helpers import tiny_config

    cfg = tiny_config(tiny_demo, tmp_path, "cnn", "train.epochs=1", "train.limit_batches=2")
    summary = fit(cfg)
    entries = projector_entries(Path(summary["run_dir"]) / "tensorboard")
    assert list(entries) == [f"validation/epoch_001:{summary['step']:05d}"]
    metadata = read_tsv(next(iter(entries.values())) / "metadata.tsv")
    val = split_index(load_index(cfg.data), cfg.data)["val"]
    assert metadata[0] == ["class", "item"] and len(metadata) == len(val) + 1
    assert sorted(tuple(row) for row in metadata[1:]) == sorted(
        zip(val.table["cls"], val.table["item"], strict=True)
    )


def test_what_is_said_before_the_run_folder_exists_reaches_train_log(tmp_path):
    import logging

    from audioclf.training.logs import setup_logging

    log = logging.getLogger("audioclf")
    setup_logging(None, rank=0)
    log.info("index file x.xlsx: the header is row 3")
    log.debug("not kept: below the level")
    setup_logging(tmp_path / "run", rank=0)
    log.info("run directory %s", tmp_path / "run")
    setup_logging(None, rank=0)  # closes train.log
    lines = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert [line.split(" INFO ")[1] for line in lines] == [
        "index file x.xlsx: the header is row 3",
        f"run directory {tmp_path / 'run'}",
    ]
