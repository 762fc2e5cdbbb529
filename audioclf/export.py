"""Export a trained embedding model as TorchScript, ONNX or a slim state_dict checkpoint.

    python -m audioclf.export --checkpoint runs/demo/best.pt --format torchscript --out model.pt
    python -m audioclf.export --checkpoint runs/demo/best.pt --format onnx --out model.onnx
    python -m audioclf.export --checkpoint runs/demo/best.pt --format torchscript \
        --no-frontend --out model_logmel.pt
    python -m audioclf.export --checkpoint runs/demo/best.pt --format state_dict --out weights.pt
    python -m audioclf.export --checkpoint runs/demo/best.pt --format onnx --out adapted.onnx \
        --adapt new_source/      # AdaBN on unlabelled audio of a new source first

The exported model is the network in eval mode (no SpecAugment, no dropout):
  forward(x, lengths) -> embeddings float32 [batch, D], L2-normalised
                         (embeddings, logits [batch, classes]) when trained with a classifier
                         head (loss.ce_weight > 0; class names in the sidecar)
  x        default: waveforms float32 [batch, samples], mono at features.sample_rate,
           zero-padded after each clip; the log-mel front end is inside the model.
           --no-frontend (and models trained on .npy features): log-mel float32
           [batch, frames, n_mels] as audioclf.spectrogram.log_mel computes it (log of mel power
           + 1e-6, not normalised); per-utterance normalisation is still inside the model.
  lengths  int64 [batch]: valid samples (or frames) of each row.
Batch and time are dynamic in every format.

Formats:
  torchscript  torch.jit.script; load with torch.jit.load(path) — no audioclf needed.
  onnx         torch.onnx.export (dynamo exporter, opset >= 18), dynamic batch and time axes;
               needs the optional packages: pip install onnx onnxscript onnxruntime.
  state_dict   a checkpoint without optimizer state ({model, config, classes, ...}); load with
               audioclf.inference.load_trained(path) (--no-frontend does not apply).
  folder       the way to hand a model to someone else: --out DIR gets model.safetensors (the
               weights; no code runs while loading), config.json (what audioclf.load needs, and
               this sidecar's fields) and README.md, a model card written from the run's files
               (its data, training time, and the evaluation's figures from --report); load
               with audioclf.load("DIR") or give DIR to any tool's --model.

After writing, the artefact is loaded back (torch.jit.load / onnxruntime / load_trained) and
compared with the PyTorch model on random input at two lengths; the max abs difference is
printed, and above --tolerance the artefact is removed and the exit status is 1. A sidecar
<out>.json says what a user needs: input kind and shapes, sample rate and features settings,
embedding size, classes (with a head), format, versions. Files are written atomically.
Exit status: 0 done; 1 parity check failed; 2 bad input or missing optional packages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from audioclf.config import ModelConfig, choices
from audioclf.errors import UsageError, add_adapt_flag, add_trust_flag, run_cli
from audioclf.inference.artefacts import describe_adaptation
from audioclf.inference.exporting import (
    DEFAULT_OPSET,
    DEFAULT_TOLERANCE,
    FORMATS,
    ExportError,
    ParityError,
    export_model,
)
from audioclf.inference.sidecar import sidecar_path

PROG = "python -m audioclf.export"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        help="audioclf checkpoint (e.g. runs/<name>/best.pt)",
    )
    parser.add_argument("--format", required=True, choices=FORMATS, help="artefact format")
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        help="artefact path; the sidecar goes to <out>.json (--format folder: the folder)",
    )
    parser.add_argument(
        "--no-frontend",
        action="store_true",
        help="take log-mel features instead of waveforms (torchscript, onnx)",
    )
    parser.add_argument(
        "--opset",
        type=int,
        default=DEFAULT_OPSET,
        help=f"ONNX opset (default {DEFAULT_OPSET}, the lowest the exporter writes)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"max abs difference allowed by the parity check (default {DEFAULT_TOLERANCE:g})",
    )
    parser.add_argument(
        "--model-name",
        choices=choices(ModelConfig, "name"),
        help="fail unless the checkpoint holds this model",
    )
    add_adapt_flag(parser)
    parser.add_argument(
        "--report",
        type=Path,
        metavar="REPORT_JSON",
        help="--format folder: the evaluation report.json the model card quotes (default: "
        "eval/report.json in the checkpoint's run folder, when it evaluated this checkpoint)",
    )
    add_trust_flag(parser)
    return parser.parse_intermixed_args(argv)  # options and files in any order


def run(args: argparse.Namespace) -> int:
    try:
        meta = export_model(
            args.checkpoint,
            args.format,
            args.out,
            frontend=not args.no_frontend,
            opset=args.opset,
            tolerance=args.tolerance,
            model_name=args.model_name,
            trust=args.trust_checkpoint,
            adapt=args.adapt or (),
            report=args.report,
        )
    except ParityError as exc:
        print(f"{PROG}: parity check failed: {exc}", file=sys.stderr)
        return 1
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    shapes = ", ".join("x".join(map(str, s)) for s in meta.parity["input_shapes"])
    outputs = f"{meta.embedding_dim}-d embeddings"
    if meta.classes:
        outputs += f" and logits of {len(meta.classes)} classes"
    print(f"exported {meta.format} ({meta.input_kind} input, {outputs}) to {args.out}")
    if meta.adaptation:
        print(f"adapted first:{describe_adaptation(meta.adaptation).removeprefix(',')}")
    print(
        f"parity: max abs difference {meta.parity['max_abs_diff']:.3g} on inputs {shapes} "
        f"(tolerance {meta.parity['tolerance']:g})"
    )
    if meta.format == "folder":
        print(
            f"model card: {args.out / 'README.md'}; load it with audioclf.load({str(args.out)!r})"
        )
    else:
        print(f"sidecar: {sidecar_path(args.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
