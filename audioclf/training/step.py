"""The training step in two pieces: `micro_batch` (forward and backward of one batch) and
`update` (the optimizer step), built once per run by the Trainer (SpeechBrain's `fit_batch` /
`optimizers_step`).

    step = TrainStep(model, optimizer, precision, objective, guard=guard, accumulate=2)
    step.start_epoch()
    for batch, last in loader.micro_batches(2):
        step.micro_batch(batch, sync_grads=last)   # DDP's no_sync() unless last
        if last:
            step.update()
    result = step.end_epoch(seconds, stopped=False)    # collective: the global mean loss

The loss is always computed from the output of the (possibly DDP-wrapped) model, so gradients
are all-reduced; precision comes decided (`audioclf.precision`), so there are no precision
branches.

Host syncs. A GPU runs ahead of the Python loop until the loop reads a device value. The loop
reads one small vector at `sync()` (the Trainer calls it every train.log_every_steps updates and
at the epoch's end): the non-finite counters, the stop vote and the loss shown on the progress
bar, all-reduced at once. In between, a step with a non-finite loss or gradient is skipped on
the device: fused optimizers (torch's Adam / AdamW / SGD, the default) take a `found_inf` flag,
as GradScaler hands them; other optimizers (e.g. apex's FusedAdam) cost one sync per step.

A skipped step changes nothing: parameters and optimizer state stay (found_inf), BatchNorm
running statistics and the fp16 loss scale are put back to what they were before the step. A
step is bad on every rank when it is bad on one (a vote in `update`), so the ranks skip alike
and keep one loss scale.

An empty batch (every file unreadable, data.skip_bad_files) still runs the model on a
placeholder input with a zero loss, so every rank takes part in the step's collectives; it
teaches BatchNorm nothing and counts as skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from audioclf import distributed
from audioclf.data.dataset import Batch
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
        device = placed(device)  # "cuda" and "cuda:0" are one device: keep the counts
        if self._counts is None or self._counts.device != device:
            self._counts = torch.tensor(
                [self.consecutive, self.total, self.overflow], dtype=torch.float64, device=device
            )
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
    stopped: bool  # a stop was requested (signal) before the epoch ended
    skipped_items: int = 0  # global items dropped from their batches (unreadable files)
    skipped_batches: int = 0  # global batches with nothing readable (dropped)
    warmup_seconds: float = 0.0  # of `seconds`: the first step's compilation (train.compile)
    warmup_samples: int = 0  # global samples of that step

    @property
    def samples_per_second(self) -> float:
        """Global samples per second, the compilation step left out."""
        seconds = self.seconds - self.warmup_seconds
        return (self.samples - self.warmup_samples) / seconds if seconds > 0 else 0.0


class TrainStep:
    """One rank's optimizer steps: micro-batches accumulated into updates.

    `objective(model_output, labels, positions)` returns the scalar loss (positions: the rows'
    places in the training split; labels and positions on the device). `accumulate` micro-batches make
    one update (each backward scaled by 1 / accumulate). `batch_size` is the sampler's: a shorter
    batch lost unreadable items. `placeholder` (x, lengths of a few rows) stands in for a batch
    with no readable item.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        objective: Callable[[object, Tensor, Tensor], Tensor],
        *,
        guard: NonFiniteGuard,
        accumulate: int = 1,
        max_grad_norm: float = 0.0,
        batch_size: int = 0,
        placeholder: tuple[Tensor, Tensor] | None = None,
    ):
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.objective, self.guard, self.accumulate = objective, guard, accumulate
        self.max_grad_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        self.batch_size, self.placeholder = batch_size, placeholder
        self.device = placed(precision.device)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._batchnorm = _batchnorm_buffers(model)
        self._on_device_skip = supports_found_inf(optimizer) and not precision.scaler.is_enabled()
        self._saved_batchnorm: list[Tensor] | None = None  # set while an update is pending
        self._step_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self._shown_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        # [loss sum, samples, skipped items, skipped batches, warm-up samples], all-reduced by
        # end_epoch
        self._totals = torch.zeros(5, dtype=torch.float64, device=self.device)
        self._warmup_seconds = 0.0

    def start_epoch(self, placeholder: tuple[Tensor, Tensor] | None = None) -> None:
        """`placeholder`: this epoch's stand-in for a batch with no readable item (its crop
        length may change between epochs); default: the one given at construction."""
        if placeholder is not None:
            self.placeholder = placeholder
        self.model.train()
        self._totals.zero_()
        self.optimizer.zero_grad()  # no argument: apex's FusedAdam.zero_grad() takes none

    # ----------------------------------------------------------------------------- micro-batch

    def micro_batch(
        self, batch: tuple[Tensor, Tensor, Tensor, Tensor], *, sync_grads: bool = True
    ) -> None:
        """Forward and backward of one batch (x, lengths, labels, positions); the gradients are
        all-reduced only when `sync_grads` (the last micro-batch before `update`)."""
        if self._saved_batchnorm is None:  # the first micro-batch of an update
            self._saved_batchnorm = [b.clone() for b in self._batchnorm]
            self._step_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        x, lengths, labels, positions, empty = self._inputs(batch)
        with distributed.no_sync(self.model, skip=not sync_grads):
            loss = self._forward_backward(x, lengths, labels, positions, empty)
        finite = torch.isfinite(loss)
        rows = labels.numel()
        self._step_bad |= ~finite
        self._totals[0] += torch.where(finite, loss.double() * rows, 0.0)
        self._totals[1] += torch.where(finite, float(rows), 0.0)
        self._shown_loss = loss.double()

    def _inputs(self, batch) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
        """(x, lengths, labels, positions) on the device (copies that do not block the host
        from pinned memory), and whether the batch had no readable item (its x and lengths are
        then the placeholder's)."""
        batch = Batch(*batch)  # also a plain (x, lengths, labels, positions) tuple
        lengths, labels, positions = batch.lengths, batch.labels, batch.positions
        rows = labels.numel()
        if self.batch_size:
            self._totals[2] += self.batch_size - rows
        empty = rows == 0
        if empty:
            if self.placeholder is None:
                raise RuntimeError("a batch with no readable item and no placeholder input")
            batch = Batch(*self.placeholder, labels, positions)
            lengths = batch.lengths
            self._totals[3] += 1
        x = batch.model_input(self.device)
        lengths, labels, positions = (
            t.to(self.device, non_blocking=True) for t in (lengths, labels, positions)
        )
        return x, lengths, labels, positions, empty

    def _forward_backward(
        self, x: Tensor, lengths: Tensor, labels: Tensor, positions: Tensor, empty: bool
    ) -> Tensor:
        """The scaled backward of one micro-batch's loss; returns the loss, detached."""
        before_forward = [b.clone() for b in self._batchnorm] if empty else []
        with self.precision.autocast():
            output = self.model(x, lengths, labels)  # labels: MixStyle's partners
        if empty:  # take part in the collectives, learn nothing
            output = _empty_output(output)
        loss = self.objective(output, labels, positions)
        self.precision.scaler.scale(loss / self.accumulate).backward()
        for buffer, before in zip(self._batchnorm, before_forward):  # the placeholder's statistics
            buffer.copy_(before)  # after backward, which still needs the buffers as they were
        return loss.detach()

    # ----------------------------------------------------------------------------- update

    def update(self) -> None:
        """Unscale, clip, step (skipped on the device when the step is bad on any rank),
        restore what a skipped step must not change, zero the gradients. Collective under DDP
        (every rank calls it: one 1-element all-reduce, the bad-step vote); no host sync with
        fused optimizers."""
        if self._saved_batchnorm is None:
            raise RuntimeError("TrainStep.update() needs a micro_batch() first")
        scaler = self.precision.scaler
        # A non-finite loss on one rank must make the step bad on every rank: the ranks then
        # skip alike and keep one loss scale (a loss can be inf with finite gradients, and in
        # fp16 the all-reduced NaN gradients alone would read as a routine overflow elsewhere).
        step_bad = distributed.all_reduce_max(self._step_bad.to(torch.float32)) > 0
        scaler.unscale_(self.optimizer)
        # The norm comes from all-reduced gradients, so every rank takes the same decision.
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
        grads_bad = ~torch.isfinite(norm)
        overflow = grads_bad & ~step_bad if scaler.is_enabled() else torch.zeros_like(grads_bad)
        bad = step_bad | (grads_bad & ~overflow)
        scale_before = [s.clone() for s in _scale_tensors(scaler)]
        if scaler.is_enabled():  # GradScaler skips only on overflow: a bad loss must skip too
            _mark_found_inf(scaler, self.optimizer, bad)
        self._optimizer_step(skip=bad | grads_bad)
        scaler.update()
        _restore_where(bad, _scale_tensors(scaler), scale_before)
        _restore_where(bad, self._batchnorm, self._saved_batchnorm)
        self.optimizer.zero_grad()
        self.guard.record(bad, overflow)
        self._saved_batchnorm = None

    def _optimizer_step(self, skip: Tensor) -> None:
        if self.precision.scaler.is_enabled():
            self.precision.scaler.step(self.optimizer)  # skips overflowing steps itself
        elif self._on_device_skip:
            self.optimizer.found_inf = skip.float()
            self.optimizer.step()
            del self.optimizer.found_inf
        elif not bool(skip):  # a host sync: this optimizer cannot skip on the device
            self.optimizer.step()

    # ----------------------------------------------------------------------------- syncs

    def sync(self, stop: bool, step: int) -> tuple[bool, float]:
        """The loop's one host sync (collective: every rank calls it): the guard's counts and
        the stop vote, max over ranks, plus this rank's last loss. Returns (halt: some rank
        asked to stop, loss); raises NonFiniteLossError on every rank alike."""
        vote = torch.tensor([1.0 if stop else 0.0], dtype=torch.float64, device=self.device)
        shared = distributed.all_reduce_max(torch.cat([self.guard.counts(self.device), vote]))
        consecutive, total, overflow, halt, loss = torch.cat(
            [shared, self._shown_loss.reshape(1)]
        ).tolist()
        self.guard.check(consecutive, total, overflow, step)
        return halt > 0, loss

    def mark_warmup(self, seconds: float) -> None:
        """The steps so far (`seconds` of this epoch, a compilation) are left out of
        samples/s."""
        self._warmup_seconds = seconds
        self._totals[4] = self._totals[1]

    def end_epoch(self, seconds: float, *, stopped: bool) -> EpochResult:
        """Drop a trailing incomplete accumulation group; the epoch's global totals
        (collective: every rank calls it)."""
        if self._saved_batchnorm is not None:
            self.optimizer.zero_grad()
            self._saved_batchnorm = None
        loss_total, samples, skipped_items, skipped_batches, warmup = distributed.all_reduce_sum(
            self._totals, device=self.device
        ).tolist()
        warmup_seconds, self._warmup_seconds = self._warmup_seconds, 0.0
        return EpochResult(
            warmup_seconds=warmup_seconds,
            warmup_samples=int(warmup),
            loss=loss_total / samples if samples > 0 else math.nan,
            samples=int(samples),
            seconds=seconds,
            stopped=stopped,
            skipped_items=int(skipped_items),
            skipped_batches=int(skipped_batches),
        )


