"""Mixed precision, decided once per run.

The loop always enters the same autocast context and calls the same GradScaler; both are no-ops
in fp32, so the loop has no precision branches (nanoGPT's pattern). `train.precision=auto`
picks what fits the device: bf16 on GPUs with native bfloat16 (compute capability 8.0+ or ROCm),
fp16 with loss scaling on older GPUs, fp32 on a CPU (CPU_BF16_COST; benchmarks/RESULTS.md,
"Other figures").
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from audioclf.config import TrainConfig

log = logging.getLogger("audioclf")

_AUTOCAST_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


CPU_BF16_COST = (
    "bf16 autocast on a CPU measured 10-20x slower per training step than fp32 "
    "(44-51 s against 2.3-4.8 s, batch 16 x 3 s, 2 threads)"
)


@dataclass
class Precision:
    """The autocast context and GradScaler for one run (fp32: both are no-ops)."""

    name: str
    device: torch.device
    dtype: torch.dtype | None
    scaler: torch.amp.GradScaler
    reason: str = ""  # why train.precision=auto chose it ("" when given outright)

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> Precision:
    """precision: auto | fp32 | fp16 | bf16; the apex alias opt_level O0..O3 overrides it."""
    name, reason = cfg.precision, ""
    if name == "auto":
        name, reason = auto_precision(device)
    if cfg.opt_level is not None:
        if cfg.opt_level in ("O2", "O3"):
            warnings.warn(
                f"train.opt_level={cfg.opt_level} (apex) has no torch.amp equivalent; using O1 "
                "(fp16 autocast with dynamic loss scaling). Set train.precision=bf16 on Ampere+ GPUs",
                stacklevel=2,
            )
        name = "fp32" if cfg.opt_level == "O0" else "fp16"
    if name == "bf16" and device.type == "cuda" and not _native_bf16(device):
        raise ValueError(
            f"train.precision=bf16 needs a GPU with native bfloat16 (compute capability 8.0+, "
            f"e.g. A100, H100); {torch.cuda.get_device_name(device)} only emulates it, much "
            "slower than fp32: use train.precision=fp16 (with loss scaling) or fp32"
        )
    if name == "bf16" and device.type == "cpu" and cfg.precision == "bf16":
        log.warning(
            "train.precision=bf16 on a CPU: %s; train.precision=auto (or fp32) trains in fp32 here",
            CPU_BF16_COST,
        )
    scaler = torch.amp.GradScaler(device.type, enabled=(name == "fp16"))
    return Precision(name, device, _AUTOCAST_DTYPES[name], scaler, reason)


def auto_precision(device: torch.device) -> tuple[str, str]:
    """(precision, why) for train.precision=auto on `device`."""
    if device.type != "cuda":
        return "fp32", f"auto on {device.type}: {CPU_BF16_COST}"
    gpu = torch.cuda.get_device_name(device)
    if _native_bf16(device):
        return "bf16", f"auto: {gpu} has native bfloat16"
    return (
        "fp16",
        f"auto: {gpu} has no native bfloat16 (compute capability below 8.0): fp16 with loss scaling",
    )


def full_precision(device: torch.device) -> Precision:
    """fp32 on `device`, as inference runs."""
    return resolve_precision(TrainConfig(precision="fp32"), device)


def _native_bf16(device: torch.device) -> bool:
    """bfloat16 arithmetic in hardware: compute capability 8.0 (Ampere) or newer, or ROCm."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


@dataclass(frozen=True)
class BackendFlags:
    """torch's process-wide TF32 and cuDNN autotuning flags (plain attributes, on a CPU too).

    `BackendFlags.current()` reads them, `.apply()` sets them: the Trainer puts back at its
    close what it found, so a run in this process (a benchmark cell, a test) leaves no TF32 or
    autotuning behind for what runs next."""

    matmul_tf32: bool
    cudnn_tf32: bool
    cudnn_benchmark: bool

    @classmethod
    def current(cls) -> BackendFlags:
        backends = torch.backends
        return cls(
            backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, backends.cudnn.benchmark
        )

    def apply(self) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_tf32
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark


EXACT = BackendFlags(matmul_tf32=False, cudnn_tf32=False, cudnn_benchmark=False)


def configure_backends(cfg: TrainConfig, device: torch.device) -> None:
    """TF32 matmuls/convolutions (train.tf32) and cuDNN autotuning (train.cudnn_benchmark) on
    CUDA; train.deterministic turns autotuning off."""
    if device.type != "cuda":
        return
    BackendFlags(cfg.tf32, cfg.tf32, cfg.cudnn_benchmark and not cfg.deterministic).apply()


class _ExactHolders:
    """The threads inside exact_arithmetic, counted under a lock: the first in saves the flags
    and sets EXACT and the eager stance, the last out puts them back. A save and restore per
    thread let a leaving thread turn TF32 back on under another's batch (a server's batcher
    and search threads: issue 42)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.saved = EXACT
        self.stance = ExitStack()

    def enter(self) -> None:
        with self.lock:
            if not self.count:
                self.saved = BackendFlags.current()
                self.stance.enter_context(torch.compiler.set_stance("force_eager"))
                EXACT.apply()
            self.count += 1

    def leave(self) -> None:
        with self.lock:
            self.count -= 1
            if not self.count:
                self.stance.close()
                self.saved.apply()


_exact_holders = _ExactHolders()


@contextmanager
def exact_arithmetic() -> Iterator[None]:
    """Inside: fp32 matmuls and convolutions without TF32, no cuDNN autotuning, and compiled
    modules run eagerly (train.compile); the previous settings after. Embedding extraction runs
    so (validation, evaluate, embed): its clips vary in length, so autotuning would re-tune and
    a compiled model recompile per batch, and validation's metrics (which pick best.pt) then
    equal evaluate's. Mixed precision still applies where asked for.

    The flags are process-wide: threads may enter and leave in any order (a server's batcher
    and its search threads), and the settings found by the first to enter come back when the
    last leaves."""
    _exact_holders.enter()
    try:
        yield
    finally:
        _exact_holders.leave()
