"""Model export: TorchScript / ONNX / state_dict round trips, parity, sidecar, failure paths."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from audioclf.export import main
from audioclf.inference import exporting, load_trained
from audioclf.inference.artefacts import load_embedder
from audioclf.inference.checkpoints import CheckpointError
from audioclf.spectrogram import log_mel
from tests.helpers import make_checkpoint

TOL = 1e-4


def waves(seconds: float, fractions: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise clips at 8 kHz, zero-padded to the longest (lengths differ from the parity inputs)."""
    generator = torch.Generator().manual_seed(seed)
    samples = int(seconds * 8000)
    lengths = torch.tensor([int(samples * f) for f in fractions])
    x = 0.1 * torch.randn(len(fractions), samples, generator=generator)
    for row, n in enumerate(lengths.tolist()):
        x[row, n:] = 0
    return x, lengths


def log_mel_batch(x: torch.Tensor, lengths: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Each clip's log-mel on its own (audioclf.spectrogram.log_mel), zero-padded to a batch."""
    feats = [
        torch.from_numpy(log_mel(row[:n], cfg.features))
        for row, n in zip(x, lengths.tolist(), strict=True)
    ]
    frames = torch.tensor([f.shape[0] for f in feats])
    batch = torch.zeros(len(feats), int(frames.max()), cfg.features.n_mels)
    for row, f in enumerate(feats):
        batch[row, : f.shape[0]] = f
    return batch, frames


@torch.no_grad()
def per_clip_embeddings(net, x, lengths) -> torch.Tensor:
    """The PyTorch model on each clip alone: what every export must reproduce."""
    return torch.cat(
        [
            net.embed(row[None, :n], torch.tensor([n]))
            for row, n in zip(x, lengths.tolist(), strict=True)
        ]
    )


@torch.no_grad()
def expected_embeddings(net, x, lengths, frontend: bool) -> torch.Tensor:
    """What an export must give for waveforms x (frontend) or for their per-clip log-mel.

    With the front end, the same padded batch through the PyTorch model (a clip's last frames
    see the batch's zero padding instead of a lone clip's reflection, so batch and lone clip
    differ slightly); without it, each clip through the PyTorch model alone, as log_mel sees it.
    """
    return net.embed(x, lengths) if frontend else per_clip_embeddings(net, x, lengths)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".")]


