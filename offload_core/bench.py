"""`offload-core bench`: store blocks of a synthetic KV cache to host, load them back elsewhere, verify
every byte, and report speeds next to the limit measured in the same run (the best of several single
copies of the same bytes, each way, through the same backend).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from offload_core import hostmem
from offload_core.backend import Backend, Direction, enqueue_lock
from offload_core.errors import InvalidSpecError, OffloadError, positive_int
from offload_core.registry import get_backend
from offload_core.spec import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor
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

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V pages of every layer, whichever the layout."""
        return 2 * self.layers * self.page_bytes


PRESETS = {
    # Llama-3-8B-like: 32 layers, K and V separate tensors, 16-token blocks, bf16 -> 64 tensors of 32 KiB pages
    "llama-8b": Preset(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype_bytes=2),
    # the same model with vLLM's cross-layer layout: one tensor, 2 MiB per block
    "llama-8b-cross-layer": Preset(
        layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype_bytes=2, cross_layer=True
    ),
}

# Single copies the limit is the best of, after a warm-up copy: with five and no warm-up, slow
# moments (cold caches, a busy core) could hold the limit below what the jobs reached, over 100%.
LIMIT_COPIES = 10


def _preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise InvalidSpecError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


def memory_needed(preset: str, blocks: int, backend: str | Backend | None = None) -> dict[str, int]:
    """Peak memory `run` allocates for `blocks` blocks of `preset` on `backend`: at the limit copies,
    the KV tensors of ``2 * blocks`` blocks on the device, the worker's host copy of `blocks` blocks,
    and the limit copies' host and device buffers of `blocks` blocks each (the backend's own small
    buffers are not counted).

    Returns:
        ``{"host_bytes": ..., "device_bytes": ...}``. A backend whose device is the cpu (the cpu
        backend, simulated runtimes) counts its device bytes as host bytes, and 0 device bytes.

    Raises:
        InvalidSpecError: an unknown preset, or `blocks` not a positive integer.
        UnknownBackendError, BackendUnavailableError: the backend cannot be had.
    """
    per_block = _preset(preset).block_bytes
    blocks = positive_int(blocks, "blocks")
    be = backend if isinstance(backend, Backend) else get_backend(backend)
    host, device = 2 * blocks * per_block, 3 * blocks * per_block
    if be.device.type == "cpu":
        return {"host_bytes": host + device, "device_bytes": 0}
    return {"host_bytes": host, "device_bytes": device}


