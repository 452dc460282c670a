"""offload-core inside vLLM (0.33.0): the spec through vLLM's factory, the worker against the
behaviour vLLM's own GPU worker tests check, and vLLM's connector worker driven end to end.

Skipped, visibly, where vLLM is not importable; with OFFLOAD_CORE_REQUIRE_VLLM=1 (CI) a
missing vLLM fails instead. On a GPU the same tests run on its backend (``device`` fixture)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if os.environ.get("OFFLOAD_CORE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (fails loudly: CI requires the vLLM tests)
vllm_offload = pytest.importorskip(
    "vllm.v1.kv_offload.base",
    reason="vLLM is not installed (pip install offload-core[vllm-test] and vllm==0.33.0 --no-deps)",
)

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from offload_core.errors import InvalidSpecError  # noqa: E402
from offload_core.integrations.vllm import OffloadCoreOffloadingSpec, OffloadCoreWorker  # noqa: E402

SPEC = {"spec_name": "OffloadCoreOffloadingSpec", "spec_module_path": "offload_core.integrations.vllm"}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


def offloading_config(
    *,
    blocks_per_chunk=1,
    cpu_bytes=1 << 20,
    kv_bytes_per_block=4096,
    world_size=1,
    rank=0,
    replicated=False,
    canonical=False,
    extra=None,
) -> OffloadingConfig:
    """As vLLM's tests build one (tests/v1/kv_offload/conftest.py::make_offloading_config)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={**SPEC, "cpu_bytes_to_use": cpu_bytes, **(extra or {})},
        engine_id="test-engine",
        model=OffloadingModelConfig(name="test-model", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated,
        canonical_layout=canonical,
    )


def test_the_factory_builds_the_spec_from_its_module_path():
    spec = OffloadingSpecFactory.create_spec(offloading_config(blocks_per_chunk=2))
    assert type(spec) is OffloadCoreOffloadingSpec
    assert spec.num_chunks == (1 << 20) // (4096 * 2) and spec.blocks_per_chunk == 2  # vLLM's own sizing
    assert spec.replicated_layout is False


def to_vllm(kv) -> CanonicalKVCaches:
    """offload-core KVCaches (with our canonical mappings) as vLLM's CanonicalKVCaches."""
    from vllm.v1.kv_offload.base import CanonicalPageMapping, CopyRun

    def mapping(m):
        runs = tuple(
            CopyRun(
                r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments, r.local_stride, r.canonical_stride
            )
            for r in m.runs
        )
        return CanonicalPageMapping(
            m.canonical_page_size_bytes, m.local_page_size_bytes, runs, m.num_writers, m.writer_index, True
        )

    tensors = [
        CanonicalKVCacheTensor(t.tensor.reshape(t.num_blocks, -1).view(torch.int8), t.page_size_bytes)
        for t in kv.tensors
    ]
    refs = [
        [CanonicalKVCacheRef(r.tensor_idx, r.page_size_bytes, mapping(r.mapping) if r.mapping else None) for r in g]
        for g in kv.group_refs
    ]
    return CanonicalKVCaches(tensors, refs)


def test_canonical_blocks_stored_at_tp2_load_at_tp1(device):
    """vLLM's canonical layout: the ranks share one region of unsharded pages; each TP=2 rank
    stores its heads, and a TP=1 worker of the same engine loads whole pages back."""
    from tp_ranks import check_tp2_stores_tp1_loads, full_model

    full = full_model(heads=2)
    page, n = full[0][0].nbytes, len(full)
    chunk = -(-n * page // 4096) * 4096
    engine = f"canon-{os.getpid()}-{device.type}"

    def spec(tp, rank):
        cfg = offloading_config(
            world_size=tp, rank=rank, canonical=True, kv_bytes_per_block=n * page // tp, cpu_bytes=8 * chunk
        )
        return OffloadingSpecFactory.create_spec(dataclasses.replace(cfg, engine_id=engine))

    check_tp2_stores_tp1_loads(
        lambda kv, tp, rank: spec(tp, rank).get_worker(kv),
        to_vllm,
        lambda ids, sizes, indices: GPULoadStoreSpec(ids, sizes, indices),
        CPULoadStoreSpec,
        device,
    )


def test_a_backend_key_that_is_no_name_is_refused_naming_the_key():
    tensors, _, _ = kv("cpu", [256], 16)
    cfg = offloading_config(kv_bytes_per_block=256, extra={"offload_core_backend": 5})
    with pytest.raises(InvalidSpecError, match="offload_core_backend in kv_connector_extra_config must be"):
        OffloadingSpecFactory.create_spec(cfg).get_worker(CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256)]]))


