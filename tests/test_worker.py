"""OffloadWorker on the cpu backend: real asynchronous copies, checked byte for byte."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from helpers import PinnedWindow, small_kv, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_core import (
    DeviceBlocks,
    Direction,
    HostBlocks,
    InvalidSpecError,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadError,
    OffloadWorker,
    get_backend,
)
from offload_core.backend import enqueue_lock
from offload_core.errors import ConfigError
from offload_core.testing.reference import reference_transfer


def host_rows(worker):
    return torch.cat(worker.host_tensors, dim=1).view(torch.uint8).numpy().copy()


@st.composite
def round_trips(draw):
    n_tensors = draw(st.integers(1, 3))
    pages = [draw(st.sampled_from([16, 48, 64, 100])) for _ in range(n_tensors)]
    copy = [draw(st.integers(1, p)) for p in pages]
    bpc = draw(st.integers(1, 4))
    n_groups = draw(st.integers(1, 2))
    groups = [
        draw(st.lists(st.integers(0, n_tensors - 1), min_size=1, max_size=3, unique=True)) for _ in range(n_groups)
    ]
    sizes = [draw(st.integers(0, 5)) for _ in groups]
    indices = [draw(st.integers(0, 9)) for _ in groups]
    blocks = 24
    ids = draw(st.permutations(range(blocks)))
    src, dst = ids[: sum(sizes)], ids[blocks - sum(sizes) :]
    counts = [-(-(s + i % bpc) // bpc) if s else 0 for s, i in zip(sizes, indices)]
    host = draw(st.permutations(range(12)))[: sum(counts)]
    return pages, copy, bpc, groups, sizes, indices, src, dst, host


@settings(max_examples=25, deadline=None)
@given(case=round_trips())
def test_store_then_load_into_other_blocks_matches_the_reference(backend, case):
    check_round_trip(backend, case)


def check_round_trip(backend, case):
    """Store blocks, load them into other blocks; host rows and device pages against the reference."""
    pages, copy, bpc, groups, sizes, indices, src, dst, host = case
    kv = small_kv(pages, copy, blocks=24, groups=groups, device=backend.device)
    before = [t.numpy().view(np.uint8).copy() for t in snapshot(kv)]
    with OffloadWorker(kv, 12, blocks_per_chunk=bpc, backend=backend) as worker:
        assert worker.submit_store(1, DeviceBlocks(src, sizes, indices), HostBlocks(host))
        worker.wait([1])
        assert worker.submit_load(2, HostBlocks(host), DeviceBlocks(dst, sizes, indices))
        worker.wait([2])
        results = worker.get_finished()
        expected_bytes = sum(n * sum(copy[t] for t in g) for n, g in zip(sizes, groups))
        assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
            (1, True, expected_bytes),
            (2, True, expected_bytes),
        ]
        rows = np.zeros((12, sum(pages) * bpc), dtype=np.uint8)
        offsets = list(np.cumsum([0] + [p * bpc for p in pages])[:-1])
        plain = [[(t, copy[t]) for t in g] for g in groups]
        for direction, ids in ((Direction.STORE, src), (Direction.LOAD, dst)):
            reference_transfer(direction, before, rows, offsets, plain, bpc, ids, sizes, indices, host)
        np.testing.assert_array_equal(host_rows(worker), rows)  # untouched host bytes stay zero
        for t, exp in zip(snapshot(kv), before):  # sources unchanged, untouched pages unchanged
            np.testing.assert_array_equal(t.numpy().view(np.uint8), exp)
    return results


@pytest.fixture(params=["planned", "expand-staged", "expand-direct"])
def cpu_backend(request):
    """The cpu backend on each of the core's paths: host-planned descriptors, compact jobs."""
    if request.param == "planned":
        return get_backend("cpu")
    from offload_core.testing.expanding import ExpandingCpuBackend

    return ExpandingCpuBackend(staged=request.param == "expand-staged")


@pytest.mark.cpu
def test_a_store_sees_what_the_compute_stream_writes_before_it(cpu_backend):
    kv = small_kv()
    backend = cpu_backend
    with OffloadWorker(kv, 4, backend=backend) as worker:

        def slow_kernel():
            time.sleep(0.05)
            for t in kv.tensors:
                t.tensor[3] = 7

        backend.current_stream().launch(slow_kernel)
        assert worker.submit_store(1, DeviceBlocks([3]), HostBlocks([2]))
        worker.wait([1])
        assert all((h[2] == 7).all() for h in worker.host_tensors)


@pytest.mark.cpu
def test_a_load_lands_after_pending_compute_on_its_blocks(cpu_backend):
    kv = small_kv()
    backend = cpu_backend
    with OffloadWorker(kv, 4, backend=backend) as worker:
        for h in worker.host_tensors:
            h[1] = 5

        def zero_fresh_block():  # vLLM #50696: zeroing new blocks must not overwrite a load
            time.sleep(0.05)
            for t in kv.tensors:
                t.tensor[9] = 0

        backend.current_stream().launch(zero_fresh_block)
        assert worker.submit_load(1, HostBlocks([1]), DeviceBlocks([9]))
        worker.wait([1])
        backend.current_stream().synchronize()
        assert all((t.tensor[9] == 5).all() for t in kv.tensors)


