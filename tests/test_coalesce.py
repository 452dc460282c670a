"""Compact jobs are coalesced: jobs waiting while a launch is enqueued go to the device as one,
with results per job, in order; never two writes of the same bytes in one launch; failures and
back-pressure reported. On the cpu backend that expands compact jobs."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import PinnedWindow, compiled_or_skip, small_kv

import offload_core.queue as queue_module
from offload_core import DeviceBlocks, HostBlocks, OffloadWorker
from offload_core.backend import Direction, enqueue_lock
from offload_core.backends.cpu import CpuEvent
from offload_core.testing.expanding import ExpandingCpuBackend

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def core_steps(request, monkeypatch):
    """Every test on both kinds of the core's steps: the compiled ones (skipped where they were not
    built) and their twins, numpy's (``OFFLOAD_CORE_NATIVE=0``)."""
    if request.param == "compiled":
        compiled_or_skip(True)
    else:
        monkeypatch.setenv("OFFLOAD_CORE_NATIVE", "0")


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


def one_then_eight(worker, lock):
    """Job 0 launched alone (its launch blocks on the held `lock`), jobs 1-8 submitted meanwhile
    (they wait, for one launch together), then the lock released and all nine jobs done."""
    first = first_in_flight(worker)
    for j in range(1, 9):
        store(worker, j, [2 * j, 2 * j + 1], [2 * j, 2 * j + 1])
    lock.release()
    first.join()
    worker.wait(range(9))


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
        one_then_eight(worker, lock)
        results = worker.get_finished()
        assert [r.job_id for r in results] == list(range(9))
        assert [r.transfer_size for r in results] == [96] + [192] * 8
        pool = worker._queues[Direction.STORE]._free_events
        assert len({id(e) for e in pool}) == len(pool)  # a launch's shared events go back once, not per job
        assert all(r.success for r in results)
        stats = worker.stats()["store"]
        assert (stats.jobs, stats.launches, backend.jobs) == (9, 2, 2)
        assert stats.descriptors == 17 * len(kv.tensors) and stats.bytes == 96 * 17
        assert {r.mechanism for r in results} == {"expand_staged"}
        for t, h in zip(kv.tensors, worker.host_tensors):
            ids = [0] + list(range(2, 18))
            assert torch.equal(h[ids], t.tensor[ids])


class _Counted(CpuEvent):
    """A cpu event that counts the queue's queries and elapsed times (not the queries the cpu
    backend's elapsed_time makes itself)."""

    def __init__(self, asked):
        super().__init__()
        self.asked = asked

    def query(self):
        self.asked["query"] += not self.asked["inside"]
        return super().query()

    def elapsed_time(self, end):
        self.asked["elapsed_time"] += 1
        self.asked["inside"] = True
        try:
            return super().elapsed_time(end)
        finally:
            self.asked["inside"] = False


class CountingEvents(ExpandingCpuBackend):
    def __init__(self):
        super().__init__()
        self.asked = {"query": 0, "elapsed_time": 0, "inside": False}

    def new_event(self):
        return _Counted(self.asked)


def test_the_jobs_of_one_launch_ask_the_device_about_it_once():
    backend = CountingEvents()
    lock = enqueue_lock(backend)
    lock.acquire()  # the first launch blocks on it: the next 8 jobs wait, and go as one
    kv = small_kv(pages=(64, 32), blocks=32)
    with OffloadWorker(kv, 32, backend=backend) as worker:
        one_then_eight(worker, lock)
        backend.asked.update(query=0, elapsed_time=0)
        results = worker.get_finished()
        assert [r.job_id for r in results] == list(range(9)) and all(r.success for r in results)
        assert backend.asked == {"query": 2, "elapsed_time": 2, "inside": False}, "once per launch, not per job"
        times = [r.transfer_time for r in results[1:]]
        assert times == [times[0]] * 8, "equal jobs of one launch get equal shares of its time"


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


