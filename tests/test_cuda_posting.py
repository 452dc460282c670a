"""The cuda backend's posted enqueues (`backends/cuda/posting.py`), without a GPU: a launch's
driver calls, made by the poster thread, are the calls the Python thread would have made, in
the same order; events wait for their tickets; a posted call's failure fails its launch's jobs.

The stand-in libcuda is `test_cuda_host.FakeLib`: C function pointers to Python callbacks,
which a C thread may call (ctypes takes the GIL for them)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_cuda_host import NAMES, WIDE, FakeCudaRuntime, LaunchingLib, host_only_backend

from offload_core import native
from offload_core.backend import Direction
from offload_core.backends.cuda import driver as drv
from offload_core.backends.cuda import kernels, posting

pytestmark = pytest.mark.skipif(
    native.load() is None or not hasattr(native.load(), "Poster"), reason="needs the compiled extension's Poster"
)

CONSTEXPRS = ("STORE", "SIMPLE", "BY_HOST", "D", "W")


class TritonLike:
    """A compiled kernel as Triton 3.6 describes itself (what `kernels._raw_launch` reads), whose
    own launcher logs the launch the way `LaunchingLib` logs ``cuLaunchKernel``."""

    launch_enter_hook = launch_exit_hook = None

    def __init__(self, lib, types=WIDE, hidden=2, **metadata):
        self.lib, self.function = lib, 0xF00
        signature = {**dict(zip(NAMES, types)), **{c: "constexpr" for c in CONSTEXPRS}}
        self.src = SimpleNamespace(fn=SimpleNamespace(arg_names=NAMES + CONSTEXPRS), signature=signature, constants={})
        scratch = {name: 0 for name in ("global_scratch_size", "profile_scratch_size")[:hidden]}
        self.metadata = SimpleNamespace(**{"num_warps": 4, "shared": 0, "num_ctas": 1, **scratch, **metadata})
        self.hidden = hidden

    def __getitem__(self, grid):
        def run(*args, stream=None):
            self.lib.calls.append(("launch", grid[0], 128, 0, stream, *args[: len(NAMES)], *[0] * self.hidden))

        return run


class EveryKey(dict):
    """A compiled-kernel cache that has `compiled` for every specialization."""

    def __init__(self, compiled):
        super().__init__()
        self.compiled = compiled

    def get(self, key, default=None):
        return self.compiled


def posted_backend(monkeypatch, lib, posted: bool):
    import torch

    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "posted:1" if posted else "posted:0")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())  # a GPU's torch too
    monkeypatch.setattr(kernels, "_fast", True)
    monkeypatch.setattr(kernels, "_compiled", EveryKey(TritonLike(lib, lib.types, lib.hidden)))
    monkeypatch.setattr(kernels, "_raw", {})
    monkeypatch.setattr(kernels, "_compile", lambda: (None, None, "expand"))
    backend = host_only_backend(monkeypatch, lib)
    assert (backend._poster is not None) == posted
    backend._ring = RingLike(backend, backend.driver.table_launch_in(backend._ctx))
    return backend


class RingLike:
    """The descriptor ring's contract (`ring.DescriptorRing`), uploading through the backend's
    table copy (posted on an adopted stream) from memory of its own; `reset` starts over, so
    that a launch made twice uploads from the same addresses."""

    def __init__(self, backend, launch=None):
        self.backend, self.host, self.at = backend, np.zeros(1 << 16, dtype=np.int64), 0
        self.base = 1 << 40
        self.launch = launch  # `upload_launch`'s compiled call, or None
        self.launched = []  # each `upload_launch`'s table, read back from host memory
        self.waits, self.wait_s = 0, 0.0  # never full

    @property
    def launches(self):
        return self.launch is not None

    def reset(self):
        self.at = 0

    def device_address(self):
        return self.base

    def upload(self, cols, stream, held, split=0, narrow=False):
        table = np.concatenate(cols).astype(np.int32 if narrow else np.int64)
        entries = -(-table.nbytes // 8)
        self.host[self.at : self.at + entries].view(np.uint8)[: table.nbytes] = table.view(np.uint8)
        dev, host = self.base + 8 * self.at, self.host.ctypes.data + 8 * self.at
        self.at += entries
        self.backend._table_copy(dev, host, table.nbytes, stream.cuda_stream)
        return [dev]

    def upload_launch(self, cols, stream, narrow, function, grid, threads, shared, params, held):
        entries = -(-len(cols) * len(cols[0]) * (4 if narrow else 8) // 8)
        dev, host = self.base + 8 * self.at, self.host.ctypes.data + 8 * self.at
        self.launch(
            host, dev, 8 * entries, cols, narrow, stream.cuda_stream, function, grid, threads, shared, (dev, *params)
        )
        words = self.host[self.at : self.at + entries]
        self.launched.append(words.view(np.int32)[: len(cols) * len(cols[0])] if narrow else words.copy())
        self.at += entries

    def open(self):
        return []

    def retire(self, event, regions=None):
        pass


class Stream:
    """A torch stream as the backend sees one: its handle, and ``wait_event`` as torch's does."""

    def __init__(self, handle):
        self.cuda_stream = handle

    def wait_event(self, event):
        event.wait(self)


