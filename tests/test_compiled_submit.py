"""The compiled submit of simple compact jobs (`_native.submit_simple`, offload_core/_submit.c)
against its twin, the Python path: the same answers, errors, results and bytes for any sequence
of submits, and the Python path wherever the compiled one must not decide (a lock another thread
holds, a closed worker, back-pressure, a failing call). On the cpu backend that expands compact
jobs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import compiled_or_skip, small_kv
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_core import DeviceBlocks, Direction, HostBlocks, InvalidSpecError, OffloadError, OffloadWorker
from offload_core.compact import CompactLayout
from offload_core.queue import enqueue_lock
from offload_core.testing.expanding import ExpandingCpuBackend

pytestmark = pytest.mark.cpu

BLOCKS = 8  # device and host blocks: small, so that ids collide and go out of range often


def make_worker(compiled: bool, backend=None, **kwargs) -> OffloadWorker:
    kv = small_kv(pages=(64, 32), blocks=BLOCKS)
    if not compiled:  # the twin: numpy's and Python's steps
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OFFLOAD_CORE_NATIVE", "0")
            return OffloadWorker(kv, BLOCKS, backend=backend or ExpandingCpuBackend(), **kwargs)
    worker = OffloadWorker(kv, BLOCKS, backend=backend or ExpandingCpuBackend(), **kwargs)
    assert worker._submit_simple is not None
    return worker


@pytest.fixture(scope="module")
def compiled():
    compiled_or_skip(True)


ids = st.lists(st.integers(-1, BLOCKS), min_size=0, max_size=5)  # out of range, repeated, unequal counts
valid = st.integers(1, 4).flatmap(
    lambda n: st.tuples(*[st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True)] * 2)
)
spec = st.one_of(valid, valid, valid, st.tuples(ids, ids))
# a submit takes the next job id and, `twice`, submits it again at once: refused if the first
# was accepted (whether a poll between them would have returned it depends on timing)
operation = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from([False, False, True]), spec, st.booleans()),
    st.tuples(st.just("wait"), st.integers(0, 6)),
    st.tuples(st.just("poll")),
)


def submit(worker: OffloadWorker, kind: str, job_id, dev, host):
    """The submit's answer, or its error's type and message."""
    try:
        if kind == "store":
            return worker.submit_store(job_id, DeviceBlocks(dev), HostBlocks(host))
        return worker.submit_load(job_id, HostBlocks(host), DeviceBlocks(dev))
    except InvalidSpecError as exc:
        return type(exc).__name__, str(exc)


def play(worker: OffloadWorker, kind: str, operations, first_id: int = 0) -> tuple[list, list]:
    """What each submit answered, and the results polls returned, in their order. Submits are
    all of one `kind` (the lanes are not ordered against each other), their job ids from
    `first_id` on."""
    answers, results, job_id = [], [], first_id - 1
    for op in operations:
        if op[0] == "wait":
            worker.wait([op[1]])
        elif op[0] == "poll":
            results += [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()]
        else:
            _, twice, (dev, host), numpy_id = op
            job_id += 1
            for _ in range(1 + twice):
                answers.append(submit(worker, kind, np.int64(job_id) if numpy_id else job_id, dev, host))
    return answers, results


def outcome(worker: OffloadWorker, kind: str, operations, busy: bool) -> list:
    """`play`'s answers, every result in the order they came (when one comes depends on timing;
    their order does not), and every byte of the host rows and device pages. A lane's first
    submit starts its launcher, on the Python path: job 50's does, first. If `busy`, the
    operations (but their waits) run while a launch of job 99 blocks on the backend's enqueue
    lock, so that submits wait for a launch (and the launcher) instead of launching themselves."""
    play(worker, kind, [("submit", False, ([7], [7]), False), ("wait", 50), ("poll",)], first_id=50)
    if busy:
        lock = enqueue_lock(worker.backend)
        lock.acquire()
        first = [("submit", False, ([0], [0]), False)]
        thread = threading.Thread(target=play, args=(worker, kind, first, 99))
        thread.start()
        queue = worker._queues[Direction(kind)]
        while not queue._launching:
            pass
        try:
            answers, results = play(worker, kind, [op for op in operations if op[0] != "wait"])
        finally:
            lock.release()
            thread.join()
    else:
        answers, results = play(worker, kind, operations)
    worker.wait([*range(len(operations)), 99])
    results += [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()]
    kv = [t.tensor.clone().numpy().tobytes() for t in worker.kv_caches.tensors]
    return [answers, results, kv, [t.clone().numpy().tobytes() for t in worker.host_tensors]]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["store", "load"]), st.lists(operation, max_size=14), st.booleans())
def test_any_sequence_of_submits_goes_as_on_the_python_path(compiled, kind, operations, busy):
    with make_worker(True) as fast, make_worker(False) as slow:
        assert outcome(fast, kind, operations, busy) == outcome(slow, kind, operations, busy)


def test_the_compiled_submit_takes_a_simple_job_without_the_python_path(compiled, monkeypatch):
    def refuse(*args):
        raise AssertionError("the Python path ran")

    with make_worker(True) as worker:
        # a lane's first submit starts its launcher thread, on the Python path
        assert worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))
        assert worker.submit_load(10, HostBlocks([0]), DeviceBlocks([7]), expedited=True)
        worker.wait([0, 10])
        worker.get_finished()
        monkeypatch.setattr(CompactLayout, "job", refuse)
        assert worker.submit_store(1, DeviceBlocks([1, 2]), HostBlocks([3, 4]))
        worker.wait([1])  # lanes are not ordered against each other
        assert worker.submit_load(2, HostBlocks([3, 4]), DeviceBlocks([5, 6]), expedited=True)
        worker.wait([2])
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True), (2, True)]
        assert np.array_equal(worker.kv_caches.tensors[0].tensor[[5, 6]], worker.kv_caches.tensors[0].tensor[[1, 2]])


def test_a_submit_waits_for_a_lock_another_thread_holds(compiled):
    with make_worker(True) as worker:
        worker._lock.acquire()
        done = []
        thread = threading.Thread(
            target=lambda: done.append(worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1])))
        )
        thread.start()
        thread.join(0.2)
        assert thread.is_alive() and not done  # on the Python path, waiting for the lock
        worker._lock.release()
        thread.join()
        worker.wait([1])
        assert done == [True] and [r.success for r in worker.get_finished()] == [True]


def test_a_shut_down_worker_refuses_submits(compiled):
    worker = make_worker(True)
    worker.shutdown()
    with pytest.raises(OffloadError, match="shut down"):
        worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))


def test_a_job_id_in_flight_is_refused_and_nothing_else_changes(compiled):
    backend = ExpandingCpuBackend()
    with make_worker(True, backend) as worker:
        lock = enqueue_lock(backend)
        with lock:  # the first launch blocks: the jobs stay in flight
            threading.Thread(target=worker.submit_store, args=(1, DeviceBlocks([1]), HostBlocks([1]))).start()
            with pytest.raises(InvalidSpecError, match="job id 1 is still in flight"):
                worker.submit_load(1, HostBlocks([2]), DeviceBlocks([2]))
        worker.wait([1])
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]


class FailingEvent:
    def __init__(self, event, error):
        self.event, self.error = event, error

    def record(self, stream):
        raise self.error

    def __getattr__(self, name):
        return getattr(self.event, name)


@pytest.mark.parametrize("error", [RuntimeError("the device is lost"), KeyboardInterrupt()])
def test_a_ready_event_that_cannot_be_recorded_queues_nothing(compiled, monkeypatch, error):
    """An Exception: the submit logs it and returns False, as the Python path does; anything else
    (Ctrl-C) is raised. Either way the job id is free again."""
    backend = ExpandingCpuBackend()
    with make_worker(True, backend) as worker:
        assert worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))  # the lane's launcher starts
        worker.wait([0])
        worker.get_finished()
        queue = worker._queues[Direction.STORE]
        made = backend.new_event
        monkeypatch.setattr(queue, "_free_events", [])
        monkeypatch.setattr(backend, "new_event", lambda: FailingEvent(made(), error))
        if isinstance(error, Exception):
            assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1])) is False
        else:
            with pytest.raises(KeyboardInterrupt):
                worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
        monkeypatch.setattr(backend, "new_event", made)
        assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
        worker.wait([1])
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]


def test_back_pressure_takes_the_python_path_and_counts(compiled):
    backend = ExpandingCpuBackend()
    with make_worker(True, backend) as worker:
        queue = worker._queues[next(iter(worker._queues))]
        queue.max_pending = 2
        lock = enqueue_lock(backend)
        lock.acquire()
        first = threading.Thread(target=worker.submit_store, args=(0, DeviceBlocks([0]), HostBlocks([0])))
        first.start()
        while not queue._launching:
            pass
        worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
        worker.submit_store(2, DeviceBlocks([2]), HostBlocks([2]))
        third = threading.Thread(target=worker.submit_store, args=(3, DeviceBlocks([3]), HostBlocks([3])))
        third.start()
        third.join(0.2)
        assert third.is_alive()  # two wait for a launch: the third waits for room
        lock.release()
        first.join()
        third.join()
        worker.wait(range(4))
        assert [r.success for r in worker.get_finished()] == [True] * 4
        assert worker.stats()["store"].backpressure_waits == 1


def test_shutdown_racing_compiled_submits_loses_no_accepted_job(compiled):
    for trial in range(20):
        worker = make_worker(True)
        accepted, go = [], threading.Barrier(3)

        def submitter(t):
            go.wait()
            for i in range(50):
                try:
                    if worker.submit_store(t * 100 + i, DeviceBlocks([t * 4 + i % 4]), HostBlocks([t * 4 + i % 4])):
                        accepted.append(t * 100 + i)
                except OffloadError:  # shut down
                    return

        threads = [threading.Thread(target=submitter, args=(t,)) for t in (0, 1)]
        for t in threads:
            t.start()
        go.wait()
        worker.shutdown()
        for t in threads:
            t.join()
        reported = [r.job_id for r in worker.get_finished()]
        assert sorted(reported) == sorted(accepted), f"trial {trial}"


@pytest.mark.parametrize("path", [True, False], ids=["compiled", "python"])
def test_a_launch_bookkeeping_failure_after_the_job_is_queued_reports_it_as_the_python_path(compiled, path):
    """`_take` failing once: the submit logs it and returns False, yet the job is queued and its
    result comes (the Python path's behaviour, which the compiled one keeps); no submit stays
    counted as under way, so shutdown returns."""
    worker = make_worker(path)
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
    queue._launch_s = 0.0  # no burst: the submit launches itself, the device being idle
    assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1])) is False
    queue._take = take
    worker.wait([1])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(0, True), (1, True)]
    assert worker._submitting == 0
    worker.shutdown()


def test_state_of_another_kind_takes_the_python_path(compiled):
    with make_worker(True) as worker:
        worker._queues[Direction.STORE].burst_bytes = float("inf")
        for j in range(3):
            assert worker.submit_store(j, DeviceBlocks([j]), HostBlocks([j]))
        worker.wait(range(3))
        assert [r.success for r in worker.get_finished()] == [True] * 3


@pytest.mark.parametrize("position", range(5))
def test_the_compiled_submit_refuses_what_it_cannot_work_with(compiled, position):
    """`submit_setup` checks what it is given, and keeps what it had when it refuses."""
    import time

    from offload_core import native
    from offload_core.compact import CompactJob
    from offload_core.queue import TransferQueue, _Pending

    good = [DeviceBlocks, HostBlocks, CompactJob, _Pending, TransferQueue, Direction.STORE, time.perf_counter]
    wrong = [object(), 1, type("Job", (), {"__slots__": ("layout",)}), list, None]
    args = [*good, time.monotonic]
    args[position] = wrong[position]
    with pytest.raises(TypeError, match="submit_setup"):
        native.load().submit_setup(*args)
    with make_worker(True) as worker:  # still set up as before
        assert worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))
        worker.wait([0])
