"""`TorchDeviceBackend` and its subclasses take their runtime (and the npu backend its ACL
library, the xpu backend its copier) as constructor arguments: a backend written on this base
for another runtime needs nothing patched, and production code carries no test hooks."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import simulated
import torch
from helpers import small_kv

import offload_core.backends
from offload_core import DeviceBlocks, Direction, HostBlocks, OffloadWorker
from offload_core.backends.cpu import CpuEvent, CpuStream, memmove_all
from offload_core.backends.npu import NpuBackend
from offload_core.backends.torch_device import TorchDeviceBackend, TorchRuntime
from offload_core.backends.xpu import StreamCopier, XpuBackend
from offload_core.testing.conformance import BackendConformance

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class HostRuntime:
    """The runtime contract over host memory and cpu streams, written from the contract alone,
    recording which members the backend calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.compute = CpuStream()
        self.streams: list[CpuStream] = [self.compute]
        self.device = 0
        runtime = self

        class Stream(CpuStream):
            def __init__(self, device=None):
                super().__init__()
                runtime.calls.append(f"Stream({device})")
                runtime.streams.append(self)

        class Event(CpuEvent):
            def __init__(self, enable_timing=False):
                super().__init__()
                runtime.calls.append(f"Event({enable_timing})")

        self.Stream, self.Event = Stream, Event

    def current_stream(self, index):
        self.calls.append(f"current_stream({index})")
        return self.compute

    def current_device(self):
        return self.device

    def set_device(self, index):
        self.calls.append(f"set_device({index})")
        self.device = index

    def synchronize(self, index):
        self.calls.append(f"synchronize({index})")
        for s in self.streams:
            s.synchronize()

    def stream(self, s):
        raise AssertionError("HostBackend never makes a stream current")

    def torch_device(self, index):
        self.calls.append(f"torch_device({index})")
        return torch.device("cpu")

    def alloc_pinned(self, nbytes):
        self.calls.append(f"alloc_pinned({nbytes})")
        return torch.zeros(nbytes, dtype=torch.uint8)

    def is_pinned(self, tensor):
        return True

    def pin(self, tensor):
        return tensor.clone()


class HostBackend(TorchDeviceBackend):
    """A third-party backend on the public base: only `probe` and `copy_batch` of its own."""

    name = "cpu"  # its device is the host: the conformance suite checks device.type == name
    module_name = "host"

    @classmethod
    def probe(cls):
        return None

    def copy_batch(self, src, dst, sizes, direction, stream):
        self._bind_thread()
        stream.launch(lambda: memmove_all(src, dst, sizes))
        return "memmove"


class TestHostBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self):
        return HostBackend(runtime=HostRuntime())


def test_the_injected_runtime_serves_every_member():
    runtime = HostRuntime()
    backend = HostBackend(1, runtime=runtime)
    assert backend.runtime is runtime and backend.device == torch.device("cpu")
    assert runtime.calls == ["torch_device(1)"]
    stream, event = backend.new_stream(), backend.new_event()
    assert backend.current_stream() is runtime.compute
    host = backend.alloc_host(64)
    assert host.dtype == torch.uint8 and host.numel() == 64
    one = np.ones(1, dtype=np.int64)
    device = torch.arange(64, dtype=torch.uint8)
    backend.copy_batch(one * device.data_ptr(), one * host.data_ptr(), one * 64, Direction.STORE, stream)
    event.record(stream)
    backend.synchronize()
    assert torch.equal(host, device)
    assert runtime.calls == [
        "torch_device(1)",
        "Stream(1)",
        "Event(True)",
        "current_stream(1)",
        "alloc_pinned(64)",
        "set_device(1)",
        "synchronize(1)",
    ]


def test_torch_runtime_wraps_the_torch_module():
    runtime = TorchRuntime("cuda")
    assert runtime.is_available is torch.cuda.is_available and runtime.Event is torch.cuda.Event
    assert runtime.torch_device(1) == torch.device("cuda", 1)
    assert runtime.is_pinned(torch.zeros(4)) is False
    assert copy.copy(runtime).module is torch.cuda  # no recursion through __getattr__
    with pytest.raises(AttributeError):
        _ = runtime.no_such_member
    with pytest.raises(AttributeError, match="torch.no_such_module"):
        TorchRuntime("no_such_module")


class RecordingCopier(simulated.SimCopier):
    def __init__(self):
        self.calls = []

    def enqueue(self, pairs, stream, runtime):
        self.calls.append((pairs, stream, runtime))
        super().enqueue(pairs, stream, runtime)


