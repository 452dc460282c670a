"""`auto` by measurement (`backends/cuda/tuning.py`): the choosing logic against injected
timings. No GPU: the tuner sees only names, bytes and seconds."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from offload_core import DeviceBlocks, Direction, HostBlocks
from offload_core.backends.cuda import tuning
from offload_core.backends.cuda.tuning import ShapeClass, Timings, Tuner, candidates, in_runs, shape_class

SCATTERED = np.random.default_rng(0).permutation(1 << 16)[:1024]
RUN = np.arange(1000, 1064)
KEY = shape_class("store", 4096, 4096 * 64, 4 << 20, False)


def run_trial(tuner: Tuner, key: ShapeClass, names: list[str], seconds: dict[str, float], nbytes: int = 1 << 20):
    """Launch until the class is decided, each launch of `name` taking `seconds[name]` on the
    device (and a tenth of it on the host); returns the picks in order."""
    picks = []
    for _ in range(10 * len(names) * tuning.TRIALS):
        name, timed = tuner.pick(key, names)
        picks.append((name, timed))
        if not timed:
            return picks
        tuner.observe(key, name, nbytes, seconds[name] / 10, seconds[name])
    raise AssertionError(f"no decision after {len(picks)} launches")


def test_the_class_tries_each_candidate_then_keeps_the_fastest():
    tuner = Tuner()
    names = ["expand_staged", "expand_direct", "ce_batch"]
    picks = run_trial(tuner, KEY, names, {"expand_staged": 1.5, "expand_direct": 1.0, "ce_batch": 1.8})
    timed = [n for n, t in picks if t]
    assert timed[0] == "expand_staged"  # the cost model's pick goes first
    assert sorted(timed) == sorted(names * tuning.TRIALS)
    assert tuner.timed == len(timed)  # what a benchmark's warm-up waits on
    assert picks[-1] == ("expand_direct", False)
    assert tuner.pick(KEY, names) == ("expand_direct", False)
    assert tuner.winners() == {KEY.name(): "expand_direct"}


def test_a_challenger_within_the_margin_leaves_the_prior():
    tuner = Tuner()
    names = ["expand_staged", "expand_direct"]
    near = 1.0 - tuning.MARGIN / 2
    run_trial(tuner, KEY, names, {"expand_staged": 1.0, "expand_direct": near})
    assert tuner.pick(KEY, names) == ("expand_staged", False)


def test_the_host_time_counts_where_it_exceeds_the_device_time():
    tuner = Tuner()
    names = ["expand_staged", "expand_direct"]
    for _ in range(len(names) * tuning.TRIALS):
        name, timed = tuner.pick(KEY, names)
        assert timed
        # expand_staged: fast on the device, slow on the host (a batched copy per host row)
        host, device = (3.0, 1.0) if name == "expand_staged" else (2.0, 2.0)
        tuner.observe(KEY, name, 1 << 20, host, device)
    assert tuner.pick(KEY, names) == ("expand_direct", False)


@pytest.mark.parametrize(
    "costs, winner",
    [
        ({"expand_staged": [1.0, 9.0, 1.0], "expand_direct": [2.0, 2.0, 2.0]}, "expand_staged"),
        # the first launch of a kernel compiles it: slow once (struck off by none), then fastest
        ({"expand_staged": [1.0, 1.0, 1.0], "expand_direct": [50.0, 0.5, 0.5]}, "expand_direct"),
    ],
    ids=["the median decides", "a compile strikes nothing"],
)
def test_one_slow_launch_neither_decides_nor_strikes(costs, winner):
    tuner = Tuner()
    names = list(costs)
    left = {n: iter(c) for n, c in costs.items()}
    while True:
        name, timed = tuner.pick(KEY, names)
        if not timed:
            break
        tuner.observe(KEY, name, 1 << 20, 0.0, next(left[name]))
    assert name == winner


def test_a_candidate_far_off_the_best_leaves_after_two_launches():
    tuner = Tuner()
    names = ["expand_staged", "expand_direct", "ce_batch"]
    slow = tuning.STRIKE * 1.5
    picks = run_trial(tuner, KEY, names, {"expand_staged": 1.0, "expand_direct": 1.2, "ce_batch": slow})
    timed = [n for n, t in picks if t]
    assert timed.count("ce_batch") == 2
    assert timed.count("expand_staged") == timed.count("expand_direct") == tuning.TRIALS
    assert tuner.pick(KEY, names) == ("expand_staged", False)


def test_a_struck_prior_leaves_the_choice_to_the_measured_best():
    """The cost model's pick measured far off (its figures came from another GPU): the
    fastest of the rest wins, however near the others are to each other."""
    tuner = Tuner()
    names = ["expand_staged", "ce_batch", "expand_direct"]
    near = 1.0 - tuning.MARGIN / 2
    run_trial(tuner, KEY, names, {"expand_staged": 3 * tuning.STRIKE, "ce_batch": near, "expand_direct": 1.0})
    assert tuner.pick(KEY, names) == ("ce_batch", False)


def test_launches_faster_than_their_timings_go_untimed_to_the_prior_meanwhile():
    """Timings arrive launches later (once their events pass): a candidate gets at most
    `TRIALS` timed launches in flight, however many launches come before they are observed."""
    tuner = Tuner()
    names = ["expand_staged", "expand_direct"]
    picks = [tuner.pick(KEY, names) for _ in range(20)]  # a burst: nothing observed yet
    timed = [n for n, t in picks if t]
    assert sorted(timed) == sorted(names * tuning.TRIALS)
    assert all(p == ("expand_staged", False) for p in picks[len(timed) :])
    for name in timed:
        tuner.observe(KEY, name, 1 << 20, 0.0, 1.0 if name == "expand_direct" else 2.0)
    assert tuner.pick(KEY, names) == ("expand_direct", False) and tuner.undecided() == 0


def test_a_timing_lost_to_a_fault_is_taken_again():
    tuner = Tuner()
    names = ["expand_staged", "expand_direct"]
    timed = [tuner.pick(KEY, names) for _ in range(2 * tuning.TRIALS)]
    tuner.dropped(KEY, timed[0][0])  # its events reported a fault
    for name, _ in timed[1:]:
        tuner.observe(KEY, name, 1 << 20, 0.0, 1.0)
    assert tuner.pick(KEY, names) == (timed[0][0], True)  # tried again, not stuck


def test_no_room_for_a_timing_sends_the_launch_to_the_prior_untimed():
    tuner = Tuner()
    assert tuner.pick(KEY, ["expand_staged", "expand_direct"], can_time=False) == ("expand_staged", False)
    assert [tuner.pick(KEY, ["expand_staged", "expand_direct"])[1] for _ in range(2 * tuning.TRIALS)] == [True] * 6


def test_a_class_left_with_one_candidate_ends_its_trial():
    tuner = Tuner()
    assert tuner.pick(KEY, ["expand_staged", "expand_direct"])[1]
    assert tuner.pick(KEY, ["ce_batch"]) == ("ce_batch", False)
    assert tuner.undecided() == 0


def test_one_candidate_is_never_timed():
    assert Tuner().pick(KEY, ["ce_batch"]) == ("ce_batch", False)


def test_classes_are_decided_apart():
    tuner = Tuner()
    names = ["expand_staged", "expand_direct"]
    other = KEY._replace(direction="load")
    run_trial(tuner, KEY, names, {"expand_staged": 2.0, "expand_direct": 1.0})
    assert tuner.pick(other, names) == ("expand_staged", True)


def test_a_saved_winner_that_is_no_candidate_here_is_tried_again():
    tuner = Tuner()
    run_trial(tuner, KEY, ["expand_staged", "expand_direct"], {"expand_staged": 2.0, "expand_direct": 1.0})
    # the host rows of another worker are not addressable: expand_direct is no candidate there
    assert tuner.pick(KEY, ["expand_staged", "ce_batch"]) == ("expand_staged", True)


def test_winners_persist_per_file_and_merge(tmp_path):
    path = tmp_path / "tuned.json"
    first = Tuner(path)
    run_trial(first, KEY, ["expand_staged", "expand_direct"], {"expand_staged": 2.0, "expand_direct": 1.0})
    other = KEY._replace(job=KEY.job + 1)
    second = Tuner(path)  # another process, started before the first decided its class
    run_trial(second, other, ["expand_staged", "ce_batch"], {"expand_staged": 1.0, "ce_batch": 3.0})
    saved = json.loads(path.read_text())["winners"]
    assert saved == {KEY.name(): "expand_direct", other.name(): "expand_staged"}
    third = Tuner(path)
    assert third.pick(KEY, ["expand_staged", "expand_direct"]) == ("expand_direct", False)


def test_names_another_version_wrote_are_kept_not_read(tmp_path):
    """Winners measured under other rules (older fields, or the same fields decided otherwise:
    `RULES`) are left to the versions that wrote them."""
    path = tmp_path / "tuned.json"
    fields = KEY.name().partition("/")[2]
    older = {"store:12:15:9:0": "ce_batch", fields: "expand_direct", f"{tuning.RULES - 1}/{fields}": "ce_batch"}
    path.write_text(json.dumps({"winners": {KEY.name(): "expand_staged", **older}}))
    tuner = Tuner(path)
    assert tuner.winners() == {KEY.name(): "expand_staged"}
    other = KEY._replace(job=KEY.job + 1)
    run_trial(tuner, other, ["expand_staged", "expand_direct"], {"expand_staged": 1.0, "expand_direct": 1.5})
    saved = json.loads(path.read_text())["winners"]
    assert saved == {**older, KEY.name(): "expand_staged", other.name(): "expand_staged"}


def test_an_unreadable_file_is_ignored(tmp_path, caplog):
    path = tmp_path / "tuned.json"
    path.write_text("{not json")
    tuner = Tuner(path)
    assert tuner.pick(KEY, ["expand_staged", "expand_direct"]) == ("expand_staged", True)
    assert "unreadable" in caplog.text


@pytest.mark.parametrize("make", ["deep", "fifo"])
def test_a_profile_that_is_no_winners_file_is_ignored(tmp_path, caplog, make):
    """Nesting too deep for the parser, or a FIFO (whose read would block): measured again."""
    import os

    path = tmp_path / "tuned.json"
    if make == "deep":
        path.write_text("[" * 100_000)
    else:
        os.mkfifo(path)
    tuner = Tuner(path)
    assert tuner.pick(KEY, ["expand_staged", "expand_direct"]) == ("expand_staged", True)
    assert "unreadable" in caplog.text


def test_a_measured_winner_outlives_a_launch_that_offers_one_other_candidate(tmp_path):
    path = tmp_path / "tuned.json"
    tuner = Tuner(path)
    run_trial(tuner, KEY, ["expand_staged", "expand_direct"], {"expand_staged": 2.0, "expand_direct": 1.0})
    assert tuner.pick(KEY, ["ce_batch"]) == ("ce_batch", False)  # this launch cannot take the winner
    assert tuner.pick(KEY, ["expand_staged", "expand_direct"]) == ("expand_direct", False)
    other = KEY._replace(job=KEY.job + 1)
    run_trial(tuner, other, ["expand_staged", "ce_batch"], {"expand_staged": 1.0, "ce_batch": 3.0})
    assert json.loads(path.read_text())["winners"] == {KEY.name(): "expand_direct", other.name(): "expand_staged"}


def test_a_class_measured_after_a_one_candidate_launch_is_saved(tmp_path):
    path = tmp_path / "tuned.json"
    tuner = Tuner(path)
    assert tuner.pick(KEY, ["expand_direct"]) == ("expand_direct", False)
    run_trial(tuner, KEY, ["expand_staged", "ce_batch"], {"expand_staged": 1.0, "ce_batch": 3.0})
    assert json.loads(path.read_text())["winners"] == {KEY.name(): "expand_staged"}


def test_candidates_are_those_the_cost_model_rates_near_its_pick():
    estimates = {"expand_staged": 1.0, "expand_direct": 1.5, "ce_batch": tuning.WITHIN * 1.01, "ce_loop": 0.9}
    assert candidates(estimates, "expand_staged") == ["expand_staged", "ce_loop", "expand_direct"]


def test_shape_classes_bucket_what_decides():
    a = shape_class("load", 4096, 1 << 18, 4 << 20, False)
    assert a == ShapeClass("load", 12, 18, 11, False)
    assert shape_class("load", 4096, 1 << 18, 5 << 20, False) == a  # powers of 4
    assert ShapeClass.parse(a.name()) == a
    assert in_runs(RUN) and not in_runs(SCATTERED)


def test_runs_are_read_from_the_first_host_ids_only():
    # looked up every launch: the ids past the sample cannot change the class (nor cost its time)
    assert in_runs(np.concatenate([RUN, SCATTERED]))
    # runs of two blocks: as many runs as half the ids, not fewer
    pairs = (np.arange(32)[:, None] * 10 + np.arange(2)).ravel()
    assert not in_runs(pairs)
    # the sample is RUNS_SAMPLE ids and one: the 65th continuing the last pair tips it
    assert in_runs(np.append(pairs, pairs[-1] + 1))
    threes = (np.arange(32)[:, None] * 10 + np.arange(3)).ravel()
    assert in_runs(threes)
    assert not in_runs(RUN[:1])


def test_small_jobs_joined_are_read_as_one_alone():
    # one block a job, the engine handing out consecutive host blocks: four joined run on, one
    # alone cannot; the sample reads one job's worth, so both are one class
    assert in_runs(RUN[:4]) and not in_runs(RUN[:4], jobs=4) and not in_runs(RUN[:1])
    assert in_runs(RUN, jobs=2)  # 32 a job: read


def test_names_of_other_rules_are_refused():
    with pytest.raises(ValueError, match="rules"):
        ShapeClass.parse(f"{tuning.RULES - 1}/store:12:18:11:0:12")  # the older fields, launch size last
    with pytest.raises(ValueError):
        ShapeClass.parse(f"{tuning.RULES}/store:12:18:11:0:12")  # this rule, a field too many


class Event:
    def __init__(self, passed=True, fault=False, ms=1.0):
        self.passed, self.fault, self.ms = passed, fault, ms

    def query(self):
        if self.fault:
            raise RuntimeError("device fault")
        return self.passed

    def elapsed_time(self, end):
        return end.ms


def test_timings_reach_the_tuner_once_their_events_passed():
    seen = []

    class Recorder(Tuner):
        def observe(self, key, name, nbytes, host_s, device_s):
            seen.append((name, nbytes, host_s, device_s))

    timings = Timings(Recorder())
    late = Event(passed=False, ms=4.0)
    timings.add(KEY, "a", 1, 0.5, Event(), Event(ms=2.0))
    timings.add(KEY, "b", 2, 0.5, Event(), Event(fault=True))  # no timing from a fault
    timings.add(KEY, "c", 3, 0.5, Event(), late)
    timings.add(KEY, "d", 4, 0.5, Event(), Event(ms=1.0))  # after c, in order
    timings.collect()
    assert seen == [("a", 1, 0.5, 0.002)]
    late.passed = True
    timings.collect()
    assert seen == [("a", 1, 0.5, 0.002), ("c", 3, 0.5, 0.004), ("d", 4, 0.5, 0.001)]


def test_a_timing_counts_as_weighed_and_logs_both(caplog):
    """The tuner gets the weighed time; the log shows the measured one beside it (a log that
    showed only the weighed time once read as a launch twice as slow)."""
    seen = []

    class Recorder(Tuner):
        def observe(self, key, name, nbytes, host_s, device_s):
            seen.append(device_s)

    timings = Timings(Recorder(), weigh=lambda name, device_s: 2 * device_s)
    timings.add(KEY, "a", 1, 0.0, Event(), Event(ms=2.0))
    with caplog.at_level(logging.DEBUG, logger=tuning.__name__):
        timings.collect()
    assert seen == [0.004]
    assert "device 2000 us (counted as 4000 us)" in caplog.text


def test_timings_room_is_bounded():
    timings = Timings(Tuner())
    for _ in range(tuning.MAX_PENDING):
        assert timings.room()
        timings.add(KEY, "a", 1, 0.0, Event(), Event(passed=False))
    assert not timings.room()


@pytest.mark.parametrize("seconds", [{"expand_staged": 1.0, "expand_direct": 1.0}])
def test_a_tie_keeps_the_prior(seconds):
    tuner = Tuner()
    run_trial(tuner, KEY, ["expand_staged", "expand_direct"], seconds)
    assert tuner.pick(KEY, ["expand_staged", "expand_direct"])[0] == "expand_staged"


# ---- wired into the copier: `BlockCopier.copy` under auto -----------------------------------


class Clock:
    """The device's clock as the stub mechanisms advance it; events read it when recorded."""

    now = 0.0


