"""DTensor construction and reading: distribute_tensor, from_local, to_local, full_tensor."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from placements2jax import (
    ArgumentTypeError,
    DeviceMesh,
    DTensor,
    Layout,
    LayoutError,
    MeshError,
    Partial,
    PlacementError,
    Replicate,
    Shard,
    ShapeError,
    distribute_tensor,
    init_device_mesh,
    resolve_layout,
)
from placements2jax.layout import iter_layouts

MESH_SHAPES = [(2,), (3,), (8,), (2, 2), (4, 2), (2, 3), (2, 2, 2)]
TENSOR_SHAPES = [(), (8,), (5,), (4, 6), (7, 3), (2, 4, 8), (3, 5, 2)]


def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    return init_device_mesh(shape, tuple("abc"[: len(shape)]))


def _reference_local(x: np.ndarray, layout: Layout, rank: int) -> np.ndarray:
    """torch's local tensor of a non-partial layout: the rank's torch.chunk block."""
    return x[layout.local_slices(x.shape, rank)]


def _partial_count(layout: Layout) -> int:
    return math.prod(layout.mesh.shape[a] for a in layout.partial_axes)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
@pytest.mark.parametrize("shape", TENSOR_SHAPES, ids=str)
def test_distribute_every_layout_matches_torch_blocks(mesh_shape, shape):
    mesh = _mesh(mesh_shape)
    x = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    for index, layout in enumerate(iter_layouts(mesh, len(shape))):
        dt = distribute_tensor(x, mesh, layout)
        assert dt.shape == shape and dt.dtype == np.int32 and dt.layout == layout
        for rank in mesh.rank_list:
            local = dt.to_local(rank)
            expected = _reference_local(x, layout, rank)
            assert local.shape == expected.shape, (layout, rank)
            np.testing.assert_array_equal(np.asarray(local), expected)
            assert local.devices() == {mesh.device(rank)}
        if index % 5 == 0:  # each full_tensor compiles a program: a sample keeps the suite fast
            np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)


@pytest.mark.parametrize("mesh_shape", [(8,), (4, 2), (2, 2, 2)], ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_distribute_partial_follows_torch_values(mesh_shape, op):
    mesh = _mesh(mesh_shape)
    x = np.arange(24, dtype=np.float32).reshape(6, 4) - 7.5
    layouts = [lay for lay in iter_layouts(mesh, 2, partial_ops=(op,)) if lay.has_partial]
    for layout in layouts[:: max(1, len(layouts) // 6)]:
        dt = distribute_tensor(x, mesh, layout)
        scale = _partial_count(layout) if op == "sum" else 1
        for rank in mesh.rank_list:
            expected = _reference_local(x, Layout(mesh, layout.dim_axes), rank) / scale
            np.testing.assert_allclose(np.asarray(dt.to_local(rank)), expected, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(dt.full_tensor()), x, rtol=1e-6)


def test_integer_partial_sum_is_exact():
    mesh = _mesh((4, 2))
    x = np.arange(8, dtype=np.int64).reshape(4, 2)
    dt = distribute_tensor(x, mesh, (Partial("sum"), Shard(0)))
    locals_ = {r: np.asarray(dt.to_local(r)) for r in mesh.rank_list}
    # Integers cannot be split as x / n: the rank at coordinate 0 holds x, the others 0.
    np.testing.assert_array_equal(locals_[0], x[:2])
    np.testing.assert_array_equal(locals_[2], np.zeros((2, 2)))
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)


def test_rfc_examples_on_sub_meshes():
    mesh = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    dp_mesh = mesh["dp"]
    assert dp_mesh.rank_list == (0, 2)
    local = np.arange(6.0).reshape(3, 2)
    torch_form = DTensor.from_local(local, dp_mesh, (Shard(0),))
    assert torch_form.shape == (6, 2)
    assert torch_form.layout.tensor_map == (0, -1)
    np.testing.assert_array_equal(np.asarray(torch_form.full_tensor()), np.concatenate([local, local]))
    alias_form = DTensor.from_local(local, dp_mesh, ("None", "None"))
    assert alias_form.placements == (Replicate(),) and alias_form.shape == (3, 2)
    sharded_alias = DTensor.from_local(local, dp_mesh, ("dp", None))
    assert sharded_alias.layout == torch_form.layout


def test_from_local_per_rank_sequence_and_mapping_uneven():
    mesh = _mesh((4,))
    x = np.arange(20).reshape(10, 2)
    layout = Layout.from_device_mesh(mesh)((Shard(0),)).bind(2)
    pieces = [x[layout.local_slices(x.shape, r)] for r in mesh.rank_list]
    assert [p.shape[0] for p in pieces] == [3, 3, 3, 1]
    from_sequence = DTensor.from_local(pieces, mesh, (Shard(0),))
    from_mapping = DTensor.from_local(dict(zip(mesh.rank_list, pieces)), mesh, (Shard(0),))
    for dt in (from_sequence, from_mapping):
        assert dt.shape == (10, 2)  # torch would say (12, 2): local * mesh size
        np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)
        assert dt.to_local(3).shape == (1, 2)


def test_to_local_of_an_unpadded_block_is_the_device_buffer_and_a_padded_one_its_rows():
    """As torch's to_local, no copy where the block is the local tensor; a padded block
    (uneven split) is cut to its exact rows, each on its rank's device."""
    mesh = _mesh((4,))
    even = distribute_tensor(np.arange(16.0).reshape(8, 2), mesh, (Shard(0),))
    for rank, shard in zip(mesh.rank_list, even.to_jax().addressable_shards):
        assert shard.device == mesh.device(rank)
        local = even.to_local(rank)
        assert local.unsafe_buffer_pointer() == shard.data.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(local), np.arange(16.0).reshape(8, 2)[2 * rank:2 * rank + 2])
    uneven = distribute_tensor(np.arange(10.0), mesh, (Shard(0),))
    assert [uneven.to_local(r).shape for r in mesh.rank_list] == [(3,), (3,), (3,), (1,)]
    assert [uneven.to_local(r).devices() for r in mesh.rank_list] == [{mesh.device(r)} for r in mesh.rank_list]
    np.testing.assert_array_equal(np.asarray(uneven.to_local(3)), [9.0])


