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

On a stream the backend's poster adopted (`posting`), a record or a wait is posted: the event
then carries the record's ticket, and asks the poster before anything that depends on it.
"""

from __future__ import annotations

import ctypes
import os
import weakref

from offload_core.backends.cuda.driver import ERROR_NOT_READY, CudaDriverError, Driver
from offload_core.backends.cuda.posting import DESTROY, RECORD, WAIT

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

    __slots__ = ("handle", "_driver", "_ctx", "_ticket", "_touch", "_from", "_flags", "_owned", "__weakref__")

    def __init__(self, driver: Driver, context: int, timing: bool = True):
        self._driver, self._ctx = driver, context
        self._ticket = 0  # the posted record that marks this event's position, until issued
        self._touch = 0  # the last posted call that records or reads it
        self._from = 0  # the first ticket of a call enqueued after its last record
        self._flags = 0 if timing else EVENT_DISABLE_TIMING
        self.handle = self._create()
        self._owned = [self.handle]  # what the finalizer destroys: the handle may be replaced
        done = weakref.finalize(self, _destroy, driver, context, self._owned, os.getpid())
        done.atexit = False  # at exit the driver may be gone; the process frees its events anyway

    def _create(self) -> int:
        out = ctypes.c_void_p()
        self._call(self._driver.event_create, "cuEventCreate", ctypes.byref(out), self._flags)
        return out.value

    def record(self, stream) -> None:
        """Mark `stream`'s current position (any stream of this GPU with a ``cuda_stream`` handle)."""
        handle, poster = stream.cuda_stream, self._driver.poster
        if poster is not None:
            if poster.owns(handle):
                self._ticket = self._touch = self._from = poster.call(
                    RECORD, handle, poster.record_fn, self.handle, handle
                )
                return
            if self._touch and poster.issued < self._touch:
                # A posted wait still has to read the position this record would replace: this
                # object takes a new handle rather than wait (the caller may be a submit), and
                # the old one is destroyed once the poster has made that wait.
                old, self.handle = self.handle, self._create()
                self._owned[0] = self.handle
                _destroy(self._driver, self._ctx, [old], os.getpid())
            self._ticket = self._touch = 0
            self._from = poster.posted + 1
        code = self._driver.record_in(self._ctx, self.handle, handle)  # once or twice a job: inline
        if code:
            self._driver.fail(code, "cuEventRecord")

    def wait(self, stream) -> None:
        """Later work on `stream` waits for this event (what ``stream.wait_event`` calls)."""
        handle, poster = stream.cuda_stream, self._driver.poster
        if poster is not None:
            if poster.owns(handle):
                self._touch = poster.call(WAIT, handle, poster.wait_fn, handle, self.handle, 0)
                return
            poster.wait(self._ticket)  # the wait must see the posted record
        self._driver.call_in(self._driver.wait_in, "cuStreamWaitEvent", self._ctx, handle, self.handle, 0)

    def query(self) -> bool:
        """Whether the marked work has completed (False while its posted record waits to be made).

        Raises:
            CudaDriverError: the work failed (a device fault).
        """
        if self._ticket and self._driver.poster is not None and self._driver.poster.issued < self._ticket:
            return False
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
        if self._ticket and self._driver.poster is not None:
            self._driver.poster.wait(self._ticket)
        self._call(self._driver.event_synchronize, "cuEventSynchronize", self.handle)

    def elapsed_time(self, end: DriverEvent) -> float:
        """Milliseconds from this event to `end`, both passed.

        Raises:
            CudaDriverError: either has not been recorded, or has not passed; or a call posted
                between the two records failed (a launch's calls lie between its two events).
        """
        ms, driver = ctypes.c_float(), self._driver
        poster = driver.poster
        if poster is not None and end._ticket:
            poster.wait(end._ticket)
            failed = poster.failure(max(1, self._from), end._ticket)
            if failed is not None:
                raise failed
        out = ctypes.addressof(ms)
        driver.call_in(driver.elapsed_in, "cuEventElapsedTime", self._ctx, out, self.handle, end.handle)
        return ms.value

    def _call(self, fn, what: str, *args) -> None:
        code = self._driver.in_context(self._ctx, fn, *args)
        if code != 0:
            raise CudaDriverError(f"{what} failed: {self._driver.error_name(code)}", code)


def _destroy(driver: Driver, context: int, owned: list, pid: int) -> None:
    if os.getpid() != pid:  # a forked child must not touch its parent's driver state
        return
    (handle,) = owned
    poster = driver.poster
    if poster is not None and poster.streams and poster.context == context:  # after the posted calls naming it
        try:
            poster.call(DESTROY, 0, poster.destroy_fn, handle)
            return
        except RuntimeError:  # closing: once what was posted is made, directly
            poster.drain()
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
