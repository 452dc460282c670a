"""The part of the vLLM adapter (`offload_core.integrations.vllm`) that needs no vLLM, so that it is
tested on every backend: vLLM's worker-side objects, duck-typed after vLLM 0.33.0's, as offload-core's
and back.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from typing import Any

from offload_core.canonical import CanonicalPageMapping, CopyRun
from offload_core.errors import InvalidSpecError, flag, integer, positive_int
from offload_core.host_layout import HostLayout
from offload_core.region import SharedHostRegion
from offload_core.spec import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor
from offload_core.worker import OffloadWorker

log = logging.getLogger("offload_core.integrations.vllm")


class WorkerAdapter:
    """vLLM's ``OffloadingWorker`` methods over an `OffloadWorker`, on duck-typed specs;
    `offload_core.integrations.vllm.OffloadCoreWorker` is this plus vLLM's base class.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches``: int8 ``(num_blocks, page)`` views, possibly
            strided (rows a pitch apart), and per group one ref per layer.
        num_chunks: host chunks (blocks of `blocks_per_chunk` device blocks each).
        blocks_per_chunk: device blocks per host chunk.
        backend: a backend name, or None for the KV tensors' device.
        shared_region: the name of the `SharedHostRegion` every rank of the engine opens, for a
            replicated layout (one copy of each block, stored by rank 0, loaded by all) or a
            canonical one; None for host memory of this rank's own.
        canonical: host pages in the canonical (TP-independent) layout, through the refs'
            mappings; needs `shared_region`.
        rank: this rank, in the canonical region.
        row_budget: host bytes per chunk vLLM sized for this rank (its slot of a chunk); more is
            refused rather than allocated beyond ``cpu_bytes_to_use``.

    Raises:
        InvalidSpecError: the KV caches do not fit offload-core's rules (see `to_kv_caches`).
        OffloadError: the backend cannot be used.
        RegionError: the shared region is not safe to open (see `SharedHostRegion`).
    """

    # what get_finished returns: vLLM's TransferResult in the subclass, offload-core's here
    result_type: Any = None

    def __init__(
        self,
        kv_caches: Any,
        num_chunks: int,
        blocks_per_chunk: int = 1,
        backend: str | None = None,
        shared_region: str | None = None,
        canonical: bool = False,
        rank: int = 0,
        row_budget: int | None = None,
    ):
        canonical = flag(canonical, "canonical")
        if canonical and shared_region is None:
            raise InvalidSpecError("a canonical layout needs the name of the region the ranks share (shared_region)")
        num_chunks = positive_int(num_chunks, "num_chunks")
        blocks_per_chunk = positive_int(blocks_per_chunk, "blocks_per_chunk")
        rank = integer(rank, "rank", 0)
        row_budget = None if row_budget is None else positive_int(row_budget, "row_budget")
        kv = to_kv_caches(kv_caches, canonical=canonical)
        row = HostLayout.of(kv, blocks_per_chunk, canonical).row_bytes
        if row_budget is not None and row > row_budget:
            raise InvalidSpecError(
                f"the KV pages need {row} bytes per host chunk, vLLM budgeted {row_budget} (its "
                "worker_kv_bytes_per_block does not cover these tensors): the host memory would exceed cpu_bytes_to_use"
            )
        self.region = None
        if shared_region is not None:
            # The creator reserves and touches every page before a joiner may map it: give the
            # joiners time for that at a slow 0.25 GB/s, as well as the usual 30 s.
            timeout = 30.0 + num_chunks * row / 0.25e9
            # canonical: the unsharded pages, one area for all ranks; replicated: every rank uses
            # slot 0, as the replicas' bytes are the same
            area = {"rank": rank, "canonical_bytes": row} if canonical else {"rank": 0, "slot_bytes": [row]}
            self.region = SharedHostRegion(shared_region, num_blocks=num_chunks, timeout=timeout, **area)
        try:
            self.worker = OffloadWorker(
                kv,
                num_chunks,
                blocks_per_chunk=blocks_per_chunk,
                backend=backend,
                canonical_layout=canonical,
                host_region=self.region,
            )
        except BaseException:
            if self.region is not None:
                try:  # the failure's traceback may still hold views of it: then it goes with them
                    self.region.close()
                except Exception:
                    log.warning(
                        "the shared region %s stays open until the failed worker's views are gone", self.region.path
                    )
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
                log.error(
                    "offload-core %s job %d failed (%d bytes, backend %s): see the error logged before for the cause",
                    r.direction,
                    r.job_id,
                    r.transfer_size,
                    self.worker.backend.name,
                )
            results.append(
                r
                if self.result_type is None
                else self.result_type(r.job_id, r.success, r.transfer_size, r.transfer_time)
            )
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


def to_kv_caches(kv_caches: Any, canonical: bool = False) -> KVCaches:
    """vLLM's ``CanonicalKVCaches`` as offload-core's `KVCaches`, with the refs' canonical
    mappings where `canonical`. Layers that alias one tensor in a group (vLLM shares a tensor
    between layers with the same memory) copy it once.

    Raises:
        InvalidSpecError: a tensor or ref that breaks `KVCacheTensor`'s or `KVCaches`' rules, or,
            where `canonical`, a ref vLLM could not certify (no mapping, or one that is not
            ``parallelism_agnostic``); an object that lacks the fields read here.
    """
    # vLLM's names: a tensor's page_size_bytes is its row (the padded page), a ref's the prefix
    # of it that the layer uses and a copy moves
    try:
        tensors = [KVCacheTensor(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]  # it checks the size
        groups = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            kept: dict[int, Any] = {}
            for ref in refs:
                if canonical and (ref.mapping is None or getattr(ref.mapping, "parallelism_agnostic", True) is False):
                    why = "no canonical mapping" if ref.mapping is None else "its pages differ by TP size"
                    raise InvalidSpecError(
                        f"canonical_layout was requested, but vLLM could not certify the layout of group {g}'s ref "
                        f"to tensor {ref.tensor_idx} ({why}): remove canonical_layout from "
                        "kv_connector_extra_config"
                    )
                if ref.tensor_idx not in kept or ref.page_size_bytes > kept[ref.tensor_idx].page_size_bytes:
                    kept[ref.tensor_idx] = ref
            groups.append(
                [
                    KVCacheRef(i, r.page_size_bytes, mapping=to_mapping(r.mapping) if canonical else None)
                    for i, r in kept.items()
                ]
            )
        return KVCaches(tensors, groups)
    except (AttributeError, TypeError) as exc:  # not vLLM's objects, or a field of another kind
        raise InvalidSpecError(
            "kv_caches must be vLLM's CanonicalKVCaches: tensors (each .tensor and an int .page_size_bytes) "
            f"and group_data_refs (lists of refs, each an int .tensor_idx and .page_size_bytes): {exc}"
        ) from exc


def to_mapping(mapping: Any) -> CanonicalPageMapping:
    """vLLM's ``CanonicalPageMapping`` as offload-core's (`to_kv_caches` refuses one that is not
    ``parallelism_agnostic``: its pages would land elsewhere at another TP size)."""
    runs = tuple(
        CopyRun(
            r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments, r.local_stride, r.canonical_stride
        )
        for r in mapping.runs
    )
    return CanonicalPageMapping(
        canonical_page_size_bytes=mapping.canonical_page_size_bytes,  # it checks them: a float is refused
        local_page_size_bytes=mapping.local_page_size_bytes,
        runs=runs,
        num_writers=mapping.num_writers,
        writer_index=mapping.writer_index,
    )


def device_blocks(spec: Any) -> DeviceBlocks:
    """A ``GPULoadStoreSpec`` (block ids in group order, group sizes, each group's first block
    index) as `DeviceBlocks`; older specs without groups are one group.

    Raises:
        InvalidSpecError: a host spec in its place (source and destination swapped), or no ids.
    """
    if type(spec).__name__ == "CPULoadStoreSpec":
        raise InvalidSpecError(
            f"expected a GPULoadStoreSpec (device blocks), got a {type(spec).__name__}: source and destination swapped?"
        )
    return DeviceBlocks(
        _ids_of(spec, "GPULoadStoreSpec"), getattr(spec, "group_sizes", None), getattr(spec, "block_indices", None)
    )


def host_blocks(spec: Any) -> HostBlocks:
    """A ``CPULoadStoreSpec`` (host chunk ids) as `HostBlocks`.

    Raises:
        InvalidSpecError: a device spec in its place (source and destination swapped), or no ids.
    """
    if hasattr(spec, "group_sizes") or type(spec).__name__ == "GPULoadStoreSpec":
        raise InvalidSpecError(
            f"expected a CPULoadStoreSpec (host chunks), got a {type(spec).__name__}: source and destination swapped?"
        )
    return HostBlocks(_ids_of(spec, "CPULoadStoreSpec"))


def _ids_of(spec: Any, kind: str) -> Any:
    ids = getattr(spec, "block_ids", None)
    if ids is None:
        raise InvalidSpecError(f"expected a {kind} (with block_ids), got {spec!r}")
    return ids


def region_name(engine_id: str, data_parallel_index: int) -> str:
    """The `SharedHostRegion` name of one engine's data-parallel replica: readable, and unique
    (a hash of the whole id), within the name's 128 characters of ``A-Za-z0-9._-``.

    Raises:
        InvalidSpecError: a `data_parallel_index` that is not a non-negative integer.
    """
    data_parallel_index = integer(data_parallel_index, "data_parallel_index", 0)
    digest = hashlib.sha256(f"{engine_id}\0{data_parallel_index}".encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]", "-", str(engine_id))[:80]
    return f"vllm-{readable}-dp{data_parallel_index}-{digest}"
