"""Every cache of placements2jax, registered in one place, and :func:`clear_caches`.

Pure planners (layouts from placements, physical representations, signature choices,
redistribution plans, compiled programs) are wrapped in caches, as torch wraps its
redistribute planner; this module is how they are declared (:func:`cached` for functions,
:func:`register` for a module's own dict cache) and how all of them are emptied at once,
for "cold" measurements or to free memory; and the collector paused while caches fill
(:func:`collector_paused`); and a frozen value's hash computed once (:func:`hash_once`).
It imports nothing from the package, so every
module may use it. Interned values (DeviceMesh, Layout) are not caches: they live as long
as someone holds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from functools import lru_cache
from operator import attrgetter
from typing import Any, TypeVar

__all__ = ["cached", "register", "Memo", "clear_caches", "collector_paused", "hash_once", "without_hash"]

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


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (if it was running) while a prediction or a
    signature is made (``predict``, ``infer_signature``): the walk and the search build
    ~300k long-lived small objects (candidates, states, cached plans), and the collector's
    full passes over them were 10-14% of a cold predict
    (measured with gc.callbacks on the GPT-2 adamw step; Llama's cold predict 4.3-5.1 ->
    3.8-3.9 s CPU). Objects freed by reference counting go at once as before; cycles wait
    for the next collection after the pause. Concurrent predictions never leave it off:
    only the call that found it running turns it back on.

    Turned back on, the collector would pass over everything allocated meanwhile at the
    next allocation (the young generation's count is far over its threshold): ~284k objects
    survive a cold predict of Llama's adamw step (the caches' plans, signatures and
    candidates; predict leaves no cyclic garbage, 0-10 objects), a 0.10-0.13 s pass that
    finds nothing, and a second one when they age into the middle generation. So they are
    moved to the oldest generation first (``gc.freeze()`` then ``gc.unfreeze()``: no pass),
    where they would end up anyway. Not a cost deferred: the full collections that scan the
    oldest generation come no sooner (CPython starts one when the objects promoted by young
    passes reach a quarter of it, and these are not counted so), and they would have
    scanned these objects all the same (the first also untracks ~63k tuples of atoms the
    young pass would have: 0.05 s once). Measured alternating cold predicts of Llama's
    adamw step with XLA's compile of it in one process: the collector's CPU time per pair
    0.32 -> 0.005 s, no full collection in either. Skipped when the caller has frozen
    objects itself (``gc.freeze()`` before a fork): those must stay out of every generation.
    A cold ``infer_signature`` on the (2,2,2) mesh (the ops of docs/benchmarks.md section 7,
    caches cleared, alternated in one process, load 1.4): 0.92-1.11 -> 0.91-0.94 ms per op
    on average, the slowest op 2.67-4.00 -> 2.68-2.70 ms."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            thaw = gc.get_freeze_count() == 0
            if thaw:
                gc.freeze()
            gc.enable()
            if thaw:
                gc.unfreeze()


def hash_once() -> Callable[[Any], int]:
    """A frozen dataclass's ``__hash__`` (``__hash__ = hash_once()`` in its body): the
    dataclass hash (its hashed fields' tuple's: :func:`_hashed_fields`), computed at the
    first hash and stored on the value (as ``_hash``; :func:`without_hash` is its pickled
    state). Caches and memos key on avals, specs, 1-D signatures and cost models by the
    thousand (hashing their shapes, dtypes and placements again at every use was ~4% of
    ranking, ~15% of a lazy choice and ~8% of a walk whose signatures are cached; a cold
    Llama predict hashed its cost model ~7,300 times). One per class: the fields are read
    from the first value hashed."""
    compared: Callable[[Any], tuple[Any, ...]] | None = None  # the fields' getter, known at the first hash

    def __hash__(self: Any) -> int:
        nonlocal compared
        cached = self.__dict__.get("_hash")
        if cached is None:
            if compared is None:
                compared = _hashed_fields(type(self))
            cached = hash(compared(self))
            object.__setattr__(self, "_hash", cached)
        return cached

    return __hash__


def _hashed_fields(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """A getter of the tuple a frozen dataclass's generated hash hashes: its fields
    compared, unless their ``hash=`` says otherwise. Read at the first hash, not in
    :func:`hash_once` (``__hash__`` is set in the class body, before
    :func:`dataclasses.dataclass` makes the fields)."""
    names = [f.name for f in dataclasses.fields(cls) if (f.compare if f.hash is None else f.hash)]
    if len(names) > 1:
        return attrgetter(*names)
    return lambda value: tuple(getattr(value, name) for name in names)  # attrgetter of one name gives no tuple


def without_hash(value: Any) -> dict[str, Any]:
    """A frozen dataclass's pickled state without the hash its :func:`hash_once` stored:
    dtypes and placements hash strings, whose hashes differ from one process to another."""
    return {k: v for k, v in value.__dict__.items() if k != "_hash"}
