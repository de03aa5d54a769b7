"""Parallelization plans: path rendering, presets (vs torch's styles), distribute_pytree values and errors."""

import collections
import dataclasses
import json
import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import (
    DTensor,
    Layout,
    ParallelStyle,
    Partial,
    Replicate,
    Shard,
    colwise,
    distribute_pytree,
    distribute_tensor,
    init_device_mesh,
    layouts_of,
    plan_layouts,
    replicate,
    rowwise,
    sequence,
)
from placements2jax.errors import ArgumentTypeError, MeshError, PlacementError, PlanError
from placements2jax.parallelize import path_of

R, S = Replicate(), Shard


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh((2, 4), ("dp", "tp"))


def mlp_params(d: int = 8, hidden: int = 16) -> dict:
    rng = np.random.default_rng(0)
    layer = lambda: {
        "up": {"w": rng.normal(size=(d, hidden)).astype(np.float32), "b": rng.normal(size=hidden).astype(np.float32)},
        "down": {"w": rng.normal(size=(hidden, d)).astype(np.float32), "b": rng.normal(size=d).astype(np.float32)},
    }
    return {"layers": [layer(), layer()], "norm": {"scale": np.ones(d, np.float32)}}


MLP_PLAN = {r"layers/\d+/up/.*": colwise("tp"), r"layers/\d+/down/.*": rowwise("tp")}


def flat_paths(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, (DTensor, Layout)))[0]
    return {path_of(k): v for k, v in leaves}


def chunk(n: int, k: int, r: int) -> slice:
    """torch.chunk's block r of n elements in k pieces (notes section 1)."""
    c = -(-n // k)
    return slice(min(n, c * r), min(n, c * r + c))


# -- paths -----------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    kernel: jax.Array
    bias: jax.Array


def test_paths_join_dict_keys_attribute_names_and_indices_with_slashes() -> None:
    Pair = collections.namedtuple("Pair", "first second")
    tree = {"layers": [{"w1": 1.0, "pair": Pair(2.0, 3.0)}, (4.0,)], "dense": Dense(5.0, 6.0), "none": None}
    paths = [path_of(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths == [
        "dense/kernel",
        "dense/bias",
        "layers/0/pair/first",
        "layers/0/pair/second",
        "layers/0/w1",
        "layers/1/0",
    ]
    assert [path_of(k) for k, _ in jax.tree_util.tree_flatten_with_path({7: {"b": 1.0}})[0]] == ["7/b"]


# -- presets ---------------------------------------------------------------------------

PRESET_TABLE = [
    # style, ndim, role, placement on the style's axis
    (colwise("tp"), 2, "param", S(1)),
    (colwise("tp"), 1, "param", S(0)),
    (colwise("tp"), 3, "param", S(2)),
    (colwise("tp", convention="torch"), 2, "param", S(0)),
    (colwise("tp", convention="torch"), 3, "param", S(1)),
    (colwise("tp", convention="torch"), 1, "param", S(0)),
    (rowwise("tp"), 2, "param", S(0)),
    (rowwise("tp"), 3, "param", S(1)),
    (rowwise("tp"), 1, "param", R),
    (rowwise("tp", convention="torch"), 2, "param", S(1)),
    (rowwise("tp", convention="torch"), 1, "param", R),
    (sequence("tp"), 1, "param", R),
    (sequence("tp"), 2, "param", R),
    (replicate(), 2, "param", R),
    (colwise("tp"), 3, "input", R),
    (colwise("tp"), 3, "output", S(2)),
    (rowwise("tp"), 3, "input", S(2)),
    (rowwise("tp"), 3, "output", R),
    (sequence("tp"), 3, "input", S(1)),
    (sequence("tp"), 3, "output", S(1)),
    (sequence("tp", sequence_dim=0), 2, "input", S(0)),
    (replicate(), 3, "output", R),
]


@pytest.mark.parametrize(("style", "ndim", "role", "expected"), PRESET_TABLE, ids=lambda v: str(v))
def test_preset_table(style: ParallelStyle, ndim: int, role: str, expected, mesh) -> None:
    assert style.placement(ndim, role) == expected
    layout = style.layout(mesh, ndim, role)
    assert layout.placements == (R, expected)


def test_presets_are_value_types_with_exact_repr() -> None:
    assert colwise("tp") == ParallelStyle("colwise", "tp", "jax")
    assert hash(colwise("tp")) == hash(colwise("tp")) and colwise("tp") != colwise("dp")
    assert repr(rowwise("tp", convention="torch")) == (
        "ParallelStyle(kind='rowwise', axis='tp', convention='torch', sequence_dim=1)"
    )
    assert str(colwise("tp")) == "colwise(tp)" and str(replicate()) == "replicate()"


def test_preset_without_axis_uses_a_one_dimensional_mesh() -> None:
    tp = init_device_mesh((4,), ("tp",))
    assert colwise().layout(tp, 2).placements == (S(1),)
    with pytest.raises(PlanError, match=r'colwise\(\) names no mesh axis.*colwise\("tp"\)'):
        colwise().layout(init_device_mesh((2, 4), ("dp", "tp")), 2)


def test_preset_errors() -> None:
    with pytest.raises(PlanError, match="convention='tf'.*unknown weight convention"):
        colwise("tp", convention="tf")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="not a parallel style"):
        ParallelStyle("diagonal")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="axis=0"):
        colwise(0)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="ndim=0: colwise\\(tp\\) splits dim -1, which a 0-d tensor"):
        colwise("tp").placement(0)
    with pytest.raises(PlanError, match="sequence_dim=2: sequence\\(tp\\) splits dim 2, which a 2-d tensor"):
        sequence("tp", sequence_dim=2).placement(2, "input")
    with pytest.raises(PlanError, match="role='grad'"):
        colwise("tp").placement(2, "grad")  # type: ignore[arg-type]
    with pytest.raises(MeshError, match="axis='mp': no such mesh axis"):
        colwise("mp").layout(init_device_mesh((2, 4), ("dp", "tp")), 2)


