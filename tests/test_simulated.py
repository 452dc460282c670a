"""The npu and xpu backends against simulated runtimes that run asynchronously and check contracts."""

from __future__ import annotations

import time

import numpy as np
import pytest
import simulated
import torch
from helpers import small_kv

from offload_core import (
    DeviceBlocks,
    Direction,
    HostBlocks,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadError,
    OffloadWorker,
    get_backend,
)
from offload_core.backends.npu import AclMemcpyBatchAttr
from offload_core.testing.conformance import BackendConformance

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(params=["acl_batch", "swap_blocks_batch", "acl_loop"])
def sim_npu(request):
    with simulated.npu(
        with_batch=request.param == "acl_batch", with_operator=request.param == "swap_blocks_batch"
    ) as acl:
        backend = get_backend("npu")
        assert backend.mechanism == request.param
        assert isinstance(backend, simulated.SimulatedNpuBackend) and backend.runtime is acl.runtime
        yield backend, acl


@pytest.fixture
def sim_xpu():
    with simulated.xpu() as runtime:
        backend = get_backend("xpu")
        assert isinstance(backend, simulated.SimulatedXpuBackend) and backend.runtime is runtime
        yield backend, runtime


@pytest.mark.npu
class TestSimulatedNpu(BackendConformance):
    @pytest.fixture
    def backend(self, sim_npu):
        return sim_npu[0]


@pytest.mark.xpu
class TestSimulatedXpu(BackendConformance):
    @pytest.fixture
    def backend(self, sim_xpu):
        return sim_xpu[0]


def test_acl_batch_struct_matches_the_header():
    assert ctypes_size(AclMemcpyBatchAttr) == 32
    assert AclMemcpyBatchAttr.srcLoc.offset == 8 and AclMemcpyBatchAttr.rsv.offset == 16


def ctypes_size(t):
    import ctypes

    return ctypes.sizeof(t)


@pytest.mark.npu
def test_npu_reads_the_stream_handle_at_each_call(sim_npu):
    backend, acl = sim_npu
    kv = small_kv(blocks=8)
    with OffloadWorker(kv, 4, backend=backend) as worker:
        worker.submit_store(1, DeviceBlocks([1, 2]), HostBlocks([0, 1]))
        worker.wait([1])
        (result,) = worker.get_finished()
        assert result.success and result.mechanism == backend.mechanism
    handles = {c[-1] for c in acl.calls}
    assert handles == {worker._queues[Direction.STORE]._stream.npu_stream}  # the copy stream, every call


@pytest.mark.npu
def test_npu_whose_product_lacks_the_batch_call_copies_one_by_one():
    """CANN's batch call exists on products that do not support it (310P): its first call
    answers ACL_ERROR_RT_FEATURE_NOT_SUPPORT, enqueuing nothing; that job and every later one go
    by aclrtMemcpyAsync, bytes intact."""
    with simulated.npu(batch_supported=False) as acl:
        backend = get_backend("npu")
        assert backend.mechanism == "acl_batch"
        kv = small_kv(blocks=8)
        with OffloadWorker(kv, 4, backend=backend) as worker:
            for job, (dev, host) in enumerate([([1, 2], [0, 1]), ([3], [2])], start=1):
                worker.submit_store(job, DeviceBlocks(dev), HostBlocks(host))
                worker.wait([job])
                (result,) = worker.get_finished()
                assert result.success and result.mechanism == "acl_loop"
            for dev, host in ((1, 0), (2, 1), (3, 2)):
                assert torch.equal(worker.host_tensors[0][host], kv.tensors[0].tensor[dev])
    assert [c[0] for c in acl.calls].count("batch") == 1 and "memcpy" in [c[0] for c in acl.calls]


@pytest.mark.npu
def test_npu_refuses_pageable_host_memory(sim_npu):
    backend, _ = sim_npu
    device = torch.zeros(4096, dtype=torch.uint8)
    pageable = torch.zeros(4096, dtype=torch.uint8)  # not from alloc_host: not page-locked
    one = np.ones(1, dtype=np.int64)
    with pytest.raises(RuntimeError, match="aclError 507899|not page-locked"):
        backend.copy_batch(
            one * device.data_ptr(), one * pageable.data_ptr(), one * 64, Direction.STORE, backend.new_stream()
        )


@pytest.mark.npu
def test_npu_store_waits_for_the_compute_stream(sim_npu):
    backend, _ = sim_npu
    kv = small_kv(blocks=8)
    with OffloadWorker(kv, 4, backend=backend) as worker:

        def kernel():
            time.sleep(0.05)
            kv.tensors[0].tensor[5] = 3

        backend.current_stream().launch(kernel)
        worker.submit_store(1, DeviceBlocks([5]), HostBlocks([2]))
        worker.wait([1])
        assert (worker.host_tensors[0][2] == 3).all()


