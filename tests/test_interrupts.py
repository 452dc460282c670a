"""Ctrl-C where a worker's own Python runs: a submit's launch and clean-up, a poll. The
interrupt is raised where CPython runs signal handlers, at the entry of a Python function
(`sys.settrace`'s "call" event) or as a call returns (`sys.setprofile`'s "c_return"); one
test raises it at every such point of a submit and of a shutdown in turn. Afterwards results
still come, once each and not before the copies they report, and `wait` and `shutdown` return."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from ctrl_c_sweep import sweep
from helpers import SignalPoints, compiled_or_skip, ctrl_c_before_line

import offload_core
from offload_core import (
    DeviceBlocks,
    Direction,
    HostBlocks,
    InvalidSpecError,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadWorker,
)
from offload_core.backends.cpu import CpuBackend
from offload_core.testing.expanding import ExpandingCpuBackend

pytestmark = pytest.mark.cpu


def make_worker(backend, native: str, monkeypatch) -> OffloadWorker:
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", native)
    tensor = torch.zeros(16, 64, dtype=torch.uint8)
    return OffloadWorker(KVCaches([KVCacheTensor(tensor, 64)], [[KVCacheRef(0, 64)]]), 8, backend=backend)


def ctrl_c_at(function: str, caller: str, caller_file: str) -> None:
    """Raise KeyboardInterrupt once, as `function` is entered from `caller` in `caller_file`."""

    def tracer(frame, event, arg):
        back = frame.f_back
        if (
            event == "call"
            and frame.f_code.co_name == function
            and back is not None
            and back.f_code.co_name == caller
            and back.f_code.co_filename.endswith(caller_file)
        ):
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(tracer)


def finishes(worker: OffloadWorker, job_ids) -> bool:
    """Whether `wait(job_ids)` and then `shutdown()` return within a few seconds."""
    done = threading.Event()

    def run():
        worker.wait(job_ids)
        worker.shutdown()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(10)


@pytest.mark.parametrize("native", ["0", "1"])
def test_ctrl_c_before_a_submit_launches_its_jobs_fails_them_instead_of_hanging(native, monkeypatch):
    if native == "1":
        compiled_or_skip(True)
    worker = make_worker(ExpandingCpuBackend(), native, monkeypatch)
    worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))
    worker.wait([0])
    ctrl_c_at("launch_taken", "_submit", ".py")
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
    finally:
        sys.settrace(None)
    assert finishes(worker, [1])
    results = {r.job_id: r for r in worker.get_finished()}
    assert results[0].success and not results[1].success  # never launched: failed, not lost


def test_ctrl_c_in_a_refused_submits_clean_up_leaves_shutdown_free(monkeypatch):
    worker = make_worker("cpu", "0", monkeypatch)
    ctrl_c_at("__contains__", "_submit", "worker.py")
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.submit_store(1, DeviceBlocks([99]), HostBlocks([1]))  # out of range: refused
    finally:
        sys.settrace(None)
    assert worker.submit_store(1, DeviceBlocks([2]), HostBlocks([1]))  # the id was left taken; nothing holds it
    with pytest.raises(InvalidSpecError, match="still in flight"):  # until its result is returned
        worker.submit_store(1, DeviceBlocks([3]), HostBlocks([2]))
    assert finishes(worker, [1])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]


def test_ctrl_c_inside_get_finished_loses_no_result(monkeypatch):
    worker = make_worker("cpu", "0", monkeypatch)
    for job_id in range(3):
        worker.submit_store(job_id, DeviceBlocks([job_id]), HostBlocks([job_id]))
    worker.wait([2])
    ctrl_c_at("__init__", "poll", "queue.py")  # as the second result is made
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.get_finished()
    finally:
        sys.settrace(None)
    assert [r.job_id for r in worker.get_finished()] == [0, 1, 2]
    worker.submit_store(0, DeviceBlocks([3]), HostBlocks([3]))  # its id is free again
    assert finishes(worker, [0])


def test_ctrl_c_in_get_finished_keeps_results_collected_before(monkeypatch):
    """A lane's results collected (as a `shutdown` cut short after one lane leaves them), then a
    Ctrl-C as a later lane's poll makes its result: both are kept for the next call."""
    worker = make_worker("cpu", "0", monkeypatch)
    worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))
    worker.submit_load(1, HostBlocks([1]), DeviceBlocks([1]))
    worker.wait([0, 1])
    assert worker._lanes[0].direction.value == "store"
    worker._drained[0] += worker._lanes[0].poll()  # what `shutdown` does for each lane
    ctrl_c_at("__init__", "poll", "queue.py")
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.get_finished()
    finally:
        sys.settrace(None)
    assert [r.job_id for r in worker.get_finished()] == [0, 1]
    assert finishes(worker, [])


