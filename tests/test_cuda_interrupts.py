"""Ctrl-C at every point of a cuda worker's submits and wait where CPython runs signal
handlers, in the core's and the backend's Python, one point after another on one worker:
after each, nothing hangs, every queued job reports once, no result comes before the copies
it enqueued can have run, the bytes of every successful job are right, and the worker goes
on working. Skipped without a GPU."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch
from helpers import SignalPoints

import offload_core
from offload_core import DeviceBlocks, Direction, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker
from offload_core.backends.cuda import CudaBackend

REASON = CudaBackend.probe()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=f"cuda: {REASON}")]

LAYERS, BLOCKS, PAGE, PER_JOB = 8, 64, 4096, 8
ROOTS = (os.path.dirname(offload_core.__file__), os.path.dirname(sys.modules[CudaBackend.__module__].__file__))


def _returns(call, seconds: float = 20) -> bool:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


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
    store = direction == "store"
    gen = torch.Generator(device="cuda").manual_seed(1)
    shape = (BLOCKS, PAGE)
    layers = [torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen) for _ in range(LAYERS)]
    kv = KVCaches([KVCacheTensor(t, PAGE) for t in layers], [[KVCacheRef(i, PAGE) for i in range(LAYERS)]])
    worker = OffloadWorker(kv, BLOCKS, backend=backend)
    host = torch.cat(worker.host_tensors, dim=1)  # a copy: the rows to load are written through the views
    rows = torch.randint(0, 256, tuple(host.shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    offset = 0
    for view in worker.host_tensors:
        view.view(torch.uint8).copy_(rows[:, offset : offset + view.view(torch.uint8).shape[1]])
        offset += view.view(torch.uint8).shape[1]
    lane = worker._queues[Direction.STORE if store else Direction.LOAD]
    job_of_block, current = {}, [None]
    touched = set()  # jobs whose copies the backend began to enqueue

    def wrap(name, blocks_of):
        original = getattr(backend, name)

        def recording(*args, **kwargs):
            touched.update(blocks_of(args))
            return original(*args, **kwargs)

        setattr(backend, name, recording)

    wrap("copy_blocks", lambda a: {job_of_block.get(int(b)) for b in a[0].dev_ids})
    wrap("copy_jobs", lambda a: {job_of_block.get(int(b)) for j in a[0] for b in j.dev_ids})
    # a descriptor job's copies (a backend's compact launch may call copy_batch too, on any thread)
    wrap("copy_batch", lambda a: {current[0]} if sys._getframe(2).f_code.co_name == "submit" else set())
    rng = np.random.default_rng(3)
    broken, k, next_id, seen = [], 1, 0, {}

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

    jobs = {}
    while not broken:
        points = SignalPoints(k, ROOTS)
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
        with torch.cuda.stream(lane._stream):  # a torch stream: the backend's runtime is torch's
            torch.cuda._sleep(5_000_000)  # holds the lane's stream a few ms: a result before this ends is early
            gate_end = torch.cuda.Event()
            gate_end.record()
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
                broken.append(f"Ctrl-C at {k} ({where}): job {job_id} queued, no result")
            elif job_id in touched and interrupted is False:
                broken.append(f"Ctrl-C at {k} ({where}): job {job_id} interrupted with copies in flight")
        if where is None:  # past the last point: the sequence ran through
            break
        k += 1
    assert k > 50, "too few points: the profiler saw none of the worker's code"
    assert _returns(worker.shutdown), "shutdown hangs"
    assert worker.get_finished() == []  # every result came in its round
    assert not broken, "\n".join(broken[:20])
