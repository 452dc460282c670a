"""The npu backend, for Ascend NPUs (torch_npu, aclrtMemcpyBatchAsync): not written yet (issue #5)."""

from offload_core.backends._pending import PendingBackend


class NpuBackend(PendingBackend):
    name = "npu"
    priority = 100
    install_hint = "pip install 'offload-core[npu]'"
    pending = "offload-core's npu backend is not implemented yet (issue #5)"
