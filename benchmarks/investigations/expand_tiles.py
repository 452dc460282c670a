"""The expansion kernel's tile (items per step, 64-bit words per item and step) against the link,
per entry size: forced ``expand_direct`` (the kernel reads or writes host rows itself), 64 KV
tensors, jobs back to back as `benchmarks/engine_bench.py` runs them, for each candidate tile.

    python benchmarks/investigations/expand_tiles.py [--pages 256,1024,4096] [--jobs 64]   # on a GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_bench import run_shape  # noqa: E402

from offload_core.backends.cuda import CudaBackend, kernels  # noqa: E402

CANDIDATES = ((128, 32), (64, 64), (32, 128), (16, 256))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="256,1024,4096")
    parser.add_argument("--blocks-per-job", type=int, default=0, help="default: a 4 MiB job")
    parser.add_argument("--jobs", type=int, default=64)
    args = parser.parse_args()
    chosen = kernels.expand_tile
    for page in map(int, args.pages.split(",")):
        per_job = args.blocks_per_job or max(1, (4 << 20) // (64 * page))
        for tile in (None, *CANDIDATES):
            if tile is not None and tile[1] * 8 > 4 * page:
                continue  # words per step far beyond the entry: masked lanes only
            kernels.expand_tile = chosen if tile is None else (lambda largest, tile=tile: tile)
            kernels._compiled.clear()
            row = run_shape(CudaBackend(mechanism="expand_direct"), page, per_job, 64, args.jobs)
            label = f"default {chosen(page)}" if tile is None else str(tile)
            print(
                f"page {page:>5} B x {per_job:>3} blocks, tile {label:>18}: store {row['store_ratio']:.2f} "
                f"load {row['load_ratio']:.2f} of the link; verified {row['verified']}",
                flush=True,
            )
    kernels.expand_tile = chosen


if __name__ == "__main__":
    main()
