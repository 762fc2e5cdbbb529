"""Training with unlabelled audio (data.unlabelled): the clustering step, the NT-Xent objective,
exact resume with pseudo-labels, and two gloo ranks (mixed batches, the labels' broadcast)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

from audioclf import checkpoint
from audioclf.config import Config
from audioclf.data.demo import generate_demo
from audioclf.training.unlabelled import (
    REFERENCE_CLASSES,
    class_gap,
    cluster_pseudo_labels,
    pseudo_labels_at_gap,
    reference_rows,
)
from tests.helpers import run_in_group, tiny_config
from tests.train_hooks import digest_hooks, stop_at


def _planted(classes: int, per_class: int, dim: int = 32, noise: float = 0.15, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    truth = np.repeat(np.arange(classes), per_class)
    points = centres[truth] + noise * rng.normal(size=(len(truth), dim)) / np.sqrt(dim)
    return points, truth


def test_clustering_recovers_planted_classes():
    points, truth = _planted(classes=8, per_class=12)
    labels, report = cluster_pseudo_labels(points, threshold=0.3, min_size=4, min_cohesion=0.7)
    kept = labels >= 0
    assert report["kept"] == 8 and report["kept_share"] == 1.0
    assert normalized_mutual_info_score(truth[kept], labels[kept]) > 0.99
    purity = sum(np.bincount(truth[labels == k]).max() for k in range(report["kept"])) / kept.sum()
    assert purity == 1.0 and report["sizes"] == [12] * 8


def test_clustering_keeps_only_confident_clusters():
    points, truth = _planted(classes=4, per_class=10)
    scattered = np.random.default_rng(1).normal(size=(6, 32))  # six loners: no cluster of m
    labels, report = cluster_pseudo_labels(
        np.concatenate([points, scattered]), threshold=0.3, min_size=4, min_cohesion=0.7
    )
    assert report["kept"] == 4 and (labels[40:] == -1).all()
    assert report["kept_share"] == pytest.approx(40 / 46)
    assert normalized_mutual_info_score(truth, labels[:40]) > 0.99
    # a cluster of more than max_share of the clips is no class (an untrained model's blob)
    labels, report = cluster_pseudo_labels(
        points, threshold=0.3, min_size=4, min_cohesion=0.7, max_share=0.2
    )
    assert report["clusters"] == 4 and report["kept"] == 0
    # a cohesion above what the clusters reach keeps none
    labels, report = cluster_pseudo_labels(points, threshold=0.3, min_size=4, min_cohesion=0.9999)
    assert report["kept"] == 0 and (labels == -1).all()


def test_the_largest_confident_clusters_are_kept_up_to_max_clusters():
    points, truth = _planted(classes=5, per_class=12)
    small, _ = _planted(classes=1, per_class=5, seed=2)  # a sixth class of 5: the smallest
    everything = np.concatenate([small, points])
    labels, report = cluster_pseudo_labels(everything, threshold=0.3, min_size=4, min_cohesion=0.7)
    assert (report["confident"], report["kept"]) == (6, 6)
    labels, report = cluster_pseudo_labels(
        everything, threshold=0.3, min_size=4, min_cohesion=0.7, max_clusters=5
    )
    assert (report["confident"], report["kept"]) == (6, 5) and report["sizes"] == [12] * 5
    assert (labels[:5] == -1).all()  # the small cluster goes, though its clips come first
    assert labels[5:].tolist() == np.repeat(np.arange(5), 12).tolist()  # numbered in order
    assert normalized_mutual_info_score(truth, labels[5:]) > 0.99


def test_the_class_gap_is_the_median_distance_to_the_nearest_other_class():
    # centroids at 0, 60 and 180 degrees: nearest-other distances 0.5, 0.5 and 1.5
    angles = np.radians([0, 0, 60, 60, 180, 180])
    points = np.stack([np.cos(angles), np.sin(angles)], axis=1) * 3.0  # the scale is ignored
    assert class_gap(points, np.array([0, 0, 1, 1, 2, 2])) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="two classes"):
        class_gap(points[:2], np.array([0, 0]))


def test_the_cut_follows_the_labelled_classes_gap():
    """New-source classes as close together as the labelled ones: a fixed cosine cut (0.3)
    merges them; cut at half the labelled gap, each is its own pseudo-class."""
    rng = np.random.default_rng(3)
    base = rng.normal(size=32)
    tight = []
    for seed in (4, 5):  # two sets of 6 classes, 12 clips each, close around one direction
        points, truth = _planted(classes=6, per_class=12, noise=0.02, seed=seed)
        tight.append((base / np.linalg.norm(base) * 4 + points, truth))
    (reference, reference_labels), (clips, truth) = tight
    gap = class_gap(reference, reference_labels)
    assert gap < 0.15  # the labelled classes are close too
    merged, _ = cluster_pseudo_labels(clips, threshold=0.3, min_size=4, min_cohesion=0.7)
    assert len(np.unique(merged[merged >= 0])) < 6
    labels, report = pseudo_labels_at_gap(
        clips, reference, reference_labels, cut=0.5, min_size=4, min_cohesion=0.7
    )
    assert report["gap"] == pytest.approx(gap) and report["threshold"] == pytest.approx(gap / 2)
    assert report["kept"] == 6 and (labels >= 0).all()
    assert normalized_mutual_info_score(truth, labels) > 0.99


def test_a_fixed_cluster_threshold_cuts_there_and_older_runs_keep_theirs():
    points, truth = _planted(classes=6, per_class=12)
    reference, reference_labels = _planted(classes=4, per_class=6, seed=9)
    options = {"min_size": 4, "min_cohesion": 0.7}
    _, report = pseudo_labels_at_gap(points, reference, reference_labels, cut=0.5, **options)
    assert report["threshold"] == pytest.approx(0.5 * report["gap"])
    _, report = pseudo_labels_at_gap(
        points, reference, reference_labels, cut=0.5, fixed=0.3, **options
    )
    assert report["threshold"] == 0.3
    # a checkpoint of a run from before unlabelled.cluster_cut holds cluster_threshold: 0.3
    from audioclf.config import config_from_dict
    from audioclf.config.loading import to_dict

    older = to_dict(Config())
    older["unlabelled"]["cluster_threshold"] = 0.3
    del older["unlabelled"]["cluster_cut"]
    assert config_from_dict(older).unlabelled.cluster_threshold == 0.3
    assert Config().unlabelled.cluster_threshold == 0.0  # new runs cut at the gap


def test_no_clip_is_labelled_while_the_model_cannot_tell_known_classes_apart():
    clips, _ = _planted(classes=6, per_class=12)
    reference, reference_labels = _planted(classes=4, per_class=6, seed=9)
    options = {"cut": 0.5, "min_size": 4, "min_cohesion": 0.7, "min_reference_p1": 0.8}
    labels, report = pseudo_labels_at_gap(clips, reference, reference_labels, **options)
    assert report["reference_p1"] == 1.0 and report["kept"] == 6
    shuffled = np.random.default_rng(0).permutation(reference_labels)  # known classes mixed up
    labels, report = pseudo_labels_at_gap(clips, reference, shuffled, **options)
    assert report["reference_p1"] < 0.8 and report["kept"] == 0 and (labels == -1).all()
    assert labels.shape == (len(clips),)


def test_the_reference_sample_is_a_fixed_draw_of_classes_with_two_rows():
    codes = np.concatenate([np.repeat(np.arange(300), 6), [300]])  # class 300: one row
    rows = reference_rows(codes, per_class=4, seed=7)
    assert np.array_equal(rows, reference_rows(codes, per_class=4, seed=7))
    assert not np.array_equal(rows, reference_rows(codes, per_class=4, seed=8))
    drawn, counts = np.unique(codes[rows], return_counts=True)
    assert len(drawn) == REFERENCE_CLASSES and set(counts) == {4} and 300 not in drawn
    assert (np.diff(rows) > 0).all()


def test_two_views_of_a_clip_pull_together():
    from audioclf.losses.unlabelled import ViewsLoss

    loss = ViewsLoss(temperature=0.1)
    clips = torch.tensor([0, 0, 1, 1, 2, 2])
    same = torch.nn.functional.normalize(torch.eye(3).repeat_interleave(2, 0), dim=1)
    mixed = same[[0, 2, 1, 4, 3, 5]]  # each clip's views apart
    assert loss(same, clips) < loss(mixed, clips)
    empty = torch.zeros(0, 3, requires_grad=True)
    assert loss(empty, torch.zeros(0, dtype=torch.int64)).item() == 0.0


@pytest.fixture(scope="module")
def new_source(tmp_path_factory) -> Path:
    """Unlabelled audio of another source: 6 classes x 2 items x 4 ids of generated audio."""
    index = generate_demo(tmp_path_factory.mktemp("new"), classes=6, items=2, ids=4, seed=1)
    return index.parent / "wav"


def _config(tiny_demo: Path, runs: Path, new_source: Path, *extra: str) -> Config:
    return tiny_config(
        tiny_demo,
        runs,
        "cnn",
        f"data.unlabelled={new_source}",
        "sampler.batch_size=12",
        "unlabelled.share=0.35",
        "unlabelled.cluster_every=1",
        "unlabelled.cluster_cut=1.0",
        "unlabelled.min_reference_p1=0",  # the tiny model labels from its first round
        "unlabelled.min_cohesion=0.5",
        # the tiny model's first clusters are large: kept here, so the rounds have labels to test
        "unlabelled.max_cluster_share=1.0",
        *extra,
    )


def _fit(cfg: Config, hooks=None) -> dict:
    from audioclf.training.trainer import fit

    return fit(cfg, hooks=hooks or digest_hooks())


def test_a_run_with_unlabelled_audio_resumes_mid_epoch_exactly(tmp_path, tiny_demo, new_source):
    straight = _fit(_config(tiny_demo, tmp_path / "a", new_source))
    assert straight["unlabelled"] == {"source": str(new_source), "clips": 48}
    stopped = _fit(_config(tiny_demo, tmp_path / "b", new_source), hooks=stop_at(20))
    ckpt = checkpoint.load(tmp_path / "b" / "t" / "last.pt")
    assert (ckpt["epoch"], ckpt["step"]) == (1, 20) and ckpt["position"] > 0  # in epoch 2
    assert ckpt["pseudo_labels"]["round_epoch"] == 1 and len(ckpt["pseudo_labels"]["rounds"]) == 2
    assert ckpt["unlabelled"]["clips"] == 48 and stopped["stopped"]
    assert max(ckpt["pseudo_labels"]["labels"]) >= 0  # a pseudo-class was kept and saved
    resumed = _fit(_config(tiny_demo, tmp_path / "b", new_source, "checkpoint.resume=auto"))
    assert resumed["step"] == straight["step"]
    assert resumed["parameters_sha256"] == straight["parameters_sha256"]
    final = checkpoint.load(tmp_path / "a" / "t" / "last.pt")["pseudo_labels"]
    assert checkpoint.load(tmp_path / "b" / "t" / "last.pt")["pseudo_labels"] == final
    from audioclf.config import config_from_dict
    from audioclf.inference.checkpoints import describe_checkpoint

    best = checkpoint.load(tmp_path / "a" / "t" / "best.pt")
    described = describe_checkpoint(best, config_from_dict(best["config"]))
    assert described.endswith(f"trained also on 48 unlabelled clips of {new_source}")
    log = (tmp_path / "a" / "t" / "train.log").read_text()
    assert "pseudo-labels, epoch 1:" in log and "pseudo-labels, epoch 2:" in log
    assert "48 usable unlabelled clips" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "a" / "t" / "tensorboard")).Reload()
    assert {"pseudo/clusters", "pseudo/kept", "pseudo/kept_share"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("pseudo/kept")) == 2  # one a round


@pytest.mark.slow
def test_prepared_unlabelled_features_train_like_the_audio(tmp_path, tiny_demo, new_source):
    """prepare --index and --unlabelled into one folder, then train on both as .npy; then on
    packs of both."""
    from audioclf.prepare import main as prepare_main

    out = tmp_path / "feats"
    for source in (["--index", tiny_demo], ["--unlabelled", new_source]):
        argv = [*map(str, source), "--out", str(out), "--workers", "1", "--quiet"]
        assert prepare_main([*argv, "features.n_mels=32"]) == 0
    sheet = out / "unlabelled.csv"
    npy = _config(out / "index.xlsx", tmp_path / "runs", sheet, "features.kind=npy")
    summary = _fit(npy)
    assert summary["unlabelled"] == {"source": str(sheet), "clips": 48}
    log = (tmp_path / "runs" / "t" / "train.log").read_text()
    assert "48 usable unlabelled clips" in log and "pseudo-labels, epoch 2:" in log
    # the labelled rows from a feature pack, the clips still their prepared files, then packed
    # too (prepare --unlabelled --pack): float32 packs hold the .npy values, so the same run
    packs = {}
    for name, source in (
        ("pack", ["--index", out / "index.xlsx"]),
        ("clips", ["--unlabelled", sheet]),
    ):
        argv = [*map(str, source), "--out", str(tmp_path / name), "--pack", "--workers", "1"]
        assert prepare_main([*argv, "--quiet", "--pack-dtype", "float32", "features.kind=npy",
                             "features.n_mels=32"]) == 0  # fmt: skip
        packs[name] = tmp_path / name / "index.parquet"
    runs = {}
    for name, clips in (("packed", sheet), ("both packed", packs["clips"])):
        if name == "both packed":  # read from the pack: the clips' .npy files are gone
            shutil.rmtree(out / "unlabelled")
        cfg = _config(packs["pack"], tmp_path / name, clips, "features.kind=npy")
        runs[name] = _fit(cfg)
        assert runs[name]["unlabelled"] == {"source": str(clips), "clips": 48}
        log = (tmp_path / name / "t" / "train.log").read_text()
        assert "48 usable unlabelled clips" in log and "pseudo-labels, epoch 2:" in log
    assert runs["both packed"]["parameters_sha256"] == runs["packed"]["parameters_sha256"]


def _rank_batches(rank, world, cfg: Config) -> dict:
    """A 2-rank run that records every batch's positions and the pseudo-labels it saw."""
    from audioclf.training.trainer import TrainHooks, fit

    seen = {"batches": [], "labels": []}

    def on_step(trainer) -> None:
        sampler = trainer.train_loader.sampler
        seen["labels"].append(sampler.pseudo_labels.tolist())

    hooks = TrainHooks(on_step=on_step, on_end=lambda t, s: seen.update(summary=s))
    from audioclf.training import step as step_module

    # the positions of every batch this rank trains on, as the step receives them (this
    # spawned rank's own copy of the class: nothing else sees the wrapper)

    original = step_module.TrainStep._inputs

    def inputs(self, batch):
        seen["batches"].append(batch[3].tolist())
        return original(self, batch)

    step_module.TrainStep._inputs = inputs
    try:
        fit(cfg, hooks=hooks)
    finally:
        step_module.TrainStep._inputs = original
    return {**seen, "step": seen["summary"]["step"]}