def test_a_canonical_layout_needs_vllm_certified_refs():
    from offload_core import InvalidSpecError

    tensors, _, _ = kv("cpu", [256], 16)
    cfg = dataclasses.replace(
        offloading_config(canonical=True, kv_bytes_per_block=256), engine_id=f"uncert-{os.getpid()}"
    )
    with pytest.raises(InvalidSpecError, match="could not certify .* remove canonical_layout"):
        OffloadingSpecFactory.create_spec(cfg).get_worker(CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256)]]))
    # a mapping vLLM gives a layout it cannot place the same at every TP size (its opaque fallback)
    from vllm.v1.kv_offload.base import CanonicalPageMapping, CopyRun

    opaque = CanonicalPageMapping(256, 256, (CopyRun(0, 0, 256, 1, 256, 256),), 1, 0, False)
    with pytest.raises(InvalidSpecError, match="pages differ by TP size.* remove canonical_layout"):
        OffloadingSpecFactory.create_spec(cfg).get_worker(
            CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256, opaque)]])
        )


def test_replicated_ranks_share_one_region_rank_0_stores_all_load(device):
    """vLLM's replicated layout (MLA under tensor parallelism): one host copy for the engine,
    in a region every rank opens; rank 0 stores, another rank loads what it stored."""
    pages, blocks = [512, 256], 16
    engine = f"test-{os.getpid()}-{device.type}"
    specs, workers, tensors = [], [], []
    for rank in range(2):
        cfg = dataclasses.replace(
            offloading_config(world_size=2, rank=rank, replicated=True, kv_bytes_per_block=768, cpu_bytes=8 * 4096),
            engine_id=engine,
        )
        spec = OffloadingSpecFactory.create_spec(cfg)
        assert spec.replicated_layout is True and spec.num_chunks == 8  # sized for one copy
        t, _, _ = kv(device, pages, blocks, seed=0)  # replicas hold the same KV
        if rank == 1:
            for x in t:
                x.tensor.zero_()
        refs = [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 256)]]
        specs.append(spec)
        tensors.append(t)
        workers.append(spec.get_worker(CanonicalKVCaches(t, refs)))
    assert workers[0].region.path == workers[1].region.path
    assert workers[0].submit_store(1, GPULoadStoreSpec([3, 7], [2], [0]), CPULoadStoreSpec([5, 2]))
    workers[0].wait({1})
    assert workers[1].submit_load(2, CPULoadStoreSpec([5, 2]), GPULoadStoreSpec([9, 10], [2], [0]), expedited=True)
    workers[1].wait({2})
    assert [r.success for w in workers for r in w.get_finished()] == [True, True]
    for a, b in zip(tensors[0], tensors[1]):
        assert torch.equal(b.tensor[[9, 10]].cpu(), a.tensor[[3, 7]].cpu())
    path = workers[0].region.path
    for w in workers:
        w.shutdown()
    assert not path.exists()  # the last rank to close removes it


def kv(device, pages, blocks, copy=None, gap=0, seed=0):
    """CanonicalKVCaches of int8 (blocks, page) views, rows `gap` bytes apart beyond their page
    (vLLM hands strided views over); returns it and the backing tensors."""
    gen = torch.Generator().manual_seed(seed)
    backing = [torch.randint(-128, 128, (blocks, p + gap), dtype=torch.int8, generator=gen).to(device) for p in pages]
    tensors = [CanonicalKVCacheTensor(b[:, :p], p) for b, p in zip(backing, pages)]
    copy = copy or pages
    return tensors, backing, copy


