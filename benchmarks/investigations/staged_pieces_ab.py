"""`staged` with its piece schedule against the schedule before step 14 of docs/dev/cuda-tuning-log.md
(1 MiB, then four times larger, whatever the job's size), in the same run: device time on a
busy stream, eight jobs back to back (the engine's view) with the host time per job, and both
directions at once. Each variant twice, interleaved, because this VM's host speed drifts.

    python benchmarks/investigations/staged_pieces_ab.py [--json OUT.json]      # on a GPU, about 20 s
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cuda import CudaBackend, measure, select

CASES = ((256, 16), (1024, 16), (1024, 64))  # (fragment bytes, MiB a job)


def geometric(total: int, staging_bytes: int, store: bool, first: int = 1 << 20) -> list[int]:
    """The schedule before step 14: 1 MiB, then four times larger up to the buffer."""
    ends, done = [], 0
    while True:
        done += min(staging_bytes, first << (2 * len(ends)))
        if done >= total:
            break
        ends.append(done)
    return ends if store else [total - e for e in reversed(ends)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args()
    current = select.piece_bounds  # auto's piece count and staged's cuts both read it from select
    backend = CudaBackend()
    torch = backend._torch
    span = 256 << 20
    device = torch.zeros(2 * span, dtype=torch.uint8, device=backend.device)
    host = backend.alloc_host(span)
    one = np.ones(1, dtype=np.int64)
    limit = {}
    for d in Direction:
        ends = (one * device.data_ptr(), one * host.data_ptr())
        src, dst = ends if d is Direction.STORE else ends[::-1]
        limit[d] = span / measure.time_copy(backend, "ce_batch", src, dst, one * span, d, busy=True, reps=5)["event_s"]
    rows = []
    try:
        for size, mib in CASES:
            gb = (mib << 20) / 1e9
            dev, hst, sizes = measure.fragments((mib << 20) // size, size, device.data_ptr(), host.data_ptr())
            jobs = {
                Direction.STORE: (dev, hst, sizes, Direction.STORE),
                Direction.LOAD: (hst, dev + span, sizes, Direction.LOAD),
            }
            for variant in ("geometric", "current", "geometric", "current"):
                select.piece_bounds = current if variant == "current" else geometric
                row = {"fragment": size, "job_mib": mib, "variant": variant}
                for d, job in jobs.items():
                    event = measure.time_copy(backend, "staged", *job, busy=True, reps=5)["event_s"]
                    runs = [measure.time_jobs(backend, "staged", *job, jobs=8) for _ in range(3)]
                    row[f"{d.value}_ratio"] = gb * 1e9 / event / limit[d]
                    row[f"{d.value}_jobs_ratio"] = 8 * gb * 1e9 / min(r["wall_s"] for r in runs) / limit[d]
                    row[f"{d.value}_host_us"] = float(np.median([r["host_s"] for r in runs])) * 1e6
                both = measure.time_both(
                    backend, "staged", jobs[Direction.STORE], jobs[Direction.LOAD], released="own", reps=5
                )
                row["both_gbps"] = [2 * gb / max(both), 2 * gb / min(both)]
                rows.append(row)
    finally:
        select.piece_bounds = current
    print(
        "| fragment | job | variant | store / load (of limit) | 8 jobs back to back | host µs per job | both at once GB/s, worst / best |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['fragment']} B | {r['job_mib']} MiB | {r['variant']} | {r['store_ratio']:.1%} / {r['load_ratio']:.1%} "
            f"| {r['store_jobs_ratio']:.1%} / {r['load_jobs_ratio']:.1%} | {r['store_host_us']:.0f} / {r['load_host_us']:.0f} "
            f"| {r['both_gbps'][0]:.1f} / {r['both_gbps'][1]:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
