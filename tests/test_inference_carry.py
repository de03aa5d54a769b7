"""Loop carries chosen by the program search (scan and while): a residual stream made
partial before the loop is carried reduced, where the walk's greedy fixed point carries it
partial and reduces it again for every nonlinear read in every iteration."""

from __future__ import annotations

from fractions import Fraction
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from models import common, stacked
from models.steps import training_step

from placements2jax import DTensor, apply, check, clear_caches, distribute_pytree, distribute_tensor, init_device_mesh
from placements2jax.hlo import compiled_collectives
from placements2jax.inference import CostModel, infer_signature, jaxpr, predict, use_cost_model
from placements2jax.inference.cost import collective_nbytes
from placements2jax.inference.signature import TensorSpec
from placements2jax.layout import Layout


def layer_norm(x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5)


def residual_scan(x0: jax.Array, w0: jax.Array, w1s: jax.Array, w2s: jax.Array, unroll: int | bool = 1) -> jax.Array:
    """A row-parallel projection (partial) feeding a scanned stack of pre-norm MLP blocks."""

    def block(x: jax.Array, w: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        w1, w2 = w
        return x + jnp.tanh(layer_norm(x) @ w1) @ w2, None

    x, _ = lax.scan(block, x0 @ w0, (w1s, w2s), unroll=unroll)
    return jnp.tanh(x)


def residual_while(x0: jax.Array, w0: jax.Array, w1s: jax.Array, w2s: jax.Array) -> jax.Array:
    """The same blocks under ``lax.while_loop`` (a counter carried beside the stream)."""

    def block(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, x = carry
        return i + 1, x + jnp.tanh(layer_norm(x) @ w1s[i]) @ w2s[i]

    _, x = lax.while_loop(lambda c: c[0] < w1s.shape[0], block, (0, x0 @ w0))
    return jnp.tanh(x)


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(scope="module")
def inputs(mesh: Any) -> tuple[list[np.ndarray], list[Any]]:
    rng = np.random.default_rng(0)
    arrays = [
        rng.normal(size=(8, 32)).astype(np.float32), rng.normal(size=(32, 32)).astype(np.float32) / 6,
        rng.normal(size=(3, 32, 64)).astype(np.float32) / 6, rng.normal(size=(3, 64, 32)).astype(np.float32) / 8,
    ]
    placements = ("S(0),S(1)", "R,S(0)", "R,S(2)", "R,S(1)")  # x0 @ w0 is S(0),P: partial over tp
    return arrays, [distribute_tensor(a, mesh, p) for a, p in zip(arrays, placements)]


def _greedy_carry(fn: Any, args: list[Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The program search with the carries fixed at the walk's greedy fixed point (before
    carry re-solving): one carry option, no seeds, no re-solving rounds."""
    with monkeypatch.context() as patch:
        patch.setattr(jaxpr, "_CARRY_OPTIONS", 1)
        patch.setattr(jaxpr, "_CARRY_SEEDS", 0)
        patch.setattr(jaxpr, "_CARRY_ROUNDS", 0)
        clear_caches()
        greedy = predict(fn, *args)
    clear_caches()
    return greedy


def _compiled_nbytes(prediction: Any) -> Any:
    """The bytes each device sends as CPU XLA compiles the prediction: a reduce-scatter is
    an all-reduce of the whole block (twice its bytes), as the search prices it."""
    return sum((2 * s.nbytes if s.collective == "reduce-scatter" else s.nbytes for s in prediction.steps), Fraction(0))


def _loop_row(prediction: Any, primitive: str) -> Any:
    (row,) = [r for r in prediction.equations if r.primitive == primitive]
    return row


@pytest.mark.parametrize(("fn", "primitive", "carry"), [(residual_scan, "scan", 0), (residual_while, "while", 3)])
def test_the_search_carries_the_residual_stream_reduced(
    inputs: Any, monkeypatch: pytest.MonkeyPatch, fn: Any, primitive: str, carry: int
) -> None:
    """Greedy: the carry stays S(0),P (the initial layout is a fixed point) and each
    iteration reduces it for the layer norm's square, its scaling and the matmul
    (reduce-scatters, all-reduces as CPU XLA compiles them); re-solved: carried S(0),R
    (one all-reduce per iteration of the body's result), as XLA compiles it. The carries'
    re-solving is the search's mechanics, measured at the 192 B per collective its schedule
    was tuned at (``CostModel(collective_overhead=192)``): under the latency-bound default
    the rest of the greedy program adapts around its S(0),P carry to the same 1,536 B in 2
    all-reduces (the re-solved plan is the same at both overheads)."""
    _, args = inputs
    with use_cost_model(CostModel(collective_overhead=192)):
        greedy = _greedy_carry(fn, args, monkeypatch)
        prediction = predict(fn, *args)
        assert str(_loop_row(greedy, primitive).signature.chosen.in_layouts[carry]) == "S(0),P"
        row = _loop_row(prediction, primitive)
        assert str(row.signature.chosen.in_layouts[carry]) == "S(0),R"
        assert str(row.outputs[-1].layout) == "S(0),R"
        # as the search prices them (CPU XLA's reduce-scatter is an all-reduce): 1,536 B against greedy's 1,920 B
        assert (_compiled_nbytes(prediction), len(prediction.steps)) < (_compiled_nbytes(greedy), len(greedy.steps))
        report = check(fn, *args)
        assert [o.verdict for o in report.outputs] == ["equal"]
        assert report.predicted_bytes == report.compiled_bytes  # greedy: twice XLA's bytes
        assert report.prediction is prediction


@pytest.mark.parametrize("fn", [residual_scan, residual_while])
def test_apply_runs_the_chosen_carries(inputs: Any, fn: Any) -> None:
    arrays, args = inputs
    expected = jax.jit(fn)(*arrays)
    out = apply(fn, *args)
    assert str(out.layout) == str(predict(fn, *args).out_layouts[0])
    np.testing.assert_allclose(np.asarray(out.full_tensor()), np.asarray(expected), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("shape", "placements", "rows", "nbytes", "combined"), [
    ((8,), ("S(0)", "R", "S(2)", "S(1)"), 8, 4480, 3),
    ((4, 2), ("S(0),S(1)", "R,S(0)", "S(2),S(1)", "S(2),S(1)"), 16, 26368, 14),
])
def test_pinned_apply_compiles_the_predicted_loops(
    shape: Any, placements: Any, rows: int, nbytes: int, combined: int
) -> None:
    """apply(execute="pinned") compiles the predicted program of ``residual_scan``'s
    gradient: its bytes per device as predicted (all-reduces for the reduce-scatters, as
    CPU XLA compiles them), the values plain jax.jit's. Each loop's results are pinned
    where it returns it: on (8,), with only a result's consumers pinned, XLA moved the
    backward scan's S(0) result to S(1) for one matmul and that copy back to S(0) for the
    other (7,392 B). Each input of a loop moves along its planned route: on 4x2 XLA
    otherwise moved the stacked weights its own way (15,744 B; 16,512 with neither).
    Moves of one value whose routes begin alike share those first steps, in the
    prediction and the pinned program: on 4x2 the backward scan's second result is
    all-gathered over ``tp`` once for the matmul wanting ``S(1),R`` and the one wanting
    ``S(0),R`` (an all-to-all over ``dp`` after it): 15,616 B, where 15,872 before. Its
    loops split a carry over a mesh dim their initial values are not split over, and the
    search restarted from every loop's carries replicated over it (stop 26) found a
    cheaper plan, the gradients in other layouts: 13,824 B in 19 collectives after XLA's
    combiner where 23 (plain jax.jit: 21,136 B in 27). On (8,) the search restarted from
    replicas over its one mesh dim (jaxpr._replicas_restart) kept 4,592 B where 7,280.
    Those counted no move of the free gradients after the program; charged their moves to
    eager dispatch's layouts, partials reduced (stop 38), every gradient on (8,) is XLA's
    layout in 7,168 B (4,592 and two gradients to convert to XLA's layouts, 8,176 B, before);
    on 4x2 16,320 B, two gradients in eager's layouts where XLA's differ (18,880 B with their
    conversions; three differed before, 17,920 B with theirs). Under the latency-bound
    default cost model (stop 39: 8,192 B per all-gather and all-to-all) fewer collectives
    after XLA's combiner for more bytes: on (8,) 12,544 B in 5 where 7,168 in 6 (plain
    jax.jit: 13,440 B in 6), on 4x2 17,984 B in 18 where 16,320 in 21 (jax.jit: 21,136 in
    27); the pinned program compiles as many collectives as predicted. Stop 45's escape
    from the compiled descents the planner's result replaced (program._escaped) finds
    cheaper plans by that model's objective (check's): on (8,) 5,376 B in 4 collectives
    (22,144 where 29,504; XLA's program 38,592), ``x0``'s gradient then Replicate where XLA
    returns it ``S(0)``; on 4x2 15,552 B in 11 (100,608 where 122,112; XLA's 170,320), three
    gradients in other layouts than XLA's where two were and one partial XLA reduced. Stop
    60's polish (program._polished, its moves each one equation re-chosen alone, kept where
    they lower the search's objective): on (8,) 4,480 B in 3 (one all-gather fewer); on 4x2
    17,600 B in 17 (9 all-gathers and 8 all-reduces), two gradients in other layouts than
    XLA's and one partial XLA reduced, dearer by check's objective (113,536 where 100,608,
    still below XLA's 170,320) though each search's result it polishes is cheaper by its
    own: jaxpr._resolve_carries keeps among the carries' restarts the one least by bytes
    (with its free outputs' moves) before steps, not by the objective, and a restart's
    polished bytes went below the former pick's (15,808 B in 23 steps where 15,936 in 13;
    by the objective 91,456 where 90,240). Stop 61 keeps the restart least by the objective
    among those within eager dispatch's bytes (jaxpr._cheapest): on 4x2 26,368 B in 14
    (7 all-gathers and 7 all-reduces), 94,272 by check's objective, below both
    former picks; more bytes than XLA's 21,136 (in 27) for fewer collectives, as the
    default cost model trades them; one gradient in XLA's layout, two a local slice from
    it and one an all-to-all."""
    rng = np.random.default_rng(1)
    arrays = [
        rng.normal(size=(rows, 32)).astype(np.float32), rng.normal(size=(32, 32)).astype(np.float32) / 6,
        rng.normal(size=(3, 32, 64)).astype(np.float32) / 6, rng.normal(size=(3, 64, 32)).astype(np.float32) / 8,
    ]
    mesh = init_device_mesh(shape, ("tp",) if len(shape) == 1 else ("dp", "tp"))
    args = [distribute_tensor(a, mesh, p) for a, p in zip(arrays, placements)]
    fn = jax.grad(lambda *a: residual_scan(*a).sum(), argnums=(0, 1, 2, 3))
    prediction = predict(fn, *args)
    pinned = jax.jit(lambda *a: apply(fn, *a, execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.lowered_nbytes == nbytes
    assert sum(prediction.combined_counts.values()) == len(compiled) == combined
    got = jax.tree.leaves(pinned(*args), is_leaf=lambda v: isinstance(v, DTensor))
    assert [g.layout for g in got] == list(prediction.out_layouts)
    for g, want in zip(got, jax.jit(fn)(*arrays), strict=True):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_carry_options_and_seeds(inputs: Any) -> None:
    """The loop's program node offers the walked carries first (the eager choice), then
    the body's result's, the reduced and the initial layouts, then one carry at a time in
    the layouts its producer can give; the search also descends from the all-carries ones."""
    _, args = inputs
    walker = jaxpr._Walker(args[0].layout.mesh, jaxpr.resolve_cost_model(None), {})
    closed = jax.make_jaxpr(residual_while)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
    specs = [jaxpr.TensorSpec(a.shape, a.dtype, a.layout) for a in args]
    walker.walk(closed.jaxpr, jaxpr._const_specs(closed.jaxpr, specs[0].layout.mesh), specs, "",
                [("in", i) for i in range(len(specs))])
    (loop,) = walker.loops.values()
    options = loop.options()
    assert options[0] == loop.carries and len(set(options)) == len(options) <= jaxpr._CARRY_OPTIONS
    assert [str(x) for x in options[0]] == ["R,R", "S(0),P"]
    assert ("R,R", "S(0),R") in {tuple(map(str, o)) for o in options}
    assert [tuple(map(str, options[k])) for k in loop.seeds] == [("R,R", "S(0),R")]  # reduced (= returned, initial)
    node = walker.node_at[next(iter(walker.loops))]
    assert [c.in_layouts for c in node.candidates] == [o * 2 for o in options]  # initial values, body's results
    assert all(len(c.out_layouts) == 3 * 2 for c in node.candidates)  # results, condition's reads, body's reads


def test_a_deeper_scanned_layer_stack_predicts_the_plan_of_a_shallow_one() -> None:
    """GPT-2's adamw step (layers under ``lax.scan``, Megatron dp=2 x tp=4) at 2 and 8
    layers: a loop body's collectives count once (as XLA compiles them: 44,942 B per device
    in 23 collectives at every depth), so the plan is the same at both depths. Before the
    search re-chose a scan's stacked outputs looking ahead to their consumers (program.py's
    ``_greedy_stack``), moves of the stacked gradients after the loop (the loop's length
    times a slice's bytes) led its descents into other basins the deeper the stack:
    41,770 -> 56,938 B predicted (1.27x XLA's) from 2 to 8 layers. 41,770 at both until the
    clip's norm summed its squares replicated over dp (program.py's ``_one_reduced``).
    Under the latency-bound default cost model (stop 39: 8,192 B per all-gather and
    all-to-all) 45,606 B at both depths (check: 45,616, 1.015x XLA's) in 17 collectives
    after the combiner, where 40,998 (0.91x) in 21 at 192 B per collective (XLA: 23): its
    8 all-to-alls gone for 4 all-gathers. Since the planner reduces a value partial over
    several mesh dims last mesh dim first (tp before dp, stop 39) 45,610 B (check's bytes
    unchanged, 45,616) in 16 collectives after the combiner, one fewer."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    shallow, deep = (training_step("gpt2", mesh, layers=n) for n in (2, 8))
    two = predict(shallow.fn, *shallow.args, out_layouts=shallow.out_layouts)
    report = check(deep.fn, *deep.args, out_layouts=deep.out_layouts)
    eight = report.prediction
    # 41,766 until take_along_axis had the masked lookup (stop 30: no all-to-all of the log-probabilities, 768 B)
    # 40,998 at 192 B per collective (the default until stop 39); 45,606 reducing dp first (until stop 39's tp first)
    assert eight.lowered_nbytes == two.lowered_nbytes == 45610
    assert eight.collectives == two.collectives
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert report.compiled_bytes == 44942
    # 0.9-0.93 at 192 B per collective; the latency-bound default's 1.015x buys 4 collectives fewer (21 -> 17)
    assert 1.0 <= report.predicted_bytes / report.compiled_bytes <= 1.02
    assert report.predicted_bytes == 45616
    # 17 reducing dp first (until stop 39's tp first)
    assert len(report.predicted_combined) == 16 < len(report.compiled_collectives)


def test_replicated_carries_unsplit_every_loop_over_a_mesh_dim_some_loop_split() -> None:
    """The restart of :func:`jaxpr._resolve_carries` per mesh dim: every loop's carries
    reduced and unsplit over it, offered only where some loop splits a carry over it that
    its initial value is not split over (a gradient accumulator reduce-scattered into
    shards); a carry split as its initial value is (a batch-split residual stream) offers
    nothing."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    layout = lambda text, ndim: Layout.from_device_mesh(mesh)(text).bind(ndim)  # noqa: E731
    spec = lambda text, shape: TensorSpec(shape, np.dtype(np.float32), layout(text, len(shape)))  # noqa: E731
    accumulate = jaxpr._LoopCarries(
        "scan", (spec("R,R", (64, 32)), spec("R,R", (32, 64))), (spec("S(1),P", (64, 32)), spec("S(0),S(1)", (32, 64))),
        (layout("S(1),P", 2), layout("S(0),S(1)", 2)), 1,
    )
    layers = jaxpr._LoopCarries("scan", (spec("S(0),P", (4, 32)),), (spec("S(0),P", (4, 32)),), (layout("S(0),P", 2),), 1)
    loops = {"7": accumulate, "7.6": layers}
    assert jaxpr._replicated_carries({"7.6": layers}, 0) is None
    assert jaxpr._replicated_carries({"7.6": layers}, 1) is None
    seeds = jaxpr._replicated_carries(loops, 0)
    assert seeds is not None
    assert [(path, [str(x) for x in carries]) for path, carries in seeds] == [
        ("7", ["R,R", "R,S(1)"]), ("7.6", ["R,R"]),
    ]
    tp = jaxpr._replicated_carries(loops, 1)  # the head gradient's vocab split over tp
    assert tp is not None and [str(x) for x in tp[0][1]] == ["S(1),R", "S(0),R"]
    # the next rounds start from the layouts the restart's bodies return, whatever the carries' initial values
    returned = jaxpr._replicated_carries({"7.6": layers}, 0, returned=True)
    assert returned is not None and [str(x) for x in returned[0][1]] == ["R,R"]


def test_replicated_constants_gather_what_a_loop_indexes_over_the_mesh_dim() -> None:
    """A ``fori_loop`` body indexing the microbatches reads them as a loop constant (the
    batch split over dp lands on the microbatch dim): the restart over dp gathers it, as a
    scan's scanned input is (dim 0 whole); constants not split over the mesh dim stay."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    layout = lambda text, ndim: Layout.from_device_mesh(mesh)(text).bind(ndim)  # noqa: E731
    spec = lambda text, shape: TensorSpec(shape, np.dtype(np.float32), layout(text, len(shape)))  # noqa: E731
    loop = jaxpr._LoopCarries(
        "scan", (spec("R,R", (32, 64)),), (spec("S(1),S(0)", (32, 64)),), (layout("S(1),S(0)", 2),), 1,
        consts=(spec("S(0),R", (2, 2, 8)), spec("R,S(1)", (32, 64))),
    )
    assert [(path, i, str(x)) for path, i, x in jaxpr._replicated_constants({"5": loop}, 0)] == [("5", 0, "R,R")]
    assert [(path, i, str(x)) for path, i, x in jaxpr._replicated_constants({"5": loop}, 1)] == [("5", 1, "R,R")]


def test_unsplit_first_ranks_the_replicas_over_the_mesh_dim_first() -> None:
    """The restart from replicated loop bodies (:func:`jaxpr._unsplit_first`): a
    signature's candidates that split and make partial nothing over the mesh dim come
    first, each group in its rule's order, so the walk runs the body replicated over it
    where the inputs allow; a signature whose first candidate is such a replica already
    is kept as it is."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    layout = lambda text, ndim: Layout.from_device_mesh(mesh)(text).bind(ndim)  # noqa: E731

    def unsplit(x: Layout, mesh_dim: int) -> bool:
        return x.mesh_dim_split(mesh_dim) is None and x.partial[mesh_dim] is None

    weight = ((16, 32), np.float32, layout("R,S(1)", 2))
    split = infer_signature("matmul", [((8, 16), np.float32, layout("S(0),R", 2)), weight], mesh)
    assert str(split.chosen.out_layouts[0]) == "S(0),S(1)"  # eager keeps the batch split over dp
    ranked = jaxpr._unsplit_first(split, 0)
    assert ranked.candidates[0].in_layouts == (layout("R,R", 2), layout("R,S(1)", 2))  # the batch gathered
    assert sorted(map(id, ranked.candidates)) == sorted(map(id, split.candidates))
    replicas = [c for c in split.candidates if all(unsplit(x, 0) for x in (*c.in_layouts, *c.out_layouts))]
    assert list(ranked.candidates[:len(replicas)]) == replicas
    replicated = infer_signature("matmul", [((8, 16), np.float32, layout("R,R", 2)), weight], mesh)
    assert jaxpr._unsplit_first(replicated, 0) is replicated


# microbatches, remat, dtype -> check's predicted bytes, its collectives after XLA's combiner, XLA's bytes (8
# collectives), the bytes apply(execute="pinned") compiles, its collectives. (8592, 13, 9746, 8586, 13) until
# take_along_axis had the masked lookup (stop 30): its all-to-all over tp (384 B per microbatch) and the scalar loss
# all-reduce over dp it caused gone; (8204, 11, 9746, 8198, 11) at 192 B per collective, the default until stop 39
_ACCUMULATED = {
    (2, False, "float32"): (9740, 8, 9746, 9734, 8),
    (2, True, "bfloat16"): (9740, 8, 9746, 9734, 8),
}


@pytest.mark.parametrize(("microbatches", "remat", "dtype"), sorted(_ACCUMULATED))
def test_gradients_accumulated_under_scan_are_carried_replicated_over_dp(
    microbatches: int, remat: bool, dtype: str
) -> None:
    """tests/models/stacked.py's adamw step with gradients accumulated over microbatches
    under ``lax.scan`` (its layers under an inner scan; Megatron dp=2 x tp=4, the batch
    split over dp): XLA all-gathers the microbatches' tokens over dp and computes every
    microbatch replicated over dp, no gradient reduced over dp (8 collectives, 9,746 B).
    The first search carried the accumulators reduce-scattered over dp (each addend
    reduced into shards in every iteration, the optimizer updating shards and parameters
    and moments all-gathered at the end: 41,468 B, 4.25x XLA's, 41 collectives; with
    remat and bfloat16 35,828 B, 29): every descent stays in that basin. The restart
    from every loop's carries replicated over dp finds XLA's: the accumulators in their
    parameters' layouts. bfloat16: XLA on CPU all-reduces the bfloat16 activations in
    float32 (the pinned program of either dtype sends the same bytes), and check counts
    them so (combine.CombinerRules.widening: 5,808 B, 0.60x, and 16 collectives when it
    counted them in bfloat16, keyed apart from the float32 ones). That restart's body still
    split the microbatch's log-softmax and head gradient over dp (9,776 B, 15 collectives
    after the combiner: the head gradient carried split over (tp, dp) and all-gathered, two
    all-to-alls); the restart from its carries with the bodies' equations ranking their
    candidates unsplit over dp first runs them replicated: 8,592 B (0.88x), 13 collectives.
    Left against XLA's 8 then: the take_along_axis gather's all-to-all over tp (no masked-lookup
    candidate with batching dims until stop 30: 8,204 B, 11), split over dp for half its bytes
    and so a scalar loss all-reduce over dp per microbatch; and the moves back to the layer scans' carries routed
    ``R,P -> R,R`` as a slice over dp, the half block all-reduced over tp and an all-gather
    over dp (2,560 B where one all-reduce of the whole block sends 3,072: three all-gathers
    more). The pinned program sends the predicted 8,586 B (as CPU XLA compiles the planned
    steps, the loss's reduction not owed) since those moves take their planned routes;
    moved whole, XLA all-reduced the whole block for two of them (10,790 B, 1.10x, in 12
    collectives when the body was split). Under the latency-bound default cost model (stop
    39: 8,192 B per all-gather and all-to-all) XLA's 8 collectives after the combiner,
    9,740 B (1.00x), where 8,204 in 11 at 192 B per collective; pinned 9,734 B in 8."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    step = training_step("stacked", mesh, microbatches=microbatches, remat=remat, dtype=dtype)
    nbytes, combined, xla_bytes, pinned_bytes, pinned_count = _ACCUMULATED[microbatches, remat, dtype]
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert report.predicted_bytes == nbytes and len(report.predicted_combined) == combined
    assert report.compiled_bytes == xla_bytes and len(report.compiled_collectives) == 8
    (loop,) = (e.path for e in report.prediction.equations if e.primitive == "scan" and e.depth == 0)
    carries = dict(report.prediction.choices)[loop].in_layouts[:5]  # the accumulation scan's carries
    params = [x.layout for x in jax.tree.leaves(step.args[0], is_leaf=lambda v: isinstance(v, DTensor))]
    assert list(carries) == params
    pinned = jax.jit(lambda *a: apply(step.fn, *a, out_layouts=step.out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, *step.args)
    assert (sum(collective_nbytes(c, 8) for c in compiled), len(compiled)) == (pinned_bytes, pinned_count)


def test_multisteps_update_branch_runs_inlined_in_the_parameters_layouts() -> None:
    """tests/models/stacked.py's step under ``optax.MultiSteps`` (clip + AdamW with a
    warmup-cosine schedule, accumulated over 2 steps: the update inside a ``lax.cond``;
    Megatron dp=2 x tp=4). The first walk's update branch computed the updates split over
    dp and the cond joined them so (slicing the other branch's zeros is free);
    ``apply_updates`` read them split, with no move a re-join where consumers read could
    follow, and the updated parameters were all-gathered to their layouts (34,356 B, 1.43x
    XLA's, 25 collectives by operand). The searched branch computes them in the
    parameters' layouts and sliced them into the join: re-joined as the searched branches
    give them, the program predicts the bytes the same step without MultiSteps does
    (21,844 B when this landed; 18,768 since the layers' saved inputs are stored reduced
    and the clip's norm sums its squares replicated over dp, below XLA's legitimately:
    the embedding's gradient scattered from the activation gradient all-gathered over dp
    where XLA all-reduces the table), the cond's outputs in the parameters' and state's
    layouts. Under the latency-bound default cost model (stop 39: 8,192 B per all-gather
    and all-to-all) the cond's outputs alike, and XLA's plan: 24,080 B in 9 all-reduces
    after the combiner, XLA's 9 (24,086 B), where 18,000 B in 11 at 192 B per collective
    (the token ids and the activation gradient all-gathered over dp for the embedding's
    gradient, which is now all-reduced as XLA's). The cond's index is the literal 0
    (MultiSteps' default ``should_skip_update`` returns ``jnp.array(False)``), and XLA
    inlines its branch 0: so does the walk since stop 40 (inference/simplify.py), a call
    of the update branch, whose outputs are the parameters' and state's layouts; walked
    as a cond the prediction counted 9 collectives after the combiner where its pinned
    program compiles 8; now 8, the pinned program's, one fewer than XLA's own 9."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    cfg, optimizer = stacked.Config(), common.accumulating_optimizer()
    plain = stacked.init(jax.random.key(0), cfg)
    params = distribute_pytree(plain, mesh, stacked.megatron_plan())
    state = common.distribute_state(optimizer.init(plain), params)
    step = partial(stacked.train_step, cfg=cfg, optimizer=optimizer)
    report = check(step, params, state, *common.megatron_batch(cfg, mesh), out_layouts=(params, state, None))
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    # 18,772 B in 13 after the combiner until the clip's norm summed its squares replicated over dp (program's
    # _one_reduced): its 4 B dp all-reduce gone, the head's gradient's joins the loss's
    # (18768, 24086) in (16, 12) until take_along_axis had the masked lookup (stop 30: its all-to-all gone)
    # (18000, 24086) in (15, 11) at 192 B per collective
    assert (report.predicted_bytes, report.compiled_bytes) == (24080, 24086)
    assert (sum(report.predicted_counts.values()), len(report.predicted_combined)) == (14, 8)
    assert len(report.compiled_collectives) == 9
    assert common.below_floor(report)
    gathered = [plan.shape for plan, s in report.prediction.routed_moves() if s.collective == "all-gather"]
    assert gathered == []  # at 192 B the token ids and the activation gradient, for the embedding's
    assert not [e for e in report.prediction.equations if e.primitive == "cond"]
    (update,) = (e for e in report.prediction.equations if e.primitive == "closed_call")
    layouts = [x.layout for x in jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, DTensor))]
    assert [o.layout for o in update.outputs[:5]] == layouts  # the updates
    assert [o.layout for o in update.outputs[-15:]] == layouts * 3  # Adam's moments, the accumulated gradients
    args = (params, state, *common.megatron_batch(cfg, mesh))
    pinned = jax.jit(lambda *a: apply(step, *a, out_layouts=(params, state, None), execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert len(compiled) == len(report.predicted_combined) == 8


def test_skipping_non_finite_updates_all_reduces_one_bool() -> None:
    """tests/models/stacked.py's step with ``optax.apply_if_finite(optax.adam(1e-3), 3)``
    (Megatron dp=2 x tp=4): the wrapper reduces ``isfinite`` over every update with
    ``jnp.all`` (``reduce_and``) and selects the new or old state. ``reduce_and`` had no
    partial output, so the search all-gathered the three tp-split updates' bool arrays
    (1,536 + 3,072 + 3,072 B: check's 26,442 B, 1.10x XLA's 24,072.5; 29,514 B, 1.23x,
    before stop 27's other changes). On bools ``all`` is ``min``: each rank reduces its
    slice to P(min) and the five flags, concatenated, are all-reduced once (one bool, 7.5 B
    as CPU XLA's all-reduce is priced): 18,769.5 B (0.78x), the plain adam step's bytes
    plus that bool (predict: 18,752 -> 18,759.5; check adds the loss's 10 B reduction).
    Under the latency-bound default cost model (stop 39: 8,192 B per all-gather and
    all-to-all) the bool alike, in XLA's plan: 24,081.5 B (1.00x) in 8 all-reduces after
    the combiner, XLA's 8, where 18,001.5 B in 10 at 192 B per collective."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    cfg, optimizer = stacked.Config(), optax.apply_if_finite(optax.adam(1e-3), 3)
    params = distribute_pytree(stacked.init(jax.random.key(0), cfg), mesh, stacked.megatron_plan())
    step = partial(stacked.train_step, cfg=cfg, optimizer=optimizer)
    state = optimizer.init(params)
    report = check(step, params, state, *common.megatron_batch(cfg, mesh), out_layouts=(params, state, None))
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    # 37,539 / 2 until take_along_axis had the masked lookup (stop 30: its all-to-all gone); 36,003 / 2 at 192 B per
    # collective (the default until stop 39)
    assert (report.predicted_bytes, report.compiled_bytes) == (Fraction(48163, 2), Fraction(48145, 2))
    assert len(report.predicted_combined) == len(report.compiled_collectives) == 8
    moves = report.prediction.routed_moves()
    bools = [(plan.shape, s.collective) for plan, s in moves if plan.dtype == jnp.bool_ and s.nbytes]
    assert bools == [((5,), "all-reduce")]  # the two flags computed replicated join the P(min) ones for free
    (finite,) = (e for e in report.prediction.equations if e.primitive == "reduce_and" and e.inputs[0].shape == (5,))
    assert str(finite.inputs[0].layout) == "R,P(min)"


# accumulate -> check's predicted bytes, its collectives after XLA's combiner, XLA's bytes, its collectives, the
# bytes apply(execute="pinned") compiles, its collectives. (8586, 12, ..., 8586, 12) before take_along_axis's masked
# lookup; (8198, 10, ..., 8198, 10) at 192 B per collective (the default until stop 39)
_INDEXED = {
    "fori_loop": (9734, 7, 9728, 7, 9734, 7),
    "while_loop": (9734, 7, 9728, 7, 9734, 7),
}


@pytest.mark.parametrize("accumulate", sorted(_INDEXED))
def test_gradients_accumulated_over_indexed_microbatches_are_carried_replicated_over_dp(accumulate: str) -> None:
    """tests/models/stacked.py's step with gradients accumulated over 2 microbatches the
    body indexes (``lax.fori_loop``, which JAX runs as a scan, and ``lax.while_loop``),
    updated by ``optax.lion`` (Megatron dp=2 x tp=4, the batch split over dp): the
    microbatches are a loop constant split over dp on the microbatch dim, not a scanned
    input whose dim 0 must be whole. XLA all-gathers the tokens and targets over dp and
    runs both microbatches on every dp rank (9,728 B in 7 collectives). The first search
    split them over dp (29,682 B as the search counts). The restart from carries
    replicated over dp alone stopped at 19,202 B (1.97x XLA's): its body still took each
    microbatch split over dp (an all-to-all of the tokens), and its walk started the
    bodies from the first search's other layouts (the head gradient carried Replicate),
    which the search did not leave. The restart gathers the loop's constants split over
    dp (18,490 B), then walks again from the carries as its bodies return them, reduced
    and unsplit over dp: 9,770 B, 1.00x XLA's, 14 collectives against XLA's 7, the body
    splitting some activations over dp. A last restart from those carries, the bodies'
    equations ranking their candidates unsplit over dp first, runs them replicated:
    8,586 B (0.88x), 12 collectives (left: the take_along_axis all-to-all, the layer
    scans' carries' routed moves); pinned, the same bytes. With take_along_axis's masked
    lookup (stop 30) 8,198 B in 10, pinned alike (the scans' carries' moves left). Under
    the latency-bound default cost model (stop 39: 8,192 B per all-gather and all-to-all)
    XLA's 7 collectives after the combiner, 9,734 B (1.00x), pinned alike."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    step = training_step("stacked", mesh, optimizer=optax.lion(1e-4), microbatches=2, accumulate=accumulate)
    nbytes, combined, xla_bytes, xla_count, pinned_bytes, pinned_count = _INDEXED[accumulate]
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert [o.verdict for o in report.outputs] == ["equal"] * len(report.outputs)
    assert (report.predicted_bytes, len(report.predicted_combined)) == (nbytes, combined)
    assert (report.compiled_bytes, len(report.compiled_collectives)) == (xla_bytes, xla_count)
    (loop,) = (e for e in report.prediction.equations if e.primitive in ("scan", "while") and e.depth == 0)
    assert [str(x) for x in loop.signature.chosen.in_layouts[:2]] == ["R,R", "R,R"]  # the tokens and targets, gathered
    pinned = jax.jit(lambda *a: apply(step.fn, *a, out_layouts=step.out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, *step.args)
    assert (sum(collective_nbytes(c, 8) for c in compiled), len(compiled)) == (pinned_bytes, pinned_count)
    got = jax.tree.leaves(pinned(*step.args)[0], is_leaf=lambda v: isinstance(v, DTensor))
    want = jax.tree.leaves(step.plain_jit()(*step.plain_args())[0])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=1e-5, atol=1e-6)


# layers, unroll -> check's predicted bytes, its collectives after XLA's combiner, XLA's bytes, the bytes
# apply(execute="pinned") compiles, the scans walked (depth, label). 3 layers: 39,796 B in 16 (pinned 39,786) until
# the clip's norm summed its squares replicated over dp (program's _one_reduced: a 4 B all-reduce over dp less)
_UNROLLED = {
    # (29328, 12, ..., 29318) and (39792, 15, ..., 39782) before take_along_axis's masked lookup (stop 30)
    # check's collectives: the plan and the free loss's P(dp),P(tp) reduced last mesh dim first, as XLA compiles the
    # plan with the loss reduced in one constraint (12 / 15: measured, stop 38; 11 / 14 counted dp first before).
    # (28560, 12, ..., 28550) and (39024, 15, ..., 39014) at 192 B per collective (the default until stop 39); under
    # the latency-bound default every collective an all-reduce, one more than XLA's 9 / 11 after the combiner (10 / 12)
    # until the planner reduced a partial over several mesh dims tp first (stop 39): XLA's 9 / 11, predicted bytes
    # unchanged, the pinned program's 34,640 / 45,200 -> 34,634 / 45,194
    (2, 2): (34640, 9, 34454, 34634, [(0, "scan[unroll=2]"), (0, "scan[unroll=2]")]),
    (3, 2): (45200, 11, 44822, 45194, [(0, "scan[unroll=2]"), (1, "scan"), (0, "scan[unroll=2]"), (1, "scan")]),
}


@pytest.mark.parametrize(("layers", "unroll"), sorted(_UNROLLED))
def test_an_unrolled_scan_is_predicted_as_xla_compiles_it(layers: int, unroll: int) -> None:
    """tests/models/stacked.py's adamw step with its layers under ``lax.scan(unroll=2)``
    (Megatron dp=2 x tp=4): XLA's program holds the layer body twice (2 layers: one trip,
    all copies and no loop; 3 layers: a loop of one trip of two copies, and one copy
    after it), and so does the walk (:func:`jaxpr.unrolled_scan`), each copy's
    collectives counted. Walked as one body (before), the step with 2 layers predicted
    its unroll=1 plan, 21,844 B, where the pinned program sent 35,466 (1.62x) and XLA
    34,454; now 29,328 B predicted, the pinned program the prediction's (1.00x), its
    values plain jax.jit's. Under the latency-bound default cost model (stop 39: 8,192 B
    per all-gather and all-to-all) 34,640 B (1.01x XLA's) in 10 all-reduces after the
    combiner where 28,560 in 12 at 192 B per collective (XLA: 9); 9 all-reduces, XLA's
    count, since the planner reduces a partial over several mesh dims tp first (stop 39)."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    step = training_step("stacked", mesh, layers=layers, unroll=unroll)
    nbytes, combined, xla_bytes, pinned_bytes, scans = _UNROLLED[layers, unroll]
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert report.predicted_bytes == nbytes and report.compiled_bytes == xla_bytes
    assert len(report.predicted_combined) == combined
    walked = [(e.depth, e.primitive) for e in report.prediction.equations if e.primitive.split("[")[0] == "scan"]
    assert walked == scans
    pinned = jax.jit(lambda *a: apply(step.fn, *a, out_layouts=step.out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, *step.args)
    assert sum(collective_nbytes(c, 8) for c in compiled) == pinned_bytes <= 1.05 * nbytes
    full = lambda tree: jax.tree.map(  # noqa: E731
        lambda v: v.full_tensor() if isinstance(v, DTensor) else v, tree, is_leaf=lambda v: isinstance(v, DTensor)
    )
    for got, want in zip(jax.tree.leaves(full(pinned(*step.args))), jax.tree.leaves(jax.jit(step.fn)(*full(step.args))),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


# 9,600 / 12,928 B until the finishing descents' reduced moves (program.py): the residual stream's partial reduced
# where its consumers take it (all-reduces, shared), not reduce-scattered before the final tanh (compiled on CPU as an
# all-reduce, 768 B where 384 planned) and all-gathered back in the backward scan: the same planned bytes (9,216 /
# 11,008), 384 B and one all-gather fewer as compiled (20 -> 19 collectives after the combiner), pinned alike
@pytest.mark.parametrize(("unroll", "nbytes", "combined"), [(2, 17664, 8), (True, 12544, 8)])
def test_apply_runs_an_unrolled_scan_and_its_reverse(
    inputs: Any, unroll: int | bool, nbytes: int, combined: int
) -> None:
    """``residual_scan``'s gradient (3 layers; its backward scan a reverse one) with
    ``unroll=2`` (a loop of one trip of two copies, then one copy: the forward scan's
    last row, the backward's first) and ``unroll=True`` (three copies, no loop): both
    executors compute plain jax.jit's values, the pinned program sending the predicted
    bytes (unroll=1: 3,712 B at 192 B per collective, the body once). Under the
    latency-bound default cost model (stop 39: 8,192 B per all-gather and all-to-all)
    every collective is an all-reduce, 8 after XLA's combiner as plain jax.jit's (18,688
    B): unroll=2 17,664 B where 9,216 in 15 at 192 B per collective, unroll=True the same
    12,544 B where in 18 (unroll=1: 6,400 B in 4 where 3,712 in 9)."""
    arrays, args = inputs
    fn = jax.grad(lambda *a: residual_scan(*a, unroll=unroll).sum(), argnums=(0, 1, 2, 3))
    prediction = predict(fn, *args)
    pinned = jax.jit(lambda *a: apply(fn, *a, execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.lowered_nbytes == nbytes
    assert sum(prediction.combined_counts.values()) == len(compiled) == combined
    for got in (apply(fn, *args), pinned(*args)):
        for g, want in zip(got, jax.jit(fn)(*arrays), strict=True):
            np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(want), rtol=2e-5, atol=2e-5)