def test_jobs_of_one_direction_run_in_order(backend):
    kv = small_kv(pages=(1 << 20,), blocks=32, device=backend.device)
    with OffloadWorker(kv, 4, backend=backend) as worker:
        for job in range(20):  # each job overwrites host block 0 from another device block
            assert worker.submit_store(job, DeviceBlocks([job]), HostBlocks([0]))
        worker.wait([19])
        assert torch.equal(worker.host_tensors[0][0], kv.tensors[0].tensor[19].cpu())
        assert [r.job_id for r in worker.get_finished()] == list(range(20))


def test_host_buffer_is_one_row_per_host_block():
    kv = small_kv(pages=(64, 128))
    with OffloadWorker(kv, 5, blocks_per_chunk=3, backend="cpu") as worker:
        a, b = worker.host_tensors
        assert a.shape == (5, 64 * 3) and b.shape == (5, 128 * 3)
        assert worker.host_row_bytes == 3 * (64 + 128)
        assert a.stride(0) == b.stride(0) == worker.host_row_bytes
        assert b.data_ptr() - a.data_ptr() == 64 * 3


BAD = [
    ("store", DeviceBlocks([16]), HostBlocks([0]), "device block id 16 out of range"),
    ("store", DeviceBlocks([0]), HostBlocks([8]), "host block id 8 out of range"),
    ("load", HostBlocks([-1]), DeviceBlocks([0]), "host block id -1 out of range"),
    ("store", DeviceBlocks([0, 1]), HostBlocks([0]), "need 2"),
    ("store", DeviceBlocks([0, 1], [1, 1]), HostBlocks([0, 1]), "2 groups, the KV cache has 1"),
    ("store", HostBlocks([0]), DeviceBlocks([0]), "needs DeviceBlocks and HostBlocks"),
    ("load", DeviceBlocks([0]), HostBlocks([0]), "needs DeviceBlocks and HostBlocks"),
    ("load", HostBlocks([1, 2]), DeviceBlocks([4, 4]), "device block id 4 is the destination of two copies"),
]


@pytest.mark.parametrize("direction, a, b, message", BAD)
def test_invalid_specs_raise_and_move_nothing(backend, direction, a, b, message):
    kv = small_kv(device=backend.device)
    before = snapshot(kv)
    with OffloadWorker(kv, 8, backend=backend) as worker:
        for h in worker.host_tensors:
            h.fill_(3)
        submit = worker.submit_store if direction == "store" else worker.submit_load
        with pytest.raises(InvalidSpecError, match=message):
            submit(1, a, b)
        worker.backend.synchronize()
        assert worker.get_finished() == []
        assert all((h == 3).all() for h in worker.host_tensors)
        assert all(torch.equal(t, b) for t, b in zip(snapshot(kv), before))
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([0]))  # still usable


@pytest.mark.parametrize(
    "ids, message", [([1.5], "must be an integer, got 1.5"), ([[1]], "1-D"), (np.array([True]), "integers")]
)
def test_block_ids_must_be_1d_integers(ids, message):
    with pytest.raises(InvalidSpecError, match=message):
        DeviceBlocks(ids)
    with pytest.raises(InvalidSpecError, match=message):
        HostBlocks(ids)


def test_a_strided_view_is_a_kv_tensor_with_a_pitch():
    backing = torch.zeros(6, 40, dtype=torch.int8)
    t = KVCacheTensor(backing[:, 4:36], 32)
    assert (t.pitch_bytes, t.page_size_bytes, t.num_blocks) == (40, 32, 6)
    assert KVCacheTensor(backing, 40).pitch_bytes == 40
    assert KVCacheTensor(torch.zeros(6, 8, dtype=torch.float32), 32).pitch_bytes == 32


