"""A soak test of one worker driven by several threads, with faults injected and shutdowns at
random moments; every byte that a successful job moved is checked.

Each round makes a worker on a `FaultyCpuBackend` and starts submitter threads and poller
threads. A submitter owns its own device blocks and host blocks, fills device blocks with
fresh random bytes, stores them, waits, loads them back into other blocks, waits, and
compares; pollers call `get_finished` meanwhile, so a submitter may find its results in
another thread's hands. A controller shuts the worker down after a random delay; the
submitters then see `OffloadError` and stop. At the end of a round every accepted job must
have been reported exactly once; jobs the backend failed (at enqueue or on the device) must
be reported as failed, or refused, and the bytes of every successful store-then-load must
match. `tests/test_soak.py` runs a short soak, `benchmarks/soak.py` a long one.
"""

from __future__ import annotations

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
from offload_core.layout import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor
from offload_core.worker import OffloadWorker


class FaultyCpuBackend(CpuBackend):
    """The cpu backend, failing a share of jobs at enqueue or on its streams.

    Args:
        enqueue_faults: share of `copy_batch` calls that raise after enqueueing a random
            prefix of the copies (the job is not queued; its destination is part written).
        device_faults: share of batches whose copies stop part way with an error on the
            stream (the job completes as failed).
        seed: for the choices above.
    """

    def __init__(self, enqueue_faults: float = 0.0, device_faults: float = 0.0, seed: int = 0):
        super().__init__()
        self.enqueue_faults, self.device_faults = enqueue_faults, device_faults
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
    enqueue_failures: int = 0
    device_failures: int = 0
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


def soak(
    rounds: int = 10,
    *,
    submitters: int = 3,
    pollers: int = 2,
    blocks_per_thread: int = 16,
    round_seconds: float = 0.2,
    enqueue_faults: float = 0.05,
    device_faults: float = 0.05,
    seed: int = 0,
    backend: Backend | None = None,
) -> SoakReport:
    """Run `rounds` rounds (see the module docstring) and report.

    Args:
        backend: the backend to soak; default a `FaultyCpuBackend` with the fault shares below.
        rounds: workers made and shut down.
        submitters, pollers: threads per round.
        blocks_per_thread: device and host blocks each submitter owns.
        round_seconds: a round is shut down after a random time up to this.
        enqueue_faults, device_faults: shares of jobs the default backend fails.
        seed: makes the random choices repeatable (thread timing is not).
    """
    rng = np.random.default_rng(seed)
    backend = backend or FaultyCpuBackend(enqueue_faults, device_faults, seed)
    blocks = 2 * blocks_per_thread * submitters  # each thread: a store area and a load area
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        KVCacheTensor(torch.randint(-128, 128, (blocks, p), dtype=torch.int8, generator=gen).to(backend.device), p)
        for p in PAGES
    ]
    kv = KVCaches(tensors, [[KVCacheRef(i, c) for i, c in enumerate(COPY)]])
    report = SoakReport()
    for r in range(rounds):
        _round(kv, backend, blocks_per_thread, submitters, pollers, float(rng.uniform(0.01, round_seconds)),
               int(rng.integers(1 << 30)), report)
        report.rounds += 1
    return report


def _round(kv, backend, per_thread, submitters, pollers, lifetime, seed, report: SoakReport) -> None:
    worker = OffloadWorker(kv, per_thread * submitters, backend=backend)
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
            _submit_loop(t, counts)
        finally:
            with tally:
                for key, n in counts.items():
                    setattr(report, key, getattr(report, key) + n)

    def _submit_loop(t: int, counts: Counter) -> None:
        rng = np.random.default_rng(seed + t)
        mine = np.arange(per_thread) + 2 * per_thread * t  # store from these ...
        other = mine + per_thread  # ... load into these
        hosts = np.arange(per_thread) + per_thread * t
        job = t << 32
        while True:
            k = int(rng.integers(1, per_thread + 1))
            src, dst, chunk = (rng.choice(a, k, replace=False) for a in (mine, other, hosts))
            index = torch.from_numpy(src).to(kv.device)
            for tensor in kv.tensors:  # on the compute stream, which a store waits for
                fresh = torch.from_numpy(rng.integers(-128, 128, (k, tensor.page_size_bytes), dtype=np.int8))
                tensor.tensor[index] = fresh.to(kv.device)
            expected = [tensor.tensor[index].cpu() for tensor in kv.tensors]
            ok = {}
            for direction in ("store", "load"):
                job += 1
                counts['submitted'] += 1
                try:
                    if direction == "store":
                        queued = worker.submit_store(job, DeviceBlocks(src), HostBlocks(chunk))
                    else:
                        queued = worker.submit_load(job, HostBlocks(chunk), DeviceBlocks(dst))
                except OffloadError:
                    counts['refused_after_shutdown'] += 1
                    return
                if not queued:
                    counts['enqueue_failures'] += 1
                    ok[direction] = False
                    break
                with tally:
                    accepted.append(job)
                worker.wait([job])
                collect()
                res = result_of(job)
                if res is None:
                    return  # counted as lost at the end of the round
                ok[direction] = res.success
                counts['device_failures'] += not res.success
                if not res.success:
                    break
            if ok.get("store") and ok.get("load"):
                for tensor, exp, copy in zip(kv.tensors, expected, COPY):
                    got = tensor.tensor[torch.from_numpy(dst).to(kv.device)][:, :copy].cpu()
                    counts['checked_bytes'] += got.numel()
                    counts['wrong_bytes'] += int((got != exp[:, :copy]).sum())

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

    threads = [guarded(submitter, t) for t in range(submitters)]
    polls = [guarded(poller) for _ in range(pollers)]
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
