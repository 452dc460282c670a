"""The cuda backend's host side, without a GPU: auto's choices, what each mechanism enqueues, its
fallbacks, settings, and what an enqueue holds until its event passes (also where a Ctrl-C cut it
short). The choosing logic is tested against injected costs and thresholds, never the shipped
(tuned) ones. The driver's own tests: test_cuda_driver.py; kernel launches and the descriptor
ring: test_cuda_launch.py; the tuner: test_cuda_tuning.py."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cuda_fakes import GPU_CONTEXT, FakeCudaRuntime, FakeLib, arrays, copies, host_only_backend
from helpers import Model
from hypothesis import given
from hypothesis import strategies as st

from offload_core import ConfigError, DeviceBlocks, HostBlocks
from offload_core.backend import Direction
from offload_core.backends.cuda import BLOCK_MECHANISMS, MECHANISMS, CudaBackend, kernels, select
from offload_core.backends.cuda import blocks as cuda_blocks
from offload_core.backends.cuda import driver as drv
from offload_core.backends.cuda.blocks import TABLE
from offload_core.backends.cuda.events import DriverEvent
from offload_core.backends.cuda.select import CostModel
from offload_core.backends.cuda.staging import Held
from offload_core.backends.cuda.tuning import winners_path
from offload_core.canonical import CanonicalPageMapping, CopyRun
from offload_core.testing.expanding import descriptors


@pytest.fixture(autouse=True)
def _no_cuda_settings(monkeypatch):
    """Each test starts from the defaults, whatever the shell that runs it has set."""
    for name in [n for n in os.environ if n.startswith("OFFLOAD_CORE_CUDA_")]:
        monkeypatch.delenv(name)


def test_probe_names_a_rocm_build_of_torch_or_a_machine_without_cuda(monkeypatch):
    reason = CudaBackend.probe()
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert "without CUDA" in reason or "is_available() is False" in reason
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert "ROCm (HIP) build" in CudaBackend.probe()


def test_missing_triton_takes_kernel_mechanisms_away(monkeypatch):
    kernels.why_unavailable.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)
    try:
        assert "triton is not importable" in kernels.why_unavailable()
    finally:
        kernels.why_unavailable.cache_clear()


# ---- the cost model: its choice against injected estimates, how its terms combine ---------------


@pytest.mark.parametrize("penalty", [3.0, 0.5])
def test_a_launch_that_holds_sms_counts_its_penalty_by_its_length(penalty):
    """Brief launches hardly (the model's kernels wait for them briefly), those of SM_HOLD_S
    and longer in full; the same rule for a lowered penalty (the engine prefers its link)."""
    model = CostModel(sm_penalty=penalty)
    assert model.sm_weight(0.0) == 1.0
    assert model.sm_weight(select.SM_HOLD_S / 2) == pytest.approx((1 + penalty) / 2)
    assert model.sm_weight(select.SM_HOLD_S) == model.sm_weight(50 * select.SM_HOLD_S) == pytest.approx(penalty)


def free(**fields) -> CostModel:
    """A cost model whose link, kernels and host cost nothing but `fields`."""
    zero = {"store": 0.0, "load": 0.0}
    fast = {"store": 1e12, "load": 1e12}
    base = dict(
        ce_desc_s=zero, ce_gbps=fast, ce_tail_s=0.0, ce_host_s=0.0,
        sm_gbps=fast, sm_desc_s=zero, gather_gbps=1e12, gather_desc_s=0.0, launch_s=0.0,
    )  # fmt: skip
    return CostModel(**{**base, **fields})


def test_the_estimates_add_the_host_time_where_it_does_not_hide_behind_the_copies():
    n, nbytes = 4096, 4096 * 256
    # ce_batch: the batch call's host time comes on top of its copies, not beside them
    assert free(ce_host_s=1e-6, launch_s=1e-3).estimate("ce_batch", "store", n, nbytes) == pytest.approx(
        1e-3 + n * 1e-6
    )
    # expand_direct's device time weighed for the SMs it holds
    penalized = [free(sm_gbps={"store": 50.0, "load": 50.0}, sm_penalty=p) for p in (1.0, 3.0)]
    one, three = (m.estimate("expand_direct", "store", n, 64 * nbytes, 64) for m in penalized)
    assert three == pytest.approx(3 * one) and one > select.SM_HOLD_S  # long: the whole penalty
    assert free(loop_s_per_desc=3e-6).estimate("ce_loop", "load", n, nbytes) == pytest.approx(n * 3e-6)
    with pytest.raises(ValueError, match="unknown"):
        free().estimate("nosuch", "store", n, nbytes)


@pytest.mark.parametrize("direction, weighed", [("load", True), ("store", False)])
def test_small_host_to_device_copies_weigh_their_bytes_in_loads_only(direction, weighed):
    """The batch call moves small host-to-device copies through the CPU, at `inline_h2d_gbps`:
    expand_staged's small segments, and ce_batch's copies where they are that small (a load of
    80 MiB of 4 KiB pages took 24 ms to submit on an H100, the batch call's per-copy time alone 9)."""
    model = free(inline_h2d_gbps=2.0, inline_h2d_bytes=4096)
    plain, small = (model.estimate("expand_staged", direction, 4096, 1 << 20, 64, s) for s in (0, 1 << 19))
    assert small - plain == pytest.approx((1 << 19) / 2e9 if weighed else 0.0)
    pages, larger = (model.estimate("ce_batch", direction, n, 1 << 22) for n in (1024, 512))  # 4 and 8 KiB copies
    assert pages == pytest.approx((1 << 22) / 2e9 if weighed else 0.0, abs=1e-9)
    assert larger == pytest.approx(0.0, abs=1e-9)


def test_winners_persist_per_gpu_model_and_sm_penalty_in_the_profile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_PROFILE_DIR", str(tmp_path))
    assert winners_path("NVIDIA H200 NVL", 2.0) == tmp_path / "cuda-nvidia-h200-nvl-sm2-tuned.json"
    assert winners_path("NVIDIA H200 NVL", 1.5) == tmp_path / "cuda-nvidia-h200-nvl-sm1.5-tuned.json"


# ---- the adapter: one table of mechanisms, runs by name ---------------------------------------


def test_availability_comes_from_the_table(monkeypatch):
    assert tuple(TABLE) == MECHANISMS + BLOCK_MECHANISMS and all(name == m.name for name, m in TABLE.items())
    backend = host_only_backend(monkeypatch, FakeLib(with_batch=False), triton=False)
    assert backend.available_mechanisms == ("ce_loop",)
    assert "12.8" in backend.why_unavailable("ce_batch") and "12.8" in backend.why_unavailable("expand_staged")
    assert "triton" in backend.why_unavailable("expand_direct")
    # with Triton but without the batch call: staging cannot copy its segments
    older = host_only_backend(monkeypatch, FakeLib(with_batch=False))
    assert older.available_mechanisms == ("ce_loop", "expand_direct")
    assert backend.why_unavailable("nosuch") == (
        "unknown mechanism; choose one of ce_batch, ce_loop, expand_staged, expand_direct or auto"
    )
    assert host_only_backend(monkeypatch, FakeLib()).available_mechanisms == MECHANISMS + BLOCK_MECHANISMS


def test_a_bare_batch_under_auto_goes_to_the_batch_call_or_without_it_the_loop(monkeypatch):
    """Descriptor batches under auto take the copy engines: one batch call where the driver has
    it, else one call per copy."""
    dst, src, sizes = arrays(4)
    for lib, expected in ((FakeLib(with_batch=False), "ce_loop"), (FakeLib(), "ce_batch")):
        backend = host_only_backend(monkeypatch, lib)
        for direction in Direction:
            assert backend.copy_batch(src, dst, sizes, direction, SimpleNamespace(cuda_stream=7)) == expected


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
    auto = host_only_backend(monkeypatch, FakeLib(with_batch=False))
    assert auto.enqueue_with("expand_staged", src, dst, sizes, Direction.LOAD, stream) == "ce_loop"


@pytest.mark.parametrize(
    "mechanism, message",
    [
        ("nosuch", "cuda mechanism 'nosuch' cannot be used: unknown mechanism"),
        ("ce_batch", "cuda mechanism 'ce_batch' cannot be used: the driver has no cuMemcpyBatchAsync"),
    ],
)
def test_enqueue_with_refuses_what_cannot_run_before_enqueueing(monkeypatch, mechanism, message):
    lib = FakeLib(with_batch=mechanism != "ce_batch")
    backend = host_only_backend(monkeypatch, lib)
    dst, src, sizes = arrays(2)
    with pytest.raises(ValueError, match=message):
        backend.enqueue_with(mechanism, src, dst, sizes, Direction.STORE, SimpleNamespace(cuda_stream=1))
    assert lib.calls == []


def test_addressable_reads_the_host_ranges_while_other_threads_change_them():
    """alloc_host and tensor finalizers change the ranges outside the enqueue lock while a
    layout's first job asks whether its host rows are addressable (`BlockCopier.direct_ok`)."""
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
        for _ in range(300):  # not addressable: every range is looked at
            assert not backend.addressable(1 << 50, 64)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("mechanism", ["ce_batch", "ce_loop"])
def test_a_thread_that_made_no_cuda_call_yet_enqueues_in_the_gpus_context(monkeypatch, mechanism):
    """A queue's launcher thread, or any new thread of the engine's, has no context current until
    it makes a runtime call: its first enqueue must make the GPU's current, or the driver fails
    its copies (the batch call with INVALID_VALUE, as loads from a launcher thread once did on
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


# ---- interrupts: an enqueue cut short keeps what it holds until an event passes ---------------


class _Stream(SimpleNamespace):
    """A stream handle that notes the events it was made to wait for."""

    def wait_event(self, event):
        self.waited.append(event)


@pytest.mark.parametrize("direct", [True, False], ids=["called directly", "inside a worker's step"])
def test_an_enqueue_is_one_step_for_ctrl_c(direct, monkeypatch):
    """A SIGINT on the main thread as an enqueue settles what it holds (its ring regions
    retired on its event) comes once its event is set: called directly (by user code: the
    enqueue is its own step), or inside a worker's step (which it joins)."""
    from helpers import python_sigint, send_ctrl_c

    from offload_core.backend import deferred

    backend = host_only_backend(monkeypatch, FakeLib(), mechanism="ce_batch")
    dst, src, sizes = arrays(3)
    retire = backend._ring.retire

    def retire_with_ctrl_c(*args):
        send_ctrl_c()
        retire(*args)

    monkeypatch.setattr(backend._ring, "retire", retire_with_ctrl_c)
    with python_sigint(), pytest.raises(KeyboardInterrupt):
        with deferred() if not direct else contextlib.nullcontext():
            backend.enqueue_with("ce_batch", src, dst, sizes, Direction.STORE, SimpleNamespace(cuda_stream=9))
    (entry,) = backend._keepalive
    assert entry[0] is not None  # its event set: what it holds goes once the event has passed


def test_an_enqueue_whose_event_cannot_be_recorded_keeps_nothing_for_ever(monkeypatch):
    """The driver fails as an enqueue records its event: the call raises, what it held goes
    once the GPU has run everything, and later enqueues still let go of theirs."""
    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib, mechanism="ce_batch")
    dst, src, sizes = arrays(3)
    stream = SimpleNamespace(cuda_stream=9)
    marker = backend._marker
    monkeypatch.setattr(backend, "_marker", lambda: (_ for _ in ()).throw(RuntimeError("driver failed")))
    with pytest.raises(RuntimeError, match="driver failed"):
        backend.enqueue_with("ce_batch", src, dst, sizes, Direction.STORE, stream)
    assert ("device_synchronize", 0) in lib.calls
    monkeypatch.setattr(backend, "_marker", marker)
    for _ in range(5):
        backend.enqueue_with("ce_batch", src, dst, sizes, Direction.STORE, stream)
    assert len(backend._keepalive) <= 2 and all(e[0] is not None for e in backend._keepalive)


# ---- settings ---------------------------------------------------------------------------------


def test_auto_is_measured_by_default_and_the_conf_can_turn_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFLOAD_CORE_PROFILE_DIR", str(tmp_path))
    backend = host_only_backend(monkeypatch, FakeLib(), tune=None)
    tuner = backend._blocks.tuner
    assert tuner is not None and tuner.path.parent == tmp_path and tuner.path.name.endswith("-sm2-tuned.json")
    # winners weighed by another penalty are not read as this one's
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_penalty:1")
    assert host_only_backend(monkeypatch, FakeLib(), tune=None)._blocks.tuner.path.name.endswith("-sm1-tuned.json")
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "tune:0")
    assert host_only_backend(monkeypatch, FakeLib(), tune=None)._blocks.tuner is None
    assert host_only_backend(monkeypatch, FakeLib(), tune=True)._blocks.tuner is not None  # the argument wins
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "tune:2")
    with pytest.raises(ConfigError, match="OFFLOAD_CORE_CUDA_CONF tune must be 0 or 1, got '2'"):
        host_only_backend(monkeypatch, FakeLib(), tune=None)
    monkeypatch.delenv("OFFLOAD_CORE_CUDA_CONF")
    for value in (0.5, 2, "yes"):  # not silently turned into 0 or 1
        with pytest.raises(ConfigError, match=f"tune must be 0 or 1, got {value!r}"):
            host_only_backend(monkeypatch, FakeLib(), tune=value)


