"""The exact program search (benchmarks/exact_milp.py, a MILP solved by HiGHS)
against the steepest-descent search (program._select) on the same graphs, same objective.

    cd /tmp && env -i PATH=/usr/bin:/bin PYTHONPATH=ROOT /work/main/.venv/bin/python \
        ROOT/benchmarks/exact_search.py [PROGRAM ...] [--limit S] [--k K,K,...] [--full] [--lp]
        [--walked] [--followers] [--check K|full]

PROGRAM: mlp, gpt2, llama (the adamw steps of tests/models/steps.py; llama:L / gpt2:L for
L layers), nnx-loss, nnx-vg, eqx-loss, eqx-vg, eqx-adamw (as /work/wt/tools/dump_predictions.py
builds them). Every call of program._select a cold predict makes is captured (the walker
may search again after re-walking), then per call: the search cold (its CPU s) and its
objective (``_Search.total`` as compiled), and the MILP (full with --full, and pruned to
each node's K best-ranked candidates, with and without the search's own choice added, and
with --walked its walked start's instead, a choice found without descending; --k 0: no
pruned form; --followers: those forms with follower merging instead; --lp: the full
program's linear relaxation): binaries, continuous variables, constraints, build and
solve CPU s, objective, dual bound. One line per (call, form); CPU seconds
(time.process_time); --limit is HiGHS's wall-clock limit per solve.

With --check K (or --check full), per program: check() against XLA's compile (predicted
bytes as lowered and collectives) with the search's choice, then with the MILP's in its
place (K: each node's K best-ranked candidates and the search's own; kept only where its
objective is lower), so that a cheaper objective is judged as a prediction too."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
ROOT = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or os.path.dirname(os.path.dirname(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import jax  # noqa: E402

from placements2jax import (  # noqa: E402
    DTensor, check, clear_caches, distribute_pytree, distribute_tensor, init_device_mesh, predict,
)
from placements2jax.inference import program  # noqa: E402
from exact_milp import solve_exact  # noqa: E402


def programs(mesh: Any, names: list[str]) -> Iterator[tuple[str, Any, tuple[Any, ...], Any]]:
    """(name, fn, args, out_layouts) of each program named."""
    from models.steps import training_step

    for name in names:
        model, _, layers = name.partition(":")
        if model in ("mlp", "gpt2", "llama"):
            step = training_step(model, mesh, **({"layers": int(layers)} if layers else {}))
            yield name, *step.program
        else:
            yield (name, *framework(mesh, name))


def framework(mesh: Any, name: str) -> tuple[Any, tuple[Any, ...], Any]:
    import equinox as eqx
    from flax import nnx

    from models import common, eqx_lm, nnx_lm

    tokens, targets = (distribute_tensor(a, mesh, "S(0),R") for a in common.batch(0, 4, 8, 64))
    if name.startswith("nnx"):
        model, _ = nnx_lm.create(nnx_lm.Config(layers=1))
        graphdef, state = nnx.split(model)
        f = nnx_lm.Functional(graphdef)
        params = distribute_pytree(state, mesh, nnx_lm.megatron_plan())
        if name == "nnx-loss":
            return f.loss, (params, tokens, targets), None
        return f.value_and_grad, (params, tokens, targets), (None, params)
    eqx_model = eqx_lm.LM(eqx_lm.Config(layers=1), jax.random.key(0))
    arrays, static = eqx.partition(eqx_model, eqx.is_array)
    eqx_params = distribute_pytree(arrays, mesh, eqx_lm.megatron_plan(), strict=False)
    whole = eqx.combine(eqx_params, static, is_leaf=lambda x: isinstance(x, DTensor))
    if name == "eqx-loss":
        return eqx_lm.loss_fn, (whole, tokens, targets), None
    if name == "eqx-vg":
        return eqx_lm.Functional(static).value_and_grad, (eqx_params, tokens, targets), (None, eqx_params)
    opt_state = distribute_pytree(eqx_lm.optimizer.init(arrays), mesh, eqx_lm.megatron_plan(), strict=False)
    return eqx_lm.train_step, (whole, opt_state, tokens, targets), (whole, opt_state, None)


def capture(fn: Any, args: tuple[Any, ...], out_layouts: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments and results of every program._select call of a cold predict."""
    calls = []
    select = program._select

    def spy(*a: Any) -> dict[str, Any]:
        found = select(*a)
        calls.append((a, found))
        return found

    program._select = spy
    try:
        clear_caches()
        predict(fn, *args, out_layouts=out_layouts)
    finally:
        program._select = select
    return calls


def indices(graph: Any, found: dict[str, Any]) -> dict[str, int]:
    """A _select result (path -> Candidate, empty: eager) as candidate indices."""
    return {
        node.path: next(k for k, c in enumerate(node.candidates) if c is found[node.path]) if found else 0
        for node in graph.nodes
    }


def fmt(cost: tuple[float, float] | None) -> str:
    return f"{cost[0]:.0f}/{cost[1]:.0f}" if cost is not None else "-"


