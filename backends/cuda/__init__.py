"""The cuda backend: NVIDIA GPUs, with four ways to move a batch, chosen per job.

* ``ce_batch``: one ``cuMemcpyBatchAsync`` on the copy engines (source order STREAM for
  stores, which read the live KV cache; ANY for loads, which read stable host memory);
* ``sm_gather``: one Triton kernel reading and writing pinned host memory through its
  unified address; fast for small fragments, but it occupies SMs;
* ``staged``: gather the fragments on the device into a staging buffer (or scatter them out
  of it), so that the link sees only host-contiguous runs: a block's pages of all layers;
* ``ce_loop``: one ``cuMemcpyAsync`` per descriptor, for drivers without the batch API.

A worker's jobs arrive compact (block ids; `blocks.BlockCopier`) and are expanded on the device:
``expand_staged`` (a kernel into staging that mirrors host rows, then one copy per host
segment) or ``expand_direct`` (the kernel reads or writes the host rows themselves).

``mechanism="auto"`` (the default) asks a cost model (`select.CostModel`) per job; a
profile saved by ``offload-core calibrate`` replaces its H200 defaults. Force a mechanism with
``CudaBackend(mechanism=...)`` or ``OFFLOAD_CORE_CUDA_MECHANISM``.
"""

from __future__ import annotations

import bisect
import logging
import os
import weakref
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import asdict

import numpy as np

from offload_core.backend import Direction
from offload_core.backends._torch import TorchDeviceBackend
from offload_core.backends.cuda import kernels
from offload_core.backends.cuda.driver import (
    ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    HOST_REGISTER_PORTABLE_DEVICEMAP,
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    Driver,
)
from offload_core.backends.cuda.blocks import BlockCopier
from offload_core.backends.cuda.ring import DescriptorRing
from offload_core.backends.cuda.select import MECHANISMS, CostModel, piece_bounds, profile_path

BLOCK_MECHANISMS = ("expand_staged", "expand_direct")  # for compact jobs (a worker's)

log = logging.getLogger(__name__)

ENV_MECHANISM = "OFFLOAD_CORE_CUDA_MECHANISM"
ENV_SM_PROGRAMS = "OFFLOAD_CORE_CUDA_SM_PROGRAMS"
ENV_MAX_BATCH = "OFFLOAD_CORE_CUDA_MAX_BATCH"
ENV_STAGING_MB = "OFFLOAD_CORE_CUDA_STAGING_MB"