def test_from_local_empty_shards_need_shape_when_ambiguous():
    mesh = _mesh((4,))
    pieces = [np.ones((2,)), np.ones((2,)), np.ones((1,)), np.ones((0,))]
    dt = DTensor.from_local(pieces, mesh, (Shard(0),))
    assert dt.shape == (5,)
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), np.ones(5))
    empties = [np.ones((0,))] * 4
    assert DTensor.from_local(empties, mesh, (Shard(0),)).shape == (0,)


@pytest.mark.parametrize("op,reduce", [("sum", np.sum), ("avg", np.mean), ("max", np.max), ("min", np.min)])
def test_from_local_partial_is_the_reduction_of_locals(op, reduce):
    mesh = _mesh((4, 2))
    rng = np.random.default_rng(0)
    locals_ = [rng.integers(-9, 9, size=(3, 5)).astype(np.float32) for _ in mesh.rank_list]
    dt = DTensor.from_local(locals_, mesh, (Partial(op), Replicate()))
    expected = reduce(np.stack([locals_[r] for r in (0, 2, 4, 6)]), axis=0)
    np.testing.assert_allclose(np.asarray(dt.full_tensor()), expected, rtol=1e-6)
    for rank in mesh.rank_list:
        np.testing.assert_array_equal(np.asarray(dt.to_local(rank)), locals_[rank])


def test_from_local_partial_with_uneven_shard_and_alias_form():
    mesh = _mesh((2, 2, 2))
    x = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    layout = Layout.from_device_mesh(mesh)((("c", "a"), None), partial={"b": "max"})
    pieces = {r: x[layout.local_slices(x.shape, r)] + (mesh.get_coordinate(r)[1] == 0) * -100 for r in mesh.rank_list}
    dt = DTensor.from_local(pieces, mesh, layout)
    assert dt.shape == (7, 3)
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)


def test_from_local_with_explicit_shape_validates_blocks():
    mesh = _mesh((4,))
    pieces = [np.ones((3,)), np.ones((3,)), np.ones((3,)), np.ones((1,))]
    assert DTensor.from_local(pieces, mesh, (Shard(0),), shape=(10,)).shape == (10,)
    with pytest.raises(ShapeError, match=r"rank 3 holds shape \(1,\), but torch.chunk gives it \(0,\)"):
        DTensor.from_local(pieces, mesh, (Shard(0),), shape=(9,))


