"""The redistribution planner: the cheapest way from one layout to another (pure).

Like torch, a plan changes one mesh dim at a time, each step one collective on that
mesh dim (notes section 1):

======================  ===============  =========================================
step on mesh dim m      collective       condition
======================  ===============  =========================================
``S(d) -> R``           all-gather       m is the minor-most mesh dim splitting d
``S(d) -> S(e)``        all-to-all       m minor-most on d; m becomes minor-most on e
``R -> S(d)``           local slice      m becomes minor-most on d
``P -> R``              all-reduce
``P -> S(d)``           reduce-scatter   m becomes minor-most on d
``R -> P``              local partial    only as the last steps (see below)
======================  ===============  =========================================

(Gathering a mesh dim that is not the minor-most split of its tensor dim would leave a
strided layout; ``S -> P`` and ``P(a) -> P(b)`` go through ``R``, as in torch.) There is
no all-reduce over several mesh dims at once: XLA reduces a value partial on two mesh
axes with one all-reduce per axis, even back to back (tests/test_inference_check.py),
so such a step would predict a collective XLA never compiles.

A layout with split factors from a view (torch's ``_StridedShard``, a *strided* dim) goes
by :func:`.programs.strided_route`, the steps the executed program takes: *unstride*, an
all-to-all over the dim's mesh dim into the plain ``S(d)`` (or an all-gather, priced as a
plain one's bytes, when that mesh dim ends up splitting nothing), then the search above
between the plain layouts, then the inverse all-to-all (or a free local slice) into a
strided target. Such layouts' states carry their split factors as a third entry.

Torch walks the mesh dims in a fixed order and goes through Replicate for many
Shard -> Shard moves. Here every sequence of such steps is searched (Dijkstra over
layouts) for the lowest cost under the cost model, so e.g. ``(S(0),S(0)) -> (R,S(0))``
on a 2x2 mesh moves the inner split away with an all-to-all instead of gathering twice
(0.625 T instead of 0.75 T). Order of the steps: lowest total cost; among equal costs,
fewest steps; then the lexicographically smallest sequence of ``(mesh dim, kind,
target dim)`` with kinds ordered local slice < all-to-all < all-gather <
reduce-scatter < all-reduce, a reduction's mesh dims counted from the last: a value
partial over several mesh dims is reduced last mesh dim first, as XLA reduces it in its
own programs (a loss partial over ``dp`` and ``tp``: ``tp`` first, where its reduction
joins the layer's other ``tp`` all-reduces, then ``dp`` with the gradients'; dp first,
the ``tp`` one depended on the gradients' ``dp`` group and could join no other: one
collective more after XLA's combiner on 6 of docs/benchmarks.md section 14's programs).
:func:`cached_plan`'s ``order`` :data:`FIRST_FIRST` counts them from the first instead
(the same bytes when the reductions are all-reduces of one block): a free output's
reduction is planned so where that leaves fewer collectives after the combiner
(:attr:`.jaxpr.Prediction.output_reductions`; Gemma-2's loss, whose ``tp`` all-reduce
then joins the optimizer's final group of scalars). ``R -> P`` steps come last, in mesh dim order: creating a
partial is free and never makes a later step cheaper; a partial that the source and
the destination share (same op, same mesh dim) is kept untouched, but on a size-1 mesh
dim of a move: there it is given up first and made again last (both free), so that all
moves of a value take their collectives on the same array (:func:`cached_plan`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, NamedTuple

import numpy as np

from ..caches import cached
from ..errors import RedistributeError
from ..layout import Layout, MeshPlacements
from ..placements import Partial, ReduceOp, Replicate
from ..programs import strided_route_tables
from .cost import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COMMUNICATING,
    LOCAL_PARTIAL,
    LOCAL_SLICE,
    REDUCE_SCATTER,
    CostModelLike,
    Overhead,
    block_bytes,
    blocks_misaligned,
    collective_bytes,
    collective_factor,
    exchange_block_bytes,
    gather_block_bytes,
    gather_halo_bytes,
    gather_halo_permutes,
    overhead_of,
    resolve_cost_model,
)
from .signature import RedistributePlan, RedistributeStep, TensorSpec, placement_on

__all__ = ["InputPlans", "layout_state", "plan_collectives", "plan_cost", "plan_redistribute"]

DimAxes = tuple[tuple[int, ...], ...]
# the order, among routes of equal cost and steps, in which a plan reduces a value partial over several mesh dims
# (:func:`cached_plan`'s ``order``): the last mesh dim first (the default, XLA's own), or the first
ReductionOrder = Literal["last first", "first first"]
LAST_FIRST: ReductionOrder = "last first"
FIRST_FIRST: ReductionOrder = "first first"
# (dim_axes, partial), and split factors as a third entry for a strided layout only
State = tuple[Any, ...]

_KIND_ORDER = {LOCAL_SLICE: 0, ALL_TO_ALL: 1, ALL_GATHER: 2, REDUCE_SCATTER: 3, ALL_REDUCE: 4}
_LOCAL_SLICE_KEY, _ALL_TO_ALL_KEY, _ALL_GATHER_KEY, _REDUCE_SCATTER_KEY, _ALL_REDUCE_KEY = (
    _KIND_ORDER[kind] for kind in (LOCAL_SLICE, ALL_TO_ALL, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
)


# a step the search takes: (mesh dim, collective, target dim, scaled bytes), a _Move on a plan's path
Step = tuple[int, str, int, int]
# a step from a layout as the search's loop unpacks it: (state after, scaled bytes, mesh dim, key digit, step)
Moved = tuple[State, int, int, int, Step]


class _Move(NamedTuple):
    mesh_dim: int
    collective: str
    target_dim: int  # the tensor dim the mesh dim splits afterwards, -1 for R
    state: State
    scaled: int  # bytes each device sends, times the search's ``unit`` (an exact integer)


def plan_redistribute(
    shape: Sequence[int],
    dtype: Any,
    src: Layout,
    dst: Layout,
    cost_model: CostModelLike = None,
) -> RedistributePlan:
    """The cheapest plan taking a tensor of ``shape``/``dtype`` from layout ``src`` to
    ``dst`` (both on one mesh), one mesh dim per step (see the module docstring)."""
    spec = TensorSpec(tuple(shape), dtype, src)
    if isinstance(dst, MeshPlacements):
        dst = dst.bind(len(spec.shape))
    if not isinstance(dst, Layout):
        raise RedistributeError("dst", dst, "expected a Layout", "pass Layout.from_device_mesh(mesh)(...)")
    if dst.mesh != spec.mesh:
        raise RedistributeError(
            "dst", dst, f"is on {dst.mesh!r}, the source on {spec.mesh!r}",
            "cross-mesh redistribution is not supported: use one mesh",
        )
    dst = TensorSpec(spec.shape, spec.dtype, dst).layout
    return cached_plan(spec.shape, spec.dtype, spec.layout, dst, resolve_cost_model(cost_model))


@cached(maxsize=1024)
def mesh_all_reduce(shape: tuple[int, ...], dtype: np.dtype, src: Layout, cost_model: Any) -> RedistributePlan:
    """``src`` (Partial(sum) over every mesh dim) to Replicate as XLA compiles a host
    callback's result (:data:`.jaxpr.HOST_CALLBACKS`): one all-reduce over the whole mesh
    (replica groups of every device), not the planner's per-mesh-dim route. Its cost is
    its bytes at the heaviest mesh dim's weight (the ring crosses every link)."""
    mesh = src.mesh
    dst = src.replicated()
    nbytes = collective_bytes(ALL_REDUCE, block_bytes(shape, dtype.itemsize, src.dim_axes, mesh.shape), mesh.size())
    over = tuple(range(mesh.ndim))
    step = RedistributeStep(
        0, ",".join(mesh.axis_names), Partial("sum"), Replicate(), ALL_REDUCE, nbytes,
        nbytes * max(cost_model.weights(mesh)), src, dst, ALL_REDUCE, (), over,
    )
    return RedistributePlan(shape, dtype, src, dst, (step,))


