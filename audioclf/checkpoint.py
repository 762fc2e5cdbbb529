"""Checkpoints: one flat dict, written atomically, kept as last / best / the last K epochs.

A checkpoint holds everything needed to resume bit-exactly (model, optimizer, LR schedule,
grad scaler, sampler position, every rank's RNG states) and to rebuild the model without the
original config file (the resolved config travels inside).

Checkpoints are data, not code. What audioclf writes is tensors and plain containers of
numbers and strings (the numpy RNG state as a tensor, not an ndarray), and every load uses
`torch.load(weights_only=True)`, which builds nothing else: a file carrying a pickled object
(a payload whose unpickling would run code) is refused with one line naming the file and
the opt-in (`trust=True`: --trust-checkpoint, checkpoint.trust=true) for a file one trusts.
Checkpoints of audioclf 0.1 hold numpy arrays (RNG states) and torch's TorchVersion string;
those data-only constructors are allow-listed for every load (they build arrays and strings,
never run code), so those files load as they are.

`Checkpointer` is built once with the run's stateful parts, by name (torchtitan's
`states={...}`, timm's `CheckpointSaver(model=..., optimizer=...)`); the loop then only says
`save_last()` or `save_epoch(epoch, metric)`, and a resume is one `restore(ckpt)`.
`CheckpointSaver` decides which files are kept.
"""

from __future__ import annotations

import logging
import pickle
import platform
import random
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torchaudio

from audioclf import __version__, distributed
from audioclf.fileio import atomic_copy, atomic_write

log = logging.getLogger("audioclf")

LAST = "last.pt"
BEST = "best.pt"
AVG = "avg.pt"  # checkpoint.average_last: the average of the last epochs' weights


def epoch_path(run_dir: str | Path, epoch: int) -> Path:
    """epoch_<N>.pt of a run folder (`epoch` 1-based)."""
    return Path(run_dir) / f"epoch_{epoch:04d}.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit; the message names the file and the fix."""


def library_versions() -> dict[str, str]:
    return {  # str(): torch's TorchVersion is a str subclass that weights_only does not build
        "audioclf": str(__version__),
        "torch": str(torch.__version__),
        "torchaudio": str(torchaudio.__version__),
        "numpy": str(np.__version__),
        "python": platform.python_version(),
    }


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU, and `device`'s when it is a GPU.

    Only the process's own GPU: a checkpoint then resumes on a machine with fewer GPUs. Plain
    data only (tuples, numbers, strings, tensors), so weights_only loading reads it.
    """
    name, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["bit_generator"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)  # a tuple with an ndarray in checkpoints of audioclf 0.1
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or device is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):  # older checkpoints: one state per visible GPU
        index = device.index or 0
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RankRNG:
    """Every rank's RNG streams, as one checkpoint entry (a list ordered by rank).

    `state_dict` is collective: every rank must call it (the states are gathered). On restore a
    rank takes its own entry; with another world size the streams stay as seeded, which is said.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device | None = None):
        self.rank, self.world_size, self.device = rank, world_size, device

    def state_dict(self) -> list[dict[str, Any]]:
        return distributed.gather_objects(rng_state(self.device))

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        states = states or []
        if len(states) == self.world_size:
            set_rng_state(states[self.rank], self.device)
        else:
            log.warning(
                "resuming with %d ranks from a %d-rank checkpoint: random streams are "
                "reseeded, so the run is not bit-identical",
                self.world_size,
                len(states),
            )


