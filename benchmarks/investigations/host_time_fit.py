"""Host time of one enqueue (`copy_batch`) for `staged` and `sm_gather` over ten job shapes,
job after job as an engine submits, and least-squares fits of the cost model's host parts:
per job + per copy, and per job + per copy + per staging piece (docs/dev/cuda-tuning-log.md, step 13).

    python benchmarks/investigations/host_time_fit.py [--json OUT.json]      # on a GPU, about 30 s
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from offload_core.backend import Direction
from offload_core.backends.cuda import CudaBackend, measure
from offload_core.backends.cuda.select import piece_bounds

SHAPES = [
    (4096, 256),
    (8192, 256),
    (1024, 2048),
    (2048, 1024),
    (4096, 2048),
    (4096, 4096),
    (1024, 16384),
    (16384, 1024),
    (65536, 256),
    (2048, 16384),
]  # (copies, bytes each): 1 to 32 MiB, 1 to 4 pieces


def fit(columns: list[list[float]], y: list[float]) -> tuple[np.ndarray, float]:
    """Least-squares coefficients and the largest residual."""
    a, y = np.array(columns, dtype=float), np.array(y)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return coef, float(np.abs(a @ coef - y).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args()
    backend = CudaBackend()
    torch = backend._torch
    span = 64 << 20
    device = torch.zeros(2 * span, dtype=torch.uint8, device=backend.device)
    host = backend.alloc_host(span)
    rows = []
    for direction in Direction:
        for n, size in SHAPES:
            dev, hst, sizes = measure.fragments(n, size, device.data_ptr(), host.data_ptr())
            src, dst = (dev, hst) if direction is Direction.STORE else (hst, dev)
            row = {
                "direction": direction.value,
                "n": n,
                "size": size,
                "pieces": 1 + len(piece_bounds(n * size, backend.staging_bytes, direction is Direction.STORE)),
                "auto": backend.choose(src, dst, sizes, direction),
            }
            for mechanism in ("staged", "sm_gather"):
                row[f"{mechanism}_us"] = measure.host_time(backend, mechanism, src, dst, sizes, direction) * 1e6
            rows.append(row)
    print("| direction | copies | bytes each | pieces | staged µs | sm_gather µs | auto |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['direction']} | {r['n']} | {r['size']} | {r['pieces']} | {r['staged_us']:.0f} | {r['sm_gather_us']:.0f} | {r['auto']} |"
        )
    print()
    for d in ("store", "load"):
        rs = [r for r in rows if r["direction"] == d]
        staged = [r["staged_us"] for r in rs]
        (a, b), worst2 = fit([[1, r["n"]] for r in rs], staged)
        (c, e, p), worst3 = fit([[1, r["n"], r["pieces"]] for r in rs], staged)
        (f, g), worst_sm = fit([[1, r["n"]] for r in rs], [r["sm_gather_us"] for r in rs])
        print(
            f"{d}: staged per job + copy: {a:.0f} us + {b * 1e3:.2f} ns (worst residual {worst2:.0f} us); "
            f"+ per piece: {c:.0f} us + {e * 1e3:.2f} ns + {p:.0f} us (worst {worst3:.0f} us); "
            f"sm_gather: {f:.0f} us + {g * 1e3:.2f} ns (worst {worst_sm:.0f} us)"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
