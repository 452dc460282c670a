"""A base for backends over one of torch's per-device modules (``torch.cuda``, ``torch.npu``,
``torch.xpu``, ...), whose streams, events and pinned memory come from a *runtime*: that module
(`TorchRuntime`) or an injected stand-in. torch and the device SDK are imported only when a
backend or runtime is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from offload_core.backend import Backend

if TYPE_CHECKING:
    import torch


class Runtime(Protocol):
    """What a `TorchDeviceBackend` needs of its runtime: ``torch.cuda``'s surface, plus the last
    four members, which `TorchRuntime` adds."""

    def Stream(self, device: int = ...) -> Any:  # noqa: N802  (torch's name)
        """A new stream on `device`, with ``wait_event`` and ``wait_stream`` (`backend.Stream`)."""

    def Event(self, enable_timing: bool = ...) -> Any:  # noqa: N802
        """A new event, with ``record``, ``query``, ``synchronize`` and ``elapsed_time`` (`backend.Event`)."""

    def current_stream(self, index: int) -> Any:
        """The calling thread's current (compute) stream on device `index`."""

    def current_device(self) -> int: ...

    def set_device(self, index: int) -> None: ...

    def synchronize(self, index: int) -> None:
        """Block until all work on device `index` has finished."""

    def stream(self, stream: Any) -> Any:
        """A context manager making `stream` the calling thread's current stream."""

    def torch_device(self, index: int) -> torch.device:
        """Where device `index`'s memory lives (`Backend.device`)."""

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """A zero-filled 1-D uint8 CPU tensor, page-locked for this device's asynchronous copies."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether host `tensor` can be the source of an asynchronous copy as it is."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of host `tensor` (staging for one that is not)."""


class TorchRuntime:
    """``torch.<module_name>`` as a `TorchDeviceBackend` runtime. Attributes it does not define
    are the module's (``Stream``, ``Event``, ...), so vendor extras such as torch_npu's ``npurt``
    stay reachable.

    Args:
        module_name: the attribute of ``torch`` to wrap: ``"cuda"``, ``"npu"``, ``"xpu"``.

    Raises:
        AttributeError: torch has no such module (for ``npu``, torch_npu is not imported).
    """

    def __init__(self, module_name: str):
        import torch

        module = getattr(torch, module_name, None)
        if module is None:
            raise AttributeError(f"torch has no torch.{module_name} (is its extension imported?)")
        self._torch = torch
        self.module_name = module_name
        self.module = module

    def __getattr__(self, name: str) -> Any:
        # only reached for names not defined here; read __dict__ so that a half-built or
        # copied instance raises AttributeError instead of recursing
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(module, name)

    def torch_device(self, index: int) -> torch.device:
        return self._torch.device(self.module_name, index)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return self._torch.zeros(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def __repr__(self) -> str:
        return f"TorchRuntime({self.module_name!r})"


class TorchDeviceBackend(Backend):
    """A backend whose streams, events and pinned memory come from a torch-style runtime
    (`Runtime`). Subclasses set `name`, `module_name`, `priority` and `install_hint` and implement
    `probe` and `copy_batch` (see `Backend`); everything else is implemented here.

    Args:
        device_index: the device.
        runtime: the runtime; default ``TorchRuntime(module_name)``, the real torch module.

    Raises:
        AttributeError: no runtime is given and torch has no ``torch.<module_name>``.
    """

    module_name: ClassVar[str]

    def __init__(self, device_index: int = 0, *, runtime: Runtime | None = None):
        import torch

        super().__init__(device_index)
        self._torch = torch
        self.runtime: Runtime = runtime if runtime is not None else TorchRuntime(self.module_name)
        self._device = self.runtime.torch_device(device_index)

    @property
    def device(self) -> torch.device:
        return self._device

    def new_stream(self):
        return self.runtime.Stream(device=self.device_index)

    def new_event(self):
        return self.runtime.Event(enable_timing=True)

    def current_stream(self):
        return self.runtime.current_stream(self.device_index)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return self.runtime.alloc_pinned(nbytes)

    def synchronize(self) -> None:
        self.runtime.synchronize(self.device_index)

    @classmethod
    def _unavailable(cls, module: Any, what: str) -> str | None:
        """A probe's last step: why torch's `module` (``torch.npu``, say) has no usable `what`, or None."""
        try:
            if not module.is_available():
                return f"torch.{cls.module_name}.is_available() is False: no usable {what} or driver"
        except Exception as exc:  # a half-installed SDK raises here rather than saying False
            return f"torch.{cls.module_name}.is_available() raised {exc!r}"
        return None

    def _bind_thread(self) -> None:
        """Make this device current in the calling thread (copies may come from any thread)."""
        if self.runtime.current_device() != self.device_index:
            self.runtime.set_device(self.device_index)
