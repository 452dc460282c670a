"""`offload_core.runs` against a loop that merges one entry at a time."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from offload_core.runs import merge_runs, run_starts


def loop_merge(sides, sizes):
    """Each entry joins the run before it where, on every side, it starts where that run ends."""
    runs = []  # [addresses of the first entry per side, bytes]
    for i in range(len(sizes)):
        if runs and all(a[i] == first + runs[-1][1] for a, first in zip(sides, runs[-1][0])):
            runs[-1][1] += sizes[i]
        else:
            runs.append([[a[i] for a in sides], sizes[i]])
    return runs


entries = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 3)), max_size=40)


@given(entries, st.integers(1, 2), st.booleans())
def test_runs_match_a_loop(steps, nsides, uniform):
    """Addresses that mostly continue the previous entry (gap 0), sometimes jump or go back."""
    sizes = [4 if uniform else s for _, _, s in steps]
    sides = []
    for k in range(nsides):
        addresses, at = [], 100
        for (gap_a, gap_b, _), size in zip(steps, sizes):
            gap = (gap_a, gap_b)[k]
            at += (0, 0, 8, -12)[gap]
            addresses.append(at)
            at += size
        sides.append(np.array(addresses, dtype=np.int64))
    arg = 4 if uniform else np.array(sizes, dtype=np.int64)
    expected = loop_merge(sides, sizes)
    *firsts, run_bytes = merge_runs(sides, arg)
    assert [[int(a[j]) for a in firsts] for j in range(len(run_bytes))] == [r[0] for r in expected]
    assert run_bytes.tolist() == [r[1] for r in expected]
    assert run_starts(sides, arg).size == len(expected)


def test_host_contiguous_runs_of_equal_sizes():
    host = np.array([100, 132, 164, 500, 532, 900], dtype=np.int64)
    assert run_starts((host,), 32).tolist() == [0, 3, 5]
    assert run_starts((host,), np.full(6, 32)).tolist() == [0, 3, 5]
    assert run_starts((host[:0],), 32).tolist() == []
