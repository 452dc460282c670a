"""Small KV caches on the host for worker tests, the compiled steps for tests of both paths, and
Ctrl-C: a real SIGINT sent from inside a call (`CtrlCInside`, `ctrl_c_inside_calls`)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import NamedTuple

import numpy as np
import pytest
import torch

from offload_core import KVCacheRef, KVCaches, KVCacheTensor, native


class PinnedWindow:
    """A queue's `launch_cost` whose burst window (`LaunchCost.window`) stays `window` seconds,
    whatever the launches take: 0 launches every submit on an idle device, 60 makes any two
    submits a burst."""

    probe = pair = False

    def __init__(self, window: float):
        self.window = window

    def note(self, jobs: int, seconds: float) -> None:
        pass


def small_kv(pages=(64, 128), copy=None, blocks=16, groups=None, seed=0, device="cpu") -> KVCaches:
    """Random int8 tensors with `blocks` pages each; one group over all tensors unless `groups` is given."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        KVCacheTensor(torch.randint(-128, 128, (blocks, p), dtype=torch.int8, generator=gen).to(device), p)
        for p in pages
    ]
    copy = copy or pages
    if groups is None:
        groups = [list(range(len(pages)))]
    return KVCaches(tensors, [[KVCacheRef(t, copy[t]) for t in g] for g in groups])


def snapshot(kv: KVCaches) -> list[torch.Tensor]:
    """Host copies of the KV tensors."""
    return [t.tensor.cpu().clone() for t in kv.tensors]