def test_submit_waits_when_too_many_jobs_wait_for_a_launch(held):
    backend, lock = held
    kv = small_kv(pages=(64,), blocks=32)
    with OffloadWorker(kv, 32, backend=backend) as worker:
        worker._queues[next(iter(worker._queues))].max_pending = 3
        first = first_in_flight(worker)
        for j in range(1, 4):
            store(worker, j, [j], [j])
        done = threading.Event()
        blocked = threading.Thread(target=lambda: (store(worker, 4, [4], [4]), done.set()))
        blocked.start()
        time.sleep(0.05)
        waited = not done.is_set()  # three jobs wait for a launch: the fourth waits for room
        lock.release()  # before any assertion: the worker's shutdown would wait for it forever
        assert waited
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


def test_wait_launches_the_named_job_with_those_before_it_and_none_after(monkeypatch):
    """Job 0 launches at once (no burst yet), jobs 1-7 wait for a launch in a burst;
    `wait([3])` launches jobs 1-3 at once, by itself, and leaves 4-7 to the launcher, which
    waits for the submits to pause."""
    import offload_core.queue as queue_module

    class Launches(ExpandingCpuBackend):
        sizes: list = []

        def copy_blocks(self, job, prepared, stream, after):
            self.sizes.append(job.jobs)
            return super().copy_blocks(job, prepared, stream, after)

    # Launches taken to last a minute: every submit is part of a burst, which the launcher
    # leaves to its submits until they pause for MAX_QUIET_S.
    monkeypatch.setattr(queue_module, "MAX_QUIET_S", 30.0)
    backend = Launches()
    kv = small_kv(pages=(64,), blocks=32)
    with OffloadWorker(kv, 16, backend=backend) as worker:
        for queue in worker._queues.values():
            queue.launch_cost = PinnedWindow(60.0)
        for j in range(8):
            store(worker, j, [j], [j])
        worker.wait([3])
        assert backend.sizes == [1, 3]
        assert [r.job_id for r in worker.get_finished()] == [0, 1, 2, 3]
        worker.wait(range(8))
    assert backend.sizes == [1, 3, 4]


def test_shutdown_launches_what_waits_and_stops_the_launchers(held):
    backend, lock = held
    kv = small_kv(pages=(64,), blocks=16)
    worker = OffloadWorker(kv, 8, backend=backend)
    queue = worker._queues[next(iter(worker._queues))]
    first = first_in_flight(worker)
    store(worker, 1, [1], [1])
    launcher = queue._launcher
    threading.Timer(0.05, lock.release).start()
    worker.shutdown()
    first.join()
    assert sorted(r.job_id for r in worker.get_finished()) == [0, 1]
    launcher.join(5)
    assert not launcher.is_alive() and queue._launcher is None


def test_a_launcher_that_dies_is_replaced_by_the_next_submit(monkeypatch):
    """Submits trust the launcher field; a launcher that ends in any way must clear it."""
    from offload_core import queue as queue_module

    died = threading.Event()

    def dies(queue_ref):
        died.set()
        raise RuntimeError("launcher died")

    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 8, backend=ExpandingCpuBackend()) as worker:
        queue = worker._queues[next(iter(worker._queues))]
        with monkeypatch.context() as patch:
            patch.setattr(queue_module, "_launch_until_done", dies)
            patch.setattr(threading, "excepthook", lambda args: None)  # the thread's error is the test's doing
            store(worker, 1, [1], [1])
            assert died.wait(5)
            until(lambda: queue._launcher is None)
        store(worker, 2, [2], [2])
        assert queue._launcher is not None and queue._launcher.is_alive()
        worker.wait([1, 2])
        assert [r.job_id for r in worker.get_finished()] == [1, 2]


def test_a_lone_job_on_an_idle_device_is_launched_by_its_submit():
    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 8, backend=ExpandingCpuBackend()) as worker:
        store(worker, 1, [1], [1])
        queue = worker._queues[next(iter(worker._queues))]
        assert queue.stats.launches == 1 and not queue._pending  # launched before submit returned
        assert queue._launcher is not None


