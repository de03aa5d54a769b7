"""XLA's collective combiner, modelled on a predicted program.

A prediction counts one collective per redistribution step; XLA then runs combiner passes
(``AllReduceCombiner``, ``AllGatherCombiner``, ``ReduceScatterCombiner``) that merge
independent collectives of one kind into a single collective of several operands (a tuple
result). :func:`combine` groups a predicted program's collectives as those passes do, so
that predicted and compiled collectives can be counted alike (:class:`~.check.CheckReport`).

The rules, read from XLA's source (``collective_combiner_utils.h``'s
``CombineInstructionsByKey``, ``all_reduce_key.h``, the CPU and GPU compilers' pipelines):

* Per computation (a loop body is its own computation; calls are inlined first, and so is
  a scan of one trip: ``WhileLoopSimplifier`` replaces a loop of trip count 1 by its body,
  measured on Llama's one-layer masked scan, whose compiled program has no while and one
  all-reduce of the body's activation gradients and the program's squared sums), one
  group at a time: the first collective left in the computation's post order
  (``MakeInstructionPostOrder``: depth first from the root, operands first to last;
  :func:`planned_collectives` walks the prediction's dataflow so) opens a group of its
  *key*, and the later ones of that key join it until one depends on a member (a data
  path from it: the group ends there), or would pass the backend's byte threshold, or
  the group has 256 operands. The group is combined into one collective, XLA rebuilds
  its reachability and post order, and the next group opens at the first collective
  left. A combined group makes new paths (what depended on one member now depends on
  what every member depended on): forming groups of all keys side by side instead
  merged groups into cycles no program has (GPT-2's 2x4 adamw step counted 12
  all-reduces where XLA compiles 13). On CPU the pass (``cpu-all-reduce-combiner``) runs
  after layout assignment and fusion (read from its pass dump).
* A cond's operand moved for its branches reading it alike runs before the cond
  (:func:`move_computations`; the pinned program's ``hoisted``, what XLA's partitioner
  compiles): its collectives are the cond's computation's, operands of the cond in its post
  order, and combine with those before it (novograd's gradient all-reduce joins the dp
  group before its conds: 9 collectives compiled, 10 counted in the first reading
  branch's computation until stop 41).
* An output's move to its ``out_layouts`` (and a move after the program) reducing a
  Partial over several mesh dims is counted last mesh dim first, as XLA compiles the
  predicted program's one constraint (:func:`_xla_order`); the planner reduces the first
  first.
* Keys: all-reduce and reduce-scatter: the reduction, the element type and the replica
  groups (here: the mesh axes); all-gather: the replica groups (element types may mix on
  GPU, ``combine_different_dtypes``; gathered dims are not compared, as
  ``xla_gpu_enable_all_gather_combine_by_dim`` defaults to false).
* CPU (``cpu_compiler.cc``): only ``CpuAllReduceCombiner``, with no byte limit
  (``int64`` max) and 256 operands; all-gathers, all-to-alls stay one per operand, and a
  reduce-scatter is compiled as an all-reduce of the whole block (CPU XLA forms none), so
  it combines with the all-reduces. CPU XLA also runs every collective of ``bfloat16``
  in ``float32`` (converted before, back after; ``float16`` stays: measured with jax
  0.10.2's CPU client), so it sends twice the bytes and keys with the ``float32`` ones
  (:meth:`CombinerRules.compiled_dtype`): its pipeline promotes bfloat16 all-reduces to
  float32 (``AllReducePromotion``) and normalizes every other bfloat16 op its
  ``FloatSupport(BF16)`` does not support, no collective among them
  (``FloatNormalization``). GPU and TPU send bfloat16 as it is: the GPU's
  ``GpuFloatSupport::IsSupported`` lists all-reduce, reduce-scatter, all-gather, all-to-all
  and collective-permute as supported in bfloat16 (read from XLA's source; no GPU here to
  measure); TPU's pipeline is not public, bfloat16 is its native type and the GPU's rules
  are used for it (no widening). The program search prices moves by the
  same rule (:func:`.program.select_program`).
* GPU (``gpu_compiler.cc``, ``debug_options_flags.cc``): all three combiners, thresholds
  ``30 MiB + 7`` bytes of results each, 256 operands. TPU's pipeline is not public: the
  GPU's rules are used for it.

The sizes are the per-device result bytes of each collective (XLA compares the combined
instruction's shape); the dependencies come from the prediction's dataflow (every
equation's inputs name the values they are: :attr:`EquationReport.sources`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from ..caches import Memo, cached
from ..errors import InferenceError
from ..layout import Layout
from .cost import ALL_GATHER, ALL_REDUCE, COLLECTIVE_PERMUTE, REDUCE_SCATTER, gather_block_bytes
from .regions import Region
from .signature import RedistributePlan, RedistributeStep, SharedRoutes

__all__ = ["BACKENDS", "LOOPS", "CombinedCollective", "CombinerRules", "MovedEquation", "PlannedCollective",
           "combine", "combiner_rules", "lowered_step", "move_computations", "planned_collectives"]

# control flow: one row each in a walk (jaxpr's _Walker._<name>), each body a computation of its own here
LOOPS = ("scan", "while", "cond")
_NO_LIMIT = 2**63 - 1
_GPU_THRESHOLD = 30 * 1024 * 1024 + 7  # kDefault{AllReduce,AllGather,ReduceScatter}CombineThreshold
_COUNT = 256


@dataclass(frozen=True)
class CombinerRules:
    """What one backend's XLA combines: the kinds it combines (with their byte
    thresholds), whether a kind's key includes the element type, the operand count
    limit, and the kinds it compiles as another (CPU: reduce-scatter as all-reduce)."""

    backend: str
    thresholds: tuple[tuple[str, int], ...]
    typed: tuple[str, ...]  # kinds whose key includes the element type
    count: int = _COUNT
    lowered: tuple[tuple[str, str], ...] = ()
    widened: tuple[tuple[str, str], ...] = ()  # element types whose collectives run in another, wider one

    def threshold(self, kind: str) -> int | None:
        """The byte threshold of ``kind`` (None: XLA does not combine it here)."""
        return dict(self.thresholds).get(kind)

    def compiled_kind(self, kind: str) -> str:
        return dict(self.lowered).get(kind, kind)

    def compiled_dtype(self, dtype: Any) -> np.dtype:
        """The element type the backend's collectives of ``dtype`` send (CPU: ``bfloat16``
        as ``float32``)."""
        dtype = np.dtype(dtype)
        wider = dict(self.widened).get(dtype.name)
        return dtype if wider is None else np.dtype(wider)

    def widening(self, dtype: Any) -> int:
        """How many times the bytes of a collective of ``dtype`` the backend sends."""
        return self.compiled_dtype(dtype).itemsize // np.dtype(dtype).itemsize


_RULES = {
    "cpu": CombinerRules(
        "cpu", ((ALL_REDUCE, _NO_LIMIT),), (ALL_REDUCE,), lowered=((REDUCE_SCATTER, ALL_REDUCE),),
        widened=(("bfloat16", "float32"),),
    ),
    "gpu": CombinerRules(
        "gpu", ((ALL_REDUCE, _GPU_THRESHOLD), (ALL_GATHER, _GPU_THRESHOLD), (REDUCE_SCATTER, _GPU_THRESHOLD)),
        (ALL_REDUCE, REDUCE_SCATTER),
    ),
}
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "tpu": "gpu"}
BACKENDS = (*_RULES, *_ALIASES)


def combiner_rules(backend: str) -> CombinerRules:
    """The combiner rules of a JAX platform name (``cpu``, ``gpu``, ``cuda``, ``rocm``,
    ``tpu``: the GPU's rules, TPU's pipeline not being public)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise InferenceError("backend", backend, "no combiner rules for this platform", f"use one of {BACKENDS}")
    return _RULES[_ALIASES.get(backend, backend)]



