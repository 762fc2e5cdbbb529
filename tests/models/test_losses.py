"""The objective: the triplet term (miners, precision), the head term (cross-entropy and margin
heads), their weighted sum, the margin warm-up, empty batches, input and config errors (one
process)."""

import math

import pytest
import torch
import torch.nn.functional as F

from audioclf.config import (
    Config,
    ConfigError,
    LossConfig,
    ModelConfig,
    TrainConfig,
    load_config,
)
from audioclf.losses import TripletLoss, build_loss
from audioclf.models.heads import ClassifierHead

LABELS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


def objective(head="none", head_scale=None, subcenters=3, **loss):
    """The training objective as the trainer builds it (build_loss), with these settings."""
    model = ModelConfig(head=head, head_scale=head_scale, subcenters=subcenters)
    return build_loss(Config(model=model, loss=LossConfig(**loss)))


def embeddings(seed=0, n=8, dim=6):
    torch.manual_seed(seed)
    return F.normalize(torch.randn(n, dim), dim=1).requires_grad_(True)


def reference_loss(emb, labels, margin, keep):
    """Mean of the non-zero hinges relu(cos(a,n) - cos(a,p) + margin) over triplets kept."""
    sim = emb @ emb.T
    values = []
    for a in range(len(labels)):
        for p in range(len(labels)):
            for n in range(len(labels)):
                if a != p and labels[a] == labels[p] and labels[a] != labels[n]:
                    if keep(sim, a, p, n):
                        values.append(F.relu(sim[a, n] - sim[a, p] + margin))
    values = torch.stack(values) if values else torch.zeros(0)
    positive = values[values > 0]
    return positive.mean() if len(positive) else torch.tensor(0.0), len(values)


def test_all_miner_matches_the_definition():
    emb = embeddings()
    loss, stats = objective(margin=0.3, miner="all").with_stats(emb, LABELS)
    expected, count = reference_loss(
        emb.detach(), LABELS, 0.3, lambda s, a, p, n: s[a, n] - s[a, p] + 0.3 > 0
    )
    torch.testing.assert_close(loss, expected)
    assert stats["triplets"] == count and stats["triplet_loss"] == pytest.approx(expected.item())


def test_semi_hard_miner_keeps_only_semi_hard_triplets():
    emb = embeddings(1)
    loss, stats = objective(margin=0.3, miner="semi_hard").with_stats(emb, LABELS)
    # semi-hard: the negative is farther than the positive, but within the margin.
    expected, count = reference_loss(
        emb.detach(), LABELS, 0.3, lambda s, a, p, n: s[a, p] > s[a, n] > s[a, p] - 0.3
    )
    torch.testing.assert_close(loss, expected)
    assert stats["triplets"] == count > 0


def test_batch_hard_miner_one_triplet_per_anchor():
    emb = embeddings(2)
    loss, stats = objective(margin=0.2, miner="batch_hard").with_stats(emb, LABELS)
    sim = (emb @ emb.T).detach()
    same = LABELS[:, None] == LABELS[None, :]
    hardest_pos = sim.masked_fill(~same | torch.eye(8, dtype=torch.bool), 2).min(dim=1).values
    hardest_neg = sim.masked_fill(same, -2).max(dim=1).values
    hinges = F.relu(hardest_neg - hardest_pos + 0.2)
    assert stats["triplets"] == 8
    torch.testing.assert_close(loss, hinges[hinges > 0].mean())


