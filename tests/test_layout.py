"""Layout: torch placements <-> tensor_map <-> alias form <-> PartitionSpec, local blocks, errors."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from placements2jax import (
    ArgumentTypeError,
    DTensor,
    DeviceMesh,
    Layout,
    LayoutError,
    MeshError,
    Partial,
    Placement,
    PlacementError,
    Replicate,
    Shard,
    ShapeError,
    distribute_tensor,
    init_device_mesh,
    resolve_layout,
)
from placements2jax.layout import _plain_tables, _torch_form_to_tables, iter_layouts, split_order_from_factors
from placements2jax.placements import REDUCE_OPS, StridedShard

Block = tuple[tuple[int, int], ...]


@pytest.fixture
def mesh4x2() -> DeviceMesh:
    return DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))


@pytest.fixture
def mesh2x2() -> DeviceMesh:
    return DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))


def _blocks(layout: Layout, shape: Sequence[int]) -> list[Block]:
    """Each rank's block as ((start, stop) per dim), in rank_list order."""
    return [tuple((s.start, s.stop) for s in layout.local_slices(shape, r)) for r in layout.mesh.rank_list]


def _normalize(index: Sequence[slice], shape: Sequence[int]) -> Block:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


# -- the RFC's 8x2 tensor on the 4x2 ("dp", "tp") mesh ---------------------------------------------

ALL = (0, 8)
COLS = (0, 2)

# (placements, tensor_map, partial, alias view, PartitionSpec, rows/cols of ranks 0..7)
RFC_CASES: list[tuple[Any, Any, Any, Any, P, list[Block]]] = [
    (
        (Shard(0), Replicate()),
        (1, -1),
        (None, None),
        ("dp", "None"),
        P("dp", None),
        [((0, 2), COLS), ((0, 2), COLS), ((2, 4), COLS), ((2, 4), COLS),
         ((4, 6), COLS), ((4, 6), COLS), ((6, 8), COLS), ((6, 8), COLS)],
    ),
    (
        (Replicate(), Shard(0)),
        (0, -1),
        (None, None),
        ("tp", "None"),
        P("tp", None),
        [((0, 4), COLS), ((4, 8), COLS)] * 4,
    ),
    (
        (Shard(0), Shard(1)),
        (1, 0),
        (None, None),
        ("dp", "tp"),
        P("dp", "tp"),
        [((0, 2), (0, 1)), ((0, 2), (1, 2)), ((2, 4), (0, 1)), ((2, 4), (1, 2)),
         ((4, 6), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (0, 1)), ((6, 8), (1, 2))],
    ),
    (
        # 2 columns over 4 dp ranks: 1, 1, 0, 0 (torch.chunk; empty blocks start at 2).
        (Shard(1), Shard(0)),
        (0, 1),
        (None, None),
        ("tp", "dp"),
        P("tp", "dp"),
        [((0, 4), (0, 1)), ((4, 8), (0, 1)), ((0, 4), (1, 2)), ((4, 8), (1, 2)),
         ((0, 4), (2, 2)), ((4, 8), (2, 2)), ((0, 4), (2, 2)), ((4, 8), (2, 2))],
    ),
    (
        (Replicate(), Shard(1)),
        (-1, 0),
        (None, None),
        ("None", "tp"),
        P(None, "tp"),
        [(ALL, (0, 1)), (ALL, (1, 2))] * 4,
    ),
    (
        (Replicate(), Replicate()),
        (-1, -1),
        (None, None),
        ("None", "None"),
        P(None, None),
        [(ALL, COLS)] * 8,
    ),
    (
        # alias form: rows split over dp then tp (torch's [Shard(0), Shard(0)]): rank r holds row r
        (("dp", "tp"), None),
        ((1, 0), -1),
        (None, None),
        (("dp", "tp"), "None"),
        P(("dp", "tp"), None),
        [((r, r + 1), COLS) for r in range(8)],
    ),
    (
        # reversed order (torch's _StridedShard): tp major, dp minor; rank (d, t) holds row 4t + d
        (("tp", "dp"), None),
        ((0, 1), -1),
        (None, None),
        (("tp", "dp"), "None"),
        P(("tp", "dp"), None),
        [((0, 1), COLS), ((4, 5), COLS), ((1, 2), COLS), ((5, 6), COLS),
         ((2, 3), COLS), ((6, 7), COLS), ((3, 4), COLS), ((7, 8), COLS)],
    ),
    (
        # Partial(sum) over dp: every rank holds a full-shape partial value of its tp block
        (Partial(), Shard(0)),
        (0, -1),
        ("sum", None),
        ("tp", "None"),
        P("tp", None, unreduced={"dp"}),
        [((0, 4), COLS), ((4, 8), COLS)] * 4,
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("placements", "tensor_map", "partial", "alias", "spec", "blocks"),
    RFC_CASES,
    ids=[str(c[0]) for c in RFC_CASES],
)
def test_rfc_8x2_on_4x2(
    mesh4x2: DeviceMesh, placements: Any, tensor_map: Any, partial: Any, alias: Any, spec: P, blocks: list[Block]
) -> None:
    layout = Layout.from_device_mesh(mesh4x2)(placements).bind(2)
    assert layout.tensor_map == tensor_map
    assert layout.placement_to_tensor_map(2) == tensor_map
    assert layout.partial == partial
    assert layout.alias_map == alias
    assert layout.partition_spec == spec
    assert _blocks(layout, (8, 2)) == blocks


EVEN_RFC_CASES = [c for c in RFC_CASES if c[0] not in ((Shard(1), Shard(0)), (Partial(), Shard(0)))]


@pytest.mark.parametrize("placements", [c[0] for c in EVEN_RFC_CASES], ids=[str(c[0]) for c in EVEN_RFC_CASES])
def test_rfc_8x2_device_put_holds_those_rows(mesh4x2: DeviceMesh, placements: Any) -> None:
    full = np.arange(16, dtype=np.float32).reshape(8, 2)
    layout = Layout.from_device_mesh(mesh4x2)(placements).bind(2)
    array = jax.device_put(full, layout.named_sharding)
    assert len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[layout.local_slices((8, 2), shard.device.id)])


