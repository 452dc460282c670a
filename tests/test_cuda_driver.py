"""The cuda backend's driver layer without a GPU: the ctypes ABI, batched copies, streams and
events in the GPU's context, and the compiled calls of `_driver` (`cuda_fakes.FakeLib` stands in
for libcuda)."""

from __future__ import annotations

import ctypes
import gc
import os
from types import SimpleNamespace

import numpy as np
import pytest
from cuda_fakes import GPU_CONTEXT, FakeLib, arrays, compiled_table_launch, host_only_backend
from helpers import compiled_or_skip

from offload_core.backends.cuda import driver as drv
from offload_core.backends.cuda.events import DriverEvent, RawStream


@pytest.fixture(autouse=True)
def _no_cuda_settings(monkeypatch):
    """Each test starts from the defaults, whatever the shell that runs it has set."""
    for name in [n for n in os.environ if n.startswith("OFFLOAD_CORE_CUDA_")]:
        monkeypatch.delenv(name)


# ---- the driver through ctypes ------------------------------------------------------------------


def test_memcpy_attributes_has_the_driver_layout():
    assert ctypes.sizeof(drv.CUmemcpyAttributes) == 24
    assert drv.CUmemcpyAttributes.srcLocHint.offset == 4
    assert drv.CUmemcpyAttributes.dstLocHint.offset == 12
    assert drv.CUmemcpyAttributes.flags.offset == 20


def test_batch_passes_destinations_first_and_one_attribute_set():
    lib = FakeLib()
    dst, src, sizes = arrays(5)
    drv.Driver(lib).memcpy_batch_async(dst, src, sizes, drv.SRC_ACCESS_ORDER_ANY, stream=0x1234)
    ((_, d, s, n, order, first_idx, num_attrs, stream),) = lib.calls
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


def test_streams_are_created_non_blocking():
    lib = FakeLib()
    assert drv.Driver(lib).new_stream() == 0xBEEF
    assert lib.calls == [("stream_create", drv.STREAM_NON_BLOCKING)]


def test_missing_driver_library_is_an_os_error(monkeypatch):
    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(drv.ctypes, "CDLL", no_lib)
    with pytest.raises(OSError):
        drv.Driver.load()


@pytest.mark.parametrize(
    "symbol, name", [("cuMemcpyAsync", "memcpy"), ("cuEventRecord", "event_record"), ("cuCtxPopCurrent", "ctx_pop")]
)
def test_a_driver_without_an_entry_point_the_backend_calls_is_an_os_error_naming_it(symbol, name):
    lib = FakeLib()
    del lib._keep[symbol]
    with pytest.raises(OSError, match=f"lacks entry points the cuda backend needs: {name}"):
        drv.Driver(lib)


# ---- driver events, and the compiled calls in the GPU's context ----------------------------------


@pytest.fixture(params=[True, False], ids=["compiled", "ctypes"])
def event_calls(request, monkeypatch):
    """An event's record and query through the compiled extension (skipped where it was not
    built) or through ctypes: both must call the driver alike."""
    compiled_or_skip(request.param, drv.COMPILED)
    if not request.param:
        monkeypatch.setenv("OFFLOAD_CORE_NATIVE", "0")
    return request.param


