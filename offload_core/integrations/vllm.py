"""offload-core as vLLM's CPU-offloading worker, through vLLM's own plug-in path (see
docs/integrations/vllm.md)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "OffloadCoreOffloadingSpec",
        "spec_module_path": "offload_core.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

The scheduler side (host memory sizing, manager, eviction, metrics) stays vLLM's `CPUOffloadingSpec`;
only `get_worker` differs. ``offload_core_backend`` in the extra config names a backend (default: the
KV tensors' device). Tensor-parallel ranks share a `SharedHostRegion` for vLLM's replicated and
canonical layouts. Importable only where vLLM is installed; tested against vLLM 0.33.0, and the
worker also accepts the older API that vllm-ascend targets.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingWorker
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from offload_core.errors import InvalidSpecError
from offload_core.integrations.vllm_convert import WorkerAdapter, region_name

BACKEND_KEY = "offload_core_backend"  # kv_connector_extra_config key: the backend's name


class OffloadCoreOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with offload-core's worker.

    Args:
        config: vLLM's ``OffloadingConfig``.

    Raises:
        InvalidSpecError: ``cpu_bytes_to_use`` missing, or not a positive number of bytes.
        Exception: anything else vLLM's `CPUOffloadingSpec` refuses.
    """

    def __init__(self, config: Any):
        # read as vLLM reads it (int(value)), refused where vLLM would fail with a bare exception or size nothing
        extra = getattr(config, "extra_config", None) or {}
        value = extra.get("cpu_bytes_to_use") if isinstance(extra, dict) else None
        try:
            valid = not isinstance(value, bool) and int(value) > 0
        except (TypeError, ValueError, OverflowError):
            valid = False
        if not valid:
            raise InvalidSpecError(
                f"cpu_bytes_to_use in kv_connector_extra_config must be a positive number of bytes, got {value!r}"
            )
        super().__init__(config)
        self._offload_core_worker: OffloadCoreWorker | None = None

    def _uses_shared_region(self) -> bool:
        # vLLM's own worker shares a region on CUDA (not ROCm) and XPU only; offload-core's does on every
        # backend, so vLLM keeps the replicated layout (and sizes one copy) everywhere.
        return True

    def get_worker(self, kv_caches: Any) -> OffloadCoreWorker:
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
            if not getattr(self.config, "worker_kv_bytes_per_block", 1):
                raise InvalidSpecError(
                    "vLLM reported no KV bytes per block (worker_kv_bytes_per_block=0): nothing to offload"
                )
            if chunks <= 0:
                raise InvalidSpecError(
                    f"vLLM sized no host chunks (cpu_bytes_to_use={self.extra_config.get('cpu_bytes_to_use')!r} "
                    "is below one chunk of every rank's KV bytes): raise cpu_bytes_to_use"
                )
            shared = None
            canonical = bool(getattr(self.config, "canonical_layout", False))
            parallel = getattr(self.config, "parallel", None)  # absent before vLLM 0.33
            rank = int(getattr(parallel, "rank", 0))
            if self.replicated_layout or canonical:
                shared = region_name(self.config.engine_id, int(getattr(parallel, "data_parallel_index", 0)))
                budget = getattr(self, "kv_bytes_per_chunk", None)  # the whole (shared) chunk
            else:
                budget = getattr(self, "cpu_page_size_per_worker", None)  # this rank's part of a chunk
            backend = self.extra_config.get(BACKEND_KEY)
            if backend is not None and not isinstance(backend, str):
                raise InvalidSpecError(
                    f"{BACKEND_KEY} in kv_connector_extra_config must be a backend's name, got {backend!r}"
                )
            self._offload_core_worker = OffloadCoreWorker(
                kv_caches,
                int(chunks),
                int(self.blocks_per_chunk),
                backend=backend,
                shared_region=shared,
                canonical=canonical,
                rank=rank,
                row_budget=budget or None,
            )
        return self._offload_core_worker


class OffloadCoreWorker(WorkerAdapter, OffloadingWorker):
    """`WorkerAdapter` with vLLM's ``OffloadingWorker`` base class and result type."""

    result_type = VllmTransferResult
