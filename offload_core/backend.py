"""The backend interface: everything the core needs from an accelerator (docs/backends.md).

Streams and events are whatever the device library returns (``torch.cuda.Stream``,
``torch.npu.Event``, ...): they satisfy the small protocols below without wrapping.
"""

from __future__ import annotations

import abc
import enum
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from offload_core.errors import integer

# For a backend's enqueues that user code may call directly: one step for Ctrl-C (docs/architecture.md §9).
from offload_core.interrupts import deferred  # noqa: F401

if TYPE_CHECKING:
    import torch

    from offload_core.compact import CompactJob, CompactLayout


class Direction(str, enum.Enum):
    """Which way a transfer goes. The value is what `TransferResult.direction` reports."""

    STORE = "store"  # device -> host
    LOAD = "load"  # host -> device


class Event(Protocol):
    def record(self, stream: Stream) -> None: ...  # mark the stream's current position

    def query(self) -> bool: ...  # has the marked work completed? Raises if it failed.

    def synchronize(self) -> None: ...  # block the host until it has; raises if it failed

    def elapsed_time(self, end: Event) -> float: ...  # milliseconds from this event to `end`


class Stream(Protocol):
    def wait_event(self, event: Event) -> None: ...  # later work waits for the event; host does not block

    def wait_stream(self, stream: Stream) -> None: ...  # later work waits for all work queued on `stream`


class Backend(abc.ABC):
    """An accelerator: streams, events, host memory it can copy from, and a batched copy.

    Subclasses set `name` (registry key, equal to the torch device type), `priority`
    (automatic selection prefers higher) and `install_hint`, and implement the abstract
    methods. The core never asks which backend it talks to.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    install_hint: ClassVar[str] = ""

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> str | None:
        """Say whether this backend can run here, without creating a device context.

        Cheap, idempotent and fork-safe: it may import the device SDK, never allocate.

        Returns:
            None when usable, else one sentence saying why not.

        Raises:
            ConfigError: this backend could run here, but its own setting (its environment
                variable) is malformed: selecting it raises this, rather than pass it by;
                `registry.availability` lists it as misconfigured.
        """

    def __init__(self, device_index: int = 0):
        """
        Raises:
            InvalidSpecError: `device_index` is not an integer >= 0.
        """
        self.device_index = integer(device_index, "device_index", 0)

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The torch device whose tensors this backend copies to and from."""

    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A new stream for copies, distinct from the compute stream."""

    def release_stream(self, stream: Stream) -> None:
        """The core is done with `stream` (from `new_stream`): every job on it has finished and
        none will come (called once per lane at shutdown, again where a Ctrl-C cut that short).
        Return only once no work this backend enqueued for it, on it or beside it, can still
        run: the host memory is then freed. Free what this backend keeps per stream (staging).
        Default: nothing."""

    @abc.abstractmethod
    def new_event(self) -> Event:
        """A new event that supports timing (`elapsed_time`)."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The caller's current (compute) stream on this device."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """Zero-filled host memory the device copies to and from asynchronously.

        Returns:
            A 1-D uint8 CPU tensor of `nbytes`, pinned (page-locked) where the backend
            supports it.
        """

    def pin_host_memory(self, tensor: torch.Tensor) -> bool:
        """Page-lock host memory allocated elsewhere (a shared region's mapping, say), so that
        copies reach it directly (``cuMemHostRegister`` on cuda). The caller keeps the memory
        alive and calls `unpin_host_memory` before freeing it.

        Returns:
            True if this call pinned it (undo with `unpin_host_memory`); False, with nothing
            to undo, where this backend pins nothing or the memory was pinned already.
        """
        return False

    def unpin_host_memory(self, tensor: torch.Tensor) -> None:
        """Undo `pin_host_memory`."""

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Say that copies will touch the `span_bytes` from `tensor`'s ``data_ptr()`` (a strided
        view's include bytes between rows that copies never touch), without pinning anything:
        the worker calls it for its KV tensors and host buffer, for backends that copy through
        tensor views rather than addresses (`xpu`). Hold `tensor` weakly: the registry keeps a
        backend for the life of the process."""

    @abc.abstractmethod
    def copy_batch(
        self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream: Stream
    ) -> str | None:
        """Enqueue ``dst[i] <- src[i]`` for ``sizes[i]`` bytes, for every i, on `stream` (one of
        `new_stream`'s, never the compute stream: cuda's batch call refuses the legacy default stream).

        Enqueue only: never wait for the copies. The arrays are int64 addresses and byte
        counts, at least one descriptor, validated by the caller to lie inside registered
        buffers; they stay alive and unchanged until an event recorded after this call
        completes. Copies within one batch may run in any order and must not overlap.

        Returns:
            The name of the mechanism that carries the copies (reported in results and
            stats), or None for a backend with only one.

        Raises:
            Exception: anything that stops the copies from being enqueued; the core reports the
                launch's jobs as failed.
        """

    def synchronize(self) -> None:
        """Block until all work on this device has finished. The core never calls it; for
        benchmarks and tests that need the whole device idle."""

    def prepare_layout(self, layout: CompactLayout) -> Any:
        """Take a worker's layout once, for `copy_blocks` (upload its tables to the device, say).

        Called once per worker, before its first job. Default: nothing to take (None).

        Returns:
            What `copy_blocks` receives with each job of this layout, held by the worker until
            its last job has finished.

        Raises:
            Exception: this backend cannot copy this layout's jobs; the worker is not made.
        """
        return None

    def copy_blocks(self, job: CompactJob, prepared: Any, stream: Stream, after: list[Event]) -> str | None:
        """Enqueue a job (see `offload_core.compact`) on `stream`: copy every entry of every
        block, as `offload_core.testing.expanding.descriptors` expands them, and nothing else.

        Enqueue only, as `copy_batch`; the ids are validated against the layout. `stream` already
        waits for the events `after` (the jobs' compute streams, and other lanes' jobs it must
        follow, also in `job.host_after`): side streams of the backend must wait too. It may run
        on another thread than the submit. The job may be several submitted jobs in one
        (`CompactJob.concat`).

        Default: the job expanded on the host, runs merged (`CompactLayout.copies`), as one
        `copy_batch`; a backend that expands jobs on the device overrides it.

        Returns:
            The mechanism's name, as `copy_batch`.

        Raises:
            Exception: anything that stops the copies from being enqueued.
        """
        src, dst, sizes = job.layout.copies(job)
        if not sizes.size:
            return None
        return self.copy_batch(src, dst, sizes, job.direction, stream)

    def buffer_waits(self) -> tuple[int, float]:
        """Running totals of this backend's enqueues that waited for the device because a buffer
        of its own was full (cuda's descriptor ring), and their seconds (`QueueStats.buffer_waits`).
        Default: never."""
        return 0, 0.0


def span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from ``tensor.data_ptr()`` to the end of its last element: ``nbytes`` for a
    contiguous tensor, more for a strided view."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


_enqueue_locks: weakref.WeakKeyDictionary[Backend, threading.Lock] = weakref.WeakKeyDictionary()
_enqueue_locks_guard = threading.Lock()


def enqueue_lock(backend: Backend) -> threading.Lock:
    """The lock every enqueue on `backend` is made under, across all its workers' lanes (the core
    holds it around `copy_blocks`): a backend that enqueues work of its own takes it
    too, so that its buffers are never shared with a launch."""
    with _enqueue_locks_guard:
        lock = _enqueue_locks.get(backend)
        if lock is None:
            lock = _enqueue_locks[backend] = threading.Lock()
        return lock
