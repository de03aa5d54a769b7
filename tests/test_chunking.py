"""torch.chunk arithmetic, nested over mesh axes, and the padded physical positions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax.chunking import (
    block_size,
    chunk_1d,
    is_even,
    logical_to_physical,
    nested_chunk,
    padded_size,
)


def _torch_chunk(items: list[int], pieces: int) -> list[list[int]]:
    """Reference: torch.chunk on a list, with the missing trailing chunks as empty lists
    (torch.chunk returns fewer chunks; DTensor gives those ranks empty shards)."""
    step = -(-len(items) // pieces) if items else 0
    chunks = [items[i * step : (i + 1) * step] for i in range(pieces)] if step else []
    return chunks + [[] for _ in range(pieces - len(chunks))]


# -- the 1-D rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "pieces", "expected"),
    [
        (10, 4, [(0, 3), (3, 3), (6, 3), (9, 1)]),
        (5, 4, [(0, 2), (2, 2), (4, 1), (5, 0)]),
        (10, 8, [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2), (10, 0), (10, 0), (10, 0)]),
        (8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
        (3, 4, [(0, 1), (1, 1), (2, 1), (3, 0)]),
        (0, 2, [(0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_chunk_1d(size: int, pieces: int, expected: list[tuple[int, int]]) -> None:
    assert [chunk_1d(size, pieces, i) for i in range(pieces)] == expected


def test_1d_sizes_from_the_notes() -> None:
    assert [chunk_1d(10, 4, i)[1] for i in range(4)] == [3, 3, 3, 1]
    assert [chunk_1d(5, 4, i)[1] for i in range(4)] == [2, 2, 1, 0]
    assert [chunk_1d(10, 8, i)[1] for i in range(8)] == [2, 2, 2, 2, 2, 0, 0, 0]


# -- the nested rule ------------------------------------------------------------------------


def test_nested_10_rows_over_2x2() -> None:
    blocks = [nested_chunk(10, ((2, i), (2, j))) for i, j in itertools.product(range(2), range(2))]
    assert blocks == [(0, 3), (3, 2), (5, 3), (8, 2)]
    # Not the flat 4-way chunk, which gives 3,3,3,1.
    assert [nested_chunk(10, ((4, r),)) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]


@pytest.mark.parametrize(
    ("size", "splits", "expected"),
    [
        (9, (2, 2), [(0, 3), (3, 2), (5, 2), (7, 2)]),
        (5, (2, 4), [(0, 1), (1, 1), (2, 1), (5, 0), (3, 1), (4, 1), (5, 0), (5, 0)]),
        (6, (4, 2), [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 0), (6, 0)]),
        (12, (2, 2, 2), [(0, 2), (2, 1), (3, 2), (5, 1), (6, 2), (8, 1), (9, 2), (11, 1)]),
    ],
)
def test_nested_more_cases(size: int, splits: tuple[int, ...], expected: list[tuple[int, int]]) -> None:
    indices = itertools.product(*(range(p) for p in splits))
    assert [nested_chunk(size, tuple(zip(splits, idx))) for idx in indices] == expected


def test_no_splits_is_the_whole_dim() -> None:
    assert nested_chunk(10, ()) == (0, 10)
    assert nested_chunk(0, ()) == (0, 0)


def test_empty_shard_reports_offset_equal_to_global_size() -> None:
    assert nested_chunk(5, ((4, 3),)) == (5, 0)
    assert nested_chunk(10, ((8, 7),)) == (10, 0)
    # Empty after the second split, although the first split's block starts at 3.
    assert nested_chunk(5, ((2, 1), (4, 2))) == (5, 0)
    assert nested_chunk(0, ((2, 0), (2, 1))) == (0, 0)


@given(
    st.integers(0, 40),
    st.lists(st.integers(1, 5), max_size=3),
)
def test_nested_chunk_matches_repeated_torch_chunk(size: int, splits: list[int]) -> None:
    blocks: dict[tuple[int, ...], list[int]] = {(): list(range(size))}
    for pieces in splits:
        blocks = {idx + (i,): chunk for idx, items in blocks.items() for i, chunk in enumerate(_torch_chunk(items, pieces))}
    for idx, items in blocks.items():
        offset, length = nested_chunk(size, tuple(zip(splits, idx)))
        assert length == len(items)
        assert offset == (items[0] if items else size)
        assert items == list(range(offset, offset + length))


# -- padded physical representation ------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "pieces", "block", "padded", "even"),
    [
        (10, (4,), 3, 12, False),
        (5, (4,), 2, 8, False),
        (10, (8,), 2, 16, False),
        (10, (2, 2), 3, 12, False),
        (8, (4, 2), 1, 8, True),
        (16, (2, 4), 2, 16, True),
        (7, (), 7, 7, True),
        (0, (4,), 0, 0, True),
    ],
)
def test_block_and_padded_sizes(size: int, pieces: tuple[int, ...], block: int, padded: int, even: bool) -> None:
    assert block_size(size, pieces) == block
    assert padded_size(size, pieces) == padded
    assert is_even(size, pieces) is even


@pytest.mark.parametrize(
    ("size", "pieces", "positions"),
    [
        (10, (4,), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
        (5, (4,), [0, 1, 2, 3, 4]),
        (10, (2, 2), [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]),
        (9, (2, 2), [0, 1, 2, 3, 4, 6, 7, 9, 10]),
        (5, (2, 4), [0, 1, 2, 4, 5]),
        (6, (3,), [0, 1, 2, 3, 4, 5]),
        (3, (), [0, 1, 2]),
    ],
)
def test_logical_to_physical_examples(size: int, pieces: tuple[int, ...], positions: list[int]) -> None:
    result = logical_to_physical(size, pieces)
    assert result.dtype == np.int64
    assert result.tolist() == positions


@given(st.integers(0, 60), st.lists(st.integers(1, 5), max_size=3))
def test_physical_positions_properties(size: int, pieces: list[int]) -> None:
    positions = logical_to_physical(size, pieces)
    block = block_size(size, pieces)
    padded = padded_size(size, pieces)
    assert padded == math.prod(pieces) * block >= size
    assert positions.shape == (size,)
    # injective and inside the padded dimension
    assert len(set(positions.tolist())) == size
    assert all(0 <= p < padded for p in positions.tolist())
    # each rank's elements lie contiguously at the start of its own block
    for flat, idx in enumerate(itertools.product(*(range(p) for p in pieces))):
        offset, length = nested_chunk(size, tuple(zip(pieces, idx)))
        assert length <= block
        assert positions[offset : offset + length].tolist() == list(range(flat * block, flat * block + length))
    # even layouts need no padding: the positions are the identity
    if is_even(size, pieces):
        assert positions.tolist() == list(range(size))
