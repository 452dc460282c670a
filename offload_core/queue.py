"""One lane: an ordered, asynchronous transfer queue for one direction, over the Backend ABC.

A lane's jobs run in submission order on its one copy stream, each after the caller's compute
stream as it was at submit; results come from the head of the queue, so in order. Pending jobs
are coalesced into launches, made by the submitting thread, the lane's launcher thread or a
`wait`: docs/architecture.md says when (§4), under which locks (§7) and what an interrupt or a
failed launch does (§9).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, NamedTuple

import numpy as np

from offload_core.backend import Backend, Direction, Event, enqueue_lock
from offload_core.compact import CompactJob
from offload_core.errors import OffloadError
from offload_core.interrupts import deferred

log = logging.getLogger(__name__)

MAX_LAUNCH = 256  # jobs in one launch at most
MAX_QUIET_S = 0.005  # the launcher launches once no submit came for a launch's time, or this long
_NOTHING: frozenset[int] = frozenset()  # `_launching` when nothing launches
IDLE_POLL_S = 0.1  # how often a waiting launcher looks whether its queue was dropped or the interpreter exits
SETTLE_POLL_S = 0.001  # how often a drain asks an event whose wait failed whether the work has passed
# The launcher lets the GIL go this long around an enqueue: about the kernel's timer slack, long
# enough for a woken thread to take it (after time.sleep(0) the launcher usually wins it back).
GIL_YIELD_S = 20e-6
LAUNCH_CREEP = 1.0625  # a launch of one job's least time may rise this much a launch: the host may slow
JOIN_PAYS = 0.2  # submits join a burst where joining saves the host at least this part of a job's time
BACKLOG = 2  # launches of a lane the device has yet to run, from which a submit's job waits to join
PROBE_EVERY = 16  # launches of one kind in a row (of one job, of several), after which the other kind is measured again


@dataclass(frozen=True, init=False)
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

    def __init__(
        self, job_id: int, success: bool, transfer_size: int, transfer_time: float, direction: str, mechanism: str = ""
    ):
        # one per job: the fields at once (the generated __init__ sets each through a call)
        self.__dict__.update(
            job_id=job_id,
            success=success,
            transfer_size=transfer_size,
            transfer_time=transfer_time,
            direction=direction,
            mechanism=mechanism,
        )


@dataclass
class QueueStats:
    """Counters since the queue was made: jobs queued, their bytes and copy descriptors, jobs that failed."""

    jobs: int = 0
    bytes: int = 0
    descriptors: int = 0
    failed: int = 0
    mechanisms: Counter = field(default_factory=Counter)  # jobs per mechanism
    launches: int = 0  # times the device was given work: jobs / launches is how much coalescing did
    launch_s: float = 0.0  # host seconds spent enqueueing launches (on any thread)
    backpressure_waits: int = 0  # submits that waited because `max_pending` jobs were waiting for a launch
    backpressure_s: float = 0.0  # seconds those submits waited
    buffer_waits: int = 0  # enqueues that waited for the device: a buffer of the backend was full
    buffer_wait_s: float = 0.0  # seconds they waited (part of `launch_s`)


class _Job(NamedTuple):
    job_id: int
    seq: int  # the worker's submit order, across lanes (`TransferQueue.end_of`)
    start: Event | None  # None: the launch failed to enqueue
    end: Event | None
    nbytes: int
    held: object  # what the device may still read (the launched jobs, with their copies), until `end`
    mechanism: str
    share: float = 1.0  # of the launch's time, this job's part (by bytes)
    last: bool = True  # the last job of its launch: its events go back to the pool with it
    failed: bool = False  # its launch failed to enqueue: reported, once `end` has passed, as failed


class _Pending(NamedTuple):
    job_id: int
    job: CompactJob
    prepared: Any
    ready: Event  # recorded on the caller's compute stream at submit
    stream: Any  # that stream
    seq: int  # the worker's submit order, across lanes
    waits: tuple  # end events of other lanes' jobs this one must follow on the device (hazards)


class TransferQueue:
    """Runs the jobs of one direction (one lane) on `backend` in submission order. Safe to call
    from several threads (see the module docstring)."""

    max_pending = 1024  # jobs waiting for a launch before a submit waits (back-pressure)
    burst_jobs = 16  # jobs of a burst that wait for the launcher before a submit launches them itself
    burst_bytes = 128 << 20  # or their bytes: about 2.4 ms of a PCIe 5 link, several launches' host time

    def __init__(self, backend: Backend, direction: Direction):
        self.backend = backend
        self.direction = direction
        self._stream = backend.new_stream()
        self._stream_released = False  # by `close`; a release that raised other than an Exception is redone
        self._enqueue = enqueue_lock(backend)
        # Re-entrant: `Condition.wait` then restores it in C, which a Ctrl-C cannot split.
        self._lock = threading.RLock()
        self._jobs: deque[_Job] = deque()
        self._ids: set[int] = set()
        self._free_events: list[Event] = []
        self.stats = QueueStats()
        self._pending: deque[_Pending] = deque()  # jobs waiting for a launch
        self._pending_bytes = 0  # their bytes
        self._launching: frozenset[int] | set[int] = _NOTHING  # ids of the launch being enqueued
        self._batch: list[_Pending] | None = None  # that launch's jobs, as `_take` took them
        self._enqueued: tuple[list, Event, list] | None = None  # (batch, end event, held) once its enqueue began
        self._launched = threading.Condition(self._lock)  # notified after each launch, and on new pending jobs
        self._launcher: threading.Thread | None = None
        self._last_submit = float("-inf")  # perf_counter when the last submit returned
        self._ends: deque[tuple[int, Event]] = deque(maxlen=BACKLOG)  # (last seq, end) of the last launches
        self._lent: dict[int, Event] = {}  # ends handed out by `end_of`, by id: never pooled
        self.added_seq = 0  # the submit order of the last job added
        self.reported_seq = 0  # the submit order of the last job `poll` reported: every earlier one has been
        self.launch_cost = LaunchCost()  # a launch's host time: when submits form a burst
        self._closed = False

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._ids

    def __len__(self) -> int:
        return len(self._jobs) + len(self._pending) + len(self._launching)

    def add(self, job_id: int, job: CompactJob, prepared: Any, seq: int, waits: tuple) -> list[_Pending] | None:
        """Queue one job (its id not in flight) behind every earlier one and behind the caller's
        compute stream, waiting for a launch. Never enqueues on the device. `seq` is its place in
        the worker's submit order; `waits`, the ends of other lanes' launches it must follow.

        Returns:
            The jobs the caller must launch now (`launch`): this submit is not part of a burst
            nor behind a backlog on the device, or a burst's worth waits. Else None: the
            launcher thread will.

        Raises:
            OffloadError: the queue is closed, or its launcher thread cannot be started.
        """
        compute = self.backend.current_stream()  # the caller's: the launcher thread has its own
        with self._lock:
            if self._closed:
                raise OffloadError(f"the {self.direction.value} queue is closed")
            self._wait_for_room()
            if self._closed:
                raise OffloadError(f"the {self.direction.value} queue was closed while the job waited")
            self._ensure_launcher()
            ready = self._event()
            # Under the lock: per compute stream, pending order is recording order (`_after`).
            ready.record(compute)
            self._ids.add(job_id)
            self._pending.append(_Pending(job_id, job, prepared, ready, compute, seq, waits))
            self.added_seq = seq
            self._pending_bytes += job.nbytes
            # In a burst (`LaunchCost.window`), or behind a backlog on the device, jobs wait for
            # the launcher or a full burst, and go as one: that saves the host launches, and the
            # device its cost per launch. Other jobs go at once, as the launcher may not get the
            # GIL for a while.
            burst = time.perf_counter() - self._last_submit < self.launch_cost.window
            if not self._launching and (self._burst_full() or not (burst or self._backlog() is not None)):
                return self._take()
            self._last_submit = time.perf_counter()
            if len(self._pending) == 1:  # the launcher takes it; with more, it already knows of some
                self._launched.notify_all()
            return None

    def wait_for_room(self) -> None:
        """Wait while `max_pending` jobs wait for a launch (back-pressure), as `add` would; it
        changes nothing, so a caller may wait here where an interrupt should reach it."""
        if len(self._pending) >= self.max_pending:
            with self._lock:
                self._wait_for_room()

    def _wait_for_room(self) -> None:
        if len(self._pending) < self.max_pending:
            return
        t0 = time.perf_counter()
        try:
            while len(self._pending) >= self.max_pending and not self._closed:
                self._ensure_launcher()  # someone must launch what waits
                self._launched.wait(IDLE_POLL_S)
        finally:
            self.stats.backpressure_waits += 1
            self.stats.backpressure_s += time.perf_counter() - t0

    def poll(self) -> list[TransferResult]:
        """Results of the jobs completed so far, from the head of the queue, without blocking."""
        passed = None  # (end event, seconds) of the last reported job's launch: its other jobs share both
        results = []
        with self._lock:
            while self._jobs:
                job = self._jobs[0]
                try:
                    # A failed launch too waits for what it enqueued: the engine may reuse the
                    # blocks as soon as it sees the result.
                    known = passed is not None and passed[0] is job.end
                    if job.end is not None and not known and not job.end.query():
                        break
                    ok = not job.failed
                    if ok and not known:
                        passed = (job.end, job.start.elapsed_time(job.end) / 1e3)
                    elapsed = passed[1] * job.share if ok else 0.0
                except Exception as exc:  # a device fault fails this job, not the caller's loop
                    log.error(
                        "%s job %s (%s) failed on the device: %r", self.direction.value, job.job_id, job.mechanism, exc
                    )
                    ok, elapsed = False, 0.0
                results.append(TransferResult(job.job_id, ok, job.nbytes, elapsed, self.direction.value, job.mechanism))
                self._ids.discard(job.job_id)
                self.reported_seq = job.seq
                self._jobs.popleft()
                self.stats.failed += not ok
                # an end another lane's job waits for (`end_of`) is never recorded again under it
                lent = job.last and self._lent.pop(id(job.end), None) is not None
                if ok and job.last:  # events that saw a fault are not trusted again
                    events = (job.start,) if lent else (job.start, job.end)
                    self._free_events += events
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until the named jobs (and so every job before them) have completed. Results are
        not consumed: `poll` still reports them. Unknown ids are ignored."""
        with self._lock:
            wanted = job_ids & self._ids

        def through() -> tuple:
            # A named job not launched yet is launched now, on this thread, with the jobs before it.
            pos = max((i for i, p in enumerate(self._pending) if p.job_id in wanted), default=-1)
            if pos >= 0 or not self._launching.isdisjoint(wanted):
                return pos + 1, None
            # Else the last end recorded up to the newest named job (a launch that failed before
            # enqueuing has none); searched from the newest: results not taken may be thousands.
            named = False
            for job in reversed(self._jobs):
                named = named or job.job_id in wanted
                if named and job.end is not None:
                    return None, job.end
            return None, None

        last = self._launch_through(through) if wanted else None
        if last is not None:
            _settle(last)

    def end_of(self, seq: int) -> Event | None:
        """The end event of the launch carrying this lane's last unreported job of submit order up
        to `seq` that recorded one, launching it first on this thread where it still waits; None
        where there is none. The lane runs in order, so this covers every earlier job, whatever
        became of job `seq` itself (a launch that failed before enqueuing recorded no end, and
        moved no byte: the end before it is the one to wait for)."""

        def through() -> tuple:
            if self._batch is not None and self._batch[0].seq <= seq:
                return 0, None  # launching on another thread: wait for it
            waiting = bisect.bisect_right(self._pending, seq, key=lambda p: p.seq)  # in submit order
            if waiting:
                return waiting, None
            for job in reversed(self._jobs):  # launched: the recent end, usually
                if job.seq <= seq and job.end is not None:
                    self._lent[id(job.end)] = job.end
                    return None, job.end
            return None, None

        return self._launch_through(through)

    def _launch_through(self, through) -> Any:
        """Launch waiting jobs on this thread until `through()` (called under the lock) returns
        ``(None, result)``, and return `result`. ``(n, None)``: launch the first n waiting jobs,
        after the launch under way (n 0: just wait for it). Each launch is one step for Ctrl-C."""
        while True:
            with deferred():
                with self._lock:
                    n, result = through()
                    if n is None:
                        return result
                    batch = self._take(n) if n and not self._launching else None
                if batch is not None:
                    self._run(batch)
                    continue
            with self._lock:
                if self._launching:
                    self._launched.wait(IDLE_POLL_S)

    def finish(self) -> None:
        """Wait for every queued job, launching on this thread those not launched yet; the results
        stay for `poll`."""

        def through() -> tuple:
            if self._pending or self._launching:
                return len(self._pending), None
            return None, [job.end for job in self._jobs if job.end is not None]

        for end in self._launch_through(through):  # each: a fault on one may not have waited for the rest
            _settle(end)

    def close(self) -> list[TransferResult]:
        """Refuse further jobs, `finish`, stop the launcher thread and release the stream (once,
        over any number of calls). Returns all pending results."""
        with self._lock:
            self._closed = True
        self.finish()
        results = self.poll()
        with self._lock:
            self._launched.notify_all()  # the launcher sees `_closed` with nothing left, and ends
        if not self._stream_released:
            try:
                self.backend.release_stream(self._stream)
            except Exception:  # what the backend keeps for the stream stays kept; shutdown goes on
                log.exception("%s could not release the %s stream", self.backend.name, self.direction.value)
            self._stream_released = True
        return results

    def _event(self) -> Event:
        return self._free_events.pop() if self._free_events else self.backend.new_event()

    def waiting_for_launch(self) -> bool:
        """Whether jobs wait for a launch, or one is being enqueued."""
        return bool(self._pending or self._launching)

    def launch(self, batch: list[_Pending]) -> None:
        """Launch `batch`, which `add` took for this thread; failures become the jobs' results."""
        try:
            self._run(batch)
        finally:
            self._last_submit = time.perf_counter()

    def _ensure_launcher(self) -> None:
        """Start the launcher thread if there is none (lock held); OffloadError where no thread can
        start (none left, or the interpreter is exiting)."""
        if self._launcher is not None:  # it clears the field under this lock on every way out (`_launch_loop`)
            return
        # Not a daemon: one killed at exit inside a torch call that let go of the GIL aborts the
        # process (std::terminate). The launcher ends on its own once the main thread has.
        launcher = threading.Thread(
            target=_launch_loop, args=(weakref.ref(self),), name=f"offload-core-{self.direction.value}-launcher"
        )
        try:
            launcher.start()
        except RuntimeError as exc:
            raise OffloadError(f"cannot start the {self.direction.value} launcher thread: {exc}") from exc
        self._launcher = launcher

    def _run(self, batch: list[_Pending], background: bool = False) -> None:
        """Launch `batch`, which this thread took (`_take`): its jobs are recorded or failed,
        whatever raises. Exceptions other than `Exception` (an interrupt) propagate."""
        try:
            self._launch(batch, background)
        except Exception:
            self._fail(batch)
            log.exception("launching %s jobs %s failed", self.direction.value, [p.job_id for p in batch])
        except BaseException:
            self._fail(batch)
            raise

    def _fail(self, batch: list[_Pending]) -> None:
        """Fail `batch` unless its launch recorded it. If its enqueue had begun, the results come
        once what it enqueued has run, holding what it may read until then."""
        with self._lock:
            if self._batch is not batch:
                return
            end, held = None, batch
            if self._enqueued is not None and self._enqueued[0] is batch:
                # No launch of this queue can come between: the batch still holds `_launching`.
                try:
                    end, held = self._enqueued[1], self._enqueued[2]
                    end.record(self._stream)
                except Exception:
                    end, held = None, batch  # the device is lost
            self._jobs += [_Job(p.job_id, p.seq, None, end, p.job.nbytes, held, "", failed=True) for p in batch]
            self._launching, self._batch, self._enqueued = _NOTHING, None, None
            self._launched.notify_all()

    def _backlog(self) -> Event | None:
        """Where the device has yet to run `BACKLOG` launches of this lane, the end of the first."""
        if len(self._ends) < BACKLOG:
            return None
        seq, end = self._ends[0]
        try:  # a reported launch has passed (its events may be pooled since)
            return end if seq > self.reported_seq and not end.query() else None
        except Exception:  # a fault: reported with its jobs; new work may go
            return None

    def _burst_full(self) -> bool:
        """Whether enough waits to launch now, burst or not: its device time covers a launch, or
        two jobs measure the fixed part (`LaunchCost.pair`)."""
        jobs = min(2, self.burst_jobs) if self.launch_cost.pair else self.burst_jobs
        return len(self._pending) >= jobs or self._pending_bytes >= self.burst_bytes

    def _take(self, limit: int = MAX_LAUNCH) -> list[_Pending] | None:
        """The jobs of the next launch, marked as launching: the first `limit` waiting (at most
        `MAX_LAUNCH`; one where `LaunchCost.probe` asks), up to the first clash (`_first_clash`);
        None if nothing waits. Call with the lock held, nothing launching."""
        pending = self._pending
        if not pending:
            return None
        n = 1 if self.launch_cost.probe else min(limit, MAX_LAUNCH, len(pending))
        # Windows growing fourfold from a burst's size: an early clash costs a short look.
        size = min(n, max(1, self.burst_jobs))
        while True:
            take = _first_clash([pending[i].job for i in range(size)])
            if take < size or size == n:
                break
            size = min(n, 4 * size)
        batch = list(islice(pending, take))
        self._pending = deque(islice(pending, take, None))
        self._pending_bytes -= sum(p.job.nbytes for p in batch)
        self._launching, self._batch = {p.job_id for p in batch}, batch
        return batch

    def _launch(self, batch: list[_Pending], background: bool = False) -> None:
        """Enqueue `batch` as one job on the device; its jobs share the launch's events.
        `background`: on the launcher thread, which lets the GIL go around the enqueue."""
        t0 = time.perf_counter()
        with self._lock:
            start, end = self._event(), self._event()
        jobs = [p.job for p in batch]
        nbytes, items = sum(j.nbytes for j in jobs), sum(j.items for j in jobs)
        stream = self._stream
        after = _after(batch)
        held = [jobs]  # what the device may read, until `end` has passed: the joined job joins it
        if background:
            time.sleep(GIL_YIELD_S)
        with self._enqueue:
            t_locked = time.perf_counter()  # waiting for another lane's enqueue is not the host's cost
            waited = self.backend.buffer_waits()
            self._enqueued = (batch, end, held)  # from here a failed batch waits for `end` (`_fail`)
            try:
                for ready in after:
                    stream.wait_event(ready)
                start.record(stream)
                # host-block order where that joins host rows: copies within a launch run in any order
                job = CompactJob.concat(jobs).in_host_order()
                job.host_after = tuple(w for p in batch for w in p.waits)
                held.append(job)
                mechanism = self.backend.copy_blocks(job, batch[0].prepared, stream, after) if len(job) else None
                end.record(stream)
            except Exception as exc:
                log.error(
                    "%s jobs %s could not be enqueued on %s: %r",
                    self.direction.value,
                    [p.job_id for p in batch],
                    self.backend.name,
                    exc,
                )
                self._fail(batch)  # under the enqueue lock, as every event of the stream is recorded
            with self._lock:
                self._free_events += [p.ready for p in batch]  # their waits are enqueued: free to record again
                if self._batch is batch:  # enqueued (`_fail` let it go otherwise)
                    last = len(batch) - 1
                    mechanism = mechanism or ""
                    total = max(1, nbytes)
                    # Recorded and released before anything that can raise (a backend's odd
                    # mechanism in the stats, say): `_run` fails a batch still marked launching.
                    self._jobs += [
                        _Job(
                            p.job_id, p.seq, start, end, p.job.nbytes, held, mechanism, p.job.nbytes / total, i == last
                        )
                        for i, p in enumerate(batch)
                    ]
                    self._launching, self._batch, self._enqueued = _NOTHING, None, None
                    self._launched.notify_all()
                    self._ends.append((batch[-1].seq, end))
                    self.stats.launches += 1
                    self.stats.jobs += len(batch)
                    self.stats.bytes += nbytes
                    self.stats.descriptors += items
                    self.stats.mechanisms[mechanism] += len(batch)
                now = time.perf_counter()
                self.stats.launch_s += now - t0
                waits, wait_s = self.backend.buffer_waits()
                self.stats.buffer_waits += waits - waited[0]
                self.stats.buffer_wait_s += wait_s - waited[1]
                # the host's own time: a wait for the device (a full buffer) says nothing of the next launches
                self.launch_cost.note(len(batch), now - t_locked - (wait_s - waited[1]))
        if background:
            time.sleep(GIL_YIELD_S)


