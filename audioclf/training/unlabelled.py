"""Cluster pseudo-labels of the unlabelled clips (data.unlabelled), round after round.

    labels, report = pseudo_labels_at_gap(embeddings, reference, reference_labels, cut=0.5,
                                          min_size=4, min_cohesion=0.7)
    rounds = PseudoLabelRounds(cfg, clips, reference, labelled_classes=37, apply=..., ...)
    rounds.start_epoch(epoch, model)     # every rank: a round when one is due
    rounds.state_dict() / load_state_dict(state)   # the checkpoint's "pseudo_labels"

A round (at the start of epoch 1, then every unlabelled.cluster_every epochs) embeds the clips
and a fixed sample of labelled training clips (the reference: up to REFERENCE_CLASSES classes,
sampler.m clips each) with the current model, sharded over the ranks and gathered on rank 0.
Rank 0 measures the labelled classes' gap (the median cosine distance from a class's centroid
to its nearest other class) and clusters the clips (scikit-learn's agglomerative clustering,
cosine distance, average linkage) until clusters are unlabelled.cluster_cut × that gap apart:
two clips join only when they are closer than known classes are to each other, so the cut
follows the model as it trains and the embedding's scale on each domain, where a fixed
distance merged sounds' classes (purity 0.64; benchmarks/RESULTS.md, "Pseudo-labels cut at
the labelled classes' gap"). unlabelled.cluster_threshold > 0 cuts at that fixed distance
instead (what runs before cluster_cut did, at 0.3; their configs keep it). It keeps the confident clusters: at least
sampler.m clips (a batch draws m distinct clips of a pseudo-class, each clip its own item)
whose mean cosine to their centroid (the purity proxy, "cohesion") is at least
unlabelled.min_cohesion, and at most unlabelled.max_cluster_share of the clips (an untrained
model puts nearly every clip in one tight cluster: that is no class); of those, the largest
are kept, at most unlabelled.max_pseudo_classes per labelled class (pseudo-classes join the
class draw like labelled ones: 140 of them beside 37 labelled classes drowned the labels). The
labels
reach every rank by one broadcast (inside dist.timeout_minutes) and go to the sampler and the
loss (`apply`). Each round logs the gap, the cut, the cluster count, the kept share and the
kept sizes, and writes them to TensorBoard (pseudo/*). The labels are checkpointed, so a resume
(mid-epoch too) continues with the labels of the round it was in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch
from sklearn.cluster import AgglomerativeClustering
from sklearn.preprocessing import normalize

from audioclf import distributed
from audioclf.config import Config
from audioclf.inference.extract import embed_dataset

log = logging.getLogger("audioclf")

REFERENCE_CLASSES = 256  # labelled classes whose gap sets each round's cut (a fixed draw)


def reference_rows(class_codes: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """Sorted positions of the reference sample: up to REFERENCE_CLASSES classes of at least
    two rows, up to `per_class` rows of each, drawn once with `seed` (the same on every rank
    and on a resume)."""
    codes = np.asarray(class_codes)
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(codes, return_counts=True)
    classes = classes[counts >= 2]
    chosen = rng.permutation(classes)[:REFERENCE_CLASSES]
    rows = [rng.permutation(np.flatnonzero(codes == c))[:per_class] for c in np.sort(chosen)]
    return np.sort(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)


def class_gap(embeddings: np.ndarray, labels: np.ndarray) -> float:
    """The median over classes of the cosine distance from a class's centroid to the nearest
    other class's centroid (ValueError with fewer than two classes)."""
    x = normalize(np.asarray(embeddings, dtype=np.float64))
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if len(classes) < 2:
        raise ValueError(f"the labelled classes' gap needs two classes, got {len(classes)}")
    centroids = normalize(np.stack([x[labels == c].mean(axis=0) for c in classes]))
    distances = 1.0 - centroids @ centroids.T
    np.fill_diagonal(distances, np.inf)
    return float(np.median(distances.min(axis=1)))


