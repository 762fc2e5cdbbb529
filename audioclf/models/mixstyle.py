"""MixStyle: mix the feature statistics ("style") of each training example with those of an
example of another class in the batch, so the network cannot rely on them.

    Freq-MixStyle (Schmid et al., DCASE 2022): on the log-mel [B, T, F], the per-bin mean and
    standard deviation over time, in the front end.
    MixStyle (Zhou et al., ICLR 2021): on the maps [B, C, T, F] after the first block(s) of the
    CNN / ResNet, the per-channel mean and standard deviation over time and frequency.

Each example x_b is normalised with its own statistics (mu_b, sigma_b, detached) and rescaled
with lam·mu_b + (1 - lam)·mu_p and the same mix of sigma, p = partners[b] (`style_partners`: a
random example of another class), lam ~ Beta(alpha, alpha) for a share `prob` of the examples
and 1 (unchanged) for the rest. Statistics use the valid frames only (frames < lengths[b]);
padded frames come out as zeros. Training only: without partners (inference, eval, exports) the
input is returned unchanged. Draws come from torch's generator on the input's device (as
SpecAugment), so a seeded run repeats and a resumed run, which restores it, repeats too. The
draws make no host sync: alpha lives in a buffer on the model's device, and the Beta distribution
is built without argument validation (validating reads its parameters back to the host).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from audioclf.models.pooling import lengths_to_mask


def style_partners(labels: Tensor) -> Tensor:
    """For each row, a random row of another class (the row itself when all share one class)."""
    other = labels.unsqueeze(0) != labels.unsqueeze(1)  # [B, B]
    scores = torch.rand(other.shape, device=labels.device).masked_fill(~other, -1.0)
    partners = scores.argmax(dim=1)
    itself = torch.arange(labels.numel(), device=labels.device)
    return torch.where(other.any(dim=1), partners, itself)


class MixStyle(nn.Module):
    """Mix per-example statistics with a partner's; `frequency=True`: x [B, T, F], statistics
    over time per bin (Freq-MixStyle); False: x [B, C, T, F], over time and frequency per
    channel. `prob` = 0 is the identity. forward(x, lengths, partners) with partners None
    (inference, exports) returns x unchanged. Inside a CNN / ResNet, `after(block, ...)` mixes
    after each of the first `blocks` early blocks (augment.mixstyle_blocks)."""

    def __init__(
        self, prob: float = 0.0, alpha: float = 0.3, frequency: bool = False, blocks: int = 0
    ):
        super().__init__()
        self.prob = float(prob)
        self.alpha = float(alpha)
        self.frequency = frequency
        self.blocks = blocks
        # Beta(alpha, alpha)'s two concentrations, moved with the model; not saved (from config)
        self.register_buffer("concentration", torch.full((2,), self.alpha), persistent=False)

    def forward(self, x: Tensor, lengths: Tensor, partners: Tensor | None = None) -> Tensor:
        if partners is None or not self.training or self.prob == 0.0:
            return x
        return self._mix(x, lengths, partners)

    def after(
        self, block: int, x: Tensor, lengths: Tensor, partners: Tensor | None = None
    ) -> Tensor:
        """x after early block `block` (0 = first: a CNN's first block, a ResNet's stem),
        mixed when it is one of the first `blocks`."""
        if block >= self.blocks:
            return x
        return self.forward(x, lengths, partners)

    @torch.jit.unused
    def mixing_weights(self, rows: int) -> Tensor:
        """[rows] lam: Beta(alpha, alpha) for a share `prob` of the rows, 1 for the others; the
        same draws from torch's generator as before, without reading anything to the host."""
        first, second = self.concentration.float().unbind()
        beta = torch.distributions.Beta(first, second, validate_args=False)
        lam = beta.sample((rows,))
        chosen = torch.rand(rows, device=self.concentration.device) < self.prob
        return torch.where(chosen, lam, 1.0)

    @torch.jit.unused
    def _mix(self, x, lengths, partners):  # unannotated: torch.jit.unused cannot read them
        time_dim = 1 if self.frequency else 2
        dims = (1,) if self.frequency else (2, 3)
        shape = [x.shape[0]] + [1] * (x.dim() - 1)
        keep_shape = list(shape)
        keep_shape[time_dim] = x.shape[time_dim]
        keep = lengths_to_mask(lengths, x.shape[time_dim]).reshape(keep_shape).to(torch.float32)
        feats = x.float()
        count = (keep * torch.ones_like(feats)).sum(dim=dims, keepdim=True).clamp(min=1.0)
        mean = ((feats * keep).sum(dim=dims, keepdim=True) / count).detach()
        var = ((((feats - mean) * keep) ** 2).sum(dim=dims, keepdim=True) / count).detach()
        std = torch.sqrt(var + 1e-5)
        lam = self.mixing_weights(x.shape[0]).reshape(shape)
        mixed_mean = lam * mean + (1.0 - lam) * mean[partners]
        mixed_std = lam * std + (1.0 - lam) * std[partners]
        return (((feats - mean) / std * mixed_std + mixed_mean) * keep).to(x.dtype)
