"""Exporting a trained model: the exported module, the parity check, the sidecar.

    meta = export_model("runs/demo/best.pt", "torchscript", "model.pt")   # → ExportSidecar

The artefact is written to a temporary name, loaded back and compared with the PyTorch model on
random input at two lengths; only within the tolerance is it moved into place and its sidecar
<out>.json written (see `python -m audioclf.export --help`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from audioclf import checkpoint
from audioclf.checkpoint import CheckpointError
from audioclf.config import Config, FeaturesConfig, to_dict
from audioclf.fileio import atomic_write_bytes, remove_temporaries
from audioclf.inference.adapt import adapt as adapt_model
from audioclf.inference.artefacts import LoadedEmbedder
from audioclf.inference.card import model_card
from audioclf.inference.checkpoints import load_trained
from audioclf.inference.extract import WAVEFORM, input_kind_of
from audioclf.inference.folder import (
    check_folder_out,
    finish_folder,
    place_folder,
    remove_tree_or_file,
    write_folder,
)
from audioclf.inference.formats import (
    ExportError,
    as_tuple,
    load_onnx,
    load_torchscript,
    onnx_io_names,
    onnx_modules,
    write_onnx,
    write_torchscript,
)
from audioclf.inference.sidecar import ExportSidecar, sidecar_path
from audioclf.models import EmbeddingNet
from audioclf.models.frontend import FeatureFrontend
from audioclf.outputs import FolderLock

__all__ = [
    "DEFAULT_OPSET",
    "DEFAULT_TOLERANCE",
    "FORMATS",
    "ExportError",
    "ExportedEmbedder",
    "ExportedEmbedderWithLogits",
    "ParityError",
    "export_model",
    "exportable",
    "parity_difference",
]

FORMATS = ("torchscript", "onnx", "state_dict", "folder")
DEFAULT_OPSET = 18  # the dynamo exporter's lowest opset (it cannot convert down to 17)
DEFAULT_TOLERANCE = 1e-4  # max abs difference of fp32 unit-length embeddings
# Parity inputs: (batch, seconds, valid fraction of each row); two lengths, varied padding.
PARITY_INPUTS = ((2, 1.0, (1.0, 0.6)), (3, 2.3, (1.0, 0.45, 0.8)))
# The index sheet's column settings a sidecar records (so a gallery sheet reads as in training).
DATA_COLUMNS = ("sheet", "class_column", "item_column", "id_column", "path_column", "path_template")


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


# ---------------------------------------------------------------------------------------------
# The state_dict format (an audioclf checkpoint; TorchScript and ONNX are in formats.py)


def write_state_dict(net: EmbeddingNet, cfg: Config, ckpt: dict, path: Path, source: Path) -> None:
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
        "adaptation": ckpt.get("adaptation"),  # None: the source's own statistics
    }
    with open(path, "wb") as fh:
        torch.save(slim, fh)


def load_state_dict_export(path: Path, frontend: bool) -> Callable:
    net, cfg, _ = load_trained(path, "cpu")
    module = exportable(net, cfg, frontend)
    return lambda x, lengths: as_tuple(module(x, lengths))


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
        expected = as_tuple(expected_fn(x, lengths))
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


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """What export_model writes and how it checks it: export's --format, --no-frontend,
    --opset and --tolerance."""

    fmt: str  # one of FORMATS
    frontend: bool = True  # the log-mel inside the artefact (torchscript, onnx: may be left out)
    opset: int = DEFAULT_OPSET  # onnx
    tolerance: float = DEFAULT_TOLERANCE  # of the parity check

    def check(self, out: Path) -> None:
        """ValueError for settings that do not fit together (or with `out`), before any work."""
        fmt = self.fmt
        if fmt not in FORMATS:
            raise ValueError(f"--format {fmt!r} is invalid: use one of {', '.join(FORMATS)}")
        if fmt in ("state_dict", "folder") and not self.frontend:
            raise ValueError(
                f"--no-frontend applies to torchscript and onnx exports; a {fmt} "
                "export always holds the whole model"
            )
        if fmt == "onnx" and self.opset < DEFAULT_OPSET:
            raise ValueError(
                f"--opset {self.opset}: torch's ONNX exporter writes opset {DEFAULT_OPSET} or newer"
            )
        if not self.tolerance >= 0:
            raise ValueError(f"--tolerance must be >= 0, got {self.tolerance}")
        if fmt == "folder":
            check_folder_out(out)
        elif out.is_dir():
            raise ValueError(
                f"--out {out} is a folder; give a file path such as {out / 'model.pt'}"
            )
        if fmt == "onnx":
            onnx_modules()  # fail before any work when the optional packages are missing


def export_model(
    checkpoint_path: str | Path,
    fmt: str,
    out: str | Path,
    *,
    frontend: bool = True,
    opset: int = DEFAULT_OPSET,
    tolerance: float = DEFAULT_TOLERANCE,
    model_name: str | None = None,
    trust: bool = False,
    adapt: Sequence[str | Path] = (),
    report: str | Path | None = None,
) -> ExportSidecar:
    """Write the artefact and its sidecar; returns the sidecar. `adapt`: folders or files of
    unlabelled audio of a new source the model is adapted on first (AdaBN, as `--adapt`
    adapts for embed and evaluate); the artefact holds those statistics and the sidecar (a
    state_dict export: the checkpoint) records the adaptation. A folder's model card quotes
    `report` (an evaluation's report.json; default: eval/report.json in the checkpoint's run
    folder, when there).

    Raises ParityError (nothing written) when the reloaded artefact differs from the PyTorch
    model by more than `tolerance`; ValueError / CheckpointError / ExportError on bad input.
    """
    out, checkpoint_path = Path(out), Path(checkpoint_path)
    options = ExportOptions(fmt, frontend=frontend, opset=opset, tolerance=tolerance)
    options.check(out)
    net, cfg, ckpt = load_trained(checkpoint_path, "cpu", model_name=model_name, trust=trust)
    if adapt:
        net, ckpt = _adapted(net, cfg, ckpt, checkpoint_path, adapt)
    kind = input_kind_of(cfg.features, frontend)
    module = exportable(net, cfg, frontend)
    inputs = random_inputs(cfg, kind)
    expected = reference(net, module, frontend)
    _check_finite(expected, inputs, checkpoint_path)

    with export_lock(out):  # creates out's folder
        remove_temporaries(out)  # of killed exports: the lock holder is out's only writer
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            loaded = _write_and_load(
                options, tmp, net, module, cfg, ckpt, checkpoint_path, kind=kind, example=inputs[0]
            )
            difference = parity_difference(expected, loaded, inputs)
            del loaded  # release the file (onnxruntime session, mmap) before moving it
            check_parity(difference, tolerance, fmt, out)
            meta = sidecar(
                cfg,
                ckpt,
                checkpoint_path,
                options,
                out=out,
                kind=kind,
                with_logits=isinstance(module, ExportedEmbedderWithLogits),
                difference=difference,
                inputs=inputs,
            )
            if fmt == "folder":
                card = model_card(cfg, ckpt, checkpoint_path, report=report)
                finish_folder(tmp, meta, card)
                place_folder(tmp, out)
            else:
                sidecar_path(out).unlink(missing_ok=True)  # never the new model beside an old one's
                os.replace(tmp, out)
                atomic_write_bytes(sidecar_path(out), meta.to_json().encode())
        finally:
            remove_tree_or_file(tmp)
    return meta


def check_parity(difference: float, tolerance: float, fmt: str, out: Path) -> None:
    """ParityError when the artefact's outputs differ by more than the tolerance."""
    if not difference <= tolerance:
        raise ParityError(
            f"the exported {fmt} model differs from the PyTorch model by {difference:.3g} "
            f"(max abs, tolerance {tolerance:g}; inf: an output is NaN/inf or of another "
            f"shape); nothing was written to {out}"
        )


