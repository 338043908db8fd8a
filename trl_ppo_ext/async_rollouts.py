"""Rollouts sampled in a background thread while the trainer updates, never older than
``max_staleness`` policy versions (TRL ``AsyncGRPOTrainer``'s name and meaning).

The producer calls ``sample(version, index)`` for batch ``index`` (0, 1, 2, ...) with the policy
of ``version``; the batch must be a function of those two alone (prompts and request seeds from
``index``, weights from ``version``), which is what makes a run reproducible and a resume exact.
The consumer (the trainer) takes batches in index order with :meth:`RolloutProducer.get` and,
after each update, announces the new weights with :meth:`RolloutProducer.publish`. A version is
one such announcement: normally one per trained batch.

Schedule. After a start (or a :meth:`RolloutProducer.checkpoint`) at batch ``i0`` and version
``v0``, the consumer trains batch ``k`` at version ``v0 + (k - i0)``; the producer samples it at
the fixed version ``v0 + max(0, k - i0 - max_staleness)``, waiting for that version to be
published (the time it waits is logged). So every batch is exactly ``min(max_staleness, k - i0)``
versions old, never more, and which version samples which batch does not depend on timing. At
most ``max_staleness`` finished batches wait in the queue. ``sample`` is asked for an older version
than the newest published when the trainer is ahead; an engine that keeps several versions
(``generation.server_weights.AdapterFilePush``) serves it exactly; :meth:`needed_version` says
which versions may be released.

A batch that would still be too old when taken (the consumer published more than one version per
batch) is dropped, counted, and sampled again at the consumer's version together with every
batch queued after it. If the consumer waits for a batch whose version was never published
(fewer publishes than batches), that batch is sampled at the newest version instead of waiting
for ever.

``max_staleness=0`` is the synchronous loop: no thread, ``get`` calls ``sample(version, index)``
itself with the newest version.

Resume: :meth:`RolloutProducer.checkpoint` discards the queued and in-flight batches (nothing
half-trained is saved) and returns ``{"next_index", "version"}``; a producer built from it
(``RolloutProducer(..., **state)``) samples them again from the saved weights, exactly as the
producer that wrote the checkpoint goes on to do. A checkpoint is a synchronisation point: the
``max_staleness`` batches after it are sampled at the checkpoint's version.

Errors: an exception in ``sample`` ends the thread and is raised by the ``get`` that asks for
that batch (the batches sampled before it are handed out first), as a ``RolloutProducerError``
whose cause is the original. :meth:`RolloutProducer.close` stops the thread and waits for it
(for the ``sample`` call in flight to return, at most ``close_timeout`` seconds).

Example (synchronous: batch ``index`` sampled at the newest version):

>>> from trl_ppo_ext.async_rollouts import RolloutProducer
>>> with RolloutProducer(lambda version, index: f"batch {index} by v{version}", max_staleness=0) as rollouts:
...     first = rollouts.get()
...     rollouts.publish(1)
...     second = rollouts.get()
>>> first.batch, second.batch, second.staleness
('batch 0 by v0', 'batch 1 by v1', 0)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ASYNC_KEYS", "PromptFeed", "ReadAheadPrompts", "RolloutProducer", "RolloutProducerError", "VersionedBatch"]

ASYNC_KEYS = ("async/staleness", "async/wait_for_rollout_s", "async/wait_for_weights_s", "async/dropped_stale",
              "async/queued")


class RolloutProducerError(RuntimeError):
    """``sample`` raised in the producer thread; the cause is its exception."""


@dataclass(frozen=True)
class VersionedBatch:
    """One batch and the policy that sampled it."""

    batch: Any           # what ``sample`` returned
    index: int           # its place in the run: 0, 1, 2, ...
    version: int         # the policy version that sampled it
    staleness: int       # versions between that policy and the consumer's when handed out
    sample_seconds: float  # how long ``sample`` took


class RolloutProducer:
    """Samples the next batches in a background thread (see the module docstring).

    Args:
        sample: ``sample(version, index) -> batch``; called from one thread at a time (the
            producer's, or the consumer's when ``max_staleness=0``).
        max_staleness: the most policy versions a batch may lag behind the consumer's; 0:
            synchronous, no thread.
        next_index: the index of the first batch to hand out (a resume's ``next_index``).
        version: the consumer's policy version now (a resume's ``version``).
        close_timeout: seconds :meth:`close` waits for the thread.
    """

    def __init__(self, sample: Callable[[int, int], Any], *, max_staleness: int, next_index: int = 0,
                 version: int = 0, close_timeout: float = 60.0):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (0: synchronous rollouts), got {max_staleness!r}.")
        self.sample, self.max_staleness, self.close_timeout = sample, max_staleness, close_timeout
        self._cond = threading.Condition()
        self._queue: deque[VersionedBatch] = deque()
        self._latest = version       # newest published version: the consumer's
        self._taken = next_index     # index of the next batch the consumer gets
        self._anchor = (next_index, version)  # (index, version) the schedule counts from
        self._next = next_index      # index the producer samples next
        self._epoch = 0              # bumped when queued work is thrown away
        self._waiting_for: int | None = None  # index the consumer is blocked on
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self._weights_wait = 0.0
        self._dropped = 0
        self._metrics: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        if max_staleness > 0:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ consumer side
    def publish(self, version: int) -> None:
        """The policy of ``version`` is ready to sample from (its weights staged); versions only grow."""
        with self._cond:
            if version < self._latest:
                raise ValueError(f"publish({version}) after version {self._latest}: versions only grow.")
            self._latest = version
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> VersionedBatch:
        """The next batch in index order, at most ``max_staleness`` versions old; blocks until it
        is sampled (at most ``timeout`` seconds: then ``TimeoutError``)."""
        start = time.monotonic()
        if self._closed:
            raise RuntimeError("RolloutProducer.get after close().")
        if self._thread is None:
            item = self._sample_now()
        else:
            item = self._take(start, timeout)
        with self._cond:
            self._metrics = {"async/staleness": float(item.staleness),
                             "async/wait_for_rollout_s": time.monotonic() - start,
                             "async/wait_for_weights_s": self._weights_wait,
                             "async/dropped_stale": float(self._dropped),
                             "async/queued": float(len(self._queue))}
            self._weights_wait = 0.0
        return item

    def metrics(self) -> dict[str, float]:
        """``ASYNC_KEYS`` of the last :meth:`get`: that batch's staleness, how long the consumer
        waited for it, how long the producer waited for weights since the get before, the stale
        batches dropped so far, the batches queued after it."""
        with self._cond:
            return dict(self._metrics)

    def needed_version(self) -> int:
        """The oldest version a batch the consumer has not taken yet can ask for: older ones may be
        released. Counted from the consumer's position, not the producer's, so that processes whose
        producers run at different paces but whose consumers step together agree on it (one process
        releases the versions every process's producer samples from)."""
        with self._cond:
            return min(self._target(self._taken), self._latest)

    def checkpoint(self) -> dict[str, int]:
        """Discard queued and in-flight batches; the state a resumed producer starts from."""
        with self._cond:
            self._restart(self._taken)
            return {"next_index": self._taken, "version": self._latest}

    def close(self) -> None:
        """Stop the thread and wait for it; raises ``RuntimeError`` if it is still in ``sample``
        after ``close_timeout`` seconds. Safe to call twice."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.close_timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the rollout producer thread did not stop within close_timeout="
                                   f"{self.close_timeout} s (a sample call still running).")

    def __enter__(self) -> RolloutProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _target(self, index: int) -> int:
        """The version batch ``index`` is sampled at under the schedule."""
        anchor_index, anchor_version = self._anchor
        return anchor_version + max(0, index - anchor_index - self.max_staleness)

    def _restart(self, index: int) -> None:
        """Throw away what is queued and in flight; sample again from ``index`` (lock held)."""
        self._queue.clear()
        self._epoch += 1
        self._next = index
        self._anchor = (index, self._latest)
        if self._error is not None and self._error[0] >= index:
            self._error = None  # that batch will be sampled again
        self._cond.notify_all()

    def _sample_now(self) -> VersionedBatch:
        index, version = self._taken, self._latest
        start = time.monotonic()
        try:
            batch = self.sample(version, index)
        except Exception as err:
            raise RolloutProducerError(f"sampling batch {index} at policy version {version} failed: {err}") from err
        self._taken += 1
        return VersionedBatch(batch, index, version, 0, time.monotonic() - start)

    def _take(self, start: float, timeout: float | None) -> VersionedBatch:
        with self._cond:
            self._waiting_for = self._taken
            self._cond.notify_all()  # a producer waiting for a version that will not come goes on
            try:
                while True:
                    if self._queue:
                        item = self._queue.popleft()
                        staleness = self._latest - item.version
                        if staleness > self.max_staleness:
                            self._dropped += 1
                            self._restart(item.index)
                            continue
                        self._taken = item.index + 1
                        self._cond.notify_all()  # a slot is free
                        return VersionedBatch(item.batch, item.index, item.version, staleness, item.sample_seconds)
                    if self._error is not None:
                        index, err = self._error
                        raise RolloutProducerError(f"sampling batch {index} in the producer thread failed: "
                                                   f"{err!r}") from err
                    if self._closed:
                        raise RuntimeError("RolloutProducer.get after close().")
                    left = None if timeout is None else timeout - (time.monotonic() - start)
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no rollout for batch {self._taken} within {timeout} s.")
                    self._cond.wait(left)
            finally:
                self._waiting_for = None

    def _ready(self) -> bool:
        """Whether the producer may sample ``self._next`` now (lock held)."""
        if len(self._queue) >= self.max_staleness or self._error is not None:
            return False
        return self._latest >= self._target(self._next) or self._waiting_for == self._next

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._ready():
                    # not a full queue nor an error: the version this batch needs is not published yet
                    on_weights = len(self._queue) < self.max_staleness and self._error is None
                    waited = time.monotonic()
                    self._cond.wait()
                    if on_weights:
                        self._weights_wait += time.monotonic() - waited
                if self._closed:
                    return
                index, epoch = self._next, self._epoch
                version = min(self._target(index), self._latest)
            start = time.monotonic()
            try:
                batch = self.sample(version, index)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, nothing swallowed
                with self._cond:
                    if epoch == self._epoch:
                        self._error = (index, err)
                        self._cond.notify_all()
                continue
            with self._cond:
                if epoch != self._epoch:
                    continue  # thrown away meanwhile (a drop or a checkpoint): sampled again
                self._queue.append(VersionedBatch(batch, index, version, 0, time.monotonic() - start))
                self._next = index + 1
                self._cond.notify_all()


@dataclass(frozen=True)
class PromptFeed:
    """Where a producer reads prompt batches ahead of the trainer: the trainer's own data stream.

    ``restart()`` returns a new iterator of batches that starts at ``cursor``'s position
    (``cursor.epoch``, ``cursor.batches``; the trainer's ``RunCounters``) and moves that cursor as it
    goes (the trainer's ``_repeat_dataloader``); ``prepare`` turns each batch into what is sampled
    (the trainer's ``repeated_prompts``)."""

    restart: Callable[[], Any]
    cursor: Any
    prepare: Callable[[Any], Any]


class ReadAheadPrompts:
    """Prompt batches by index, read ahead of the trainer, while the trainer's data cursor stays at
    the batch it trains next (what a synchronous run's cursor says at the same update), so that a
    checkpoint saved at any moment records the trainer's position, never the producer's.

    Reads happen on the trainer's thread (:meth:`fill`, the iterator moving its own cursor copy);
    the producer's thread only looks batches up (:meth:`batch`). After a checkpoint the batches
    still ahead are the same prompts whichever run reads them: the data order depends on the
    cursor alone.

    Example (a stream of the numbers 0, 1, 2, ... with its cursor):

    >>> from types import SimpleNamespace
    >>> cursor = SimpleNamespace(epoch=0, batches=0)
    >>> def stream():
    ...     while True:
    ...         cursor.batches += 1
    ...         yield cursor.batches - 1
    >>> prompts = ReadAheadPrompts(PromptFeed(stream, cursor, lambda b: f"prompts {b}"), first_index=0)
    >>> prompts.fill(upto=2)                        # batches 0, 1 and 2 read ahead
    >>> prompts.batch(2), cursor.batches            # the trainer's cursor has not moved
    ('prompts 2', 0)
    >>> prompts.taken(0); cursor.batches            # the trainer trains batch 0: its cursor moves past it
    1
    """

    def __init__(self, feed: PromptFeed, first_index: int):
        self.feed = feed
        self._lock = threading.Lock()
        self._iterator = None
        self._batches: dict[int, Any] = {}
        self._after: dict[int, tuple[int, int]] = {}  # index -> the cursor once that batch was read
        self._next = first_index
        self._read_cursor = (feed.cursor.epoch, feed.cursor.batches)

    def fill(self, upto: int) -> None:
        """Read the batches up to index ``upto`` not read yet (the trainer's thread)."""
        cursor = self.feed.cursor
        trainer_position = (cursor.epoch, cursor.batches)
        cursor.epoch, cursor.batches = self._read_cursor
        try:
            if self._iterator is None:
                self._iterator = self.feed.restart()
            while self._next <= upto:
                batch = self.feed.prepare(next(self._iterator))
                with self._lock:
                    self._batches[self._next] = batch
                    self._after[self._next] = (cursor.epoch, cursor.batches)
                self._next += 1
            self._read_cursor = (cursor.epoch, cursor.batches)
        finally:
            cursor.epoch, cursor.batches = trainer_position

    def batch(self, index: int) -> Any:
        """Batch ``index`` (read by :meth:`fill` before; any thread)."""
        with self._lock:
            if index not in self._batches:
                raise KeyError(f"prompt batch {index} was not read ahead (read up to {self._next - 1}).")
            return self._batches[index]

    def taken(self, index: int) -> None:
        """The trainer trains batch ``index`` now: its cursor moves past it; older batches are forgotten."""
        with self._lock:
            self.feed.cursor.epoch, self.feed.cursor.batches = self._after[index]
            for old in [i for i in self._batches if i <= index]:
                del self._batches[old], self._after[old]
