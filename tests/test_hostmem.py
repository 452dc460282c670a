"""What `hostmem` says is available: the machine's MemAvailable, or less where a memory cgroup
(a container's limit) leaves less, read from stand-in /proc and /sys trees."""

import pytest

from offload_core import hostmem

GIB = 2**30


@pytest.fixture
def fake_kernel(tmp_path, monkeypatch):
    """Point hostmem at files under tmp_path: write(relative path, text) makes one."""

    def write(name, text):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    monkeypatch.setattr(hostmem, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(hostmem, "CGROUPS", str(tmp_path / "cgroup"))
    monkeypatch.setattr(hostmem, "CGROUP_ROOT", str(tmp_path / "sys"))
    write("meminfo", f"MemTotal: {512 * GIB // 1024} kB\nMemAvailable: {400 * GIB // 1024} kB\n")
    return write


def test_without_a_cgroup_limit_the_machine_decides(fake_kernel):
    fake_kernel("cgroup", "0::/job\n")
    fake_kernel("sys/job/memory.max", "max\n")
    assert hostmem.available_host_bytes() == 400 * GIB


@pytest.mark.parametrize("where", ["sys/job", "sys"])  # the cgroup's directory, or mounted as the root
def test_a_cgroup_v2_limit_below_the_machine_decides(fake_kernel, where):
    fake_kernel("cgroup", "0::/job\n")
    fake_kernel(f"{where}/memory.max", f"{128 * GIB}\n")
    fake_kernel(f"{where}/memory.current", f"{30 * GIB}\n")
    fake_kernel(f"{where}/memory.stat", f"anon 1\ninactive_file {2 * GIB}\nactive_file 5\n")
    assert hostmem.available_host_bytes() == 100 * GIB  # 128 - 30 + 2 of droppable file cache


def test_a_cgroup_v1_limit_below_the_machine_decides(fake_kernel):
    fake_kernel("cgroup", "5:cpu,cpuacct:/\n4:memory:/job\n0::/\n")
    fake_kernel("sys/memory/job/memory.limit_in_bytes", f"{64 * GIB}\n")
    fake_kernel("sys/memory/job/memory.usage_in_bytes", f"{4 * GIB}\n")
    fake_kernel("sys/memory/job/memory.stat", f"cache 9\ntotal_inactive_file {GIB}\n")
    assert hostmem.available_host_bytes() == 61 * GIB


def test_a_cgroup_v1_without_a_limit_is_ignored(fake_kernel):
    fake_kernel("cgroup", "4:memory:/\n")
    fake_kernel("sys/memory/memory.limit_in_bytes", "9223372036854771712\n")
    fake_kernel("sys/memory/memory.usage_in_bytes", f"{4 * GIB}\n")
    assert hostmem.available_host_bytes() == 400 * GIB


def test_a_cgroup_over_its_limit_leaves_nothing(fake_kernel):
    fake_kernel("cgroup", "0::/\n")
    fake_kernel("sys/memory.max", f"{GIB}\n")
    fake_kernel("sys/memory.current", f"{2 * GIB}\n")
    assert hostmem.available_host_bytes() == 0
    with pytest.raises(hostmem.OffloadError, match="host buffer needs 1.0 MiB of host memory, but only 0.0 MiB"):
        hostmem.check_host_bytes(2**20, "host buffer")


def test_unreadable_files_fall_back_to_what_can_be_read(fake_kernel):
    fake_kernel("cgroup", "0::/job\n")
    fake_kernel("sys/job/memory.max", "garbage\n")
    assert hostmem.available_host_bytes() == 400 * GIB
