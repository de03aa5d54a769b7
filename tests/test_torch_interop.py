"""Torch interop: conversions both ways, and every rank's shard cross-checked against torch."""

import itertools
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from torch.distributed.tensor import Partial as TPartial  # noqa: E402
from torch.distributed.tensor import Replicate as TReplicate  # noqa: E402
from torch.distributed.tensor import Shard as TShard  # noqa: E402
from torch.distributed.tensor import distribute_tensor  # noqa: E402
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from placements2jax import (  # noqa: E402
    DeviceMesh, Layout, Partial, Replicate, Shard, StridedShard, init_device_mesh, resolve_layout,
)
from placements2jax.errors import ArgumentTypeError, LayoutError, PlacementError  # noqa: E402
from placements2jax.interop.torch import (  # noqa: E402
    check_torch_equivalent,
    from_torch_mesh,
    from_torch_placement,
    from_torch_placements,
    to_torch_mesh,
    to_torch_placements,
)

MESH_SHAPES = [(8,), (3,), (2, 4), (4, 2), (3, 2), (2, 3), (2, 2, 2), (2, 1, 3), (1, 2, 2)]


@st.composite
def meshes(draw: st.DrawFn) -> DeviceMesh:
    shape = draw(st.sampled_from(MESH_SHAPES))
    ranks = draw(st.permutations(range(math.prod(shape))))
    names = ("dp", "tp", "cp")[: len(shape)]
    return DeviceMesh(np.array(ranks).reshape(shape), names)


@st.composite
def layouts(draw: st.DrawFn, mesh: DeviceMesh, ndim: int) -> Layout:
    """Any layout: per mesh dim R, P(op) or S(dim), the axes of a dim in any order."""
    op = draw(st.sampled_from(["sum", "avg", "max", "min"]))
    choices = draw(st.lists(st.sampled_from(["R", "P", *range(ndim)]), min_size=mesh.ndim, max_size=mesh.ndim))
    dim_axes = [draw(st.permutations([a for a, c in enumerate(choices) if c == d])) for d in range(ndim)]
    return Layout(mesh, dim_axes, [op if c == "P" else None for c in choices])


@st.composite
def cases(draw: st.DrawFn) -> tuple[Layout, tuple[int, ...]]:
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
    return draw(layouts(mesh, len(shape))), shape


def significant_order(layout: Layout, shard_order=None) -> tuple:
    """The shard order without size-1 mesh dims, whose place torch cannot say (nor matters),
    and the set of mesh dims of each dim."""
    sizes = layout.mesh.shape
    entries = layout.shard_order if shard_order is None else shard_order
    return tuple((d, tuple(a for a in axes if sizes[a] > 1), frozenset(axes)) for d, axes in entries)


def in_mesh_order(layout: Layout) -> bool:
    return all(list(axes) == sorted(axes) for axes in layout.dim_axes)


def torch_local(layout: Layout, x: np.ndarray, rank: int) -> np.ndarray:
    """Rank's local tensor from torch's own distribute_tensor (no process group, no comms)."""
    torch_mesh = to_torch_mesh(layout.mesh, rank=rank)
    local = distribute_tensor(torch.from_numpy(x), torch_mesh, to_torch_placements(layout), src_data_rank=None)
    return local.to_local().numpy()


def our_local(layout: Layout, x: np.ndarray, rank: int) -> np.ndarray:
    """Rank's local tensor by our layout; Partial(sum) ranks hold x / n, as torch's."""
    block = x[layout.local_slices(x.shape, rank)]
    divisor = math.prod(layout.mesh.shape[a] for a in layout.partial_axes if layout.partial[a] == "sum")
    return block / divisor if divisor > 1 else block


@given(cases())
def test_local_shape_and_offset_equal_torchs(case: tuple[Layout, tuple[int, ...]]) -> None:
    layout, shape = case
    placements = to_torch_placements(layout)
    agrees = True
    for rank in layout.mesh.rank_list:
        theirs = compute_local_shape_and_global_offset(shape, to_torch_mesh(layout.mesh, rank=rank), placements)
        agrees &= layout.local_shape_and_offset(shape, rank) == theirs
    # Mesh-order splits (plain and repeated Shard) always agree with torch; out-of-order
    # splits agree exactly when check_torch_equivalent says so.
    if in_mesh_order(layout):
        assert agrees
    try:
        check_torch_equivalent(layout, shape)
    except LayoutError:
        assert not agrees
    else:
        assert agrees


