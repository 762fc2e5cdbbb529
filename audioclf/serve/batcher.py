"""The micro-batcher of `audioclf serve`: clips from many requests gathered into batches for one
model call each, in a thread of its own, and each request answered with its own rows.

    batcher = MicroBatcher(model.embed_prepared, max_batch=32, max_wait_ms=5, max_queue=256)
    batcher.start()
    with batcher.reserve(len(clips)) as slot:       # Overloaded at once when the queue is full
        embeddings = slot.submit(clips).result()    # a concurrent.futures.Future of [n, D]
    batcher.close()                                 # embeds what is queued, then stops

A batch starts when `max_batch` clips wait, or `max_wait_ms` after the oldest waiting clip came
(at once when it has waited that long already, e.g. behind a running batch). It holds the
oldest clip and the clips closest to it in length, so a batch's padding stays small and no clip
waits behind newer ones for ever. The queue limit counts every clip admitted and not yet
embedded, so a full server refuses a request before decoding it instead of answering it late.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError

import numpy as np
from torch import Tensor

from audioclf.serve.stats import Stats


class Overloaded(Exception):
    """More clips admitted than the queue holds: the request is refused (HTTP 503)."""


class _Job:
    """One request's clips; its future resolves to their embeddings [n, D], in order."""

    def __init__(self, count: int) -> None:
        self.future: Future = Future()
        self.rows: list[np.ndarray | None] = [None] * count
        self.left = count

    def put(self, slot: int, row: np.ndarray) -> None:
        self.rows[slot] = row
        self.left -= 1
        if not self.left:
            # a future already done: another of its clips failed, or its request went away
            with contextlib.suppress(InvalidStateError):
                self.future.set_result(np.stack(self.rows))

    def fail(self, exc: BaseException) -> None:
        with contextlib.suppress(InvalidStateError):
            self.future.set_exception(exc)


class _Clip:
    __slots__ = ("arrived", "clip", "job", "length", "slot")

    def __init__(self, clip: Tensor, job: _Job, slot: int, arrived: float) -> None:
        self.clip, self.job, self.slot, self.arrived = clip, job, slot, arrived
        self.length = int(clip.shape[0])


class Reservation:
    """Room for `count` clips in the queue, held until they are submitted (and embedded) or
    the `with` block ends without submitting them."""

    def __init__(self, batcher: MicroBatcher, count: int) -> None:
        self._batcher, self.count, self._held = batcher, count, True

    def submit(self, clips: Sequence[Tensor]) -> Future:
        if not self._held or len(clips) != self.count:
            raise ValueError(f"a reservation of {self.count} clip(s) submits them once")
        self._held = False
        return self._batcher._enqueue(list(clips))

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        if self._held:
            self._held = False
            self._batcher._release(self.count)


class MicroBatcher:
    """Runs `embed_batch(clips) -> [n, D]` (e.g. Model.embed_prepared) on batches of queued
    clips in one worker thread; see the module's docstring. The knobs are checked by
    ServeOptions.check (max_batch and max_queue >= 1, max_wait_ms >= 0)."""

    def __init__(
        self,
        embed_batch: Callable[[list[Tensor]], np.ndarray],
        *,
        max_batch: int,
        max_wait_ms: float,
        max_queue: int,
        stats: Stats | None = None,
    ) -> None:
        self._embed = embed_batch
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait_ms / 1000, max_queue
        self.stats = stats or Stats()
        self._cond = threading.Condition()
        self._pending: list[_Clip] = []
        self._admitted = 0
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="audioclf-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop taking clips, embed those queued, and end the worker thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def check_room(self, count: int = 1) -> None:
        """Overloaded (at once) when `count` clips do not fit in the queue now: a request is
        refused so before its body is read; reserve() then admits its clips."""
        with self._cond:
            self._refuse_when_full(count)

    def reserve(self, count: int) -> Reservation:
        """Room for `count` clips; Overloaded (at once) when the queue has less."""
        with self._cond:
            self._refuse_when_full(count)
            self._admitted += count
            self.stats.set("audioclf_queue_clips", self._admitted)
        return Reservation(self, count)

    def _refuse_when_full(self, count: int) -> None:  # under the lock
        if self._closing:
            raise Overloaded("the server is shutting down")
        if self._admitted + count > self.max_queue:
            self.stats.count("audioclf_rejected_requests_total")
            raise Overloaded(
                f"the queue is full ({self._admitted} of {self.max_queue} clips waiting); "
                "try again shortly"
            )

    def _release(self, count: int) -> None:
        with self._cond:
            self._admitted -= count
            self.stats.set("audioclf_queue_clips", self._admitted)

    def _enqueue(self, clips: list[Tensor]) -> Future:
        job, now = _Job(len(clips)), time.monotonic()
        with self._cond:
            self._pending += [_Clip(clip, job, slot, now) for slot, clip in enumerate(clips)]
            self._cond.notify_all()
        return job.future

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            self._run(batch)

    def _next_batch(self) -> list[_Clip] | None:
        with self._cond:
            while not self._pending and not self._closing:
                self._cond.wait()
            if not self._pending:
                return None  # closing, and everything queued is embedded
            deadline = self._pending[0].arrived + self.max_wait
            while len(self._pending) < self.max_batch and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._take()

    def _take(self) -> list[_Clip]:
        """The oldest clip and the max_batch - 1 others closest to it in length (under the lock)."""
        pending = self._pending
        if len(pending) <= self.max_batch:
            self._pending = []
            return pending
        first = pending[0].length
        nearest = sorted(range(1, len(pending)), key=lambda i: abs(pending[i].length - first))
        chosen = {0, *nearest[: self.max_batch - 1]}
        self._pending = [clip for i, clip in enumerate(pending) if i not in chosen]
        return [pending[i] for i in sorted(chosen)]

    def _run(self, batch: list[_Clip]) -> None:
        start = time.monotonic()
        for clip in batch:
            self.stats.observe("audioclf_queue_seconds", start - clip.arrived)
        try:
            rows = self._embed([clip.clip for clip in batch])
        except Exception as exc:  # each request gets its own answer
            self._run_apart(batch, exc)
        else:
            for clip, row in zip(batch, rows):
                clip.job.put(clip.slot, row)
        self.stats.observe("audioclf_batch_size", len(batch))
        self.stats.observe("audioclf_batch_seconds", time.monotonic() - start)
        self.stats.count("audioclf_clips_total", by=len(batch))
        self._release(len(batch))

    def _run_apart(self, batch: list[_Clip], exc: Exception) -> None:
        """A batch that failed: each request's clips again on their own, so that one bad clip
        fails its own request only."""
        jobs: dict[int, list[_Clip]] = {}
        for clip in batch:
            jobs.setdefault(id(clip.job), []).append(clip)
        if len(jobs) == 1:
            batch[0].job.fail(exc)
            return
        for clips in jobs.values():
            try:
                rows = self._embed([clip.clip for clip in clips])
            except Exception as own:  # the request's own error
                clips[0].job.fail(own)
                continue
            for clip, row in zip(clips, rows):
                clip.job.put(clip.slot, row)
