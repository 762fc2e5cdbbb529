"""Fine-tuning: a new run that starts from another run's (or an export's) weights."""

from __future__ import annotations

import pytest
import torch

from audioclf import checkpoint
from audioclf.checkpoint import CheckpointError
from tests.helpers import fit, tiny_config


def _weights(path):
    return checkpoint.load(path)["model"]


def test_init_from_loads_the_body_and_restarts_a_head_for_new_classes(tmp_path, tiny_demo):
    common = ["eval.every=0", "model.head=softmax", "loss.ce_weight=0.5"]
    fit(tiny_config(tiny_demo, tmp_path, "cnn", "train.epochs=1", "train.name=source", *common))
    source = tmp_path / "source" / "last.pt"
    fit(
        tiny_config(
            tiny_demo,
            tmp_path,
            "cnn",
            "train.epochs=2",
            "train.name=tuned",
            f"model.init_from={source}",
            "optim.freeze_epochs=1",
            "data.holdout=items",
            "train.limit_batches=1",
            "checkpoint.keep_last=2",
            *common,
        )
    )
    log = (tmp_path / "tuned" / "train.log").read_text()
    assert f"model.init_from: weights of {source}" in log
    assert "the classifier head starts afresh (9 classes in last.pt, 12 here)" in log
    assert "epoch 1: only the embedding layer (and head) learns" in log
    before, after = _weights(source), _weights(tmp_path / "tuned" / "epoch_0001.pt")
    conv = "embedder.blocks.0.conv1.weight"
    assert torch.equal(before[conv], after[conv])  # frozen during epoch 1
    assert not torch.equal(before["embedder.embedding.weight"], after["embedder.embedding.weight"])
    assert after["head.linear.weight"].shape[0] == 12
    final = _weights(tmp_path / "tuned" / "last.pt")
    assert not torch.equal(before[conv], final[conv])  # and learning after it


def test_init_from_another_architecture_names_the_tensor(tmp_path, tiny_demo):
    fit(
        tiny_config(
            tiny_demo,
            tmp_path,
            "cnn",
            "train.epochs=1",
            "eval.every=0",
            "train.name=source",
            "train.limit_batches=1",
        )
    )
    with pytest.raises(
        CheckpointError,
        match=r"model\.init_from=.*tensor 'embedder\.blocks\.0\."
        r"conv1\.weight' is \[8, 1, 3, 3\] there and "
        r"\[16, 1, 3, 3\] here",
    ):
        fit(
            tiny_config(
                tiny_demo,
                tmp_path,
                "cnn",
                "train.epochs=1",
                "train.name=other",
                "model.cnn.width=16",
                f"model.init_from={tmp_path / 'source' / 'last.pt'}",
            )
        )
    assert not (tmp_path / "other").exists()  # refused before anything was written


def test_init_from_a_state_dict_export(tmp_path, tiny_demo):
    from audioclf.export import export_model

    fit(
        tiny_config(
            tiny_demo,
            tmp_path,
            "cnn",
            "train.epochs=1",
            "eval.every=0",
            "train.name=source",
            "train.limit_batches=1",
        )
    )
    export_model(tmp_path / "source" / "last.pt", "state_dict", tmp_path / "weights.pt")
    fit(
        tiny_config(
            tiny_demo,
            tmp_path,
            "cnn",
            "train.epochs=1",
            "eval.every=0",
            "train.name=tuned",
            "train.limit_batches=1",
            f"model.init_from={tmp_path / 'weights.pt'}",
            "optim.freeze_epochs=1",
        )
    )
    source, tuned = _weights(tmp_path / "weights.pt"), _weights(tmp_path / "tuned" / "last.pt")
    assert torch.equal(
        source["embedder.blocks.0.conv1.weight"], tuned["embedder.blocks.0.conv1.weight"]
    )
