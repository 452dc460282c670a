"""The cuda backend on a GPU: every mechanism bit-exact, ordering against compute. Skipped without a GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import small_kv
from hypothesis import given, settings
from test_worker import check_round_trip, round_trips

from offload_core import DeviceBlocks, Direction, HostBlocks, OffloadWorker
from offload_core.backends.cuda import BLOCK_MECHANISMS, MECHANISMS, CudaBackend, kernels
from offload_core.backends.cuda.ring import DescriptorRing
from offload_core.testing.conformance import BackendConformance

REASON = CudaBackend.probe()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=f"cuda: {REASON}")]


def mechanisms(names=MECHANISMS + BLOCK_MECHANISMS):
    if REASON is not None:
        return list(names)
    probe = CudaBackend()
    return [
        m if probe.why_unavailable(m) is None else pytest.param(m, marks=pytest.mark.skip(probe.why_unavailable(m)))
        for m in names
    ]


@pytest.fixture(scope="module", params=mechanisms())
def forced(request):
    return CudaBackend(mechanism=request.param)


@pytest.fixture(scope="module", params=mechanisms(BLOCK_MECHANISMS))
def expanding(request):
    return CudaBackend(mechanism=request.param)


class TestEveryMechanism(BackendConformance):
    @pytest.fixture
    def backend(self, forced):
        return forced


def random_fragments(rng, count, space, max_size, equal=False):
    """Sizes from 1 B to `max_size`, log-uniform (or all `max_size`), at unaligned offsets,
    without overlap on either side."""
    if equal:
        sizes = np.full(count, max_size, dtype=np.int64)
    else:
        sizes = np.exp(rng.uniform(0, np.log(max_size), count)).astype(np.int64) + rng.integers(0, 3, count)
        sizes = np.minimum(sizes, max_size)

    def places():
        gaps = rng.integers(0, 17, count)
        order = rng.permutation(count)
        ends = np.cumsum(sizes[order] + gaps[order])
        assert ends[-1] <= space
        out = np.empty(count, dtype=np.int64)
        out[order] = ends - sizes[order]
        return out

    return sizes, places(), places()


@pytest.mark.parametrize(
    "max_size, equal", [(256, False), (64 * 1024, False), (4 << 20, False), (256, True), (4099, True)]
)
def test_round_trip_is_bit_exact_for_random_fragments(forced, max_size, equal):
    """Equal sizes take the kernels' computed-column path (no sizes uploaded)."""
    if forced.mechanism in BLOCK_MECHANISMS:
        pytest.skip("compact mechanisms take a worker's jobs; a bare batch goes as auto")
    assert round_trip(forced, max_size, equal) == forced.mechanism


def test_auto_round_trip_of_a_bare_batch_is_bit_exact_by_the_copy_engines():
    """A bare batch under auto goes to ce_batch (ce_loop where the driver lacks the batch call)."""
    backend = CudaBackend(mechanism="auto")
    expected = "ce_batch" if "ce_batch" in backend.available_mechanisms else "ce_loop"
    for max_size, equal in [(256, False), (256, True), (4099, True)]:
        assert round_trip(backend, max_size, equal) == expected


def round_trip(backend, max_size, equal) -> str:
    """Store random fragments and load them back; check both byte for byte. Returns the mechanism used."""
    import torch

    rng = np.random.default_rng(max_size)
    count = 60 if max_size >= (1 << 20) else 20000 if equal else 400
    space = 160 << 20
    sizes, dev_off, host_off = random_fragments(rng, count, space, max_size, equal)
    source = torch.from_numpy(rng.integers(0, 256, space, dtype=np.uint8))
    device = source.to(backend.device)
    back = torch.zeros(space, dtype=torch.uint8, device=backend.device)
    host = backend.alloc_host(space)
    stream, done = backend.new_stream(), backend.new_event()
    d, h = device.data_ptr() + dev_off, host.data_ptr() + host_off
    used = backend.copy_batch(d, h, sizes, Direction.STORE, stream)
    backend.copy_batch(h, back.data_ptr() + dev_off, sizes, Direction.LOAD, stream)
    done.record(stream)
    done.synchronize()
    expected_host = np.zeros(space, dtype=np.uint8)
    expected_back = np.zeros(space, dtype=np.uint8)
    src = source.numpy()
    for s, do, ho in zip(sizes.tolist(), dev_off.tolist(), host_off.tolist()):
        expected_host[ho : ho + s] = src[do : do + s]
        expected_back[do : do + s] = src[do : do + s]
    np.testing.assert_array_equal(host.numpy(), expected_host)
    np.testing.assert_array_equal(back.cpu().numpy(), expected_back)
    return used


