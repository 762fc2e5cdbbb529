"""The one embedding path: a function over a dataset, and one over files, that validation,
evaluate, embed --index, the gallery, search queries and the API all run.

    emb, labels, positions = embed_dataset(net, dataset, batch_size=32, device="cpu")
    files, emb, skipped = embed_paths(model, find_files(["clips/"], model.features))  # [n, D]
    emb = embed_waves(model, [wave], sample_rate=22050)
    clips = read_clips(model, files)     # unbatched, as the network takes them (adaptation)

`embed_dataset` runs a model's `embed` (in eval mode) or any callable `(x, lengths) ->
embeddings`, e.g. a TorchScript export, over a dataset in ordered batches. `embed_paths` reads
each file as evaluation does (AudioDataset: the whole clip, cut centred to
clips.eval_max_seconds, or a centred crop with clips.eval_crop=center), and `embed_waves` cuts
in-memory audio the same way. `dataset_for_input` gives a model what it takes: waveforms, or the
log-mel of each file for an export without a front end (not `data.dataset.Batch.model_input`, a
training batch on the device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torchaudio
from torch import Tensor, nn
from tqdm import tqdm

from audioclf import distributed
from audioclf.config import FeaturesConfig
from audioclf.data.dataset import AudioDataset
from audioclf.data.loader import build_eval_loader, eval_loader_options
from audioclf.data.readers import AUDIO_SUFFIXES, AudioReadError, FeatureFileError
from audioclf.precision import Precision, exact_arithmetic, full_precision
from audioclf.spectrogram import log_mel

if TYPE_CHECKING:
    from audioclf.inference.artefacts import LoadedEmbedder

# What a model takes as input: waveforms [B, samples] or log-mel features [B, frames, n_mels].
WAVEFORM, LOG_MEL = "waveform", "log_mel"

EmbedFn = Callable[[Tensor, Tensor], Tensor]
# What a folder is searched for when the model reads precomputed features (features.kind=npy).
FEATURE_SUFFIXES = (".npy",)
# The suffixes an error message names when a folder holds no audio (AUDIO_SUFFIXES has ~30).
SHOWN_AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")


def input_kind_of(features: FeaturesConfig, frontend: bool = True) -> str:
    """What a model trained on `features` takes: waveforms when it reads audio through its own
    front end, log-mel otherwise (features.kind=npy, or an export without the front end)."""
    return WAVEFORM if features.kind == "audio" and frontend else LOG_MEL


@torch.no_grad()
def embed_dataset(
    model: nn.Module | EmbedFn,
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    device: str | torch.device = "cpu",
    positions: Sequence[int] | None = None,
    num_workers: int = 0,
    loader_options: dict | None = None,
    precision: Precision | None = None,
    progress: bool = False,
    description: str = "embed",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Embeddings of a dataset of (x, label, position) items, in ordered batches.

    `model` is a network with an `embed(x, lengths)` method (an EmbeddingNet, also inside a
    DDP / DataParallel wrapper; it runs in eval mode and its training flag is restored after)
    or any callable `(x, lengths) -> [B, D]`. `positions` selects items (default: all);
    `loader_options` are DataLoader settings (validation: the run's; default
    eval_loader_options with `num_workers`);
    `precision` gives the autocast context (default fp32). One batch is on the device at a
    time, without gradients. Returns (embeddings float32 [N, D], labels [N], positions [N]);
    items a dataset skips (data.skip_bad_files) are absent.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    precision = precision or full_precision(device)
    options = loader_options or eval_loader_options(num_workers, device)
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
            for x, lengths, labels, batch_positions, _ in batches:
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


def dataset_for_input(dataset: AudioDataset, input_kind: str) -> torch.utils.data.Dataset:
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


def embed_paths(
    model: LoadedEmbedder,
    paths: Sequence[str | Path],
    *,
    spans: np.ndarray | None = None,
    skip_bad: bool = False,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
    what: str = "the files",
) -> tuple[list[Path], np.ndarray, list[tuple[Path, str]]]:
    """(the files read, their embeddings float32 [n, D] in order, [(file, reason)] of the
    others) of audio (or .npy feature) files, read as evaluation reads them (`spans`: [N, 2]
    seconds of each file, NaN = the whole file). An unreadable file raises AudioReadError /
    FeatureFileError naming it, or with `skip_bad` is listed: after a failure the files are
    embedded one by one (ValueError when none can be read). NaN/inf embeddings raise a
    ValueError naming the first file, as `what` (e.g. "the query files")."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no files to embed")
    common = dict(batch_size=batch_size, device=model.device)
    try:
        dataset = _files_dataset(model, paths, spans)
        embeddings = embed_dataset(
            model.embed_fn, dataset, num_workers=num_workers, progress=progress, **common
        )[0]
        kept, skipped = paths, []
    except (AudioReadError, FeatureFileError) as exc:
        if not skip_bad:
            raise _reader_error(exc) from None
        kept, rows, skipped = [], [], []
        for i, path in enumerate(paths):  # one bad file does not cost the others
            try:
                span = None if spans is None else spans[i : i + 1]
                rows.append(
                    embed_dataset(model.embed_fn, _files_dataset(model, [path], span), **common)[0]
                )
                kept.append(path)
            except (AudioReadError, FeatureFileError) as exc:
                skipped.append((path, str(_reader_error(exc))))
        if not kept:
            raise ValueError(
                f"none of the {len(paths)} file(s) could be read; the first: {skipped[0][1]}"
            ) from None
        embeddings = np.concatenate(rows)
    check_finite(embeddings, [str(p) for p in kept], what)
    return kept, embeddings, skipped


