"""Where an engine's host time per compact job goes: the submit and launch steps timed inside
a run of small jobs back to back (each wrapped in a perf_counter timer, about 0.2 us a call).

    python benchmarks/investigations/host_breakdown.py [--page 256] [--blocks-per-job 64] [--tensors 64]
        [--jobs 128] [--rounds 5] [--backend cuda] [--profile 40] [--alternate-join]

Prints, per step, calls per job and microseconds per job (a step's time includes the steps it
calls; "launch" also the GIL hand-overs inside it), and the whole run's wall time per job.
Runs on cuda, or on the cpu with `offload_core.testing.expanding` (--backend expanding).
With --profile N, the timers give way to cProfile on the main thread (where a burst's submits
launch it), and the N functions of most own time, then of most cumulative time, are printed, per job.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import pstats
import threading
import time
import traceback
from collections import defaultdict

import numpy as np
import torch

from offload_core import (
    DeviceBlocks,
    HostBlocks,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadWorker,
    compact,
    get_backend,
    queue,
    worker,
)

TIMES: dict = defaultdict(float)
CALLS: dict = defaultdict(int)
WAITS: dict = defaultdict(lambda: [0, 0.0])  # the main thread's Condition waits: callers -> [calls, seconds]


def timed(owner, name: str, label: str) -> None:
    """Replace `owner.name` by a wrapper that adds its time under `label`, per thread kind."""
    fn = getattr(owner, name)
    wrapper = timed_call(fn.__func__ if isinstance(fn, staticmethod) else fn, label)
    setattr(owner, name, staticmethod(wrapper) if isinstance(owner.__dict__.get(name), staticmethod) else wrapper)


def timed_call(fn, label: str):
    """`fn` wrapped to add its time under `label`, per thread kind."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            key = (label, threading.current_thread() is threading.main_thread())
            TIMES[key] += time.perf_counter() - t0
            CALLS[key] += 1

    return wrapper


def instrument_waits() -> None:
    """Time the main thread's `threading.Condition.wait` calls by their four callers."""
    wait = threading.Condition.wait

    def timed_wait(self, timeout=None):
        if threading.current_thread() is not threading.main_thread():
            return wait(self, timeout)
        t0 = time.perf_counter()
        try:
            return wait(self, timeout)
        finally:
            frames = traceback.extract_stack(limit=5)[:-1]
            key = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames))
            WAITS[key][0] += 1
            WAITS[key][1] += time.perf_counter() - t0

    threading.Condition.wait = timed_wait


