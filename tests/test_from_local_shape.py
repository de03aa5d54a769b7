"""from_local's global shape inference in closed form (sum of the blocks along the split
axes, every rank checked against torch.chunk): exact for every layout and shape, errors
for local shapes torch.chunk never gives, and independent of the extents' size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import DTensor, ShapeError, init_device_mesh
from placements2jax.layout import iter_layouts

MESH = init_device_mesh((4, 2), ("dp", "tp"))
LAYOUTS = iter_layouts(MESH, 2, partial_ops=("sum",))


@given(st.sampled_from(LAYOUTS), st.integers(0, 23), st.integers(0, 11))
def test_inferred_shape_is_the_global_shape(layout, rows, cols) -> None:
    shape = (rows, cols)
    pieces = {r: np.zeros(layout.local_shape(shape, r), np.float32) for r in MESH.rank_list}
    assert DTensor.from_local(pieces, MESH, layout).shape == shape


@given(st.sampled_from([lay for lay in LAYOUTS if lay.dim_axes[0]]), st.integers(1, 23), st.data())
def test_blocks_torch_chunk_never_gives_are_refused(layout, rows, data) -> None:
    shape = (rows, 3)
    extents = {r: layout.local_shape(shape, r)[0] for r in MESH.rank_list}
    rank = data.draw(st.sampled_from(MESH.rank_list))
    extents[rank] += data.draw(st.sampled_from([-1, 1]) if extents[rank] else st.just(1))
    pieces = {r: np.zeros((e, 3), np.float32) for r, e in extents.items()}
    try:
        got = DTensor.from_local(pieces, MESH, layout).shape
    except ShapeError as error:
        assert error.argument == "local_tensor" and "torch.chunk" in str(error)
    else:  # another global extent gives exactly these blocks
        assert {r: layout.local_shape(got, r)[0] for r in MESH.rank_list} == extents


def test_large_extents_cost_nothing_to_infer() -> None:
    """8 x (65536, 4): the candidate search took 13 s; the closed form is O(mesh size)."""
    mesh = init_device_mesh((8,), ("x",))
    pieces = [np.full((65536, 4), r, np.float32) for r in range(8)]
    dt = DTensor.from_local(pieces, mesh, "S(0)")
    assert dt.shape == (524288, 4)
    np.testing.assert_array_equal(np.asarray(dt.to_local(5)), pieces[5])
    uneven = [np.zeros((65536 if r < 7 else 65530, 4), np.float32) for r in range(8)]
    assert DTensor.from_local(uneven, mesh, "S(0)").shape == (65536 * 7 + 65530, 4)
    with pytest.raises(ShapeError, match="torch.chunk"):
        DTensor.from_local([np.zeros((65530 if r == 3 else 65536, 4), np.float32) for r in range(8)], mesh, "S(0)")