@pytest.mark.parametrize("native", ["0", "1"])
def test_ctrl_c_as_a_launch_takes_its_jobs_loses_none(native, monkeypatch):
    """The Ctrl-C lands in `_take` as it sums the jobs it takes: the job is still waiting, or it is
    launched or failed; either way its result comes and its id is free again."""
    if native == "1":
        compiled_or_skip(True)
    worker = make_worker(ExpandingCpuBackend(), native, monkeypatch)
    ctrl_c_at("<genexpr>", "_take", "queue.py")
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))
    finally:
        sys.settrace(None)
    worker.wait([0])
    assert [r.job_id for r in worker.get_finished()] == [0]
    assert worker.submit_store(0, DeviceBlocks([1]), HostBlocks([1]))
    assert finishes(worker, [0])


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("where", ["wait", "finish"])
def test_ctrl_c_as_wait_or_shutdown_launches_waiting_jobs_leaves_them_free(where, native, monkeypatch):
    """`wait` (and `shutdown`, through `finish`) launches jobs still waiting for a launch; a Ctrl-C
    as it begins to fails them rather than leave every later `wait` and `shutdown` hanging."""
    if native == "1":
        compiled_or_skip(True)
    for _ in range(20):  # the launcher thread may take the jobs first: then again
        backend = ExpandingCpuBackend()
        worker = make_worker(backend, native, monkeypatch)
        go = threading.Event()
        backend.current_stream().launch(go.wait)  # the compute stream busy: jobs wait for a launch
        for job_id in range(4):
            assert worker.submit_store(job_id, DeviceBlocks([job_id]), HostBlocks([job_id]))
        hit = []

        def tracer(frame, event, arg):
            caller = frame.f_back
            if (
                event == "call"
                and frame.f_code.co_name == "_run_quietly"
                and caller.f_code.co_name == "_launch_through"
                and caller.f_back.f_code.co_name == where
            ):
                sys.settrace(None)
                hit.append(True)
                raise KeyboardInterrupt
            return None

        sys.settrace(tracer)
        try:
            worker.wait([3]) if where == "wait" else worker.shutdown()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        go.set()
        if hit:
            break
        worker.shutdown()
    assert hit, "the launcher took the jobs every time"
    assert finishes(worker, [0, 1, 2, 3])
    assert sorted(r.job_id for r in worker.get_finished()) == [0, 1, 2, 3]


def test_ctrl_c_as_shutdown_closes_the_lanes_leaves_the_next_call_to_close_them(monkeypatch):
    """Once `shutdown` has taken the worker's memory from its finalizer, a Ctrl-C as it closes
    the lanes must not leave them open (their launcher threads and streams) for good."""
    worker = make_worker(ExpandingCpuBackend(), "0", monkeypatch)
    assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([1]))
    ctrl_c_at("drain", "close", "queue.py")  # the first lane's close, from the worker's `_drain`
    with pytest.raises(KeyboardInterrupt):
        worker.shutdown()
    assert not any(q._stream_released for q in worker._lanes)
    worker.shutdown()
    assert all(q._closed and q._stream_released for q in worker._lanes)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]


