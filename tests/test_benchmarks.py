"""The engine benchmark runs end to end on the cpu backend (a small shape): its rows hold every
figure the docs quote, and the bytes of the jobs it ran arrived."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from offload_core import get_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import engine_bench  # noqa: E402

pytestmark = pytest.mark.cpu


def test_an_engine_bench_row_holds_its_figures_and_its_bytes_arrived():
    row = engine_bench.run_shape(get_backend("cpu"), page=256, per_job=4, count=2, jobs=6)
    assert row["verified"] and row["store_ok"] and row["load_ok"]
    for direction in ("store", "load"):
        for figure in ("ratio", "submit_us_median", "jobs_per_launch", "buffer_waits", "device_busy"):
            assert f"{direction}_{figure}" in row
        assert row[f"{direction}_buffer_waits"] == 0  # the cpu backend never waits for a full buffer
