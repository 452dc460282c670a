"""How much host memory can still be had, so that a large allocation is refused with a message
instead of ending in the out-of-memory killer (zero-filled and pinned memory is touched at once)."""

from __future__ import annotations

import os

from offload_core.errors import OffloadError

# Where the kernel says what this process may use; module attributes so tests can point elsewhere.
MEMINFO = "/proc/meminfo"
CGROUPS = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def available_host_bytes() -> int | None:
    """Host memory this process can get without swapping: the kernel's ``MemAvailable`` (else
    all physical memory), or less where the process's memory cgroup (a container's limit) leaves
    less; None where nothing can be read."""
    machine = _meminfo_available()
    if machine is None:
        try:
            machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            machine = None
    group = _cgroup_headroom()
    if machine is None or group is None:
        return group if machine is None else machine
    return min(machine, group)


def _meminfo_available() -> int | None:
    try:
        with open(MEMINFO, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    """The memory cgroup's limit less what it uses (file cache it can drop not counted), for
    cgroup v2 and v1; None where there is no limit or nothing can be read."""
    try:
        with open(CGROUPS) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            files, base = ("memory.max", "memory.current", "inactive_file"), CGROUP_ROOT
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            base = CGROUP_ROOT + "/memory"
        else:
            continue
        # Inside a container the cgroup's own directory is usually mounted as the root.
        for directory in (base + path.rstrip("/"), base):
            headroom = _headroom(directory, *files)
            if headroom is not None:
                return headroom
    return None


def _headroom(directory: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        with open(os.path.join(directory, limit_file)) as f:
            text = f.read().strip()
        if text == "max" or int(text) >= _NO_LIMIT:
            return None
        with open(os.path.join(directory, usage_file)) as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
                    break
    except (OSError, ValueError):
        pass
    return max(0, int(text) - used + inactive)


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
