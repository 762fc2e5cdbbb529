"""Building a Config: YAML file + dotted overrides → checked dataclasses; earlier layouts read
through `migrate`; a Config back to a dict or YAML."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from audioclf.config.base import ConfigError
from audioclf.config.sections import Config
from audioclf.fileio import atomic_write_bytes

# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"config section {where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]} in section {where}; "
            f"valid keys: {', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - all fields have defaults
        raise ConfigError(f"{prefix.rstrip('.')}: {exc}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    """`value` as type `hint`, or ConfigError naming the key and the expected type."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value if value is not None else {}, key + ".")
    if origin in (Union, types.UnionType):
        return _coerce_union(hint, value, key)
    if origin is Literal:
        return _coerce_literal(hint, value, key)
    if origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            (item_hint, *_) = typing.get_args(hint) or (Any,)
            return origin(_coerce(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value))
    elif hint is Any:
        return value
    elif hint in _SCALARS:
        coerced = _SCALARS[hint](value, key)
        if coerced is not None:
            return coerced
    raise ConfigError(
        f"config key {key}={value!r} has the wrong type: expected {_type_name(hint)}, "
        f"got {type(value).__name__}"
    )


def _coerce_union(hint: Any, value: Any, key: str) -> Any:
    for option in typing.get_args(hint):
        if option is type(None):
            if value is None:
                return None
            continue
        try:
            return _coerce(option, value, key)
        except ConfigError:
            continue  # try the next type of the union
    expected = " or ".join(_type_name(a) for a in typing.get_args(hint))
    raise ConfigError(f"config key {key}={value!r} has the wrong type: expected {expected}")


def _coerce_literal(hint: Any, value: Any, key: str) -> Any:
    options = typing.get_args(hint)
    if value not in options:
        raise ConfigError(
            f"config key {key}={value!r} is not a valid choice: use one of "
            + ", ".join(repr(c) for c in options)
        )
    return value


def _as_float(value: Any, key: str) -> float | None:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # PyYAML reads 5e-4 (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            return None
    if number is not None and not math.isfinite(number):
        raise ConfigError(f"config key {key}={value!r} is invalid: expected a finite number")
    return number


# Scalar types: value -> the value as that type, or None when it is not one.
_SCALARS = {
    bool: lambda value, key: value if isinstance(value, bool) else None,
    int: lambda value, key: (
        value if isinstance(value, int) and not isinstance(value, bool) else None
    ),
    float: _as_float,
    str: lambda value, key: value if isinstance(value, str) else None,
}


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (what is written to config.yaml and checkpoints)."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# Keys of earlier releases

# (old section, old key) -> (new section, new key). Old config files, overrides and the configs
# stored in older checkpoints are read through `migrate`.
MOVED_KEYS = {
    **{
        ("features", key): ("clips", key)
        for key in ("crop_seconds", "pad_mode", "eval_crop", "eval_max_seconds", "npy_layout")
    },
    ("features", "spec_augment"): ("spec_augment", "enabled"),
    **{("features", key): ("spec_augment", key) for key in ("freq_mask", "time_mask", "num_masks")},
    **{("loss", key): ("model", key) for key in ("head", "head_scale", "subcenters")},
}


