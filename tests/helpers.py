"""Small KV caches on the host for worker tests."""

from __future__ import annotations

import torch

from offload_core import KVCacheRef, KVCaches, KVCacheTensor


def small_kv(pages=(64, 128), copy=None, blocks=16, groups=None, seed=0, device="cpu") -> KVCaches:
    """Random int8 tensors with `blocks` pages each; one group over all tensors unless `groups` is given."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        KVCacheTensor(torch.randint(-128, 128, (blocks, p), dtype=torch.int8, generator=gen).to(device), p)
        for p in pages
    ]
    copy = copy or pages
    if groups is None:
        groups = [list(range(len(pages)))]
    return KVCaches(tensors, [[KVCacheRef(t, copy[t]) for t in g] for g in groups])


def snapshot(kv: KVCaches) -> list[torch.Tensor]:
    """Host copies of the KV tensors."""
    return [t.tensor.cpu().clone() for t in kv.tensors]
