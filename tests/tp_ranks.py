"""Tensor-parallel ranks of a small model for canonical-layout tests (importable by spawned processes)."""

from __future__ import annotations

import numpy as np
import torch

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker, SharedHostRegion
from offload_core.canonical import attention_mappings, replicated_mappings

BLOCKS, TOKENS, HEAD_BYTES = 12, 4, 16


def full_model(heads: int, layers: int = 2, seed: int = 0) -> list[np.ndarray]:
    """The unsharded KV: per layer, K and V as (blocks, tokens, heads, head_bytes) bytes (NHD)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (BLOCKS, TOKENS, heads, HEAD_BYTES), dtype=np.uint8) for _ in range(2 * layers)]


def rank_kv(full: list[np.ndarray], tp: int, rank: int, *, empty: bool = False, device="cpu") -> KVCaches:
    """Rank `rank`'s shard of `full` at TP=`tp`, with its canonical mappings."""
    heads = full[0].shape[2]
    maps = attention_mappings(total_kv_heads=heads, tp_size=tp, block_tokens=TOKENS, head_bytes=HEAD_BYTES)
    local_heads = max(1, heads // tp)
    shard = rank // (tp // min(tp, heads))
    tensors = []
    for t in full:
        local = np.ascontiguousarray(t[:, :, shard * local_heads : (shard + 1) * local_heads])
        data = (torch.zeros(local.shape, dtype=torch.uint8) if empty else torch.from_numpy(local)).to(device)
        tensors.append(KVCacheTensor(data, local[0].nbytes))
    refs = [KVCacheRef(i, tensors[i].page_size_bytes, mapping=maps[rank]) for i in range(len(tensors))]
    return KVCaches(tensors, [refs])


def latent_kv(full: np.ndarray, tp: int, rank: int, *, empty: bool = False, device="cpu") -> KVCaches:
    """An MLA-like latent every rank holds whole: one tensor, replicated mappings."""
    page = full[0].nbytes
    data = (torch.zeros(full.shape, dtype=torch.uint8) if empty else torch.from_numpy(full.copy())).to(device)
    maps = replicated_mappings(page_size_bytes=page, tp_size=tp)
    return KVCaches([KVCacheTensor(data, page)], [[KVCacheRef(0, page, mapping=maps[rank])]])


def row_bytes(full: list[np.ndarray], bpc: int) -> int:
    return sum(t[0].nbytes for t in full) * bpc


def region(name: str, full, bpc: int, num_host: int, directory: str, rank: int = 0) -> SharedHostRegion:
    return SharedHostRegion(
        name, num_blocks=num_host, canonical_bytes=row_bytes(full, bpc), rank=rank, directory=directory
    )


def spawned_rank(name, directory, tp, rank, barrier, store, load, bpc, num_host, heads, result):
    """One rank in its own process: join the region, store its shard, wait for all, load it back."""
    full = full_model(heads)
    with region(name, full, bpc, num_host, directory, rank) as reg:
        kv = rank_kv(full, tp, rank)
        fresh = rank_kv(full, tp, rank, empty=True)
        with OffloadWorker(
            kv, num_host, blocks_per_chunk=bpc, backend="cpu", canonical_layout=True, host_region=reg
        ) as w:
            w.submit_store(1, DeviceBlocks(store[0]), HostBlocks(store[1]))
            w.wait([1])
            ok = all(r.success for r in w.get_finished())
        barrier.wait(timeout=60)
        with OffloadWorker(
            fresh, num_host, blocks_per_chunk=bpc, backend="cpu", canonical_layout=True, host_region=reg
        ) as w:
            w.submit_load(2, HostBlocks(load[1]), DeviceBlocks(load[0]))
            w.wait([2])
            ok = ok and all(r.success for r in w.get_finished())
        for t, f in zip(fresh.tensors, kv.tensors):
            ok = ok and torch.equal(t.tensor[list(load[0])], f.tensor[list(store[0])])
        barrier.wait(timeout=60)  # both still hold the region here; the last to close removes the file
    result.put((rank, bool(ok)))


def check_tp2_stores_tp1_loads(make, convert, gpu_spec, cpu_spec, device="cpu") -> None:
    """Two TP=2 ranks store blocks 1 and 4 of `full_model(2)` into host chunks 6 and 2 of one
    canonical region; a TP=1 worker on the same region loads them into blocks 9 and 3, and gets
    the whole pages. For adapters: `convert` turns a rank's `KVCaches` into the adapter's input,
    `make(kv, tp, rank)` builds its worker (with `region`, `submit_*`, `wait`, `get_finished`,
    `shutdown`), `gpu_spec(ids, sizes, indices)` and `cpu_spec(ids)` its specs."""
    full = full_model(heads=2)
    writers = [make(convert(rank_kv(full, 2, r, device=device)), 2, r) for r in range(2)]
    for w in writers:
        assert w.submit_store(1, gpu_spec([1, 4], [2], [0]), cpu_spec([6, 2]))
        w.wait({1})
    whole = convert(rank_kv(full, 1, 0, empty=True, device=device))
    reader = make(whole, 1, 0)
    assert reader.region.path == writers[0].region.path
    assert reader.submit_load(2, cpu_spec([6, 2]), gpu_spec([9, 3], [2], [0]))
    reader.wait({2})
    assert all(r.success for w in (*writers, reader) for r in w.get_finished())
    for t, f in zip(whole.tensors, full):
        assert np.array_equal(t.tensor.cpu().numpy()[[9, 3]], f[[1, 4]].reshape(2, -1).view(np.int8))
    for w in (*writers, reader):
        w.shutdown()
