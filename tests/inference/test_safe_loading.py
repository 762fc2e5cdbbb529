"""Checkpoints are data, not code: a file carrying a pickled payload is refused by every entry
point before any of it runs (a marker file tells), and the opt-in loads a file one trusts."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
import torch

from audioclf import checkpoint
from tests.helpers import FIXTURES, make_checkpoint, tiny_config


class Payload:
    """Unpickling it creates `marker`: what a crafted checkpoint would do with os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


def crafted(tmp_path: Path) -> tuple[Path, Path]:
    """(an audioclf checkpoint with a payload beside its weights, the payload's marker)."""
    good = make_checkpoint(tmp_path / "good.pt")
    state = torch.load(good, weights_only=True)
    marker = tmp_path / "payload-ran"
    state["notes"] = Payload(marker)
    torch.save(state, tmp_path / "crafted.pt")
    return tmp_path / "crafted.pt", marker


def _refused(capsys, status: int, path: Path) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert f"checkpoint {path} holds Python objects beyond tensors" in err[0]
    assert "(exec)" in err[0] and "--trust-checkpoint" in err[0]  # names the refused object


@pytest.mark.parametrize("tool", ["evaluate", "embed", "export"])
def test_each_tool_refuses_a_payload_without_running_it(tmp_path, capsys, tool):
    path, marker = crafted(tmp_path)
    if tool == "evaluate":
        from audioclf.evaluate import main

        status = main(["--checkpoint", str(path), "--out", str(tmp_path / "eval"), "--quiet"])
    elif tool == "embed":
        from audioclf.embed import main

        status = main(
            [
                "--model",
                str(path),
                "--index",
                str(tmp_path / "none.xlsx"),
                "--save",
                str(tmp_path / "e"),
                "--quiet",
            ]
        )
    else:
        from audioclf.export import main

        status = main(
            ["--checkpoint", str(path), "--format", "state_dict", "--out", str(tmp_path / "x.pt")]
        )
    _refused(capsys, status, path)
    assert not marker.exists()
    assert not (tmp_path / "eval").exists() and not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("how", ["init_from", "resume"])
def test_training_refuses_a_payload_without_running_it(tmp_path, tiny_demo, how):
    from audioclf.training.trainer import fit

    path, marker = crafted(tmp_path)
    key = "model.init_from" if how == "init_from" else "checkpoint.resume"
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", f"{key}={path}")
    with pytest.raises(checkpoint.CheckpointError, match="holds Python objects.*checkpoint.trust"):
        fit(cfg)
    assert not marker.exists() and not (tmp_path / "runs" / "t").exists()


def test_the_opt_in_loads_a_trusted_file(tmp_path):
    path, marker = crafted(tmp_path)
    ckpt = checkpoint.load(path, trust=True)
    assert marker.exists() and "model" in ckpt  # trusted: its objects were built


def test_what_audioclf_writes_loads_as_data(tmp_path, tiny_demo):
    from audioclf.training.trainer import fit

    fit(
        tiny_config(
            tiny_demo,
            tmp_path / "runs",
            "cnn",
            "train.epochs=1",
            "model.head=arcface",
            "train.opt_level=O1",
        )
    )
    # Plain torch.load(weights_only=True), without audioclf's allow-list for 0.1 files.
    state = torch.load(tmp_path / "runs" / "t" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "rng", "sampler", "scaler", "config", "versions"} <= set(state)


RELEASE_0_1 = FIXTURES / "audioclf-0.1-last.pt"  # written by audioclf 0.1.0


def test_a_checkpoint_of_the_previous_release_loads_as_data():
    """Made with audioclf 0.1.0 (f4ea544): tiny CNN, arcface head, fp16; its RNG states hold
    numpy arrays and its versions torch's TorchVersion, and its config the 0.1 layout."""
    from audioclf.inference import load_trained

    ckpt = checkpoint.load(RELEASE_0_1)  # no trust needed
    assert ckpt["versions"]["audioclf"] == "0.1.0" and ckpt["config"]["loss"]["head"] == "arcface"
    net, cfg, _ = load_trained(RELEASE_0_1)
    assert cfg.model.head == "arcface" and net.head is not None and net.head.num_classes == 9
    assert cfg.clips.crop_seconds == 0.5  # features.crop_seconds of 0.1, read in its new place


def test_a_run_of_the_previous_release_resumes(tmp_path, tiny_demo):
    import shutil

    from audioclf.training.trainer import fit

    run = tmp_path / "runs" / "t"
    run.mkdir(parents=True)
    shutil.copy(RELEASE_0_1, run / "last.pt")
    cfg = tiny_config(
        tiny_demo,
        tmp_path / "runs",
        "cnn",
        "train.epochs=2",
        "model.head=arcface",
        "train.opt_level=O1",
        "checkpoint.resume=auto",
    )
    summary = fit(cfg)
    assert summary["step"] == 26 and [row["epoch"] for row in summary["history"]] == [1, 2]
    assert "resumed from" in (run / "train.log").read_text()