@pytest.mark.filterwarnings("ignore:`torch.jit")  # deprecated: Future- or DeprecationWarning (2.11)
@pytest.mark.parametrize("frontend", [True, False], ids=["waveform", "log_mel"])
@pytest.mark.parametrize("name", ["cnn", "conformer"])
def test_torchscript_round_trip(tmp_path, capsys, name, frontend):
    ckpt = make_checkpoint(tmp_path / "best.pt", name)
    out = tmp_path / "export" / "model.pt"
    code, stdout, err = run_cli(
        capsys,
        "--checkpoint",
        ckpt,
        "--format",
        "torchscript",
        "--out",
        out,
        *([] if frontend else ["--no-frontend"]),
    )
    assert code == 0, err
    assert "parity: max abs difference" in stdout
    net, cfg, _ = load_trained(ckpt)
    scripted = torch.jit.load(str(out))
    for x, lengths in (waves(0.7, [1.0, 0.55], seed=1), waves(1.9, [0.3, 1.0, 0.8], seed=2)):
        expected = expected_embeddings(net, x, lengths, frontend)
        if not frontend:
            x, lengths = log_mel_batch(x, lengths, cfg)
        with torch.no_grad():
            torch.testing.assert_close(scripted(x, lengths), expected, atol=TOL, rtol=0)

    meta = json.loads((out.parent / "model.pt.json").read_text())
    assert meta["format"] == "torchscript" and meta["file"] == "model.pt"
    assert meta["input_kind"] == ("waveform" if frontend else "log_mel")
    assert meta["sample_rate"] == 8000 and meta["features"]["n_mels"] == 32
    assert meta["features"]["hop_length"] == 80 and meta["embedding_dim"] == 16
    assert meta["model"]["name"] == name and meta["classes"] == []
    assert meta["output_names"] == ["embeddings"]
    assert meta["parity"]["max_abs_diff"] <= TOL and len(meta["parity"]["input_shapes"]) == 2
    assert {"audioclf", "torch", "torchaudio"} <= set(meta["versions"])
    assert meta["checkpoint"] == {"path": str(ckpt), "epoch": 3, "step": 30}
    assert leftovers(out.parent) == []


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_a_classifier_head_adds_logits_and_the_class_names(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn", classes=("bird", "car", "dog"))
    out = tmp_path / "model.pt"
    code, stdout, err = run_cli(
        capsys, "--checkpoint", ckpt, "--format", "torchscript", "--out", out
    )
    assert code == 0, err
    assert "logits of 3 classes" in stdout
    net, _, _ = load_trained(ckpt)
    x, lengths = waves(1.2, [1.0, 0.6], seed=3)
    with torch.no_grad():
        embeddings, logits = torch.jit.load(str(out))(x, lengths)
        expected_embeddings, expected_logits = net(x, lengths)
    torch.testing.assert_close(embeddings, expected_embeddings, atol=TOL, rtol=0)
    torch.testing.assert_close(logits, expected_logits, atol=TOL, rtol=0)
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta["classes"] == ["bird", "car", "dog"]
    assert meta["output_names"] == ["embeddings", "logits"]


def test_state_dict_export_is_a_slim_loadable_checkpoint(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "best.pt", "conformer")
    out = tmp_path / "weights.pt"
    code, _, err = run_cli(capsys, "--checkpoint", ckpt, "--format", "state_dict", "--out", out)
    assert code == 0, err
    stored = torch.load(out, weights_only=False)
    assert "optimizer" not in stored and stored["exported_from"] == str(ckpt)
    rebuilt, cfg, _ = load_trained(out)
    original, _, _ = load_trained(ckpt)
    x, lengths = waves(1.0, [1.0, 0.4], seed=4)
    torch.testing.assert_close(
        per_clip_embeddings(rebuilt, x, lengths),
        per_clip_embeddings(original, x, lengths),
        atol=0,
        rtol=0,
    )
    assert json.loads(Path(f"{out}.json").read_text())["format"] == "state_dict"

    code, _, err = run_cli(
        capsys,
        "--checkpoint",
        ckpt,
        "--format",
        "state_dict",
        "--out",
        tmp_path / "nf.pt",
        "--no-frontend",
    )
    assert code == 2 and "--no-frontend applies to torchscript and onnx" in err


@pytest.mark.slow  # the ONNX exporter: seconds per model
@pytest.mark.parametrize("name, frontend", [("cnn", True), ("conformer", False)])
def test_onnx_round_trip_with_dynamic_batch_and_time(tmp_path, capsys, name, frontend):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    ckpt = make_checkpoint(tmp_path / "best.pt", name)
    out = tmp_path / "model.onnx"
    code, _, err = run_cli(
        capsys,
        "--checkpoint",
        ckpt,
        "--format",
        "onnx",
        "--out",
        out,
        *([] if frontend else ["--no-frontend"]),
    )
    assert code == 0, err
    # The weights are inside the file (no external .data file), and no temp file is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.pt",
        "model.onnx",
        "model.onnx.json",
    ]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    assert [i.name for i in inputs] == ["waveform" if frontend else "features", "lengths"]
    assert all(isinstance(dim, str) for dim in inputs[0].shape[:2])  # dynamic batch and time
    net, cfg, _ = load_trained(ckpt)
    for x, lengths in (waves(0.7, [1.0, 0.55], seed=1), waves(1.9, [0.3, 1.0, 0.8], seed=2)):
        expected = expected_embeddings(net, x, lengths, frontend)
        if not frontend:
            x, lengths = log_mel_batch(x, lengths, cfg)
        (embeddings,) = session.run(None, {inputs[0].name: x.numpy(), "lengths": lengths.numpy()})
        torch.testing.assert_close(torch.from_numpy(embeddings), expected, atol=TOL, rtol=0)
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta["format"] == "onnx" and meta["opset"] == 18
    assert {"onnx", "onnxruntime"} <= set(meta["versions"])


