"""Classification head on top of the embedding (for the optional cross-entropy term)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class ClassifierHead(nn.Module):
    """Embedding [B, D] → logits [B, num_classes].

    `cosine=True` (default): logits = scale · cos(embedding, class weight), a normalised softmax
    that suits unit-length embeddings; `cosine=False`: a plain Linear layer.
    """

    def __init__(self, embedding_dim: int, num_classes: int, cosine: bool = True, scale: float = 16.0):
        super().__init__()
        if embedding_dim < 1 or num_classes < 1:
            raise ValueError(
                f"ClassifierHead needs embedding_dim >= 1 and num_classes >= 1, got "
                f"{embedding_dim} and {num_classes}"
            )
        self.cosine = cosine
        self.scale = scale
        self.linear = nn.Linear(embedding_dim, num_classes, bias=not cosine)

    def forward(self, embeddings: Tensor) -> Tensor:
        if self.cosine:
            weight = F.normalize(self.linear.weight, dim=1)
            return self.scale * F.linear(F.normalize(embeddings, dim=1), weight)
        return self.linear(embeddings)