def test_a_registration_undone_when_ctrl_c_cut_its_shutdown_short_is_not_undone_twice():
    """Another worker over the same region may still count on it: the next call finishes the
    shutdown without a second unpin (an unpin cut short leaves the memory registered)."""
    from offload_core import worker as worker_module

    calls = []

    class Backend:
        def unpin_host_memory(self, host):
            calls.append(host)
            if len(calls) == 1:
                raise KeyboardInterrupt

    backend, host, registered = Backend(), torch.zeros(64, dtype=torch.uint8), [True]
    worker_module._pins[(id(backend), host.data_ptr(), 64)] = 1
    with pytest.raises(KeyboardInterrupt):
        worker_module._drain([], backend, host, registered, None)
    assert worker_module._drain([], backend, host, registered, None) == []
    assert len(calls) == 1 and registered == [False]


def test_ctrl_c_as_a_condition_retakes_the_workers_lock_leaves_the_lock_as_it_was(monkeypatch):
    """`shutdown` waits for a submit under way on the worker's condition. Were its lock a plain
    one, `Condition.wait` would retake it in a Python method, where a Ctrl-C leaves it released
    and the `with` block around the wait then releases it again (or another thread's hold)."""
    import time

    worker = make_worker(ExpandingCpuBackend(), "0", monkeypatch)
    with worker._lock:
        worker._submitting = 1  # as a submit under way on another thread

    def submit_ends():
        time.sleep(0.05)
        with worker._lock:
            worker._submitting = 0
            worker._idle.notify_all()

    threading.Thread(target=submit_ends).start()
    ctrl_c_at("_acquire_restore", "wait", "threading.py")
    try:
        worker.shutdown()
    except KeyboardInterrupt:
        worker.shutdown()
    finally:
        sys.settrace(None)
    assert worker._lock.acquire(False)
    worker._lock.release()


def test_ctrl_c_as_a_condition_retakes_a_queues_lock_leaves_the_lock_as_it_was(monkeypatch):
    """The same for a queue: `wait` on a job whose launch is under way on another thread (held
    on the backend's enqueue lock) waits on the queue's condition."""
    import time

    from offload_core.backend import enqueue_lock

    backend = ExpandingCpuBackend()
    worker = make_worker(backend, "0", monkeypatch)
    queue = next(iter(worker._queues.values()))
    lock = enqueue_lock(backend)
    lock.acquire()
    submit = threading.Thread(target=worker.submit_store, args=(1, DeviceBlocks([0]), HostBlocks([1])))
    submit.start()
    while not queue._launching:
        time.sleep(0.001)
    threading.Timer(0.05, lock.release).start()
    ctrl_c_at("_acquire_restore", "wait", "threading.py")
    try:
        worker.wait([1])
    except KeyboardInterrupt:
        worker.wait([1])
    finally:
        sys.settrace(None)
    submit.join()
    assert queue._lock.acquire(False)
    queue._lock.release()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    worker.shutdown()


def test_ctrl_c_as_shutdown_detaches_the_finalizer_leaves_the_next_call_what_it_held(monkeypatch):
    """A Ctrl-C run as `weakref.finalize.detach` returns, after it took the entry from the
    registry: the next `shutdown` must still close the lanes (and undo a registration)."""
    import weakref

    worker = make_worker(ExpandingCpuBackend(), "0", monkeypatch)
    assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([1]))
    ctrl_c_before_line(weakref.finalize.detach, "return (")
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.shutdown()
    finally:
        sys.settrace(None)
    assert not worker._finalizer.alive
    worker.shutdown()
    assert all(q._closed and q._stream_released for q in worker._lanes)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]