def test_from_local_spmd_single_array():
    mesh = _mesh((4, 2))
    local = jnp.arange(6.0).reshape(2, 3)
    dt = DTensor.from_local(local, mesh, (Shard(0), Shard(1)))
    assert dt.shape == (8, 6)
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), np.tile(np.asarray(local), (4, 2)))


def test_from_local_errors():
    mesh = _mesh((4,))
    with pytest.raises(ShapeError, match="rank 1 has dtype float32"):
        DTensor.from_local([np.ones(2, np.int32), np.ones(2, np.float32)] * 2, mesh, (Shard(0),))
    with pytest.raises(ShapeError, match="rank 2 has 2 dims"):
        DTensor.from_local([np.ones(2), np.ones(2), np.ones((2, 1)), np.ones(2)], mesh, (Shard(0),))
    with pytest.raises(ShapeError, match=r"one array per rank of the mesh \(4"):
        DTensor.from_local([np.ones(2)] * 3, mesh, (Shard(0),))
    with pytest.raises(ShapeError, match="no global extent of dim 0"):
        DTensor.from_local([np.ones(1), np.ones(3), np.ones(3), np.ones(3)], mesh, (Shard(0),))
    with pytest.raises(MeshError, match="missing"):
        DTensor.from_local({0: np.ones(2)}, mesh, (Shard(0),))
    with pytest.raises(MeshError, match="not a rank of this mesh"):
        DTensor.from_local({r: np.ones(2) for r in (0, 1, 2, 3, 7)}, mesh, (Shard(0),))
    with pytest.raises(ArgumentTypeError, match="not a numeric array"):
        DTensor.from_local("abc", mesh, (Shard(0),))
    with pytest.raises(ArgumentTypeError, match="device_mesh"):
        DTensor.from_local(np.ones(2), "mesh", (Shard(0),))
    with pytest.raises(PlacementError, match="out of range"):
        DTensor.from_local(np.ones(2), mesh, (Shard(1),))


def test_distribute_errors():
    mesh = _mesh((4, 2))
    with pytest.raises(PlacementError, match="2 placements"):
        distribute_tensor(np.ones((8, 2)), _mesh((8,)), (Shard(0), Shard(1)))
    with pytest.raises(LayoutError, match="unknown mesh axis 'x'"):
        distribute_tensor(np.ones((8, 2)), mesh, ("x", None))
    with pytest.raises(ArgumentTypeError, match="not a numeric array"):
        distribute_tensor(object(), mesh, (Shard(0), Replicate()))
    with pytest.raises(ArgumentTypeError, match="already a DTensor"):
        distribute_tensor(distribute_tensor(np.ones(8), mesh), mesh)


def test_reading_properties_and_sharding():
    mesh = _mesh((4, 2))
    dt = distribute_tensor(np.ones((8, 4), np.float32), mesh, (Shard(0), Partial()))
    assert dt.placements == (Shard(0), Partial("sum"))
    assert dt.device_mesh is mesh and dt.ndim == 2 and dt.size == 32
    assert dt.sharding.spec == jax.sharding.PartitionSpec("a", None, unreduced={"b"})
    uneven = distribute_tensor(np.ones((7, 4)), mesh, (Shard(0), Replicate()))
    assert uneven.sharding is None and uneven.array.shape == (8, 4)
    stacked = distribute_tensor(np.ones((8, 4)), mesh, (Partial("max"), Replicate()))
    assert stacked.sharding is None and stacked.array.shape == (4, 8, 4)
    assert "placements=S(0),P" in repr(dt)


def _preview_of(values: np.ndarray, count: int = 6) -> str:
    flat = values.reshape(-1)
    if values.ndim == 0:
        return np.array2string(values)
    text = np.array2string(flat[:count], separator=", ", threshold=count + 1)
    return text if flat.size <= count else text[:-1] + ", ...]"


