"""Property tests (hypothesis) across modules, extending tests/test_layout.py (round trips
on random meshes) and tests/test_redistribute.py (chains on meshes of ranks 0..n-1, int32):

* layouts survive every text and object form: alias text, torch text, repr, shard_order,
  JAX's PartitionSpec / NamedSharding, DeviceMesh <-> jax Mesh, pickle;
* all ranks' local shapes give back the global shape;
* distribute -> redistribute chains -> full_tensor is the input exactly, on meshes of 1-3
  dims over random subsets and orders of the 8 devices, all-Explicit or all-Auto axes,
  for int8/uint8/int16/int32/uint32/bool/float32 data spanning the dtype's range, all
  Partial ops, uneven and empty shapes; steps run eagerly or under jax.jit, and the chain
  ends on another random mesh;
* to_local of every rank -> from_local rebuilds the tensor, and from_local of random
  partial values reduces them exactly as NumPy does.

Examples: the profile's count (conftest: "ci" 200, "dev" 40) for the pure-Python
properties; the ones that compile XLA programs use half of it (each example brings new
meshes and so new compilations, up to ~1 s), so that the "ci" profile runs this file in
about 45 s on the 2-core machine, well under two minutes.
"""

from __future__ import annotations

import functools
import math
import pickle
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding

from placements2jax import (
    DeviceMesh,
    DTensor,
    Layout,
    Partial,
    RedistributeError,
    Replicate,
    Shard,
    distribute_tensor,
    format_alias,
    format_placements,
    parse_alias,
    resolve_layout,
)
from placements2jax.layout import iter_layouts
from placements2jax.placements import REDUCE_OPS

