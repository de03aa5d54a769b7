"""from_local's torch keywords: run_check (torch's broadcast of the first replica along
every Replicate mesh dim) and stride (the contiguous stride only, as torch computes it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from placements2jax import ArgumentTypeError, DTensor, Partial, Replicate, Shard, ShapeError, init_device_mesh

MESH = init_device_mesh((4, 2), ("dp", "tp"))


def _locals(shape: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Every rank a different block: rank r holds r everywhere."""
    return {r: np.full(shape, float(r), np.float32) for r in MESH.rank_list}


def test_run_check_makes_replicas_agree_as_torch_broadcasts() -> None:
    pieces = _locals((2, 3))
    x = DTensor.from_local(pieces, MESH, [Shard(0), Replicate()], run_check=True)
    # the first rank along tp (tp coordinate 0) is rank 2 * dp: its block wins on both tp ranks
    for rank in MESH.rank_list:
        np.testing.assert_array_equal(np.asarray(x.to_local(rank)), np.full((2, 3), 2.0 * (rank // 2)))
    np.testing.assert_array_equal(np.asarray(x.full_tensor()), np.repeat([0.0, 2, 4, 6], 2)[:, None] * np.ones(3))
    y = DTensor.from_local(pieces, MESH, [Replicate(), Replicate()], run_check=True)
    np.testing.assert_array_equal(np.asarray(y.full_tensor()), np.zeros((2, 3)))
    assert all(np.asarray(y.to_local(r)).sum() == 0 for r in MESH.rank_list)


def test_run_check_keeps_partial_and_split_blocks() -> None:
    pieces = _locals((2, 3))
    x = DTensor.from_local(pieces, MESH, [Partial(), Shard(1)], run_check=True)
    plain = DTensor.from_local(pieces, MESH, [Partial(), Shard(1)])
    np.testing.assert_array_equal(np.asarray(x.full_tensor()), np.asarray(plain.full_tensor()))


def test_run_check_on_one_array_changes_nothing() -> None:
    block = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    x = DTensor.from_local(block, MESH, [Shard(0), Replicate()], run_check=True)
    np.testing.assert_array_equal(np.asarray(x.full_tensor()), np.tile(block, (4, 1)))


@pytest.mark.parametrize("shape", [(8, 6), (5, 1, 3), (7,), ()])
def test_stride_is_torchs_contiguous_stride(shape) -> None:
    stride = torch.empty(shape).stride()
    block = np.zeros(shape, np.float32)
    x = DTensor.from_local(block, MESH, [Replicate(), Replicate()], shape=shape, stride=stride)
    assert x.shape == shape
    DTensor.from_local(block, MESH, [Replicate(), Replicate()], stride=list(stride))  # remembered path too
    DTensor.from_local(block, MESH, [Replicate(), Replicate()], stride=list(stride))


def test_non_contiguous_stride_is_refused() -> None:
    block = np.zeros((2, 6), np.float32)
    transposed = torch.empty(6, 8).t().stride()  # a transposed view of a (6, 8) tensor: (1, 8)
    with pytest.raises(ShapeError, match=r"stride=\(1, 8\): is not the contiguous stride \(6, 1\)"):
        DTensor.from_local(block, MESH, [Shard(0), Replicate()], stride=transposed)
    with pytest.raises(ArgumentTypeError, match="stride"):
        DTensor.from_local(block, MESH, [Shard(0), Replicate()], stride="6,1")
    with pytest.raises(ArgumentTypeError, match="run_check"):
        DTensor.from_local(block, MESH, [Shard(0), Replicate()], run_check="yes")