ENQUEUES = ("wait", "record", "memcpy", "batch", "launch")  # what goes on a stream (queries and setup aside)


def comparable(calls):
    """The driver's calls that enqueue work, with a batch's argument arrays as lists."""
    return [tuple(x.tolist() if isinstance(x, np.ndarray) else x for x in c) for c in calls if c[0] in ENQUEUES]


class CompactLaunch:
    """One compact launch of 8 blocks through `CudaBackend.copy_blocks`, with the queue's events
    around it, on a backend with a poster (`run` makes it posted or not)."""

    def __init__(self, monkeypatch, lib, direction, mechanism, half_rows=3):
        from test_plan import Model

        from offload_core import DeviceBlocks, HostBlocks
        from offload_core.compact import CompactLayout
        from offload_core.plan import Planner

        handles = iter(range(0x100, 0x200))
        monkeypatch.setattr(FakeCudaRuntime, "ExternalStream", lambda self, handle, device=None: Stream(next(handles)))
        self.lib, backend = lib, posted_backend(monkeypatch, lib, True)
        self.backend, self.poster = backend, backend._poster
        backend.mechanism = mechanism
        model = Model([16, 8], [[(0, 16), (1, 8)]], 1, 32, 24)
        planner = Planner(model.geometry)
        planner.host_base = 0x7F00_0000_0000
        layout = CompactLayout(planner)
        backend._blocks.half_bytes = half_rows * layout.row_bytes
        backend._blocks.direct_ok = lambda prepared: True
        self.prepared = backend._blocks.prepare(layout)
        self.stream = backend.new_stream()
        self.job = layout.job(
            direction, DeviceBlocks([5, 9, 2, 30, 17, 11, 0, 22]), HostBlocks([3, 4, 5, 6, 7, 20, 21, 9])
        )
        self.compute = backend.new_event()
        self.start, self.end = backend.new_event(), backend.new_event()

    def run(self, posted: bool = True):
        """The launch; returns the mechanism used and the driver's calls (`comparable`) once
        every posted one was made."""
        b, lib = self.backend, self.lib
        b._poster = b.driver.poster = self.poster if posted else None
        b._ring.reset()
        for st in b._blocks.staging.values():
            st.next = 0
        self.compute.record(b.current_stream())
        lib.calls.clear()
        self.stream.wait_event(self.compute)
        self.start.record(self.stream)
        used = b.copy_blocks(self.job, self.prepared, self.stream, [self.compute])
        self.end.record(self.stream)
        self.poster.drain()
        return used, comparable(lib.calls)


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("mechanism, half_rows", [("expand_staged", 3), ("expand_staged", 64), ("expand_direct", 3)])
def test_posted_calls_are_the_calls_the_python_thread_would_make_in_its_order(
    monkeypatch, direction, mechanism, half_rows
):
    """Staged jobs cut into pieces (three rows a half) and whole, direct jobs: the same driver
    calls with the same arguments in the same order, kernel launches included. Unposted, each
    table's upload and its kernel's launch are one compiled call (`_native.table_launch`)."""
    launch = CompactLaunch(monkeypatch, LaunchingLib(), direction, mechanism, half_rows)
    launch.run()  # the first makes the staging
    before = launch.poster.state()["posted"]
    ring = launch.backend._ring
    used, posted = launch.run(posted=True)
    uploaded = ring.host[: ring.at].copy()
    state = launch.poster.state()
    assert launch.backend.posting_stats() == state
    ring.launched.clear()
    used_direct, direct = launch.run(posted=False)
    assert used == used_direct == mechanism
    assert posted == direct
    assert len(ring.launched) == sum(c[0] == "launch" for c in direct), "every table went up with its launch"
    assert (ring.host[: ring.at] == uploaded).all(), "the compiled call wrote the tables the posted uploads did"
    kinds = {c[0] for c in direct}
    assert {"launch", "memcpy", "record", "wait"} <= kinds and ("batch" in kinds) == (mechanism == "expand_staged")
    assert state["posted"] - before == len(direct) and state["issued"] == state["posted"]