@pytest.mark.npu
def test_vllm_ascend_padded_kv_layout(sim_npu):
    backend, _ = sim_npu
    blocks, tokens, heads, dim, pad = 6, 4, 2, 8, 24  # 64 bytes of data per block, 88 with padding
    pitch = tokens * heads * dim + pad
    storage = torch.randint(0, 255, (blocks * pitch,), dtype=torch.uint8)
    pair = [storage.as_strided((blocks, tokens, heads, dim), (pitch, heads * dim, dim, 1)) for _ in range(1)]
    value_storage = torch.randint(0, 255, (blocks * pitch,), dtype=torch.uint8)
    pair.append(value_storage.as_strided((blocks, tokens, heads, dim), (pitch, heads * dim, dim, 1)))
    # vllm-ascend's layout: each block's 64 bytes of data, `pad` bytes of padding after it
    rows = [torch.empty(0, dtype=torch.int8).set_(t.untyped_storage(), 0, (blocks, 64), (pitch, 1)) for t in pair]
    kv = KVCaches([KVCacheTensor(r, 64) for r in rows], [[KVCacheRef(0, 64), KVCacheRef(1, 64)]])
    assert [(t.page_size_bytes, t.pitch_bytes) for t in kv.tensors] == [(64, pitch), (64, pitch)]
    assert [r.page_size_bytes for r in kv.group_refs[0]] == [64, 64]
    before = [storage.clone(), value_storage.clone()]
    with OffloadWorker(kv, 4, backend=backend) as worker:
        assert [h.shape[1] for h in worker.host_tensors] == [64, 64]  # no host memory for the padding
        worker.submit_store(1, DeviceBlocks([0, 1]), HostBlocks([2, 3]))
        worker.wait([1])
        worker.submit_load(2, HostBlocks([2, 3]), DeviceBlocks([4, 5]))
        worker.wait([2])
    for t, b in zip(pair, before):
        assert torch.equal(t[4:6], t[0:2])
        padding = t.as_strided((blocks, pad), (pitch, 1), t.storage_offset() + 64)
        assert torch.equal(padding, b.as_strided((blocks, pad), (pitch, 1), 64))  # padding never copied


@pytest.mark.xpu
def test_xpu_copy_stream_is_never_the_compute_queue(sim_xpu):
    backend, runtime = sim_xpu
    compute = backend.current_stream()
    streams = [backend.new_stream() for _ in range(6)]
    assert all(s.sycl_queue != compute.sycl_queue for s in streams)


@pytest.mark.xpu
def test_xpu_with_one_queue_refuses_rather_than_spin():
    """A pool of one queue can only hand out the compute queue: an error, not a hang."""
    from offload_core.backends.xpu import XpuBackend

    backend = XpuBackend(runtime=simulated.SimRuntime("xpu", pool=1), copier=simulated.SimCopier())
    with pytest.raises(OffloadError, match="no separate copy queue"):
        backend.new_stream()


@pytest.mark.xpu
def test_xpu_loads_pageable_host_rows_a_store_still_writes_after_it(tmp_path):
    """A shared region is pageable on xpu, which stages such rows during the enqueue, out of
    stream order: a load of a host block behind a store into it must still read the store's bytes."""
    from offload_core import SharedHostRegion
    from offload_core.backends.xpu import XpuBackend

    class Truthful(simulated.SimRuntime):  # the region's mmap is pageable, as torch.xpu says
        def is_pinned(self, tensor):
            return self.page_locked(tensor.data_ptr(), max(tensor.nbytes, 1))

    backend = XpuBackend(runtime=Truthful("xpu", pool=4), copier=simulated.SimCopier())
    kv = small_kv(blocks=8)
    with SharedHostRegion("r", num_blocks=4, slot_bytes=[192], directory=tmp_path) as region:
        with OffloadWorker(kv, 4, backend=backend, host_region=region) as worker:
            backend.current_stream().launch(lambda: time.sleep(0.2))  # the model still runs: the store waits
            assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([0]))
            assert worker.submit_load(2, HostBlocks([0]), DeviceBlocks([5]))
            worker.wait([1, 2])
            assert all(r.success for r in worker.get_finished())
        assert all(torch.equal(t.tensor[5], t.tensor[1]) for t in kv.tensors)


def test_xpu_before_torch_2_6_is_refused(monkeypatch):
    """Its events could not time copies (elapsed_time raised): every job would fail."""
    from offload_core.backends.xpu import XpuBackend

    monkeypatch.setattr(torch, "__version__", "2.5.1+xpu")
    assert "needs 2.6 or later" in XpuBackend.probe()