def test_jobs_whose_groups_share_a_host_block_still_coalesce(held):
    """Two groups on different tensors may store into one host block; only clashes between two
    jobs split a launch."""
    backend, lock = held
    kv = small_kv(pages=(64, 32), blocks=16, groups=[[0], [1]])
    with OffloadWorker(kv, 16, backend=backend) as worker:
        first = threading.Thread(target=worker.submit_store, args=(2, DeviceBlocks([3], [1, 0]), HostBlocks([0])))
        first.start()
        until(lambda: worker._queues[next(iter(worker._queues))]._launching)
        assert worker.submit_store(3, DeviceBlocks([1, 2], [1, 1]), HostBlocks([6, 6]))
        assert worker.submit_store(4, DeviceBlocks([5, 4], [1, 1]), HostBlocks([7, 7]))
        lock.release()
        first.join()
        worker.wait([3, 4])
        assert [r.success for r in worker.get_finished()] == [True] * 3
        assert worker.stats()["store"].launches == 2
        assert torch.equal(worker.host_tensors[0][7], kv.tensors[0].tensor[5])
        assert torch.equal(worker.host_tensors[1][7], kv.tensors[1].tensor[4])


def test_a_launch_waits_for_every_jobs_compute_event():
    """Thread A records its compute event, then stalls; thread B queues compute work and a store
    that enters the pending list first: the launch must wait for B's event too."""
    from offload_core.backends.cpu import CpuEvent

    stalled = {}

    class SlowEvent(CpuEvent):
        def record(self, stream):
            super().record(stream)
            if threading.current_thread() is stalled.get("thread"):
                time.sleep(0.3)

    class Backend(ExpandingCpuBackend):
        def new_event(self):
            return SlowEvent()

    backend = Backend()
    lock = enqueue_lock(backend)
    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 16, backend=backend) as worker:
        lock.acquire()
        first = first_in_flight(worker)
        a = threading.Thread(target=store, args=(worker, 1, [1], [1]))
        stalled["thread"] = a
        a.start()
        time.sleep(0.1)
        gate = threading.Event()

        def compute():  # the model writes block 5 before B's store of it
            gate.wait()
            time.sleep(0.5)
            kv.tensors[0].tensor[5].fill_(0x77)

        backend.current_stream().launch(compute)
        store(worker, 2, [5], [5])
        gate.set()
        a.join()
        lock.release()
        first.join()
        worker.wait([0, 1, 2])
        assert (worker.host_tensors[0][5] == 0x77).all()


def test_a_failed_launch_is_reported_after_what_it_enqueued_has_run():
    class HalfWay(ExpandingCpuBackend):
        def copy_blocks(self, job, prepared, stream, after):
            stream.launch(lambda: time.sleep(0.2))
            super().copy_blocks(job, prepared, stream, after)
            raise RuntimeError("failed half-way")

    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 16, backend=HalfWay()) as worker:
        worker.host_tensors[0][3].fill_(0x11)
        assert worker.submit_load(1, HostBlocks([3]), DeviceBlocks([9]))
        worker.wait([1])
        (result,) = worker.get_finished()
        assert not result.success
        kv.tensors[0].tensor[9].fill_(0x42)  # the engine reuses the block of a failed load
        time.sleep(0.3)
        assert (kv.tensors[0].tensor[9] == 0x42).all()


def test_a_worker_collected_while_its_backend_enqueues_does_not_deadlock():
    """The collector may free a worker with jobs waiting for a launch on the thread that holds the
    backend's enqueue lock (inside another worker's copy_blocks): the drain goes to a thread."""
    import gc

    class Backend(ExpandingCpuBackend):
        hook = None

        def copy_blocks(self, job, prepared, stream, after):
            hook, self.hook = self.hook, None
            if hook:
                hook()
            return super().copy_blocks(job, prepared, stream, after)

    backend = Backend()
    gc.disable()
    try:
        w1 = OffloadWorker(small_kv(pages=(64,), blocks=16), 16, backend=backend)
        w2 = OffloadWorker(small_kv(pages=(64,), blocks=16, seed=1), 16, backend=backend)
        w1.cycle = w1  # only the cyclic collector frees it
        block = threading.Event()
        w1._queues[next(iter(w1._queues))]._stream.launch(block.wait)
        store(w1, 0, [0], [0])  # launched, behind the block
        for queue in w1._queues.values():
            queue.launch_cost = PinnedWindow(60.0)  # the next ones, a burst, wait for the launcher
        ref = [w1]
        del w1

        def hook():  # inside copy_blocks, the enqueue lock held by this thread
            t = threading.Thread(target=lambda: [store(ref[0], i, [i], [i]) for i in (1, 2)])
            t.start()
            t.join()
            time.sleep(0.1)
            block.set()
            ref.clear()
            gc.collect()

        backend.hook = hook
        done = threading.Event()
        threading.Thread(target=lambda: (store(w2, 7, [3], [3]), done.set()), daemon=True).start()
        assert done.wait(10), "deadlock: the collector drained inline under the enqueue lock"
        w2.shutdown()
    finally:
        gc.enable()


