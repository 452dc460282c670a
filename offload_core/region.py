"""SharedHostRegion: the host memory that the ranks of one engine share, in one file in /dev/shm.

Rows are page-aligned host blocks, each holding one slot per rank side by side (direct layout)
or one area every rank writes into (canonical layout). A header records the layout, so that a
joiner expecting another fails loudly.

Only the user who made it may open it: the file lives in ``/dev/shm/offload-core-<euid>/`` (0700,
this user's, not a symlink; a directory given instead must be this user's or root's, writable by
others only with the sticky bit), no open follows a symlink, and only a regular file of this
user, without group or other permissions, with one name (no hard link) and of its header's
size, is used; anything else is a `RegionError`.

Liveness: every process that has the region open holds a shared `flock` on it, which the kernel
drops when the process dies, so a file that can be locked exclusively has no live user and is
made afresh. The creator locks the file under a temporary name and publishes it with `link`,
reserves the memory (`posix_fallocate`: a full tmpfs is a `RegionError`, not SIGBUS) and writes
the header last; joiners wait for the header. The last process to close removes the file (a
closer waits up to `_LAST_USER_S` for ranks that have just ended to let go of it), and
making a region also removes this user's regions in its directory that nobody holds. Should the
file be removed or replaced anyway, `check()` raises. A forked child shares its parent's lock:
only the parent's close counts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import logging
import mmap
import numbers
import os
import pathlib
import re
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from offload_core.errors import InvalidSpecError, OffloadError, RegionError, ResourceInUseError, integer
from offload_core.hostmem import check_host_bytes

SHM_ROOT = pathlib.Path("/dev/shm")  # memory, not disk; the per-user directory goes here

log = logging.getLogger(__name__)

_MAGIC = b"offload-core region v2\n"  # v1 files (pid liveness) are never joined
_HEADER = mmap.PAGESIZE  # magic, then the JSON header and a NUL; rows start on the next page
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NAME_RULE = "1 to 128 characters from A-Z a-z 0-9 . _ -, the first a letter or digit"
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_POLL_S = 0.005
_MAX_TIMEOUT_S = 1e6
_TMP_AGE_S = 60.0  # a temporary file this old belongs to a creator that died before publishing
_LOCK_GRACE_S = 1.0  # exclusive locks are held only for an unlink: wait this long even with timeout=0
# A rank that has just ended, even one already reaped, can hold its lock a moment longer (the
# kernel lets go of the file late), with no /proc entry that shows it: a closer tries this long
# to find itself the last user.
_LAST_USER_S = 0.25


def default_directory() -> pathlib.Path:
    """This user's directory for regions, ``SHM_ROOT/offload-core-<euid>``, made 0700 if absent.

    Raises:
        RegionError: it cannot be made, or it is not a directory of this user that only this
            user may enter (a symlink, another user's, or with group or other permissions).
    """
    path = pathlib.Path(SHM_ROOT) / f"offload-core-{os.geteuid()}"
    fix = "remove it (as its owner or root) or pass directory= to use another one"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RegionError(
            f"cannot make the region directory {path}: {exc.strerror}; pass directory= to use another one"
        ) from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RegionError(f"cannot inspect the region directory {path}: {exc.strerror}; {fix}") from None
    if stat.S_ISLNK(st.st_mode):
        raise RegionError(f"the region directory {path} is a symbolic link, which another user may have planted; {fix}")
    _check_private(st, f"the region directory {path}", True, fix)
    return path


class SharedHostRegion:
    """Create or join the region `name` (who may open it, and when it is made, joined or removed:
    see the module docstring).

    Args:
        name: the engine instance's name, 1 to 128 characters from ``A-Za-z0-9._-``, the first
            a letter or digit; the file is ``<directory>/<name>.shm``.
        num_blocks: host blocks (rows).
        rank: this process's rank.
        slot_bytes: per rank, the bytes of its slot in a row (direct layout); or
        canonical_bytes: the bytes of the one area all ranks share (canonical layout).
        timeout: seconds a joiner waits for the creator to finish.
        directory: where the file lives: this user's or root's, and writable by others only
            with the sticky bit (as /dev/shm); by default `default_directory()`,
            ``/dev/shm/offload-core-<euid>`` (memory, not disk; only this user may enter).

    Attributes:
        tensor: the rows, a (num_blocks, row_stride) uint8 tensor over the mapping.
        is_creator: whether this process created the file.
        generation: a random token from the header: the same for every rank of one file, new for each file.

    Raises:
        InvalidSpecError: a bad name or size (not an integer, or not positive), both or neither
            of slot_bytes and canonical_bytes, a rank out of range, or an existing region in use
            laid out differently.
        RegionError: the directory or the file is not safe to use (a symlink, another user's, with
            group or other permissions, a file with a second name), the file is corrupt or
            truncated, or there is no room for it.
        OffloadError: the region needs more host memory than is available, or the creator did not
            finish within `timeout`.
    """

    def __init__(
        self,
        name: str,
        *,
        num_blocks: int,
        rank: int = 0,
        slot_bytes: Sequence[int] | None = None,
        canonical_bytes: int | None = None,
        timeout: float = 30.0,
        directory: str | os.PathLike | None = None,
    ):
        self._mmap: mmap.mmap | None = None
        self._closer: weakref.finalize | None = None
        self._closing = threading.Lock()  # one close at a time: a worker's thread may close it beside the caller's
        self._fd = -1
        self.tensor = None
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidSpecError(f"region name {name!r} is not allowed: use {_NAME_RULE}")
        num_blocks = integer(num_blocks, "num_blocks", 1)
        rank = integer(rank, "rank", 0)
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 <= timeout <= _MAX_TIMEOUT_S:
            raise InvalidSpecError(
                f"timeout must be a number of seconds from 0 to {_MAX_TIMEOUT_S:.0f}, got {timeout!r}"
            )
        if (slot_bytes is None) == (canonical_bytes is None):
            raise InvalidSpecError("give exactly one of slot_bytes (per rank) and canonical_bytes")
        if slot_bytes is None:
            slots = [integer(canonical_bytes, "canonical_bytes", 1)]
        else:
            try:
                if isinstance(slot_bytes, (str, bytes)):
                    raise TypeError
                slots = [integer(b, f"slot_bytes[{i}]", 1) for i, b in enumerate(slot_bytes)]
            except TypeError:  # not iterable (a 0-d array among them)
                raise InvalidSpecError(
                    f"slot_bytes must be a sequence of sizes, one per rank, got {slot_bytes!r}"
                ) from None
            if not slots:
                raise InvalidSpecError("slot_bytes must give one size per rank, got none")
            if rank >= len(slots):
                raise InvalidSpecError(f"rank {rank} out of range for {len(slots)} slots")
        self.name, self.rank, self.num_blocks = name, rank, num_blocks
        self.canonical = slot_bytes is None
        self.row_stride = -(-sum(slots) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._slots = slots
        self.layout = dict(num_blocks=num_blocks, row_stride=self.row_stride, canonical=self.canonical, slots=slots)
        if len(_MAGIC) + len(_header_body(self.layout, "0" * 32)) + 1 > _HEADER:
            raise InvalidSpecError(
                f"{len(slots)} slots do not fit the region's {_HEADER}-byte header; use fewer ranks per region"
            )
        self.size = _HEADER + self.num_blocks * self.row_stride
        self.path = (default_directory() if directory is None else _given_directory(directory)) / f"{name}.shm"
        self.is_creator = False
        self.generation: str | None = None
        self._identity: tuple[int, int] | None = None
        self._pid = os.getpid()
        self._open(float(timeout))
        # Dropped without close(): the fd, and so the lock, go with the mapping and its last view.
        self._closer = weakref.finalize(self._mmap, os.close, self._fd)

    @property
    def slot_offset(self) -> int:
        """Offset of this rank's slot within a row (0 for the canonical area)."""
        return 0 if self.canonical else sum(self._slots[: self.rank])

    @property
    def slot_bytes(self) -> int:
        return self._slots[0 if self.canonical else self.rank]

    def check(self) -> None:
        """Confirm that the file at `path` is still the one this rank has mapped (one stat).

        Raises:
            RegionError: the file was removed or replaced, so ranks that open it from now on
                would use another region than this one; or the region is closed.
        """
        if self._identity is None or self._mmap is None:
            raise RegionError(f"region {self.path} is closed")
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._identity:
            raise RegionError(
                f"region {self.path} was removed or replaced while this rank used it; "
                "ranks would no longer share it: restart every rank"
            )
        if st.st_size != self.size:  # touching a page past a shortened file's end is SIGBUS
            raise RegionError(
                f"region {self.path} is {st.st_size} bytes, not {self.size}: something truncated it while "
                "ranks used it; restart every rank"
            )

    def close(self) -> None:
        """Release the mapping and the lock; the last process to close removes the file.

        Raises:
            ResourceInUseError: tensors or memoryviews made from this region (a worker's, say)
                are still alive; the region stays open and usable.
        """
        with self._closing:
            if self._mmap is None:
                return
            self.tensor = None
            try:
                self._mmap.close()
            except BufferError:
                gc.collect()  # views kept alive only by reference cycles (a traceback's frames) go now
                try:
                    self._mmap.close()
                except BufferError:
                    self.tensor = self._tensor()
                    raise ResourceInUseError(
                        f"region {self.path} is still in use by tensors or memoryviews made from it (or a worker "
                        "using it): shut the worker down and drop those views before closing the region"
                    ) from None
            self._closer.detach()  # before the mapping goes: this close releases the fd itself
            self._mmap = None
            self._release()

    def __enter__(self) -> SharedHostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            attempt += 1
            if attempt > 2 and time.monotonic() > deadline:  # two passes: a stale file removed, then ours made
                raise OffloadError(f"timed out opening {self.path}: it kept being removed or replaced")
            try:
                fd = os.open(self.path, _OPEN)
            except FileNotFoundError:
                if self._create():
                    return
                continue  # another process published it first: join theirs
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise RegionError(
                        f"{self.path} is a symbolic link; a region must be a regular file of this user: "
                        "remove the link (and restart every rank)"
                    ) from None
                hint = "; it is not this user's region: remove it or pass directory="
                raise RegionError(
                    f"cannot open {self.path}: {exc.strerror}"
                    + (hint if exc.errno in (errno.EACCES, errno.EPERM) else "")
                ) from None
            if self._join(fd, deadline):
                return

    def _create(self) -> bool:
        """Make and publish the file; False when another process published one first."""
        check_host_bytes(self.size, f"shared region {self.path}")
        directory = self.path.parent
        self._sweep()
        tmp = directory / f".{self.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, _OPEN | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise RegionError(f"cannot create a region file in {directory}: {exc.strerror}") from None
        published = False
        try:
            os.fchmod(fd, 0o600)  # a umask may have taken our own read or write bit
            # Held from before the file is visible: a file at `path` that can be locked
            # exclusively therefore never has a live creator.
            fcntl.flock(fd, fcntl.LOCK_SH)
            # Only the size here, not the memory: ranks that start together all get here, and
            # reserving the whole region in each would need their number times the space.
            os.ftruncate(fd, self.size)
            try:
                os.link(tmp, self.path)  # atomic, and never replaces a file another rank published
            except (FileExistsError, FileNotFoundError):
                # another rank published first (or, in a race we lost, swept our temporary file):
                # join theirs, or try again
                return False
            published = True
        except OSError as exc:
            raise RegionError(f"cannot create the region {self.path}: {exc.strerror}") from None
        finally:
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            except OSError as exc:
                # the file would keep a second name, which joiners refuse: withdraw it (no rank
                # joins before the header)
                if published and _open_at(self.path, fd):
                    with contextlib.suppress(OSError):
                        os.unlink(self.path)
                published = False
                raise RegionError(f"cannot remove {tmp} while creating {self.path}: {exc.strerror}") from None
            finally:
                if not published:
                    os.close(fd)
        st = os.fstat(fd)
        self._fd, self._identity, self.is_creator = fd, (st.st_dev, st.st_ino), True
        try:
            try:
                # Memory a tmpfs cannot supply surfaces here, not as SIGBUS on first touch.
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                raise RegionError(
                    f"no room for the {self.size}-byte region {self.path} in {directory}: {exc.strerror}; "
                    f"free space there, ask for a smaller region, or give {directory} more room "
                    "(a larger /dev/shm, e.g. docker run --shm-size=...)"
                ) from None
            self._map(fd)
            self.tensor[:, :: mmap.PAGESIZE] = 0  # fault every page in now, not during the first transfer
            self.generation = secrets.token_hex(16)
            body = _header_body(self.layout, self.generation)
            self._mmap[len(_MAGIC) : len(_MAGIC) + len(body) + 1] = body + b"\0"
            self._mmap[: len(_MAGIC)] = _MAGIC  # written last: joiners read the header only after it
        except BaseException:
            self.tensor = None
            if self._mmap is not None:
                self._mmap.close()
                self._mmap = None
            self._release()  # no joiner holds it before the header: this removes the file
            raise
        return True

    def _join(self, fd: int, deadline: float) -> bool:
        """Map the file open at `fd` once its creator is done; False (fd closed) to start over."""
        joined = False
        try:
            _check_private(os.fstat(fd), str(self.path), False, "remove it (and restart every rank) or pass directory=")
            while True:
                if _try_flock(fd, fcntl.LOCK_EX):
                    # Nobody holds it: every user died or left without removing it.
                    self._unlink_if_at_path(fd)
                    return False
                start = os.pread(fd, len(_MAGIC), 0)
                if start == _MAGIC:
                    break
                if any(b and b != m for b, m in zip(start, _MAGIC)):
                    raise RegionError(
                        f"{self.path} is not an offload-core v2 region (another version's or program's file) "
                        "and is in use: stop what uses it, remove it, and restart every rank"
                    )
                if time.monotonic() >= deadline:
                    raise OffloadError(f"timed out waiting for the creator of {self.path}")
                time.sleep(_POLL_S)
            grace = max(deadline, time.monotonic() + _LOCK_GRACE_S)
            while not _try_flock(fd, fcntl.LOCK_SH):
                if time.monotonic() >= grace:
                    raise OffloadError(f"timed out waiting to join {self.path}: another process holds it exclusively")
                time.sleep(_POLL_S)
            if not _open_at(self.path, fd):
                return False  # removed (its last user left) or replaced since we opened it
            links = os.fstat(fd).st_nlink  # the creator unlinked its temporary name before the magic
            if links != 1:
                raise RegionError(
                    f"{self.path} has {links} names (hard links): under another one, another engine could "
                    "share these bytes; remove them all and restart every rank"
                )
            header = _parse_header(os.pread(fd, _HEADER, 0))
            if header is None:  # the creator's stores of body and magic may reach this CPU out of order
                time.sleep(_POLL_S)
                header = _parse_header(os.pread(fd, _HEADER, 0))
            if header is None:
                raise RegionError(f"region {self.path} has a corrupt header; remove the file and restart every rank")
            size = os.fstat(fd).st_size
            expected = _HEADER + header["layout"]["num_blocks"] * header["layout"]["row_stride"]
            if size != expected:
                raise RegionError(
                    f"region {self.path} is {size} bytes, but its header says {expected}: it is truncated "
                    "or corrupt; remove the file and restart every rank"
                )
            if header["layout"] != self.layout:
                raise InvalidSpecError(
                    f"region {self.path} is laid out as {header['layout']}, this rank expects {self.layout}"
                )
            self._map(fd)
            st = os.fstat(fd)
            self._fd, self._identity, self.generation = fd, (st.st_dev, st.st_ino), header["token"]
            joined = True
            return True
        finally:
            if not joined:
                os.close(fd)

    def _map(self, fd: int) -> None:
        try:
            self._mmap = mmap.mmap(fd, self.size)
        except (OSError, ValueError) as exc:
            raise RegionError(f"cannot map the {self.size}-byte region {self.path}: {exc}") from None
        self.tensor = self._tensor()

    def _tensor(self):
        import torch

        # torch keeps the memoryview, which holds an export of the mmap: while any view of the
        # tensor lives, the mmap refuses to close (BufferError) instead of leaving it dangling.
        flat = torch.frombuffer(memoryview(self._mmap)[_HEADER:], dtype=torch.uint8)
        return flat.view(self.num_blocks, self.row_stride)

    def _release(self) -> None:
        fd, self._fd = self._fd, -1
        try:
            # A forked child shares its parent's lock (one open file description): only the
            # process that opened the region may decide it is the last user.
            if os.getpid() == self._pid and _lock_within(fd, _LAST_USER_S):
                self._unlink_if_at_path(fd)
        finally:
            os.close(fd)

    def _unlink_if_at_path(self, fd: int) -> None:
        if _open_at(self.path, fd):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise RegionError(f"cannot remove the unused region {self.path}: {exc.strerror}") from None

    def _sweep(self) -> None:
        """Remove what dead processes left in the directory: this region's temporary files whose
        creator died before publishing, and this user's other regions that no process holds."""
        try:
            entries = list(self.path.parent.iterdir())
        except OSError as exc:  # writable but not readable, say: the region's own file is opened by name
            log.debug("not sweeping: %s", exc)
            return
        temporary = re.compile(rf"\.{re.escape(self.name)}\.\d+\.[0-9a-f]{{16}}\.tmp")
        for entry in entries:
            is_temporary = bool(temporary.fullmatch(entry.name))
            if not is_temporary and (not entry.name.endswith(".shm") or entry == self.path):
                continue
            try:
                fd = os.open(entry, _OPEN)
            except OSError:
                continue
            try:
                if _unheld(fd, is_temporary) and _open_at(entry, fd):
                    os.unlink(entry)
                    log.info("removed %s (%d bytes), which no process held", entry, os.fstat(fd).st_size)
            except OSError:
                pass  # another process removed it first
            finally:
                os.close(fd)


def _check_private(st: os.stat_result, what: str, directory: bool, fix: str) -> None:
    """Raise `RegionError` unless `what` is a directory (0700) or a regular file (0600) of this user's."""
    kind, mode = ("directory", "0700") if directory else ("regular file", "0600")
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(st.st_mode):
        raise RegionError(f"{what} is not a {kind}; {fix}")
    if st.st_uid != os.geteuid():
        raise RegionError(
            f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): that user could read or "
            f"change the KV data; {fix}"
        )
    if st.st_mode & 0o077:
        raise RegionError(
            f"{what} has mode {st.st_mode & 0o777:#o}, which lets other users read or change the KV data; "
            f"it must be {mode}: {fix}"
        )