def compiled_or_skip(compiled: bool, name: str = native.NATIVE):
    """The compiled module `name` (default `offload_core._native`; the cuda backend's is
    `driver.COMPILED`) for the compiled path, skipping where it was not built (failing under
    ``OFFLOAD_CORE_REQUIRE_NATIVE=1``); None for numpy."""
    if not compiled:
        return None
    module = native.load(name)
    if module is None:
        why = f"{name} was not built here (no C compiler at install) or OFFLOAD_CORE_NATIVE=0"
        if os.environ.get("OFFLOAD_CORE_REQUIRE_NATIVE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return module


class Copies(NamedTuple):
    """A transfer as the copies a backend that copies on the host enqueues."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    nbytes: int

    def __len__(self) -> int:
        return self.sizes.size


def host_copies(layout, direction, device, host) -> Copies:
    """Validate a transfer and expand it on the host (`CompactLayout.job`, then `.copies`), as
    `Backend.copy_blocks` does by default."""
    job = layout.job(direction, device, host)
    return Copies(*layout.copies(job), job.nbytes)


def compact_layout(model: Model, compiled: bool):
    """`model`'s `CompactLayout` on the compiled steps (skipping where they were not built) or on numpy."""
    layout = model.layout(compiled)
    if compiled:
        compiled_or_skip(True)
    return layout


class Model:
    """Device tensors over numpy memory and a host row buffer, and the `CompactLayout` a worker
    builds over them (`layout`): every byte a job moves can be checked against the page-at-a-time
    reference model (`expected`), with no device. Each device tensor's rows may lie `gaps[t]`
    bytes apart beyond their length (a strided view). A ref is ``(tensor, bytes)`` or ``(tensor,
    bytes, mapping)``; a mapping makes the host layout canonical."""

    def __init__(self, pages, copy_sizes_per_group, bpc, device_blocks=16, host_blocks=12, seed=0, gaps=None):
        from offload_core.host_layout import HostLayout

        rng = np.random.default_rng(seed)
        self.pages, self.bpc = pages, bpc
        gaps = gaps or [0] * len(pages)
        self.backing = [rng.integers(0, 256, (device_blocks, p + gap), dtype=np.uint8) for p, gap in zip(pages, gaps)]
        self.device = [b[:, :p] for b, p in zip(self.backing, pages)]
        self.group_refs = copy_sizes_per_group
        self.kv = KVCaches(
            [KVCacheTensor(torch.from_numpy(a), p) for a, p in zip(self.device, pages)],
            [[KVCacheRef(*r) for r in refs] for refs in copy_sizes_per_group],
        )
        canonical = any(len(r) > 2 for refs in copy_sizes_per_group for r in refs)
        self.host_layout = HostLayout.of(self.kv, bpc, canonical)
        self.offsets = list(self.host_layout.offsets)
        self.host = rng.integers(0, 256, (host_blocks, self.host_layout.row_bytes), dtype=np.uint8)

    def layout(self, compiled: bool = True, host_base: int | None = None):
        """The worker's `CompactLayout` over these buffers (host rows at `host_base` if given)."""
        from offload_core.compact import CompactLayout

        base = self.host.ctypes.data if host_base is None else host_base
        return CompactLayout(self.kv, self.host_layout, base, self.host.shape[1], self.host.shape[0], compiled)

    def snapshot(self):
        return [a.copy() for a in self.device], self.host.copy()

    def expected(self, direction, device, host):
        """Device pages and host rows after the reference model moved the transfer's bytes."""
        from offload_core.testing.reference import reference_transfer

        expected_dev, expected_host = self.snapshot()
        reference_transfer(
            direction,
            expected_dev,
            expected_host,
            self.offsets,
            self.group_refs,
            self.bpc,
            device.block_ids,
            device.group_sizes,
            device.block_indices,
            host.block_ids,
            host_pages=self.host_layout.pages,
        )
        return expected_dev, expected_host

    def gaps(self):
        """The bytes between device rows, which no copy may touch."""
        return [b[:, p:].copy() for b, p in zip(self.backing, self.pages)]

    def buffers(self):
        return [(a.ctypes.data, a.nbytes) for a in self.backing] + [(self.host.ctypes.data, self.host.nbytes)]


@contextlib.contextmanager
def python_sigint():
    """SIGINT handled by Python's own handler (KeyboardInterrupt) for the block, as in a
    terminal; the handler before it is put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def send_ctrl_c() -> None:
    """A real SIGINT, as a terminal's Ctrl-C sends, directed at the main thread (where CPython
    runs its handler). Sent from the main thread, `pthread_kill` runs the Python handler before
    it returns: a KeyboardInterrupt not held back comes from this call. (`os.kill` sends it to
    the process, and the kernel may hand it to another thread, whose C handler the main thread
    notices only at a later bytecode: under load, after the call the test meant.)"""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


class CtrlCInside:
    """Sends a real SIGINT from inside the next call, once `arm`ed, of any of the methods
    `names` of `obj` (each wrapped on the instance), before the method runs (`after`: once it
    has returned). `sent`: it was sent; `returned`: that call returned (the interrupt did not
    cut it short)."""

    def __init__(self, obj, *names: str, after: bool = False):
        self.armed = self.sent = self.returned = False
        self.after = after
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def arm(self) -> CtrlCInside:
        self.armed, self.sent, self.returned = True, False, False
        return self

    def _wrap(self, method):
        def wrapper(*args, **kwargs):
            if not self.armed:
                return method(*args, **kwargs)
            self.armed = False
            if not self.after:
                self.sent = True
                send_ctrl_c()
            result = method(*args, **kwargs)
            self.returned = True
            if self.after:
                self.sent = True
                send_ctrl_c()
            return result

        return wrapper


def ctrl_c_inside_calls(backend, device: str, store: bool) -> None:
    """A real Ctrl-C from inside `backend`'s copy as a submit launches its job, as a `wait`
    launches a job that waited, and from inside a stream's release as `shutdown` closes the
    worker, on any backend: each call finishes its step, then raises KeyboardInterrupt; every
    job reports once, successful, with its bytes right, and the worker goes on working.
    `backend`'s methods are wrapped; call it with SIGINT raising KeyboardInterrupt
    (`python_sigint`)."""
    import pytest

    from offload_core import DeviceBlocks, Direction, HostBlocks, KVCacheRef, OffloadWorker

    layers, blocks, page = 4, 16, 4096
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=gen) for _ in range(layers)]
    kv = KVCaches([KVCacheTensor(t.to(device), page) for t in tensors], [[KVCacheRef(i, page) for i in range(layers)]])
    worker = OffloadWorker(kv, blocks, backend=backend)
    rows = torch.randint(0, 256, (blocks, layers * page), dtype=torch.uint8, generator=gen)
    for i, view in enumerate(worker.host_tensors):
        view.view(torch.uint8).copy_(rows[:, i * page : (i + 1) * page])
    host = list(worker.host_tensors)  # views of the host buffer, for the checks after shutdown
    lane = worker._queues[Direction.STORE if store else Direction.LOAD]
    lane._launcher = object()  # no launcher thread: jobs go with a submit or a wait only
    copy = CtrlCInside(backend, "copy_blocks")

    def submit(job_id: int) -> None:
        if store:
            worker.submit_store(job_id, DeviceBlocks([job_id]), HostBlocks([job_id]))
        else:
            worker.submit_load(job_id, HostBlocks([job_id]), DeviceBlocks([job_id]))

    def check(job_ids) -> None:
        results = worker.get_finished()
        assert [(r.job_id, r.success) for r in results] == [(j, True) for j in job_ids]
        for j in job_ids:
            device_row = torch.cat([t.tensor[j].cpu() for t in kv.tensors])
            host_row = torch.cat([v.view(torch.uint8)[j] for v in host])
            assert torch.equal(device_row, host_row), f"job {j}: wrong bytes"

    lane.launch_cost = PinnedWindow(0.0)  # no burst: a submit launches its job itself
    copy.arm()
    with pytest.raises(KeyboardInterrupt):
        submit(1)
    assert copy.sent and copy.returned, "the interrupt cut the submit's launch short"
    worker.wait([1])
    check([1])

    lane.launch_cost = PinnedWindow(1e9)  # every submit part of a burst: the job waits for a launch
    submit(2)
    assert lane.waiting_for_launch()
    copy.arm()
    with pytest.raises(KeyboardInterrupt):
        worker.wait([2])
    assert copy.sent and copy.returned, "the interrupt cut the wait's launch short"
    worker.wait([2])
    check([2])

    lane.launch_cost = PinnedWindow(0.0)
    submit(3)  # the worker goes on
    release = CtrlCInside(backend, "release_stream").arm()
    with pytest.raises(KeyboardInterrupt):
        worker.shutdown()
    assert release.sent and release.returned and worker.host_tensors == [], "shutdown cut short"
    check([3])