def exact_select(limit: float, k: int | None) -> Any:
    """program._select with the MILP's choice where its objective is lower (see --check)."""
    select = program._select

    def choose(keyed: Any, cost_model: Any, targets: Any, *rest: Any) -> dict[str, Any]:
        found = select(keyed, cost_model, targets, *rest)
        graph = keyed.graph
        search = program._Search(graph, cost_model, targets)
        chosen = indices(graph, found)
        allowed = None if k is None else {
            node.path: set(range(min(k, len(node.candidates)))) | {chosen[node.path]} for node in graph.nodes
        }
        r = solve_exact(search, allowed, time_limit=limit)
        if r.total is None or r.total >= search.total(chosen):
            return found
        return program._chosen(graph, {node.path: 0 for node in graph.nodes}, r.choice)

    return choose


def checked(fn: Any, args: tuple[Any, ...], out_layouts: Any, select: Any = None) -> str:
    """check() with program._select replaced by ``select`` (None: as it is)."""
    original = program._select
    program._select = select or original
    try:
        clear_caches()
        r = check(fn, *args, out_layouts=out_layouts)
    finally:
        program._select = original
    low, xla = float(r.prediction.lowered_nbytes), float(r.compiled_bytes)
    counts = f"{len(r.predicted_combined)}/{len(r.compiled_collectives)}"
    return f"predicted={low:.0f}B xla={xla:.0f}B ratio={low / xla:.3f} collectives={counts}"


def main(argv: list[str]) -> None:
    limit = float(argv[argv.index("--limit") + 1]) if "--limit" in argv else 120.0
    ks = [int(k) for k in argv[argv.index("--k") + 1].split(",") if int(k)] if "--k" in argv else [2, 4]  # 0: none
    valued = ("--limit", "--k", "--check")  # options taking a value
    names = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] not in valued)]
    names = names or ["mlp", "gpt2", "llama", "nnx-loss", "nnx-vg", "eqx-loss", "eqx-vg", "eqx-adamw"]
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    print(f"# load={os.getloadavg()[0]:.1f} limit={limit}s; objective = bytes+192/collective / collectives", flush=True)
    if "--check" in argv:
        form = argv[argv.index("--check") + 1]
        k = None if form == "full" else int(form)
        for name, fn, args, out_layouts in programs(mesh, names):
            print(f"{name} search: {checked(fn, args, out_layouts)}", flush=True)
            print(f"{name} exact {form}: {checked(fn, args, out_layouts, exact_select(limit, k))}", flush=True)
        return
    for name, fn, args, out_layouts in programs(mesh, names):
        for n, (a, found) in enumerate(capture(fn, args, out_layouts)):
            keyed, cost_model, targets = a[:3]
            graph = keyed.graph
            clear_caches()
            t = time.process_time()
            program._select(*a)
            heuristic_s = time.process_time() - t
            clear_caches()
            t = time.process_time()
            search = program._Search(graph, cost_model, targets)
            search_s = time.process_time() - t
            chosen = indices(graph, found)
            best = search.total(chosen)
            candidates = sum(len(node.candidates) for node in graph.nodes)
            print(f"{name} call {n}: nodes={len(graph.nodes)} candidates={candidates} heuristic={heuristic_s:.2f}s "
                  f"objective={fmt(best)} (_Search built in {search_s:.2f}s)", flush=True)
            forms = [("full", None)] if "--full" in argv else []
            if "--lp" in argv:
                r = solve_exact(search, None, time_limit=limit, relaxed=True)
                print(f"  full LP relaxation: bin={r.binaries} cont={r.continuous} rows={r.constraints} "
                      f"nnz={r.nonzeros} build={r.build_s:.2f}s solve={r.solve_s:.2f}s status={r.status} "
                      f"root bound={r.objective}", flush=True)
            walked = search.starts({path: 0 for path in search.paths})[-1]  # the descents' walked start
            for k in ks:
                top = {node.path: set(range(min(k, len(node.candidates)))) for node in graph.nodes}
                forms.append((f"K={k}", top))
                if "--walked" in argv:
                    forms.append((f"K={k}+walked", {p: s | {walked[p]} for p, s in top.items()}))
                forms.append((f"K={k}+heur", {p: s | {chosen[p]} for p, s in top.items()}))
            if "--followers" in argv:  # the same forms with follower merging instead
                forms = [(f"{form}+followers", allowed) for form, allowed in forms]
            for form, allowed in forms:
                r = solve_exact(search, allowed, time_limit=limit, followers=form.endswith("+followers"))
                verdict = "-" if r.total is None else (
                    "cheaper" if r.total < best else "equal" if r.total == best else "dearer")
                print(f"  {form}: bin={r.binaries} cont={r.continuous} rows={r.constraints} nnz={r.nonzeros} "
                      f"build={r.build_s:.2f}s solve={r.solve_s:.2f}s status={r.status} milp={fmt(r.total)} "
                      f"obj={r.objective} bound={r.bound} vs heuristic: {verdict}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
