"""Every cache of placements2jax, registered in one place, and :func:`clear_caches`.

Pure planners (layouts from placements, physical representations, signature choices,
redistribution plans, compiled programs) are wrapped in caches, as torch wraps its
redistribute planner; this module is how they are declared (:func:`cached` for functions,
:func:`register` for a module's own dict cache) and how all of them are emptied at once,
for "cold" measurements or to free memory. It imports nothing from the package, so every
module may use it. Interned values (DeviceMesh, Layout) are not caches: they live as long
as someone holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

__all__ = ["cached", "register", "Memo", "clear_caches"]

F = TypeVar("F", bound=Callable[..., Any])

_clears: list[Callable[[], None]] = []


def cached(maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered with :func:`clear_caches`."""

    def decorate(function: F) -> F:
        wrapper = lru_cache(maxsize=maxsize)(function)
        _clears.append(wrapper.cache_clear)
        return wrapper  # type: ignore[return-value]

    return decorate


def register(cache: dict[Any, Any]) -> dict[Any, Any]:
    """Register a module's dict cache with :func:`clear_caches`; returns it."""
    _clears.append(cache.clear)
    return cache


class Memo(dict):  # type: ignore[type-arg]
    """A module's dict cache, registered with :func:`clear_caches`, of at most ``limit``
    entries: emptied when full (its entries are cheap to recompute, and a bound keeps a
    long run from growing it without end). :meth:`recall` and :meth:`remember` take any
    key: an unhashable one (a list among the arguments) is a miss and is not stored."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        register(self)

    def recall(self, key: Any) -> Any:
        """The value stored under ``key``, or None."""
        try:
            return self.get(key)
        except TypeError:
            return None

    def remember(self, key: Any, value: Any) -> None:
        if len(self) >= self.limit:
            self.clear()
        try:
            self[key] = value
        except TypeError:
            pass


def clear_caches() -> None:
    """Empty every cache of the package (all :func:`cached` functions and registered dicts)."""
    for clear in _clears:
        clear()
