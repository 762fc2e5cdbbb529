"""The Trainer: builds a run from a Config, owns its stateful parts, and runs the epochs.

    fit(cfg)   # what `python -m audioclf.train` does, on every rank

Set-up order: process group → (resume checkpoint) → seeds → index and split (rank 0 builds the
index cache) → data → model (DDP/SyncBN) → optimizer, schedule, precision, EMA → run directory
and logging → checkpointer. Each epoch: `train_epoch` (micro-batches → update → after-step work
(the EMA, hooks) → a sync every train.log_every_steps), the parameter-consistency check,
validation (of the EMA when on), then save. After the last epoch, checkpoint.average_last
averages the last epochs into avg.pt (`averaging`). The parts that carry state (model,
optimizer, LR schedule, grad scaler, the train loader's position, RNG streams, the EMA, the
counters in `TrainState`) are handed to the `Checkpointer` by name, so saving and resuming are
one call each.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from audioclf import checkpoint, distributed
from audioclf.config import Config, to_dict
from audioclf.data.dataset import AudioDataset, split_datasets
from audioclf.data.index import load_index
from audioclf.data.loader import TrainLoader, loader_options
from audioclf.data.unlabelled import load_unlabelled
from audioclf.fileio import atomic_copy
from audioclf.inference import init_weights
from audioclf.losses import build_loss, final_epochs_start
from audioclf.losses.unlabelled import UnlabelledObjective, ViewsLoss
from audioclf.models import build_net, count_parameters
from audioclf.precision import BackendFlags, configure_backends, resolve_precision
from audioclf.training import averaging
from audioclf.training.compiled import compile_embedder
from audioclf.training.logs import EpochRow, MetricsWriter, setup_logging
from audioclf.training.optim import (
    LRSchedule,
    OptimizerState,
    base_lr,
    build_optimizer,
    param_groups,
)
from audioclf.training.rundir import (
    RunLock,
    StopRequested,
    check_free,
    prepare_run_dir,
    reported,
    resume_point,
)
from audioclf.training.step import EpochResult, NonFiniteGuard, TrainStep
from audioclf.training.trackers import check_tracker, open_tracker
from audioclf.training.unlabelled import PseudoLabelRounds, reference_rows
from audioclf.training.validation import Validator

log = logging.getLogger("audioclf")


@dataclass
class TrainHooks:
    """Callbacks into a run, for tests and tools (production runs pass none)."""

    on_step: Callable[[Trainer], None] | None = None  # after every optimizer step
    on_end: Callable[[Trainer, dict], None] | None = None  # with the summary fit() returns


@dataclass
class TrainState:
    """The run's counters; saved at the top level of every checkpoint. (How far the current
    epoch has been consumed is the train loader's own state.)"""

    epoch: int = 0  # epochs completed (the epoch in progress is this one, 0-based)
    step: int = 0  # optimizer steps taken
    history: list[dict] = field(default_factory=list)  # one EpochRow.as_dict() per epoch
    last_metrics: dict = field(default_factory=dict)  # the latest validation metrics
    averaged: dict = field(default_factory=dict)  # avg.pt's epochs and metrics, once written

    def state_dict(self) -> dict:
        state = {
            "epoch": self.epoch,
            "step": self.step,
            "metrics": self.history,
            "last_metrics": self.last_metrics,
        }
        return {**state, "averaged": self.averaged} if self.averaged else state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.history = list(state.get("metrics", []))
        self.last_metrics = dict(state.get("last_metrics", {}))
        self.averaged = dict(state.get("averaged", {}))


