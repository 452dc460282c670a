"""Jobs at a steady pace, as an engine's steps submit them, not in one burst. One thread submits a
job, and once `cap` are in flight, waits for the oldest (`wait`), or polls `get_finished` until one
is done (`poll`), or waits for the oldest and takes no result until the end (`keep`, as
`clock_trace.py` did) before the next. `clock_trace.py`'s copy thread does the first with ids drawn from
all blocks and moved 6-15 GB/s, where `engine_bench.py`'s jobs back to back move 45-55: is it the
pace, the waits, or the ids? Ids are `random` (a job's host blocks may be a job's in flight: a
launch is cut there) or `disjoint` from the `cap` jobs before it (as an engine's are).

Per setting, for `--seconds`: the rate against the best of 5 pinned copies of 256 MiB in the same
run, jobs per launch, host seconds per job in submits and in waits or polls, and whether every
job succeeded. Layout: `engine_bench.py`'s (64 KV tensors, one group).

    python benchmarks/investigations/steady_rate.py [--page 4096] [--per-job 16] [--caps 8,64]
        [--ids random,disjoint] [--modes wait,poll,keep] [--mechanism auto] [--seconds 2] [--direction store] [--backend cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

import numpy as np
import torch

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker, get_backend
from offload_core.backends.cuda import CudaBackend
from offload_core.bench import _limit_gbps


def run(worker, rng, blocks, per_job, cap, ids, mode, seconds, direction, first_id):
    """Jobs for `seconds`, at most `cap` in flight; returns the row and the next job id."""
    stats = worker.stats()[direction]
    launches0 = stats.launches
    flight: deque = deque()  # (job id, its host blocks)
    done: set = set()
    submit_s = wait_s = 0.0
    jobs = failed = 0
    job_id = first_id
    perm = rng.permutation(blocks)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        if ids == "random":
            dev, host = rng.choice(blocks, per_job, replace=False), rng.choice(blocks, per_job, replace=False)
        else:  # a window that moves on by a job each time: none shared with the `cap` jobs before
            at = (jobs * per_job) % (blocks - blocks % per_job)
            dev = host = perm[at : at + per_job]
        t0 = time.perf_counter()
        if direction == "store":
            worker.submit_store(job_id, DeviceBlocks(dev), HostBlocks(host))
        else:
            worker.submit_load(job_id, HostBlocks(host), DeviceBlocks(dev))
        t1 = time.perf_counter()
        submit_s += t1 - t0
        flight.append(job_id)
        job_id += 1
        jobs += 1
        if mode == "keep" and len(flight) >= cap:  # clock_trace's way: results left until the end
            worker.wait([flight.popleft()])
            continue
        while len(flight) >= cap:
            if mode == "wait":
                worker.wait([flight[0]])
            for r in worker.get_finished():
                done.add(r.job_id)
                failed += not r.success
            while flight and flight[0] in done:
                done.discard(flight.popleft())
            if mode == "poll" and len(flight) >= cap:
                time.sleep(0)  # an engine's step would run here; let the launcher have the GIL
        wait_s += time.perf_counter() - t1
    worker.wait(list(flight))
    failed += sum(not r.success for r in worker.get_finished())
    wall = time.perf_counter() - start
    launches = worker.stats()[direction].launches - launches0
    return dict(
        jobs=jobs, wall=wall, jobs_per_launch=jobs / max(1, launches), failed=failed,
        submit_us=submit_s / jobs * 1e6, wait_us=wait_s / jobs * 1e6,
    ), job_id  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page", type=int, default=4096)
    parser.add_argument("--per-job", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--caps", default="8,64")
    parser.add_argument("--ids", default="random,disjoint")
    parser.add_argument("--modes", default="wait,poll")
    parser.add_argument("--mechanism", default="auto", help="cuda's")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--direction", default="store", choices=("store", "load"))
    parser.add_argument("--json")
    args = parser.parse_args()
    backend = CudaBackend(mechanism=args.mechanism) if args.backend == "cuda" else get_backend(args.backend)
    device = backend.device
    tensors = [
        KVCacheTensor(torch.zeros(args.blocks, args.page, dtype=torch.int8, device=device), args.page)
        for _ in range(2 * args.layers)
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, args.page) for i in range(len(tensors))]])
    job_bytes = args.per_job * args.page * len(tensors)
    limit_host = backend.alloc_host(256 << 20)
    limit_dev = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    link = _limit_gbps(backend, 256 << 20, limit_host, limit_dev)[args.direction]
    rng = np.random.default_rng(0)
    rows, job_id = [], 0
    print(
        f"{args.direction}, {args.page} B pages x {args.per_job} blocks x {len(tensors)} tensors; link {link:.1f} GB/s"
    )
    print("| ids | cap | mode | of the link | jobs | jobs per launch | submit us/job | wait us/job | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    with OffloadWorker(kv, args.blocks, backend=backend) as worker:
        _, job_id = run(worker, rng, args.blocks, args.per_job, 8, "disjoint", "wait", 0.3, args.direction, job_id)
        for ids in args.ids.split(","):
            for cap in map(int, args.caps.split(",")):
                for mode in args.modes.split(","):
                    row, job_id = run(
                        worker, rng, args.blocks, args.per_job, cap, ids, mode, args.seconds, args.direction, job_id
                    )
                    ratio = row["jobs"] * job_bytes / row["wall"] / 1e9 / link
                    rows.append(dict(ids=ids, cap=cap, mode=mode, ratio=ratio, **row))
                    print(
                        f"| {ids} | {cap} | {mode} | {ratio:.2f} | {row['jobs']} | {row['jobs_per_launch']:.1f}"
                        f" | {row['submit_us']:.0f} | {row['wait_us']:.0f} | {row['failed']} |",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(link_gbps=link, args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