def lowered_step(step: RedistributeStep, rules: CombinerRules, dtype: Any) -> tuple[tuple[str, Fraction], ...]:
    """A planner step of a ``dtype`` value as ``rules``' backend compiles it: its collectives
    in order, each as (kind, bytes each device sends, in the element type the backend sends,
    :meth:`CombinerRules.compiled_dtype`); none for a local step or one over a size-1 mesh dim.
    A kind the backend compiles as another (CPU: a reduce-scatter as an all-reduce of the
    whole block, then sliced) sends what that one sends: twice the reduce-scatter's bytes
    (:mod:`.cost`: ``2T(n-1)/n`` against ``T(n-1)/n``); a gather XLA all-reduces
    (:attr:`.RedistributeStep.compiled`) is an all-reduce, priced so; a gather off a
    misaligned dim split by several mesh dims comes after its halo's collective-permutes
    (:attr:`.RedistributeStep.halo`, their bytes out of the gather's)."""
    if not step.communicates:
        return ()
    kind = rules.compiled_kind(step.compiled)
    widening = rules.widening(dtype)
    if kind == ALL_REDUCE and step.collective == REDUCE_SCATTER:
        return ((kind, 2 * widening * step.nbytes),)
    halo = tuple((COLLECTIVE_PERMUTE, Fraction(widening * nbytes)) for _, nbytes in step.halo)
    return (*halo, (kind, widening * step.nbytes - sum(nbytes for _, nbytes in halo)))

@dataclass(frozen=True)
class PlannedCollective:
    """One predicted collective as the backend compiles it: its kind, the mesh axes of
    its device groups, the reduction (all-reduce / reduce-scatter), the element type,
    the bytes of its per-device result, the computation it runs in (``""``: the program;
    a loop body's path otherwise), where it is (the consuming equation's path) and the
    collectives it depends on (a bit set of their indices), its place in XLA's post order
    and the value it moves (None: a literal or constant)."""

    kind: str
    axes: tuple[str, ...]
    reduce_op: str | None
    dtype: str
    result_bytes: int
    scope: str
    where: str
    after: int
    rank: int = 0  # its place in XLA's post order of its computation (:func:`planned_collectives`)
    source: Source | None = None


