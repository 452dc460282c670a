"""Compact jobs on the GPU: the block ids go up, the device expands them (`offload_core.compact`).

Per job the host uploads one small table (two ids per block for simple jobs, int32 where they
fit; five int64 columns for others) and enqueues, per piece, one expansion kernel and at most
one batch of copies, by one of the mechanisms here (all listed in `TABLE`):

* ``expand_staged``: the kernel gathers the job's entries into a staging half that mirrors its
  host rows (store), or scatters them out of it (load), and the copy engines move the
  host-contiguous segments, whichever goes first on a side stream. A job larger than a half goes
  in pieces of whole host rows that alternate between the two halves (`staging.StagingHalves`),
  one's kernel beside the copies of the one before (two halves of `half_bytes` each: device
  memory per queue stream);
* ``expand_direct``: the kernel reads or writes the host rows through their unified addresses:
  no staging, but it holds SMs while the bytes cross the link;
* ``ce_batch`` (host-expanded): the copies, expanded on the host, in one batched copy; or
  ``ce_loop``, one copy a call, for drivers without the batch call. These two also take bare
  batches of descriptors (`CudaBackend.copy_batch`).
"""

from __future__ import annotations

import abc
import time
from typing import ClassVar

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cuda import kernels, tuning
from offload_core.backends.cuda.driver import SRC_ACCESS_ORDER_ANY, SRC_ACCESS_ORDER_STREAM
from offload_core.backends.cuda.select import cheapest
from offload_core.backends.cuda.staging import PerStream, StagingHalves
from offload_core.compact import CompactJob, CompactLayout

# How many programs an ``expand_direct`` launch takes (`BlockCopier.direct_programs`): each
# holds an SM while its bytes cross the link, so as few as keep up with it. Loads need more
# requests in flight than stores; pages under `SIZED_PAGE` move slower per program.
HOST_BOUND_BYTES = 1 << 20  # jobs averaging at most this are bound by the host's time per job
LONG_ROW_BYTES = 4096
SIZED_PAGE = 1024  # the smallest entry whose jobs `direct_programs` sizes
STORE_BYTES_PER_PROGRAM = 512 << 10  # then a store takes one program per this much of a job
MIN_STORE_PROGRAMS = 2
SMALL_LOAD_PROGRAMS = 8  # and a small load these
SMALL_PAGE_STORE_PROGRAMS = 4  # a store of smaller pages averaging more than HOST_BOUND_BYTES a job
# Stores up to this of entries from SIZED_PAGE to DIRECT_STORE_PAGE keep up with the link on
# MIN_STORE_PROGRAMS.
DIRECT_STORE_BYTES = 4 << 20
DIRECT_STORE_PAGE = 4096
MAX_ITEMS = 1 << 30  # kernel items per piece: its indices are 32-bit
# Staging is a candidate only where its host segments are at most this share of a launch's
# copies: it moves them after a kernel and a batch call of its own, which saving fewer copies
# does not repay (one tensor's scattered blocks, joined and sorted, meet a few neighbours).
STAGED_SEGMENTS_SHARE = 0.5


class Prepared:
    """A layout's tables on the device, and what the backend decided about it once."""

    def __init__(self, torch, device, layout: CompactLayout):
        self.layout = layout
        self.entries = torch.from_numpy(layout.entries.copy()).to(device)
        self.groups = torch.from_numpy(layout.group_entries.copy()).to(device)
        self.entry_count = layout.entries.shape[1]
        self.group_count = layout.group_entries.shape[1]
        self.per_block = max(1, layout.max_entries)
        self.direct_ok: bool | None = None  # the host rows are device-addressable; known at the first job
        self.narrow = narrow_ids(layout)
        self.whole_rows = {d: layout.whole_rows(d) for d in Direction}  # each block writes its whole host row
        self.decided: dict[tuple, Mechanism] = {}  # auto's decided mechanisms, by `BlockCopier._tuned`


def narrow_ids(layout: CompactLayout) -> bool:
    """Whether `layout`'s jobs are simple and their ids go up as int32 (half the bytes to upload
    and hold). The upload casts unchecked: a simple job's ids reach a launch only through the
    submit's checks against `CompactLayout.id_limit`."""
    return layout.id_limit is not None and layout.id_limit <= 1 << 31


