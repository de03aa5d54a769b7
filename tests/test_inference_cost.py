"""The cost model: exact bytes per device for each collective, blocks, axis weights."""

from __future__ import annotations

from fractions import Fraction

import pytest

from placements2jax import ArgumentTypeError, InferenceError, init_device_mesh
from placements2jax.inference import (
    CostModel,
    default_cost_model,
    set_default_cost_model,
    use_cost_model,
)
from placements2jax.inference.cost import (
    block_bytes,
    collective_bytes,
    resolve_cost_model,
)


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


def test_cost_model_weights_by_name_then_index() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    model = CostModel({"dp": 4, 1: 0.5})
    assert model.weights(mesh) == (4, Fraction(1, 2))
    assert CostModel().weights(mesh) == (1, 1)
    assert CostModel({"dp": 4}) == CostModel({"dp": 4.0}) and hash(CostModel({"dp": 4})) == hash(CostModel({"dp": 4.0}))
    assert repr(CostModel({"dp": 4})) == "CostModel({'dp': 4.0})"


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
