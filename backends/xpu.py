"""The xpu backend: Intel GPUs through upstream torch.xpu (torch 2.6+, whose events time copies;
no intel-extension-for-pytorch).

SYCL offers no batched copy, so each coalesced run is one ``copy_`` between tensor views of
the memory the worker registered (its KV tensors and host buffer), on the copy stream. Host
memory that is not pinned is staged through pinned memory, so the copy stays asynchronous.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from offload_core.backend import Direction, span_bytes
from offload_core.backends.torch_device import Runtime, TorchDeviceBackend
from offload_core.errors import OffloadError

MAX_STREAM_TRIES = 64  # torch.xpu's pool has 32 queues per priority
_UNREGISTERED = "xpu copies need their memory registered (register_buffer or alloc_host)"


class StreamCopier:
    """How `XpuBackend` enqueues its copies: ``dst.copy_(src, non_blocking=True)`` for each
    pair, with the copy stream current. Replace it (``XpuBackend(copier=...)``) where a runtime's
    streams cannot run a torch copy asynchronously themselves."""

    def enqueue(self, pairs: Sequence[tuple[Any, Any]], stream: Any, runtime: Runtime) -> None:
        """Enqueue ``dst <- src`` for every ``(dst, src)`` pair of same-sized uint8 tensors on
        `stream` (from `runtime`), without waiting. The tensors stay alive until an event
        recorded on `stream` after this call has completed."""
        with runtime.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)


class XpuBackend(TorchDeviceBackend):
    """Intel GPUs. Streams, events and pinned memory from torch.xpu; copies as tensor-view copies.

    Args:
        device_index: the GPU.
        runtime: torch.xpu's surface, as `TorchDeviceBackend` describes it, with
            ``stream.sycl_queue`` on its streams (telling pooled queues apart). Default:
            ``TorchRuntime("xpu")``.
        copier: what enqueues the copies; default a `StreamCopier`.

    Raises:
        AttributeError: no runtime is given and torch has no torch.xpu.
    """

    name = "xpu"
    module_name = "xpu"
    priority = 100
    install_hint = "an XPU build of torch (2.6 or later); then pip install -e '.[xpu]' in offload-core's clone"

    @classmethod
    def probe(cls) -> str | None:
        import torch

        xpu = getattr(torch, "xpu", None)
        if xpu is None or tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
            # before 2.6 an xpu event's elapsed_time raised NotImplementedError: every job would fail
            return f"torch {torch.__version__} has no usable torch.xpu (needs 2.6 or later)"
        return cls._unavailable(xpu, "Intel GPU")

    def __init__(self, device_index: int = 0, *, runtime: Runtime | None = None, copier: StreamCopier | None = None):
        super().__init__(device_index, runtime=runtime)
        self.copier = copier if copier is not None else StreamCopier()
        # Registered buffers (start, end, weak ref to the tensor) by address, their starts, ends
        # and `_rebuild`'s reach, in one tuple so that a reader never sees a mix of two versions
        # (a collection rebuilds it from any thread). Weak: the backend outlives workers (the
        # registry keeps it) and must not keep their memory or a shared region's mapping alive.
        self._table: tuple[list, np.ndarray, np.ndarray, np.ndarray] = ([], *(np.zeros(0, np.int64),) * 3)
        self._table_lock = threading.RLock()  # re-entrant: a collection during a rebuild calls _forget

    def new_stream(self):
        # torch.xpu hands out pooled queues round robin, starting with the slot the compute
        # stream uses: a copy stream must be a different queue, or copies and compute serialize.
        compute = self.current_stream()
        for _ in range(MAX_STREAM_TRIES):
            stream = self.runtime.Stream(device=self.device_index)
            if stream.sycl_queue != compute.sycl_queue:
                return stream
        raise OffloadError(
            f"torch.xpu handed out the compute stream's queue {MAX_STREAM_TRIES} times in a row: no separate "
            "copy queue is available (is the stream pool of size 1?)"
        )

    def alloc_host(self, nbytes: int):
        tensor = super().alloc_host(nbytes)
        self.register_buffer(tensor)
        return tensor

    def register_buffer(self, tensor) -> None:
        start = tensor.data_ptr()
        entry = (start, start + span_bytes(tensor), weakref.ref(tensor, self._forget))
        with self._table_lock:  # a tensor registered again (a second worker over it) keeps one entry
            kept = [e for e in self._table[0] if e[2]() is not None and not (e[2]() is tensor and e[1] == entry[1])]
            self._rebuild(kept + [entry])

    def _forget(self, ref: weakref.ref) -> None:
        with self._table_lock:
            self._rebuild([e for e in self._table[0] if e[2]() is not None])

    def _rebuild(self, entries: list) -> None:
        entries = sorted(entries, key=lambda e: e[0])
        starts = np.array([e[0] for e in entries], dtype=np.int64)
        ends = np.array([e[1] for e in entries], dtype=np.int64)
        # reach[j]: the entry among the first j + 1 whose end lies furthest; where any entry
        # starting at or before an address covers a copy from it, that one does
        reach = np.zeros(len(entries), dtype=np.int64)
        for j in range(1, len(entries)):
            reach[j] = j if ends[j] >= ends[reach[j - 1]] else reach[j - 1]
        self._table = (entries, starts, ends, reach)

    def copy_blocks(self, job, prepared, stream, after) -> str:
        if job.direction is Direction.LOAD:
            # Pageable host rows are staged during the call (`copy_batch`), out of stream order:
            # rows a store may still write (`job.host_after`) are read once it is done.
            for event in job.host_after:
                event.synchronize()
        return super().copy_blocks(job, prepared, stream, after)

    def copy_batch(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream) -> str:
        self._bind_thread()
        src_t, src_off = self._resolve(src, sizes)
        dst_t, dst_off = self._resolve(dst, sizes)
        pairs = []
        for s, so, d, do, n in zip(src_t, src_off.tolist(), dst_t, dst_off.tolist(), sizes.tolist()):
            source = s[so : so + n]
            if source.device.type == "cpu" and not self.runtime.is_pinned(source):
                source = self.runtime.pin(source)  # pageable: stage, so the copy can be asynchronous
            pairs.append((d[do : do + n], source))
        self.copier.enqueue(pairs, stream, self.runtime)
        return "copy_runs"

    def _resolve(self, addresses: np.ndarray, sizes: np.ndarray):
        """Each address as (a flat byte view of its registered buffer, offset in it)."""
        entries, starts, ends, reach = self._table
        i = np.searchsorted(starts, addresses, side="right") - 1
        if i.min(initial=0) < 0 or np.any(addresses + sizes > ends[reach[i]]):
            raise ValueError(_UNREGISTERED)
        i = reach[i]
        views = {}
        for k in set(i.tolist()):
            tensor = entries[k][2]()
            if tensor is None:  # freed since: its address range is no longer the caller's
                raise ValueError(_UNREGISTERED)
            # its bytes from data_ptr on, between the rows of a strided view too
            flat = self._torch.empty(0, dtype=self._torch.uint8, device=tensor.device)
            views[k] = flat.set_(
                tensor.untyped_storage(),
                tensor.storage_offset() * tensor.element_size(),
                (int(ends[k] - starts[k]),),
                (1,),
            )
        return [views[k] for k in i.tolist()], addresses - starts[i]
