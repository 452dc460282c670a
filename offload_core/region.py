"""SharedHostRegion: the host memory that the ranks of one engine share, in one file in /dev/shm.

Rows are host blocks, page-aligned. Each row holds either one slot per rank, side by side
(the direct layout), or one canonical area that every rank writes into (the canonical layout).
Exactly one process creates the file; the others join it. A header at the start records the
layout, so that a joiner with other expectations fails loudly, and the creator's pid, so that a
file left behind by a crash is recognised and replaced at the next start.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import time
from typing import Sequence

import numpy as np

from offload_core.errors import InvalidSpecError, OffloadError

_MAGIC = b"offload-core region v1\n"
_HEADER = mmap.PAGESIZE  # the layout, as JSON after the magic; rows start on the next page


class SharedHostRegion:
    """Create or join the region `name`.

    Args:
        name: the engine instance's name; the file is ``<directory>/offload-core-<name>.shm``.
        num_blocks: host blocks (rows).
        rank: this process's rank.
        slot_bytes: per rank, the bytes of its slot in a row (direct layout); or
        canonical_bytes: the bytes of the one area all ranks share (canonical layout).
        timeout: seconds a joiner waits for the creator to finish.
        directory: where the file lives; default /dev/shm (memory, not disk).

    Raises:
        InvalidSpecError: both or neither of slot_bytes and canonical_bytes, a rank out of range,
            or an existing region laid out differently.
        OffloadError: the creator did not finish within `timeout`, or no space for the file.
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
        directory: str | os.PathLike = "/dev/shm",
    ):
        if (slot_bytes is None) == (canonical_bytes is None):
            raise InvalidSpecError("give exactly one of slot_bytes (per rank) and canonical_bytes")
        if num_blocks < 1:
            raise InvalidSpecError(f"num_blocks must be >= 1, got {num_blocks}")
        slots = [int(canonical_bytes)] if slot_bytes is None else [int(b) for b in slot_bytes]
        if slot_bytes is not None and not 0 <= rank < len(slots):
            raise InvalidSpecError(f"rank {rank} out of range for {len(slots)} slots")
        if min(slots) <= 0:
            raise InvalidSpecError("slot sizes must be positive")
        self.name, self.rank, self.num_blocks = name, rank, int(num_blocks)
        self.canonical = slot_bytes is None
        self.row_stride = -(-sum(slots) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._slots = slots
        self.layout = {"num_blocks": self.num_blocks, "row_stride": self.row_stride, "canonical": self.canonical, "slots": slots}
        self.path = pathlib.Path(directory) / f"offload-core-{name}.shm"
        self.size = _HEADER + self.num_blocks * self.row_stride
        self.is_creator = False
        self._fd = self._open(timeout)
        self._mmap = mmap.mmap(self._fd, self.size)
        self.tensor = _tensor_view(self._mmap, self.num_blocks, self.row_stride)
        if self.is_creator:
            self._publish()

    # ---- where this rank's bytes are -----------------------------------------

    @property
    def slot_offset(self) -> int:
        """Offset of this rank's slot within a row (0 for the canonical area)."""
        return 0 if self.canonical else sum(self._slots[: self.rank])

    @property
    def slot_bytes(self) -> int:
        return self._slots[0 if self.canonical else self.rank]

    def memoryview(self) -> memoryview:
        """A zero-copy view of every row, for tiers that read the region from another process."""
        return memoryview(self._mmap)[_HEADER:]

    # ---- life cycle ---------------------------------------------------------

    def close(self) -> None:
        """Release the mapping (views first), the file descriptor, and, for the creator, the file.

        Raises:
            BufferError: tensors or memoryviews made from this region are still alive.
        """
        if self._mmap is None:
            return
        self.tensor = None
        self._mmap.close()
        self._mmap = None
        os.close(self._fd)
        if self.is_creator:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SharedHostRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                fd = self._join(deadline)
                if fd is not None:
                    return fd
                continue  # a stale file was removed: try to create again
            try:
                os.ftruncate(fd, self.size)
            except OSError as exc:
                os.close(fd)
                self.path.unlink(missing_ok=True)
                raise OffloadError(f"no room for a {self.size}-byte region in {self.path.parent}: {exc}") from exc
            self.is_creator = True
            return fd

    def _join(self, deadline: float) -> int | None:
        """Open the existing file once its creator is done; None if it was stale and removed."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                return None
            header = _read_header(fd)
            if header is not None:
                if header["layout"] != self.layout:
                    os.close(fd)
                    raise InvalidSpecError(
                        f"region {self.path} is laid out as {header['layout']}, this rank expects {self.layout}"
                    )
                if _alive(header["pid"]) or header["pid"] == os.getpid():
                    return fd
            creator = None if header is None else header["pid"]
            os.close(fd)
            if header is not None or _stale_without_header(self.path):
                # the creator died (before or after finishing): nobody will use this file again
                self.path.unlink(missing_ok=True)
                return None
            if time.monotonic() > deadline:
                raise OffloadError(f"timed out waiting for the creator of {self.path} (pid {creator})")
            time.sleep(0.005)

    def _publish(self) -> None:
        pages = np.frombuffer(self._mmap, dtype=np.uint8)
        pages[_HEADER :: mmap.PAGESIZE] = 0  # fault every page in now, not during the first transfer
        del pages
        body = json.dumps({"layout": self.layout, "pid": os.getpid()}).encode()
        self._mmap[len(_MAGIC) : len(_MAGIC) + len(body) + 1] = body + b"\0"
        self._mmap[: len(_MAGIC)] = _MAGIC  # written last: joiners read the header only after it


def _tensor_view(buffer: mmap.mmap, rows: int, stride: int):
    import torch

    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat[_HEADER:].view(rows, stride)


def _read_header(fd: int) -> dict | None:
    raw = os.pread(fd, _HEADER, 0)
    if not raw.startswith(_MAGIC):
        return None
    return json.loads(raw[len(_MAGIC) :].split(b"\0", 1)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_without_header(path: pathlib.Path, grace: float = 60.0) -> bool:
    """A file with no header yet whose creator has had ample time: it died while creating."""
    try:
        return time.time() - path.stat().st_mtime > grace
    except FileNotFoundError:
        return False
