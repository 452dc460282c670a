"""The backend registry kept apart per test: what a test registers, the plugins it loads and the
instances it makes are gone afterwards, and the registrations from before (a session's
simulations, say) are back. Test support: it reaches into `offload_core.registry`'s state, which
the library itself only changes through `register_backend`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from offload_core import registry


@contextlib.contextmanager
def restored_registry() -> Iterator[None]:
    """Registrations, plugin loading and cached instances as they are now, put back on exit."""
    with registry._lock:
        saved = dict(registry._targets), registry._plugins_loaded, dict(registry._instances)
    try:
        yield
    finally:
        with registry._lock:
            registry._targets, registry._plugins_loaded, registry._instances = saved


@contextlib.contextmanager
def fresh_registry() -> Iterator[None]:
    """Only the built-in backends, no plugins loaded yet and no instances, inside; everything
    as it was, afterwards."""
    with restored_registry():
        with registry._lock:
            registry._targets, registry._plugins_loaded, registry._instances = dict(registry._BUILTIN), False, {}
        yield
