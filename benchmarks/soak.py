"""The long soak: many rounds of `soak_rounds.soak` (threads submitting, waiting and
polling; faults injected at enqueue and on the streams; shutdowns at random moments; every
byte of every successful store-then-load checked), then ranks in separate processes sharing
a region while some of them crash and restart. Prints one JSON object; exit status 1 if a
byte was lost or wrong, a job lost or reported twice, or any error seen.

    python benchmarks/soak.py [--rounds 300] [--seed 0] [--region-cycles 50] [--backend NAME]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import asdict

from soak_rounds import region_soak, soak

from offload_core import get_backend


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="workers made, driven and shut down")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--round-seconds", type=float, default=0.3, help="longest life of one round's worker")
    parser.add_argument("--backend", help="soak this backend, without injected faults (default: cpu with faults)")
    parser.add_argument(
        "--region-cycles", type=int, default=50, help="cycles per rank process sharing a region (0: skip)"
    )
    parser.add_argument("--ranks", type=int, default=3, help="rank processes sharing the region at once")
    args = parser.parse_args()
    logging.getLogger("offload_core").setLevel(logging.CRITICAL)  # the injected faults are logged as errors
    t0 = time.perf_counter()
    backend = get_backend(args.backend) if args.backend else None
    report = soak(args.rounds, round_seconds=args.round_seconds, seed=args.seed, backend=backend)
    threads_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    regions = region_soak(args.region_cycles, ranks=args.ranks, seed=args.seed) if args.region_cycles else None
    out = {
        "threads": {
            **asdict(report),
            "backend": backend.name if backend else "cpu with injected faults",
            "clean": report.clean,
            "seconds": round(threads_s, 1),
        },
        "regions": regions
        and {**asdict(regions), "clean": regions.clean, "seconds": round(time.perf_counter() - t0, 1)},
        "machine": platform.node(),
        "python": platform.python_version(),
        "command": " ".join(["python"] + sys.argv),
    }
    print(json.dumps(out, indent=1))
    return 0 if report.clean and (regions is None or regions.clean) else 1


if __name__ == "__main__":
    sys.exit(main())
