"""Config sections of the model and the run: model, loss, optimizer, loop, ranks, evaluation,
checkpoints, and the whole Config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from audioclf.config.base import check as _check
from audioclf.config.inputs import (
    AugmentConfig,
    ClipsConfig,
    DataConfig,
    FeaturesConfig,
    SamplerConfig,
    SpecAugmentConfig,
)


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
class ECAPAConfig:
    channels: int = 512  # C of the TDNN and SE-Res2 blocks (the published 512 or 1024)
    scale: int = 8  # Res2Net scale: channel groups per block (divides channels)
    se_bottleneck: int = 128  # squeeze-excitation bottleneck
    attention_channels: int = 128  # hidden channels of the attentive statistics pooling
    mfa_channels: int = 0  # width of the multi-layer feature aggregation; 0 = 3 x channels (1536 at C = 512)

    def __post_init__(self) -> None:
        _check(self.scale >= 2 and self.channels % self.scale == 0, "model.ecapa.channels",
               self.channels, f"a multiple of model.ecapa.scale={self.scale} (scale >= 2)")
        _check(self.se_bottleneck >= 1 and self.attention_channels >= 1, "model.ecapa.se_bottleneck",
               self.se_bottleneck, ">= 1 (and attention_channels >= 1)")
        _check(self.mfa_channels >= 0, "model.ecapa.mfa_channels", self.mfa_channels, ">= 0")


@dataclass
class ModelConfig:
    name: Literal["cnn", "conformer", "resnet", "ecapa"] = "cnn"  # embedding network (ecapa: ECAPA-TDNN)
    embedding_dim: int = 128  # size of the L2-normalised embedding
    head: Literal["none", "softmax", "arcface", "subcenter_arcface"] = "none"  # classifier head over the training classes beside the triplets, trained by cross-entropy weighted by loss.ce_weight: cosine softmax; arcface adds an angular margin to the target; subcenter_arcface also gives each class model.subcenters weights
    head_scale: float | None = None  # logit scale s of the head; null = 16 for softmax, 30 for the arcface heads
    subcenters: int = 3  # sub-centers per class (subcenter_arcface): a class's cosine is the largest of its K
    sync_bn: bool = True  # SyncBatchNorm under multi-GPU DDP (plain BatchNorm on CPU)
    init_from: str = ""  # fine-tune: start a new run from this checkpoint's or state_dict export's weights
    early_norm: Literal["batch", "rfn", "subspectral"] = "batch"  # experimental: normalisation in the first early_norm_blocks blocks of model.name=cnn or resnet: BatchNorm; rfn = relaxed instance frequency-wise norm (rfn_lambda · per-bin instance norm + (1 - rfn_lambda) · layer norm, no running statistics); subspectral = BatchNorm per frequency sub-band; off: RFN and SubSpectral Norm measured on benchmarks/quality.py, both domains, did not close the other-source gap (RESULTS.md, "Domain generalisation (issue 36)")
    early_norm_blocks: int = 1  # experimental: blocks that use early_norm (CNN blocks, or the ResNet stem then its blocks) (RESULTS.md, "Domain generalisation (issue 36)")
    rfn_lambda: float = 0.5  # experimental: weight of the instance frequency-wise norm in rfn (1 = per-bin instance norm only, 0 = layer norm only) (RESULTS.md, "Domain generalisation (issue 36)")
    subspectral_groups: int = 4  # experimental: frequency sub-bands of subspectral (must divide the bins of each early block) (RESULTS.md, "Domain generalisation (issue 36)")
    cnn: CNNConfig = field(default_factory=CNNConfig)  # settings of model.name=cnn
    conformer: ConformerConfig = field(default_factory=ConformerConfig)  # settings of conformer
    resnet: ResNetConfig = field(default_factory=ResNetConfig)  # settings of model.name=resnet
    ecapa: ECAPAConfig = field(default_factory=ECAPAConfig)  # settings of model.name=ecapa

    def __post_init__(self) -> None:
        _check(self.embedding_dim >= 1, "model.embedding_dim", self.embedding_dim, ">= 1")
        _check(self.head_scale is None or self.head_scale > 0, "model.head_scale",
               self.head_scale, "> 0, or null for the head's default")
        _check(self.subcenters >= 1, "model.subcenters", self.subcenters, ">= 1")
        _check(self.early_norm_blocks >= 1, "model.early_norm_blocks", self.early_norm_blocks, ">= 1")
        _check(0.0 <= self.rfn_lambda <= 1.0, "model.rfn_lambda", self.rfn_lambda, "in [0, 1]")
        _check(self.subspectral_groups >= 1, "model.subspectral_groups", self.subspectral_groups, ">= 1")
        _check(self.early_norm == "batch" or self.name in ("cnn", "resnet"), "model.early_norm",
               self.early_norm, f"'batch' for model.name={self.name!r} (rfn and subspectral: cnn, resnet)")

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
    final_margin: float | None = None  # triplet margin in the last train.final_epochs epochs (large-margin fine-tuning); null = loss.margin
    final_head_margin: float | None = None  # the arcface heads' margin in those epochs; null = loss.head_margin
    memory_size: int = 0  # experimental: cross-batch memory, mine each batch also against the last N training embeddings (XBM; item-aware, the same on every rank); 0 = off. Off because on benchmarks/quality.py (cpu_small, memory 1024, two seeds) it cost a sounds column on both seeds (RESULTS.md, "Quality on real audio", 42eef68)
    memory_warmup_epochs: int = 1  # experimental: epochs of plain in-batch mining before the memory is filled and used (embeddings drift fast at first)

    def __post_init__(self) -> None:
        _check(self.margin >= 0, "loss.margin", self.margin, ">= 0")
        _check(self.ce_weight >= 0, "loss.ce_weight", self.ce_weight, ">= 0")
        _check(self.head_margin >= 0, "loss.head_margin", self.head_margin, ">= 0 (radians)")
        _check(self.margin_warmup_epochs >= 0, "loss.margin_warmup_epochs",
               self.margin_warmup_epochs, ">= 0")
        _check(self.memory_size >= 0, "loss.memory_size", self.memory_size, ">= 0 (0 = off)")
        _check(self.memory_warmup_epochs >= 0, "loss.memory_warmup_epochs",
               self.memory_warmup_epochs, ">= 0")


@dataclass
class UnlabelledConfig:
    share: float = 0.25  # with data.unlabelled: share of each batch's rows that are views of unlabelled clips (two crops of each clip); the labelled part keeps the rest, rounded down to whole classes of sampler.m
    views_weight: float = 1.0  # weight of the NT-Xent term over those views (two crops of a clip a positive pair, the other views of the step, every rank's, negatives) beside the triplet term
    temperature: float = 0.1  # NT-Xent temperature
    cluster_every: int = 0  # epochs between pseudo-label rounds (embed the unlabelled clips, cluster, add the confident clusters to the sampler as classes), the first at the start of training; 0 = none: measured on both domains, three seeds, they added nothing to the views (benchmarks/RESULTS.md); 2 turns them on
    cluster_threshold: float = 0.0  # a fixed cosine distance to cut at instead of cluster_cut (0 = off; runs before cluster_cut cut at 0.3, and their configs keep it)
    cluster_cut: float = 0.5  # agglomerative clustering (cosine, average linkage) stops merging clips at this fraction of the labelled classes' gap: the median cosine distance from a class's centroid to its nearest other class, measured each round with the current model on a fixed sample of training clips (up to 256 classes x sampler.m)
    min_cohesion: float = 0.7  # a cluster is confident when it has at least sampler.m clips and their mean cosine to its centroid is at least this
    max_cluster_share: float = 0.25  # ...and holds at most this share of the unlabelled clips (a cluster that swallows more is a model that cannot yet tell them apart, e.g. untrained)
    max_pseudo_classes: float = 1.0  # of the confident clusters, the largest become pseudo-classes, at most this many per labelled class: they join the class draw like labelled classes, and more of them than labelled classes drowns the labels (benchmarks/RESULTS.md)
    min_reference_p1: float = 0.8  # a round labels clips only once the model tells known classes apart: the nearest-neighbour accuracy (P@1) of the labelled reference sample is at least this (an untrained network's tight clusters are collapse, not classes)

    def __post_init__(self) -> None:
        _check(0.0 < self.share < 1.0, "unlabelled.share", self.share, "in (0, 1)")
        _check(self.views_weight >= 0, "unlabelled.views_weight", self.views_weight, ">= 0")
        _check(self.temperature > 0, "unlabelled.temperature", self.temperature, "> 0")
        _check(self.cluster_every >= 0, "unlabelled.cluster_every", self.cluster_every,
               ">= 0 (0 = no pseudo-labels)")
        _check(0.0 <= self.cluster_threshold < 2.0, "unlabelled.cluster_threshold",
               self.cluster_threshold, "a cosine distance in (0, 2), or 0 (cut at cluster_cut)")
        _check(0.0 < self.cluster_cut <= 2.0, "unlabelled.cluster_cut", self.cluster_cut,
               "a fraction of the labelled classes' gap in (0, 2]")
        _check(-1.0 <= self.min_cohesion <= 1.0, "unlabelled.min_cohesion", self.min_cohesion,
               "a cosine in [-1, 1]")
        _check(0.0 <= self.min_reference_p1 <= 1.0, "unlabelled.min_reference_p1",
               self.min_reference_p1, "in [0, 1] (0 = label from the first round)")
        _check(self.max_pseudo_classes > 0, "unlabelled.max_pseudo_classes",
               self.max_pseudo_classes, "> 0 (pseudo-classes per labelled class)")
        _check(0.0 < self.max_cluster_share <= 1.0, "unlabelled.max_cluster_share",
               self.max_cluster_share, "in (0, 1]")

    def batch_rows(self, batch_size: int, m: int) -> tuple[int, int]:
        """(labelled rows, unlabelled clips) of a batch of `batch_size` rows: each clip gives
        two views, the labelled rows are whole classes of `m`."""
        clips = round(self.share * batch_size / 2)
        labelled = batch_size - 2 * clips
        labelled -= labelled % m
        return labelled, (batch_size - labelled) // 2


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
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"  # autocast dtype (fp16 uses GradScaler); auto = bf16 on GPUs with native bf16, fp16 on older GPUs, fp32 on CPUs
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
    ema_decay: float = 0.0  # keep an exponential moving average of the weights (e.g. 0.999 per step, warmed up as min(decay, (1 + step) / (10 + step))), used for validation, best.pt and export; 0 = off
    tracker: Literal["none", "mlflow", "wandb"] = "none"  # also log params, epoch metrics and best.pt to an experiment tracker (rank 0): mlflow (MLFLOW_TRACKING_URI, else <run dir>/mlruns) or wandb (offline unless WANDB_MODE says otherwise); needs pip install mlflow-skinny / wandb
    tracker_required: bool = False  # with train.tracker: a tracker that cannot be reached or started stops the run before anything is written (one error line); false = one warning and training goes on without it
    compile: bool = False  # torch.compile the embedder for training (the first step compiles, minutes on a CPU, and is left out of samples/s; a batch size or crop length that changes compiles once more, that dimension then dynamic; train.log says each); not with dist.strategy=dp; validation, evaluate, embed and export run it eagerly, checkpoints are unchanged
    final_epochs: int = 0  # the last N epochs train with clips.final_crop_seconds and loss.final_margin / final_head_margin where set (WeSpeaker's large-margin fine-tuning; the margin warm-up applies before them); 0 = off

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "train.epochs", self.epochs, ">= 1")
        _check(self.accumulate >= 1, "train.accumulate", self.accumulate, ">= 1")
        _check(0.0 <= self.ema_decay < 1.0, "train.ema_decay", self.ema_decay,
               "in [0, 1), e.g. 0.999 (0 = off)")
        _check(0 <= self.final_epochs <= self.epochs, "train.final_epochs", self.final_epochs,
               f"between 0 and train.epochs={self.epochs}")
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
    average_last: int = 0  # after the last epoch, average the weights of the last N epochs (the EMA's with train.ema_decay; BatchNorm statistics averaged) into avg.pt, validated and eligible for best.pt; keeps at least N epoch checkpoints whatever keep_last says; 0 = off
    trust: bool = False  # load checkpoint.resume / model.init_from files holding more than tensors and plain data (their Python objects can run code): only files you trust

    def __post_init__(self) -> None:
        _check(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, ">= 0")
        _check(self.average_last >= 0, "checkpoint.average_last", self.average_last, ">= 0 (0 = off)")


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
    unlabelled: UnlabelledConfig = field(default_factory=UnlabelledConfig)  # how data.unlabelled is learnt from: batch share, NT-Xent views, cluster pseudo-labels
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer and LR schedule
    train: TrainConfig = field(default_factory=TrainConfig)  # loop, precision, seeds
    dist: DistConfig = field(default_factory=DistConfig)  # multi-process settings
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation during training
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saving, resume

    def __post_init__(self) -> None:
        _check(self.model.head == "none" or self.loss.ce_weight > 0, "loss.ce_weight",
               self.loss.ce_weight, f"> 0 with model.head={self.model.head} (its cross-entropy "
               "weight; e.g. 1.0), or set model.head=none")
        if self.data.unlabelled:
            self._check_unlabelled()
        _check(self.augment.mixstyle == 0.0 or self.model.name in ("cnn", "resnet"),
               "augment.mixstyle", self.augment.mixstyle, f"0 for model.name={self.model.name!r}: "
               "MixStyle acts inside model.name=cnn or resnet only (augment.freq_mixstyle works "
               "for all)")
        # DataParallel's replicas copy the module's __dict__, the compiled call with it, so every
        # replica would run the original's weights (a device mismatch on 2+ GPUs).
        _check(not (self.train.compile and self.dist.strategy == "dp"), "train.compile",
               self.train.compile, "false with dist.strategy=dp (DataParallel's replicas would "
               "all run the compiled original's weights): set train.compile=false, or compile "
               "under DDP (torchrun, dist.strategy=ddp or auto)")

    def _check_unlabelled(self) -> None:
        batch, m = self.sampler.batch_size, self.sampler.m
        labelled, clips = self.unlabelled.batch_rows(batch, m)
        _check(labelled >= 2 * m and clips >= 1, "unlabelled.share", self.unlabelled.share,
               f"a share of sampler.batch_size={batch} that leaves at least one unlabelled clip "
               f"(2 views) and two labelled classes of sampler.m={m}; it gives {labelled} "
               f"labelled rows and {clips} clips")
        _check(self.loss.memory_size == 0, "loss.memory_size", self.loss.memory_size,
               "0 with data.unlabelled (the cross-batch memory does not know unlabelled clips)")


def architecture(cfg: Config) -> dict:
    """What a checkpoint's tensors depend on: the model (with its head) and the features.

    Resume compatibility, build_net and the export sidecar all read these two objects; crops,
    evaluation clips, SpecAugment and the loss weights may change between runs of one model.
    """
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "init_from"}
    return {"model": model, "features": dataclasses.asdict(cfg.features)}
