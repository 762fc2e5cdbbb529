"""Helpers shared by several test files (test modules do not import each other)."""

from __future__ import annotations

from pathlib import Path

import torch

from audioclf.config import config_from_dict, to_dict

TINY_MODELS = {
    "cnn": {"name": "cnn", "embedding_dim": 16, "cnn": {"width": 8, "depth": 2}},
    "conformer": {"name": "conformer", "embedding_dim": 16,
                  "conformer": {"d_model": 32, "num_heads": 2, "ffn_dim": 64, "num_layers": 2,
                                "kernel_size": 7}},
}


def make_checkpoint(path: Path, name: str = "cnn", classes: tuple[str, ...] = (), seed: int = 0
                    ) -> Path:
    """A checkpoint as the trainer writes it (model, config, classes), of an untrained model
    with non-trivial BatchNorm statistics."""
    from audioclf.models import build_net

    cfg = config_from_dict({
        "features": {"sample_rate": 8000, "n_fft": 256, "win_length": 200, "hop_length": 80,
                     "n_mels": 32},
        "model": {**TINY_MODELS[name], "head": "softmax" if classes else "none"},
    })
    torch.manual_seed(seed)
    net = build_net(cfg, len(classes))
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 2.0)
    torch.save({"model": net.state_dict(), "config": to_dict(cfg), "classes": list(classes),
                "epoch": 3, "step": 30}, path)
    return path