def spec_worker(device, tensors, group_refs, chunks, bpc, extra=None):
    per_block = sum(t.page_size_bytes for t in tensors)
    chunk_bytes = -(-per_block * bpc // 4096) * 4096  # vLLM rounds chunks up to the page size
    spec = OffloadingSpecFactory.create_spec(
        offloading_config(
            blocks_per_chunk=bpc, cpu_bytes=chunks * chunk_bytes, kv_bytes_per_block=per_block, extra=extra
        )
    )
    assert spec.num_chunks == chunks
    worker = spec.get_worker(CanonicalKVCaches(tensors, group_refs))
    assert spec.get_worker(CanonicalKVCaches(tensors, group_refs)) is worker  # made once
    return worker


def expected_pages(refs, gpu_ids, group_sizes, block_indices, chunks, bpc):
    """(group, device block, chunk, sub-block) per copied block, as vLLM's worker lays them out."""
    out, d, h = [], 0, 0
    for g, (n, index) in enumerate(zip(group_sizes, block_indices)):
        skip = index % bpc
        for k in range(n):
            q = skip + k
            out.append((g, gpu_ids[d + k], chunks[h + q // bpc], q % bpc))
        d += n
        h += -(-(n + skip) // bpc) if n else 0
    return out


@pytest.mark.parametrize("bpc, gap, expedited", [(1, 0, False), (3, 0, False), (3, 24, True)])
def test_transfer_round_trip(device, bpc, gap, expedited):
    """vLLM's test_transfer: random GPU blocks and CPU chunks, a first chunk entered mid-way,
    padded pages; sources unchanged, each destination page equal to its source, transfer size
    and time, the bytes between strided rows untouched."""
    rng = np.random.default_rng(bpc + gap)
    pages, copy, blocks, chunks = [512, 1024, 768, 512], [512, 1000, 768, 500], 64, 32
    tensors, backing, _ = kv(device, pages, blocks, gap=gap)
    refs = [[CanonicalKVCacheRef(i, c) for i, c in enumerate(copy)]]
    worker = spec_worker(device, tensors, refs, chunks, bpc)
    n = 3 * bpc - (bpc - 1)  # three chunks, the first entered at sub-block bpc - 1
    gpu = rng.permutation(blocks // 2)[:n].tolist()
    cpu = rng.permutation(chunks)[:3].tolist()
    index = bpc - 1
    gaps_before = [b[:, p:].cpu().clone() for b, p in zip(backing, pages)]
    before = [t.tensor.cpu().clone() for t in tensors]
    t0 = time.perf_counter()
    assert worker.submit_store(1, GPULoadStoreSpec(gpu, [n], [index]), CPULoadStoreSpec(cpu))
    worker.wait({1})
    wall = time.perf_counter() - t0
    (result,) = worker.get_finished()
    assert (result.job_id, result.success) == (1, True)
    assert result.transfer_size == n * sum(copy)
    assert 0 < result.transfer_time < wall
    host = [h.cpu() for h in worker.worker.host_tensors]
    for _, block, chunk, sub in expected_pages(refs, gpu, [n], [index], cpu, bpc):
        for t, (c, h, b) in enumerate(zip(copy, host, before)):
            page = pages[t]
            assert torch.equal(h[chunk, sub * page : sub * page + c], b[block, :c])
    dst = (blocks // 2 + rng.permutation(blocks // 2)[:n]).tolist()
    assert worker.submit_load(2, CPULoadStoreSpec(cpu), GPULoadStoreSpec(dst, [n], [index]), expedited=expedited)
    worker.wait({2})
    (result,) = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (2, True, n * sum(copy))
    for t, (c, b) in enumerate(zip(copy, before)):
        got = tensors[t].tensor.cpu()
        assert torch.equal(got[dst, :c], b[gpu, :c])  # each destination page equals its source
        assert torch.equal(got[gpu], b[gpu])  # sources unchanged
        untouched = np.setdiff1d(np.arange(blocks), dst)
        assert torch.equal(got[untouched], b[untouched])
    for b, p, g in zip(backing, pages, gaps_before):
        assert torch.equal(b[:, p:].cpu(), g)  # never a byte between strided rows
    worker.shutdown()


def test_transfer_multi_group_with_an_empty_group(device):
    """vLLM's test_transfer_multi_group: three groups, the middle one moving nothing, the last
    entered mid-chunk; results in submission order."""
    bpc, blocks, chunks = 3, 32, 16
    pages = [256, 256, 512, 512, 128, 128]
    tensors, _, _ = kv(device, pages, blocks, seed=3)
    refs = [
        [CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)],
        [CanonicalKVCacheRef(2, 512), CanonicalKVCacheRef(3, 512)],
        [CanonicalKVCacheRef(4, 128), CanonicalKVCacheRef(5, 100)],
    ]
    worker = spec_worker(device, tensors, refs, chunks, bpc)
    sizes, indices = [6, 0, 4], [0, 0, bpc - 1]
    gpu = [1, 2, 3, 4, 5, 6, 10, 11, 12, 13]
    cpu = [7, 2, 9, 4]  # 2 chunks for group 0, none for group 1, 2 for group 2
    before = [t.tensor.cpu().clone() for t in tensors]
    assert worker.submit_store(5, GPULoadStoreSpec(gpu, sizes, indices), CPULoadStoreSpec(cpu))
    dst = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    worker.wait({5})
    assert worker.submit_load(6, CPULoadStoreSpec(cpu), GPULoadStoreSpec(dst, sizes, indices))
    worker.wait({6})
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(5, True), (6, True)]
    assert results[0].transfer_size == 6 * 512 + 4 * 228
    group_of = {0: 0, 1: 0, 4: 2, 5: 2}
    for t, b in enumerate(before):
        got = tensors[t].tensor.cpu()
        if t in (2, 3):
            assert torch.equal(got, b)  # the empty group's tensors: untouched
            continue
        g = group_of[t]
        src_ids, dst_ids = (gpu[:6], dst[:6]) if g == 0 else (gpu[6:], dst[6:])
        c = refs[g][t % 2].page_size_bytes
        assert torch.equal(got[dst_ids, :c], b[src_ids, :c])
    worker.shutdown()


def test_expedited_loads_do_not_wait_behind_regular_ones():
    tensors, _, _ = kv("cpu", [256], 32, seed=4)
    worker = spec_worker("cpu", tensors, [[CanonicalKVCacheRef(0, 256)]], 8, 1)
    assert worker.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0, 1]))
    worker.wait({1})
    worker.get_finished()
    assert worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([10], [1], [0]))
    assert worker.submit_load(3, CPULoadStoreSpec([1]), GPULoadStoreSpec([11], [1], [0]), expedited=True)
    worker.wait({3})
    stats = worker.worker.stats()
    assert (stats["load"].jobs, stats["expedited_load"].jobs) == (1, 1)
    worker.wait({2})
    assert sorted(r.job_id for r in worker.get_finished()) == [2, 3]
    assert torch.equal(tensors[0].tensor[11], tensors[0].tensor[1])
    worker.shutdown()


def test_a_failed_job_is_reported_as_failed_and_logged(caplog):
    from offload_core.testing.fake import FakeBackend

    backend = FakeBackend()
    tensors, _, _ = kv("cpu", [256], 16, seed=5)
    worker = OffloadCoreWorker(CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256)]]), 8, 1, backend=backend)
    assert worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
    backend.complete(backend.job_ends(backend.streams[0])[-1], RuntimeError("injected device fault"))
    backend.complete_all()
    with caplog.at_level(logging.ERROR):
        (result,) = worker.get_finished()
    assert (result.job_id, result.success) == (1, False)
    assert "store job 1 failed" in caplog.text
    worker.shutdown()


