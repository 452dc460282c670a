"""Ctrl-C and a worker (docs/architecture.md, section 9): a real SIGINT sent from inside a call,
where it is most dangerous (a launch's enqueue, a poll, a stream's release), is raised once the
call's step is done; every job still reports once, never before its copies have run; waits
stay interruptible and change nothing; the worker goes on working. Each test that needs the
interrupt held back fails with `offload_core.interrupts.deferred` made a no-op."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import (
    CtrlCInside,
    PinnedWindow,
    compiled_or_skip,
    ctrl_c_inside_calls,
    python_sigint,
    send_ctrl_c,
    small_kv,
)

from offload_core import DeviceBlocks, Direction, HostBlocks, InvalidSpecError, OffloadWorker, interrupts
from offload_core.backends.cpu import CpuBackend
from offload_core.interrupts import deferred
from offload_core.testing.expanding import ExpandingCpuBackend
from offload_core.testing.fake import FakeBackend, FakeEvent

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def sigint():
    with python_sigint():
        yield


def fake_worker() -> tuple[OffloadWorker, FakeBackend]:
    """A worker on the fake backend (events pass when the test says), with no launcher threads:
    jobs go with a submit (one not part of a burst) or with a wait."""
    fake = FakeBackend()
    worker = OffloadWorker(small_kv(), 8, backend=fake)
    for lane in worker._lanes:
        lane._launcher = object()
    return worker, fake


def store(worker: OffloadWorker, job_id: int) -> bool:
    """A store, submitted as if long after the last one: not part of a burst, so it launches
    at once (a loaded machine's slow launches would make it a burst)."""
    for lane in worker._lanes:
        lane._last_submit = float("-inf")
    return burst_store(worker, job_id)


def burst_store(worker: OffloadWorker, job_id: int) -> bool:
    """A store right after the last submit: part of a burst where the lane's window says so."""
    return worker.submit_store(job_id, DeviceBlocks([job_id]), HostBlocks([job_id]))


def done(worker: OffloadWorker) -> list[tuple[int, bool]]:
    return [(r.job_id, r.success) for r in worker.get_finished()]


@pytest.mark.parametrize("where", ["in its launch", "as it enters its lane"])
def test_ctrl_c_inside_a_submit_comes_once_its_job_is_queued_and_launched(where):
    worker, fake = fake_worker()
    lane = worker._queues[Direction.STORE]
    if where == "in its launch":
        spy = CtrlCInside(fake, "copy_batch").arm()  # the enqueue's own Python
    else:
        spy = CtrlCInside(lane, "add", after=True).arm()  # queued, not launched yet
    with pytest.raises(KeyboardInterrupt):
        store(worker, 1)
    assert spy.sent and spy.returned  # the step ran whole
    assert 1 in lane and not lane.waiting_for_launch() and worker._submitting == 0
    with pytest.raises(InvalidSpecError, match="still in flight"):
        store(worker, 1)  # its id stays taken until its result is returned
    assert done(worker) == []  # not before its copy has run on the device
    fake.complete_all()
    assert done(worker) == [(1, True)]
    assert done(worker) == []
    assert store(worker, 1)  # its id is free again, and the worker goes on
    fake.complete_all()
    worker.wait([1])
    assert done(worker) == [(1, True)]
    worker.shutdown()


def test_ctrl_c_inside_a_launch_a_wait_makes_comes_after_the_launch():
    worker, fake = fake_worker()
    lane = worker._queues[Direction.STORE]
    assert store(worker, 1)  # launched: the device was idle, and is busy with it now
    lane.launch_cost = PinnedWindow(60.0)  # the next submit is part of a burst
    assert burst_store(worker, 2) and lane.waiting_for_launch()  # waits for a launch
    copy = CtrlCInside(fake, "copy_batch").arm()
    with pytest.raises(KeyboardInterrupt):
        worker.wait([2])
    assert copy.sent and copy.returned and not lane.waiting_for_launch()
    fake.complete_all()
    worker.wait([2])
    assert done(worker) == [(1, True), (2, True)]
    worker.shutdown()


@pytest.mark.parametrize("at", [2, 3])
def test_ctrl_c_inside_get_finished_keeps_its_results_for_the_next_call(at, monkeypatch):
    """The SIGINT comes as the poll asks the second (or last) launch's end event whether it has
    passed, once the first launch's result has been taken from the lane."""
    worker, fake = fake_worker()
    for j in (1, 2, 3):
        assert store(worker, j)  # each launched alone: the device idle once the last one passed
        fake.complete_all()
    asked = []
    query = FakeEvent.query

    def query_then_ctrl_c(event):
        asked.append(event)
        if len(asked) == at:
            send_ctrl_c()
        return query(event)

    monkeypatch.setattr(FakeEvent, "query", query_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        worker.get_finished()
    assert len(asked) >= at
    monkeypatch.setattr(FakeEvent, "query", query)
    with pytest.raises(InvalidSpecError, match="still in flight"):
        store(worker, 1)  # its result is not returned yet
    assert done(worker) == [(1, True), (2, True), (3, True)]
    assert done(worker) == []
    assert store(worker, 1)
    worker.shutdown()
    assert done(worker) == [(1, True)]


def test_ctrl_c_inside_shutdowns_closing_comes_once_it_has_closed():
    worker, fake = fake_worker()
    assert store(worker, 1)
    release = CtrlCInside(fake, "release_stream").arm()
    with pytest.raises(KeyboardInterrupt):
        worker.shutdown()
    assert release.sent and release.returned and worker.host_tensors == []
    released = [x for x in fake.log if x[0] == "release_stream"]
    assert sorted(name for _, name, _ in released) == sorted(s.name for s in fake.streams)
    assert all(unfinished == 0 for _, _, unfinished in released)  # after their last job
    assert done(worker) == [(1, True)]
    worker.shutdown()


def test_a_blocking_wait_stops_at_a_ctrl_c_and_changes_nothing():
    backend = CpuBackend()
    worker = OffloadWorker(small_kv(), 8, backend=backend)
    go = threading.Event()
    backend.current_stream().launch(go.wait)  # the compute stream busy: the job waits behind it
    assert store(worker, 1)
    threading.Timer(0.1, send_ctrl_c).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        worker.wait([1])
    assert time.monotonic() - t0 < 5
    assert done(worker) == []
    go.set()
    worker.wait([1])
    assert done(worker) == [(1, True)]
    assert store(worker, 2)
    worker.wait([2])
    assert done(worker) == [(2, True)]
    worker.shutdown()


def test_a_submit_waiting_for_room_stops_at_a_ctrl_c_and_queues_nothing():
    worker, fake = fake_worker()
    lane = worker._queues[Direction.STORE]
    lane.max_pending = 1
    assert store(worker, 1)  # launched
    lane.launch_cost = PinnedWindow(60.0)
    assert burst_store(worker, 2)  # part of a burst: it waits
    threading.Timer(0.1, send_ctrl_c).start()
    with pytest.raises(KeyboardInterrupt):
        store(worker, 3)
    assert 3 not in worker._in_flight and 3 not in lane and worker._submitting == 0
    fake.complete_all()
    worker.wait([2])
    fake.complete_all()
    assert store(worker, 3)
    fake.complete_all()
    worker.wait([3])
    assert done(worker) == [(1, True), (2, True), (3, True)]
    worker.shutdown()


@pytest.mark.parametrize("kind", ["cpu", "expanding"])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("native", ["0", "1"])
def test_ctrl_c_inside_submits_waits_and_shutdown_on_a_real_backend(kind, direction, native, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", native)
    compiled_or_skip(native == "1")
    backend = CpuBackend() if kind == "cpu" else ExpandingCpuBackend()
    ctrl_c_inside_calls(backend, "cpu", direction == "store")


def test_sigint_is_held_back_on_the_main_thread_only():
    seen = {}

    def look(where):
        with deferred():
            seen[where] = signal.getsignal(signal.SIGINT)

    thread = threading.Thread(target=look, args=("thread",))
    thread.start()
    thread.join()
    look("main")
    assert seen == {"thread": signal.default_int_handler, "main": interrupts._record}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    # a submit from another thread launches with the handler untouched
    worker, fake = fake_worker()
    handlers = []
    copy = fake.copy_batch
    fake.copy_batch = lambda *a: (handlers.append(signal.getsignal(signal.SIGINT)), copy(*a))[1]
    submit = threading.Thread(target=store, args=(worker, 1))
    submit.start()
    submit.join()
    store(worker, 2)
    fake.complete_all()
    worker.wait([2])
    assert handlers == [signal.default_int_handler, interrupts._record]
    assert done(worker) == [(1, True), (2, True)]
    worker.shutdown()


def test_nested_sections_raise_once_as_the_outermost_ends():
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            with deferred():
                send_ctrl_c()
                send_ctrl_c()
            assert signal.getsignal(signal.SIGINT) is interrupts._record  # still held back
            reached = True
    assert reached and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an ignored SIGINT is left alone
    with deferred():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_the_engines_handler_runs_once_after_the_call_and_may_use_the_worker():
    """A handler that does not raise (an engine's, setting a flag), run with the SIGINT the
    submit held back; inside it, a `get_finished` holds back a SIGINT of its own."""
    worker, fake = fake_worker()
    copy = CtrlCInside(fake, "copy_batch")
    calls = []

    def handler(signum, frame):
        calls.append((copy.returned, signal.getsignal(signal.SIGINT) is handler))
        if len(calls) == 1:
            fake.complete_all()
            results = []
            poll = worker._queues[Direction.STORE].poll
            with deferred():
                send_ctrl_c()  # comes back to this handler as the section ends
                results += poll()
            calls.append([r.job_id for r in results])

    signal.signal(signal.SIGINT, handler)
    copy.arm()
    assert store(worker, 1)
    assert calls == [(True, True), (True, True), [1]]
    assert signal.getsignal(signal.SIGINT) is handler
    worker.shutdown()


def test_a_section_whose_end_was_cut_short_holds_nothing_back_for_good():
    """Another signal's handler raising at a section's edge can leave it open (its `__exit__`
    never ran): once the frame that opened it has gone, a SIGINT is delivered at once, and the
    next section starts afresh."""

    def cut_short():
        interrupts._DEFERRED.__enter__()  # as a `with` whose exit a raising handler skipped

    cut_short()
    assert signal.getsignal(signal.SIGINT) is interrupts._record
    with pytest.raises(KeyboardInterrupt):
        send_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and interrupts._depth == 0
    cut_short()
    with pytest.raises(KeyboardInterrupt):  # the next section releases the stale one, then holds back its own
        with deferred():
            assert interrupts._depth == 1
            send_ctrl_c()
            held = True
    assert held and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_is_held_back_too():
    """An engine's SIGTERM handler that raises (SystemExit) lands after the step, not inside."""

    def exit_now(signum, frame):
        raise SystemExit(3)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        with pytest.raises(SystemExit):
            with deferred():
                signal.raise_signal(signal.SIGTERM)
                whole = True
        assert whole and signal.getsignal(signal.SIGTERM) is exit_now
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_child_forked_inside_a_section_gets_the_handler_back():
    import warnings

    with deferred():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # pytest's threads: the child calls nothing of theirs
            pid = os.fork()
        if pid == 0:
            ok = signal.getsignal(signal.SIGINT) is signal.default_int_handler and interrupts._depth == 0
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


SWEEP = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, torch
    from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker
    faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the test, with the stacks
    page = 1 << 20
    kv = KVCaches([KVCacheTensor(torch.ones(16, page, dtype=torch.uint8), page)], [[KVCacheRef(0, page)]])
    for call in ("wait", "shutdown"):
        for k in range(30):
            w = OffloadWorker(kv, 16, backend="cpu")
            for j in range(8):
                w.submit_store(j, DeviceBlocks([j]), HostBlocks([j]))
            seen = [0]
            def prof(frame, event, arg):  # a SIGINT at the k-th call into threading.py
                if event == "call" and frame.f_code.co_filename.endswith("threading.py"):
                    seen[0] += 1
                    if seen[0] > k:
                        sys.setprofile(None)
                        os.kill(os.getpid(), signal.SIGINT)
            sys.setprofile(prof)
            try:
                w.wait(range(8)) if call == "wait" else w.shutdown()
            except KeyboardInterrupt:
                pass
            sys.setprofile(None)
            w.shutdown()
            assert sorted(r.job_id for r in w.get_finished()) == list(range(8)), (call, k)
    print("ok")
    """
)


def test_a_ctrl_c_at_any_instant_of_a_wait_or_shutdown_on_the_cpu_backend_leaves_shutdown_working():
    """A SIGINT delivered at each of the first calls into `threading` during `wait` and during
    `shutdown` (where one inside `threading.Event.wait` could leave the event's lock held, and the
    cpu stream's `set` of it blocked for good): the next `shutdown` returns every result."""
    out = subprocess.run([sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
