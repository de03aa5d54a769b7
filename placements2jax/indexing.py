"""``DTensor.__getitem__``: basic indexing (ints, slices with steps, ``None``, ``...``) and
integer-array indexing on one dim, with torch's placement rules.

torch's rule (``gen_slice_strategy``, ``aten.select``, ``aten.index``): an index that
keeps a dim whole (``:``) keeps its split; any other index of a split dim first unshards
that dim (an all-gather over its mesh axes only, the minimal redistribution), and the
result is Replicate there; other dims and Partial placements pass through (indexing is
linear). One addition where the blocks allow it, at no communication: a step slice
``start::step`` of an evenly split dim whose blocks are a multiple of ``step`` (with
``0 <= start < step``) keeps the split, since every rank's block of the result is its own
block sliced the same way. Uneven splits stay exact (the result is computed by
:func:`~placements2jax.operators.apply`, which pads and masks).

This module installs ``__getitem__`` on DTensor when imported (the package imports it).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .caches import cached
from .dtensor import DTensor
from .errors import ArgumentTypeError, IndexingError
from .layout import Layout
from .mesh import shard_map
from .operators import apply
from .physical import Physical, physical

__all__ = ["getitem"]

# One parsed index per input dim (or a new dim): ("int", i), ("slice", start, stop, step),
# ("array", position of the array argument), ("new",).
Item = tuple[Any, ...]


@dataclass(frozen=True)
class _Indexer:
    """``x[key]`` as a hashable function of ``x`` and the key's index arrays (``apply``
    caches its program per function object and the arrays' shapes, not their values)."""

    items: tuple[Item, ...]

    def __call__(self, x: jax.Array, *arrays: jax.Array) -> jax.Array:
        key = []
        for item in self.items:
            if item[0] == "int":
                key.append(item[1])
            elif item[0] == "slice":
                key.append(slice(*item[1:]))
            elif item[0] == "array":
                key.append(arrays[item[1]])
            else:
                key.append(None)
        return x[tuple(key)]


def getitem(x: DTensor, key: Any) -> DTensor:
    """``x[key]`` as a DTensor (module docstring)."""
    items, arrays = _parse(key, x.shape)
    layout = x.layout
    gather = set()  # split dims indexed in a way that cannot keep the split: unsharded first
    dim = 0
    for item in items:
        if item[0] == "new":
            continue
        if layout.dim_axes[dim] and not (item[0] == "slice" and _keeps_split(item[1:], x.shape[dim], layout, dim)):
            gather.add(dim)
        dim += 1
    if gather:
        unsharded = tuple(() if d in gather else a for d, a in enumerate(layout.dim_axes))
        x = x.redistribute(placements=Layout(layout.mesh, unsharded, layout.partial))
        layout = x.layout
    out_axes: list[tuple[int, ...]] = []
    dim = 0
    for item in items:
        if item[0] == "new":
            out_axes.append(())
            continue
        if item[0] == "slice":
            out_axes.append(layout.dim_axes[dim])
        elif item[0] == "array":
            out_axes.extend([()] * np.ndim(arrays[item[1]]))
        dim += 1
    target = Layout(layout.mesh, tuple(out_axes), layout.partial)
    items, x = _strided_per_rank(items, x)
    return apply(_Indexer(items), x, *arrays, out_layouts=target, execute="ops")  # an operator: torch's dispatch


@cached(maxsize=1024)
def _per_rank_slicer(
    phys: Physical, out: Physical, strided: tuple[tuple[int, tuple[int, int]], ...]
) -> Callable[[jax.Array], jax.Array]:
    """Every rank's block of ``phys`` sliced ``start::step`` on the dims of ``strided``
    (``(dim, (start, step))``), as the block of ``out``: one jitted ``jax.shard_map`` per
    layout and slicing. Eager ``jax.shard_map`` compiles anew on every call in JAX 0.10.2
    (``x[::2]`` of a split dim took ~100-120 ms per call; jitted and cached ~1 ms)."""
    steps = dict(strided)
    lead = (slice(None),) * len(phys.stacked_axes)
    key = lead + tuple(slice(steps[d][0], None, steps[d][1]) if d in steps else slice(None) for d in range(len(out.shape)))
    return jax.jit(shard_map(
        lambda block: block[key], mesh=phys.layout.mesh.to_jax(), in_specs=phys.spec, out_specs=out.spec,
        check_vma=False,
    ))


