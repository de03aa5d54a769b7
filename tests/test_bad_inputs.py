"""The bad-input catalogue: every public function and class of placements2jax, fed bad input.

Each case asserts that

(a) the exception is ours (a :class:`Placements2JaxError` subclass, also a ValueError,
    TypeError or LookupError) of the expected class;
(b) the message names the argument (``"placements="``) and says how to fix it (``"Fix:"``);
(c) no JAX/XLA error leaks: the exception is not a jax type and does not show another
    exception's traceback (raised ``from None``, or chained only from our own errors);
(d) every DTensor the case got is unchanged: same layout, shape and dtype, same
    ``full_tensor`` and the same ``to_local`` on every rank as before.

``test_every_public_name_has_a_case`` keeps the catalogue complete as ``__all__`` grows.
"""

from __future__ import annotations

import io
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import equinox as eqx
from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import placements2jax
from placements2jax import (
    ArgumentTypeError,
    CheckpointError,
    Collective,
    CostModel,
    DeviceMesh,
    DTensor,
    IndexingError,
    InferenceError,
    Layout,
    LayoutError,
    MeshError,
    MeshGroup,
    ParallelStyle,
    Partial,
    Placement,
    PlacementError,
    Placements2JaxError,
    PlanError,
    RedistributeError,
    Replicate,
    ShapeError,
    Shard,
    StridedShard,
    UnsupportedOpError,
    apply,
    auto_plan,
    as_device_mesh,
    check,
    colwise,
    distribute_pytree,
    distribute_tensor,
    format_alias,
    format_placements,
    fully_shard,
    fully_shard_layouts,
    fully_sharded_layout,
    infer_signature,
    init_device_mesh,
    local_map,
    logical_layouts,
    register_sharding,
    unregister_sharding,
    parse_alias,
    parse_placement,
    parse_placements,
    plan_figures,
    plan_layouts,
    plan_redistribute,
    plot,
    predict,
    print_layout,
    redistribute_collectives,
    resolve_layout,
    rowwise,
    sequence,
    set_default_cost_model,
    unshard,
    use_cost_model,
    visualize,
    vocab_parallel_cross_entropy,
)
from placements2jax.autoplan import compiled_figures
from placements2jax.cli import main as cli_main

F32 = np.float32
X = np.arange(30, dtype=np.int32).reshape(10, 3) - 5  # 10 rows over dp=4 and 3 cols over tp=2: uneven


def _make_env() -> SimpleNamespace:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    mesh8 = init_device_mesh((8,), ("x",))
    e = SimpleNamespace(mesh=mesh, mesh8=mesh8, x=X)
    e.layout = resolve_layout(mesh, "S(0),R", 2)
    e.dt = distribute_tensor(X, mesh, "S(0),R")
    e.dtp = distribute_tensor(X, mesh, [Partial(), Shard(1)])
    e.dtm = distribute_tensor(X, mesh, [Partial("max"), Replicate()])
    e.dt8 = distribute_tensor(X, mesh8, [Shard(1)])
    e.dtb = distribute_tensor(X > 0, mesh8, [Replicate()])
    e.dtc = distribute_tensor(X.astype(np.complex64), mesh8, [Replicate()])
    e.dtensors = {name: getattr(e, name) for name in ("dt", "dtp", "dtm", "dt8", "dtb", "dtc")}
    e.logical = {"dt": X, "dtp": X, "dtm": X, "dt8": X, "dtb": X > 0, "dtc": X.astype(np.complex64)}
    e.snapshot = {name: _state(d) for name, d in e.dtensors.items()}
    return e


def _state(d: DTensor) -> tuple[Any, ...]:
    locals_ = {r: np.asarray(d.to_local(r)) for r in d.device_mesh.rank_list}
    return d.layout, d.shape, d.dtype, np.asarray(d.full_tensor()), locals_


@pytest.fixture(scope="module")
def env() -> SimpleNamespace:
    return _make_env()


@dataclass(frozen=True)
class Case:
    """One bad input: the public names it exercises, the call, the expected error class
    and the argument the message must name."""

    name: str
    covers: tuple[str, ...]
    error: type[Placements2JaxError]
    argument: str
    call: Callable[[SimpleNamespace], Any]


class _EqxActivated(eqx.Module):
    """An Equinox module with a non-array leaf where eqx.nn.MLP keeps its activation function."""

    w: Any
    activation: Callable[[Any], Any]


def _c(name: str, covers: str, error: type[Placements2JaxError], argument: str, call: Callable[[Any], Any]) -> Case:
    return Case(name, tuple(covers.split()), error, argument, call)


def _deprecated_call(function: Callable[..., Any], *args: Any) -> Any:
    with pytest.warns(DeprecationWarning, match="deprecated"):
        return function(*args)


def _enter_twice(e: Any) -> None:
    mode = placements2jax.CommDebugMode()
    with mode:
        mode.__enter__()


def _other_mesh_layout(e: Any) -> Layout:
    return Layout.from_device_mesh(e.mesh8)(("x", None))


def _out_sharding_on_another_mesh(e: Any) -> Any:
    """predict, inside ``jax.set_mesh`` of the 8-device mesh's Explicit copy, of an einsum
    whose ``out_sharding`` names that mesh's axis: not the inputs' (dp, tp) mesh."""
    square = distribute_tensor(np.ones((8, 8), np.float32), e.mesh, "S(0),R")
    with jax.set_mesh(e.mesh8.to_jax()):
        return predict(lambda a: jnp.einsum("ij,jk->ik", a, a, out_sharding=P("x", None)), square)


def _check_untyped_matmul_in_explicit_context(e: Any) -> Any:
    """check, inside ``jax.set_mesh`` of the Explicit mesh, of a matmul over a dim both
    operands split over tp: JAX's explicit typing asks for its ``out_sharding``."""
    a = distribute_tensor(np.ones((8, 4), np.float32), e.mesh, "R,S(1)")
    b = distribute_tensor(np.ones((4, 8), np.float32), e.mesh, "R,S(0)")
    with jax.set_mesh(e.mesh.to_jax()):
        return check(jnp.matmul, a, b)


def _refused_matmul_operands(e: Any) -> tuple[DTensor, DTensor]:
    """Two operands of a matmul over a dim both split over tp: inside ``jax.set_mesh`` of
    the Explicit mesh JAX's typing asks for its ``out_sharding``."""
    return (distribute_tensor(np.ones((8, 4), np.float32), e.mesh, "R,S(1)"),
            distribute_tensor(np.ones((4, 8), np.float32), e.mesh, "R,S(0)"))


def _apply_untyped_matmul_in_explicit_context(e: Any, execute: str) -> Any:
    """apply, inside ``jax.set_mesh`` of the Explicit mesh, of that matmul: XLA's
    executors trace it on JAX's types, which refuse it (a raw ShardingTypeError before)."""
    a, b = _refused_matmul_operands(e)
    with jax.set_mesh(e.mesh.to_jax()):
        return apply(jnp.matmul, a, b, execute=execute)


def _apply_inside_another_explicit_mesh(e: Any, execute: str) -> Any:
    """apply of a function on DTensors of the Explicit mesh inside jax.set_mesh of another
    Explicit mesh: JAX refuses fn's primitives there (a raw ValueError or KeyError before);
    "ops" (and "auto", which chooses it there) runs it."""
    with jax.set_mesh(init_device_mesh((8,), ("x",)).to_jax()):
        return apply(jnp.tanh, e.dt, execute=execute)


def _check_untyped_loop_in_explicit_context(e: Any) -> Any:
    """check, inside ``jax.set_mesh`` of the Explicit mesh, of that matmul accumulated in a
    ``fori_loop``: jax.jit of it is refused there; check compiled a rewrite of it before
    (the Partial inputs' workaround) and compared a program the user cannot compile."""
    a, b = _refused_matmul_operands(e)

    def accumulated(a: Any, b: Any) -> Any:
        return jax.lax.fori_loop(0, 2, lambda i, acc: acc + a @ b, jnp.zeros((8, 8), jnp.float32))

    with jax.set_mesh(e.mesh.to_jax()):
        return check(accumulated, a, b)


def _predict_ragged_dot_in_explicit_context(e: Any) -> Any:
    """predict, inside ``jax.set_mesh`` of the Explicit mesh, of ``lax.ragged_dot``: JAX
    (0.10.2) has no explicit-sharding rule for it (a raw NotImplementedError before)."""
    tokens = distribute_tensor(np.ones((8, 4), np.float32), e.mesh, "S(0),R")
    experts = distribute_tensor(np.ones((2, 4, 8), np.float32), e.mesh, "R,S(2)")
    with jax.set_mesh(e.mesh.to_jax()):
        return predict(jax.lax.ragged_dot, tokens, experts, np.array([4, 4], np.int32))


def _ckpt(e: Any) -> str:
    """A checkpoint of ``e.dt`` saved once per test session (step 0, leaf 'w')."""
    if not hasattr(e, "checkpoint"):
        e.checkpoint = tempfile.mkdtemp(prefix="p2j-bad-inputs-")
        placements2jax.save(e.checkpoint, {"w": e.dt}, step=0)
    return e.checkpoint


def _tiny_step(params: Any, x: Any) -> Any:
    return jax.tree.map(lambda w: w - 0.1 * x, params), jnp.sum(params["w"] * x)


def _locals(e: Any, make: Callable[[int], Any]) -> dict[int, Any]:
    return {r: make(r) for r in e.mesh.rank_list}


