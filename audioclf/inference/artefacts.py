"""Load any model artefact as one embedding function: a checkpoint (.pt from audioclf.train), a
state_dict export, or a TorchScript / ONNX export with its sidecar <artefact>.json.

    model = load_embedder("runs/demo/best.pt", torch.device("cpu"))
    files, emb, skipped = embed_paths(model, files)   # audioclf.inference.extract

evaluate, embed (and search) read files through what this returns; the features, clips and
sheet columns come from the checkpoint's config or from the sidecar.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from audioclf.checkpoint import CheckpointError, model_file, not_a_model
from audioclf.config import Config, DataConfig, FeaturesConfig
from audioclf.errors import one_line
from audioclf.fileio import file_stamp
from audioclf.inference.checkpoints import describe_checkpoint, load_trained
from audioclf.inference.extract import EmbedFn, input_kind_of
from audioclf.inference.formats import load_onnx, load_torchscript
from audioclf.inference.sidecar import ExportSidecar, sidecar_config, sidecar_path


class ArtefactError(ValueError):
    """A model artefact that cannot be loaded; the message names the file and the fix."""


@dataclass
class LoadedEmbedder:
    """What embedding needs from a checkpoint or an export."""

    embed_fn: EmbedFn
    cfg: Config  # features and clips to read files as evaluation does; data: the sheet columns
    input_kind: str  # WAVEFORM or LOG_MEL
    path: Path
    description: str
    device: torch.device
    # A checkpoint's data settings hold the training's split rules (data.val_ratio, holdout,
    # seed); an export's sidecar holds only the column names.
    knows_splits: bool = False
    # A checkpoint's network (None for an export): what audioclf.inference.adapt changes.
    network: nn.Module | None = None
    # What that adaptation did (None: not adapted); the description says it too.
    adaptation: dict | None = None

    @classmethod
    def from_checkpoint(
        cls, path: Path, device: torch.device, *, model_name: str | None = None, trust=False
    ) -> LoadedEmbedder:
        """The model of an audioclf checkpoint (load_trained: `model_name` asserts which)."""
        net, cfg, ckpt = load_trained(path, device, model_name=model_name, trust=trust)
        return cls.of_network(net, cfg, ckpt, Path(path), device)

    @classmethod
    def of_network(
        cls, net: nn.Module, cfg: Config, ckpt: dict, path: Path, device: torch.device
    ) -> LoadedEmbedder:
        """A loaded checkpoint's network; an adapted state_dict export says so."""
        adaptation = ckpt.get("adaptation")
        description = describe_checkpoint(ckpt, cfg) + describe_adaptation(adaptation)
        kind = input_kind_of(cfg.features)
        return cls(
            net.embed,
            cfg,
            kind,
            path,
            description,
            device,
            knows_splits=True,
            network=net,
            adaptation=adaptation,
        )

    @property
    def features(self) -> FeaturesConfig:
        return self.cfg.features

    @property
    def data(self) -> DataConfig:
        return self.cfg.data


def resolve_device(name: str | torch.device, flag: str = "--device") -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available) → a device that exists here;
    else a ValueError naming it as the caller's user gave it (`flag`: "--device", "device")."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"{flag} {name!r} is not a device; use cpu, cuda, cuda:N or auto"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{flag} {name} was requested but CUDA is not available here; use {flag} cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type != "cpu":
        raise ValueError(f"{flag} {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    return device


def load_embedder(
    path: str | Path,
    device: torch.device,
    *,
    flag: str = "--model",
    trust: bool = False,
) -> LoadedEmbedder:
    """An audioclf checkpoint or state_dict export, or an export with its sidecar <path>.json;
    a folder stands for its run's best.pt, or the one model file it holds (checkpoint.model_file).

    ONNX runs on the CPU whatever `device` says. `flag` is how the caller's user named the
    file (messages say "--model x.pt does not exist"). ArtefactError / CheckpointError name
    the file and the fix.
    """
    path = model_file(path, flag)
    if (what := not_a_model(path)) is not None:
        raise ArtefactError(
            f"{flag} {path} is {what}, not a model; pass a checkpoint (.pt), TorchScript or ONNX "
            "export"
        )
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        try:
            meta = ExportSidecar.read(sidecar)
            cfg = sidecar_config(meta)
        except (ValueError, KeyError, TypeError) as exc:
            raise ArtefactError(
                f"the sidecar {sidecar} of {flag} {path} cannot be read "
                f"({type(exc).__name__}: {exc}); export the model again"
            ) from None
        if meta.format in ("torchscript", "onnx"):
            return _load_export(path, meta, cfg, device, flag)
    if path.suffix.lower() == ".onnx":
        raise ArtefactError(
            f"{flag} {path}: an ONNX export needs its sidecar {sidecar} "
            "(written by audioclf.export)"
        )
    try:
        return LoadedEmbedder.from_checkpoint(path, device, trust=trust)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc} (a TorchScript export needs its sidecar {sidecar.name} next to it)"
        ) from None


def _load_export(
    path: Path, meta: ExportSidecar, cfg: Config, device: torch.device, flag: str
) -> LoadedEmbedder:
    fmt = meta.format
    if fmt == "onnx":
        device = torch.device("cpu")  # the onnxruntime session runs on the CPU
    loader = load_torchscript if fmt == "torchscript" else load_onnx
    try:
        run = loader(path, device)
    except (RuntimeError, ValueError) as exc:  # a damaged file: the first sentence says how
        reason = one_line(exc).split(". ")[0].rstrip(".")
        raise ArtefactError(
            f"{flag} {path} is not a loadable {fmt} export ({reason}); export the model again "
            "with python -m audioclf.export"
        ) from None

    def embed_fn(x: Tensor, lengths: Tensor) -> Tensor:
        return run(x, lengths)[0].to(x.device)  # the embeddings (logits come second)

    description = f"{fmt} export, {meta.embedding_dim}-d" + describe_adaptation(meta.adaptation)
    return LoadedEmbedder(
        embed_fn, cfg, meta.input_kind, path, description, device, adaptation=meta.adaptation
    )


def describe_adaptation(record: dict | None) -> str:
    """What a model was adapted on, in words: the end of its description ("" when it was not)."""
    if record is None:
        return ""
    return (
        f", adapted by {record['method']} on {record['clips']} unlabelled clips of "
        f"{', '.join(record['source'])} ({record['batchnorm_layers']} BatchNorm layers)"
    )


def model_dim(model: LoadedEmbedder) -> int | None:
    """The dimension of the model's embeddings, from its export sidecar or checkpoint config."""
    sidecar = sidecar_path(model.path)
    if sidecar.is_file():
        try:
            return int(ExportSidecar.read(sidecar).embedding_dim)
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return int(model.cfg.model.embedding_dim) if model.knows_splits else None


def model_record(model: LoadedEmbedder) -> dict[str, Any]:
    """The one record of what made some embeddings: its file, description, input, features,
    clip settings (what evaluation length a file is cut to), dimension and adaptation (None: its
    own statistics). embed --index's table and a search index keep it; the gallery cache's key
    and embed --index's parts manifest are built from it plus their own keys."""
    return {
        **file_stamp(model.path),
        "description": model.description,
        "input_kind": model.input_kind,
        "features": dataclasses.asdict(model.features),
        "clips": dataclasses.asdict(model.cfg.clips),
        "dim": model_dim(model),
        "adaptation": model.adaptation,
    }