class BlockCopier:
    """Enqueues compact jobs for a `CudaBackend`.

    Args:
        backend: the backend (its driver, ring, streams and host ranges).
        half_bytes: bytes of each staging half.
        tuner: where auto's choices are measured (`tuning`), or None: the cost model's rules alone.
    """

    def __init__(self, backend, half_bytes: int, tuner: tuning.Tuner | None = None):
        self.backend = backend
        self.half_bytes = half_bytes
        self.staging = PerStream(self._staging_for)
        self.tuner = tuner
        self.timings = tuning.Timings(tuner, self._weighed) if tuner is not None else None

    def _weighed(self, name: str, device_s: float) -> float:
        """A timed launch's device time, ``expand_direct``'s weighed for the SMs it held, as the
        cost model weighs its estimate (`select.CostModel.sm_weight`)."""
        return device_s * self.backend.cost.sm_weight(device_s) if name == EXPAND_DIRECT.name else device_s

    def _staging_for(self, stream) -> StagingHalves:
        b = self.backend
        return StagingHalves(
            b._torch, b.device, stream, b.new_stream(), half_bytes=self.half_bytes, new_event=b._marker
        )

    def prepare(self, layout: CompactLayout) -> Prepared:
        """Upload the layout's tables, and build the kernel for its jobs in both directions so
        that no job waits for the compiler."""
        b = self.backend
        with b._on_device():
            prepared = Prepared(b._torch, b.device, layout)
            stream = b.runtime.current_stream(b.device_index)
            # Triton builds per type of each int argument (32 or 64 bits), and the first launch of
            # a build loads it, waiting for the device to go idle: the values must be of a job's
            # kind. Simple jobs' rows are found from the host block (direct) or from the block
            # (staged, in a device buffer, for which the entry table's address stands in).
            row = layout.row_bytes
            staged = (prepared.entries.data_ptr(), row, False)
            variants = ((layout.host_base, row, True), staged) if layout.simple_jobs else (None,)
            no_table = (b._ring, None, 0, *_tables(prepared))
            for store in (True, False):
                for rows in variants:
                    kernels.expand(
                        *no_table, store, layout.largest, stream, 1, rows, prepared.narrow, device=b.device_index
                    )
        return prepared

    def direct_ok(self, prepared: Prepared) -> bool:
        """Whether the kernel may address the layout's host rows (registered by the worker
        after `prepare`, so asked at the first job)."""
        if prepared.direct_ok is None:
            layout = prepared.layout
            span = layout.host_blocks * layout.row_bytes
            prepared.direct_ok = span > 0 and self.backend.addressable(layout.host_base, span)
        return prepared.direct_ok

    def choose(self, job: CompactJob, prepared: Prepared) -> Mechanism:
        """The cost model's pick for `job` (auto's, without a tuner): the cheapest of `_estimates`."""
        count, small = prepared.layout.segment_summary(job, self._small_limit(job.direction))
        return TABLE[cheapest(self._estimates(job, prepared, count, small))]

    def _small_limit(self, direction: Direction) -> int:
        """Loads: segments this small the batch call moves through the CPU; stores: none."""
        return self.backend.cost.inline_h2d_bytes if direction is Direction.LOAD else 0

    def direct_programs(self, job: CompactJob, prepared: Prepared) -> int:
        """Programs of an ``expand_direct`` launch of `job`: at most the backend's, all of them
        where they were set (``sm_programs``), else sized by the constants above."""
        b, layout, direction = self.backend, job.layout, job.direction
        most = b.sm_programs[direction]
        if b.programs_given:
            return most
        per_job = -(-job.nbytes // max(1, job.jobs))
        if layout.largest < SIZED_PAGE:
            long_rows = prepared.whole_rows[direction] and layout.row_bytes >= LONG_ROW_BYTES
            bound_by_link = direction is Direction.STORE and per_job > HOST_BOUND_BYTES and long_rows
            return min(most, SMALL_PAGE_STORE_PROGRAMS) if bound_by_link else most
        if direction is Direction.LOAD:
            return min(most, SMALL_LOAD_PROGRAMS) if per_job <= HOST_BOUND_BYTES else most
        mid_sized = SIZED_PAGE <= layout.smallest and layout.largest <= DIRECT_STORE_PAGE
        if mid_sized and per_job <= DIRECT_STORE_BYTES:
            return min(most, MIN_STORE_PROGRAMS)
        return max(MIN_STORE_PROGRAMS, min(most, -(-per_job // STORE_BYTES_PER_PROGRAM)))

    def copy(
        self, job: CompactJob, prepared: Prepared, stream, after: list, held: list, forced: Mechanism | None = None
    ) -> str:
        """Enqueue `job` on `stream` (the queue's, which already waits for `after`: the compute
        streams' events and the hazards' ends, `job.host_after`) by `forced`, or by auto's pick
        (`choose`, or `_tuned` with a tuner); returns the mechanism used."""
        key = timed = None
        if forced is not None:
            mechanism = forced
        elif self.tuner is not None:
            mechanism, key, timed = self._tuned(job, prepared)
        else:
            mechanism = self.choose(job, prepared)
        if not timed:
            segments = prepared.layout.segments(job) if mechanism.needs_segments else None
            mechanism.enqueue_job(self, job, prepared, segments, stream, after, held)
            return mechanism.name
        # a trial: the launch between two events on the stream (which every side stream of the
        # job joins before `enqueue_job` returns), and the host's clock around it
        b = self.backend
        try:
            start, end = b.new_event(), b.new_event()
            start.record(stream)
            if mechanism is EXPAND_STAGED:
                # its side stream would start the job's first piece beside the launches before it
                # (a pipelining each trial then shares): timed, the job starts where `start` stands
                self.staging.for_stream(stream).side.wait_event(start)
            t0 = time.perf_counter()  # the host segments are this mechanism's host time too
            segments = prepared.layout.segments(job) if mechanism.needs_segments else None
            mechanism.enqueue_job(self, job, prepared, segments, stream, after, held)
            host_s = time.perf_counter() - t0
            end.record(stream)
        except BaseException:
            self.tuner.dropped(key, mechanism.name)  # no timing from it: another launch is timed instead
            raise
        self.timings.add(key, mechanism.name, job.nbytes, host_s, start, end)
        return mechanism.name

    def _tuned(self, job: CompactJob, prepared: Prepared) -> tuple[Mechanism, tuning.ShapeClass | None, bool]:
        """Auto's mechanism for `job` by measurement, its shape class (None where decided before
        for this layout), and whether to time the launch: the class's winner where one is decided
        and can run here, else the tuner's pick among `tuning.candidates`."""
        self.timings.collect()
        layout = prepared.layout
        per_job, runs = job.nbytes // max(1, job.jobs), tuning.in_runs(job.host_ids, job.jobs)
        # Within a layout these tell the class: a decided class's launch makes no pass over its
        # job, nor the class itself (half of this lookup's time).
        seen = (job.direction, per_job.bit_length(), runs)
        mechanism = prepared.decided.get(seen)
        if mechanism is not None:
            return mechanism, None, False
        key = tuning.shape_class(job.direction.value, layout.smallest, layout.row_bytes, per_job, runs)
        winner = self.tuner.decided(key)
        if winner is not None and self._runs_here(winner, prepared):
            prepared.decided[seen] = TABLE[winner]
            return TABLE[winner], key, False
        count, small = layout.segment_summary(job, self._small_limit(job.direction))
        estimates = self._estimates(job, prepared, count, small)
        name, timed = self.tuner.pick(key, tuning.candidates(estimates, cheapest(estimates)), self.timings.room())
        return TABLE[name], key, timed

    @property
    def batch_ok(self) -> bool:
        """Whether the driver has ``cuMemcpyBatchAsync`` (CUDA 12.8 on), which staging's copies
        and host-expanded jobs take; without it, host-expanded jobs go one copy per call."""
        return "ce_batch" in self.backend.available_mechanisms

    def _runs_here(self, name: str, prepared: Prepared) -> bool:
        """Whether mechanism `name` can move this layout's jobs (as `_estimates` offers them)."""
        if name == EXPAND_STAGED.name:
            return self.batch_ok and prepared.layout.row_bytes <= self.half_bytes
        if name == EXPAND_DIRECT.name:
            return self.direct_ok(prepared)
        return name == self._host_expanded.name

    @property
    def _host_expanded(self) -> HostExpanded:
        return HOST_EXPANDED if self.batch_ok else HOST_LOOPED

    def _estimates(self, job: CompactJob, prepared: Prepared, count: int, small: int) -> dict[str, float]:
        """The cost model's seconds for `job` whose host bytes form `count` segments (`small`
        bytes in those of at most `_small_limit`), by each mechanism that can move it here, in
        `select.cheapest`'s tie order: the copy engines alone (no kernel, no staging), then
        staged, then the SMs. Staging that would join few copies (about a segment per copy: one
        tensor's scattered blocks) moves what ``ce_batch`` moves after a kernel: not offered
        (`STAGED_SEGMENTS_SHARE`)."""
        cost, d, items, nbytes = self.backend.cost, job.direction.value, job.items, job.nbytes
        host = self._host_expanded.name
        out = {host: cost.estimate(host, d, items, nbytes)}
        if self.batch_ok and prepared.layout.row_bytes <= self.half_bytes and count <= STAGED_SEGMENTS_SHARE * items:
            out[EXPAND_STAGED.name] = cost.estimate("expand_staged", d, items, nbytes, count, small)
        if self.direct_ok(prepared):
            out[EXPAND_DIRECT.name] = cost.estimate("expand_direct", d, items, nbytes, count)
        return out

    def expand(self, job, prepared, b0, b1, stream, held, programs: int, stage: int | None = None) -> None:
        """Upload the table of blocks b0..b1 and enqueue the kernel on `stream` with at most
        `programs` programs, on the host buffer's rows where `stage` is None, else on a staging
        buffer's that mirrors them, chunk j at ``stage + j * row_bytes``."""
        layout, b = prepared.layout, self.backend
        if job.simple:  # two columns; the kernel finds the rows
            cols = (job.dev_ids[b0:b1], job.host_ids[b0:b1])
            row = layout.row_bytes
            rows = (layout.host_base, row, True) if stage is None else (stage + b0 * row, row, False)
        else:
            blocks = job.blocks
            chunks = blocks[1, b0:b1]
            if stage is None:
                addresses = layout.host_base + job.host_ids[chunks] * layout.row_bytes
            else:
                addresses = stage + chunks * layout.row_bytes
            cols, rows = (blocks[0, b0:b1], addresses, blocks[2, b0:b1], blocks[3, b0:b1], blocks[4, b0:b1]), None
        store, narrow, tables = job.direction is Direction.STORE, job.simple and prepared.narrow, _tables(prepared)
        kernels.expand(
            b._ring, cols, b1 - b0, *tables, store, layout.largest, stream, programs, rows, narrow, held, b.device_index
        )


class Mechanism(abc.ABC):
    """One way to enqueue a compact job, for `BlockCopier`; stateless. Those that also take a
    bare batch of descriptors (`CudaBackend.copy_batch`) set `takes_batches` and `enqueue`."""

    name: ClassVar[str]
    takes_batches: ClassVar[bool] = False  # a bare batch on a backend forced to it goes as auto
    needs_segments: ClassVar[bool] = False  # whether `enqueue_job` takes the job's host segments

    def why_unavailable(self, backend) -> str | None:
        """None if this mechanism can run on `backend`, else why not."""
        return None

    def refuses_layout(self, copier: BlockCopier, prepared: Prepared) -> str | None:
        """None if this mechanism can take the jobs of `prepared`'s layout, else why not."""
        return None

    @abc.abstractmethod
    def enqueue_job(
        self, copier: BlockCopier, job: CompactJob, prepared: Prepared, segments, stream, after: list, held: list
    ) -> None:
        """Enqueue `job` on `stream`, as `BlockCopier.copy` describes; `segments` are the
        layout's (`CompactLayout.segments`) where `needs_segments`, else None.

        Raises:
            Exception: anything that stops the copies from being enqueued.
        """


def source_order(direction: Direction, waits: bool) -> int:
    """How a batched copy may read its sources. A store's are the live KV cache: in stream order.
    A load's are host rows, which the driver may read out of stream order (small ones through the
    CPU during the call), unless the stream `waits` for a store that may still write them (a
    hazard, `CompactJob.host_after`)."""
    return SRC_ACCESS_ORDER_STREAM if direction is Direction.STORE or waits else SRC_ACCESS_ORDER_ANY


class HostExpanded(Mechanism):
    """Copies on the copy engines, a job's expanded on the host (`CompactLayout.copies`):
    ``ce_batch`` (`batched`: one ``cuMemcpyBatchAsync``) or ``ce_loop`` (one ``cuMemcpyAsync``
    a copy, for drivers without the batch call)."""

    takes_batches = True

    def __init__(self, name: str, batched: bool):
        self.name, self.batched = name, batched

    def why_unavailable(self, backend) -> str | None:
        if self.batched and backend.driver.memcpy_batch is None:
            return "the driver has no cuMemcpyBatchAsync (CUDA 12.8 or later)"
        return None

    def enqueue(self, backend, src, dst, sizes, direction: Direction, stream, held: list, waits: bool) -> None:
        """Enqueue ``dst[i] <- src[i]`` for ``sizes[i]`` bytes on `stream`, after what it waits
        for where `waits` (`source_order`); what the device may still read afterwards goes to
        `held`."""
        if not self.batched:
            backend.driver.memcpy_loop_async(dst, src, sizes, stream.cuda_stream)
            return
        order = source_order(direction, waits)
        backend.driver.memcpy_batch_async(dst, src, sizes, order, stream.cuda_stream, backend.max_batch, held)

    def enqueue_job(self, copier, job, prepared, segments, stream, after, held) -> None:
        src, dst, sizes = prepared.layout.copies(job)
        if sizes.size:
            self.enqueue(copier.backend, src, dst, sizes, job.direction, stream, held, bool(job.host_after))


class ExpandDirect(Mechanism):
    name = "expand_direct"

    def why_unavailable(self, backend) -> str | None:
        return kernels.why_unavailable()

    def refuses_layout(self, copier, prepared) -> str | None:
        if copier.direct_ok(prepared):
            return None
        return "expand_direct needs host memory from alloc_host or pin_host_memory (device-addressable)"

    def enqueue_job(self, copier, job, prepared, segments, stream, after, held) -> None:
        # it holds its SMs while the bytes cross the link: as few as keep up
        copier.expand(job, prepared, 0, len(job), stream, held, copier.direct_programs(job, prepared))


class ExpandStaged(Mechanism):
    name = "expand_staged"
    needs_segments = True

    def why_unavailable(self, backend) -> str | None:
        if backend.driver.memcpy_batch is None:
            return "its copies need the driver's cuMemcpyBatchAsync (CUDA 12.8 or later)"
        return kernels.why_unavailable()

    def refuses_layout(self, copier, prepared) -> str | None:
        row = prepared.layout.row_bytes
        if row <= copier.half_bytes:
            return None
        return (
            f"expand_staged needs a host row ({row} bytes) to fit a staging half ({copier.half_bytes} bytes): "
            f"raise staging_mb of OFFLOAD_CORE_CUDA_CONF (or staging_bytes) to at least {-(-row // (1 << 20))}, "
            "or let auto choose"
        )

    def enqueue_job(self, copier, job, prepared, segments, stream, after, held) -> None:
        layout, b = prepared.layout, copier.backend
        store = job.direction is Direction.STORE
        st = copier.staging.for_stream(stream)
        row = layout.row_bytes
        seg_stage, seg_host, seg_sizes = segments
        seg_host = seg_host + layout.host_base
        chunks = job.host_ids.size
        per_piece = max(
            1, min(copier.half_bytes // row, MAX_ITEMS // (prepared.per_block * max(1, layout.blocks_per_chunk)))
        )
        cuts = list(range(0, chunks, per_piece)) + [chunks]
        if len(cuts) > 2:  # a segment may run across a cut (consecutive host rows): split it there
            seg_stage, seg_host, seg_sizes = _split(seg_stage, seg_host, seg_sizes, np.array(cuts[1:-1]) * row)
        chunk_of = None if job.simple else job.blocks[1]  # a simple job's block i is in chunk i
        # a store's gather reads what the compute streams wrote (the queue's stream already waits for
        # them); a load's copies into staging read host rows another lane's job may still write
        for event in after if store else job.host_after:
            st.side.wait_event(event)
        held.sides.append(st.side)  # each piece joins it; `_enqueued` does if a failure cuts a piece short
        batch, order = b.driver.memcpy_batch_async, source_order(job.direction, bool(job.host_after))
        for j0, j1 in zip(cuts[:-1], cuts[1:]):
            half = st.halves[st.next]
            free = st.free[st.next]
            st.next ^= 1
            if len(cuts) == 2:
                b0, b1, s0, s1 = 0, len(job), 0, seg_stage.size
            else:
                b0, b1 = (j0, j1) if chunk_of is None else np.searchsorted(chunk_of, (j0, j1)).tolist()
                s0, s1 = np.searchsorted(seg_stage, (j0 * row, j1 * row)).tolist()
            stage = half - j0 * row  # where chunk 0 would lie: chunk j0 lies at the half's start
            staged, host, sizes = seg_stage[s0:s1] + stage, seg_host[s0:s1], seg_sizes[s0:s1]
            if store:
                st.side.wait_event(free)  # the copies that last read this half are done
                if b1 > b0:
                    copier.expand(job, prepared, b0, b1, st.side, held, b.gather_programs, stage)
                st.ready.record(st.side)
                stream.wait_event(st.ready)
                if s1 > s0:
                    batch(host, staged, sizes, SRC_ACCESS_ORDER_STREAM, stream.cuda_stream, 0, held)
                free.record(stream)
            else:
                st.side.wait_event(free)  # the scatter that last read this half is done
                if s1 > s0:
                    batch(staged, host, sizes, order, st.side.cuda_stream, 0, held)
                st.ready.record(st.side)
                stream.wait_event(st.ready)
                if b1 > b0:
                    copier.expand(job, prepared, b0, b1, stream, held, b.gather_programs, stage)
                free.record(stream)
        held.sides.pop()


HOST_EXPANDED, HOST_LOOPED = HostExpanded("ce_batch", batched=True), HostExpanded("ce_loop", batched=False)
EXPAND_STAGED = ExpandStaged()
EXPAND_DIRECT = ExpandDirect()
# every mechanism, the one place they are listed (the order is the copy engines' first: the
# order of `select.cheapest`'s ties and of the names in messages)
TABLE: dict[str, Mechanism] = {m.name: m for m in (HOST_EXPANDED, HOST_LOOPED, EXPAND_STAGED, EXPAND_DIRECT)}
MECHANISMS = tuple(name for name, m in TABLE.items() if m.takes_batches)  # for descriptor batches too
BLOCK_MECHANISMS = tuple(name for name, m in TABLE.items() if not m.takes_batches)  # for compact jobs only


def _tables(prepared: Prepared) -> tuple:
    """`kernels.expand`'s arguments `entries` to `per_block`."""
    p = prepared
    return p.entries.data_ptr(), p.entry_count, p.groups.data_ptr(), p.group_count, p.per_block


def _split(stage: np.ndarray, host: np.ndarray, sizes: np.ndarray, cuts: np.ndarray):
    """Segments cut at the staging offsets `cuts`, so that none runs across one."""
    ends = stage + sizes
    # Usually none does (scattered host rows merge rarely): then the segments are the answer.
    around = np.searchsorted(stage, cuts) - 1  # the last segment starting before each cut
    if not (ends[around[around >= 0]] > cuts[around >= 0]).any():
        return stage, host, sizes
    points = np.union1d(stage, cuts)
    owner = np.searchsorted(stage, points, "right") - 1  # the segment each point falls in, if any
    inside = (owner >= 0) & (points < ends[np.maximum(owner, 0)])
    points, owner = points[inside], owner[inside]
    stop = np.minimum(np.append(points[1:], ends[-1]), ends[owner])
    return points, host[owner] + (points - stage[owner]), stop - points
