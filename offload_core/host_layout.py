"""Where a worker's KV pages live in host memory: one row per host block, holding every KV
tensor's chunk (``blocks_per_chunk`` pages) back to back. `HostLayout` is the arithmetic only;
the worker lays it over private host memory or over a `SharedHostRegion`'s slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload_core.errors import InvalidSpecError
from offload_core.spec import KVCaches

if TYPE_CHECKING:
    from offload_core.region import SharedHostRegion


@dataclass(frozen=True)
class HostLayout:
    """The host row of one worker.

    Attributes:
        pages: per KV tensor, the bytes of one page on the host: the tensor's own page in the
            direct layout; in the canonical one, the largest canonical page among the refs into
            the tensor (0 where no ref reads it).
        offsets: per KV tensor, where its chunk starts in a row.
        row_bytes: the bytes of every tensor's chunk: what one host block needs.
        blocks_per_chunk: device blocks (pages) per host block.
        canonical: whether pages are laid out as the unsharded model's (see `OffloadWorker`).
    """

    pages: tuple[int, ...]
    offsets: tuple[int, ...]
    row_bytes: int
    blocks_per_chunk: int
    canonical: bool

    @classmethod
    def of(cls, kv_caches: KVCaches, blocks_per_chunk: int = 1, canonical: bool = False) -> HostLayout:
        """The layout of `kv_caches`' pages, direct or canonical."""
        if canonical:
            pages = [0] * len(kv_caches.tensors)
            for refs in kv_caches.group_refs:
                for r in refs:
                    size = r.mapping.canonical_page_size_bytes if r.mapping is not None else r.page_size_bytes
                    pages[r.tensor_idx] = max(pages[r.tensor_idx], size)
            # A tensor no ref reads keeps 0: nothing of it is copied, and its own (padded) page
            # depends on the TP size, which would move every later tensor in the canonical row.
        else:
            pages = [t.page_size_bytes for t in kv_caches.tensors]
        offsets = [sum(pages[:i]) * blocks_per_chunk for i in range(len(pages))]
        return cls(tuple(pages), tuple(offsets), sum(pages) * blocks_per_chunk, blocks_per_chunk, canonical)

    def views(self, rows, slot: int = 0) -> list:
        """Per KV tensor, a ``(host blocks, chunk bytes)`` view of its chunks in `rows` (an int8
        tensor of host rows), whose rows start `slot` bytes in."""
        return [
            rows[:, slot + off : slot + off + page * self.blocks_per_chunk]
            for off, page in zip(self.offsets, self.pages)
        ]

    def check_region(self, region: SharedHostRegion, num_blocks: int) -> None:
        """Whether `region` can hold this layout's rows.

        Raises:
            InvalidSpecError: another number of host blocks, the other layout, or a slot
                smaller than a row.
        """
        if region.num_blocks != num_blocks:
            raise InvalidSpecError(f"the region has {region.num_blocks} host blocks, the worker asked for {num_blocks}")
        if region.canonical != self.canonical:
            raise InvalidSpecError(
                f"the region holds the {'canonical' if region.canonical else 'direct'} layout, "
                f"the worker uses the {'canonical' if self.canonical else 'direct'} one"
            )
        if self.row_bytes > region.slot_bytes:
            raise InvalidSpecError(
                f"the region is too small: this rank needs {self.row_bytes} bytes per host block, its slot has "
                f"{region.slot_bytes}"
            )
