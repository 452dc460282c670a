"""The reference model of a transfer: bytes moved one page at a time, with plain indexing.

Slow and obviously right; layout and backend tests compare against it. Independent of the
code under test on purpose: it merges nothing, and elects writers itself (``p % num_writers ==
writer_index``, written out below), so that a mistake in `offload_core.runs` or
`offload_core.canonical.elected` cannot hide in the model as well.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    host_pages: Sequence[int] | None = None,
) -> None:
    """Apply one transfer in place.

    Args:
        direction: STORE copies device pages into host rows, LOAD the reverse.
        device_pages: per tensor, a ``(num_blocks, page)`` uint8 array.
        host_rows: ``(num_host_blocks, row_bytes)`` uint8 array.
        host_offsets: per tensor, offset of its chunk in a host row.
        group_refs: per group, ``(tensor_idx, copy_bytes)`` or ``(tensor_idx, copy_bytes, mapping)``
            per ref; a mapping's runs place the page in the host page, and on store only the
            elected writer of a page copies it.
        blocks_per_chunk, device_ids, group_sizes, block_indices, host_ids: the transfer.
        host_pages: per tensor, the host sub-page size; default the device page size.
    """
    d = h = 0
    for refs, size, index in zip(group_refs, group_sizes, block_indices):
        skip = index % blocks_per_chunk
        for k in range(size):
            q = skip + k
            host_id = host_ids[h + q // blocks_per_chunk]
            sub = q % blocks_per_chunk
            for t, nbytes, *mapping in refs:
                page = host_pages[t] if host_pages is not None else device_pages[t].shape[1]
                start = host_offsets[t] + sub * page
                dev_page = device_pages[t][device_ids[d + k]]
                pieces = [(0, 0, nbytes)]
                if mapping:
                    m = mapping[0]
                    if (
                        direction is Direction.STORE
                        and (host_id * blocks_per_chunk + sub) % m.num_writers != m.writer_index
                    ):
                        continue
                    pieces = [
                        (
                            r.local_offset + i * r.local_stride,
                            r.canonical_offset + i * r.canonical_stride,
                            r.fragment_size,
                        )
                        for r in m.runs
                        for i in range(r.num_fragments)
                    ]
                for local, canon, length in pieces:
                    host_view = host_rows[host_id, start + canon : start + canon + length]
                    dev_view = dev_page[local : local + length]
                    if direction is Direction.STORE:
                        host_view[:] = dev_view
                    else:
                        dev_view[:] = host_view
        d += size
        if size:
            h += -(-(size + skip) // blocks_per_chunk)


def merge_contiguous(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive descriptors that continue each other on both sides (the generic merge;
    `CompactLayout.copies` merges per block, and tests compare it with this).

    Returns:
        The merged descriptors; the inputs themselves when nothing merges.
    """
    ends_src = src[:-1] + sizes[:-1]
    follows = (ends_src == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    if not follows.any():
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)
