"""Where a submit's host time goes: cProfile over many back-to-back jobs of one engine shape.

python benchmarks/submit_profile.py [--page 4096] [--blocks-per-job 16] [--layers 32 | --tensors 1] [--jobs 400]
    [--mechanism auto] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker, get_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend")
    parser.add_argument("--mechanism", default="auto", help="cuda mechanism (default: %(default)s)")
    parser.add_argument("--page", type=int, default=4096)
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tensors", type=int, help="KV tensors (default: K and V of each layer)")
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    backend = get_backend(args.backend)
    if backend.name == "cuda":
        from offload_core.backends.cuda import CudaBackend

        backend = CudaBackend(mechanism=args.mechanism)
    count = args.tensors or 2 * args.layers
    blocks = max(1024, 2 * args.blocks_per_job)
    tensors = [
        KVCacheTensor(torch.zeros(blocks, args.page, dtype=torch.int8, device=backend.device), args.page)
        for _ in range(count)
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, args.page) for i in range(len(tensors))]])
    rng = np.random.default_rng(0)
    # random ids, consecutive jobs disjoint (as an engine's: no two jobs in flight write one block)
    dev_perm, host_perm = rng.permutation(blocks), rng.permutation(blocks)
    take = lambda perm, j: np.take(perm, np.arange(j * args.blocks_per_job, (j + 1) * args.blocks_per_job), mode="wrap")  # noqa: E731
    specs = [(DeviceBlocks(take(dev_perm, j)), HostBlocks(take(host_perm, j))) for j in range(args.jobs)]
    with OffloadWorker(kv, blocks, backend=backend) as worker:

        def run(first: int) -> list[float]:
            times = []
            for j, (dev, host) in enumerate(specs):
                t0 = time.perf_counter()
                worker.submit_store(first + j, dev, host)
                times.append(time.perf_counter() - t0)
                if j % 50 == 49:  # an engine collects its results as it goes
                    worker.get_finished()
            worker.wait(range(first, first + len(specs)))
            worker.get_finished()
            return times

        run(0)
        wall, cpu = time.perf_counter(), time.process_time()
        plain = run(10_000)
        # the whole run per job, and the CPU time of every thread per job: where the second is
        # well below the first, the host waits (for the GIL's hand-over, or the device), not works
        wall, cpu = (time.perf_counter() - wall) / args.jobs, (time.process_time() - cpu) / args.jobs
        profile = cProfile.Profile()
        profile.enable()
        run(20_000)
        profile.disable()
        print(
            f"submit median {np.median(plain) * 1e6:.1f} us, p99 {np.percentile(plain, 99) * 1e6:.1f} us "
            f"({args.jobs} jobs, {args.blocks_per_job} blocks x {count} tensors x {args.page} B, "
            f"{worker.stats()['store'].mechanisms}, {worker.stats()['store'].jobs / worker.stats()['store'].launches:.1f} "
            f"jobs per launch, launches {worker.stats()['store'].launch_s / worker.stats()['store'].jobs * 1e6:.0f} us per job); "
            f"per job {wall * 1e6:.1f} us of wall, {cpu * 1e6:.1f} us of CPU (all threads)"
        )
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