@pytest.mark.parametrize(
    "key, text, rule",
    [
        *[("sm_penalty", t, "a positive number") for t in ("0", "-1", "inf", "nan", "two", "1e400")],
        *[("sm_programs", t, "a positive integer") for t in ("0", "2.5", "1e3")],
        ("staging_mb", "-24", "a positive integer"),
        ("ring_mb", "0", "a positive integer"),
        ("max_batch", "-1", "a non-negative integer"),
        ("max_batch", "many", "a non-negative integer"),
        *[("staging_mb", t, "a positive integer") for t in ("\u0663", "\uff18", "1_000")],  # int() takes them
        ("sm_penalty", "1_0", "a positive number"),
    ],
)
def test_a_setting_outside_its_values_is_refused_by_name(monkeypatch, key, text, rule):
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", f"{key}:{text}")
    with pytest.raises(ConfigError, match=f"OFFLOAD_CORE_CUDA_CONF {key} must be {rule}, got {text!r}"):
        host_only_backend(monkeypatch, FakeLib())


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("OFFLOAD_CORE_CUDA_CONF", "staging_mb=8", "CONF: 'staging_mb=8' is not key:value"),
        ("OFFLOAD_CORE_CUDA_CONF", "staging:8", "CONF: 'staging:8' has an unknown key; keys: mechanism, sm_programs"),
        (
            "OFFLOAD_CORE_CUDA_CONF",
            "posted:1",
            "CONF: 'posted:1' has an unknown key; keys: ",
        ),  # posted mode was removed
        ("OFFLOAD_CORE_CUDA_CONF", "ring_mb:4, ring_mb:8", "CONF: 'ring_mb:8' names a key twice"),
        ("OFFLOAD_CORE_CUDA_STAGING_MB", "8", "STAGING_MB is no longer read: set OFFLOAD_CORE_CUDA_CONF"),  # of old
    ],
)
def test_a_malformed_conf_or_a_variable_of_earlier_versions_is_refused_by_name(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"OFFLOAD_CORE_CUDA_{message}"):
        host_only_backend(monkeypatch, FakeLib())