@dataclass(frozen=True)
class CombinedCollective:
    """One collective after combining: the indices of the planned collectives it merges
    (its operands)."""

    kind: str
    axes: tuple[str, ...]
    members: tuple[int, ...]
    result_bytes: int


def combine(collectives: Sequence[PlannedCollective], rules: CombinerRules) -> tuple[CombinedCollective, ...]:
    """Group ``collectives`` as XLA's combiners do (``CombineInstructionsByKey``, module
    docstring): one group at a time, each opened by the first collective left in XLA's
    post order (:attr:`PlannedCollective.rank`, program order among equal ranks) and
    joined by the later ones of its key until one depends on a member or would pass the
    byte threshold, or the group has the operand count. A combined group is one
    collective: what depended on a member now depends on what every member did, and the
    collectives its members depended on are visited where the first member was (the
    post order XLA rebuilds after each group)."""
    done: list[tuple[int, ...]] = []
    order: list[int] = []
    for i in sorted(range(len(collectives)), key=lambda i: collectives[i].rank):
        threshold = rules.threshold(collectives[i].kind)
        if threshold is None or collectives[i].result_bytes > threshold:
            done.append((i,))  # a kind this backend does not combine, or alone above the threshold
        else:
            order.append(i)
    after = [c.after for c in collectives]
    keys = [_key(c, rules) for c in collectives]
    while order:
        first = order[0]
        key, threshold = keys[first], rules.threshold(collectives[first].kind) or 0
        group: list[int] = []
        bits = size = 0
        for i in order:
            if keys[i] != key:
                continue
            if after[i] & bits or size + collectives[i].result_bytes > threshold:
                break
            group.append(i)
            bits |= 1 << i
            size += collectives[i].result_bytes
            if len(group) >= rules.count:
                break
        done.append(tuple(group))
        depends = bits
        for i in group:
            depends |= after[i]
        # the group is where its first member was (the first collective left): the collectives its members depend
        # on, left in the order after it, now come first (XLA's post order visits a combined collective's operands
        # where the first member's user needs it)
        order = [i for i in order if not bits >> i & 1]
        order = [i for i in order if depends >> i & 1] + [i for i in order if not depends >> i & 1]
        if len(group) > 1:
            for i in order:
                if after[i] & bits:
                    after[i] |= depends
    done.sort()
    return tuple(
        CombinedCollective(collectives[g[0]].kind, collectives[g[0]].axes, g,
                           sum(collectives[i].result_bytes for i in g))
        for g in done
    )


def _key(c: PlannedCollective, rules: CombinerRules) -> tuple[Any, ...]:
    """What two collectives XLA may combine share: the computation, kind, device groups,
    reduction and (for the kinds ``rules`` type) the element type."""
    return (c.scope, c.kind, c.axes, c.reduce_op, c.dtype if c.kind in rules.typed else None)


def combined_counts(combined: Iterable[CombinedCollective]) -> Counter[tuple[str, tuple[str, ...]]]:
    """Collectives per (kind, mesh axes)."""
    return Counter((c.kind, c.axes) for c in combined)


# a value: (the path of the equation making it, its output index); ("in", i): the program's input i
Source = tuple[str, int]


class MovedEquation(NamedTuple):
    """What :func:`planned_collectives` reads of one equation of a program: its path, its
    inputs' sources (None: a constant), the moves of its inputs (None or a no-op plan:
    read as they arrive) and whether they are an output's moves to its ``out_layouts``
    (``whole``: the predicted program runs each as one constraint, :func:`_xla_order`). A
    walked prediction's rows give them (:meth:`.jaxpr.Prediction.planned_collectives`), and
    so does the program search's choice before any walk (:meth:`.program._Search.combined`)."""

    path: str
    sources: tuple[Source | None, ...]
    redistributions: tuple[RedistributePlan | None, ...]
    whole: bool = False
    region: Region | None = None  # a shard_map region's: what its body sends (.regions)


def _xla_order(steps: Sequence[RedistributeStep]) -> list[RedistributeStep]:
    """``steps`` (a plan's) in the order XLA compiles them when the predicted program
    (``apply(execute="pinned")``) runs the move as one constraint, XLA choosing the route
    (an output's move to its ``out_layouts`` whose route splits no dim unevenly, else it
    pins every step: :func:`~placements2jax.operators._output_plans`; a move after the
    program, ``extra``): a run of all-reduces over several mesh dims (a Partial over
    them reduced) is reduced last mesh dim first. The predicted program holds such a
    Partial as its stacked local sums (one leading dim per mesh dim, in mesh order) and
    sums them in one ``reduce``; XLA's SPMD partitioner emits one all-reduce per reduced
    dim, the last dim first, whichever mesh dim splits it (read from its
    ``spmd-partitioning`` pass dump; measured with jax 0.10.2's CPU client on
    ``x.sum((0, 1))`` of a (2, 4, 32) array split (dp, tp) over a 2x4 mesh, of a (4, 2, 32)
    one split (tp, dp), and of three dims over 2x2x2), so the last mesh dim first. The
    bytes are the same in any order (each an all-reduce of the same block), but the order
    decides what XLA's combiner can merge: GPT-2's 2x4 ``value_and_grad`` returns two bias
    gradients ``P(dp),P(tp)`` whose tp all-reduces, first in XLA's order, join another tp
    one (11 all-reduces compiled; 12 counted first mesh dim first). The planner orders
    them so too (:mod:`.plan`), but for a plan ordered otherwise (:func:`stepped`)."""
    steps = list(steps)
    start = 0
    while start < len(steps):
        end = start
        while end < len(steps) and steps[end].collective == ALL_REDUCE and not steps[end].over:
            end += 1
        steps[start:end] = sorted(steps[start:end], key=lambda step: -step.mesh_dim)
        start = end + 1
    return steps


