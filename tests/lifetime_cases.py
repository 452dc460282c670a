"""Cases that crash the interpreter (or corrupt bytes) when memory is freed under a running copy.
Each runs in a process of its own (``python tests/lifetime_cases.py NAME BACKEND``), so a crash
fails its test instead of killing pytest; exit status 0 means every byte came out right.

On cpu, freed buffers go back to the OS and a late copy faults; on cuda, torch caches freed
pinned memory, so a late copy lands in (or reads) the next pinned allocation: the cases
allocate one right after the free and check the bytes."""

from __future__ import annotations

import gc
import sys
import threading

import torch
from helpers import PinnedWindow

from offload_core import (
    DeviceBlocks,
    HostBlocks,
    KVCacheRef,
    KVCaches,
    KVCacheTensor,
    OffloadError,
    OffloadWorker,
    get_backend,
)

PAGE = 8 << 20  # large enough that freed buffers go back to the OS: a use after free faults


BACKEND = "cpu"


def _kv(blocks: int, device=None) -> KVCaches:
    data = torch.arange(blocks * PAGE, dtype=torch.int64).to(torch.uint8).view(blocks, PAGE)
    device = device or get_backend(BACKEND).device
    return KVCaches([KVCacheTensor(data.to(device), PAGE)], [[KVCacheRef(0, PAGE)]])


def _hold_compute(backend, seconds: float = 0.5):
    """Keep the compute stream busy until the returned event is set (cpu) or for about
    `seconds` (cuda): jobs queue up behind it."""
    go = threading.Event()
    if backend.name == "cpu":
        backend.current_stream().launch(go.wait)
    else:
        torch.cuda._sleep(int(seconds * 2e9))  # cycles, at about 2 GHz
    return go


def _junk(nbytes: int) -> torch.Tensor:
    """Memory allocated right after a free, as the backend's host memory: where a late copy would land."""
    return get_backend(BACKEND).alloc_host(nbytes).fill_(0xEE)


def dropped_worker() -> None:
    """A worker dropped with loads in flight: they still land, from memory that was not freed."""
    backend = get_backend(BACKEND)
    kv = _kv(8)
    expected = kv.tensors[0].tensor[:4].clone()
    worker = OffloadWorker(kv, 4, backend=backend)
    worker.submit_store(1, DeviceBlocks([0, 1, 2, 3]), HostBlocks([0, 1, 2, 3]))
    worker.wait([1])
    go = _hold_compute(backend)
    worker.submit_load(2, HostBlocks([0, 1, 2, 3]), DeviceBlocks([4, 5, 6, 7]))
    threading.Timer(1.0, go.set).start()
    assert not go.is_set(), "the machine stalled for a second: the load was not in flight when the worker went"
    del worker
    gc.collect()
    junk = [_junk(4 * PAGE), _junk(4 * PAGE)]  # the host buffer's size: reuses it where it was freed
    backend.synchronize()
    del junk
    assert torch.equal(kv.tensors[0].tensor[4:].cpu(), expected.cpu()), "the load read freed memory"


def dropped_worker_off_main_thread() -> None:
    """The same, with the last reference dropped on another thread (the drain then runs on its own)."""
    backend = get_backend(BACKEND)
    kv = _kv(4)
    expected = kv.tensors[0].tensor[:2].clone()
    box = [OffloadWorker(kv, 2, backend=backend)]
    box[0].submit_store(1, DeviceBlocks([0, 1]), HostBlocks([0, 1]))
    box[0].wait([1])
    go = _hold_compute(backend)
    box[0].submit_load(2, HostBlocks([0, 1]), DeviceBlocks([2, 3]))
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    go.set()
    junk = [_junk(2 * PAGE), _junk(2 * PAGE)]
    backend.synchronize()
    del junk
    assert torch.equal(kv.tensors[0].tensor[2:].cpu(), expected.cpu()), "the load read freed memory"


