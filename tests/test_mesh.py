"""DeviceMesh: construction, properties, JAX meshes, per-rank queries, sub-meshes and errors."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from placements2jax import (
    ArgumentTypeError,
    DeviceMesh,
    MeshError,
    MeshGroup,
    Replicate,
    Shard,
    ShapeError,
    init_device_mesh,
)


@pytest.fixture
def mesh2x2() -> DeviceMesh:
    return DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))


@pytest.fixture
def mesh4x2() -> DeviceMesh:
    return DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))


# -- construction -------------------------------------------------------------------------


def test_from_nested_list(mesh2x2: DeviceMesh) -> None:
    assert mesh2x2.shape == (2, 2)
    assert mesh2x2.alias_name == ("dp", "tp")
    assert mesh2x2.rank_list == (0, 1, 2, 3)


def test_from_numpy_array_of_any_int_dtype() -> None:
    mesh = DeviceMesh(np.array([[3, 1], [2, 0]], dtype=np.int32), ("dp", "tp"))
    assert mesh.rank_list == (3, 1, 2, 0)
    assert mesh.mesh.tolist() == [[3, 1], [2, 0]]
    assert mesh == DeviceMesh([[3, 1], [2, 0]], ("dp", "tp"))


def test_mesh_dim_names_is_torchs_name_for_alias_name() -> None:
    by_torch_name = DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert by_torch_name.alias_name == by_torch_name.mesh_dim_names == ("dp", "tp")
    assert by_torch_name == DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    assert DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), mesh_dim_names=("dp", "tp")) == by_torch_name


def test_default_names_and_single_name_string() -> None:
    assert DeviceMesh([[0, 1], [2, 3]]).alias_name == ("dim0", "dim1")
    assert DeviceMesh([0, 1, 2]).alias_name == ("dim0",)
    assert DeviceMesh([0, 1, 2], "dp").alias_name == ("dp",)


def test_mesh_copies_the_input_and_is_read_only() -> None:
    ranks = np.array([[0, 1], [2, 3]])
    mesh = DeviceMesh(ranks, ("dp", "tp"))
    ranks[0, 0] = 7
    assert mesh.rank_list == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="read-only"):
        mesh.mesh[0, 0] = 5


def test_value_semantics_and_repr() -> None:
    a = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    b = DeviceMesh(np.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    assert a == b and hash(a) == hash(b)
    assert a != DeviceMesh([[0, 1], [2, 3]], ("dp", "sp"))
    assert a != DeviceMesh([[1, 0], [2, 3]], ("dp", "tp"))
    assert a != DeviceMesh([0, 1, 2, 3], ("dp",))
    assert a != DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), axis_types="auto")
    assert repr(a) == "DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
    auto = DeviceMesh([2, 0], "x", axis_types="auto")
    assert repr(auto) == "DeviceMesh([2, 0], mesh_dim_names=('x',), axis_types='auto')"
    mixed = DeviceMesh([[0, 1], [2, 3]], ("a", "b"), axis_types=("auto", "explicit"))
    assert repr(mixed) == "DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=('a', 'b'), axis_types=('auto', 'explicit'))"
    for mesh in (a, mixed, DeviceMesh([2, 0], "x", axis_types="auto"), DeviceMesh([[0, 1], [2, 3]])):
        assert eval(repr(mesh)) is mesh  # noqa: S307


def test_repr_of_a_large_mesh_is_short_and_exact() -> None:
    """More than 16 ranks 0..N-1 in row-major order print as the init_device_mesh call
    (JAX's and torch's reprs do not list the devices either); others list their ranks."""
    mesh = DeviceMesh(np.arange(8).reshape(2, 2, 2), ("pp", "dp", "tp"))
    assert repr(mesh) == "DeviceMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], mesh_dim_names=('pp', 'dp', 'tp'))"
    if jax.device_count() > 16:  # pragma: no cover - the tests run on 8 devices
        big = init_device_mesh((jax.device_count(),), ("dp",))
        assert repr(big) == f"init_device_mesh(({jax.device_count()},), mesh_dim_names=('dp',))"


def test_torch_constructor() -> None:
    """torch's DeviceMesh(device_type, mesh, *, mesh_dim_names=...) builds the same
    (interned) mesh; the device type must be JAX's backend's."""
    import torch

    ours = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    assert DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")) is ours
    assert DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp")) is ours
    assert DeviceMesh("CPU", np.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"), axis_types="explicit") is ours
    assert DeviceMesh("cpu", [0, 1]).mesh_dim_names == ("dim0",)
    # The names' other spellings, one place: the RFC's alias_name=, JAX's axis_names=.
    assert DeviceMesh([[0, 1], [2, 3]], alias_name=("dp", "tp")) is ours
    assert DeviceMesh([[0, 1], [2, 3]], axis_names=("dp", "tp")) is ours
    assert ours.mesh_dim_names == ours.alias_name == ours.axis_names == ("dp", "tp")
    with pytest.raises(MeshError, match=r"device_type='cuda': JAX runs on 'cpu' devices here.*Fix: pass 'cpu'"):
        DeviceMesh("cuda", [0, 1])
    with pytest.raises(MeshError, match=r"device_type='xpu': not a device type"):
        DeviceMesh("xpu", [0, 1])
    with pytest.raises(MeshError, match=r"mesh=None: torch's form needs the ranks after the device type"):
        DeviceMesh("cpu")
    with pytest.raises(MeshError, match=r"axis_names='b': differs from the names given as alias_name, 'a'"):
        DeviceMesh([0, 1], alias_name="a", axis_names="b")


def test_get_rank_is_the_rank_this_process_acts_as(mesh4x2: DeviceMesh) -> None:
    """torch's get_rank(): the global rank; one process drives every device here, so it is
    the first rank of the mesh on this process, the one get_coordinate() defaults to."""
    assert jax.process_count() == 1
    assert mesh4x2.get_rank() == 0 == mesh4x2.calling_rank()
    assert mesh4x2.get_coordinate() == mesh4x2.get_coordinate(mesh4x2.get_rank()) == (0, 0)
    shuffled = DeviceMesh([[5, 3], [1, 7]], ("dp", "tp"))
    assert shuffled.get_rank() == 5 and shuffled.get_coordinate() == (0, 0)
    assert mesh4x2.submesh("tp", rank=6).get_rank() == 6
    assert mesh4x2.get_local_rank("tp") == mesh4x2.get_coordinate(mesh4x2.get_rank())[1]


# -- properties ------------------------------------------------------------------------------


def test_properties() -> None:
    mesh = DeviceMesh([[7, 1, 2], [3, 4, 5]], ("dp", "tp"))
    assert mesh.shape == (2, 3)
    assert mesh.ndim == 2
    assert mesh.size() == 6
    assert mesh.size("tp") == 3 and mesh.size(0) == 2 and mesh.size(-1) == 3
    assert mesh.rank_list == (7, 1, 2, 3, 4, 5)
    assert isinstance(mesh.mesh, np.ndarray) and mesh.mesh.tolist() == [[7, 1, 2], [3, 4, 5]]
    assert mesh.devices.shape == (2, 3)
    assert mesh.devices[0, 0] == jax.devices()[7]
    assert mesh.device(4) == jax.devices()[4]
    assert mesh.is_explicit


# -- JAX meshes ---------------------------------------------------------------------------


def test_to_jax_same_names_devices_and_explicit_axes() -> None:
    mesh = DeviceMesh([[6, 1], [2, 7], [4, 5], [0, 3]], ("dp", "tp"))
    jax_mesh = mesh.to_jax()
    assert isinstance(jax_mesh, jax.sharding.Mesh)
    assert jax_mesh.axis_names == ("dp", "tp")
    assert dict(jax_mesh.shape) == {"dp": 4, "tp": 2}
    assert [[d.id for d in row] for row in jax_mesh.devices] == [[6, 1], [2, 7], [4, 5], [0, 3]]
    assert tuple(jax_mesh.axis_types) == (AxisType.Explicit, AxisType.Explicit)


def test_to_jax_is_cached(mesh2x2: DeviceMesh) -> None:
    assert mesh2x2.to_jax() is mesh2x2.to_jax()


def test_to_jax_auto_and_mixed_axis_types() -> None:
    auto = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), axis_types="auto")
    assert tuple(auto.to_jax().axis_types) == (AxisType.Auto, AxisType.Auto)
    assert not auto.is_explicit
    mixed = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), axis_types=("explicit", AxisType.Auto))
    assert tuple(mixed.to_jax().axis_types) == (AxisType.Explicit, AxisType.Auto)
    assert mixed.axis_types == (AxisType.Explicit, AxisType.Auto)


def test_from_jax_explicit_round_trip() -> None:
    devices = np.array(jax.devices())[[3, 2, 1, 0, 7, 6, 5, 4]].reshape(2, 4)
    jax_mesh = jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    mesh = DeviceMesh.from_jax(jax_mesh)
    assert mesh == DeviceMesh([[3, 2, 1, 0], [7, 6, 5, 4]], ("dp", "tp"))
    assert mesh.to_jax() == jax_mesh


def test_from_jax_make_mesh_is_explicit() -> None:
    mesh = DeviceMesh.from_jax(jax.make_mesh((4, 2), ("dp", "tp")))
    assert mesh.is_explicit
    assert mesh.shape == (4, 2) and sorted(mesh.rank_list) == list(range(8))


def test_from_jax_auto_round_trip() -> None:
    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    assert tuple(jax_mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
    mesh = DeviceMesh.from_jax(jax_mesh)
    assert mesh == DeviceMesh([[0, 1], [2, 3]], ("x", "y"), axis_types="auto")
    assert mesh.to_jax() == jax_mesh
    assert DeviceMesh.from_jax(mesh.to_jax()) == mesh


# -- per-rank queries --------------------------------------------------------------------------


def test_rank_list_along_axis_from_the_issue(mesh2x2: DeviceMesh) -> None:
    assert mesh2x2.get_rank_list_along_axis("dp", rank=0) == [0, 2]
    assert mesh2x2.get_rank_list_along_axis("dp", rank=1) == [1, 3]
    assert mesh2x2.get_rank_list_along_axis("dp", rank=2) == [0, 2]
    assert mesh2x2.get_rank_list_along_axis("tp", rank=0) == [0, 1]
    assert mesh2x2.get_rank_list_along_axis("tp", rank=3) == [2, 3]
    assert mesh2x2.get_rank_list_along_axis("dp") == [0, 2]


def test_local_rank_and_coordinate(mesh4x2: DeviceMesh) -> None:
    assert mesh4x2.get_coordinate(rank=5) == (2, 1)
    assert mesh4x2.get_local_rank("dp", rank=5) == 2
    assert mesh4x2.get_local_rank("tp", rank=5) == 1
    assert [mesh4x2.get_coordinate(rank=r) for r in range(8)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1),
    ]  # fmt: skip


def test_calling_rank_is_first_rank_of_the_mesh() -> None:
    mesh = DeviceMesh([[3, 1], [2, 0]], ("dp", "tp"))
    assert mesh.calling_rank() == 3
    assert mesh.get_coordinate() == (0, 0)
    assert mesh.get_rank_list_along_axis("dp") == [3, 2]
    assert DeviceMesh([[0, 1], [2, 3]], ("dp", "tp")).get_coordinate() == (0, 0)


def test_get_group(mesh4x2: DeviceMesh) -> None:
    assert mesh4x2.get_group("dp", rank=3) == MeshGroup(("dp",), (1, 3, 5, 7))
    assert mesh4x2.get_group("tp", rank=3) == MeshGroup(("tp",), (2, 3))
    assert mesh4x2.get_group(("dp", "tp"), rank=3) == MeshGroup(("dp", "tp"), tuple(range(8)))
    assert mesh4x2.get_group(rank=3) == MeshGroup(("dp", "tp"), tuple(range(8)))
    assert mesh4x2.get_group(("tp", "dp"), rank=0).ranks == (0, 2, 4, 6, 1, 3, 5, 7)
    assert mesh4x2.get_group("dp").size == 4
    assert mesh4x2.get_group("dp").ranks == (0, 2, 4, 6)


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
@pytest.mark.parametrize("axes", ["dp", "tp", ("dp", "tp")])
def test_get_group_drives_a_psum_in_shard_map(axis_types: str, axes: Any) -> None:
    # Ranks deliberately out of device order: device r must sum exactly the ranks of its group.
    mesh = DeviceMesh([[6, 1], [2, 7], [4, 5], [0, 3]], ("dp", "tp"), axis_types=axis_types)  # type: ignore[arg-type]
    jax_mesh = mesh.to_jax()
    spec = P(("dp", "tp"))
    values = jax.device_put(np.array(mesh.rank_list, dtype=np.int32), NamedSharding(jax_mesh, spec))
    group = mesh.get_group(axes)
    summed = jax.shard_map(
        lambda v: jax.lax.psum(v, group.axis_names), mesh=jax_mesh, in_specs=spec, out_specs=spec
    )(values)
    got = {shard.device.id: int(shard.data[0]) for shard in summed.addressable_shards}
    expected = {r: sum(mesh.get_group(axes, rank=r).ranks) for r in mesh.rank_list}
    assert got == expected
    if axes == "dp":
        assert expected == {6: 12, 2: 12, 4: 12, 0: 12, 1: 16, 7: 16, 5: 16, 3: 16}


def test_device_num_along_axis(mesh4x2: DeviceMesh) -> None:
    assert mesh4x2.get_device_num_along_axis("dp") == 4
    assert mesh4x2.get_device_num_along_axis("tp") == 2
    assert mesh4x2.get_device_num_along_axis(0) == 4
    assert mesh4x2.get_device_num_along_axis(-1) == 2


# -- get_global_shape ------------------------------------------------------------------------------


def test_global_shape_exact_from_all_local_shapes(mesh2x2: DeviceMesh) -> None:
    # 5 rows over dp: 3 | 2.
    assert mesh2x2.get_global_shape({0: (3, 4), 2: (2, 4)}, (Shard(0), Replicate())) == (5, 4)
    assert mesh2x2.get_global_shape({0: (3, 4), 1: (3, 4), 2: (3, 4), 3: (3, 4)}, "S(0),R") == (6, 4)
    # 10 rows under the alias form (("dp", "tp"),): 3,2,3,2.
    local = {0: (3, 4), 1: (2, 4), 2: (3, 4), 3: (2, 4)}
    assert mesh2x2.get_global_shape(local, (("dp", "tp"), None)) == (10, 4)
    # torch form over both axes on two dims
    assert mesh2x2.get_global_shape({0: (2, 2), 3: (1, 2)}, (Shard(0), Shard(1))) == (3, 4)


def test_global_shape_exact_when_unique() -> None:
    mesh = init_device_mesh((4,), ("x",))
    # Rank 2 holding 3 needs ceil(N/4) = 3, rank 3 holding 1 then pins N = 10.
    assert mesh.get_global_shape({2: (3,), 3: (1,)}, (Shard(0),)) == (10,)
    assert mesh.get_global_shape({r: s for r, s in enumerate([(3,), (3,), (3,), (1,)])}, "S(0)") == (10,)
    # Replicated dims are exact from one rank; so is an empty first shard.
    assert mesh.get_global_shape((7, 5), (Replicate(),)) == (7, 5)
    assert mesh.get_global_shape((0, 5), (Shard(0),), rank=0) == (0, 5)


def test_global_shape_ambiguous_raises(mesh2x2: DeviceMesh) -> None:
    with pytest.raises(
        ShapeError,
        match=r"local_shape=.*global extents \[5, 6\] of dim 0 all give local extents \{0: 3\}\. "
        r"Fix: pass the global shape \(shape=\.\.\.\), the local shapes of more ranks, or assume_even=True",
    ):
        mesh2x2.get_global_shape((3, 4), (Shard(0), Replicate()))
    with pytest.raises(ShapeError, match=r"global extents \[4, 5\] of dim 0 all give local extents \{2: 2\}"):
        mesh2x2.get_global_shape((2, 4), (Shard(0), Replicate()), rank=2)


def test_global_shape_assume_even(mesh2x2: DeviceMesh) -> None:
    assert mesh2x2.get_global_shape((3, 4), (Shard(0), Replicate()), assume_even=True) == (6, 4)
    assert mesh2x2.get_global_shape((2, 4), (Shard(0), Shard(1)), assume_even=True) == (4, 8)


def test_global_shape_inconsistent_raises(mesh2x2: DeviceMesh) -> None:
    with pytest.raises(ShapeError, match=r"no global extent of dim 0 gives local extents \{0: 3, 2: 4\} under torch\.chunk"):
        mesh2x2.get_global_shape({0: (3, 4), 2: (4, 4)}, (Shard(0), Replicate()))
    # A replicated dim must have the same extent on every rank.
    with pytest.raises(ShapeError, match=r"no global extent of dim 1 gives local extents \{0: 4, 2: 5\}"):
        mesh2x2.get_global_shape({0: (3, 4), 2: (3, 5)}, (Shard(0), Replicate()))
    with pytest.raises(ShapeError, match=r"no global extent of dim 0 gives local extents \{0: 3, 1: 4\}"):
        mesh2x2.get_global_shape({0: (3,), 1: (4,)}, (Replicate(), Replicate()))


def test_global_shape_errors(mesh2x2: DeviceMesh) -> None:
    with pytest.raises(ShapeError, match=r"local_shape=\(3,\): rank 2's shape has 1 dims, the layout 2"):
        mesh2x2.get_global_shape({0: (3, 4), 2: (3,)}, ("dp", None))
    with pytest.raises(MeshError, match=r"rank=9: not a rank of this mesh\. Fix: use one of \(0, 1, 2, 3\)"):
        mesh2x2.get_global_shape({9: (3, 4)}, ("dp", None))
    with pytest.raises(ArgumentTypeError, match=r"local_shape=3: expected a tuple of ints"):
        mesh2x2.get_global_shape(3, ("dp", None))  # type: ignore[arg-type]


# -- sub-meshes and flatten --------------------------------------------------------------------------


def test_getitem_is_the_calling_ranks_view(mesh2x2: DeviceMesh) -> None:
    dp_mesh = mesh2x2["dp"]
    assert dp_mesh.rank_list == (0, 2)
    assert dp_mesh.alias_name == ("dp",)
    assert dp_mesh == DeviceMesh([0, 2], ("dp",))
    assert mesh2x2["tp"] == DeviceMesh([0, 1], ("tp",))


def test_submesh_of_other_ranks(mesh2x2: DeviceMesh) -> None:
    assert mesh2x2.submesh("dp", rank=1).rank_list == (1, 3)
    assert mesh2x2.submesh("dp", rank=3).rank_list == (1, 3)
    assert mesh2x2.submesh("dp", rank=2).rank_list == (0, 2)
    assert mesh2x2.submesh("tp", rank=2).rank_list == (2, 3)


def test_getitem_tuple_of_names() -> None:
    mesh = init_device_mesh((2, 2, 2), ("pp", "dp", "tp"))
    assert mesh[("dp", "tp")] == DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    assert mesh.submesh(("pp", "tp"), rank=5) == DeviceMesh([[0, 1], [4, 5]], ("pp", "tp"))
    assert mesh.submesh(("tp", "pp"), rank=5) == DeviceMesh([[0, 4], [1, 5]], ("tp", "pp"))
    assert mesh[("pp", "dp", "tp")] == mesh


def test_submesh_keeps_axis_types() -> None:
    mesh = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), axis_types=("auto", "explicit"))
    assert mesh["dp"].axis_types == (AxisType.Auto,)
    assert mesh["tp"].axis_types == (AxisType.Explicit,)


def test_flatten(mesh2x2: DeviceMesh) -> None:
    assert mesh2x2.flatten() == DeviceMesh([0, 1, 2, 3], ("dp_tp",))
    assert mesh2x2.flatten("world").alias_name == ("world",)
    assert DeviceMesh([[3, 1], [2, 0]], ("a", "b")).flatten().rank_list == (3, 1, 2, 0)
    assert init_device_mesh((2, 2, 2), ("pp", "dp", "tp")).flatten().alias_name == ("pp_dp_tp",)
    assert DeviceMesh([[0, 1], [2, 3]], ("a", "b"), axis_types="auto").flatten().axis_types == (AxisType.Auto,)
    assert mesh2x2.flatten().axis_types == (AxisType.Explicit,)


# -- every axis argument by name or int -------------------------------------------------------


AXIS_QUERIES: list[tuple[str, Callable[[DeviceMesh, Any], Any], Any]] = [
    ("get_local_rank", lambda m, a: m.get_local_rank(a, rank=5), 1),
    ("get_rank_list_along_axis", lambda m, a: m.get_rank_list_along_axis(a, rank=5), [4, 5]),
    ("get_group", lambda m, a: m.get_group(a, rank=5), MeshGroup(("tp",), (4, 5))),
    ("get_device_num_along_axis", lambda m, a: m.get_device_num_along_axis(a), 2),
    ("size", lambda m, a: m.size(a), 2),
    ("axis_index", lambda m, a: m.axis_index(a), 1),
    ("axis_name", lambda m, a: m.axis_name(a), "tp"),
]


@pytest.mark.parametrize(("query", "call", "expected"), AXIS_QUERIES, ids=[q[0] for q in AXIS_QUERIES])
@pytest.mark.parametrize("axis", ["tp", 1, -1, np.int64(1)])
def test_axis_by_name_or_int(
    mesh4x2: DeviceMesh, query: str, call: Callable[[DeviceMesh, Any], Any], expected: Any, axis: Any
) -> None:
    assert call(mesh4x2, axis) == expected


# -- init_device_mesh --------------------------------------------------------------------------------


def test_init_device_mesh() -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    assert mesh == DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
    assert init_device_mesh((3,)).alias_name == ("dim0",)
    assert init_device_mesh((2, 2), mesh_dim_names=("a", "b")) == DeviceMesh([[0, 1], [2, 3]], ("a", "b"))
    assert init_device_mesh([8], ("x",)).rank_list == tuple(range(8))


def test_init_device_mesh_torch_style() -> None:
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert mesh == DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "tp"))
    assert init_device_mesh("cuda", (8,)).shape == (8,)


def test_init_device_mesh_axis_types() -> None:
    mesh = init_device_mesh((2, 2), ("a", "b"), axis_types="auto")
    assert tuple(mesh.to_jax().axis_types) == (AxisType.Auto, AxisType.Auto)


# -- pickling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_types", ["explicit", "auto", ("auto", "explicit")])
def test_pickle_round_trip(axis_types: Any) -> None:
    mesh = DeviceMesh([[3, 1], [2, 0]], ("dp", "tp"), axis_types=axis_types)
    clone = pickle.loads(pickle.dumps(mesh))
    assert clone == mesh and hash(clone) == hash(mesh)
    assert clone.axis_types == mesh.axis_types
    assert clone.to_jax() == mesh.to_jax()


# -- errors -----------------------------------------------------------------------------------------


MESH_ERRORS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "duplicate names",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp", "dp")),
        MeshError,
        r"mesh_dim_names=\('dp', 'dp'\): axis names must be unique\. Fix: give every mesh axis its own name",
    ),
    (
        "None as a name",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp", "None")),
        MeshError,
        r"mesh_dim_names=\('dp', 'None'\): 'None' cannot name a mesh axis \(\"None\" means unsharded\)\. Fix: choose another name",
    ),
    (
        "empty name",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp", "")),
        MeshError,
        r"mesh_dim_names=\('dp', ''\): '' cannot name a mesh axis",
    ),
    (
        "too few names",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp",)),
        MeshError,
        r"mesh_dim_names=\('dp',\): 1 names for a 2-d mesh\. Fix: give exactly 2 names, one per mesh axis",
    ),
    (
        "too many names",
        lambda: DeviceMesh([0, 1], ("dp", "tp")),
        MeshError,
        r"mesh_dim_names=\('dp', 'tp'\): 2 names for a 1-d mesh\. Fix: give exactly 1 names",
    ),
    (
        "positional names and mesh_dim_names differ",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), mesh_dim_names=("a", "b")),
        MeshError,
        r"mesh_dim_names=\('a', 'b'\): differs from the names given positionally, \('dp', 'tp'\)\. Fix: give the axis "
        r"names once",
    ),
    (
        "duplicate ranks",
        lambda: DeviceMesh([[0, 1], [2, 0]], ("dp", "tp")),
        MeshError,
        r"mesh=\[\[0, 1\], \[2, 0\]\]: rank 0 appears more than once\. Fix: list every rank once",
    ),
    (
        "rank beyond the device count",
        lambda: DeviceMesh([[0, 1], [2, 8]], ("dp", "tp")),
        MeshError,
        r"mesh=\[\[0, 1\], \[2, 8\]\]: rank 8 does not exist: JAX sees 8 devices \(ranks 0\.\.7\)\. "
        r"Fix: use ranks below jax\.device_count\(\), or start JAX with more devices",
    ),
    (
        "negative rank",
        lambda: DeviceMesh([-1, 0]),
        MeshError,
        r"mesh=\[-1, 0\]: rank -1 does not exist",
    ),
    (
        "non-rectangular mesh",
        lambda: DeviceMesh([[0, 1], [2]], ("dp", "tp")),
        MeshError,
        r"mesh=\[\[0, 1\], \[2\]\]: not a rectangular array of ranks .*Fix: pass e\.g\. \[\[0, 1\], \[2, 3\]\]",
    ),
    (
        "non-int ranks",
        lambda: DeviceMesh([["a", "b"]], ("dp", "tp")),
        MeshError,
        r"mesh=\[\['a', 'b'\]\]: ranks must be ints in a rectangular array\. Fix: pass e\.g\.",
    ),
    (
        "fractional ranks",
        lambda: DeviceMesh([0.5, 1.0]),
        MeshError,
        r"mesh=\[0\.5, 1\.0\]: ranks must be ints",
    ),
    (
        "scalar mesh",
        lambda: DeviceMesh(3),
        MeshError,
        r"mesh=3: a mesh needs at least one axis and one rank\. Fix: pass e\.g\. \[0, 1, 2, 3\]",
    ),
    (
        "empty mesh",
        lambda: DeviceMesh([]),
        MeshError,
        r"mesh=\[\]: ",
    ),
    (
        "name of the wrong type",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp", 3)),
        ArgumentTypeError,
        r"mesh_dim_names=\('dp', 3\): axis name 3 is not a string\. Fix: pass e\.g\. \(\"dp\", \"tp\"\)",
    ),
    (
        "names not a sequence",
        lambda: DeviceMesh([[0, 1], [2, 3]], 5),
        ArgumentTypeError,
        r"mesh_dim_names=5: expected a tuple of axis names",
    ),
    (
        "bad axis type",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), axis_types="manual"),
        MeshError,
        r"axis_types=\('manual', 'manual'\): unsupported axis type 'manual'\. Fix: use \"explicit\" or \"auto\"",
    ),
    (
        "wrong number of axis types",
        lambda: DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"), axis_types=("auto",)),
        MeshError,
        r"axis_types=\('auto',\): need one axis type per mesh axis \(2\)",
    ),
    (
        "from_jax of a non-mesh",
        lambda: DeviceMesh.from_jax("dp"),
        ArgumentTypeError,
        r"mesh='dp': expected a jax\.sharding\.Mesh\. Fix: pass e\.g\. jax\.make_mesh",
    ),
    (
        "init_device_mesh: more devices than JAX has",
        lambda: init_device_mesh((2, 5)),
        MeshError,
        r"mesh_shape=\(2, 5\): needs 10 devices, JAX sees 8\. Fix: use a smaller mesh, or start JAX with more devices",
    ),
    (
        "init_device_mesh: zero-size axis",
        lambda: init_device_mesh((2, 0)),
        MeshError,
        r"mesh_shape=\(2, 0\): a mesh needs at least one axis and every axis size a positive int\. Fix: pass e\.g\. \(4, 2\)",
    ),
    (
        "init_device_mesh: no axes",
        lambda: init_device_mesh(()),
        MeshError,
        r"mesh_shape=\(\): a mesh needs at least one axis",
    ),
    (
        "init_device_mesh: an int",
        lambda: init_device_mesh(8),
        ArgumentTypeError,
        r"mesh_shape=8: expected a tuple of ints\. Fix: pass e\.g\. \(4, 2\)",
    ),
    (
        "init_device_mesh: device type without a shape",
        lambda: init_device_mesh("cpu"),
        ArgumentTypeError,
        r"mesh_shape=None: expected a tuple of ints",
    ),
    (
        "init_device_mesh: wrong number of names",
        lambda: init_device_mesh((2, 4), ("dp",)),
        MeshError,
        r"mesh_dim_names=\('dp',\): 1 names for a 2-d mesh",
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "message"), MESH_ERRORS, ids=[e[0] for e in MESH_ERRORS])
def test_construction_errors(case: str, call: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


QUERY_ERRORS: list[tuple[str, Callable[[DeviceMesh], Any], type[Exception], str]] = [
    (
        "unknown axis name",
        lambda m: m.get_local_rank("pp"),
        MeshError,
        r"axis='pp': no such mesh axis; the axes are \('dp', 'tp'\)\. Fix: use one of those names",
    ),
    (
        "axis index too large",
        lambda m: m.get_rank_list_along_axis(2),
        MeshError,
        r"axis=2: out of range for a 2-d mesh\. Fix: use an index in \[-2, 2\) or a name from \('dp', 'tp'\)",
    ),
    (
        "axis index too negative",
        lambda m: m.get_device_num_along_axis(-3),
        MeshError,
        r"axis=-3: out of range for a 2-d mesh",
    ),
    (
        "axis of the wrong type",
        lambda m: m.get_local_rank(1.0),
        ArgumentTypeError,
        r"axis=1\.0: expected an axis name or index\. Fix: use one of \('dp', 'tp'\)",
    ),
    (
        "bool axis",
        lambda m: m.size(True),
        ArgumentTypeError,
        r"axis=True: expected an axis name or index",
    ),
    (
        "rank not in the mesh",
        lambda m: m.get_coordinate(rank=5),
        MeshError,
        r"rank=5: not a rank of this mesh\. Fix: use one of \(0, 1, 2, 3\)",
    ),
    (
        "rank of the wrong type",
        lambda m: m.get_local_rank("dp", rank="0"),
        ArgumentTypeError,
        r"rank='0': expected an int rank\. Fix: use one of \(0, 1, 2, 3\)",
    ),
    (
        "device of a missing rank",
        lambda m: m.device(9),
        MeshError,
        r"rank=9: not a rank of this mesh",
    ),
    (
        "unknown sub-mesh name",
        lambda m: m["pp"],
        MeshError,
        r"axis='pp': no such mesh axis; the axes are \('dp', 'tp'\)",
    ),
    (
        "sub-mesh by index",
        lambda m: m[0],
        ArgumentTypeError,
        r"names=0: a sub-mesh is selected by axis names\. Fix: use names from \('dp', 'tp'\)",
    ),
    (
        "sub-mesh naming an axis twice",
        lambda m: m[("dp", "dp")],
        MeshError,
        r"axis=\('dp', 'dp'\): an axis is named twice\. Fix: name each mesh axis at most once",
    ),
    (
        "group naming an axis twice",
        lambda m: m.get_group(("tp", 1)),
        MeshError,
        r"axis=\('tp', 1\): an axis is named twice",
    ),
    (
        "group of no axes",
        lambda m: m.get_group(()),
        MeshError,
        r"axis=\(\): no axis given\. Fix: name at least one mesh axis",
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "message"), QUERY_ERRORS, ids=[e[0] for e in QUERY_ERRORS])
def test_query_errors(
    mesh2x2: DeviceMesh, case: str, call: Callable[[DeviceMesh], Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call(mesh2x2)


def test_errors_are_value_and_type_errors() -> None:
    with pytest.raises(ValueError):
        DeviceMesh([[0, 1], [2, 3]], ("dp", "dp"))
    with pytest.raises(TypeError):
        DeviceMesh([[0, 1], [2, 3]], ("dp", 3))
