"""The folder format: a model to hand to someone else, the way the field shares models.

    DIR/model.safetensors   the weights (safetensors: no code runs while loading; memory-mapped)
    DIR/config.json         what audioclf.load needs (the run's config, the classes, the epoch,
                            the adaptation) and the export sidecar's fields (inputs, outputs,
                            parity, versions), with the folder format's number
    DIR/README.md           the model card (inference/card.py), written from the run's files

    write_folder(net, cfg, ckpt, folder, source)   # what `export --format folder` writes first
    ckpt = read_folder(folder)                      # a checkpoint-shaped dict; no pickle at all

`load_trained` (and so `audioclf.load`, evaluate, embed, search, serve, model.init_from) read a
folder through read_folder, as they read a checkpoint through checkpoint.load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from audioclf import __version__
from audioclf.checkpoint import CheckpointError, is_model_folder, library_versions
from audioclf.config import Config, to_dict
from audioclf.fileio import atomic_write_bytes
from audioclf.inference.sidecar import ExportSidecar

FOLDER_FORMAT = 1  # config.json's "folder_format"; a folder of another number is refused
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
# The checkpoint entries config.json carries besides the config (load_trained reads them).
ENTRIES = ("classes", "epoch", "step", "last_metrics", "adaptation")
_AGAIN = "export the model again with python -m audioclf.export --format folder"


def write_folder(net: nn.Module, cfg: Config, ckpt: dict, folder: Path, source: Path) -> None:
    """The weights and config.json of `net` in the new folder `folder` (the card comes later)."""
    from safetensors.torch import save_file  # noqa: PLC0415 - only exports and loads need it

    folder.mkdir(parents=True)
    state = {key: value.detach().cpu().contiguous() for key, value in net.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    entries = {key: ckpt.get(key) for key in ENTRIES}
    entries["classes"] = list(entries["classes"] or [])
    write_config(
        folder,
        {
            "folder_format": FOLDER_FORMAT,
            "audioclf_version": str(__version__),
            **entries,
            "exported_from": str(source),
            "versions": library_versions(),
            "config": to_dict(cfg),
        },
    )


def write_config(folder: Path, fields: dict[str, Any]) -> None:
    """config.json, atomically."""
    atomic_write_bytes(folder / CONFIG_FILE, (json.dumps(fields, indent=2) + "\n").encode())


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a model folder; CheckpointError (one line) when it is missing, not JSON,
    or of another folder format."""
    path = folder / CONFIG_FILE
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder} has no {CONFIG_FILE}: it is not a whole model folder; {_AGAIN}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); {_AGAIN}"
        ) from None
    if not isinstance(fields, dict) or not isinstance(fields.get("config"), dict):
        raise CheckpointError(f"{path} is not an audioclf model folder's config; {_AGAIN}")
    number = fields.get("folder_format")
    if number != FOLDER_FORMAT:
        made_by = fields.get("audioclf_version", "an unknown version")
        raise CheckpointError(
            f"{path} is of folder format {number} (written by audioclf {made_by}); this audioclf "
            f"({__version__}) reads format {FOLDER_FORMAT}: load it with audioclf {made_by}, or "
            f"{_AGAIN} from its checkpoint"
        )
    return fields


def read_folder(folder: str | Path) -> dict[str, Any]:
    """A model folder as a checkpoint-shaped dict ({"model": weights, "config", "classes",
    "epoch", "step", "last_metrics", "adaptation", "versions"}), read without pickle.
    CheckpointError names the damaged file and the fix."""
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    folder = Path(folder)
    fields = read_config(folder)
    weights = folder / WEIGHTS_FILE
    try:
        state = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"{weights} cannot be read ({reason}); it may be truncated or damaged — {_AGAIN}"
        ) from None
    entries = {key: fields.get(key) for key in (*ENTRIES, "versions", "config")}
    return {"model": state, **entries, "folder": str(folder)}


# ---------------------------------------------------------------------------------------------
# Writing a folder in place (export_model: into a temporary folder, then renamed)


def check_folder_out(out: Path) -> None:
    """ValueError when `out` cannot become a model folder: a file, or a folder of other files."""
    if out.is_file():
        raise ValueError(
            f"--out {out} is a file; a folder export writes a folder: give a new path such as "
            f"{out.with_suffix('')}_model"
        )
    if out.is_dir() and any(out.iterdir()) and not is_model_folder(out):
        raise ValueError(
            f"--out {out} is a folder holding other files; give a new folder (or an exported "
            "model folder, which is replaced)"
        )


def finish_folder(folder: Path, sidecar: ExportSidecar, card: str) -> None:
    """config.json gains the export sidecar's fields (inputs, outputs, parity, versions); the
    model card goes beside it."""
    fields = read_config(folder)
    described = json.loads(sidecar.to_json())
    described["file"] = WEIGHTS_FILE
    write_config(folder, {**described, **fields})
    atomic_write_bytes(folder / CARD_FILE, card.encode())


def place_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder `tmp` to `out`, replacing an exported folder there (which is
    moved aside first, so `out` is never a mixture of the two)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}.replaced")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_tree_or_file(path: Path) -> None:
    """A temporary export, file or folder, gone (nothing when it is not there)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
