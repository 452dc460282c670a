"""The engine's view: many small jobs over a many-layer KV cache, back to back, random block ids.

For each page size and job size, J store jobs (random block ids, no two consecutive jobs
sharing a block) are submitted one after another through `OffloadWorker` (then J loads of the same blocks into other device blocks), and the wall
clock from the first submit to the last completion is compared with the link's limit
measured in the same run (the best of several single pinned copies of the same bytes, each
way). Reported per shape and mechanism: the ratio to the limit, median and p99 host time of
a submit (specs built from id arrays included), jobs per launch and the host time launches
took per job (compact jobs, enqueued by the submit, `wait` or the queue's launcher), how many
enqueues waited for the device (a buffer of the backend full: cuda's descriptor ring), how much of the
wall time the copy stream was busy (each launch's start to end event), device memory the backend allocated beyond
the KV cache, and whether the last job's bytes arrived. On `cuda`, every mechanism is also
forced beside `auto`, each on a worker of its own, their measured passes taken in turn (a VM's
host drifts over seconds); forced `ce_batch` is the seed's way (one batched copy per job).

    python benchmarks/engine_bench.py [--backend cuda] [--pages 256,1024,4096,32768]
        [--blocks-per-job 1,16,128 | --job-mib 256] [--layers 32 | --tensors 1] [--jobs 32] [--json FILE]
        [--host-runs] [--no-host-order] [--bursts 16:128,32:32] [--repeat 2]
        [--interference [--directions store,load] [--rounds 5]]

`--bursts JOBS:MIB,...` runs every shape once per setting of the queue's burst (a burst's
jobs launch together once JOBS of them or MIB MiB wait; the default is the queue's own), and
`--repeat N` N times, the settings' order reversed every other time: the settings then compare
within seconds of each other, where a VM's host drifts over minutes. `--interference` instead
times a bf16 matmul loop alone and behind J jobs: its slowdown from its first event to its
last, and of the matmuls' own device time (events around each: the host's delays left out).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import platform
import time
from unittest import mock

import numpy as np
import torch

from offload_core import (
    DeviceBlocks,
    HostBlocks,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadError,
    OffloadWorker,
    get_backend,
)
from offload_core.bench import _limit_gbps
from offload_core.queue import TransferQueue

# A shape's measured passes: as many as would take MIN_MEASURED_S of its shorter direction as
# its last warm-up pass ran (the most any of the interleaved backends needs), at least the
# `passes` asked for, at most MAX_PASSES: the median then outlasts a pause of the host. A backend
# whose passes took MAX_MEASURED_S in all stops at `passes` (the slow ones: their passes are long).
MIN_MEASURED_S = 0.2
MAX_MEASURED_S = 2.0
MAX_PASSES = 25


def _backends(name: str | None, mechanisms: list[str] | None):
    base = get_backend(name)
    if base.name != "cuda":
        return [("default", base)]
    from offload_core.backends.cuda import CudaBackend, driver
    from offload_core.backends.cuda.select import CostModel

    def made(m: str):
        if m == "auto-sm1":  # auto choosing by speed alone: launches on the SMs weigh no more
            return CudaBackend(mechanism="auto", cost_model=CostModel(sm_penalty=1.0))
        if m != "auto-ctypes":
            return CudaBackend(mechanism=m)
        # auto without _driver.c (its driver calls through ctypes, its kernels through Triton's
        # launcher): what the compiled module buys, in the same run
        with mock.patch.object(driver, "compiled", lambda: None):
            return CudaBackend(mechanism="auto", driver=driver.Driver.load())

    return [(m, made(m)) for m in mechanisms or ["auto", *base.available_mechanisms]]


def _runs(sizes, bursts: list, repeat: int):
    """(job size, burst setting, repeat index) in run order: per job size, every setting once
    per repeat, in reverse order every other repeat (no setting always runs first)."""
    for per_job in sizes:
        for r in range(repeat):
            for burst in bursts if r % 2 == 0 else bursts[::-1]:
                yield per_job, burst, r


def _allocated(backend) -> int:
    return torch.cuda.memory_allocated(backend.device) if backend.device.type == "cuda" else 0


def launches_timed(backend):
    """How many launches cuda's `auto` has timed so far (its trials), as a function to call
    again; 0 on a backend that times none."""
    tuner = getattr(getattr(backend, "_blocks", None), "tuner", None)
    return lambda: getattr(tuner, "timed", 0)


def _last_writers(dst: list[np.ndarray], src: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each block that jobs wrote (`dst`, per job in submission order) once, with the block the
    last of them copied into it (`src`)."""
    d, s = np.concatenate(dst)[::-1], np.concatenate(src)[::-1]
    written, last = np.unique(d, return_index=True)
    return written, s[last]