class HostClock:
    """The host's clock for `copier_over_stubs`' trials, as a test moves it."""

    now = 0.0


class TimedEvent:
    def record(self, stream):
        self.t = Clock.now

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def copier_over_stubs(monkeypatch, seconds: dict[str, float]):
    """A BlockCopier whose mechanisms note their name and take `seconds[name]` of device time,
    over a real worker layout (8 tensors of 4 KiB pages, host rows addressable)."""

    from helpers import small_kv

    from offload_core import OffloadWorker
    from offload_core.backends.cuda import blocks
    from offload_core.backends.cuda.select import CostModel

    ran = []
    for mechanism in (blocks.EXPAND_STAGED, blocks.EXPAND_DIRECT, blocks.HOST_EXPANDED):

        def enqueue_job(copier, job, prepared, segments, stream, after, held, name=mechanism.name):
            ran.append(name)
            Clock.now += seconds[name]

        monkeypatch.setattr(mechanism, "enqueue_job", enqueue_job)
    # The host's clock is a stub's too (still unless a test moves it): a trial counts the longer
    # of host and device time, and a loaded machine's real enqueue outlasts launches of microseconds.
    monkeypatch.setattr(HostClock, "now", 0.0)
    monkeypatch.setattr(blocks, "time", SimpleNamespace(perf_counter=lambda: HostClock.now))
    backend = SimpleNamespace(
        cost=CostModel(), new_event=TimedEvent, addressable=lambda *a: True, available_mechanisms=("ce_batch",)
    )
    copier = blocks.BlockCopier(backend, 16 << 20, Tuner())
    side = SimpleNamespace(waited=[])
    side.wait_event = side.waited.append  # a staged trial's side stream waits for its start event
    copier.staging = SimpleNamespace(for_stream=lambda stream: SimpleNamespace(side=side))
    copier.side = side
    worker = OffloadWorker(small_kv(pages=(4096,) * 8, blocks=64), 64, backend="cpu")
    layout = worker._layout
    prepared = SimpleNamespace(layout=layout, direct_ok=True, whole_rows={d: True for d in Direction}, decided={})
    return copier, layout, prepared, ran, worker


