"""The training objective: loss terms, each its own class, summed with weights.

    loss = build_loss(cfg)                # WeightedLosses: triplet (+ loss.ce_weight × head)
    loss(embeddings, labels, logits)      # every term takes the same arguments

`TripletLoss`: a miner and the triplet margin loss of pytorch-metric-learning, optionally over
the global batch of every rank. `MarginHeadLoss`: cross-entropy on the head's logits (cosine
softmax, ArcFace or sub-center ArcFace: model.head). `WeightedLosses` sums them with weights,
as pytorch-metric-learning's `MultipleLosses` does.

Distance convention: cosine similarity (PML `CosineSimilarity`) on L2-normalised embeddings.
A triplet's loss is relu(cos(a, n) - cos(a, p) + margin), so `loss.margin` is in units of
cosine distance (1 - cos). The triplet term is averaged over the mined triplets whose loss is
non-zero (PML's default AvgNonZeroReducer). Every term is computed in fp32 under autocast.

Cross-rank scaling (`loss.cross_rank=True`): every rank gathers the embeddings and labels of
all ranks (`all_gather_with_grad` / `all_gather_nograd`, in rank order) and computes the same
loss L on the global batch. In backward, `all_gather_with_grad` SUM-reduces dL/d(global batch)
over the W ranks (W identical copies) and hands each rank its own slice: W · dL/d(own slice).
DDP then averages parameter gradients over the W ranks, so they equal
sum over ranks of dL/d(own slice) · d(own slice)/dθ = the single-process gradient of L on the
concatenated batch. The head term is per rank on local logits; DDP's average makes it the mean
over ranks (the global mean when every rank holds the same number of items).

Margin heads (model.head=arcface|subcenter_arcface): the class weights live in the model
(`EmbeddingNet.head`, so DDP all-reduces their gradients like any other parameter's) and the
model outputs plain scaled cosines (max over sub-centers); `MarginHeadLoss` turns each row's
target logit s·cos θ into s·cos(θ + m) before the cross-entropy
(models.heads.angular_margin_logits). pytorch-metric-learning's ArcFaceLoss /
SubCenterArcFaceLoss own their weight `W` inside the loss module, outside DDP, so they are not
used; the result is the same (tests compare them).

Margin warm-up (`loss.margin_warmup_epochs=W`): `set_epoch(epoch)` sets both margins to
min(1, (epoch + 1) / (W + 1)) × their configured values (epoch 0-based); the triplet miner uses
the same current margin as the triplet loss.

Final epochs (`train.final_epochs=K`, WeSpeaker's large-margin fine-tuning): in the last K
epochs (epoch >= train.epochs - K) the margins are `loss.final_margin` / `loss.final_head_margin`
where set, in full (the warm-up ramp applies to the epochs before them).

Cross-batch memory (`loss.memory_size=N`, from epoch `loss.memory_warmup_epochs` on): the
triplet term mines each batch against the batch and a queue of the last N training embeddings
(losses.memory: item-aware, filled with the global batch so every rank holds the same queue,
kept in the checkpoint). It needs each row's item: `objective(output, labels, positions)`
looks the items up by the rows' positions in the training split (build_loss's `items`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances, losses, miners
from torch import Tensor, nn

from audioclf.config import Config, LossConfig, ModelConfig, choices
from audioclf.distributed import all_gather_nograd, all_gather_with_grad, get_world_size
from audioclf.losses.memory import CrossBatchMemory, mine_with_items
from audioclf.models.heads import angular_margin_logits

MINERS = choices(LossConfig, "miner")
HEADS = tuple(h for h in choices(ModelConfig, "head") if h != "none")


def build_loss(cfg: Config, items: np.ndarray | None = None) -> WeightedLosses:
    """The run's objective: the triplet term, plus loss.ce_weight × the head's cross-entropy
    when model.head is not none; their margins follow the warm-up and the final epochs.
    `items`: the item code of every training row (by position), which the cross-batch memory
    (loss.memory_size) needs."""
    final_from = final_epochs_start(cfg)
    terms: dict[str, nn.Module] = {"triplet": TripletLoss(cfg.loss, final_from=final_from)}
    weights = {"triplet": 1.0}
    if cfg.model.head != "none":
        terms["ce"] = MarginHeadLoss(
            cfg.model.head,
            scale=cfg.model.effective_head_scale,
            margin=cfg.loss.head_margin,
            warmup_epochs=cfg.loss.margin_warmup_epochs,
            final_margin=cfg.loss.final_head_margin,
            final_from=final_from,
        )
        weights["ce"] = cfg.loss.ce_weight
    return WeightedLosses(terms, weights, items=items)


def final_epochs_start(cfg: Config) -> int | None:
    """The first (0-based) of the last train.final_epochs epochs; None when that is off."""
    final = cfg.train.final_epochs
    return cfg.train.epochs - final if final else None


class _MarginSchedule(nn.Module):
    """A term whose margin ramps up over the first `warmup_epochs` epochs and is `final_margin`
    (when given) from epoch `final_from` on (set_epoch)."""

    def __init__(
        self,
        margin: float,
        warmup_epochs: int,
        final_margin: float | None = None,
        final_from: int | None = None,
    ):
        super().__init__()
        self.full_margin = margin
        self.margin = margin  # the current margin (set_epoch changes it)
        self.warmup_epochs = warmup_epochs
        self.final_margin = final_margin if final_from is not None else None
        self.final_from = final_from
        self.epoch: int | None = None  # set by set_epoch; needed only when the margin changes

    def set_epoch(self, epoch: int) -> None:
        """Set the margin of `epoch` (0-based); call before every epoch."""
        if epoch < 0:
            raise ValueError(f"set_epoch needs an epoch >= 0, got {epoch}")
        self.epoch = epoch
        if self.final_margin is not None and epoch >= self.final_from:
            self.margin = self.final_margin
            return
        # (epoch + 1) / (W + 1): never 0, so semi-hard mining finds triplets from the start.
        factor = min(1.0, (epoch + 1) / (self.warmup_epochs + 1)) if self.warmup_epochs else 1.0
        self.margin = factor * self.full_margin

    def _check_epoch(self) -> None:
        if self.epoch is not None:
            return
        if self.warmup_epochs:
            raise RuntimeError(
                f"loss.margin_warmup_epochs={self.warmup_epochs} ramps the margins per epoch: call "
                "TripletLoss.set_epoch(epoch) before each epoch (or set loss.margin_warmup_epochs=0)"
            )
        if self.final_margin is not None:
            raise RuntimeError(
                "the final epochs (train.final_epochs) change the margin: call set_epoch(epoch) "
                "before each epoch"
            )


class TripletLoss(_MarginSchedule):
    """forward(embeddings [B, D], labels [B], logits=None) → the triplet term (logits unused).

    A batch whose labels admit no triplet (one class, or all singletons) gives a zero loss that
    still depends on the embeddings, so backward reaches every parameter (and, with
    cross_rank, every rank runs the gather's backward collective).
    """

    def __init__(self, cfg: LossConfig, *, final_from: int | None = None):
        if cfg.miner not in MINERS:  # a LossConfig edited after construction
            raise ValueError(f"loss.miner={cfg.miner!r} is invalid: use one of {', '.join(MINERS)}")
        super().__init__(cfg.margin, cfg.margin_warmup_epochs, cfg.final_margin, final_from)
        self.cross_rank, self.kind = cfg.cross_rank, cfg.miner
        self.memory = CrossBatchMemory(cfg.memory_size) if cfg.memory_size else None
        self.memory_from = cfg.memory_warmup_epochs
        distance = distances.CosineSimilarity()
        self.triplet = losses.TripletMarginLoss(margin=cfg.margin, distance=distance)
        if cfg.miner == "batch_hard":
            self.miner = miners.BatchHardMiner(distance=distance)
        else:
            kind = "semihard" if cfg.miner == "semi_hard" else "all"
            self.miner = miners.TripletMarginMiner(
                margin=cfg.margin, type_of_triplets=kind, distance=distance
            )

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.triplet.margin = self.margin
        if isinstance(self.miner, miners.TripletMarginMiner):
            self.miner.margin = self.margin

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        logits: Tensor | None = None,
        items: Tensor | None = None,
    ) -> Tensor:
        return self.with_stats(embeddings, labels, items=items)[0]

    def with_stats(
        self,
        embeddings: Tensor,
        labels: Tensor,
        logits: Tensor | None = None,
        items: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """(loss, {"triplets": mined triplets}); the count is a host sync. `items` (the rows'
        item codes) are needed by the cross-batch memory only."""
        check_inputs(embeddings, labels)
        self._check_epoch()
        labels = labels.to(embeddings.device)
        remember = self.memory is not None and (self.epoch or 0) >= self.memory_from
        if remember and (items is None or items.shape != labels.shape):
            raise ValueError("the cross-batch memory (loss.memory_size) needs each row's item")
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            embeddings = embeddings.float()
            rows = (labels, items.to(embeddings.device)) if remember else (labels,)
            if self.cross_rank:
                embeddings, *rows = gather_global(embeddings, *rows)
            if remember:
                return self._with_memory(embeddings, *rows)
            labels = rows[0]  # the global batch's, with cross_rank
            triplets = self.miner(embeddings, labels) if len(labels) else ()
            return self._triplet_loss(embeddings, labels, triplets)

    def _with_memory(self, embeddings: Tensor, labels: Tensor, items: Tensor):
        refs = self.memory.references(embeddings, labels, items)
        triplets = mine_with_items(embeddings, labels, items, *refs, self.kind, self.margin)
        loss, stats = self._triplet_loss(embeddings, labels, triplets, refs[:2])
        # The global batch joins the queue (gathered here unless it already is).
        batch = (embeddings.detach(), labels, items)
        self.memory.enqueue(*(batch if self.cross_rank else gather_global(*batch, grad=False)))
        return loss, stats  # the memory's fill (len) is left out: a host sync every step

    def _triplet_loss(self, embeddings, labels, triplets, refs=()):
        n_triplets = int(triplets[0].shape[0]) if triplets else 0
        if n_triplets == 0:
            # Zero, yet connected to every embedding (and so every parameter and rank);
            # "+ 0.0" turns a -0.0 into 0.0.
            return embeddings.sum() * 0.0 + 0.0, {"triplets": 0.0}
        loss = self.triplet(embeddings, labels, triplets, *refs)
        return loss, {"triplets": float(n_triplets)}


class MarginHeadLoss(_MarginSchedule):
    """forward(embeddings, labels [B], logits [B, C]) → cross-entropy of the head's logits.

    `logits` are the model head's scaled cosines (`scale`, the scale build_net gives the head);
    the arcface heads add their angular `margin` (radians) to each row's target first
    (`final_margin` from epoch `final_from` on). The softmax head has no margin.
    """

    def __init__(
        self,
        head: str,
        *,
        scale: float,
        margin: float,
        warmup_epochs: int = 0,
        final_margin: float | None = None,
        final_from: int | None = None,
    ):
        if head not in HEADS:
            raise ValueError(f"model.head={head!r} is invalid: use one of {', '.join(HEADS)}")
        softmax = head == "softmax"
        super().__init__(
            0.0 if softmax else margin,
            warmup_epochs,
            None if softmax else final_margin,
            final_from,
        )
        self.head = head
        self.scale = scale

    def forward(self, embeddings: Tensor, labels: Tensor, logits: Tensor | None = None) -> Tensor:
        return self.with_stats(embeddings, labels, logits)[0]

    def with_stats(
        self,
        embeddings: Tensor,
        labels: Tensor,
        logits: Tensor | None = None,
        items: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """(loss, {}); `items` is taken as every term's and not used (no cross-item rule)."""
        if logits is None:
            raise ValueError(
                f"model.head={self.head} needs classifier logits: build EmbeddingNet with "
                "num_classes > 0, or set model.head=none"
            )
        check_inputs(embeddings, labels, logits)
        self._check_epoch()
        labels = labels.to(logits.device)
        with torch.autocast(device_type=logits.device.type, enabled=False):
            if not len(labels):
                return logits.float().sum() * 0.0, {}  # no rows here (a dropped batch)
            logits = logits.float()
            if self.head != "softmax":
                logits = angular_margin_logits(logits, labels, self.scale, self.margin)
            return F.cross_entropy(logits, labels), {}


class WeightedLosses(nn.Module):
    """Σ weight × term(embeddings, labels, logits) over named terms (PML's MultipleLosses).

    `with_stats` also returns floats: each term's value as "<name>_loss" and what the term
    reports (the triplet term: "triplets") — host syncs, so the training loop calls forward.
    """

    def __init__(
        self,
        terms: dict[str, nn.Module],
        weights: dict[str, float],
        *,
        items: np.ndarray | None = None,
    ):
        super().__init__()
        if set(terms) != set(weights):
            raise ValueError(
                f"every loss term needs a weight: terms {sorted(terms)}, weights {sorted(weights)}"
            )
        self.terms = nn.ModuleDict(terms)
        self.weights = dict(weights)
        self.items = None if items is None else torch.as_tensor(items, dtype=torch.int64)

    @property
    def memory(self) -> CrossBatchMemory | None:
        """The triplet term's cross-batch memory (loss.memory_size), a checkpointed state."""
        return self.terms["triplet"].memory if "triplet" in self.terms else None

    def set_epoch(self, epoch: int) -> None:
        """Call before every epoch: the terms' margins follow loss.margin_warmup_epochs and
        the final epochs (train.final_epochs)."""
        for term in self.terms.values():
            term.set_epoch(epoch)

    def forward(self, embeddings: Tensor, labels: Tensor, logits: Tensor | None = None) -> Tensor:
        return self.with_stats(embeddings, labels, logits, stats=False)[0]

    def objective(
        self, output: tuple[Tensor, Tensor | None], labels: Tensor, positions: Tensor
    ) -> Tensor:
        """The loss of an EmbeddingNet's output (embeddings, logits) for the training rows at
        `positions`: what TrainStep calls."""
        embeddings, logits = output
        items = None
        if self.items is not None and self.memory is not None:  # only the memory reads them
            if self.items.device != labels.device:  # once: the table then lives there
                self.items = self.items.to(labels.device)
            # on the device, no host sync (positions come with the batch, non_blocking)
            items = self.items[positions.to(labels.device, non_blocking=True)]
        return self.with_stats(embeddings, labels, logits, items=items, stats=False)[0]

    def with_stats(
        self,
        embeddings: Tensor,
        labels: Tensor,
        logits: Tensor | None = None,
        *,
        items: Tensor | None = None,
        stats: bool = True,
    ) -> tuple[Tensor, dict[str, float]]:
        check_inputs(embeddings, labels, logits)
        total, report = None, {}
        for name, term in self.terms.items():
            value, term_stats = term.with_stats(embeddings, labels, logits, items=items)
            weighted = self.weights[name] * value
            total = weighted if total is None else total + weighted
            if stats:
                report.update(term_stats, **{f"{name}_loss": float(value.detach())})
        return total, report


def gather_global(embeddings: Tensor, *labels: Tensor, grad: bool = True) -> list[Tensor]:
    """The global batch (embeddings, then each label tensor) in rank order; with `grad` this
    rank's embedding rows keep their gradient.

    Ranks may hold different numbers of items (e.g. after skipped files): sizes are gathered
    first, and shorter batches are padded to the longest for the gather, then cut out again.
    Identity in one process; else one host sync (the sizes).
    """
    if get_world_size() == 1:
        return [embeddings, *labels]
    gather = all_gather_with_grad if grad else all_gather_nograd
    sizes = all_gather_nograd(torch.tensor([embeddings.shape[0]], device=embeddings.device))
    largest, smallest = torch.stack([sizes.max(), sizes.min()]).tolist()
    if smallest == largest:
        return [gather(embeddings), *(all_gather_nograd(t) for t in labels)]
    missing = largest - embeddings.shape[0]
    embeddings = F.pad(embeddings, (0, 0, 0, missing))
    labels = [torch.cat([t, t.new_full((missing,), -1)]) for t in labels]
    gathered = [gather(embeddings), *(all_gather_nograd(t) for t in labels)]
    keep = (torch.arange(largest, device=sizes.device)[None, :] < sizes[:, None]).flatten()
    return [t[keep] for t in gathered]


def check_inputs(embeddings: Tensor, labels: Tensor, logits: Tensor | None = None) -> None:
    """One ValueError naming the shape or dtype that does not fit."""
    if embeddings.dim() != 2:
        raise ValueError(
            f"the loss expects embeddings [batch, dim], got shape {list(embeddings.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"the loss expects one label per embedding: embeddings {list(embeddings.shape)}, "
            f"labels {list(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"the loss's labels must be integers, got dtype {labels.dtype}")
    if logits is not None and (logits.dim() != 2 or logits.shape[0] != embeddings.shape[0]):
        raise ValueError(
            f"the loss expects logits [batch, classes] with batch={embeddings.shape[0]}, "
            f"got shape {list(logits.shape)}"
        )
