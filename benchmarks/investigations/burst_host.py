"""The core's host time per compact job in a burst, without a GPU: jobs submitted back to back
to a backend that takes compact jobs, copies nothing, and whose events pass only when waited
for, so that jobs coalesce into launches as they do on a busy GPU. What it measures is the
core's part (specs, validation, the queue, the clash check, the join, results), not a backend's.

    python benchmarks/investigations/burst_host.py [--page 256] [--blocks-per-job 64] [--tensors 64]
        [--jobs 128] [--rounds 20] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pathlib
import pstats
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/, for submit_overhead

from submit_overhead import NullExpandingBackend  # noqa: E402

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker  # noqa: E402


class BusyEvent:
    """Passes only when synchronized: the device looks busy, so submits coalesce."""

    def __init__(self):
        self.done = True

    def record(self, stream):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def elapsed_time(self, end):
        return 0.0


class BusyBackend(NullExpandingBackend):
    def new_event(self):
        return BusyEvent()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--blocks-per-job", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of 20 more rounds")
    args = parser.parse_args()
    n, blocks = args.blocks_per_job, max(1024, 2 * args.blocks_per_job)
    tensors = [KVCacheTensor(torch.zeros(blocks, args.page, dtype=torch.int8), args.page) for _ in range(args.tensors)]
    kv = KVCaches(tensors, [[KVCacheRef(i, args.page) for i in range(args.tensors)]])
    rng = np.random.default_rng(0)
    dev_perm, host_perm = rng.permutation(blocks), rng.permutation(blocks)
    take = lambda perm, j: np.take(perm, np.arange(j * n, (j + 1) * n), mode="wrap")  # noqa: E731
    specs = [(take(dev_perm, j), take(host_perm, j)) for j in range(16)]  # consecutive jobs disjoint
    with OffloadWorker(kv, blocks, backend=BusyBackend()) as worker:

        def burst(first: int) -> None:
            for j in range(args.jobs):
                dev, host = specs[j % len(specs)]
                worker.submit_store(first + j, DeviceBlocks(dev), HostBlocks(host))
            worker.wait(range(first, first + args.jobs))
            worker.get_finished()

        for r in range(5):  # warm-up
            burst(r * 2 * args.jobs)
        gc.collect()  # the setup's garbage collected now, not by a pause inside a measured burst
        per_job = []
        for r in range(5, 5 + args.rounds):
            t0 = time.perf_counter()
            burst(r * 2 * args.jobs)
            per_job.append((time.perf_counter() - t0) / args.jobs * 1e6)
        stats = worker.stats()["store"]
        print(
            f"{args.tensors} tensors x {n} blocks x {args.page} B, bursts of {args.jobs}: per job "
            f"median {np.median(per_job):.1f} us, best {min(per_job):.1f} us over {args.rounds} rounds; "
            f"{stats.jobs / stats.launches:.1f} jobs per launch"
        )
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for r in range(100, 120):
                burst(r * 2 * args.jobs)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