@pytest.mark.parametrize("where", ["wait", "finish"])
def test_ctrl_c_between_taking_jobs_and_launching_them_fails_them(where, monkeypatch):
    """`wait` and `finish` take the jobs to launch under the queue's lock, then launch them with
    it let go. A Ctrl-C in between (as the lock is let go) fails them: another thread's `wait`
    and `shutdown` then return, and the queue goes on."""
    import time

    from offload_core.queue import TransferQueue

    backend = ExpandingCpuBackend()
    worker = make_worker(backend, "0", monkeypatch)
    queue = next(iter(worker._queues.values()))
    with queue._lock:
        queue._launcher = threading.current_thread()  # no launcher thread takes the jobs first
        # a burst (the last submit just now, a launch slow): the submits leave the jobs waiting
        queue.burst_jobs, queue._launch_s, queue._last_submit = 1 << 30, 10.0, time.perf_counter()
    for job_id in range(3):
        assert worker.submit_store(job_id, DeviceBlocks([job_id]), HostBlocks([job_id]))
    assert len(queue._pending) == 3
    ctrl_c_before_line(TransferQueue._launch_through, "self._run_quietly(batch)")  # under `where`
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.wait([2]) if where == "wait" else worker.shutdown()
    finally:
        sys.settrace(None)
    assert queue._taken is None and not queue._launching
    with queue._lock:
        queue._launcher = None
    assert finishes(worker, [2])
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2] and not any(r.success for r in results)


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_wait_for_a_job_failed_before_its_launch_waits_for_the_jobs_before_it(native, monkeypatch):
    """Job 1 fails with nothing enqueued (a Ctrl-C between its take and its launch) while job 0,
    launched before it, still runs. Results come in submission order, so job 1's waits for
    job 0's: a `wait` for job 1 returns only once both can be taken."""
    import time

    from offload_core.queue import TransferQueue

    running = threading.Event()

    class Held(ExpandingCpuBackend):
        def copy_blocks(self, job, prepared, stream, after):
            stream.launch(running.wait)  # job 0's copy runs until the test lets it
            return super().copy_blocks(job, prepared, stream, after)

    worker = make_worker(Held(), native, monkeypatch)
    queue = next(iter(worker._queues.values()))
    assert worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))  # an idle device: launched by its submit
    with queue._lock:
        queue._launcher = threading.current_thread()  # no launcher thread takes job 1 first
        queue.burst_jobs, queue._launch_s, queue._last_submit = 1 << 30, 10.0, time.perf_counter()
    assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
    assert len(queue._pending) == 1
    ctrl_c_before_line(TransferQueue._launch_through, "self._run_quietly(batch)")  # under `wait`
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.wait([1])
    finally:
        sys.settrace(None)
    with queue._lock:
        queue._launcher = None
    waiter = threading.Thread(target=worker.wait, args=([1],))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "wait returned while job 0, before job 1, still runs"
    running.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(0, True), (1, False)]
    worker.shutdown()


def test_ctrl_c_as_a_lanes_poll_returns_loses_no_result(monkeypatch):
    """`get_finished` polls each lane; a Ctrl-C as a poll returns (its results out of the queue,
    not yet in the worker's hands) must leave them to the next call."""
    worker = make_worker(ExpandingCpuBackend(), "0", monkeypatch)
    assert worker.submit_store(1, DeviceBlocks([0]), HostBlocks([1]))
    worker.wait([1])

    def tracer(frame, event, arg):
        if frame.f_code.co_name == "poll" and frame.f_back.f_code.co_name == "get_finished":
            if event == "return":
                sys.settrace(None)
                raise KeyboardInterrupt
            return tracer
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.get_finished()
    finally:
        sys.settrace(None)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    worker.shutdown()


class _RecordingExpanding(ExpandingCpuBackend):
    def copy_blocks(self, job, prepared, stream, after):
        self.touched.update(int(i) for i in job.dev_ids)  # before: a Ctrl-C inside may leave some enqueued
        return super().copy_blocks(job, prepared, stream, after)


