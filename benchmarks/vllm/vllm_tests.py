"""vLLM 0.33.0's own GPU worker tests, run against offload-core's worker (a pytest plugin).

vLLM's ``tests/v1/kv_offload/cpu/test_gpu_worker.py`` builds ``CPUOffloadingWorker`` directly
and reads three of its internals: ``_store_handler`` / ``_load_handler`` with ``src_tensors``,
``dst_tensors``, ``layer_refs_per_group`` and ``_transfers`` (the jobs in flight). This plugin
puts `ShimWorker` in its place before the test module is imported: offload-core's
``OffloadCoreWorker`` (what ``OffloadCoreOffloadingSpec.get_worker`` returns), with those
internals made from offload-core's own tensors. vLLM's tests are not changed. It also supplies
the one fixture they take from vLLM's root conftest (``default_vllm_config``), which imports far
more than a GPU machine without network has. From the root of vLLM's sdist:

    PYTHONPATH=<offload-core>/benchmarks/vllm python -m pytest -p vllm_tests --confcutdir=tests/v1/kv_offload \\
        tests/v1/kv_offload/cpu/test_gpu_worker.py

Differences the shim cannot hide: ``mmap_region`` (vLLM's ``SharedOffloadRegion``) is not used
as host memory (offload-core's worker shares its own regions); it is kept only to be cleaned up
at shutdown, as vLLM's worker does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


class _HostPages:
    """A host tensor as vLLM's tests use it. offload-core's host tensors are strided views into
    rows that hold every tensor's pages of a chunk, so ``view(-1, page)`` (a reinterpretation
    vLLM's contiguous host tensors allow) is served as ``reshape``, a copy the tests only read."""

    def __init__(self, tensor: torch.Tensor):
        self._t = tensor

    def view(self, *shape):
        return self._t.reshape(*shape)

    def __getattr__(self, name):
        return getattr(self._t, name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def unwrap(a):
            return a._t if isinstance(a, _HostPages) else a

        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def _shim_class():
    from offload_core.integrations.vllm import OffloadCoreWorker

    class ShimWorker(OffloadCoreWorker):
        """``CPUOffloadingWorker(kv_caches, blocks_per_chunk, num_cpu_chunks, mmap_region)``,
        as offload-core's worker."""

        def __init__(self, kv_caches, blocks_per_chunk, num_cpu_chunks, mmap_region=None):
            super().__init__(kv_caches, num_cpu_chunks, blocks_per_chunk)
            self.mmap_region = mmap_region
            device = [t.tensor for t in kv_caches.tensors]
            host = [_HostPages(t) for t in self.worker.host_tensors]
            refs = kv_caches.group_data_refs
            self._store_handler = SimpleNamespace(
                src_tensors=device, dst_tensors=host, layer_refs_per_group=refs, _transfers=[]
            )
            self._load_handler = SimpleNamespace(
                src_tensors=host, dst_tensors=device, layer_refs_per_group=refs, _transfers=[]
            )

        def submit_store(self, job_id, src_spec, dst_spec):
            ok = super().submit_store(job_id, src_spec, dst_spec)
            self._store_handler._transfers.append(SimpleNamespace(job_id=job_id))
            return ok

        def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
            ok = super().submit_load(job_id, src_spec, dst_spec, expedited)
            self._load_handler._transfers.append(SimpleNamespace(job_id=job_id))
            return ok

        def get_finished(self):
            results = super().get_finished()
            done = {r.job_id for r in results}
            for h in (self._store_handler, self._load_handler):
                h._transfers[:] = [t for t in h._transfers if t.job_id not in done]
            return results

        def shutdown(self):
            super().shutdown()
            if self.mmap_region is not None:
                self.mmap_region.cleanup()

    return ShimWorker


def pytest_configure(config):
    from vllm.v1.kv_offload.cpu import gpu_worker

    gpu_worker.CPUOffloadingWorker = _shim_class()  # before the test module imports the name


@pytest.fixture()
def default_vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config
