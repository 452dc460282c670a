"""The suite every backend must pass.

Use it from any test module with a ``backend`` fixture that returns a ready `Backend`::

    from offload_core.testing.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend(self):
            return MyBackend()

Every check compares against host memory and the reference model, byte for byte.
"""

from __future__ import annotations

import gc
import time
from unittest import mock

import numpy as np
import pytest
import torch

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker
from offload_core.backend import Backend, Direction
from offload_core.testing.reference import reference_transfer


def _random_bytes(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


BUSY = 64 << 20  # a copy long enough that work ordered after it, and not waiting, shows


def _one(value: int) -> np.ndarray:
    return np.array([value], dtype=np.int64)


def _busy(backend: Backend, stream, fill: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """`BUSY` bytes of `fill` loaded into a device buffer on `stream`; the buffers, to keep."""
    host = backend.alloc_host(BUSY)
    host.fill_(fill)
    device = torch.zeros(BUSY, dtype=torch.uint8, device=backend.device)
    backend.register_buffer(device)
    backend.copy_batch(_one(host.data_ptr()), _one(device.data_ptr()), _one(BUSY), Direction.LOAD, stream)
    return host, device


def _disjoint_descriptors(rng: np.random.Generator, count: int, max_size: int, space: int):
    """`count` sizes and non-overlapping destination offsets inside `space` bytes, in random order."""
    sizes = rng.integers(1, max_size + 1, count)
    gaps = rng.integers(0, 64, count)
    slots = np.cumsum(sizes + gaps) - sizes
    assert slots[-1] + sizes[-1] <= space
    order = rng.permutation(count)
    return sizes[order].astype(np.int64), slots[order].astype(np.int64)


class BackendConformance:
    """Checks of the `Backend` contract; needs a ``backend`` fixture."""

    def test_probe_is_idempotent_and_passes(self, backend: Backend) -> None:
        assert type(backend).probe() is None
        assert type(backend).probe() is None

    def test_device_type_is_the_backend_name(self, backend: Backend) -> None:
        # A worker finds the backend of its KV tensors' device by this name; a backend over
        # host memory (a third party's: the name `cpu` is taken) is found by name only.
        assert backend.device.type in (backend.name, "cpu"), (
            f"backend {backend.name!r} copies {backend.device}: an accelerator's backend must be named after "
            f"its torch device type ({backend.device.type!r})"
        )

    def test_alloc_host_is_zeroed_host_memory(self, backend: Backend) -> None:
        host = backend.alloc_host(1 << 16)
        assert host.device.type == "cpu" and host.dtype == torch.uint8 and host.numel() == 1 << 16
        assert not host.any()

    @pytest.mark.parametrize("direction", list(Direction))
    def test_copy_batch_matches_reference(self, backend: Backend, direction: Direction) -> None:
        rng = np.random.default_rng(1234 + (direction is Direction.LOAD))
        space = 1 << 20
        device = _random_bytes(rng, space).to(backend.device)
        host = backend.alloc_host(space)
        host.copy_(_random_bytes(rng, space))
        backend.register_buffer(device)
        src_buf, dst_buf = (device, host) if direction is Direction.STORE else (host, device)
        before_src, expected = src_buf.cpu().numpy().copy(), dst_buf.cpu().numpy().copy()

        count = 300
        sizes, dst_off = _disjoint_descriptors(rng, count, 2000, space)
        src_off = rng.integers(0, space - sizes)
        for s, d, n in zip(src_off, dst_off, sizes):
            expected[d : d + n] = before_src[s : s + n]

        stream, done = backend.new_stream(), backend.new_event()
        backend.copy_batch(src_buf.data_ptr() + src_off, dst_buf.data_ptr() + dst_off, sizes, direction, stream)
        done.record(stream)
        done.synchronize()
        assert done.query()
        np.testing.assert_array_equal(dst_buf.cpu().numpy(), expected)
        np.testing.assert_array_equal(src_buf.cpu().numpy(), before_src)

    def test_events_order_work_across_streams(self, backend: Backend) -> None:
        a, b = backend.new_stream(), backend.new_stream()
        start, mid, end = backend.new_event(), backend.new_event(), backend.new_event()
        n = 1 << 20
        host = backend.alloc_host(2 * n)
        host[:n].copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
        device = torch.zeros(n, dtype=torch.uint8, device=backend.device)
        backend.register_buffer(device)
        one = np.ones(1, dtype=np.int64)
        start.record(a)
        backend.copy_batch(one * host.data_ptr(), one * device.data_ptr(), one * n, Direction.LOAD, a)
        mid.record(a)
        b.wait_event(mid)  # b must not read device before a's load lands
        backend.copy_batch(one * device.data_ptr(), one * (host.data_ptr() + n), one * n, Direction.STORE, b)
        end.record(b)
        end.synchronize()
        assert start.query() and mid.query() and end.query()
        assert torch.equal(host[n:], host[:n])
        assert start.elapsed_time(mid) >= 0

    def test_streams_are_the_callers_own_and_new_ones_apart(self, backend: Backend) -> None:
        """`current_stream` is the caller's compute stream, the same each call; every
        `new_stream` is a stream of its own (lanes that shared one would serialize)."""
        compute, a, b = backend.current_stream(), backend.new_stream(), backend.new_stream()
        assert backend.current_stream() == compute
        assert a != b and compute not in (a, b)

    def test_alloc_host_gives_each_call_memory_of_its_own(self, backend: Backend) -> None:
        a, b = backend.alloc_host(4096), backend.alloc_host(4096)
        a.fill_(1)
        assert a.is_contiguous() and b.is_contiguous() and not b.any()

    def test_pin_host_memory_says_what_it_did(self, backend: Backend) -> None:
        # Page-aligned, as some runtimes require; its storage starts there too (torch asks the
        # storage's first byte whether a tensor is pinned).
        raw = np.zeros((1 << 16) + 4096, dtype=np.uint8)
        start = -raw.ctypes.data % 4096
        tensor = torch.from_numpy(raw[start : start + (1 << 16)])
        pinned = backend.pin_host_memory(tensor)
        try:
            assert tensor.is_pinned() == pinned
        finally:
            if pinned:  # memory still registered once freed would fail later copies into it
                backend.unpin_host_memory(tensor)
        assert not tensor.is_pinned()

    def test_large_batches_and_copies_arrive_whole(self, backend: Backend) -> None:
        """20,000 copies of 1-32 bytes in one batch, and copies of 1, 3 and 16 MiB and odd bytes:
        engines send batches and merged runs that large."""
        rng = np.random.default_rng(5)
        sizes = np.concatenate([rng.integers(1, 33, 20000), [(1 << 20) + 3, (16 << 20) + 5, 3 << 20]])
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        host = backend.alloc_host(int(sizes.sum()))
        host.copy_(_random_bytes(rng, host.numel()))
        device = torch.zeros(host.numel(), dtype=torch.uint8, device=backend.device)
        backend.register_buffer(device)
        order = rng.permutation(sizes.size)
        stream, done = backend.new_stream(), backend.new_event()
        at = offsets[order]
        backend.copy_batch(
            host.data_ptr() + at, device.data_ptr() + at, sizes[order].astype(np.int64), Direction.LOAD, stream
        )
        done.record(stream)
        done.synchronize()
        assert torch.equal(device.cpu(), host)

    def test_query_true_means_the_work_is_done(self, backend: Backend) -> None:
        """The queue reports a job, and the engine reuses its blocks, once `query` says True,
        without a `synchronize` (a backend whose work waits for one may keep saying False)."""
        stream, done = backend.new_stream(), backend.new_event()
        _, device = _busy(backend, stream)
        done.record(stream)
        deadline = time.monotonic() + 0.5
        while not done.query() and time.monotonic() < deadline:
            time.sleep(1e-4)
        if done.query():
            assert bool(device[:4096].eq(7).all()) and bool(device[-4096:].eq(7).all())
        done.synchronize()
        assert bool(device.eq(7).all())

    def test_an_event_recorded_again_marks_the_new_position(self, backend: Backend) -> None:
        """The queue records pooled events again for later launches."""
        stream, event = backend.new_stream(), backend.new_event()
        event.record(stream)
        event.synchronize()
        _, device = _busy(backend, stream)
        event.record(stream)
        event.synchronize()
        assert bool(device.eq(7).all())

    @pytest.mark.parametrize("by", ["wait_event", "wait_stream"])
    def test_a_stream_waits_for_a_long_copy_on_another(self, backend: Backend, by: str) -> None:
        a, b, mark, done = backend.new_stream(), backend.new_stream(), backend.new_event(), backend.new_event()
        out = backend.alloc_host(BUSY)
        _, device = _busy(backend, a)
        if by == "wait_event":
            mark.record(a)
            b.wait_event(mark)
        else:
            b.wait_stream(a)
        backend.copy_batch(_one(device.data_ptr()), _one(out.data_ptr()), _one(BUSY), Direction.STORE, b)
        done.record(b)
        done.synchronize()
        assert bool(out.eq(7).all())

    def _one_tensor_worker(self, backend: Backend, blocks: int = 64, page: int = 1 << 16):
        kv = torch.zeros(blocks, page, dtype=torch.uint8, device=backend.device)
        return kv, OffloadWorker(KVCaches([KVCacheTensor(kv, page)], [[KVCacheRef(0, page)]]), blocks, backend=backend)

    def _model_writes(self, backend: Backend, kv: torch.Tensor, blocks: int) -> tuple:
        """The model's write of 9s into the first `blocks` blocks behind a long copy, ordered
        before the compute stream's next work; the buffers, to keep until the copies have run.
        (On a stream of its own that the compute stream waits for: `copy_batch` is given lane
        streams only, and cuda's batch call refuses the legacy default stream.)"""
        model = backend.new_stream()
        new = backend.alloc_host(blocks * kv.shape[1])
        new.fill_(9)
        kept = _busy(backend, model)
        backend.copy_batch(_one(new.data_ptr()), _one(kv.data_ptr()), _one(new.numel()), Direction.LOAD, model)
        backend.current_stream().wait_stream(model)
        return (*kept, new)

    def test_a_store_reads_what_the_compute_stream_wrote_before_it(self, backend: Backend) -> None:
        """The model writes blocks (work the compute stream is ordered behind) and submits their
        store at once: the store must read the new bytes."""
        kv, worker = self._one_tensor_worker(backend)
        with worker:
            kept = self._model_writes(backend, kv, 8)
            assert worker.submit_store(1, DeviceBlocks(np.arange(8)), HostBlocks(np.arange(8)))
            worker.wait([1])
            assert all(r.success for r in worker.get_finished())
            assert bool(torch.cat(worker.host_tensors, dim=1).view(torch.uint8)[:8].eq(9).all())
        del kept

    def test_a_load_of_rows_a_store_still_writes_reads_the_stored_bytes(self, backend: Backend) -> None:
        kv, worker = self._one_tensor_worker(backend)
        with worker:
            kept = self._model_writes(backend, kv, 32)
            assert worker.submit_store(1, DeviceBlocks(np.arange(32)), HostBlocks(np.arange(32)))
            assert worker.submit_load(2, HostBlocks(np.arange(32)), DeviceBlocks(np.arange(32, 64)))
            worker.wait([1, 2])
            assert all(r.success for r in worker.get_finished())
            assert bool(kv[32:].eq(9).all())
        del kept

    @pytest.mark.parametrize("enqueued", [False, True], ids=["before-enqueue", "after-enqueue"])
    def test_a_launch_that_raises_fails_its_jobs_and_the_lane_goes_on(self, backend: Backend, enqueued: bool) -> None:
        """A fault at a launch (`copy_blocks` raising as a driver's error does, before or after it
        enqueued its copies) fails that launch's jobs, each reported once; the jobs after it, on
        the same streams, move every byte."""
        kv, worker = self._one_tensor_worker(backend, blocks=16, page=256)
        kv.copy_(_random_bytes(np.random.default_rng(3), kv.numel()).view(kv.shape).to(backend.device))
        real, faults = backend.copy_blocks, [RuntimeError("an injected device fault")]

        def faulty(*args, **kwargs):
            if not faults:
                return real(*args, **kwargs)
            if enqueued:
                real(*args, **kwargs)
            raise faults.pop()

        with worker, mock.patch.object(backend, "copy_blocks", faulty):
            assert worker.submit_store(1, DeviceBlocks([0, 1]), HostBlocks([0, 1]))
            worker.wait([1])
            assert not faults, "the worker never launched job 1"
            assert worker.submit_store(2, DeviceBlocks([2, 3]), HostBlocks([4, 5]))
            assert worker.submit_load(3, HostBlocks([4, 5]), DeviceBlocks([8, 9]))
            worker.wait([2, 3])
            results = worker.get_finished()
            assert sorted((r.job_id, r.success) for r in results) == [(1, False), (2, True), (3, True)]
            host = torch.cat(worker.host_tensors, dim=1).view(torch.uint8)
            assert torch.equal(host[4:6], kv[2:4].cpu()) and torch.equal(kv[8:10], kv[2:4])

    def test_a_shut_down_worker_leaves_nothing_of_the_callers_alive(self, backend: Backend) -> None:
        """The registry keeps a backend for the life of the process: what it holds of a
        worker's KV tensors (a view is the memory too) it must hold weakly."""
        kv, worker = self._one_tensor_worker(backend, blocks=8, page=256)
        assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([0]))
        worker.shutdown()
        memory = kv.data_ptr()
        del kv, worker
        gc.collect()
        # type(), not isinstance: that asks some modules in the heap for `__class__`, which warns
        alive = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.data_ptr() == memory]
        assert not alive, "something keeps a shut-down worker's KV memory alive"

    @pytest.mark.parametrize("blocks_per_chunk, gap, expedited", [(1, 0, False), (3, 0, False), (3, 40, True)])
    def test_worker_round_trip(self, backend: Backend, blocks_per_chunk: int, gap: int, expedited: bool) -> None:
        """Stores and loads against the reference; with a `gap`, the KV tensors are strided views
        whose rows lie `gap` bytes apart beyond their length, and those bytes stay untouched;
        `expedited` loads go on their own lane."""
        rng = np.random.default_rng(blocks_per_chunk + gap)
        pages = [256, 512, 96]
        blocks = 24
        backing = [_random_bytes(rng, blocks * (p + gap)).view(blocks, p + gap).to(backend.device) for p in pages]
        gaps_before = [b[:, p:].cpu().numpy().copy() for b, p in zip(backing, pages)]
        tensors = [KVCacheTensor(b[:, :p], p) for b, p in zip(backing, pages)]
        refs = [[KVCacheRef(0, 256), KVCacheRef(1, 500)], [KVCacheRef(2, 96)]]
        kv = KVCaches(tensors, refs)
        before = [t.tensor.cpu().numpy().copy() for t in tensors]
        bpc = blocks_per_chunk
        sizes, indices = [5, 3], [2, 1]
        host_counts = [-(-(s + i % bpc) // bpc) for s, i in zip(sizes, indices)]
        host_ids = rng.permutation(8)[: sum(host_counts)]
        src_ids = rng.permutation(blocks // 2)[:8]
        dst_ids = blocks // 2 + rng.permutation(blocks // 2)[:8]
        with OffloadWorker(kv, 8, blocks_per_chunk=bpc, backend=backend) as worker:
            assert worker.submit_store(1, DeviceBlocks(src_ids, sizes, indices), HostBlocks(host_ids))
            worker.wait({1})  # the two directions are not ordered against each other
            assert worker.submit_load(
                2, HostBlocks(host_ids), DeviceBlocks(dst_ids, sizes, indices), expedited=expedited
            )
            worker.wait({1, 2})
            results = {r.job_id: r for r in worker.get_finished()}
            assert set(results) == {1, 2} and all(r.success for r in results.values())

            offsets = np.cumsum([0] + [p * bpc for p in pages])[:-1]
            rows = np.zeros((8, sum(pages) * bpc), dtype=np.uint8)
            expected = [b.copy() for b in before]
            plain = [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in refs]
            for direction, ids in ((Direction.STORE, src_ids), (Direction.LOAD, dst_ids)):
                reference_transfer(direction, expected, rows, offsets, plain, bpc, ids, sizes, indices, host_ids)
            for t, exp in zip(tensors, expected):
                np.testing.assert_array_equal(t.tensor.cpu().numpy(), exp)
            host_rows = torch.cat(worker.host_tensors, dim=1).view(torch.uint8).numpy()
            np.testing.assert_array_equal(host_rows, rows)
            for b, p, exp in zip(backing, pages, gaps_before):
                np.testing.assert_array_equal(b[:, p:].cpu().numpy(), exp)

    def test_jobs_back_to_back_match_the_reference(self, backend: Backend) -> None:
        """Many small jobs submitted back to back, as an engine does (random ids; the queue may
        join them into launches, `copy_blocks` of the joined job in host order),
        then loads of what they stored into other blocks: every byte as the reference model
        moves them, whichever way the launches went."""
        rng = np.random.default_rng(7)
        pages, blocks, hosts, jobs = [192, 64, 320], 64, 48, 12
        tensors = [KVCacheTensor(_random_bytes(rng, blocks * p).view(blocks, p).to(backend.device), p) for p in pages]
        refs = [[KVCacheRef(0, 192), KVCacheRef(1, 64), KVCacheRef(2, 320)]]
        kv = KVCaches(tensors, refs)
        expected = [t.tensor.cpu().numpy().copy() for t in tensors]
        rows = np.zeros((hosts, sum(pages)), dtype=np.uint8)
        offsets = np.cumsum([0] + pages)[:-1]
        plain = [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in refs]
        host_ids = rng.permutation(hosts)[: 3 * jobs].reshape(jobs, 3)  # no two jobs write one row
        src_ids = [rng.permutation(blocks // 2)[:3] for _ in range(jobs)]
        dst_ids = (blocks // 2 + rng.permutation(blocks // 2)[: 2 * jobs]).reshape(jobs, 2)
        with OffloadWorker(kv, hosts, backend=backend) as worker:
            for j in range(jobs):
                assert worker.submit_store(j, DeviceBlocks(src_ids[j]), HostBlocks(host_ids[j]))
            worker.wait(range(jobs))
            for j in range(jobs):  # each load takes two of a job's three rows, into fresh blocks
                assert worker.submit_load(100 + j, HostBlocks(host_ids[j][1:]), DeviceBlocks(dst_ids[j]))
            worker.wait(range(100, 100 + jobs))
            results = worker.get_finished()
            assert sorted(r.job_id for r in results) == [*range(jobs), *range(100, 100 + jobs)]
            assert all(r.success for r in results)
            for j in range(jobs):  # job j's load reads only rows that job j's store wrote
                reference_transfer(
                    Direction.STORE, expected, rows, offsets, plain, 1, src_ids[j], [3], [0], host_ids[j]
                )
                reference_transfer(
                    Direction.LOAD, expected, rows, offsets, plain, 1, dst_ids[j], [2], [0], host_ids[j][1:]
                )
            for t, exp in zip(tensors, expected):
                np.testing.assert_array_equal(t.tensor.cpu().numpy(), exp)
            host_rows = torch.cat(worker.host_tensors, dim=1).view(torch.uint8).numpy()
            np.testing.assert_array_equal(host_rows, rows)