def shutdown_racing_submits() -> None:
    """Threads submit while another shuts the worker down: every job is either refused or drained."""
    sys.setswitchinterval(1e-6)  # switch threads often, so that the race is hit, not just possible
    backend = get_backend(BACKEND)
    kv = _kv(16)
    for trial in range(20):
        worker = OffloadWorker(kv, 16, backend=backend)
        go = _hold_compute(backend, 0.05)
        accepted: list[int] = []
        refused = []
        start = threading.Barrier(5)

        def submitter(t: int) -> None:
            start.wait()
            for i in range(50):
                job = t * 1000 + i
                try:
                    # the closure reads this trial's worker, deleted only after its threads joined
                    if worker.submit_store(job, DeviceBlocks([(t * 4 + i) % 16]), HostBlocks([(t * 4 + i) % 16])):  # noqa: F821
                        accepted.append(job)
                except OffloadError:
                    refused.append(job)

        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        start.wait()
        threading.Timer(0.01, go.set).start()
        worker.shutdown()
        for t in threads:
            t.join()
        go.set()
        reported = [r.job_id for r in worker.get_finished()]
        assert sorted(reported) == sorted(accepted), f"trial {trial}: jobs lost or reported twice"
        assert len(accepted) + len(refused) == 200
        backend.synchronize()
        junk = _junk(16 * PAGE)  # a late store would land in it
        backend.synchronize()
        assert (junk == 0xEE).all(), f"trial {trial}: a copy landed in freed memory"
        del junk, worker


def interrupted_shutdown() -> None:
    """Ctrl-C while shutdown drains: the memory stays held, and the next shutdown finishes the job."""
    import os
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell that started us in the background ignores it
    backend = get_backend(BACKEND)
    kv = _kv(4)
    worker = OffloadWorker(kv, 4, backend=backend)
    go = _hold_compute(backend, 1.0)
    worker.submit_store(1, DeviceBlocks([0, 1, 2, 3]), HostBlocks([0, 1, 2, 3]))
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        worker.shutdown()
        raise AssertionError("the interrupt did not arrive during the drain")
    except KeyboardInterrupt:
        pass
    assert worker.host_tensors, "memory released although the drain was interrupted"
    go.set()
    worker.shutdown()  # finishes what the first call started
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert worker.host_tensors == []


def forked_child() -> None:
    """A child forked with a job in flight refuses to use the worker and exits without hanging."""
    import os

    backend = get_backend(BACKEND)
    kv = _kv(4)
    worker = OffloadWorker(kv, 4, backend=backend)
    go = _hold_compute(backend)
    worker.submit_store(1, DeviceBlocks([0]), HostBlocks([0]))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            worker.submit_store(2, DeviceBlocks([1]), HostBlocks([1]))
        except OffloadError as exc:
            code = 0 if "forked child" in str(exc) else 1
        if code or BACKEND == "cuda":  # CUDA cannot be torn down in a forked child: leave at once
            os._exit(code)
        sys.exit(0)  # a normal exit runs the worker's finalizer: it must not wait for the parent's copies
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child used the parent's worker or hung"
    go.set()
    worker.shutdown()
    assert [r.job_id for r in worker.get_finished()] == [1]


