"""Stand-ins for the cuda backend's tests without a GPU: libcuda (`FakeLib`, and `LaunchingLib`
with kernel launches), ``torch.cuda`` (`FakeCudaRuntime`) and a backend over both
(`host_only_backend`)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from types import SimpleNamespace

import numpy as np
import torch
from helpers import compiled_or_skip

from offload_core.backends.cuda import CudaBackend, kernels
from offload_core.backends.cuda import driver as drv
from offload_core.backends.cuda.select import CostModel

GPU_CONTEXT = 0xC0  # the backend's CUcontext in the fake driver
ERROR_NAME = b"CUDA_ERROR_INVALID_VALUE"  # lives as long as the module: the driver reads it after the call


def read_array(address, count, kind=ctypes.c_int64):
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(kind)), (count,)).copy()


class FakeLib:
    """A libcuda stand-in whose entry points are Python callbacks behind real C function pointers,
    each call logged in `calls`; `codes` queues the codes an entry point returns next (then 0).

    `contexts` is the calling thread's context stack (top last): the creating thread starts with
    the GPU's context current, any other thread (a queue's launcher thread) with none."""

    @property
    def contexts(self) -> list:
        me = threading.get_ident()  # not a threading.local: each callback from a C thread is a new thread state
        if me not in self._stacks:
            self._stacks[me] = [GPU_CONTEXT] if me == self._creator else []
        return self._stacks[me]

    def __init__(self, with_batch=True):
        self.calls, self.fail_at, self.codes = [], None, {}
        self._events, self._stacks, self._creator = 0, {}, threading.get_ident()

        def returns(name):
            queued = self.codes.get(name)
            return queued.pop(0) if queued else 0

        def logged(name):  # logs (name, *arguments), returns the next queued code
            return lambda *args: self.calls.append((name, *args)) or returns(name)

        def batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
            d, s, n = (read_array(a, count) for a in (dsts, srcs, sizes))
            self.calls.append(("batch", d, s, n, attrs.contents.srcAccessOrder, attr_idxs[0], num_attrs, stream))
            if not self.contexts:  # the H200's driver: INVALID_VALUE, on a thread with no context current
                return 1
            if self.fail_at is not None and self.fail_at < count:
                fail_idx[0] = self.fail_at
                return 1  # CUDA_ERROR_INVALID_VALUE
            return 0

        def memcpy(dst, src, size, stream):
            self.calls.append(("memcpy", dst, src, size, stream))
            return returns("memcpy") if self.contexts else 201  # CUDA_ERROR_INVALID_CONTEXT

        def stream_create(handle, flags):
            self.calls.append(("stream_create", flags))
            handle[0] = 0xBEEF
            return 0

        def event_create(handle, flags):
            self.calls.append(("event_create", flags))
            self._events += 1  # unique, even once the calls were cleared
            handle[0] = 0xE0 + self._events
            return returns("create")

        def elapsed(ms, start, end):
            self.calls.append(("elapsed", start, end))
            ctypes.c_float.from_address(ms).value = 1.5
            return returns("elapsed")

        def ctx_get(out):
            out[0] = self.contexts[-1] if self.contexts else None
            return 0

        def ctx_push(ctx):
            self.calls.append(("push", ctx))
            self.contexts.append(ctx)
            return 0

        def ctx_pop(out):
            self.calls.append(("pop",))
            out[0] = self.contexts.pop()
            return 0

        self._keep = {
            "cuEventCreate": drv.EVENT_CREATE(event_create),
            "cuEventRecord": drv.EVENT_RECORD(logged("record")),
            "cuStreamWaitEvent": drv.STREAM_WAIT_EVENT(logged("wait")),
            **{f"cuEvent{n.capitalize()}": drv.EVENT_CALL(logged(n)) for n in ("query", "synchronize", "destroy")},
            "cuEventElapsedTime": drv.EVENT_ELAPSED_TIME(elapsed),
            "cuCtxGetCurrent": drv.CTX_OUT(ctx_get),
            "cuCtxPushCurrent": drv.CTX_IN(ctx_push),
            "cuCtxPopCurrent": drv.CTX_OUT(ctx_pop),
            "cuStreamCreate": drv.STREAM_CREATE(stream_create),
            "cuMemcpyAsync": drv.MEMCPY(memcpy),
        }
        if with_batch:
            self._keep["cuMemcpyBatchAsync"] = drv.MEMCPY_BATCH(batch)

        def get_proc(symbol, pfn, version, flags, status):
            fn = self._keep.get(symbol.decode())
            if fn is None:
                return 500  # CUDA_ERROR_NOT_FOUND
            pfn[0] = ctypes.cast(fn, ctypes.c_void_p).value
            return 0

        def error_name(code, out):
            out[0] = ERROR_NAME
            return 0

        self.cuGetProcAddress_v2 = drv.GET_PROC_ADDRESS(get_proc)
        self.cuGetErrorName = drv.GET_ERROR_NAME(error_name)

    def runtime_call(self) -> None:
        """What a call of the CUDA runtime does first on a thread: make the device's primary
        context current there, if none is."""
        if not self.contexts:
            self.contexts.append(GPU_CONTEXT)


NAMES = ("blocks", "n", "entries", "num_entries", "groups", "num_groups", "per_block", "row_base", "row_step")
WIDE = ("i64",) * len(NAMES)  # every parameter 64 bits


class LaunchingLib(FakeLib):
    """`FakeLib` with ``cuLaunchKernel``: a launch is logged as ``("launch", grid, threads,
    shared, stream, *params)``, each parameter read as the kernel would (`types`)."""

    def __init__(self, types=WIDE, hidden=2, **kwargs):
        super().__init__(**kwargs)
        self.types, self.hidden = list(types), hidden
        self.codes.setdefault("launch", [])

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            kinds = self.types + ["*i8"] * self.hidden
            values = [
                (ctypes.c_int32 if k == "i32" else ctypes.c_uint64).from_address(slots[i]).value
                for i, k in enumerate(kinds)
            ]
            self.calls.append(("launch", gx, bx, shared, stream, *values))
            queued = self.codes.get("launch")
            return queued.pop(0) if queued else 0

        self._keep["cuLaunchKernel"] = drv.LAUNCH_KERNEL(launch)


def arrays(n):
    return np.arange(n, dtype=np.int64) * 10 + 1000, np.arange(n, dtype=np.int64) * 10 + 5000, np.full(n, 8, np.int64)


class FakeCudaRuntime:
    """``torch.cuda`` as `CudaBackend` uses it, without a GPU: one device whose memory is the
    CPU's, streams known by their handles, the current one 0x5. Given the stand-in libcuda, its
    calls make the GPU's context current on the calling thread, as the runtime's do."""

    def __init__(self, lib: FakeLib | None = None):
        self._lib = lib

    def _call(self) -> bool:
        if self._lib is not None:
            self._lib.runtime_call()
        return True

    def torch_device(self, index):
        return torch.device("cpu")

    def get_device_name(self, device):
        return "Fake GPU"

    def get_device_properties(self, device):
        return SimpleNamespace(multi_processor_count=132, total_memory=80 << 30)

    def current_device(self):
        return 0

    def device(self, device):
        return contextlib.nullcontext()

    def current_stream(self, index):
        return SimpleNamespace(cuda_stream=0x5, query=self._call)

    def ExternalStream(self, handle, device=None):  # noqa: N802  (torch's name)
        return SimpleNamespace(cuda_stream=handle)

    def alloc_pinned(self, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def synchronize(self, index):
        if self._lib is not None:
            self._lib.calls.append(("device_synchronize", index))


def host_only_backend(monkeypatch, lib, triton=True, mechanism="auto", cost=None, tune=False):
    """A CudaBackend over a stand-in libcuda and runtime: the table decides what is available.
    `auto` is the cost model's alone unless `tune` (the tuner has tests of its own:
    test_cuda_tuning.py)."""
    monkeypatch.setattr(kernels, "why_unavailable", (lambda: None) if triton else (lambda: "triton is not importable"))
    return CudaBackend(
        mechanism=mechanism,
        cost_model=cost or CostModel(),
        driver=drv.Driver(lib),
        runtime=FakeCudaRuntime(lib),
        tune=tune,
    )


def copies(lib):
    """The copy calls the backend made (events and contexts aside)."""
    return [c for c in lib.calls if c[0] in ("batch", "memcpy")]


def compiled_table_launch(lib=None):
    """A `LaunchingLib`, and the compiled table launch of its driver in the GPU's context."""
    compiled_or_skip(True, drv.COMPILED)
    lib = lib or LaunchingLib(types=("i64", "i32", "i64"), hidden=1)
    return lib, drv.Driver(lib).table_launch_in(GPU_CONTEXT)