@pytest.mark.parametrize("mesh_shape", [(8,), (4, 2), (2, 2, 2)], ids=str)
def test_repr_previews_values_from_the_local_shards(mesh_shape, monkeypatch):
    """repr shows the first logical values (partials reduced, padding skipped) like JAX's
    and torch's reprs, read from the devices holding them: no program gathers the array."""
    mesh = _mesh(mesh_shape)
    cases = [((), "sum"), ((5,), "max"), ((7, 3), "sum"), ((3, 5, 2), "avg"), ((0, 3), "min")]
    for shape, op in cases:
        x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) * 3 - 4
        layouts = iter_layouts(mesh, len(shape), partial_ops=(op,))
        for layout in [*layouts[1::5][:3], layouts[-1]]:  # a sample: each distribute compiles a program
            dt = distribute_tensor(x, mesh, layout)
            with monkeypatch.context() as patch:
                patch.setattr(DTensor, "full_tensor", lambda self: pytest.fail("repr gathered the tensor"))
                patch.setattr(jax, "device_get", lambda *a: pytest.fail("repr fetched whole arrays"))
                text = repr(dt)
            head = f"DTensor({_preview_of(x)}, shape={shape}, dtype=float32, placements={layout}, mesh={mesh!r})"
            assert text == head, (layout, text)


def test_repr_of_integer_partials_and_traced_values():
    mesh = _mesh((4, 2))
    local = {r: np.full((2, 3), r, np.int32) for r in mesh.rank_list}  # rank r holds r everywhere
    dt = DTensor.from_local(local, mesh, [Shard(0), Partial("sum")], shape=(8, 3))
    # Row 0 lives on dp coordinate 0 (ranks 0 and 1): 0 + 1 = 1.
    assert repr(dt).startswith("DTensor([1, 1, 1, 1, 1, 1, ...], shape=(8, 3), dtype=int32, placements=S(0),P, ")
    seen = []
    jax.jit(lambda t: seen.append(repr(t)) or t)(distribute_tensor(np.ones(4), mesh, "S(0),R"))
    assert seen[0].startswith("DTensor(traced, shape=(4,)")


def test_a_dtensor_of_prng_keys_is_replicate_and_prints():
    """Typed PRNG keys have no NumPy form: their DTensor (Replicate only, as inference takes
    keys) prints without values and gives
    its keys back."""
    mesh = _mesh((4, 2))
    keys = jax.random.split(jax.random.key(0), 3)
    dt = distribute_tensor(keys, mesh)
    assert repr(dt).startswith("DTensor(PRNG keys, shape=(3,), dtype=key<fry>, placements=R,R, ")
    np.testing.assert_array_equal(jax.random.key_data(dt.full_tensor()), jax.random.key_data(keys))
    assert dt.redistribute(placements="R,R").layout == dt.layout


def test_to_jax_and_numpy_views():
    mesh = _mesh((4, 2))
    x = np.arange(32.0).reshape(8, 4)
    even = distribute_tensor(x, mesh, (Shard(0), Replicate()))
    assert even.to_jax() is even.array
    partial = distribute_tensor(x, mesh, (Shard(0), Partial("avg")))
    np.testing.assert_allclose(np.asarray(partial.to_jax()), x)
    assert partial.to_jax().sharding.spec == jax.sharding.PartitionSpec("a", None)
    uneven = distribute_tensor(x[:7], mesh, (Shard(0), Replicate()))
    np.testing.assert_array_equal(np.asarray(uneven), x[:7])
    np.testing.assert_array_equal(np.asarray(uneven.to_jax()), x[:7])


def test_local_shards_and_default_rank():
    mesh = _mesh((4, 2))
    dt = distribute_tensor(np.arange(10), mesh, (Replicate(), Shard(0)))
    shards = dt.local_shards()
    assert sorted(shards) == list(range(8))
    np.testing.assert_array_equal(np.asarray(dt.to_local()), np.arange(5))
    np.testing.assert_array_equal(np.asarray(shards[7]), np.arange(5, 10))


def test_jax_array_input_and_auto_mesh():
    auto = init_device_mesh((4, 2), ("a", "b"), axis_types="auto")
    x = jnp.arange(30.0).reshape(10, 3)
    for placements in [(Shard(0), Replicate()), (Partial(), Shard(1)), (Partial("min"), Replicate())]:
        dt = distribute_tensor(x, auto, placements)
        np.testing.assert_array_equal(np.asarray(dt.full_tensor()), np.asarray(x))
    summed = distribute_tensor(x, auto, (Partial(), Replicate()))
    assert summed.physical.stacked_axes == (0,)  # Auto axes have no unreduced form
    np.testing.assert_allclose(np.asarray(summed.to_local(2)), np.asarray(x) / 4)


