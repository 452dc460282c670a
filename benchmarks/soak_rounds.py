"""Soak tests: `soak` drives one worker from several threads, with faults injected and shutdowns at
random moments, and checks every byte a successful job moved; `region_soak` runs ranks in processes
of their own around one shared region, crashing and restarting some of them.

A `soak` round makes a worker on a `FaultyCpuBackend`. Submitter threads, each with device and host
blocks of its own, fill blocks with fresh random bytes, store them, load them back into other
blocks and compare, while poller threads call `get_finished` (so results may land in another
thread's hands). The worker is shut down after a random delay. Every accepted job must be reported
exactly once, and every successful store-then-load must move the right bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from offload_core.backend import Backend, Direction
from offload_core.backends.cpu import CpuBackend
from offload_core.errors import OffloadError
from offload_core.region import SharedHostRegion
from offload_core.spec import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor
from offload_core.worker import OffloadWorker


class FaultyCpuBackend(CpuBackend):
    """The cpu backend, failing a share of jobs at enqueue or on its streams: `enqueue_faults` of
    the `copy_batch` calls raise after enqueueing a random prefix of the copies (the launch's jobs
    fail; their destinations are part written), `device_faults` stop part way with an error on
    the stream (the job completes as failed). `seed` makes the choices repeatable."""

    enqueue_faults = device_faults = 0.05

    def __init__(self, seed: int = 0):
        super().__init__()
        self._rng = random.Random(seed)  # the core calls copy_batch one thread at a time
        self.injected: Counter = Counter()

    def copy_batch(self, src, dst, sizes, direction: Direction, stream) -> str:
        roll = self._rng.random()
        cut = self._rng.randrange(len(sizes) + 1)
        if roll < self.enqueue_faults:
            self.injected["enqueue"] += 1
            if cut:
                super().copy_batch(src[:cut], dst[:cut], sizes[:cut], direction, stream)
            raise RuntimeError("injected enqueue fault")
        if roll < self.enqueue_faults + self.device_faults:
            self.injected["device"] += 1
            if cut:
                super().copy_batch(src[:cut], dst[:cut], sizes[:cut], direction, stream)

            def fault() -> None:
                raise RuntimeError("injected device fault")

            stream.launch(fault)
            return "memmove"
        return super().copy_batch(src, dst, sizes, direction, stream)


@dataclass
class SoakReport:
    """What a soak did and found; `lost`, `duplicated`, `wrong_bytes` and `errors` must stay zero/empty."""

    rounds: int = 0
    submitted: int = 0
    accepted: int = 0
    refused_after_shutdown: int = 0
    refused_submits: int = 0  # submits that returned False
    failed_jobs: int = 0  # results with success False: a fault at enqueue or on the device
    injected: dict = field(default_factory=dict)  # faults the default backend injected, by kind
    reported: int = 0
    lost: int = 0
    duplicated: int = 0
    checked_bytes: int = 0
    wrong_bytes: int = 0
    errors: list = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.wrong_bytes or self.errors)


PAGES = (512, 96)  # two KV tensors; the second's ref copies only part of its page
COPY = (512, 64)
SUBMITTERS, POLLERS, PER_THREAD = 3, 2, 16  # threads per round; device and host blocks per submitter


def soak(rounds: int = 10, *, round_seconds: float = 0.2, seed: int = 0, backend: Backend | None = None) -> SoakReport:
    """Run `rounds` rounds (see the module docstring) and report.

    Args:
        rounds: workers made and shut down.
        round_seconds: a round is shut down after a random time up to this.
        seed: makes the random choices repeatable (thread timing is not).
        backend: the backend to soak; default a `FaultyCpuBackend`.
    """
    rng = np.random.default_rng(seed)
    backend = backend or FaultyCpuBackend(seed)
    blocks = 2 * PER_THREAD * SUBMITTERS  # each thread: a store area and a load area
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        KVCacheTensor(torch.randint(-128, 128, (blocks, p), dtype=torch.int8, generator=gen).to(backend.device), p)
        for p in PAGES
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, c) for i, c in enumerate(COPY)]])
    report = SoakReport()
    for _ in range(rounds):
        _round(kv, backend, float(rng.uniform(0.01, round_seconds)), int(rng.integers(1 << 30)), report)
        report.rounds += 1
    report.injected = dict(getattr(backend, "injected", {}))
    return report


def _round(kv, backend, lifetime: float, seed: int, report: SoakReport) -> None:
    worker = OffloadWorker(kv, PER_THREAD * SUBMITTERS, backend=backend)
    seen: Counter = Counter()
    results: dict = {}
    found = threading.Condition()
    accepted: list[int] = []
    stop_polling = threading.Event()

    def collect() -> None:
        got = worker.get_finished()
        with found:
            for res in got:
                seen[res.job_id] += 1
                results[res.job_id] = res
            found.notify_all()

    def result_of(job: int):
        with found:
            found.wait_for(lambda: job in results, timeout=10.0)
            return results.get(job)

    tally = threading.Lock()

    def submitter(t: int) -> None:
        counts: Counter = Counter()
        try:
            rng = np.random.default_rng(seed + t)
            mine = np.arange(PER_THREAD) + 2 * PER_THREAD * t  # store from these ...
            other = mine + PER_THREAD  # ... load into these
            hosts = np.arange(PER_THREAD) + PER_THREAD * t
            job = t << 32
            while True:
                k = int(rng.integers(1, PER_THREAD + 1))
                src, dst, chunk = (rng.choice(a, k, replace=False) for a in (mine, other, hosts))
                index = torch.from_numpy(src).to(kv.device)
                for tensor in kv.tensors:  # on the compute stream, which a store waits for
                    fresh = torch.from_numpy(rng.integers(-128, 128, (k, tensor.page_size_bytes), dtype=np.int8))
                    tensor.tensor[index] = fresh.to(kv.device)
                expected = [tensor.tensor[index].cpu() for tensor in kv.tensors]
                for direction in ("store", "load"):
                    job += 1
                    counts["submitted"] += 1
                    try:
                        if direction == "store":
                            queued = worker.submit_store(job, DeviceBlocks(src), HostBlocks(chunk))
                        else:
                            queued = worker.submit_load(job, HostBlocks(chunk), DeviceBlocks(dst))
                    except OffloadError:
                        counts["refused_after_shutdown"] += 1
                        return
                    if not queued:
                        counts["refused_submits"] += 1
                        break
                    with tally:
                        accepted.append(job)
                    worker.wait([job])
                    collect()
                    res = result_of(job)
                    if res is None:
                        return  # counted as lost at the end of the round
                    counts["failed_jobs"] += not res.success
                    if not res.success:
                        break
                else:  # both succeeded
                    for tensor, exp, copy in zip(kv.tensors, expected, COPY):
                        got = tensor.tensor[torch.from_numpy(dst).to(kv.device)][:, :copy].cpu()
                        counts["checked_bytes"] += got.numel()
                        counts["wrong_bytes"] += int((got != exp[:, :copy]).sum())
        finally:
            with tally:
                for key, n in counts.items():
                    setattr(report, key, getattr(report, key) + n)

    def poller() -> None:
        while not stop_polling.wait(0.0005):
            collect()

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as exc:  # reported, never swallowed
                report.errors.append(repr(exc))

        return threading.Thread(target=run)

    threads = [guarded(submitter, t) for t in range(SUBMITTERS)]
    polls = [guarded(poller) for _ in range(POLLERS)]
    for th in threads + polls:
        th.start()
    time.sleep(lifetime)
    worker.shutdown()
    for th in threads:
        th.join(60)
    stop_polling.set()
    for th in polls:
        th.join(60)
    if any(th.is_alive() for th in threads + polls):
        report.errors.append("a thread hung")
    collect()
    report.accepted += len(accepted)
    report.reported += sum(seen.values())
    report.lost += sum(1 for job in accepted if seen[job] == 0)
    report.duplicated += sum(n - 1 for n in seen.values() if n > 1)
    stray = set(seen) - set(accepted)
    if stray:
        report.errors.append(f"reported but never accepted: {sorted(stray)[:5]}")


# ---- ranks in separate processes sharing a region ------------------------------------------

REGION_BLOCKS, SLOT = 8, 4096


@dataclass
class RegionSoakReport:
    """What `region_soak` did and found; `split`, `wrong_bytes`, `errors` and `left_behind` must stay zero/empty."""

    cycles: int = 0  # a rank joined, stored, loaded back, checked the keeper's bytes, left
    crashes: int = 0  # ranks that died (os._exit) holding the region, some with jobs in flight
    checked_bytes: int = 0
    wrong_bytes: int = 0
    split: int = 0  # a rank mapped another file than the live keeper's
    left_behind: list = field(default_factory=list)
    holders: list = field(default_factory=list)  # where files were left behind: who locks, has open or maps them
    # per file left behind, the seconds until it could be locked exclusively (None: not within
    # FREED_WITHIN_S; "gone": removed): a lock a process outlives is freed later; one held is not
    freed_after_s: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.split or self.wrong_bytes or self.errors or self.left_behind)


FREED_WITHIN_S = 5.0


def _freed_after(paths: list[str], within: float = FREED_WITHIN_S) -> list[float | str | None]:
    """Per file of `paths`, the seconds until it could be locked exclusively (polled together
    for `within` seconds; None if it never could), or "gone" if it was removed meanwhile."""
    fds: dict[int, int] = {}
    out: list[float | str | None] = [None] * len(paths)
    for i, path in enumerate(paths):
        try:
            fds[i] = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            out[i] = "gone"
    t0 = time.monotonic()
    try:
        while fds and time.monotonic() - t0 < within:
            for i, fd in list(fds.items()):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                out[i] = round(time.monotonic() - t0, 4)
                os.close(fds.pop(i))
            time.sleep(0.001)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _lock_holders(path: str) -> list[str]:
    """Who holds the file at `path` (Linux): its flocks in /proc/locks, each as "pid mode (command
    line)", then each process that has it open or mapped, as "pid fd|map (command line)". The
    second list matters: in a pid namespace, /proc/locks leaves out a lock whose locking process
    has died, though a process it forked may still hold that lock."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        return [f"unknown: {exc}"]
    found = [
        (f[4], f[3]) for f in map(str.split, lines) if len(f) > 5 and f[1] == "FLOCK" and f[5].endswith(f":{st.st_ino}")
    ]
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"  # as /proc/PID/maps writes it
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.path.samestat(os.stat(f"/proc/{pid}/fd/{fd}"), st):
                        found.append((pid, "fd"))
            with open(f"/proc/{pid}/maps") as f:
                if any(m.split()[3:5] == [dev, str(st.st_ino)] for m in f):
                    found.append((pid, "map"))
        except OSError:
            pass  # gone, or not ours to read
    out = []
    for pid, how in dict.fromkeys(found):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
        except OSError:
            cmd = "gone"
        out.append(f"{pid} {how} ({cmd})")
    return out


