"""The CUDA driver entry points the cuda backend calls directly, through ctypes with numpy arrays
(a batch of any size is one foreign call). They come from ``cuGetProcAddress`` at an explicit
ABI version: CUDA 13 renames ``cuMemcpyBatchAsync`` to an 8-argument ``_v2``, and asking for
12.8 keeps the 9-argument form whatever the toolkit.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

CUresult = ctypes.c_int


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


SRC_ACCESS_ORDER_STREAM = 1  # read the source in stream order (it may still be written before us)
SRC_ACCESS_ORDER_ANY = 3  # the source is stable: the driver may read it whenever it likes
POINTER_ATTRIBUTE_DEVICE_POINTER = 3
BATCH_ABI_VERSION = 12080
_PTR, _SIZE, _SIZES = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)

# CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
#     CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream)
MEMCPY_BATCH = ctypes.CFUNCTYPE(
    CUresult, *[_PTR] * 3, _SIZE, ctypes.POINTER(CUmemcpyAttributes), _SIZES, _SIZE, _SIZES, _PTR
)
# CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream)
MEMCPY = ctypes.CFUNCTYPE(CUresult, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
# CUresult cuStreamCreate(CUstream *phStream, unsigned int flags)
STREAM_CREATE = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
STREAM_NON_BLOCKING = 1  # no implicit ordering with the legacy default stream
# CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int flags); cuMemHostUnregister(void *p)
HOST_REGISTER = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
HOST_UNREGISTER = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p)
# CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
#     CUdriverProcAddressQueryResult *symbolStatus)
GET_PROC_ADDRESS = ctypes.CFUNCTYPE(
    CUresult, ctypes.c_char_p, ctypes.POINTER(_PTR), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)
)
# CUresult cuGetErrorName(CUresult error, const char **pStr)
GET_ERROR_NAME = ctypes.CFUNCTYPE(CUresult, CUresult, ctypes.POINTER(ctypes.c_char_p))
# cuEventCreate(CUevent *, flags); cuEventRecord(CUevent, CUstream); cuStreamWaitEvent(CUstream,
# CUevent, flags); cuEventQuery, Synchronize, Destroy(CUevent); cuEventElapsedTime(float *, start, end)
EVENT_CREATE = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
EVENT_RECORD = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p, ctypes.c_void_p)
STREAM_WAIT_EVENT = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
EVENT_CALL = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p)
EVENT_ELAPSED_TIME = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # (float *, ...)
# CUresult cuLaunchKernel(CUfunction, unsigned gridX, gridY, gridZ, blockX, blockY, blockZ,
#     unsigned sharedMemBytes, CUstream, void **kernelParams, void **extra)
LAUNCH_KERNEL = ctypes.CFUNCTYPE(
    CUresult, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)
# cuCtxGetCurrent(CUcontext *); cuCtxPushCurrent(CUcontext); cuCtxPopCurrent(CUcontext *)
CTX_OUT = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(ctypes.c_void_p))
CTX_IN = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p)
ERROR_NOT_READY = 600
HOST_REGISTER_PORTABLE_DEVICEMAP = 0x3  # pinned for every context, mapped for kernels
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
# CUresult cuPointerGetAttribute(void *data, CUpointer_attribute, CUdeviceptr)
POINTER_GET_ATTRIBUTE = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)
COMPILED = "offload_core.backends.cuda._driver"  # _driver.c: the short calls and launches below, in C


def compiled() -> ModuleType | None:
    """_driver.c's module, or None where it was not built or ``OFFLOAD_CORE_NATIVE=0`` (ctypes then).

    Raises:
        ConfigError: a malformed ``OFFLOAD_CORE_NATIVE``.
    """
    from offload_core import native

    return native.load(COMPILED)


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; `code` is the CUresult."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Driver:
    """Entry points of one loaded libcuda.

    Args:
        lib: the loaded library (``ctypes.CDLL("libcuda.so.1")``), or anything else whose
            ``cuGetProcAddress_v2`` and ``cuGetErrorName`` are C function pointers.

    Attributes:
        memcpy_batch: ``cuMemcpyBatchAsync`` (12.8 ABI), or None on drivers before 12.8.
        memcpy: ``cuMemcpyAsync``.

    Raises:
        OSError: the library lacks an entry point the backend always calls (copies, events,
            contexts).
    """

    def __init__(self, lib: Any):
        self._attrs: dict = {}
        self._lib = lib
        self._get_proc = GET_PROC_ADDRESS(self.address(lib.cuGetProcAddress_v2))
        self._error_name = GET_ERROR_NAME(self.address(lib.cuGetErrorName))
        self.memcpy_batch = self.resolve("cuMemcpyBatchAsync", BATCH_ABI_VERSION, MEMCPY_BATCH)
        self.memcpy = self.resolve("cuMemcpyAsync", 4000, MEMCPY)
        self.pointer_get_attribute = self.resolve("cuPointerGetAttribute", 4000, POINTER_GET_ATTRIBUTE)
        self.stream_create = self.resolve("cuStreamCreate", 2000, STREAM_CREATE)
        # through the driver, not torch's cudart: a failed runtime call would leave an error
        # that torch's next kernel launch reports as its own
        self.host_register = self.resolve("cuMemHostRegister", 6050, HOST_REGISTER)
        self.host_unregister = self.resolve("cuMemHostUnregister", 4000, HOST_UNREGISTER)
        self.event_create = self.resolve("cuEventCreate", 2000, EVENT_CREATE)
        self.event_record = self.resolve("cuEventRecord", 2000, EVENT_RECORD)
        self.stream_wait_event = self.resolve("cuStreamWaitEvent", 3020, STREAM_WAIT_EVENT)
        self.event_query = self.resolve("cuEventQuery", 2000, EVENT_CALL)
        self.event_synchronize = self.resolve("cuEventSynchronize", 2000, EVENT_CALL)
        self.event_destroy = self.resolve("cuEventDestroy", 4000, EVENT_CALL)
        self.event_elapsed_time = self.resolve("cuEventElapsedTime", 12080, EVENT_ELAPSED_TIME) or self.resolve(
            "cuEventElapsedTime", 2000, EVENT_ELAPSED_TIME
        )
        self.launch_kernel = self.resolve("cuLaunchKernel", 4000, LAUNCH_KERNEL)
        self.ctx_get_current = self.resolve("cuCtxGetCurrent", 4000, CTX_OUT)
        self.ctx_push_current = self.resolve("cuCtxPushCurrent", 4000, CTX_IN)
        self.ctx_pop_current = self.resolve("cuCtxPopCurrent", 4000, CTX_OUT)
        needed = ("memcpy", "event_create", "event_record", "stream_wait_event", "event_query", "event_synchronize")
        needed += ("event_destroy", "event_elapsed_time", "ctx_get_current", "ctx_push_current", "ctx_pop_current")
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:  # every driver since CUDA 12 (the first with cuGetProcAddress_v2) has them
            raise OSError(f"libcuda lacks entry points the cuda backend needs: {', '.join(missing)}")
        # The hot path's short calls, ``(context, *args) -> CUresult`` (the negated code where
        # the context could not be made current). Compiled (`compiled`), they keep the GIL:
        # each is asynchronous or asks about work done, and handing the GIL to another thread
        # and back costs 15-20 us of a job on the H200's host.
        self.record_in = self._context_call(self.event_record)
        self.query_in = self._context_call(self.event_query)
        self.wait_in = self._context_call(self.stream_wait_event)
        self.elapsed_in = self._context_call(self.event_elapsed_time)
        self.memcpy_in = self._context_call(self.memcpy)

    def _context_call(self, fn: Callable) -> Callable[..., int]:
        module = compiled()
        if module is None:
            return functools.partial(self._in_context_or_code, fn)
        contexts = (self.ctx_get_current, self.ctx_push_current, self.ctx_pop_current)
        return functools.partial(module.context_call, *map(self.address, contexts), self.address(fn))

    def table_launch_in(self, context: int) -> Callable[..., None] | None:
        """A descriptor table's upload and a kernel's launch in one compiled call in `context`
        (`DescriptorRing.upload_launch`'s `launch`), or None where the module or an entry point
        is missing. The callable raises `CudaDriverError` naming the call that failed."""
        module = compiled()
        if module is None or self.launch_kernel is None:
            return None
        entry = [self.address(f) for f in (self.ctx_get_current, self.ctx_push_current, self.ctx_pop_current)]
        bound = functools.partial(
            module.table_launch, *entry, self.address(self.memcpy), self.address(self.launch_kernel), context
        )

        def launch(*args) -> None:
            failed = bound(*args)
            if failed is not None:
                self.fail(failed[1], failed[0])

        return launch

    def fail(self, code: int, what: str) -> NoReturn:
        """Raise for a nonzero result (a short call's negated code: cuCtxPushCurrent's)."""
        if code < 0:
            what, code = "cuCtxPushCurrent", -code
        raise CudaDriverError(f"{what} failed: {self.error_name(code)}", code)

    def check(self, code: int, what: str) -> None:
        if code:
            self.fail(code, what)

    def _in_context_or_code(self, fn: Callable, context: int, *args) -> int:
        try:
            return self.in_context(context, fn, *args)
        except CudaDriverError as exc:  # only the push raises
            return -exc.code

    @staticmethod
    def address(fn: Callable) -> int:
        """The C address of an entry point."""
        return ctypes.cast(fn, ctypes.c_void_p).value

    def current_context(self) -> int | None:
        """The calling thread's current context (None where it has none)."""
        out = ctypes.c_void_p()
        self.ctx_get_current(ctypes.byref(out))
        return out.value

    def in_context(self, context: int, fn: Callable, *args) -> int:
        """``fn(*args)`` with `context` current in the calling thread, which afterwards has the
        context it had before; returns `fn`'s CUresult."""
        if self.current_context() == context:
            return fn(*args)
        self.check(self.ctx_push_current(context), "cuCtxPushCurrent")
        try:
            return fn(*args)
        finally:
            self.ctx_pop_current(ctypes.byref(ctypes.c_void_p()))

    @classmethod
    def load(cls) -> Driver:
        """Load the system's libcuda.

        Raises:
            OSError: no NVIDIA driver library here.
        """
        return cls(ctypes.CDLL("libcuda.so.1"))

    def resolve(self, name: str, version: int, prototype: Callable) -> Callable | None:
        """The entry point `name` at ABI `version`, or None where the driver lacks it."""
        pfn = ctypes.c_void_p()
        status = ctypes.c_int()
        result = self._get_proc(name.encode(), ctypes.byref(pfn), version, 0, ctypes.byref(status))
        if result != 0 or not pfn.value:
            return None
        return prototype(pfn.value)

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._error_name(code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUDA error {code}"
        return name.value.decode()

    def memcpy_batch_async(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        sizes: np.ndarray,
        order: int,
        stream: int,
        max_batch: int = 0,
        held: list | None = None,
    ) -> tuple:
        """Enqueue one ``cuMemcpyBatchAsync`` per `max_batch` descriptors (0: all in one call).

        Args:
            held: a list that what the copies read goes to before the first is enqueued.

        Returns:
            What the caller must keep alive until the stream has passed the copies (the driver
            may read its argument arrays after it returns).

        Raises:
            CudaDriverError: naming the index of the failing copy within the whole batch.
        """
        if self.memcpy_batch is None:
            raise CudaDriverError("cuMemcpyBatchAsync needs a CUDA 12.8 driver", 0)
        if not stream:  # the legacy default stream is rejected with INVALID_VALUE
            raise CudaDriverError("cuMemcpyBatchAsync cannot run on the legacy default stream", 1)
        if order not in self._attrs:  # one attribute set, for copies from 0 on: made once, never written after
            self._attrs[order] = (CUmemcpyAttributes(srcAccessOrder=order), ctypes.c_size_t(0))
        attrs, first = self._attrs[order]
        keep = (dst, src, sizes, attrs, first)
        if held is not None:
            held.append(keep)
        n = len(sizes)
        step = max_batch if max_batch > 0 else n
        fail = ctypes.c_size_t(0)
        common = (ctypes.byref(attrs), ctypes.byref(first), 1, ctypes.byref(fail))  # every call's
        for start in range(0, n, step):
            count = min(step, n - start)
            offset = 8 * start
            fail.value = 0
            code = self.memcpy_batch(
                dst.ctypes.data + offset, src.ctypes.data + offset, sizes.ctypes.data + offset, count, *common, stream
            )
            if code != 0:
                where = (
                    f"at index {start + fail.value} of {n}"
                    if fail.value < count
                    else f"in copies {start}..{start + count - 1}"
                )
                raise CudaDriverError(f"cuMemcpyBatchAsync failed {where}: {self.error_name(code)}", code)
        return keep

    def memcpy_loop_async(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """One ``cuMemcpyAsync`` per descriptor: the fallback without the batch API.

        Raises:
            CudaDriverError: naming the failing descriptor.
        """
        memcpy = self.memcpy
        for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), sizes.tolist())):
            code = memcpy(d, s, n, stream)
            if code != 0:
                raise CudaDriverError(
                    f"cuMemcpyAsync failed at index {i} of {len(sizes)}: {self.error_name(code)}", code
                )

    def new_stream(self) -> int:
        """A new non-blocking stream of the current context, never shared with anyone.

        Raises:
            CudaDriverError: the driver refused.
        """
        handle = ctypes.c_void_p()
        self.check(self.stream_create(ctypes.byref(handle), STREAM_NON_BLOCKING), "cuStreamCreate")
        return handle.value

    def device_pointer(self, host_address: int) -> int | None:
        """The device's address for host memory, or None if the device cannot address it."""
        if self.pointer_get_attribute is None:
            return None
        out = ctypes.c_uint64()
        code = self.pointer_get_attribute(ctypes.addressof(out), POINTER_ATTRIBUTE_DEVICE_POINTER, host_address)
        return out.value if code == 0 else None