@pytest.mark.parametrize(
    "fast, unit, winner",
    [
        ("expand_staged", 1e-5, "expand_staged"),
        ("expand_direct", 1e-5, "expand_direct"),
        # launches of a millisecond: expand_direct's, holding SMs all along, count its penalty
        ("expand_direct", 1e-3, "expand_staged"),
    ],
)
def test_auto_runs_the_trials_then_the_winner(monkeypatch, fast, unit, winner):
    seconds = {"expand_staged": 1.5 * unit, "expand_direct": 1.5 * unit, "ce_batch": 1.8 * unit, fast: unit}
    copier, layout, prepared, ran, worker = copier_over_stubs(monkeypatch, seconds)
    with worker:
        job = layout.job(Direction.STORE, DeviceBlocks(list(range(16))), HostBlocks(list(range(0, 32, 2))))
        prior = copier.choose(job, prepared).name
        for _ in range(12):
            assert copier.copy(job, prepared, "stream", [], []) == ran[-1]
    assert ran[0] == prior  # the cost model's pick goes first
    tried = set(ran[: len(ran) - 1])
    assert prior in tried and len(tried) >= 2
    # once decided, every launch of the class goes to the fastest candidate tried, as weighed
    assert ran[-3:] == [winner] * 3
    # each timed expand_staged launch made its side stream wait for its start; no other did
    assert "expand_staged" in tried and len(copier.side.waited) == tuning.TRIALS
    assert copier.tuner.winners() == {next(iter(copier.tuner._saved)).name(): winner}