def layout_state(layout: Layout) -> State:
    """The planner's state of a layout: ``(dim_axes, partial)``, plus its split factors
    when it is strided."""
    if layout.is_strided:
        return (layout.dim_axes, layout.partial, layout.split_factors)
    return (layout.dim_axes, layout.partial)


@cached(maxsize=8192)
def cached_plan(
    shape: tuple[int, ...], dtype: np.dtype, src: Layout, dst: Layout, cost_model: Any, overhead: Overhead = 0,
    order: ReductionOrder = LAST_FIRST,
) -> RedistributePlan:
    """:func:`plan_redistribute`'s plan; ``overhead``: bytes each communicating step also
    costs when choosing the route, one figure or one per kind (see :class:`_Dijkstra`),
    none by default; ``order``: which of several partial mesh dims a route of equal cost
    reduces first (see the module docstring)."""
    if src == dst:  # nothing to move (a partial on a size-1 mesh dim is not given up and made again below)
        return RedistributePlan(shape, dtype, src, dst, ())
    mesh = src.mesh
    weights = cost_model.weights(mesh)
    steps: list[RedistributeStep] = []
    before: tuple[Any, ...] = ()
    after: tuple[Any, ...] = ()
    if src.is_strided or dst.is_strided:
        before, first, last, after = _strided_parts(shape, dtype.itemsize, layout_state(src), layout_state(dst), mesh.shape)
        state: State = layout_state(src)
        for m, kind, nbytes, new_state in before:
            steps.append(_step(shape, dtype, src, state, new_state, m, kind, nbytes, weights))
            state = new_state
        src_state: State = (first[0], src.partial)
        target_axes = last[0]
        kept_split = first[1] if any(f > 1 for f in first[1]) else None
    else:
        src_state = (src.dim_axes, src.partial)
        target_axes = dst.dim_axes
        kept_split = None
    # A partial the source and the destination share is kept, but on a size-1 mesh dim: there it is
    # given up before the searched steps and made again after them (both free: one device's partial is
    # its own sum), so that a value's moves keeping it and those dropping it take the same collectives
    # on the same arrays; kept, a program gathers its stacked form and its reduced one apart (a
    # (2,1,4) mesh's pinned MLP step all-gathered h over dp twice, 4,102 B against (2,4)'s 3,590).
    kept = tuple(op if op and src.partial[m] == op and mesh.shape[m] > 1 else None for m, op in enumerate(dst.partial))
    target: State = (target_axes, kept)
    search = _search(shape, dtype.itemsize, mesh.shape, weights, src_state, overhead, order)
    moves = search.path_to(target)
    state = src_state
    for move in moves:
        nbytes = Fraction(move.scaled, search.unit)
        steps.append(_step(
            shape, dtype, src, _with_split(state, kept_split), _with_split(move.state, kept_split), move.mesh_dim,
            move.collective, nbytes, weights,
        ))
        state = move.state
    for m, op in enumerate(dst.partial):
        if op and not kept[m]:
            partial = tuple(op if i == m else p for i, p in enumerate(state[1]))
            new_state: State = (state[0], partial)
            steps.append(_step(
                shape, dtype, src, _with_split(state, kept_split), _with_split(new_state, kept_split), m, LOCAL_PARTIAL,
                Fraction(0), weights,
            ))
            state = new_state
    state = _with_split(state, kept_split)
    for m, kind, nbytes, new_state in after:
        new_state = (new_state[0], state[1], *new_state[2:])
        steps.append(_step(shape, dtype, src, state, new_state, m, kind, nbytes, weights))
        state = new_state
    return RedistributePlan(shape, dtype, src, dst, tuple(steps))


