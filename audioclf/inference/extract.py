"""The one embedding-extraction path: validation during training, evaluate and embed all run it.

    emb = embed_files(net, cfg, ["a.wav", "b.wav"], batch_size=16, device="cpu")  # [2, D]

`extract_embeddings` runs a model's `embed` (in eval mode) or any callable
`(x, lengths) -> embeddings`, e.g. a TorchScript export, over a dataset in ordered batches.
`embed_files` reads each file as evaluation does (the whole clip, cut centred to
clips.eval_max_seconds, or a centred crop with clips.eval_crop=center). `model_input` gives a
model what it takes: waveforms, or the log-mel of each file for an export without a front end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from audioclf import distributed
from audioclf.config import Config, FeaturesConfig
from audioclf.data.dataset import AudioDataset
from audioclf.data.loader import build_eval_loader, loader_kwargs
from audioclf.data.readers import AudioReadError, FeatureFileError
from audioclf.precision import Precision, exact_arithmetic, full_precision
from audioclf.spectrogram import log_mel

# What a model takes as input: waveforms [B, samples] or log-mel features [B, frames, n_mels].
WAVEFORM, LOG_MEL = "waveform", "log_mel"

EmbedFn = Callable[[Tensor, Tensor], Tensor]


def input_kind_of(features: FeaturesConfig, frontend: bool = True) -> str:
    """What a model trained on `features` takes: waveforms when it reads audio through its own
    front end, log-mel otherwise (features.kind=npy, or an export without the front end)."""
    return WAVEFORM if features.kind == "audio" and frontend else LOG_MEL


@torch.no_grad()
def extract_embeddings(
    model: nn.Module | EmbedFn,
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
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    precision = precision or full_precision(device)
    options = (
        loader_options if loader_options is not None else loader_kwargs(0, True, False, 2, device)
    )
    loader = build_eval_loader(
        dataset, None if positions is None else list(positions), batch_size=batch_size, **options
    )
    net = distributed.unwrap(model) if isinstance(model, nn.Module) else None
    embed = net.embed if net is not None else model
    was_training = net is not None and net.training
    if net is not None:
        net.eval()
    chunks, labels_out, positions_out = [], [], []
    batches = tqdm(
        loader,
        total=len(loader),
        desc=description,
        disable=not progress,
        dynamic_ncols=True,
        leave=False,
    )
    try:
        with exact_arithmetic():  # the same numbers in validation, evaluate and embed
            for x, lengths, labels, batch_positions in batches:
                with precision.autocast():
                    x, lengths = (
                        x.to(device, non_blocking=True),
                        lengths.to(device, non_blocking=True),
                    )
                    emb = embed(x, lengths)
                chunks.append(emb.float().cpu().numpy())
                labels_out.append(labels.numpy())
                positions_out.append(batch_positions.numpy())
    finally:
        if was_training:
            net.train()
    if not chunks:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(chunks), np.concatenate(labels_out), np.concatenate(positions_out)


class LogMelDataset(torch.utils.data.Dataset):
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


def model_input(dataset: AudioDataset, input_kind: str) -> torch.utils.data.Dataset:
    """`dataset` as a model of `input_kind` reads it: as it is, or (LOG_MEL from audio files)
    the log-mel of each file."""
    features = dataset.cfg
    if input_kind not in (WAVEFORM, LOG_MEL):
        raise ValueError(f"input_kind={input_kind!r} is invalid: use {WAVEFORM!r} or {LOG_MEL!r}")
    if input_kind == WAVEFORM and features.kind == "npy":
        raise ValueError(
            "a model that takes waveforms cannot read precomputed features (features.kind=npy)"
        )
    if input_kind == LOG_MEL and features.kind == "audio":
        return LogMelDataset(dataset)
    return dataset


def file_dataset(
    paths: Sequence[str | Path],
    cfg: Config,
    input_kind: str | None = None,
    spans: np.ndarray | None = None,
) -> torch.utils.data.Dataset:
    """Evaluation-mode dataset of `paths` (label 0) giving what a model of `input_kind` takes.

    input_kind defaults to what `features.kind` gives the front end (waveforms for audio,
    log-mel for npy); LOG_MEL with audio files computes the log-mel of each file. `spans`
    ([N, 2] seconds, NaN = the whole file): only that part of a file is read (segment rows).
    """
    dataset = AudioDataset(
        [str(p) for p in paths],
        np.zeros(len(paths), np.int64),
        cfg.features,
        cfg.clips,
        train=False,
        spans=spans,
    )
    return model_input(dataset, input_kind or input_kind_of(cfg.features))


def embed_files(
    net: nn.Module | EmbedFn,
    cfg: Config,
    paths: Sequence[str | Path],
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    *,
    input_kind: str | None = None,
    num_workers: int = 0,
    progress: bool = True,
    spans: np.ndarray | None = None,
) -> np.ndarray:
    """Embeddings float32 [len(paths), D] of audio (or .npy feature) files, in order (`spans`:
    the segments to read, as file_dataset takes them).

    `net` is an EmbeddingNet or any callable `(x, lengths) -> [B, D]` such as a TorchScript
    export; `input_kind` says what that callable takes (WAVEFORM or LOG_MEL; default: what
    cfg.features.kind gives). A tqdm bar shows progress. An unreadable file raises
    AudioReadError / FeatureFileError naming it.
    """
    if not paths:
        raise ValueError("no files to embed")
    dataset = file_dataset(paths, cfg, input_kind, spans)
    options = loader_kwargs(num_workers, True, False, 2, torch.device(device))
    try:
        emb, _, positions = extract_embeddings(
            net,
            dataset,
            batch_size=batch_size,
            device=device,
            loader_options=options,
            progress=progress,
        )
    except (AudioReadError, FeatureFileError) as exc:
        # The dataset's message speaks of index items and data.skip_bad_files; for loose files
        # the reader's own message (which names the file) is the useful one.
        cause = (
            exc.__cause__ if isinstance(exc.__cause__, (AudioReadError, FeatureFileError)) else exc
        )
        raise type(cause)(str(cause)) from None
    order = np.argsort(positions, kind="stable")
    return np.ascontiguousarray(emb[order], dtype=np.float32)


def check_loader_options(batch_size: int, num_workers: int | None) -> None:
    """ValueError for a batch size below 1 or a negative worker count (None: a default),
    before any work."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {num_workers}")


def check_finite(embeddings: np.ndarray, names: list[str], what: str) -> None:
    """ValueError naming the first of `names` whose embedding holds NaN / inf: a broken model
    must not pass for one that ranks or embeds."""
    bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1))
    if len(bad):
        raise ValueError(
            f"the model gives NaN/inf embeddings for {len(bad)} of {len(names)} of "
            f"{what} (first: {names[bad[0]]}): the model is broken (did training "
            "diverge?); use another checkpoint or export"
        )
