"""The cuda backend's host side, without a GPU: driver ABI, batching, selection, fallbacks."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from offload_core.backend import Direction
from offload_core.backends.cuda import BLOCK_MECHANISMS, MECHANISMS, kernels, staging
from offload_core.backends.cuda import blocks as cuda_blocks
from offload_core.backends.cuda import driver as drv
from offload_core.backends.cuda.events import DriverEvent, RawStream
from offload_core.backends.cuda.select import CostModel, piece_bounds, profile_path
from offload_core.backends.cuda.staging import Held


@pytest.fixture(autouse=True)
def _no_cuda_settings(monkeypatch):
    """Each test starts from the defaults, whatever the shell that runs it has set."""
    for name in [n for n in os.environ if n.startswith("OFFLOAD_CORE_CUDA_")]:
        monkeypatch.delenv(name)


def test_memcpy_attributes_has_the_driver_layout():
    assert ctypes.sizeof(drv.CUmemcpyAttributes) == 24
    assert drv.CUmemcpyAttributes.srcLocHint.offset == 4
    assert drv.CUmemcpyAttributes.dstLocHint.offset == 12
    assert drv.CUmemcpyAttributes.flags.offset == 20


GPU_CONTEXT = 0xC0  # the backend's CUcontext in the fake driver
ERROR_NAME = b"CUDA_ERROR_INVALID_VALUE"  # lives as long as the module: the driver reads it after the call


class FakeLib:
    """A libcuda stand-in whose entry points are Python callbacks behind real C function pointers.

    `contexts` is the calling thread's context stack (top last): the creating thread starts with
    the GPU's context current, any other thread (a queue's launcher thread) with none."""

    @property
    def contexts(self) -> list:
        me = threading.get_ident()  # not a threading.local: each callback from a C thread is a new thread state
        if me not in self._stacks:
            self._stacks[me] = [GPU_CONTEXT] if me == self._creator else []
        return self._stacks[me]

    def __init__(self, with_batch=True, fail_at=None):
        self.calls = []
        self.fail_at = fail_at
        self._keep = {}

        def batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
            d = np.ctypeslib.as_array(ctypes.cast(dsts, ctypes.POINTER(ctypes.c_int64)), (count,)).copy()
            s = np.ctypeslib.as_array(ctypes.cast(srcs, ctypes.POINTER(ctypes.c_int64)), (count,)).copy()
            n = np.ctypeslib.as_array(ctypes.cast(sizes, ctypes.POINTER(ctypes.c_int64)), (count,)).copy()
            self.calls.append(("batch", d, s, n, attrs.contents.srcAccessOrder, attr_idxs[0], num_attrs, stream))
            if not self.contexts:  # the H200's driver: INVALID_VALUE, on a thread with no context current
                return 1
            if self.fail_at is not None and self.fail_at < count:
                fail_idx[0] = self.fail_at
                return 1  # CUDA_ERROR_INVALID_VALUE
            return 0

        def memcpy(dst, src, size, stream):
            self.calls.append(("memcpy", dst, src, size, stream))
            return returns("memcpy") if self.contexts else 201  # CUDA_ERROR_INVALID_CONTEXT

        def stream_create(handle, flags):
            self.calls.append(("stream_create", flags))
            handle[0] = 0xBEEF
            return 0

        self.codes = {}  # entry point -> codes it returns next (then 0)

        def returns(name):
            queued = self.codes.get(name)
            return queued.pop(0) if queued else 0

        def event_create(handle, flags):
            self.calls.append(("event_create", flags))
            self._events += 1  # unique, even once the calls were cleared
            handle[0] = 0xE0 + self._events
            return returns("create")

        def event_record(event, stream):
            self.calls.append(("record", event, stream))
            return returns("record")

        def stream_wait_event(stream, event, flags):
            self.calls.append(("wait", stream, event, flags))
            return returns("wait")

        def event_call(name):
            def call(event):
                self.calls.append((name, event))
                return returns(name)

            return call

        def elapsed(ms, start, end):
            self.calls.append(("elapsed", start, end))
            ctypes.c_float.from_address(ms).value = 1.5
            return returns("elapsed")

        self._keep["cuEventCreate"] = drv.EVENT_CREATE(event_create)
        self._keep["cuEventRecord"] = drv.EVENT_RECORD(event_record)
        self._keep["cuStreamWaitEvent"] = drv.STREAM_WAIT_EVENT(stream_wait_event)
        for name in ("query", "synchronize", "destroy"):
            self._keep[f"cuEvent{name.capitalize()}"] = drv.EVENT_CALL(event_call(name))
        self._keep["cuEventElapsedTime"] = drv.EVENT_ELAPSED_TIME(elapsed)
        self._events = 0
        self._stacks: dict = {}  # each thread's context stack, as the driver keeps them
        self._creator = threading.get_ident()

        def ctx_get(out):
            out[0] = self.contexts[-1] if self.contexts else None
            return 0

        def ctx_push(ctx):
            self.calls.append(("push", ctx))
            self.contexts.append(ctx)
            return 0

        def ctx_pop(out):
            self.calls.append(("pop",))
            out[0] = self.contexts.pop()
            return 0

        self._keep["cuCtxGetCurrent"] = drv.CTX_OUT(ctx_get)
        self._keep["cuCtxPushCurrent"] = drv.CTX_IN(ctx_push)
        self._keep["cuCtxPopCurrent"] = drv.CTX_OUT(ctx_pop)
        if with_batch:
            self._keep["cuMemcpyBatchAsync"] = drv.MEMCPY_BATCH(batch)
        self._keep["cuStreamCreate"] = drv.STREAM_CREATE(stream_create)
        self._keep["cuMemcpyAsync"] = drv.MEMCPY(memcpy)

        def get_proc(symbol, pfn, version, flags, status):
            fn = self._keep.get(symbol.decode())
            if fn is None:
                return 500  # CUDA_ERROR_NOT_FOUND
            pfn[0] = ctypes.cast(fn, ctypes.c_void_p).value
            return 0

        def error_name(code, out):
            out[0] = ERROR_NAME
            return 0

        self.cuGetProcAddress_v2 = drv.GET_PROC_ADDRESS(get_proc)
        self.cuGetErrorName = drv.GET_ERROR_NAME(error_name)

    def runtime_call(self) -> None:
        """What a call of the CUDA runtime does first on a thread: make the device's primary
        context current there, if none is."""
        if not self.contexts:
            self.contexts.append(GPU_CONTEXT)


NAMES = ("blocks", "n", "entries", "num_entries", "groups", "num_groups", "per_block", "row_base", "row_step")
WIDE = ("i64",) * len(NAMES)  # every parameter 64 bits


class LaunchingLib(FakeLib):
    """`FakeLib` with ``cuLaunchKernel``: a launch is logged as ``("launch", grid, threads,
    shared, stream, *params)``, each parameter read as the kernel would (`types`)."""

    def __init__(self, types=WIDE, hidden=2, **kwargs):
        super().__init__(**kwargs)
        self.types, self.hidden = list(types), hidden
        self.codes.setdefault("launch", [])

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            kinds = self.types + ["*i8"] * self.hidden
            values = [
                (ctypes.c_int32 if k == "i32" else ctypes.c_uint64).from_address(slots[i]).value
                for i, k in enumerate(kinds)
            ]
            self.calls.append(("launch", gx, bx, shared, stream, *values))
            queued = self.codes.get("launch")
            return queued.pop(0) if queued else 0

        self._keep["cuLaunchKernel"] = drv.LAUNCH_KERNEL(launch)


def arrays(n):
    return np.arange(n, dtype=np.int64) * 10 + 1000, np.arange(n, dtype=np.int64) * 10 + 5000, np.full(n, 8, np.int64)


def test_batch_passes_destinations_first_and_one_attribute_set():
    lib = FakeLib()
    driver = drv.Driver(lib)
    dst, src, sizes = arrays(5)
    driver.memcpy_batch_async(dst, src, sizes, drv.SRC_ACCESS_ORDER_ANY, stream=0x1234)
    (call,) = lib.calls
    _, d, s, n, order, first_idx, num_attrs, stream = call
    assert d.tolist() == dst.tolist() and s.tolist() == src.tolist() and n.tolist() == sizes.tolist()
    assert (order, first_idx, num_attrs, stream) == (3, 0, 1, 0x1234)


def test_batch_is_split_and_a_failure_names_its_global_index():
    lib = FakeLib()
    driver = drv.Driver(lib)
    dst, src, sizes = arrays(10)
    driver.memcpy_batch_async(dst, src, sizes, drv.SRC_ACCESS_ORDER_STREAM, stream=1, max_batch=4)
    assert [len(c[1]) for c in lib.calls] == [4, 4, 2]
    assert lib.calls[1][1][0] == dst[4]
    lib.calls.clear()
    lib.fail_at = 1  # the second copy of each call fails
    with pytest.raises(drv.CudaDriverError, match="at index 1 of 10: CUDA_ERROR_INVALID_VALUE"):
        driver.memcpy_batch_async(dst, src, sizes, drv.SRC_ACCESS_ORDER_STREAM, stream=1, max_batch=4)


def test_batch_refuses_the_legacy_stream_and_old_drivers():
    dst, src, sizes = arrays(2)
    with pytest.raises(drv.CudaDriverError, match="legacy default stream"):
        drv.Driver(FakeLib()).memcpy_batch_async(dst, src, sizes, 1, stream=0)
    old = drv.Driver(FakeLib(with_batch=False))
    assert old.memcpy_batch is None
    with pytest.raises(drv.CudaDriverError, match="12.8"):
        old.memcpy_batch_async(dst, src, sizes, 1, stream=1)
    old.memcpy_loop_async(dst, src, sizes, stream=7)  # the fallback: one call per copy
    assert [c[1:] for c in old._lib.calls] == [(1000, 5000, 8, 7), (1010, 5010, 8, 7)]


def test_missing_driver_library_is_an_os_error(monkeypatch):
    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(drv.ctypes, "CDLL", no_lib)
    with pytest.raises(OSError):
        drv.Driver.load()


def test_probe_names_a_rocm_build_of_torch(monkeypatch):
    import torch

    from offload_core.backends.cuda import CudaBackend

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert "ROCm (HIP) build" in CudaBackend.probe()


def test_probe_explains_a_machine_without_cuda():
    import torch

    from offload_core.backends.cuda import CudaBackend

    reason = CudaBackend.probe()
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert "without CUDA" in reason or "is_available() is False" in reason


def test_missing_triton_takes_kernel_mechanisms_away(monkeypatch):
    kernels.why_unavailable.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)
    try:
        assert "triton is not importable" in kernels.why_unavailable()
    finally:
        kernels.why_unavailable.cache_clear()


@pytest.mark.parametrize(
    "direction, n, size, available, expected",
    [
        ("load", 4096, 256, MECHANISMS, "sm_gather"),  # tiny fragments: copy engines pay per descriptor
        # scattered on the host: the batch call's host time comes on top of its copies
        ("store", 1024, 16 * 1024, MECHANISMS, "sm_gather"),
        ("store", 16, 2 << 20, MECHANISMS, "ce_batch"),  # large: link speed, no SMs
        ("load", 256, 64 * 1024, MECHANISMS, "ce_batch"),
        ("store", 4096, 256, ("ce_batch", "ce_loop"), "ce_batch"),  # no triton
        ("store", 64, 4096, ("ce_loop",), "ce_loop"),
    ],
)
def test_cost_model_choices(direction, n, size, available, expected):
    assert CostModel().choose(direction, n, n * size, available, runs=n) == expected


def test_staging_wins_when_small_fragments_form_few_host_runs():
    model = CostModel()
    no_sm = ("ce_batch", "staged")
    assert model.choose("store", 8192, 8192 * 4096, no_sm, runs=lambda: 16) == "staged"
    assert model.choose("store", 8192, 8192 * 4096, no_sm, runs=lambda: 8192) == "ce_batch"


def test_profiles_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_PROFILE_DIR", str(tmp_path))
    path = profile_path("NVIDIA H200 NVL")
    assert path == tmp_path / "cuda-nvidia-h200-nvl.json"
    model = CostModel(sm_gbps={"store": 40.0, "load": 30.0}, source="calibrated")
    model.save(path)
    loaded = CostModel.load(path)
    assert loaded.sm_gbps == {"store": 40.0, "load": 30.0} and loaded.source == "calibrated"
    assert loaded.ce_gbps == CostModel().ce_gbps


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        '"x"',
        '{"ce_gbps": "fast"}',
        '{"ce_gbps": {"store": 0, "load": 0}}',
        '{"ce_gbps": {"store": 55}}',
        '{"sm_penalty": -5}',
        '{"staged_host_s": [1e-5]}',
        '{"inline_h2d_bytes": 1.5}',
        '{"launch_s": NaN}',
        "{not json",
    ],
)
def test_a_malformed_profile_is_ignored_for_the_defaults(tmp_path, monkeypatch, caplog, content):
    """A profile edited by hand or cut short: logged and left out, never a crash at the first choice."""
    from offload_core.backends.cuda.calibration import saved_profile

    monkeypatch.setenv("OFFLOAD_CORE_PROFILE_DIR", str(tmp_path))
    profile_path("Some GPU").write_text(content)
    with pytest.raises(ValueError):
        CostModel.load(profile_path("Some GPU"))
    assert saved_profile("Some GPU") == CostModel()
    assert "ignoring unreadable cuda profile" in caplog.text
    old = {"staged_host_s": [28e-6, 3.3e-9], "sm_host_s": [44e-6, 3.4e-9]}  # before the per-piece term
    profile_path("Old GPU").write_text(json.dumps(old))
    assert saved_profile("Old GPU").staged_host_s == (28e-6, 3.3e-9)


def test_host_time_of_the_batch_call_counts():
    """32 KiB pages: the link takes 0.6 us a copy and the batch call 0.4 us of host time on top: staging wins."""
    model = CostModel()
    n = 4096
    copies = (
        n * max(model.ce_desc_s["store"], 32768 / (model.ce_gbps["store"] * 1e9) + model.ce_tail_s) + model.launch_s
    )
    assert model.estimate("ce_batch", "store", n, n * 32768) == pytest.approx(copies + n * model.ce_host_s)
    assert model.choose("store", n, n * 32768, MECHANISMS, runs=64) == "staged"
    assert model.choose("store", 64, 64 * (2 << 20), MECHANISMS, runs=64) == "ce_batch"


def test_streams_are_created_non_blocking():
    lib = FakeLib()
    assert drv.Driver(lib).new_stream() == 0xBEEF
    assert lib.calls == [("stream_create", drv.STREAM_NON_BLOCKING)]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8 << 20), min_size=1, max_size=200),
    store=st.booleans(),
    staging_mb=st.sampled_from([4, 32]),
)
@example(sizes=[1048577, 1048577], store=False, staging_mb=32)  # a load's bound just past a fragment's start
def test_staged_pieces_cover_the_job_in_order_and_fit_a_buffer(sizes, store, staging_mb):
    staging_bytes = staging_mb << 20
    sizes = np.array([s for s in sizes if s <= staging_bytes // 4] or [1], dtype=np.int64)  # larger ones bypass staging
    edges = np.concatenate(([0], np.cumsum(sizes)))
    firsts = np.array(staging.pieces(edges, int(sizes.max()), sizes.size, store, staging_bytes))
    lasts = np.append(firsts[1:], sizes.size)
    assert firsts[0] == 0 and lasts[-1] == sizes.size
    assert (firsts[1:] == lasts[:-1]).all() and (lasts > firsts).all()
    piece_bytes = np.add.reduceat(sizes, firsts)
    assert (piece_bytes <= staging_bytes * 5 // 4).all()  # the buffer size
    if sizes.sum() <= staging_bytes:
        assert firsts.size == 1  # each piece costs host time; one that fits the buffer is one piece
    else:
        exposed = piece_bytes[0] if store else piece_bytes[-1]  # the gather or scatter not hidden behind the link
        assert exposed <= (1 << 20) + sizes.max()  # also in a load, whose pieces count from its end


def test_a_job_that_fits_the_buffer_is_one_piece_and_a_load_is_cut_from_its_end():
    MiB = 1 << 20
    assert piece_bounds(32 * MiB, 32 * MiB, store=True) == piece_bounds(32 * MiB, 32 * MiB, store=False) == []
    assert piece_bounds(100 * MiB, 32 * MiB, store=True) == [MiB, 33 * MiB, 65 * MiB, 97 * MiB]  # 1, 32, 32, 32, 3
    assert piece_bounds(100 * MiB, 32 * MiB, store=False) == [3 * MiB, 35 * MiB, 67 * MiB, 99 * MiB]  # 3, 32, 32, 32, 1


def test_staged_host_time_counts_its_pieces():
    """A staged job's host time has a part per piece; a profile saved without it still loads."""
    model = CostModel(staged_host_s=(50e-6, 5e-9, 60e-6))
    one, three = (model.estimate("staged", "store", 4096, 4096 * 256, runs=1, pieces=p) for p in (1, 3))
    assert three - one == pytest.approx(120e-6)
    old = CostModel(staged_host_s=[50e-6, 5e-9])  # as json.load gives it
    assert old.estimate("staged", "store", 4096, 4096 * 256, runs=1, pieces=3) == pytest.approx(50e-6 + 4096 * 5e-9)


