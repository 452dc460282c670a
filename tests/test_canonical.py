"""The canonical host layout: mappings, writer rotation, ranks of different TP sizes sharing a region."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
import tp_ranks as tp
from helpers import host_copies
from hypothesis import given
from hypothesis import strategies as st
from tp_ranks import BLOCKS, full_model, latent_kv, rank_kv, region

from offload_core import (
    CanonicalPageMapping,
    CopyRun,
    DeviceBlocks,
    Direction,
    HostBlocks,
    InvalidSpecError,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadWorker,
    SharedHostRegion,
    verify_tiling,
)
from offload_core.canonical import attention_mappings, replicated_mappings

# ---- mappings ---------------------------------------------------------------


def test_vllm_example_four_heads_at_tp2():
    """4 tokens x 4 heads of 64 B, K and V halves: rank r copies 8 fragments of 128 B."""
    maps = attention_mappings(total_kv_heads=4, tp_size=2, block_tokens=4, head_bytes=64, kv="split")
    for rank, m in enumerate(maps):
        assert (m.canonical_page_size_bytes, m.local_page_size_bytes, m.num_writers) == (2048, 1024, 1)
        local, canon, sizes = m.fragments
        assert sizes.tolist() == [128] * 8
        assert canon.tolist() == [rank * 128 + 256 * i for i in range(8)]


@pytest.mark.parametrize(
    "runs, message",
    [
        ((CopyRun(0, 0, 32),), "exactly once"),  # leaves local bytes uncovered
        ((CopyRun(0, 0, 64), CopyRun(32, 64, 32)), "exactly once"),  # covers some twice
        ((CopyRun(0, 100, 64),), "leaves the canonical page"),
        ((CopyRun(0, 0, 32), CopyRun(32, 16, 32)), "no two local bytes on one canonical byte"),  # a store writes twice
        ((CopyRun(0, 0, 16, 2**62),), "exactly once"),  # refused before 2**62 fragments are unrolled
        (None, "sequence of CopyRun"),
        (5, "sequence of CopyRun"),
        (((0, 0, 64),), "CopyRun objects"),
    ],
)
def test_invalid_mappings(runs, message):
    with pytest.raises(InvalidSpecError, match=message):
        CanonicalPageMapping(128, 64, runs)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: CopyRun(0, 0, 0), "fragment_size must be a positive integer, got 0"),
        (lambda: CopyRun(0.0, 0, 64), "local_offset must be an integer, got 0.0"),
        (lambda: CopyRun(0, 0, 64.0), "fragment_size must be a positive integer, got 64.0"),
        (lambda: CopyRun(0, 0, "64"), "fragment_size must be a positive integer"),
        (
            lambda: CanonicalPageMapping(64.5, 64, [CopyRun(0, 0, 64)]),
            "canonical_page_size_bytes must be a positive integer, got 64.5",
        ),
        (
            lambda: CanonicalPageMapping(64, 64.0, [CopyRun(0, 0, 64)]),
            "local_page_size_bytes must be a positive integer",
        ),
        (
            lambda: CanonicalPageMapping(64, 64, [CopyRun(0, 0, 64)], num_writers=0),
            "num_writers must be a positive integer",
        ),
    ],
)
def test_mapping_sizes_must_be_integers(make, message):
    with pytest.raises(InvalidSpecError, match=message):
        make()


def test_adjacent_runs_are_merged_and_writers_rotate():
    m = CanonicalPageMapping(256, 64, (CopyRun(32, 96, 32), CopyRun(0, 64, 32)), num_writers=3, writer_index=1)
    assert m.runs == (CopyRun(0, 64, 64),)
    assert [p for p in range(9) if m.is_writer(p)] == [1, 4, 7]
    with pytest.raises(InvalidSpecError, match="writer_index"):
        CanonicalPageMapping(64, 64, (CopyRun(0, 0, 64),), num_writers=2, writer_index=2)


def test_tiling_rejects_gaps_and_double_writes():
    a, b = (CanonicalPageMapping(128, 64, (CopyRun(0, r * 64, 64),)) for r in range(2))  # side by side
    verify_tiling([a, b])
    with pytest.raises(InvalidSpecError, match="not exactly once"):
        verify_tiling([a])
    with pytest.raises(InvalidSpecError, match="not exactly once"):
        verify_tiling([a, a, b])


@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(1, 5),
    head_bytes=st.sampled_from([2, 16, 64]),
    layout=st.sampled_from([("NHD", None), ("HND", None), ("NHD", "split"), ("HND", "split"), ("NHD", "packed")]),
)
def test_attention_mappings_tile_for_every_layout(heads, tp, tokens, head_bytes, layout):
    order, kv = layout
    maps = attention_mappings(
        total_kv_heads=heads, tp_size=tp, block_tokens=tokens, head_bytes=head_bytes, order=order, kv=kv
    )
    assert len(maps) == tp
    assert {m.num_writers for m in maps} == {max(1, tp // heads)}
    halves = 2 if kv else 1
    assert maps[0].canonical_page_size_bytes == halves * tokens * heads * head_bytes
    verify_tiling(maps)  # also checked inside; here as the property


# ---- ranks sharing a canonical region -----------------------------------------


def store_all(backend, tp_size, full, name, directory, dev_ids, host_ids, bpc, num_host, block_index=0):
    """Every rank of TP=`tp_size` stores the same blocks into the shared region."""
    regions = [region(name, full, bpc, num_host, directory, r) for r in range(tp_size)]
    for r in range(tp_size):
        with OffloadWorker(
            rank_kv(full, tp_size, r, device=backend.device),
            num_host,
            blocks_per_chunk=bpc,
            backend=backend,
            canonical_layout=True,
            host_region=regions[r],
        ) as w:
            assert w.submit_store(1, DeviceBlocks(dev_ids, block_indices=[block_index]), HostBlocks(host_ids))
            w.wait([1])
            assert all(x.success for x in w.get_finished())
    return regions


def load_all(backend, tp_size, full, regions, dev_ids, host_ids, bpc, num_host, block_index=0):
    """Every rank of TP=`tp_size` loads the blocks into fresh device blocks; returns their shards."""
    loaded = []
    for r in range(tp_size):
        kv = rank_kv(full, tp_size, r, empty=True, device=backend.device)
        with OffloadWorker(
            kv,
            num_host,
            blocks_per_chunk=bpc,
            backend=backend,
            canonical_layout=True,
            host_region=regions[r % len(regions)],
        ) as w:
            assert w.submit_load(2, HostBlocks(host_ids), DeviceBlocks(dev_ids, block_indices=[block_index]))
            w.wait([2])
        loaded.append(kv)
    return loaded


@pytest.mark.parametrize("a, b", [(2, 4), (4, 2), (2, 1), (4, 4), (1, 2)])
@pytest.mark.parametrize("heads", [4, 2])
def test_blocks_stored_at_one_tp_size_load_at_another(backend, tmp_path, a, b, heads):
    full = full_model(heads)
    bpc, num_host = 2, 8
    src, dst, hosts = [1, 4, 5, 7], [9, 2, 3, 0], [6, 2, 3]  # starts mid-chunk: block index 1
    regions = store_all(backend, a, full, f"x{a}{b}{heads}", tmp_path, src, hosts, bpc, num_host, block_index=1)
    try:
        # the canonical page of tensor t in host block h, sub-page j, is the unsharded page
        rows = regions[0].tensor.numpy().copy()  # a view would keep the region from closing
        page = full[0][0].nbytes
        for block, q in zip(src, range(1, 5)):
            h, j = hosts[q // bpc], q % bpc
            for t, f in enumerate(full):
                start = t * page * bpc + j * page
                np.testing.assert_array_equal(rows[h, start : start + page], f[block].ravel())
        for rank, kv in enumerate(load_all(backend, b, full, regions, dst, hosts, bpc, num_host, block_index=1)):
            expected = rank_kv(full, b, rank)
            for t, e in zip(kv.tensors, expected.tensors):
                got = t.tensor.cpu()
                assert torch.equal(got[dst], e.tensor[src])
                untouched = [i for i in range(BLOCKS) if i not in dst]
                assert not got[untouched].any()
    finally:
        for r in reversed(regions):
            r.close()


@pytest.mark.parametrize("tp_size, heads", [(4, 2), (8, 2), (4, 1)])
def test_replicated_heads_are_written_exactly_once(tmp_path, tp_size, heads):
    full = full_model(heads)
    bpc, num_host = 2, 6
    regions = [region("rot", full, bpc, num_host, tmp_path, r) for r in range(tp_size)]
    try:
        dev_ids, host_ids = np.arange(10), np.arange(5)
        writes = np.zeros(regions[0].tensor.numel(), dtype=np.int64)
        for r in range(tp_size):
            base = regions[r].tensor.data_ptr()  # each rank maps the file at its own address
            with OffloadWorker(
                rank_kv(full, tp_size, r),
                num_host,
                blocks_per_chunk=bpc,
                backend="cpu",
                canonical_layout=True,
                host_region=regions[r],
            ) as w:
                batch = host_copies(w._layout, Direction.STORE, DeviceBlocks(dev_ids), HostBlocks(host_ids))
                for d, n in zip((batch.dst - base).tolist(), batch.sizes.tolist()):
                    writes[d : d + n] += 1
        stored = writes.reshape(num_host, -1)[host_ids, : tp.row_bytes(full, bpc)]
        assert (stored == 1).all()
    finally:
        for r in reversed(regions):
            r.close()


def test_mla_latent_is_stored_once_and_read_by_any_rank(backend, tmp_path):
    latent = np.random.default_rng(3).integers(0, 256, (BLOCKS, 64), dtype=np.uint8)
    num_host = 6
    with SharedHostRegion("mla", num_blocks=num_host, canonical_bytes=64, directory=tmp_path) as reg:
        moved = []
        for rank in range(2):
            with OffloadWorker(
                latent_kv(latent, 2, rank, device=backend.device),
                num_host,
                backend=backend,
                canonical_layout=True,
                host_region=reg,
            ) as w:
                w.submit_store(1, DeviceBlocks([0, 1, 2, 3]), HostBlocks([0, 1, 2, 3]))
                w.wait([1])
                moved.append(w.get_finished()[0].transfer_size)
        assert moved == [128, 128]  # each rank wrote two of the four pages
        reader = latent_kv(latent, 1, 0, empty=True, device=backend.device)
        with OffloadWorker(reader, num_host, backend=backend, canonical_layout=True, host_region=reg) as w:
            w.submit_load(2, HostBlocks([0, 1, 2, 3]), DeviceBlocks([8, 9, 10, 11]))
            w.wait([2])
        assert torch.equal(reader.tensors[0].tensor[8:12].cpu(), torch.from_numpy(latent[0:4]))


def test_private_host_memory_uses_the_canonical_page_too():
    full = full_model(4)
    kv = rank_kv(full, 2, 1)
    with OffloadWorker(kv, 4, backend="cpu", canonical_layout=True) as w:
        assert [h.shape for h in w.host_tensors] == [(4, full[0][0].nbytes)] * len(full)
        w.submit_store(1, DeviceBlocks([3]), HostBlocks([1]))
        w.wait([1])
        rows = w.host_tensors[0].view(torch.uint8).numpy()[1].reshape(tp.TOKENS, 4, tp.HEAD_BYTES)
        np.testing.assert_array_equal(rows[:, 2:], full[0][3][:, 2:])  # rank 1 holds heads 2 and 3
        assert not rows[:, :2].any()


def test_private_host_memory_keeps_every_page_a_rank_holds_alike_with_others():
    """Ranks holding the same bytes (an MLA latent) take turns writing a shared region's pages;
    in a rank's private memory nobody else writes them: it stores every page itself."""
    latent = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (8, 64), dtype=np.uint8))
    mapping = replicated_mappings(page_size_bytes=64, tp_size=2)[1]  # rank 1 of two
    kv = KVCaches([KVCacheTensor(latent, 64)], [[KVCacheRef(0, 64, mapping=mapping)]])
    with OffloadWorker(kv, 4, backend="cpu", canonical_layout=True) as w:
        w.submit_store(1, DeviceBlocks([0, 1, 2, 3]), HostBlocks([0, 1, 2, 3]))
        w.submit_load(2, HostBlocks([0, 1, 2, 3]), DeviceBlocks([4, 5, 6, 7]))
        w.wait([1, 2])
        assert [(r.success, r.transfer_size) for r in w.get_finished()] == [(True, 256), (True, 256)]
        assert torch.equal(latent[4:], latent[:4])