@given(cases())
def test_local_values_equal_torchs_distribute_tensor(case: tuple[Layout, tuple[int, ...]]) -> None:
    layout, shape = case
    x = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    same = all(np.array_equal(torch_local(layout, x, r), our_local(layout, x, r)) for r in layout.mesh.rank_list)
    try:
        check_torch_equivalent(layout, shape)
    except LayoutError:
        assert not in_mesh_order(layout)
        assert not same  # the check refuses only shapes on which torch really differs
    else:
        assert same


@given(cases())
def test_placements_round_trip(case: tuple[Layout, tuple[int, ...]]) -> None:
    layout, shape = case
    placements = to_torch_placements(layout)
    for back in (from_torch_placements(layout.mesh, placements), Layout.from_device_mesh(layout.mesh)(placements)):
        back = back.bind(len(shape))
        assert back.partial == layout.partial
        assert significant_order(back) == significant_order(layout)


@given(cases())
def test_strided_shard_encoding_is_torchs(case: tuple[Layout, tuple[int, ...]]) -> None:
    """Our _StridedShard split factors and shard-order decoding are torch's own."""
    layout, _ = case
    torch_mesh = to_torch_mesh(layout.mesh)
    plain = tuple(
        TPartial(op) if op else TShard(d) if d is not None else TReplicate()
        for op, d in zip(layout.partial, map(layout.mesh_dim_split, range(layout.mesh.ndim)))
    )
    order = tuple(ShardOrderEntry(d, axes) for d, axes in layout.shard_order)
    theirs = DTensorSpec._convert_shard_order_to_StridedShard(order, plain, torch_mesh)
    assert to_torch_placements(layout) == theirs
    decoded = DTensorSpec._maybe_convert_StridedShard_to_shard_order(theirs, torch_mesh)
    decoded_order = tuple((e.tensor_dim, e.mesh_dims) for e in decoded)
    assert significant_order(layout, decoded_order) == significant_order(layout)


def test_repeated_shard_is_the_alias_form_in_mesh_order() -> None:
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    layout = Layout.from_device_mesh(mesh)([TShard(0), TShard(0)])
    assert layout.bind(2).alias_map == (("dp", "tp"), "None")
    assert layout.placements == (Shard(0), Shard(0))
    # torch's example in the notes: 10 rows -> sizes 3,2,3,2 at offsets 0,3,5,8.
    assert [layout.bind(1).local_shape_and_offset((10,), r) for r in range(4)] == [
        ((3,), (0,)),
        ((2,), (3,)),
        ((3,), (5,)),
        ((2,), (8,)),
    ]


# Repeated Shard(d), as torch's objects, ours and text: (mesh shape, text, torch's placements).
REPEATED = [
    ((2, 2), "S(0),S(0)", [TShard(0), TShard(0)]),
    ((2, 4), "S(0),S(0)", [TShard(0), TShard(0)]),
    ((2, 2, 2), "S(0),S(0),R", [TShard(0), TShard(0), TReplicate()]),
    ((2, 2, 2), "S(0),S(0),P", [TShard(0), TShard(0), TPartial()]),
    ((2, 2, 2), "S(0),P(avg),S(0)", [TShard(0), TPartial("avg"), TShard(0)]),
    ((2, 2, 2), "R,S(-2),S(0)", [TReplicate(), TShard(-2), TShard(0)]),  # one dim: torch normalizes first
    ((2, 2), "_S(0, 2),S(-2)", [_StridedShard(0, split_factor=2), TShard(-2)]),  # tp splits first
]


