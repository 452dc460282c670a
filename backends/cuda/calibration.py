"""Calibration (`offload-core calibrate`): measure a GPU's copy costs into a `select.CostModel`,
save it as that GPU model's profile, and find the saved profile when a backend starts.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cuda import kernels, measure
from offload_core.backends.cuda.select import CostModel, profile_path

log = logging.getLogger(__name__)


def saved_profile(device_name: str) -> CostModel:
    """The profile saved for this GPU model, or the H200 defaults where none is saved or it
    cannot be read (which is logged)."""
    path = profile_path(device_name)
    if path.exists():
        try:
            return CostModel.load(path)
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable cuda profile %s: %s", path, exc)
    return CostModel()


def calibrate(backend, save: bool = True) -> dict:
    """Measure `backend`'s copy costs (a few seconds): link speed and per-copy costs of each
    available mechanism, the host time of their enqueues, and the staging gather. Make them its
    cost model, and save them as its GPU model's profile unless `save` is False.

    Returns:
        The measured cost model as a dict, with ``profile`` (the file) and ``saved``.

    Raises:
        ConfigError: a mechanism the measurement needs is unavailable (the copy engines' batch
            API measures the link).
        Exception: anything the GPU, its driver or the profile's folder raises.
    """
    torch = backend._torch
    available = backend.available_mechanisms
    span = 256 << 20
    device = torch.zeros(2 * span, dtype=torch.uint8, device=backend.device)  # fragments scatter over 2x
    staging = torch.zeros(span, dtype=torch.uint8, device=backend.device)
    host = backend.alloc_host(span)
    name = backend.runtime.get_device_name(backend.device)
    model = CostModel(source=f"offload-core calibrate on {name}")
    one = np.ones(1, dtype=np.int64)
    for direction in Direction:
        d = direction.value

        def timed(mechanism, dev, hst, sizes):
            src, dst = (dev, hst) if direction is Direction.STORE else (hst, dev)
            return measure.time_copy(backend, mechanism, src, dst, sizes, direction, busy=True)["event_s"]

        def run(mechanism, n, size):
            return timed(mechanism, *measure.fragments(n, size, device.data_ptr(), host.data_ptr()))

        whole = timed("ce_batch", one * device.data_ptr(), one * host.data_ptr(), one * span)
        model.ce_gbps[d] = span / whole / 1e9
        if "ce_batch" in available:
            model.ce_desc_s[d] = run("ce_batch", 65536, 256) / 65536
            model.ce_tail_s = max(0.0, run("ce_batch", 16384, 16384) / 16384 - 16384 / (model.ce_gbps[d] * 1e9))
        if "sm_gather" in available:
            model.sm_gbps[d] = span / run("sm_gather", 4096, 65536) / 1e9
            model.sm_desc_s[d] = run("sm_gather", 65536, 256) / 65536

    def host_s(mechanism, n, size, reps=15):  # median host time of one enqueue, job after job
        dev, hst, sizes = measure.fragments(n, size, device.data_ptr(), host.data_ptr())
        return measure.time_jobs(backend, mechanism, dev, hst, sizes, Direction.STORE, jobs=reps)["host_s"]

    if "ce_batch" in available:
        model.ce_host_s = host_s("ce_batch", 16384, 16384, reps=5) / 16384
    if kernels.why_unavailable() is None:
        stream, start, end = backend.new_stream(), backend.new_event(), backend.new_event()
        ring = backend._ring

        def gather_s(n, size):
            dev_a, dev_b, sizes = measure.fragments(n, size, device.data_ptr(), staging.data_ptr())
            for _ in range(2):  # the first launch compiles
                held: list = []  # one-off table memory, where the ring is full: until the kernel ran
                regions = ring.open()
                start.record(stream)
                kernels.launch(
                    dev_a, dev_b, sizes, stream, backend.gather_programs, ring, held, device=backend.device_index
                )
                end.record(stream)
                ring.retire(end, regions)
                end.synchronize()
            return start.elapsed_time(end) / 1e3

        model.gather_gbps = span / gather_s(16384, 16384) / 1e9
        model.gather_desc_s = max(0.0, gather_s(65536, 256) / 65536 - 256 / (model.gather_gbps * 1e9))
    path = profile_path(name)
    if save:
        model.save(path)
    backend.cost = model
    return {"profile": str(path), "saved": save, **asdict(model)}
