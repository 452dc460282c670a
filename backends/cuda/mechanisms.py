"""The cuda backend's mechanisms, one object each, and `TABLE`, the one place they are listed.

A batch of descriptors (`CudaBackend.copy_batch`) goes by one of:

* ``ce_batch``: one ``cuMemcpyBatchAsync`` on the copy engines (source order STREAM for
  stores, which read the live KV cache; ANY for loads, which read stable host memory);
* ``staged``: gather the fragments on the device into a staging buffer (or scatter them out
  of it), so that the link sees only host-contiguous runs: a block's pages of all layers;
* ``sm_gather``: one Triton kernel reading and writing pinned host memory through its
  unified address; fast for small fragments, but it occupies SMs;
* ``ce_loop``: one ``cuMemcpyAsync`` per descriptor, for drivers without the batch API.

A worker's compact jobs go by ``expand_staged``, ``expand_direct`` or ``expand_split`` (`blocks`;
the last where forced or the SM penalty is lowered), listed here too so that availability and
names come from one table.
Mechanisms keep no state: what they need (driver, descriptor ring, staging) belongs to the
backend they are handed.
"""

from __future__ import annotations

import abc
import bisect
from typing import ClassVar

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cuda import kernels, staging
from offload_core.backends.cuda.blocks import EXPAND_DIRECT, EXPAND_SPLIT, EXPAND_STAGED
from offload_core.backends.cuda.driver import SRC_ACCESS_ORDER_ANY, SRC_ACCESS_ORDER_STREAM
from offload_core.backends.cuda.select import BatchSummary
from offload_core.runs import run_starts


class Mechanism(abc.ABC):
    """One way to enqueue a batch of descriptors (`CudaBackend.copy_batch`)."""

    name: ClassVar[str]
    takes_batches: ClassVar[bool] = True  # False for the compact-job mechanisms in the table
    # auto weighs this one only where the mechanism named here is unavailable
    fallback_for: ClassVar[str | None] = None

    def why_unavailable(self, backend) -> str | None:
        """None if this mechanism can run on `backend`, else why not."""
        return None

    def refuses(self, backend, host: np.ndarray, sizes: np.ndarray, largest: int | None = None) -> str | None:
        """None if this mechanism can take a batch whose host side is `host` (`largest`, the
        largest size, where known), else why not."""
        return None

    @abc.abstractmethod
    def enqueue(
        self,
        backend,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
        stream,
        held: list,
        summary: BatchSummary | None,
    ) -> None:
        """Enqueue ``dst[i] <- src[i]`` for ``sizes[i]`` bytes on `stream`.

        Args:
            held: what the device may still read after the call is appended here; the
                backend keeps it until an event after the enqueue has passed.
            summary: what auto learned about the batch while choosing, or None.

        Raises:
            Exception: anything that stops the copies from being enqueued.
        """


class CeBatch(Mechanism):
    """One ``cuMemcpyBatchAsync``, split at the backend's `max_batch`."""

    name = "ce_batch"

    def why_unavailable(self, backend) -> str | None:
        if backend.driver.memcpy_batch is None:
            return "the driver has no cuMemcpyBatchAsync (CUDA 12.8 or later)"
        return None

    def enqueue(self, backend, src, dst, sizes, direction, stream, held, summary) -> None:
        order = SRC_ACCESS_ORDER_STREAM if direction is Direction.STORE else SRC_ACCESS_ORDER_ANY
        backend.driver.memcpy_batch_async(dst, src, sizes, order, stream.cuda_stream, backend.max_batch, held)


class CeLoop(Mechanism):
    """One ``cuMemcpyAsync`` per descriptor: a host call each, so auto takes it only where
    the batch API is missing."""

    name = "ce_loop"
    fallback_for = "ce_batch"

    def enqueue(self, backend, src, dst, sizes, direction, stream, held, summary) -> None:
        backend.driver.memcpy_loop_async(dst, src, sizes, stream.cuda_stream)


class SmGather(Mechanism):
    """The copy kernel, reading or writing host memory through its unified address: the
    descriptors go up in one copy, then one launch."""

    name = "sm_gather"

    def why_unavailable(self, backend) -> str | None:
        return kernels.why_unavailable()

    def refuses(self, backend, host, sizes, largest=None) -> str | None:
        if backend.addressable(host, sizes, largest):
            return None
        return "sm_gather needs host memory from alloc_host or pin_host_memory (device-addressable)"

    def enqueue(self, backend, src, dst, sizes, direction, stream, held, summary) -> None:
        programs = backend.sm_programs[direction]
        largest, uniform = (summary or (None, None))[:2]
        kernels.launch(src, dst, sizes, stream, programs, backend._ring, held, largest, uniform, backend.device_index)


