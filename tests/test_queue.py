"""Ordering, waiting, shutdown and failures, with a backend whose events complete when the test says so."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import PinnedWindow, compiled_or_skip, small_kv
from hypothesis import given
from hypothesis import strategies as st

from offload_core import DeviceBlocks, Direction, HostBlocks, InvalidSpecError, OffloadError, OffloadWorker
from offload_core.queue import BACKLOG, JOIN_PAYS, MAX_QUIET_S, PROBE_EVERY, LaunchCost, TransferQueue, _first_clash
from offload_core.testing.fake import FakeBackend


@pytest.fixture
def fake():
    return FakeBackend()


def one_launch_per_job(worker):
    """Each submit launches its job at once, alone (a burst of one): the fake's events then
    belong to one job each, a start and an end per job on its lane's stream."""
    for lane in worker._lanes:
        lane.burst_jobs = 1
    return worker


@pytest.fixture
def worker(fake):
    with OffloadWorker(small_kv(), 8, backend=fake) as w:
        yield one_launch_per_job(w)


def store(worker, job_id, block=0, host=0):
    return worker.submit_store(job_id, DeviceBlocks([block]), HostBlocks([host]))


def load(worker, job_id, host=0, block=0):
    return worker.submit_load(job_id, HostBlocks([host]), DeviceBlocks([block]))


def test_results_come_in_submission_order_even_when_a_later_job_finishes_first(worker, fake):
    for job in (1, 2, 3):
        assert store(worker, job, block=job, host=job)
    ends = fake.job_ends(fake.streams[0])
    fake.complete(ends[2])
    fake.complete(ends[1])
    assert worker.get_finished() == []
    fake.complete(ends[0])
    assert [r.job_id for r in worker.get_finished()] == [1, 2, 3]
    assert worker.get_finished() == []


def test_directions_are_independent_and_each_stays_ordered(worker, fake):
    store(worker, 1, block=1, host=1)
    load(worker, 2, host=2, block=2)
    store(worker, 3, block=3, host=3)
    fake.complete(fake.job_ends(fake.streams[1])[0])  # the load finishes first
    results = worker.get_finished()
    assert [(r.job_id, r.direction) for r in results] == [(2, "load")]
    fake.complete_all()
    assert [(r.job_id, r.direction) for r in worker.get_finished()] == [(1, "store"), (3, "store")]


def test_every_job_waits_for_the_compute_stream_then_the_previous_job(worker, fake):
    store(worker, 1, block=1)
    load(worker, 2, host=1, block=2)  # another host block: no hazard between the lanes
    ops = [(op, s) for op, s, *_ in fake.log]
    # per job: an event on the compute stream at submit; at its launch, on the lane's stream, a
    # wait for that event, a start event, the copy, an end event
    assert ops == [
        ("record", "compute"),
        ("wait_event", "s0"),
        ("record", "s0"),
        ("copy", "s0"),
        ("record", "s0"),
        ("record", "compute"),
        ("wait_event", "s1"),
        ("record", "s1"),
        ("copy", "s1"),
        ("record", "s1"),
    ]
    assert [x[2] for x in fake.log if x[0] == "wait_event"] == [
        x[2] for x in fake.log if x[:2] == ("record", "compute")
    ]
    # one stream per lane (store, load, expedited load): later jobs run behind earlier ones by stream order
    store(worker, 3, block=3)
    assert fake.log[-1][:2] == ("record", "s0") and len(fake.streams) == 3


def test_wait_blocks_until_done_without_consuming(worker, fake):
    store(worker, 1, block=1, host=1)
    store(worker, 2, block=2, host=2)
    worker.wait({1, 99})  # unknown ids are ignored
    ends = fake.job_ends(fake.streams[0])
    assert ends[0].done and not ends[1].done
    assert [r.job_id for r in worker.get_finished()] == [1]
    worker.wait([2])
    worker.wait([2])
    assert [r.job_id for r in worker.get_finished()] == [2]
    worker.wait([1, 2])  # already reported: ignored
    assert worker.get_finished() == []


def test_transfer_size_and_time_are_reported(worker, fake):
    worker.submit_store(1, DeviceBlocks([1, 2, 3]), HostBlocks([0, 1, 2]))
    fake.complete_all()
    (result,) = worker.get_finished()
    assert result.success and result.transfer_size == 3 * (64 + 128) and result.transfer_time > 0