@pytest.mark.slow
def test_two_ranks_mix_batches_and_share_the_pseudo_labels(tmp_path, tiny_demo, new_source):
    cfg = _config(tiny_demo, tmp_path / "runs", new_source, "eval.every=0")
    r0, r1 = run_in_group(_rank_batches, tmp_path, cfg, timeout=300)
    assert r0["step"] == r1["step"] == len(r0["batches"]) == len(r1["batches"]) > 0
    assert r0["labels"] == r1["labels"]  # the broadcast labels, step by step
    assert max(max(labels) for labels in r0["labels"]) >= 0  # some pseudo-class was kept
    from tests.helpers import run_datasets

    train, _, _ = run_datasets(cfg)
    n, clips = len(train), 48
    classes = train.codes.class_codes
    for rank in (r0, r1):
        for batch, labels in zip(rank["batches"], rank["labels"]):
            labelled, views = batch[:8], batch[8:]
            assert len(batch) == 12 and views[0::2] == views[1::2]
            assert all(p >= n + clips for p in views)
            keys = [classes[p] if p < n else 1000 + labels[p - n] for p in labelled]
            assert all(count == 2 for count in np.unique(keys, return_counts=True)[1])
    views = [{p for b in rank["batches"] for p in b[8:]} for rank in (r0, r1)]
    assert not views[0] & views[1]  # each rank draws views from its own share of the clips