def test_xpu_needs_registered_memory(sim_xpu):
    backend, _ = sim_xpu
    stray = torch.zeros(64, dtype=torch.uint8)
    host = backend.alloc_host(64)
    one = np.ones(1, dtype=np.int64)
    with pytest.raises(ValueError, match="registered"):
        backend.copy_batch(
            one * stray.data_ptr(), one * host.data_ptr(), one * 8, Direction.STORE, backend.new_stream()
        )


@pytest.mark.xpu
def test_xpu_holds_registered_memory_weakly(sim_xpu):
    """The registry keeps the backend for good: holding a worker's host buffer (or a region's
    view) strongly would keep it, and the region's mapping, alive for good too."""
    import gc
    import weakref

    backend, _ = sim_xpu
    tensor = torch.zeros(64, dtype=torch.uint8)
    backend.register_buffer(tensor)
    gone = weakref.ref(tensor)
    del tensor
    gc.collect()
    assert gone() is None
    host = backend.alloc_host(64)
    one = np.ones(1, dtype=np.int64)
    stream = backend.new_stream()
    backend.copy_batch(one * host.data_ptr(), one * (host.data_ptr() + 32), one * 8, Direction.STORE, stream)
    stream.synchronize()  # as test_xpu_memory_stays_registered_while_any_tensor_over_it_lives


@pytest.mark.xpu
def test_xpu_registrations_survive_collections_on_other_threads(sim_xpu):
    import sys
    import threading

    backend, _ = sim_xpu
    live = []
    stop = threading.Event()

    def churn():  # tensors registered and collected on another thread: their finalizers rebuild too
        while not stop.is_set():
            backend.register_buffer(torch.zeros(16, dtype=torch.uint8))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(300):
            tensor = torch.zeros(16, dtype=torch.uint8)
            backend.register_buffer(tensor)
            live.append(tensor)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    starts = set(backend._table[1].tolist())
    assert all(t.data_ptr() in starts for t in live)


def test_simulations_leave_no_trace():
    """From the built-in registrations (whatever the session installed is put aside meanwhile)."""
    from offload_core import availability
    from offload_core.testing.fresh_registry import fresh_registry

    with fresh_registry():
        real = availability()
        with simulated.npu():
            with simulated.xpu():
                assert availability()["npu"] is None and availability()["xpu"] is None
        assert availability() == real


def test_simulations_replace_registrations_and_patch_no_module():
    import sys

    from offload_core import registry

    before = {name: registry.backend_class(name) for name in ("npu", "xpu")}
    modules = (getattr(torch, "npu", None), getattr(torch, "xpu", None), sys.modules.get("torch_npu"))
    with simulated.npu() as acl:
        with simulated.xpu() as runtime:
            assert issubclass(registry.backend_class("npu"), simulated.SimulatedNpuBackend)
            assert get_backend("npu").runtime is acl.runtime and get_backend("xpu").runtime is runtime
            assert (getattr(torch, "npu", None), getattr(torch, "xpu", None), sys.modules.get("torch_npu")) == modules
        assert registry.backend_class("xpu") is before["xpu"]
    assert {name: registry.backend_class(name) for name in ("npu", "xpu")} == before


def test_npu_holds_the_acl_library_it_was_given():
    """Its entry points may be callbacks that live only as long as the object: the backend keeps
    it, so a caller that passes a fresh one and drops it does not leave dangling pointers."""
    import gc
    import weakref

    from offload_core.backends.npu import NpuBackend

    runtime = simulated.SimRuntime("npu")
    acl = simulated.SimAcl(runtime)
    backend = NpuBackend(0, runtime=runtime, acl=acl)
    gone = weakref.ref(acl)
    del acl
    gc.collect()
    assert gone() is not None and backend._acl is gone()


@pytest.mark.xpu
def test_xpu_memory_stays_registered_while_any_tensor_over_it_lives(sim_xpu):
    """Two workers' views of one cache: the first's registration must survive the second's, a
    shorter one from the same address, and its collection; a view's own registration goes with it."""
    import gc

    backend, _ = sim_xpu
    host = backend.alloc_host(256)
    cache = torch.zeros(256, dtype=torch.uint8)
    backend.register_buffer(cache)
    head = cache[:64]  # a second worker over the first blocks only
    backend.register_buffer(head)
    one, base = np.ones(1, dtype=np.int64), cache.data_ptr()

    def store(offset):  # waited for: a copy left running at exit dies inside torch on its daemon thread, an abort
        stream = backend.new_stream()
        backend.copy_batch(one * (base + offset), one * host.data_ptr(), one * 8, Direction.STORE, stream)
        stream.synchronize()

    store(200)  # beyond the shorter view: the longer one covers it
    del head
    gc.collect()
    store(200)
    store(0)
    for _ in range(3):
        backend.register_buffer(cache)  # again and again: one entry
    assert sum(e[2]() is cache for e in backend._table[0]) == 1
    del cache
    gc.collect()
    with pytest.raises(ValueError, match="registered"):  # its memory is no longer the caller's
        store(0)