def cluster_pseudo_labels(
    embeddings: np.ndarray,
    *,
    threshold: float,
    min_size: int,
    min_cohesion: float,
    max_share: float = 1.0,
    max_clusters: int | None = None,
) -> tuple[np.ndarray, dict]:
    """Pseudo-labels of `embeddings` [N, D] (-1: not in a kept cluster), numbered 0.. in
    order of each kept cluster's first member, and a report: clusters found, confident, kept,
    the share of clips kept, the kept clusters' sizes (largest first) and mean cohesion. A
    cluster is confident with min_size <= size <= max_share × N and a mean cosine to its
    centroid of at least min_cohesion; the `max_clusters` largest confident ones are kept
    (all without it)."""
    x = normalize(np.asarray(embeddings, dtype=np.float64))
    labels = np.full(len(x), -1, dtype=np.int64)
    report = _no_clusters()
    if len(x) < 2:
        return labels, report
    found = AgglomerativeClustering(
        n_clusters=None, metric="cosine", linkage="average", distance_threshold=threshold
    ).fit_predict(x)
    _, first, counts = np.unique(found, return_index=True, return_counts=True)
    confident = []  # (members, cohesion) by first member: labels do not depend on sklearn's ids
    for cluster in found[np.sort(first)]:
        members = np.flatnonzero(found == cluster)
        if not min_size <= len(members) <= max_share * len(x):
            continue
        centroid = normalize(x[members].mean(axis=0, keepdims=True))[0]
        cohesion = float((x[members] @ centroid).mean())
        if cohesion >= min_cohesion:
            confident.append((members, cohesion))
    chosen = sorted(range(len(confident)), key=lambda i: -len(confident[i][0]))[:max_clusters]
    cohesions = []
    for kept, position in enumerate(sorted(chosen)):
        members, cohesion = confident[position]
        labels[members] = kept
        cohesions.append(cohesion)
    kept = len(chosen)
    report["confident"] = len(confident)
    sizes = sorted(np.bincount(labels[labels >= 0]).tolist(), reverse=True) if kept else []
    report.update(
        clusters=len(counts),
        kept=kept,
        kept_share=float((labels >= 0).mean()),
        sizes=sizes,
        cohesion=float(np.mean(cohesions)) if cohesions else 0.0,
    )
    return labels, report


def pseudo_labels_at_gap(
    embeddings: np.ndarray,
    reference: np.ndarray,
    reference_labels: np.ndarray,
    *,
    cut: float,
    fixed: float = 0.0,
    min_reference_p1: float = 0.0,
    **options,
) -> tuple[np.ndarray, dict]:
    """cluster_pseudo_labels(embeddings, **options) cut at `cut` × the class gap of the
    labelled `reference` embeddings (at the cosine distance `fixed` instead when it is > 0:
    unlabelled.cluster_threshold); the report adds the gap, the threshold used and the
    reference's leave-one-out nearest-neighbour accuracy ("reference_p1"). While that is below
    `min_reference_p1` the model cannot yet tell known classes apart, and no clip is labelled
    (its tight clusters are an untrained network's collapse, not classes)."""
    gap = class_gap(reference, reference_labels)
    threshold = fixed if fixed > 0 else cut * gap
    reference_p1 = nearest_neighbour_accuracy(reference, reference_labels)
    if reference_p1 < min_reference_p1:
        labels, report = np.full(len(embeddings), -1, dtype=np.int64), _no_clusters()
    else:
        labels, report = cluster_pseudo_labels(embeddings, threshold=threshold, **options)
    return labels, {"gap": gap, "threshold": threshold, "reference_p1": reference_p1, **report}


def _no_clusters() -> dict:
    """The report of a round that labels nothing."""
    return {"clusters": 0, "confident": 0, "kept": 0, "kept_share": 0.0, "sizes": [],
            "cohesion": 0.0}  # fmt: skip


def nearest_neighbour_accuracy(embeddings: np.ndarray, labels: np.ndarray) -> float:
    """The share of rows whose nearest other row (cosine) has their label."""
    x = normalize(np.asarray(embeddings, dtype=np.float64))
    similarity = x @ x.T
    np.fill_diagonal(similarity, -np.inf)
    labels = np.asarray(labels)
    return float((labels[similarity.argmax(axis=1)] == labels).mean())


def round_options(cfg: Config, labelled_classes: int) -> dict:
    """pseudo_labels_at_gap's settings for a run's rounds (beside the embeddings): the cut, the
    fixed cut, the wait, the confident-cluster rules and the most pseudo-classes to keep
    (unlabelled.max_pseudo_classes per labelled class, at least one)."""
    unl = cfg.unlabelled
    return {
        "cut": unl.cluster_cut,
        "fixed": unl.cluster_threshold,
        "min_reference_p1": unl.min_reference_p1,
        "min_size": cfg.sampler.m,
        "min_cohesion": unl.min_cohesion,
        "max_share": unl.max_cluster_share,
        "max_clusters": max(1, math.floor(unl.max_pseudo_classes * labelled_classes)),
    }


