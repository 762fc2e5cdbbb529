"""Training runs with averaged weights and the final-epochs schedule (one process, in-process
fit): bit-exact resume with the EMA, avg.pt made once, best.pt seeing the EMA and avg.pt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from audioclf import checkpoint, distributed
from audioclf.inference import load_trained
from audioclf.training.validation import Validator
from tests.helpers import fit, tiny_config
from tests.train_hooks import digest_hooks, stop_at

SCHEDULE = [
    "train.epochs=2",
    "train.ema_decay=0.9",
    "train.final_epochs=1",
    "clips.final_crop_seconds=0.75",
    "loss.final_margin=0.3",
    "checkpoint.average_last=2",
]


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_stopped_in_its_final_epoch_resumes_bit_exactly_ema_and_average_included(
    tmp_path, tiny_demo
):
    def config(folder: str, *extra: str):
        return tiny_config(tiny_demo, tmp_path / folder, "cnn", *SCHEDULE, *extra)

    straight = fit(config("a"), digest_hooks())
    per_epoch = straight["history"][0]["step"]
    stopped = fit(config("b"), stop_at(per_epoch + 3))  # in the final epoch
    assert stopped["stopped"] and stopped["average"] is None
    assert not (tmp_path / "b" / "t" / checkpoint.AVG).exists()
    resumed = fit(config("b", "checkpoint.resume=auto"), digest_hooks())
    assert resumed["parameters_sha256"] == straight["parameters_sha256"]
    # The validation of every epoch (of the EMA) and of avg.pt is the straight run's.
    assert [h["map_at_r"] for h in resumed["history"]] == [
        h["map_at_r"] for h in straight["history"]
    ]
    assert resumed["average"] == straight["average"] and resumed["average"]["epochs"] == [1, 2]
    assert resumed["average"]["weights"] == "ema"
    for name, keys in ((checkpoint.LAST, ("model", "ema")), (checkpoint.AVG, ("model",))):
        a, b = (checkpoint.load(tmp_path / run / "t" / name) for run in ("a", "b"))
        for key in keys:
            assert _same_tensors(a[key], b[key]), (name, key)
    log = (tmp_path / "b" / "t" / "train.log").read_text()
    assert "train.final_epochs=1 (epoch 2 of 2): training crops of 0.75 s" in log
    # Resumed once more after the last epoch: avg.pt is not made again.
    again = fit(config("b", "checkpoint.resume=auto"))
    assert again["average"] == straight["average"]
    log = (tmp_path / "b" / "t" / "train.log").read_text()
    assert log.count("avg.pt: the mean of the EMA weights of epochs 1-2") == 1
    rows = (tmp_path / "b" / "t" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "avg_1-2"]


def _scripted_validation(monkeypatch, metrics: list[float]) -> list[dict]:
    """Validator.run as it is, but its map_at_r taken from `metrics` in turn; returns the state
    of every model it validated."""
    real, seen = Validator.run, []

    def run(self, model, **kwargs):
        result = real(self, model, **kwargs)
        seen.append({k: v.clone() for k, v in distributed.unwrap(model).state_dict().items()})
        return {**result, "map_at_r": metrics[len(seen) - 1]}

    monkeypatch.setattr(Validator, "run", run)
    return seen


@pytest.mark.parametrize("ema, avg_wins", [(True, True), (False, False)])
def test_best_pt_sees_the_ema_and_the_average(tmp_path, tiny_demo, monkeypatch, ema, avg_wins):
    seen = _scripted_validation(monkeypatch, [0.5, 0.6, 0.9 if avg_wins else 0.1])
    extra = ["train.ema_decay=0.9"] if ema else []
    cfg = tiny_config(
        tiny_demo, tmp_path / "runs", "cnn", "train.epochs=2", "checkpoint.average_last=2", *extra
    )
    result = fit(cfg)
    run = Path(result["run_dir"])
    assert len(seen) == 3  # two epochs and avg.pt
    source = "ema" if ema else "model"
    epochs = [checkpoint.load(checkpoint.epoch_path(run, e)) for e in (1, 2)]
    for validated, epoch in zip(seen, epochs, strict=False):
        assert _same_tensors(validated, epoch[source])  # validation judged the EMA when kept
    avg = checkpoint.load(run / checkpoint.AVG)
    assert _same_tensors(seen[2], avg["model"]) and avg["average_of"]["weights"] == source
    mean = (
        epochs[0][source]["embedder.embedding.weight"]
        + epochs[1][source]["embedder.embedding.weight"]
    ) / 2
    assert torch.allclose(avg["model"]["embedder.embedding.weight"], mean)
    best = checkpoint.load(run / checkpoint.BEST)
    assert result["average"]["metrics"]["map_at_r"] == (0.9 if avg_wins else 0.1)
    net, _, _ = load_trained(run / checkpoint.BEST)
    wanted = avg["model"] if avg_wins else epochs[1][source]
    assert _same_tensors(net.state_dict(), wanted)
    assert ("average_of" in best) == avg_wins
    assert checkpoint.load(run / checkpoint.LAST)["best_metric"] == (0.9 if avg_wins else 0.6)
    log = (run / "train.log").read_text()
    assert ("(new best: best.pt is avg.pt)" in log) == avg_wins
    assert "BatchNorm statistics averaged" in log


def _fit_worker(rank, world, cfg):
    from audioclf.training.trainer import TrainHooks
    from audioclf.training.trainer import fit as train
    from tests.train_hooks import parameters_digest

    def on_end(trainer, summary):
        summary["parameters_sha256"] = parameters_digest(trainer.model)
        summary["ema_weight"] = trainer.ema.state_dict()["embedder.embedding.weight"].clone()

    return train(cfg, hooks=TrainHooks(on_end=on_end))


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_two_ranks_keep_one_ema_and_validate_the_average_together(tmp_path, tiny_demo, sharded):
    from tests.helpers import run_in_group

    cfg = tiny_config(
        tiny_demo, tmp_path / "runs", "cnn", *SCHEDULE, f"eval.distributed={str(sharded).lower()}"
    )
    r0, r1 = run_in_group(_fit_worker, tmp_path, cfg, timeout=300)
    assert r0["parameters_sha256"] == r1["parameters_sha256"]
    run = Path(r0["run_dir"])
    ema = checkpoint.load(run / checkpoint.LAST)["ema"]["embedder.embedding.weight"]
    assert torch.equal(r0["ema_weight"], ema) and torch.equal(r1["ema_weight"], ema)  # each its own
    assert r0["average"]["epochs"] == r1["average"]["epochs"] == [1, 2]
    assert set(r0["average"]["metrics"]) == {"precision_at_1", "map_at_r", "r_precision"}
    assert (run / checkpoint.AVG).is_file()
