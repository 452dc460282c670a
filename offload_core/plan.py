"""The planner: block ids in, copy descriptors out. Pure numpy, no device code.

Addressing (the data model of vLLM's offloading worker):

* device page of block ``b`` in tensor ``t``: ``device_base[t] + b * device_page[t]``;
* host block ``h`` is one row of ``row_bytes`` holding every tensor's chunk back to back;
  sub-page ``j`` of tensor ``t`` in it: ``host_base + h * row_bytes + host_offset[t] + j * host_page[t]``;
* group ``g`` starts ``skip = block_indices[g] % blocks_per_chunk`` sub-pages into its
  first host block, so its ``k``-th device block pairs with sub-page ``q = skip + k``:
  host id ``q // blocks_per_chunk`` of the group's host ids, sub-page ``q % blocks_per_chunk``;
* each ref of the group copies its ``copy_bytes`` from the start of the page.

The refs of a group are split once, at construction, into parts that share a page
geometry (usually one part: every layer alike). Descriptors are laid out group by group,
part by part, block by block, ref by ref: the order of the host rows, so that a backend can
find host-contiguous runs (a block's pages of all layers) among neighbours. Where a part
copies whole pages, runs of blocks that are contiguous on both sides become one descriptor
(`offload_core.runs`), decided on the block offsets
before any per-ref array exists. One `plan` call does a fixed number of numpy operations
per group and part, whatever the number of blocks or layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from offload_core.backend import Direction
from offload_core.errors import InvalidSpecError
from offload_core.layout import DeviceBlocks, HostBlocks
from offload_core.runs import run_starts

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
    full_pages: bool  # copies whole pages on both sides, so consecutive blocks may merge
    mapping: CanonicalPageMapping | None  # its fragments scatter the page into the host page


class _Group(NamedTuple):
    parts: tuple[_Part, ...]
    device_limit: int  # device block ids must be below this
    descriptors_per_block: int


class _Checked(NamedTuple):
    """One group of a validated transfer."""

    index: int
    group: _Group
    n: int  # blocks
    dev_ids: np.ndarray
    hids: np.ndarray  # per block, its host block
    sub: np.ndarray | None  # per block, its sub-page in that host block; None where blocks_per_chunk is 1
    first_chunk: int  # position of the group's first host block in HostBlocks
    skip: int  # sub-pages of the first host block the group skips


class Planner:
    """Turns (DeviceBlocks, HostBlocks) into a `CopyBatch` for one KV-cache geometry.

    Args:
        geometry: addresses and sizes of the device tensors and the host buffer.

    Raises:
        InvalidSpecError: the geometry is inconsistent (a ref copies more than a page, a
            tensor chunk overflows the host row, ...).
    """

    def __init__(self, geometry: Geometry):
        if not isinstance(geometry, Geometry):
            raise InvalidSpecError(f"Planner needs a Geometry, got {type(geometry).__name__}")
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
            named = [r.tensor for r in refs if isinstance(r, PlanRef)]
            if len(named) != len(set(named)):
                raise InvalidSpecError(f"a group names tensor {max(named, key=named.count)} twice")
            by_shape: dict[tuple, list[int]] = {}
            for ref in refs:
                if not isinstance(ref, PlanRef):
                    raise InvalidSpecError(f"group refs must be PlanRef, got {ref!r}")
                t, size, mapping = ref
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
                    full_pages=mapping is None and size == dev_page == host_page,
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
                    descriptors_per_block=sum(
                        len(p.device_base) * (1 if p.mapping is None else p.mapping.fragments[2].size) for p in parts
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

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def max_descriptors(self, device: DeviceBlocks) -> int:
        """Descriptors `plan` writes at most (the scratch size it needs).

        Raises:
            InvalidSpecError: a group names more blocks than any valid transfer can (each
                destination page at most once), so no scratch is sized from a wild count.
        """
        if device.group_sizes.size != self.num_groups:
            return 0
        sizes = device.group_sizes.tolist()
        for g, (n, grp) in enumerate(zip(sizes, self._groups)):
            if n > max(grp.device_limit, self.host_blocks * self.blocks_per_chunk):
                raise InvalidSpecError(
                    f"group {g} names {n} blocks, more than any transfer can move (device blocks "
                    f"{grp.device_limit}, host pages {self.host_blocks * self.blocks_per_chunk})"
                )
        return self._descriptors(sizes)

    def _descriptors(self, sizes: list[int]) -> int:
        return sum(n * grp.descriptors_per_block for n, grp in zip(sizes, self._groups))

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
            The descriptors; runs of consecutive blocks that are contiguous on both sides
            are merged into one descriptor.

        Raises:
            InvalidSpecError: wrong group count, host ids that do not add up, a block id out
                of range on either side, or a destination page named twice in one transfer.
        """
        checked, sizes = self._check(direction, device, host)
        total = self._descriptors(sizes)
        if out is None or out.shape[1] < total:
            out = np.empty((3, total), dtype=np.int64)
        store = direction is Direction.STORE
        dev_row, host_row = (0, 1) if store else (1, 0)
        row = self.host_row_bytes
        pos = nbytes = 0
        for _, grp, n, dev_ids, hids, sub, _, _ in checked:
            host_rows = hids * row
            for part in grp.parts:
                dev_off = dev_ids * part.device_page
                host_off = host_rows if sub is None else host_rows + sub * part.host_page
                if part.mapping is not None:
                    pos, moved = self._plan_mapped(part, dev_off, host_off, hids, sub, store, out, pos)
                    nbytes += moved
                    continue
                nbytes += n * len(part.device_base) * part.copy_bytes
                run_bytes = part.copy_bytes
                if part.full_pages and n > 1:
                    dev_off, host_off, run_bytes = _merge_blocks(dev_off, host_off, part.copy_bytes)
                m = dev_off.size
                end = pos + part.device_base.size * m
                np.add.outer(dev_off, part.device_base, out=out[dev_row, pos:end].reshape(m, -1))
                np.add.outer(host_off, part.host_base, out=out[host_row, pos:end].reshape(m, -1))
                out[2, pos:end].reshape(m, -1)[:] = np.reshape(run_bytes, (-1, 1))
                pos = end
        return CopyBatch(out[0, :pos], out[1, :pos], out[2, :pos], nbytes)

    def _check(self, direction: Direction, device: DeviceBlocks, host: HostBlocks) -> tuple[list, list[int]]:
        """Validate a transfer (see `plan`'s Raises) before anything is computed from it.

        Returns:
            A `_Checked` per group that moves blocks, and the group sizes.
        """
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
            checked.append(_Checked(g, grp, n, dev_ids, hids, sub, h0 - hc, skip))
        for gs in self._collisions if shared_keys else ():
            keys = [shared_keys[g] for g in gs if g in shared_keys]
            if keys:  # a group's own duplicates too
                if store:
                    _check_unique(np.concatenate(keys), "host sub-page", self.host_blocks * bpc)
                else:
                    _check_unique(np.concatenate(keys), "device block id", self.device_limit)
        return checked, sizes

    def _plan_mapped(self, part, dev_off, host_off, hids, sub, store, out, pos) -> tuple[int, int]:
        """Descriptors of a part whose pages go through a canonical mapping: one per (block, ref,
        fragment). On store, only the pages this rank is elected to write.

        Returns:
            The next free descriptor position and the bytes planned.
        """
        mapping = part.mapping
        if store and mapping.num_writers > 1:
            # the global canonical page id: every rank computes the same election for a page
            page_ids = hids * self.blocks_per_chunk + (0 if sub is None else sub)
            mine = mapping.is_writer(page_ids)
            dev_off, host_off = dev_off[mine], host_off[mine]
        local, canon, sizes = mapping.fragments
        m, r, f = dev_off.size, part.device_base.size, sizes.size
        end = pos + m * r * f
        dev_row, host_row = (0, 1) if store else (1, 0)
        np.add.outer(np.add.outer(dev_off, part.device_base), local, out=out[dev_row, pos:end].reshape(m, r, f))
        np.add.outer(np.add.outer(host_off, part.host_base), canon, out=out[host_row, pos:end].reshape(m, r, f))
        out[2, pos:end].reshape(m, r, f)[:] = sizes
        return end, m * r * part.copy_bytes


def _merge_blocks(dev_off: np.ndarray, host_off: np.ndarray, page: int):
    """Merge runs of blocks that follow each other on both sides (whole-page copies only).

    Decided once per group from block offsets, not per descriptor: every ref of a part
    shares the page geometry, so they merge at the same places.

    Returns:
        Offsets of each run's first block, and each run's length in bytes (or `page` when
        nothing merges).
    """
    starts = run_starts((dev_off, host_off), page)
    if starts.size == dev_off.size:
        return dev_off, host_off, page
    run_blocks = np.diff(np.append(starts, dev_off.size))
    return dev_off[starts], host_off[starts], run_blocks * page


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
