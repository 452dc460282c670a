"""Ctrl-C at every point of a worker's submits and wait where CPython runs signal handlers, in
the core's and the backend's Python, one point after another on one worker, for any backend
(`tests/test_interrupts.py` runs it on the cpu backend, `tests/test_cuda_interrupts.py` on a
GPU). After each: nothing hangs, every queued job reports once and in its round, no result comes
before the copies it enqueued can have run, the bytes of every successful job are right, and
the worker goes on working."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import SignalPoints

from offload_core import DeviceBlocks, Direction, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker

LAYERS, BLOCKS, PAGE, PER_JOB = 8, 64, 4096, 8


def _returns(call, seconds: float = 20) -> bool:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def sweep(backend, device: str, store: bool, roots: tuple[str, ...], hold: Callable) -> None:
    """Run two jobs and a wait for them, round after round, with a Ctrl-C at the k-th signal
    point under `roots` in round k, until a round runs through; fails with what broke.

    Args:
        backend: a backend instance (its copy methods are wrapped, to see which jobs they touch).
        device: where the KV cache lives.
        store: stores (device -> host) or loads.
        roots: the directories whose code the interrupts land in.
        hold: ``hold(stream) -> event``: holds `stream` a few ms with work of its own and
            returns an event recorded after it (a result before it has passed is early).
    """
    gen = torch.Generator(device=device).manual_seed(1)
    layers = [
        torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8, device=device, generator=gen) for _ in range(LAYERS)
    ]
    kv = KVCaches([KVCacheTensor(t, PAGE) for t in layers], [[KVCacheRef(i, PAGE) for i in range(LAYERS)]])
    worker = OffloadWorker(kv, BLOCKS, backend=backend)
    host = torch.cat(worker.host_tensors, dim=1)  # a copy: the rows to load are written through the views
    rows = torch.randint(0, 256, tuple(host.shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    offset = 0
    for view in worker.host_tensors:
        width = view.view(torch.uint8).shape[1]
        view.view(torch.uint8).copy_(rows[:, offset : offset + width])
        offset += width
    lane = worker._queues[Direction.STORE if store else Direction.LOAD]
    job_of_block, current = {}, [None]
    touched = set()  # jobs whose copies the backend began to enqueue

    def wrap(name, jobs_of):
        original = getattr(backend, name)

        def recording(*args, **kwargs):
            touched.update(jobs_of(args))
            return original(*args, **kwargs)

        setattr(backend, name, recording)

    wrap("copy_blocks", lambda a: {job_of_block.get(int(b)) for b in a[0].dev_ids})
    wrap("copy_jobs", lambda a: {job_of_block.get(int(b)) for j in a[0] for b in j.dev_ids})
    # a descriptor job's copies (a backend's compact launch may call copy_batch too, on any thread)
    wrap("copy_batch", lambda a: {current[0]} if sys._getframe(2).f_code.co_name == "submit" else set())
    rng = np.random.default_rng(3)
    broken, k, next_id, seen, jobs = [], 1, 0, {}, {}

    def check(results, gate_end):
        for r in results:
            if r.job_id in seen:
                broken.append(f"Ctrl-C at {k}: job {r.job_id} reported twice")
                continue
            dev, hst = seen.setdefault(r.job_id, jobs[r.job_id])
            if r.job_id in touched and not gate_end.query():
                broken.append(f"Ctrl-C at {k}: job {r.job_id}'s result before its copies could run")
            if r.success:
                got = torch.cat(worker.host_tensors, dim=1).view(torch.uint8)[hst] if store else None
                want = torch.cat([t[dev] for t in layers], dim=1).cpu()
                if not store:
                    got, want = want, rows[hst]
                if not torch.equal(got, want):
                    broken.append(f"Ctrl-C at {k}: job {r.job_id} succeeded with wrong bytes")

    while not broken:
        points = SignalPoints(k, roots)
        ids = []
        devs, hosts = rng.permutation(BLOCKS), rng.permutation(BLOCKS)  # the two jobs' blocks disjoint
        for i in range(2):
            jobs[next_id] = (devs[i * PER_JOB : (i + 1) * PER_JOB], hosts[i * PER_JOB : (i + 1) * PER_JOB])
            ids.append(next_id)
            next_id += 1
        job_of_block.clear()
        for job_id in ids:
            job_of_block.update((int(b), job_id) for b in jobs[job_id][0])
        touched.clear()
        gate_end = hold(lane._stream)
        submitted, interrupted = [], None
        sys.setprofile(points)
        try:
            for job_id in ids:
                dev, hst = jobs[job_id]
                current[0] = job_id
                if store:
                    worker.submit_store(job_id, DeviceBlocks(dev), HostBlocks(hst))
                else:
                    worker.submit_load(job_id, HostBlocks(hst), DeviceBlocks(dev))
                submitted.append(job_id)
            worker.wait(ids)
        except KeyboardInterrupt:
            interrupted = gate_end.query()
        finally:
            sys.setprofile(None)
        where = points.where
        if not _returns(lambda: worker.wait(ids)):
            pytest.fail(f"Ctrl-C at {k} ({where}): wait hangs")
        results = worker.get_finished()
        check(results, gate_end)
        reported = {r.job_id for r in results}
        for job_id in ids:
            if job_id in reported:
                continue
            if job_id in submitted:
                broken.append(f"Ctrl-C at {k} ({where}): job {job_id} queued, no result after its wait")
            elif job_id in touched and interrupted is False:
                broken.append(f"Ctrl-C at {k} ({where}): job {job_id} interrupted with copies in flight")
        if where is None:  # past the last point: the sequence ran through
            break
        k += 1
    assert k > 50, "too few points: the profiler saw none of the worker's code"
    assert _returns(worker.shutdown), "shutdown hangs"
    late = [r.job_id for r in worker.get_finished()]
    assert not late, f"results of jobs {late} came after their wait"
    assert not broken, "\n".join(broken[:20])
