"""What the command-line entry points share: the error policy, devices, the export sidecar.

Every `python -m audioclf.<tool>` parses its arguments and hands its body to `run_cli`:

    def main(argv=None) -> int:
        args = parse_args(argv)
        return run_cli(PROG, lambda: run(args))

Error policy (one for all tools): bad input — a ValueError or OSError anywhere, or any error
raised by audioclf's own code — prints one line `<prog>: error: <message>` and exits 2. An
error raised inside a library (torch, numpy, ...) for another reason keeps its traceback, as a
bug should. AUDIOCLF_DEBUG=1 shows every traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEBUG_ENV = "AUDIOCLF_DEBUG"  # set to 1 to get tracebacks instead of one-line errors
PACKAGE_DIR = Path(__file__).resolve().parent


class AlreadyReported(Exception):
    """An error another process (rank 0, the failing rank) reports: exit 2 without a word."""


class UsageError(ValueError):
    """Bad command-line input (flags, paths); the CLI prints it as one line and exits 2."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: worker tracebacks reduced to their final message."""
    text = str(exc).strip() or type(exc).__name__
    if "Original Traceback" in text:  # raised inside a DataLoader worker
        last = [line for line in text.splitlines() if line.strip()][-1]
        head, sep, message = last.partition(": ")
        text = message if sep and "." in head and " " not in head else last
    return " ".join(text.split())


def is_user_error(exc: BaseException) -> bool:
    """Bad input with a clear message: ValueError / OSError, or raised by audioclf itself."""
    if isinstance(exc, (ValueError, OSError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE_DIR)


def run_cli(prog: str, run: Callable[[], int]) -> int:
    """Run a CLI body under the error policy above; returns the exit status."""
    try:
        return run()
    except AlreadyReported:
        return 2
    except Exception as exc:
        if not is_user_error(exc) or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        # Under torchrun another rank's progress bar may hold the terminal's current line.
        fresh_line = "\n" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{fresh_line}{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available) → a device that exists here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name} was requested but CUDA is not available here; "
                             "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    elif device.type != "cpu":
        raise UsageError(f"--device {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    return device


# ---------------------------------------------------------------------------------------------
# The export sidecar: what `export` writes next to an artefact and `embed` reads back


def sidecar_path(artefact: str | Path) -> Path:
    """<artefact>.json"""
    artefact = Path(artefact)
    return artefact.with_name(artefact.name + ".json")


@dataclass
class ExportSidecar:
    """Everything needed to run an exported model without audioclf's training config."""

    format: str  # torchscript | onnx | state_dict
    file: str  # the artefact's file name
    input_kind: str  # "waveform" or "log_mel"
    inputs: dict[str, str]  # input name -> what it holds
    outputs: dict[str, str]  # output name -> what it holds
    output_names: list[str]
    embedding_dim: int
    sample_rate: int
    features: dict[str, Any]  # the FeaturesConfig the model was trained with
    model: dict[str, Any]  # the ModelConfig
    classes: list[str]  # names of the classifier head's outputs ([] without a head)
    data_columns: dict[str, Any]  # index sheet column settings (for reading a gallery)
    checkpoint: dict[str, Any]  # source checkpoint path, epoch, step
    parity: dict[str, Any]  # max_abs_diff, tolerance, input_shapes
    versions: dict[str, str]
    opset: int | None = None  # ONNX only
    clips: dict[str, Any] = dataclasses.field(default_factory=dict)  # how evaluation reads files

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if self.opset is None:
            del fields["opset"]
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def read(cls, path: str | Path) -> ExportSidecar:
        """Parse a sidecar; ValueError / KeyError / TypeError when it is not one."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def sidecar_config(meta: ExportSidecar):
    """A Config holding what a sidecar records (features, clips, the sheet's columns); older
    sidecars' features sections are read as their release wrote them. Raises ConfigError."""
    from audioclf.config import config_from_dict

    return config_from_dict({"features": meta.features, "clips": meta.clips,
                             "data": meta.data_columns})
