"""The direct expansion kernel's own rate: device time only, with the host out of the way, per
page size, job size, programs, warps per program and tile. How fast can a few SMs move a
simple job's bytes across the link when they write (stores) or read (loads) host rows?

The stream is held by a sleep kernel while a direction's launches are enqueued, so the events
around them time the kernels back to back and nothing of the host. Layout as
`benchmarks/engine_bench.py`'s: 64 KV tensors, host rows of one block's 64 pages, random
device and host blocks; ratios to the best of 10 single pinned copies in the same run. Each
setting's last job is checked byte for byte.

    python benchmarks/investigations/direct_rate.py [--pages 256,1024,4096] [--job-mib 1,4]
        [--programs 2,4,8,32] [--items 128,256] [--warps 4,8] [--jobs 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from offload_core.backends.cuda import kernels

TENSORS = 64


def link_gbps(nbytes: int) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("store", host, dev), ("load", dev, host)):
        dst.copy_(src, non_blocking=True)
        best = float("inf")
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src, non_blocking=True)
            e1.record()
            e1.synchronize()
            best = min(best, e0.elapsed_time(e1) / 1e3)
        out[name] = nbytes / best / 1e9
    return out


def kv_entries(page: int, tensors: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Random KV tensors of `page`-byte pages (at most 512 MiB) and their expansion table on the
    host (one entry per tensor: base, page, host offset within a row); returns (blocks, kv, entries)."""
    blocks = min(8192, (512 << 20) // (tensors * page))
    kv = torch.randint(-128, 128, (tensors, blocks, page), dtype=torch.int8, device="cuda")
    entries = torch.zeros((8, tensors), dtype=torch.int64)
    entries[0] = torch.tensor([kv[t].data_ptr() for t in range(tensors)])
    entries[1] = page
    entries[3] = torch.arange(tensors) * page
    entries[5] = page
    entries[6] = 1
    return blocks, kv, entries


def report_slowdown(rows: list, spec: str, alone: list, busy: list) -> None:
    """Add and print the matmul's slowdown beside `spec`: the median of `busy` loops against `alone`."""
    slow = np.median(busy) / np.median(alone) - 1
    rows.append(dict(interference=spec, slowdown=float(slow), alone_ms=float(np.median(alone))))
    print(f"matmul beside {spec}: {np.median(alone):.2f} ms alone, {slow:+.1%}", flush=True)


def write_json(path: str | None, link: dict, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"link": link, "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="256,1024,4096")
    parser.add_argument("--job-mib", default="1,4")
    parser.add_argument("--programs", default="2,4,8,32")
    parser.add_argument("--items", default="128,256", help="the tile's items (its words a step: expand_tile's)")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    kernel = kernels._compile()[2]
    link = link_gbps(256 << 20)
    print(f"link: store {link['store']:.1f} GB/s, load {link['load']:.1f} GB/s", flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for page in map(int, args.pages.split(",")):
        blocks = min(8192, (512 << 20) // (TENSORS * page))
        kv = torch.randint(-128, 128, (TENSORS, blocks, page), dtype=torch.int8, device="cuda")
        host = torch.zeros(blocks * TENSORS * page, dtype=torch.int8, pin_memory=True)
        entries = torch.zeros((8, TENSORS), dtype=torch.int64)
        entries[0] = torch.tensor([kv[t].data_ptr() for t in range(TENSORS)])  # dev_base
        entries[1] = page  # dev_page
        entries[3] = torch.arange(TENSORS) * page  # host_off: a block's host row holds its 64 pages
        entries[5] = page  # size
        entries[6] = 1  # writers
        entries = entries.cuda()
        host_ptr = host.data_ptr()
        groups = torch.tensor([[0], [TENSORS]], dtype=torch.int64, device="cuda")
        width = kernels.expand_tile(page)[1]
        for mib in map(int, args.job_mib.split(",")):
            per_job = max(1, (mib << 20) // (TENSORS * page))
            tables = []
            for _ in range(args.jobs):
                dev_ids = rng.choice(blocks, per_job, replace=False)
                host_ids = rng.choice(blocks, per_job, replace=False)
                tables.append(torch.from_numpy(np.stack([dev_ids, host_ids]).astype(np.int64)).cuda())
            job_bytes = per_job * TENSORS * page
            for store in (True, False):
                for programs in map(int, args.programs.split(",")):
                    for warps in map(int, args.warps.split(",")):
                        for items in map(int, args.items.split(",")):
                            consts = dict(STORE=store, SIMPLE=True, BY_HOST=True, NARROW=False, D=items, W=width)

                            def launch(table, programs=programs, warps=warps, consts=consts):
                                kernel[(programs,)](
                                    table.data_ptr(), per_job, entries.data_ptr(), TENSORS, groups.data_ptr(), 1,
                                    TENSORS, host_ptr, TENSORS * page, **consts, num_warps=warps,
                                )  # fmt: skip

                            try:
                                launch(tables[0])
                                torch.cuda.synchronize()
                            except Exception as exc:  # a setting Triton will not build (registers, warps)
                                print(f"page {page} {mib} MiB P={programs} w={warps} items {items}: {exc!r}"[:200])
                                continue
                            last = tables[-1].cpu().numpy()
                            if store:  # the last job's destination cleared: a copy that did not run shows
                                host.view(blocks, TENSORS * page)[last[1]] = 0
                            else:
                                kv[:, last[0]] = 0
                            torch.cuda._sleep(50_000_000)  # holds the stream while the host enqueues
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            h0 = time.perf_counter()
                            e0.record()
                            for table in tables:
                                launch(table)
                            e1.record()
                            enqueue = time.perf_counter() - h0
                            busy = not e0.query()  # the sleep outlasted the enqueues
                            e1.synchronize()
                            seconds = e0.elapsed_time(e1) / 1e3
                            dev_pages = kv[:, last[0]].permute(1, 0, 2).reshape(per_job, -1).cpu()
                            host_rows = host.view(blocks, TENSORS * page)[last[1]]
                            ok = torch.equal(dev_pages, host_rows)
                            d = "store" if store else "load"
                            ratio = args.jobs * job_bytes / seconds / 1e9 / link[d]
                            row = dict(
                                page=page, job_mib=mib, direction=d, programs=programs, warps=warps,
                                items=items, words=width, ratio=ratio, us_per_job=seconds / args.jobs * 1e6,
                                verified=ok, stream_held=busy, enqueue_ms=enqueue * 1e3,
                            )  # fmt: skip
                            rows.append(row)
                            print(
                                f"page {page:>5} {mib} MiB {d:<5} P={programs:<3} warps={warps:<2} tile {items}x{width}:"
                                f" {ratio:.2f} of the link, {row['us_per_job']:.1f} us a job; verified {ok}"
                                f"{'' if busy else ' (stream not held: host gaps counted)'}",
                                flush=True,
                            )
        del kv, host
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"link": link, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
