"""The Trainer: builds a run from a Config, owns its stateful parts, and runs the epochs.

    fit(cfg)   # what `python -m audioclf.train` does, on every rank

Set-up order: process group → run directory and logging → (resume checkpoint) → seeds →
index and split (rank 0 builds the index cache) → data → model (DDP/SyncBN) → optimizer,
schedule, precision → checkpointer. Each epoch: train_one_epoch, the parameter-consistency
check, validation, then save. The parts that carry state (model, optimizer, LR schedule,
grad scaler, sampler, RNG streams, the counters in `TrainState`) are handed to the
`Checkpointer` by name, so saving and resuming are one call each.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from audioclf import checkpoint, distributed
from audioclf.cli import AlreadyReported, is_user_error, one_line
from audioclf.config import Config, architecture, config_from_dict, save_config, to_dict
from audioclf.data.augment import Augmenter
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index, split_index, stratified_subset
from audioclf.data.loader import SeededBatches, build_train_loader, loader_kwargs
from audioclf.engine import EpochResult, NonFiniteGuard, train_one_epoch
from audioclf.fileio import (
    DiskWriteError,
    atomic_copy,
    remove_stale_temps,
    write_failure_message,
)
from audioclf.inference import extract_embeddings, init_weights
from audioclf.logs import MetricsWriter, log_failure_to_file, setup_logging
from audioclf.losses import build_loss
from audioclf.metrics import RETRIEVAL_KEYS, retrieval_summary
from audioclf.models import build_net, count_parameters
from audioclf.optim import LRSchedule, OptimizerState, base_lr, build_optimizer
from audioclf.precision import configure_backends, resolve_precision
from audioclf.sampler import MPerClassSampler

log = logging.getLogger("audioclf")


class StopRequested:
    """SIGTERM / SIGINT set a flag; the loop finishes the step, saves last.pt and exits 0."""

    def __init__(self):
        self.flag = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test thread)
                pass
        return self

    def _handle(self, signum, frame):
        if not self.flag:
            log.warning("received %s: stopping at the next step boundary all ranks agree on, "
                        "then saving last.pt", signal.Signals(signum).name)
        self.flag = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainHooks:
    """Callbacks into a run, for tests and tools (production runs pass none)."""

    on_step: Callable[[Trainer], None] | None = None  # after every optimizer step
    on_end: Callable[[Trainer, dict], None] | None = None  # with the summary fit() returns


@dataclass
class TrainState:
    """The run's counters; saved at the top level of every checkpoint."""

    epoch: int = 0  # epochs completed (the epoch in progress is this one, 0-based)
    position: int = 0  # batches of that epoch consumed
    step: int = 0  # optimizer steps taken
    history: list[dict] = field(default_factory=list)  # one metrics row per epoch
    last_metrics: dict = field(default_factory=dict)  # the latest validation metrics

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "step": self.step,
                "metrics": self.history, "last_metrics": self.last_metrics}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.step = state["epoch"], state["position"], state["step"]
        self.history = list(state.get("metrics", []))
        self.last_metrics = dict(state.get("last_metrics", {}))


class _SamplerAtPosition:
    """The sampler's resume point at the trainer's position in the epoch; with `restart` a
    mid-epoch checkpoint starts its epoch again (checkpoint.restart_epoch)."""

    def __init__(self, batches: SeededBatches, state: TrainState, restart: bool = False):
        self.batches, self.state, self.restart = batches, state, restart

    def state_dict(self) -> dict:
        return self.batches.state_dict(self.state.position)

    def load_state_dict(self, state: dict) -> None:
        if not state["position"] or self.restart:  # from the start of an epoch: nothing to load
            return
        try:
            self.batches.load_state_dict(state)
        except ValueError as exc:
            raise checkpoint.CheckpointError(
                f"the checkpoint was written in the middle of epoch {state['epoch'] + 1} (batch "
                f"{state['position']}) and cannot continue that epoch here ({exc}); set "
                "checkpoint.restart_epoch=true to resume from the start of the epoch"
            ) from None


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


