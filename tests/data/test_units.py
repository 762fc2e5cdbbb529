"""The one loader shape: training batches read a unit at a time (audioclf.data.units)."""

from __future__ import annotations

import pytest
import torch

from audioclf.data.dataset import collate_padded
from audioclf.data.loader import SeededBatches, TrainLoader, loader_kwargs
from audioclf.data.units import BufferLeases, FileBatchReader


class _Ragged(torch.utils.data.Dataset):
    """Items of several lengths; every seventh position is an unreadable file (None), and so
    is every position of the fifth batch."""

    def __len__(self):
        return 64

    def __getitem__(self, key):
        position, seed = key[0], key[1]
        if position % 7 == 3 or 32 <= position < 40:
            return None
        return torch.full((3 + position % 5, 2), float(seed % 1000)), position // 8, position


class _Sampler:
    """Batches of 8 consecutive positions; the epoch and resume API TrainLoader needs."""

    epoch, batches_per_epoch = 0, 8

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.batches_per_epoch

    def __iter__(self):
        return iter([list(range(8 * b, 8 * b + 8)) for b in range(self.batches_per_epoch)])


@pytest.mark.parametrize("read_batches", [1, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_per_file_batches_are_their_items_collated(workers, read_batches):
    options = loader_kwargs(workers, False, False, 2, torch.device("cpu"))
    loader = TrainLoader(_Ragged(), _Sampler(), seed=4, read_batches=read_batches, **options)
    batches = list(loader)
    keys = list(SeededBatches(_Sampler(), 4))
    assert len(batches) == len(keys) == 8
    for batch, batch_keys in zip(batches, keys, strict=True):
        expected = collate_padded([_Ragged()[key] for key in batch_keys])
        if len(expected.labels) == 0:  # no readable item: no rows (the step's placeholder)
            assert len(batch.labels) == len(batch.positions) == len(batch.x) == 0
            continue
        assert batch.x.shape == expected.x.shape
        for got, want in zip(batch, expected, strict=True):
            assert (got is None and want is None) or torch.equal(got, want)
    readable = [p for p in range(64) if _Ragged()[(p, 0)] is not None]
    assert torch.cat([b.positions for b in batches]).tolist() == readable  # skipped: left out


def test_a_caller_that_keeps_batches_keeps_them_intact():
    # The worker reuses a buffer only once the main process holds nothing of it; later epochs
    # (other crop seeds, other values) must not write into batches still held.
    options = loader_kwargs(1, False, True, 2, torch.device("cpu"))
    loader = TrainLoader(_Ragged(), _Sampler(), seed=4, **options)
    held = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        held += [(batch, batch.x.clone()) for batch in loader]
        loader.end_epoch()
    assert len(held) == 24 and not all(torch.equal(held[0][1], h[1]) for h in held[8:])
    for batch, copy in held:
        assert torch.equal(batch.x, copy)


def test_a_worker_reuses_its_released_buffers_and_leaves_held_ones_alone():
    leases = BufferLeases(workers=1, per_worker=2)
    reader = FileBatchReader(_Ragged(), leases)
    first, held = reader._leased(0, 1000)
    second, _ = reader._leased(0, 1000)
    assert held == (0, 0) and second is not first  # buffer 0 is held: buffer 1
    extra, lease = reader._leased(0, 1000)
    assert lease == (0, -1) and extra is not first and extra is not second  # both held: a new one
    leases.flags[0, 0] = 0  # the main process let go of buffer 0
    again, lease = reader._leased(0, 500)
    assert lease == (0, 0) and again is first  # reused, not faulted in anew
    leases.flags[0, 1] = 0
    grown, lease = reader._leased(0, 4000)
    assert lease == (0, 1) and grown.nbytes() >= 4000  # too small for the unit: grown
