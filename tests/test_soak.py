"""A short soak: threads submitting, waiting and polling, injected faults, shutdowns at random
moments; every byte checked (`benchmarks/soak_rounds.py`; `benchmarks/soak.py` runs it longer)."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from soak_rounds import soak  # noqa: E402

pytestmark = pytest.mark.cpu


def test_short_soak_loses_nothing_and_reports_each_job_once():
    report = soak(rounds=8, round_seconds=0.15, seed=1)
    assert report.clean, report
    # the soak did what it claims: faults injected both ways, jobs failed by them
    assert report.injected.get("enqueue") and report.injected.get("device") and report.failed_jobs, report
    assert report.accepted == report.reported
    assert report.checked_bytes > 0


def test_ranks_crashing_and_restarting_keep_sharing_one_region():
    from soak_rounds import region_soak

    report = region_soak(cycles=4, ranks=2, crash_share=0.3, seed=2)
    assert report.clean, report
    assert report.crashes >= 1  # the founding rank dies holding the region, every time
    assert report.cycles == 8


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_a_file_left_behind_names_the_processes_that_have_it_open_or_mapped(tmp_path):
    # /proc/locks alone misses a lock whose locking process died (in a pid namespace), though a
    # process it forked may keep the lock: the report also names who has the file open or mapped.
    from soak_rounds import _lock_holders

    path = tmp_path / "left.shm"
    path.write_bytes(bytes(mmap.PAGESIZE))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE):
        holders = _lock_holders(str(path))
    assert any(h.startswith(f"{os.getpid()} fd ") for h in holders), holders
    assert any(h.startswith(f"{os.getpid()} map ") for h in holders), holders
    assert _lock_holders(str(path)) == []