def test_to_local_inside_jit_is_a_clear_error():
    mesh = _mesh((4,))
    dt = distribute_tensor(np.ones(8), mesh, (Shard(0),))
    with pytest.raises(ArgumentTypeError, match="inside jax.jit"):
        jax.jit(lambda d: d.to_local(0))(dt)


def test_repeated_calls_through_the_front_caches_give_the_same_results():
    """Second and later calls with the same source layout, mesh object, shape, dtype and
    placements skip building the layout; results, errors and unhashable placements are
    as on the first call."""
    mesh = _mesh((4, 2))
    x = np.arange(64, dtype=np.int32).reshape(8, 8)
    for _ in range(2):
        dt = distribute_tensor(x, mesh, (Partial(), Shard(0)))
        assert dt.placements == (Partial(), Shard(0)) and np.array_equal(np.asarray(dt.full_tensor()), x)
        assert np.array_equal(np.asarray(dt.to_local(0)), x[:4]) and not np.asarray(dt.to_local(2)).any()
        for placements in ([Shard(1), Shard(0)], "S(1),S(0)", [["a", "b"], None]):
            moved = dt.redistribute(mesh, placements)
            assert moved.layout == resolve_layout(mesh, placements, 2)
            for rank in mesh.rank_list:
                np.testing.assert_array_equal(np.asarray(moved.to_local(rank)), x[moved.layout.local_slices(x.shape, rank)])
    with pytest.raises(PlacementError):  # the dtype is part of the key: bools have no Partial(sum)
        distribute_tensor(x > 3, mesh, (Partial(), Shard(0)))
    plain = distribute_tensor(x > 3, mesh, (Replicate(), Shard(0)))
    for _ in range(2):
        with pytest.raises(PlacementError):
            plain.redistribute(mesh, (Partial(), Shard(0)))


# -- issue 16: every layout is readable and writable back through the public API ----------


@pytest.mark.parametrize("alias", [(("dp", "tp"), None), (("tp", "dp"), None), (None, ("tp", "dp")), ("tp", "dp")])
def test_placements_of_every_layout_are_accepted_back(alias):
    """``.placements`` is torch 2.13's form (repeated Shard in mesh order, StridedShard
    for other orders); distribute_tensor, redistribute and from_local take it back, and
    the alias form (``.layout``) too, with the same blocks on every rank."""
    from placements2jax import StridedShard

    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    y = distribute_tensor(x, mesh, alias)
    placements = y.placements
    assert all(isinstance(p, (Shard, Replicate)) for p in placements)
    if alias == (("tp", "dp"), None):
        assert placements == (StridedShard(0, split_factor=2), Shard(0))
    for again in (
        distribute_tensor(x, mesh, placements),
        distribute_tensor(x, mesh, y.layout),
        y.redistribute(mesh, placements),
        distribute_tensor(x, mesh, "R,R").redistribute(mesh, placements),
        DTensor.from_local([y.to_local(r) for r in mesh.rank_list], mesh, placements),
    ):
        assert again.layout is y.layout and again.placements == placements
        for rank in range(8):
            np.testing.assert_array_equal(np.asarray(again.to_local(rank)), x[y.layout.local_slices(x.shape, rank)])


def test_products_of_partials_have_placements_torch_writes():
    """``P,R * P,R`` on 4 x 2 used to give a result split over tp then dp whose
    ``.placements`` raised; the tie now goes to a mesh-order layout, and its placements
    give the same DTensor back."""
    import placements2jax.operators  # noqa: F401  (installs the operators)

    mesh = _mesh((4, 2))
    a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 1000
    pa = distribute_tensor(a, mesh, "R,R").redistribute(placements="P,R")
    for out, expected in ((pa * pa, a * a), (pa.max(axis=0), a.max(axis=0))):
        back = distribute_tensor(np.asarray(out.full_tensor()), mesh, out.placements)
        assert back.layout is out.layout
        np.testing.assert_allclose(np.asarray(out.full_tensor()), expected, rtol=1e-5)
