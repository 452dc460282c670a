"""The queue's launch policy on a simulated device, on any machine: how many jobs share a launch,
how long the device idles, and what rate the jobs reach, for jobs submitted back to back.

The backend takes compact jobs as the cuda backend does, spends ``--launch-us + --per-job-us x
jobs`` of host time (a busy loop, holding the GIL as a driver call mostly does) on each launch,
and moves ``--gbps`` on a device clock of its own: a launch's work starts when the host has
enqueued it or the previous launch has ended, whichever is later, and its events pass then.
Everything else (the worker's validation, hazards, queue, launcher thread) is the real code.

    python benchmarks/queue_sim.py --page 256 --blocks-per-job 16384 --gbps 15 --launch-us 20 --per-job-us 66

`--slow-launches N` makes the first N launches `--slow-us` slower, as a tuner's trials of slow
candidates are at a shape's start. `--per-step N` submits as an engine does instead: N jobs a
step (`--gap-us` of host time, the GIL held, between two), the results taken, then the step's
compute (the GIL free) until `--step-ms` has passed.

The rate is of the simulated device (``--gbps`` is its limit): below it, the host or the policy
left the device idle (``idle ms``).

`--candidates` gives the device several ways to move a launch (``name:launch_us:per_job_us:gbps``
each, comma-separated) and lets the cuda backend's tuner (`tuning.Tuner`, the real one) choose
among them per shape class, timing each trial on the simulated clock, as `auto` does; with
`--class-per-launch`, its classes hold the launch's size too (as before `c697dea`). Each pass
prints the launches per mechanism:

    python benchmarks/queue_sim.py --tensors 64 --page 256 --blocks-per-job 128 --jobs 64 \
        --candidates fast_host:20:2:50,fast_device:60:8:55
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np
import torch
from submit_overhead import NullExpandingBackend

from offload_core import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor, OffloadWorker
from offload_core.backends.cuda import tuning

now = time.perf_counter


class _Event:
    t = 0.0  # when the device reaches it

    def record(self, stream):
        self.t = stream.t

    def query(self):
        return now() >= self.t

    def synchronize(self):
        while not self.query():
            time.sleep(10e-6)

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class _Stream:
    t = 0.0  # when the device is done with what was enqueued so far

    def wait_event(self, event):
        self.t = max(self.t, event.t)

    def wait_stream(self, stream):
        pass


class SimulatedDevice(NullExpandingBackend):
    def __init__(
        self,
        launch_s: float,
        per_job_s: float,
        gbps: float,
        device_launch_s: float = 0.0,
        slow_launches: int = 0,
        slow_s: float = 0.0,
    ):
        self.launch_s, self.per_job_s, self.s_per_byte = launch_s, per_job_s, 1 / (gbps * 1e9)
        self.device_launch_s = device_launch_s  # what a launch costs the device beyond its bytes
        self.slow_launches, self.slow_s = slow_launches, slow_s  # the first launches this much slower (trials)
        self.idle_s, self.since = 0.0, 0.0  # the device's idle time since `since` (a pass's start)
        self.ends: list[float] = []  # when the device is done with each job, in launch order
        self.candidates: dict[str, tuple[float, float, float]] = {}  # name: (launch s, per job s, s per byte)
        self.tuner = self.timings = None
        self.class_per_launch = False
        self.used: Counter = Counter()  # launches per mechanism

    def new_event(self):
        return _Event()

    def new_stream(self):
        return _Stream()

    def current_stream(self):
        return _Stream()

    def copy_blocks(self, job, prepared, stream, after):
        slow = self.slow_launches > 0
        self.slow_launches -= slow
        name, (launch_s, per_job_s, s_per_byte) = "simulated", (self.launch_s, self.per_job_s, self.s_per_byte)
        key = timed = None
        if self.tuner is not None:
            self.timings.collect()
            per_job = job.nbytes if self.class_per_launch else job.nbytes // max(1, job.jobs)
            runs = tuning.in_runs(job.host_ids, 1 if self.class_per_launch else job.jobs)
            key = tuning.shape_class("store", job.layout.smallest, job.layout.row_bytes, per_job, runs)
            name = self.tuner.decided(key)
            if name is None:
                name, timed = self.tuner.pick(key, list(self.candidates), self.timings.room())
            launch_s, per_job_s, s_per_byte = self.candidates[name]
        self.used[name] += 1
        t0 = now()
        _busy(self.slow_s * slow + launch_s + per_job_s * max(1, job.jobs))
        host_s = now() - t0
        first = _Event()
        first.t = max(now(), stream.t)
        self.idle_s += first.t - max(stream.t, self.since)
        stream.t = first.t + self.device_launch_s + job.nbytes * s_per_byte
        if timed:  # as the cuda backend times a trial: its host time and its span on the device
            last = _Event()
            last.t = stream.t
            self.timings.add(key, name, job.nbytes, host_s, first, last)
        self.ends += [stream.t] * max(1, job.jobs)
        return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--blocks-per-job", type=int, default=16384)
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--gbps", type=float, default=15.0, help="the simulated device's rate")
    ap.add_argument("--launch-us", type=float, default=20.0, help="host time of a launch")
    ap.add_argument("--per-job-us", type=float, default=66.0, help="host time of a launch, per job in it")
    ap.add_argument("--device-launch-us", type=float, default=0.0, help="device time of a launch beyond its bytes")
    ap.add_argument("--slow-launches", type=int, default=0, help="launches, the first, that take --slow-us more")
    ap.add_argument("--slow-us", type=float, default=5000.0, help="host time those launches take beyond the rest")
    ap.add_argument("--per-step", type=int, default=0, help="jobs an engine step (default: all back to back)")
    ap.add_argument("--step-ms", type=float, default=3.0, help="an engine step, its compute included")
    ap.add_argument("--gap-us", type=float, default=0.0, help="host time between two submits of a step")
    ap.add_argument("--candidates", default="", help="name:launch_us:per_job_us:gbps,... for the tuner to choose")
    ap.add_argument("--class-per-launch", action="store_true", help="the tuner's classes hold the launch's size")
    args = ap.parse_args()
    per, jobs = args.blocks_per_job, args.jobs
    blocks = per * jobs if per * jobs <= 1 << 20 else 2 * per  # jobs that clash only where blocks run out
    tensors = [KVCacheTensor(torch.zeros(blocks, args.page, dtype=torch.int8), args.page) for _ in range(args.tensors)]
    kv = KVCaches(tensors, [[KVCacheRef(i, args.page) for i in range(args.tensors)]])
    rng = np.random.default_rng(0)
    dev, host = rng.permutation(blocks), rng.permutation(blocks)
    ids = [np.arange(j * per, (j + 1) * per) for j in range(jobs)]
    specs = [(np.take(dev, i, mode="wrap"), np.take(host, i, mode="wrap")) for i in ids]
    us = 1e-6
    backend = SimulatedDevice(
        args.launch_us * us,
        args.per_job_us * us,
        args.gbps,
        args.device_launch_us * us,
        args.slow_launches,
        args.slow_us * us,
    )
    for spec in filter(None, args.candidates.split(",")):
        name, launch_us, job_us, gbps = spec.split(":")
        backend.candidates[name] = (float(launch_us) * us, float(job_us) * us, 1 / (float(gbps) * 1e9))
    limit = max([1 / c[2] / 1e9 for c in backend.candidates.values()], default=args.gbps)  # the fastest device
    if backend.candidates:
        backend.tuner = tuning.Tuner()
        backend.timings = tuning.Timings(backend.tuner)
        backend.class_per_launch = args.class_per_launch
    with OffloadWorker(kv, blocks, backend=backend) as worker:
        for n in range(args.passes):
            launches, backend.idle_s, backend.ends = worker.stats()["store"].launches, 0.0, []
            backend.used.clear()
            submitted = []
            t0 = backend.since = step = now()
            for j, (d, h) in enumerate(specs):
                submitted.append(now())
                worker.submit_store(j, DeviceBlocks(d), HostBlocks(h))
                _busy(args.gap_us * 1e-6)
                if args.per_step and (j + 1) % args.per_step == 0:
                    worker.get_finished()
                    step += args.step_ms * 1e-3
                    time.sleep(max(0.0, step - now()))
            worker.wait(range(jobs))
            wall = now() - t0
            worker.get_finished()
            rate = jobs * per * args.page * args.tensors / wall / 1e9
            per_launch = jobs / (worker.stats()["store"].launches - launches)
            latency = (np.array(backend.ends) - np.array(submitted)) * 1e3  # a submit to its bytes moved
            print(
                f"pass {n}: {rate:.2f} GB/s of {limit:g}; jobs per launch {per_launch:.2f}; "
                f"idle {backend.idle_s * 1e3:.2f} ms of {wall * 1e3:.2f}; "
                f"latency {latency.mean():.2f} ms mean, {latency.max():.2f} ms at most"
                + (f"; launches {dict(backend.used)}" if backend.candidates else "")
            )
        if backend.tuner is not None:
            print("classes:", backend.tuner.winners(), "still on trial:", backend.tuner.undecided())


def _busy(seconds: float) -> None:
    """Hold the host (and the GIL) this long, as an engine's own work between submits does."""
    t0 = now()
    while now() - t0 < seconds:
        pass


if __name__ == "__main__":
    main()
