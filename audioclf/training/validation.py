"""Validation during training: cross-item retrieval on the validation split (rank 0 alone, or
sharded over every rank with eval.distributed), on a fixed class-stratified subset when
eval.max_samples is set, with a sample of the embeddings for TensorBoard's projector.

Its numbers pick best.pt, so they are computed as evaluate computes them: the embeddings in
fp32 whatever train.precision (no autocast), without TF32 or autotuning (embed_dataset),
and the retrieval's similarities in IEEE fp32 (retrieval_metrics)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from audioclf import distributed
from audioclf.config import Config
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, stratified_subset
from audioclf.inference import embed_dataset
from audioclf.metrics import RETRIEVAL_KEYS, retrieval_summary
from audioclf.training.logs import MetricsWriter

log = logging.getLogger("audioclf")


class Validator:
    """`run(model, epoch, step)` → the validation metrics on rank 0 ({} elsewhere)."""

    def __init__(
        self,
        cfg: Config,
        env: distributed.DistEnv,
        val: Index | None,
        val_set: AudioDataset | None,
        *,
        loader_options: dict,
        metrics: MetricsWriter,
    ):
        self.cfg, self.env, self.val, self.val_set = cfg, env, val, val_set
        self.loader_options, self.metrics = loader_options, metrics
        self.positions = self._positions()
        self._said_leave_one_out = False

    def run(
        self, model: torch.nn.Module, *, epoch: int, step: int, projector: bool = True
    ) -> dict[str, float]:
        """Cross-item retrieval metrics on the validation split, on rank 0 ({} elsewhere).

        A query may not retrieve clips of its own item (recording). Every rank must call it:
        rank 0 embeds alone while the others wait at a barrier (dist.timeout_minutes must cover
        it), or with eval.distributed every rank embeds a shard and rank 0 gathers them.
        eval.max_samples restricts it to a fixed class-stratified subset. `projector`: a sample
        of the embeddings goes to TensorBoard's projector as epoch `epoch` + 1.
        """
        val_set, env = self.val_set, self.env
        if val_set is None:
            return {}
        sharded = self.cfg.eval.distributed and env.distributed
        if not sharded and not env.is_primary:
            distributed.barrier()
            return {}
        embedded = self._embed(model, sharded)
        if not sharded:
            distributed.barrier()  # the other ranks wait here
        if embedded is None:  # another rank's shard, sent to rank 0
            return {}
        emb, labels, seen = embedded
        summary = retrieval_summary(emb, labels, self.val.codes.item_codes[seen], device=env.device)
        if summary and not summary["cross_item"] and not self._said_leave_one_out:
            self._said_leave_one_out = True
            log.warning(
                "validation: no class has clips of two items (recordings), so the "
                "metrics are leave-one-out: a clip may retrieve clips of its own item"
            )
        val = self.val  # a class-stratified sample for TensorBoard's projector (rank 0)
        if projector:
            self.metrics.projector(
                emb,
                np.asarray(val.classes)[labels],
                val.table["item"].to_numpy()[seen],
                epoch=epoch + 1,
                step=step,
            )
        return {k: summary[k] for k in RETRIEVAL_KEYS if k in summary}

    def _embed(self, model: torch.nn.Module, sharded: bool) -> tuple | None:
        """(embeddings, labels, positions) of the validation clips on rank 0; with `sharded`
        each rank embeds a share and rank 0 gathers them (collective; None elsewhere)."""
        env, positions = self.env, self.positions
        if sharded:
            positions = positions[env.rank :: env.world_size]
        emb, labels, seen = embed_dataset(
            model,
            self.val_set,
            batch_size=self.cfg.eval.batch_size,
            device=env.device,
            positions=positions,
            loader_options=self.loader_options,
            progress=env.is_primary,  # fp32, as evaluate: no precision is passed
            description="validate",
        )
        if not sharded:
            return emb, labels, seen
        parts = distributed.gather_to_primary((emb, labels, seen))
        if not env.is_primary:
            return None
        return (
            np.concatenate([e for e, lab, _ in parts if len(lab)]),
            np.concatenate([lab for _, lab, _ in parts]),
            np.concatenate([s for _, _, s in parts]),
        )

    def _positions(self) -> np.ndarray:
        """All validation rows, or a fixed class-stratified subset (eval.max_samples)."""
        val, limit = self.val, self.cfg.eval.max_samples
        if val is None:
            return np.zeros(0, dtype=np.int64)
        if not limit or limit >= len(val):
            return np.arange(len(val))
        log.info(
            "validation on %d of %d samples (eval.max_samples, class-stratified)", limit, len(val)
        )
        return stratified_subset(val.codes.class_codes, limit, self.cfg.train.seed)