def _rank_fit(rank, world, cfg: Config, stop_step: int) -> dict:
    from audioclf.training.trainer import fit

    return fit(cfg, hooks=stop_at(stop_step) if stop_step else digest_hooks())


@pytest.mark.slow
def test_two_ranks_resume_mid_epoch_with_the_same_pseudo_labels(tmp_path, tiny_demo, new_source):
    def cfg(runs: str, *extra: str) -> Config:
        return _config(tiny_demo, tmp_path / runs, new_source, "eval.every=0", *extra)

    results = [tmp_path / name for name in ("straight", "stopped", "resumed")]
    for folder in results:
        folder.mkdir()
    straight = run_in_group(_rank_fit, results[0], cfg("a"), 0, timeout=300)
    stopped = run_in_group(_rank_fit, results[1], cfg("b"), 14, timeout=300)
    assert all(s["stopped"] for s in stopped)
    ckpt = checkpoint.load(tmp_path / "b" / "t" / "last.pt")
    assert ckpt["epoch"] == 1 and ckpt["position"] > 0 and ckpt["world_size"] == 2
    resumed = run_in_group(
        _rank_fit, results[2], cfg("b", "checkpoint.resume=auto"), 0, timeout=300
    )
    digests = {r["parameters_sha256"] for r in (*straight, *resumed)}
    assert len(digests) == 1 and resumed[0]["step"] == straight[0]["step"]
    final = checkpoint.load(tmp_path / "a" / "t" / "last.pt")["pseudo_labels"]
    assert checkpoint.load(tmp_path / "b" / "t" / "last.pt")["pseudo_labels"] == final