def test_small_jobs_go_to_the_kernel_and_large_ones_to_staging():
    """2 KiB pages in host rows (canonical_bench's direct 128-byte heads): in a 1 MiB job
    staging's host time exceeds the kernel's device time, even counted double; in a 16 MiB
    job the link's time is what counts."""
    model = CostModel()
    assert model.choose("store", 512, 512 * 2048, MECHANISMS, runs=8, pieces=1) == "sm_gather"
    assert model.choose("store", 8192, 8192 * 2048, MECHANISMS, runs=128, pieces=1) == "staged"


@settings(max_examples=30, deadline=None)
@given(size=st.integers(1, 4096), n=st.integers(1, 5000), store=st.booleans())
def test_staged_pieces_of_equal_sizes_match_the_offsets_path(size, n, store):
    edges = np.arange(n + 1, dtype=np.int64) * size
    assert staging.pieces(None, size, n, store, 4 << 20) == staging.pieces(edges, size, n, store, 4 << 20)


def test_triton_specialization_key_separates_what_triton_specializes_on():
    spec = kernels._spec
    assert spec(1) != spec(17) and spec(16) != spec(17) and spec(32) == spec(48)
    assert spec(1 << 31) != spec((1 << 31) - 16)  # 32 vs 64 bits
    assert spec(1 << 63) != spec((1 << 63) - 16)  # unsigned


class FakeEvent:
    def __init__(self):
        self.done, self.waited = False, 0

    def query(self):
        return self.done

    def synchronize(self):  # the host waits until the work before it has run
        self.waited += 1
        self.done = True


class RingDevice:
    """The ring's torch and copy stand-ins: "device" memory is a CPU tensor, copies are immediate."""

    def __init__(self):
        import torch

        self.torch = SimpleNamespace(
            int64=torch.int64, empty=lambda n, dtype, pin_memory=False, device=None: torch.empty(n, dtype=dtype)
        )
        self.copies = []

    def memcpy(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((dst, nbytes, stream))


def _read(address, count, kind=ctypes.c_int64):
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(kind)), (count,)).copy()


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 3), st.integers(0, 300), st.booleans(), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_descriptor_ring_never_reuses_memory_a_pending_job_reads(jobs):
    """Tables of int64 and of int32 (`narrow`, an odd count of them taking half an entry) side
    by side: each reads back as it went up while its job is pending (a full ring waits for the
    oldest jobs, which are then done)."""
    from offload_core.backends.cuda.ring import DescriptorRing

    fake = RingDevice()
    ring = DescriptorRing(fake.torch, None, fake.memcpy, entries=512)
    stream = SimpleNamespace(cuda_stream=7)
    pending = []  # (event, [(device address, expected values, width)])
    for j, (n, k, split, narrow, finish_oldest) in enumerate(jobs):
        columns = [np.arange(n, dtype=np.int64) + 1000 * (j * 4 + c) for c in range(k)]
        regions = ring.open()
        tables, keep = _upload(ring, columns, stream, split, narrow=narrow)
        parts = [(0, split), (split, n)] if 0 < split < n else [(0, n)]
        assert len(tables) == len(parts)
        width = 4 if narrow else 8
        expect = [
            (tables[p] + width * c * (b - a), col[a:b], width)
            for p, (a, b) in enumerate(parts)
            for c, col in enumerate(columns)
        ]
        event = FakeEvent()
        ring.retire(event, regions)
        pending = [p for p in pending if not p[0].done] + [(event, expect, keep)]
        for _, exp, _ in pending:  # every pending job's tables still hold its descriptors
            for address, values, w in exp:
                assert (_read(address, len(values), ctypes.c_int32 if w == 4 else ctypes.c_int64) == values).all()
        if finish_oldest:
            pending.pop(0)[0].done = True
    assert all(stream == 7 for _, _, stream in fake.copies)


def _upload(ring, columns, stream, *args, **kwargs):
    """`DescriptorRing.upload`, and what it put in `held` (one-off memory, else empty)."""
    held: list = []
    tables = ring.upload(columns, stream, held, *args, **kwargs)
    (keep,) = held
    return tables, keep


def test_a_full_descriptor_ring_waits_for_its_oldest_job_and_falls_back_only_without_one():
    """No room beside a pending table: the upload waits for the oldest job (counted), then
    reuses its memory. One-off memory only for a table larger than the ring, or where the room
    would have to come from the enqueue under way (its regions not retired yet)."""
    from offload_core.backends.cuda.ring import DescriptorRing

    fake = RingDevice()
    ring = DescriptorRing(fake.torch, None, fake.memcpy, entries=100)
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


def test_small_fragments_in_host_rows_are_staged_and_scattered_ones_gathered():
    """256 B fragments: staging wins where they form few host runs (2 MiB rows), even where
    sm_gather is a little faster alone; where every fragment is its own run, sm_gather."""
    model, n = CostModel(), 65536
    assert model.choose("store", n, n * 256, MECHANISMS, runs=8, pieces=3) == "staged"
    assert model.choose("load", n, n * 256, MECHANISMS, runs=8, pieces=3) == "staged"
    assert model.choose("store", n, n * 256, MECHANISMS, runs=n, pieces=3) == "sm_gather"


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

    import torch

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
    stream = SimpleNamespace(cuda_stream=1)
    for _ in range(3):
        kernels._launch(kernel, 4, [64], {"W": 32}, stream)
    assert len(kernel.calls) == 3 and kernels._fast is False


def test_addressable_reads_the_host_ranges_while_other_threads_change_them():
    """alloc_host (a scratch-pool miss) and tensor finalizers change the ranges outside the
    enqueue lock while copy_batch asks whether memory is addressable."""
    import threading

    from offload_core.backends.cuda import CudaBackend

    backend = CudaBackend(driver=drv.Driver(FakeLib()), runtime=FakeCudaRuntime())
    backend._host_ranges.update({i << 12: (i << 12, (i + 1) << 12) for i in range(1, 5000)})
    stop = threading.Event()

    def churn():
        k = 1 << 40
        while not stop.is_set():
            backend._host_ranges[k] = (k, k + 1)
            k += 1
            if k % 7 == 0:
                for j in range(k - 7, k):
                    backend._host_ranges.pop(j, None)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that the race is hit, not just possible
    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(300):  # not addressable: every range is looked at, twice
            assert not backend.addressable(np.array([1 << 50]), np.array([64]))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


# ---- the adapter: one table of mechanisms, runs by name, calibration as a capability ------------


class Weigh:
    """A cost model that records what it was asked to weigh and picks `pick`."""

    def __init__(self, pick):
        self.pick, self.asked = pick, []

    def choose(self, direction, n, nbytes, available, runs, pieces=1):
        self.asked.append(available)
        return self.pick


class FakeCudaRuntime:
    """``torch.cuda`` as `CudaBackend` uses it, without a GPU: one device whose memory is the
    CPU's, streams known by their handles, the current one 0x5. Given the stand-in libcuda, its
    calls make the GPU's context current on the calling thread, as the runtime's do."""

    def __init__(self, lib: FakeLib | None = None):
        self._lib = lib

    def _call(self) -> bool:
        if self._lib is not None:
            self._lib.runtime_call()
        return True

    def torch_device(self, index):
        import torch

        return torch.device("cpu")

    def get_device_name(self, device):
        return "Fake GPU"

    def get_device_properties(self, device):
        return SimpleNamespace(multi_processor_count=132)

    def current_device(self):
        return 0

    def device(self, device):
        return contextlib.nullcontext()

    def current_stream(self, index):
        return SimpleNamespace(cuda_stream=0x5, query=self._call)

    def ExternalStream(self, handle, device=None):  # noqa: N802  (torch's name)
        return SimpleNamespace(cuda_stream=handle)

    def alloc_pinned(self, nbytes):
        import torch

        return torch.zeros(nbytes, dtype=torch.uint8)

    def synchronize(self, index):
        if self._lib is not None:
            self._lib.calls.append(("device_synchronize", index))