@dataclass(frozen=True)
class FinalEpochs:
    """train.final_epochs (WeSpeaker's large-margin fine-tuning): from epoch `start` (0-based) on,
    training crops of `final_crop` samples (clips.final_crop_seconds) and the final margins
    (losses.build_loss). `start` is train.epochs when it is off."""

    start: int
    crop: int  # samples of a training crop before (clips.crop_seconds)
    final_crop: int

    @classmethod
    def of(cls, cfg: Config) -> FinalEpochs:
        crop = cfg.clips.crop_samples(cfg.features)
        final = cfg.clips.final_crop_seconds
        start = final_epochs_start(cfg)
        return cls(
            cfg.train.epochs if start is None else start,
            crop,
            crop if final is None or start is None else cfg.features.samples(final),
        )

    @property
    def changes_crop(self) -> bool:
        return self.final_crop != self.crop

    def crop_samples(self, epoch: int) -> int:
        return self.final_crop if epoch >= self.start else self.crop


def describe_final_epochs(cfg: Config) -> str:
    """What changes at the start of the final epochs, for train.log."""
    loss, clips, epochs = cfg.loss, cfg.clips, cfg.train.epochs
    changes = []
    if clips.final_crop_seconds is not None:
        changes.append(
            f"training crops of {clips.final_crop_seconds:g} s (clips.final_crop_seconds; "
            f"{clips.crop_seconds:g} s before)"
        )
    if loss.final_margin is not None:
        changes.append(f"triplet margin {loss.final_margin:g} (loss.final_margin; {loss.margin:g})")
    if loss.final_head_margin is not None and cfg.model.head not in ("none", "softmax"):
        changes.append(
            f"head margin {loss.final_head_margin:g} rad (loss.final_head_margin; "
            f"{loss.head_margin:g})"
        )
    final = cfg.train.final_epochs
    span = f"epoch {epochs}" if final == 1 else f"epochs {epochs - final + 1}-{epochs}"
    what = "; ".join(changes) or (
        "nothing changes: set clips.final_crop_seconds, loss.final_margin or loss.final_head_margin"
    )
    return f"train.final_epochs={final} ({span} of {epochs}): {what}"


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def fit(cfg: Config, *, hooks: TrainHooks | None = None, local_rank_arg: int | None = None) -> dict:
    """Train as configured on this rank; returns a summary (run dir, step, metrics, history)."""
    env = distributed.setup(
        strategy=cfg.dist.strategy,
        backend=cfg.dist.backend,
        device=cfg.train.device,
        timeout_minutes=cfg.dist.timeout_minutes,
        local_rank_arg=local_rank_arg,
    )
    trainer = None
    stop = StopRequested(every=max(1, cfg.train.log_every_steps))
    try:
        with stop:
            trainer = Trainer(cfg, env, stop, hooks or TrainHooks())
            return trainer.fit()
    except Exception as exc:
        shown = reported(exc, env, setting_up=trainer is None, stopping=stop.flag)
        if shown is exc:
            raise
        raise shown from exc
    finally:
        if trainer is not None:
            trainer.close()
        distributed.teardown()


