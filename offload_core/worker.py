"""OffloadWorker: the engine-facing API. Owns the host buffer, its `CompactLayout` and one queue per direction."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable

import numpy as np

from offload_core import native
from offload_core.backend import Backend, Direction
from offload_core.compact import CompactLayout
from offload_core.errors import InvalidSpecError, OffloadError, RegionError, flag, integer, positive_int
from offload_core.host_layout import HostLayout
from offload_core.hostmem import check_host_bytes
from offload_core.interrupts import deferred
from offload_core.queue import QueueStats, TransferQueue, TransferResult
from offload_core.region import SharedHostRegion
from offload_core.registry import get_backend
from offload_core.spec import DeviceBlocks, HostBlocks, KVCaches

log = logging.getLogger(__name__)

_REGION_CHECK_S = 1.0  # how often a submit confirms the shared region is still the one the other ranks use


class OffloadWorker:
    """Moves KV-cache blocks between device memory and a host buffer, in order, asynchronously.

    The host buffer has one row per host block; a row holds, back to back, the chunk of
    every KV tensor (``blocks_per_chunk`` pages each), so a host block is one contiguous
    range of bytes. `host_tensors` are strided views into it.

    Args:
        kv_caches: the device KV cache.
        num_host_blocks: host blocks (chunks) to allocate.
        blocks_per_chunk: device blocks per host block.
        backend: a `Backend`, a registry name, or None for the backend of the KV tensors'
            device type (or ``$OFFLOAD_CORE_BACKEND`` when set).
        canonical_layout: lay host pages out as the unsharded model would (each ref's
            `mapping` places this rank's page; refs without one are copied whole), so that ranks
            share one copy of replicated bytes and any TP size can load what another stored.
            A tensor's host page is the largest canonical page among the refs into it.
        host_region: a `SharedHostRegion` to use instead of private host memory; this rank's
            slot, or the canonical area. The region outlives the worker.

    Every method may be called from any thread; nothing a queued copy may touch is freed before
    it has run (`shutdown` drains; a dropped worker drains on a thread of its own); on the main
    thread each call's changes are one step for Ctrl-C. docs/architecture.md §7-§9 has the rules.

    Raises:
        InvalidSpecError: sizes that are not positive integers, a `canonical_layout` that is
            not a truth value (True, False, 0 or 1), KV tensors on a device the
            backend does not copy, or a region that is too small or laid out for the other
            layout.
        OffloadError: the host buffer is larger than the host memory available, or cannot be
            allocated.
        UnknownBackendError, BackendUnavailableError: the backend cannot be had.
        ConfigError: ``OFFLOAD_CORE_NATIVE`` is malformed.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        num_host_blocks: int,
        *,
        blocks_per_chunk: int = 1,
        backend: Backend | str | None = None,
        canonical_layout: bool = False,
        host_region: SharedHostRegion | None = None,
    ):
        if not isinstance(kv_caches, KVCaches):
            raise InvalidSpecError(f"kv_caches must be KVCaches, got {type(kv_caches).__name__}")
        bpc = positive_int(blocks_per_chunk, "blocks_per_chunk")
        num_host_blocks = positive_int(num_host_blocks, "num_host_blocks")
        import torch  # deferred: `import offload_core` stays light

        device = kv_caches.device
        canonical_layout = flag(canonical_layout, "canonical_layout")
        native.load()  # a malformed OFFLOAD_CORE_NATIVE is named here, whichever path the jobs take
        if backend is not None and not isinstance(backend, (Backend, str)):
            raise InvalidSpecError(f"backend must be a Backend, a backend name or None, got {backend!r}")
        if host_region is not None and not isinstance(host_region, SharedHostRegion):
            raise InvalidSpecError(f"host_region must be a SharedHostRegion, got {type(host_region).__name__}")
        if not isinstance(backend, Backend):
            backend = get_backend(backend, device_index=device.index or 0, device_type=device.type)
        if backend.device != device:
            raise InvalidSpecError(f"KV tensors are on {device}, but backend {backend.name!r} copies {backend.device}")
        self.backend = backend
        self.kv_caches = kv_caches  # keeps the device memory alive while we hold its addresses
        self.blocks_per_chunk = bpc
        self.num_host_blocks = num_host_blocks

        layout = HostLayout.of(kv_caches, bpc, canonical_layout)
        self._region = host_region
        if host_region is None:
            nbytes = self.num_host_blocks * layout.row_bytes
            # with the hazard bookkeeping's 24 bytes a host block (`_written_by`, `_read_by`),
            # which outweighs rows of a few bytes
            check_host_bytes(
                nbytes + 24 * self.num_host_blocks,
                "the worker's host buffer (num_host_blocks x host_row_bytes, and 24 bytes a block)",
            )
            try:
                self._host = backend.alloc_host(nbytes)
            except Exception as exc:  # torch reports an allocation failure as RuntimeError
                raise OffloadError(
                    f"could not allocate the worker's host buffer of {nbytes} bytes on {backend.name}: {exc}"
                ) from exc
            rows, stride, slot = self._host.view(self.num_host_blocks, layout.row_bytes), layout.row_bytes, 0
        else:
            layout.check_region(host_region, self.num_host_blocks)
            self._host = host_region.tensor  # read once: another thread may be closing the region
            host_region.check()  # raises if it is closed
            if self._host is None:
                raise RegionError(f"region {host_region.path} is being closed")
            rows, stride, slot = self._host, host_region.row_stride, host_region.slot_offset
        self._next_region_check = time.monotonic() + _REGION_CHECK_S
        self.host_tensors = layout.views(rows.view(torch.int8), slot)
        self.host_row_bytes = stride  # bytes from one host block to the next: every tensor's chunk, back to back
        # Jobs go to the backend as block ids against this table (offload_core.compact).
        self._layout = CompactLayout(
            kv_caches,
            layout,
            self._host.data_ptr() + slot,
            stride,
            self.num_host_blocks,
            elect_writers=host_region is not None,  # in private memory no other rank writes a page
        )
        self._queues = {d: TransferQueue(backend, d) for d in Direction}
        # Loads the engine waits for at once go on their own stream, never behind regular loads.
        self._expedited = TransferQueue(backend, Direction.LOAD)
        self._lanes = (*self._queues.values(), self._expedited)
        for t in kv_caches.tensors:
            backend.register_buffer(t.tensor)
        backend.register_buffer(self._host)
        self._prepared = backend.prepare_layout(self._layout)
        # last: nothing after it can fail and leave it registered
        registered = host_region is not None and _pin(backend, self._host)
        # Hazards between lanes (`_hazards`): per host block, the submit order of the last store
        # into it and of the last load from it in each load lane (regular, expedited).
        self._order = threading.Lock()  # a submit's hazard check and its place in its lane, together
        self._seq = 0
        self._written_by = np.zeros(self.num_host_blocks, dtype=np.int64)
        self._read_by = tuple(np.zeros(self.num_host_blocks, dtype=np.int64) for _ in range(2))
        self._lock = threading.RLock()  # as the queue's: `Condition.wait` restores it in C, which Ctrl-C cannot split
        self._idle = threading.Condition(self._lock)  # notified when the last submit under way ends
        self._in_flight: set[int] = set()  # job ids reserved or queued, or results not yet returned
        self._submitting = 0  # submits under way: `shutdown` waits for them
        self._closed = False
        # per lane, results taken from it and not returned yet (by `shutdown`, or a `get_finished`
        # that was interrupted), in order: returned before what the lane has since
        self._kept: list[list[TransferResult]] = [[] for _ in self._lanes]
        # Holds what queued copies may touch until they have finished, should the worker be
        # dropped without `shutdown`.
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(
            self,
            _dropped,
            self._pid,
            self._lanes,
            backend,
            self._host,
            [registered],  # cleared as it is undone
            (kv_caches, self._prepared),
        )
        self._shutdown_lock = threading.Lock()  # held while draining: a second shutdown waits for it

    def submit_store(self, job_id: int, src: DeviceBlocks, dst: HostBlocks) -> bool:
        """Start copying device blocks to host blocks (device -> host).

        Returns:
            True if queued; False if it could not be queued (logged; nothing of the job stays
            in flight): the lane's launcher thread could not be started, say. Jobs are
            enqueued on the device by launches, coalesced (see `offload_core.queue`): a
            failure there is reported as the job's failed result.

        Raises:
            InvalidSpecError: bad specs or a job id still in flight; nothing was enqueued.
            RegionError: the shared region was removed, replaced or truncated under this rank.
            OffloadError: the worker is shut down, or used from a forked child.
        """
        return self._submit(Direction.STORE, job_id, src, dst)

    def submit_load(self, job_id: int, src: HostBlocks, dst: DeviceBlocks, expedited: bool = False) -> bool:
        """Start copying host blocks to device blocks (host -> device).

        Args:
            expedited: a load the engine is about to wait for: it goes on a lane of its own
                (a stream, ordered among expedited loads), so it never queues behind regular
                loads. Results, waiting and shutdown are the same.

        Returns:
            True if queued; False if it could not be queued (as `submit_store`).

        Raises:
            InvalidSpecError: bad specs, a job id still in flight, or an `expedited` that is not
                a truth value (True, False, 0 or 1); nothing was enqueued.
            RegionError: the shared region was removed, replaced or truncated under this rank.
            OffloadError: the worker is shut down, or used from a forked child.
        """
        return self._submit(Direction.LOAD, job_id, dst, src, expedited=flag(expedited, "expedited"))

    def _submit(
        self, direction: Direction, job_id: int, device: DeviceBlocks, host: HostBlocks, expedited: bool = False
    ) -> bool:
        self._same_process()
        job_id = integer(job_id, "job_id")
        if not isinstance(device, DeviceBlocks) or not isinstance(host, HostBlocks):
            raise InvalidSpecError(
                f"{direction.value} needs DeviceBlocks and HostBlocks, got "
                f"{type(device).__name__} and {type(host).__name__}"
            )
        queue = self._expedited if expedited else self._queues[direction]
        queue.wait_for_room()  # back-pressure, where a Ctrl-C may reach it: it changes nothing
        with deferred():  # from the id's reservation to its launch and clean-up, one step for Ctrl-C
            with self._lock:
                if self._closed:
                    raise OffloadError("OffloadWorker is shut down")
                if job_id in self._in_flight:
                    raise InvalidSpecError(f"job id {job_id} is still in flight")
                self._in_flight.add(job_id)
                self._submitting += 1
            try:
                queued, batch = self._add(queue, direction, job_id, device, host, expedited)
                if batch is not None:  # this submit launches, on the caller's thread; failures are the jobs' results
                    queue.launch(batch)
            finally:
                with self._lock:
                    self._submitting -= 1
                    if not self._submitting and self._closed:  # only `shutdown` waits for it
                        self._idle.notify_all()
        return queued

    def _add(
        self, queue: TransferQueue, direction: Direction, job_id: int, device: DeviceBlocks, host: HostBlocks, expedited
    ) -> tuple[bool, list | None]:
        """Validate a job whose id is reserved and add it to its lane: whether it was added (a
        refusal is logged; the id is let go), and the jobs this submit must launch."""
        added = False
        try:
            if self._region is not None and time.monotonic() >= self._next_region_check:
                self._region.check()
                self._next_region_check = time.monotonic() + _REGION_CHECK_S
            job = self._layout.job(direction, device, host)
            try:
                # Together, so that a later job's check finds this one in its lane; the launch,
                # which may wait for the device, after.
                with self._order:
                    self._seq += 1
                    waits = self._hazards(direction, expedited, job.host_ids, self._seq)
                    batch = queue.add(job_id, job, self._prepared, self._seq, waits)
            except Exception:
                log.exception("%s job %s could not be enqueued on %s", direction.value, job_id, self.backend.name)
                added = job_id in queue  # in its lane all the same (its launch failed after): its result will come
                return added, None
            added = True
            return True, batch
        finally:
            if not added:
                with self._lock:
                    self._in_flight.discard(job_id)

    def _hazards(self, direction: Direction, expedited: bool, hosts: np.ndarray, seq: int) -> tuple:
        """The end events a job's copies must follow (docs/architecture.md §6), recording the job
        as the last of its direction on its host blocks. Call under `_order`."""
        if not hosts.size:
            return ()
        if direction is Direction.STORE:
            self._written_by[hosts] = seq
            found = zip((self._queues[Direction.LOAD], self._expedited), self._read_by)
        else:
            self._read_by[int(expedited)][hosts] = seq
            found = ((self._queues[Direction.STORE], self._written_by),)
        waits = ()
        for lane, last_by in found:
            if lane.added_seq > lane.reported_seq:  # it may have jobs still to run
                last = int(last_by[hosts].max())
                if last > lane.reported_seq:
                    end = lane.end_of(last)
                    if end is not None:
                        waits += (end,)
        return waits

    def stats(self) -> dict[str, QueueStats]:
        """Counters per lane (``"store"``, ``"load"``, ``"expedited_load"``): see `QueueStats`."""
        return {**{d.value: q.stats for d, q in self._queues.items()}, "expedited_load": self._expedited.stats}

    def get_finished(self) -> list[TransferResult]:
        """Results of completed jobs: stores, then loads, then expedited loads, each in submission
        order. Never blocks on the device; each result is returned once, to one caller."""
        self._same_process()
        lanes = None
        try:
            # Under the lock, as `shutdown` collects: a lane's results leave it in the order they came.
            with deferred(), self._lock:
                for kept, queue in zip(self._kept, self._lanes):
                    kept += queue.poll()
                lanes, self._kept = self._kept, [[] for _ in self._lanes]
                results = [r for lane in lanes for r in lane]
                self._in_flight.difference_update(r.job_id for r in results)
        except BaseException:
            # A Ctrl-C raised as the step ends: the results, ids and all, go back for the next
            # call (the caller has not seen them, so cannot have reused their ids).
            if lanes is not None:
                with deferred(), self._lock:
                    for kept, lane in zip(self._kept, lanes):
                        kept[:0] = lane
                    self._in_flight.update(r.job_id for lane in lanes for r in lane)
            raise
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs have completed; their results stay for `get_finished`.

        Unknown or already reported ids are ignored. Holds no lock while it waits.

        Raises:
            InvalidSpecError: `job_ids` is not an iterable of integers (a bare id, say).
        """
        self._same_process()
        # a 0-d array or tensor claims to be iterable and is not
        if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable) or getattr(job_ids, "ndim", 1) == 0:
            raise InvalidSpecError(f"wait takes an iterable of job ids, got {job_ids!r}; for one job: wait([job_id])")
        job_ids = {integer(j, "a job id passed to wait") for j in job_ids}
        for queue in self._lanes:
            queue.wait(job_ids)

    def shutdown(self) -> None:
        """Refuse new jobs, let submits under way finish, wait for every job in flight, then
        release the host memory. Calling it again (from any thread) waits for the first call;
        if that one was interrupted (Ctrl-C), the next call finishes its work.

        Results of jobs that finished here stay available from `get_finished`. In a process
        forked from the one that made the worker, it only marks the worker closed: the
        parent's copies are not the child's to wait for.
        """
        if os.getpid() != self._pid:
            # No lock: the fork may have copied it held, or a submit count no thread will lower.
            self._closed = True
            return
        with self._lock:
            self._closed = True
            while self._submitting:
                self._idle.wait()
        with self._shutdown_lock:
            if self._host is None:
                return  # an earlier call finished
            # Waited for while the finalizer still holds the memory: an interruption here leaves
            # it held, and the next call (or the collector) waits again.
            for queue in self._lanes:
                queue.finish()
            with deferred():  # then let go of it, as one step for Ctrl-C
                with self._lock:  # as `get_finished` polls: the lane's results stay in order
                    for kept, queue in zip(self._kept, self._lanes):
                        kept += queue.poll()
                # The finalizer holds the memory until the lanes are closed: should a close raise,
                # the next call (or the finalizer) closes them again (`TransferQueue.close`).
                held = self._finalizer.peek()
                if held is not None:
                    lanes = _drain(*held[2][1:])
                    with self._lock:
                        for kept, results in zip(self._kept, lanes):
                            kept += results
                self._finalizer.detach()
                self.host_tensors = []
                self._layout = self._prepared = None
                self._host = None  # a shared region outlives the worker: its owner closes it

    def _same_process(self) -> None:
        if os.getpid() != self._pid:
            raise OffloadError(
                f"this OffloadWorker was made in process {self._pid}; a forked child cannot use its streams: "
                "make a new worker in the child"
            )

    def __enter__(self) -> OffloadWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _drain(queues, backend: Backend, host, registered: list[bool], kept) -> list[list[TransferResult]]:
    """Close `queues` (waiting for their jobs), then undo the host registration if
    ``registered[0]`` (cleared first); returns each queue's results. `kept` (the KV caches, the
    prepared layout) is passed only to be held until this returns."""
    results = [queue.close() for queue in queues]
    if registered[0]:
        registered[0] = False
        try:
            _unpin(backend, host)
        except Exception:
            log.exception("unregistering a worker's host memory failed")
    return results


# Workers of one process that share a region share its registration: the first registers it,
# the last to shut down unregisters it (another worker's copies may still read it before).
_pins: dict[tuple[int, int, int], int] = {}  # (id of the backend, address, bytes) -> workers
# Re-entrant: a collection inside a backend's (un)pin call may finalize a dropped worker on this
# thread, whose drain unpins another region (never this one: a worker still holds it).
_pins_lock = threading.RLock()


def _pin(backend: Backend, host) -> bool:
    """Register `host` with `backend` for this worker; whether it is registered."""
    key = (id(backend), host.data_ptr(), host.numel() * host.element_size())  # the workers hold the backend
    with _pins_lock:
        count = _pins.get(key, 0)
        if count == 0 and not backend.pin_host_memory(host):
            return False
        _pins[key] = count + 1
        return True


def _unpin(backend: Backend, host) -> None:
    key = (id(backend), host.data_ptr(), host.numel() * host.element_size())
    with _pins_lock:  # held through the call: a worker registering meanwhile must find it done
        count = _pins.pop(key, 1) - 1
        if count:
            _pins[key] = count
        else:
            backend.unpin_host_memory(host)


def _dropped(pid: int, *held) -> None:
    """The garbage collector took a worker that was never shut down (or the interpreter exits)."""
    if os.getpid() != pid:
        return  # a forked child: the copies, and the streams that run them, are the parent's
    queues = held[0]
    pending = sum(len(q) for q in queues)
    if pending:
        log.warning("OffloadWorker dropped without shutdown() with %d jobs in flight: draining them first", pending)
    # The collector may run on any thread, even one a backend's stream needs, or one holding the
    # enqueue lock that unlaunched jobs need: only the main thread waits here, and only for
    # launched jobs; otherwise a thread of its own waits, holding the memory.
    unlaunched = any(q.waiting_for_launch() for q in queues)
    if pending and (unlaunched or threading.current_thread() is not threading.main_thread()):
        with contextlib.suppress(RuntimeError):  # an exiting interpreter starts no threads: drained here
            # not a daemon: the interpreter waits for it rather than kill it inside a torch call
            threading.Thread(target=_drain, args=held, name="offload-core-drain").start()
            return
    with deferred():  # on the main thread: a Ctrl-C must not end the drain, which lets the memory go
        _drain(*held)