def _adapted(
    net: EmbeddingNet, cfg: Config, ckpt: dict, path: Path, sources: Sequence[str | Path]
) -> tuple[EmbeddingNet, dict]:
    """The network adapted on `sources` (AdaBN, as --adapt adapts for embed and evaluate), and
    the checkpoint's entries with the record of it (for the sidecar and a state_dict export)."""
    loaded = LoadedEmbedder.of_network(net, cfg, ckpt, path, torch.device("cpu"))
    adapted = adapt_model(loaded, sources)
    return adapted.network, {**ckpt, "adaptation": adapted.adaptation}


def _check_finite(expected: Callable, inputs, path: Path) -> None:
    with torch.no_grad():
        if not all(
            torch.isfinite(o).all() for x, lengths in inputs for o in as_tuple(expected(x, lengths))
        ):
            raise CheckpointError(
                f"the model in {path} gives NaN/inf outputs (did training diverge?); export "
                "another checkpoint"
            )


def export_lock(out: Path) -> FolderLock:
    """.OUT.lock beside the artefact: one export into `out` at a time (artefact and sidecar)."""
    fix = "wait for it to finish, or export to another --out"
    return FolderLock(
        out.with_name(f".{out.name}.lock"), what=f"--out {out}", by="another export", fix=fix
    )


