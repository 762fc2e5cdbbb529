"""model.early_norm: relaxed frequency-wise norm and SubSpectral Norm in the early CNN/ResNet
blocks; statistics against a plain loop, padding, export parity, SyncBatchNorm conversion."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from audioclf.config import config_from_dict
from audioclf.export import main as export_main
from audioclf.inference import load_trained
from audioclf.models import build_net
from audioclf.models.norms import RelaxedFrequencyNorm, SubSpectralNorm
from tests.helpers import TINY_FEATURES, make_checkpoint

MODELS = {
    "cnn": {"name": "cnn", "embedding_dim": 16, "cnn": {"width": 8, "depth": 2}},
    "resnet": {"name": "resnet", "embedding_dim": 16, "resnet": {"width": 4, "blocks": [1, 1]}},
}
TOL = 1e-4


def net_with(name: str, **model):
    cfg = config_from_dict({"features": TINY_FEATURES, "model": {**MODELS[name], **model}})
    torch.manual_seed(0)
    return build_net(cfg, 0)


def rfn_loop(x: torch.Tensor, lengths: torch.Tensor, lam: float, eps: float = 1e-5):
    """lam · IFN + (1 - lam) · LN, one example and one bin at a time, valid frames only."""
    out = torch.zeros_like(x)
    for b, n in enumerate(lengths.tolist()):
        valid = x[b, :, :n, :]  # [C, n, F]
        layer = (valid - valid.mean()) / torch.sqrt(valid.var(unbiased=False) + eps)
        for f in range(x.shape[3]):
            band = valid[:, :, f]
            ifn = (band - band.mean()) / torch.sqrt(band.var(unbiased=False) + eps)
            out[b, :, :n, f] = lam * ifn + (1 - lam) * layer[:, :, f]
    return out


def test_relaxed_frequency_norm_matches_a_plain_loop():
    x = torch.randn(3, 4, 9, 6) * torch.rand(1, 1, 1, 6) * 4 + torch.randn(1, 1, 1, 6)
    lengths = torch.tensor([9, 5, 2])
    x[1, :, 5:] = 100.0  # padding must not enter the statistics
    norm = RelaxedFrequencyNorm(4, lam=0.3)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
        norm.bias.copy_(torch.tensor([0.0, 0.1, -0.2, 0.3]))
    expected = rfn_loop(x, lengths, 0.3)
    expected = expected * norm.weight[None, :, None, None] + norm.bias[None, :, None, None]
    for b, n in enumerate(lengths.tolist()):
        expected[b, :, n:] = 0
    torch.testing.assert_close(norm(x, lengths), expected, atol=1e-5, rtol=1e-5)


def test_subspectral_norm_normalises_each_band_on_its_own():
    x = torch.randn(5, 3, 7, 8)
    x[..., 4:] = x[..., 4:] * 10 + 3  # the upper band has other statistics
    norm = SubSpectralNorm(3, groups=2).train()
    out = norm(x, torch.full((5,), 7))
    for band in (slice(0, 4), slice(4, 8)):
        part = out[..., band]
        torch.testing.assert_close(part.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            part.var(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-3, rtol=0
        )
    assert norm.bn.num_features == 6


@pytest.mark.parametrize("name", ["cnn", "resnet"])
@pytest.mark.parametrize("kind", ["rfn", "subspectral"])
def test_early_norm_replaces_batchnorm_in_the_early_blocks_only(name, kind):
    plain, switched = net_with(name), net_with(name, early_norm=kind, early_norm_blocks=1)
    frequency_norms = (RelaxedFrequencyNorm, SubSpectralNorm)
    assert not any(isinstance(m, frequency_norms) for m in plain.modules())
    found = [m for m in switched.modules() if isinstance(m, frequency_norms)]
    assert len(found) == 2 if name == "cnn" else 1  # a CNN block's two norms; the ResNet stem
    x = 0.1 * torch.randn(3, 4000)
    lengths = torch.tensor([4000, 3100, 1800])
    switched.eval()
    with torch.no_grad():
        batched = switched.embed(x, lengths)
        alone = torch.cat(
            [
                switched.embed(x[i : i + 1, :n], lengths[i : i + 1])
                for i, n in enumerate(lengths.tolist())
            ]
        )
    # padding never changes an embedding (as with BatchNorm in eval mode); the last frames of
    # a padded clip see zero padding instead of reflection in the log-mel, hence the tolerance
    torch.testing.assert_close(batched, alone, atol=0.05, rtol=0)


@pytest.mark.filterwarnings("ignore:`torch.jit")
@pytest.mark.parametrize("name", ["cnn", "resnet"])
@pytest.mark.parametrize("kind", ["rfn", "subspectral"])
def test_an_early_norm_model_scripts_with_parity(name, kind):
    net = net_with(name, early_norm=kind, early_norm_blocks=2).eval()
    scripted = torch.jit.script(net)
    x = 0.1 * torch.randn(2, 6000)
    lengths = torch.tensor([6000, 3500])
    with torch.no_grad():
        torch.testing.assert_close(
            scripted.embed(x, lengths), net.embed(x, lengths), atol=TOL, rtol=0
        )


@pytest.mark.filterwarnings("ignore:`torch.jit")
@pytest.mark.parametrize("kind", ["rfn", "subspectral"])
@pytest.mark.parametrize("fmt", ["torchscript", pytest.param("onnx", marks=pytest.mark.slow)])
def test_the_export_cli_keeps_parity_with_an_early_norm(tmp_path, capsys, kind, fmt):
    if fmt == "onnx":
        for module in ("onnx", "onnxscript", "onnxruntime"):
            pytest.importorskip(module)
    ckpt = make_checkpoint(
        tmp_path / "best.pt", "cnn", model={"early_norm": kind, "early_norm_blocks": 2}
    )
    out = tmp_path / f"model.{'pt' if fmt == 'torchscript' else 'onnx'}"
    code = export_main(["--checkpoint", str(ckpt), "--format", fmt, "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    meta = json.loads(out.with_name(out.name + ".json").read_text())
    assert meta["parity"]["max_abs_diff"] <= TOL
    net, _, _ = load_trained(ckpt)
    assert any(isinstance(m, RelaxedFrequencyNorm | SubSpectralNorm) for m in net.modules())


def test_syncbn_conversion_reaches_the_subspectral_batchnorm_and_leaves_rfn_alone():
    for kind, inner in (("subspectral", True), ("rfn", False)):
        net = nn.SyncBatchNorm.convert_sync_batchnorm(
            net_with("cnn", early_norm=kind, early_norm_blocks=1)
        )
        plain_bn = [m for m in net.modules() if type(m) is nn.BatchNorm2d]
        assert plain_bn == []
        syncs = [n for n, m in net.named_modules() if isinstance(m, nn.SyncBatchNorm)]
        assert ("embedder.blocks.0.fn1.bn" in syncs) == inner
        assert "embedder.blocks.1.bn1" in syncs  # later blocks keep BatchNorm


def test_early_norm_on_a_conformer_is_one_clear_error():
    with pytest.raises(ValueError, match="model.early_norm"):
        config_from_dict({"model": {"name": "conformer", "early_norm": "rfn"}})


def test_subspectral_groups_must_divide_the_bins():
    with pytest.raises(ValueError, match="model.subspectral_groups=3 does not divide the 32"):
        net_with("cnn", early_norm="subspectral", subspectral_groups=3)
