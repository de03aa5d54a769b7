"""Choosing a signature: N-D candidates from 1-D rules, filtering, ranking, caching.

1. Candidates: the op's 1-D signatures plus all-Replicate; on an N-D mesh the direct
   product (one 1-D signature per mesh dim). A tensor dim split by several mesh dims is
   split in *nest order* (major first): every order of the mesh dims on meshes of up to
   3 dims, else mesh order plus the orders implied by the input and constraint layouts
   (a valid signature stays valid under any nest order: it is the same signature on a
   transposed mesh). Ties prefer mesh order, which torch's placements say with plain Shards.
2. Filters: a split must have at least as many elements as pieces at its step, using the
   current local extent as torch.chunk nests (``ceil`` of the previous steps); splits a
   1-D signature marks ``even`` must be exact; a tensor may not mix partial reduce ops;
   user constraints (``out_layouts=``, ``in_layouts=``) must match.
3. Ranking (:meth:`Candidate.rank_key`): candidates needing no redistribution of any input
   first (OneFlow's order value), then lower cost (the planner's cost of every input's
   redistribution) plus the pending reduction of partials the op creates
   (:func:`pending_reduction`), then layouts split in mesh order (what torch writes
   without ``_StridedShard``), then the outputs' splits, mesh dim by mesh dim: not split
   there (Replicate or Partial) first, then splits of lower tensor dims (torch's order
   among its equal-cost strategies: ``S(1) + S(0)`` gives ``S(0)``, as torch), then
   keeping earlier inputs unchanged, then smaller per-device output blocks, then a
   structural key of the layouts (splits of lower dims, then Replicate, then Partial): a
   total order, so the result never depends on the order candidates were generated in.

Candidates running on the inputs as given rank first, so when there are any,
:func:`infer_signature` chooses among them alone (built from the 1-D signatures matching
the inputs' placements on each mesh dim) and ranks the rest when
``Signature.candidates`` is first read; the program search reads them all.

Strided inputs (split factors from a view, torch's ``_StridedShard``) add the candidates
running on them in place (:func:`_strided`), as a reshape adds its view (:func:`_views`).

Results are cached by op, params, input shapes/dtypes/layouts, constraints and cost model
(OneFlow caches by shape, dtype, nd_sbp, placement and constraints).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from fractions import Fraction
from functools import partial
from typing import Any

import jax

from ..caches import Memo, cached, collector_paused
from ..errors import ArgumentTypeError, InferenceError, MissingDependencyError
from ..foreign import dispatcher
from ..layout import Layout, MeshPlacements
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
from .cost import (
    ALL_GATHER,
    ALL_TO_ALL,
    REDUCE_SCATTER,
    CostModel,
    CostModelLike,
    block_bytes,
    collective_factor,
    resolve_cost_model,
)
from .ops import freeze, function_definition, has_user_rule, op_definition, out_shapes, primitive_definition
from .plan import InputPlans, cached_plan, cached_plan_cost, cost_scale, plan_search
from .rules import strided_factors
from .signature import (
    Aval,
    Candidate,
    OneDSig,
    Signature,
    TensorSpec,
    as_tensor_spec,
    as_tensor_specs,
    is_tensor_leaf,
    layout_rank_key,
    placement_on,
    split_dims_key,
    split_out_of_mesh_order,
)

__all__ = [
    "continued_partials", "infer_signature", "nest_orders", "pending_reduction", "rank_candidates", "signature_for"
]

Constraint = tuple[Layout | None, ...] | None
FitShapes = tuple[tuple[int, ...], ...]  # per tensor, per dim: its size's fit class (_fit_shapes)
_ALL_ORDERS_UP_TO = 3
RuleKey = tuple[str, str]  # ("op" | "primitive", name) or ("function", its source: "name at file:line")


def infer_signature(
    op: str,
    inputs: Sequence[Any],
    mesh: DeviceMesh | None = None,
    *,
    out_layouts: Any = None,
    in_layouts: Any = None,
    cost_model: CostModelLike = None,
    search: str | None = None,
    **params: Any,
) -> Signature:
    """The signature of named op ``op`` (e.g. ``"matmul"``, ``"sum"``) on ``inputs``.

    ``search="torch"`` gives torch 2.13's dispatcher's choice instead (asked of torch's
    own sharding propagation: needs torch installed; see
    :mod:`placements2jax.interop.torch_dispatch`), as a signature with that one candidate
    costed by our planner; the default (None) is the cost-optimal choice described here.

    ``inputs``: a list of ``(shape, dtype, layout)`` tuples or DTensor-like objects (with
    ``.shape``, ``.dtype``, ``.layout``), or any pytree of them (dicts, NamedTuples,
    dataclasses: its leaves in ``jax.tree`` order are the operands); ``mesh`` defaults
    to theirs. ``params`` are the
    op's parameters as its JAX reference takes them (``axis=``, ``keepdims=``,
    ``shape=``, ``subscripts=``...). ``out_layouts`` / ``in_layouts`` constrain the chosen
    layouts (a layout or placements per output / input, None = free); ``cost_model``
    defaults to :func:`default_cost_model`.
    """
    with collector_paused():  # as predict: the signature's candidates and plans outlive the call
        return _infer_signature_of(op, inputs, mesh, out_layouts, in_layouts, cost_model, search, params)


def _infer_signature_of(
    op: str, inputs: Sequence[Any], mesh: DeviceMesh | None, out_layouts: Any, in_layouts: Any,
    cost_model: CostModelLike, search: str | None, params: dict[str, Any],
) -> Signature:
    definition = op_definition(op)
    specs, mesh = _as_specs(inputs, mesh)
    frozen = freeze(params)
    out_avals = _out_avals(definition.name, frozen, tuple(s.aval for s in specs))
    if search is not None:
        if search != "torch" or out_layouts is not None or in_layouts is not None:
            raise ArgumentTypeError(
                "search", search, "infer_signature's only other search is 'torch', without constraints",
                "pass search=None (the default) or search='torch' without out_layouts= / in_layouts=",
            )
        return _torch_signature(op, frozen, specs, out_avals, resolve_cost_model(cost_model), mesh)
    return _infer(
        ("op", op),
        frozen,
        specs,
        out_avals,
        _constraint(out_layouts, out_avals, mesh, "out_layouts"),
        _constraint(in_layouts, tuple(s.aval for s in specs), mesh, "in_layouts"),
        resolve_cost_model(cost_model),
        mesh,
        lazy=True,
    )


@cached(maxsize=4096)
def _torch_signature(
    op: str, params: Any, specs: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...], cost_model: CostModel,
    mesh: DeviceMesh,
) -> Signature:
    choose = dispatcher("torch")
    if choose is None:
        raise MissingDependencyError(
            "search", "torch", "torch is not installed", "install the torch extra: pip install 'placements2jax[torch]'"
        )
    ins, outs = choose(op, dict(params), specs, out_avals, mesh)
    plans = tuple(cached_plan(s.shape, s.dtype, s.layout, layout, cost_model) for s, layout in zip(specs, ins))
    pending = pending_reduction(out_avals, outs, continued_partials(specs, ins), cost_model)
    candidate = Candidate(ins, outs, plans, (), tuple(range(mesh.ndim)), out_avals, pending)
    return Signature(op, specs, (candidate,))


def signature_for(
    rule: RuleKey,
    params: Any,
    specs: tuple[TensorSpec, ...],
    out_avals: tuple[Aval, ...],
    cost_model: CostModel,
    mesh: DeviceMesh,
    gathered: bool = True,
    ranked: bool = True,
) -> Signature:
    """The (cached) signature of a named op or jaxpr primitive given its output avals.
    ``gathered=False``: ranked without charging a partial kept while another input's
    split is gathered (:func:`continued_partials`): the program search's walk, whose
    carries and starts that charge sends into worse basins (docs/inference.md). Where
    ``gathered`` changes nothing (:func:`_gathered_matters`), both walks share one cached
    signature (the second walk of a cold predict then ranks only from the first
    equation where they differ). ``ranked=False``: a caller reading the chosen candidate
    alone (eager dispatch's walk): a signature not cached yet is chosen as
    :func:`infer_signature` chooses, its other candidates ranked when first read (one
    cache for both: a signature ranked before is returned as it is)."""
    gathered = gathered or not _gathered_matters(specs)
    key = (rule, params, specs, out_avals, cost_model, mesh, gathered)
    signature = _SIGNATURES.recall(key)
    if signature is None:
        signature = _infer_signature(rule, params, specs, out_avals, None, None, cost_model, mesh, not ranked, gathered)
        _SIGNATURES.remember(key, signature)
    return signature


# signature_for's signatures (the program search keys its cache on their candidates' identities)
_SIGNATURES = Memo(16384)


def _gathered_matters(specs: Sequence[TensorSpec]) -> bool:
    """Can :func:`continued_partials`' ``gathered`` change its result on ``specs``? Only if
    on some mesh dim one input is partial (a partial to keep) and another is split (a
    split to gather there): elsewhere a gathered split ends no kept partial."""
    partial = [s.layout.partial_axes for s in specs if s.layout.has_partial]
    if not partial:  # most ops
        return False
    split = frozenset().union(*(_split_mesh_dims(s.layout) for s in specs))
    return any(m in split for axes in partial for m in axes)


def _as_specs(inputs: Any, mesh: DeviceMesh | None) -> tuple[tuple[TensorSpec, ...], DeviceMesh]:
    """The op's operands: the leaves of ``inputs`` (a list, or any pytree: dict, NamedTuple,
    dataclass..., flattened in ``jax.tree`` order), each a tensor or a constant."""
    leaves, tree = jax.tree.flatten(inputs, is_leaf=lambda v: is_tensor_leaf(v) or _spec_like(v))
    if inputs is None or (tree.num_nodes == 1 and tree.num_leaves == 1):
        raise ArgumentTypeError(
            "inputs", inputs, "expected a list of tensors (or a pytree of them)",
            "pass a list, e.g. [(shape, dtype, layout), dtensor]",
        )
    return as_tensor_specs(leaves, mesh)


def _spec_like(value: Any) -> bool:
    """A ``(shape, dtype, layout)`` tuple, maybe with a bad entry (an operand, not a pytree)."""
    return (
        isinstance(value, (tuple, list)) and len(value) == 3 and isinstance(value[0], (tuple, list))
        and isinstance(value[2], (Layout, MeshPlacements, str))
    )


@cached(maxsize=4096)
def _out_avals(op: str, params: Any, in_avals: tuple[Aval, ...]) -> tuple[Aval, ...]:
    known = out_shapes(op, dict(params), in_avals)  # common ops: from shapes, without tracing
    if known is not None:
        return known
    reference = partial(op_definition(op).reference, **dict(params))
    try:
        out = jax.eval_shape(reference, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals))
    except (TypeError, ValueError) as err:
        raise InferenceError(
            "params", dict(params), f"{op} rejects inputs {[str(a) for a in in_avals]} with these params ({err})",
            f"pass the inputs and params {op}'s JAX function takes",
        ) from None
    return tuple(Aval(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(out))


def _constraint(value: Any, avals: tuple[Aval, ...], mesh: DeviceMesh, argument: str) -> Constraint:
    if value is None:
        return None
    single = isinstance(value, (Layout, MeshPlacements, str)) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(p, Placement) for p in value)
    )
    if not single and not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(
            argument, value, "expected a layout or placements, or one of them (or None) per tensor",
            f"pass e.g. {argument}=[Layout.from_device_mesh(mesh)('S(0),R')]",
        )
    values = [value] if single else list(value)
    if len(values) != len(avals):
        raise InferenceError(
            argument, value, f"{len(values)} layouts for {len(avals)} tensors", "give one layout (or None) per tensor"
        )
    return tuple(
        None if v is None else as_tensor_spec((a.shape, a.dtype, v), mesh, f"{argument}[{i}]").layout
        for i, (v, a) in enumerate(zip(values, avals))
    )


def _infer_signature(
    rule: RuleKey,
    params: Any,
    specs: tuple[TensorSpec, ...],
    out_avals: tuple[Aval, ...],
    out_constraint: Constraint,
    in_constraint: Constraint,
    cost_model: CostModel,
    mesh: DeviceMesh,
    lazy: bool = False,
    gathered: bool = True,
) -> Signature:
    """The signature of ``rule`` on ``specs``; ``lazy``: its candidates ranked only when read
    if one of them runs on the inputs as given (predict reads them all: not lazy);
    ``gathered``: see :func:`signature_for`."""
    kind, name = rule
    ins = tuple(s.aval for s in specs)
    definitions = {"op": op_definition, "primitive": primitive_definition, "function": function_definition}
    definition = definitions[kind](name)
    one_d = list(definition.rule(ins, out_avals, **dict(params)))
    prng = [t for t, aval in enumerate(ins + out_avals) if aval.is_key]
    if prng:  # PRNG keys: Replicate on every mesh dim (Aval.is_key), whatever the shape rule allows
        one_d = [sig for sig in one_d if all(isinstance((*sig.inputs, *sig.outputs)[t], Replicate) for t in prng)]
    name = definition.name
    layouts = [s.layout for s in specs] + [x for x in (out_constraint or ()) + (in_constraint or ()) if x is not None]
    orders = nest_orders(mesh, layouts)
    rank = partial(rank_candidates, one_d, specs, out_avals, mesh, orders, cost_model,
                   out_constraint=out_constraint, in_constraint=in_constraint, strided=not has_user_rule(kind, name),
                   gathered=gathered)
    if lazy:
        # candidates running on the inputs as given rank first: the best of them is the choice
        in_place = rank(in_place=True)
        if in_place:
            return Signature(name, specs, chosen=in_place[0], rank=rank)
        best = _bounded_best(one_d, specs, out_avals, mesh, orders, cost_model,
                            out_constraint=out_constraint, in_constraint=in_constraint, gathered=gathered)
        if best is not None:
            return Signature(name, specs, chosen=best, rank=rank)
    candidates = rank()
    if not candidates:
        raise InferenceError(
            "out_layouts" if out_constraint else "in_layouts",
            out_constraint or in_constraint,
            f"no valid signature of {name} matches the constraint",
            "relax the constraint (None leaves a tensor free), or redistribute the result afterwards",
        )
    return Signature(name, specs, tuple(candidates))


_infer = cached(maxsize=4096)(_infer_signature)  # infer_signature's, per op, inputs, constraints and options


def nest_orders(mesh: DeviceMesh, layouts: Sequence[Layout]) -> tuple[tuple[int, ...], ...]:
    """Mesh order first; on meshes of up to ``_ALL_ORDERS_UP_TO`` dims of more than one
    device every other order of those too (e.g. moving a split onto a dim another mesh dim
    already splits, as the minor one, is one all-to-all; size-1 mesh dims stay in place:
    where one of them nests splits nothing); on larger meshes the orders implied by
    ``layouts``."""
    every = _every_order(mesh)
    if every is not None:
        return every
    orders = [tuple(range(mesh.ndim))]
    for layout in layouts:
        order = _implied_order(layout)
        if order not in orders:
            orders.append(order)
    return tuple(orders)


@cached(maxsize=256)
def _every_order(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...] | None:
    """:func:`nest_orders` on a mesh of up to ``_ALL_ORDERS_UP_TO`` dims of more than one
    device (the layouts not read there: cached per mesh, as every ranking asks); None on
    larger meshes."""
    orders = [tuple(range(mesh.ndim))]
    real = [m for m, n in enumerate(mesh.shape) if n > 1]
    if len(real) > _ALL_ORDERS_UP_TO:
        return None
    for permuted in itertools.permutations(real):
        order = list(orders[0])
        for m, new in zip(real, permuted):
            order[m] = new
        if tuple(order) != orders[0]:
            orders.append(tuple(order))
    return tuple(orders)


def _implied_order(layout: Layout) -> tuple[int, ...]:
    """The mesh order with each dim's mesh axes moved into the order that splits it
    (a topological sort choosing the lowest mesh dim first)."""
    before: dict[int, set[int]] = {m: set() for m in range(layout.mesh.ndim)}
    for axes in layout.dim_axes:
        for major, minor in itertools.pairwise(axes):
            before[minor].add(major)
    order: list[int] = []
    while len(order) < len(before):
        order.append(min(m for m, deps in before.items() if m not in order and deps <= set(order)))
    return tuple(order)


def rank_candidates(
    one_d: Sequence[OneDSig],
    specs: Sequence[TensorSpec],
    out_avals: Sequence[Aval],
    mesh: DeviceMesh,
    orders: Sequence[tuple[int, ...]],
    cost_model: CostModel,
    *,
    out_constraint: Constraint = None,
    in_constraint: Constraint = None,
    in_place: bool = False,
    strided: bool = True,
    gathered: bool = True,
) -> list[Candidate]:
    """All valid N-D candidates from the 1-D signatures ``one_d`` (all-Replicate added),
    costed and sorted by :meth:`Candidate.rank_key` (the module docstring's steps 1-3).
    ``in_place``: only those running on the inputs as given (no input redistributed),
    built from the 1-D signatures matching the inputs' placements on each mesh dim.
    ``strided``: add the candidates running on strided inputs in place (:func:`_strided`;
    False for a user's rule, whose signatures may read positions). ``gathered``: whether
    a split gathered ends a kept partial (:func:`continued_partials`).

    The valid layouts do not depend on the inputs' layouts, nor on the sizes beyond what
    the shape filters read of them (:func:`_layout_choices`, cached per
    :func:`_fit_shapes`: a model's repeated layers and its tensors of like shapes share
    them); the candidates' plans are built only
    when read (:class:`.plan.InputPlans`): ranking needs their costs alone."""
    n_in = len(specs)
    replicate = _all_replicate(n_in, len(out_avals))
    sigs = tuple(sorted(set(one_d) | {replicate}, key=_sig_key))  # one cache key per set of signatures
    avals = tuple(s.aval for s in specs) + tuple(out_avals)
    allowed = _trivial_dim_sigs(sigs, specs, mesh)
    if in_place:
        given = [tuple(placement_on(s.layout, m) for s in specs) for m in range(mesh.ndim)]
        allowed = tuple(tuple(sig for sig in sigs if sig.inputs == given[m]) for m in range(mesh.ndim))
        if in_constraint is not None and any(c is not None and c is not s.layout for c, s in zip(in_constraint, specs)):
            return []
        if not all(allowed) and _view_joint(sigs, specs) is None:
            # a mesh dim with no 1-D signature keeping the inputs' placements: only a view runs in place
            # (ranking nothing cost a bounded op of the bench's (2,2,2) row 0.19-0.32 -> 0.08-0.18 ms)
            return []
        in_constraint = tuple(s.layout for s in specs)
    ranked = _ranked(sigs, specs, avals, out_avals, mesh, orders, cost_model, allowed, out_constraint, in_constraint,
                     strided, gathered)
    if not ranked and allowed is not None and not in_place:
        # nothing valid with the trivial mesh dims following the inputs (a constraint or a
        # joint condition asks otherwise there): every combination, as on other meshes
        ranked = _ranked(sigs, specs, avals, out_avals, mesh, orders, cost_model, None, out_constraint, in_constraint,
                         strided, gathered)
    return ranked


@cached(maxsize=256)
def _all_replicate(n_in: int, n_out: int) -> OneDSig:
    """The all-Replicate 1-D signature every op has: one object per arity, its hash and
    sort key computed once (every ranking adds it to its rule's)."""
    return OneDSig((Replicate(),) * n_in, (Replicate(),) * n_out)


def _trivial_dim_sigs(
    sigs: Sequence[OneDSig], specs: Sequence[TensorSpec], mesh: DeviceMesh
) -> tuple[tuple[OneDSig, ...], ...] | None:
    """Per mesh dim, the 1-D signatures candidates use there: all of them on a mesh dim of
    more than one device; on a mesh dim of size 1 (a multi-host layout run with ``dp=1``)
    those changing the inputs' placements there least (:func:`_changes`; most often the
    one keeping them all, as given). None on meshes without size-1 dims.

    On one device every placement holds the whole tensor (a partial over one device is
    its own sum), so a size-1 mesh dim moves no data whichever signature it uses; offering
    every signature there would multiply the candidates by their number per such dim
    (61,552 for a matmul on a (1, 1, 1, 2, 2, 2) mesh instead of 55) for no change in
    cost. Keeping the inputs' placements gives the outputs the placements torch's DTensor
    gives on such a dim (it keeps placements on size-1 dims as written and prices a change
    there by its collective's latency: ``S(0) @ R`` stays ``S(0)``, ``S(1) @ R`` becomes
    ``P`` by slicing the replicated operand, ``S(0) @ S(0)`` gathers the second operand),
    so results stay well defined and deterministic."""
    if 1 not in mesh.shape:
        return None
    allowed = []
    for m, n in enumerate(mesh.shape):
        if n > 1:
            allowed.append(tuple(sigs))
            continue
        given = tuple(placement_on(s.layout, m) for s in specs)
        changes = [_changes(given, sig.inputs) for sig in sigs]
        least = min(changes)
        allowed.append(tuple(sig for sig, c in zip(sigs, changes) if c == least))
    return tuple(allowed)


def _changes(given: Sequence[Placement], wanted: Sequence[Placement]) -> tuple[int, int, int]:
    """How much a 1-D signature changes the inputs' placements on a size-1 mesh dim, as
    torch orders those changes there: collectives (its costs are their latencies: a
    local slice of a replicated input is free), then splits moved to another tensor dim
    (torch adds a penalty to its all-to-all), then every change."""
    moved = [(p, q) for p, q in zip(given, wanted) if p != q]
    communicating = [(p, q) for p, q in moved if not isinstance(p, Replicate)]
    exchanged = sum(1 for p, q in communicating if isinstance(p, Shard) and isinstance(q, Shard))
    return (len(communicating), exchanged, len(moved))


def _ranked(
    sigs: tuple[OneDSig, ...], specs: Sequence[TensorSpec], avals: tuple[Aval, ...], out_avals: Sequence[Aval],
    mesh: DeviceMesh, orders: Sequence[tuple[int, ...]], cost_model: CostModel,
    allowed: tuple[tuple[OneDSig, ...], ...] | None, out_constraint: Constraint, in_constraint: Constraint,
    strided: bool, gathered: bool,
) -> list[Candidate]:
    """:func:`rank_candidates`' list with ``allowed`` signatures per mesh dim (None: all)."""
    n_in = len(specs)
    choices = _layout_choices(sigs, tuple(s.joint for s in sigs), _fit_shapes(avals, mesh.shape), mesh, tuple(orders),
                              allowed)
    out_avals = tuple(out_avals)
    keys = _RankKeys(tuple(specs), out_avals, cost_model, mesh, gathered)
    extra = _views(sigs, specs, mesh, choices)
    if strided and any(s.layout.is_strided for s in specs):
        extra += _strided(specs, avals, mesh, choices)
    entries: Iterable[tuple[tuple[Layout, ...], tuple[OneDSig, ...], tuple[int, ...]]] = (
        itertools.chain(choices, extra) if extra else choices
    )
    if out_constraint is not None or in_constraint is not None:  # predict's walk: never
        entries = [(layouts, combo, order) for layouts, combo, order in entries
                   if _matches(layouts[n_in:], out_constraint) and _matches(layouts[:n_in], in_constraint)]
    ranked = keys.ranked_all(entries)
    ranked.sort(key=_first)  # stable: equal keys keep their order
    return [candidate for _, candidate in ranked]


def _views(
    sigs: Sequence[OneDSig], specs: Sequence[TensorSpec], mesh: DeviceMesh, choices: Sequence[Any]
) -> list[tuple[tuple[Layout, ...], tuple[OneDSig, ...], tuple[int, ...]]]:
    """The view candidate of a one-input op whose joint condition has a ``view`` (reshape:
    :meth:`.rules._ReshapeCheck.view`): the input as it is, the output holding the same
    elements on every rank (maybe strided, torch's ``_StridedShard``; partials kept), at
    no cost; unless the 1-D signatures already give it."""
    view = _view_joint(sigs, specs)
    if view is None:
        return []
    layout = specs[0].layout
    found = view.view(layout.dim_axes, layout.split_factors, mesh.shape)
    if found is None:
        return []
    out = Layout(mesh, found[0], layout.partial, found[1])
    if any(layouts == (layout, out) for layouts, _, _ in choices):
        return []
    return [((layout, out), (), tuple(range(mesh.ndim)))]


def _view_joint(sigs: Sequence[OneDSig], specs: Sequence[TensorSpec]) -> Any:
    """The joint condition with a ``view`` of a one-input op's 1-D signatures (reshape's),
    or None."""
    views = {s.joint for s in sigs if hasattr(s.joint, "view")}
    return views.pop() if len(specs) == 1 and len(views) == 1 else None


def _strided(
    specs: Sequence[TensorSpec], avals: tuple[Aval, ...], mesh: DeviceMesh, choices: Sequence[Any]
) -> list[tuple[tuple[Layout, ...], tuple[OneDSig, ...], tuple[int, ...]]]:
    """The candidates running on strided inputs (split factors from a view, torch's
    ``_StridedShard``) as torch runs elementwise ops, transpose and reductions on them: each
    choice whose 1-D signatures carry the inputs' split factors
    (:func:`.rules.strided_factors`), with the factors on every tensor those signatures
    split alike. A strided input then stays as it is (free), a replicated co-operand is
    sliced locally; without them every op would unstride its inputs first."""
    n_in = len(specs)
    given = [(s.layout.dim_axes, s.layout.split_factors) for s in specs]
    shapes = tuple(a.shape for a in avals)
    found = []
    for layouts, combo, order in choices:
        factors = strided_factors(combo, given, [x.dim_axes for x in layouts], shapes, mesh.shape)
        if factors is None:
            continue
        strided = tuple(Layout(mesh, x.dim_axes, x.partial, f) for x, f in zip(layouts, factors))
        if any(x.is_strided for x in strided[:n_in]):
            found.append((strided, combo, order))
    return found


def _first(entry: tuple[Any, ...]) -> Any:
    return entry[0]


class _RankKeys:
    """:meth:`Candidate.rank_key` of many candidates of one op on the same inputs, from
    parts computed once per (tensor, layout) (plan costs, block bytes, the partials an
    input keeps or gives up) and per output layouts (pending reductions): the candidates
    of an op share them (one dict per tensor, keyed by the interned layout: hashed by
    identity). The same order, the total cost in exact integer units (times ``scale``,
    the planner's :func:`.plan.cost_scale`, which clears the denominators of every plan
    cost and pending reduction on the mesh: the planner's own integers
    (:meth:`plan_units`), int additions and comparisons, not Fraction arithmetic; a
    Fraction where a cost model's weights would leave one, which compares exactly all
    the same); equal keys keep their position. The candidate's ``redistributed`` is
    stored on it as computed, and its ``cost`` where nothing costs (else summed on first
    read: the program search reads layouts only).
    :meth:`ranked_all` does each candidate's steps in one pass (ranking builds tens of
    thousands of candidates per program)."""

    __slots__ = (
        "specs", "out_avals", "cost_model", "gathered", "planner", "weights", "scale", "searches", "mesh", "costs",
        "out_bytes", "charges", "fractions", "partials", "any_partial",
    )

    def __init__(
        self, specs: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...], cost_model: CostModel, mesh: DeviceMesh,
        gathered: bool = True,
    ) -> None:
        self.specs, self.out_avals, self.cost_model, self.gathered = specs, out_avals, cost_model, gathered
        self.planner = InputPlans(specs, cost_model)
        self.weights, self.scale = _weights_and_scale(mesh, cost_model)
        # per input, the planner's search from its layout (None: strided, or not needed yet)
        self.searches: list[Any] = [None] * len(specs)
        # per input, per layout: (plan cost in units of 1/scale, strided, layout key, moved)
        self.costs: tuple[dict[Layout, tuple[int | Fraction, bool, Any, bool]], ...] = tuple(
            _parts_table(("input", spec, cost_model)) for spec in specs
        )
        # per output, per layout: (block bytes, strided, layout key, split dims, its reduction charges' total in
        # units of 1 / scale: _charges())
        self.out_bytes: tuple[dict[Layout, tuple[int, bool, Any, Any, int | Fraction]], ...] = tuple(
            _parts_table(("output", aval, cost_model)) for aval in out_avals
        )
        self.mesh = mesh
        # per output, per layout: _charges()
        self.charges: tuple[dict[Layout, Any], ...] = tuple(
            _parts_table(("charges", aval, cost_model)) for aval in out_avals
        )
        # per pending reduction in units, as a Fraction (shared by the rankings on the mesh: a Fraction division each)
        self.fractions: dict[int | Fraction, Fraction] = _parts_table(("fractions", self.scale))
        self.any_partial = any(s.layout.has_partial for s in specs)
        # per input, per layout: (partial mesh dims kept, splits given up), None where neither (read only with a
        # partial input)
        self.partials: tuple[dict[Layout, tuple[frozenset[int], frozenset[int]] | None], ...] = tuple(
            _parts_table(("partials", spec.layout, gathered)) for spec in specs
        ) if self.any_partial else ()

    def units(self, value: Fraction) -> int | Fraction:
        """``value`` in units of ``1 / scale`` (:func:`_in_units`)."""
        return _in_units(value, self.scale)

    def plan_units(self, i: int, layout: Layout) -> int | Fraction:
        """The cost of input ``i``'s plan to ``layout`` in units of ``1 / scale``: the
        planner's search from its layout settled up to ``layout``, its integer cost read
        as is (:func:`.plan.plan_search`: the same value as :func:`.plan.cached_plan_cost`
        times ``scale``, without building the plan's path or its Fraction); strided
        layouts by :func:`.plan.cached_plan_cost`."""
        spec = self.specs[i]
        given = spec.layout
        if given is layout:
            return 0
        if given.is_strided or layout.is_strided:
            return self.units(cached_plan_cost(spec.shape, spec.dtype, given, layout, self.cost_model))
        search = self.searches[i]
        if search is None:
            search = self.searches[i] = plan_search(
                spec.shape, spec.dtype.itemsize, given.mesh.shape, self.weights, (given.dim_axes, given.partial)
            )
        return search.cost_within((layout.dim_axes, layout.partial), math.inf)

    def total(self, key: tuple[Any, ...]) -> Fraction:
        """The exact cost plus pending reduction of a candidate with rank key ``key``."""
        return Fraction(key[1]) / self.scale

    def continued(self, in_layouts: tuple[Layout, ...]) -> frozenset[int]:
        """:func:`continued_partials` from per-(input, layout) parts: the partial mesh dims
        an input keeps and those it gives up a split on (None where it does neither: most
        layouts). Empty without a partial input (nothing to keep: most ops)."""
        kept = made = _NO_DIMS
        if not self.any_partial:
            return kept
        for spec, layout, table in zip(self.specs, in_layouts, self.partials):
            parts = table.get(layout, _UNSEEN)
            if parts is _UNSEEN:
                given = spec.layout
                keeps = frozenset(m for m in layout.partial_axes if given.partial[m])
                gives = _unsplit(given, layout, self.gathered)
                parts = table[layout] = (keeps, gives) if keeps or gives else None
            if parts is not None:
                if parts[0]:
                    kept = kept | parts[0]
                if parts[1]:
                    made = made | parts[1]
        return kept - made if made else kept

    def pending(self, out_layouts: tuple[Layout, ...], given: frozenset[int]) -> Fraction:
        """:func:`pending_reduction` of the outputs in ``out_layouts`` continuing ``given``."""
        return self._pending(out_layouts, given)[0]

    def pending_units(self, out_layouts: tuple[Layout, ...], given: frozenset[int]) -> int | Fraction:
        """:meth:`pending` in units of ``1 / scale``."""
        return self._pending(out_layouts, given)[1]

    def _pending(self, out_layouts: tuple[Layout, ...], given: frozenset[int]) -> tuple[Fraction, int | Fraction]:
        """:meth:`pending` and it in units of ``1 / scale``: per output layout, its block
        bytes without each partial mesh dim times that dim's :func:`_reduction_rate` in
        units (int products and sums; the same value as :func:`pending_reduction`)."""
        units = 0
        for aval, layout, table in zip(self.out_avals, out_layouts, self.charges):
            found = self._charged(table, aval, layout)
            if given:
                units += sum(charge for m, charge in found[1] if m not in given)
            else:
                units += found[0]
        pending = self.fractions.get(units)
        if pending is None:
            pending = self._fraction(units)
        return pending, units

    def _fraction(self, units: int | Fraction) -> Fraction:
        """``units`` (of ``1 / scale``) as a Fraction, stored in :attr:`fractions`."""
        pending = self.fractions[units] = Fraction(units) / self.scale
        return pending

    def _charged(
        self, table: dict[Layout, Any], aval: Aval, layout: Layout
    ) -> tuple[int | Fraction, tuple[tuple[int, int | Fraction], ...]]:
        """An output's :meth:`_charges` in ``layout`` through its ``table``."""
        found = table.get(layout)
        if found is None:
            found = table[layout] = self._charges(aval, layout)
        return found

    def _charges(self, aval: Aval, layout: Layout) -> tuple[int | Fraction, tuple[tuple[int, int | Fraction], ...]]:
        """An output layout's reduction charges in units: their total and (partial mesh dim,
        charge) pairs."""
        rates = _reduction_units(self.mesh, self.cost_model)
        shape = layout.mesh.shape
        charges = tuple(
            (m, block_bytes(aval.shape, aval.dtype.itemsize, layout.dim_axes, shape, without=m) * rates[m])
            for m in layout.partial_axes
        )
        return sum(charge for _, charge in charges), charges

    def ranked(
        self, layouts: tuple[Layout, ...], one_d: tuple[OneDSig, ...], nest_order: tuple[int, ...]
    ) -> tuple[tuple[Any, ...], Candidate]:
        """The rank key of one choice and its candidate (:meth:`ranked_all`)."""
        return self.ranked_all(((layouts, one_d, nest_order),))[0]

    def ranked_all(
        self, choices: Iterable[tuple[tuple[Layout, ...], tuple[OneDSig, ...], tuple[int, ...]]]
    ) -> list[tuple[tuple[Any, ...], Candidate]]:
        """Per choice (layouts of the inputs then the outputs, 1-D signatures, nest order):
        its rank key and the candidate running the op with it, its pending reduction from
        :meth:`continued`. One loop over them all, the tables and methods it reads bound
        once (a cold predict ranks ~11k candidates, Llama's adamw step); without a partial
        input (nothing continued) a candidate's pending reduction is its outputs' charges'
        totals, read from their parts, not from :meth:`_pending`."""
        n_in = len(self.specs)
        out_avals, planner, given = self.out_avals, self.planner, tuple(s.layout for s in self.specs)
        in_tables = tuple(enumerate(self.costs))
        out_tables = tuple(zip(self.out_avals, self.out_bytes, self.charges))
        pending_of, continued, fractions, any_partial = self._pending, self.continued, self.fractions, self.any_partial
        new = Candidate.__new__
        ranked = []
        for layouts, one_d, nest_order in choices:
            total = 0  # the plan costs, then plus the pending reduction, in units of 1 / scale
            strided = 0
            layout_key = []
            redistributed = []
            for (i, table), layout in zip(in_tables, layouts):
                parts = table.get(layout)
                if parts is None:
                    parts = table[layout] = (
                        self.plan_units(i, layout), split_out_of_mesh_order(layout), layout_rank_key(layout),
                        given[i] is not layout,
                    )
                total += parts[0]
                strided += parts[1]
                layout_key.append(parts[2])
                redistributed.append(parts[3])
            free = not total  # no plan costs anything
            out_layouts = layouts[n_in:]
            out_bytes = 0
            out_splits = []
            charged = 0  # the outputs' reduction charges, in units of 1 / scale
            for (aval, table, charges), layout in zip(out_tables, out_layouts):
                parts = table.get(layout)
                if parts is None:
                    parts = table[layout] = (
                        block_bytes(aval.shape, aval.dtype.itemsize, layout.dim_axes, layout.mesh.shape),
                        split_out_of_mesh_order(layout), layout_rank_key(layout), split_dims_key(layout),
                        self._charged(charges, aval, layout)[0] if layout.has_partial else 0,
                    )
                out_bytes += parts[0]
                strided += parts[1]
                layout_key.append(parts[2])
                out_splits.append(parts[3])
                charged += parts[4]
            in_layouts = layouts[:n_in]
            if not charged:  # nothing to reduce (no partial output): nothing pending, whatever the inputs continue
                pending = _ZERO
            elif any_partial:
                pending, units = pending_of(out_layouts, continued(in_layouts))
                total += units
            else:
                pending = fractions.get(charged)
                if pending is None:
                    pending = self._fraction(charged)
                total += charged
            moved = tuple(redistributed)
            # Candidate(...) as its __init__ sets it, with what Candidate.redistributed (and .cost, where
            # nothing costs) compute stored, not recomputed
            candidate = new(Candidate)
            candidate.__dict__.update(
                in_layouts=in_layouts, out_layouts=out_layouts, one_d=one_d, nest_order=nest_order,
                out_avals=out_avals, pending=pending, planner=planner, redistributed=moved,
            )
            if free:
                candidate.__dict__["cost"] = _ZERO
            # Candidate.strided, .out_splits and .layout_key from parts per (tensor, layout)
            ranked.append(((True in moved, total, strided, tuple(out_splits), moved, out_bytes, tuple(layout_key)),
                           candidate))
        return ranked


def _parts_table(key: tuple[Any, ...]) -> dict[Layout, Any]:
    """The per-layout parts table of one tensor of :class:`_RankKeys` under ``key``: an
    input's by its spec and cost model (the partials it keeps or gives up by its layout
    and ``gathered``), an output's by its aval and cost model (its reduction charges
    among its parts); and the pending reductions' Fractions by the planner's scale.
    Shared by every ranking (memoized): a part is a function of the tensor and
    the layout alone, and rankings meet the same ones again (the ops reading one value,
    values of one shape and layout: 3/4 of the input parts of a cold predict's rankings
    are another ranking's, Llama's and GPT-2's adamw steps)."""
    table = _PARTS.get(key)
    if table is None:
        table = {}
        _PARTS.remember(key, table)
    return table


_PARTS = Memo(16384)
_ZERO = Fraction(0)
_NO_DIMS: frozenset[int] = frozenset()
_UNSEEN = object()


def _bounded_best(
    one_d: Sequence[OneDSig],
    specs: Sequence[TensorSpec],
    out_avals: Sequence[Aval],
    mesh: DeviceMesh,
    orders: Sequence[tuple[int, ...]],
    cost_model: CostModel,
    *,
    out_constraint: Constraint = None,
    in_constraint: Constraint = None,
    gathered: bool = True,
) -> Candidate | None:
    """The first of :func:`rank_candidates`' list when none of them runs on the inputs as
    given (the caller checked), by branch and bound, without ranking the others
    (``gathered``: charging a partial kept while a split is gathered, as that ranking does:
    :func:`continued_partials`).

    A combination of 1-D signatures costs at least the sum over mesh dims of what its
    placements there force (:func:`_dim_bound`); combinations are visited by that bound
    and the visit stops at the first whose bound exceeds the best exact ``cost +
    pending`` found. Within a combination, a nest order whose inputs cannot reach their
    layouts within the best less the combination's pending bound is skipped before its
    layouts are built (:func:`_inputs_cost`). The bounds depend only on the layouts a
    combination and order give, so every one giving the best layouts is visited and the
    candidate (its 1-D signatures and nest order too) is the one the full ranking puts
    first. None where this does not apply (a strided input) or nothing is valid: rank
    them all. Costs are compared in the planner's exact integer units (times
    :func:`.plan.cost_scale`), not as Fractions."""
    specs, out_avals = tuple(specs), tuple(out_avals)
    if any(s.layout.is_strided for s in specs):
        return None
    n_in = len(specs)
    replicate = _all_replicate(n_in, len(out_avals))
    ordered = sorted(set(one_d) | {replicate}, key=_sig_key)
    # per signature index (a combination's parts read by index, not by hashing signatures)
    sig_keys = [_sig_key(sig) for sig in ordered]
    tables = [_placement_table(sig) for sig in ordered]
    avals = tuple(s.aval for s in specs) + out_avals
    shapes = _fit_shapes(avals, mesh.shape)
    allowed = _trivial_dim_sigs(ordered, specs, mesh)  # as rank_candidates: the same first candidate
    bounds = []
    pending_bounds = []
    rates, unit = _bound_rates(mesh, cost_model)
    nbytes = [math.prod(a.shape) * a.dtype.itemsize for a in avals]
    for m in range(mesh.ndim):
        given = tuple(placement_on(s.layout, m) for s in specs)
        parts = [_dim_bound(sig, given, nbytes[:n_in], nbytes[n_in:], rates[m], gathered) for sig in ordered]
        # the floats of the exact bounds (int true division rounds correctly, as Fraction's float)
        bounds.append([(k, (moved + pending) / unit) for k, (moved, pending) in enumerate(parts)
                       if allowed is None or ordered[k] in allowed[m]])
        pending_bounds.append([pending for _, pending in parts])
    weights, scale = _weights_and_scale(mesh, cost_model)
    searches = [plan_search(s.shape, s.dtype.itemsize, mesh.shape, weights, (s.layout.dim_axes, s.layout.partial))
                for s in specs]
    # the bound of every combination, in itertools.product's order over the rows (a flat
    # index, mixed radix), the sums built one mesh dim at a time (the same floats as summing
    # each afresh); visited by bound, equal bounds in that order (a stable sort of the
    # indices: floats alone, not (bound, indices) tuples, built and compared for every one)
    totals: list[float] = [0]
    for row in bounds:
        totals = [total + b for total in totals for _, b in row]
    visits = sorted(range(len(totals)), key=totals.__getitem__)
    found: dict[tuple[Layout, ...], tuple[tuple[Any, ...], tuple[OneDSig, ...], tuple[int, ...]]] = {}
    keys = _RankKeys(specs, out_avals, cost_model, mesh, gathered)
    orders = tuple(orders)
    positions = [tuple(order.index(m) for m in range(mesh.ndim)) for order in orders]
    cosplit = _cosplit(tables)
    mesh_pairs = tuple(itertools.combinations(range(mesh.ndim), 2))
    order_classes: dict[tuple[tuple[int, int], ...], tuple[tuple[int, ...], ...]] = {}
    ndims = tuple(len(s.shape) for s in specs)
    best: tuple[Any, tuple[Layout, ...]] | None = None  # rank key, layouts
    best_units = 0  # its exact cost + pending in units of 1 / scale (an int: the scale clears every denominator)
    limit = math.inf
    for flat in visits:
        if totals[flat] > limit:
            break
        ix = _combination(flat, bounds)
        combo = tuple(ordered[k] for k in ix)
        placements = [tables[k] for k in ix]
        combo_keys = tuple(sig_keys[k] for k in ix)
        # the least pending reductions, in units (rounded up: the exact ones are integers)
        least_pending = -(-sum(pending_bounds[m][k] for m, k in enumerate(ix)) * scale // unit)
        pairs = tuple((a, b) for a, b in mesh_pairs if cosplit[ix[a]][ix[b]])
        distinct = order_classes.get(pairs)
        if distinct is None:  # once per pattern of nested pairs (a few per call)
            distinct = order_classes[pairs] = _distinct_orders(pairs, orders, positions, mesh.shape)
        for order in distinct:
            if best is not None:
                in_cost = _inputs_cost(searches, ndims, placements, order, mesh.ndim, best_units - least_pending)
                if in_cost is None:
                    continue
            for layouts in _add_layouts(combo, placements, combo_keys, (order,), shapes, mesh, found):
                ins, outs = layouts[:n_in], layouts[n_in:]
                if not _matches(outs, out_constraint) or not _matches(ins, in_constraint):
                    continue
                if best is not None and in_cost + keys.pending_units(outs, keys.continued(ins)) > best_units:
                    continue
                key = keys.ranked(layouts, (), ())[0]
                if not key[0]:  # runs on the inputs as given: not this function's case
                    return None
                if best is None or key < best[0]:
                    best, best_units = (key, layouts), key[1]
                    limit = float(keys.total(key)) * (1 + 1e-9) + 1e-9  # float bounds: a margin over their rounding
    if best is None:
        return None
    layouts = best[1]
    _, combo, order = found[layouts]
    return keys.ranked(layouts, combo, order)[1]


def _distinct_orders(
    pairs: tuple[tuple[int, int], ...], orders: tuple[tuple[int, ...], ...], positions: Sequence[tuple[int, ...]],
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[int, ...], ...]:
    """The nest orders of ``orders`` (``positions``: each one's position of every mesh dim)
    that give a combination of 1-D signatures whose ``pairs`` of mesh dims split one tensor
    dim (:func:`_cosplit`, in order) layouts no smaller order gives: two orders give every
    tensor the same layouts iff they order each such pair alike (the layouts' keys in
    :func:`_add_layouts` prefer the smaller order). Mesh order alone where no tensor dim is
    split by two mesh dims of more than one device, as :func:`_layout_choices`. A
    combination splitting one tensor dim by two mesh dims has 2 distinct orders of the 6
    on a 3-D mesh, each checked and built once."""
    if not any(mesh_shape[a] > 1 and mesh_shape[b] > 1 for a, b in pairs):
        return orders[:1]
    least: dict[tuple[bool, ...], tuple[int, ...]] = {}
    for order, position in zip(orders, positions):
        class_key = tuple([position[a] < position[b] for a, b in pairs])
        known = least.get(class_key)
        if known is None or order < known:
            least[class_key] = order
    kept = set(least.values())
    return tuple(order for order in orders if order in kept)


def _cosplit(tables: Sequence[tuple[tuple[int | None, Any], ...]]) -> list[list[bool]]:
    """Per pair of 1-D signatures (``tables``: their :func:`_placement_table`): do they split
    one dim of some tensor (so on two mesh dims, the nest order matters for it)?"""
    splits = [{(t, dim) for t, (dim, _) in enumerate(table) if dim is not None} for table in tables]
    return [[not mine.isdisjoint(other) for other in splits] for mine in splits]


def _combination(flat: int, rows: Sequence[Sequence[tuple[int, float]]]) -> tuple[int, ...]:
    """The signature index per mesh dim of the combination at ``flat`` in the product of
    ``rows`` (each a mesh dim's ``(signature index, bound)`` pairs)."""
    ix = []
    for row in reversed(rows):
        flat, position = divmod(flat, len(row))
        ix.append(row[position][0])
    return tuple(reversed(ix))


def _inputs_cost(
    searches: Sequence[Any], ndims: tuple[int, ...], placements: Sequence[tuple[tuple[int, Any], ...]],
    order: tuple[int, ...], mesh_ndim: int, limit: int,
) -> int | None:
    """The plans' cost taking the inputs to the layouts a combination of 1-D signatures
    (``placements``: their :func:`_placement_table`) gives them in nest order ``order``
    (in the units of ``searches``, the planner's search from each input), if at most
    ``limit``; else None, and None where an input's layout is invalid. Built as
    :func:`_tensor_layout` builds them, without building layouts: each search settles
    layouts only up to what is left of the limit."""
    total = 0
    for t, search in enumerate(searches):
        ndim = ndims[t]
        dim_axes: list[tuple[int, ...]] = [()] * ndim
        partial: list[Any] = [None] * mesh_ndim
        for m in order:
            dim, op = placements[m][t]
            if dim is not None:
                if not 0 <= dim < ndim:
                    return None
                dim_axes[dim] += (m,)
            elif op:
                partial[m] = op
        cost = search.cost_within((tuple(dim_axes), tuple(partial)), limit - total)
        if cost is None:
            return None
        total += cost
    return total


def _dim_bound(sig: OneDSig, given: tuple[Placement, ...], in_bytes: Sequence[int], out_bytes: Sequence[int],
               rates: tuple[int, int, int], gathered: bool = True) -> tuple[int, int]:
    """A lower bound on the cost and pending reduction a candidate using ``sig`` on one
    mesh dim pays there, the inputs having placements ``given`` on it: an input leaving a
    partial is reduced (at least a reduce-scatter), a split moved to another dim is
    exchanged (at least an all-to-all), a split dropped (to Replicate or Partial) is
    gathered; a partial output owes a reduce-scatter (:func:`pending_reduction`) unless a
    partial input continues it there and no input gives up a split there (gathers it or
    makes it partial; only the latter unless ``gathered``: :func:`continued_partials`); each on the
    smallest block the tensor can have (its bytes over the other mesh dims' sizes).
    Distinct mesh dims' steps are distinct steps of a plan, so the bounds of the mesh dims
    add up. In exact integer units (:func:`_bound_rates`: ``rates`` are the dim's, per byte
    of the tensor, of a reduce-scatter, an all-to-all and an all-gather)."""
    total = 0
    kept = made = False
    reduce, exchange, gather = rates
    for p, q, size in zip(given, sig.inputs, in_bytes):
        kept = kept or (isinstance(q, Partial) and isinstance(p, Partial))
        # a split given up (continued_partials): gathered or made partial, or only made partial
        made = made or (isinstance(p, Shard) and (not isinstance(q, Shard) if gathered else isinstance(q, Partial)))
        if p == q:
            continue
        if isinstance(p, Partial):
            total += reduce * size
        elif isinstance(p, Shard):
            total += (exchange if isinstance(q, Shard) else gather) * size
    pending = 0
    if not kept or made:
        for q, size in zip(sig.outputs, out_bytes):
            if isinstance(q, Partial):
                pending += reduce * size
    return total, pending


@cached(maxsize=256)
def _bound_rates(mesh: DeviceMesh, cost_model: CostModel) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """:func:`_dim_bound`'s rates in integers (Fraction arithmetic in every bound of
    every combination was ~16% of eager dispatch's choices): per mesh dim, the weighted
    bytes a reduce-scatter, an all-to-all and an all-gather send per byte of a tensor
    (:func:`.cost.collective_bytes` on its smallest block, its bytes over the other mesh
    dims' sizes), times ``unit``, an integer clearing their denominators; and ``unit``.
    Built from numerators and denominators in int arithmetic (the Fraction products were
    half of a bounded choice's setup on a 3-D mesh; the ratios are the same, so are the
    bounds). Cached: every branch and bound reads them."""
    total = math.prod(mesh.shape)
    exact = []  # per mesh dim, per collective: (numerator, denominator) of its rate
    for m, n in enumerate(mesh.shape):
        weight = Fraction(cost_model.weight(mesh, m))
        # one byte's block is n / total (its bytes over the other mesh dims' sizes)
        exact.append([
            (factor.numerator * n * weight.numerator, factor.denominator * total * weight.denominator)
            for factor in (collective_factor(c, n) for c in (REDUCE_SCATTER, ALL_TO_ALL, ALL_GATHER))
        ])
    unit = math.lcm(*(den for rates in exact for _, den in rates))
    return tuple(tuple(num * (unit // den) for num, den in rates) for rates in exact), unit


@cached(maxsize=4096)
def _layout_choices(
    sigs: tuple[OneDSig, ...], joints: tuple[Any, ...], shapes: FitShapes, mesh: DeviceMesh,
    orders: tuple[tuple[int, ...], ...], allowed: tuple[tuple[OneDSig, ...], ...] | None = None,
) -> tuple[tuple[tuple[Layout, ...], tuple[OneDSig, ...], tuple[int, ...]], ...]:
    """Every valid assignment of layouts to the tensors (inputs, then outputs; ``shapes``:
    their :func:`_fit_shapes`), with the least ``(1-D signature keys, nest order)`` giving
    it: step 1 and the shape filters of step 2 (``joints``, the signatures' joint conditions, are in the key because
    OneDSig's equality ignores them). A combination of 1-D signatures that splits no
    tensor dim over several mesh dims gives the same layouts in every nest order, and
    mesh order (``orders[0]``) is its least key: it is built once. ``allowed``: per mesh
    dim, the signatures it may use (a subset of ``sigs``; None: all)."""
    sig_keys = {sig: _sig_key(sig) for sig in sigs}
    ordered = sorted(sigs, key=sig_keys.__getitem__)
    tables = [_placement_table(sig) for sig in ordered]
    # (signature, placement table, key, index) quadruples: a combination's parts without hashing signatures (a
    # dataclass's hash, in Python) per combination
    entries = [(sig, table, sig_keys[sig], k) for k, (sig, table) in enumerate(zip(ordered, tables))]
    # whether a combination nests (some tensor dim split by two mesh dims of more than one device: the nest order
    # matters; a size-1 mesh dim splits nothing wherever it nests: mesh order alone puts it in place) from its
    # pairs of signatures (_cosplit), looked up per pair of those mesh dims, not computed or hashed per combination
    cosplit = _cosplit(tables)
    real = [m for m, n in enumerate(mesh.shape) if n > 1]
    real_pairs = tuple(itertools.combinations(real, 2))
    found: dict[tuple[Layout, ...], tuple[tuple[Any, ...], tuple[OneDSig, ...], tuple[int, ...]]] = {}
    per_dim = [entries] * mesh.ndim if allowed is None else [[e for e in entries if e[0] in a] for a in allowed]
    first = orders[:1]
    for chosen in itertools.product(*per_dim):
        combo, placements, keys, ix = zip(*chosen)
        nests = any(cosplit[ix[a]][ix[b]] for a, b in real_pairs)
        _add_layouts(combo, placements, keys, orders if nests else first, shapes, mesh, found)
    return tuple((layouts, combo, order) for layouts, (_, combo, order) in found.items())


def _add_layouts(
    combo: tuple[OneDSig, ...], placements: Sequence[tuple[tuple[int, Any], ...]], keys: tuple[Any, ...],
    orders: tuple[tuple[int, ...], ...], shapes: FitShapes, mesh: DeviceMesh,
    found: dict[tuple[Layout, ...], tuple[tuple[Any, ...], tuple[OneDSig, ...], tuple[int, ...]]],
) -> list[tuple[Layout, ...]]:
    """The valid layouts of one combination of 1-D signatures in the nest orders ``orders``
    (the caller's: those that matter), each entered in ``found`` with the least ``(keys,
    order)`` giving it; returns the layouts ``found`` did not hold before."""
    new = []
    joints = [s.joint for s in combo if s.joint is not None]
    for order in orders:
        layouts = _layouts(combo, placements, order, shapes, mesh)
        if layouts is None or (joints and not _joints_hold(joints, layouts, mesh.shape)):
            continue
        key = (keys, order)
        known = found.get(layouts)
        if known is None:
            new.append(layouts)
        if known is None or key < known[0]:
            found[layouts] = (key, combo, order)
    return new


def _joints_hold(joints: Sequence[Any], layouts: tuple[Layout, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Do the joint conditions hold on the candidate's layouts (they read each tensor's
    ``(dim_axes, partial)`` table)?"""
    tables = [(x.dim_axes, x.partial) for x in layouts]
    return all(joint(tables, mesh_shape) for joint in joints)


def _placement_table(sig: OneDSig) -> tuple[tuple[int, Any], ...]:
    """Per tensor of a 1-D signature: (split tensor dim or None, partial reduce op or None)."""
    return tuple(
        (p.dim, None) if isinstance(p, Shard) else (None, p.reduce_op if isinstance(p, Partial) else None)
        for p in sig.placements
    )


def continued_partials(specs: Sequence[TensorSpec], in_layouts: Sequence[Layout], gathered: bool = True) -> set[int]:
    """The mesh dims on which an op run with ``in_layouts`` continues a given partial: some
    input stays partial there and no input split on that mesh dim gives its split up there,
    to a partial or to Replicate (``P + S(0)`` made ``P + P``, or ``P * S(0)`` made
    ``P * R``, still owes the result's reduction: torch reduce-scatters ``P`` into the
    split instead, and the reduction it then owes no more is charged to the candidate that
    keeps it). ``P + P``, ``P * R`` (nothing gathered) and a replicated input made partial
    (``P + R``: the replicated value scaled on one coordinate) continue the partial:
    charging them would make every op split its output only to shrink the charge
    (``b - lr * g`` on a replicated bias, in op-by-op prediction, where no later op pays
    for gathering it back). ``gathered=False``: only a split made partial ends a kept
    partial, not one gathered (the program search walks so: :func:`signature_for`)."""
    kept = {m for s, layout in zip(specs, in_layouts) for m in layout.partial_axes if s.layout.partial[m]}
    made = set().union(*(_unsplit(s.layout, layout, gathered) for s, layout in zip(specs, in_layouts)))
    return kept - made


def _unsplit(given: Layout, layout: Layout, gathered: bool = True) -> frozenset[int]:
    """The mesh dims on which ``given`` is split and ``layout`` is not (the split given up:
    gathered, or made partial; only made partial unless ``gathered``)."""
    lost = _split_mesh_dims(given) - _split_mesh_dims(layout)
    return lost if gathered or not lost else frozenset(m for m in lost if layout.partial[m])


def _split_mesh_dims(layout: Layout) -> frozenset[int]:
    """The mesh dims splitting some dim of ``layout`` (memoized per interned layout)."""
    dims = _SPLIT_MESH_DIMS.get(layout)
    if dims is None:
        dims = frozenset(m for axes in layout.dim_axes for m in axes)
        _SPLIT_MESH_DIMS.remember(layout, dims)
    return dims


_SPLIT_MESH_DIMS = Memo(65536)


def pending_reduction(
    out_avals: Sequence[Aval], out_layouts: Sequence[Layout], given_partial: set[int], cost_model: CostModel
) -> Fraction:
    """The look-ahead charge of new partials: for every output partial on a mesh dim not
    in ``given_partial`` (the mesh dims the op continues a partial on, see
    :func:`continued_partials`), the cheapest way to resolve it later (a reduce-scatter of
    the output's block on that mesh dim, weighted: :func:`_reduction_rate` per byte).
    Without it, a greedy choice would pay a little now to create a partial that costs
    much more to reduce later (e.g. contract a matmul over an extra mesh dim). Continuing
    a partial through a linear op is free."""
    total = Fraction(0)
    for aval, layout in zip(out_avals, out_layouts):
        for m in layout.partial_axes:
            if m not in given_partial:
                block = block_bytes(aval.shape, aval.dtype.itemsize, layout.dim_axes, layout.mesh.shape, without=m)
                total += block * _reduction_rate(layout.mesh, m, cost_model)
    return total


def _in_units(value: Fraction, scale: int) -> int | Fraction:
    """``value`` times ``scale``: an int where ``scale`` clears its denominator (in int
    arithmetic, not a Fraction product), else a Fraction."""
    whole, part = divmod(scale, value.denominator)
    return value.numerator * whole if not part else value * scale


@cached(maxsize=256)
def _weights_and_scale(mesh: DeviceMesh, cost_model: CostModel) -> tuple[tuple[Fraction, ...], int]:
    """The mesh dims' weights and the planner's :func:`.plan.cost_scale` (cached: every
    ranking reads them; computing them again was ~4% of a cold predict's rankings)."""
    weights = cost_model.weights(mesh)
    return weights, cost_scale(mesh.shape, weights)


@cached(maxsize=256)
def _reduction_units(mesh: DeviceMesh, cost_model: CostModel) -> tuple[int | Fraction, ...]:
    """Per mesh dim, :func:`_reduction_rate` in units of ``1 / cost_scale`` (the units of
    :class:`_RankKeys`; cached: every ranking with a partial output reads them)."""
    scale = _weights_and_scale(mesh, cost_model)[1]
    return tuple(_in_units(_reduction_rate(mesh, m, cost_model), scale) for m in range(mesh.ndim))


def _reduction_rate(mesh: DeviceMesh, mesh_dim: int, cost_model: CostModel) -> Fraction:
    """What a pending reduction on ``mesh_dim`` charges per byte of the block it reduces
    (a reduce-scatter's bytes sent per block byte, weighted)."""
    return collective_factor(REDUCE_SCATTER, mesh.shape[mesh_dim]) * cost_model.weight(mesh, mesh_dim)


def _sig_key(sig: OneDSig) -> tuple[str, ...]:
    """A 1-D signature's sort key (its placements' and even marks' text; memoized: every
    ranking sorts its rule's signatures, and rules give the same ones again)."""
    key = _SIG_KEYS.get(sig)
    if key is None:
        key = tuple(str(p) for p in sig.placements) + tuple(sorted(map(str, sig.even)))
        _SIG_KEYS.remember(sig, key)
    return key


_SIG_KEYS = Memo(65536)


def _layouts(
    combo: tuple[OneDSig, ...], placements: Sequence[tuple[tuple[int, Any], ...]], order: tuple[int, ...],
    shapes: FitShapes, mesh: DeviceMesh,
) -> tuple[Layout, ...] | None:
    """Per tensor the layout of a candidate, or None if it is invalid (``placements``: each
    signature's :func:`_placement_table`; ``shapes``: the tensors' :func:`_fit_shapes`).
    Each split step needs at least as many elements as pieces (the current local extent:
    ceil of the previous steps, as torch.chunk nests); ``even`` steps must be exact, and so
    must every step before them. Each tensor's layout from its entries, nest order and
    fit shape is memoized (:func:`_tensor_layout`: an op's tensors and its candidates, and
    the ops of a program, share most of them); the ``even`` marks are the combination's."""
    layouts = []
    for t, (entries, dims) in enumerate(zip(zip(*placements), shapes)):
        key = (entries, order, dims, mesh)
        found = _TENSOR_LAYOUTS.get(key)
        if found is None:
            found = _tensor_layout(entries, order, dims, mesh)
            _TENSOR_LAYOUTS.remember(key, found)
        if not found:  # _INVALID
            return None
        layout, inexact = found
        for d, axes in inexact:
            if any((t, d) in combo[m].even for m in axes):
                return None
        layouts.append(layout)
    return tuple(layouts)


_TENSOR_LAYOUTS = Memo(65536)
_INVALID = ()


def _tensor_layout(
    entries: tuple[tuple[int | None, Any], ...], order: tuple[int, ...], dims: tuple[int, ...], mesh: DeviceMesh
) -> tuple[Any, ...]:
    """One tensor's part of :func:`_layouts` (``entries``: its (split dim, partial op) per
    mesh dim; ``dims``: its fit shape): ``_INVALID``, or its layout and, per split dim
    with an inexact step, the mesh dims splitting it from that step on (those steps must
    not be ``even``)."""
    mesh_shape = mesh.shape
    ndim = len(dims)
    dim_axes: list[list[int]] = [[] for _ in range(ndim)]
    partial: list[Any] = [None] * len(mesh_shape)
    for m in order:
        dim, op = entries[m]
        if dim is not None:
            if not 0 <= dim < ndim:
                return _INVALID
            dim_axes[dim].append(m)
        elif op:
            partial[m] = op
    if len({op for op in partial if op}) > 1:
        return _INVALID
    inexact = []
    for d, axes in enumerate(dim_axes):
        if axes:
            step = _inexact_step(dims[d], tuple(axes), mesh_shape)
            if step < 0:
                return _INVALID
            if step < len(axes):
                inexact.append((d, tuple(axes[step:])))
    return Layout(mesh, tuple(map(tuple, dim_axes)), tuple(partial)), tuple(inexact)


def _fit_shapes(avals: Sequence[Aval], mesh_shape: tuple[int, ...]) -> FitShapes:
    """What the shape filters read of the tensors' sizes: per tensor, per dim, its size's
    fit class (:func:`_fit_class`). Sizes of one class give the same valid layouts, so
    the layout choices are computed once per class (most of a model's tensors share
    them: 64 and 256 split alike on a (2, 4) mesh)."""
    devices = math.prod(mesh_shape)
    return tuple(tuple(_fit_class(n, devices) for n in aval.shape) for aval in avals)


def _fit_class(size: int, devices: int) -> int:
    """A size that every split of a dim of ``size`` by distinct mesh dims treats alike
    (:func:`_first_inexact`, on a mesh of ``devices``): ``size`` itself below ``devices``,
    else ``devices + gcd(size, devices)``. The mesh dims' sizes n1, n2, ... of a split
    multiply to a divisor of ``devices``, so its step i is exact iff n1...ni divides
    ``gcd(size, devices)``; and from ``devices`` elements on no step has fewer elements than
    pieces (ceil(size / (n1...n(i-1))) >= ni). A class is thus one int, not its results
    per ordered sequence of mesh dims (factorial in the mesh's dims: ~110k sequences on 8
    non-trivial dims); :func:`_inexact_step` computes those a split reads, memoized."""
    return size if size < devices else devices + math.gcd(size, devices)


_INEXACT_STEPS = Memo(65536)


def _inexact_step(size: int, axes: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    """:func:`_first_inexact`, memoized (a model's fit classes and splits recur)."""
    key = (size, axes, mesh_shape)
    found = _INEXACT_STEPS.get(key)
    if found is None:
        found = _first_inexact(size, axes, mesh_shape)
        _INEXACT_STEPS.remember(key, found)
    return found


def _first_inexact(size: int, axes: Sequence[int], mesh_shape: tuple[int, ...]) -> int:
    """Splitting a dim of ``size`` by mesh dims ``axes`` in turn (major first): -1 when
    some step has fewer elements than pieces, else the index of the first inexact step
    (the number of steps if all are exact)."""
    extent, inexact = size, len(axes)
    for i, m in enumerate(axes):
        n = mesh_shape[m]
        if extent < n:
            return -1
        if inexact == len(axes) and extent % n:
            inexact = i
        extent = -(-extent // n)
    return inexact


def _matches(layouts: Sequence[Layout], constraint: Constraint) -> bool:
    return constraint is None or all(c is None or c == x for c, x in zip(constraint, layouts))
