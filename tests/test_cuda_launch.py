"""The kernels' launches without a GPU: Triton's compiled kernels found again by their
specializations (`kernels._launch`), what `kernels._raw_launch` reads from a Triton-compiled
kernel, a compact launch whose tables go up with their kernels in one compiled call
(`_driver.table_launch`) making the calls that uploads and Triton's own launcher make, and the
descriptor ring those tables go through, which never reuses memory a pending job reads.

Also the stand-ins the other cuda tests share: Triton's compiled kernel (`TritonLike`), a backend
that finds it built for every launch (`compiled_backend`), a stream and the driver's enqueueing
calls (`comparable`). The stand-in libcuda is `cuda_fakes.LaunchingLib`."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cuda_fakes import NAMES, WIDE, FakeCudaRuntime, LaunchingLib, compiled_table_launch, host_only_backend, read_array
from helpers import compiled_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_core.backend import Direction
from offload_core.backends.cuda import driver as drv
from offload_core.backends.cuda import kernels
from offload_core.backends.cuda.ring import DescriptorRing

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


def compiled_backend(monkeypatch, lib):
    """A backend over `lib` whose expansion kernel is found compiled (`TritonLike`) for every
    launch, with `RingLike` for its descriptor ring."""
    import torch

    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())  # a GPU's torch too
    monkeypatch.setattr(kernels, "_fast", True)
    monkeypatch.setattr(kernels, "_compiled", EveryKey(TritonLike(lib, lib.types, lib.hidden)))
    monkeypatch.setattr(kernels, "_raw", {})
    monkeypatch.setattr(kernels, "_compile", lambda: "expand")
    backend = host_only_backend(monkeypatch, lib)
    backend._ring = RingLike(backend, backend.driver.table_launch_in(backend._ctx))
    return backend


class RingLike:
    """The descriptor ring's contract (`ring.DescriptorRing`), uploading through the backend's
    table copy from memory of its own; `reset` starts over, so that a launch made twice uploads
    from the same addresses."""

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

    def upload(self, cols, stream, held, narrow=False):
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
    around it (`run` sends its tables up with their kernels in one compiled call or not)."""

    def __init__(self, monkeypatch, lib, direction, mechanism, half_rows=3):
        from helpers import Model

        from offload_core import DeviceBlocks, HostBlocks

        handles = iter(range(0x100, 0x200))
        monkeypatch.setattr(FakeCudaRuntime, "ExternalStream", lambda self, handle, device=None: Stream(next(handles)))
        self.lib, backend = lib, compiled_backend(monkeypatch, lib)
        self.backend, self.table_launch = backend, backend._ring.launch
        backend.mechanism = mechanism
        model = Model([16, 8], [[(0, 16), (1, 8)]], 1, 32, 24)
        layout = model.layout(host_base=0x7F00_0000_0000)  # where pinned host memory lies
        backend._blocks.half_bytes = half_rows * layout.row_bytes
        backend._blocks.direct_ok = lambda prepared: True
        self.prepared = backend._blocks.prepare(layout)
        self.stream = backend.new_stream()
        self.job = layout.job(
            direction, DeviceBlocks([5, 9, 2, 30, 17, 11, 0, 22]), HostBlocks([3, 4, 5, 6, 7, 20, 21, 9])
        )
        self.compute = backend.new_event()
        self.start, self.end = backend.new_event(), backend.new_event()

    def run(self, compiled: bool = True):
        """The launch; returns the mechanism used and the driver's calls (`comparable`)."""
        b, lib = self.backend, self.lib
        b._ring.launch = self.table_launch if compiled else None
        b._ring.reset()
        b._ring.launched.clear()
        for halves in b._blocks.staging.values():
            halves.next = 0
        self.compute.record(b.current_stream())
        lib.calls.clear()
        self.stream.wait_event(self.compute)
        self.start.record(self.stream)
        used = b.copy_blocks(self.job, self.prepared, self.stream, [self.compute])
        self.end.record(self.stream)
        return used, comparable(lib.calls)


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("mechanism, half_rows", [("expand_staged", 3), ("expand_staged", 64), ("expand_direct", 3)])
def test_a_compact_launchs_compiled_calls_are_the_uploads_and_launches_they_replace(
    monkeypatch, direction, mechanism, half_rows
):
    """Staged jobs cut into pieces (three rows a half) and whole, direct jobs: each table's upload
    and its kernel's launch are one compiled call (`_driver.table_launch`), which makes the driver
    calls that an upload and Triton's own launcher make, with the same arguments in the same
    order, and writes the same tables."""
    compiled_or_skip(True, drv.COMPILED)
    launch = CompactLaunch(monkeypatch, LaunchingLib(), direction, mechanism, half_rows)
    launch.run()  # the first makes the staging
    ring = launch.backend._ring
    used, together = launch.run(compiled=True)
    assert len(ring.launched) == sum(c[0] == "launch" for c in together) > 0, "every table went up with its launch"
    tables = ring.host[: ring.at].copy()
    used_apart, apart = launch.run(compiled=False)
    assert ring.launched == []
    assert used == used_apart == mechanism
    assert together == apart
    assert (ring.host[: ring.at] == tables).all(), "the compiled call wrote the tables the uploads did"
    kinds = {c[0] for c in together}
    assert {"launch", "memcpy", "record", "wait"} <= kinds and ("batch" in kinds) == (mechanism == "expand_staged")


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


