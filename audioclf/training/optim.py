"""Optimizer and learning rate.

The learning rate is a pure function of the optimizer step, the epoch and the plateau factor
(`learning_rate`, nanoGPT's `get_lr`); `LRSchedule.apply` is the one place it is written into
the optimizer's param groups. The effective base rate is `optim.lr` scaled by the world size
(`base_lr`), computed once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from audioclf.config import OptimConfig

log = logging.getLogger("audioclf")


def lr_scale(world_size: int, ref_world_size: int, mode: str) -> float:
    """Factor applied to optim.lr: sqrt(world/ref), world/ref, or 1."""
    ratio = world_size / ref_world_size
    return {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[mode]


def base_lr(cfg: OptimConfig, world_size: int) -> float:
    """optim.lr scaled for this world size (optim.lr_scaling against optim.ref_world_size)."""
    return cfg.lr * lr_scale(world_size, cfg.ref_world_size, cfg.lr_scaling)


def param_groups(net: nn.Module, cfg: OptimConfig) -> list:
    """All parameters; with optim.freeze_epochs, in two groups: the embedding layer and head
    ("output", `net.output_parameters()`), and the rest ("body"), which LRSchedule keeps at
    lr 0 while the freeze lasts."""
    if not cfg.freeze_epochs:
        return list(net.parameters())
    output = net.output_parameters()
    chosen = {id(p) for p in output}
    body = [p for p in net.parameters() if id(p) not in chosen]
    return [{"params": body, "name": "body"}, {"params": output, "name": "output"}]


def build_optimizer(
    params: Iterable[nn.Parameter] | list[dict], cfg: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer named by optim.name; its learning rate is set by LRSchedule.apply.

    `params` may be param groups; a group named "body" is frozen (lr 0) during the first
    optim.freeze_epochs epochs. torch's Adam, AdamW and SGD run their fused kernels (CUDA and
    CPU): one kernel per step, and a step with non-finite gradients is skipped on the device.
    """
    params = list(params)
    lr = cfg.lr  # a placeholder: LRSchedule.apply writes the scheduled rate before every step
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, fused=True)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay, fused=True)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True
        )
    try:
        from apex.optimizers import FusedAdam  # noqa: PLC0415 - optional NVIDIA apex
    except ImportError:
        raise ValueError(
            "optim.name=fused_adam needs NVIDIA apex (apex.optimizers), which is not importable "
            "here; use optim.name=adamw (torch's AdamW runs fused)"
        ) from None
    return FusedAdam(params, lr=lr, weight_decay=cfg.weight_decay, adam_w_mode=True)


# Param-group keys that describe how an optimizer runs, not what it learned: a checkpoint
# written elsewhere (CPU, another torch) must not switch them off.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


class OptimizerState:
    """The optimizer as a checkpoint entry; restoring also accepts a state written by another
    Adam implementation (apex FusedAdam keeps the step count per group, torch per parameter)
    and keeps this run's implementation settings (a CPU-written state has fused=None)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        state = _convert_step_counts(state, per_parameter=not _is_apex(self.optimizer))
        # torch places each restored tensor by the *saved* groups' flags (a fused or capturable
        # group keeps `step` on the parameter's device, others on the CPU), so the saved groups
        # take this optimizer's implementation first: a state from a non-fused AdamW or apex
        # restored into the CUDA fused AdamW would otherwise hand its kernel CPU step counts.
        for saved, current in zip(state["param_groups"], self.optimizer.param_groups):
            saved.update({k: current[k] for k in _IMPLEMENTATION_KEYS if k in current})
        self.optimizer.load_state_dict(state)


def _is_apex(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("apex")


def _convert_step_counts(state: dict, *, per_parameter: bool) -> dict:
    """Move Adam's step count to where this optimizer keeps it (per parameter or per group)."""
    groups = [dict(g) for g in state["param_groups"]]
    per_param = {k: dict(v) for k, v in state["state"].items()}
    for group in groups:
        ids = group["params"]
        if per_parameter and "step" in group:
            for i in ids:
                if i in per_param and "step" not in per_param[i]:
                    per_param[i]["step"] = torch.tensor(float(group["step"]))
            del group["step"]
        elif not per_parameter and "step" not in group:
            steps = [float(per_param[i]["step"]) for i in ids if "step" in per_param.get(i, {})]
            if steps:
                group["step"] = int(max(steps))
    return {"state": per_param, "param_groups": groups}


def learning_rate(
    cfg: OptimConfig,
    base: float,
    epochs: int,
    *,
    step: int,
    epoch: int,
    plateau_factor: float = 1.0,
) -> float:
    """The rate of optimizer step `step` (0-based) in epoch `epoch` (0-based).

    Linear warm-up over the first optim.warmup_steps steps, times the epoch's decay: cosine from
    `base` to optim.min_lr over `epochs`, step decay by optim.gamma every optim.step_size
    epochs, or `base * plateau_factor` (floored at optim.min_lr) for the plateau schedule.
    """
    warm = 1.0
    if cfg.warmup_steps > 0:
        warm = min(1.0, (step + 1) / cfg.warmup_steps)
    if cfg.scheduler == "cosine":
        progress = min(epoch / max(epochs, 1), 1.0)
        decayed = cfg.min_lr + (base - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    elif cfg.scheduler == "step":
        decayed = base * cfg.gamma ** (epoch // cfg.step_size)
    elif cfg.scheduler == "plateau":
        decayed = max(base * plateau_factor, cfg.min_lr)
    else:
        decayed = base
    return decayed * warm


class LRSchedule:
    """Writes `learning_rate(...)` into the optimizer; owns the plateau bookkeeping.

    Step and epoch come from the caller (the trainer's state), so the only state here is what
    the plateau schedule learns from the epoch losses (saved in checkpoints).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, base: float, epochs: int
    ):
        self.optimizer = optimizer
        self.cfg = cfg
        self.base = base
        self.epochs = epochs
        self.plateau_factor = 1.0
        self.plateau_best = math.inf
        self.plateau_bad_epochs = 0

    def lr(self, step: int, epoch: int) -> float:
        return learning_rate(
            self.cfg,
            self.base,
            self.epochs,
            step=step,
            epoch=epoch,
            plateau_factor=self.plateau_factor,
        )

    def apply(self, step: int, epoch: int) -> float:
        """Set the rate of step `step` in epoch `epoch` on every param group (0 on a "body"
        group while optim.freeze_epochs lasts); returns it."""
        lr = self.lr(step, epoch)
        frozen = epoch < self.cfg.freeze_epochs
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0 if frozen and group.get("name") == "body" else lr
        return lr

    def epoch_end(self, epoch_loss: float) -> None:
        """After every epoch, with the global (all-reduced) epoch loss (plateau schedule)."""
        if self.cfg.scheduler != "plateau" or not np.isfinite(epoch_loss):
            return
        if epoch_loss < self.plateau_best:
            self.plateau_best, self.plateau_bad_epochs = epoch_loss, 0
            return
        self.plateau_bad_epochs += 1
        if self.plateau_bad_epochs > self.cfg.plateau_patience:
            self.plateau_factor *= self.cfg.gamma
            self.plateau_bad_epochs = 0
            log.info(
                "plateau: learning rate decayed to %.3g",
                max(self.base * self.plateau_factor, self.cfg.min_lr),
            )

    _STATE = ("plateau_factor", "plateau_best", "plateau_bad_epochs")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE:  # older checkpoints also hold step/epoch counters: not needed
            setattr(self, k, state[k])
