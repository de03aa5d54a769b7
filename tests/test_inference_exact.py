"""The exact program search (benchmarks/exact_milp.py): its MILP's optimum is the least
objective of the program search (``_Search.total``) over every allowed choice, checked
by enumerating them on a small program (a value read twice: consumers needing one layout
share its move; a literal; a free or fixed output)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placements2jax import Layout, init_device_mesh
from placements2jax.inference.cost import resolve_cost_model
from placements2jax.inference.jaxpr import _Walker
from placements2jax.inference.program import ProgramGraph, _Search
from placements2jax.inference.signature import as_tensor_specs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from exact_milp import TIE, solve_exact  # noqa: E402

PLACEMENTS = ("R,R", "S(0),R", "R,S(0)", "R,S(1)", "S(0),S(1)", "S(1),S(0)")


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


def fn(x: jax.Array, w: jax.Array, v: jax.Array) -> jax.Array:
    h = x @ w
    return jnp.tanh(h * 2.0) @ v + h


def _search(mesh: Any, placements: tuple[str, str, str], fixed_out: str | None) -> _Search:
    layout = Layout.from_device_mesh(mesh)
    shapes = ((8, 32), (32, 16), (16, 16))
    specs, mesh = as_tensor_specs([(s, jnp.float32, layout(p)) for s, p in zip(shapes, placements)], None)
    closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in specs))
    walker = _Walker(mesh, resolve_cost_model(None), {})
    outputs = walker.walk(closed.jaxpr, [], specs, "", [("in", i) for i in range(len(specs))])
    graph = ProgramGraph(mesh, tuple(walker.nodes), tuple(s for _, s in outputs), specs)
    targets = (None if fixed_out is None else layout(fixed_out).bind(2),)
    return _Search(graph, resolve_cost_model(None), targets)


@settings(max_examples=40, deadline=None)
@given(
    placements=st.tuples(*(st.sampled_from(PLACEMENTS) for _ in range(3))),
    fixed_out=st.sampled_from((None, "R,R", "S(0),R")),
    picks=st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=6), min_size=5, max_size=5),
)
def test_milp_optimum_is_the_least_total_over_allowed_choices(
    mesh: Any, placements: tuple[str, str, str], fixed_out: str | None, picks: list[list[int]]
) -> None:
    search = _search(mesh, placements, fixed_out)
    assert len(search.paths) <= len(picks)  # dot, mul, tanh, dot, add
    allowed = {path: {k % len(search.ins[path]) for k in ks} for path, ks in zip(search.paths, picks)}
    result = solve_exact(search, allowed, time_limit=30)
    assert result.status == 0 and result.choice is not None
    assert all(result.choice[path] in ks for path, ks in allowed.items())
    every = (dict(zip(search.paths, ks)) for ks in itertools.product(*(sorted(allowed[p]) for p in search.paths)))
    least = min(search.total(choice) for choice in every)
    assert result.total == least
    assert result.objective == pytest.approx(least[0] + TIE * least[1], abs=1e-6)
    # follower merging restricts the choice (the mul follows the dot, the tanh the mul): never cheaper, and
    # its program prices its choice as the search does (a followed edge moves nothing)
    merged = solve_exact(search, allowed, time_limit=30, followers=True)
    assert merged.status == 0 and merged.total is not None and merged.total >= least
    assert merged.objective == pytest.approx(merged.total[0] + TIE * merged.total[1], abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    placements=st.tuples(*(st.sampled_from(PLACEMENTS) for _ in range(3))),
    fixed_out=st.sampled_from((None, "R,R", "S(0),R")),
    picks=st.lists(st.integers(0, 60), min_size=5, max_size=5),
)
def test_milp_prices_any_choice_as_the_search_totals_it(
    mesh: Any, placements: tuple[str, str, str], fixed_out: str | None, picks: list[int]
) -> None:
    """One candidate allowed per node: the program's value at that choice is its total
    (the moves of a value read twice counted once per distinct layout needed)."""
    search = _search(mesh, placements, fixed_out)
    choice = {path: k % len(search.ins[path]) for path, k in zip(search.paths, picks)}
    result = solve_exact(search, {path: {k} for path, k in choice.items()}, time_limit=30)
    total = search.total(choice)
    assert result.choice == choice and result.total == total
    assert result.objective == pytest.approx(total[0] + TIE * total[1], abs=1e-6)
