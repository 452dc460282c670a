"""The cuda backend's joined launch of simple jobs (`CudaBackend.copy_jobs`, through
`_driver.join_launch`) against what the queue does without it, `copy_blocks` of the jobs joined
and put in host order: the same choice, the same driver calls with the same arguments, the same
table bytes; and where the joined launch declines, nothing enqueued. Without a GPU: the
stand-in libcuda of `cuda_fakes`, Triton's compiled kernel as `test_cuda_launch` stands it
in, the real descriptor ring over numpy memory."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_fakes import FakeCudaRuntime, LaunchingLib
from helpers import Model, compiled_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cuda_launch import Stream, comparable, compiled_backend

from offload_core import DeviceBlocks, HostBlocks
from offload_core.backend import Direction
from offload_core.backends.cuda import blocks, driver, tuning
from offload_core.backends.cuda.ring import DescriptorRing
from offload_core.compact import CompactJob

DEVICE_BLOCKS, HOST_BLOCKS = 64, 48
RING = 1 << 40  # the ring's device address: 64-bit, as the hand launch needs


def numpy_ring(backend, entries: int = 1 << 12) -> DescriptorRing:
    """The backend's descriptor ring with host memory from numpy (no pinned torch memory here)."""
    ring = DescriptorRing(
        None,
        None,
        backend._table_copy,
        entries,
        launch=backend.driver.table_launch_in(backend._ctx),
        join=backend.driver.join_launch_in(backend._ctx),
    )
    host = np.zeros(entries, dtype=np.int64)
    ring._flat, ring._host_ptr, ring._dev_ptr, ring._host = host, host.ctypes.data, RING, host
    return ring


class Decided(tuning.Tuner):
    """A tuner whose every class is decided: host rows apart for `apart`, in runs for `runs`."""

    def __init__(self, apart="expand_direct", runs="expand_staged"):
        super().__init__(None)
        self.names = {False: apart, True: runs}

    def decided(self, key):
        return self.names[key.runs]


class Launches:
    """A backend over the stand-in libcuda, a simple layout (one group: 16 and 8 byte pages of
    one block per host row), both ways of launching jobs of it, and a tuner that decided every
    class (`Decided`)."""

    def __init__(self, monkeypatch, tuner=None):
        compiled_or_skip(True, driver.COMPILED)
        handles = iter(range(0x100, 0x400))
        monkeypatch.setattr(FakeCudaRuntime, "ExternalStream", lambda self, handle, device=None: Stream(next(handles)))
        self.lib = LaunchingLib()
        self.backend = b = compiled_backend(monkeypatch, self.lib)
        b._ring = numpy_ring(b)
        model = Model([16, 8], [[(0, 16), (1, 8)]], 1, DEVICE_BLOCKS, HOST_BLOCKS)
        self.layout = model.layout(host_base=0x7F00_0000_0000)  # where pinned host memory lies
        assert self.layout.simple_jobs
        b._blocks.direct_ok = lambda prepared: True
        b._blocks.tuner = tuner or Decided()
        b._blocks.timings = tuning.Timings(b._blocks.tuner)
        self.prepared = b._blocks.prepare(self.layout)
        self.stream = b.new_stream()
        self.compute = b.new_event()

    def jobs(self, direction, specs) -> list[CompactJob]:
        return [self.layout.job(direction, DeviceBlocks(d), HostBlocks(h)) for d, h in specs]

    def run(self, launch):
        """`launch(stream, after)` from an empty ring; returns its mechanism, the driver's
        enqueueing calls, and the ring's host memory afterwards."""
        ring, lib = self.backend._ring, self.lib
        ring._regions.clear()
        ring._head = 0
        ring._flat[:] = -1
        self.compute.record(self.backend.current_stream())
        lib.calls.clear()
        used = launch(self.stream, [self.compute])
        return used, comparable(lib.calls), ring._flat.copy()

    def joined(self, jobs):
        return self.run(lambda stream, after: self.backend.copy_jobs(jobs, self.prepared, stream, after))

    def queued(self, jobs):
        job = CompactJob.concat(jobs).in_host_order()
        return self.run(lambda stream, after: self.backend.copy_blocks(job, self.prepared, stream, after))