def _join(name: str, directory: str, rank: int, ranks: int) -> SharedHostRegion:
    """`rank` joins the region of `ranks` ranks besides the keeper, whose slot is 0."""
    return SharedHostRegion(
        name, num_blocks=REGION_BLOCKS, rank=rank, slot_bytes=[SLOT] * (ranks + 1), directory=directory
    )


def _rank_cycles(name, directory, rank, ranks, cycles, crash_share, seed, inode, keeper_bytes, out) -> None:
    """One rank process: `cycles` times join, store, load back, check, leave (or crash)."""
    rng = np.random.default_rng(seed)
    tensor = KVCacheTensor(torch.zeros(2 * REGION_BLOCKS, SLOT, dtype=torch.uint8), SLOT)
    kv = KVCaches([tensor], [[KVCacheRef(0, SLOT)]])
    for _ in range(cycles):
        stats: Counter = Counter()
        region = _join(name, directory, rank, ranks)
        stats["split"] += os.stat(region.path).st_ino != inode
        keeper = region.tensor[:, :SLOT].numpy()
        stats["checked_bytes"] += keeper.size
        stats["wrong_bytes"] += int((keeper != keeper_bytes).sum())
        del keeper
        tensor.tensor[:REGION_BLOCKS] = torch.from_numpy(rng.integers(0, 256, (REGION_BLOCKS, SLOT), dtype=np.uint8))
        worker = OffloadWorker(kv, REGION_BLOCKS, backend="cpu", host_region=region)
        blocks = rng.permutation(REGION_BLOCKS)
        worker.submit_store(1, DeviceBlocks(blocks), HostBlocks(blocks))
        worker.wait([1])
        worker.submit_load(2, HostBlocks(blocks), DeviceBlocks(blocks + REGION_BLOCKS))
        if rng.random() < crash_share:
            out.put(("crash", rank, dict(stats)))
            os._exit(1)  # holding the region, the load perhaps still in flight
        worker.shutdown()
        ok = all(r.success for r in worker.get_finished())
        loaded = tensor.tensor[REGION_BLOCKS:]
        stats["checked_bytes"] += loaded.numel()
        stats["wrong_bytes"] += int((loaded != tensor.tensor[:REGION_BLOCKS]).sum()) if ok else loaded.numel()
        del worker
        region.close()
        out.put(("cycle", rank, dict(stats)))


