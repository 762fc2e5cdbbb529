"""Which checkpoint a run starts from (checkpoint.resume), and whether it fits the config.

The architecture (config.architecture: the model with its head, and the features) must be the
checkpoint's: a difference is refused with the keys named, unless checkpoint.resume_strict=false,
which takes the checkpoint's. Everything else (crops, evaluation clips, augmentation, the loss
weights, the schedule) may change between the runs of one model.
"""

from __future__ import annotations

from pathlib import Path

from audioclf import checkpoint
from audioclf.config import Config, architecture, config_from_dict


def resume_point(cfg: Config, run_dir: Path) -> tuple[Path | None, dict | None, list[str]]:
    """(checkpoint path, its dict, notes for train.log), or (None, None, []) for a fresh start.

    A fresh start into a folder that holds a run is refused. With resume_strict=false the
    checkpoint's architecture replaces cfg's (cfg.model, cfg.features are set in place).
    """
    path = checkpoint.resolve_resume(cfg.checkpoint.resume, run_dir)
    if path is None and (run_dir / checkpoint.LAST).exists():
        raise ValueError(
            f"{run_dir} already holds a run ({checkpoint.LAST}); continue it with "
            "checkpoint.resume=auto, or start a new one with another train.name (or delete "
            "the folder)"
        )
    if path is None:
        return None, None, []
    ckpt = checkpoint.load(path, trust=cfg.checkpoint.trust)
    saved = config_from_dict(ckpt["config"])
    changed = [
        f"{key} {old!r} (now {new!r})"
        for key, (old, new) in differences(architecture(saved), architecture(cfg)).items()
    ]
    notes = []
    if changed and cfg.checkpoint.resume_strict:
        raise checkpoint.CheckpointError(
            f"{path} was trained with other settings: {'; '.join(changed[:6])}"
            f"{' and more' if len(changed) > 6 else ''}. Resume with the run's own settings, "
            "start a new run (another train.name), or set checkpoint.resume_strict=false to "
            "continue with the checkpoint's"
        )
    if changed:
        notes.append(
            f"resuming {path} with its own settings, not the requested "
            f"({'; '.join(changed)}): checkpoint.resume_strict=false"
        )
    cfg.model, cfg.features = saved.model, saved.features  # the architecture
    return path, ckpt, notes


def differences(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = {}
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out[f"{prefix}{key}"] = (a, b)
    return dict(sorted(out.items()))
