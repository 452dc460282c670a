"""The canonical (tensor-parallel-independent) host layout: a `CanonicalPageMapping` places one
rank's page in the page the model would have unsharded. Ranks that hold the same bytes (MLA
latents, KV heads replicated when TP exceeds their number) take turns writing them (`elected`);
`verify_tiling` certifies that the ranks together write every canonical byte exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from offload_core.errors import InvalidSpecError, integer, positive_int
from offload_core.runs import merge_runs

MAX_FRAGMENTS = 1 << 22  # fragments of one mapping: far more than any page has (a head per token)
MAX_PAGE = 1 << 48  # bytes of a page, either side: any offset within it stays far inside int64


@dataclass(frozen=True)
class CopyRun:
    """Fragment i covers local bytes ``[local_offset + i*local_stride, +fragment_size)`` and canonical
    bytes ``[canonical_offset + i*canonical_stride, +fragment_size)``."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int = 1
    local_stride: int = 0
    canonical_stride: int = 0

    def __post_init__(self) -> None:
        for name in ("local_offset", "canonical_offset", "local_stride", "canonical_stride"):
            object.__setattr__(self, name, integer(getattr(self, name), f"CopyRun.{name}"))
        for name in ("fragment_size", "num_fragments"):
            object.__setattr__(self, name, positive_int(getattr(self, name), f"CopyRun.{name}"))


@dataclass(frozen=True)
class CanonicalPageMapping:
    """One rank's page, placed into the canonical page.

    Args:
        canonical_page_size_bytes: bytes of the unsharded page.
        local_page_size_bytes: bytes of this rank's page (what its KVCacheRef copies).
        runs: the correspondence; it must cover the local page exactly once and stay inside
            the canonical page. Adjacent runs are merged.
        num_writers: how many ranks hold these bytes.
        writer_index: this rank's turn among them.

    Raises:
        InvalidSpecError: runs that leave local bytes uncovered, cover some twice, place two on
            one canonical byte, or leave the canonical page; a writer index out of range.
    """

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int = 1
    writer_index: int = 0
    fragments: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("canonical_page_size_bytes", "local_page_size_bytes", "num_writers"):
            object.__setattr__(self, name, positive_int(getattr(self, name), f"CanonicalPageMapping.{name}"))
        object.__setattr__(self, "writer_index", integer(self.writer_index, "CanonicalPageMapping.writer_index"))
        if not 0 <= self.writer_index < self.num_writers:
            raise InvalidSpecError(f"writer_index {self.writer_index} is not in [0, {self.num_writers})")
        if isinstance(self.runs, (str, bytes)) or not isinstance(self.runs, Iterable):
            raise InvalidSpecError(f"runs must be a sequence of CopyRun, got {self.runs!r}")
        object.__setattr__(self, "runs", tuple(self.runs))
        if not all(isinstance(r, CopyRun) for r in self.runs):
            raise InvalidSpecError("runs must be CopyRun objects")
        # checked on the counts before anything is unrolled, to bound the unrolling
        if sum(r.fragment_size * r.num_fragments for r in self.runs) != self.local_page_size_bytes:
            raise InvalidSpecError("runs must cover the local page exactly once")
        for name in ("canonical_page_size_bytes", "local_page_size_bytes"):
            if getattr(self, name) > MAX_PAGE:
                raise InvalidSpecError(f"{name} {getattr(self, name)} is beyond any page (at most {MAX_PAGE} bytes)")
        fragments = sum(r.num_fragments for r in self.runs)
        if fragments > MAX_FRAGMENTS:
            raise InvalidSpecError(f"a mapping of {fragments} fragments: at most {MAX_FRAGMENTS} are taken")
        for r in self.runs:  # in Python's integers, so that nothing wraps around in int64 below
            for first, stride, page, side in (
                (r.local_offset, r.local_stride, self.local_page_size_bytes, "local"),
                (r.canonical_offset, r.canonical_stride, self.canonical_page_size_bytes, "canonical"),
            ):
                last = first + (r.num_fragments - 1) * stride
                if min(first, last) < 0 or max(first, last) + r.fragment_size > page:
                    raise InvalidSpecError(f"{r} leaves the {side} page of {page} bytes")
        local, canon, sizes = _unroll(self.runs)
        if _coverage(local, sizes, self.local_page_size_bytes).tolist() != [1]:
            raise InvalidSpecError("runs must cover the local page exactly once")
        if _coverage(canon, sizes, self.canonical_page_size_bytes).max() > 1:
            raise InvalidSpecError("runs must place no two local bytes on one canonical byte")
        merged = _joined(local, canon, sizes)
        object.__setattr__(self, "runs", _as_runs(*merged))
        object.__setattr__(self, "fragments", merged)

    def is_writer(self, page_ids):
        """Whether this rank writes canonical page `page_ids` (global host page ids: an int,
        or an array, answered element by element)."""
        return elected(page_ids, self.num_writers, self.writer_index)


