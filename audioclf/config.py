"""Typed run configuration: YAML file + dotted command-line overrides.

Every section is a dataclass; each field carries a one-line comment. Unknown keys and wrong
types are rejected with one message naming the key and listing the valid keys of its section.

    cfg = load_config("configs/demo_cnn.yaml", ["train.epochs=3", "sampler.m=4"])
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key and the fix."""


@dataclass
class DataConfig:
    index: str = "data/demo/index.xlsx"  # index sheet: .xlsx, .csv or .parquet
    root: str = ""  # folder that relative paths are resolved against; "" = the index's folder
    sheet: int | str = 0  # Excel sheet name or position
    header_row: int | None = None  # sheet row (1-based) holding the column names; null = the first of the first 20 rows that holds the class, item and id columns
    class_column: str = "a_cls"  # column holding the class label
    item_column: str = "a_item"  # column holding the source/recording inside a class
    id_column: str = "a_id"  # column holding the unique sample id
    path_column: str = "path"  # column holding each sample's file path (used when present)
    path_template: str = ""  # e.g. "features/{a_id}.npy"; used when the path column is absent
    split_column: str = "split"  # optional column with train/val/test per row
    check_files: bool = True  # fail early when referenced files do not exist
    cache: bool = True  # cache the validated index next to it (parsed once, re-read in ms)
    cache_dir: str = ""  # "" = <index folder>/.audioclf_cache
    val_ratio: float = 0.2  # share of classes (or items) held out when no split column
    holdout: Literal["classes", "items"] = "classes"  # open-set (whole classes) or closed-set split
    seed: int = 0  # seed of the generated split
    skip_bad_files: bool = False  # skip unreadable files (counted, reported) instead of failing
    num_workers: int = 2  # DataLoader worker processes per rank
    pin_memory: bool = True  # pin host memory (only takes effect on CUDA)
    persistent_workers: bool = True  # keep workers alive between epochs
    prefetch_factor: int = 2  # batches prefetched per worker

    def __post_init__(self) -> None:
        _check(self.header_row is None or self.header_row >= 1, "data.header_row",
               self.header_row, "a row number >= 1, or null to find the header row")
        _check(0.0 <= self.val_ratio < 1.0, "data.val_ratio", self.val_ratio, "a number in [0, 1)")
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, "0 or more")
        _check(self.prefetch_factor >= 1, "data.prefetch_factor", self.prefetch_factor, ">= 1")


@dataclass
class SamplerConfig:
    batch_size: int = 32  # samples per batch on each rank
    m: int = 4  # items per class in a batch (one id per item); batch_size / m classes per batch
    split: Literal["classes", "batches"] = "classes"  # divide classes or batches between ranks
    small_classes: Literal["replace", "skip"] = "replace"  # classes with < m items: repeat items or drop

    def __post_init__(self) -> None:
        _check(self.m >= 2, "sampler.m", self.m, ">= 2 (triplet loss needs positives)")
        _check(
            self.batch_size % self.m == 0,
            "sampler.batch_size",
            self.batch_size,
            f"a multiple of sampler.m={self.m}",
        )