def test_rfc_torch_forms_of_alias_rows(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((("dp", "tp"), None))
    assert layout.placements == (Shard(0), Shard(0))
    # the text form is the one the parser reads back: the alias form, not S(0),S(0)
    assert str(layout) == "(dp,tp),None"
    strided = Layout.from_device_mesh(mesh4x2)((("tp", "dp"), None))
    assert str(strided) == "(tp,dp),None"
    # torch 2.13's encoding of the other order: _StridedShard on dp with tp's size as split factor
    assert strided.placements == (StridedShard(0, split_factor=2), Shard(0))
    assert Layout.from_device_mesh(mesh4x2)(strided.placements).bind(2) is strided
    assert Layout.from_device_mesh(mesh4x2)(layout.placements).bind(2) is layout


# -- the RFC's two sub-mesh examples -------------------------------------------------------------------


def test_rfc_submesh_example_1_shard_form(mesh2x2: DeviceMesh) -> None:
    dp_mesh = mesh2x2["dp"]
    assert dp_mesh.shape == (2,) and dp_mesh.alias_name == ("dp",) and dp_mesh.rank_list == (0, 2)
    recorded = Layout.from_device_mesh(dp_mesh)((Shard(0),))
    assert not recorded.is_bound
    assert recorded.placement_to_tensor_map(2) == (0, -1)
    layout = recorded.bind(2)
    assert layout.alias_map == ("dp", "None")
    assert layout.partition_spec == P("dp", None)
    # rank 0 holds rows 0..3 of 8, rank 2 rows 4..7
    assert layout.local_shape_and_offset((8, 3), rank=0) == ((4, 3), (0, 0))
    assert layout.local_shape_and_offset((8, 3), rank=2) == ((4, 3), (4, 0))
    assert layout.named_sharding.mesh.devices.tolist() == [jax.devices()[0], jax.devices()[2]]
    # rank 1's view of the same code is the other column of the mesh
    other = Layout.from_device_mesh(mesh2x2.submesh("dp", rank=1))((Shard(0),)).bind(2)
    assert other.mesh.rank_list == (1, 3)
    assert other.local_shape_and_offset((8, 3), rank=3) == ((4, 3), (4, 0))


def test_rfc_submesh_example_2_alias_form(mesh2x2: DeviceMesh) -> None:
    dp_mesh = mesh2x2["dp"]
    sharded = Layout.from_device_mesh(dp_mesh)(("dp",))
    assert sharded.is_bound  # the alias form needs no placement_to_tensor_map conversion
    assert sharded.tensor_map == (0,)
    assert sharded == Layout.from_device_mesh(dp_mesh)((Shard(0),)).bind(1)
    replicated = Layout.from_device_mesh(dp_mesh)(("None",))
    assert replicated.tensor_map == (-1,)
    assert replicated.placements == (Replicate(),)
    assert replicated == Layout.from_device_mesh(dp_mesh)((None,))
    assert Layout.from_device_mesh(dp_mesh)(("dp", "None")) == Layout.from_device_mesh(dp_mesh)((Shard(0),)).bind(2)


# -- MindSpore's four tensor_map cases (notes section 2) ------------------------------------------------------


def test_mindspore_case_1() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    assert Layout.from_device_mesh(mesh)((Shard(0), Shard(1))).placement_to_tensor_map(2) == (1, 0)


def test_mindspore_case_2() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "mp"))
    assert Layout.from_device_mesh(mesh)((Shard(1), Shard(0))).placement_to_tensor_map(2) == (0, 1)


def test_mindspore_case_3() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "mp"))
    assert Layout.from_device_mesh(mesh)((Shard(0), Replicate())).placement_to_tensor_map(3) == (1, -1, -1)


def test_mindspore_case_4() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "mp"))
    layout = Layout.from_device_mesh(mesh)((Partial("sum"), Shard(0)))
    assert layout.placement_to_tensor_map(2) == (0, -1)
    assert layout.partial == ("sum", None)
    assert layout.bind(2).partial == ("sum", None)


# -- views, value semantics, properties -------------------------------------------------------------------------