def test_ids_may_come_as_lists_arrays_or_tensors():
    for ids in ([1, 2], np.array([1, 2], dtype=np.int32), torch.tensor([1, 2])):
        assert DeviceBlocks(ids).block_ids.tolist() == [1, 2]
        assert HostBlocks(ids).block_ids.dtype == np.int64


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: KVCacheTensor(torch.zeros(4, 16, dtype=torch.int8), 8), "not 4 pages"),
        (lambda: KVCacheTensor(torch.zeros(16, 4, dtype=torch.int8).t(), 16), "contiguous"),
        (lambda: KVCacheTensor(torch.zeros(64, dtype=torch.int8).as_strided((4, 16), (8, 1)), 16), "rows overlap"),
        (lambda: KVCacheTensor(torch.zeros(4, 2, 16, dtype=torch.int8)[:, :, :8], 16), "rows must each be contiguous"),
        (lambda: KVCacheTensor(torch.zeros(0, 4, dtype=torch.int8), 4), "leading block dimension"),
        (lambda: KVCaches([], [[]]), "at least one tensor"),
        (lambda: KVCaches([KVCacheTensor(torch.zeros(2, 8), 32)], [[KVCacheRef(1, 8)]]), "ref to tensor 1"),
        (lambda: KVCaches([KVCacheTensor(torch.zeros(2, 8), 32)], [[KVCacheRef(0, 33)]]), "page is 32 bytes"),
        (
            lambda: KVCaches([KVCacheTensor(torch.zeros(2, 8), 32)], [[KVCacheRef(0, 8, mapping=object())]]),
            "CanonicalPageMapping",
        ),
        (lambda: OffloadWorker(small_kv(), 0), "num_host_blocks"),
        (lambda: OffloadWorker(small_kv(), 4, blocks_per_chunk=0), "blocks_per_chunk"),
        (lambda: OffloadWorker(small_kv(), None), "num_host_blocks must be a positive integer, got None"),
        (lambda: OffloadWorker(small_kv(), 2.5), "num_host_blocks must be a positive integer, got 2.5"),
        (lambda: OffloadWorker(small_kv(), "4"), "num_host_blocks must be a positive integer"),
        (lambda: OffloadWorker(small_kv(), True), "num_host_blocks must be a positive integer, got True"),
        (lambda: OffloadWorker(small_kv(), 4, blocks_per_chunk=1.0), "blocks_per_chunk must be a positive integer"),
        (
            lambda: KVCacheTensor(torch.zeros(4, 16, dtype=torch.int8), 16.0),
            "page_size_bytes must be a positive integer, got 16.0",
        ),
        (
            lambda: KVCacheTensor(torch.zeros(4, 16, dtype=torch.int8), -16),
            "page_size_bytes must be a positive integer",
        ),
        (lambda: KVCacheTensor(np.zeros((4, 16), dtype=np.int8), 16), "must be a torch.Tensor, got ndarray"),
        (lambda: KVCacheRef(0, 8.5), "page_size_bytes must be a positive integer, got 8.5"),
        (lambda: KVCacheRef(None, 8), "tensor_idx must be an integer >= 0, got None"),
        (lambda: KVCacheRef(-1, 8), "tensor_idx must be an integer >= 0, got -1"),
        (lambda: KVCacheRef(torch.tensor(True), 8), r"tensor_idx must be an integer >= 0, got tensor\(True\)"),
        (lambda: OffloadWorker(small_kv(), np.array(True)), r"num_host_blocks must be a positive integer, got array"),
        (lambda: KVCaches([KVCacheTensor(torch.zeros(2, 8), 32)], [[]]), "group 0 has no refs"),
        (lambda: KVCaches([KVCacheTensor(torch.zeros(2, 8), 32)], [[KVCacheRef(0, 32)], []]), "group 1 has no refs"),
        (
            lambda: KVCaches([KVCacheTensor(torch.zeros(2, 16), 64)], [[KVCacheRef(0, 64), KVCacheRef(0, 64)]]),
            r"names tensor 0 \(or its memory\) twice",
        ),
        (
            lambda: KVCaches([KVCacheTensor(torch.zeros(2, 16), 64)], [[KVCacheRef(0, 64), KVCacheRef(0, 32)]]),
            r"names tensor 0 \(or its memory\) twice",
        ),
        (lambda: KVCaches([torch.zeros(2, 8)], [[KVCacheRef(0, 32)]]), "must be a KVCacheTensor"),
        (lambda: KVCaches(5, [[KVCacheRef(0, 32)]]), "KVCaches.tensors must be a sequence"),
        (lambda: KVCaches([KVCacheTensor(torch.zeros(2, 8), 32)], [5]), r"group_refs\[0\] must be a sequence"),
        (lambda: KVCacheTensor(torch.zeros(4, 16, dtype=torch.int8, device="meta"), 16), "dense .* with memory"),
        (lambda: KVCacheTensor(torch.zeros(4, 16).to_sparse(), 64), "dense"),
        (lambda: OffloadWorker(small_kv(), 4, backend=["cpu"]), "backend must be a Backend, a backend name or None"),
        (lambda: OffloadWorker(small_kv(), 4, host_region=object()), "host_region must be a SharedHostRegion"),
        (lambda: DeviceBlocks([1], [2**63 - 1, 2**63 - 1, 3]), "add up to 18446744073709551617"),
        (lambda: DeviceBlocks(np.array([2**64 - 1], dtype=np.uint64)), "beyond any block id"),
        (lambda: DeviceBlocks([1, 2], [2], [2**63]), "block_indices holds 9223372036854775808, beyond any block id"),
    ],
)
def test_invalid_layouts_are_rejected(make, message):
    with pytest.raises(InvalidSpecError, match=message):
        make()


_BACK = torch.zeros(9, 64, dtype=torch.int8)  # one buffer that tensors below wrap


@pytest.mark.parametrize(
    "tensors",
    [
        [(_BACK[0:8], 64), (_BACK[1:9], 64)],  # rows shifted by one block
        [(_BACK[:, 0:48], 48), (_BACK[:, 16:64], 48)],  # rows overlapping within each block
        [(_BACK[0:8], 64), (_BACK.view(-1)[:256].view(8, 32), 32)],  # another pitch
    ],
)
def test_tensors_whose_rows_overlap_are_rejected(tensors):
    """A copy into one would change the other's pages unseen (checks of where copies land go by
    tensor)."""
    kv_tensors = [KVCacheTensor(t, page) for t, page in tensors]
    with pytest.raises(InvalidSpecError, match="KV tensors 0 and 1 share memory without being the same rows"):
        KVCaches(kv_tensors, [[KVCacheRef(0, tensors[0][1])], [KVCacheRef(1, tensors[1][1])]])