def stepped(plan: RedistributePlan) -> bool:
    """Whether the predicted program (``apply(execute="pinned")``,
    :func:`~placements2jax.operators.pinned_function`) takes an output's move by ``plan``
    step by step, each step's layout pinned, rather than as one constraint whose route XLA
    chooses (:func:`_xla_order`): where the route passes an uneven layout
    (:func:`~placements2jax.operators._output_plans`), or where its reductions are not
    in XLA's order (a free output's reduction planned first mesh dim first,
    :attr:`.jaxpr.Prediction.reduction_orders`)."""
    if plan.passes_uneven:
        return True
    communicating = [step for step in plan.steps if not step.over_one_device]
    return _xla_order(communicating) != communicating


def planned_collectives(
    equations: Iterable[MovedEquation], rules: CombinerRules, extra: Sequence[tuple[Source, RedistributePlan]] = (),
    *, loops: Iterable[tuple[str, str]] = (), returned: Iterable[tuple[Source, Source | None]] = (),
    shared_routes: bool = True, outputs: Sequence[Source | None] = (),
    results: Iterable[tuple[str, Sequence[tuple[str, Source | None]]]] = (), dataflow: Dataflow | None = None,
) -> tuple[PlannedCollective, ...]:
    """The collectives of ``equations``' moves, in program order, with their dependencies
    read from its dataflow, and after each ``shard_map`` row's moves the collectives its
    body sends (:attr:`MovedEquation.region`, in the region's computations: its own is the
    row's; each output of the row depends on those its value does); ``loops``: (path, primitive) of
    the loops XLA compiles as loops
    (each body a computation of the combiner's own; not a scan of one trip, which XLA
    inlines), ``returned``: (a one-trip scan's result, the value it is in the body; its
    carries' moves are rows ``<loop>.carry<j>``), ``shared_routes``: a value's moves whose
    routes begin alike share those first steps where they see each other
    (:class:`.SharedRoutes`, :func:`move_computations`; as the whole-program search plans
    them, :meth:`~.jaxpr.Prediction.routed_steps`), else each runs its own. ``extra``
    adds (source value, plan) moves at the end of the program, whose routes continue the
    program's (e.g. :func:`~.check.check`'s conversions of outputs to XLA's layouts).

    Each collective's :attr:`~PlannedCollective.rank` is its place in XLA's post order of
    its computation (``HloComputation::MakeInstructionPostOrder``: depth first from the
    root, each instruction's operands first to last), the order :func:`combine` visits:
    the program's from ``outputs`` (the values the function returns, in order; then the
    ``extra`` moves), a loop body's from ``results`` (per loop path, what its body returns:
    (the row moving it, the value it is in the body)); what no root reaches (a while's or a
    cond's bodies, given no results) in program order. A move's collectives are an
    equation's operand after the value they move (a chain, a shared route's first steps
    where its first reader is); a cond's operand moved before the cond for its branches
    (:func:`move_computations`, with ``shared_routes``: eager dispatch runs each branch's
    own) is the cond's operand, in the cond's computation. ``dataflow``: the equations'
    :class:`Dataflow` (their paths and sources, ``loops``, ``returned``, ``outputs`` and
    ``results`` its own), found here where not given."""
    equations = tuple(equations)
    if dataflow is None:
        dataflow = Dataflow(equations, dict(loops), dict(returned), outputs, results)
    # a scan of one trip, inlined by XLA: its rows are the program's, and its results depend on what their values
    # in the body did, and their moves to the carries (``<loop>.carry<j>``)
    loops, returned, region_rows = dataflow.loops, dataflow.returned, dataflow.regions
    # equation path -> collectives its outputs depend on; (path, output) of a shard_map row: that output's
    upstream: dict[Any, int] = {}
    # each route's run records the collectives the value depends on there: a later move along that route runs
    # nothing there and depends on what the first did
    routes = SharedRoutes(shared_routes)

    def before(source: Any) -> int:
        if source is None:
            return 0
        if region_rows and source in upstream:  # an output of a shard_map row
            return upstream[source]
        if returned and source in returned:
            path, j = source
            return upstream.get(path, 0) | upstream.get(f"{path}.carry{j}", 0) | before(returned[source])
        path = source[0]
        known = upstream.get(path)
        if known is not None:  # most values: made by an equation already walked
            return known
        while path not in upstream:  # a loop's sliced / stacked value: its loop's
            if "." not in path:
                return 0  # an input of the program
            path = path.rsplit(".", 1)[0]
        return upstream[path]

    # XLA's post order: per collective its operand (the value moved, the collective before it in the move); per
    # equation input (path, index) and output move ("end", k), the last collective of its move
    operands: list[tuple[Any, int | None]] = []
    tails: dict[tuple[str, int], int] = {}
    # per cond, the moves of its operands its branches read, run before it (move_computations): per value moved,
    # their last collectives, the cond's operands in XLA's post order
    hoisted: dict[str, dict[Source, list[int]]] = {}
    ahead: dict[str, int] = {}  # per cond row not walked yet, the collectives of those moves
    last_of: dict[Any, int | None] = {}  # a route's last collective so far
    made: list[tuple[Any, ...]] = []  # per collective: its fields before its rank (PlannedCollective's order)

    def moved(source: Any, plan: RedistributePlan, where: str, scope: str, slot: int, whole: bool) -> int:
        after = before(source)
        last = None
        # the route (its keys, what it shares) is the plan's; each collective is the one XLA compiles at that place
        within = computations(where, source) if where != "end" else ("",)
        cond = None
        if shared_routes and within[0] != scope:  # a cond's operand moved before it, in the cond's computation
            cond = _cond_left(scope, within[0], loops)
            scope = within[0]
        for (route, _, runs), lowered in zip(routes.steps(source, plan, within), _lowered_plan(plan, whole, rules)):
            if not runs:
                after, last = routes.left(route), last_of.get(route)
                continue
            if lowered is not None:  # not local, nor over one device: those XLA compiles to nothing
                halos, collective = lowered
                first = len(made)
                for halo in halos:  # a gather's halo exchange comes first (never combined)
                    made.append((*halo, scope, where, after))
                    operands.append((source, last))
                    last = len(made) - 1
                after |= (1 << len(made)) - (1 << first)
                made.append((*collective, scope, where, after))
                operands.append((source, last))
                last = len(made) - 1
                after |= 1 << last
            routes.record(route, after)
            last_of[route] = last
        if last is not None and cond is not None:
            early = hoisted.setdefault(cond, {}).setdefault(source, [])
            if last not in early:
                early.append(last)
            if cond in upstream:  # the cond's results depend on it (a walk's row of a cond precedes its branches')
                upstream[cond] |= after
            else:  # the search's follows them (.program._Search.moved_equations)
                ahead[cond] = ahead.get(cond, 0) | after
        elif last is not None:
            tails[where, slot] = last
        return after

    regions: dict[str, list[int]] = {}  # per shard_map row, the collectives its body sends

    def sent(path: str, region: Region, scope: str, bits: int) -> int:
        first = len(made)
        for c in region.collectives:
            dtype = rules.compiled_dtype(c.dtype)
            made.append((c.kind, c.axes, c.reduce_op, str(dtype), rules.widening(c.dtype) * c.result_bytes,
                         f"{scope}/{path}{c.body}" if c.body else scope, path, bits | c.after << first))
            operands.append((None, None))
        regions[path] = list(range(first, len(made)))
        for j, after in enumerate(region.outputs):  # read by the rows after it (Dataflow.reads), and before()
            upstream[path, j] = bits | after << first
        return bits | (1 << len(made)) - (1 << first)

    computations = move_computations(loops)
    for (path, sources, plans, whole, region), scope, reads in zip(equations, dataflow.scopes, dataflow.reads):
        bits = 0
        if any(plans) or len(plans) > len(sources):
            for i in range(max(len(plans), len(sources))):
                source = sources[i] if i < len(sources) else None
                plan = plans[i] if i < len(plans) else None
                bits |= before(source) if plan is None or plan.is_noop else moved(source, plan, path, scope, i, whole)
        else:  # most rows: no input moved, what its sources depend on
            for read in reads:
                bits |= upstream[read]
        if region is not None and region.collectives:
            bits = sent(path, region, scope, bits)
        upstream[path] = bits | ahead.pop(path, 0) if ahead else bits
    for k, (source, plan) in enumerate(extra):
        moved(source, plan, "end", "", k, True)
    if not made:
        return ()
    ranks = _post_order(dataflow, upstream, operands, tails, hoisted, [source for source, _ in extra], regions)
    return tuple(
        PlannedCollective(*fields, rank, source) for fields, rank, (source, _) in zip(made, ranks, operands)
    )


