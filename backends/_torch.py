"""What the cuda, npu and xpu backends share: torch's per-device module for streams, events,
the current stream, pinned memory and synchronisation.

A simulated runtime (`offload_core.testing.simulated`) marks its module with
``SIMULATION_ATTR``; its "device" memory is then host memory and nothing is pinned.
"""

from __future__ import annotations

from typing import Any, ClassVar

from offload_core.backend import Backend

SIMULATION_ATTR = "__offload_core_simulation__"


class TorchDeviceBackend(Backend):
    """A backend over ``torch.<module_name>`` (``torch.cuda``, ``torch.npu``, ``torch.xpu``)."""

    module_name: ClassVar[str]

    def __init__(self, device_index: int = 0):
        import torch

        super().__init__(device_index)
        self._torch = torch
        self.module: Any = getattr(torch, self.module_name)
        self.simulated = bool(getattr(self.module, SIMULATION_ATTR, False))
        self._device = torch.device("cpu") if self.simulated else torch.device(self.name, device_index)

    @property
    def device(self):
        return self._device

    def new_stream(self):
        return self.module.Stream(device=self.device_index)

    def new_event(self):
        return self.module.Event(enable_timing=True)

    def current_stream(self):
        return self.module.current_stream(self.device_index)

    def alloc_host(self, nbytes: int):
        torch = self._torch
        tensor = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=not self.simulated)
        if self.simulated:
            self.module.pin(tensor)  # the simulation's stand-in for page-locked memory
        return tensor

    def synchronize(self) -> None:
        self.module.synchronize(self.device_index)

    def _bind_thread(self) -> None:
        """Make this device current in the calling thread (copies may come from any thread)."""
        if self.module.current_device() != self.device_index:
            self.module.set_device(self.device_index)