def test_the_same_memory_wrapped_twice_is_one_tensor_to_the_checks():
    buf = torch.zeros(8, 16, dtype=torch.int8)
    twice = [KVCacheTensor(buf, 16), KVCacheTensor(buf, 16)]
    with pytest.raises(InvalidSpecError, match="names tensor 1 \\(or its memory\\) twice"):
        KVCaches(twice, [[KVCacheRef(0, 16), KVCacheRef(1, 16)]])
    kv = KVCaches(twice, [[KVCacheRef(0, 16)], [KVCacheRef(1, 16)]])
    with OffloadWorker(kv, 4, backend="cpu") as worker:
        with pytest.raises(InvalidSpecError, match="device block id 3 is the destination of two copies"):
            worker.submit_load(1, HostBlocks([0, 1]), DeviceBlocks([3, 3], [1, 1]))
    # groups overlaid on one memory with pages of other sizes (vLLM's hybrid caches) are one too
    overlaid = [KVCacheTensor(buf, 16), KVCacheTensor(buf.view(8, 2, 8)[:, 0], 8)]
    assert KVCaches(overlaid, [[KVCacheRef(0, 16)], [KVCacheRef(1, 8)]]).memory == (0, 0)
    # K and V interleaved in one buffer, rows a pitch apart: they do not meet
    kv_rows = torch.zeros(8, 2, 16, dtype=torch.int8)
    KVCaches(
        [KVCacheTensor(kv_rows[:, 0], 16), KVCacheTensor(kv_rows[:, 1], 16)], [[KVCacheRef(0, 16), KVCacheRef(1, 16)]]
    )


def test_bf16_tensors_are_viewed_as_bytes(backend):
    tensor = torch.randn(8, 16, 128, dtype=torch.bfloat16).to(backend.device)  # 8 blocks of 16 tokens x 128
    kv = KVCaches([KVCacheTensor(tensor, 16 * 128 * 2)], [[KVCacheRef(0, 16 * 128 * 2)]])
    with OffloadWorker(kv, 4, backend=backend) as worker:
        worker.submit_store(1, DeviceBlocks([2]), HostBlocks([3]))
        worker.wait([1])
        worker.submit_load(2, HostBlocks([3]), DeviceBlocks([6]))
        worker.wait([2])
    assert torch.equal(tensor[6], tensor[2])


def test_backend_must_copy_the_kv_tensors_device():
    from offload_core.testing.fake import FakeBackend

    class Elsewhere(FakeBackend):
        @property
        def device(self):
            return torch.device("meta")

    with pytest.raises(InvalidSpecError, match="KV tensors are on cpu"):
        OffloadWorker(small_kv(), 4, backend=Elsewhere())


def test_an_absurd_host_buffer_is_refused_before_allocating():
    from offload_core.hostmem import available_host_bytes

    # Twice what is available: memory freed between this read and the worker's must not make
    # the request fit (it would then be allocated, and touched, in full).
    too_many = 2 * available_host_bytes() // 192 + 1  # small_kv's host row is 64 + 128 bytes
    with pytest.raises(OffloadError, match="host buffer .* needs .* only .* available"):
        OffloadWorker(small_kv(), too_many, backend="cpu")


def test_the_bookkeeping_of_host_blocks_counts_with_their_rows(monkeypatch):
    """Rows of a few bytes weigh less than the 24 bytes a block the worker keeps for hazards."""
    from offload_core import hostmem

    kv = small_kv(pages=(8,), blocks=4)
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda root="/": 16 * 1000)  # the rows fit
    with pytest.raises(OffloadError, match="host buffer .* needs .* only .* available"):
        OffloadWorker(kv, 1000, backend="cpu")


@pytest.mark.parametrize("job_id", ["7", None, 1.0, (1,), True, object()])
def test_job_ids_must_be_integers(job_id):
    with OffloadWorker(small_kv(), 4, backend="cpu") as worker:
        with pytest.raises(InvalidSpecError, match="job_id must be an integer"):
            worker.submit_store(job_id, DeviceBlocks([0]), HostBlocks([0]))
        with pytest.raises(InvalidSpecError, match="job_id must be an integer"):
            worker.submit_load(job_id, HostBlocks([0]), DeviceBlocks([0]))
        assert worker.submit_store(np.int64(7), DeviceBlocks([0]), HostBlocks([0]))  # numpy integers are integers
        worker.wait([7])
        assert [r.job_id for r in worker.get_finished()] == [7]


def test_rejected_submits_allocate_no_host_memory():
    from offload_core.testing.fake import FakeBackend

    class Counting(FakeBackend):
        allocs = 0

        def alloc_host(self, nbytes):
            Counting.allocs += 1
            return super().alloc_host(nbytes)

    backend = Counting()
    with OffloadWorker(small_kv(), 4, backend=backend) as worker:
        before = Counting.allocs
        for _ in range(100):
            with pytest.raises(InvalidSpecError):
                worker.submit_store(1, DeviceBlocks([99]), HostBlocks([0]))
        assert Counting.allocs == before


@pytest.mark.parametrize("ids", [7, None, "7", [1.5], [None], np.array(5), torch.tensor(5)], ids=repr)
def test_wait_takes_an_iterable_of_integer_ids(ids):
    with OffloadWorker(small_kv(), 4, backend="cpu") as worker:
        with pytest.raises(InvalidSpecError, match="wait"):
            worker.wait(ids)
        worker.wait(iter([1, 2]))  # any iterable; unknown ids are ignored


def test_specs_keep_what_was_validated():
    """Neither the caller's lists nor its id arrays can change what a worker addresses."""
    tensors = [KVCacheTensor(torch.zeros(8, 64, dtype=torch.uint8), 64)]
    refs = [KVCacheRef(0, 64)]
    kv = KVCaches(tensors, [refs])
    tensors.clear()
    refs.append(KVCacheRef(7, 64))
    assert len(kv.tensors) == 1 and kv.group_refs == ((KVCacheRef(0, 64),),)
    ids = np.array([3])
    device = DeviceBlocks(ids)
    ids[0] = 1 << 40
    assert device.block_ids.tolist() == [3] and not device.block_ids.flags.writeable
    with OffloadWorker(kv, 8, backend="cpu") as worker:
        assert worker.submit_store(1, device, HostBlocks([0]))


