"""A run's parts, built from its Config: the seeds, the data, the train loader, and the
training objects (the wrapped model, the objective, optimizer, LR schedule, and the step that
uses them). The Trainer assembles them; this module holds no state of its own."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from audioclf import distributed
from audioclf.config import Config
from audioclf.data.augment import Augmenter
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index, split_index
from audioclf.data.loader import TrainLoader, loader_kwargs
from audioclf.losses import WeightedLosses, build_loss
from audioclf.models import count_parameters
from audioclf.optim import LRSchedule, base_lr, build_optimizer, param_groups
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


def build_train_loader(cfg: Config, env: distributed.DistEnv, data: RunData) -> TrainLoader:
    """The m-per-class sampler of this rank over the train split, in a stateful loader."""
    train = data.train
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
    return Training(model, loss_fn, optimizer, schedule, guard, step)
