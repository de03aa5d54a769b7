"""redistribute: exact values between every pair of layouts, torch's refusals, the
collectives XLA compiles for each single-mesh-dim move, jit / grad, other meshes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import (
    DeviceMesh,
    DTensor,
    Layout,
    Partial,
    RedistributeError,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    redistribute_collectives,
    resolve_layout,
)
from placements2jax.layout import iter_layouts


def _mesh(shape: tuple[int, ...], axis_types: str = "explicit") -> DeviceMesh:
    return init_device_mesh(shape, tuple("abc"[: len(shape)]), axis_types=axis_types)


def _legal(src: Layout, dst: Layout) -> bool:
    for mesh_dim, (src_op, dst_op) in enumerate(zip(src.partial, dst.partial)):
        if dst_op and (src.mesh_dim_split(mesh_dim) is not None or (src_op and src_op != dst_op)):
            return False
    return True


def _assert_lands(dt: DTensor, x: np.ndarray, layout: Layout) -> None:
    """The per-device data of ``dt`` is what torch's rules give for ``layout``."""
    assert dt.layout == layout and dt.shape == x.shape
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)
    if not layout.has_partial:
        for rank in layout.mesh.rank_list:
            np.testing.assert_array_equal(np.asarray(dt.to_local(rank)), x[layout.local_slices(x.shape, rank)])
    else:
        plain = Layout(layout.mesh, layout.dim_axes)
        blocks = {r: np.asarray(dt.to_local(r)) for r in layout.mesh.rank_list}
        for rank, block in blocks.items():
            assert block.shape == plain.local_shape(x.shape, rank)


@pytest.mark.parametrize(
    "mesh_shape,shape,partial_ops,stride",
    [((8,), (10, 3), ("sum", "max"), 1), ((2, 2), (5, 3), ("sum", "max"), 1), ((2, 2, 2), (5,), ("sum",), 3)],
    ids=["1d-mesh", "2d-mesh", "3d-mesh"],
)
def test_every_pair_of_layouts_is_exact(mesh_shape, shape, partial_ops, stride):
    """All pairs on 1-D and 2-D meshes; on the 3-D mesh every source against a third of
    the targets (rotating, so every pair kind appears) to keep the suite fast."""
    mesh = _mesh(mesh_shape)
    x = np.arange(math.prod(shape), dtype=np.int32).reshape(shape) - 7
    layouts = iter_layouts(mesh, len(shape), partial_ops=partial_ops)
    for index, src in enumerate(layouts):
        dt = distribute_tensor(x, mesh, src)
        for dst in layouts[index % stride :: stride]:
            if not _legal(src, dst):
                with pytest.raises(RedistributeError):
                    dt.redistribute(placements=dst)
                continue
            _assert_lands(dt.redistribute(placements=dst), x, dst)
        np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)  # input untouched


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_partial_reduces_with_its_op(op):
    mesh = _mesh((4, 2))
    rng = np.random.default_rng(1)
    locals_ = [rng.normal(size=(6, 2)).astype(np.float32) for _ in mesh.rank_list]
    dt = DTensor.from_local(locals_, mesh, (Partial(op), Shard(1)))
    reduce = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[op]
    for col_block, tp in ((slice(0, 2), 0), (slice(2, 4), 1)):
        expected_cols = reduce(np.stack([locals_[2 * dp + tp] for dp in range(4)]), axis=0)
        replicated = dt.redistribute(placements=(Replicate(), Replicate()))
        np.testing.assert_allclose(np.asarray(replicated.full_tensor())[:, col_block], expected_cols, rtol=1e-5)
    sharded = dt.redistribute(placements=(Shard(0), Shard(1)))
    np.testing.assert_allclose(
        np.asarray(sharded.full_tensor()), np.asarray(dt.full_tensor()), rtol=1e-5
    )


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_replicate_to_partial_follows_torch_values(op):
    mesh = _mesh((4, 2))
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    dt = distribute_tensor(x, mesh, (Replicate(), Shard(0)))
    partial = dt.redistribute(placements=(Partial(op), Shard(0)))
    scale = 4 if op == "sum" else 1
    for rank in mesh.rank_list:
        tp = mesh.get_coordinate(rank)[1]
        np.testing.assert_allclose(np.asarray(partial.to_local(rank)), x[4 * tp : 4 * tp + 4] / scale)
    np.testing.assert_allclose(np.asarray(partial.full_tensor()), x)