def test_vllm_connector_worker_end_to_end(device):
    """vLLM's OffloadingConnectorWorker over the spec: register_kv_caches (its own strided int8
    views of fp16 layers), deferred stores, a regular and a synchronous load, get_finished and
    build_connector_worker_meta."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata, TransferJob
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    blocks, block_size, heads, head_size = 8, 16, 2, 64
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.float16)
    page = attn.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=blocks * page, layers=[n], layer_stride=0, block_stride=page) for n in layers
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=attn)],
    )
    caches = {
        n: torch.zeros(blocks, 2, block_size, heads, head_size, dtype=torch.float16, device=device) for n in layers
    }
    config = dataclasses_replace_groups(
        offloading_config(cpu_bytes=4 * page * len(layers), kv_bytes_per_block=page * len(layers)),
        OffloadingGroupConfig(block_size, tuple(layers), 0),
    )
    spec = OffloadingSpecFactory.create_spec(config)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
            world_size=1,
            rank=0,
            cp_kv_cache_interleave_size=1,
        ),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads),
    )
    connector = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
    connector.register_kv_caches(caches)
    assert isinstance(connector.worker, OffloadCoreWorker)

    for n in layers:
        caches[n][[3, 5]] = torch.randn(2, 2, block_size, heads, head_size, dtype=torch.float16, device=device)
    stored = {n: caches[n][[3, 5]].clone() for n in layers}
    connector.prepare_store_kv(
        OffloadingConnectorMetadata(
            load_jobs={},
            store_jobs={
                1: TransferJob(
                    "req-A", GPULoadStoreSpec([3, 5], group_sizes=(2,), block_indices=(0,)), CPULoadStoreSpec([0, 1])
                )
            },
        )
    )
    assert connector.worker.worker.stats()["store"].jobs == 0  # deferred to the next step
    connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    connector.worker.wait({1})
    assert connector.get_finished(set()) == (set(), set())
    meta = connector.build_connector_worker_meta()
    assert meta.completed_jobs == {1: 1}
    for n in layers:
        caches[n].zero_()
    connector.start_kv_transfers(
        OffloadingConnectorMetadata(
            store_jobs={},
            load_jobs={
                2: TransferJob(
                    "req-B", CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([6, 7], group_sizes=(2,), block_indices=(0,))
                ),
                3: TransferJob(
                    "req-C",
                    CPULoadStoreSpec([0, 1]),
                    GPULoadStoreSpec([1, 2], group_sizes=(2,), block_indices=(0,)),
                    sync=True,
                ),
            },
        )
    )
    assert connector.worker.worker.stats()["expedited_load"].jobs == 1  # the synchronous load
    connector.worker.wait({2, 3})
    assert connector.get_finished(set()) == (set(), {"req-B"})
    assert connector.build_connector_worker_meta().completed_jobs == {2: 1, 3: 1}
    for n in layers:
        assert torch.equal(caches[n][[6, 7]], stored[n]) and torch.equal(caches[n][[1, 2]], stored[n])
    connector.shutdown()


def dataclasses_replace_groups(config, group):
    return dataclasses.replace(config, groups=(group,))


def test_older_vllm_specs_without_num_chunks_or_groups():
    """vllm-ascend's vLLM: the spec sizes `num_blocks`, GPU specs carry no groups, loads no
    `expedited` argument."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(kv_bytes_per_block=256, cpu_bytes=8 * 4096))
    spec.num_blocks = spec.num_chunks
    del spec.num_chunks
    tensors, _, _ = kv("cpu", [256], 16, seed=9)
    worker = spec.get_worker(CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256)]]))
    assert worker.worker.num_host_blocks == 8
    old_gpu = SimpleNamespace(block_ids=np.array([2, 3], dtype=np.int32))  # no group_sizes, no block_indices
    assert worker.submit_store(1, old_gpu, CPULoadStoreSpec([4, 5]))
    worker.wait({1})
    assert worker.submit_load(2, CPULoadStoreSpec([4, 5]), SimpleNamespace(block_ids=np.array([8, 9], dtype=np.int32)))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True, True]
    assert torch.equal(tensors[0].tensor[[8, 9]], tensors[0].tensor[[2, 3]])
    worker.shutdown()