# ---- workers on a shared region (the region on its own: test_region.py) ---------------------


def test_worker_checks_the_region_layout(tmp_path):
    with SharedHostRegion("e", num_blocks=4, slot_bytes=[100, 200], rank=1, directory=tmp_path) as reg:
        kv = rank_kv(full_model(2), 1, 0)
        with pytest.raises(InvalidSpecError, match="too small"):
            OffloadWorker(kv, 4, backend="cpu", host_region=reg)
        with pytest.raises(InvalidSpecError, match="holds the direct layout, the worker uses the canonical"):
            OffloadWorker(kv, 4, backend="cpu", canonical_layout=True, host_region=reg)
        with pytest.raises(InvalidSpecError, match="host blocks"):
            OffloadWorker(kv, 3, backend="cpu", host_region=reg)


def test_workers_sharing_a_region_share_its_registration(tmp_path):
    """The first worker on a region registers it, the last to shut down unregisters it: a worker
    that shuts down first must not unpin memory another one's copies still read."""
    from offload_core.backends.cpu import CpuBackend

    class Pinning(CpuBackend):
        def __init__(self):
            super().__init__()
            self.calls, self.pinned = [], False

        def pin_host_memory(self, tensor):
            self.calls.append("pin")
            self.pinned = True
            return True

        def unpin_host_memory(self, tensor):
            self.calls.append("unpin")
            self.pinned = False

    full = full_model(2)
    row = tp.row_bytes(full, 1)
    backend = Pinning()
    with SharedHostRegion("p", num_blocks=4, slot_bytes=[row], rank=0, directory=tmp_path) as reg:
        a = OffloadWorker(rank_kv(full, 1, 0), 4, backend=backend, host_region=reg)
        b = OffloadWorker(rank_kv(full, 1, 0), 4, backend=backend, host_region=reg)
        a.shutdown()
        assert backend.pinned and backend.calls == ["pin"], "unpinned under the other worker"
        assert b.submit_store(1, DeviceBlocks([2]), HostBlocks([1]))
        b.wait([1])
        b.shutdown()
        assert not backend.pinned and backend.calls == ["pin", "unpin"]
        c = OffloadWorker(rank_kv(full, 1, 0), 4, backend=backend, host_region=reg)  # pinned afresh
        del c
        assert backend.calls == ["pin", "unpin", "pin", "unpin"]