class _RecordingCpu(CpuBackend):
    def copy_batch(self, src, dst, sizes, direction, stream):
        base = self.tensor.data_ptr()
        self.touched.update((int(a) - base) // 64 for a in (src if direction.value == "store" else dst))
        return super().copy_batch(src, dst, sizes, direction, stream)


def _interrupted_at(k: int, kind: str, native: str, during: str, monkeypatch) -> tuple[str | None, str | None]:
    """Submit two stores (or wait for two, or shut down with two queued) with a Ctrl-C at point `k`, the streams
    held by a gate until then. Returns (where the Ctrl-C landed or None past the last point,
    what broke or None)."""
    import os
    import time

    import offload_core

    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", native)
    tensor = torch.zeros(16, 64, dtype=torch.uint8)
    backend = _RecordingExpanding() if kind == "expanding" else _RecordingCpu()
    backend.touched, backend.tensor = set(), tensor
    worker = OffloadWorker(KVCaches([KVCacheTensor(tensor, 64)], [[KVCacheRef(0, 64)]]), 8, backend=backend)
    worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))
    worker.wait([0])
    got = [(r, 0.0) for r in worker.get_finished()]
    backend.touched.clear()
    gate, opened = threading.Event(), []

    def open_gate():
        opened.append(time.perf_counter())
        gate.set()

    for lane in worker._lanes:
        lane._stream.launch(gate.wait)
    # opened after the interrupted calls; before, if one of them waits for copies to pass
    timer = threading.Timer(0.05 if during == "submit" else 0.01, open_gate)  # `wait` and `shutdown` wait for it
    timer.start()
    points, submitted, interrupted_at = SignalPoints(k, (os.path.dirname(offload_core.__file__),)), [], None
    if during != "submit":
        if during == "wait":  # the jobs left waiting for a launch: `wait` launches them
            lane = worker._queues[Direction.STORE]
            with lane._lock:
                lane._launcher = threading.current_thread()  # no launcher thread takes them first
                lane.burst_jobs, lane._launch_s, lane._last_submit = 1 << 30, 10.0, time.perf_counter()
        for job_id in (1, 2):
            worker.submit_store(job_id, DeviceBlocks([job_id]), HostBlocks([job_id]))
            submitted.append(job_id)
        assert during != "wait" or len(lane._pending) == 2
    sys.setprofile(points)
    try:
        if during == "shutdown":
            worker.shutdown()
        elif during == "wait":
            worker.wait([1, 2])
        else:
            for job_id in (1, 2):
                worker.submit_store(job_id, DeviceBlocks([job_id]), HostBlocks([job_id]))
                submitted.append(job_id)
    except KeyboardInterrupt:
        interrupted_at = time.perf_counter()
    finally:
        sys.setprofile(None)
    if during == "wait":
        with lane._lock:
            lane._launcher = None
    got += [(r, time.perf_counter()) for r in worker.get_finished()]
    if timer.cancel() is None and not opened:
        open_gate()
    t_open = opened[0]
    if during == "shutdown":
        if not _returns(worker.shutdown):
            return points.where, "a shutdown after one cut short hangs"
        if not all(q._closed and q._stream_released for q in worker._lanes):
            return points.where, "a lane left open"
    if not _returns(lambda: worker.wait([1, 2])):
        return points.where, "wait hangs"
    got += [(r, time.perf_counter()) for r in worker.get_finished()]
    ids = [r.job_id for r, _ in got]
    if len(ids) != len(set(ids)):
        return points.where, f"results twice: {ids}"
    for r, t in got:
        if r.job_id in backend.touched and t < t_open:
            return points.where, f"job {r.job_id}'s result (success {r.success}) before its copies could run"
    for job_id in (1, 2):
        if job_id in ids:
            continue
        if job_id in submitted:
            return points.where, f"job {job_id} queued, no result"
        if job_id in backend.touched and (interrupted_at is None or interrupted_at < t_open):
            return points.where, f"job {job_id} interrupted with copies in flight and no result to wait for"
        if during == "submit":
            try:
                worker.submit_store(job_id, DeviceBlocks([job_id + 4]), HostBlocks([job_id + 4]))
            except InvalidSpecError as exc:
                return points.where, f"job id {job_id} neither reported nor free: {exc}"
    if not _returns(worker.shutdown):
        return points.where, "shutdown hangs"
    return points.where, None


