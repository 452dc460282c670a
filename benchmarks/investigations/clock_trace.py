"""Is what copies cost a matmul beside them the GPU's clock? A bf16 matmul loop runs alone, then
with jobs kept in flight all through it by another thread (not a burst before it, as
`engine_bench.py --interference` has it), per setting; `nvidia-smi` samples the SM clock, power
and the clock-event reasons every 20 ms meanwhile, and each phase reports the medians of its
samples and of its matmuls' own device times.

If the matmul slows by about what its clock falls, the cost is the power or clock limit (bytes
through device memory and the link draw power the matmul then lacks), not SMs or memory
bandwidth taken from it. Phases alternate over `--rounds` rounds (settings in reverse every
other round); the layout is `engine_bench.py`'s (64 KV tensors, random blocks).

    python benchmarks/investigations/clock_trace.py [--page 4096] [--per-job 16] [--seconds 1.5]
        [--rounds 3] [--settings none,auto,expand_staged,expand_direct,ce_batch,pinned,auto-only]
        [--direction store]

A setting is `none` (the matmul alone), a cuda mechanism (a worker forced to it; `auto`), or
`pinned` (one 256 MiB pinned copy after another: the copy engines only); NAME-only runs NAME's
copies without the matmul.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime

import numpy as np
import torch

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker
from offload_core.backends.cuda import CudaBackend

FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer, older drivers


def sampler(path: str) -> subprocess.Popen:
    """nvidia-smi writing a CSV line every 20 ms to `path`, with whichever reasons field the driver knows."""
    for reasons in REASONS:
        out = open(path, "w")
        proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={FIELDS},{reasons}", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        time.sleep(0.5)
        if proc.poll() is None:
            return proc
    raise SystemExit(f"nvidia-smi would not sample: {open(path).read()[:300]}")


def samples(path: str) -> list[tuple[float, float, float, float, int]]:
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(parts[1]), float(parts[2]), float(parts[3]), int(parts[5], 16)))
        except (ValueError, IndexError):
            continue
    return rows


def phase(worker, a, rng, blocks: int, per_job: int, seconds: float, direction: str, ids: int, matmul=True):
    """For `seconds`: matmuls back to back on the compute stream (the host at most 8 ahead, so
    the device never waits for it), each timed by its own pair of events; meanwhile a thread
    keeps `worker`'s jobs (a `torch.Tensor` pair: one pinned copy at a time) in flight, at most 64."""
    stop, copied, failed, mechanisms = threading.Event(), [0], [0], set()

    def copies(ids):
        if isinstance(worker, tuple):
            src, dst = worker
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    dst.copy_(src, non_blocking=True)
                    stream.synchronize()
                    copied[0] += src.numel()
            return
        first = ids
        # A stream of the thread's own: a job waits for work pending on the caller's current
        # stream (a store must see what kernels wrote), and the default one holds the matmuls.
        torch.cuda.set_stream(torch.cuda.Stream())
        # Random ids, none shared with a job in flight (a window moving over a permutation), as
        # an engine's: a job that writes what one in flight writes cuts a launch there, and cut
        # launches of one or two jobs left these copies at 6-15 GB/s (steady_rate.py)
        order, span = rng.permutation(blocks), blocks - blocks % per_job
        while not stop.is_set():
            at = ((ids - first) * per_job) % span
            window = DeviceBlocks(order[at : at + per_job]), HostBlocks(order[at : at + per_job])
            if direction == "store":
                worker.submit_store(ids, *window)
            else:
                worker.submit_load(ids, window[1], window[0])
            ids += 1
            if ids - first > 64:
                worker.wait([ids - 65])
        worker.wait(range(first, ids))
        for r in worker.get_finished():
            failed[0] += not r.success
            mechanisms.add(r.mechanism)
            copied[0] += r.transfer_size

    thread = None
    if worker is not None:
        thread = threading.Thread(target=copies, args=(ids,))
        thread.start()
        ids += 1 << 20
    pairs, start = [], time.time()
    while time.time() - start < seconds:
        if not matmul:
            time.sleep(0.01)
            continue
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.mm(a, a)
        end.record()
        pairs.append((begin, end))
        if len(pairs) > 8:
            while not pairs[-9][1].query():  # not `synchronize`, which holds the GIL the copies' thread needs
                time.sleep(0.002)  # rarely: each wake takes the GIL from the copies
    torch.cuda.synchronize()
    end_t = time.time()
    stop.set()
    if thread is not None:
        thread.join()
    own = [b.elapsed_time(e) for b, e in pairs]
    return {
        "t0": start,
        "t1": end_t,
        "matmul_ms": float(np.median(own)) if own else float("nan"),
        "matmuls": len(own),
        "copied_gbps": copied[0] / (end_t - start) / 1e9,
        "failed": failed[0],
        "mechanisms": sorted(mechanisms),
    }, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page", type=int, default=4096)
    parser.add_argument("--per-job", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default="none,auto,expand_staged,expand_direct,ce_batch,pinned,auto-only")
    parser.add_argument("--direction", default="store", choices=("store", "load"))
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    blocks = max(1024, 128 * args.per_job)  # twice the windows of the jobs in flight (`phase`)
    tensors = [
        KVCacheTensor(torch.zeros(blocks, args.page, dtype=torch.int8, device=device), args.page)
        for _ in range(2 * args.layers)
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, args.page) for i in range(len(tensors))]])
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    settings = args.settings.split(",")

    def make(setting):
        setting = setting.removesuffix("-only")
        if setting == "none":
            return None
        if setting == "pinned":  # one large copy at a time on the copy engines: no SM, no staging
            host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            return (dev, host) if args.direction == "store" else (host, dev)
        return OffloadWorker(kv, blocks, backend=CudaBackend(mechanism=setting))

    workers = {s: make(s) for s in settings}
    rng = np.random.default_rng(0)
    trace = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    proc = sampler(trace)
    ids, rows = 0, []
    try:
        for s in settings:  # warm-up: compile, staging, clocks up
            _, ids = phase(workers[s], a, rng, blocks, args.per_job, 0.3, args.direction, ids, "-only" not in s)
        for r in range(args.rounds):
            for s in settings if r % 2 == 0 else settings[::-1]:
                row, ids = phase(
                    workers[s], a, rng, blocks, args.per_job, args.seconds, args.direction, ids, "-only" not in s
                )
                rows.append({"setting": s, "round": r, **row})
    finally:
        time.sleep(0.2)
        proc.terminate()
        for w in workers.values():
            if isinstance(w, OffloadWorker):
                w.shutdown()
    points = samples(trace)
    # against the same round's matmul alone: the power-capped clock drifts between rounds
    alone = {x["round"]: x["matmul_ms"] for x in rows if x["setting"] == "none"}
    print(
        f"{args.direction}, {args.page} B pages x {args.per_job} blocks x {2 * args.layers} tensors; {len(points)} samples"
    )
    print(
        "| setting | round | matmul ms | vs alone (same round) | SM MHz (median) | mem MHz | W | reasons seen | copied GB/s | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        inside = [p for p in points if x["t0"] + 0.1 <= p[0] <= x["t1"]]  # the first 100 ms: clocks settling
        x["sm_mhz"] = float(np.median([p[1] for p in inside])) if inside else None
        x["mem_mhz"] = float(np.median([p[2] for p in inside])) if inside else None
        x["watts"] = float(np.median([p[3] for p in inside])) if inside else None
        x["reasons"] = sorted({hex(p[4]) for p in inside})
        x["samples"] = len(inside)
        x["slowdown"] = x["matmul_ms"] / alone[x["round"]] - 1 if alone else None
        vs = "" if not alone else f"{100 * x['slowdown']:+.1f}%"
        print(
            f"| {x['setting']} | {x['round']} | {x['matmul_ms']:.3f} | {vs} | {x['sm_mhz']} | {x['mem_mhz']} | "
            f"{x['watts']} | {' '.join(x['reasons'])} | {x['copied_gbps']:.1f} | {x['failed']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "trace": points}, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