def test_block_tables_are_not_reused_while_a_job_may_read_them():
    """Eight store jobs queued behind a sleeping compute stream, their block tables through a
    ring that holds two of them: the third wraps onto the first's while that job waits, so the
    enqueue must wait for it; every job must still copy its own blocks. Each writes host row 0
    too, so none joins another's launch."""
    import torch

    if kernels.why_unavailable() is not None:
        pytest.skip(kernels.why_unavailable())
    backend = CudaBackend(mechanism="expand_direct")
    n, jobs = 4096, 8
    # a simple job's table: its device and host ids, int32, one 8-byte entry per block; uploaded
    # and launched in one compiled call where the module was built, as the backend's own ring
    launch = backend.driver.table_launch_in(backend._ctx)
    backend._ring = DescriptorRing(torch, backend.device, backend._table_copy, entries=2 * n + 7, launch=launch)
    kv = small_kv(pages=(256,), blocks=2 * n, device=backend.device)
    rng = np.random.default_rng(5)
    slots = [rng.permutation(2 * n)[:n] for _ in range(jobs)]
    rows = [np.concatenate([[0], 1 + j * (n - 1) + np.arange(n - 1)]) for j in range(jobs)]
    with OffloadWorker(kv, 1 + jobs * (n - 1), backend=backend) as worker:
        torch.cuda._sleep(50_000_000)  # on the compute stream, which every job waits for
        for j in range(jobs):
            assert worker.submit_store(j, DeviceBlocks(slots[j]), HostBlocks(rows[j]))
        worker.wait(range(jobs))
        assert all(r.success for r in worker.get_finished())
        host, device = worker.host_tensors[0], kv.tensors[0].tensor.cpu()
        for j in range(jobs):
            assert torch.equal(host[rows[j][1:]], device[slots[j][1:]])
        assert torch.equal(host[0], device[slots[-1][0]])
    assert backend.buffer_waits()[0] >= 1  # the ring was full while a job could still read it


def test_auto_reports_its_choice_per_job():
    backend = CudaBackend(mechanism="auto")
    kv = small_kv(pages=(256,) * 8, blocks=64, device=backend.device)
    with OffloadWorker(kv, 64, backend=backend) as worker:
        worker.submit_store(1, DeviceBlocks(np.arange(32)), HostBlocks(np.arange(32)))
        worker.wait([1])
        (result,) = worker.get_finished()
        assert result.mechanism in MECHANISMS + BLOCK_MECHANISMS
        assert worker.stats()["store"].mechanisms[result.mechanism] == 1


