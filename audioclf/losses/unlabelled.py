"""The objective of a run with unlabelled audio (data.unlabelled): the labelled terms, the
triplet term also over pseudo-classes, NT-Xent over two views of each unlabelled clip, and
(unlabelled.align_weight) an MMD term between the batch's labelled and unlabelled rows.

    objective = UnlabelledObjective(build_loss(cfg), ViewsLoss(0.1), views_weight=1.0,
                                    n_labelled=L, n_clips=U, n_classes=C, align_weight=0.0)
    objective.set_pseudo_labels(labels)        # per clip: its pseudo-class, or -1
    loss = objective.objective(model_output, labels, positions)

A batch row's role follows from its dataset position (data.sampler.MixedBatchSampler's
layout), so rows dropped from a batch (unreadable files) never shift the roles:
    - [0, L): a labelled row: every labelled term (triplet, the head's cross-entropy);
    - [L, L + U): a clip as a member of its pseudo-class: the triplet term only, with class
      C + its pseudo-label (the head has no weights for pseudo-classes);
    - [L + U, L + 2U): a view of clip (position - L - U): the NT-Xent term, whose positives are
      the views of one clip and whose negatives are every other view in the batch.
Terms are summed with weights, as WeightedLosses (PML's MultipleLosses) does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses
from torch import Tensor, nn

from audioclf.losses import WeightedLosses, _gather_global
from audioclf.losses.memory import CrossBatchMemory


class ViewsLoss(nn.Module):
    """NT-Xent (PML's NTXentLoss) over views: rows with one label are views of one clip.

    With `neighbours` > 0, a queue of that many past views (CrossBatchMemory, gathered from
    every rank, checkpointed) gives each view a further positive once it is full: its nearest
    queued view of another clip (NNCLR, Dwibedi et al., 2021), detached. Two crops of one clip
    share its source, speaker and recording; the neighbour is the model's guess at the same
    content from another, the nuisance it should not see."""

    def __init__(self, temperature: float, neighbours: int = 0):
        super().__init__()
        self.ntxent = losses.NTXentLoss(temperature=temperature)
        self.memory = CrossBatchMemory(neighbours) if neighbours else None

    def forward(self, embeddings: Tensor, clips: Tensor) -> Tensor:
        # "+ 0 × sum": zero when no clip has two views here, yet connected to every embedding
        connected = embeddings.sum() * 0.0
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            rows, labels = embeddings.float(), clips
            if self.memory is not None:
                rows, labels = self._with_neighbours(rows, clips)
            if len(labels) < 2:
                return connected
            return self.ntxent(rows, labels) + connected

    def _with_neighbours(self, rows: Tensor, clips: Tensor) -> tuple[Tensor, Tensor]:
        """The rows followed by each one's nearest queued view of another clip (a full queue
        only; a host sync), with their clips; then the (global) views join the queue."""
        memory = self.memory
        queued, queued_clips, _ = memory.references(rows[:0], clips[:0], clips[:0])
        batch = _gather_global(rows.detach(), clips, clips, grad=False)  # every rank's views
        if len(queued) and bool((queued_clips >= 0).all()):
            with torch.no_grad():
                similar = F.normalize(rows, dim=1) @ F.normalize(queued, dim=1).T
                similar = similar.masked_fill(clips[:, None] == queued_clips[None, :], -torch.inf)
                best, nearest = similar.max(dim=1)
                found = torch.isfinite(best)
            rows = torch.cat([rows, queued[nearest[found]]])
            clips = torch.cat([clips, clips[found]])
        memory.enqueue(*batch)
        return rows, clips


def mmd(source: Tensor, target: Tensor, scales: tuple[float, ...] = (0.5, 1.0, 2.0)) -> Tensor:
    """Squared maximum mean discrepancy between two sets of rows (the biased estimate), under a
    sum of Gaussian kernels exp(-d² / (scale · mean d²)), the mean over every pair of rows of
    both sets (held fixed for the gradient), as DAN's multi-kernel MMD (Long et al., 2015).
    Zero, still connected to every row, when either set has fewer than two rows."""
    if len(source) < 2 or len(target) < 2:
        return (source.sum() + target.sum()) * 0.0
    with torch.autocast(device_type=source.device.type, enabled=False):
        rows = torch.cat([source, target]).float()
        squared = torch.cdist(rows, rows).pow(2)
        bandwidth = squared.detach().mean().clamp_min(1e-12)
        kernel = sum(torch.exp(-squared / (scale * bandwidth)) for scale in scales)
        n = len(source)
        return kernel[:n, :n].mean() + kernel[n:, n:].mean() - 2 * kernel[:n, n:].mean()


class UnlabelledObjective(nn.Module):
    """Labelled terms + pseudo-classes in the triplet term + views_weight × NT-Xent of views
    + align_weight × MMD(labelled rows, unlabelled rows)."""

    def __init__(
        self,
        labelled: WeightedLosses,
        views: ViewsLoss,
        *,
        views_weight: float,
        n_labelled: int,
        n_clips: int,
        n_classes: int,
        align_weight: float = 0.0,
    ):
        super().__init__()
        if labelled.memory is not None:
            raise ValueError("the cross-batch memory (loss.memory_size) is not for data.unlabelled")
        self.labelled, self.views, self.views_weight = labelled, views, views_weight
        self.align_weight = align_weight
        self.n_labelled, self.n_clips, self.n_classes = n_labelled, n_clips, n_classes
        self.pseudo_classes = torch.full((n_clips,), -1, dtype=torch.int64)

    @property
    def memory(self) -> CrossBatchMemory | None:
        """The views' queue (unlabelled.neighbours), a checkpointed state; the labelled terms
        have none (Config refuses loss.memory_size with data.unlabelled)."""
        return self.views.memory

    def set_epoch(self, epoch: int) -> None:
        self.labelled.set_epoch(epoch)

    def set_pseudo_labels(self, labels: np.ndarray) -> None:
        """Each clip's pseudo-label (-1: none), as the sampler was given them."""
        labels = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
        self.pseudo_classes = torch.where(labels >= 0, labels + self.n_classes, -1).to(
            self.pseudo_classes.device
        )

    def objective(
        self, output: tuple[Tensor, Tensor | None], labels: Tensor, positions: Tensor
    ) -> Tensor:
        """The loss of an EmbeddingNet's output for the rows at `positions` (what TrainStep
        calls). Selecting the rows of each role is a host sync (boolean masks)."""
        embeddings, logits = output
        positions = positions.to(labels.device, non_blocking=True)
        if self.pseudo_classes.device != labels.device:
            self.pseudo_classes = self.pseudo_classes.to(labels.device)
        first_view = self.n_labelled + self.n_clips
        real = positions < self.n_labelled
        member = ~real & (positions < first_view)
        clip = (positions - self.n_labelled).clamp(0, self.n_clips - 1)
        triplet_labels = torch.where(
            real, labels, torch.where(member, self.pseudo_classes[clip], -1)
        )
        classed = triplet_labels >= 0
        total = None
        for name, term in self.labelled.terms.items():
            rows = classed if name == "triplet" else real
            value = term(
                embeddings[rows], triplet_labels[rows], None if logits is None else logits[rows]
            )
            weighted = self.labelled.weights[name] * value
            total = weighted if total is None else total + weighted
        view = positions >= first_view
        total = total + self.views_weight * self.views(embeddings[view], positions[view])
        if self.align_weight:
            total = total + self.align_weight * mmd(embeddings[real], embeddings[~real])
        return total
