"""The training loop: train_one_epoch() over a loader, with the non-finite guard.

The loss is always computed from the output of the (possibly DDP-wrapped) model passed in, so
gradients are all-reduced; precision comes decided (`audioclf.precision`), so the loop has no
precision branches.

Host syncs. A GPU runs ahead of the Python loop until the loop reads a device value. The loop
reads one small vector every `sync_every` updates (and at the epoch's end): the non-finite
counters, the stop vote and the loss shown on the progress bar, all-reduced at once. In between,
a step with a non-finite loss or gradient is skipped on the device: fused optimizers (torch's
Adam / AdamW / SGD, the default) take a `found_inf` flag, as GradScaler hands them; other
optimizers (e.g. apex's FusedAdam) cost one sync per step to decide.

A skipped step changes nothing: parameters and optimizer state stay (found_inf), BatchNorm
running statistics and the fp16 loss scale are put back to what they were before the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm import tqdm

from audioclf import distributed
from audioclf.precision import Precision


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class NonFiniteGuard:
    """Counts bad steps on the device; `check` (after a sync) stops training after `patience`
    consecutive ones.

    A step is bad when the loss is not finite on some rank, or (fp32 / bf16) when its gradient
    norm is not finite. In fp16 a step whose gradients overflow while the loss is finite is
    GradScaler's routine (it skips the step and lowers the scale): it counts as `overflow`,
    never towards `patience`. `consecutive`, `total` and `overflow` are as of the last sync.
    """

    def __init__(self, patience: int):
        self.patience = patience
        self.consecutive = self.total = self.overflow = 0
        self._counts: Tensor | None = None  # [consecutive, total, overflow] on the device

    def counts(self, device: torch.device) -> Tensor:
        if self._counts is None or self._counts.device != device:
            self._counts = torch.tensor([self.consecutive, self.total, self.overflow],
                                        dtype=torch.float64, device=device)
        return self._counts

    def record(self, bad: Tensor, overflow: Tensor) -> None:
        """One step's outcome (bool tensors on the device; no sync)."""
        counts = self.counts(bad.device)
        bad, overflow = bad.double(), overflow.double()
        counts[0] = (counts[0] + 1) * bad
        counts[1] += bad
        counts[2] += overflow

    def check(self, consecutive: float, total: float, overflow: float, step: int) -> None:
        """Take the synced counts (the worst rank's); raise after `patience` bad steps in a row."""
        self.consecutive, self.total, self.overflow = int(consecutive), int(total), int(overflow)
        self._counts = None  # re-created from the synced values
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
    skipped_items: int = 0  # global items dropped from their batches (unreadable files)
    skipped_batches: int = 0  # global batches with nothing readable (dropped)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step() skips itself on the device given `optimizer.found_inf`."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _batchnorm_buffers(model: nn.Module) -> list[Tensor]:
    return [buffer for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)
            if buffer is not None]


def _restore_where(bad: Tensor, tensors: list[Tensor], saved: list[Tensor]) -> None:
    for tensor, before in zip(tensors, saved, strict=True):
        tensor.copy_(torch.where(bad, before, tensor))


