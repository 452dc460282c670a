"""The worker from several threads, and its memory's lifetime: nothing is freed while a copy may
still touch it, no job is accepted twice, lost or reported twice."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from helpers import Model, small_kv

from offload_core import DeviceBlocks, HostBlocks, InvalidSpecError, OffloadError, OffloadWorker, get_backend, registry

HERE = pathlib.Path(__file__).parent


@pytest.mark.parametrize(
    "case",
    [
        "dropped_worker",
        "dropped_worker_off_main_thread",
        "shutdown_racing_submits",
        "interrupted_shutdown",
        "forked_child",
        "forked_during_a_submit",
        "forked_child_makes_its_own_worker",
        "exit_with_live_workers",
        "submits_after_the_main_thread_ended",
    ],
)
@pytest.mark.parametrize(
    "name", [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("cuda", marks=pytest.mark.cuda)]
)
def test_memory_outlives_the_copies_that_touch_it(case, name):
    reason = registry.availability()[name]
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    proc = subprocess.run(
        [sys.executable, str(HERE / "lifetime_cases.py"), case, name], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{case} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"


def _run_threads(targets):
    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # surfaced in the test's thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_submit_wait_and_poll_from_several_threads(backend):
    kv = small_kv(pages=(4096, 512), blocks=64, device=backend.device)
    reported: list[int] = []
    accepted: list[int] = []
    with OffloadWorker(kv, 64, backend=backend) as worker:
        done = threading.Event()

        def submitter(t):
            def run():
                rng = np.random.default_rng(t)
                for i in range(150):
                    job = t * 10_000 + i
                    blocks = rng.choice(16, size=2, replace=False) + 16 * t
                    if i % 2:
                        ok = worker.submit_store(job, DeviceBlocks(blocks), HostBlocks(blocks))
                    else:
                        ok = worker.submit_load(job, HostBlocks(blocks), DeviceBlocks(blocks))
                    assert ok
                    accepted.append(job)
                    if i % 10 == 0:
                        worker.wait([job, job - 1])

            return run

        def poller():
            while not done.is_set():
                reported.extend(r.job_id for r in worker.get_finished())

        pollers = [threading.Thread(target=poller) for _ in range(2)]
        for p in pollers:
            p.start()
        try:
            _run_threads([submitter(t) for t in range(4)])
        finally:
            worker.wait(accepted)
            done.set()
            for p in pollers:
                p.join()
        reported.extend(r.job_id for r in worker.get_finished())
    assert sorted(reported) == sorted(accepted)  # each once: none lost, none twice


@pytest.mark.cpu
@pytest.mark.parametrize("expanding", [False, True], ids=["planned", "compact"])
def test_one_job_id_from_two_threads_is_accepted_once(expanding):
    """Also for compact jobs, whose submit is one compiled call where the extension was built."""
    from offload_core.testing.expanding import ExpandingCpuBackend

    kv = small_kv(blocks=16)
    with OffloadWorker(kv, 16, backend=ExpandingCpuBackend() if expanding else "cpu") as worker:
        for trial in range(200):
            barrier = threading.Barrier(2)
            outcomes = []

            def submit(block):
                barrier.wait()
                try:
                    outcomes.append(worker.submit_store(trial, DeviceBlocks([block]), HostBlocks([block])))
                except InvalidSpecError as exc:
                    assert "still in flight" in str(exc)
                    outcomes.append(None)

            _run_threads([lambda: submit(1), lambda: submit(2)])
            assert sorted(outcomes, key=str) == [None, True], f"trial {trial}: {outcomes}"
            worker.wait([trial])
            assert [r.job_id for r in worker.get_finished()] == [trial]


@pytest.mark.cpu
@pytest.mark.parametrize("expanding", [False, True], ids=["planned", "compact"])
def test_one_id_resubmitted_as_soon_as_returned_is_never_twice_in_flight(expanding):
    """Three threads submit one id on random lanes while a fourth returns results: a submit's
    clean-up may run after its job's result was returned and the id submitted again, and must
    not free the new submit's hold on it. Each accepted job is reported once, never two at once."""
    from offload_core.testing.expanding import ExpandingCpuBackend

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many thread switches: the windows between a submit's steps open
    kv = small_kv(blocks=16)
    worker = OffloadWorker(kv, 16, backend=ExpandingCpuBackend() if expanding else "cpu")
    accepted, reported, twice = [0, 0, 0], [0], []  # accepted: one count per thread
    done = threading.Event()

    def submit(seed):
        rng = np.random.default_rng(seed)
        while not done.is_set():
            lane, block = int(rng.integers(3)), int(rng.integers(16))
            try:
                if lane == 0:
                    ok = worker.submit_store(5, DeviceBlocks([block]), HostBlocks([block]))
                else:
                    ok = worker.submit_load(5, HostBlocks([block]), DeviceBlocks([block]), expedited=lane == 2)
            except InvalidSpecError:
                continue
            accepted[seed] += ok
            if sum(accepted) >= 1500:
                done.set()

    def poll():
        while not done.is_set():
            ids = [r.job_id for r in worker.get_finished()]
            reported[0] += len(ids)
            if len(ids) > 1:
                twice.append(ids)

    try:
        _run_threads([lambda s=s: submit(s) for s in range(3)] + [poll])
    finally:
        sys.setswitchinterval(interval)
    worker.wait([5])
    reported[0] += len(worker.get_finished())
    worker.shutdown()
    assert not twice, f"one id reported twice by one call: {twice[:3]}"
    assert reported[0] == sum(accepted)


