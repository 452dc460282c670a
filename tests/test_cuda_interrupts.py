"""A real Ctrl-C from inside a cuda worker's calls (`helpers.ctrl_c_inside_calls`): the cuda
backend's enqueue as a submit or a wait launches, its stream release as shutdown closes; per
mechanism, direction and core path. Each call finishes its step before the KeyboardInterrupt,
with real events and bytes. Skipped without a GPU."""

from __future__ import annotations

import pytest
from helpers import ctrl_c_inside_calls, python_sigint

from offload_core.backends.cuda import CudaBackend

REASON = CudaBackend.probe()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=f"cuda: {REASON}")]


@pytest.mark.parametrize(
    "mechanism, direction, native",
    [
        ("auto", "store", "0"),
        ("auto", "load", "0"),
        ("auto", "store", "1"),
        ("expand_staged", "store", "0"),
        ("expand_direct", "store", "0"),
        ("ce_batch", "store", "0"),
    ],
)
def test_ctrl_c_inside_cuda_submits_waits_and_shutdown(mechanism, direction, native, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", native)
    backend = CudaBackend(mechanism=mechanism)
    why = None if mechanism == "auto" else backend.why_unavailable(mechanism)
    if why is not None:
        pytest.skip(why)
    with python_sigint():
        ctrl_c_inside_calls(backend, "cuda", direction == "store")