def host_only_backend(monkeypatch, lib, triton=True, mechanism="auto", cost=None, tune=False):
    """A CudaBackend over a stand-in libcuda and runtime: the table decides what is available.
    `auto` is the cost model's alone unless `tune` (the tuner has tests of its own:
    test_cuda_tuning.py)."""
    from offload_core.backends.cuda import CudaBackend

    monkeypatch.setattr(kernels, "why_unavailable", (lambda: None) if triton else (lambda: "triton is not importable"))
    return CudaBackend(
        mechanism=mechanism,
        cost_model=cost or CostModel(),
        driver=drv.Driver(lib),
        runtime=FakeCudaRuntime(lib),
        tune=tune,
    )


def copies(lib):
    """The copy calls the backend made (events and contexts aside)."""
    return [c for c in lib.calls if c[0] in ("batch", "memcpy")]


def test_the_table_lists_every_mechanism_once_batch_ones_in_order_of_preference():
    from offload_core.backends.cuda.mechanisms import TABLE

    assert MECHANISMS == ("ce_batch", "staged", "sm_gather", "ce_loop")
    assert BLOCK_MECHANISMS == ("expand_staged", "expand_direct", "expand_split")
    assert tuple(TABLE) == MECHANISMS + BLOCK_MECHANISMS
    assert all(name == m.name for name, m in TABLE.items())


def test_availability_comes_from_the_table(monkeypatch):
    backend = host_only_backend(monkeypatch, FakeLib(with_batch=False), triton=False)
    assert backend.available_mechanisms == ("ce_loop",)
    assert "12.8" in backend.why_unavailable("ce_batch")
    assert all("triton" in backend.why_unavailable(m) for m in ("staged", "sm_gather", *BLOCK_MECHANISMS))
    assert backend.why_unavailable("nosuch") == (
        "unknown mechanism; choose one of ce_batch, staged, sm_gather, ce_loop, expand_staged, expand_direct,"
        " expand_split or auto"
    )
    assert host_only_backend(monkeypatch, FakeLib()).available_mechanisms == MECHANISMS + BLOCK_MECHANISMS


def test_auto_weighs_the_available_batch_mechanisms_a_fallback_only_without_its_original(monkeypatch):
    """ce_loop stands in for ce_batch; sm_gather drops out where the host side is not
    device-addressable, and is weighed where it is."""
    from offload_core.backends.cuda.mechanisms import contenders

    dst, src, sizes = arrays(4)
    model = Weigh("ce_loop")
    backend = host_only_backend(monkeypatch, FakeLib(with_batch=False), cost=model)
    backend.available_mechanisms += ("staged",)  # as if triton were there for it alone
    backend._contenders = contenders(backend.available_mechanisms)
    assert backend.copy_batch(src, dst, sizes, Direction.LOAD, SimpleNamespace(cuda_stream=7)) == "ce_loop"
    assert model.asked == [("staged", "ce_loop")]

    model = Weigh("ce_batch")
    backend = host_only_backend(monkeypatch, FakeLib(), cost=model)
    backend.copy_batch(src, dst, sizes, Direction.STORE, SimpleNamespace(cuda_stream=7))
    backend._host_ranges[0] = (0, 1 << 20)  # now the host side is addressable
    backend.copy_batch(src, dst, sizes, Direction.STORE, SimpleNamespace(cuda_stream=7))
    assert model.asked == [("ce_batch", "staged"), ("ce_batch", "staged", "sm_gather")]


class _Stream(SimpleNamespace):
    """A stream handle that notes the events it was made to wait for."""

    def wait_event(self, event):
        self.waited.append(event)


def test_an_enqueue_a_ctrl_c_cut_short_is_held_until_an_event_on_its_own_stream(monkeypatch):
    """An enqueue whose `with` a Ctrl-C left before its event was recorded (the `finally` then
    runs only when the generator is collected): the next enqueue, on another stream, records
    one on the first enqueue's stream, after the side streams it left unjoined, and sets it on
    what the first holds and the ring regions it reserved; its own event covers only its own."""
    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib, mechanism="ce_batch")
    first, second = _Stream(cuda_stream=5, waited=[]), _Stream(cuda_stream=9, waited=[])
    side = SimpleNamespace(cuda_stream=6)
    cut = backend._enqueued(first)
    held = cut.__enter__()
    held.append("the first enqueue's table")
    held.sides.append(side)  # a mechanism's join that the interrupt cut short
    (entry,) = [e for e in backend._keepalive if e[1] is held]
    region = entry[3]
    region.append([0, 10, None])  # as `_reserve` lists a region of the enqueue under way
    assert entry[0] is None
    lib.calls.clear()
    dst, src, sizes = arrays(3)
    backend.enqueue_with("ce_batch", src, dst, sizes, Direction.STORE, second)
    records = [c[2] for c in lib.calls if c[0] == "record"]
    # the side joined (a marker on it that the first enqueue's stream waits for), the first
    # enqueue's event on its own stream, then the second's on its own
    assert records == [6, 5, 9]
    assert len(first.waited) == 1 and second.waited == []
    assert entry[0] is not None and region[0][2] is entry[0]
    assert not backend._cut_short
    cut.__exit__(None, None, None)  # the collected generator's `finally`, late: a later event, harmless
    assert not backend._cut_short


def test_releasing_a_stream_waits_for_the_gpu_only_where_an_enqueue_was_cut_short(monkeypatch):
    """The worker frees its host memory once its lanes' streams are released: where an enqueue
    a Ctrl-C cut short may have left work on a side stream, the release waits for the whole
    GPU first, even on a thread that holds the enqueue lock (a collected worker's release)."""
    from offload_core.backend import enqueue_lock

    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib, mechanism="ce_batch")
    stream = _Stream(cuda_stream=5, waited=[])
    dst, src, sizes = arrays(3)
    backend.enqueue_with("ce_batch", src, dst, sizes, Direction.STORE, stream)
    backend.release_stream(stream)
    assert ("device_synchronize", 0) not in lib.calls  # the jobs' end events covered everything
    cut = backend._enqueued(stream)
    held = cut.__enter__()
    held.sides.append(SimpleNamespace(cuda_stream=6))  # a join the interrupt cut short
    lib.calls.clear()
    released = threading.Event()

    def release_inside_an_enqueue():
        with enqueue_lock(backend):
            backend.release_stream(stream)
            released.set()

    thread = threading.Thread(target=release_inside_an_enqueue, daemon=True)
    thread.start()
    thread.join(10)
    assert released.is_set() and lib.calls == [("device_synchronize", 0)]
    cut.__exit__(None, None, None)


@pytest.mark.parametrize("line", ["keepalive.append(entry)", "self._cut_short[id(entry)] = entry"])
def test_a_ctrl_c_as_an_enqueue_lists_its_entry_leaves_nothing_kept_for_ever(line, monkeypatch):
    """A Ctrl-C before either step that records an enqueue's entry (kept, and listed to be
    settled): the enqueues after it still let go of what they held once their events passed."""
    from helpers import ctrl_c_before_line

    from offload_core.backends.cuda import CudaBackend

    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib, mechanism="ce_batch")
    dst, src, sizes = arrays(3)
    stream = SimpleNamespace(cuda_stream=9)
    ctrl_c_before_line(CudaBackend._enqueued.__wrapped__, line)
    try:
        with pytest.raises(KeyboardInterrupt):
            backend.enqueue_with("ce_batch", src, dst, sizes, Direction.STORE, stream)
    finally:
        sys.settrace(None)
    for _ in range(5):
        backend.enqueue_with("ce_batch", src, dst, sizes, Direction.STORE, stream)
    assert len(backend._keepalive) <= 2 and not backend._cut_short


def test_an_enqueues_ring_regions_take_its_own_event_only():
    """Regions an enqueue reserved are retired with its event, not with the event of another
    enqueue whose retire comes first (a Ctrl-C cut the other's short)."""
    from offload_core.backends.cuda.ring import DescriptorRing

    ring = DescriptorRing(RingDevice().torch, None, RingDevice().memcpy, entries=100)
    stream = SimpleNamespace(cuda_stream=1)
    first = ring.open()
    _upload(ring, [np.arange(10)], stream)
    second = ring.open()
    _upload(ring, [np.arange(10)], stream)
    event = FakeEvent()
    ring.retire(event, second)
    assert [r[2] for r in first] == [None] and [r[2] for r in second] == [event]


def test_enqueue_with_runs_one_mechanism_and_leaves_the_backends_alone(monkeypatch):
    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib, mechanism="ce_batch")
    dst, src, sizes = arrays(3)
    stream = SimpleNamespace(cuda_stream=9)
    assert backend.enqueue_with("ce_loop", src, dst, sizes, Direction.LOAD, stream) == "ce_loop"
    assert [c[0] for c in copies(lib)] == ["memcpy"] * 3 and backend.mechanism == "ce_batch"
    # the arrays the driver may still read are held until an event recorded after the copies has passed
    assert lib.calls[-1][0] == "record" and lib.calls[-1][2] == 9 and backend._keepalive
    assert ("event_create", 2) in lib.calls  # a marker, never timed: CU_EVENT_DISABLE_TIMING
    lib.calls.clear()
    assert backend.copy_batch(src, dst, sizes, Direction.STORE, stream) == "ce_batch"
    (call,) = copies(lib)
    assert call[0] == "batch" and call[4] == drv.SRC_ACCESS_ORDER_STREAM
    # a compact-job mechanism takes a bare batch as auto
    assert (
        host_only_backend(monkeypatch, lib, cost=Weigh("ce_loop")).enqueue_with(
            "expand_staged", src, dst, sizes, Direction.LOAD, stream
        )
        == "ce_loop"
    )


@pytest.mark.parametrize(
    "mechanism, message",
    [
        ("nosuch", "cuda mechanism 'nosuch' cannot be used: unknown mechanism"),
        ("ce_batch", "cuda mechanism 'ce_batch' cannot be used: the driver has no cuMemcpyBatchAsync"),
        ("sm_gather", "sm_gather needs host memory from alloc_host or pin_host_memory"),
    ],
)
def test_enqueue_with_refuses_what_cannot_run_before_enqueueing(monkeypatch, mechanism, message):
    lib = FakeLib(with_batch=mechanism != "ce_batch")
    backend = host_only_backend(monkeypatch, lib)
    dst, src, sizes = arrays(2)
    with pytest.raises(ValueError, match=message):
        backend.enqueue_with(mechanism, src, dst, sizes, Direction.STORE, SimpleNamespace(cuda_stream=1))
    assert lib.calls == []


def test_calibration_holds_the_backends_enqueue_lock(monkeypatch):
    """Calibrating uploads through the backend's descriptor ring and stages through its buffers,
    which every enqueue shares: a worker's launch on the same backend must wait for it."""
    from offload_core.backend import enqueue_lock
    from offload_core.backends.cuda import calibration

    backend = host_only_backend(monkeypatch, FakeLib())
    seen = []
    monkeypatch.setattr(calibration, "calibrate", lambda b, save: seen.append(enqueue_lock(b).locked()) or {})
    backend.calibrate(save=False)
    assert seen == [True] and not enqueue_lock(backend).locked()