@pytest.mark.parametrize("job_id", [torch.tensor(5, device="meta")])
def test_job_ids_that_are_tensors_without_data_are_refused(job_id):
    with OffloadWorker(small_kv(), 4, backend="cpu") as worker:
        with pytest.raises(InvalidSpecError, match="job_id must be an integer"):
            worker.submit_store(job_id, DeviceBlocks([0]), HostBlocks([0]))


@pytest.mark.parametrize("expedited", [np.array([1, 0]), 2, "yes", None, 1.0], ids=repr)
def test_expedited_is_a_truth_value(expedited):
    with OffloadWorker(small_kv(), 4, backend="cpu") as worker:
        with pytest.raises(InvalidSpecError, match="expedited must be True or False"):
            worker.submit_load(1, HostBlocks([0]), DeviceBlocks([0]), expedited=expedited)
        for ok in (np.True_, 1, False):
            assert worker.submit_load(2, HostBlocks([0]), DeviceBlocks([0]), expedited=ok)
            worker.wait([2])
            worker.get_finished()


@pytest.mark.parametrize(
    "ids, rule",
    [
        ([1, 2**63], "holds 9223372036854775808, beyond any block id"),
        ([2**64], "holds 18446744073709551616, beyond any block id"),
        ([-(2**63) - 1], "holds -9223372036854775809, beyond any block id"),
        ([1, 2.5], r"DeviceBlocks.block_ids\[1\] must be an integer, got 2.5"),
    ],
)
def test_ids_numpy_cannot_hold_as_int64_are_named(ids, rule):
    with pytest.raises(InvalidSpecError, match=rule):
        DeviceBlocks(ids)


def test_ids_of_mixed_numpy_integer_types_are_taken():
    """numpy makes floats of int64 and uint64 together: the ids are integers all the same."""
    assert DeviceBlocks([np.int64(1), np.uint64(2)]).block_ids.tolist() == [1, 2]
    assert HostBlocks((np.int32(7), 3)).block_ids.tolist() == [7, 3]


@pytest.mark.parametrize("change", ["as_strided_", "set_"])
def test_a_kv_tensor_changed_after_it_was_checked_is_not_followed(backend_name_for_probe, change):
    """The caller's tensor object re-viewed (`as_strided_`) or given other memory (`set_`) after
    `KVCacheTensor` checked it: the worker copies what was checked, from memory it keeps alive,
    and never past the original rows."""
    backing = torch.full((1024,), -1, dtype=torch.int8)
    view = backing[256:768].view(8, 64)  # 8 pages of 64 bytes, guards on both sides
    kv = KVCaches([KVCacheTensor(view, 64)], [[KVCacheRef(0, 64)]])
    if change == "as_strided_":
        view.as_strided_((8, 32), (64, 1), view.storage_offset() + 32)
    else:
        view.set_(torch.zeros(16, dtype=torch.int8))
    with OffloadWorker(kv, 8, backend=backend_name_for_probe()) as worker:
        worker.host_tensors[0][:] = 7
        assert worker.submit_load(1, HostBlocks([0]), DeviceBlocks([7]))
        worker.wait([1])
        assert all(r.success for r in worker.get_finished())
    assert (backing[256 + 7 * 64 : 768] == 7).all()
    assert (backing[:256] == -1).all() and (backing[768:] == -1).all()


@pytest.fixture(params=["cpu", "expanding-staged", "expanding-direct"])
def backend_name_for_probe(request):
    from offload_core.testing.expanding import ExpandingCpuBackend

    return {
        "cpu": lambda: "cpu",
        "expanding-staged": lambda: ExpandingCpuBackend(staged=True),
        "expanding-direct": lambda: ExpandingCpuBackend(staged=False),
    }[request.param]


