"""SharedHostRegion on its own: who may open it, locking and liveness, removal, corrupt files, errors.

Cases that could crash the interpreter (unmapped memory, SIGBUS) run in a subprocess, so a
regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import offload_core.region as shared
from offload_core import InvalidSpecError, OffloadError, SharedHostRegion
from offload_core.errors import RegionError, ResourceInUseError

PAGE = mmap.PAGESIZE
JOIN_S = 60  # a bound on every wait for a child process, never reached when things work

# the layout of SharedHostRegion(name, num_blocks=2, canonical_bytes=64): header page + 2 rows
LAYOUT = {"num_blocks": 2, "row_stride": PAGE, "canonical": True, "slots": [64]}
SIZE = 3 * PAGE


def small(name, directory, **kw):
    kw = {"num_blocks": 2, "canonical_bytes": 64, **kw}
    return SharedHostRegion(name, directory=directory, **kw)


def write_file(path, data=b"", size=None, mode=0o600):
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        if size is not None:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


def header(body) -> bytes:
    return shared._MAGIC + (body if isinstance(body, bytes) else json.dumps(body).encode()) + b"\0"


@contextlib.contextmanager
def held(path):
    """Hold `path` the way a live rank does (a shared flock on an open file)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        yield
    finally:
        os.close(fd)


def python(code: str, timeout=JOIN_S) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (no torch import unless the code maps a region)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


# ---- layout --------------------------------------------------------------------


def test_direct_slots_side_by_side_in_page_aligned_rows(tmp_path):
    with SharedHostRegion("e", num_blocks=4, slot_bytes=[100, 200], rank=1, directory=tmp_path) as reg:
        assert (reg.slot_offset, reg.slot_bytes, reg.row_stride) == (100, 200, PAGE)
        assert reg.path == tmp_path / "e.shm" and reg.size == 5 * PAGE and reg.is_creator
        assert tuple(reg.tensor.shape) == (4, PAGE) and not reg.canonical
        assert reg.tensor.nbytes == 4 * PAGE
        with pytest.raises(InvalidSpecError, match="laid out as"):
            SharedHostRegion("e", num_blocks=5, slot_bytes=[100, 200], directory=tmp_path)
        with pytest.raises(InvalidSpecError, match="laid out as"):
            SharedHostRegion("e", num_blocks=4, canonical_bytes=300, directory=tmp_path)
        reg.check()  # the failed joiners left it alone
    with pytest.raises(InvalidSpecError, match="rank 2 out of range"):
        SharedHostRegion("e", num_blocks=4, slot_bytes=[100, 200], rank=2, directory=tmp_path)
    with pytest.raises(InvalidSpecError, match="exactly one"):
        SharedHostRegion("e", num_blocks=4, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_canonical_area_and_a_joiner_see_the_same_bytes(tmp_path):
    with (
        small("c", tmp_path, canonical_bytes=PAGE + 1, rank=3) as a,
        small("c", tmp_path, canonical_bytes=PAGE + 1) as b,
    ):
        assert (a.slot_offset, a.slot_bytes, a.row_stride, a.canonical) == (0, PAGE + 1, 2 * PAGE, True)
        assert a.is_creator and not b.is_creator and a.generation == b.generation
        a.tensor[1, 5] = 42
        assert int(b.tensor[1, 5]) == 42
        assert bytes(b.tensor.numpy().ravel()[a.row_stride + 5 : a.row_stride + 6]) == b"\x2a"


# ---- who may open it -----------------------------------------------------------


def test_default_directory_is_private_to_the_user(monkeypatch, tmp_path):
    monkeypatch.setattr(shared, "SHM_ROOT", tmp_path)
    private = tmp_path / f"offload-core-{os.geteuid()}"
    with SharedHostRegion("d", num_blocks=1, canonical_bytes=8) as reg:
        assert reg.path == private / "d.shm"
        assert private.lstat().st_mode & 0o777 == 0o700
        assert reg.path.stat().st_mode & 0o777 == 0o600
    assert shared.default_directory() == private and list(private.iterdir()) == []


def _other_users(path):
    os.mkdir(path, 0o700)
    os.chown(path, 65534, 65534)


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda p: (os.mkdir(p), os.chmod(p, 0o750)), "mode 0o750"),
        (lambda p: (os.mkdir(p), os.chmod(p, 0o1777)), "mode 0o777"),
        (_other_users, "owned by uid 65534"),
        (
            lambda p: (os.mkdir(p.with_name("elsewhere"), 0o700), os.symlink(p.with_name("elsewhere"), p)),
            "symbolic link",
        ),
        (lambda p: write_file(p), "not a directory"),
    ],
    ids=["group-readable", "world-writable", "other-owner", "symlink", "file"],
)
def test_an_unsafe_default_directory_is_refused(monkeypatch, tmp_path, make, problem):
    if problem.startswith("owned") and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    monkeypatch.setattr(shared, "SHM_ROOT", tmp_path)
    private = tmp_path / f"offload-core-{os.geteuid()}"
    make(private)
    with pytest.raises(RegionError, match=problem) as info:
        SharedHostRegion("d", num_blocks=1, canonical_bytes=8)
    assert str(private) in str(info.value) and "directory=" in str(info.value)