def test_alias_view_and_repr(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((Partial("max"), Shard(1))).bind(3)
    assert layout.alias_map == ("None", "tp", "None")
    assert layout.tensor_map == (-1, 0, -1)
    assert layout.partial == ("max", None)
    assert (
        repr(layout)
        == "Layout.from_device_mesh(DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], mesh_dim_names=('dp', 'tp')))"
        "(('None', 'tp', 'None'), partial={'dp': 'max'})"
    )
    assert str(layout) == "P(max),S(1)"
    unbound = Layout.from_device_mesh(mesh4x2)((Shard(0), Replicate()))
    assert repr(unbound).endswith("((Shard(dim=0), Replicate()))")
    assert repr(Layout.from_device_mesh(mesh4x2)).endswith("(())")


def test_forms_agree_and_compare_by_value(mesh4x2: DeviceMesh) -> None:
    torch_form = Layout.from_device_mesh(mesh4x2)((Shard(1), Partial())).bind(2)
    alias_form = Layout.from_device_mesh(mesh4x2)((None, "dp"), partial={"tp": "sum"})
    text_form = Layout.from_device_mesh(mesh4x2)("S(1),P").bind(2)
    from_map = Layout.from_tensor_map(mesh4x2, (-1, 1), (None, "sum"))
    from_spec = Layout.from_partition_spec(mesh4x2, P(None, "dp", unreduced={"tp"}))
    assert torch_form == alias_form == text_form == from_map == from_spec
    assert len({torch_form, alias_form, text_form, from_map, from_spec}) == 1
    assert torch_form != Layout.from_device_mesh(mesh4x2)((Shard(1), Partial("avg"))).bind(2)
    assert torch_form != Layout.from_device_mesh(init_device_mesh((4, 2), ("dp", "sp")))((Shard(1), Partial())).bind(2)


def test_unbound_and_bound_layouts(mesh4x2: DeviceMesh) -> None:
    unbound = Layout.from_device_mesh(mesh4x2)((Shard(-1), Replicate()))
    assert not unbound.is_bound
    assert unbound.placements == (Shard(-1), Replicate())
    assert unbound != unbound.bind(2)
    assert unbound == Layout.from_device_mesh(mesh4x2)((Shard(-1), Replicate()))
    bound = unbound.bind(2)
    assert bound.is_bound and bound.ndim == 2
    assert bound.placements == (Shard(1), Replicate())  # normalized
    assert bound.bind(2) is bound
    assert unbound.bind(3).tensor_map == (-1, -1, 1)


def test_layout_is_immutable(mesh4x2: DeviceMesh) -> None:
    empty = Layout.from_device_mesh(mesh4x2)
    recorded = empty((Shard(0), Replicate()))
    assert recorded is not empty and empty.placements == ()
    bound = recorded.bind(2)
    with pytest.raises(AttributeError):
        bound.tensor_map = (0, -1)  # type: ignore[misc]


def test_layout_properties(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(init_device_mesh((2, 2, 2), ("pp", "dp", "tp")))(
        (("tp", "pp"), None, None), partial={"dp": "avg"}
    )
    assert layout.dim_axes == ((2, 0), (), ())
    assert layout.tensor_map == ((0, 2), -1, -1)
    assert layout.pieces(0) == (2, 2) and layout.pieces(1) == ()
    assert [layout.mesh_dim_split(a) for a in range(3)] == [0, None, 0]
    assert layout.partial_axes == (1,) and layout.partial_op == "avg" and layout.has_partial
    assert layout.mesh is layout.device_mesh
    plain = Layout.from_device_mesh(mesh4x2)(("dp", None))
    assert plain.partial_op is None and not plain.has_partial and plain.partial_axes == ()


def test_iter_layouts_counts(mesh4x2: DeviceMesh) -> None:
    # per mesh axis: unused, dim 0, dim 1 (+ Partial); both axes on one dim come in two orders
    assert len(iter_layouts(mesh4x2, 2)) == 11
    assert len(iter_layouts(mesh4x2, 2, partial_ops=("sum",))) == 18
    assert len(iter_layouts(mesh4x2, 2, partial_ops=("sum", "max"))) == 25
    assert len(iter_layouts(mesh4x2, 1)) == 5
    assert len(set(iter_layouts(init_device_mesh((2, 2, 2)), 3, partial_ops=REDUCE_OPS))) == len(
        iter_layouts(init_device_mesh((2, 2, 2)), 3, partial_ops=REDUCE_OPS)
    )


# -- PartitionSpec and NamedSharding --------------------------------------------------------------------------------


def test_partition_spec_entries(mesh4x2: DeviceMesh) -> None:
    from_device_mesh = Layout.from_device_mesh(mesh4x2)
    assert from_device_mesh((("dp", "tp"), None, "None")).partition_spec == P(("dp", "tp"), None, None)
    assert from_device_mesh((None, ("tp", "dp"))).partition_spec == P(None, ("tp", "dp"))
    assert from_device_mesh((Partial(), Partial())).bind(1).partition_spec == P(None, unreduced={"dp", "tp"})
    # only sum has a JAX form: avg/max/min partial axes do not appear in the spec
    for op in ("avg", "max", "min"):
        assert from_device_mesh((Partial(op), Shard(0))).bind(1).partition_spec == P("tp")  # type: ignore[arg-type]
    assert from_device_mesh(()).partition_spec == P()


def test_named_sharding(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((Partial(), Shard(1))).bind(2)
    sharding = layout.named_sharding
    assert isinstance(sharding, NamedSharding)
    assert sharding.mesh is mesh4x2.to_jax()
    assert sharding.spec == P(None, "tp", unreduced={"dp"})
    assert layout.named_sharding is sharding  # cached
    assert layout.jax_expressible


def test_named_sharding_refuses_what_jax_cannot_say(mesh4x2: DeviceMesh) -> None:
    for op in ("avg", "max", "min"):
        layout = Layout.from_device_mesh(mesh4x2)((Partial(op), Replicate())).bind(1)  # type: ignore[arg-type]
        assert not layout.jax_expressible
        with pytest.raises(
            LayoutError,
            match=rf"JAX has no sharding for Partial\({op}\) on any mesh axes\. Fix: use a DTensor, which carries it, "
            r"or reduce it first \(redistribute to Replicate\)",
        ):
            layout.named_sharding  # noqa: B018


def test_auto_mesh_named_sharding() -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"), axis_types="auto")
    plain = Layout.from_device_mesh(mesh)((Shard(0), Shard(1))).bind(2)
    assert plain.named_sharding.spec == P("dp", "tp")
    assert plain.named_sharding.mesh is mesh.to_jax()
    partial = Layout.from_device_mesh(mesh)((Partial(), Replicate())).bind(1)
    assert not partial.jax_expressible
    with pytest.raises(LayoutError, match=r"JAX has no sharding for Partial\(sum\) on auto mesh axes"):
        partial.named_sharding  # noqa: B018


# -- reverse conversions ----------------------------------------------------------------------------------------------


def test_from_partition_spec(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_partition_spec(mesh4x2, P(("dp", "tp"), None))
    assert layout.tensor_map == ((1, 0), -1) and layout.placements == (Shard(0), Shard(0))
    partial = Layout.from_partition_spec(mesh4x2, P("tp", None, unreduced={"dp"}))
    assert partial.placements == (Partial("sum"), Shard(0))
    assert partial.partial == ("sum", None)
    assert Layout.from_partition_spec(mesh4x2, P("tp"), ndim=3).tensor_map == (0, -1, -1)
    assert Layout.from_partition_spec(mesh4x2, P()).ndim == 0


def test_from_tensor_map(mesh4x2: DeviceMesh) -> None:
    assert Layout.from_tensor_map(mesh4x2, (1, 0)).placements == (Shard(0), Shard(1))
    assert Layout.from_tensor_map(mesh4x2, (0, 1)).placements == (Shard(1), Shard(0))
    assert Layout.from_tensor_map(mesh4x2, (1, -1, -1)).placements == (Shard(0), Replicate())
    assert Layout.from_tensor_map(mesh4x2, (0, -1), ("sum", None)).placements == (Partial(), Shard(0))
    assert Layout.from_tensor_map(mesh4x2, ((1, 0),)).alias_map == (("dp", "tp"),)
    assert Layout.from_tensor_map(mesh4x2, [[0, 1], -1]).alias_map == (("tp", "dp"), "None")
    assert Layout.from_tensor_map(mesh4x2, (-1,), {"tp": "max"}).placements == (Replicate(), Partial("max"))


NAMES = ("dp", "tp", "sp")


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered k-tuple of positive ints whose product is n."""
    if k == 1:
        return [(n,)]
    return [(f, *rest) for f in range(1, n + 1) if n % f == 0 for rest in _factorizations(n // f, k - 1)]


ALL_MESH_SHAPES = [shape for n in range(1, 9) for k in (1, 2, 3) for shape in _factorizations(n, k)]


def test_mesh_shape_enumeration() -> None:
    assert len(ALL_MESH_SHAPES) == 66
    assert _factorizations(8, 3).count((2, 2, 2)) == 1 and len(_factorizations(8, 3)) == 10
    assert _factorizations(6, 2) == [(1, 6), (2, 3), (3, 2), (6, 1)]


@functools.lru_cache(maxsize=None)
def _cached_layouts(mesh: DeviceMesh, ndim: int) -> list[Layout]:
    return iter_layouts(mesh, ndim, partial_ops=REDUCE_OPS)


@st.composite
def meshes(draw: st.DrawFn) -> DeviceMesh:
    shape = draw(st.sampled_from(ALL_MESH_SHAPES))
    size = int(np.prod(shape))
    ranks = draw(st.permutations(range(8)))[:size]
    axis_types = draw(st.sampled_from(["explicit", "auto"]))
    return DeviceMesh(np.array(ranks).reshape(shape), NAMES[: len(shape)], axis_types=axis_types)  # type: ignore[arg-type]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    mesh = draw(meshes())
    ndim = draw(st.integers(1, 3))
    return draw(st.sampled_from(_cached_layouts(mesh, ndim)))


@given(layouts())
def test_round_trips(layout: Layout) -> None:
    mesh = layout.mesh
    partial = {mesh.alias_name[a]: op for a, op in enumerate(layout.partial) if op}
    # tensor_map (+ partial side table) -> layout
    assert Layout.from_tensor_map(mesh, layout.tensor_map, layout.partial) == layout
    # alias view -> layout
    assert Layout.from_device_mesh(mesh)(layout.alias_map, partial=partial or None) == layout
    # PartitionSpec -> layout: exact when the only partial op is sum (JAX has no other)
    from_spec = Layout.from_partition_spec(mesh, layout.partition_spec, ndim=layout.ndim)
    if layout.partial_op in (None, "sum"):
        assert from_spec == layout
    else:
        assert from_spec == Layout(mesh, layout.dim_axes)
    # torch placements -> layout, for every layout: repeated Shard(d) for a dim split in mesh
    # order, StridedShard (torch's _StridedShard) for other orders. Torch cannot say where a
    # size-1 mesh dim stands in a split order, so those come back in mesh order (same blocks).
    back = Layout.from_device_mesh(mesh)(layout.placements).bind(layout.ndim)
    assert back.placements == layout.placements and back.partial == layout.partial
    real = [tuple(m for m in axes if mesh.shape[m] > 1) for axes in layout.dim_axes]
    assert [tuple(m for m in axes if mesh.shape[m] > 1) for axes in back.dim_axes] == real
    if all(mesh.shape[m] > 1 for axes in layout.dim_axes for m in axes):
        assert back is layout
    if all(len(axes) <= 1 for axes in layout.dim_axes):
        assert Layout.from_device_mesh(mesh)(str(layout)).bind(layout.ndim) == layout


# -- the exhaustive check against JAX --------------------------------------------------------------------------------------


def _torch_forms(mesh: DeviceMesh, ndim: int) -> Iterator[tuple[Placement, ...]]:
    choices: list[Placement] = [Replicate(), Partial(), *(Shard(d) for d in range(-ndim, ndim))]
    return itertools.product(choices, repeat=mesh.ndim)


@pytest.mark.parametrize("mesh_shape", ALL_MESH_SHAPES, ids=["x".join(map(str, s)) for s in ALL_MESH_SHAPES])
def test_partition_spec_places_the_torch_blocks(mesh_shape: tuple[int, ...]) -> None:
    """For every layout on this mesh and 1-3 dim tensors of even shape, JAX's
    NamedSharding puts on each device exactly the block torch's rules give that rank."""
    size = int(np.prod(mesh_shape))
    mesh = DeviceMesh(np.arange(size).reshape(mesh_shape), NAMES[: len(mesh_shape)])
    jax_mesh = mesh.to_jax()
    devices = jax.devices()
    for ndim in (1, 2, 3):
        shape = tuple(size * (d + 2) for d in range(ndim))  # even under every layout
        layouts_ = iter_layouts(mesh, ndim, partial_ops=("sum",))
        assert len(set(layouts_)) == len(layouts_)
        for layout in layouts_:
            assert layout.is_even(shape) and layout.physical_shape(shape) == shape
            spec = layout.partition_spec
            # devices_indices_map refuses unreduced specs; partial ranks hold the full block anyway
            sharding = NamedSharding(jax_mesh, P(*spec.partitions))
            placed = {d: _normalize(idx, shape) for d, idx in sharding.devices_indices_map(shape).items()}
            expected = {devices[r]: _normalize(layout.local_slices(shape, r), shape) for r in mesh.rank_list}
            assert placed == expected, (layout, spec)
            for d, n in enumerate(shape):
                assert {b[d][1] - b[d][0] for b in expected.values()} == {n // int(np.prod(layout.pieces(d)))}
            if layout.has_partial:
                assert layout.named_sharding.spec == spec and spec.unreduced
        # torch form (Shard / Replicate / Partial, as torch): exactly the layouts that split
        # each tensor dim in mesh order (a repeated Shard(d) splits in mesh order); negative
        # dims are normalized first, as torch does (S(-1) and S(1) are a repeated S(1))
        in_order = {layout for layout in layouts_ if all(list(axes) == sorted(axes) for axes in layout.dim_axes)}
        from_torch = set()
        for placements in _torch_forms(mesh, ndim):
            layout = Layout.from_device_mesh(mesh)(placements).bind(ndim)
            normalized = tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)
            assert layout is Layout.from_device_mesh(mesh)(normalized).bind(ndim)
            from_torch.add(layout)
        assert from_torch == in_order
        # every layout's placements (StridedShard for other orders) give its blocks back
        for layout in layouts_:
            back = Layout.from_device_mesh(mesh)(layout.placements).bind(ndim)
            assert all(back.local_slices(shape, r) == layout.local_slices(shape, r) for r in mesh.rank_list)


# -- uneven local shapes and offsets ---------------------------------------------------------------------------------------


def test_uneven_10_rows_over_4() -> None:
    layout = Layout.from_device_mesh(init_device_mesh((4,), ("x",)))((Shard(0),)).bind(1)
    assert layout.all_local_shapes((10,)) == {0: (3,), 1: (3,), 2: (3,), 3: (1,)}
    assert [layout.global_offset((10,), r) for r in range(4)] == [(0,), (3,), (6,), (9,)]
    assert not layout.is_even((10,)) and layout.physical_shape((10,)) == (12,)
    assert layout.global_shape_from_local(layout.all_local_shapes((10,))) == (10,)


def test_uneven_5_rows_over_4_has_an_empty_rank() -> None:
    layout = Layout.from_device_mesh(init_device_mesh((4,), ("x",)))(("x",))
    assert [layout.local_shape_and_offset((5,), r) for r in range(4)] == [
        ((2,), (0,)), ((2,), (2,)), ((1,), (4,)), ((0,), (5,)),
    ]  # fmt: skip
    assert layout.local_slices((5,), 3) == (slice(5, 5),)


def test_uneven_10_rows_over_dp_tp_alias_form(mesh2x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh2x2)((("dp", "tp"),))
    shapes_offsets = [layout.local_shape_and_offset((10,), r) for r in range(4)]
    assert shapes_offsets == [((3,), (0,)), ((2,), (3,)), ((3,), (5,)), ((2,), (8,))]
    # the same as torch's [Shard(0), Shard(0)], which the torch form cannot state here
    assert layout.placements == (Shard(0), Shard(0))
    # a flat 4-way split would be 3,3,3,1
    flat = Layout.from_device_mesh(mesh2x2.flatten())((Shard(0),)).bind(1)
    assert [flat.local_shape((10,), r) for r in range(4)] == [(3,), (3,), (3,), (1,)]
    assert layout.physical_shape((10,)) == (12,)
    assert layout.global_shape_from_local(layout.all_local_shapes((10,))) == (10,)


def test_uneven_two_dims(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((Shard(0), Shard(1))).bind(2)
    assert layout.all_local_shapes((10, 3)) == {
        0: (3, 2), 1: (3, 1), 2: (3, 2), 3: (3, 1), 4: (3, 2), 5: (3, 1), 6: (1, 2), 7: (1, 1),
    }  # fmt: skip
    assert [layout.global_offset((10, 3), r) for r in range(8)] == [
        (0, 0), (0, 2), (3, 0), (3, 2), (6, 0), (6, 2), (9, 0), (9, 2),
    ]  # fmt: skip
    assert layout.physical_shape((10, 3)) == (12, 4)


def test_local_shape_of_the_calling_rank(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((Shard(0), Replicate())).bind(2)
    assert layout.local_shape((10, 3)) == (3, 3)
    assert layout.global_offset((10, 3)) == (0, 0)


@given(layouts(), st.data())
def test_blocks_tile_the_tensor(layout: Layout, data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 11), min_size=layout.ndim, max_size=layout.ndim)))
    counts = np.zeros(shape, dtype=np.int64)
    for rank in layout.mesh.rank_list:
        counts[layout.local_slices(shape, rank)] += 1
    # each element is held once per rank combination of the mesh axes that do not split it
    unused = [n for a, n in enumerate(layout.mesh.shape) if layout.mesh_dim_split(a) is None]
    assert (counts == int(np.prod(unused))).all()
    assert layout.global_shape_from_local(layout.all_local_shapes(shape)) == shape


# -- errors ---------------------------------------------------------------------------------------------------------------------

MESH = DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
MESH3 = init_device_mesh((2, 2, 2), ("pp", "dp", "tp"))
AUTO = init_device_mesh((4, 2), ("dp", "tp"), axis_types="auto")
L = Layout.from_device_mesh(MESH)

LAYOUT_ERRORS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "torch form: the same dim written two ways, each with its own split order",
        lambda: L((Shard(-1), Shard(1)), shard_order={-1: (0,), 1: (1,)}).bind(2),
        PlacementError,
        r"Shard\(1\) and Shard\(-1\) are the same dim of a 2-d tensor, which the split order \(shard_order=, or "
        r"StridedShard split factors\) names apart\. Fix: write every Shard dim one way \(all non-negative\)",
    ),
    (
        "torch form: a split factor no order gives",
        lambda: L((StridedShard(0, split_factor=3), Shard(0))).bind(2),
        PlacementError,
        r"split factor 3 is no product of the sizes of the mesh dims splitting tensor dim 0 after it",
    ),
    (
        "alias form: one axis on two dims",
        lambda: L(("dp", "dp")),
        LayoutError,
        r"mesh axis 'dp' splits tensor dims 0 and 1; one axis can split one dim only\. Fix: use 'dp' on a single tensor dim",
    ),
    (
        "alias form: one axis in a tuple and alone",
        lambda: L((("dp", "tp"), "tp")),
        LayoutError,
        r"mesh axis 'tp' splits tensor dims 0 and 1; one axis can split one dim only",
    ),
    (
        "alias form: one axis twice in a tuple",
        lambda: L((("dp", "dp"), None)),
        LayoutError,
        r"mesh axis 'dp' splits tensor dims 0 and 0",
    ),
    (
        "alias form: unknown name",
        lambda: L(("pp", None)),
        LayoutError,
        r"placements=\('pp', None\): unknown mesh axis 'pp'\. Fix: use names from \('dp', 'tp'\) or 'None'",
    ),
    (
        "alias form: unknown name in a tuple",
        lambda: L((("dp", "sp"),)),
        LayoutError,
        r"unknown mesh axis 'sp'",
    ),
    (
        "PartitionSpec: unknown name",
        lambda: Layout.from_partition_spec(MESH, P("pp")),
        LayoutError,
        r"unknown mesh axis 'pp'\. Fix: use names from \('dp', 'tp'\)",
    ),
    (
        "partial: unknown axis name",
        lambda: L(("dp", None), partial={"pp": "sum"}),
        MeshError,
        r"axis='pp': no such mesh axis; the axes are \('dp', 'tp'\)",
    ),
    (
        "Shard dim too large",
        lambda: L((Shard(2), Replicate())).bind(2),
        PlacementError,
        r"placements=\(Shard\(dim=2\), Replicate\(\)\): Shard\(dim=2\) is out of range for a 2-d tensor\. "
        r"Fix: use a Shard dim in \[-2, 2\)",
    ),
    (
        "Shard dim too negative",
        lambda: L((Replicate(), Shard(-3))).placement_to_tensor_map(2),
        PlacementError,
        r"Shard\(dim=-3\) is out of range for a 2-d tensor\. Fix: use a Shard dim in \[-2, 2\)",
    ),
    (
        "too few placements",
        lambda: L((Shard(0),)),
        PlacementError,
        r"placements=\(Shard\(dim=0\),\): 1 placements for a 2-d mesh \('dp', 'tp'\)\. "
        r"Fix: give exactly one placement per mesh dim \(2\)",
    ),
    (
        "too many placements",
        lambda: L("S(0),R,R"),
        PlacementError,
        r"3 placements for a 2-d mesh \('dp', 'tp'\)\. Fix: give exactly one placement per mesh dim \(2\)",
    ),
    (
        "alias form longer than the tensor rank",
        lambda: L(("dp", None, None)).bind(2),
        LayoutError,
        r"placements=\('dp', 'None', 'None'\): the alias form has 3 entries but the tensor has 2 dims\. "
        r"Fix: give at most one entry per tensor dim \(2\)",
    ),
    (
        "mixed Partial reduce ops (torch form)",
        lambda: L((Partial("sum"), Partial("max"))),
        PlacementError,
        r"mixes Partial reduce ops \['max', 'sum'\]; a tensor is the reduction of its partials with one op\. "
        r"Fix: reduce all but one kind first",
    ),
    (
        "mixed Partial reduce ops (alias form)",
        lambda: L((None,), partial={"dp": "avg", "tp": "min"}),
        PlacementError,
        r"partial=\{'dp': 'avg', 'tp': 'min'\}: mixes Partial reduce ops \['avg', 'min'\]",
    ),
    (
        "mixed Partial reduce ops (tensor_map)",
        lambda: Layout.from_tensor_map(MESH, (-1,), ("sum", "max")),
        PlacementError,
        r"mixes Partial reduce ops \['max', 'sum'\]",
    ),
    (
        "partial on an axis that also shards (alias form)",
        lambda: L(("dp", None), partial={"dp": "sum"}),
        LayoutError,
        r"partial=\('sum', None\): mesh axis 'dp' both splits tensor dim 0 and is Partial\(sum\)\. "
        r"Fix: a mesh dim is either Shard, Replicate or Partial",
    ),
    (
        "partial on an axis that also shards (tensor_map)",
        lambda: Layout.from_tensor_map(MESH, (-1, 0), (None, "max")),
        LayoutError,
        r"mesh axis 'tp' both splits tensor dim 1 and is Partial\(max\)",
    ),
    (
        "unknown reduce op in the partial table",
        lambda: L((None,), partial={"tp": "prod"}),
        PlacementError,
        r"partial=\{'tp': 'prod'\}: unknown reduce op 'prod'\. Fix: use one of \('sum', 'avg', 'max', 'min'\)",
    ),
    (
        "partial table of the wrong length",
        lambda: L((None,), partial=("sum",)),
        ArgumentTypeError,
        r"partial=\('sum',\): expected a mapping axis -> reduce op or one entry per mesh dim \(2\)",
    ),
    (
        "partial= with torch-form placements",
        lambda: L((Shard(0), Replicate()), partial={"tp": "sum"}),
        PlacementError,
        r"partial=\{'tp': 'sum'\}: the torch form states partials itself\. Fix: use Partial\(op\) in the placements",
    ),
    (
        "tensor_map entry too large",
        lambda: Layout.from_tensor_map(MESH, (2, -1)),
        LayoutError,
        r"tensor_map=\(2, -1\): entry 2 is not -1 or a mesh axis counted from the right \(0\.\.1\)\. "
        r"Fix: use -1 for an unsplit dim, k for mesh axis ndim-1-k",
    ),
    (
        "tensor_map entry too negative",
        lambda: Layout.from_tensor_map(MESH, (-2,)),
        LayoutError,
        r"tensor_map=\(-2,\): entry -2 is not -1 or a mesh axis",
    ),
    (
        "tensor_map entry a name",
        lambda: Layout.from_tensor_map(MESH, ("dp", 1)),
        LayoutError,
        r"tensor_map=\('dp', 1\): entry 'dp' is not -1 or a mesh axis",
    ),
    (
        "tensor_map entry a bool",
        lambda: Layout.from_tensor_map(MESH, (True, -1)),
        LayoutError,
        r"tensor_map=\(True, -1\): entry True is not -1",
    ),
    (
        "tensor_map: -1 inside a tuple",
        lambda: Layout.from_tensor_map(MESH, ((1, -1), -1)),
        LayoutError,
        r"tensor_map=\(\(1, -1\), -1\): -1 inside a tuple\. Fix: use -1 alone for an unsplit dim",
    ),
    (
        "tensor_map: one axis on two dims",
        lambda: Layout.from_tensor_map(MESH, (1, 1)),
        LayoutError,
        r"mesh axis 'dp' splits tensor dims 0 and 1",
    ),
    (
        "tensor_map not a tuple",
        lambda: Layout.from_tensor_map(MESH, "1,0"),
        ArgumentTypeError,
        r"tensor_map='1,0': expected a tuple\. Fix: pass e\.g\. \(1, -1\)",
    ),
    (
        "forms mixed",
        lambda: L((Shard(0), "dp")),
        ArgumentTypeError,
        r"'dp' mixes the alias form into torch-form placements\. Fix: use one form",
    ),
    (
        "alias entry of the wrong type",
        lambda: L((3, None)),
        ArgumentTypeError,
        r"alias entry 3 is not an axis name, a tuple of names or None\. Fix: use names from \('dp', 'tp'\)",
    ),
    (
        "empty tuple alias entry",
        lambda: L(((), None)),
        ArgumentTypeError,
        r"alias entry \(\) is not an axis name",
    ),
    (
        "placements not a sequence",
        lambda: L(Shard(0)),
        ArgumentTypeError,
        r"placements=Shard\(dim=0\): expected a sequence of placements or alias entries",
    ),
    (
        "bad short text",
        lambda: L("S(0),X"),
        PlacementError,
        r"placement='X': not a placement in short form",
    ),
    (
        "unbound layout asked for its tensor_map",
        lambda: L((Shard(0), Replicate())).tensor_map,
        LayoutError,
        r"torch-form placements do not say how many dims the tensor has, so they have no tensor_map\. "
        r"Fix: call layout\.bind\(ndim\) \(or placement_to_tensor_map\(ndim\)\) first",
    ),
    (
        "bind to a negative ndim",
        lambda: L((Shard(0), Replicate())).bind(-1),
        ArgumentTypeError,
        r"ndim=-1: expected a non-negative int",
    ),
    (
        "layout on a non-mesh",
        lambda: Layout.from_device_mesh([[0, 1], [2, 3]]),
        ArgumentTypeError,
        r"device_mesh=.*expected a placements2jax\.DeviceMesh\. Fix: build one with init_device_mesh",
    ),
    (
        "layout of another mesh",
        lambda: Layout.from_device_mesh(AUTO)(L(("dp", None))),
        LayoutError,
        r"this layout is on another mesh\. Fix: rebuild it on the target mesh",
    ),
    (
        "from_partition_spec of a tuple",
        lambda: Layout.from_partition_spec(MESH, ("dp",)),
        ArgumentTypeError,
        r"spec=\('dp',\): expected a jax\.sharding\.PartitionSpec",
    ),
    (
        "from_partition_spec with a short ndim",
        lambda: Layout.from_partition_spec(MESH, P("tp", "dp"), ndim=1),
        LayoutError,
        r"ndim=1: shorter than the spec P\('tp', 'dp'\)\. Fix: pass ndim >= 2",
    ),
    (
        "global shape of the wrong rank",
        lambda: L(("dp", None)).local_shape((8,)),
        ShapeError,
        r"global_shape=\(8,\): 1 dims, but the layout is for 2 dims\. Fix: pass a matching shape",
    ),
    (
        "negative extent",
        lambda: L(("dp", None)).local_shape((8, -1)),
        ShapeError,
        r"global_shape=\(8, -1\): -1 is not a non-negative int",
    ),
    (
        "rank outside the mesh",
        lambda: L(("dp", None)).local_shape((8, 2), rank=8),
        MeshError,
        r"rank=8: not a rank of this mesh",
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "message"), LAYOUT_ERRORS, ids=[e[0] for e in LAYOUT_ERRORS])
def test_errors(case: str, call: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_torch_form_repeated_shard_as_text_is_torchs() -> None:
    """A repeated Shard(d), as text or values, splits d in mesh order (torch's meaning);
    negative dims count from the end once the rank is known, as torch normalizes them."""
    assert L("S(1),S(1)") == L((Shard(1), Shard(1)))
    assert L("S(1),S(1)").bind(2).alias_map == ("None", ("dp", "tp"))
    assert L("S(-1),S(-1)").bind(2).alias_map == ("None", ("dp", "tp"))
    # S(-1) and S(1) are different dims of a 3-d tensor, the same dim of a 2-d one.
    assert L((Shard(-1), Shard(1))).bind(3).tensor_map == (-1, 0, 1)
    assert L("S(-1),S(1)").bind(2) is L("S(1),S(1)").bind(2)
    assert Layout.from_device_mesh(MESH3)("R,S(-2),S(-2)").bind(2).alias_map == (("dp", "tp"), "None")
    assert Layout.from_device_mesh(MESH3)("S(1),R,S(1)").bind(3).alias_map == ("None", ("pp", "tp"), "None")


# -- torch's shard order (repeated Shard, split order), strings in either form -----------------


def test_shard_order_call_repeated_shard_in_mesh_order(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((Shard(0), Shard(0)), shard_order={})
    assert not layout.is_bound
    assert layout.shard_order == ((0, (0, 1)),)
    assert layout.placements == (Shard(0), Shard(0))
    bound = layout.bind(2)
    assert bound.alias_map == (("dp", "tp"), "None")
    assert bound.shard_order == ((0, (0, 1)),)
    assert bound == Layout.from_device_mesh(mesh4x2)([("dp", "tp"), None])
    # torch's nested rule: 10 rows -> 3,3,3,1 over dp, then each over tp.
    assert [bound.local_shape((10, 2), r)[0] for r in mesh4x2.rank_list] == [2, 1, 2, 1, 2, 1, 1, 0]


def test_shard_order_call_other_order(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((Shard(-1), Shard(-1)), shard_order={-1: ("tp", "dp")})
    assert layout.shard_order == ((-1, (1, 0)),)
    assert layout.bind(3).alias_map == ("None", "None", ("tp", "dp"))
    assert eval(repr(layout)) == layout  # noqa: S307
    assert layout.placements == (StridedShard(-1, split_factor=2), Shard(-1))  # torch's _StridedShard encoding
    assert L(layout.placements).bind(3) is layout.bind(3)
    assert layout != Layout.from_device_mesh(mesh4x2)((Shard(-1), Shard(-1)), shard_order={})


def test_shard_order_call_equals_plain_torch_form(mesh4x2: DeviceMesh) -> None:
    plain = Layout.from_device_mesh(mesh4x2)((Shard(1), Partial()))
    assert Layout.from_device_mesh(mesh4x2)((Shard(1), Partial()), shard_order={}) == plain
    assert hash(Layout.from_device_mesh(mesh4x2)((Shard(1), Partial()), shard_order={})) == hash(plain)
    assert plain.shard_order == ((1, (0,)),)


def test_shard_order_call_errors(mesh4x2: DeviceMesh) -> None:
    with pytest.raises(PlacementError, match="sharded by mesh dims \\[0, 1\\] in the placements, not \\[1\\]"):
        Layout.from_device_mesh(mesh4x2)((Shard(0), Shard(0)), shard_order={0: (1,)})
    with pytest.raises(PlacementError, match="Shard\\(1\\) and Shard\\(-1\\) are the same dim"):
        Layout.from_device_mesh(mesh4x2)((Shard(1), Shard(-1)), shard_order={}).bind(2)
    with pytest.raises(ArgumentTypeError, match="shard_order"):
        Layout.from_device_mesh(mesh4x2)((Shard(0), Shard(0)), shard_order=[(0, (1, 0))])  # type: ignore[arg-type]


def test_every_route_ends_in_the_same_interned_layout(mesh4x2: DeviceMesh) -> None:
    """The resolver, the RFC's call, the MindSpore / JAX tables and the constructor give the
    same object (docs/architecture.md, "Building a Layout")."""
    layout = Layout(mesh4x2, ((0,), (1,)), (None, None))
    assert resolve_layout(mesh4x2, "S(0),S(1)", 2) is layout
    assert resolve_layout(mesh4x2, [Shard(0), Shard(1)], (8, 4)) is layout
    assert Layout.from_device_mesh(mesh4x2)("S(0),S(1)").bind(2) is layout
    assert Layout.from_device_mesh(mesh4x2)(("dp", "tp")) is layout
    assert Layout.from_tensor_map(mesh4x2, (1, 0)) is layout
    assert Layout.from_partition_spec(mesh4x2, P("dp", "tp")) is layout
    assert Layout.from_device_mesh(mesh4x2)("S(0),S(1)").placement_to_tensor_map(2) == (1, 0)
    assert layout.replicated() is Layout(mesh4x2, ((), ())) is resolve_layout(mesh4x2, "R,R", 2)


def test_resolve_layout_takes_torch_shard_order(mesh4x2: DeviceMesh) -> None:
    split = resolve_layout(mesh4x2, "S(0),S(0)", 2, shard_order={0: ("tp", "dp")})
    assert split is Layout.from_device_mesh(mesh4x2)([("tp", "dp"), None])
    assert resolve_layout(mesh4x2, "S(0),S(0)", 2, shard_order={}).alias_map == (("dp", "tp"), "None")
    assert resolve_layout(mesh4x2, "S(0),S(0)", 2) is resolve_layout(mesh4x2, "S(0),S(0)", 2, shard_order={})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (lambda m: Layout.from_placements(m, "S(0),R"), lambda m: Layout.from_device_mesh(m)("S(0),R")),
        (
            lambda m: Layout.from_shard_order(m, "S(0),S(0)", {0: (1, 0)}),
            lambda m: Layout.from_device_mesh(m)("S(0),S(0)", shard_order={0: (1, 0)}),
        ),
        (lambda m: Layout.replicated_on(m, 2), lambda m: Layout(m, ((), ()))),
    ],
    ids=["from_placements", "from_shard_order", "replicated_on"],
)
def test_deprecated_constructors_warn_and_agree(mesh4x2: DeviceMesh, old: Any, new: Any) -> None:
    with pytest.warns(DeprecationWarning, match="is deprecated and will be removed; use Layout"):
        value = old(mesh4x2)
    assert value == new(mesh4x2)


def test_strings_in_alias_form(mesh4x2: DeviceMesh) -> None:
    assert Layout.from_device_mesh(mesh4x2)("(tp,dp),None") == Layout.from_device_mesh(mesh4x2)([("tp", "dp"), None])
    assert Layout.from_device_mesh(mesh4x2)("tp", partial={"dp": "max"}).placements == (Partial("max"), Shard(0))


def test_jax_mesh_accepted(mesh4x2: DeviceMesh) -> None:
    assert Layout.from_device_mesh(mesh4x2.to_jax())("S(0),R") == Layout.from_device_mesh(mesh4x2)("S(0),R")


def test_layouts_and_meshes_are_interned_also_through_pickle_and_copy():
    import copy
    import pickle

    mesh = init_device_mesh((2, 2), ("a", "b"))
    unbound = Layout.from_device_mesh(mesh)((Shard(0), Replicate()))
    assert unbound.bind(2) is unbound.bind(2) and unbound.bind(3) is not unbound.bind(2)
    bound = unbound.bind(2)
    assert bound is resolve_layout(mesh, "S(0),R", 2) is Layout(mesh, ((0,), ()))
    assert bound is Layout.from_tensor_map(mesh, (1, -1)) is Layout.from_device_mesh(mesh)(("a", None))
    assert pickle.loads(pickle.dumps(bound)) is bound
    assert copy.copy(bound) is bound and copy.deepcopy(bound) is bound
    assert pickle.loads(pickle.dumps(mesh)) == mesh


# -- the one text form ------------------------------------------------------------------------


def test_text_keeps_partial_of_a_dim_split_out_of_mesh_order() -> None:
    """Regression: alias form (('c', 'b'), None) with Partial(max) on 'a' printed without
    the partial (in str(), visualize, DTensor's repr)."""
    mesh = init_device_mesh((2, 2, 2), ("a", "b", "c"))
    layout = Layout.from_device_mesh(mesh)((("c", "b"), None), partial={"a": "max"})
    assert str(layout) == "(c,b),None; partial a=max"
    assert Layout.from_device_mesh(mesh)(str(layout)) == layout
    assert "placements=(c,b),None; partial a=max," in repr(distribute_tensor(np.ones((8, 2), np.float32), mesh, layout))


def test_text_of_a_dim_split_by_two_axes_parses_back(mesh4x2: DeviceMesh) -> None:
    layout = Layout.from_device_mesh(mesh4x2)((Shard(0), Shard(0)), shard_order={}).bind(2)
    assert layout.placements == (Shard(0), Shard(0))  # torch's DTensorSpec view is kept
    assert str(layout) == "(dp,tp),None"
    assert Layout.from_device_mesh(mesh4x2)("(dp,tp),None") == layout


def test_text_partial_clause_errors(mesh4x2: DeviceMesh) -> None:
    with pytest.raises(PlacementError, match=r"the text after ';' is not a partial clause"):
        Layout.from_device_mesh(mesh4x2)("dp,None; tp=max")
    with pytest.raises(PlacementError, match=r"placements='None,dp; partial tp=prod': not axis or axis=op pairs"):
        Layout.from_device_mesh(mesh4x2)("None,dp; partial tp=prod")
    with pytest.raises(PlacementError, match=r"names its partial axes itself"):
        Layout.from_device_mesh(mesh4x2)("None,dp; partial tp=max", partial={"tp": "max"})


def test_repeated_shard_text_and_values_agree(mesh4x2: DeviceMesh) -> None:
    # both mean what torch's do (mesh order), as Layout.placements returns them
    layout = resolve_layout(mesh4x2, "S(0),S(0)", 1)
    assert layout is resolve_layout(mesh4x2, (Shard(0), Shard(0)), 1)
    assert layout.alias_map == (("dp", "tp"),) and layout.placements == (Shard(0), Shard(0))
    assert resolve_layout(mesh4x2, str(layout), 1) is layout  # its text (the alias form) parses back


def test_replicated_and_without_partial_live_on_the_value(mesh4x2: DeviceMesh) -> None:
    layout = resolve_layout(mesh4x2, "P(max),S(1)", 2)
    assert str(layout.without_partial()) == "R,S(1)"
    assert str(layout.replicated()) == "R,R"
    assert Layout(mesh4x2, ((),) * 3) == resolve_layout(mesh4x2, "R,R", 3)
    assert str(mesh4x2) == "dp=4 x tp=2"


def test_placements_not_yet_bound_answer_what_needs_no_rank(mesh4x2: DeviceMesh) -> None:
    recorded = Layout.from_device_mesh(mesh4x2)("R,S(1)")
    assert recorded.partition_spec == P(None, "tp")  # JAX pads the trailing dims
    assert recorded.bind(3).partition_spec == P(None, "tp", None)
    assert Layout.from_device_mesh(mesh4x2)("P,R").partition_spec == P(unreduced={"dp"})
    with pytest.raises(LayoutError, match=r"a negative Shard dim counts from the end"):
        Layout.from_device_mesh(mesh4x2)("S(-1),R").partition_spec  # noqa: B018


def test_short_alias_form_leaves_trailing_dims_unsplit() -> None:
    """The RFC's from_local(local_x, dp_mesh, ("dp",)) for any rank, as a PartitionSpec reads."""
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    dp_mesh = mesh["dp"]
    for shape in [(2,), (2, 3), (2, 3, 5)]:
        x = DTensor.from_local(np.ones(shape, np.float32), dp_mesh, ("dp",))
        assert x.shape == (8, *shape[1:])
        assert x.layout == Layout.from_partition_spec(dp_mesh, P("dp"), len(shape))
    layout = Layout.from_device_mesh(mesh)(("tp",), partial={"dp": "max"}).bind(3)
    assert layout.alias_map == ("tp", "None", "None") and layout.partial == ("max", None)


def test_empty_record_has_one_partial_entry_per_mesh_dim() -> None:
    """MindSpore's Layout(device_mesh).partial: [None] per mesh dim."""
    assert Layout.from_device_mesh(init_device_mesh((4, 2), ("dp", "tp"))).partial == (None, None)
    assert Layout.from_device_mesh(init_device_mesh((2, 2, 2), ("a", "b", "c"))).partial == (None, None, None)
    assert Layout.from_device_mesh(init_device_mesh((8,), ("x",))).partial == (None,)


PLAIN_OR_NOT = st.sampled_from(
    [Shard(0), Shard(1), Shard(2), Shard(-1), Replicate(), Partial("sum"), Partial("max"), StridedShard(0, split_factor=2)]
)


@given(placements=st.tuples(PLAIN_OR_NOT, PLAIN_OR_NOT, PLAIN_OR_NOT), ndim=st.integers(0, 3))
def test_plain_placements_bind_as_the_general_decoding(placements: tuple[Any, ...], ndim: int) -> None:
    """Binding plain Shard (a dim in range, non-negative) / Replicate / Partial placements
    takes a short path: the tables the general decoding gives (each dim split in mesh
    order); anything else goes the general way."""
    mesh = init_device_mesh((2, 2, 2))
    plain = _plain_tables(placements, ndim)
    if any(isinstance(p, Shard) and (type(p) is not Shard or not 0 <= p.dim < ndim) for p in placements):
        assert plain is None
        return
    assert plain is not None
    dim_axes, partial, split = _torch_form_to_tables(mesh, placements, ndim, split_order_from_factors(mesh, placements))
    assert plain == ([tuple(axes) for axes in dim_axes], partial, split)
