"""The exceptions offload-core raises, and the checks of a caller's values that raise them."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


class OffloadError(Exception):
    """Base class of every error raised by offload-core."""


class UnknownBackendError(OffloadError, LookupError):
    """A backend name that is neither built in nor registered."""

    def __init__(self, name: object, known: tuple[str, ...], source: str = "", note: str = ""):
        self.name = name
        self.known = known
        self.note = note
        origin = f" (from {source})" if source else ""
        super().__init__(f"unknown offload backend {name!r}{origin}; known backends: {', '.join(known)}{note}")


class BackendUnavailableError(OffloadError, RuntimeError):
    """A known backend that cannot run here (missing SDK, no device, ...).

    Attributes:
        name: the backend's registry name.
        reason: one sentence saying why it is unavailable.
    """

    def __init__(self, name: str, reason: str, hint: str = "", source: str = ""):
        self.name = name
        self.reason = reason
        hint = f" ({hint})" if hint else ""
        origin = f" (from {source})" if source else ""
        super().__init__(
            f"offload backend {name!r}{origin} is unavailable: {reason}{hint}; the host-memory reference backend is "
            "'cpu': pass backend='cpu' or --backend cpu, or set OFFLOAD_CORE_BACKEND=cpu where code names none"
        )


class InvalidSpecError(OffloadError, ValueError):
    """Input that would make a transfer read or write outside its buffers, or is malformed."""


class ConfigError(OffloadError, ValueError):
    """A setting (a constructor argument or an environment variable) outside the values it may take."""


class ResourceInUseError(OffloadError, BufferError):
    """Memory cannot be released yet: tensors made from it, or copies that may touch it, still exist."""


class RegionError(OffloadError):
    """A shared host region that cannot be used safely: wrong owner or permissions, a corrupt
    or replaced file, or no room for it."""


def integer(value: Any, what: str, minimum: int | None = None) -> int:
    """`value` as an int if it is an integer (not bool, float or str), at least `minimum` if given.

    Raises:
        InvalidSpecError: naming `what`, the value and the rule.
    """
    if type(value) is int and (minimum is None or value >= minimum):  # the usual: once per submit
        return value
    rule = "an integer" if minimum is None else "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):  # numpy's, torch's
        raise InvalidSpecError(f"{what} must be {rule}, got {value!r}")
    try:
        number = operator.index(value)
    except Exception:  # TypeError; a tensor on a device without data raises others
        raise InvalidSpecError(f"{what} must be {rule}, got {value!r} ({type(value).__name__})") from None
    if minimum is not None and number < minimum:
        raise InvalidSpecError(f"{what} must be {rule}, got {number}")
    return number


def flag(value: Any, what: str) -> bool:
    """`value` as a bool: True or False (Python's or numpy's), or 0 or 1.

    Raises:
        InvalidSpecError: naming `what` and the value, for anything else (an array, say).
    """
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise InvalidSpecError(f"{what} must be True or False, got {value!r}")


def positive_int(value: Any, what: str) -> int:
    """`value` as an int if it is an integer >= 1 (see `integer`)."""
    return integer(value, what, 1)
