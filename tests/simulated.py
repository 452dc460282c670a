"""Simulated Ascend (torch_npu + ACL) and Intel (torch.xpu) runtimes, for tests without the hardware.

Streams are the cpu backend's threads, and copies really happen, asynchronously, on host memory.
The simulated ACL returns an error code where the real one's requirements are broken (a valid
stream handle, a non-empty batch, one attribute set starting at copy 0, page-locked host and
unlocked device locations, a known copy kind, a large enough destination). The backends are the
production ones, given a `SimRuntime` (and a `SimAcl` or a `SimCopier`); `npu()` and `xpu()`
register them under ``"npu"`` and ``"xpu"`` while entered, and nothing else is patched::

    with simulated.npu():          # or simulated.xpu()
        backend = get_backend("npu")
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar
from unittest import mock

import numpy as np

from offload_core.backends.cpu import CpuEvent, CpuStream, memmove_all
from offload_core.backends.npu import NpuBackend
from offload_core.backends.xpu import XpuBackend

ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_RT_STREAM_INVALID = 107003
ACL_ERROR_RT_MEMORY_LOCATION = 507899  # the simulation's code for a host/device location mismatch
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000  # acl_base.h's, for a call the product lacks


class SimStream(CpuStream):
    """A stream with a raw handle, as torch_npu's ``npu_stream`` and torch.xpu's ``sycl_queue``."""

    def __init__(self, runtime: SimRuntime):
        super().__init__()
        self.handle = next(runtime.handles)
        runtime.streams[self.handle] = self

    @property
    def npu_stream(self) -> int:
        return self.handle

    @property
    def sycl_queue(self) -> int:
        return self.handle


class SimRuntime:
    """A stand-in for ``torch.npu`` or ``torch.xpu``: a `TorchDeviceBackend` runtime whose device
    memory is host memory.

    Args:
        name: ``"npu"`` or ``"xpu"`` (for messages only).
        pool: 0 for a new stream per ``Stream()``, as torch.npu; else that many streams handed
            out round robin, the first of them the compute stream's, as torch.xpu's queues.
    """

    def __init__(self, name: str, pool: int = 0):
        self.name = name
        self.handles = itertools.count(0x1000)
        self.streams: weakref.WeakValueDictionary[int, SimStream] = weakref.WeakValueDictionary()
        self._pool = [SimStream(self) for _ in range(pool)]
        self._next = itertools.count()
        self._default = self._pool[0] if pool else SimStream(self)
        self._local = threading.local()
        self.pinned: dict[int, tuple[int, object]] = {}  # start -> (end, tensor or None)
        runtime = self

        class Stream(SimStream):
            def __new__(cls, device=None, priority=0):
                if runtime._pool:
                    return runtime._pool[next(runtime._next) % len(runtime._pool)]
                return super().__new__(cls)

            def __init__(self, device=None, priority=0):
                if not getattr(self, "handle", None):
                    SimStream.__init__(self, runtime)

        class Event(CpuEvent):
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                super().__init__()

            def record(self, stream=None):
                super().record(stream or runtime.current_stream())

        self.Stream, self.Event = Stream, Event

    def __repr__(self) -> str:
        return f"SimRuntime({self.name!r})"

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, index: int) -> None:
        self._local.device = index

    def current_stream(self, device=None) -> SimStream:
        return getattr(self._local, "stream", self._default)

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def synchronize(self, device=None) -> None:
        for stream in list(self.streams.values()):
            stream.synchronize()

    def torch_device(self, index: int):
        """The cpu: the simulated device's memory is host memory."""
        import torch

        return torch.device("cpu")

    def alloc_pinned(self, nbytes: int):
        """Zero-filled host memory, marked page-locked for the simulated ACL's checks."""
        import torch

        return self._mark_pinned(torch.zeros(nbytes, dtype=torch.uint8))

    def pin(self, tensor):
        """A copy, marked page-locked."""
        return self._mark_pinned(tensor.clone())

    def _mark_pinned(self, tensor):
        self.pinned[tensor.data_ptr()] = (tensor.data_ptr() + tensor.nbytes, tensor)
        return tensor

    def is_pinned(self, tensor) -> bool:
        """Always True, so the xpu backend stages nothing: every simulated copy is asynchronous
        anyway, and the simulated device memory (host memory) must never be staged."""
        return True

    def npurt(self) -> SimRuntime:
        return self  # torch.npu.npurt(): host registration lives here

    def npuHostRegister(self, address: int, size: int, flags: int) -> int:
        # aclrtHostRegisterV2, which it calls with `flags` as they are: ACL_HOST_REG_MAPPED (0x2)
        # and or ACL_HOST_REG_PINNED (0x10000000), a 4 KiB-aligned address (CANN's reference)
        if not flags or flags & ~(0x2 | 0x10000000) or address % 4096:
            return ACL_ERROR_INVALID_PARAM
        self.pinned[address] = (address + size, None)
        return 0

    def npuHostUnregister(self, address: int) -> int:
        return 0 if self.pinned.pop(address, None) else ACL_ERROR_INVALID_PARAM

    def page_locked(self, address: int, size: int) -> bool:
        """Whether ``[address, address + size)`` lies in memory from `alloc_pinned` or `npuHostRegister`."""
        return any(s <= address and address + size <= e for s, (e, _) in self.pinned.items())