def test_calibration_is_a_capability_the_cli_asks_for(monkeypatch, capsys):
    import json

    from offload_core import cli, registry
    from offload_core.backends.cpu import CpuBackend
    from offload_core.backends.cuda import CudaBackend

    assert CudaBackend.calibrates and not CpuBackend.calibrates
    with pytest.raises(NotImplementedError, match="nothing to calibrate"):
        CpuBackend().calibrate()
    backend = CudaBackend(driver=drv.Driver(FakeLib()), runtime=FakeCudaRuntime())
    monkeypatch.setattr(backend, "calibrate", lambda save=True: {"saved": save})
    monkeypatch.setattr(registry, "get_backend", lambda name=None: backend)
    assert cli.main(["calibrate", "--backend", "cuda", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) == {"saved": False}


@pytest.mark.parametrize(
    "items, nbytes, segments, cheaper",
    [
        (65536, 256 << 20, 65536, "expand_direct"),  # one tensor, 4 KiB pages, scattered host blocks
        (1 << 20, 256 << 20, 1 << 20, "expand_direct"),  # the same at 256 B
        (4096, 256 << 20, 4096, "expand_staged"),  # 64 KiB pages: the copy engines keep up
        (1024, 4 << 20, 16, "expand_staged"),  # an engine's job: 16 blocks x 64 tensors of 4 KiB
    ],
)
def test_the_cost_model_weighs_the_compact_paths(items, nbytes, segments, cheaper):
    from offload_core.backends.cuda.select import CostModel

    cost = CostModel()
    est = {m: cost.estimate_job(m, "store", items, nbytes, segments) for m in ("expand_staged", "expand_direct")}
    assert min(est, key=est.get) == cheaper


@pytest.mark.parametrize(
    "items, nbytes, segments, small, cheaper",
    [
        (4096, 1 << 20, 64, 1 << 20, "expand_direct"),  # 64 blocks x 64 tensors of 256 B: 16 KiB host-to-device copies
        (4096, 1 << 20, 63, (1 << 20) - (32 << 10), "expand_direct"),  # the same, two rows adjacent on the host
        (1024, 4 << 20, 16, 0, "expand_staged"),  # 4 KiB pages: 256 KiB segments
    ],
)
def test_small_loads_weigh_the_host_time_of_their_copies(items, nbytes, segments, small, cheaper):
    from offload_core.backends.cuda.select import CostModel

    cost = CostModel()
    est = {m: cost.estimate_job(m, "load", items, nbytes, segments, small) for m in ("expand_staged", "expand_direct")}
    assert est[cheaper] < 0.98 * max(est.values())


def test_compact_stores_go_straight_to_host_rows_where_the_batch_call_would_bind_them():
    """256 B pages over 64 layers: 16 KiB host rows, 256 per 4 MiB job. The batch call's host time
    per row exceeds the link's time for it, so auto weighs writing the rows from the kernel, and
    takes it; 1 KiB pages (64 KiB rows) stay staged."""
    from types import SimpleNamespace

    from offload_core.backends.cuda.blocks import EXPAND_DIRECT, EXPAND_STAGED, BlockCopier

    copier = BlockCopier(SimpleNamespace(cost=CostModel()), 24 << 20)
    copier.direct_ok = lambda prepared: True

    def choice(row_bytes, rows, direction=Direction.STORE, merged=0):
        # `merged` pairs of neighbouring rows: one segment each
        layout = SimpleNamespace(
            row_bytes=row_bytes,
            largest=row_bytes // 64,
            smallest=row_bytes // 64,
            segment_summary=lambda job, limit: (rows - merged, 0),
        )
        job = SimpleNamespace(direction=direction, items=rows * 64, nbytes=rows * row_bytes, jobs=1, layout=layout)
        job.host_ids = np.empty(rows)
        return copier.choose(job, SimpleNamespace(layout=layout))

    assert choice(16384, 256) is EXPAND_DIRECT
    assert choice(16384, 256, merged=6) is EXPAND_DIRECT  # a few neighbours do not flip the choice
    assert choice(65536, 256) is EXPAND_STAGED  # 16 MiB jobs: larger than the small stores' rule
    assert choice(262144, 64) is EXPAND_STAGED
    copier.direct_ok = lambda prepared: False  # host rows the kernel cannot address
    assert choice(16384, 256) is EXPAND_STAGED


def _copier(penalty=2.0, given=None):
    from offload_core.backends.cuda.blocks import BlockCopier

    programs = {Direction.STORE: given or 8, Direction.LOAD: given or 32}
    backend = SimpleNamespace(
        cost=CostModel(sm_penalty=penalty), sm_programs=programs, programs_given=given is not None
    )
    copier = BlockCopier(backend, 24 << 20)
    copier.direct_ok = lambda prepared: True
    return copier


def _launch(direction, job_bytes, jobs, row_bytes=65536, runs=None, tensors=64, whole_rows=True):
    # a launch of `jobs` jobs of `job_bytes`, pages of 1/64 of a row over 64 tensors (1 KiB by
    # default), its host rows apart or merged into `runs` segments; each block writes its whole
    # host row, or (`whole_rows` False) a piece of it, as in a canonical layout
    rows = job_bytes * jobs // row_bytes
    segments = (runs or rows, 0)
    layout = SimpleNamespace(
        row_bytes=row_bytes,
        largest=row_bytes // tensors,
        smallest=row_bytes // tensors,
        segment_summary=lambda job, limit: segments,
    )
    job = SimpleNamespace(
        direction=direction,
        items=rows * tensors,
        nbytes=job_bytes * jobs,
        jobs=jobs,
        layout=layout,
        host_ids=np.empty(rows),
        simple=True,
    )
    return job, SimpleNamespace(layout=layout, whole_rows=dict.fromkeys(Direction, whole_rows))


@pytest.mark.parametrize(
    "job_bytes, jobs, expected",
    [
        (1 << 20, 14, "expand_direct"),  # 1 KiB x 16 blocks: bound by the host's time per job
        (256 << 10, 1, "expand_direct"),
        ((1 << 20) + 65536, 14, "expand_staged"),  # larger: the cost model's choice
        (4 << 20, 14, "expand_staged"),
    ],
)
def test_small_loads_go_straight_to_host_rows_larger_ones_by_the_cost_model(job_bytes, jobs, expected):
    assert _copier().choose(*_launch(Direction.LOAD, job_bytes, jobs)).name == expected


@pytest.mark.parametrize(
    "job_bytes, row_bytes, expected",
    [
        (4 << 20, 65536, "expand_direct"),  # 1 KiB pages: staging's batch call per row binds them
        (4 << 20, 64 * 4096, "expand_direct"),  # 4 KiB pages
        ((4 << 20) + 65536, 65536, "expand_staged"),  # larger: bound by the link, staging spares the SMs
        (4 << 20, 64 * 8192, "expand_staged"),  # 8 KiB pages: rows long enough for the batch call
        (4 << 20, 64 * 512, "expand_staged"),  # 512 B pages: not sized by this rule; the cost model's choice
    ],
)
def test_stores_of_mid_sized_pages_go_straight_up_to_a_few_mib_a_job(job_bytes, row_bytes, expected):
    assert _copier().choose(*_launch(Direction.STORE, job_bytes, 14, row_bytes=row_bytes)).name == expected
    # on two programs: they keep up with the link and leave the model's kernels their SMs
    if expected == "expand_direct" and row_bytes >= 65536:
        assert _copier().direct_programs(*_launch(Direction.STORE, job_bytes, 14, row_bytes=row_bytes)) == 2
    # some of the entries smaller (256 B beside 1 KiB pages): not sized by this rule
    mixed = _launch(Direction.STORE, job_bytes, 14, row_bytes=row_bytes)
    mixed[0].layout.smallest = 256
    if row_bytes >= 65536:
        assert _copier().choose(*mixed).name == "expand_staged"
    assert _copier(penalty=3.0).choose(*_launch(Direction.STORE, job_bytes, 14, row_bytes=row_bytes)).name == (
        "expand_staged"
    )


@pytest.mark.parametrize(
    "job_bytes, row_bytes, expected",
    [
        (4 << 20, 65536, "expand_split"),  # 1 KiB pages: larger than the host-bound jobs
        (4 << 20, 64 * 4096, "expand_split"),  # 4 KiB pages
        (32 << 20, 64 * 4096, "expand_split"),
        (1 << 20, 65536, "expand_direct"),  # bound by the host's time per job: as before
        (4 << 20, 64 * 8192, None),  # 8 KiB and 512 B pages: not split (the cost model's choice)
        (4 << 20, 64 * 512, None),
    ],
)
def test_an_engine_that_lowers_the_sm_penalty_splits_mid_sized_stores(job_bytes, row_bytes, expected):
    """Below the default penalty, stores the default sends to expand_direct (or, larger, to
    staging) go to expand_split: two SMs and the copy engines on the link at once."""
    launch = _launch(Direction.STORE, job_bytes, 14, row_bytes=row_bytes)
    chosen = _copier(penalty=1.0).choose(*launch).name
    assert chosen == expected if expected else chosen != "expand_split"
    assert _copier(penalty=1.0).choose(*_launch(Direction.LOAD, job_bytes, 14, row_bytes=row_bytes)).name != (
        "expand_split"
    )
    runs = _launch(Direction.STORE, job_bytes, 14, row_bytes=row_bytes, runs=1)  # host rows in one run: staged
    assert _copier(penalty=1.0).choose(*runs).name != "expand_split"
    assert _copier().choose(*launch).name != "expand_split"  # the default never splits
    # jobs it cannot split (several groups, chunks of several blocks) go as at the default: up
    # to 4 MiB straight to the rows, not staged
    whole = _launch(Direction.STORE, job_bytes, 14, row_bytes=row_bytes)
    whole[0].simple = False
    chosen = _copier(penalty=1.0).choose(*whole).name
    assert chosen != "expand_split"
    if expected in ("expand_split", "expand_direct") and job_bytes <= 4 << 20:
        assert chosen == "expand_direct"


def test_a_split_sends_half_a_simple_stores_blocks_direct():
    from offload_core.backends.cuda.blocks import BlockCopier

    def job(n, direction=Direction.STORE, simple=True):
        return SimpleNamespace(direction=direction, simple=simple, host_ids=np.arange(n))

    assert [BlockCopier.split_at(job(n)) for n in (1, 2, 3, 16, 64)] == [0, 1, 2, 8, 32]
    assert BlockCopier.split_at(job(16, Direction.LOAD)) == 0
    assert BlockCopier.split_at(job(16, simple=False)) == 0


@pytest.mark.parametrize("direction", list(Direction))
def test_copies_that_staging_would_not_join_go_host_expanded(direction):
    """One tensor's 64 KiB pages scattered over the host: each copy fills the copy engines, each
    segment holds one or two of them, so the gather joins nothing worth a pass through staging."""
    assert _copier().choose(*_launch(direction, 256 << 20, 1, row_bytes=65536, tensors=1)).name == "ce_batch"
    paired = _launch(direction, 256 << 20, 1, row_bytes=65536, runs=2048, tensors=1)  # neighbours merged
    assert _copier().choose(*paired).name == "ce_batch"
    # 64 tensors' 32 KiB pages: 64 copies a 2 MiB row, joined by the gather into one
    assert _copier().choose(*_launch(direction, 32 << 20, 4, row_bytes=64 * 32768)).name == "expand_staged"
    # pages of 64 KiB and 4 KiB (two tensors): the small ones would go as copies of their own
    mixed = _launch(direction, 256 << 20, 1, row_bytes=65536 + 4096, tensors=2)
    mixed[0].layout.largest, mixed[0].layout.smallest = 65536, 4096
    assert mixed[0].items <= 4 * (256 << 20) // (65536 + 4096)
    assert _copier().choose(*mixed).name != "ce_batch"
    # one tensor's 16 KiB pages: copies too small for the copy engines at link speed
    assert _copier().choose(*_launch(direction, 256 << 20, 1, row_bytes=16384, tensors=1)).name != "ce_batch"


@pytest.mark.parametrize("direction", list(Direction))
def test_small_jobs_stay_staged_where_the_engine_spares_the_sms_or_the_kernel_cannot_reach_the_rows(direction):
    assert _copier(penalty=3.0).choose(*_launch(direction, 1 << 20, 14)).name == "expand_staged"
    # host rows in runs (a free list's blocks, in host order): a copy per run, no SMs
    assert _copier().choose(*_launch(direction, 1 << 20, 14, runs=14)).name == "expand_staged"
    assert _copier().choose(*_launch(direction, 1 << 20, 14, runs=14 * 8 - 1)).name == "expand_staged"
    # random host blocks have a few neighbours, merged in host order: still apart
    assert _copier().choose(*_launch(direction, 1 << 20, 14, runs=14 * 16 - 6)).name == "expand_direct"
    assert _copier().choose(*_launch(direction, 1 << 20, 14, runs=14 * 8)).name == "expand_direct"
    copier = _copier()
    copier.direct_ok = lambda prepared: False
    assert copier.choose(*_launch(direction, 1 << 20, 14)).name == "expand_staged"


@pytest.mark.parametrize(
    "job_bytes, jobs, store_programs, load_programs",
    [
        (1 << 20, 14, 2, 8),
        (256 << 10, 1, 2, 8),
        ((1 << 20) + 1, 3, 2, 32),
        (4 << 20, 14, 2, 32),  # stores up to DIRECT_STORE_BYTES: two programs keep up with the link
        ((4 << 20) + 1, 3, 8, 32),  # larger: one per STORE_BYTES_PER_PROGRAM
        (256 << 20, 1, 8, 32),
    ],
)
def test_direct_jobs_take_programs_by_their_jobs_size(job_bytes, jobs, store_programs, load_programs):
    copier = _copier()
    assert copier.direct_programs(*_launch(Direction.STORE, job_bytes, jobs)) == store_programs
    assert copier.direct_programs(*_launch(Direction.LOAD, job_bytes, jobs)) == load_programs
    given = _copier(given=12)  # set by the engine: taken as it is
    for direction in Direction:
        assert given.direct_programs(*_launch(direction, job_bytes, jobs)) == 12
    for direction in Direction:  # smaller pages move slower per program: the backend's, but for link-bound stores
        small_pages = _launch(direction, job_bytes, jobs, row_bytes=64 * 512)
        link_bound_store = direction is Direction.STORE and job_bytes > (1 << 20)
        expected = 4 if link_bound_store else copier.backend.sm_programs[direction]
        assert copier.direct_programs(*small_pages) == expected
        # pieces of rows (a canonical layout's small heads) need requests in flight: the backend's
        pieces = _launch(direction, job_bytes, jobs, row_bytes=64 * 512, whole_rows=False)
        assert copier.direct_programs(*pieces) == copier.backend.sm_programs[direction]
        # one tensor: rows of one page, scattered over the host, keep the backend's programs
        one_tensor = _launch(direction, job_bytes, jobs, row_bytes=256, tensors=1)
        assert copier.direct_programs(*one_tensor) == copier.backend.sm_programs[direction]


@pytest.fixture(params=[True, False], ids=["compiled", "ctypes"])
def event_calls(request, monkeypatch):
    """An event's record and query through the compiled extension (skipped where it was not
    built) or through ctypes: both must call the driver alike."""
    from helpers import compiled_or_skip

    compiled_or_skip(request.param, drv.COMPILED)
    if not request.param:
        monkeypatch.setenv("OFFLOAD_CORE_NATIVE", "0")
    return request.param


def test_driver_events_record_wait_and_time_on_any_streams_handle(event_calls):
    lib = FakeLib()
    driver = drv.Driver(lib)
    assert driver.has_events
    event, end = DriverEvent(driver, GPU_CONTEXT), DriverEvent(driver, GPU_CONTEXT)
    torch_like = SimpleNamespace(cuda_stream=0x51)
    event.record(torch_like)
    compute = RawStream(0x52, lambda: DriverEvent(driver, GPU_CONTEXT))
    compute.wait_event(event)
    assert ("record", event.handle, 0x51) in lib.calls and ("wait", 0x52, event.handle, 0) in lib.calls
    assert event.query() is True and event.elapsed_time(end) == 1.5
    lib.codes["query"] = [drv.ERROR_NOT_READY]
    assert event.query() is False
    lib.codes["query"] = [700]  # a fault on the device: the result fails, the caller's loop goes on
    with pytest.raises(drv.CudaDriverError, match="cuEventQuery failed"):
        event.query()
    assert not any(c[0] in ("push", "pop") for c in lib.calls), "the GPU's context was current: nothing to switch"
    assert RawStream(0x52, None) == compute and hash(RawStream(0x52, None)) == hash(compute)
    assert RawStream(0x53, None) != compute
    handle = event.handle
    del event
    gc.collect()
    assert ("destroy", handle) in lib.calls


@pytest.mark.parametrize("current", [[], [0xC1]], ids=["no context", "another GPU's context"])
def test_a_driver_event_runs_in_its_gpus_context_and_leaves_the_threads_alone(current, event_calls):
    lib = FakeLib()
    driver = drv.Driver(lib)
    event = DriverEvent(driver, GPU_CONTEXT)
    lib.contexts[:] = current  # a thread that made no CUDA call, or one on another GPU
    del lib.calls[:]
    event.record(SimpleNamespace(cuda_stream=0))  # the default stream: the current context's
    assert lib.calls == [("push", GPU_CONTEXT), ("record", event.handle, None), ("pop",)]  # None: a null handle
    assert lib.contexts == current
    del lib.calls[:]
    lib.codes["query"] = [drv.ERROR_NOT_READY]
    assert event.query() is False
    assert lib.calls == [("push", GPU_CONTEXT), ("query", event.handle), ("pop",)] and lib.contexts == current
    lib.codes["record"] = [700]
    with pytest.raises(drv.CudaDriverError, match="cuEventRecord failed: CUDA_ERROR_INVALID_VALUE") as failed:
        event.record(SimpleNamespace(cuda_stream=0x51))
    assert failed.value.code == 700 and lib.contexts == current, "popped after a failure too"
    lib.codes["wait"] = [1]
    with pytest.raises(drv.CudaDriverError, match="cuStreamWaitEvent failed"):
        event.wait(SimpleNamespace(cuda_stream=0x51))
    assert lib.contexts == current, "popped after a failure too"
    del lib.calls[:]
    event.wait(SimpleNamespace(cuda_stream=0x51))
    assert event.elapsed_time(event) == 1.5
    assert lib.calls == [
        ("push", GPU_CONTEXT),
        ("wait", 0x51, event.handle, 0),
        ("pop",),
        ("push", GPU_CONTEXT),
        ("elapsed", event.handle, event.handle),
        ("pop",),
    ]
    assert lib.contexts == current


def test_a_descriptor_tables_upload_runs_in_the_gpus_context(monkeypatch, event_calls):
    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib)
    lib.contexts[:] = []  # a launcher thread that made no CUDA call
    del lib.calls[:]
    backend._table_copy(0xD0, 0x40, 96, 0x77)
    assert lib.calls == [("push", GPU_CONTEXT), ("memcpy", 0xD0, 0x40, 96, 0x77), ("pop",)] and lib.contexts == []


