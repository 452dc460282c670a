"""The npu backend: Huawei Ascend NPUs through torch_npu and the ACL runtime.

Batched copies, best available first:

* ``acl_batch``: ``aclrtMemcpyBatchAsync`` (CANN 8.5+), through ctypes, where the product
  supports it (else its first call says so and every later batch goes by ``acl_loop``);
* ``swap_blocks_batch``: vllm-ascend's operator, when it is registered;
* ``acl_loop``: one ``aclrtMemcpyAsync`` per copy.

torch_npu queues launches on a second thread; ``stream.npu_stream`` drains that queue, so the
raw stream handle is read at the moment of each call, never cached.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from typing import Any

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.torch_device import Runtime, TorchDeviceBackend

log = logging.getLogger(__name__)

# aclrtMemcpyKind
ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST = 1, 2
# aclrtMemLocationType
ACL_MEM_LOCATION_TYPE_HOST, ACL_MEM_LOCATION_TYPE_DEVICE = 0, 1
ACL_HOST_REG_PINNED = 0x10000000  # aclrtHostRegisterV2's flag for page-locked memory (0 is refused)
# what a product without the batch call answers it (CANN lists no 310P, no first Atlas training series)
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
# vllm-ascend's swap_blocks_batch direction argument (its own codes, not aclrtMemcpyKind)
SWAP_H2D, SWAP_D2H = 0, 1


class AclMemLocation(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_uint32)]


class AclMemcpyBatchAttr(ctypes.Structure):
    # acl_rt.h: destination first, then source, then reserved bytes
    _fields_ = [("dstLoc", AclMemLocation), ("srcLoc", AclMemLocation), ("rsv", ctypes.c_uint8 * 16)]


_PTR, _SIZE, _SIZES = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)
# aclError aclrtMemcpyBatchAsync(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes, size_t numBatches,
#     aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes, size_t numAttrs, size_t *failIndex, aclrtStream stream)
ACL_MEMCPY_BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int, *[_PTR] * 4, _SIZE, ctypes.POINTER(AclMemcpyBatchAttr), _SIZES, _SIZE, _SIZES, _PTR
)
# aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind, aclrtStream)
ACL_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, _PTR, _SIZE, _PTR, _SIZE, ctypes.c_int, _PTR)


def _entry(lib: Any, name: str, prototype):
    fn = getattr(lib, name, None)
    return None if fn is None else prototype(ctypes.cast(fn, ctypes.c_void_p).value)


class NpuBackend(TorchDeviceBackend):
    """Ascend NPUs. Streams, events and pinned memory from torch.npu; copies through ACL.

    Args:
        device_index: the NPU.
        runtime: torch.npu's surface, as `TorchDeviceBackend` describes it, plus, optionally,
            ``npurt()`` returning an object with ``npuHostRegister(address, size, flags)`` and
            ``npuHostUnregister(address)`` (host registration is unavailable without it), and
            ``stream.npu_stream``, the raw ``aclrtStream`` handle, on its streams. Default:
            ``TorchRuntime("npu")``, importing torch_npu first if torch has no torch.npu yet.
        acl: the ACL library: an object with ``aclrtMemcpyAsync`` and optionally
            ``aclrtMemcpyBatchAsync`` as C function pointers (ctypes functions) of the
            prototypes `ACL_MEMCPY` and `ACL_MEMCPY_BATCH`. Default: libascendcl.so, loaded now.

    Raises:
        ImportError: no runtime is given and torch_npu cannot be imported.
        OSError: the ACL library cannot be loaded (CANN is not installed or not on the loader's path),
            or has no ``aclrtMemcpyAsync``.
    """

    name = "npu"
    module_name = "npu"
    priority = 100
    install_hint = "torch_npu matching your torch and CANN: pip install -e '.[npu]' in offload-core's clone"

    @classmethod
    def probe(cls) -> str | None:
        import torch

        if getattr(torch, "npu", None) is None:
            if importlib.util.find_spec("torch_npu") is None:
                return "torch_npu is not installed"
            try:
                import torch_npu  # noqa: F401  (registers torch.npu)
            except Exception as exc:
                return f"torch_npu failed to import: {exc}"
        return cls._unavailable(torch.npu, "Ascend NPU")

    def __init__(self, device_index: int = 0, *, runtime: Runtime | None = None, acl: Any = None):
        if runtime is None:
            import torch

            if getattr(torch, "npu", None) is None:
                import torch_npu  # noqa: F401  (registers torch.npu; imported only now, never at import time)
        super().__init__(device_index, runtime=runtime)
        if acl is None:
            acl = ctypes.CDLL("libascendcl.so")
        self._acl = acl  # its entry points may be callbacks that live only as long as it
        self._batch = _entry(acl, "aclrtMemcpyBatchAsync", ACL_MEMCPY_BATCH)
        self._memcpy = _entry(acl, "aclrtMemcpyAsync", ACL_MEMCPY)
        if self._memcpy is None:
            raise OSError("the ACL library has no aclrtMemcpyAsync")
        try:
            self._swap_op = self._torch.ops._C_ascend.swap_blocks_batch
        except (AttributeError, RuntimeError):
            self._swap_op = None
        self.mechanism = "acl_batch" if self._batch else "swap_blocks_batch" if self._swap_op else "acl_loop"

    def pin_host_memory(self, tensor) -> bool:
        npurt = getattr(self.runtime, "npurt", None)
        register = getattr(npurt() if npurt else None, "npuHostRegister", None)
        # torch_npu hands the flags to aclrtHostRegisterV2 as they are
        return register is not None and int(register(tensor.data_ptr(), tensor.nbytes, ACL_HOST_REG_PINNED)) == 0

    def unpin_host_memory(self, tensor) -> None:
        npurt = getattr(self.runtime, "npurt", None)
        unregister = getattr(npurt() if npurt else None, "npuHostUnregister", None)
        if unregister is not None:
            unregister(tensor.data_ptr())

    def copy_batch(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream) -> str:
        src, dst, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (src, dst, sizes))
        self._bind_thread()
        store = direction is Direction.STORE
        if self.mechanism == "acl_batch":
            host = AclMemLocation(0, ACL_MEM_LOCATION_TYPE_HOST)
            device = AclMemLocation(self.device_index, ACL_MEM_LOCATION_TYPE_DEVICE)
            attr = AclMemcpyBatchAttr(dstLoc=host if store else device, srcLoc=device if store else host)
            first, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)
            code = self._batch(
                dst.ctypes.data,
                sizes.ctypes.data,
                src.ctypes.data,
                sizes.ctypes.data,
                len(sizes),
                ctypes.byref(attr),
                ctypes.byref(first),
                1,
                ctypes.byref(fail),
                stream.npu_stream,
            )
            # Nothing enqueued: from now on every copy goes one by one (not by vllm-ascend's
            # operator, which calls the same batch function where it was built with it).
            if code == ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
                log.warning("npu: aclrtMemcpyBatchAsync is not supported on this device; copying with aclrtMemcpyAsync")
                self.mechanism = "acl_loop"
                return self.copy_batch(src, dst, sizes, direction, stream)
            if code != 0:
                where = f"at index {fail.value}" if fail.value < len(sizes) else "(no single copy)"
                raise RuntimeError(f"aclrtMemcpyBatchAsync failed {where} of {len(sizes)}: aclError {code}")
        elif self.mechanism == "swap_blocks_batch":
            with self.runtime.stream(stream):  # the operator issues on the current stream
                self._swap_op(*(self._torch.from_numpy(a) for a in (src, dst, sizes)), SWAP_D2H if store else SWAP_H2D)
        else:
            kind = ACL_MEMCPY_DEVICE_TO_HOST if store else ACL_MEMCPY_HOST_TO_DEVICE
            handle = stream.npu_stream
            for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), sizes.tolist())):
                code = self._memcpy(d, n, s, n, kind, handle)
                if code != 0:
                    raise RuntimeError(f"aclrtMemcpyAsync failed at index {i} of {len(sizes)}: aclError {code}")
        return self.mechanism