def test_a_posted_events_ticket_decides_what_it_answers(monkeypatch):
    """Until the poster made its record, an event has not passed, and waiting for it waits for
    the record first; a direct record of an event that a posted wait reads waits for that wait."""
    lib = LaunchingLib()
    backend = posted_backend(monkeypatch, lib, True)
    poster = backend._poster
    stream = backend.new_stream()
    poster.adopt(stream)
    hold, holding = threading.Event(), threading.Event()
    blocker = drv.EVENT_CALL(lambda _: holding.set() or hold.wait(10) and 0)
    poster.call(posting.CALL, stream.cuda_stream, drv.Driver.address(blocker), 0)
    assert holding.wait(10)
    event = backend.new_event()
    event.record(stream)
    assert not event.query(), "a record still in the FIFO has not passed"
    assert not [c for c in lib.calls if c[0] in ("record", "query")]
    done = []
    waiter = threading.Thread(target=lambda: (event.synchronize(), done.append(1)))
    waiter.start()
    waiter.join(0.2)
    assert not done, "synchronize returned before the record was made"
    hold.set()
    waiter.join(10)
    assert done and [c[0] for c in lib.calls if c[0] in ("record", "synchronize")] == ["record", "synchronize"]
    assert event.query()

    # A posted wait reads `ready`; recording it again on the caller's stream, as a submit does,
    # neither waits for the poster nor moves what that wait sees: it takes a new handle.
    hold.clear(), holding.clear()
    poster.call(posting.CALL, stream.cuda_stream, drv.Driver.address(blocker), 0)
    assert holding.wait(10)
    ready = backend.new_event()
    ready.wait(stream)
    old = ready.handle
    lib.calls.clear()
    ready.record(backend.current_stream())  # would hang here if it waited: the poster is held
    assert ready.handle != old and [c for c in lib.calls if c[0] == "record"] == [("record", ready.handle, 0x5)]
    hold.set()
    poster.drain()
    later = [c for c in lib.calls if c[0] in ("wait", "destroy")]
    assert later == [("wait", stream.cuda_stream, old, 0), ("destroy", old)]


def test_a_failed_posted_call_fails_its_launch_and_no_other(monkeypatch):
    """A batch the driver refuses on the poster thread: the launch's end event says so through
    `elapsed_time` (what the queue asks for each launch's result); the next launch is fine."""
    lib = LaunchingLib()
    launch = CompactLaunch(monkeypatch, lib, Direction.STORE, "expand_staged", 64)
    lib.fail_at = 0
    _, calls = launch.run()
    assert [c[0] for c in calls].count("batch") == 1
    failed = (launch.start, launch.end)
    for _ in range(2):  # asked again: still failed
        with pytest.raises(drv.CudaDriverError, match="cuMemcpyBatchAsync failed on the posting thread"):
            failed[0].elapsed_time(failed[1])
    lib.fail_at = None
    launch.start, launch.end = launch.backend.new_event(), launch.backend.new_event()
    launch.run()
    assert launch.start.elapsed_time(launch.end) == 1.5


def test_a_failed_kernel_launch_on_the_side_stream_fails_the_launch(monkeypatch):
    """A store's kernel runs on the staging side stream: its failure attaches to the side
    stream's next record, which lies between the launch's two events."""
    lib = LaunchingLib()
    launch = CompactLaunch(monkeypatch, lib, Direction.STORE, "expand_staged", 64)
    lib.codes["launch"] = [719]  # CUDA_ERROR_LAUNCH_FAILED
    _, calls = launch.run()
    assert "launch" in [c[0] for c in calls]
    with pytest.raises(drv.CudaDriverError, match="cuLaunchKernel failed on the posting thread"):
        launch.start.elapsed_time(launch.end)


