"""The training loop: train_one_epoch() over a loader, with the non-finite guard.

The loss is always computed from the output of the (possibly DDP-wrapped) model passed in, so
gradients are all-reduced; precision comes decided (`audioclf.precision`), so the loop has no
precision branches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from audioclf import distributed
from audioclf.precision import Precision


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
    set_lr: Callable[[int], object] | None = None,
    accumulate: int = 1,
    max_grad_norm: float = 0.0,
    guard: NonFiniteGuard | None = None,
    start_batch: int = 0,
    limit_batches: int = 0,
    global_step: int = 0,
    on_step: Callable[[int, int], bool] | None = None,
    progress: bool = False,
    log_every: int = 0,
    description: str = "train",
) -> EpochResult:
    """One pass over `loader`; returns the exact global mean loss.

    Each batch is (x, lengths, labels, positions); `loss_fn(model_output, labels)` returns the
    scalar loss. Micro-batches are grouped by `accumulate` with DDP's no_sync() on all but the
    last, so one all-reduce happens per update. Before each update `set_lr(global_step)` sets
    the learning rate of that step; after it, `on_step(global_step, batches_consumed)` may
    return True to stop (its decision must agree across ranks). The progress bar shows the loss
    every `log_every` updates (0 = never).
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
                loss = loss_fn(output, labels)
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
            if set_lr is not None:
                set_lr(global_step)
            if finite:
                precision.scaler.step(optimizer)
            precision.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            steps += 1
            guard.update(finite, global_step)
            if progress and log_every and steps % log_every == 0:
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