def _with_split(state: State, split: tuple[int, ...] | None) -> State:
    """A plain search state with the split factors the route keeps (while valid)."""
    if split is None or any(f > 1 and len(state[0][d]) != 1 for d, f in enumerate(split)):
        return state
    return (state[0], state[1], split)


def _strided_parts(
    shape: tuple[int, ...], itemsize: int, src: State, dst: State, mesh_shape: tuple[int, ...]
) -> tuple[list[tuple[int, str, Fraction, State]], Any, Any, list[tuple[int, str, Fraction, State]]]:
    """:func:`.programs.strided_route_tables` of two states, priced: the ``before`` and
    ``after`` steps as ``(mesh dim, collective, bytes each device sends, state after)``,
    and the ``(dim_axes, split_factors)`` of the first and last plain-search layouts."""
    ones = (1,) * len(shape)
    src_split = src[2] if len(src) > 2 else ones
    dst_split = dst[2] if len(dst) > 2 else ones
    before, first, last, after = strided_route_tables(mesh_shape, (src[0], src_split), (dst[0], dst_split))
    priced_before = []
    axes, split = list(src[0]), list(src_split)
    for d, m, kind in before:
        if kind == ALL_TO_ALL:
            nbytes = collective_bytes(kind, block_bytes(shape, itemsize, axes, mesh_shape, without=m), mesh_shape[m])
        else:  # a plain all-gather's bytes, as XLA compiles it
            compiled, block = gather_block_bytes(shape, itemsize, axes, mesh_shape, m, d)
            nbytes = collective_bytes(compiled, block, mesh_shape[m])
            axes[d] = ()
        split[d] = 1
        state = (tuple(axes), src[1], tuple(split)) if any(f > 1 for f in split) else (tuple(axes), src[1])
        priced_before.append((m, kind, nbytes, state))
    priced_after = []
    axes, split = list(last[0]), list(last[1])
    for d, m, kind in after:
        block = block_bytes(shape, itemsize, axes, mesh_shape, without=m)
        nbytes = collective_bytes(kind, block, mesh_shape[m]) if kind == ALL_TO_ALL else Fraction(0)
        split[d] = dst_split[d]
        axes[d] = dst[0][d]
        priced_after.append((m, kind, nbytes, (tuple(axes), dst[1], tuple(split))))
    return priced_before, first, last, priced_after


@cached(maxsize=65536)
def plan_cost(
    shape: tuple[int, ...], dtype: np.dtype, src: State, dst: State, mesh_shape: tuple[int, ...],
    weights: tuple[Fraction, ...], overhead: Overhead = 0,
) -> tuple[Fraction, int]:
    """The cost of the plan from layout state ``src`` to ``dst`` (``(dim_axes, partial)``
    on a mesh of ``mesh_shape`` with per-dim ``weights``) and how many of its steps
    communicate: what :func:`plan_redistribute` gives, without building the plan (for
    searches that compare many layouts; cached). ``overhead``: as :func:`cached_plan`'s
    (the route chosen with it; the cost returned is its bytes times the weights alone)."""
    priced, scale = plan_priced(shape, dtype, src, dst, mesh_shape, weights, overhead)
    return Fraction(sum(cost for _, cost in priced), scale), len(priced)


