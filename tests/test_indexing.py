"""DTensor.__getitem__: values against NumPy (full and per device), placements by torch's
rules (a dim indexed other than ':' is unsharded first), uneven splits, partials, grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placements2jax import (
    DeviceMesh,
    IndexingError,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from placements2jax import indexing
from placements2jax.errors import ArgumentTypeError
from placements2jax.hlo import compiled_collectives

X = np.arange(8 * 6 * 5, dtype=np.float32).reshape(8, 6, 5)
U = np.arange(7 * 5 * 3, dtype=np.float32).reshape(7, 5, 3)  # uneven on both mesh dims


@pytest.fixture(scope="module")
def mesh() -> DeviceMesh:
    return init_device_mesh((4, 2), ("dp", "tp"))


def assert_every_device(y, expected: np.ndarray) -> None:
    """The full value, and every rank's local block as torch.chunk cuts ``expected``."""
    np.testing.assert_array_equal(np.asarray(y.full_tensor()), expected)
    for rank in range(8):
        shape, offset = y.layout.local_shape_and_offset(expected.shape, rank)
        block = expected[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        local = np.asarray(y.to_local(rank))
        if y.layout.has_partial:
            continue  # a partial rank holds a share of the value, checked through full_tensor
        np.testing.assert_array_equal(local, block)


@pytest.mark.parametrize(
    ("key", "placements"),
    [
        ((slice(None), 1), (Shard(0), Replicate())),               # int on the tp-split dim: unshard it
        ((1,), (Replicate(), Shard(0))),                           # int on the dp-split dim drops it
        ((Ellipsis, 2), (Shard(0), Shard(1))),                     # an unsplit dim: nothing moves
        ((slice(None), slice(None), None), (Shard(0), Shard(1))),  # new trailing dim
        ((None, slice(None)), (Shard(1), Shard(2))),               # new leading dim
        ((slice(2, 7),), (Replicate(), Shard(1))),                 # torch: a partial slice of a split dim
        ((slice(None, None, -1),), (Replicate(), Shard(1))),
        ((slice(1, None, 2),), (Shard(0), Shard(1))),              # blocks of 2, step 2: stays split
        ((slice(0, None, 2), None, Ellipsis), (Shard(0), Shard(2))),
        ((slice(None), np.array([0, 5, 2])), (Shard(0), Replicate())),
        ((np.array([[7, 0], [3, 3]]),), (Replicate(), Shard(2))),
        ((-1, -2, -3), (Replicate(), Replicate())),
    ],
)
def test_even_indexing_matches_numpy_and_torch_placements(mesh: DeviceMesh, key, placements) -> None:
    x = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    y = x[key]
    assert y.placements == placements
    assert_every_device(y, X[key])


@settings(max_examples=15)  # each example compiles its programs
@given(st.data())
def test_uneven_indexing_is_exact(mesh: DeviceMesh, data) -> None:
    x = distribute_tensor(U, mesh, [Shard(0), Shard(1)])
    key = []
    for size in U.shape:
        kind = data.draw(st.sampled_from(["int", "slice", "full", "none"]))
        if kind == "int":
            key.append(data.draw(st.integers(-size, size - 1)))
        elif kind == "slice":
            start = data.draw(st.none() | st.integers(-size, size))
            stop = data.draw(st.none() | st.integers(-size, size))
            step = data.draw(st.none() | st.sampled_from([1, 2, 3, -1, -2]))
            key.append(slice(start, stop, step))
        elif kind == "none":
            key.extend([None, slice(None)])
        else:
            key.append(slice(None))
    expected = U[tuple(key)]
    y = x[tuple(key)]
    assert y.shape == expected.shape
    assert_every_device(y, expected)


def test_array_index_on_uneven_split_and_jax_index(mesh: DeviceMesh) -> None:
    x = distribute_tensor(U, mesh, [Shard(1), Shard(0)])
    index = jnp.array([4, 0, 4, 2])
    y = x[:, index]
    assert y.placements == (Replicate(), Shard(0))
    assert_every_device(y, U[:, np.asarray(index)])


def test_partial_passes_through_indexing(mesh: DeviceMesh) -> None:
    x = distribute_tensor(X, mesh, [Shard(0), Partial()])
    y = x[:, 2:5, 1]
    assert y.placements == (Shard(0), Partial())
    np.testing.assert_allclose(np.asarray(y.full_tensor()), X[:, 2:5, 1])


def test_indexing_under_jit_and_grad(mesh: DeviceMesh) -> None:
    x = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    out = jax.jit(lambda t: t[1::2, 3])(x)
    assert out.placements == (Shard(0), Replicate())
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), X[1::2, 3])
    grad = jax.jit(jax.grad(lambda t: (t[1::2, 3] * 2).sum().to_jax()))(x)
    expected = np.zeros_like(X)
    expected[1::2, 3] = 2
    np.testing.assert_array_equal(np.asarray(grad.full_tensor()), expected)
    assert grad.placements == x.placements


def test_bad_indices(mesh: DeviceMesh) -> None:
    x = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    with pytest.raises(IndexingError, match="out of bounds for dim 1 of size 6"):
        x[0, 6]
    with pytest.raises(IndexingError, match="indexes 4 dims of a 3-d DTensor"):
        x[0, 0, 0, 0]
    with pytest.raises(IndexingError, match="more than one"):
        x[..., 0, ...]
    with pytest.raises(IndexingError, match="step of 0"):
        x[::0]
    with pytest.raises(IndexingError, match="boolean mask"):
        x[X[:, 0, 0] > 3]
    with pytest.raises(IndexingError, match="several dims with arrays"):
        x[[0, 1], [1, 2]]
    with pytest.raises(IndexingError, match="values 0..9 are out of bounds"):
        x[[0, 9]]
    with pytest.raises(ArgumentTypeError, match="not an integer"):
        x[0.5:]
    with pytest.raises(ArgumentTypeError, match="a DTensor as an index"):
        x[distribute_tensor(np.array([0, 1]), mesh)]
    with pytest.raises(IndexError):  # IndexingError is an IndexError, as Python's indexing raises
        x[8]


def test_step_slices_that_keep_the_split_move_nothing(mesh: DeviceMesh) -> None:
    x = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    step = jax.jit(lambda t: t[1::2, ::3].to_jax())
    assert compiled_collectives(step, x) == []
    y = x[1::2, ::3]
    assert y.placements == (Shard(0), Shard(1))
    assert_every_device(y, X[1::2, ::3])
    p = distribute_tensor(X, mesh, [Partial("max"), Shard(0)])  # a stacked partial passes through
    z = p[::2]
    assert z.placements == (Partial("max"), Shard(0))
    np.testing.assert_array_equal(np.asarray(z.full_tensor()), X[::2])


def test_step_slices_compile_once_per_layout(mesh: DeviceMesh) -> None:
    """The per-rank slicing is one jitted shard_map per layout and slicing, reused: eager
    jax.shard_map compiles anew on every call (~100 ms each in JAX 0.10.2)."""
    x = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    x[1::2, ::3]
    before = indexing._per_rank_slicer.cache_info()
    for _ in range(3):
        assert_every_device(x[1::2, ::3], X[1::2, ::3])
    after = indexing._per_rank_slicer.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (3, 0)
