"""Communication accounting: bytes sent per device by compiled collectives, the lower
bound of a redistribution, and torch's planner's steps priced with the same formulas.

All figures are *average bytes sent per device*: the total over the mesh divided by
the number of devices (every collective of the catalogue is balanced except
collective-permute, where a device whose source is its own target sends nothing).

Lower bound, per element ``e`` of the tensor (messages carry element values; bytes =
messages x itemsize). Let ``H`` be the devices whose source block holds ``e`` and ``R``
those whose target block holds it.

* No partial source: every receiver that does not hold ``e`` must receive it once:
  ``|R \\ H|``.
* Partial source reduced by the move, ``k`` distinct contributions (one per coordinate
  on the partial mesh dims): merging ``k`` values takes at least ``k - 1`` messages (a
  message joins at most two partial sums), and every receiver other than the device
  where the sum is completed needs one more: ``(k - 1) + |R| - [R and H meet]``. For an
  all-reduce of ``n`` devices this is ``2(n-1)`` messages per element, i.e. ``2T(n-1)/n``
  bytes per device (the ring's figure); for a reduce-scatter ``(n-1)`` per element, i.e.
  ``T(n-1)/n``.
* Partial kept (same partial mesh dims in source and target): each contribution stays
  with its coordinate on the partial mesh dims and moves like a plain tensor among the
  devices of that coordinate: ``sum over c of |R_c \\ H_c|``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from placements2jax import Layout
from placements2jax.inference.cost import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    LOCAL_PARTIAL,
    LOCAL_SLICE,
    REDUCE_SCATTER,
    block_bytes,
    collective_bytes,
)
from placements2jax.schedules import sent_bytes_per_device  # noqa: F401  (counts compiled bytes; not the bound)


def _cells(src: Layout, dst: Layout, shape: tuple[int, ...]) -> list[np.ndarray]:
    """Per tensor dim, the cut points of both layouts' blocks (the cells they refine to)."""
    ranks = src.mesh.rank_list
    cuts = []
    for d, n in enumerate(shape):
        points = {0, n}
        for layout in (src, dst):
            for r in ranks:
                s = layout.local_slices(shape, r)[d]
                points.update((s.start, s.stop))
        cuts.append(np.array(sorted(points)))
    return cuts


def _holds(layout: Layout, shape: tuple[int, ...], cuts: list[np.ndarray]) -> np.ndarray:
    """holds[r, cell...]: rank r's block of ``layout`` contains the cell."""
    ranks = layout.mesh.rank_list
    grid = [len(c) - 1 for c in cuts]
    result = np.zeros((len(ranks), *grid), dtype=bool)
    for i, r in enumerate(ranks):
        inside = np.ones(grid, dtype=bool)
        for d, s in enumerate(layout.local_slices(shape, r)):
            starts = cuts[d][:-1]
            view = [1] * len(grid)
            view[d] = grid[d]
            inside = inside & ((starts >= s.start) & (starts < s.stop)).reshape(view)
        result[i] = inside
    return result


def lower_bound_bytes(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int) -> Fraction:
    """The least average bytes per device any algorithm sends for the move (see the
    module docstring)."""
    shape = tuple(shape)
    mesh = src.mesh
    if dst.partial_axes and dst.partial_axes != src.partial_axes:
        raise NotImplementedError("bounds are derived for moves that keep or reduce all partial mesh dims")
    cuts = _cells(src, dst, shape)
    sizes = np.ones([len(c) - 1 for c in cuts], dtype=np.int64)
    for d, c in enumerate(cuts):
        view = [1] * len(cuts)
        view[d] = len(c) - 1
        sizes = sizes * np.diff(c).reshape(view)
    held, wanted = _holds(src, shape, cuts), _holds(dst, shape, cuts)
    coordinates = np.array([mesh.get_coordinate(r) for r in mesh.rank_list])
    partial = src.partial_axes
    if not partial:
        messages = (wanted & ~held).sum(axis=0)
    elif dst.partial_axes:
        messages = np.zeros(sizes.shape, dtype=np.int64)
        for c in itertools.product(*(range(mesh.shape[a]) for a in partial)):
            group = np.all(coordinates[:, list(partial)] == c, axis=1)
            messages += (wanted[group] & ~held[group]).sum(axis=0)
    else:
        k = int(np.prod([mesh.shape[a] for a in partial]))
        meet = (wanted & held).any(axis=0)
        messages = (k - 1) + wanted.sum(axis=0) - meet
    return Fraction(int((messages * sizes).sum()) * itemsize, mesh.size())


def step_bytes(kind: str, before: Layout, mesh_dim: int, shape: Sequence[int], itemsize: int) -> Fraction:
    """Bytes per device of one planner step on ``mesh_dim`` from layout ``before``, by the
    cost model's ring formulas (docs/inference.md section 4)."""
    block = block_bytes(shape, itemsize, before.dim_axes, before.mesh.shape, without=mesh_dim)
    return collective_bytes(kind, block, before.mesh.shape[mesh_dim])


STEP_KINDS = (ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, ALL_REDUCE, LOCAL_SLICE, LOCAL_PARTIAL)
