"""Validation and host expansion of transfers (`CompactLayout.job`, `.copies`) against the
page-at-a-time reference model, on numpy buffers (no device); the specs' own checks."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers import Model, host_copies
from hypothesis import given
from hypothesis import strategies as st

from offload_core import DeviceBlocks, Direction, HostBlocks, InvalidSpecError
from offload_core.testing.reference import merge_contiguous


@st.composite
def transfers(draw):
    n_tensors = draw(st.integers(1, 4))
    pages = [draw(st.integers(1, 48)) for _ in range(n_tensors)]
    bpc = draw(st.integers(1, 8))
    n_groups = draw(st.integers(1, 3))
    group_refs = []
    for _ in range(n_groups):
        tidx = draw(st.lists(st.integers(0, n_tensors - 1), min_size=1, max_size=4, unique=True))
        group_refs.append([(t, draw(st.integers(1, pages[t]))) for t in tidx])  # unpadded <= padded
    device_blocks, host_blocks = 16, 12
    sizes, indices, dev_ids, host_ids = [], [], [], []
    free_host = list(draw(st.permutations(range(host_blocks))))
    free_device = list(draw(st.permutations(range(device_blocks))))  # groups may share tensors
    for _ in range(n_groups):
        size = min(draw(st.integers(0, 6)), len(free_device))
        index = draw(st.integers(0, 20))
        need = -(-(size + index % bpc) // bpc) if size else 0
        if need > len(free_host):
            size, need = 0, 0
        sizes.append(size)
        indices.append(index)
        dev_ids += [free_device.pop() for _ in range(size)]
        host_ids += [free_host.pop() for _ in range(need)]
    direction = draw(st.sampled_from(list(Direction)))
    gaps = [draw(st.sampled_from([0, 0, 1, 8, 40])) for _ in range(n_tensors)]  # rows a pitch apart
    model = Model(pages, group_refs, bpc, device_blocks, host_blocks, seed=draw(st.integers(0, 2**16)), gaps=gaps)
    return model, direction, DeviceBlocks(dev_ids, sizes, indices), HostBlocks(host_ids)


def execute(batch):
    for s, d, n in zip(batch.src.tolist(), batch.dst.tolist(), batch.sizes.tolist()):
        ctypes.memmove(d, s, n)


def inside(addr, n, spans):
    return any(base <= addr and addr + n <= base + size for base, size in spans)


def _moves_as_the_reference(case, check=lambda batch, model, device: None) -> None:
    """Expand `case` on the host, `check` its copies, run them: every byte as the reference model
    moves it, the bytes between rows untouched."""
    model, direction, device, host = case
    expected_dev, expected_host = model.expected(direction, device, host)
    gaps = model.gaps()
    batch = host_copies(model.layout(), direction, device, host)
    spans = model.buffers()
    for s, d, n in zip(batch.src.tolist(), batch.dst.tolist(), batch.sizes.tolist()):
        assert inside(s, n, spans) and inside(d, n, spans)
    assert batch.nbytes == int(batch.sizes.sum())
    check(batch, model, device)
    execute(batch)
    for got, exp in zip(model.device, expected_dev):
        np.testing.assert_array_equal(got, exp)
    np.testing.assert_array_equal(model.host, expected_host)
    for got, exp in zip(model.gaps(), gaps):
        np.testing.assert_array_equal(got, exp)


@given(transfers())
def test_host_expansion_moves_the_same_bytes_as_the_reference(case):
    def check(batch, model, device):
        assert np.all(batch.sizes > 0)
        order = np.argsort(batch.dst, kind="stable")
        assert np.all(batch.dst[order][1:] >= (batch.dst + batch.sizes)[order][:-1]), "destinations overlap"
        refs_bytes = [sum(c for _, c in refs) for refs in model.group_refs]
        assert batch.nbytes == sum(n * b for n, b in zip(device.group_sizes, refs_bytes))

    _moves_as_the_reference(case, check)


@given(transfers())
def test_block_merging_finds_the_runs_within_each_ref(case):
    model, direction, device, host = case
    layout = model.layout()
    batch = host_copies(layout, direction, device, host)
    src, dst, sizes = merge_contiguous(batch.src, batch.dst, batch.sizes)
    assert int(sizes.sum()) == batch.nbytes
    # Merging again may only join the last run of one ref to the first of the next
    # (tensors that happen to lie back to back in memory), never more.
    assert len(batch) - len(sizes) <= max(0, sum(len(r) for r in model.group_refs) - 1)


def test_worked_example_from_vllm_load():
    """bpc 4, group 0 over two 32 KiB tensors starting mid-chunk, group 1 a 16 KiB window."""
    kib = 1024
    model = Model(
        [32 * kib, 32 * kib, 16 * kib],
        [[(0, 32 * kib), (1, 32 * kib)], [(2, 16 * kib)]],
        4,
        device_blocks=302,
        host_blocks=56,
    )
    device = DeviceBlocks([105, 9, 33, 34, 71, 72, 300, 301], group_sizes=(6, 2), block_indices=(6, 10))
    host = HostBlocks([40, 17, 55])
    layout = model.layout()
    batch = host_copies(layout, Direction.LOAD, device, host)
    assert batch.nbytes == 416 * kib
    # 33,34 and 71,72 land in consecutive sub-pages of host block 17; 300,301 in block 55
    assert len(batch) == 9
    row = model.host.shape[1]
    first = model.host.ctypes.data + 40 * row + 2 * 32 * kib
    assert (batch.src[0], batch.dst[0], batch.sizes[0]) == (
        first,
        model.device[0].ctypes.data + 105 * 32 * kib,
        32 * kib,
    )


def test_contiguous_blocks_of_one_tensor_become_one_copy():
    model = Model([64], [[(0, 64)]], 4, device_blocks=16, host_blocks=8)
    batch = host_copies(model.layout(), Direction.STORE, DeviceBlocks(range(2, 10)), HostBlocks([5, 6]))
    assert len(batch) == 1 and batch.sizes[0] == 8 * 64
    assert batch.dst[0] == model.host.ctypes.data + 5 * model.host.shape[1]


def test_padding_is_never_copied():
    model = Model([64, 64], [[(0, 60), (1, 64)]], 2)
    batch = host_copies(model.layout(), Direction.STORE, DeviceBlocks([0, 1]), HostBlocks([3]))
    assert sorted(batch.sizes.tolist()) == [60, 60, 128]


@pytest.mark.parametrize(
    "device, host, message",
    [
        (DeviceBlocks([0, 1], [1, 1]), HostBlocks([0, 1]), "2 groups"),
        (DeviceBlocks([0, 16]), HostBlocks([0]), "device block id 16 out of range"),
        (DeviceBlocks([-1]), HostBlocks([0]), "device block id -1 out of range"),
        (DeviceBlocks([0]), HostBlocks([12]), "host block id 12 out of range"),
        (DeviceBlocks([0, 1, 2]), HostBlocks([0]), "need 2"),
        (DeviceBlocks([0]), HostBlocks([0, 1]), "need 1"),
        (DeviceBlocks([0, 1], block_indices=[1]), HostBlocks([0]), "need 2"),
        (DeviceBlocks([0, 1, 2, 3]), HostBlocks([4, 4]), "host block id 4 is the destination of two copies"),
    ],
)
def test_bad_specs_are_rejected(device, host, message):
    model = Model([32], [[(0, 32)]], 2)
    with pytest.raises(InvalidSpecError, match=message):
        host_copies(model.layout(), Direction.STORE, device, host)


def test_duplicate_load_destination_is_rejected_but_duplicate_source_is_not():
    model = Model([32], [[(0, 32)]], 1)
    layout = model.layout()
    with pytest.raises(InvalidSpecError, match="device block id 3 is the destination of two copies"):
        host_copies(layout, Direction.LOAD, DeviceBlocks([3, 3]), HostBlocks([0, 1]))
    host_copies(layout, Direction.LOAD, DeviceBlocks([3, 4]), HostBlocks([0, 0]))
    host_copies(layout, Direction.STORE, DeviceBlocks([3, 3]), HostBlocks([0, 1]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_ids=[[1, 2]]), "1-D"),
        (dict(block_ids=[1.0, 2.0]), r"block_ids\[0\] must be an integer, got 1.0"),
        (dict(block_ids=[1, 2], group_sizes=[1]), "add up to 1"),
        (dict(block_ids=[1, 2], group_sizes=[3, -1]), r"^DeviceBlocks\.group_sizes\[1\] must be non-negative, got -1$"),
        (dict(block_ids=[1, 2], group_sizes=[2], block_indices=[0, 0]), "1 group sizes but 2"),
        (dict(block_ids=[1], block_indices=[-2]), r"^DeviceBlocks\.block_indices\[0\] must be non-negative, got -2$"),
        (
            dict(block_ids=[1, 2], group_sizes=[1, 1], block_indices=np.array([4, -7])),
            r"^DeviceBlocks\.block_indices\[1\] must be non-negative, got -7$",
        ),
    ],
)
def test_malformed_device_blocks(kwargs, message):
    with pytest.raises(InvalidSpecError, match=message):
        DeviceBlocks(**kwargs)


BOOLS_AMONG_IDS = [
    ([1, True], 1, "True"),
    ((5, np.True_), 1, "np.True_"),
    ([True], 0, "True"),
    ([0, 1, False], 2, "False"),
    ([*range(2, 102), True], 100, "True"),  # past the few ids scanned at once: numpy's 1 gives it away
    ([*range(100), np.False_], 100, "np.False_"),
    ([False] * 60, 0, "False"),
]


@pytest.mark.parametrize("spec", [DeviceBlocks, HostBlocks])
@pytest.mark.parametrize("ids, at, shown", BOOLS_AMONG_IDS)
def test_a_bool_among_ids_is_refused_wherever_it_stands(spec, ids, at, shown):
    """numpy makes 1 of a bool among ints; a lone bool was refused, one in a list must be too."""
    with pytest.raises(InvalidSpecError) as caught:
        spec(ids)
    name = "DeviceBlocks" if spec is DeviceBlocks else "HostBlocks"
    assert (
        str(caught.value)
        == f"{name}.block_ids must be integers, got {shown} at position {at} (bools are not taken for integers)"
    )


@pytest.mark.parametrize("ids, at, shown", BOOLS_AMONG_IDS[:2])
def test_a_bool_among_group_sizes_or_indices_is_refused(ids, at, shown):
    with pytest.raises(InvalidSpecError, match=rf"^DeviceBlocks\.group_sizes must be integers, got {shown}"):
        DeviceBlocks(list(range(len(ids))), ids)
    with pytest.raises(InvalidSpecError, match=rf"^DeviceBlocks\.block_indices must be integers, got {shown}"):
        DeviceBlocks([7] * len(ids), [1] * len(ids), ids)


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], list(range(200)), list(range(5, 205)), (0, np.int64(1), np.int32(2))])
def test_ids_of_0_and_1_are_not_bools(ids):
    want = [int(i) for i in ids]
    assert DeviceBlocks(ids).block_ids.tolist() == HostBlocks(ids).block_ids.tolist() == want


@pytest.mark.parametrize("ids", [b"\x01\x02", bytearray(b"\x01\x02"), memoryview(b"\x07\x09"), "12"])
def test_bytes_like_ids_are_refused(ids):
    kind = type(ids).__name__
    for spec in (DeviceBlocks, HostBlocks):
        with pytest.raises(InvalidSpecError, match=rf"block_ids must be integers .*, got a {kind}: its bytes"):
            spec(ids)
    with pytest.raises(InvalidSpecError, match=rf"^DeviceBlocks\.group_sizes must be integers .*, got a {kind}"):
        DeviceBlocks([1, 2], ids)


def test_a_memoryview_of_integers_holds_ids():
    """Only raw bytes are refused: a typed buffer's items are ids."""
    assert HostBlocks(memoryview(np.arange(3))).block_ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "sizes, indices",
    [
        ([3], [0]),
        ((3,), (2,)),
        (np.array([3]), np.array([5])),
        ([3], None),
        (np.array([3], dtype=np.int32), [1]),  # not int64: the general path, to the same end
        ([1, 2], [0, 4]),
        ([0, 3], [0, 0]),
    ],
    ids=["list", "tuple", "array", "no indices", "int32 sizes", "two groups", "an empty group"],
)
def test_group_sizes_and_indices_spelled_out_give_the_same_spec_however_written(sizes, indices):
    """One group written out, as vLLM's specs do, takes a short path: the spec it gives must be
    the one the general path gives (values, dtype, read-only), and the caller's lists or arrays
    may change afterwards."""
    device = DeviceBlocks(np.array([7, 3, 5]), sizes, indices)
    want_sizes = [int(v) for v in sizes]
    want_indices = [0] * len(want_sizes) if indices is None else [int(v) for v in indices]
    if isinstance(sizes, np.ndarray):
        sizes[:] = 99
    if isinstance(indices, (list, np.ndarray)):
        indices[:] = [99] * len(indices)
    assert device.group_sizes.tolist() == want_sizes and device.block_indices.tolist() == want_indices
    for arr in (device.group_sizes, device.block_indices):
        assert arr.dtype == np.int64 and not arr.flags.writeable
        with pytest.raises(ValueError, match="WRITEABLE"):
            arr.setflags(write=True)


