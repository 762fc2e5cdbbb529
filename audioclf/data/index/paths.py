"""Sample paths: data.path_template parsed and rendered, relative paths resolved against the
data root."""

from __future__ import annotations

import os
import re
import string

import numpy as np
import pandas as pd

from audioclf.data.index.table import IndexValidationError


def template_fields(template: str) -> tuple[list[tuple[str, str | None]], bool]:
    """The template's (literal text, column) pieces, and whether plain concatenation renders it
    (no format spec, conversion, attribute or index access)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise IndexValidationError(
            f"data.path_template {template!r} is not a valid format string ({exc}); "
            "write columns in braces, e.g. features/{a_id}.npy"
        ) from None
    pieces, simple = [], True
    for literal, field, spec, conversion in parsed:
        column = None
        if field is not None:
            column = re.split(r"[.\[]", field, maxsplit=1)[0]
            if not column or column.isdigit():
                raise IndexValidationError(
                    f"data.path_template {template!r} has a field {{{field}}} without a column "
                    "name; name a column in the braces, e.g. features/{a_id}.npy"
                )
            simple = simple and column == field and not spec and not conversion
        pieces.append((literal, column))
    return pieces, simple


def template_columns(template: str) -> list[str]:
    """The columns a template names, each once, in order."""
    pieces, _ = template_fields(template)
    return list(dict.fromkeys(column for _, column in pieces if column is not None))


def render_template(template: str, cells: pd.DataFrame) -> pd.Series:
    pieces, simple = template_fields(template)
    if not simple:  # format specs or attribute access: row by row
        rendered = [template.format(**record) for record in cells.to_dict("records")]
        return pd.Series(rendered, index=cells.index, dtype=str)
    out = pd.Series("", index=cells.index, dtype=str)
    for literal, column in pieces:
        out = out + literal
        if column is not None:
            out = out + cells[column]
    return out


def resolve_paths(paths: pd.Series, root: str) -> pd.Series:
    """Absolute paths: relative ones are joined to `root`; '.', '..' and '//' are normalised."""
    is_abs = paths.str.startswith("/")
    if os.name == "nt":  # pragma: no cover - drive letters and UNC shares
        is_abs = is_abs | paths.str.match(r"^[A-Za-z]:[\\/]|^\\\\")
    prefix = root.rstrip("/\\") + os.sep
    if not is_abs.any():
        paths = prefix + paths
    elif not is_abs.all():
        paths = pd.Series(np.where(is_abs, paths, prefix + paths), index=paths.index, dtype=str)
    messy = paths.str.contains(r"//|/\.\.?(?:/|$)", regex=True)
    if messy.any():
        paths = paths.copy()
        paths[messy] = [os.path.normpath(p) for p in paths[messy]]
    return paths
