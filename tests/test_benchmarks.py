"""The engine benchmark runs end to end on the cpu backend (a small shape): its rows hold every
figure the docs quote, and the bytes of the jobs it ran arrived."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from offload_core import Direction, get_backend
from offload_core.backends.cpu import CpuBackend

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


def test_every_jobs_bytes_are_checked_not_only_the_last_ones(monkeypatch):
    """One byte of a host row that only a middle job writes (the measured pass's second store)
    goes wrong, in whichever launch moves that job."""
    stores: list[np.ndarray] = []  # each submitted store's host blocks, in order

    class Recording(engine_bench.OffloadWorker):
        def submit_store(self, job_id, device_blocks, host_blocks):
            stores.append(host_blocks.block_ids)
            return super().submit_store(job_id, device_blocks, host_blocks)

    class OneWrongByte(CpuBackend):
        stored = 0  # stores the launches so far moved

        def copy_blocks(self, job, prepared, stream, after):
            mechanism = super().copy_blocks(job, prepared, stream, after)
            if job.direction is Direction.STORE:
                first, OneWrongByte.stored = OneWrongByte.stored, OneWrongByte.stored + job.jobs
                if first <= 7 < OneWrongByte.stored:  # the warm-up pass stores 6 jobs
                    row = job.layout.host_base + int(stores[7][0]) * job.layout.row_bytes

                    def spoil():
                        ctypes.c_uint8.from_address(row).value ^= 0xFF

                    stream.launch(spoil)
            return mechanism

    monkeypatch.setattr(engine_bench, "OffloadWorker", Recording)
    row = engine_bench.run_shape(OneWrongByte(), page=256, per_job=4, count=2, jobs=6)
    assert OneWrongByte.stored >= 12 and row["store_ok"] and row["load_ok"]
    assert not row["verified"]


def test_backends_take_their_measured_passes_in_turn_each_with_its_own_bytes(monkeypatch):
    """`run_interleaved`: every backend warms up, then their measured passes alternate (a
    drifting host weighs on each alike), and each row's figures and bytes are its own."""
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 0)  # `passes` passes, however short
    log = []

    class Tagged(CpuBackend):
        def __init__(self, tag):
            super().__init__()
            self.tag = tag

        def copy_blocks(self, job, prepared, stream, after):
            log.append(self.tag)
            return super().copy_blocks(job, prepared, stream, after)

    rows = engine_bench.run_interleaved([Tagged("a"), Tagged("b")], page=256, per_job=4, count=2, jobs=6, passes=3)
    assert len(rows) == 2 and all(r["verified"] and r["store_ok"] and r["load_ok"] for r in rows)
    turns = [tag for i, tag in enumerate(log) if i == 0 or log[i - 1] != tag]
    # warm-up and pass 1 of each, then passes 2 and 3 in turn, each round begun by the next backend
    assert turns == ["a", "b", "a", "b"]  # a (warm-up, 1), b (warm-up, 1), b (2), a (2), a (3), b (3)


class StoresCounted(CpuBackend):
    """Counts the store jobs its launches moved; `tuner.timed` as cuda's `auto` keeps it, counting
    the launches of stores numbered `timed` (a range); launches of `slow` directions sleep."""

    def __init__(self, timed: range = range(0), slow: tuple = ()):
        super().__init__()
        self.stored, self.timed, self.slow = 0, timed, slow
        self._blocks = SimpleNamespace(tuner=SimpleNamespace(timed=0, _trials={}))

    def copy_blocks(self, job, prepared, stream, after):
        if job.direction is Direction.STORE:
            self.stored += job.jobs
        if self.stored in self.timed:  # a trial's timed launch, as a class met anew times some
            self._blocks.tuner.timed += 1
        if job.direction.value in self.slow:
            time.sleep(SLOW_S)
        return super().copy_blocks(job, prepared, stream, after)

    @property
    def passes(self) -> int:
        """Passes of 6 stores it ran, warm-up ones too."""
        return self.stored // 6


SLOW_S = 0.02  # a slow launch; MIN_MEASURED_S below it wants few passes of a slow backend