def test_a_backend_that_prepares_nothing_gets_its_jobs_expanded_on_the_host():
    backend = ExpandingCpuBackend(refuse=True)
    kv = small_kv(pages=(64,), blocks=16)
    with OffloadWorker(kv, 8, backend=backend) as worker:
        store(worker, 1, [1, 2], [3, 4])
        worker.wait([1])
        (result,) = worker.get_finished()
        assert result.success and result.mechanism == "memmove" and backend.jobs == 0
        assert torch.equal(worker.host_tensors[0][3], kv.tensors[0].tensor[1])


class _Who(ExpandingCpuBackend):
    """Records which thread enqueued each launch."""

    def __init__(self):
        super().__init__()
        self.by = []

    def copy_blocks(self, job, prepared, stream, after):
        self.by.append(threading.current_thread())
        return super().copy_blocks(job, prepared, stream, after)


def test_a_burst_on_an_idle_device_waits_for_the_launcher():
    """Submits closer together than a launch takes do not launch one by one, even on an idle
    device: the launcher (or the burst_jobs-th submit) sends them together."""
    backend = _Who()
    with OffloadWorker(small_kv(pages=(64,), blocks=16), 16, backend=backend) as worker:
        queue = worker._queues[next(iter(worker._queues))]
        queue.launch_cost = PinnedWindow(60.0)  # a host so slow that any two submits form a burst
        store(worker, 0, [0], [0])
        worker.wait([0])  # the device is idle for each of the next ones
        for j in range(1, 4):
            store(worker, j, [j], [j])
        until(lambda: not queue.waiting_for_launch())
        assert backend.by[0] is threading.current_thread()  # the first was no burst
        assert threading.current_thread() not in backend.by[1:]
        worker.wait(range(4))
        assert [r.job_id for r in worker.get_finished()] == [0, 1, 2, 3]
        for t, h in zip(kv_tensors(worker), worker.host_tensors):
            assert torch.equal(h[:4], t[:4])


def test_a_launch_slower_than_the_gap_between_submits_makes_them_a_burst(monkeypatch):
    """The queue learns a launch's host time from its launches (`LaunchCost`): after one that
    took 500 ms, submits a few ms apart form a burst. Its first two go as one launch, by the
    second submit (`LaunchCost.pair`: that measures the fixed part); the later ones wait for the
    launcher and go as one."""
    monkeypatch.setattr(queue_module, "MAX_QUIET_S", 30.0)  # a window as long as the launch

    class Slow(_Who):
        def copy_blocks(self, job, prepared, stream, after):
            time.sleep(0.5)  # longer than a loaded machine takes from one submit to the next
            return super().copy_blocks(job, prepared, stream, after)

    backend = Slow()
    with OffloadWorker(small_kv(pages=(64,), blocks=16), 16, backend=backend) as worker:
        store(worker, 0, [0], [0])
        worker.wait([0])  # the device is idle for each of the next ones
        for j in range(1, 6):
            store(worker, j, [j], [j])
        assert backend.by == [threading.current_thread()] * 2  # job 0, then 1 and 2 as one
        worker.wait(range(6))
        assert len(backend.by) == 3  # 3 to 5 as one
        assert [r.job_id for r in worker.get_finished()] == list(range(6))


