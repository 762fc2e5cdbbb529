"""TripletLoss: miners, precision, cross-entropy, empty batches, input errors (one process)."""

import pytest
import torch
import torch.nn.functional as F

from audioclf.config import LossConfig
from audioclf.losses import TripletLoss

LABELS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


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
    loss, stats = TripletLoss(LossConfig(margin=0.3, miner="all")).with_stats(emb, LABELS)
    expected, count = reference_loss(emb.detach(), LABELS, 0.3, lambda s, a, p, n: s[a, n] - s[a, p] + 0.3 > 0)
    torch.testing.assert_close(loss, expected)
    assert stats["triplets"] == count and stats["triplet_loss"] == pytest.approx(expected.item())


def test_semi_hard_miner_keeps_only_semi_hard_triplets():
    emb = embeddings(1)
    loss, stats = TripletLoss(LossConfig(margin=0.3, miner="semi_hard")).with_stats(emb, LABELS)
    # semi-hard: the negative is farther than the positive, but within the margin.
    expected, count = reference_loss(
        emb.detach(), LABELS, 0.3, lambda s, a, p, n: s[a, p] > s[a, n] > s[a, p] - 0.3
    )
    torch.testing.assert_close(loss, expected)
    assert stats["triplets"] == count > 0


def test_batch_hard_miner_one_triplet_per_anchor():
    emb = embeddings(2)
    loss, stats = TripletLoss(LossConfig(margin=0.2, miner="batch_hard")).with_stats(emb, LABELS)
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
    plain, plain_stats = TripletLoss(LossConfig(miner="all")).with_stats(emb, LABELS, logits)
    assert plain_stats["ce_loss"] == 0.0  # logits are ignored at ce_weight=0
    loss, stats = TripletLoss(LossConfig(miner="all", ce_weight=0.5)).with_stats(emb, LABELS, logits)
    ce = F.cross_entropy(logits, LABELS)
    torch.testing.assert_close(loss, plain + 0.5 * ce)
    assert stats["ce_loss"] == pytest.approx(ce.item())
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("miner", ["batch_hard", "semi_hard", "all"])
@pytest.mark.parametrize("labels", [torch.zeros(4, dtype=torch.long), torch.arange(4)],
                         ids=["one-class", "all-singletons"])
def test_batch_without_triplets_gives_zero_loss_with_a_grad_path(miner, labels):
    layer = torch.nn.Linear(3, 5)
    loss, stats = TripletLoss(LossConfig(miner=miner)).with_stats(F.normalize(layer(torch.randn(4, 3))), labels)
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
        loss_fn(torch.zeros(8, 4), LABELS, torch.zeros(7, 3))
    with pytest.raises(ValueError, match="needs classifier logits.*num_classes"):
        TripletLoss(LossConfig(ce_weight=1.0))(torch.zeros(8, 4), LABELS)
    cfg = LossConfig()
    cfg.miner = "hardest"
    with pytest.raises(ValueError, match="hardest.*batch_hard, semi_hard, all"):
        TripletLoss(cfg)


def test_cross_rank_without_a_process_group_is_the_local_loss():
    emb = embeddings(4)
    local = TripletLoss(LossConfig(miner="all"))(emb, LABELS)
    crossed = TripletLoss(LossConfig(miner="all", cross_rank=True))(emb, LABELS)
    torch.testing.assert_close(local, crossed)
