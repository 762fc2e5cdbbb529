"""fit(): build everything from a Config and run the epochs — the body of `audioclf.train`.

Setup order: process group → run directory and logging → (resume checkpoint) → seeds →
index and split (rank 0 builds the index cache) → data → model (DDP/SyncBN) → optimizer,
schedule, precision → epochs: train_one_epoch, consistency check, rank-0 validation, checkpoint.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from audioclf import checkpoint, distributed
from audioclf.config import Config, config_from_dict, save_config, to_dict
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index_distributed, split_index
from audioclf.data.loader import SeededBatches, build_eval_loader, build_train_loader, loader_kwargs
from audioclf.engine import (
    LRSchedule,
    NonFiniteGuard,
    build_optimizer,
    embed_for_validation,
    lr_scale,
    resolve_precision,
    retrieval_summary,
    train_one_epoch,
    validate,
)
from audioclf.fileio import atomic_copy
from audioclf.logs import MetricsWriter, log_failure_to_file, setup_logging
from audioclf.losses import TripletLoss
from audioclf.models import EmbeddingNet, FeatureFrontend, build_model, count_parameters
from audioclf.sampler import MPerClassSampler

log = logging.getLogger("audioclf")

# Test-only fault injection: crash rank 0 at a global step (first launch only), or behave as if
# SIGTERM arrived at a global step.
CRASH_ENV = "AUDIOCLF_TEST_CRASH_AT_STEP"
STOP_ENV = "AUDIOCLF_TEST_STOP_AT_STEP"


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
            log.warning("received %s: finishing the current step, then saving last.pt",
                        signal.Signals(signum).name)
        self.flag = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
    index = load_index_distributed(cfg.data)
    splits = split_index(index, cfg.data)
    train, val = splits["train"], splits.get(cfg.eval.split)
    if len(train) == 0:
        raise ValueError(f"{index.source}: the train split is empty; check data.split_column / "
                         "data.val_ratio")
    table = train.table
    train_set = AudioDataset(table["path"].tolist(), train.labels(), cfg.features, train=True,
                             rows=table["row"].tolist(), skip_bad_files=cfg.data.skip_bad_files)
    val_set = None
    if val is not None and len(val) >= 2:
        val_set = AudioDataset(val.table["path"].tolist(), val.labels(), cfg.features,
                               train=False, rows=val.table["row"].tolist(),
                               skip_bad_files=cfg.data.skip_bad_files)
    else:
        val = None
    return RunData(train, val, train_set, val_set)


def build_net(cfg: Config, num_train_classes: int) -> EmbeddingNet:
    frontend = FeatureFrontend(cfg.features)
    embedder = build_model(cfg.model, cfg.features.n_mels)
    num_classes = num_train_classes if cfg.loss.ce_weight > 0 else 0
    return EmbeddingNet(frontend, embedder, num_classes=num_classes)


def evaluate_on_ranks(model, data: RunData, cfg: Config, env: distributed.DistEnv, precision,
                      kwargs: dict) -> dict[str, float]:
    """Rank-0 validation (others wait at the barrier), or sharded with eval.distributed."""
    if data.val_set is None:
        return {}
    n = len(data.val_set)
    if cfg.eval.distributed and env.distributed:
        positions = list(range(env.rank, n, env.world_size))
        loader = build_eval_loader(data.val_set, positions, batch_size=cfg.eval.batch_size, **kwargs)
        emb, labels, _ = embed_for_validation(model, loader, precision, progress=env.is_primary)
        parts = distributed.gather_objects((emb, labels))
        if not env.is_primary:
            return {}
        emb = np.concatenate([e for e, lab in parts if len(lab)])
        return retrieval_summary(emb, np.concatenate([lab for _, lab in parts]), precision.device)
    metrics = {}
    if env.is_primary:
        loader = build_eval_loader(data.val_set, batch_size=cfg.eval.batch_size, **kwargs)
        metrics = validate(model, loader, precision, progress=True)
    distributed.barrier()  # other ranks wait here; dist.timeout_minutes must cover validation
    return metrics


def fit(cfg: Config, *, local_rank_arg: int | None = None) -> dict:
    """Train as configured; returns a summary (run dir, last metrics). Used by train.py and tests."""
    env = distributed.setup(strategy=cfg.dist.strategy, backend=cfg.dist.backend,
                            device=cfg.train.device, timeout_minutes=cfg.dist.timeout_minutes,
                            local_rank_arg=local_rank_arg)
    try:
        with StopRequested() as stop:
            return _fit(cfg, env, stop)
    except Exception as exc:
        log_failure_to_file(exc, env.rank)  # every rank's traceback lands in train.log
        raise
    finally:
        distributed.teardown()


def _fit(cfg: Config, env: distributed.DistEnv, stop: StopRequested) -> dict:
    run_dir = Path(cfg.train.runs_dir) / cfg.train.name
    setup_logging(None, env.rank)  # console only until the input is known to be valid
    resume_path = checkpoint.resolve_resume(cfg.checkpoint.resume, run_dir)
    if resume_path is None and (run_dir / checkpoint.LAST).exists():
        raise ValueError(
            f"{run_dir} already holds a run ({checkpoint.LAST}); continue it with "
            "checkpoint.resume=auto, or start a new one with another train.name (or delete the "
            "folder)"
        )
    ckpt = checkpoint.load(resume_path) if resume_path is not None else None
    if ckpt is not None:
        # The architecture comes from the checkpoint, not from the flags.
        saved = config_from_dict(ckpt["config"])
        if (saved.model, saved.features) != (cfg.model, cfg.features):
            log.warning("resuming: model and features settings taken from %s", resume_path)
        cfg.model, cfg.features = saved.model, saved.features
    seed_everything(cfg.train.seed + env.rank, cfg.train.deterministic)
    data = build_data(cfg)  # validates the index: a bad sheet fails before anything is written

    if env.is_primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    distributed.barrier()
    setup_logging(run_dir, env.rank)
    log.info("run directory %s (rank 0 of %d, %s, device %s)", run_dir, env.world_size,
             env.strategy, env.device)
    sampler = MPerClassSampler(
        data.train.table["cls"].to_numpy(), data.train.table["item"].to_numpy(),
        batch_size=cfg.sampler.batch_size, m=cfg.sampler.m, rank=env.rank,
        world_size=env.world_size, seed=cfg.train.seed, split=cfg.sampler.split,
        small_classes=cfg.sampler.small_classes,
    )
    batches = SeededBatches(sampler, cfg.train.seed)
    kwargs = loader_kwargs(cfg.data.num_workers, cfg.data.pin_memory, cfg.data.persistent_workers,
                           cfg.data.prefetch_factor, env.device)
    train_loader = build_train_loader(data.train_set, batches, seed=cfg.train.seed, **kwargs)
    log.info("data: %d train samples in %d classes, %d validation samples; %d batches/epoch/rank",
             len(data.train), len(data.train.classes), len(data.val) if data.val else 0,
             sampler.batches_per_epoch)

    net = build_net(cfg, len(data.train.classes))
    if ckpt is not None:
        net.load_state_dict(ckpt["model"])
    if env.is_primary:
        log.info("model %s: %s trainable parameters\n%s", cfg.model.name,
                 f"{count_parameters(net):,}", net)
    model = distributed.wrap(net, env, sync_bn=cfg.model.sync_bn,
                             find_unused_parameters=cfg.dist.find_unused_parameters)
    loss_fn_core = TripletLoss(cfg.loss)

    def loss_fn(output, labels):
        embeddings, logits = output
        return loss_fn_core(embeddings, labels, logits)

    scale = lr_scale(env.world_size, cfg.optim.ref_world_size, cfg.optim.lr_scaling)
    lr = cfg.optim.lr * scale
    optimizer = build_optimizer(model.parameters(), cfg.optim, lr, env.device)
    schedule = LRSchedule(optimizer, cfg.optim, lr, cfg.train.epochs)
    precision = resolve_precision(cfg.train, env.device)
    log.info("effective lr %.4g = optim.lr %.4g × %.4g (%s scaling, %d ranks, reference %d); "
             "precision %s", lr, cfg.optim.lr, scale, cfg.optim.lr_scaling, env.world_size,
             cfg.optim.ref_world_size, precision.name)

    saver = checkpoint.CheckpointSaver(run_dir, keep_last=cfg.checkpoint.keep_last)
    history: list[dict] = []
    start_epoch, start_position, global_step = 0, 0, 0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        schedule.load_state_dict(ckpt["lr_schedule"])
        precision.scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_position = ckpt["epoch"], ckpt["position"]
        global_step = ckpt["step"]
        history = list(ckpt.get("metrics", []))
        saver.best_metric = ckpt.get("best_metric")
        rng = ckpt.get("rng") or []
        if len(rng) == env.world_size:
            checkpoint.set_rng_state(rng[env.rank])
        else:
            log.warning("resuming with %d ranks from a %d-rank checkpoint: random streams are "
                        "reseeded, so the run is not bit-identical", env.world_size, len(rng))
        log.info("resumed from %s at epoch %d, batch %d, step %d", resume_path, start_epoch,
                 start_position, global_step)

    metrics_writer = MetricsWriter(run_dir, enabled=env.is_primary)
    guard = NonFiniteGuard(cfg.train.nonfinite_patience)
    crash_at = int(os.environ.get(CRASH_ENV, "0"))
    stop_at = int(os.environ.get(STOP_ENV, "0"))
    first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    classes = data.train.classes

    def make_state(epoch: int, position: int, step: int, last_metrics: dict) -> dict:
        rng_states = distributed.gather_objects(checkpoint.rng_state())
        return {
            "model": distributed.unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_schedule": schedule.state_dict(),
            "scaler": precision.scaler.state_dict(),
            "epoch": epoch,
            "position": position,
            "step": step,
            "sampler": batches.state_dict(position),
            "rng": rng_states,
            "config": to_dict(cfg),
            "metrics": history,
            "last_metrics": last_metrics,
            "best_metric": saver.best_metric,
            "classes": classes,
            "world_size": env.world_size,
            "versions": checkpoint.library_versions(),
        }

    def save_mid_epoch(epoch: int, position: int, step: int) -> None:
        state = make_state(epoch, position, step, {})
        if env.is_primary:
            saver.save_last(state)
            log.info("saved %s (epoch %d, batch %d, step %d)", run_dir / checkpoint.LAST, epoch,
                     position, step)
        distributed.barrier()

    last_metrics: dict = {}
    stopped = False
    for epoch in range(start_epoch, cfg.train.epochs):
        batches.set_epoch(epoch)
        if epoch == start_epoch and start_position:
            batches.load_state_dict(ckpt["sampler"])

        def on_step(step: int, position: int, epoch=epoch) -> bool:
            if crash_at and step == crash_at and first_launch and env.rank == 0:
                log.error("test fault injection: crashing at step %d", step)
                os._exit(17)
            if stop_at and step == stop_at:
                stop.flag = True
            if cfg.train.consistency_every_steps and step % cfg.train.consistency_every_steps == 0:
                distributed.check_parameter_consistency(model, action=cfg.train.consistency_action,
                                                        device=env.device)
            if cfg.train.log_every_steps and step % cfg.train.log_every_steps == 0:
                metrics_writer.scalar("step/lr", optimizer.param_groups[0]["lr"], step)
            halt = distributed.any_rank(stop.flag, device=env.device)
            if halt or (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0):
                save_mid_epoch(epoch, position, step)
            return halt

        result = train_one_epoch(
            model, train_loader, loss_fn, optimizer, precision,
            schedule=schedule, accumulate=cfg.train.accumulate,
            max_grad_norm=cfg.optim.max_grad_norm, guard=guard,
            start_batch=start_position if epoch == start_epoch else 0,
            limit_batches=cfg.train.limit_batches, global_step=global_step, on_step=on_step,
            progress=env.is_primary, description=f"epoch {epoch + 1}/{cfg.train.epochs}",
        )
        global_step += result.steps
        if result.stopped:
            stopped = True
            log.info("stopped on request at epoch %d, step %d; resume with checkpoint.resume=auto",
                     epoch + 1, global_step)
            break
        distributed.check_parameter_consistency(model, action=cfg.train.consistency_action,
                                                device=env.device)
        eval_due = cfg.eval.every > 0 and ((epoch + 1) % cfg.eval.every == 0
                                           or epoch + 1 == cfg.train.epochs)
        last_metrics = evaluate_on_ranks(model, data, cfg, env, precision, kwargs) if eval_due else {}
        schedule.epoch_end(result.loss)
        row = {
            "epoch": epoch + 1, "step": global_step, "train_loss": result.loss,
            "lr": optimizer.param_groups[0]["lr"],
            "samples_per_s": result.samples / max(result.seconds, 1e-9),
            "epoch_seconds": result.seconds, "nonfinite_steps": guard.total, **last_metrics,
        }
        history.append(row)
        metric = last_metrics.get(cfg.eval.metric)
        state = make_state(epoch + 1, 0, global_step, last_metrics)
        if env.is_primary:
            written = saver.save_epoch(state, epoch + 1, metric)
            metrics_writer.epoch_row(row)
            shown = " ".join(f"{k}={v:.4f}" for k, v in last_metrics.items())
            log.info("epoch %d/%d: loss %.4f, %.1f samples/s (global), %.1f s %s%s",
                     epoch + 1, cfg.train.epochs, result.loss, row["samples_per_s"],
                     result.seconds, shown, " (new best)" if run_dir / "best.pt" in written
                     and metric is not None else "")
        distributed.barrier()
    if env.is_primary and not stopped and not (run_dir / checkpoint.BEST).exists() \
            and (run_dir / checkpoint.LAST).exists():
        log.info("no validation metric was computed: best.pt is the final epoch")
        atomic_copy(run_dir / checkpoint.LAST, run_dir / checkpoint.BEST)
    metrics_writer.close()
    distributed.barrier()
    return {"run_dir": str(run_dir), "metrics": last_metrics, "history": history,
            "stopped": stopped, "step": global_step, "world_size": env.world_size,
            "parameters_sha256": parameters_digest(model)}


def parameters_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bit-identical parameters."""
    import hashlib

    digest = hashlib.sha256()
    for name, p in distributed.unwrap(model).named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()

