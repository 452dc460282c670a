"""The planner: block ids in, copy descriptors out. Pure numpy, no device code.

Addressing (the data model of vLLM's offloading worker):

* device page of block ``b`` in tensor ``t``: ``device_base[t] + b * device_page[t]``;
* host block ``h`` is one row of ``row_bytes`` holding every tensor's chunk back to back;
  sub-page ``j`` of tensor ``t`` in it: ``host_base + h * row_bytes + host_offset[t] + j * host_page[t]``;
* group ``g`` starts ``skip = block_indices[g] % blocks_per_chunk`` sub-pages into its
  first host block, so its ``k``-th device block pairs with sub-page ``q = skip + k``:
  host id ``q // blocks_per_chunk`` of the group's host ids, sub-page ``q % blocks_per_chunk``;
* each ref of the group copies its ``copy_bytes`` from the start of the page.

Descriptors are laid out group by group, ref by ref, block by block, then runs that
are contiguous on both sides are merged. One `plan` call does a fixed number of numpy
operations per KV-cache group, whatever the number of blocks or layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from offload_core.backend import Direction
from offload_core.errors import InvalidSpecError
from offload_core.layout import DeviceBlocks, HostBlocks


class CopyBatch(NamedTuple):
    """The descriptors of one transfer: copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    nbytes: int

    def __len__(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True)
class Geometry:
    """Where the bytes live, in plain integers (the planner never sees a tensor).

    Attributes:
        device_base: per tensor, address of block 0.
        device_page: per tensor, bytes between consecutive blocks (padded page).
        device_blocks: per tensor, number of blocks.
        host_base: address of host block 0.
        host_row_bytes: bytes between consecutive host blocks.
        host_offset: per tensor, offset of its chunk within a host row.
        host_page: per tensor, bytes between consecutive sub-pages of a host chunk.
        host_blocks: number of host blocks.
        group_refs: per group, ``(tensor_idx, copy_bytes)`` for each ref.
        blocks_per_chunk: device blocks per host block.
    """

    device_base: Sequence[int]
    device_page: Sequence[int]
    device_blocks: Sequence[int]
    host_base: int
    host_row_bytes: int
    host_offset: Sequence[int]
    host_page: Sequence[int]
    host_blocks: int
    group_refs: Sequence[Sequence[tuple[int, int]]]
    blocks_per_chunk: int


class _Group(NamedTuple):
    device_base: np.ndarray  # per ref, (R, 1) so it broadcasts over blocks
    device_page: np.ndarray  # per ref, (R,)
    host_base: np.ndarray  # per ref, (R,): host_base + host_offset[t]
    host_page: np.ndarray  # per ref, (R, 1)
    copy_bytes: np.ndarray  # per ref, (R, 1)
    device_limit: int  # block ids must be below this
    may_coalesce: bool