def elected(page_ids, num_writers, writer_index):
    """The election: page ``p`` is written by the rank whose ``writer_index == p % num_writers``
    (over any arguments that broadcast)."""
    return page_ids % num_writers == writer_index


def _unroll(runs: Iterable[CopyRun]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    local, canon, sizes = [], [], []
    for r in runs:
        i = np.arange(r.num_fragments, dtype=np.int64)
        local.append(r.local_offset + i * r.local_stride)
        canon.append(r.canonical_offset + i * r.canonical_stride)
        sizes.append(np.full(r.num_fragments, r.fragment_size, dtype=np.int64))
    return np.concatenate(local), np.concatenate(canon), np.concatenate(sizes)


def _coverage(starts: np.ndarray, sizes: np.ndarray, length: int) -> np.ndarray:
    """Distinct counts of how often each byte of ``[0, length)`` is covered by fragments inside
    it, from the fragments' ends alone (no array as long as the page)."""
    points, where = np.unique(np.concatenate([starts, starts + sizes, [0, length]]), return_inverse=True)
    steps = np.zeros(points.size, dtype=np.int64)
    np.add.at(steps, where, np.concatenate([np.ones(starts.size, np.int64), -np.ones(starts.size, np.int64), [0, 0]]))
    counts = np.cumsum(steps)[:-1]  # over [points[i], points[i + 1]), each of positive length
    return np.unique(counts)


def _joined(local, canon, sizes):
    """The fragments in local order, those that continue each other on both sides joined."""
    order = np.argsort(local, kind="stable")
    return merge_runs((local[order], canon[order]), sizes[order])


def _as_runs(local, canon, sizes) -> tuple[CopyRun, ...]:
    """Fragments as strided runs: equal sizes at constant strides on both sides become one run."""
    runs, i, n = [], 0, sizes.size
    while i < n:
        j, ls, cs = i + 1, 0, 0
        if j < n and sizes[j] == sizes[i]:
            ls, cs = local[j] - local[i], canon[j] - canon[i]
            while j < n and sizes[j] == sizes[i] and local[j] - local[j - 1] == ls and canon[j] - canon[j - 1] == cs:
                j += 1
        runs.append(CopyRun(int(local[i]), int(canon[i]), int(sizes[i]), j - i, int(ls), int(cs)))
        i = j
    return tuple(runs)


def verify_tiling(mappings: Sequence[CanonicalPageMapping]) -> None:
    """Check that the ranks' mappings of one tensor write every canonical byte exactly once,
    for every page (every election residue), and agree on the canonical page.

    Raises:
        InvalidSpecError: naming the residue and what is wrong.
    """
    if isinstance(mappings, (str, bytes)) or not isinstance(mappings, Sequence):
        raise InvalidSpecError(f"verify_tiling takes a sequence of CanonicalPageMapping, got {type(mappings).__name__}")
    if not all(isinstance(m, CanonicalPageMapping) for m in mappings):
        raise InvalidSpecError("verify_tiling takes CanonicalPageMapping objects only")
    if not mappings:
        raise InvalidSpecError("no mappings to verify")
    size = mappings[0].canonical_page_size_bytes
    if any(m.canonical_page_size_bytes != size for m in mappings):
        raise InvalidSpecError("ranks disagree on the canonical page size")
    period = int(np.lcm.reduce([m.num_writers for m in mappings]))
    for page in range(period):
        writers = [m for m in mappings if m.is_writer(page)]
        if not writers:
            raise InvalidSpecError(f"no rank writes canonical pages {page} mod {period}")
        canon = np.concatenate([m.fragments[1] for m in writers])
        sizes = np.concatenate([m.fragments[2] for m in writers])
        counts = _coverage(canon, sizes, size).tolist()
        if counts != [1]:
            raise InvalidSpecError(
                f"pages {page} mod {period}: the writers cover canonical bytes {counts} times, not exactly once"
            )


MAX_PAGE_SLOTS = 1 << 24  # (kv, token, head) slots of one page that `attention_mappings` lays out


def attention_mappings(
    *, total_kv_heads: int, tp_size: int, block_tokens: int, head_bytes: int, order: str = "NHD", kv: str | None = None
) -> list[CanonicalPageMapping]:
    """Mappings of every TP rank for a GQA/MHA KV tensor whose heads are sharded over TP.

    With ``tp_size > total_kv_heads`` each head is replicated on ``tp_size / total_kv_heads``
    ranks, which take turns writing it.

    Args:
        total_kv_heads: KV heads of the unsharded model.
        tp_size: tensor-parallel ranks.
        block_tokens: tokens per block.
        head_bytes: bytes of one head of one token (head_dim x dtype size).
        order: ``"NHD"`` (token, head, dim) or ``"HND"`` (head, token, dim) within a page.
        kv: None (the tensor holds K or V only), ``"split"`` (K half then V half, each in
            `order`) or ``"packed"`` (per token, K heads then V heads; NHD only).

    Returns:
        One mapping per rank, certified by `verify_tiling`.

    Raises:
        InvalidSpecError: a layout these helpers do not know, heads that do not divide, a
            count or size that is not a positive integer, or a page of more than
            `MAX_PAGE_SLOTS` head slots.
    """
    total_kv_heads, tp_size = positive_int(total_kv_heads, "total_kv_heads"), positive_int(tp_size, "tp_size")
    block_tokens, head_bytes = positive_int(block_tokens, "block_tokens"), positive_int(head_bytes, "head_bytes")
    if order not in ("NHD", "HND") or kv not in (None, "split", "packed") or (kv == "packed" and order != "NHD"):
        raise InvalidSpecError(f"unknown attention page layout: order={order!r}, kv={kv!r}")
    if tp_size % total_kv_heads and total_kv_heads % tp_size:
        raise InvalidSpecError(f"{total_kv_heads} KV heads do not divide over TP={tp_size} (or the reverse)")
    halves = 1 if kv is None else 2
    slots = halves * block_tokens * total_kv_heads
    if slots > MAX_PAGE_SLOTS:  # each slot is a few int64 arrays' worth of memory here
        raise InvalidSpecError(
            f"a page of {block_tokens} tokens x {total_kv_heads} KV heads has {slots} head slots, "
            f"more than the {MAX_PAGE_SLOTS} a mapping is built for"
        )
    shards = min(tp_size, total_kv_heads)
    replication = tp_size // shards
    local_heads = total_kv_heads // shards

    def offsets(heads: int) -> np.ndarray:
        """Byte offsets of (kv, token, head) in a page holding `heads` heads, as an array [kv, t, h]."""
        k, t, h = np.meshgrid(np.arange(halves), np.arange(block_tokens), np.arange(heads), indexing="ij")
        if kv == "packed":  # token-major, then K heads, then V heads
            slot = (t * halves + k) * heads + h
        elif order == "NHD":
            slot = k * block_tokens * heads + t * heads + h
        else:
            slot = k * block_tokens * heads + h * block_tokens + t
        return slot * head_bytes

    canonical, local = offsets(total_kv_heads), offsets(local_heads)
    canonical_page, local_page = int(canonical.size * head_bytes), int(local.size * head_bytes)
    out = []
    for rank in range(tp_size):
        shard = rank // replication
        canon = canonical[:, :, shard * local_heads : (shard + 1) * local_heads]
        runs = _as_runs(*_joined(local.ravel(), canon.ravel(), np.full(local.size, head_bytes, dtype=np.int64)))
        out.append(CanonicalPageMapping(canonical_page, local_page, runs, replication, rank % replication))
    verify_tiling(out)
    return out


def replicated_mappings(*, page_size_bytes: int, tp_size: int) -> list[CanonicalPageMapping]:
    """Mappings of every TP rank for a page of `page_size_bytes` every rank holds whole (an MLA
    latent): one copy, the ranks taking turns to write it."""
    page = page_size_bytes
    out = [
        CanonicalPageMapping(page, page, (CopyRun(0, 0, page),), num_writers=tp_size, writer_index=r)
        for r in range(tp_size)
    ]
    verify_tiling(out)
    return out
