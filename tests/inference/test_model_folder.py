"""The folder format (export --format folder): safetensors weights, config.json and a model card;
loaded by name with no pickle, damaged folders as one line, the card's figures from the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import audioclf
from audioclf.checkpoint import CheckpointError
from audioclf.export import main as export_main
from audioclf.inference.folder import FOLDER_FORMAT
from tests.helpers import child_env, make_checkpoint, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def export_folder(capsys, checkpoint: Path, out: Path, *extra) -> tuple[int, str, str]:
    code = export_main(
        ["--checkpoint", str(checkpoint), "--format", "folder", "--out", str(out), *map(str, extra)]
    )
    stdout, err = capsys.readouterr()
    return code, stdout, err


def noise(seconds: float = 1.3, seed: int = 0) -> np.ndarray:
    return 0.1 * np.random.default_rng(seed).standard_normal(int(8000 * seconds)).astype("f4")


def test_a_folder_loads_by_name_and_embeds_as_its_checkpoint(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "best.pt", classes=("a", "b", "c"))
    out = tmp_path / "shared" / "model"
    code, stdout, err = export_folder(capsys, checkpoint, out)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    assert "audioclf.load(" in stdout
    fields = json.loads((out / "config.json").read_text())
    assert fields["folder_format"] == FOLDER_FORMAT
    assert fields["audioclf_version"] == audioclf.__version__
    assert fields["classes"] == ["a", "b", "c"] and fields["epoch"] == 3
    assert fields["file"] == "model.safetensors" and fields["parity"]["max_abs_diff"] <= 1e-4

    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))  # plain tensors, readable without audioclf
    assert all(isinstance(v, torch.Tensor) for v in weights.values())
    waves = [noise(seed=1), noise(0.7, seed=2)]
    shared = audioclf.load(out, device="cpu").embed_waveforms(waves, sample_rate=8000)
    original = audioclf.load(checkpoint, device="cpu").embed_waveforms(waves, sample_rate=8000)
    np.testing.assert_array_equal(shared, original)


def test_exporting_again_replaces_the_folder_whole(tmp_path, capsys):
    first = make_checkpoint(tmp_path / "a.pt", seed=0)
    second = make_checkpoint(tmp_path / "b.pt", seed=1)
    out = tmp_path / "model"
    killed = tmp_path / ".model.99999.0123abcd.tmp"  # a folder export killed before its rename
    (killed / "model.safetensors").parent.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    assert export_folder(capsys, first, out)[0] == 0
    (out / "README.md").write_text("edited")
    assert export_folder(capsys, second, out)[0] == 0
    assert json.loads((out / "config.json").read_text())["exported_from"] == str(second)
    assert (out / "README.md").read_text() != "edited"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing aside


@pytest.mark.parametrize(
    "out_kind, extra, message",
    [
        ("file", (), "is a file; a folder export writes a folder"),
        ("other", (), "is a folder holding other files"),
        ("new", ("--no-frontend",), "--no-frontend applies to torchscript and onnx exports"),
    ],
)
def test_a_folder_export_refuses_what_it_cannot_write(tmp_path, capsys, out_kind, extra, message):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    out = tmp_path / "out"
    if out_kind == "file":
        out.write_text("x")
    elif out_kind == "other":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    code, _, err = export_folder(capsys, checkpoint, out, *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert out_kind != "other" or sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _future_format(folder: Path) -> None:
    fields = json.loads((folder / "config.json").read_text())
    fields.update(folder_format=FOLDER_FORMAT + 1, audioclf_version="9.0.0")
    (folder / "config.json").write_text(json.dumps(fields))


@pytest.mark.parametrize(
    "damage, names, fix",
    [
        (_truncate, "model.safetensors cannot be read", "export the model again"),
        (
            lambda f: (f / "model.safetensors").unlink(),
            "model.safetensors cannot be read",
            "export",
        ),
        (lambda f: (f / "config.json").write_text("{"), "config.json cannot be read", "export"),
        (lambda f: (f / "config.json").unlink(), "has no config.json", "export the model again"),
        (_future_format, "is of folder format 2 (written by audioclf 9.0.0)", "audioclf 9.0.0"),
    ],
    ids=["truncated-weights", "no-weights", "config-not-json", "no-config", "other-version"],
)
def test_a_damaged_folder_is_one_line_naming_the_file(tmp_path, capsys, damage, names, fix):
    out = tmp_path / "model"
    assert export_folder(capsys, make_checkpoint(tmp_path / "best.pt"), out)[0] == 0
    damage(out)
    with pytest.raises(CheckpointError) as caught:
        audioclf.load(out, device="cpu")
    message = str(caught.value)
    assert names in message and fix in message and "\n" not in message, message


@pytest.mark.slow  # a fresh interpreter
def test_a_folder_loads_in_a_fresh_process_without_pickle(tmp_path, capsys):
    out = tmp_path / "model"
    assert export_folder(capsys, make_checkpoint(tmp_path / "best.pt"), out)[0] == 0
    script = f"""