def test_parity_failure_exits_1_and_removes_the_artefact(tmp_path, capsys, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    real_loader = exporting.load_torchscript

    def perturbed_loader(path, device="cpu"):
        run = real_loader(path, device)
        return lambda x, lengths: tuple(o + 1e-3 for o in run(x, lengths))

    monkeypatch.setattr(exporting, "load_torchscript", perturbed_loader)
    out = tmp_path / "out" / "model.pt"
    code, stdout, err = run_cli(
        capsys, "--checkpoint", ckpt, "--format", "torchscript", "--out", out
    )
    assert code == 1 and stdout == ""
    assert "parity check failed" in err and "0.001" in err
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no artefact, sidecar or temp


def test_a_scripting_failure_is_one_line_naming_the_network(tmp_path, capsys, monkeypatch):
    def failing_script(module):
        raise RuntimeError("Python builtin <built-in function id> is currently not supported")

    monkeypatch.setattr(torch.jit, "script", failing_script)
    ckpt = make_checkpoint(tmp_path / "best.pt", "conformer")
    out = tmp_path / "out" / "model.pt"
    code, stdout, err = run_cli(
        capsys, "--checkpoint", ckpt, "--format", "torchscript", "--out", out
    )
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err.startswith(
        "python -m audioclf.export: error: torch.jit.script failed for the "
        "ConformerEmbedder: Python builtin"
    )
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no artefact, sidecar or temp


def test_missing_onnx_packages_say_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript → ImportError
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    out = tmp_path / "model.onnx"
    code, _, err = run_cli(capsys, "--checkpoint", ckpt, "--format", "onnx", "--out", out)
    assert code == 2 and err.count("\n") == 1
    assert "onnxscript" in err and "pip install onnx onnxscript onnxruntime" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model-name", "conformer"], "holds a cnn model"),
        (["--format", "onnx", "--opset", "17"], "opset 18 or newer"),
        (["--tolerance", "-1"], "--tolerance must be >= 0"),
    ],
)
def test_bad_input_exits_2(tmp_path, capsys, extra, message):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    code, _, err = run_cli(
        capsys, "--checkpoint", ckpt, "--format", "torchscript", "--out", tmp_path / "m.pt", *extra
    )
    assert code == 2 and message in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


def test_help_describes_inputs_and_formats(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--no-frontend" in text and "torch.jit.load" in text and "dynamic" in text


def test_corrupt_checkpoint_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _, err = run_cli(
            capsys, "--checkpoint", bad, "--format", "torchscript", "--out", tmp_path / "m.pt"
        )
    assert code == 2 and "cannot be read" in err and err.count("\n") == 1


def test_a_nan_model_fails_export_with_one_line(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    state = torch.load(ckpt, weights_only=False)
    state["model"] = {
        k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
        for k, v in state["model"].items()
    }
    torch.save(state, ckpt)
    out = tmp_path / "out" / "model.pt"
    code, stdout, err = run_cli(
        capsys, "--checkpoint", ckpt, "--format", "torchscript", "--out", out
    )
    assert code == 2 and stdout == "" and err.count("\n") == 1  # was "max abs difference 0"
    assert "NaN/inf outputs" in err and not out.parent.exists()


def test_parity_counts_nan_in_the_artefact_as_a_failure():
    x = (torch.zeros(2, 4), torch.tensor([4, 4]))
    assert exporting.parity_difference(
        lambda *_: torch.zeros(2, 3), lambda *_: (torch.full((2, 3), float("nan")),), [x]
    ) == float("inf")


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_an_export_stopped_before_its_sidecar_leaves_no_stale_one(tmp_path, capsys, monkeypatch):
    # A killed export (before its sidecar) must not leave the new model beside the sidecar of
    # the earlier export, which would describe another model; the next export removes the
    # killed one's temporary file.
    ckpt = make_checkpoint(tmp_path / "best.pt", "cnn")
    out = tmp_path / "export" / "model.pt"
    assert run_cli(capsys, "--checkpoint", ckpt, "--format", "torchscript", "--out", out)[0] == 0
    (out.parent / ".model.pt.99999.0123abcd.tmp").write_bytes(b"half of a killed export")

    def killed(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exporting, "atomic_write_bytes", killed)
    code, _, err = run_cli(
        capsys, "--checkpoint", ckpt, "--format", "torchscript", "--no-frontend", "--out", out
    )
    assert code == 2 and err.count("\n") == 1
    assert out.is_file() and not Path(f"{out}.json").exists()
    assert leftovers(out.parent) == []
    with pytest.raises(CheckpointError, match="needs its sidecar model.pt.json"):
        load_embedder(out, "cpu")