def test_swapped_specs_are_refused_before_anything_moves():
    """vLLM's own handler asserts which spec is which; a swapped pair must not copy host chunk 5
    over device block 9 (both kinds carry `block_ids`)."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(kv_bytes_per_block=256, cpu_bytes=8 * 4096))
    tensors, _, _ = kv("cpu", [256], 16, seed=3)
    before = tensors[0].tensor.clone()
    worker = spec.get_worker(CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256)]]))
    gpu = GPULoadStoreSpec([9], [1], [0])
    with pytest.raises(InvalidSpecError, match="expected a CPULoadStoreSpec .*, got a GPULoadStoreSpec: .* swapped"):
        worker.submit_load(1, gpu, CPULoadStoreSpec([5]))
    with pytest.raises(InvalidSpecError, match="expected a CPULoadStoreSpec .*, got a GPULoadStoreSpec"):
        worker.submit_store(2, gpu, gpu)
    with pytest.raises(InvalidSpecError, match="expected a GPULoadStoreSpec .*, got a CPULoadStoreSpec"):
        worker.submit_store(3, CPULoadStoreSpec([5]), CPULoadStoreSpec([5]))
    assert worker.get_finished() == []
    assert torch.equal(tensors[0].tensor, before)
    worker.shutdown()


@pytest.mark.parametrize("value", [None, 0, -4096, "8GB", [1], True])
def test_cpu_bytes_to_use_that_sizes_nothing_is_named(value):
    extra = {"cpu_bytes_to_use": value}
    config = offloading_config(extra=extra)
    if value is None:
        del config.extra_config["cpu_bytes_to_use"]
    with pytest.raises(InvalidSpecError, match="cpu_bytes_to_use in kv_connector_extra_config must be a positive"):
        OffloadCoreOffloadingSpec(config)


def test_no_kv_bytes_per_block_is_named_as_such():
    spec = OffloadCoreOffloadingSpec(offloading_config(kv_bytes_per_block=0))
    with pytest.raises(InvalidSpecError, match="worker_kv_bytes_per_block=0"):
        spec.get_worker(None)


def test_the_serve_benchmark_notes_what_the_engine_submits(monkeypatch):
    """benchmarks/vllm/recording_spec.py as vLLM's factory loads it by module path: each job's
    lane, blocks and bytes, expedited loads, the results, and offload-core's own counters."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks" / "vllm"))
    import recording_spec

    recording_spec.reset()
    tensors, _, _ = kv("cpu", [256, 256], 32, seed=6)
    refs = [[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]]
    extra = {"spec_name": "RecordingOffloadCoreSpec", "spec_module_path": "recording_spec"}
    worker = spec_worker("cpu", tensors, refs, 8, 1, extra=extra)
    assert worker.submit_store(1, GPULoadStoreSpec([0, 1, 2], [3], [0]), CPULoadStoreSpec([0, 1, 2]))
    assert worker.submit_store(2, GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([3]))
    worker.wait({1, 2})
    assert worker.submit_load(3, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([10, 11], [2], [0]), expedited=True)
    worker.wait({3})
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2, 3]
    s = recording_spec.summary()
    store, load = s["directions"]["store"], s["directions"]["load"]
    assert (store["jobs"], store["blocks_hist"], store["bytes_total"], store["threads"]) == (
        2,
        {"1": 1, "2-3": 1},
        4 * 512,
        1,
    )
    assert (load["jobs"], load["expedited"], load["bytes_total"]) == (1, 1, 2 * 512)
    # the slowest submits, each with its blocks and its place
    assert sorted((x["blocks"], x["index"]) for x in store["slowest"]) == [(1, 1), (3, 0)]
    assert all(x["submit_ms"] > 0 for x in store["slowest"] + load["slowest"])
    assert s["results"] == {"finished": 3, "failed": 0, "failed_ids": []}
    # every job was seen by the one get_finished, after its submit; the engine thread's time
    # covers the submits and that call
    assert s["get_finished_calls"] == 1
    assert 0 < store["done_ms_median"] <= store["done_ms_p99"] and load["done_ms_median"] > 0
    submits_ms = 1e-3 * (2 * store["submit_us_median"] + load["submit_us_median"])
    assert s["engine_thread_ms"] > submits_ms * 0.99
    assert (s["backend"], s["offload_core_stats"]["expedited_load"]["jobs"]) == ("cpu", 1)
    assert torch.equal(tensors[1].tensor[11], tensors[1].tensor[1])
    worker.shutdown()