COMPILING = settings(max_examples=max(10, settings.default.max_examples // 2))

MESH_SHAPES = [
    (1,),
    (2,),
    (3,),
    (5,),
    (8,),
    (2, 2),
    (2, 3),
    (3, 2),
    (2, 4),
    (4, 2),
    (1, 4),
    (2, 2, 2),
    (1, 2, 3),
    (2, 1, 2),
]
NAMES = ("dp", "tp", "cp")
AXIS_TYPES = ("explicit", "auto")

# dtype -> the Partial ops whose values stay exact for it (bool has no sum or average;
# float32 sums of x / n are inexact for n = 3, 5, 6, so float32 keeps avg, max, min).
DTYPES: dict[Any, tuple[str, ...]] = {
    np.int8: REDUCE_OPS,
    np.uint8: REDUCE_OPS,
    np.int16: REDUCE_OPS,
    np.int32: REDUCE_OPS,
    np.uint32: REDUCE_OPS,
    np.bool_: ("max", "min"),
    np.float32: ("avg", "max", "min"),
}


@st.composite
def meshes(draw: st.DrawFn, shapes: list[tuple[int, ...]] = MESH_SHAPES, *, mixed: bool = False) -> DeviceMesh:
    """A mesh over a random subset of the 8 devices in random order, with random axis
    types: one type for all axes, or (``mixed``, layouts only: DTensors refuse them) one per axis."""
    shape = draw(st.sampled_from(shapes))
    ranks = draw(st.permutations(range(8)))[: math.prod(shape)]
    types = tuple(draw(st.sampled_from(AXIS_TYPES)) for _ in shape) if mixed else draw(st.sampled_from(AXIS_TYPES))
    return DeviceMesh(np.array(ranks).reshape(shape), NAMES[: len(shape)], axis_types=types)  # type: ignore[arg-type]


@functools.cache
def _layouts(mesh: DeviceMesh, ndim: int, partial_ops: tuple[str, ...]) -> list[Layout]:
    return iter_layouts(mesh, ndim, partial_ops=partial_ops)  # type: ignore[arg-type]


@st.composite
def layouts(
    draw: st.DrawFn, mesh: DeviceMesh | None = None, ndim: int | None = None, ops: tuple[str, ...] = REDUCE_OPS
) -> Layout:
    mesh = mesh if mesh is not None else draw(meshes(mixed=True))
    ndim = ndim if ndim is not None else draw(st.integers(0, 3))
    return draw(st.sampled_from(_layouts(mesh, ndim, ops)))


def shapes(ndim: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.tuples(*(st.integers(0, 9) for _ in range(ndim)))


def _values(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random data covering the dtype's whole range, its extremes included."""
    rng = np.random.default_rng(seed)
    if dtype is np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype is np.float32:
        return rng.integers(-1000, 1001, shape).astype(np.float32)
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if x.size:
        x.flat[0], x.flat[-1] = info.min, info.max
    return x


def _legal(src: Layout, dst: Layout) -> bool:
    """torch's rule: a mesh dim may become Partial(op) only from Replicate or Partial(op)."""
    return all(
        dst_op is None or (src.mesh_dim_split(m) is None and src_op in (None, dst_op))
        for m, (src_op, dst_op) in enumerate(zip(src.partial, dst.partial))
    )


def _assert_holds(dtensor: DTensor, x: np.ndarray, layout: Layout) -> None:
    """The DTensor has the layout, the dtype, every rank's torch block and the full value."""
    assert dtensor.layout == layout and dtensor.shape == x.shape and dtensor.dtype == x.dtype
    full = np.asarray(dtensor.full_tensor())
    assert full.dtype == x.dtype
    np.testing.assert_array_equal(full, x)
    locals_ = {r: np.asarray(dtensor.to_local(r)) for r in layout.mesh.rank_list}
    plain = Layout(layout.mesh, layout.dim_axes)
    for rank, block in locals_.items():
        if layout.has_partial:
            assert block.shape == plain.local_shape(x.shape, rank)
        else:
            np.testing.assert_array_equal(block, x[layout.local_slices(x.shape, rank)])
    # every rank's local tensor rebuilds the same logical tensor
    rebuilt = DTensor.from_local(locals_, layout.mesh, layout, shape=x.shape)
    np.testing.assert_array_equal(np.asarray(rebuilt.full_tensor()), x)


# -- layouts: every form round-trips (no XLA) ------------------------------------------------------------------------


@given(layouts())
def test_layout_text_repr_and_shard_order_round_trips(layout: Layout) -> None:
    mesh = layout.mesh
    partial = {mesh.alias_name[a]: op for a, op in enumerate(layout.partial) if op} or None
    if layout.ndim:
        assert Layout.from_device_mesh(mesh)(format_alias(layout.alias_map), partial=partial) == layout
        assert parse_alias(format_alias(layout.alias_map)) == layout.alias_map
    namespace = {"Layout": Layout, "DeviceMesh": DeviceMesh, "Shard": Shard, "Replicate": Replicate, "Partial": Partial}
    rebuilt = eval(repr(layout), namespace)  # noqa: S307 - the exact repr is the property under test
    assert rebuilt == layout and hash(rebuilt) == hash(layout)
    # torch's DTensorSpec view: repeated Shard(d) plus shard_order says any split order
    placements = tuple(
        Partial(op) if op else Shard(d) if (d := layout.mesh_dim_split(m)) is not None else Replicate()
        for m, op in enumerate(layout.partial)
    )
    assert Layout.from_device_mesh(mesh)(placements, shard_order=dict(layout.shard_order)).bind(layout.ndim) == layout
    torch_form = Layout.from_device_mesh(mesh)(format_placements(placements), shard_order=dict(layout.shard_order))
    assert torch_form.bind(layout.ndim) == layout and torch_form.shard_order == layout.shard_order


@given(layouts())
def test_every_printed_layout_parses_back(layout: Layout) -> None:
    """``str()`` is the one text form: Partial is never dropped, and the text (what tables,
    reprs, plots and the CLI print) parses back to the same layout."""
    text = str(layout)
    assert resolve_layout(layout.mesh, text, layout.ndim) == layout
    assert Layout.from_device_mesh(layout.mesh)(text).bind(layout.ndim) == layout
    assert all(f"={op}" in text or str(Partial(op)) in text for op in layout.partial if op)


@given(layouts())
def test_layout_through_jax_shardings(layout: Layout) -> None:
    mesh = layout.mesh
    assert DeviceMesh.from_jax(mesh.to_jax()) == mesh
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    if layout.jax_expressible:
        sharding = layout.named_sharding
        assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh.to_jax()
        assert Layout.from_partition_spec(DeviceMesh.from_jax(sharding.mesh), sharding.spec, layout.ndim) == layout
    else:
        with pytest.raises(Exception, match="JAX has no sharding"):
            layout.named_sharding  # noqa: B018


@given(layouts(), st.data())
def test_all_local_shapes_give_back_the_global_shape(layout: Layout, data: st.DataObject) -> None:
    shape = data.draw(shapes(layout.ndim))
    local_shapes = layout.all_local_shapes(shape)
    assert layout.global_shape_from_local(local_shapes) == shape
    # each rank's offset + shape stays inside the tensor, and one replica of the blocks tiles it
    for rank, local in local_shapes.items():
        offset = layout.global_offset(shape, rank)
        assert all(0 <= o and o + n <= s for o, n, s in zip(offset, local, shape))


# -- data: chains of redistributions are exact ---------------------------------------------------------------------------


@st.composite
def chains(draw: st.DrawFn) -> tuple[Any, ...]:
    dtype = draw(st.sampled_from(list(DTYPES)))
    ops = DTYPES[dtype]
    mesh = draw(meshes())
    ndim = draw(st.integers(0, 3))
    shape = draw(shapes(ndim))
    steps = draw(st.lists(layouts(mesh, ndim, ops), min_size=2, max_size=3))
    under_jit = draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    other = draw(layouts(draw(meshes()), ndim, ops))
    return dtype, shape, steps, under_jit, other, draw(st.integers(0, 2**32 - 1))


def _move(dtensor: DTensor, target: Layout, jit: bool) -> DTensor | None:
    """``dtensor`` redistributed to ``target`` (checking torch's refusals on one mesh: a
    refused target is replaced by its partial-free version), or None if that is refused too."""
    if target.mesh == dtensor.device_mesh and not _legal(dtensor.layout, target):
        with pytest.raises(RedistributeError):
            dtensor.redistribute(placements=target)
        target = Layout(target.mesh, target.dim_axes)
        if not _legal(dtensor.layout, target):
            return None
    move = lambda d: d.redistribute(target.mesh, target)  # noqa: E731
    moved = jax.jit(move)(dtensor) if jit else move(dtensor)
    assert moved.layout == target
    return moved


@COMPILING
@given(chains())
def test_distribute_redistribute_chains_are_exact(case: tuple[Any, ...]) -> None:
    dtype, shape, steps, under_jit, other, seed = case
    x = _values(dtype, shape, seed)
    dtensor = distribute_tensor(x, steps[0].mesh, steps[0])
    _assert_holds(dtensor, x, steps[0])
    for target, jit in [*zip(steps[1:], under_jit), (other, False)]:
        moved = _move(dtensor, target, jit)
        if moved is not None:
            dtensor = moved
            _assert_holds(dtensor, x, dtensor.layout)


@st.composite
def partial_values(draw: st.DrawFn) -> tuple[Any, ...]:
    dtype = draw(st.sampled_from([np.int8, np.uint8, np.int32, np.uint32]))
    op = draw(st.sampled_from(REDUCE_OPS))
    mesh = draw(meshes([s for s in MESH_SHAPES if math.prod(s) > 1]))
    ndim = draw(st.integers(0, 2))
    layout = draw(layouts(mesh, ndim, (op,)).filter(lambda layout: layout.has_partial))
    return dtype, layout, draw(shapes(ndim)), draw(st.integers(0, 2**32 - 1))


@COMPILING
@given(partial_values())
def test_from_local_partial_values_reduce_like_numpy(case: tuple[Any, ...]) -> None:
    """Random per-rank partial values (full dtype range): the full tensor is their
    reduction over the partial mesh dims, as NumPy computes it (sum wraps in the dtype,
    avg is the exact floor of the mean)."""
    dtype, layout, shape, seed = case
    mesh, op = layout.mesh, layout.partial_op
    plain = Layout(mesh, layout.dim_axes)
    x_shape = shape
    # ranks that differ only along Replicate mesh dims hold the same values (torch's invariant)
    varying = [m for m in range(mesh.ndim) if m in layout.partial_axes or layout.mesh_dim_split(m) is not None]
    values: dict[tuple[int, ...], np.ndarray] = {}
    locals_ = {}
    for rank in mesh.rank_list:
        key = tuple(mesh.get_coordinate(rank)[m] for m in varying)
        if key not in values:
            values[key] = _values(dtype, plain.local_shape(x_shape, rank), seed + len(values))
        locals_[rank] = values[key]
    dtensor = DTensor.from_local(locals_, mesh, layout, shape=x_shape)
    expected = np.zeros(x_shape, dtype)
    # a block's partial holders: the ranks whose coordinates differ only on partial mesh dims
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in mesh.rank_list:
        key = tuple(c for m, c in enumerate(mesh.get_coordinate(rank)) if m not in layout.partial_axes)
        groups.setdefault(key, []).append(rank)
    for ranks in groups.values():
        stack = np.stack([locals_[r] for r in ranks]).astype(np.int64)
        reduced = {
            "sum": stack.sum(axis=0),
            "avg": np.floor_divide(stack.sum(axis=0), len(ranks)),
            "max": stack.max(axis=0),
            "min": stack.min(axis=0),
        }[op]
        expected[plain.local_slices(x_shape, ranks[0])] = reduced.astype(dtype)  # sum wraps like the dtype
    full = np.asarray(dtensor.full_tensor())
    assert full.dtype == dtype
    np.testing.assert_array_equal(full, expected)
    for rank, local in locals_.items():
        np.testing.assert_array_equal(np.asarray(dtensor.to_local(rank)), local)


# -- what these properties found, pinned as plain regression tests -------------------------------------------------------


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_integer_partial_avg_at_the_dtype_extremes(axis_types: str) -> None:
    """Reducing 8 copies summed 8 * 2**31 in int32 before; the mean is now exact."""
    mesh = DeviceMesh(np.arange(8).reshape(2, 4), ("dp", "tp"), axis_types=axis_types)  # type: ignore[arg-type]
    for dtype in (np.int8, np.int32, np.uint32):
        x = _values(dtype, (5, 3), 1)
        dtensor = distribute_tensor(x, mesh, [Partial("avg"), Shard(0)])
        _assert_holds(dtensor.redistribute(placements="R,R"), x, Layout(mesh, ((), ())))


def test_stacked_integer_sums_keep_their_dtype() -> None:
    mesh = DeviceMesh(np.arange(8).reshape(2, 4), ("dp", "tp"), axis_types="auto")
    x = _values(np.int8, (6,), 2)
    for op in ("sum", "avg"):
        moved = distribute_tensor(x, mesh, [Partial(op), Replicate()]).redistribute(placements="S(0),R")
        assert moved.array.dtype == np.int8
        _assert_holds(moved, x, resolve_layout(mesh, "S(0),R", 1))


def test_partial_sum_over_a_size_1_explicit_axis() -> None:
    mesh = DeviceMesh([[3], [5]], ("dp", "tp"))
    x = _values(np.int32, (4, 2), 3)
    dtensor = distribute_tensor(x, mesh, [Shard(0), Partial()])
    assert not dtensor.physical.unreduced_axes and dtensor.physical.stacked_axes == (1,)
    _assert_holds(dtensor, x, resolve_layout(mesh, "S(0),P", 2))
    _assert_holds(dtensor.redistribute(placements="R,R"), x, Layout(mesh, ((), ())))


def test_from_local_of_scalars() -> None:
    mesh = DeviceMesh([6, 1, 4], ("x",))
    dtensor = DTensor.from_local({r: np.int32(r) for r in mesh.rank_list}, mesh, "P")
    assert dtensor.shape == () and int(np.asarray(dtensor.full_tensor())) == 11


def test_empty_tensor_to_a_mesh_on_other_devices() -> None:
    source = DeviceMesh([0, 1], ("dp",))
    x = np.zeros((2, 0), np.int8)
    dtensor = distribute_tensor(x, source, "S(0)").redistribute(DeviceMesh([5], ("dp",)), "R")
    _assert_holds(dtensor, x, Layout(DeviceMesh([5], ("dp",)), ((), ())))
