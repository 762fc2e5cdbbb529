"""DataLoaders for training and evaluation.

Training batches carry a crop seed per sample, derived from (seed, epoch, batch, slot): random
crops are then the same whatever the number of DataLoader workers, and a resumed run reads the
very same crops as an uninterrupted one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from audioclf.data.dataset import collate_padded


class SeededBatches:
    """Wraps a batch sampler; yields [(position, crop_seed), ...] instead of [position, ...].

    Epoch and resume position are the sampler's own (MPerClassSampler.epoch; a resumed epoch
    starts at batches_per_epoch - len), so the seeds follow the sampler through a resume.
    """

    def __init__(self, batch_sampler, seed: int):
        self.batch_sampler = batch_sampler
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self, position: int) -> dict:
        return self.batch_sampler.state_dict(position=position)

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        sampler = self.batch_sampler
        epoch, start = sampler.epoch, sampler.batches_per_epoch - len(sampler)
        for batch_index, batch in enumerate(sampler, start=start):
            base = (self.seed * 1_000_003 + epoch) * 10_000_019 + batch_index
            yield [(int(p), (base * 1_009 + slot) & 0x7FFF_FFFF_FFFF_FFFF) for slot, p in enumerate(batch)]


def seed_worker(worker_id: int) -> None:
    """Per-worker seeds for python and numpy, derived from the worker's torch seed."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def loader_kwargs(num_workers: int, pin_memory: bool, persistent_workers: bool,
                  prefetch_factor: int, device: torch.device) -> dict:
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


def build_train_loader(dataset: Dataset, batches: SeededBatches, *, seed: int, **kwargs) -> DataLoader:
    # Its own generator: creating the iterator must not consume the global torch RNG, or a
    # resumed run would see different SpecAugment masks and dropout than a straight one.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_sampler=batches, generator=generator, **kwargs)


def build_eval_loader(dataset: Dataset, positions: list[int] | None = None, *, batch_size: int,
                      **kwargs) -> DataLoader:
    """Ordered batches over `positions` (default: the whole dataset)."""
    if positions is not None:
        dataset = torch.utils.data.Subset(dataset, positions)
    kwargs = dict(kwargs, persistent_workers=False) if kwargs.get("num_workers", 0) > 0 else kwargs
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      generator=torch.Generator().manual_seed(0), **kwargs)