def _child_status(pid: int, seconds: float, hung: str) -> int:
    """The exit code of forked child `pid`; killed, and `hung` raised, after `seconds`."""
    import os

    for _ in range(int(seconds * 100)):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        threading.Event().wait(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(hung)


def forked_during_a_submit() -> None:
    """A fork while another thread is inside submit: the child's shutdown returns at once
    (the copied submit count, or a lock copied held, would otherwise stop it for good)."""
    import os

    from offload_core.backends.cpu import CpuBackend

    entered, leave = threading.Event(), threading.Event()

    class Slow(CpuBackend):
        def copy_batch(self, *args):
            entered.set()
            leave.wait(30)
            return super().copy_batch(*args)

    backend = Slow()  # on every backend name: the fork logic is the worker's, not the device's
    worker = OffloadWorker(_kv(2, "cpu"), 2, backend=backend)
    submitter = threading.Thread(target=worker.submit_store, args=(1, DeviceBlocks([0]), HostBlocks([0])))
    submitter.start()
    entered.wait(30)
    pid = os.fork()
    if pid == 0:
        worker.shutdown()  # must return: a hang here is killed below and fails the case
        os._exit(0)
    assert _child_status(pid, 10, "the forked child's shutdown hung") == 0
    leave.set()
    submitter.join()
    worker.shutdown()
    assert [r.job_id for r in worker.get_finished()] == [1]


def forked_child_makes_its_own_worker() -> None:
    """What the forked child is told to do, it can: a new worker there, on the registry's backend
    or on the parent's backend object, copies and waits (the parent's stream threads are not in
    the child). On the cpu backend under every name: a CUDA context cannot cross a fork."""
    import os

    from offload_core.backends.cpu import CpuBackend

    mine = CpuBackend()
    parent = [OffloadWorker(_kv(2, "cpu"), 2, backend=b) for b in ("cpu", mine)]
    # Small: torch's own thread pool, which a large fill or copy uses, may hang in a forked child.
    caches = [
        KVCaches([KVCacheTensor(torch.arange(128, dtype=torch.uint8).view(2, 64), 64)], [[KVCacheRef(0, 64)]])
        for _ in range(2)
    ]
    pid = os.fork()
    if pid == 0:
        code = 0
        for backend, kv in zip(("cpu", mine), caches):
            with OffloadWorker(kv, 2, backend=backend) as worker:
                worker.submit_store(1, DeviceBlocks([1]), HostBlocks([0]))
                worker.wait([1])
                ok = [r.success for r in worker.get_finished()] == [True]
                ok = ok and all(torch.equal(h[0], t.tensor[1]) for h, t in zip(worker.host_tensors, kv.tensors))
            code = code or (0 if ok else 1)
        os._exit(code)
    assert _child_status(pid, 30, "the forked child's own worker hung") == 0, "its copies went wrong or failed"
    for worker in parent:
        worker.shutdown()


def exit_with_live_workers() -> None:
    """The interpreter exits with workers never shut down: one idle, one with jobs waiting for
    a launch and copies in flight. Exit drains them and neither hangs nor aborts (a daemon
    thread killed inside a torch call aborts the process)."""
    import offload_core.queue as queue_module

    if BACKEND == "cpu":
        from offload_core.testing.expanding import ExpandingCpuBackend

        backend = ExpandingCpuBackend()  # with a launcher thread, as on a GPU
    else:
        backend = get_backend(BACKEND)
    idle = OffloadWorker(_kv(2), 2, backend=backend)
    idle.submit_store(1, DeviceBlocks([0]), HostBlocks([0]))
    idle.wait([1])
    busy = OffloadWorker(_kv(4), 4, backend=backend)
    for queue in busy._queues.values():
        queue.launch_cost = PinnedWindow(60.0)  # every submit after the first is part of a burst
    queue_module.MAX_QUIET_S = 60.0  # and the launcher leaves the burst alone: it stays pending
    threading.Timer(0.5, _hold_compute(backend, 0.5).set).start()
    for j in range(4):
        busy.submit_store(j, DeviceBlocks([j]), HostBlocks([j]))
    assert any(q.waiting_for_launch() for q in busy._queues.values()), "nothing left waiting for a launch"
    globals()["workers"] = (idle, busy)  # alive until the interpreter exits


def submits_after_the_main_thread_ended() -> None:
    """A thread that outlives the main thread submits jobs the launcher must send while the
    previous launcher is on its way out (it ends when idle once the main thread has): no job
    may be left waiting for a launch that never comes."""
    import os
    import time

    from offload_core.testing.expanding import ExpandingCpuBackend

    def slow_exit(frame, event, arg):  # widens the moment between the launcher's last look and its end
        if frame.f_code.co_name == "_launch_loop":
            return lambda f, e, a: time.sleep(0.2) if e == "return" else None
        return None

    def body() -> None:
        try:
            threading.main_thread().join()
            threading.settrace(slow_exit)
            backend = ExpandingCpuBackend() if BACKEND == "cpu" else get_backend(BACKEND)
            worker = OffloadWorker(_kv(4), 4, backend=backend)
            for queue in worker._queues.values():
                queue.launch_cost = PinnedWindow(0.02)  # a submit within 20 ms of the last waits for the launcher
            for base in (0, 3):
                go = _hold_compute(backend, 0.3)
                threading.Timer(0.3, go.set).start()
                worker.submit_store(base, DeviceBlocks([0]), HostBlocks([0]))  # launched by the submit
                worker.submit_store(base + 1, DeviceBlocks([1]), HostBlocks([1]))  # a burst: the launcher's
                time.sleep(0.05)
                worker.submit_store(base + 2, DeviceBlocks([2]), HostBlocks([2]))
                got, end = set(), time.monotonic() + 10
                while len(got) < 3 and time.monotonic() < end:
                    got |= {r.job_id for r in worker.get_finished()}
                    time.sleep(0.005)
                assert got == {base, base + 1, base + 2}, (
                    f"jobs {sorted({base, base + 1, base + 2} - got)} never launched"
                )
            worker.shutdown()
        except BaseException as exc:  # no main thread left to report it: say it and fail the process
            print(f"submits_after_the_main_thread_ended: {exc!r}", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=body).start()


if __name__ == "__main__":
    BACKEND = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    globals()[sys.argv[1]]()
