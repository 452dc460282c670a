"""Staging (``expand_staged``, `blocks`): device memory that copies pass through between
scattered device pages and host-contiguous runs, one set per copy stream, made on its first use
and kept until the stream is released (`CudaBackend.release_stream`); and `Held`, what an
enqueue's work may still read.
"""

from __future__ import annotations

from collections.abc import Callable


class Held(list):
    """What one enqueue's work may read until it has run (`CudaBackend._enqueued`), and `sides`:
    streams beside the queue's stream that the work went to, listed before the first work there
    until the queue's stream waits for them; `_enqueued` joins what a failure left listed."""

    __slots__ = ("sides",)

    def __init__(self):
        super().__init__()
        self.sides: list = []


class PerStream:
    """What each copy stream needs, made by `make(stream)` on its first use and keyed by its
    handle (the entry holds the stream, so the handle stays its own). Not thread-safe: a stream
    is enqueued on by one queue at a time."""

    def __init__(self, make: Callable):
        self._make = make
        self._by_handle: dict[int, object] = {}

    def for_stream(self, stream):
        """The entry of `stream`, made now if it has none."""
        entry = self._by_handle.get(stream.cuda_stream)
        if entry is None:
            entry = self._by_handle[stream.cuda_stream] = self._make(stream)
        return entry

    def values(self):
        return list(self._by_handle.copy().values())  # a snapshot: streams come and go on other threads

    def discard(self, stream) -> None:
        """Forget `stream`'s entry (its memory goes back to torch's allocator)."""
        self._by_handle.pop(stream.cuda_stream, None)


class StagingHalves:
    """Compact jobs' staging for one queue stream: its side stream, two halves of one buffer
    and their hand-over events, made by `new_event` (the backend's untimed markers)."""

    def __init__(self, torch, device, stream, side, half_bytes: int, new_event: Callable):
        self.stream, self.side = stream, side  # the stream is held so its handle stays ours
        with torch.cuda.stream(side):
            self.buffer = torch.empty(2 * half_bytes, dtype=torch.uint8, device=device)
        self.halves = (self.buffer.data_ptr(), self.buffer.data_ptr() + half_bytes)
        self.free = [new_event(), new_event()]  # a half may be overwritten once passed
        self.ready = new_event()  # the side stream's step is done
        self.next = 0  # the half the next piece uses
