"""Selection on N-D meshes: the product of 1-D signatures, the filters, the ranking order,
constraints, caching, and the inputs a DTensor will pass."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placements2jax import ArgumentTypeError, InferenceError, Layout, Partial, clear_caches, init_device_mesh
from placements2jax.inference import CostModel, Signature, infer_signature, ops
from placements2jax.inference.cost import resolve_cost_model
from placements2jax.inference.select import (
    _cosplit, _distinct_orders, _first_inexact, _fit_class, _fit_shapes, _gathered_matters, _inexact_step, _out_avals,
    nest_orders, rank_candidates, signature_for,
)
from placements2jax.inference.signature import Aval, TensorSpec, placement_on

F32 = jnp.float32


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh((2, 4), ("dp", "tp"))


def L(mesh: Any, placements: Any) -> Layout:
    return Layout.from_device_mesh(mesh)(placements)


def texts(layouts: Any) -> list[str]:
    return [str(x) for x in layouts]


def test_2d_matmul_split_rows_and_contraction(mesh: Any) -> None:
    signature = infer_signature("matmul", [((8, 16), F32, L(mesh, "S(0),S(1)")), ((16, 8), F32, L(mesh, "R,S(0)"))])
    assert texts(signature.in_layouts) == ["S(0),S(1)", "R,S(0)"]
    assert texts(signature.out_layouts) == ["S(0),P"]
    assert [str(s) for s in signature.chosen.one_d] == ["S(0),R -> S(0)", "S(1),S(0) -> P"]
    assert signature.cost == 0


def test_megatron_linear_pair_signatures(mesh: Any) -> None:
    column = infer_signature("matmul", [((8, 16), F32, L(mesh, "S(0),R")), ((16, 32), F32, L(mesh, "R,S(1)"))])
    assert texts(column.out_layouts) == ["S(0),S(1)"]
    row = infer_signature("matmul", [((8, 32), F32, column.out_layout), ((32, 16), F32, L(mesh, "R,S(0)"))])
    assert texts(row.out_layouts) == ["S(0),P"] and row.cost == 0


def test_split_needs_as_many_elements_as_pieces(mesh: Any) -> None:
    signature = infer_signature("exp", [((2, 16), F32, L(mesh, "R,R"))])
    assert all(x.pieces(0) in ((), (2,)) for c in signature.candidates for x in c.in_layouts)
    assert ((0,), (1,)) in {c.in_layouts[0].dim_axes for c in signature.candidates}


def test_nested_splits_use_the_current_local_extent() -> None:
    """3 rows on a 2x2 mesh: 3 -> chunks 2|1, then the 2 rows split in 2. A flat size test
    (3 < 4 pieces) would refuse it; torch.chunk nests, so the local extent (2) decides."""
    mesh = init_device_mesh((2, 2), ("a", "b"))
    signature = infer_signature("neg", [((3,), F32, Layout(mesh, ((),)))])
    assert ((0, 1),) in {c.in_layouts[0].dim_axes for c in signature.candidates}
    signature = infer_signature("neg", [((1,), F32, Layout(mesh, ((),)))])
    assert {c.in_layouts[0].dim_axes for c in signature.candidates} == {((),)}


@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 400))
def test_fit_classes_split_like_their_sizes(mesh_shape: list[int], size: int) -> None:
    """A size's fit class (one int) meets every split by distinct mesh dims (each ordered
    sequence of them) as the size does: fails where it fails, first inexact at the same step."""
    shape = tuple(mesh_shape)
    fit = _fit_class(size, math.prod(shape))
    for steps in range(1, len(shape) + 1):
        for axes in itertools.permutations(range(len(shape)), steps):
            assert _first_inexact(fit, axes, shape) == _first_inexact(size, axes, shape)


def test_fit_classes_are_not_factorial_in_mesh_dims() -> None:
    """On 8 non-trivial mesh dims (109,600 ordered sequences of them, which the classes were
    once tabulated over, ~0.1 s per size) a class is one int, and a split reads its own step
    alone. The 8 test devices cannot make such a mesh: the filters see its shape alone."""
    mesh_shape = (2, 3, 5, 7, 2, 2, 3, 2)
    devices = math.prod(mesh_shape)
    sizes = (2**20, 96, 7, devices, 3 * devices)
    assert _fit_shapes([Aval(sizes, jnp.dtype("float32"))], mesh_shape) == (
        (devices + 16, 96, 7, 2 * devices, 2 * devices),  # gcd(2**20, 5040) = 16; 96 < 5040
    )
    for axes in ((0, 1, 2, 3, 4, 5, 6, 7), (7, 6, 5, 4, 3, 2, 1, 0), (3, 0), (1, 6, 2)):
        for size in sizes:
            assert _inexact_step(_fit_class(size, devices), axes, mesh_shape) == _first_inexact(size, axes, mesh_shape)


def test_even_splits_required_where_marked() -> None:
    mesh = init_device_mesh((2, 2), ("a", "b"))
    six = infer_signature("mean", [((6,), F32, Layout(mesh, ((),)))], axis=0)
    # 6 -> 3|3 -> 2|1: the second split is uneven, so the reduced dim is split once at most
    assert {c.in_layouts[0].dim_axes for c in six.candidates} == {((),), ((0,),), ((1,),)}
    assert any(c.out_layouts[0].partial == ("avg", None) for c in six.candidates)
    eight = infer_signature("mean", [((8,), F32, Layout(mesh, ((),)))], axis=0)
    assert {((0, 1),), ((1, 0),)} <= {c.in_layouts[0].dim_axes for c in eight.candidates} | {((1, 0),)}
    assert any(c.in_layouts[0].dim_axes == ((0, 1),) and c.out_layouts[0].partial == ("avg", "avg")
               for c in eight.candidates)


def test_no_candidate_mixes_partial_ops(mesh: Any) -> None:
    signature = infer_signature("add", [((8, 8), F32, L(mesh, "P,R")), ((8, 8), F32, L(mesh, "R,R"))])
    for candidate in signature.candidates:
        for layout in candidate.in_layouts + candidate.out_layouts:
            assert len({op for op in layout.partial if op}) <= 1


def test_output_constraint_filters_and_costs(mesh: Any) -> None:
    inputs = [((8, 16), F32, L(mesh, "S(0),S(1)")), ((16, 8), F32, L(mesh, "R,S(0)"))]
    signature = infer_signature("matmul", inputs, out_layouts=L(mesh, "S(0),R"))
    assert texts(signature.out_layouts) == ["S(0),R"]
    assert all(texts(c.out_layouts) == ["S(0),R"] for c in signature.candidates)
    assert signature.cost > 0
    fixed = infer_signature("matmul", inputs, in_layouts=[None, L(mesh, "R,R")])
    assert texts(fixed.in_layouts)[1] == "R,R"


def test_impossible_constraint_is_an_error(mesh: Any) -> None:
    with pytest.raises(InferenceError, match="out_layouts"):
        infer_signature("sum", [((8, 16), F32, L(mesh, "R,R"))], axis=1, out_layouts=L(mesh, "R,P(max)"))


def test_cost_weights_change_the_choice() -> None:
    mesh = init_device_mesh((2, 2), ("a", "b"))
    inputs = [((8, 8), F32, L(mesh, "S(0),R")), ((8, 8), F32, L(mesh, "R,S(0)"))]
    even = infer_signature("add", inputs)
    # one all-to-all of 64 B, on b (or symmetrically on a): the tie goes to lower dims first
    assert texts(even.out_layouts) == ["S(0),S(1)"]
    assert [(s.axis, s.collective, s.nbytes) for s in even.redistributions[1].steps if s.nbytes] == [
        ("b", "all-to-all", 64)
    ]
    slow_b = infer_signature("add", inputs, cost_model=CostModel({"b": 10}))
    assert texts(slow_b.out_layouts) == ["S(1),S(0)"]
    (move,) = [s for s in slow_b.redistributions[0].steps if s.nbytes]
    assert (move.axis, move.collective, move.nbytes, move.cost) == ("a", "all-to-all", 64, 64)
    slow_a = infer_signature("add", inputs, cost_model={"a": 10})
    assert slow_a.out_layouts == even.out_layouts and slow_a.cost == even.cost == 64


def _shuffled_rank(one_d: list[Any], seed: int, specs: tuple[TensorSpec, ...], outs: Any, mesh: Any) -> list[Any]:
    shuffled = list(one_d)
    random.Random(seed).shuffle(shuffled)
    orders = nest_orders(mesh, [s.layout for s in specs])
    return rank_candidates(shuffled, specs, outs, mesh, orders, resolve_cost_model(None))


@given(seed=st.integers(0, 10_000))
def test_ranking_does_not_depend_on_generation_order(seed: int) -> None:
    mesh = init_device_mesh((2, 2), ("a", "b"))
    specs = (
        TensorSpec((8, 8), F32, L(mesh, "S(0),S(1)")),
        TensorSpec((8, 8), F32, L(mesh, "S(1),S(0)")),
    )
    out_avals = (Aval((8, 8), F32),)
    one_d = ops.op_definition("add").rule([s.aval for s in specs], out_avals)
    reference = _shuffled_rank(one_d, 0, specs, out_avals, mesh)
    again = _shuffled_rank(one_d, seed, specs, out_avals, mesh)
    assert [c.in_layouts + c.out_layouts for c in again] == [c.in_layouts + c.out_layouts for c in reference]
    assert [c.rank_key() for c in again] == sorted(c.rank_key() for c in again)


def test_results_are_cached(mesh: Any) -> None:
    inputs = [((8, 16), F32, L(mesh, "S(0),S(1)")), ((16, 8), F32, L(mesh, "R,S(0)"))]
    assert infer_signature("matmul", inputs) is infer_signature("matmul", list(inputs))
    assert infer_signature("matmul", inputs) is not infer_signature("matmul", inputs, cost_model={"dp": 2})


@dataclass
class FakeDTensor:
    """What a DTensor exposes to inference."""

    shape: tuple[int, ...]
    dtype: Any
    layout: Layout


def test_dtensor_like_objects_and_placements_forms(mesh: Any) -> None:
    x = FakeDTensor((8, 16), np.dtype("float32"), L(mesh, "S(0),S(1)"))
    w = FakeDTensor((16, 8), F32, L(mesh, "R,S(0)"))
    by_objects = infer_signature("matmul", [x, w])
    by_tuples = infer_signature("matmul", [((8, 16), F32, "S(0),S(1)"), ((16, 8), F32, "R,S(0)")], mesh)
    assert by_objects.out_layouts == by_tuples.out_layouts
    assert isinstance(by_objects, Signature)


def test_bad_inputs_are_our_errors(mesh: Any) -> None:
    spec = ((8, 8), F32, L(mesh, "S(0),R"))
    with pytest.raises(ArgumentTypeError, match="list of tensors"):
        infer_signature("exp", spec)
    with pytest.raises(ArgumentTypeError, match="placements without a mesh"):
        infer_signature("exp", [((8, 8), F32, "S(0),R")])
    other = init_device_mesh((4, 2), ("dp", "tp"))
    with pytest.raises(InferenceError, match="different meshes"):
        infer_signature("add", [spec, ((8, 8), F32, L(other, "S(0),R"))])
    with pytest.raises(InferenceError, match="rejects"):
        infer_signature("matmul", [spec, ((4, 4), F32, L(mesh, "R,R"))])
    with pytest.raises(ArgumentTypeError, match="hashable"):
        infer_signature("sum", [spec], axis=[np.array(0)])


def test_signature_prints_a_ranked_table(mesh: Any) -> None:
    signature = infer_signature("add", [((8, 8), F32, L(mesh, "S(0),R")), ((8, 8), F32, L(mesh, "S(1),R"))])
    text = str(signature)
    assert text.splitlines()[0].startswith("add(float32[8, 8] S(0),R ; float32[8, 8] S(1),R)")
    assert "rank | inputs" in text and "all-to-all" in text
    assert len(signature.table(limit=None).splitlines()) == len(signature.candidates) + 2


def test_real_dtensors_are_accepted(mesh: Any) -> None:
    from placements2jax import distribute_tensor

    x = distribute_tensor(np.ones((8, 16), np.float32), mesh, "S(0),S(1)")
    w = distribute_tensor(np.ones((16, 8), np.float32), mesh, "R,S(0)")
    signature = infer_signature("matmul", [x, w])
    assert texts(signature.out_layouts) == ["S(0),P"] and signature.inputs[0].shape == (8, 16)


def test_constants_are_replicated_inputs(mesh: Any) -> None:
    x = ((8, 16), F32, L(mesh, "S(0),S(1)"))
    scaled = infer_signature("mul", [x, 2.0])
    assert texts(scaled.out_layouts) == ["S(0),S(1)"] and scaled.inputs[1].shape == ()
    assert texts(infer_signature("add", [np.ones((16,), np.float32), x]).out_layouts) == ["S(0),S(1)"]
    with pytest.raises(InferenceError, match="no mesh"):
        infer_signature("add", [1.0, 2.0])


# -- issue 16: results the torch form can write, the pending partial charge ----------------------


@pytest.mark.parametrize(
    ("op", "inputs", "params"),
    [
        ("mul", ("P,R", "P,R"), {}),
        ("div", ("R,R", "P,R"), {}),
        ("exp", ("P,R",), {}),
        ("max", ("P,R",), {"axis": 0}),
    ],
)
def test_cost_ties_prefer_layouts_split_in_mesh_order(op: str, inputs: tuple[str, ...], params: dict) -> None:
    """On 4 x 2 these used to split dim 0 over tp then dp (a StridedShard layout) at the
    same cost as a mesh-order layout; cost ties now prefer what torch writes with plain
    Shards. Where the out-of-order layout is strictly cheaper (max: its output is split
    over both mesh dims, no P(max) left) it stays chosen, and its placements (with
    StridedShard) give it back."""
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    specs = [((64, 64), F32, L(mesh, p)) for p in inputs]
    signature = infer_signature(op, specs, **params)
    chosen = signature.chosen
    best = chosen.cost + chosen.pending
    in_order = [c for c in signature.candidates if not c.strided and c.cost + c.pending == best]
    assert not in_order or not chosen.strided
    for x in chosen.in_layouts + chosen.out_layouts:
        assert Layout.from_device_mesh(mesh)(x.placements).bind(x.ndim) is x
    assert (op == "max") == bool(chosen.strided)


def test_a_partial_made_from_a_sharded_input_is_charged_its_reduction() -> None:
    """P + S(0) on (8,): turning S(0) into a partial (all-gather, 448 B) leaves the sum's
    reduction owed (>= 448 B more); reduce-scattering P to S(0) once (448 B) is cheaper,
    as torch does. P + R still continues the partial (R -> P is free)."""
    mesh = init_device_mesh((8,), ("x",))
    p, s = ((8, 16), F32, L(mesh, "P")), ((8, 16), F32, L(mesh, "S(0)"))
    signature = infer_signature("add", [p, s])
    assert texts(signature.in_layouts) == ["S(0)", "S(0)"] and texts(signature.out_layouts) == ["S(0)"]
    assert signature.chosen.cost == 448
    assert [step.collective for step in signature.chosen.plans[0].steps] == ["reduce-scatter"]
    keep = next(c for c in signature.candidates if texts(c.out_layouts) == ["P"])
    assert keep.cost == 448 and keep.pending == 448
    assert texts(infer_signature("add", [p, ((8, 16), F32, L(mesh, "R"))]).out_layouts) == ["P"]
    assert texts(infer_signature("add", [p, 1.0]).out_layouts) == ["P"]


def test_equal_cost_ties_take_torch_s_order() -> None:
    """S(1) + S(0) on (8,): one all-to-all of either input costs the same (56 B). Torch takes
    its first least-cost strategy, Shard(0)'s (its elementwise strategies are listed per
    output layout, Replicate, then Shard(0), Shard(1), ...), and moves the first input; so
    does ours: cost ties order the outputs' splits mesh dim by mesh dim, lower tensor dims
    first, before keeping earlier inputs (docs/inference.md, section 10). S(0) + S(1) gives
    S(0) both ways. P * P keeps a partial at the bytes of reduce-scattering both (as torch,
    whose latency term prefers one all-reduce to two reduce-scatters): an output not split
    on a mesh dim ranks before one split there."""
    mesh = init_device_mesh((8,), ("x",))
    s1, s0 = ((8, 16), F32, L(mesh, "S(1)")), ((8, 16), F32, L(mesh, "S(0)"))
    for op in ("add", "mul"):
        ours = infer_signature(op, [s1, s0])
        assert texts(ours.in_layouts) == ["S(0)", "S(0)"] and texts(ours.out_layouts) == ["S(0)"]
        assert ours.chosen.redistributed == (True, False) and ours.chosen.pending == 0
        kept = next(c for c in ours.candidates if texts(c.out_layouts) == ["S(1)"])
        assert texts(kept.in_layouts) == ["S(1)", "S(1)"] and kept.redistributed == (False, True)
        assert ours.cost == kept.cost == 56 and kept.pending == 0
        swapped = infer_signature(op, [s0, s1])
        assert texts(swapped.out_layouts) == ["S(0)"] and swapped.chosen.redistributed == (False, True)
        assert swapped.cost == 56
    p = ((8, 16), F32, L(mesh, "P"))
    product = infer_signature("mul", [p, p])
    assert texts(product.in_layouts) == ["P", "R"] and texts(product.out_layouts) == ["P"]
    split = next(c for c in product.candidates if texts(c.out_layouts) == ["S(0)"])
    assert product.cost == split.cost + split.pending == 896  # one all-reduce, or two reduce-scatters


@pytest.mark.parametrize(
    ("mesh_shape", "op", "inputs", "out"),
    [
        ((8,), "add", ("P", "P"), "P"),
        ((8,), "add", ("P", "R"), "P"),  # R made P: the replicated value on one coordinate
        ((8,), "mul", ("P", "R"), "P"),
        ((8,), "matmul", ("P", "R"), "P"),
        ((4, 2), "mul", ("P,S(0)", "R,S(0)"), "P,S(0)"),  # tp's splits stay where they are
    ],
)
def test_partials_stay_pending_where_no_split_moves(mesh_shape: tuple[int, ...], op: str, inputs: tuple[str, ...],
                                                    out: str) -> None:
    """A Partial input kept Partial through a linear op, when no other input's split
    moves, runs as given: no bytes now and no pending charge (its reduction was owed before
    the op). Reducing it first would cost bytes the next op may never need."""
    mesh = init_device_mesh(mesh_shape, ("dp", "tp")[: len(mesh_shape)])
    shapes = {"matmul": ((8, 16), (16, 8))}.get(op, ((8, 16), (8, 16)))
    signature = infer_signature(op, [(shape, F32, L(mesh, p)) for shape, p in zip(shapes, inputs)])
    assert texts(signature.out_layouts) == [out]
    assert signature.chosen.cost == 0 and signature.chosen.pending == 0
    assert texts(signature.in_layouts)[0] == inputs[0]


def test_a_partial_kept_while_a_split_is_given_up_is_charged_its_reduction() -> None:
    """P * S(0) on (8,): all-gathering S(0) to carry P on (448 B) leaves the product's
    reduction owed (>= 448 B more); reduce-scattering P into S(0) (448 B) leaves nothing
    owed, as torch does. On 4 x 2, (R,S(0)) @ (P,P) keeping P,P (gathering the row split,
    torch's choice) owes the reduction over tp, where the split is given up: all-reducing
    the weight over tp instead is strictly cheaper (its dp partial continues, owed before
    the op, as in P * R; reduce-scattering it over dp too, to S(1),R, costs the same and
    ranks after: an output not split on a mesh dim ranks first on a cost tie)."""
    mesh = init_device_mesh((8,), ("x",))
    p, s = ((8, 16), F32, L(mesh, "P")), ((8, 16), F32, L(mesh, "S(0)"))
    signature = infer_signature("mul", [p, s])
    assert texts(signature.out_layouts) == ["S(0)"] and signature.cost == 448 and signature.chosen.pending == 0
    keep = next(c for c in signature.candidates if texts(c.out_layouts) == ["P"])
    assert texts(keep.in_layouts) == ["P", "R"] and keep.cost == 448 and keep.pending == 448
    mesh2 = init_device_mesh((4, 2), ("dp", "tp"))
    x, w = ((1024, 2048), F32, L(mesh2, "R,S(0)")), ((2048, 512), F32, L(mesh2, "P,P"))
    ours = infer_signature("matmul", [x, w])
    torch_s = next(c for c in ours.candidates if texts(c.in_layouts) == ["R,R", "P,P"])  # search="torch"'s choice
    assert texts(torch_s.out_layouts) == ["P,P"] and texts(ours.in_layouts) == ["R,S(0)", "P,R"]
    assert texts(ours.out_layouts) == ["P,S(0)"]
    assert ours.cost == torch_s.cost == 4194304 and ours.chosen.pending == 0 < torch_s.pending
    reduced = next(c for c in ours.candidates if texts(c.out_layouts) == ["S(1),S(0)"])
    assert reduced.cost == ours.cost and reduced.pending == 0


def test_the_program_search_walks_without_charging_a_gathered_split() -> None:
    """signature_for(gathered=False), the program search's walk: only a split made partial
    ends a kept partial, so P * S(0) on (8,) keeps P at the same 448 B, its reduction not
    charged (P + S(0) made P + P still is: one reduce-scatter of P wins either way)."""
    mesh = init_device_mesh((8,), ("x",))
    specs = tuple(TensorSpec((8, 16), F32, L(mesh, x)) for x in ("P", "S(0)"))
    out_avals = (Aval((8, 16), F32),)
    model = resolve_cost_model(None)
    for op, charged, free in (("mul", ["S(0)"], ["P"]), ("add", ["S(0)"], ["S(0)"])):
        owed, walked = (signature_for(("primitive", op), (), specs, out_avals, model, mesh, gathered)
                        for gathered in (True, False))
        assert texts(owed.out_layouts) == charged and texts(walked.out_layouts) == free
        assert owed.cost == walked.cost == 448 and walked.chosen.pending == 0


@settings(max_examples=60)  # each example ranks every candidate twice
@given(data=st.data())
def test_gathered_changes_nothing_without_a_partial_and_a_split_on_one_mesh_dim(data: Any) -> None:
    """signature_for shares one signature between both walks where no mesh dim has one
    input partial and another split (select._gathered_matters): there the ranking with
    and without charging a gathered split is the same list, costs and charges included;
    where one has, a P * S(0) keeps its charge (the test above)."""
    shape = data.draw(st.sampled_from(sorted(_BOUNDED_MESHES)))
    mesh = init_device_mesh(shape, _BOUNDED_MESHES[shape])
    op = data.draw(st.sampled_from(sorted(_BOUNDED_OPS)))
    shapes, params = _BOUNDED_OPS[op]
    specs = tuple(TensorSpec(*x) for x in _drawn_inputs(data, mesh, shapes))
    partial = {m for s in specs for m in s.layout.partial_axes}
    split = {m for s in specs for axes in s.layout.dim_axes for m in axes}
    assert _gathered_matters(specs) == bool(partial & split)
    out_avals = infer_signature(op, [(s.shape, s.dtype, s.layout) for s in specs], **params).out_avals
    rule = ops.op_definition(op).rule(tuple(s.aval for s in specs), out_avals, **params)
    orders = nest_orders(mesh, [s.layout for s in specs])
    model = resolve_cost_model(None)
    owed, walked = (rank_candidates(rule, specs, out_avals, mesh, orders, model, gathered=g) for g in (True, False))
    if not _gathered_matters(specs):
        assert [(c, c.cost, c.pending) for c in owed] == [(c, c.cost, c.pending) for c in walked]
        frozen = ops.freeze(params)
        shared = [signature_for(("op", op), frozen, specs, out_avals, model, mesh, g) for g in (True, False)]
        assert shared[0] is shared[1]


def test_p_plus_s_runs_as_one_reduce_scatter() -> None:
    from placements2jax import distribute_tensor

    mesh = init_device_mesh((8,), ("x",))
    a = np.arange(128, dtype=np.float32).reshape(8, 16)
    b = np.ones((8, 16), np.float32)
    pa = distribute_tensor(a, mesh, "R").redistribute(placements="P")
    sb = distribute_tensor(b, mesh, "S(0)")
    out = pa + sb
    assert str(out.layout) == "S(0)"
    for rank in range(8):
        np.testing.assert_allclose(np.asarray(out.to_local(rank)), (a + b)[rank : rank + 1], rtol=1e-6)


_SHAPE_CASES: list[tuple[str, dict[str, Any], list[tuple[tuple[int, ...], Any]]]] = [
    (op, {}, [(a, dt), (b, dt)]) for dt in (F32, jnp.bfloat16, jnp.int32, jnp.int8) for op in ("add", "mul", "matmul")
    for a, b in [((4, 8), (4, 8)), ((4, 1), (1, 8)), ((8,), (4, 8)), ((2, 4, 8), (8, 3)), ((2, 1, 4, 8), (3, 8, 5))]
] + [
    ("add", {}, [((4,), F32), ((4,), jnp.int32)]),
    *[("einsum", {"subscripts": s}, [(x, F32) for x in xs]) for s, xs in [
        ("bij,bjk->bik", [(4, 16, 32), (4, 32, 8)]), ("ij,jk", [(3, 4), (4, 5)]), ("i,i->", [(3,), (3,)]),
        ("...ij,jk->...ik", [(2, 3, 4), (4, 5)]), ("ij,jk->ik", [(3, 1), (4, 5)])]],
    *[(op, {"axis": axis, "keepdims": kd}, [((16, 32, 8), dt)]) for op in ("sum", "mean") for dt in (F32, jnp.int32)
      for axis in (None, 1, -1, (0, 2), ()) for kd in (False, True)],
    *[("transpose", {"axes": axes}, [((16, 32, 8), F32)]) for axes in ((2, 0, 1), (-1, 0, 1))],
    ("transpose", {}, [((16, 32, 8), jnp.int32)]),
    *[("reshape", {"shape": shape}, [((16, 32, 8), F32)]) for shape in ((16, 256), (-1,), (16, -1), 4096, (0, -1))],
    *[(op, {"axis": axis}, [((16, 32), dt)]) for op in ("softmax", "log_softmax") for axis in (-1, 0, (0, 1))
      for dt in (F32, jnp.bfloat16)],
    *[("layer_norm", {}, [(x, F32) for x in xs]) for xs in ([(8, 16, 32), (32,), (32,)], [(8, 16, 32)])],
    *[("take", {"axis": axis}, [((64, 32), F32), ((4, 5), dt)]) for axis in (0, -1) for dt in (jnp.int32, jnp.int8)],
]


def test_output_shapes_without_tracing_match_eval_shape() -> None:
    """The per-op shape rules (cold infer_signature's shortcut past jax.eval_shape) give
    jax.eval_shape's avals exactly, or decline (None) where JAX's promotion or params decide."""
    known = 0
    for op, params, ins in _SHAPE_CASES:
        avals = tuple(Aval(shape, dtype) for shape, dtype in ins)
        got = ops.out_shapes(op, params, avals)
        if got is None:
            continue
        known += 1
        structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in ins]
        expected = jax.eval_shape(partial(ops.op_definition(op).reference, **params), *structs)
        assert got == tuple(Aval(x.shape, x.dtype) for x in jax.tree.leaves(expected)), (op, params, ins)
    assert known > len(_SHAPE_CASES) // 2


def test_lazy_candidates_start_with_the_chosen_one() -> None:
    """infer_signature finds the best candidate running on the inputs as given without
    ranking the others; reading .candidates ranks them all, the chosen one first."""
    mesh3 = init_device_mesh((2, 2, 2), ("a", "b", "c"))
    given = [((16, 32, 8), F32, L(mesh3, "S(0),S(1),S(2)"))]
    signature = infer_signature("sum", given, axis=1)
    chosen = signature.chosen
    assert "candidates" not in vars(signature)  # not ranked yet
    assert signature.candidates[0] is chosen and len(signature.candidates) > 1
    ranked = rank_candidates(ops.op_definition("sum").rule((Aval((16, 32, 8), F32),), signature.out_avals, axis=1),
                             signature.inputs, signature.out_avals, mesh3, nest_orders(mesh3, [given[0][2]]),
                             resolve_cost_model(None))
    pairs = [(c.in_layouts, c.out_layouts) for c in ranked]
    assert pairs == [(c.in_layouts, c.out_layouts) for c in signature.candidates]
    assert signature == Signature(signature.op, signature.inputs, tuple(ranked))


_BOUNDED_MESHES = {(2, 2): ("a", "b"), (4, 2): ("a", "b"), (2, 2, 2): ("a", "b", "c")}
_BOUNDED_OPS = {  # op: (input shapes, params); shapes 6 and 10 split unevenly
    "add": (((16, 10), (16, 10)), {}),
    "matmul": (((6, 16), (16, 8)), {}),
    "softmax": (((8, 16),), {"axis": -1}),
    "einsum": (((4, 6, 8), (4, 8, 2)), {"subscripts": "bij,bjk->bik"}),
}


def _drawn_inputs(data: Any, mesh: Any, shapes: Any) -> list[tuple[Any, Any, Layout]]:
    """Inputs of ``shapes`` on which each mesh dim replicates, holds a partial sum or splits
    a dim (nested in a drawn order)."""
    inputs = []
    for dims in shapes:
        dim_axes: list[tuple[int, ...]] = [() for _ in dims]
        partial: list[Any] = [None] * mesh.ndim
        for m in data.draw(st.permutations(range(mesh.ndim))):
            choice = data.draw(st.sampled_from(["R", "P", *range(len(dims))]))
            if choice == "P":
                partial[m] = Partial().reduce_op
            elif choice != "R":
                dim_axes[choice] += (m,)
        inputs.append((dims, F32, Layout(mesh, tuple(dim_axes), tuple(partial))))
    return inputs


@given(data=st.data())
def test_distinct_orders_build_each_layout_once_from_its_least_order(data: Any) -> None:
    """Branch and bound checks and builds one nest order per class giving a combination's
    tensors the same layouts: the least order of every class, and no two of one class."""
    orders = tuple(itertools.permutations(range(3)))
    positions = [tuple(order.index(m) for m in range(3)) for order in orders]
    n_tensors = data.draw(st.integers(1, 3))
    entries = st.sampled_from([(0, None), (1, None), (None, None), (None, "sum")])
    tables = [tuple(data.draw(entries) for _ in range(n_tensors)) for _ in range(3)]  # a signature per mesh dim

    def layouts(order: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], ...], ...]:
        per_tensor = []
        for t in range(n_tensors):
            dim_axes: list[tuple[int, ...]] = [(), ()]
            for m in order:
                dim = tables[m][t][0]
                if dim is not None:
                    dim_axes[dim] += (m,)
            per_tensor.append(tuple(dim_axes))
        return tuple(per_tensor)

    cosplit = _cosplit(tables)
    pairs = tuple((a, b) for a, b in itertools.combinations(range(3), 2) if cosplit[a][b])
    kept = _distinct_orders(pairs, orders, positions, (2, 2, 2))
    assert kept == tuple(o for o in orders if o in kept)  # in the given sequence
    assert len({layouts(o) for o in kept}) == len(kept)
    for order in orders:
        assert min(o for o in orders if layouts(o) == layouts(order)) in kept
    # a mesh dim of one device nests nothing: mesh order alone unless the others nest, as _add_layouts builds
    nested = any(tables[0][t][0] is not None and tables[0][t][0] == tables[1][t][0] for t in range(n_tensors))
    assert _distinct_orders(pairs, orders, positions, (2, 2, 1)) == (kept if nested else orders[:1])


@settings(max_examples=80)  # each example also ranks every candidate (up to ~0.1 s on the 3-D mesh)
@given(data=st.data())
def test_bounded_choice_is_the_full_rankings_first(data: Any) -> None:
    """When no candidate runs on the inputs as given, infer_signature finds the best by
    branch and bound (a lower bound per mesh dim on each combination of 1-D signatures):
    the same candidate (1-D signatures and nest order included) as ranking all of them."""
    shape = data.draw(st.sampled_from(sorted(_BOUNDED_MESHES)))
    mesh = init_device_mesh(shape, _BOUNDED_MESHES[shape])
    op = data.draw(st.sampled_from(sorted(_BOUNDED_OPS)))
    shapes, params = _BOUNDED_OPS[op]
    inputs = _drawn_inputs(data, mesh, shapes)
    weights = {"a": data.draw(st.sampled_from([1, 3]))}
    signature = infer_signature(op, inputs, cost_model=weights, **params)
    chosen = signature.chosen
    specs = signature.inputs
    rule = ops.op_definition(op).rule(tuple(s.aval for s in specs), signature.out_avals, **params)
    ranked = rank_candidates(rule, specs, signature.out_avals, mesh, nest_orders(mesh, [s.layout for s in specs]),
                             resolve_cost_model(weights))
    assert (chosen.in_layouts, chosen.out_layouts, chosen.one_d, chosen.nest_order, chosen.cost, chosen.pending) == (
        ranked[0].in_layouts, ranked[0].out_layouts, ranked[0].one_d, ranked[0].nest_order, ranked[0].cost,
        ranked[0].pending,
    )
    assert signature == Signature(signature.op, specs, tuple(ranked))


@settings(max_examples=80)  # each example also ranks every candidate
@given(data=st.data())
def test_in_place_candidates_are_the_full_rankings_without_a_move(data: Any) -> None:
    """rank_candidates(in_place=True), the lazy choice's first attempt, gives the full
    ranking's candidates that move no input, in its order: none where some mesh dim has
    no 1-D signature keeping the inputs' placements (returned before building anything),
    a reshape's view where it applies (the view runs in place on any input)."""
    shape = data.draw(st.sampled_from(sorted(_BOUNDED_MESHES)))
    mesh = init_device_mesh(shape, _BOUNDED_MESHES[shape])
    cases = {**_BOUNDED_OPS, "reshape": (((8, 6),), {"shape": (48,)})}
    op = data.draw(st.sampled_from(sorted(cases)))
    shapes, params = cases[op]
    specs = tuple(TensorSpec(dims, dtype, layout) for dims, dtype, layout in _drawn_inputs(data, mesh, shapes))
    avals = tuple(s.aval for s in specs)
    out_avals = _out_avals(op, ops.freeze(params), avals)
    rule = ops.op_definition(op).rule(avals, out_avals, **params)
    orders = nest_orders(mesh, [s.layout for s in specs])
    model = resolve_cost_model(None)
    in_place = rank_candidates(rule, specs, out_avals, mesh, orders, model, in_place=True)
    unmoved = [c for c in rank_candidates(rule, specs, out_avals, mesh, orders, model) if not any(c.redistributed)]
    assert [(c.in_layouts, c.out_layouts, c.one_d, c.nest_order) for c in in_place] == [
        (c.in_layouts, c.out_layouts, c.one_d, c.nest_order) for c in unmoved
    ]


@settings(max_examples=60)  # each example also ranks every candidate
@given(data=st.data())
def test_a_lazy_choice_is_the_full_rankings_first_in_either_walk(data: Any) -> None:
    """signature_for(ranked=False), a walk reading the chosen candidates alone, chooses what
    the full ranking puts first both charging a partial kept while a split is gathered
    (eager dispatch's walk) and not (the program search's: ``gathered=False``): the branch
    and bound charges as the ranking does (not passed ``gathered``, it kept ``P,S(1) *
    S(0),S(1)`` for a reduce-scatter where the ranking keeps the partial)."""
    shape = data.draw(st.sampled_from(sorted(_BOUNDED_MESHES)))
    mesh = init_device_mesh(shape, _BOUNDED_MESHES[shape])
    op = data.draw(st.sampled_from(sorted(_BOUNDED_OPS)))
    shapes, params = _BOUNDED_OPS[op]
    specs = tuple(TensorSpec(*x) for x in _drawn_inputs(data, mesh, shapes))
    gathered = data.draw(st.booleans())
    out_avals = infer_signature(op, [(s.shape, s.dtype, s.layout) for s in specs], **params).out_avals
    model = resolve_cost_model(None)
    clear_caches()  # a signature ranked by an earlier example would be returned as it is
    lazy = signature_for(("op", op), ops.freeze(params), specs, out_avals, model, mesh, gathered, ranked=False)
    chosen = lazy.chosen
    rule = ops.op_definition(op).rule(tuple(s.aval for s in specs), out_avals, **params)
    ranked = rank_candidates(rule, specs, out_avals, mesh, nest_orders(mesh, [s.layout for s in specs]), model,
                             gathered=gathered)
    assert (chosen.in_layouts, chosen.out_layouts, chosen.one_d, chosen.nest_order, chosen.cost, chosen.pending) == (
        ranked[0].in_layouts, ranked[0].out_layouts, ranked[0].one_d, ranked[0].nest_order, ranked[0].cost,
        ranked[0].pending,
    )
    assert [(c.in_layouts, c.out_layouts) for c in lazy.candidates] == [(c.in_layouts, c.out_layouts) for c in ranked]


def test_a_lazy_choice_without_charging_a_gathered_split() -> None:
    """GPT-2's layer norm scale ``P * S(1)`` on dp=2 x tp=4: the program search's walk keeps
    the partial and all-gathers the small (4, 8, 1) factor (48 B, nothing pending: a split
    gathered ends no kept partial there), and a lazy choice (``ranked=False``) is that
    same candidate, not the reduce-scatter (1,536 B) that charging the gathered split picks."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    specs = (TensorSpec((4, 8, 32), F32, L(mesh, "S(0),P")), TensorSpec((4, 8, 1), F32, L(mesh, "S(0),S(1)")))
    out_avals = (Aval((4, 8, 32), F32),)
    model = resolve_cost_model(None)
    clear_caches()
    lazy = signature_for(("primitive", "mul"), (), specs, out_avals, model, mesh, False, ranked=False)
    assert "candidates" not in vars(lazy)  # chosen without ranking the others
    assert texts(lazy.in_layouts) == ["S(0),P", "S(0),R"] and texts(lazy.out_layouts) == ["S(0),P"]
    assert lazy.cost == 48 and lazy.chosen.pending == 0
    assert lazy.candidates[0] is lazy.chosen  # the full ranking starts with it
    owed = signature_for(("primitive", "mul"), (), specs, out_avals, model, mesh, True, ranked=False)
    assert texts(owed.in_layouts) == ["S(0),S(1)", "S(0),S(1)"] and owed.cost == 1536


# -- size-1 mesh dims (multi-host layouts run with dp=1) ----------------------------------------------------------

_TRIVIAL_MESHES = [(1, 8), (1, 2, 4), (2, 1, 4), (1, 1, 1, 2, 2, 2)]
_TRIVIAL_OPS = {  # op: (input shapes, placements per non-trivial mesh dim, params)
    "matmul": (((64, 128), (128, 256)), (("S(0)", "R"), ("R", "S(1)"), ("S(1)", "S(0)")), {}),
    "add": (((64, 128), (64, 128)), (("S(0)", "S(1)"), ("R", "S(0)"), ("S(1)", "R")), {}),
    "sum": (((64, 128),), (("S(0)",), ("S(1)",), ("R",)), {"axis": 0}),
}


def _squeezed(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in mesh_shape if n > 1)


def _on_mesh(mesh: Any, per_real_dim: list[tuple[str, ...]], trivial: str) -> list[Layout]:
    """Layouts per tensor on ``mesh``: the real dims' placements in turn, ``trivial`` on size-1 dims."""
    real = iter(per_real_dim)
    per_dim = [next(real) if n > 1 else None for n in mesh.shape]
    layouts = []
    for t in range(len(per_real_dim[0])):
        dim_axes: list[tuple[int, ...]] = [(), ()]
        for m, p in enumerate(per_dim):
            placement = trivial if p is None else p[t]
            if placement.startswith("S"):
                dim_axes[int(placement[2])] += (m,)
        layouts.append(Layout(mesh, tuple(dim_axes)))
    return layouts


# on a size-1 mesh dim split on dim 0 in every input: the placements there, inputs then outputs
_TRIVIAL_SPLIT = {"matmul": ["S(0)", "R", "S(0)"], "add": ["S(0)", "S(0)", "S(0)"], "sum": ["S(0)", "P"]}


@pytest.mark.parametrize("mesh_shape", _TRIVIAL_MESHES)
@pytest.mark.parametrize("op", sorted(_TRIVIAL_OPS))
@pytest.mark.parametrize("trivial", ["R", "S(0)"])
def test_size_one_mesh_dims_do_not_multiply_candidates(mesh_shape: tuple[int, ...], op: str, trivial: str) -> None:
    """A size-1 mesh dim moves no data whatever its placement: candidates keep the inputs'
    placements there (or change the fewest: ``S(0) @ S(0)`` runs as ``S(0) @ R`` there),
    no more of them than on the mesh without it, choosing what the squeezed mesh chooses on
    the other dims, with torch's placements on the size-1 dims (``S(0) @ R`` stays ``S(0)``,
    the sum over the split dim makes it ``P``)."""
    shapes, placements, params = _TRIVIAL_OPS[op]
    squeezed = _squeezed(mesh_shape)
    names = tuple(f"m{i}" for i in range(len(mesh_shape)))
    full = init_device_mesh(mesh_shape, names)
    small = init_device_mesh(squeezed, tuple(n for n, k in zip(names, mesh_shape) if k > 1))
    real = list(placements[: len(squeezed)])
    on_full = _on_mesh(full, real, trivial)
    on_small = _on_mesh(small, real, trivial)
    signature = infer_signature(op, [(s, F32, p) for s, p in zip(shapes, on_full)], full, **params)
    reference = infer_signature(op, [(s, F32, p) for s, p in zip(shapes, on_small)], small, **params)
    trivial_dims = [m for m, n in enumerate(mesh_shape) if n == 1]
    # R there: the one signature keeping it; S(0) @ S(0): S(0) @ R or S(1) @ S(0) (one input changed)
    offered = 2 if trivial == "S(0)" and op == "matmul" else 1
    assert len(signature.candidates) <= len(reference.candidates) * offered ** len(trivial_dims)
    chosen, expected = signature.chosen, reference.chosen
    real_dims = [m for m, n in enumerate(mesh_shape) if n > 1]
    for got, want in zip(chosen.in_layouts + chosen.out_layouts, expected.in_layouts + expected.out_layouts):
        assert [placement_on(got, m) for m in real_dims] == [placement_on(want, m) for m in range(len(squeezed))]
    assert chosen.cost == expected.cost and chosen.pending == expected.pending
    want = ["R"] * len(chosen.in_layouts + chosen.out_layouts) if trivial == "R" else _TRIVIAL_SPLIT[op]
    for m in trivial_dims:
        assert [str(placement_on(x, m)) for x in chosen.in_layouts + chosen.out_layouts] == want


def test_size_one_mesh_dims_take_the_fewest_changes_there() -> None:
    """Where no 1-D signature runs on the inputs' placements on a size-1 mesh dim, the
    candidates change as few inputs there as possible: ``S(1) @ R`` slices the replicated
    operand into a partial product (torch's choice: it moves nothing), on an 8-D mesh in
    milliseconds (the direct product of every 1-D signature per mesh dim: 2 million)."""
    mesh = init_device_mesh((1, 1, 1, 1, 1, 2, 2, 2), tuple("abcdefgh"))
    signature = infer_signature("matmul", [((64, 128), F32, "S(1),R,R,R,R,R,R,S(0)"), ((128, 256), F32, "R,R,R,R,R,R,S(1),R")],
                                mesh)
    assert texts(signature.chosen.in_layouts) == ["S(1),R,R,R,R,R,R,S(0)", "S(0),R,R,R,R,R,S(1),R"]
    assert texts(signature.chosen.out_layouts) == ["P,R,R,R,R,R,S(1),S(0)"]
    assert signature.chosen.cost == 0 and signature.chosen.pending == 0
    assert len(signature.candidates) < 400


def test_constraints_on_size_one_mesh_dims_are_still_met() -> None:
    """A constraint asking for another placement on a size-1 mesh dim than the inputs'
    gets it (every combination is ranked then), at no cost."""
    mesh = init_device_mesh((1, 8), ("dp", "tp"))
    inputs = [((64, 128), F32, "S(1),S(0)"), ((128, 256), F32, "R,R")]
    assert texts(infer_signature("matmul", inputs, mesh).chosen.out_layouts) == ["P,S(0)"]
    signature = infer_signature("matmul", inputs, mesh, out_layouts="R,S(0)")
    assert texts(signature.chosen.out_layouts) == ["R,S(0)"] and signature.chosen.cost == 0
    assert texts(signature.chosen.in_layouts) == ["R,S(0)", "R,R"]


def test_infer_signature_pauses_the_garbage_collector_and_restores_it(mesh: Any, monkeypatch: Any) -> None:
    """A cold infer_signature runs with Python's cyclic collector paused, as predict
    (caches.collector_paused: its candidates and plans outlive the call), and leaves it on
    or off as it found it, also when the call fails."""
    import gc

    from placements2jax.inference import select

    seen: list[bool] = []
    definition = select.op_definition
    monkeypatch.setattr(select, "op_definition", lambda op: (seen.append(gc.isenabled()), definition(op))[1])
    inputs = [((8, 16), F32, L(mesh, "S(0),R")), ((16, 4), F32, L(mesh, "R,S(1)"))]
    was = gc.isenabled()
    try:
        gc.enable()
        assert texts(infer_signature("matmul", inputs).out_layouts) == ["S(0),S(1)"]
        assert seen and not any(seen) and gc.isenabled()
        with pytest.raises((ArgumentTypeError, InferenceError)):
            infer_signature("matmul", inputs[:1])
        assert gc.isenabled()
        gc.disable()
        infer_signature("matmul", inputs)
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_one_d_signature_hash_is_cached_and_not_pickled_into_another_process() -> None:
    """OneDSig caches its hash; a pickled one is hashed afresh where it is loaded (its
    placements hash strings, whose hashes differ between processes): it finds an equal
    signature's dict entry in a process with another hash seed."""
    import os
    import pickle
    import subprocess
    import sys

    from placements2jax import Replicate, Shard
    from placements2jax.inference.signature import OneDSig

    sig = OneDSig((Shard(0), Partial("sum")), (Replicate(),), {(0, 0)})
    assert hash(sig) == hash((sig.inputs, sig.outputs, sig.even)) == hash(sig)
    assert "_hash" not in pickle.loads(pickle.dumps(sig)).__dict__
    code = (
        "import pickle, sys\n"
        "from placements2jax import Partial, Replicate, Shard\n"
        "from placements2jax.inference.signature import OneDSig\n"
        "loaded = pickle.loads(sys.stdin.buffer.read())\n"
        "fresh = OneDSig((Shard(0), Partial('sum')), (Replicate(),), {(0, 0)})\n"
        "assert loaded == fresh and hash(loaded) == hash(fresh) and {fresh: 1}[loaded] == 1\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": str(hash("seed") % 1000 + 1), "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], input=pickle.dumps(sig), env=env, check=True)
