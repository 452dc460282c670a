"""Ctrl-C at every point of a cuda worker's submits and wait (`ctrl_c_sweep`), per mechanism,
direction and core path. Skipped without a GPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from ctrl_c_sweep import sweep

import offload_core
from offload_core.backends.cuda import CudaBackend

REASON = CudaBackend.probe()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=f"cuda: {REASON}")]

ROOTS = (os.path.dirname(offload_core.__file__), os.path.dirname(sys.modules[CudaBackend.__module__].__file__))


def _hold(stream):
    with torch.cuda.stream(stream):  # a torch stream: the backend's runtime is torch's
        torch.cuda._sleep(5_000_000)
        end = torch.cuda.Event()
        end.record()
    return end


@pytest.mark.parametrize(
    "mechanism, direction, native",
    [
        ("auto", "store", "0"),
        ("auto", "load", "0"),
        ("auto", "store", "1"),
        ("expand_staged", "store", "0"),
        ("expand_split", "store", "0"),
        ("ce_batch", "store", "0"),
    ],
)
def test_ctrl_c_at_every_point_of_cuda_submits_and_a_wait(mechanism, direction, native, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", native)
    backend = CudaBackend(mechanism=mechanism)
    why = None if mechanism == "auto" else backend.why_unavailable(mechanism)
    if why is not None:
        pytest.skip(why)
    sweep(backend, "cuda", direction == "store", ROOTS, _hold)