@pytest.mark.parametrize(
    "current", [[GPU_CONTEXT], [], [0xC1]], ids=["the GPU's context", "no context", "another GPU's context"]
)
def test_driver_events_run_in_their_gpus_context_and_leave_the_threads_alone(current, event_calls):
    """Recorded, waited for, queried and timed on any stream's handle; where the calling thread has
    no context current (it made no CUDA call) or another GPU's, each call pushes the event's
    context and pops it after, also after a failure. A fault reported by a query fails the call."""
    lib = FakeLib()
    driver = drv.Driver(lib)
    event = DriverEvent(driver, GPU_CONTEXT)
    lib.contexts[:] = current
    lib.calls.clear()

    def within(*calls):  # the calls, in the GPU's context
        switch = current != [GPU_CONTEXT]
        return [c for call in calls for c in ([("push", GPU_CONTEXT), call, ("pop",)] if switch else [call])]

    event.record(SimpleNamespace(cuda_stream=0))  # the default stream: the current context's (a null handle)
    RawStream(0x52, None).wait_event(event)
    assert event.query() is True and event.elapsed_time(event) == 1.5
    lib.codes["query"] = [drv.ERROR_NOT_READY]
    assert event.query() is False
    assert lib.calls == within(
        ("record", event.handle, None),
        ("wait", 0x52, event.handle, 0),
        ("query", event.handle),
        ("elapsed", event.handle, event.handle),
        ("query", event.handle),
    )
    assert lib.contexts == current
    other = SimpleNamespace(cuda_stream=0x51)
    for name, call, message in [
        ("query", event.query, "cuEventQuery failed"),
        ("record", lambda: event.record(other), "cuEventRecord failed: CUDA_ERROR_INVALID_VALUE"),
        ("wait", lambda: event.wait(other), "cuStreamWaitEvent failed"),
    ]:
        lib.codes[name] = [700]  # a fault on the device: the result fails, the caller's loop goes on
        with pytest.raises(drv.CudaDriverError, match=message) as failed:
            call()
        assert failed.value.code == 700 and lib.contexts == current, "popped after a failure too"
    gone = DriverEvent(driver, GPU_CONTEXT)
    handle = gone.handle
    del gone
    gc.collect()
    assert ("destroy", handle) in lib.calls


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
    compiled = compiled_or_skip(True, drv.COMPILED)
    with pytest.raises(TypeError, match="6 to 9 arguments"):
        compiled.context_call(1, 2, 3, 4, 5)
    with pytest.raises(TypeError, match="6 to 9 arguments"):
        compiled.context_call(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    with pytest.raises(ValueError, match="address is 0"):
        compiled.context_call(1, 2, 0, 4, 5, 6)
    with pytest.raises(OverflowError):
        compiled.context_call(-1, 2, 3, 4, 5, 6)  # an address, never negative
    with pytest.raises(TypeError):
        compiled.context_call(1, 2, 3, 4, 5, "stream")


def test_the_compiled_context_call_takes_none_for_a_null_context_or_handle():
    compiled = compiled_or_skip(True, drv.COMPILED)
    lib = FakeLib()
    driver = drv.Driver(lib)
    lib.contexts[:] = []  # no context current: a null one is what is asked for, so nothing is pushed
    address = lambda name: ctypes.cast(lib._keep[name], ctypes.c_void_p).value  # noqa: E731
    entry = [address(n) for n in ("cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuEventRecord")]
    assert compiled.context_call(*entry, None, 0xE5, None) == 0
    assert lib.calls == [("record", 0xE5, None)]
    assert driver.record_in is not None


@pytest.mark.parametrize("narrow", [False, True], ids=["int64", "int32"])
def test_the_compiled_table_launch_uploads_then_launches_in_the_gpus_context(narrow):
    lib, launch = compiled_table_launch()
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
    lib, launch = compiled_table_launch()
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
    lib, launch = compiled_table_launch(lib)  # resolves the failing push
    del lib.calls[:]
    with pytest.raises(drv.CudaDriverError, match="cuCtxPushCurrent failed"):
        launch(*args)
    assert lib.calls == [], "neither the copy nor the launch ran"


def test_the_compiled_table_launch_refuses_what_would_overrun_having_called_nothing():
    lib, launch = compiled_table_launch()
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
    lib, launch = compiled_table_launch()
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
    assert RawStream(0x62, None) == RawStream(0x62, new_event) != RawStream(0x63, None)  # keyed by their handles
    assert hash(RawStream(0x62, None)) == hash(RawStream(0x62, new_event))
