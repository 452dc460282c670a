"""The `offload-core` command: `backends` (what can run here) and `bench` (move blocks, verify, report)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from offload_core import registry
from offload_core.errors import OffloadError


def _table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # the `cli` extra is optional: fall back to plain columns
        cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        if title:
            print(title)
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return
    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for r in rows:
        table.add_row(*map(str, r))
    Console().print(table)


def _progress(enabled: bool):
    if enabled:
        try:
            from rich.progress import track

            return lambda it: track(it, description="offloading", transient=True)
        except ImportError:
            pass
    return lambda it: it


def cmd_backends(args: argparse.Namespace) -> int:
    avail = registry.availability()
    try:
        selected = registry.select_backend_name()
    except OffloadError:
        selected = None
    if args.json:
        print(json.dumps({"selected": selected, "backends": avail}))
        return 0
    rows = []
    for name, reason in avail.items():
        cls_priority = registry.backend_class(name).priority if reason is None or "cannot import" not in reason else "-"
        rows.append(("*" if name == selected else "", name, "yes" if reason is None else "no", cls_priority, reason or ""))
    _table("offload-core backends (* = selected)", ["", "name", "available", "priority", "reason"], rows)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from offload_core import bench

    result = bench.run(
        args.backend,
        preset=args.preset,
        blocks=args.blocks,
        blocks_per_job=args.blocks_per_job,
        blocks_per_chunk=args.blocks_per_chunk,
        iters=args.iters,
        progress=_progress(not args.json and sys.stderr.isatty()),
    )
    if args.json:
        print(json.dumps(result))
    else:
        r = result
        print(
            f"backend {r['backend']} ({r['device']}), preset {r['preset']}: {r['blocks']} blocks, "
            f"{r['blocks_per_job']} per job ({r['bytes_per_job'] / 2**20:.1f} MiB), "
            f"blocks_per_chunk {r['blocks_per_chunk']}, best of {r['iters']}"
        )
        rows = [
            (
                d,
                f"{r[f'{d}_gbps']:.2f}",
                f"{r[f'{d}_limit_gbps']:.2f}",
                f"{r[f'{d}_ratio']:.0%}",
                f"{r[f'{d}_descriptors_per_job']:.0f}",
                f"{r[f'{d}_mean_copy_bytes'] / 1024:.0f} KiB",
            )
            for d in ("store", "load")
        ]
        _table("", ["direction", "GB/s", "limit GB/s", "of limit", "descriptors/job", "mean copy"], rows)
        print(f"plan+submit {r['plan_submit_us_per_job']:.0f} us per job; verified: {'every byte' if r['verified'] else 'MISMATCH'}")
    return 0 if result["verified"] else 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    backend = registry.get_backend(args.backend)
    calibrate = getattr(backend, "calibrate", None)
    if calibrate is None:
        print(f"backend {backend.name} has nothing to calibrate")
        return 0
    print(json.dumps(calibrate(save=not args.dry_run), indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload-core", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list every backend: available or not, why, which one is selected")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_backends)
    from offload_core.bench import PRESETS

    p = sub.add_parser("bench", help="store blocks to host and load them back, verify every byte, report GB/s")
    p.add_argument("--backend", help="backend name (default: $OFFLOAD_CORE_BACKEND, else the best available)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-8b")
    p.add_argument("--blocks", type=int, default=64, help="device blocks stored and loaded per iteration")
    p.add_argument("--blocks-per-job", type=int, default=16)
    p.add_argument("--blocks-per-chunk", type=int, default=1, help="device blocks per host block")
    p.add_argument("--iters", type=int, default=5, help="iterations; the best is reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("calibrate", help="measure this accelerator's copy costs and save a selection profile")
    p.add_argument("--backend", help="backend name (default: the best available)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, do not save")
    p.set_defaults(func=cmd_calibrate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (OffloadError, ValueError) as exc:
        print(f"offload-core: {exc}", file=sys.stderr)
        return 2