@pytest.mark.parametrize("through_conf", [False, True])
def test_a_removed_or_unknown_mechanism_is_refused_with_the_valid_ones(monkeypatch, through_conf):
    """``staged`` (removed long ago) is as unknown as any other name; ``sm_gather`` says what
    does its work now. Through the conf, the message names the variable."""
    valid = "choose one of ce_batch, ce_loop, expand_staged, expand_direct or auto"
    what = "OFFLOAD_CORE_CUDA_CONF mechanism" if through_conf else "cuda mechanism"
    for name, removed in (("staged", ""), ("nosuch", ""), ("sm_gather", " (removed: expand_direct makes")):
        if through_conf:
            monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", f"mechanism:{name}")
        with pytest.raises(ConfigError) as refused:
            host_only_backend(monkeypatch, FakeLib(), mechanism=None if through_conf else name)
        message = str(refused.value)
        assert message.startswith(f"{what} {name!r} cannot be used: unknown mechanism{removed}")
        assert message.endswith(valid)


def test_settings_come_from_the_conf_and_an_empty_value_leaves_the_default(monkeypatch):
    def settings(backend):
        s = backend
        return s.sm_programs, s.staging_bytes, s.max_batch, s._ring.entries, s.cost.sm_penalty, s.programs_given

    default = settings(host_only_backend(monkeypatch, FakeLib(), cost=CostModel(sm_penalty=1.25)))
    assert default[4] == 1.25 and not default[5]
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_programs:16, staging_mb:8,max_batch: 5 ,sm_penalty:3.5,ring_mb:4")
    assert settings(host_only_backend(monkeypatch, FakeLib(), cost=CostModel(sm_penalty=1.25))) == (
        {Direction.STORE: 16, Direction.LOAD: 16}, 8 << 20, 5, 1 << 19, 3.5, True  # the operator's penalty wins
    )  # fmt: skip
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_programs:, staging_mb:,max_batch:,sm_penalty:,ring_mb:")
    assert settings(host_only_backend(monkeypatch, FakeLib(), cost=CostModel(sm_penalty=1.25))) == default


