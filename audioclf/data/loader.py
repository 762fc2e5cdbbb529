"""DataLoaders for training and evaluation.

Training batches carry a crop seed per sample, derived from (seed, epoch, batch, slot): random
crops are then the same whatever the number of DataLoader workers, and a resumed run reads the
very same crops as an uninterrupted one. With a crop schedule (train.final_epochs) the keys also
carry the epoch's crop length: the batch sampler runs in the main process, while a persistent
worker's dataset is the copy it was given at its start and never hears of a new epoch.
`TrainLoader` is stateful: it counts the batches it has handed out, so a checkpoint resumes at
the very next batch (torchtitan's stateful loader). Its workers read units of whole batches
(audioclf.data.units): from the files, or from a feature pack (audioclf.data.pack.batches), from
the same keys.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from audioclf.config import Config
from audioclf.data.dataset import AudioDataset, collate_padded
from audioclf.data.index import Index
from audioclf.data.pack.batches import PackedBatchReader
from audioclf.data.sampler import MixedBatchSampler, MPerClassSampler
from audioclf.data.units import BufferLeases, FileBatchReader, Units, batches_of, unit_as_is

log = logging.getLogger("audioclf")


class SeededBatches:
    """Wraps a batch sampler; yields [(position, crop_seed), ...] instead of [position, ...],
    or [(position, crop_seed, crop_samples), ...] with `crop_samples(epoch)` given.

    Epoch and resume position are the sampler's own (MPerClassSampler.epoch; a resumed epoch
    starts at batches_per_epoch - len), so seeds and crop lengths follow the sampler through a
    resume.
    """

    def __init__(self, batch_sampler, seed: int, crop_samples: Callable[[int], int] | None = None):
        self.batch_sampler = batch_sampler
        self.seed = seed
        self.crop_samples = crop_samples

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[tuple]]:
        sampler = self.batch_sampler
        epoch, start = sampler.epoch, sampler.batches_per_epoch - len(sampler)
        crop = () if self.crop_samples is None else (int(self.crop_samples(epoch)),)
        for batch_index, batch in enumerate(sampler, start=start):
            base = (self.seed * 1_000_003 + epoch) * 10_000_019 + batch_index
            yield [
                (int(p), (base * 1_009 + slot) & 0x7FFF_FFFF_FFFF_FFFF, *crop)
                for slot, p in enumerate(batch)
            ]


def seed_worker(worker_id: int) -> None:
    """Per-worker seeds for python and numpy, derived from the worker's torch seed."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def loader_kwargs(
    num_workers: int,
    pin_memory: bool,
    persistent_workers: bool,
    prefetch_factor: int,
    device: torch.device,
) -> dict:
    kwargs = {
        "num_workers": num_workers,
        "pin_memory": pin_memory and device.type == "cuda",
        "collate_fn": collate_padded,
        "worker_init_fn": seed_worker,
    }
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        kwargs["prefetch_factor"] = prefetch_factor
    return kwargs


def eval_loader_options(num_workers: int, device: torch.device) -> dict:
    """DataLoader settings of an evaluation pass outside a run (evaluate, embed, search, the
    API): memory pinned for CUDA, workers not kept between passes."""
    return loader_kwargs(
        num_workers, pin_memory=True, persistent_workers=False, prefetch_factor=2, device=device
    )


def loader_options(cfg: Config, device: torch.device) -> dict:
    """The run's DataLoader settings (data.*), for its train and validation loaders."""
    return loader_kwargs(
        cfg.data.num_workers,
        cfg.data.pin_memory,
        cfg.data.persistent_workers,
        cfg.data.prefetch_factor,
        device,
    )


