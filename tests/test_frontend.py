"""The batched log-mel front end (audioclf.models.frontend, audioclf.spectrogram)."""

import numpy as np
import pytest
import torch

from audioclf.config import FeaturesConfig
from audioclf.models.frontend import FeatureFrontend, SpecAugment, UtteranceNorm
from audioclf.spectrogram import LogMel, log_mel

# ---------------------------------------------------------------------------------------------
# Front end


def test_log_mel_shapes_and_lengths():
    cfg = FeaturesConfig(n_mels=40)
    waves = torch.randn(3, 16000)
    lengths = torch.tensor([16000, 8000, 100])
    feats, frame_lengths = LogMel(cfg)(waves, lengths)
    assert feats.shape == (3, 16000 // 160 + 1, 40) and feats.dtype == torch.float32
    # Valid frames: centred windows (n_fft 512, hop 160) that end inside the clip.
    assert frame_lengths.tolist() == [(16000 - 256) // 160 + 1, (8000 - 256) // 160 + 1, 1]
    single = log_mel(waves[1, :8000], cfg)
    assert isinstance(single, np.ndarray) and single.shape == (49, 40)
    # The offline features are the front end's own frames (away from the zero-padded end).
    np.testing.assert_allclose(single[:45], feats[1, :45].numpy(), atol=1e-4)


def test_log_mel_is_fp32_under_autocast():
    lm = LogMel(FeaturesConfig(n_mels=32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats, _ = lm(torch.randn(2, 4000), torch.tensor([4000, 4000]))
    assert feats.dtype == torch.float32 and torch.isfinite(feats).all()


@pytest.mark.parametrize("mode", ["utterance", "utterance_bin"])
def test_utterance_norm_ignores_padding(mode):
    norm = UtteranceNorm(mode)
    torch.manual_seed(0)
    alone = torch.randn(1, 30, 8) * 3 + 5
    padded = torch.cat([alone, 1000 * torch.randn(1, 20, 8)], dim=1)
    out_alone = norm(alone, torch.tensor([30]))
    out_padded = norm(padded, torch.tensor([30]))
    torch.testing.assert_close(out_padded[:, :30], out_alone, atol=1e-5, rtol=1e-5)
    assert not out_padded[:, 30:].any()
    dims = (1,) if mode == "utterance_bin" else (1, 2)
    assert out_alone.mean(dim=dims).abs().max() < 1e-5
    assert (out_alone.std(dim=dims, unbiased=False) - 1).abs().max() < 1e-3


def test_utterance_norm_keeps_the_spectral_envelope_by_default():
    feats = torch.linspace(0, 7, 8).repeat(1, 30, 1)  # a bright-to-dark envelope, constant in time
    lengths = torch.tensor([30])
    kept = UtteranceNorm("utterance")(feats, lengths)
    removed = UtteranceNorm("utterance_bin")(feats, lengths)
    assert kept[0, 0, -1] > kept[0, 0, 0]  # bins still ordered
    assert removed.abs().max() < 1e-3  # per-bin CMVN wipes a stationary envelope
    with pytest.raises(ValueError, match="features.norm='x' is invalid"):
        UtteranceNorm("x")


def test_spec_augment_only_in_training():
    aug = SpecAugment(freq_mask=4, time_mask=10, num_masks=2)
    feats = torch.randn(8, 100, 32)
    aug.eval()
    assert torch.equal(aug(feats), feats)
    aug.train()
    torch.manual_seed(0)
    out = aug(feats)
    assert out.shape == feats.shape and not torch.equal(out, feats)
    changed = out != feats
    assert bool((out[changed] == 0).all())
    # Masks are drawn per example (iid_masks): examples differ in what was masked.
    per_example = changed.flatten(1).sum(dim=1)
    assert len(set(per_example.tolist())) > 1


@pytest.mark.parametrize("kind", ["audio", "npy"])
def test_frontend_both_kinds(kind):
    cfg = FeaturesConfig(kind=kind, n_mels=32)
    frontend = FeatureFrontend(cfg).eval()
    if kind == "audio":
        x, lengths = torch.randn(2, 8000), torch.tensor([8000, 4000])
        total, frames = 51, [49, 24]
    else:
        x, lengths = torch.randn(2, 60, 32), torch.tensor([60, 30])
        total, frames = 60, [60, 30]
    feats, feat_lengths = frontend(x, lengths)
    assert feats.shape == (2, total, 32) and feat_lengths.tolist() == frames
    assert not feats[1, frames[1] :].any()  # padding stays zero after normalisation
    assert feats[0].mean().abs() < 1e-4


def test_frontend_rejects_wrong_input_shape():
    with pytest.raises(ValueError, match=r"\[batch, frames, 32\]"):
        FeatureFrontend(FeaturesConfig(kind="npy", n_mels=32))(
            torch.zeros(2, 10, 40), torch.tensor([10, 10])
        )
    with pytest.raises(ValueError, match=r"\[batch, samples\]"):
        FeatureFrontend(FeaturesConfig(kind="audio"))(
            torch.zeros(2, 10, 40), torch.tensor([10, 10])
        )
