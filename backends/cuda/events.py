"""Events and the caller's stream through the CUDA driver, for the queue's hot path.

Every submit records an event on the caller's compute stream, and every launch waits for such
events and records two of its own. torch's wrappers cost several microseconds per call (a
Python stream object built for each `current_stream`, device guards around each record); a
ctypes call into the driver costs under one. `DriverEvent` and `RawStream` satisfy the core's
`Event` and `Stream` protocols and mix with torch's streams: a torch stream's ``wait_event``
calls the event's ``wait``, and recording reads any stream's ``cuda_stream`` handle.

Every call runs in the backend's GPU context: a thread may have none current (it made no CUDA
call yet), or another GPU's, and handle 0 (the default stream) means the current context's.
Where the current context is another, the call pushes the backend's and pops it after
(`Driver.in_context`), leaving the thread as it was.
"""

from __future__ import annotations

import ctypes
import os
import weakref

from offload_core.backends.cuda.driver import ERROR_NOT_READY, CudaDriverError, Driver

EVENT_DISABLE_TIMING = 0x2


class DriverEvent:
    """A ``CUevent`` of one GPU context, destroyed when the object is collected.

    Args:
        driver: the loaded driver (`Driver.has_events` must be True).
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
        self._driver.call_in(self._driver.wait_in, "cuStreamWaitEvent", self._ctx, stream.cuda_stream, self.handle, 0)

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
        out = ctypes.addressof(ms)
        driver.call_in(driver.elapsed_in, "cuEventElapsedTime", self._ctx, out, self.handle, end.handle)
        return ms.value

    def _call(self, fn, what: str, *args) -> None:
        code = self._driver.in_context(self._ctx, fn, *args)
        if code != 0:
            raise CudaDriverError(f"{what} failed: {self._driver.error_name(code)}", code)


def _destroy(driver: Driver, context: int, handle: int, pid: int) -> None:
    if os.getpid() != pid:  # a forked child must not touch its parent's driver state
        return
    driver.in_context(context, driver.event_destroy, handle)


class RawStream:
    """A stream known by its handle: the caller's compute stream, as `CudaBackend.current_stream`
    returns it. Equal streams have equal handles (the queue keys compute streams by them).

    Its ``wait_event`` takes events that wait by handle (`DriverEvent`, what the backend's
    `new_event` makes), not torch's.
    """

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
