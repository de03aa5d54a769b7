"""The physical jax.Array that carries a DTensor of a given layout and logical shape.

JAX shards only evenly and knows only one partial form (``unreduced``, sums on Explicit
axes), so a DTensor's array differs from its logical tensor in two documented ways:

* **Padding.** A tensor dim split ``k`` ways (nested over mesh axes) is stored with
  ``k * ceil(N / k)`` elements: every rank owns one full block, and its torch.chunk
  elements sit at the start of the block (:mod:`.chunking`). Even dims are not padded.
* **Partial.** ``Partial(sum)`` on Explicit axes uses JAX's native ``unreduced`` form.
  Every other partial (avg, max, min, sum on Auto axes or over a size-1 axis) is *stacked*: one leading dim
  per partial mesh axis, of that axis's size and sharded over it, so each rank's slice of
  the stack is exactly its partial value. Reducing the stack dims is an all-reduce.
* **Strided shards.** A dim with a split factor ``f`` from a view (torch's
  ``_StridedShard``, :attr:`.Layout.split_factors`) is stored permuted: rank ``r``'s block
  holds its elements (chunk ``r`` of each of the ``f`` groups, group-major), so the array
  is block-sharded like a plain split and each device's shard is torch's local tensor.
  A reshape giving one is a reshape, transpose and reshape of the array, which XLA
  compiles without communication; moving to another layout undoes the permutation
  (:func:`.programs.convert`).

This module only describes the representation (shapes, specs, index maps); the programs
that move data live in :mod:`.programs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .caches import cached
from . import chunking
from .layout import Layout

__all__ = ["Physical", "physical"]


@dataclass(frozen=True)
class Physical:
    """The physical representation of a tensor of logical ``shape`` under ``layout``."""

    layout: Layout
    shape: tuple[int, ...]

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return self.layout.mesh.axis_names

    @cached_property
    def unreduced_axes(self) -> tuple[int, ...]:
        """Partial mesh dims carried by JAX's ``unreduced``."""
        layout = self.layout
        # JAX 0.10.2 cannot lower ``unreduced`` over a size-1 axis (an internal assertion
        # in shard_map); the stacked form carries such partials instead.
        if layout.partial_op == "sum" and layout.mesh.is_explicit and all(layout.mesh.shape[a] > 1 for a in layout.partial_axes):
            return layout.partial_axes
        return ()

    @cached_property
    def stacked_axes(self) -> tuple[int, ...]:
        """Partial mesh dims carried as leading stack dims, in mesh order."""
        return () if self.unreduced_axes else self.layout.partial_axes

    @cached_property
    def padded_shape(self) -> tuple[int, ...]:
        """The tensor dims after padding (without the stack dims)."""
        return self.layout.physical_shape(self.shape)

    @cached_property
    def array_shape(self) -> tuple[int, ...]:
        stack = tuple(self.layout.mesh.shape[a] for a in self.stacked_axes)
        return stack + self.padded_shape

    @cached_property
    def is_padded(self) -> bool:
        """True when the array is not the logical tensor as it is: padded, or a strided
        dim stored permuted (every path that handles padding goes through
        :meth:`positions`, which says both)."""
        return self.padded_shape != self.shape or self.layout.is_strided

    @cached_property
    def dim_entries(self) -> tuple[str | tuple[str, ...] | None, ...]:
        """PartitionSpec entries of the tensor dims."""
        entries = []
        for axes in self.layout.dim_axes:
            names = tuple(self.mesh_names[a] for a in axes)
            entries.append(None if not names else names[0] if len(names) == 1 else names)
        return tuple(entries)

    @cached_property
    def spec(self) -> PartitionSpec:
        stack = tuple(self.mesh_names[a] for a in self.stacked_axes)
        unreduced = frozenset(self.mesh_names[a] for a in self.unreduced_axes)
        entries = stack + self.dim_entries
        return PartitionSpec(*entries, unreduced=unreduced) if unreduced else PartitionSpec(*entries)

    @cached_property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.layout.mesh.to_jax(), self.spec)

    @cached_property
    def reduced_sharding(self) -> NamedSharding:
        """The sharding of the tensor dims alone (no partial, no stack dims)."""
        return NamedSharding(self.layout.mesh.to_jax(), PartitionSpec(*self.dim_entries))

    def positions(self, dim: int) -> np.ndarray:
        """Physical index of each logical index along tensor ``dim``."""
        factor = self.layout.split_factors[dim]
        if factor > 1:
            return _strided_positions(self.shape[dim], math.prod(self.layout.pieces(dim)), factor)
        return _positions(self.shape[dim], self.layout.pieces(dim))

    def is_prefix(self, dim: int) -> bool:
        """True when logical index i sits at physical index i (padding only at the end)."""
        if self.layout.split_factors[dim] > 1:
            return False
        return _is_prefix(self.shape[dim], self.layout.pieces(dim))


@cached(maxsize=4096)
def physical(layout: Layout, shape: tuple[int, ...]) -> Physical:
    """The (cached) physical representation of ``shape`` under a bound ``layout``."""
    return Physical(layout, shape)


@cached(maxsize=4096)
def _positions(size: int, pieces: tuple[int, ...]) -> np.ndarray:
    positions = chunking.logical_to_physical(size, pieces)
    positions.setflags(write=False)
    return positions


@cached(maxsize=4096)
def _strided_positions(size: int, pieces: int, factor: int) -> np.ndarray:
    """Logical index ``g * (size / factor) + b * chunk + i`` (group g, block b) sits at
    ``b * (size / pieces) + g * chunk + i``: every block holds its chunk of each group."""
    chunk = size // (factor * pieces)
    positions = np.arange(size).reshape(factor, pieces, chunk).transpose(1, 0, 2).reshape(size)
    inverse = np.empty(size, dtype=np.int64)
    inverse[positions] = np.arange(size)
    inverse.setflags(write=False)
    return inverse


@cached(maxsize=4096)
def _is_prefix(size: int, pieces: tuple[int, ...]) -> bool:
    return bool(np.array_equal(_positions(size, pieces), np.arange(size)))
