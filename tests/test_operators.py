"""DTensor operators and apply: values against NumPy, placements against inference and
torch's rules, inside jax.jit, and gradients against the plain function."""

from __future__ import annotations

import functools
from collections import Counter
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from models import common, gpt2
from models.steps import Step, training_step

from placements2jax import (
    ArgumentTypeError,
    DeviceMesh,
    DTensor,
    InferenceError,
    Layout,
    Partial,
    Replicate,
    Shard,
    UnsupportedOpError,
    apply,
    implicit_replication,
    distribute_tensor,
    infer_signature,
    init_device_mesh,
    operators,
    predict,
)
from placements2jax.hlo import compiled_collectives
from placements2jax.inference.check import check, collective_nbytes
from placements2jax.inference.cost import SEARCH_OVERHEAD, CostModel, default_cost_model, use_cost_model
from placements2jax.inference.ops import freeze, primitive_definition
from placements2jax.inference.select import signature_for
from placements2jax.inference.signature import Aval, TensorSpec
from placements2jax.physical import physical
from placements2jax.programs import convert
from placements2jax.inference.combine import combiner_rules, lowered_step
from placements2jax.layout import iter_layouts

MESH1 = init_device_mesh((4,), ("x",))
MESH2 = init_device_mesh((2, 4), ("dp", "tp"))
MESH_DP1 = init_device_mesh((1, 4), ("dp", "tp"))  # multi-host code run with dp=1: a size-1 mesh dim
MESHES = {"1d": MESH1, "2d": MESH2, "dp1": MESH_DP1}


def _on_dp1(cases: list[tuple[Any, ...]], placements: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """``cases`` run on the (1, 4) mesh: the 1-D ones replicated on the size-1 dim, the 2-D
    ones as written (their dp placements, partials included, on one device)."""
    found = []
    for case in cases:
        if case[0] == "1d":
            found.append(("dp1", *(f"R,{x}" if i in placements else x for i, x in enumerate(case[1:], 1))))
        else:
            found.append(("dp1", *case[1:]))
    return found
P_SUM, P_AVG, P_MAX, P_MIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")


def _data(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    # Away from zero (division) and with distinct values (max/min).
    rng = np.random.default_rng(seed + 7 * len(shape) + sum(shape))
    return (rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1, 1], size=shape)).astype(np.float32)


def _dt(x: np.ndarray, mesh: DeviceMesh, placements: Any) -> DTensor:
    return distribute_tensor(x, mesh, placements)


def _check(result: DTensor, expected: np.ndarray, op: str, operands: list[Any], **params: Any) -> None:
    """Values equal NumPy's, the layout is inference's prediction, and the physical
    array of a non-partial result is exactly what distribute_tensor builds (pads zero)."""
    assert isinstance(result, DTensor)
    assert result.shape == expected.shape
    np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=2e-5, atol=2e-5)
    predicted = infer_signature(op, operands, **params).out_layout
    assert result.layout == predicted
    if not result.layout.has_partial:
        reference = distribute_tensor(expected.astype(result.dtype), result.device_mesh, result.layout)
        np.testing.assert_allclose(np.asarray(result.array), np.asarray(reference.array), rtol=2e-5, atol=2e-5)


# -- binary elementwise ops -----------------------------------------------------------------

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
DUNDER = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b}

BINARY_CASES = [
    # (mesh, shape, op, left placements, right placements)
    ("1d", (8, 12), "add", "S(0)", "S(1)"),
    ("1d", (8, 12), "add", "P", "P"),
    ("1d", (8, 12), "add", "P", "R"),
    ("1d", (7, 5), "add", "S(0)", "S(0)"),
    ("1d", (7, 5), "sub", "S(1)", "P(avg)"),
    ("1d", (8, 12), "sub", "P(avg)", "P(avg)"),
    ("1d", (8, 12), "mul", "P", "R"),
    ("1d", (7, 5), "mul", "R", "P"),
    ("1d", (7, 5), "mul", "P(max)", "S(1)"),
    ("1d", (8, 12), "div", "P", "R"),
    ("1d", (7, 5), "div", "S(0)", "P(min)"),
    ("2d", (8, 12), "add", "S(0),S(1)", "S(1),S(0)"),
    ("2d", (7, 5), "add", "P,S(0)", "P,S(0)"),
    ("2d", (7, 5), "sub", "(dp,tp),None", "R,S(1)"),
    ("2d", (8, 12), "mul", "S(1),P", "S(1),R"),
    ("2d", (7, 5), "div", "P(max),S(1)", "R,R"),
]


@pytest.mark.parametrize("mesh_name,shape,op,left,right", BINARY_CASES + _on_dp1(BINARY_CASES, (3, 4)))
def test_binary_ops_values_and_placements(
    mesh_name: str, shape: tuple[int, ...], op: str, left: str, right: str
) -> None:
    mesh = MESHES[mesh_name]
    a, b = _data(shape, 1), _data(shape, 2)
    x, y = _dt(a, mesh, left), _dt(b, mesh, right)
    _check(DUNDER[op](x, y), BINARY[op](a, b), op, [x, y])


MORE_OPERATORS = {  # Python operator -> (named op, NumPy, operands: "xy" two DTensors, "x" one, "xc"/"cx" a constant)
    "x > y": (lambda x, y: x > y, "greater", np.greater, "xy"),
    "0.1 < x": (lambda x, y: 0.1 < x, "greater", lambda a, b: a > 0.1, "xc"),
    "x <= 0.2": (lambda x, y: x <= 0.2, "less_equal", lambda a, b: a <= 0.2, "xc"),
    "x >= y": (lambda x, y: x >= y, "greater_equal", np.greater_equal, "xy"),
    "x < y": (lambda x, y: x < y, "less", np.less, "xy"),
    "x ** 2": (lambda x, y: x ** 2.0, "pow", lambda a, b: a ** 2.0, "xc"),
    "2 ** x": (lambda x, y: 2.0 ** x, "pow", lambda a, b: 2.0 ** a, "cx"),
    "abs(x)": (lambda x, y: abs(x), "abs", lambda a, b: np.abs(a), "x"),
    "x.astype(bfloat16)": (lambda x, y: x.astype(jnp.bfloat16), "astype",
                           lambda a, b: a.astype(jnp.bfloat16).astype(np.float32), "x"),
}


@pytest.mark.parametrize("placements", ["S(0),S(1)", "P,S(1)", "R,P(max)"])
@pytest.mark.parametrize("name", list(MORE_OPERATORS))
def test_comparison_power_abs_and_astype_operators(name: str, placements: str) -> None:
    """``<``, ``<=``, ``>``, ``>=``, ``**`` (either side), ``abs`` and ``astype``, as torch's
    DTensor runs them (``x.to(dtype)`` is ``astype``): NumPy's values, the placements
    inference chooses for the named op, each rank's block as distribute_tensor lays it out;
    ``==`` stays object identity (DTensors stay hashable)."""
    operator, op, reference, form = MORE_OPERATORS[name]
    a, b = _data((8, 12), 11), _data((8, 12), 12)
    x, y = _dt(a, MESH2, placements), _dt(b, MESH2, "R,S(0)")
    operands = {"xy": [x, y], "x": [x], "xc": [x, 0.0], "cx": [2.0, x]}[form]
    params = {"dtype": jnp.bfloat16} if op == "astype" else {}
    result = operator(x, y)
    if op == "astype":  # NumPy has no bfloat16 arithmetic: the values compared in float32
        assert result.dtype == jnp.bfloat16 and result.layout == infer_signature(op, operands, **params).out_layout
        np.testing.assert_array_equal(np.asarray(result.full_tensor()).astype(np.float32), reference(a, b))
    else:
        _check(result, reference(a, b), op, operands)
    assert (x == x) is True and len({x, y}) == 2


@pytest.mark.parametrize("placements", ["S(0),S(1)", "P,S(1)", "R,P(max)", "S(1),R"])
@pytest.mark.parametrize("ties", [False, True])
def test_argmax_and_argmin_methods(placements: str, ties: bool) -> None:
    """``x.argmax(dim=, keepdim=)`` / ``x.argmin(axis, keepdims)`` (torch's and NumPy's
    names), flattened with no dim: torch's values (the first extreme on ties, as NumPy),
    the placements inference chooses for the named op, each rank's block as
    distribute_tensor lays it out."""
    a = _data((8, 12), 13)
    if ties:
        a = np.round(a).astype(np.float32)  # -2 .. 2: many equal extremes
    x = _dt(a, MESH2, placements)
    calls = [
        (x.argmax(dim=-1), np.argmax(a, -1), "argmax", {"axis": -1, "keepdims": False}),
        (x.argmax(dim=0, keepdim=True), np.argmax(a, 0, keepdims=True), "argmax", {"axis": 0, "keepdims": True}),
        (x.argmin(1), np.argmin(a, 1), "argmin", {"axis": 1, "keepdims": False}),
        (x.argmin(), np.argmin(a), "argmin", {"axis": None, "keepdims": False}),
    ]
    for result, expected, op, params in calls:
        assert result.dtype == jnp.int32
        _check(result, expected, op, [x], **params)
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(a)
    np.testing.assert_array_equal(np.asarray(x.argmax(dim=-1).full_tensor()), t.argmax(dim=-1).numpy())
    np.testing.assert_array_equal(np.asarray(x.argmin(dim=0, keepdim=True).full_tensor()),
                                  t.argmin(dim=0, keepdim=True).numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("left,right", [("R,P", "S(1),P(avg)"), ("R,P(avg)", "S(1),P"), ("P(avg),R", "P,S(0)")])
def test_add_of_sum_and_avg_partials_on_one_mesh_dim(left: str, right: str, dtype: type) -> None:
    """One input's partial changes reduce op (P(sum) <-> P(avg)) on the way to the linear rule's
    common partial: its partial is reduced first, never kept (hypothesis found the assertion)."""
    a = (np.arange(96).reshape(8, 12) * 7).astype(dtype)
    x, y = _dt(a, MESHES["2d"], left), _dt(a + 1, MESHES["2d"], right)
    np.testing.assert_array_equal(np.asarray((x + y).full_tensor()), a + a + 1)


@pytest.mark.parametrize(
    "mesh_name,shape,placements",
    [("1d", (7, 5), "S(1)"), ("2d", (7, 5), "S(0),P(max)"), ("2d", (8, 12), "P,S(1)")],
)
def test_constants_are_replicate_operands_on_either_side(
    mesh_name: str, shape: tuple[int, ...], placements: str
) -> None:
    mesh = MESHES[mesh_name]
    a = _data(shape, 3)
    x = _dt(a, mesh, placements)
    row = _data(shape[1:], 4)
    with implicit_replication():  # torch's context: plain arrays of more than one element are Replicate
        cases = [
            (x * row, a * row, "mul", [x, row]),
            (row / x, row / a, "div", [row, x]),
            (x - jnp.asarray(row), a - row, "sub", [x, jnp.asarray(row)]),
        ]
    cases += [
        (x + 2.5, a + 2.5, "add", [x, 2.5]),
        (2.5 - x, 2.5 - a, "sub", [2.5, x]),
        (np.float32(3) * x, 3 * a, "mul", [np.float32(3), x]),
        (x * np.ones((1,) * len(shape), np.float32), a, "mul", [x, np.ones((1,) * len(shape), np.float32)]),
        (-x, -a, "neg", [x]),
    ]
    for result, expected, op, operands in cases:
        _check(result, expected, op, operands)
    assert (x * 2.0).dtype == np.float32  # Python scalars are weak, as in JAX
    with pytest.raises(ArgumentTypeError, match="implicit_replication"):  # torch refuses it outside the context
        x * row
    with pytest.raises(ArgumentTypeError, match="implicit_replication"):
        row - x


LAYOUTS_2D = iter_layouts(MESH2, 2, partial_ops=("sum", "avg", "max", "min"))
PROPERTY_OPS = {
    "add": (lambda u, v: u + v, np.add),
    "mul": (lambda u, v: u * v, np.multiply),
    "matmul": (lambda u, v: u @ v.T, lambda p, q: p @ q.T),
    "sum": (lambda u, v: (u - v).sum(axis=0), lambda p, q: (p - q).sum(axis=0)),
    "max": (lambda u, v: u.max(axis=1, keepdims=True) * v, lambda p, q: p.max(axis=1, keepdims=True) * q),
}


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(LAYOUTS_2D),
    st.sampled_from(LAYOUTS_2D),
    st.sampled_from(sorted(PROPERTY_OPS)),
    st.sampled_from([(8, 12), (7, 5), (3, 9)]),
)
def test_any_pair_of_layouts_gives_numpy_values(left: Layout, right: Layout, op: str, shape: tuple[int, int]) -> None:
    a, b = _data(shape, 35), _data(shape, 36)
    x, y = _dt(a, MESH2, left), _dt(b, MESH2, right)
    run, reference = PROPERTY_OPS[op]
    np.testing.assert_allclose(np.asarray(run(x, y).full_tensor()), reference(a, b), rtol=2e-5, atol=2e-5)


