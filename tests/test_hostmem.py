"""What `hostmem` says is available: the machine's MemAvailable, or less where a memory cgroup
(a container's limit) leaves less, read from stand-in /proc and /sys trees."""

import pytest

from offload_core import hostmem

GIB = 2**30


@pytest.fixture
def fake_kernel(tmp_path):
    """A stand-in root with /proc and /sys under tmp_path: write(name, text) makes ``meminfo``
    (proc/meminfo), ``cgroup`` (proc/self/cgroup) or ``sys/...`` (under sys/fs/cgroup)."""

    def write(name, text):
        path = tmp_path / where(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("meminfo", f"MemTotal: {512 * GIB // 1024} kB\nMemAvailable: {400 * GIB // 1024} kB\n")
    return write


def where(name):
    if name in ("meminfo", "cgroup"):
        return {"meminfo": "proc/meminfo", "cgroup": "proc/self/cgroup"}[name]
    return "sys/fs/cgroup" + name.removeprefix("sys")


@pytest.fixture
def available(tmp_path):
    return lambda: hostmem.available_host_bytes(root=str(tmp_path))


def test_without_a_cgroup_limit_the_machine_decides(fake_kernel, available):
    fake_kernel("cgroup", "0::/job\n")
    fake_kernel("sys/job/memory.max", "max\n")
    assert available() == 400 * GIB


@pytest.mark.parametrize("where", ["sys/job", "sys"])  # the cgroup's directory, or mounted as the root
def test_a_cgroup_v2_limit_below_the_machine_decides(fake_kernel, where, available):
    fake_kernel("cgroup", "0::/job\n")
    fake_kernel(f"{where}/memory.max", f"{128 * GIB}\n")
    fake_kernel(f"{where}/memory.current", f"{30 * GIB}\n")
    fake_kernel(f"{where}/memory.stat", f"anon 1\ninactive_file {2 * GIB}\nactive_file {GIB}\nshmem 7\n")
    assert available() == 101 * GIB  # 128 - 30 + 3 of page cache the kernel drops first


def test_a_cgroup_v1_limit_below_the_machine_decides(fake_kernel, available):
    fake_kernel("cgroup", "5:cpu,cpuacct:/\n4:memory:/job\n0::/\n")
    fake_kernel("sys/memory/job/memory.limit_in_bytes", f"{64 * GIB}\n")
    fake_kernel("sys/memory/job/memory.usage_in_bytes", f"{4 * GIB}\n")
    fake_kernel("sys/memory/job/memory.stat", f"cache 9\ntotal_inactive_file {GIB}\n")
    assert available() == 61 * GIB


def test_a_cgroup_v1_without_a_limit_is_ignored(fake_kernel, available):
    fake_kernel("cgroup", "4:memory:/\n")
    fake_kernel("sys/memory/memory.limit_in_bytes", "9223372036854771712\n")
    fake_kernel("sys/memory/memory.usage_in_bytes", f"{4 * GIB}\n")
    assert available() == 400 * GIB


def test_a_cgroup_over_its_limit_leaves_nothing(fake_kernel, available, tmp_path):
    fake_kernel("cgroup", "0::/\n")
    fake_kernel("sys/memory.max", f"{GIB}\n")
    fake_kernel("sys/memory.current", f"{2 * GIB}\n")
    assert available() == 0
    with pytest.raises(hostmem.OffloadError, match="host buffer needs 1.0 MiB of host memory, but only 0.0 MiB"):
        hostmem.check_host_bytes(2**20, "host buffer", root=str(tmp_path))


def test_unreadable_files_fall_back_to_what_can_be_read(fake_kernel, available):
    fake_kernel("cgroup", "0::/job\n")
    fake_kernel("sys/job/memory.max", "garbage\n")
    assert available() == 400 * GIB


def test_a_limit_on_a_parent_cgroup_binds_its_children(fake_kernel, available):
    # a batch scheduler's layout: the job's cgroup has the limit, the task's below it none
    fake_kernel("cgroup", "0::/slice/job_1/step_0/task_0\n")
    fake_kernel("sys/slice/job_1/step_0/task_0/memory.max", "max\n")
    fake_kernel("sys/slice/job_1/step_0/task_0/memory.current", f"{GIB}\n")
    fake_kernel("sys/slice/job_1/memory.max", f"{64 * GIB}\n")
    fake_kernel("sys/slice/job_1/memory.current", f"{60 * GIB}\n")
    fake_kernel("sys/slice/memory.max", f"{256 * GIB}\n")
    fake_kernel("sys/slice/memory.current", f"{100 * GIB}\n")
    assert available() == 4 * GIB


def test_a_cgroup_v1_inherited_limit_counts_where_only_the_leaf_is_visible(fake_kernel, available):
    fake_kernel("cgroup", "4:memory:/\n")
    fake_kernel("sys/memory/memory.limit_in_bytes", "9223372036854771712\n")
    fake_kernel("sys/memory/memory.usage_in_bytes", f"{4 * GIB}\n")
    fake_kernel("sys/memory/memory.stat", f"hierarchical_memory_limit {16 * GIB}\ntotal_active_file {GIB}\n")
    assert available() == 13 * GIB


def test_a_cgroup_v1_memory_controller_mounted_with_another(fake_kernel, available):
    fake_kernel("cgroup", "3:cpu,memory:/job\n")
    fake_kernel("sys/cpu,memory/job/memory.limit_in_bytes", f"{8 * GIB}\n")
    fake_kernel("sys/cpu,memory/job/memory.usage_in_bytes", f"{2 * GIB}\n")
    assert available() == 6 * GIB


def test_a_cgroup_path_that_is_not_utf8_is_read_as_bytes(fake_kernel, tmp_path, available):
    fake_kernel("cgroup", "")
    (tmp_path / "proc/self/cgroup").write_bytes(b"0::/job\xff\n")
    directory = tmp_path / "sys/fs/cgroup" / "job\udcff"  # the name's byte, as the file system has it
    directory.mkdir(parents=True)
    (directory / "memory.max").write_text(f"{2 * GIB}\n")
    (directory / "memory.current").write_text(f"{GIB}\n")
    assert available() == GIB


def test_what_is_not_a_file_is_not_read(fake_kernel, available, tmp_path):
    """A FIFO (never waited on), a device (never read without end) or a huge sparse file in place
    of a kernel file: that file counts as unreadable."""
    import os

    fake_kernel("cgroup", "0::/job\n")
    (tmp_path / "sys/fs/cgroup/job").mkdir(parents=True)
    os.mkfifo(tmp_path / "sys/fs/cgroup/job/memory.max")
    fake_kernel("sys/job/memory.current", f"{GIB}\n")
    assert available() == 400 * GIB
    (tmp_path / "proc/meminfo").unlink()
    (tmp_path / "proc/meminfo").symlink_to("/dev/zero")
    assert available() is not None  # the machine's physical memory, from sysconf
    with open(tmp_path / "proc/self/cgroup", "wb") as f:
        f.truncate(1 << 40)
    assert available() is not None


@pytest.mark.parametrize(
    "cgroup, files",
    [
        ("0::/../../../../outside\n", {}),  # out of the mount (tmp_path/sys/fs/cgroup): not read
        ("7:../../../../outside/x,memory:/\n", {}),
        ("0::" + "/a" * 5000 + "\n", {}),  # deeper than any real one: not read
        ("0::/job\n", {"sys/job/memory.max": "-1\n", "sys/job/memory.current": "0\n"}),
        ("0::/job\n", {"sys/job/memory.max": "\u0661\u0660\u0660\n", "sys/job/memory.current": "0\n"}),  # not ASCII
        ("0::/job\n", {"sys/job/memory.max": "1_0\n", "sys/job/memory.current": "0\n"}),
    ],
)
def test_odd_cgroup_files_leave_the_machine_to_decide(fake_kernel, available, tmp_path, cgroup, files):
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)  # a path through it leads out only where it exists
    for outside in (tmp_path.parent / "outside", tmp_path.parent / "outside/x,memory"):  # where they lead
        outside.mkdir(parents=True, exist_ok=True)
        for name in ("memory.max", "memory.limit_in_bytes"):
            (outside / name).write_text(f"{GIB}\n")
        for name in ("memory.current", "memory.usage_in_bytes"):
            (outside / name).write_text("0\n")
    fake_kernel("cgroup", cgroup)
    for name, text in files.items():
        fake_kernel(name, text)
    assert available() == 400 * GIB


def test_a_negative_memavailable_is_not_believed(fake_kernel, available):
    fake_kernel("meminfo", "MemTotal: 1 kB\nMemAvailable: -5 kB\n")
    assert available() is None or available() > 0


@pytest.mark.parametrize("nbytes", ["5", 2.5, -1, True, None])
def test_a_size_that_is_not_one_is_named(nbytes, tmp_path):
    with pytest.raises(hostmem.InvalidSpecError, match="host buffer: a size of host memory must be a non-negative"):
        hostmem.check_host_bytes(nbytes, "host buffer", root=str(tmp_path))


def test_a_size_beyond_any_machine_is_refused_in_words(fake_kernel, tmp_path):
    with pytest.raises(hostmem.OffloadError, match=r"needs \d+ GiB of host memory, but only 400.00 GiB"):
        hostmem.check_host_bytes(10**400, "host buffer", root=str(tmp_path))