@dataclass
class RunData:
    train: Index
    val: Index | None
    train_set: AudioDataset
    val_set: AudioDataset | None


def build_data(cfg: Config) -> RunData:
    """The index (rank 0 reads it first and builds its cache; the others then read the cache)
    and the train / validation datasets. Collective when distributed."""
    index = distributed.primary_first(load_index, cfg.data)
    splits = split_index(index, cfg.data)
    train, val = splits["train"], splits.get(cfg.eval.split)
    if len(train) == 0:
        raise ValueError(f"{index.source}: the train split is empty; check data.split_column / "
                         "data.val_ratio")
    augment = Augmenter(cfg.augment, cfg.features, cfg.clips.crop_samples(cfg.features))
    train_set = AudioDataset.from_index(train, cfg, train=True, augment=augment)
    if val is None or len(val) < 2:
        return RunData(train, None, train_set, None)
    return RunData(train, val, train_set, AudioDataset.from_index(val, cfg, train=False))


def fit(cfg: Config, *, hooks: TrainHooks | None = None, local_rank_arg: int | None = None) -> dict:
    """Train as configured on this rank; returns a summary (run dir, step, metrics, history)."""
    env = distributed.setup(strategy=cfg.dist.strategy, backend=cfg.dist.backend,
                            device=cfg.train.device, timeout_minutes=cfg.dist.timeout_minutes,
                            local_rank_arg=local_rank_arg)
    trainer = None
    stop = StopRequested()
    try:
        with stop:
            trainer = Trainer(cfg, env, stop, hooks or TrainHooks())
            return trainer.fit()
    except Exception as exc:
        reported = _reported(exc, env, setting_up=trainer is None, stopping=stop.flag)
        if reported is exc:
            raise
        raise reported from exc
    finally:
        distributed.teardown()


def _reported(exc: Exception, env: distributed.DistEnv, *, setting_up: bool,
              stopping: bool) -> Exception:
    """Log a rank's failure once and decide what its console shows.

    The rank that failed says why (and leaves its reason for the others, whose train.log lines
    name it); the ranks that lost it say nothing more, unless it vanished without a word (rank
    0 then says so). Set-up errors are the same on every rank (same config, same sheet): rank 0
    alone prints them.
    """
    if distributed.is_peer_failure(exc):
        exc = distributed.peer_failure(exc)
    else:
        distributed.announce_failure(one_line(exc))
    log_failure_to_file(exc, env.rank, traceback=not is_user_error(exc))
    if stopping:
        log.error("last.pt was not updated by the stop request: %s", one_line(exc))
    peer = isinstance(exc, distributed.PeerFailure)
    quiet = (peer and exc.reported) or (not env.is_primary and (setting_up or peer))
    return AlreadyReported() if quiet else exc


