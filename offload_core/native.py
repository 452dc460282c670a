"""The optional compiled steps of the hot path (`offload_core._native`, from _native.c), and the
loader a backend's own compiled module goes through (`load`).

Each does what a numpy (or ctypes) function next to it does, which stays the reference and the
fallback where the extension was not built or ``OFFLOAD_CORE_NATIVE=0``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from offload_core.errors import ConfigError

ENV_NATIVE = "OFFLOAD_CORE_NATIVE"
NATIVE = "offload_core._native"


def load(name: str = NATIVE) -> ModuleType | None:
    """The compiled module `name` (offload_core's own, or a backend's); None where it is not
    built or switched off.

    Raises:
        ConfigError: ``OFFLOAD_CORE_NATIVE`` is set to anything but 0 or 1.
    """
    if _switched_off():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def status() -> str:
    """``"built"``, ``"off"`` (``OFFLOAD_CORE_NATIVE=0``) or ``"not built"`` (no C compiler or
    Python headers at install), of offload_core's steps, for `offload-core backends`.

    Raises:
        ConfigError: as `load`.
    """
    if _switched_off():
        return "off"
    return "built" if load() is not None else "not built"


def _switched_off() -> bool:
    setting = os.environ.get(ENV_NATIVE, "").strip() or "1"  # empty: unset, as every variable here
    if setting not in ("0", "1"):
        raise ConfigError(
            f"{ENV_NATIVE} must be 0 (numpy's steps) or 1 (the compiled ones, where built), got {setting!r}"
        )
    return setting == "0"