# -- matmul -----------------------------------------------------------------------------------

MATMUL_CASES = [
    ("1d", (8, 12), (12, 6), "S(0)", "R"),
    ("1d", (8, 12), (12, 6), "R", "S(1)"),
    ("1d", (8, 12), (12, 6), "S(1)", "S(0)"),
    ("1d", (7, 5), (5, 3), "S(1)", "S(0)"),
    ("1d", (7, 5), (5, 3), "P", "R"),
    ("1d", (7, 5), (5, 3), "R", "P(avg)"),
    ("1d", (7, 5), (5, 3), "S(0)", "S(0)"),
    ("1d", (7, 5), (5, 3), "P(max)", "S(1)"),
    ("2d", (8, 12), (12, 16), "S(0),S(1)", "R,S(0)"),
    ("2d", (8, 12), (12, 16), "S(0),R", "R,S(1)"),
    ("2d", (7, 5), (5, 6), "S(1),S(0)", "S(0),S(1)"),
    ("2d", (3, 7, 5), (5, 6), "S(0),S(2)", "R,S(0)"),
    ("2d", (5,), (5, 6), "S(0),R", "S(0),S(1)"),
]


@pytest.mark.parametrize("mesh_name,sa,sb,left,right", MATMUL_CASES + _on_dp1(MATMUL_CASES, (3, 4)))
def test_matmul_values_and_placements(
    mesh_name: str, sa: tuple[int, ...], sb: tuple[int, ...], left: str, right: str
) -> None:
    mesh = MESHES[mesh_name]
    a, b = _data(sa, 5), _data(sb, 6)
    x, w = _dt(a, mesh, left), _dt(b, mesh, right)
    _check(x @ w, a @ b, "matmul", [x, w])


def test_matmul_with_constant_operands_on_either_side() -> None:
    a, b = _data((8, 12), 7), _data((12, 6), 8)
    x = _dt(a, MESH1, "S(0)")
    w = _dt(b, MESH1, "S(1)")
    with implicit_replication():
        _check(x @ b, a @ b, "matmul", [x, b])
        _check(a @ w, a @ w.full_tensor(), "matmul", [a, w])
    with pytest.raises(ArgumentTypeError, match="implicit_replication"):
        x @ b


def test_torch_matmul_rules_without_communication() -> None:
    a, b = _data((8, 12), 9), _data((12, 16), 10)
    rules = [
        ("S(0)", "R", (Shard(0),)),
        ("R", "S(1)", (Shard(1),)),
        ("S(1)", "S(0)", (P_SUM,)),
        ("P", "R", (P_SUM,)),
        ("R", "P", (P_SUM,)),
    ]
    for left, right, expected in rules:
        x, w = _dt(a, MESH1, left), _dt(b, MESH1, right)
        y = x @ w
        assert y.placements == expected, (left, right)
        np.testing.assert_allclose(np.asarray(y.full_tensor()), a @ b, rtol=1e-5, atol=1e-4)
        if left != "P" and right != "P":
            assert compiled_collectives(jax.jit(lambda u, v: u @ v), x, w) == []


# -- reductions -------------------------------------------------------------------------------

REDUCE_NP = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}
REDUCE_CASES = [
    ("1d", (8, 12), "S(0)", None, False),
    ("1d", (8, 12), "S(0)", 0, False),
    ("1d", (7, 5), "S(0)", 0, True),
    ("1d", (7, 5), "S(1)", 0, False),
    ("1d", (7, 5), "S(1)", (0, 1), True),
    ("2d", (8, 12), "S(0),S(1)", 1, False),
    ("2d", (7, 5), "S(1),S(0)", (0, 1), False),
    ("2d", (7, 5), "(dp,tp),None", -2, True),
]


@pytest.mark.parametrize("op", sorted(REDUCE_NP))
@pytest.mark.parametrize("mesh_name,shape,placements,axis,keepdims", REDUCE_CASES)
def test_reductions_values_and_placements(
    op: str, mesh_name: str, shape: tuple[int, ...], placements: str, axis: Any, keepdims: bool
) -> None:
    mesh = MESHES[mesh_name]
    a = _data(shape, 11)
    x = _dt(a, mesh, placements)
    result = getattr(x, op)(axis=axis, keepdims=keepdims)
    _check(result, REDUCE_NP[op](a, axis=axis, keepdims=keepdims), op, [x], axis=axis, keepdims=keepdims)


@pytest.mark.parametrize("op", sorted(REDUCE_NP))
@pytest.mark.parametrize("partial", ["P", "P(avg)", "P(max)", "P(min)"])
def test_reductions_of_partial_inputs(op: str, partial: str) -> None:
    a = _data((7, 5), 12)
    x = _dt(a, MESH2, f"{partial},S(1)")
    result = getattr(x, op)(axis=0)
    _check(result, REDUCE_NP[op](a, axis=0), op, [x], axis=0, keepdims=False)


def test_reduction_over_a_sharded_axis_gives_the_torch_partial() -> None:
    a = _data((8, 12), 13)
    x = _dt(a, MESH2, "S(0),S(1)")
    expected = {"sum": P_SUM, "mean": P_AVG, "max": P_MAX, "min": P_MIN}
    for op, partial in expected.items():
        assert getattr(x, op)(axis=1).placements == (Shard(0), partial)
        assert getattr(x, op)().placements == (partial, partial)
        np.testing.assert_allclose(np.asarray(getattr(x, op)().full_tensor()), REDUCE_NP[op](a), rtol=1e-5)
    # A partial passes through its own reduction unchanged, with no communication.
    m = _dt(a, MESH2, "P(max),S(1)").max(axis=0)
    assert m.placements == (P_MAX, Shard(0))
    np.testing.assert_allclose(np.asarray(m.full_tensor()), a.max(axis=0))


@pytest.mark.parametrize("op", sorted(REDUCE_NP))
def test_reductions_take_torchs_dim_and_keepdim(op: str) -> None:
    """``x.sum(dim=0, keepdim=True)`` as torch writes it: the same result as NumPy's names."""
    a = _data((8, 12), 14)
    x = _dt(a, MESH2, "S(0),S(1)")
    torch_style = getattr(x, op)(dim=0, keepdim=True)
    _check(torch_style, REDUCE_NP[op](a, axis=0, keepdims=True), op, [x], axis=0, keepdims=True)
    assert torch_style.placements == getattr(x, op)(axis=0, keepdims=True).placements
    np.testing.assert_allclose(
        np.asarray(getattr(x, op)(dim=(0, 1)).full_tensor()), REDUCE_NP[op](a, axis=(0, 1)), rtol=1e-5
    )
    with pytest.raises(ArgumentTypeError, match=r"dim=0: given together with axis=1.*pass only one of axis="):
        getattr(x, op)(axis=1, dim=0)


def test_reduce_argument_errors() -> None:
    x = _dt(_data((8, 12)), MESH1, "S(0)")
    with pytest.raises(ArgumentTypeError, match="keepdims"):
        x.sum(axis=0, keepdims="yes")
    with pytest.raises(InferenceError, match="axis"):
        x.sum(axis=2)


# -- transpose, reshape, neg ------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_name,shape,placements",
    [("1d", (7, 5), "S(0)"), ("1d", (8, 12), "P(avg)"), ("2d", (7, 5), "S(1),S(0)"), ("2d", (8, 12), "P(min),S(1)")],
)
def test_transpose_and_T(mesh_name: str, shape: tuple[int, ...], placements: str) -> None:
    mesh = MESHES[mesh_name]
    a = _data(shape, 14)
    x = _dt(a, mesh, placements)
    _check(x.T, a.T, "transpose", [x], axes=None)
    _check(x.transpose(1, 0), a.T, "transpose", [x], axes=(1, 0))
    _check(x.transpose((1, 0)), a.T, "transpose", [x], axes=(1, 0))
    b = _data((3, *shape), 15)
    y = _dt(b, mesh, placements)
    _check(y.transpose(2, 0, 1), b.transpose(2, 0, 1), "transpose", [y], axes=(2, 0, 1))


def test_transpose_follows_torch_rule() -> None:
    x = _dt(_data((4, 6, 8)), MESH2, "S(0),S(2)")
    assert x.transpose(2, 0, 1).placements == (Shard(1), Shard(0))
    assert _dt(_data((8, 4)), MESH2, "P,S(0)").T.placements == (P_SUM, Shard(1))


@pytest.mark.parametrize(
    "mesh_name,shape,placements,target",
    [
        ("1d", (8, 12), "S(0)", (4, 2, 12)),
        ("1d", (8, 12), "S(0)", (96,)),
        ("1d", (7, 6), "S(0)", (7, 2, 3)),
        ("1d", (7, 6), "S(1)", (42,)),
        ("1d", (8, 12), "P(max)", (12, 8)),
        ("2d", (8, 12), "S(0),S(1)", (8, 3, 4)),
        ("2d", (8, 12), "S(1),R", (2, -1)),
    ],
)
def test_reshape(mesh_name: str, shape: tuple[int, ...], placements: str, target: tuple[int, ...]) -> None:
    mesh = MESHES[mesh_name]
    a = _data(shape, 16)
    x = _dt(a, mesh, placements)
    _check(x.reshape(*target), a.reshape(target), "reshape", [x], shape=target)
    _check(x.reshape(target), a.reshape(target), "reshape", [x], shape=target)


def test_neg_swaps_max_and_min_partials() -> None:
    a = _data((8, 12), 17)
    assert (-_dt(a, MESH1, "P(max)")).placements == (P_MIN,)
    neg = -_dt(a, MESH1, "P(min)")
    assert neg.placements == (P_MAX,)
    np.testing.assert_allclose(np.asarray(neg.full_tensor()), -a)


# -- apply ------------------------------------------------------------------------------------


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b


APPLY_FUNCTIONS = {
    "gelu": jax.nn.gelu,
    "affine": lambda v: 2.0 * v + 1.0,  # the literal 1.0 becomes Partial(sum) for a partial v
    "softmax": functools.partial(jax.nn.softmax, axis=-1),
    "exp-sum": lambda v: jnp.exp(v).sum(axis=0) / 3,
    "pair": lambda v: (v * 2.0, jnp.max(v, axis=1)),
    "dict": lambda v: {"t": v.T[1:], "c": jnp.cumsum(v, axis=1)},
}


@pytest.mark.parametrize(
    "mesh_name,shape,placements,names",
    [
        ("1d", (7, 5), "S(1)", ("gelu", "softmax", "pair")),
        ("2d", (7, 5), "S(0),S(1)", tuple(APPLY_FUNCTIONS)),
        ("2d", (8, 12), "P,S(0)", tuple(APPLY_FUNCTIONS)),
    ],
)
def test_apply_matches_the_function_and_predict(
    mesh_name: str, shape: tuple[int, ...], placements: str, names: tuple[str, ...]
) -> None:
    mesh = MESHES[mesh_name]
    a = _data(shape, 18)
    x = _dt(a, mesh, placements)
    w, b = _data(shape[-1:], 19), _data(shape[-1:], 20)
    cases = [(APPLY_FUNCTIONS[name], (x,), (a,)) for name in names] + [(_layer_norm, (x, w, b), (a, w, b))]
    for fn, args, plain in cases:
        expected = jax.jit(fn)(*plain)
        # op by op: torch's placements (predict's eager search); the default, XLA on the whole
        # function, and "pinned", the whole program with every predicted layout pinned: the
        # whole-program search's output layouts
        for execute, search in (("ops", "eager"), (None, "program"), ("pinned", "program")):
            result = apply(fn, *args, execute=execute) if execute else apply(fn, *args)
            layouts = predict(fn, *args, search=search).out_layouts
            leaves, tree = jax.tree.flatten(result, is_leaf=lambda v: isinstance(v, DTensor))
            assert tree == jax.tree.structure(expected)
            for leaf, want, layout in zip(leaves, jax.tree.leaves(expected), layouts):
                assert isinstance(leaf, DTensor) and leaf.layout == layout
                np.testing.assert_allclose(np.asarray(leaf.full_tensor()), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_apply_takes_constant_arguments() -> None:
    a = _data((8, 12), 32)
    x = _dt(a, MESH1, "S(0)")
    result = apply(lambda v, s, row: v * s + row, x, 2.0, np.arange(12, dtype=np.float32))
    assert result.placements == (Shard(0),)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), a * 2 + np.arange(12), rtol=1e-6)