@dataclass
class FeaturesConfig:
    """How audio becomes the model's log-mel input: the settings the model's tensors depend on
    (with `model`, what a checkpoint's architecture is; resume and export compare these)."""

    kind: Literal["audio", "npy"] = "audio"  # raw audio files or precomputed log-mel .npy files
    sample_rate: int = 16000  # audio is resampled to this rate
    n_fft: int = 512  # FFT size of the log-mel front end
    win_length: int = 400  # window length in samples
    hop_length: int = 160  # hop in samples (one feature frame)
    n_mels: int = 64  # mel bins (= bins of precomputed features)
    f_min: float = 20.0  # lowest mel frequency in Hz
    f_max: float | None = None  # highest mel frequency; None = sample_rate / 2
    norm: Literal["utterance", "utterance_bin", "none"] = "utterance"  # per-utterance mean/var over all bins, per bin (CMVN), or none

    def __post_init__(self) -> None:
        _check(self.sample_rate > 0, "features.sample_rate", self.sample_rate, "> 0")
        _check(self.hop_length > 0, "features.hop_length", self.hop_length, "> 0")
        _check(self.n_mels > 0, "features.n_mels", self.n_mels, "> 0")

    def samples(self, seconds: float) -> int:
        """Samples in `seconds` of audio at features.sample_rate."""
        return int(round(seconds * self.sample_rate))

    def frames(self, samples: int) -> int:
        """Centred log-mel frames of a clip of `samples` samples (torchaudio's center=True)."""
        return max(1, samples // self.hop_length + 1)

    def valid_frames(self, samples: int) -> int:
        """Frames whose window ends inside a clip of `samples` samples: what the front end
        counts as valid (models.frontend.LogMel), and what a precomputed .npy file holds."""
        return max(1, (samples - self.n_fft // 2) // self.hop_length + 1)


@dataclass
class ClipsConfig:
    """Which part of each file is read: training crops and evaluation clips."""

    crop_seconds: float = 2.0  # training crop length
    pad_mode: Literal["repeat", "zeros"] = "repeat"  # how clips shorter than the crop are filled
    eval_crop: Literal["full", "center"] = "full"  # evaluation: whole clip or a centred crop
    eval_max_seconds: float = 30.0  # evaluation clips are cut (centred) to at most this length
    npy_layout: Literal["frames_bins", "bins_frames"] = "frames_bins"  # axis order of .npy files

    def __post_init__(self) -> None:
        _check(self.crop_seconds > 0, "clips.crop_seconds", self.crop_seconds, "> 0")
        _check(self.eval_max_seconds > 0, "clips.eval_max_seconds", self.eval_max_seconds, "> 0")

    def crop_samples(self, features: FeaturesConfig) -> int:
        return features.samples(self.crop_seconds)

    def crop_frames(self, features: FeaturesConfig) -> int:
        """Frames of a training crop of precomputed features."""
        return features.frames(self.crop_samples(features))

    def eval_max_frames(self, features: FeaturesConfig) -> int:
        """Longest evaluation clip of precomputed features, in frames."""
        return features.frames(features.samples(self.eval_max_seconds))


@dataclass
class SpecAugmentConfig:
    enabled: bool = True  # SpecAugment masks in the front end, training mode only
    freq_mask: int = 8  # widest frequency mask in bins
    time_mask: int = 20  # widest time mask in frames
    num_masks: int = 2  # masks of each kind per example

    def __post_init__(self) -> None:
        for key in ("freq_mask", "time_mask", "num_masks"):
            _check(getattr(self, key) >= 0, f"spec_augment.{key}", getattr(self, key), ">= 0")


@dataclass
class AugmentConfig:
    enabled: bool = False  # augment training crops: waveforms, or log-mel for features.kind=npy (EQ and gain only)
    speed_prob: float = 1.0  # share of clips speed-perturbed before the crop (tempo and pitch together, Kaldi/WeSpeaker style)
    speed_factors: tuple[float, ...] = (0.9, 1.0, 1.1)  # speed drawn uniformly from these; 1.1 = 10 % faster and higher, 1.0 = unchanged
    reverb_prob: float = 0.3  # share of crops convolved with a synthetic room impulse response
    reverb_rt60: tuple[float, float] = (0.2, 0.8)  # reverberation time range in seconds (time to decay by 60 dB)
    reverb_drr_db: tuple[float, float] = (0.0, 12.0)  # direct-to-reverberant energy ratio range in dB (lower = more reverberant)
    reverb_early_reflections: int = 4  # discrete echoes 2-40 ms after the direct sound; 0 = diffuse tail only
    eq_prob: float = 0.5  # share of crops coloured by a random smooth EQ curve (microphone / channel / synthesiser)
    eq_bands: int = 6  # control points of the EQ curve, log-spaced from 50 Hz to sample_rate / 2
    eq_gain_db: tuple[float, float] = (-6.0, 6.0)  # gain range of each control point in dB
    eq_tilt_db_per_octave: tuple[float, float] = (-1.0, 1.0)  # spectral tilt range (dB per octave, pivot 1 kHz), added to the curve
    noise_prob: float = 0.5  # share of crops with added noise
    noise_snr_db: tuple[float, float] = (5.0, 20.0)  # signal-to-noise ratio range in dB
    noise_colors: tuple[Literal["white", "pink", "brown"], ...] = ("white", "pink", "brown")  # generated noise colour, drawn uniformly
    noise_dir: str = ""  # folder of noise recordings (wav/flac/ogg, searched recursively); "" = generated noise only
    noise_file_prob: float = 0.5  # with noise_dir set: share of noisy crops using a random file segment instead of generated noise
    noise_cache_mb: int = 256  # decoded noise files kept per data-loader process (least recently used dropped first)
    gain_prob: float = 0.5  # share of crops with a random gain
    gain_db: tuple[float, float] = (-6.0, 6.0)  # gain range in dB

    def __post_init__(self) -> None:
        for name in ("speed_prob", "reverb_prob", "eq_prob", "noise_prob", "noise_file_prob", "gain_prob"):
            value = getattr(self, name)
            _check(0.0 <= value <= 1.0, f"augment.{name}", value, "a probability in [0, 1]")
        _check(
            len(self.speed_factors) >= 1 and all(0.5 <= f <= 2.0 for f in self.speed_factors),
            "augment.speed_factors", self.speed_factors, "a non-empty list of factors in [0.5, 2.0]",
        )
        self._check_range("reverb_rt60", self.reverb_rt60, 0.01, 5.0)
        self._check_range("reverb_drr_db", self.reverb_drr_db, -30.0, 60.0)
        self._check_range("eq_gain_db", self.eq_gain_db, -30.0, 30.0)
        self._check_range("eq_tilt_db_per_octave", self.eq_tilt_db_per_octave, -6.0, 6.0)
        self._check_range("noise_snr_db", self.noise_snr_db, -30.0, 100.0)
        self._check_range("gain_db", self.gain_db, -60.0, 60.0)
        _check(self.reverb_early_reflections >= 0, "augment.reverb_early_reflections",
               self.reverb_early_reflections, ">= 0")
        _check(self.eq_bands >= 2, "augment.eq_bands", self.eq_bands, ">= 2")
        _check(len(self.noise_colors) >= 1, "augment.noise_colors", self.noise_colors,
               "a non-empty list of 'white', 'pink', 'brown' (for files only, set noise_file_prob=1)")
        _check(self.noise_cache_mb >= 0, "augment.noise_cache_mb", self.noise_cache_mb, ">= 0")

    @staticmethod
    def _check_range(name: str, value: Any, lowest: float, highest: float) -> None:
        ok = len(value) == 2 and lowest <= value[0] <= value[1] <= highest
        _check(ok, f"augment.{name}", value, f"[low, high] with {lowest} <= low <= high <= {highest}")


@dataclass
class CNNConfig:
    width: int = 32  # channels of the first block; doubled every block
    depth: int = 4  # number of conv blocks (each: 2 conv3x3 + BN + ReLU, then 2x2 pooling)
    dropout: float = 0.1  # dropout before the embedding layer
    pooling: Literal["mean_max", "attentive_stats"] = "mean_max"  # over time: masked mean + max (PANNs) or attentive mean + std

    def __post_init__(self) -> None:
        _check(self.width >= 1, "model.cnn.width", self.width, ">= 1")
        _check(self.depth >= 1, "model.cnn.depth", self.depth, ">= 1")


@dataclass
class ResNetConfig:
    width: int = 32  # channels of the first stage; doubled in each later stage (32 = WeSpeaker's ResNet-34)
    blocks: list[int] = field(default_factory=lambda: [3, 4, 6, 3])  # BasicBlocks per stage; stages after the first stride 2 in time and frequency
    pooling: Literal["stats", "attentive_stats"] = "stats"  # over time, frequency flattened into channels: masked mean + std, or attentive mean + std

    def __post_init__(self) -> None:
        _check(self.width >= 1, "model.resnet.width", self.width, ">= 1")
        _check(len(self.blocks) >= 1 and all(b >= 1 for b in self.blocks), "model.resnet.blocks",
               self.blocks, "a non-empty list of block counts >= 1, e.g. [3, 4, 6, 3]")


@dataclass
class ConformerConfig:
    d_model: int = 144  # attention width
    num_heads: int = 4  # attention heads
    ffn_dim: int = 576  # feed-forward hidden size
    num_layers: int = 4  # Conformer blocks
    kernel_size: int = 31  # depthwise convolution kernel
    dropout: float = 0.1  # dropout inside the blocks
    pooling: Literal["attentive_stats", "mean"] = "attentive_stats"  # masked pooling over time

    def __post_init__(self) -> None:
        _check(
            self.d_model % self.num_heads == 0,
            "model.conformer.d_model",
            self.d_model,
            f"a multiple of model.conformer.num_heads={self.num_heads}",
        )
        _check(self.kernel_size % 2 == 1, "model.conformer.kernel_size", self.kernel_size, "odd")


@dataclass
class ModelConfig:
    name: Literal["cnn", "conformer", "resnet"] = "cnn"  # embedding network
    embedding_dim: int = 128  # size of the L2-normalised embedding
    head: Literal["none", "softmax", "arcface", "subcenter_arcface"] = "none"  # classifier head over the training classes beside the triplets, trained by cross-entropy weighted by loss.ce_weight: cosine softmax; arcface adds an angular margin to the target; subcenter_arcface also gives each class model.subcenters weights
    head_scale: float | None = None  # logit scale s of the head; null = 16 for softmax, 30 for the arcface heads
    subcenters: int = 3  # sub-centers per class (subcenter_arcface): a class's cosine is the largest of its K
    sync_bn: bool = True  # SyncBatchNorm under multi-GPU DDP (plain BatchNorm on CPU)
    init_from: str = ""  # fine-tune: start a new run from this checkpoint's or state_dict export's weights
    cnn: CNNConfig = field(default_factory=CNNConfig)  # settings of model.name=cnn
    conformer: ConformerConfig = field(default_factory=ConformerConfig)  # settings of conformer
    resnet: ResNetConfig = field(default_factory=ResNetConfig)  # settings of model.name=resnet

    def __post_init__(self) -> None:
        _check(self.embedding_dim >= 1, "model.embedding_dim", self.embedding_dim, ">= 1")
        _check(self.head_scale is None or self.head_scale > 0, "model.head_scale",
               self.head_scale, "> 0, or null for the head's default")
        _check(self.subcenters >= 1, "model.subcenters", self.subcenters, ">= 1")

    @property
    def effective_head_scale(self) -> float:
        """The head's logit scale: model.head_scale, or the head's default when it is null."""
        if self.head_scale is not None:
            return self.head_scale
        return 16.0 if self.head == "softmax" else 30.0

    @property
    def head_subcenters(self) -> int:
        """Weight vectors per class in the head (model.subcenters for subcenter_arcface, else 1)."""
        return self.subcenters if self.head == "subcenter_arcface" else 1


@dataclass
class LossConfig:
    margin: float = 0.2  # triplet margin (cosine distance)
    miner: Literal["batch_hard", "semi_hard", "all"] = "semi_hard"  # which triplets are used
    cross_rank: bool = False  # mine negatives from the global batch gathered from every rank
    ce_weight: float = 1.0  # weight of the head's cross-entropy term beside the triplet term (model.head)
    head_margin: float = 0.2  # additive angular margin m of the arcface heads, in radians: target logit s·cos(θ + m)
    margin_warmup_epochs: int = 0  # ramp loss.margin and loss.head_margin linearly up to their values at this epoch (from 1/(N+1) of them at the first); 0 = full at once

    def __post_init__(self) -> None:
        _check(self.margin >= 0, "loss.margin", self.margin, ">= 0")
        _check(self.ce_weight >= 0, "loss.ce_weight", self.ce_weight, ">= 0")
        _check(self.head_margin >= 0, "loss.head_margin", self.head_margin, ">= 0 (radians)")
        _check(self.margin_warmup_epochs >= 0, "loss.margin_warmup_epochs",
               self.margin_warmup_epochs, ">= 0")


@dataclass
class OptimConfig:
    name: Literal["adamw", "adam", "sgd", "fused_adam"] = "adamw"  # fused_adam needs NVIDIA apex
    lr: float = 1e-3  # reference learning rate at ref_world_size ranks
    ref_world_size: int = 1  # world size that lr was tuned for
    lr_scaling: Literal["sqrt", "linear", "none"] = "sqrt"  # effective lr = lr * scale(world/ref)
    weight_decay: float = 1e-4  # decoupled (adamw) or L2 (adam, sgd) weight decay
    momentum: float = 0.9  # sgd momentum
    warmup_steps: int = 0  # linear warm-up from 0 over this many optimizer steps
    scheduler: Literal["cosine", "step", "plateau", "none"] = "cosine"  # per-epoch schedule
    step_size: int = 10  # epochs between decays (scheduler=step)
    gamma: float = 0.1  # decay factor (step, plateau)
    plateau_patience: int = 3  # epochs without improvement before decaying (plateau)
    min_lr: float = 0.0  # floor of cosine and plateau schedules
    max_grad_norm: float = 0.0  # clip gradients to this norm; 0 = off
    freeze_epochs: int = 0  # first train only the embedding layer (and head) for this many epochs

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "> 0")
        _check(self.ref_world_size >= 1, "optim.ref_world_size", self.ref_world_size, ">= 1")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.freeze_epochs >= 0, "optim.freeze_epochs", self.freeze_epochs, ">= 0")


@dataclass
class TrainConfig:
    name: str = "demo"  # run name: outputs go to <runs_dir>/<name>/
    runs_dir: str = "runs"  # parent folder of run directories
    epochs: int = 10  # epochs to train
    limit_batches: int = 0  # stop each epoch after this many batches; 0 = full epoch
    accumulate: int = 1  # micro-batches per optimizer step (gradient accumulation)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # autocast dtype (fp16 uses GradScaler)
    opt_level: Literal["O0", "O1", "O2", "O3"] | None = None  # apex alias; overrides precision
    seed: int = 0  # seed for python, numpy, torch and the sampler
    deterministic: bool = False  # torch deterministic algorithms (slower)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda when available
    tf32: bool = True  # TF32 matmuls and convolutions on Ampere+ GPUs (fp32 runs ~2-3x faster)
    cudnn_benchmark: bool = True  # let cuDNN pick the fastest kernels (crops have fixed shapes)
    nonfinite_patience: int = 10  # consecutive non-finite losses before training stops
    consistency_every_steps: int = 0  # also check ranks' parameters every K steps; 0 = per epoch
    consistency_action: Literal["error", "warn"] = "error"  # on drifting parameters
    log_every_steps: int = 50  # steps between host syncs (progress-bar loss, TensorBoard, non-finite check, stop vote); 0 = every step

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "train.epochs", self.epochs, ">= 1")
        _check(self.accumulate >= 1, "train.accumulate", self.accumulate, ">= 1")
        _check(self.limit_batches >= 0, "train.limit_batches", self.limit_batches, ">= 0")
        _check(bool(self.name.strip()) and "/" not in self.name, "train.name", self.name,
               "a non-empty name without '/'")