import pickle, numpy as np, torch
import audioclf, audioclf.api
def refuse(*args, **kwargs):
    raise AssertionError("pickle was used")
class Refused(pickle.Unpickler):
    def __init__(self, *args, **kwargs):
        refuse()
pickle.load = pickle.loads = torch.load = refuse
pickle.Unpickler = Refused
model = audioclf.load({str(out)!r}, device="cpu")
wave = 0.1 * np.random.default_rng(0).standard_normal(8000).astype("f4")
print(model.embed_waveforms([wave], sample_rate=8000).shape)
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 16)"


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.slow  # trains one short epoch and evaluates
def test_the_card_quotes_the_run_and_its_evaluation_report(tmp_path, capsys, tiny_demo):
    from audioclf.evaluate import main as evaluate_main
    from audioclf.training.trainer import fit

    cfg = tiny_config(
        tiny_demo,
        tmp_path / "runs",
        "cnn",
        "train.epochs=1",
        "train.limit_batches=4",
        "eval.every=0",
    )
    checkpoint = Path(fit(cfg)["run_dir"]) / "best.pt"
    out = tmp_path / "model"
    assert export_folder(capsys, checkpoint, out)[0] == 0
    unevaluated = (out / "README.md").read_text()
    assert "Not evaluated" in unevaluated and "model-index" not in front_matter(unevaluated)

    assert (
        evaluate_main(["--checkpoint", str(checkpoint), "--out", str(checkpoint.parent / "eval")])
        == 0
    )
    capsys.readouterr()
    assert export_folder(capsys, checkpoint, out)[0] == 0
    card = (out / "README.md").read_text()
    report = json.loads((checkpoint.parent / "eval" / "report.json").read_text())
    front = front_matter(card)
    assert front["library_name"] == "audioclf"
    [result] = front["model-index"][0]["results"]
    quoted = {m["type"]: m["value"] for m in result["metrics"]}
    assert quoted["precision_at_1"] == report["metrics"]["precision_at_1"]
    assert quoted["map_at_r"] == report["metrics"]["map_at_r"]
    assert result["dataset"]["split"] == report["evaluation"]["split"] == "val"
    assert f"| cross-item P@1 | {report['metrics']['precision_at_1']:.4f} |" in card
    train = report["evaluation"]["n_samples"]
    assert f"({train} clips, {report['evaluation']['n_classes']} classes" in card
    assert "- the run: 1 epochs in" in card and "Measured on the training source only" in card


def test_fine_tuning_starts_from_a_folder(tmp_path, capsys):
    from audioclf.inference import init_weights, load_trained
    from audioclf.models import build_net

    checkpoint = make_checkpoint(tmp_path / "best.pt", seed=3)
    out = tmp_path / "model"
    assert export_folder(capsys, checkpoint, out)[0] == 0
    trained, cfg, _ = load_trained(checkpoint)
    fresh = build_net(cfg, 0)
    notes = init_weights(fresh, out, [])
    assert notes[0].startswith(f"model.init_from: weights of {out} (cnn, 16-d, epoch 3")
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