def test_an_explicit_directory_must_exist(tmp_path):
    with pytest.raises(RegionError, match=f"{tmp_path / 'missing'} does not exist"):
        small("x", tmp_path / "missing")
    write_file(tmp_path / "plain")
    with pytest.raises(RegionError, match="not a directory"):
        small("x", tmp_path / "plain")


def test_an_explicit_directory_others_may_change_is_refused_unless_sticky(tmp_path):
    """In a directory others may write without the sticky bit, another user could rename one
    engine's live region to another's name, which would then join it."""
    shared_dir = tmp_path / "open"
    shared_dir.mkdir()
    os.chmod(shared_dir, 0o777)
    with pytest.raises(RegionError, match="0o777: other users may rename or replace"):
        small("x", shared_dir)
    os.chmod(shared_dir, 0o1777)  # as /dev/shm and /tmp: only a file's owner may rename it
    with small("x", shared_dir) as reg:
        assert reg.is_creator


def test_a_file_with_a_second_name_is_refused(tmp_path):
    """A hard link would let an engine of another name share this one's bytes."""
    with small("a", tmp_path) as reg:
        os.link(reg.path, tmp_path / "b.shm")
        with pytest.raises(RegionError, match="2 names"):
            small("b", tmp_path, timeout=1)
        os.unlink(tmp_path / "b.shm")


def test_a_temporary_name_that_cannot_be_removed_leaves_no_region(monkeypatch, tmp_path):
    unlink = os.unlink

    def refuse_temporary(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.EIO, "Input/output error")
        return unlink(path, *args, **kwargs)

    fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(shared.os, "unlink", refuse_temporary)
    with pytest.raises(RegionError, match="cannot remove .*tmp while creating"):
        small("u", tmp_path)
    monkeypatch.setattr(shared.os, "unlink", unlink)
    assert not (tmp_path / "u.shm").exists() and len(os.listdir("/proc/self/fd")) == fds
    with small("u", tmp_path, timeout=1) as reg:  # nothing of it blocks the next try
        assert reg.is_creator


