"""Resumable output folders, shared by prepare (DIR/prepare.json) and embed --index
(PREFIX.parts/manifest.json).

Both write their results in pieces, so that a rerun after a crash, a kill or a full disk
finishes what the killed run left. A manifest records what every piece depends on (settings,
model, format version); a folder whose manifest differs holds another run's work and must be
refused, not completed. The rows a run left out are listed in a skipped.csv (row, id, path,
reason).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from audioclf.config import differences
from audioclf.fileio import atomic_write_bytes


class ManifestMismatch(ValueError):
    """A folder's manifest records another run; `changed` names the differing keys (dotted for
    nested settings, e.g. "features.n_mels"), `earlier` is that manifest (None: unreadable)."""

    def __init__(self, path: Path, changed: list[str], earlier: dict | None, reason: str = ""):
        self.path, self.changed, self.earlier, self.reason = path, changed, earlier, reason
        what = reason or f"{', '.join(changed)} differ{'s' if len(changed) == 1 else ''}"
        super().__init__(f"{path} records another run ({what})")


def check_manifest(path: Path, wanted: dict) -> bool:
    """Whether `path` holds a manifest equal to `wanted` (True: the folder's work may be
    resumed; False: there is none). ManifestMismatch when it records another run or cannot
    be read."""
    if not path.is_file():
        return False
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestMismatch(path, sorted(wanted), None, f"unreadable ({exc})") from None
    if not isinstance(earlier, dict):
        raise ManifestMismatch(path, sorted(wanted), None, "not a JSON object")
    changed = list(differences(earlier, wanted))
    if changed:
        raise ManifestMismatch(path, changed, earlier)
    return True


def write_manifest(path: Path, manifest: dict) -> Path:
    """The manifest as indented JSON, atomically (its folder is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, (json.dumps(manifest, indent=2) + "\n").encode())


def write_skipped(path: Path, table: pd.DataFrame, reasons: Mapping[int, str]) -> Path | None:
    """row, id, path, reason of the rows of an index table at the positions of `reasons`
    (sorted, each reason on one line) as CSV at `path`; None and no file when nothing was
    skipped (a stale list of an earlier run is removed)."""
    if not reasons:
        path.unlink(missing_ok=True)
        return None
    positions = sorted(reasons)
    rows = table.iloc[positions]
    listing = pd.DataFrame(
        {
            "row": rows["row"].to_numpy(),
            "id": rows["id"].to_numpy(),
            "path": rows["path"].to_numpy(),
            "reason": [" ".join(str(reasons[p]).split()) for p in positions],
        }
    )
    return atomic_write_bytes(path, listing.to_csv(index=False).encode())
