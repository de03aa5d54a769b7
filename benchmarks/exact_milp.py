"""Exact whole-program selection as a mixed-integer linear program (a measured spike).

The program search (:mod:`placements2jax.inference.program`) minimizes its objective by steepest descent; Alpa
solves the same kind of choice as an integer linear program. This module states the
search's objective exactly (:class:`placements2jax.inference.program._Search`'s :meth:`~placements2jax.inference.program._Search.total`,
priced by the search's own :meth:`~placements2jax.inference.program._Search.cost` and
:meth:`~placements2jax.inference.program._Search.charge`: nothing re-priced here) as a MILP and solves it with
:func:`scipy.optimize.milp` (HiGHS):

- ``x[n, k]`` binary: node ``n`` runs candidate ``k`` (one per node);
- per value (an equation's output, or a function input) with consumers, ``y[v, d]`` in
  [0, 1]: some consumer's chosen candidate needs ``v`` in layout ``d``
  (``y[v, d] >= sum(x[c, k] for k needing d)`` per consumer ``c``: consumers needing the
  same layout share it, as :meth:`~placements2jax.inference.program._Search.value_cost` counts it);
- ``z[v, s, d]`` in [0, 1] for a producer layout ``s`` and need ``d`` whose move costs
  something: the move is made. As a flow (tighter than the product ``z >= u + y - 1``):
  ``z[v, s, d] <= u[v, s]`` (``u``: the sum of the producer's ``x`` giving ``s``) and
  ``sum(z[v, s, d] for s costing) + sum(u[v, s] for s free) >= y[v, d]``;
- a literal's or constant's move and an output's charge are linear in its one node's ``x``.

Every variable but ``x`` is continuous: with ``x`` integral the least ``y`` and ``z`` are
0/1. Costs are :data:`placements2jax.inference.program.Cost` pairs (bytes plus the overhead per collective, and
collectives); the program minimizes the first plus a tie-break weight times the second
(:data:`TIE`: fewer collectives among equally cheap choices, as the search compares).
Function inputs keep their layouts (constants), loop carries and stacked outputs are nodes
like any other: their costs are the same value costs, so nothing is fixed for them.

``allowed`` restricts each node to some of its candidates (pruning: the K best-ranked and
those another search chose), making the program smaller; a node left one candidate is a
constant. This is not wired into :func:`.jaxpr.predict`: benchmarks/exact_search.py
measures it against the search (docs/inference.md section 8 records the figures and why it
stays a prototype).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from placements2jax.inference.program import Choice, _Search

__all__ = ["ExactResult", "solve_exact"]

TIE = 1e-3  # objective weight of one collective beyond its bytes and overhead: a tie-break only


@dataclass(frozen=True)
class ExactResult:
    """A solved program: the choice (path -> candidate index), its objective as the
    search totals it, the solver's status, bound and sizes, and where the time went."""

    choice: Choice | None
    total: tuple[float, float] | None
    status: int
    message: str
    objective: float | None  # the MILP's (bytes + overhead + TIE * collectives)
    bound: float | None  # the MILP's dual bound: no choice of the allowed candidates is cheaper
    binaries: int
    continuous: int
    constraints: int
    nonzeros: int
    build_s: float
    solve_s: float