def test_closing_after_the_directory_was_moved_is_no_error(tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    reg = small("m", directory)
    os.rename(directory, tmp_path / "moved")
    write_file(directory)  # a plain file where the directory was: the path cannot be looked at
    reg.close()
    assert (tmp_path / "moved" / "m.shm").exists()  # not the closer's to remove any more


def test_two_threads_closing_one_region_both_return(tmp_path):
    errors = []
    for i in range(30):
        reg = small(f"c{i}", tmp_path)
        barrier = threading.Barrier(4)

        def close():
            barrier.wait()
            try:
                reg.close()
            except Exception as exc:  # noqa: BLE001 - any is the failure
                errors.append(exc)

        threads = [threading.Thread(target=close) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
    assert errors == [] and list(tmp_path.iterdir()) == []


def test_another_users_file_is_refused_and_left_alone(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = tmp_path / "x.shm"
    write_file(path, header({"layout": LAYOUT, "token": "t"}), SIZE)
    os.chown(path, 65534, 65534)
    with pytest.raises(RegionError, match=r"owned by uid 65534.*remove it"):
        small("x", tmp_path)
    assert path.exists()


@pytest.mark.parametrize("mode", [0o666, 0o640, 0o604])
def test_a_file_open_to_other_users_is_refused(tmp_path, mode):
    write_file(tmp_path / "x.shm", header({"layout": LAYOUT, "token": "t"}), SIZE, mode=mode)
    with pytest.raises(RegionError, match=f"mode {mode:#o}.*0600"):
        small("x", tmp_path)


def test_a_symlink_at_the_path_is_not_followed(tmp_path):
    with small("target", tmp_path) as target:
        (tmp_path / "x.shm").symlink_to(target.path)
        with pytest.raises(RegionError, match="symbolic link"):
            small("x", tmp_path)
        target.tensor[0, 0] = 1  # still its own, untouched region
        target.check()
    assert (tmp_path / "x.shm").is_symlink()


def test_something_else_at_the_path_is_refused(tmp_path):
    (tmp_path / "x.shm").mkdir()
    with pytest.raises(RegionError, match="x.shm"):
        small("x", tmp_path)


# ---- liveness ------------------------------------------------------------------


def test_an_old_style_pid_header_is_never_joined(tmp_path):
    """v1 trusted a pid in the header: a file naming a live pid (ours) was joined whoever made it."""
    path = tmp_path / "x.shm"
    old = b"offload-core region v1\n" + json.dumps({"layout": LAYOUT, "pid": os.getpid()}).encode() + b"\0"
    write_file(path, old, SIZE)
    with small("x", tmp_path) as reg:  # nobody holds it: reclaimed
        assert reg.is_creator and path.read_bytes().startswith(shared._MAGIC)
    write_file(path, old, SIZE)
    with held(path), pytest.raises(RegionError, match="not an offload-core v2 region"):  # in use: refused
        small("x", tmp_path)


@pytest.mark.parametrize(
    "content, size",
    [
        (header(b"{not json"), SIZE),
        (header(b"\xff\xfe"), SIZE),
        (header([1, 2]), SIZE),
        (header({"layout": LAYOUT}), SIZE),
        (header({"layout": LAYOUT, "pid": 1}), SIZE),
        (header({"layout": {**LAYOUT, "num_blocks": "2"}, "token": "t"}), SIZE),
        (header({"layout": {**LAYOUT, "slots": [-64]}, "token": "t"}), SIZE),
        (shared._MAGIC + b"x" * (PAGE - len(shared._MAGIC)), SIZE),  # no terminator
        (header({"layout": LAYOUT, "token": "t"}), SIZE - PAGE),  # truncated
        (header({"layout": LAYOUT, "token": "t"}), 100),
        (header({"layout": LAYOUT, "token": "t"}), SIZE + PAGE),
    ],
    ids=["garbage", "not-utf8", "list", "no-token", "pid", "str-count", "negative", "no-nul", "short", "tiny", "long"],
)
def test_a_corrupt_file_in_use_is_a_region_error(tmp_path, content, size):
    path = tmp_path / "x.shm"
    write_file(path, content, size)
    with held(path), pytest.raises(RegionError, match=f"{path}.*remove the file"):
        small("x", tmp_path, timeout=5)
    assert path.exists()  # in use by someone: not ours to remove


def test_a_corrupt_file_nobody_holds_is_replaced(tmp_path):
    write_file(tmp_path / "x.shm", header(b"garbage"), 7)
    with small("x", tmp_path) as reg:
        assert reg.is_creator and reg.path.stat().st_size == SIZE


def test_joiner_times_out_on_a_creator_that_never_finishes(tmp_path):
    write_file(tmp_path / "slow.shm", size=SIZE)  # no header yet, and a live holder
    with held(tmp_path / "slow.shm"), pytest.raises(OffloadError, match="timed out waiting for the creator of"):
        small("slow", tmp_path, timeout=0.1)


def test_a_file_left_by_a_creator_that_died_while_creating_is_reclaimed_at_once(tmp_path):
    write_file(tmp_path / "old.shm")
    with small("old", tmp_path, timeout=0) as reg:  # no wait needed: nobody holds it
        assert reg.is_creator


def test_a_creator_that_dies_before_its_header_is_reclaimed_while_a_joiner_waits(tmp_path):
    path = tmp_path / "mid.shm"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import fcntl, os, time
            fd = os.open({str(path)!r}, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, {SIZE})
            print("ready", flush=True)
            time.sleep(0.3)
            os._exit(1)  # dies mid-initialisation: no header
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with small("mid", tmp_path, timeout=JOIN_S) as reg:  # v1 waited for a minute of mtime here
            assert reg.is_creator
    finally:
        child.kill()
        child.wait(JOIN_S)
    assert list(tmp_path.iterdir()) == []


def _create_and_die(name, directory):
    small(name, directory)
    os._exit(1)  # a crash: no close, the file stays


def test_a_region_whose_creator_crashed_is_reclaimed(tmp_path):
    p = mp.get_context("spawn").Process(target=_create_and_die, args=("crash", str(tmp_path)))
    p.start()
    p.join(JOIN_S)
    assert p.exitcode == 1 and (tmp_path / "crash.shm").exists()
    with small("crash", tmp_path, timeout=0) as reg:
        assert reg.is_creator
    assert list(tmp_path.iterdir()) == []


def _creator(directory, ready, created, die):
    reg = small("live", directory)
    reg.tensor[0, 0] = 11
    ready.put((reg.is_creator, reg.path.stat().st_ino))
    created.set()
    die.wait(JOIN_S)
    os._exit(1)  # killed while a joiner still uses the region


def _joiner(directory, ready, created, release):
    created.wait(JOIN_S)
    with small("live", directory) as reg:
        reg.tensor[0, 1] = 22
        ready.put((reg.is_creator, reg.path.stat().st_ino))
        release.wait(JOIN_S)
        reg.check()


def test_a_restarted_creator_joins_the_file_a_live_joiner_still_uses(tmp_path):
    """v1 saw the creator's pid dead, removed the file and made a new one: two ranks, two regions."""
    ctx = mp.get_context("spawn")
    ready, created, die, release = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    creator = ctx.Process(target=_creator, args=(str(tmp_path), ready, created, die))
    joiner = ctx.Process(target=_joiner, args=(str(tmp_path), ready, created, release))
    creator.start()
    joiner.start()
    try:
        assert ready.get(timeout=JOIN_S)[0]
        is_creator, inode = ready.get(timeout=JOIN_S)
        assert not is_creator
        die.set()
        creator.join(JOIN_S)
        assert creator.exitcode == 1
        with small("live", tmp_path) as reg:
            assert not reg.is_creator and reg.path.stat().st_ino == inode
            assert reg.tensor[0, :2].tolist() == [11, 22]
            release.set()
            joiner.join(JOIN_S)
            assert joiner.exitcode == 0
            assert reg.path.exists()  # the joiner left, we still use it
        assert list(tmp_path.iterdir()) == []  # the last one out removed it
    finally:
        die.set()
        release.set()
        for p in (creator, joiner):
            if p.is_alive():
                p.kill()
            p.join(JOIN_S)


def test_the_last_one_out_removes_the_file_not_the_creator(tmp_path):
    a = small("r", tmp_path)
    b = small("r", tmp_path)
    c = small("r", tmp_path)
    a.close()  # the creator leaves first
    assert b.path.exists()
    b.check()
    c.close()
    b.tensor[1, 0] = 5
    b.close()
    b.close()  # twice is fine
    assert list(tmp_path.iterdir()) == []


def test_the_last_one_out_waits_for_a_rank_that_just_ended_to_let_go(tmp_path, monkeypatch):
    """A rank that just ended can hold its lock a moment past its /proc entries: the last
    closer waits a little for it, but never removes a file a live rank holds."""
    monkeypatch.setattr(shared, "_LAST_USER_S", 30.0)  # a bound never reached: the holder lets go first
    a = small("r", tmp_path)
    fd = os.open(a.path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # the dying rank's lock
    refused = threading.Event()
    try_flock = shared._try_flock

    def watched(fd, kind):
        locked = try_flock(fd, kind)
        if not locked and kind == fcntl.LOCK_EX:
            refused.set()
        return locked

    monkeypatch.setattr(shared, "_try_flock", watched)
    letting_go = threading.Thread(target=lambda: (refused.wait(30), os.close(fd)))
    letting_go.start()  # lets go only once the closer has found it held
    a.close()
    letting_go.join()
    assert refused.is_set() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shared, "_LAST_USER_S", 0.05)
    b = small("r", tmp_path)
    with held(b.path):  # a live rank, past the wait
        b.close()
        assert b.path.exists()


def test_check_fails_loudly_once_the_file_is_removed_or_replaced(tmp_path):
    old = small("g", tmp_path)
    old.check()
    old.path.unlink()
    with pytest.raises(RegionError, match="removed or replaced while this rank used it.*restart every rank"):
        old.check()
    new = small("g", tmp_path)  # a rank starting now makes another region
    assert new.is_creator and new.generation != old.generation
    with pytest.raises(RegionError, match="removed or replaced"):
        old.check()
    new.check()
    old.close()  # the last user of the old file must not remove the new one
    new.check()
    new.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RegionError, match="closed"):
        new.check()
    assert new.tensor is None


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_closing_its_copy_leaves_the_region_to_its_parent(tmp_path):
    """A forked child shares the parent's lock: had its close taken the lock exclusively, it would
    have removed the file the parent still uses (and left the parent's lock exclusive)."""
    reg = small("f", tmp_path)
    pid = os.fork()
    if pid == 0:
        try:
            reg.close()
        finally:
            os._exit(0)
    for _ in range(JOIN_S * 100):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish")
    assert os.waitstatus_to_exitcode(status) == 0
    reg.check()
    with small("f", tmp_path, timeout=0) as other:  # joins: the parent's lock is still shared
        assert not other.is_creator
    reg.close()
    assert list(tmp_path.iterdir()) == []


def test_temporary_files_of_creators_that_died_are_swept(tmp_path):
    """Only old, unlocked temporaries of this very name go: a creator that has just made its
    file and not yet locked it, or another region whose name starts with this one, keeps its own."""
    dead, live, young = (tmp_path / f".s.{pid}.{tag * 16}.tmp" for pid, tag in ((123, "d"), (456, "e"), (789, "f")))
    other = tmp_path / f".s.x.123.{'a' * 16}.tmp"  # region "s.x"
    for path in (dead, live, young, other):
        write_file(path)
    old = time.time() - 3600
    for path in (dead, live, other):
        os.utime(path, (old, old))
    with held(live), small("s", tmp_path):
        assert not dead.exists() and live.exists() and young.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, young, other))