# _lowered_plan() per plan object, whether its move is an output's (whole) and rules object
_LOWERED = Memo(16384)


def _lowered_plan(
    plan: RedistributePlan, whole: bool, rules: CombinerRules
) -> tuple[tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...]] | None, ...]:
    """Per step of ``plan`` (its routes' order; :func:`_xla_order`'s where ``whole``), the
    collectives ``rules``' backend compiles there, each as :class:`PlannedCollective`'s
    first fields (kind, mesh axes, reduction, element type, result bytes): (its halo's
    collective-permutes, the collective), None for a step XLA compiles to nothing (local,
    or over one device). Found once per plan object (kept beside its result, so that its
    id stays its own): the program search groups ~40 choices differing in a few moves per
    :meth:`.program._Search.regrouped` round (GPT-2's adamw step), each moving ~85 values
    by plans it shares with the others."""
    key = (id(plan), whole, id(rules))
    known = _LOWERED.recall(key)
    if known is not None and known[0] is plan and known[1] is rules:
        return known[2]  # type: ignore[no-any-return]
    dtype, widening = rules.compiled_dtype(plan.dtype), rules.widening(plan.dtype)
    lowered: list[tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...]] | None] = []
    for step in _xla_order(plan.steps) if whole and not stepped(plan) else plan.steps:
        if not step.communicates:
            lowered.append(None)
            continue
        halos = tuple((COLLECTIVE_PERMUTE, axes, None, str(dtype), widening * nbytes) for axes, nbytes in step.halo)
        if step.collective == ALL_GATHER:  # a padded all-gather, or an all-reduce of a short dim (compiled)
            _, result_bytes = gather_block_bytes(
                plan.shape, dtype.itemsize, step.before.dim_axes, step.before.mesh.shape, step.mesh_dim, step.src.dim,
            )
            reduce_op = "sum" if step.compiled == ALL_REDUCE else None  # the zero-filled blocks are added
            kind = rules.compiled_kind(step.compiled)
        else:
            kind = rules.compiled_kind(step.collective)
            reduce_op = _reduce_op(step)
            result_bytes = _result_bytes(kind, step.before, step.after, plan.shape, dtype.itemsize)
        lowered.append((halos, (kind, step.axes, reduce_op, str(dtype), result_bytes)))
    found = tuple(lowered)
    _LOWERED.remember(key, (plan, rules, found))
    return found


