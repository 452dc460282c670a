"""Can the copy engines add to the direct kernel's rate in the same direction? A 4 MiB job's
blocks split in two: a fraction goes straight between the KV pages and the host rows through
the direct expansion kernel on a few programs (stream A), the rest through staging (the same
kernel on more programs gathers those blocks' rows into device memory, then one copy a host
row on the copy engines; for loads the reverse), on other streams at the same time. Every
SM-issued copy measured on the H200 tops out near 0.90 / 0.87 of the link (2026-12-03), the
copy engines near 1.0; the question is whether the two share the link or add up.

Device time only: the streams are held by a sleep kernel while a setting's jobs are enqueued.
Layout as `benchmarks/engine_bench.py`'s (64 KV tensors, host rows of one block's 64 pages,
random device and host blocks); ratios to the best of 10 single pinned copies in the same run;
each setting's last job checked byte for byte. Then a bf16 matmul loop's slowdown beside 32
jobs of each `--interference` setting (median of `--rounds` rounds).

    python benchmarks/investigations/split_rate.py [--pages 1024,4096] [--direct 1,0.75,0.5,0.25,0]
        [--programs 2] [--gather-programs 8] [--batched | --contiguous] [--interference PAGE:DIRECTION:FRACTION,...]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import numpy as np
import torch
from direct_rate import kv_entries, link_gbps, report_slowdown, write_json  # beside this file

from offload_core.backends.cuda import kernels
from offload_core.backends.cuda.driver import SRC_ACCESS_ORDER_ANY, SRC_ACCESS_ORDER_STREAM, Driver

TENSORS = 64
JOB = 4 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="1024,4096")
    parser.add_argument("--direct", default="1,0.75,0.5,0.25,0", help="fractions of a job's blocks sent direct")
    parser.add_argument("--programs", type=int, default=2, help="the direct kernel's programs")
    parser.add_argument("--gather-programs", type=int, default=8, help="the staging kernel's programs")
    parser.add_argument("--directions", default="store,load")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--batched", action="store_true", help="each job's staged rows in one cuMemcpyBatchAsync")
    parser.add_argument("--one-stream", action="store_true", help="stores: gather, then the direct part, one stream")
    parser.add_argument("--rounds", type=int, default=11, help="the matmul's rounds")
    parser.add_argument("--contiguous", action="store_true", help="each job's staged rows one run of host blocks")
    parser.add_argument("--interference", default="1024:store:0.5,1024:store:1,4096:store:0.75,4096:store:1")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    kernel = kernels._compile()[2]
    link = link_gbps(256 << 20)
    print(f"link: store {link['store']:.1f} GB/s, load {link['load']:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows, setups, alive, batch_seconds = (
        [],
        {},
        [],
        [0.0],
    )  # alive: the batches' argument arrays, kept past their copies
    driver = Driver(ctypes.CDLL("libcuda.so.1"))
    a_stream, g_stream, c_stream = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def setup(page):
        blocks, kv, entries = kv_entries(page, TENSORS)
        host = torch.zeros(blocks, TENSORS * page, dtype=torch.int8, pin_memory=True)
        groups = torch.tensor([[0], [TENSORS]], dtype=torch.int64, device="cuda")
        staging = torch.empty(args.jobs, JOB, dtype=torch.int8, device="cuda")  # one region a job: no reuse hazard
        return blocks, kv, host, entries.cuda(), groups, staging

    def make_jobs(page, fraction, store, env):
        blocks, kv, host, entries, groups, staging = env
        per_job = JOB // (TENSORS * page)
        direct = int(round(per_job * fraction))
        row = TENSORS * page
        items, width, warps = kernels.expand_tile(page)
        consts = dict(STORE=store, SIMPLE=True, BY_HOST=True, NARROW=False, D=items, W=width)
        jobs = []
        staged = per_job - direct
        # ids disjoint between jobs: the streams run jobs side by side, and rows two jobs shared
        # would race; with --contiguous the staged rows are one run of host blocks a job
        dev_perm = rng.permutation(blocks)
        reserved = args.jobs * staged if args.contiguous else 0
        host_perm = rng.permutation(np.arange(reserved, blocks))
        for j in range(args.jobs):
            d = dev_perm[j * per_job : (j + 1) * per_job]
            h = host_perm[j * direct : (j + 1) * direct]
            if args.contiguous:
                runs = np.arange(j * staged, (j + 1) * staged)
            else:
                runs = host_perm[args.jobs * direct + j * staged :][:staged]
            h = np.concatenate([h, runs])
            jobs.append(
                dict(
                    ids=(d, h),
                    direct=torch.from_numpy(np.stack([d[:direct], h[:direct]]).astype(np.int64)).cuda(),
                    staged=torch.from_numpy(np.stack([d[direct:], np.arange(staged)]).astype(np.int64)).cuda(),
                    rows=h[direct:].tolist(),
                    staging=staging[j, : staged * row].view(staged, row),
                    n=(direct, staged),
                )
            )

        def expand(table, n, programs, base):
            kernel[(programs,)](
                table.data_ptr(), n, entries.data_ptr(), TENSORS, groups.data_ptr(), 1, TENSORS, base, row,
                **consts, num_warps=warps,
            )  # fmt: skip

        def copy_rows(job, store):
            rows, staging = job["rows"], job["staging"]
            if args.batched:  # one cuMemcpyBatchAsync a job, as the staged mechanism copies
                host_rows = host.data_ptr() + np.asarray(rows, dtype=np.uint64) * row
                stage_rows = staging.data_ptr() + np.arange(len(rows), dtype=np.uint64) * row
                sizes = np.full(len(rows), row, dtype=np.uint64)
                dst, src = (host_rows, stage_rows) if store else (stage_rows, host_rows)
                order = SRC_ACCESS_ORDER_STREAM if store else SRC_ACCESS_ORDER_ANY
                t0 = time.perf_counter()
                alive.append(driver.memcpy_batch_async(dst, src, sizes, order, c_stream.cuda_stream))
                batch_seconds[0] += time.perf_counter() - t0
                return
            pairs = (
                [(host[rows[0] : rows[0] + len(rows)], staging)]
                if args.contiguous
                else [(host[r], staging[i]) for i, r in enumerate(rows)]
            )
            for h, d in pairs:
                (h.copy_(d, non_blocking=True) if store else d.copy_(h, non_blocking=True))

        def run(job):
            """Enqueue one job on the three streams."""
            direct, staged = job["n"]
            # --one-stream: the gather runs before the direct copy on its stream, so that at
            # most `programs` SMs copy at any time; the copy engines' part waits for the gather
            if direct and not (args.one_stream and store and staged):
                with torch.cuda.stream(a_stream):
                    expand(job["direct"], direct, args.programs, host.data_ptr())
            if staged:
                ready = torch.cuda.Event()
                if store:
                    with torch.cuda.stream(a_stream if args.one_stream else g_stream):
                        expand(job["staged"], staged, args.gather_programs, job["staging"].data_ptr())
                        ready.record()
                        if direct and args.one_stream:
                            expand(job["direct"], direct, args.programs, host.data_ptr())
                    c_stream.wait_event(ready)
                    with torch.cuda.stream(c_stream):
                        copy_rows(job, store)
                else:
                    with torch.cuda.stream(c_stream):
                        copy_rows(job, store)
                        ready.record()
                    g_stream.wait_event(ready)
                    with torch.cuda.stream(g_stream):
                        expand(job["staged"], staged, args.gather_programs, job["staging"].data_ptr())

        return jobs, run

    def timed(jobs, run):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(a_stream):
            torch.cuda._sleep(200_000_000)  # holds every stream while the host enqueues
            start.record()
        g_stream.wait_event(start)
        c_stream.wait_event(start)
        batch_seconds[0] = 0.0
        t0 = time.perf_counter()
        for job in jobs:
            run(job)
        enqueue = time.perf_counter() - t0
        for s in (g_stream, c_stream):
            e = torch.cuda.Event()
            e.record(s)
            a_stream.wait_event(e)
        end.record(a_stream)
        held = not start.query()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, held, enqueue

    directions = [d == "store" for d in args.directions.split(",")]
    for page in map(int, args.pages.split(",")):
        env = setups[page] = setup(page)
        kv, host = env[1], env[2]
        for store in directions:
            d = "store" if store else "load"
            for fraction in map(float, args.direct.split(",")):
                jobs, run = make_jobs(page, fraction, store, env)
                run(jobs[0])
                torch.cuda.synchronize()
                dev_ids, host_ids = jobs[-1]["ids"]
                if store:
                    host[host_ids] = 0
                    kv[:, dev_ids] = torch.randint_like(kv[:, dev_ids], -128, 128)
                else:
                    kv[:, dev_ids] = 0
                    host[host_ids] = torch.randint(-128, 128, host[host_ids].shape, dtype=torch.int8)
                seconds, held, enqueue = timed(jobs, run)
                ok = torch.equal(kv[:, dev_ids].permute(1, 0, 2).reshape(len(dev_ids), -1).cpu(), host[host_ids])
                ratio = args.jobs * JOB / seconds / 1e9 / link[d]
                host_us = enqueue / args.jobs * 1e6, batch_seconds[0] / args.jobs * 1e6
                rows.append(
                    dict(
                        page=page, direction=d, direct=fraction, ratio=ratio, verified=ok, held=held,
                        enqueue_us=host_us[0], batch_us=host_us[1],
                    )
                )  # fmt: skip
                print(
                    f"page {page:>5} 4 MiB {d:<5} direct {fraction:.2f} (P={args.programs}) staged rest"
                    f" (gather P={args.gather_programs}): {ratio:.2f} of the link, {seconds / args.jobs * 1e6:.1f} us"
                    f" a job; host {host_us[0]:.1f} us a job to enqueue ({host_us[1]:.1f} in batched copies);"
                    f" verified {ok}{'' if held else ' (not held)'}",
                    flush=True,
                )
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    main_stream = torch.cuda.Stream()

    def loop(jobs=(), run=None):
        """The matmuls' time, started with `jobs` (held back until the matmuls are enqueued)."""
        with torch.cuda.stream(main_stream):
            torch.cuda._sleep(50_000_000)
            go = torch.cuda.Event()
            go.record()
        for s in (a_stream, g_stream, c_stream):
            s.wait_event(go)
        for job in jobs:
            run(job)
        with torch.cuda.stream(main_stream):
            marks[0].record()
            for _ in range(12):
                torch.mm(a, a)
            marks[1].record()
        torch.cuda.synchronize()
        return marks[0].elapsed_time(marks[1])

    for _ in range(3):
        loop()
    for spec in filter(None, args.interference.split(",")):
        page, d, fraction = spec.split(":")
        env = setups.get(int(page)) or setup(int(page))
        jobs, run = make_jobs(int(page), float(fraction), d == "store", env)
        alone, busy = [], []
        for _ in range(args.rounds):
            alone.append(loop())
            busy.append(loop(jobs, run))
        report_slowdown(rows, spec, alone, busy)
    write_json(args.json, link, rows)


if __name__ == "__main__":
    sys.exit(main())