class SimCopier:
    """The xpu backend's last step on a `SimRuntime`: a torch ``copy_`` cannot run asynchronously
    between host tensors, so the copies run on the stream's thread instead."""

    def enqueue(self, pairs, stream: SimStream, runtime: SimRuntime) -> None:
        stream.launch(lambda: [d.copy_(s) for d, s in pairs])


class SimAcl:
    """``aclrtMemcpyBatchAsync`` and ``aclrtMemcpyAsync`` as C function pointers over a SimRuntime."""

    def __init__(self, runtime: SimRuntime, with_batch: bool = True, batch_supported: bool = True):
        from offload_core.backends import npu

        self.runtime = runtime
        self.calls: list[tuple] = []
        self.batch_supported = batch_supported  # False: the entry point exists, the product lacks it (310P)
        if with_batch:
            self.aclrtMemcpyBatchAsync = npu.ACL_MEMCPY_BATCH(self._batch)
        self.aclrtMemcpyAsync = npu.ACL_MEMCPY(self._memcpy)

    def _locations_ok(self, dst: int, src: int, size: int, dst_host: bool, src_host: bool) -> bool:
        pinned = self.runtime.page_locked
        return pinned(dst, size) == dst_host and pinned(src, size) == src_host

    def _batch(self, dsts, dest_maxs, srcs, sizes, n, attrs, attr_idx, num_attrs, fail_idx, handle):
        from offload_core.backends import npu

        self.calls.append(("batch", n, handle))
        if not self.batch_supported:
            return ACL_ERROR_RT_FEATURE_NOT_SUPPORT
        stream = self.runtime.streams.get(handle or 0)
        if stream is None:
            return ACL_ERROR_RT_STREAM_INVALID
        if n == 0 or num_attrs < 1 or attr_idx[0] != 0:
            return ACL_ERROR_INVALID_PARAM
        d, dmax, s, size = (
            np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_int64)), (n,)).copy()
            for p in (dsts, dest_maxs, srcs, sizes)
        )
        attr = attrs[0]
        dst_host = attr.dstLoc.type == npu.ACL_MEM_LOCATION_TYPE_HOST
        src_host = attr.srcLoc.type == npu.ACL_MEM_LOCATION_TYPE_HOST
        if dst_host == src_host:
            return ACL_ERROR_INVALID_PARAM
        for i in range(n):
            if dmax[i] < size[i] or not self._locations_ok(int(d[i]), int(s[i]), int(size[i]), dst_host, src_host):
                fail_idx[0] = i
                return ACL_ERROR_RT_MEMORY_LOCATION
        stream.launch(lambda: memmove_all(s, d, size))
        return 0

    def _memcpy(self, dst, dest_max, src, count, kind, handle):
        from offload_core.backends import npu

        self.calls.append(("memcpy", kind, handle))
        stream = self.runtime.streams.get(handle or 0)
        if stream is None:
            return ACL_ERROR_RT_STREAM_INVALID
        if kind not in (npu.ACL_MEMCPY_HOST_TO_DEVICE, npu.ACL_MEMCPY_DEVICE_TO_HOST) or dest_max < count:
            return ACL_ERROR_INVALID_PARAM
        to_host = kind == npu.ACL_MEMCPY_DEVICE_TO_HOST
        if not self._locations_ok(dst, src, count, to_host, not to_host):
            return ACL_ERROR_RT_MEMORY_LOCATION
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        stream.launch(lambda: memmove_all(one(src), one(dst), one(count)))
        return 0


