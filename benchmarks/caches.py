"""Clearing placements2jax's functools caches, for "cold" measurements."""

from __future__ import annotations

import sys
from collections.abc import Callable

_CLEARS: list[Callable[[], None]] = []


def clear_package_caches() -> None:
    """Empty every ``functools.lru_cache`` / ``cache`` defined in the placements2jax
    modules imported by the first call (signature inference, plans, physical
    representations, compiled programs ...): measure "cold" after one warm call, so every
    module the measured code uses is imported."""
    if not _CLEARS:
        for name, module in list(sys.modules.items()):
            if name == "placements2jax" or name.startswith("placements2jax."):
                _CLEARS.extend(
                    value.cache_clear
                    for value in vars(module).values()
                    if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == name
                )
    for clear in _CLEARS:
        clear()
