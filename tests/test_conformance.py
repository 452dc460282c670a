"""Every registered backend against the conformance suite (unavailable ones are skipped with their reason)."""

import pytest
import torch

from offload_core.testing.conformance import BackendConformance
from offload_core.testing.fake import FakeBackend


class TestBackendConformance(BackendConformance):
    pass


class TestFakeBackendConformance(BackendConformance):
    """The fake backend must honour the contract too, or ordering tests built on it prove nothing;
    under a name of its own, as a third party's backend over host memory is."""

    @pytest.fixture
    def backend(self):
        class Toy(FakeBackend):
            name = "toy"

        return Toy()


def test_an_accelerators_backend_must_be_named_after_its_device():
    class Misnamed(FakeBackend):
        name = "gpu"

        @property
        def device(self):
            return torch.device("meta")

    with pytest.raises(AssertionError, match="'gpu' copies meta: an accelerator's backend must be named after"):
        BackendConformance().test_device_type_is_the_backend_name(Misnamed())
