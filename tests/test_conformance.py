"""Every registered backend against the conformance suite (unavailable ones are skipped with their reason)."""

from offload_core.testing.conformance import BackendConformance


class TestBackendConformance(BackendConformance):
    pass


class TestFakeBackendConformance(BackendConformance):
    """The fake backend must honour the contract too, or ordering tests built on it prove nothing."""

    import pytest

    @pytest.fixture
    def backend(self):
        from offload_core.testing.fake import FakeBackend

        class _Fake(FakeBackend):
            name = "cpu"  # its device is the host: the suite checks device.type == name

        return _Fake()