def test_a_collection_inside_a_registration_may_drop_another_regions_worker(tmp_path):
    """The registration count's lock is held while the backend pins: a garbage collection there
    that finalizes a dropped worker of another region (which unpins it) must not hang."""
    import gc
    import threading

    from offload_core.backends.cpu import CpuBackend

    class CollectingPins(CpuBackend):
        collect = False

        def pin_host_memory(self, tensor):
            if self.collect:
                gc.collect()  # what an allocation inside a real pin may set off
            return True

        def unpin_host_memory(self, tensor):
            pass

    full = full_model(2)
    row = tp.row_bytes(full, 1)
    backend = CollectingPins()
    with (
        SharedHostRegion("a", num_blocks=4, slot_bytes=[row], directory=tmp_path) as first,
        SharedHostRegion("b", num_blocks=4, slot_bytes=[row], directory=tmp_path) as second,
    ):
        dropped = OffloadWorker(rank_kv(full, 1, 0), 4, backend=backend, host_region=first)
        dropped.cycle = dropped  # only a collection frees it
        del dropped
        backend.collect = True
        made = []
        thread = threading.Thread(
            target=lambda: made.append(OffloadWorker(rank_kv(full, 1, 0), 4, backend=backend, host_region=second)),
            daemon=True,
        )
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the registration hung on its own lock"
        made[0].shutdown()