def test_the_warm_up_lasts_until_a_pass_times_no_launch(monkeypatch):
    """Launches join however many jobs wait, so a pass may meet a launch class the one before
    did not: the measured passes begin after a pass in which `auto` timed nothing."""
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 0)
    backend = StoresCounted(timed=range(1, 3 * 6 + 1))  # the first three passes' stores time launches
    row = engine_bench.run_shape(backend, page=256, per_job=4, count=2, jobs=6, passes=3)
    assert row["trial_launches_measured"] == 0 and row["verified"]
    assert backend.passes == 4 + 3  # three passes timed, one did not, then the measured three


def test_a_class_still_on_trial_that_no_pass_meets_holds_up_no_warm_up(monkeypatch):
    """A class an earlier shape left on trial (or a rare one) that this shape's passes do not
    meet: the first pass timed nothing, so the measured passes begin after it."""
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 0)
    backend = StoresCounted()
    backend.trials_pending = lambda: 1
    row = engine_bench.run_shape(backend, page=256, per_job=4, count=2, jobs=6, passes=3)
    assert backend.passes == 1 + 3 and row["trials_pending"] == 1 and row["trial_launches_measured"] == 0


def test_launches_timed_in_the_measured_passes_are_counted(monkeypatch):
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 0)
    backend = StoresCounted(timed=range(2 * 6 + 1, 3 * 6 + 1))  # the second measured pass meets a new class
    row = engine_bench.run_shape(backend, page=256, per_job=4, count=2, jobs=6, passes=3)
    assert row["trial_launches_measured"] > 0 and backend.passes == 1 + 3


def test_short_passes_are_measured_more_times(monkeypatch):
    monkeypatch.setattr(engine_bench, "MAX_PASSES", 5)
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 3600)  # no pass lasts that long
    backend = StoresCounted()
    engine_bench.run_shape(backend, page=256, per_job=4, count=2, jobs=6, passes=3)
    assert backend.passes == 1 + 5
    monkeypatch.setattr(engine_bench, "MAX_MEASURED_S", 0)  # a backend whose passes took that long: `passes`
    backend = StoresCounted()
    engine_bench.run_shape(backend, page=256, per_job=4, count=2, jobs=6, passes=3)
    assert backend.passes == 1 + 3
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 0)
    monkeypatch.setattr(engine_bench, "MAX_MEASURED_S", 3600)
    backend = StoresCounted()
    engine_bench.run_shape(backend, page=256, per_job=4, count=2, jobs=6, passes=3)
    assert backend.passes == 1 + 3


def test_the_shorter_direction_sets_the_passes(monkeypatch):
    """A pass of slow stores and quick loads: the loads, short, want more passes."""
    monkeypatch.setattr(engine_bench, "MAX_PASSES", 4)
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 1.5 * SLOW_S)
    backend = StoresCounted(slow=("store",))
    engine_bench.run_shape(backend, page=256, per_job=4, count=2, jobs=6, passes=2)
    assert backend.passes == 1 + 4


def test_interleaved_backends_take_as_many_passes_as_the_one_that_wants_most(monkeypatch):
    """A slow backend (its passes want fewer) measures as many passes as a quick one beside it,
    in turn with it."""
    monkeypatch.setattr(engine_bench, "MAX_PASSES", 4)
    monkeypatch.setattr(engine_bench, "MIN_MEASURED_S", 1.5 * SLOW_S)
    slow, quick = StoresCounted(slow=("store", "load")), StoresCounted()
    engine_bench.run_interleaved([slow, quick], page=256, per_job=4, count=2, jobs=6, passes=2)
    assert slow.passes == quick.passes == 1 + 4


def test_the_last_writer_of_each_block_is_the_one_compared():
    written, source = engine_bench._last_writers(
        [np.array([3, 1]), np.array([1, 2]), np.array([3])], [np.array([10, 11]), np.array([12, 13]), np.array([14])]
    )
    assert written.tolist() == [1, 2, 3] and source.tolist() == [12, 13, 14]


