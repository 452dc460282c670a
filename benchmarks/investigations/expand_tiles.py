"""The expansion kernel's tile (items per step, 64-bit words per item and step) against the link,
per entry size: forced ``expand_direct`` (the kernel reads or writes host rows itself), for each
candidate tile. Either 64 KV tensors with jobs back to back as `benchmarks/engine_bench.py` runs
them, or (``--canonical``) the canonical layouts of `benchmarks/canonical_bench.py`, whose entries
are one head's fragment (128 B - 4 KiB).

    python benchmarks/investigations/expand_tiles.py [--pages 256,1024,4096] [--jobs 64]   # on a GPU
    python benchmarks/investigations/expand_tiles.py --canonical [--heads 128,256]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import canonical_bench  # noqa: E402
from engine_bench import run_shape  # noqa: E402

from offload_core.backends.cuda import CudaBackend, kernels  # noqa: E402

CANDIDATES = ((256, 16, 4), (128, 32, 4), (64, 64, 4), (32, 128, 4), (16, 256, 4))  # items, words, warps


def tiles(entry: int):
    """The default, then each candidate whose words per step do not far exceed the entry."""
    yield None
    yield from (tile for tile in CANDIDATES if tile[1] * 8 <= 4 * entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="256,1024,4096")
    parser.add_argument("--blocks-per-job", type=int, default=0, help="default: a 4 MiB job")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--canonical", action="store_true", help="canonical layouts, one head per rank")
    parser.add_argument("--heads", default="128,256,1024", help="--canonical: head bytes")
    args = parser.parse_args()
    chosen = kernels.expand_tile
    sizes = args.heads if args.canonical else args.pages
    try:
        for entry in map(int, sizes.split(",")):
            for tile in tiles(entry):
                kernels.expand_tile = chosen if tile is None else (lambda largest, tile=tile: tile)
                kernels._compiled.clear()
                label = f"default {chosen(entry)}" if tile is None else str(tile)
                if args.canonical:
                    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
                        row = canonical_bench.measure("cuda", entry, True, directory, "expand_direct")
                    print(
                        f"canonical, head {entry:>5} B, tile {label:>18}: store {row['store_gbps']:.1f} "
                        f"load {row['load_gbps']:.1f} GB/s; verified {row['verified']}",
                        flush=True,
                    )
                    continue
                per_job = args.blocks_per_job or max(1, (4 << 20) // (64 * entry))
                row = run_shape(CudaBackend(mechanism="expand_direct"), entry, per_job, 64, args.jobs)
                print(
                    f"page {entry:>5} B x {per_job:>3} blocks, tile {label:>18}: store {row['store_ratio']:.2f} "
                    f"load {row['load_ratio']:.2f} of the link; verified {row['verified']}",
                    flush=True,
                )
    finally:
        kernels.expand_tile = chosen


if __name__ == "__main__":
    main()
