"""How much host memory can still be had, so that a large allocation is refused with a message
instead of ending in the out-of-memory killer (zero-filled and pinned memory is touched at once)."""

from __future__ import annotations

import contextlib
import os
import stat

from offload_core.errors import InvalidSpecError, OffloadError

_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63
_MAX_READ = 1 << 20  # more than any of these files holds
_MAX_DEPTH = 64  # cgroups nested deeper are not read (real ones nest a handful deep)


def available_host_bytes(root: str = "/") -> int | None:
    """Host memory this process can get without swapping: the kernel's ``MemAvailable`` (else
    all physical memory), or less where the process's memory cgroup (a container's limit) leaves
    less; None where nothing can be read.

    Args:
        root: where the kernel's ``proc`` and ``sys`` file systems are mounted.
    """
    machine = None
    for line in (_read(os.path.join(root, "proc/meminfo")) or b"").splitlines():
        if line.startswith(b"MemAvailable:"):
            fields = line.split()
            kib = _number(fields[1]) if len(fields) > 1 else None
            machine = None if kib is None else kib * 1024
            break
    if machine is None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    group = _cgroup_headroom(os.path.join(root, "proc/self/cgroup"), os.path.join(root, "sys/fs/cgroup"))
    return min((n for n in (machine, group) if n is not None), default=None)


def _read(path: str) -> bytes | None:
    """The start of a regular file (at most `_MAX_READ` bytes), else None: never waits on a FIFO or device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], _MAX_READ
        while left:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _number(text: bytes | str | None) -> int | None:
    """A non-negative decimal number as the kernel writes it (ASCII digits only), else None."""
    text = (text or "").strip()
    return int(text) if 0 < len(text) <= 20 and text.isdigit() and text.isascii() else None


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
    """The least headroom (limit less usage, page cache counted free) of the process's memory cgroup
    and every cgroup above it (v2 and v1); None where none has a limit or nothing can be read."""
    text = _read(cgroups)
    if text is None:
        return None
    least, seen = None, set()
    lines = text.decode("utf-8", "surrogateescape").splitlines()  # paths are bytes
    for line in lines[:_MAX_DEPTH]:  # a line per hierarchy: a handful
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            spec, bases = _V2, [cgroup_root]
        elif "memory" in controllers.split(",") and "/" not in controllers:  # v1: alone, or with others
            spec, bases = _V1, [f"{cgroup_root}/memory", f"{cgroup_root}/{controllers}"]
        else:
            continue
        parts = [p for p in path.split("/") if p]
        if len(parts) > _MAX_DEPTH or any(p in (".", "..") for p in parts):  # never read outside the mount
            continue
        for base in bases:
            # from the own cgroup up to the root: a parent's limit binds the children
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
    text = (_read(os.path.join(directory, limit_file)) or b"").strip()
    limit = None if text == b"max" else _number(text)
    used = _number(_read(os.path.join(directory, usage_file)))
    if (limit is None and text != b"max") or used is None:
        return None
    stat_: dict[str, int] = {}
    for line in (_read(os.path.join(directory, "memory.stat")) or b"").decode("ascii", "replace").splitlines():
        key, _, value = line.partition(" ")
        number = _number(value) if key in cache_keys or key == inherited_key else None
        if number is not None:
            stat_[key] = number
    if inherited_key in stat_:
        limit = stat_[inherited_key] if limit is None else min(limit, stat_[inherited_key])
    if limit is None or limit >= _NO_LIMIT:
        return None
    return max(0, limit - used + sum(stat_.get(key, 0) for key in cache_keys))


def check_host_bytes(nbytes: int, what: str, root: str = "/") -> None:
    """Refuse to allocate `nbytes` of host memory for `what` where less is available
    (`available_host_bytes` under `root`).

    Raises:
        OffloadError: more than the available host memory is asked for; the message names
            both sizes.
        InvalidSpecError: `nbytes` is not a non-negative integer.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidSpecError(f"{what}: a size of host memory must be a non-negative integer, got {nbytes!r}")
    available = available_host_bytes(root)
    if available is not None and nbytes > available:
        raise OffloadError(
            f"{what} needs {gib(nbytes)} of host memory, but only {gib(available)} is available; ask for less"
        )


def gib(nbytes: int) -> str:
    """`nbytes` for people: MiB below a GiB, GiB above."""
    if nbytes >= 2**60:  # beyond any machine, and beyond a float's range too
        return f"{nbytes >> 30} GiB"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
