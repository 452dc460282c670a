"""The reference backend: "device" memory is host memory, and streams really are asynchronous.

A stream is a worker thread running its queue in order; an event marks a position in
a stream. Copies happen on the stream's thread, so a missing ordering edge in the core
shows up as a wrong byte in tests instead of passing by luck.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from offload_core.backend import Backend, Direction


class _Marker:
    """One recording of an event: done once the stream reaches it."""

    __slots__ = ("done", "time", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.time = 0.0
        self.error: BaseException | None = None


class _StreamState:
    """What the stream's thread shares with the stream, kept apart so the stream can be collected."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None  # first failure since the last event


def _run(state: _StreamState) -> None:
    for task in iter(state.tasks.get, None):
        try:
            task()
        except BaseException as exc:  # reported through the next event recorded on the stream
            if state.error is None:
                state.error = exc


class CpuStream:
    """An in-order queue of host work, run by its own thread (in a forked child, a thread of its
    own: the parent's is not there, and what the parent queued is the parent's)."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._state = _StreamState()
        threading.Thread(target=_run, args=(self._state,), daemon=True, name="offload-core-cpu-stream").start()
        weakref.finalize(self, self._state.tasks.put, None)  # stop the thread with the stream

    def launch(self, fn: Callable[[], None]) -> None:
        """Enqueue a host function as if it were a kernel (tests use it to stand in for compute)."""
        self._live().tasks.put(fn)

    def _live(self) -> _StreamState:
        if self._pid != os.getpid():
            self._start()
        return self._state

    def wait_event(self, event: CpuEvent) -> None:
        marker = event._marker
        if marker is not None:  # as on CUDA, waiting on a never-recorded event is a no-op
            self.launch(marker.done.wait)

    def wait_stream(self, stream: CpuStream) -> None:
        event = CpuEvent()
        event.record(stream)
        self.wait_event(event)

    def synchronize(self) -> None:
        event = CpuEvent()
        event.record(self)
        event.synchronize()


class CpuEvent:
    """A position in a `CpuStream`; re-recording moves it, as CUDA events do."""

    def __init__(self) -> None:
        self._marker: _Marker | None = None

    def record(self, stream: CpuStream) -> None:
        marker = self._marker = _Marker()
        state = stream._live()

        def reach() -> None:
            marker.error, state.error = state.error, None
            marker.time = time.perf_counter()
            marker.done.set()

        stream.launch(reach)

    def query(self) -> bool:
        marker = self._marker
        if marker is None:
            return True
        if not marker.done.is_set():
            return False
        self._raise_if_failed(marker)
        return True

    def synchronize(self) -> None:
        marker = self._marker
        if marker is not None:
            if threading.current_thread() is threading.main_thread():
                # Polled: a KeyboardInterrupt landing inside `Event.wait`'s Python frames can leave
                # the event's lock held, and then the stream's `set` blocks for good.
                pause = 20e-6
                while not marker.done.is_set():
                    time.sleep(pause)
                    pause = min(2 * pause, 200e-6)
            else:  # signals reach the main thread only
                marker.done.wait()
            self._raise_if_failed(marker)

    def elapsed_time(self, end: CpuEvent) -> float:
        """Milliseconds from this event to `end`; both must have completed."""
        if self._marker is None or end._marker is None or not (self.query() and end.query()):
            raise RuntimeError("elapsed_time needs two completed events")
        return (end._marker.time - self._marker.time) * 1e3

    @staticmethod
    def _raise_if_failed(marker: _Marker) -> None:
        if marker.error is not None:
            raise RuntimeError(f"work on the cpu stream failed: {marker.error!r}") from marker.error


def memmove_all(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    """Copy ``sizes[i]`` bytes from address ``src[i]`` to address ``dst[i]`` for every i, now, on
    the calling thread. The memory must be valid, and no destination may overlap another copy's."""
    move = ctypes.memmove  # a foreign call: releases the GIL while it copies
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        move(d, s, n)


class CpuBackend(Backend):
    """Host-memory reference backend; always available, lowest priority."""

    name = "cpu"
    priority = 0

    @classmethod
    def probe(cls) -> str | None:
        return None

    def __init__(self, device_index: int = 0):
        super().__init__(device_index)
        self._compute = CpuStream()
        self._streams: weakref.WeakSet[CpuStream] = weakref.WeakSet([self._compute])

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_stream(self) -> CpuStream:
        stream = CpuStream()
        self._streams.add(stream)
        return stream

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def current_stream(self) -> CpuStream:
        """The stand-in compute stream: idle unless a test launches work on it."""
        return self._compute

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def copy_batch(
        self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream: CpuStream
    ) -> str:
        stream.launch(lambda: memmove_all(src, dst, sizes))
        return "memmove"

    def synchronize(self) -> None:
        for stream in list(self._streams):
            stream.synchronize()