@pytest.mark.parametrize(
    "argument, value, rule",
    [
        *[("max_programs", v, "a positive integer") for v in (0, -4, 2.5, True)],
        ("staging_bytes", -1, "a positive integer"),
        ("ring_bytes", 0, "a positive integer"),
        ("max_batch", -7, "a non-negative integer"),
    ],
)
def test_a_constructor_setting_outside_its_values_is_refused_by_name(monkeypatch, argument, value, rule):
    with pytest.raises(ConfigError, match=f"{argument} must be {rule}, got {value!r}"):
        CudaBackend(driver=drv.Driver(FakeLib()), runtime=FakeCudaRuntime(), **{argument: value})


@pytest.mark.parametrize("conf, what", [("ring_mb:100000000", "ring_mb"), ("staging_mb:50000", "staging_mb")])
def test_staging_or_a_ring_larger_than_the_gpu_is_refused_at_once(monkeypatch, conf, what):
    """A size in bytes where MiB were meant would fail every job that needs the memory later."""
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", conf)
    with pytest.raises(ConfigError, match=f"{what} .* more than the GPU has"):
        host_only_backend(monkeypatch, FakeLib())
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", conf.replace("100000000", "40000").replace("50000", "40000"))
    host_only_backend(monkeypatch, FakeLib())  # within the fake GPU's 80 GiB


def test_a_constructor_setting_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", "sm_programs:4,max_batch:9,ring_mb:4")
    backend = CudaBackend(
        driver=drv.Driver(FakeLib()), runtime=FakeCudaRuntime(), max_programs=12, max_batch=0, ring_bytes=800
    )
    assert backend.sm_programs == {Direction.STORE: 12, Direction.LOAD: 12}
    assert backend.max_batch == 0 and backend._ring.entries == 100


# ---- compact jobs: the cost model's pick (`BlockCopier.choose`) against injected thresholds and costs ----

RULES = dict(  # the test's own thresholds, not the shipped (tuned) ones; pages of SIZED_PAGE are mid-sized
    HOST_BOUND_BYTES=256 << 10, DIRECT_STORE_BYTES=1 << 20, SIZED_PAGE=512, DIRECT_STORE_PAGE=2048,
    LONG_ROW_BYTES=2048, STORE_BYTES_PER_PROGRAM=256 << 10, MIN_STORE_PROGRAMS=3,
    SMALL_LOAD_PROGRAMS=5, SMALL_PAGE_STORE_PROGRAMS=6,
)  # fmt: skip


