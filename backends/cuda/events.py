"""Events and the caller's stream through the CUDA driver, for the queue's hot path: torch's
wrappers cost several microseconds per call, a call into the driver under one. `DriverEvent` and
`RawStream` satisfy the core's `Event` and `Stream` protocols and mix with torch's streams (a
torch stream's ``wait_event`` calls the event's ``wait``; recording reads any stream's
``cuda_stream``). Every call runs in the backend's GPU context, whatever the thread's
(`Driver.in_context`).
"""

from __future__ import annotations

import ctypes
import os
import weakref

from offload_core.backends.cuda.driver import ERROR_NOT_READY, Driver

EVENT_DISABLE_TIMING = 0x2


class DriverEvent:
    """A ``CUevent`` of one GPU context, destroyed when the object is collected.

    Args:
        driver: the loaded driver.
        context: the ``CUcontext`` of the GPU whose streams this event marks.
        timing: whether `elapsed_time` may be asked of it (such events cost more to record).

    Raises:
        CudaDriverError: the driver could not create the event.
    """

    __slots__ = ("handle", "_driver", "_ctx", "__weakref__")

    def __init__(self, driver: Driver, context: int, timing: bool = True):
        self._driver, self._ctx = driver, context
        out = ctypes.c_void_p()
        self._call(driver.event_create, "cuEventCreate", ctypes.byref(out), 0 if timing else EVENT_DISABLE_TIMING)
        self.handle = out.value
        done = weakref.finalize(self, _destroy, driver, context, self.handle, os.getpid())
        done.atexit = False  # at exit the driver may be gone; the process frees its events anyway

    def record(self, stream) -> None:
        """Mark `stream`'s current position (any stream of this GPU with a ``cuda_stream`` handle)."""
        code = self._driver.record_in(self._ctx, self.handle, stream.cuda_stream)  # once or twice a job: inline
        if code:
            self._driver.fail(code, "cuEventRecord")

    def wait(self, stream) -> None:
        """Later work on `stream` waits for this event (what ``stream.wait_event`` calls)."""
        self._driver.check(self._driver.wait_in(self._ctx, stream.cuda_stream, self.handle, 0), "cuStreamWaitEvent")

    def query(self) -> bool:
        """Whether the marked work has completed.

        Raises:
            CudaDriverError: the work failed (a device fault).
        """
        code = self._driver.query_in(self._ctx, self.handle)
        if code == 0:
            return True
        if code == ERROR_NOT_READY:
            return False
        self._driver.fail(code, "cuEventQuery")

    def synchronize(self) -> None:
        """Block until the marked work has completed (the GIL is released meanwhile).

        Raises:
            CudaDriverError: the work failed.
        """
        self._call(self._driver.event_synchronize, "cuEventSynchronize", self.handle)

    def elapsed_time(self, end: DriverEvent) -> float:
        """Milliseconds from this event to `end`, both passed.

        Raises:
            CudaDriverError: either has not been recorded, or has not passed.
        """
        ms, driver = ctypes.c_float(), self._driver
        driver.check(driver.elapsed_in(self._ctx, ctypes.addressof(ms), self.handle, end.handle), "cuEventElapsedTime")
        return ms.value

    def _call(self, fn, what: str, *args) -> None:
        self._driver.check(self._driver.in_context(self._ctx, fn, *args), what)


def _destroy(driver: Driver, context: int, handle: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child must not touch its parent's driver state
        driver.in_context(context, driver.event_destroy, handle)


class RawStream:
    """A stream known by its handle (`CudaBackend.current_stream`); equal streams have equal
    handles. Its ``wait_event`` takes `DriverEvent`, not torch's events."""

    __slots__ = ("cuda_stream", "_new_event")

    def __init__(self, handle: int, new_event):
        self.cuda_stream, self._new_event = handle, new_event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RawStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return hash(self.cuda_stream)

    def wait_event(self, event) -> None:
        event.wait(self)

    def wait_stream(self, stream) -> None:
        event = self._new_event()
        event.record(stream)
        event.wait(self)

    def record_event(self, event=None):
        """`event` (default: a new one) recorded here; what a torch stream's ``wait_stream`` asks for."""
        event = event if event is not None else self._new_event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"RawStream({self.cuda_stream:#x})"
