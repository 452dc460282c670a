"""Offloading specs that note what vLLM's connector submits, for `serve.py`.

`RecordingOffloadCoreSpec` is offload-core's spec and `RecordingCPUSpec` vLLM's own; each wraps
its worker's ``submit_store``, ``submit_load`` and ``get_finished`` to note every job (blocks,
host chunks, bytes, when, from which thread, how long the submit took), every result and how
long after its submit the engine saw it, and the time both calls took on the engine's thread
(what offloading costs a step there). Both
specs are wrapped the same way, so the comparison between them stays fair. vLLM imports this
module by name (``spec_module_path: "recording_spec"``) in its engine process; `serve.py` reads
the notes back with `summary` through ``LLM.collective_rpc``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from offload_core.integrations.vllm import OffloadCoreOffloadingSpec

_lock = threading.Lock()
_jobs: list[tuple] = []  # (direction, expedited, device blocks, host chunks, bytes, t, submit seconds, thread)
_results = {"finished": 0, "failed": 0, "failed_ids": []}
_submitted: dict = {}  # job id -> (direction, submit time), until its result is seen
_seen: list[tuple] = []  # (direction, seconds from the submit to the get_finished that returned it)
_calls = {"get_finished": 0, "get_finished_s": 0.0}
_worker: list = [None]  # the worker wrapped last: the engine process has one


def _wrap(spec, worker):
    if getattr(worker, "_recorded", False):  # get_worker returns the same worker on every call
        return worker
    per_block = int(spec.config.worker_kv_bytes_per_block)
    store, load, finished = worker.submit_store, worker.submit_load, worker.get_finished

    def note(job_id, direction, expedited, src, dst, t0, ok):
        dev = src if direction == "store" else dst
        host = dst if direction == "store" else src
        n = len(dev.block_ids)
        with _lock:
            _submitted[job_id] = (direction, t0)
            _jobs.append(
                (
                    direction,
                    expedited,
                    n,
                    len(host.block_ids),
                    n * per_block,
                    t0,
                    time.perf_counter() - t0,
                    threading.get_ident(),
                )
            )
        return ok

    def submit_store(job_id, src_spec, dst_spec):
        t0 = time.perf_counter()
        return note(job_id, "store", False, src_spec, dst_spec, t0, store(job_id, src_spec, dst_spec))

    def submit_load(job_id, src_spec, dst_spec, expedited=False):
        t0 = time.perf_counter()
        return note(
            job_id, "load", expedited, src_spec, dst_spec, t0, load(job_id, src_spec, dst_spec, expedited=expedited)
        )

    def get_finished():
        t0 = time.perf_counter()
        results = finished()
        now = time.perf_counter()
        with _lock:
            _calls["get_finished"] += 1
            _calls["get_finished_s"] += now - t0
            _results["finished"] += len(results)
            for r in results:
                sub = _submitted.pop(r.job_id, None)
                if sub is not None:
                    _seen.append((sub[0], now - sub[1]))
                if not r.success:
                    _results["failed"] += 1
                    _results["failed_ids"].append(r.job_id)
        return results

    worker.submit_store, worker.submit_load, worker.get_finished = submit_store, submit_load, get_finished
    worker._recorded = True
    _worker[0] = worker
    return worker


class RecordingOffloadCoreSpec(OffloadCoreOffloadingSpec):
    """offload-core's spec, its jobs noted."""

    def get_worker(self, kv_caches):
        return _wrap(self, super().get_worker(kv_caches))


class RecordingCPUSpec(CPUOffloadingSpec):
    """vLLM's own CPU spec, its jobs noted."""

    def get_worker(self, kv_caches):
        return _wrap(self, super().get_worker(kv_caches))


def reset() -> None:
    """Forget the jobs and results noted so far."""
    with _lock:
        _jobs.clear()
        _seen.clear()
        _results.update(finished=0, failed=0, failed_ids=[])
        _calls.update(get_finished=0, get_finished_s=0.0)


def _hist(values: np.ndarray) -> dict[str, int]:
    """Counts per power-of-two bin, keyed by the bin's range ("1", "2-3", "4-7", ...)."""
    out: dict[str, int] = {}
    if values.size == 0:
        return out
    bins = np.floor(np.log2(np.maximum(values, 1))).astype(int)
    for b in range(bins.max() + 1):
        c = int((bins == b).sum())
        if c:
            lo, hi = 1 << b, (1 << (b + 1)) - 1
            out[str(lo) if lo == hi else f"{lo}-{hi}"] = c
    return out


def _plain(value):
    return dict(value) if isinstance(value, dict) else value  # a Counter as a plain dict (asdict would miscount it)


def summary() -> dict:
    """The jobs noted since `reset`, per direction: how many, expedited ones, device blocks and
    bytes (histogram, median, total), jobs per second over the span they were submitted in,
    submit time (median, p99, in microseconds; the three slowest, with their blocks and their
    place among the direction's jobs), threads that submitted, time from a submit to
    the ``get_finished`` that returned its result (median, p99, in milliseconds); the results
    (finished, failed); the engine thread's time in submits and ``get_finished`` together
    (``engine_thread_ms``, and ``get_finished`` calls); and offload-core's
    `OffloadWorker.stats()` where its worker ran."""
    with _lock:
        jobs = list(_jobs)
        seen = list(_seen)
        results = dict(_results, failed_ids=list(_results["failed_ids"][:20]))
        calls = dict(_calls)
    out: dict = {"results": results, "directions": {}}
    out["get_finished_calls"] = calls["get_finished"]
    out["engine_thread_ms"] = 1e3 * (calls["get_finished_s"] + sum(j[6] for j in jobs))
    for direction in ("store", "load"):
        rows = [j for j in jobs if j[0] == direction]
        if not rows:
            continue
        blocks = np.array([r[2] for r in rows])
        nbytes = np.array([r[4] for r in rows])
        t = np.array([r[5] for r in rows])
        submit_us = np.array([r[6] for r in rows]) * 1e6
        span = float(t.max() - t.min())
        out["directions"][direction] = {
            "jobs": len(rows),
            "expedited": sum(1 for r in rows if r[1]),
            "blocks_hist": _hist(blocks),
            "blocks_median": float(np.median(blocks)),
            "bytes_median": float(np.median(nbytes)),
            "bytes_total": int(nbytes.sum()),
            "host_chunks_total": int(sum(r[3] for r in rows)),
            "jobs_per_s": len(rows) / span if span > 0 else None,
            "submit_us_median": float(np.median(submit_us)),
            "submit_us_p99": float(np.percentile(submit_us, 99)),
            "threads": len({r[7] for r in rows}),
            # the three slowest submits: what held the engine's thread longest, and when
            "slowest": [
                {"submit_ms": r[6] * 1e3, "blocks": r[2], "index": rows.index(r)}
                for r in sorted(rows, key=lambda r: -r[6])[:3]
            ],
        }
        done_ms = np.array([s for d, s in seen if d == direction]) * 1e3
        if done_ms.size:
            out["directions"][direction]["done_ms_median"] = float(np.median(done_ms))
            out["directions"][direction]["done_ms_p99"] = float(np.percentile(done_ms, 99))
    inner = getattr(_worker[0], "worker", None)  # offload-core's OffloadWorker behind the adapter
    if inner is not None and hasattr(inner, "stats"):
        out["offload_core_stats"] = {
            lane: {f.name: _plain(getattr(s, f.name)) for f in dataclasses.fields(s)}
            for lane, s in inner.stats().items()
        }
        out["backend"] = inner.backend.name
    return out
