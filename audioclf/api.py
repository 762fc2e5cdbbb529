"""audioclf from Python: a trained model from any artefact, and what it does with audio.

    import audioclf

    model = audioclf.load("runs/demo_cnn/best.pt")   # a checkpoint, state dict, TorchScript, ONNX
    files, emb = model.embed(["data/demo/wav/c00/c00_i0/"])   # files and folders -> [N, D]
    emb = model.embed_waveforms([wave], sample_rate=22050)     # in-memory audio
    model.score(emb[0], emb[1])                                # cosine similarity
    ranking = model.rank(["clip.wav"], gallery="data/demo/index.xlsx", top=3)
    table = model.search(["clip.wav"], "runs/demo_cnn/embed/all", k=5)
    evaluated = model.evaluate("data/demo/index.xlsx", split="val")  # a checkpoint's report
    model.adapt(["new_source/"])        # AdaBN on unlabelled audio of a new source (checkpoints)

Embeddings are float32 unit vectors; files are read as `python -m audioclf.evaluate` reads
them (the model's features and evaluation clips). These names stay as they are across
refactors of the package (docs/api.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from audioclf.embedding.gallery import Ranking, RankOptions, rank_files
from audioclf.inference import LoadedEmbedder, load_embedder, resolve_device
from audioclf.inference.adapt import adapt
from audioclf.inference.extract import (
    embed_clips,
    embed_paths,
    embed_waves,
    find_files,
    prepare_wave,
)
from audioclf.search import queries as search_queries

if TYPE_CHECKING:
    from audioclf.evaluation import Evaluated


def load(path: str | Path, *, device: str = "auto", trust: bool = False) -> Model:
    """The model in `path`: an audioclf checkpoint or state-dict export, or a TorchScript /
    ONNX export beside its sidecar <path>.json. `device`: cpu, cuda, cuda:N or auto. `trust`
    loads a checkpoint holding more than tensors and plain data (only one you trust)."""
    device = resolve_device(device, flag="device")
    return Model(load_embedder(path, device, flag="model", trust=trust))


@dataclass
class Model:
    """A loaded model (from `audioclf.load`)."""

    loaded: LoadedEmbedder

    def adapt(self, inputs: Sequence[str | Path] | str | Path) -> dict:
        """AdaBN on unlabelled audio of a new source (files, folders searched recursively):
        the checkpoint's BatchNorm statistics become the new source's for everything that
        follows (embed, rank, search, evaluate, whose report records it); returns the record
        of what was done, kept as `adaptation`. Adapting again starts from the new audio
        alone. Checkpoints only: an export is a ValueError, as are no inputs or an empty path."""
        inputs = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
        self.loaded = adapt(self.loaded, inputs, flag="Model.adapt(inputs)")
        return self.loaded.adaptation

    @property
    def adaptation(self) -> dict | None:
        """What `adapt` did (None: not adapted)."""
        return self.loaded.adaptation

    @property
    def sample_rate(self) -> int:
        """The rate the model hears audio at (files and waveforms are resampled to it)."""
        return self.loaded.features.sample_rate

    def embed(
        self, inputs: Sequence[str | Path] | str | Path, *, batch_size: int = 32, progress=False
    ) -> tuple[list[Path], np.ndarray]:
        """(the files found, their embeddings [N, D]): audio files, or folders searched
        recursively. A file that cannot be read raises ValueError naming it."""
        inputs = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
        files = find_files(inputs, self.loaded.features)
        files, embeddings, skipped = embed_paths(
            self.loaded, files, skip_bad=True, batch_size=batch_size, progress=progress
        )
        if skipped:
            path, reason = skipped[0]
            raise ValueError(
                f"{len(skipped)} file(s) could not be read; the first, {path}: {reason}"
            )
        return files, embeddings

    def embed_waveforms(
        self, waves: Sequence[np.ndarray | torch.Tensor], sample_rate: int
    ) -> np.ndarray:
        """Embeddings [N, D] of in-memory audio: each a 1-D array of samples (or [channels,
        samples], mixed down) at `sample_rate`, resampled and cut to the evaluation length as
        a file would be."""
        return embed_waves(self.loaded, waves, sample_rate)

    def prepare_waveform(self, wave: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
        """One waveform as the model takes it (resampled, cut to the evaluation length, or its
        log-mel for an export without a front end): embed_waveforms in two steps, so that a
        server can prepare clips as they arrive and embed them together (embed_prepared)."""
        return prepare_wave(self.loaded, wave, sample_rate)

    def embed_prepared(self, clips: Sequence[torch.Tensor]) -> np.ndarray:
        """Embeddings [N, D] of clips from prepare_waveform, in one padded batch on the model's
        device (as evaluation embeds a batch)."""
        return embed_clips(self.loaded, clips)

    @staticmethod
    def score(a: np.ndarray, b: np.ndarray) -> np.ndarray | float:
        """Cosine similarity of two embeddings (or of rows of two [N, D] arrays, pairwise)."""
        a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
        a /= np.linalg.norm(a, axis=1, keepdims=True)
        b /= np.linalg.norm(b, axis=1, keepdims=True)
        scores = (a * b).sum(axis=1)
        return float(scores[0]) if scores.size == 1 else scores

    def rank(
        self,
        inputs: Sequence[str | Path],
        gallery: str | Path,
        *,
        top: int = 5,
        batch_size: int = 32,
        use_cache: bool = True,
    ) -> Ranking:
        """The classes of the gallery sheet ranked for each file, as `audioclf embed
        --gallery` does: `Ranking.files`, `.names` (the classes), `.scores` [files, classes]
        and `.order` (each file's top classes, best first)."""
        return rank_files(
            self.loaded,
            list(inputs),
            Path(gallery),
            RankOptions(top=top),
            root=None,
            batch_size=batch_size,
            use_cache=use_cache,
            progress=False,
        )

    def search(
        self,
        inputs: Sequence[str | Path],
        collection: str | Path,
        *,
        k: int = 10,
        method: str | None = None,
        batch_size: int = 32,
        cohort: str | Path | None = None,
        score_norm: str | None = None,
        cohort_top: int | None = None,
    ) -> pd.DataFrame:
        """The k nearest clips of a collection (the PREFIX of `audioclf embed --index --save
        PREFIX`) for each audio file, best first: one row per (query, rank) with score, class,
        item, id and path, as `audioclf search query` prints them. With `cohort` (another
        collection's PREFIX, e.g. the training set's) a norm_score column too: each score
        normalised against it by `score_norm` (by default "asnorm", over each side's `cohort_top`
        highest cohort scores: 300 or a fifth of a smaller cohort; "snorm" over all). A
        UserWarning when the collection was embedded by another model file or with other
        BatchNorm statistics (an --adapt this model lacks, or the other way round); a
        ValueError when this model cannot have made it (another dimension or features)."""
        searcher = search_queries.Searcher.open(
            collection,
            model=self.loaded,
            method=method,
            device=self.loaded.device,
            cohort=cohort,
            score_norm=score_norm,
            cohort_top=cohort_top,
        )
        if searcher.warning:  # another model or another adaptation made the collection
            warnings.warn(searcher.warning.removeprefix("warning: "), UserWarning, stacklevel=2)
        queries = search_queries.audio_queries(
            self.loaded, list(inputs), batch_size=batch_size, progress=False
        )
        return searcher.table(queries, k)

    def evaluate(
        self,
        sheet: str | Path | None = None,
        *,
        split: str = "val",
        gallery: str = "train",
        out: str | Path | None = None,
        batch_size: int = 32,
        **options,
    ) -> Evaluated:
        """The model (loaded from a checkpoint) evaluated on `split` of `sheet` (default: its
        training's index), as `audioclf evaluate` does, with its report written into `out`
        (default <checkpoint folder>/eval): `.metrics` (report.json's), `.out_dir`, `.lines()`
        (the printed summary). `options`: audioclf.evaluation.EvaluateOptions' fields
        (score_norm, cohort, search, seed, adapt, ...; adapt= adapts for this evaluation only)
        and evaluate's keywords (progress, ...)."""
        from audioclf.evaluation import evaluate  # noqa: PLC0415 - lazy: the report loads matplotlib

        return evaluate(
            self.loaded,
            index=sheet,
            split=split,
            gallery=gallery,
            out=out,
            batch_size=batch_size,
            progress=options.pop("progress", False),
            **options,
        )