P = SimpleNamespace(**RULES)


@pytest.fixture
def rules(monkeypatch):
    for name, value in RULES.items():
        monkeypatch.setattr(cuda_blocks, name, value)
    return P


class Costs:
    """A cost model for `BlockCopier`: each mechanism at `seconds` (1 unless given)."""

    inline_h2d_bytes = 1  # loads count their small segments (`_small_limit`)

    def __init__(self, **seconds):
        self.seconds = {"ce_batch": 1.0, "ce_loop": 1.0, "expand_staged": 1.0, "expand_direct": 1.0, **seconds}

    def estimate(self, mechanism, *args, **kwargs):
        return self.seconds[mechanism]


CHEAP_DIRECT = Costs(expand_direct=0.5)


def _copier(cost=None, given=None, half_bytes=24 << 20, direct_ok=True):
    """A `BlockCopier` over `cost` (default: every mechanism alike, which keeps ce_batch) whose
    backend has 16 programs for stores and 64 for loads, or `given` for both as an engine set them."""
    store, load = (given, given) if given else (16, 64)
    backend = SimpleNamespace(
        cost=cost or Costs(),
        sm_programs={Direction.STORE: store, Direction.LOAD: load},
        programs_given=bool(given),
        available_mechanisms=("ce_batch",),
    )
    copier = cuda_blocks.BlockCopier(backend, half_bytes)
    copier.direct_ok = lambda prepared: direct_ok
    return copier


def _launch(direction, job_bytes, jobs=1, page=None, tensors=8, runs=None, small=0, whole_rows=True, simple=True):
    """A launch of `jobs` jobs of `job_bytes`, pages of `page` bytes (default `SIZED_PAGE`) over
    `tensors` tensors, a host row per block; the rows apart or merged into `runs` segments, `small`
    of the bytes in segments small enough for a load's batch call to move them through the CPU.
    Returns (job, prepared)."""
    page = page or cuda_blocks.SIZED_PAGE
    rows = job_bytes * jobs // (page * tensors)
    layout = SimpleNamespace(
        row_bytes=page * tensors, largest=page, smallest=page, host_base=0, segments=lambda job: None,
        segment_summary=lambda job, limit: (runs or rows, small if limit else 0),
    )  # fmt: skip
    job = SimpleNamespace(
        direction=direction, items=rows * tensors, nbytes=job_bytes * jobs, jobs=jobs, layout=layout,
        host_ids=np.arange(rows), simple=simple,
    )  # fmt: skip
    return job, SimpleNamespace(layout=layout, whole_rows=dict.fromkeys(Direction, whole_rows))


def chosen(copier, job_and_prepared, smallest=None):
    job, prepared = job_and_prepared
    if smallest is not None:  # pages of several sizes
        job.layout.smallest = smallest
    return copier.choose(job, prepared).name


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize(
    "seconds, direct_ok, expected",
    [
        ({}, True, "ce_batch"),  # a tie: the copy engines alone, then staging
        (dict(expand_staged=0.97), True, "expand_staged"),
        (dict(expand_staged=0.99), True, "ce_batch"),  # within 2%: a tie
        (dict(expand_direct=0.5), True, "expand_direct"),
        (dict(expand_direct=0.99), True, "ce_batch"),
        (dict(expand_direct=0.97, expand_staged=0.99), True, "expand_direct"),
        (dict(expand_direct=0.975, expand_staged=0.99), True, "ce_batch"),  # 2% below every earlier one
        (dict(expand_direct=0.5), False, "ce_batch"),  # the rows are not addressable
    ],
)
def test_the_prior_is_the_cost_models_cheapest_ties_to_the_copy_engines(rules, direction, seconds, direct_ok, expected):
    """Auto's choice without a tuner, and the prior the tuner measures against: whatever the
    job's size or segments, the cost model decides (no rules of its own besides)."""
    for launch in (_launch(direction, 3 * rules.HOST_BOUND_BYTES), _launch(direction, rules.HOST_BOUND_BYTES, runs=1)):
        assert chosen(_copier(Costs(**seconds), direct_ok=direct_ok), launch) == expected


@pytest.mark.parametrize("direction", list(Direction))
def test_staging_that_would_join_few_copies_is_not_a_candidate(direction):
    """One tensor's scattered blocks: a host segment per copy, or nearly (jobs joined and sorted
    meet a few neighbours), so staging moves what ce_batch moves, after a kernel; rated cheaper
    (the model lacks its batch call), it was the prior for one tensor's 64 KiB pages. Where the
    segments join at least half the copies it stays a candidate."""
    staged_cheapest = Costs(expand_staged=0.5)
    apart = _launch(direction, 4 << 20, page=65536, tensors=1)  # 64 blocks, 64 segments
    assert chosen(_copier(staged_cheapest), apart) == "ce_batch"
    neighbours = _launch(direction, 4 << 20, jobs=10, page=65536, tensors=1, runs=634)  # 640 blocks
    assert chosen(_copier(staged_cheapest), neighbours) == "ce_batch"
    half = _launch(direction, 4 << 20, jobs=10, page=65536, tensors=1, runs=320)
    assert chosen(_copier(staged_cheapest), half) == "expand_staged"
    joined = _launch(direction, 4 << 20, page=65536, tensors=1, runs=16)
    assert chosen(_copier(staged_cheapest), joined) == "expand_staged"
    assert chosen(_copier(staged_cheapest), _launch(direction, 4 << 20)) == "expand_staged"  # 8 tensors a row