def _found_and_crash(name, directory, ranks, out, go) -> None:
    """Create the region, let the keeper join, then die holding it: the keeper's file must live on."""
    region = _join(name, directory, 1, ranks)
    out.put(("founded", 1, {}))
    go.wait(60)
    del region
    os._exit(1)


def region_soak(cycles: int = 6, *, ranks: int = 2, crash_share: float = 0.3, seed: int = 0) -> RegionSoakReport:
    """Ranks in processes of their own join one region, store into their slots, load back,
    check every byte and the keeper's bytes, and leave; some crash instead (os._exit, holding
    the region) and are restarted. The region is created by a rank that crashes right after
    the keeper (this process) joined; the keeper then holds it throughout, so every rank,
    restarted or not, must map the keeper's file: a rank on another file counts as `split`.
    At the end the keeper leaves last and the directory must be empty.

    Args:
        cycles: join-store-load-leave cycles each rank completes (crashed cycles do not count).
        ranks: rank processes besides the keeper, running at the same time.
        crash_share: share of cycles that end in a crash.
        seed: for the bytes and the crashes.
    """
    import multiprocessing as mp
    import tempfile

    report = RegionSoakReport()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "offload_core.worker", "offload_core.region", "offload_core.backends.cpu"])
    out = ctx.SimpleQueue()  # written through at once: a crashing rank loses no message
    with tempfile.TemporaryDirectory() as directory:
        name = f"soak-{seed}"
        go = ctx.Event()
        founder = ctx.Process(target=_found_and_crash, args=(name, directory, ranks, out, go))
        founder.start()
        if out.get()[0] != "founded":
            raise RuntimeError("the founding rank did not report")
        keeper = _join(name, directory, 0, ranks)
        go.set()
        founder.join(60)
        report.crashes += founder.exitcode == 1
        keeper_bytes = np.random.default_rng(seed).integers(0, 256, (REGION_BLOCKS, SLOT), dtype=np.uint8)
        keeper.tensor[:, :SLOT] = torch.from_numpy(keeper_bytes)
        inode = os.stat(keeper.path).st_ino
        done = Counter()
        starts = 0

        def drain() -> None:
            while not out.empty():
                kind, rank, stats = out.get()
                done[rank] += kind == "cycle"
                report.cycles += kind == "cycle"
                report.crashes += kind == "crash"
                for key, n in stats.items():
                    setattr(report, key, getattr(report, key) + n)

        for _ in range(20 * cycles):  # rounds of (re)starts; each round some rank completes or crashes
            left = {rank: cycles - done[rank] for rank in range(1, ranks + 1) if done[rank] < cycles}
            if not left:
                break
            procs = {}
            for rank, n in left.items():
                starts += 1
                args = (name, directory, rank, ranks, n, crash_share, seed * 1000 + starts, inode, keeper_bytes, out)
                procs[rank] = ctx.Process(target=_rank_cycles, args=args)
                procs[rank].start()
            deadline = time.monotonic() + 120
            while any(p.is_alive() for p in procs.values()) and time.monotonic() < deadline:
                drain()
                time.sleep(0.01)
            for rank, proc in procs.items():
                if proc.is_alive():
                    proc.kill()
                    report.errors.append(f"rank {rank} hung")
                proc.join()
                if proc.exitcode not in (0, 1):
                    report.errors.append(f"rank {rank} exited with {proc.exitcode}")
            drain()
            if report.errors:
                break
        else:
            report.errors.append("ranks did not finish their cycles")
        after = keeper.tensor[:, :SLOT].numpy().copy()
        report.wrong_bytes += int((after != keeper_bytes).sum())  # no rank wrote outside its slot
        keeper.close()
        report.left_behind = sorted(os.listdir(directory))
        report.holders = [h for f in report.left_behind for h in _lock_holders(os.path.join(directory, f))]
        report.freed_after_s = _freed_after([os.path.join(directory, f) for f in report.left_behind])
    return report