class Trainer:
    """One rank's training run. Construction builds (and, when resuming, restores) everything;
    `fit()` runs the remaining epochs."""

    def __init__(
        self, cfg: Config, env: distributed.DistEnv, stop: StopRequested, hooks: TrainHooks
    ):
        self.cfg, self.env, self.stop, self.hooks = cfg, env, stop, hooks
        self.run_dir = Path(cfg.train.runs_dir) / cfg.train.name
        self.lock: RunLock | None = None
        self.backends = BackendFlags.current()  # put back by close()
        setup_logging(None, env.rank)  # console only until the input is known to be valid
        distributed.primary_first(check_free, self.run_dir)  # before reading what it holds
        resume_path, ckpt, resume_notes = resume_point(cfg, self.run_dir)
        seed_everything(cfg.train.seed + env.rank, cfg.train.deterministic)
        # Everything that can refuse the input comes before anything is written.
        self._load_data()
        self.final = FinalEpochs.of(cfg)
        self.loader_options = loader_options(cfg, env.device)
        self.train_loader = TrainLoader.for_run(
            cfg,
            self.train,
            self.train_set,
            rank=env.rank,
            world_size=env.world_size,
            options=self.loader_options,
            crop_samples=self.final.crop_samples if self.final.changes_crop else None,
            unlabelled_clips=len(self.unlabelled) if self.unlabelled else 0,
        )
        self.precision = resolve_precision(cfg.train, env.device)
        net = build_net(cfg, len(self.train.classes))
        init_notes = []
        if cfg.model.init_from and ckpt is None:  # a resume continues its own weights
            init_notes = init_weights(
                net, cfg.model.init_from, self.train.classes, trust=cfg.checkpoint.trust
            )

        check_tracker(cfg, self.run_dir)
        self._prepare_run_dir()
        try:
            for note in resume_notes:
                log.warning(note)
            for note in init_notes:
                log.info(note)
            self._build_run(net, ckpt, resume_path)
        except BaseException:
            self.close()  # a failed set-up leaves the folder free at once
            raise

    def _build_run(self, net: torch.nn.Module, ckpt: dict | None, resume_path: Path | None) -> None:
        cfg, env = self.cfg, self.env
        self._log_data()
        configure_backends(cfg.train, env.device)
        self._build_training(net)
        self.state = TrainState()
        self.metrics = MetricsWriter(self.run_dir, enabled=env.is_primary)
        self.tracker = open_tracker(cfg, self.run_dir, env.is_primary)
        self.validator = Validator(
            cfg,
            env,
            self.val,
            self.val_set,
            loader_options=self.loader_options,
            metrics=self.metrics,
        )
        self.pseudo_labels = self._pseudo_label_rounds()
        self.checkpointer = self._checkpointer()
        self.average = averaging.LastEpochsAverage(cfg, env, self.checkpointer, self.validator)
        if ckpt is not None:
            self.checkpointer.restore(ckpt)
            log.info(
                "resumed from %s at epoch %d, batch %d, step %d",
                resume_path,
                self.state.epoch,
                self.train_loader.position,
                self.state.step,
            )

    def _load_data(self) -> None:
        """The index (rank 0 reads it first and builds its cache; the others then read the
        cache), its train / validation split and their datasets. Collective when distributed."""
        index = distributed.primary_first(load_index, self.cfg.data)
        self.train, self.val, self.train_set, self.val_set = split_datasets(self.cfg, index)
        self.unlabelled = None
        if self.cfg.data.unlabelled:  # rank 0 checks the files; every rank gets the list
            self.unlabelled = distributed.primary_only(
                load_unlabelled, self.cfg.data.unlabelled, self.cfg.features
            )
            clips = self.unlabelled
            self.train_set = self.train_set.with_unlabelled(clips.paths, clips.pack)

    def _build_training(self, net: torch.nn.Module) -> None:
        """The wrapped model, the loss, optimizer, schedule, the step that uses them, the EMA."""
        cfg, env = self.cfg, self.env
        log.info("model %s: %s trainable parameters", cfg.model.name, f"{count_parameters(net):,}")
        self.model = distributed.wrap(
            net,
            env,
            sync_bn=cfg.model.sync_bn,
            find_unused_parameters=cfg.dist.find_unused_parameters,
            autocast_dtype=self.precision.dtype,
        )
        self.loss_fn = build_loss(cfg, items=self.train.codes.item_codes)
        if self.unlabelled:
            self.loss_fn = UnlabelledObjective(
                self.loss_fn,
                ViewsLoss(cfg.unlabelled.temperature),
                views_weight=cfg.unlabelled.views_weight,
                n_labelled=len(self.train),
                n_clips=len(self.unlabelled),
                n_classes=len(self.train.classes),
            )
        self.optimizer = build_optimizer(param_groups(net, cfg.optim), cfg.optim, env.device)
        self.schedule = LRSchedule(
            self.optimizer, cfg.optim, base_lr(cfg.optim, env.world_size), cfg.train.epochs
        )
        log.info(
            "effective lr %.4g = optim.lr %.4g × %.4g (%s scaling, %d ranks, reference %d); "
            "precision %s%s",
            self.schedule.base,
            cfg.optim.lr,
            self.schedule.base / cfg.optim.lr,
            cfg.optim.lr_scaling,
            env.world_size,
            cfg.optim.ref_world_size,
            self.precision.name,
            f" ({self.precision.reason})" if self.precision.reason else "",
        )
        self.guard = NonFiniteGuard(cfg.train.nonfinite_patience)
        self.step = TrainStep(
            self.model,
            self.optimizer,
            self.precision,
            self.loss_fn.objective,
            guard=self.guard,
            accumulate=cfg.train.accumulate,
            max_grad_norm=cfg.optim.max_grad_norm,
            batch_size=self.train_loader.sampler.batch_size,
            placeholder=self.train_set.placeholder(),
        )
        self.ema = averaging.build_ema(cfg, self.model)
        self._compiling = cfg.train.compile  # until the first step has compiled
        if cfg.train.compile:  # in place: the state dict keeps its keys; after the EMA's copy
            compile_embedder(net)  # a batch size or crop length that changes becomes dynamic

    def _checkpointer(self) -> checkpoint.Checkpointer:
        """The run's stateful parts, by name, in one Checkpointer (with "ema" when kept)."""
        cfg, env = self.cfg, self.env
        keep, average = cfg.checkpoint.keep_last, cfg.checkpoint.average_last
        saver = checkpoint.CheckpointSaver(self.run_dir, keep_last=keep, average_last=average)
        if average > keep:
            log.info(
                "checkpoint.average_last=%d: the last %d epoch checkpoints are kept "
                "(checkpoint.keep_last=%d)",
                average,
                average,
                keep,
            )
        states = {
            "model": distributed.unwrap(self.model),
            "optimizer": OptimizerState(self.optimizer),
            "lr_schedule": self.schedule,
            "scaler": checkpoint.ScalerState(self.precision.scaler),
        }
        if self.pseudo_labels is not None:  # before "sampler": the labels change its draw
            states["pseudo_labels"] = self.pseudo_labels
        states |= {
            "sampler": self.train_loader,  # the sampler's state at the loader's position
            "rng": checkpoint.RankRNG(env.rank, env.world_size, env.device),
        }
        if self.ema is not None:  # after "model": a checkpoint without one starts from it
            states["ema"] = self.ema
        if self.loss_fn.memory is not None:  # the cross-batch memory (loss.memory_size)
            states["loss_memory"] = self.loss_fn.memory
        classes, loader = self.train.classes, self.train_loader
        return checkpoint.Checkpointer(
            saver,
            states=states,
            optional=("ema", "loss_memory", "pseudo_labels"),
            flat=[self.state, saver],
            meta=lambda: {
                "config": to_dict(cfg),
                "classes": classes,
                "position": loader.position,
                "world_size": env.world_size,
                "versions": checkpoint.library_versions(),
                **self._unlabelled_record(),
            },
            primary=env.is_primary,
        )

    def _pseudo_label_rounds(self) -> PseudoLabelRounds | None:
        """The pseudo-label rounds over data.unlabelled (None without it)."""
        if not self.unlabelled:
            return None
        cfg, sampler = self.cfg, self.train_loader.sampler
        clips = AudioDataset(
            self.unlabelled.paths,
            np.zeros(len(self.unlabelled), dtype=np.int64),
            cfg.features,
            cfg.clips,
            train=False,
            pack=self.unlabelled.pack,
        )

        rows = reference_rows(self.train.labels(), cfg.sampler.m, cfg.train.seed)
        reference = AudioDataset.from_index(
            self.train.subset(np.isin(np.arange(len(self.train)), rows)), cfg, train=False
        )

        def apply(labels: np.ndarray) -> None:
            sampler.set_pseudo_labels(labels)
            self.loss_fn.set_pseudo_labels(labels)

        return PseudoLabelRounds(
            cfg,
            clips,
            reference,
            labelled_classes=len(self.train.classes),
            apply=apply,
            metrics=self.metrics,
            device=self.env.device,
            loader_options=self.loader_options,
        )

    def _unlabelled_record(self) -> dict:
        """What the checkpoint and the summary say of data.unlabelled (nothing without it)."""
        if not self.unlabelled:
            return {}
        return {"unlabelled": {"source": self.unlabelled.source, "clips": len(self.unlabelled)}}

    # ----------------------------------------------------------------------------- set-up

    def _log_data(self) -> None:
        train, val = self.train, self.val
        log.info(
            "data: %d train samples in %d classes, %d validation samples; %d batches/epoch/rank",
            len(train),
            len(train.classes),
            len(val) if val else 0,
            self.train_loader.sampler.batches_per_epoch,
        )
        if self.unlabelled:
            labelled, clips = self.cfg.unlabelled.batch_rows(
                self.cfg.sampler.batch_size, self.cfg.sampler.m
            )
            every = self.cfg.unlabelled.cluster_every
            log.info(
                "data.unlabelled=%s: %d usable unlabelled clips; a batch holds %d labelled rows "
                "and 2 views of %d clips (unlabelled.share=%g); %s",
                self.unlabelled.source,
                len(self.unlabelled),
                labelled,
                clips,
                self.cfg.unlabelled.share,
                f"pseudo-labels every {every} epochs"
                if every
                else "no pseudo-labels (unlabelled.cluster_every=0)",
            )

    def _prepare_run_dir(self) -> None:
        """The run folder (rank 0 writes it and holds its lock), then logging into it."""
        stale: list[Path] = []
        if self.env.is_primary:
            self.lock, stale = prepare_run_dir(self.run_dir, self.cfg)
        distributed.barrier()
        setup_logging(self.run_dir, self.env.rank)
        log.info(
            "run directory %s (rank 0 of %d, %s, device %s)",
            self.run_dir,
            self.env.world_size,
            self.env.strategy,
            self.env.device,
        )
        if self.env.is_primary and stale:
            log.info(
                "removed %d temporary file(s) of an interrupted write: %s",
                len(stale),
                ", ".join(p.name for p in stale),
            )

    def close(self) -> None:
        """End the tracker run of a run that did not finish; release the run folder (the lock
        goes with the process anyway); put back the TF32 and autotuning flags it found."""
        self.backends.apply()
        if getattr(self, "tracker", None) is not None:
            try:
                self.tracker.finish([])
            except Exception as exc:  # the run's own error is what the user must see
                log.warning("could not end the %s run: %s", self.tracker.kind, exc)
        if self.lock is not None:
            self.lock.release()

    # ----------------------------------------------------------------------------- the loop

    def fit(self) -> dict:
        """Run the remaining epochs; every rank calls it. A stop request ends the run at the
        next step all ranks agree on (mid-epoch: last.pt at that step), or after the epoch
        when it came during the epoch's end (validation, checkpoints)."""
        stopped = False
        if self.final.start < self.state.epoch < self.cfg.train.epochs:  # resumed into them
            log.info(describe_final_epochs(self.cfg))
        for epoch in range(self.state.epoch, self.cfg.train.epochs):
            result = self.train_epoch(epoch)
            if result.stopped:
                self.save_mid_epoch()
            else:
                self.end_epoch(epoch, result)
            stopped = result.stopped or self._stop_agreed()
            if stopped:
                log.info(
                    "stopped on request at epoch %d, step %d; last.pt saved; resume with "
                    "checkpoint.resume=auto",
                    epoch + 1,
                    self.state.step,
                )
                break
        if not stopped and self.average.due(self.state.epoch, self.state.averaged):
            self.average.run(self._validated(), self.state)
            distributed.barrier()
        return self.finish(stopped)

    def _stop_agreed(self) -> bool:
        """Whether some rank was asked to stop (collective: every rank calls it)."""
        vote = torch.tensor(
            [1.0 if self.stop.flag else 0.0], dtype=torch.float64, device=self.env.device
        )
        return bool(distributed.all_reduce_max(vote).item() > 0)

    def train_epoch(self, epoch: int) -> EpochResult:
        """One epoch (or its rest, after a resume): every rank calls it."""
        cfg, state, loader, step = self.cfg, self.state, self.train_loader, self.step
        self._start_epoch(epoch)
        sync_every, first_step = max(1, cfg.train.log_every_steps), state.step
        stopped, start = False, time.perf_counter()
        with self._progress(epoch) as bar:
            for batch, closes_group in loader.micro_batches(cfg.train.accumulate):
                step.micro_batch(batch, sync_grads=closes_group)
                bar.update(1)
                if not closes_group:
                    continue
                self.schedule.apply(state.step, epoch)
                step.update()
                state.step += 1
                if self._compiling:
                    self._compiled(start)
                self._after_step()
                if (state.step - first_step) % sync_every == 0 and self._sync(bar):
                    stopped = True
                    break
        if (state.step - first_step) % sync_every != 0 and not stopped:
            step.sync(False, state.step)  # the epoch's last guard check
        return step.end_epoch(time.perf_counter() - start, stopped=stopped)

    def _compiled(self, start: float) -> None:
        """After the first step of train.compile (the epoch began at `start`): its time is left
        out of samples/s."""
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        seconds = time.perf_counter() - start
        self._compiling = False
        self.step.mark_warmup(seconds)
        log.info(
            "train.compile: the first step took %.1f s with torch.compile (left out of samples/s)",
            seconds,
        )

    def _start_epoch(self, epoch: int) -> None:
        if self.pseudo_labels is not None:  # before the sampler's epoch: it may change its draw
            self.pseudo_labels.start_epoch(epoch, self.model, self.state.step)
        self.train_loader.set_epoch(epoch)
        self.loss_fn.set_epoch(epoch)
        self.step.start_epoch(self.train_set.placeholder(self.final.crop_samples(epoch)))
        if epoch == self.final.start:
            log.info(describe_final_epochs(self.cfg))
        if epoch < self.cfg.optim.freeze_epochs:
            log.info(
                "epoch %d: only the embedding layer (and head) learns (optim.freeze_epochs=%d)",
                epoch + 1,
                self.cfg.optim.freeze_epochs,
            )

    def _progress(self, epoch: int) -> tqdm:
        return tqdm(
            total=len(self.train_loader),
            desc=f"epoch {epoch + 1}/{self.cfg.train.epochs}",
            disable=not self.env.is_primary,
            dynamic_ncols=True,
            mininterval=1.0,
            leave=False,
        )

    def _sync(self, bar: tqdm) -> bool:
        """The host sync (collective): the non-finite guard, the stop vote, the progress bar and
        TensorBoard's learning rate; True when some rank asked to stop."""
        halt, loss = self.step.sync(self.stop.flag, self.state.step)
        lr = max(group["lr"] for group in self.optimizer.param_groups)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        self.metrics.scalar("step/lr", lr, self.state.step)
        return halt

    def _after_step(self) -> None:
        """After every optimizer step (every rank): the EMA, hooks, and what is due now."""
        cfg, step = self.cfg, self.state.step
        if self.ema is not None:
            self.ema.update(step)  # the step is the trainer's: a resume continues the warm-up
        if self.hooks.on_step is not None:
            self.hooks.on_step(self)
        if _due(step, cfg.train.consistency_every_steps):
            distributed.check_parameter_consistency(
                self.model, action=cfg.train.consistency_action, device=self.env.device
            )
        if _due(step, cfg.checkpoint.every_steps):
            self.save_mid_epoch()

    def end_epoch(self, epoch: int, result: EpochResult) -> None:
        """Consistency check, validation, schedule, metrics row, checkpoints (every rank)."""
        cfg, state = self.cfg, self.state
        distributed.check_parameter_consistency(
            self.model, action=cfg.train.consistency_action, device=self.env.device
        )
        state.last_metrics = (
            self.validator.run(self._validated(), epoch=epoch, step=state.step)
            if self._eval_due(epoch)
            else {}
        )
        self.schedule.epoch_end(result.loss)
        state.epoch = epoch + 1
        self.train_loader.end_epoch()
        row = EpochRow(
            epoch=epoch + 1,
            step=state.step,
            train_loss=result.loss,
            lr=self.schedule.lr(state.step, state.epoch),
            samples_per_s=result.samples_per_second,
            epoch_seconds=result.seconds,
            nonfinite_steps=self.guard.total,
            overflow_steps=self.guard.overflow,
            skipped_files=result.skipped_items,
            skipped_batches=result.skipped_batches,
            metrics=state.last_metrics,
        ).as_dict()
        state.history.append(row)
        metric = state.last_metrics.get(cfg.eval.metric)
        self.metrics.epoch_row(row)  # first: the epoch's row survives a checkpoint that fails
        if self.tracker is not None:
            self.tracker.log_epoch(row)
        written = self.checkpointer.save_epoch(epoch + 1, metric)
        if self.env.is_primary:
            self._log_epoch(
                epoch, result, best=self.run_dir / checkpoint.BEST in written and metric is not None
            )
        distributed.barrier()

    def _log_epoch(self, epoch: int, result: EpochResult, *, best: bool) -> None:
        shown = " ".join(f"{k}={v:.4f}" for k, v in self.state.last_metrics.items())
        log.info(
            "epoch %d/%d: loss %.4f, %.1f samples/s (global), %.1f s %s%s",
            epoch + 1,
            self.cfg.train.epochs,
            result.loss,
            result.samples_per_second,
            result.seconds,
            shown,
            " (new best)" if best else "",
        )
        if result.skipped_items:
            log.warning(
                "epoch %d: %d unreadable file(s) skipped (data.skip_bad_files), %d "
                "batch(es) with nothing readable dropped",
                epoch + 1,
                result.skipped_items,
                result.skipped_batches,
            )

    def _validated(self) -> torch.nn.Module:
        """What validation (and so best.pt) judges: the EMA of the weights when kept."""
        return self.model if self.ema is None else self.ema.module

    def _eval_due(self, epoch: int) -> bool:
        every = self.cfg.eval.every
        return every > 0 and ((epoch + 1) % every == 0 or epoch + 1 == self.cfg.train.epochs)

    def save_mid_epoch(self) -> None:
        """last.pt at the current position (every rank calls it; rank 0 writes)."""
        if self.checkpointer.save_last() is not None:
            log.info(
                "saved %s (epoch %d, batch %d, step %d)",
                self.run_dir / checkpoint.LAST,
                self.state.epoch,
                self.train_loader.position,
                self.state.step,
            )
        distributed.barrier()

    def finish(self, stopped: bool) -> dict:
        run_dir, state = self.run_dir, self.state
        if (
            self.env.is_primary
            and not stopped
            and not (run_dir / checkpoint.BEST).exists()
            and (run_dir / checkpoint.LAST).exists()
        ):
            log.info("no validation metric was computed: best.pt is the final epoch")
            atomic_copy(run_dir / checkpoint.LAST, run_dir / checkpoint.BEST)
        self.metrics.close()
        if self.tracker is not None:
            self.tracker.finish([run_dir / checkpoint.BEST, run_dir / checkpoint.AVG])
            self.tracker = None
        distributed.barrier()
        summary = {
            "run_dir": str(run_dir),
            "metrics": state.last_metrics,
            "history": state.history,
            "stopped": stopped,
            "step": state.step,
            "stop_signal": self.stop.signal if stopped else None,
            "world_size": self.env.world_size,
            "average": state.averaged or None,  # checkpoint.average_last: avg.pt's epochs, metrics
            **self._unlabelled_record(),
        }
        if self.hooks.on_end is not None:
            self.hooks.on_end(self, summary)
        return summary


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