@pytest.mark.parametrize("execute", ["auto", "xla", "ops", "pinned"])
def test_apply_takes_arrays_committed_to_the_explicit_mesh(execute: str) -> None:
    """A jax.Array constant committed to the DTensors' Explicit mesh (split or replicated,
    float or int, a typed PRNG key, such as apply returns) mixes with the DTensors' values in
    fn, gradients included, and a key output comes back a key that the next call takes (JAX
    refused such programs: "Mesh for all inputs should be equal")."""
    a = _data((8, 12), 33)
    x = _dt(a, MESH2, "S(0),R")
    explicit = MESH2.to_jax()
    assert MESH2.is_explicit
    split, whole = (NamedSharding(explicit, spec) for spec in (PartitionSpec(MESH2.mesh_dim_names[0]), PartitionSpec()))
    for sharding, dtype in ((split, np.float32), (whole, np.float32), (split, np.int32)):
        y = jax.device_put(np.full((8, 12), 2, dtype), sharding)
        np.testing.assert_allclose(float(apply(lambda v, w: (v * w).sum(), x, y, execute=execute).full_tensor()),
                                   2 * a.sum(), rtol=1e-5)
    y = jax.device_put(np.full((8, 12), 2, np.float32), split)
    gx, gy = apply(jax.grad(lambda v, w: (jnp.sin(v) * w).sum(), argnums=(0, 1)), x, y, execute=execute)
    np.testing.assert_allclose(np.asarray(gx.full_tensor()), 2 * np.cos(a), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gy.full_tensor()), np.sin(a), rtol=1e-5, atol=1e-6)
    count = _dt(np.int32(3), MESH2, "R,R")

    def noised(v: jax.Array, c: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        return (v * jax.random.normal(jax.random.fold_in(key, c), v.shape)).sum(), jax.random.split(key)[0]

    key = jax.random.key(0)
    for _ in range(2):  # the second call takes the key the first returned (committed to the Explicit mesh)
        value, next_key = apply(noised, x, count, key, execute=execute)
        want, want_key = jax.jit(noised)(a, 3, key)
        assert isinstance(next_key, jax.Array) and not isinstance(next_key, DTensor) and next_key.dtype == key.dtype
        np.testing.assert_array_equal(jax.random.key_data(next_key), jax.random.key_data(want_key))
        np.testing.assert_allclose(float(value.full_tensor()), float(want), rtol=1e-5)
        key = next_key


def test_apply_with_keyword_arguments_and_a_jnp_function() -> None:
    a = _data((8, 12), 21)
    x = _dt(a, MESH2, "S(0),S(1)")
    result = apply(jnp.sum, x, axis=1, keepdims=True, execute="ops")  # torch's placements, op by op
    assert result.placements == (Shard(0), P_SUM)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), a.sum(axis=1, keepdims=True), rtol=1e-5)
    assert apply(jnp.max, x, axis=0, execute="ops").placements == (P_MAX, Shard(0))
    default = apply(jnp.sum, x, axis=1, keepdims=True)  # XLA on the whole function: the program search's layout
    assert default.layout == predict(lambda v: jnp.sum(v, axis=1, keepdims=True), x).out_layouts[0]
    np.testing.assert_allclose(np.asarray(default.full_tensor()), a.sum(axis=1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("execute", ["auto", "xla", "ops", "pinned"])
def test_apply_runs_a_primitive_without_a_rule_replicated_on_request(execute: str) -> None:
    """A primitive with no inference rule (a ``lax.composite``: an op a backend may lower
    as a unit) stops apply with the primitive named, as predict does;
    ``on_unknown="replicate"`` runs it on its inputs gathered, every execute mode giving
    the function's values."""
    a = _data((8, 12), 44)
    x = _dt(a, MESH2, "S(0),S(1)")

    def f(v: jax.Array) -> jax.Array:
        return jax.lax.composite(jax.scipy.special.i1e, name="my.i1e")(v) * 2.0 + v

    with pytest.raises(UnsupportedOpError, match="composite") as info:
        apply(f, x, execute=execute)
    assert "on_unknown" in info.value.fix
    result = apply(f, x, execute=execute, on_unknown="replicate")
    prediction = predict(f, x, search="eager" if execute == "ops" else "program", on_unknown="replicate")
    row = next(e for e in prediction.equations if e.primitive.startswith("composite"))
    assert row.primitive == "composite (no rule: replicated)" and str(row.outputs[0].layout) == "R,R"
    assert result.layout == prediction.out_layouts[0]
    np.testing.assert_allclose(np.asarray(result.full_tensor()), np.asarray(jax.jit(f)(a)), rtol=1e-6)


def _named_layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(checkpoint_name(x @ w, "mlp_out"))


_REMAT_POLICIES = {
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names("mlp_out"),
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["mlp_out"], offload_src="device",
        offload_dst="pinned_host",
    ),
}


@pytest.mark.parametrize("execute", ["xla", "ops", "pinned"])
@pytest.mark.parametrize("policy", sorted(_REMAT_POLICIES))
def test_apply_remat_by_checkpoint_names(policy: str, execute: str) -> None:
    """``checkpoint_name`` (the ``name`` primitive, an identity) and the remat policies
    that read it, as MaxText-style layers save or offload their activations by name."""
    w, x = _data((16, 16), 45), _data((8, 16), 46)

    def grad(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.grad(lambda w: jax.checkpoint(_named_layer, policy=_REMAT_POLICIES[policy])(w, x).sum())(w)

    result = apply(grad, _dt(w, MESH2, "R,S(1)"), _dt(x, MESH2, "S(0),R"), execute=execute)
    # The gradient sums, over the 8 rows of x, x times 1 - tanh(x @ w)^2: where tanh saturates that difference
    # cancels, and float32 computes it to about two epsilons absolute however the program is laid out (each
    # vectorization rounds tanh its own way). On some CPUs plain jax.jit of grad with x split by rows and w by
    # columns (a 2x2 mesh) differs from its unsharded run by up to 2.0e-6 (1.5e-4 relative), every execute here by
    # up to 1.25e-6: the bound, not rtol alone, is what any layout meets.
    atol = 2 * len(x) * float(np.abs(x).max()) * float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), np.asarray(jax.jit(grad)(w, x)), rtol=1e-5, atol=atol)


@pytest.mark.parametrize("execute", ["xla", "ops", "pinned"])
def test_apply_platform_dependent_takes_this_platforms_branch(execute: str) -> None:
    """``lax.platform_dependent`` (a ``platform_index`` scalar made from nothing and a
    ``cond`` on it): the CPU branch runs here, the rows of both branches are walked."""
    a = _data((8, 12), 47)

    def f(v: jax.Array) -> jax.Array:
        return jax.lax.platform_dependent(v, cpu=lambda y: y * 2.0, default=lambda y: y * 3.0) + 1.0

    result = apply(f, _dt(a, MESH2, "S(0),S(1)"), execute=execute)
    assert result.placements == (Shard(0), Shard(1))
    np.testing.assert_allclose(np.asarray(result.full_tensor()), a * 2.0 + 1.0, rtol=1e-6)


@pytest.mark.parametrize("execute", ["xla", "ops", "pinned"])
@pytest.mark.parametrize("placements", ["S(0),S(2)", "S(0),S(1)"])
def test_apply_variadic_reduce_under_its_own_computation(placements: str, execute: str) -> None:
    """``lax.reduce`` of two operands at once (a linear recurrence's coefficient product
    and sum): split on a kept dim it runs in place; split on the reduced dim it is moved
    first (never reduced split: the computation is its own)."""
    a, b = _data((4, 16, 8), 48), _data((4, 16, 8), 49)

    def f(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.reduce((a, b), (np.float32(1), np.float32(0)), lambda x, y: (x[0] * y[0], x[1] + y[1]), (1,))

    x, y = _dt(a, MESH2, placements), _dt(b, MESH2, placements)
    search = "eager" if execute == "ops" else "program"
    row = next(e for e in predict(f, x, y, search=search).equations if e.primitive == "reduce")
    assert not any(layout.dim_axes[1] for layout in row.signature.chosen.in_layouts[:2])
    if placements == "S(0),S(2)":
        assert row.cost == 0
    prod, total = apply(f, x, y, execute=execute)
    np.testing.assert_allclose(np.asarray(prod.full_tensor()), a.prod(axis=1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(total.full_tensor()), b.sum(axis=1), rtol=1e-5)


def test_apply_vocab_parallel_embedding_is_a_masked_lookup() -> None:
    table = _data((10, 6), 22)
    ids = np.array([[0, 9, 3], [4, 4, 7]], np.int32)
    t = _dt(table, MESH1, "S(0)")  # 10 rows over 4 ranks: 3, 3, 3, 1 (padded)
    i = _dt(ids, MESH1, "R")
    result = apply(lambda tab, idx: tab[idx], t, i, execute="ops")
    assert result.placements == (P_SUM,)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), table[ids], rtol=1e-6)
    gathered = apply(jnp.take, _dt(table, MESH1, "S(1)"), i, axis=0, execute="ops")
    assert gathered.placements == (Shard(2),)
    np.testing.assert_allclose(np.asarray(gathered.full_tensor()), table[ids], rtol=1e-6)


MESH42 = init_device_mesh((4, 2), ("a", "b"))
VOCAB, WIDTH = 10, 6  # 10 rows over 4 ranks: 3, 3, 3, 1 (padded)


def _lookup_loss(table: jax.Array, ids: jax.Array, w: jax.Array) -> jax.Array:
    return (jnp.tanh(table[ids]) * w).sum()


def _vmapped_lookup_loss(table: jax.Array, ids: jax.Array, w: jax.Array) -> jax.Array:
    # eqx.nn.Embedding's lookup: a gather of start_index_map (0, 1), nothing collapsed
    return (jax.vmap(lambda k: table[k])(ids[0]) * w[0]).sum()


VOCABULARY_UPDATES = {
    "grad of table[ids]": jax.grad(_lookup_loss),
    "grad of a vmapped row lookup": jax.grad(_vmapped_lookup_loss),
    "sgd step": lambda t, i, w: t - 0.1 * jax.grad(_lookup_loss)(t, i, w),
    "at[ids].add": lambda t, i, u: t.at[i].add(u),
    "at[ids].add under grad": lambda t, i, u: jax.grad(lambda t_: (t_.at[i].add(u) ** 2).sum())(t),
}


@pytest.mark.parametrize("execute", ["ops", "xla", "pinned"])
@pytest.mark.parametrize("placements", ["S(0),R", "R,S(0)", "(a,b),None"])  # (a,b): 2,1,2,1,2,1,1,0 rows
@pytest.mark.parametrize("name", sorted(VOCABULARY_UPDATES))
def test_apply_embedding_gradients_into_a_vocabulary_split_table(name: str, placements: str, execute: str) -> None:
    """Scatters into a table split on its (uneven) vocabulary: each rank adds the
    updates of the rows it owns at the id minus its offset (the masked scatter, not a
    scatter of global ids into its block); full values and every rank's local tensor
    equal plain JAX's, with repeated ids."""
    fn = VOCABULARY_UPDATES[name]
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    ids = rng.integers(0, VOCAB, (2, 5)).astype(np.int32)
    ids[0, :2] = ids[1, :2] = (0, VOCAB - 1)  # repeated ids and the rows of both ends
    w = rng.standard_normal((2, 5, WIDTH)).astype(np.float32)
    expected = np.asarray(jax.jit(fn)(table, ids, w))
    t = _dt(table, MESH42, placements)
    result = apply(fn, t, _dt(ids, MESH42, "R,R"), _dt(w, MESH42, "R,R"), out_layouts=t.layout, execute=execute)
    assert result.layout == t.layout
    np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=1e-5, atol=1e-5)
    reference = distribute_tensor(expected, MESH42, t.layout)
    for rank in MESH42.rank_list:
        np.testing.assert_allclose(
            np.asarray(result.to_local(rank)), np.asarray(reference.to_local(rank)), rtol=1e-5, atol=1e-5,
            err_msg=f"rank {rank}",
        )