def test_loss_is_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 6)
    x = torch.randn(8, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = layer(x)
        assert emb.dtype == torch.bfloat16
        loss = TripletLoss(LossConfig(miner="all"))(emb, LABELS)
    assert loss.dtype == torch.float32
    reference = TripletLoss(LossConfig(miner="all"))(emb.float(), LABELS)
    assert loss.item() == reference.item()  # same fp32 computation from the same inputs
    loss.backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


def test_ce_weight_adds_cross_entropy():
    emb = embeddings(3)
    logits = torch.randn(8, 4, requires_grad=True)
    plain, plain_stats = objective(miner="all").with_stats(emb, LABELS, logits)
    assert "ce_loss" not in plain_stats  # logits are ignored without a head
    loss, stats = objective(miner="all", head="softmax", ce_weight=0.5).with_stats(
        emb, LABELS, logits
    )
    ce = F.cross_entropy(logits, LABELS)
    torch.testing.assert_close(loss, plain + 0.5 * ce)
    assert stats["ce_loss"] == pytest.approx(ce.item())
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("miner", ["batch_hard", "semi_hard", "all"])
@pytest.mark.parametrize(
    "labels",
    [torch.zeros(4, dtype=torch.long), torch.arange(4)],
    ids=["one-class", "all-singletons"],
)
def test_batch_without_triplets_gives_zero_loss_with_a_grad_path(miner, labels):
    layer = torch.nn.Linear(3, 5)
    loss, stats = objective(miner=miner).with_stats(F.normalize(layer(torch.randn(4, 3))), labels)
    assert stats["triplets"] == 0 and loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


def test_input_errors_are_explicit():
    loss_fn = TripletLoss(LossConfig())
    with pytest.raises(ValueError, match="embeddings \\[batch, dim\\]"):
        loss_fn(torch.zeros(8), LABELS)
    with pytest.raises(ValueError, match="one label per embedding"):
        loss_fn(torch.zeros(8, 4), LABELS[:5])
    with pytest.raises(ValueError, match="integers"):
        loss_fn(torch.zeros(8, 4), LABELS.float())
    with pytest.raises(ValueError, match="logits \\[batch, classes\\]"):
        objective()(torch.zeros(8, 4), LABELS, torch.zeros(7, 3))
    with pytest.raises(ValueError, match="needs classifier logits.*num_classes"):
        objective(head="softmax")(torch.zeros(8, 4), LABELS)
    cfg = LossConfig()
    cfg.miner = "hardest"
    with pytest.raises(ValueError, match="hardest.*batch_hard, semi_hard, all"):
        TripletLoss(cfg)


def test_cross_rank_without_a_process_group_is_the_local_loss():
    emb = embeddings(4)
    local = TripletLoss(LossConfig(miner="all"))(emb, LABELS)
    crossed = TripletLoss(LossConfig(miner="all", cross_rank=True))(emb, LABELS)
    torch.testing.assert_close(local, crossed)


# ---------------------------------------------------------------------------------------------
# Margin heads (the class weights live in the model's head; the loss adds the margin)


@pytest.mark.parametrize("head, subcenters", [("arcface", 1), ("subcenter_arcface", 3)])
def test_margin_head_loss_and_grads_equal_pml(head, subcenters):
    """Our head + margin gives pytorch-metric-learning's (SubCenter)ArcFaceLoss, whose weight
    W [D, C·K] is our head's weight transposed, in value and in gradient."""
    from pytorch_metric_learning import losses as pml_losses

    torch.manual_seed(0)
    margin, scale, classes = 0.3, 20.0, 4
    settings = dict(
        miner="all",
        ce_weight=1.0,
        head=head,
        head_margin=margin,
        head_scale=scale,
        subcenters=subcenters,
    )
    classifier = ClassifierHead(6, classes, scale=scale, subcenters=subcenters)
    emb = embeddings(5)
    _, stats = objective(**settings).with_stats(emb, LABELS, classifier(emb))
    if head == "arcface":
        pml = pml_losses.ArcFaceLoss(classes, 6, margin=math.degrees(margin), scale=scale)
    else:
        pml = pml_losses.SubCenterArcFaceLoss(
            num_classes=classes,
            embedding_size=6,
            sub_centers=subcenters,
            margin=math.degrees(margin),
            scale=scale,
        )
    with torch.no_grad():
        pml.W.copy_(classifier.linear.weight.T)
    expected = pml(emb, LABELS)
    assert stats["ce_loss"] == pytest.approx(expected.item(), abs=1e-5)

    # only the cross-entropy term reaches the head's weight
    objective(**settings)(emb, LABELS, classifier(emb)).backward()
    expected.backward()
    torch.testing.assert_close(classifier.linear.weight.grad, pml.W.grad.T, atol=1e-5, rtol=0)
    assert classifier.linear.weight.grad.abs().sum() > 0


def test_margin_raises_the_loss_and_softmax_head_is_unchanged():
    emb = embeddings(6)
    classifier = ClassifierHead(6, 4, scale=30.0)
    logits = classifier(emb)

    def ce(**kw):
        return objective(miner="all", ce_weight=1.0, **kw).with_stats(emb, LABELS, logits)[1][
            "ce_loss"
        ]

    plain = F.cross_entropy(logits, LABELS).item()
    assert ce(head="softmax", head_margin=0.5) == pytest.approx(plain)  # the margin is arcface's
    assert ce(head="arcface", head_margin=0.0) == pytest.approx(plain, abs=1e-5)
    assert ce(head="arcface", head_margin=0.2) > plain + 0.1


@pytest.mark.parametrize("head", ["softmax", "arcface", "subcenter_arcface"])
def test_margin_head_on_a_rank_with_no_rows(head):
    """A rank whose batch was unreadable feeds 0 rows: zero loss, a (zero) gradient for the head."""
    model = ModelConfig(head=head)
    classifier = ClassifierHead(
        6, 4, scale=model.effective_head_scale, subcenters=model.head_subcenters
    )
    layer = torch.nn.Linear(3, 6)
    emb = F.normalize(layer(torch.randn(0, 3)), dim=1)
    loss, stats = objective(miner="semi_hard", ce_weight=1.0, head=head).with_stats(
        emb, torch.zeros(0, dtype=torch.long), classifier(emb)
    )
    assert loss.item() == 0.0 and stats["triplets"] == 0
    loss.backward()
    assert classifier.linear.weight.grad is not None and not classifier.linear.weight.grad.any()


def test_margin_head_loss_is_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 6)
    classifier = ClassifierHead(6, 4, scale=30.0, subcenters=2)
    loss_fn = objective(miner="all", ce_weight=1.0, head="subcenter_arcface", subcenters=2)
    x = torch.randn(8, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = layer(x)
        logits = classifier(emb)
        loss = loss_fn(emb, LABELS, logits)
    assert emb.dtype == torch.bfloat16 and logits.dtype == loss.dtype == torch.float32
    assert loss.item() == loss_fn(emb.float(), LABELS, classifier(emb.float())).item()
    loss.backward()
    assert (
        torch.isfinite(classifier.linear.weight.grad).all() and classifier.linear.weight.grad.any()
    )


# ---------------------------------------------------------------------------------------------
# Margin warm-up


def test_margin_warmup_values():
    loss_fn = objective(
        margin=0.3,
        miner="semi_hard",
        ce_weight=1.0,
        head="arcface",
        head_margin=0.2,
        margin_warmup_epochs=4,
    )
    triplet, head = loss_fn.terms["triplet"], loss_fn.terms["ce"]
    for epoch, factor in [(0, 0.2), (1, 0.4), (2, 0.6), (3, 0.8), (4, 1.0), (9, 1.0)]:
        loss_fn.set_epoch(epoch)
        assert triplet.margin == pytest.approx(0.3 * factor)
        assert head.margin == pytest.approx(0.2 * factor)
        assert triplet.triplet.margin == triplet.miner.margin == triplet.margin  # miner in step
    no_warmup = objective(margin=0.3, ce_weight=1.0, head="arcface").terms
    assert (no_warmup["triplet"].margin, no_warmup["ce"].margin) == (0.3, 0.2)
    for term in no_warmup.values():
        term.set_epoch(0)
    assert (no_warmup["triplet"].margin, no_warmup["ce"].margin) == (0.3, 0.2)
    with pytest.raises(ValueError, match="epoch >= 0"):
        loss_fn.set_epoch(-1)


@pytest.mark.parametrize("miner", ["all", "semi_hard"])
def test_margin_warmup_changes_the_mined_triplets_and_the_loss(miner):
    emb = embeddings(1)
    loss_fn = objective(margin=0.4, miner=miner, margin_warmup_epochs=2)
    keep = {
        "all": lambda m: lambda s, a, p, n: s[a, n] - s[a, p] + m > 0,
        "semi_hard": lambda m: lambda s, a, p, n: s[a, p] > s[a, n] > s[a, p] - m,
    }[miner]
    for epoch, margin in [(0, 0.4 / 3), (1, 0.8 / 3), (2, 0.4)]:
        loss_fn.set_epoch(epoch)
        loss, stats = loss_fn.with_stats(emb, LABELS)
        expected, count = reference_loss(emb.detach(), LABELS, margin, keep(margin))
        torch.testing.assert_close(loss, expected)
        assert stats["triplets"] == count
    assert count > 0


def test_margin_warmup_needs_set_epoch():
    loss_fn = TripletLoss(LossConfig(margin_warmup_epochs=3))
    with pytest.raises(RuntimeError, match="call TripletLoss.set_epoch"):
        loss_fn(embeddings(), LABELS)


def final_objective(epochs=6, final_epochs=2, head="arcface", **loss):
    """build_loss of a run of `epochs` whose last `final_epochs` use the final margins."""
    return build_loss(
        Config(
            model=ModelConfig(head=head),
            loss=LossConfig(ce_weight=1.0, **loss),
            train=TrainConfig(epochs=epochs, final_epochs=final_epochs),
        )
    )


def test_the_final_epochs_use_the_final_margins_after_the_warm_up():
    loss_fn = final_objective(
        margin=0.3,
        head_margin=0.2,
        margin_warmup_epochs=2,
        final_margin=0.5,
        final_head_margin=0.4,
        miner="semi_hard",
    )
    triplet, head = loss_fn.terms["triplet"], loss_fn.terms["ce"]
    margins = []
    for epoch in range(6):
        loss_fn.set_epoch(epoch)
        margins.append((round(triplet.margin, 6), round(head.margin, 6)))
        assert triplet.triplet.margin == triplet.miner.margin == triplet.margin
    assert margins == [
        (0.1, 0.066667),
        (0.2, 0.133333),
        (0.3, 0.2),
        (0.3, 0.2),
        (0.5, 0.4),
        (0.5, 0.4),
    ]
    only_triplet = final_objective(final_margin=0.5).terms  # the head keeps its margin
    for epoch, expected in [(3, (0.2, 0.2)), (4, (0.5, 0.2))]:
        for term in only_triplet.values():
            term.set_epoch(epoch)
        assert (only_triplet["triplet"].margin, only_triplet["ce"].margin) == expected
    off = final_objective(final_epochs=0, final_margin=0.5).terms["triplet"]
    off.set_epoch(5)
    assert off.margin == 0.2  # train.final_epochs=0: loss.final_margin is not used
    softmax = final_objective(head="softmax", final_head_margin=0.4).terms["ce"]
    softmax.set_epoch(5)
    assert softmax.margin == 0.0


def test_final_margins_need_set_epoch():
    loss_fn = final_objective(final_margin=0.5)
    with pytest.raises(RuntimeError, match="train.final_epochs"):
        loss_fn(embeddings(), LABELS, torch.zeros(8, 3))


def test_softmax_head_has_no_margin_to_warm_up():
    loss_fn = objective(ce_weight=1.0, head="softmax", margin_warmup_epochs=2)
    loss_fn.set_epoch(1)
    assert loss_fn.terms["ce"].margin == 0.0
    assert loss_fn.terms["triplet"].margin == pytest.approx(0.2 * 2 / 3)


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    "override, message",
    [
        ("loss.head_margin=-0.1", r"loss\.head_margin=-0\.1 is invalid: expected >= 0"),
        ("model.head_scale=0", r"model\.head_scale=0\.0 is invalid: expected > 0"),
        ("model.subcenters=0", r"model\.subcenters=0 is invalid: expected >= 1"),
        ("loss.margin_warmup_epochs=-1", r"loss\.margin_warmup_epochs=-1 is invalid"),
        ("loss.margin=-0.2", r"loss\.margin=-0\.2 is invalid"),
        ("model.head=cosface", r"model\.head='cosface' is not a valid choice"),
    ],
)
def test_loss_config_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.head=softmax", override])


