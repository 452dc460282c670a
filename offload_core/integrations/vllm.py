"""offload-core as vLLM's CPU-offloading worker, through vLLM's own plug-in path.

vLLM's offloading connector builds its spec from ``kv_connector_extra_config``; name this
module and class there and the GPU <-> host copies are offload-core's, on any backend
(``cuda``, ``npu`` through vllm-ascend, ``xpu``, ``cpu``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "OffloadCoreOffloadingSpec",
        "spec_module_path": "offload_core.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

Everything on the scheduler side stays vLLM's: `OffloadCoreOffloadingSpec` subclasses
vLLM's `CPUOffloadingSpec`, so host memory sizing (``cpu_bytes_to_use``, chunks of
``blocks_per_chunk`` blocks), the manager, eviction policies and metrics are vLLM's own.
Only `get_worker` differs: it returns `OffloadCoreWorker`, which converts vLLM's specs and
KV-cache description to offload-core's and back. ``offload_core_backend`` in the extra config
names a backend; by default it follows the KV tensors' device.

Tensor-parallel ranks: with vLLM's replicated layout (MLA models, whose KV every rank holds
whole), the ranks of one engine share one `SharedHostRegion` (in ``/dev/shm``, opened only by
its user): rank 0 stores each block once, every rank loads it, and vLLM sizes the host memory
for one copy. Otherwise each rank keeps its own host copy of its part. vLLM's canonical layout
is turned off (not supported here yet), so each rank then stores its own blocks.

Importable only where vLLM is installed; offload-core never depends on vLLM. Tested against
vLLM 0.33.0; the worker also accepts the older API vllm-ascend targets (``num_blocks``
instead of ``num_chunks`` on the spec, specs without groups, loads without ``expedited``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Iterable

from vllm.v1.kv_offload.base import OffloadingWorker
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from offload_core.errors import InvalidSpecError
from offload_core.layout import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor
from offload_core.region import SharedHostRegion
from offload_core.worker import OffloadWorker

log = logging.getLogger(__name__)

BACKEND_KEY = "offload_core_backend"  # kv_connector_extra_config key: the backend's name


class OffloadCoreOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with offload-core's worker.

    Args:
        config: vLLM's ``OffloadingConfig``. A replicated layout is kept on every platform (the
            ranks share a `SharedHostRegion`); a canonical layout is turned off (logged), so
            vLLM sizes the host memory for a copy per rank and lets every rank store.

    Raises:
        Exception: as vLLM's `CPUOffloadingSpec` (``cpu_bytes_to_use`` missing, say).
    """

    def __init__(self, config: Any):
        if getattr(config, "canonical_layout", False):
            # vLLM's canonical rules may also have set replicated_layout, for a single rank too:
            # keep it only where there are replicas to share a copy.
            replicated = bool(config.replicated_layout) and config.parallel.tp_size > 1
            log.info("offload-core: canonical_layout turned off (not supported yet); %s",
                     "the ranks share one replicated copy" if replicated else "each rank keeps its own host copy")
            config = dataclasses.replace(config, canonical_layout=False, replicated_layout=replicated)
        super().__init__(config)
        self._offload_core_worker: OffloadCoreWorker | None = None

    def _uses_shared_region(self) -> bool:
        # vLLM's own worker shares a region on CUDA and XPU only; offload-core's does on every
        # backend, so vLLM keeps the replicated layout (and sizes one copy) everywhere.
        return True

    def get_worker(self, kv_caches: Any) -> "OffloadCoreWorker":
        """The worker of this rank, made on the first call, for CUDA, NPU, XPU and CPU alike.

        Raises:
            InvalidSpecError: vLLM sized no host memory (``cpu_bytes_to_use`` below one
                chunk), or the KV caches do not fit offload-core's rules.
            OffloadError: the named backend cannot be used.
        """
        if self._offload_core_worker is None:
            chunks = getattr(self, "num_chunks", None)
            if chunks is None:  # vLLM before num_chunks (vllm-ascend's)
                chunks = getattr(self, "num_blocks", 0)
            if not chunks:
                raise InvalidSpecError(
                    f"vLLM sized no host chunks (cpu_bytes_to_use={self.extra_config.get('cpu_bytes_to_use')!r} "
                    "is below one chunk of every rank's KV bytes): raise cpu_bytes_to_use"
                )
            region_name = None
            if self.replicated_layout:
                parallel = self.config.parallel
                region_name = _region_name(f"vllm-{self.config.engine_id}-dp{parallel.data_parallel_index}")
            self._offload_core_worker = OffloadCoreWorker(
                kv_caches, int(chunks), int(self.blocks_per_chunk), backend=self.extra_config.get(BACKEND_KEY),
                shared_region=region_name,
            )
        return self._offload_core_worker


class OffloadCoreWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` over an `OffloadWorker`.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches``: int8 ``(num_blocks, page)`` views, possibly
            strided (rows a pitch apart), and per group one ref per layer.
        num_chunks: host chunks (blocks of `blocks_per_chunk` device blocks each).
        blocks_per_chunk: device blocks per host chunk.
        backend: a backend name, or None for the KV tensors' device.
        shared_region: for a replicated layout, the name of the `SharedHostRegion` every rank
            of the engine opens: one copy of each block, stored by rank 0, loaded by all.

    Raises:
        InvalidSpecError: the KV caches do not fit offload-core's rules (see `to_kv_caches`).
        OffloadError: the backend cannot be used.
        RegionError: the shared region is not safe to open (see `SharedHostRegion`).
    """

    def __init__(self, kv_caches: Any, num_chunks: int, blocks_per_chunk: int = 1, backend: str | None = None,
                 shared_region: str | None = None):
        kv = to_kv_caches(kv_caches)
        self.region = None
        if shared_region is not None:
            row = sum(t.page_size_bytes for t in kv.tensors) * blocks_per_chunk
            # every rank's slot 0: the replicas' bytes are the same, so one copy serves all
            self.region = SharedHostRegion(shared_region, num_blocks=num_chunks, rank=0, slot_bytes=[row])
        try:
            self.worker = OffloadWorker(kv, num_chunks, blocks_per_chunk=blocks_per_chunk, backend=backend,
                                        host_region=self.region)
        except BaseException:
            if self.region is not None:
                self.region.close()
            raise

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Device blocks (``GPULoadStoreSpec``) to host chunks (``CPULoadStoreSpec``).

        Raises:
            InvalidSpecError: bad specs or a job id in flight; nothing was enqueued.
        """
        return self.worker.submit_store(job_id, device_blocks(src_spec), host_blocks(dst_spec))

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        """Host chunks to device blocks; `expedited` loads (ones vLLM waits for within the step)
        go on a lane of their own, never behind regular loads.

        Raises:
            InvalidSpecError: bad specs or a job id in flight; nothing was enqueued.
        """
        return self.worker.submit_load(job_id, host_blocks(src_spec), device_blocks(dst_spec), expedited=expedited)

    def get_finished(self) -> list:
        """Finished jobs as vLLM's ``TransferResult``. A failed job comes back with
        ``success=False`` and is logged here (the device fault was logged when it was found):
        vLLM's connector asserts success, so the log says why it stopped."""
        results = []
        for r in self.worker.get_finished():
            if not r.success:
                log.error("offload-core %s job %d failed (%d bytes, backend %s): see the error logged before for the cause",
                          r.direction, r.job_id, r.transfer_size, self.worker.backend.name)
            results.append(VllmTransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time))
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs finished; their results stay for `get_finished`."""
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        """Wait for every job in flight, then release the host memory (and this rank's hold on
        the shared region: the last rank to close it removes it)."""
        self.worker.shutdown()
        if self.region is not None:
            try:
                self.region.close()
            except Exception:  # views still alive elsewhere: the region goes when they do
                log.exception("closing the shared region %s", self.region.path)


def to_kv_caches(kv_caches: Any) -> KVCaches:
    """vLLM's ``CanonicalKVCaches`` as offload-core's `KVCaches`. Layers that alias one tensor
    in a group (vLLM shares a tensor between layers with the same memory) copy it once.

    Raises:
        InvalidSpecError: a tensor or ref that breaks `KVCacheTensor`'s or `KVCaches`' rules.
    """
    tensors = [KVCacheTensor(t.tensor, int(t.page_size_bytes)) for t in kv_caches.tensors]
    groups = []
    for refs in kv_caches.group_data_refs:
        pages: dict[int, int] = {}
        for ref in refs:
            pages[ref.tensor_idx] = max(pages.get(ref.tensor_idx, 0), int(ref.page_size_bytes))
        groups.append([KVCacheRef(i, n) for i, n in pages.items()])
    return KVCaches(tensors, groups)


def device_blocks(spec: Any) -> DeviceBlocks:
    """A ``GPULoadStoreSpec`` (block ids in group order, group sizes, each group's first block
    index) as `DeviceBlocks`; older specs without groups are one group."""
    return DeviceBlocks(spec.block_ids, getattr(spec, "group_sizes", None), getattr(spec, "block_indices", None))


def host_blocks(spec: Any) -> HostBlocks:
    """A ``CPULoadStoreSpec`` (host chunk ids) as `HostBlocks`."""
    return HostBlocks(spec.block_ids)


def _region_name(text: str) -> str:
    """`text` as a `SharedHostRegion` name: characters outside ``A-Za-z0-9._-`` replaced, at most 128."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:128].lstrip("._-") or "vllm"

