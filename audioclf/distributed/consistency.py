"""The parameter-consistency check: every rank must hold bit-identical parameters."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from audioclf.distributed.group import is_initialized
from audioclf.distributed.wrapping import unwrap

log = logging.getLogger("audioclf")


class ParameterDriftError(RuntimeError):
    """Ranks hold different parameters: some update bypassed DDP's gradient all-reduce."""


def parameter_checksums(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Two float64 checksums per parameter tensor (plain sum and position-weighted sum)."""
    names, sums = [], []
    for name, p in unwrap(model).named_parameters():
        flat = p.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
        weights = torch.remainder(weights * 0.6180339887, 1.0) + 0.5
        names.append(name)
        sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    if not sums:
        return names, torch.zeros(0, 2, dtype=torch.float64)
    return names, torch.stack(sums)


def check_parameter_consistency(
    model: nn.Module, *, action: str = "error", device: torch.device | None = None
) -> str | None:
    """All-reduce per-tensor checksums as max − min across ranks; name the first drifting tensor.

    Returns None when every rank agrees bit for bit (or without a process group); otherwise
    raises ParameterDriftError (action="error") or logs a warning and returns its message.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return None
    names, sums = parameter_checksums(model)
    sums = sums.to(device) if device is not None else sums
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    spread = (high - low).abs().amax(dim=1).cpu()
    drifting = torch.nonzero(spread > 0).flatten().tolist()
    if not drifting:
        return None
    first = drifting[0]
    message = (
        f"parameters differ across ranks: {len(drifting)} of {len(names)} tensors drifted, first "
        f"'{names[first]}' (checksum spread {spread[first].item():.3g}). An update bypassed DDP's "
        "gradient all-reduce — compute the training loss from the DDP-wrapped model's output, "
        "never through model.module"
    )
    if action == "error":
        raise ParameterDriftError(message)
    log.warning(message)
    return message