def _write_and_load(
    options: ExportOptions,
    tmp: Path,
    net: EmbeddingNet,
    module: ExportedEmbedder,
    cfg: Config,
    ckpt: dict,
    source: Path,
    *,
    kind: str,
    example: tuple[Tensor, Tensor],
) -> Callable:
    """Write the artefact at `tmp` and load it back as `(x, lengths) -> outputs`."""
    fmt = options.fmt
    if fmt == "torchscript":
        write_torchscript(module, tmp, what=type(module.net.embedder).__name__)
        return load_torchscript(tmp)
    if fmt == "onnx":
        write_onnx(
            module,
            tmp,
            kind=kind,
            example=example,
            opset=options.opset,
            with_logits=isinstance(module, ExportedEmbedderWithLogits),
        )
        return load_onnx(tmp)
    if fmt == "folder":
        write_folder(net, cfg, ckpt, tmp, source)
    else:
        write_state_dict(net, cfg, ckpt, tmp, source)
    return load_state_dict_export(tmp, options.frontend)


def sidecar(
    cfg: Config,
    ckpt: dict,
    checkpoint_path: Path,
    options: ExportOptions,
    *,
    out: Path,
    kind: str,
    with_logits: bool,
    difference: float,
    inputs,
) -> ExportSidecar:
    """The sidecar of an artefact that passed the parity check on `inputs`."""
    fmt = options.fmt
    x_doc, lengths_doc = input_docs(cfg.features, kind)
    input_names, output_names = (
        onnx_io_names(kind, with_logits)
        if fmt == "onnx"
        else (["x", "lengths"], ["embeddings", "logits"][: 1 + with_logits])
    )
    classes = list(ckpt.get("classes") or []) if with_logits else []
    return ExportSidecar(
        format=fmt,
        file=out.name,
        input_kind=kind,
        inputs={input_names[0]: x_doc, input_names[1]: lengths_doc},
        outputs=output_docs(cfg.model.embedding_dim, classes, with_logits),
        output_names=output_names,
        embedding_dim=cfg.model.embedding_dim,
        sample_rate=cfg.features.sample_rate,
        features=dataclasses.asdict(cfg.features),
        clips=dataclasses.asdict(cfg.clips),
        model=dataclasses.asdict(cfg.model),
        classes=classes,
        data_columns={k: getattr(cfg.data, k) for k in DATA_COLUMNS},
        checkpoint={
            "path": str(checkpoint_path),
            "epoch": ckpt.get("epoch"),
            "step": ckpt.get("step"),
        },
        parity={
            "max_abs_diff": difference,
            "tolerance": options.tolerance,
            "input_shapes": [list(x.shape) for x, _ in inputs],
        },
        versions=export_versions(fmt),
        opset=options.opset if fmt == "onnx" else None,
        adaptation=ckpt.get("adaptation"),
    )


def input_docs(features: FeaturesConfig, kind: str) -> tuple[str, str]:
    """What the sidecar says the two inputs (x, lengths) hold."""
    if kind == WAVEFORM:
        x_doc = (
            f"float32 [batch, samples]: mono waveforms at {features.sample_rate} Hz in "
            "[-1, 1], zero-padded after each clip"
        )
        return x_doc, "int64 [batch]: valid samples of each row"
    x_doc = (
        f"float32 [batch, frames, {features.n_mels}]: log-mel as "
        "audioclf.spectrogram.log_mel computes it (log(mel power + 1e-6), centred frames, "
        "not normalised), zero-padded after each clip"
    )
    return x_doc, "int64 [batch]: valid frames of each row"


def output_docs(embedding_dim: int, classes: list[str], with_logits: bool) -> dict[str, str]:
    """What the sidecar says each output holds."""
    docs = {"embeddings": f"float32 [batch, {embedding_dim}], L2-normalised"}
    if with_logits:
        docs["logits"] = f"float32 [batch, {len(classes)}], one per class in 'classes'"
    return docs


def export_versions(fmt: str) -> dict[str, str]:
    """The library versions an artefact was written with (onnx and onnxruntime for ONNX)."""
    versions = checkpoint.library_versions()
    if fmt == "onnx":
        onnx, ort = onnx_modules()
        versions.update(onnx=onnx.__version__, onnxruntime=ort.__version__)
    return versions