def test_torch_refusals_are_clear_errors():
    mesh = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    dt = distribute_tensor(np.ones((4, 4)), mesh, (Shard(0), Replicate()))
    with pytest.raises(RedistributeError, match=r"mesh dim 'dp' goes from Shard\(0\) to Partial\(sum\).*Replicate first"):
        dt.redistribute(placements=(Partial(), Replicate()))
    partial = distribute_tensor(np.ones((4, 4)), mesh, (Partial("max"), Replicate()))
    with pytest.raises(RedistributeError, match=r"Partial\(max\) to Partial\(sum\)"):
        partial.redistribute(placements=(Partial("sum"), Replicate()))
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), np.ones((4, 4)))


MOVES_4x2 = [
    # (source, target, expected collectives) for one mesh dim on a (4, 2) mesh, even shape.
    ("S(0),R", "R,R", ["all-gather"]),
    ("R,S(0)", "R,R", ["all-gather"]),
    ("S(0),R", "S(1),R", ["all-to-all"]),
    ("R,S(1)", "R,S(0)", ["all-to-all"]),
    ("P,R", "R,R", ["all-reduce"]),
    ("R,P", "R,R", ["all-reduce"]),
    ("P(max),R", "R,R", ["all-reduce"]),
    ("P(min),R", "R,R", ["all-reduce"]),
    ("P(avg),R", "R,R", ["all-reduce"]),
    ("R,R", "S(0),R", []),
    ("R,R", "R,S(1)", []),
    ("R,R", "P,R", []),
    ("R,R", "P(max),R", []),
    ("S(0),R", "S(0),R", []),
]


@pytest.mark.parametrize("source,target,expected", MOVES_4x2, ids=[f"{s}->{t}" for s, t, _ in MOVES_4x2])
def test_single_mesh_dim_moves_compile_to_their_collective(source, target, expected):
    mesh = DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
    dt = distribute_tensor(np.ones((8, 8), np.float32), mesh, source)
    collectives = redistribute_collectives(dt, target)
    assert [c.op for c in collectives] == expected
    groups = {"dp": ((0, 2, 4, 6), (1, 3, 5, 7)), "tp": ((0, 1), (2, 3), (4, 5), (6, 7))}
    moved_dim = next(i for i, (a, b) in enumerate(zip(source.split(","), target.split(","))) if a != b) if expected else None
    for c in collectives:
        assert c.groups == groups[("dp", "tp")[moved_dim]]


@pytest.mark.parametrize("source", ["P,R", "P(max),R"])
def test_partial_to_shard_is_reduce_scatter_or_all_reduce_and_slice(source):
    mesh = DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
    dt = distribute_tensor(np.ones((8, 8), np.float32), mesh, source)
    ops = [c.op for c in redistribute_collectives(dt, "S(0),R")]
    # CPU XLA forms no reduce-scatter (notes section 4): all-reduce + local dynamic-slice.
    assert ops in (["reduce-scatter"], ["all-reduce"])


def test_redistribute_inside_jit_emits_collectives_into_the_caller():
    mesh = _mesh((4, 2))
    x = np.arange(56, dtype=np.float32).reshape(7, 8)
    dt = distribute_tensor(x, mesh, (Shard(0), Replicate()))

    def step(d: DTensor) -> DTensor:
        return d.redistribute(placements=(Replicate(), Shard(1)))

    eager = step(dt)
    jitted = jax.jit(step)(dt)
    assert jitted.layout == eager.layout
    for rank in mesh.rank_list:
        np.testing.assert_array_equal(np.asarray(jitted.to_local(rank)), np.asarray(eager.to_local(rank)))
    hlo = jax.jit(step).lower(dt).compile().as_text()
    assert "all-gather" in hlo or "all-to-all" in hlo or "collective-permute" in hlo


def test_grad_through_dtensor_functions():
    mesh = _mesh((4, 2))
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    dt = distribute_tensor(x, mesh, (Shard(0), Shard(1)))

    def loss(d: DTensor) -> jax.Array:
        full = d.redistribute(placements=(Replicate(), Replicate())).full_tensor()
        return jnp.sum(full**2)

    grad = jax.jit(jax.grad(loss))(dt)
    assert isinstance(grad, DTensor) and grad.layout == dt.layout
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), 2 * x)
    leaves, treedef = jax.tree_util.tree_flatten(dt)
    assert len(leaves) == 1 and jax.tree_util.tree_unflatten(treedef, leaves).layout == dt.layout
    doubled = jax.tree_util.tree_map(lambda a: a * 2, dt)
    np.testing.assert_array_equal(np.asarray(doubled.full_tensor()), 2 * x)


