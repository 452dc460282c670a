"""Where a small-fragment job's time goes, on a GPU: the parts of ``staged`` and ``sm_gather`` timed alone.

    python benchmarks/investigations/staged_breakdown.py [--sizes 256,1024,4096] [--json FILE]

For each fragment size, a 65536-fragment job shaped as in transfer_bench.py (device side
scattered, host side in 2 MiB rows), device time on a busy stream, best of 3:
the descriptor upload, the device-side gather alone per piece size and program count, the
copy-engine part alone (the job's host-contiguous runs, in one batch and in pieces chained by
events across two streams, as staged chains them), staged itself, and sm_gather per program
count; store and load; and both at once, per rep, for the copy engines alone, staged and
sm_gather. What staged costs beyond its copy-engine part is its fill (upload, first
gather), drain (last scatter) and per-piece gaps.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from offload_core.backend import Direction
from offload_core.backends.cuda import CudaBackend, kernels, measure
from offload_core.backends.cuda.driver import SRC_ACCESS_ORDER_ANY, SRC_ACCESS_ORDER_STREAM
from offload_core.runs import run_starts


def host_runs(host, sizes):
    starts = run_starts((host,), sizes)
    return starts, np.add.reduceat(sizes, starts)


MIB = 1 << 20
SPAN = 256 * MIB


def busy_time(fn, stream, reps=3) -> float:
    """Best device seconds of what `fn()` enqueues on `stream`, after a sleep so that it is all enqueued first."""
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(measure.SLEEP_CYCLES // 5)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256,1024,4096")
    parser.add_argument("--json")
    args = parser.parse_args()
    be = CudaBackend()
    dev = torch.zeros(2 * SPAN, dtype=torch.uint8, device=be.device)
    staging = torch.zeros(SPAN, dtype=torch.uint8, device=be.device)
    host = be.alloc_host(SPAN)
    dev2, host2 = (
        torch.zeros(2 * SPAN, dtype=torch.uint8, device=be.device),
        be.alloc_host(SPAN),
    )  # the load's, for both at once
    s1, s2 = be.new_stream(), be.new_stream()
    one = np.ones(1, dtype=np.int64)
    limit = {
        d: SPAN / measure.time_copy(be, "ce_batch", *a, busy=True)["event_s"] / 1e9
        for d, a in (
            ("store", (one * dev.data_ptr(), one * host.data_ptr(), one * SPAN, Direction.STORE)),
            ("load", (one * host.data_ptr(), one * dev.data_ptr(), one * SPAN, Direction.LOAD)),
        )
    }
    half = SPAN // 2
    limit["both"] = (
        SPAN
        / min(
            measure.time_both(
                be,
                "ce_batch",
                (one * dev.data_ptr(), one * host.data_ptr(), one * half, Direction.STORE),
                (one * (host.data_ptr() + half), one * (dev.data_ptr() + SPAN), one * half, Direction.LOAD),
                released="own",
            )
        )
        / 1e9
    )
    report = {"device": torch.cuda.get_device_name(), "limit_gbps": limit, "sizes": []}
    print("limit", limit, flush=True)
    for size in map(int, args.sizes.split(",")):
        n = 65536
        nbytes = n * size
        d_addr, h_addr, sizes = measure.fragments(n, size, dev.data_ptr(), host.data_ptr(), seed=1)
        stage = staging.data_ptr() + np.arange(n, dtype=np.int64) * size
        row = {"size": size, "n": n, "bytes": nbytes}
        us = lambda s: round(s * 1e6, 1)  # noqa: E731

        ring = be._ring
        for cols, count in ((3, n), (1, n), (1, (4 * MIB) // size)):
            regions = ring.open()
            row[f"upload_{cols}col_{count}_us"] = us(
                busy_time(lambda: ring.upload((d_addr[:count],) * cols, s1, []), s1)  # noqa: B023
            )
            ring.retire(_recorded(s1), regions)
        regions = ring.open()
        (table,) = ring.upload((d_addr, stage, sizes), s1, [])
        desc = [table + 8 * j * n for j in range(3)]
        torch.cuda.synchronize()
        for programs in (264, 528, 1056):
            for piece in (MIB, 4 * MIB, nbytes):
                k = piece // size
                row[f"gather_p{programs}_{piece >> 10}KiB_us"] = us(
                    busy_time(lambda: kernels.run(desc[0], desc[1], desc[2], k, size, s1, programs), s1)
                )
                row[f"gather_affine_p{programs}_{piece >> 10}KiB_us"] = us(
                    busy_time(lambda: kernels.run(desc[0], (int(stage[0]), size), (size, 0), k, size, s1, programs), s1)
                )
        ring.retire(_recorded(s1), regions)

        starts, run_bytes = host_runs(h_addr, sizes)
        for d, order in (("store", SRC_ACCESS_ORDER_STREAM), ("load", SRC_ACCESS_ORDER_ANY)):
            src, dst = (stage[starts], h_addr[starts]) if d == "store" else (h_addr[starts], stage[starts])
            row[f"ce_runs_{d}_us"] = us(
                busy_time(lambda: be.driver.memcpy_batch_async(dst, src, run_bytes, order, s1.cuda_stream), s1)
            )

            def chained(pieces=4):
                per = -(-len(starts) // pieces)
                for a in range(0, len(starts), per):
                    s2.wait_event(_recorded(s1))
                    s1.wait_event(_recorded(s2))
                    be.driver.memcpy_batch_async(
                        dst[a : a + per], src[a : a + per], run_bytes[a : a + per], order, s1.cuda_stream
                    )

            row[f"ce_runs_4pieces_{d}_us"] = us(busy_time(chained, s1))

        st = (d_addr, h_addr, sizes, Direction.STORE)
        ld = (h_addr, d_addr, sizes, Direction.LOAD)
        d2, h2, _ = measure.fragments(n, size, dev2.data_ptr(), host2.data_ptr(), seed=2)
        ld2 = (h2, d2, sizes, Direction.LOAD)
        for mech in ("ce_batch", "staged", "sm_gather"):
            if mech == "ce_batch":  # the copy engines alone, host runs each way: the ceiling for staged
                s_runs, l_runs = host_runs(h_addr, sizes), host_runs(h2, sizes)
                pair = (
                    (stage[s_runs[0]], h_addr[s_runs[0]], s_runs[1], Direction.STORE),
                    (h2[l_runs[0]], stage[l_runs[0]] - staging.data_ptr() + dev2.data_ptr(), l_runs[1], Direction.LOAD),
                )
            else:
                pair = (st, ld2)
            for released in ("together", "own"):
                times = measure.time_both(be, mech, *pair, released=released, reps=5)
                row[f"both_{mech}_{released}_of_limit"] = [
                    round(2 * nbytes / t / 1e9 / limit["both"], 3) for t in times
                ]
        own = dict(be.sm_programs)
        for mech, knob in (("staged", [None]), ("sm_gather", [32, 132])):
            for programs in knob:
                if programs:
                    be.sm_programs = dict.fromkeys(be.sm_programs, programs)
                tag = f"{mech}{programs or ''}"
                for d, a in (("store", st), ("load", ld)):
                    row[f"{tag}_{d}_us"] = us(measure.time_copy(be, mech, *a, busy=True)["event_s"])
        be.sm_programs = own
        for key in list(row):
            if key.endswith("_us") and not key.startswith(("upload", "gather", "both_")):
                d = "both" if "both" in key else "store" if "store" in key else "load"
                ref = nbytes * (2 if d == "both" else 1) / limit[d] / 1e9
                row[key.replace("_us", "_of_limit")] = round(ref / (row[key] / 1e6), 3)
        report["sizes"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _recorded(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


if __name__ == "__main__":
    main()