def test_a_context_that_cannot_be_made_current_fails_the_call_not_the_process(event_calls):
    lib = FakeLib()
    driver = drv.Driver(lib)
    event = DriverEvent(driver, GPU_CONTEXT)
    lib.contexts[:] = []
    push = lib._keep["cuCtxPushCurrent"]
    lib._keep["cuCtxPushCurrent"] = drv.CTX_IN(lambda ctx: 201)  # CUDA_ERROR_INVALID_CONTEXT
    driver = drv.Driver(lib)  # resolves the failing push
    event._driver = driver
    del lib.calls[:]
    calls = (
        lambda: event.record(SimpleNamespace(cuda_stream=0x51)),
        event.query,
        lambda: event.wait(SimpleNamespace(cuda_stream=0x51)),
        lambda: event.elapsed_time(event),
    )
    for call in calls:
        with pytest.raises(drv.CudaDriverError, match="cuCtxPushCurrent failed") as failed:
            call()
        assert failed.value.code == 201
    assert lib.calls == [], "neither the call nor a pop ran"
    lib._keep["cuCtxPushCurrent"] = push


def test_the_compiled_context_call_refuses_what_would_crash():
    from helpers import compiled_or_skip

    compiled = compiled_or_skip(True, drv.COMPILED)
    for keep_gil in (True, False):
        with pytest.raises(TypeError, match="7 to 10 arguments"):
            compiled.context_call(keep_gil, 1, 2, 3, 4, 5)
        with pytest.raises(TypeError, match="7 to 10 arguments"):
            compiled.context_call(keep_gil, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
        with pytest.raises(ValueError, match="address is 0"):
            compiled.context_call(keep_gil, 1, 2, 0, 4, 5, 6)
        with pytest.raises(OverflowError):
            compiled.context_call(keep_gil, -1, 2, 3, 4, 5, 6)  # an address, never negative
        with pytest.raises(TypeError):
            compiled.context_call(keep_gil, 1, 2, 3, 4, 5, "stream")


def test_the_compiled_context_call_takes_none_for_a_null_context_or_handle():
    from helpers import compiled_or_skip

    compiled = compiled_or_skip(True, drv.COMPILED)
    lib = FakeLib()
    driver = drv.Driver(lib)
    lib.contexts[:] = []  # no context current: a null one is what is asked for, so nothing is pushed
    address = lambda name: ctypes.cast(lib._keep[name], ctypes.c_void_p).value  # noqa: E731
    entry = [address(n) for n in ("cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuEventRecord")]
    assert compiled.context_call(True, *entry, None, 0xE5, None) == 0
    assert compiled.context_call(False, *entry, None, 0xE6, None) == 0
    assert lib.calls == [("record", 0xE5, None), ("record", 0xE6, None)]
    assert driver.record_in is not None


def _table_launch(lib=None, types=("i64", "i32", "i64"), hidden=1):
    """A `LaunchingLib`, and the compiled table launch of its driver in the GPU's context."""
    from helpers import compiled_or_skip

    compiled_or_skip(True, drv.COMPILED)
    lib = lib or LaunchingLib(types=types, hidden=hidden)
    return lib, drv.Driver(lib).table_launch_in(GPU_CONTEXT)


@pytest.mark.parametrize("narrow", [False, True], ids=["int64", "int32"])
def test_the_compiled_table_launch_uploads_then_launches_in_the_gpus_context(narrow):
    lib, launch = _table_launch()
    lib.contexts[:] = []  # a launcher thread that made no CUDA call
    host = np.full(8, -1, dtype=np.int64)
    cols = (np.array([5, 70000, 3]), np.array([7, 8, 1 << 20]))
    device, stream, nbytes = 1 << 40, 0x77, 6 * (4 if narrow else 8)
    params = (device, -5, 2**40 + 3, 0)  # the last a null scratch pointer
    launch(host.ctypes.data, device, host.nbytes, cols, narrow, stream, 0xF00, 9, 128, 512, params)
    assert lib.calls == [
        ("push", GPU_CONTEXT),
        ("memcpy", device, host.ctypes.data, nbytes, stream),
        ("launch", 9, 128, 512, stream, device, -5, 2**40 + 3, 0),  # -5 read as the kernel's i32
        ("pop",),
    ]
    written = host.view(np.int32)[:6] if narrow else host[:6]
    assert written.tolist() == [5, 70000, 3, 7, 8, 1 << 20]
    assert (host.view(np.uint8)[nbytes:] == 0xFF).all(), "nothing written past the table"
    assert lib.contexts == []


def test_the_compiled_table_launch_names_the_call_that_failed():
    lib, launch = _table_launch()
    host = np.zeros(4, dtype=np.int64)
    cols, params = (np.arange(2), np.arange(2)), (1 << 40, 1, 2, 0)
    args = (host.ctypes.data, 1 << 40, 32, cols, False, 0x77, 0xF00, 1, 128, 0, params)
    lib.codes["memcpy"] = [700]
    with pytest.raises(drv.CudaDriverError, match="cuMemcpyAsync failed") as failed:
        launch(*args)
    assert failed.value.code == 700
    assert not [c for c in lib.calls if c[0] == "launch"], "no launch after a failed upload"
    lib.codes["launch"] = [719]
    with pytest.raises(drv.CudaDriverError, match="cuLaunchKernel failed") as failed:
        launch(*args)
    assert failed.value.code == 719
    lib.contexts[:] = []
    lib._keep["cuCtxPushCurrent"] = drv.CTX_IN(lambda ctx: 201)
    lib, launch = _table_launch(lib)  # resolves the failing push
    del lib.calls[:]
    with pytest.raises(drv.CudaDriverError, match="cuCtxPushCurrent failed"):
        launch(*args)
    assert lib.calls == [], "neither the copy nor the launch ran"


def test_the_compiled_table_launch_refuses_what_would_overrun_having_called_nothing():
    lib, launch = _table_launch()
    host = np.zeros(4, dtype=np.int64)
    two = (np.arange(2), np.arange(2))

    def call(room=32, cols=two, narrow=False, grid=1, params=(1 << 40, 1, 2, 0)):
        launch(host.ctypes.data, 1 << 40, room, cols, narrow, 0x77, 0xF00, grid, 128, 0, params)

    del lib.calls[:]
    refusals = [
        (ValueError, "does not fit the 24", dict(room=24)),
        (ValueError, "equal lengths", dict(cols=(np.arange(2), np.arange(3)))),
        (TypeError, "int64", dict(cols=(np.arange(2, dtype=np.int32),))),
        (ValueError, "C-contiguous", dict(cols=(np.arange(4)[::2],))),
        (ValueError, "1 to 8 columns", dict(cols=(np.arange(1),) * 9)),
        (ValueError, "1 to 8 columns", dict(cols=())),
        (ValueError, "at most 24 params", dict(params=(0,) * 25)),
        (ValueError, "1 <= grid", dict(grid=0)),
        (TypeError, "sequence", dict(cols=5)),
    ]
    for error, message, kwargs in refusals:
        with pytest.raises(error, match=message):
            call(**kwargs)
    call(room=16, narrow=True)  # int32: 16 bytes fit
    assert [c[0] for c in lib.calls] == ["memcpy", "launch"], "only the last call was made"
    with pytest.raises(TypeError, match="17 arguments"):
        drv.compiled().table_launch(1, 2, 3)
    with pytest.raises(ValueError, match="address is 0"):
        drv.compiled().table_launch(0, *[1] * 16)


def test_the_compiled_table_launch_takes_its_arguments_as_they_were_given():
    """A column list or a parameter that changes the lists while they are read (an `__index__`
    that empties them) cannot make the call read past them: it reads copies."""
    lib, launch = _table_launch()
    host = np.zeros(4, dtype=np.int64)
    cols, params = [np.arange(2), np.arange(2)], [1 << 40, 1, 2, 0]

    class Emptying:
        def __index__(self):
            cols.clear()
            params.clear()
            return 1

    params[1] = Emptying()
    launch(host.ctypes.data, 1 << 40, 32, cols, False, 0x77, 0xF00, 1, 128, 0, params)
    assert [c[0] for c in lib.calls] == ["memcpy", "launch"] and lib.calls[-1][5:] == (1 << 40, 1, 2, 0)
    with pytest.raises(OverflowError):  # the first failed conversion is the one reported
        launch(-1, 1 << 40, 32, (np.arange(2),), SimpleNamespace(), 0x77, 0xF00, 1, 128, 0, ())


@pytest.mark.parametrize("compiled_launch", [True, False], ids=["compiled", "triton's launcher"])
def test_one_off_table_memory_is_held_when_the_launch_fails(monkeypatch, compiled_launch):
    """A ring full of pending tables gives a table one-off memory; a launch that fails after its
    upload was enqueued still leaves that memory to `held`, which outlives the copies."""
    from test_cuda_launch import EveryKey, TritonLike

    from offload_core.backends.cuda.ring import DescriptorRing

    fake = RingDevice()

    def failing_launch(*args):
        raise drv.CudaDriverError("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED", 719)

    ring = DescriptorRing(fake.torch, None, fake.memcpy, entries=4, launch=failing_launch if compiled_launch else None)
    monkeypatch.setattr(ring, "device_address", lambda: 1 << 40)
    monkeypatch.setattr(kernels, "_compile", lambda: (None, None, "expand"))
    monkeypatch.setattr(kernels, "_compiled", {})

    def launch(*args, **kwargs):
        raise drv.CudaDriverError("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED", 719)

    monkeypatch.setattr(kernels, "_launch", launch)
    if compiled_launch:  # a build found: the compiled call is taken
        monkeypatch.setattr(kernels, "_compiled", EveryKey(TritonLike(LaunchingLib())))
        monkeypatch.setattr(kernels, "_raw", {})
    held: list = []
    cols = (np.arange(8), np.arange(8))  # 16 entries: more than the ring holds
    with pytest.raises(drv.CudaDriverError, match="cuLaunchKernel failed"):
        kernels.expand(
            ring,
            cols,
            8,
            1 << 41,
            8,
            1 << 42,
            1,
            8,
            True,
            1024,
            SimpleNamespace(cuda_stream=7),
            4,
            (1 << 43, 64, True),
            False,
            held,
        )
    assert len(held) == 1 and len(held[0]) == 2, "the one-off host and device memory stay held"


def test_a_torch_stream_waits_for_a_raw_streams_position_and_back():
    lib = FakeLib()
    driver = drv.Driver(lib)
    made = []

    def new_event():
        made.append(DriverEvent(driver, GPU_CONTEXT))
        return made[-1]

    class TorchLikeStream:  # torch's Stream.wait_stream and record_event, as torch implements them
        cuda_stream = 0x61

        def wait_event(self, event):
            event.wait(self)

        def wait_stream(self, stream):
            self.wait_event(stream.record_event())

        def record_event(self):
            raise AssertionError("a RawStream records its own events on the other stream")

    TorchLikeStream().wait_stream(RawStream(0x62, new_event))
    assert lib.calls[-2:] == [("record", made[0].handle, 0x62), ("wait", 0x61, made[0].handle, 0)]
    RawStream(0x62, new_event).wait_stream(TorchLikeStream())
    assert lib.calls[-2:] == [("record", made[1].handle, 0x61), ("wait", 0x62, made[1].handle, 0)]


@pytest.mark.parametrize(
    "key, text, rule",
    [
        ("sm_penalty", "0", "a positive number"),
        ("sm_penalty", "-1", "a positive number"),
        ("sm_penalty", "inf", "a positive number"),
        ("sm_penalty", "nan", "a positive number"),
        ("sm_penalty", "two", "a positive number"),
        ("sm_penalty", "1e400", "a positive number"),
        ("sm_programs", "0", "a positive integer"),
        ("sm_programs", "2.5", "a positive integer"),
        ("sm_programs", "1e3", "a positive integer"),
        ("staging_mb", "-24", "a positive integer"),
        ("ring_mb", "0", "a positive integer"),
        ("max_batch", "-1", "a non-negative integer"),
        ("max_batch", "many", "a non-negative integer"),
    ],
)
def test_a_setting_outside_its_values_is_refused_by_name(monkeypatch, key, text, rule):
    from offload_core import ConfigError

    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", f"{key}:{text}")
    with pytest.raises(ConfigError, match=f"OFFLOAD_CORE_CUDA_CONF {key} must be {rule}, got {text!r}"):
        host_only_backend(monkeypatch, FakeLib())


@pytest.mark.parametrize(
    "conf, message",
    [
        ("staging_mb=8", "'staging_mb=8' is not key:value"),
        ("staging:8", "'staging:8' has an unknown key; keys: mechanism, sm_programs"),
        ("posted:1", "'posted:1' has an unknown key; keys: "),  # posted mode was removed
        ("ring_mb:4, ring_mb:8", "'ring_mb:8' names a key twice"),
    ],
)
def test_a_malformed_conf_is_refused_by_name(monkeypatch, conf, message):
    from offload_core import ConfigError

    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", conf)
    with pytest.raises(ConfigError, match=f"OFFLOAD_CORE_CUDA_CONF: {message}"):
        host_only_backend(monkeypatch, FakeLib())


def test_a_variable_of_earlier_versions_is_refused_rather_than_ignored(monkeypatch):
    from offload_core import ConfigError

    monkeypatch.setenv("OFFLOAD_CORE_CUDA_STAGING_MB", "8")
    with pytest.raises(ConfigError, match="OFFLOAD_CORE_CUDA_STAGING_MB is no longer read: set OFFLOAD_CORE_CUDA_CONF"):
        host_only_backend(monkeypatch, FakeLib())


def test_settings_come_from_the_conf_and_default_where_unset_or_empty(monkeypatch):
    backend = host_only_backend(monkeypatch, FakeLib())
    assert backend.sm_programs == {Direction.STORE: 8, Direction.LOAD: 32}
    assert (backend.staging_bytes, backend.max_batch, backend._ring.entries) == (16 << 20, 0, 2 << 20)
    assert backend.cost.sm_penalty == CostModel().sm_penalty
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_programs:16, staging_mb:8,max_batch: 5 ,sm_penalty:3.5,ring_mb:4")
    backend = host_only_backend(monkeypatch, FakeLib())
    assert backend.sm_programs == {Direction.STORE: 16, Direction.LOAD: 16}
    assert (backend.staging_bytes, backend.max_batch, backend._ring.entries) == (8 << 20, 5, 1 << 19)
    assert backend.cost.sm_penalty == 3.5
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_penalty:")
    assert host_only_backend(monkeypatch, FakeLib()).cost.sm_penalty == CostModel().sm_penalty


def test_auto_is_measured_by_default_and_the_conf_can_turn_it_off(monkeypatch, tmp_path):
    from offload_core import ConfigError
    from offload_core.backends.cuda import calibration
    from offload_core.backends.cuda.tuning import ShapeClass

    monkeypatch.setenv("OFFLOAD_CORE_PROFILE_DIR", str(tmp_path))
    backend = host_only_backend(monkeypatch, FakeLib(), tune=None)
    tuner = backend._blocks.tuner
    assert tuner is not None and tuner.path.parent == tmp_path and tuner.path.name.endswith("-tuned.json")
    # a calibration changes the prior: what was decided under the old one is measured again
    key = ShapeClass("store", 12, 15, 9, False)
    tuner._saved[key] = "expand_direct"
    monkeypatch.setattr(calibration, "calibrate", lambda backend, save: {"saved": save})
    assert backend.calibrate(save=False) == {"saved": False}
    assert tuner.decided(key) is None
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "tune:0")
    assert host_only_backend(monkeypatch, FakeLib(), tune=None)._blocks.tuner is None
    assert host_only_backend(monkeypatch, FakeLib(), tune=True)._blocks.tuner is not None  # the argument wins
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "tune:2")
    with pytest.raises(ConfigError, match="must be 0 or 1, got 2"):
        host_only_backend(monkeypatch, FakeLib(), tune=None)


