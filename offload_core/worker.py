"""OffloadWorker: the engine-facing API. Owns the host buffer, a planner and one queue per direction."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Iterable

from offload_core.backend import Backend, Direction
from offload_core.errors import InvalidSpecError, OffloadError
from offload_core.layout import DeviceBlocks, HostBlocks, KVCaches
from offload_core.plan import Geometry, Planner
from offload_core.queue import QueueStats, TransferQueue, TransferResult
from offload_core.registry import ENV_BACKEND, get_backend

if TYPE_CHECKING:
    from offload_core.region import SharedHostRegion

log = logging.getLogger(__name__)


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

    Raises:
        InvalidSpecError: bad sizes, KV tensors on a device the backend does not copy, or a
            region that is too small or laid out for the other layout.
        UnknownBackendError, BackendUnavailableError: the backend cannot be had.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        num_host_blocks: int,
        *,
        blocks_per_chunk: int = 1,
        backend: Backend | str | None = None,
        canonical_layout: bool = False,
        host_region: "SharedHostRegion | None" = None,
    ):
        if not isinstance(kv_caches, KVCaches):
            raise InvalidSpecError(f"kv_caches must be KVCaches, got {type(kv_caches).__name__}")
        if int(blocks_per_chunk) != blocks_per_chunk or blocks_per_chunk < 1:
            raise InvalidSpecError(f"blocks_per_chunk must be a positive integer, got {blocks_per_chunk!r}")
        if int(num_host_blocks) != num_host_blocks or num_host_blocks < 1:
            raise InvalidSpecError(f"num_host_blocks must be a positive integer, got {num_host_blocks!r}")
        import torch  # deferred: `import offload_core` stays light

        device = kv_caches.device
        if not isinstance(backend, Backend):
            name = backend or os.environ.get(ENV_BACKEND) or device.type
            backend = get_backend(name, device_index=device.index or 0)
        if backend.device != device:
            raise InvalidSpecError(f"KV tensors are on {device}, but backend {backend.name!r} copies {backend.device}")
        self.backend = backend
        self.kv_caches = kv_caches  # keeps the device memory alive while we hold its addresses
        self.blocks_per_chunk = bpc = int(blocks_per_chunk)
        self.num_host_blocks = int(num_host_blocks)

        pages = [t.page_size_bytes for t in kv_caches.tensors]
        host_pages = _canonical_pages(kv_caches) if canonical_layout else pages
        offsets = [sum(host_pages[:i]) * bpc for i in range(len(pages))]
        row = sum(host_pages) * bpc
        self._region = host_region
        self._registered = False
        if host_region is None:
            self._host = backend.alloc_host(self.num_host_blocks * row)
            rows, stride, slot = self._host.view(self.num_host_blocks, row), row, 0
        else:
            _check_region(host_region, self.num_host_blocks, row, canonical_layout)
            self._host = host_region.tensor
            rows, stride, slot = self._host, host_region.row_stride, host_region.slot_offset
            self._registered = backend.host_register(self._host)
        for t in kv_caches.tensors:
            backend.register_tensor(t.tensor)
        backend.register_tensor(self._host)
        rows = rows.view(torch.int8)
        self.host_tensors = [rows[:, slot + off : slot + off + hp * bpc] for off, hp in zip(offsets, host_pages)]
        refs = [
            [(r.tensor_idx, r.page_size_bytes) + ((r.mapping,) if canonical_layout and r.mapping else ()) for r in g]
            for g in kv_caches.group_refs
        ]
        self._planner = Planner(
            Geometry(
                device_base=[t.tensor.data_ptr() for t in kv_caches.tensors],
                device_page=pages,
                device_blocks=[t.num_blocks for t in kv_caches.tensors],
                host_base=self._host.data_ptr() + slot,
                host_row_bytes=stride,
                host_offset=offsets,
                host_page=host_pages,
                host_blocks=self.num_host_blocks,
                group_refs=refs,
                blocks_per_chunk=bpc,
            )
        )
        self._queues = {d: TransferQueue(backend, d) for d in Direction}
        self._drained: list[TransferResult] = []
        self._closed = False

    @property
    def host_row_bytes(self) -> int:
        """Bytes of one host block: every tensor's chunk, back to back."""
        return self._planner.host_row_bytes

    def submit_store(self, job_id: int, src: DeviceBlocks, dst: HostBlocks) -> bool:
        """Start copying device blocks to host blocks (device -> host).

        Returns:
            True if queued; False if the backend failed to enqueue it (logged; nothing of
            the job stays in flight).

        Raises:
            InvalidSpecError: bad specs or a job id still in flight; nothing was enqueued.
            OffloadError: the worker is shut down.
        """
        return self._submit(Direction.STORE, job_id, src, dst)

    def submit_load(self, job_id: int, src: HostBlocks, dst: DeviceBlocks) -> bool:
        """Start copying host blocks to device blocks (host -> device).

        Returns:
            True if queued; False if the backend failed to enqueue it.

        Raises:
            InvalidSpecError: bad specs or a job id still in flight; nothing was enqueued.
            OffloadError: the worker is shut down.
        """
        return self._submit(Direction.LOAD, job_id, dst, src)

    def _submit(self, direction: Direction, job_id: int, device: DeviceBlocks, host: HostBlocks) -> bool:
        if self._closed:
            raise OffloadError("OffloadWorker is shut down")
        if not isinstance(device, DeviceBlocks) or not isinstance(host, HostBlocks):
            raise InvalidSpecError(
                f"{direction.value} needs DeviceBlocks and HostBlocks, got "
                f"{type(device).__name__} and {type(host).__name__}"
            )
        if any(job_id in q for q in self._queues.values()):
            raise InvalidSpecError(f"job id {job_id} is still in flight")
        queue = self._queues[direction]
        scratch = queue.scratch(self._planner.max_descriptors(device))
        batch = self._planner.plan(direction, device, host, out=scratch)
        try:
            queue.submit(job_id, batch, scratch)
        except Exception:
            log.exception("%s job %s could not be enqueued on %s", direction.value, job_id, self.backend.name)
            return False
        return True

    def stats(self) -> dict[str, QueueStats]:
        """Counters per direction (``"store"``, ``"load"``): jobs, bytes, descriptors after merging, failures."""
        return {d.value: q.stats for d, q in self._queues.items()}

    def get_finished(self) -> list[TransferResult]:
        """Results of completed jobs: stores, then loads, each in submission order. Never blocks."""
        results, self._drained = self._drained, []
        for queue in self._queues.values():
            results += queue.poll()
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs have completed; their results stay for `get_finished`.

        Unknown or already reported ids are ignored.
        """
        job_ids = set(job_ids)
        for queue in self._queues.values():
            queue.wait(job_ids)

    def shutdown(self) -> None:
        """Wait for every job in flight, then release the host memory. Calling it again does nothing.

        Results of jobs that finished here stay available from `get_finished`.
        """
        if self._closed:
            return
        self._closed = True
        for queue in self._queues.values():
            self._drained += queue.drain()
        self.host_tensors = []
        if self._registered:
            self.backend.host_unregister(self._host)
        self._host = None  # a shared region outlives the worker: its owner closes it

    def __enter__(self) -> "OffloadWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()



def _canonical_pages(kv_caches: KVCaches) -> list[int]:
    """Per tensor, the largest canonical page among the refs into it (its own page if none)."""
    pages = [t.page_size_bytes for t in kv_caches.tensors]
    for refs in kv_caches.group_refs:
        for r in refs:
            size = r.mapping.canonical_page_size_bytes if r.mapping is not None else r.page_size_bytes
            pages[r.tensor_idx] = max(pages[r.tensor_idx], size)
    return pages


def _check_region(region, num_blocks: int, row: int, canonical: bool) -> None:
    if region.num_blocks != num_blocks:
        raise InvalidSpecError(f"the region has {region.num_blocks} host blocks, the worker asked for {num_blocks}")
    if region.canonical != canonical:
        raise InvalidSpecError(
            f"the region holds the {'canonical' if region.canonical else 'direct'} layout, "
            f"the worker uses the {'canonical' if canonical else 'direct'} one"
        )
    if row > region.slot_bytes:
        raise InvalidSpecError(f"the region is too small: this rank needs {row} bytes per host block, its slot has {region.slot_bytes}")