@cached(maxsize=65536)
def plan_collectives(
    shape: tuple[int, ...], dtype: np.dtype, src: State, dst: State, mesh_shape: tuple[int, ...],
    weights: tuple[Fraction, ...], overhead: Overhead = 0,
) -> tuple[tuple[str, Fraction], ...]:
    """The communicating steps of the plan :func:`plan_cost` prices, in order, each as
    ``(collective, cost)`` (bytes times its mesh dim's weight; they add up to
    :func:`plan_cost`'s cost): for callers that count or price collectives by kind, e.g.
    as a backend compiles them (CPU XLA: a reduce-scatter is an all-reduce)."""
    priced, scale = plan_priced(shape, dtype, src, dst, mesh_shape, weights, overhead)
    return tuple((kind, Fraction(cost, scale)) for kind, cost in priced)


@cached(maxsize=65536)
def plan_priced(
    shape: tuple[int, ...], dtype: np.dtype, src: State, dst: State, mesh_shape: tuple[int, ...],
    weights: tuple[Fraction, ...], overhead: Overhead = 0,
) -> tuple[tuple[tuple[str, int], ...], int]:
    """:func:`plan_collectives` as exact integers over one denominator: the communicating
    steps as ``(collective, cost times scale)`` and ``scale``. What the program search
    prices its moves from (:meth:`.program._Search.cost`): a step's float is ``cost /
    scale``, the same float as its Fraction's (int true division rounds correctly), without
    building Fractions; :func:`plan_cost` and :func:`plan_collectives` are built on it, so a
    route is walked once for both (the search prices each move as compiled and by the
    planner alone)."""
    if len(src) > 2 or len(dst) > 2:  # strided: the route's own steps around the plain search
        before, first, last, after = _strided_parts(shape, dtype.itemsize, src, dst, mesh_shape)
        middle, inner = plan_priced(shape, dtype, (first[0], src[1]), (last[0], dst[1]), mesh_shape, weights, overhead)
        head = [(kind, nbytes * Fraction(weights[m])) for m, kind, nbytes, _ in before if nbytes]
        tail = [(kind, nbytes * Fraction(weights[m])) for m, kind, nbytes, _ in after if nbytes]
        scale = math.lcm(inner, *(cost.denominator for _, cost in head + tail))
        return (
            tuple((kind, int(cost * scale)) for kind, cost in head)
            + tuple((kind, cost * (scale // inner)) for kind, cost in middle)
            + tuple((kind, int(cost * scale)) for kind, cost in tail)
        ), scale
    partial = dst[1]  # kept where the source has it too (a target without partials: as it is)
    kept = tuple(op if op and src[1][m] == op else None for m, op in enumerate(partial)) if any(partial) else partial
    search = _search(shape, dtype.itemsize, mesh_shape, weights, src, overhead)
    return search.priced((dst[0], kept)), search.unit * search.weight_unit


@cached(maxsize=65536)
def cached_plan_cost(shape: tuple[int, ...], dtype: np.dtype, src: Layout, dst: Layout, cost_model: Any) -> Fraction:
    """``cached_plan(...).cost`` without building the plan's steps (the same Fraction)."""
    if src is dst:
        return Fraction(0)
    weights = _weights(cost_model, src.mesh)
    return plan_cost(shape, dtype, layout_state(src), layout_state(dst), src.mesh.shape, weights)[0]


def cost_scale(mesh_shape: tuple[int, ...], weights: tuple[Fraction, ...]) -> int:
    """What the planner's search multiplies costs by to make them exact integers."""
    return math.lcm(*(n * n for n in mesh_shape)) * math.lcm(*(Fraction(w).denominator for w in weights))


def plan_search(
    shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...], weights: tuple[Fraction, ...], src: State
) -> _Dijkstra:
    """The planner's (cached, lazily settled) search from plain state ``src``: its
    ``cost_within(dst, limit)`` is the cost of the plan to ``dst`` (as :func:`plan_cost`'s)
    in integers, times :func:`cost_scale`, if at most ``limit`` (else None, settling no
    layout that costs more): for callers asking many targets of one source."""
    return _search(shape, itemsize, mesh_shape, weights, src)


@cached(maxsize=256)
def _weights(cost_model: Any, mesh: Any) -> tuple[Fraction, ...]:
    return cost_model.weights(mesh)


@dataclass(frozen=True)
class InputPlans:
    """The plans taking an op's given ``inputs`` to a candidate's input layouts, built on
    demand: ranking candidates needs only their costs (:meth:`cost`) and which inputs move
    (:meth:`redistributed`); the steps of a plan are built when someone reads them
    (:attr:`.signature.Candidate.plans`). Same results as :func:`cached_plan` per input."""

    inputs: tuple[TensorSpec, ...]
    cost_model: Any

    def plans(self, layouts: Sequence[Layout]) -> tuple[RedistributePlan, ...]:
        return tuple(cached_plan(s.shape, s.dtype, s.layout, x, self.cost_model) for s, x in zip(self.inputs, layouts))

    def cost(self, layouts: Sequence[Layout]) -> Fraction:
        return sum(
            (cached_plan_cost(s.shape, s.dtype, s.layout, x, self.cost_model) for s, x in zip(self.inputs, layouts)),
            Fraction(0),
        )

    def redistributed(self, layouts: Sequence[Layout]) -> tuple[bool, ...]:
        """Per input: does its plan have any step? (Layouts are interned: a plan is empty
        exactly when the layouts are the same object.)"""
        return tuple(s.layout is not x for s, x in zip(self.inputs, layouts))


def _step(
    shape: tuple[int, ...],
    dtype: np.dtype,
    src: Layout,
    before: State,
    after: State,
    mesh_dim: int,
    collective: str,
    nbytes: Fraction,
    weights: tuple[Fraction, ...],
) -> RedistributeStep:
    mesh = src.mesh
    before_layout = Layout(mesh, *before)
    after_layout = Layout(mesh, *after)
    compiled, halo = collective, ()
    if collective == ALL_GATHER:  # a short dim's gather compiles to an all-reduce; off a misaligned split, after a halo
        gathered = next(d for d, axes in enumerate(before[0]) if mesh_dim in axes)
        compiled, _ = gather_block_bytes(shape, dtype.itemsize, before[0], mesh.shape, mesh_dim, gathered)
        halo = tuple(
            (tuple(mesh.axis_names[a] for a in axes), nbytes)
            for axes, nbytes in gather_halo_permutes(shape, dtype.itemsize, before[0], mesh.shape, mesh_dim, gathered)
        )
    return RedistributeStep(
        mesh_dim,
        mesh.axis_names[mesh_dim],
        before_layout.placements[mesh_dim] if before_layout.is_strided else placement_on(before_layout, mesh_dim),
        after_layout.placements[mesh_dim] if after_layout.is_strided else placement_on(after_layout, mesh_dim),
        collective,
        nbytes,
        nbytes * weights[mesh_dim],
        before_layout,
        after_layout,
        compiled,
        halo,
    )


@cached(maxsize=1024)
def _search(
    shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...], weights: tuple[Fraction, ...], src: State,
    overhead: Overhead = 0, order: ReductionOrder = LAST_FIRST,
) -> _Dijkstra:
    return _Dijkstra(shape, itemsize, mesh_shape, weights, src, overhead, order)


class _Dijkstra:
    """Single-source shortest paths over layouts, settled lazily up to each target.

    ``overhead``: bytes every communicating step also costs in the path keys (a latency: a
    route with fewer collectives unless the other saves more bytes than that per extra
    collective; the program search's, :mod:`.program`), one figure or one per step's kind
    (:attr:`.cost.CostModel.collective_overhead`), none by default. :meth:`cost_within`
    needs it 0 (its bound is on the keys).

    Path keys are ``(cost, steps, sequence of move keys)``: extending two paths by the same
    move keeps their order, so Dijkstra finds the least key, which is the documented order.
    The sequence is one integer, the move keys' digits in base :attr:`_Steps.radix` (see
    :meth:`_Steps.of`): keys compared share their step count, so the integers of their
    equally long sequences compare as the sequences do (ints built and compared, not growing
    tuples of tuples).
    Costs are exact integers: bytes times ``unit`` (the lcm of every mesh dim's ``n^2``,
    which clears the denominators of :func:`.cost.collective_bytes`), times the weights
    scaled by ``weight_unit`` (the lcm of their denominators): the same order as the
    Fractions, without their arithmetic.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        itemsize: int,
        mesh_shape: tuple[int, ...],
        weights: tuple[Fraction, ...],
        src: State,
        overhead: Overhead = 0,
        order: ReductionOrder = LAST_FIRST,
    ) -> None:
        self._src = src
        # size-1 mesh dims are planned around the search, not in it (see _TrivialDims)
        self._trivial = _TrivialDims.of(mesh_shape)
        if self._trivial is not None:
            src = self._trivial.strip(src)
        active = tuple(m for m, n in enumerate(mesh_shape) if n > 1 or self._trivial is None)
        self._steps = _steps(shape, itemsize, mesh_shape, active, order)
        self.unit = self._steps.unit
        self.weight_unit, self.weights = _integral_weights(weights)
        scale = self.unit * self.weight_unit
        self.overheads = {kind: overhead_of(overhead, kind) * scale for kind in COMMUNICATING}  # per step's kind
        # per layout reached: its best heap entry (cost, steps, path, layout), the layout before, the move
        start = (0, 0, 0, src)
        self._best: dict[State, tuple[tuple[int, int, int, State], State | None, Step | None]] = {src: (start, None, None)}
        self._settled: set[State] = set()
        self._heap: list[tuple[int, int, int, State]] = [start]

    def cost_within(self, dst: State, limit: int) -> int | None:
        """The cost (scaled as the path keys) of the plan to plain state ``dst`` if at most
        ``limit``, else None, settling no layout that costs more."""
        partial = dst[1]
        if not any(partial):  # most targets: nothing to keep
            target = dst
        else:
            src_partial = self._src[1]
            target = (dst[0], tuple(op if op and src_partial[m] == op else None for m, op in enumerate(partial)))
        if self._trivial is not None:
            target = self._trivial.strip(target)  # steps on size-1 mesh dims cost nothing
        if target not in self._settled and not self._settle(target, limit):
            return None
        cost: int = self._best[target][0][0]
        return cost if cost <= limit else None

    def path_to(self, target: State) -> list[_Move]:
        if self._trivial is not None:
            return self._trivial.around(self._src, target, self._path_to)
        return self._path_to(target)

    def _path_to(self, target: State) -> list[_Move]:
        moves = [
            _Move(mesh_dim, collective, target_dim, state, scaled)
            for state, (mesh_dim, collective, target_dim, scaled) in self._backwards(target)
        ]
        return moves[::-1]

    def priced(self, target: State) -> tuple[tuple[str, int], ...]:
        """:func:`plan_priced`'s steps of the plan to ``target``: per communicating step, in
        order, its collective and its scaled bytes times its mesh dim's weight, without a
        :class:`_Move` per step (a cold Llama predict prices ~18,500 routes: ~3.0 us each
        where ~5.5 us through :meth:`path_to`, microbenchmarked with the routes settled)."""
        weights = self.weights
        if self._trivial is not None:
            return tuple((m.collective, m.scaled * weights[m.mesh_dim]) for m in self.path_to(target) if m.scaled)
        return tuple([
            (collective, scaled * weights[mesh_dim])
            for _, (mesh_dim, collective, _, scaled) in self._backwards(target) if scaled
        ][::-1])

    def _backwards(self, target: State) -> Iterator[tuple[State, Step]]:
        """The steps of the search's path to ``target``, last first, each with the layout it
        reaches."""
        if target not in self._settled:  # most queries: a layout settled by an earlier one
            self._settle(target)
        state = target
        while True:
            _, previous, move = self._best[state]
            if move is None:
                return
            yield state, move
            state = previous  # type: ignore[assignment]

    def _settle(self, target: State, limit: int | None = None) -> bool:
        """Settle layouts, least key first, until ``target`` is settled (True) or, with a
        ``limit``, the next one costs more (False). One loop for all of them, its tables bound
        once and each move unpacked from :meth:`_Steps.of` (a cold Llama predict settles
        ~8,800 layouts in ~480 searches). With the integer paths: every query of a cold
        predict replayed on fresh searches 0.83x the time of tuple paths and a call per
        layout (Llama and GPT-2 2 layers, medians of 15 and 11, alternated, load 4-7)."""
        heap, settled, best = self._heap, self._settled, self._best
        radix, weights, overheads, moves_of = self._steps.radix, self.weights, self.overheads, self._steps.of
        heappop, heappush = heapq.heappop, heapq.heappush
        while target not in settled:
            # An internal invariant, not bad input: every layout is reachable by one-mesh-dim steps.
            assert heap, f"redistribution planner: {target} unreachable by one-mesh-dim steps"
            if limit is not None and heap[0][0] > limit:
                return False
            cost, steps, path, state = heappop(heap)
            if state in settled:
                continue
            settled.add(state)
            steps += 1
            path *= radix
            for after, scaled, mesh_dim, digit, move in moves_of(state):
                if after in settled:
                    continue
                moved = cost + scaled * weights[mesh_dim] + overheads[move[1]] if scaled else cost
                entry = (moved, steps, path + digit, after)
                known = best.get(after)
                if known is None or entry < known[0]:
                    best[after] = (entry, state, move)
                    heappush(heap, entry)
        return True


@cached(maxsize=256)
def _integral_weights(weights: tuple[Fraction, ...]) -> tuple[int, tuple[int, ...]]:
    """The lcm of the weights' denominators and the weights times it (see :class:`_Dijkstra`),
    once per weights, not in each search (~480 searches of a cold Llama predict, ~4 Fractions each)."""
    unit = math.lcm(*(Fraction(w).denominator for w in weights))
    return unit, tuple(int(Fraction(w) * unit) for w in weights)


class _Steps:
    """The one-mesh-dim steps (:func:`_moves`) from each layout of a tensor, with their
    keys, found once per layout: every search on tensors of one shape shares them
    (searches from different sources settle the same layouts: 8238 expansions of 1123
    layouts on a Llama adamw step's cold predict). ``unit``: see :class:`_Dijkstra`;
    ``radix``: one more than the largest move key digit (:meth:`of`); ``order``: the
    reductions' tie order (:func:`cached_plan`'s)."""

    __slots__ = ("shape", "itemsize", "mesh_shape", "active", "order", "unit", "radix", "factors", "by_state")

    def __init__(
        self, shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...], active: tuple[int, ...],
        order: ReductionOrder,
    ) -> None:
        self.shape, self.itemsize, self.mesh_shape, self.active, self.order = shape, itemsize, mesh_shape, active, order
        self.unit, self.factors = _scaled_factors(mesh_shape)
        self.radix = len(mesh_shape) * len(_KIND_ORDER) * (len(shape) + 1)
        self.by_state: dict[State, tuple[Moved, ...]] = {}

    def of(self, state: State) -> tuple[Moved, ...]:
        """The moves from ``state`` (:func:`_moves`), found once."""
        found = self.by_state.get(state)
        if found is None:
            found = self.by_state[state] = _moves(state, self)
        return found


@cached(maxsize=256)
def _scaled_factors(mesh_shape: tuple[int, ...]) -> tuple[int, tuple[dict[str, int], ...]]:
    """The search's ``unit`` (see :class:`_Dijkstra`) and, per mesh dim and communicating
    kind, the bytes it sends for a one-byte block times ``unit``: exact integers (``unit``
    clears every :func:`.cost.collective_factor`'s denominator, ``n`` or ``n^2``). Once per
    mesh, not per tensor shape searched."""
    unit = math.lcm(*(n * n for n in mesh_shape))
    return unit, tuple(
        {kind: _times(collective_factor(kind, n), unit) for kind in (ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, ALL_REDUCE)}
        for n in mesh_shape
    )


def _times(factor: Fraction, unit: int) -> int:
    """``factor * unit``, ``unit`` a multiple of its denominator, in int arithmetic."""
    return unit // factor.denominator * factor.numerator


@cached(maxsize=1024)
def _steps(
    shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...], active: tuple[int, ...], order: ReductionOrder,
) -> _Steps:
    return _Steps(shape, itemsize, mesh_shape, active, order)


def _moves(state: State, steps: _Steps) -> tuple[Moved, ...]:
    """The one-mesh-dim steps from ``state`` on the mesh dims ``steps.active``, each as
    ``(state after, scaled bytes, mesh dim, key digit, step)`` (unpacked in the search's
    loop): scaled bytes are the bytes each device sends times the search's unit
    (``steps.factors[m][kind]``: a one-byte block's, see :class:`_Dijkstra`); the key
    ``(mesh dim, kind, target dim)`` is one digit, mixed radix, so digits order as the keys
    do; ``step`` is ``(mesh dim, kind, target dim, scaled bytes)``, made a :class:`_Move`
    only on a plan's path. Built as plain tuples in one pass (a cold ``infer_signature``
    on a 3-D mesh spent a third of its time here: a generator, a ``_Move`` per step and
    the split found again for each mesh dim)."""
    dim_axes, partial = state
    shape, itemsize, mesh_shape = steps.shape, steps.itemsize, steps.mesh_shape
    width = len(dim_axes) + 1  # the target dim's digits: -1 (none) and every tensor dim
    dims = range(len(dim_axes))
    split_of = {m: d for d, axes in enumerate(dim_axes) for m in axes}
    last_first = steps.order == LAST_FIRST
    whole = None  # the block of a mesh dim splitting nothing: the device's block
    moves: list[Moved] = []
    for m in steps.active:
        factor = steps.factors[m]
        split = split_of.get(m)
        key = m * len(_KIND_ORDER)
        if partial[m]:  # a partial mesh dim splits nothing: its block is the device's
            # reductions: the last mesh dim first (or the first, ``steps.order``)
            key = (len(mesh_shape) - 1 - m if last_first else m) * len(_KIND_ORDER)
            if whole is None:
                whole = block_bytes(shape, itemsize, dim_axes, mesh_shape)
            block = whole
            listed = list(partial)
            listed[m] = None
            cleared = tuple(listed)
            reduced = block * factor[ALL_REDUCE]
            moves.append(((dim_axes, cleared), reduced, m, (key + _ALL_REDUCE_KEY) * width, (m, ALL_REDUCE, -1, reduced)))
            scattered = block * factor[REDUCE_SCATTER]
            digit = (key + _REDUCE_SCATTER_KEY) * width + 1
            for d in dims:
                moves.append((
                    (_append(dim_axes, d, m), cleared), scattered, m, digit + d, (m, REDUCE_SCATTER, d, scattered)
                ))
        elif split is None:
            digit = (key + _LOCAL_SLICE_KEY) * width + 1
            for d in dims:
                moves.append(((_append(dim_axes, d, m), partial), 0, m, digit + d, (m, LOCAL_SLICE, d, 0)))
        elif dim_axes[split][-1] == m:
            gathered = _remove(dim_axes, split, m)
            # priced as XLA compiles it: a padded all-gather, or an all-reduce of a dim of at most n/2 rows
            compiled, gathered_block = gather_block_bytes(shape, itemsize, dim_axes, mesh_shape, m, split)
            collected = gathered_block * factor[compiled]
            misaligned = len(dim_axes[split]) > 1 and blocks_misaligned(
                shape[split], math.prod(mesh_shape[a] for a in dim_axes[split]), mesh_shape[m]
            )
            if misaligned:  # off a dim split by several mesh dims, XLA first realigns the blocks (a halo exchange)
                collected += gather_halo_bytes(shape, itemsize, dim_axes, mesh_shape, m, split) * steps.unit
            moves.append(((gathered, partial), collected, m, (key + _ALL_GATHER_KEY) * width, (m, ALL_GATHER, -1, collected)))
            if misaligned:
                continue  # XLA replicates the dim or adds a halo exchange for this exchange: not offered (docs section 4)
            # padded as XLA pads an uneven exchange (a size-1 dim's chunk is n rows)
            exchanged = exchange_block_bytes(shape, itemsize, dim_axes, mesh_shape, m)
            digit = (key + _ALL_TO_ALL_KEY) * width + 1
            for d in dims:
                if d != split:
                    sent = exchanged[d] * factor[ALL_TO_ALL]
                    moves.append(((_append(gathered, d, m), partial), sent, m, digit + d, (m, ALL_TO_ALL, d, sent)))
    return tuple(moves)


class _TrivialDims:
    """The size-1 mesh dims of a search's mesh, planned around the search instead of in it.

    On one device every placement holds the whole tensor, so a step on a size-1 mesh dim
    moves no data (0 bytes) and never makes another step cheaper; but searched like the
    others, each such dim multiplies the free layouts settled before any costly one (every
    split of every tensor dim, in every nest position: minutes on a (1, 1, 1, 1, 1, 2, 2, 2)
    mesh, where users run multi-host code with ``dp=1``). So the search runs on layouts
    without them, and a plan is: give up the source's placements on them that the target
    does not keep (0-byte all-gathers and all-reduces), the searched steps (the kept ones
    carried along unchanged), then the target's other splits on them (local slices, in mesh
    order). The cost is the searched steps' alone, as the full search's would be."""

    __slots__ = ("dims",)

    def __init__(self, dims: tuple[int, ...]) -> None:
        self.dims = dims

    @classmethod
    def of(cls, mesh_shape: tuple[int, ...]) -> _TrivialDims | None:
        dims = tuple(m for m, n in enumerate(mesh_shape) if n == 1)
        return cls(dims) if dims else None

    def strip(self, state: State, keep: frozenset[int] = frozenset()) -> State:
        """``state`` without its placements on the size-1 mesh dims (but those in ``keep``)."""
        gone = set(self.dims) - keep
        return (
            tuple(tuple(a for a in axes if a not in gone) for axes in state[0]),
            tuple(None if m in gone else op for m, op in enumerate(state[1])),
        )

    def around(self, src: State, target: State, search: Any) -> list[_Move]:
        """The plan from ``src`` to ``target``: the steps on size-1 mesh dims around the
        searched ones (``search``: the path between stripped states)."""
        kept = self._kept(src, target)
        if self._dress(self.strip(src), target, kept) != self.strip(src, kept):
            kept = frozenset(m for m in kept if src[1][m])  # kept splits in another order: redone
        moves = []
        state = src
        for m in self.dims:  # give up what the target does not keep
            if m in kept:
                continue
            if state[1][m]:
                state = (state[0], tuple(None if i == m else op for i, op in enumerate(state[1])))
                moves.append(_Move(m, ALL_REDUCE, -1, state, 0))
            elif any(m in axes for axes in state[0]):
                state = (tuple(tuple(a for a in axes if a != m) for axes in state[0]), state[1])
                moves.append(_Move(m, ALL_GATHER, -1, state, 0))
        for move in search(self.strip(target)):
            moves.append(move._replace(state=self._dress(move.state, target, kept)))
        added = set(kept)
        for m in self.dims:  # the target's other splits (its partials there are kept or come after)
            d = next((d for d, axes in enumerate(target[0]) if m in axes), None)
            if d is not None and m not in added:
                added.add(m)
                state = (self.strip(target, frozenset(added))[0], target[1])
                moves.append(_Move(m, LOCAL_SLICE, d, state, 0))
        return moves

    def _kept(self, src: State, target: State) -> frozenset[int]:
        """The size-1 mesh dims whose placement ``src`` and ``target`` share (the same partial,
        or the same split in the same place among the other splits of its tensor dim)."""
        kept = set()
        for m in self.dims:
            if src[1][m]:
                if target[1][m] == src[1][m]:
                    kept.add(m)
                continue
            for s_axes, t_axes in zip(src[0], target[0]):
                if m in s_axes and m in t_axes and self._position(s_axes, m) == self._position(t_axes, m):
                    kept.add(m)
        return frozenset(kept)

    def _position(self, axes: tuple[int, ...], m: int) -> int:
        """How many splits of more than one device come before size-1 mesh dim ``m`` in ``axes``."""
        return sum(1 for a in axes[: axes.index(m)] if a not in self.dims)

    def _dress(self, state: State, target: State, kept: frozenset[int]) -> State:
        """A stripped state with the kept placements put back: the kept partials, and each kept
        split in its place among the tensor dim's other splits (as in ``target``)."""
        partial = tuple(target[1][m] if m in kept else op for m, op in enumerate(state[1]))
        dim_axes = []
        for axes, t_axes in zip(state[0], target[0]):
            mine = [m for m in t_axes if m in kept]
            if mine:
                dressed: list[int] = []
                for i in range(len(axes) + 1):
                    dressed += [m for m in mine if min(self._position(t_axes, m), len(axes)) == i]
                    if i < len(axes):
                        dressed.append(axes[i])
                axes = tuple(dressed)
            dim_axes.append(axes)
        return (tuple(dim_axes), partial)


def _append(dim_axes: DimAxes, dim: int, mesh_dim: int) -> DimAxes:
    changed = list(dim_axes)  # a list edited in place: the search builds these by the ten thousand
    changed[dim] += (mesh_dim,)
    return tuple(changed)


def _remove(dim_axes: DimAxes, dim: int, mesh_dim: int) -> DimAxes:
    changed = list(dim_axes)
    changed[dim] = tuple([a for a in changed[dim] if a != mesh_dim])
    return tuple(changed)