def test_a_job_id_in_flight_is_rejected_in_either_direction(worker, fake):
    store(worker, 7, block=1, host=1)
    from offload_core import InvalidSpecError

    with pytest.raises(InvalidSpecError, match="job id 7 is still in flight"):
        load(worker, 7, host=2, block=2)
    fake.complete_all()
    worker.get_finished()
    assert load(worker, 7, host=2, block=2)  # reported jobs free their id


def test_shutdown_drains_jobs_in_flight_and_keeps_their_results(worker, fake):
    store(worker, 1, block=1, host=1)
    load(worker, 2, host=2, block=2)
    worker.shutdown()
    assert all(e.done for e in fake.recorded())
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
    worker.shutdown()  # harmless
    assert worker.host_tensors == []
    with pytest.raises(OffloadError, match="shut down"):
        store(worker, 3)


def test_shutdown_releases_each_lanes_stream_once_after_its_last_job(worker, fake):
    store(worker, 1, block=1, host=1)
    load(worker, 2, host=2, block=2)
    assert worker.submit_load(3, HostBlocks([3]), DeviceBlocks([3]), expedited=True)
    assert not [x for x in fake.log if x[0] == "release_stream"]
    worker.shutdown()
    worker.shutdown()
    released = [x for x in fake.log if x[0] == "release_stream"]
    assert sorted(name for _, name, _ in released) == sorted(s.name for s in fake.streams)
    assert all(unfinished == 0 for _, _, unfinished in released)


def test_a_ctrl_c_inside_a_streams_release_leaves_it_to_the_next_shutdown(worker, fake, monkeypatch):
    """A backend's release may wait for the device (cuda: work a Ctrl-C left on side streams),
    so a Ctrl-C can land in it: the next shutdown releases that stream again, and the others once."""
    release = fake.release_stream
    cut = []

    def interrupted_once(stream):
        if not cut:
            cut.append(stream.name)
            raise KeyboardInterrupt
        release(stream)

    monkeypatch.setattr(fake, "release_stream", interrupted_once)
    store(worker, 1, block=1, host=1)
    with pytest.raises(KeyboardInterrupt):
        worker.shutdown()
    worker.shutdown()
    worker.shutdown()
    released = sorted(x[1] for x in fake.log if x[0] == "release_stream")
    assert cut and released == sorted(s.name for s in fake.streams)


def test_a_device_fault_fails_that_job_only(worker, fake):
    store(worker, 1, block=1, host=1)
    store(worker, 2, block=2, host=2)
    ends = fake.job_ends(fake.streams[0])
    fake.complete(ends[0], error=RuntimeError("illegal address"))
    fake.complete(ends[1])
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, False), (2, True)]
    assert store(worker, 3, block=3, host=3)
    fake.complete_all()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, True)]


def test_wait_and_shutdown_survive_a_fault(worker, fake):
    store(worker, 1, block=1, host=1)
    fake.complete(fake.job_ends(fake.streams[0])[0], error=RuntimeError("ECC"))
    worker.wait([1])
    worker.shutdown()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]


def test_an_enqueue_failure_fails_the_job_once_what_it_enqueued_has_run(worker, fake):
    fake.fail_enqueue = RuntimeError("cuMemcpyBatchAsync failed at index 3")
    assert store(worker, 1, block=1, host=1)  # queued: its launch fails later (here, at once)
    lane = worker._queues[Direction.STORE]
    assert (lane.stats.launches, lane.stats.jobs) == (0, 0) and lane.stats.launch_s > 0  # timed, not counted
    assert len(lane._free_events) == 1  # the job's ready event: its wait was enqueued
    assert worker.get_finished() == []  # copies enqueued before the failure may still run
    fake.complete_all()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]
    assert store(worker, 1, block=1, host=1)  # the id is free again
    fake.complete_all()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    assert fake.syncs == 0  # nothing waited for the device


def test_events_are_reused(worker, fake):
    created = []
    original = fake.new_event
    fake.new_event = lambda: created.append(1) or original()
    for job in range(50):
        store(worker, job, block=job % 16, host=job % 8)
        fake.complete_all()
        worker.get_finished()
    # steady state: a job's event on the compute stream and its launch's start and end, pooled
    # once reported
    assert len(created) <= 3


def test_empty_job_still_completes_in_order(worker, fake):
    store(worker, 1, block=1, host=1)
    assert worker.submit_store(2, DeviceBlocks([]), HostBlocks([]))
    fake.complete_all()
    results = worker.get_finished()
    assert [(r.job_id, r.transfer_size) for r in results] == [(1, 192), (2, 0)]
    assert sum(1 for x in fake.log if x[0] == "copy") == 1  # an empty batch never reaches the backend


