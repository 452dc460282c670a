"""The xpu backend, for Intel GPUs (torch.xpu): not written yet (issue #5)."""

from offload_core.backends._pending import PendingBackend


class XpuBackend(PendingBackend):
    name = "xpu"
    priority = 100
    install_hint = "pip install 'offload-core[xpu]' with an XPU build of torch"
    pending = "offload-core's xpu backend is not implemented yet (issue #5)"