def test_auto_vs_best_compares_auto_with_the_best_forced_mechanism_per_shape_and_direction():
    import auto_vs_best

    def row(mechanism, page, store, load, chose=None, link=50.0):
        return {
            "mechanism": mechanism,
            "tensors": 64,
            "page": page,
            "job_bytes": 4 << 20,
            "host_runs": False,
            "store_wall_gbps": store * 50.0,
            "load_wall_gbps": load * 50.0,
            "store_limit_gbps": link,  # each row's own figure for the link
            "load_limit_gbps": link,
            "store_mechanisms": [chose or mechanism],
            "load_mechanisms": [chose or mechanism],
        }

    rows = [
        row("auto", 4096, 0.90, 0.50, chose="expand_staged"),
        row("expand_staged", 4096, 0.90, 0.50),
        row("expand_direct", 4096, 0.80, 0.75),
        row("ce_batch", 4096, 0.85, 0.30, link=30.0),  # a link measured low: its rates still lose
        row("auto", 256, 0.2, 0.2),  # no forced mechanism beside it: not a cell
    ]
    cells = auto_vs_best.cells(rows)
    assert [(c[1], c[2], c[3], c[4], c[5]) for c in cells] == [
        ("store", 0.90, "expand_staged", "expand_staged", 0.90),
        ("load", 0.50, "expand_staged, SMs spared: expand_direct holds them 0.11 ms a launch", "expand_direct", 0.75),
    ]
    assert [c[8] for c in cells] == [1.0, pytest.approx(0.50 / 0.75)]  # auto's choice forced, against the best
    rows[0]["store_mechanisms"] = ["expand_staged", "ce_batch"]  # two in its measured passes: the slower counts
    assert auto_vs_best.cells(rows)[0][8] == pytest.approx(0.85 / 0.90)
    rows[0]["store_mechanisms"] = ["expand_staged", "sm_gather"]  # one without a forced row: no figure
    assert auto_vs_best.cells(rows)[0][8] is None
    rows[0]["store_mechanisms"] = ["expand_staged"]
    rows[0]["trial_launches_measured"] = 2  # its measured passes timed trial launches
    assert all("still on trial" in c[3] for c in auto_vs_best.cells(rows))
    rows[0]["trial_launches_measured"] = 0
    rows[0]["trials_pending"] = 1  # a class on trial that its measured passes did not meet
    assert not any("still on trial" in c[3] for c in auto_vs_best.cells(rows))
    # the best on the SMs for a whole launch of SM_HOLD_S or more: auto's copy engines are by design
    for r in rows:
        r.update(load_jobs_per_launch=4.0)  # 16 MiB launches: 0.45 ms at 0.75 of 50 GB/s
    (load,) = [c for c in auto_vs_best.cells(rows) if c[1] == "load"]
    assert "SMs spared: expand_direct holds them 0.45 ms a launch" in load[3]
    assert load[6] == pytest.approx(1.0)  # weighed as auto weighs it, expand_direct's 0.75 counts 0.375
    rows[0]["load_mechanisms"] = ["expand_direct"]
    (load,) = [c for c in auto_vs_best.cells(rows) if c[1] == "load"]
    assert "SMs spared" not in load[3]
    assert load[6] == pytest.approx(0.5)  # auto's own launches on the SMs weigh the same
    for r in rows:
        r["load_device_busy"] = 0.4  # bound by the host: 0.18 ms of device a launch, weighed 0.36, under the wall's
    (load,) = [c for c in auto_vs_best.cells(rows) if c[1] == "load"]
    assert load[6] == pytest.approx(0.50 / 0.75)
    assert load[7] == "-"
    rows.append(row("auto-sm1", 4096, 0.90, 0.72, chose="expand_direct"))  # auto by speed alone: its own column
    (load,) = [c for c in auto_vs_best.cells(rows) if c[1] == "load"]
    assert load[7] == "0.96 (expand_direct)" and load[4] == "expand_direct"


