"""The cuda backend's mechanisms, one object each, and `TABLE`, the one place they are listed.

A batch of descriptors (`CudaBackend.copy_batch`) goes by ``ce_batch`` (one
``cuMemcpyBatchAsync`` on the copy engines; auto's, where the driver has it) or ``ce_loop`` (one
``cuMemcpyAsync`` per descriptor, for drivers without the batch API; auto's there). A worker's
compact jobs go by the mechanisms of `blocks`, listed here too. Mechanisms keep no state.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cuda.blocks import EXPAND_DIRECT, EXPAND_STAGED
from offload_core.backends.cuda.driver import SRC_ACCESS_ORDER_ANY, SRC_ACCESS_ORDER_STREAM


class Mechanism(abc.ABC):
    """One way to enqueue a batch of descriptors (`CudaBackend.copy_batch`)."""

    name: ClassVar[str]
    takes_batches: ClassVar[bool] = True  # False for the compact-job mechanisms in the table

    def why_unavailable(self, backend) -> str | None:
        """None if this mechanism can run on `backend`, else why not."""
        return None

    @abc.abstractmethod
    def enqueue(
        self, backend, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream, held: list
    ) -> None:
        """Enqueue ``dst[i] <- src[i]`` for ``sizes[i]`` bytes on `stream`; what the device may
        still read afterwards goes to `held`."""


class CeBatch(Mechanism):
    name = "ce_batch"

    def why_unavailable(self, backend) -> str | None:
        if backend.driver.memcpy_batch is None:
            return "the driver has no cuMemcpyBatchAsync (CUDA 12.8 or later)"
        return None

    def enqueue(self, backend, src, dst, sizes, direction, stream, held) -> None:
        # stores read the live KV cache in stream order; loads read stable host memory
        order = SRC_ACCESS_ORDER_STREAM if direction is Direction.STORE else SRC_ACCESS_ORDER_ANY
        backend.driver.memcpy_batch_async(dst, src, sizes, order, stream.cuda_stream, backend.max_batch, held)


class CeLoop(Mechanism):
    name = "ce_loop"

    def enqueue(self, backend, src, dst, sizes, direction, stream, held) -> None:
        backend.driver.memcpy_loop_async(dst, src, sizes, stream.cuda_stream)


TABLE: dict = {m.name: m for m in (CeBatch(), CeLoop(), EXPAND_STAGED, EXPAND_DIRECT)}
MECHANISMS = tuple(name for name, m in TABLE.items() if m.takes_batches)  # for descriptor batches
BLOCK_MECHANISMS = tuple(name for name, m in TABLE.items() if not m.takes_batches)  # for compact jobs (a worker's)
