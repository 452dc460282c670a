"""The expansion kernel's launches by hand, without a GPU: what `kernels._raw_launch` reads from a
Triton-compiled kernel, and a compact launch whose tables go up with their kernels in one compiled
call (`_driver.table_launch`) making the calls that uploads and Triton's own launcher make.

Also the stand-ins the other cuda tests share: Triton's compiled kernel (`TritonLike`), a backend
that finds it built for every launch (`compiled_backend`), a stream and the driver's enqueueing
calls (`comparable`). The stand-in libcuda is `test_cuda_host.LaunchingLib`."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import compiled_or_skip
from test_cuda_host import NAMES, WIDE, FakeCudaRuntime, LaunchingLib, _table_launch, host_only_backend

from offload_core.backend import Direction
from offload_core.backends.cuda import driver as drv
from offload_core.backends.cuda import kernels

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
    monkeypatch.setattr(kernels, "_compile", lambda: (None, None, "expand"))
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
    around it (`run` sends its tables up with their kernels in one compiled call or not)."""

    def __init__(self, monkeypatch, lib, direction, mechanism, half_rows=3):
        from test_plan import Model

        from offload_core import DeviceBlocks, HostBlocks
        from offload_core.compact import CompactLayout
        from offload_core.plan import Planner

        handles = iter(range(0x100, 0x200))
        monkeypatch.setattr(FakeCudaRuntime, "ExternalStream", lambda self, handle, device=None: Stream(next(handles)))
        self.lib, backend = lib, compiled_backend(monkeypatch, lib)
        self.backend, self.table_launch = backend, backend._ring.launch
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

    def run(self, compiled: bool = True):
        """The launch; returns the mechanism used and the driver's calls (`comparable`)."""
        b, lib = self.backend, self.lib
        b._ring.launch = self.table_launch if compiled else None
        b._ring.reset()
        b._ring.launched.clear()
        for st in b._blocks.staging.values():
            st.next = 0
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
    lib, table_launch = _table_launch(LaunchingLib(types=types, hidden=1))
    monkeypatch.setattr(kernels, "_compile", lambda: (None, None, "expand"))
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