class Planner:
    """Turns (DeviceBlocks, HostBlocks) into a `CopyBatch` for one KV-cache geometry.

    Args:
        geometry: addresses and sizes of the device tensors and the host buffer.

    Raises:
        InvalidSpecError: the geometry is inconsistent (a ref copies more than a page, a
            tensor chunk overflows the host row, ...).
    """

    def __init__(self, geometry: Geometry):
        g = geometry
        self.blocks_per_chunk = bpc = int(g.blocks_per_chunk)
        self.host_blocks = int(g.host_blocks)
        self.host_row_bytes = row = int(g.host_row_bytes)
        if bpc < 1:
            raise InvalidSpecError(f"blocks_per_chunk must be >= 1, got {bpc}")
        if self.host_blocks < 1:
            raise InvalidSpecError(f"need at least one host block, got {self.host_blocks}")
        n = len(g.device_base)
        if not (len(g.device_page) == len(g.device_blocks) == len(g.host_offset) == len(g.host_page) == n):
            raise InvalidSpecError("per-tensor geometry lists differ in length")
        for t in range(n):
            if g.host_offset[t] < 0 or g.host_offset[t] + bpc * g.host_page[t] > row:
                raise InvalidSpecError(f"tensor {t}: host chunk does not fit in a host row of {row} bytes")
        self._groups: list[_Group] = []
        for refs in g.group_refs:
            tidx = np.array([t for t, _ in refs], dtype=np.int64)
            size = np.array([s for _, s in refs], dtype=np.int64)
            dev_page = np.array([g.device_page[t] for t in tidx], dtype=np.int64)
            host_page = np.array([g.host_page[t] for t in tidx], dtype=np.int64)
            if np.any(size <= 0) or np.any(size > dev_page) or np.any(size > host_page):
                raise InvalidSpecError("a ref copies more bytes than its tensor's page")
            self._groups.append(
                _Group(
                    device_base=np.array([g.device_base[t] for t in tidx], dtype=np.int64)[:, None],
                    device_page=dev_page,
                    host_base=np.array([g.host_base + g.host_offset[t] for t in tidx], dtype=np.int64),
                    host_page=host_page[:, None],
                    copy_bytes=size[:, None],
                    device_limit=min((g.device_blocks[t] for t in tidx), default=min(g.device_blocks, default=0)),
                    # Consecutive descriptors of one ref can only touch when the copy fills
                    # the page on both sides and host sub-pages follow each other.
                    may_coalesce=bool(np.any((size == dev_page) & (size == host_page) & ((bpc > 1) | (host_page == row)))),
                )
            )
        users = [t for refs in g.group_refs for t in {t for t, _ in refs}]
        # Groups that share a tensor can collide on a destination page across groups.
        self._groups_share_tensors = len(users) != len(set(users))
        self._refs_per_group = np.array([len(r) for r in g.group_refs], dtype=np.int64)
        self._bytes_per_group_block = np.array([int(x.copy_bytes.sum()) for x in self._groups], dtype=np.int64)
        self._arange = np.arange(1024, dtype=np.int64)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def max_descriptors(self, device: DeviceBlocks) -> int:
        """Descriptors `plan` writes before merging contiguous runs (the scratch size it needs)."""
        return int(device.group_sizes @ self._refs_per_group) if device.group_sizes.size == self.num_groups else 0

    def plan(
        self, direction: Direction, device: DeviceBlocks, host: HostBlocks, out: np.ndarray | None = None
    ) -> CopyBatch:
        """Validate a transfer and compute its copy descriptors.

        Args:
            direction: STORE reads the device and writes the host; LOAD the reverse.
            device: the device blocks, in group order.
            host: the host blocks, in group order.
            out: optional int64 scratch of shape ``(3, >= max_descriptors(device))``; the
                returned arrays may be views into it.

        Returns:
            The descriptors, merged where contiguous on both sides.

        Raises:
            InvalidSpecError: wrong group count, host ids that do not add up, a block id out
                of range on either side, or a destination block named twice in one group.
        """
        sizes = device.group_sizes
        if sizes.size != len(self._groups):
            raise InvalidSpecError(f"DeviceBlocks has {sizes.size} groups, the KV cache has {len(self._groups)}")
        bpc = self.blocks_per_chunk
        skips = device.block_indices % bpc
        host_counts = np.where(sizes > 0, -(-(sizes + skips) // bpc), 0)
        host_ids = host.block_ids
        if int(host_counts.sum()) != host_ids.size:
            raise InvalidSpecError(
                f"{host_ids.size} host block ids given, the device blocks need {int(host_counts.sum())} "
                f"(per group: {host_counts.tolist()}, blocks_per_chunk={bpc})"
            )
        if host_ids.size and (host_ids.min() < 0 or host_ids.max() >= self.host_blocks):
            _raise_out_of_range("host", host_ids, self.host_blocks)
        total = self.max_descriptors(device)
        if out is None or out.shape[1] < total:
            out = np.empty((3, total), dtype=np.int64)
        if self._arange.size < sizes.max(initial=0) + bpc:
            self._arange = np.arange(2 * (int(sizes.max()) + bpc), dtype=np.int64)
        dev_row, host_row = (0, 1) if direction is Direction.STORE else (1, 0)
        store = direction is Direction.STORE
        row = self.host_row_bytes
        pos = d0 = h0 = 0
        coalesce = False
        shared_keys = []
        for grp, n, skip, hc in zip(self._groups, sizes.tolist(), skips.tolist(), host_counts.tolist()):
            if n == 0:
                continue
            dev_ids = device.block_ids[d0 : d0 + n]
            d0 += n
            if dev_ids.min() < 0 or dev_ids.max() >= grp.device_limit:
                _raise_out_of_range("device", dev_ids, grp.device_limit)
            q = self._arange[skip : skip + n]  # the group's sub-pages, counted from its first host block
            group_hids = host_ids[h0 : h0 + hc]
            h0 += hc
            hids, sub = (group_hids, None) if bpc == 1 else (host_ids[h0 - hc + q // bpc], q % bpc)
            if self._groups_share_tensors:
                shared_keys.append(dev_ids if not store else hids * bpc + (0 if sub is None else sub))
            else:
                _check_unique(group_hids if store else dev_ids, "host block id" if store else "device block id")
            r = grp.copy_bytes.shape[0]
            if r == 0:
                continue
            end = pos + r * n
            dev = out[dev_row, pos:end].reshape(r, n)
            np.multiply.outer(grp.device_page, dev_ids, out=dev)
            dev += grp.device_base
            hst = out[host_row, pos:end].reshape(r, n)
            np.add.outer(grp.host_base, hids * row, out=hst)
            if sub is not None:
                hst += grp.host_page * sub
            out[2, pos:end].reshape(r, n)[:] = grp.copy_bytes
            coalesce |= grp.may_coalesce
            pos = end
        if shared_keys:
            _check_unique(np.concatenate(shared_keys), "device block id" if not store else "host sub-page")
        nbytes = int(sizes @ self._bytes_per_group_block)
        src, dst, size = out[0, :pos], out[1, :pos], out[2, :pos]
        if coalesce and pos > 1:
            src, dst, size = merge_contiguous(src, dst, size)
        return CopyBatch(src, dst, size, nbytes)


def merge_contiguous(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive descriptors that continue each other on both sides.

    Returns:
        The merged descriptors; the inputs themselves when nothing merges.
    """
    ends_src = src[:-1] + sizes[:-1]
    follows = (ends_src == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    if not follows.any():
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)


def _raise_out_of_range(side: str, ids: np.ndarray, limit: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    raise InvalidSpecError(
        f"{side} block id {int(ids[bad[0]])} out of range [0, {limit}) "
        f"({bad.size} bad ids, first at position {int(bad[0])} of its group)"
    )


def _check_unique(ids: np.ndarray, side: str) -> None:
    """Two copies into the same destination page would race: reject them."""
    if ids.size < 2:
        return
    s = np.sort(ids)
    dup = s[1:] == s[:-1]
    if dup.any():
        raise InvalidSpecError(f"{side} {int(s[1:][dup][0])} is the destination of two copies in one transfer")
