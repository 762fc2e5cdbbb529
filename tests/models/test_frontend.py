"""The batched log-mel front end (audioclf.models.frontend, audioclf.spectrogram)."""

import math

import numpy as np
import pytest
import torch

from audioclf.config import FeaturesConfig, SpecAugmentConfig
from audioclf.models.frontend import FeatureFrontend, SpecAugment, SpectralJitter, UtteranceNorm
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


# ---------------------------------------------------------------------------------------------
# Spectral tilt and mel-axis warp (SpectralJitter)

DB = math.log(10.0) / 10.0  # 1 dB in natural-log power units


def test_jitter_off_returns_its_input_and_draws_nothing():
    feats = torch.randn(3, 20, 16)
    state = torch.get_rng_state()
    assert SpectralJitter().train()(feats) is feats  # both keys 0 (the defaults)
    assert SpectralJitter(6.0, 0.1).eval()(feats) is feats  # eval: never
    assert torch.equal(torch.get_rng_state(), state)
    assert SpecAugmentConfig().tilt_db == 0.0 and SpecAugmentConfig().freq_warp == 0.0


def test_tilt_adds_the_drawn_slope_across_the_bins():
    jitter = SpectralJitter(tilt_db=6.0).train()
    feats = torch.randn(8, 5, 16)
    torch.manual_seed(3)
    out = jitter(feats)
    torch.manual_seed(3)
    drawn_db = 6.0 * (2.0 * torch.rand(8) - 1.0)  # the one draw per example
    offset = out - feats
    assert torch.allclose(offset, offset[:, :1], atol=1e-5)  # the same in every frame
    slope = offset[:, 0, -1] - offset[:, 0, 0]  # highest minus lowest bin
    torch.testing.assert_close(slope, drawn_db * DB, atol=1e-5, rtol=0)
    steps = offset[:, 0, 1:] - offset[:, 0, :-1]
    assert torch.allclose(steps, steps[:, :1], atol=1e-5)  # linear across the bins
    assert torch.allclose(offset[:, 0].mean(1), torch.zeros(8), atol=1e-5)  # centred
    assert slope.abs().max() <= 6.0 * DB + 1e-6 and slope.std() > 0.5 * DB  # per example


def peak_bin(feats: torch.Tensor) -> torch.Tensor:
    """Sub-bin peak position of each example's (frame-averaged) spectrum: centroid of the top."""
    spectrum = feats.mean(1)
    top = spectrum.argmax(1, keepdim=True)
    near = torch.arange(spectrum.shape[1]).unsqueeze(0)
    weights = torch.where((near - top).abs() <= 2, spectrum.clamp(min=0), 0.0)
    return (weights * near).sum(1) / weights.sum(1)


def test_warp_moves_a_peak_along_the_mel_axis_by_the_drawn_factor():
    bins = torch.arange(64, dtype=torch.float32)
    bump = torch.exp(-0.5 * ((bins - 30.0) / 2.0) ** 2)  # a tonal peak at bin 30
    feats = bump.expand(6, 10, 64).clone()
    jitter = SpectralJitter(freq_warp=0.2).train()
    torch.manual_seed(5)
    out = jitter(feats)
    torch.manual_seed(5)
    factor = 1.0 + 0.2 * (2.0 * torch.rand(6) - 1.0)
    assert out.shape == feats.shape
    torch.testing.assert_close(peak_bin(out), 30.0 * factor, atol=0.3, rtol=0)
    assert (factor - 1).abs().max() > 0.05  # the draws did move it
    assert torch.allclose(out, out[:, :1], atol=1e-6)  # every frame alike


def test_jitter_is_seeded_by_torch_and_differs_across_seeds():
    jitter = SpectralJitter(tilt_db=4.0, freq_warp=0.1).train()
    feats = torch.randn(4, 30, 32)
    torch.manual_seed(0)
    first = jitter(feats)
    state = torch.get_rng_state()
    after_first = jitter(feats)
    torch.manual_seed(0)
    assert torch.equal(jitter(feats), first)
    torch.set_rng_state(state)  # as a resumed run restores the generator
    assert torch.equal(jitter(feats), after_first)
    assert not torch.equal(first, after_first)


@pytest.mark.filterwarnings("ignore:`torch.jit")  # deprecated: Future- or DeprecationWarning (2.11)
def test_frontend_jitter_before_the_norm_and_only_in_training():
    cfg = FeaturesConfig(n_mels=32)
    plain = FeatureFrontend(cfg).eval()
    jittered = FeatureFrontend(cfg, SpecAugmentConfig(enabled=False, tilt_db=10.0, freq_warp=0.2))
    waves, lengths = torch.randn(3, 8000), torch.tensor([8000, 6000, 3000])
    expected, expected_lengths = plain(waves, lengths)
    out, out_lengths = jittered.eval()(waves, lengths)
    assert torch.equal(out, expected) and torch.equal(out_lengths, expected_lengths)
    scripted = torch.jit.script(jittered)  # exports script the front end: still scriptable
    assert torch.equal(scripted(waves, lengths)[0], expected)
    torch.manual_seed(1)
    trained, _ = jittered.train()(waves, lengths)
    assert not torch.equal(trained, expected)
    assert not trained[2, 18:].any()  # padding still zero: the norm runs after the jitter
    valid = trained[0, :49]  # (8000 - 256) // 160 + 1 valid frames
    assert valid.mean().abs() < 1e-4 and (valid.std(unbiased=False) - 1).abs() < 1e-3
    torch.manual_seed(1)
    assert torch.equal(scripted.train()(waves, lengths)[0], trained)  # same draws when scripted