def test_a_malformed_native_setting_is_named_by_any_worker(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", "2")
    with pytest.raises(ConfigError, match="OFFLOAD_CORE_NATIVE"):
        OffloadWorker(small_kv(), 4, backend="cpu")


# ---- the submit's checks, which other paths would otherwise hide --------------------------------


def test_a_shut_down_worker_refuses_submits_by_raising():
    """Not a False answer (what the closed queue underneath would give): the engine must see it."""
    worker = OffloadWorker(small_kv(), 4, backend="cpu")
    worker.shutdown()
    with pytest.raises(OffloadError, match="OffloadWorker is shut down"):
        worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
    with pytest.raises(OffloadError, match="OffloadWorker is shut down"):
        worker.submit_load(2, HostBlocks([1]), DeviceBlocks([1]), expedited=True)


def test_submits_racing_shutdown_are_each_accepted_and_reported_once_or_refused():
    for trial in range(20):
        worker = OffloadWorker(small_kv(blocks=8), 8, backend="cpu")
        accepted, answers, go = [], [], threading.Barrier(3)

        def submitter(t):
            go.wait()
            for i in range(100_000):  # until refused: some submits come after the shutdown
                job = t * 1_000_000 + i
                try:
                    ok = worker.submit_store(job, DeviceBlocks([t * 4 + i % 4]), HostBlocks([t * 4 + i % 4]))
                except OffloadError as exc:
                    answers.append(str(exc))
                    return
                except Exception as exc:  # what a closed lane underneath would raise, say
                    answers.append(repr(exc))
                    return
                answers.append(ok)
                if ok:
                    accepted.append(job)

        threads = [threading.Thread(target=submitter, args=(t,)) for t in (0, 1)]
        for t in threads:
            t.start()
        go.wait()
        worker.shutdown()
        for t in threads:
            t.join()
        reported = [r.job_id for r in worker.get_finished()]
        assert sorted(reported) == sorted(accepted), f"trial {trial}"
        assert all(a is True or "OffloadWorker is shut down" in a for a in answers), f"trial {trial}: {answers}"


class _FailingEvent:
    def __init__(self, event, error):
        self.event, self.error = event, error

    def record(self, stream):
        raise self.error

    def __getattr__(self, name):
        return getattr(self.event, name)


@pytest.mark.parametrize("error", [RuntimeError("the device is lost"), KeyboardInterrupt()])
def test_a_ready_event_that_cannot_be_recorded_queues_nothing(monkeypatch, error):
    """An Exception: the submit logs it and returns False; anything else (Ctrl-C) is raised.
    Either way the job id is free again."""
    from offload_core.backends.cpu import CpuBackend

    backend = CpuBackend()
    with OffloadWorker(small_kv(), 4, backend=backend) as worker:
        assert worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))  # the lane's launcher starts
        worker.wait([0])
        worker.get_finished()
        queue = worker._queues[Direction.STORE]
        made = backend.new_event
        monkeypatch.setattr(queue, "_free_events", [])
        monkeypatch.setattr(backend, "new_event", lambda: _FailingEvent(made(), error))
        if isinstance(error, Exception):
            assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1])) is False
        else:
            with pytest.raises(KeyboardInterrupt):
                worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
        monkeypatch.setattr(backend, "new_event", made)
        assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
        worker.wait([1])
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]


def test_a_launch_bookkeeping_failure_after_the_job_is_queued_still_reports_it():
    """`_take` failing once: the submit logs it and says the job is queued (it is: its result
    comes); no submit stays counted as under way, so shutdown returns."""
    worker = OffloadWorker(small_kv(), 4, backend="cpu")
    queue = worker._queues[Direction.STORE]
    assert worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))  # starts the launcher
    worker.wait([0])
    take = queue._take
    calls = []

    def fail_once(*args):
        if not calls:
            calls.append(1)
            raise RuntimeError("bookkeeping")
        return take(*args)

    queue._take = fail_once
    queue.launch_cost = PinnedWindow(0.0)  # no burst: the submit launches itself, the device being idle
    assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1])) is True
    queue._take = take
    worker.wait([1])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(0, True), (1, True)]
    assert worker._submitting == 0
    worker.shutdown()


def test_a_submit_checks_the_shared_region_once_its_check_is_due(tmp_path):
    """A rank's submits notice, within `_REGION_CHECK_S`, that the region file was removed or
    replaced (another rank restarted it): writing on would split the ranks' host memory."""
    from offload_core.errors import RegionError
    from offload_core.region import SharedHostRegion

    region = SharedHostRegion("due", num_blocks=4, slot_bytes=[64 * 16], directory=tmp_path)
    worker = OffloadWorker(small_kv(pages=(64,), blocks=16), 4, blocks_per_chunk=16, backend="cpu", host_region=region)
    try:
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([0]))
        region.path.unlink()
        assert worker.submit_store(2, DeviceBlocks([1]), HostBlocks([1]))  # not due yet: no file system call per job
        worker._next_region_check = 0.0  # as if `_REGION_CHECK_S` had passed
        with pytest.raises(RegionError, match="removed or replaced"):
            worker.submit_store(3, DeviceBlocks([2]), HostBlocks([2]))
        worker.wait([1, 2])
        assert [r.job_id for r in worker.get_finished()] == [1, 2]
    finally:
        worker.shutdown()
        region.close()


# ---- hazards between lanes: stores and loads of one host block ---------------------------------


class _SlowLane:
    """A cpu backend whose copies of one direction start late on their stream (a long job
    ahead of them, say), so that the other lane would run first if nothing ordered them."""

    def __new__(cls, slow: Direction, seconds: float = 0.05):
        from offload_core.backends.cpu import CpuBackend

        class Slow(CpuBackend):
            def copy_batch(self, src, dst, sizes, direction, stream):
                if direction is slow:
                    stream.launch(lambda: time.sleep(seconds))
                return super().copy_batch(src, dst, sizes, direction, stream)

        return Slow()


@pytest.mark.parametrize("expedited", [False, True])
def test_a_load_of_a_host_block_waits_for_the_store_into_it(expedited):
    kv = small_kv(pages=(64,), blocks=8)
    with OffloadWorker(kv, 4, backend=_SlowLane(Direction.STORE)) as worker:
        before = worker.host_tensors[0][2].clone()
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([2]))
        assert worker.submit_load(2, HostBlocks([2]), DeviceBlocks([5]), expedited=expedited)
        worker.wait([1, 2])
        assert all(r.success for r in worker.get_finished())
        assert not torch.equal(before, kv.tensors[0].tensor[0])  # the old bytes would show
        assert torch.equal(kv.tensors[0].tensor[5], kv.tensors[0].tensor[0])  # the stored ones, not the old


