"""The `backend` fixture runs a test once per registered backend; unusable ones are skipped with their reason.

OFFLOAD_CORE_TEST_BACKENDS=cuda,cpu narrows the set; OFFLOAD_CORE_REQUIRE_BACKENDS=cuda turns a
skip of a listed backend into a failure, so a runner with a broken driver cannot pass green.
OFFLOAD_CORE_SIMULATE=npu,xpu installs the simulated runtimes for the whole session, so every
backend test also runs on simulated npu and xpu (what CI does on its CPU-only machine).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
from hypothesis import settings

from offload_core import registry

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_teardown = contextlib.ExitStack()


def pytest_configure(config):
    import simulated

    # the cuda backend's tuned choices: the suite's own, not the user's
    profiles = tempfile.TemporaryDirectory(prefix="offload-core-test-profiles-")
    os.environ["OFFLOAD_CORE_PROFILE_DIR"] = _teardown.enter_context(profiles)  # removed at the end

    real = registry.availability()
    listed = _listed("OFFLOAD_CORE_SIMULATE") or set()
    unknown = sorted(listed - {"npu", "xpu"})
    if unknown:
        raise pytest.UsageError(f"OFFLOAD_CORE_SIMULATE lists {', '.join(unknown)}: only npu and xpu have simulations")
    for name in sorted(listed):
        if real.get(name) is not None:  # never hide a real device behind its simulation
            _teardown.enter_context(getattr(simulated, name)())


def pytest_unconfigure(config):
    _teardown.close()


def _listed(var: str) -> set[str] | None:
    value = os.environ.get(var, "").strip()
    return {n.strip() for n in value.split(",") if n.strip()} if value else None


# The cpu backend once more per path of the core that only expanding backends take (compact
# jobs, offload_core/testing/expanding.py): expanded into staging, or straight into host rows.
_EXPANDING = {
    "cpu-expand-staged": {"staged": True},
    "cpu-expand-direct": {"staged": False},
}


def _backend_params():
    chosen = _listed("OFFLOAD_CORE_TEST_BACKENDS")
    for name in registry.backend_names():
        if chosen is None or name in chosen:
            marks = [getattr(pytest.mark, name)] if name in ("cpu", "cuda", "npu", "xpu") else []
            yield pytest.param(name, marks=marks, id=name)
            if name == "cpu":
                for variant in _EXPANDING:
                    yield pytest.param(variant, marks=marks, id=variant)


@pytest.fixture(params=list(_backend_params()), scope="session")
def backend(request):
    name = request.param
    if name in _EXPANDING:
        from offload_core.testing.expanding import ExpandingCpuBackend

        return ExpandingCpuBackend(**_EXPANDING[name])
    reason = registry.availability()[name]
    if reason is not None:
        if name in (_listed("OFFLOAD_CORE_REQUIRE_BACKENDS") or ()):
            pytest.fail(f"required backend {name} is unavailable: {reason}")
        pytest.skip(f"{name}: {reason}")
    return registry.get_backend(name)