# ---- a state machine against a model of the contract ------------------------------

from hypothesis import settings as _settings  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402


class QueueContract(RuleBasedStateMachine):
    """Random submits, completions, faults, polls and waits; the model says what must come back:
    every job once, each direction in submission order, failures as failures, nothing early."""

    def __init__(self):
        super().__init__()
        self.fake = FakeBackend()
        self.worker = one_launch_per_job(OffloadWorker(small_kv(), 8, backend=self.fake))
        self.next_id = 0
        self.pending = {"store": [], "load": []}  # job ids in submission order, not yet reported
        self.failed: set[int] = set()
        self.reported: list = []

    def _end_event(self, job_id):
        """The end event of a job still queued, else None."""
        for queue in self.worker._queues.values():
            for job in queue._jobs:
                if job.job_id == job_id:
                    return job.end
        return None

    @rule(direction=st.sampled_from(["store", "load"]), block=st.integers(0, 15))
    def submit(self, direction, block):
        job = self.next_id
        self.next_id += 1
        ok = (
            store(self.worker, job, block=block, host=block % 8)
            if direction == "store"
            else load(self.worker, job, host=block % 8, block=block)
        )
        assert ok
        self.pending[direction].append(job)

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data(), fail=st.booleans())
    def complete_one(self, data, fail):
        job = data.draw(st.sampled_from(self.pending["store"] + self.pending["load"]))
        end = self._end_event(job)
        if end is not None and not end.done:
            self.fake.complete(end, error=RuntimeError("fault") if fail else None)
            if fail:
                self.failed.add(job)

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def wait_for(self, data):
        job = data.draw(st.sampled_from(self.pending["store"] + self.pending["load"]))
        self.worker.wait([job, 10_000])
        end = self._end_event(job)
        assert end is None or end.done

    @rule()
    def poll(self):
        results = self.worker.get_finished()
        for r in results:
            queue = self.pending[r.direction]
            assert queue and queue[0] == r.job_id, "out of order, twice, or never submitted"
            queue.pop(0)
            assert r.success == (r.job_id not in self.failed)
        self.reported += results

    @invariant()
    def nothing_reported_before_its_end(self):
        for queue in self.pending.values():
            for job in queue:
                assert self._end_event(job) is not None  # still queued, so still unreported

    def teardown(self):
        self.worker.shutdown()
        rest = self.worker.get_finished()
        for r in rest:
            assert self.pending[r.direction][0] == r.job_id
            self.pending[r.direction].pop(0)
        assert not any(self.pending.values())


QueueContract.TestCase.settings = _settings(max_examples=40, stateful_step_count=30, deadline=None)
test_queue_contract = QueueContract.TestCase


def test_an_expedited_load_never_queues_behind_regular_loads(worker, fake):
    load(worker, 1, host=1, block=1)  # a regular load the device has not finished
    assert worker.submit_load(2, HostBlocks([2]), DeviceBlocks([2]), expedited=True)
    load(worker, 3, host=3, block=3)
    load_stream, expedited_stream = fake.streams[1], fake.streams[2]
    assert [x[1] for x in fake.log if x[0] == "copy"] == [load_stream.name, expedited_stream.name, load_stream.name]
    for event in fake.recorded(expedited_stream):
        fake.complete(event)
    results = worker.get_finished()
    assert [(r.job_id, r.direction, r.success) for r in results] == [(2, "load", True)]
    worker.wait([1, 3])  # the regular lane, in its own order
    assert [r.job_id for r in worker.get_finished()] == [1, 3]
    stats = worker.stats()
    assert (stats["load"].jobs, stats["expedited_load"].jobs) == (2, 1)


def test_shutdown_waits_for_expedited_loads_too(worker, fake):
    assert worker.submit_load(4, HostBlocks([4]), DeviceBlocks([4]), expedited=True)
    worker.shutdown()
    assert [r.job_id for r in worker.get_finished()] == [4]
    with pytest.raises(OffloadError, match="shut down"):
        worker.submit_load(5, HostBlocks([5]), DeviceBlocks([5]), expedited=True)


