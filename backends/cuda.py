"""The cuda backend, for NVIDIA GPUs (copy engines and a Triton gather kernel): not written yet (issue #3)."""

from offload_core.backends._pending import PendingBackend


class CudaBackend(PendingBackend):
    name = "cuda"
    priority = 100
    install_hint = "a CUDA build of torch"
    pending = "offload-core's cuda backend is not implemented yet (issue #3)"