class TrainLoader:
    """One rank's training batches, and how far the current epoch has been consumed.

    Iterating yields the DataLoader's batches of the sampler's current epoch (from the resume
    point on) and counts them in `position`; `limit_batches` ends an epoch early
    (train.limit_batches). `state_dict()` is the sampler's state at `position`, so the
    checkpointer saves and restores the loader like the model; with `restart_epoch` a state
    saved in the middle of an epoch starts that epoch again (checkpoint.restart_epoch).
    `crop_samples(epoch)`, when given, is each epoch's crop length, carried by the batch keys.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler,
        *,
        seed: int,
        limit_batches: int = 0,
        restart_epoch: bool = False,
        crop_samples: Callable[[int], int] | None = None,
        read_batches: int = 1,
        **kwargs,
    ):
        self.sampler = sampler
        self.limit_batches = limit_batches
        self.restart_epoch = restart_epoch
        self.position = 0  # batches of the current epoch handed out
        # Its own generator: creating the iterator must not consume the global torch RNG, or a
        # resumed run would see different SpecAugment masks and dropout than a straight one.
        generator = torch.Generator().manual_seed(seed)
        batches = SeededBatches(sampler, seed, crop_samples)
        # Workers read units of `read_batches` batches into buffers they reuse (data.units).
        self.packed = getattr(dataset, "pack", None) is not None
        self.leases = None
        if workers := kwargs.get("num_workers", 0):  # a worker's units in flight, in use, before
            self.leases = BufferLeases(workers, kwargs.get("prefetch_factor", 2) + 3)
        reader = (PackedBatchReader if self.packed else FileBatchReader)(dataset, self.leases)
        self.loader = DataLoader(
            reader,
            sampler=Units(batches, read_batches),
            batch_size=None,
            generator=generator,
            **dict(kwargs, collate_fn=unit_as_is),
        )

    @classmethod
    def for_run(
        cls,
        cfg: Config,
        train: Index,
        dataset: AudioDataset,
        *,
        rank: int,
        world_size: int,
        options: dict,
        crop_samples: Callable[[int], int] | None = None,
        unlabelled_clips: int = 0,
    ) -> TrainLoader:
        """This rank's loader of a run: the m-per-class sampler over the train split (sampler.*,
        the classes dealt to `world_size` ranks), with the run's loader `options`. With
        `unlabelled_clips` (data.unlabelled; the dataset then follows
        AudioDataset.with_unlabelled) batches mix in views of those clips (unlabelled.share)."""
        settings = dict(
            m=cfg.sampler.m,
            rank=rank,
            world_size=world_size,
            seed=cfg.train.seed,
            split=cfg.sampler.split,
            small_classes=cfg.sampler.small_classes,
        )
        classes, items = train.codes.class_codes, train.codes.item_codes
        if unlabelled_clips:
            labelled, clips = cfg.unlabelled.batch_rows(cfg.sampler.batch_size, cfg.sampler.m)
            sampler = MixedBatchSampler(
                MPerClassSampler(classes, items, batch_size=labelled, **settings),
                unlabelled_clips,
                clips_per_batch=clips,
            )
        else:
            sampler = MPerClassSampler(
                classes, items, batch_size=cfg.sampler.batch_size, **settings
            )
        return cls(
            dataset,
            sampler,
            seed=cfg.train.seed,
            limit_batches=cfg.train.limit_batches,
            restart_epoch=cfg.checkpoint.restart_epoch,
            crop_samples=crop_samples,
            read_batches=cfg.data.pack_read_batches,
            **options,
        )

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate; a resumed epoch keeps its position."""
        if epoch != self.sampler.epoch:
            self.position = 0
        self.sampler.set_epoch(epoch)

    def end_epoch(self) -> None:
        """The current epoch is done: the next one starts from its first batch."""
        self.position = 0

    def __len__(self) -> int:
        """Batches the next iteration yields."""
        left = len(self.sampler)
        return min(left, max(0, self.limit_batches - self.position)) if self.limit_batches else left

    def __iter__(self) -> Iterator:
        for unit in self.loader:
            if self.leases is not None:
                self.leases.hold(unit)
            for batch in batches_of(unit):
                if self.limit_batches and self.position >= self.limit_batches:
                    return
                self.position += 1
                yield batch

    def micro_batches(self, accumulate: int) -> Iterator[tuple[object, bool]]:
        """(batch, closes_group): groups of `accumulate` batches end at the epoch positions that
        are multiples of `accumulate`, so a resumed epoch keeps the groups of the straight one."""
        for batch in self:
            yield batch, self.position % accumulate == 0

    def state_dict(self) -> dict:
        return self.sampler.state_dict(position=self.position)

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved epoch after its last consumed batch (nothing to do when it was
        saved at an epoch's start or end, or with restart_epoch)."""
        position = state.get("position", 0)
        if position and self.restart_epoch:
            log.info(
                "checkpoint.restart_epoch: epoch %d starts again from its first batch (the "
                "checkpoint was at batch %d)",
                state["epoch"] + 1,
                position,
            )
        if not position or self.restart_epoch:
            return
        try:
            self.sampler.load_state_dict(state)
        except ValueError as exc:
            raise ValueError(
                f"the checkpoint was written in the middle of epoch {state['epoch'] + 1} (batch "
                f"{position}) and cannot continue that epoch here ({exc}); set "
                "checkpoint.restart_epoch=true to resume from the start of the epoch"
            ) from None
        self.position = position


def build_eval_loader(
    dataset: Dataset, positions: list[int] | None = None, *, batch_size: int, **kwargs
) -> DataLoader:
    """Ordered batches over `positions` (default: the whole dataset)."""
    if positions is not None:
        dataset = torch.utils.data.Subset(dataset, positions)
    kwargs = dict(kwargs, persistent_workers=False) if kwargs.get("num_workers", 0) > 0 else kwargs
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