CASES: list[Case] = [
    # -- DeviceMesh ---------------------------------------------------------------------------------------
    _c("mesh: float ranks", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh([0.5, 1.5])),
    _c("mesh: ragged ranks", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh([[0, 1], [2]])),
    _c("mesh: duplicate rank", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh([[0, 1], [1, 2]])),
    _c("mesh: rank beyond the device count", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh([0, 8])),
    _c("mesh: negative rank", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh([-1, 0])),
    _c("mesh: bool ranks", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh([True, False])),
    _c("mesh: no ranks", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh([])),
    _c(
        "mesh: duplicate axis names",
        "DeviceMesh",
        MeshError,
        "mesh_dim_names",
        lambda e: DeviceMesh([[0, 1], [2, 3]], ("a", "a")),
    ),
    _c("mesh: too many names", "DeviceMesh", MeshError, "mesh_dim_names", lambda e: DeviceMesh([0, 1], ("a", "b"))),
    _c(
        "mesh: torch's form on another backend",
        "DeviceMesh",
        MeshError,
        "device_type",
        lambda e: DeviceMesh("tpu", [0, 1], mesh_dim_names=("dp",)),
    ),
    _c("mesh: unknown device type", "DeviceMesh", MeshError, "device_type", lambda e: DeviceMesh("mps", [0, 1])),
    _c("mesh: torch's form without ranks", "DeviceMesh", MeshError, "mesh", lambda e: DeviceMesh("cpu")),
    _c(
        "mesh: alias_name and axis_names differ",
        "DeviceMesh",
        MeshError,
        "axis_names",
        lambda e: DeviceMesh([0, 1], alias_name=("a",), axis_names=("b",)),
    ),
    _c("mesh: int axis name", "DeviceMesh", ArgumentTypeError, "mesh_dim_names", lambda e: DeviceMesh([0, 1], (1,))),
    _c("mesh: axis named None", "DeviceMesh", MeshError, "mesh_dim_names", lambda e: DeviceMesh([0, 1], "None")),
    _c(
        "mesh: torch names disagree",
        "DeviceMesh",
        MeshError,
        "mesh_dim_names",
        lambda e: DeviceMesh([0, 1], "a", mesh_dim_names="b"),
    ),
    _c(
        "mesh: unknown axis type",
        "DeviceMesh",
        MeshError,
        "axis_types",
        lambda e: DeviceMesh([0, 1], axis_types="manual"),
    ),
    _c("mesh: from_jax of a string", "DeviceMesh", ArgumentTypeError, "mesh", lambda e: DeviceMesh.from_jax("mesh")),
    _c("mesh: rank not in mesh", "DeviceMesh", MeshError, "rank", lambda e: e.mesh.get_coordinate(9)),
    _c("mesh: rank as string", "DeviceMesh", ArgumentTypeError, "rank", lambda e: e.mesh.get_coordinate("0")),
    _c("mesh: device of unknown rank", "DeviceMesh", MeshError, "rank", lambda e: e.mesh.device(99)),
    _c("mesh: unknown axis name", "DeviceMesh", MeshError, "axis", lambda e: e.mesh.get_local_rank("pp")),
    _c("mesh: axis index out of range", "DeviceMesh", MeshError, "axis", lambda e: e.mesh.size(2)),
    _c("mesh: group names an axis twice", "DeviceMesh", MeshError, "axis", lambda e: e.mesh.get_group(("dp", "dp"))),
    _c("mesh: group of a float", "DeviceMesh", ArgumentTypeError, "axis", lambda e: e.mesh.get_group(1.5)),
    _c("mesh: sub-mesh of unknown axis", "DeviceMesh", MeshError, "axis", lambda e: e.mesh["pp"]),
    _c("mesh: sub-mesh by index", "DeviceMesh", ArgumentTypeError, "names", lambda e: e.mesh.submesh([0])),
    _c("mesh: flatten to an int name", "DeviceMesh", ArgumentTypeError, "mesh_dim_names", lambda e: e.mesh.flatten(3)),
    _c(
        "mesh: ambiguous global shape",
        "DeviceMesh",
        ShapeError,
        "local_shape",
        lambda e: e.mesh.get_global_shape((3, 3), "S(0),R", rank=0),
    ),
    _c(
        "group: axis names as a string", "MeshGroup", ArgumentTypeError, "axis_names", lambda e: MeshGroup("dp", (0, 1))
    ),
    _c("group: float ranks", "MeshGroup", ArgumentTypeError, "ranks", lambda e: MeshGroup(("dp",), (0.0, 1.0))),
    # -- init_device_mesh / as_device_mesh --------------------------------------------------------------------
    _c(
        "init: more devices than JAX has",
        "init_device_mesh",
        MeshError,
        "mesh_shape",
        lambda e: init_device_mesh((4, 4)),
    ),
    _c("init: float size", "init_device_mesh", MeshError, "mesh_shape", lambda e: init_device_mesh((2.0, 4))),
    _c("init: zero size", "init_device_mesh", MeshError, "mesh_shape", lambda e: init_device_mesh((0,))),
    _c("init: an int shape", "init_device_mesh", ArgumentTypeError, "mesh_shape", lambda e: init_device_mesh(8)),
    _c(
        "init: torch call without shape",
        "init_device_mesh",
        ArgumentTypeError,
        "mesh_shape",
        lambda e: init_device_mesh("cpu"),
    ),
    _c(
        "init: too few torch names",
        "init_device_mesh",
        MeshError,
        "mesh_dim_names",
        lambda e: init_device_mesh((2, 4), mesh_dim_names=("a",)),
    ),
    _c(
        "as_device_mesh: a string", "as_device_mesh", ArgumentTypeError, "device_mesh", lambda e: as_device_mesh("mesh")
    ),
    # -- placements ----------------------------------------------------------------------------------------------
    _c("Shard: string dim", "Shard", ArgumentTypeError, "Shard.dim", lambda e: Shard("0")),
    _c("Shard: float dim", "Shard", ArgumentTypeError, "Shard.dim", lambda e: Shard(1.0)),
    _c("Partial: unknown op", "Partial", PlacementError, "Partial.reduce_op", lambda e: Partial("prod")),
    _c(
        "Placement: the bare base class",
        "Placement Replicate",
        ArgumentTypeError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)([Placement(), Replicate()]),
    ),
    _c("parse_placement: unknown", "parse_placement", PlacementError, "placement", lambda e: parse_placement("X")),
    _c("parse_placement: an int", "parse_placement", ArgumentTypeError, "placement", lambda e: parse_placement(3)),
    _c(
        "parse_placements: empty item",
        "parse_placements",
        PlacementError,
        "placements",
        lambda e: parse_placements("S(0),,R"),
    ),
    _c(
        "parse_placements: unknown op",
        "parse_placements",
        PlacementError,
        "Partial.reduce_op",
        lambda e: parse_placements("P(prod),R"),
    ),
    _c(
        "parse_placements: bytes",
        "parse_placements",
        ArgumentTypeError,
        "placements",
        lambda e: parse_placements(b"S(0)"),
    ),
    _c("parse_alias: unclosed group", "parse_alias", PlacementError, "placements", lambda e: parse_alias("(dp,")),
    _c("parse_alias: an int", "parse_alias", ArgumentTypeError, "placements", lambda e: parse_alias(1)),
    _c(
        "format_placements: a string",
        "format_placements",
        ArgumentTypeError,
        "placements",
        lambda e: format_placements("S(0)"),
    ),
    _c(
        "format_placements: ints",
        "format_placements",
        ArgumentTypeError,
        "placements",
        lambda e: format_placements([1, 2]),
    ),
    _c(
        "layout text: partial clause without 'partial'",
        "Layout",
        PlacementError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)("dp,None; tp=max"),
    ),
    _c(
        "layout text: unknown reduce op in the partial clause",
        "Layout",
        PlacementError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)("None,dp; partial tp=prod"),
    ),
    _c(
        "layout text: partial twice",
        "Layout",
        PlacementError,
        "partial",
        lambda e: Layout.from_device_mesh(e.mesh)("None,dp; partial tp=max", partial={"tp": "max"}),
    ),
    _c(
        "resolve_layout: a string rank",
        "resolve_layout",
        ArgumentTypeError,
        "shape",
        lambda e: resolve_layout(e.mesh, "R,R", "2"),
    ),
    _c(
        "resolve_layout: shape of strings",
        "resolve_layout",
        ShapeError,
        "shape",
        lambda e: resolve_layout(e.mesh, "S(0),R", ("8", 2)),
    ),
    _c(
        "resolve_layout: mesh is a list",
        "resolve_layout",
        ArgumentTypeError,
        "mesh",
        lambda e: resolve_layout([0, 1], "S(0)", 2),
    ),
    _c(
        "resolve_layout: shard_order with the alias form",
        "resolve_layout",
        PlacementError,
        "shard_order",
        lambda e: resolve_layout(e.mesh, (("dp", "tp"), None), 2, shard_order={0: (1, 0)}),
    ),
    _c(
        "resolve_layout: shard_order not a mapping",
        "resolve_layout",
        ArgumentTypeError,
        "shard_order",
        lambda e: resolve_layout(e.mesh, "S(0),S(0)", 2, shard_order=[(0, (1, 0))]),
    ),
    _c(
        "layout: deprecated replicated_on a string rank",
        "Layout",
        ArgumentTypeError,
        "ndim",
        lambda e: _deprecated_call(Layout.replicated_on, e.mesh, "2"),
    ),
    _c("format_alias: None", "format_alias", ArgumentTypeError, "entries", lambda e: format_alias(None)),
    _c("format_alias: int entry", "format_alias", ArgumentTypeError, "entries", lambda e: format_alias([1])),
    # -- Layout -------------------------------------------------------------------------------------------------------
    _c(
        "layout: mesh is a string",
        "Layout",
        ArgumentTypeError,
        "device_mesh",
        lambda e: Layout.from_device_mesh("mesh"),
    ),
    _c(
        "layout: placements of the wrong length",
        "Layout",
        PlacementError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)([Shard(0)]),
    ),
    _c(
        "layout: unknown axis name",
        "Layout",
        LayoutError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)(("pp", None)),
    ),
    _c(
        "layout: a StridedShard split factor no split order gives",
        "Layout StridedShard",
        PlacementError,
        "placements",
        lambda e: resolve_layout(e.mesh, [StridedShard(0, split_factor=3), Shard(0)], 2),
    ),
    _c("StridedShard: split factor 0", "StridedShard", ArgumentTypeError, "StridedShard.split_factor",
       lambda e: StridedShard(0, split_factor=0)),
    _c(
        "layout: a dim written negative and positive, with a split order per spelling",
        "Layout",
        PlacementError,
        "placements",
        lambda e: resolve_layout(e.mesh, [Shard(1), Shard(-1)], 2, shard_order={1: (0,), -1: (1,)}),
    ),
    _c(
        "layout: mixed Partial ops",
        "Layout",
        PlacementError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)([Partial(), Partial("max")]),
    ),
    _c(
        "layout: shard dim out of range",
        "Layout",
        PlacementError,
        "placements",
        lambda e: resolve_layout(e.mesh, [Shard(2), Replicate()], 2),
    ),
    _c(
        "layout: placements an int",
        "Layout",
        ArgumentTypeError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)(3),
    ),
    _c(
        "layout: alias axis used twice",
        "Layout",
        LayoutError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)(("dp", "dp")),
    ),
    _c(
        "layout: partial on unknown axis",
        "Layout",
        MeshError,
        "partial",
        lambda e: Layout.from_device_mesh(e.mesh)(("dp", None), partial={"pp": "sum"}),
    ),
    _c(
        "layout: partial with unknown op",
        "Layout",
        PlacementError,
        "partial",
        lambda e: Layout.from_device_mesh(e.mesh)(("dp", None), partial={"tp": "prod"}),
    ),
    _c(
        "layout: partial on a splitting axis",
        "Layout",
        LayoutError,
        "partial",
        lambda e: Layout.from_device_mesh(e.mesh)(("dp", None), partial={"dp": "sum"}),
    ),
    _c(
        "layout: mixed partial ops in partial=",
        "Layout",
        PlacementError,
        "partial",
        lambda e: Layout.from_device_mesh(e.mesh)((None,), partial={"dp": "sum", "tp": "max"}),
    ),
    _c(
        "layout: partial= with the torch form",
        "Layout",
        PlacementError,
        "partial",
        lambda e: Layout.from_device_mesh(e.mesh)("S(0),R", partial={"tp": "sum"}),
    ),
    _c(
        "layout: layout of another mesh",
        "Layout",
        LayoutError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)(_other_mesh_layout(e)),
    ),
    _c(
        "layout: tensor_map entry too big",
        "Layout",
        LayoutError,
        "tensor_map",
        lambda e: Layout.from_tensor_map(e.mesh, (5, -1)),
    ),
    _c(
        "layout: tensor_map a string",
        "Layout",
        ArgumentTypeError,
        "tensor_map",
        lambda e: Layout.from_tensor_map(e.mesh, "1,-1"),
    ),
    _c(
        "layout: -1 inside a tuple",
        "Layout",
        LayoutError,
        "tensor_map",
        lambda e: Layout.from_tensor_map(e.mesh, ((1, -1),)),
    ),
    _c(
        "layout: spec not a PartitionSpec",
        "Layout",
        ArgumentTypeError,
        "spec",
        lambda e: Layout.from_partition_spec(e.mesh, ("dp",)),
    ),
    _c(
        "layout: spec longer than ndim",
        "Layout",
        LayoutError,
        "ndim",
        lambda e: Layout.from_partition_spec(e.mesh, P("dp", "tp"), ndim=1),
    ),
    _c(
        "layout: spec ndim a string",
        "Layout",
        ArgumentTypeError,
        "ndim",
        lambda e: Layout.from_partition_spec(e.mesh, P("dp"), ndim="3"),
    ),
    _c(
        "layout: shard_order misses a mesh dim",
        "Layout",
        PlacementError,
        "shard_order",
        lambda e: Layout.from_device_mesh(e.mesh)([Shard(0), Shard(0)], shard_order={0: (0,)}),
    ),
    _c(
        "layout: shard_order unknown axis",
        "Layout",
        MeshError,
        "shard_order",
        lambda e: Layout.from_device_mesh(e.mesh)([Shard(0), Shard(0)], shard_order={0: ("dp", "pp")}),
    ),
    _c(
        "layout: shard_order entry an int",
        "Layout",
        ArgumentTypeError,
        "shard_order",
        lambda e: Layout.from_device_mesh(e.mesh)([Shard(0), Shard(0)], shard_order={0: 1}),
    ),
    _c(
        "layout: shard_order placements an int",
        "Layout",
        ArgumentTypeError,
        "placements",
        lambda e: Layout.from_device_mesh(e.mesh)(3, shard_order={}),
    ),
    _c("layout: bind to a negative ndim", "Layout", ArgumentTypeError, "ndim", lambda e: e.layout.bind(-1)),
    _c("layout: alias form bound to fewer dims", "Layout", LayoutError, "placements", lambda e: e.layout.bind(1)),
    _c("layout: negative extent", "Layout", ShapeError, "global_shape", lambda e: e.layout.local_shape((10, -2), 0)),
    _c("layout: float extent", "Layout", ShapeError, "global_shape", lambda e: e.layout.local_shape((10.0, 3), 0)),
    _c(
        "layout: shape of the wrong rank",
        "Layout",
        ShapeError,
        "global_shape",
        lambda e: e.layout.physical_shape((10,)),
    ),
    _c("layout: rank not in mesh", "Layout", MeshError, "rank", lambda e: e.layout.local_shape((10, 3), 9)),
    _c(
        "layout: unbound layout has no shapes",
        "Layout",
        LayoutError,
        "layout",
        lambda e: Layout.from_device_mesh(e.mesh)("S(0),R").local_shape((10, 3), 0),
    ),
    _c(
        "layout: local shapes no global shape gives",
        "Layout",
        ShapeError,
        "local_shape",
        lambda e: e.layout.global_shape_from_local({0: (2, 3), 1: (3, 3)}),
    ),
    _c("layout: no local shapes", "Layout", ShapeError, "local_shape", lambda e: e.layout.global_shape_from_local({})),
    _c(
        "layout: NamedSharding of Partial(max)",
        "Layout",
        LayoutError,
        "layout",
        lambda e: resolve_layout(e.mesh, "P(max),R", 2).named_sharding,
    ),
    _c("layout: pieces of a missing dim", "Layout", ShapeError, "dim", lambda e: e.layout.pieces(5)),
    _c("layout: split of a missing mesh dim", "Layout", MeshError, "mesh_dim", lambda e: e.layout.mesh_dim_split(2)),
    _c("layout: constructor mesh dim too big", "Layout", LayoutError, "dim_axes", lambda e: Layout(e.mesh, ((5,), ()))),
    _c("layout: constructor tables a string", "Layout", ArgumentTypeError, "dim_axes", lambda e: Layout(e.mesh, "ab")),
    _c(
        "layout: constructor unknown op",
        "Layout",
        PlacementError,
        "partial",
        lambda e: Layout(e.mesh, ((0,), ()), (None, "prod")),
    ),
    _c(
        "layout: constructor short partial",
        "Layout",
        LayoutError,
        "partial",
        lambda e: Layout(e.mesh, ((0,), ()), ("sum",)),
    ),
    _c(
        "layout: split factors a string",
        "Layout",
        ArgumentTypeError,
        "split_factors",
        lambda e: Layout(e.mesh, ((0,), ()), None, "41"),
    ),
    _c(
        "layout: split factor zero",
        "Layout",
        ArgumentTypeError,
        "split_factors",
        lambda e: Layout(e.mesh, ((0,), ()), None, (0, 1)),
    ),
    _c(
        "layout: split factors one per mesh dim, not tensor dim",
        "Layout",
        LayoutError,
        "split_factors",
        lambda e: Layout(e.mesh, ((0,), (), ()), None, (4, 1)),
    ),
    _c(
        "layout: split factor on a dim split by two mesh dims",
        "Layout",
        LayoutError,
        "split_factors",
        lambda e: Layout(e.mesh, ((0, 1), ()), None, (2, 1)),
    ),
    _c(
        "layout: split factor on an unsplit dim",
        "Layout",
        LayoutError,
        "split_factors",
        lambda e: Layout(e.mesh, ((0,), ()), None, (1, 2)),
    ),
    _c(
        "layout: strided shard of an uneven extent",
        "Layout",
        ShapeError,
        "global_shape",
        lambda e: resolve_layout(e.mesh, "_S(0, 4),R", 2).local_shape((20, 3), 0),
    ),
    _c(
        "layout: slices of a strided shard",
        "Layout",
        LayoutError,
        "layout",
        lambda e: resolve_layout(e.mesh, "_S(0, 4),R", 2).local_slices((32, 3), 0),
    ),
    _c(
        "layout: text strided shard with a zero factor",
        "Layout",
        PlacementError,
        "placement",
        lambda e: resolve_layout(e.mesh, "_S(0, 0),R", 2),
    ),
    _c(
        "layout: tensor_map of a strided shard",
        "Layout",
        LayoutError,
        "layout",
        lambda e: resolve_layout(e.mesh, "_S(0, 4),R", 2).tensor_map,
    ),
    _c(
        "layout: alias_map of a strided shard",
        "Layout",
        LayoutError,
        "layout",
        lambda e: resolve_layout(e.mesh, "_S(0, 4),R", 2).alias_map,
    ),
    _c(
        "layout: partition_spec of a strided shard",
        "Layout",
        LayoutError,
        "layout",
        lambda e: resolve_layout(e.mesh, "_S(0, 4),R", 2).partition_spec,
    ),
    _c(
        "infer_signature: strided input of an uneven extent",
        "infer_signature",
        ShapeError,
        "inputs[0]",
        lambda e: infer_signature("neg", [((20, 3), F32, resolve_layout(e.mesh, "_S(0, 4),R", 2))]),
    ),
    _c(
        "check: a strided input (JAX has no sharding for it)",
        "check",
        LayoutError,
        "layout",
        lambda e: check(jnp.sin, distribute_tensor(np.zeros((32, 4), np.float32), e.mesh, "_S(0, 4),R")),
    ),
    # -- distribute_tensor -----------------------------------------------------------------------------------------------
    _c(
        "distribute: a string",
        "distribute_tensor",
        ArgumentTypeError,
        "tensor",
        lambda e: distribute_tensor("abc", e.mesh),
    ),
    _c("distribute: None", "distribute_tensor", ArgumentTypeError, "tensor", lambda e: distribute_tensor(None, e.mesh)),
    _c(
        "distribute: ragged lists",
        "distribute_tensor",
        ArgumentTypeError,
        "tensor",
        lambda e: distribute_tensor([[1, 2], [3]], e.mesh),
    ),
    _c(
        "distribute: a DTensor",
        "distribute_tensor",
        ArgumentTypeError,
        "tensor",
        lambda e: distribute_tensor(e.dt, e.mesh),
    ),
    _c(
        "distribute: mesh a string",
        "distribute_tensor",
        ArgumentTypeError,
        "device_mesh",
        lambda e: distribute_tensor(e.x, "mesh"),
    ),
    _c(
        "distribute: shard dim out of range",
        "distribute_tensor",
        PlacementError,
        "placements",
        lambda e: distribute_tensor(e.x, e.mesh, [Shard(2), Replicate()]),
    ),
    _c(
        "distribute: placements of the wrong length",
        "distribute_tensor",
        PlacementError,
        "placements",
        lambda e: distribute_tensor(e.x, e.mesh, "S(0)"),
    ),
    _c(
        "distribute: shard a scalar",
        "distribute_tensor",
        PlacementError,
        "placements",
        lambda e: distribute_tensor(np.float32(1), e.mesh, "S(0),R"),
    ),
    _c(
        "distribute: int64 beyond int32",
        "distribute_tensor",
        ArgumentTypeError,
        "tensor",
        lambda e: distribute_tensor(np.array([2**40, 1]), e.mesh8),
    ),
    _c(
        "distribute: float64 overflowing float32",
        "distribute_tensor",
        ArgumentTypeError,
        "tensor",
        lambda e: distribute_tensor(np.array([1e300, 1.0]), e.mesh8),
    ),
    _c(
        "distribute: Partial(sum) of bools",
        "distribute_tensor",
        PlacementError,
        "placements",
        lambda e: distribute_tensor(e.x > 0, e.mesh8, [Partial()]),
    ),
    _c(
        "distribute: Partial(max) of complex",
        "distribute_tensor",
        PlacementError,
        "placements",
        lambda e: distribute_tensor(e.x.astype(np.complex64), e.mesh8, [Partial("max")]),
    ),
    _c(
        "distribute: PRNG keys split",
        "distribute_tensor",
        PlacementError,
        "placements",
        lambda e: distribute_tensor(jax.random.split(jax.random.key(0), 8), e.mesh8, [Shard(0)]),
    ),
    _c(
        "redistribute: PRNG keys to Partial",
        "DTensor",
        PlacementError,
        "placements",
        lambda e: distribute_tensor(jax.random.key(0), e.mesh8).redistribute(placements=[Partial()]),
    ),
    _c(
        "distribute: mesh mixing axis types",
        "distribute_tensor",
        MeshError,
        "device_mesh",
        lambda e: distribute_tensor(e.x, DeviceMesh([[0, 1], [2, 3]], ("a", "b"), axis_types=("explicit", "auto"))),
    ),
    _c(
        "redistribute: to a mesh mixing axis types",
        "DTensor",
        MeshError,
        "device_mesh",
        lambda e: e.dt8.redistribute(DeviceMesh([[0, 1], [2, 3]], ("a", "b"), axis_types=("auto", "explicit"))),
    ),
    # -- DTensor.from_local --------------------------------------------------------------------------------------------------
    _c(
        "from_local: dtypes differ between ranks",
        "DTensor",
        ShapeError,
        "local_tensor",
        lambda e: DTensor.from_local(
            _locals(e, lambda r: np.zeros((3, 3), np.float32 if r == 5 else np.int32)), e.mesh, "S(0),R"
        ),
    ),
    _c(
        "from_local: ndims differ between ranks",
        "DTensor",
        ShapeError,
        "local_tensor",
        lambda e: DTensor.from_local(_locals(e, lambda r: np.zeros((3,) if r == 2 else (3, 3))), e.mesh, "S(0),R"),
    ),
    _c(
        "from_local: shapes differ along a replicated dim",
        "DTensor",
        ShapeError,
        "local_tensor",
        lambda e: DTensor.from_local(_locals(e, lambda r: np.zeros((3, 3 + r % 2))), e.mesh, "S(0),R"),
    ),
    _c(
        "from_local: local shapes no global shape gives",
        "DTensor",
        ShapeError,
        "local_tensor",
        lambda e: DTensor.from_local(_locals(e, lambda r: np.zeros((1 if r < 2 else 3, 3))), e.mesh, "S(0),R"),
    ),
    _c(
        "from_local: local shapes inconsistent with shape=",
        "DTensor",
        ShapeError,
        "local_tensor",
        lambda e: DTensor.from_local(np.zeros((3, 3)), e.mesh, "S(0),R", shape=(11, 3)),
    ),
    _c(
        "from_local: shape= a string",
        "DTensor",
        ArgumentTypeError,
        "shape",
        lambda e: DTensor.from_local(np.zeros((3, 3)), e.mesh, "S(0),R", shape="10,3"),
    ),
    _c(
        "from_local: shape= of the wrong rank",
        "DTensor",
        ShapeError,
        "shape",
        lambda e: DTensor.from_local(np.zeros((3, 3)), e.mesh, "S(0),R", shape=(10,)),
    ),
    _c(
        "from_local: a rank missing",
        "DTensor",
        MeshError,
        "local_tensor",
        lambda e: DTensor.from_local({r: np.zeros((3, 3)) for r in range(7)}, e.mesh, "S(0),R"),
    ),
    _c(
        "from_local: a rank beyond the mesh",
        "DTensor",
        MeshError,
        "local_tensor",
        lambda e: DTensor.from_local({r: np.zeros((3, 3)) for r in range(9)}, e.mesh, "S(0),R"),
    ),
    _c(
        "from_local: a string key",
        "DTensor",
        ArgumentTypeError,
        "local_tensor",
        lambda e: DTensor.from_local({"a": np.zeros(2)}, e.mesh),
    ),
    _c(
        "from_local: too few arrays",
        "DTensor",
        ShapeError,
        "local_tensor",
        lambda e: DTensor.from_local([np.zeros((3, 3))] * 3, e.mesh, "S(0),R"),
    ),
    _c(
        "from_local: a string",
        "DTensor",
        ArgumentTypeError,
        "local_tensor",
        lambda e: DTensor.from_local("abc", e.mesh),
    ),
    _c(
        "from_local: a non-array rank",
        "DTensor",
        ArgumentTypeError,
        "local_tensor[3]",
        lambda e: DTensor.from_local(_locals(e, lambda r: "x" if r == 3 else np.zeros(2)), e.mesh),
    ),
    _c(
        "from_local: mesh None",
        "DTensor",
        ArgumentTypeError,
        "device_mesh",
        lambda e: DTensor.from_local(np.zeros(2), None),
    ),
    _c(
        "from_local: mixed Partial ops",
        "DTensor",
        PlacementError,
        "placements",
        lambda e: DTensor.from_local(np.zeros(2), e.mesh, [Partial(), Partial("min")]),
    ),
    _c(
        "from_local: int64 beyond int32",
        "DTensor",
        ArgumentTypeError,
        "local_tensor",
        lambda e: DTensor.from_local(np.array([2**33]), e.mesh8),
    ),
    _c(
        "from_local: Partial(avg) of bools",
        "DTensor",
        PlacementError,
        "placements",
        lambda e: DTensor.from_local(np.ones(2, bool), e.mesh8, "P(avg)"),
    ),
    # -- DTensor constructor, to_local, redistribute ----------------------------------------------------------------------
    _c("DTensor: a NumPy array", "DTensor", ArgumentTypeError, "array", lambda e: DTensor(e.x, e.layout, (10, 3))),
    _c(
        "DTensor: layout a string",
        "DTensor",
        ArgumentTypeError,
        "layout",
        lambda e: DTensor(e.dt.array, "S(0),R", (10, 3)),
    ),
    _c(
        "DTensor: shape a string",
        "DTensor",
        ArgumentTypeError,
        "shape",
        lambda e: DTensor(e.dt.array, e.layout, "10,3"),
    ),
    _c(
        "DTensor: array of another shape",
        "DTensor",
        ShapeError,
        "array",
        lambda e: DTensor(e.dt.array, e.layout, (4, 3)),
    ),
    _c("to_local: rank not in mesh", "DTensor", MeshError, "rank", lambda e: e.dt.to_local(99)),
    _c("to_local: rank a float", "DTensor", ArgumentTypeError, "rank", lambda e: e.dt.to_local(1.0)),
    _c("to_local: inside jit", "DTensor", ArgumentTypeError, "self", lambda e: jax.jit(lambda d: d.to_local(0))(e.dt)),
    _c("astype: not a dtype", "DTensor", InferenceError, "params", lambda e: e.dt.astype("notadtype")),
    _c(
        "redistribute: Shard -> Partial",
        "DTensor",
        RedistributeError,
        "placements",
        lambda e: e.dt.redistribute(placements=[Partial(), Replicate()]),
    ),
    _c(
        "redistribute: Partial(sum) -> Partial(max)",
        "DTensor",
        RedistributeError,
        "placements",
        lambda e: e.dtp.redistribute(placements=[Partial("max"), Replicate()]),
    ),
    _c(
        "redistribute: Partial(max) -> Partial(avg) in alias form",
        "DTensor",
        RedistributeError,
        "placements",
        lambda e: e.dtm.redistribute(placements=Layout.from_device_mesh(e.mesh)((None, None), partial={"dp": "avg"})),
    ),
    _c(
        "redistribute: mesh a string",
        "DTensor",
        ArgumentTypeError,
        "device_mesh",
        lambda e: e.dt.redistribute("mesh", [Replicate(), Replicate()]),
    ),
    _c(
        "redistribute: placements of the wrong length",
        "DTensor",
        PlacementError,
        "placements",
        lambda e: e.dt.redistribute(placements=[Replicate()]),
    ),
    _c(
        "redistribute: placements an int",
        "DTensor",
        ArgumentTypeError,
        "placements",
        lambda e: e.dt.redistribute(placements=5),
    ),
    _c(
        "redistribute: unknown axis",
        "DTensor",
        LayoutError,
        "placements",
        lambda e: e.dt.redistribute(placements=("pp", None)),
    ),
    _c(
        "redistribute: shard dim out of range",
        "DTensor",
        PlacementError,
        "placements",
        lambda e: e.dtp.redistribute(placements="R,S(5)"),
    ),
    _c(
        "redistribute: bools to Partial(sum)",
        "DTensor",
        PlacementError,
        "placements",
        lambda e: e.dtb.redistribute(placements="P"),
    ),
    _c(
        "redistribute: complex to Partial(min)",
        "DTensor",
        PlacementError,
        "placements",
        lambda e: e.dtc.redistribute(placements="P(min)"),
    ),
    _c(
        "redistribute_collectives: Shard -> Partial",
        "redistribute_collectives",
        RedistributeError,
        "placements",
        lambda e: redistribute_collectives(e.dt8, [Partial()]),
    ),
    _c(
        "redistribute_collectives: another mesh",
        "redistribute_collectives",
        MeshError,
        "device_mesh",
        lambda e: redistribute_collectives(e.dt, "R,R", e.mesh8),
    ),
    _c(
        "redistribute_collectives: not a DTensor",
        "redistribute_collectives",
        ArgumentTypeError,
        "dtensor",
        lambda e: redistribute_collectives(e.x, "R,R"),
    ),
    _c(
        "Collective: unknown opcode",
        "Collective",
        ArgumentTypeError,
        "op",
        lambda e: Collective("broadcast", ((4,),), "f32", ((0, 1),)),
    ),
    _c(
        "Collective: shapes as lists",
        "Collective",
        ArgumentTypeError,
        "result_shapes",
        lambda e: Collective("all-gather", [[4]], "f32", ((0, 1),)),
    ),
    _c(
        "Collective: op_name not a string",
        "Collective",
        ArgumentTypeError,
        "op_name",
        lambda e: Collective("all-gather", ((4,),), "f32", ((0, 1),), op_name=None),
    ),
    # -- comm_debug ----
    _c(
        "comm_debug: print_table to a path",
        "comm_debug",
        ArgumentTypeError,
        "file",
        lambda e: placements2jax.comm_debug().print_table("out.txt"),
    ),
    _c("CommDebugMode: entered twice", "CommDebugMode", ArgumentTypeError, "comm_debug", _enter_twice),
    # -- DTensor operators and apply ----------------------------------------------------------------------------------------
    _c("operator: DTensors on two meshes", "DTensor", InferenceError, "operands", lambda e: e.dt + e.dt8),
    _c(
        "operator: shapes that do not broadcast",
        "DTensor",
        InferenceError,
        "params",
        lambda e: e.dt + distribute_tensor(np.ones((4, 4), np.int32), e.mesh),
    ),
    _c("operator: matmul dims disagree", "DTensor", InferenceError, "params", lambda e: e.dt @ e.dt),
    _c("operator: sum over a missing axis", "DTensor", InferenceError, "params", lambda e: e.dt.sum(axis=5)),
    _c("operator: sum over a string axis", "DTensor", ArgumentTypeError, "axis", lambda e: e.dt.sum(axis="0")),
    _c("operator: keepdims a string", "DTensor", ArgumentTypeError, "keepdims", lambda e: e.dt.max(keepdims="yes")),
    _c("operator: torch's keepdim a string", "DTensor", ArgumentTypeError, "keepdim", lambda e: e.dt.sum(keepdim="no")),
    _c("operator: torch's dim a string", "DTensor", ArgumentTypeError, "dim", lambda e: e.dt.mean(dim="0")),
    _c("operator: both dim and axis", "DTensor", ArgumentTypeError, "dim", lambda e: e.dt.sum(axis=0, dim=0)),
    _c("argmax: several dims", "DTensor", ArgumentTypeError, "axis", lambda e: e.dt.argmax(axis=(0, 1))),
    _c("argmin: torch's dim a float", "DTensor", ArgumentTypeError, "dim", lambda e: e.dt.argmin(dim=1.0)),
    _c("argmax: both dim and axis", "DTensor", ArgumentTypeError, "dim", lambda e: e.dt.argmax(0, dim=0)),
    _c("argmin: keepdim a string", "DTensor", ArgumentTypeError, "keepdim", lambda e: e.dt.argmin(0, keepdim="no")),
    _c(
        "operator: both keepdim and keepdims",
        "DTensor",
        ArgumentTypeError,
        "keepdim",
        lambda e: e.dt.min(0, keepdims=True, keepdim=True),
    ),
    _c("operator: transpose repeats an axis", "DTensor", InferenceError, "params", lambda e: e.dt.transpose(0, 0)),
    _c("operator: reshape to another size", "DTensor", InferenceError, "params", lambda e: e.dt.reshape(7)),
    _c("operator: negate bools", "DTensor", InferenceError, "params", lambda e: -e.dtb),
    _c(  # predict / check / apply take such a DTensor as None (tests/test_frameworks.py); an operand holds an array
        "operator: a DTensor eqx.partition emptied",
        "DTensor",
        ArgumentTypeError,
        "operands[0]",
        lambda e: eqx.partition({"w": e.dt}, {"w": False})[0]["w"] * 2,
    ),
    _c("apply: fn not callable", "apply", ArgumentTypeError, "fn", lambda e: apply(3, e.dt)),
    _c("apply: fn fails to trace", "apply", InferenceError, "fn", lambda e: apply(lambda a: a @ a, e.dt)),
    _c("apply: no DTensor operand", "apply", InferenceError, "args", lambda e: apply(jnp.sin, e.x)),
    _c("apply: DTensors on two meshes", "apply", InferenceError, "args", lambda e: apply(jnp.add, e.dt, e.dt8)),
    # -- inference ------------------------------------------------------------------------------------------------------------
    _c(
        "infer: unknown op",
        "infer_signature Signature",
        UnsupportedOpError,
        "op",
        lambda e: infer_signature("frobnicate", [e.dt]),
    ),
    _c("infer: op an int", "infer_signature", ArgumentTypeError, "op", lambda e: infer_signature(3, [e.dt])),
    _c("infer: unknown search", "infer_signature", ArgumentTypeError, "search",
       lambda e: infer_signature("neg", [e.dt], search="eager")),
    _c(
        "infer: inputs not a list",
        "infer_signature",
        ArgumentTypeError,
        "inputs",
        lambda e: infer_signature("neg", e.dt),
    ),
    _c(
        "infer: axis out of range",
        "infer_signature",
        InferenceError,
        "params",
        lambda e: infer_signature("sum", [e.dt], axis=5),
    ),
    _c(
        "infer: matmul dims disagree",
        "infer_signature",
        InferenceError,
        "params",
        lambda e: infer_signature("matmul", [e.dt, e.dt]),
    ),
    _c(
        "infer: input a string",
        "infer_signature",
        ArgumentTypeError,
        "inputs[0]",
        lambda e: infer_signature("neg", ["abc"]),
    ),
    _c(
        "infer: dtype not a dtype",
        "infer_signature",
        ArgumentTypeError,
        "inputs[0]",
        lambda e: infer_signature("neg", [((10, 3), "notadtype", e.layout)]),
    ),
    _c(
        "infer: layout for another ndim",
        "infer_signature",
        LayoutError,
        "inputs[0]",
        lambda e: infer_signature("neg", [((10, 3, 1), F32, e.layout)]),
    ),
    _c(
        "infer: two out_layouts for one output",
        "infer_signature",
        InferenceError,
        "out_layouts",
        lambda e: infer_signature("neg", [e.dt], out_layouts=[e.layout, e.layout]),
    ),
    _c(
        "infer: out_layouts an int",
        "infer_signature",
        ArgumentTypeError,
        "out_layouts",
        lambda e: infer_signature("neg", [e.dt], out_layouts=3),
    ),
    _c(
        "infer: in_layouts an int",
        "infer_signature",
        ArgumentTypeError,
        "in_layouts",
        lambda e: infer_signature("neg", [e.dt], in_layouts=3),
    ),
    _c(
        "infer: inputs on two meshes",
        "infer_signature",
        InferenceError,
        "inputs",
        lambda e: infer_signature("add", [e.dt, e.dt8]),
    ),
    _c(
        "infer: cost model a string",
        "infer_signature",
        ArgumentTypeError,
        "cost_model",
        lambda e: infer_signature("neg", [e.dt], cost_model="fast"),
    ),
    _c("predict: fn not callable", "predict", InferenceError, "fn", lambda e: predict(3, e.dt)),
    _c("predict: unknown search", "predict", InferenceError, "search", lambda e: predict(jnp.sin, e.dt, search="dfs")),
    _c("predict: fn fails to trace", "predict", InferenceError, "fn", lambda e: predict(lambda a: a @ a, e.dt)),
    _c(
        "predict: a shard_map over a mesh with Explicit axes",
        "predict",
        InferenceError,
        "fn",
        lambda e: predict(
            lambda a: jax.shard_map(
                lambda b: b, mesh=e.mesh.to_jax(), in_specs=P("dp", "tp"), out_specs=P("dp", "tp")
            )(a),
            ((8, 4), F32, e.layout),
        ),
    ),
    _c(
        "predict: an einsum's out_sharding on another mesh than the inputs'",
        "predict",
        InferenceError,
        "out_sharding",
        _out_sharding_on_another_mesh,
    ),
    _c(
        "predict: with_sharding_constraint on another mesh than the inputs'",
        "predict",
        InferenceError,
        "sharding",
        lambda e: predict(
            lambda a: jax.lax.with_sharding_constraint(
                a, NamedSharding(init_device_mesh((2, 4), ("a", "b"), axis_types="auto").to_jax(), P("a", None))),
            ((8, 8), F32, e.layout),
        ),
    ),
    _c(
        "predict: with_sharding_constraint to one device",
        "predict",
        UnsupportedOpError,
        "sharding",
        lambda e: predict(
            lambda a: jax.lax.with_sharding_constraint(a, jax.sharding.SingleDeviceSharding(jax.devices()[0])), e.dt
        ),
    ),
    _c(
        "check: inside set_mesh of the Explicit mesh, a matmul JAX's typing refuses",
        "check",
        InferenceError,
        "inputs",
        _check_untyped_matmul_in_explicit_context,
    ),
    _c(
        "check: inside set_mesh of the Explicit mesh, a loop of a matmul JAX's typing refuses",
        "check",
        InferenceError,
        "inputs",
        _check_untyped_loop_in_explicit_context,
    ),
    _c(
        "apply: inside set_mesh of the Explicit mesh, a matmul JAX's typing refuses (xla)",
        "apply",
        InferenceError,
        "fn",
        lambda e: _apply_untyped_matmul_in_explicit_context(e, "xla"),
    ),
    _c(
        "apply: inside set_mesh of the Explicit mesh, a matmul JAX's typing refuses (pinned)",
        "apply",
        InferenceError,
        "fn",
        lambda e: _apply_untyped_matmul_in_explicit_context(e, "pinned"),
    ),
    *(_c(
        f"apply: inside set_mesh of another Explicit mesh ({execute})",
        "apply",
        InferenceError,
        "execute",
        lambda e, execute=execute: _apply_inside_another_explicit_mesh(e, execute),
    ) for execute in ("xla", "pinned")),
    _c(
        "predict: inside set_mesh of the Explicit mesh, ragged_dot, which JAX's typing refuses",
        "predict",
        InferenceError,
        "fn",
        _predict_ragged_dot_in_explicit_context,
    ),
    _c(
        "predict: combined for an unknown backend",
        "predict",
        InferenceError,
        "backend",
        lambda e: predict(lambda a: a.sum(), e.dt).combined("metal"),
    ),
    _c(
        "predict: planned_collectives for an unknown backend",
        "predict",
        InferenceError,
        "backend",
        lambda e: predict(lambda a: a.sum(), e.dt).planned_collectives("metal"),
    ),
    _c(
        "predict: combined for a backend that is not a name",
        "predict",
        InferenceError,
        "backend",
        lambda e: predict(lambda a: a.sum(), e.dt).combined(["gpu"]),
    ),
    _c("predict: no inputs and no mesh", "predict", InferenceError, "inputs", lambda e: predict(lambda: jnp.ones(3))),
    _c(
        "predict: mesh a string",
        "predict",
        ArgumentTypeError,
        "mesh",
        lambda e: predict(jnp.sin, ((8,), F32, ("x",)), mesh="m"),
    ),
    _c(
        "predict: out_layouts not a prefix of the outputs",
        "predict",
        InferenceError,
        "out_layouts",
        lambda e: predict(lambda a: (a, a), e.dt, out_layouts=(None, None, None)),
    ),
    _c(
        "predict: out_layouts on another mesh",
        "predict",
        InferenceError,
        "out_layouts[0]",
        lambda e: predict(jnp.sin, e.dt, out_layouts=e.dt8),
    ),
    _c(
        "predict: unknown on_unknown",
        "predict",
        InferenceError,
        "on_unknown",
        lambda e: predict(jnp.sin, e.dt, on_unknown="skip"),
    ),
    _c(
        "predict: pytree leaf not a tensor",
        "predict",
        ArgumentTypeError,
        "inputs[0]['f']",
        lambda e: predict(lambda d: d["x"], {"x": e.dt, "f": "text"}),
    ),
    _c(
        "predict: primitive without a rule",
        "predict",
        UnsupportedOpError,
        "primitive",
        lambda e: predict(lambda a: jax.lax.composite(jnp.sin, name="my.sin")(a), e.dt),  # no rule
    ),
    _c(
        "predict: a DTensor whose array a tree.map reshaped",
        "predict",
        ShapeError,
        "inputs[0]['w']",
        lambda e: predict(lambda d: d["w"], jax.tree.map(lambda a: a.sum(0), {"w": e.dt})),
    ),
    _c(
        "apply: a DTensor whose array a tree.map reshaped",
        "apply",
        ShapeError,
        "args[0]['w']",
        lambda e: apply(lambda d: d["w"] * 2, jax.tree.map(lambda a: a.sum(0), {"w": e.dt})),
    ),
    _c(
        "apply: a DTensor holding a Python number a tree.map returned (a raw AttributeError before)",
        "apply",
        ArgumentTypeError,
        "args[0]['w']",
        lambda e: apply(lambda d: d["w"] * 2, jax.tree.map(lambda a: 2.0, {"w": e.dt})),
    ),
    _c(
        "predict: a DTensor holding a Python number a tree.map returned",
        "predict",
        ArgumentTypeError,
        "inputs[0]['w']",
        lambda e: predict(lambda d: d["w"] * 2, jax.tree.map(lambda a: 2.0, {"w": e.dt})),
    ),
    _c(
        "apply: pytree leaf not a tensor",
        "apply",
        ArgumentTypeError,
        "args[0]['f']",
        lambda e: apply(lambda d: d["x"], {"x": e.dt, "f": "text"}),
    ),
    _c(
        "apply: an Equinox module's unhashable non-array leaf",
        "apply",
        ArgumentTypeError,
        "args[0].activation",
        lambda e: apply(lambda m: m.w, _EqxActivated(e.dt, bytearray(b"gelu"))),
    ),
    _c(
        "check: an Equinox module's unhashable non-array leaf",
        "check",
        ArgumentTypeError,
        "inputs[0].activation",
        lambda e: check(lambda m: m.w, _EqxActivated(e.dt, bytearray(b"gelu"))),
    ),
    _c(
        "apply: fn not hashable (an Equinox transform's wrapper)",
        "apply",
        ArgumentTypeError,
        "fn",
        lambda e: apply(eqx.filter_value_and_grad(lambda a: (a * a).sum()), e.dt),
    ),
    _c(
        "distribute_pytree: a plan splitting a PRNG key array",
        "distribute_pytree",
        PlanError,
        "plan",
        lambda e: distribute_pytree({"key": jax.random.split(jax.random.key(0), 8)}, e.mesh8, {"key": "S(0)"}),
    ),
    _c(
        "apply: out_layouts leaf neither a layout nor an input",
        "apply",
        ArgumentTypeError,
        "out_layouts",
        lambda e: apply(jnp.sin, e.dt, out_layouts=[{1, 2}]),
    ),
    _c(  # an array stands for the layout of an input it is (kept by the output): here of other dims than the output
        "apply: out_layouts an array of other dims than its output",
        "apply",
        LayoutError,
        "out_layouts[0]",
        lambda e: apply(jnp.sin, e.dt, out_layouts=np.zeros(2)),
    ),
    _c(
        "apply: unhashable keyword argument",
        "apply",
        ArgumentTypeError,
        "scale",
        lambda e: apply(lambda a, scale: a * len(scale), e.dt, scale=bytearray(b"ab")),
    ),
    _c(
        "apply: unknown execute",
        "apply",
        InferenceError,
        "execute",
        lambda e: apply(jnp.sin, e.dt, execute="fast"),
    ),
    _c(
        "apply: unknown on_unknown",
        "apply",
        InferenceError,
        "on_unknown",
        lambda e: apply(jnp.sin, e.dt, on_unknown="skip"),
    ),
    _c(
        "apply: a Partial operand of a function calling pure_callback on an Explicit mesh",
        "apply",
        UnsupportedOpError,
        "args",
        lambda e: apply(lambda a: jax.pure_callback(np.negative, jax.ShapeDtypeStruct(a.shape, a.dtype), a), e.dtp),
    ),
    _c(
        "check: a host callback of a value computed from a Partial input (XLA would abort the process)",
        "check",
        InferenceError,
        "inputs",
        lambda e: check(lambda a: jax.pure_callback(np.negative, jax.ShapeDtypeStruct(a.shape, a.dtype), a * 2),
                        distribute_tensor(np.ones((4, 2), F32), e.mesh, [Partial(), Shard(1)])),
    ),
    _c(
        "apply: under jax.jit, a function calling pure_callback on an Explicit mesh",
        "apply",
        UnsupportedOpError,
        "fn",
        lambda e: jax.jit(lambda d: apply(lambda a: jax.pure_callback(
            np.negative, jax.ShapeDtypeStruct(a.shape, a.dtype), a), d))(e.dt),
    ),
    _c(
        "apply: execute not a name",
        "apply",
        InferenceError,
        "execute",
        lambda e: apply(jnp.sin, e.dt, execute=None),
    ),
    _c(
        "apply: execute='xla' of what XLA cannot compile (an integer reduce_and over a split dim on CPU)",
        "apply",
        UnsupportedOpError,
        "execute",
        lambda e: apply(lambda a: jax.lax.reduce_and(a.astype(jnp.int32), (0, 1)), e.dt, execute="xla"),
    ),
    _c(
        "apply: a loop whose body has no rule",
        "apply",
        UnsupportedOpError,
        "primitive",
        lambda e: apply(
            lambda a: jax.lax.fori_loop(
                0, 2, lambda i, x: x + jax.lax.composite(jnp.sin, name="my.sin")(x).astype(x.dtype), a
            ), e.dt
        ),
    ),
    _c(
        "check: out_layouts not a prefix of the outputs",
        "check",
        InferenceError,
        "out_layouts",
        lambda e: check(lambda a: a * 2, ((8, 16), F32, ("x", None)), mesh=e.mesh8, out_layouts=("R", "R")),
    ),
    _c("check: uneven input", "check", InferenceError, "inputs[0]", lambda e: check(jnp.sin, e.dt)),
    _c(
        "check: unknown policy",
        "check",
        ArgumentTypeError,
        "policy",
        lambda e: check(lambda a: a * 2, ((8, 16), F32, ("x", None)), mesh=e.mesh8, policy="fastest"),
    ),
    _c("predict: unknown policy", "predict", ArgumentTypeError, "policy", lambda e: predict(jnp.sin, e.dt, policy=3)),
    _c(
        "predict: cost model a string",
        "predict",
        ArgumentTypeError,
        "cost_model",
        lambda e: predict(jnp.sin, e.dt, cost_model="fast"),
    ),
    _c(
        "check: unknown search",
        "check",
        InferenceError,
        "search",
        lambda e: check(lambda a: a * 2, ((8, 16), F32, ("x", None)), mesh=e.mesh8, search="dfs"),
    ),
    _c(
        "check: unknown on_unknown",
        "check",
        InferenceError,
        "on_unknown",
        lambda e: check(lambda a: a * 2, ((8, 16), F32, ("x", None)), mesh=e.mesh8, on_unknown="skip"),
    ),
    _c(
        "check: mesh a string",
        "check",
        ArgumentTypeError,
        "mesh",
        lambda e: check(lambda a: a * 2, ((8, 16), F32, ("x", None)), mesh="m"),
    ),
    _c(
        "check: cost model a string",
        "check",
        ArgumentTypeError,
        "cost_model",
        lambda e: check(lambda a: a * 2, ((8, 16), F32, ("x", None)), mesh=e.mesh8, cost_model="fast"),
    ),
    _c("check: Partial(max) input", "check", InferenceError, "inputs[0]", lambda e: check(jnp.sin, e.dtm)),
    _c(
        "check: product of two Partial(sum) inputs",
        "check",
        InferenceError,
        "inputs",
        lambda e: check(lambda a: a * a, ((8, 16), F32, "S(0),P"), mesh=e.mesh),
    ),
    _c(
        "check: fn fails to trace",
        "check",
        InferenceError,
        "fn",
        lambda e: check(lambda a: a @ a, ((8, 16), F32, ("x", None)), mesh=e.mesh8),
    ),
    _c(
        "plan: dst not a Layout",
        "plan_redistribute",
        RedistributeError,
        "dst",
        lambda e: plan_redistribute((10, 3), F32, e.layout, "S(0),R"),
    ),
    _c(
        "plan: src not a Layout",
        "plan_redistribute",
        ArgumentTypeError,
        "layout",
        lambda e: plan_redistribute((10, 3), F32, "S(0),R", e.layout),
    ),
    _c(
        "plan: shape of the wrong rank",
        "plan_redistribute",
        LayoutError,
        "layout",
        lambda e: plan_redistribute((10,), F32, e.layout, e.layout),
    ),
    _c(
        "plan: shape a string",
        "plan_redistribute",
        ShapeError,
        "shape",
        lambda e: plan_redistribute("10,3", F32, e.layout, e.layout),
    ),
    _c(
        "plan: dtype not a dtype",
        "plan_redistribute",
        ArgumentTypeError,
        "dtype",
        lambda e: plan_redistribute((10, 3), "xx", e.layout, e.layout),
    ),
    _c(
        "plan: object dtype",
        "plan_redistribute",
        ArgumentTypeError,
        "dtype",
        lambda e: plan_redistribute((10, 3), object, e.layout, e.layout),
    ),
    _c(
        "plan: layouts on two meshes",
        "plan_redistribute",
        RedistributeError,
        "dst",
        lambda e: plan_redistribute((10, 3), F32, e.layout, _other_mesh_layout(e)),
    ),
    _c(
        "CostModel: NaN weight",
        "CostModel",
        ArgumentTypeError,
        "axis_weights",
        lambda e: CostModel({"dp": float("nan")}),
    ),
    _c(
        "CostModel: infinite weight",
        "CostModel",
        ArgumentTypeError,
        "axis_weights",
        lambda e: CostModel({"dp": float("inf")}),
    ),
    _c("CostModel: negative weight", "CostModel", ArgumentTypeError, "axis_weights", lambda e: CostModel({"dp": -1})),
    _c("CostModel: negative latency", "CostModel", ArgumentTypeError, "latency", lambda e: CostModel(latency={"dp": -1})),
    _c("CostModel: per_byte not a mapping", "CostModel", ArgumentTypeError, "per_byte", lambda e: CostModel(per_byte=3)),
    _c("CostModel: curves not per axis", "CostModel", ArgumentTypeError, "curves",
       lambda e: CostModel(curves={"dp": [(4096, 1e-4)]})),
    _c("CostModel: curve bytes not increasing", "CostModel", ArgumentTypeError, "curves",
       lambda e: CostModel(curves={"dp": {"all-gather": [(4096, 1e-4), (1024, 2e-4)]}})),
    _c("CostModel: negative copy time", "CostModel", ArgumentTypeError, "copy_curve",
       lambda e: CostModel(copy_curve=[(0, 0), (4096, -1e-6)])),
    _c("CostModel: alloc curve not pairs", "CostModel", ArgumentTypeError, "alloc_curve",
       lambda e: CostModel(alloc_curve=[4096, 1e-3])),
    _c("CostModel: negative collective overhead", "CostModel", InferenceError, "collective_overhead",
       lambda e: CostModel(collective_overhead=-192)),
    _c("CostModel: infinite overhead per kind", "CostModel", InferenceError, "collective_overhead",
       lambda e: CostModel(collective_overhead={"all-gather": float("inf")})),
    _c("CostModel: overhead of an unknown kind", "CostModel", InferenceError, "collective_overhead",
       lambda e: CostModel(collective_overhead={"gather": 3072})),
    _c("CostModel: overhead not a number", "CostModel", ArgumentTypeError, "collective_overhead",
       lambda e: CostModel(collective_overhead="3 KB")),
    _c("policy_model: not a mesh", "CostModel", ArgumentTypeError, "mesh",
       lambda e: placements2jax.schedules.policy_model((4, 2))),
    _c("Collective.mesh_axes: not a mesh", "Collective", ArgumentTypeError, "mesh",
       lambda e: Collective("all-gather", ((4,),), "f32", ((0, 1),)).mesh_axes((2, 4))),
    _c("Collective.mesh_axes: a smaller mesh", "Collective", MeshError, "mesh",
       lambda e: Collective("all-gather", ((4,),), "f32", ((0, 7),)).mesh_axes(DeviceMesh([0, 1], ("x",)))),
    _c(
        "DTensor.redistribute: unknown policy",
        "DTensor",
        ArgumentTypeError,
        "policy",
        lambda e: e.dt.redistribute(e.mesh, "R,R", policy="fastest"),
    ),
    _c(
        "redistribute_collectives: unknown policy",
        "redistribute_collectives",
        ArgumentTypeError,
        "policy",
        lambda e: redistribute_collectives(e.dt, "R,R", policy=3),
    ),
    _c("CostModel: not a mapping", "CostModel", ArgumentTypeError, "axis_weights", lambda e: CostModel("x")),
    _c(
        "set_default_cost_model: a string",
        "set_default_cost_model",
        ArgumentTypeError,
        "model",
        lambda e: set_default_cost_model("x"),
    ),
    _c("use_cost_model: an int", "use_cost_model", ArgumentTypeError, "model", lambda e: use_cost_model(3).__enter__()),
    # -- pictures ------------------------------------------------------------------------------------------------------------------
    _c(
        "visualize: 3-d tensor",
        "visualize",
        ShapeError,
        "shape",
        lambda e: visualize(Layout.from_device_mesh(e.mesh)(("dp", None, None)), (8, 2, 2)),
    ),
    _c("visualize: layout without shape", "visualize", ArgumentTypeError, "shape", lambda e: visualize(e.layout)),
    _c("visualize: a string", "visualize", ArgumentTypeError, "item", lambda e: visualize("S(0)", (8,))),
    _c("visualize: shape a string", "visualize", ArgumentTypeError, "shape", lambda e: visualize(e.layout, "10,3")),
    _c("visualize: negative extent", "visualize", ShapeError, "shape", lambda e: visualize(e.layout, (-10, 3))),
    _c("visualize: color a string", "visualize", ArgumentTypeError, "color", lambda e: visualize(e.dt, color="yes")),
    _c(
        "print_layout: file a path",
        "print_layout",
        ArgumentTypeError,
        "file",
        lambda e: print_layout(e.dt, file="out.txt"),
    ),
    _c("plot: nothing", "plot", ArgumentTypeError, "items", lambda e: plot([])),
    _c("plot: too few titles", "plot", ArgumentTypeError, "titles", lambda e: plot([e.dt, e.dt8], titles=["a"])),
    _c("plot: zero columns", "plot", ArgumentTypeError, "ncols", lambda e: plot([e.dt], ncols=0)),
    _c("plot: a string", "plot", ArgumentTypeError, "item", lambda e: plot("S(0)", (8,))),
    # -- parallelization plans ------------------------------------------------------------------------------------------------------
    _c("ParallelStyle: unknown kind", "ParallelStyle", PlanError, "kind", lambda e: ParallelStyle("diagonal")),
    _c("colwise: axis an int", "colwise", ArgumentTypeError, "axis", lambda e: colwise(3)),
    _c(
        "rowwise: unknown convention", "rowwise", PlanError, "convention", lambda e: rowwise("tp", convention="pytorch")
    ),
    _c(
        "sequence: sequence_dim a string",
        "sequence",
        ArgumentTypeError,
        "sequence_dim",
        lambda e: sequence("tp", sequence_dim="1"),
    ),
    _c(
        "colwise: axis not on the mesh",
        "colwise distribute_pytree",
        MeshError,
        "axis (at 'w')",
        lambda e: distribute_pytree({"w": e.x}, e.mesh, {"w": colwise("pp")}),
    ),
    _c(
        "plan_layouts: plan an int",
        "plan_layouts",
        ArgumentTypeError,
        "plan",
        lambda e: plan_layouts({"w": e.x}, e.mesh, 3),
    ),
    _c(
        "plan_layouts: bad regex",
        "plan_layouts",
        PlanError,
        "plan['[']",
        lambda e: plan_layouts({"w": e.x}, e.mesh, {"[": "R,R"}),
    ),
    _c(
        "distribute_pytree: rule matching nothing",
        "distribute_pytree",
        PlanError,
        "plan",
        lambda e: distribute_pytree({"w": e.x}, e.mesh, {"v": "R,R"}),
    ),
    # -- auto_plan / plan_figures -------------------------------------------------------------------------
    _c(
        "auto_plan: a (shape, dtype) pair as a parameter (predict's spec form, a raw TypeError before)",
        "auto_plan",
        ArgumentTypeError,
        "params['w'][1]",
        lambda e: auto_plan(_tiny_step, {"w": ((8, 16), np.float32)}, e.x, mesh=e.mesh),
    ),
    _c(
        "auto_plan: fixed path matching nothing",
        "auto_plan",
        PlanError,
        "fixed",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, fixed={"args/7": "S(0),R"}),
    ),
    _c(
        "auto_plan: fixed placements for another mesh",
        "auto_plan",
        PlacementError,
        "fixed['args/0']",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, fixed={"args/0": "S(0)"}),
    ),
    _c(
        "auto_plan: score='xla' with a fixed leaf split unevenly (XLA cannot compile it)",
        "auto_plan",
        ShapeError,
        "fixed['args/0']",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, fixed={"args/0": "S(0),R"}),
    ),
    _c(
        "auto_plan: score='pinned' with a fixed leaf split unevenly (XLA cannot compile the pinned program either)",
        "auto_plan",
        ShapeError,
        "fixed['args/0']",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, fixed={"args/0": "S(0),R"}, score="pinned"),
    ),
    _c(
        "auto_plan: memory budget too small for any plan",
        "auto_plan",
        PlanError,
        "memory_budget",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, memory_budget=16),
    ),
    _c(
        "auto_plan: memory budget not a number",
        "auto_plan",
        ArgumentTypeError,
        "memory_budget",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, memory_budget="1GB"),
    ),
    _c(
        "auto_plan: unknown score",
        "auto_plan",
        ArgumentTypeError,
        "score",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, score="compiled"),
    ),
    _c(
        "auto_plan: score not a string",
        "auto_plan",
        ArgumentTypeError,
        "score",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, score=True),
    ),
    _c(
        "auto_plan: step not callable",
        "auto_plan",
        ArgumentTypeError,
        "step_fn",
        lambda e: auto_plan("train_step", {"w": e.x}, e.x, mesh=e.mesh),
    ),
    _c(
        "auto_plan: mesh a string",
        "auto_plan",
        ArgumentTypeError,
        "mesh",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh="dp=4,tp=2"),
    ),
    _c(
        "auto_plan: presets not a mapping",
        "auto_plan",
        ArgumentTypeError,
        "presets",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, presets="megatron"),
    ),
    _c(
        "auto_plan: a preset named by an int",
        "auto_plan",
        ArgumentTypeError,
        "presets",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, presets={1: {"w": "S(0),R"}}),
    ),
    _c(
        "auto_plan: bad rule in a preset",
        "auto_plan",
        PlacementError,
        "presets['mine']['w']",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, presets={"mine": {"w": "P,P(max)"}}),
    ),
    _c(
        "auto_plan: a preset that is not a plan",
        "auto_plan",
        ArgumentTypeError,
        "presets['mine']",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, presets={"mine": 3}),
    ),
    _c(
        "auto_plan: flops_per_byte not positive",
        "auto_plan",
        ArgumentTypeError,
        "flops_per_byte",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, flops_per_byte=0),
    ),
    _c(
        "auto_plan: flops_per_byte infinite",
        "auto_plan",
        ArgumentTypeError,
        "flops_per_byte",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, flops_per_byte=float("inf")),
    ),
    _c(
        "auto_plan: max_evaluations zero",
        "auto_plan",
        ArgumentTypeError,
        "max_evaluations",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, max_evaluations=0),
    ),
    _c(
        "auto_plan: max_evaluations a float",
        "auto_plan",
        ArgumentTypeError,
        "max_evaluations",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, max_evaluations=2.5),
    ),
    _c(
        "auto_plan: cost model a string",
        "auto_plan",
        ArgumentTypeError,
        "cost_model",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, cost_model="fast", score="predict"),
    ),
    _c(
        "auto_plan: fixed not a mapping",
        "auto_plan",
        ArgumentTypeError,
        "fixed",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, fixed="args/0"),
    ),
    _c(
        "auto_plan: fixed path not a regex",
        "auto_plan",
        PlanError,
        "fixed['(']",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, fixed={"(": "S(0),R"}),
    ),
    _c(
        "auto_plan: a parameter that is a string",
        "auto_plan",
        ArgumentTypeError,
        "params['w']",
        lambda e: auto_plan(_tiny_step, {"w": "weights.npy"}, e.x, mesh=e.mesh),
    ),
    _c(
        "auto_plan: an argument leaf that is a string",
        "auto_plan",
        ArgumentTypeError,
        "args[0]",
        lambda e: auto_plan(_tiny_step, {"w": e.x}, "batch", mesh=e.mesh),
    ),
    _c(
        "plan_figures: plan not a mapping",
        "plan_figures",
        ArgumentTypeError,
        "plan",
        lambda e: plan_figures(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, plan=3),
    ),
    _c(
        "plan_figures: flops_per_byte not a number",
        "plan_figures",
        ArgumentTypeError,
        "flops_per_byte",
        lambda e: plan_figures(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, plan={}, flops_per_byte="1000"),
    ),
    _c(
        "plan_figures: mesh a string",
        "plan_figures",
        ArgumentTypeError,
        "mesh",
        lambda e: plan_figures(_tiny_step, {"w": e.x}, e.x, mesh="dp=4,tp=2", plan={}),
    ),
    _c(
        "plan_figures: fixed path matching nothing",
        "plan_figures",
        PlanError,
        "fixed",
        lambda e: plan_figures(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, plan={}, fixed={"args/9": "R,R"}),
    ),
    _c(
        "compiled_figures: a parameter that is a string",
        "compiled_figures",
        ArgumentTypeError,
        "params['w']",
        lambda e: compiled_figures(_tiny_step, {"w": "weights.npy"}, e.x, mesh=e.mesh, plan={}),
    ),
    _c(
        "compiled_figures: mesh a string",
        "compiled_figures",
        ArgumentTypeError,
        "mesh",
        lambda e: compiled_figures(_tiny_step, {"w": e.x}, e.x, mesh="dp=4,tp=2", plan={}),
    ),
    _c(
        "plan_figures: bad rule in the plan",
        "plan_figures",
        PlacementError,
        "plan['w']",
        lambda e: plan_figures(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, plan={"w": "P,P(max)"}),
    ),
    _c(
        "compiled_figures: bad rule in the plan",
        "compiled_figures",
        PlacementError,
        "plan['w']",
        lambda e: compiled_figures(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, plan={"w": "P,P(max)"}),
    ),
    _c(
        "compiled_figures: unknown execution",
        "compiled_figures",
        ArgumentTypeError,
        "execute",
        lambda e: compiled_figures(_tiny_step, {"w": e.x}, e.x, mesh=e.mesh, plan={}, execute="ops"),
    ),
    _c(
        "compiled_figures: step not callable",
        "compiled_figures",
        ArgumentTypeError,
        "step_fn",
        lambda e: compiled_figures("train_step", {"w": e.x}, e.x, mesh=e.mesh, plan={}),
    ),
    _c(
        "distribute_pytree: bad placements in a rule",
        "distribute_pytree",
        PlacementError,
        "plan['w']",
        lambda e: distribute_pytree({"w": e.x}, e.mesh, {"w": "P,P(max)"}),
    ),
    _c(
        "distribute_pytree: a leaf that is not an array",
        "distribute_pytree",
        ArgumentTypeError,
        "params at 'w'",
        lambda e: distribute_pytree({"w": "text"}, e.mesh, {"w": "R,R"}),
    ),
    # -- local_map ----------------------------------------------------------------------------------------
    _c("local_map: func not callable", "local_map", ArgumentTypeError, "func", lambda e: local_map("mm", "R,R")),
    _c(
        "local_map: in_placements as one string",
        "local_map",
        ArgumentTypeError,
        "in_placements",
        lambda e: local_map(lambda b: b, "R,R", "S(0),R"),
    ),
    _c(
        "local_map: in_placements of the wrong length",
        "local_map",
        PlacementError,
        "in_placements",
        lambda e: local_map(lambda b: b, "R,R", ("S(0),R", None))(e.dt),
    ),
    _c(
        "local_map: input in other placements",
        "local_map",
        PlacementError,
        "in_placements[0]",
        lambda e: local_map(lambda b: b, "R,R", ("R,R",))(e.dt),
    ),
    _c(
        "local_map: uneven input",
        "local_map",
        ShapeError,
        "args (flattened argument 0)",
        lambda e: local_map(lambda b: b, "S(0),R")(e.dt),
    ),
    _c(
        "local_map: varying output declared Replicate",
        "local_map",
        PlacementError,
        "out_placements",
        lambda e: local_map(lambda b: b, "R,R")(distribute_tensor(np.ones((8, 2), F32), e.mesh, "S(0),R")),
    ),
    _c(
        "local_map: one placements value for two outputs",
        "local_map",
        PlacementError,
        "out_placements",
        lambda e: local_map(lambda b: (b, b), "S(0),R")(distribute_tensor(np.ones((8, 2), F32), e.mesh, "S(0),R")),
    ),
    _c(
        "local_map: input on another mesh",
        "local_map",
        MeshError,
        "args (flattened argument 0)",
        lambda e: local_map(lambda b: b, "S(0)", device_mesh=e.mesh8)(e.dt),
    ),
    _c("from_local: non-contiguous stride", "DTensor", ShapeError, "stride",
       lambda e: DTensor.from_local(np.zeros((3, 3), np.int32), e.mesh, "S(0),R", stride=(1, 3))),
    _c("from_local: stride as text", "DTensor", ArgumentTypeError, "stride",
       lambda e: DTensor.from_local(np.zeros((3, 3), np.int32), e.mesh, "S(0),R", stride="3,1")),
    _c("from_local: run_check not a bool", "DTensor", ArgumentTypeError, "run_check",
       lambda e: DTensor.from_local(np.zeros((3, 3), np.int32), e.mesh, "S(0),R", run_check="yes")),
    # -- DTensor indexing ---------------------------------------------------------------------------------
    _c("getitem: int out of bounds", "DTensor", IndexingError, "key", lambda e: e.dt[10]),
    _c("getitem: too many indices", "DTensor", IndexingError, "key", lambda e: e.dt[0, 0, 0]),
    _c("getitem: two ellipses", "DTensor", IndexingError, "key", lambda e: e.dt[..., ...]),
    _c("getitem: zero step", "DTensor", IndexingError, "key", lambda e: e.dt[::0]),
    _c("getitem: float slice bound", "DTensor", ArgumentTypeError, "key", lambda e: e.dt[1.5:]),
    _c("getitem: boolean mask", "DTensor", IndexingError, "key", lambda e: e.dt[X[:, 0] > 0]),
    _c("getitem: arrays on two dims", "DTensor", IndexingError, "key", lambda e: e.dt[[0, 1], [1, 2]]),
    _c("getitem: index array out of bounds", "DTensor", IndexingError, "key", lambda e: e.dt[:, [0, 3]]),
    _c("getitem: a string", "DTensor", ArgumentTypeError, "key", lambda e: e.dt["a"]),
    _c("getitem: a DTensor index", "DTensor", ArgumentTypeError, "key", lambda e: e.dt[e.dt8]),
    _c("operators: plain array mixed outside implicit_replication", "implicit_replication", ArgumentTypeError,
       "operands", lambda e: e.dt * np.ones(3, np.int32)),
    _c("cross_entropy: plain array logits", "cross_entropy", ArgumentTypeError, "logits",
       lambda e: placements2jax.cross_entropy(np.ones((4, 8), F32), np.zeros(4, np.int32))),
    _c("cross_entropy: float labels", "cross_entropy", ArgumentTypeError, "labels",
       lambda e: placements2jax.cross_entropy(distribute_tensor(np.ones((4, 8), F32), e.mesh, "R,S(1)"),
                                              np.zeros(4, F32))),
    # -- register_sharding ---------------------------------------------------------------------------------
    _c("register_sharding: unknown op name", "register_sharding", UnsupportedOpError, "op",
       lambda e: register_sharding("no_such_op")),
    _c("register_sharding: not an op", "register_sharding", ArgumentTypeError, "op", lambda e: register_sharding(3)),
    _c("register_sharding: empty list", "register_sharding", ArgumentTypeError, "op", lambda e: register_sharding([])),
    _c("register_sharding: rule not callable", "register_sharding", ArgumentTypeError, "rule",
       lambda e: register_sharding("softmax")("rule")),
    _c("unregister_sharding: nothing registered", "unregister_sharding", UnsupportedOpError, "op",
       lambda e: unregister_sharding("softmax")),
    _c("unregister_sharding: not an op", "unregister_sharding", ArgumentTypeError, "op",
       lambda e: unregister_sharding(None)),
    # -- vocab_parallel_cross_entropy ---------------------------------------------------------------------
    _c(
        "vocab_parallel_cross_entropy: plain array logits",
        "vocab_parallel_cross_entropy",
        ArgumentTypeError,
        "logits",
        lambda e: vocab_parallel_cross_entropy(e.x, e.x[:, 0]),
    ),
    _c(
        "vocab_parallel_cross_entropy: labels of the wrong shape",
        "vocab_parallel_cross_entropy",
        ShapeError,
        "labels",
        lambda e: vocab_parallel_cross_entropy(e.dt, e.x),
    ),
    _c(
        "vocab_parallel_cross_entropy: float labels",
        "vocab_parallel_cross_entropy",
        ArgumentTypeError,
        "labels",
        lambda e: vocab_parallel_cross_entropy(e.dt, e.x[:, 0].astype(F32)),
    ),
    _c(
        "vocab_parallel_cross_entropy: unknown reduction",
        "vocab_parallel_cross_entropy",
        ArgumentTypeError,
        "reduction",
        lambda e: vocab_parallel_cross_entropy(e.dt, e.x[:, 0], reduction="avg"),
    ),
    _c(
        "vocab_parallel_cross_entropy: partial logits",
        "vocab_parallel_cross_entropy",
        PlacementError,
        "logits",
        lambda e: vocab_parallel_cross_entropy(e.dtp, e.x[:, 0]),
    ),
    _c(
        "vocab_parallel_cross_entropy: uneven logits",
        "vocab_parallel_cross_entropy",
        ShapeError,
        "logits",
        lambda e: vocab_parallel_cross_entropy(e.dt, e.x[:, 0]),
    ),
    # -- fully_shard / unshard ----------------------------------------------------------------------------
    _c("fully_shard: mesh a string", "fully_shard", ArgumentTypeError, "mesh", lambda e: fully_shard({"w": e.x}, "dp")),
    _c(
        "fully_shard_layouts: mesh a string",
        "fully_shard_layouts",
        ArgumentTypeError,
        "mesh",
        lambda e: fully_shard_layouts({"w": e.x}, "dp"),
    ),
    _c(
        "distribute_pytree: mesh a string",
        "distribute_pytree",
        ArgumentTypeError,
        "mesh",
        lambda e: distribute_pytree({"w": e.x}, "dp=4,tp=2", {}),
    ),
    _c("plan_layouts: mesh a string", "plan_layouts", ArgumentTypeError, "mesh",
       lambda e: plan_layouts({"w": e.x}, "dp=4,tp=2", {})),
    # -- logical_layouts: Flax logical axis names and rules (e.mesh: dp=4 x tp=2) -------------------------
    _c("logical_layouts: mesh a string", "logical_layouts", ArgumentTypeError, "mesh",
       lambda e: logical_layouts({"w": ("embed", "mlp")}, "dp=4,tp=2", (("mlp", "tp"),))),
    _c("logical_layouts: a logical name no rule names", "logical_layouts", PlanError, "rules",
       lambda e: logical_layouts({"w": ("embed", "mlp")}, e.mesh, (("mlp", "tp"),))),
    _c("logical_layouts: a rule's mesh axis not in the mesh", "logical_layouts", MeshError, "rules[1]",
       lambda e: logical_layouts({"w": ("embed", "mlp")}, e.mesh, (("embed", None), ("mlp", "pp")))),
    _c("logical_layouts: a logical name on two dims", "logical_layouts", LayoutError, "tree at 'w'",
       lambda e: logical_layouts({"w": ("mlp", "mlp")}, e.mesh, (("mlp", "tp"),))),
    _c("logical_layouts: rules a dict", "logical_layouts", ArgumentTypeError, "rules",
       lambda e: logical_layouts({"w": ("mlp",)}, e.mesh, {"mlp": "tp"})),
    _c("logical_layouts: a rule not a pair", "logical_layouts", ArgumentTypeError, "rules[0]",
       lambda e: logical_layouts({"w": ("mlp",)}, e.mesh, ("mlp", "tp"))),
    _c("logical_layouts: a rule's mesh axes a number", "logical_layouts", ArgumentTypeError, "rules[0]",
       lambda e: logical_layouts({"w": ("mlp",)}, e.mesh, (("mlp", 1),))),
    _c("logical_layouts: more names than dims", "logical_layouts", LayoutError, "tree at 'w'",
       lambda e: logical_layouts({"w": nn.LogicallyPartitioned(e.x, ("a", "b", "c"))}, e.mesh,
                                 (("a", None), ("b", None), ("c", None)))),
    _c("logical_layouts: a leaf that is not an array", "logical_layouts", ArgumentTypeError, "tree at 'w'",
       lambda e: logical_layouts({"w": "text"}, e.mesh, ())),
    _c("fully_shard: unknown axis", "fully_shard", MeshError, "axis", lambda e: fully_shard({"w": e.x}, e.mesh, "pp")),
    _c(
        "fully_shard: a leaf that is not an array",
        "fully_shard",
        ArgumentTypeError,
        "params at 'w'",
        lambda e: fully_shard({"w": "text"}, e.mesh, "dp"),
    ),
    _c(
        "fully_shard: a DTensor on another mesh",
        "fully_shard",
        MeshError,
        "params at 'w'",
        lambda e: fully_shard({"w": e.dt8}, e.mesh, "dp"),
    ),
    _c(
        "fully_shard: partial over the data-parallel axis",
        "fully_shard",
        PlanError,
        "params at 'w'",
        lambda e: fully_shard({"w": e.dtm}, e.mesh, "dp"),
    ),
    _c(
        "fully_shard_layouts: axis index instead of name",
        "fully_shard_layouts",
        ArgumentTypeError,
        "axis",
        lambda e: fully_shard_layouts({"w": e.x}, e.mesh, 0),
    ),
    _c(
        "fully_shard_layouts: bad plan rule",
        "fully_shard_layouts",
        PlanError,
        "plan",
        lambda e: fully_shard_layouts({"w": e.x}, e.mesh, "dp", plan={"v": "R,R"}),
    ),
    _c(
        "fully_sharded_layout: base not a Layout",
        "fully_sharded_layout",
        ArgumentTypeError,
        "base",
        lambda e: fully_sharded_layout("S(0),R", (10, 3), "dp"),
    ),
    _c(
        "fully_sharded_layout: shape of the wrong rank",
        "fully_sharded_layout",
        ArgumentTypeError,
        "shape",
        lambda e: fully_sharded_layout(e.layout, (10,), "dp"),
    ),
    _c(
        "fully_sharded_layout: unknown axis",
        "fully_sharded_layout",
        MeshError,
        "mesh_dim",
        lambda e: fully_sharded_layout(e.layout, (10, 3), "pp"),
    ),
    _c(
        "fully_sharded_layout: mesh dim out of range",
        "fully_sharded_layout",
        ArgumentTypeError,
        "mesh_dim",
        lambda e: fully_sharded_layout(e.layout, (10, 3), 2),
    ),
    _c("unshard: axis index instead of name", "unshard", ArgumentTypeError, "axis", lambda e: unshard({"w": e.dt}, 0)),
    _c("unshard: unknown axis", "unshard", MeshError, "axis", lambda e: unshard({"w": e.dt}, "pp")),
    # -- checkpoints -------------------------------------------------------------------------------------------
    _c("save: negative step", "save", ArgumentTypeError, "step", lambda e: placements2jax.save(_ckpt(e), {"w": e.dt}, step=-1)),
    _c(
        "save: a leaf that is not an array", "save", ArgumentTypeError, "tree at 'w'",
        lambda e: placements2jax.save(_ckpt(e) + "-text", {"w": "text"}, step=1),
    ),
    _c("save: path not a path", "save", ArgumentTypeError, "path", lambda e: placements2jax.save(3, {"w": e.dt})),
    _c(
        "load: no checkpoint there", "load", CheckpointError, "path",
        lambda e: placements2jax.load(_ckpt(e) + "-missing", {"w": e.dt}),
    ),
    _c(
        "load: leaf missing from the checkpoint", "load AbstractDTensor", CheckpointError, "target at 'v'",
        lambda e: placements2jax.load(_ckpt(e), {"v": placements2jax.AbstractDTensor((10, 3), np.int32, e.mesh)}),
    ),
    _c(
        "load: wrong shape", "load AbstractDTensor", CheckpointError, "target at 'w'",
        lambda e: placements2jax.load(_ckpt(e), {"w": placements2jax.AbstractDTensor((3, 10), np.int32, e.mesh)}),
    ),
    _c(
        "load: wrong dtype", "load", CheckpointError, "target at 'w'",
        lambda e: placements2jax.load(_ckpt(e), {"w": e.dtc}),
    ),
    _c(
        "load: an array into a PRNG key target", "load", CheckpointError, "target at 'w'",
        lambda e: placements2jax.load(_ckpt(e), {"w": jax.random.key(0)}),
    ),
    _c(
        "load: bad target placements", "AbstractDTensor", PlacementError, "target at 'w'",
        lambda e: placements2jax.load(_ckpt(e), {"w": placements2jax.AbstractDTensor((10, 3), np.int32, e.mesh, "S(2),R")}),
    ),
    _c("read_metadata: no such step", "read_metadata", CheckpointError, "step",
       lambda e: placements2jax.read_metadata(_ckpt(e), step=99)),
    _c("latest_step: path not a path", "latest_step", ArgumentTypeError, "path", lambda e: placements2jax.latest_step(None)),
    _c(
        "load_torch_checkpoint: not a torch checkpoint", "load_torch_checkpoint", CheckpointError, "path",
        lambda e: placements2jax.load_torch_checkpoint(_ckpt(e), {"w": e.dt}),
    ),
    _c(
        "load_torch_checkpoint: path not a path", "load_torch_checkpoint", ArgumentTypeError, "path",
        lambda e: placements2jax.load_torch_checkpoint(None, {"w": e.dt}),
    ),
    _c(
        "load: step a string", "load", ArgumentTypeError, "step",
        lambda e: placements2jax.load(_ckpt(e), {"w": e.dt}, step="0"),
    ),
    _c(
        "read_metadata: step a string", "read_metadata", ArgumentTypeError, "step",
        lambda e: placements2jax.read_metadata(_ckpt(e), step="latest"),
    ),
    _c(
        "AbstractDTensor: shape a string", "AbstractDTensor", ArgumentTypeError, "shape",
        lambda e: placements2jax.AbstractDTensor("10,3", np.int32, e.mesh),
    ),
    _c(
        "AbstractDTensor: not a dtype", "AbstractDTensor", ArgumentTypeError, "dtype",
        lambda e: placements2jax.AbstractDTensor((10, 3), "no-such-type", e.mesh),
    ),
    _c(
        "AbstractDTensor: mesh a string", "AbstractDTensor", ArgumentTypeError, "device_mesh",
        lambda e: placements2jax.AbstractDTensor((10, 3), np.int32, "dp=4,tp=2"),
    ),
    # -- factories: parameters born sharded --------------------------------------------------------------
    _c("zeros: negative size", "zeros", ShapeError, "size", lambda e: placements2jax.zeros(3, -1, device_mesh=e.mesh)),
    _c(
        "zeros: no mesh", "zeros", ArgumentTypeError, "device_mesh",
        lambda e: placements2jax.zeros(3, device_mesh=None),
    ),
    _c(
        "ones: shard dim the tensor lacks", "ones", PlacementError, "placements",
        lambda e: placements2jax.ones(4, device_mesh=e.mesh, placements="S(1),R"),
    ),
    _c(
        "empty: not a dtype", "empty", ArgumentTypeError, "dtype",
        lambda e: placements2jax.empty(4, device_mesh=e.mesh, dtype="no-such-type"),
    ),
    _c(
        "zeros: a NumPy dtype JAX cannot hold", "zeros", ArgumentTypeError, "dtype",
        lambda e: placements2jax.zeros(4, device_mesh=e.mesh, dtype="float128"),
    ),
    _c(
        "full: text fill value", "full", ArgumentTypeError, "fill_value",
        lambda e: placements2jax.full((4,), "a", device_mesh=e.mesh),
    ),
    _c(
        "full: Partial(sum) of bools", "full", PlacementError, "placements",
        lambda e: placements2jax.full((4,), True, device_mesh=e.mesh, placements="P,R"),
    ),
    _c(
        "rand: no key", "rand", ArgumentTypeError, "key",
        lambda e: placements2jax.rand(4, key=None, device_mesh=e.mesh),
    ),
    _c(
        "randn: integer dtype", "randn", ArgumentTypeError, "dtype",
        lambda e: placements2jax.randn(4, key=jax.random.key(0), device_mesh=e.mesh, dtype=np.int32),
    ),
    _c(
        "init_pytree: init_fn not callable", "init_pytree", ArgumentTypeError, "init_fn",
        lambda e: placements2jax.init_pytree({"w": 1}, jax.random.key(0), e.mesh, {}),
    ),
    _c(
        "init_pytree: init_fn fails", "init_pytree", ArgumentTypeError, "init_fn",
        lambda e: placements2jax.init_pytree(lambda k: jnp.ones(3) @ jnp.ones(4), jax.random.key(0), e.mesh, {}),
    ),
    _c(
        "init_pytree: seed instead of key", "init_pytree", ArgumentTypeError, "key",
        lambda e: placements2jax.init_pytree(lambda k: {"w": jnp.ones(3)}, 0, e.mesh, {}),
    ),
    _c(
        "init_pytree: rule matching nothing", "init_pytree", PlanError, "plan",
        lambda e: placements2jax.init_pytree(lambda k: {"w": jnp.ones(3)}, jax.random.key(0), e.mesh, {"v": "R,R"}),
    ),
    _c(
        "init_pytree: shard a dim the leaf lacks", "init_pytree", PlacementError, "placements (at 'w')",
        lambda e: placements2jax.init_pytree(lambda k: {"w": jnp.ones(3)}, jax.random.key(0), e.mesh, {"w": "S(1),R"}),
    ),
    # -- mixed precision -------------------------------------------------------------------------------------
    _c(
        "mixed_precision: not an optax optimizer", "mixed_precision", ArgumentTypeError, "optimizer",
        lambda e: placements2jax.mixed_precision(lambda g: g),
    ),
    _c(
        "mixed_precision: integer master dtype", "mixed_precision", ArgumentTypeError, "master_dtype",
        lambda e: placements2jax.mixed_precision(_optax().sgd(0.1), master_dtype=np.int32),
    ),
    _c(
        "mixed_precision: unknown master dtype", "mixed_precision", ArgumentTypeError, "master_dtype",
        lambda e: placements2jax.mixed_precision(_optax().sgd(0.1), master_dtype="float33"),
    ),
    _c(
        "mixed_precision: update without params", "mixed_precision", ArgumentTypeError, "params",
        lambda e: _mixed_update_without_params(e),
    ),
    # -- optimizer state following its parameters -------------------------------------------------------------
    _c(
        "init_optimizer_state: not an optax optimizer", "init_optimizer_state", ArgumentTypeError, "optimizer",
        lambda e: placements2jax.init_optimizer_state(lambda p: p, {"w": e.dt}),
    ),
    _c(
        "init_optimizer_state: a parameter that is not a DTensor", "init_optimizer_state", ArgumentTypeError,
        "params['b']", lambda e: placements2jax.init_optimizer_state(_optax().adam(0.1), {"w": e.dt, "b": np.ones(3)}),
    ),
    _c(
        "init_optimizer_state: no parameters", "init_optimizer_state", ArgumentTypeError, "params",
        lambda e: placements2jax.init_optimizer_state(_optax().adam(0.1), {}),
    ),
    _c(
        "state_layouts: a leaf that is not an array", "state_layouts", ArgumentTypeError, "state['schedule']",
        lambda e: placements2jax.state_layouts({"mu": {"w": e.dt}, "schedule": "cosine"}, {"w": e.dt}),
    ),
    _c(
        "state_layouts: a function mapped over DTensors made arrays of other shapes", "state_layouts", ShapeError,
        "state['v_row']['w']",  # as optax.adafactor(...).init(params) does (its factored statistics)
        lambda e: placements2jax.state_layouts({"v_row": jax.tree.map(lambda a: a[:, 0], {"w": e.dt})}, {"w": e.dt}),
    ),
    _c(
        "state_layouts: parameters that are plain arrays", "state_layouts", ArgumentTypeError, "params['w']",
        lambda e: placements2jax.state_layouts({"mu": {"w": e.x}}, {"w": e.x}),
    ),
]