@pytest.mark.parametrize("execute", ["ops", "xla", "pinned"])
@pytest.mark.parametrize("placements", ["S(0),R", "R,S(0)", "S(0),S(1)", "S(1),R"])
def test_apply_vmapped_row_lookup_of_a_split_table(placements: str, execute: str) -> None:
    """eqx.nn.Embedding's lookup (a vmapped ``table[i]``: a gather of start_index_map (0, 1),
    nothing collapsed) is the masked lookup on a vocabulary-split table, and keeps a
    split embedding dim; its gradient the masked scatter: values of both against plain
    JAX, the gradient's local tensors too."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    ids = np.array([0, 9, 3, 3, 7], np.int32)
    w = rng.standard_normal((5, WIDTH)).astype(np.float32)

    def lookup(t: jax.Array, i: jax.Array) -> jax.Array:
        return jax.vmap(lambda k: t[k])(i)

    t, i = _dt(table, MESH42, placements), _dt(ids, MESH42, "R,R")
    rows = apply(lookup, t, i, execute=execute)
    np.testing.assert_allclose(np.asarray(rows.full_tensor()), table[ids], rtol=1e-6)
    grad = jax.grad(lambda t_, i_, w_: (jnp.tanh(lookup(t_, i_)) * w_).sum())
    result = apply(grad, t, i, _dt(w, MESH42, "R,R"), out_layouts=t.layout, execute=execute)
    expected = distribute_tensor(np.asarray(jax.jit(grad)(table, ids, w)), MESH42, t.layout)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), np.asarray(expected.full_tensor()), rtol=1e-5, atol=1e-6)
    for rank in MESH42.rank_list:
        np.testing.assert_allclose(np.asarray(result.to_local(rank)), np.asarray(expected.to_local(rank)), rtol=1e-5,
                                   atol=1e-6, err_msg=f"rank {rank}")
    if execute == "ops" and placements.startswith("S(0)"):  # the masked lookup: a partial sum, not a gathered table
        assert Partial("sum") in rows.placements
    # the gradient's scatter-add (same dimension numbers) into the split table itself
    numbers = lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                          scatter_dims_to_operand_dims=(0, 1))

    def scatter(t_: jax.Array, i_: jax.Array, u: jax.Array) -> jax.Array:
        return lax.scatter_add(t_, jnp.stack([i_, jnp.zeros_like(i_)], 1), u[:, None], numbers, mode="clip")

    added = apply(scatter, t, i, _dt(w, MESH42, "R,R"), execute=execute)
    assert added.layout == t.layout
    np.testing.assert_allclose(np.asarray(added.full_tensor()), np.asarray(scatter(table, ids, w)), rtol=1e-6)


def _picked(logp: jax.Array, ids: jax.Array, mode: str | None = None) -> jax.Array:
    """``take_along_axis`` of the last dim (a gather with batching dims 0, 1)."""
    return jnp.take_along_axis(logp, ids[..., None], axis=-1, mode=mode)[..., 0]


def _picked_loss(logp: jax.Array, ids: jax.Array, w: jax.Array) -> jax.Array:
    return (jnp.tanh(_picked(jax.nn.log_softmax(logp), ids)) * w).sum()


@pytest.mark.parametrize("execute", ["ops", "xla", "pinned"])
@pytest.mark.parametrize(  # (6, 5, 10) over a=4 x b=2: 6 -> 2,2,2,0; 10 -> 3,3,3,1 and 2,2,2,2,2,0,0,0; 5 -> 3,2
    "placements,id_placements",
    [("S(0),S(2)", "S(0),R"), ("S(2),S(0)", "R,S(0)"), ("S(2),S(1)", "R,S(1)"), ("None,None,(a,b)", "R,R")],
)
def test_apply_take_along_axis_of_a_split_last_dim(placements: str, id_placements: str, execute: str) -> None:
    """``take_along_axis`` (batching dims) on log-probabilities split on the looked-up
    dim (unevenly) and on a batch dim alike with the ids: the masked lookup with each
    rank's batch rows, ids out of range filled (NaN, once) or clamped as XLA does;
    its gradient (a scatter-add with batching dims through log_softmax) too: values
    against plain JAX, the gradient's local tensors too."""
    rng = np.random.default_rng(3)
    logp = rng.standard_normal((6, 5, 10)).astype(np.float32)
    ids = rng.integers(0, 10, (6, 5)).astype(np.int32)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    strays = ids.copy()
    strays[0, :3], strays[5, 2:] = (-1, 12, 9), (0, -11, 10)  # -1: jnp's row 9; 12, -11, 10: out of range
    t, i = _dt(logp, MESH42, placements), _dt(ids, MESH42, id_placements)
    s = _dt(strays, MESH42, id_placements)
    for mode in (None, "clip"):
        rows = apply(functools.partial(_picked, mode=mode), t, s, execute=execute)
        np.testing.assert_allclose(np.asarray(rows.full_tensor()), np.asarray(_picked(logp, strays, mode)),
                                   rtol=1e-6, err_msg=str(mode))
        if execute == "ops":  # the masked lookup: a partial sum, not moved log-probabilities
            assert Partial("sum") in rows.placements
    result = apply(jax.grad(_picked_loss), t, i, _dt(w, MESH42, id_placements), out_layouts=t.layout, execute=execute)
    expected = distribute_tensor(np.asarray(jax.jit(jax.grad(_picked_loss))(logp, ids, w)), MESH42, t.layout)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), np.asarray(expected.full_tensor()), rtol=1e-5, atol=1e-6)
    for rank in MESH42.rank_list:
        np.testing.assert_allclose(np.asarray(result.to_local(rank)), np.asarray(expected.to_local(rank)), rtol=1e-5,
                                   atol=1e-6, err_msg=f"rank {rank}")


SCATTER_KINDS = ("set", "add", "multiply", "min", "max")
INDEX_MODES = ("clip", "drop", "promise_in_bounds")


@pytest.mark.parametrize("mode", INDEX_MODES)
@pytest.mark.parametrize("kind", SCATTER_KINDS)
def test_apply_scatters_of_every_kind_into_a_vocabulary_split_table(kind: str, mode: str) -> None:
    """Every scatter kind runs masked on a table split on its uneven vocabulary (the
    updates of other ranks' rows dropped, not made neutral): repeated ids, and out of
    range ones (clamped in clip mode, dropped otherwise, as XLA does)."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    ids = np.array([[0, 9, 3, 3], [4, -3, 12, 9]], np.int32)  # -3: jnp's row 7
    if mode == "promise_in_bounds":
        ids = ids % VOCAB
    u = rng.standard_normal((2, 4, WIDTH)).astype(np.float32)

    def fn(t: jax.Array, i: jax.Array, v: jax.Array) -> jax.Array:
        return getattr(t.at[i], kind)(v, mode=mode)

    expected = np.asarray(jax.jit(fn)(table, ids, u))
    for placements in ("S(0),R", "R,S(0)"):
        t = _dt(table, MESH42, placements)
        assert predict(fn, t, _dt(ids, MESH42, "R,R"), _dt(u, MESH42, "R,R"), search="eager").out_layouts == (t.layout,)
        result = apply(fn, t, _dt(ids, MESH42, "R,R"), _dt(u, MESH42, "R,R"), execute="ops")
        np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=1e-6, err_msg=placements)


def _ragged_dims(contracting: Any, ragged: int, groups: tuple[int, ...]) -> lax.RaggedDotDimensionNumbers:
    return lax.RaggedDotDimensionNumbers((contracting, ((), ())), (ragged,), groups)


# lax.ragged_dot (m, k) x (g, k, n) and its gradients, as (function, operand shapes given g)
RAGGED_DOTS = {
    "forward": (lax.ragged_dot, lambda g: [(10, 6), (g, 6, 5)]),
    "rhs gradient": (lambda x, dy, s: lax.ragged_dot_general(x, dy, s, _ragged_dims(((0,), (0,)), 0, ())),
                     lambda g: [(10, 6), (10, 5)]),
    "lhs gradient": (lambda dy, w, s: lax.ragged_dot_general(dy, w, s, _ragged_dims(((1,), (2,)), 0, (0,))),
                     lambda g: [(10, 5), (g, 6, 5)]),
}


@pytest.mark.parametrize("groups", [[3, 0, 4, 2], [3, 0, 4]])  # 4 groups over a's 4 ranks; 3 (uneven): 9 of 10 rows
@pytest.mark.parametrize("name", sorted(RAGGED_DOTS))
def test_every_expert_parallel_candidate_of_a_ragged_dot_runs_each_ranks_groups(name: str, groups: list[int]) -> None:
    """Every expert-parallel candidate of a ragged dot (the group dim split: the rhs ->
    P, the rhs gradient's output S(0)), run by the executors' local program
    (execute="ops"; "pinned" where an output is partial) on (4, 2), gives the whole op:
    each rank runs its own groups over the rows, the other groups' rows zeroed (the
    masked ragged dot reads a rank's offset: test_inference_programs' per-rank
    simulation cannot run it). Even and uneven (a pad group) splits of the groups, an
    empty group, a row in no group."""
    fn, shapes = RAGGED_DOTS[name]
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes(len(groups))]
    values.append(np.asarray(groups, np.int32))
    (eqn,) = jax.make_jaxpr(fn)(*values).jaxpr.eqns
    expected = np.asarray(fn(*values))
    definition = primitive_definition("ragged_dot_general")
    specs = tuple(TensorSpec(v.shape, v.dtype, Layout(MESH42, ((),) * v.ndim)) for v in values)
    signature = signature_for(("primitive", "ragged_dot_general"), freeze(dict(definition.read_params(eqn.params))),
                              specs, (Aval(expected.shape, expected.dtype),), default_cost_model(), MESH42)

    def whole(shape: tuple[int, ...]) -> Any:
        return physical(Layout(MESH42, ((),) * len(shape)), shape)

    own_groups = 0
    for candidate in signature.candidates:
        targets = [physical(layout, v.shape) for layout, v in zip(candidate.in_layouts, values)]
        out = physical(candidate.out_layouts[0], expected.shape)
        if operators._split_groups(eqn.primitive.name, eqn.params, targets, [out]) is None:
            continue  # run on blocks: test_inference_programs' PRIM_CASES simulate them per rank
        def run(*arrays: jax.Array, targets: Any = targets, out: Any = out) -> jax.Array:
            ins = [operators._Value(a, whole(a.shape)) for a in arrays]
            return operators._run_local(eqn, ins, targets, [out])[0]

        result = jax.jit(run)(*values)  # eagerly, shard_map compiles its body op by op (~3 s per candidate)
        np.testing.assert_allclose(np.asarray(convert(result, out, whole(expected.shape))), expected, rtol=1e-5,
                                   atol=1e-5, err_msg=str(candidate))
        own_groups += 1
    assert own_groups >= 2  # the groups split over a, with b's dims split or not


@pytest.mark.parametrize("mode", ["clip", "fill", "promise_in_bounds"])
def test_apply_masked_lookup_of_out_of_range_ids_follows_the_mode(mode: str) -> None:
    """The masked lookup clamps out-of-range ids as XLA does (clip) or gives the fill
    value once (on the first rank of the partial sum)."""
    table = _data((VOCAB, WIDTH), 46)
    ids = np.array([[0, 9, 12], [4, -1, -11]], np.int32)
    if mode == "promise_in_bounds":
        ids = ids % VOCAB

    def fn(t: jax.Array, i: jax.Array) -> jax.Array:
        return t.at[i].get(mode=mode, fill_value=-5.0 if mode == "fill" else None)

    expected = np.asarray(jax.jit(fn)(table, ids))
    for placements in ("S(0),R", "R,S(0)"):
        result = apply(fn, _dt(table, MESH42, placements), _dt(ids, MESH42, "R,R"), execute="ops")
        assert Partial("sum") in result.placements
        np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=1e-6, err_msg=placements)


# coordinates of points in a (VOCAB, WIDTH) table, some out of range (jnp's -3: row 7, -1: column 5)
POINT_ROWS = np.array([[0, 9, 3, 3], [4, -3, 12, 9]], np.int32)
POINT_COLUMNS = np.array([[0, 5, 2, 2], [7, 1, -1, 4]], np.int32)


@pytest.mark.parametrize("execute", ["ops", "xla", "pinned"])
@pytest.mark.parametrize("mode", ["clip", "fill", "promise_in_bounds"])
def test_apply_point_lookup_of_a_table_split_on_both_dims(mode: str, execute: str) -> None:
    """``x[rows, cols]`` on a table split on both dims (unevenly: 10 rows over 4 ranks,
    6 columns over 2, and the other way round) is the masked lookup on both: a rank
    gathers the points whose two coordinates fall in its blocks (a partial sum over both
    mesh axes under "ops"); out-of-range ones clamp (clip) or give the fill value once."""
    table = _data((VOCAB, WIDTH), 47)
    rows, columns = POINT_ROWS, POINT_COLUMNS
    if mode == "promise_in_bounds":
        rows, columns = rows % VOCAB, columns % WIDTH

    def fn(t: jax.Array, i: jax.Array, j: jax.Array) -> jax.Array:
        return t.at[i, j].get(mode=mode, fill_value=-5.0 if mode == "fill" else None)

    expected = np.asarray(jax.jit(fn)(table, rows, columns))
    for placements in ("S(0),S(1)", "S(1),S(0)"):
        args = (_dt(table, MESH42, placements), _dt(rows, MESH42, "R,R"), _dt(columns, MESH42, "R,R"))
        result = apply(fn, *args, execute=execute)
        if execute == "ops":
            assert result.placements == (Partial("sum"), Partial("sum"))
        np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=1e-6, err_msg=placements)


@pytest.mark.parametrize("mode", INDEX_MODES)
@pytest.mark.parametrize("kind", SCATTER_KINDS)
def test_apply_point_scatters_of_every_kind_into_a_table_split_on_both_dims(kind: str, mode: str) -> None:
    """``x.at[rows, cols].<kind>(v)`` into a table split on both dims (unevenly) keeps the
    table's layout: each rank applies the updates of the points it owns and drops the
    others; repeated and out-of-range points as XLA treats them."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    rows, columns = POINT_ROWS, POINT_COLUMNS
    if mode == "promise_in_bounds":
        rows, columns = rows % VOCAB, columns % WIDTH
    u = rng.standard_normal(rows.shape).astype(np.float32)

    def fn(t: jax.Array, i: jax.Array, j: jax.Array, v: jax.Array) -> jax.Array:
        return getattr(t.at[i, j], kind)(v, mode=mode)

    expected = np.asarray(jax.jit(fn)(table, rows, columns, u))
    for placements in ("S(0),S(1)", "S(1),S(0)"):
        t = _dt(table, MESH42, placements)
        args = (t, _dt(rows, MESH42, "R,R"), _dt(columns, MESH42, "R,R"), _dt(u, MESH42, "R,R"))
        assert predict(fn, *args, search="eager").out_layouts == (t.layout,)
        result = apply(fn, *args, execute="ops")
        np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=1e-6, err_msg=placements)


