"""Triplet loss with a miner (pytorch-metric-learning), optional cross-entropy on a cosine or
margin (ArcFace, sub-center ArcFace) head, a margin warm-up, optional cross-rank mining.

Distance convention: cosine similarity (PML `CosineSimilarity`) on L2-normalised embeddings.
A triplet's loss is relu(cos(a, n) - cos(a, p) + margin), so `loss.margin` is in units of
cosine distance (1 - cos). The triplet term is averaged over the mined triplets whose loss is
non-zero (PML's default AvgNonZeroReducer).

Cross-rank scaling (`loss.cross_rank=True`): every rank gathers the embeddings and labels of
all ranks (`all_gather_with_grad` / `all_gather_nograd`, in rank order) and computes the same
loss L on the global batch. In backward, `all_gather_with_grad` SUM-reduces dL/d(global batch)
over the W ranks (W identical copies) and hands each rank its own slice: W · dL/d(own slice).
DDP then averages parameter gradients over the W ranks, so they equal
sum over ranks of dL/d(own slice) · d(own slice)/dθ = the single-process gradient of L on the
concatenated batch. The cross-entropy term is per rank on local logits; DDP's average makes it
the mean over ranks (the global mean when every rank holds the same number of items).

Margin heads (`loss.head=arcface|subcenter_arcface`): the class weights live in the model
(`EmbeddingNet.head`, so DDP all-reduces their gradients like any other parameter's) and the
model outputs plain scaled cosines (max over sub-centers); this loss turns each row's target
logit s·cos θ into s·cos(θ + m) before the cross-entropy (models.heads.angular_margin_logits).
pytorch-metric-learning's ArcFaceLoss / SubCenterArcFaceLoss own their weight `W` inside the
loss module, outside DDP, so they are not used; the result is the same (tests compare them).

Margin warm-up (`loss.margin_warmup_epochs=W`): `set_epoch(epoch)` sets both margins to
min(1, epoch / W) × their configured values (epoch 0-based: 0 in the first epoch, full from
epoch W on); the triplet miner uses the same current margin as the triplet loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances, losses, miners
from torch import Tensor, nn

from audioclf.config import LossConfig, choices
from audioclf.distributed import all_gather_nograd, all_gather_with_grad
from audioclf.models.heads import angular_margin_logits

MINERS = choices(LossConfig, "miner")
HEADS = choices(LossConfig, "head")


class TripletLoss(nn.Module):
    """forward(embeddings [B, D], labels [B], logits [B, C] | None) → scalar loss.

    The loss is computed in fp32 even under autocast. `with_stats` also returns floats:
    `triplets` (mined on the local or global batch), `triplet_loss`, `ce_loss` (0.0 when not
    used) — each a host sync, so the training loop calls forward.
    A batch whose labels admit no triplet (one class, or all singletons) gives a zero loss that
    still depends on the embeddings, so backward reaches every parameter (and, with
    cross_rank, every rank runs the gather's backward collective).

    `logits` are the model head's scaled cosines (scale `loss.effective_head_scale`, the scale
    build_net gives the head); the arcface heads add their margin to them here. With
    `loss.margin_warmup_epochs > 0`, call `set_epoch(epoch)` before every epoch.
    """

    def __init__(self, cfg: LossConfig):
        super().__init__()
        if cfg.miner not in MINERS:  # a LossConfig edited after construction
            raise ValueError(f"loss.miner={cfg.miner!r} is invalid: use one of {', '.join(MINERS)}")
        if cfg.head not in HEADS:
            raise ValueError(f"loss.head={cfg.head!r} is invalid: use one of {', '.join(HEADS)}")
        self.ce_weight = cfg.ce_weight
        self.cross_rank = cfg.cross_rank
        self.head = cfg.head
        self.head_scale = cfg.effective_head_scale
        self.full_margin = cfg.margin
        self.full_head_margin = cfg.head_margin
        self.warmup_epochs = cfg.margin_warmup_epochs
        self.epoch: int | None = None  # set by set_epoch; needed only with a warm-up
        self.margin = cfg.margin  # the current margins (set_epoch changes them)
        self.head_margin = cfg.head_margin if cfg.head != "softmax" else 0.0
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
        """Set the margins of `epoch` (0-based) on the warm-up ramp; call before every epoch."""
        if epoch < 0:
            raise ValueError(f"set_epoch needs an epoch >= 0, got {epoch}")
        self.epoch = epoch
        # (epoch + 1) / (W + 1): never 0, so semi-hard mining finds triplets from the start.
        factor = min(1.0, (epoch + 1) / (self.warmup_epochs + 1)) if self.warmup_epochs else 1.0
        self.margin = factor * self.full_margin
        self.head_margin = factor * self.full_head_margin if self.head != "softmax" else 0.0
        self.triplet.margin = self.margin
        if isinstance(self.miner, miners.TripletMarginMiner):
            self.miner.margin = self.margin

    def forward(self, embeddings: Tensor, labels: Tensor, logits: Tensor | None = None) -> Tensor:
        return self._terms(embeddings, labels, logits)[0]

    def with_stats(self, embeddings: Tensor, labels: Tensor, logits: Tensor | None = None
                   ) -> tuple[Tensor, dict[str, float]]:
        """(loss, {"triplets", "triplet_loss", "ce_loss"} as floats)."""
        loss, triplet_loss, ce_loss, n_triplets = self._terms(embeddings, labels, logits)
        return loss, {"triplets": float(n_triplets), "triplet_loss": float(triplet_loss.detach()),
                      "ce_loss": float(ce_loss.detach())}

    def _terms(self, embeddings: Tensor, labels: Tensor, logits: Tensor | None
               ) -> tuple[Tensor, Tensor, Tensor, int]:
        """(loss, triplet term, cross-entropy term, mined triplets)."""
        _check_inputs(embeddings, labels, logits)
        if self.warmup_epochs and self.epoch is None:
            raise RuntimeError(
                f"loss.margin_warmup_epochs={self.warmup_epochs} ramps the margins per epoch: call "
                "TripletLoss.set_epoch(epoch) before each epoch (or set loss.margin_warmup_epochs=0)"
            )
        if logits is None and self.ce_weight > 0:
            raise ValueError(
                f"loss.ce_weight={self.ce_weight} needs classifier logits: build EmbeddingNet "
                "with num_classes > 0, or set loss.ce_weight=0"
            )
        labels = labels.to(embeddings.device)
        local_labels = labels
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            embeddings = embeddings.float()
            if self.cross_rank:
                embeddings, labels = _gather_global(embeddings, labels)
            triplets = self.miner(embeddings, labels) if len(labels) else ()
            n_triplets = int(triplets[0].shape[0]) if triplets else 0
            if n_triplets == 0:
                # Zero, yet connected to every embedding (and so every parameter and rank);
                # "+ 0.0" turns a -0.0 into 0.0.
                triplet_loss = embeddings.sum() * 0.0 + 0.0
            else:
                triplet_loss = self.triplet(embeddings, labels, triplets)
            loss = triplet_loss
            ce_loss = torch.zeros((), device=embeddings.device)
            if logits is not None and self.ce_weight > 0:
                ce_loss = (F.cross_entropy(self._margin_logits(logits, local_labels), local_labels)
                           if len(local_labels)
                           else logits.sum() * 0.0)  # no rows here (a dropped batch)
                loss = loss + self.ce_weight * ce_loss
        return loss, triplet_loss, ce_loss, n_triplets

    def _margin_logits(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The head's logits in fp32, with the current angular margin on the targets (arcface)."""
        logits = logits.float()
        if self.head == "softmax":
            return logits
        return angular_margin_logits(logits, labels, self.head_scale, self.head_margin)


