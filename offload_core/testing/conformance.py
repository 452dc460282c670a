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

import numpy as np
import pytest
import torch

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker
from offload_core.backend import Backend, Direction
from offload_core.testing.reference import reference_transfer


def _random_bytes(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


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
