"""How much host memory can still be had, so that a large allocation is refused with a message
instead of ending in the out-of-memory killer (zero-filled and pinned memory is touched at once)."""

from __future__ import annotations

import os

from offload_core.errors import OffloadError


def available_host_bytes() -> int | None:
    """Host memory the kernel can give without swapping (``MemAvailable``), else all physical
    memory, or None where neither can be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_host_bytes(nbytes: int, what: str) -> None:
    """Refuse to allocate `nbytes` of host memory for `what` where less is available.

    Raises:
        OffloadError: more than the available host memory is asked for; the message names
            both sizes.
    """
    available = available_host_bytes()
    if available is not None and nbytes > available:
        raise OffloadError(
            f"{what} needs {gib(nbytes)} of host memory, but only {gib(available)} is available; ask for less"
        )


def gib(nbytes: int) -> str:
    """`nbytes` for people: MiB below a GiB, GiB above."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