class CudaBackend(TorchDeviceBackend):
    """NVIDIA GPUs through torch.cuda streams and events and the CUDA driver.

    Args:
        device_index: the GPU.
        mechanism: ``"auto"``, one of ``ce_batch``, ``sm_gather``, ``staged``, ``ce_loop`` (a
            worker then plans descriptors on the host) or one of ``expand_staged``,
            ``expand_direct`` (a worker's jobs; other batches as auto); default
            ``$OFFLOAD_CORE_CUDA_MECHANISM`` or ``"auto"``.
        max_programs: cap on the copy kernel's programs (SMs it may occupy); default
            ``$OFFLOAD_CORE_CUDA_SM_PROGRAMS`` or 32.
        staging_bytes: the largest piece of a staged job; the compact path keeps two buffers of
            this per copy stream (so 4x per worker), ``staged`` two of 1.25 times this;
            default ``$OFFLOAD_CORE_CUDA_STAGING_MB`` or 24 MiB.
        max_batch: descriptors per ``cuMemcpyBatchAsync`` call, 0 for no limit; default
            ``$OFFLOAD_CORE_CUDA_MAX_BATCH`` or 0.
        cost_model: the selection model; default the calibrated profile of this GPU model if
            one is saved, else H200 defaults.

    Raises:
        ValueError: an unknown or unavailable forced mechanism.
        OSError: no NVIDIA driver library.
    """

    name = "cuda"
    module_name = "cuda"
    priority = 100
    install_hint = "needs an NVIDIA GPU, its driver, and a CUDA build of torch"
    expands_blocks = True

    @classmethod
    def probe(cls) -> str | None:
        try:
            import torch
        except Exception as exc:
            return f"torch is not importable: {exc}"
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is built without CUDA"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False: no usable NVIDIA GPU or driver"
        return None

    def __init__(
        self,
        device_index: int = 0,
        *,
        mechanism: str | None = None,
        max_programs: int | None = None,
        staging_bytes: int | None = None,
        max_batch: int | None = None,
        cost_model: CostModel | None = None,
    ):
        super().__init__(device_index)
        torch = self._torch
        self.driver = Driver.load()
        self.max_programs = max_programs or int(os.environ.get(ENV_SM_PROGRAMS, 32))
        self.staging_bytes = staging_bytes or int(os.environ.get(ENV_STAGING_MB, 24)) << 20
        self.max_batch = max_batch if max_batch is not None else int(os.environ.get(ENV_MAX_BATCH, 0))
        self.cost = cost_model or self._saved_profile()
        self.available_mechanisms = tuple(m for m in MECHANISMS + BLOCK_MECHANISMS if self.why_unavailable(m) is None)
        self.mechanism = mechanism or os.environ.get(ENV_MECHANISM) or "auto"
        if self.mechanism != "auto":
            reason = self.why_unavailable(self.mechanism)
            if reason:
                raise ValueError(f"cuda mechanism {self.mechanism!r} cannot be used: {reason}")
        self._host_ranges: dict[int, tuple[int, int]] = {}  # device-addressable host memory
        self._keepalive: deque = deque()  # (event, objects) the driver may still read
        self._spare_events: list = []
        # by stream handle: (the stream, so the handle stays ours; its kernel stream; two buffers)
        self._staging: dict[int, tuple] = {}
        self._ring = DescriptorRing(torch, self._device, self.driver.memcpy_async)
        self._blocks = BlockCopier(self, self.staging_bytes)
        sms = torch.cuda.get_device_properties(self._device).multi_processor_count
        self.gather_programs = 4 * sms  # the device-side gather is short: it may use every SM

    # ---- what the core needs ---------------------------------------------

    def new_stream(self):
        """A dedicated stream. torch's pool hands out its 32 streams round robin, so a pooled
        copy stream could be the caller's compute stream or the other direction's, which would
        silently serialize them. These streams live as long as the process."""
        with self._context():
            return self._torch.cuda.ExternalStream(self.driver.new_stream(), device=self._device)

    def alloc_host(self, nbytes: int):
        # torch's pinned allocator hands a freed block out again at once (it knows nothing of
        # driver-level copies): whoever queues copies keeps the tensor until they finish, as
        # the worker does. It rounds large requests up, which PYTORCH_CUDA_ALLOC_CONF can tune.
        tensor = self._torch.zeros(nbytes, dtype=self._torch.uint8, pin_memory=True)
        self._track(tensor)
        return tensor

    def host_register(self, tensor) -> bool:
        """Page-lock `tensor`'s memory (``cuMemHostRegister``) so copies and kernels reach it directly.

        The caller keeps the memory alive and calls `host_unregister` before freeing it.
        Returns False, with nothing to undo, where the memory was pinned already (it stays
        usable) or the driver refuses (copies then go through pageable memory).
        """
        nbytes = tensor.numel() * tensor.element_size()
        with self._context():
            code = self.driver.host_register(tensor.data_ptr(), nbytes, HOST_REGISTER_PORTABLE_DEVICEMAP)
        if code not in (0, ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            log.warning("cuMemHostRegister of %d bytes failed (%s): copies use pageable memory", nbytes, self.driver.error_name(code))
            return False
        self._track(tensor)
        return code == 0

    def host_unregister(self, tensor) -> None:
        self._host_ranges.pop(tensor.data_ptr(), None)
        with self._context():
            self.driver.check(self.driver.host_unregister(tensor.data_ptr()), "cuMemHostUnregister")

    def prepare_layout(self, layout):
        """The layout's tables on the GPU, or None where its jobs go as descriptors: a forced
        descriptor mechanism, or no Triton."""
        if self.mechanism not in ("auto",) + BLOCK_MECHANISMS or kernels.available() is not None:
            return None
        return self._blocks.prepare(layout)

    def copy_blocks(self, job, prepared, stream, after) -> str:
        forced = self.mechanism if self.mechanism in BLOCK_MECHANISMS else None
        if forced == "expand_direct" and not self._blocks.direct_ok(prepared):
            raise ValueError("expand_direct needs host memory from alloc_host or host_register (device-addressable)")
        with self._enqueued(stream) as held:
            return self._blocks.copy(job, prepared, stream, after, held, forced)

    @contextmanager
    def _enqueued(self, stream):
        """Around an enqueue: yields the list of what the device may still read afterwards, and
        holds it, with the ring's regions, until an event recorded after the enqueue has passed."""
        while self._keepalive and self._keepalive[0][0].query():
            self._spare_events.append(self._keepalive.popleft()[0])
        held: list = []
        with self._on_device():
            try:
                yield held
            finally:  # also after a failed call: copies enqueued before it may still read
                # a passed event is recorded again: a ring region still naming it is then freed later, never sooner
                event = self._spare_events.pop() if self._spare_events else self._torch.cuda.Event()
                event.record(stream)
                self._keepalive.append((event, held))
                self._ring.retire(event)

    def copy_batch(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream) -> str:
        src, dst, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (src, dst, sizes))
        shape = None
        if self.mechanism == "auto" or self.mechanism in BLOCK_MECHANISMS:
            mechanism, shape = self._choose(src, dst, sizes, direction)
        else:
            mechanism = self.mechanism
            if mechanism == "sm_gather" and not self.addressable(dst if direction is Direction.STORE else src, sizes):
                raise ValueError("sm_gather needs host memory from alloc_host or host_register (device-addressable)")
        with self._enqueued(stream) as held:
            getattr(self, f"_{mechanism}")(src, dst, sizes, direction, stream, held, shape)
        return mechanism

    # ---- choosing ----------------------------------------------------------

    def why_unavailable(self, mechanism: str) -> str | None:
        """None if `mechanism` can run here, else why not."""
        if mechanism not in MECHANISMS + BLOCK_MECHANISMS:
            return f"unknown mechanism; choose one of {', '.join(MECHANISMS + BLOCK_MECHANISMS)} or auto"
        if mechanism == "ce_batch" and self.driver.memcpy_batch is None:
            return "the driver has no cuMemcpyBatchAsync (CUDA 12.8 or later)"
        if mechanism in ("sm_gather", "staged") + BLOCK_MECHANISMS:
            return kernels.available()
        return None

    def choose(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction) -> str:
        """The mechanism ``auto`` picks for this batch."""
        return self._choose(src, dst, sizes, direction)[0]

    def _choose(self, src, dst, sizes, direction) -> tuple[str, tuple]:
        """The mechanism, and what was learned about the job on the way: ``(largest size,
        whether all sizes are equal, host run starts or None)``."""
        host = dst if direction is Direction.STORE else src
        largest = int(sizes.max())
        uniform = int(sizes.min()) == largest
        nbytes = len(sizes) * largest if uniform else int(sizes.sum())
        # ce_loop is a fallback: it only competes where the batch API is missing
        candidates = [m for m in self.available_mechanisms
                      if m in MECHANISMS and (m != "ce_loop" or "ce_batch" not in self.available_mechanisms)]
        if "sm_gather" in candidates and not self.addressable(host, sizes, largest):
            candidates.remove("sm_gather")
        starts = []

        def count_runs():
            starts.append(run_starts(host, sizes, largest if uniform else None))
            return starts[0].size

        pieces = 1 + len(piece_bounds(nbytes, self.staging_bytes, direction is Direction.STORE))
        mechanism = self.cost.choose(direction.value, len(sizes), nbytes, tuple(candidates), count_runs, pieces)
        return mechanism, (largest, uniform, starts[0] if starts else None)

    def addressable(self, host: np.ndarray, sizes: np.ndarray, largest: int | None = None) -> bool:
        """Whether every host range lies in pinned or registered memory the GPU can dereference."""
        lo, hi = int(host.min()), int(host.max())
        top = hi + (int(sizes.max()) if largest is None else largest)  # bounds every end: one pass less
        ranges = tuple(self._host_ranges.values())  # a copy: other threads add and drop ranges
        if any(start <= lo and top <= end for start, end in ranges):
            return True
        top = int((host + sizes).max())
        return any(start <= lo and top <= end for start, end in ranges)

    # ---- the mechanisms ----------------------------------------------------

    # Each mechanism enqueues on `stream` and appends to `held` what must outlive the enqueue;
    # `shape` is what `_choose` learned about the job, or None.

    def _ce(self, dst, src, sizes, order, stream, held) -> None:
        if self.driver.memcpy_batch is not None:
            held.append(self.driver.memcpy_batch_async(dst, src, sizes, order, stream.cuda_stream, self.max_batch))
        else:
            self.driver.memcpy_loop_async(dst, src, sizes, stream.cuda_stream)

    def _ce_batch(self, src, dst, sizes, direction, stream, held, shape=None) -> None:
        order = SRC_ACCESS_ORDER_STREAM if direction is Direction.STORE else SRC_ACCESS_ORDER_ANY
        held.append(self.driver.memcpy_batch_async(dst, src, sizes, order, stream.cuda_stream, self.max_batch))

    def _ce_loop(self, src, dst, sizes, direction, stream, held, shape=None) -> None:
        self.driver.memcpy_loop_async(dst, src, sizes, stream.cuda_stream)

    def _sm_gather(self, src, dst, sizes, direction, stream, held, shape=None) -> None:
        held.append(kernels.launch(src, dst, sizes, stream, self.max_programs, self._ring, *(shape or ())[:2]))

    def _staged(self, src, dst, sizes, direction, stream, held, shape=None) -> None:
        """Device-side gather (store) or scatter (load) through two staging buffers, pipelined.

        Pieces (see `_pieces`) alternate between the buffers: while the copy engines move
        piece k over the link on `stream`, the kernel gathers piece k+1 (or scatters piece
        k-1) on a companion stream, so the link sees only host-contiguous runs and the
        kernel's time hides behind it. Fragments too large to gain from staging go straight
        through the copy engines.

        Staging pays where a job's fragments form few host runs, so the bookkeeping per piece
        and run is plain Python: numpy's fixed cost per call dominated it (docs/benchmarks.md).
        """
        torch = self._torch
        largest, uniform, starts = shape or (int(sizes.max()), None, None)
        if largest > self.staging_bytes // 4:
            big = sizes > self.staging_bytes // 4
            self._ce_batch(src[big], dst[big], sizes[big], direction, stream, held)
            keep = ~big
            src, dst, sizes, uniform, starts = src[keep], dst[keep], sizes[keep], None, None
            if not sizes.size:
                return
            largest = int(sizes.max())
        store = direction is Direction.STORE
        host, dev = (dst, src) if store else (src, dst)
        kernel_stream, buffers = self._staging_for(stream)
        bases = [buffers[0].data_ptr(), buffers[1].data_ptr()]
        n = sizes.size
        # With equal sizes a fragment's staging offset is i * size: nothing to compute or upload per fragment.
        uniform = int(sizes.min()) == largest if uniform is None else uniform
        edges = None if uniform else np.concatenate(([0], np.cumsum(sizes)))  # fragment i's offset, then the total
        firsts = self._pieces(edges, largest, n, store)
        bounds = firsts + [n]
        if uniform:
            cols = (dev,)
        else:
            piece = np.repeat(np.arange(len(firsts)), np.diff(bounds))
            first_offset = edges[firsts]
            cols = (dev, np.array(bases)[piece % 2] + edges[:-1] - first_offset[piece], sizes)
        starts = (run_starts(host, sizes, largest if uniform else None) if starts is None else starts).tolist()
        # The uploads need nothing the job waits for, so they go first, while the copy stream
        # may still be busy; the first piece's go alone, so that in an idle stream its
        # kernel need not wait for the rest.
        split = bounds[1]
        tables, keep = self._ring.upload(cols, kernel_stream, split)
        held.append(keep)
        kernel_stream.wait_stream(stream)  # the job's own waits (compute, earlier jobs) hold for the kernel too
        free = [None, None]  # per buffer: the event after which it may be overwritten
        try:
            for k in range(len(firsts)):
                a, b = bounds[k], bounds[k + 1]
                base = bases[k % 2]
                # The piece starts at offset 0 of its buffer (which holds staging_bytes * 5 / 4,
                # more than a piece); the copy engines move its host-contiguous runs.
                inner = starts[bisect.bisect_right(starts, a) : bisect.bisect_left(starts, b)]
                cut = np.array([a, *inner, b], dtype=np.int64)
                if uniform:
                    run_stage, run_bytes = base + (cut[:-1] - a) * largest, (cut[1:] - cut[:-1]) * largest
                else:
                    e = edges[cut]
                    run_stage, run_bytes = base + (e[:-1] - e[0]), e[1:] - e[:-1]
                run_host = host[cut[:-1]]
                length, at = (split, a) if k == 0 else (n - split, a - split)
                col = [tables[k > 0] + 8 * (j * length + at) for j in range(len(cols))]  # column j, from fragment a
                dev_col, stage_col, size_col = (col[0], (base, largest), (largest, 0)) if uniform else col
                kernel = (dev_col, stage_col) if store else (stage_col, dev_col)
                if store:
                    if free[k % 2] is not None:
                        kernel_stream.wait_event(free[k % 2])
                    kernels.run(*kernel, size_col, b - a, largest, kernel_stream, self.gather_programs)
                    stream.wait_event(_recorded(torch, kernel_stream))
                    self._ce(run_host, run_stage, run_bytes, SRC_ACCESS_ORDER_STREAM, stream, held)
                    free[k % 2] = _recorded(torch, stream)
                else:
                    if free[k % 2] is not None:
                        stream.wait_event(free[k % 2])
                    self._ce(run_stage, run_host, run_bytes, SRC_ACCESS_ORDER_STREAM, stream, held)
                    kernel_stream.wait_event(_recorded(torch, stream))
                    kernels.run(*kernel, size_col, b - a, largest, kernel_stream, self.gather_programs)
                    free[k % 2] = _recorded(torch, kernel_stream)
        finally:  # the job ends when the kernel stream's work has (a load's last scatter, the uploads)
            stream.wait_stream(kernel_stream)

    def _pieces(self, edges: np.ndarray | None, size: int, n: int, store: bool) -> list[int]:
        """Staged's pieces (`piece_bounds`: one if the job fits a buffer), as the index of each
        one's first fragment. `edges` are the fragments' offsets followed by their total, or
        None where all `n` fragments are `size` bytes.
        """
        bounds = piece_bounds(n * size if edges is None else int(edges[-1]), self.staging_bytes, store)
        # A piece starts at the fragment where its bound falls, rounded away from the exposed
        # end: a store's first piece and a load's last one get their bytes, at most one
        # fragment more, never all the job's.
        if store:
            cuts = [-(-x // size) for x in bounds] if edges is None else np.searchsorted(edges, bounds).tolist()
        else:
            cuts = [x // size for x in bounds] if edges is None else (np.searchsorted(edges, bounds, "right") - 1).tolist()
        firsts = [0]
        for cut in cuts:
            if firsts[-1] < cut < n:
                firsts.append(cut)
        return firsts

    def calibrate(self, save: bool = True) -> dict:
        """Measure this GPU's copy costs (a few seconds), use them, and save them as its profile.

        Returns:
            The measured cost model as a dict, with ``profile`` (the file) and ``saved``.
        """
        model = self._measure_costs()
        path = profile_path(self._torch.cuda.get_device_name(self._device))
        if save:
            model.save(path)
        self.cost = model
        return {"profile": str(path), "saved": save, **asdict(model)}

    def _measure_costs(self) -> CostModel:
        from offload_core.backends.cuda import measure

        torch = self._torch
        span = 256 << 20
        device = torch.zeros(2 * span, dtype=torch.uint8, device=self._device)  # fragments scatter over 2x
        staging = torch.zeros(span, dtype=torch.uint8, device=self._device)
        host = self.alloc_host(span)
        model = CostModel(source=f"offload-core calibrate on {torch.cuda.get_device_name(self._device)}")
        one = np.ones(1, dtype=np.int64)
        for direction in Direction:
            d = direction.value

            def run(mechanism, n, size, seed=0):
                dev, hst, sizes = measure.fragments(n, size, device.data_ptr(), host.data_ptr(), seed=seed)
                src, dst = (dev, hst) if direction is Direction.STORE else (hst, dev)
                return measure.time_copy(self, mechanism, src, dst, sizes, direction, busy=True)["event_s"]

            whole = measure.time_copy(
                self, "ce_batch", *((one * device.data_ptr(), one * host.data_ptr()) if direction is Direction.STORE
                                    else (one * host.data_ptr(), one * device.data_ptr())), one * span, direction, busy=True
            )["event_s"]
            model.ce_gbps[d] = span / whole / 1e9
            if "ce_batch" in self.available_mechanisms:
                model.ce_desc_s[d] = run("ce_batch", 65536, 256) / 65536
                model.ce_tail_s = max(0.0, run("ce_batch", 16384, 16384) / 16384 - 16384 / (model.ce_gbps[d] * 1e9))
            if "sm_gather" in self.available_mechanisms:
                model.sm_gbps[d] = span / run("sm_gather", 4096, 65536) / 1e9
                model.sm_desc_s[d] = run("sm_gather", 65536, 256) / 65536

        def host_s(mechanism, n, size, reps=15):  # the enqueue call's time on this machine's CPU
            dev, hst, sizes = measure.fragments(n, size, device.data_ptr(), host.data_ptr())
            return measure.host_time(self, mechanism, dev, hst, sizes, Direction.STORE, reps)

        if "ce_batch" in self.available_mechanisms:
            model.ce_host_s = host_s("ce_batch", 16384, 16384, reps=5) / 16384
        if "sm_gather" in self.available_mechanisms:
            few, many = host_s("sm_gather", 4096, 256), host_s("sm_gather", 65536, 256)
            per_copy = max(0.0, (many - few) / (65536 - 4096))
            model.sm_host_s = (max(0.0, few - 4096 * per_copy), per_copy)
        if "staged" in self.available_mechanisms:
            # 4096 and 65536 copies in one piece tell the part per copy; 4096 copies in a job
            # larger than the staging buffers, the part per piece (`piece_bounds`)
            wide = 4096 * min(span // (2 * 4096), 1 << (self.staging_bytes // 4096).bit_length())
            small, many, large = (host_s("staged", n, size) for n, size in ((4096, 256), (65536, 256), (4096, wide // 4096)))
            per_copy = max(0.0, (many - small) / (65536 - 4096))
            one, more = (1 + len(piece_bounds(b, self.staging_bytes, True)) for b in (4096 * 256, wide))
            per_piece = max(0.0, (large - small) / (more - one)) if more > one else 0.0
            model.staged_host_s = (max(0.0, small - 4096 * per_copy - one * per_piece), per_copy, per_piece)
        if kernels.available() is None:
            stream, start, end = self.new_stream(), self.new_event(), self.new_event()

            def gather_s(n, size):
                dev_a, dev_b, sizes = measure.fragments(n, size, device.data_ptr(), staging.data_ptr())
                for _ in range(2):  # the first launch compiles
                    start.record(stream)
                    kernels.launch(dev_a, dev_b, sizes, stream, self.gather_programs, self._ring)
                    end.record(stream)
                    self._ring.retire(end)
                    end.synchronize()
                return start.elapsed_time(end) / 1e3

            model.gather_gbps = span / gather_s(16384, 16384) / 1e9
            model.gather_desc_s = max(0.0, gather_s(65536, 256) / 65536 - 256 / (model.gather_gbps * 1e9))
        return model

    # ---- helpers -----------------------------------------------------------

    def _staging_for(self, stream):
        """The companion kernel stream and the two staging buffers of `stream`, made on first use."""
        entry = self._staging.get(stream.cuda_stream)
        if entry is None:
            torch = self._torch
            kernel_stream = self.new_stream()
            with torch.cuda.stream(kernel_stream):  # their memory is ordered on the stream that writes it
                buffers = [torch.empty(self.staging_bytes * 5 // 4, dtype=torch.uint8, device=self._device) for _ in range(2)]
            entry = self._staging[stream.cuda_stream] = (stream, kernel_stream, buffers)
        return entry[1], entry[2]

    def release_staging(self) -> None:
        """Free the staging buffers (they are reallocated on next use)."""
        for stream, kernel_stream, _ in self._staging.values():
            stream.synchronize()
            kernel_stream.synchronize()
        self._staging.clear()

    def _track(self, tensor) -> None:
        start = tensor.data_ptr()
        with self._context():
            mapped = self.driver.device_pointer(start)
        if mapped != start:
            return  # the device sees this memory at another address: keep kernels off it
        self._host_ranges[start] = (start, start + tensor.numel() * tensor.element_size())
        weakref.finalize(tensor, self._host_ranges.pop, start, None)

    @contextmanager
    def _context(self):
        """This GPU's context, current in the calling thread for driver calls: a thread that has
        made no runtime call yet has none, and the driver then fails (invalid context)."""
        with self._on_device():
            self._torch.cuda.current_stream(self._device).query()  # a runtime call makes it current
            yield

    def _on_device(self):
        torch = self._torch
        return nullcontext() if torch.cuda.current_device() == self.device_index else torch.cuda.device(self._device)

    def _saved_profile(self) -> CostModel:
        path = profile_path(self._torch.cuda.get_device_name(self._device))
        if path.exists():
            try:
                return CostModel.load(path)
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable cuda profile %s: %s", path, exc)
        return CostModel()


def _recorded(torch, stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def run_starts(host: np.ndarray, sizes: np.ndarray, size: int | None = None) -> np.ndarray:
    """The indices where runs of descriptors that are contiguous on the host start; `size`,
    where every descriptor has that size, saves a pass."""
    new_run = np.empty(host.size, dtype=bool)
    new_run[0] = True
    if size is None:
        np.not_equal(host[1:], host[:-1] + sizes[:-1], out=new_run[1:])
    else:
        np.not_equal(host[1:] - host[:-1], size, out=new_run[1:])
    return new_run.nonzero()[0]


def host_runs(host: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where runs of descriptors that are contiguous on the host start, and their bytes."""
    starts = run_starts(host, sizes)
    return starts, np.add.reduceat(sizes, starts)
