"""The `offload-core` command as an operator runs it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from offload_core import bench, hostmem, registry
from offload_core.cli import bench_report, main
from offload_core.errors import BackendUnavailableError, ConfigError, InvalidSpecError, OffloadError
from offload_core.testing.fake import FakeBackend
from offload_core.testing.fresh_registry import restored_registry

SMALL = ["--blocks", "8", "--blocks-per-job", "4", "--iters", "1"]


@pytest.fixture(autouse=True)
def _no_backend_from_the_shell(monkeypatch):
    """`backends` exits 1 where $OFFLOAD_CORE_BACKEND names a backend that cannot run: each test
    starts from the automatic selection, whatever the shell that runs it has set."""
    monkeypatch.delenv("OFFLOAD_CORE_BACKEND", raising=False)


class Lossy(FakeBackend):
    """Drops the last descriptor of every batch: a bug the benchmark must catch."""

    name = "lossy"

    def copy_batch(self, src, dst, sizes, direction, stream):
        super().copy_batch(src[:-1], dst[:-1], sizes[:-1], direction, stream)
        self.complete_all()


def unavailable(name: str, reason: str, **attributes) -> type:
    """A backend named `name` whose probe says `reason` (plus any class attributes)."""
    return type(
        name.capitalize(), (FakeBackend,), {"name": name, "probe": classmethod(lambda cls: reason), **attributes}
    )


@pytest.fixture
def lossy():
    with restored_registry():
        registry.register_backend("lossy", Lossy)
        yield


def test_version_is_the_installed_distribution_s(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"offload-core {importlib.metadata.version('offload-core')}\n"


def test_backends_table_lists_every_backend_and_the_selected_one(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu", "cuda", "npu", "xpu"):
        assert name in out
    assert "available" in out and "priority" in out and "reason" in out


def test_backends_says_how_it_selected_and_whether_the_compiled_steps_were_built(capsys, monkeypatch):
    monkeypatch.delenv("OFFLOAD_CORE_BACKEND", raising=False)
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", "0")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "by the highest priority available" in out and "compiled steps: off ($OFFLOAD_CORE_NATIVE=0)" in out


@pytest.mark.parametrize("value", ["bogus", "unusable"])
def test_backends_fails_where_the_environment_selects_nothing_usable(capsys, monkeypatch, value):
    with restored_registry():
        registry.register_backend(
            "unusable", unavailable("unusable", "no unusable device here", install_hint="pip install unusable-sdk")
        )
        monkeypatch.setenv("OFFLOAD_CORE_BACKEND", value)
        assert main(["backends"]) == 1
        err = capsys.readouterr().err
        if value == "bogus":
            assert "unknown offload backend 'bogus'" in err
        else:
            assert "'unusable' ($OFFLOAD_CORE_BACKEND) cannot run here: no unusable device here" in err
            assert "install: pip install unusable-sdk" in err
        assert main(["backends", "--json"]) == 1
        data = json.loads(capsys.readouterr().out)
        assert data["selected_by"] == "$OFFLOAD_CORE_BACKEND" and data["compiled_steps"] in (
            "built",
            "not built",
            "off",
        )


def test_backends_lists_a_plugin_that_is_not_a_backend_as_unavailable(capsys):
    with restored_registry():
        registry.register_backend("notabackend", "os:path")  # a lazy target, checked on import
        assert main(["backends"]) == 0
        out = capsys.readouterr().out
        assert "notabackend" in out and "not a Backend subclass" in out


@pytest.mark.parametrize("value", ["false", "2", "yes"])
def test_a_native_switch_other_than_0_or_1_is_one_line(capsys, monkeypatch, value):
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", value)
    assert main(["backends"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OFFLOAD_CORE_NATIVE must be 0 (numpy's steps) or 1" in err and repr(value) in err


def test_an_empty_native_switch_is_as_unset(capsys, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_NATIVE", "")
    assert main(["backends"]) == 0


@pytest.mark.parametrize(
    "conf, named",
    [
        ("mechansim:ce_batch", "OFFLOAD_CORE_CUDA_CONF: 'mechansim:ce_batch' has an unknown key"),
        ("ring_mb:0", "OFFLOAD_CORE_CUDA_CONF ring_mb must be a positive integer, got '0'"),
        ("mechanism:nosuch", "OFFLOAD_CORE_CUDA_CONF mechanism 'nosuch' cannot be used: unknown mechanism"),
        ("tune:2", "OFFLOAD_CORE_CUDA_CONF tune must be 0 or 1, got '2'"),
    ],
)
def test_a_malformed_backend_setting_is_refused_before_a_worker_is_made(capsys, monkeypatch, conf, named):
    """The cuda backend's conf is parsed by its probe where a GPU is usable (made to seem so
    here): the listing says so, selecting it raises; where it cannot run, its conf is ignored."""
    import torch

    monkeypatch.setenv("OFFLOAD_CORE_CUDA_CONF", conf)
    monkeypatch.delenv("OFFLOAD_CORE_BACKEND", raising=False)
    if torch.version.cuda is None:
        assert main(["backends"]) == 0  # an NPU or CPU host: not its setting to judge
        capsys.readouterr()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["backends"]) == 1
    out, err = capsys.readouterr()
    assert "misconfigured" in out and named in err
    assert registry.availability()["cuda"].startswith(f"misconfigured: {named}")
    with pytest.raises(ConfigError, match=re.escape(named)):
        registry.select_backend_name()
    assert registry.select_backend_name("cpu") == "cpu"  # another backend, named, is not held up


def test_backends_json(capsys):
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backends"]["cpu"] is None and data["selected"] in data["backends"]


@pytest.mark.parametrize("chunk", ["1", "2"])
def test_bench_json_verifies_every_byte(capsys, chunk):
    assert main(["bench", "--backend", "cpu", "--json", "--blocks-per-chunk", chunk] + SMALL) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "cpu" and data["verified"] is True
    assert data["store_gbps"] > 0 and data["load_gbps"] > 0
    assert data["store_descriptors_per_job"] >= 1 and data["bytes_per_job"] == 4 * 64 * 32 * 1024


def test_the_links_measure_enqueues_under_the_lock_the_core_holds():
    """The contract: `copy_batch` is never called beside a worker's enqueue on one backend, so
    the link's measure, run while its worker is open, takes the same lock."""
    import torch

    from offload_core.backend import enqueue_lock
    from offload_core.backends.cpu import CpuBackend

    class Watched(CpuBackend):
        def copy_batch(self, *args):
            held.append(enqueue_lock(self).locked())
            return super().copy_batch(*args)

    held: list[bool] = []
    backend = Watched()
    bench._limit_gbps(backend, 4096, backend.alloc_host(4096), torch.empty(4096, dtype=torch.uint8))
    assert held and all(held)


