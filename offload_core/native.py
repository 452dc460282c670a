"""The optional compiled steps of the hot path (`offload_core._native`, from _native.c).

They do what a numpy function next to them does, which stays the reference and the fallback:
where the extension was not built (no C compiler at install), or ``OFFLOAD_CORE_NATIVE=0`` is
set, everything runs the same in numpy.
"""

from __future__ import annotations

import os
from types import ModuleType

ENV_NATIVE = "OFFLOAD_CORE_NATIVE"


def load() -> ModuleType | None:
    """The compiled module, or None where it is not built or switched off.

    Raises:
        ConfigError: ``OFFLOAD_CORE_NATIVE`` is set to anything but 0 or 1.
    """
    if _switched_off():
        return None
    try:
        from offload_core import _native
    except ImportError:
        return None
    return _native


def status() -> str:
    """``"built"``, ``"off"`` (``OFFLOAD_CORE_NATIVE=0``) or ``"not built"`` (no C compiler or
    Python headers at install: everything runs in numpy), for `offload-core backends`.

    Raises:
        ConfigError: as `load`.
    """
    if _switched_off():
        return "off"
    return "built" if load() is not None else "not built"


def _switched_off() -> bool:
    setting = os.environ.get(ENV_NATIVE, "1").strip()
    if setting not in ("0", "1"):
        from offload_core.errors import ConfigError

        rule = "0 (numpy's steps) or 1 (the compiled ones, where built)"
        raise ConfigError(f"{ENV_NATIVE} must be {rule}, got {setting!r}")
    return setting == "0"
