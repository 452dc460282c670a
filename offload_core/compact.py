"""Jobs: a transfer as block ids against a table computed once per worker (docs/architecture.md §3).

`CompactLayout` tables what every block copies, its *entries*, and validates each transfer
(`CompactLayout.job`); a `CompactJob` is one validated transfer, one column per device block.
Entry ``e`` of block ``b`` copies ``size[e]`` bytes between ``dev_base[e] + dev_id[b] * dev_page[e]
+ dev_off[e]`` and ``row(b) + host_off[e] + sub[b] * host_sub[e]`` (``row(b)``: its host row, or
staging that mirrors it); a store skips it unless ``page[b] % writers[e] == writer[e]``.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

from offload_core import native
from offload_core.backend import Direction
from offload_core.canonical import elected
from offload_core.errors import InvalidSpecError
from offload_core.runs import merge_runs, run_starts
from offload_core.spec import DeviceBlocks, HostBlocks, KVCaches

if TYPE_CHECKING:
    from offload_core.host_layout import HostLayout

ENTRY_COLUMNS = ("dev_base", "dev_page", "dev_off", "host_off", "host_sub", "size", "writers", "writer")
BLOCK_COLUMNS = ("dev_id", "chunk", "sub", "page", "group")
SORTED_BLOCKS = 2048  # the most blocks `CompactJob.in_host_order` sorts (2048 ids: about 60 us, CI-class CPU)


class CompactJob:
    """One validated transfer, one column per device block.

    Attributes:
        layout: the layout the ids refer to.
        direction: STORE or LOAD.
        dev_ids: int64, the device block of each block.
        host_ids: int64, the host block of each chunk.
        groups: per group that moves blocks, ``(group, first block, end block, first chunk,
            end chunk, skip)``: its range in `blocks` and in `host_ids`, and the sub-pages of
            its first chunk it skips.
        nbytes: bytes the job copies.
        items: copies the job expands to (blocks times their group's entries).
        simple: one group, one block per chunk, block ``i`` in chunk ``i``: `dev_ids` and
            `host_ids` say everything, and `blocks` is built only when asked for.
        jobs: how many submitted jobs that move blocks this one joins (`concat`).
        host_after: set by the queue at a launch: other lanes' end events that a stream touching
            this job's host rows must wait for.
    """

    __slots__ = (
        "layout",
        "direction",
        "dev_ids",
        "host_ids",
        "groups",
        "nbytes",
        "items",
        "_blocks",
        "jobs",
        "_copies",
        "_segments",
        "host_after",
    )

    def __init__(
        self,
        layout: CompactLayout,
        direction: Direction,
        blocks: np.ndarray | None,
        host_ids: np.ndarray,
        groups: tuple,
        nbytes: int,
        items: int,
        dev_ids: np.ndarray | None = None,
        jobs: int = 1,
    ):
        self.layout, self.direction, self.host_ids = layout, direction, host_ids
        self.groups, self.nbytes, self.items = groups, nbytes, items
        self._blocks, self.jobs = blocks, jobs
        self.dev_ids = blocks[0] if dev_ids is None else dev_ids
        self._copies: tuple | None = None  # cached by `CompactLayout.copies`
        self._segments: tuple | None = None  # cached by `CompactLayout.segments`
        self.host_after: tuple = ()

    @property
    def simple(self) -> bool:
        return self._blocks is None

    @property
    def blocks(self) -> np.ndarray:
        """int64 ``(5, n)``, rows named by `BLOCK_COLUMNS`: device block id, position of its host
        block in `host_ids` (its chunk), sub-page in that host block, canonical page id
        (``host block * blocks_per_chunk + sub``) and KV-cache group. A simple job's is built anew
        on each call."""
        if self._blocks is not None:
            return self._blocks
        n = self.dev_ids.size
        table = np.zeros((5, n), dtype=np.int64)
        table[0] = self.dev_ids
        table[1] = np.arange(n)
        table[3] = self.host_ids
        return table

    def __len__(self) -> int:
        return self.dev_ids.size

    def destinations(self) -> np.ndarray:
        """A key per block that two blocks share if they may write the same bytes: the host
        page for a store, the device block for a load (conservative across groups). Every key
        lies in ``[0, destination_limit)``."""
        if self.direction is Direction.LOAD:
            return self.dev_ids
        return self.host_ids if self._blocks is None else self._blocks[3]

    @property
    def destination_limit(self) -> int:
        """A bound on `destinations`: host pages for a store, device blocks for a load."""
        if self.direction is Direction.STORE:
            return self.layout.host_blocks * self.layout.blocks_per_chunk
        return self.layout.device_limit

    def in_host_order(self) -> CompactJob:
        """The same copies with the blocks in host-block order where that makes fewer host runs
        (an engine's free list hands out host blocks backwards), else this job: staging that
        mirrors host rows then moves one copy per run. Simple jobs of 2 to `SORTED_BLOCKS`
        blocks only (larger ones are bound by the link, or by the sort)."""
        n = self.dev_ids.size
        if self._blocks is not None or not 2 <= n <= SORTED_BLOCKS:
            return self
        hosts, compiled = self.host_ids, self.layout.native
        if compiled is not None:
            ordered, devs = np.empty_like(hosts), np.empty_like(self.dev_ids)
            if not compiled.host_order(hosts, self.dev_ids, ordered, devs):
                return self
        else:
            order = np.argsort(hosts, kind="stable")
            ordered = hosts[order]
            if run_starts((ordered,), 1).size >= run_starts((hosts,), 1).size:
                return self
            devs = self.dev_ids[order]
        return CompactJob(
            self.layout, self.direction, None, ordered, self.groups, self.nbytes, self.items, devs, self.jobs
        )

    @staticmethod
    def concat(jobs: list[CompactJob]) -> CompactJob:
        """Consecutive jobs of one layout and direction as one job (their chunks renumbered).
        The caller makes sure that no two of them write the same bytes (`destinations`)."""
        if len(jobs) == 1:
            return jobs[0]
        first = jobs[0]
        # The usual launch: simple jobs, and at most general ones that move nothing. One plain
        # loop: this runs under the enqueue lock for every launch of two jobs or more.
        devs, hosts, nbytes, items, count = [], [], 0, 0, 0
        for j in jobs:
            if j._blocks is None:
                devs.append(j.dev_ids)
                hosts.append(j.host_ids)
                nbytes, items, count = nbytes + j.nbytes, items + j.items, count + j.jobs
            elif len(j) or j.host_ids.size:
                break
        else:
            if devs:
                dev_ids, host_ids = np.concatenate(devs), np.concatenate(hosts)
                groups = ((0, 0, dev_ids.size, 0, dev_ids.size, 0),)
                return CompactJob(first.layout, first.direction, None, host_ids, groups, nbytes, items, dev_ids, count)
        nbytes, items = sum(j.nbytes for j in jobs), sum(j.items for j in jobs)
        count = sum(j.jobs for j in jobs if len(j))
        lengths = [len(j) for j in jobs]
        block_offsets = list(accumulate(lengths, initial=0))
        chunk_offsets = list(accumulate((j.host_ids.size for j in jobs), initial=0))
        compiled = first.layout.native
        if compiled is not None:
            blocks = np.empty((5, block_offsets[-1]), dtype=np.int64)
            host_ids = np.empty(chunk_offsets[-1], dtype=np.int64)
            compiled.concat([j.blocks for j in jobs], [j.host_ids for j in jobs], blocks, host_ids)
        else:
            blocks = np.concatenate([j.blocks for j in jobs], axis=1)
            blocks[1] += np.repeat(chunk_offsets[:-1], lengths)
            host_ids = np.concatenate([j.host_ids for j in jobs])
        groups = tuple(
            (g, b0 + ob, b1 + ob, c0 + oc, c1 + oc, skip)
            for j, ob, oc in zip(jobs, block_offsets, chunk_offsets)
            for g, b0, b1, c0, c1, skip in j.groups
        )
        return CompactJob(first.layout, first.direction, blocks, host_ids, groups, nbytes, items, jobs=count)


class CompactLayout:
    """What every transfer of one worker has in common, for expanding its jobs, and the
    validation of each (`job`).

    Args:
        kv_caches: the device KV cache.
        host: the host row (`HostLayout`).
        host_base: address of host block 0.
        row_stride: bytes between consecutive host blocks (`host.row_bytes`, or a shared
            region's stride).
        host_blocks: how many host blocks there are.
        compiled: take the compiled steps (`offload_core.native`) where they were built; False:
            numpy, the reference.
        elect_writers: ranks that hold a page alike take turns writing it (`CanonicalPageMapping`'s
            writers), as they share the host memory; False: this rank writes every page it
            holds (its memory is its own).

    Attributes:
        entries: int64 ``(8, E)``, rows named by `ENTRY_COLUMNS`, group by group.
        group_entries: int64 ``(2, G)``: per group, its first entry and how many it has.
        row_bytes, host_base, blocks_per_chunk, host_blocks: the host buffer's geometry
            (`row_bytes` is `row_stride`).
        device_limit: one above any device block id of any group.
        largest, smallest: the largest and the smallest entry, in bytes.
        native: the compiled steps this layout's jobs take, or None (numpy).
        simple_jobs: every job of this layout that moves blocks is simple (`CompactJob.simple`).
        id_limit: where `simple_jobs`, one above any id (device or host) such a job may hold;
            else None.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        host: HostLayout,
        host_base: int,
        row_stride: int,
        host_blocks: int,
        compiled: bool = True,
        elect_writers: bool = True,
    ):
        self.row_bytes, self.host_base, self.host_blocks = row_stride, host_base, host_blocks
        self.blocks_per_chunk = host.blocks_per_chunk
        tensors = kv_caches.tensors
        columns, self._device_limits = [], []  # per group: its entries, and one above its device ids
        users: dict[int, list[int]] = {}  # a tensor's memory -> the groups that copy it
        for g, refs in enumerate(kv_caches.group_refs):
            self._device_limits.append(min(tensors[r.tensor_idx].num_blocks for r in refs))
            for r in refs:
                users.setdefault(kv_caches.memory[r.tensor_idx], []).append(g)
            # Refs of one page geometry go together, so that whole pages of one size are one run
            # of entries (`copies`).
            shapes = [
                (tensors[r.tensor_idx].pitch_bytes, host.pages[r.tensor_idx], r.page_size_bytes, r.mapping)
                for r in refs
            ]
            if not host.canonical:  # direct: pages go whole
                shapes = [s[:3] + (None,) for s in shapes]
            rows = []
            for i in sorted(range(len(refs)), key=lambda i: shapes.index(shapes[i])):
                t, (dev_page, host_page, size, mapping) = refs[i].tensor_idx, shapes[i]
                if mapping is None:
                    local, canon, sizes, writers, writer = [0], [0], [size], 1, 0
                else:
                    local, canon, sizes = mapping.fragments
                    writers, writer = (mapping.num_writers, mapping.writer_index) if elect_writers else (1, 0)
                dev_base, host_off = tensors[t].tensor.data_ptr(), np.add(canon, host.offsets[t])
                fields = np.broadcast_arrays(dev_base, dev_page, local, host_off, host_page, sizes, writers, writer)
                rows.append(np.array(fields, dtype=np.int64))
            columns.append(np.concatenate(rows, axis=1))
        self.entries = np.ascontiguousarray(np.concatenate(columns, axis=1))
        counts = [c.shape[1] for c in columns]
        self.group_entries = np.array([list(accumulate(counts[:-1], initial=0)), counts], dtype=np.int64)
        self.largest, self.smallest = int(self.entries[5].max()), int(self.entries[5].min())
        self._entry_bytes = [int(c[5].sum()) for c in columns]
        self._periods = [math.lcm(*c[6].tolist()) for c in columns]  # of each group's writer elections
        # Only groups that share a tensor can collide on a destination page.
        self._collisions = sorted({tuple(gs) for gs in users.values() if len(gs) > 1})
        self._colliding = {g for gs in self._collisions for g in gs}
        self.device_limit = max(self._device_limits)
        # Per group, its entries in runs (start, end, page): a run of entries that copy whole pages
        # of one size on both sides, without election, has that size (`copies` merges consecutive
        # blocks there); others have 0.
        self._runs_of_entries = []
        self._dev_entry = self.entries[0] + self.entries[2]  # an entry's device address less the block's offset
        self._host_entry = self.entries[3] + self.host_base  # its host address less the chunk's and sub-page's
        for e0, count in self.group_entries.T.tolist():
            e = self.entries[:, e0 : e0 + count]
            whole = np.where((e[1] == e[4]) & (e[1] == e[5]) & (e[2] == 0) & (e[6] == 1), e[1], 0)
            cuts = [0, *(np.flatnonzero(whole[1:] != whole[:-1]) + 1).tolist(), count]
            self._runs_of_entries.append(
                [(e0 + a, e0 + b, int(whole[a])) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
            )
        self._templates: dict = {}
        self.native = native.load() if compiled else None
        # One group, one block per chunk (most engines' caches): jobs take `_job_single`.
        self.simple_jobs = len(columns) == 1 and self.blocks_per_chunk == 1
        self.id_limit = max(self.device_limit, self.host_blocks) if self.simple_jobs else None

    @property
    def max_entries(self) -> int:
        """The most copies one block makes."""
        return int(self.group_entries[1].max())

    def job(self, direction: Direction, device: DeviceBlocks, host: HostBlocks) -> CompactJob:
        """Validate a transfer and describe it by blocks.

        Raises:
            InvalidSpecError: wrong group count, host ids that do not add up, a block id out of
                range on either side, or a destination page named twice in one transfer.
        """
        if self.simple_jobs:
            job = self._job_single(direction, device, host)
            if job is not None:
                return job
        return self._job_general(direction, device, host)

    def _job_general(self, direction: Direction, device: DeviceBlocks, host: HostBlocks) -> CompactJob:
        """`job` for any layout, group by group (Python ints: cheaper than numpy on tiny arrays)."""
        sizes, limits = device.group_sizes.tolist(), self._device_limits
        if len(sizes) != len(limits):
            raise InvalidSpecError(f"DeviceBlocks has {len(sizes)} groups, the KV cache has {len(limits)}")
        bpc = self.blocks_per_chunk
        skips = [i % bpc for i in device.block_indices.tolist()]
        host_counts = [-(-(n + skip) // bpc) if n else 0 for n, skip in zip(sizes, skips)]
        host_ids = host.block_ids
        if sum(host_counts) != host_ids.size:
            raise InvalidSpecError(
                f"{host_ids.size} host block ids given, the device blocks need {sum(host_counts)} "
                f"(per group: {host_counts}, blocks_per_chunk={bpc})"
            )
        _check_range("host", host_ids, self.host_blocks, host_counts)
        store = direction is Direction.STORE
        blocks = np.empty((5, device.block_ids.size), dtype=np.int64)
        groups, shared, d0, c0, nbytes, items = [], {}, 0, 0, 0, 0
        for g, (n, skip, hc, limit) in enumerate(zip(sizes, skips, host_counts, limits)):
            if n == 0:
                continue
            out = blocks[:, d0 : d0 + n]
            out[0] = dev_ids = device.block_ids[d0 : d0 + n]
            _check_range("device", dev_ids, limit, group=g)
            group_hids = host_ids[c0 : c0 + hc]
            if bpc == 1:
                out[1] = np.arange(c0, c0 + n)
                out[2] = 0
                out[3] = group_hids
            else:  # the group's sub-pages, counted from its first host block
                q = np.arange(skip, skip + n)
                out[1] = c0 + q // bpc
                out[2] = q % bpc
                out[3] = group_hids[q // bpc] * bpc + out[2]
            out[4] = g
            if g in self._colliding:  # checked below, with the groups it may collide with
                shared[g] = out[3] if store else dev_ids
            elif store:
                _check_unique(group_hids, "host block id", self.host_blocks)
            else:
                _check_unique(dev_ids, "device block id", limit)
            items += n * int(self.group_entries[1, g])
            nbytes += self._nbytes(g, store, out[3])
            groups.append((g, d0, d0 + n, c0, c0 + hc, skip))
            d0, c0 = d0 + n, c0 + hc
        for gs in self._collisions if shared else ():
            keys = [shared[g] for g in gs if g in shared]
            if keys:  # a group's own duplicates too
                if store:
                    _check_unique(np.concatenate(keys), "host block", self.host_blocks * bpc, bpc)
                else:
                    _check_unique(np.concatenate(keys), "device block id", self.device_limit)
        return CompactJob(self, direction, blocks, host_ids, tuple(groups), nbytes, items)

    def _job_single(self, direction: Direction, device: DeviceBlocks, host: HostBlocks) -> CompactJob | None:
        """`job` for a layout of one group and one block per chunk, or None where the spec
        breaks a rule (the general path then names it) or moves nothing."""
        dev_ids, host_ids = device.block_ids, host.block_ids
        n = dev_ids.size
        if n == 0 or host_ids.size != n or device.group_sizes.size != 1:
            return None
        store = direction is Direction.STORE
        limit = self.device_limit  # of the one group
        if self.native is not None:
            if not self.native.single_check(dev_ids, host_ids, limit, self.host_blocks, not store):
                return None
        elif (
            any_outside(dev_ids, limit)
            or any_outside(host_ids, self.host_blocks)
            or (has_duplicates(host_ids, self.host_blocks) if store else has_duplicates(dev_ids, limit))
        ):
            return None
        groups = ((0, 0, n, 0, n, 0),)
        items = n * self.entries.shape[1]  # every entry is the one group's
        return CompactJob(self, direction, None, host_ids, groups, self._nbytes(0, store, host_ids), items, dev_ids)

    def _nbytes(self, group: int, store: bool, pages: np.ndarray) -> int:
        """Bytes that blocks of `group` copy, given their canonical page ids."""
        if not store or self._periods[group] == 1:
            return pages.size * self._entry_bytes[group]
        e0, count = self.group_entries[:, group].tolist()
        e = self.entries[:, e0 : e0 + count]
        return int(np.where(elected(pages[:, None], e[6], e[7]), e[5], 0).sum())

    def copies(self, job: CompactJob) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`job` as the copies a backend that copies on the host enqueues (`Backend.copy_batch`):
        ``(src, dst, sizes)`` in the job's direction, group by group, entry by entry, block by
        block; where a run of entries copies whole pages of one size, consecutive blocks whose
        pages follow each other on both sides go as one copy per entry.

        Computed once per job and kept with it: the queue holds a launched job until its copies
        have run, and so the arrays that `copy_batch` was handed.
        """
        found = job._copies
        if found is not None:
            return found
        store = job.direction is Direction.STORE
        dev_parts, host_parts, size_parts = [], [], []
        for g, b0, b1, *_ in job.groups:
            if job.simple:  # block i in chunk i, sub-page 0, page id = host id
                dev, chunks, sub, pages = job.dev_ids, job.host_ids, None, job.host_ids
            else:
                b = job.blocks[:, b0:b1]
                dev, chunks, sub, pages = b[0], job.host_ids[b[1]], b[2], b[3]
            rows = chunks * self.row_bytes
            for lo, hi, page in self._runs_of_entries[g]:
                if page:
                    dev_off = dev * page
                    host_off = rows if sub is None else rows + sub * page
                    sizes = None  # page, for every copy
                    # Consecutive blocks continue each other on the host only within a chunk, or
                    # where a row is one page: the run decision on the blocks, once for all entries.
                    if dev.size > 1 and (sub is not None or page == self.row_bytes):
                        starts = run_starts((dev_off, host_off), page)
                        if starts.size < dev_off.size:
                            sizes = np.diff(np.append(starts, dev_off.size)) * page
                            dev_off, host_off = dev_off[starts], host_off[starts]
                    d = np.add.outer(self._dev_entry[lo:hi], dev_off).ravel()
                    h = np.add.outer(self._host_entry[lo:hi], host_off).ravel()
                    size = np.full(d.size, page) if sizes is None else np.tile(sizes, hi - lo)
                else:
                    e = self.entries[:, lo:hi]
                    d = np.multiply.outer(e[1], dev) + self._dev_entry[lo:hi, None]
                    h = (rows if sub is None else rows + np.multiply.outer(e[4], sub)) + self._host_entry[lo:hi, None]
                    size = np.broadcast_to(e[5][:, None], d.shape)
                    if store and self._periods[g] > 1:
                        mine = elected(pages[None, :], e[6][:, None], e[7][:, None])
                        d, h, size = d[mine], h[mine], size[mine]
                    d, h, size = d.ravel(), h.ravel(), size.ravel()
                dev_parts.append(d)
                host_parts.append(h)
                size_parts.append(size)
        dev, host, sizes = (_concat(p) for p in (dev_parts, host_parts, size_parts))
        found = job._copies = (dev, host, sizes) if store else (host, dev, sizes)
        return found

    def segments(self, job: CompactJob) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The host bytes `job` touches, as contiguous ranges, for staging that mirrors host rows;
        computed once per job.

        Returns:
            ``(stage, host, sizes)``: per range, its offset in the staging buffer (chunk ``j``
            at ``j * row_bytes``), its offset from `host_base`, and its length; in staging order,
            ranges that continue each other on both sides merged into one.
        """
        if job._segments is None:
            job._segments = self._segments_of(job)
        return job._segments

    def _segments_of(self, job: CompactJob) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        row, bpc = self.row_bytes, self.blocks_per_chunk
        store = job.direction is Direction.STORE
        host_ids = job.host_ids
        g = job.groups[0][0] if job.groups else 0
        if job.groups and bpc == 1 and all(grp[0] == g for grp in job.groups):  # the common case, in a few numpy calls
            c0, c1 = job.groups[0][3], job.groups[-1][4]  # one group: its chunks follow each other
            starts, lengths = self._template(g, 0, 0, 0, store)
            if starts.size == 1 and (not store or self._periods[g] == 1):
                a, n = int(starts[0]), int(lengths[0])
                if n == row:  # whole rows: a run of consecutive host blocks is one range
                    hosts = host_ids[c0:c1]
                    if self.native is not None and hosts.size and self.native.row_runs(hosts, 0)[0] == hosts.size:
                        # no two rows continue each other (what scattered host blocks give): one range each
                        stage = np.arange(c0 * row, c1 * row, row, dtype=np.int64)
                        return stage, hosts * row, np.full(hosts.size, row, np.int64)
                    first = run_starts((hosts,), 1)
                    sizes = np.diff(np.append(first, hosts.size)) * row
                    return (first + c0) * row, hosts[first] * row, sizes
                stage = np.arange(c0 * row + a, c1 * row + a, row, dtype=np.int64)
                return stage, host_ids[c0:c1] * row + a, np.full(stage.size, n, dtype=np.int64)
        pieces = []  # (chunk positions, template starts, template lengths)
        for g, b0, b1, c0, c1, skip in job.groups:
            period = self._periods[g] if store else 1
            last = (skip + (b1 - b0) - 1) % bpc
            if bpc == 1 and period == 1:
                starts, lengths = self._template(g, 0, 0, 0, store)
                pieces.append((np.arange(c0, c1), starts, lengths))
                continue
            residue = (host_ids[c0:c1] * bpc) % period
            for j in (c0, c1 - 1) if c1 - c0 > 1 else (c0,):
                s0 = skip if j == c0 else 0
                s1 = last if j == c1 - 1 else bpc - 1
                pieces.append((np.array([j]), *self._template(g, s0, s1, int(residue[j - c0]), store)))
            if c1 - c0 > 2:
                middle = residue[1:-1]
                for r in np.unique(middle).tolist():
                    chunks = c0 + 1 + np.flatnonzero(middle == r)
                    pieces.append((chunks, *self._template(g, 0, bpc - 1, r, store)))
        stage_parts, host_parts, size_parts = [], [], []
        for chunks, starts, lengths in pieces:
            if starts.size:
                stage_parts.append((chunks[:, None] * row + starts).ravel())
                host_parts.append((host_ids[chunks][:, None] * row + starts).ravel())
                size_parts.append(np.broadcast_to(lengths, (chunks.size, lengths.size)).ravel())
        stage, host, sizes = (_concat(p) for p in (stage_parts, host_parts, size_parts))
        if len(stage_parts) > 1:
            order = np.argsort(stage, kind="stable")
            stage, host, sizes = stage[order], host[order], sizes[order]
        return merge_runs((stage, host), sizes)

    def segment_summary(self, job: CompactJob, small_limit: int) -> tuple[int, int]:
        """How many ranges `segments` returns, and the bytes of those of at most `small_limit`
        bytes; where no range of a host row can continue into the next, from the row templates
        alone (no pass over the job's copies)."""
        row, store, groups = self.row_bytes, job.direction is Direction.STORE, job.groups
        if groups and self.blocks_per_chunk == 1 and all(grp[0] == groups[0][0] for grp in groups):
            g, c0, c1 = groups[0][0], groups[0][3], groups[-1][4]
            period = self._periods[g] if store else 1
            if period == 1:
                uses = {0: c1 - c0}
            else:
                counts = np.bincount(job.host_ids[c0:c1] % period, minlength=period)
                uses = {r: n for r, n in enumerate(counts.tolist()) if n}
            templates = [(n, *self._template(g, 0, 0, r, store)) for r, n in uses.items()]
            if len(templates) == 1 and templates[0][1].size == 1 and templates[0][2][0] == row:
                return _row_runs(job.host_ids[c0:c1], row, small_limit, self.native)
            starts_at_0 = any(s.size and s[0] == 0 for _, s, _ in templates)
            ends_at_row = any(s.size and s[-1] + lengths[-1] == row for _, s, lengths in templates)
            if not (starts_at_0 and ends_at_row):
                count = sum(n * s.size for n, s, _ in templates)
                small = sum(n * int(lengths[lengths <= small_limit].sum()) for n, _, lengths in templates)
                return count, small
        sizes = self.segments(job)[2]
        return sizes.size, int(sizes[sizes <= small_limit].sum())

    def whole_rows(self, direction: Direction) -> bool:
        """Whether each block of a simple job covers its whole host row in `direction`: its
        `segments` are then the runs of consecutive host blocks."""
        store = direction is Direction.STORE
        if not self.simple_jobs or (store and self._periods[0] != 1):
            return False
        starts, lengths = self._template(0, 0, 0, 0, store)
        return starts.size == 1 and int(lengths[0]) == self.row_bytes

    def _template(self, group: int, s0: int, s1: int, residue: int, store: bool) -> tuple[np.ndarray, np.ndarray]:
        """The ranges of a host row that a chunk of `group` touches through sub-pages s0..s1,
        where its first page's id is `residue` modulo the group's election period: sorted,
        touching ranges merged. Cached: a worker's jobs use a handful."""
        key = (group, s0, s1, residue, store)
        found = self._templates.get(key)
        if found is not None:
            return found
        e0, count = self.group_entries[:, group].tolist()
        e = self.entries[:, e0 : e0 + count]
        subs = np.arange(s0, s1 + 1)
        starts = (e[3][None, :] + subs[:, None] * e[4][None, :]).ravel()
        lengths = np.broadcast_to(e[5], (subs.size, count)).ravel()
        if store:
            mine = elected((residue + subs)[:, None], e[6][None, :], e[7][None, :]).ravel()
            starts, lengths = starts[mine], lengths[mine]
        order = np.argsort(starts, kind="stable")
        merged: list[list[int]] = []
        for a, n in zip(starts[order].tolist(), lengths[order].tolist()):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], a + n)
            else:
                merged.append([a, a + n])
        found = (np.array([a for a, _ in merged], np.int64), np.array([b - a for a, b in merged], np.int64))
        self._templates[key] = found
        return found


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _row_runs(hosts: np.ndarray, row: int, small_limit: int, compiled=None) -> tuple[int, int]:
    """`CompactLayout.segment_summary` where every chunk covers its whole row."""
    if compiled is not None and hosts.size:
        runs, rows = compiled.row_runs(hosts, int(small_limit) // row)  # a cost model's limit may be a float
        return runs, rows * row
    first = run_starts((hosts,), 1)
    lengths = np.diff(first, append=hosts.size)  # rows per run
    return first.size, int(lengths[lengths <= small_limit // row].sum()) * row


_FEW = 64  # up to this many ids, Python's min, max and set beat numpy's per-call overhead (4x at 16)


def any_outside(ids: np.ndarray, limit: int) -> bool:
    """Whether any id is negative or not below `limit` (a negative int64 read as uint64 is
    larger than any limit)."""
    if ids.size <= _FEW:
        few = ids.tolist()
        return bool(few) and (min(few) < 0 or max(few) >= limit)
    return bool((ids.view(np.uint64) >= limit).any())


def _check_range(side: str, ids: np.ndarray, limit: int, counts: list[int] | None = None, group: int = 0) -> None:
    """Refuse an id outside ``[0, limit)``, naming the first, its group and its position there: `ids`
    are group `group`'s, or, given `counts`, consecutive groups' of those many ids each."""
    if any_outside(ids, limit):
        bad = np.flatnonzero((ids < 0) | (ids >= limit))
        at = int(bad[0])
        for g, n in enumerate(counts or ()):  # the group of position `at`, and `at` within it
            if at < n:
                group = g
                break
            at -= n
        also = f"; {bad.size - 1} more out of range" if bad.size > 1 else ""
        raise InvalidSpecError(
            f"{side} block id {int(ids[bad[0]])} out of range [0, {limit}): position {at} of group {group}'s "
            f"{side} block ids{also}"
        )


def _check_unique(ids: np.ndarray, side: str, limit: int, per: int = 1) -> None:
    """Two copies into the same destination would race: reject them (ids lie in ``[0, limit)``;
    `per` sub-pages to a host block where ids are sub-pages)."""
    if has_duplicates(ids, limit):
        s = np.sort(ids)
        k = int(s[1:][s[1:] == s[:-1]][0])
        what = f"{side} {k}" if per == 1 else f"{side} {k // per} (sub-page {k % per} of it)"
        raise InvalidSpecError(f"{what} is the destination of two copies in one transfer")


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
