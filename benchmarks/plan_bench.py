"""Plan + submit time per job on the cpu backend: offload-core's planner against the seed's way of planning.

The seed (vLLM's CPU offloading worker) fills descriptors per group and per ref, with two
vectorised pointer computations per ref. offload-core does a fixed number of numpy
operations per group, for all refs at once, then merges contiguous runs. Both submit
through the same queue and backend. Jobs are submitted in bursts while the compute
stream is held busy (as during a model's forward pass), so no copy runs, competes for
the interpreter or evicts caches while a submission is timed; the first burst only warms
the descriptor-buffer pools. The median over the rest of each burst is the steady
state; the first job of each burst, right after a burst of copies flushed the caches, is
reported apart as "cold". The two plans are checked to be the same descriptors.

    python benchmarks/plan_bench.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

import numpy as np
import torch

from offload_core import (
    DeviceBlocks,
    Direction,
    HostBlocks,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadWorker,
    get_backend,
)
from offload_core.plan import CopyBatch
from offload_core.testing.reference import merge_contiguous

LAYERS, PAGE = 32, 32 * 1024  # 64 refs: K and V of 32 layers, 32 KiB pages


def sub_block_pointers(ids, bpc, tensor, skip, out):
    """The seed's pointer computation, written anew: address of every sub-page of `ids`, from `skip` on."""
    base, stride, sub = tensor.data_ptr(), tensor.stride(0), tensor.shape[1] // bpc
    ptrs = (base + ids[:, None] * stride + np.arange(bpc)[None, :] * sub).ravel()
    out[:] = ptrs[skip : skip + len(out)]


def seed_way_plan(direction, device, host, dev_tensors, host_tensors, group_refs, bpc, buf):
    store = direction is Direction.STORE
    src_t, dst_t = (dev_tensors, host_tensors) if store else (host_tensors, dev_tensors)
    src_ids_all, dst_ids_all = (device.block_ids, host.block_ids) if store else (host.block_ids, device.block_ids)
    src_bpc, dst_bpc = (1, bpc) if store else (bpc, 1)
    pos = src_off = dst_off = nbytes = 0
    for refs, n, index in zip(group_refs, device.group_sizes.tolist(), device.block_indices.tolist()):
        if n == 0:
            continue
        src_skip, dst_skip = index % src_bpc, index % dst_bpc
        src_count = -(-(n + src_skip) // src_bpc)
        dst_count = -(-(n + dst_skip) // dst_bpc)
        src_ids = src_ids_all[src_off : src_off + src_count]
        dst_ids = dst_ids_all[dst_off : dst_off + dst_count]
        for ref in refs:
            sub_block_pointers(src_ids, src_bpc, src_t[ref.tensor_idx], src_skip, buf[0, pos : pos + n])
            sub_block_pointers(dst_ids, dst_bpc, dst_t[ref.tensor_idx], dst_skip, buf[1, pos : pos + n])
            buf[2, pos : pos + n] = ref.page_size_bytes
            nbytes += n * ref.page_size_bytes
            pos += n
        src_off += src_count
        dst_off += dst_count
    return CopyBatch(buf[0, :pos], buf[1, :pos], buf[2, :pos], nbytes)


def measure(blocks_per_job: int, bpc: int, bursts: int, jobs_per_burst: int) -> dict:
    rng = np.random.default_rng(0)
    num_blocks = max(1024, blocks_per_job)
    tensors = [KVCacheTensor(torch.zeros(num_blocks, PAGE, dtype=torch.int8), PAGE) for _ in range(2 * LAYERS)]
    kv = KVCaches(tensors, [[KVCacheRef(i, PAGE) for i in range(2 * LAYERS)]])
    host_blocks = num_blocks // bpc
    backend = get_backend("cpu")
    specs = [
        (
            DeviceBlocks(rng.permutation(num_blocks)[:blocks_per_job]),
            HostBlocks(rng.permutation(host_blocks)[: blocks_per_job // bpc]),
        )
        for _ in range(jobs_per_burst)
    ]
    with OffloadWorker(kv, host_blocks, blocks_per_chunk=bpc, backend=backend) as worker:
        queue = worker._queues[Direction.STORE]
        dev_views = [t.tensor for t in tensors]

        def ours(job, device, host):
            worker.submit_store(job, device, host)

        def seed_way(job, device, host):
            buf = queue.scratch(blocks_per_job * len(tensors))
            batch = seed_way_plan(
                Direction.STORE, device, host, dev_views, worker.host_tensors, kv.group_refs, bpc, buf
            )
            queue.submit(job, batch, buf)

        times = {ours: [], seed_way: []}
        cold = {ours: [], seed_way: []}  # first job of each burst: caches just flushed by copies
        job = 0
        for burst in range(bursts):
            for method in times:
                # Submit while the compute stream is busy, as an engine does during a forward
                # pass: nothing is copied (or evicts caches) until the burst has been timed.
                gate = threading.Event()
                backend.current_stream().launch(gate.wait)
                for i, (device, host) in enumerate(specs):
                    job += 1
                    t0 = time.perf_counter()
                    method(job, device, host)
                    if burst:  # the first burst warms the descriptor-buffer pools
                        (cold if i == 0 else times)[method].append(time.perf_counter() - t0)
                gate.set()
                queue.wait([job])
                worker.get_finished()
        device, host = specs[0]
        mine = worker._planner.plan(Direction.STORE, device, host)
        theirs = seed_way_plan(
            Direction.STORE,
            device,
            host,
            dev_views,
            worker.host_tensors,
            kv.group_refs,
            bpc,
            np.empty((3, blocks_per_job * len(tensors)), dtype=np.int64),
        )
        merged = merge_contiguous(theirs.src, theirs.dst, theirs.sizes)
        # the same descriptors, in another order (ours follow the host rows)
        a, b = (np.stack(x)[:, np.argsort(x[1])] for x in (merged, mine[:3]))
        assert np.array_equal(a, b), "the two plans differ"
    ours_us, seed_us = (float(np.median(times[m])) * 1e6 for m in (ours, seed_way))
    ours_cold, seed_cold = (float(np.median(cold[m])) * 1e6 for m in (ours, seed_way))
    return {
        "refs": len(tensors),
        "blocks_per_job": blocks_per_job,
        "blocks_per_chunk": bpc,
        "descriptors_before_merge": blocks_per_job * len(tensors),
        "descriptors": len(mine),
        "jobs_timed": len(times[ours]),
        "offload_core_us": round(ours_us, 1),
        "seed_way_us": round(seed_us, 1),
        "speedup": round(seed_us / ours_us, 2),
        "offload_core_cold_us": round(ours_cold, 1),
        "seed_way_cold_us": round(seed_cold, 1),
        "cold_speedup": round(seed_cold / ours_cold, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    for blocks in (16, 1024):
        for bpc in (1, 4):
            rows.append(measure(blocks, bpc, *((11, 20) if blocks == 16 else (3, 9))))
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"numpy {np.__version__}, torch {torch.__version__}"
    )
    print(
        "| refs | blocks/job | blocks/chunk | descriptors (merged) | offload-core us | seed-way us | speedup "
        "| cold: offload-core us | cold: seed-way us | cold speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['refs']} | {r['blocks_per_job']} | {r['blocks_per_chunk']} | {r['descriptors_before_merge']} "
            f"({r['descriptors']}) | {r['offload_core_us']} | {r['seed_way_us']} | {r['speedup']}x "
            f"| {r['offload_core_cold_us']} | {r['seed_way_cold_us']} | {r['cold_speedup']}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