def test_an_expansion_launched_by_hand_passes_its_parameters_as_triton_compiled_them(monkeypatch):
    """`kernels._raw_expansion` through the compiled table launch: the table's address first, the
    other arguments as the kernel reads them (32-bit ones as such), a null scratch pointer last."""
    types = ("i64", "i32", "i64", "i32", "i64", "i32", "i32", "i64", "i64")
    lib, table_launch = compiled_table_launch(LaunchingLib(types=types, hidden=1))
    monkeypatch.setattr(kernels, "_compile", lambda: "expand")
    monkeypatch.setattr(kernels, "_compiled", EveryKey(TritonLike(lib, types, hidden=1)))
    monkeypatch.setattr(kernels, "_raw", {})
    args = [1 << 40, 7, 1 << 41, 3, 1 << 42, 1, 2, -5, 96]
    function, grid, threads, shared, params = kernels._raw_expansion(9, args, dict.fromkeys(CONSTEXPRS, 1), 4, 0)
    host = np.zeros(4, dtype=np.int64)
    lib.calls.clear()
    cols = (np.arange(2), np.arange(2))
    table_launch(host.ctypes.data, args[0], 32, cols, False, 0x77, function, grid, threads, shared, (args[0], *params))
    want = [a if t == "i32" else a % (1 << 64) for a, t in zip(args, types)]
    assert comparable(lib.calls)[-1] == ("launch", 9, 128, 0, 0x77, *want, 0)


# ---- Triton launches and the descriptor ring ----------------------------------------------------


def test_triton_specialization_key_separates_what_triton_specializes_on():
    spec = kernels._spec
    assert spec(1) != spec(17) and spec(16) != spec(17) and spec(32) == spec(48)
    assert spec(1 << 31) != spec((1 << 31) - 16)  # 32 vs 64 bits
    assert spec(1 << 63) != spec((1 << 63) - 16)  # unsigned