def job_specs(draw, count: int, runs: bool):
    """`count` jobs of distinct device and host blocks; host blocks in runs where `runs`."""
    n = draw(st.integers(1, 6))
    devs = draw(st.permutations(range(DEVICE_BLOCKS)))[: n * count]
    if runs:
        first = draw(st.integers(0, HOST_BLOCKS - n * count))
        hosts = list(range(first, first + n * count))[::-1]
    else:
        hosts = draw(st.permutations(range(HOST_BLOCKS)))[: n * count]
    return [(devs[i * n : (i + 1) * n], hosts[i * n : (i + 1) * n]) for i in range(count)]


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    direction=st.sampled_from(list(Direction)),
    narrow=st.booleans(),
    apart=st.sampled_from(["expand_direct", "expand_staged"]),  # the class of host rows apart decided for
)
def test_a_joined_launch_makes_the_calls_and_table_of_the_queues_joined_job(data, direction, narrow, apart):
    """Any launch of 1-8 jobs, host rows apart or in runs: where `copy_jobs` takes them, it chose,
    called and wrote what `copy_blocks` of their joined job does; where it declines (the class
    not decided for expand_direct, or the rows in runs), it enqueued nothing, and `copy_blocks`
    does not send them to expand_direct."""
    with pytest.MonkeyPatch.context() as mp:
        launches = Launches(mp, Decided(apart))
        launches.prepared.narrow = narrow
        mp.setattr(blocks, "JOIN_BACKOFF", 0)  # every launch offered
        count = data.draw(st.integers(1, 8))
        jobs = launches.jobs(direction, job_specs(data.draw, count, data.draw(st.booleans())))
        used, calls, table = launches.joined(jobs)
        reference = launches.queued(jobs)
        if used is not None:
            assert (used, calls) == reference[:2]
            assert (table == reference[2]).all(), "the same table bytes"
        else:  # then the queue joins them, and `copy_blocks` stages them
            assert [c[0] for c in calls] in ([], ["record"]), "declined: nothing but a keepalive marker"
            assert reference[0] != "expand_direct", "declined what copy_blocks sends to expand_direct"


def test_scattered_host_blocks_take_the_joined_launch_in_host_order_rows_in_runs_do_not(monkeypatch):
    """Not vacuous: scattered host blocks go joined, in host order (the table's host column
    sorted); host blocks in runs (another class) are declined; nothing is joined before the
    class is decided."""
    launches = Launches(monkeypatch)
    specs = [([5, 9, 2], [31, 3, 17]), ([40, 1], [30, 4])]  # five runs as given, three in host order
    for direction in Direction:
        used, calls, table = launches.joined(launches.jobs(direction, specs))
        assert used == "expand_direct"
        assert [c[0] for c in calls] == ["memcpy", "launch", "record"]
        assert table.view(np.int32)[:10].tolist() == [9, 1, 2, 40, 5, 3, 4, 17, 30, 31]
        used, calls, _ = launches.joined(launches.jobs(direction, [([5, 9, 2], [7, 5, 6])]))
        assert used is None and [c[0] for c in calls] == ["record"], "declined: a keepalive marker only"
    undecided = Launches(monkeypatch, tuning.Tuner(None))
    assert undecided.joined(undecided.jobs(Direction.STORE, specs))[:2] == (None, [])


def test_a_forced_backend_leaves_its_jobs_to_copy_blocks(monkeypatch):
    launches = Launches(monkeypatch)
    jobs = launches.jobs(Direction.STORE, [([5, 9], [30, 3])])
    b = launches.backend
    b.mechanism = "expand_staged"
    assert launches.joined(jobs)[:2] == (None, [])


