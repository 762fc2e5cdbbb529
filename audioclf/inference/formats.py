"""The artefact formats, each written and read back in one place: TorchScript and ONNX.

A loaded artefact is a callable `(x, lengths) -> tuple of tensors` (embeddings first, logits
second with a classifier head): what the parity check compares and `load_embedder` wraps.
The ONNX packages are optional and imported only when an ONNX file is written or read.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from audioclf.inference.extract import WAVEFORM

LoadedArtefact = Callable[[Tensor, Tensor], tuple[Tensor, ...]]


class ExportError(RuntimeError):
    """The model could not be exported (or an optional package is missing)."""


def as_tuple(output) -> tuple[Tensor, ...]:
    if isinstance(output, (tuple, list)):
        return tuple(torch.as_tensor(o) for o in output)
    return (torch.as_tensor(output),)


# ---------------------------------------------------------------------------------------------
# TorchScript


def write_torchscript(module: nn.Module, path: Path, *, what: str | None = None) -> None:
    """torch.jit.script + save; ExportError (one line) when scripting fails. `what` names the
    scripted network in that message (default: the module's class)."""
    what = what or type(module).__name__
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated in torch >= 2.10
            scripted = torch.jit.script(module)
            torch.jit.save(scripted, str(path))
    except Exception as exc:  # the scripting compiler raises many error types
        raise ExportError(f"torch.jit.script failed for the {what}: {exc}") from None


def load_torchscript(path: Path, device: str | torch.device = "cpu") -> LoadedArtefact:
    with warnings.catch_warnings():
        # torch.jit.load is deprecated too: a FutureWarning in torch 2.14, a DeprecationWarning
        # in torch 2.11, so matched by its message
        warnings.filterwarnings("ignore", message="`torch.jit.load` is")
        scripted = torch.jit.load(str(path), map_location=device)
    scripted.eval()
    return lambda x, lengths: as_tuple(scripted(x, lengths))


# ---------------------------------------------------------------------------------------------
# ONNX


def onnx_modules():
    """(onnx, onnxruntime), imported lazily; ExportError naming the pip command when missing."""
    missing = []
    modules = {}
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            modules[name] = __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ExportError(
            f"ONNX export needs the optional package(s) {', '.join(missing)}, which are not "
            "installed: pip install onnx onnxscript onnxruntime"
        )
    return modules["onnx"], modules["onnxruntime"]


def onnx_io_names(kind: str, with_logits: bool) -> tuple[list[str], list[str]]:
    inputs = ["waveform" if kind == WAVEFORM else "features", "lengths"]
    outputs = ["embeddings", "logits"] if with_logits else ["embeddings"]
    return inputs, outputs


def write_onnx(
    module: nn.Module,
    path: Path,
    *,
    kind: str,
    example: tuple[Tensor, Tensor],
    opset: int,
    with_logits: bool,
) -> None:
    onnx, _ = onnx_modules()
    input_names, output_names = onnx_io_names(kind, with_logits)
    batch = torch.export.Dim("batch")
    time_axis = torch.export.Dim("samples" if kind == WAVEFORM else "frames")
    captured = io.StringIO()
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)  # progress lines and "torchvision is not installed"
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(captured):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                example,
                str(path),
                dynamo=True,
                external_data=False,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes={"x": {0: batch, 1: time_axis}, "lengths": {0: batch}},
            )
        onnx.checker.check_model(str(path))
    except Exception as exc:  # torch.export / onnxscript raise many error types
        raise ExportError(f"ONNX export failed ({type(exc).__name__}): {exc}") from None
    finally:
        onnx_logger.setLevel(level)


def load_onnx(path: Path, device: str | torch.device = "cpu") -> LoadedArtefact:
    """An onnxruntime session on the CPU as `(x, lengths) -> outputs` (device is ignored)."""
    _, ort = onnx_modules()
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's errors (InvalidProtobuf, ...) are plain Exceptions
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        raise ValueError(str(exc).rsplit(" failed:", 1)[-1].strip()) from None
    names = [i.name for i in session.get_inputs()]

    def run(x: Tensor, lengths: Tensor) -> tuple[Tensor, ...]:
        feeds = {
            names[0]: x.cpu().numpy().astype(np.float32),
            names[1]: lengths.cpu().numpy().astype(np.int64),
        }
        return tuple(torch.from_numpy(o) for o in session.run(None, feeds))

    return run
