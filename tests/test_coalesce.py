"""Compact jobs are coalesced: jobs waiting while a launch is enqueued go to the device as one,
with results per job, in order; never two writes of the same bytes in one launch; failures and
back-pressure reported. On the cpu backend that expands compact jobs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from offload_core import DeviceBlocks, HostBlocks, OffloadWorker
from offload_core import queue as queue_module
from offload_core.queue import enqueue_lock
from offload_core.testing.expanding import ExpandingCpuBackend

from helpers import small_kv

pytestmark = pytest.mark.cpu


def store(worker, job_id, dev, host):
    assert worker.submit_store(job_id, DeviceBlocks(dev), HostBlocks(host))


def until(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def first_in_flight(worker, job_id=0, dev=(0,), host=(0,)):
    """Submit a job from another thread, which launches it (the device is idle) and blocks on the
    held enqueue lock: jobs submitted now wait for a launch. Returns that thread."""
    queue = worker._queues[next(iter(worker._queues))]
    thread = threading.Thread(target=store, args=(worker, job_id, list(dev), list(host)))
    thread.start()
    until(lambda: queue._launching)
    return thread


@pytest.fixture
def held():
    """A backend whose enqueue lock the test holds: the first launch blocks on it, so later jobs
    wait, and go together."""
    backend = ExpandingCpuBackend()
    lock = enqueue_lock(backend)
    lock.acquire()
    yield backend, lock
    if lock.locked():
        lock.release()


def test_jobs_waiting_for_a_launch_go_as_one_with_results_per_job(held):
    backend, lock = held
    kv = small_kv(pages=(64, 32), blocks=32)
    with OffloadWorker(kv, 32, backend=backend) as worker:
        first = first_in_flight(worker)
        for j in range(1, 9):
            store(worker, j, [2 * j, 2 * j + 1], [2 * j, 2 * j + 1])
        lock.release()
        first.join()
        worker.wait(range(9))
        results = worker.get_finished()
        assert [r.job_id for r in results] == list(range(9))
        assert [r.transfer_size for r in results] == [96] + [192] * 8
        assert all(r.success for r in results)
        stats = worker.stats()["store"]
        assert (stats.jobs, stats.launches) == (9, 2)
        for t, h in zip(kv.tensors, worker.host_tensors):
            ids = [0] + list(range(2, 18))
            assert torch.equal(h[ids], t.tensor[ids])


def test_two_writes_of_the_same_bytes_never_share_a_launch(held):
    backend, lock = held
    kv = small_kv(pages=(64,), blocks=32)
    with OffloadWorker(kv, 8, backend=backend) as worker:
        first = first_in_flight(worker)
        store(worker, 1, [1], [5])
        store(worker, 2, [2], [5])  # host block 5 again: must land after job 1
        store(worker, 3, [3], [6])
        lock.release()
        first.join()
        worker.wait(range(4))
        assert [r.job_id for r in worker.get_finished()] == [0, 1, 2, 3]
        assert worker.stats()["store"].launches == 3  # 0; 1; 2 and 3
        assert torch.equal(worker.host_tensors[0][5], kv.tensors[0].tensor[2])


def test_a_launch_that_fails_fails_its_jobs_and_the_queue_goes_on():
    class Flaky(ExpandingCpuBackend):
        fail = True

        def copy_blocks(self, job, prepared, stream, after):
            if self.fail:
                self.fail = False
                raise RuntimeError("injected enqueue failure")
            return super().copy_blocks(job, prepared, stream, after)

    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 8, backend=Flaky()) as worker:
        store(worker, 1, [1], [1])
        worker.wait([1])
        store(worker, 2, [2], [2])
        worker.wait([2])
        results = {r.job_id: r for r in worker.get_finished()}
        assert not results[1].success and results[1].transfer_size == 64
        assert results[2].success
        assert worker.stats()["store"].failed == 1
        assert torch.equal(worker.host_tensors[0][2], kv.tensors[0].tensor[2])


def test_submit_waits_when_too_many_jobs_wait_for_a_launch(held, monkeypatch):
    backend, lock = held
    monkeypatch.setattr(queue_module, "MAX_PENDING", 3)
    kv = small_kv(pages=(64,), blocks=32)
    with OffloadWorker(kv, 32, backend=backend) as worker:
        first = first_in_flight(worker)
        for j in range(1, 4):
            store(worker, j, [j], [j])
        done = threading.Event()
        blocked = threading.Thread(target=lambda: (store(worker, 4, [4], [4]), done.set()))
        blocked.start()
        time.sleep(0.05)
        assert not done.is_set()  # three jobs wait for a launch: the fourth waits for room
        lock.release()
        first.join()
        blocked.join(10)
        assert done.is_set()
        worker.wait(range(5))
        assert [r.job_id for r in worker.get_finished()] == list(range(5))
        stats = worker.stats()["store"]
        assert stats.backpressure_waits == 1 and stats.backpressure_s > 0


def test_wait_for_a_job_not_yet_launched_returns_once_it_has_landed(held):
    backend, lock = held
    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 8, backend=backend) as worker:
        first = first_in_flight(worker)
        store(worker, 1, [1], [1])
        threading.Timer(0.05, lock.release).start()
        worker.wait([1])
        first.join()
        assert torch.equal(worker.host_tensors[0][1], kv.tensors[0].tensor[1])


def test_shutdown_launches_what_waits_and_stops_the_launchers(held):
    backend, lock = held
    kv = small_kv(pages=(64,), blocks=16)
    worker = OffloadWorker(kv, 8, backend=backend)
    queue = worker._queues[next(iter(worker._queues))]
    first = first_in_flight(worker)
    store(worker, 1, [1], [1])
    threading.Timer(0.05, lock.release).start()
    worker.shutdown()
    first.join()
    assert sorted(r.job_id for r in worker.get_finished()) == [0, 1]
    queue._launcher.join(5)
    assert not queue._launcher.is_alive()


def test_a_lone_job_on_an_idle_device_is_launched_by_its_submit():
    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 8, backend=ExpandingCpuBackend()) as worker:
        store(worker, 1, [1], [1])
        queue = worker._queues[next(iter(worker._queues))]
        assert queue.stats.launches == 1 and not queue._pending  # launched before submit returned
        assert queue._launcher is not None
