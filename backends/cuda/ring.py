"""Descriptor tables for the copy kernels: pinned host memory and device memory, reused job after
job, so that an upload costs one numpy copy and one ``cuMemcpyAsync``. (Tables allocated per job
would cost a ``cudaHostAlloc`` each time the stream is busy: torch's pinned allocator cannot
reuse a buffer while the copy that reads it is pending.)
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np


class DescriptorRing:
    """A ring of int64 entries in pinned host memory, mirrored by device memory.

    Regions are reserved during a job's enqueue and retired with an event recorded after the
    last work that reads them (`retire`); a region is reused only after its event has passed, and
    a reservation that finds no room waits for the oldest ones' (`waits`, `wait_s`: the device is
    behind the host). A table larger than the ring, or one that would have to wait for the
    enqueue under way, takes one-off memory. Not thread-safe: uploads run under the backend's
    enqueue lock.

    Args:
        torch: the torch module.
        device: the torch device of the mirror.
        memcpy: ``(dst, src, nbytes, stream_handle) -> None``, an asynchronous host-to-device copy.
        entries: capacity; the memory is allocated on first use.
        launch: ``(host, device, room, columns, narrow, stream_handle, function, grid, threads,
            shared, params) -> None``, the table's upload and a kernel's launch in one call
            (`upload_launch`), or None.
    """

    def __init__(self, torch, device, memcpy, entries: int = 1 << 21, launch=None):
        self._torch, self._device, self._memcpy = torch, device, memcpy
        self._launch = launch
        self.entries = entries
        self._host = self._dev = None
        self._allocating = threading.Lock()
        self._head = 0
        self._regions: deque = deque()  # [start, end, event or None while its job is enqueued]
        self._opened: list | None = None  # the regions of the enqueue under way (`open`)
        self.waits, self.wait_s = 0, 0.0  # reservations that waited for a table's job, and how long

    def upload(self, columns, stream, held: list, narrow: bool = False) -> list:
        """Copy int64 `columns` (equal lengths n) to the device on `stream`; as int32 where
        `narrow` (the caller knows every value fits). What must outlive the copies goes to
        `held` before the upload is enqueued.

        Returns:
            A list of one item: the device address of the first column (column j is at
            ``table + width * j * n``, width 4 where `narrow`, else 8).
        """
        n, k = len(columns[0]), len(columns)
        width = 4 if narrow else 8
        flat, host_ptr, dev_ptr, keep = self._region(-(-k * n * width // 8))
        held.append(keep)
        if narrow:
            flat = flat.view(np.int32)
        for row, column in zip(flat[: k * n].reshape(k, n), columns):
            row[:] = column
        self._memcpy(dev_ptr, host_ptr, width * k * n, stream.cuda_stream)
        return [dev_ptr]

    @property
    def launches(self) -> bool:
        """Whether `upload_launch` can be called."""
        return self._launch is not None

    def upload_launch(
        self, columns, stream, narrow: bool, function: int, grid: int, threads: int, shared: int, params, held: list
    ) -> None:
        """`upload` of `columns`, and the launch on `stream` of the kernel `function` whose
        parameters are the table's device address followed by `params` (64-bit values), in one
        call. What must outlive the copies goes to `held` first: the launch may fail with the
        upload enqueued.

        Raises:
            CudaDriverError: the upload or the launch failed (nothing is launched after a failed upload).
        """
        entries = -(-len(columns) * len(columns[0]) * (4 if narrow else 8) // 8)
        _, host_ptr, dev_ptr, keep = self._region(entries)
        held.append(keep)
        launch_args = (stream.cuda_stream, function, grid, threads, shared, (dev_ptr, *params))
        self._launch(host_ptr, dev_ptr, 8 * entries, columns, narrow, *launch_args)

    def _region(self, entries: int) -> tuple:
        """``(flat, host, device, keep)`` for `entries` int64 entries: a numpy view of the host
        memory from their start, its address and its mirror's, and what must outlive the copies."""
        start = self._reserve(entries)
        if start is None:  # larger than the ring, or its room is the enqueue's own: one-off memory
            host = self._torch.empty(entries, dtype=self._torch.int64, pin_memory=True)
            dev = self._torch.empty(entries, dtype=self._torch.int64, device=self._device)
            return host.numpy(), host.data_ptr(), dev.data_ptr(), [host, dev]
        return self._flat[start:], self._host_ptr + 8 * start, self._dev_ptr + 8 * start, []

    def device_address(self) -> int:
        """Where the ring's tables lie on the device (allocated now if they were not)."""
        self._allocate()
        return self._dev_ptr

    def open(self) -> list:
        """Start an enqueue: the regions reserved from now on are listed in the list returned,
        for `retire` (whose event then covers them and no other enqueue's)."""
        self._opened = []
        return self._opened

    def retire(self, event, regions: list) -> None:
        """`regions` (a list `open` returned) are free once `event` has passed."""
        # `_opened` stays: a late retire (from another thread, or at collection) must not
        # unlist the enqueue under way
        for region in regions:
            region[2] = event

    def _allocate(self) -> None:
        if self._host is not None:
            return
        with self._allocating:  # a worker's `prepare` may ask while another thread's launch uploads
            if self._host is None:
                torch = self._torch
                dev = torch.empty(self.entries, dtype=torch.int64, device=self._device)
                host = torch.empty(self.entries, dtype=torch.int64, pin_memory=True)
                self._flat: np.ndarray = host.numpy()
                self._host_ptr, self._dev, self._dev_ptr = host.data_ptr(), dev, dev.data_ptr()
                self._host = host  # last: another thread that finds it set finds the rest set too

    def _reserve(self, count: int) -> int | None:
        """The first of `count` free entries, reserved for the enqueue under way, where the ring
        is full after waiting for the oldest tables' jobs; None where the table is larger than
        the ring, or the room would have to come from the enqueue under way itself."""
        if count > self.entries:
            return None
        self._allocate()
        regions = self._regions
        while True:
            while regions and regions[0][2] is not None and regions[0][2].query():
                regions.popleft()
            start = self._room(count)
            if start is not None or not regions or regions[0][2] is None:
                break
            t0 = time.perf_counter()
            regions[0][2].synchronize()
            regions.popleft()
            self.waits += 1
            self.wait_s += time.perf_counter() - t0
        if start is not None:
            region = [start, start + count, None]
            regions.append(region)
            if self._opened is not None:
                self._opened.append(region)
            self._head = start + count
        return start

    def _room(self, count: int) -> int | None:
        """Where `count` entries fit between the regions in use, or None."""
        if not self._regions:
            self._head = 0
            return 0
        tail, head = self._regions[0][0], self._head
        if head > tail:  # in use: [tail, head); free: [head, entries) and [0, tail)
            return head if head + count <= self.entries else (0 if count <= tail else None)
        return head if head + count <= tail else None  # in use: [tail, entries) and [0, head)
