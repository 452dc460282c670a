"""offload-core: move KV-cache blocks between accelerator and host memory, in order, on any accelerator.

Importing this package imports neither torch's device SDKs nor any backend: backends
are loaded when first probed or selected.
"""

from offload_core.backend import Backend, Direction, Event, Stream
from offload_core.canonical import CanonicalPageMapping, CopyRun, verify_tiling
from offload_core.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidSpecError,
    OffloadError,
    RegionError,
    ResourceInUseError,
    UnknownBackendError,
)
from offload_core.queue import TransferResult
from offload_core.region import SharedHostRegion
from offload_core.registry import availability, backend_names, get_backend, register_backend
from offload_core.spec import DeviceBlocks, HostBlocks, KVCacheRef, KVCaches, KVCacheTensor
from offload_core.worker import OffloadWorker

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "ConfigError",
    "CanonicalPageMapping",
    "CopyRun",
    "DeviceBlocks",
    "Direction",
    "Event",
    "HostBlocks",
    "InvalidSpecError",
    "KVCacheRef",
    "KVCacheTensor",
    "KVCaches",
    "OffloadError",
    "OffloadWorker",
    "RegionError",
    "ResourceInUseError",
    "SharedHostRegion",
    "Stream",
    "TransferResult",
    "UnknownBackendError",
    "availability",
    "backend_names",
    "get_backend",
    "register_backend",
    "verify_tiling",
]
