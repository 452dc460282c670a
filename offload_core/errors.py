"""The exceptions offload-core raises."""

from __future__ import annotations


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