def test_the_compiled_join_declines_or_refuses_having_called_nothing(monkeypatch):
    launches = Launches(monkeypatch)
    b, lib = launches.backend, launches.lib
    join = b.driver.join_launch_in(b._ctx)
    host = np.full(16, -1, dtype=np.int64)

    def call(parts, room=128, order=True, least=0, params=(RING, *range(1, 9), 0, 0)):
        # params as LaunchingLib reads them
        args = (host.ctypes.data, RING, room, parts, True, 0x77, 0xF00, 1, 128, 0, params, order, least)
        return join(*args)

    one = ([np.array([4, 5, 6])], [np.array([9, 7, 8])])
    two = ([np.array([4, 5]), np.array([6])], [np.array([9, 3]), np.array([4])])  # hosts 9 / 3 4: two runs
    lib.calls.clear()
    assert call(one, least=3) == 1  # one run in host order (7 8 9): fewer than 3
    assert call(one, least=3, order=False) == 2  # as given (9 / 7 8): two runs
    assert call(two, least=3, order=False) == 2  # several parts read where they lie
    assert lib.calls == []  # the table's memory, reserved for the call, may hold the hosts
    host[:] = -1
    refusals = [
        (ValueError, "differ in length", dict(parts=([np.arange(2)], [np.arange(3)]))),
        (ValueError, "as many arrays", dict(parts=([np.arange(2)], [np.arange(2)] * 2))),
        (ValueError, "as many arrays", dict(parts=([], []))),
        (ValueError, r"must be \(devs, hosts\), got 1", dict(parts=(one[0],))),
        (TypeError, "int64", dict(parts=([np.arange(2, dtype=np.int32)], [np.arange(2)]))),
        (ValueError, "does not fit the 20", dict(parts=one, room=20)),
        (ValueError, "at most 24 params", dict(parts=one, params=(0,) * 25)),
        (TypeError, "sequence", dict(parts=5)),
    ]
    for error, message, kwargs in refusals:
        with pytest.raises(error, match=message):
            call(**kwargs)
    assert lib.calls == [] and (host == -1).all()
    assert call(one, least=1, order=False) is None  # as given: 4 5 6 / 9 7 8
    assert host.view(np.int32)[:6].tolist() == [4, 5, 6, 9, 7, 8]
    assert [c[0] for c in lib.calls] == ["memcpy", "launch"]
    assert call(two, least=2, order=False) is None
    assert host.view(np.int32)[:6].tolist() == [4, 5, 6, 9, 3, 4]
    with pytest.raises(TypeError, match="takes 19 arguments"):
        driver.compiled().join_launch(1, 2, 3)


def test_declined_offers_back_off_and_a_taken_one_resets(monkeypatch):
    """A launch the joined path declines (its host rows in runs) costs a join and an event for
    nothing: the next offers are skipped, 1, 2, 4... launches after each decline; one taken
    offers every launch again."""
    launches = Launches(monkeypatch)
    in_runs = launches.jobs(Direction.STORE, [([5, 9, 2], [30, 31, 32])])
    offered = []
    for _ in range(10):
        offered.append(launches.joined(in_runs)[1] != [])  # an offer made records the keepalive marker
    assert offered == [True, False, True, False, False, True, False, False, False, False]
    apart = launches.jobs(Direction.STORE, [([5, 9], [30, 3])])
    for _ in range(3):
        launches.joined(apart)  # the skips run out; then taken
    assert [launches.joined(apart)[0] for _ in range(3)] == ["expand_direct"] * 3


def test_a_full_ring_leaves_the_jobs_to_copy_blocks_without_backing_off(monkeypatch):
    launches = Launches(monkeypatch)
    launches.backend._ring = numpy_ring(launches.backend, entries=2)  # no room for five blocks' table
    jobs = launches.jobs(Direction.STORE, [([5, 9, 2], [31, 3, 17]), ([40, 1], [30, 4])])
    assert launches.joined(jobs)[0] is None
    assert launches.prepared.join_backoff[Direction.STORE] == [0, 0], "the next launch is offered again"