def test_a_load_of_several_host_blocks_waits_for_the_newest_store_into_any():
    """Host block 0 never stored, block 2 stored just now: the load waits for that store, the
    newest of its blocks' stores (found by mutating the lookup to the oldest)."""
    kv = small_kv(pages=(64,), blocks=8)
    with OffloadWorker(kv, 4, backend=_SlowLane(Direction.STORE)) as worker:
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([2]))
        assert worker.submit_load(2, HostBlocks([0, 2]), DeviceBlocks([4, 5]))
        worker.wait([1, 2])
        assert all(r.success for r in worker.get_finished())
        assert torch.equal(kv.tensors[0].tensor[5], kv.tensors[0].tensor[0])


def test_an_end_a_load_waits_for_is_never_pooled_for_another_launch():
    """A store's end event that a load waits for on the device (`end_of` lends it) must not be
    recorded again under a later store once the first is reported: the load would wait for that."""
    kv = small_kv(pages=(64,), blocks=8)
    with OffloadWorker(kv, 4, backend=_SlowLane(Direction.STORE)) as worker:
        stores = worker._queues[Direction.STORE]
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([2]))
        assert worker.submit_load(2, HostBlocks([2]), DeviceBlocks([5]))
        lent = list(stores._lent.values())
        assert lent  # the load waits for the store's end
        worker.wait([1, 2])
        assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
        assert not any(e is end for e in stores._free_events for end in lent)


def test_a_load_waits_for_a_store_whose_launch_is_under_way_on_another_thread():
    """The store's launch has taken its job and waits for the enqueue lock on another thread:
    the load of its host block waits for that launch's end, not for an older one or none."""
    kv = small_kv(pages=(64,), blocks=8)
    backend = _SlowLane(Direction.STORE)
    lock = enqueue_lock(backend)
    with OffloadWorker(kv, 4, backend=backend) as worker:
        stores = worker._queues[Direction.STORE]
        lock.acquire()
        try:
            storing = threading.Thread(target=worker.submit_store, args=(1, DeviceBlocks([0]), HostBlocks([2])))
            storing.start()
            deadline = time.monotonic() + 10
            while stores._batch is None and time.monotonic() < deadline:  # its launch is under way
                time.sleep(0.001)
            loading = threading.Thread(target=worker.submit_load, args=(2, HostBlocks([2]), DeviceBlocks([5])))
            loading.start()
            time.sleep(0.05)
        finally:
            lock.release()
        storing.join(10)
        loading.join(10)
        worker.wait([1, 2])
        assert all(r.success for r in worker.get_finished())
        assert torch.equal(kv.tensors[0].tensor[5], kv.tensors[0].tensor[0])


def test_a_result_is_handed_out_once():
    kv = small_kv(pages=(64,), blocks=8)
    with OffloadWorker(kv, 4, backend="cpu") as worker:
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([2]))
        assert worker.submit_load(2, HostBlocks([1]), DeviceBlocks([5]))
        worker.wait([1, 2])
        assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
        assert worker.get_finished() == []


@pytest.mark.parametrize("expedited", [False, True])
def test_a_store_into_a_host_block_waits_for_the_load_that_reads_it(expedited):
    kv = small_kv(pages=(64,), blocks=8)
    with OffloadWorker(kv, 4, backend=_SlowLane(Direction.LOAD)) as worker:
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([2]))
        worker.wait([1])
        old = kv.tensors[0].tensor[0].clone()
        assert worker.submit_load(2, HostBlocks([2]), DeviceBlocks([5]), expedited=expedited)
        assert worker.submit_store(3, DeviceBlocks([1]), HostBlocks([2]))  # overwrites what job 2 reads
        worker.wait([2, 3])
        assert all(r.success for r in worker.get_finished())
        assert not torch.equal(old, kv.tensors[0].tensor[1])
        assert torch.equal(kv.tensors[0].tensor[5], old)  # what the host block held at job 2's submit


def test_a_load_of_a_host_block_whose_store_waits_for_a_launch_launches_that_store_first():
    from offload_core.testing.fake import FakeBackend

    fake = FakeBackend()
    with OffloadWorker(small_kv(), 8, backend=fake) as worker:
        stores = worker._queues[Direction.STORE]
        with stores._lock:  # no launcher thread and no launch by the submit: the store waits
            stores._launcher, stores.burst_jobs = threading.current_thread(), 10**6
            stores.launch_cost = PinnedWindow(60.0)
        stores._last_submit = time.perf_counter()  # the next submit is part of a burst: it waits
        assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([3]))
        assert stores.waiting_for_launch()
        assert worker.submit_load(2, HostBlocks([3]), DeviceBlocks([4]))
        assert not stores.waiting_for_launch()  # launched by the load's submit
        store_end = stores._jobs[-1].end
        waits = [e for op, s, e, *_ in fake.log if op == "wait_event" and s == fake.streams[1].name]
        assert store_end in waits
        with stores._lock:
            stores._launcher = None
        fake.complete_all()


def test_a_loads_launch_hands_the_backend_its_stores_end_as_host_after():
    """What a backend's side streams wait for before they touch host rows (cuda's staged
    loads): the joined job's `host_after` holds the unreported store's end, among `after`."""
    from offload_core.testing.expanding import ExpandingCpuBackend

    seen = []

    class Recording(ExpandingCpuBackend):
        def copy_blocks(self, job, prepared, stream, after):
            seen.append((job.direction, tuple(job.host_after), list(after)))
            return super().copy_blocks(job, prepared, stream, after)

    with OffloadWorker(small_kv(pages=(64,), blocks=8), 8, backend=Recording()) as worker:
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([5]))
        assert worker.submit_load(2, HostBlocks([5]), DeviceBlocks([1]))
        worker.wait([1, 2])
    (load,) = [s for s in seen if s[0] is Direction.LOAD]
    assert load[1] and {id(e) for e in load[1]} <= {id(e) for e in load[2]}