class Trainer:
    """One rank's training run. Construction builds (and, when resuming, restores) everything;
    `fit()` runs the remaining epochs."""

    def __init__(self, cfg: Config, env: distributed.DistEnv, stop: StopRequested,
                 hooks: TrainHooks):
        self.cfg, self.env, self.stop, self.hooks = cfg, env, stop, hooks
        self.run_dir = Path(cfg.train.runs_dir) / cfg.train.name
        setup_logging(None, env.rank)  # console only until the input is known to be valid
        resume_path, ckpt, resume_notes = self._resume_checkpoint()
        seed_everything(cfg.train.seed + env.rank, cfg.train.deterministic)
        # Everything that can refuse the input comes before anything is written.
        self.data = build_data(cfg)
        train = self.data.train
        sampler = MPerClassSampler(
            train.codes.class_codes, train.codes.item_codes,
            batch_size=cfg.sampler.batch_size, m=cfg.sampler.m, rank=env.rank,
            world_size=env.world_size, seed=cfg.train.seed, split=cfg.sampler.split,
            small_classes=cfg.sampler.small_classes,
        )
        self.precision = resolve_precision(cfg.train, env.device)
        net = build_net(cfg, len(train.classes))
        init_notes = []
        if cfg.model.init_from and ckpt is None:  # a resume continues its own weights
            init_notes = init_weights(net, cfg.model.init_from, train.classes)

        self._prepare_run_dir()
        for note in resume_notes:
            log.warning(note)
        for note in init_notes:
            log.info(note)
        self.batches = SeededBatches(sampler, cfg.train.seed)
        self.loader_options = loader_kwargs(cfg.data.num_workers, cfg.data.pin_memory,
                                            cfg.data.persistent_workers, cfg.data.prefetch_factor,
                                            env.device)
        self.train_loader = build_train_loader(self.data.train_set, self.batches,
                                               seed=cfg.train.seed, **self.loader_options)
        log.info("data: %d train samples in %d classes, %d validation samples; %d batches/epoch/"
                 "rank", len(train), len(train.classes), len(self.data.val) if self.data.val else 0,
                 sampler.batches_per_epoch)
        configure_backends(cfg.train, env.device)
        log.info("model %s: %s trainable parameters", cfg.model.name, f"{count_parameters(net):,}")
        self.model = distributed.wrap(net, env, sync_bn=cfg.model.sync_bn,
                                      find_unused_parameters=cfg.dist.find_unused_parameters,
                                      autocast_dtype=self.precision.dtype)
        self.loss_fn = build_loss(cfg)
        self.optimizer = build_optimizer(_param_groups(net, cfg), cfg.optim, env.device)
        self.schedule = LRSchedule(self.optimizer, cfg.optim, base_lr(cfg.optim, env.world_size),
                                   cfg.train.epochs)
        log.info("effective lr %.4g = optim.lr %.4g × %.4g (%s scaling, %d ranks, reference %d); "
                 "precision %s", self.schedule.base, cfg.optim.lr, self.schedule.base / cfg.optim.lr,
                 cfg.optim.lr_scaling, env.world_size, cfg.optim.ref_world_size,
                 self.precision.name)

        self.val_positions = self._validation_positions()
        self._said_leave_one_out = False
        self.state = TrainState()
        self.guard = NonFiniteGuard(cfg.train.nonfinite_patience)
        self.metrics = MetricsWriter(self.run_dir, enabled=env.is_primary)
        saver = checkpoint.CheckpointSaver(self.run_dir, keep_last=cfg.checkpoint.keep_last)
        self.checkpointer = checkpoint.Checkpointer(
            saver,
            states={
                "model": distributed.unwrap(self.model),
                "optimizer": OptimizerState(self.optimizer),
                "lr_schedule": self.schedule,
                "scaler": checkpoint.ScalerState(self.precision.scaler),
                "sampler": _SamplerAtPosition(self.batches, self.state,
                                              restart=cfg.checkpoint.restart_epoch),
                "rng": checkpoint.RankRNG(env.rank, env.world_size, env.device),
            },
            flat=[self.state, saver],
            meta=lambda: {"config": to_dict(cfg), "classes": train.classes,
                          "world_size": env.world_size, "versions": checkpoint.library_versions()},
            primary=env.is_primary,
        )
        if ckpt is not None:
            self.checkpointer.restore(ckpt)
            if cfg.checkpoint.restart_epoch and self.state.position:
                log.info("checkpoint.restart_epoch: epoch %d starts again from its first batch "
                         "(the checkpoint was at batch %d)", self.state.epoch + 1,
                         self.state.position)
                self.state.position = 0
            log.info("resumed from %s at epoch %d, batch %d, step %d", resume_path,
                     self.state.epoch, self.state.position, self.state.step)

    # ----------------------------------------------------------------------------- set-up

    def _resume_checkpoint(self) -> tuple[Path | None, dict | None, list[str]]:
        """The checkpoint to resume from (checkpoint.resume), and notes for train.log.

        The model and features settings must be the checkpoint's: a difference is refused with
        the keys named, unless checkpoint.resume_strict=false, which takes the checkpoint's.
        """
        cfg = self.cfg
        path = checkpoint.resolve_resume(cfg.checkpoint.resume, self.run_dir)
        if path is None and (self.run_dir / checkpoint.LAST).exists():
            raise ValueError(
                f"{self.run_dir} already holds a run ({checkpoint.LAST}); continue it with "
                "checkpoint.resume=auto, or start a new one with another train.name (or delete "
                "the folder)"
            )
        if path is None:
            return None, None, []
        ckpt = checkpoint.load(path)
        saved = config_from_dict(ckpt["config"])
        changed = [f"{key} {old!r} (now {new!r})"
                   for key, (old, new) in _differences(architecture(saved), architecture(cfg)).items()]
        notes = []
        if changed and cfg.checkpoint.resume_strict:
            raise checkpoint.CheckpointError(
                f"{path} was trained with other settings: {'; '.join(changed[:6])}"
                f"{' and more' if len(changed) > 6 else ''}. Resume with the run's own settings, "
                "start a new run (another train.name), or set checkpoint.resume_strict=false to "
                "continue with the checkpoint's"
            )
        if changed:
            notes.append(f"resuming {path} with its own settings, not the requested "
                         f"({'; '.join(changed)}): checkpoint.resume_strict=false")
        cfg.model, cfg.features = saved.model, saved.features  # the architecture
        return path, ckpt, notes

    def _prepare_run_dir(self) -> None:
        stale: list[Path] = []
        if self.env.is_primary:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DiskWriteError(exc.errno, write_failure_message(
                    self.run_dir, exc.strerror or str(exc))) from exc
            stale = remove_stale_temps(self.run_dir)  # left by a process killed mid-write
            save_config(self.cfg, self.run_dir / "config.yaml")
        distributed.barrier()
        setup_logging(self.run_dir, self.env.rank)
        log.info("run directory %s (rank 0 of %d, %s, device %s)", self.run_dir,
                 self.env.world_size, self.env.strategy, self.env.device)
        if self.env.is_primary and stale:
            log.info("removed %d temporary file(s) of an interrupted write: %s", len(stale),
                     ", ".join(p.name for p in stale))

    # ----------------------------------------------------------------------------- the loop

    def fit(self) -> dict:
        """Run the remaining epochs; every rank calls it."""
        stopped = False
        for epoch in range(self.state.epoch, self.cfg.train.epochs):
            result = self.train_epoch(epoch)
            if result.stopped:
                stopped = True
                self.save_mid_epoch()
                log.info("stopped on request at epoch %d, step %d; resume with "
                         "checkpoint.resume=auto", epoch + 1, self.state.step)
                break
            self.end_epoch(epoch, result)
        return self.finish(stopped)

    def train_epoch(self, epoch: int) -> EpochResult:
        cfg = self.cfg
        self.batches.set_epoch(epoch)
        self.loss_fn.set_epoch(epoch)
        if epoch < cfg.optim.freeze_epochs:
            log.info("epoch %d: only the embedding layer (and head) learns "
                     "(optim.freeze_epochs=%d)", epoch + 1, cfg.optim.freeze_epochs)
        return train_one_epoch(
            self.model, self.train_loader, self._loss, self.optimizer, self.precision,
            set_lr=lambda step: self.schedule.apply(step, epoch), accumulate=cfg.train.accumulate,
            max_grad_norm=cfg.optim.max_grad_norm, guard=self.guard,
            start_batch=self.state.position, limit_batches=cfg.train.limit_batches,
            global_step=self.state.step, on_step=self._after_step,
            should_stop=lambda: self.stop.flag, sync_every=cfg.train.log_every_steps,
            batch_size=cfg.sampler.batch_size, placeholder=self.data.train_set.placeholder(),
            progress=self.env.is_primary, description=f"epoch {epoch + 1}/{cfg.train.epochs}",
        )

    def _loss(self, output, labels):
        embeddings, logits = output
        return self.loss_fn(embeddings, labels, logits)

    def _after_step(self, step: int, position: int) -> None:
        """After every optimizer step (every rank): hooks, and what is due at this step."""
        cfg = self.cfg
        self.state.step, self.state.position = step, position
        if self.hooks.on_step is not None:
            self.hooks.on_step(self)
        if _due(step, cfg.train.consistency_every_steps):
            distributed.check_parameter_consistency(self.model, action=cfg.train.consistency_action,
                                                    device=self.env.device)
        if _due(step, cfg.train.log_every_steps):
            self.metrics.scalar("step/lr", self.optimizer.param_groups[0]["lr"], step)
        if _due(step, cfg.checkpoint.every_steps):
            self.save_mid_epoch()

    def request_stop(self) -> None:
        """Finish the current step, save last.pt and end fit() (as SIGTERM does)."""
        self.stop.flag = True

    def end_epoch(self, epoch: int, result: EpochResult) -> None:
        """Consistency check, validation, schedule, metrics row, checkpoints (every rank)."""
        cfg, state = self.cfg, self.state
        distributed.check_parameter_consistency(self.model, action=cfg.train.consistency_action,
                                                device=self.env.device)
        state.last_metrics = self.validate() if self._eval_due(epoch) else {}
        self.schedule.epoch_end(result.loss)
        state.epoch, state.position = epoch + 1, 0
        row = {
            "epoch": epoch + 1, "step": state.step, "train_loss": result.loss,
            "lr": self.schedule.apply(state.step, state.epoch),
            "samples_per_s": result.samples_per_second, "epoch_seconds": result.seconds,
            "nonfinite_steps": self.guard.total, "overflow_steps": self.guard.overflow,
            "skipped_files": result.skipped_items, "skipped_batches": result.skipped_batches,
            **state.last_metrics,
        }
        state.history.append(row)
        metric = state.last_metrics.get(cfg.eval.metric)
        self.metrics.epoch_row(row)  # first: the epoch's row survives a checkpoint that fails
        written = self.checkpointer.save_epoch(epoch + 1, metric)
        if self.env.is_primary:
            shown = " ".join(f"{k}={v:.4f}" for k, v in state.last_metrics.items())
            best = self.run_dir / checkpoint.BEST in written and metric is not None
            log.info("epoch %d/%d: loss %.4f, %.1f samples/s (global), %.1f s %s%s", epoch + 1,
                     cfg.train.epochs, result.loss, row["samples_per_s"], result.seconds, shown,
                     " (new best)" if best else "")
            if result.skipped_items:
                log.warning("epoch %d: %d unreadable file(s) skipped (data.skip_bad_files), %d "
                            "batch(es) with nothing readable dropped", epoch + 1,
                            result.skipped_items, result.skipped_batches)
        distributed.barrier()

    def _eval_due(self, epoch: int) -> bool:
        every = self.cfg.eval.every
        return every > 0 and ((epoch + 1) % every == 0 or epoch + 1 == self.cfg.train.epochs)

    def save_mid_epoch(self) -> None:
        """last.pt at the current position (every rank calls it; rank 0 writes)."""
        state = self.state
        if self.checkpointer.save_last() is not None:
            log.info("saved %s (epoch %d, batch %d, step %d)", self.run_dir / checkpoint.LAST,
                     state.epoch, state.position, state.step)
        distributed.barrier()

    def validate(self) -> dict[str, float]:
        """Cross-item retrieval metrics on the validation split, on rank 0 ({} elsewhere).

        A query may not retrieve clips of its own item (recording). Every rank must call it:
        rank 0 embeds alone while the others wait at a barrier (dist.timeout_minutes must cover
        it), or with eval.distributed every rank embeds a shard and rank 0 gathers them.
        eval.max_samples restricts it to a fixed class-stratified subset.
        """
        val_set, env = self.data.val_set, self.env
        if val_set is None:
            return {}
        sharded = self.cfg.eval.distributed and env.distributed
        if not sharded and not env.is_primary:
            distributed.barrier()
            return {}
        positions = self.val_positions
        if sharded:
            positions = positions[env.rank::env.world_size]
        emb, labels, seen = extract_embeddings(
            self.model, val_set, batch_size=self.cfg.eval.batch_size, device=env.device,
            positions=positions, loader_options=self.loader_options, precision=self.precision,
            progress=env.is_primary, description="validate")
        if sharded:
            parts = distributed.gather_to_primary((emb, labels, seen))
            if not env.is_primary:
                return {}
            emb = np.concatenate([e for e, lab, _ in parts if len(lab)])
            labels = np.concatenate([lab for _, lab, _ in parts])
            seen = np.concatenate([s for _, _, s in parts])
        items = self.data.val.codes.item_codes[seen]
        summary = retrieval_summary(emb, labels, items, device=env.device)
        if not sharded:
            distributed.barrier()  # the other ranks wait here
        if summary and not summary["cross_item"] and not self._said_leave_one_out:
            self._said_leave_one_out = True
            log.warning("validation: no class has clips of two items (recordings), so the "
                        "metrics are leave-one-out: a clip may retrieve clips of its own item")
        val = self.data.val  # a class-stratified sample for TensorBoard's projector (rank 0)
        self.metrics.projector(emb, np.asarray(val.classes)[labels],
                               val.table["item"].to_numpy()[seen], epoch=self.state.epoch + 1,
                               step=self.state.step)
        return {k: summary[k] for k in RETRIEVAL_KEYS if k in summary}

    def _validation_positions(self) -> np.ndarray:
        """All validation rows, or a fixed class-stratified subset (eval.max_samples)."""
        val, limit = self.data.val, self.cfg.eval.max_samples
        if val is None:
            return np.zeros(0, dtype=np.int64)
        if not limit or limit >= len(val):
            return np.arange(len(val))
        log.info("validation on %d of %d samples (eval.max_samples, class-stratified)", limit,
                 len(val))
        return stratified_subset(val.codes.class_codes, limit, self.cfg.train.seed)

    def finish(self, stopped: bool) -> dict:
        run_dir, state = self.run_dir, self.state
        if self.env.is_primary and not stopped and not (run_dir / checkpoint.BEST).exists() \
                and (run_dir / checkpoint.LAST).exists():
            log.info("no validation metric was computed: best.pt is the final epoch")
            atomic_copy(run_dir / checkpoint.LAST, run_dir / checkpoint.BEST)
        self.metrics.close()
        distributed.barrier()
        summary = {"run_dir": str(run_dir), "metrics": state.last_metrics,
                   "history": state.history, "stopped": stopped, "step": state.step,
                   "world_size": self.env.world_size}
        if self.hooks.on_end is not None:
            self.hooks.on_end(self, summary)
        return summary


def _param_groups(net: torch.nn.Module, cfg: Config) -> list:
    """All parameters; with optim.freeze_epochs, in two groups: the embedding layer and head
    ("output"), and the rest ("body"), which LRSchedule keeps at lr 0 while the freeze lasts."""
    if not cfg.optim.freeze_epochs:
        return list(net.parameters())
    output = list(net.embedder.embedding.parameters())
    output += list(net.head.parameters()) if net.head is not None else []
    chosen = {id(p) for p in output}
    body = [p for p in net.parameters() if id(p) not in chosen]
    return [{"params": body, "name": "body"}, {"params": output, "name": "output"}]


def _differences(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = {}
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out[f"{prefix}{key}"] = (a, b)
    return dict(sorted(out.items()))


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
