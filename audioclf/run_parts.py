"""A run's parts, built from its Config: the seeds, the data, the train loader, the
training objects (the wrapped model, the objective, optimizer, LR schedule, the step that uses
them, the EMA of the weights), and the final-epochs schedule. The Trainer assembles them; this
module holds no state of its own."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from audioclf import checkpoint, distributed
from audioclf.averaging import WeightEMA
from audioclf.config import Config, to_dict
from audioclf.data.augment import Augmenter
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index, split_index
from audioclf.data.loader import TrainLoader, loader_kwargs
from audioclf.losses import WeightedLosses, build_loss, final_epochs_start
from audioclf.models import count_parameters
from audioclf.optim import LRSchedule, OptimizerState, base_lr, build_optimizer, param_groups
from audioclf.precision import Precision
from audioclf.sampler import MPerClassSampler
from audioclf.step import NonFiniteGuard, TrainStep

log = logging.getLogger("audioclf")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


@dataclass
class RunData:
    train: Index
    val: Index | None
    train_set: AudioDataset
    val_set: AudioDataset | None


def build_data(cfg: Config) -> RunData:
    """The index (rank 0 reads it first and builds its cache; the others then read the cache)
    and the train / validation datasets. Collective when distributed."""
    index = distributed.primary_first(load_index, cfg.data)
    splits = split_index(index, cfg.data)
    train, val = splits["train"], splits.get(cfg.eval.split)
    if len(train) == 0:
        raise ValueError(
            f"{index.source}: the train split is empty; check data.split_column / data.val_ratio"
        )
    augment = Augmenter(cfg.augment, cfg.features, cfg.clips.crop_samples(cfg.features))
    train_set = AudioDataset.from_index(train, cfg, train=True, augment=augment)
    if val is None or len(val) < 2:
        return RunData(train, None, train_set, None)
    return RunData(train, val, train_set, AudioDataset.from_index(val, cfg, train=False))


def loader_options(cfg: Config, device: torch.device) -> dict:
    """DataLoader settings of the run (train and validation loaders)."""
    return loader_kwargs(
        cfg.data.num_workers,
        cfg.data.pin_memory,
        cfg.data.persistent_workers,
        cfg.data.prefetch_factor,
        device,
    )


@dataclass(frozen=True)
class FinalEpochs:
    """train.final_epochs (WeSpeaker's large-margin fine-tuning): from epoch `start` (0-based) on,
    training crops of `final_crop` samples (clips.final_crop_seconds) and the final margins
    (losses.build_loss). `start` is train.epochs when it is off."""

    start: int
    crop: int  # samples of a training crop before (clips.crop_seconds)
    final_crop: int

    @classmethod
    def of(cls, cfg: Config) -> FinalEpochs:
        crop = cfg.clips.crop_samples(cfg.features)
        final = cfg.clips.final_crop_seconds
        start = final_epochs_start(cfg)
        return cls(
            cfg.train.epochs if start is None else start,
            crop,
            crop if final is None or start is None else cfg.features.samples(final),
        )

    @property
    def changes_crop(self) -> bool:
        return self.final_crop != self.crop

    def crop_samples(self, epoch: int) -> int:
        return self.final_crop if epoch >= self.start else self.crop


def describe_final_epochs(cfg: Config) -> str:
    """What changes at the start of the final epochs, for train.log."""
    loss, clips, epochs = cfg.loss, cfg.clips, cfg.train.epochs
    changes = []
    if clips.final_crop_seconds is not None:
        changes.append(
            f"training crops of {clips.final_crop_seconds:g} s (clips.final_crop_seconds; "
            f"{clips.crop_seconds:g} s before)"
        )
    if loss.final_margin is not None:
        changes.append(f"triplet margin {loss.final_margin:g} (loss.final_margin; {loss.margin:g})")
    if loss.final_head_margin is not None and cfg.model.head not in ("none", "softmax"):
        changes.append(
            f"head margin {loss.final_head_margin:g} rad (loss.final_head_margin; "
            f"{loss.head_margin:g})"
        )
    final = cfg.train.final_epochs
    span = f"epoch {epochs}" if final == 1 else f"epochs {epochs - final + 1}-{epochs}"
    what = "; ".join(changes) or (
        "nothing changes: set clips.final_crop_seconds, loss.final_margin or loss.final_head_margin"
    )
    return f"train.final_epochs={final} ({span} of {epochs}): {what}"


def build_train_loader(cfg: Config, env: distributed.DistEnv, data: RunData) -> TrainLoader:
    """The m-per-class sampler of this rank over the train split, in a stateful loader (whose
    keys carry the crop length when the final epochs change it)."""
    train, final = data.train, FinalEpochs.of(cfg)
    sampler = MPerClassSampler(
        train.codes.class_codes,
        train.codes.item_codes,
        batch_size=cfg.sampler.batch_size,
        m=cfg.sampler.m,
        rank=env.rank,
        world_size=env.world_size,
        seed=cfg.train.seed,
        split=cfg.sampler.split,
        small_classes=cfg.sampler.small_classes,
    )
    return TrainLoader(
        data.train_set,
        sampler,
        seed=cfg.train.seed,
        limit_batches=cfg.train.limit_batches,
        restart_epoch=cfg.checkpoint.restart_epoch,
        crop_samples=final.crop_samples if final.changes_crop else None,
        **loader_options(cfg, env.device),
    )


@dataclass
class Training:
    """What a run trains with."""

    model: nn.Module  # the net, wrapped for the strategy (DDP, DataParallel) and on the device
    loss_fn: WeightedLosses
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    guard: NonFiniteGuard
    step: TrainStep
    ema: WeightEMA | None  # train.ema_decay


def build_training(
    cfg: Config, env: distributed.DistEnv, net: nn.Module, precision: Precision, data: RunData
) -> Training:
    """The wrapped model, the objective, optimizer, schedule, and the step that uses them."""
    log.info("model %s: %s trainable parameters", cfg.model.name, f"{count_parameters(net):,}")
    model = distributed.wrap(
        net,
        env,
        sync_bn=cfg.model.sync_bn,
        find_unused_parameters=cfg.dist.find_unused_parameters,
        autocast_dtype=precision.dtype,
    )
    loss_fn = build_loss(cfg)
    optimizer = build_optimizer(param_groups(net, cfg.optim), cfg.optim, env.device)
    schedule = LRSchedule(
        optimizer, cfg.optim, base_lr(cfg.optim, env.world_size), cfg.train.epochs
    )
    log.info(
        "effective lr %.4g = optim.lr %.4g × %.4g (%s scaling, %d ranks, reference %d); "
        "precision %s%s",
        schedule.base,
        cfg.optim.lr,
        schedule.base / cfg.optim.lr,
        cfg.optim.lr_scaling,
        env.world_size,
        cfg.optim.ref_world_size,
        precision.name,
        f" ({precision.reason})" if precision.reason else "",
    )

    def objective(output, labels: torch.Tensor) -> torch.Tensor:
        embeddings, logits = output
        return loss_fn(embeddings, labels, logits)

    guard = NonFiniteGuard(cfg.train.nonfinite_patience)
    step = TrainStep(
        model,
        optimizer,
        precision,
        objective,
        guard=guard,
        accumulate=cfg.train.accumulate,
        max_grad_norm=cfg.optim.max_grad_norm,
        batch_size=cfg.sampler.batch_size,
        placeholder=data.train_set.placeholder(),
    )
    return Training(model, loss_fn, optimizer, schedule, guard, step, build_ema(cfg, model))


def build_ema(cfg: Config, model: nn.Module) -> WeightEMA | None:
    """The EMA of the (wrapped, on its device) model's weights, or None (train.ema_decay=0)."""
    if not cfg.train.ema_decay:
        return None
    log.info(
        'train.ema_decay=%g: an EMA of the weights is kept (checkpoint entry "ema"); '
        "validation, best.pt and the model artefacts use it",
        cfg.train.ema_decay,
    )
    return WeightEMA(distributed.unwrap(model), cfg.train.ema_decay)


def build_checkpointer(
    cfg: Config,
    env: distributed.DistEnv,
    run_dir: Path,
    training: Training,
    precision: Precision,
    train_loader: TrainLoader,
    train_state: checkpoint.Stateful,
    *,
    classes: list[str],
) -> checkpoint.Checkpointer:
    """The run's stateful parts, by name, in one Checkpointer (with "ema" when kept)."""
    keep, average = cfg.checkpoint.keep_last, cfg.checkpoint.average_last
    saver = checkpoint.CheckpointSaver(run_dir, keep_last=keep, average_last=average)
    if average > keep:
        log.info(
            "checkpoint.average_last=%d: the last %d epoch checkpoints are kept "
            "(checkpoint.keep_last=%d)",
            average,
            average,
            keep,
        )
    states = {
        "model": distributed.unwrap(training.model),
        "optimizer": OptimizerState(training.optimizer),
        "lr_schedule": training.schedule,
        "scaler": checkpoint.ScalerState(precision.scaler),
        "sampler": train_loader,  # the sampler's state at the loader's position
        "rng": checkpoint.RankRNG(env.rank, env.world_size, env.device),
    }
    if training.ema is not None:  # after "model": a checkpoint without one starts from it
        states["ema"] = training.ema
    return checkpoint.Checkpointer(
        saver,
        states=states,
        optional=("ema",),
        flat=[train_state, saver],
        meta=lambda: {
            "config": to_dict(cfg),
            "classes": classes,
            "position": train_loader.position,
            "world_size": env.world_size,
            "versions": checkpoint.library_versions(),
        },
        primary=env.is_primary,
    )
