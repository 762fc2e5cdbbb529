"""Embedders (CNN, Conformer, ResNet), pooling, heads, the registry, EmbeddingNet, export, and
learning."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from audioclf.config import (
    CNNConfig,
    ConfigError,
    ConformerConfig,
    ECAPAConfig,
    FeaturesConfig,
    LossConfig,
    ModelConfig,
    ResNetConfig,
    load_config,
)
from audioclf.losses import TripletLoss
from audioclf.models import (
    MODELS,
    ClassifierHead,
    EmbeddingNet,
    build_model,
    build_net,
    count_parameters,
)
from audioclf.models.frontend import FeatureFrontend
from audioclf.models.heads import angular_margin_logits
from audioclf.models.pooling import (
    AttentiveStatsPooling,
    StatsPooling,
    lengths_to_mask,
    masked_mean,
)
from audioclf.models.resnet import BasicBlock

N_MELS = 32
NAMES = ["cnn", "conformer", "resnet", "ecapa"]


def tiny_config(name, pooling=None, embedding_dim=16):
    """Small settings of every model; `pooling` (when given) replaces the named model's."""
    cfg = ModelConfig(
        name=name,
        embedding_dim=embedding_dim,
        cnn=CNNConfig(width=8, depth=2, dropout=0.0),
        conformer=ConformerConfig(
            d_model=32, num_heads=2, ffn_dim=64, num_layers=2, kernel_size=7, dropout=0.0
        ),
        # 4 stages (total stride 8), identity and 1×1-conv shortcuts, 2 blocks in one stage
        resnet=ResNetConfig(width=4, blocks=[1, 2, 1, 1]),
        ecapa=ECAPAConfig(channels=16, scale=4, se_bottleneck=8, attention_channels=8),
    )
    if pooling is not None:
        getattr(cfg, name).pooling = pooling
    return cfg


def tiny_model(name, pooling=None, seed=0):
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


@pytest.mark.parametrize(
    "name, pooling",
    [
        ("cnn", "mean_max"),
        ("cnn", "attentive_stats"),
        ("conformer", "attentive_stats"),
        ("conformer", "mean"),
        ("resnet", "stats"),
        ("resnet", "attentive_stats"),
        ("ecapa", None),  # attentive statistics with global context, its own
    ],
)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_padding_does_not_change_an_embedding(name, pooling, dtype, tol):
    model = tiny_model(name, pooling).to(dtype).eval()
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


@pytest.mark.parametrize("seed", range(4))
def test_ecapa_embeds_a_30_s_clip_under_fp16_autocast(seed):
    # The attentive statistics' x * x and means, in fp16, overflow (65504) over a long clip at
    # activations of a few units; they are computed in fp32, as pooling.py's. The aggregation
    # layer's weights are scaled up to give activations of a trained net's size.
    frames = 3001  # 30 s at a 10 ms hop
    model = tiny_model("ecapa", seed=seed).eval()
    with torch.no_grad():
        model.mfa.weight.mul_(16.0)
        x = torch.randn(1, frames, N_MELS, generator=torch.Generator().manual_seed(seed))
        lengths = torch.tensor([frames])
        exact = model(x, lengths)
        with torch.autocast("cpu", dtype=torch.float16):
            half = model(x, lengths)
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), exact, atol=5e-3, rtol=0)


def test_masked_mean_sums_half_precision_in_fp32():
    # A sum of 1000 frames of 100.0 is 1e5, past fp16's largest value.
    x = torch.full((1, 1000, 2), 100.0, dtype=torch.float16)
    mean = masked_mean(x, torch.ones(1, 1000, dtype=torch.bool))
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean, torch.full((1, 2), 100.0))