def _swap_blocks_batch_library(runtime: SimRuntime, acl: SimAcl):
    """vllm-ascend's ``_C_ascend::swap_blocks_batch``: int64 CPU tensors and a direction code
    (0 host to device, 1 device to host), copies issued on the current stream."""
    import torch

    from offload_core.backends import npu

    lib = torch.library.Library("_C_ascend", "DEF")
    lib.define("swap_blocks_batch(Tensor src, Tensor dst, Tensor sizes, int direction) -> ()")

    def swap_blocks_batch(src, dst, sizes, direction):
        acl.calls.append(("swap_blocks_batch", direction, runtime.current_stream().handle))
        if not all(t.dtype == torch.int64 and t.device.type == "cpu" for t in (src, dst, sizes)):
            raise RuntimeError("swap_blocks_batch takes int64 CPU tensors")
        if direction not in (npu.SWAP_H2D, npu.SWAP_D2H) or not len(src) == len(dst) == len(sizes):
            raise RuntimeError(f"swap_blocks_batch: bad direction {direction} or lengths")
        to_host = direction == npu.SWAP_D2H
        s, d, n = (t.numpy().copy() for t in (src, dst, sizes))
        for i in range(len(n)):
            if not acl._locations_ok(int(d[i]), int(s[i]), int(n[i]), to_host, not to_host):
                raise RuntimeError(f"swap_blocks_batch: copy {i} has a host side that is not page-locked")
        runtime.current_stream().launch(lambda: memmove_all(s, d, n))

    lib.impl("swap_blocks_batch", swap_blocks_batch, "CPU")
    return lib


class SimulatedNpuBackend(NpuBackend):
    """`NpuBackend` over one simulation's `SimRuntime` and `SimAcl`, always usable: `npu()`
    registers a subclass of it bound to its simulation."""

    sim_acl: ClassVar[SimAcl]

    @classmethod
    def probe(cls) -> str | None:
        return None

    def __init__(self, device_index: int = 0):
        super().__init__(device_index, runtime=self.sim_acl.runtime, acl=self.sim_acl)


class SimulatedXpuBackend(XpuBackend):
    """`XpuBackend` over one simulation's `SimRuntime` with a `SimCopier`, always usable: `xpu()`
    registers a subclass of it bound to its simulation."""

    sim_runtime: ClassVar[SimRuntime]

    @classmethod
    def probe(cls) -> str | None:
        return None

    def __init__(self, device_index: int = 0):
        super().__init__(device_index, runtime=self.sim_runtime, copier=SimCopier())


@contextlib.contextmanager
def _registered(name: str, cls: type) -> Iterator[None]:
    """`cls` as the backend `name`, and the previous registration back on exit."""
    from offload_core import registry

    previous: Any = registry.backend_class(name)
    registry.register_backend(name, cls, clobber=True)
    try:
        yield
    finally:
        registry.register_backend(name, previous, clobber=True)


@contextlib.contextmanager
def npu(with_batch: bool = True, with_operator: bool = False, batch_supported: bool = True) -> Iterator[SimAcl]:
    """Register a simulated npu backend (optionally without ACL's batch entry point, or with one
    the product does not support, optionally with vllm-ascend's operator) until exit. Yields the
    `SimAcl`; its ``runtime`` is the `SimRuntime`."""
    import torch

    runtime = SimRuntime("npu")
    acl = SimAcl(runtime, with_batch, batch_supported)
    bound = type("SimulatedNpuBackend", (SimulatedNpuBackend,), {"sim_acl": acl})
    library = _swap_blocks_batch_library(runtime, acl) if with_operator else None
    real_is_pinned = torch.Tensor.is_pinned

    def is_pinned(tensor, *args, **kwargs) -> bool:
        # host memory registered through npuHostRegister reads as pinned, as memory registered
        # through cudaHostRegister does to torch (assumed of torch_npu; not seen on an NPU)
        registered = tensor.device.type == "cpu" and runtime.page_locked(tensor.data_ptr(), max(1, tensor.nbytes))
        return registered or real_is_pinned(tensor, *args, **kwargs)

    try:
        with _registered("npu", bound), mock.patch.object(torch.Tensor, "is_pinned", is_pinned):
            yield acl
    finally:
        if library is not None:
            library._destroy()


@contextlib.contextmanager
def xpu(pool: int = 4) -> Iterator[SimRuntime]:
    """Register a simulated xpu backend until exit, its streams a round-robin pool of `pool` that
    starts with the compute stream's queue, as torch.xpu's. Yields the `SimRuntime`."""
    runtime = SimRuntime("xpu", pool=pool)
    bound = type("SimulatedXpuBackend", (SimulatedXpuBackend,), {"sim_runtime": runtime})
    with _registered("xpu", bound):
        yield runtime