def test_a_drain_whose_wait_fails_asks_until_the_work_has_passed(fake):
    """An event whose `synchronize` fails while its work still runs (and `query` answers): shutdown
    must not return, and let the host buffer go, before the job has finished; its result comes
    from the drain."""
    import threading

    from offload_core.testing.fake import FakeEvent

    class WaitFails(FakeEvent):
        def synchronize(self):
            raise RuntimeError("a transient fault while waiting")

    fake.new_event = lambda: WaitFails(fake)
    worker = OffloadWorker(small_kv(), 8, backend=fake)
    assert store(worker, 1, block=1, host=1)
    end = fake.job_ends(fake.streams[0])[0]
    timer = threading.Timer(0.2, fake.complete_all)  # the device finishes later
    timer.start()
    worker.shutdown()
    assert end.done, "shutdown returned while the job still ran"
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    timer.join()


def test_get_finished_racing_shutdown_returns_each_lane_in_order(fake):
    """A poll that took a lane's first results, then is slow on the next lane, while shutdown
    collects the lane's later results: the later ones must come after, in any list."""
    import threading
    import time

    from offload_core.testing.fake import FakeEvent

    polled = threading.Event()
    release = threading.Event()

    class SlowLoadQuery(FakeEvent):
        def query(self):
            if threading.current_thread().name == "poller" and self.stream is fake.streams[1] and release.is_set():
                polled.set()  # the store lane was polled already
                time.sleep(0.3)
            return super().query()

    fake.new_event = lambda: SlowLoadQuery(fake)
    worker = OffloadWorker(small_kv(), 8, backend=fake)
    for job in (0, 1):
        assert store(worker, job, block=job, host=job)
    assert load(worker, 10, host=5, block=5)
    fake.complete_all()
    for job in (2, 3):
        assert store(worker, job, block=job, host=job)
    ends = fake.job_ends(fake.streams[0])
    for e in ends[:2]:
        fake.complete(e)
    release.set()
    out = []
    poller = threading.Thread(target=lambda: out.extend(worker.get_finished()), name="poller")
    poller.start()
    polled.wait(5)
    fake.complete_all()
    worker.shutdown()  # collects stores 2 and 3 while the poller sits in the load lane
    poller.join()
    out += worker.get_finished()
    assert [r.job_id for r in out if r.direction == "store"] == [0, 1, 2, 3]
    assert sorted(r.job_id for r in out) == [0, 1, 2, 3, 10]


class _Keys:
    """What `_first_clash` reads of a job: its destination keys, their bound, and whether its
    layout takes the compiled steps."""

    def __init__(self, keys, limit, compiled):
        self._keys, self.destination_limit = np.array(keys, dtype=np.int64), limit
        self.layout = SimpleNamespace(native=compiled)

    def destinations(self):
        return self._keys


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@given(
    jobs=st.lists(st.lists(st.integers(0, 63), max_size=12), min_size=1, max_size=8),
    limit_extra=st.sampled_from([0, 100000]),  # a bound near the keys (bitmap) or far above them (sort)
)
def test_a_launch_ends_before_the_first_job_that_writes_what_an_earlier_one_writes(compiled, jobs, limit_extra):
    module = compiled_or_skip(compiled)
    want = len(jobs)
    for i in range(1, len(jobs)):
        if set(jobs[i]) & set().union(*jobs[:i]):
            want = i
            break
    assert _first_clash([_Keys(k, 64 + limit_extra, module) for k in jobs]) == want


def test_the_compiled_clash_check_counts_every_key_and_lets_go_of_every_buffer():
    from array import array

    module = compiled_or_skip(True)
    many = [np.arange(i * 1000, i * 1000 + 1000, dtype=np.int64) for i in range(40)]
    assert module.first_clash(many, 1 << 40) == 40
    many[33] = many[33].copy()
    many[33][-1] = 5  # job 0's key, in the last place of job 33
    assert module.first_clash(many, 1 << 40) == 33
    assert module.first_clash([np.array([7, 7, 7], dtype=np.int64), np.array([8], dtype=np.int64)], 1 << 40) == 2
    assert module.first_clash([], 8) == 0
    assert module.first_clash([np.array([3], dtype=np.int64)], 8) == 1
    assert module.first_clash([np.array([-1], dtype=np.int64), np.array([-1], dtype=np.int64)], 1 << 40) == 1
    # 8 and 16 both hash to the last of the 8 slots that 3 keys get: 16 wraps to slot 0
    assert module.first_clash([np.array([8, 16], dtype=np.int64), np.array([16], dtype=np.int64)], 1 << 40) == 1
    keys = [array("q", [1, 2]), array("q", [3, 2]), array("q", [9])]
    assert module.first_clash(keys, 1 << 40) == 1
    # a bound near the keys: the bitmap's way, a bit for each possible key
    many[33][-1] = 33999
    assert module.first_clash(many, 40000) == 40
    many[33][-1] = 5
    assert module.first_clash(many, 40000) == 33
    assert module.first_clash([np.array([7, 7, 7], dtype=np.int64), np.array([8], dtype=np.int64)], 9) == 2
    assert module.first_clash([np.array([63], dtype=np.int64), np.array([64, 63], dtype=np.int64)], 65) == 1
    for bad in (-1, 9):  # outside [0, limit): refused, never a write outside the bitmap
        with pytest.raises(ValueError, match=f"key {bad} of job 1 lies outside"):
            module.first_clash([np.array([1], dtype=np.int64), np.array([2, bad], dtype=np.int64)], 9)
    for a in keys:
        a.append(0)
    with pytest.raises(TypeError, match="keys must be a C-contiguous int64 array"):
        module.first_clash([np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)], 8)


