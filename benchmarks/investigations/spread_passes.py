"""The compiled passes over a million-id job, one thread against several (`OFFLOAD_CORE_NATIVE_THREADS`,
offload_core/_spread.c): a submit's checks (`single_check`), a spec's private copy of int64 and
int32 ids (`frozen`, `frozen_widened`), median milliseconds of 30 calls, the threads' settings
alternating.

    python benchmarks/investigations/spread_passes.py [--ids 1048576] [--threads 1,2,4,8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from offload_core import native


def median_ms(fn, calls: int = 30) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=1 << 20)
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    compiled = native.load()
    if compiled is None:
        raise SystemExit("offload_core._native is not built here")
    n = args.ids
    rng = np.random.default_rng(0)
    dev, host = rng.permutation(n).astype(np.int64), rng.permutation(n).astype(np.int64)
    narrow = dev.astype(np.int32)
    alive: list = []  # three copies alive, as a queue's jobs in flight keep theirs: the pool is used as in a run

    def copy(fn, ids):
        alive.append(fn(ids))
        if len(alive) > 3:
            alive.pop(0)

    print(f"{n} ids, median ms of 30 calls")
    for _ in range(args.rounds):
        for k in map(int, args.threads.split(",")):
            compiled.spread_threads(k)
            checks = median_ms(lambda: compiled.single_check(dev, host, n, n, False))
            frozen = median_ms(lambda: copy(compiled.frozen, dev))
            widened = median_ms(lambda: copy(compiled.frozen_widened, narrow))
            print(f"  {k} threads: checks {checks:.3f}, frozen {frozen:.3f}, frozen_widened {widened:.3f}")
    compiled.spread_threads(0)


if __name__ == "__main__":
    main()
