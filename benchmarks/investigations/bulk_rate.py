"""Can the Tensor Memory Accelerator's bulk copies move a simple job's pages across the link on
fewer SMs than the Triton expansion kernel? Device time only (the stream held by a sleep kernel
while a setting's 32 jobs are enqueued), the layout of `benchmarks/engine_bench.py` (64 KV
tensors, host rows of one block's 64 pages, random device and host blocks), ratios to the best
of 10 single pinned copies in the same run, each setting's last job checked byte for byte; then
a bf16 matmul loop's slowdown beside 32 jobs of each kind (median of 11 rounds).

    python benchmarks/investigations/bulk_rate.py [--cubin bulk_copy.cubin] [--pages 256,1024,4096]
        [--job-mib 1,4] [--programs 1,2,4] [--directions store,load] [--kinds triton,lanes4x32,...]
        [--interference PAGE:MIB:DIRECTION:KIND:PROGRAMS,...]

A kernel fault leaves the context unusable for every later setting, and a wait that never ends
holds the process: run it under `timeout`, the kinds that never ran first (`--kinds`).

The kernel is `bulk_copy.cu` beside this file, built for sm_90a where nvcc is (a cubin, or PTX
that the driver compiles when it loads it, for a machine without nvcc):
    nvcc -arch=sm_90a -cubin -o bulk_copy.cubin bulk_copy.cu   (or -ptx -o bulk_copy.ptx, --cubin bulk_copy.ptx)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np
import torch
from direct_rate import kv_entries, link_gbps, report_slowdown, write_json  # beside this file

from offload_core.backends.cuda import kernels

TENSORS = 64
MAX_SMEM = 200 << 10
# kind -> (function, slots an issuer, lanes of a warp that issue, warps a program): "bulkSxW" has
# lane 0 of each of W warps issue through S slots (the 2026-12-03 probe); "lanesDxN" has N lanes
# of one warp issue, D slots each
KINDS = {
    **{f"bulk{s}x{w}": (f"bulk_ring_{s}", s, 1, w) for s, w in ((8, 4), (16, 1), (16, 4), (32, 1))},
    **{
        f"lanes{d}x{n}": (f"bulk_ring_{d}", d, n, 1)
        for d, n in ((2, 32), (4, 32), (4, 16), (2, 16), (4, 12), (4, 8), (8, 8))
    },  # (2, 16), (4, 12) and (4, 8) are the ones that fit 4 KiB pages
}


class Bulk:
    """The cubin's kernels through the driver API (torch's context current)."""

    def __init__(self, path: str):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.module = ctypes.c_void_p()
        image = open(path, "rb").read() + (b"\0" if path.endswith(".ptx") else b"")  # PTX: the driver compiles it
        self._check(self.cu.cuModuleLoadData(ctypes.byref(self.module), image), "cuModuleLoadData")
        self.functions = {}
        for name in {spec[0] for spec in KINDS.values()}:
            f = ctypes.c_void_p()
            self._check(self.cu.cuModuleGetFunction(ctypes.byref(f), self.module, name.encode()), name)
            self._check(self.cu.cuFuncSetAttribute(f, 8, MAX_SMEM), "cuFuncSetAttribute")
            self.functions[name] = f

    def _check(self, code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"{what} failed: CUresult {code}")

    @staticmethod
    def shared(kind: str, page: int) -> int:
        _, slots, lanes, warps = KINDS[kind]
        issuers = lanes * warps
        return -(-issuers * slots * 8 // 128) * 128 + issuers * slots * (-(-page // 128) * 128)

    def launch(self, kind, programs, table, n, dev_base, dev_stride, page, host_base, row, store, stream):
        name, _, lanes, warps = KINDS[kind]
        values = [
            ctypes.c_int64(table), ctypes.c_int64(n), ctypes.c_int64(dev_base), ctypes.c_int64(dev_stride),
            ctypes.c_int64(page), ctypes.c_int64(TENSORS), ctypes.c_int64(host_base), ctypes.c_int64(row),
            ctypes.c_int(int(store)), ctypes.c_int64(-(-page // 128) * 128), ctypes.c_int(lanes),
        ]  # fmt: skip
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        self._check(
            self.cu.cuLaunchKernel(
                self.functions[name], programs, 1, 1, 32 * warps, 1, 1, self.shared(kind, page),
                ctypes.c_void_p(stream), params, None,
            ),
            "cuLaunchKernel",
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cubin", default=os.path.join(os.path.dirname(__file__), "bulk_copy.cubin"))
    parser.add_argument("--pages", default="256,1024,4096")
    parser.add_argument("--job-mib", default="1,4")
    parser.add_argument("--programs", default="1,2,4")
    parser.add_argument("--directions", default="store,load")
    parser.add_argument("--kinds", help="comma-separated kinds to time (default: triton and every one of KINDS)")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument(
        "--interference", default="1024:4:store:triton:2,1024:4:store:bulk16x4:1,1024:4:store:bulk16x4:2"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.empty(1, device="cuda")
    bulk = Bulk(args.cubin)
    triton_kernel = kernels._compile()[2]
    link = link_gbps(256 << 20)
    print(f"link: store {link['store']:.1f} GB/s, load {link['load']:.1f} GB/s", flush=True)
    rows, rng = [], np.random.default_rng(0)
    setups = {}

    def setup(page):
        blocks, kv, entries = kv_entries(page, TENSORS)
        host = torch.zeros(blocks * TENSORS * page, dtype=torch.int8, pin_memory=True)
        bases = entries[0].clone().cuda()
        entries = entries.cuda()
        groups = torch.tensor([[0], [TENSORS]], dtype=torch.int64, device="cuda")
        return blocks, kv, host, entries, bases, groups

    def launcher(kind, programs, page, per_job, store, blocks, kv, host, entries, bases, groups):
        if kind == "triton":
            items, width, warps = kernels.expand_tile(page)
            consts = dict(STORE=store, SIMPLE=True, BY_HOST=True, NARROW=False, D=items, W=width)

            def launch(table, s=None):  # on `s` (a torch stream), else on the current one
                with torch.cuda.stream(s or torch.cuda.current_stream()):
                    triton_kernel[(programs,)](
                        table.data_ptr(), per_job, entries.data_ptr(), TENSORS, groups.data_ptr(), 1,
                        TENSORS, host.data_ptr(), TENSORS * page, **consts, num_warps=warps,
                    )  # fmt: skip

            return launch

        def launch(table, s=None):
            bulk.launch(
                kind, programs, table.data_ptr(), per_job, bases.data_ptr(), kv.stride(1), page,
                host.data_ptr(), TENSORS * page, store, (s or torch.cuda.current_stream()).cuda_stream,
            )  # fmt: skip

        return launch

    kinds = args.kinds.split(",") if args.kinds else ["triton", *KINDS]
    for page in map(int, args.pages.split(",")):
        setups[page] = env = setup(page)
        blocks, kv, host = env[0], env[1], env[2]
        for mib in map(int, args.job_mib.split(",")):
            per_job = max(1, (mib << 20) // (TENSORS * page))
            tables = []
            for _ in range(args.jobs):
                d, h = rng.choice(blocks, per_job, replace=False), rng.choice(blocks, per_job, replace=False)
                tables.append(torch.from_numpy(np.stack([d, h]).astype(np.int64)).cuda())
            job_bytes = per_job * TENSORS * page
            for store in [d == "store" for d in args.directions.split(",")]:
                for kind in kinds:
                    if kind != "triton" and Bulk.shared(kind, page) > MAX_SMEM:
                        print(f"page {page} {kind}: {Bulk.shared(kind, page)} bytes of shared memory, over {MAX_SMEM}")
                        continue
                    for programs in map(int, args.programs.split(",")):
                        launch = launcher(kind, programs, page, per_job, store, *env)
                        try:
                            launch(tables[0])
                            torch.cuda.synchronize()
                        except Exception as exc:
                            print(f"page {page} {mib} MiB {kind} P={programs}: {exc!r}"[:300], flush=True)
                            continue
                        last = tables[-1].cpu().numpy()
                        if store:
                            host.view(blocks, TENSORS * page)[last[1]] = 0
                            kv[:, last[0]] = torch.randint_like(kv[:, last[0]], -128, 128)  # fresh source bytes
                        else:
                            kv[:, last[0]] = 0  # and fresh source bytes: rows a failed store left zero match zeros
                            view = host.view(blocks, TENSORS * page)
                            view[last[1]] = torch.randint(-128, 128, view[last[1]].shape, dtype=torch.int8)
                        torch.cuda._sleep(50_000_000)
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        for table in tables:
                            launch(table)
                        e1.record()
                        held = not e0.query()
                        e1.synchronize()
                        seconds = e0.elapsed_time(e1) / 1e3
                        ok = torch.equal(
                            kv[:, last[0]].permute(1, 0, 2).reshape(per_job, -1).cpu(),
                            host.view(blocks, TENSORS * page)[last[1]],
                        )
                        d = "store" if store else "load"
                        ratio = args.jobs * job_bytes / seconds / 1e9 / link[d]
                        rows.append(dict(page=page, job_mib=mib, direction=d, kind=kind, programs=programs,
                                         ratio=ratio, verified=ok, held=held))  # fmt: skip
                        print(
                            f"page {page:>5} {mib} MiB {d:<5} {kind:<7} P={programs:<2}: {ratio:.2f} of the link,"
                            f" {seconds / args.jobs * 1e6:.1f} us a job; verified {ok}{'' if held else ' (not held)'}",
                            flush=True,
                        )
    # the matmul beside 32 jobs on another stream
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def loop():
        marks[0].record()
        for _ in range(12):
            torch.mm(a, a)
        marks[1].record()
        marks[1].synchronize()
        return marks[0].elapsed_time(marks[1])

    for _ in range(3):
        loop()
    for spec in filter(None, args.interference.split(",")):
        page, mib, d, kind, programs = spec.split(":")
        page, mib, programs = int(page), int(mib), int(programs)
        env = setups.get(page) or setup(page)
        blocks = env[0]
        per_job = max(1, (mib << 20) // (TENSORS * page))
        launch = launcher(kind, programs, page, per_job, d == "store", *env)
        tables = [
            torch.from_numpy(
                np.stack(
                    [rng.choice(blocks, per_job, replace=False), rng.choice(blocks, per_job, replace=False)]
                ).astype(np.int64)
            ).cuda()
            for _ in range(args.jobs)
        ]
        alone, busy = [], []
        for _ in range(11):
            alone.append(loop())
            torch.cuda.synchronize()
            for table in tables:
                launch(table, side)
            busy.append(loop())
            torch.cuda.synchronize()
        report_slowdown(rows, spec, alone, busy)
    write_json(args.json, link, rows)


if __name__ == "__main__":
    sys.exit(main())