def test_auto_tries_its_candidates_and_keeps_one_per_shape_class(tmp_path, monkeypatch):
    """`tuning` on the device: the first launches of one shape class run more than one
    mechanism, every byte right whichever ran; once decided, the class keeps one mechanism,
    saved per GPU model, which a new backend reads back."""
    import torch

    from offload_core.backends.cuda import tuning

    monkeypatch.setenv("OFFLOAD_CORE_PROFILE_DIR", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_CORE_CUDA_CONF", raising=False)
    backend = CudaBackend(mechanism="auto")
    kv = small_kv(pages=(4096,) * 8, blocks=256, device=backend.device)
    before = [t.tensor.clone() for t in kv.tensors]
    rng = np.random.default_rng(5)
    rounds = 4 * tuning.TRIALS + 4  # more than three candidates' trials, then decided launches
    with OffloadWorker(kv, 256, backend=backend) as worker:
        results = []
        for j in range(rounds):  # one job at a time: each its own launch, all of one class
            src, host = rng.permutation(256)[:32], rng.permutation(256)[:32]
            assert worker.submit_store(j, DeviceBlocks(src), HostBlocks(host))
            worker.wait([j])
            (r,) = worker.get_finished()
            results.append(r)
            assert r.success
            for t in kv.tensors:
                t.tensor[src] = 0
            assert worker.submit_load(1000 + j, HostBlocks(host), DeviceBlocks(src))
            worker.wait([1000 + j])
            (r,) = worker.get_finished()
            assert r.success
            for t, b in zip(kv.tensors, before):
                assert torch.equal(t.tensor[src], b[src]), (j, r.mechanism)
    stores = [r.mechanism for r in results]
    winners = backend._blocks.tuner.winners()
    assert winners, "the class was decided"
    if len(set(stores[: 2 * tuning.TRIALS])) > 1:  # more than one candidate: tried, then one kept
        assert len(set(stores[-3:])) == 1
    again = CudaBackend(mechanism="auto")
    assert again._blocks.tuner.winners() == winners


def test_a_store_sees_what_a_running_kernel_writes(forced):
    import torch

    kv = small_kv(pages=(1 << 20,), blocks=8, device=forced.device)
    with OffloadWorker(kv, 4, backend=forced) as worker:
        torch.cuda._sleep(50_000_000)  # the compute stream is busy for tens of milliseconds ...
        kv.tensors[0].tensor[3].fill_(7)  # ... before the model writes the block
        assert worker.submit_store(1, DeviceBlocks([3]), HostBlocks([2]))
        worker.wait([1])
        assert (worker.host_tensors[0][2] == 7).all()


def test_a_load_lands_after_pending_work_on_its_block(forced):
    import torch

    kv = small_kv(pages=(1 << 20,), blocks=8, device=forced.device)
    with OffloadWorker(kv, 4, backend=forced) as worker:
        worker.host_tensors[0][1].fill_(5)
        torch.cuda._sleep(50_000_000)
        kv.tensors[0].tensor[6].zero_()  # zeroing of a fresh block, still queued on the compute stream
        assert worker.submit_load(1, HostBlocks([1]), DeviceBlocks([6]))
        worker.wait([1])
        torch.cuda.synchronize()
        assert (kv.tensors[0].tensor[6] == 5).all()


def test_a_load_reads_what_a_store_still_queued_behind_the_model_writes(forced):
    """A load of a host block whose store still waits behind the model (its compute stream busy)
    waits for that store on the device and reads its bytes, not the row's old ones: the batch
    call could read small host rows through the CPU at once, out of stream order."""
    import torch

    kv = small_kv(pages=(1024,) * 4, blocks=8, device=forced.device)  # 4 KiB host rows: small copies
    with OffloadWorker(kv, 4, backend=forced) as worker:
        torch.cuda._sleep(50_000_000)
        for t in kv.tensors:
            t.tensor[3].fill_(7)  # the model writes the block after the sleep
        assert worker.submit_store(1, DeviceBlocks([3]), HostBlocks([2]))
        assert worker.submit_load(2, HostBlocks([2]), DeviceBlocks([6]))
        worker.wait([1, 2])
        torch.cuda.synchronize()
        assert all(r.success for r in worker.get_finished())
        assert all((t.tensor[6] == 7).all() for t in kv.tensors)


def test_copies_run_on_a_non_default_current_stream(forced):
    import torch

    kv = small_kv(pages=(4096,) * 4, blocks=16, device=forced.device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), OffloadWorker(kv, 16, backend=forced) as worker:
        kv.tensors[0].tensor[5].fill_(9)  # written on the side stream, which is now current
        assert worker.submit_store(1, DeviceBlocks([5]), HostBlocks([0]))
        worker.wait([1])
        assert (worker.host_tensors[0][0] == 9).all()


def test_memory_allocated_and_registered_on_a_fresh_thread_is_device_addressable():
    """Driver calls need the context current in their thread; a new thread has none until a
    runtime call (an engine may build its worker, or a queue its scratch, on any thread)."""
    import threading

    import torch

    backend = CudaBackend()
    out = {}

    def work():
        out["pinned"] = backend.alloc_host(1 << 20)
        out["plain"] = plain = torch.zeros(1 << 20, dtype=torch.uint8)
        out["registered"] = backend.pin_host_memory(plain)
        backend.unpin_host_memory(plain)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    pinned = out["pinned"]
    assert backend.addressable(pinned.data_ptr(), pinned.numel())
    assert out["registered"]


def test_jobs_launched_on_threads_that_made_no_cuda_call_yet_move_their_bytes(forced):
    """A store and a load submitted from a new thread, which enqueues them itself, then loads
    coalesced behind a busy compute stream, which the queue's launcher thread enqueues while
    this thread sleeps: neither thread has made a runtime call before its first enqueue."""
    import threading
    import time

    import torch

    kv = small_kv(pages=(1024,) * 8, blocks=16, device=forced.device)
    before = [t.tensor.clone() for t in kv.tensors]
    with OffloadWorker(kv, 16, backend=forced) as worker:

        def round_trip():
            assert worker.submit_store(1, DeviceBlocks([3, 7, 1]), HostBlocks([9, 2, 12]))
            worker.wait([1])
            assert worker.submit_load(2, HostBlocks([9, 2, 12]), DeviceBlocks([10, 11, 15]))
            worker.wait([2])

        thread = threading.Thread(target=round_trip)
        thread.start()
        thread.join()
        torch.cuda._sleep(20_000_000)  # the next loads wait for the compute stream: they coalesce
        for j in range(4):
            assert worker.submit_load(10 + j, HostBlocks([9 - j]), DeviceBlocks([4 + j]))
        # The launcher thread enqueues what waits, before `wait` could (no fixed sleep: its first
        # launch of a kernel may compile it, which takes longer than any fixed pause)
        deadline = time.monotonic() + 60
        while worker._queues[Direction.LOAD].waiting_for_launch() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker._queues[Direction.LOAD].waiting_for_launch()
        worker.wait(range(10, 14))
        results = worker.get_finished()
        assert [r.success for r in results] == [True] * 6, results
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[[10, 11, 15]], b[[3, 7, 1]])
            assert torch.equal(t.tensor[[4]], b[[3]])  # host block 9 came back into device block 4