class Dataflow:
    """What :func:`planned_collectives` reads of a program's equations that their moves do
    not change, found once per program (the program search groups ~75 choices of GPT-2's
    adamw step's ~1,250 rows, :meth:`.program._Search.combined`): each row's computation
    (:func:`_scope`), the rows whose collectives a row depends on where none of its inputs
    moves (what ``before()`` reads of each source, resolved against the rows before it: the
    same bits), and the order in which :func:`_post_order`'s walk reaches the equations'
    inputs (:meth:`walk_order`)."""

    def __init__(
        self, equations: Sequence[MovedEquation], loops: Mapping[str, str], returned: Mapping[Source, Source | None],
        outputs: Sequence[Source | None], results: Iterable[tuple[str, Sequence[tuple[str, Source | None]]]],
    ) -> None:
        self.loops, self.returned = loops, returned
        self.rows = {e.path: e for e in equations}
        # the shard_map rows sending something: their outputs are read one by one (planned_collectives' upstream)
        self.regions = {e.path for e in equations if e.region is not None and e.region.collectives}
        memo = _scopes(tuple(loops.items()))
        self.scopes: list[str] = []
        self.reads: list[tuple[Any, ...]] = []  # per row: the paths (or shard_map outputs) it reads
        seen: set[str] = set()
        for e in equations:
            scope = memo.get(e.path)
            if scope is None:
                scope = memo[e.path] = _scope(e.path, loops)
            self.scopes.append(scope)
            reads: list[Any] = []
            for source in e.sources:
                if source is not None and source[0] in self.regions:
                    reads.append(source)  # an output of a shard_map row: what it depends on
                elif source is not None and source[0] in seen and not (returned and source in returned):
                    reads.append(source[0])  # most: made by a row before (_read()'s common case read inline)
                else:
                    reads += self._read(source, seen)
            self.reads.append(tuple(dict.fromkeys(reads)))
            seen.add(e.path)
        self.scope_of = memo
        self.in_order: dict[str, list[str]] = {}  # per computation, by its first row, its rows' paths in order
        for e, scope in zip(equations, self.scopes):
            self.in_order.setdefault(scope, []).append(e.path)
        self.outputs = outputs
        self.results = dict(results)
        self._walk_orders: dict[tuple[Source | None, ...], tuple[dict[tuple[str, int], int], list[int]]] = {}

    def _read(self, source: Source | None, seen: set[str]) -> tuple[str, ...]:
        """The rows among ``seen`` whose collectives ``source`` depends on (``before()``'s
        reads: a one-trip scan's result its row's, its carry's and its value's in the
        body; a loop's sliced or stacked value its loop's; an input of the program none)."""
        if source is None:
            return ()
        if self.returned and source in self.returned:
            path, j = source
            carry = f"{path}.carry{j}"
            return (*(read for read in (path, carry) if read in seen), *self._read(self.returned[source], seen))
        path = source[0]
        while path not in seen:
            if "." not in path:
                return ()
            path = path.rsplit(".", 1)[0]
        return (path,)

    def producers(self, source: Source | None, scope: str) -> tuple[str, ...]:
        """The equations of ``scope`` making ``source`` (a one-trip scan's result: its value
        in the body and its carry's move)."""
        if source is None or source[0] == "in":
            return ()
        if self.returned and source in self.returned:
            path, j = source
            carry = f"{path}.carry{j}"
            return (*self.producers(self.returned[source], scope), *((carry,) if carry in self.rows else ()))
        path = source[0]
        while path not in self.rows:  # a loop's sliced / stacked value: its loop's
            if "." not in path:
                return ()
            path = path.rsplit(".", 1)[0]
        return (path,) if self.scope_of[path] == scope else ()

    def inputs(self, path: str, scope: str) -> list[str | tuple[str, int]]:
        """The operands of the equation ``path`` (its last row's) walked in ``scope``, in
        order: per input, its :meth:`producers` (paths), then the input itself (its path
        and index: where its move's collectives are the equation's operands)."""
        operands: list[str | tuple[str, int]] = []
        rows, scope_of = self.rows, self.scope_of
        for i, source in enumerate(rows[path].sources):
            if source is not None and source[0] in rows and not (self.returned and source in self.returned):
                if scope_of[source[0]] == scope:  # most: made by an equation (producers()' common case read inline)
                    operands.append(source[0])
            else:
                operands += self.producers(source, scope)
            operands.append((path, i))
        return operands

    def walk_order(self, ends: tuple[Source | None, ...]) -> tuple[dict[tuple[str, int], int], list[int]]:
        """The place of each equation's input (by its path and index) and of each move after
        the program of a value among ``ends`` (those making collectives, in order) in
        :func:`_post_order`'s depth first walk, with no equation skipped. Walking an
        equation after no collective places nothing (no move of its inputs makes one, nor
        of its producers', which are after none either), so skipping those does not reorder
        the rest: the collectives come in this order of the inputs and moves they are at.
        Found once per ``ends`` (a program search's groupings share one or two)."""
        known = self._walk_orders.get(ends)
        if known is not None:
            return known
        at: dict[tuple[str, int], int] = {}
        ended: list[int] = []
        visited: set[str] = set()

        def visit(root: str, scope: str) -> None:
            if root in visited:
                return
            visited.add(root)
            # an explicit stack (a program's chains are deeper than Python's recursion): (node, its operands left)
            stack = [(root, iter(self.inputs(root, scope)))]
            while stack:
                for operand in stack[-1][1]:  # the first producer not visited yet, visited next
                    if isinstance(operand, tuple):  # an input, after its producers
                        at[operand] = len(at) + len(ended)
                    elif operand not in visited:
                        visited.add(operand)
                        stack.append((operand, iter(self.inputs(operand, scope))))
                        break
                else:
                    stack.pop()

        for scope, paths in self.in_order.items():
            if scope == "":
                for source in self.outputs:
                    for made in self.producers(source, ""):
                        visit(made, "")
                for source in ends:
                    for made in self.producers(source, ""):
                        visit(made, "")
                    ended.append(len(at) + len(ended))
            else:
                for row, value in self.results.get(scope, ()):
                    for made in (row,) if row in self.rows else self.producers(value, scope):
                        visit(made, scope)
            for path in paths:
                visit(path, scope)
        known = self._walk_orders[ends] = (at, ended)
        return known


