"""Host time of building a job's specs and `submit_store` with a backend that copies nothing:
the cost of the worker's own bookkeeping (validation, planning, locks, queueing), without a
device.

16-block jobs over 64 KV tensors (K and V of 32 layers), random block ids; median and p99
of 2000 jobs after 200 warm-up jobs, on one thread, and again while a second thread polls
`get_finished` every 200 us (an engine polls once per step; the lock then has a second user). Run it at two commits to see
what a change costs:

    python benchmarks/submit_overhead.py [--page 32768] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

import numpy as np
import torch

from offload_core import Backend, DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker

TENSORS, BLOCKS, PER_JOB = 64, 256, 16


class _Done:
    def record(self, stream):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 0.0


class _Stream:
    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class NullBackend(Backend):
    """Every copy is done the moment it is asked for, and copies nothing."""

    name = "null"

    @classmethod
    def probe(cls):
        return None

    @property
    def device(self):
        return torch.device("cpu")

    def new_stream(self):
        return _Stream()

    def new_event(self):
        return _Done()

    def current_stream(self):
        return _Stream()

    def alloc_host(self, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def copy_batch(self, src, dst, sizes, direction, stream):
        return None


class NullExpandingBackend(NullBackend):
    """`NullBackend` taking compact jobs (block ids), as the cuda backend does."""

    def prepare_layout(self, layout):
        return layout

    def copy_blocks(self, job, prepared, stream, after):
        return "null"


def measure(page: int, poll_thread: bool, compact: bool, jobs: int = 2000, warmup: int = 200) -> dict:
    tensors = [KVCacheTensor(torch.zeros(BLOCKS, page, dtype=torch.int8), page) for _ in range(TENSORS)]
    kv = KVCaches(tensors, [[KVCacheRef(i, page) for i in range(TENSORS)]])
    rng = np.random.default_rng(0)
    specs = [
        (rng.choice(BLOCKS, PER_JOB, replace=False), rng.choice(BLOCKS, PER_JOB, replace=False)) for _ in range(64)
    ]
    times = []
    stop = threading.Event()
    with OffloadWorker(kv, BLOCKS, backend=NullExpandingBackend() if compact else NullBackend()) as worker:

        def poll():
            while not stop.wait(200e-6):
                worker.get_finished()

        poller = threading.Thread(target=poll) if poll_thread else None
        if poller:
            poller.start()
        try:
            for job in range(warmup + jobs):
                device, host = specs[job % len(specs)]
                t0 = time.perf_counter()
                worker.submit_store(job, DeviceBlocks(device), HostBlocks(host))
                times.append(time.perf_counter() - t0)
                if not poll_thread:
                    worker.get_finished()
        finally:
            stop.set()
            if poller:
                poller.join()
    us = np.array(times[warmup:]) * 1e6
    return {
        "page": page,
        "path": "compact" if compact else "planned",
        "poll_thread": poll_thread,
        "median_us": float(np.median(us)),
        "p99_us": float(np.percentile(us, 99)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page", type=int, action="append", help="page bytes (repeatable; default 256 and 32768)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    rows = [
        measure(page, poll, compact)
        for compact in (False, True)
        for page in args.page or [256, 32768]
        for poll in (False, True)
    ]
    for r in rows:
        print(
            f"{r['path']:>8}: page {r['page']:>6} B, {'with' if r['poll_thread'] else 'no  '} poller: "
            f"median {r['median_us']:6.1f} us, p99 {r['p99_us']:6.1f} us"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "python": platform.python_version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
