"""How much host memory can still be had, so that a large allocation is refused with a message
instead of ending in the out-of-memory killer (zero-filled and pinned memory is touched at once)."""

from __future__ import annotations

import os

from offload_core.errors import OffloadError

_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def available_host_bytes(root: str = "/") -> int | None:
    """Host memory this process can get without swapping: the kernel's ``MemAvailable`` (else
    all physical memory), or less where the process's memory cgroup (a container's limit) leaves
    less; None where nothing can be read.

    Args:
        root: where the kernel's ``proc`` and ``sys`` file systems are mounted.
    """
    machine = _meminfo_available(os.path.join(root, "proc/meminfo"))
    if machine is None:
        try:
            machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            machine = None
    group = _cgroup_headroom(os.path.join(root, "proc/self/cgroup"), os.path.join(root, "sys/fs/cgroup"))
    if machine is None or group is None:
        return group if machine is None else machine
    return min(machine, group)


def _meminfo_available(meminfo: str) -> int | None:
    try:
        with open(meminfo, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Per cgroup version: the limit's file, the usage's, the page cache in memory.stat (the kernel
# drops it before it kills; MemAvailable counts it too), and a limit inherited from above.
_V2 = ("memory.max", "memory.current", ("active_file", "inactive_file"), None)
_V1 = (
    "memory.limit_in_bytes",
    "memory.usage_in_bytes",
    ("total_active_file", "total_inactive_file"),
    "hierarchical_memory_limit",
)


def _cgroup_headroom(cgroups: str, cgroup_root: str) -> int | None:
    """The least headroom (limit less usage, page cache counted free) of the process's memory
    cgroup and every cgroup above it, for cgroup v2 and v1; None where none has a limit or
    nothing can be read."""
    try:
        with open(cgroups, "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()  # paths are bytes
    except OSError:
        return None
    least, seen = None, set()
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            spec, bases = _V2, [cgroup_root]
        elif "memory" in controllers.split(","):  # v1 mounts it alone, or with others ("cpu,memory")
            spec, bases = _V1, [f"{cgroup_root}/memory", f"{cgroup_root}/{controllers}"]
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for base in bases:
            # from the process's own cgroup up to the root: a parent's limit binds the children
            # (inside a container the own cgroup is usually mounted as the root: only that is read)
            for depth in range(len(parts), -1, -1):
                directory = "/".join([base, *parts[:depth]])
                if directory in seen:
                    continue
                seen.add(directory)
                headroom = _headroom(directory, spec)
                if headroom is not None:
                    least = headroom if least is None else min(least, headroom)
    return least


def _headroom(directory: str, spec: tuple) -> int | None:
    limit_file, usage_file, cache_keys, inherited_key = spec
    try:
        with open(os.path.join(directory, limit_file)) as f:
            text = f.read().strip()
        limit = None if text == "max" else int(text)
        with open(os.path.join(directory, usage_file)) as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    stat: dict[str, int] = {}
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in cache_keys or key == inherited_key:
                    stat[key] = int(value)
    except (OSError, ValueError):
        pass
    if inherited_key in stat:
        limit = stat[inherited_key] if limit is None else min(limit, stat[inherited_key])
    if limit is None or limit >= _NO_LIMIT:
        return None
    return max(0, limit - used + sum(stat.get(key, 0) for key in cache_keys))


def check_host_bytes(nbytes: int, what: str, root: str = "/") -> None:
    """Refuse to allocate `nbytes` of host memory for `what` where less is available
    (`available_host_bytes` under `root`).

    Raises:
        OffloadError: more than the available host memory is asked for; the message names
            both sizes.
    """
    available = available_host_bytes(root)
    if available is not None and nbytes > available:
        raise OffloadError(
            f"{what} needs {gib(nbytes)} of host memory, but only {gib(available)} is available; ask for less"
        )


def gib(nbytes: int) -> str:
    """`nbytes` for people: MiB below a GiB, GiB above."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