# ---- closing while views are alive -------------------------------------------


def _close_with_views(directory, out):
    import torch
    from helpers import small_kv

    from offload_core import OffloadWorker

    seen = []
    reg = SharedHostRegion("v", num_blocks=4, slot_bytes=[64 * 16], directory=directory)
    view = reg.tensor[1, 8:16].view(torch.int8)
    try:
        reg.close()
    except ResourceInUseError as exc:
        seen.append(("view", isinstance(exc, BufferError), "drop" in str(exc)))
    view.fill_(7)  # still mapped: a segfault here would fail the test through the exit code
    seen.append(("usable", reg.tensor[1, 8:16].tolist() == [7] * 8))
    reg.check()
    del view
    mv = memoryview(reg.tensor.numpy())  # a buffer export, as another tier might hold
    try:
        reg.close()
    except ResourceInUseError:
        seen.append(("memoryview",))
    del mv
    worker = OffloadWorker(small_kv(pages=(64,), blocks=16), 4, blocks_per_chunk=16, backend="cpu", host_region=reg)
    try:
        reg.close()
    except ResourceInUseError as exc:
        seen.append(("worker", "worker" in str(exc)))
    worker.shutdown()
    reg.close()
    seen.append(("closed", not reg.path.exists()))
    out.put(seen)