def _repetition_penalty(logits: jax.Array, previous: jax.Array) -> jax.Array:
    """A sampler's repetition penalty (CTRL's, as Hugging Face's Flax processors apply it):
    the logits of tokens already generated divided (positive) or multiplied by 1.3."""
    rows = jnp.arange(logits.shape[0])[:, None]
    picked = logits[rows, previous]
    return logits.at[rows, previous].set(jnp.where(picked > 0, picked / 1.3, picked * 1.3))


def test_a_repetition_penalty_keeps_logits_split_on_batch_and_vocabulary() -> None:
    """The repetition penalty on logits split over batch (dp) and vocabulary (tp): the
    point lookup of the previous tokens' logits is masked on both dims (an all-reduce of
    the small (8, 4) result) and the point scatter back too, as XLA partitions them (320
    B per device, XLA's; 896 before, when the scatter took the logits whole); values of
    the three executors."""
    logits, previous = _data((8, 32), 48), np.random.default_rng(4).integers(0, 32, (8, 4)).astype(np.int32)
    layout = Layout.from_device_mesh(MESH2)
    report = check(_repetition_penalty, ((8, 32), jnp.float32, layout("S(0),S(1)")),
                   ((8, 4), jnp.int32, layout("R,R")))
    assert report.communication == "equal" and report.agrees
    assert report.predicted_bytes == report.compiled_bytes == 320
    expected = np.asarray(jax.jit(_repetition_penalty)(logits, previous))
    for execute in ("ops", "xla", "pinned"):
        result = apply(_repetition_penalty, _dt(logits, MESH2, "S(0),S(1)"), _dt(previous, MESH2, "R,R"),
                       execute=execute)
        assert result.placements == (Shard(0), Shard(1)), execute
        np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=1e-6, err_msg=execute)


def _partial_scan(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A linear recurrence over the rows of a contraction's partial sums."""
    return lax.scan(lambda c, r: (c * 0.5 + r, c * 2.0), jnp.zeros(w.shape[1]), x @ w)


# loops and branches carrying a Partial(sum) (a matmul's over its split contraction dim), and a real one: optax's CTC
# loss (a scan of its alignment recursion) on logits split over their classes
PARTIAL_LOOPS = {
    "scan": _partial_scan,
    "its gradient": lambda x, w: jax.grad(lambda v: jnp.sum(jnp.tanh(_partial_scan(x, v)[1])))(w),
    "fori_loop": lambda x, w: lax.fori_loop(0, x.shape[0], lambda i, c: c + (x @ w)[i] * i, jnp.zeros(w.shape[1])),
    "while_loop": lambda x, w: lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 0.5 + (x @ w)[0], c[1] + 1),
                                              (jnp.zeros(w.shape[1]), 0))[0],
    "cond": lambda x, w: lax.cond(x[0, 0] > 0, lambda a: a * 2.0, lambda a: a - 1.0, x @ w),
    "optax ctc_loss": lambda x, w: optax.ctc_loss((x @ w).reshape(2, 3, -1), jnp.zeros((2, 3)),
                                                  jnp.ones((2, 2), jnp.int32), jnp.zeros((2, 2))),
}


@pytest.mark.parametrize("name", sorted(PARTIAL_LOOPS))
def test_apply_loops_carrying_partial_sums(name: str) -> None:
    """A scan (and its gradient), fori_loop, while_loop and cond over a matmul's partial
    sums under "ops": on an Explicit mesh a Partial(sum) is JAX ``unreduced``, which a
    scan cannot slice or stack (JAX 0.10.2 raised "unreduced rule for dynamic_slice is
    not implemented"); loops carry its stacked blocks instead. The three executors give
    jax.jit's values, "ops" keeps torch's partial results."""
    fn = PARTIAL_LOOPS[name]
    x, w = _data((6, 16), 49), _data((16, 8), 50)
    want = jax.tree.leaves(jax.jit(fn)(x, w))
    for execute in ("ops", "xla", "pinned"):
        got = jax.tree.leaves(apply(fn, _dt(x, MESH2, "R,S(1)"), _dt(w, MESH2, "R,S(0)"), execute=execute),
                              is_leaf=lambda t: isinstance(t, DTensor))
        for g, v in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(v), rtol=1e-4, atol=1e-4,
                                       err_msg=execute)
    if name == "scan":
        assert all(Partial("sum") in g.placements for g in apply(fn, _dt(x, MESH2, "R,S(1)"),
                                                                    _dt(w, MESH2, "R,S(0)"), execute="ops"))


# static slices of split dims, as (function, operands' (shape, placements), predicted bytes per device, XLA's): the
# last token's hidden state of a sequence-split activation projected (sampling after a prefill), a [CLS] pooling,
# a corner of a split matrix, a strided slice, the last token's gradient (before the masked slice: 240, 480, 896,
# 108 and 592 B, each gathering the operand)
MASKED_SLICES = {
    "last token": (lambda h, w: h[:, -1] @ w, [((4, 16, 8), "S(0),S(1)"), ((8, 32), "R,S(1)")], 96, 160),
    "cls pooling": (lambda h: jnp.tanh(h[:, 0]), [((4, 16, 8), "R,S(1)")], 208, 192),
    "corner": (lambda x: x[1:3, 5:7] * 2.0, [((8, 32), "S(0),S(1)")], 28, 72),
    "strided": (lambda x: x[:, 3:30:7] + 1.0, [((8, 32), "S(0),S(1)")], 96, 0),
    "last token gradient": (jax.grad(lambda h, w: jnp.sum((h[:, -1] @ w) ** 2), argnums=(0, 1)),
                            [((4, 16, 8), "S(0),S(1)"), ((8, 32), "R,S(1)")], 448, 512),
    # dynamic slices (before: the operand moved or gathered, 496 and 138 B)
    "a cache's row at a traced position": (
        lambda c, u: lax.dynamic_slice_in_dim(c, jnp.argmax(u[0, 0, 0, :4]) + 5, 1, axis=1) * 2.0,
        [((2, 16, 4, 8), "S(0),S(1)"), ((2, 1, 4, 8), "S(0),R")], 208, 1552),
    "rows read in a loop to a traced bound": (
        lambda x: lax.fori_loop(0, jnp.argmax(x[0, :4]) + 1, lambda i, c: c + x[i], jnp.zeros(32)),
        [((8, 32), "S(0),S(1)")], 90, 204),
}


@pytest.mark.parametrize("name", sorted(MASKED_SLICES))
def test_a_slice_of_a_split_dim_is_masked(name: str) -> None:
    """A static or dynamic slice taking at most half of a split dim: each rank keeps the
    window's rows its block holds, zeros elsewhere (P(sum), reduced on the small result)
    where the operand was gathered before: the bytes below (XLA's beside them: it sends 0
    on the strided slice, whose 4 columns fall one per tp rank, and less on the pooled
    tanh); the three executors give jax.jit's values."""
    fn, shapes, predicted, compiled = MASKED_SLICES[name]
    layout = Layout.from_device_mesh(MESH2)
    report = check(fn, *((shape, jnp.float32, layout(p)) for shape, p in shapes))
    assert (report.predicted_bytes, report.compiled_bytes) == (predicted, compiled)
    arrays = [_data(shape, 51 + i) for i, (shape, _) in enumerate(shapes)]
    want = jax.tree.leaves(jax.jit(fn)(*arrays))
    for execute in ("ops", "xla", "pinned"):
        got = jax.tree.leaves(apply(fn, *(_dt(a, MESH2, p) for a, (_, p) in zip(arrays, shapes)), execute=execute),
                              is_leaf=lambda t: isinstance(t, DTensor))
        for g, v in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(v), rtol=1e-5, atol=1e-5,
                                       err_msg=execute)


@pytest.mark.parametrize("placements", ["S(0),S(1)", "S(1),S(0)", "R,S(1)"])
def test_apply_masked_slices_of_uneven_blocks(placements: str) -> None:
    """The masked slice on uneven blocks (10 rows over 4 ranks: 3, 3, 3, 1; over 2: 5,
    5), its window across two ranks' blocks and strided: every rank's rows at their
    index minus its offset, as run by "ops" (a partial sum over the sliced dims' mesh
    axes, as eager dispatch chooses it) and the other executors."""
    x = _data((3, 10, 8), 52)

    def fn(h: jax.Array) -> jax.Array:
        return h[:, 2:5] * 3.0 + h[:, 9:0:-1][:, ::4].sum()  # rows 2-4; 9, 5, 1 of the reversed dim: a rev, then a slice

    want = np.asarray(jax.jit(fn)(x))
    for execute in ("ops", "xla", "pinned"):
        got = apply(fn, _dt(x, MESH42, placements), execute=execute)
        np.testing.assert_allclose(np.asarray(got.full_tensor()), want, rtol=1e-5, atol=1e-5, err_msg=execute)
    sliced = [e.outputs[0].layout for e in predict(fn, _dt(x, MESH42, placements), search="eager").equations
              if e.primitive == "slice"]
    assert sliced[0].has_partial  # rows 2-4 from the ranks splitting the sequence (eager dispatch's choice)


def _negated_by_its_sign_bits(x: jax.Array) -> jax.Array:
    """-x through its bytes: a bitcast to uint8 (a trailing dim of 4), the sign bit of the
    last (little-endian) byte flipped, a bitcast back."""
    flipped = lax.bitcast_convert_type(x, jnp.uint8) ^ jnp.array([0, 0, 0, 0x80], jnp.uint8)
    return lax.bitcast_convert_type(flipped, jnp.float32) * 2.0


@pytest.mark.parametrize(("mesh", "shape", "placements"), [
    (MESH2, (8, 32), "S(0),S(1)"), (MESH2, (8, 32), "S(1),S(0)"), (MESH42, (6, 10), "S(1),S(0)"),
])
def test_a_bitcast_to_bytes_and_back_keeps_the_splits(mesh: DeviceMesh, shape: tuple[int, ...], placements: str) -> None:
    """A bitcast to a narrower dtype adds a trailing dim of one element's bytes, back to the
    wider one takes it away: the dims before it keep their splits (it gathered the operand
    before: 896 B on the even case, where XLA sends none), on uneven blocks too; the three
    executors give jax.jit's values."""
    x = _data(shape, 53)
    dt = _dt(x, mesh, placements)
    if mesh is MESH2:  # check compiles XLA's program: even blocks only
        report = check(_negated_by_its_sign_bits, dt)
        assert (report.predicted_bytes, report.compiled_bytes) == (0, 0)
    assert str(predict(_negated_by_its_sign_bits, dt).outputs[0].layout) == placements
    want = np.asarray(jax.jit(_negated_by_its_sign_bits)(x))
    np.testing.assert_array_equal(want, -2.0 * x)
    for execute in ("ops", "xla", "pinned"):
        got = apply(_negated_by_its_sign_bits, dt, execute=execute)
        np.testing.assert_array_equal(np.asarray(got.full_tensor()), want, err_msg=execute)