def test_bench_cross_layer_preset(capsys):
    assert main(["bench", "--backend", "cpu", "--preset", "llama-8b-cross-layer", "--json"] + SMALL) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verified"] and data["store_mean_copy_bytes"] >= 2 * 2**20  # whole 2 MiB blocks, merged


def test_bench_table_output(capsys):
    assert main(["bench", "--backend", "cpu"] + SMALL) == 0
    out = capsys.readouterr().out
    assert "store" in out and "load" in out and "verified: every byte" in out


def test_bench_fails_when_a_byte_differs(capsys, lossy):
    assert main(["bench", "--backend", "lossy", "--json"] + SMALL) == 1
    assert json.loads(capsys.readouterr().out)["verified"] is False


def test_bench_reports_bad_arguments_without_a_traceback(capsys):
    assert main(["bench", "--backend", "tpu"] + SMALL) == 2
    assert "unknown offload backend 'tpu'" in capsys.readouterr().err
    assert main(["bench", "--backend", "cuda"] + SMALL) in (0, 2)
    assert main(["bench", "--blocks", "10", "--blocks-per-job", "4"]) == 2


def test_python_dash_m_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "offload_core", "backends", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "cpu" in json.loads(out.stdout)["backends"]


# --- bad input: exit status 2, one line naming the option, the value and the rule, no traceback