@pytest.mark.parametrize("per_job", [16, 1])
def test_a_launch_of_one_job_and_one_of_several_are_one_class(monkeypatch, per_job):
    """Launches join however many jobs wait: launches of one job and of four joined share one
    trial and one winner, so one shape's jobs never go two ways, nor meet a new trial late;
    also where one-block jobs' host blocks, joined, run on (an engine handing them out in turn)."""
    from offload_core.compact import CompactJob

    seconds = {"expand_staged": 1e-5, "expand_direct": 1.5e-5, "ce_batch": 1.8e-5}
    copier, layout, prepared, ran, worker = copier_over_stubs(monkeypatch, seconds)
    with worker:
        blocks = [range(per_job * i, per_job * i + per_job) for i in range(4)]
        jobs = [layout.job(Direction.STORE, DeviceBlocks(b), HostBlocks(b)) for b in blocks]
        joined = CompactJob.concat(jobs)
        for i in range(4 * tuning.TRIALS):
            copier.copy(jobs[0] if i % 2 else joined, prepared, "stream", [], [])
        assert copier.tuner.undecided() == 0 and len(copier.tuner.winners()) == 1
        assert len(set(ran[-4:])) == 1  # one mechanism for both kinds of launch

        def no_pass(*args):
            raise AssertionError("a decided launch passed over its blocks")

        monkeypatch.setattr(layout, "segment_summary", no_pass)  # a decided class needs no estimate
        assert copier.copy(joined, prepared, "stream", [], []) == ran[-1]
        monkeypatch.setattr(tuning, "shape_class", no_pass)  # nor its class, once seen on this layout
        assert copier.copy(jobs[0], prepared, "stream", [], []) == ran[-1]