@pytest.mark.parametrize(
    "sizes, indices, rule",
    [
        ([2], [0], "add up to 2"),
        ([3], [-1], "non-negative"),
        ([True], [0], "must be integers"),
        ([3.0], [0], "must be an integer"),
        ([3], [0, 0], "1 group sizes but 2 block indices"),
        ([3], [True], "must be integers"),
    ],
)
def test_one_group_spelled_out_is_checked_as_any_other(sizes, indices, rule):
    with pytest.raises(InvalidSpecError, match=rule):
        DeviceBlocks([7, 3, 5], sizes, indices)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.array([7, 3, 5]),
        lambda: np.array([7, 3, 5], dtype=np.int32),
        lambda: [7, 3, 5],
        lambda: np.array([7, 0, 3, 0, 5])[::2],  # a strided view
    ],
    ids=["int64", "int32", "list", "strided"],
)
def test_specs_hold_a_read_only_copy_of_the_ids(make):
    """The caller may reuse its array at once: the layout must address exactly what was checked."""
    ids = make()
    device, host = DeviceBlocks(ids), HostBlocks(ids)
    if isinstance(ids, np.ndarray):
        ids[:] = 0
    for spec_ids in (device.block_ids, host.block_ids, device.group_sizes, device.block_indices):
        assert spec_ids.dtype == np.int64 and not spec_ids.flags.writeable
        with pytest.raises(ValueError, match="WRITEABLE"):  # not even on purpose: a queued job reads them later
            spec_ids.setflags(write=True)
    for spec_ids in (device.block_ids, host.block_ids):
        assert spec_ids.tolist() == [7, 3, 5]
    assert device.group_sizes.tolist() == [3] and device.block_indices.tolist() == [0]