@pytest.mark.parametrize(
    "option, value",
    [
        ("--blocks-per-job", "0"),
        ("--blocks-per-chunk", "0"),
        ("--blocks", "-16"),
        ("--blocks-per-job", "-16"),
        ("--iters", "0"),
        ("--blocks", "abc"),
    ],
)
def test_bench_refuses_sizes_that_are_not_positive_integers(capsys, option, value):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--backend", "cpu", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be a positive integer, got " in err and value in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--blocks", "10", "--blocks-per-job", "4"],
            "--blocks must be a multiple of --blocks-per-job (whole jobs), got --blocks 10, --blocks-per-job 4",
        ),
        (
            ["--blocks", "8", "--blocks-per-job", "4", "--blocks-per-chunk", "3"],
            "--blocks-per-job must be a multiple of --blocks-per-chunk (whole host blocks)",
        ),
        (["--backend", "nosuch"], "unknown offload backend 'nosuch'"),
    ],
)
def test_bench_refuses_runs_that_cannot_be_made_in_one_line(capsys, args, message):
    assert main(["bench", "--backend", "cpu"] + args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("offload-core: ") and message in captured.err
    assert captured.err.count("\n") == 1


def test_bench_preset_must_be_known(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--backend", "cpu", "--preset", "x"])
    assert exc.value.code == 2
    assert "argument --preset: invalid choice: 'x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--blocks-per-job", "0"], "argument --blocks-per-job: must be a positive integer, got 0"),
        # more than any machine has: refused before anything is allocated
        (["--blocks", str(16 * 10**15)], "of host memory, but only"),
    ],
)
def test_the_console_command_exits_2_without_a_traceback(args, message):
    out = subprocess.run(
        [sys.executable, "-m", "offload_core", "bench", "--backend", "cpu"] + args, capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and message in out.stderr


def test_bench_with_fewer_blocks_than_a_job_runs_as_one_job(capsys):
    assert main(["bench", "--backend", "cpu", "--json", "--blocks", "4", "--iters", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["blocks_per_job"] == 4 and data["verified"]


def test_an_interrupted_bench_says_so(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run", interrupted)
    assert main(["bench", "--backend", "cpu"] + SMALL) == 130
    assert capsys.readouterr().err == "offload-core: interrupted\n"


# --- bench.run from Python


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"blocks": 0}, "blocks must be a positive integer, got 0"),
        ({"blocks": -16}, "blocks must be a positive integer, got -16"),
        ({"blocks": 4.0}, "blocks must be a positive integer, got 4.0"),
        ({"blocks": True}, "blocks must be a positive integer, got True"),
        ({"blocks_per_job": 0}, "blocks_per_job must be a positive integer, got 0"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk must be a positive integer, got 0"),
        ({"iters": 0}, "iters must be a positive integer, got 0"),
        ({"blocks": 10, "blocks_per_job": 4}, "got blocks=10, blocks_per_job=4"),
        ({"blocks_per_job": 16, "blocks_per_chunk": 3}, "got blocks_per_job=16, blocks_per_chunk=3"),
        ({"preset": "nosuch"}, "unknown preset 'nosuch'; presets: llama-8b, llama-8b-cross-layer"),
    ],
)
def test_bench_run_raises_invalid_spec_for_bad_sizes(kwargs, message):
    with pytest.raises(InvalidSpecError) as exc:
        bench.run("cpu", **kwargs)
    assert isinstance(exc.value, OffloadError) and isinstance(exc.value, ValueError)
    assert message in str(exc.value)


# --- memory: estimated from what bench.run allocates, refused before allocating


class FakeCuda(FakeBackend):
    """Only its device type matters: memory_needed never touches the device."""

    @property
    def device(self):
        import torch

        return torch.device("cuda", 0)


def test_memory_needed_counts_device_bytes_as_host_on_the_cpu():
    block = 2 * 2**20  # llama-8b: 64 pages of 32 KiB
    assert bench.memory_needed("llama-8b", 4, "cpu") == {"host_bytes": 5 * 4 * block, "device_bytes": 0}
    assert bench.memory_needed("llama-8b-cross-layer", 4, FakeCuda()) == {
        "host_bytes": 2 * 4 * block,
        "device_bytes": 3 * 4 * block,
    }


@pytest.mark.parametrize("device_type", ["cuda", "xpu"])
def test_bench_refuses_more_device_memory_than_the_device_says_is_free(monkeypatch, device_type):
    """Asked of torch's module for the device type, whichever accelerator it is."""
    import torch

    class Small(FakeBackend):
        device = property(lambda self: torch.device(device_type, 0))

    asked = []
    monkeypatch.setattr(torch, device_type, SimpleNamespace(mem_get_info=lambda d: asked.append(d) or (2**20, 2**30)))
    with pytest.raises(OffloadError, match=f"GiB of memory on {device_type}:0, but only 0.00 GiB is free"):
        bench._check_memory(Small(), "llama-8b", 16, 16)
    assert asked == [torch.device(device_type, 0)]


def test_bench_reports_the_memory_it_uses(capsys):
    assert main(["bench", "--backend", "cpu", "--json"] + SMALL) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_memory_bytes"] == bench.memory_needed("llama-8b", 8, "cpu")["host_bytes"] == 80 * 2**20
    assert data["device_memory_bytes"] == 0 and data["limit_copies"] == bench.LIMIT_COPIES
    assert main(["bench", "--backend", "cpu"] + SMALL) == 0
    assert "; uses 80.0 MiB host memory\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    "available, hint",
    [(2**20, "not even one job (--blocks 4) would fit"), (100 * 2**20, "--blocks 8 or fewer would fit")],
)
def test_bench_refuses_more_memory_than_is_available(capsys, monkeypatch, available, hint):
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda root="/": available)
    assert main(["bench", "--backend", "cpu", "--blocks", "64", "--blocks-per-job", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "bench with 64 blocks of llama-8b needs 640.0 MiB of host memory, but only" in captured.err
    assert captured.err.rstrip().endswith(hint)


def test_bench_run_refuses_before_allocating(monkeypatch):
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda root="/": 2**20)
    monkeypatch.setattr(bench, "build_kv_caches", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(OffloadError, match="of host memory"):
        bench.run("cpu", blocks=4, blocks_per_job=4)


# --- the table: ratios above 100% are marked and explained


def _result(**changes):
    r = {
        "backend": "cpu", "device": "cpu", "preset": "llama-8b", "verified": True, "blocks": 8,
        "blocks_per_job": 4, "blocks_per_chunk": 1, "iters": 1, "bytes_per_job": 8 * 2**20,
        "plan_submit_us_per_job": 100.0, "host_memory_bytes": 80 * 2**20, "device_memory_bytes": 0,
        "limit_copies": 10,
    }  # fmt: skip
    for d in ("store", "load"):
        r.update({f"{d}_gbps": 9.5, f"{d}_device_gbps": 10.0, f"{d}_limit_gbps": 10.0, f"{d}_ratio": 0.95})
        r.update({f"{d}_descriptors_per_job": 256.0, f"{d}_mean_copy_bytes": 32768.0})
    r.update(changes)
    return r


def test_a_ratio_above_100_percent_is_starred_and_explained():
    header, rows, notes = bench_report(_result(load_ratio=1.05))
    assert [row[3] for row in rows] == ["95%", "105%*"]
    assert notes[0] == (
        "* above 100%: jobs back to back overlap their host work with the copies; "
        "the limit is the best of 10 single copies of the same bytes"
    )
    assert notes[1] == "plan+submit 100 us per job; verified: every byte"


@pytest.mark.parametrize("ratio, cell", [(0.95, "95%"), (1.0, "100%"), (1.004, "100%")])
def test_no_footnote_when_no_ratio_shows_above_100_percent(ratio, cell):
    header, rows, notes = bench_report(_result(store_ratio=ratio, load_ratio=ratio))
    assert [row[3] for row in rows] == [cell, cell]
    assert len(notes) == 1 and "*" not in notes[0]


def test_the_header_names_host_and_device_memory():
    header, _, _ = bench_report(_result(host_memory_bytes=256 * 2**20, device_memory_bytes=3 * 2**30 // 2))
    assert header.endswith("best of 1; uses 256.0 MiB host and 1.50 GiB device memory")


def test_the_footnote_is_printed_under_the_table(capsys, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda *a, **k: _result(store_ratio=1.05))
    assert main(["bench", "--backend", "cpu"] + SMALL) == 0
    out = capsys.readouterr().out
    assert "105%*" in out
    assert out.index("105%*") < out.index("* above 100%") < out.index("plan+submit")


# --- help


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("backends", "bench"):
        assert f"`{command}`" in out  # in the description, not only the list argparse makes


def test_bench_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for default in ("llama-8b", "64", "16, or --blocks where that is fewer", "1", "5", "a table"):
        assert f"(default: {default})" in out
    assert "default: $OFFLOAD_CORE_BACKEND" in out and "iterations; the best is reported" in out


def test_no_subcommand_is_a_usage_error_that_names_the_commands(capsys):
    from offload_core.cli import main

    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: offload-core")
    assert "error: choose a command: backends, bench (offload-core --help)" in captured.err


def test_copy_sizes_are_printed_in_a_readable_unit():
    from offload_core.cli import _size

    assert [_size(n) for n in (512, 32768, 32 << 20, 3 << 30)] == ["512 B", "32 KiB", "32 MiB", "3 GiB"]


@pytest.mark.parametrize(
    "args", [["backends"], ["backends", "--json"], ["bench", "--json", "--blocks", "16", "--iters", "1"]]
)
def test_output_that_cannot_be_written_is_one_line_and_status_3(args):
    """A full disk (/dev/full) or a closed pipe: one line on stderr naming why, exit 3, no traceback."""
    with open("/dev/full", "w") as full:
        out = subprocess.run(
            [sys.executable, "-m", "offload_core", *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert out.returncode == 3, out.stderr
    assert out.stderr == "offload-core: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("args", [["backends"], ["backends", "--json"]])
def test_a_command_started_with_its_output_closed_says_so_with_status_3(args):
    out = subprocess.run(
        [sys.executable, "-m", "offload_core", *args],
        stdout=None,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(1),  # as `offload-core backends >&-`
    )
    assert out.returncode == 3, out.stderr
    assert out.stderr == "offload-core: cannot write the output: the standard output is closed\n"


def test_a_plugin_that_exits_or_fails_to_construct_is_unavailable_not_fatal():
    class Exits(FakeBackend):
        name = "exits"

        @classmethod
        def probe(cls):
            raise SystemExit(3)

    class Breaks(FakeBackend):
        name = "breaks"

        def __init__(self, device_index=0):
            raise RuntimeError("no such device")

    with restored_registry():
        registry.register_backend("exits", Exits)
        registry.register_backend("breaks", Breaks)
        assert "probe raised SystemExit(3)" in registry.availability()["exits"]
        with pytest.raises(BackendUnavailableError, match="'breaks' is unavailable: making it raised RuntimeError"):
            registry.get_backend("breaks")
        assert main(["bench", "--backend", "breaks", "--blocks", "16", "--iters", "1"]) == 2


def test_backends_prints_a_reason_as_it_is(capsys, monkeypatch):
    """A probe's reason is text: brackets and colons in it are not markup or emoji."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per row

    with restored_registry():
        registry.register_backend("odd", unavailable("odd", "cannot import pkg.x:X: [bold]no[/bold] :x:"))
        main(["backends"])
    assert "cannot import pkg.x:X: [bold]no[/bold] :x:" in capsys.readouterr().out