@pytest.mark.parametrize("direct_ok, expected", [(True, "expand_direct"), (False, "ce_loop")])
def test_without_the_batch_call_jobs_go_direct_or_one_copy_a_call(rules, direct_ok, expected):
    """A driver before CUDA 12.8 has no cuMemcpyBatchAsync: staging cannot copy its segments nor
    ce_batch its copies, so auto weighs what is left, the copies expanded on the host going one
    cuMemcpyAsync each."""
    copier = _copier(Costs(ce_loop=2.0), direct_ok=direct_ok)
    copier.backend.available_mechanisms = ("ce_loop", "expand_direct")
    assert chosen(copier, _launch(Direction.STORE, rules.HOST_BOUND_BYTES)) == expected


@pytest.mark.parametrize("direction", list(Direction))
def test_rows_larger_than_a_staging_half_go_direct_if_cheaper_else_host_expanded(rules, direction):
    launch = _launch(direction, rules.HOST_BOUND_BYTES)  # no staging
    half = launch[0].layout.row_bytes - 1
    assert chosen(_copier(CHEAP_DIRECT, half_bytes=half), launch) == "expand_direct"
    assert chosen(_copier(Costs(ce_batch=0.5), half_bytes=half), launch) == "ce_batch"
    assert chosen(_copier(half_bytes=half), launch) == "ce_batch"
    assert chosen(_copier(CHEAP_DIRECT, half_bytes=half, direct_ok=False), launch) == "ce_batch"