def test_kernels_that_copy_across_the_link_get_the_programs_of_their_direction(monkeypatch):
    launched = []
    monkeypatch.setattr(kernels, "launch", lambda src, dst, sizes, stream, programs, *rest: launched.append(programs))
    backend = host_only_backend(monkeypatch, FakeLib(), mechanism="sm_gather")
    monkeypatch.setattr(backend, "addressable", lambda *args: True)
    dst, src, sizes = arrays(2)
    for direction in (Direction.STORE, Direction.LOAD):
        backend.enqueue_with("sm_gather", src, dst, sizes, direction, SimpleNamespace(cuda_stream=1))
    assert launched == [8, 32]


def test_expand_direct_takes_the_programs_of_its_direction(monkeypatch):
    from offload_core.backends.cuda.blocks import BlockCopier
    from offload_core.backends.cuda.mechanisms import TABLE

    class Job:
        host_ids = np.array([3, 1])
        blocks = np.zeros((5, 2), dtype=np.int64)
        nbytes, jobs = 16 << 20, 2  # 8 MiB jobs: all of a store's programs
        layout = SimpleNamespace(largest=4096, smallest=4096, row_bytes=4096)

        def __init__(self, direction):
            self.direction = direction

        def __len__(self):
            return 2

    expanded = []
    copier = BlockCopier(host_only_backend(monkeypatch, FakeLib()), 24 << 20)
    copier.expand = lambda job, prepared, b0, b1, stream, held, programs, stage=None: expanded.append(
        (b0, b1, programs, stage)
    )
    prepared = SimpleNamespace(
        layout=SimpleNamespace(host_base=1000, row_bytes=10), whole_rows=dict.fromkeys(Direction, True)
    )
    for direction in (Direction.STORE, Direction.LOAD):
        TABLE["expand_direct"].enqueue_job(copier, Job(direction), prepared, None, None, [], [])
    assert expanded == [(0, 2, 8, None), (0, 2, 32, None)]
    small = Job(Direction.STORE)
    small.nbytes, small.layout = 2 << 20, SimpleNamespace(largest=1024, smallest=1024, row_bytes=1024)  # 1 KiB pages
    TABLE["expand_direct"].enqueue_job(copier, small, prepared, None, None, [], [])
    assert expanded[-1] == (0, 2, 2, None)


