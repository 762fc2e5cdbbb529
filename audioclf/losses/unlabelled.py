"""The objective of a run with unlabelled audio (data.unlabelled): the labelled terms, the
triplet term also over pseudo-classes, and NT-Xent over two views of each unlabelled clip.

    objective = UnlabelledObjective(build_loss(cfg), ViewsLoss(0.1), views_weight=1.0,
                                    n_labelled=L, n_clips=U, n_classes=C)
    objective.set_pseudo_labels(labels)        # per clip: its pseudo-class, or -1
    loss = objective.objective(model_output, labels, positions)

A batch row's role follows from its dataset position (data.sampler.MixedBatchSampler's
layout), so rows dropped from a batch (unreadable files) never shift the roles:
    - [0, L): a labelled row: every labelled term (triplet, the head's cross-entropy);
    - [L, L + U): a clip as a member of its pseudo-class: the triplet term only, with class
      C + its pseudo-label (the head has no weights for pseudo-classes);
    - [L + U, L + 2U): a view of clip (position - L - U): the NT-Xent term, whose positives are
      the views of one clip and whose negatives are every other view of the step (every rank's:
      `ViewsLoss`).
Terms are summed with weights, as WeightedLosses (PML's MultipleLosses) does.
"""

from __future__ import annotations

import numpy as np
import torch
from pytorch_metric_learning import losses
from torch import Tensor, nn

from audioclf.losses import WeightedLosses, gather_global


class ViewsLoss(nn.Module):
    """NT-Xent (PML's NTXentLoss) over views: rows with one label are views of one clip.

    In a process group the term is over the step's global batch, as loss.cross_rank's triplet
    term: every rank gathers the views of all ranks (gather_global, its own rows keeping their
    gradient) and computes the same loss, so a view's negatives are every other clip's views of
    the step, not only its rank's (2 ranks of cpu_small: 14 instead of 6), and the gradients
    that DDP averages are the single-process gradients over the concatenated views.
    """

    def __init__(self, temperature: float):
        super().__init__()
        self.ntxent = losses.NTXentLoss(temperature=temperature)

    def forward(self, embeddings: Tensor, clips: Tensor) -> Tensor:
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            embeddings, clips = gather_global(embeddings.float(), clips.to(embeddings.device))
            # "+ 0 × sum": zero when no clip has two views, yet connected to every embedding
            # (and to the gather, whose backward is a collective every rank must join)
            connected = embeddings.sum() * 0.0
            if len(clips) < 2:
                return connected
            return self.ntxent(embeddings, clips) + connected


class UnlabelledObjective(nn.Module):
    """Labelled terms + pseudo-classes in the triplet term + views_weight × NT-Xent of views."""

    memory = None  # no cross-batch memory (Config refuses loss.memory_size with data.unlabelled)

    def __init__(
        self,
        labelled: WeightedLosses,
        views: ViewsLoss,
        *,
        views_weight: float,
        n_labelled: int,
        n_clips: int,
        n_classes: int,
    ):
        super().__init__()
        if labelled.memory is not None:
            raise ValueError("the cross-batch memory (loss.memory_size) is not for data.unlabelled")
        self.labelled, self.views, self.views_weight = labelled, views, views_weight
        self.n_labelled, self.n_clips, self.n_classes = n_labelled, n_clips, n_classes
        self.pseudo_classes = torch.full((n_clips,), -1, dtype=torch.int64)

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
        return total
