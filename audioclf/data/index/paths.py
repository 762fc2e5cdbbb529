"""Sample paths: data.path_template parsed and rendered, relative paths resolved against the
data root, paths written on Windows read with '/' (off Windows)."""

from __future__ import annotations

import os
import re
import string

import numpy as np
import pandas as pd

from audioclf.data.index.table import IndexValidationError

WINDOWS_ROOT = r"(?:[A-Za-z]:[\\/]|\\\\)"  # a path starting C:\ or C:/, or a \\server\share


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


def resolve_paths(paths: pd.Series, root: str) -> tuple[pd.Series, tuple[str, ...]]:
    """Absolute paths: relative ones are joined to `root`; '.', '..' and '//' are normalised;
    paths written on Windows read with '/' (posix_separators). Also the notes to log."""
    paths, notes = posix_separators(paths)
    is_abs = paths.str.startswith("/")
    if os.name == "nt":  # pragma: no cover - drive letters and UNC shares
        is_abs = is_abs | paths.str.match(WINDOWS_ROOT)
    prefix = root.rstrip("/\\") + os.sep
    if not is_abs.any():
        paths = prefix + paths
    elif not is_abs.all():
        paths = pd.Series(np.where(is_abs, paths, prefix + paths), index=paths.index, dtype=str)
    messy = paths.str.contains(r"//|/\.\.?(?:/|$)", regex=True)
    if messy.any():
        paths = paths.copy()
        paths[messy] = [os.path.normpath(p) for p in paths[messy]]
    return paths, notes


def posix_separators(paths: pd.Series) -> tuple[pd.Series, tuple[str, ...]]:
    """Paths written on Windows (wav\\c00\\x.wav) with '/', off Windows, when no path holds a
    '/' or starts with a drive or share (a POSIX name holding a backslash sits in a folder, so
    its path holds a '/'). It reads only the sheet, not which files exist, so the cached table
    and data.check_files=false agree with it. Also the note to log."""
    backslash = paths.str.contains("\\", regex=False)
    if os.sep != "/" or not backslash.any() or paths.str.contains(f"/|^{WINDOWS_ROOT}").any():
        return paths, ()
    converted = paths.str.replace("\\", "/", regex=False)
    first = backslash.to_numpy().argmax()
    example = f"{paths.iloc[first]} as {converted.iloc[first]}"
    return converted, (f"paths written with Windows separators, read with '/' (e.g. {example})",)