def test_a_worker_copies_after_another_on_its_region_shut_down(backend, tmp_path):
    """On every backend: the second worker's copies through a region still reach its memory after
    the first worker shut down (on cuda, `expand_direct` reads and writes the region through the
    registration they shared)."""
    full = full_model(2)
    device = getattr(backend, "device", "cpu")
    with region("shared", full, 1, 4, tmp_path) as reg:
        kv, fresh = rank_kv(full, 1, 0, device=device), rank_kv(full, 1, 0, empty=True, device=device)
        a = OffloadWorker(kv, 4, backend=backend, canonical_layout=True, host_region=reg)
        b = OffloadWorker(fresh, 4, backend=backend, canonical_layout=True, host_region=reg)
        assert a.submit_store(1, DeviceBlocks([3, 5]), HostBlocks([2, 0]))
        a.wait([1])
        a.shutdown()
        assert b.submit_load(2, HostBlocks([2, 0]), DeviceBlocks([7, 8]))
        b.wait([2])  # the lanes are not ordered with each other: the store reads what the load wrote
        assert b.submit_store(3, DeviceBlocks([8, 7]), HostBlocks([1, 3]))
        b.wait([3])
        assert b.submit_load(4, HostBlocks([3, 1]), DeviceBlocks([9, 10]))
        b.wait([4])
        assert [r.success for r in b.get_finished()] == [True] * 3
        b.shutdown()
        for got, want in zip(fresh.tensors, kv.tensors):
            assert torch.equal(got.tensor[[7, 8, 9, 10]].cpu(), want.tensor[[3, 5, 3, 5]].cpu())


