"""Where a launch's host time goes: `offload-core bench`'s Llama-8B cache, 32 MiB jobs (16
blocks over 64 tensors of 32 KiB pages), one at a time, each launched by its own submit (a wait
after each), every step of interest wrapped in a timer. Needs a GPU.

    OFFLOAD_CORE_CUDA_CONF=mechanism:expand_staged python benchmarks/launch_steps.py

Prints, per host-block order (random, in runs), the wall time a job and each step's time a job
and a call. The timers cost about a microsecond a call.
"""

from __future__ import annotations

import collections
import os
import time

import numpy as np

import offload_core.backends.cuda as cuda
import offload_core.queue as queue
from offload_core import DeviceBlocks, HostBlocks, OffloadWorker, compact, get_backend
from offload_core.backends.cuda import blocks, events, kernels
from offload_core.bench import _preset, build_kv_caches

spent: collections.defaultdict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0
            calls[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    backend = get_backend("cuda")
    for owner, name, label in [
        (queue.TransferQueue, "_launch", "queue: the launch"),
        (cuda.CudaBackend, "copy_blocks", "backend: copy_blocks"),
        (blocks.BlockCopier, "copy", "copier: copy"),
        (compact.CompactLayout, "segments", "layout: host segments"),
        (blocks.ExpandStaged, "enqueue_job", "staged: enqueue_job"),
        (blocks, "_split", "staged: pieces cut"),
        (kernels, "expand", "kernel launch + table"),
        (backend.driver, "memcpy_batch_async", "driver: batch call"),
        (events.DriverEvent, "record", "event: record"),
        (events.DriverEvent, "wait", "event: wait"),
    ]:
        timed(owner, name, label)
    preset, host_blocks = _preset("llama-8b"), 64
    kv = build_kv_caches(preset, 2 * host_blocks, backend)
    rng = np.random.default_rng(0)
    print(f"{backend.device}, OFFLOAD_CORE_CUDA_CONF={os.environ.get('OFFLOAD_CORE_CUDA_CONF', '')!r}")
    for runs in (False, True):
        with OffloadWorker(kv, host_blocks, backend=backend) as worker:
            for _ in range(2):  # the first pass warms up (and lets auto decide)
                spent.clear()
                calls.clear()
                t0, jobs = time.perf_counter(), 0
                for i in range(40):
                    host = np.arange(16) + 16 * (i % 4) if runs else rng.permutation(host_blocks)[:16]
                    dev = rng.permutation(2 * host_blocks)[:16]
                    worker.submit_store(2 * i + 1, DeviceBlocks(dev), HostBlocks(host))
                    worker.wait([2 * i + 1])
                    worker.submit_load(2 * i + 2, HostBlocks(host), DeviceBlocks(dev))
                    worker.wait([2 * i + 2])
                    jobs += 2
                worker.get_finished()
                wall = time.perf_counter() - t0
        print(f"host blocks {'in runs' if runs else 'random'}: {wall / jobs * 1e6:.0f} us wall a job")
        for label in sorted(spent, key=spent.get, reverse=True):
            print(
                f"  {label:24s} {spent[label] / jobs * 1e6:7.1f} us a job {spent[label] / calls[label] * 1e6:7.1f} us a call"
            )


if __name__ == "__main__":
    main()
