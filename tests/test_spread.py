"""The compiled passes over a large job's ids, split over threads (``OFFLOAD_CORE_NATIVE_THREADS``,
offload_core/_spread.c): the submit's checks, the specs' private copies and the cuda backend's
joined launch's run count and table (backends/cuda/_driver.c, built with a copy of _spread.c)
give what one thread gives, whatever the number of parts, with a broken rule placed right at a
part's bound as well as inside one."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import compiled_or_skip
from test_cuda_joined import RING, Launches

from offload_core import native
from offload_core.backends.cuda import driver
from offload_core.compact import _row_runs
from offload_core.errors import ConfigError

PART_IDS = 1 << 17  # _spread.c's least ids a part
THREADS = (1, 2, 3, 8)  # parts of N: 1, 2, 3 and 5
N = 5 * PART_IDS + 77  # five parts' worth: every thread count splits it


@pytest.fixture
def threads(monkeypatch):
    """Sets the threads through the environment, as an operator does; the setting before comes
    back after the test."""
    compiled = compiled_or_skip(True)

    def use(k: int):
        monkeypatch.setenv(native.ENV_THREADS, str(k))
        assert native.load().spread_threads() == k
        return compiled

    yield use
    monkeypatch.undo()
    native.load()


def bounds(n: int, parts=range(2, 9)) -> set[int]:
    """Every part's first id for these numbers of parts (as _spread.c splits: down to a multiple
    of 64), with its neighbours."""
    at = {int(n * k / p) // 64 * 64 for p in parts for k in range(1, p)}
    return {i + d for i in at for d in (-1, 0, 1)}


@pytest.mark.parametrize("n", [2 * PART_IDS - 1, 2 * PART_IDS, N])
def test_large_copies_are_the_same_on_any_number_of_threads(threads, n):
    ids = np.random.default_rng(n).integers(-(1 << 62), 1 << 62, n)
    narrow = ids.astype(np.int32)
    for k in THREADS:
        compiled = threads(k)
        assert bytes(memoryview(compiled.frozen(ids))) == ids.tobytes()
        assert bytes(memoryview(compiled.frozen_widened(narrow))) == narrow.astype(np.int64).tobytes()


def fits(dev, host, dev_limit, host_limit, unique_dev) -> bool:
    """The reference: `single_check`'s rule in numpy."""
    unique, limit = (dev, dev_limit) if unique_dev else (host, host_limit)
    inside = all(((a >= 0) & (a < lim)).all() for a, lim in ((dev, dev_limit), (host, host_limit)))
    return dev.size == host.size > 0 and inside and np.unique(unique).size == unique.size


@pytest.mark.parametrize("spread_factor", [1, 20])  # unique limit n: a bitset per part; 20n: one bitset
def test_the_checks_find_a_broken_rule_wherever_it_lies(threads, spread_factor):
    rng = np.random.default_rng(spread_factor)
    limit = spread_factor * N
    base = rng.permutation(limit)[:N].astype(np.int64)
    other = rng.integers(0, N, N)
    places = sorted(bounds(N, (2, 3, 5)) | {0, N - 1, int(rng.integers(N))})
    broken = []  # each breaks the rule at one place: a repeat of another part's id, one past the end, a negative
    for i in places:
        for value in (base[(i + N // 2) % N], limit, -1):
            unique = base.copy()
            unique[i] = value
            broken.append((unique, other))
        outside = other.copy()
        outside[i] = N
        broken.append((base, outside))
    for unique_dev in (True, False):
        limits = (limit, N) if unique_dev else (N, limit)
        sides = lambda unique, rest: (unique, rest) if unique_dev else (rest, unique)  # noqa: E731
        assert fits(*sides(base, other), *limits, unique_dev)
        for k in THREADS:
            compiled = threads(k)
            assert compiled.single_check(*sides(base, other), *limits, unique_dev), (k, unique_dev)
            for n, case in enumerate(broken):
                assert not compiled.single_check(*sides(*case), *limits, unique_dev), (k, unique_dev, n)


def runs_of_hosts(rng, n: int) -> np.ndarray:
    """`n` host ids in runs of consecutive ones, 1 to 6 long, the runs in random order: runs start
    and end on every side of the parts' bounds."""
    lengths = rng.integers(1, 7, n)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), n) + 1]
    lengths[-1] -= lengths.sum() - n
    starts = rng.permutation(lengths.size) * 8  # runs 8 apart: never joined by the shuffle
    return np.concatenate([s + np.arange(length) for s, length in zip(starts, lengths)])


@pytest.mark.parametrize("narrow", [True, False])
def test_the_joined_launch_counts_and_writes_the_same_on_any_number_of_threads(threads, monkeypatch, narrow):
    launches = Launches(monkeypatch)
    b, lib = launches.backend, launches.lib
    join = b.driver.join_launch_in(b._ctx)
    rng = np.random.default_rng(int(narrow))
    hosts = runs_of_hosts(rng, N)
    devs = rng.permutation(N).astype(np.int64)
    cuts = np.sort(rng.integers(0, N, 5))
    cuts[1] = cuts[0]  # an empty part among them
    parts = ([*np.split(devs, cuts)], [*np.split(hosts, cuts)])
    table = np.zeros(2 * N, dtype=np.int64)
    params = (RING, *range(1, 9), 0, 0)

    def call(least):
        table[:] = -1
        args = (table.ctypes.data, RING, table.nbytes, parts, narrow, 0x77, 0xF00, 1, 128, 0, params)
        return join(*args, False, least)

    for k in THREADS:
        threads(k)
        assert driver.compiled().spread_threads() == k, "the setting reaches the cuda backend's module too"
        assert call(N + 1) == _row_runs(hosts, 1, 0)[0], k
        lib.calls.clear()
        assert call(0) is None
        written = table.view(np.int32)[: 2 * N] if narrow else table
        assert np.array_equal(written[:N], devs) and np.array_equal(written[N:], hosts), k
        assert [c[0] for c in lib.calls] == ["memcpy", "launch"]


@pytest.mark.parametrize("setting", ["0", "9", "two", "-1", "1.5"])
def test_a_threads_setting_outside_the_rule_is_refused(monkeypatch, setting):
    compiled_or_skip(True)
    monkeypatch.setenv(native.ENV_THREADS, setting)
    with pytest.raises(
        ConfigError, match=f"{native.ENV_THREADS} must be a whole number from 1 .* to 8, got '{setting}'"
    ):
        native.load()
    monkeypatch.undo()
    native.load()
