"""The reference model of a transfer: bytes moved one page at a time, with plain indexing.

Slow and obviously right; planner and backend tests compare against it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from offload_core.backend import Direction


def reference_transfer(
    direction: Direction,
    device_pages: Sequence[np.ndarray],
    host_rows: np.ndarray,
    host_offsets: Sequence[int],
    group_refs: Sequence[Sequence[tuple[int, int]]],
    blocks_per_chunk: int,
    device_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    host_ids: Sequence[int],
) -> None:
    """Apply one transfer in place.

    Args:
        direction: STORE copies device pages into host rows, LOAD the reverse.
        device_pages: per tensor, a ``(num_blocks, page)`` uint8 array.
        host_rows: ``(num_host_blocks, row_bytes)`` uint8 array.
        host_offsets: per tensor, offset of its chunk in a host row.
        group_refs: per group, ``(tensor_idx, copy_bytes)`` per ref.
        blocks_per_chunk, device_ids, group_sizes, block_indices, host_ids: the transfer.
    """
    d = h = 0
    for refs, size, index in zip(group_refs, group_sizes, block_indices):
        skip = index % blocks_per_chunk
        for k in range(size):
            q = skip + k
            host_id = host_ids[h + q // blocks_per_chunk]
            sub = q % blocks_per_chunk
            for t, nbytes in refs:
                page = device_pages[t].shape[1]
                start = host_offsets[t] + sub * page
                host_view = host_rows[host_id, start : start + nbytes]
                dev_view = device_pages[t][device_ids[d + k], :nbytes]
                if direction is Direction.STORE:
                    host_view[:] = dev_view
                else:
                    dev_view[:] = host_view
        d += size
        if size:
            h += -(-(size + skip) // blocks_per_chunk)