def _strided_per_rank(items: tuple[Item, ...], x: DTensor) -> tuple[tuple[Item, ...], DTensor]:
    """Run the step slices that keep a split on every rank's own block (``jax.shard_map``
    over the physical array, no communication); those items become ``:``. Partial(sum)
    carried as JAX ``unreduced`` is left to :func:`apply`."""
    phys = x.physical
    strided: dict[int, tuple[int, int]] = {}
    dim = 0
    for item in items:
        if item[0] == "new":
            continue
        if item[0] == "slice" and x.layout.dim_axes[dim]:
            start, stop, step = slice(*item[1:]).indices(x.shape[dim])
            if (start, stop, step) != (0, x.shape[dim], 1):
                strided[dim] = (start, step)
        dim += 1
    if not strided or phys.unreduced_axes:
        return items, x
    shape = tuple(n // strided[d][1] if d in strided else n for d, n in enumerate(x.shape))
    out = physical(x.layout, shape)
    array = _per_rank_slicer(phys, out, tuple(sorted(strided.items())))(x.array)
    dim, kept = 0, []
    for item in items:
        kept.append(("slice", None, None, None) if item[0] != "new" and dim in strided else item)
        dim += item[0] != "new"
    return tuple(kept), DTensor.trusted(array, x.layout, shape)


def _keeps_split(item: tuple[int, int, int], size: int, layout: Layout, dim: int) -> bool:
    """A slice keeps the split of ``dim``: the whole dim, or ``start::step`` of an even split
    whose blocks are a multiple of ``step``, ``0 <= start < step``, running to the end."""
    start, stop, step = slice(*item).indices(size)
    if (start, stop, step) == (0, size, 1):
        return True
    pieces = math.prod(layout.pieces(dim))
    if step <= 0 or size % pieces or (size // pieces) % step or not 0 <= start < step:
        return False
    return len(range(start, stop, step)) == size // step


def _parse(key: Any, shape: tuple[int, ...]) -> tuple[tuple[Item, ...], list[jax.Array]]:
    """The key as one item per input dim plus new dims (``...`` expanded, ints and slice
    bounds checked as NumPy does), and the index arrays."""
    entries = list(key) if isinstance(key, tuple) else [key]
    if sum(e is Ellipsis for e in entries) > 1:
        raise IndexingError("key", key, "has more than one '...'", "use at most one Ellipsis")
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    if consumed > len(shape):
        raise IndexingError(
            "key", key, f"indexes {consumed} dims of a {len(shape)}-d DTensor", f"give at most {len(shape)} indices"
        )
    if any(e is Ellipsis for e in entries):
        at = next(i for i, e in enumerate(entries) if e is Ellipsis)
        entries[at:at + 1] = [slice(None)] * (len(shape) - consumed)
    else:
        entries += [slice(None)] * (len(shape) - consumed)
    items: list[Item] = []
    arrays: list[jax.Array] = []
    dim = 0
    for entry in entries:
        if entry is None:
            items.append(("new",))
            continue
        size = shape[dim]
        if isinstance(entry, slice):
            for bound in (entry.start, entry.stop, entry.step):
                if bound is not None and not _is_int(bound):
                    raise ArgumentTypeError("key", key, f"slice bound {bound!r} is not an integer", "use int bounds")
            if entry.step == 0:
                raise IndexingError("key", key, "has a slice step of 0", "use a non-zero step")
            items.append(("slice", *(None if b is None else operator.index(b) for b in (entry.start, entry.stop, entry.step))))
        elif _is_int(entry):
            index = operator.index(entry)
            if not -size <= index < size:
                raise IndexingError(
                    "key", key, f"index {index} is out of bounds for dim {dim} of size {size}",
                    f"use an index in [{-size}, {size})",
                )
            items.append(("int", index))
        else:
            items.append(("array", len(arrays)))
            arrays.append(_index_array(entry, key, dim, size))
        dim += 1
    if len(arrays) > 1:
        raise IndexingError(
            "key", key, "indexes several dims with arrays (NumPy's broadcast and transposed advanced indexing)",
            "index one dim with an array at a time: x[i][:, j]",
        )
    return tuple(items), arrays


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _index_array(entry: Any, key: Any, dim: int, size: int) -> jax.Array:
    """An integer index array (list, NumPy or JAX array), bounds-checked when concrete."""
    if isinstance(entry, (str, bytes)):
        raise ArgumentTypeError("key", key, f"{entry!r} is not an index", "index with ints, slices, None, ... or int arrays")
    if isinstance(entry, DTensor):
        raise ArgumentTypeError(
            "key", key, "a DTensor as an index", "index with its full value: x[idx.full_tensor()]"
        )
    try:
        array = jnp.asarray(entry)
    except TypeError:
        raise ArgumentTypeError(
            "key", key, f"{entry!r} is not an int, slice, None, ... or integer array", "index with those"
        ) from None
    if array.dtype == jnp.bool_ or not jnp.issubdtype(array.dtype, jnp.integer):
        raise IndexingError(
            "key", key, f"an index array of dtype {array.dtype} (a boolean mask has a data-dependent shape)",
            "index with integer arrays, e.g. jnp.nonzero(mask, size=n)[0]",
        )
    if not isinstance(array, jax.core.Tracer) and array.size:
        low, high = int(array.min()), int(array.max())
        if low < -size or high >= size:
            raise IndexingError(
                "key", key, f"index array values {low}..{high} are out of bounds for dim {dim} of size {size}",
                f"use indices in [{-size}, {size})",
            )
    return array


DTensor.__getitem__ = getitem  # type: ignore[method-assign]