class AskedRuntime(simulated.SimRuntime):
    """A simulated runtime that says which host tensors are pinned, and records the questions."""

    def __init__(self, pinned: bool):
        super().__init__("xpu", pool=4)
        self.answer = pinned
        self.asked = []
        self.staged = []

    def is_pinned(self, tensor):
        self.asked.append(tensor.data_ptr())
        return self.answer

    def pin(self, tensor):
        self.staged.append(tensor.data_ptr())
        return super().pin(tensor)


def _one_xpu_copy(backend):
    src = torch.arange(64, dtype=torch.uint8)
    dst = backend.alloc_host(64)
    backend.register_buffer(src)
    one = np.ones(1, dtype=np.int64)
    stream = backend.new_stream()
    backend.copy_batch(one * src.data_ptr(), one * dst.data_ptr(), one * 64, Direction.STORE, stream)
    stream.synchronize()
    return src, dst, stream


def test_xpu_copies_through_the_injected_runtime_and_copier():
    runtime, copier = AskedRuntime(pinned=True), RecordingCopier()
    backend = XpuBackend(runtime=runtime, copier=copier)
    src, dst, stream = _one_xpu_copy(backend)
    assert torch.equal(dst, src)
    ((pairs, used_stream, used_runtime),) = copier.calls
    assert used_stream is stream and used_runtime is runtime
    assert runtime.asked == [src.data_ptr()]  # the runtime decides whether a host source is staged
    assert pairs[0][1].data_ptr() == src.data_ptr()  # pinned: copied from where it is


def test_xpu_stages_what_the_runtime_says_is_pageable():
    copier, runtime = RecordingCopier(), AskedRuntime(pinned=False)
    backend = XpuBackend(runtime=runtime, copier=copier)
    src, dst, _ = _one_xpu_copy(backend)
    assert torch.equal(dst, src) and runtime.staged == [src.data_ptr()]
    ((pairs, _, _),) = copier.calls
    assert pairs[0][1].data_ptr() != src.data_ptr()


def test_xpu_default_copier_enqueues_on_the_stream():
    assert isinstance(XpuBackend(runtime=simulated.SimRuntime("xpu", pool=2)).copier, StreamCopier)

    class Runtime:
        current = None

        def stream(self, s):
            import contextlib

            @contextlib.contextmanager
            def cm():
                self.current = s
                yield
                self.current = None

            return cm()

    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    StreamCopier().enqueue([(dst, src)], "the stream", Runtime())
    assert torch.equal(dst, src)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_npu_backend_with_injected_runtime_and_acl_imports_no_torch_npu():
    had_npu = hasattr(torch, "npu")
    runtime = simulated.SimRuntime("npu")
    acl = simulated.SimAcl(runtime)
    backend = NpuBackend(runtime=runtime, acl=acl)
    assert backend.runtime is runtime and backend.mechanism == "acl_batch"
    assert "torch_npu" not in sys.modules and hasattr(torch, "npu") == had_npu
    kv = small_kv(blocks=8)
    with OffloadWorker(kv, 4, backend=backend) as worker:
        worker.submit_store(1, DeviceBlocks([1, 2]), HostBlocks([0, 1]))
        worker.wait([1])
        (result,) = worker.get_finished()
        assert result.success
        assert torch.equal(worker.host_tensors[0][0:2], kv.tensors[0].tensor[1:3])
    assert acl.calls and acl.calls[0][0] == "batch"


def test_production_backends_never_mention_simulation():
    root = pathlib.Path(offload_core.backends.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 5
    offenders = [str(f.relative_to(root)) for f in files if "simulat" in f.read_text().lower()]
    assert offenders == []


def test_importing_the_base_imports_no_device_sdk():
    code = (
        "import sys, offload_core.backends.torch_device; "
        "bad = [m for m in sys.modules if m.startswith(('torch', 'triton', 'torch_npu'))]; "
        "print(bad); raise SystemExit(bool(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("module", ["cuda", "npu", "xpu"])
@pytest.mark.parametrize("answer", [False, RuntimeError("driver half installed")])
def test_a_device_module_that_says_no_or_raises_is_the_probes_reason(monkeypatch, module, answer):
    """``torch.<module>.is_available()`` answering False, or raising (a half-installed SDK), is a
    reason naming the module; the probe itself does not raise."""
    from offload_core.backends.cuda import CudaBackend

    def is_available():
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, module, type(module, (), {"is_available": staticmethod(is_available)}), raising=False)
    cls = {"cuda": CudaBackend, "npu": NpuBackend, "xpu": XpuBackend}[module]
    expected = "is False" if answer is False else "raised RuntimeError('driver half installed')"
    assert f"torch.{module}.is_available() {expected}" in cls.probe()