def run_shape(
    backend, page: int, per_job: int, count: int, jobs: int, seed: int = 0, host_runs: bool = False, passes: int = 3
) -> dict:
    """One page size and job size over `count` KV tensors on one backend: stores, then loads,
    J jobs back to back. Host blocks are random, or with `host_runs` each job's a run of
    consecutive blocks handed out backwards (as a free list, last freed first, gives them).
    Each direction's rate is the median of at least `passes` measured passes, more where a pass
    is short (`MIN_MEASURED_S`: a pass of small jobs lasts a millisecond or two, and one alone is
    noise); the other figures are the last pass's."""
    (row,) = run_interleaved([backend], page, per_job, count, jobs, seed, host_runs, passes)
    return row


def run_interleaved(
    backends: list,
    page: int,
    per_job: int,
    count: int,
    jobs: int,
    seed: int = 0,
    host_runs: bool = False,
    passes: int = 3,
) -> list[dict]:
    """`run_shape` on each of `backends` (a worker each, alive together), their measured passes
    taken in turn: each backend's first, then each one's second...: a VM's host, whose speed
    drifts over seconds to minutes, then weighs on every backend alike. Each round starts one
    backend further on, so that none always follows the same other (a slow one leaves the host's
    caches and clocks as they are for the next), and every backend takes as many passes as the
    one that wants most (`MIN_MEASURED_S`), unless its own have taken `MAX_MEASURED_S`."""
    outs = [{} for _ in backends]
    wanted: list[int] = []  # each backend's pass count, once warm: every backend takes the most
    live = [
        _shape_steps(b, page, per_job, count, jobs, seed, host_runs, passes, out, wanted)
        for b, out in zip(backends, outs)
    ]
    while live:
        for steps in list(live):
            if next(steps, None) is None:
                live.remove(steps)
        live = live[1:] + live[:1]
    return outs