@dataclass
class DistConfig:
    strategy: Literal["auto", "ddp", "dp", "single"] = "auto"  # auto = ddp when WORLD_SIZE > 1
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto = nccl on CUDA, gloo on CPU
    timeout_minutes: float = 30.0  # collective timeout; must cover rank-0 evaluation
    find_unused_parameters: bool = False  # DDP flag for models with conditional branches


@dataclass
class EvalConfig:
    every: int = 1  # evaluate every N epochs; 0 = never during training
    distributed: bool = False  # shard embedding extraction across ranks (else rank 0 alone)
    batch_size: int = 32  # clips per extraction batch
    metric: Literal["precision_at_1", "map_at_r", "r_precision"] = "map_at_r"  # selects best.pt (cross-item)
    split: str = "val"  # split evaluated during training
    max_samples: int = 0  # validate on a fixed class-stratified subset of this size; 0 = all

    def __post_init__(self) -> None:
        _check(self.max_samples >= 0, "eval.max_samples", self.max_samples, ">= 0 (0 = all)")
        _check(self.batch_size >= 1, "eval.batch_size", self.batch_size, ">= 1")


@dataclass
class CheckpointConfig:
    keep_last: int = 2  # epoch checkpoints kept besides last.pt and best.pt
    every_steps: int = 0  # also write last.pt every N steps inside an epoch; 0 = off
    resume: str = ""  # "" = fresh start, "auto" = <run dir>/last.pt if present, or a path
    resume_strict: bool = True  # refuse to resume with other model / features settings than the checkpoint's
    restart_epoch: bool = False  # resume a mid-epoch checkpoint from the start of its epoch (e.g. on another world size)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)  # index sheet and loading
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # m-per-class batches
    features: FeaturesConfig = field(default_factory=FeaturesConfig)  # audio → log-mel (part of the architecture)
    clips: ClipsConfig = field(default_factory=ClipsConfig)  # training crops and evaluation clips
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)  # SpecAugment masks in the front end
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # waveform / feature augmentation (training only)
    model: ModelConfig = field(default_factory=ModelConfig)  # embedding network and its head (the architecture)
    loss: LossConfig = field(default_factory=LossConfig)  # triplet loss, mining, the head's weight
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer and LR schedule
    train: TrainConfig = field(default_factory=TrainConfig)  # loop, precision, seeds
    dist: DistConfig = field(default_factory=DistConfig)  # multi-process settings
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation during training
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saving, resume

    def __post_init__(self) -> None:
        _check(self.model.head == "none" or self.loss.ce_weight > 0, "loss.ce_weight",
               self.loss.ce_weight, f"> 0 with model.head={self.model.head} (its cross-entropy "
               "weight; e.g. 1.0), or set model.head=none")