def _open_at(path: pathlib.Path, fd: int) -> bool:
    """Whether `path` is (still) the file open at `fd`."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:  # gone, or its directory is (moved, unreadable): not ours to remove or join
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _unheld(fd: int, temporary: bool) -> bool:
    """Whether the file open at `fd` is this user's region (or, where `temporary`, a temporary file
    older than `_TMP_AGE_S`) that no process holds."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return False
    if temporary:
        if time.time() - st.st_mtime <= _TMP_AGE_S:
            return False
    elif os.pread(fd, len(_MAGIC), 0) != _MAGIC:
        return False  # not a region: someone else's file in a directory the caller chose
    return _try_flock(fd, fcntl.LOCK_EX)


def _lock_within(fd: int, seconds: float) -> bool:
    """Whether the file open at `fd` could be locked exclusively within `seconds` (a failed try
    drops this process's shared lock: it holds none while it waits)."""
    deadline = time.monotonic() + seconds
    while not _try_flock(fd, fcntl.LOCK_EX):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _try_flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _given_directory(directory: Any) -> pathlib.Path:
    try:
        path = pathlib.Path(directory)
    except TypeError:
        raise InvalidSpecError(f"directory must be a path, got {directory!r}") from None
    if not str(directory) or "\0" in str(directory):
        raise InvalidSpecError(f"directory must be a non-empty path without NUL, got {directory!r}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RegionError(f"the region directory {path} does not exist; create it or pass another directory=") from None
    except OSError as exc:
        raise RegionError(f"cannot use the region directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RegionError(f"the region directory {path} is not a directory; pass another directory=")
    if st.st_uid not in (os.geteuid(), 0):
        raise RegionError(
            f"the region directory {path} is owned by uid {st.st_uid}, neither this user (uid {os.geteuid()}) nor "
            "root: its owner could replace the region's file; pass another directory="
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise RegionError(
            f"the region directory {path} has mode {st.st_mode & 0o7777:#o}: other users may rename or replace "
            "files in it (group or other writable without the sticky bit); pass another directory="
        )
    return path


def _header_body(layout: dict, token: str) -> bytes:
    return json.dumps({"layout": layout, "token": token}).encode()


def _parse_header(raw: bytes) -> dict | None:
    if not raw.startswith(_MAGIC):
        return None
    body, nul, _ = raw[len(_MAGIC) :].partition(b"\0")
    if not nul:
        return None
    try:
        header = json.loads(body)
    except (ValueError, RecursionError):  # also UnicodeDecodeError; absurdly nested JSON
        return None
    if not isinstance(header, dict) or set(header) != {"layout", "token"} or not isinstance(header["token"], str):
        return None
    layout = header["layout"]
    if not isinstance(layout, dict) or set(layout) != {"num_blocks", "row_stride", "canonical", "slots"}:
        return None
    counts = [layout["num_blocks"], layout["row_stride"]] + (
        layout["slots"] if isinstance(layout["slots"], list) else [None]
    )
    if not all(type(n) is int and n > 0 for n in counts) or not isinstance(layout["canonical"], bool):
        return None
    if layout["row_stride"] % mmap.PAGESIZE:
        return None
    return header