def test_the_job_a_launch_hands_its_backend_is_held_until_its_end_has_passed():
    """The launch's job in host order (a new job, whose copies `copy_batch` was handed): the
    queue keeps it until the launch's end has passed and its result is taken, then lets go."""
    import gc
    import weakref

    from offload_core.testing.fake import FakeBackend

    handed = []

    class Handing(FakeBackend):
        def copy_blocks(self, job, prepared, stream, after):
            handed.append(weakref.ref(job.layout.copies(job)[0]))  # kept with the job
            return super().copy_blocks(job, prepared, stream, after)

    fake = Handing()
    with OffloadWorker(small_kv(), 8, backend=fake) as worker:
        for lane in worker._lanes:
            lane.burst_jobs = 1  # each submit launches its job at once
        assert worker.submit_store(1, DeviceBlocks([1, 2]), HostBlocks([4, 3]))  # put in host order
        gc.collect()
        assert len(handed) == 1 and handed[0]() is not None  # its end has not passed
        fake.complete_all()
        worker.wait([1])
        assert [r.job_id for r in worker.get_finished()] == [1]
        gc.collect()
        assert handed[0]() is None


def test_jobs_of_other_host_blocks_and_reported_stores_wait_for_nothing():
    from offload_core.testing.fake import FakeBackend

    fake = FakeBackend()
    with OffloadWorker(small_kv(), 8, backend=fake) as worker:
        for lane in worker._lanes:
            lane.burst_jobs = 1  # each submit launches its job at once
        assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([3]))
        assert worker.submit_load(2, HostBlocks([4]), DeviceBlocks([4]))  # another host block
        fake.complete_all()
        worker.get_finished()
        assert worker.submit_load(3, HostBlocks([3]), DeviceBlocks([5]))  # its store was reported
        lane_waits = [e for op, s, e, *_ in fake.log if op == "wait_event" and s == fake.streams[1].name]
        computed = [e for op, s, e, *_ in fake.log if op == "record" and s == "compute"]
        assert all(e in computed for e in lane_waits)  # the compute stream's events only
        fake.complete_all()


def test_a_refused_store_hides_no_earlier_store_from_a_load(monkeypatch):
    """Store 2 into host block 2 is recorded as the block's last store, then refused (its ready
    event fails): the load must still wait for store 1, which is still running."""
    kv = small_kv(pages=(64,), blocks=8)
    backend = _SlowLane(Direction.STORE, seconds=0.2)
    with OffloadWorker(kv, 4, backend=backend) as worker:
        assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([2]))
        queue = worker._queues[Direction.STORE]
        made = backend.new_event
        monkeypatch.setattr(queue, "_free_events", [])
        monkeypatch.setattr(backend, "new_event", lambda: _FailingEvent(made(), RuntimeError("the device hiccups")))
        assert worker.submit_store(2, DeviceBlocks([1]), HostBlocks([2])) is False
        monkeypatch.setattr(backend, "new_event", made)
        assert worker.submit_load(3, HostBlocks([2]), DeviceBlocks([5]))
        worker.wait([1, 3])
        assert all(r.success for r in worker.get_finished())
        assert torch.equal(kv.tensors[0].tensor[5], kv.tensors[0].tensor[0])  # store 1's bytes, not the old


@pytest.mark.parametrize("first", [Direction.STORE, Direction.LOAD])
def test_a_launch_that_failed_before_enqueuing_hides_no_earlier_job_from_the_other_lane(monkeypatch, first):
    """Job 1 of host block 2 is still running; job 2, of its lane and block, fails to launch
    before it enqueued anything (no event for its start, so it records no end): job 3, of the
    other lane and the same block, must still wait for job 1."""
    kv = small_kv(pages=(64,), blocks=8)
    backend = _SlowLane(first, seconds=0.2)
    dev = kv.tensors[0].tensor
    with OffloadWorker(kv, 4, backend=backend) as worker:
        host = worker.host_tensors[0]
        before = host[2].clone()
        assert not torch.equal(dev[0], before)
        store = lambda job, block: worker.submit_store(job, DeviceBlocks([block]), HostBlocks([2]))  # noqa: E731
        load = lambda job, block: worker.submit_load(job, HostBlocks([2]), DeviceBlocks([block]))  # noqa: E731
        same, other = (store, load) if first is Direction.STORE else (load, store)
        assert same(1, 0 if first is Direction.STORE else 4)
        made = backend.new_event
        queue = worker._queues[first]
        monkeypatch.setattr(queue, "_free_events", [])
        ready = [made()]  # job 2's ready event, made at its submit; then none for its launch

        def new_event():
            if ready:
                return ready.pop()
            monkeypatch.setattr(backend, "new_event", made)
            raise RuntimeError("no event now")

        monkeypatch.setattr(backend, "new_event", new_event)
        same(2, 1 if first is Direction.STORE else 5)
        assert other(3, 5 if first is Direction.STORE else 0)
        worker.wait([1, 2, 3])
        assert {r.job_id: r.success for r in worker.get_finished()} == {1: True, 2: False, 3: True}
        if first is Direction.STORE:
            assert torch.equal(dev[5], dev[0])  # store 1's bytes, not the block's old ones
        else:
            assert torch.equal(dev[4], before)  # what load 1 was to read, not store 3's bytes
            assert torch.equal(host[2], dev[0])
