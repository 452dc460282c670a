"""The cuda backend: NVIDIA GPUs, with several ways to move a job, chosen per job.

`CudaBackend` adapts the core's `Backend` interface to the modules beside it: `blocks` (every
mechanism by name, and a worker's jobs expanded on the device or on the host), `select` and
`tuning` (how ``auto`` chooses: a cost model, then measurements), `staging`, `driver`, `kernels`,
`ring` and `events` (the CUDA driver through ctypes, the Triton kernels and their descriptor
tables).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import weakref
from collections import deque
from contextlib import contextmanager, nullcontext, suppress
from types import SimpleNamespace

import numpy as np

from offload_core.backend import Direction, deferred
from offload_core.backends.cuda import kernels
from offload_core.backends.cuda.blocks import BLOCK_MECHANISMS, MECHANISMS, TABLE, BlockCopier
from offload_core.backends.cuda.driver import (
    ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    HOST_REGISTER_PORTABLE_DEVICEMAP,
    Driver,
)
from offload_core.backends.cuda.events import DriverEvent, RawStream
from offload_core.backends.cuda.ring import DescriptorRing
from offload_core.backends.cuda.select import CostModel
from offload_core.backends.cuda.staging import Held
from offload_core.backends.cuda.tuning import Tuner, winners_path
from offload_core.backends.torch_device import Runtime, TorchDeviceBackend, TorchRuntime
from offload_core.errors import ConfigError

__all__ = ["BLOCK_MECHANISMS", "MECHANISMS", "CudaBackend"]

log = logging.getLogger(__name__)

ENV_CONF = "OFFLOAD_CORE_CUDA_CONF"  # the backend's one variable (as PYTORCH_CUDA_ALLOC_CONF is)
# its keys: what each value must be (`_setting`'s rules); "mechanism" is a name of `TABLE` or auto
CONF_RULES = {
    "mechanism": None,
    "sm_programs": {},
    "staging_mb": {"scale": 1 << 20},
    "ring_mb": {"scale": 1 << 20},
    "max_batch": {"zero": True},
    "sm_penalty": {"kind": float},
    "tune": {"zero": True, "most": 1},
}

# Programs (SMs) of the kernels that copy across the link. On an H200, 8 keep the link as busy
# with stores (posted writes) as 32 did; loads wait for every read and need more in flight.
SM_PROGRAMS = {Direction.STORE: 8, Direction.LOAD: 32}
# an event that has passed: an enqueue's, where none could be recorded (`_enqueued`)
_PASSED = SimpleNamespace(query=lambda: True, synchronize=lambda: None)


class CudaBackend(TorchDeviceBackend):
    """NVIDIA GPUs through torch.cuda streams and events and the CUDA driver.

    Every argument left None takes its key of ``$OFFLOAD_CORE_CUDA_CONF`` (`conf`), else
    its default.

    Args:
        device_index: the GPU.
        mechanism: ``"auto"`` (default), a batch mechanism (``ce_batch``, ``ce_loop``: a worker
            then plans descriptors on the host) or a compact-job one (``expand_staged``,
            ``expand_direct``: other batches as auto).
        max_programs: the programs (SMs) of every launch of the kernels that copy across the
            link. Unset: at most 8 for stores (``expand_direct`` sizes its stores' by their
            jobs) and 32 for loads.
        staging_bytes: each staging half, the largest piece of an ``expand_staged`` job (two
            halves per copy stream); default 16 MiB.
        ring_bytes: the descriptor ring's device memory (and as much pinned host memory), one
            per GPU; a larger table takes one-off memory, and a full ring makes the next
            enqueue wait for its oldest job; default 16 MiB.
        max_batch: descriptors per ``cuMemcpyBatchAsync`` call, 0 (default) for no limit.
        tune: whether auto measures its choices per shape class (`tuning`), saved per GPU
            model; False: the cost model alone. Default True.
        cost_model: the selection model; default H200 figures (`select.CostModel`). The
            conf's ``sm_penalty`` replaces its `sm_penalty`, also in a model passed here: how
            many times auto counts each second of a launch that holds SMs for 100 µs or longer
            (`select.CostModel.sm_weight`; default 2).
        driver: the CUDA driver's entry points; default the system's libcuda (`Driver.load`).
        runtime: ``torch.cuda``'s surface (`torch_device.Runtime`, plus ``get_device_name``,
            ``get_device_properties``, ``ExternalStream`` and ``device``); default the real one.

    Raises:
        ConfigError: an unknown or unavailable forced mechanism, an argument or a conf value
            outside its values (programs, staging and ring: positive integers, the staging's two
            halves and the ring within the GPU's memory; batch: a non-negative integer; SM
            penalty: a positive number; tune: 0, 1 or a bool), a
            malformed conf or one with an unknown key, or a variable this backend no longer reads.
        OSError: no NVIDIA driver library.
    """

    name = "cuda"
    module_name = "cuda"
    priority = 100
    install_hint = "needs an NVIDIA GPU, its driver, and a CUDA build of torch"

    @classmethod
    def probe(cls) -> str | None:
        """As `Backend.probe`; where a GPU is usable, the conf is parsed too, so that a typo in
        it is refused before any worker is made (by `offload-core backends`, say).

        Raises:
            ConfigError: as `conf`.
        """
        try:
            import torch
        except Exception as exc:
            return f"torch is not importable: {exc}"
        if torch.version.cuda is None:
            if getattr(torch.version, "hip", None):  # ROCm builds name their devices "cuda" too
                return f"torch {torch.__version__} is a ROCm (HIP) build: the cuda backend needs NVIDIA's CUDA driver"
            return f"torch {torch.__version__} is built without CUDA"
        reason = cls._unavailable(torch.cuda, "NVIDIA GPU")
        if reason is None:
            conf()  # only here: a machine that cannot run it (an NPU host, say) ignores its conf
        return reason

    def __init__(
        self,
        device_index: int = 0,
        *,
        mechanism: str | None = None,
        max_programs: int | None = None,
        staging_bytes: int | None = None,
        ring_bytes: int | None = None,
        max_batch: int | None = None,
        tune: bool | None = None,
        cost_model: CostModel | None = None,
        driver: Driver | None = None,
        runtime: Runtime | None = None,
    ):
        super().__init__(device_index, runtime=runtime)
        runtime = self.runtime
        self.driver = driver if driver is not None else Driver.load()
        settings = conf()
        programs = _setting(settings, "sm_programs", None, given=max_programs, argument="max_programs")
        self.sm_programs = {d: programs or SM_PROGRAMS[d] for d in Direction}
        self.programs_given = programs is not None  # else expand_direct sizes its stores' programs by their jobs
        self.staging_bytes = _setting(settings, "staging_mb", 16 << 20, given=staging_bytes, argument="staging_bytes")
        ring_bytes = _setting(settings, "ring_mb", 16 << 20, given=ring_bytes, argument="ring_bytes")
        self.max_batch = _setting(settings, "max_batch", 0, given=max_batch, argument="max_batch")
        self.cost = cost_model or CostModel()
        penalty = _setting(settings, "sm_penalty", None)
        if penalty is not None:
            self.cost = dataclasses.replace(self.cost, sm_penalty=penalty)
        self.available_mechanisms = tuple(name for name, m in TABLE.items() if m.why_unavailable(self) is None)
        # auto's for a bare batch: the copy engines, in one call where the driver can
        self._batch_auto = TABLE["ce_batch" if "ce_batch" in self.available_mechanisms else "ce_loop"]
        self.mechanism = mechanism or settings.get("mechanism") or "auto"
        if self.mechanism != "auto":
            reason = self.why_unavailable(self.mechanism)
            if reason:
                raise ConfigError(f"cuda mechanism {self.mechanism!r} cannot be used: {reason}")
        self._host_ranges: dict[int, tuple[int, int]] = {}  # device-addressable host memory
        self._keepalive: deque = deque()  # [event or None while enqueuing, Held, stream, ring regions]
        self._threads = threading.local()  # `in_context`: the GPU's context was made current on this thread
        self._spare_events: list = []
        tune = _setting(settings, "tune", 1, given=int(tune) if type(tune) is bool else tune, argument="tune")
        # auto's choices measured per shape class, kept per GPU model
        tuner = Tuner(winners_path(runtime.get_device_name(self._device), self.cost.sm_penalty)) if tune else None
        self._blocks = BlockCopier(self, self.staging_bytes, tuner)
        props = runtime.get_device_properties(self._device)
        memory = getattr(props, "total_memory", 0)
        for what, nbytes in (
            ("staging_mb (staging_bytes)", 2 * self.staging_bytes),
            ("ring_mb (ring_bytes)", ring_bytes),
        ):
            if memory and nbytes > memory:  # a typo (bytes for MiB, say): refused now, not as failed jobs later
                raise ConfigError(f"{what} asks for {nbytes} bytes of device memory, more than the GPU has ({memory})")
        self.gather_programs = 4 * props.multi_processor_count  # the device-side gather is short: it may use every SM
        with self._context():
            self._ctx = self.driver.current_context()  # this GPU's primary context
        table_launch = self.driver.table_launch_in(self._ctx)
        self._ring = DescriptorRing(
            self._torch, self._device, self._table_copy, -(-ring_bytes // 8), launch=table_launch
        )
        # what Triton reads too; only torch's own runtime has it
        self._raw_stream = (
            getattr(self._torch._C, "_cuda_getCurrentRawStream", None) if isinstance(runtime, TorchRuntime) else None
        )

    # ---- what the core needs ---------------------------------------------

    def new_stream(self):
        """A dedicated stream: one of torch's pool (32, round robin) could be the caller's
        compute stream or the other direction's, which would silently serialize them."""
        with self._context():
            return self.runtime.ExternalStream(self.driver.new_stream(), device=self._device)

    def _table_copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """A descriptor table's upload (`ring.DescriptorRing`), in the GPU's context."""
        self.driver.check(self.driver.memcpy_in(self._ctx, dst, src, nbytes, stream), "cuMemcpyAsync")

    def new_event(self):
        """A driver event (`events.DriverEvent`)."""
        return DriverEvent(self.driver, self._ctx)

    def _marker(self):
        """An event that is never timed: cheaper to record."""
        return DriverEvent(self.driver, self._ctx, timing=False)

    def current_stream(self):
        """The calling thread's current stream on this GPU, as its handle (`events.RawStream`)."""
        if self._raw_stream is not None:
            return RawStream(self._raw_stream(self.device_index), self.new_event)
        return RawStream(self.runtime.current_stream(self.device_index).cuda_stream, self.new_event)

    def release_stream(self, stream) -> None:
        # The staging buffers go; the stream itself stays, so that its handle, their key, is
        # never another stream's.
        self._blocks.staging.discard(stream)

    def alloc_host(self, nbytes: int):
        # torch's pinned allocator hands a freed block out again at once: whoever queues
        # copies keeps the tensor until they finish, as the worker does.
        tensor = self.runtime.alloc_pinned(nbytes)
        self._track(tensor)
        return tensor

    def pin_host_memory(self, tensor) -> bool:
        """Page-lock `tensor`'s memory (``cuMemHostRegister``) so copies and kernels reach it directly.

        The caller keeps the memory alive and calls `unpin_host_memory` before freeing it.
        Returns False, with nothing to undo, where the memory was pinned already (it stays
        usable) or the driver refuses (copies then go through pageable memory).
        """
        nbytes = tensor.nbytes
        with self._context():
            code = self.driver.host_register(tensor.data_ptr(), nbytes, HOST_REGISTER_PORTABLE_DEVICEMAP)
        if code not in (0, ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            log.warning(
                "cuMemHostRegister of %d bytes failed (%s): copies use pageable memory",
                nbytes,
                self.driver.error_name(code),
            )
            return False
        self._track(tensor)
        return code == 0

    def unpin_host_memory(self, tensor) -> None:
        self._host_ranges.pop(tensor.data_ptr(), None)
        with self._context():
            self.driver.check(self.driver.host_unregister(tensor.data_ptr()), "cuMemHostUnregister")

    def prepare_layout(self, layout):
        """The layout's tables on the GPU, or None where its jobs go as descriptors
        (`copy_batch`): a forced batch mechanism, or no Triton."""
        forced = TABLE.get(self.mechanism)
        if (forced is not None and forced.takes_batches) or kernels.why_unavailable() is not None:
            return None
        return self._blocks.prepare(layout)

    def copy_blocks(self, job, prepared, stream, after) -> str:
        if prepared is None:  # expanded on the host (`prepare_layout`), as the contract's default
            src, dst, sizes = job.layout.copies(job)
            if not sizes.size:
                return None
            return self.enqueue_with(self.mechanism, src, dst, sizes, job.direction, stream, bool(job.host_after))
        forced = TABLE.get(self.mechanism)
        if forced is not None and forced.takes_batches:
            forced = None  # a layout was prepared under another mechanism: its jobs go as auto
        if forced is not None:
            reason = forced.refuses_layout(self._blocks, prepared)
            if reason:
                raise ConfigError(reason)
        with deferred(), self._enqueued(stream) as held:
            return self._blocks.copy(job, prepared, stream, after, held, forced)

    @contextmanager
    def _enqueued(self, stream):
        """Around an enqueue, inside the caller's `deferred` (a generator's frame is off the
        stack while its `with` runs): yields a `Held`, kept with the ring's regions reserved
        meanwhile until an event recorded on `stream` after the enqueue, and after the side
        streams still listed in it, has passed."""
        keepalive = self._keepalive
        with self._context():
            while keepalive and keepalive[0][0] is not None and keepalive[0][0].query():
                event = keepalive.popleft()[0]
                if event is not _PASSED:
                    self._spare_events.append(event)
            held = Held()
            entry = [None, held, stream, self._ring.open()]
            keepalive.append(entry)
            try:
                yield held
            finally:  # also after a failed call: copies enqueued before it may still read
                try:
                    event = self._spare_events.pop() if self._spare_events else self._marker()
                    for side in held.sides:
                        joined = self._marker()
                        joined.record(side)
                        stream.wait_event(joined)
                    # a passed event is recorded again: a ring region naming it is freed later, never sooner
                    event.record(stream)
                    self._ring.retire(event, entry[3])
                    entry[0] = event
                except Exception:
                    # no event could be recorded: what the entry holds goes once the whole GPU
                    # has run, rather than stay at the head of `_keepalive` with every later entry
                    with suppress(Exception):  # the GPU failed: none of its work runs any more
                        self.synchronize()
                    self._ring.retire(_PASSED, entry[3])
                    entry[0] = _PASSED
                    raise

    def copy_batch(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream) -> str:
        return self.enqueue_with(self.mechanism, src, dst, sizes, direction, stream)

    def enqueue_with(
        self,
        mechanism: str,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
        stream,
        waits: bool = True,
    ) -> str:
        """`copy_batch` by `mechanism` instead of this backend's own, which stays as it is
        (measurements run one mechanism after another while other threads may copy).

        Args:
            mechanism: ``"auto"`` (``ce_batch``, or ``ce_loop`` where the driver lacks the batch
                call), a batch mechanism (`MECHANISMS`), or a compact-job one (`BLOCK_MECHANISMS`:
                a bare batch then goes as auto).
            waits: whether `stream` may wait for another lane's job on the host rows a load
                reads (`blocks.source_order`); a bare batch's caller does not say, so it may.

        Returns:
            The mechanism that carried the copies.

        Raises:
            ConfigError: an unknown or unavailable mechanism.
            Exception: anything else that stops the copies from being enqueued.
        """
        src, dst, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (src, dst, sizes))
        chosen = TABLE.get(mechanism)
        if mechanism == "auto" or (chosen is not None and not chosen.takes_batches):
            chosen = self._batch_auto
        elif mechanism not in self.available_mechanisms:  # unknown, or not here
            raise ConfigError(f"cuda mechanism {mechanism!r} cannot be used: {self.why_unavailable(mechanism)}")
        with deferred(), self._enqueued(stream) as held:
            chosen.enqueue(self, src, dst, sizes, direction, stream, held, waits)
        return chosen.name

    # ---- choosing ----------------------------------------------------------

    def why_unavailable(self, mechanism: str) -> str | None:
        """None if `mechanism` can run here, else why not."""
        found = TABLE.get(mechanism)
        if found is None:
            return _unknown(mechanism)
        return found.why_unavailable(self)

    def addressable(self, start: int, nbytes: int) -> bool:
        """Whether the host bytes from `start` lie in pinned or registered memory the GPU can dereference."""
        # a snapshot in one step: other threads and finalizers change the dict
        return any(lo <= start and start + nbytes <= hi for lo, hi in self._host_ranges.copy().values())

    def buffer_waits(self) -> tuple[int, float]:
        """Reservations of descriptor-ring room that waited for an earlier table's job, and
        their seconds."""
        return self._ring.waits, self._ring.wait_s

    def trials_pending(self) -> int:
        """Shape classes whose `auto` choice is still being measured (`tuning`): 0 once every
        class launched so far is decided, or without tuning. Benchmarks launch until it is 0."""
        tuner = self._blocks.tuner
        return 0 if tuner is None else tuner.undecided()

    # ---- helpers -----------------------------------------------------------

    def _track(self, tensor) -> None:
        start = tensor.data_ptr()
        with self._context():
            mapped = self.driver.device_pointer(start)
        if mapped != start:
            return  # the device sees this memory at another address: keep kernels off it
        # the finalizer first: a Ctrl-C between the two then leaves no range of freed memory listed
        weakref.finalize(tensor, self._host_ranges.pop, start, None)
        self._host_ranges[start] = (start, start + tensor.nbytes)

    @contextmanager
    def _context(self):
        """This GPU's context, current in the calling thread for driver calls: a thread that
        made no runtime call yet has none, and the driver fails its calls. A runtime call makes
        it current, once a thread."""
        with self._on_device():
            if not getattr(self._threads, "in_context", False):
                self.runtime.current_stream(self.device_index).query()
                self._threads.in_context = True
            yield

    def _on_device(self):
        runtime = self.runtime
        return nullcontext() if runtime.current_device() == self.device_index else runtime.device(self._device)


