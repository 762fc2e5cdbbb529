"""Embedders (CNN, Conformer), pooling, the registry, EmbeddingNet, export, and learning."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from audioclf.config import CNNConfig, ConformerConfig, FeaturesConfig, LossConfig, ModelConfig
from audioclf.losses import TripletLoss
from audioclf.models import (
    MODELS,
    ClassifierHead,
    EmbeddingNet,
    build_model,
    count_parameters,
)
from audioclf.models.frontend import FeatureFrontend
from audioclf.models.pooling import AttentiveStatsPooling, lengths_to_mask, masked_mean

N_MELS = 32
NAMES = ["cnn", "conformer"]


def tiny_config(name, pooling="attentive_stats", embedding_dim=16):
    return ModelConfig(
        name=name,
        embedding_dim=embedding_dim,
        cnn=CNNConfig(width=8, depth=2, dropout=0.0),
        conformer=ConformerConfig(d_model=32, num_heads=2, ffn_dim=64, num_layers=2,
                                  kernel_size=7, dropout=0.0, pooling=pooling),
    )


def tiny_model(name, pooling="attentive_stats", seed=0):
    torch.manual_seed(seed)
    return build_model(tiny_config(name, pooling), N_MELS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch, frames", [(1, 1), (2, 9), (3, 50), (5, 201)])
def test_shapes_and_unit_norm(name, batch, frames):
    model = tiny_model(name).eval()
    lengths = torch.randint(1, frames + 1, (batch,))
    with torch.no_grad():
        out = model(torch.randn(batch, frames, N_MELS), lengths)
        no_lengths = model(torch.randn(batch, frames, N_MELS))
    assert out.shape == no_lengths.shape == (batch, 16)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(batch))


@pytest.mark.parametrize("name, pooling", [("cnn", None), ("conformer", "attentive_stats"),
                                           ("conformer", "mean")])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_padding_does_not_change_an_embedding(name, pooling, dtype, tol):
    model = tiny_model(name, pooling or "mean").to(dtype).eval()
    torch.manual_seed(1)
    lengths = torch.tensor([61, 40, 13, 6, 1])
    batch = torch.randn(5, 61, N_MELS, dtype=dtype)
    for i, n in enumerate(lengths.tolist()):  # junk, large and non-zero, in the padding
        batch[i, n:] = 1e3 * torch.randn(61 - n, N_MELS, dtype=dtype)
    with torch.no_grad():
        together = model(batch, lengths)
        for i, n in enumerate(lengths.tolist()):
            alone = model(batch[i : i + 1, :n], lengths[i : i + 1])
            torch.testing.assert_close(together[i : i + 1], alone, atol=tol, rtol=0)


def test_pooling_helpers_ignore_padding():
    x = torch.randn(2, 6, 4)
    lengths = torch.tensor([6, 3])
    mask = lengths_to_mask(lengths, 6)
    assert mask.tolist()[1] == [True] * 3 + [False] * 3
    torch.testing.assert_close(masked_mean(x, mask)[1], x[1, :3].mean(dim=0))
    pool = AttentiveStatsPooling(4, attention_dim=8)
    junk = x.clone()
    junk[1, 3:] = 1e4
    torch.testing.assert_close(pool(x, mask), pool(junk, mask))
    assert pool(x, mask).shape == (2, 8)


def test_build_model_registry_and_errors():
    assert set(MODELS) == {"cnn", "conformer"}
    cfg = tiny_config("cnn")
    cfg.name = "transformer"
    with pytest.raises(ValueError, match="transformer.*cnn, conformer"):
        build_model(cfg, N_MELS)
    with pytest.raises(ValueError, match="n_mels >= 16"):
        build_model(ModelConfig(name="cnn", cnn=CNNConfig(depth=4)), 8)


def test_count_parameters():
    model = tiny_model("cnn")
    expected = sum(p.numel() for p in model.parameters())
    assert count_parameters(model) == expected > 0
    model.embedding.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == expected - model.embedding.weight.numel()


def test_embedding_net_head_and_embed():
    frontend = FeatureFrontend(FeaturesConfig(kind="npy", n_mels=N_MELS))
    x, lengths = torch.randn(4, 30, N_MELS), torch.tensor([30, 20, 10, 5])
    plain = EmbeddingNet(frontend, tiny_model("cnn"))
    embeddings, logits = plain(x, lengths)
    assert embeddings.shape == (4, 16) and logits is None
    net = EmbeddingNet(frontend, tiny_model("cnn"), num_classes=7).eval()
    embeddings, logits = net(x, lengths)
    assert logits.shape == (4, 7)
    torch.testing.assert_close(net.embed(x, lengths), embeddings)
    assert ClassifierHead(16, 3, cosine=False)(embeddings).shape == (4, 3)


@pytest.mark.parametrize("name", NAMES)
def test_embedding_net_trains_every_parameter_from_waveforms(name):
    """DDP (find_unused_parameters=False) needs a gradient for every parameter."""
    frontend = FeatureFrontend(FeaturesConfig(kind="audio", n_mels=N_MELS, sample_rate=8000))
    net = EmbeddingNet(frontend, tiny_model(name), num_classes=3).train()
    embeddings, logits = net(torch.randn(2, 8000), torch.tensor([8000, 3000]))
    (embeddings.sum() + logits.sum()).backward()
    assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_torchscript_matches_eager(name):
    frontend = FeatureFrontend(FeaturesConfig(kind="audio", n_mels=N_MELS, sample_rate=8000))
    net = EmbeddingNet(frontend, tiny_model(name), num_classes=3).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated in torch >= 2.10
        scripted = torch.jit.script(net)
    for batch, samples in [(2, 8000), (3, 5000)]:
        waves = torch.randn(batch, samples)
        lengths = torch.randint(1000, samples + 1, (batch,))
        with torch.no_grad():
            torch.testing.assert_close(scripted.embed(waves, lengths), net.embed(waves, lengths))
            torch.testing.assert_close(scripted(waves, lengths)[1], net(waves, lengths)[1])


@pytest.mark.filterwarnings("ignore:# The axis name")  # torch's note on shared dims
@pytest.mark.parametrize("name", NAMES)
def test_onnx_export_with_dynamic_batch_and_time(name, tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")  # torch.onnx.export's default (dynamo) exporter needs it
    model = tiny_model(name).eval()
    path = tmp_path / f"{name}.onnx"
    batch, frames = torch.export.Dim("batch"), torch.export.Dim("frames")
    torch.onnx.export(
        model, (torch.randn(2, 40, N_MELS), torch.tensor([40, 25])), str(path),
        input_names=["feats", "lengths"], output_names=["embeddings"],
        dynamic_shapes={"feats": {0: batch, 1: frames}, "lengths": {0: batch}},
    )
    onnx.checker.check_model(onnx.load(str(path)))
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path))
    for n, t in [(3, 57), (1, 9), (1, 1)]:
        feats, lengths = torch.randn(n, t, N_MELS), torch.randint(1, t + 1, (n,))
        (out,) = session.run(None, {"feats": feats.numpy(), "lengths": lengths.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(out), model(feats, lengths), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Learning on a tiny separable problem


def pattern_batch(generator, per_class=4, classes=4, frames=48):
    """Log-mel-like patterns: class c lights up mel band c (of 4) for half the clip, at a random
    time, over unit-less noise; clip lengths vary so padding is exercised."""
    labels = torch.arange(classes).repeat_interleave(per_class)
    feats = 0.5 * torch.randn(len(labels), frames, N_MELS, generator=generator)
    band = N_MELS // classes
    for i, c in enumerate(labels.tolist()):
        start = int(torch.randint(0, frames // 2, (1,), generator=generator))
        feats[i, start : start + frames // 2, c * band : (c + 1) * band] += 2.0
    lengths = torch.randint(frames // 2 + 8, frames + 1, (len(labels),), generator=generator)
    return feats, lengths, labels


def all_triplets_loss(embeddings, labels, margin=0.5):
    """Mean hinge over every valid triplet (an independent yardstick, not the trained loss)."""
    sim = embeddings @ embeddings.T
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool)
    valid = (same & ~eye)[:, :, None] & ~same[:, None, :]
    hinge = F.relu(sim[:, None, :] - sim[:, :, None] + margin)  # [a, p, n]: s_an - s_ap + m
    return hinge[valid].mean().item()


@pytest.mark.parametrize("name", NAMES)
def test_triplet_loss_falls_on_separable_patterns(name):
    model = tiny_model(name, seed=0)
    loss_fn = TripletLoss(LossConfig(margin=0.2, miner="semi_hard"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    held_out = pattern_batch(torch.Generator().manual_seed(123), per_class=6)

    def held_out_loss():
        model.eval()
        with torch.no_grad():
            feats, lengths, labels = held_out
            value = all_triplets_loss(model(feats, lengths), labels)
        model.train()
        return value

    initial = held_out_loss()
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(60):
        feats, lengths, labels = pattern_batch(generator)
        loss = loss_fn(model(feats, lengths), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    final = held_out_loss()
    assert initial > 0.05, f"the untrained model already separates the classes ({initial:.3f})"
    assert final < 0.5 * initial, f"held-out triplet loss {initial:.3f} → {final:.3f}"


@pytest.mark.parametrize("name", ["cnn", "conformer"])
def test_waveform_embedding_does_not_depend_on_the_batch(name):
    """A clip embedded alone equals the same clip zero-padded next to a longer one."""
    from audioclf.config import load_config
    from audioclf.models import build_net

    cfg = load_config(None, [
        f"model.name={name}", "features.n_mels=32", "model.cnn.width=8", "model.cnn.depth=2",
        "model.conformer.d_model=32", "model.conformer.num_heads=2", "model.conformer.ffn_dim=64",
        "model.conformer.num_layers=1", "model.conformer.kernel_size=7"])
    torch.manual_seed(0)
    net = build_net(cfg, 0).eval()
    short, long = torch.randn(1, 12345) * 0.1, torch.randn(1, 20000) * 0.1
    batch = torch.zeros(2, 20000)
    batch[0, :12345], batch[1] = short[0], long[0]
    with torch.no_grad():
        alone = net.embed(short, torch.tensor([12345]))
        together = net.embed(batch, torch.tensor([12345, 20000]))
    torch.testing.assert_close(together[:1], alone, atol=1e-5, rtol=0)