class LaunchCost:
    """A launch's host time split in two: a fixed part, which joining jobs into one launch saves,
    and a part per job, which it does not. From them, `window`: how close together submits come
    in a burst, whose jobs wait to be launched as one.

    A launch of one job gives its time (the least lately: it may rise by `LAUNCH_CREEP` a launch
    of one); a launch of k jobs bounds it from above and, where a launch of one measured it, gives
    the fixed part: (k x one - its time) / (k - 1), averaged. Until it is known, submits closer
    together than a launch of one job form a burst, and `pair` asks that two of them go as one
    launch then, which tells it (a burst's last job waits for no more). Where no launch of one
    came for `PROBE_EVERY` launches, `probe` asks for one: a slow host's measure would otherwise
    hold the window wide, every launch then joining jobs. Where only launches of one came for as
    long, the fixed part is forgotten, to be measured again: one measured too small (a slower
    mechanism's launch joined, as `auto` tries them) would otherwise keep every launch at one job."""

    def __init__(self) -> None:
        self.one = 0.0  # seconds a launch of one job takes; 0 until a launch is seen
        self.measured = False  # `one` is a launch of one job's, not a larger launch's bound
        self.fixed: float | None = None  # the fixed part, once launches of both kinds measured it
        self.window = 0.0  # submits closer together than this form a burst
        self._since_one = 0  # launches since the last launch of one job
        self._since_joined = 0  # launches since the last launch of several

    @property
    def probe(self) -> bool:
        """Whether the next launch should carry one job, to time it again."""
        return self._since_one >= PROBE_EVERY

    @property
    def pair(self) -> bool:
        """Whether two jobs waiting should go as one launch now: it measures the fixed part."""
        return self.fixed is None and self.measured

    def note(self, jobs: int, seconds: float) -> None:
        """A launch of `jobs` jobs took `seconds` of host time."""
        if jobs == 1:
            if self.fixed is not None and seconds < self.fixed:  # it came from a slower host's
                self.fixed = None
            self.one = min(self.one * LAUNCH_CREEP, seconds) if self.one else seconds
            self.measured, self._since_one = True, 0
        elif not self.one or seconds < self.one:
            # a launch of one job takes no longer: what was measured of it, and the fixed part
            # taken from it, were a slow host's
            self.one, self.measured, self.fixed = seconds, False, None
        elif self.measured:
            fixed = (jobs * self.one - seconds) / (jobs - 1)
            self.fixed = fixed if self.fixed is None else self.fixed + 0.25 * (fixed - self.fixed)
            self.fixed = min(max(self.fixed, 0.0), self.one)
        self._since_one += jobs > 1
        self._since_joined = self._since_joined + 1 if jobs == 1 else 0
        if self._since_joined >= PROBE_EVERY:
            self.fixed, self._since_joined = None, 0
        if self.fixed is None:  # until joined launches tell: submits faster than a launch of one join
            self.window = self.one
        else:
            # Joining a job saves the fixed part; it pays where that is `JOIN_PAYS` of the job's
            # host time: the gap to the next submit, the fixed part and the part per job. (Where
            # submits launch their own jobs, their gaps leave the launch out: a gap shorter than
            # a launch does not mean the host falls behind.)
            per_job = self.one - self.fixed
            self.window = max(0.0, self.fixed * (1 / JOIN_PAYS - 1) - per_job)
        self.window = min(self.window, MAX_QUIET_S)


