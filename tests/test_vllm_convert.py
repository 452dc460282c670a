"""The vLLM adapter's worker side without vLLM (`offload_core.integrations.vllm_convert`): vLLM's
objects stood in for by plain ones with the same fields, on every backend, so the conversion
runs on machines where vLLM cannot be installed (the GPU one here) too."""

from __future__ import annotations

import os
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from tp_ranks import check_tp2_stores_tp1_loads

from offload_core import InvalidSpecError, get_backend, registry
from offload_core.integrations.vllm_convert import WorkerAdapter


@pytest.fixture(params=[pytest.param(n, marks=getattr(pytest.mark, n)) for n in ("cpu", "cuda", "npu", "xpu")])
def backend(request):
    """(name, device) of each available backend (npu and xpu where simulated)."""
    reason = registry.availability()[request.param]
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    return request.param, get_backend(request.param).device


def gpu_spec(ids, sizes, indices):
    return NS(block_ids=np.array(ids, dtype=np.int32), group_sizes=sizes, block_indices=indices)


def cpu_spec(ids):
    return NS(block_ids=np.array(ids, dtype=np.int32))


def test_groups_strided_rows_and_expedited_loads(backend):
    """Two groups (one moving nothing), strided int8 rows with padding after each page, three
    blocks per chunk entered mid-chunk; the bytes between rows stay untouched."""
    name, device = backend
    blocks, pages, gap, bpc = 24, [256, 512, 128], 40, 3
    gen = torch.Generator().manual_seed(7)
    backing = [torch.randint(-128, 128, (blocks, p + gap), dtype=torch.int8, generator=gen).to(device) for p in pages]
    tensors = [NS(tensor=b[:, :p], page_size_bytes=p) for b, p in zip(backing, pages)]
    refs = [
        [NS(tensor_idx=0, page_size_bytes=256, mapping=None), NS(tensor_idx=1, page_size_bytes=500, mapping=None)],
        [NS(tensor_idx=2, page_size_bytes=128, mapping=None)],
    ]
    worker = WorkerAdapter(NS(tensors=tensors, group_data_refs=refs), 8, bpc, backend=name)
    before = [b.cpu().clone() for b in backing]
    src, dst, sizes, indices, chunks = [3, 5, 7, 9], [13, 15, 17, 19], [4, 0], [2, 0], [6, 1]
    assert worker.submit_store(1, gpu_spec(src, sizes, indices), cpu_spec(chunks))
    worker.wait({1})
    assert worker.submit_load(2, cpu_spec(chunks), gpu_spec(dst, sizes, indices), expedited=True)
    worker.wait([2])
    results = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(1, True, 4 * 756), (2, True, 4 * 756)]
    assert worker.worker.stats()["expedited_load"].jobs == 1
    for t, (b, p, c) in enumerate(zip(backing, pages, [256, 500, 128])):
        got = b.cpu()
        if t < 2:
            assert torch.equal(got[dst, :c], before[t][src, :c])
        untouched = [i for i in range(blocks) if t == 2 or i not in dst]
        assert torch.equal(got[untouched], before[t][untouched])
        assert torch.equal(got[:, p:], before[t][:, p:])  # between rows
    worker.shutdown()


def test_canonical_pages_through_a_shared_region(backend):
    """Mappings converted: TP=2 ranks store their heads into one canonical region, TP=1 loads."""
    backend_name, device = backend
    name = f"convert-{os.getpid()}-{backend_name}"

    def vllm_like(kv):
        return NS(
            tensors=[
                NS(tensor=t.tensor.reshape(t.num_blocks, -1).view(torch.int8), page_size_bytes=t.page_size_bytes)
                for t in kv.tensors
            ],
            group_data_refs=[
                [NS(tensor_idx=r.tensor_idx, page_size_bytes=r.page_size_bytes, mapping=r.mapping) for r in g]
                for g in kv.group_refs
            ],
        )

    def make(kv, tp, rank):
        return WorkerAdapter(kv, 8, backend=backend_name, shared_region=name, canonical=True, rank=rank)

    check_tp2_stores_tp1_loads(make, vllm_like, gpu_spec, cpu_spec, device)


def test_a_canonical_layout_needs_a_region_and_mappings():
    tensors = [NS(tensor=torch.zeros(4, 64, dtype=torch.int8), page_size_bytes=64)]
    refs = [[NS(tensor_idx=0, page_size_bytes=64, mapping=None)]]
    with pytest.raises(InvalidSpecError, match="needs the name of the region"):
        WorkerAdapter(NS(tensors=tensors, group_data_refs=refs), 4, canonical=True)
    with pytest.raises(InvalidSpecError, match="could not certify"):
        WorkerAdapter(NS(tensors=tensors, group_data_refs=refs), 4, canonical=True, shared_region=f"x-{os.getpid()}")