def _cache_write(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """A decoding step's key/value cache write at a traced position."""
    return lax.dynamic_update_slice(cache, new, (0, pos, 0, 0)) * 1.0


def test_a_cache_split_over_its_sequence_is_written_where_its_block_holds_the_position() -> None:
    """``dynamic_update_slice`` of one step's keys into a cache split over its sequence
    dim (context-parallel decoding): each rank writes the rows of the window its block
    holds (the masked update), where the cache was moved to a heads split and back
    before (784 B per device; XLA masks it too: 16 B, the position's argmax all-reduced
    over dp). The three executors give jax.jit's cache, the position traced."""
    cache, new = _data((2, 16, 4, 8), 54), _data((2, 1, 4, 8), 55)

    def fn(c: jax.Array, u: jax.Array) -> jax.Array:
        return _cache_write(c, u, jnp.argmax(u[0, 0, 0, :4]) + 5)

    layout = Layout.from_device_mesh(MESH2)
    report = check(fn, (cache.shape, jnp.float32, layout("S(0),S(1)")), (new.shape, jnp.float32, layout("S(0),R")))
    assert (report.predicted_bytes, report.compiled_bytes) == (16, 16), report
    assert all(o.verdict == "equal" for o in report.outputs), report
    want = np.asarray(jax.jit(fn)(cache, new))
    for execute in ("ops", "xla", "pinned"):
        got = apply(fn, _dt(cache, MESH2, "S(0),S(1)"), _dt(new, MESH2, "S(0),R"), execute=execute)
        assert str(got.layout) == "S(0),S(1)", execute
        np.testing.assert_array_equal(np.asarray(got.full_tensor()), want, err_msg=execute)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("placements", ["R,S(1)", "S(1),S(0)"])
def test_apply_masked_updates_of_uneven_blocks(placements: str, size: int) -> None:
    """The masked update on uneven blocks (10 rows over 4 ranks: 3, 3, 3, 1), windows of
    1-3 rows within one rank's block, across two, at either end, and starts clamped as
    JAX clamps them (before the dim, past its end): "ops" and "pinned" write jax.jit's
    rows, and "auto" runs "pinned" (:mod:`.inference.xla_defects`: XLA drops a one-row
    window past the end where it splits the dim; plain jax.jit of that program on these
    shardings writes nothing there)."""
    from placements2jax.inference.xla_defects import needs_pinned

    cache, new = _data((2, 10, 4, 8), 56), _data((2, size, 4, 8), 57)
    assert needs_pinned(jax.make_jaxpr(_cache_write)(cache, new, 0).jaxpr, MESH42) == (size == 1)
    dt, update = _dt(cache, MESH42, placements), _dt(new, MESH42, "R,R")
    assert [str(e.inputs[0].layout) for e in predict(_cache_write, dt, update, jnp.int32(0)).equations
            if e.primitive == "dynamic_update_slice"] == [placements]  # written where it is
    for pos in (-2, 0, 2, 3, 8, 9, 12):
        want = np.asarray(jax.jit(_cache_write)(cache, new, pos))
        for execute in ("ops", "pinned", "auto"):
            got = apply(_cache_write, dt, update, jnp.int32(pos), execute=execute)
            np.testing.assert_array_equal(np.asarray(got.full_tensor()), want, err_msg=f"{execute} at {pos}")


@pytest.mark.parametrize("placements", ["S(0),S(1)", "S(1),S(0)", "R,S(1)"])
def test_apply_masked_dynamic_slices_of_uneven_blocks(placements: str) -> None:
    """The masked dynamic slice on uneven blocks (10 rows over 4 ranks: 3, 3, 3, 1; over
    2: 5, 5): windows of 1-3 rows within a block, across two, at either end, and starts
    clamped as JAX clamps them (before the dim, past its end), as "ops" runs it (the
    partial sum eager dispatch chooses) and the other executors."""
    x = _data((3, 10, 8), 58)
    dt = _dt(x, MESH42, placements)
    for size in (1, 2, 3):
        def fn(h: jax.Array, i: jax.Array, size: int = size) -> jax.Array:
            return lax.dynamic_slice_in_dim(h, i, size, axis=1) * 3.0

        assert [e.outputs[0].layout.has_partial for e in predict(fn, dt, jnp.int32(0), search="eager").equations
                if e.primitive == "dynamic_slice"] == [True]  # eager dispatch takes the masked slice
        for i in (-2, 0, 2, 3, 8, 9, 12):
            want = np.asarray(jax.jit(fn)(x, i))
            for execute in ("ops", "xla", "pinned"):
                got = apply(fn, dt, jnp.int32(i), execute=execute)
                np.testing.assert_allclose(np.asarray(got.full_tensor()), want, rtol=1e-6, err_msg=f"{execute} {i}")


def test_apply_follows_the_planned_redistributions_of_intermediates() -> None:
    a, b = _data((8, 12), 23), _data((12, 16), 24)
    x, w = _dt(a, MESH2, "S(0),S(1)"), _dt(b, MESH2, "R,S(0)")

    def fn(u: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.tanh(u @ v) @ v.T  # the partial product must be reduced before tanh

    prediction = predict(fn, x, w, search="eager")
    assert prediction.steps  # an intermediate is redistributed
    result = apply(fn, x, w, execute="ops")
    assert result.layout == prediction.out_layouts[0]
    np.testing.assert_allclose(np.asarray(result.full_tensor()), np.tanh(a @ b) @ b.T, rtol=1e-5, atol=1e-4)


def _scan_layers(h: jax.Array, ws: jax.Array) -> tuple[jax.Array, jax.Array]:
    def layer(c: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = jnp.tanh(c @ w)
        return out, out.sum(0)  # a stacked partial output when rows are split

    return jax.lax.scan(layer, h, ws)


def _while_sine(x: jax.Array) -> jax.Array:
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.sin(c[0]) * 2, c[1] + 1), (x, 0))[0]


def _halved_per_row(x: jax.Array) -> jax.Array:
    """A vmapped while_loop whose condition reads the row: a batched predicate (one per row),
    each row halved until its largest magnitude is at most 1 (rows stop at different steps)."""
    row_loop = lambda r: jax.lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 1.0, lambda v: v * 0.5, r)  # noqa: E731
    return jax.vmap(row_loop)(x * 8.0)