def test_direct_slots_keep_ranks_apart(tmp_path):
    full = full_model(2)
    row = tp.row_bytes(full, 1)
    regions = [SharedHostRegion("d", num_blocks=4, slot_bytes=[row, row], rank=r, directory=tmp_path) for r in (0, 1)]
    try:
        for r in (0, 1):
            kv = rank_kv(full, 2, r)
            with OffloadWorker(kv, 4, backend="cpu", host_region=regions[r]) as w:
                w.submit_store(1, DeviceBlocks([r]), HostBlocks([0]))
                w.wait([1])
        rows = regions[0].tensor.numpy()[0].copy()  # a view would keep the region from closing
        for r in (0, 1):
            local = rank_kv(full, 2, r).tensors[0].tensor[r].numpy().ravel()
            np.testing.assert_array_equal(rows[r * row : r * row + local.size], local)
    finally:
        for reg in regions:
            reg.close()
    assert list(tmp_path.iterdir()) == []


def test_ranks_in_separate_processes_share_the_region(tmp_path):
    ctx = mp.get_context("spawn")
    tp_size, heads, bpc, num_host = 2, 4, 1, 6
    barrier, result = ctx.Barrier(tp_size), ctx.Queue()
    store, load = ([1, 3, 5], [0, 4, 2]), ([7, 8, 9], [0, 4, 2])
    procs = [
        ctx.Process(
            target=tp.spawned_rank,
            args=("mp", str(tmp_path), tp_size, r, barrier, store, load, bpc, num_host, heads, result),
        )
        for r in range(tp_size)
    ]
    for p in procs:
        p.start()
    outcome = dict(result.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert outcome == {0: True, 1: True}
    assert [p.exitcode for p in procs] == [0, 0]
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_tensor_no_group_reads_takes_no_room_in_the_canonical_row(tmp_path):
    """Its own page depends on the TP size: with room in the row, every later tensor's place
    would too, and TP=1 would load from where TP=2 did not store (found by a probe)."""
    heads, tokens, head_bytes = 2, 4, 8
    full = np.random.default_rng(0).integers(1, 256, (4, tokens, heads, head_bytes), dtype=np.uint8)

    def kv(tp_size, rank, empty=False):
        mapping = attention_mappings(total_kv_heads=heads, tp_size=tp_size, block_tokens=tokens, head_bytes=head_bytes)[
            rank
        ]
        local = heads // tp_size
        pages = np.ascontiguousarray(full[:, :, rank * local : (rank + 1) * local]).reshape(4, -1)
        read = torch.zeros(pages.shape, dtype=torch.uint8) if empty else torch.from_numpy(pages)
        unread = torch.zeros(pages.shape, dtype=torch.uint8)  # a layer's tensor no group lists
        return KVCaches(
            [KVCacheTensor(unread, pages.shape[1]), KVCacheTensor(read, pages.shape[1])],
            [[KVCacheRef(1, pages.shape[1], mapping=mapping)]],
        )

    rows = 2 * full[0].nbytes  # room for the unread tensor too, as a caller sizing for it would give
    regions = [
        SharedHostRegion("unread", num_blocks=2, canonical_bytes=rows, rank=r, directory=tmp_path) for r in range(2)
    ]
    try:
        for r in range(2):
            with OffloadWorker(kv(2, r), 2, backend="cpu", canonical_layout=True, host_region=regions[r]) as w:
                w.submit_store(1, DeviceBlocks([3]), HostBlocks([1]))
                w.wait({1})
                assert all(res.success for res in w.get_finished())
        reader = kv(1, 0, empty=True)
        with OffloadWorker(reader, 2, backend="cpu", canonical_layout=True, host_region=regions[0]) as w:
            w.submit_load(2, HostBlocks([1]), DeviceBlocks([0]))
            w.wait({2})
            assert all(res.success for res in w.get_finished())
        assert np.array_equal(reader.tensors[1].tensor[0].numpy(), full[3].ravel())
    finally:
        for region in regions[::-1]:
            region.close()


def test_padded_pages_do_not_change_the_canonical_host_page():
    """A rank's padded page depends on its TP size; the canonical host page must not."""
    from offload_core import KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker
    from offload_core.canonical import attention_mappings

    (m0, _) = attention_mappings(total_kv_heads=2, tp_size=2, block_tokens=4, head_bytes=16)
    padded = m0.local_page_size_bytes + 128  # more than the canonical page
    kv = KVCaches(
        [KVCacheTensor(torch.zeros(8, padded, dtype=torch.int8), padded)],
        [[KVCacheRef(0, m0.local_page_size_bytes, mapping=m0)]],
    )
    with OffloadWorker(kv, 4, canonical_layout=True, backend="cpu") as worker:
        assert worker.host_row_bytes == m0.canonical_page_size_bytes


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: CanonicalPageMapping(2**70, 32, [CopyRun(0, 2**69, 32)]), "beyond any page"),
        (lambda: CanonicalPageMapping(64, 32, [CopyRun(0, 0, 16, 2, 16, 2**70)]), "leaves the canonical page"),
        (lambda: CanonicalPageMapping(2**63 - 1, 16, [CopyRun(0, 2**63 - 8, 16)]), "beyond any page"),
        (lambda: CanonicalPageMapping(2**40, 16, [CopyRun(0, 2**40 - 8, 16)]), "leaves the canonical page"),
        (lambda: CanonicalPageMapping(2**40, 2**40, [CopyRun(0, 0, 1, 2**40, 1, 1)]), "at most 4194304 are taken"),
        (lambda: attention_mappings(total_kv_heads=0, tp_size=2, block_tokens=4, head_bytes=8), "total_kv_heads"),
        (lambda: attention_mappings(total_kv_heads=2.0, tp_size=2, block_tokens=4, head_bytes=8), "total_kv_heads"),
        (lambda: attention_mappings(total_kv_heads=3, tp_size=4, block_tokens=4, head_bytes=8), "do not divide"),
    ],
)
def test_mappings_beyond_any_page_are_refused_before_any_arithmetic(make, rule):
    """Offsets and strides beyond int64, ends that would wrap around in it, or fragments by the
    trillion: named, not an overflow, a wrong answer or a memory error."""
    with pytest.raises(InvalidSpecError, match=rule):
        make()