def test_each_launch_takes_its_own_classs_winner(monkeypatch):
    """Decided classes that differ in direction, job size or host runs alone keep their own
    winners, launch after launch, whatever came before on the layout."""
    names = ["expand_staged", "expand_direct", "ce_batch", "expand_staged"]
    copier, layout, prepared, ran, worker = copier_over_stubs(monkeypatch, dict.fromkeys(names, 1e-5))
    shapes = [(Direction.STORE, 8, False), (Direction.STORE, 8, True), (Direction.LOAD, 8, False)]
    with worker:
        jobs = []
        for (d, n, runs), name in zip(shapes + [(Direction.STORE, 32, False)], names):
            host = range(n) if runs else range(0, 2 * n, 2)
            jobs.append(layout.job(d, DeviceBlocks(list(range(n))), HostBlocks(list(host))))
            key = shape_class(d.value, layout.smallest, layout.row_bytes, jobs[-1].nbytes, runs)
            copier.tuner._saved[key] = name
        for _ in range(2):  # once to look each up, once from what was seen
            assert [copier.copy(job, prepared, "stream", [], []) for job in jobs] == names
        assert len(prepared.decided) == len(jobs)


def test_a_class_with_one_candidate_is_decided_at_once_but_not_saved(tmp_path):
    """One candidate decides its class at once; only measured winners are saved."""
    tuner = Tuner(tmp_path / "tuned.json")
    assert tuner.pick(KEY, ["expand_direct"]) == ("expand_direct", False)
    assert tuner.decided(KEY) == "expand_direct"
    other = KEY._replace(direction="load")
    run_trial(tuner, other, ["expand_staged", "expand_direct"], {"expand_staged": 1.0, "expand_direct": 2.0})
    saved = json.loads((tmp_path / "tuned.json").read_text())["winners"]
    assert saved == {other.name(): "expand_staged"}  # measured winners only