class FakeCompiled:
    """Triton's compiled kernel as `kernels._launch` uses it: ``compiled[grid](*args, stream=)``."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            if self.fail:
                raise TypeError("launcher of another Triton")
            self.calls.append((grid, args, stream))

        return runner


class FakeKernel:
    """A JIT kernel: ``kernel[grid](*args, **constexprs)`` launches and returns the compiled kernel."""

    def __init__(self, compiled):
        self.calls, self.compiled = [], compiled

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.calls.append((grid, args, constexprs))
            return self.compiled

        return launch


@pytest.fixture
def launch_cache(monkeypatch):
    """An empty compiled-kernel cache, and torch's stream context as a no-op (no GPU here)."""
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_fast", True)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def test_kernels_launch_through_the_compiled_kernel_once_a_specialization_was_seen(launch_cache):
    compiled = FakeCompiled()
    kernel = FakeKernel(compiled)
    stream = SimpleNamespace(cuda_stream=0xABC)
    consts = {"ARRAY": True, "D": 128}
    kernels._launch(kernel, 5, [1, 32, 1 << 40], consts, stream)
    assert kernel.calls == [((5,), (1, 32, 1 << 40), {**consts, "num_warps": 4})] and compiled.calls == []
    kernels._launch(kernel, 7, [1, 48, (1 << 40) + 16], consts, stream)  # same specialization
    assert compiled.calls == [((7, 1, 1), (1, 48, (1 << 40) + 16, True, 128), 0xABC)]
    kernels._launch(kernel, 7, [2, 48, (1 << 40) + 16], consts, stream)  # 1 was a constant to Triton
    kernels._launch(kernel, 7, [1, 40, (1 << 40) + 16], consts, stream)  # 40 is not a multiple of 16
    kernels._launch(kernel, 7, [1, 48, (1 << 40) + 8], consts, stream)
    assert len(kernel.calls) == 4 and len(compiled.calls) == 1
    kernels._launch(kernel, 7, [1, 48, (1 << 40) + 16], consts, stream, device=1)  # another GPU: its own build
    assert len(kernel.calls) == 5 and len(compiled.calls) == 1
    kernels._launch(kernel, 7, [1, 48, (1 << 40) + 16], consts, stream, warps=8)  # other warps: another build
    assert kernel.calls[-1][2]["num_warps"] == 8 and len(kernel.calls) == 6 and len(compiled.calls) == 1


def test_kernels_launch_falls_back_to_triton_dispatch_when_its_launcher_differs(launch_cache):
    kernel = FakeKernel(FakeCompiled(fail=True))
    for _ in range(3):
        kernels._launch(kernel, 4, [64], {"W": 32}, SimpleNamespace(cuda_stream=1))
    assert len(kernel.calls) == 3 and kernels._fast is False


class FakeEvent:
    def __init__(self):
        self.done, self.waited = False, 0

    def query(self):
        return self.done

    def synchronize(self):  # the host waits until the work before it has run
        self.waited += 1
        self.done = True


def fake_ring(entries, **kwargs):
    """A `DescriptorRing` whose "device" memory is a CPU tensor and whose copies are immediate;
    its copies are listed in `ring.copies`."""
    copies = []

    def memcpy(dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        copies.append((dst, nbytes, stream))

    fake_torch = SimpleNamespace(
        int64=torch.int64, empty=lambda n, dtype, pin_memory=False, device=None: torch.empty(n, dtype=dtype)
    )
    ring = DescriptorRing(fake_torch, None, memcpy, entries=entries, **kwargs)
    ring.copies = copies
    return ring


def _upload(ring, columns, stream, **kwargs):
    """`DescriptorRing.upload`, and what it put in `held` (one-off memory, else empty)."""
    held: list = []
    tables = ring.upload(columns, stream, held, **kwargs)
    (keep,) = held
    return tables, keep


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 3), st.booleans(), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_descriptor_ring_never_reuses_memory_a_pending_job_reads(jobs):
    """Tables of int64 and of int32 (`narrow`, an odd count of them taking half an entry) side
    by side: each reads back as it went up while its job is pending (a full ring waits for the
    oldest jobs, which are then done)."""
    ring = fake_ring(512)
    stream = SimpleNamespace(cuda_stream=7)
    pending = []  # (event, [(device address, expected values, width)])
    for j, (n, k, narrow, finish_oldest) in enumerate(jobs):
        columns = [np.arange(n, dtype=np.int64) + 1000 * (j * 4 + c) for c in range(k)]
        regions = ring.open()
        (table,), keep = _upload(ring, columns, stream, narrow=narrow)
        width = 4 if narrow else 8
        expect = [(table + width * c * n, col, width) for c, col in enumerate(columns)]
        event = FakeEvent()
        ring.retire(event, regions)
        pending = [p for p in pending if not p[0].done] + [(event, expect, keep)]
        for _, exp, _ in pending:  # every pending job's tables still hold its descriptors
            for address, values, w in exp:
                assert (read_array(address, len(values), ctypes.c_int32 if w == 4 else ctypes.c_int64) == values).all()
        if finish_oldest:
            pending.pop(0)[0].done = True
    assert all(stream == 7 for _, _, stream in ring.copies)


