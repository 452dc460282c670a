"""Runs: neighbouring copies that continue one another, found in one vectorised pass.

A job's host copies merge whole-page blocks that follow each other on both sides, a canonical
mapping joins fragments that continue on both sides, and the compact layout joins the host
ranges a job touches. One definition serves them all. The reference model
(`offload_core.testing.reference`) keeps its own, on purpose: a mistake here must not
hide in the model the layout is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def run_starts(sides: Sequence[np.ndarray], sizes: np.ndarray | int) -> np.ndarray:
    """The indices where runs start.

    Entry ``i`` continues entry ``i - 1`` where, on every side, its address is entry
    ``i - 1``'s plus entry ``i - 1``'s size.

    Args:
        sides: one or more int64 address arrays of one length (source and destination, say).
        sizes: the entries' sizes: an array of that length, or one int for every entry
            (which saves a pass).
    """
    n = sides[0].size
    new = np.empty(n, dtype=bool)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    new[0] = True
    rest = new[1:]
    uniform = np.ndim(sizes) == 0
    for k, a in enumerate(sides):
        step = a[1:] - a[:-1] if uniform else a[1:] - sizes[:-1]
        if k == 0:
            np.not_equal(step, sizes if uniform else a[:-1], out=rest)
        else:
            rest |= step != (sizes if uniform else a[:-1])
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