def test_a_backends_buffer_waits_during_an_enqueue_count_for_that_lane():
    class Waiting(FakeBackend):
        waits = 0

        def buffer_waits(self):
            return self.waits, 0.5 * self.waits

        def copy_batch(self, src, dst, sizes, direction, stream):
            self.waits += direction is Direction.LOAD  # as a full descriptor ring makes the enqueue wait
            return super().copy_batch(src, dst, sizes, direction, stream)

    fake = Waiting()
    with OffloadWorker(small_kv(), 8, backend=fake) as w:
        one_launch_per_job(w)
        store(w, 1)
        load(w, 2, block=1)
        load(w, 3, block=2)
        fake.complete_all()
        stats = w.stats()
        assert (stats["load"].buffer_waits, stats["load"].buffer_wait_s) == (2, 1.0)
        assert (stats["store"].buffer_waits, stats["store"].buffer_wait_s) == (0, 0.0)


def test_a_closed_queue_refuses_jobs(worker, fake):
    job = worker._layout.job(Direction.STORE, DeviceBlocks([0]), HostBlocks([0]))
    queue = TransferQueue(fake, Direction.STORE)
    queue.close()
    with pytest.raises(OffloadError, match="store queue is closed"):
        queue.add(7, job, None, 1, ())
    assert 7 not in queue and not queue.poll()


@pytest.mark.parametrize("value", ["False", "no", np.array([1, 0]), 2])
def test_canonical_layout_must_be_a_truth_value(value):
    with pytest.raises(InvalidSpecError, match="canonical_layout must be True or False"):
        OffloadWorker(small_kv(), 4, backend="cpu", canonical_layout=value)


def _cost(*launches):
    cost = LaunchCost()
    for jobs, us in launches:
        cost.note(jobs, us * 1e-6)
    return cost


def test_launches_of_one_job_set_the_window_until_larger_ones_measure_the_fixed_part():
    cost = _cost((1, 90), (1, 100))
    assert cost.window == pytest.approx(90e-6 * 1.0625)  # the least lately, rising a sixteenth a launch
    assert cost.fixed is None and cost.pair  # two jobs of a burst go as one, to measure it
    cost = _cost((1, 90), (2, 130))
    assert cost.fixed == pytest.approx(50e-6) and not cost.pair
    cost.note(4, 80e-6)  # faster than a launch of one: it bounds it, and no pair measures against a bound
    assert cost.fixed is None and not cost.pair


def test_where_joining_saves_little_only_submits_closer_than_that_join():
    # 20 us fixed, 70 a job: joining saves a fifth of a job's time only up to a 10 us gap, though
    # submits that launch their own jobs come closer together than a launch of one takes
    cost = _cost((1, 90), (4, 300))
    assert cost.fixed == pytest.approx(20e-6)
    assert cost.window == pytest.approx(10e-6)
    cost.note(1, 85e-6)  # a little faster: the fixed part still holds
    assert cost.fixed == pytest.approx(20e-6)
    assert _cost((1, 90), (2, 180)).window == 0.0  # nothing fixed: nothing to save


def test_where_joining_saves_much_submits_further_apart_still_join():
    # 60 us fixed, 8 a job: joining saves a fifth of a job's time up to a gap of 4 x 60 - 8
    cost = _cost((1, 68), (16, 188))
    assert cost.fixed == pytest.approx(60e-6)
    assert cost.window == pytest.approx(60e-6 * (1 / JOIN_PAYS - 1) - 8e-6)


