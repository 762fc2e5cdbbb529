"""Train an audio embedding model with triplet loss.

    python -m audioclf.train --config configs/demo_cnn.yaml [section.key=value ...]
    torchrun --nproc_per_node=4 -m audioclf.train --config configs/conformer.yaml

One process per GPU under torchrun (DDP, NCCL; gloo on CPU); plain `python -m` trains in a
single process. Outputs go to <train.runs_dir>/<train.name>/: config.yaml, train.log,
metrics.csv, tensorboard/, last.pt, best.pt, epoch_*.pt. Resume with checkpoint.resume=auto.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from audioclf.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m audioclf.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides use dotted keys, e.g. train.epochs=3 sampler.m=4 optim.lr=5e-4 "
               "model.name=conformer checkpoint.resume=auto. See README.md for every key.",
    )
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    # Legacy torch.distributed.launch passes --local_rank / --local-rank; torchrun sets LOCAL_RANK.
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides applied after the file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"audioclf.train: {exc}", file=sys.stderr)
        return 2
    from audioclf.trainer import fit  # heavy imports after the config is known to be valid

    try:
        fit(cfg, local_rank_arg=args.local_rank)
    except Exception as exc:
        if not is_user_error(exc):
            raise
        print(f"audioclf.train: {exc}", file=sys.stderr)
        return 2
    return 0


USER_ERRORS = (ValueError, FileNotFoundError, RuntimeError)
PACKAGE_DIR = Path(__file__).resolve().parent


def is_user_error(exc: BaseException) -> bool:
    """A validation error raised by audioclf itself (bad input, clear message): no traceback.

    Errors raised inside torch or other libraries keep their traceback.
    """
    if not isinstance(exc, USER_ERRORS):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE_DIR)


if __name__ == "__main__":
    sys.exit(main())
