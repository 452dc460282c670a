"""The cpu backend with the compact path, for testing the core's second path without a GPU.

It expands each compact job exactly as the cuda kernel is specified to (`CompactLayout.descriptors`),
on its streams, through a staging buffer that mirrors host rows (the device path's shape:
expand into staging, then one copy per segment) or straight into the host rows. Staging is
filled with a poison byte first, so a segment that covers a byte no entry wrote shows up
as a wrong byte on the host.
"""

from __future__ import annotations

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cpu import CpuBackend, CpuStream
from offload_core.compact import CompactJob, CompactLayout

POISON = 0xA5


class ExpandingCpuBackend(CpuBackend):
    """`CpuBackend` that takes compact jobs.

    Args:
        staged: expand through a staging buffer and copy segments (True), or expand straight
            into the host rows (False).
        refuse: `prepare_layout` returns None, as a backend that cannot expand a layout does.
    """

    expands_blocks = True

    def __init__(self, device_index: int = 0, *, staged: bool = True, refuse: bool = False):
        super().__init__(device_index)
        self.staged = staged
        self.refuse = refuse
        self.jobs = 0  # compact jobs enqueued

    def prepare_layout(self, layout: CompactLayout):
        return None if self.refuse else layout

    def copy_blocks(self, job: CompactJob, prepared, stream: CpuStream, after) -> str:
        layout = job.layout
        assert prepared is layout, "copy_blocks got another layout's tables"
        self.jobs += 1
        store = job.direction is Direction.STORE
        if not self.staged:
            dev, host, sizes = layout.descriptors(job)
            src, dst = (dev, host) if store else (host, dev)
            self.copy_batch(src, dst, sizes, job.direction, stream)
            return "expand_direct"
        staging = np.full(max(1, job.host_ids.size * layout.row_bytes), POISON, dtype=np.uint8)
        base = staging.ctypes.data
        dev, side, sizes = layout.descriptors(job, base)
        seg_stage, seg_host, seg_sizes = layout.segments(job)
        seg_stage, seg_host = seg_stage + base, seg_host + layout.host_base
        if store:
            self.copy_batch(dev, side, sizes, job.direction, stream)
            self.copy_batch(seg_stage, seg_host, seg_sizes, job.direction, stream)
        else:
            self.copy_batch(seg_host, seg_stage, seg_sizes, job.direction, stream)
            self.copy_batch(side, dev, sizes, job.direction, stream)
        stream.launch(lambda: staging.size)  # holds the staging buffer until the stream is past it
        return "expand_staged"
