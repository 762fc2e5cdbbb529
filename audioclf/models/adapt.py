"""Unsupervised adaptation to a new source: AdaBN (Li et al., 2016) on unlabelled clips.

    record = adapt_batchnorm(net, clips)   # clips: one waveform [S] (or log-mel [T, F]) each,
                                           # on the host or the network's device

Every BatchNorm's running mean and variance become the statistics of its input over the new
source's clips, layer by layer in network order, each layer measured with every earlier one
already adapted: exactly what the adapted model then computes at inference. Clips go through
the network in batches of clips of one length (no padding enters the statistics: in eval mode
no layer mixes the rows of a batch) and only as far as the layer being measured. The clips stay
where they are (the host) and move to the network's device one batch at a time, so a large
source never has to fit on a GPU. The statistics are over every clip's frames (and bins) per
channel, float64 sums, population variance. Weights, affine parameters and frequency norms without running
statistics (model.early_norm=rfn) are left as they are. The model stays in eval mode; the
returned record says what was done, for the caller to write beside its output (never silent).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

ADAPTATION_METHOD = "adabn"


class _Measured(Exception):
    """Raised by the hook once the layer's input has been counted: the rest is not needed."""


class _Moments:
    """Per-channel running sums of a [N, C, ...] input, in float64."""

    def __init__(self) -> None:
        self.count = 0
        self.total: Tensor | None = None
        self.squares: Tensor | None = None

    def add(self, x: Tensor) -> None:
        values = x.detach().transpose(0, 1).reshape(x.shape[1], -1).double()
        self.count += values.shape[1]
        sums, squares = values.sum(dim=1), (values * values).sum(dim=1)
        self.total = sums if self.total is None else self.total + sums
        self.squares = squares if self.squares is None else self.squares + squares

    def mean_and_variance(self) -> tuple[Tensor, Tensor]:
        if self.total is None or self.squares is None or self.count == 0:
            raise ValueError("adaptation needs at least one clip")
        mean = self.total / self.count
        return mean, (self.squares / self.count - mean * mean).clamp(min=0.0)


def batchnorm_layers(net: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers with running statistics, in network (registration) order."""
    return [
        m
        for m in net.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


def same_length_batches(clips: Sequence[Tensor], batch_size: int) -> list[list[int]]:
    """Indices of `clips` in batches of at most `batch_size` clips of one shape, shortest first
    (the order within a shape is the clips' own)."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, clip in enumerate(clips):
        by_shape.setdefault(tuple(clip.shape), []).append(i)
    return [
        indices[start : start + batch_size]
        for _shape, indices in sorted(by_shape.items())
        for start in range(0, len(indices), batch_size)
    ]


@torch.no_grad()
def adapt_batchnorm(net: nn.Module, clips: Sequence[Tensor], *, batch_size: int = 32) -> dict:
    """AdaBN of `net` (an EmbeddingNet: `net.embed(x, lengths)`) on `clips`, in place. The
    clips may lie on the host: each batch of `batch_size` clips of one length is moved to the
    network's device when it is used.

    Returns {"method": "adabn", "clips": N, "batchnorm_layers": L}. A model without BatchNorm
    is returned unchanged with batchnorm_layers 0; no clips is a ValueError.
    """
    if len(clips) == 0:
        raise ValueError("adaptation needs at least one clip of the new source; got none")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    net.eval()
    layers = batchnorm_layers(net)
    batches = same_length_batches(clips, batch_size)
    device = next(net.parameters()).device if layers else None
    for layer in layers:
        moments = _Moments()

        def measure(_module, args, moments=moments):
            moments.add(args[0])
            raise _Measured

        handle = layer.register_forward_pre_hook(measure)
        try:
            for batch in batches:
                x = torch.stack([clips[i] for i in batch]).to(device, non_blocking=True)
                lengths = torch.full((len(batch),), x.shape[1], device=device)
                try:
                    net.embed(x, lengths)
                except _Measured:
                    pass
        finally:
            handle.remove()
        mean, variance = moments.mean_and_variance()
        layer.running_mean.copy_(mean.to(layer.running_mean.dtype))
        layer.running_var.copy_(variance.to(layer.running_var.dtype))
    return {"method": ADAPTATION_METHOD, "clips": len(clips), "batchnorm_layers": len(layers)}