# ---- compact jobs: the device expansion against the reference --------------------------------


@settings(max_examples=30, deadline=None)
@given(case=round_trips())
def test_compact_jobs_are_bit_exact(expanding, case):
    """Blocks per chunk, partial first chunks, several groups sharing tensors, padded pages."""
    results = check_round_trip(expanding, case)
    assert {r.mechanism for r in results} <= {expanding.mechanism, ""}  # "": a job of no blocks


@pytest.mark.parametrize("a, b, heads, bpc", [(4, 2, 2, 2), (4, 4, 1, 2), (2, 4, 4, 2), (4, 2, 2, 1), (2, 4, 4, 1)])
def test_compact_canonical_jobs_with_writer_election(expanding, a, b, heads, bpc):
    """In the default region directory (/dev/shm): the driver registers its memory, so
    ``expand_direct`` reaches it (a file elsewhere may not be registrable). One block per chunk:
    simple jobs, whose election reads the host ids of their two-column tables."""
    import torch
    from test_canonical import load_all, store_all
    from tp_ranks import full_model, rank_kv

    full = full_model(heads)
    num_host = 8
    src, dst = [1, 4, 5, 7], [9, 2, 3, 0]
    hosts, index = ([6, 2, 3], 1) if bpc == 2 else ([6, 2, 3, 5], 0)
    name = f"test-{os.getpid()}-{expanding.mechanism}-{a}{b}{heads}{bpc}"
    regions = store_all(expanding, a, full, name, None, src, hosts, bpc, num_host, block_index=index)
    try:
        for rank, kv in enumerate(load_all(expanding, b, full, regions, dst, hosts, bpc, num_host, block_index=index)):
            for t, e in zip(kv.tensors, rank_kv(full, b, rank).tensors):
                assert torch.equal(t.tensor.cpu()[dst], e.tensor[src])
    finally:
        for r in reversed(regions):
            r.close()


