"""Timing copies on the GPU for transfer_bench.py, each through
`CudaBackend.enqueue_with` (the backend's own `mechanism` stays as it is).
"""

from __future__ import annotations

import time

import numpy as np

from offload_core.backend import Direction

SLEEP_CYCLES = 100_000_000  # about 50 ms: longer than enqueueing the largest batch we time


def streams(backend) -> tuple:
    """Three copy streams per backend, made once, as an engine reuses its two: the GPU spreads
    streams over a few hardware queues in creation order, so a stream per case would pair
    streams an engine never pairs."""
    made = getattr(backend, "_measure_streams", None)
    if made is None:
        made = backend._measure_streams = tuple(backend.new_stream() for _ in range(3))
    return made


def time_copy(backend, mechanism: str, src, dst, sizes, direction: Direction, *, busy: bool) -> dict:
    """Best of three: device seconds (events), wall seconds (submit to completion) and host
    seconds (the enqueue call alone). `busy` first puts a sleep on the stream, so that the
    events time the device alone."""
    torch = backend._torch
    stream = streams(backend)[0]
    best = {"event_s": float("inf"), "wall_s": float("inf"), "host_s": float("inf"), "mechanism": mechanism}
    for _ in range(3):
        torch.cuda.synchronize()
        start, end = backend.new_event(), backend.new_event()
        if busy:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        start.record(stream)
        best["mechanism"] = backend.enqueue_with(mechanism, src, dst, sizes, direction, stream)
        best["host_s"] = min(best["host_s"], time.perf_counter() - t0)
        end.record(stream)
        end.synchronize()
        best["wall_s"] = min(best["wall_s"], time.perf_counter() - t0)
        best["event_s"] = min(best["event_s"], start.elapsed_time(end) / 1e3)
    return best


def time_jobs(backend, mechanism: str, src, dst, sizes, direction: Direction, jobs: int = 8) -> dict:
    """What an engine that submits job after job sees: wall seconds from the first submission
    on an idle GPU to the last job's completion, and the median host seconds of one enqueue
    (the first enqueue after the GPU went idle, or one behind a sleeping stream, reads high)."""
    torch = backend._torch
    stream, end = streams(backend)[0], backend.new_event()
    backend.enqueue_with(mechanism, src, dst, sizes, direction, stream)  # staging buffers, compiled kernels
    torch.cuda.synchronize()
    enqueue = []
    t0 = time.perf_counter()
    for _ in range(jobs):
        t = time.perf_counter()
        backend.enqueue_with(mechanism, src, dst, sizes, direction, stream)
        enqueue.append(time.perf_counter() - t)
    end.record(stream)
    end.synchronize()
    return {"wall_s": time.perf_counter() - t0, "host_s": float(np.median(enqueue))}


def time_both(backend, mechanism: str, store_args, load_args, *, released: str, reps: int = 3) -> list[float]:
    """Device seconds, per rep, for a store and a load on two streams at the same time.

    A sleep on a third stream holds both until everything is enqueued; then, `released`
    ``"together"``, both start at once, or ``"own"``, each after a short sleep on its own
    stream (the H200's copy engines treat the two differently).
    """
    torch = backend._torch
    s1, s2, gate_stream = streams(backend)
    times = []
    for rep in range(reps + 1):  # rep 0 warms up
        torch.cuda.synchronize()
        gate, start, e1, e2 = (backend.new_event() for _ in range(4))
        with torch.cuda.stream(gate_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        gate.record(gate_stream)
        for stream in (s1, s2):
            stream.wait_event(gate)
            if released == "own":
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(SLEEP_CYCLES // 100)
        start.record(s1)
        for stream, args, end in ((s1, store_args, e1), (s2, load_args, e2)):
            backend.enqueue_with(mechanism, *args, stream)
            end.record(stream)
        e1.synchronize()
        e2.synchronize()
        if rep:
            times.append(max(start.elapsed_time(e1), start.elapsed_time(e2)) / 1e3)
    return times


def fragments(n: int, size: int, device_base: int, host_base: int, seed: int = 0):
    """`n` fragments of `size` bytes: device side scattered over 2n slots; host side in rows of
    2 MiB filled in order (a host block holds one block's pages of all layers), rows shuffled."""
    rng = np.random.default_rng(seed)
    dev = device_base + rng.permutation(2 * n)[:n].astype(np.int64) * size
    per_row = max(1, (2 << 20) // size)
    rows = rng.permutation(-(-n // per_row)).astype(np.int64)
    k = np.arange(n, dtype=np.int64)
    host = host_base + rows[k // per_row] * per_row * size + (k % per_row) * size
    return dev, host, np.full(n, size, dtype=np.int64)