def placed(device: torch.device | str) -> torch.device:
    """The device as its tensors report it: "cuda" is the current GPU with its index, "cpu:0"
    is "cpu"."""
    return torch.empty(0, device=device).device


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step() skips itself on the device given `optimizer.found_inf`."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _batchnorm_buffers(model: nn.Module) -> list[Tensor]:
    return [
        buffer
        for module in model.modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)
        if buffer is not None
    ]


def _restore_where(bad: Tensor, tensors: list[Tensor], saved: list[Tensor]) -> None:
    for tensor, before in zip(tensors, saved, strict=True):
        tensor.copy_(torch.where(bad, before, tensor))


def _empty_output(output):
    """The model output cut to no rows, still attached to every parameter the forward used."""
    parts = output if isinstance(output, tuple) else (output,)
    attached = sum(p.sum() for p in parts if p is not None) * 0.0
    cut = tuple(None if p is None else p[:0] + attached for p in parts)
    return cut if isinstance(output, tuple) else cut[0]


def _mark_found_inf(scaler: torch.amp.GradScaler, optimizer, bad: Tensor) -> None:
    """Make GradScaler's step (after unscale_) skip when `bad`, on the device: its per-device
    overflow flags are what scaler.step hands the optimizer (found_inf) and scaler.update reads."""
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        found.copy_(torch.maximum(found, bad.to(found.dtype)))


def _scale_tensors(scaler: torch.amp.GradScaler) -> list[Tensor]:
    """The fp16 loss scale and its growth tracker (updated in place), [] without a scaler."""
    if not scaler.is_enabled() or scaler._scale is None:
        return []
    return [scaler._scale, scaler._growth_tracker]