def test_build_model_registry_and_errors():
    assert set(MODELS) == {"cnn", "conformer", "resnet", "ecapa"}
    cfg = tiny_config("cnn")
    cfg.name = "transformer"
    with pytest.raises(ValueError, match="transformer.*cnn, conformer, resnet"):
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
@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")  # torch 2.11's exporter, internal
@pytest.mark.slow  # the ONNX exporter: seconds per model
@pytest.mark.parametrize("name", NAMES)
def test_onnx_export_with_dynamic_batch_and_time(name, tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")  # torch.onnx.export's default (dynamo) exporter needs it
    model = tiny_model(name).eval()
    path = tmp_path / f"{name}.onnx"
    batch, frames = torch.export.Dim("batch"), torch.export.Dim("frames")
    torch.onnx.export(
        model,
        (torch.randn(2, 40, N_MELS), torch.tensor([40, 25])),
        str(path),
        input_names=["feats", "lengths"],
        output_names=["embeddings"],
        dynamic_shapes={"feats": {0: batch, 1: frames}, "lengths": {0: batch}},
    )
    onnx.checker.check_model(onnx.load(str(path)))
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path))
    for n, t in [(3, 57), (1, 9), (1, 1)]:
        feats, lengths = torch.randn(n, t, N_MELS), torch.randint(1, t + 1, (n,))
        (out,) = session.run(None, {"feats": feats.numpy(), "lengths": lengths.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(
                torch.from_numpy(out), model(feats, lengths), atol=1e-5, rtol=0
            )


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


@pytest.mark.parametrize("name", NAMES)
def test_waveform_embedding_does_not_depend_on_the_batch(name):
    """A clip embedded alone equals the same clip zero-padded next to a longer one."""
    cfg = load_config(
        None,
        [
            f"model.name={name}",
            "features.n_mels=32",
            "model.cnn.width=8",
            "model.cnn.depth=2",
            "model.conformer.d_model=32",
            "model.conformer.num_heads=2",
            "model.conformer.ffn_dim=64",
            "model.conformer.num_layers=1",
            "model.conformer.kernel_size=7",
            "model.resnet.width=4",
            "model.resnet.blocks=[1,1,1,1]",
        ],
    )
    torch.manual_seed(0)
    net = build_net(cfg, 0).eval()
    short, long = torch.randn(1, 12345) * 0.1, torch.randn(1, 20000) * 0.1
    batch = torch.zeros(2, 20000)
    batch[0, :12345], batch[1] = short[0], long[0]
    with torch.no_grad():
        alone = net.embed(short, torch.tensor([12345]))
        together = net.embed(batch, torch.tensor([12345, 20000]))
    torch.testing.assert_close(together[:1], alone, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# ResNet


def test_resnet_carries_the_length_of_each_stage():
    """The lengths a block hands on are the frames a lone clip of that length gets."""
    model = tiny_model("resnet").eval()
    for frames in [1, 2, 3, 7, 8, 9, 16, 33]:
        x = torch.randn(1, model.conv1.out_channels, frames, N_MELS)  # what the stem gives
        lengths = torch.tensor([frames])
        with torch.no_grad():
            for block in model.blocks:
                x, lengths = block(x, lengths)
                assert lengths.tolist() == [x.shape[2]], f"{frames} input frames"
        assert x.shape[2] == math.ceil(frames / 8)  # 3 stride-2 stages


@pytest.mark.parametrize("n_mels, low, high", [(64, 5.5e6, 6.2e6), (80, 5.7e6, 6.4e6)])
def test_resnet34_default_layout_and_size(n_mels, low, high):
    """The default is WeSpeaker's ResNet-34 at width 32: 3-4-6-3 BasicBlocks of 32-64-128-256
    channels, stride 2 from stage 2 on; a few million parameters (frequency is flattened into
    the pooled channels, so the embedding layer grows with n_mels)."""
    model = build_model(ModelConfig(name="resnet"), n_mels)
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    assert [b.conv2.out_channels for b in blocks] == [32] * 3 + [64] * 4 + [128] * 6 + [256] * 3
    assert [b.stride for b in blocks] == [1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1]
    assert model.conv1.stride == (1, 1) and model.conv1.kernel_size == (3, 3)
    assert model.embedding.in_features == 2 * 256 * math.ceil(n_mels / 8)  # mean + std
    assert low < count_parameters(model) < high, f"{count_parameters(model):,} parameters"


def test_resnet_default_net_is_scriptable():
    """The export path scripts the whole EmbeddingNet (torch.jit.script(build_net(cfg, 0)))."""
    cfg = load_config(None, ["model.name=resnet", "features.n_mels=64"])
    torch.manual_seed(0)
    net = build_net(cfg, 0).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated in torch >= 2.10
        scripted = torch.jit.script(net)
    waves, lengths = torch.randn(2, 8000) * 0.1, torch.tensor([8000, 1200])
    with torch.no_grad():
        torch.testing.assert_close(scripted.embed(waves, lengths), net.embed(waves, lengths))


def test_stats_pooling_is_masked_mean_and_std():
    x = torch.randn(2, 6, 4)
    mask = lengths_to_mask(torch.tensor([6, 3]), 6)
    junk = x.clone()
    junk[1, 3:] = 1e4
    pooled = StatsPooling(4)(junk, mask)
    torch.testing.assert_close(
        pooled[1], torch.cat([x[1, :3].mean(0), x[1, :3].std(0, unbiased=False)])
    )
    torch.testing.assert_close(pooled[0], torch.cat([x[0].mean(0), x[0].std(0, unbiased=False)]))


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.resnet.blocks=[]", r"model\.resnet\.blocks=\[\] is invalid"),
        (
            "model.resnet.blocks=[3,0,2]",
            r"model\.resnet\.blocks=\[3, 0, 2\] is invalid: expected a non-empty",
        ),
        ("model.resnet.width=0", r"model\.resnet\.width=0 is invalid"),
        ("model.resnet.pooling=mean", r"model\.resnet\.pooling='mean' is not a valid choice"),
        ("model.cnn.pooling=max", r"model\.cnn\.pooling='max' is not a valid choice"),
    ],
)
def test_model_config_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_model_config_reads_blocks_and_poolings():
    cfg = load_config(
        None,
        [
            "model.name=resnet",
            "model.resnet.blocks=[2, 2]",
            "model.resnet.pooling=attentive_stats",
            "model.cnn.pooling=attentive_stats",
        ],
    )
    assert cfg.model.resnet.blocks == [2, 2] and cfg.model.resnet.pooling == "attentive_stats"
    assert ModelConfig().resnet.blocks == [3, 4, 6, 3] and ModelConfig().cnn.pooling == "mean_max"


# ---------------------------------------------------------------------------------------------
# Heads: sub-centers, angular margin


def unit(angle):
    return torch.tensor([math.cos(angle), math.sin(angle)])


def test_angular_margin_on_a_hand_case():
    """Class weights at 0, π/2 and π; the embedding at θ = π/3 from class 0 (its target)."""
    head = ClassifierHead(2, 3, scale=30.0)
    with torch.no_grad():
        head.linear.weight.copy_(torch.stack([unit(0.0), unit(math.pi / 2), unit(math.pi)]))
    embedding = 2.5 * unit(math.pi / 3)[None]  # any length: the head normalises
    logits = head(embedding)
    expected = 30 * torch.tensor([[0.5, math.cos(math.pi / 6), math.cos(2 * math.pi / 3)]])
    torch.testing.assert_close(logits, expected)
    margined = angular_margin_logits(logits, torch.tensor([0]), 30.0, 0.2)
    assert margined[0, 0].item() == pytest.approx(30 * math.cos(math.pi / 3 + 0.2), abs=1e-5)
    assert torch.equal(margined[0, 1:], logits[0, 1:])  # non-targets untouched
    # target class 2 at θ = 2π/3: θ + m <= π, plain ArcFace
    margined = angular_margin_logits(logits, torch.tensor([2]), 30.0, 0.5)
    assert margined[0, 2].item() == pytest.approx(30 * math.cos(2 * math.pi / 3 + 0.5), abs=1e-5)
    assert torch.equal(margined[0, :2], logits[0, :2])
    torch.testing.assert_close(angular_margin_logits(logits, torch.tensor([1]), 30.0, 0.0), logits)


def test_angular_margin_past_pi_keeps_falling_as_pml():
    """θ + m > π: s·(cos θ − m·sin m), as pytorch-metric-learning's ArcFaceLoss computes it."""
    from pytorch_metric_learning.losses import ArcFaceLoss

    margin, scale = 0.4, 30.0
    angles = torch.tensor([0.0, 0.3, 1.5, 2.5, math.pi - 0.45, math.pi - 0.35, 3.1, math.pi])
    cosines = torch.cos(angles)[:, None].double()
    ours = angular_margin_logits(
        scale * cosines, torch.zeros(len(angles), dtype=torch.long), scale, margin
    )
    pml = ArcFaceLoss(num_classes=2, embedding_size=2, margin=math.degrees(margin), scale=scale)
    reference = scale * pml.modify_cosine_of_target_classes(cosines[:, 0])
    torch.testing.assert_close(ours[:, 0], reference, atol=1e-6, rtol=0)
    past = angles + margin > math.pi
    assert past.any() and (~past).any()
    torch.testing.assert_close(
        ours[past, 0], scale * (cosines[past, 0] - margin * math.sin(margin))
    )
    assert (ours[1:, 0] < ours[:-1, 0]).all()  # monotonic in θ


def test_subcenter_head_takes_the_best_subcenter():
    head = ClassifierHead(2, 2, scale=10.0, subcenters=3)  # rows c·3 + k
    angles = [0.0, 1.0, 2.0, 0.5, 2.5, 3.0]  # class 0: 0, 1, 2; class 1: 0.5, 2.5, 3
    with torch.no_grad():
        head.linear.weight.copy_(torch.stack([unit(a) for a in angles]))
    embedding = unit(1.9)[None]
    expected = 10 * torch.tensor([[math.cos(0.1), math.cos(0.6)]])  # nearest: 2.0 and 2.5
    torch.testing.assert_close(head(embedding), expected)
    assert head(torch.zeros(0, 2)).shape == (0, 2)  # a rank with no rows


def test_head_is_fp32_under_autocast():
    head = ClassifierHead(8, 5, subcenters=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = torch.nn.Linear(4, 8)(torch.randn(3, 4))
        assert emb.dtype == torch.bfloat16
        logits = head(emb)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, head(emb.float()))


@pytest.mark.parametrize("head, rows", [("softmax", 5), ("arcface", 5), ("subcenter_arcface", 15)])
def test_build_net_head_follows_model_config(head, rows):
    cfg = load_config(
        None,
        [
            "features.kind=npy",
            f"features.n_mels={N_MELS}",
            "model.cnn.depth=2",
            f"model.head={head}",
        ],
    )
    net = build_net(cfg, 5)
    assert net.head.linear.weight.shape == (rows, cfg.model.embedding_dim)
    assert net.head.scale == (16.0 if head == "softmax" else 30.0)
    _, logits = net(torch.randn(2, 20, N_MELS), torch.tensor([20, 9]))
    assert logits.shape == (2, 5) and logits.abs().max() <= net.head.scale + 1e-4


@pytest.mark.parametrize("channels, low, high", [(512, 5.8e6, 6.6e6), (1024, 1.9e7, 2.2e7)])
def test_ecapa_default_layout_and_size(channels, low, high):
    # The published ECAPA-TDNN at 80 mels, 192-d: about 6.2M parameters at C = 512 and 20.8M at
    # C = 1024 (SpeechBrain's and WeSpeaker's counts of the same layout, within a few percent).
    cfg = ModelConfig(name="ecapa", embedding_dim=192, ecapa=ECAPAConfig(channels=channels))
    model = build_model(cfg, 80)
    assert low <= count_parameters(model) <= high
    assert len(model.blocks) == 3 and model.mfa.out_channels == 3 * channels
    assert [b.res2[0].conv.dilation[0] for b in model.blocks] == [2, 3, 4]