def test_a_queue_reports_a_failed_posted_launch_as_failed_jobs_and_goes_on(monkeypatch):
    """End to end through `TransferQueue`: the failed launch's jobs fail, the next jobs succeed,
    in order, and the caller's loop never sees an exception."""
    from test_plan import Model

    from offload_core import DeviceBlocks, HostBlocks
    from offload_core.compact import CompactLayout
    from offload_core.plan import Planner
    from offload_core.queue import TransferQueue

    handles = iter(range(0x100, 0x200))
    monkeypatch.setattr(FakeCudaRuntime, "ExternalStream", lambda self, handle, device=None: Stream(next(handles)))
    lib = LaunchingLib()
    backend = posted_backend(monkeypatch, lib, True)
    model = Model([16], [[(0, 16)]], 1, 32, 24)
    planner = Planner(model.geometry)
    planner.host_base = 0x7F00_0000_0000
    layout = CompactLayout(planner)
    backend.mechanism = "expand_staged"
    prepared = backend._blocks.prepare(layout)
    queue = TransferQueue(backend, Direction.STORE)
    lib.fail_at = 0
    queue.submit(1, layout.job(Direction.STORE, DeviceBlocks([1, 2]), HostBlocks([3, 4])), prepared=prepared)
    queue.finish()
    lib.fail_at = None
    queue.submit(2, layout.job(Direction.STORE, DeviceBlocks([5, 6]), HostBlocks([7, 8])), prepared=prepared)
    results = queue.close()
    assert [(r.job_id, r.success) for r in results] == [(1, False), (2, True)]


def held_poster(monkeypatch):
    """A posting backend, a stream it adopted, and its poster thread held inside a call until
    ``hold`` is set (``blocker``, the C callback, must live as long)."""
    lib = LaunchingLib()
    backend = posted_backend(monkeypatch, lib, True)
    stream = backend.new_stream()
    backend._poster.adopt(stream)
    hold = threading.Event()
    blocker = drv.EVENT_CALL(lambda _: hold.wait(10) and 0)
    backend._poster.call(posting.CALL, stream.cuda_stream, drv.Driver.address(blocker), 0)
    return SimpleNamespace(lib=lib, backend=backend, stream=stream, hold=hold, blocker=blocker)


def test_an_unpostable_enqueue_on_an_adopted_stream_comes_after_the_posted_calls(monkeypatch):
    """`enqueue_with` (another mechanism's copies) on a stream with posted calls waits until they
    were made: its copies follow them on the stream."""
    held = held_poster(monkeypatch)
    lib, backend, stream, hold = held.lib, held.backend, held.stream, held.hold
    marker = backend.new_event()
    marker.record(stream)
    threading.Timer(0.2, hold.set).start()
    src = np.arange(4, dtype=np.int64) * 64 + (1 << 30)
    backend.enqueue_with("ce_loop", src, src + (1 << 32), np.full(4, 64, dtype=np.int64), Direction.LOAD, stream)
    order = [c[0] for c in lib.calls if c[0] in ("record", "memcpy")]
    assert order[0] == "record" and order[1:5] == ["memcpy"] * 4


def test_raw_launches_pass_the_parameters_triton_compiled_and_refuse_what_they_cannot(monkeypatch):
    """`kernels._raw_launch`: constexprs left out, 32-bit parameters read as such, null scratch
    pointers after them; hooks, scratch memory, clusters and large shared memory go through
    Triton's own launcher."""
    types = ("i64", "i32", "i64", "i32", "i64", "i32", "i32", "i64", "i64")
    lib = LaunchingLib(types=types, hidden=1)
    compiled = TritonLike(lib, types, hidden=1)
    raw = kernels._raw_launch(compiled)
    assert raw == (0xF00, 128, 0, tuple(range(len(NAMES))), 1)
    for change in (
        {"global_scratch_size": 256},
        {"shared": 64 << 10},
        {"num_ctas": 2},
        {"cluster_dims": (2, 1, 1)},
        {"launch_pdl": True},
    ):
        assert kernels._raw_launch(TritonLike(lib, types, hidden=1, **change)) is None, change
    hooked = TritonLike(lib, types, hidden=1)
    hooked.launch_enter_hook = print
    assert kernels._raw_launch(hooked) is None
    odd = TritonLike(lib, ("fp32",) + types[1:], hidden=1)
    assert kernels._raw_launch(odd) is None
    # Triton 3.5 on: hooks are chains in triton.knobs.runtime, set once any hook is added
    chains = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=None)
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(knobs=SimpleNamespace(runtime=chains)))
    assert kernels._raw_launch(TritonLike(lib, types, hidden=1)) is not None
    chains.launch_enter_hook.calls.append(print)
    assert kernels._raw_launch(TritonLike(lib, types, hidden=1)) is None
    monkeypatch.delitem(sys.modules, "triton")

    backend = posted_backend(monkeypatch, lib, True)
    monkeypatch.setattr(kernels, "_compiled", EveryKey(compiled))
    stream = backend.new_stream()
    backend._poster.adopt(stream)
    lib.calls.clear()
    args = [1 << 40, 7, 1 << 41, 3, 1 << 42, 1, 2, -5, 96]
    kernels._launch("expand", 9, args, dict.fromkeys(CONSTEXPRS, 1), stream, backend._poster)
    backend._poster.drain()
    want = [a if t == "i32" else a % (1 << 64) for a, t in zip(args, types)]
    assert comparable(lib.calls) == [("launch", 9, 128, 0, stream.cuda_stream, *want, 0)]