def test_host_memory_beyond_vllms_budget_is_refused():
    tensors = [NS(tensor=torch.zeros(4, 64, dtype=torch.int8), page_size_bytes=64)]
    refs = [[NS(tensor_idx=0, page_size_bytes=64, mapping=None)]]
    with pytest.raises(InvalidSpecError, match="vLLM budgeted 32"):
        WorkerAdapter(NS(tensors=tensors, group_data_refs=refs), 4, 1, row_budget=32)


@pytest.mark.parametrize(
    "tensor_page, ref_page, args, rule",
    [
        (256.9, 256, (4,), "must be a positive integer, got 256.9"),
        (256, 200.7, (4,), "must be a positive integer, got 200.7"),
        (256, 256, (None,), "num_chunks must be a positive integer, got None"),
        (256, 256, ("4",), "num_chunks must be a positive integer, got '4'"),
        (256, 256, (4, "2"), "blocks_per_chunk must be a positive integer, got '2'"),
        (256, 256, (4, None), "blocks_per_chunk must be a positive integer, got None"),
    ],
)
def test_what_vllm_hands_over_is_checked_not_truncated(tensor_page, ref_page, args, rule):
    tensors = [NS(tensor=torch.zeros(4, 256, dtype=torch.int8), page_size_bytes=tensor_page)]
    refs = [[NS(tensor_idx=0, page_size_bytes=ref_page, mapping=None)]]
    with pytest.raises(InvalidSpecError, match=rule):
        WorkerAdapter(NS(tensors=tensors, group_data_refs=refs), *args)


def test_a_spec_that_is_not_one_is_named():
    tensors = [NS(tensor=torch.zeros(4, 64, dtype=torch.int8), page_size_bytes=64)]
    refs = [[NS(tensor_idx=0, page_size_bytes=64, mapping=None)]]
    adapter = WorkerAdapter(NS(tensors=tensors, group_data_refs=refs), 4, backend="cpu")
    try:
        with pytest.raises(InvalidSpecError, match="expected a GPULoadStoreSpec"):
            adapter.submit_store(1, None, cpu_spec([0]))
        with pytest.raises(InvalidSpecError, match="expected a CPULoadStoreSpec"):
            adapter.submit_load(2, object(), gpu_spec([0], [1], [0]))
    finally:
        adapter.shutdown()
    with pytest.raises(InvalidSpecError, match="expected a GPULoadStoreSpec"):  # named before the worker's state
        adapter.submit_store(3, None, None)


def test_region_names_are_unique_and_keep_the_replica():
    from offload_core.integrations.vllm_convert import region_name

    long = "x" * 300
    assert region_name(long, 0) != region_name(long, 1) and len(region_name(long, 1)) <= 128
    assert region_name("team/a:b", 0) != region_name("team:a/b", 0)
    assert region_name("engine-1", 2).startswith("vllm-engine-1-dp2-")


def _refs(**ref):
    return [[NS(**{"tensor_idx": 0, "page_size_bytes": 64, "mapping": None, **ref})]]


@pytest.mark.parametrize(
    "kv",
    [
        NS(),  # no fields at all
        NS(tensors=[NS(tensor=torch.zeros(4, 64, dtype=torch.int8))], group_data_refs=_refs()),  # no page size
        NS(tensors=[NS(tensor=torch.zeros(4, 64, dtype=torch.int8), page_size_bytes=64)], group_data_refs=None),
        NS(tensors=[NS(tensor=torch.zeros(4, 64, dtype=torch.int8), page_size_bytes=64)], group_data_refs=[[NS()]]),
        NS(
            tensors=[NS(tensor=torch.zeros(4, 64, dtype=torch.int8), page_size_bytes=64)],
            group_data_refs=[_refs()[0] + _refs(page_size_bytes=None)[0]],  # two refs to one tensor
        ),
    ],
)
def test_malformed_kv_caches_are_named_not_leaked(kv):
    with pytest.raises(InvalidSpecError, match="kv_caches must be vLLM's CanonicalKVCaches"):
        WorkerAdapter(kv, 8, backend="cpu")


@pytest.mark.parametrize("value", ["x", -1, 1.5])
def test_region_name_takes_a_replica_index(value):
    from offload_core.integrations.vllm_convert import region_name

    with pytest.raises(InvalidSpecError, match="data_parallel_index"):
        region_name("e", value)


@pytest.mark.parametrize("value", ["no", "False", 2])
def test_the_adapter_s_canonical_must_be_a_truth_value(value):
    kv = NS(tensors=[NS(tensor=torch.zeros(4, 64, dtype=torch.int8), page_size_bytes=64)], group_data_refs=_refs())
    with pytest.raises(InvalidSpecError, match="canonical must be True or False"):
        WorkerAdapter(kv, 8, backend="cpu", shared_region="r", canonical=value)
