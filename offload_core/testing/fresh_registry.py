"""The backend registry kept apart per test: what a test registers, the plugins it loads and the
instances it makes are gone afterwards, and the registrations from before (a session's
simulations, say) are back.

    with fresh_registry():          # only the built-in backends inside
        register_backend("mine", MyBackend)
    with restored_registry():       # everything as it is now, inside and afterwards
        ...

Test support: it reaches into `offload_core.registry`'s state, which the library itself only
changes through `register_backend`.
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
            registry._targets.clear()
            registry._targets.update(saved[0])
            registry._plugins_loaded = saved[1]
            registry._instances.clear()
            registry._instances.update(saved[2])


@contextlib.contextmanager
def fresh_registry() -> Iterator[None]:
    """Only the built-in backends, no plugins loaded yet and no instances, inside; everything
    as it was, afterwards."""
    with restored_registry():
        with registry._lock:
            registry._targets.clear()
            registry._targets.update(registry._BUILTIN)
            registry._plugins_loaded = False
            registry._instances.clear()
        yield
