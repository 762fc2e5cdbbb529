"""The training loop: precision, optimizer, LR schedule, train_one_epoch(), validate().

Precision is decided once (`Precision`): the loop always calls the same autocast context and
GradScaler, which are no-ops in fp32, so it has no precision branches. The loss is always
computed from the output of the (possibly DDP-wrapped) model passed in.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from audioclf import distributed
from audioclf.config import OptimConfig, TrainConfig

log = logging.getLogger("audioclf")


# ---------------------------------------------------------------------------------------------
# Precision


_AUTOCAST_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Precision:
    """The autocast context and GradScaler for one run (fp32: both are no-ops)."""

    name: str
    device: torch.device
    dtype: torch.dtype | None
    scaler: torch.amp.GradScaler

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> Precision:
    """precision: fp32 | fp16 | bf16; the apex alias opt_level O0..O3 overrides it."""
    name = cfg.precision
    if cfg.opt_level is not None:
        if cfg.opt_level in ("O2", "O3"):
            warnings.warn(
                f"train.opt_level={cfg.opt_level} (apex) has no torch.amp equivalent; using O1 "
                "(fp16 autocast with dynamic loss scaling). Set train.precision=bf16 on Ampere+ GPUs",
                stacklevel=2,
            )
        name = "fp32" if cfg.opt_level == "O0" else "fp16"
    scaler = torch.amp.GradScaler(device.type, enabled=(name == "fp16"))
    return Precision(name, device, _AUTOCAST_DTYPES[name], scaler)


# ---------------------------------------------------------------------------------------------
# Optimizer and learning rate


def lr_scale(world_size: int, ref_world_size: int, mode: str) -> float:
    """Factor applied to optim.lr: sqrt(world/ref), world/ref, or 1."""
    ratio = world_size / ref_world_size
    return {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[mode]


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig, lr: float,
                    device: torch.device) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.name == "adamw":
        fused = {"fused": True} if device.type == "cuda" else {}
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, **fused)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    try:
        from apex.optimizers import FusedAdam  # optional NVIDIA apex
    except ImportError:
        raise ValueError(
            "optim.name=fused_adam needs NVIDIA apex (apex.optimizers), which is not importable "
            "here; use optim.name=adamw (torch's AdamW runs fused on CUDA)"
        ) from None
    return FusedAdam(params, lr=lr, weight_decay=cfg.weight_decay, adam_w_mode=True)


class LRSchedule:
    """Linear warm-up per optimizer step × per-epoch decay (cosine, step or plateau).

    One object, so warm-up composes with every decay, and its state is two counters and the
    plateau bookkeeping (saved in checkpoints).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, base_lr: float,
                 epochs: int):
        self.optimizer = optimizer
        self.cfg = cfg
        self.base_lr = base_lr
        self.epochs = epochs
        self.step_count = 0
        self.epoch = 0
        self.plateau_factor = 1.0
        self.plateau_best = math.inf
        self.plateau_bad_epochs = 0
        self._apply()

    @property
    def lr(self) -> float:
        warm = 1.0
        if self.cfg.warmup_steps > 0:
            warm = min(1.0, (self.step_count + 1) / self.cfg.warmup_steps)
        return self.decayed_lr() * warm

    def decayed_lr(self) -> float:
        cfg, base = self.cfg, self.base_lr
        if cfg.scheduler == "cosine":
            progress = min(self.epoch / max(self.epochs, 1), 1.0)
            return cfg.min_lr + (base - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        if cfg.scheduler == "step":
            return base * cfg.gamma ** (self.epoch // cfg.step_size)
        if cfg.scheduler == "plateau":
            return max(base * self.plateau_factor, cfg.min_lr)
        return base

    def _apply(self) -> None:
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """After every optimizer step."""
        self.step_count += 1
        self._apply()

    def epoch_end(self, epoch_loss: float) -> None:
        """After every epoch, with the global (all-reduced) epoch loss for plateau."""
        self.epoch += 1
        if self.cfg.scheduler == "plateau" and np.isfinite(epoch_loss):
            if epoch_loss < self.plateau_best:
                self.plateau_best, self.plateau_bad_epochs = epoch_loss, 0
            else:
                self.plateau_bad_epochs += 1
                if self.plateau_bad_epochs > self.cfg.plateau_patience:
                    self.plateau_factor *= self.cfg.gamma
                    self.plateau_bad_epochs = 0
                    log.info("plateau: learning rate decayed to %.3g", self.decayed_lr())
        self._apply()

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in
                ("step_count", "epoch", "plateau_factor", "plateau_best", "plateau_bad_epochs")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._apply()


# ---------------------------------------------------------------------------------------------
# Training


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass
class NonFiniteGuard:
    """Counts skipped steps; stops training after `patience` consecutive ones."""

    patience: int
    consecutive: int = 0
    total: int = 0

    def update(self, finite: bool, step: int) -> None:
        if finite:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.patience:
            raise NonFiniteLossError(
                f"{self.consecutive} consecutive steps up to step {step} had a non-finite loss or "
                "gradient (train.nonfinite_patience); lower optim.lr, set optim.max_grad_norm, or "
                "use train.precision=bf16/fp32 instead of fp16"
            )


@dataclass
class EpochResult:
    loss: float  # global mean loss over the samples of finite steps
    samples: int  # global samples seen
    seconds: float
    steps: int  # optimizer steps taken on this rank in this epoch
    batches: int  # batches consumed (including a resumed epoch's first position)
    stopped: bool  # a stop was requested (signal) before the epoch ended

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def train_one_epoch(
    model: nn.Module,
    loader: Iterable,
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    *,
    schedule: LRSchedule | None = None,
    accumulate: int = 1,
    max_grad_norm: float = 0.0,
    guard: NonFiniteGuard | None = None,
    start_batch: int = 0,
    limit_batches: int = 0,
    global_step: int = 0,
    on_step: Callable[[int, int], bool] | None = None,
    progress: bool = False,
    description: str = "train",
) -> EpochResult:
    """One pass over `loader`; returns the exact global mean loss.

    Each batch is (x, lengths, labels, positions). `loss_fn(model_output, labels)` returns
    (loss, stats); the stats are not used here. Micro-batches are grouped by `accumulate` with
    DDP's no_sync() on all but the last, so one all-reduce happens per update. After each update `on_step(global_step,
    batches_consumed)` may return True to stop (its decision must agree across ranks).
    """
    device = precision.device
    guard = guard or NonFiniteGuard(patience=10**9)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sample_count = torch.zeros((), dtype=torch.float64, device=device)
    total = len(loader) if hasattr(loader, "__len__") else None
    if limit_batches:
        total = max(0, min(total if total is not None else limit_batches, limit_batches - start_batch))
    steps, batch_index, stopped = 0, start_batch, False
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    bar = tqdm(total=total, desc=description, disable=not progress, dynamic_ncols=True,
               mininterval=1.0, leave=False)
    try:
        for x, lengths, labels, _positions in loader:
            if limit_batches and batch_index >= limit_batches:
                break
            x = x.to(device, non_blocking=True)
            lengths = lengths.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            final_micro = (batch_index + 1) % accumulate == 0
            with distributed.no_sync(model, skip=not final_micro):
                with precision.autocast():
                    output = model(x, lengths)
                loss, _stats = loss_fn(output, labels)
                precision.scaler.scale(loss / accumulate).backward()
            loss = loss.detach()
            finite_loss = torch.isfinite(loss)
            loss_sum += torch.where(finite_loss, loss.double() * labels.numel(), 0.0)
            sample_count += torch.where(finite_loss, float(labels.numel()), 0.0)
            batch_index += 1
            bar.update(1)
            if not final_micro:
                continue
            precision.scaler.unscale_(optimizer)
            # The norm is computed from all-reduced gradients: every rank takes the same decision.
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
            finite = bool(torch.isfinite(norm))
            if finite:
                precision.scaler.step(optimizer)
            precision.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            steps += 1
            guard.update(finite, global_step)
            if schedule is not None:
                schedule.step()
            if progress and steps % 10 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            if on_step is not None and on_step(global_step, batch_index):
                stopped = True
                break
    finally:
        bar.close()  # also on error, so the message starts on its own line
    if batch_index % accumulate != 0:  # drop a trailing incomplete accumulation group
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    totals = distributed.all_reduce_sum(torch.stack([loss_sum, sample_count]), device=device)
    loss_total, samples = totals.tolist()
    return EpochResult(
        loss=loss_total / samples if samples > 0 else math.nan,
        samples=int(samples),
        seconds=seconds,
        steps=steps,
        batches=batch_index,
        stopped=stopped,
    )


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def extract_embeddings(embed: Callable, loader: Iterable, precision: Precision, *,
                       progress: bool = False, description: str = "embed"
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run `embed(x, lengths)` over a loader → (embeddings float32 [N, D], labels, positions)."""
    device = precision.device
    chunks, labels_out, positions_out = [], [], []
    total = len(loader) if hasattr(loader, "__len__") else None
    for x, lengths, labels, positions in tqdm(loader, total=total, desc=description,
                                             disable=not progress, dynamic_ncols=True, leave=False):
        with precision.autocast():
            emb = embed(x.to(device, non_blocking=True), lengths.to(device, non_blocking=True))
        chunks.append(emb.float().cpu().numpy())
        labels_out.append(labels.numpy())
        positions_out.append(positions.numpy())
    if not chunks:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(chunks), np.concatenate(labels_out), np.concatenate(positions_out)


RETRIEVAL_KEYS = ("precision_at_1", "map_at_r", "r_precision")


def embed_for_validation(model: nn.Module, loader: Iterable, precision: Precision, *,
                         progress: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Embeddings of the bare model in eval mode over one loader (training mode restored after)."""
    net = distributed.unwrap(model)
    was_training = net.training
    net.eval()
    try:
        return extract_embeddings(net.embed, loader, precision, progress=progress,
                                  description="validate")
    finally:
        net.train(was_training)


def retrieval_summary(embeddings: np.ndarray, labels: np.ndarray,
                      device: torch.device | None = None) -> dict[str, float]:
    """P@1, MAP@R and R-precision as plain floats ({} with fewer than 2 samples)."""
    from audioclf.metrics import retrieval_metrics

    if len(labels) < 2:
        return {}
    metrics = retrieval_metrics(embeddings, labels, device=device)
    return {k: float(metrics[k]) for k in RETRIEVAL_KEYS}


def validate(model: nn.Module, loader: Iterable, precision: Precision, *,
             progress: bool = False) -> dict[str, float]:
    """Retrieval metrics of the bare model on one loader, rank-local."""
    embeddings, labels, _ = embed_for_validation(model, loader, precision, progress=progress)
    return retrieval_summary(embeddings, labels, precision.device)
