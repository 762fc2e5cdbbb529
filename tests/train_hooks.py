"""Test-only hooks into training runs: parameter digests, fault injection, stop requests.

Production code knows none of this; tests hand these hooks to `fit(cfg, hooks=...)`, or run
`python -m tests.train_hooks` under torchrun for a crash in a launched job.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys

import torch

from audioclf import distributed
from audioclf.training.trainer import Trainer, TrainHooks

log = logging.getLogger("audioclf")


def parameters_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bit-identical parameters."""
    digest = hashlib.sha256()
    for name, p in distributed.unwrap(model).named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _add_digest(trainer: Trainer, summary: dict) -> None:
    summary["parameters_sha256"] = parameters_digest(trainer.model)


def digest_hooks(**more) -> TrainHooks:
    """Hooks that add the final parameters' digest to fit()'s summary."""
    return TrainHooks(on_end=_add_digest, **more)


def stop_at(step: int) -> TrainHooks:
    """Behave as if SIGTERM arrived at global step `step`."""

    def on_step(trainer: Trainer) -> None:
        if trainer.state.step == step:
            trainer.stop.flag = True  # what StopRequested's SIGTERM handler sets

    return digest_hooks(on_step=on_step)


def crash_at(step: int) -> TrainHooks:
    """Kill rank 0 at global step `step`, on torchrun's first launch only."""

    def on_step(trainer: Trainer) -> None:
        first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.state.step == step and first_launch and trainer.env.rank == 0:
            log.error("test fault injection: crashing at step %d", step)
            os._exit(17)

    return TrainHooks(on_step=on_step)


def fail_at(step: int, rank: int) -> TrainHooks:
    """Raise a ValueError (bad input, as a corrupt file gives) on `rank` at global step `step`."""

    def on_step(trainer: Trainer) -> None:
        if trainer.state.step == step and trainer.env.rank == rank:
            raise ValueError(f"injected failure on rank {rank} at step {step}")

    return TrainHooks(on_step=on_step)


def main() -> int:
    """`python -m tests.train_hooks (--crash-at-step N | --fail-at-step N --rank R) -- <audioclf.train
    arguments>`"""
    from audioclf.train import main as train_main

    parser = argparse.ArgumentParser()
    parser.add_argument("--crash-at-step", type=int)
    parser.add_argument("--fail-at-step", type=int)
    parser.add_argument("--rank", type=int, default=1)
    args, rest = parser.parse_known_args()
    hooks = (
        crash_at(args.crash_at_step)
        if args.crash_at_step
        else fail_at(args.fail_at_step, args.rank)
    )
    return train_main([a for a in rest if a != "--"], hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