def test_posting_is_off_unless_the_environment_asks_and_a_bad_value_is_named(monkeypatch):
    from offload_core.errors import ConfigError

    monkeypatch.delenv("OFFLOAD_CORE_CUDA_CONF", raising=False)
    assert posting.make(drv.Driver(LaunchingLib()), 0xC0) is None
    assert host_only_backend(monkeypatch, LaunchingLib()).posting_stats() is None
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "posted:0")
    assert posting.make(drv.Driver(LaunchingLib()), 0xC0) is None
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "posted:1")
    assert posting.make(drv.Driver(LaunchingLib()), 0xC0) is not None
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "posted:yes")
    with pytest.raises(ConfigError, match="OFFLOAD_CORE_CUDA_CONF posted must be 0 .* or 1, got 'yes'"):
        posting.make(drv.Driver(LaunchingLib()), 0xC0)


def test_an_event_collected_with_posted_calls_pending_is_destroyed_after_them(monkeypatch):
    import gc

    held = held_poster(monkeypatch)
    lib, backend, stream, hold = held.lib, held.backend, held.stream, held.hold
    event = backend.new_event()
    handle = event.handle
    event.record(stream)
    del event
    gc.collect()
    hold.set()
    backend._poster.drain()
    order = [c for c in lib.calls if c[0] in ("record", "destroy") and c[1] == handle]
    assert [c[0] for c in order] == ["record", "destroy"]


@pytest.mark.parametrize("mechanism", ["sm_gather", "ce_loop"])
def test_a_batch_mechanism_on_an_adopted_stream_makes_all_its_calls_itself_in_order(monkeypatch, mechanism):
    """`sm_gather` uploads its table through the driver and launches through Triton: on a stream
    with posted calls, both go after them and neither through the poster, so the kernel never
    reaches the stream before its table."""
    lib = LaunchingLib()
    backend = posted_backend(monkeypatch, lib, True)
    monkeypatch.setattr(backend, "addressable", lambda *args, **kwargs: True)
    stream = Stream(0x300)
    backend._poster.adopt(stream)
    marker = backend.new_event()
    marker.record(stream)  # posted
    before = backend._poster.posted
    src = np.arange(4, dtype=np.int64) * 64 + (1 << 30)
    sizes = np.full(4, 64, dtype=np.int64)
    backend.enqueue_with(mechanism, src, src + (1 << 32), sizes, Direction.LOAD, stream)
    order = [c[0] for c in comparable(lib.calls)]
    want = ["memcpy", "launch"] if mechanism == "sm_gather" else ["memcpy"] * 4
    assert order == ["record", *want, "record"]  # the posted marker, the copies, the keepalive record
    assert backend._poster.posted == before and backend._poster.owns(stream.cuda_stream)


def test_a_failure_beyond_what_the_log_keeps_still_fails_its_launch(monkeypatch):
    """The log keeps the newest failures; a launch whose failure was dropped to make room (other
    launches failing before it was asked about) still fails."""
    lib = LaunchingLib()
    backend = posted_backend(monkeypatch, lib, True)
    poster = backend._poster
    stream, other = Stream(0x300), Stream(0x301)
    poster.adopt(stream), poster.adopt(other)
    start, end = backend.new_event(), backend.new_event()
    start.record(stream)
    lib.codes["wait"] = [1]
    backend.new_event().wait(stream)  # fails on the poster thread
    end.record(stream)
    lib.codes["record"] = [1] * 100  # then a hundred failed records elsewhere
    for event in [backend.new_event() for _ in range(100)]:
        event.record(other)
    poster.drain()
    with pytest.raises(drv.CudaDriverError, match="dropped from the log"):
        start.elapsed_time(end)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_closes_its_copy_of_a_poster_without_touching_the_parents_thread(monkeypatch):
    lib = LaunchingLib()
    backend = posted_backend(monkeypatch, lib, True)
    stream = Stream(0x300)
    backend._poster.adopt(stream)
    backend.new_event().record(stream)  # the thread runs
    backend._poster.drain()
    pid = os.fork()
    if pid == 0:  # the child: nothing posted, nothing waited for, closed and gone
        code = 1
        try:
            poster = backend._poster
            ok = not poster.owns(stream.cuda_stream) and poster.failure(0, 1 << 62) is None
            ok = ok and backend.posting_stats() is None
            poster.wait(1 << 62)
            poster.close()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the child hung on its copy of the poster")
