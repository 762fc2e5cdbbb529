"""What the tool CLIs share beyond the error policy (audioclf.errors): the --trust-checkpoint
flag and the --device choice."""

from __future__ import annotations

import torch

from audioclf.errors import UsageError


def add_trust_flag(parser) -> None:
    """--trust-checkpoint: the opt-in audioclf.checkpoint.load's refusal names."""
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load a checkpoint that holds more than tensors and plain data "
        "(its Python objects can run code while loading): only for a file you "
        "trust",
    )


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available) → a device that exists here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(
            f"--device {name!r} is not a device; use cpu, cuda, cuda:N or auto"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {name} was requested but CUDA is not available here; use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type != "cpu":
        raise UsageError(f"--device {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    return device
