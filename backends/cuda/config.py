"""The cuda backend's one environment variable, read in one place (as PYTORCH_CUDA_ALLOC_CONF is).
Every key sets a `CudaBackend` argument too (``sm_penalty``: the cost model's); the argument wins,
except over ``sm_penalty``.
"""

from __future__ import annotations

import os

from offload_core.errors import ConfigError

ENV_CONF = "OFFLOAD_CORE_CUDA_CONF"
CONF_KEYS = ("mechanism", "sm_programs", "staging_mb", "ring_mb", "max_batch", "sm_penalty", "tune")


def conf() -> dict[str, str]:
    """``$OFFLOAD_CORE_CUDA_CONF`` as a dict: ``key:value`` pairs, comma-separated (spaces
    around either ignored; unset or empty: no settings), keys from `CONF_KEYS`.

    Raises:
        ConfigError: a pair without ``:``, a key not in `CONF_KEYS` or given twice, or one of
            the single variables of earlier versions still set (they are no longer read).
    """
    old = sorted(n for n in os.environ if n.startswith("OFFLOAD_CORE_CUDA_") and n != ENV_CONF)
    if old:
        raise ConfigError(
            f"{', '.join(old)} {'is' if len(old) == 1 else 'are'} no longer read: set {ENV_CONF} instead "
            f"(key:value pairs, comma-separated; keys: {', '.join(CONF_KEYS)})"
        )
    settings: dict[str, str] = {}
    for pair in os.environ.get(ENV_CONF, "").split(","):
        if not pair.strip():
            continue
        key, sep, value = (part.strip() for part in pair.partition(":"))
        if not sep or key not in CONF_KEYS or key in settings:
            why = "is not key:value" if not sep else "names a key twice" if key in settings else "has an unknown key"
            raise ConfigError(f"{ENV_CONF}: {pair.strip()!r} {why}; keys: {', '.join(CONF_KEYS)}")
        settings[key] = value
    return settings