def _optax() -> Any:
    import optax

    return optax


def _mixed_update_without_params(e: Any) -> Any:
    optimizer = placements2jax.mixed_precision(_optax().sgd(0.1))
    params = {"w": e.dt}
    return optimizer.update(params, optimizer.init(params))

# Public names without a bad-input case, and why.
EXEMPT = {
    name: "an exception class"
    for name in placements2jax.__all__
    if isinstance(getattr(placements2jax, name), type) and issubclass(getattr(placements2jax, name), Exception)
} | {
    "Signature": "a result built only by infer_signature (covered by its cases)",
    "replicate": "takes no arguments",
    "clear_caches": "takes no arguments",
    "loss_parallel": "takes no arguments",
    "layouts_of": "accepts any pytree (non-DTensor leaves are kept as they are)",
    "model_arrays": "accepts any pytree (non-DTensor leaves are kept as they are)",
}


def _chained_foreign(error: BaseException) -> BaseException | None:
    """The first exception in ``error``'s chain that Python would print and is not ours."""
    seen: BaseException | None = error
    while seen is not None:
        nxt = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
        if nxt is not None and not isinstance(nxt, Placements2JaxError):
            return nxt
        seen = nxt
    return None


def _assert_clean(error: Placements2JaxError, expected: type[Placements2JaxError], argument: str) -> None:
    assert isinstance(error, expected), f"{type(error).__name__} is not a {expected.__name__}: {error}"
    assert isinstance(error, (ValueError, TypeError, LookupError))
    assert type(error).__module__.startswith("placements2jax"), type(error)
    message = str(error)
    assert error.argument == argument and message.startswith(f"{argument}="), (error.argument, argument, message)
    assert "Fix:" in message and message.split("Fix:")[1].strip(), message
    assert "\n" not in message, message  # one line, as the CLI prints it (an array's repr spans lines)
    foreign = _chained_foreign(error)
    assert foreign is None, f"chained from {type(foreign).__module__}.{type(foreign).__name__}: {foreign}"
    text = "".join(traceback.format_exception(error))
    for leak in ("XlaRuntimeError", "jaxlib", "The above exception", "During handling of the above exception"):
        assert leak not in text, text