def _check_memory(be: Backend, preset: str, blocks: int, blocks_per_job: int) -> dict[str, int]:
    """Refuse a run that would not fit before anything is allocated (rather than meet the OOM killer)."""
    need = memory_needed(preset, blocks, be)
    try:
        hostmem.check_host_bytes(need["host_bytes"], f"bench with {blocks} blocks of {preset}")
    except OffloadError as exc:
        available = hostmem.available_host_bytes() or 0
        raise OffloadError(f"{exc}: {_fewer_blocks(available, need['host_bytes'] // blocks, blocks_per_job)}") from None
    import torch

    # torch.cuda, torch.npu (torch_npu) and torch.xpu each say what is free; the cpu says nothing
    mem_get_info = getattr(getattr(torch, be.device.type, None), "mem_get_info", None)
    if be.device.type != "cpu" and mem_get_info is not None:
        try:
            free, _ = mem_get_info(be.device)
        except (RuntimeError, AssertionError):  # a device that cannot say (torch without it) is no reason to refuse
            return need
        if need["device_bytes"] > free:
            raise OffloadError(
                f"bench with {blocks} blocks of {preset} needs {need['device_bytes'] / 2**30:.2f} GiB of memory "
                f"on {be.device}, but only {free / 2**30:.2f} GiB is free; ask for less: "
                + _fewer_blocks(free, need["device_bytes"] // blocks, blocks_per_job)
            )
    return need


def _fewer_blocks(available: int, per_block: int, blocks_per_job: int) -> str:
    fit = available // per_block // blocks_per_job * blocks_per_job  # whole jobs only
    if fit:
        return f"--blocks {fit} or fewer would fit"
    return f"not even one job (--blocks {blocks_per_job}) would fit"


def build_kv_caches(preset: Preset, num_blocks: int, backend: Backend) -> KVCaches:
    """Random KV tensors shaped like `preset` on the backend's device."""
    import torch

    gen = torch.Generator(device=backend.device).manual_seed(0)  # random bytes made where they live
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
    """GB/s each way: the best of `LIMIT_COPIES` single copies of `nbytes`, after a warm-up copy."""
    out = {}
    host.fill_(1)  # fault every page in first: untouched memory would read as the shared zero page
    device.fill_(1)
    one = np.ones(1, dtype=np.int64)
    stream = backend.new_stream()
    for direction, src, dst in ((Direction.STORE, device, host), (Direction.LOAD, host, device)):
        best = float("inf")
        for i in range(1 + LIMIT_COPIES):
            stream.wait_stream(backend.current_stream())
            start, end = backend.new_event(), backend.new_event()
            t0 = time.perf_counter()
            start.record(stream)
            with enqueue_lock(backend):  # the contract's promise: never beside a worker's enqueue
                backend.copy_batch(one * src.data_ptr(), one * dst.data_ptr(), one * nbytes, direction, stream)
            end.record(stream)
            end.synchronize()
            if i:  # the first copy warms caches, TLBs and the stream's thread
                best = min(best, time.perf_counter() - t0)
        out[direction.value] = nbytes / best / 1e9
    return out


def check_whole(sizes: dict[str, int], sep: str = "=") -> None:
    """Blocks, blocks per job and blocks per chunk, keyed by the names the message gives them:
    each a multiple of the next (whole jobs of whole host blocks), else `InvalidSpecError`."""
    pairs = list(sizes.items())
    for ((whole, w), (part, p)), unit in zip(zip(pairs, pairs[1:]), ("whole jobs", "whole host blocks")):
        if w % p:
            raise InvalidSpecError(
                f"{whole} must be a multiple of {part} ({unit}), got {whole}{sep}{w}, {part}{sep}{p}"
            )


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
    """Run the benchmark and return its figures (see `memory_needed` for the memory it takes).

    Raises:
        InvalidSpecError: an unknown preset; `blocks`, `blocks_per_job`, `blocks_per_chunk` or
            `iters` not a positive integer; `blocks` not a multiple of `blocks_per_job`, or
            `blocks_per_job` not a multiple of `blocks_per_chunk`.
        OffloadError: more host memory (or, on CUDA, device memory) than is available would be
            needed; nothing has been allocated.
        UnknownBackendError, BackendUnavailableError: the backend cannot be had.
    """
    import torch

    spec = _preset(preset)
    blocks = positive_int(blocks, "blocks")
    blocks_per_job = positive_int(blocks_per_job, "blocks_per_job")
    blocks_per_chunk = positive_int(blocks_per_chunk, "blocks_per_chunk")
    iters = positive_int(iters, "iters")
    check_whole({"blocks": blocks, "blocks_per_job": blocks_per_job, "blocks_per_chunk": blocks_per_chunk})
    be = backend if isinstance(backend, Backend) else get_backend(backend)
    need = _check_memory(be, preset, blocks, blocks_per_job)
    kv = build_kv_caches(spec, 2 * blocks, be)  # stores read blocks [0, blocks); loads write [blocks, 2*blocks)
    jobs = [  # job j: device blocks [j, j + per_job), the host chunks that hold them, the blocks they load into
        (
            DeviceBlocks(np.arange(j, j + blocks_per_job)),
            HostBlocks(np.arange(j, j + blocks_per_job, blocks_per_chunk) // blocks_per_chunk),
            DeviceBlocks(np.arange(j, j + blocks_per_job) + blocks),
        )
        for j in range(0, blocks, blocks_per_job)
    ]
    job_bytes = blocks_per_job * sum(t.page_size_bytes for t in kv.tensors)

    walls = {d.value: [] for d in Direction}
    device_secs = {d.value: [] for d in Direction}
    submit_us: list[float] = []
    job_id = 0
    with OffloadWorker(kv, blocks // blocks_per_chunk, blocks_per_chunk=blocks_per_chunk, backend=be) as worker:
        for _ in progress(range(iters)):
            for direction in Direction:
                ids = []
                t0 = time.perf_counter()
                for dev, host, dst in jobs:
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
        limit = _limit_gbps(be, total, be.alloc_host(total), torch.empty(total, dtype=torch.uint8, device=be.device))

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
        "host_memory_bytes": need["host_bytes"],
        "device_memory_bytes": need["device_bytes"],
        "limit_copies": LIMIT_COPIES,
    }
    for d in ("store", "load"):
        out[f"{d}_gbps"] = total / min(walls[d]) / 1e9
        out[f"{d}_device_gbps"] = total / max(min(device_secs[d]), 1e-12) / 1e9
        out[f"{d}_limit_gbps"] = limit[d]
        out[f"{d}_ratio"] = out[f"{d}_gbps"] / limit[d]
        out[f"{d}_descriptors_per_job"] = stats[d].descriptors / stats[d].jobs
        out[f"{d}_mean_copy_bytes"] = stats[d].bytes / stats[d].descriptors
    return out


def _verify(kv: KVCaches, worker: OffloadWorker, blocks: int, bpc: int) -> bool:
    """Whether host copies and loaded pages equal the source pages, every byte."""
    import torch

    for t, host in zip(kv.tensors, worker.host_tensors):
        src = t.tensor.view(torch.int8).view(2 * blocks, -1)
        page = src.shape[1]
        if not torch.equal(src[blocks:], src[:blocks]):
            return False
        if not torch.equal(host.reshape(blocks // bpc, bpc, page).reshape(blocks, page).to(src.device), src[:blocks]):
            return False
    return True