def _post_order(
    dataflow: Dataflow, upstream: dict[Any, int], operands: Sequence[tuple[Any, int | None]],
    tails: dict[tuple[str, int], int], hoisted: dict[str, dict[Source, list[int]]], ends: Sequence[Source | None],
    regions: Mapping[str, Sequence[int]],
) -> list[int]:
    """Each collective's place in XLA's post order (:func:`planned_collectives`): a depth
    first walk of the equations from each computation's roots, an equation's inputs first
    to last, each input's value then its move's collectives (``tails``; a cond's, the moves
    of it its branches read that run before it, ``hoisted``; a ``shard_map`` row's, the
    collectives its body sends, after its last input's, ``regions``), a collective's moved
    value and the collective before it first. The walk skips an equation after no collective
    (``upstream``: none), which has none to place, and so reaches the inputs in the
    program's order of them (:meth:`Dataflow.walk_order`, found once): each collective is
    placed where the walk reaches the input (or the move after the program) it is at, after
    those before it in its route not placed yet (of the same value: its producers walked).
    Walking the equations per grouping visited ~730 of GPT-2's adamw step, 1.2 ms of its
    2.3 ms of :func:`planned_collectives` (now ~0.2 ms)."""
    ended = [k for k in range(len(ends)) if ("end", k) in tails]
    at, ended_at = dataflow.walk_order(tuple(ends[k] for k in ended))
    placed: list[tuple[int, int, int]] = []  # (where the walk reaches it, its place there, collective)
    for (where, slot), tail in tails.items():  # but at an equation the walk skips, or an input its last row lacks
        if where != "end" and upstream[where] and (where, slot) in at:
            placed.append((at[where, slot], -1, tail))
    placed += [(position, -1, tails["end", k]) for k, position in zip(ended, ended_at)]
    for cond, early in hoisted.items():
        sources = dataflow.rows[cond].sources if cond in dataflow.rows and upstream[cond] else ()
        for source, collectives in early.items():
            if source in sources:  # at the first operand holding the value
                position = at[cond, sources.index(source)]
                placed += [(position, j, collective) for j, collective in enumerate(collectives)]
    for path, collectives in regions.items():
        inputs = len(dataflow.rows[path].sources)
        position = at.get((path, inputs - 1), -1) if inputs else -1
        placed += [(position, j, collective) for j, collective in enumerate(collectives)]
    placed.sort()
    rank = [-1] * len(operands)
    count = 0
    for *_, collective in placed:
        chain: list[int] = []
        while collective is not None and rank[collective] < 0:
            chain.append(collective)
            collective = operands[collective][1]
        for collective in reversed(chain):
            rank[collective] = count
            count += 1
    return rank


