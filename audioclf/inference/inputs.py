"""The files a user names (files, folders searched recursively) found and embedded: what embed's
ranking and search's audio queries share.

    files, embeddings, skipped = embed_inputs(model, ["clips/"], "the files", batch_size=16,
                                              progress=True)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from audioclf.config import FeaturesConfig
from audioclf.data.readers import AUDIO_SUFFIXES, AudioReadError, FeatureFileError
from audioclf.inference.artefacts import LoadedEmbedder
from audioclf.inference.extract import check_finite, embed_files

FEATURE_SUFFIXES = (".npy",)
# The suffixes an error message names when a folder holds no audio (AUDIO_SUFFIXES has ~30).
SHOWN_AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")


def find_files(inputs: list[str | Path], features: FeaturesConfig) -> list[Path]:
    """The files to embed: named files as given, folders searched recursively (sorted) for
    audio (every suffix libsndfile reads) or .npy features, as the model takes."""
    audio = features.kind == "audio"
    wanted = AUDIO_SUFFIXES if audio else FEATURE_SUFFIXES
    other = FEATURE_SUFFIXES if audio else AUDIO_SUFFIXES
    what = "audio" if audio else ".npy log-mel features (features.kind=npy)"
    files: list[Path] = []
    skipped = 0
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            files += [p for p in found if p.suffix.lower() in wanted]
            skipped += sum(p.suffix.lower() in other for p in found)
        elif path.is_file():
            if path.suffix.lower() in other:
                raise ValueError(f"{path}: the model takes {what}, not {path.suffix} files")
            files.append(path)
        else:
            raise ValueError(f"{path} does not exist")
    if not files:
        raise ValueError(_nothing_found(inputs, audio, skipped, what))
    return files


def _nothing_found(inputs: list, audio: bool, skipped: int, what: str) -> str:
    shown = " / ".join(SHOWN_AUDIO_SUFFIXES if audio else FEATURE_SUFFIXES)
    also = " (nor any other audio format libsndfile reads)" if audio else ""
    other = "/".join(FEATURE_SUFFIXES) if audio else "audio"
    hint = f" (found {skipped} {other} file(s), but the model takes {what})" if skipped else ""
    return f"no {shown} files found in {', '.join(map(str, inputs))}{also}{hint}"


def embed_readable(
    model: LoadedEmbedder,
    files: list[Path],
    *,
    batch_size: int,
    progress: bool,
    num_workers: int = 0,
) -> tuple[list[Path], np.ndarray, list[tuple[Path, str]]]:
    """(files that could be read, their embeddings, [(file, reason)] of the others). One bad
    file does not cost the call: after a failure the files are embedded one by one."""

    def embed(paths: list[Path], show: bool, workers: int = 0) -> np.ndarray:
        return embed_files(
            model.embed_fn,
            model.cfg,
            paths,
            batch_size=batch_size,
            device=model.device,
            input_kind=model.input_kind,
            progress=show,
            num_workers=workers,
        )

    try:
        return files, embed(files, progress, num_workers), []
    except (AudioReadError, FeatureFileError):
        pass
    kept, rows, skipped = [], [], []
    for path in files:
        try:
            rows.append(embed([path], False))
            kept.append(path)
        except (AudioReadError, FeatureFileError) as exc:
            skipped.append((path, str(exc)))
    if not kept:
        raise ValueError(
            f"none of the {len(files)} file(s) could be read; the first: {skipped[0][1]}"
        )
    return kept, np.concatenate(rows), skipped


def embed_inputs(
    model: LoadedEmbedder,
    inputs: list[str | Path],
    what: str,
    *,
    batch_size: int,
    progress: bool,
    num_workers: int = 0,
) -> tuple[list[Path], np.ndarray, list[tuple[Path, str]]]:
    """embed_readable over the files of `inputs` (files, folders searched recursively), whose
    embeddings must be finite (ValueError naming them as `what`, e.g. "the files")."""
    files, embeddings, skipped = embed_readable(
        model,
        find_files(inputs, model.features),
        batch_size=batch_size,
        progress=progress,
        num_workers=num_workers,
    )
    check_finite(embeddings, [str(f) for f in files], what)
    return files, embeddings, skipped