@pytest.mark.parametrize(
    "argument, value, rule",
    [
        ("max_programs", 0, "a positive integer"),
        ("max_programs", -4, "a positive integer"),
        ("max_programs", 2.5, "a positive integer"),
        ("max_programs", True, "a positive integer"),
        ("staging_bytes", -1, "a positive integer"),
        ("ring_bytes", 0, "a positive integer"),
        ("max_batch", -7, "a non-negative integer"),
    ],
)
def test_a_constructor_setting_outside_its_values_is_refused_by_name(monkeypatch, argument, value, rule):
    from offload_core import ConfigError
    from offload_core.backends.cuda import CudaBackend

    with pytest.raises(ConfigError, match=f"{argument} must be {rule}, got {value!r}"):
        CudaBackend(driver=drv.Driver(FakeLib()), runtime=FakeCudaRuntime(), **{argument: value})


def test_a_constructor_setting_wins_over_the_environment(monkeypatch):
    from offload_core.backends.cuda import CudaBackend

    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_programs:4,max_batch:9,ring_mb:4")
    backend = CudaBackend(
        driver=drv.Driver(FakeLib()), runtime=FakeCudaRuntime(), max_programs=12, max_batch=0, ring_bytes=800
    )
    assert backend.sm_programs == {Direction.STORE: 12, Direction.LOAD: 12}
    assert backend.max_batch == 0 and backend._ring.entries == 100


def host_prepared(layout):
    """What `BlockCopier.prepare` gives, without a device: the tables' addresses are 0."""
    return SimpleNamespace(
        layout=layout,
        entries=SimpleNamespace(data_ptr=lambda: 0),
        groups=SimpleNamespace(data_ptr=lambda: 0),
        entry_count=layout.entries.shape[1],
        group_count=layout.group_entries.shape[1],
        per_block=layout.max_entries,
        narrow=cuda_blocks.narrow_ids(layout),
    )


def _as_uploaded(cols, narrow: bool) -> np.ndarray:
    """A table's columns as `DescriptorRing.upload` writes them (int32 where `narrow`), read
    back as the kernel's loads widen them: an id that int32 cannot hold comes back wrong."""
    return np.concatenate(cols).astype(np.int32 if narrow else np.int64).astype(np.int64)


def kernel_reading(table: np.ndarray, n: int, rows, layout, store: bool):
    """The copies the expansion kernel makes of a block table (`kernels.expand`'s contract), in
    numpy: block by block, entry by entry, the entries a store does not elect left out."""
    dev_id = table[:n]
    if rows is None:
        row, sub, page, g = (table[k * n : (k + 1) * n] for k in range(1, 5))
    else:
        base, step, by_host = rows
        page = table[n : 2 * n]
        row = base + step * (page if by_host else np.arange(n))
        sub = g = np.zeros(n, dtype=np.int64)
    e = layout.entries
    dev, side, size = [], [], []
    for b in range(n):
        first, count = layout.group_entries[:, g[b]]
        for k in range(first, first + count):
            mine = not store or e[6, k] == 1 or page[b] % e[6, k] == e[7, k]
            if mine:
                dev.append(e[0, k] + dev_id[b] * e[1, k] + e[2, k])
                side.append(row[b] + e[3, k] + sub[b] * e[4, k])
                size.append(e[5, k])
    return [np.array(x, dtype=np.int64) for x in (dev, side, size)]


@pytest.mark.parametrize("shape", ["simple", "simple, elected", "chunks of two", "two groups"])
@pytest.mark.parametrize("stage", [None, 1 << 40], ids=["host rows", "staging"])
@pytest.mark.parametrize("direction", list(Direction))
def test_the_kernels_block_table_names_the_reference_copies(monkeypatch, shape, stage, direction):
    """What `BlockCopier.expand` uploads, read as the kernel reads it, gives the reference's copies
    (`CompactLayout.descriptors`): a simple job's two columns with the rows found from the host
    ids or the block index, and the five columns of the others."""
    from test_plan import Model

    from offload_core import DeviceBlocks, HostBlocks
    from offload_core.backends.cuda import blocks as cuda_blocks
    from offload_core.canonical import CanonicalPageMapping, CopyRun
    from offload_core.compact import CompactLayout
    from offload_core.plan import Planner

    bpc = 2 if shape == "chunks of two" else 1
    if shape == "two groups":
        model = Model([16, 24], [[(0, 16)], [(1, 24)]], bpc, 64, 64)
        device, host = DeviceBlocks([5, 9, 2, 40, 7], [2, 3]), HostBlocks([11, 3, 60, 8, 0])
    elif shape == "simple, elected":
        mapping = CanonicalPageMapping(128, 64, (CopyRun(0, 0, 64),), num_writers=2, writer_index=1)
        model = Model([128], [[(0, 64, mapping)]], 1, 64, 64)
        device, host = DeviceBlocks([5, 9, 2, 40, 7]), HostBlocks([11, 3, 60, 8, 0])
    else:
        model = Model([16], [[(0, 16)]], bpc, 64, 64)
        device = DeviceBlocks([5, 9, 2, 40, 7], block_indices=[1] if bpc == 2 else None)
        host = HostBlocks([11, 3, 60] if bpc == 2 else [11, 3, 60, 8, 0])
    layout = CompactLayout(Planner(model.geometry), compiled=False)
    job = layout.job(direction, device, host)
    assert job.simple == shape.startswith("simple")
    launched = []

    def expand(*args):  # `kernels.expand`: the table as it goes up (int32 where narrow)
        launched.append(args)

    monkeypatch.setattr(cuda_blocks.kernels, "expand", expand)
    copier = cuda_blocks.BlockCopier.__new__(cuda_blocks.BlockCopier)
    ring = object()
    copier.backend = SimpleNamespace(_ring=ring, device_index=0)
    prepared = host_prepared(layout)
    copier.expand(job, prepared, 0, len(job), None, [], 4, stage)
    (args,) = launched
    uploaded = [_as_uploaded(a[1], a[13]) for a in launched]
    assert args[0] is ring and args[2] == len(job) and args[8] == (direction is Direction.STORE)
    assert args[13] == job.simple  # simple jobs' ids go up as int32 (this layout's counts allow it)
    got = kernel_reading(uploaded[0], len(job), args[12], layout, direction is Direction.STORE)
    want = layout.descriptors(job, stage)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert uploaded[0].size == (2 if job.simple else 5) * len(job)
    if stage is not None and shape in ("simple", "chunks of two"):  # a piece: blocks 2..4, chunk 2 (1) at stage
        chunk = 2 // bpc
        copier.expand(job, prepared, 2, 5, None, [], 4, stage - chunk * layout.row_bytes)
        second = launched[1]
        got = kernel_reading(_as_uploaded(second[1], second[13]), 3, second[12], layout, direction is Direction.STORE)
        per = int(layout.group_entries[1, 0])
        for g, w in zip(got, layout.descriptors(job, stage - chunk * layout.row_bytes)):
            np.testing.assert_array_equal(g, w[2 * per : 5 * per])


@pytest.mark.parametrize("ring", [1 << 20, 1 << 40], ids=["32-bit", "64-bit"])
def test_a_layouts_warm_up_launches_are_of_its_jobs_kinds(monkeypatch, ring):
    """Triton builds a kernel per set of constexprs and per type of each int argument (whether it
    fits 32 bits), and the first launch of a build loads it, which waits for the device to go
    idle. `prepare` must launch every build a job will use, so that no job waits for that."""
    from test_plan import Model

    from offload_core import DeviceBlocks, HostBlocks
    from offload_core.compact import CompactLayout
    from offload_core.plan import Planner

    launched = []

    def launch(kernel, programs, args, constexprs, stream, key_args=None, device=0, warps=4):
        key_args = args if key_args is None else key_args  # what the build is found by
        launched.append((warps, tuple(constexprs.items()), tuple(-(1 << 31) <= a < (1 << 31) for a in key_args)))

    monkeypatch.setattr(kernels, "_compile", lambda: (None, None, "expand"))
    monkeypatch.setattr(kernels, "_launch", launch)
    backend = host_only_backend(monkeypatch, FakeLib())
    # the ring's device memory, where every job's table lies, at an address of either kind (the
    # warm-up once passed another table, a CPU heap's in this test: on the H200 it fitted 32 bits)
    backend._ring = SimpleNamespace(
        upload=lambda cols, stream, held, split=0, narrow=False: [ring], device_address=lambda: ring, launches=False
    )
    for simple in (True, False):
        model = Model([16], [[(0, 16)]], 1 if simple else 2, 64, 64)
        planner = Planner(model.geometry)
        planner.host_base = 0x7F00_0000_0000  # where pinned host memory lies
        layout = CompactLayout(planner)
        prepared = backend._blocks.prepare(layout)
        warmed, launched[:] = set(launched), []
        for direction in Direction:
            job = layout.job(direction, DeviceBlocks([5, 9, 2]), HostBlocks([11, 3, 60] if simple else [11, 3]))
            assert job.simple == simple
            for stage in (None, prepared.entries.data_ptr() + 4096):
                backend._blocks.expand(job, prepared, 0, len(job), SimpleNamespace(cuda_stream=7), [], 4, stage)
        assert launched and set(launched) <= warmed, "a job's launch that prepare did not warm up"


@pytest.mark.parametrize(
    "bpc, backwards", [(1, False), (2, False), (1, True)], ids=["simple", "chunks of two", "simple, rows backwards"]
)
@pytest.mark.parametrize("direction", list(Direction))
def test_staged_jobs_cut_into_pieces_move_the_reference_bytes(monkeypatch, bpc, backwards, direction):
    """`expand_staged` over halves of three host rows: the job goes in pieces, segments of
    consecutive host rows are cut at the pieces' edges, and the halves alternate. The kernel
    and the batch call run at once, on the CPU (the kernel as `kernel_reading` reads its table),
    over a model's real memory: the bytes must be the reference model's. Host rows in runs
    backwards go in host order (`CompactJob.in_host_order`), as the queue's launch sends them."""
    from test_plan import Model

    from offload_core import DeviceBlocks, HostBlocks
    from offload_core.backends.cuda import blocks as cuda_blocks
    from offload_core.compact import CompactLayout
    from offload_core.plan import Planner

    model = Model([16, 8], [[(0, 16), (1, 8)]], bpc, 32, 24, seed=bpc)
    layout = CompactLayout(Planner(model.geometry))
    row = layout.row_bytes
    store = direction is Direction.STORE
    half_bytes = 3 * row
    staging = np.full(2 * half_bytes, 0xA5, dtype=np.uint8)
    pieces = []

    regions = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in (staging, model.host, *model.backing)]

    def move(dst, src, sizes):
        for d, s, n in zip(np.asarray(dst).tolist(), np.asarray(src).tolist(), np.asarray(sizes).tolist()):
            for a in (d, s):  # a copy outside the buffers fails the test, not the process
                assert any(lo <= a and a + n <= hi for lo, hi in regions), f"a copy of {n} bytes at {a:#x}"
            ctypes.memmove(d, s, n)

    def expand(
        ring,
        cols,
        n,
        entries,
        num_entries,
        groups,
        num_groups,
        per_block,
        is_store,
        largest,
        stream,
        programs,
        rows,
        narrow,
        held,
        device,
    ):
        pieces.append(n)
        dev, side, sizes = kernel_reading(_as_uploaded(cols, narrow), n, rows, layout, is_store)
        half = st.halves[st.next ^ 1]  # the half this piece took
        assert ((side >= half) & (side + sizes <= half + half_bytes)).all(), "the kernel left its half"
        move(side, dev, sizes) if is_store else move(dev, side, sizes)

    class Event:
        def record(self, stream):
            pass

    stream = SimpleNamespace(cuda_stream=7, wait_event=lambda event: None)
    st = SimpleNamespace(
        halves=[staging.ctypes.data, staging.ctypes.data + half_bytes],
        free=[Event(), Event()],
        next=0,
        side=SimpleNamespace(cuda_stream=8, wait_event=lambda event: None),
        ready=Event(),
    )
    monkeypatch.setattr(cuda_blocks.kernels, "expand", expand)
    copier = cuda_blocks.BlockCopier.__new__(cuda_blocks.BlockCopier)
    copier.half_bytes = half_bytes
    copier.staging = SimpleNamespace(for_stream=lambda s: st)
    copier.backend = SimpleNamespace(
        _ring=None,
        device_index=0,
        gather_programs=4,
        driver=SimpleNamespace(
            memcpy_batch_async=lambda dst, src, sizes, order, handle, max_batch=0, held=None: (
                move(dst, src, sizes) or ()
            )
        ),
    )
    prepared = host_prepared(layout)
    hosts = [3, 4, 5, 6, 7, 20, 21, 9] if bpc == 1 else [3, 4, 5, 6, 20]  # runs of rows across the cuts
    if backwards:
        hosts = [7, 6, 5, 4, 3, 21, 20, 9]
    dev_ids = [5, 9, 2, 30, 17, 11, 0, 22] if bpc == 1 else [5, 9, 2, 30, 17, 11, 0, 22, 13]
    device, host = DeviceBlocks(dev_ids, block_indices=[bpc - 1]), HostBlocks(hosts)
    job = layout.job(direction, device, host)
    assert job.simple == (bpc == 1)
    if backwards:
        job = job.in_host_order()
        assert job.host_ids.tolist() == sorted(hosts) and layout.segments(job)[2].size == 3
    want_dev, want_host = model.expected(direction, device, host)
    held = Held()
    cuda_blocks.EXPAND_STAGED.enqueue_job(copier, job, prepared, layout.segments(job), stream, [], held)
    assert held.sides == [], "the side stream left listed though every piece joined it"
    assert len(pieces) == -(-len(hosts) // 3), "not cut into pieces of three rows"
    if store:
        np.testing.assert_array_equal(model.host, want_host)
    else:
        for got, want in zip(model.device, want_dev):
            np.testing.assert_array_equal(got, want)


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=12),
    st.lists(st.integers(1, 120), max_size=5),
)
def test_segments_split_at_piece_cuts_cover_the_same_bytes_and_cross_none(gaps_and_sizes, cut_points):
    """`blocks._split` against the bytes themselves: every byte of every segment, at its host
    address, once; no segment runs across a cut; staging order kept."""
    from offload_core.backends.cuda.blocks import _split

    stage, at = [], 0
    for gap, size in gaps_and_sizes:
        stage.append(at + gap)
        at += gap + size
    stage = np.array(stage, dtype=np.int64)
    sizes = np.array([size for _, size in gaps_and_sizes], dtype=np.int64)
    host = np.arange(stage.size, dtype=np.int64) * 1000 + 7  # any host place per segment
    cuts = np.array(sorted(set(cut_points)), dtype=np.int64)
    s, h, n = _split(stage, host, sizes, cuts)

    def bytes_of(stage, host, sizes):
        return sorted((int(a) + i, int(b) + i) for a, b, k in zip(stage, host, sizes) for i in range(int(k)))

    assert bytes_of(s, h, n) == bytes_of(stage, host, sizes)
    assert (np.diff(s) > 0).all() and (n > 0).all()
    assert not any(a < c < a + k for a, k in zip(s.tolist(), n.tolist()) for c in cuts.tolist())