def test_redistribute_to_another_mesh():
    mesh = DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
    other = DeviceMesh([1, 3, 5, 7], ("x",))
    for shape, placements in [((8, 4), (Shard(0), Shard(1))), ((7, 3), (Partial(), Shard(0))), ((8, 4), (Partial("max"), Replicate()))]:
        x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
        dt = distribute_tensor(x, mesh, placements)
        for target in [(Shard(1),), (Replicate(),), (Partial("min"),), (Shard(0),)]:
            moved = dt.redistribute(other, target)
            assert moved.device_mesh == other
            np.testing.assert_allclose(np.asarray(moved.full_tensor()), x)
            layout = moved.layout
            if not layout.has_partial:
                for rank in other.rank_list:
                    local = moved.to_local(rank)
                    assert local.devices() == {other.device(rank)}
                    np.testing.assert_array_equal(np.asarray(local), x[layout.local_slices(shape, rank)])


def test_auto_mesh_redistribute():
    mesh = _mesh((4, 2), axis_types="auto")
    x = np.arange(30, dtype=np.int32).reshape(10, 3)
    dt = distribute_tensor(x, mesh, (Partial(), Shard(1)))
    for target in [(Replicate(), Replicate()), (Shard(0), Shard(1)), (Partial(), Replicate())]:
        _assert_lands(dt.redistribute(placements=target), x, resolve_layout(mesh, target, 2))


MESHES = [(8,), (2, 4), (4, 2), (2, 2, 2), (3,), (2, 3), (1, 4), (2, 1, 2)]  # size-1 dims: dp=1 runs


@st.composite
def _chains(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh = _mesh(mesh_shape)
    layouts = iter_layouts(mesh, ndim, partial_ops=("sum", "avg", "max", "min"))
    chain = draw(st.lists(st.sampled_from(layouts), min_size=2, max_size=4))
    return mesh, shape, chain


@given(_chains())
def test_redistribute_chains_preserve_integer_values(case):
    mesh, shape, chain = case
    x = (np.arange(math.prod(shape), dtype=np.int32) * 3 - 11).reshape(shape)
    dt = distribute_tensor(x, mesh, chain[0])
    for target in chain[1:]:
        if not _legal(dt.layout, target):
            with pytest.raises(RedistributeError):
                dt.redistribute(placements=target)
            target = Layout(mesh, target.dim_axes)
            if not _legal(dt.layout, target):
                continue
        dt = dt.redistribute(placements=target)
        _assert_lands(dt, x, target)
    np.testing.assert_array_equal(np.asarray(dt.redistribute(placements=Layout(mesh, ((),) * len(shape))).full_tensor()), x)


@pytest.mark.parametrize(
    "mesh_shape,source,target,shape",
    [((4, 2), "P,S(0)", "P,S(1)", (8, 8)), ((2, 2, 2), "P,S(0),S(1)", "P,S(1),S(0)", (4, 4))],
)
def test_partial_kept_across_a_move_among_the_same_mesh_axes_is_not_reduced(mesh_shape, source, target, shape):
    """The dims move among the mesh axes they already use: JAX's reshard keeps the
    unreduced values right, so no all-reduce (only the move itself)."""
    mesh = _mesh(mesh_shape)
    x = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    dt = distribute_tensor(x, mesh, source)
    ops = [c.op for c in redistribute_collectives(dt, target)]
    assert "all-reduce" not in ops and len(ops) == 1
    _assert_lands(dt.redistribute(mesh, target), x, resolve_layout(mesh, target, 2))


def test_refused_move_names_the_placements_as_written() -> None:
    """The error echoes what the user passed ('P,R', a list of placements), not the layout
    object it became."""
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    dt = distribute_tensor(np.zeros((8, 2), np.float32), mesh, "S(0),R")
    with pytest.raises(RedistributeError, match=r"^placements='P,R': mesh dim 'dp' goes from Shard\(0\)"):
        dt.redistribute(mesh, "P,R")
    with pytest.raises(RedistributeError, match=r"^placements=\[Partial\(reduce_op='sum'\), Shard\(dim=1\)\]: "):
        dt.redistribute(placements=[Partial(), Shard(1)])
    with pytest.raises(RedistributeError, match=r"^placements='P,R': "):
        redistribute_collectives(dt, "P,R")
