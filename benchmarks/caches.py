"""Clearing placements2jax's functools caches, for "cold" measurements."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

import placements2jax


def _package_caches() -> list[Callable[[], None]]:
    clears = []
    for info in pkgutil.walk_packages(placements2jax.__path__, "placements2jax."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (torch, matplotlib) that is not installed
            continue
        for value in vars(module).values():
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and getattr(value, "__module__", None) == info.name:
                clears.append(clear)
    return clears


_CLEARS: list[Callable[[], None]] = []


def clear_package_caches() -> None:
    """Empty every ``functools.lru_cache`` / ``cache`` defined in placements2jax
    (signature inference, plans, physical representations, compiled programs ...)."""
    if not _CLEARS:
        _CLEARS.extend(_package_caches())
    for clear in _CLEARS:
        clear()


def cache_count() -> int:
    clear_package_caches()
    return len(_CLEARS)
