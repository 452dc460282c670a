"""Which backends exist, which can run here, and which one to use.

Built-in backends are registered as lazy ``"module:Class"`` strings, so nothing is
imported until a backend is probed or selected. Third-party packages add backends
through the entry-point group ``offload_core.backends`` (set
``OFFLOAD_CORE_PLUGINS=0`` to ignore them; any value but 0, 1 or empty is a `ConfigError`).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import threading
from importlib.metadata import EntryPoint, entry_points

from offload_core.backend import Backend
from offload_core.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidSpecError,
    OffloadError,
    UnknownBackendError,
    flag,
    integer,
)

log = logging.getLogger(__name__)

ENV_BACKEND = "OFFLOAD_CORE_BACKEND"
ENV_PLUGINS = "OFFLOAD_CORE_PLUGINS"
ENTRY_POINT_GROUP = "offload_core.backends"
_NAME = re.compile(r"[a-z][a-z0-9_]*")  # as torch names device types

_BUILTIN: dict[str, str] = {
    "cpu": "offload_core.backends.cpu:CpuBackend",
    "cuda": "offload_core.backends.cuda:CudaBackend",
    "npu": "offload_core.backends.npu:NpuBackend",
    "xpu": "offload_core.backends.xpu:XpuBackend",
}

_lock = threading.RLock()
_targets: dict[str, str | type[Backend]] = dict(_BUILTIN)
_plugins_loaded = False
_instances: dict[tuple[str, int], Backend] = {}
_instances_pid = os.getpid()  # a forked child makes its own: the parent's streams have no threads there


def register_backend(name: str, target: str | type[Backend], *, clobber: bool = False) -> None:
    """Register a backend under `name`.

    Args:
        name: registry key, lower-case letters, digits and ``_``, the first a letter; by
            convention the torch device type it copies to.
        target: a `Backend` subclass that implements every abstract method, or a lazy
            ``"package.module:Class"`` string (an entry point's value).
        clobber: replace an existing registration of the same name.

    Raises:
        InvalidSpecError: `name` is malformed, or taken and `clobber` is False, `clobber` is
            not a bool, or `target` is malformed, an abstract class or a class whose `name`
            is not `name`.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidSpecError(
            f"a backend name must be lower-case letters, digits and _, the first a letter, got {name!r}"
        )
    clobber = flag(clobber, "clobber")
    if isinstance(target, str) and ":" not in target:
        raise InvalidSpecError(f"lazy backend target must look like 'module:Class', got {target!r}")
    if not isinstance(target, str):
        problem = _class_problem(target, name)
        if problem:
            label = target.__name__ if isinstance(target, type) else "target"
            raise InvalidSpecError(f"backend {label} {problem}")
    with _lock:
        _load_plugins()
        if name in _targets and not clobber:
            raise InvalidSpecError(f"offload backend {name!r} is already registered (pass clobber=True to replace it)")
        _targets[name] = target
        for key in [k for k in _instances if k[0] == name]:
            del _instances[key]


def backend_names() -> tuple[str, ...]:
    """Every known backend name, usable here or not, sorted."""
    with _lock:
        _load_plugins()
        return tuple(sorted(_targets))


def backend_class(name: str) -> type[Backend]:
    """Import and return the class registered under `name`.

    Raises:
        UnknownBackendError: no backend has that name.
        BackendUnavailableError: its module cannot be imported, or its class is not a
            complete `Backend` named `name`.
    """
    with _lock:
        _load_plugins()
        if name not in _targets:
            off = os.environ.get(ENV_PLUGINS, "").strip() == "0"
            note = f" (third-party backends are off: ${ENV_PLUGINS}=0)" if off else ""
            if isinstance(name, str) and name.lower() in _targets:
                note += f"; names are lower case: did you mean {name.lower()!r}?"
            raise UnknownBackendError(name, tuple(sorted(_targets)), note=note)
        target = _targets[name]
    if not isinstance(target, str):
        return target
    try:  # as the entry point would load it: "module:Outer.Inner", extras ignored
        cls = EntryPoint(name, target, ENTRY_POINT_GROUP).load()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken plugin must not break the others, nor end the process
        raise BackendUnavailableError(name, f"cannot import {target}: {exc!r}") from exc
    problem = _class_problem(cls, name)
    if problem:
        raise BackendUnavailableError(name, f"{target} {problem}")
    with _lock:
        if _targets.get(name) == target:
            _targets[name] = cls
    return cls


def availability() -> dict[str, str | None]:
    """Probe every backend.

    Returns:
        ``{name: None}`` for usable backends, ``{name: reason}`` for the others; a backend that
        could run but whose own setting is malformed (its probe raised `ConfigError`) has
        ``"misconfigured: ..."``.
    """
    return {name: _probe(name, strict=False) for name in backend_names()}


def _class_problem(cls: object, name: str) -> str | None:
    """Why `cls` cannot be the backend `name`, for a message, or None."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return f"is {cls!r}, not a Backend subclass"
    if inspect.isabstract(cls):
        return "does not implement the abstract method(s) " + ", ".join(sorted(cls.__abstractmethods__))
    if getattr(cls, "name", None) != name:  # results, logs and the worker's messages say `name`
        return f"has name {getattr(cls, 'name', None)!r}, not its key {name!r}"
    if type(cls.priority) is not int:
        return f"has priority {cls.priority!r}, not an int"
    return None


def _probe(name: str, strict: bool = True) -> str | None:
    try:
        reason = backend_class(name).probe()
    except BackendUnavailableError as exc:
        reason = exc.reason
    except ConfigError as exc:
        if strict:  # selecting it: the user's own setting is wrong, said rather than passed by
            raise
        reason = f"misconfigured: {exc}"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a probe must never take the registry down, nor end the process
        reason = f"probe raised {exc!r}"
    if reason is not None and (not isinstance(reason, str) or not reason):
        reason = f"its probe() returned {reason!r}, not None (usable) or a reason"
    if reason is not None:
        log.debug("offload backend %s unavailable: %s", name, reason)
    return reason


def select_backend_name(name: str | None = None, *, device_type: str | None = None) -> str:
    """The backend `get_backend` would use: `name`, else $OFFLOAD_CORE_BACKEND, else
    `device_type` (the backend named after the device that holds the KV tensors, as a worker
    asks), else the usable one of the highest priority, ties by name.

    Raises:
        UnknownBackendError: an explicit or environment name that is not registered.
        BackendUnavailableError: no backend at all is usable.
        ConfigError: the backend it would pick could run, but its own setting is malformed.
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise UnknownBackendError(name, backend_names())
    source = ""
    if not name and os.environ.get(ENV_BACKEND, "").strip():
        name, source = os.environ[ENV_BACKEND].strip(), f"${ENV_BACKEND}"
    name = name or device_type or None
    if name is not None:
        try:
            backend_class(name)  # unknown names fail loudly here
        except UnknownBackendError as exc:
            if not source:
                raise
            raise UnknownBackendError(name, exc.known, source, exc.note) from None
        return name
    ranked = sorted(backend_names(), key=lambda n: (-_priority(n), n))
    for candidate in ranked:
        if _probe(candidate) is None:
            return candidate
    raise BackendUnavailableError("any", "no offload backend is usable")


def _priority(name: str) -> int:
    try:
        return backend_class(name).priority
    except BackendUnavailableError:
        return -1


def get_backend(name: str | None = None, *, device_index: int = 0, device_type: str | None = None) -> Backend:
    """Return the backend instance `select_backend_name` chooses, for `device_index` (cached).

    Raises:
        InvalidSpecError: `device_index` is not an integer >= 0.
        UnknownBackendError: the name is not registered.
        BackendUnavailableError: the backend cannot run here; the message carries the
            probe's reason and an install hint.
        ConfigError: it could run, but its own setting is malformed (its probe says so).
    """
    global _instances_pid
    device_index = integer(device_index, "device_index", 0)
    chosen = select_backend_name(name, device_type=device_type)
    with _lock:
        if _instances_pid != os.getpid():
            _instances.clear()
            _instances_pid = os.getpid()
        instance = _instances.get((chosen, device_index))
        if instance is not None:
            return instance
    cls = backend_class(chosen)
    reason = _probe(chosen)
    if reason is not None:
        source = f"${ENV_BACKEND}" if name is None and os.environ.get(ENV_BACKEND, "").strip() == chosen else ""
        raise BackendUnavailableError(chosen, reason, cls.install_hint, source)
    with _lock:
        try:
            made = cls(device_index)
        except OffloadError:  # a setting's or the device's own message, already named
            raise
        except (Exception, SystemExit) as exc:  # a plugin's constructor must not end the caller's process
            raise BackendUnavailableError(chosen, f"making it raised {exc!r}", cls.install_hint) from exc
        return _instances.setdefault((chosen, device_index), made)


def _load_plugins() -> None:
    """Add third-party backends from entry points, once, as lazy strings. Caller holds _lock."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    setting = os.environ.get(ENV_PLUGINS, "").strip() or "1"  # empty: unset, as every variable here
    if setting not in ("0", "1"):  # raised on every call until it is set right
        raise ConfigError(f"{ENV_PLUGINS} must be 0 (ignore third-party backends) or 1, got {setting!r}")
    _plugins_loaded = True
    if setting == "0":
        return
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if not _NAME.fullmatch(ep.name):
            rule = "names are lower-case letters, digits and _"
            log.warning("ignoring plugin backend %r from %s: %s", ep.name, ep.value, rule)
        elif ep.name in _targets:
            log.warning("ignoring plugin backend %r from %s: the name is taken", ep.name, ep.value)
        else:
            _targets[ep.name] = ep.value
