"""`auto` by measurement: the first launches of each shape class try the mechanisms the cost
model rates close to its own pick, and the class keeps the fastest (as cuDNN's benchmark mode
and Triton's autotune do). The cost model stays the prior: it names the candidates and wins
ties, so its sparing of the SMs holds where measurements cannot tell the candidates apart.
Winners persist per GPU model (`winners_path`).

A class is a job's shape, not its launch's: launches join however many jobs wait, so a class
per launch size would split one shape's jobs between mechanisms and meet new classes, with
their trials, long after the first launches. Costs are per byte, and a class's candidates take
turns launch by launch, so each meets the launch sizes the others meet.

A launch's cost is the larger, per byte, of its host time around the enqueue and its device
time between two events on the copy stream (the host prepares the next launch while the device
moves this one), the device time weighed for the SMs the launch held (`Timings`' `weigh`).
Every setting of the search is a module constant here; tests inject timings, not thresholds.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import stat
import threading
from contextlib import suppress
from pathlib import Path
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

TRIALS = 3  # timed launches per candidate; the median decides
# The candidates: mechanisms the cost model rates at most this many times its pick. Wide, since
# the model's figures come from one GPU and may be off by 2-3x on another; a candidate that
# measures far off the best leaves the trial early (`STRIKE`), so a wide net costs little.
WITHIN = 8.0
STRIKE = 2.0  # a candidate whose best of two launches is this many times the class's best leaves
MARGIN = 0.05  # another candidate replaces the cost model's pick only if this much faster
MAX_PENDING = 64  # timed launches whose events have not passed yet, at most (more go untimed)
# A launch's first host ids that tell its class whether they run on (a class is looked up every
# launch: reading every id would cost a launch of 262,144 blocks about 200 us)
RUNS_SAMPLE = 64
# The rules a saved winner was measured under (its name's prefix): raised where what decides
# a class changes (its fields, the candidates, how timings are weighed), so that winners saved
# under other rules are neither read nor lost (another version may still use them).
RULES = 6
_SAVING = threading.Lock()  # one file write at a time in this process (`Tuner._record`)
_MOST_BYTES = 1 << 20  # a winners file larger than this is not one


class ShapeClass(NamedTuple):
    """What decides between the mechanisms and stays put over an engine's life, bytes in powers
    of four."""

    direction: str  # "store" or "load"
    entry: int  # log2 of the layout's smallest entry (page or head fragment)
    row: int  # log2 of a host row
    job: int  # log4 of the bytes per job
    runs: bool  # host blocks mostly in runs (`in_runs`: fewer runs than half the ids read)

    def name(self) -> str:
        return f"{RULES}/{self.direction}:{self.entry}:{self.row}:{self.job}:{int(self.runs)}"

    @classmethod
    def parse(cls, text: str) -> ShapeClass:
        """The class `name` gave.

        Raises:
            ValueError: a name of other rules (`RULES`) or of no class.
        """
        rules, _, fields = text.partition("/")
        if rules != str(RULES):
            raise ValueError(f"a class of rules {rules!r}, not {RULES}")
        d, e, r, j, runs = fields.split(":")
        return cls(d, int(e), int(r), int(j), runs == "1")


def shape_class(direction: str, smallest: int, row_bytes: int, job_bytes: int, runs: bool) -> ShapeClass:
    """The class of jobs of `job_bytes` over a layout whose smallest entry is `smallest` bytes
    and host row `row_bytes`, their host blocks in runs or not (`in_runs`)."""
    return ShapeClass(direction, _log2(smallest), _log2(row_bytes), _log2(job_bytes) // 2, runs)


def in_runs(host_ids: np.ndarray, jobs: int = 1) -> bool:
    """Whether the host blocks `host_ids` of a launch of `jobs` jobs mostly run on, from their
    first `RUNS_SAMPLE` and one, at most one job's worth: ids of several small jobs joined may
    run on where one job's alone cannot, and one shape must be one class."""
    head = host_ids[: min(RUNS_SAMPLE + 1, max(1, host_ids.size // max(1, jobs)))]
    # the runs as `runs.run_starts` counts them, in half its time: this is asked every launch
    return 2 * (int(np.count_nonzero(head[1:] - head[:-1] != 1)) + 1) < head.size


def _log2(n: int) -> int:
    """The floor of log2 of `n` (at least 1), exact where `math.log2` of a float may not be."""
    return max(1, int(n)).bit_length() - 1


def winners_path(device_name: str, sm_penalty: float) -> Path:
    """Where this device model's winners persist: in ``$OFFLOAD_CORE_PROFILE_DIR`` (default
    ``~/.cache/offload-core``), apart per `sm_penalty`, which weighs the timings that decide."""
    root = os.environ.get("OFFLOAD_CORE_PROFILE_DIR") or Path.home() / ".cache" / "offload-core"
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return Path(root) / f"cuda-{slug}-sm{sm_penalty:g}-tuned.json"


def candidates(estimates: dict[str, float], prior: str) -> list[str]:
    """The mechanisms to try for a class, the cost model's pick `prior` first, then those
    `estimates` (seconds by name) rates at most `WITHIN` times the prior."""
    limit = WITHIN * estimates.get(prior, math.inf)
    rest = sorted((cost, name) for name, cost in estimates.items() if name != prior and cost <= limit)
    return [prior] + [name for _, name in rest]


class _Trial:
    """A class's trial. Candidates may differ between launches of one class (the cost model
    weighs each launch's bytes), so costs per byte are kept per name; `pending` counts timed
    launches not observed yet. A candidate is struck off once the faster of two of its launches
    is `STRIKE` times the best of any (two: a launch that compiles a kernel is slow once)."""

    __slots__ = ("prior", "offered", "costs", "pending", "struck")

    def __init__(self, prior: str):
        self.prior = prior
        self.offered: list[str] = [prior]
        self.costs: dict[str, list[float]] = {}
        self.pending: dict[str, int] = {}
        self.struck: set[str] = set()

    def tried(self, name: str) -> int:
        return len(self.costs[name]) + self.pending[name]

    def left(self) -> list[str]:
        """The candidates offered and not struck off (all offered where every one was: the best
        need not be offered by the last launch)."""
        return [n for n in self.offered if n not in self.struck] or self.offered


class Tuner:
    """The winners per shape class, and the trials still under way; safe from any thread.

    Args:
        path: where the winners persist (a JSON file), or None to keep them in memory.
    """

    def __init__(self, path: Path | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._trials: dict[ShapeClass, _Trial] = {}
        self._saved: dict[ShapeClass, str] = {}
        self._single: set[ShapeClass] = set()  # decided with one candidate: nothing to save
        self.timed = 0  # launches timed so far: a benchmark warms up until a pass times none
        for name, winner in (_read(path) if path is not None else {}).items():
            with suppress(ValueError, TypeError):  # another version's name
                self._saved[ShapeClass.parse(name)] = winner

    def pick(self, key: ShapeClass, names: list[str], can_time: bool = True) -> tuple[str, bool]:
        """The mechanism for a launch of class `key` among `names` (`candidates`), and whether to
        time it (then `observe` or `dropped` must follow). A class with one candidate is decided
        at once, in memory only. Without `can_time`, or where every candidate has `TRIALS`
        timed launches in flight or done, the launch goes untimed to the cost model's pick, or
        to the winner where those launches, all observed, decide the class now."""
        with self._lock:
            saved = self._saved.get(key)
            if saved is not None and saved in names:
                return saved, False
            if len(names) == 1:
                if saved is None:  # a measured winner stays: only this launch cannot take it
                    self._saved[key] = names[0]
                    self._single.add(key)
                    self._trials.pop(key, None)
                return names[0], False
            trial = self._trials.get(key)
            if trial is None:
                trial = self._trials[key] = _Trial(names[0])
            trial.offered = names
            for n in names:
                trial.costs.setdefault(n, [])
                trial.pending.setdefault(n, 0)
            need = [n for n in trial.left() if trial.tried(n) < TRIALS]
            if need and can_time:
                name = min(need, key=trial.tried)  # the least tried, the prior first
                trial.pending[name] += 1
                self.timed += 1
                return name, True
            # decided here where the launches that measured the candidates offered now were
            # observed under another offer (with one that is not offered now, unmeasured)
            decision = None if need else self._decide(key, trial)
        if decision is None:
            return names[0], False
        self._record(key, *decision)
        return decision[0], False

    def dropped(self, key: ShapeClass, name: str) -> None:
        """A timed launch of class `key` by `name` gave no timing: another is timed in its place."""
        with self._lock:
            trial = self._trials.get(key)
            if trial is not None and trial.pending.get(name, 0) > 0:
                trial.pending[name] -= 1

    def decided(self, key: ShapeClass) -> str | None:
        """The winner of class `key`, or None while it is undecided."""
        with self._lock:
            return self._saved.get(key)

    def observe(self, key: ShapeClass, name: str, nbytes: int, host_s: float, device_s: float) -> None:
        """Record a timed launch of class `key` by `name`: `nbytes` moved, `host_s` of enqueue
        and `device_s` on the stream (as the SMs' weight counts it). Once every candidate left
        has `TRIALS`, the class goes to the fastest by median, or to the prior (the cost model's
        first pick, if still in) unless another is `MARGIN` faster."""
        with self._lock:
            trial = self._trials.get(key)
            if trial is None or name not in trial.costs:
                return
            trial.pending[name] = max(0, trial.pending[name] - 1)
            trial.costs[name].append(max(host_s, device_s) / max(1, nbytes))
            best = min(min(c) for c in trial.costs.values() if c)
            trial.struck.update(n for n, c in trial.costs.items() if len(c) >= 2 and min(c) > STRIKE * best)
            decision = self._decide(key, trial)
        if decision is not None:
            self._record(key, *decision)

    def _decide(self, key: ShapeClass, trial: _Trial) -> tuple[str, dict, dict] | None:
        """With the lock held: once every candidate left has `TRIALS`, the class's winner (the
        fastest by median, or the prior unless another is `MARGIN` faster), the medians, and the
        winners to save; else None."""
        left = trial.left()
        if any(len(trial.costs[n]) < TRIALS for n in left):
            return None
        medians = {n: sorted(trial.costs[n])[len(trial.costs[n]) // 2] for n in left}
        best = min(medians, key=medians.get)
        prior = trial.prior if trial.prior in medians else best
        winner = best if medians[best] < (1 - MARGIN) * medians[prior] else prior
        del self._trials[key]
        self._saved[key] = winner
        self._single.discard(key)  # measured: saved with the others
        return winner, medians, {k: v for k, v in self._saved.items() if k not in self._single}

    def _record(self, key: ShapeClass, winner: str, medians: dict, measured: dict) -> None:
        """Log a decision and save the winners (outside the lock: a file is written)."""
        log.info(
            "cuda auto: %s -> %s (seconds per GiB: %s)",
            key.name(),
            winner,
            {n: round(m * (1 << 30), 4) for n, m in medians.items()},
        )
        if self.path is not None:
            with _SAVING:  # two decisions merging into one file at once would drop one
                _save(self.path, measured)

    def undecided(self) -> int:
        """How many classes are still under trial."""
        with self._lock:
            return len(self._trials)

    def winners(self) -> dict[str, str]:
        """The decided classes, by name (`ShapeClass.name`)."""
        with self._lock:
            return {k.name(): v for k, v in self._saved.items()}


class Timings:
    """Timed launches whose events have not passed yet, handed to the tuner once they have
    (asked without blocking, at the next launch), their device time as ``weigh(name, device_s)``
    counts it."""

    def __init__(self, tuner: Tuner, weigh=lambda name, device_s: device_s):
        self.tuner = tuner
        self.weigh = weigh
        self._pending: list[tuple] = []

    def room(self) -> bool:
        return len(self._pending) < MAX_PENDING

    def add(self, key, name, nbytes, host_s, start, end) -> None:
        self._pending.append((key, name, nbytes, host_s, start, end))

    def collect(self) -> None:
        """Hand every timed launch that has passed to the tuner, in order."""
        done = 0
        for key, name, nbytes, host_s, start, end in self._pending:
            try:
                if not end.query():
                    break
                device_s = start.elapsed_time(end) / 1e3
            except Exception:  # a fault: the queue reports it with the jobs; no timing from it
                self.tuner.dropped(key, name)
            else:
                counted = self.weigh(name, device_s)
                log.debug(
                    "cuda auto: %s timed %s: %d bytes, host %.0f us, device %.0f us (counted as %.0f us)",
                    key.name(),
                    name,
                    nbytes,
                    host_s * 1e6,
                    device_s * 1e6,
                    counted * 1e6,
                )
                self.tuner.observe(key, name, nbytes, host_s, counted)
            done += 1
        del self._pending[:done]


def _read(path: Path) -> dict[str, str]:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MOST_BYTES:  # a FIFO would block the read
            raise ValueError(f"not a regular file of at most {_MOST_BYTES} bytes")
        raw = json.loads(path.read_text())
        return {str(k): str(v) for k, v in raw["winners"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
        log.warning("ignoring unreadable cuda tuning file %s: %s", path, exc)
        return {}


def _save(path: Path, winners: dict[ShapeClass, str]) -> None:
    """Merge `winners` into the file through a new file renamed over it, under a lock file beside
    it: other processes, maybe of another version, merge theirs too, and none may lose another's."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # let go with the file
            merged = _read(path)
            merged.update({k.name(): v for k, v in winners.items()})
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps({"winners": merged}, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot save cuda tuning to %s: %s", path, exc)