def instrument(backend_name: str) -> None:
    timed(DeviceBlocks, "__init__", "specs (the benchmark's, before each submit)")
    timed(HostBlocks, "__init__", "specs (the benchmark's, before each submit)")
    timed(worker.OffloadWorker, "submit_store", "submit")
    timed(worker.OffloadWorker, "submit_load", "submit")
    timed(compact.CompactLayout, "job", "submit: CompactLayout.job")
    timed(queue.TransferQueue, "submit", "submit: queue (launches inline included)")
    timed(queue.TransferQueue, "_run", "launch")
    timed(queue.TransferQueue, "_take", "launch: _take (clash check)")
    timed(compact.CompactJob, "concat", "launch: CompactJob.concat")
    timed(compact.CompactJob, "in_host_order", "launch: CompactJob.in_host_order")
    timed(queue.TransferQueue, "_event", "launch: the queue's events")
    timed(queue, "_after", "launch: _after (the events waited for)")
    timed(worker.OffloadWorker, "get_finished", "get_finished")
    timed(worker.OffloadWorker, "_launch_submitted", "submit: its launch (compiled submit)")
    if backend_name == "cuda":
        from offload_core.backends.cuda import CudaBackend, blocks, events, kernels, ring
        from offload_core.backends.cuda import driver as drv

        timed(CudaBackend, "copy_blocks", "launch: backend.copy_blocks")
        timed(CudaBackend, "current_stream", "current_stream")
        timed(blocks.BlockCopier, "choose", "launch: copy_blocks: choose")
        timed(compact.CompactLayout, "segments", "launch: copy_blocks: segments")
        timed(compact.CompactLayout, "segment_summary", "launch: copy_blocks: choose: segment_summary")
        timed(ring.DescriptorRing, "upload", "launch: copy_blocks: ring upload")
        timed(ring.DescriptorRing, "upload_launch", "launch: copy_blocks: upload and launch, compiled")
        reserve = ring.DescriptorRing._reserve

        def counted_reserve(self, count):  # None: the ring is full, the upload takes one-off pinned memory
            start = reserve(self, count)
            if start is None:
                key = (
                    "launch: copy_blocks: ring full, one-off pinned tables",
                    threading.current_thread() is threading.main_thread(),
                )
                CALLS[key] += 1
                TIMES[key] += 0.0
            return start

        ring.DescriptorRing._reserve = counted_reserve
        timed(kernels, "_launch", "launch: copy_blocks: kernel launch")
        timed(kernels, "expand", "launch: copy_blocks: kernels.expand")
        timed(blocks.BlockCopier, "direct_programs", "launch: copy_blocks: direct_programs")
        timed(blocks.BlockCopier, "copy", "launch: copy_blocks: BlockCopier.copy")
        timed(drv.Driver, "memcpy_batch_async", "launch: copy_blocks: cuMemcpyBatchAsync")
        timed(blocks.ExpandStaged, "enqueue_job", "launch: copy_blocks: expand_staged pieces")
        timed(blocks.BlockCopier, "expand", "launch: copy_blocks: table upload and kernel")
        timed(events.DriverEvent, "wait", "event wait (a stream waits)")
        timed(events.DriverEvent, "record", "event record")
        timed(events.DriverEvent, "query", "event query")
        timed(events.RawStream, "wait_event", "stream wait_event")
    else:
        from offload_core.testing.expanding import ExpandingCpuBackend

        timed(ExpandingCpuBackend, "copy_blocks", "launch: backend.copy_blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", help="cuda, or expanding (the cpu backend with the compact path)")
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--blocks-per-job", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, help="device blocks per tensor (default: 1024, or twice a job)")
    parser.add_argument("--profile", type=int, help="cProfile the main thread; print this many functions")
    parser.add_argument(
        "--alternate-join",
        action="store_true",
        help="every other round with the backend's joined launch declined (`copy_jobs`): both walls, one process",
    )
    args = parser.parse_args()
    if args.backend == "expanding":
        from offload_core.testing.expanding import ExpandingCpuBackend

        backend = ExpandingCpuBackend()
    else:
        backend = get_backend(args.backend)
    if not args.profile:
        instrument("cuda" if backend.name == "cuda" else "expanding")
        instrument_waits()
    profile = cProfile.Profile()
    blocks = args.blocks or max(1024, 2 * args.blocks_per_job)
    tensors = [
        KVCacheTensor(torch.zeros(blocks, args.page, dtype=torch.int8, device=backend.device), args.page)
        for _ in range(args.tensors)
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, args.page) for i in range(args.tensors)]])
    rng = np.random.default_rng(0)
    n = args.blocks_per_job
    dev_perm, host_perm = rng.permutation(blocks), rng.permutation(blocks)
    ids = [
        (
            np.take(dev_perm, np.arange(j * n, (j + 1) * n), mode="wrap"),
            np.take(host_perm, np.arange(j * n, (j + 1) * n), mode="wrap"),
        )
        for j in range(args.jobs)
    ]
    walls, unjoined = [], []  # per round, store and load wall per job (`unjoined`: --alternate-join's other rounds)
    with OffloadWorker(kv, blocks, backend=backend) as w:
        for r in range(args.rounds + 1):
            if r == 1:  # the first round compiles and allocates
                TIMES.clear()
                CALLS.clear()
                WAITS.clear()
                gc.collect()  # the setup's garbage collected now, not by a pause inside a measured round
                if args.profile:
                    profile.enable()
            first = r * args.jobs * 2
            joins = not (args.alternate_join and r % 2 == 0)
            if args.alternate_join:  # an instance attribute over the class's method
                vars(backend).pop("copy_jobs", None)
                if not joins:
                    backend.copy_jobs = lambda *a: None
            t0 = time.perf_counter()
            for j, (d, h) in enumerate(ids):
                w.submit_store(first + j, DeviceBlocks(d), HostBlocks(h))
            w.wait(range(first, first + args.jobs))
            t1 = time.perf_counter()
            for j, (d, h) in enumerate(ids):
                w.submit_load(first + args.jobs + j, HostBlocks(h), DeviceBlocks(d))
            w.wait(range(first + args.jobs, first + 2 * args.jobs))
            t2 = time.perf_counter()
            w.get_finished()
            if r:
                (walls if joins else unjoined).append(((t1 - t0) / args.jobs, (t2 - t1) / args.jobs))
    profile.disable()
    jobs = 2 * args.jobs * args.rounds
    store, load = np.median(walls, axis=0) * 1e6
    print(
        f"{backend.name}: {args.tensors} tensors x {n} blocks x {args.page} B "
        f"({args.tensors * n * args.page / 2**20:.2f} MiB a job), {args.jobs} jobs back to back, {args.rounds} rounds: "
        f"wall per job {store:.1f} us (store) / {load:.1f} us (load)"
    )
    if unjoined:
        store, load = np.median(unjoined, axis=0) * 1e6
        print(
            f"  the rounds between them, copy_jobs declined: wall per job {store:.1f} us (store) / {load:.1f} us (load)"
        )
    if args.profile:
        stats = pstats.Stats(profile)
        for order, column in (("own", 2), ("cumulative", 3)):
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][column])[: args.profile]
            print(f"by {order} time:")
            print(f"{'function':70} {'calls/job':>9} {'own us/job':>10} {'cum us/job':>10}")
            for (path, line, name), (_, calls, own, cum, _) in rows:
                where = f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line} {name}"
                print(f"{where[:70]:70} {calls / jobs:9.2f} {own / jobs * 1e6:10.2f} {cum / jobs * 1e6:10.2f}")
        return
    print(f"{'step':58} {'thread':9} {'calls/job':>9} {'us/call':>8} {'us/job':>7}")
    for (label, main_thread), seconds in sorted(TIMES.items()):
        calls = CALLS[(label, main_thread)]
        print(
            f"{label:58} {'main' if main_thread else 'launcher':9} {calls / jobs:9.2f} "
            f"{seconds / calls * 1e6:8.1f} {seconds / jobs * 1e6:7.1f}"
        )
    if WAITS:
        print("the main thread's Condition waits, by caller (innermost first):")
        for key, (calls, seconds) in sorted(WAITS.items(), key=lambda kv: -kv[1][1])[:8]:
            print(f"  {calls / jobs:6.2f} calls/job {seconds / jobs * 1e6:9.1f} us/job  {key}")


if __name__ == "__main__":
    main()
