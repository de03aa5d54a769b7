"""XLA's collective combiner modelled on predictions (inference/combine.py): small programs
whose compiled collectives are known, checked against the 8 CPU devices' XLA, and the
combiner's rules on hand-made collectives (the GPU's thresholds)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from placements2jax import InferenceError, Layout, apply, distribute_tensor, init_device_mesh
from placements2jax.hlo import compiled_collectives
from placements2jax.inference import check, predict
from placements2jax.inference.combine import (
    PlannedCollective, combine, combiner_rules, lowered_step, move_computations,
)

F32 = jnp.float32


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


def spec(mesh: Any, shape: tuple[int, ...], placements: str, dtype: Any = F32) -> tuple[Any, ...]:
    return (shape, dtype, Layout.from_device_mesh(mesh)(placements))


def replicated(mesh: Any) -> Layout:
    return Layout.from_device_mesh(mesh)("R,R")


def counts(report: Any) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """(predicted per operand, predicted after combining, compiled)."""
    return report.predicted_counts, report.predicted_combined_counts, report.compiled_counts


def all_reduces(report: Any) -> dict[tuple[str, ...], tuple[int, int, int, int]]:
    """Per mesh axes: the all-reduces predicted, predicted after combining, compiled and
    their operands (the planner may add other moves, e.g. reducing half a replicated
    value over tp after a local slice on dp and gathering it back: fewer bytes)."""
    return {c.axes: (c.predicted, c.combined, c.compiled, c.operands) for c in report.axis_checks
            if c.kind == "all-reduce"}


def test_independent_gradient_all_reduces_combine_into_one(mesh: Any) -> None:
    """Two sums over the batch dim split on dp (as data-parallel gradients are): two
    predicted all-reduces, independent, of one dtype on one mesh axis: XLA sends one
    all-reduce of two operands, as modelled."""
    out = Layout(mesh, ((),))
    report = check(lambda a, b: (a.sum(0), b.sum(0)), spec(mesh, (8, 16), "S(0),R"), spec(mesh, (8, 16), "S(0),R"),
                   out_layouts=(out, out))
    assert counts(report) == ({"all-reduce": 2}, {"all-reduce": 1}, {"all-reduce": 1})
    assert report.communication == "equal"
    (row,) = [c for c in report.axis_checks if c.kind == "all-reduce"]
    assert (row.axes, row.predicted, row.combined, row.compiled, row.operands) == (("dp",), 2, 1, 1, 2)
    (merged,) = report.predicted_combined
    assert len(merged.members) == 2 and "predicted combined" in str(report)
    assert report.prediction.combined_counts == {"all-reduce": 1}


def test_dependent_all_reduces_stay_apart(mesh: Any) -> None:
    """The second sum needs the first's reduced value: XLA cannot combine them."""

    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.sum(b * jnp.sum(a, 1)[:, None], 1)

    report = check(f, spec(mesh, (8, 8), "R,S(1)"), spec(mesh, (8, 8), "R,S(1)"), out_layouts=Layout(mesh, ((),)))
    assert all_reduces(report) == {("tp",): (2, 2, 2, 2)}


@pytest.mark.parametrize(
    ("name", "fn", "second"),
    [
        ("other mesh axis", lambda a, b: (a.sum(1), b.sum(1)), "S(1),R"),
        ("other dtype", lambda a, b: (a.sum(1), b.astype(jnp.int32).sum(1)), "R,S(1)"),
        ("other reduction", lambda a, b: (a.sum(1), b.max(1)), "R,S(1)"),
    ],
)
def test_all_reduces_of_another_key_stay_apart(mesh: Any, name: str, fn: Any, second: str) -> None:
    """XLA's key: the replica groups (mesh axes), the element type and the reduction."""
    out = Layout(mesh, ((),))
    report = check(fn, spec(mesh, (8, 8), "R,S(1)"), spec(mesh, (8, 8), second), out_layouts=(out, out))
    expected = {("dp",): (1, 1, 1, 1), ("tp",): (1, 1, 1, 1)} if name == "other mesh axis" else {("tp",): (2, 2, 2, 2)}
    assert all_reduces(report) == expected, name