@pytest.mark.parametrize(
    "direction, job_bytes, page, whole_rows, programs",
    [
        # stores of mid-sized pages: few programs up to DIRECT_STORE_BYTES, then one per STORE_BYTES_PER_PROGRAM
        (Direction.STORE, P.DIRECT_STORE_BYTES, None, True, P.MIN_STORE_PROGRAMS),
        (Direction.STORE, 2 * P.DIRECT_STORE_BYTES, None, True, 2 * P.DIRECT_STORE_BYTES // P.STORE_BYTES_PER_PROGRAM),
        (Direction.STORE, 8 * P.DIRECT_STORE_BYTES, None, True, "most"),
        (Direction.STORE, P.HOST_BOUND_BYTES, 4 * P.DIRECT_STORE_PAGE, True, P.MIN_STORE_PROGRAMS),  # larger pages
        (Direction.LOAD, P.HOST_BOUND_BYTES, None, True, P.SMALL_LOAD_PROGRAMS),
        (Direction.LOAD, 2 * P.HOST_BOUND_BYTES, None, True, "most"),
        # pages under SIZED_PAGE: the backend's, but for link-bound stores into whole long rows
        (Direction.STORE, 2 * P.HOST_BOUND_BYTES, P.LONG_ROW_BYTES // 8, True, P.SMALL_PAGE_STORE_PROGRAMS),
        (Direction.STORE, 2 * P.HOST_BOUND_BYTES, P.LONG_ROW_BYTES // 8, False, "most"),  # pieces of rows
        (Direction.STORE, 2 * P.HOST_BOUND_BYTES, P.LONG_ROW_BYTES // 16, True, "most"),  # short rows
        (Direction.STORE, P.HOST_BOUND_BYTES, P.LONG_ROW_BYTES // 8, True, "most"),
        (Direction.LOAD, 2 * P.HOST_BOUND_BYTES, P.LONG_ROW_BYTES // 8, True, "most"),
    ],
)
def test_direct_launches_take_programs_by_their_jobs_size_up_to_the_backends(
    rules, direction, job_bytes, page, whole_rows, programs
):
    launch = _launch(direction, job_bytes, 3, page, whole_rows=whole_rows)
    copier = _copier()
    most = copier.backend.sm_programs[direction]
    assert copier.direct_programs(*launch) == (most if programs == "most" else programs)
    assert _copier(given=12).direct_programs(*launch) == 12  # set by the engine: taken as it is


def test_expand_direct_launches_on_the_programs_direct_programs_gives():
    class Job(list):  # of two blocks
        pass

    expanded = []
    copier = cuda_blocks.BlockCopier(SimpleNamespace(), 0)
    copier.expand = lambda job, prepared, b0, b1, stream, held, programs, stage=None: expanded.append(
        (b0, b1, programs, stage)
    )
    copier.direct_programs = lambda job, prepared: 7 if job.direction is Direction.STORE else 9
    for direction in Direction:
        job = Job([0, 0])
        job.direction = direction
        TABLE["expand_direct"].enqueue_job(copier, job, None, None, None, [], [])
    assert expanded == [(0, 2, 7, None), (0, 2, 9, None)]


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
    (`expanding.descriptors`): a simple job's two columns with the rows found from the host
    ids or the block index, and the five columns of the others."""
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
    layout = model.layout(compiled=False)
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
    want = descriptors(job, stage)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert uploaded[0].size == (2 if job.simple else 5) * len(job)
    if stage is not None and shape in ("simple", "chunks of two"):  # a piece: blocks 2..4, chunk 2 (1) at stage
        chunk = 2 // bpc
        copier.expand(job, prepared, 2, 5, None, [], 4, stage - chunk * layout.row_bytes)
        second = launched[1]
        got = kernel_reading(_as_uploaded(second[1], second[13]), 3, second[12], layout, direction is Direction.STORE)
        per = int(layout.group_entries[1, 0])
        for g, w in zip(got, descriptors(job, stage - chunk * layout.row_bytes)):
            np.testing.assert_array_equal(g, w[2 * per : 5 * per])


@pytest.mark.parametrize("ring", [1 << 20, 1 << 40], ids=["32-bit", "64-bit"])
def test_a_layouts_warm_up_launches_are_of_its_jobs_kinds(monkeypatch, ring):
    """Triton builds a kernel per set of constexprs and per type of each int argument (whether it
    fits 32 bits), and the first launch of a build loads it, which waits for the device to go
    idle. `prepare` must launch every build a job will use, so that no job waits for that."""
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
        upload=lambda cols, stream, held, narrow=False: [ring], device_address=lambda: ring, launches=False
    )
    for simple in (True, False):
        model = Model([16], [[(0, 16)]], 1 if simple else 2, 64, 64)
        layout = model.layout(host_base=0x7F00_0000_0000)  # where pinned host memory lies
        prepared = backend._blocks.prepare(layout)
        warmed, launched[:] = set(launched), []
        for direction in Direction:
            job = layout.job(direction, DeviceBlocks([5, 9, 2]), HostBlocks([11, 3, 60] if simple else [11, 3]))
            assert job.simple == simple
            for stage in (None, prepared.entries.data_ptr() + 4096):
                backend._blocks.expand(job, prepared, 0, len(job), SimpleNamespace(cuda_stream=7), [], 4, stage)
        assert launched and set(launched) <= warmed, "a job's launch that prepare did not warm up"


def test_loads_expanded_on_the_host_read_in_stream_order_unless_nothing_may_still_write_them(monkeypatch):
    """A bare batch's caller does not say what its stream waits for: its loads read their host
    rows in stream order. A job expanded on the host (a forced batch mechanism) says: out of
    stream order only where it waits for no other lane's job (`host_after`)."""
    lib = FakeLib()
    backend = host_only_backend(monkeypatch, lib, mechanism="ce_batch")
    dst, src, sizes = arrays(3)
    stream = SimpleNamespace(cuda_stream=9)
    assert backend.copy_batch(src, dst, sizes, Direction.LOAD, stream) == "ce_batch"
    assert {c[4] for c in copies(lib)} == {drv.SRC_ACCESS_ORDER_STREAM}
    layout = Model([16, 8], [[(0, 16), (1, 8)]], 1, 32, 24, seed=1).layout()
    for hazard in (False, True):
        lib.calls.clear()
        job = layout.job(Direction.LOAD, DeviceBlocks([5, 9, 2]), HostBlocks([3, 4, 20]))
        job.host_after = (object(),) if hazard else ()
        assert backend.copy_blocks(job, None, stream, []) == "ce_batch"
        order = drv.SRC_ACCESS_ORDER_STREAM if hazard else drv.SRC_ACCESS_ORDER_ANY
        assert {c[4] for c in copies(lib)} == {order}


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
    model = Model([16, 8], [[(0, 16), (1, 8)]], bpc, 32, 24, seed=bpc)
    layout = model.layout()
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

    def expand(ring, cols, n, entries, num_entries, groups, num_groups, per_block, is_store, *args):
        rows, narrow = args[3], args[4]  # after largest, stream, programs
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


@pytest.mark.parametrize("mechanism", ["ce_batch", "expand_staged"])
@pytest.mark.parametrize("direction", list(Direction))
def test_batched_copies_read_in_stream_order_what_may_still_be_written(monkeypatch, mechanism, direction):
    """The batch call may read a load's host rows out of stream order (small ones through the
    CPU, during the call), past the stream's wait for a store still writing them: where a load
    waits for one (`host_after`), and for every store, its copies read in stream order."""
    model = Model([16, 8], [[(0, 16), (1, 8)]], 1, 32, 24, seed=1)
    layout = model.layout()
    orders = []
    backend = SimpleNamespace(
        _ring=None,
        device_index=0,
        gather_programs=4,
        max_batch=0,
        driver=SimpleNamespace(
            memcpy_batch_async=lambda dst, src, sizes, order, handle, max_batch=0, held=None: orders.append(order)
        ),
    )
    monkeypatch.setattr(cuda_blocks.kernels, "expand", lambda *args: None)
    event = SimpleNamespace(record=lambda stream: None)
    side = SimpleNamespace(cuda_stream=8, wait_event=lambda event: None)
    st = SimpleNamespace(halves=[0, 1 << 20], free=[event, event], next=0, side=side, ready=event)
    copier = SimpleNamespace(
        backend=backend, half_bytes=1 << 20, staging=SimpleNamespace(for_stream=lambda s: st), expand=lambda *a: None
    )
    stream = SimpleNamespace(cuda_stream=7, wait_event=lambda event: None)
    for hazard in (False, True):
        job = layout.job(direction, DeviceBlocks([5, 9, 2]), HostBlocks([3, 4, 20]))
        job.host_after = (event,) if hazard else ()
        segments = layout.segments(job) if TABLE[mechanism].needs_segments else None
        orders.clear()
        TABLE[mechanism].enqueue_job(copier, job, host_prepared(layout), segments, stream, [], Held())
        in_order = direction is Direction.STORE or hazard
        assert orders and set(orders) == {drv.SRC_ACCESS_ORDER_STREAM if in_order else drv.SRC_ACCESS_ORDER_ANY}


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=12),
    st.lists(st.integers(1, 120), max_size=5),
)
def test_segments_split_at_piece_cuts_cover_the_same_bytes_and_cross_none(gaps_and_sizes, cut_points):
    """`blocks._split` against the bytes themselves: every byte of every segment, at its host
    address, once; no segment runs across a cut; staging order kept."""
    stage, at = [], 0
    for gap, size in gaps_and_sizes:
        stage.append(at + gap)
        at += gap + size
    stage = np.array(stage, dtype=np.int64)
    sizes = np.array([size for _, size in gaps_and_sizes], dtype=np.int64)
    host = np.arange(stage.size, dtype=np.int64) * 1000 + 7  # any host place per segment
    cuts = np.array(sorted(set(cut_points)), dtype=np.int64)
    s, h, n = cuda_blocks._split(stage, host, sizes, cuts)

    def bytes_of(stage, host, sizes):
        return sorted((int(a) + i, int(b) + i) for a, b, k in zip(stage, host, sizes) for i in range(int(k)))

    assert bytes_of(s, h, n) == bytes_of(stage, host, sizes)
    assert (np.diff(s) > 0).all() and (n > 0).all()
    assert not any(a < c < a + k for a, k in zip(s.tolist(), n.tolist()) for c in cuts.tolist())


@pytest.mark.parametrize("direction", list(Direction))
def test_staging_halves_hand_over_through_driver_markers_after_the_hazards_ends(monkeypatch, direction):
    """`expand_staged`'s pieces hand a staging half from the kernel to the copies and back through
    the backend's untimed driver events, alternating halves: a store's piece waits until its
    half's last copies passed, gathers, and its copies wait for the gather; a load's the other
    way round. The side stream first waits for the hazards' ends (another lane's job on the same
    host blocks: `after` and `job.host_after`), so that the first copy between host rows and
    staging follows them."""

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
    layout = model.layout()
    backend._blocks.half_bytes = 3 * layout.row_bytes  # three pieces of three rows, the last of two
    ring = 1 << 40
    backend._ring = SimpleNamespace(
        device_address=lambda: ring,
        upload=lambda cols, stream, held, narrow=False: [ring],
        retire=lambda event, regions=None: None,
        open=lambda: [],
    )
    prepared = backend._blocks.prepare(layout)
    stream = backend.new_stream()
    job = layout.job(direction, DeviceBlocks([5, 9, 2, 30, 17, 11, 0, 22]), HostBlocks([3, 4, 5, 6, 7, 20, 21, 9]))
    hazard = backend.new_event()
    hazard.record(backend.new_stream())
    job.host_after = (hazard,)
    lib.calls.clear()
    cuda_blocks.EXPAND_STAGED.enqueue_job(
        backend._blocks, job, prepared, layout.segments(job), stream, [hazard], Held()
    )
    halves = backend._blocks.staging.for_stream(stream)
    assert all(isinstance(e, DriverEvent) for e in (*halves.free, halves.ready))
    assert [c for c in lib.calls if c[0] == "event_create"] == [("event_create", 2)] * 3  # untimed markers
    names = {halves.free[0].handle: "free0", halves.free[1].handle: "free1", halves.ready.handle: "ready"}
    names[hazard.handle] = "hazard"
    steps = [
        c[0] if c[0] in ("kernel", "batch") else (c[0], names[c[1] if c[0] == "record" else c[2]])
        for c in lib.calls
        if c[0] in ("kernel", "batch", "record", "wait")
    ]
    first, then = ("kernel", "batch") if direction is Direction.STORE else ("batch", "kernel")
    piece = [("wait", "free{}"), first, ("record", "ready"), ("wait", "ready"), then, ("record", "free{}")]
    pieces = [[s if isinstance(s, str) else (s[0], s[1].format(h)) for s in piece] for h in (0, 1, 0)]
    assert steps == [("wait", "hazard"), *pieces[0], *pieces[1], *pieces[2]]
