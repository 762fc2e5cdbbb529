"""MixStyle and Freq-MixStyle: statistics mixed across classes in training, nothing otherwise."""

from __future__ import annotations

import pytest
import torch

from audioclf.config import config_from_dict
from audioclf.models import build_net
from audioclf.models.mixstyle import MixStyle, style_partners
from tests.helpers import TINY_FEATURES, count_host_syncs

MODELS = {
    "cnn": {"name": "cnn", "embedding_dim": 16, "cnn": {"width": 8, "depth": 2}},
    "resnet": {"name": "resnet", "embedding_dim": 16, "resnet": {"width": 4, "blocks": [1, 1]}},
}


def net_with(name: str, **augment):
    cfg = config_from_dict(
        {
            "features": TINY_FEATURES,
            "model": {**MODELS[name], "head": "none"},
            "spec_augment": {"enabled": False},
            "augment": augment,
        }
    )
    torch.manual_seed(0)
    return build_net(cfg, 0)


def batch(rows: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.02, 0.3, rows)[:, None]
    x = scale * torch.randn(rows, 4000, generator=generator)
    lengths = torch.tensor([4000, 4000, 3000, 4000, 2500, 4000][:rows])
    return x, lengths, torch.tensor([0, 0, 1, 1, 2, 2][:rows])


def test_partners_are_of_another_class_and_itself_when_there_is_none():
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    for seed in range(20):
        torch.manual_seed(seed)
        partners = style_partners(labels)
        assert (labels[partners] != labels).all()
    assert style_partners(torch.tensor([3, 3, 3])).tolist() == [0, 1, 2]


def frequency_statistics_loop(x: torch.Tensor, lengths: torch.Tensor):
    """Per row and bin: mean and std over the valid frames, one row at a time."""
    means, stds = [], []
    for row, n in zip(x, lengths.tolist(), strict=True):
        valid = row[:n]
        means.append(valid.mean(dim=0))
        stds.append(torch.sqrt(valid.var(dim=0, unbiased=False) + 1e-5))
    return torch.stack(means), torch.stack(stds)


def test_freq_mixstyle_gives_each_row_a_mix_of_its_and_its_partners_statistics():
    x = torch.randn(4, 10, 5) * torch.rand(4, 1, 5) * 3 + torch.randn(4, 1, 5)
    lengths = torch.tensor([10, 7, 10, 4])
    for row, n in enumerate(lengths.tolist()):
        x[row, n:] = 0
    partners = torch.tensor([2, 3, 0, 1])
    style = MixStyle(prob=1.0, alpha=0.3, frequency=True).train()
    torch.manual_seed(0)
    out = style(x, lengths, partners)
    torch.manual_seed(0)
    alpha = torch.tensor(0.3)
    lam = torch.distributions.Beta(alpha, alpha).sample((4,))
    mean, std = frequency_statistics_loop(x, lengths)
    out_mean, out_std = frequency_statistics_loop(out, lengths)
    lam = lam[:, None]
    torch.testing.assert_close(out_mean, lam * mean + (1 - lam) * mean[partners], atol=1e-4, rtol=0)
    # std: within the eps (1e-5) both sides add to the variance
    torch.testing.assert_close(out_std, lam * std + (1 - lam) * std[partners], atol=1e-4, rtol=5e-3)
    for row, n in enumerate(lengths.tolist()):
        assert (out[row, n:] == 0).all()


@pytest.mark.parametrize("name", ["cnn", "resnet"])
@pytest.mark.parametrize("keys", [{"freq_mixstyle": 1.0}, {"mixstyle": 1.0, "mixstyle_blocks": 2}])
def test_mixstyle_changes_training_embeddings_only_with_labels(name, keys):
    plain, mixed = net_with(name), net_with(name, **keys)
    mixed.load_state_dict(plain.state_dict())
    x, lengths, labels = batch()
    assert mixed.mixes_styles and not plain.mixes_styles
    for net in (plain, mixed):
        net.train()
    torch.manual_seed(1)
    reference, _ = plain(x, lengths, labels)
    torch.manual_seed(1)
    changed, _ = mixed(x, lengths, labels)
    assert (changed - reference).abs().max() > 1e-3
    torch.manual_seed(1)
    without_labels, _ = mixed(x, lengths)
    torch.manual_seed(1)
    torch.testing.assert_close(without_labels, plain(x, lengths)[0])
    mixed.load_state_dict(plain.state_dict())  # training moved the two BatchNorms apart
    plain.eval(), mixed.eval()
    with torch.no_grad():
        torch.testing.assert_close(mixed(x, lengths, labels)[0], plain(x, lengths, labels)[0])
        torch.testing.assert_close(mixed.embed(x, lengths), plain.embed(x, lengths))


def test_without_mixstyle_labels_draw_nothing_more():
    net = net_with("cnn").train()
    x, lengths, labels = batch()
    torch.manual_seed(3)
    with_labels, _ = net(x, lengths, labels)
    after = torch.rand(1)
    torch.manual_seed(3)
    without, _ = net(x, lengths)
    torch.testing.assert_close(with_labels, without)
    assert torch.equal(after, torch.rand(1))


def test_mixstyle_inside_a_conformer_is_one_clear_error_of_the_config():
    with pytest.raises(
        ValueError, match="augment.mixstyle=0.5 is invalid: expected 0 for model.name='conformer'"
    ):
        config_from_dict(
            {
                "features": TINY_FEATURES,
                "model": {"name": "conformer", "embedding_dim": 16},
                "augment": {"mixstyle": 0.5},
            }
        )


@pytest.mark.parametrize("key", ["freq_mixstyle", "mixstyle"])
def test_mixstyle_probability_outside_0_1_names_the_key(key):
    with pytest.raises(ValueError, match=f"augment.{key}"):
        config_from_dict({"augment": {key: 1.5}})


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_a_mixstyle_model_scripts_and_embeds_as_the_plain_one():
    plain, mixed = net_with("cnn"), net_with("cnn", freq_mixstyle=0.7, mixstyle=0.7)
    mixed.load_state_dict(plain.state_dict())
    plain.eval(), mixed.eval()
    scripted = torch.jit.script(mixed)
    x, lengths, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(scripted.embed(x, lengths), plain.embed(x, lengths))


def test_the_mixing_weights_are_the_seeded_beta_draws_of_before():
    # alpha moved into a buffer and Beta lost its argument checks: the draws stay bit-exact, so
    # a seeded or resumed run repeats as it did.
    style = MixStyle(prob=0.6, alpha=0.3).train()
    torch.manual_seed(5)
    drawn = style.mixing_weights(64)
    torch.manual_seed(5)
    alpha = torch.tensor(0.3)
    lam = torch.distributions.Beta(alpha, alpha).sample((64,))
    expected = torch.where(torch.rand(64) < 0.6, lam, 1.0)
    assert torch.equal(drawn, expected)
    assert 0 < (drawn == 1).sum() < 64
    assert "concentration" not in style.state_dict()  # checkpoints keep their keys


@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_a_training_forward_with_both_mixstyles_reads_nothing_from_the_device(name):
    # torch.tensor(alpha, device=...) and Beta's argument validation read back to the host: 6
    # reads per step with both on, each a stall on a GPU.
    net = net_with(name, freq_mixstyle=1.0, mixstyle=1.0).train()
    x, lengths, labels = batch()
    net(x, lengths, labels)  # warm-up
    assert count_host_syncs(lambda: net(x, lengths, labels)) == 0