def _assert_unchanged(env: SimpleNamespace) -> None:
    for name, dtensor in env.dtensors.items():
        layout, shape, dtype, full, locals_ = env.snapshot[name]
        assert (dtensor.layout, dtensor.shape, dtensor.dtype) == (layout, shape, dtype), name
        np.testing.assert_array_equal(np.asarray(dtensor.full_tensor()), full, err_msg=name)
        np.testing.assert_array_equal(full, env.logical[name], err_msg=name)
        for rank, block in locals_.items():
            np.testing.assert_array_equal(np.asarray(dtensor.to_local(rank)), block, err_msg=f"{name} rank {rank}")


def test_catalogue_size() -> None:
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES), "case names must be unique"


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input(case: Case, env: SimpleNamespace) -> None:
    with pytest.raises(Placements2JaxError) as info:
        case.call(env)
    _assert_clean(info.value, case.error, case.argument)
    _assert_unchanged(env)


def test_every_public_name_has_a_case() -> None:
    covered = {name for case in CASES for name in case.covers}
    missing = sorted(set(placements2jax.__all__) - covered - set(EXEMPT))
    assert not missing, f"public names without a bad-input case (add cases, or exempt them with a reason): {missing}"
    assert not covered - set(placements2jax.__all__), covered - set(placements2jax.__all__)