def test_cpu_xla_combines_no_all_gathers(mesh: Any) -> None:
    """CPU XLA runs only the all-reduce combiner: two independent all-gathers stay two."""
    report = check(lambda a, b: (a * 2, b * 3), spec(mesh, (8, 8), "S(1),R"), spec(mesh, (8, 8), "S(1),R"),
                   out_layouts=(replicated(mesh), replicated(mesh)))
    assert counts(report) == ({"all-gather": 2}, {"all-gather": 2}, {"all-gather": 2})


def test_a_reduce_scatter_combines_with_all_reduces_on_cpu(mesh: Any) -> None:
    """CPU XLA forms no reduce-scatter: a predicted one is an all-reduce of the whole
    block, which combines with an independent all-reduce of the same key."""
    layouts = (Layout.from_device_mesh(mesh)("R,S(0)"), Layout(mesh, ((),)))
    report = check(lambda a, b: (a.sum(1), b.sum(1)), spec(mesh, (8, 8, 4), "R,S(1)"),
                   spec(mesh, (8, 8), "R,S(1)"), out_layouts=layouts)
    assert report.prediction.collectives["reduce-scatter"] == 1 and report.prediction.collectives["all-reduce"] == 1
    assert all_reduces(report) == {("tp",): (2, 1, 1, 2)}


def test_a_loop_body_is_its_own_computation(mesh: Any) -> None:
    """An all-reduce inside a scan's body and one outside it do not combine (XLA combines
    within a computation); the body's runs once per iteration but is one collective.
    (Eager search: the program search, pricing a reduce-scatter as CPU XLA's all-reduce,
    moves the scanned input by an all-to-all instead, leaving the body no reduction.)"""

    def f(a: jax.Array, xs: jax.Array) -> Any:
        def body(c: jax.Array, x: jax.Array) -> Any:
            return jnp.tanh(c + x.sum(0)), None

        carry, _ = lax.scan(body, jnp.zeros(8), xs)
        return a.sum(1), carry

    out = Layout(mesh, ((),))
    report = check(f, spec(mesh, (8, 8), "R,S(1)"), ((3, 4, 8), F32, Layout.from_device_mesh(mesh)("R,S(1)")),
                   out_layouts=(out, out), search="eager")
    scopes = {c.scope for c in _planned(report) if c.kind == "all-reduce"}
    assert scopes == {"", "1"}  # the scan is equation 1
    assert all_reduces(report) == {("tp",): (2, 2, 2, 2)}


def test_a_move_runs_out_of_cond_branches_and_sees_across_loop_boundaries() -> None:
    """Where a move runs, then the computations whose moves it sees (a cond at 3 whose
    branch 0 holds a scan at 3.b0.2, a scan at 5): a branch's move of a value made outside
    it runs before the cond; a loop body sees the moves before the loop, up to a branch."""
    within = move_computations({"3": "cond", "3.b0.2": "scan", "5": "scan"})
    assert within("3.b0.1", ("1", 0)) == ("",)  # an operand of the cond: moved before it
    assert within("3.b0.1", ("3.b0.0", 0)) == ("3.b0",)  # made in the branch
    assert within("3.b0.2.4", ("1", 0)) == ("3.b0.2", "3.b0")  # the branch's operand in its scan
    assert within("3.b0.2.4", ("3.b0.2.3", 0)) == ("3.b0.2", "3.b0")
    assert within("5.2", ("in", 0)) == ("5", "")  # a scan's constant
    assert within("5.carry0", ("5.2", 0)) == ("5", "")
    assert within("3.b0.1", None) == ("3.b0",)  # a literal: moved in the branch reading it
    assert move_computations({})("7", ("in", 0)) == ("",)