def test_a_burst_of_burst_jobs_is_launched_by_the_submit():
    backend = _Who()
    with OffloadWorker(small_kv(pages=(64,), blocks=16), 16, backend=backend) as worker:
        queue = worker._queues[next(iter(worker._queues))]
        queue.launch_cost, queue.burst_jobs = PinnedWindow(60.0), 1
        for j in range(3):
            store(worker, j, [j], [j])
        assert backend.by == [threading.current_thread()] * 3


def kv_tensors(worker):
    return [t.tensor for t in worker.kv_caches.tensors]


def test_a_clash_far_down_the_pending_list_splits_the_launch_there(held):
    backend, lock = held
    kv = small_kv(pages=(64,), blocks=32)
    with OffloadWorker(kv, 32, backend=backend) as worker:
        first = first_in_flight(worker)
        for j in range(1, 12):
            store(worker, j, [j], [j])
        store(worker, 12, [20], [2])  # host block 2 again, ten jobs later: in the next launch
        lock.release()
        first.join()
        worker.wait(range(13))
        assert [r.job_id for r in worker.get_finished()] == list(range(13))
        assert worker.stats()["store"].launches == 3  # 0; 1..11; 12
        assert torch.equal(worker.host_tensors[0][2], kv.tensors[0].tensor[20])


def test_a_burst_of_burst_bytes_is_launched_by_the_submit():
    backend = _Who()
    with OffloadWorker(small_kv(pages=(64,), blocks=16), 16, backend=backend) as worker:
        queue = worker._queues[next(iter(worker._queues))]
        queue.launch_cost, queue.burst_bytes = PinnedWindow(60.0), 64  # one one-block job of 64 bytes is enough
        store(worker, 0, [0], [0])
        worker.wait([0])
        store(worker, 1, [1], [1])  # part of a burst, on an idle device, yet launched here
        assert backend.by == [threading.current_thread()] * 2


def test_a_launch_whose_bookkeeping_fails_reports_each_job_once():
    """Whatever raises after a launch was enqueued (here a backend's mechanism that is no string,
    which the stats cannot count) must not record the launch's jobs a second time, as failed."""

    class OddMechanism(ExpandingCpuBackend):
        def copy_blocks(self, job, prepared, stream, after):
            super().copy_blocks(job, prepared, stream, after)
            return ["expand_staged"]

    with OffloadWorker(small_kv(), 8, backend=OddMechanism()) as worker:
        store(worker, 1, [3], [3])
        store(worker, 2, [4], [4])
        worker.wait([1, 2])
        results = worker.get_finished()
    assert sorted(r.job_id for r in results) == [1, 2]


class WaitingBackend(ExpandingCpuBackend):
    """Each launch of store jobs waits 1 ms "for a full buffer" (as the cuda backend's descriptor
    ring does when the host is a ring's worth of tables ahead of the device)."""

    waits, wait_s = 0, 0.0

    def buffer_waits(self):
        return self.waits, self.wait_s

    def _wait(self, stream):
        if stream is self.stores:
            self.waits, self.wait_s = self.waits + 1, self.wait_s + 0.001

    def copy_blocks(self, job, prepared, stream, after):
        self._wait(stream)
        return super().copy_blocks(job, prepared, stream, after)


def test_a_backends_waits_for_its_full_buffers_count_as_its_lanes_back_pressure():
    backend = WaitingBackend()
    with OffloadWorker(small_kv(pages=(64,), blocks=16), 16, backend=backend) as worker:
        backend.stores = worker._queues[next(iter(worker._queues))]._stream
        for j in range(4):
            store(worker, j, [j], [j])
            worker.wait([j])  # one launch each
        assert worker.submit_load(9, HostBlocks([0]), DeviceBlocks([8]))
        worker.wait([9])
        stats = worker.stats()
        assert (stats["store"].buffer_waits, stats["store"].buffer_wait_s) == (4, pytest.approx(0.004))
        assert (stats["load"].buffer_waits, stats["load"].buffer_wait_s) == (0, 0.0)
        assert stats["store"].launches == 4
