"""train.compile: torch.compile of the embedder gives the eager loss and gradients on a fixed
batch; a new batch size compiles once more (the batch axis then dynamic), logged, and no more;
a compiled run trains, validates eagerly (no compilation for the validation clips'
lengths), leaves the compilation step out of samples/s and saves the eager state-dict keys.
Compiling takes tens of seconds on a CPU: every test here is slow."""

import pytest
import torch
from torch._dynamo.utils import counters

from audioclf import checkpoint
from audioclf.losses import build_loss
from audioclf.models import build_net
from audioclf.training.compiled import compile_embedder
from tests.helpers import feature_batches, fit, tiny_config, tiny_net_config

pytestmark = pytest.mark.slow

NO_RANDOMNESS = ["model.cnn.dropout=0", "spec_augment.enabled=false", "loss.miner=all"]


def loss_and_grads(compiled: bool):
    cfg = tiny_net_config("cnn", *NO_RANDOMNESS)
    torch.manual_seed(0)
    net = build_net(cfg, 0).train()
    if compiled:
        compile_embedder(net)  # as train.compile does
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


def compiled_steps(sizes, graphs: list) -> int:
    """A tiny net's embedder compiled by compile_embedder with a backend that counts graphs and
    runs them as they are, through a forward and backward of a batch of each size; returns
    the compilations it counted."""

    def eager(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = build_net(tiny_net_config("cnn", *NO_RANDOMNESS), 0).train()
    compilations = compile_embedder(net, backend=eager)
    for rows in sizes:
        embeddings, _ = net(torch.randn(rows, 120, 32), torch.full((rows,), 120))
        embeddings.sum().backward()
    return compilations.count


def test_a_new_batch_size_compiles_once_more_and_is_logged(notes):
    # Batches shrink when files are skipped as unreadable; the empty-batch placeholder has 2
    # rows. With static shapes each size compiled anew (5 here), up to torch's limit of 8.
    graphs = []
    assert compiled_steps((16, 14, 12, 16, 2, 15), graphs) == len(graphs) == 2
    said = [line for line in notes if line.startswith("train.compile:")]
    assert said[0] == "train.compile: compiling the embedder for lengths [16], feats [16, 120, 32]"
    assert said[1].startswith("train.compile: the embedder compiles again (compilation 2) for ")
    assert "a new batch size or crop length" in said[1] and ", 120, 32]" in said[1]
    assert "[14, 120, 32]" not in said[1]  # the batch axis is symbolic: dynamic
    assert len(said) == 2
    # At torch's recompile limit, past which it would run the embedder eagerly: a warning.
    with torch._dynamo.config.patch(recompile_limit=2):  # (monkeypatch's undo breaks it)
        assert compiled_steps((16, 14), []) == 2
    assert notes[-1].startswith("train.compile: 2 compilations of the embedder, torch's recompile")


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
    assert "train.compile: compiling the embedder for lengths [8], feats [8, " in log
    first, again = (checkpoint.load(tmp_path / run / "t" / checkpoint.LAST) for run in "ce")
    assert first["model"].keys() == again["model"].keys()
    assert not any("_orig_mod" in key for key in first["model"])
    # the first epoch's samples/s leaves the compiling step out: not far below the second's
    rates = [h["samples_per_s"] for h in compiled["history"]]
    assert rates[0] > 0.3 * rates[1], rates
    assert eager["history"][0]["samples_per_s"] > 0


class _Breaking(torch.nn.Module):
    """An embedder whose forward breaks its graph on purpose: two frames to compile."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x)


def test_a_graph_break_is_logged_as_one_and_recompiles_count_per_frame(notes):
    # The resume function after a graph break is another code object (frame_id): it was counted
    # as compilation 2 "for a new batch size" and brought the recompile-limit warning closer.
    torch._dynamo.reset()
    net = torch.nn.Module()
    net.embedder = _Breaking()
    compilations = compile_embedder(net, backend=lambda graph, _inputs: graph.forward)
    net.embedder(torch.randn(4, 8))
    said = [line for line in notes if line.startswith("train.compile:")]
    assert len(said) == 2 and said[0].startswith("train.compile: compiling the embedder for ")
    assert said[1].startswith("train.compile: a graph break in the embedder")
    assert compilations.graph_breaks == 1 and sorted(compilations.per_frame.values()) == [1, 1]
    net.embedder(torch.randn(6, 8))  # a new batch size: each frame once more, dynamic
    assert sorted(compilations.per_frame.values()) == [2, 2] and compilations.count == 4
    again = [line for line in notes if "compiles again" in line]
    assert len(again) == 2 and all("(compilation 2)" in line for line in again)
    with torch._dynamo.config.patch(recompile_limit=3):
        net.embedder(torch.randn(6, 8))  # reused: no compilation, no warning
    assert not any("recompile limit" in line for line in notes)
