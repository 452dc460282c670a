"""Staging: device memory that copies pass through between scattered device pages and
host-contiguous runs, one set per copy stream, made on the stream's first use.

* `StagedPair`, for the descriptor mechanism ``staged``: a companion kernel stream and two
  buffers; `pieces` cuts a job into pieces that fit one;
* `StagingHalves`, for compact jobs (``expand_staged``, `blocks`): a side stream, one buffer
  in two halves, and the events that hand a half from one step to the next.

A set lives until its stream is released (`CudaBackend.release_stream`, when its queue closes,
once drained) or the backend goes: a queue's stream is used job after job, and a job still in
flight may read its buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from offload_core.backends.cuda import select


class Held(list):
    """What one enqueue's work may read until it has run (`CudaBackend._enqueued` keeps it until
    an event recorded after the enqueue has passed), and `sides`: streams beside the queue's
    stream that the work went to and that are not joined back yet. A mechanism lists a side
    stream before its first work there and takes it off once the queue's stream waits for it;
    `_enqueued` joins whatever is still listed (a failure or a Ctrl-C cut the join short)."""

    __slots__ = ("sides",)

    def __init__(self):
        super().__init__()
        self.sides: list = []


class PerStream:
    """What each copy stream needs, made by `make(stream)` on the stream's first use.

    Keyed by the stream's handle; the entry holds the stream, so the handle stays its own.
    Not thread-safe: a stream is enqueued on by one queue at a time.
    """

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


class StagedPair:
    """``staged``'s staging for one copy stream: its companion kernel stream, and two buffers
    that pieces alternate between, so that one piece's gather or scatter overlaps the copies
    of the next.

    Each buffer holds ``staging_bytes * 5 // 4``: a piece (`pieces`) holds at most
    `staging_bytes` and one more fragment, and fragments above a quarter of `staging_bytes`
    bypass staging.
    """

    def __init__(self, backend, stream):
        torch = backend._torch
        self.stream = stream  # held so that its handle, the key, stays ours
        self.kernel_stream = backend.new_stream()
        with torch.cuda.stream(self.kernel_stream):  # their memory is ordered on the stream that writes it
            self.buffers = [
                torch.empty(backend.staging_bytes * 5 // 4, dtype=torch.uint8, device=backend.device) for _ in range(2)
            ]
        self.bases = [b.data_ptr() for b in self.buffers]


class StagingHalves:
    """Compact jobs' staging for one queue stream: its side stream, two halves of one buffer
    and their hand-over events, made by `new_event` (the backend's untimed markers: four of
    their calls a piece, each a fraction of what torch's event wrappers cost)."""

    def __init__(self, torch, device, stream, side, half_bytes: int, new_event: Callable):
        self.stream, self.side = stream, side  # the stream is held so its handle stays ours
        with torch.cuda.stream(side):
            self.buffer = torch.empty(2 * half_bytes, dtype=torch.uint8, device=device)
        self.halves = (self.buffer.data_ptr(), self.buffer.data_ptr() + half_bytes)
        self.free = [new_event(), new_event()]  # a half may be overwritten once passed
        self.ready = new_event()  # the side stream's step is done
        self.next = 0  # the half the next piece uses
        # expand_split's direct part: its stream, and the events that start and join it (`BlockCopier.direct_side`)
        self.direct = self.direct_go = self.direct_done = None


def pieces(edges: np.ndarray | None, size: int, n: int, store: bool, staging_bytes: int) -> list[int]:
    """``staged``'s pieces (`select.piece_bounds`: one if the job fits a buffer), as the index
    of each one's first fragment.

    Args:
        edges: the fragments' offsets followed by their total, or None where all `n`
            fragments are `size` bytes.
        size: the largest fragment.
        n: how many fragments.
        store: whether the job is a store (pieces count from its start) or a load (from its end).
        staging_bytes: the backend's `staging_bytes`.
    """
    bounds = select.piece_bounds(n * size if edges is None else int(edges[-1]), staging_bytes, store)
    # A piece starts at the fragment where its bound falls, rounded away from the exposed
    # end: a store's first piece and a load's last one get their bytes, at most one
    # fragment more, never all the job's.
    if store:
        cuts = [-(-x // size) for x in bounds] if edges is None else np.searchsorted(edges, bounds).tolist()
    else:
        cuts = [x // size for x in bounds] if edges is None else (np.searchsorted(edges, bounds, "right") - 1).tolist()
    firsts = [0]
    for cut in cuts:
        if firsts[-1] < cut < n:
            firsts.append(cut)
    return firsts
