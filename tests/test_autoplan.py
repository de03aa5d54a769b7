"""auto_plan: the searched plan is a distribute_pytree plan, trains like plain JAX, is
no worse than the presets at their memory budget, fits a tight budget, honours fixed=,
and its memory estimate bounds XLA's compiled memory (tiny MLP steps on dp=2 x tp=4; the
GPT-2 / Llama figures are in benchmarks/bench_autoplan.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from models import common, steps

from placements2jax import (
    DTensor,
    Layout,
    apply,
    check,
    auto_plan,
    colwise,
    distribute_pytree,
    distribute_tensor,
    init_device_mesh,
    plan_figures,
    plan_layouts,
    resolve_layout,
    rowwise,
    state_layouts,
)
from placements2jax.autoplan import AutoPlan, compiled_figures, planned_inputs
from placements2jax.errors import ShapeError
from placements2jax.dtensor import auto_twin_of

FIXED = {"args/1": "S(0),R", "args/2": "S(0),R"}  # the batch split over dp
MEGATRON = {"up": colwise("tp"), "down": rowwise("tp")}
# our estimate counts every unfused intermediate: XLA's fusion keeps less (measured 1.8-2.1x)
MEMORY_TOLERANCE = 2.5


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(scope="module")
def problem() -> tuple[Any, ...]:
    rng = np.random.default_rng(0)
    params = {"up": rng.normal(size=(64, 256)).astype(np.float32) / 8,
              "down": rng.normal(size=(256, 64)).astype(np.float32) / 16}
    state = common.make_optimizer().init(params)
    x, y = (rng.normal(size=(16, 64)).astype(np.float32) for _ in range(2))
    return params, state, x, y


@pytest.fixture(scope="module")
def megatron(mesh: Any, problem: tuple[Any, ...]) -> Any:
    return plan_figures(steps.mlp_step, *problem, mesh=mesh, plan=MEGATRON, fixed=FIXED)


@pytest.fixture(scope="module")
def plan(mesh: Any, problem: tuple[Any, ...], megatron: Any) -> AutoPlan:
    return auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=FIXED, presets={"megatron": MEGATRON},
                     memory_budget=megatron.memory)


def test_plan_is_a_distribute_pytree_plan(mesh: Any, problem: tuple[Any, ...], plan: AutoPlan) -> None:
    params = problem[0]
    placed = distribute_pytree(params, mesh, plan)
    assert {k: v.layout for k, v in placed.items()} == {"up": plan["up"], "down": plan["down"]}
    assert plan_layouts(params, mesh, plan.torch_form()) == {"up": plan["up"], "down": plan["down"]}
    text = str(plan)
    assert "megatron" in text and "fsdp" in text and "bytes/step" in text and "args/1" in text
    assert plan.figures.nbytes > 0 and plan.evaluations <= 24


@pytest.mark.parametrize("execute", ["xla", "pinned"])
def test_training_with_the_plan_equals_plain_jax(mesh: Any, problem: tuple[Any, ...], plan: AutoPlan,
                                                 execute: str) -> None:
    """One step of the plan, by XLA's propagation ("xla") or as the predicted program with
    every layout pinned ("pinned", whose bytes the plan's prediction states), equals
    plain jax.jit's step."""
    params, state, x, y = problem
    placed = distribute_pytree(params, mesh, plan)
    placed_state = common.distribute_state(state, placed)
    batch = [distribute_tensor(a, mesh, plan.args[f"args/{k}"]) for k, a in ((1, x), (2, y))]
    new_params, new_state, loss = apply(steps.mlp_step, placed, placed_state, *batch,
                                        out_layouts=(placed, placed_state, None), execute=execute)
    ref_params, ref_state, ref_loss = jax.jit(steps.mlp_step)(params, state, x, y)
    np.testing.assert_allclose(float(loss.full_tensor()), float(ref_loss), rtol=1e-5)
    for key in params:
        assert new_params[key].layout == plan[key]
        np.testing.assert_allclose(np.asarray(new_params[key].full_tensor()), np.asarray(ref_params[key]),
                                   rtol=1e-5, atol=1e-6)
    mu = new_state[1][0].mu
    np.testing.assert_allclose(np.asarray(mu["up"].full_tensor()), np.asarray(ref_state[1][0].mu["up"]),
                               rtol=1e-5, atol=1e-7)


def test_no_worse_than_megatron_at_its_budget(plan: AutoPlan, megatron: Any) -> None:
    """score="xla" (the default): XLA compiles the chosen plan to no more bytes than Megatron."""
    assert plan.score == "xla" and plan.presets["megatron"] == megatron
    assert plan.figures.memory <= megatron.memory
    # FSDP over dp needs more than Megatron's budget: shown by its prediction, not compiled
    assert plan.presets["fsdp"].memory > megatron.memory and set(plan.compiled) == {"auto", "megatron"}
    assert "not compiled" in next(line for line in plan.comparison().splitlines() if line.lstrip().startswith("fsdp"))
    assert plan.compiled["auto"].nbytes <= plan.compiled["megatron"].nbytes
    assert plan.compiled["auto"].memory <= plan.figures.memory  # the estimate bounds XLA's memory
    assert "XLA bytes/step" in plan.comparison()


def test_pinned_score_ranks_by_the_pinned_program(mesh: Any, problem: tuple[Any, ...], megatron: Any) -> None:
    """score="pinned": the plan will run as apply(..., execute="pinned"), so the finalists are
    compiled as the predicted program pinned and ranked by those figures: no more bytes than
    Megatron's pinned program, and predicted no more than Megatron (the issue's first form:
    the prediction states the pinned program's bytes; under score="xla" a plan is ranked by
    what jax.jit compiles, which the prediction does not state). plan.compiled holds the
    pinned compiles, as compiled_figures(execute="pinned") makes them."""
    pinned = auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=FIXED, presets={"megatron": MEGATRON},
                       memory_budget=megatron.memory, score="pinned")
    assert pinned.score == "pinned" and set(pinned.compiled) == {"auto", "megatron"}
    assert pinned.compiled["auto"].nbytes <= pinned.compiled["megatron"].nbytes
    assert pinned.figures.nbytes <= megatron.nbytes and pinned.memory <= megatron.memory
    assert pinned.compiled["auto"] == compiled_figures(steps.mlp_step, *problem, mesh=mesh, plan=pinned,
                                                       execute="pinned")
    assert pinned.compiled["megatron"] == compiled_figures(steps.mlp_step, *problem, mesh=mesh, plan=MEGATRON,
                                                           fixed=FIXED, execute="pinned")
    assert "pinned bytes/step" in pinned.comparison() and "scored by pinned" in str(pinned)


