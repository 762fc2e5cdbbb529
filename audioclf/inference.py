"""Using a trained model outside training: load it, embed files, report errors as one line.

Shared by the `evaluate`, `export` and `embed` entry points:

    net, cfg, ckpt = load_trained("runs/demo/best.pt")        # EmbeddingNet in eval mode
    emb = embed_files(net, cfg, ["a.wav", "b.wav"], batch_size=16, device="cpu")  # [2, D]

`embed_files` reads each file as evaluation does (the whole clip, cut centred to
features.eval_max_seconds, or a centred crop with features.eval_crop=center) and also takes any
callable `(x, lengths) -> embeddings`, e.g. a TorchScript export, in place of the network.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from audioclf import checkpoint
from audioclf.checkpoint import CheckpointError
from audioclf.config import Config, ConfigError, FeaturesConfig, TrainConfig, config_from_dict
from audioclf.data.dataset import AudioDataset
from audioclf.data.loader import build_eval_loader, loader_kwargs
from audioclf.engine import extract_embeddings, resolve_precision
from audioclf.features import AudioReadError, FeatureFileError, log_mel
from audioclf.models import EmbeddingNet

# What a model takes as input: waveforms [B, samples] or log-mel features [B, frames, n_mels].
WAVEFORM, LOG_MEL = "waveform", "log_mel"
# Prefixes that wrappers add to state-dict keys (DDP / DataParallel, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOW = 3  # keys quoted in a state-dict mismatch message
DEBUG_ENV = "AUDIOCLF_DEBUG"  # set to 1 to get tracebacks instead of one-line CLI errors


class UsageError(ValueError):
    """Bad command-line input (flags, paths); the CLI prints it as one line and exits 2."""


# ---------------------------------------------------------------------------------------------
# Devices


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available) → a device that exists here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name} was requested but CUDA is not available here; "
                             "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    elif device.type != "cpu":
        raise UsageError(f"--device {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    return device


# ---------------------------------------------------------------------------------------------
# Loading a trained model


def load_trained(path: str | Path, device: str | torch.device = "cpu", *,
                 model_name: str | None = None) -> tuple[EmbeddingNet, Config, dict]:
    """Rebuild the model a checkpoint describes and load its weights.

    Returns (net in eval mode on `device`, its Config, the checkpoint dict). The architecture
    comes from the config stored in the checkpoint; `model_name` ("cnn", "conformer") only
    asserts what the caller expects. Raises CheckpointError naming the file when it is missing,
    corrupt, not an audioclf checkpoint, of another model, or its weights do not fit its config.
    """
    from audioclf.trainer import build_net

    path = Path(path)
    ckpt = checkpoint.load(path, map_location="cpu")
    cfg = checkpoint_config(ckpt, path)
    if model_name is not None and model_name != cfg.model.name:
        raise CheckpointError(
            f"--model-name {model_name} was requested but {path} holds a {cfg.model.name} model "
            f"(model.name={cfg.model.name} in its config); use a {model_name} checkpoint or drop "
            "--model-name"
        )
    classes = list(ckpt.get("classes") or [])
    if cfg.loss.ce_weight > 0 and not classes:
        raise CheckpointError(
            f"{path} was trained with a classifier head (loss.ce_weight={cfg.loss.ce_weight}) but "
            "holds no 'classes' list, so the head's size is unknown; use a checkpoint written by "
            "audioclf.train"
        )
    try:
        net = build_net(cfg, len(classes))
    except (ValueError, ConfigError) as exc:
        raise CheckpointError(f"{path}: its config does not describe a model audioclf can build "
                              f"({exc})") from None
    state = _strip_wrapper_prefixes(ckpt["model"])
    _check_state_dict(net.state_dict(), state, path, cfg)
    net.load_state_dict(state)
    return net.to(device).eval(), cfg, ckpt


def checkpoint_config(ckpt: dict, path: str | Path) -> Config:
    """The Config stored in a checkpoint dict; CheckpointError when it cannot be read."""
    try:
        return config_from_dict(ckpt["config"])
    except ConfigError as exc:
        raise CheckpointError(
            f"{path} holds a config this version of audioclf cannot read ({exc}); it was written "
            "by another version — evaluate it with that version"
        ) from None


def _strip_wrapper_prefixes(state: dict) -> dict:
    for prefix in _WRAPPER_PREFIXES:
        if state and all(key.startswith(prefix) for key in state):
            state = {key[len(prefix):]: value for key, value in state.items()}
    return state


def _check_state_dict(expected: dict[str, Tensor], state: dict, path: Path, cfg: Config) -> None:
    """One CheckpointError listing the first missing / unexpected / mis-shaped keys."""
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    mismatched = [
        f"{key} (checkpoint {list(state[key].shape)}, model {list(value.shape)})"
        for key, value in expected.items()
        if key in state and hasattr(state[key], "shape") and tuple(state[key].shape) != tuple(value.shape)
    ]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    for title, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                        ("shape mismatches", mismatched)):
        if keys:
            more = f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
            parts.append(f"{title} {', '.join(keys[:_SHOW])}{more}")
    raise CheckpointError(
        f"the weights in {path} do not fit the model its config describes (model.name="
        f"{cfg.model.name}, embedding_dim={cfg.model.embedding_dim}, features.n_mels="
        f"{cfg.features.n_mels}): {'; '.join(parts)}. The checkpoint was written by another model "
        "config (or another audioclf version); load it with the config it was trained with"
    )


# ---------------------------------------------------------------------------------------------
# Embedding files


class _LogMelDataset(torch.utils.data.Dataset):
    """Audio files as un-normalised log-mel [frames, n_mels], for models without a front end."""

    def __init__(self, audio: AudioDataset):
        self.audio = audio

    def __len__(self) -> int:
        return len(self.audio)

    def __getitem__(self, key):
        item = self.audio[key]
        if item is None:
            return None
        wave, label, position = item
        return torch.from_numpy(log_mel(wave, self.audio.cfg)), label, position


def file_dataset(paths: Sequence[str | Path], features: FeaturesConfig,
                 input_kind: str | None = None) -> torch.utils.data.Dataset:
    """Evaluation-mode dataset of `paths` (label 0) giving what a model of `input_kind` takes.

    input_kind defaults to what `features.kind` gives the front end (waveforms for audio,
    log-mel for npy); LOG_MEL with audio files computes the log-mel of each file.
    """
    input_kind = input_kind or (WAVEFORM if features.kind == "audio" else LOG_MEL)
    if input_kind not in (WAVEFORM, LOG_MEL):
        raise ValueError(f"input_kind={input_kind!r} is invalid: use {WAVEFORM!r} or {LOG_MEL!r}")
    if input_kind == WAVEFORM and features.kind == "npy":
        raise ValueError("a model that takes waveforms cannot read precomputed features "
                         "(features.kind=npy)")
    dataset = AudioDataset([str(p) for p in paths], np.zeros(len(paths), np.int64), features,
                           train=False)
    if input_kind == LOG_MEL and features.kind == "audio":
        return _LogMelDataset(dataset)
    return dataset


def embed_dataset(embed_fn: Callable[[Tensor, Tensor], Tensor], dataset, *, batch_size: int,
                  device: str | torch.device = "cpu", num_workers: int = 0, progress: bool = True,
                  description: str = "embed") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batched `embed_fn` over a dataset of (x, label, position) → (emb, labels, positions).

    fp32, no gradients, bounded memory (one batch on the device at a time). Unreadable files
    raise the dataset's error (AudioReadError / FeatureFileError naming the file).
    """
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    device = torch.device(device)
    kwargs = loader_kwargs(num_workers, True, False, 2, device)
    loader = build_eval_loader(dataset, batch_size=batch_size, **kwargs)
    precision = resolve_precision(TrainConfig(precision="fp32"), device)
    return extract_embeddings(embed_fn, loader, precision, progress=progress,
                              description=description)