def test_compact_small_jobs_back_to_back_are_bit_exact(monkeypatch):
    """Small simple jobs back to back by expand_direct, scattered host blocks: the queue joins
    waiting jobs into launches in host order; every byte checked both ways (device blocks no
    load wrote unchanged)."""
    import torch

    monkeypatch.delenv("OFFLOAD_CORE_CUDA_CONF", raising=False)  # the defaults, whatever the shell set
    backend = CudaBackend(mechanism="expand_direct")
    pages, blocks, jobs, per_job = (1024, 256, 512), 128, 40, 3
    kv = small_kv(pages=pages, blocks=blocks, device=backend.device)
    before = [t.tensor.clone() for t in kv.tensors]
    rng = np.random.default_rng(7)
    with OffloadWorker(kv, jobs * per_job, backend=backend) as worker:
        host_ids = rng.permutation(jobs * per_job)
        src = [rng.permutation(blocks // 2)[:per_job] for _ in range(jobs)]
        for j in range(jobs):
            assert worker.submit_store(j, DeviceBlocks(src[j]), HostBlocks(host_ids[j * per_job : (j + 1) * per_job]))
        worker.wait(range(jobs))
        dst = [blocks // 2 + rng.permutation(blocks // 2)[:per_job] for _ in range(jobs)]
        for j in range(jobs):  # into the other half; jobs that write one block go in separate launches, in order
            worker.submit_load(100 + j, HostBlocks(host_ids[j * per_job : (j + 1) * per_job]), DeviceBlocks(dst[j]))
        worker.wait(range(100, 100 + jobs))
        results = worker.get_finished()
        assert len(results) == 2 * jobs and all(r.success for r in results)
        for j in range(jobs):
            rows = host_ids[j * per_job : (j + 1) * per_job]
            for h, b in zip(worker.host_tensors, before):
                assert torch.equal(h[rows].to(backend.device), b[src[j]])
    last = {int(d): int(s) for j in range(jobs) for d, s in zip(dst[j], src[j])}  # each block's last load
    untouched = [i for i in range(blocks) if i not in last]
    for t, b in zip(kv.tensors, before):
        assert torch.equal(t.tensor[list(last)], b[list(last.values())])
        assert torch.equal(t.tensor[untouched], b[untouched])


@pytest.mark.parametrize(
    "pages, per_job, cheapest",
    [
        ((65536,), 64, "ce_batch"),  # one tensor's 64 KiB pages over scattered host rows
        ((4096,) * 8, 64, "expand_direct"),  # 4 KiB pages over 8 tensors, 2 MiB jobs
    ],
)
def test_compact_jobs_auto_sends_past_staging_are_bit_exact(pages, per_job, cheapest, monkeypatch):
    """`auto`'s choices that skip staging (`BlockCopier.choose`), the cost model made to rate
    `cheapest` so: the mechanism each job reports, and every byte both ways."""
    import torch

    backend = CudaBackend(mechanism="auto", tune=False)  # the cost model's pick, untried
    monkeypatch.setattr(backend._blocks, "_estimates", lambda *args: {"expand_staged": 1.0, cheapest: 0.5})
    blocks, jobs = 4 * per_job, 4
    kv = small_kv(pages=pages, blocks=blocks, device=backend.device)
    before = [t.tensor.clone() for t in kv.tensors]
    rng = np.random.default_rng(3)
    host_ids = rng.permutation(4 * jobs * per_job)  # rows apart, as an engine's jobs find them
    src = [rng.permutation(blocks)[:per_job] for _ in range(jobs)]
    with OffloadWorker(kv, 4 * jobs * per_job, backend=backend) as worker:
        for j in range(jobs):
            assert worker.submit_store(j, DeviceBlocks(src[j]), HostBlocks(host_ids[j * per_job : (j + 1) * per_job]))
        worker.wait(range(jobs))
        for t in kv.tensors:
            t.tensor.zero_()
        for j in range(jobs):  # each job's blocks back where they came from, one job after another
            worker.submit_load(100 + j, HostBlocks(host_ids[j * per_job : (j + 1) * per_job]), DeviceBlocks(src[j]))
            worker.wait([100 + j])
        results = worker.get_finished()
    assert len(results) == 2 * jobs and all(r.success for r in results)
    assert {r.mechanism for r in results} == {cheapest}
    stored = sorted({int(b) for s in src for b in s})
    for t, b in zip(kv.tensors, before):
        assert torch.equal(t.tensor[stored], b[stored])
        others = [i for i in range(blocks) if i not in set(stored)]
        assert not t.tensor[others].any(), "no load wrote a block it was not given"


@pytest.mark.parametrize("staging_kib, consecutive", [(16, True), (16, False), (24 << 10, True)])
def test_compact_jobs_back_to_back_through_small_staging(staging_kib, consecutive):
    """Jobs cut into pieces (a staging half holds a few rows), segments over consecutive host rows
    cut at the pieces' edges, and many jobs in flight through the two halves: every byte checked."""
    import torch

    backend = CudaBackend(mechanism="expand_staged", staging_bytes=staging_kib << 10)
    pages, blocks, jobs, per_job = (4096, 1024, 512, 1024), 96, 12, 8
    kv = small_kv(pages=pages, blocks=blocks, device=backend.device)
    before = [t.tensor.clone() for t in kv.tensors]
    rng = np.random.default_rng(staging_kib)
    with OffloadWorker(kv, jobs * per_job, backend=backend) as worker:
        host_ids = np.arange(jobs * per_job) if consecutive else rng.permutation(jobs * per_job)
        src = [rng.permutation(blocks // 2)[:per_job] for _ in range(jobs)]
        for j in range(jobs):
            assert worker.submit_store(j, DeviceBlocks(src[j]), HostBlocks(host_ids[j * per_job : (j + 1) * per_job]))
        worker.wait(range(jobs))
        for j in range(jobs):  # into the other half of the device blocks
            dst = blocks // 2 + np.arange(per_job) + (j % 6) * per_job
            assert worker.submit_load(100 + j, HostBlocks(host_ids[j * per_job : (j + 1) * per_job]), DeviceBlocks(dst))
            worker.wait([100 + j])
            for t, b in zip(kv.tensors, before):
                assert torch.equal(t.tensor[dst], b[src[j]])
        results = worker.get_finished()
        assert len(results) == 2 * jobs and all(r.success for r in results)
        assert {r.mechanism for r in results} == {"expand_staged"}
        for j in range(jobs):
            rows = host_ids[j * per_job : (j + 1) * per_job]
            for h, b in zip(worker.host_tensors, before):
                assert torch.equal(h[rows].to(backend.device), b[src[j]])


@pytest.mark.parametrize("mechanism", ["expand_staged", "auto"])
def test_host_rows_larger_than_a_staging_half(mechanism):
    """Rows of 6.5 KiB against halves of 4 KiB: forced staging refuses the jobs (failed results,
    no kernel writing past a half); auto moves them another way, every byte right."""
    import torch

    backend = CudaBackend(mechanism=mechanism, staging_bytes=4 << 10)
    kv = small_kv(pages=(4096, 1024, 512, 1024), blocks=32, device=backend.device)
    before = [t.tensor.clone() for t in kv.tensors]
    src, dst, host = [3, 1, 4, 15, 9, 2], [20, 21, 22, 23, 24, 25], [7, 0, 5, 2, 6, 1]
    with OffloadWorker(kv, 8, backend=backend) as worker:
        assert worker.submit_store(1, DeviceBlocks(src), HostBlocks(host))
        worker.wait([1])
        assert worker.submit_load(2, HostBlocks(host), DeviceBlocks(dst))
        worker.wait([2])
        results = worker.get_finished()
    if mechanism == "expand_staged":
        assert [r.success for r in results] == [False, False]
        return
    assert all(r.success for r in results) and {r.mechanism for r in results} <= {"expand_direct", "ce_batch"}
    for t, b in zip(kv.tensors, before):
        assert torch.equal(t.tensor[dst], b[src])


@pytest.mark.parametrize("mechanism", mechanisms(["expand_staged"]))
def test_a_shut_down_workers_staging_goes_back(mechanism):
    """Staging is kept per copy stream; a worker's shutdown gives its lanes' back, so a process
    that makes workers one after another does not grow."""
    import torch

    backend = CudaBackend(mechanism=mechanism)
    kv = small_kv(pages=(4096, 1024), blocks=8, device=backend.device)
    before = [t.tensor.clone() for t in kv.tensors]
    for round_ in range(3):
        with OffloadWorker(kv, 8, backend=backend) as worker:
            assert worker.submit_store(1, DeviceBlocks([1, 3]), HostBlocks([round_, 7]))
            worker.wait([1])  # lanes are not ordered against each other
            assert worker.submit_load(2, HostBlocks([round_, 7]), DeviceBlocks([5, 6]), expedited=True)
            worker.wait([2])
            assert backend._blocks.staging.values()  # each lane that copied has its staging
        assert backend._blocks.staging.values() == []
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[[5, 6]], b[[1, 3]])


@pytest.mark.parametrize("mechanism", ["expand_staged", "auto"])
def test_a_workers_staging_and_ring_stay_within_128_mib_by_default(mechanism, monkeypatch):
    """Every lane staged (stores, loads, expedited loads) on a fresh backend at its default
    sizes: the device memory it takes, the KV tensors aside, is at most 128 MiB."""
    import torch

    monkeypatch.delenv("OFFLOAD_CORE_CUDA_CONF", raising=False)
    kv = small_kv(pages=(4096, 1024), blocks=64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    backend = CudaBackend(mechanism=mechanism)
    with OffloadWorker(kv, 64, backend=backend) as worker:
        for j in range(3):
            ids = np.arange(16 * j, 16 * j + 16)
            assert worker.submit_store(3 * j, DeviceBlocks(ids), HostBlocks(ids))
            worker.wait([3 * j])
            assert worker.submit_load(3 * j + 1, HostBlocks(ids), DeviceBlocks(ids))
            assert worker.submit_load(3 * j + 2, HostBlocks(ids), DeviceBlocks(ids), expedited=True)
            worker.wait([3 * j + 1, 3 * j + 2])
        assert all(r.success for r in worker.get_finished())
        if mechanism == "expand_staged":
            assert len(backend._blocks.staging.values()) == 3  # each lane staged
        used = torch.cuda.max_memory_allocated() - before
    assert used <= 128 << 20, f"{used / 2**20:.1f} MiB"


def test_the_sm_penalty_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_penalty:3.5")
    backend = CudaBackend()
    assert backend.cost.sm_penalty == 3.5
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_penalty:0")
    with pytest.raises(ValueError, match="OFFLOAD_CORE_CUDA_CONF sm_penalty must be a positive number, got '0'"):
        CudaBackend()
