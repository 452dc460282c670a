"""The `offload-core` command as an operator runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from offload_core import registry
from offload_core.cli import main
from offload_core.testing.fake import FakeBackend

SMALL = ["--blocks", "8", "--blocks-per-job", "4", "--iters", "1"]


class Lossy(FakeBackend):
    """Drops the last descriptor of every batch: a bug the benchmark must catch."""

    name = "lossy"

    def copy_batch(self, src, dst, sizes, direction, stream):
        super().copy_batch(src[:-1], dst[:-1], sizes[:-1], direction, stream)
        self.complete_all()


@pytest.fixture
def lossy():
    registry.register_backend("lossy", Lossy)
    yield
    registry._reset_for_tests()


def test_backends_table_lists_every_backend_and_the_selected_one(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu", "cuda", "npu", "xpu"):
        assert name in out
    assert "available" in out and "priority" in out and "reason" in out


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


def test_calibrate_on_a_backend_without_costs(capsys):
    assert main(["calibrate", "--backend", "cpu"]) == 0
    assert "nothing to calibrate" in capsys.readouterr().out