def read_clips(model: LoadedEmbedder, paths: Sequence[str | Path]) -> list[torch.Tensor]:
    """Each file as `model` takes it, read as embed_paths reads it (the evaluation clip), one
    unpadded clip each, on the host (audioclf.inference.adapt moves them to the model's device
    a batch at a time). An unreadable file raises AudioReadError / FeatureFileError naming it."""
    dataset = _files_dataset(model, [Path(p) for p in paths], None)
    try:
        return [dataset[i][0] for i in range(len(dataset))]
    except (AudioReadError, FeatureFileError) as exc:
        raise _reader_error(exc) from None


def _files_dataset(model: LoadedEmbedder, paths: list[Path], spans) -> torch.utils.data.Dataset:
    """An evaluation-mode dataset of `paths` (label 0) giving what `model` takes."""
    labels = np.zeros(len(paths), np.int64)
    features, clips = model.features, model.cfg.clips
    audio = AudioDataset([str(p) for p in paths], labels, features, clips, train=False, spans=spans)
    return dataset_for_input(audio, model.input_kind)


def _reader_error(exc: Exception) -> Exception:
    """The reader's own message, which names the file: the dataset's speaks of index items and
    data.skip_bad_files, which loose files do not have."""
    cause = exc.__cause__ if isinstance(exc.__cause__, (AudioReadError, FeatureFileError)) else exc
    return type(cause)(str(cause))


def embed_waves(
    model: LoadedEmbedder, waves: Sequence[Any], sample_rate: int, *, batch_size: int = 32
) -> np.ndarray:
    """Embeddings [N, D] of in-memory audio: each a 1-D array of samples (or [channels,
    samples], mixed down) at `sample_rate`, resampled and cut to the evaluation clip as a file
    would be (AudioDataset.eval_clip)."""
    clips = [prepare_wave(model, wave, sample_rate) for wave in waves]
    return embed_clips(model, clips, batch_size=batch_size)


def prepare_wave(model: LoadedEmbedder, wave: Any, sample_rate: int) -> torch.Tensor:
    """One waveform as `model` takes it: mono, resampled, cut to the evaluation clip (its
    log-mel for an export without a front end); embed_clips embeds such clips together (a
    server prepares clips as they arrive)."""
    features = model.features
    if features.kind != "audio":
        raise ValueError("this model takes precomputed .npy features, not waveforms")
    clip = AudioDataset.eval_clip(
        _mono(wave, sample_rate, features.sample_rate), features, model.cfg.clips
    )
    return torch.from_numpy(log_mel(clip, features)) if model.input_kind == LOG_MEL else clip


def embed_clips(
    model: LoadedEmbedder, clips: Sequence[torch.Tensor], *, batch_size: int | None = None
) -> np.ndarray:
    """Embeddings [N, D] of clips from prepare_wave, in batches of `batch_size` (None: one
    batch of them all)."""
    if not clips:
        raise ValueError("no waveforms to embed")
    items = [(clip, 0, i) for i, clip in enumerate(clips)]
    size = batch_size or len(items)
    embeddings = embed_dataset(model.embed_fn, items, batch_size=size, device=model.device)[0]
    check_finite(embeddings, [f"waveform {i}" for i in range(len(items))], "the waveforms")
    return embeddings


def _mono(wave: Any, sample_rate: int, rate: int) -> torch.Tensor:
    """A waveform as float32 mono samples at `rate`."""
    wave = torch.as_tensor(np.asarray(wave, dtype=np.float32))
    if wave.ndim == 2:
        wave = wave.mean(dim=0)
    if wave.ndim != 1 or wave.numel() == 0:
        raise ValueError(
            f"a waveform must be 1-D samples (or [channels, samples]), got shape {tuple(wave.shape)}"
        )
    if sample_rate != rate:
        wave = torchaudio.functional.resample(wave, int(sample_rate), rate)
    return wave


def find_files(inputs: list[str | Path], features: FeaturesConfig) -> list[Path]:
    """The files to embed: named files as given, folders searched recursively (sorted) for
    audio (every suffix libsndfile reads) or .npy features, as the model takes."""
    audio = features.kind == "audio"
    wanted = AUDIO_SUFFIXES if audio else FEATURE_SUFFIXES
    other = FEATURE_SUFFIXES if audio else AUDIO_SUFFIXES
    what = "audio" if audio else ".npy log-mel features (features.kind=npy)"
    files: list[Path] = []
    skipped = 0
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            files += [p for p in found if p.suffix.lower() in wanted]
            skipped += sum(p.suffix.lower() in other for p in found)
        elif path.is_file():
            if path.suffix.lower() in other:
                raise ValueError(f"{path}: the model takes {what}, not {path.suffix} files")
            files.append(path)
        else:
            raise ValueError(f"{path} does not exist")
    if not files:
        raise ValueError(_nothing_found(inputs, audio, skipped, what))
    return files


def _nothing_found(inputs: list, audio: bool, skipped: int, what: str) -> str:
    shown = " / ".join(SHOWN_AUDIO_SUFFIXES if audio else FEATURE_SUFFIXES)
    also = " (nor any other audio format libsndfile reads)" if audio else ""
    other = "/".join(FEATURE_SUFFIXES) if audio else "audio"
    hint = f" (found {skipped} {other} file(s), but the model takes {what})" if skipped else ""
    return f"no {shown} files found in {', '.join(map(str, inputs))}{also}{hint}"


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
