"""Unsupervised adaptation to a new source: AdaBN (Li et al., 2016) on unlabelled clips.

    record = adapt_batchnorm(net, clips)   # clips: one waveform [S] (or log-mel [T, F]) each

Every BatchNorm's running mean and variance become the statistics of its input over the new
source's clips, layer by layer in network order, each layer measured with every earlier one
already adapted: exactly what the adapted model then computes at inference. Each clip goes
through the network alone (no padding enters the statistics) and only as far as the layer
being measured. The statistics are over every clip's frames (and bins) per channel, float64
sums, population variance. Weights, affine parameters and frequency norms without running
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


@torch.no_grad()
def adapt_batchnorm(net: nn.Module, clips: Sequence[Tensor]) -> dict:
    """AdaBN of `net` (an EmbeddingNet: `net.embed(x, lengths)`) on `clips`, in place.

    Returns {"method": "adabn", "clips": N, "batchnorm_layers": L}. A model without BatchNorm
    is returned unchanged with batchnorm_layers 0; no clips is a ValueError.
    """
    if len(clips) == 0:
        raise ValueError("adaptation needs at least one clip of the new source; got none")
    net.eval()
    layers = batchnorm_layers(net)
    for layer in layers:
        moments = _Moments()

        def measure(_module, args, moments=moments):
            moments.add(args[0])
            raise _Measured

        handle = layer.register_forward_pre_hook(measure)
        try:
            for clip in clips:
                try:
                    net.embed(clip.unsqueeze(0), torch.tensor([clip.shape[0]], device=clip.device))
                except _Measured:
                    pass
        finally:
            handle.remove()
        mean, variance = moments.mean_and_variance()
        layer.running_mean.copy_(mean.to(layer.running_mean.dtype))
        layer.running_var.copy_(variance.to(layer.running_var.dtype))
    return {"method": ADAPTATION_METHOD, "clips": len(clips), "batchnorm_layers": len(layers)}