def _reduce_op(step: Any) -> str | None:
    return getattr(step.src, "reduce_op", None) if step.collective in (ALL_REDUCE, REDUCE_SCATTER) else None


def _result_bytes(kind: str, before: Layout, after: Layout, shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one device's (padded) result block: the gathered block of an all-gather,
    the whole block of an all-reduce, the scattered one of a reduce-scatter."""
    layout = before if kind == ALL_REDUCE else after
    return itemsize * math.prod(-(-n // math.prod(layout.pieces(d))) for d, n in enumerate(shape))


@cached(maxsize=64)
def _scopes(loops: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The memo of :func:`_scope` per equation path of a program with ``loops``, shared by
    its :class:`Dataflow` objects (a program search's per pricing that groups,
    :meth:`.program._Search.combined`, and the walked prediction's)."""
    return {}


@cached(maxsize=64)
def _computations(loops: tuple[tuple[str, str], ...]) -> dict[tuple[str, Source | None], tuple[str, ...]]:
    """The memo of :func:`move_computations` per (equation path, value moved) of a program
    with ``loops`` (each grouping asks it per move)."""
    return {}


def _scope(path: str, loops: Mapping[str, str]) -> str:
    """The computation an equation runs in: ``""`` (the program) or the body of its
    innermost loop (``<loop>`` for a scan, ``<loop>.body`` / ``<loop>.cond`` for a while,
    ``<loop>.b<k>`` for a cond's branch k). Calls are inlined, as XLA inlines them."""
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        loop = ".".join(parts[:n])
        kind = loops.get(loop)
        if kind == "scan":
            return loop
        if kind == "while":
            return f"{loop}.cond" if parts[n] == "cond" else f"{loop}.body"
        if kind == "cond":
            return f"{loop}.{parts[n]}" if parts[n].startswith("b") else loop
    return ""


def move_computations(loops: Mapping[str, str]) -> Callable[[str, Source | None], tuple[str, ...]]:
    """Where moves run in a program with ``loops`` ((path, primitive) of its loops and conds
    compiled as such): a function of the path of the equation reading a value and the
    value ``source`` (None: a literal or constant), giving where its move runs, then the
    computations whose moves it sees, innermost first (:class:`.SharedRoutes` keys a
    route by the first). The first is the equation's computation (:func:`_scope`), but out
    of each cond's branch that does not make ``source`` (a literal's is made where it is
    read): the pinned program moves a cond's
    operand once before the cond for every branch reading it so
    (:meth:`.operators._Runner.loop`'s ``hoisted``; novograd's two ``lax.cond`` read its
    partial gradient reduced in both branches: one all-reduce, as XLA's partitioner
    compiles it, not four). Then those enclosing it across loop boundaries up to a cond's
    branch: a loop body reads an outer value as it is (a scan's or while's constant), and
    so the moves made of it before the loop, where a branch reads its operands as values
    of its own. The function is bound to the program's memo, found once here: a walk asks
    it per move."""
    if not loops:
        return _in_program
    return partial(_within, loops=loops, memo=_computations(tuple(loops.items())))


def _in_program(path: str, source: Source | None) -> tuple[str, ...]:
    """:func:`move_computations` of a program without loops: every move runs in it."""
    return ("",)


def _within(
    path: str, source: Source | None, loops: Mapping[str, str], memo: dict[tuple[str, Source | None], tuple[str, ...]]
) -> tuple[str, ...]:
    """:func:`move_computations`' function, memoized in ``memo`` (:func:`_computations`' of
    ``loops``)."""
    key = (path, source)
    known = memo.get(key)
    if known is None:
        where = _scope(path, loops)
        while where and _is_branch(where, loops) and source is not None and not source[0].startswith(where + "."):
            where = _scope(_loop_of(where, loops), loops)
        chain = [where]
        while where and not _is_branch(where, loops):
            where = _scope(_loop_of(where, loops), loops)
            chain.append(where)
        known = memo[key] = tuple(chain)
    return known


def _cond_left(where: str, outer: str, loops: Mapping[str, str]) -> str:
    """The cond (by path) in the computation ``outer`` whose branch holds the computation
    ``where`` (a move out of a branch, :func:`move_computations`, runs before that cond)."""
    cond = _loop_of(where, loops)
    while (enclosing := _scope(cond, loops)) != outer:
        cond = _loop_of(enclosing, loops)
    return cond


def _loop_of(where: str, loops: Mapping[str, str]) -> str:
    """The loop or cond (by path) whose body or branch the computation ``where`` is."""
    return where if loops.get(where) == "scan" else where.rsplit(".", 1)[0]


def _is_branch(where: str, loops: Mapping[str, str]) -> bool:
    """Whether the computation ``where`` is a cond's branch."""
    return loops.get(where) != "scan" and loops.get(where.rsplit(".", 1)[0]) == "cond"