def conf() -> dict[str, str]:
    """``$OFFLOAD_CORE_CUDA_CONF`` as a dict: ``key:value`` pairs, comma-separated (spaces
    around either ignored; unset or empty: no settings), keys and values as `CONF_RULES` says.
    Parsed whole wherever it is read, so that `probe` (and `offload-core backends`) refuse a
    typo before any worker is made.

    Raises:
        ConfigError: a pair without ``:``, a key not in `CONF_RULES` or given twice, a value
            outside its key's values, or one of the single variables of earlier versions still
            set (they are no longer read).
    """
    old = sorted(n for n in os.environ if n.startswith("OFFLOAD_CORE_CUDA_") and n != ENV_CONF)
    if old:
        raise ConfigError(
            f"{', '.join(old)} {'is' if len(old) == 1 else 'are'} no longer read: set {ENV_CONF} instead "
            f"(key:value pairs, comma-separated; keys: {', '.join(CONF_RULES)})"
        )
    settings: dict[str, str] = {}
    for pair in os.environ.get(ENV_CONF, "").split(","):
        if not pair.strip():
            continue
        key, sep, value = (part.strip() for part in pair.partition(":"))
        if not sep or key not in CONF_RULES or key in settings:
            why = "is not key:value" if not sep else "names a key twice" if key in settings else "has an unknown key"
            raise ConfigError(f"{ENV_CONF}: {pair.strip()!r} {why}; keys: {', '.join(CONF_RULES)}")
        settings[key] = value
    for key in settings:
        if key != "mechanism":
            _setting(settings, key, None)
    name = settings.get("mechanism")
    if name and name != "auto" and name not in TABLE:
        raise ConfigError(f"{ENV_CONF} mechanism {name!r} cannot be used: {_unknown(name)}")
    return settings