@pytest.mark.parametrize(
    "second",
    [["expand_staged", "ce_batch", "expand_direct"], ["expand_staged", "expand_direct"]],
    ids=["another order", "one fewer"],
)
def test_a_class_whose_candidates_vary_from_launch_to_launch_is_still_decided(second):
    """The cost model weighs each launch's own bytes: one class's launches may offer the
    candidates in another order, or one fewer. The costs are kept per name."""
    tuner = Tuner()
    offers = [["expand_staged", "expand_direct", "ce_batch"], second]
    seconds = {"expand_staged": 3.0, "expand_direct": 1.0, "ce_batch": 2.0}
    for i in range(10 * tuning.TRIALS):
        name, timed = tuner.pick(KEY, offers[i % 2])
        if not timed:
            break
        tuner.observe(KEY, name, 1 << 20, 0.0, seconds[name])
    assert tuner.decided(KEY) == "expand_direct"


def test_the_last_timing_decides_the_class():
    tuner = Tuner()
    names = ["expand_staged", "expand_direct"]
    timed = [tuner.pick(KEY, names) for _ in range(tuning.TRIALS * len(names))]
    assert all(t for _, t in timed)
    for name, _ in timed:
        assert tuner.decided(KEY) is None
        tuner.observe(KEY, name, 1 << 20, 0.0, {"expand_staged": 2.0, "expand_direct": 1.0}[name])
    assert tuner.decided(KEY) == "expand_direct"  # no launch needed to decide it