def _launch_loop(queue_ref: weakref.ref[TransferQueue]) -> None:
    """The launcher thread of one queue: launches what waits until the queue is closed, dropped,
    or the main thread has ended. Holds the queue only briefly, so a dropped one can be collected."""
    try:
        _launch_until_done(queue_ref)
    finally:  # however it ends, a submit must then start another (`_ensure_launcher` trusts the field)
        queue = queue_ref()
        if queue is not None:
            with queue._lock:
                if queue._launcher is threading.current_thread():
                    queue._launcher = None


def _launch_until_done(queue_ref: weakref.ref[TransferQueue]) -> None:
    while True:
        queue = queue_ref()
        if queue is None:
            return
        exiting = not threading.main_thread().is_alive()  # the interpreter waits for this thread
        with queue._lock:
            if not queue._pending or queue._launching:
                if (queue._closed or exiting) and not queue._pending and not queue._launching:
                    # under the lock: a later submit starts a new launcher rather than count on this one
                    if queue._launcher is threading.current_thread():
                        queue._launcher = None
                    return
                queue._launched.wait(IDLE_POLL_S)  # then let go of the queue a moment: a dropped one can be collected
                del queue
                continue
            # A burst's submits launch it: a launch here would stall, the device waiting, whenever it
            # let go of the GIL (a submitter keeps it a switch interval). It goes once submits pause.
            quiet = time.perf_counter() - queue._last_submit
            wait = min(queue.launch_cost.window, MAX_QUIET_S) - quiet
            hold = not queue._closed and not exiting and not queue._burst_full()
            if wait > 0 and hold:
                queue._launched.wait(min(wait, IDLE_POLL_S))  # still looking whether the interpreter exits
                del queue
                continue
            # Behind a backlog the jobs wait, to go as one, until the device is a launch from done.
            backlog = queue._backlog() if hold else None
            if backlog is None:
                batch = queue._take()
        if backlog is not None:
            del queue
            with contextlib.suppress(Exception):  # a fault: reported with its jobs
                backlog.synchronize()  # lets go of the GIL; pooled and recorded again meanwhile, it passes later
            del backlog
            continue
        try:
            queue._run(batch, background=True)
        except BaseException:
            log.exception("the %s launcher failed", queue.direction.value)
        del queue, batch


