"""Using a model outside the training loop: load it, and the one embedding-extraction path.

    net, cfg, ckpt = load_trained("runs/demo/best.pt")        # EmbeddingNet in eval mode
    emb = embed_files(net, cfg, ["a.wav", "b.wav"], batch_size=16, device="cpu")  # [2, D]

`extract_embeddings` is what validation during training, `evaluate` and `embed` all run: a
model's `embed` (in eval mode) or any callable `(x, lengths) -> embeddings`, e.g. a TorchScript
export, over a dataset in ordered batches. `embed_files` reads each file as evaluation does
(the whole clip, cut centred to clips.eval_max_seconds, or a centred crop with
clips.eval_crop=center).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from audioclf import checkpoint, distributed
from audioclf.checkpoint import CheckpointError
from audioclf.cli import UsageError
from audioclf.config import Config, ConfigError, config_from_dict
from audioclf.data.dataset import AudioDataset
from audioclf.data.loader import build_eval_loader, loader_kwargs
from audioclf.data.readers import AudioReadError, FeatureFileError
from audioclf.models import EmbeddingNet, build_net
from audioclf.precision import Precision, full_precision
from audioclf.spectrogram import log_mel

# What a model takes as input: waveforms [B, samples] or log-mel features [B, frames, n_mels].
WAVEFORM, LOG_MEL = "waveform", "log_mel"
# Prefixes that wrappers add to state-dict keys (DDP / DataParallel, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOW = 3  # keys quoted in a state-dict mismatch message


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
    if cfg.model.head != "none" and not classes:
        raise CheckpointError(
            f"{path} was trained with a classifier head (model.head={cfg.model.head}) but "
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


def init_weights(net: EmbeddingNet, path: str | Path, classes: list[str]) -> list[str]:
    """Fine-tuning: load the weights of a checkpoint or state_dict export into a new run's net.

    The architecture must be the same; a classifier head trained for other classes (or absent
    on one side) is left freshly initialised. Returns notes for the log; CheckpointError names
    the first tensor that does not fit.
    """
    path = Path(path)
    ckpt = checkpoint.load(path, map_location="cpu")
    state = _strip_wrapper_prefixes(ckpt["model"])
    notes = []
    expected = net.state_dict()
    saved_classes = list(ckpt.get("classes") or [])
    head = [k for k in set(state) | set(expected) if k.startswith("head.")]
    same_head = all(k in state and k in expected and state[k].shape == expected[k].shape
                    for k in head) and saved_classes == list(classes)
    if head and not same_head:
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        expected = {k: v for k, v in expected.items() if not k.startswith("head.")}
        notes.append(f"model.init_from: the classifier head starts afresh ({len(saved_classes)} "
                     f"classes in {path.name}, {len(classes)} here)")
    for key, value in expected.items():
        if key not in state:
            raise CheckpointError(f"model.init_from={path}: it has no tensor {key!r}; it holds "
                                  "another architecture (model.* settings must match it)")
        if tuple(state[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"model.init_from={path}: tensor {key!r} is {list(state[key].shape)} there and "
                f"{list(value.shape)} here; the model.* / features.n_mels settings must match it")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"model.init_from={path}: tensor {unexpected[0]!r} has no place in "
                              "this model; it holds another architecture")
    net.load_state_dict(state, strict=False)
    notes.insert(0, f"model.init_from: weights of {path} ({describe_checkpoint(ckpt, checkpoint_config(ckpt, path))})")
    return notes


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




def describe_checkpoint(ckpt: dict[str, Any], cfg: Config) -> str:
    """'cnn, 128-d, epoch 12, step 3400' — for summaries."""
    parts = [cfg.model.name, f"{cfg.model.embedding_dim}-d"]
    for key in ("epoch", "step"):
        if ckpt.get(key) is not None:
            parts.append(f"{key} {ckpt[key]}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Embedding extraction


@torch.no_grad()
def extract_embeddings(
    model: nn.Module | Callable[[Tensor, Tensor], Tensor],
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    device: str | torch.device = "cpu",
    positions: Sequence[int] | None = None,
    loader_options: dict | None = None,
    precision: Precision | None = None,
    progress: bool = False,
    description: str = "embed",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Embeddings of a dataset of (x, label, position) items, in ordered batches.

    `model` is a network with an `embed(x, lengths)` method (an EmbeddingNet, also inside a
    DDP / DataParallel wrapper; it runs in eval mode and its training flag is restored after)
    or any callable `(x, lengths) -> [B, D]`. `positions` selects items (default: all);
    `loader_options` are DataLoader settings from `loader_kwargs` (default: no workers);
    `precision` gives the autocast context (default fp32). One batch is on the device at a
    time, without gradients. Returns (embeddings float32 [N, D], labels [N], positions [N]);
    items a dataset skips (data.skip_bad_files) are absent.
    """
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    device = torch.device(device)
    precision = precision or full_precision(device)
    options = loader_options if loader_options is not None else loader_kwargs(0, True, False, 2, device)
    loader = build_eval_loader(dataset, None if positions is None else list(positions),
                               batch_size=batch_size, **options)
    net = distributed.unwrap(model) if isinstance(model, nn.Module) else None
    embed = net.embed if net is not None else model
    was_training = net is not None and net.training
    if net is not None:
        net.eval()
    chunks, labels_out, positions_out = [], [], []
    try:
        for x, lengths, labels, batch_positions in tqdm(
                loader, total=len(loader), desc=description, disable=not progress,
                dynamic_ncols=True, leave=False):
            with precision.autocast():
                emb = embed(x.to(device, non_blocking=True), lengths.to(device, non_blocking=True))
            chunks.append(emb.float().cpu().numpy())
            labels_out.append(labels.numpy())
            positions_out.append(batch_positions.numpy())
    finally:
        if was_training:
            net.train()
    if not chunks:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(chunks), np.concatenate(labels_out), np.concatenate(positions_out)


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