def staged_job(monkeypatch, direction):
    """A backend over the stand-in driver, with a layout of 3-row staging halves, a job of eight
    blocks over host rows in runs and apart, its prepared tables and a queue stream: what
    `expand_staged`'s tests enqueue. Returns (lib, backend, layout, prepared, stream, job)."""
    import torch
    from test_plan import Model

    from offload_core import DeviceBlocks, HostBlocks
    from offload_core.compact import CompactLayout
    from offload_core.plan import Planner

    class Stream:  # what a torch stream's wait_event does with any event
        def __init__(self, handle):
            self.cuda_stream = handle

        def wait_event(self, event):
            event.wait(self)

    monkeypatch.setattr(FakeCudaRuntime, "ExternalStream", lambda self, handle, device=None: Stream(handle))
    # staging is allocated under torch's stream context, which a CUDA build of torch would apply
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib)
    monkeypatch.setattr(kernels, "expand", lambda *args, **kwargs: lib.calls.append(("kernel",)))
    model = Model([16, 8], [[(0, 16), (1, 8)]], 1, 32, 24)
    layout = CompactLayout(Planner(model.geometry))
    backend._blocks.half_bytes = 3 * layout.row_bytes  # three pieces of three rows, the last of two
    ring = 1 << 40
    backend._ring = SimpleNamespace(
        device_address=lambda: ring,
        upload=lambda cols, stream, held, split=0, narrow=False: [ring],
        retire=lambda event, regions=None: None,
        open=lambda: [],
    )
    prepared = backend._blocks.prepare(layout)
    stream = backend.new_stream()
    job = layout.job(direction, DeviceBlocks([5, 9, 2, 30, 17, 11, 0, 22]), HostBlocks([3, 4, 5, 6, 7, 20, 21, 9]))
    return lib, backend, layout, prepared, stream, job


@pytest.mark.parametrize("direction", list(Direction))
def test_staging_halves_hand_over_through_driver_markers(monkeypatch, direction):
    """`expand_staged`'s pieces hand a staging half from the kernel to the copies and back through
    the backend's untimed driver events, alternating halves: a store's piece waits until its
    half's last copies passed, gathers, and its copies wait for the gather; a load's the other
    way round."""
    from offload_core.backends.cuda import blocks as cuda_blocks

    lib, backend, layout, prepared, stream, job = staged_job(monkeypatch, direction)
    lib.calls.clear()
    cuda_blocks.EXPAND_STAGED.enqueue_job(backend._blocks, job, prepared, layout.segments(job), stream, [], Held())
    halves = backend._blocks.staging.for_stream(stream)
    assert all(isinstance(e, DriverEvent) for e in (*halves.free, halves.ready))
    assert [c for c in lib.calls if c[0] == "event_create"] == [("event_create", 2)] * 3  # untimed markers
    free, ready = [e.handle for e in halves.free], halves.ready.handle
    names = {free[0]: "free0", free[1]: "free1", ready: "ready"}
    calls = [c for c in lib.calls if c[0] in ("kernel", "batch", "record", "wait")]
    steps = [
        c[0] if len(c) == 1 or c[0] == "batch" else (c[0], names[c[1] if c[0] == "record" else c[2]]) for c in calls
    ]
    piece = {
        Direction.STORE: lambda h: [
            ("wait", h),
            "kernel",
            ("record", "ready"),
            ("wait", "ready"),
            "batch",
            ("record", h),
        ],
        Direction.LOAD: lambda h: [
            ("wait", h),
            "batch",
            ("record", "ready"),
            ("wait", "ready"),
            "kernel",
            ("record", h),
        ],
    }[direction]
    assert steps == piece("free0") + piece("free1") + piece("free0")


@pytest.mark.parametrize("mechanism", ["ce_batch", "ce_loop"])
def test_a_thread_that_made_no_cuda_call_yet_enqueues_in_the_gpus_context(monkeypatch, mechanism):
    """A queue's launcher thread, or any new thread of the engine's, has no context current until
    it makes a runtime call: its first enqueue must make the GPU's current, or the driver fails
    its copies (the batch call with INVALID_VALUE, as staged loads from a launcher thread did on
    the H200). Once per thread: the runtime is asked again only on a new one."""
    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib)
    dst, src, sizes = arrays(3)
    asked = []
    query = backend.runtime._call
    monkeypatch.setattr(backend.runtime, "_call", lambda: asked.append(threading.get_ident()) or query())
    done, alive = [], threading.Barrier(2)  # both alive to the end: the stand-in tells threads by their idents

    def enqueue():
        fresh = not lib.contexts
        for _ in range(2):
            backend.enqueue_with(mechanism, src, dst, sizes, Direction.LOAD, SimpleNamespace(cuda_stream=9))
        done.append((fresh, lib.contexts[-1]))
        alive.wait(10)

    threads = [threading.Thread(target=enqueue) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert done == [(True, GPU_CONTEXT)] * 2
    assert len(copies(lib)) == (2 if mechanism == "ce_batch" else 6) * 2
    assert len(asked) == 2 and asked[0] != threading.get_ident()  # once a thread


def test_a_split_job_that_fails_part_way_still_ends_after_its_direct_part(monkeypatch):
    """The direct half runs on a stream of its own: where the staged rest fails to enqueue, the
    queue's stream must still wait for it, or the job's end event (and the tables it holds)
    would pass while the kernel still writes host rows."""
    from offload_core.backends.cuda import blocks

    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append(f"{self.name} waits {event.name}")

    class Event:
        def __init__(self, name):
            self.name = name

        def record(self, stream):
            log.append(f"{self.name} on {stream.name}")

    class Copier(blocks.BlockCopier):
        def __init__(self):
            self.backend = SimpleNamespace(sm_programs={Direction.STORE: 8})
            self.st = SimpleNamespace(direct=Stream("direct"), direct_go=Event("go"), direct_done=Event("done"))
            self.staging = SimpleNamespace(for_stream=lambda stream: self.st)

        def expand(self, job, prepared, b0, b1, stream, held, programs, stage=None):
            log.append(f"blocks {b0}-{b1} on {stream.name}, {programs} programs")

    class Failing(blocks.ExpandStaged):
        def enqueue_job(self, *args):
            raise RuntimeError("cuMemcpyBatchAsync failed")

    job = SimpleNamespace(direction=Direction.STORE, simple=True, host_ids=np.arange(8), tail=lambda k: "rest")
    prepared = SimpleNamespace(layout=SimpleNamespace(segments=lambda job: None))
    monkeypatch.setattr(blocks, "EXPAND_STAGED", Failing())
    held = Held()
    with pytest.raises(RuntimeError, match="failed"):
        blocks.EXPAND_SPLIT.enqueue_job(Copier(), job, prepared, None, Stream("queue"), [], held)
    assert log == [
        "go on queue",
        "direct waits go",
        "blocks 0-4 on direct, 2 programs",
        "done on direct",
        "queue waits done",
    ]
    # still listed: `_enqueued` joins it again (its own join may have been what was cut short)
    assert [side.name for side in held.sides] == ["direct"]


def test_a_lowered_penalty_keeps_launches_it_would_split_from_the_joined_direct_launch(monkeypatch):
    """Rows of at most 32 KiB (1 KiB pages over 32 tensors) are offered to the compiled joined
    launch, which only ever launches expand_direct: where `choose` would split, it must decline."""
    monkeypatch.setattr(cuda_blocks.kernels, "raw_expansion", lambda *args: ("raw",))
    job, prepared = _launch(Direction.STORE, 2 << 20, 1, row_bytes=32 << 10, tensors=32)
    job.dev_ids = np.empty(job.host_ids.size)
    address = SimpleNamespace(data_ptr=lambda: 0)
    layout = prepared.layout
    layout.host_base = 0
    prepared = SimpleNamespace(
        layout=layout, whole_rows=prepared.whole_rows, join_backoff={d: [0, 0] for d in Direction},
        entries=address, groups=address, entry_count=32, group_count=1, per_block=32, narrow=True,
    )  # fmt: skip
    plans = {}
    for penalty in (2.0, 1.0):
        copier = _copier(penalty=penalty)
        copier.backend._ring, copier.backend.device_index = SimpleNamespace(joins=True), 0
        plans[penalty] = (copier.choose(job, prepared).name, copier.join_plan([job, job], prepared))
    assert plans[2.0][0] == "expand_direct" and plans[2.0][1] is not None
    assert plans[1.0] == ("expand_split", None)


@pytest.mark.parametrize("direction", list(Direction))
def test_staged_copies_of_host_rows_wait_for_the_hazards_ends(monkeypatch, direction):
    """A hazard's end (another lane's job on the same host blocks, `TransferQueue.end_of`) is in
    `after` and in `job.host_after`: `expand_staged`'s first copy between host rows and staging
    follows it on whatever stream it runs (a load's go on the side stream)."""
    from offload_core.backends.cuda import blocks as cuda_blocks
    from offload_core.backends.cuda.staging import Held

    lib, backend, layout, prepared, stream, job = staged_job(monkeypatch, direction)
    hazard = backend.new_event()
    hazard.record(backend.new_stream())
    job.host_after = (hazard,)
    lib.calls.clear()
    cuda_blocks.EXPAND_STAGED.enqueue_job(
        backend._blocks, job, prepared, layout.segments(job), stream, [hazard], Held()
    )
    first = next(i for i, c in enumerate(lib.calls) if c[0] == "batch")
    on = lib.calls[first][-1]  # the stream of the first copy between host rows and staging
    # (the fake driver gives every stream one handle: a wait on the hazard after the queue's own
    # is the side stream's)
    waited = [c for c in lib.calls[1:first] if c[0] == "wait" and c[2] == hazard.handle and c[1] == on]
    assert waited, f"{direction.value}: the first host copy does not follow the hazard"