def _empty_output(output):
    """The model output cut to no rows, still attached to every parameter the forward used."""
    parts = output if isinstance(output, tuple) else (output,)
    attached = sum(p.sum() for p in parts if p is not None) * 0.0
    cut = tuple(None if p is None else p[:0] + attached for p in parts)
    return cut if isinstance(output, tuple) else cut[0]


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
    on_step: Callable[[int, int], bool | None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    sync_every: int = 1,
    batch_size: int = 0,
    placeholder: tuple[Tensor, Tensor] | None = None,
    progress: bool = False,
    description: str = "train",
) -> EpochResult:
    """One pass over `loader`; returns the exact global mean loss.

    Each batch is (x, lengths, labels, positions); `loss_fn(model_output, labels)` returns the
    scalar loss. Micro-batches are grouped by `accumulate` with DDP's no_sync() on all but the
    last, so one all-reduce happens per update. Before each update `set_lr(global_step)` sets
    the learning rate of that step; after it, `on_step(global_step, batches_consumed)` runs
    and may return True to stop at once (the caller makes that agree across ranks).

    Every `sync_every` updates the ranks sync once (collective): the non-finite guard is
    checked, `should_stop()` is voted on (any rank stops all) and the progress bar shows the
    loss. Batches shorter than `batch_size` lost unreadable items (data.skip_bad_files); a batch
    with none left still runs the model on `placeholder` (x, lengths of a few rows) with a zero
    loss, so every rank takes part in the step's collectives, and counts as skipped.
    """
    device = precision.device
    guard = guard or NonFiniteGuard(patience=10**9)
    sync_every = max(1, sync_every)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    batchnorm = _batchnorm_buffers(model)
    on_device_skip = supports_found_inf(optimizer) and not precision.scaler.is_enabled()
    # [loss sum, samples, skipped items, skipped batches], all-reduced at the end of the epoch
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    step_bad = torch.zeros((), dtype=torch.bool, device=device)
    shown_loss = torch.zeros((), dtype=torch.float64, device=device)
    total = len(loader) if hasattr(loader, "__len__") else None
    if limit_batches:
        total = max(0, min(total if total is not None else limit_batches, limit_batches - start_batch))
    steps, batch_index, stopped = 0, start_batch, False
    start = time.perf_counter()
    optimizer.zero_grad()  # no argument: apex's FusedAdam.zero_grad() takes none
    bar = tqdm(total=total, desc=description, disable=not progress, dynamic_ncols=True,
               mininterval=1.0, leave=False)
    try:
        for x, lengths, labels, _positions in loader:
            if limit_batches and batch_index >= limit_batches:
                break
            first_micro = batch_index % accumulate == 0 or batch_index == start_batch
            final_micro = (batch_index + 1) % accumulate == 0
            if first_micro:
                saved_batchnorm = [b.clone() for b in batchnorm]
                step_bad = torch.zeros((), dtype=torch.bool, device=device)
            rows = labels.numel()
            empty = rows == 0
            if batch_size:
                totals[2] += batch_size - rows
            if empty:
                if placeholder is None:
                    raise RuntimeError("a batch with no readable item and no placeholder input")
                x, lengths = placeholder
                totals[3] += 1
            x = x.to(device, non_blocking=True)
            lengths = lengths.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with distributed.no_sync(model, skip=not final_micro):
                before_forward = [b.clone() for b in batchnorm] if empty else []
                with precision.autocast():
                    output = model(x, lengths)
                if empty:  # take part in the collectives, learn nothing
                    output = _empty_output(output)
                loss = loss_fn(output, labels)
                precision.scaler.scale(loss / accumulate).backward()
            for buffer, before in zip(batchnorm, before_forward):  # the placeholder's statistics
                buffer.copy_(before)  # after backward, which still needs the buffers as they were
            loss = loss.detach()
            finite_loss = torch.isfinite(loss)
            step_bad |= ~finite_loss
            totals[0] += torch.where(finite_loss, loss.double() * rows, 0.0)
            totals[1] += torch.where(finite_loss, float(rows), 0.0)
            shown_loss = loss.double()
            batch_index += 1
            bar.update(1)
            if not final_micro:
                continue

            precision.scaler.unscale_(optimizer)
            # The norm comes from all-reduced gradients, so every rank takes the same decision.
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
            grads_bad = ~torch.isfinite(norm)
            overflow = grads_bad & ~step_bad if precision.scaler.is_enabled() else torch.zeros_like(grads_bad)
            bad = step_bad | (grads_bad & ~overflow)
            skip = bad | grads_bad
            if set_lr is not None:
                set_lr(global_step)
            scale_before = [s.clone() for s in _scale_tensors(precision.scaler)]
            if precision.scaler.is_enabled():
                precision.scaler.step(optimizer)  # skips overflowing steps itself
            elif on_device_skip:
                optimizer.found_inf = skip.float()
                optimizer.step()
                del optimizer.found_inf
            elif not bool(skip):  # a host sync: this optimizer cannot skip on the device
                optimizer.step()
            precision.scaler.update()
            _restore_where(bad, _scale_tensors(precision.scaler), scale_before)
            _restore_where(bad, batchnorm, saved_batchnorm)
            optimizer.zero_grad()
            guard.record(bad, overflow)
            global_step += 1
            steps += 1
            if on_step is not None and on_step(global_step, batch_index):
                stopped = True
                break
            if steps % sync_every == 0:
                halt, loss_value = _sync(guard, should_stop, shown_loss, global_step, device)
                if progress:
                    lr = max(group["lr"] for group in optimizer.param_groups)
                    bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                if halt:
                    stopped = True
                    break
    finally:
        bar.close()  # also on error, so the message starts on its own line
    if batch_index % accumulate != 0:  # drop a trailing incomplete accumulation group
        optimizer.zero_grad()
    if steps % sync_every != 0 and not stopped:
        _sync(guard, None, shown_loss, global_step, device)
    seconds = time.perf_counter() - start
    loss_total, samples, skipped_items, skipped_batches = (
        distributed.all_reduce_sum(totals, device=device).tolist())
    return EpochResult(
        loss=loss_total / samples if samples > 0 else math.nan,
        samples=int(samples),
        seconds=seconds,
        steps=steps,
        batches=batch_index,
        stopped=stopped,
        skipped_items=int(skipped_items),
        skipped_batches=int(skipped_batches),
    )


def _scale_tensors(scaler: torch.amp.GradScaler) -> list[Tensor]:
    """The fp16 loss scale and its growth tracker (updated in place), [] without a scaler."""
    if not scaler.is_enabled() or scaler._scale is None:
        return []
    return [scaler._scale, scaler._growth_tracker]


def _sync(guard: NonFiniteGuard, should_stop: Callable[[], bool] | None, loss: Tensor, step: int,
          device: torch.device) -> tuple[bool, float]:
    """The loop's one host sync (collective): guard counts and the stop vote, max over ranks,
    plus this rank's last loss. Raises NonFiniteLossError on every rank alike."""
    stop = torch.tensor([1.0 if should_stop is not None and should_stop() else 0.0],
                        dtype=torch.float64, device=device)
    shared = distributed.all_reduce_max(torch.cat([guard.counts(device), stop]))
    consecutive, total, overflow, halt, loss_value = torch.cat([shared, loss.reshape(1)]).tolist()
    guard.check(consecutive, total, overflow, step)
    return halt > 0, loss_value