def architecture(cfg: Config) -> dict:
    """What a checkpoint's tensors depend on: the model (with its head) and the features.

    Resume compatibility, build_net and the export sidecar all read these two objects; crops,
    evaluation clips, SpecAugment and the loss weights may change between runs of one model.
    """
    model = {k: v for k, v in to_dict(cfg.model).items() if k != "init_from"}
    return {"model": model, "features": to_dict(cfg.features)}


def choices(cls: type, name: str) -> tuple:
    """The allowed values of a Literal field: the one home of that rule for other modules."""
    return typing.get_args(typing.get_type_hints(cls)[name])


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key}={value!r} is invalid: expected {expected}")


# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"config section {where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]} in section {where}; "
            f"valid keys: {', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - all fields have defaults
        raise ConfigError(f"{prefix.rstrip('.')}: {exc}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value if value is not None else {}, key + ".")
    if origin in (Union, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(option, value, key)
            except ConfigError:
                continue  # try the next type of the union
        expected = " or ".join(_type_name(a) for a in typing.get_args(hint))
        raise ConfigError(f"config key {key}={value!r} has the wrong type: expected {expected}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(
                f"config key {key}={value!r} is not a valid choice: use one of "
                + ", ".join(repr(c) for c in choices)
            )
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads 5e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"config key {key}={value!r} is invalid: expected a finite number")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            (item_hint, *_) = typing.get_args(hint) or (Any,)
            items = [_coerce(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
            return origin(items)
    elif hint is Any:
        return value
    raise ConfigError(
        f"config key {key}={value!r} has the wrong type: expected {_type_name(hint)}, "
        f"got {type(value).__name__}"
    )


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (what is written to config.yaml and checkpoints)."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# Keys of earlier releases

# (old section, old key) -> (new section, new key). Old config files, overrides and the configs
# stored in older checkpoints are read through `migrate`.
MOVED_KEYS = {
    **{("features", key): ("clips", key)
       for key in ("crop_seconds", "pad_mode", "eval_crop", "eval_max_seconds", "npy_layout")},
    ("features", "spec_augment"): ("spec_augment", "enabled"),
    **{("features", key): ("spec_augment", key) for key in ("freq_mask", "time_mask", "num_masks")},
    **{("loss", key): ("model", key) for key in ("head_scale", "subcenters")},
}


def migrate(data: dict) -> tuple[dict, list[str]]:
    """A config dict in the current layout, and a note per key it moved.

    Before 0.2 the head's kind was loss.head and a head existed only while loss.ce_weight > 0;
    such dicts keep that meaning: model.head is loss.head (default softmax) when ce_weight > 0,
    else none. A loss.ce_weight > 0 without any head key is read the same way.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    loss = out.get("loss") if isinstance(out.get("loss"), dict) else {}
    model = out.get("model") if isinstance(out.get("model"), dict) else {}
    notes = []
    if "head" not in model and ("head" in loss or loss.get("ce_weight", 0)):
        weight = loss.get("ce_weight", 0)
        head = loss.pop("head", "softmax") if weight else "none"
        loss.pop("head", None)
        out.setdefault("model", model)["head"] = head
        if not weight:
            loss.pop("ce_weight", None)  # no head: the weight of nothing
        notes.append(f"loss.head / loss.ce_weight={weight} -> model.head={head}")
    for (section, key), (new_section, new_key) in MOVED_KEYS.items():
        old = out.get(section)
        if isinstance(old, dict) and key in old:
            value = old.pop(key)
            target = out.setdefault(new_section, {})
            if isinstance(target, dict):
                target.setdefault(new_key, value)
            notes.append(f"{section}.{key} -> {new_section}.{new_key}")
    return out, notes


# ---------------------------------------------------------------------------------------------
# Loading


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ["train.epochs=3", "model.name=cnn"] into a nested dict; values are parsed as YAML."""
    nested: dict = {}
    for text in overrides:
        if "=" not in text:
            raise ConfigError(
                f"override {text!r} is not of the form section.key=value (e.g. train.epochs=3)"
            )
        dotted, raw = text.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"override {text!r} has an empty key; use section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
        node = nested
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r} conflicts with another override of {k}")
        node[keys[-1]] = value
    return nested


def merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults), apply dotted overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass --config configs/<name>.yaml")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    data, moved = migrate(merge(data, parse_overrides(overrides or [])))
    if moved:
        warnings.warn(f"{path or 'overrides'}: config keys of an earlier release were read as "
                      f"{'; '.join(moved)}; write them the new way", UserWarning, stacklevel=2)
    try:
        return from_dict(Config, data)
    except ConfigError as exc:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{exc}") from None


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from the dict stored in a checkpoint or config.yaml (older releases'
    layouts included)."""
    return from_dict(Config, migrate(data)[0])


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    from audioclf.fileio import atomic_write_bytes

    atomic_write_bytes(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())


# ---------------------------------------------------------------------------------------------
# Reference documentation (README's config table is generated from the field comments)


def reference_markdown() -> str:
    """A Markdown table of every config key, its default and its one-line comment."""
    import inspect
    import re

    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(cls: type, prefix: str) -> None:
        source = inspect.getsource(cls)
        comments = dict(re.findall(r"^\s+(\w+): .*?#\s*(.+)$", source, flags=re.M))
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
                continue
            shown = "null" if default is None else repr(default) if isinstance(default, str) else default
            meaning = comments.get(f.name, "").replace("<", "&lt;").replace("|", "\\|")
            rows.append(f"| `{prefix}{f.name}` | `{shown}` | {meaning} |")

    for section in dataclasses.fields(Config):
        walk(section.default_factory, f"{section.name}.")
    return "\n".join(rows)


README_START = "<!-- CONFIG-REFERENCE:START -->"
README_END = "<!-- CONFIG-REFERENCE:END -->"


def readme_with_reference(text: str) -> str:
    """README text with the block between the CONFIG-REFERENCE markers regenerated."""
    head, _, rest = text.partition(README_START)
    _, _, tail = rest.partition(README_END)
    return f"{head}{README_START}\n{reference_markdown()}\n{README_END}{tail}"


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--update-readme"]:
        readme = Path(sys.argv[2] if len(sys.argv) > 2 else "README.md")
        readme.write_text(readme_with_reference(readme.read_text()))
    else:
        print(reference_markdown())