@pytest.mark.cpu
def test_shutdown_from_two_threads_returns_after_the_drain():
    backend = get_backend("cpu")
    kv = small_kv(pages=(1 << 20,), blocks=8)
    worker = OffloadWorker(kv, 8, backend=backend)
    go = threading.Event()
    backend.current_stream().launch(go.wait)
    worker.submit_store(1, DeviceBlocks([0]), HostBlocks([0]))
    threading.Timer(0.05, go.set).start()
    _run_threads([worker.shutdown, worker.shutdown])
    assert go.is_set()  # both returned only after the drain, which waited for the held compute stream
    assert worker.host_tensors == []
    assert [r.job_id for r in worker.get_finished()] == [1]
    with pytest.raises(OffloadError, match="shut down"):
        worker.submit_store(2, DeviceBlocks([0]), HostBlocks([0]))


@pytest.mark.cpu
def test_a_dropped_worker_keeps_its_buffers_until_its_jobs_finish():
    backend = get_backend("cpu")
    kv = small_kv(pages=(4096,), blocks=4)
    worker = OffloadWorker(kv, 4, backend=backend)
    host = worker.host_tensors[0]
    worker.submit_store(1, DeviceBlocks([0]), HostBlocks([0]))
    worker.wait([1])
    go = threading.Event()
    backend.current_stream().launch(go.wait)
    worker.submit_load(2, HostBlocks([0]), DeviceBlocks([3]))
    storage = host.untyped_storage()
    threading.Timer(0.05, go.set).start()
    del worker, host  # the drain, on this (main) thread, waits for the load
    assert go.is_set()
    assert torch.equal(kv.tensors[0].tensor[3], kv.tensors[0].tensor[0])
    del storage


@pytest.mark.cpu
def test_one_layout_from_several_threads():
    """Workers check and expand jobs on the caller's thread: one `CompactLayout` takes jobs from
    several threads at once."""
    import sys

    from offload_core import Direction

    # 8192 device blocks of 64 bytes, 4096 host blocks of 4 of them
    layout = Model([64], [[(0, 64)]], 4, device_blocks=8192, host_blocks=4096).layout()

    def plans(t):
        def run():
            rng = np.random.default_rng(t)
            for _ in range(300):
                n = int(rng.integers(1, 4000))
                device = DeviceBlocks(rng.permutation(8192)[:n], [n], [int(rng.integers(0, 4))])
                hosts = -(-(n + int(device.block_indices[0]) % 4) // 4)
                job = layout.job(Direction.STORE, device, HostBlocks(rng.permutation(4096)[:hosts]))
                assert job.nbytes == 64 * n and int(layout.copies(job)[2].sum()) == 64 * n

        return run

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _run_threads([plans(t) for t in range(3)])
    finally:
        sys.setswitchinterval(interval)
