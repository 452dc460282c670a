"""The cpu backend expanding jobs as a device backend does, for testing that without a GPU.

It expands each compact job exactly as the cuda kernel is specified to (`descriptors`),
on its streams, through a staging buffer that mirrors host rows (the device path's shape:
expand into staging, then one copy per segment) or straight into the host rows. Staging is
filled with a poison byte first, so a segment that covers a byte no entry wrote shows up
as a wrong byte on the host.
"""

from __future__ import annotations

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cpu import CpuBackend, CpuStream
from offload_core.canonical import elected
from offload_core.compact import CompactJob, CompactLayout

POISON = 0xA5


class ExpandingCpuBackend(CpuBackend):
    """`CpuBackend` that takes compact jobs.

    Args:
        staged: expand through a staging buffer and copy segments (True), or expand straight
            into the host rows (False).
        refuse: `prepare_layout` returns None, and its jobs go the default way (expanded on the
            host, `Backend.copy_blocks`), as the cuda backend's do where it cannot expand them.
    """

    def __init__(self, device_index: int = 0, *, staged: bool = True, refuse: bool = False):
        super().__init__(device_index)
        self.staged = staged
        self.refuse = refuse
        self.jobs = 0  # compact jobs enqueued
        self._kept: dict[int, np.ndarray | None] = {}  # staging buffers queued copies may still touch

    def prepare_layout(self, layout: CompactLayout):
        return None if self.refuse else layout

    def copy_blocks(self, job: CompactJob, prepared, stream: CpuStream, after) -> str:
        if prepared is None:
            return super().copy_blocks(job, prepared, stream, after)
        assert prepared is job.layout, "copy_blocks got another layout's tables"
        self.jobs += 1
        # no waits for `after`: `stream` already waits for them, and every copy here goes on it
        staging = (
            np.full(max(1, job.host_ids.size * job.layout.row_bytes), POISON, dtype=np.uint8) if self.staged else None
        )
        # Kept before the first copy is enqueued, dropped by the stream once past the last: a
        # Ctrl-C in between leaves it kept (a leak), never freed under a queued copy.
        key = id(staging)
        self._kept[key] = staging
        for src, dst, sizes in steps(job, None if staging is None else staging.ctypes.data):
            self.copy_batch(src, dst, sizes, job.direction, stream)
        stream.launch(lambda: self._kept.pop(key, None))
        return "expand_staged" if self.staged else "expand_direct"


def steps(job: CompactJob, staging: int | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The copy batches, in order, that move `job` as a device backend does: expanded straight
    into the host rows (`staging` None), or expanded into a staging buffer at address `staging`
    that mirrors the job's host rows, and moved between it and the host by segments."""
    batches = [descriptors(job, staging)]  # device to host side, on store; the reverse on load
    if staging is not None:
        stage, host, sizes = job.layout.segments(job)
        batches.append((stage + staging, host + job.layout.host_base, sizes))
    if job.direction is Direction.STORE:
        return batches
    return [(dst, src, sizes) for src, dst, sizes in reversed(batches)]


def descriptors(job: CompactJob, row_base: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expand `job` into copies on the host, one per entry of each block: the reference a
    device expansion must match (and `CompactLayout.copies`, which merges runs).

    Args:
        job: from `CompactLayout.job`.
        row_base: where host rows lie: None for the host buffer (chunk ``j`` at
            ``host_base + host_ids[j] * row_bytes``), or the address of a staging buffer
            that mirrors the job's host rows (chunk ``j`` at ``row_base + j * row_bytes``).

    Returns:
        ``(device, host, sizes)`` addresses and byte counts, block by block, entry by entry;
        on store, only the entries the block is elected to write.
    """
    layout = job.layout
    dev, side, size = [], [], []
    for g, b0, b1, *_ in job.groups:
        e0, count = layout.group_entries[:, g].tolist()
        e = layout.entries[:, e0 : e0 + count]
        b = job.blocks[:, b0:b1]
        if row_base is None:
            rows = layout.host_base + job.host_ids[b[1]] * layout.row_bytes
        else:
            rows = row_base + b[1] * layout.row_bytes
        d = b[0][:, None] * e[1] + (e[0] + e[2])
        h = (rows[:, None] + b[2][:, None] * e[4]) + e[3]
        s = np.broadcast_to(e[5], d.shape)
        if job.direction is Direction.STORE:
            mine = elected(b[3][:, None], e[6], e[7])
            d, h, s = d[mine], h[mine], s[mine]
        dev.append(d.ravel())
        side.append(h.ravel())
        size.append(s.ravel())
    if not dev:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    return np.concatenate(dev), np.concatenate(side), np.concatenate(size)