class ScalerState:
    """The fp16 GradScaler as a checkpoint entry. A bf16 / fp32 checkpoint holds no scale: an
    fp16 run resumed from it starts a fresh one (said in the log), and an fp16 checkpoint
    resumed in bf16 / fp32 drops it."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler.is_enabled() and not state:
            log.info("resuming fp16 from a checkpoint without a loss scale: starting a fresh one")
            return
        self.scaler.load_state_dict(state)


class Checkpointer:
    """Saves a run's stateful parts by name into one flat dict, and restores them.

    `states` go under their names ("model", "optimizer", ...); `flat` states (the trainer's
    counters, the saver's best metric) are merged into the top level, as nanoGPT keeps
    `iter_num`; `meta()` adds what is written but never restored (config, classes, versions).
    Saving is collective — every rank must call `save_last` / `save_epoch` (RNG states are
    gathered) — and rank 0 alone writes.
    """

    def __init__(
        self,
        saver: CheckpointSaver,
        *,
        states: dict[str, Stateful],
        flat: list[Stateful],
        meta: Callable[[], dict],
        primary: bool,
        optional: tuple[str, ...] = (),
    ):
        self.saver = saver
        self.states = states
        self.flat = flat
        self.meta = meta
        self.primary = primary
        self.optional = optional

    def state_dict(self) -> dict:
        """The checkpoint dict (collective: every rank must call it)."""
        state = {name: part.state_dict() for name, part in self.states.items()}
        for part in self.flat:
            state.update(part.state_dict())
        state.update(self.meta())
        return state

    def save_last(self) -> Path | None:
        """last.pt (collective); returns its path on rank 0."""
        state = self.state_dict()
        return self.saver.save_last(state) if self.primary else None

    def save_epoch(self, epoch: int, metric: float | None) -> list[Path]:
        """End of an epoch (collective): last.pt, epoch_<N>.pt and best.pt when `metric` is the
        best so far; returns the files rank 0 wrote."""
        state = self.state_dict()
        return self.saver.save_epoch(state, epoch, metric) if self.primary else []

    def save_average(self, weights: dict, metric: float | None, about: dict) -> list[Path]:
        """After the last epoch (collective): avg.pt, a checkpoint of the run whose model
        weights are `weights` (`about` them under "average_of"), then last.pt; best.pt = avg.pt
        when `metric` beats the best epoch. Returns the files rank 0 wrote."""
        if not self.primary:
            self.state_dict()  # the collectives (RNG states) of the primary's call
            return []
        better = self.saver.is_better(metric)
        if better:
            self.saver.best_metric = float(metric)
        return self.saver.save_average(self.state_dict(), weights, about, best=better)

    def restore(self, ckpt: dict) -> None:
        """Load every part from a checkpoint dict (each rank, no collective). A part named in
        `optional` that the checkpoint lacks (an EMA switched on at resume) gets None."""
        for part in self.flat:
            part.load_state_dict(ckpt)
        for name, part in self.states.items():
            if name not in ckpt and name in self.optional:
                part.load_state_dict(None)
            else:
                part.load_state_dict(ckpt[name])


def save_atomic(obj: dict, path: str | Path) -> Path:
    """torch.save to a temporary file in the same folder, fsync, then os.replace."""
    return atomic_write(path, lambda handle: torch.save(obj, handle), sync=True)


# Data-only constructors that checkpoints of audioclf 0.1 hold (numpy RNG states and scalars,
# torch's version string): they build arrays, dtypes and a str subclass and cannot run code, so
# every weights_only load accepts them.
_EARLIER_RELEASE = [
    torch.torch_version.TorchVersion,
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
    np.dtypes.Float64DType,
    np.dtypes.Int64DType,
    getattr(np, "_core", np.core).multiarray._reconstruct,
    getattr(np, "_core", np.core).multiarray.scalar,
]
_OTHER_CHECKPOINT = "use another checkpoint of the run (last.pt, best.pt, epoch_*.pt)"
TRUST_HINT = (
    "if you trust the file and its source, load it with --trust-checkpoint "
    "(training: checkpoint.trust=true)"
)


_SHEET = "a sheet (an index of clips?)"
# Files handed over as a model that are something else: (their first bytes, suffixes, what they
# are). A file is taken for one of these by its first bytes or its suffix, whichever says so.
_NOT_MODELS = (
    ((b"\x93NUMPY",), (".npy",), "a NumPy array (embeddings?)"),
    ((b"PAR1",), (".parquet",), "a Parquet table (an embed --index PREFIX.parquet?)"),
    ((b"\xd0\xcf\x11\xe0",), (".xls", ".xlsx", ".xlsm", ".csv", ".tsv", ".ods"), _SHEET),
    (
        (b"RIFF", b"fLaC", b"OggS", b"ID3", b"\xff\xfb", b"\xff\xf3"),
        (".wav", ".flac", ".ogg", ".opus", ".mp3", ".m4a", ".aiff", ".aif"),
        "an audio file (a clip to embed?)",
    ),
)
MODEL_SUFFIXES = (".pt", ".pth", ".onnx")  # what a folder's model files are named
# The files of an exported model folder (export --format folder; inference/folder.py).
MODEL_FOLDER_FILES = ("model.safetensors", "config.json")


def is_model_folder(path: Path) -> bool:
    """A folder written by `export --format folder` (or one of its two files left): not a run."""
    return path.is_dir() and any((path / name).is_file() for name in MODEL_FOLDER_FILES)


def not_a_model(path: Path) -> str | None:
    """What the file at `path` is when it is plainly not a model (by its first bytes or its
    suffix: "a NumPy array (embeddings?)", "a sheet ...", "an audio file ..."); None otherwise."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except OSError:
        return None
    if head.startswith(b"PK") and (names := _zip_names(path)) is not None:
        return _zip_kind(names)  # torch.save's and torch.jit.save's files are zips too
    suffix = path.suffix.lower()
    for magics, suffixes, what in _NOT_MODELS:
        if head.startswith(magics) or suffix in suffixes:
            return what
    return None


def _zip_names(path: Path) -> list[str] | None:
    """The entries of a zip archive; None when it cannot be read (a damaged one)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return None


def _zip_kind(names: list[str]) -> str | None:
    """What a zip archive holding `names` is; None for torch's (a data.pkl in its folder)."""
    if any(name.endswith("/data.pkl") for name in names):
        return None
    if any(name.startswith("xl/") for name in names):
        return _SHEET
    if names and all(name.endswith(".npy") for name in names):
        return "a NumPy archive (.npz)"
    return "a zip archive"


def model_file(path: str | Path, named: str = "checkpoint") -> Path:
    """The model file `path` names: itself, an exported model folder (is_model_folder) itself,
    or in a folder its run's best.pt, else the one checkpoint or export (*.pt, *.pth, *.onnx)
    it holds. CheckpointError, naming the folder as `named` (e.g. "--model"), when it holds
    none or several (listed), or is not there."""
    path = Path(path)
    if is_model_folder(path) and not (path / BEST).is_file():
        return path
    if not path.is_dir():
        if not path.is_file():
            raise CheckpointError(f"{named} {path} does not exist; check the path or the run name")
        return path
    if (path / BEST).is_file():
        return path / BEST
    found = sorted(
        p.name
        for p in path.iterdir()
        if p.is_file() and p.suffix.lower() in MODEL_SUFFIXES and not_a_model(p) is None
    )
    if len(found) == 1:
        return path / found[0]
    if not found:
        raise CheckpointError(
            f"{named} {path} is a folder holding no model (no best.pt, no checkpoint .pt or "
            "export); pass the model file itself"
        )
    raise CheckpointError(
        f"{named} {path} is a folder holding {len(found)} models and no best.pt "
        f"({', '.join(found)}); pass one of them"
    )


def _is_torchscript(path: Path) -> bool:
    """A torch.jit.save archive: a zip holding constants.pkl (a checkpoint's zip does not)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/constants.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def load(
    path: str | Path, map_location: str | torch.device = "cpu", *, trust: bool = False
) -> dict:
    """Read a checkpoint written by audioclf; a clear error when missing, corrupt or foreign.

    weights_only unless `trust`: a file that needs more than tensors and plain data (a foreign
    pickle, or a payload) is refused before any of it runs.
    """
    path = model_file(path)
    if (what := not_a_model(path)) is not None:
        raise CheckpointError(f"{path} is {what}, not a model; pass an audioclf checkpoint (.pt)")
    if _is_torchscript(path):  # torch.load would hand it to torch.jit.load, with a warning
        raise CheckpointError(
            f"{path} is a TorchScript export, not an audioclf checkpoint; {_OTHER_CHECKPOINT}"
        )
    try:
        with torch.serialization.safe_globals(_EARLIER_RELEASE):
            ckpt = torch.load(path, map_location=map_location, weights_only=not trust)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" not in str(exc):  # not a refused object: a damaged file
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({_reason(exc)}); it may be "
                f"truncated — {_OTHER_CHECKPOINT}"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} holds Python objects beyond tensors and plain data "
            f"({_first_global(exc)}), which could run code when loaded, so it was not loaded; "
            f"{TRUST_HINT}"
        ) from None
    except Exception as exc:  # torch raises many types for truncated/corrupt files
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}); it may be truncated "
            f"— {_OTHER_CHECKPOINT}"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise CheckpointError(
            f"{path} is not an audioclf checkpoint (expected a dict with 'model' and 'config'); "
            "exported models are loaded with torch.jit.load / onnxruntime instead"
        )
    return ckpt


class CheckpointSaver:
    """Keeps last.pt, best.pt and the last `keep_last` epoch checkpoints in a run directory
    (at least `average_last` of them, which checkpoint.average_last reads), and avg.pt.

    best.pt follows the highest finite metric (every validation metric is higher-is-better).
    """

    def __init__(self, run_dir: str | Path, *, keep_last: int, average_last: int = 0):
        self.run_dir = Path(run_dir)
        self.keep_last = max(keep_last, average_last)
        self.best_metric: float | None = None

    def is_better(self, metric: float | None) -> bool:
        if metric is None or not np.isfinite(metric):
            return False
        return self.best_metric is None or metric > self.best_metric

    def state_dict(self) -> dict:
        return {"best_metric": self.best_metric}

    def load_state_dict(self, state: dict) -> None:
        self.best_metric = state.get("best_metric")

    def save_last(self, state: dict) -> Path:
        """last.pt; refused (CheckpointError, nothing written) when a model tensor is not finite."""
        bad = [
            name
            for name, tensor in state.get("model", {}).items()
            if torch.is_tensor(tensor)
            and tensor.is_floating_point()
            and not bool(torch.isfinite(tensor).all())
        ]
        if bad:
            raise CheckpointError(
                f"refusing to write {self.run_dir / LAST}: {len(bad)} model tensor(s) hold NaN or "
                f"inf (first {bad[0]!r}); the run diverged. Resume from the last good checkpoint "
                "with a lower optim.lr or optim.max_grad_norm"
            )
        return save_atomic(state, self.run_dir / LAST)

    def save_epoch(self, state: dict, epoch: int, metric: float | None) -> list[Path]:
        """End of an epoch: last.pt, epoch_<N>.pt (pruned to keep_last) and best.pt if improved."""
        written = [self.save_last(state)]
        if self.keep_last > 0:
            written.append(atomic_copy(written[0], epoch_path(self.run_dir, epoch)))
            for old in sorted(self.run_dir.glob("epoch_*.pt"))[: -self.keep_last]:
                old.unlink(missing_ok=True)
        if self.is_better(metric):
            self.best_metric = float(metric)
            written.append(atomic_copy(written[0], self.run_dir / BEST))
        return written

    def save_average(self, state: dict, weights: dict, about: dict, *, best: bool) -> list[Path]:
        """avg.pt (`state` with `weights` as its model, `about` as "average_of", and no EMA
        entry: the average is what it holds), best.pt when `best`, then last.pt (`state`)."""
        averaged = {key: value for key, value in state.items() if key != "ema"}
        averaged.update(model=weights, average_of=about)
        written = [save_atomic(averaged, self.run_dir / AVG)]
        if best:
            written.append(atomic_copy(written[0], self.run_dir / BEST))
        written.append(self.save_last(state))
        return written


def _reason(exc: BaseException) -> str:
    """torch's weights_only failure, cut to its own last line (it adds advice about torch 2.6)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else exc}"


def _first_global(exc: BaseException) -> str:
    """The object torch's weights_only unpickler refused, e.g. 'posix.system'."""
    match = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return match.group(1) if match else "an object weights_only loading does not build"


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """checkpoint.resume: '' → None, 'auto' → run_dir/last.pt when it exists, else a path."""
    if not resume:
        return None
    if resume == "auto":
        last = Path(run_dir) / LAST
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint.resume={resume}: file not found; use 'auto' or an existing .pt path"
        )
    return path
