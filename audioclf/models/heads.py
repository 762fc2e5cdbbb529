"""Classification head on top of the embedding (for the optional cross-entropy term).

The head holds the class weights, so they are parameters of the model that training wraps in
DDP (all-reduced with the rest). It outputs plain scaled cosines; an angular margin (ArcFace)
is a training-time change of the target logit that the loss applies (`angular_margin_logits`),
so exported models output the same logits without it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ClassifierHead(nn.Module):
    """Embedding [B, D] → logits [B, num_classes].

    `cosine=True` (default): logits = scale · cos(embedding, class weight), a normalised softmax
    that suits unit-length embeddings; with `subcenters=K > 1` each class has K weight vectors
    (rows c·K … c·K + K − 1 of `linear.weight`) and its cosine is the largest of the K
    (sub-center ArcFace). Computed in fp32 under autocast. `cosine=False`: a plain Linear layer.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        cosine: bool = True,
        scale: float = 16.0,
        subcenters: int = 1,
    ):
        super().__init__()
        if embedding_dim < 1 or num_classes < 1:
            raise ValueError(
                f"ClassifierHead needs embedding_dim >= 1 and num_classes >= 1, got "
                f"{embedding_dim} and {num_classes}"
            )
        if subcenters < 1 or scale <= 0:
            raise ValueError(
                f"ClassifierHead needs subcenters >= 1 and scale > 0, got {subcenters} and {scale}"
            )
        if subcenters > 1 and not cosine:
            raise ValueError("ClassifierHead sub-centers need cosine=True")
        self.cosine = cosine
        self.scale = scale
        self.num_classes = num_classes
        self.subcenters = subcenters
        self.linear = nn.Linear(embedding_dim, num_classes * subcenters, bias=not cosine)

    def forward(self, embeddings: Tensor) -> Tensor:
        if not self.cosine:
            return self.linear(embeddings)
        if torch.jit.is_scripting():  # TorchScript cannot take the device type at run time
            return self.scale * self.cosines(embeddings)
        # In fp32: under fp16/bf16 autocast cosines near 1 lose the resolution a margin needs.
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            return self.scale * self.cosines(embeddings)

    def cosines(self, embeddings: Tensor) -> Tensor:
        """cos(embedding, class) [B, num_classes]: the best of each class's sub-centers."""
        dtype = torch.promote_types(embeddings.dtype, torch.float32)
        weight = F.normalize(self.linear.weight.to(dtype), dim=1)
        cosine = F.linear(F.normalize(embeddings.to(dtype), dim=1), weight)
        if self.subcenters > 1:
            cosine = cosine.reshape(embeddings.shape[0], self.num_classes, self.subcenters).amax(
                dim=2
            )
        return cosine


def angular_margin_logits(logits: Tensor, labels: Tensor, scale: float, margin: float) -> Tensor:
    """ArcFace: the head's logits s·cos θ [B, C] with each row's target logit made s·cos(θ + m).

    Where θ + m > π, cos(θ + m) would rise again with θ; there the target gets
    s·(cos θ − m·sin m) instead, which keeps falling (the rule of InsightFace and of
    pytorch-metric-learning's ArcFaceLoss). Non-target logits are unchanged. `margin` is in
    radians; m = 0 gives the logits back. Computed in fp32 (or fp64).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    target = (logits.gather(1, labels.unsqueeze(1)) / scale).clamp(-1.0, 1.0)  # cos θ, [B, 1]
    # sin θ (θ in [0, π]); at cos θ = ±1 exactly it is 0, where sqrt's gradient would be infinite
    sine_squared = 1.0 - target * target
    sine = torch.where(sine_squared > 0, torch.sqrt(sine_squared.clamp(min=1e-12)), 0.0)
    with_margin = target * math.cos(margin) - sine * math.sin(margin)
    fallback = target - margin * math.sin(margin)
    with_margin = torch.where(target >= math.cos(math.pi - margin), with_margin, fallback)
    is_target = F.one_hot(labels, logits.shape[1]).to(torch.bool)
    return torch.where(is_target, scale * with_margin, logits)
