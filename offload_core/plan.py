"""The planner: a worker's geometry in plain integers, and the validation of each transfer
against it. Pure numpy, no device code.

Addressing (the data model of vLLM's offloading worker):

* device page of block ``b`` in tensor ``t``: ``device_base[t] + b * device_page[t]``;
* host block ``h`` is one row of ``row_bytes`` holding every tensor's chunk back to back;
  sub-page ``j`` of tensor ``t`` in it: ``host_base + h * row_bytes + host_offset[t] + j * host_page[t]``;
* group ``g`` starts ``skip = block_indices[g] % blocks_per_chunk`` sub-pages into its
  first host block, so its ``k``-th device block pairs with sub-page ``q = skip + k``:
  host id ``q // blocks_per_chunk`` of the group's host ids, sub-page ``q % blocks_per_chunk``;
* each ref of the group copies its ``copy_bytes`` from the start of the page.

The refs of a group are split once, at construction, into parts that share a page geometry
(usually one part: every layer alike); `offload_core.compact` builds a worker's table of
copies from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from offload_core.backend import Direction
from offload_core.errors import InvalidSpecError
from offload_core.spec import DeviceBlocks, HostBlocks

if TYPE_CHECKING:
    from offload_core.canonical import CanonicalPageMapping


class PlanRef(NamedTuple):
    """One ref of a group, as the planner sees it: which tensor, how much of each page, and
    where its page goes in the host page.

    Attributes:
        tensor: index into the geometry's per-tensor lists.
        copy_bytes: bytes copied from the start of each page (at most the device page; at
            most the host page unless `mapping` scatters them).
        mapping: a `CanonicalPageMapping` scattering the page into the canonical host page,
            or None for a page copied whole to the start of its host page.
    """

    tensor: int
    copy_bytes: int
    mapping: CanonicalPageMapping | None = None


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
        group_refs: per group, a `PlanRef` for each of its refs.
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
    group_refs: Sequence[Sequence[PlanRef]]
    blocks_per_chunk: int


class _Part(NamedTuple):
    """Refs of one group that share a page geometry: one numpy pass each for addresses and sizes."""

    device_base: np.ndarray  # per ref, address of block 0
    host_base: np.ndarray  # per ref, host_base + host_offset[t]
    device_page: int
    host_page: int
    copy_bytes: int
    mapping: CanonicalPageMapping | None  # its fragments scatter the page into the host page


class _Group(NamedTuple):
    parts: tuple[_Part, ...]
    device_limit: int  # device block ids must be below this


class _Checked(NamedTuple):
    """One group of a validated transfer."""

    index: int
    n: int  # blocks
    dev_ids: np.ndarray
    hids: np.ndarray  # per block, its host block
    sub: np.ndarray | None  # per block, its sub-page in that host block; None where blocks_per_chunk is 1
    first_chunk: int  # position of the group's first host block in HostBlocks
    skip: int  # sub-pages of the first host block the group skips


class Planner:
    """Checks (DeviceBlocks, HostBlocks) against one KV-cache geometry (`_check`).

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
        self.host_base = int(g.host_base)
        if bpc < 1:
            raise InvalidSpecError(f"blocks_per_chunk must be >= 1, got {bpc}")
        if self.host_blocks < 1:
            raise InvalidSpecError(f"need at least one host block, got {self.host_blocks}")
        if row < 0 or self.host_base < 0 or self.host_base + self.host_blocks * row >= 1 << 63:
            # descriptors are int64: an address past it would wrap around
            raise InvalidSpecError(
                f"host_base {self.host_base} + {self.host_blocks} host rows of {row} bytes leave the int64 "
                "address range"
            )
        n = len(g.device_base)
        if not (len(g.device_page) == len(g.device_blocks) == len(g.host_offset) == len(g.host_page) == n):
            raise InvalidSpecError("per-tensor geometry lists differ in length")
        for t in range(n):
            if g.device_blocks[t] < 0:
                raise InvalidSpecError(f"tensor {t}: {g.device_blocks[t]} device blocks, a negative count")
            if g.host_offset[t] < 0 or g.host_offset[t] + bpc * g.host_page[t] > row:
                raise InvalidSpecError(f"tensor {t}: host chunk does not fit in a host row of {row} bytes")
        chunks = sorted((g.host_offset[t], g.host_offset[t] + bpc * g.host_page[t], t) for t in range(n))
        for (_, end, t), (start, _, u) in zip(chunks, chunks[1:]):
            if start < end:  # a store of both would write the same host bytes twice
                raise InvalidSpecError(f"tensors {t} and {u}: their host chunks overlap in the host row")
        self._groups: list[_Group] = []
        for refs in g.group_refs:
            named = [r.tensor for r in refs]
            if len(named) != len(set(named)):
                raise InvalidSpecError(f"a group names tensor {max(named, key=named.count)} twice")
            by_shape: dict[tuple, list[int]] = {}
            for t, size, mapping in refs:
                if not 0 < size <= g.device_page[t] or (mapping is None and size > g.host_page[t]):
                    raise InvalidSpecError(f"a ref copies {size} bytes of tensor {t}, more than its page")
                if mapping is not None and (
                    mapping.local_page_size_bytes != size or mapping.canonical_page_size_bytes > g.host_page[t]
                ):
                    raise InvalidSpecError(f"tensor {t}: mapping does not fit the ref's page or the host page")
                by_shape.setdefault((int(g.device_page[t]), int(g.host_page[t]), int(size), mapping), []).append(t)
            parts = tuple(
                _Part(
                    device_base=np.array([g.device_base[t] for t in ts], dtype=np.int64),
                    host_base=np.array([g.host_base + g.host_offset[t] for t in ts], dtype=np.int64),
                    device_page=dev_page,
                    host_page=host_page,
                    copy_bytes=size,
                    mapping=mapping,
                )
                for (dev_page, host_page, size, mapping), ts in by_shape.items()
            )
            self._groups.append(
                _Group(
                    parts=parts,
                    device_limit=min(
                        (g.device_blocks[r.tensor] for r in refs), default=min(g.device_blocks, default=0)
                    ),
                )
            )
        users: dict[int, list[int]] = {}  # tensor -> the groups that copy it
        for gi, refs in enumerate(g.group_refs):
            for t in {r.tensor for r in refs}:
                users.setdefault(t, []).append(gi)
        # Groups that share a tensor can collide on a destination page of it; others cannot.
        self._collisions = sorted({tuple(gs) for gs in users.values() if len(gs) > 1})
        self._colliding = {gi for gs in self._collisions for gi in gs}
        self.device_limit = max((grp.device_limit for grp in self._groups), default=0)  # above every device id
        self._arange = np.arange(1024, dtype=np.int64)

    def _check(self, direction: Direction, device: DeviceBlocks, host: HostBlocks) -> list[_Checked]:
        """Validate a transfer (see `CompactLayout.job`'s Raises) before anything is computed from it:
        a `_Checked` per group that moves blocks."""
        # Per-group bookkeeping is a handful of Python ints: cheaper than numpy calls on tiny arrays.
        sizes = device.group_sizes.tolist()
        if len(sizes) != len(self._groups):
            raise InvalidSpecError(f"DeviceBlocks has {len(sizes)} groups, the KV cache has {len(self._groups)}")
        bpc = self.blocks_per_chunk
        skips = [i % bpc for i in device.block_indices.tolist()]
        host_counts = [-(-(n + skip) // bpc) if n else 0 for n, skip in zip(sizes, skips)]
        host_ids = host.block_ids
        if sum(host_counts) != host_ids.size:
            raise InvalidSpecError(
                f"{host_ids.size} host block ids given, the device blocks need {sum(host_counts)} "
                f"(per group: {host_counts}, blocks_per_chunk={bpc})"
            )
        if any_outside(host_ids, self.host_blocks):
            _raise_out_of_range("host", host_ids, self.host_blocks)
        arange = self._arange  # one read: another thread may swap in a smaller one meanwhile
        if arange.size < max(sizes, default=0):
            arange = self._arange = np.arange(2 * max(sizes), dtype=np.int64)
        store = direction is Direction.STORE
        d0 = h0 = 0
        shared_keys, checked = {}, []
        for g, (grp, n, skip, hc) in enumerate(zip(self._groups, sizes, skips, host_counts)):
            if n == 0:
                continue
            dev_ids = device.block_ids[d0 : d0 + n]
            d0 += n
            if any_outside(dev_ids, grp.device_limit):
                _raise_out_of_range("device", dev_ids, grp.device_limit)
            group_hids = host_ids[h0 : h0 + hc]
            h0 += hc
            if bpc == 1:
                hids, sub = group_hids, None
            else:  # the group's sub-pages, counted from its first host block
                q = arange[:n] + skip
                hids, sub = group_hids[q // bpc], q % bpc
            if g in self._colliding:
                shared_keys[g] = dev_ids if not store else hids * bpc + (0 if sub is None else sub)
            else:
                if store:
                    _check_unique(group_hids, "host block id", self.host_blocks)
                else:
                    _check_unique(dev_ids, "device block id", grp.device_limit)
            checked.append(_Checked(g, n, dev_ids, hids, sub, h0 - hc, skip))
        for gs in self._collisions if shared_keys else ():
            keys = [shared_keys[g] for g in gs if g in shared_keys]
            if keys:  # a group's own duplicates too
                if store:
                    _check_unique(np.concatenate(keys), "host sub-page", self.host_blocks * bpc)
                else:
                    _check_unique(np.concatenate(keys), "device block id", self.device_limit)
        return checked


_FEW = 64  # up to this many ids, Python's min, max and set beat numpy's per-call overhead (4x at 16)


def any_outside(ids: np.ndarray, limit: int) -> bool:
    """Whether any id is negative or not below `limit`: one comparison, since a negative int64
    read as uint64 is larger than any limit."""
    if ids.size <= _FEW:
        few = ids.tolist()
        return bool(few) and (min(few) < 0 or max(few) >= limit)
    return bool((ids.view(np.uint64) >= limit).any())


def _raise_out_of_range(side: str, ids: np.ndarray, limit: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    raise InvalidSpecError(
        f"{side} block id {int(ids[bad[0]])} out of range [0, {limit}) "
        f"({bad.size} bad ids, first at position {int(bad[0])} of its group)"
    )


def _check_unique(ids: np.ndarray, side: str, limit: int) -> None:
    """Two copies into the same destination page would race: reject them. Every id lies in
    ``[0, limit)`` (checked before)."""
    if not has_duplicates(ids, limit):
        return
    s = np.sort(ids)
    dup = s[1:] == s[:-1]
    raise InvalidSpecError(f"{side} {int(s[1:][dup][0])} is the destination of two copies in one transfer")


def has_duplicates(ids: np.ndarray, limit: int) -> bool:
    """Whether an id occurs twice in `ids`, each of which lies in ``[0, limit)``."""
    n = ids.size
    if n < 2:
        return False
    if n <= _FEW:
        return len(set(ids.tolist())) != n
    if n * 64 >= limit:  # a byte per possible id and one scatter: a 1M-id job in 1 ms, not a 50 ms sort
        seen = np.zeros(limit, dtype=np.bool_)
        seen[ids] = True
        return int(np.count_nonzero(seen)) != n
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())