def test_an_empty_transfer_expands_to_nothing():
    model = Model([32], [[(0, 32)], [(0, 16)]], 3)
    batch = host_copies(model.layout(), Direction.STORE, DeviceBlocks([], [0, 0]), HostBlocks([]))
    assert len(batch) == 0 and batch.nbytes == 0


def test_groups_collide_only_through_a_shared_tensor():
    disjoint = Model([32, 32], [[(0, 32)], [(1, 32)]], 2).layout()
    host_copies(disjoint, Direction.LOAD, DeviceBlocks([3, 3], [1, 1]), HostBlocks([0, 1]))
    shared = Model([32, 32], [[(0, 32)], [(0, 32), (1, 32)]], 2).layout()
    with pytest.raises(InvalidSpecError, match="device block id 3 is the destination of two copies"):
        host_copies(shared, Direction.LOAD, DeviceBlocks([3, 3], [1, 1]), HostBlocks([0, 1]))
    # the same host block, different sub-pages: no collision
    host_copies(shared, Direction.STORE, DeviceBlocks([3, 4], [1, 1], [0, 1]), HostBlocks([0, 0]))
    with pytest.raises(InvalidSpecError, match=r"host block 1 \(sub-page 0 of it\) is the destination of two copies"):
        host_copies(shared, Direction.STORE, DeviceBlocks([3, 4], [1, 1], [0, 0]), HostBlocks([1, 1]))