class _Rows:
    """A sparse constraint matrix built row by row (lower <= row . vars <= upper)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, terms: Mapping[int, float], lower: float, upper: float) -> None:
        row = len(self.lower)
        for col, val in terms.items():
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lower)
        self.upper.append(upper)


def solve_exact(
    search: _Search, allowed: Mapping[str, Collection[int]] | None = None, time_limit: float = 60.0,
    gap: float = 0.0, relaxed: bool = False, followers: bool = False,
) -> ExactResult:
    """The choice minimizing ``search.total`` over every node's candidates (or the
    ``allowed`` ones, per path; every node must keep one), by the MILP of the module
    docstring, solved within ``time_limit`` seconds (HiGHS's: wall clock) to a relative ``gap``. ``relaxed``:
    its linear relaxation only (every ``x`` in [0, 1]: ``objective`` is the root bound,
    no choice). ``followers`` (a reduction, no longer exact): an equation with one input
    not fixed, whose value it alone reads, produced earlier in program order, takes it as
    its producer makes it, by the allowed candidate cheapest for it (Alpa's follower merging: an
    elementwise chain follows its producer; the edge costs nothing; where some layout its
    producer may give cannot be taken as it is, the equation chooses freely)."""
    started = time.process_time()
    obj: list[float] = []
    integral: list[int] = []
    cols: dict[str, dict[int, int]] = {}  # per node, per allowed candidate: its x column
    rows = _Rows()

    def var(cost: float, binary: bool) -> int:
        obj.append(cost)
        integral.append(1 if binary else 0)
        return len(obj) - 1

    def weight(cost: tuple[float, float]) -> float:
        return cost[0] + TIE * cost[1]

    # followers: per value (path, j) read by one equation with no other input to choose, per layout its allowed
    # producer candidates give it in, the follower's candidate for it (cheapest for that input, as eager dispatch)
    follows: dict[tuple[str, int], dict[object, int]] = {}
    for path in search.paths:
        ks = sorted(allowed[path]) if allowed is not None else range(len(search.ins[path]))
        if followers and len(search.producers[path]) == 1:
            (i, source), = ((i, src) for i, (src, fixed) in enumerate(zip(search.sources[path], search.fixed[path]))
                            if fixed is None)
            made = {search.outs[source[0]][k][source[1]] for k in cols.get(source[0], ())}
            taking = {state: [k for k in by if k in ks] for state, by in search.candidates[path].by_in[i].items()}
            if made and len(search.consumers[source]) == 1 and all(taking.get(state) for state in made):
                fixed = list(search.fixed[path])
                follow = follows[source] = {}
                for state in made:
                    fixed[i] = state
                    follow[state] = search.cheapest(path, taking[state], fixed)
                ks = sorted(set(follow.values()))
        cols[path] = {k: var(0.0, True) for k in ks}
        rows.add(dict.fromkeys(cols[path].values(), 1.0), 1.0, 1.0)

    for value in search.priced:
        if value[0] == "owed":  # an output of the function: its charge, by its producer's layout
            _, path, j = value
            aval = search.out_avals[path][j]
            for k, col in cols[path].items():
                obj[col] += weight(search.charge((path, j), aval, search.outs[path][k][j]))
            continue
        if value[0] == "literal":  # fixed layout, moved into its consumer's need
            _, path, i = value
            aval, fixed = search.in_avals[path][i], search.fixed[path][i]
            for k, col in cols[path].items():
                obj[col] += weight(search.cost(aval, fixed, search.ins[path][k][i]))
            continue
        consumers = search.consumers[value]
        first, i0 = consumers[0]
        if value in follows:  # its one consumer follows it: the edge costs nothing
            path, j = value
            per: dict[int, dict[int, float]] = {}  # per follower column: it minus the producer's giving its input
            for k, col in cols[path].items():
                follower = cols[first][follows[value][search.outs[path][k][j]]]
                per.setdefault(follower, {follower: 1.0})[col] = -1.0
            for terms in per.values():
                rows.add(terms, 0.0, 0.0)
            continue
        aval = search.in_avals[first][i0]
        # the producer's layouts: u[s] as the columns of x giving s (a function input: one, fixed)
        if value[0] == "in":
            sources: dict[object, list[int]] = {search.fixed[first][i0]: []}
        else:
            path, j = value
            sources = {}
            for k, col in cols[path].items():
                sources.setdefault(search.outs[path][k][j], []).append(col)
        # per need, per consumer, the columns of x needing it
        needs: dict[object, list[list[int]]] = {}
        for c, i in consumers:
            by: dict[object, list[int]] = {}
            for k, col in cols[c].items():
                by.setdefault(search.ins[c][k][i], []).append(col)
            for need, ks in by.items():
                needs.setdefault(need, []).append(ks)
        for need, per_consumer in needs.items():
            costs = {s: weight(search.cost(aval, s, need)) for s in sources}
            if not any(costs.values()):
                continue  # free from every producer layout
            if value[0] == "in":  # fixed source: y costs the move itself
                y = var(costs[next(iter(sources))], False)
                paying = {}
            else:
                y = var(0.0, False)
                paying = {s: var(cost, False) for s, cost in costs.items() if cost}
            for ks in per_consumer:  # y >= this consumer's need
                rows.add({y: 1.0, **dict.fromkeys(ks, -1.0)}, 0.0, np.inf)
            if not paying:
                continue
            # sum of paying z + free u >= y;  z[s] <= u[s]
            terms = {z: 1.0 for z in paying.values()}
            for s, cost in costs.items():
                if not cost:
                    terms.update(dict.fromkeys(sources[s], 1.0))
            terms[y] = -1.0
            rows.add(terms, 0.0, np.inf)
            for s, z in paying.items():
                rows.add({z: 1.0, **dict.fromkeys(sources[s], -1.0)}, -np.inf, 0.0)
    n = len(obj)
    matrix = csr_array((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lower), n))
    constraints = LinearConstraint(matrix, np.array(rows.lower), np.array(rows.upper))
    built = time.process_time()
    result = milp(
        np.array(obj), integrality=np.zeros(n) if relaxed else np.array(integral), bounds=Bounds(0.0, 1.0),
        constraints=constraints, options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False},
    )
    solved = time.process_time()
    choice, total = None, None
    if result.x is not None and not relaxed:
        choice = {path: max(ks, key=lambda k: result.x[ks[k]]) for path, ks in cols.items()}
        total = search.total(choice)
    return ExactResult(
        choice, total, result.status, result.message, None if result.x is None else float(result.fun),
        getattr(result, "mip_dual_bound", None), sum(integral), n - sum(integral), len(rows.lower),
        len(rows.vals), built - started, solved - built,
    )