def test_predicted_no_worse_than_megatron_at_its_budget(mesh: Any, problem: tuple[Any, ...], megatron: Any) -> None:
    """score="predict": the search's best by prediction, nothing compiled."""
    predicted = auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=FIXED, presets={"megatron": MEGATRON},
                          memory_budget=megatron.memory, score="predict")
    assert predicted.compiled == {} and predicted.score == "predict"
    assert predicted.figures.memory <= megatron.memory
    assert predicted.figures.nbytes <= megatron.nbytes
    assert predicted.figures.objective <= megatron.objective


def test_a_tight_budget_finds_a_plan_replication_does_not_fit(mesh: Any, problem: tuple[Any, ...]) -> None:
    replicated = plan_figures(steps.mlp_step, *problem, mesh=mesh, plan={}, fixed=FIXED)
    budget = replicated.params + replicated.state  # not even the replicated weights' activations fit
    tight = auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=FIXED, memory_budget=budget, max_evaluations=8,
                      score="predict")
    assert tight.figures.memory <= budget < replicated.memory
    assert any(layout.dim_axes != ((), ()) for layout in tight.values())


def test_predict_seconds_is_the_predictions_cpu_time(mesh: Any, problem: tuple[Any, ...], megatron: Any) -> None:
    """predict_seconds: the CPU time of the call's predictions alone (the calling thread's,
    not the compiles beside them): positive, within the call's CPU time and its wall time."""
    import time

    cpu = time.process_time()
    plan = auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=FIXED, presets={"megatron": MEGATRON},
                     memory_budget=megatron.memory, max_evaluations=6)
    cpu = time.process_time() - cpu
    assert plan.evaluations > 0 and 0 < plan.predict_seconds <= cpu
    assert plan.predict_seconds <= plan.seconds


