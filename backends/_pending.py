"""A registered name whose backend is not written yet: listed, probed, never selected."""

from __future__ import annotations

from typing import ClassVar, NoReturn

from offload_core.backend import Backend


class PendingBackend(Backend):
    """Reports itself unavailable with `pending` as the reason."""

    pending: ClassVar[str]

    @classmethod
    def probe(cls) -> str | None:
        return cls.pending

    def _absent(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(self.pending)

    device = property(_absent)  # type: ignore[assignment]
    new_stream = new_event = current_stream = alloc_host = copy_batch = _absent  # type: ignore[assignment]
