"""Pure arithmetic of torch.chunk sharding, nested over mesh axes. No JAX here.

One tensor dimension of extent ``size`` is split by a sequence of mesh axes, major to
minor, each given as ``(pieces, index)``: the axis size and the rank's coordinate on it.
Each split applies the 1-D torch.chunk rule to the *current local* extent, exactly as
torch's ``_compute_local_shape_and_global_offset`` walks mesh dimensions.

The padded physical representation used by DTensor gives every rank a block of
``ceil(size / prod(pieces))`` elements (the largest local extent any rank can have), with
the rank's logical elements at the start of its block, so JAX can shard it evenly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "chunk_1d",
    "nested_chunk",
    "block_size",
    "padded_size",
    "logical_to_physical",
    "is_even",
]


def chunk_1d(size: int, pieces: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk ``index`` when ``size`` elements are split into ``pieces``
    with torch.chunk: every chunk has ``ceil(size / pieces)`` elements but the last ones."""
    full = -(-size // pieces)
    start = min(size, full * index)
    return start, min(size, start + full) - start


def nested_chunk(size: int, splits: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(offset, length) of a rank's block after the nested splits ``(pieces, index)``.

    An empty block reports ``offset == size``, as torch does.
    """
    offset, length = 0, size
    for pieces, index in splits:
        start, length = chunk_1d(length, pieces, index)
        offset += start
    return (offset, length) if length else (size, 0)


def block_size(size: int, pieces: Sequence[int]) -> int:
    """The largest local extent under nested splits: ``ceil(size / prod(pieces))``."""
    return -(-size // math.prod(pieces))


def padded_size(size: int, pieces: Sequence[int]) -> int:
    """Extent of the padded physical dimension: one block per rank combination."""
    return math.prod(pieces) * block_size(size, pieces)


def is_even(size: int, pieces: Sequence[int]) -> bool:
    """True when no padding is needed, i.e. every rank's block is full."""
    return padded_size(size, pieces) == size


def logical_to_physical(size: int, pieces: Sequence[int]) -> np.ndarray:
    """For each logical index, its position in the padded physical dimension.

    Blocks are laid out in row-major order of the split indices (major axis first), which
    is how a JAX ``PartitionSpec`` entry ``(major, ..., minor)`` tiles a dimension.
    """
    block = block_size(size, pieces)
    positions = np.empty(size, dtype=np.int64)
    for flat, indices in enumerate(itertools.product(*(range(p) for p in pieces))):
        offset, length = nested_chunk(size, tuple(zip(pieces, indices)))
        positions[offset : offset + length] = flat * block + np.arange(length)
    return positions
