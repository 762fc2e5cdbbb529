"""Export a trained embedding model as TorchScript, ONNX or a slim state_dict checkpoint.

    python -m audioclf.export --checkpoint runs/demo/best.pt --format torchscript --out model.pt
    python -m audioclf.export --checkpoint runs/demo/best.pt --format onnx --out model.onnx
    python -m audioclf.export --checkpoint runs/demo/best.pt --format torchscript \
        --no-frontend --out model_logmel.pt
    python -m audioclf.export --checkpoint runs/demo/best.pt --format state_dict --out weights.pt

The exported model is the network in eval mode (no SpecAugment, no dropout):
  forward(x, lengths) -> embeddings float32 [batch, D], L2-normalised
                         (embeddings, logits [batch, classes]) when trained with a classifier
                         head (loss.ce_weight > 0; class names in the sidecar)
  x        default: waveforms float32 [batch, samples], mono at features.sample_rate,
           zero-padded after each clip; the log-mel front end is inside the model.
           --no-frontend (and models trained on .npy features): log-mel float32
           [batch, frames, n_mels] as audioclf.spectrogram.log_mel computes it (log of mel power
           + 1e-6, not normalised); per-utterance normalisation is still inside the model.
  lengths  int64 [batch]: valid samples (or frames) of each row.
Batch and time are dynamic in every format.

Formats:
  torchscript  torch.jit.script; load with torch.jit.load(path) — no audioclf needed.
  onnx         torch.onnx.export (dynamo exporter, opset >= 18), dynamic batch and time axes;
               needs the optional packages: pip install onnx onnxscript onnxruntime.
  state_dict   a checkpoint without optimizer state ({model, config, classes, ...}); load with
               audioclf.inference.load_trained(path) (--no-frontend does not apply).

After writing, the artefact is loaded back (torch.jit.load / onnxruntime / load_trained) and
compared with the PyTorch model on random input at two lengths; the max abs difference is
printed, and above --tolerance the artefact is removed and the exit status is 1. A sidecar
<out>.json says what a user needs: input kind and shapes, sample rate and features settings,
embedding size, classes (with a head), format, versions. Files are written atomically.
Exit status: 0 done; 1 parity check failed; 2 bad input or missing optional packages.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from audioclf import checkpoint
from audioclf.checkpoint import CheckpointError
from audioclf.cli import ExportSidecar, UsageError, run_cli, sidecar_path
from audioclf.config import Config, ModelConfig, choices, to_dict
from audioclf.fileio import atomic_write_bytes
from audioclf.inference import LOG_MEL, WAVEFORM, load_trained
from audioclf.models import EmbeddingNet
from audioclf.models.frontend import FeatureFrontend

PROG = "python -m audioclf.export"
FORMATS = ("torchscript", "onnx", "state_dict")
DEFAULT_OPSET = 18  # the dynamo exporter's lowest opset (it cannot convert down to 17)
DEFAULT_TOLERANCE = 1e-4  # max abs difference of fp32 unit-length embeddings
# Parity inputs: (batch, seconds, valid fraction of each row); two lengths, varied padding.
PARITY_INPUTS = ((2, 1.0, (1.0, 0.6)), (3, 2.3, (1.0, 0.45, 0.8)))


class ExportError(RuntimeError):
    """The model could not be exported (or an optional package is missing)."""


class ParityError(RuntimeError):
    """The exported artefact does not reproduce the PyTorch model within the tolerance."""


# ---------------------------------------------------------------------------------------------
# What is exported


class ExportedEmbedder(nn.Module):
    """forward(x, lengths) -> embeddings of an EmbeddingNet (front end → embedder), eval mode."""

    def __init__(self, net: EmbeddingNet):
        super().__init__()
        self.net = net

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        return self.net.embed(x, lengths)


class ExportedEmbedderWithLogits(ExportedEmbedder):
    """forward(x, lengths) -> (embeddings, logits of the classifier head)."""

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        embeddings = self.net.embed(x, lengths)
        return embeddings, self.net.head(embeddings)


def exportable(net: EmbeddingNet, cfg: Config, frontend: bool = True) -> ExportedEmbedder:
    """The module that is exported: with or without the log-mel, with logits if a head.

    Without the log-mel the trained embedder and head sit behind a front end built for log-mel
    input with the same settings, so normalisation stays inside the model.
    """
    if not frontend and net.frontend.log_mel is not None:
        front = FeatureFrontend(dataclasses.replace(cfg.features, kind="npy"))
        bare = EmbeddingNet(front, net.embedder)
        bare.head = net.head
        net = bare
    if net.head is not None:
        return ExportedEmbedderWithLogits(net).eval()
    return ExportedEmbedder(net).eval()


def input_kind(cfg: Config, frontend: bool) -> str:
    return WAVEFORM if cfg.features.kind == "audio" and frontend else LOG_MEL


def random_inputs(cfg: Config, kind: str, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """The parity inputs: noise of two lengths (PARITY_INPUTS), rows padded to varied lengths."""
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for batch, seconds, fractions in PARITY_INPUTS:
        samples = int(round(seconds * cfg.features.sample_rate))
        size = samples if kind == WAVEFORM else cfg.features.frames(samples)
        lengths = torch.tensor([max(1, int(size * f)) for f in fractions[:batch]], dtype=torch.long)
        shape = (batch, size) if kind == WAVEFORM else (batch, size, cfg.features.n_mels)
        x = torch.randn(shape, generator=generator) * (0.1 if kind == WAVEFORM else 1.0)
        for row, length in enumerate(lengths.tolist()):
            x[row, length:] = 0  # zero padding, as collate_padded gives
        inputs.append((x, lengths))
    return inputs


def _as_tuple(output) -> tuple[Tensor, ...]:
    if isinstance(output, (tuple, list)):
        return tuple(torch.as_tensor(o) for o in output)
    return (torch.as_tensor(output),)


# ---------------------------------------------------------------------------------------------
# Writers and loaders (artefact → callable returning a tuple of tensors)


def _temp_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.tmp{os.getpid()}")


def write_torchscript(module: ExportedEmbedder, path: Path) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated in torch >= 2.10
            scripted = torch.jit.script(module)
            torch.jit.save(scripted, str(path))
    except Exception as exc:  # the scripting compiler raises many error types
        raise ExportError(f"torch.jit.script failed for the {type(module.embedder).__name__}: "
                          f"{exc}") from None


def load_torchscript(path: Path, device: str | torch.device = "cpu") -> Callable:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated too
        scripted = torch.jit.load(str(path), map_location=device)
    scripted.eval()
    return lambda x, lengths: _as_tuple(scripted(x, lengths))


def onnx_modules():
    """(onnx, onnxruntime), imported lazily; ExportError naming the pip command when missing."""
    missing = []
    modules = {}
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            modules[name] = __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ExportError(
            f"ONNX export needs the optional package(s) {', '.join(missing)}, which are not "
            "installed: pip install onnx onnxscript onnxruntime"
        )
    return modules["onnx"], modules["onnxruntime"]


def onnx_io_names(kind: str, with_logits: bool) -> tuple[list[str], list[str]]:
    inputs = ["waveform" if kind == WAVEFORM else "features", "lengths"]
    outputs = ["embeddings", "logits"] if with_logits else ["embeddings"]
    return inputs, outputs


def write_onnx(module: ExportedEmbedder, path: Path, *, kind: str, example: tuple[Tensor, Tensor],
               opset: int) -> None:
    onnx, _ = onnx_modules()
    input_names, output_names = onnx_io_names(kind, isinstance(module, ExportedEmbedderWithLogits))
    batch = torch.export.Dim("batch")
    time_axis = torch.export.Dim("samples" if kind == WAVEFORM else "frames")
    captured = io.StringIO()
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)  # progress lines and "torchvision is not installed"
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(captured):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, example, str(path), dynamo=True, external_data=False,
                opset_version=opset, input_names=input_names, output_names=output_names,
                dynamic_shapes={"x": {0: batch, 1: time_axis}, "lengths": {0: batch}},
            )
        onnx.checker.check_model(str(path))
    except Exception as exc:  # torch.export / onnxscript raise many error types
        raise ExportError(f"ONNX export failed ({type(exc).__name__}): {exc}") from None
    finally:
        onnx_logger.setLevel(level)


def load_onnx(path: Path, device: str | torch.device = "cpu") -> Callable:
    """An onnxruntime session on the CPU as `(x, lengths) -> outputs` (device is ignored)."""
    _, ort = onnx_modules()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(x: Tensor, lengths: Tensor) -> tuple[Tensor, ...]:
        feeds = {names[0]: x.cpu().numpy().astype(np.float32),
                 names[1]: lengths.cpu().numpy().astype(np.int64)}
        return tuple(torch.from_numpy(o) for o in session.run(None, feeds))

    return run


def write_state_dict(net: EmbeddingNet, cfg: Config, ckpt: dict, path: Path,
                     source: Path) -> None:
    """A loadable audioclf checkpoint without optimizer, scheduler, sampler or RNG state."""
    slim = {
        "model": net.state_dict(),
        "config": to_dict(cfg),
        "classes": list(ckpt.get("classes") or []),
        "epoch": ckpt.get("epoch"),
        "step": ckpt.get("step"),
        "last_metrics": ckpt.get("last_metrics", {}),
        "versions": checkpoint.library_versions(),
        "exported_from": str(source),
    }
    with open(path, "wb") as fh:
        torch.save(slim, fh)


def load_state_dict_export(path: Path, frontend: bool) -> Callable:
    net, cfg, _ = load_trained(path, "cpu")
    module = exportable(net, cfg, frontend)
    return lambda x, lengths: _as_tuple(module(x, lengths))


# ---------------------------------------------------------------------------------------------
# Export + parity


def reference(net: EmbeddingNet, module: ExportedEmbedder, frontend: bool) -> Callable:
    """The PyTorch model the artefact must reproduce: the trained EmbeddingNet itself (its
    outputs without the None logits), or the exported module when it skips the log-mel."""
    if not frontend and net.frontend.log_mel is not None:
        return module
    return lambda x, lengths: tuple(o for o in net(x, lengths) if o is not None)


@torch.no_grad()
def parity_difference(expected_fn: Callable, loaded: Callable, inputs) -> float:
    """Max abs difference over every output of every input; inf when shapes differ or either
    side gives NaN / inf (a broken model must not pass as "difference 0")."""
    worst = 0.0
    for x, lengths in inputs:
        expected = _as_tuple(expected_fn(x, lengths))
        actual = loaded(x, lengths)
        if len(actual) != len(expected):
            return float("inf")
        for a, e in zip(actual, expected, strict=True):
            if tuple(a.shape) != tuple(e.shape):
                return float("inf")
            if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
                return float("inf")
            worst = max(worst, float((a.float() - e.float()).abs().max()))
    return worst


def export_model(checkpoint_path: str | Path, fmt: str, out: str | Path, *, frontend: bool = True,
                 opset: int = DEFAULT_OPSET, tolerance: float = DEFAULT_TOLERANCE,
                 model_name: str | None = None) -> ExportSidecar:
    """Write the artefact and its sidecar; returns the sidecar.

    Raises ParityError (nothing written) when the reloaded artefact differs from the PyTorch
    model by more than `tolerance`; UsageError / CheckpointError / ExportError on bad input.
    """
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is invalid: use one of {', '.join(FORMATS)}")
    if fmt == "state_dict" and not frontend:
        raise UsageError("--no-frontend applies to torchscript and onnx exports; a state_dict "
                         "export always holds the whole model")
    if fmt == "onnx" and opset < DEFAULT_OPSET:
        raise UsageError(f"--opset {opset}: torch's ONNX exporter writes opset {DEFAULT_OPSET} "
                         "or newer")
    if not tolerance >= 0:
        raise UsageError(f"--tolerance must be >= 0, got {tolerance}")
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; give a file path such as {out / 'model.pt'}")
    if fmt == "onnx":
        onnx_modules()  # fail before any work when the optional packages are missing
    checkpoint_path = Path(checkpoint_path)
    net, cfg, ckpt = load_trained(checkpoint_path, "cpu", model_name=model_name)
    kind = input_kind(cfg, frontend)
    module = exportable(net, cfg, frontend)
    inputs = random_inputs(cfg, kind)
    with torch.no_grad():
        if not all(torch.isfinite(o).all() for x, lengths in inputs
                   for o in _as_tuple(reference(net, module, frontend)(x, lengths))):
            raise CheckpointError(f"the model in {checkpoint_path} gives NaN/inf outputs (did "
                                  "training diverge?); export another checkpoint")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(out)
    try:
        if fmt == "torchscript":
            write_torchscript(module, tmp)
            loaded = load_torchscript(tmp)
        elif fmt == "onnx":
            write_onnx(module, tmp, kind=kind, example=inputs[0], opset=opset)
            loaded = load_onnx(tmp)
        else:
            write_state_dict(net, cfg, ckpt, tmp, checkpoint_path)
            loaded = load_state_dict_export(tmp, frontend)
        difference = parity_difference(reference(net, module, frontend), loaded, inputs)
        del loaded  # release the file (onnxruntime session, mmap) before moving it
        if not difference <= tolerance:
            raise ParityError(
                f"the exported {fmt} model differs from the PyTorch model by {difference:.3g} "
                f"(max abs, tolerance {tolerance:g}; inf: an output is NaN/inf or of another "
                f"shape); nothing was written to {out}"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)

    meta = sidecar(cfg, ckpt, checkpoint_path, fmt=fmt, out=out, kind=kind,
                   with_logits=isinstance(module, ExportedEmbedderWithLogits), opset=opset,
                   difference=difference, tolerance=tolerance, inputs=inputs)
    atomic_write_bytes(sidecar_path(out), meta.to_json().encode())
    return meta


def sidecar(cfg: Config, ckpt: dict, checkpoint_path: Path, *, fmt: str, out: Path, kind: str,
            with_logits: bool, opset: int, difference: float, tolerance: float,
            inputs) -> ExportSidecar:
    features = cfg.features
    if kind == WAVEFORM:
        x_doc = (f"float32 [batch, samples]: mono waveforms at {features.sample_rate} Hz in "
                 "[-1, 1], zero-padded after each clip")
        lengths_doc = "int64 [batch]: valid samples of each row"
    else:
        x_doc = (f"float32 [batch, frames, {features.n_mels}]: log-mel as "
                 "audioclf.spectrogram.log_mel computes it (log(mel power + 1e-6), centred frames, "
                 "not normalised), zero-padded after each clip")
        lengths_doc = "int64 [batch]: valid frames of each row"
    versions = checkpoint.library_versions()
    if fmt == "onnx":
        onnx, ort = onnx_modules()
        versions.update(onnx=onnx.__version__, onnxruntime=ort.__version__)
    input_names, output_names = (onnx_io_names(kind, with_logits) if fmt == "onnx"
                                 else (["x", "lengths"], ["embeddings", "logits"][: 1 + with_logits]))
    classes = list(ckpt.get("classes") or []) if with_logits else []
    return ExportSidecar(
        format=fmt,
        file=out.name,
        input_kind=kind,
        inputs={input_names[0]: x_doc, input_names[1]: lengths_doc},
        outputs={
            "embeddings": f"float32 [batch, {cfg.model.embedding_dim}], L2-normalised",
            **({"logits": f"float32 [batch, {len(classes)}], one per class in 'classes'"}
               if with_logits else {}),
        },
        output_names=output_names,
        embedding_dim=cfg.model.embedding_dim,
        sample_rate=features.sample_rate,
        features=dataclasses.asdict(features),
        clips=dataclasses.asdict(cfg.clips),
        model=dataclasses.asdict(cfg.model),
        classes=classes,
        data_columns={k: getattr(cfg.data, k) for k in (
            "sheet", "class_column", "item_column", "id_column", "path_column", "path_template")},
        checkpoint={"path": str(checkpoint_path), "epoch": ckpt.get("epoch"),
                    "step": ckpt.get("step")},
        parity={"max_abs_diff": difference, "tolerance": tolerance,
                "input_shapes": [list(x.shape) for x, _ in inputs]},
        versions=versions,
        opset=opset if fmt == "onnx" else None,
    )


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="audioclf checkpoint (e.g. runs/<name>/best.pt)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="artefact format")
    parser.add_argument("--out", required=True, type=Path,
                        help="artefact path; the sidecar goes to <out>.json")
    parser.add_argument("--no-frontend", action="store_true",
                        help="take log-mel features instead of waveforms (torchscript, onnx)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                        help=f"ONNX opset (default {DEFAULT_OPSET}, the lowest the exporter writes)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"max abs difference allowed by the parity check (default "
                             f"{DEFAULT_TOLERANCE:g})")
    parser.add_argument("--model-name", choices=choices(ModelConfig, "name"),
                        help="fail unless the checkpoint holds this model")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    try:
        meta = export_model(args.checkpoint, args.format, args.out, frontend=not args.no_frontend,
                            opset=args.opset, tolerance=args.tolerance,
                            model_name=args.model_name)
    except ParityError as exc:
        print(f"{PROG}: parity check failed: {exc}", file=sys.stderr)
        return 1
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    shapes = ", ".join("x".join(map(str, s)) for s in meta.parity["input_shapes"])
    outputs = f"{meta.embedding_dim}-d embeddings"
    if meta.classes:
        outputs += f" and logits of {len(meta.classes)} classes"
    print(f"exported {meta.format} ({meta.input_kind} input, {outputs}) to {args.out}")
    print(f"parity: max abs difference {meta.parity['max_abs_diff']:.3g} on inputs {shapes} "
          f"(tolerance {meta.parity['tolerance']:g})")
    print(f"sidecar: {sidecar_path(args.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
