"""Cross-batch memory for the triplet miner (XBM, Wang et al. 2020; pytorch-metric-learning's
CrossBatchMemory): a queue of the last `size` training embeddings with their class and item,
mined against together with the current batch.

    memory = CrossBatchMemory(size=4096)
    refs, ref_classes, ref_items = memory.references(emb, classes, items)  # the batch, then the queue
    a, p, n = mine_with_items(emb, classes, items, refs, ref_classes, ref_items, "semi_hard", 0.2)
    memory.enqueue(global_emb, global_classes, global_items)  # the batch joins the queue

Anchors are the batch's rows; positives and negatives are drawn from the references (the batch
itself, with its gradient, then the queue, detached). Item-aware, as the metrics are: a
reference of the anchor's own item (the anchor itself, or another clip of its recording) is
never its positive. The miners are those of TripletLoss with pytorch-metric-learning's
definitions on cosine similarity s: batch_hard takes each anchor's least similar positive and
most similar negative; semi_hard the triplets with 0 < s(a,p) - s(a,n) <= margin; all those
with s(a,p) - s(a,n) <= margin (a non-zero loss).

The queue is filled with the global batch (every rank's, in rank order), so under DDP every
rank holds the same memory; a batch with a non-finite embedding is not queued (its step is
skipped). Neither `references` nor `enqueue` reads a value on the host: the queue's empty
slots go to the miner with class -1, which it never picks, and the finite check decides on
the device (the mining itself has data-dependent sizes: a sync per torch.nonzero). The queue's entries and write pointer are buffers: the checkpoint keeps them
("loss_memory"), so a resumed run mines as the uninterrupted one.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

log = logging.getLogger("audioclf")

MINERS = ("batch_hard", "semi_hard", "all")


class CrossBatchMemory(nn.Module):
    """A ring buffer of (embedding, class, item) rows; empty slots have class -1."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"loss.memory_size must be >= 1 when on, got {size}")
        super().__init__()
        self.size = size
        self.register_buffer("embeddings", torch.zeros(size, 0))  # [size, dim] on first enqueue
        self.register_buffer("classes", torch.full((size,), -1, dtype=torch.int64))
        self.register_buffer("items", torch.full((size,), -1, dtype=torch.int64))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.int64))

    def __len__(self) -> int:
        return int((self.classes >= 0).sum())

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        """The saved queue; None (a checkpoint from before loss.memory_size was set) empties
        it."""
        if state is None:
            log.info(
                "loss.memory_size=%d: the checkpoint holds no memory; it starts empty", self.size
            )
            self.classes.fill_(-1)
            self.pointer.zero_()
            return None
        # The embedding width is known once a batch was queued: take the saved shape.
        self.embeddings = torch.zeros_like(state["embeddings"], device=self.classes.device)
        return super().load_state_dict(state, strict=strict, assign=assign)

    def references(self, embeddings: Tensor, classes: Tensor, items: Tensor):
        """(embeddings, classes, items) of the batch followed by the queue's slots, empty ones
        with class -1 (mine_with_items never picks them); no host sync."""
        self._place(embeddings)
        if self.embeddings.shape[1] not in (0, embeddings.shape[1]):
            raise ValueError(
                f"the cross-batch memory holds {self.embeddings.shape[1]}-d embeddings, the "
                f"batch {embeddings.shape[1]}-d: resume with the model.embedding_dim it was "
                "filled with"
            )
        if self.embeddings.shape[1] == 0:  # nothing queued yet
            return embeddings, classes, items
        return (
            torch.cat([embeddings, self.embeddings]),
            torch.cat([classes, self.classes]),
            torch.cat([items, self.items]),
        )

    @torch.no_grad()
    def enqueue(self, embeddings: Tensor, classes: Tensor, items: Tensor) -> None:
        """Queue a (global) batch, overwriting the oldest rows; skipped when not all finite
        (decided on the device: no host sync)."""
        self._place(embeddings)
        if embeddings.shape[0] == 0:
            return
        if self.embeddings.shape[1] == 0:
            self.embeddings = embeddings.new_zeros(self.size, embeddings.shape[1])
        embeddings, classes, items = (
            embeddings[-self.size :],
            classes[-self.size :],
            items[-self.size :],
        )
        finite = torch.isfinite(embeddings).all()
        slots = (self.pointer + torch.arange(len(classes), device=self.pointer.device)) % self.size
        for queue, rows in (
            (self.embeddings, embeddings.float()),
            (self.classes, classes),
            (self.items, items),
        ):
            queue[slots] = torch.where(finite, rows, queue[slots])
        self.pointer.copy_((self.pointer + len(classes) * finite) % self.size)

    def _place(self, like: Tensor) -> None:
        if self.classes.device != like.device:
            self.to(like.device)


def mine_with_items(
    embeddings: Tensor,
    classes: Tensor,
    items: Tensor,
    refs: Tensor,
    ref_classes: Tensor,
    ref_items: Tensor,
    miner: str,
    margin: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(anchor, positive, negative) indices: anchors into `embeddings`, the others into `refs`.

    Positives share the anchor's class and not its item; negatives are of another class.
    """
    if miner not in MINERS:
        raise ValueError(f"loss.miner={miner!r} is invalid: use one of {', '.join(MINERS)}")
    with torch.no_grad():
        sim = embeddings @ refs.T
        same = classes[:, None] == ref_classes[None, :]
        positive = same & (items[:, None] != ref_items[None, :])
        negative = ~same & (ref_classes >= 0)[None, :]  # class -1: an empty slot of the queue
        if miner == "batch_hard":
            found = positive.any(1) & negative.any(1)
            hardest_positive = sim.masked_fill(~positive, torch.inf).argmin(1)
            hardest_negative = sim.masked_fill(~negative, -torch.inf).argmax(1)
            anchors = torch.nonzero(found).flatten()
            return anchors, hardest_positive[anchors], hardest_negative[anchors]
        anchors, positives = torch.nonzero(positive, as_tuple=True)
        # [pairs, refs]: how much more similar the positive is than each reference
        gap = sim[anchors, positives][:, None] - sim[anchors]
        keep = negative[anchors] & (gap <= margin)
        if miner == "semi_hard":
            keep &= gap > 0
        pair, negatives = torch.nonzero(keep, as_tuple=True)
        return anchors[pair], positives[pair], negatives
