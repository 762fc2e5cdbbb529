"""train.compile: torch.compile of the embedder gives the eager loss and gradients on a fixed
batch; a compiled run trains, validates eagerly (no compilation for the validation clips'
lengths), leaves the compilation step out of samples/s and saves the eager state-dict keys.
Compiling takes tens of seconds on a CPU: every test here is slow."""

import pytest
import torch
from torch._dynamo.utils import counters

from audioclf import checkpoint
from audioclf.losses import build_loss
from audioclf.models import build_net
from tests.helpers import feature_batches, fit, tiny_config, tiny_net_config

pytestmark = pytest.mark.slow

NO_RANDOMNESS = ["model.cnn.dropout=0", "spec_augment.enabled=false", "loss.miner=all"]


def loss_and_grads(compiled: bool):
    cfg = tiny_net_config("cnn", *NO_RANDOMNESS)
    torch.manual_seed(0)
    net = build_net(cfg, 0).train()
    if compiled:
        net.embedder.compile(dynamic=False)
    loss_fn = build_loss(cfg)
    loss_fn.set_epoch(0)
    x, lengths, labels, _ = feature_batches(1)[0]
    embeddings, _ = net(x, lengths)
    loss = loss_fn(embeddings, labels)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in net.named_parameters()}


def test_compile_gives_the_eager_loss_and_gradients_on_a_fixed_batch():
    torch._dynamo.reset()
    eager_loss, eager_grads = loss_and_grads(compiled=False)
    loss, grads = loss_and_grads(compiled=True)
    assert eager_loss > 0 and loss == pytest.approx(eager_loss, rel=1e-4, abs=1e-5)
    assert grads.keys() == eager_grads.keys()  # the compiled module keeps its parameter names
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=1e-4, rtol=1e-3, msg=name)


def test_a_compiled_run_trains_validates_eagerly_and_keeps_the_checkpoint_keys(tmp_path, tiny_demo):
    torch._dynamo.reset()
    counters.clear()
    extra = ["train.epochs=2", "eval.every=1", "train.log_every_steps=1"]
    compiled = fit(tiny_config(tiny_demo, tmp_path / "c", "cnn", *extra, "train.compile=true"))
    graphs = counters["stats"]["unique_graphs"]
    eager = fit(tiny_config(tiny_demo, tmp_path / "e", "cnn", *extra))
    # One training graph for the crop (forward and backward), no graph for the validation
    # clips, whose lengths differ from the crop's (eval.max_seconds 1.0 s, crops 0.5 s).
    assert 1 <= graphs <= 2, graphs
    assert [h["epoch"] for h in compiled["history"]] == [1, 2]
    assert all(h["map_at_r"] > 0 for h in compiled["history"])
    log = (tmp_path / "c" / "t" / "train.log").read_text()
    assert "train.compile: the first step took" in log
    first, again = (checkpoint.load(tmp_path / run / "t" / checkpoint.LAST) for run in "ce")
    assert first["model"].keys() == again["model"].keys()
    assert not any("_orig_mod" in key for key in first["model"])
    # the first epoch's samples/s leaves the compiling step out: not far below the second's
    rates = [h["samples_per_s"] for h in compiled["history"]]
    assert rates[0] > 0.3 * rates[1], rates
    assert eager["history"][0]["samples_per_s"] > 0