def test_a_conds_operand_moved_before_it_combines_with_the_collectives_there(mesh: Any) -> None:
    """Both branches of a cond read its operand, a matmul's partial sum over tp, moved
    alike: the pinned program moves it once before the cond (``operators._Runner._cond``'s
    ``hoisted``), where XLA's combiner merges its all-reduce with the one of another
    partial sum reduced before the cond. Until stop 41 the combiner placed that move in the
    first branch's computation, which combines with nothing outside it: 6 collectives
    counted where the pinned program compiles 5."""

    def f(i: jax.Array, x: jax.Array, w: jax.Array, v: jax.Array, u: jax.Array) -> Any:
        return lax.cond(i > 0, lambda a: jnp.sin(a) * 2.0, lambda a: jnp.cos(a) + 1.0, x @ w), jnp.sin(v @ u)

    rng = np.random.default_rng(0)
    x, w, v, u = (rng.standard_normal(shape, np.float32) for shape in ((8, 16), (16, 8), (8, 16), (16, 8)))
    args = (np.int32(1), *(distribute_tensor(a, mesh, p) for a, p in zip((x, w, v, u), ("R,S(1)", "R,S(0)") * 2)))
    outs = (replicated(mesh), replicated(mesh))
    prediction = predict(f, *args, out_layouts=outs)
    (cond,) = [e.path for e in prediction.equations if e.primitive == "cond"]
    planned = prediction.planned_collectives("cpu")
    in_cond = [(c.kind, c.where, c.scope) for c in planned if c.where.startswith(cond + ".b")]
    # branch 0's move (reduced over tp, then gathered over dp), run before the cond, in the program's computation
    assert in_cond == [("all-reduce", f"{cond}.b0.0", ""), ("all-gather", f"{cond}.b0.0", "")]
    (reduced,) = [g.members for g in prediction.combined() if g.kind == "all-reduce"]
    assert len(reduced) == 2 and f"{cond}.b0.0" in {planned[i].where for i in reduced}
    pinned = jax.jit(lambda *a: apply(f, *a, out_layouts=outs, execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert [len(c.result_shapes) for c in compiled if c.op == "all-reduce"] == [2]
    assert prediction.combined_counts == Counter(c.op for c in compiled) == {"all-reduce": 1, "all-gather": 4}
    for i in (1, 0):
        got = pinned(np.int32(i), *args[1:])
        want = f(np.int32(i), x, w, v, u)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_interleaved_tp_and_dp_all_reduces_combine_as_xla_compiles_them(mesh: Any) -> None:
    """Two values reduced over dp then tp (each squared between), and a tp reduction whose
    square feeds a dp one: combined one group at a time, as ``CombineInstructionsByKey``
    does, the three dp all-reduces form one collective, which makes the first tp one an
    ancestor of the other two (through the third dp one): XLA compiles 3 all-reduces, not
    2 (the groups side by side, as combine counted before: a cycle no program has). The
    pinned program of the prediction compiles them so, and computes the function's values."""

    def f(a: jax.Array, b: jax.Array, x: jax.Array, y: jax.Array) -> Any:
        t = jnp.square(x.sum(1))
        return jnp.square(a.sum(0)).sum(), jnp.square(b.sum(0)).sum(), (t[:, None] * y).sum(0)

    rng = np.random.default_rng(0)
    values = [rng.normal(size=(8, 16)).astype(np.float32) for _ in range(4)]
    args = [distribute_tensor(v, mesh, p) for v, p in zip(values, ("S(0),S(1)", "S(0),S(1)", "R,S(1)", "S(0),R"))]
    outs = (Layout(mesh, ()), Layout(mesh, ()), Layout(mesh, ((),)))
    prediction = predict(f, *args, out_layouts=outs)
    planned = prediction.planned_collectives("cpu")
    assert [(c.kind, c.axes) for c in planned] == [("all-reduce", ("tp",)), *[("all-reduce", ("dp",))] * 2,
                                                   *[("all-reduce", ("tp",))] * 2, ("all-reduce", ("dp",))]
    # XLA's post order: a's reduction (dp, tp), b's, then the tp reduction and the dp one after it
    assert [c.rank for c in planned] == [4, 0, 2, 1, 3, 5]
    assert [g.members for g in prediction.combined()] == [(0,), (1, 2, 5), (3, 4)]
    pinned = jax.jit(lambda *a: apply(f, *a, out_layouts=outs, execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert [len(c.result_shapes) for c in compiled if c.op == "all-reduce"] == [1, 3, 2]
    assert prediction.combined_counts == Counter(c.op for c in compiled) == {"all-reduce": 3}
    square = np.square(values[2].sum(1))
    want = (np.square(values[0].sum(0)).sum(), np.square(values[1].sum(0)).sum(), (square[:, None] * values[3]).sum(0))
    for got, expected in zip(pinned(*args), want, strict=True):
        np.testing.assert_allclose(np.asarray(got.full_tensor()), expected, rtol=1e-5)


def test_an_outputs_reduction_over_two_mesh_dims_is_ordered_as_xla_compiles_it(mesh: Any) -> None:
    """Two outputs ``P(dp),P(tp)`` reduced to their ``out_layouts`` and a tp reduction
    feeding a dp one (as GPT-2's ``value_and_grad`` returns two bias gradients): the
    predicted program reduces an output in one constraint, XLA's SPMD partitioner the last
    mesh dim first, so the outputs' tp all-reduces join the other tp one and their dp ones
    the other dp one: 2 all-reduces compiled. In the planner's order until stop 39 (dp,
    then tp; now tp first, its tie order) the dp group held the dp all-reduce after the tp
    one, and the outputs' tp ones after it could not join that: 3 counted."""

    def f(a: jax.Array, b: jax.Array, x: jax.Array, y: jax.Array) -> Any:
        t = jnp.square(x.sum(1))
        return a.sum(), b.sum(), (t[:, None] * y).sum(0)

    rng = np.random.default_rng(0)
    values = [rng.normal(size=(8, 16)).astype(np.float32) for _ in range(4)]
    args = [distribute_tensor(v, mesh, p) for v, p in zip(values, ("S(0),S(1)", "S(0),S(1)", "R,S(1)", "S(0),R"))]
    outs = (Layout(mesh, ()), Layout(mesh, ()), Layout(mesh, ((),)))
    prediction = predict(f, *args, out_layouts=outs)
    moves = {e.path: e.signature.redistributions[0] for e in prediction.equations if e.primitive == "out_layouts"}
    assert [s.axis for s in moves["out.0"].steps] == [s.axis for s in moves["out.1"].steps] == ["tp", "dp"]
    planned = prediction.planned_collectives("cpu")
    assert [(c.axes, c.where) for c in planned] == [
        (("tp",), "1"), (("tp",), "out.0"), (("dp",), "out.0"), (("tp",), "out.1"), (("dp",), "out.1"),
        (("dp",), "out.2"),
    ]
    assert [g.members for g in prediction.combined()] == [(1, 3, 0), (2, 4, 5)]  # in the planner's order 3 groups
    pinned = jax.jit(lambda *a: apply(f, *a, out_layouts=outs, execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert [len(c.result_shapes) for c in compiled if c.op == "all-reduce"] == [3, 3]
    assert prediction.combined_counts == Counter(c.op for c in compiled) == {"all-reduce": 2}
    square = np.square(values[2].sum(1))
    want = (values[0].sum(), values[1].sum(), (square[:, None] * values[3]).sum(0))
    for got, expected in zip(pinned(*args), want, strict=True):
        np.testing.assert_allclose(np.asarray(got.full_tensor()), expected, rtol=1e-5)


def test_a_combined_group_orders_what_its_members_depend_on_first() -> None:
    """Hand-made: a dp all-reduce (2) after a tp one (1) joins the first dp group (0, 2);
    the tp all-reduce 3 after dp 0 then depends on tp 1 through the combined group, so
    the tp ones stay apart; the combined group's operands (tp 1) come first in the order
    XLA walks next, so tp 1 opens the next group. In program order, groups side by side
    merged 1 and 3 (a cycle with the dp group)."""
    rules = combiner_rules("cpu")

    def c(axes: str, after: int, rank: int) -> PlannedCollective:
        return PlannedCollective("all-reduce", (axes,), "sum", "float32", 4, "", "0", after, rank)

    planned = [c("dp", 0, 0), c("tp", 0, 2), c("dp", 0b10, 1), c("tp", 0b1, 3)]
    assert [g.members for g in combine(planned, rules)] == [(0, 2), (1,), (3,)]
    assert [g.members for g in combine([*planned[:3], c("tp", 0, 3)], rules)] == [(0, 2), (1, 3)]


def _planned(report: Any) -> Any:
    return report.prediction.planned_collectives("cpu")


def test_gpu_rules_combine_all_gathers_up_to_the_threshold() -> None:
    """The GPU pipeline combines all-gathers (element types may differ), all-reduces of
    one element type, up to 30 MiB + 7 bytes of results and 256 operands per collective."""
    rules = combiner_rules("gpu")
    mib = 1024 * 1024

    def c(kind: str, nbytes: int, dtype: str = "float32", after: int = 0) -> PlannedCollective:
        return PlannedCollective(kind, ("tp",), "sum" if kind == "all-reduce" else None, dtype, nbytes, "", "0", after)

    gathers = [c("all-gather", 8), c("all-gather", 8, "bfloat16")]
    assert [g.members for g in combine(gathers, rules)] == [(0, 1)]
    assert len(combine(gathers, combiner_rules("cpu"))) == 2
    big = [c("all-reduce", 20 * mib), c("all-reduce", 20 * mib), c("all-reduce", 5 * mib)]
    assert [g.members for g in combine(big, rules)] == [(0,), (1, 2)]
    assert len(combine(big, combiner_rules("cpu"))) == 1  # CPU: no byte limit
    many = [c("all-reduce", 4) for _ in range(300)]
    assert [len(g.members) for g in combine(many, rules)] == [256, 44]
    typed = [c("all-reduce", 4), c("all-reduce", 4, "int32"), c("all-reduce", 4, after=1)]
    assert [g.members for g in combine(typed, rules)] == [(0,), (1,), (2,)]
    assert combiner_rules("tpu") == rules and combiner_rules("cuda") == rules


def test_only_cpu_sends_bfloat16_collectives_in_float32() -> None:
    """CPU XLA promotes and float-normalizes bfloat16 collectives to float32 (twice the
    bytes; float16 stays); GPU (and TPU, on the GPU's rules) send bfloat16 as it is."""
    cpu, gpu = combiner_rules("cpu"), combiner_rules("gpu")
    assert [cpu.widening(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8)] == [2, 1, 1, 1]
    assert cpu.compiled_dtype(jnp.bfloat16) == np.float32
    assert [gpu.widening(t) for t in (jnp.bfloat16, jnp.float16)] == [1, 1]
    assert combiner_rules("tpu").widening(jnp.bfloat16) == 1


def test_prediction_combines_for_a_given_backend(mesh: Any) -> None:
    out = Layout(mesh, ((),))
    prediction = predict(lambda a, b: (a.sum(0), b.sum(0)), spec(mesh, (8, 16), "S(0),R"),
                         spec(mesh, (8, 16), "S(0),R"), out_layouts=(out, out))
    assert [len(c.members) for c in prediction.combined("gpu")] == [2]
    with pytest.raises(InferenceError, match="backend"):
        prediction.combined("metal")


def test_a_gathers_halo_exchange_is_counted_as_the_permutes_xla_compiles(mesh: Any) -> None:
    """Gathering tp off a dim of 9 rows split (dp, tp) to dp's blocks of 5 rows, XLA first
    sends rows between devices: two collective-permutes of a row over dp and tp, then the
    all-gather (tests/test_inference_cost.py compiles it so). The prediction counts them so
    (its steps' lowered collectives and the combined counts), its bytes 8,192 as compiled."""
    moved = predict(lambda y: 2 * y, spec(mesh, (9, 8, 32), "(dp,tp),None,None"),
                    out_layouts=Layout.from_device_mesh(mesh)("S(0),R"))
    (step,) = [s for s in moved.steps if s.communicates]
    assert step.halo == ((("dp", "tp"), 1024), (("dp", "tp"), 1024))
    rules = combiner_rules("cpu")
    assert lowered_step(step, rules, jnp.float32) == (
        ("collective-permute", 1024), ("collective-permute", 1024), ("all-gather", 6144)
    )
    assert moved.lowered_nbytes == moved.nbytes == 8192
    assert moved.combined_counts == Counter({"collective-permute": 2, "all-gather": 1})
    planned = moved.planned_collectives("cpu")
    assert [(c.kind, c.axes, c.result_bytes) for c in planned] == [
        ("collective-permute", ("dp", "tp"), 1024), ("collective-permute", ("dp", "tp"), 1024),
        ("all-gather", ("tp",), 8192),
    ]
    assert [c.after for c in planned] == [0, 0, 0b11]  # the permutes from the source, the gather after both