def test_a_class_is_decided_by_a_launch_that_offers_only_measured_candidates(tmp_path):
    """A candidate offered by few launches (the cost model weighs each launch's bytes) may be
    short of timings when the last timed launch is observed: the next launch whose candidates
    are all measured decides the class (with or without room for a timing), rather than
    leaving it on trial, untimed, for good; the winner is saved."""
    tuner = Tuner(tmp_path / "tuned.json")
    seconds = {"expand_staged": 3.0, "expand_direct": 1.0, "ce_batch": 2.0}
    rare, common = ["expand_staged", "expand_direct", "ce_batch"], ["expand_staged", "expand_direct"]
    timed = []
    for offer in [rare, rare, rare, common, common, common, common, rare]:  # ce_batch: 2 launches
        name, was_timed = tuner.pick(KEY, offer)
        assert was_timed
        timed.append(name)
    for name in timed:  # observed once all have passed, the last under the offer with ce_batch
        tuner.observe(KEY, name, 1 << 20, 0.0, seconds[name])
    assert timed.count("ce_batch") == 2 and tuner.decided(KEY) is None
    assert tuner.pick(KEY, common, can_time=False) == ("expand_direct", False)
    assert tuner.decided(KEY) == "expand_direct" and tuner.undecided() == 0
    assert json.loads((tmp_path / "tuned.json").read_text())["winners"] == {KEY.name(): "expand_direct"}


