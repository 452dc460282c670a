"""Host <-> device transfer speed of the cuda backend, per mechanism, next to the link's limit.

One command, one run, on a GPU:

    python benchmarks/transfer_bench.py --out DIR

writes DIR/transfer.json, DIR/transfer.md (its tables) and
DIR/transfer.png (GB/s against fragment size per mechanism). `--mechanisms auto --parts
fragments` measures auto's per-job ratios and both directions at once alone. Sections:

1. the limit: one 256 MiB pinned copy each way, and both ways at once;
2. fragments of 256 B .. 2 MiB, device side scattered, host side in 2 MiB rows: GB/s of each
   mechanism and of auto, store / load with the copy stream busy (device time) and idle
   (device time and wall-clock from submit to completion), eight jobs back to back from an
   idle GPU (wall-clock: host and device time together, as an engine sees them; and the
   host time of one enqueue), and both at once (best and worst of 5, released by one event
   or each after its own stream's work), as ratios to (1);
3. end to end through OffloadWorker for two model presets;
4. compute interference: slowdown of a warmed-up bf16 matmul loop while each mechanism
   copies 256 B, 4 KiB or 16 KiB fragments.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import gpu_timing as measure
import numpy as np
import torch

from offload_core import bench
from offload_core.backend import Direction
from offload_core.backends.cuda import CudaBackend

KIB, MIB = 1024, 1 << 20
SIZES = [256, KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 2 * MIB]
SPAN = 256 * MIB
PARTS = ("fragments", "end-to-end", "interference")


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="folder for transfer.json, transfer.md, transfer.png")
    parser.add_argument("--mechanisms", help="comma-separated mechanisms (default: every available one and auto)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="sections after the limit, comma-separated (default: %(default)s)"
    )
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    be = CudaBackend()
    mechs = [m for m in ("ce_batch", "ce_loop") if m in be.available_mechanisms] + ["auto"]
    if args.mechanisms:
        mechs = args.mechanisms.split(",")
    dev_a = torch.zeros(2 * SPAN, dtype=torch.uint8, device=be.device)
    dev_b = torch.zeros(2 * SPAN, dtype=torch.uint8, device=be.device)
    host_a, host_b = be.alloc_host(SPAN), be.alloc_host(SPAN)
    host_a.fill_(1)
    host_b.fill_(2)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "driver_batch_api": be.driver.memcpy_batch is not None,
        "mechanisms": mechs,
    }

    # 1. the limit
    one = np.ones(1, dtype=np.int64)
    store1 = (one * dev_a.data_ptr(), one * host_a.data_ptr(), one * SPAN, Direction.STORE)
    load1 = (one * host_b.data_ptr(), one * dev_b.data_ptr(), one * SPAN, Direction.LOAD)
    limit = {
        "store": gbps(SPAN, measure.time_copy(be, "ce_batch", *store1, busy=True)["event_s"]),
        "load": gbps(SPAN, measure.time_copy(be, "ce_batch", *load1, busy=True)["event_s"]),
        "both": gbps(
            2 * SPAN,
            min(
                t
                for r in ("together", "own")
                for t in measure.time_both(be, "ce_batch", store1, load1, released=r, reps=5)
            ),
        ),
    }
    report["limit_gbps"] = limit
    print("limit", limit, flush=True)

    # 2. fragments
    rows = []
    for size in SIZES if "fragments" in parts else ():
        n = min(SPAN // size, 65536)
        nbytes = n * size
        dev_s, host_s, sizes = measure.fragments(n, size, dev_a.data_ptr(), host_a.data_ptr(), seed=1)
        dev_l, host_l, _ = measure.fragments(n, size, dev_b.data_ptr(), host_b.data_ptr(), seed=2)
        st = (dev_s, host_s, sizes, Direction.STORE)
        ld = (host_l, dev_l, sizes, Direction.LOAD)
        for mech in mechs:
            if mech == "ce_loop" and n > 4096:
                continue  # one host call per copy: hopeless below 64 KiB, and slow to wait for
            row = {"size": size, "n": n, "bytes": nbytes, "mechanism": mech}
            for name, a in (("store", st), ("load", ld)):
                busy = measure.time_copy(be, mech, *a, busy=True)
                idle = measure.time_copy(be, mech, *a, busy=False)
                row[f"{name}_chosen"] = busy["mechanism"]
                row[f"{name}_busy_gbps"] = gbps(nbytes, busy["event_s"])
                row[f"{name}_idle_gbps"] = gbps(nbytes, idle["event_s"])
                row[f"{name}_idle_wall_gbps"] = gbps(nbytes, idle["wall_s"])
                row[f"{name}_ratio"] = row[f"{name}_busy_gbps"] / limit[name]
                jobs = measure.time_jobs(be, mech, *a)
                row[f"{name}_jobs_gbps"] = gbps(8 * nbytes, jobs["wall_s"])
                row[f"{name}_host_us"] = jobs["host_s"] * 1e6
            for released in ("together", "own"):
                times = measure.time_both(be, mech, st, ld, released=released, reps=5)
                row[f"both_{released}_gbps"] = [
                    gbps(2 * nbytes, max(times)),
                    gbps(2 * nbytes, min(times)),
                ]  # worst, best
                row[f"both_{released}_ratio"] = [x / limit["both"] for x in row[f"both_{released}_gbps"]]
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    report["fragments"] = rows

    # 3. end to end through OffloadWorker
    e2e = []
    presets = (("llama-8b", 256, 64), ("llama-8b-cross-layer", 256, 64)) if "end-to-end" in parts else ()
    for preset, blocks, per_job in presets:
        for mech in mechs:
            if mech == "ce_loop" and preset == "llama-8b":
                continue
            r = bench.run(CudaBackend(mechanism=mech), preset=preset, blocks=blocks, blocks_per_job=per_job, iters=3)
            e2e.append(
                {
                    "preset": preset,
                    "mechanism": mech,
                    "verified": r["verified"],
                    "store_gbps": r["store_gbps"],
                    "load_gbps": r["load_gbps"],
                    "store_device_gbps": r["store_device_gbps"],
                    "load_device_gbps": r["load_device_gbps"],
                    "store_ratio": r["store_gbps"] / limit["store"],
                    "load_ratio": r["load_gbps"] / limit["load"],
                    "descriptors_per_job": r["store_descriptors_per_job"],
                    "plan_submit_us": r["plan_submit_us_per_job"],
                }
            )
            print(e2e[-1], flush=True)
    report["end_to_end"] = e2e

    # 4. compute interference: a warmed-up bf16 matmul loop, alone and while one direction copies
    a = torch.randn(8192, 8192, device=be.device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=be.device, dtype=torch.bfloat16)

    def matmuls(count=10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            torch.mm(a, b)
        end.record()
        return start, end

    def matmul_ms(copies=None):
        torch.cuda.synchronize()
        if copies:
            torch.cuda.current_stream().wait_event(copies())  # the loop starts when the copies do
        s, e = matmuls()
        e.synchronize()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    for _ in range(10 if "interference" in parts else 0):
        matmuls()
    stream = measure.streams(be)[0]
    cases, alone = [], []
    for size in (256, 4 * KIB, 16 * KIB) if "interference" in parts else ():
        n = min(65536, SPAN // size)
        dev_s, host_s, sizes = measure.fragments(n, size, dev_a.data_ptr(), host_a.data_ptr(), seed=3)
        jobs = -(-(1 << 30) // (n * size))  # 1 GiB: longer than the loop at the link's speed
        for mech in mechs:
            if mech == "ce_loop" or (mech == "ce_batch" and size < 16 * KIB):
                continue  # neither copies at full speed there
            for direction in Direction:
                src, dst = (dev_s, host_s) if direction is Direction.STORE else (host_s, dev_s)

                def copies():
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(
                            4 * measure.SLEEP_CYCLES
                        )  # about 200 ms: every job is enqueued before any runs
                    go = torch.cuda.Event()
                    go.record(stream)
                    for _ in range(jobs):
                        be.enqueue_with(mech, src, dst, sizes, direction, stream)
                    return go

                with_copies = []
                for _ in range(3):  # alone and with copies interleaved: clocks drift over the run
                    alone.append(matmul_ms())
                    with_copies.append(matmul_ms(copies))
                cases.append((size, mech, direction.value, min(with_copies)))
    baseline = min(alone, default=float("nan"))
    interference = [
        {
            "size": z,
            "mechanism": m,
            "direction": d,
            "matmul_ms_alone": baseline,
            "matmul_ms_with_copies": t,
            "slowdown": t / baseline - 1,
        }
        for z, m, d, t in cases
    ]
    report["matmul_alone_ms_spread"] = [baseline, max(alone, default=float("nan"))]
    print(interference, flush=True)
    report["interference"] = interference

    (out / "transfer.json").write_text(json.dumps(report, indent=1))
    (out / "transfer.md").write_text(markdown(report))
    plot(report, out / "transfer.png")
    print(markdown(report))


def both(x: dict, released: str) -> str:
    (worst, best), (worst_r, best_r) = x[f"both_{released}_gbps"], x[f"both_{released}_ratio"]
    return f"{best:.1f} ({best_r:.0%}) / {worst:.1f} ({worst_r:.0%})"


def markdown(r: dict) -> str:
    lim = r["limit_gbps"]
    lines = [
        f"{r['device']}, torch {r['torch']}, {r['date']}.",
        "",
        f"Limit: store {lim['store']:.1f} GB/s, load {lim['load']:.1f} GB/s, both at once {lim['both']:.1f} GB/s.",
        "",
    ]
    lines.append(
        "| fragment | mechanism | store GB/s (of limit) | load GB/s (of limit) | both, own: best / worst GB/s (of limit) "
        "| both, together: best / worst GB/s (of limit) | store idle: device / wall GB/s | load idle: device / wall GB/s "
        "| 8 jobs back to back, store / load GB/s (of limit) | enqueue µs per job, store / load | auto chose |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in r["fragments"]:
        size = f"{x['size'] // 1024} KiB" if x["size"] >= 1024 else f"{x['size']} B"
        if x["size"] >= 1 << 20:
            size = f"{x['size'] >> 20} MiB"
        chose = f"{x['store_chosen']} / {x['load_chosen']}" if x["mechanism"] == "auto" else ""
        lines.append(
            f"| {size} | {x['mechanism']} | {x['store_busy_gbps']:.1f} ({x['store_ratio']:.0%}) | {x['load_busy_gbps']:.1f} ({x['load_ratio']:.0%}) "
            f"| {both(x, 'own')} | {both(x, 'together')} | {x['store_idle_gbps']:.1f} / {x['store_idle_wall_gbps']:.1f} "
            f"| {x['load_idle_gbps']:.1f} / {x['load_idle_wall_gbps']:.1f} "
            f"| {x['store_jobs_gbps']:.1f} ({x['store_jobs_gbps'] / lim['store']:.0%}) / {x['load_jobs_gbps']:.1f} ({x['load_jobs_gbps'] / lim['load']:.0%}) "
            f"| {x['store_host_us']:.0f} / {x['load_host_us']:.0f} | {chose} |"
        )
    lines += [
        "",
        "| preset | mechanism | verified | store GB/s (of limit) | load GB/s (of limit) | descriptors/job | plan+submit µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in r["end_to_end"]:
        lines.append(
            f"| {x['preset']} | {x['mechanism']} | {x['verified']} | {x['store_gbps']:.1f} ({x['store_ratio']:.0%}) "
            f"| {x['load_gbps']:.1f} ({x['load_ratio']:.0%}) | {x['descriptors_per_job']:.0f} | {x['plan_submit_us']:.0f} |"
        )
    lines += [
        "",
        f"Matmul loop alone: best {r['matmul_alone_ms_spread'][0]:.1f} ms, worst {r['matmul_alone_ms_spread'][1]:.1f} ms over the run; slowdown is against the best.",
        "",
        "| fragment | mechanism | direction | matmul ms alone | with copies | slowdown |",
        "|---|---|---|---|---|---|",
    ]
    for x in r["interference"]:
        lines.append(
            f"| {x['size']} | {x['mechanism']} | {x['direction']} | {x['matmul_ms_alone']:.1f} | {x['matmul_ms_with_copies']:.1f} | {x['slowdown']:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def plot(r: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    for ax, d in zip(axes, ("store", "load", "both")):
        for mech in r["mechanisms"]:
            pts = [
                (x["size"], x[f"{d}_busy_gbps"] if d != "both" else x["both_own_gbps"][1])
                for x in r["fragments"]
                if x["mechanism"] == mech
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mech)
        ax.axhline(r["limit_gbps"][d], color="k", linestyle="--", label="limit")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("fragment bytes")
        ax.set_title(f"{d if d != 'both' else 'both at once (own, best)'} ({r['device']})")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
