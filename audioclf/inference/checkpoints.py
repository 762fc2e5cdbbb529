"""Checkpoints outside the training loop: rebuild the model one describes, or load its weights
into a new run's model for fine-tuning.

    net, cfg, ckpt = load_trained("runs/demo/best.pt")        # EmbeddingNet in eval mode
    notes = init_weights(net, "runs/demo/best.pt", classes)   # model.init_from (the trainer)

A state_dict export (`audioclf.export --format state_dict`) is a checkpoint without optimizer
state, and a model folder (`--format folder`) reads as one (inference/folder.py), so both read
them too. The weights are the EMA's ("ema") when the run kept one
(train.ema_decay > 0 in the checkpoint's config) and the entry is there, else "model" (avg.pt
holds the average there); describe_checkpoint says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from audioclf import checkpoint
from audioclf.checkpoint import CheckpointError
from audioclf.config import Config, ConfigError, config_from_dict
from audioclf.inference.folder import read_folder
from audioclf.models import EmbeddingNet, build_net

# Prefixes that wrappers add to state-dict keys (DDP / DataParallel, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOW = 3  # keys quoted in a state-dict mismatch message


def load_trained(
    path: str | Path,
    device: str | torch.device = "cpu",
    *,
    model_name: str | None = None,
    trust: bool = False,
) -> tuple[EmbeddingNet, Config, dict]:
    """Rebuild the model a checkpoint describes and load its weights.

    Returns (net in eval mode on `device`, its Config, the checkpoint dict). The architecture
    comes from the config stored in the checkpoint; `model_name` ("cnn", "conformer") only
    asserts what the caller expects. Raises CheckpointError naming the file when it is missing,
    corrupt, not an audioclf checkpoint, of another model, or its weights do not fit its config.
    `trust` loads a file holding more than tensors and plain data (checkpoint.load).
    """
    path, ckpt = read_model(path, "checkpoint", trust=trust)
    cfg = checkpoint_config(ckpt, path)
    if model_name is not None and model_name != cfg.model.name:
        raise CheckpointError(
            f"--model-name {model_name} was requested but {path} holds a {cfg.model.name} model "
            f"(model.name={cfg.model.name} in its config); use a {model_name} checkpoint or drop "
            "--model-name"
        )
    classes = list(ckpt.get("classes") or [])
    if cfg.model.head != "none" and not classes:
        raise CheckpointError(
            f"{path} was trained with a classifier head (model.head={cfg.model.head}) but "
            "holds no 'classes' list, so the head's size is unknown; use a checkpoint written by "
            "audioclf.train"
        )
    try:
        net = build_net(cfg, len(classes))
    except (ValueError, ConfigError) as exc:
        raise CheckpointError(
            f"{path}: its config does not describe a model audioclf can build ({exc})"
        ) from None
    state = _strip_wrapper_prefixes(ckpt[weights_key(ckpt, cfg)])
    _check_state_dict(net.state_dict(), state, path, cfg)
    net.load_state_dict(state)
    return net.to(device).eval(), cfg, ckpt


def init_weights(
    net: EmbeddingNet, path: str | Path, classes: list[str], *, trust: bool = False
) -> list[str]:
    """Fine-tuning: load the weights of a checkpoint or state_dict export into a new run's net.

    The architecture must be the same; a classifier head trained for other classes (or absent
    on one side) is left freshly initialised. Returns notes for the log; CheckpointError names
    the first tensor that does not fit.
    """
    path, ckpt = read_model(path, "model.init_from=", trust=trust)
    saved_cfg = checkpoint_config(ckpt, path)
    state = _strip_wrapper_prefixes(ckpt[weights_key(ckpt, saved_cfg)])
    notes = []
    expected = net.state_dict()
    saved_classes = list(ckpt.get("classes") or [])
    head = [k for k in set(state) | set(expected) if k.startswith("head.")]
    same_head = all(
        k in state and k in expected and state[k].shape == expected[k].shape for k in head
    ) and saved_classes == list(classes)
    if head and not same_head:
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        expected = {k: v for k, v in expected.items() if not k.startswith("head.")}
        notes.append(
            f"model.init_from: the classifier head starts afresh ({len(saved_classes)} "
            f"classes in {path.name}, {len(classes)} here)"
        )
    _check_init_tensors(expected, state, path)
    net.load_state_dict(state, strict=False)
    described = describe_checkpoint(ckpt, saved_cfg)
    notes.insert(0, f"model.init_from: weights of {path} ({described})")
    return notes


def read_model(path: str | Path, named: str, *, trust: bool = False) -> tuple[Path, dict]:
    """The model file `path` names (checkpoint.model_file) and its checkpoint dict: a checkpoint
    or state_dict export through checkpoint.load, an exported model folder through
    read_folder (no pickle)."""
    path = checkpoint.model_file(path, named)
    if checkpoint.is_model_folder(path):
        return path, read_folder(path)
    return path, checkpoint.load(path, map_location="cpu", trust=trust)


def _check_init_tensors(expected: dict[str, Tensor], state: dict, path: Path) -> None:
    """CheckpointError naming the first tensor of `state` that does not fit `expected`."""
    for key, value in expected.items():
        if key not in state:
            raise CheckpointError(
                f"model.init_from={path}: it has no tensor {key!r}; it holds "
                "another architecture (model.* settings must match it)"
            )
        if tuple(state[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"model.init_from={path}: tensor {key!r} is {list(state[key].shape)} there and "
                f"{list(value.shape)} here; the model.* / features.n_mels settings must match it"
            )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"model.init_from={path}: tensor {unexpected[0]!r} has no place in "
            "this model; it holds another architecture"
        )


def checkpoint_config(ckpt: dict, path: str | Path) -> Config:
    """The Config stored in a checkpoint dict; CheckpointError when it cannot be read."""
    try:
        return config_from_dict(ckpt["config"])
    except ConfigError as exc:
        raise CheckpointError(
            f"{path} holds a config this version of audioclf cannot read ({exc}); it was written "
            "by another version — evaluate it with that version"
        ) from None


def weights_key(ckpt: dict[str, Any], cfg: Config) -> str:
    """The entry holding the weights to use: "ema" when the run kept an EMA of its weights
    (train.ema_decay > 0) and the checkpoint holds it, else "model"."""
    return "ema" if cfg.train.ema_decay > 0 and isinstance(ckpt.get("ema"), dict) else "model"


def describe_checkpoint(ckpt: dict[str, Any], cfg: Config) -> str:
    """'cnn, 128-d, epoch 12, step 3400, EMA weights' — for summaries (and evaluate's report);
    a run with data.unlabelled adds its clip count and source."""
    parts = [cfg.model.name, f"{cfg.model.embedding_dim}-d"]
    for key in ("epoch", "step"):
        if ckpt.get(key) is not None:
            parts.append(f"{key} {ckpt[key]}")
    average = ckpt.get("average_of")
    if isinstance(average, dict) and average.get("epochs"):
        epochs = average["epochs"]
        of_ema = " EMA" if average.get("weights") == "ema" else ""
        parts.append(f"mean of the{of_ema} weights of epochs {epochs[0]}-{epochs[-1]}")
    elif weights_key(ckpt, cfg) == "ema":
        parts.append(f"EMA weights (decay {cfg.train.ema_decay:g})")
    unlabelled = ckpt.get("unlabelled")  # data.unlabelled (issue 45)
    if isinstance(unlabelled, dict) and unlabelled.get("clips"):
        parts.append(
            f"trained also on {unlabelled['clips']} unlabelled clips of {unlabelled['source']}"
        )
    return ", ".join(parts)


def _strip_wrapper_prefixes(state: dict) -> dict:
    for prefix in _WRAPPER_PREFIXES:
        if state and all(key.startswith(prefix) for key in state):
            state = {key[len(prefix) :]: value for key, value in state.items()}
    return state


def _check_state_dict(expected: dict[str, Tensor], state: dict, path: Path, cfg: Config) -> None:
    """One CheckpointError listing the first missing / unexpected / mis-shaped keys."""
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    mismatched = [
        f"{key} (checkpoint {list(state[key].shape)}, model {list(value.shape)})"
        for key, value in expected.items()
        if key in state
        and hasattr(state[key], "shape")
        and tuple(state[key].shape) != tuple(value.shape)
    ]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    for title, keys in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("shape mismatches", mismatched),
    ):
        if keys:
            more = f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
            parts.append(f"{title} {', '.join(keys[:_SHOW])}{more}")
    raise CheckpointError(
        f"the weights in {path} do not fit the model its config describes (model.name="
        f"{cfg.model.name}, embedding_dim={cfg.model.embedding_dim}, features.n_mels="
        f"{cfg.features.n_mels}): {'; '.join(parts)}. The checkpoint was written by another model "
        "config (or another audioclf version); load it with the config it was trained with"
    )
