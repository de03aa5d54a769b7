"""The cost model: exact bytes per device for each collective, blocks, axis weights."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from placements2jax import ArgumentTypeError, InferenceError, Layout, init_device_mesh, resolve_layout
from placements2jax.hlo import parse_collectives
from placements2jax.inference import (
    CostModel,
    default_cost_model,
    plan_redistribute,
    predict,
    set_default_cost_model,
    use_cost_model,
)
from placements2jax.inference.cost import (
    COLLECTIVES,
    block_bytes,
    collective_bytes,
    collective_factor,
    exchange_block_bytes,
    resolve_cost_model,
)
from placements2jax.physical import physical
from placements2jax.placements import parse_placements_or_alias
from placements2jax.schedules import choose, sent_bytes_per_device


@pytest.mark.parametrize(
    ("n", "gather", "scatter", "reduce", "all_to_all"),
    [(2, 512, 512, 1024, 256), (4, 768, 768, 1536, 192), (8, 896, 896, 1792, 112)],
)
def test_ring_formulas_on_a_1024_byte_block(n: int, gather: int, scatter: int, reduce: int, all_to_all: int) -> None:
    assert collective_bytes("all-gather", 1024, n) == gather  # T(n-1)/n
    assert collective_bytes("reduce-scatter", 1024, n) == scatter  # T(n-1)/n
    assert collective_bytes("all-reduce", 1024, n) == reduce  # 2T(n-1)/n
    assert collective_bytes("all-to-all", 1024, n) == all_to_all  # T(n-1)/n^2
    assert collective_bytes("local-slice", 1024, n) == 0
    assert collective_bytes("local-partial", 1024, n) == 0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_collective_factor_is_the_bytes_of_a_one_byte_block(n: int) -> None:
    for kind in COLLECTIVES:
        assert collective_factor(kind, n) == collective_bytes(kind, 1, n)
        assert collective_bytes(kind, 96, n) == 96 * collective_factor(kind, n)
    assert collective_factor("all-to-all", 4) == Fraction(3, 16) and collective_factor("all-reduce", 4) == Fraction(3, 2)


def test_costs_are_exact_fractions() -> None:
    assert collective_bytes("all-gather", 1000, 3) == Fraction(2000, 3)
    assert collective_bytes("all-to-all", 1000, 3) == Fraction(2000, 9)
    assert collective_bytes("all-reduce", 7, 1) == 0


def test_collective_errors() -> None:
    with pytest.raises(InferenceError, match="unknown collective"):
        collective_bytes("broadcast", 8, 2)
    with pytest.raises(InferenceError, match="at least one rank"):
        collective_bytes("all-gather", 8, 0)


def test_block_bytes_are_padded_blocks() -> None:
    # 10 rows over 4 ranks: blocks of ceil(10/4) = 3 rows of 8 float32
    assert block_bytes((10, 8), 4, ((0,), ()), (4,)) == 3 * 8 * 4
    assert block_bytes((10, 8), 4, ((0,), ()), (4,), without=0) == 10 * 8 * 4
    # nested: 10 over (2, 2) -> ceil(10/4) = 3; leaving out the minor axis -> 5
    assert block_bytes((10,), 2, ((0, 1),), (2, 2), without=1) == 5 * 2


def test_an_all_to_all_exchanges_padded_blocks() -> None:
    """T of an all-to-all as XLA compiles it: n times the held (padded) block, its target
    dim padded to a multiple of n; block_bytes without the mesh dim on even splits."""
    # (1, 8, 32) split over 4 on its last dim, moved to its first: each holds (1, 8, 8), padded to (4, 8, 8)
    assert exchange_block_bytes((1, 8, 32), 4, ((), (), (0,)), (4, 2), 0)[0] == 4 * (4 * 8 * 8 * 4)
    assert block_bytes((1, 8, 32), 4, ((), (), (0,)), (4, 2), without=0) == 1 * 8 * 32 * 4  # the unpadded T
    # the size-1 dim split over 4 (every rank holds a padded row), moved to the last dim (split over 2 too)
    assert exchange_block_bytes((1, 8, 32), 4, ((0,), (), (1,)), (4, 2), 0)[2] == 4 * (1 * 8 * 16 * 4)
    # 6 rows over 4 ranks: blocks of 2 rows; the target dim 8 divides
    assert exchange_block_bytes((6, 8, 32), 4, ((0,), (), ()), (4, 2), 0)[1] == 4 * (2 * 8 * 32 * 4)


@given(shape=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)), data=st.data())
def test_exchange_blocks_are_never_below_the_unpadded_ones_and_equal_on_even_splits(shape: Any, data: Any) -> None:
    mesh_shape = (4, 2)
    m, split, target = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    assume(split != target)
    other = data.draw(st.sampled_from([None, 0, 1, 2]))  # where the other mesh dim splits, if anywhere
    dim_axes = tuple(tuple(a for a, d in ((1 - m, other), (m, split)) if d == i) for i in range(3))
    exchanged = exchange_block_bytes(shape, 4, dim_axes, mesh_shape, m)[target]
    unpadded = block_bytes(shape, 4, dim_axes, mesh_shape, without=m)
    assert exchanged >= unpadded
    pieces = [math.prod(mesh_shape[a] for a in axes) for axes in dim_axes]
    pieces[target] *= mesh_shape[m]
    if all(n % p == 0 for n, p in zip(shape, pieces)):
        assert exchanged == unpadded


def test_cost_model_weights_by_name_then_index() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    model = CostModel({"dp": 4, 1: 0.5})
    assert model.weights(mesh) == (4, Fraction(1, 2))
    assert CostModel().weights(mesh) == (1, 1)
    assert CostModel({"dp": 4}) == CostModel({"dp": 4.0}) and hash(CostModel({"dp": 4})) == hash(CostModel({"dp": 4.0}))
    assert repr(CostModel({"dp": 4})) == "CostModel({'dp': 4.0})"


def test_cost_model_hash_is_the_dataclass_hash_cached_and_not_pickled() -> None:
    """The hash is computed once (plan caches key on the model by the thousand), is the
    plain frozen dataclass's (its fields' tuple), and a pickled model is hashed afresh where
    it is loaded (axis names are strings, hashed differently in another process)."""
    import dataclasses
    import pickle

    model = CostModel({"dp": 4}, latency={"tp": 1e-6}, curves={"tp": {"all-gather": [(8, 1e-6), (1024, 2e-6)]}})
    fields = tuple(getattr(model, f.name) for f in dataclasses.fields(model))
    assert hash(model) == hash(fields) == hash(model) and "_hash" in model.__dict__
    loaded = pickle.loads(pickle.dumps(model))
    assert "_hash" not in loaded.__dict__
    assert loaded == model and hash(loaded) == hash(model)
    assert model != CostModel({"dp": 4}, latency={"tp": 1e-6})  # equality still by every field


@pytest.mark.parametrize("weights", [{"dp": -1}, {"dp": float("nan")}, {"dp": True}, {"dp": "fast"}, {1.5: 2}, [("dp", 2)]])
def test_bad_weights_are_argument_errors(weights: object) -> None:
    with pytest.raises(ArgumentTypeError):
        CostModel(weights)  # type: ignore[arg-type]


def test_default_cost_model_can_be_set_and_scoped() -> None:
    assert default_cost_model() == CostModel()
    with use_cost_model({"dp": 3}) as model:
        assert model == CostModel({"dp": 3}) == default_cost_model() == resolve_cost_model(None)
    assert default_cost_model() == CostModel()
    previous = set_default_cost_model(CostModel({"tp": 2}))
    try:
        assert default_cost_model() == CostModel({"tp": 2})
    finally:
        set_default_cost_model(previous)
    assert resolve_cost_model({"x": 2}) == CostModel({"x": 2})


# -- pricing moves by the schedules redistribute runs (predict(policy=)) ------------------------------------

# (mesh shape, tensor shape, source, target): every family of the redistribute catalogue, Partial sources
# (sum and avg), a Partial target, an uneven (padded) source, and moves where the schedules send less than XLA.
PRICED_MOVES = [
    ((8,), (16, 16), "S(0)", "R"),
    ((8,), (16, 16), "S(0)", "S(1)"),
    ((8,), (16, 16), "P", "S(0)"),
    ((8,), (16, 16), "P", "S(1)"),
    ((8,), (16, 16), "P(avg)", "R"),
    ((8,), (16, 16), "R", "P"),
    ((8,), (10, 4), "S(0)", "R"),
    ((4, 2), (16, 16), "S(0),S(1)", "S(1),S(0)"),
    ((4, 2), (16, 16), "S(0),R", "R,S(0)"),
    ((4, 2), (16, 16), "P,R", "S(0),R"),
    ((4, 2), (16, 16), "P,S(0)", "P,S(1)"),
    ((4, 2), (16, 16), "(a,b),None", "None,(b,a)"),
    ((2, 2, 2), (8, 8, 8), "P,P,P", "S(0),S(1),S(2)"),
    ((2, 2, 2), (8, 8, 8), "(a,b,c),None,None", "None,None,(c,b,a)"),
]
_MESH_AXES = {(8,): ("x",), (4, 2): ("a", "b"), (2, 2, 2): ("a", "b", "c")}


@pytest.mark.parametrize(("mesh_shape", "shape", "src", "dst"), PRICED_MOVES)
def test_predict_prices_moves_by_the_schedule_the_policy_runs(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], src: str, dst: str
) -> None:
    """predict(policy=P) prices a move (an identity function with ``out_layouts``) by the
    schedule ``redistribute(policy=P)`` runs: its bytes and collectives equal those read
    from that schedule's compiled HLO. predict(policy=None) keeps the planner's price of
    XLA's reshard (what check compares with a plain jit program)."""
    mesh = init_device_mesh(mesh_shape, _MESH_AXES[mesh_shape])
    source, target = (resolve_layout(mesh, parse_placements_or_alias(t), len(shape)) for t in (src, dst))
    spec = (shape, np.int32, source)
    plain = predict(lambda x: x, spec, out_layouts=target)
    assert plain.policy is None and plain.schedules == ()
    assert plain.nbytes == plan_redistribute(shape, np.int32, source, target).nbytes
    for policy in ("xla", "min_bytes", "cost"):
        prediction = predict(lambda x: x, spec, out_layouts=target, policy=policy)
        schedule = choose(physical(source, shape), physical(target, shape), np.int32, policy)
        compiled = parse_collectives(schedule.jitted.lower(schedule.argument()).compile().as_text())
        assert [s.name for s in prediction.schedules] == [schedule.name]
        assert prediction.nbytes == sent_bytes_per_device(compiled, mesh.size()), (policy, schedule.name)
        assert prediction.collectives == Counter(c.op for c in compiled)
        assert prediction.cost == prediction.nbytes  # every axis weighs 1
        assert f"schedules under policy {policy!r}: {schedule.name}" in str(prediction)


def test_predict_weighs_schedule_bytes_by_the_axis_weights() -> None:
    """Under a policy, ``cost`` weighs each collective's bytes by the largest weight of its
    mesh dims: an all-gather over ``a`` on (4,2) costs 3x its bytes with ``{"a": 3}``."""
    mesh = init_device_mesh((4, 2), ("a", "b"))
    source, target = (resolve_layout(mesh, p, 2) for p in ("S(0),R", "R,R"))
    prediction = predict(lambda x: x, ((16, 16), np.float32, source), out_layouts=target, policy="xla",
                         cost_model={"a": 3})
    assert prediction.nbytes == 16 * 16 * 4 * Fraction(3, 4)
    assert prediction.cost == 3 * prediction.nbytes


def test_predict_refuses_a_bad_policy() -> None:
    mesh = init_device_mesh((8,), ("x",))
    layout = resolve_layout(mesh, "S(0)", 1)
    with pytest.raises(ArgumentTypeError, match="policy="):
        predict(lambda x: x, ((8,), np.float32, layout), policy="fastest")