def embed_files(net: EmbeddingNet | Callable[[Tensor, Tensor], Tensor],
                cfg: Config | FeaturesConfig, paths: Sequence[str | Path], batch_size: int = 32,
                device: str | torch.device = "cpu", *, input_kind: str | None = None,
                num_workers: int = 0, progress: bool = True) -> np.ndarray:
    """Embeddings float32 [len(paths), D] of audio (or .npy feature) files, in order.

    `net` is an EmbeddingNet (its `embed` runs, in eval mode) or any callable
    `(x, lengths) -> [B, D]` such as a TorchScript export; `input_kind` says what that callable
    takes (WAVEFORM or LOG_MEL; default: what cfg.features.kind gives). A tqdm bar shows
    progress. An unreadable file raises AudioReadError / FeatureFileError naming it.
    """
    features = cfg.features if isinstance(cfg, Config) else cfg
    if not paths:
        raise UsageError("no files to embed")
    if isinstance(net, EmbeddingNet):
        net.eval()
        embed_fn = net.embed
    else:
        embed_fn = net
    dataset = file_dataset(paths, features, input_kind)
    try:
        emb, _, positions = embed_dataset(embed_fn, dataset, batch_size=batch_size, device=device,
                                          num_workers=num_workers, progress=progress)
    except (AudioReadError, FeatureFileError) as exc:
        # The dataset's message speaks of index items and data.skip_bad_files; for loose files
        # the reader's own message (which names the file) is the useful one.
        cause = exc.__cause__ if isinstance(exc.__cause__, (AudioReadError, FeatureFileError)) else exc
        raise type(cause)(str(cause)) from None
    order = np.argsort(positions, kind="stable")
    return np.ascontiguousarray(emb[order], dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Command-line helpers


def one_line(exc: BaseException) -> str:
    """An exception as one line: worker tracebacks reduced to their final message."""
    text = str(exc).strip() or type(exc).__name__
    if "Original Traceback" in text:  # raised inside a DataLoader worker
        last = [line for line in text.splitlines() if line.strip()][-1]
        head, sep, message = last.partition(": ")
        text = message if sep and "." in head and " " not in head else last
    return " ".join(text.split())


def cli_errors(prog: str, run: Callable[[], int]) -> int:
    """Run a CLI body; expected errors (ValueError, OSError and their subclasses) → one line, exit 2.

    Set AUDIOCLF_DEBUG=1 to see the traceback instead.
    """
    try:
        return run()
    except (ValueError, OSError) as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def describe_checkpoint(ckpt: dict[str, Any], cfg: Config) -> str:
    """'cnn, 128-d, epoch 12, step 3400' — for summaries."""
    parts = [cfg.model.name, f"{cfg.model.embedding_dim}-d"]
    for key in ("epoch", "step"):
        if ckpt.get(key) is not None:
            parts.append(f"{key} {ckpt[key]}")
    return ", ".join(parts)