def _returns(call) -> bool:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    return not thread.is_alive()


@pytest.mark.parametrize(
    "kind, native, during",
    [("expanding", "0", "submit"), ("expanding", "1", "submit"), ("cpu", "0", "submit")]
    + [("expanding", "0", "shutdown"), ("expanding", "1", "shutdown"), ("cpu", "0", "shutdown")]
    + [("expanding", "0", "wait"), ("expanding", "1", "wait")],
)
def test_ctrl_c_at_every_point_of_a_submit_wait_or_shutdown_loses_and_frees_nothing(kind, native, during, monkeypatch):
    """A Ctrl-C at each point in turn where CPython runs signal handlers, in offload_core's own
    code (of two submits, of a `wait` that launches two waiting jobs, of a shutdown with two
    queued): afterwards nothing hangs, every queued job reports once, an interrupted submit leaves
    its id free, and no result (nor an interrupted call) comes before copies it enqueued ran."""
    if native == "1":
        compiled_or_skip(True)
    broken, k = [], 1
    while True:
        where, what = _interrupted_at(k, kind, native, during, monkeypatch)
        if where is None:
            break
        if what is not None:
            broken.append(f"Ctrl-C at {k} ({where}): {what}")
        k += 1
    assert k > 50, "too few points: the profiler saw none of the worker's code"
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_signal_handler_that_waits_between_a_take_and_its_launch_gets_each_result_once(native, monkeypatch):
    """A handler (run on the submitting thread, where a launch is taken and not yet begun) that
    calls `wait` fails the taken jobs rather than wait for its own thread; the submit, resumed,
    must then not launch them as well (each would be reported twice)."""
    if native == "1":
        compiled_or_skip(True)
    worker = make_worker(ExpandingCpuBackend(), native, monkeypatch)
    worker.submit_store(0, DeviceBlocks([0]), HostBlocks([0]))
    worker.wait([0])
    lane = worker._queues[Direction.STORE]
    with lane._lock:  # the submit launches the job itself, never the launcher thread
        lane._launcher, lane.burst_jobs = threading.current_thread(), 1
    caller, handled = "_submit", []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "launch_taken" and frame.f_back.f_code.co_name == caller:
            sys.settrace(None)
            worker.wait([1])  # the handler's own call, returning normally
            handled.append(True)
        return None

    sys.settrace(tracer)
    try:
        assert worker.submit_store(1, DeviceBlocks([1]), HostBlocks([1]))
    finally:
        sys.settrace(None)
    assert handled
    with lane._lock:
        lane._launcher = None
    assert finishes(worker, [1])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(0, True), (1, False)]


def _hold_cpu_stream(stream):
    import time

    from offload_core.backends.cpu import CpuEvent

    stream.launch(lambda: time.sleep(0.005))
    end = CpuEvent()
    end.record(stream)
    return end


@pytest.mark.parametrize(
    "kind, direction, native",
    [("expanding", "store", "0"), ("expanding", "load", "0"), ("expanding", "store", "1"), ("cpu", "load", "0")],
)
def test_ctrl_c_at_every_point_of_submits_and_a_wait_with_copies_in_flight(kind, direction, native, monkeypatch):
    """`ctrl_c_sweep` on the cpu backend, its stream held a few ms each round: the every-point
    test above with the bytes of each successful job checked, and copies still queued when the
    interrupt lands."""
    compiled_or_skip(native == "1")
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", native)
    backend = ExpandingCpuBackend() if kind == "expanding" else CpuBackend()
    roots = (os.path.dirname(offload_core.__file__), os.path.dirname(sys.modules[CpuBackend.__module__].__file__))
    sweep(backend, "cpu", direction == "store", roots, _hold_cpu_stream)