def test_fixed_pins_leaves(mesh: Any, problem: tuple[Any, ...]) -> None:
    fixed = {**FIXED, "up": "R,S(1)"}
    pinned = auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=fixed, max_evaluations=6, score="predict")
    assert pinned["up"] == resolve_layout(mesh, "R,S(1)", 2)
    assert pinned.args == {"args/1": resolve_layout(mesh, "S(0),R", 2), "args/2": resolve_layout(mesh, "S(0),R", 2)}
    assert set(pinned.fixed) == {"up", "args/1", "args/2"}
    again = auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=fixed, max_evaluations=6, score="predict")
    assert again.rules == pinned.rules and again.figures == pinned.figures  # deterministic


def _compiled_memory(mesh: Any, problem: tuple[Any, ...], plan: Any) -> int:
    params, state, x, y = problem
    twin = auto_twin_of(mesh.to_jax())
    shardings = {k: NamedSharding(twin, v.partition_spec) for k, v in plan_layouts(params, mesh, plan).items()}
    state_shardings = state_layouts(state, distribute_pytree(params, mesh, plan))
    state_shardings = jax.tree.map(lambda layout: NamedSharding(twin, layout.partition_spec), state_shardings,
                                   is_leaf=lambda v: hasattr(v, "partition_spec"))
    batch = NamedSharding(twin, PartitionSpec("dp"))
    jitted = jax.jit(steps.mlp_step, in_shardings=(shardings, state_shardings, batch, batch),
                     out_shardings=(shardings, state_shardings, None))
    stats = jitted.lower(params, state, x, y).compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


def test_memory_estimate_bounds_the_compiled_memory(mesh: Any, problem: tuple[Any, ...], plan: AutoPlan,
                                                    megatron: Any) -> None:
    for figures, layouts in ((megatron, MEGATRON), (plan.figures, plan)):
        compiled = _compiled_memory(mesh, problem, layouts)
        assert compiled <= figures.memory <= MEMORY_TOLERANCE * compiled, (figures.memory, compiled)


def test_uneven_fixed_leaves(problem: tuple[Any, ...]) -> None:
    """A batch of 12 over 8 devices: score="xla" refuses it (XLA compiles only even shards,
    so no plan could be scored) and says how to go on; score="predict" plans with it (the
    DTensor pads the shards) and the search still proposes only even splits."""
    mesh8 = init_device_mesh((8,), ("tp",))
    params, state, _, _ = problem
    batch = jax.ShapeDtypeStruct((12, 64), jnp.float32)
    fixed = {"args/1": "S(0)", "args/2": "S(0)"}
    with pytest.raises(ShapeError, match=r"fixed\['args/1'\].*unevenly.*score='predict'"):
        auto_plan(steps.mlp_step, params, state, batch, batch, mesh=mesh8, fixed=fixed)
    predicted = auto_plan(steps.mlp_step, params, state, batch, batch, mesh=mesh8, fixed=fixed, max_evaluations=4,
                          score="predict")
    assert predicted.args["args/1"] == resolve_layout(mesh8, "S(0)", 2)
    assert not predicted.args["args/1"].is_even((12, 64))
    assert all(layout.is_even(params[k].shape) for k, layout in predicted.items())
    # per device two padded rows of 64 for each of x and y, and the optimizer step count
    assert predicted.compiled == {} and predicted.figures.args == 2 * 2 * 64 * 4 + 4