def move_keys(data: dict) -> tuple[dict, list[str]]:
    """One source's dict (a file, the overrides, a checkpoint's config) with the keys of an
    earlier release at their new places (a new key given too wins); a note per key moved."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    notes = []
    for (section, key), (new_section, new_key) in MOVED_KEYS.items():
        old = out.get(section)
        if isinstance(old, dict) and key in old:
            value = old.pop(key)
            target = out.setdefault(new_section, {})
            if isinstance(target, dict):
                target.setdefault(new_key, value)
            notes.append(f"{section}.{key} -> {new_section}.{new_key}")
    return out, notes


# (section, key) -> (its "off" value, what it was). Keys taken out after they had landed: the
# configs stored in checkpoints of those commits hold them (at "off" unless the run used them).
# Read from a checkpoint (config_from_dict, which keeps no notes), such a key is dropped at any
# value: a model's weights do not depend on it. A config file or an override at "off" has it
# dropped with load_config's earlier-release warning; at another value it is refused.
RETIRED_KEYS = {
    ("unlabelled", "neighbours"): (0, "nearest-neighbour positives (NNCLR)"),
    ("unlabelled", "align_weight"): (0.0, "the MMD alignment term"),
}


def drop_retired(data: dict, *, refuse_set: bool) -> list[str]:
    """Retired keys taken out of the merged dict `data` (in place), a note per key; a key set to
    another value than its "off" is a ConfigError when `refuse_set` (a run asking for it)."""
    notes = []
    for (section, key), (off, what) in RETIRED_KEYS.items():
        part = data.get(section)
        if not isinstance(part, dict) or key not in part:
            continue
        value = part.pop(key)
        if refuse_set and value != off:
            raise ConfigError(
                f"{section}.{key}={value}: audioclf no longer has {what} (measured to add "
                f"nothing, benchmarks/RESULTS.md); remove the key"
            )
        notes.append(f"{section}.{key}={value} dropped (audioclf no longer has {what})")
    return notes


def head_rule(data: dict, *, earlier_layout: bool) -> list[str]:
    """Before 0.2 a head existed only while loss.ce_weight > 0 (loss.head chose its kind,
    softmax by default). Applied to the merged dict, in place; returns a note when it decided."""
    loss = data.get("loss") if isinstance(data.get("loss"), dict) else {}
    model = data.setdefault("model", {})
    if not isinstance(model, dict):
        return []
    weight = loss.get("ce_weight", 0)
    if (
        earlier_layout
        and model.get("head", "none") != "none"
        and "ce_weight" in loss
        and not weight
    ):
        model["head"] = "none"
        loss.pop("ce_weight", None)  # no head: the weight of nothing
        return [f"loss.ce_weight={weight} -> model.head=none"]
    if "head" not in model and weight:
        model["head"] = "softmax"
        return [f"loss.ce_weight={weight} without model.head -> model.head=softmax"]
    return []


def migrate(*sources: dict, refuse_retired: bool = False) -> tuple[dict, list[str]]:
    """The sources (later ones win) merged into one dict of the current layout, and a note per
    key of an earlier release that was read (see move_keys, head_rule, drop_retired)."""
    merged, notes = {}, []
    for source in sources:
        moved, source_notes = move_keys(source)
        merged, notes = merge(merged, moved), notes + source_notes
    notes += head_rule(merged, earlier_layout=bool(notes))
    return merged, notes + drop_retired(merged, refuse_set=refuse_retired)


# ---------------------------------------------------------------------------------------------
# Loading


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ["train.epochs=3", "model.name=cnn"] into a nested dict; values are parsed as YAML."""
    nested: dict = {}
    for text in overrides:
        if "=" not in text:
            raise ConfigError(
                f"override {text!r} is not of the form section.key=value (e.g. train.epochs=3)"
            )
        dotted, raw = text.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"override {text!r} has an empty key; use section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
        node = nested
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r} conflicts with another override of {k}")
        node[keys[-1]] = value
    return nested


def merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


RECIPES = Path(__file__).resolve().parents[1] / "recipes"  # the shipped configs/ (package data)


def recipe_names() -> list[str]:
    """The shipped recipes, by name (configs/<name>.yaml in a checkout)."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def resolve_recipe(path: str | Path) -> Path:
    """A config file: `path` as given, or a shipped recipe named so (`cpu_small`, also as
    `configs/cpu_small.yaml` outside a checkout). ConfigError naming the recipes otherwise."""
    path = Path(path)
    if path.is_file():
        return path
    shipped = RECIPES / f"{path.stem}.yaml"
    by_name = path.suffix in ("", ".yaml") and (path.parent.name in ("", "configs"))
    if by_name and shipped.is_file():
        return shipped
    raise ConfigError(
        f"config file {path} does not exist; pass a YAML file or a shipped recipe: "
        f"{', '.join(recipe_names())}"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults), apply dotted overrides, validate."""
    data: dict = {}
    if path is not None:
        path = resolve_recipe(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    try:
        data, moved = migrate(data, parse_overrides(overrides or []), refuse_retired=True)
    except ConfigError as exc:
        raise ConfigError(f"{path or 'overrides'}: {exc}") from None
    if moved:
        warnings.warn(
            f"{path or 'overrides'}: config keys of an earlier release were read as "
            f"{'; '.join(moved)}; write them the new way",
            UserWarning,
            stacklevel=2,
        )
    try:
        return from_dict(Config, data)
    except ConfigError as exc:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{exc}") from None


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from the dict stored in a checkpoint or config.yaml (older releases'
    layouts included)."""
    return from_dict(Config, migrate(data)[0])


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    atomic_write_bytes(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
