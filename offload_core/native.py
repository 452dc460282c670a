"""The optional compiled steps of the hot path (`offload_core._native`, from _native.c), and the
loader a backend's own compiled module goes through (`load`).

Each does what a numpy (or ctypes) function next to it does, which stays the reference and the
fallback where the extension was not built or ``OFFLOAD_CORE_NATIVE=0``. Passes over a large job's
ids are spread over at most ``OFFLOAD_CORE_NATIVE_THREADS`` threads (default: the usable CPUs, at
most 4; 1 keeps them on the calling thread), in every compiled module loaded.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from offload_core.errors import ConfigError

ENV_NATIVE = "OFFLOAD_CORE_NATIVE"
ENV_THREADS = "OFFLOAD_CORE_NATIVE_THREADS"
MOST_THREADS = 8  # _spread.c's MOST_PARTS
NATIVE = "offload_core._native"
_threads_applied: str | None = None  # the setting last handed to the modules ("" for the default)
_loaded: dict[str, ModuleType] = {}  # the compiled modules loaded, each with threads of its own (_spread.c)


def load(name: str = NATIVE) -> ModuleType | None:
    """The compiled module `name` (offload_core's own, or a backend's built with _spread.c), its
    threads set from ``OFFLOAD_CORE_NATIVE_THREADS``; None where it is not built or switched off.

    Raises:
        ConfigError: ``OFFLOAD_CORE_NATIVE`` is set to anything but 0 or 1, or
            ``OFFLOAD_CORE_NATIVE_THREADS`` to anything but a whole number from 1 to 8.
    """
    if _switched_off():
        return None
    module = _loaded.get(name)
    if module is None:
        try:
            module = importlib.import_module(name)
        except ImportError:
            return None
    _apply_threads(module)
    return module


def status() -> str:
    """``"built"``, ``"off"`` (``OFFLOAD_CORE_NATIVE=0``) or ``"not built"`` (no C compiler or
    Python headers at install), of offload_core's steps, for `offload-core backends`.

    Raises:
        ConfigError: as `load`.
    """
    if _switched_off():
        return "off"
    return "built" if load() is not None else "not built"


def _apply_threads(module: ModuleType) -> None:
    """Hand ``OFFLOAD_CORE_NATIVE_THREADS`` to a module loaded for the first time, or to every
    module loaded where it changed."""
    global _threads_applied
    setting = os.environ.get(ENV_THREADS, "").strip()
    fresh = _loaded.get(module.__name__) is not module
    if setting == _threads_applied and not fresh:
        return
    threads = int(setting) if setting.isdigit() else -1
    if setting and not 1 <= threads <= MOST_THREADS:
        rule = f"a whole number from 1 (the calling thread only) to {MOST_THREADS}"
        raise ConfigError(f"{ENV_THREADS} must be {rule}, got {setting!r}")
    _loaded[module.__name__] = module
    for each in _loaded.values() if setting != _threads_applied else (module,):
        spread = getattr(each, "spread_threads", None)  # an extension built before it lacks it
        if spread is not None:
            spread(threads if setting else 0)
    _threads_applied = setting


def _switched_off() -> bool:
    setting = os.environ.get(ENV_NATIVE, "1").strip()
    if setting not in ("0", "1"):
        raise ConfigError(
            f"{ENV_NATIVE} must be 0 (numpy's steps) or 1 (the compiled ones, where built), got {setting!r}"
        )
    return setting == "0"