def test_margin_head_needs_a_cross_entropy_weight():
    with pytest.raises(ConfigError, match=r"loss\.ce_weight=0\.0 is invalid.*model\.head=arcface"):
        load_config(None, ["model.head=arcface", "loss.ce_weight=0"])


def test_head_scale_defaults_by_head():
    assert ModelConfig(head="softmax").effective_head_scale == 16.0  # today's cosine softmax
    assert ModelConfig(head="arcface").effective_head_scale == 30.0
    assert ModelConfig(head="subcenter_arcface", head_scale=64).effective_head_scale == 64.0
    assert ModelConfig(head="arcface").head_subcenters == 1
    assert ModelConfig(head="subcenter_arcface", subcenters=5).head_subcenters == 5


def test_configs_of_the_earlier_layout_are_read_with_a_warning():
    with pytest.warns(UserWarning, match="loss.head -> model.head"):
        cfg = load_config(
            None,
            [
                "loss.ce_weight=1",
                "loss.head=arcface",
                "loss.subcenters=2",
                "features.crop_seconds=0.7",
                "features.spec_augment=false",
            ],
        )
    assert (cfg.model.head, cfg.model.subcenters, cfg.loss.ce_weight) == ("arcface", 2, 1.0)
    assert cfg.clips.crop_seconds == 0.7 and cfg.spec_augment.enabled is False
    with pytest.warns(UserWarning, match="model.head=none"):
        assert load_config(None, ["loss.head=softmax", "loss.ce_weight=0"]).model.head == "none"
    with pytest.warns(UserWarning, match="model.head=softmax"):  # 0.1: ce_weight > 0 was a head
        assert load_config(None, ["loss.ce_weight=0.5"]).model.head == "softmax"


def test_an_earlier_override_applies_over_a_file_in_the_new_layout(tmp_path):
    config = tmp_path / "new.yaml"
    config.write_text("clips:\n  crop_seconds: 1.0\nmodel:\n  head: arcface\n")
    with pytest.warns(UserWarning, match="features.crop_seconds -> clips.crop_seconds"):
        cfg = load_config(config, ["features.crop_seconds=1.5", "loss.head=subcenter_arcface"])
    assert cfg.clips.crop_seconds == 1.5 and cfg.model.head == "subcenter_arcface"
    assert cfg.loss.ce_weight == 1.0