def _shape_steps(backend, page, per_job, count, jobs, seed, host_runs, passes, out: dict, wanted: list):
    """`run_shape` into `out`, yielding True after each measured pass (another backend's turn):
    the first turn also sets up and warms up, the turn after the last pass finishes."""
    # about 512 MiB of KV (at most 8192 blocks), and at least two jobs' worth
    blocks = max(2 * per_job, min(8192, (1 << 29) // (count * page)), 64)
    device = backend.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = [
        KVCacheTensor(torch.randint(-128, 128, (blocks, page), dtype=torch.int8, generator=gen, device=device), page)
        for _ in range(count)
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, page) for i in range(len(tensors))]])
    rng = np.random.default_rng(seed)
    # Random ids, but consecutive jobs never share a block, as an engine's never do (it does not
    # store into a host block, or load into a device block, that a job in flight still writes).
    dev_perm, host_perm = rng.permutation(blocks), rng.permutation(blocks)
    take = lambda perm, j: np.take(perm, np.arange(j * per_job, (j + 1) * per_job), mode="wrap")  # noqa: E731
    if host_runs:
        starts = rng.permutation(blocks // per_job) * per_job  # whole runs, none shared by two jobs
        specs = [(take(dev_perm, j), starts[j % starts.size] + np.arange(per_job)[::-1]) for j in range(jobs)]
    else:
        specs = [(take(dev_perm, j), take(host_perm, j)) for j in range(jobs)]
    job_bytes = per_job * page * len(tensors)
    # (host rows, device pages) each direction's passes leave, as their last writers left them:
    # the same every pass, and an argsort of every id, found once
    written = {
        "store": _last_writers([h for _, h in specs], [d for d, _ in specs]),
        "load": _last_writers([specs[(j + 1) % jobs][0] for j in range(jobs)], [h for _, h in specs])[::-1],
    }
    before = _allocated(backend)
    out.update(
        {
            "page": page,
            "blocks_per_job": per_job,
            "tensors": len(tensors),
            "job_bytes": job_bytes,
            "jobs": jobs,
            "host_runs": host_runs,
        }
    )
    with OffloadWorker(kv, blocks, backend=backend) as worker:
        pending = getattr(backend, "trials_pending", lambda: 0)
        tuner = getattr(getattr(backend, "_blocks", None), "tuner", None)
        timed = launches_timed(backend)
        walls = {}  # each direction's last pass, seconds
        measured = []  # each measured pass's seconds, both directions

        def schedule():  # True: a pass to warm up; False: a measured one
            seen = timed()
            yield True  # pools, rings, compiled kernels
            # while `auto` still measures its candidates (cuda): until a pass timed no launch, as
            # an engine's launches run once its first have decided. A class still on
            # trial then is one this pass did not meet (a rare one, or an earlier shape's): it
            # holds nothing up, and `trial_launches_measured` tells if a measured pass meets it.
            for _ in range(24):
                if timed() == seen:
                    break
                seen = timed()
                yield True
            out["trials_pending"] = pending()  # as the measured passes begin, whatever shape met them
            for key, trial in dict(getattr(tuner, "_trials", {})).items():  # with --log-decisions: why
                counts = {n: (len(trial.costs[n]), trial.pending[n]) for n in trial.offered}
                logging.getLogger("offload_core.backends.cuda.tuning").info(
                    "cuda auto: %s still on trial, (timed, in flight) %s, struck %s", key.name(), counts, trial.struck
                )
            seen = timed()
            # a pass of small jobs lasts a millisecond or two, where one pause of the host weighs
            # (`MIN_MEASURED_S`); every backend warms up in the first round, so from the second
            # on they all see every count and take as many passes, in turn
            wanted.append(math.ceil(MIN_MEASURED_S / max(1e-6, min(walls.values()))))
            while len(measured) < max(passes, min(MAX_PASSES, max(wanted))):
                if len(measured) >= passes and sum(measured) >= MAX_MEASURED_S:
                    break
                yield False
            out["trial_launches_measured"] = timed() - seen  # 0 unless a measured pass met a new class

        rates = {"store": [], "load": []}

        for warm in schedule():
            for direction in ("store", "load"):
                submit_s = []
                if not warm:  # the setup's garbage collected now, not by a pause inside the measured jobs
                    gc.collect()
                stats = worker.stats()[direction]
                launches, launch_s, buffer_waits = stats.launches, stats.launch_s, stats.buffer_waits
                t0, cpu0 = time.perf_counter(), time.process_time()
                for j, (dev, host) in enumerate(specs):
                    s0 = time.perf_counter()
                    if direction == "store":
                        worker.submit_store(j, DeviceBlocks(dev), HostBlocks(host))
                    else:  # into other blocks: the ids shifted by one job
                        worker.submit_load(j, HostBlocks(host), DeviceBlocks(specs[(j + 1) % jobs][0]))
                    submit_s.append(time.perf_counter() - s0)
                cpu = time.process_time() - cpu0  # every thread's, while the jobs are submitted (not the wait)
                worker.wait(range(jobs))
                wall = walls[direction] = time.perf_counter() - t0
                results = worker.get_finished()
                if not warm:
                    us = np.array(submit_s) * 1e6
                    rates[direction].append(jobs * job_bytes / wall / 1e9)
                    out[f"{direction}_wall_gbps"] = float(np.median(rates[direction]))
                    out[f"{direction}_submit_us_median"] = float(np.median(us))
                    out[f"{direction}_submit_us_p99"] = float(np.percentile(us, 99))
                    # CPU time, unlike wall time, leaves out what a VM's host takes away (steal):
                    # where it holds steady while the wall time drifts, the drift is the machine's
                    out[f"{direction}_host_cpu_us_per_job"] = cpu / jobs * 1e6
                    out[f"{direction}_ok"] = (
                        out.get(f"{direction}_ok", True) and all(r.success for r in results) and len(results) == jobs
                    )
                    out[f"{direction}_jobs_per_launch"] = jobs / max(1, worker.stats()[direction].launches - launches)
                    out[f"{direction}_launch_us_per_job"] = (worker.stats()[direction].launch_s - launch_s) / jobs * 1e6
                    # enqueues that waited for the device, a buffer of the backend full (cuda's descriptor ring)
                    out[f"{direction}_buffer_waits"] = worker.stats()[direction].buffer_waits - buffer_waits
                    took = {r.mechanism for r in results} | set(out.get(f"{direction}_mechanisms", ()))
                    out[f"{direction}_mechanisms"] = sorted(took)  # of every measured pass
                    # the copy stream's busy time (each launch's start to end event) over the wall
                    # time: near 1, the device bounds the jobs; lower, the host leaves it waiting
                    out[f"{direction}_device_busy"] = sum(r.transfer_time for r in results) / wall
                    # every job's bytes: the host rows after the stores, the device pages after
                    # the loads (each as its last writer left it); its memory is not the backend's
                    host_ids, dev_ids = written[direction]
                    out[f"{direction}_verified"] = out.get(f"{direction}_verified", True) and all(
                        torch.equal(h[host_ids].to(device), t.tensor[dev_ids])
                        for h, t in zip(worker.host_tensors, tensors)
                    )  # every measured pass's
            if not warm:  # another backend's turn; what this one allocated is known before it
                out.setdefault("device_bytes_beyond_kv", _allocated(backend) - before)
                measured.append(sum(walls.values()))
                yield True
        out["verified"] = out.pop("store_verified") and out.pop("load_verified")
        total = jobs * job_bytes
        limit_host = backend.alloc_host(total)
        limit_dev = torch.empty(total, dtype=torch.uint8, device=device)
        limit = _limit_gbps(backend, total, limit_host, limit_dev)
    for direction in ("store", "load"):
        out[f"{direction}_limit_gbps"] = limit[direction]
        out[f"{direction}_ratio"] = out[f"{direction}_wall_gbps"] / limit[direction]
    return out


def submit_random(worker, rng, blocks: int, per_job: int, direction: str, job_id: int) -> None:
    """Submit job `job_id` of `per_job` random device blocks and as many random host blocks."""
    dev = DeviceBlocks(rng.choice(blocks, per_job, replace=False))
    host = HostBlocks(rng.choice(blocks, per_job, replace=False))
    if direction == "store":
        worker.submit_store(job_id, dev, host)
    else:
        worker.submit_load(job_id, host, dev)


def interference(
    backend, page: int, per_job: int, layers: int, jobs: int, seed: int = 0, direction: str = "store", rounds: int = 5
) -> dict:
    """How much jobs in flight slow a bf16 matmul loop on the compute stream, as an engine's next
    step runs while the last step's blocks are offloaded (stores) or other requests' blocks are
    brought back (loads): median of `rounds` rounds (after one to warm up), each the loop alone
    and then behind `jobs` jobs of `direction` submitted just before it."""
    device = backend.device
    blocks = max(2 * per_job * jobs // 4, 64)
    tensors = [
        KVCacheTensor(torch.zeros(blocks, page, dtype=torch.int8, device=device), page) for _ in range(2 * layers)
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, page) for i in range(len(tensors))]])
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    rng = np.random.default_rng(seed)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2 * 12)]

    def matmuls(count=12) -> tuple[float, float, float, float]:
        """The loop's device ms from its start to its end, the sum of its matmuls' own device ms
        (without the gaps where the device waited for the host), and the host ms to enqueue it
        and to its first matmul (the device waits for the host between the loop's start and its
        first matmul, so a late one counts in the first figure, not in the second)."""
        t0 = time.perf_counter()
        for i in range(count):
            marks[2 * i].record()
            torch.mm(a, a)
            marks[2 * i + 1].record()
            if i == 0:
                first = time.perf_counter()
        enqueued = time.perf_counter()
        marks[2 * count - 1].synchronize()
        own = sum(marks[2 * i].elapsed_time(marks[2 * i + 1]) for i in range(count))
        return marks[0].elapsed_time(marks[2 * count - 1]), own, (enqueued - t0) * 1e3, (first - t0) * 1e3

    alone, busy, ids, failed = [], [], 0, 0
    with OffloadWorker(kv, blocks, backend=backend) as worker:
        matmuls(3)
        for _ in range(rounds + 1):
            alone.append(matmuls())
            for _ in range(jobs):
                submit_random(worker, rng, blocks, per_job, direction, ids)
                ids += 1
            busy.append(matmuls())
            worker.wait(range(ids))
            results = worker.get_finished()
            mechanisms = sorted({r.mechanism for r in results})
            failed += sum(not r.success for r in results)
    alone_ms, busy_ms = float(np.median([b[0] for b in alone[1:]])), float(np.median([b[0] for b in busy[1:]]))
    alone_own, busy_own = float(np.median([b[1] for b in alone[1:]])), float(np.median([b[1] for b in busy[1:]]))
    return {
        "page": page,
        "blocks_per_job": per_job,
        "jobs": jobs,
        "direction": direction,
        "matmul_ms": alone_ms,
        "matmul_busy_ms": busy_ms,
        "slowdown": busy_ms / alone_ms - 1,
        # the matmuls' own device time: what the copies' use of the device costs them, the host's delays aside
        "device_slowdown": busy_own / alone_own - 1,
        "matmul_enqueue_ms": float(np.median([b[2] for b in busy[1:]])),
        "matmul_first_ms": float(max(b[3] for b in busy[1:])),  # the worst of the rounds
        "matmul_first_alone_ms": float(max(b[3] for b in alone[1:])),
        "mechanisms": mechanisms,
        "failed_jobs": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", help="backend name (default: the best available)")
    parser.add_argument(
        "--mechanisms",
        help="cuda: comma-separated mechanisms (default: auto and every available one); auto-ctypes is auto "
        "without the compiled driver calls (backends/cuda/_driver.c), auto-sm1 auto by speed alone (sm_penalty 1)",
    )
    parser.add_argument("--pages", default="256,1024,4096,32768", help="page sizes in bytes (default: %(default)s)")
    parser.add_argument("--blocks-per-job", default="1,16,128", help="blocks per job (default: %(default)s)")
    parser.add_argument(
        "--layers", type=int, default=32, help="layers; K and V are separate tensors (default: %(default)s)"
    )
    parser.add_argument(
        "--tensors",
        type=int,
        help="KV tensors, instead of 2 x layers (1: one tensor, pages scattered over host blocks)",
    )
    parser.add_argument("--job-mib", type=float, help="job size in MiB, instead of --blocks-per-job")
    parser.add_argument(
        "--no-host-order",
        action="store_true",
        help="send launches in job order, not host-block order (what host order buys, measured against it)",
    )
    parser.add_argument(
        "--host-runs",
        action="store_true",
        help="each job's host blocks one run of consecutive blocks, backwards (a free list's order), not random",
    )
    parser.add_argument("--jobs", type=int, default=32, help="jobs back to back per direction (default: %(default)s)")
    parser.add_argument("--bursts", help="comma-separated JOBS:MIB burst settings, each shape run under each")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each shape and setting (default: %(default)s)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--interference",
        action="store_true",
        help="cuda: instead, the slowdown of a matmul loop while jobs run, per shape and mechanism",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="with --interference: rounds, whose median is taken (default: %(default)s)",
    )
    parser.add_argument(
        "--directions",
        default="store",
        help="with --interference: comma-separated directions of the jobs beside the matmul (default: %(default)s)",
    )
    parser.add_argument(
        "--log-decisions",
        action="store_true",
        help="cuda: print each shape class auto decides, with its candidates' measured seconds per GiB, and each "
        "timed launch (its host time, and its device time as measured and as auto counts it)",
    )
    args = parser.parse_args()
    if args.log_decisions:
        # the time of day, to set beside the GPU's clocks (gpu_check.sh grid logs them)
        logging.basicConfig(format="%(asctime)s.%(msecs)03d %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("offload_core.backends.cuda.tuning").setLevel(logging.DEBUG)
    if args.no_host_order:
        from offload_core.compact import CompactJob

        CompactJob.in_host_order = lambda self: self
    rows = []
    mechanisms = args.mechanisms.split(",") if args.mechanisms else None
    if args.interference:
        directions = [d.strip() for d in args.directions.split(",")]
        if not set(directions) <= {"store", "load"}:
            parser.error(f"--directions takes store and load, got {args.directions!r}")
        for name, backend in _backends(args.backend, mechanisms):
            for page in map(int, args.pages.split(",")):
                for per_job in map(int, args.blocks_per_job.split(",")):
                    for direction in directions:
                        row = {
                            "mechanism": name,
                            **interference(
                                backend, page, per_job, args.layers, args.jobs, direction=direction, rounds=args.rounds
                            ),
                        }
                        rows.append(row)
                        print(
                            f"{name:13} page {page:>6} B x {per_job:>3} blocks: matmul {row['matmul_ms']:.2f} ms "
                            f"alone, {row['matmul_busy_ms']:.2f} ms behind {args.jobs} {direction}s "
                            f"({row['slowdown']:+.1%}, on the device {row['device_slowdown']:+.1%}; "
                            f"{','.join(row['mechanisms'])}; {row['failed_jobs']} failed; its host enqueue "
                            f"{row['matmul_enqueue_ms']:.2f} ms, to the first {row['matmul_first_ms']:.2f}, "
                            f"alone {row['matmul_first_alone_ms']:.2f})",
                            flush=True,
                        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": platform.node(), "torch": torch.__version__, "interference": rows}, f, indent=1)
        return
    defaults = (TransferQueue.burst_jobs, TransferQueue.burst_bytes / 2**20)
    bursts = [defaults]
    if args.bursts:
        try:
            bursts = [(int(j), float(m)) for j, m in (b.split(":") for b in args.bursts.split(","))]
        except ValueError:
            parser.error(f"--bursts takes JOBS:MIB pairs, got {args.bursts!r}")
    named = _backends(args.backend, mechanisms)
    for page in map(int, args.pages.split(",")):
        count = args.tensors or 2 * args.layers
        sizes = (
            [max(1, int(args.job_mib * 2**20) // (page * count))]
            if args.job_mib
            else map(int, args.blocks_per_job.split(","))
        )
        for per_job, (jobs_, mib), repeat in _runs(sizes, bursts, args.repeat):
            TransferQueue.burst_jobs, TransferQueue.burst_bytes = jobs_, int(mib * 2**20)
            shapes = run_interleaved([b for _, b in named], page, per_job, count, args.jobs, host_runs=args.host_runs)
            for (name, backend), shape in zip(named, shapes):
                row = {
                    "backend": backend.name,
                    "mechanism": name,
                    "burst_jobs": jobs_,
                    "burst_mib": mib,
                    "repeat": repeat,
                    **shape,
                }
                rows.append(row)
                burst = f" burst {jobs_}:{mib:g}" if args.bursts else ""
                print(
                    f"{backend.name:5} {name:9}{burst} page {page:>6} B x {per_job:>3} blocks ({row['job_bytes'] / 2**20:7.2f} MiB): "
                    f"store {row['store_ratio']:5.2f} load {row['load_ratio']:5.2f} of the link; submit median "
                    f"{row['store_submit_us_median']:6.0f} / {row['load_submit_us_median']:6.0f} us, p99 "
                    f"{row['store_submit_us_p99']:6.0f} / {row['load_submit_us_p99']:6.0f} us; host cpu "
                    f"{row['store_host_cpu_us_per_job']:.0f} / {row['load_host_cpu_us_per_job']:.0f} us per job; "
                    f"+{row['device_bytes_beyond_kv'] / 2**20:.0f} MiB device; jobs per launch "
                    f"{row['store_jobs_per_launch']:.1f} / {row['load_jobs_per_launch']:.1f} (launch "
                    f"{row['store_launch_us_per_job']:.0f} / {row['load_launch_us_per_job']:.0f} us per job, "
                    f"{row['store_buffer_waits']} / {row['load_buffer_waits']} waited for a full buffer); "
                    f"stream busy {row['store_device_busy']:.2f} / {row['load_device_busy']:.2f}; "
                    f"{'+'.join(row['store_mechanisms'])} / {'+'.join(row['load_mechanisms'])}; verified {row['verified']}; "
                    f"every job succeeded {row['store_ok'] and row['load_ok']}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except OffloadError as exc:  # a backend that cannot run here, a bad setting: the message says which
        raise SystemExit(f"engine_bench: {exc}") from None