def test_groups_that_share_no_tensor_stay_apart_when_others_do():
    # groups 0 and 2 share tensor 0; group 1 has tensor 1 to itself
    layout = Model([32, 32], [[(0, 32)], [(1, 32)], [(0, 32)]], 2).layout()
    host_copies(layout, Direction.LOAD, DeviceBlocks([5, 5], [1, 1, 0]), HostBlocks([1, 2]))
    host_copies(layout, Direction.LOAD, DeviceBlocks([5, 5], [0, 1, 1]), HostBlocks([1, 2]))
    with pytest.raises(InvalidSpecError, match="device block id 5 is the destination of two copies"):
        host_copies(layout, Direction.LOAD, DeviceBlocks([5, 5], [1, 0, 1]), HostBlocks([1, 2]))
    host_copies(layout, Direction.STORE, DeviceBlocks([3, 4], [1, 1, 0]), HostBlocks([0, 0]))
    with pytest.raises(InvalidSpecError, match=r"host block 0 \(sub-page 0 of it\) is the destination of two copies"):
        host_copies(layout, Direction.STORE, DeviceBlocks([3, 4], [1, 0, 1]), HostBlocks([0, 0]))
    with pytest.raises(InvalidSpecError, match="device block id 5 is the destination of two copies"):
        host_copies(layout, Direction.LOAD, DeviceBlocks([5, 5, 6], [2, 0, 1]), HostBlocks([1, 3]))  # within a group