def _gather_global(embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The global batch in rank order; this rank's rows keep their gradient.

    Ranks may hold different numbers of items (e.g. after skipped files): sizes are gathered
    first, and shorter batches are padded to the longest for the gather, then cut out again.
    Identity without a process group.
    """
    sizes = all_gather_nograd(torch.tensor([embeddings.shape[0]], device=embeddings.device))
    largest = int(sizes.max())
    if int(sizes.min()) == largest:
        return all_gather_with_grad(embeddings), all_gather_nograd(labels)
    missing = largest - embeddings.shape[0]
    embeddings = F.pad(embeddings, (0, 0, 0, missing))
    labels = torch.cat([labels, labels.new_full((missing,), -1)])
    gathered, gathered_labels = all_gather_with_grad(embeddings), all_gather_nograd(labels)
    keep = (torch.arange(largest, device=sizes.device)[None, :] < sizes[:, None]).flatten()
    return gathered[keep], gathered_labels[keep]


def _check_inputs(embeddings: Tensor, labels: Tensor, logits: Tensor | None) -> None:
    if embeddings.dim() != 2:
        raise ValueError(f"TripletLoss expects embeddings [batch, dim], got shape {list(embeddings.shape)}")
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"TripletLoss expects one label per embedding: embeddings {list(embeddings.shape)}, "
            f"labels {list(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"TripletLoss labels must be integers, got dtype {labels.dtype}")
    if logits is not None and (logits.dim() != 2 or logits.shape[0] != embeddings.shape[0]):
        raise ValueError(
            f"TripletLoss expects logits [batch, classes] with batch={embeddings.shape[0]}, "
            f"got shape {list(logits.shape)}"
        )