def test_a_full_descriptor_ring_waits_for_its_oldest_job_and_falls_back_only_without_one():
    """No room beside a pending table: the upload waits for the oldest job (counted), then
    reuses its memory. One-off memory only for a table larger than the ring, or where the room
    would have to come from the enqueue under way (its regions not retired yet)."""
    ring = fake_ring(100)
    stream = SimpleNamespace(cuda_stream=1)
    regions = ring.open()
    (first,), keep = _upload(ring, [np.arange(60)], stream)
    assert keep == [] and (ring.waits, ring.wait_s) == (0, 0.0)
    busy = FakeEvent()
    ring.retire(busy, regions)
    regions = ring.open()
    (second,), keep = _upload(ring, [np.arange(60)], stream)
    assert keep == [] and second == first and busy.waited == 1  # waited for the first job, then took its memory
    assert ring.waits == 1 and ring.wait_s >= 0
    (third,), keep = _upload(ring, [np.arange(60)], stream)  # the second is not retired: this enqueue's own
    assert keep != [] and ring.waits == 1
    (big,), keep = _upload(ring, [np.arange(101)], stream)
    assert keep != [] and ring.waits == 1  # larger than the ring: never waits
    ring.retire(FakeEvent(), regions)
    (fourth,), keep = _upload(ring, [np.arange(30)], stream)
    assert keep == [] and ring.waits == 1  # room beside the pending one: no wait


def test_an_enqueues_ring_regions_take_its_own_event_only():
    """Regions an enqueue reserved are retired with its event, not with the event of another
    enqueue whose retire comes first (a Ctrl-C cut the other's short)."""
    ring = fake_ring(100)
    stream = SimpleNamespace(cuda_stream=1)
    first = ring.open()
    _upload(ring, [np.arange(10)], stream)
    second = ring.open()
    _upload(ring, [np.arange(10)], stream)
    event = FakeEvent()
    ring.retire(event, second)
    assert [r[2] for r in first] == [None] and [r[2] for r in second] == [event]


@pytest.mark.parametrize("compiled_launch", [True, False], ids=["compiled", "triton's launcher"])
def test_one_off_table_memory_is_held_when_the_launch_fails(monkeypatch, compiled_launch):
    """A ring full of pending tables gives a table one-off memory; a launch that fails after its
    upload was enqueued still leaves that memory to `held`, which outlives the copies."""

    def failing_launch(*args, **kwargs):
        raise drv.CudaDriverError("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED", 719)

    ring = fake_ring(4, launch=failing_launch if compiled_launch else None)
    monkeypatch.setattr(ring, "device_address", lambda: 1 << 40)
    monkeypatch.setattr(kernels, "_compile", lambda: "expand")
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_launch", failing_launch)
    if compiled_launch:  # a build found: the compiled call is taken
        monkeypatch.setattr(kernels, "_compiled", EveryKey(TritonLike(LaunchingLib())))
        monkeypatch.setattr(kernels, "_raw", {})
    held: list = []
    cols = (np.arange(8), np.arange(8))  # 16 entries: more than the ring holds
    with pytest.raises(drv.CudaDriverError, match="cuLaunchKernel failed"):
        stream = SimpleNamespace(cuda_stream=7)
        kernels.expand(
            ring, cols, 8, 1 << 41, 8, 1 << 42, 1, 8, True, 1024, stream, 4, (1 << 43, 64, True), False, held
        )
    assert len(held) == 1 and len(held[0]) == 2, "the one-off host and device memory stay held"