def _switch(x: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.switch(i, [lambda a: a.sum(1), lambda a: a.max(1), lambda a: a[:, 0]], x)


@pytest.mark.parametrize("execute, search", [("ops", "eager"), ("pinned", "program")])
@pytest.mark.parametrize("rows", [8, 7])  # 7: uneven over dp
def test_apply_runs_loops_under_the_predicted_layouts(rows: int, execute: str, search: str) -> None:
    """scan (carry fixed point, stacked Partial outputs), while (also vmapped, its predicate
    batched) and cond/switch run per iteration under the loop rows' layouts, eagerly, under
    jit and under grad (op by op, and pinned in one program)."""
    a, ws = _data((rows, 16), 40), _data((3, 16, 16), 41) / 4
    x, w = _dt(a, MESH2, "S(0),R"), _dt(ws, MESH2, "R,S(2)")
    for fn, args, plain in [
        (_scan_layers, (x, w), (a, ws)),
        (_while_sine, (x,), (a,)),
        (_halved_per_row, (x,), (a,)),
        (_switch, (x, 1), (a, 1)),
        (jax.grad(lambda w_, x_: _scan_layers(x_, w_)[0].sum()), (w, x), (ws, a)),
    ]:
        layouts = predict(fn, *args, search=search).out_layouts
        for result in (apply(fn, *args, execute=execute), jax.jit(functools.partial(apply, fn, execute=execute))(*args)):
            leaves = jax.tree.leaves(result, is_leaf=lambda v: isinstance(v, DTensor))
            assert [leaf.layout for leaf in leaves] == list(layouts)
            for leaf, want in zip(leaves, jax.tree.leaves(fn(*plain))):
                np.testing.assert_allclose(np.asarray(leaf.full_tensor()), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert any(layout.has_partial for layout in predict(_scan_layers, x, w, search="eager").out_layouts)


def test_pinned_scan_keeps_its_carries_in_the_predicted_layouts() -> None:
    """execute="pinned" pins a loop's carries where its body receives them: XLA compiles
    the predicted program, no more. GPT-2's adamw step (4 scanned layers, Megatron on a
    (8,) mesh, a batch of 8 split over it) carries its backward scan's Replicate
    (8, 8, 32) f32 residual gradient; with only the carry the body returns pinned, XLA
    carried it split on dim 0 and all-gathered it again in the body and after the loop
    (106,407 B compiled against 92,071 predicted). Predicted and pinned 81,424 B since the
    whole-program replicas' restart (jaxpr._replicas_restart; 92,071 before). The loss and
    the parameters (in their layouts) equal plain jax.jit's step's. A test of pinning: under the
    search's own overhead (cost.SEARCH_OVERHEAD, 192 B per collective); the latency-bound default
    predicts 94,759 B, which pinned compiles too, in 17 collectives after the combiner where 16."""
    with use_cost_model(CostModel(collective_overhead=SEARCH_OVERHEAD)):
        _pinned_scan_keeps_its_carries()


def _pinned_scan_keeps_its_carries() -> None:
    mesh = init_device_mesh((8,), ("tp",))
    step = training_step("gpt2", mesh, layers=4)
    cfg = gpt2.Config(layers=4)
    batch = [distribute_tensor(a, mesh, "S(0)") for a in common.batch(0, 8, cfg.seq, cfg.vocab)]
    step = Step("gpt2", step.fn, (*step.args[:2], *batch, step.args[-1]))
    prediction = predict(step.fn, *step.args, out_layouts=step.out_layouts)
    pinned = jax.jit(functools.partial(apply, step.fn, out_layouts=step.out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, *step.args)
    assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.lowered_nbytes == 81424
    params, _, loss = pinned(*step.args)
    want_params, _, want_loss = step.plain_jit()(*step.plain_args())
    np.testing.assert_allclose(float(loss.full_tensor()), float(want_loss), rtol=1e-5)
    for got, want, layout in zip(jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, DTensor)),
                                 jax.tree.leaves(want_params),
                                 jax.tree.leaves(step.args[0], is_leaf=lambda v: isinstance(v, DTensor)), strict=True):
        assert got.layout == layout.layout
        # adamw moves a weight by up to its learning rate (1e-3) however small the gradient:
        # the sums' order shows at 1e-6 (tests/test_frameworks.py's LEARNING_RATE / 100)
        np.testing.assert_allclose(np.asarray(got.full_tensor()), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("fn", "shapes", "placements", "out", "nbytes"), [
    # GPT-2's token + position embeddings on 4x2 at FSDP's plan: the (1, 8, 32) positions split over a on their last
    # dim, moved under the tokens' (b, a) split of it. Priced on unpadded blocks the route went through S(0) (192 +
    # 96 B), which XLA pads to 4 rows: 1,152 B compiled; priced as XLA pads, it goes through S(1), 288 B as compiled
    (lambda x, y: x + y, ((4, 8, 32), (1, 8, 32)), ((None, None, ("b", "a")), "S(2),R"), (None, None, ("b", "a")), 288),
    # 6 rows over 4 ranks (2, 2, 2, 0): XLA exchanges the padded (2, 8, 32) block, 1,536 B, not 1,152
    (lambda y: 2 * y, ((6, 8, 32),), ("S(0),R",), "S(1),R", 1536),
])
def test_pinned_uneven_all_to_alls_compile_at_their_predicted_bytes(
    fn: Any, shapes: Any, placements: Any, out: Any, nbytes: int
) -> None:
    """An all-to-all of an uneven split is priced on the blocks XLA exchanges (the held
    block padded to a multiple of the group on the dim it moves to): the pinned program
    compiles to the predicted bytes, with plain jax.jit's values."""
    arrays = [_data(shape, 50 + i) for i, shape in enumerate(shapes)]
    args = [_dt(a, MESH42, p) for a, p in zip(arrays, placements)]
    out_layouts = Layout.from_device_mesh(MESH42)(out)
    prediction = predict(fn, *args, out_layouts=out_layouts)
    pinned = jax.jit(lambda *a: apply(fn, *a, out_layouts=out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.lowered_nbytes == nbytes
    assert [c.op for c in compiled] == ["all-to-all"] * len(compiled)
    result = pinned(*args)
    assert result.layout == prediction.out_layouts[0]
    np.testing.assert_allclose(np.asarray(result.full_tensor()), np.asarray(jax.jit(fn)(*arrays)), rtol=1e-6)


@pytest.mark.parametrize(("mesh", "shape", "src", "out", "ops", "nbytes"), [
    # 6 rows over a (4): XLA gathers 8 padded rows, 6,144 B (priced 4,608 on unpadded blocks)
    (MESH42, (6, 8, 32), "S(0),R", "R,R", ["all-gather"], 6144),
    # 3 rows over b (2), a sub-mesh axis: 4 padded rows, 2,048 B (1,536 unpadded)
    (MESH42, (3, 8, 32), "R,S(0)", "R,R", ["all-gather"], 2048),
    # 1 row over b (1 <= 2 // 2): XLA writes it into zeros and all-reduces, 1,024 B (512 as an all-gather)
    (MESH42, (1, 8, 32), "R,S(0)", "R,R", ["all-reduce"], 1024),
    # 9 rows over 8: the planned all-to-all to the even dim 1 then its gather (1,792 + 8,064 B) beat the padded
    # all-gather of 16 rows XLA compiles for the move in one (14,336 B): an uneven output's move is pinned step by step
    (init_device_mesh((8,), ("x",)), (9, 8, 32), "S(0)", "R", ["all-to-all", "all-gather"], 9856),
    # two mesh dims gathered, a first as planned (XLA's own route for the move in one gathers b first: 7,168 B)
    (MESH42, (6, 8, 32), "S(0),S(1)", "R,R", ["all-gather", "all-gather"], 6144),
])
def test_pinned_uneven_gathers_compile_at_their_predicted_bytes(
    mesh: Any, shape: Any, src: str, out: str, ops: list[str], nbytes: int
) -> None:
    """An all-gather of an uneven split is priced as XLA compiles it (a padded all-gather,
    or an all-reduce of a short dim, cost.gather_block_bytes), and a pinned program's
    output move takes the planned steps: the program compiles to the predicted bytes."""
    array = _data(shape, 60)
    x = _dt(array, mesh, src)
    out_layouts = Layout.from_device_mesh(mesh)(out)
    prediction = predict(lambda y: 2 * y, x, out_layouts=out_layouts)
    pinned = jax.jit(lambda a: apply(lambda y: 2 * y, a, out_layouts=out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, x)
    assert sum(collective_nbytes(c, mesh.size()) for c in compiled) == prediction.lowered_nbytes == nbytes
    assert [c.op for c in compiled] == ops
    assert prediction.combined_counts == Counter(ops)  # a short dim's gather counts as XLA's all-reduce
    rules = combiner_rules("cpu")
    assert [kind for step in prediction.steps for kind, _ in lowered_step(step, rules, array.dtype)] == ops  # each step
    result = pinned(x)
    assert result.layout == prediction.out_layouts[0]
    np.testing.assert_allclose(np.asarray(result.full_tensor()), 2 * array, rtol=1e-6)


@pytest.mark.parametrize("execute", ["xla", "pinned"])
@pytest.mark.parametrize("rows", [8, 7])  # 7: uneven over dp
def test_apply_xla_is_exact_on_uneven_and_partial_layouts(rows: int, execute: str) -> None:
    """execute="xla" / "pinned": inputs' partials are reduced and pads removed before XLA
    runs fn; outputs take the whole-program prediction's layouts (with "xla" a Partial
    made locally, with "pinned" the planned partial sum), with the function's values,
    eagerly and under jit; out_layouts are enforced."""
    a, b = _data((rows, 16), 42), _data((16, 12), 43) / 4
    x, w = _dt(a, MESH2, "S(0),R"), _dt(b, MESH2, "P,S(1)")  # w: a Partial(sum) input
    fns = [
        (lambda u, v: jnp.tanh(u @ v), None),
        (lambda u, v: (u @ v, (u @ v).sum(0)), None),
        (lambda u, v: u @ v, "S(0),P"),  # a Partial output, asked for
    ]
    for fn, out in fns:
        out_layouts = None if out is None else Layout.from_device_mesh(MESH2)(out)
        want = predict(fn, x, w, out_layouts=out_layouts).out_layouts
        for result in (
            apply(fn, x, w, out_layouts=out_layouts, execute=execute),
            jax.jit(lambda u, v, fn=fn, o=out_layouts, e=execute: apply(fn, u, v, out_layouts=o, execute=e))(x, w),
        ):
            leaves = jax.tree.leaves(result, is_leaf=lambda v: isinstance(v, DTensor))
            assert [leaf.layout for leaf in leaves] == list(want)
            for leaf, expected in zip(leaves, jax.tree.leaves(fn(a, b))):
                np.testing.assert_allclose(np.asarray(leaf.full_tensor()), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert [str(layout) for layout in want] == ["S(0),P"]



def test_apply_default_compiles_a_function_without_registered_calls_whole() -> None:
    """execute="auto" (the default) is "xla" when fn calls no registered function: the
    same program as execute="xla", not the op-by-op one."""
    x = _dt(_data((8, 12), 44), MESH2, "S(0),S(1)")
    fn = functools.partial(jnp.sum, axis=1, keepdims=True)
    lowered = {
        execute: jax.jit(functools.partial(apply, fn, execute=execute)).lower(x).as_text()
        for execute in ("auto", "xla", "ops")
    }
    assert lowered["auto"] == lowered["xla"] != lowered["ops"]


def _grouped_conv_loss(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """A causal grouped conv (16 channels in 4 groups, width 3; Mamba's depthwise conv
    with wider groups) of ``x`` (batch, time, channels), its squares summed."""
    out = lax.conv_general_dilated(x, w, (1,), [(2, 0)], dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=4)
    return jnp.sum((out + b) ** 2)


@pytest.mark.parametrize("w_placements", ["R,R", "R,S(2)"])
def test_apply_auto_runs_a_grouped_conv_gradient_as_planned(w_placements: str) -> None:
    """execute="auto" runs a grouped conv's gradient on dp=2 x tp=4 (the batch over dp, the
    kernel replicated or its output channels over tp) as the pinned plan (inside
    jax.set_mesh of the Explicit mesh op by op): values and every device's block are
    one-device jax.jit's, eagerly and under jax.jit. (XLA's own program,
    execute="xla", all-reduces the kernel's batch-grouped gradient conv over all 8 devices
    with JAX 0.10.2: 4x the gradient, docs/inference.md.)"""
    x, w, b = _data((8, 12, 16), 60), _data((3, 4, 16), 61), _data((16,), 62)
    args = (_dt(x, MESH2, "S(0),R"), _dt(w, MESH2, w_placements), _dt(b, MESH2, "R,R"))
    step = jax.value_and_grad(_grouped_conv_loss, argnums=(0, 1, 2))
    want = jax.tree.leaves(jax.jit(step)(x, w, b))
    with jax.set_mesh(MESH2.to_jax()):  # the pinned program compiles as "xla" here: "auto" runs "ops"
        inside = apply(step, *args)
    for got in (apply(step, *args), jax.jit(functools.partial(apply, step))(*args), inside):
        for result, expected in zip(jax.tree.leaves(got, is_leaf=lambda v: isinstance(v, DTensor)), want, strict=True):
            expected = np.asarray(expected)
            np.testing.assert_allclose(np.asarray(result.full_tensor()), expected, rtol=1e-4, atol=1e-3)
            reference = distribute_tensor(expected, MESH2, result.layout.without_partial())
            blocks = result.redistribute(placements=result.layout.without_partial()).array
            np.testing.assert_allclose(np.asarray(blocks), np.asarray(reference.array), rtol=1e-4, atol=1e-3)


def test_auto_picks_the_pinned_plan_for_a_batch_grouped_conv_on_a_2d_mesh() -> None:
    """_auto_execute sends a program to "pinned" for its batch-grouped conv (the weight
    gradient of a grouped conv, in a sub-jaxpr too) on a mesh of two axes of size > 1
    only: the forward and the input gradient alone (feature-grouped convs), a dense conv's
    weight gradient, and the same gradient on a 1-D mesh or on (1, 4) stay with XLA;
    inside jax.set_mesh of an Explicit mesh (``explicit``) it is "ops"."""
    from placements2jax.operators import _auto_execute

    x, w, b = np.zeros((8, 12, 16), np.float32), np.zeros((3, 4, 16), np.float32), np.zeros((16,), np.float32)

    def dense(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(lax.conv_general_dilated(x, w, (1,), [(2, 0)], dimension_numbers=("NWC", "WIO", "NWC")) ** 2)

    jaxprs = {
        "weight gradient": jax.make_jaxpr(jax.grad(_grouped_conv_loss, argnums=1))(x, w, b).jaxpr,
        "under jit": jax.make_jaxpr(jax.jit(jax.grad(_grouped_conv_loss, argnums=(0, 1))))(x, w, b).jaxpr,
        "forward": jax.make_jaxpr(_grouped_conv_loss)(x, w, b).jaxpr,
        "input gradient": jax.make_jaxpr(jax.grad(_grouped_conv_loss))(x, w, b).jaxpr,
        "dense weight gradient": jax.make_jaxpr(jax.grad(dense, argnums=1))(x, np.zeros((3, 16, 16), np.float32)).jaxpr,
    }
    for explicit, executor in ((False, "pinned"), (True, "ops")):  # inside set_mesh of an Explicit mesh: "ops"
        chosen = {(name, mesh): _auto_execute(jaxpr, MESHES[mesh], explicit)
                  for name, jaxpr in jaxprs.items() for mesh in MESHES}
        sent = {key for key, value in chosen.items() if value != "xla"}
        assert sent == {("weight gradient", "2d"), ("under jit", "2d")}
        assert set(chosen.values()) == {executor, "xla"}


@pytest.mark.parametrize("execute", ["xla", "ops", "pinned"])
def test_apply_under_eager_grad_inside_set_mesh_on_an_uneven_input(execute: str) -> None:
    """Inside jax.set_mesh the inputs stay Explicit-typed: execute="xla" slices the pad
    of an uneven input (7 rows over dp=2) and places its output under auto_axes."""
    a = _data((7, 12), 45)
    x = _dt(a, MESH2, "S(0),S(1)")
    with jax.set_mesh(MESH2.to_jax()):
        grad = jax.grad(lambda t: apply(jnp.sin, t, execute=execute).full_tensor().sum())(x)
    assert grad.layout == x.layout
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), np.cos(a), rtol=1e-6)

@pytest.mark.parametrize("context", ["auto twin", "another mesh"])
def test_operators_and_apply_inside_set_mesh_of_another_mesh(context: str) -> None:
    """Inside jax.set_mesh of a mesh other than the DTensors' (their mesh's Auto twin, as
    code written for jax.make_mesh sets; or an unrelated one), the library's own
    shard_maps were refused raw ("The context mesh ... should match the mesh passed to
    shard_map"): a matmul making a partial, a partial's reduction, and apply's "ops"
    program, eagerly and under jax.jit. Now each runs on its own mesh
    (:func:`placements2jax.mesh.shard_map`)."""
    twin = init_device_mesh((2, 4), ("dp", "tp"), axis_types="auto").to_jax()
    other = twin if context == "auto twin" else init_device_mesh((8,), ("x",), axis_types="auto").to_jax()
    a, b = _data((8, 16), 51), _data((16, 12), 52)
    x, w = _dt(a, MESH2, "R,S(1)"), _dt(b, MESH2, "R,S(0)")

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return lax.with_sharding_constraint(x @ w, NamedSharding(twin, PartitionSpec("dp", None)))

    with jax.set_mesh(other):
        product = x @ w
        assert product.placements[1].is_partial()
        np.testing.assert_allclose(np.asarray(product.full_tensor()), a @ b, rtol=1e-5, atol=1e-5)
        for execute in ("ops", "xla", "pinned"):
            for run in (apply, jax.jit(functools.partial(apply, execute=execute), static_argnums=0)):
                got = run(f, x, w, execute=execute) if run is apply else run(f, x, w)
                np.testing.assert_allclose(np.asarray(got.full_tensor()), a @ b, rtol=1e-5, atol=1e-5)
    # inside another Explicit mesh's set_mesh JAX refuses fn's primitives on the operands' logical values, which the
    # "xla" and "pinned" programs bind (tests/test_bad_inputs.py): "auto" runs "ops" there
    with jax.set_mesh(init_device_mesh((8,), ("x",)).to_jax()):
        got = apply(lambda x, w: jnp.tanh(x @ w), x, w)
    np.testing.assert_allclose(np.asarray(got.full_tensor()), np.tanh(a @ b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placements", ["(a,b),None", "(b,a),None", "None,(a,b)"])
def test_apply_xla_reads_nested_uneven_inputs(placements: str) -> None:
    """10 rows over (a, b) = 4 x 2 are chunked 2,1,2,1,2,1,1,0: the padding sits between
    blocks, so execute="xla" takes the logical positions instead of the first 10 rows
    (it read pads as data), eagerly, under jit and under grad inside jax.set_mesh."""
    a = _data((10, 10), 47)
    x = _dt(a, MESH42, placements)
    for result in (apply(jnp.sin, x, execute="xla"), jax.jit(functools.partial(apply, jnp.sin, execute="xla"))(x)):
        np.testing.assert_allclose(np.asarray(result.full_tensor()), np.sin(a), rtol=1e-6)
    with jax.set_mesh(MESH42.to_jax()):
        grad = jax.grad(lambda t: apply(jnp.sin, t, execute="xla").full_tensor().sum())(x)
    assert grad.layout == x.layout
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), np.cos(a), rtol=1e-6)


def test_apply_errors() -> None:
    x = _dt(_data((8, 12)), MESH1, "S(0)")
    with pytest.raises(ArgumentTypeError, match="fn"):
        apply("gelu", x)
    with pytest.raises(ArgumentTypeError, match="args"):
        apply(jax.nn.gelu, "x")
    with pytest.raises(InferenceError, match="at least one operand must be a DTensor"):
        apply(jax.nn.gelu, np.ones(3))
    with pytest.raises(InferenceError, match="different meshes"):
        apply(jnp.add, x, _dt(_data((8, 12)), MESH2, "S(0),R"))


def test_operator_errors() -> None:
    x = _dt(_data((8, 12)), MESH1, "S(0)")
    with pytest.raises(TypeError):
        x + "a"
    with pytest.raises(InferenceError, match="different meshes"):
        x + _dt(_data((8, 12)), MESH2, "S(0),R")
    with pytest.raises(InferenceError):
        x @ _dt(_data((5, 3)), MESH1, "R")
    with pytest.raises(InferenceError):
        x.reshape(5, 5)


# -- Megatron MLP, jit, grad ------------------------------------------------------------------


def _megatron() -> tuple[tuple[DTensor, ...], tuple[np.ndarray, ...]]:
    x, w1, w2 = _data((8, 16), 25), _data((16, 32), 26) / 4, _data((32, 16), 27) / 4
    dts = (_dt(x, MESH2, "S(0),R"), _dt(w1, MESH2, "R,S(1)"), _dt(w2, MESH2, "R,S(0)"))
    return dts, (x, w1, w2)


def _mlp(x: Any, w1: Any, w2: Any) -> Any:
    return apply(jax.nn.gelu, x @ w1) @ w2


def test_megatron_mlp_is_row_parallel_partial_then_reduced() -> None:
    (x, w1, w2), (a, b1, b2) = _megatron()
    expected = np.asarray(jax.nn.gelu(a @ b1) @ b2)
    hidden = x @ w1
    assert hidden.placements == (Shard(0), Shard(1))
    y = _mlp(x, w1, w2)
    assert y.placements == (Shard(0), P_SUM)
    np.testing.assert_allclose(np.asarray(y.full_tensor()), expected, rtol=1e-5, atol=1e-5)
    reduced = y.redistribute(placements=(Shard(0), Replicate()))
    np.testing.assert_allclose(np.asarray(reduced.to_jax()), expected, rtol=1e-5, atol=1e-5)

    jitted = jax.jit(_mlp)(x, w1, w2)
    assert jitted.layout == y.layout
    np.testing.assert_allclose(np.asarray(jitted.full_tensor()), expected, rtol=1e-5, atol=1e-5)
    # Column- then row-parallel: no communication at all until the final reduce.
    assert compiled_collectives(jax.jit(_mlp), x, w1, w2) == []


def test_jit_gives_the_same_values_and_placements_as_eager() -> None:
    a = _data((7, 5), 28)
    x = _dt(a, MESH2, "S(0),S(1)")

    def step(v: DTensor) -> tuple[DTensor, DTensor, DTensor]:
        s = (v * 2 - 1).sum(axis=1)
        return s, (v.T @ v).max(axis=0), apply(jnp.tanh, v).reshape(35)

    eager = step(x)
    jitted = jax.jit(step)(x)
    for e, j in zip(eager, jitted):
        assert e.layout == j.layout
        np.testing.assert_allclose(np.asarray(j.full_tensor()), np.asarray(e.full_tensor()), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jitted[0].full_tensor()), (a * 2 - 1).sum(axis=1), rtol=1e-5)


def _loss(x: DTensor, w1: DTensor, w2: DTensor) -> jax.Array:
    y = _mlp(x, w1, w2) * 0.5 + x  # Partial(sum) consumed by mul and add
    return jnp.sum(jnp.sin(y.redistribute(placements=(Shard(0), Replicate())).to_jax()))


def _plain_loss(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    return jnp.sum(jnp.sin((jax.nn.gelu(x @ w1) @ w2) * 0.5 + x))


def test_grad_through_operators_matches_the_plain_function() -> None:
    dts, arrays = _megatron()
    expected = jax.grad(_plain_loss, argnums=(0, 1, 2))(*arrays)
    grads = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(*dts)
    for g, d, want in zip(grads, dts, expected):
        assert isinstance(g, DTensor) and g.layout == d.layout
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_eager_grad() -> None:
    a, b = _data((8, 12), 33), _data((12, 6), 34)
    x, w = _dt(a, MESH2, "S(0),S(1)"), _dt(b, MESH2, "R,S(0)")

    def loss(u: DTensor, v: DTensor) -> jax.Array:
        return ((u @ v) * 3.0).sum().full_tensor()  # P(sum) all the way to the scalar

    # Eager grad on Explicit meshes needs the mesh set (JAX builds the seed cotangent).
    with jax.set_mesh(MESH2.to_jax()):
        grads = jax.grad(loss, argnums=(0, 1))(x, w)
    expected = jax.grad(lambda u, v: jnp.sum((u @ v) * 3.0), argnums=(0, 1))(a, b)
    for g, d, want in zip(grads, (x, w), expected):
        assert g.layout == d.layout
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_grad_through_uneven_layouts_and_reductions() -> None:
    a, b = _data((7, 5), 29), _data((5, 3), 30)
    x, w = _dt(a, MESH2, "S(0),S(1)"), _dt(b, MESH2, "R,S(0)")

    def loss(u: DTensor, v: DTensor) -> jax.Array:
        y = u @ v  # (S(0), P) on uneven blocks
        total = (y * y).sum() + u.max(axis=1).sum() + (-u).mean(axis=0).sum()
        return total.full_tensor()

    def plain(u: jax.Array, v: jax.Array) -> jax.Array:
        y = u @ v
        return (y * y).sum() + u.max(axis=1).sum() + (-u).mean(axis=0).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    expected = jax.grad(plain, argnums=(0, 1))(a, b)
    for g, d, want in zip(grads, (x, w), expected):
        assert g.layout == d.layout
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(want), rtol=1e-4, atol=1e-4)
        reference = distribute_tensor(np.asarray(want), d.device_mesh, d.layout)
        np.testing.assert_allclose(np.asarray(g.array), np.asarray(reference.array), rtol=1e-4, atol=1e-4)


# -- dispatch ---------------------------------------------------------------------------------


def test_programs_are_cached_per_op_params_and_layouts() -> None:
    operators._named_program.cache_clear()  # other test files may have run x.sum(axis=0) already
    x = _dt(_data((8, 12)), MESH2, "S(0),S(1)")
    x * 3.0
    before = operators._named_program.cache_info()
    x * 4.0  # another scalar value: the same program, found by the dispatch cache
    assert operators._named_program.cache_info() == before
    # The same layout given otherwise is the same (interned) object: the dispatch cache again.
    y = _dt(_data((8, 12), 1), MESH2, (Shard(0), Shard(1)))
    assert y.layout is x.layout
    y * 3.0
    after = operators._named_program.cache_info()
    assert after == before
    operators._dispatched.clear()  # a dispatch miss finds the program by value
    y * 3.0
    after = operators._named_program.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    x.sum(axis=0)
    assert operators._named_program.cache_info().misses == after.misses + 1


def test_numpy_and_jax_arrays_on_the_left() -> None:
    a = _data((8, 12), 31)
    x = _dt(a, MESH1, "S(0)")
    left = np.ones((8, 12), np.float32)
    with implicit_replication():
        result = left + x
    assert isinstance(result, DTensor) and result.placements == (Shard(0),)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), left + a)


def _instructions(hlo: str) -> list[str]:
    """The compiled HLO without names and metadata: per instruction its shape and opcode."""
    found = []
    for line in hlo.splitlines():
        match = re.match(r"\s*(ROOT )?%\S+ = (\S+) ([\w-]+)\(", line)
        if match:
            found.append(f"{match.group(1) or ''}{match.group(2)} {match.group(3)}")
    return found


def test_jitted_dtensor_program_is_the_plain_jax_program() -> None:
    (x, w1, w2), (a, b1, b2) = _megatron()

    def with_dtensors(u: DTensor, v1: DTensor, v2: DTensor) -> DTensor:
        return _mlp(u, v1, v2).redistribute(placements=(Shard(0), Replicate()))

    def plain(u: jax.Array, v1: jax.Array, v2: jax.Array) -> jax.Array:
        return jax.nn.gelu(u @ v1) @ v2

    auto = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    arrays = [
        jax.device_put(value, NamedSharding(auto, spec))
        for value, spec in ((a, PartitionSpec("dp")), (b1, PartitionSpec(None, "tp")), (b2, PartitionSpec("tp")))
    ]
    ours = jax.jit(with_dtensors).lower(x, w1, w2).compile().as_text()
    theirs = jax.jit(plain, out_shardings=NamedSharding(auto, PartitionSpec("dp"))).lower(*arrays).compile().as_text()
    assert _instructions(ours) == _instructions(theirs)
    assert "all-reduce" in " ".join(_instructions(ours))


def test_integer_tensors_and_auto_mesh_axes() -> None:
    ints = np.random.default_rng(37).integers(-50, 50, size=(7, 5)).astype(np.int32)
    x = _dt(ints, MESH2, "S(0),S(1)")
    for op in ("sum", "max", "min"):
        result = getattr(x, op)()  # pads take 0 / int32 min / int32 max before the op
        assert result.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(result.full_tensor()), getattr(ints, op)())
    np.testing.assert_array_equal(np.asarray((x * 3 - 1).full_tensor()), ints * 3 - 1)
    # On Auto axes Partial(sum) is stacked, not unreduced: the same operators.
    auto = DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "tp"), axis_types="auto")
    a, b = _data((8, 12), 38), _data((12, 6), 39)
    u, w = _dt(a, auto, "S(0),S(1)"), _dt(b, auto, "R,S(0)")
    y = (u @ w) * 2 + u @ w
    assert y.placements == (Shard(0), P_SUM)
    np.testing.assert_allclose(np.asarray(y.full_tensor()), 3 * (a @ b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("placements", ["R,S(1)", "S(0),S(1)"])  # a Partial's array: np.asarray refuses it (unreduced)
def test_dtensors_a_mapped_function_left_host_arrays_in_are_placed(placements: str) -> None:
    """A DTensor is a pytree whose leaf is its array, so a function mapped over DTensors
    leaves its results in them: a checkpoint's NumPy values mapped into a DTensor
    template, an optimizer's init of host zeros. Their arrays are placed as their layouts
    lay them out where a program reads them: apply's per-rank programs ("ops") read them
    as laid out, and JAX refused them ("in_specs passed to shard_map ... does not match
    the specs of the input"); eager operators too."""
    template = {"w": _dt(_data((8, 16)), MESH2, placements)}
    values = jax.tree.map(np.asarray, template)  # the physical arrays, now on the host
    on_host = jax.tree.map(lambda _, v: v, template, values)
    assert isinstance(on_host["w"].array, np.ndarray) and on_host["w"].layout == template["w"].layout
    on_one_device = jax.tree.map(jnp.asarray, values)
    want = np.tanh(np.asarray(template["w"].full_tensor())) * 2.0
    for tree in (on_host, jax.tree.map(lambda _, v: v, template, on_one_device)):
        for execute in ("xla", "ops", "pinned"):
            got = apply(lambda p: jnp.tanh(p["w"]) * 2.0, tree, execute=execute)
            np.testing.assert_allclose(np.asarray(got.full_tensor()), want, rtol=1e-6)
        eager = tree["w"] * 2.0
        np.testing.assert_allclose(np.asarray(eager.full_tensor()), np.asarray(template["w"].full_tensor()) * 2.0)
        assert len(eager.array.sharding.device_set) == MESH2.size()
