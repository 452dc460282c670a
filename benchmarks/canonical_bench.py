"""Canonical-layout stores and loads of small fragments, against the direct layout, on one backend.

A Llama-8B-like cache (32 layers, K and V separate, 16-token blocks, 8 KV heads) at TP=8:
each rank holds one head, so in the canonical (NHD) page its bytes are one fragment of
`head_bytes` per token, 16 per page, 1024 per block. Rank 0 stores `--blocks` blocks (64) in
jobs of 16, back to back, into a shared canonical region and loads them back; the direct layout
moves the same rank's whole pages. Reports GB/s, descriptors per job and plan+submit time, best
of 3 passes after a warm-up (under `auto`, warm-ups until its choices are measured). With few jobs the first launch and the wait weigh on the figure: an engine's many jobs are
closer to `--blocks 1024`.

    python benchmarks/canonical_bench.py [--backend cpu] [--heads 128,256,1024,4096] [--blocks 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections import Counter

import numpy as np
import torch
from engine_bench import launches_timed

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker, SharedHostRegion
from offload_core.bench import _limit_gbps
from offload_core.canonical import attention_mappings

LAYERS, HEADS, TP, TOKENS, PER_JOB = 32, 8, 8, 16, 16


def measure(
    backend: str, head_bytes: int, canonical: bool, directory: str, mechanism: str | None = None, blocks: int = 64
) -> dict | None:
    """One row; None where `mechanism` is `expand_staged` and a host row does not fit its staging
    half (forced, it would fail every job)."""
    maps = attention_mappings(total_kv_heads=HEADS, tp_size=TP, block_tokens=TOKENS, head_bytes=head_bytes)
    page = TOKENS * head_bytes  # one head per rank
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    tensors = [
        KVCacheTensor(torch.randint(0, 255, (2 * blocks, page), dtype=torch.uint8, device=device), page)
        for _ in range(2 * LAYERS)
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, page, mapping=maps[0]) for i in range(len(tensors))]])
    host_page = maps[0].canonical_page_size_bytes if canonical else page
    with SharedHostRegion(
        f"bench-{head_bytes}-{canonical}",
        num_blocks=blocks,
        directory=directory,
        **({"canonical_bytes": host_page * len(tensors)} if canonical else {"slot_bytes": [host_page * len(tensors)]}),
    ) as region:
        engine = backend
        if mechanism:
            from offload_core.backends.cuda import CudaBackend

            engine = CudaBackend(mechanism=mechanism)
            if mechanism == "expand_staged" and host_page * len(tensors) > engine.staging_bytes:
                return None
        with OffloadWorker(kv, blocks, backend=engine, canonical_layout=canonical, host_region=region) as w:
            best = {"store": float("inf"), "load": float("inf")}
            submit_us = []
            job = 0
            chosen = {"store": Counter(), "load": Counter()}  # the measured passes' mechanisms
            timed = launches_timed(w.backend)

            def schedule():  # True: a pass to warm up; False: a measured one
                seen = timed()
                yield True  # pools, rings, compiled kernels
                for _ in range(24):  # while `auto` still measures its candidates (cuda), as engine_bench
                    if timed() == seen:
                        break
                    seen = timed()
                    yield True
                yield from (False,) * 3

            for warm in schedule():
                for direction in ("store", "load"):
                    job_ids = []
                    t0 = time.perf_counter()
                    for first in range(0, blocks, PER_JOB):
                        job += 1
                        block_ids = np.arange(first, first + PER_JOB)
                        s0 = time.perf_counter()
                        if direction == "store":
                            w.submit_store(job, DeviceBlocks(block_ids), HostBlocks(block_ids))
                        else:
                            w.submit_load(job, HostBlocks(block_ids), DeviceBlocks(block_ids + blocks))
                        if not warm:
                            submit_us.append((time.perf_counter() - s0) * 1e6)
                        job_ids.append(job)
                    w.wait(job_ids)
                    elapsed, results = time.perf_counter() - t0, w.get_finished()
                    assert all(r.success for r in results)
                    if not warm:
                        best[direction] = min(best[direction], elapsed)
                        chosen[direction].update(r.mechanism for r in results)
            stats = w.stats()
            verified = all(torch.equal(t.tensor[blocks:], t.tensor[:blocks]) for t in tensors)
            nbytes = blocks * page * len(tensors)
            limit = _limit_gbps(
                w.backend, nbytes, w.backend.alloc_host(nbytes), torch.empty(nbytes, dtype=torch.uint8, device=device)
            )
    return {
        "mechanism": (f"{mechanism} -> " if mechanism == "auto" else "" if mechanism else "")
        + (
            mechanism
            if mechanism not in (None, "auto")
            else "/".join(chosen[d].most_common(1)[0][0] for d in ("store", "load"))
        ),
        "layout": "canonical" if canonical else "direct",
        "head_bytes": head_bytes,
        "verified": verified,
        "store_gbps": nbytes / best["store"] / 1e9,
        "load_gbps": nbytes / best["load"] / 1e9,
        "store_limit_gbps": limit["store"],
        "load_limit_gbps": limit["load"],
        "descriptors_per_job": stats["store"].descriptors / stats["store"].jobs,
        "plan_submit_us": float(np.median(submit_us)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--json")
    parser.add_argument("--heads", default="128,256,1024,4096", help="head bytes (default: %(default)s)")
    parser.add_argument(
        "--blocks", type=int, default=64, help="blocks per direction, in jobs of 16 (default: %(default)s)"
    )
    parser.add_argument(
        "--mechanisms", default="", help="cuda only: comma-separated, each forced in turn (auto: chosen per job)"
    )
    args = parser.parse_args()
    if args.blocks < PER_JOB or args.blocks % PER_JOB:
        parser.error(f"--blocks must be a positive multiple of {PER_JOB} (jobs of {PER_JOB} blocks), got {args.blocks}")
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        for head_bytes in (int(h) for h in args.heads.split(",")):
            for canonical in (False, True):
                for mechanism in args.mechanisms.split(",") if args.mechanisms else [None]:
                    row = measure(args.backend, head_bytes, canonical, directory, mechanism, args.blocks)
                    if row is None:
                        layout = "canonical" if canonical else "direct"
                        print(
                            f"# {mechanism} left out at {head_bytes} B heads, {layout}: a host row exceeds a staging half"
                        )
                    else:
                        rows.append(row)
    # Each row's link figure is noisy alone (small copies): every row of a head size and layout
    # is measured against the best of theirs, so that its mechanisms compare by their rates.
    for r in rows:
        group = [q for q in rows if (q["head_bytes"], q["layout"]) == (r["head_bytes"], r["layout"])]
        for d in ("store", "load"):
            r[f"{d}_ratio"] = r[f"{d}_gbps"] / max(q[f"{d}_limit_gbps"] for q in group)
    print(f"# {platform.node()}, backend {args.backend}, torch {torch.__version__}")
    print(
        "| head bytes | layout | mechanism | verified | store GB/s (of the link) | load GB/s (of the link) | descriptors/job | plan+submit µs/job |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['head_bytes']} | {r['layout']} | {r['mechanism']} | {r['verified']} | {r['store_gbps']:.2f} ({r['store_ratio']:.2f}) "
            f"| {r['load_gbps']:.2f} ({r['load_ratio']:.2f}) "
            f"| {r['descriptors_per_job']:.0f} | {r['plan_submit_us']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