@pytest.mark.parametrize(("mesh_shape", "text", "theirs"), REPEATED, ids=[t for _, t, _ in REPEATED])
def test_repeated_shard_is_torchs_in_every_route(mesh_shape: tuple[int, ...], text: str, theirs: list) -> None:
    """Every rank's shard as torch's distribute_tensor gives it (torch's nested chunking,
    uneven sizes included), from torch's placements, ours and the text form, through every
    public route: binding, distribute_tensor, redistribute, from_local and predict."""
    from placements2jax import DTensor, check, predict
    from placements2jax import distribute_tensor as p2j_distribute

    mesh = init_device_mesh(mesh_shape, ("dp", "tp", "cp")[: len(mesh_shape)])
    ours = [from_torch_placement(p) if not isinstance(p, _StridedShard) else StridedShard(0, split_factor=2)
            for p in theirs]
    forms = [ours, theirs] if isinstance(theirs[0], _StridedShard) else [text, ours, theirs]  # no text for _S
    # torch's distribute_tensor normalizes negative dims before computing shapes and offsets
    normalized = [
        _StridedShard(p.dim % 2, split_factor=p.split_factor) if isinstance(p, _StridedShard)
        else TShard(p.dim % 2) if isinstance(p, TShard) else p
        for p in theirs
    ]
    for rows in (5, 6, 7):
        x = np.arange(rows * 3.0).reshape(rows, 3)
        torch_mesh = {r: to_torch_mesh(mesh, rank=r) for r in mesh.rank_list}
        expected = {
            r: distribute_tensor(torch.from_numpy(x), torch_mesh[r], theirs, src_data_rank=None).to_local().numpy()
            for r in mesh.rank_list
        }
        layout = resolve_layout(mesh, forms[0], x.shape)
        for placements in forms:
            assert resolve_layout(mesh, placements, x.shape) is layout
            assert Layout.from_device_mesh(mesh)(placements).bind(2) is layout
            for r in mesh.rank_list:
                theirs_r = compute_local_shape_and_global_offset(x.shape, torch_mesh[r], normalized)
                assert layout.local_shape_and_offset(x.shape, r) == theirs_r
            dt = p2j_distribute(x, mesh, placements)
            moved = p2j_distribute(x, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
            assert dt.layout is layout and moved.layout is layout
            for r in mesh.rank_list:
                np.testing.assert_array_equal(np.asarray(dt.to_local(r)), expected[r])
                np.testing.assert_array_equal(np.asarray(moved.to_local(r)), expected[r])
            back = DTensor.from_local(expected, mesh, placements, shape=x.shape)
            assert back.layout is layout
            np.testing.assert_array_equal(np.asarray(back.full_tensor()), x)
            assert predict(lambda a: a * 2, (x.shape, np.float32, placements), mesh=mesh).inputs[0].layout is layout
    if any(isinstance(p, TPartial) and p.reduce_op != "sum" for p in theirs):
        return  # XLA has no sharding for Partial(avg) to compile
    # check compiles even shards only: 8 rows, the elementwise op keeping the layout, as XLA does
    report = check(lambda a: a + a, ((8, 3), np.float32, forms[0]), mesh=mesh)
    assert report.prediction.inputs[0].layout is resolve_layout(mesh, forms[-1], (8, 3))
    assert [o.verdict for o in report.outputs] == ["equal"] and not report.compiled_collectives


def test_strided_shard_is_the_reversed_order() -> None:
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    layout = resolve_layout(mesh, [_StridedShard(0, split_factor=2), TShard(0)], 2)
    assert layout.alias_map == (("tp", "dp"), "None")
    assert layout.tensor_map == ((0, 1), -1)
    assert to_torch_placements(layout) == (_StridedShard(0, split_factor=2), TShard(0))
    assert layout.placements == (StridedShard(0, split_factor=2), Shard(0))  # ours, torch's encoding
    assert resolve_layout(mesh, layout.placements, 2) is layout


def test_strided_shard_uneven_difference_is_caught() -> None:
    mesh = init_device_mesh((3, 2), ("dp", "tp"))
    placements = [_StridedShard(0, split_factor=2), TShard(0)]
    assert from_torch_placements(mesh, placements, (12,)).alias_map == (("tp", "dp"),)
    with pytest.raises(LayoutError, match=r"global_shape=\(7,\).*rank 4"):
        from_torch_placements(mesh, placements, (7,))
    layout = from_torch_placements(mesh, placements).bind(1)
    x = np.arange(7.0)
    assert torch_local(layout, x, 4).tolist() == [6.0]  # torch: row 6 on rank 4 = (2, 0)
    assert our_local(layout, x, 5).tolist() == [6.0]  # nested split tp then dp: on rank 5 = (2, 1)
    with pytest.raises(LayoutError, match="_StridedShard differs"):
        to_torch_placements(Layout.from_device_mesh(mesh)([("tp", "dp")]), (7,))


def test_partial_and_negative_dims() -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    layout = Layout.from_device_mesh(mesh)([TPartial("max"), TShard(-1)])
    assert layout.placements == (Partial("max"), Shard(-1))
    assert layout.bind(3).tensor_map == (-1, -1, 0)
    assert to_torch_placements(layout) == (TPartial("max"), TShard(-1))
    assert from_torch_placement(TReplicate()) == Replicate()
    mixed = Layout.from_device_mesh(mesh)([Shard(1), TReplicate()])
    assert mixed == Layout.from_device_mesh(mesh)("S(1),R")


def test_unsupported_torch_placements_are_refused() -> None:
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    with pytest.raises(PlacementError, match="product"):
        Layout.from_device_mesh(mesh)([TPartial("product"), TReplicate()])
    with pytest.raises(PlacementError, match="split factor 3"):
        Layout.from_device_mesh(mesh)([_StridedShard(0, split_factor=3), TShard(0)])
    with pytest.raises(PlacementError, match="3 placements for a 2-d mesh"):
        from_torch_placements(mesh, [TShard(0)] * 3)
    with pytest.raises(PlacementError, match="same dim"):  # a split order per spelling of one dim
        resolve_layout(mesh, [Shard(1), Shard(-1)], 2, shard_order={1: (0,), -1: (1,)})
    with pytest.raises(PlacementError, match="mixes Partial reduce ops"):
        Layout.from_device_mesh(mesh)([TPartial("sum"), TPartial("max")])
    with pytest.raises(ArgumentTypeError, match="expected a placements2jax.Layout"):
        to_torch_placements("S(0),R")  # type: ignore[arg-type]


@given(meshes())
def test_mesh_round_trip(mesh: DeviceMesh) -> None:
    torch_mesh = to_torch_mesh(mesh)
    assert torch_mesh.mesh.tolist() == mesh.mesh.tolist()
    assert torch_mesh.mesh_dim_names == mesh.alias_name
    assert from_torch_mesh(torch_mesh) == mesh
    for rank in mesh.rank_list:
        assert tuple(to_torch_mesh(mesh, rank=rank).get_coordinate()) == mesh.get_coordinate(rank)


def test_torch_mesh_accepted_wherever_a_mesh_is() -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    torch_mesh = to_torch_mesh(mesh)
    assert Layout.from_device_mesh(torch_mesh)("S(0),R") == Layout.from_device_mesh(mesh)("S(0),R")
    assert Layout.from_device_mesh(torch_mesh)([TShard(0), TReplicate()]).mesh == mesh
    with pytest.raises(ArgumentTypeError, match="expected a placements2jax.DeviceMesh"):
        Layout.from_device_mesh(torch.arange(8))


def test_importing_placements2jax_does_not_import_torch() -> None:
    code = "import sys, placements2jax; assert 'torch' not in sys.modules, 'torch imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_mesh_with_fake_process_group() -> None:
    """With a (fake) default process group, to_torch_mesh builds an ordinary torch mesh."""
    code = textwrap.dedent(
        """
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
        from placements2jax import init_device_mesh
        from placements2jax.interop.torch import from_torch_mesh, to_torch_mesh
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
        mesh = init_device_mesh((4, 2), ("dp", "tp"))
        torch_mesh = to_torch_mesh(mesh)
        assert tuple(torch_mesh.get_coordinate()) == (1, 1), torch_mesh.get_coordinate()
        assert from_torch_mesh(torch_mesh) == mesh
        assert from_torch_mesh(torch_init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b"))) == (
            init_device_mesh((2, 4), ("a", "b"))
        )
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_strided_order_on_small_meshes_matches_torch_when_even() -> None:
    """Exhaustive: every split order of one dim, divisible extents -> torch agrees."""
    for shape in [(2, 2), (3, 2), (2, 2, 2), (2, 1, 3)]:
        mesh = init_device_mesh(shape)
        for order in itertools.permutations(range(len(shape))):
            layout = Layout(mesh, [order], None)
            check_torch_equivalent(layout, (math.prod(shape) * 2,))


def test_dtensors_from_torch_meshes_and_placements() -> None:
    from placements2jax import DTensor
    from placements2jax import distribute_tensor as p2j_distribute

    mesh = init_device_mesh((3, 2), ("dp", "tp"))
    torch_mesh = to_torch_mesh(mesh)
    x = np.arange(14.0).reshape(7, 2)
    dt = p2j_distribute(torch.from_numpy(x), torch_mesh, [TShard(0), TReplicate()])
    assert dt.device_mesh == mesh and dt.placements == (Shard(0), Replicate())
    np.testing.assert_array_equal(np.asarray(dt.to_local(4)), x[6:7])
    moved = dt.redistribute(torch_mesh, [TReplicate(), TShard(1)])
    np.testing.assert_array_equal(np.asarray(moved.to_local(1)), x[:, 1:])
    strided = [_StridedShard(0, split_factor=2), TShard(0)]
    even = p2j_distribute(np.arange(12.0), torch_mesh, strided)
    np.testing.assert_array_equal(np.asarray(even.full_tensor()), np.arange(12.0))
    with pytest.raises(LayoutError, match="_StridedShard differs"):
        p2j_distribute(np.arange(7.0), torch_mesh, strided)
    with pytest.raises(LayoutError, match="_StridedShard differs"):
        p2j_distribute(np.arange(7.0), torch_mesh, [TShard(0), TReplicate()]).redistribute(placements=strided)
    pieces = {r: np.ones(1) for r in mesh.rank_list}
    with pytest.raises(LayoutError, match="_StridedShard differs"):
        DTensor.from_local(pieces, torch_mesh, strided, shape=(7,))
