"""Train an audio embedding model with triplet loss.

    python -m audioclf.train --config configs/demo_cnn.yaml [section.key=value ...]
    torchrun --nproc_per_node=4 -m audioclf.train --config configs/conformer.yaml
    audioclf train --nproc-per-node 4 --config conformer   # starts the 4 ranks itself

One process per GPU under torchrun (DDP, NCCL; gloo on CPU); plain `python -m` trains in a
single process. Outputs go to <train.runs_dir>/<train.name>/: config.yaml, train.log,
metrics.csv, tensorboard/, last.pt, best.pt, epoch_*.pt. Resume with checkpoint.resume=auto.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

PROG = "python -m audioclf.train"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides use dotted keys, e.g. train.epochs=3 sampler.m=4 optim.lr=5e-4 "
        "model.name=conformer checkpoint.resume=auto. Every key: docs/configuration.md.",
    )
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    # Legacy torch.distributed.launch passes --local_rank / --local-rank; torchrun sets LOCAL_RANK.
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=None,
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc",
        type=int,
        metavar="N",
        help="start N ranks on this machine (as torchrun --standalone --nproc_per_node N); "
        "one Ctrl-C stops them all at the next step with last.pt saved",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides applied after the file",
    )
    return parser.parse_intermixed_args(argv)  # options and files in any order


def main(argv: list[str] | None = None, *, hooks=None) -> int:
    """The entry point; `hooks` (a trainer.TrainHooks) lets tests and tools watch the run.

    Imports come inside: a Ctrl-C while torch loads (seconds) is one line and 130, not a
    KeyboardInterrupt traceback; a rank of --nproc-per-node says nothing (the launcher does)."""
    parent_at_start = os.getppid()  # a launcher's rank dies with it: see die_with_launcher
    args = parse_args(argv)
    if args.nproc is not None:
        EarlyStop.install()
    try:
        from audioclf.distributed.launch import die_with_launcher  # noqa: PLC0415 - see above
        from audioclf.errors import run_cli  # noqa: PLC0415

        die_with_launcher(parent_at_start)
        return run_cli(PROG, lambda: run(args, hooks))
    except KeyboardInterrupt:  # before the trainer's own handler (which stops at a step)
        if "AUDIOCLF_LAUNCHER_PID" not in os.environ:
            print(
                f"{PROG}: stopped by SIGINT before training started; nothing was saved",
                file=sys.stderr,
            )
        return 130


class EarlyStop:
    """The launcher's Ctrl-C (SIGTERM, SIGHUP) before its ranks start, while it imports torch
    and checks the input: noted, and honoured once that is done (`stopped`), not raised where
    it lands: a KeyboardInterrupt inside numpy's lazy import of numpy.dtypes left it half-built,
    and the next use recursed into a RecursionError traceback. A second one raises at once."""

    signal: str | None = None

    @classmethod
    def install(cls) -> None:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            signal.signal(getattr(signal, name), cls._note)

    @classmethod
    def _note(cls, signum, frame) -> None:
        if cls.signal is not None:
            raise KeyboardInterrupt
        cls.signal = signal.Signals(signum).name

    @classmethod
    def stopped(cls) -> int | None:
        """130 (SIGINT) or 143 with its one line when a signal came before the ranks start."""
        if cls.signal is None:
            return None
        print(f"{PROG}: stopped by {cls.signal} before training started; nothing was saved",
              file=sys.stderr)  # fmt: skip
        return 130 if cls.signal == "SIGINT" else 143


def run(args: argparse.Namespace, hooks=None) -> int:
    from audioclf.config import load_config  # noqa: PLC0415 - see main

    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:
        return launch(args, cfg)
    from audioclf.training.trainer import fit  # noqa: PLC0415 - torch etc. once the config is valid

    summary = fit(cfg, hooks=hooks, local_rank_arg=args.local_rank)
    # Ctrl-C exits 130, as shells expect; under torchrun a worker exits 0 (torchrun would
    # report any other status as a failure), and ./run.sh turns the stop into 130 itself.
    interrupted = summary.get("stop_signal") == "SIGINT"
    return 130 if interrupted and "TORCHELASTIC_RUN_ID" not in os.environ else 0


def launch(args: argparse.Namespace, cfg) -> int:
    """--nproc-per-node N: the ranks, each `python -m audioclf.train` without the flag, once
    the input is known to be good (every rank would refuse it alike)."""
    from audioclf.distributed.launch import check_local_gpus, launch_tool  # noqa: PLC0415
    from audioclf.errors import UsageError  # noqa: PLC0415
    from audioclf.training.rundir import check_before_ranks  # noqa: PLC0415

    if args.nproc < 1 or "WORLD_SIZE" in os.environ:
        raise UsageError(
            "--nproc-per-node needs N >= 1 and no launcher around it (under torchrun or srun, "
            "leave it out)"
        )
    check_local_gpus(args.nproc, cfg.train.device)  # before any rank starts
    check_before_ranks(cfg)
    if (code := EarlyStop.stopped()) is not None:
        return code
    argv = [*(["--config", args.config] if args.config else []), *args.overrides]
    last = Path(cfg.train.runs_dir) / cfg.train.name / "last.pt"
    return launch_tool(
        PROG, args.nproc, "audioclf.train", argv, last, noted=lambda: EarlyStop.signal
    )


if __name__ == "__main__":
    sys.exit(main())
