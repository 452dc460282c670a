"""Runs: neighbouring copies that continue one another, found in one vectorised pass.

Host copies of a job, a canonical mapping's fragments and the compact layout's segments all
merge runs here. The reference model (`offload_core.testing.reference`) keeps its own, on
purpose: a mistake here must not hide in the model the layout is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def run_starts(sides: Sequence[np.ndarray], sizes: np.ndarray | int) -> np.ndarray:
    """The indices where runs start: entry ``i`` continues entry ``i - 1`` where, on every side,
    its address is entry ``i - 1``'s plus entry ``i - 1``'s size.

    Args:
        sides: one or more int64 address arrays of one length (source and destination, say).
        sizes: the entries' sizes: an array of that length, or one int for every entry.
    """
    n = sides[0].size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    step = sizes if np.ndim(sizes) == 0 else sizes[:-1]
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(sides[0][1:], sides[0][:-1] + step, out=new[1:])
    for a in sides[1:]:
        new[1:] |= a[1:] != a[:-1] + step
    return new.nonzero()[0]


def merge_runs(sides: Sequence[np.ndarray], sizes: np.ndarray | int) -> tuple[np.ndarray, ...]:
    """Each run as one entry: every side's address of its first entry, then its bytes
    (``(*sides, sizes)``; arguments as `run_starts`)."""
    starts = run_starts(sides, sizes)
    if np.ndim(sizes) == 0:
        run_bytes = np.diff(np.append(starts, sides[0].size)) * int(sizes)
    else:
        run_bytes = np.add.reduceat(sizes, starts) if starts.size else np.zeros(0, dtype=np.int64)
    return (*(a[starts] for a in sides), run_bytes)