def test_a_large_page_is_checked_without_an_array_as_long():
    page = 1 << 40  # a tebibyte: only the fragments' ends are looked at
    mapping = CanonicalPageMapping(page, page, [CopyRun(0, 0, page // 2, 2, page // 2, page // 2)])
    assert mapping.fragments[2].sum() == page


@pytest.mark.parametrize("mappings", [[1, 2], (m for m in ()), "NHD"])
def test_verify_tiling_names_what_it_takes(mappings):
    with pytest.raises(InvalidSpecError, match="verify_tiling takes"):
        verify_tiling(mappings)


def test_attention_mappings_refuse_a_page_too_large_to_lay_out():
    with pytest.raises(InvalidSpecError, match="head slots"):
        attention_mappings(total_kv_heads=8, tp_size=2, block_tokens=10**9, head_bytes=2)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.sampled_from([4, 8])), min_size=1, max_size=12))
def test_strided_runs_unroll_to_exactly_the_fragments_given(steps):
    """`_as_runs` folds fragments into runs only where sizes and both strides stay constant."""
    from offload_core.canonical import _as_runs

    local = np.cumsum([1 + a for a, _, _ in steps]) * 16
    canon = np.cumsum([1 + b for _, b, _ in steps]) * 16
    sizes = np.array([s for _, _, s in steps])
    unrolled = [
        (r.local_offset + i * r.local_stride, r.canonical_offset + i * r.canonical_stride, r.fragment_size)
        for r in _as_runs(local, canon, sizes)
        for i in range(r.num_fragments)
    ]
    assert unrolled == list(zip(local.tolist(), canon.tolist(), sizes.tolist()))
