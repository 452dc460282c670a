"""Planning alone, warm, for several versions of offload_core/plan.py taken from git history.

Each version is loaded from `git show COMMIT:offload_core/plan.py` into the same process and
plans the same Llama-8B-shaped store jobs (64 refs, 32 KiB pages, random ids) into the same
buffer, so the columns differ only by the planner's code.

    python benchmarks/investigations/plan_history.py COMMIT [COMMIT ...]
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time

import numpy as np

from offload_core import DeviceBlocks, Direction, Geometry, HostBlocks
from offload_core.plan import PlanRef  # a 3-tuple: older planners, which unpack tuples, take it too

PAGE, REFS, BLOCKS = 32 * 1024, 64, 1024


def load(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:offload_core/plan.py"], check=True, capture_output=True).stdout
    with tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"plan_{commit}", f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    commits = sys.argv[1:]
    modules = [load(c) for c in commits]
    rng = np.random.default_rng(0)
    device_mem = np.zeros(1, dtype=np.int64)  # addresses are never dereferenced: planning only
    print("| blocks/chunk | blocks/job | " + " | ".join(f"{c} µs" for c in commits) + " |")
    print("|---|---|" + "---|" * len(commits))
    for bpc in (1, 4):
        geometry = Geometry(
            device_base=[(t + 1) << 32 for t in range(REFS)],
            device_page=[PAGE] * REFS,
            device_blocks=[BLOCKS] * REFS,
            host_base=device_mem.ctypes.data,
            host_row_bytes=REFS * PAGE * bpc,
            host_offset=[t * PAGE * bpc for t in range(REFS)],
            host_page=[PAGE] * REFS,
            host_blocks=BLOCKS // bpc,
            group_refs=[[PlanRef(t, PAGE) for t in range(REFS)]],
            blocks_per_chunk=bpc,
        )
        for blocks in (16, 1024):
            device = DeviceBlocks(rng.permutation(BLOCKS)[:blocks])
            host = HostBlocks(rng.permutation(BLOCKS // bpc)[: blocks // bpc])
            out = np.empty((3, blocks * REFS), dtype=np.int64)
            cells = []
            for module in modules:
                planner = module.Planner(geometry)
                n = 20000 if blocks == 16 else 500
                for _ in range(n // 10):
                    planner.plan(Direction.STORE, device, host, out=out)
                t0 = time.perf_counter()
                for _ in range(n):
                    planner.plan(Direction.STORE, device, host, out=out)
                cells.append(f"{(time.perf_counter() - t0) / n * 1e6:.1f}")
            print(f"| {bpc} | {blocks} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
