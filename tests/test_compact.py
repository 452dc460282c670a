"""Jobs expanded as a device does, against the host path and the reference model, on numpy buffers.

A job expanded as a device kernel is specified to (`expanding.descriptors`), straight into
the host rows or into staging that mirrors them and then out by segments, must move exactly
the bytes of the host path (`CompactLayout.copies`, itself checked against the page-at-a-time
reference model in test_expansion.py): every layout feature (blocks per chunk, partial first
chunks, several groups, groups sharing tensors, padded pages, canonical mappings with writer
election).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers import Model, compact_layout, compiled_or_skip, host_copies
from hypothesis import given, settings
from hypothesis import strategies as st
from test_expansion import transfers

from offload_core import CanonicalPageMapping, CopyRun, DeviceBlocks, Direction, HostBlocks, InvalidSpecError
from offload_core.canonical import attention_mappings
from offload_core.compact import CompactJob
from offload_core.testing.expanding import POISON, descriptors, steps


def execute(src, dst, sizes):
    for s, d, n in zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), np.asarray(sizes).tolist()):
        ctypes.memmove(d, s, n)


def run_compact(layout, job, staged: bool) -> None:
    """What an expanding backend does with a job, on the host; staging poisoned."""
    staging = np.full(max(1, job.host_ids.size * layout.row_bytes), POISON, dtype=np.uint8)
    batches = steps(job, staging.ctypes.data if staged else None)
    for src, dst, sizes in batches:
        execute(src, dst, sizes)
    if staged:
        stage = batches[1][0] if job.direction is Direction.STORE else batches[0][1]
        assert (np.sort(stage) == stage).all(), "segments come in staging order"


def check_against_host_copies(model, direction, device, host, staged):
    layout = model.layout()
    devices, rows = model.snapshot()
    gaps = model.gaps()
    batch = host_copies(layout, direction, device, host)
    execute(batch.src, batch.dst, batch.sizes)
    want_dev, want_host = model.snapshot()
    for a, b in zip(model.device, devices):
        a[:] = b
    model.host[:] = rows
    job = layout.job(direction, device, host)
    assert job.nbytes == int(batch.sizes.sum())
    keys = job.destinations()
    assert not keys.size or 0 <= keys.min() <= keys.max() < job.destination_limit  # what _first_clash counts on
    assert job.items == sum(int(layout.group_entries[1, g]) * (b1 - b0) for g, b0, b1, *_ in job.groups)
    run_compact(layout, job, staged)
    for a, b in zip(model.device, want_dev):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(model.host, want_host)
    for a, b in zip(model.gaps(), gaps):
        np.testing.assert_array_equal(a, b)


@given(case=transfers(), staged=st.booleans())
def test_expanded_jobs_move_what_the_host_path_moves(case, staged):
    model, direction, device, host = case
    check_against_host_copies(model, direction, device, host, staged)


@st.composite
def canonical_transfers(draw):
    """Attention pages sharded over TP with replicated heads (writer election), several groups."""
    heads = draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    tokens = draw(st.integers(1, 4))
    head_bytes = draw(st.sampled_from([8, 16, 24]))
    kv = draw(st.sampled_from([None, "split"]))
    maps = attention_mappings(total_kv_heads=heads, tp_size=tp, block_tokens=tokens, head_bytes=head_bytes, kv=kv)
    mapping = maps[draw(st.integers(0, tp - 1))]
    n_tensors = draw(st.integers(1, 3))
    local, canon = mapping.local_page_size_bytes, mapping.canonical_page_size_bytes
    pad = draw(st.sampled_from([0, 8]))
    plain_page = draw(st.integers(1, 40))
    bpc = draw(st.integers(1, 4))
    # tensor 0..n-1 canonical; one more plain tensor in a second group
    dev_pages = [local + pad] * n_tensors + [plain_page]
    host_pages = [canon] * n_tensors + [plain_page]
    refs = [[(t, local, mapping) for t in range(n_tensors)], [(n_tensors, plain_page)]]
    device_blocks, host_blocks = 12, 10
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    sizes = [draw(st.integers(0, 5)), draw(st.integers(0, 5))]
    indices = [draw(st.integers(0, 7)), draw(st.integers(0, 7))]
    counts = [-(-(s + i % bpc) // bpc) if s else 0 for s, i in zip(sizes, indices)]
    if sum(counts) > host_blocks:
        sizes[1], counts[1] = 0, 0
    dev_ids = rng.permutation(device_blocks)[: sum(sizes)]
    host_ids = rng.permutation(host_blocks)[: sum(counts)]
    direction = draw(st.sampled_from(list(Direction)))
    model = Model(dev_pages, refs, bpc, device_blocks, host_blocks, seed=int(rng.integers(1 << 16)))
    assert list(model.host_layout.pages) == host_pages  # refs with a mapping: canonical host pages
    return model, direction, DeviceBlocks(dev_ids, sizes, indices), HostBlocks(host_ids)


@given(case=canonical_transfers(), staged=st.booleans())
def test_canonical_compact_jobs_move_what_the_host_path_moves(case, staged):
    model, direction, device, host = case
    check_against_host_copies(model, direction, device, host, staged)


@given(case=st.one_of(transfers(), canonical_transfers()), limit=st.sampled_from([0, 8, 24, 1 << 20]))
def test_a_segment_summary_counts_what_segments_returns(case, limit):
    model, direction, device, host = case
    layout = model.layout()
    job = layout.job(direction, device, host)
    segments = layout.segments(job)
    _, _, sizes = segments
    assert layout.segment_summary(job, limit) == (sizes.size, int(sizes[sizes <= limit].sum()))
    assert layout.segments(job) is segments  # computed once per job: a choice asks, then the copy


@given(
    hosts=st.lists(st.integers(0, 11), min_size=1, max_size=12, unique=True),
    direction=st.sampled_from(list(Direction)),
    limit=st.sampled_from([0, 47, 48, 96, 200, 1 << 20]),
    compiled=st.booleans(),
)
def test_a_segment_summary_of_whole_rows_counts_runs_of_host_blocks(hosts, direction, limit, compiled):
    model = Model([16, 32], [[(0, 16), (1, 32)]], 1, 16, 12)  # every block fills its 48-byte row
    layout = compact_layout(model, compiled)
    job = layout.job(direction, DeviceBlocks(list(range(len(hosts)))), HostBlocks(hosts))
    _, _, sizes = layout.segments(job)
    assert layout.segment_summary(job, limit) == (sizes.size, int(sizes[sizes <= limit].sum()))


@given(
    hosts=st.lists(st.integers(0, 11), min_size=1, max_size=12, unique=True), direction=st.sampled_from(list(Direction))
)
def test_whole_rows_segments_compiled_are_numpys(hosts, direction):
    """Rows of which none continues another take a compiled shortcut: the same ranges, the same types."""
    model = Model([16, 32], [[(0, 16), (1, 32)]], 1, 16, 12)
    jobs = [
        compact_layout(model, compiled).job(direction, DeviceBlocks(list(range(len(hosts)))), HostBlocks(hosts))
        for compiled in (False, True)
    ]
    numpy_side, compiled_side = (job.layout.segments(job) for job in jobs)
    for a, b in zip(numpy_side, compiled_side):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype == np.int64


def test_a_segment_summary_sees_ranges_that_continue_into_the_next_row():
    # rows of 128 bytes; each block touches [0, 32) and [64, 128): a row's last range and the
    # next row's first continue each other where host blocks follow each other
    model = Model([64, 64], [[(0, 32), (1, 64)]], 1, 16, 12)
    layout = model.layout()
    job = layout.job(Direction.STORE, DeviceBlocks([5, 1, 9]), HostBlocks([3, 4, 5]))
    _, _, sizes = layout.segments(job)
    assert sizes.tolist() == [32, 96, 96, 64]
    assert layout.segment_summary(job, 64) == (4, 96)


def test_full_rows_become_one_segment_per_run_of_host_blocks():
    model = Model([64, 32, 16], [[(0, 64), (1, 32), (2, 16)]], 1, 16, 12)
    layout = model.layout()
    job = layout.job(Direction.STORE, DeviceBlocks([5, 1, 9, 2]), HostBlocks([3, 4, 5, 9]))
    stage, host, sizes = layout.segments(job)
    assert stage.tolist() == [0, 3 * 112] and host.tolist() == [3 * 112, 9 * 112] and sizes.tolist() == [3 * 112, 112]


def test_writer_election_leaves_other_ranks_pages_alone():
    m = CanonicalPageMapping(128, 64, (CopyRun(0, 0, 64),), num_writers=2, writer_index=1)
    model = Model([128], [[(0, 64, m)]], 1, 8, 8)
    layout = model.layout()
    job = layout.job(Direction.STORE, DeviceBlocks([0, 1, 2, 3]), HostBlocks([0, 1, 2, 3]))
    stage, host, sizes = layout.segments(job)
    assert host.tolist() == [1 * 128, 3 * 128] and sizes.tolist() == [64, 64]
    assert job.nbytes == 128


@pytest.mark.parametrize(
    "device, host, message",
    [
        (DeviceBlocks([0, 16]), HostBlocks([0, 1]), "device block id 16 out of range"),
        (DeviceBlocks([0, 1]), HostBlocks([0, 12]), "host block id 12 out of range"),
        (DeviceBlocks([0, 1]), HostBlocks([0]), "1 host block ids given"),
        (DeviceBlocks([0, 1]), HostBlocks([3, 3]), "host block id 3 is the destination of two copies"),
    ],
)
def test_compact_jobs_are_validated_as_plans_are(device, host, message):
    model = Model([64], [[(0, 64)]], 1, 16, 12)
    with pytest.raises(InvalidSpecError, match=message):
        model.layout().job(Direction.STORE, device, host)


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize(
    "groups, device, host, message",
    [
        # two groups: positions count from the start of the id's own group, which is named
        (
            2,
            DeviceBlocks([1, 2, 3, 4], [2, 2]),
            HostBlocks([0, 1, 2, 99]),
            "host block id 99 out of range [0, 12): position 1 of group 1's host block ids",
        ),
        (
            2,
            DeviceBlocks([1, 2, 3, 44], [2, 2]),
            HostBlocks([0, 1, 2, 3]),
            "device block id 44 out of range [0, 16): position 1 of group 1's device block ids",
        ),
        (
            2,
            DeviceBlocks([1, 2, 3, 4], [2, 2]),
            HostBlocks([0, -1, 2, 12]),
            "host block id -1 out of range [0, 12): position 1 of group 0's host block ids; 1 more out of range",
        ),
        (
            2,
            DeviceBlocks([3, 4], [0, 2]),
            HostBlocks([0, 50]),
            "host block id 50 out of range [0, 12): position 1 of group 1's host block ids",
        ),
        # one group (the compiled check only detects: the message is the same either way)
        (
            1,
            DeviceBlocks([1, 2, 3, 4]),
            HostBlocks([0, 1, 2, 12]),
            "host block id 12 out of range [0, 12): position 3 of group 0's host block ids",
        ),
        (
            1,
            DeviceBlocks([1, 2, -3, 4]),
            HostBlocks([0, 1, 2, 3]),
            "device block id -3 out of range [0, 16): position 2 of group 0's device block ids",
        ),
    ],
    ids=[
        "host-2nd-group",
        "device-2nd-group",
        "host-two-bad",
        "host-after-empty-group",
        "host-one-group",
        "device-one-group",
    ],
)
def test_an_id_out_of_range_is_named_with_its_group_and_position_there(compiled, groups, device, host, message):
    model = Model([64, 64], [[(0, 64)], [(1, 64)]], 1, 16, 12) if groups == 2 else Model([64], [[(0, 64)]], 1, 16, 12)
    layout = compact_layout(model, compiled)
    for direction in Direction:
        with pytest.raises(InvalidSpecError) as caught:
            layout.job(direction, device, host)
        assert str(caught.value) == message


@st.composite
def single_group_specs(draw):
    """One group, one block per chunk (the layout `CompactLayout.job` takes a short path for):
    up to 300 ids against small limits, so that every way of checking them runs (Python sets,
    sorting, a bitmap), valid or breaking one rule."""
    device_blocks, host_blocks = draw(st.integers(1, 400)), draw(st.integers(1, 400))
    n = min(draw(st.integers(1, 300)), device_blocks, host_blocks)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    dev, host = rng.permutation(device_blocks)[:n], rng.permutation(host_blocks)[:n]
    flaw = (
        "none"
        if draw(st.booleans())
        else draw(st.sampled_from(["dev_range", "host_range", "negative", "duplicate", "count"]))
    )
    dev, host = dev.copy(), host.copy()
    if dev.size and flaw != "none":
        i = draw(st.integers(0, dev.size - 1))
        if flaw == "dev_range":
            dev[i] = device_blocks + draw(st.integers(0, 3))
        elif flaw == "host_range":
            host[i] = host_blocks
        elif flaw == "negative":
            (dev if draw(st.booleans()) else host)[i] = -1
        elif flaw == "duplicate" and dev.size > 1:
            side = dev if draw(st.booleans()) else host
            side[i] = side[(i + 1) % side.size]
        elif flaw == "count":
            host = host[:-1]
    if draw(st.booleans()):
        model = Model([16], [[(0, 16)]], 1, device_blocks, host_blocks)
    else:  # a replicated canonical page: stores elect a writer per page (a period of two pages)
        writer = draw(st.integers(0, 1))
        mapping = CanonicalPageMapping(128, 64, (CopyRun(0, 0, 64),), num_writers=2, writer_index=writer)
        model = Model([128], [[(0, 64, mapping)]], 1, device_blocks, host_blocks)
    return model, draw(st.sampled_from(list(Direction))), dev, host


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@given(case=single_group_specs())
def test_single_group_jobs_take_a_short_path_to_the_same_job(compiled, case):
    model, direction, dev, host = case
    layout = compact_layout(model, compiled)
    device, hosts = DeviceBlocks(dev), HostBlocks(host)
    short = layout._job_single(direction, device, hosts)
    try:
        general = layout._job_general(direction, device, hosts)
    except InvalidSpecError:
        assert short is None, "the short path took a spec the general one refuses"
        return
    if short is None:
        assert dev.size == 0, "the short path refused a valid spec"
        return
    np.testing.assert_array_equal(short.blocks, general.blocks)
    np.testing.assert_array_equal(short.host_ids, general.host_ids)
    assert (short.groups, short.nbytes, short.items) == (general.groups, general.nbytes, general.items)


@given(
    dev=st.one_of(st.lists(st.integers(-2, 40), max_size=24), st.lists(st.integers(-2, 1100), max_size=300)),
    host_extra=st.integers(-1, 1),
    limit_extra=st.integers(0, 100000),
    unique_dev=st.booleans(),
    data=st.data(),
)
def test_the_compiled_check_agrees_with_numpy(dev, host_extra, limit_extra, unique_dev, data):
    """Every way the compiled step counts ids (pairs, a bitmap, a hash set) against the numpy rules."""
    from offload_core.compact import any_outside, has_duplicates

    module = compiled_or_skip(True)
    dev_limit, host_limit = 1000 + limit_extra, 1000 + data.draw(st.integers(0, 100000))
    host = data.draw(st.lists(st.integers(-2, 40 if len(dev) <= 24 else 1100), min_size=len(dev), max_size=len(dev)))
    host = host[: len(host) + host_extra] if host_extra < 0 else host + [0] * host_extra
    d, h = np.array(dev, dtype=np.int64), np.array(host, dtype=np.int64)
    took = module.single_check(d, h, dev_limit, host_limit, unique_dev)
    valid = (
        d.size > 0
        and h.size == d.size
        and not any_outside(d, dev_limit)
        and not any_outside(h, host_limit)
        and not (has_duplicates(d, dev_limit) if unique_dev else has_duplicates(h, host_limit))
    )
    assert took == valid


@given(
    hosts=st.lists(st.sampled_from([0, 1, 2, 3, 5, 6, 2**62, 2**63 - 1, -(2**63), -1]), max_size=40),
    row=st.sampled_from([1, 48, 4096]),
    small_limit=st.integers(0, 40 * 4096),
)
def test_the_compiled_row_runs_agree_with_numpy(hosts, row, small_limit):
    """Runs of consecutive host blocks, wrapping differences included (numpy's int64 ones wrap)."""
    from offload_core.compact import _row_runs

    module = compiled_or_skip(True)
    h = np.array(hosts, dtype=np.int64)
    expected = _row_runs(h, row, small_limit) if h.size else (0, 0)
    assert _row_runs(h, row, small_limit, module) == expected
    assert module.row_runs(h, small_limit // row) == (expected[0], expected[1] // row)
    assert _row_runs(h, row, float(small_limit), module) == expected  # a limit read from a profile as a float
    assert module.row_runs(h, 2**80) == (expected[0], h.size)  # saturated: every run is short
    assert module.row_runs(h, -(2**80)) == (expected[0], 0)


@pytest.mark.parametrize("n, limit", [(16, 1000), (200, 1000), (200, 10**6)], ids=["pairs", "bitmap", "set"])
@pytest.mark.parametrize("where", ["smallest", "largest", "apart"])
def test_the_compiled_check_finds_a_duplicate_wherever_it_lies(n, limit, where):
    module = compiled_or_skip(True)
    ids = np.arange(10, 10 + n, dtype=np.int64) * (limit // (20 + 2 * n))
    i, j = {"smallest": (0, 1), "largest": (n - 2, n - 1), "apart": (3, n - 4)}[where]
    ids[j] = ids[i]
    ids = np.random.default_rng(n).permutation(ids)
    assert not module.single_check(ids, np.arange(n, dtype=np.int64), limit, limit, True)
    assert module.single_check(np.arange(n, dtype=np.int64), ids, limit, limit, True)  # host ids may repeat on a load


@pytest.mark.parametrize("n", [2, 5, 16, 64])
def test_the_compiled_check_finds_every_pair_of_equal_ids_among_few(n):
    module = compiled_or_skip(True)
    other = np.arange(n, dtype=np.int64)
    for i in range(n):
        for j in range(i + 1, n):
            ids = np.arange(n, dtype=np.int64) * 3
            ids[j] = ids[i]
            assert not module.single_check(ids, other, 3 * n, 3 * n, True), (i, j)


@pytest.mark.parametrize("n", [1023, 1024, 1025, 2048, 3001])
@pytest.mark.parametrize("bad", [4000, -1, -(2**63)])
def test_the_compiled_check_finds_an_id_out_of_range_wherever_it_lies(n, bad):
    """The range check goes through blocks of 1024 ids: an id out of range at either end of
    one, or in the last, short one, is found on either side; one just past the ids is not read."""
    module = compiled_or_skip(True)
    buf = np.arange(n + 1, dtype=np.int64)
    buf[n] = bad  # past the end of the view below
    good = buf[:n]
    assert module.single_check(good, good, n, n, True) and module.single_check(good, good, n, n, False)
    for at in sorted({0, 1023, 1024, n // 2, n - 1} & set(range(n))):
        ids = good.copy()
        ids[at] = bad
        assert not module.single_check(ids, good, n, n, True), at
        assert not module.single_check(good, ids, n, n, False), at


def test_the_compiled_check_takes_any_limit():
    module = compiled_or_skip(True)
    ids = np.array([0, 5], dtype=np.int64)
    assert not module.single_check(ids, ids, 0, 10, True)
    assert not module.single_check(ids, ids, -1, 10, True)
    assert module.single_check(ids, ids, 2**64, 2**70, True)  # beyond int64: no id reaches it
    assert not module.single_check(np.array([-5, 1], dtype=np.int64), ids, 2**64, 10, True)


def test_the_compiled_check_lets_go_of_every_buffer():
    """An `array.array` refuses to grow while a buffer export of it is held."""
    from array import array

    module = compiled_or_skip(True)
    for dev, host in (([1, 2], [3, 4]), ([1, 1], [3, 4]), ([1, 99], [3, 4]), ([1, 2], [3])):
        d, h = array("q", dev), array("q", host)
        module.single_check(d, h, 10, 10, True)
        for a in (d, h):
            a.append(0)
    d, h = array("q", [1, 2]), array("d", [3, 4])
    with pytest.raises(TypeError, match="host_ids must be"):
        module.single_check(d, h, 10, 10, True)
    d.append(0)


def test_the_compiled_concat_checks_sizes_before_it_writes_and_lets_go_of_every_buffer():
    from array import array

    module = compiled_or_skip(True)
    a, b = np.arange(10, dtype=np.int64).reshape(5, 2), np.arange(15, dtype=np.int64).reshape(5, 3)
    out, hosts = np.full((5, 5), -1, dtype=np.int64), np.full(3, -1, dtype=np.int64)
    module.concat([a, b], [np.array([7, 8], dtype=np.int64), np.array([9], dtype=np.int64)], out, hosts)
    want = np.concatenate([a, b], axis=1)
    want[1, 2:] += 2
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(hosts, [7, 8, 9])
    short = np.full((5, 4), -1, dtype=np.int64)
    with pytest.raises(ValueError, match="the outputs must hold"):
        module.concat([a, b], [np.array([7, 8], dtype=np.int64), np.array([9], dtype=np.int64)], short, hosts)
    assert (short == -1).all()
    with pytest.raises(ValueError, match="5 x n"):
        module.concat([a.reshape(2, 5)], [np.zeros(1, dtype=np.int64)], out, hosts)

    def table(n):  # a 5 x n int64 view whose `release` fails while a buffer export of it is held
        return memoryview(array("q", range(5 * n))).cast("B").cast("q", [5, n])

    hosts = [array("q", [1, 2]), array("q", [3])]
    for out_n, host_n in ((2, 3), (1, 3), (2, 2)):  # fits; too few blocks; too few host ids
        tables, out, out_hosts = [table(1), table(1)], table(out_n), memoryview(array("q", [0] * host_n))
        try:
            module.concat(tables, hosts, out, out_hosts)
        except ValueError:
            assert (out_n, host_n) != (2, 3)
        for view in (*tables, out, out_hosts):
            view.release()
        for h in hosts:
            h.append(0)
            h.pop()


def test_the_compiled_check_refuses_what_is_not_an_int64_array():
    module = compiled_or_skip(True)
    ids = np.arange(4, dtype=np.int64)
    with pytest.raises(TypeError, match="host_ids must be a C-contiguous int64 array"):
        module.single_check(ids, ids.astype(np.int32), 10, 10, True)
    with pytest.raises(ValueError, match="not C-contiguous"):
        module.single_check(np.arange(8, dtype=np.int64)[::2], ids, 10, 10, True)
    with pytest.raises(TypeError, match="single_check takes 5 arguments"):
        module.single_check(ids, ids, 10, 10)


@given(ids=st.lists(st.integers(0, 999), max_size=400), limit_extra=st.integers(0, 100000))
def test_duplicates_are_found_whichever_way_the_ids_are_counted(ids, limit_extra):
    from offload_core.compact import has_duplicates

    arr = np.array(ids, dtype=np.int64)
    assert has_duplicates(arr, 1000 + limit_extra) == (len(set(ids)) != len(ids))


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@given(
    bpc=st.integers(1, 3),
    sizes=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 5)), min_size=1, max_size=5),
    direction=st.sampled_from(list(Direction)),
    seed=st.integers(0, 2**16),
)
def test_jobs_concatenated_expand_to_their_copies_in_order(compiled, bpc, sizes, direction, seed):
    """Two groups on their own tensors; each job takes fresh blocks. A launch of concatenated
    jobs must expand to exactly the copies of each job, job after job."""
    model = Model([16, 24], [[(0, 16)], [(1, 24)]], bpc, device_blocks=64, host_blocks=64)
    layout = compact_layout(model, compiled)
    rng = np.random.default_rng(seed)
    dev_free, host_free = list(rng.permutation(64)), list(rng.permutation(64))
    specs = []
    for n0, n1, index in sizes:
        if n0 + n1 == 0:
            continue
        chunks = sum(-(-(n + index % bpc) // bpc) if n else 0 for n in (n0, n1))
        dev = [dev_free.pop() for _ in range(n0 + n1)]
        host = [host_free.pop() for _ in range(chunks)]
        specs.append((DeviceBlocks(dev, [n0, n1], [index, index]), HostBlocks(host)))
    if not specs:
        return
    jobs = [layout.job(direction, *spec) for spec in specs]
    whole = CompactJob.concat(jobs)
    if compiled:  # the same job as numpy's
        numpy_layout = model.layout(compiled=False)
        reference = CompactJob.concat([numpy_layout.job(direction, *spec) for spec in specs])
        np.testing.assert_array_equal(whole.blocks, reference.blocks)
        np.testing.assert_array_equal(whole.host_ids, reference.host_ids)
        assert whole.groups == reference.groups
    want = [np.concatenate(parts) for parts in zip(*(descriptors(j) for j in jobs))]
    for got, expected in zip(descriptors(whole), want):
        np.testing.assert_array_equal(got, expected)
    assert (whole.nbytes, whole.items) == (sum(j.nbytes for j in jobs), sum(j.items for j in jobs))
    assert whole.jobs == len(jobs) and CompactJob.concat([whole, jobs[0]]).jobs == len(jobs) + 1
    _, _, sizes = layout.segments(whole)  # a launch's summary is of concatenated jobs
    assert layout.segment_summary(whole, 24) == (sizes.size, int(sizes[sizes <= 24].sum()))


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize("direction", list(Direction))
def test_simple_jobs_join_as_their_ids_and_copy_what_each_would(compiled, direction):
    """One group, one block per chunk: jobs keep their ids only (no block table), a launch joins
    them by concatenating the ids, and empty jobs among them add nothing."""
    model = Model([16], [[(0, 16)]], 1, 64, 64)
    layout = compact_layout(model, compiled)
    specs = [([5, 9, 2], [11, 3, 60]), ([], []), ([40], [8]), ([7, 1], [0, 63])]
    jobs = [layout.job(direction, DeviceBlocks(d), HostBlocks(h)) for d, h in specs]
    assert [j.simple for j in jobs] == [True, False, True, True]  # an empty spec goes the general way
    whole = CompactJob.concat(jobs)
    assert whole.simple and whole.groups == ((0, 0, 6, 0, 6, 0),)
    np.testing.assert_array_equal(whole.dev_ids, [5, 9, 2, 40, 7, 1])
    np.testing.assert_array_equal(whole.host_ids, [11, 3, 60, 8, 0, 63])
    np.testing.assert_array_equal(
        whole.destinations(), whole.host_ids if direction is Direction.STORE else whole.dev_ids
    )
    assert (whole.nbytes, whole.items) == (sum(j.nbytes for j in jobs), sum(j.items for j in jobs))
    assert whole.jobs == 3  # the empty job moves nothing: a backend's average leaves it out
    general = CompactJob.concat([layout._job_general(direction, DeviceBlocks(d), HostBlocks(h)) for d, h in specs])
    np.testing.assert_array_equal(whole.blocks, general.blocks)  # the table it stands for
    want = [np.concatenate(parts) for parts in zip(*(descriptors(j) for j in jobs))]
    for got, expected in zip(descriptors(whole), want):
        np.testing.assert_array_equal(got, expected)
    for got, expected in zip(layout.segments(whole), layout.segments(general)):
        np.testing.assert_array_equal(got, expected)


def test_empty_jobs_join_as_an_empty_job_of_no_group():
    model = Model([16, 24], [[(0, 16)], [(1, 24)]], 2, 64, 64)
    layout = model.layout()
    empty = layout.job(Direction.STORE, DeviceBlocks([], [0, 0]), HostBlocks([]))
    whole = CompactJob.concat([empty, empty])
    assert not whole.simple and len(whole) == 0 and whole.groups == ()
    assert [a.size for a in layout.segments(whole)] == [0, 0, 0]


def _copies(layout, job, row_base=None):
    """A job's copies as a set of (device, host, size) rows: order aside."""
    return sorted(zip(*(a.tolist() for a in descriptors(job, row_base))))


@given(
    hosts=st.lists(st.integers(0, 63), min_size=1, max_size=40, unique=True),
    direction=st.sampled_from(list(Direction)),
    compiled=st.booleans(),
)
def test_a_job_in_host_order_makes_the_same_copies_in_no_more_runs(hosts, direction, compiled):
    """`in_host_order` permutes a simple job's blocks (device and host id together): the same
    copies to and from the host buffer, its staged run in no more segments, and where it sorts,
    the host ids ascending."""
    model = Model([16, 32], [[(0, 16), (1, 32)]], 1, 64, 64)  # whole 48-byte rows
    layout = compact_layout(model, compiled)
    job = layout.job(direction, DeviceBlocks(list(range(len(hosts)))), HostBlocks(hosts))
    ordered = job.in_host_order()
    assert _copies(layout, ordered) == _copies(layout, job)
    assert (ordered.nbytes, ordered.items, ordered.groups, ordered.jobs) == (job.nbytes, job.items, job.groups, 1)
    assert layout.segments(ordered)[2].size <= layout.segments(job)[2].size
    if ordered is not job:
        assert (np.diff(ordered.host_ids) > 0).all()
        assert layout.segments(ordered)[2].size < layout.segments(job)[2].size


@settings(max_examples=150, deadline=None)
@given(
    hosts=st.lists(st.integers(0, 1 << 40), min_size=0, max_size=300)
    | st.lists(st.integers(0, 300), min_size=0, max_size=300),
    runs=st.integers(0, 40),
)
def test_the_compiled_host_order_is_the_numpy_one(hosts, runs):
    """`_native.host_order` (a radix sort of one to four passes) against numpy's stable argsort:
    the same order, device ids moved with their host ids, and the same verdict on whether the
    sorted ids make fewer runs. Repeated ids (loads of one host block) keep their order."""
    compiled = compiled_or_skip(True)
    hosts = np.array(hosts + list(range(1000, 1000 + runs))[::-1], dtype=np.int64)  # and a run backwards
    devs = np.arange(hosts.size, dtype=np.int64) * 7 + 3
    out_hosts, out_devs = np.full_like(hosts, -1), np.full_like(devs, -1)
    fewer = compiled.host_order(hosts, devs, out_hosts, out_devs)
    order = np.argsort(hosts, kind="stable")

    def runs_of(h):
        return 1 + int(np.count_nonzero(np.diff(h) != 1)) if h.size else 0

    assert fewer == (runs_of(hosts[order]) < runs_of(hosts))
    if fewer:
        assert out_hosts.tolist() == hosts[order].tolist() and out_devs.tolist() == devs[order].tolist()
    with pytest.raises(ValueError, match="equal lengths"):
        compiled.host_order(hosts, devs[:-1] if devs.size else np.zeros(1, np.int64), out_hosts, out_devs)
    with pytest.raises(TypeError, match="int64"):
        compiled.host_order(hosts.astype(np.int32), devs, out_hosts, out_devs)
    if hosts.size:
        with pytest.raises(ValueError, match="overlaps"):
            compiled.host_order(hosts, devs, out_hosts, out_hosts)
        with pytest.raises(ValueError, match="overlaps"):
            compiled.host_order(hosts, devs, devs, out_devs)  # an output over an input


@pytest.mark.parametrize("n, top", [(1500, 1 << 33), (2048, 4096), (1025, 1 << 11)])
def test_the_compiled_host_order_sorts_large_launches_as_numpy_does(n, top):
    """Above 1024 ids the radix sort takes 11-bit digits: three passes (ending in its scratch
    memory), two, and one."""
    compiled = compiled_or_skip(True)
    rng = np.random.default_rng(n)
    hosts = rng.integers(0, top, n, dtype=np.int64)
    hosts[: n // 2] = np.arange(n // 2)[::-1]  # a run backwards, which sorting joins
    devs = rng.integers(0, 1 << 40, n, dtype=np.int64)
    out_hosts, out_devs = np.empty_like(hosts), np.empty_like(devs)
    assert compiled.host_order(hosts, devs, out_hosts, out_devs)
    order = np.argsort(hosts, kind="stable")
    assert (out_hosts == hosts[order]).all() and (out_devs == devs[order]).all()


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
def test_host_blocks_handed_out_backwards_stage_as_one_copy(compiled):
    """vLLM's CPU manager hands out fresh host blocks in order and reused ones off a free list,
    last freed first: a run backwards. In host order it is one segment, not one per row."""
    model = Model([16, 32], [[(0, 16), (1, 32)]], 1, 64, 64)
    layout = compact_layout(model, compiled)
    job = layout.job(Direction.STORE, DeviceBlocks([5, 9, 2, 30, 17, 11]), HostBlocks([25, 24, 23, 22, 21, 20]))
    assert layout.segments(job)[2].size == 6
    ordered = job.in_host_order()
    assert ordered.host_ids.tolist() == [20, 21, 22, 23, 24, 25] and ordered.dev_ids.tolist() == [11, 17, 30, 2, 9, 5]
    assert layout.segments(ordered)[2].tolist() == [6 * layout.row_bytes]
    after = layout.job(Direction.STORE, DeviceBlocks([40, 41]), HostBlocks([27, 26]))
    launch = CompactJob.concat([job, after]).in_host_order()  # as the queue sends a launch
    assert launch.host_ids.tolist() == [20, 21, 22, 23, 24, 25, 26, 27] and launch.jobs == 2
    already = layout.job(Direction.STORE, DeviceBlocks([1, 2]), HostBlocks([7, 8]))
    scattered = layout.job(Direction.STORE, DeviceBlocks([1, 2, 3]), HostBlocks([9, 3, 30]))
    assert already.in_host_order() is already and scattered.in_host_order() is scattered  # nothing to join


def test_only_simple_jobs_of_a_bounded_size_are_put_in_host_order():
    from offload_core.compact import SORTED_BLOCKS

    model = Model([16], [[(0, 16)]], 2, 64, 64)  # two blocks per chunk: not simple
    layout = model.layout()
    job = layout.job(Direction.STORE, DeviceBlocks([1, 2, 3, 4]), HostBlocks([9, 8]))
    assert not job.simple and job.in_host_order() is job
    n = SORTED_BLOCKS + 1
    model = Model([16], [[(0, 16)]], 1, n, n)
    layout = model.layout()
    backwards = np.arange(n)[::-1]
    job = layout.job(Direction.STORE, DeviceBlocks(np.arange(n)), HostBlocks(backwards))
    assert job.in_host_order() is job  # one more than is sorted
    shorter = layout.job(Direction.STORE, DeviceBlocks(np.arange(n - 1)), HostBlocks(backwards[1:]))
    assert shorter.in_host_order().host_ids.tolist() == list(range(n - 1))


def test_large_int32_specs_hold_an_immutable_int64_copy():
    """A spec of a million int32 ids (vLLM's) holds int64 ids equal to them that no one can
    change; a strided view too."""
    ids = np.random.default_rng(3).permutation(1 << 20).astype(np.int32)
    for caller in (ids, ids[::2]):
        spec = HostBlocks(caller)
        assert spec.block_ids.dtype == np.int64 and np.array_equal(spec.block_ids, caller)
        caller[:1] += 1  # the caller's array changes; the spec's copy does not
        assert spec.block_ids[0] == caller[0] - 1
        with pytest.raises(ValueError):
            spec.block_ids.setflags(write=True)


def test_large_specs_keep_an_immutable_copy_of_their_ids():
    ids = np.arange((4 << 20) // 8 + 1, dtype=np.int64)[::-1].copy()
    spec = DeviceBlocks(ids)
    ids[:] = -1  # the caller's array changes: the spec's ids do not
    assert spec.block_ids[0] == ids.size - 1 and not spec.block_ids.flags.writeable
    with pytest.raises(ValueError):
        spec.block_ids.flags.writeable = True
