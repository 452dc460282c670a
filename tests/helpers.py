"""Small KV caches on the host for worker tests, the compiled steps for tests of both paths, and
Ctrl-C raised where CPython runs signal handlers (`SignalPoints`, `ctrl_c_before_line`)."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import numpy as np
import pytest
import torch

from offload_core import KVCacheRef, KVCaches, KVCacheTensor, native


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


def host_copies(geometry_or_planner, direction, device, host) -> Copies:
    """Validate a transfer and expand it on the host (`CompactLayout.job`, then `.copies`), as
    `Backend.copy_blocks` does by default."""
    from offload_core.compact import CompactLayout
    from offload_core.plan import Planner

    planner = geometry_or_planner
    if not isinstance(planner, Planner):
        planner = Planner(geometry_or_planner)
    layout = CompactLayout(planner)
    job = layout.job(direction, device, host)
    return Copies(*layout.copies(job), job.nbytes)


def compact_layout(planner, compiled: bool):
    """A `CompactLayout` on the compiled steps (skipping where they were not built) or on numpy."""
    from offload_core.compact import CompactLayout

    layout = CompactLayout(planner, compiled=compiled)
    if compiled:
        compiled_or_skip(True)
    return layout


class SignalPoints:
    """A profiler that raises KeyboardInterrupt at the k-th point where CPython may run a signal
    handler on this thread, in code under `roots`: a Python function's entry (counted where its
    caller is under them), a C call's return. `where` says which point it was; None while the
    calls it watched had fewer than k points."""

    def __init__(self, k: int, roots: tuple[str, ...]):
        self.k, self.n, self.roots, self.where = k, 0, roots, None

    def __call__(self, frame, event, arg):
        caller = frame.f_back if event == "call" else frame if event == "c_return" else None
        if caller is None or not caller.f_code.co_filename.startswith(self.roots):
            return
        self.n += 1
        if self.n == self.k:
            sys.setprofile(None)
            name = getattr(arg, "__name__", frame.f_code.co_name)
            self.where = f"{event} {name} in {caller.f_code.co_name}:{caller.f_lineno}"
            raise KeyboardInterrupt


def ctrl_c_before_line(function, starts_with: str) -> None:
    """Raise KeyboardInterrupt once, as `function` (a Python function) is about to run its first
    line that starts with `starts_with`: where a signal's handler runs between two steps with
    no call between them, which a tracer's "call" event cannot reach."""
    import inspect

    lines, first = inspect.getsourcelines(function)
    target = first + next(i for i, line in enumerate(lines) if line.strip().startswith(starts_with))
    code = function.__code__

    def tracer(frame, event, arg):
        if event != "call" or frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == target:
                sys.settrace(None)
                raise KeyboardInterrupt
            return local

        return local

    sys.settrace(tracer)