def test_close_refuses_while_views_are_alive_and_the_region_stays_usable(tmp_path):
    """v1 unmapped under live views: the next access was a segfault."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_close_with_views, args=(str(tmp_path), out))
    p.start()
    try:
        seen = out.get(timeout=JOIN_S)
    finally:
        p.join(JOIN_S)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert seen == [("view", True, True), ("usable", True), ("memoryview",), ("worker", True), ("closed", True)]
    assert list(tmp_path.iterdir()) == []


# ---- no room ---------------------------------------------------------------------


def test_no_room_for_the_region_is_a_region_error_and_leaves_nothing(monkeypatch, tmp_path):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RegionError, match=rf"no room for the {SIZE}-byte region .*{tmp_path}.*--shm-size"):
        small("full", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_full_tmpfs_is_a_region_error_not_sigbus(tmp_path):
    """v1 sized the file sparsely and touched its pages: SIGBUS on a full tmpfs, the file left behind."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        run = python(f"""
            from offload_core.region import SharedHostRegion
            from offload_core.errors import RegionError
            try:
                SharedHostRegion("big", num_blocks=512, canonical_bytes=4096, directory={str(mount)!r})
            except RegionError as exc:
                print(exc)
                raise SystemExit(3)
        """)
        assert run.returncode == 3, run.stderr  # -7 would be SIGBUS
        assert "no room for the" in run.stdout and str(mount) in run.stdout
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_region_larger_than_host_memory_is_refused_before_anything_is_made(tmp_path):
    with pytest.raises(OffloadError, match="host memory"):
        SharedHostRegion("huge", num_blocks=2**40, canonical_bytes=PAGE, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---- bad arguments ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["a/b", "../x", "x" * 129, "a\0b", "", ".hidden", "-x", "a b", "a\n", 5, None, b"x"])
def test_bad_names(tmp_path, name):
    with pytest.raises(InvalidSpecError, match=r"region name .* is not allowed: use 1 to 128 characters") as info:
        small(name, tmp_path)
    assert repr(name) in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_the_longest_name_is_fine(tmp_path):
    with small("a._-" + "x" * 124, tmp_path) as reg:
        assert reg.path.name == "a._-" + "x" * 124 + ".shm"


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"num_blocks": 2.5}, "num_blocks must be a positive integer, got 2.5"),
        ({"num_blocks": True}, "num_blocks must be a positive integer, got True"),
        ({"num_blocks": None}, "num_blocks must be a positive integer, got None"),
        ({"num_blocks": "2"}, "num_blocks must be a positive integer, got '2'"),
        ({"num_blocks": 0}, "num_blocks must be a positive integer, got 0"),
        ({"rank": -1}, "rank must be an integer >= 0, got -1"),
        ({"rank": 1.0}, "rank must be an integer >= 0, got 1.0"),
        ({"canonical_bytes": 2.5}, "canonical_bytes must be a positive integer, got 2.5"),
        ({"canonical_bytes": 0}, "canonical_bytes must be a positive integer, got 0"),
        ({"canonical_bytes": None, "slot_bytes": [64, 2.5]}, r"slot_bytes\[1\] must be a positive integer, got 2.5"),
        ({"canonical_bytes": None, "slot_bytes": [True]}, r"slot_bytes\[0\] must be a positive integer, got True"),
        ({"canonical_bytes": None, "slot_bytes": [64, -1]}, r"slot_bytes\[1\] must be a positive integer, got -1"),
        ({"canonical_bytes": None, "slot_bytes": []}, "one size per rank, got none"),
        ({"canonical_bytes": None, "slot_bytes": "64"}, "slot_bytes must be a sequence"),
        ({"canonical_bytes": None, "slot_bytes": 64}, "slot_bytes must be a sequence"),
        ({"canonical_bytes": None, "slot_bytes": [1] * 2000}, "2000 slots do not fit"),
        ({"timeout": -1}, "timeout must be a number of seconds from 0 to 1000000, got -1"),
        ({"timeout": 2**2000}, "timeout must be a number of seconds"),
        ({"timeout": "5"}, "timeout must be a number of seconds"),
        ({"timeout": float("nan")}, "timeout must be a number of seconds"),
        ({"timeout": None}, "timeout must be a number of seconds"),
    ],
)
def test_bad_sizes_name_the_value_and_the_rule(tmp_path, kw, message):
    with pytest.raises(InvalidSpecError, match=message):
        small("x", tmp_path, **kw)
    assert list(tmp_path.iterdir()) == []


def test_slot_sizes_that_are_not_a_sequence_are_refused_by_name(tmp_path):
    np = pytest.importorskip("numpy")
    with pytest.raises(InvalidSpecError, match="slot_bytes must be a sequence of sizes"):
        small("s", tmp_path, canonical_bytes=None, slot_bytes=np.array(64))


def test_numpy_integers_are_integers(tmp_path):
    np = pytest.importorskip("numpy")
    with small("n", tmp_path, num_blocks=np.int64(3), canonical_bytes=np.int32(64), timeout=np.float64(1)) as reg:
        assert reg.num_blocks == 3 and type(reg.num_blocks) is int


@pytest.mark.parametrize("directory, message", [("", "non-empty path"), ("a\0b", "without NUL")])
def test_bad_directories_are_refused(directory, message):
    with pytest.raises(InvalidSpecError, match=message):
        SharedHostRegion("d", num_blocks=1, canonical_bytes=64, directory=directory)


def test_check_fails_loudly_once_the_file_is_truncated(tmp_path):
    with small("t", tmp_path) as reg:
        os.truncate(reg.path, 4096)
        with pytest.raises(RegionError, match="truncated"):
            reg.check()
        os.truncate(reg.path, reg.size)  # so that close() can finish normally


def test_a_region_dropped_without_close_lets_go_of_its_file_once_its_views_are_gone(tmp_path):
    import gc

    reg = small("g", tmp_path)
    view = reg.tensor[0]
    del reg
    gc.collect()
    with small("g", tmp_path, timeout=0) as other:  # still held through the view: joined
        assert not other.is_creator
    del view
    gc.collect()
    with small("g", tmp_path, timeout=0) as again:  # nobody holds it now: reclaimed
        assert again.is_creator


def test_a_region_nobody_holds_is_removed_when_another_is_made(tmp_path):
    """An engine that crashed leaves its file, under a name no later engine uses: the next
    region made in the directory removes it; one still held stays, and so do other files."""
    import subprocess
    import sys

    crash = (
        "import os, sys; from offload_core import SharedHostRegion; "
        "SharedHostRegion('crashed', num_blocks=2, slot_bytes=[4096], directory=sys.argv[1]); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", crash, str(tmp_path)], check=True)
    assert (tmp_path / "crashed.shm").exists()
    live = SharedHostRegion("live", num_blocks=2, slot_bytes=[4096], directory=tmp_path)
    (tmp_path / "other.shm").write_bytes(b"not a region")
    with SharedHostRegion("next", num_blocks=2, slot_bytes=[4096], directory=tmp_path):
        assert not (tmp_path / "crashed.shm").exists()
        assert live.path.exists() and (tmp_path / "other.shm").exists()
    live.close()


def test_a_directory_that_cannot_be_listed_still_takes_a_region(monkeypatch, tmp_path):
    """Writable but not readable (mode 0300 for a user who is not root): the sweeps of files left
    by crashed ranks are skipped; the region's own file is made and opened by name."""
    import pathlib

    def unlistable(self, *args):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "iterdir", unlistable)
    monkeypatch.setattr(pathlib.Path, "glob", unlistable)
    with SharedHostRegion("hidden", num_blocks=2, slot_bytes=[4096, 4096], directory=tmp_path) as reg:
        reg.tensor[:] = 7
        again = SharedHostRegion("hidden", num_blocks=2, slot_bytes=[4096, 4096], rank=1, directory=tmp_path)
        assert int(again.tensor[0, 0]) == 7
        again.close()
