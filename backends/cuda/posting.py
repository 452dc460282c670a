"""Posted enqueues: a thread per backend that makes a compact launch's driver calls, in order,
off the Python thread (`offload_core._native.Poster`).

On the queue's stream and a staging side stream (the streams a backend `adopt`s), every driver
call the backend makes goes through the poster: event records and waits, descriptor-table
uploads, batched copies, and the expansion kernel's launch (`kernels`, where its compiled form
allows a plain ``cuLaunchKernel``). The Python thread pays for a copy into a FIFO; the poster
thread, current in the GPU's context, pays for the calls. Work issued to a stream runs in the
order of the calls, and the FIFO keeps that order, so each stream sees what it would have seen.

What the Python side must keep to:

* a call that cannot be posted (Triton's own launcher, a torch op, another mechanism's copies)
  on an adopted stream first waits until everything posted was issued (`drain`);
* an event whose record was posted is not ready until that record was issued: its `query` says
  False, `synchronize` and `elapsed_time` wait for the ticket first (`events.DriverEvent`);
* an event that a posted wait reads is recorded again directly (on a stream not adopted, such
  as the caller's) only once that wait was issued, or the wait would see the newer position;
* a posted call's failure is logged against the next record on its stream; a launch's end
  event then fails `elapsed_time`, so its jobs fail as a failed enqueue does;
* what a posted call reads (argument arrays, ring regions) is held until an event recorded after
  it has passed, which, with tickets, includes having been issued.

Off unless ``OFFLOAD_CORE_CUDA_CONF=posted:1`` (it needs the compiled extension, and is not built on
Windows): the driver serializes a process's calls, so while the poster thread is inside a long
one (a batch of a few hundred copies) other threads' driver calls wait, most likely the engine's too.
What that costs and buys is in docs/performance.md.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import weakref
from contextlib import contextmanager

from offload_core.backends.cuda import config
from offload_core.backends.cuda.driver import CudaDriverError, Driver
from offload_core.errors import ConfigError

# what each posted call is, for failures (1 marks a record: earlier failures attach to it)
CALL, RECORD, WAIT, MEMCPY, BATCH, LAUNCH, DESTROY = range(7)
NAMES = (
    "a driver call",
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuMemcpyAsync",
    "cuMemcpyBatchAsync",
    "cuLaunchKernel",
    "cuEventDestroy",
)
CAPACITY = 4096  # calls in the FIFO: a few launches' worth; a full FIFO makes the poster wait

_live: weakref.WeakSet = weakref.WeakSet()


def enabled() -> bool:
    """Whether ``posted`` of ``$OFFLOAD_CORE_CUDA_CONF`` asks for posting (unset: no).

    Raises:
        ConfigError: it is set to anything but 0 or 1, or the conf is malformed (`config.conf`).
    """
    setting = config.conf().get("posted") or "0"
    if setting not in ("0", "1"):
        raise ConfigError(
            f"{config.ENV_CONF} posted must be 0 (every driver call on the enqueuing thread) or 1, got {setting!r}"
        )
    return setting == "1"


def make(driver: Driver, context: int) -> Poster | None:
    """A poster for `context`, or None where posting is off, the extension lacks it, or the
    driver lacks an entry point it needs.

    Raises:
        ConfigError: as `enabled`.
    """
    if not enabled() or not driver.has_events:
        return None
    from offload_core import native

    compiled = native.load()
    if compiled is None or not hasattr(compiled, "Poster"):
        return None
    return Poster(compiled, driver, context)


class Poster:
    """The poster of one backend's context (see the module's docstring).

    Args:
        compiled: the compiled extension.
        driver: the backend's driver; its entry points are what gets posted.
        context: the ``CUcontext`` the poster thread makes current.
    """

    def __init__(self, compiled, driver: Driver, context: int):
        address = Driver.address
        self._native = compiled.Poster(
            address(driver.ctx_push_current), address(driver.ctx_pop_current), context, CAPACITY
        )
        self._driver, self.context = driver, context
        self._pid = os.getpid()
        self.streams: set[int] = set()  # handles of the adopted streams
        self.record_fn = address(driver.event_record)
        self.wait_fn = address(driver.stream_wait_event)
        self.memcpy_fn = address(driver.memcpy)
        self.destroy_fn = address(driver.event_destroy)
        self.batch_fn = address(driver.memcpy_batch) if driver.memcpy_batch is not None else None
        self.launch_fn = address(driver.launch_kernel) if driver.launch_kernel is not None else None
        self._fail_index = ctypes.c_size_t(0)  # a posted batch's failIdx: one thread issues them all
        self.fail_address = ctypes.addressof(self._fail_index)
        _live.add(self)
        weakref.finalize(self, self._native.close)

    def adopt(self, stream) -> None:
        """Post every later call on `stream` (a queue's or a staging side stream)."""
        self.streams.add(stream.cuda_stream)

    def owns(self, handle) -> bool:
        """Whether calls on the stream of `handle` are posted (never in a forked child)."""
        return handle in self.streams and os.getpid() == self._pid

    @contextmanager
    def suspended(self, handle):
        """Every call on the stream of `handle` made directly for the block's length, once what
        was posted was made: for enqueues that mix driver calls with torch's or Triton's (the
        batch mechanisms), which must not be split between two threads. Call under the
        backend's enqueue lock (the stream is enqueued on by one thread)."""
        if handle not in self.streams:
            yield
            return
        self.drain()
        self.streams.discard(handle)
        try:
            yield
        finally:
            self.streams.add(handle)

    def call(self, what: int, stream: int, fn: int, *args) -> int:
        """Post ``fn(*args)`` on `stream`'s behalf; returns its ticket."""
        return self._native.call(what, stream, fn, *args)

    def launch(self, function: int, grid: int, threads: int, shared: int, stream: int, params) -> int:
        """Post ``cuLaunchKernel``; returns its ticket."""
        return self._native.launch(LAUNCH, self.launch_fn, function, grid, threads, shared, stream, params)

    @property
    def posted(self) -> int:
        """The ticket of the last call posted."""
        return self._native.posted

    @property
    def issued(self) -> int:
        """The ticket of the last call made."""
        return self._native.issued if os.getpid() == self._pid else 1 << 63

    def wait(self, ticket: int) -> None:
        """Block until the call of `ticket` was made (the GIL released meanwhile)."""
        if ticket and os.getpid() == self._pid:
            self._native.wait(ticket)

    def drain(self) -> None:
        """Block until every call posted so far was made: before a call on an adopted stream
        that cannot be posted."""
        self.wait(self._native.posted)

    def failure(self, lo: int, hi: int) -> CudaDriverError | None:
        """The error of a posted call logged at a ticket in ``[lo, hi]``, or None."""
        if os.getpid() != self._pid:
            return None
        found = self._native.failure(lo, hi)
        if found is None:
            return None
        _, what, code = found
        if code == -1:
            return CudaDriverError(
                "a driver call failed on the posting thread (its record was dropped from the log)", 0
            )
        name = NAMES[what] if 0 <= what < len(NAMES) else NAMES[0]
        return CudaDriverError(f"{name} failed on the posting thread: {self._driver.error_name(code)}", code)

    def state(self) -> dict | None:
        """Counters: calls posted and issued, and how often a post waited for room
        (``room_waits``, back-pressure) or a caller for a call to be issued (``issue_waits``);
        None in a forked child (no thread there, and its lock may have been held at the fork)."""
        return self._native.state() if os.getpid() == self._pid else None

    def close(self) -> None:
        """Make every posted call, then stop the thread; later calls go on the Python thread
        (posting meanwhile raises: the order of a stream's calls cannot be kept)."""
        if os.getpid() == self._pid:
            self._native.close()
        self.streams = set()


@atexit.register
def _close_all() -> None:
    # Before the interpreter goes: a poster thread inside a ctypes callback (a stand-in driver)
    # would otherwise take the GIL of a finalizing interpreter.
    for poster in list(_live):
        poster.close()
