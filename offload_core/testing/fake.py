"""A backend whose events complete only when the test says so.

Copies are applied at once (its "device" memory is host memory); what the test controls
is when the queue *sees* them complete, which makes ordering, waiting, shutdown and
failures deterministic to test.
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

import numpy as np
import torch

from offload_core.backend import Backend, Direction


class FakeStream:
    def __init__(self, backend: FakeBackend, name: str):
        self.backend = backend
        self.name = name

    def wait_event(self, event: FakeEvent) -> None:
        self.backend.log.append(("wait_event", self.name, event))

    def wait_stream(self, stream: FakeStream) -> None:
        self.backend.log.append(("wait_stream", self.name, stream.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, backend: FakeBackend):
        self.backend = backend
        self.stream: FakeStream | None = None
        self.done = True
        self.error: BaseException | None = None
        self.time = 0.0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.done, self.error = stream, False, None
        self.backend.log.append(("record", stream.name, self))

    def query(self) -> bool:
        if self.done and self.error is not None:
            raise RuntimeError(f"fake device fault: {self.error!r}")
        return self.done

    def synchronize(self) -> None:
        """Time passes until this event: it and every event recorded before it (on any stream) complete."""
        self.backend.syncs += 1
        if not self.done:
            for event in self.backend.recorded():
                self.backend.complete(event)
                if event is self:
                    break
        self.query()

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1e3


class FakeBackend(Backend):
    """Controllable backend for ordering tests.

    Attributes:
        log: every stream and event call, in order, as tuples.
        streams: streams in creation order (an OffloadWorker creates the store queue's first).
        fail_enqueue: if set, the next `copy_batch` raises it.
        syncs: how many times the host blocked on an event.
        ``("release_stream", name, unfinished events on it)`` in `log`: the core released a stream.
    """

    name: ClassVar[str] = "fake"

    @classmethod
    def probe(cls) -> str | None:
        return None

    def __init__(self, device_index: int = 0):
        super().__init__(device_index)
        self.log: list[tuple] = []
        self.streams: list[FakeStream] = []
        self.fail_enqueue: BaseException | None = None
        self.syncs = 0
        self._clock = 0.0
        self._compute = FakeStream(self, "compute")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_stream(self) -> FakeStream:
        stream = FakeStream(self, f"s{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def release_stream(self, stream: FakeStream) -> None:
        # what a backend may free now: every job on the stream must have been seen to finish
        pending = [e for e in self.recorded() if e.stream is stream and not e.done]
        self.log.append(("release_stream", stream.name, len(pending)))

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self) -> FakeStream:
        return self._compute

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def copy_batch(
        self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream: FakeStream
    ) -> None:
        if self.fail_enqueue is not None:
            exc, self.fail_enqueue = self.fail_enqueue, None
            raise exc
        self.log.append(("copy", stream.name, direction, int(sizes.sum())))
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    # ---- what tests call -------------------------------------------------

    def recorded(self, stream: FakeStream | None = None) -> list[FakeEvent]:
        """Events in the order they were (last) recorded, optionally on one stream."""
        seen = [e for op, s, e in (x for x in self.log if x[0] == "record") if stream is None or s == stream.name]
        return [e for i, e in enumerate(seen) if e.stream is not None and e not in seen[i + 1 :]]

    def job_ends(self, stream: FakeStream) -> list[FakeEvent]:
        """End events of the jobs queued on `stream` (the queue records start, end per job)."""
        return self.recorded(stream)[1::2]

    def complete(self, event: FakeEvent, error: BaseException | None = None) -> None:
        """Complete one event, optionally as failed (its `query` then raises)."""
        if not event.done:
            self._clock += 1e-3
            event.done, event.error, event.time = True, error, self._clock

    def complete_all(self) -> None:
        for event in self.recorded():
            self.complete(event)