def _scanned_step(params: Any, opt_state: Any, x: jax.Array) -> tuple[Any, Any, jax.Array]:
    def loss(p: Any) -> jax.Array:
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
        return jnp.mean(h ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optax.sgd(0.1).update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value


def test_stacked_layers_keep_their_leading_dim(mesh: Any) -> None:
    params = {"layers": jax.ShapeDtypeStruct((4, 32, 32), jnp.float32)}
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    chosen = auto_plan(_scanned_step, params, optax.sgd(0.1).init(params), x, mesh=mesh,
                       fixed={"args/1": "S(0),R"}, max_evaluations=6, score="predict")
    assert chosen["layers"].dim_axes[0] == ()
    assert isinstance(distribute_pytree({"layers": np.zeros((4, 32, 32), np.float32)}, mesh, chosen)["layers"],
                      DTensor)


def test_check_confirms_the_plan_against_xla(mesh: Any, problem: tuple[Any, ...], plan: AutoPlan) -> None:
    """The compiled step's output placements are the predicted ones; its bytes are close to
    the prediction (measured 1.14x on this step: the issue's 1.1x is the whole-program
    search's target, issue 15)."""
    inputs, out_layouts = planned_inputs(steps.mlp_step, *problem, mesh=mesh, plan=plan, fixed=FIXED)
    report = check(steps.mlp_step, *inputs, out_layouts=out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)  # the loss: XLA reduces it
    assert 0.8 <= float(report.predicted_bytes / report.compiled_bytes) <= 1.25


def test_pinned_compile_is_the_predicted_program(mesh: Any, problem: tuple[Any, ...], plan: AutoPlan) -> None:
    """compiled_figures(execute="pinned") compiles the predicted program (as apply(...,
    execute="pinned") runs it): its bytes are the prediction's as CPU XLA compiles its
    collectives (lowered_nbytes: a reduce-scatter as an all-reduce, here 9,226 -> 12,810 B),
    measured 12,820 B (the loss's reduction besides); plain jax.jit compiles another program
    (11,282 B); an AutoPlan's argument layouts are kept without fixed=. (Before the pinned
    moves followed the planner's steps, 15,892 B: the (16, 64) partial sum reduced whole over
    tp, then dp, where the prediction reduce-scatters over dp, then tp on the half block.)"""
    pinned = compiled_figures(steps.mlp_step, *problem, mesh=mesh, plan=plan, execute="pinned")
    assert plan.figures.nbytes <= plan.figures.lowered_nbytes
    assert pinned is not None and plan.figures.lowered_nbytes <= pinned.nbytes <= 1.01 * plan.figures.lowered_nbytes
    assert compiled_figures(steps.mlp_step, *problem, mesh=mesh, plan=plan) == plan.compiled["auto"]


def test_paired_moves_split_column_and_row_partners_together(mesh: Any) -> None:
    """Megatron's partners within one module, in the forward pass's order: GPT-2's fused
    c_attn (d, 3d) with c_proj (d, d), c_fc with the MLP's c_proj, the biases following
    their kernel (a column's split like its last dim, the row's replicated); a stacked
    leaf's dim 0 is skipped; other modules never pair; a square matrix read first is no row."""
    from placements2jax.autoplan import _Group, _Leaf, _paired, _pairs

    f32 = np.dtype(np.float32)
    infos = {0: _Leaf("blocks/mlp/c_fc/kernel", (4, 32, 128), f32, True, (5, 3)),
             1: _Leaf("blocks/mlp/c_proj/kernel", (4, 128, 32), f32, True, (5, 6)),
             2: _Leaf("other/fc/kernel", (128, 32), f32, False, (7,)),
             3: _Leaf("blocks/mlp/c_fc/bias", (4, 128), f32, True, (5, 4)),
             4: _Leaf("blocks/attn/c_attn/kernel", (4, 32, 96), f32, True, (5, 0)),
             5: _Leaf("blocks/attn/c_proj/kernel", (4, 32, 32), f32, True, (5, 2)),
             6: _Leaf("blocks/attn/c_attn/bias", (4, 96), f32, True, (5, 1)),
             7: _Leaf("blocks/attn/c_proj/bias", (4, 32), f32, True, (5, 2)),
             8: _Leaf("blocks/mlp/c_proj/bias", (4, 32), f32, True, (5, 7))}
    groups = _pairs(infos)
    assert groups == [_Group((4,), 5, (6,), 7), _Group((0,), 1, (3,), 8)]
    replicated = {i: resolve_layout(mesh, "R,R", len(leaf.shape)) for i, leaf in infos.items()}
    sharded_bias = {i: Layout(mesh, ((1,), ())) for i in (7, 8)}  # a row bias split over tp gets replicated
    moved = _paired(infos, {**replicated, **sharded_bias}, groups, 1)
    assert moved[0].dim_axes == ((), (), (1,)) and moved[1].dim_axes == ((), (1,), ())
    assert moved[4].dim_axes == ((), (), (1,)) and moved[5].dim_axes == ((), (1,), ())
    assert moved[3].dim_axes == ((), (1,)) and moved[6].dim_axes == ((), (1,))
    assert moved[7].dim_axes == moved[8].dim_axes == ((), ())
    assert moved[2] == replicated[2]
    # read in the other order, c_proj (d, d) would come first: no partner reads before it
    assert _pairs({0: infos[4], 1: _Leaf("blocks/attn/c_proj/kernel", (4, 32, 32), f32, True, (4,))}) == []


def test_paired_moves_on_real_models(mesh: Any) -> None:
    """The partners found in the GPT-2 and Llama test models' adamw steps: every block's
    attention and MLP (Llama's wq, wk, wv with wo; w1, w3 with w2), biases following."""
    from functools import partial

    from models import gpt2, llama

    from placements2jax.autoplan import _pairs, _Problem

    found = {}
    for module in (gpt2, llama):
        cfg = module.Config(layers=2)
        params = jax.eval_shape(lambda: module.init(jax.random.key(0), cfg))
        state = jax.eval_shape(common.make_optimizer().init, params)
        tokens = jax.ShapeDtypeStruct((4, cfg.seq), jnp.int32)
        extra = (jax.random.key(2),) if module is gpt2 else ()
        problem = _Problem(partial(module.train_step, cfg=cfg), params, (state, tokens, tokens, *extra), mesh, FIXED)
        infos = {i: problem.leaf_info(i) for i in problem.free}
        for g in _pairs(infos):
            found[infos[g.row].path] = ([infos[c].path for c in g.columns], [infos[c].path for c in g.column_biases],
                                        None if g.row_bias is None else infos[g.row_bias].path)
    assert found["blocks/attn/c_proj/kernel"] == (["blocks/attn/c_attn/kernel"], ["blocks/attn/c_attn/bias"],
                                                  "blocks/attn/c_proj/bias")
    assert found["blocks/mlp/c_proj/kernel"] == (["blocks/mlp/c_fc/kernel"], ["blocks/mlp/c_fc/bias"],
                                                 "blocks/mlp/c_proj/bias")
    for k in (0, 1):
        assert found[f"layers/{k}/attention/wo"] == ([f"layers/{k}/attention/w{n}" for n in "qkv"], [], None)
        assert found[f"layers/{k}/feed_forward/w2"] == ([f"layers/{k}/feed_forward/w{n}" for n in "13"], [], None)


def test_gpt2_on_a_4x2_mesh_at_megatrons_plan_predicts_below_xla() -> None:
    """GPT-2's adamw step (4 scanned layers) on a 4x2 ``dp, tp`` mesh at Megatron's plan:
    the prediction is at most the 57,402 B it was before the search looked ahead from a
    scan's stacked outputs (ae882e4; XLA's jit compiles 62,786 B). With the look-ahead
    free in the planner-priced search it was 110,314 B: re-chosen there, a partial stack
    was also gathered in the body to meet its consumers' current layouts (the layer dim
    split over ``dp``) for free (docs/autoplan.md); now 48,138 B."""
    from functools import partial

    from models import gpt2

    cfg = gpt2.Config(layers=4)
    params = jax.eval_shape(lambda: gpt2.init(jax.random.key(0), cfg))
    state = jax.eval_shape(common.make_optimizer().init, params)
    tokens = jax.ShapeDtypeStruct((4, cfg.seq), jnp.int32)
    figures = plan_figures(
        partial(gpt2.train_step, cfg=cfg), params, state, tokens, tokens, jax.random.key(2),
        mesh=init_device_mesh((4, 2), ("dp", "tp")), plan=gpt2.megatron_plan("tp"),
        fixed={"args/1": "S(0),R", "args/2": "S(0),R"},
    )
    assert figures.nbytes <= 57_402, figures.nbytes


@pytest.mark.parametrize(("shape", "batch", "most"), [((4, 2), 4, 248_394), ((8,), 8, 314_727)])
def test_llama_off_the_default_mesh_at_megatrons_plan_predicts_as_before(shape: Any, batch: int, most: int) -> None:
    """Llama's adamw step at Megatron's plan on the meshes other than dp=2 x tp=4 that
    section 11 of docs/benchmarks.md plans on: the prediction is no dearer than the
    search's kept result (4x2: 248,394 B since stop 26 (285,258 before), XLA's jit 289,114; (8,): 314,727 B, XLA's
    543,642). The search's basins depend on the mesh: two of its value-move descents
    never gave the kept result on 17 programs at dp=2 x tp=4, and without them these
    predicted 378,730 and 383,719 B (stop 22, reverted)."""
    from functools import partial

    from models import llama

    cfg = llama.Config()
    params = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    state = jax.eval_shape(common.make_optimizer().init, params)
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    names = ("dp", "tp") if len(shape) == 2 else ("tp",)
    split = "S(0),R" if len(shape) == 2 else "S(0)"
    figures = plan_figures(
        partial(llama.train_step, cfg=cfg), params, state, tokens, tokens, mesh=init_device_mesh(shape, names),
        plan=llama.megatron_plan("tp"), fixed={"args/1": split, "args/2": split},
    )
    assert figures.nbytes <= most, figures.nbytes


def test_memory_checked_against_xla_when_xla_keeps_more(mesh: Any, problem: tuple[Any, ...], megatron: Any,
                                                         plan: AutoPlan, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate bounds XLA only when XLA partitions as predicted (docs/autoplan.md): a
    compiled finalist's memory is the larger of the two, checked against the budget. Here XLA
    is made to report more than the budget for every plan but Megatron's: Megatron's is the
    only finalist that fits, so it is chosen; with every plan over, auto_plan says so."""
    import dataclasses

    from placements2jax import autoplan
    from placements2jax.caches import Memo
    from placements2jax.errors import PlanError

    real = autoplan._compiled_figures
    megatron_layouts = plan_layouts(problem[0], mesh, MEGATRON)

    def inflated(keep: bool) -> Any:
        def compiled(prob: Any, layouts: Any, *how: Any) -> Any:
            figures = real(prob, layouts, *how)
            ours = {prob.paths[i]: layouts[i] for i in range(prob.n_params)}
            return figures if keep and ours == megatron_layouts else dataclasses.replace(figures, memory=10 ** 9)
        return compiled

    monkeypatch.setattr(autoplan, "_compiles", Memo(64))  # not the other tests' real compiles
    monkeypatch.setattr(autoplan, "_compiled_figures", inflated(True))
    chosen = auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=FIXED, presets={"megatron": MEGATRON},
                       memory_budget=megatron.memory, max_evaluations=6)
    assert {k: plan[k] for k in ("up", "down")} != megatron_layouts  # unpatched, another plan wins
    assert {k: chosen[k] for k in ("up", "down")} == megatron_layouts
    assert chosen.memory == chosen.figures.memory <= megatron.memory and chosen.memory_source == "estimate"
    assert "memory per device" in str(chosen)

    monkeypatch.setattr(autoplan, "_compiles", Memo(64))
    monkeypatch.setattr(autoplan, "_compiled_figures", inflated(False))
    with pytest.raises(PlanError, match=r"memory_budget.*no plan fits as XLA compiles it.*raise memory_budget"):
        auto_plan(steps.mlp_step, *problem, mesh=mesh, fixed=FIXED, presets={"megatron": MEGATRON},
                  memory_budget=megatron.memory, max_evaluations=6)


def test_plan_memory_is_the_larger_of_estimate_and_xla(plan: AutoPlan) -> None:
    import dataclasses

    assert plan.memory == max(plan.figures.memory, plan.compiled["auto"].memory)
    more = dataclasses.replace(plan, compiled={**plan.compiled, "auto": dataclasses.replace(
        plan.compiled["auto"], memory=plan.figures.memory + 1)})
    assert more.memory == plan.figures.memory + 1 and more.memory_source == "XLA"
    assert "XLA's memory_analysis(), above the estimate" in str(more)
    assert dataclasses.replace(plan, compiled={}).memory_source == "estimate"


def test_compiled_figures_reuses_auto_plans_compile(mesh: Any, problem: tuple[Any, ...], plan: AutoPlan) -> None:
    from placements2jax.autoplan import compiled_figures

    assert compiled_figures(steps.mlp_step, *problem, mesh=mesh, plan=MEGATRON, fixed=FIXED) == \
        plan.compiled["megatron"]


class _Evaluator:
    """_Evaluator's figures, plans and compiles as _compiled_choice reads them: plan "x" is
    ``{0: "x"}``, predicted ``nbytes`` at objective ``objective`` and compiled to ``compiled``
    bytes (None: uneven), every memory 1; the plans compiled are recorded."""

    def __init__(self, plans: dict[str, tuple[float, float, float | None]]) -> None:
        from placements2jax.autoplan import PlanFigures

        self.memo = {(k,): PlanFigures(n, n, 1, 0.0, 1, 0, 0, 0, objective) for k, (n, objective, _) in plans.items()}
        self.plans = {(k,): {0: k} for k in plans}
        self.xla = {k: c for k, (_, _, c) in plans.items()}
        self.compiles: set[str] = set()

    def key(self, free: dict[int, str]) -> tuple[str]:
        return (free[0],)

    def start_compile(self, free: dict[int, str]) -> None:
        pass

    def compile(self, free: dict[int, str]) -> Any:
        from placements2jax.autoplan import CompiledFigures

        self.compiles.add(free[0])
        return None if self.xla[free[0]] is None else CompiledFigures(self.xla[free[0]], 1, 1)


def _choice(plans: dict[str, tuple[float, float, float | None]], presets: tuple[str, ...] = ("megatron",)) -> Any:
    """(chosen plan's name, the plans compiled, the compiled figures' bytes) of _compiled_choice
    over ``plans`` (name -> predicted bytes, objective, compiled bytes), FSDP and ``presets``
    the shown seeds, all fitting a budget of 10."""
    from placements2jax.autoplan import PlanFigures, _compiled_choice

    evaluator = _Evaluator(plans)
    seeds = {name: {0: name} for name in ("fsdp", *presets)}
    shown = {name: PlanFigures(1, 1, 1, 0.0, 1, 0, 0, 0, 1) for name in seeds}  # only their memory (1) is read
    chosen, _, compiled = _compiled_choice(evaluator, seeds, shown, dict.fromkeys(presets), memory_budget=10)
    return chosen[0], evaluator.compiles, {name: c.nbytes for name, c in compiled.items()}


def test_compiled_choice_ranks_by_the_executor() -> None:
    """score="xla" / "pinned": the plan the executor compiles to the fewest bytes, whatever
    the predictions. With the whole-program replicas' restart (s30-restart) Megatron's MLP
    layouts predict 7,174 B (their pinned program's bytes) and the best objective, where
    jax.jit compiles them to 35,856 B: the searched plan jax.jit compiles to 11,282 B wins
    (a rule preferring plans predicted no dearer than every preset returned Megatron's). GPT-2
    on 4x2 at Megatron's budget (77ca677's search): XLA's best searched plan (59,339 B) predicted
    above Megatron (47,690 > 42,122 B) is compiled and wins."""
    mlp = {"fsdp": (120_576, 121_963, 200_000), "megatron": (7_174, 8_127, 35_856),
           "searched": (9_226, 9_734, 11_282), "twin": (9_226, 9_734, 11_282), "third": (13_322, 13_946, 61_458)}
    assert _choice(mlp) == ("searched", set(mlp), {"auto": 11_282, "fsdp": 200_000, "megatron": 35_856})
    gpt2 = {"fsdp": (57_770, 59_934, 104_454), "megatron": (42_122, 47_468, 62_786),
            "a": (47_690, 50_170, 59_339), "b": (46_154, 51_098, 60_000)}
    assert _choice(gpt2)[:2] == ("a", set(gpt2))
    # ties on compiled bytes: the lower predicted objective
    assert _choice({**gpt2, "b": (46_154, 49_000, 59_339)})[0] == "b"


def test_compiled_choice_compiles_the_best_searched_plans_besides_the_presets() -> None:
    """The presets never take a finalist's place: the best XLA_FINALISTS searched plans by
    predicted objective are compiled besides every shown seed that fits, so a preset
    predicted cheapest (wrongly, for the executor) cannot crowd the executor's best out;
    plans further down are not compiled. A plan XLA cannot compile (uneven) is not chosen
    while another compiles; when none does, the best by objective stays."""
    from placements2jax.autoplan import XLA_FINALISTS

    searched = {f"s{k}": (1_000 + k, 1_000 + k, 50_000 - k) for k in range(XLA_FINALISTS + 2)}
    plans = {"fsdp": (900, 900, 60_000), "megatron": (800, 800, 70_000), **searched}
    chosen, compiles, _ = _choice(plans)
    assert compiles == {"fsdp", "megatron", *[f"s{k}" for k in range(XLA_FINALISTS)]}
    assert chosen == f"s{XLA_FINALISTS - 1}"  # the third searched plan compiles cheapest
    uneven = {name: (n, objective, None) for name, (n, objective, _) in plans.items()}
    assert _choice({**uneven, "s1": plans["s1"]})[0] == "s1"
    assert _choice(uneven)[0] == "megatron"  # nothing compiles: the best by predicted objective


_ADAFACTOR = optax.adafactor(1e-2, min_dim_size_to_factor=32)  # factors the MLP's (64, 256) weights


def _adafactor_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
    value, grads = jax.value_and_grad(steps.mlp_loss)(params, x, y)
    updates, opt_state = _ADAFACTOR.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value



def test_factored_statistics_follow_their_parameters(mesh: Any, problem: tuple[Any, ...]) -> None:
    """optax.adafactor's state (v_row / v_col: each weight's shape with a dim dropped) is
    laid out by state_layouts' rule, not searched as free arguments: the planned inputs'
    state has init_optimizer_state's layouts for the Megatron plan, and the plan searches
    the batch only among the other arguments."""
    params, _, x, y = problem
    state = jax.eval_shape(_ADAFACTOR.init, params)
    inputs, out_layouts = planned_inputs(_adafactor_step, params, state, x, y, mesh=mesh, plan=MEGATRON, fixed=FIXED)
    want = state_layouts(state, distribute_pytree(params, mesh, MEGATRON))
    assert [spec.layout for spec in jax.tree.leaves(inputs[1])] == jax.tree.leaves(
        want, is_leaf=lambda v: isinstance(v, Layout))
    factored = want[0]
    # v_row drops a weight's larger dim, v_col the other: up (64, 256) is split over tp on its 256 columns,
    # down (256, 64) on its 256 rows, so both keep the 256 dim's split in v_col
    for name in ("up", "down"):
        assert factored.v_row[name] == resolve_layout(mesh, "R,R", 1), name
        assert factored.v_col[name] == resolve_layout(mesh, "R,S(0)", 1), name
    assert jax.tree.leaves(out_layouts[1], is_leaf=lambda v: isinstance(v, Layout)) == jax.tree.leaves(
        want, is_leaf=lambda v: isinstance(v, Layout))
    chosen = auto_plan(_adafactor_step, params, state, x, y, mesh=mesh, fixed=FIXED, max_evaluations=4,
                       score="predict")
    assert set(chosen.args) == {"args/1", "args/2"}  # the fixed batch; no statistic searched
