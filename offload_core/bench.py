"""`offload-core bench`: store blocks of a synthetic KV cache to host, load them back elsewhere, verify every byte.

Speeds are reported next to the limit measured in the same run: one large copy of the
same number of bytes, in each direction, through the same backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from offload_core.backend import Backend, Direction
from offload_core.layout import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor
from offload_core.registry import get_backend
from offload_core.worker import OffloadWorker


@dataclass(frozen=True)
class Preset:
    """A model's KV cache shape. ``cross_layer`` puts every layer of a block in one tensor."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype_bytes: int
    cross_layer: bool = False

    @property
    def page_bytes(self) -> int:
        """Bytes of one K (or V) page of one layer."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes


PRESETS = {
    # Llama-3-8B-like: 32 layers, K and V separate tensors, 16-token blocks, bf16 -> 64 tensors of 32 KiB pages
    "llama-8b": Preset(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype_bytes=2),
    # the same model with vLLM's cross-layer layout: one tensor, 2 MiB per block
    "llama-8b-cross-layer": Preset(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype_bytes=2, cross_layer=True),
}


def build_kv_caches(preset: Preset, num_blocks: int, backend: Backend, seed: int = 0) -> KVCaches:
    """Random KV tensors shaped like `preset` on the backend's device."""
    import torch

    gen = torch.Generator(device=backend.device).manual_seed(seed)  # random bytes made where they live
    if preset.cross_layer:
        shapes = [(num_blocks, 2 * preset.layers * preset.page_bytes)]
    else:
        shapes = [(num_blocks, preset.page_bytes)] * (2 * preset.layers)
    tensors = []
    for shape in shapes:
        data = torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen, device=backend.device)
        tensors.append(KVCacheTensor(data, shape[1]))
    return KVCaches(tensors, [[KVCacheRef(i, t.page_size_bytes) for i, t in enumerate(tensors)]])


def _limit_gbps(backend: Backend, nbytes: int, host, device) -> dict[str, float]:
    """One copy of `nbytes` each way: the most this backend can do for a job of that size."""
    out = {}
    host.fill_(1)  # fault every page in first: untouched memory would read as the shared zero page
    device.fill_(1)
    one = np.ones(1, dtype=np.int64)
    stream = backend.new_stream()
    for direction, src, dst in ((Direction.STORE, device, host), (Direction.LOAD, host, device)):
        best = float("inf")
        for _ in range(5):
            stream.wait_stream(backend.current_stream())
            start, end = backend.new_event(), backend.new_event()
            t0 = time.perf_counter()
            start.record(stream)
            backend.copy_batch(one * src.data_ptr(), one * dst.data_ptr(), one * nbytes, direction, stream)
            end.record(stream)
            end.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[direction.value] = nbytes / best / 1e9
    return out


def run(
    backend: str | Backend | None = None,
    *,
    preset: str = "llama-8b",
    blocks: int = 64,
    blocks_per_job: int = 16,
    blocks_per_chunk: int = 1,
    iters: int = 5,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda it: it,
) -> dict:
    """Run the benchmark and return its figures.

    Raises:
        ValueError: sizes that do not divide into whole jobs and chunks.
        UnknownBackendError, BackendUnavailableError: the backend cannot be had.
    """
    import torch

    if blocks % blocks_per_job or blocks_per_job % blocks_per_chunk:
        raise ValueError("blocks must be a multiple of blocks_per_job, and that of blocks_per_chunk")
    be = backend if isinstance(backend, Backend) else get_backend(backend)
    spec = PRESETS[preset]
    kv = build_kv_caches(spec, 2 * blocks, be)  # stores read blocks [0, blocks); loads write [blocks, 2*blocks)
    host_blocks = blocks // blocks_per_chunk
    jobs = [  # job j: device blocks [j, j + per_job) into the host chunks that hold them
        (DeviceBlocks(np.arange(j, j + blocks_per_job)), HostBlocks(np.arange(j, j + blocks_per_job, blocks_per_chunk) // blocks_per_chunk))
        for j in range(0, blocks, blocks_per_job)
    ]
    shifted = [DeviceBlocks(d.block_ids + blocks) for d, _ in jobs]
    job_bytes = blocks_per_job * sum(t.page_size_bytes for t in kv.tensors)

    walls = {d.value: [] for d in Direction}
    device_secs = {d.value: [] for d in Direction}
    submit_us: list[float] = []
    job_id = 0
    with OffloadWorker(kv, host_blocks, blocks_per_chunk=blocks_per_chunk, backend=be) as worker:
        for _ in progress(range(iters)):
            for direction in Direction:
                ids = []
                t0 = time.perf_counter()
                for (dev, host), dst in zip(jobs, shifted):
                    job_id += 1
                    s0 = time.perf_counter()
                    if direction is Direction.STORE:
                        ok = worker.submit_store(job_id, dev, host)
                    else:
                        ok = worker.submit_load(job_id, host, dst)
                    submit_us.append((time.perf_counter() - s0) * 1e6)
                    if not ok:
                        raise RuntimeError(f"{direction.value} job {job_id} failed to enqueue")
                    ids.append(job_id)
                worker.wait(ids)
                walls[direction.value].append(time.perf_counter() - t0)
                results = worker.get_finished()
                if not all(r.success for r in results):
                    raise RuntimeError(f"{direction.value} jobs failed on the device")
                device_secs[direction.value].append(sum(r.transfer_time for r in results))
        stats = worker.stats()
        verified = _verify(kv, worker, blocks, blocks_per_chunk)
        total = job_bytes * len(jobs)
        limit_dev = torch.empty(total, dtype=torch.uint8, device=be.device)
        limit = _limit_gbps(be, total, be.alloc_host(total), limit_dev)

    out = {
        "backend": be.name,
        "device": str(be.device),
        "preset": preset,
        "verified": verified,
        "blocks": blocks,
        "blocks_per_job": blocks_per_job,
        "blocks_per_chunk": blocks_per_chunk,
        "iters": iters,
        "bytes_per_job": job_bytes,
        "plan_submit_us_per_job": float(np.median(submit_us)),
    }
    for d in ("store", "load"):
        best_wall = min(walls[d])
        out[f"{d}_gbps"] = total / best_wall / 1e9
        out[f"{d}_device_gbps"] = total / max(min(device_secs[d]), 1e-12) / 1e9
        out[f"{d}_limit_gbps"] = limit[d]
        out[f"{d}_ratio"] = out[f"{d}_gbps"] / limit[d]
        out[f"{d}_descriptors_per_job"] = stats[d].descriptors / stats[d].jobs
        out[f"{d}_mean_copy_bytes"] = stats[d].bytes / stats[d].descriptors
    return out


def _verify(kv: KVCaches, worker: OffloadWorker, blocks: int, bpc: int) -> bool:
    """Host copies equal the source pages, and loaded pages equal the source pages, for every byte."""
    import torch

    for t, host in zip(kv.tensors, worker.host_tensors):
        src = t.tensor.view(torch.int8).view(2 * blocks, -1)
        page = src.shape[1]
        if not torch.equal(src[blocks:], src[:blocks]):
            return False
        if not torch.equal(host.reshape(blocks // bpc, bpc, page).reshape(blocks, page).to(src.device), src[:blocks]):
            return False
    return True