# mechanisms of earlier versions, and what does their work now
REMOVED = {"sm_gather": "expand_direct makes the same copies on the SMs"}


def _unknown(name: str) -> str:
    removed = f" (removed: {REMOVED[name]})" if name in REMOVED else ""
    return f"unknown mechanism{removed}; choose one of {', '.join(TABLE)} or auto"


def _setting(settings: dict, key: str, default, *, given=None, argument=""):
    """`given` (the constructor's `argument`) where not None, else the conf's `key`, scaled as
    `CONF_RULES` says, else `default`.

    Raises:
        ConfigError: a value outside the key's rule (`CONF_RULES`), named with its argument or key.
    """
    rules = CONF_RULES[key]
    kind, zero, scale, most = rules.get("kind", int), rules.get("zero", False), rules.get("scale", 1), rules.get("most")
    if given is not None:
        value, what, shown, scale = given, argument, repr(given), 1
    else:
        text = settings.get(key, "")
        if not text:
            return default
        try:  # ASCII digits only: int() and float() also take other scripts' digits and "1_000"
            value = kind(text) if text.isascii() and "_" not in text else None
        except ValueError:
            value = None
        what, shown = f"{ENV_CONF} {key}", repr(text)
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not (ok and (value >= 0 if zero else value > 0) and (kind is int or math.isfinite(value))) or (
        most is not None and value > most
    ):
        rule = ("a non-negative " if zero else "a positive ") + ("integer" if kind is int else "number")
        raise ConfigError(f"{what} must be {'0 or 1' if most == 1 else rule}, got {shown}")
    return value * scale