def test_auto_vs_best_sorts_the_misses_as_the_docs_do():
    from auto_vs_best import miss_kind

    def cell(chose, best="expand_direct"):
        return (None, "store", 0.5, chose, best, 0.9, 0.5, "-", None)

    assert miss_kind(cell("expand_staged, SMs spared: expand_direct holds them 0.45 ms a launch")) == "spared"
    assert miss_kind(cell("expand_direct/expand_staged")) == "two"
    assert miss_kind(cell("expand_direct, still on trial")) == "two"
    assert miss_kind(cell("expand_direct")) == "own"
    assert miss_kind(cell("ce_batch")) == "other"


def test_serve_times_the_decode_steps_while_stores_run_against_those_after():
    """benchmarks/vllm/serve.py's decode figure: the first steps that decode only (after the
    longer prefill steps) against the last ones, from the times each engine step returned."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "vllm"))
    import serve

    gaps = [120, 110, 100] + [15] * serve.DECODE_EARLY + [10] * 50  # prefill, decode beside the stores, decode
    early, late = serve.step_ms(list(np.cumsum([0.0] + gaps) / 1e3))
    assert early == pytest.approx(15) and late == pytest.approx(10)


def test_the_soak_times_how_long_a_file_left_behind_stays_locked(tmp_path):
    """How a region left behind is told apart: a lock freed later (by a process that outlived
    its holder) gives the seconds; one still held gives None."""
    import fcntl
    import threading

    import soak_rounds

    path = tmp_path / "left.shm"
    path.write_bytes(b"x")
    holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    assert soak_rounds._freed_after([str(path), str(tmp_path / "gone.shm")], within=0.05) == [None, "gone"]
    threading.Timer(0.05, os.close, (holder,)).start()
    (freed,) = soak_rounds._freed_after([str(path)], within=5.0)
    assert 0.03 < freed < 4.0


def test_the_gpu_only_benchmarks_import_on_any_machine():
    """They run only on a GPU (gpu_check.sh): a broken import would first show there."""
    import canonical_bench  # noqa: F401
    import launch_steps  # noqa: F401
    import transfer_bench  # noqa: F401


def test_the_queue_simulation_runs_its_passes_within_its_devices_rate(monkeypatch, capsys):
    import queue_sim

    args = ["queue_sim.py", "--blocks-per-job", "64", "--jobs", "8", "--passes", "2", "--launch-us", "1"]
    monkeypatch.setattr(sys, "argv", [*args, "--per-job-us", "1", "--gbps", "1"])
    queue_sim.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["pass 0", "pass 1"]
    assert all(float(line.split()[2]) <= 1.0 for line in lines)  # GB/s of a 1 GB/s device
    # as an engine submits: 2 jobs a 1 ms step; every job's bytes moved after its submit
    monkeypatch.setattr(sys, "argv", [*args, "--per-job-us", "1", "--gbps", "1", "--per-step", "2", "--step-ms", "1"])
    queue_sim.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["pass 0", "pass 1"]
    assert all(float(line.split("latency ")[1].split()[0]) > 0 for line in lines)


def test_the_queue_simulation_lets_the_tuner_choose_among_simulated_mechanisms(monkeypatch, capsys):
    import queue_sim

    from offload_core.backends.cuda import tuning

    args = ["queue_sim.py", "--blocks-per-job", "64", "--jobs", "16", "--passes", "4", "--launch-us", "1"]
    # "slow" is slower on the host and on the device: it is tried, and the shape's class goes to
    # "fast" (launches that join a larger share of the small pool may sort into runs: a class of
    # their own, on trial a while)
    monkeypatch.setattr(sys, "argv", [*args, "--candidates", "slow:200:20:1,fast:5:1:2"])
    queue_sim.main()
    lines = capsys.readouterr().out.splitlines()
    assert "GB/s of 2;" in lines[0] and "'slow'" in lines[0]  # against the fastest device; a trial
    winners = eval(lines[-1].split("classes: ")[1].split(" still")[0])  # noqa: S307 (the script's own dict)
    assert f"{tuning.RULES}/store:8:8:7:0" in winners and set(winners.values()) == {"fast"}