def test_the_snapshot_sees_corruption(env: SimpleNamespace) -> None:
    """The unchanged-check of (d) is not vacuous: a DTensor whose array changed fails it."""
    fresh = _make_env()
    fresh.dtensors["dt"] = distribute_tensor(X + 1, fresh.mesh, "S(0),R")
    with pytest.raises(AssertionError):
        _assert_unchanged(fresh)


# -- the command line: one line on stderr naming the argument and the fix, exit code 2 ----------------------------------------

EXPLAIN = ["explain", "--mesh", "dp=4,tp=2", "--shape", "10,3"]
REDISTRIBUTE_R_R = ["redistribute", "--mesh", "dp=4,tp=2", "--shape", "8", "--from", "R,R", "--to", "R,R"]
CLI_CASES = [
    ("wrong length", [*EXPLAIN, "--placements", "S(0)"], "placements="),
    ("unknown axis", [*EXPLAIN, "--placements", "(dp,pp),None"], "placements="),
    ("mixed partial ops", [*EXPLAIN, "--placements", "P,P(max)"], "placements="),
    ("shard dim out of range", [*EXPLAIN, "--placements", "S(2),R"], "placements="),
    ("partial with torch form", [*EXPLAIN, "--placements", "S(0),R", "--partial", "tp"], "partial="),
    ("partial on a splitting axis", [*EXPLAIN, "--placements", "dp,None", "--partial", "dp"], "partial="),
    (
        "mesh too large",
        ["explain", "--mesh", "dp=4,tp=4", "--shape", "8", "--placements", "S(0),R"],
        "--mesh='dp=4,tp=4'",
    ),
    ("zero-size mesh", ["explain", "--mesh", "dp=0", "--shape", "8", "--placements", "S(0)"], "--mesh='dp=0'"),
    (
        "duplicate axis names",
        ["explain", "--mesh", "dp=4,dp=2", "--shape", "8", "--placements", "S(0),R"],
        "--mesh='dp=4,dp=2'",
    ),
    ("mesh syntax", ["explain", "--mesh", "dp4", "--shape", "8", "--placements", "S(0)"], "--mesh"),
    ("checkpoint missing", ["explain", "--checkpoint", "/nonexistent/p2j-checkpoint"], "path="),
    (
        "unknown axis weighed",
        [*REDISTRIBUTE_R_R, "--axis-weights", "pp=2"],
        "--axis-weights='pp=2'",
    ),
    (
        "dtype JAX cannot hold",
        [*REDISTRIBUTE_R_R, "--dtype", "float128"],
        "--dtype 'float128'",
    ),
    ("plan: module not found", ["plan", "no_such_module_p2j:problem", "--mesh", "dp=2,tp=4"], "model="),
    ("plan: not module:function", ["plan", "no_such_module_p2j", "--mesh", "dp=2,tp=4"], "model"),
    ("plan: fixed syntax", ["plan", "placements2jax.autoplan:example_mlp", "--mesh", "dp=2", "--fixed", "args/1"],
     "--fixed"),
    ("shape syntax", ["explain", "--mesh", "dp=4", "--shape", "8,x", "--placements", "S(0)"], "--shape"),
    (
        "partial op",
        ["explain", "--mesh", "dp=4", "--shape", "8", "--placements", "None", "--partial", "dp=prod"],
        "--partial",
    ),
]


