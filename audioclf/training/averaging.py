"""Averaged weights: an exponential moving average kept during training (`train.ema_decay`), and
the average of the last epochs' checkpoints after it (`checkpoint.average_last`).

    ema = WeightEMA(net, decay=0.999)    # a copy of the net; the Checkpointer saves it as "ema"
    ema.update()                         # after every optimizer step, on the device, no sync
    validator.run(ema.module, ...)       # validation (and so best.pt) sees the EMA weights

    weights = average_checkpoints([run / "epoch_0008.pt", run / "epoch_0009.pt"])

EMA (NeMo's EMA callback, timm's ModelEmaV2): after every step, ema ← decay · ema + (1 − decay) ·
live, for every floating-point tensor of the net's state (parameters and BatchNorm running
statistics); integer buffers (num_batches_tracked) are copied. One `torch._foreach_lerp_` per
step, on the device the net lives on: no host sync. A skipped step (non-finite loss) leaves the
live weights as they were, so the EMA moves towards the same weights again. Under DDP every rank
keeps its own EMA of its (identical) parameters, so no collective is needed.

Checkpoint averaging (WeSpeaker's average_model.py, SpeechBrain's average_checkpoints, NeMo's
checkpoint averaging): the element-wise mean of the last N epoch checkpoints' weights — of their
"ema" entries when the run keeps an EMA (what evaluation and export use), else of "model".
BatchNorm running statistics are averaged like the weights, not recomputed: the mean and
variance of the same layers at nearby points of the same run are close, WeSpeaker and
SpeechBrain do the same, and it needs no pass over training batches (no extra reading, no
random streams touched, nothing to synchronise). Integer buffers come from the newest file.
The mean is taken in float64 and cast back, so N identical checkpoints average to themselves
bit for bit.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from audioclf import checkpoint, distributed
from audioclf.config import Config
from audioclf.training.validation import Validator

log = logging.getLogger("audioclf")

BATCHNORM = "averaged"  # how avg.pt's BatchNorm statistics were made (said in train.log)


class WeightEMA:
    """An exponential moving average of a net's state, as a module (`module`, eval mode, no
    gradients) with the net's own state-dict keys. Build it once the net is on its device
    (after wrapping: `.to()` may replace the tensors it reads); `net` is the bare module.

    A checkpoint entry: `state_dict()` is the EMA module's state dict; `load_state_dict(None)`
    (a checkpoint written without an EMA) starts the average from the net's current weights.
    """

    def __init__(self, net: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay={decay}: use a value in (0, 1), e.g. 0.999")
        self.decay = decay
        self.module = copy.deepcopy(net).eval()
        for parameter in self.module.parameters():
            parameter.requires_grad_(False)
            parameter.grad = None
        live, averaged = net.state_dict(), self.module.state_dict()
        floats = [k for k, v in live.items() if v.is_floating_point()]
        self._live = [live[k] for k in floats]
        self._averaged = [averaged[k] for k in floats]
        others = [k for k in live if k not in set(floats)]
        self._live_other = [live[k] for k in others]
        self._averaged_other = [averaged[k] for k in others]

    def decay_at(self, step: int | None) -> float:
        """The decay of the update after optimizer step `step` (1-based): warmed up as timm's
        ModelEmaV3 does, min(decay, (1 + step) / (10 + step)), so the average follows the
        weights early on instead of holding on to the random initialisation for ~1 / (1 - decay)
        steps (a short CPU run with 0.999 ended near its first epochs' weights, measured)."""
        if step is None:
            return self.decay
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, step: int | None = None) -> None:
        """One step of the average (after optimizer step `step`; None: the plain decay); no
        host sync."""
        if self._averaged:
            torch._foreach_lerp_(self._averaged, self._live, 1.0 - self.decay_at(step))
        if self._averaged_other:
            torch._foreach_copy_(self._averaged_other, self._live_other)

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the net's current weights."""
        for averaged, live in zip(
            self._averaged + self._averaged_other, self._live + self._live_other, strict=True
        ):
            averaged.copy_(live)

    def state_dict(self) -> dict[str, Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Tensor] | None) -> None:
        if state is None:
            log.info(
                "train.ema_decay=%g: the checkpoint holds no EMA of the weights; the average "
                "starts from the resumed weights",
                self.decay,
            )
            self.reset()
            return
        self.module.load_state_dict(state)


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