def test_a_larger_launch_faster_than_a_launch_of_one_bounds_it_and_forgets_the_fixed_part():
    # a slow first launch (a compile, say), then a slow joined one: milliseconds of fixed part
    cost = _cost((1, 5000), (2, 5000))
    assert cost.window == MAX_QUIET_S  # at most: the launcher's longest wait
    cost.note(16, 300e-6)  # the host is fast after all
    assert cost.window == pytest.approx(300e-6) and cost.fixed is None
    cost.note(16, 310e-6)  # a bound, not a launch of one: no fixed part from it
    assert cost.fixed is None
    cost.note(1, 40e-6)
    cost.note(16, 340e-6)
    assert cost.fixed == pytest.approx(20e-6)


def test_the_fixed_part_never_exceeds_a_launch_of_one_and_a_faster_launch_of_one_forgets_it():
    cost = _cost((1, 100), (8, 100))
    assert cost.fixed == pytest.approx(100e-6)
    cost.note(1, 50e-6)  # the host sped up: the fixed part was measured against the slower one
    assert cost.fixed is None and cost.window == pytest.approx(50e-6)


def test_after_probe_every_joined_launches_the_next_launch_carries_one_job():
    cost = _cost((1, 2000))  # a slow first launch: every later submit joins a burst
    for _ in range(PROBE_EVERY - 1):
        cost.note(16, 2100e-6)
        assert not cost.probe
    cost.note(16, 2100e-6)
    assert cost.probe
    cost.note(1, 90e-6)
    assert not cost.probe and cost.window == pytest.approx(90e-6)


def test_after_probe_every_launches_of_one_job_the_fixed_part_is_measured_again():
    # auto's trial of a slower mechanism, joined: a fixed part of nothing, no burst after it
    cost = _cost((1, 100), (4, 4000))
    assert cost.fixed == 0.0 and cost.window == 0.0
    for _ in range(PROBE_EVERY - 1):
        cost.note(1, 100e-6)
        assert cost.window == 0.0
    cost.note(1, 100e-6)
    assert cost.fixed is None and cost.window == pytest.approx(100e-6)  # submits this close join again
    cost.note(4, 160e-6)  # and the joined launch measures it: 80 us fixed, 20 a job
    assert cost.fixed == pytest.approx(80e-6) and cost.window == pytest.approx(80e-6 * (1 / JOIN_PAYS - 1) - 20e-6)


def test_the_window_stays_within_the_launchers_longest_wait():
    assert _cost((1, 1e6)).window == MAX_QUIET_S


def _no_launcher(worker, window: float):
    """Jobs go only with a submit or a wait; submits closer than `window` form a burst."""
    for lane in worker._lanes:
        lane._launcher = object()
        lane.launch_cost = PinnedWindow(window)
    return worker._queues[Direction.STORE]


def test_a_submit_not_in_a_burst_launches_at_once_until_the_device_is_backlog_launches_behind(fake):
    with OffloadWorker(small_kv(), 8, backend=fake) as worker:
        lane = _no_launcher(worker, 0.0)
        for j in range(BACKLOG):  # the device busy with each, the next launches all the same
            assert store(worker, j, block=j, host=j) and not lane.waiting_for_launch()
        assert lane.stats.launches == BACKLOG
        store(worker, 5, block=5, host=5)
        store(worker, 6, block=6, host=6)
        assert lane.waiting_for_launch()  # behind the backlog: they wait, to go as one
        fake.complete_all()
        store(worker, 7, block=7, host=7)  # the device has caught up: this one launches them all
        assert not lane.waiting_for_launch() and lane.stats.launches == BACKLOG + 1
        fake.complete_all()
        worker.wait([7])
        assert [r.job_id for r in worker.get_finished()] == [*range(BACKLOG), 5, 6, 7]


def test_a_probe_launch_carries_one_job(fake):
    with OffloadWorker(small_kv(), 8, backend=fake) as worker:
        lane = _no_launcher(worker, 60.0)  # every submit after the first part of a burst
        store(worker, 0)
        for j in (1, 2, 3):
            store(worker, j, block=j, host=j)
        lane.launch_cost.probe = True
        fake.complete_all()
        worker.wait([3])  # launches what waits: one job, then (the pinned probe still asking) one
        assert lane.stats.launches == 4
        lane.launch_cost.probe = False
        for j in (4, 5, 6):
            store(worker, j, block=j, host=j)
        fake.complete_all()
        worker.wait([6])
        assert lane.stats.launches == 5