@pytest.mark.parametrize(("argv", "argument"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(argv: list[str], argument: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = cli_main(argv)
    except SystemExit as exit_info:  # argparse's own checks exit
        code = exit_info.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and argument in err and "Fix:" in err, err
    assert "Traceback" not in err


def test_print_layout_to_a_stream_still_works(env: SimpleNamespace) -> None:
    """The file= check accepts real streams (what it guards against is a path string)."""
    stream = io.StringIO()
    print_layout(env.dt, file=stream, color=False)
    assert stream.getvalue() == visualize(env.dt, color=False) + "\n"


def test_64_bit_host_data_that_fits_is_kept_exactly(env: SimpleNamespace) -> None:
    """The range check of 64-bit input refuses only what 32-bit JAX would change."""
    values = np.array([-(2**31), 2**31 - 1, 0, 7], dtype=np.int64)
    dtensor = distribute_tensor(values, env.mesh8, "S(0)")
    assert dtensor.dtype == jax.dtypes.canonicalize_dtype(np.int64)
    np.testing.assert_array_equal(np.asarray(dtensor.full_tensor()), values)
    floats = np.array([1e30, -np.inf, np.nan, 0.1], dtype=np.float64)
    result = np.asarray(distribute_tensor(floats, env.mesh8, "S(0)").full_tensor())
    np.testing.assert_array_equal(result, floats.astype(result.dtype))  # NaN and inf stay where they were