def file_dataset(paths: Sequence[str | Path], cfg: Config,
                 input_kind: str | None = None) -> torch.utils.data.Dataset:
    """Evaluation-mode dataset of `paths` (label 0) giving what a model of `input_kind` takes.

    input_kind defaults to what `features.kind` gives the front end (waveforms for audio,
    log-mel for npy); LOG_MEL with audio files computes the log-mel of each file.
    """
    features = cfg.features
    input_kind = input_kind or (WAVEFORM if features.kind == "audio" else LOG_MEL)
    if input_kind not in (WAVEFORM, LOG_MEL):
        raise ValueError(f"input_kind={input_kind!r} is invalid: use {WAVEFORM!r} or {LOG_MEL!r}")
    if input_kind == WAVEFORM and features.kind == "npy":
        raise ValueError("a model that takes waveforms cannot read precomputed features "
                         "(features.kind=npy)")
    dataset = AudioDataset([str(p) for p in paths], np.zeros(len(paths), np.int64), features,
                           cfg.clips, train=False)
    if input_kind == LOG_MEL and features.kind == "audio":
        return _LogMelDataset(dataset)
    return dataset


def embed_files(net: EmbeddingNet | Callable[[Tensor, Tensor], Tensor],
                cfg: Config, paths: Sequence[str | Path], batch_size: int = 32,
                device: str | torch.device = "cpu", *, input_kind: str | None = None,
                num_workers: int = 0, progress: bool = True) -> np.ndarray:
    """Embeddings float32 [len(paths), D] of audio (or .npy feature) files, in order.

    `net` is an EmbeddingNet or any callable `(x, lengths) -> [B, D]` such as a TorchScript
    export; `input_kind` says what that callable takes (WAVEFORM or LOG_MEL; default: what
    cfg.features.kind gives). A tqdm bar shows progress. An unreadable file raises
    AudioReadError / FeatureFileError naming it.
    """
    if not paths:
        raise UsageError("no files to embed")
    dataset = file_dataset(paths, cfg, input_kind)
    options = loader_kwargs(num_workers, True, False, 2, torch.device(device))
    try:
        emb, _, positions = extract_embeddings(net, dataset, batch_size=batch_size, device=device,
                                               loader_options=options, progress=progress)
    except (AudioReadError, FeatureFileError) as exc:
        # The dataset's message speaks of index items and data.skip_bad_files; for loose files
        # the reader's own message (which names the file) is the useful one.
        cause = exc.__cause__ if isinstance(exc.__cause__, (AudioReadError, FeatureFileError)) else exc
        raise type(cause)(str(cause)) from None
    order = np.argsort(positions, kind="stable")
    return np.ascontiguousarray(emb[order], dtype=np.float32)