def test_presets_match_torch_parallel_styles() -> None:
    """torch's parallelize_module (fake process group) places nn.Linear / nn.Embedding /
    nn.LayerNorm parameters exactly where our presets do: Linear weights in torch's
    (out, in) convention, Embedding tables as (in, out)."""
    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import json
        import torch.nn as nn, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module)
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        m = nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8), "norm": nn.LayerNorm(8),
                           "emb_row": nn.Embedding(12, 8), "emb_col": nn.Embedding(12, 8)})
        parallelize_module(m, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(), "norm": SequenceParallel(),
                                     "emb_row": RowwiseParallel(), "emb_col": ColwiseParallel()})
        print(json.dumps({n: [str(p.placements[0]), list(p.shape), list(p.to_local().shape)]
                          for n, p in m.named_parameters()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    torch_params = json.loads(out.strip().splitlines()[-1])
    tp = init_device_mesh((4,), ("tp",))
    plan = {
        r"up/.*": colwise("tp", convention="torch"),
        r"down/.*": rowwise("tp", convention="torch"),
        r"norm/.*": sequence("tp"),
        r"emb_row/.*": rowwise("tp"),
        r"emb_col/.*": colwise("tp"),
    }
    shapes = {name: jax.ShapeDtypeStruct(tuple(shape), jnp.float32) for name, (_, shape, _) in torch_params.items()}
    tree: dict = {}
    for name, shape in shapes.items():
        module, leaf = name.split(".")
        tree.setdefault(module, {})[leaf] = shape
    ours = flat_paths(plan_layouts(tree, tp, plan))
    for name, (placement, shape, local_shape) in torch_params.items():
        layout = ours[name.replace(".", "/")]
        assert str(layout.placements[0]) == placement.replace("Shard(dim=", "S(").replace("Replicate()", "R"), name
        assert layout.local_shape(tuple(shape), 1) == tuple(local_shape), name


# -- distribute_pytree -----------------------------------------------------------------


def test_mlp_plan_places_every_rank_block(mesh) -> None:
    params = mlp_params()
    placed = distribute_pytree(params, mesh, MLP_PLAN)
    assert jax.tree.structure(jax.tree.map(lambda _: 0, placed, is_leaf=lambda x: isinstance(x, DTensor))) == (
        jax.tree.structure(params)
    )
    expected = {
        "up/w": (R, S(1)),
        "up/b": (R, S(0)),
        "down/w": (R, S(0)),
        "down/b": (R, R),
    }
    layouts = flat_paths(layouts_of(placed))
    assert layouts["norm/scale"].placements == (R, R)
    for i in range(2):
        for name, placements in expected.items():
            assert layouts[f"layers/{i}/{name}"].placements == placements
    for (path, dt), (_, array) in zip(flat_paths(placed).items(), flat_paths(params).items()):
        assert isinstance(dt, DTensor) and dt.shape == array.shape
        np.testing.assert_array_equal(np.asarray(dt.full_tensor()), array)
        for rank in mesh.rank_list:
            tp = mesh.get_coordinate(rank)[1]
            if path.endswith("up/w"):
                block = array[:, 4 * tp : 4 * tp + 4]
            elif path.endswith(("up/b", "down/w")):
                block = array[4 * tp : 4 * tp + 4]
            else:
                block = array
            np.testing.assert_array_equal(np.asarray(dt.to_local(rank)), block, err_msg=f"{path} rank {rank}")


def test_the_physical_arrays_carry_the_partition_specs(mesh) -> None:
    placed = distribute_pytree(mlp_params(), mesh, MLP_PLAN)
    specs = {path: dt.array.sharding.spec for path, dt in flat_paths(placed).items()}
    assert specs["layers/0/up/w"] == jax.sharding.PartitionSpec(None, "tp")
    assert specs["layers/1/down/w"] == jax.sharding.PartitionSpec("tp", None)
    assert specs["norm/scale"] == jax.sharding.PartitionSpec(None)


def test_every_form_of_rule_value(mesh) -> None:
    a = np.arange(32.0).reshape(8, 4)
    params = {f"x{i}": a for i in range(9)}
    plan = [
        ("x0", (Shard(0), Replicate())),
        ("x1", "S(1),S(0)"),
        ("x2", ("dp", "tp")),
        ("x3", "(dp,tp),None"),
        ("x4", Layout.from_device_mesh(mesh)((Replicate(), Shard(1)))),
        ("x5", None),
        ("x6", "colwise(tp)"),
        ("x7", "rowwise( tp )"),
        ("x8", "replicate"),
    ]
    layouts = plan_layouts(params, mesh, plan)
    assert [layouts[f"x{i}"].alias_map for i in range(9)] == [
        ("dp", "None"),
        ("tp", "dp"),
        ("dp", "tp"),
        (("dp", "tp"), "None"),
        ("None", "tp"),
        ("None", "None"),
        ("None", "tp"),
        ("tp", "None"),
        ("None", "None"),
    ]
    placed = distribute_pytree(params, mesh, plan)
    np.testing.assert_array_equal(np.asarray(placed["x3"].to_local(5)), a[5:6])


def test_partial_rule_follows_torch_distribute_tensor(mesh) -> None:
    placed = distribute_pytree({"g": np.full((4,), 8.0)}, mesh, {"g": (Replicate(), Partial())})
    np.testing.assert_array_equal(np.asarray(placed["g"].to_local(0)), np.full((4,), 2.0))
    np.testing.assert_array_equal(np.asarray(placed["g"].full_tensor()), np.full((4,), 8.0))


def test_dtensor_leaves_are_redistributed(mesh) -> None:
    a = np.arange(16.0).reshape(4, 4)
    params = {"w": distribute_tensor(a, mesh, (Shard(0), Replicate())), "v": jnp.asarray(a)}
    placed = distribute_pytree(params, mesh, {"w": colwise("tp")})
    assert placed["w"].placements == (R, S(1)) and placed["v"].placements == (R, R)
    np.testing.assert_array_equal(np.asarray(placed["w"].to_local(3)), a[:, 3:4])
    other = init_device_mesh((4, 2), ("dp", "tp"))
    moved = distribute_pytree({"w": distribute_tensor(a, other, "S(0),S(1)")}, mesh, {"w": colwise("tp")})
    assert moved["w"].device_mesh == mesh
    np.testing.assert_array_equal(np.asarray(moved["w"].to_local(3)), a[:, 3:4])


def test_plan_layouts_needs_only_shapes(mesh) -> None:
    shapes = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, mlp_params()))
    layouts = plan_layouts(shapes, mesh, MLP_PLAN)
    assert flat_paths(layouts)["layers/1/up/w"].partition_spec == jax.sharding.PartitionSpec(None, "tp")
    assert plan_layouts({"x": 3.0}, mesh, {})["x"].placements == (R, R)


def test_plan_is_the_same_for_a_jax_mesh(mesh) -> None:
    assert plan_layouts(mlp_params(), mesh.to_jax(), MLP_PLAN) == plan_layouts(mlp_params(), mesh, MLP_PLAN)


@given(
    rows=st.integers(1, 11),
    cols=st.integers(1, 11),
    style=st.sampled_from([colwise("tp"), rowwise("tp"), colwise("dp", convention="torch"), rowwise("dp")]),
)
def test_uneven_weights_and_biases_get_torch_chunk_blocks(rows: int, cols: int, style: ParallelStyle) -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    w = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    b = np.arange(cols, dtype=np.float32)
    placed = distribute_pytree({"w": w, "b": b}, mesh, {".*": style})
    axis = mesh.axis_index(style.axis)
    weight_dim = style.placement(2).dim
    for rank in mesh.rank_list:
        pieces, coordinate = mesh.shape[axis], mesh.get_coordinate(rank)[axis]
        index = [slice(None), slice(None)]
        index[weight_dim] = chunk(w.shape[weight_dim], pieces, coordinate)
        np.testing.assert_array_equal(np.asarray(placed["w"].to_local(rank)), w[tuple(index)])
        bias = b[chunk(cols, pieces, coordinate)] if style.kind == "colwise" else b
        np.testing.assert_array_equal(np.asarray(placed["b"].to_local(rank)), bias)
    assert math.prod(placed["w"].shape) == w.size


# -- errors ------------------------------------------------------------------------------


def test_a_path_matched_by_two_rules_names_the_path_and_both_rules(mesh) -> None:
    with pytest.raises(PlanError, match=r"path 'layers/0/down/w' is matched by two rules, 'layers/0/.\*' and '.\*/w'"):
        distribute_pytree(mlp_params(), mesh, {"layers/0/.*": "R,R", ".*/w": "S(0),R"})


def test_a_rule_matching_no_path_is_an_error_unless_not_strict(mesh) -> None:
    with pytest.raises(PlanError, match=r"rule 'w' matches no parameter path \(paths: 'layers/0/down/b'"):
        distribute_pytree(mlp_params(), mesh, {"w": colwise("tp")})
    placed = distribute_pytree(mlp_params(), mesh, {"w": colwise("tp")}, strict=False)
    assert all(layout.placements == (R, R) for layout in flat_paths(layouts_of(placed)).values())


def test_regexes_match_whole_paths(mesh) -> None:
    layouts = plan_layouts({"w1": np.ones((4, 4)), "w10": np.ones((4, 4))}, mesh, {"w1": "S(0),R"})
    assert layouts["w1"].placements == (S(0), R) and layouts["w10"].placements == (R, R)


def test_bad_plans_name_the_rule(mesh) -> None:
    params = mlp_params()
    with pytest.raises(PlanError, match=r"plan\['layers/\('\]='layers/\(': not a regular expression"):
        plan_layouts(params, mesh, {"layers/(": "R,R"})
    with pytest.raises(PlacementError, match=r"plan\['norm/scale'\]='S\(0\),X'"):
        plan_layouts(params, mesh, {"norm/scale": "S(0),X"})
    with pytest.raises(ArgumentTypeError, match="expected a mapping regex -> placements"):
        plan_layouts(params, mesh, "S(0),R")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="a rule's key must be a regex string"):
        plan_layouts(params, mesh, {0: "R,R"})  # type: ignore[dict-item]


def test_bad_leaves_name_their_path(mesh) -> None:
    with pytest.raises(PlacementError, match=r"placements \(at 'norm/scale'\)=.*out of range for a 1-d tensor"):
        plan_layouts(mlp_params(), mesh, {"norm/scale": "S(1),R"})
    with pytest.raises(PlanError, match=r"axis \(at 'norm/scale'\)=None: colwise\(\) names no mesh axis"):
        plan_layouts(mlp_params(), mesh, {"norm/scale": "colwise"})
    with pytest.raises(PlanError, match=r"\(at 's'\)=0: colwise\(tp\) splits dim -1, which a 0-d tensor"):
        plan_layouts({"s": 1.0}, mesh, {"s": colwise("tp")})
    with pytest.raises(ArgumentTypeError, match=r"params at 'name'='relu': a leaf must be an array"):
        plan_layouts({"name": "relu"}, mesh, {})