@st.composite
def canonical_transfers(draw):
    """One rank of a TP group, pages scattered into canonical pages through attention mappings."""
    from offload_core.canonical import attention_mappings

    heads = draw(st.sampled_from([1, 2, 4]))
    tp_size = draw(st.sampled_from([1, 2, 4]))
    tokens = draw(st.integers(1, 3))
    head_bytes = draw(st.sampled_from([2, 8]))
    layout = draw(st.sampled_from([("NHD", None), ("HND", "split"), ("NHD", "packed")]))
    maps = attention_mappings(
        total_kv_heads=heads, tp_size=tp_size, block_tokens=tokens, head_bytes=head_bytes, order=layout[0], kv=layout[1]
    )
    mapping = maps[draw(st.integers(0, tp_size - 1))]
    n_tensors = draw(st.integers(1, 3))
    bpc = draw(st.integers(1, 4))
    local, canon = mapping.local_page_size_bytes, mapping.canonical_page_size_bytes
    size = draw(st.integers(0, 6))
    index = draw(st.integers(0, 9))
    need = -(-(size + index % bpc) // bpc) if size else 0
    dev_ids = draw(st.permutations(range(16)))[:size]
    host_ids = draw(st.permutations(range(12)))[:need]
    direction = draw(st.sampled_from(list(Direction)))
    gap = draw(st.sampled_from([0, 3, 16]))  # device rows a pitch apart
    model = Model(
        [local] * n_tensors,
        [[(t, local, mapping) for t in range(n_tensors)]],
        bpc,
        seed=draw(st.integers(0, 99)),
        gaps=[gap] * n_tensors,
    )
    assert model.host_layout.pages == (canon,) * n_tensors  # refs with a mapping: canonical host pages
    return model, direction, DeviceBlocks(dev_ids, [size], [index]), HostBlocks(host_ids)


@given(canonical_transfers())
def test_canonical_expansion_matches_the_reference(case):
    _moves_as_the_reference(case)


@pytest.mark.parametrize(
    "ids", [np.zeros((0, 3), dtype=np.int64), np.zeros(0), np.array([], "U3"), np.empty(0, np.float32)]
)
def test_empty_ids_are_still_1_d_integers(ids):
    with pytest.raises(InvalidSpecError, match="must be 1-D|must be integers"):
        DeviceBlocks(ids)
    assert DeviceBlocks([]).block_ids.size == HostBlocks(()).block_ids.size == 0  # a Python [] is any dtype


def test_specs_compare_and_hash_by_value():
    assert DeviceBlocks([1, 2]) == DeviceBlocks(np.array([1, 2], dtype=np.int32), [2])
    assert DeviceBlocks([1, 2]) != DeviceBlocks([1, 2], [1, 1]) and DeviceBlocks([1]) != HostBlocks([1])
    assert len({HostBlocks([3]), HostBlocks(np.array([3])), HostBlocks([4])}) == 2
    assert hash(DeviceBlocks([1, 2], [1, 1], [0, 2])) == hash(DeviceBlocks([1, 2], [1, 1], [0, 2]))
