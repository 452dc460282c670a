"""An ordered, asynchronous transfer queue for one direction. It only talks to the Backend ABC.

All jobs of a queue run on one copy stream, so a job starts only after the previous
one has finished on the device; every job first waits for the caller's compute stream
(a store must read the KV cache after the model wrote it; a load must land after any
pending work on its destination blocks, such as zeroing of fresh blocks). Completions
are reported from the head of the queue, so in submission order.

Threads: every method may be called from any thread. A queue's bookkeeping is guarded by
its own lock, held only for list and set operations and non-blocking event queries; the
enqueue itself (`Backend.copy_batch` and the events around it) runs under one lock per
backend, because a backend's staging and descriptor memory is shared by all its streams;
waiting on the device holds no lock.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from offload_core.backend import Backend, Direction, Event
from offload_core.compact import CompactJob
from offload_core.errors import InvalidSpecError
from offload_core.layout import integer
from offload_core.plan import CopyBatch

log = logging.getLogger(__name__)

_POOLED = 16  # descriptor buffers a queue keeps for reuse

_enqueue_locks: "weakref.WeakKeyDictionary[Backend, threading.Lock]" = weakref.WeakKeyDictionary()
_enqueue_locks_guard = threading.Lock()


def job_id_set(job_ids: Iterable[int]) -> set[int]:
    """`job_ids` as a set of ints.

    Raises:
        InvalidSpecError: not an iterable of integers (a bare id, say).
    """
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise InvalidSpecError(f"wait takes an iterable of job ids, got {job_ids!r}; for one job: wait([job_id])")
    return {integer(j, "a job id passed to wait") for j in job_ids}


def enqueue_lock(backend: Backend) -> threading.Lock:
    """The lock that serialises every enqueue on `backend`, across all its queues and workers."""
    with _enqueue_locks_guard:
        lock = _enqueue_locks.get(backend)
        if lock is None:
            lock = _enqueue_locks[backend] = threading.Lock()
        return lock


@dataclass(frozen=True)
class TransferResult:
    """One finished job.

    Attributes:
        job_id: the caller's id.
        success: False when the device reported an error for this job.
        transfer_size: bytes the job copies (also set, as attempted bytes, when it failed).
        transfer_time: seconds between the job's start and end events on the device.
        direction: ``"store"`` (device to host) or ``"load"`` (host to device).
        mechanism: how the backend copied it (e.g. ``"ce_batch"``), or ``""``.
    """

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    direction: str
    mechanism: str = ""


@dataclass
class QueueStats:
    """Counters since the queue was made: jobs queued, their bytes and copy descriptors, jobs that failed."""

    jobs: int = 0
    bytes: int = 0
    descriptors: int = 0
    failed: int = 0
    mechanisms: Counter = field(default_factory=Counter)  # jobs per mechanism


class _Job(NamedTuple):
    job_id: int
    start: Event
    end: Event
    nbytes: int
    scratch: np.ndarray | None  # descriptor memory the device may still read
    mechanism: str


class TransferQueue:
    """Runs copy batches of one direction in submission order.

    Safe to call from several threads (see the module docstring).

    Args:
        backend: the device to copy on.
        direction: STORE or LOAD; recorded in results and passed to the backend.
    """

    def __init__(self, backend: Backend, direction: Direction):
        if not isinstance(backend, Backend) or not isinstance(direction, Direction):
            raise InvalidSpecError(f"TransferQueue needs a Backend and a Direction, got {backend!r} and {direction!r}")
        self.backend = backend
        self.direction = direction
        self._stream = backend.new_stream()
        self._enqueue = enqueue_lock(backend)
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        self._ids: set[int] = set()
        self._free_events: list[Event] = []
        self._free_scratch: list[np.ndarray] = []
        self.stats = QueueStats()

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._ids

    def __len__(self) -> int:
        return len(self._jobs)

    def scratch(self, descriptors: int) -> np.ndarray:
        """A pooled int64 ``(3, >= descriptors)`` buffer for the planner to write into.

        It comes from the backend's host memory (pinned where the backend pins), so a
        backend may read descriptors from the device or upload them asynchronously. Pass it
        to `submit`, or back to `release_scratch` if the job is not submitted.
        """
        with self._lock:
            for i, buf in enumerate(self._free_scratch):
                if buf.shape[1] >= descriptors:
                    return self._free_scratch.pop(i)
        n = max(descriptors, 256)
        return self.backend.alloc_host(3 * n * 8).numpy().view(np.int64).reshape(3, n)

    def release_scratch(self, scratch: np.ndarray) -> None:
        """Return a buffer from `scratch` that no job was submitted with."""
        with self._lock:
            self._pool(scratch)

    def _pool(self, scratch: np.ndarray) -> None:
        """Keep `scratch` for reuse; past `_POOLED` buffers, the smallest is let go (pinned
        memory is scarce, and a few sizes serve an engine's jobs)."""
        pool = self._free_scratch
        pool.append(scratch)
        if len(pool) > _POOLED:  # by position: list.remove would compare arrays with ==
            del pool[min(range(len(pool)), key=lambda i: pool[i].shape[1])]

    def submit(
        self, job_id: int, batch: CopyBatch | CompactJob, scratch: np.ndarray | None = None, prepared: Any = None
    ) -> None:
        """Enqueue one job behind every earlier one and behind the compute stream.

        Args:
            job_id: reported back in the job's `TransferResult`.
            batch: the descriptors, or a compact job for a backend that expands them; `scratch`
                (if descriptors live in it) is held until the job completes.
            prepared: for a compact job, what `Backend.prepare_layout` returned for its layout.

        Raises:
            Exception: whatever the backend raised while enqueueing; the job is then not queued.
        """
        with self._lock:
            start, end = self._event(), self._event()
        stream = self._stream
        failed = None
        with self._enqueue:
            try:
                stream.wait_stream(self.backend.current_stream())
                start.record(stream)
                mechanism = None
                if not len(batch):
                    pass
                elif isinstance(batch, CompactJob):
                    mechanism = self.backend.copy_blocks(batch, prepared, stream)
                else:
                    mechanism = self.backend.copy_batch(batch.src, batch.dst, batch.sizes, self.direction, stream)
                end.record(stream)
            except Exception as exc:
                failed = exc
                try:
                    end.record(stream)
                except Exception:
                    end = None
            if failed is None:
                mechanism = mechanism or ""
                # appended under the enqueue lock, so the deque's order is the stream's order
                with self._lock:
                    self._jobs.append(_Job(job_id, start, end, batch.nbytes, scratch, mechanism))
                    self._ids.add(job_id)
                    self.stats.jobs += 1
                    self.stats.bytes += batch.nbytes
                    self.stats.descriptors += batch.items if isinstance(batch, CompactJob) else len(batch)
                    self.stats.mechanisms[mechanism] += 1
                return
        # Part of the batch may be queued already: keep the descriptors until the stream has
        # passed them, waiting outside the enqueue lock that every queue on the backend shares.
        # If even that fails, the device is lost: drop them all.
        try:
            end.synchronize()  # None when even recording failed
        except Exception:
            scratch = None
        if scratch is not None:
            self.release_scratch(scratch)
        raise failed

    def poll(self) -> list[TransferResult]:
        """Results of the jobs completed so far, from the head of the queue, without blocking."""
        results = []
        with self._lock:
            while self._jobs:
                job = self._jobs[0]
                try:
                    if not job.end.query():
                        break
                    elapsed = job.start.elapsed_time(job.end) / 1e3
                    ok = True
                except Exception as exc:  # a device fault fails this job, not the caller's loop
                    log.error("%s job %s failed on the device: %r", self.direction.value, job.job_id, exc)
                    ok, elapsed = False, 0.0
                self._jobs.popleft()
                self._ids.discard(job.job_id)
                self.stats.failed += not ok
                results.append(TransferResult(job.job_id, ok, job.nbytes, elapsed, self.direction.value, job.mechanism))
                if ok:  # events that saw a fault are not trusted again
                    self._free_events += (job.start, job.end)
                if job.scratch is not None:
                    self._pool(job.scratch)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs (and so every job before them) have completed.

        Results are not consumed: `poll` still reports them. Unknown ids are ignored.

        Raises:
            InvalidSpecError: `job_ids` is not an iterable of integers.
        """
        wanted = job_id_set(job_ids)
        with self._lock:
            wanted &= self._ids
            last = None
            if wanted:
                for job in self._jobs:
                    if job.job_id in wanted:
                        last = job
        if last is not None:
            _settle(last.end)

    def drain(self) -> list[TransferResult]:
        """Wait for every queued job and return all pending results."""
        with self._lock:
            ends = [job.end for job in self._jobs]
        if ends:
            _settle(ends[-1])
        for end in ends:  # a fault on one event may not have waited for the rest
            _settle(end)
        return self.poll()

    def _event(self) -> Event:
        return self._free_events.pop() if self._free_events else self.backend.new_event()


def _settle(event: Event) -> None:
    """Wait for an event; a failure is reported later by `poll`, not here."""
    try:
        event.synchronize()
    except Exception:
        pass