def _first_clash(jobs: list[CompactJob]) -> int:
    """How many of `jobs`, from the first, may go in one launch (copies within it run in any
    order): up to the first that writes bytes an earlier one writes. Keys within one job may
    repeat (groups on different tensors write one host block): `CompactLayout.job` checked them."""
    if len(jobs) < 2:
        return len(jobs)
    keys = [j.destinations() for j in jobs]
    limit = jobs[0].destination_limit
    compiled = jobs[0].layout.native
    if compiled is not None:
        return compiled.first_clash(keys, limit)
    if sum(k.size for k in keys) * 64 >= limit:  # many keys: a byte per possible key, no sort
        seen = np.zeros(limit, dtype=np.bool_)
        for i, k in enumerate(keys):
            if i and seen[k].any():
                return i
            seen[k] = True
        return len(jobs)
    flat = np.concatenate(keys)
    owner = np.repeat(np.arange(len(jobs)), [k.size for k in keys])
    order = np.argsort(flat, kind="stable")  # equal keys in job order
    k, o = flat[order], owner[order]
    clash = (k[1:] == k[:-1]) & (o[1:] != o[:-1])
    return int(o[1:][clash].min()) if clash.any() else len(jobs)  # >= 1: the later job of the first clash


def _after(batch: list[_Pending]) -> list[Event]:
    """The events a launch of `batch` waits for: each compute stream's last ready event (every
    job's, where streams are unhashable), then the other lanes' ends its jobs must follow."""
    last: dict = {}
    hazards = [w for p in batch for w in p.waits]
    try:
        for p in batch:
            last[p.stream] = p.ready
    except TypeError:  # an unhashable stream
        return [p.ready for p in batch] + hazards
    return list(last.values()) + hazards


def _settle(event: Event) -> None:
    """Wait for an event; `poll` reports a failure. Where waiting fails, the event is queried until
    it has passed or fails too: a drain must not let memory go while the work may still run."""
    with contextlib.suppress(Exception):
        event.synchronize()
        return
    while True:
        try:
            if event.query():
                return
        except Exception:  # the device reports the work failed: it runs no further
            return
        time.sleep(SETTLE_POLL_S)