def average_state_dicts(states: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The element-wise mean of state dicts with the same keys and shapes (floating-point
    tensors, in float64, cast back); other entries come from the last one."""
    if not states:
        raise ValueError("average_state_dicts needs at least one state dict")
    keys = list(states[-1])
    for number, state in enumerate(states):
        if list(state) != keys:
            raise ValueError(
                f"state dict {number} has other keys than the last one: the checkpoints hold "
                "different models"
            )
    averaged = {}
    for key in keys:
        newest = states[-1][key]
        if not (torch.is_tensor(newest) and newest.is_floating_point()):
            averaged[key] = newest
            continue
        total = torch.zeros_like(newest, dtype=torch.float64)
        for state in states:
            total += state[key].to(torch.float64)
        averaged[key] = (total / len(states)).to(newest.dtype)
    return averaged


def average_checkpoints(paths: Sequence[str | Path], key: str = "model") -> dict[str, Tensor]:
    """The mean of the `key` weights ("model" or "ema") of checkpoint files (on the CPU)."""
    states = []
    for path in paths:
        ckpt = checkpoint.load(path)
        if key not in ckpt:
            raise checkpoint.CheckpointError(
                f"{path} holds no {key!r} weights (its run kept no EMA?); average the 'model' "
                "weights instead"
            )
        states.append(ckpt[key])
    return average_state_dicts(states)


def with_weights(net: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """A copy of `net` (the bare module) holding `state`, on the net's device, in eval mode."""
    averaged = copy.deepcopy(net)
    averaged.load_state_dict(state)
    return averaged.eval()


@dataclass
class Averaged:
    """The outcome of averaging the last epochs."""

    after_epoch: int  # the run's last epoch (1-based)
    epochs: list[int]  # 1-based epoch numbers whose checkpoints were averaged
    weights: dict[str, Tensor]
    source: str  # "ema" or "model"

    def record(self, metrics: dict) -> dict:
        """What the checkpoints keep of it ("averaged"; avg.pt's "average_of"), and fit()'s
        summary."""
        return {
            "after_epoch": self.after_epoch,
            "epochs": self.epochs,
            "weights": self.source,
            "batchnorm": BATCHNORM,
            "metrics": dict(metrics),
        }

    def describe(self) -> str:
        what = "EMA weights" if self.source == "ema" else "weights"
        return (
            f"the mean of the {what} of epochs {self.epochs[0]}-{self.epochs[-1]} (BatchNorm "
            f"statistics {BATCHNORM})"
        )


def epochs_to_average(run_dir: Path, last_epoch: int, count: int) -> list[int]:
    """The epochs among the last `count` whose epoch_<N>.pt exists (rank 0 reads the folder)."""
    wanted = range(max(1, last_epoch - count + 1), last_epoch + 1)
    found = [e for e in wanted if checkpoint.epoch_path(run_dir, e).is_file()]
    if len(found) < len(wanted):
        log.warning(
            "checkpoint.average_last=%d: %d of epochs %d-%d have a checkpoint (%s); "
            "averaging those",
            count,
            len(found),
            wanted[0],
            wanted[-1],
            ", ".join(str(e) for e in found) or "none",
        )
    return found


def average_last_epochs(
    run_dir: Path, last_epoch: int, count: int, source: str, *, primary: bool
) -> Averaged | None:
    """Rank 0 reads the last `count` epoch checkpoints and averages their `source` weights;
    every rank receives the result (collective: every rank must call it). None when fewer than
    two checkpoints are there to average (said in the log)."""
    result = None
    if primary:
        epochs = epochs_to_average(run_dir, last_epoch, count)
        if len(epochs) >= 2:
            paths = [checkpoint.epoch_path(run_dir, e) for e in epochs]
            result = Averaged(last_epoch, epochs, average_checkpoints(paths, source), source)
        else:
            log.warning(
                "checkpoint.average_last=%d: nothing to average; no %s", count, checkpoint.AVG
            )
    return distributed.broadcast_object(result)


class LastEpochsAverage:
    """checkpoint.average_last=N after the last epoch: avg.pt holds the mean of the last N
    epochs' weights, validated like an epoch (its metrics in train.log, metrics.csv, the
    checkpoints' "averaged" and fit()'s summary) and eligible for best.pt. Once per run: a run
    resumed after it does not average again."""

    def __init__(
        self,
        cfg: Config,
        env: distributed.DistEnv,
        checkpointer: checkpoint.Checkpointer,
        validator: Validator,
    ):
        self.cfg, self.env, self.checkpointer, self.validator = cfg, env, checkpointer, validator
        self.run_dir = checkpointer.saver.run_dir
        self.metrics = validator.metrics  # metrics.csv and TensorBoard
        self.source = "ema" if cfg.train.ema_decay > 0 else "model"

    def due(self, epoch: int, averaged: dict) -> bool:
        """After the last epoch, unless avg.pt was made after it already."""
        done = averaged.get("after_epoch") == epoch
        return (
            bool(self.cfg.checkpoint.average_last) and epoch == self.cfg.train.epochs and not done
        )

    def run(self, net: nn.Module, state) -> None:
        """Average, validate (every rank takes part), write avg.pt and last.pt (rank 0), with
        the record in `state.averaged` (the trainer's TrainState: epoch, step, averaged).
        Collective: every rank must call it."""
        cfg, env, epoch, step = self.cfg, self.env, state.epoch, state.step
        result = average_last_epochs(
            self.run_dir, epoch, cfg.checkpoint.average_last, self.source, primary=env.is_primary
        )
        if result is None:
            return
        averaged_net = with_weights(distributed.unwrap(net), result.weights)
        metrics = (
            self.validator.run(averaged_net, epoch=epoch - 1, step=step, projector=False)
            if cfg.eval.every > 0
            else {}
        )
        state.averaged = result.record(metrics)  # last.pt says so: a resume does not redo it
        written = self.checkpointer.save_average(
            result.weights, metrics.get(cfg.eval.metric), state.averaged
        )
        if env.is_primary:
            self._report(result, metrics, step, best=self.run_dir / checkpoint.BEST in written)

    def _report(self, result: Averaged, metrics: dict, step: int, *, best: bool) -> None:
        shown = " ".join(f"{k}={v:.4f}" for k, v in metrics.items()) or "(not validated)"
        log.info(
            "%s: %s: %s%s",
            self.run_dir / checkpoint.AVG,
            result.describe(),
            shown,
            " (new best: best.pt is avg.pt)" if best else "",
        )
        # metrics.csv: a row marked "avg_<first>-<last>" in its epoch column
        epochs = f"avg_{result.epochs[0]}-{result.epochs[-1]}"
        self.metrics.append_row({"epoch": epochs, "step": step, **metrics})
        for key, value in metrics.items():
            self.metrics.scalar(f"average/{key}", value, step)