class Staged(Mechanism):
    """Device-side gather (store) or scatter (load) through two staging buffers, pipelined.

    Pieces (`staging.pieces`) alternate between the buffers (`staging.StagedPair`): while the
    copy engines move piece k over the link on the copy stream, the kernel gathers piece k+1
    (or scatters piece k-1) on a companion stream, so the link sees only host-contiguous runs
    and the kernel's time hides behind it. Fragments too large to gain from staging go
    straight through the copy engines.

    Staging pays where a job's fragments form few host runs, so the bookkeeping per piece
    and run is plain Python: numpy's fixed cost per call dominated it.
    """

    name = "staged"

    def why_unavailable(self, backend) -> str | None:
        return kernels.why_unavailable()

    def enqueue(self, backend, src, dst, sizes, direction, stream, held, summary) -> None:
        torch = backend._torch
        largest, uniform, starts = summary or (int(sizes.max()), None, None)
        if largest > backend.staging_bytes // 4:
            big = sizes > backend.staging_bytes // 4
            CE_BATCH.enqueue(backend, src[big], dst[big], sizes[big], direction, stream, held, None)
            keep = ~big
            src, dst, sizes, uniform, starts = src[keep], dst[keep], sizes[keep], None, None
            if not sizes.size:
                return
            largest = int(sizes.max())
        store = direction is Direction.STORE
        host, dev = (dst, src) if store else (src, dst)
        pair = backend._staged_buffers.for_stream(stream)
        kernel_stream, bases = pair.kernel_stream, pair.bases
        n = sizes.size
        # With equal sizes a fragment's staging offset is i * size: nothing to compute or upload per fragment.
        uniform = int(sizes.min()) == largest if uniform is None else uniform
        edges = None if uniform else np.concatenate(([0], np.cumsum(sizes)))  # fragment i's offset, then the total
        firsts = staging.pieces(edges, largest, n, store, backend.staging_bytes)
        bounds = firsts + [n]
        if uniform:
            cols = (dev,)
        else:
            piece = np.repeat(np.arange(len(firsts)), np.diff(bounds))
            first_offset = edges[firsts]
            cols = (dev, np.array(bases)[piece % 2] + edges[:-1] - first_offset[piece], sizes)
        starts = (run_starts((host,), largest if uniform else sizes) if starts is None else starts).tolist()
        # The uploads need nothing the job waits for, so they go first, while the copy stream
        # may still be busy; the first piece's go alone, so that in an idle stream its
        # kernel need not wait for the rest.
        split = bounds[1]
        held.sides.append(kernel_stream)  # joined by `_enqueued` if the `finally` below is cut short
        tables = backend._ring.upload(cols, kernel_stream, held, split)
        kernel_stream.wait_stream(stream)  # the job's own waits (compute, earlier jobs) hold for the kernel too
        free = [None, None]  # per buffer: the event after which it may be overwritten
        try:
            for k in range(len(firsts)):
                a, b = bounds[k], bounds[k + 1]
                base = bases[k % 2]
                # The piece starts at offset 0 of its buffer (which holds staging_bytes * 5 / 4,
                # more than a piece); the copy engines move its host-contiguous runs.
                inner = starts[bisect.bisect_right(starts, a) : bisect.bisect_left(starts, b)]
                cut = np.array([a, *inner, b], dtype=np.int64)
                if uniform:
                    run_stage, run_bytes = base + (cut[:-1] - a) * largest, (cut[1:] - cut[:-1]) * largest
                else:
                    e = edges[cut]
                    run_stage, run_bytes = base + (e[:-1] - e[0]), e[1:] - e[:-1]
                run_host = host[cut[:-1]]
                length, at = (split, a) if k == 0 else (n - split, a - split)
                col = [tables[k > 0] + 8 * (j * length + at) for j in range(len(cols))]  # column j, from fragment a
                dev_col, stage_col, size_col = (col[0], (base, largest), (largest, 0)) if uniform else col
                kernel = (dev_col, stage_col) if store else (stage_col, dev_col)
                if store:
                    if free[k % 2] is not None:
                        kernel_stream.wait_event(free[k % 2])
                    kernels.run(
                        *kernel, size_col, b - a, largest, kernel_stream, backend.gather_programs, backend.device_index
                    )
                    stream.wait_event(_recorded(torch, kernel_stream))
                    _copy_runs(backend, run_host, run_stage, run_bytes, stream, held)
                    free[k % 2] = _recorded(torch, stream)
                else:
                    if free[k % 2] is not None:
                        stream.wait_event(free[k % 2])
                    _copy_runs(backend, run_stage, run_host, run_bytes, stream, held)
                    kernel_stream.wait_event(_recorded(torch, stream))
                    kernels.run(
                        *kernel, size_col, b - a, largest, kernel_stream, backend.gather_programs, backend.device_index
                    )
                    free[k % 2] = _recorded(torch, kernel_stream)
        finally:  # the job ends when the kernel stream's work has (a load's last scatter, the uploads)
            stream.wait_stream(kernel_stream)
        held.sides.pop()


def _copy_runs(backend, dst, src, sizes, stream, held) -> None:
    """Staged's host-contiguous runs through the copy engines: one batch call, or one call
    per run where the driver has no batch API."""
    if backend.driver.memcpy_batch is not None:
        backend.driver.memcpy_batch_async(
            dst, src, sizes, SRC_ACCESS_ORDER_STREAM, stream.cuda_stream, backend.max_batch, held
        )
    else:
        backend.driver.memcpy_loop_async(dst, src, sizes, stream.cuda_stream)


def _recorded(torch, stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


CE_BATCH, STAGED, SM_GATHER, CE_LOOP = CeBatch(), Staged(), SmGather(), CeLoop()

# Every mechanism by name. The batch mechanisms come in order of preference on a tie in the
# cost model: copy engines first, then staging (SMs for a moment), then the SM kernel (SMs
# for the whole transfer), then the per-copy loop.
TABLE: dict = {m.name: m for m in (CE_BATCH, STAGED, SM_GATHER, CE_LOOP, EXPAND_STAGED, EXPAND_DIRECT, EXPAND_SPLIT)}
MECHANISMS = tuple(name for name, m in TABLE.items() if m.takes_batches)  # for descriptor batches
BLOCK_MECHANISMS = tuple(name for name, m in TABLE.items() if not m.takes_batches)  # for compact jobs (a worker's)


def contenders(available) -> tuple[Mechanism, ...]:
    """The batch mechanisms auto weighs, in the table's order, given the names of those
    `available`: each available one, but a fallback only where what it stands in for is not."""
    return tuple(
        m for name, m in TABLE.items() if m.takes_batches and name in available and m.fallback_for not in available
    )
