"""Embedding networks, the model registry, and the module that training wraps in DDP.

Nothing here knows about ranks or devices: wrapping (DDP, SyncBN) lives in distributed.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from audioclf.config import AugmentConfig, Config, ModelConfig
from audioclf.models.cnn import CNNEmbedder
from audioclf.models.conformer import ConformerEmbedder
from audioclf.models.ecapa import ECAPAEmbedder
from audioclf.models.frontend import FeatureFrontend
from audioclf.models.heads import ClassifierHead
from audioclf.models.mixstyle import MixStyle, style_partners
from audioclf.models.norms import EarlyNorm
from audioclf.models.resnet import ResNetEmbedder

__all__ = [
    "MODELS",
    "build_model",
    "build_net",
    "count_parameters",
    "EmbeddingNet",
    "ClassifierHead",
]


def _cnn(cfg: ModelConfig, n_mels: int, augment: AugmentConfig) -> nn.Module:
    return CNNEmbedder(n_mels, cfg.cnn, cfg.embedding_dim, EarlyNorm.of(cfg), _block_style(augment))


def _resnet(cfg: ModelConfig, n_mels: int, augment: AugmentConfig) -> nn.Module:
    return ResNetEmbedder(
        n_mels, cfg.resnet, cfg.embedding_dim, EarlyNorm.of(cfg), _block_style(augment)
    )


def _conformer(cfg: ModelConfig, n_mels: int, augment: AugmentConfig) -> nn.Module:
    return ConformerEmbedder(n_mels, cfg.conformer, cfg.embedding_dim)


def _ecapa(cfg: ModelConfig, n_mels: int, augment: AugmentConfig) -> nn.Module:
    return ECAPAEmbedder(n_mels, cfg.ecapa, cfg.embedding_dim)


def _block_style(augment: AugmentConfig) -> MixStyle:
    """augment.mixstyle's MixStyle after the first early blocks (the config allows it for the
    CNN and the ResNet only)."""
    return MixStyle(augment.mixstyle, augment.mixstyle_alpha, blocks=augment.mixstyle_blocks)


# model.name -> its builder: (model section, mel bins, augment section) -> the embedder
MODELS: dict[str, Callable[[ModelConfig, int, AugmentConfig], nn.Module]] = {
    "cnn": _cnn,
    "conformer": _conformer,
    "resnet": _resnet,
    "ecapa": _ecapa,
}


def build_model(cfg: ModelConfig, n_mels: int, augment: AugmentConfig | None = None) -> nn.Module:
    """The embedder named by `model.name`: log-mel [B, T, n_mels] → unit embeddings [B, D],
    with augment.mixstyle inside when given `augment`."""
    if cfg.name not in MODELS:
        raise ValueError(f"model.name={cfg.name!r} is unknown; valid names: {', '.join(MODELS)}")
    return MODELS[cfg.name](cfg, n_mels, augment or AugmentConfig())


def build_net(cfg: Config, num_classes: int) -> EmbeddingNet:
    """The architecture (cfg.model with its head, cfg.features) with cfg.spec_augment's masks
    and cfg.augment's MixStyle: front end + embedder (+ model.head over `num_classes`, unless
    model.head=none)."""
    model = cfg.model
    embedder = build_model(model, cfg.features.n_mels, cfg.augment)
    head_classes = num_classes if model.head != "none" else 0
    return EmbeddingNet(
        FeatureFrontend(cfg.features, cfg.spec_augment, cfg.augment),
        embedder,
        num_classes=head_classes,
        head_scale=model.effective_head_scale,
        head_subcenters=model.head_subcenters,
    )


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter values (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class EmbeddingNet(nn.Module):
    """Front end + embedder (+ optional classifier head): what training wraps in DDP.

    forward(x, lengths, labels=None) → (embeddings [B, D], logits [B, C] or None); x is
    waveforms [B, S] or features [B, T, F] as the front end expects, lengths in samples or
    frames. The logits are the head's scaled cosines, without a margin (the loss adds it in
    training). In training mode with `labels` (one per row), MixStyle and Freq-MixStyle
    (augment.mixstyle, augment.freq_mixstyle) mix each row's statistics with those of a row of
    another class; without labels, in eval mode and in exports nothing is mixed.
    `embed` returns the embeddings alone (call it in eval mode: SpecAugment and dropout follow
    the module's training flag).
    """

    def __init__(
        self,
        frontend: FeatureFrontend,
        embedder: nn.Module,
        num_classes: int = 0,
        head_scale: float = 16.0,
        head_subcenters: int = 1,
    ):
        super().__init__()
        if num_classes < 0:
            raise ValueError(
                f"num_classes must be >= 0 (0 = no classifier head), got {num_classes}"
            )
        self.frontend = frontend
        self.embedder = embedder
        # Partners are drawn only with a MixStyle on: without, training draws what it drew before.
        embedder_style = getattr(embedder, "style", None)
        self.mixes_styles = frontend.style.prob > 0.0 or (
            embedder_style is not None and embedder_style.prob > 0.0
        )
        self.num_classes = num_classes
        self.head: ClassifierHead | None = (
            ClassifierHead(
                embedder.embedding_dim, num_classes, scale=head_scale, subcenters=head_subcenters
            )
            if num_classes > 0
            else None
        )

    def forward(
        self, x: Tensor, lengths: Tensor, labels: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        if (
            self.mixes_styles
            and self.training
            and labels is not None
            and labels.numel() == x.shape[0]
        ):
            embeddings = self._embed_mixing_styles(x, lengths, labels)
        else:
            embeddings = self.embed(x, lengths)
        if self.head is None:
            return embeddings, None
        return embeddings, self.head(embeddings)

    @torch.jit.ignore
    def output_parameters(self) -> list[nn.Parameter]:
        """The embedding layer's and the head's parameters (what optim.freeze_epochs trains)."""
        head = list(self.head.parameters()) if self.head is not None else []
        return list(self.embedder.embedding.parameters()) + head

    @torch.jit.unused
    def _embed_mixing_styles(self, x, lengths, labels):  # unannotated for torch.jit.unused
        """embed() with style partners drawn from `labels` (training only; never exported)."""
        partners = style_partners(labels)
        feats, feat_lengths = self.frontend(x, lengths, partners)
        if isinstance(self.embedder, CNNEmbedder | ResNetEmbedder):
            return self.embedder(feats, feat_lengths, partners)
        return self.embedder(feats, feat_lengths)

    @torch.jit.export
    def embed(self, x: Tensor, lengths: Tensor) -> Tensor:
        feats, feat_lengths = self.frontend(x, lengths)
        return self.embedder(feats, feat_lengths)