class PseudoLabelRounds:
    """The pseudo-labels of a run and when they were made; checkpointed (state_dict)."""

    def __init__(
        self,
        cfg: Config,
        clips: torch.utils.data.Dataset,
        reference: torch.utils.data.Dataset,
        *,
        labelled_classes: int,
        apply: Callable[[np.ndarray], None],
        metrics,
        device: torch.device,
        loader_options: dict,
    ):
        self.cfg, self.clips, self.reference, self.apply = cfg, clips, reference, apply
        self.options = round_options(cfg, labelled_classes)
        self.metrics, self.device, self.loader_options = metrics, device, loader_options
        self.labels = np.full(len(clips), -1, dtype=np.int64)
        self.round_epoch = -1  # the epoch whose start made the labels; -1: none yet
        self.rounds: list[dict] = []  # each round's report

    def due(self, epoch: int) -> bool:
        every = self.cfg.unlabelled.cluster_every
        return every > 0 and epoch % every == 0 and epoch != self.round_epoch

    def start_epoch(self, epoch: int, model: torch.nn.Module, step: int) -> None:
        """A round when one is due at this epoch's start (collective: every rank calls it)."""
        if not self.due(epoch):
            return
        embedded = [self._embed_shard(dataset, model) for dataset in (self.clips, self.reference)]
        gathered = distributed.gather_to_primary(embedded)
        labels, report = distributed.primary_only(
            _cluster_gathered, gathered, (len(self.clips), len(self.reference)), **self.options
        )
        self._set(labels, epoch)
        self.rounds.append({"epoch": epoch + 1, **report})
        self._log(epoch, step, report)

    def _embed_shard(self, dataset, model: torch.nn.Module) -> tuple:
        """(embeddings, labels, positions) of this rank's share of `dataset`."""
        rank, world = distributed.get_rank(), distributed.get_world_size()
        return embed_dataset(
            model,
            dataset,
            batch_size=self.cfg.eval.batch_size,
            device=self.device,
            positions=range(rank, len(dataset), world),
            loader_options=self.loader_options,
        )

    def _set(self, labels: np.ndarray, epoch: int) -> None:
        self.labels, self.round_epoch = np.asarray(labels, dtype=np.int64), epoch
        self.apply(self.labels)

    def _log(self, epoch: int, step: int, report: dict) -> None:
        sizes, unl = report["sizes"], self.cfg.unlabelled
        shown = ", ".join(map(str, sizes[:10])) + (" ..." if len(sizes) > 10 else "")
        waiting = report["reference_p1"] < unl.min_reference_p1
        log.info(
            "pseudo-labels, epoch %d: labelled reference P@1 %.3f%s, gap %.3f, cut at %.3f: "
            "%d clusters of %d unlabelled clips, %d confident, %d kept (at most %d; %d to %d "
            "clips, cohesion >= %.2f: mean %.3f), %.1f%% of the clips; sizes %s",
            epoch + 1,
            report["reference_p1"],
            f" (< {unl.min_reference_p1:g}: none kept)" if waiting else "",
            report["gap"],
            report["threshold"],
            report["clusters"],
            len(self.clips),
            report["confident"],
            report["kept"],
            self.options["max_clusters"],
            self.cfg.sampler.m,
            int(unl.max_cluster_share * len(self.clips)),
            unl.min_cohesion,
            report["cohesion"],
            100 * report["kept_share"],
            shown or "-",
        )
        for key in ("reference_p1", "gap", "threshold", "clusters", "confident", "kept",
                    "kept_share", "cohesion"):  # fmt: skip
            self.metrics.scalar(f"pseudo/{key}", report[key], step)
        if sizes:
            self.metrics.scalar("pseudo/largest", sizes[0], step)

    def state_dict(self) -> dict:
        return {
            "labels": self.labels.tolist(),
            "round_epoch": self.round_epoch,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """The saved labels, applied (before the sampler's state: they change its draw)."""
        if state is None:  # a checkpoint of a run without data.unlabelled
            return
        labels = np.asarray(state["labels"], dtype=np.int64)
        if labels.shape != self.labels.shape:
            raise ValueError(
                f"the checkpoint's pseudo-labels cover {len(labels)} unlabelled clips, "
                f"data.unlabelled has {len(self.labels)}; resume with the same data.unlabelled"
            )
        self.rounds = list(state.get("rounds", []))
        self._set(labels, int(state["round_epoch"]))


def _cluster_gathered(gathered: list, sizes: tuple[int, int], **options) -> tuple[np.ndarray, dict]:
    """Rank 0: the ranks' clips and reference, each put in order, then pseudo_labels_at_gap."""
    clips, reference = (_in_order([shard[i] for shard in gathered], sizes[i]) for i in (0, 1))
    return pseudo_labels_at_gap(clips[0], reference[0], reference[1], **options)


def _in_order(shards: list, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings, labels) of the ranks' (embeddings, labels, positions) in position order."""
    embeddings = np.concatenate([e for e, _, _ in shards if len(e)])
    labels = np.concatenate([y for _, y, _ in shards])
    positions = np.concatenate([p for _, _, p in shards])
    if len(positions) != count:
        raise RuntimeError(f"pseudo-labels: {len(positions)} of {count} clips were embedded")
    order = np.argsort(positions, kind="stable")
    return embeddings[order], labels[order]