@pytest.mark.parametrize("processes", [1, 2])
def test_decisions_at_once_both_reach_the_file(tmp_path, monkeypatch, processes):
    """Each decision merges into the file (read, merge, write): two at once, one read before
    the other's write, would drop one; in one process, or in two (tuners sharing no lock in
    memory: the lock file orders them)."""
    read, reads = tuning._read, []

    def slow_read(path):  # the first decision's read grows stale while the second one saves
        found = read(path)
        reads.append(path)
        if len(reads) == 1:
            time.sleep(0.05)
        return found

    seconds = {"expand_staged": 2.0, "expand_direct": 1.0}
    keys = [KEY, KEY._replace(job=KEY.job + 1)]
    tuners = [Tuner(tmp_path / "tuned.json") for _ in range(processes)] * (3 - processes)
    monkeypatch.setattr(tuning, "_read", slow_read)
    if processes == 2:
        monkeypatch.setattr(tuning, "_SAVING", contextlib.nullcontext())
    threads = [threading.Thread(target=run_trial, args=(t, k, list(seconds), seconds)) for t, k in zip(tuners, keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saved = json.loads((tmp_path / "tuned.json").read_text())["winners"]
    assert saved == {k.name(): "expand_direct" for k in keys}


def test_a_decided_winner_that_cannot_run_here_is_not_used(monkeypatch):
    """A winner saved for the class (another worker's, say) whose host rows this layout's
    kernel cannot address: the launch goes another way."""
    seconds = {"expand_staged": 3e-3, "expand_direct": 1e-3, "ce_batch": 2e-3}
    copier, layout, prepared, ran, worker = copier_over_stubs(monkeypatch, seconds)
    with worker:
        job = layout.job(Direction.STORE, DeviceBlocks(list(range(16))), HostBlocks(list(range(0, 32, 2))))
        for _ in range(12):
            copier.copy(job, prepared, "stream", [], [])
        assert ran[-1] == "expand_direct"
        # another worker's layout of this shape, whose host rows the kernel cannot address
        elsewhere = SimpleNamespace(**{**vars(prepared), "direct_ok": False, "decided": {}})
        copier.copy(job, elsewhere, "stream", [], [])
    assert ran[-1] != "expand_direct"


def test_a_trial_launch_that_fails_to_enqueue_is_timed_again(monkeypatch):
    """A timed launch whose enqueue raises gives no timing: the class is still decided."""
    from offload_core.backends.cuda import blocks

    seconds = {"expand_staged": 1.5e-5, "expand_direct": 1e-5, "ce_batch": 1.8e-5}  # brief: hardly weighed
    copier, layout, prepared, ran, worker = copier_over_stubs(monkeypatch, seconds)
    stub = blocks.EXPAND_DIRECT.enqueue_job
    failed = []

    def fails_once(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise RuntimeError("enqueue failed")
        return stub(*args, **kwargs)

    monkeypatch.setattr(blocks.EXPAND_DIRECT, "enqueue_job", fails_once)
    with worker:
        job = layout.job(Direction.STORE, DeviceBlocks(list(range(16))), HostBlocks(list(range(0, 32, 2))))
        for _ in range(40):
            try:
                copier.copy(job, prepared, "stream", [], [])
            except RuntimeError:
                pass
            if copier.tuner.undecided() == 0 and copier.tuner.winners():
                break
    assert failed and copier.tuner.undecided() == 0
    assert list(copier.tuner.winners().values()) == ["expand_direct"]


def test_a_trial_counts_the_host_segments_in_the_mechanisms_host_time(monkeypatch):
    """expand_staged's segments are its own host work: slow ones lose it a class its device time
    alone would win."""
    seconds = {"expand_staged": 1e-5, "expand_direct": 1.5e-5, "ce_batch": 1.8e-5}
    copier, layout, prepared, ran, worker = copier_over_stubs(monkeypatch, seconds)
    segments = layout.segments

    def slow_segments(job):
        HostClock.now += 0.02  # 20 ms of host work against device launches of 10-18 µs
        return segments(job)

    monkeypatch.setattr(layout, "segments", slow_segments)
    with worker:
        job = layout.job(Direction.STORE, DeviceBlocks(list(range(16))), HostBlocks(list(range(0, 32, 2))))
        for _ in range(12):
            copier.copy(job, prepared, "stream", [], [])
    assert "expand_staged" in ran and list(copier.tuner.winners().values()) == ["expand_direct"]


def test_a_trial_launch_whose_segments_fail_is_timed_again(monkeypatch):
    """A timed launch that raises before its enqueue (its segments) gives no timing either."""
    seconds = {"expand_staged": 1e-3, "expand_direct": 1.5e-3, "ce_batch": 1.8e-3}
    copier, layout, prepared, ran, worker = copier_over_stubs(monkeypatch, seconds)
    segments = layout.segments
    fails = [MemoryError()] * 3

    def failing_segments(job):
        if fails:
            raise fails.pop()
        return segments(job)

    monkeypatch.setattr(layout, "segments", failing_segments)
    with worker:
        job = layout.job(Direction.STORE, DeviceBlocks(list(range(16))), HostBlocks(list(range(0, 32, 2))))
        for _ in range(40):
            try:
                copier.copy(job, prepared, "stream", [], [])
            except MemoryError:
                pass
    assert not fails and copier.tuner.undecided() == 0
    assert list(copier.tuner.winners().values()) == ["expand_staged"]
