"""`auto` against the best forced mechanism, per shape and direction, from benchmarks/engine_bench.py
JSON files of one run (every file's rows measured with `auto` and the forced mechanisms beside it).

    python benchmarks/auto_vs_best.py grid-*.json [--target 0.95]

Prints one row per shape and direction: `auto`'s ratio to the link and what it chose, the best
forced mechanism's, and their quotient (of the rates, every row of a shape measured against
one link: the best of its rows' link measurements, which are noisy one by one); then the worst quotient and how many shapes fall below
`--target` (exit status 1 where any does). A cell whose best mechanism holds SMs for a whole
launch of `SM_HOLD_S` or longer while `auto` took the copy engines is marked: `auto` spares
the SMs there by design (its cost model weighs such launches `sm_penalty` times); one whose
measured passes still timed trial launches is marked "still on trial". Column "auto/best
weighed" weighs the forced mechanisms as `auto` does (`CostModel.sm_weight`: a mechanism on the
SMs counts its launch's time that many times), `auto`'s own launches too, and compares the two;
"auto-sm1/best", where the files have `auto-sm1` rows (auto choosing by speed alone), theirs
against the best; "auto's choice forced/best", what `auto`'s choice costs apart from the run's
noise: the forced rate of the mechanism it took (the slower, where its measured passes took two)
against the best's ("-" where one it took has no forced row).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from offload_core.backends.cuda.select import SM_HOLD_S, CostModel

ON_SMS = {
    "expand_direct",
    "sm_gather",
}  # the mechanisms that hold SMs while the bytes cross the link (sm_gather: of files from before its removal)


def launch_s(row: dict, d: str) -> float:
    """How long one launch of `row`'s mechanism held the device in direction `d`: its jobs at its
    rate, the share of the wall time the copy stream was busy."""
    rate = row[f"{d}_wall_gbps"] * 1e9
    wall = row.get(f"{d}_jobs_per_launch", 1.0) * row["job_bytes"] / rate if rate else 0.0
    return wall * row.get(f"{d}_device_busy", 1.0)


def weighed(row: dict, d: str) -> float:
    """`row`'s rate as `auto` weighs it: a launch costs the longer of its host time and its device
    time, the device time on the SMs counted `sm_weight` times (`auto`'s own where any of its
    launches took a mechanism on the SMs); the wall time stands for the host's."""
    took = {row["mechanism"]} | set(row.get(f"{d}_mechanisms") or ())
    if not ON_SMS & took:
        return row[f"{d}_wall_gbps"]
    busy = row.get(f"{d}_device_busy", 1.0)
    return row[f"{d}_wall_gbps"] / max(1.0, busy * CostModel().sm_weight(launch_s(row, d)))


def cells(rows: list[dict]) -> list[tuple]:
    """(shape, direction, auto ratio, auto's choice, best forced name, its ratio, auto against
    the best forced with both weighed as `auto` weighs them) per shape with `auto`."""
    shapes: dict = defaultdict(dict)
    for r in rows:
        key = (r["tensors"], r["page"], r["job_bytes"], r.get("host_runs", False))
        shapes[key][r["mechanism"]] = r
    out = []
    for key, by in sorted(shapes.items()):
        if "auto" not in by or len(by) < 2:
            continue
        for d in ("store", "load"):
            link = max(r[f"{d}_limit_gbps"] for r in by.values())
            forced = {
                m: r[f"{d}_wall_gbps"] / link
                for m, r in by.items()
                if not m.startswith("auto") and r.get(f"{d}_wall_gbps")
            }
            if not forced:
                continue
            best = max(forced, key=forced.get)
            took = by["auto"].get(f"{d}_mechanisms") or []
            chose = "/".join(took)
            if by["auto"].get("trial_launches_measured"):
                chose += ", still on trial"  # its measured passes timed trial launches
            held = launch_s(by[best], d)
            if best in ON_SMS and held >= SM_HOLD_S and not ON_SMS & set(took):
                chose += f", SMs spared: {best} holds them {held * 1e3:.2f} ms a launch"
            weighs = weighed(by["auto"], d) / max(weighed(by[m], d) for m in forced)
            fast = by.get("auto-sm1", {}).get(f"{d}_wall_gbps")
            fast = (
                f"{fast / link / forced[best]:.2f} ({'/'.join(by['auto-sm1'].get(f'{d}_mechanisms') or [])})"
                if fast
                else "-"
            )
            # what the choice costs apart from the run: auto's mechanism forced, against the best
            # (where auto took the best's own, its gap is between two runs of one mechanism)
            choice = min(forced[m] for m in took) / forced[best] if took and set(took) <= forced.keys() else None
            out.append((key, d, by["auto"][f"{d}_wall_gbps"] / link, chose, best, forced[best], weighs, fast, choice))
    return out


def miss_kind(cell: tuple) -> str:
    """Why a cell of `cells` falls short, as docs/performance.md sorts the misses: "spared" (auto
    took the copy engines where the best holds SMs), "two" (its measured passes took more than one
    mechanism, or timed trial launches), "own" (it took the best's own mechanism: the gap is
    between two runs of one mechanism), else "other"."""
    chose, best = cell[3], cell[4]
    took = chose.split(",")[0].split("/")
    if "SMs spared" in chose:
        return "spared"
    if len(took) > 1 or "still on trial" in chose:
        return "two"
    return "own" if took == [best] else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--target", type=float, default=0.95)
    args = ap.parse_args()
    rows = [r for path in args.json for r in json.load(open(path))["rows"]]
    found = cells(rows)
    print(
        "| tensors | page | MiB/job | host runs | dir | auto (chose) | best forced | auto/best | auto/best weighed "
        "| auto-sm1/best | auto's choice forced/best |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def floor3(x: float) -> str:  # rounded down, so that a cell under the target never prints as on it
        return f"{math.floor(x * 1000) / 1000:.3f}"

    for (tensors, page, job, runs), d, a, chose, best, b, w, fast, choice in found:
        print(
            f"| {tensors} | {page} | {job / 2**20:.2f} | {runs} | {d} | {a:.2f} ({chose}) | {b:.2f} {best} "
            f"| {floor3(a / b)} | {floor3(w)} | {fast} | {'-' if choice is None else f'{choice:.2f}'} |"
        )
    if not found:
        raise SystemExit("no shape measured with auto and a forced mechanism")
    worst = min(found, key=lambda c: c[2] / c[5])
    below = [c for c in found if c[2] / c[5] < args.target]
    spared = sum("SMs spared" in c[3] for c in below)
    below_weighed = sum(c[6] < args.target for c in found)
    fast = [float(c[7].split()[0]) for c in found if c[7] != "-"]
    chosen = [c[8] for c in found if c[8] is not None]
    print(
        f"\nworst: {worst[2] / worst[5]:.2f} ({worst[1]} of {worst[0]}); below {args.target}: {len(below)} of "
        f"{len(found)}, {spared} of them where auto spared the SMs; against the best weighed: {below_weighed}"
        + (
            f"; auto-sm1 below: {sum(f < args.target for f in fast)} of {len(fast)}, worst {min(fast):.2f}"
            if fast
            else ""
        )
        + f"; auto's choice forced below: {sum(c < args.target for c in chosen)} of {len(chosen)}"
    )
    kinds = [miss_kind(c) for c in below]
    print(
        f"misses: SMs spared {kinds.count('spared')} / on the best's own mechanism {kinds.count('own')} / "
        f"two mechanisms {kinds.count('two')} / other {kinds.count('other')}"
    )
    raise SystemExit(1 if below else 0)


if __name__ == "__main__":
    main()
