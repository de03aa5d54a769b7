"""Predicting the layouts of a whole JAX function by walking its jaxpr.

``predict(fn, *inputs)`` traces ``fn`` with ``jax.make_jaxpr`` on shape/dtype stand-ins
and walks it once giving every equation the signature inference chooses for its inputs'
layouts (the same cached selection as :func:`infer_signature`, with the primitive's
rule), as eager torch DTensor would dispatch op by op, recording the dataflow. Unless
``search="eager"``, :mod:`.program` then chooses all signatures for the whole program and
a second walk applies that choice. Call-like equations (``jit`` / ``pjit``,
``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``closed_call``, and
``custom_linear_solve`` as its solve) are walked inside; ``with_sharding_constraint``,
``reshard`` and ``shard_map`` regions force their layouts (the report shows the plan to
them). Control flow: ``scan`` and ``while`` start from a fixed point of their carries'
layouts, which the program search re-solves (it chooses among carry options, and the
carries are walked and searched again from the layouts its chosen body returns them in,
and replicated over a mesh dim some carry was split over: :func:`_resolve_carries`);
``cond`` joins its branches' output layouts
(re-joined after the search where their consumers read them, or as the searched branches
give them: :func:`_rejoin_conds`); a ``scan`` with ``unroll=k`` is walked as JAX lowers
it, k copies of its body in a loop and the remainder after it (:func:`unrolled_scan`).
Literals and closed-over constants are Replicate. A primitive without a rule raises
:class:`UnsupportedOpError` naming it and the user's source line, or (``on_unknown=
"replicate"``) runs replicated.

Inputs and outputs are pytrees (:mod:`.signature`'s ``flatten_inputs``); ``out_layouts``
is a pytree prefix of the outputs. ``predict`` caches its result per function object,
input specs and options (as ``jax.jit`` caches traces).

The same walker runs programs: :func:`execute` walks a Prediction's jaxpr again with
its choices and an :class:`Executor` (``apply``'s) that computes every equation under
the signature the walker gives it, and loops by walking their bodies inside
``lax.scan`` / ``while_loop`` / ``switch``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

import jax
from jax._src import source_info_util  # the user's source line of an equation, for errors
from jax._src.core import ShardingTypeError  # JAX's typing refusing code (jax 0.10.2: not public)
from jax.extend import core
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ..caches import Memo, cached, collector_paused
from ..errors import InferenceError, Placements2JaxError, UnsupportedOpError
from ..layout import Layout
from ..mesh import DeviceMesh
from .combine import (
    LOOPS, CombinedCollective, MovedEquation, PlannedCollective, combine, combiner_rules, lowered_step,
    move_computations, planned_collectives,
)
from .cost import ALL_REDUCE, CostModel, CostModelLike, Overhead, block_bytes, overhead_of, resolve_cost_model
from .frameworks import bind
from .ops import CALL_JAXPR_PARAMS, ELEMENTWISE_PRIMITIVES, PrimitiveDef, primitive_definition, registered_function
from .plan import FIRST_FIRST, LAST_FIRST, InputPlans, ReductionOrder, cached_plan, cached_plan_cost, mesh_all_reduce
from .program import ProgramGraph, ProgramNode, ValueId, forced_signature, select_program
from .regions import Region, RegionCollective, RegionMove, named_axes, region_collectives
from .rules import BATCH_PARTITIONED
from .select import signature_for
from .signature import (
    Aval,
    Candidate,
    RedistributePlan,
    RedistributeStep,
    SharedRoutes,
    Signature,
    TensorSpec,
    as_tensor_specs,
    constant_layouts,
    flatten_inputs,
    is_layout_leaf,
    output_constraints,
)
from .simplify import simplified
from .table import format_bytes, format_table

__all__ = ["ON_UNKNOWN", "EquationReport", "Executor", "Prediction", "execute", "predict"]

# ``custom_linear_solve`` (``jnp.linalg.solve`` / ``inv``) is walked as a call too: see :func:`called_jaxpr`
LINEAR_SOLVE = "custom_linear_solve"
# sharding constraints and the param holding the target sharding
CONSTRAINT_SHARDING_PARAMS = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}
# primitives whose outputs are their inputs, each keeping its layout
_PASS_THROUGH = ("optimization_barrier", "device_put")
# host callbacks for their effect alone (``jax.debug.print`` / ``jax.debug.callback``): no outputs. Without
# ``partitioned=True`` the callback sees the whole value, so XLA replicates its operands (an all-gather per split
# operand, every partial reduced); with it, each device's own shard, so only partials are reduced
DEBUG_EFFECTS = ("debug_print", "debug_callback")
# host callbacks with results (``jax.pure_callback``, ``jax.experimental.io_callback``, ordered or not, any
# ``vmap_method``): XLA gathers their operands to every device (an all-gather per split operand, partials reduced),
# runs the callback on one device (device 0, or the ``sharding=`` SingleDeviceSharding's) and, where the program
# reads a result, broadcasts it as an all-reduce over the whole mesh of a select that is the result on that device
# and zeros elsewhere (jax 0.10.2's compiled HLO on dp=2 x tp=4). The walker's model is that: each result made
# Partial(sum) over every mesh dim, moved at once to Replicate (one all-reduce over the mesh: a row of its own), but
# a result nothing reads, which XLA broadcasts to nobody. One the program returns as it is XLA keeps on its device;
# the prediction makes it Replicate, as apply does (check's verdict "xla kept on one device", docs/inference.md)
HOST_CALLBACKS = ("pure_callback", "io_callback")
# what predict does at a primitive without a rule
ON_UNKNOWN = ("raise", "replicate")
# the rows of moves across a loop's or cond's bodies' boundaries (their routes go to the executor)
_BOUNDARY_MOVES = ("scan carry", "while carry", "scan ys", "cond join", "while predicate")
# rounds of the fixed point over a loop's carry layouts before falling back to the initial ones
_FIXED_POINT_ROUNDS = 4
# rounds of carry re-solving after the program search (each walks and searches the program again)
_CARRY_ROUNDS = 2
# a loop's other carry options the program search tries from its best choice (each descends again), at most
_CARRY_SEEDS = 1
# the least share of a kept result's bytes (after XLA's combiner) that all-gathers and all-to-alls over the mesh's
# first dim move for _replicas_restart to run. A threshold fitted to measured programs (stop 31, main 6f56e16): the
# restart was kept where that share was 0.48-0.89 (the Megatron MLP step, the 4x2 and batch-8 (8,) Llama adamw
# steps, test_operators' 4-layer GPT-2 scan step, test_inference_carry's residual_scan gradient on (8,)) and not
# kept at 0.11-0.45 (Llama's 2x4 adamw step 0.32, its value_and_grad 0.35, the 4-layer Llama 0.32, Llama on (8,)
# 0.35, Equinox's 0.11 / 0.17, the sort-dispatched MoE 0.45) and at 0.62 / 0.71 (GPT-2's 4x2 and (8,) steps, still
# run). Skipping it below 0.4 leaves Llama's 2x4 adamw step's cold predict at main's (the restart was 2.1-2.6 s
# CPU there, load ~7, and kept nothing). Both shares leave out the gathers every replica makes too (stop 44,
# _replicas_restart's docstring).
_RESTART_SHARE = Fraction(2, 5)
# carry options of a loop (its program node's candidates), at most
_CARRY_OPTIONS = 16


@dataclass(frozen=True, init=False)
class EquationReport:
    """One equation of the walked jaxpr: its inputs' layouts, the signature chosen (None
    for a call, whose equations follow with a deeper ``path``), its outputs' layouts; for a
    ``shard_map`` region, what its body sends itself (:mod:`.regions`)."""

    path: str
    primitive: str
    inputs: tuple[TensorSpec, ...]
    signature: Signature | None
    outputs: tuple[TensorSpec, ...]
    sources: tuple[ValueId | None, ...] = ()  # the value each input is (None: a literal or constant)
    region: Region | None = None

    def __init__(
        self, path: str, primitive: str, inputs: tuple[TensorSpec, ...], signature: Signature | None,
        outputs: tuple[TensorSpec, ...], sources: tuple[ValueId | None, ...] = (),
        region: Region | None = None,
    ) -> None:
        # one dict update, not a frozen __setattr__ per field (every walk reports every equation: half the time of
        # building a row)
        self.__dict__.update(path=path, primitive=primitive, inputs=inputs, signature=signature, outputs=outputs,
                             sources=sources, region=region)

    @property
    def depth(self) -> int:
        return self.path.count(".")

    @property
    def steps(self) -> tuple[tuple[int, RedistributeStep], ...]:
        """(input index, step) for every redistribution step this equation needs (none over
        one device: see :attr:`Prediction.steps`)."""
        if self.signature is None:
            return ()
        return tuple(
            (i, s) for i, plan in enumerate(self.signature.redistributions) for s in plan.steps if not s.over_one_device
        )

    @property
    def cost(self) -> Fraction:
        return self.signature.cost if self.signature is not None else Fraction(0)


@dataclass(frozen=True)
class Prediction:
    """The predicted layouts of a function's outputs and the per-equation report.

    ``inputs`` and ``outputs`` are flat (``jax.tree.leaves`` order of the arguments and
    of the function's result); ``in_tree`` / ``out_tree`` rebuild their structures.
    ``outputs`` are the layouts after ``out_layouts`` (the last rows, ``out_layouts``,
    move the outputs that needed it; ``constrained`` says which outputs had one);
    ``out_layouts_tree`` gives them the result's structure. ``search`` says how the
    signatures were chosen (see :func:`predict`).

    ``policy`` says how the redistributions are priced (see :func:`predict`): ``None``
    as XLA's reshard in a plain ``jax.jit`` program (the planner's steps); a redistribute
    policy as the schedules placements2jax runs (``schedules``): then ``nbytes``,
    ``cost`` and ``collectives`` are the schedules' compiled collectives.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    equations: tuple[EquationReport, ...]
    out_tree: Any
    in_tree: Any = None
    constrained: tuple[bool, ...] = ()
    search: str = "eager"  # how the signatures were chosen: "eager", "program" or "torch"
    policy: Any = None  # how redistributions are priced: None (XLA's reshard) or a redistribute policy
    cost_model: CostModel | None = None  # the model the prediction was priced by (None: the default model)
    # what :func:`execute` needs to walk the same equations again with an executor: the
    # traced jaxpr and the search's choices (path -> candidate; empty for eager)
    jaxpr: Any = dataclasses.field(default=None, repr=False, compare=False)
    choices: tuple[tuple[str, Candidate], ...] = dataclasses.field(default=(), repr=False, compare=False)
    on_unknown: str = dataclasses.field(default="raise", repr=False, compare=False)
    # the value each output is (before its out_layouts move; None: a literal or constant), for
    # the dataflow of moves after the program (check's conversions to XLA's layouts)
    output_sources: tuple[ValueId | None, ...] = dataclasses.field(default=(), repr=False, compare=False)
    # the loops XLA compiles as loops, (path, primitive): each body a computation of the combiner's own
    # (:func:`.combine.planned_collectives`; a scan of one trip is not among them, XLA inlines it)
    loops: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False, compare=False)
    # (a one-trip scan's result, the value it is in the body): as :attr:`.ProgramGraph.returned`
    returned: tuple[tuple[ValueId, ValueId | None], ...] = dataclasses.field(default=(), repr=False, compare=False)
    # per scan XLA compiles as a loop, what its body returns: as :attr:`.ProgramGraph.results`
    results: tuple[tuple[str, tuple[tuple[str, ValueId | None], ...]], ...] = dataclasses.field(
        default=(), repr=False, compare=False)
    # (a scan's slice of a scanned operand, as its body reads it; the operand it slices)
    sliced: tuple[tuple[ValueId, ValueId | None], ...] = dataclasses.field(default=(), repr=False, compare=False)
    # what else its walk ranked by, for :func:`execute`'s walk: the mesh dims it splits nothing over
    # (:func:`_idle_mesh_dims`) and its candidates ranked unsplit first (:func:`_unsplit_first`; a restart's search
    # that changes nothing returns its walk, ``choices`` empty)
    idle: tuple[int, ...] = dataclasses.field(default=(), repr=False, compare=False)
    unsplit: _Unsplit | None = dataclasses.field(default=None, repr=False, compare=False)
    # per free output of the program search, the layout its caller takes it in: what the search charged its move to
    # (:mod:`.program`'s objective; None elsewhere, and empty for eager)
    callers: tuple[Layout | None, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def out_layouts_tree(self) -> Any:
        """The outputs' layouts in the structure of the function's result."""
        return jax.tree.unflatten(self.out_tree, self.out_layouts)

    @property
    def out_layouts(self) -> tuple[Layout, ...]:
        return tuple(s.layout for s in self.outputs)

    @property
    def redistributions(self) -> tuple[RedistributePlan, ...]:
        """Every planned redistribution. Chosen for the whole program, one per value and
        layout where its moves see each other (:func:`.combine.move_computations`):
        consumers needing a value in the same layout share it (a compiled program computes
        it once); eager dispatch runs each equation's own."""
        plans, seen = [], set()
        for source, plan, within in self._moves():
            if plan.is_noop or (self.search == "program" and source is not None
                                and any((source, where, plan.dst) in seen for where in within)):
                continue
            seen.add((source, within[0], plan.dst))
            plans.append(plan)
        return tuple(plans)

    def _moves(self) -> Iterator[tuple[ValueId | None, RedistributePlan, tuple[str, ...]]]:
        """Every equation's redistributions in program order, each with the value it moves
        (None: a literal or constant) and where it runs, then the computations whose moves
        it sees (:func:`.combine.move_computations`)."""
        within = move_computations(dict(self.loops))
        for eqn in self.equations:
            if eqn.signature is not None:
                for i, plan in enumerate(eqn.signature.redistributions):
                    source = eqn.sources[i] if i < len(eqn.sources) else None
                    yield source, plan, within(eqn.path, source) if not plan.is_noop else ("",)

    @property
    def steps(self) -> tuple[RedistributeStep, ...]:
        """The redistributions' steps (a value's routes sharing their first steps under the
        whole-program search: :meth:`routed_steps`), but those over one device (a size-1
        mesh dim: they move nothing and compile to nothing,
        :attr:`.RedistributeStep.over_one_device`)."""
        return tuple(step for step in self._routed_steps if not step.over_one_device)

    @cached_property
    def _routed_steps(self) -> tuple[RedistributeStep, ...]:
        return self.routed_steps()

    def routed_steps(
        self, extra: Iterable[tuple[ValueId | None, RedistributePlan]] = ()
    ) -> tuple[RedistributeStep, ...]:
        """Every redistribution's steps the compiled program runs, then those of the
        ``extra`` (value, plan) moves after the program (:func:`~.check.check`'s conversions of
        outputs to XLA's layouts): chosen for the whole program, a value's moves whose
        routes begin alike run those first steps once where they see each other
        (:class:`.SharedRoutes`, the walk
        :func:`.combine.planned_collectives` counts too); eager dispatch runs each
        equation's own."""
        return tuple(step for _, step in self.routed_moves(extra))

    def routed_moves(
        self, extra: Iterable[tuple[ValueId | None, RedistributePlan]] = ()
    ) -> tuple[tuple[RedistributePlan, RedistributeStep], ...]:
        """:meth:`routed_steps`, each with the plan it is a step of (its value's shape and
        element type)."""
        routes = SharedRoutes(self.search == "program")
        moves = itertools.chain(self._moves(), ((source, plan, ("",)) for source, plan in extra))
        return tuple(
            (plan, step) for source, plan, within in moves
            for _, step, runs in routes.steps(source, plan, within) if runs
        )

    @cached_property
    def schedules(self) -> tuple[Any, ...]:
        """Per redistribution, the :class:`~placements2jax.schedules.Schedule` that
        ``policy`` runs for it (empty when ``policy`` is None: XLA's reshard, priced by
        the planner's steps). Each is compiled once to read its collectives."""
        if self.policy is None:
            return ()
        from ..schedules import redistribute_schedule  # inference prices what redistribute runs

        return tuple(
            redistribute_schedule(p.shape, p.dtype, p.src, p.dst, self.policy) for p in self.redistributions
        )

    @cached_property
    def region_collectives(self) -> tuple[RegionCollective, ...]:
        """What the ``shard_map`` regions' bodies send themselves (``psum``, ``all_gather``,
        ...: :mod:`.regions`), in program order: the program's communication besides its
        redistributions, fixed by the code (the search chooses nothing inside a region)."""
        return tuple(c for e in self.equations if e.region is not None for c in e.region.collectives)

    @property
    def cost(self) -> Fraction:
        """The weighted bytes of the redistributions: each step's bytes times its mesh
        dim's weight; under a policy, each collective's bytes times the largest weight of
        its mesh dims; and so each of the :attr:`region_collectives`."""
        model = resolve_cost_model(self.cost_model)
        regions = self._region_cost(model)
        if self.policy is not None:
            return regions + sum(
                (nbytes * max((model.weight(s.src.layout.mesh, m) for m in axes), default=Fraction(1))
                 for s in self.schedules for axes, nbytes in s.terms),
                Fraction(0),
            )
        return regions + sum((step.cost for step in self._routed_steps), Fraction(0))

    def _region_cost(self, model: CostModel) -> Fraction:
        """The :attr:`region_collectives`' bytes, each times the largest weight of its mesh axes."""
        if not self.region_collectives:
            return Fraction(0)
        mesh = (*self.inputs, *self.outputs)[0].layout.mesh
        return sum(
            (c.nbytes() * max((model.weight(mesh, mesh.axis_names.index(a)) for a in c.axes), default=Fraction(1))
             for c in self.region_collectives),
            Fraction(0),
        )

    @property
    def nbytes(self) -> Fraction:
        """Bytes each device sends (under a policy: the schedules', averaged over devices),
        the :attr:`region_collectives`' included."""
        regions = sum((c.nbytes() for c in self.region_collectives), Fraction(0))
        if self.policy is not None:
            return regions + sum((s.nbytes for s in self.schedules), Fraction(0))
        return regions + sum((s.nbytes for s in self.steps), Fraction(0))

    @property
    def lowered_nbytes(self) -> Fraction:
        """Bytes each device sends with the planner's steps compiled as the mesh's backend
        compiles them (:func:`.combine.lowered_step`): on CPU, which forms no
        reduce-scatter, each reduce-scatter counts the all-reduce XLA sends instead (twice
        its bytes), and a ``bfloat16`` collective the ``float32`` one XLA sends (twice its
        bytes); elsewhere :attr:`nbytes` (without a policy). What a compiled program
        of this prediction sends, as :func:`~.check.check` counts the predicted side."""
        return self._lowered_with()

    def _lowered_with(self, extra: Iterable[tuple[ValueId | None, RedistributePlan]] = ()) -> Fraction:
        """:attr:`lowered_nbytes` with ``extra`` moves at the end of the program, as
        :meth:`routed_moves` takes them."""
        rules = combiner_rules(self._backend)
        return sum(
            (nbytes for plan, s in self.routed_moves(extra) if not s.over_one_device
             for _, nbytes in lowered_step(s, rules, plan.dtype)),
            sum((c.nbytes(rules.widening(c.dtype)) for c in self.region_collectives), Fraction(0)),
        )

    @property
    def collectives(self) -> Counter[str]:
        """Steps per kind over the whole function (local ones included, none over one
        device: see :attr:`steps`); under a policy, the schedules' compiled collectives per
        kind; and the :attr:`region_collectives`."""
        regions = Counter(c.kind for c in self.region_collectives)
        if self.policy is not None:
            return regions + Counter(c.op for s in self.schedules for c in s.collectives)
        return regions + Counter(s.collective for s in self.steps)

    def combined(
        self, backend: str | None = None, extra: Sequence[tuple[ValueId, RedistributePlan]] = ()
    ) -> tuple[CombinedCollective, ...]:
        """The predicted collectives (the planner's steps, whatever ``policy``) as
        ``backend``'s XLA combiner merges them (:mod:`.combine`: independent collectives of
        one kind on the same mesh axes become one of several operands); ``backend``: a JAX
        platform name, default the mesh's; ``extra``: moves at the end of the program, as
        :meth:`planned_collectives` takes them (``check``'s conversions of the outputs)."""
        rules = combiner_rules(self._backend if backend is None else backend)
        return combine(self.planned_collectives(backend, extra), rules)

    def planned_collectives(
        self, backend: str | None = None, extra: Sequence[tuple[ValueId, RedistributePlan]] = ()
    ) -> tuple[PlannedCollective, ...]:
        """The predicted collectives as ``backend``'s XLA compiles them, before its combiner
        (:func:`.combine.planned_collectives` of the rows' moves, routes shared as the
        whole-program search plans them; ``extra``: moves at the end, whose routes continue
        the program's); ``backend``: a JAX platform name, default the mesh's."""
        rules = combiner_rules(self._backend if backend is None else backend)
        moved = (MovedEquation(e.path, e.sources, e.signature.redistributions if e.signature is not None else (),
                               e.primitive == "out_layouts", e.region) for e in self.equations)
        return planned_collectives(moved, rules, extra, loops=self.loops, returned=self.returned,
                                   shared_routes=self.search == "program", outputs=self.output_sources,
                                   results=self.results)

    @property
    def combined_counts(self) -> Counter[str]:
        """Collectives per kind after XLA's combiner on the mesh's platform (what a
        compiled program of this prediction counts; :attr:`collectives` counts operands,
        and on CPU keeps reduce-scatters, which CPU XLA compiles as all-reduces)."""
        return Counter(c.kind for c in self.combined())

    @cached_property
    def output_reductions(self) -> tuple[RedistributePlan | None, ...]:
        """Per output, the plan reducing its partials (to its layout ``without_partial``;
        None where it has none), in the order :attr:`reduction_orders` chose: how
        :func:`~.check.check` converts it where XLA reduces it inside the program, and how
        :func:`~placements2jax.operators.pinned_function` returns it."""
        return tuple(self._reduction(out, order) if order is not None else None
                     for out, order in zip(self.outputs, self.reduction_orders))

    @cached_property
    def reduction_orders(self) -> tuple[ReductionOrder | None, ...]:
        """Per output partial over some mesh dims, the order its reduction
        (:attr:`output_reductions`) takes them in (None: no partial): the planner's, the
        last mesh dim first (:data:`.plan.LAST_FIRST`, XLA's own order), but for an
        output whose reduction planned first mesh dim first (:data:`.plan.FIRST_FIRST`,
        its all-reduces in the other order: :meth:`_reordered`) leaves fewer collectives after XLA's combiner at no more bytes (every output's
        reduction counted at the end of the program; tried one output at a time, in
        order). Gemma-2's adamw step (docs/benchmarks.md section 14): its loss, partial
        over ``dp`` and ``tp``, reduced ``tp`` first has its ``dp`` all-reduce join the
        gradients' ``dp`` group, and its ``tp`` one, made before that group, can join no
        later ``tp`` all-reduce (the gradient norm's would close a cycle); reduced ``dp``
        first, as XLA compiles it, its ``tp`` all-reduce joins the final group of
        scalars' (15 -> 14 collectives after the combiner, XLA's count)."""
        orders: list[ReductionOrder | None] = [LAST_FIRST if out.layout.has_partial else None for out in self.outputs]
        reordered = [i for i, out in enumerate(self.outputs) if out.layout.has_partial and self._reordered(out)]
        if not reordered:
            return tuple(orders)
        sources = self.output_sources or (None,) * len(self.outputs)

        def counted(trial: Sequence[ReductionOrder | None]) -> tuple[int, Fraction]:
            extra = [(source, self._reduction(out, order))
                     for source, out, order in zip(sources, self.outputs, trial) if order is not None]
            return len(self.combined(extra=extra)), self._lowered_with(extra)

        best = counted(orders)
        for i in reordered:
            trial = [*orders[:i], FIRST_FIRST, *orders[i + 1:]]
            count, nbytes = counted(trial)
            if count < best[0] and nbytes <= best[1]:
                orders, best = trial, (count, nbytes)
        return tuple(orders)

    def _reordered(self, out: TensorSpec) -> bool:
        """Whether ``out``'s reduction planned first mesh dim first is all-reduces alone,
        other than the planner's: the same collectives in another order (each an
        all-reduce of the same block, the same bytes), which the pinned program then runs
        step by step (:func:`.combine.stepped`). A route through reduce-scatters is not
        reordered: run as one constraint, XLA compiles its own all-reduces there
        (tests/test_inference_check.py)."""
        first = self._reduction(out, FIRST_FIRST)
        return (all(step.collective == ALL_REDUCE for step in first.steps if step.communicates)
                and first.steps != self._reduction(out, LAST_FIRST).steps)

    def _reduction(self, out: TensorSpec, order: ReductionOrder) -> RedistributePlan:
        """The plan reducing ``out``'s partials in ``order``."""
        model = self.cost_model or resolve_cost_model(None)
        return cached_plan(out.shape, out.dtype, out.layout, out.layout.without_partial(), model, 0, order)

    @property
    def _backend(self) -> str:
        return self.inputs[0].layout.mesh.devices.flat[0].platform if self.inputs else "cpu"

    def __str__(self) -> str:
        rows = []
        for eqn in self.equations:
            sent = eqn.region.collectives if eqn.region is not None else ()
            moves = "; ".join([*(f"in{i} {s}" for i, s in eqn.steps), *(f"body {c}" for c in sent)])
            outs = " ; ".join(str(s) for s in eqn.outputs)
            ins = " ; ".join(str(s.layout) for s in eqn.inputs)
            rows.append((eqn.path, "  " * eqn.depth + eqn.primitive, ins, outs, moves, format_bytes(eqn.cost)))
        table = format_table(("eqn", "primitive", "inputs", "outputs", "redistribution", "cost"), rows)
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.collectives.items())) or "none"
        outs = " ; ".join(str(s) for s in self.outputs)
        priced = "" if self.policy is None else (
            f" (schedules under policy {self.policy!r}: {', '.join(s.name for s in self.schedules) or 'none'})"
        )
        return (
            f"{table}\noutputs: {outs}\n"
            f"communication{priced}: {kinds}; {format_bytes(self.nbytes)} B per device, cost {format_bytes(self.cost)}"
        )


SEARCHES = ("program", "eager", "torch")
# JAX's error where a shard_map over Explicit mesh axes meets operands typed otherwise than its in_specs: predict traces
# with shape/dtype stand-ins (no sharding types), so every such in_specs but a replicated one meets it
_SHARD_MAP_TYPES = "in_specs passed to shard_map"


def predict(
    fn: Callable[..., Any],
    *inputs: Any,
    mesh: DeviceMesh | None = None,
    cost_model: CostModelLike = None,
    search: str = "program",
    out_layouts: Any = None,
    on_unknown: str = "raise",
    policy: Any = None,
) -> Prediction:
    """Trace ``fn`` on ``inputs`` and propagate layouts through every equation.

    ``inputs`` are pytrees (dicts, lists, NamedTuples, dataclasses, registered classes)
    whose leaves are DTensors, ``(shape, dtype, layout)`` tuples, TensorSpecs, plain
    ``jax.Array``s (their own ``NamedSharding`` on the mesh, else Replicate), NumPy
    arrays, Python scalars (weakly typed) or PRNG keys (typed or raw; Replicate).
    Keyword arguments of ``fn`` are not traced: bind them with ``functools.partial``.
    An Equinox module's non-array leaves (its activation function, Python numbers) are
    static, as ``eqx.filter_jit`` makes them; Flax NNX modules updated in place by
    ``fn`` (``optimizer.update(model, grads)``) make the prediction's outputs
    ``(result, {path: updated Variable value})``, the updates keeping their layouts
    (:mod:`.frameworks`).

    ``out_layouts``: a pytree prefix of ``fn``'s result giving, per output (or subtree),
    a Layout, placements (with ``mesh``), something with a ``.layout`` (a DTensor: "keep
    this input's layout", e.g. ``out_layouts=(params, opt_state, None)`` for a train
    step returning updated parameters and optimizer state), a constant (an input passed
    back, such as the plain step count of ``optimizer.init(params)``: the layout it has
    as an input, its ``NamedSharding`` on the mesh or Replicate) or ``None`` (free). The
    search plans for them (they are fixed outputs of the program); outputs that still
    need it are moved at the end (rows ``out.<i>``).

    ``search="program"`` (the default) chooses every equation's signature together, to
    minimize the communication of the whole program (:mod:`.program`: OneFlow's graph-mode
    SBP inference, Alpa's intra-operator pass). ``search="eager"`` chooses each equation's
    signature on its own given its inputs' layouts, as torch's eager DTensor dispatch
    does op by op, by our cost model. ``search="torch"`` (needs torch) walks op by op with
    torch 2.13's own dispatcher's choice for every equation it maps onto an aten op
    (``infer_signature(..., search="torch")``: matmul, elementwise ops, sums and maxima,
    transpose, reshape); the others take the eager choice. Layouts fixed by the code (annotations, ``shard_map``)
    are single-candidate rows both searches respect; loops' carries are the program
    search's to choose (the others keep the walk's fixed point).

    ``on_unknown="raise"`` (default): a primitive without a rule raises
    :class:`UnsupportedOpError` naming it and the source line; ``"replicate"`` runs it
    on Replicate inputs and outputs (its report row says so) and goes on.

    ``policy`` says what runs each redistribution, and so how it is priced. ``None``
    (the default): XLA's reshard, as a plain ``jax.jit`` of ``fn`` compiles it -- what
    :func:`check` compares against; the planner's steps price it (no compilation). A
    redistribute policy (``"cost"``, ``"min_bytes"``, ``"xla"`` or a CostModel, as in
    ``DTensor.redistribute(policy=)``): the schedule that policy runs in code
    placements2jax executes (``redistribute``); ``Prediction.schedules`` holds them and
    ``nbytes`` / ``cost`` / ``collectives`` are their compiled collectives (each move is
    compiled once; ``"xla"`` gives what this backend's XLA compiles for the reshard,
    e.g. an all-reduce and a slice for Partial -> Shard on CPU). The signatures are
    chosen with the planner's prices either way (pricing every candidate move by a
    compiled schedule would compile thousands of programs).
    """
    if policy is not None:
        from ..schedules import check_policy  # validated here, used by Prediction.schedules

        policy = check_policy(policy)
    if not callable(fn):
        raise InferenceError("fn", fn, "not callable", "pass a function of the input tensors")
    if search not in SEARCHES:
        raise InferenceError("search", search, "unknown search", f"use one of {SEARCHES}")
    if on_unknown not in ON_UNKNOWN:
        raise InferenceError("on_unknown", on_unknown, "unknown fallback", f"use one of {ON_UNKNOWN}")
    fn, inputs, out_layouts = bind(fn, inputs, out_layouts, "inputs")  # Equinox statics, nnx in-place updates
    flat = flatten_inputs(inputs, mesh)
    specs, mesh = flat.specs, flat.mesh
    out_layouts = constant_layouts(out_layouts, mesh)
    model = resolve_cost_model(cost_model)
    key = _prediction_key(fn, flat, model, search, out_layouts, on_unknown, policy)
    prediction = _predictions.recall(key)
    if prediction is None:
        with collector_paused():
            prediction = _predict(fn, flat, model, search, out_layouts, on_unknown, policy)
        _predictions.remember(key, prediction)
    return prediction


# predict's results, as jax.jit caches its traces: per function object, input specs and
# structure, cost model and options (Predictions are immutable)
_predictions = Memo(256)


def _prediction_key(
    fn: Callable[..., Any], flat: Any, model: CostModel, search: str, out_layouts: Any, on_unknown: str, policy: Any
) -> tuple[Any, ...]:
    """The cache key of a predict call (unhashable parts make it a miss, never stored),
    with the mesh context the trace runs in (:func:`trace_context`)."""
    leaves, tree = jax.tree.flatten(out_layouts, is_leaf=is_layout_leaf)
    targets = tuple(
        leaf.layout if isinstance(getattr(leaf, "layout", None), Layout) and not isinstance(leaf, TensorSpec)
        else tuple(leaf) if isinstance(leaf, list) else leaf
        for leaf in leaves
    )
    return (fn, flat.specs, flat.tree, flat.weak, flat.mesh, model, search, on_unknown, policy, tree, targets,
            trace_context())


def trace_context() -> Any:
    """The mesh context a trace of user code depends on (``jax.set_mesh``'s abstract mesh;
    an empty one outside): ``jax.sharding.auto_axes``, ``reshard`` and ``out_sharding=P(...)``
    trace to resharding equations inside it and to nothing (or an error) outside, so a
    trace cached outside is not the function traced inside, as ``jax.jit``'s cache keys
    by it too. Before it was a key here, ``auto_axes(..., out_sharding=P("dp", None))``
    predicted outside and then inside ``set_mesh`` kept the unconstrained layout inside."""
    return jax.sharding.get_abstract_mesh()


# How JAX's explicit sharding ("sharding in types") refuses code inside ``jax.set_mesh`` of an Explicit mesh, as
# ``jax.jit`` there refuses it too: a ShardingTypeError where its typing finds an op ambiguous (contracting two dims
# split alike without ``out_sharding=``) and, JAX workaround (jax 0.10.2), a NotImplementedError where a primitive has
# no sharding rule ("Explicit sharding inference for ragged_dot_general is not currently implemented")
TYPING_REFUSALS: tuple[type[Exception], ...] = (ShardingTypeError, NotImplementedError)


def is_typing_refusal(err: Exception) -> bool:
    """Whether ``err`` (one of :data:`TYPING_REFUSALS`) is JAX's refusal inside an Explicit
    context, not the user's own NotImplementedError raised from ``fn``."""
    return in_explicit_context() and (isinstance(err, ShardingTypeError) or "sharding" in str(err).lower())


def typing_refusal(fn: Any, err: Exception, traced: bool = False) -> InferenceError:
    """Our error for ``fn`` refused by JAX's explicit sharding inside ``jax.set_mesh``
    (``err``, one of :data:`TYPING_REFUSALS`): the user's ``jax.jit`` of ``fn`` there is
    refused alike, so the fix is in ``fn`` or in where it is called. ``traced``: predict's
    untyped trace of ``fn`` succeeded (apply's op-by-op program runs it)."""
    return InferenceError(
        "fn", fn,
        f"JAX's explicit sharding refuses it inside jax.set_mesh, as jax.jit of fn there does "
        f"({type(err).__name__}: {str(err).splitlines()[0]})",
        "give the ops JAX's typing finds ambiguous an out_sharding=, or call it outside jax.set_mesh (XLA's "
        "propagation decides there)" + (
            "; apply(execute='ops') runs it op by op, as torch's DTensor dispatch" if traced else ""
        ),
    )


def in_explicit_context() -> bool:
    """Whether the caller runs inside ``jax.set_mesh`` of a mesh with Explicit axes, where
    ``jax.jit`` types ``fn``'s values by JAX's explicit-sharding rules (``out_sharding=``
    arguments are their layouts)."""
    context = trace_context()
    return not context.empty and AxisType.Explicit in context.axis_types


def _typed_trace(fn: Callable[..., Any], flat: Any) -> tuple[Any, Any] | None:
    """``fn`` traced on its inputs typed by their layouts (:meth:`.FlatInputs.structs`),
    as ``jax.jit`` traces it inside ``jax.set_mesh`` of a mesh with Explicit axes: there
    JAX types every value of the program by its sharding rules (``out_sharding=`` and
    ``reshard`` among them) over the Explicit axes and compiles each value in its type,
    so that the types are the layouts the walk takes over them (:attr:`_Walker.typed`;
    the Auto axes are XLA's choice, and the search's). None where the context is not such
    a mesh (no ``set_mesh``, every axis Auto), not the inputs' mesh (its names, sizes and
    axis types), an input has a layout no type says (a partial, a strided shard), or
    JAX's typing refuses ``fn`` (Auto-style code contracting a split dim without
    ``out_sharding``, which ``jax.jit`` there refuses too): then the untyped trace, whose
    explicit annotations alone are read (:func:`_explicit_out_sharding`)."""
    context, mesh = trace_context(), flat.mesh
    if (not in_explicit_context() or tuple(context.axis_names) != mesh.axis_names
            or tuple(context.axis_sizes) != mesh.shape or tuple(context.axis_types) != mesh.axis_types):
        return None
    if any(s.layout.is_strided or s.layout.has_partial for s in flat.specs):
        return None
    try:
        return jax.make_jaxpr(flat.call(fn), return_shape=True)(*flat.structs(typed=True))
    except Placements2JaxError:
        raise
    except (TypeError, ValueError, *TYPING_REFUSALS):
        return None


def _predict(
    fn: Callable[..., Any], flat: Any, model: CostModel, search: str, out_layouts: Any, on_unknown: str,
    policy: Any,
) -> Prediction:
    specs, mesh = flat.specs, flat.mesh
    try:
        closed, out_shape = _typed_trace(fn, flat) or jax.make_jaxpr(flat.call(fn), return_shape=True)(*flat.structs())
    except Placements2JaxError:
        raise
    except TYPING_REFUSALS as err:  # the untyped trace too: JAX types ragged_dot_general by none of its operands
        if not is_typing_refusal(err):
            raise
        raise typing_refusal(fn, err) from None
    except (TypeError, ValueError) as err:
        if _SHARD_MAP_TYPES in str(err):
            raise InferenceError(
                "fn", fn, f"holds a jax.shard_map over a mesh with Explicit axes, whose in_specs JAX checks against "
                f"its operands' sharding types, which predict's trace does not give them ({type(err).__name__}: {err})",
                "give that shard_map a mesh with Auto axes (the same devices and names, e.g. "
                "init_device_mesh(..., axis_types='auto').to_jax()): predict and apply take its in_specs and out_specs "
                "as fixed layouts",
            ) from None
        raise InferenceError(
            "fn", fn, f"tracing it on {_shapes_text(specs)} failed ({type(err).__name__}: {err})",
            "make fn traceable on tensors of these shapes and dtypes, as jax.jit of it on them would need (e.g. "
            "matching matmul dims; a shard_map's mesh the context's; lax.scan where reverse-mode crosses a loop)",
        ) from None
    # as XLA partitions it (zero-size values, constant conds, dead code) and arg-reductions as their reductions, but
    # in torch's walk (:mod:`.simplify`) and in an untyped trace run where values have types (inside set_mesh of an
    # Explicit mesh: apply's programs would mix the call's untyped positions with the typed operand, which JAX refuses)
    typed = _is_typed(closed.jaxpr)
    closed = simplified(closed, arg_reductions=search != "torch" and (typed or not in_explicit_context()))
    out_tree = jax.tree.structure(out_shape)
    out_avals = [Aval(x.shape, x.dtype) for x in jax.tree.leaves(out_shape)]
    targets = output_constraints(out_layouts, out_tree, out_avals, mesh)
    consts = _const_specs(closed.jaxpr, mesh)
    idle = () if typed else _idle_mesh_dims(closed.jaxpr, mesh, specs, targets)

    def walk(
        choices: Mapping[str, Candidate], gathered: bool = search != "program", unsplit: _Unsplit | None = None,
    ) -> tuple[Prediction, ProgramGraph, _Walker]:
        walker = _Walker(mesh, model, choices, on_unknown, gathered=gathered, searched=not gathered, unsplit=unsplit,
                         idle=idle, typed=typed)
        outputs = walker.walk(closed.jaxpr, consts, specs, "", [("in", i) for i in range(len(specs))])
        graph = walker.graph(outputs, specs)
        finals = [
            (spec, source) if target is None else walker.move("out_layouts", f"out.{i}", spec, source, target)
            for i, ((spec, source), target) in enumerate(zip(outputs, targets))
        ]
        moved = [spec for spec, _ in finals]
        output_sources = tuple(source for _, source in finals)
        prediction = Prediction(
            specs, tuple(moved), tuple(walker.rows), out_tree,
            in_tree=flat.tree, constrained=tuple(t is not None for t in targets), search=search,
            policy=policy, cost_model=model,
            jaxpr=closed, choices=tuple(choices.items()), on_unknown=on_unknown, output_sources=output_sources,
            loops=graph.loops, returned=graph.returned, results=graph.results, sliced=tuple(walker.sliced.items()),
            idle=idle, unsplit=unsplit,
        )
        return prediction, graph, walker

    if search == "torch":
        return walk(_torch_walk(closed, consts, specs, mesh, model, on_unknown))[0]
    eager, graph, walker = walk({})
    if search == "eager":
        return eager
    # eager dispatch's walk (predict(search="eager")), the bound of the search's bytes: the program's walk ranks
    # otherwise (select.signature_for) and from some equation on may choose what eager dispatch does not
    # and the layouts its free outputs come in, partials reduced: what the search charges a free output the move to,
    # but for one updating inputs of its shape, their layout (_updated_layouts)
    dispatching, dispatched, _ = walk({}, True)
    callers = tuple(
        None if target is not None else (updated or out.layout).without_partial()
        for out, target, updated in zip(dispatching.outputs, targets, _updated_layouts(closed.jaxpr, specs))
    )
    charged_to = _Targets(tuple(targets), callers)
    searched = _resolve_carries(
        walk, (eager, graph, walker), model, charged_to, dispatched, _total(dispatching, model, charged_to)[0]
    )
    return dataclasses.replace(searched, callers=callers)


# the inputs an error message lists by shape and dtype, at most (a training step has hundreds)
_LISTED_INPUTS = 8


def _shapes_text(specs: Sequence[TensorSpec]) -> str:
    """The inputs' shapes and dtypes for a message: all of a few, else the first
    :data:`_LISTED_INPUTS` and how many more."""
    shown = ", ".join(str(s.aval) for s in specs[:_LISTED_INPUTS])
    more = len(specs) - _LISTED_INPUTS
    return f"inputs [{shown}]" if more <= 0 else f"its {len(specs)} inputs [{shown}, ... {more} more]"


def _updated_layouts(jaxpr: core.Jaxpr, specs: Sequence[TensorSpec]) -> tuple[Layout | None, ...]:
    """Per output of ``jaxpr`` (its inputs ``specs``), the layout of the inputs it updates:
    where the inputs of the output's shape reached back from it through elementwise
    equations (on operands of that shape: a broadcast scalar is no source of its layout)
    all have one layout, that one; else None. XLA's propagation lays such an output out as
    those inputs (an optimizer's parameter ``p + u`` and moments ``b * m + (1 - b) * g``,
    the gradients in them laid out as the parameter too), whatever layout eager dispatch
    leaves it in, and a free output's caller takes it so (the Megatron MLP adamw step,
    every output free: eager dispatch reduce-scatters the weights' gradients over ``dp``
    into the update and returns the parameters and moments split there, where XLA
    all-reduces the gradients and returns the parameters' layouts). Calls (``jax.jit``
    around the step, as training loops write it; custom derivatives, remat) are seen
    through: an output of a call reaches what its body's output reaches; not a call of a
    function with a registered rule, which is one equation (its rule says what it does)."""
    indexes: dict[int, tuple[dict[Any, Any], dict[Any, int]]] = {}
    layouts = []
    for out in jaxpr.outvars:
        reached = set() if isinstance(out, core.Literal) else {
            specs[i].layout for i in _updated_inputs(jaxpr, out, indexes)
        }
        layouts.append(reached.pop() if len(reached) == 1 else None)
    return tuple(layouts)


def _updated_inputs(
    jaxpr: core.Jaxpr, out: Any, indexes: dict[int, tuple[dict[Any, Any], dict[Any, int]]]
) -> set[int]:
    """The positions of ``jaxpr``'s inputs of ``out``'s shape that ``out`` reaches back
    through elementwise equations and calls' bodies (:func:`_updated_layouts`); ``indexes``
    keeps each jaxpr's producers and input positions by its id, built once per walk."""
    if id(jaxpr) not in indexes:
        indexes[id(jaxpr)] = ({v: eqn for eqn in jaxpr.eqns for v in eqn.outvars},
                              {v: i for i, v in enumerate(jaxpr.invars)})
    producers, positions = indexes[id(jaxpr)]
    reached: set[int] = set()
    seen, stack = {out}, [out]
    while stack:
        var = stack.pop()
        if var in positions:
            reached.add(positions[var])
        eqn = producers.get(var)
        if eqn is None:
            continue
        if eqn.primitive.name in ELEMENTWISE_PRIMITIVES:
            sources = [v for v in eqn.invars if not isinstance(v, core.Literal)]
        elif eqn.primitive.name in CALL_JAXPR_PARAMS and registered_function(eqn) is None:
            body = eqn.params[CALL_JAXPR_PARAMS[eqn.primitive.name]]
            body = getattr(body, "jaxpr", body)
            inner = body.outvars[eqn.outvars.index(var)]
            sources = [] if isinstance(inner, core.Literal) else [
                eqn.invars[i] for i in _updated_inputs(body, inner, indexes)
            ]
        else:
            continue
        for v in sources:
            if not isinstance(v, core.Literal) and v.aval.shape == out.aval.shape and v not in seen:
                seen.add(v)
                stack.append(v)
    return reached


Walk = Callable[..., tuple["Prediction", ProgramGraph, "_Walker"]]
Total = tuple[Fraction, int]
# per loop (by path), the layouts a walk starts its carries from
CarrySeeds = tuple[tuple[str, tuple[Layout, ...]], ...]


@dataclass(frozen=True)
class _Targets:
    """What the program search charges each output of the function: ``fixed``, the layout
    ``out_layouts`` gives it (None: free), and ``callers``, per free output, the layout its
    caller takes it in (eager dispatch's, its partials reduced, or the layout of the inputs it
    updates: :func:`_updated_layouts`; :mod:`.program`'s objective),
    the same for every search of one program (its restarts walk otherwise)."""

    fixed: tuple[Layout | None, ...]
    callers: tuple[Layout | None, ...]


def _searched(walk: Walk, walked: tuple[Prediction, ProgramGraph, _Walker], model: CostModel,
              targets: _Targets, dispatched: ProgramGraph | None = None) -> tuple[Prediction, _Walker]:
    """The program search on a walked program and the walk with its choice (``dispatched``:
    see :func:`.program.select_program`)."""
    searched = _searched_against(walk, walked, model, targets, dispatched)
    assert searched is not None  # an internal invariant: only a search with a rival is abandoned
    return searched


def _searched_against(
    walk: Walk, walked: tuple[Prediction, ProgramGraph, _Walker], model: CostModel, targets: _Targets,
    dispatched: ProgramGraph | None = None, rival: Prediction | None = None,
) -> tuple[Prediction, _Walker] | None:
    """:func:`_searched`, abandoned (None) where its descents end dearer than ``rival``'s
    choice (:func:`.program.select_program`'s ``rival``)."""
    eager, graph, walker = walked
    seeds = [(path, k) for path, loop in walker.loops.items() for k in loop.seeds]
    rival_layouts = () if rival is None else tuple((path, c.in_layouts, c.out_layouts) for path, c in rival.choices)
    choices = select_program(
        graph, model, targets.fixed, seeds[:_CARRY_SEEDS], dispatched, targets.callers, rival_layouts
    )
    if choices is None:
        return None
    if not choices:
        return eager, walker
    prediction, _, walker = walk(choices)
    return prediction, walker


def _total(prediction: Prediction, model: CostModel, targets: _Targets) -> Total:
    """What a prediction costs as the program search counts it: the redistributions and
    each free output's move to the layout its caller takes it in; then its number of steps."""
    owed = sum(
        (cached_plan_cost(o.shape, o.dtype, o.layout, caller, model)
         for o, caller in zip(prediction.outputs, targets.callers) if caller is not None),
        Fraction(0),
    )
    return prediction.cost + owed, len(prediction.steps)


def _charged(prediction: Prediction, model: CostModel, targets: _Targets) -> tuple[Fraction, Total]:
    """A prediction as the search's last descents price it: its moves' bytes and each free
    output's move to the layout its caller takes it in, routed as the search routes it
    (:func:`_owing`), plus the model's overhead per collective among them
    (``collective_overhead``); ties broken by :func:`_total`. The restarts from the carries
    as given are kept by it (:func:`_resolve_carries`): by bytes first, a sampling loop's
    restart lost to the first search by 20 B in 21 collectives after XLA's combiner where it
    has 7 (tests/models/decode.py). The other restarts compare by it among those within
    eager dispatch's bytes (:func:`_cheapest`). The conds' rejoins compare by :func:`_total`
    (compared by this function instead, cond programs of tests/test_inference_programs.py
    and a small step of tests/test_inference_program.py changed, one past eager dispatch's
    bytes).
    The owed moves were routed by the planner's bytes alone, their collectives then charged
    the overhead: the sampled tokens returned split over ``dp`` (``S(0),R``, as XLA returns
    them) owe their caller's ``R,S(0)`` (eager dispatch's) an all-to-all and an all-gather
    (36 B, 2 x 8,192 charged) where the search routes one all-gather (48 B, 8,192), and lost
    to gathering them inside the loop each iteration (48 B, 8,192). Routed so, the two tie
    (29,232 each) and :func:`_total` breaks the tie: 3,876 B where 3,888, 6 collectives after
    XLA's combiner where 7 (:func:`_carried_as_returned`)."""
    overhead = model.collective_overhead
    owing = [plan for _, plan in _owing(prediction, model, targets)]
    steps = [*prediction.steps, *(step for plan in owing for step in plan.steps)]
    charged = sum(overhead_of(overhead, step.collective) for step in steps if step.communicates)
    owed = sum((plan.cost for plan in owing), Fraction(0))
    return prediction.cost + owed + charged, _total(prediction, model, targets)


def _cheapest(
    found: list[Prediction], model: CostModel, targets: _Targets, dispatched_bytes: Fraction | None
) -> Prediction:
    """The first of ``found`` least by the search's objective (:func:`_charged`) among those
    sending, with their free outputs' moves, no more bytes than eager dispatch
    (``dispatched_bytes``: the overhead per collective trades bytes for fewer collectives,
    never beyond eager's bytes, as :func:`.program._bounded` keeps a search's choice); where
    none does, the least by :func:`_total`. By :func:`_total` alone (stop 60), a restart
    whose polished bytes went below the others' was kept dearer by the objective: the
    residual scan's gradient on 4x2 (tests/test_inference_carry.py) 15,808 B in 23 steps
    where 23,296 in 25, 91,456 where 81,984 by the objective."""
    within = [p for p in found if dispatched_bytes is None or _total(p, model, targets)[0] <= dispatched_bytes]
    if not within:
        return min(found, key=lambda prediction: _total(prediction, model, targets))
    return min(within, key=lambda prediction: _charged(prediction, model, targets))


def _resolve_carries(
    walk: Walk, walked: tuple[Prediction, ProgramGraph, _Walker], model: CostModel, targets: _Targets,
    dispatched: ProgramGraph | None = None, dispatched_bytes: Fraction | None = None,
) -> Prediction:
    """The program search, then its loops' carries re-solved from its own choice: while
    the chosen plan of some loop body returns its carries in other layouts than it carries
    them (moving them back every iteration), walk and search again with the carries
    started from the returned layouts (every other loop's from its chosen ones); at most
    ``_CARRY_ROUNDS`` rounds. Then, where the first search carries some value unsplit
    over a mesh dim its initial value is split over, from every loop's carries as given
    (:func:`_given_carries`), then as those searches' bodies return them, each search's
    choice also walked with its bodies kept and its carries as they return them
    (:func:`_carried_as_returned`). Then, per mesh
    dim over which the first search's choice
    splits some carry its initial value is not split over (a gradient accumulator
    reduce-scattered into shards every iteration, the optimizer then updating shards and
    gathering parameters and moments at the end), walk and search again with every loop's
    carries reduced and replicated over that mesh dim (:func:`_replicated_carries`: data
    parallelism's replicas, which no descent reaches from the sharded basin) and its
    constants split over it gathered (:func:`_replicated_constants`: the microbatches a
    ``fori_loop`` indexes), then from the carries as that search's bodies return them,
    reduced and unsplit over it (at most ``_CARRY_ROUNDS`` rounds), then from the cheapest
    of those restarts' carries with every loop body's equations ranking first their
    candidates unsplit over it (:func:`_unsplit_first`: the walk, the search's eager start,
    runs the bodies replicated over it wherever their inputs allow, as XLA runs a
    microbatch on every data-parallel replica), until one is cheaper than the first
    search. Keeps the
    cheapest prediction (:func:`_cheapest`: by the search's objective among those within
    eager dispatch's bytes ``dispatched_bytes``); the first search bounded by eager
    dispatch's walk ``dispatched``. The totals are found only when there are predictions to
    compare (most programs have no carries to re-solve)."""
    best, walker = _searched(walk, walked, model, targets, dispatched)
    first = walker
    found = [best]
    searched = walked[2].loops  # the loops as the search saw them (their carry options)
    tried: set[CarrySeeds] = set()
    for _ in range(_CARRY_ROUNDS):
        loops = walker.loops
        seeds = _returned_carries(loops)
        # returned layouts among the options the search chose from: nothing new to start from
        if seeds in tried or all(
            loop.returned_layouts == loop.carries
            or (path in searched and loop.returned_layouts in searched[path].options())
            for path, loop in loops.items()
        ):
            break
        tried.add(seeds)
        start = {path: dataclasses.replace(loop, carries=layouts).choice(model) for (path, layouts), loop in
                 zip(seeds, loops.values())}
        walked = walk(start)
        searched = walked[2].loops
        prediction, walker = _searched(walk, walked, model, targets)
        found.append(prediction)
    # then from the carries as given initially, and as those restarts' bodies return them: the walk resolves a
    # carry from what the body's eager choices return, and a sampling loop's token, given split over dp, came back
    # from its argmax split over tp (the cheapest move of the logits alone), a basin no descent leaves
    given = _given_carries(first.loops)
    given_found = [] if given is None else [
        found
        for prediction, walker in _carry_restarts(walk, model, targets, first.loops, given, _returned_carries, tried)
        for found in (prediction, *_carried_as_returned(walk, prediction, walker, model))
    ]
    # the first replicated restart cheaper than the first search ends them (each is a walk and a search: on the
    # stacked LM's accumulated steps, the tp restart after the dp one only doubled their cost, never cheaper)
    for mesh_dim in range(first.mesh.ndim):
        seeds = _replicated_carries(first.loops, mesh_dim)
        if seeds is None:
            continue
        constants = {
            f"{path}.const{i}": first.loops[path].constant_choice(i, layout, model)
            for path, i, layout in _replicated_constants(first.loops, mesh_dim)
        }
        # then from the layouts the restart's bodies return the carries in, reduced and unsplit over mesh_dim: the
        # restart's walk starts its bodies from the first search's other layouts (the fori_loop accumulation's head
        # gradient carried Replicate, returned split over (dp, tp)), which its search does not leave
        walked_restarts = _carry_restarts(
            walk, model, targets, first.loops, seeds,
            partial(_replicated_carries, mesh_dim=mesh_dim, returned=True), tried, constants,
        )
        restarts = [prediction for prediction, _ in walked_restarts]
        # then from the cheapest restart's carries with the loops' bodies computed replicated over mesh_dim too,
        # wherever their inputs allow it: the restarts' searches still ran the stacked LM's accumulated microbatch
        # split over dp (slicing is free; then all-gathers and all-to-alls), a basin their descents do not leave
        if restarts:
            _, cheapest = min(walked_restarts, key=lambda restart: _total(restart[0], model, targets))
            replicas = {path: loop.choice(model) for path, loop in cheapest.loops.items()}
            body = walk({**replicas, **constants}, unsplit=(tuple(first.loops), mesh_dim))
            restarts.append(_searched(walk, body, model, targets)[0])
        found += restarts
        if any(_total(prediction, model, targets) < _total(best, model, targets) for prediction in restarts):
            break
    if len(found) > 1:
        best = _cheapest(found, model, targets, dispatched_bytes)
    if given_found:  # kept where cheaper as the search prices (:func:`_charged`)
        charged, first = min((_charged(prediction, model, targets), i) for i, prediction in enumerate(given_found))
        if charged < _charged(best, model, targets):
            best = given_found[first]
    return _rejoin_conds(walk, _replicas_restart(walk, best, model, targets), model, targets)


def _replicas_restart(walk: Walk, best: Prediction, model: CostModel, targets: _Targets) -> Prediction:
    """``best`` or, where it all-gathers or all-to-alls over the mesh's first dim (data
    parallelism's by convention: ``init_device_mesh((dp, tp))``), the program walked with
    every equation's candidates unsplit over that mesh dim first (:func:`_unsplit_first`:
    a replica per coordinate of it wherever the inputs allow, as XLA runs data
    parallelism) and searched from there, kept where cheaper by the search's objective (or
    as cheap in fewer steps: the common descent, :func:`.program._commoned`, brought a small
    step's first search to the restart's objective, its free parameter update split over
    ``dp`` and moved back in 4 collectives after the combiner where the restart's has 2) in
    no more bytes as compiled (the objective prices by the planner: the unrolled
    residual_scan's gradient, 9,600 -> 10,368 B otherwise) and no more collectives, by
    operand and after XLA's combiner, each with its free outputs' moves to the layouts
    their callers take them in (:func:`_owing`, what the objective charges: a first
    search leaving a weight's gradient partial sends fewer bytes in the program, its
    all-reduce owed; the Megatron MLP step at tests/test_inference_program.py's sizes,
    whose restart gathers the activations instead, 0.74x the first's bytes with those
    moves). The descents from the walked
    start do not reach that basin: on main 6f56e16 (stop 31) it keeps the Megatron MLP
    step's 902 B in 9 collectives where 1,414 in 10, the 4x2 Llama adamw step's 219,716 B
    (as compiled) where 249,940, Llama's (8,) step with a batch of 8 287,168 B where
    311,591, the 4-layer GPT-2 scan step on (8,) 81,424 where 92,071. The sort-dispatched
    MoE step's search ends cheaper (122,778 B as compiled where 125,366, 40 collectives
    combined where 48) in more collectives by operand (113 where 104), not kept. It runs
    only where those collectives move at least :data:`_RESTART_SHARE` of the kept result's bytes
    (a search as long as the program search's), both counted without the gathers of the
    function's inputs split over that dim and of their slices by scans
    (:func:`_given_split`): every equation unsplit over it gathers those too. GPT-2's adamw
    step fully sharded over ``dp`` (FSDP x TP, its layers' parameters sliced by its scans)
    moved 0.42 of its 71,880 B so, the restart ran (~2.3 s CPU of a 9 s cold predict) and
    was not kept; without its parameters' gathers (16,384 B) 0.25, not run (cold predict
    8.7-9.0 -> 6.5-6.8 s, the prediction unchanged). Of the restarts kept on
    dump_predictions.py's programs, section 14's and tests/test_inference_program(s).py's,
    the least share so is Llama's (8,) step with a batch of 8 (0.43; 0.61 with the 81,920 B of
    its Megatron weights gathered over tp, that mesh's first dim). 22-27 restarts that ran on
    those tests' small programs, none kept, no longer run (13 of linear algebra on an input
    split over the dim, 7-12 of test_program_search_never_costs_more_than_eager's random
    programs); on the benchmarks' programs only GPT-2's FSDP step's.
    Over the other mesh dims too, it kept no other result on
    benchmarks/dump_predictions.py's programs and doubled their search's time.

    Stop 48 (main 291038f) re-measured where it runs: on the dump's 19 programs it keeps
    only the (8,) Llama step with a batch of 8 (share 0.43, 0.8 s CPU); it runs and is not
    kept on the 4x2 Llama step (0.57: the first search now ends cheaper, 2.4 s of a 4.2 s
    cold predict) and the 8-device GPT-2 step (0.46, 0.5 s); on section 14's it keeps
    the dropless MoE's (0.49), ``apply_if_finite``'s stacked LM's (0.48) and the
    replicated Shampoo's (0.52), on tests/test_inference_program(s).py's and
    test_inference_carry.py's two small programs' and that ``apply_if_finite`` step's. The
    share does not separate them (kept at 0.43-0.86, not at 0.46-1.0); the restart's own
    descents (:func:`.program._choose`) end 0.46-0.91x the first search's objective where it
    is kept, 1.13-1.20x where not. So the restart's search is abandoned where its descents
    end dearer than ``best``'s choice (``select_program``'s ``rival``), before its
    finishing descents: the 4x2 Llama step's cold predict 3.7-4.0 -> 3.1-3.2 s CPU, the
    8-device GPT-2 step's 1.2 -> 0.95 s, every prediction of the dump and section 14 as it
    was."""
    if not best.inputs:
        return best
    name = best.inputs[0].layout.mesh.mesh_dim_names[0]
    given = _given_split(best, 0)
    total = moved = unavoidable = 0
    for c in best.planned_collectives():
        total += c.result_bytes
        if name in c.axes and c.kind != ALL_REDUCE:
            if c.source in given:
                unavoidable += c.result_bytes
            else:
                moved += c.result_bytes
    if not moved or moved < _RESTART_SHARE * (total - unavoidable):
        return best
    searched = _searched_against(walk, walk({}, unsplit=(None, 0)), model, targets, rival=best)
    if searched is None:  # its descents ended dearer than ``best``
        return best
    prediction = searched[0]
    (cost, steps), (restart_cost, restart_steps) = _total(best, model, targets), _total(prediction, model, targets)
    owing, restart_owing = _owing(best, model, targets), _owing(prediction, model, targets)
    if ((restart_cost, restart_steps) < (cost, steps) and restart_steps <= steps
            and prediction._lowered_with(restart_owing) <= best._lowered_with(owing)
            and len(prediction.combined(extra=restart_owing)) <= len(best.combined(extra=owing))):
        return prediction
    return best


def _given_split(prediction: Prediction, mesh_dim: int) -> set[ValueId]:
    """The function's inputs ``prediction`` takes split over ``mesh_dim`` and the slices
    its scans take of them (stacked layers' parameters, fully sharded): what every
    equation computed unsplit over ``mesh_dim`` gathers too. Values computed from them (a
    transpose, a cast) are not among them."""
    given: set[ValueId] = {("in", i) for i, spec in enumerate(prediction.inputs)
                           if spec.layout.mesh_dim_split(mesh_dim) is not None}
    for sliced, source in prediction.sliced:  # in program order: a nested scan's slices after its operand's
        if source in given:
            given.add(sliced)
    return given


def _owing(
    prediction: Prediction, model: CostModel, targets: _Targets
) -> tuple[tuple[ValueId | None, RedistributePlan], ...]:
    """Each free output's move to the layout its caller takes it in (:class:`_Targets`), as
    moves at the end of the program (what :func:`_total` charges, routed as the search
    routes it)."""
    sources = prediction.output_sources or (None,) * len(prediction.outputs)
    return tuple(
        (source, cached_plan(o.shape, o.dtype, o.layout, caller, model, model.collective_overhead))
        for o, source, caller in zip(prediction.outputs, sources, targets.callers)
        if caller is not None and o.layout != caller
    )


def _rejoin_conds(walk: Walk, prediction: Prediction, model: CostModel, targets: _Targets) -> Prediction:
    """``prediction`` or, cheaper, the program walked and searched again with its conds'
    outputs re-joined (:func:`_rejoined`): a cond's program node fixes its join, chosen
    from its branches as the first walk found them, where slicing is free, so a join
    tends to split what every consumer then gathers back (optax.MultiSteps' updated
    moments and updates, split over ``dp`` inside its ``lax.cond``, were gathered back to
    the parameters' layouts: 3.3x XLA's bytes). At most ``_CARRY_ROUNDS`` rounds, while
    each is cheaper; programs without a cond are returned as they are."""
    for _ in range(_CARRY_ROUNDS):
        joins = _rejoined(walk, prediction, model)
        if not joins:
            break
        rejoined, _ = _searched(walk, walk(joins), model, targets)
        if _total(rejoined, model, targets) >= _total(prediction, model, targets):
            break
        prediction = rejoined
    return prediction


def _rejoined(walk: Walk, prediction: Prediction, model: CostModel) -> dict[str, Candidate]:
    """Per cond of ``prediction`` whose join some output should leave, its candidate with
    those outputs re-joined: at the layout of its reads from which all its reads are
    cheapest to reach (:func:`_read_join`), else where the branches as the search chose
    them join (the walk's join rule, :meth:`_Walker._cond`, on a walk with the search's
    choices but the conds'). The second: optax.MultiSteps' updates, joined split over
    ``dp`` as the first walk's update branch made them, were read split by
    ``apply_updates`` (no move to re-join at) and the updated parameters all-gathered to
    their layouts, though the searched branch computed the updates in those layouts and
    sliced them into the join (the stacked LM's step 34,356 -> 21,844 B, 1.43 -> 0.91x
    XLA's). Empty without a cond."""
    conds = {row.path: row.signature.chosen for row in prediction.equations
             if row.primitive == "cond" and row.signature is not None}
    if not conds:
        return {}
    consumed = _consumed_joins(prediction, conds)
    branches = walk({path: c for path, c in prediction.choices if path not in conds})[0]
    joins = {}
    for row in branches.equations:
        chosen = conds.get(row.path)
        if chosen is None:
            continue
        joined = tuple(
            _read_join(o, layout, reads, model) or o.layout
            for reads, layout, o in zip(consumed[row.path], chosen.out_layouts, row.outputs)
        )
        if joined != chosen.out_layouts:
            joins[row.path] = dataclasses.replace(chosen, out_layouts=joined)
    return joins


def _read_join(output: TensorSpec, join: Layout, reads: Mapping[Layout, None], model: CostModel) -> Layout | None:
    """Among the layouts ``reads`` (in program order) a cond's output joined in ``join``
    is read in, the one from which reaching them all costs least (ties: the first), if it
    costs less than reaching them from ``join`` or if the output has one read and it moves
    it (that read's layout: MultiSteps' moments, joined split over ``dp``, all gathered
    back to their parameters' layouts); else None. Not only where every read moves it: the
    walk joins a gradient's optimizer update partial (the elementwise update of a partial
    gradient stays partial, as eager dispatch keeps it), and a linear read keeps the
    partial where the output's ``out_layouts`` move reduces it: optax.novograd's
    first-moment update of the stacked LM's embedding gradient, joined ``S(1),P`` and read
    so by ``-lr * mu``, was all-reduced and all-gathered for the parameter and the moment
    (2 x 10,240 B); re-joined ``R,R`` (``R,R -> S(1),P`` is free for the linear read), the
    next search gathers the gradient once and updates it replicated (its gathered value
    moves see through the cond: :attr:`.ProgramGraph.joins`), 38,262 -> 18,030 B (stop 34)."""
    if not reads:
        return None

    def total(source: Layout) -> Fraction:
        return sum((cached_plan(output.shape, output.dtype, source, read, model).cost for read in reads), Fraction(0))

    best = min(reads, key=total)
    return best if total(best) < total(join) or (len(reads) == 1 and join not in reads) else None


def _consumed_joins(prediction: Prediction, conds: Mapping[str, Candidate]) -> dict[str, list[dict[Layout, None]]]:
    """Per cond of ``conds`` (by path), per output, the layouts its reads in ``prediction``
    move it to (its own where a read does not move it), in program order (a dict: the
    first read's layout wins :func:`_read_join`'s ties on every run)."""
    consumed: dict[ValueId, dict[Layout, None]] = {}
    for row in prediction.equations:
        plans = row.signature.redistributions if row.signature is not None else ()
        for i, source in enumerate(row.sources):
            if source is not None:
                plan = plans[i] if i < len(plans) else None
                consumed.setdefault(source, {})[row.inputs[i].layout if plan is None else plan.dst] = None
    return {path: [consumed.get((path, j), {}) for j in range(len(chosen.out_layouts))]
            for path, chosen in conds.items()}


def _replicated_carries(
    loops: Mapping[str, _LoopCarries], mesh_dim: int, returned: bool = False
) -> CarrySeeds | None:
    """Every loop's carries (``returned``: the layouts its body returns them in) reduced
    and unsplit over ``mesh_dim`` (a replica per coordinate of ``mesh_dim``, as data
    parallelism keeps a gradient accumulator and the parameters it updates); None unless
    some loop splits a carry over ``mesh_dim`` that its initial value is not split over
    (a gradient accumulator reduce-scattered into shards every iteration) or ``returned``."""
    if not returned and not any(
        not carry.is_strided and carry.mesh_dim_split(mesh_dim) is not None
        and start.layout.mesh_dim_split(mesh_dim) is None
        for loop in loops.values() for carry, start in zip(loop.carries, loop.init)
    ):
        return None
    return tuple((path, tuple(_unsplit_over(carry.without_partial(), mesh_dim)
                              for carry in (loop.returned_layouts if returned else loop.carries)))
                 for path, loop in loops.items())


def _carry_restarts(
    walk: Walk, model: CostModel, targets: _Targets, loops: Mapping[str, _LoopCarries], seeds: CarrySeeds,
    returned: Callable[[Mapping[str, _LoopCarries]], CarrySeeds], tried: set[CarrySeeds],
    constants: Mapping[str, Candidate] | None = None,
) -> list[tuple[Prediction, _Walker]]:
    """The program walked with every loop's carries started from ``seeds`` (``constants``:
    its loops' constants' choices too) and searched, then from ``returned`` of the loops as
    each search's bodies leave them, at most 1 + ``_CARRY_ROUNDS`` rounds, none from seeds
    in ``tried`` (which it extends): each round's prediction and walk."""
    restarts = []
    for _ in range(1 + _CARRY_ROUNDS):
        if seeds in tried:
            break
        tried.add(seeds)
        start = {path: dataclasses.replace(loops[path], carries=layouts).choice(model) for path, layouts in seeds}
        prediction, walker = _searched(walk, walk({**start, **(constants or {})}), model, targets)
        restarts.append((prediction, walker))
        loops = walker.loops
        seeds = returned(loops)
    return restarts


def _carried_as_returned(
    walk: Walk, prediction: Prediction, walker: _Walker, model: CostModel
) -> tuple[Prediction, ...]:
    """``prediction``'s choices walked again with every loop's carries in the layouts its
    chosen body returns them in, the bodies' choices kept; empty where every body returns
    its carries as carried. A restart walked from such carries starts its bodies from their
    eager choices again, and its search may not get back to the body it left: the sampling
    loop's restart from the carries as given chose a body scattering each token into the
    sampled tokens split over ``dp`` and gathering them back to the carry each iteration
    (48 B), and the search from those returned carries (its next round) kept its walk, 39
    moves in 17 collectives after XLA's combiner: every descent's result sent more bytes by
    the planner's prices than that walk, a restart search's bound (:func:`.program._bounded`;
    that body with those carries 3,888 B where the walk 3,884). Walked with the body kept,
    the carry moves nothing: 3,840 B in 6 collectives (:func:`_charged`)."""
    loops = walker.loops
    if all(loop.returned_layouts == loop.carries for loop in loops.values()):
        return ()
    carried = {path: dataclasses.replace(loop, carries=loop.returned_layouts).choice(model)
               for path, loop in loops.items()}
    return (walk({**dict(prediction.choices), **carried})[0],)


def _returned_carries(loops: Mapping[str, _LoopCarries]) -> CarrySeeds:
    """Every loop's carries in the layouts its body returns them in."""
    return tuple((path, loop.returned_layouts) for path, loop in loops.items())


def _given_carries(loops: Mapping[str, _LoopCarries]) -> CarrySeeds | None:
    """Every loop's carries in their initial values' layouts; None unless some loop carries
    a value unsplit over a mesh dim its initial value is split over (the mirror of
    :func:`_replicated_carries`: a sampling loop's token, given split over ``dp`` with the
    batch, carried replicated over it)."""
    if not any(
        not start.layout.is_strided and start.layout.mesh_dim_split(m) is not None and carry.mesh_dim_split(m) is None
        for loop in loops.values() for carry, start in zip(loop.carries, loop.init) for m in range(carry.mesh.ndim)
    ):
        return None
    return tuple((path, tuple(start.layout for start in loop.init)) for path, loop in loops.items())


def _replicated_constants(loops: Mapping[str, _LoopCarries], mesh_dim: int) -> tuple[tuple[str, int, Layout], ...]:
    """(loop, index, layout) of every loop's constants split over ``mesh_dim``, unsplit:
    what a loop body indexes per iteration (a ``fori_loop``'s microbatches, split over
    ``dp`` with the batch), gathered so that every replica runs every iteration, as a
    scan's scanned inputs (their dim 0 whole) are."""
    return tuple((path, i, _unsplit_over(c.layout, mesh_dim)) for path, loop in loops.items()
                 for i, c in enumerate(loop.consts)
                 if not c.layout.is_strided and c.layout.mesh_dim_split(mesh_dim) is not None)


# a restart's loops (by path; None: the whole program) whose bodies' equations rank first their candidates
# unsplit over the mesh dim
_Unsplit = tuple[tuple[str, ...] | None, int]


# (id of a signature, mesh dim) -> (that signature, kept so that the id stays its own; it re-ranked by _unsplit_first)
_UNSPLIT = Memo(4096)


def _avoids(candidate: Candidate, mesh_dims: Sequence[int]) -> bool:
    """Whether ``candidate`` neither splits nor makes partial anything over ``mesh_dims``."""
    return all(x.mesh_dim_split(m) is None and x.partial[m] is None
               for x in (*candidate.in_layouts, *candidate.out_layouts) for m in mesh_dims)


def _once(memo: Memo, signature: Signature, tag: Any, make: Callable[[], Signature]) -> Signature:
    """``make()``, a signature made from ``signature``, found once per signature object and
    ``tag``: the program search finds repeated layers by their equations' candidate lists
    (``_Search.kinds``, by identity), which a new object per equation would hide. ``memo``
    keeps ``signature`` beside its result, so that its id stays its own."""
    key = (id(signature), tag)
    known = memo.recall(key)
    if known is not None and known[0] is signature:
        return known[1]
    made = make()
    memo.remember(key, (signature, made))
    return made


def _unsplit_first(signature: Signature, mesh_dim: int) -> Signature:
    """``signature`` with its candidates that neither split nor make partial anything over
    ``mesh_dim`` first (each group in its rule's order): the walk's choice, the program
    search's eager start, is then a replica per coordinate of ``mesh_dim`` wherever the
    inputs allow one. Itself where its first candidate is one already or none is.

    One signature (:func:`.select.signature_for` returns one object per equation kind and
    inputs) is re-ranked once, into one object (:func:`_once`): a new list per equation hid
    the repeated layers: the whole-program restart of Llama's 4-layer adamw step searched
    its whole graph unseeded (18.0 s CPU of a 21.0 s cold predict, load ~7)."""

    def ranked() -> Signature:
        candidates = signature.candidates
        first = [c for c in candidates if _avoids(c, (mesh_dim,))]
        if not first or first[0] is candidates[0]:
            return signature
        rest = (c for c in candidates if not _avoids(c, (mesh_dim,)))
        return Signature(signature.op, signature.inputs, (*first, *rest))

    return _once(_UNSPLIT, signature, mesh_dim, ranked)


def _kept(signature: Signature, keep: Callable[[Candidate], bool]) -> Signature:
    """``signature`` with only its candidates ``keep`` accepts; itself if it accepts none
    (never: the all-Replicate candidate, which every rule's signature holds, splits nothing)."""
    kept = tuple(filter(keep, signature.candidates))
    return Signature(signature.op, signature.inputs, kept) if kept else signature


def _operand_splits(signature: Signature) -> Signature:
    """``signature`` (of a :data:`.rules.BATCH_PARTITIONED` solver) with the candidates XLA
    can compile: their inputs split a dim (batch dims lead, so dim indices align across
    the operands) over a mesh dim only where an operand already splits it there, and are
    partial only where one is; all of them if none is (never: gathering everything is)."""
    split = {(k, m) for s in signature.inputs for k, axes in enumerate(s.layout.dim_axes) for m in axes}
    partial = {m for s in signature.inputs for m, op in enumerate(s.layout.partial) if op}

    def compiled(candidate: Candidate) -> bool:
        return all(
            all((k, m) in split for k, axes in enumerate(layout.dim_axes) for m in axes)
            and all(m in partial for m, op in enumerate(layout.partial) if op)
            for layout in candidate.in_layouts
        )

    return _kept(signature, compiled)


def _idle_mesh_dims(jaxpr: Any, mesh: DeviceMesh, specs: Sequence[TensorSpec],
                    targets: Sequence[Layout | None]) -> tuple[int, ...]:
    """The mesh dims (of size > 1) that no input of the program splits or holds partial,
    nor any ``out_layouts`` target: XLA's sharding propagation only spreads the shardings
    it is given (the arguments', the results', the annotations'), so its program splits
    nothing over them. None where ``jaxpr`` holds an annotation (``with_sharding_constraint``,
    ``reshard``, ``shard_map``, an explicit ``out_sharding``) anywhere: its axes spread too.

    Why: a split over such a dim is a free local slice, and the program search and eager
    dispatch alike took one wherever it shrank a collective over another dim, a split XLA
    never makes. ``jnp.linalg.cholesky`` / ``eigh`` of a ``(4, 16, 16)`` matrix ``R,S(1)``
    on dp=2 x tp=4 symmetrize it first, ``(a + a.mT) / 2``; the sum was sliced over ``dp``
    on its batch dim, halving the transpose's all-to-all over ``tp`` and the solver's
    gather, and the factor came out ``S(0),R`` where XLA's is ``R,R`` (``check``:
    ``differs``, 3,968 B as converted to XLA's layout against its 3,840)."""
    layouts = [*(s.layout for s in specs), *(t for t in targets if t is not None)]
    used = {m for x in layouts for axes in x.dim_axes for m in axes}
    used |= {m for x in layouts for m, op in enumerate(x.partial) if op}
    idle = tuple(m for m, size in enumerate(mesh.shape) if size > 1 and m not in used)
    if idle and any(e.primitive.name in CONSTRAINT_SHARDING_PARAMS or e.primitive.name == "shard_map"
                    or _explicit_out_sharding(e) is not None for e in all_equations(jaxpr)):
        return ()
    return idle


def _is_typed(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` was traced on inputs typed by their layouts (:func:`_typed_trace`):
    an input's sharding type names a mesh (an untyped trace's are of the empty mesh)."""
    return any(isinstance(s := getattr(v.aval, "sharding", None), NamedSharding) and not s.mesh.empty
               for v in jaxpr.invars)


class _Type(NamedTuple):
    """A value's sharding type as the walk reads it: ``layout`` over the mesh dims
    ``over`` (its mesh's Explicit axes), the others left to XLA (JAX's types name only
    Explicit axes: ``core.modify_spec_for_auto_manual``); ``whole``: over every mesh dim."""

    layout: Layout
    over: frozenset[int]
    whole: bool

    def holds(self, layout: Layout) -> bool:
        """Whether a value in ``layout`` has this type."""
        return layout == self.layout if self.whole else _over(layout, self.over) == _over(self.layout, self.over)


def _typed_candidates(
    signature: Signature, ins: Sequence[TensorSpec], types: Sequence[_Type | None]
) -> tuple[Signature, bool]:
    """``signature`` as XLA partitions a typed equation (:func:`_typed_trace`): its
    operands as they come (in their types: XLA's partitioner computes the equation on
    its operands' shardings and reshards its result to its type), and whether its
    outputs are their types (``types``, None: any) then. The candidates taking ``ins``
    as they arrive and making the types; else those taking them (a matmul contracting a
    split dim makes a partial sum, then reduced; a scatter-add of batch-split updates
    into a replicated table makes a partial table: XLA all-reduces it, where the search
    would gather the updates); else all of them (a matmul whose operands no candidate
    takes as they come: XLA slices one locally, the search chooses), making the types
    where it is a fixed signature making them (a constraint's: its move is its input's)."""
    arriving = tuple(s.layout for s in ins)

    def making(candidate: Candidate) -> bool:
        return all(t is None or t.holds(o) for o, t in zip(candidate.out_layouts, types))

    taking = [c for c in signature.candidates if tuple(c.in_layouts) == arriving]
    kept = [c for c in taking if making(c)] or taking
    if not kept:
        return signature, len(signature.candidates) == 1 and making(signature.candidates[0])
    return Signature(signature.op, signature.inputs, tuple(kept)), making(kept[0])


def _over(layout: Layout, mesh_dims: frozenset[int]) -> tuple[Any, ...]:
    """What ``layout`` says over ``mesh_dims`` alone: each tensor dim's splits among them,
    and their partials."""
    return (tuple(tuple(m for m in axes if m in mesh_dims) for axes in layout.dim_axes),
            tuple(op if m in mesh_dims else None for m, op in enumerate(layout.partial)))


def _untyped(sharding: Any) -> bool:
    """Whether a ``with_sharding_constraint`` / ``reshard`` target is the untyped trace's
    own type (a sharding on the empty mesh), which constrains nothing: JAX's transpose of
    an explicit-mode op reshards its cotangent to its operand's type (the gradient of
    ``table.at[ids].get(out_sharding=...)`` to the table's), which predict's trace leaves
    untyped (it had been refused as on another mesh)."""
    return isinstance(sharding, NamedSharding) and sharding.mesh.empty


def _explicit_out_sharding(eqn: Any) -> NamedSharding | None:
    """The ``out_sharding`` (``sharding``) param of an equation with one output when it
    names axes of a mesh with Explicit axes, traced inside ``jax.set_mesh`` of one
    (``jnp.einsum(..., out_sharding=P("dp", None))``: JAX types the result so and
    ``jax.jit`` makes it so, an annotation as ``reshard`` is); None otherwise. predict
    traces ``fn``'s inputs untyped, so a named axis comes from such an argument (or from
    one upstream, whose type JAX carried on); an all-None spec is the untyped inputs' own
    and is not read as one (``out_sharding=P()`` asking for Replicate is not honoured),
    nor is an ``unreduced`` one."""
    sharding = eqn.params.get("out_sharding", eqn.params.get("sharding"))
    if len(eqn.outvars) != 1 or not isinstance(sharding, NamedSharding):
        return None
    spec = sharding.spec
    if AxisType.Explicit not in sharding.mesh.axis_types or getattr(spec, "unreduced", None):
        return None
    return sharding if any(entry is not None for entry in spec) else None


# (id of a signature, idle mesh dims) -> (that signature, kept so that the id stays its own; it filtered by _busy)
_BUSY = Memo(4096)


def _busy(signature: Signature, idle: tuple[int, ...]) -> Signature:
    """``signature`` without the candidates splitting or making partial anything over an
    ``idle`` mesh dim (:func:`_idle_mesh_dims`); itself where it has none. One object per
    signature (:func:`_once`), as :func:`_unsplit_first`."""

    def kept() -> Signature:
        def busy(candidate: Candidate) -> bool:
            return _avoids(candidate, idle)

        return signature if all(map(busy, signature.candidates)) else _kept(signature, busy)

    return _once(_BUSY, signature, idle, kept)


def _unsplit_over(layout: Layout, mesh_dim: int) -> Layout:
    """``layout`` with ``mesh_dim`` splitting no dim (itself where strided: its factors
    belong to its splits)."""
    if layout.is_strided or layout.mesh_dim_split(mesh_dim) is None:
        return layout
    return Layout(layout.mesh, tuple(tuple(m for m in axes if m != mesh_dim) for axes in layout.dim_axes),
                  layout.partial)


# the primitives of a shard_map body's per-device code that name its manual axes: their rules in a walk of a partially
# manual region's body (:meth:`_Walker._manual_collective`); those linear in their operands keep a partial sum
_LINEAR_MANUAL = frozenset({"psum", "psum_invariant", "unreduced_psum", "ppermute", "pvary", "pcast", "all_gather",
                            "all_gather_invariant", "reduce_scatter", "unreduced_reduce_scatter", "all_to_all"})
_MANUAL_PRIMITIVES = _LINEAR_MANUAL | {"pmax", "pmin", "axis_index"}


@dataclass
class _Manual:
    """A walk of a partially manual region's body (:meth:`_Walker._region_body`): per result
    of a collective over its manual mesh dims (its jaxpr variable), the bytes of its
    per-device block; per equation (by id) whose operands the walk moves over the other
    mesh dims, those moves' collectives (:class:`.regions.RegionMove`); the paths of the
    rows they are in."""

    block_bytes: dict[Any, int] = dataclasses.field(default_factory=dict)
    moves: dict[int, tuple[RegionMove, ...]] = dataclasses.field(default_factory=dict)
    paths: set[str] = dataclasses.field(default_factory=set)

    def moved(self, eqn: Any, path: str, ins: Sequence[TensorSpec], signature: Signature) -> None:
        """Records the collectives of the moves of ``eqn``'s operands ``ins`` (its row at
        ``path``) into ``signature``'s layouts."""
        found = []
        for i, (spec, plan) in enumerate(zip(ins, signature.redistributions)):
            for step in plan.steps:
                if step.communicates:
                    sizes = spec.layout.mesh.shape
                    found.append(RegionMove(i, RegionCollective(
                        step.compiled, step.axes, getattr(step.src, "reduce_op", None), spec.dtype,
                        block_bytes(spec.shape, spec.dtype.itemsize, step.after.dim_axes, sizes),
                        math.prod(sizes[m] for m in step.over or (step.mesh_dim,)),
                        0, "", "",
                    )))
        if found:
            self.moves[id(eqn)] = tuple(found)
            self.paths.add(path)


def _without_mesh_dims(layout: Layout, mesh_dims: frozenset[int]) -> Layout:
    """``layout`` splitting nothing over ``mesh_dims`` and partial over none of them."""
    return Layout(layout.mesh, tuple(tuple(m for m in axes if m not in mesh_dims) for axes in layout.dim_axes),
                  tuple(None if m in mesh_dims else op for m, op in enumerate(layout.partial)))


def _with_manual(spec: Layout, body: Layout, mesh_dims: frozenset[int]) -> Layout:
    """A region's value as its ``spec`` (an in_spec or out_spec as a layout) lays it out over
    its manual ``mesh_dims`` and as ``body`` over the others: per dim, the manual mesh dims
    major (the value's blocks over them are the body's values, which XLA splits over the
    others), ``body``'s partials over the others."""
    return Layout(
        spec.mesh,
        tuple(tuple(m for m in a if m in mesh_dims) + tuple(m for m in b if m not in mesh_dims)
              for a, b in zip(spec.dim_axes, body.dim_axes)),
        tuple(None if m in mesh_dims else op for m, op in enumerate(body.partial)),
    )


def _touches(layout: Layout, mesh_dims: frozenset[int]) -> bool:
    """Whether ``layout`` splits a dim over, or is partial over, one of ``mesh_dims``."""
    return any(m in mesh_dims for axes in layout.dim_axes for m in axes) or any(
        layout.partial[m] for m in mesh_dims)


def _sent_bytes(signature: Signature, region: Region) -> Fraction:
    """The bytes a region's row sends: its operands' moves into ``signature``'s chosen
    layouts and what its body sends (``region``)."""
    return sum((plan.nbytes for plan in signature.redistributions), Fraction(0)) + sum(
        (c.nbytes() for c in region.collectives), Fraction(0))


class Executor(Protocol):
    """Runs equations as the walker visits them (``apply``): it keeps each jaxpr
    variable's value and computes an equation's outputs under the signature chosen for
    it. Walking into a call, the walker calls ``enter_call`` (bind the called jaxpr's
    inputs) and ``exit_call`` (bind the call's outputs); a loop or cond is run by
    ``loop`` once its row's ``signature`` is known (with ``walker.body_walker``), given
    the planned routes of the moves across its bodies' boundaries by their rows' paths
    (``<path>.carry<i>``, ``<path>.ys<i>``, ``<path>.b<k>.out<i>``, ``<path>.cond.out``)
    and, for a cond, the moves of its operands its branches make, which run before it
    (``hoisted``: (operand index, plan), :meth:`_Walker._hoisted`)."""

    def enter_call(self, eqn: Any, closed: Any) -> None: ...

    def exit_call(self, eqn: Any, closed: Any) -> None: ...

    def equation(self, eqn: Any, signature: Signature) -> None: ...

    def constrain(self, var: Any, signature: Signature) -> None: ...

    def loop(
        self, walker: _Walker, eqn: Any, path: str, signature: Signature, routes: Mapping[str, RedistributePlan],
        hoisted: Sequence[tuple[int, RedistributePlan]] = (),
    ) -> None: ...


def execute(prediction: Prediction, executor: Executor, cost_model: CostModelLike = None) -> None:
    """Walk ``prediction``'s jaxpr again with the signatures it chose (its search's
    choices, the same cost model), running every equation with ``executor``: one walker
    serves predict, check and apply. The executor holds the values of the jaxpr's
    inputs and constants before, and of its outputs after (``out_layouts`` moves are
    the caller's: ``prediction.outputs``)."""
    closed = prediction.jaxpr
    if closed is None or not prediction.inputs:
        raise InferenceError("prediction", prediction, "has no traced jaxpr or no inputs", "pass predict()'s result")
    mesh = prediction.inputs[0].layout.mesh
    walker = _Walker(mesh, resolve_cost_model(cost_model), dict(prediction.choices), prediction.on_unknown, executor,
                     gathered=prediction.search != "program", unsplit=prediction.unsplit, idle=prediction.idle,
                     typed=_is_typed(prediction.jaxpr.jaxpr))
    walker.walk(
        closed.jaxpr, _const_specs(closed.jaxpr, mesh), prediction.inputs, "",
        [("in", i) for i in range(len(prediction.inputs))],
    )


def _const_specs(jaxpr: Any, mesh: DeviceMesh) -> list[TensorSpec]:
    return [_replicated_spec(_aval(v), mesh) for v in jaxpr.constvars]


def _aval(atom: Any) -> Aval:
    """A jaxpr variable's or literal's shape and dtype: one Aval per (shape, dtype) (memoized:
    a jaxpr's values share few of them, and building each checked Aval again was ~2/3 of
    building :func:`_equations`' table)."""
    key = (atom.aval.shape, atom.aval.dtype)
    aval = _AVALS.get(key)
    if aval is None:
        aval = Aval(*key)
        _AVALS.remember(key, aval)
    return aval


_AVALS = Memo(4096)


@cached(maxsize=4096)
def _replicated_spec(aval: Aval, mesh: DeviceMesh) -> TensorSpec:
    """A literal's or constant's spec: Replicate (cached: every walk reads them again)."""
    return TensorSpec(aval.shape, aval.dtype, Layout(mesh, ((),) * len(aval.shape)))


class _Equation:
    """What every walk reads of one equation of a jaxpr, computed once per jaxpr
    (:func:`_equations`: a cold predict walks the program three times and loop bodies
    more, each equation's avals built again otherwise): the equation, its index as a path
    part, per input (atom, its Aval if a literal else None), its output avals, its output
    vars (None: dropped, or ``read`` by no equation nor output of its jaxpr, as a nested
    call's unused results are: dead code left to XLA), and the params its rule reads
    (:meth:`params`)."""

    __slots__ = ("eqn", "index", "reads", "out_avals", "outvars", "_params")

    def __init__(self, eqn: Any, index: int, read: Container[Any]) -> None:
        self.eqn = eqn
        self.index = str(index)
        self.reads = _reads(eqn.invars)
        self.out_avals = tuple(map(_aval, eqn.outvars))
        self.outvars = tuple(None if isinstance(v, core.DropVar) or v not in read else v for v in eqn.outvars)
        self._params: Any = _UNREAD

    def params(self, definition: PrimitiveDef) -> Any:
        """``definition.read_params(eqn.params)``, frozen at the first walk that reads them
        (freezing them at every walk was ~1/5 of a walk whose signatures are cached). The
        current rule's: registering or removing a rule empties the table with every cache
        (:func:`.ops.register_sharding`)."""
        if self._params is _UNREAD:
            self._params = definition.read_params(self.eqn.params)
        return self._params


_UNREAD = object()


@dataclass(frozen=True)
class _Equations:
    """A jaxpr's :class:`_Equation` per equation; per output of the jaxpr, (atom, Aval if a
    literal)."""

    equations: tuple[_Equation, ...]
    outputs: tuple[tuple[Any, Aval | None], ...]


def _reads(atoms: Sequence[Any]) -> tuple[tuple[Any, Aval | None], ...]:
    return tuple((a, _aval(a) if isinstance(a, core.Literal) else None) for a in atoms)


def _equations(jaxpr: Any) -> _Equations:
    """The jaxpr's :class:`_Equations` (memoized per jaxpr object: jaxprs are hashed by
    identity, and the memo holds the jaxpr, so an entry is never another's)."""
    table = _EQUATIONS.recall(jaxpr)
    if table is None:
        read = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, core.Literal)}
        read.update(v for v in jaxpr.outvars if not isinstance(v, core.Literal))
        table = _Equations(tuple(_Equation(eqn, index, read) for index, eqn in enumerate(jaxpr.eqns)),
                           _reads(jaxpr.outvars))
        _EQUATIONS.remember(jaxpr, table)
    return table


_EQUATIONS = Memo(1024)


def called_jaxpr(eqn: Any) -> Any | None:
    """The (closed) jaxpr a call-like equation runs, taking the equation's inputs and
    giving its outputs, or None for any other equation: a call's own
    (:data:`CALL_JAXPR_PARAMS`); for ``custom_linear_solve`` its ``solve`` jaxpr on its
    consts and the right-hand sides (:func:`_linear_solve_body`)."""
    name = eqn.primitive.name
    if name in CALL_JAXPR_PARAMS:
        return eqn.params[CALL_JAXPR_PARAMS[name]]
    if name == LINEAR_SOLVE:
        avals = tuple(
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in eqn.invars
        )
        return _linear_solve_body(eqn.params["jaxprs"], tuple(eqn.params["const_lengths"]), avals)
    return None


@cached(maxsize=256)
def _linear_solve_body(jaxprs: Any, const_lengths: tuple[int, ...], avals: tuple[Any, ...]) -> Any:
    """``custom_linear_solve``'s forward computation as a jaxpr taking all its inputs (the
    consts of its matvec, vecmat, solve and transpose_solve jaxprs in that order, then the
    right-hand sides): its ``solve`` jaxpr on the solve consts and the right-hand sides,
    as JAX's own impl runs it. Why walked so: the primitive has no sharding rule of its
    own (JAX's jaxprs carry the solve, e.g. ``jnp.linalg.solve``'s LU substitutions, whose
    primitives have rules); its other jaxprs only serve JAX's derivative rules, which the
    traced program has already applied (a gradient is another custom_linear_solve)."""
    matvec, vecmat, solve = const_lengths[:3]
    start, rhs = matvec + vecmat, sum(const_lengths)
    body = core.jaxpr_as_fun(jaxprs.solve)
    return jax.make_jaxpr(lambda *args: body(*args[start:start + solve], *args[rhs:]))(*avals)


def all_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' params (calls, loop
    bodies, cond branches, custom derivative rules), depth-first in program order. For
    questions about which primitives a program uses, which need no layouts (the walker
    visits what it predicts: it inlines calls and walks loop bodies as their rows say)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in core.jaxprs_in_params(eqn.params):
            yield from all_equations(sub)


class NestedEquation(NamedTuple):
    """One equation met by :func:`nested_equations`."""

    path: tuple[int, ...]  # equation indices from the outer jaxpr in (the walker's path parts)
    eqn: Any
    reads: tuple[Any, ...]  # per input, the tag ``tracked`` gives its value (through the bodies entered), else None
    body: Any  # the (closed) jaxpr entered for it: a scan's body, a call's, an unrolled scan's; else None


def nested_equations(
    jaxpr: Any, tracked: Mapping[Any, Any] | None = None, unroll: bool = False, path: tuple[int, ...] = ()
) -> Iterator[NestedEquation]:
    """Every equation of ``jaxpr`` and of the scan and call bodies (:func:`called_jaxpr`)
    in it, depth-first in program order, each with its path as the walker names it and
    which of the ``tracked`` values (var -> tag) it reads: a body's inputs take the tags of
    the equation's inputs they bind, so a question about where the program's inputs go
    (read as a scan's scanned operand, first read) is one loop over this, not one more
    recursion. ``while`` and ``cond`` are not entered (their equation reads the values).
    With ``unroll``, a scan with ``unroll`` k != 1 is entered as the walker walks it
    (:func:`unrolled_scan`: its paths, and the lengths of the scans in it); without, as its
    body (whose inputs are the scan's own: the unrolled jaxpr reads the scanned operands
    through reshapes and slices). Unlike :func:`all_equations`, no other sub-jaxpr
    (custom derivative rules, branches) is visited; a call of a function with a registered
    rule (one row for the walker) is entered like any call."""
    tracked = {} if tracked is None else tracked
    for index, eqn in enumerate(jaxpr.eqns):
        reads = (tuple([None if isinstance(v, core.Literal) else tracked.get(v) for v in eqn.invars]) if tracked
                 else (None,) * len(eqn.invars))  # most bodies read no tracked value: 2x faster passes
        name = eqn.primitive.name
        body = None
        if name == "scan":
            unrolled = unrolled_scan(eqn) if unroll else None
            body = eqn.params["jaxpr"] if unrolled is None else unrolled
        else:
            body = called_jaxpr(eqn)
        at = (*path, index)
        yield NestedEquation(at, eqn, reads, body)
        if body is not None:
            inner = body.jaxpr if isinstance(body, core.ClosedJaxpr) else body
            mapped = {v: tag for v, tag in zip(inner.invars, reads) if tag is not None}
            yield from nested_equations(inner, mapped, unroll, at)


def _drop_dim0(layout: Layout) -> Layout:
    """The layout of one slice along dim 0 (which must be unsplit). Split factors stay
    with their dims (a slice of a strided array holds its rows as the array does)."""
    return Layout(layout.mesh, layout.dim_axes[1:], layout.partial, _factors(layout, 1))


def _unsplit_dim0(layout: Layout) -> Layout:
    return Layout(layout.mesh, ((),) + layout.dim_axes[1:], layout.partial, _factors(layout, 1, (1,)))


def _stacked(layout: Layout) -> Layout:
    """The layout of slices stacked along a new, unsplit dim 0 (split factors kept)."""
    return Layout(layout.mesh, ((),) + layout.dim_axes, layout.partial, _factors(layout, 0, (1,)))


def _factors(layout: Layout, start: int, lead: tuple[int, ...] = ()) -> tuple[int, ...] | None:
    """``lead`` + the split factors of ``layout``'s dims from ``start`` (None: no factor)."""
    return lead + layout.split_factors[start:] if layout.is_strided else None


@dataclass(frozen=True)
class _LoopCarries:
    """A walked loop's carries: its program node's op, the initial values and the body's
    results (as walked, before their move back to the carries), the layouts carried and
    how many reads of them the loop has (its body's; a while's condition's too)."""

    op: str
    init: tuple[TensorSpec, ...]
    returned: tuple[TensorSpec, ...]
    carries: tuple[Layout, ...]
    reads: int
    producible: tuple[tuple[Layout, ...], ...] = ()  # per carry, the layouts the body's result's producer can give
    consts: tuple[TensorSpec, ...] = ()  # the loop's constants, as its bodies read them

    @property
    def returned_layouts(self) -> tuple[Layout, ...]:
        return tuple(s.layout for s in self.returned)

    def options(self) -> tuple[tuple[Layout, ...], ...]:
        """The carry layouts the program search chooses among (at most ``_CARRY_OPTIONS``),
        the walked ones first (its eager choice): as walked, as the body returns them, with
        their partials reduced, as given initially, all carries at once; then one carry at
        a time, also in any layout its producer in the body can give it (e.g. a gradient
        accumulator left partial, reduced once after the loop)."""
        walked = self.carries
        joint = self._joint()
        options = [walked, *joint]
        for i in range(len(walked)):
            options += [walked[:i] + (x,) + walked[i + 1:] for x in tuple(j[i] for j in joint) + self.producible[i]]
        return tuple(dict.fromkeys(options))[:_CARRY_OPTIONS]

    def _joint(self) -> tuple[tuple[Layout, ...], ...]:
        """The all-carries options: as the body returns them, with their partials reduced,
        as given initially."""
        return (self.returned_layouts, tuple(x.without_partial() for x in self.carries),
                tuple(s.layout for s in self.init))

    @property
    def seeds(self) -> list[int]:
        """The options the program search also descends from: the all-carries ones (the
        body's results', reduced, initial) that differ from the walked carries."""
        joint = set(self._joint())
        return [k for k, option in enumerate(self.options()) if k and option in joint]

    def choice(self, cost_model: CostModel) -> Candidate:
        """The program node's candidate carrying ``carries`` (a walk given it as the
        loop's choice starts its carries there)."""
        return _carry_candidates(self.op, self.init + self.returned, (self.carries,), self.reads, cost_model)[0]

    def constant_choice(self, i: int, layout: Layout, cost_model: CostModel) -> Candidate:
        """The choice moving constant ``i`` to ``layout`` (:meth:`_Walker._constants`)."""
        spec = self.consts[i]
        return _fixed_signature("loop constant", (spec,), (layout,), (spec.aval,), (layout,), layout.mesh,
                                cost_model).chosen


def unrolled_scan(eqn: Any) -> Any:
    """A ``scan`` with ``unroll`` k != 1 as JAX lowers it (jax 0.10.2's ``_scan_impl``), a
    closed jaxpr of ``eqn``'s inputs and outputs, or None (``unroll=1`` or ``length=0``:
    the scan itself). XLA's loop body then holds k chained copies of the scan's body (a remainder of
    ``length % k`` copies follows the loop; ``unroll=0`` / ``True``, or a loop of one trip,
    is all copies and no loop), so the compiled program has each copy's collectives:
    walked as one body, the prediction counted them once (the stacked LM with
    ``unroll=2``: 21,844 B predicted, 34,454 compiled). Here the loop is a scan of
    ``length // k`` iterations over the scanned inputs reshaped to (length // k, k, ...)
    whose body runs the k copies on slices of its slice (``_scan_impl`` runs a
    ``while_loop`` indexing them: a scan is the walker's loop with the same body), the
    remainder copies after it on slices of the inputs' last ``length % k`` rows (a reverse
    scan's first), each copy's equations rows of their own. Memoized per equation, so
    every walk sees the same jaxpr (its paths, and :func:`_equations`' table)."""
    p = eqn.params
    k, length = p["unroll"], p["length"]
    if k == 1 or not length:  # no iteration: nothing to unroll
        return None
    closed = _UNROLLED.recall(eqn)
    if closed is not None:
        return closed
    trips, remainder = divmod(length, k) if k else (0, length)
    if trips == 1 and not remainder:
        trips, remainder = 0, length
    nc, nk, reverse = p["num_consts"], p["num_carry"], p["reverse"]
    body = core.jaxpr_as_fun(p["jaxpr"])

    def copies(consts: list[Any], carry: list[Any], xs: list[Any], n: int) -> tuple[list[Any], list[Any]]:
        ys: list[Any] = [None] * n
        for i in reversed(range(n)) if reverse else range(n):
            out = body(*consts, *carry, *(jax.lax.index_in_dim(x, i, keepdims=False) for x in xs))
            carry, ys[i] = list(out[:nk]), out[nk:]
        return carry, [jax.lax.concatenate([jax.lax.expand_dims(y, (0,)) for y in col], 0) for col in zip(*ys)]

    def unrolled(*args: Any) -> list[Any]:
        consts, carry, xs = list(args[:nc]), list(args[nc:nc + nk]), list(args[nc + nk:])
        looped = trips * k
        loop_xs, rest_xs = xs, xs
        if trips and remainder:  # the remainder's rows are the last (a reverse scan's first)
            cut = remainder if reverse else looped
            head = [jax.lax.slice_in_dim(x, 0, cut) for x in xs]
            tail = [jax.lax.slice_in_dim(x, cut, length) for x in xs]
            loop_xs, rest_xs = (tail, head) if reverse else (head, tail)
        ys: list[Any] = []
        if trips:
            reshaped = [jax.lax.reshape(x, (trips, k, *x.shape[1:])) for x in loop_xs]
            carry, stacks = jax.lax.scan(lambda c, x: copies(consts, c, x, k), carry, reshaped, reverse=reverse)
            ys = [jax.lax.reshape(y, (looped, *y.shape[2:])) for y in stacks]
        if remainder:
            carry, rest = copies(consts, carry, rest_xs, remainder)
            ys = [jax.lax.concatenate([r, y] if reverse else [y, r], 0) for y, r in zip(ys, rest)] if trips else rest
        return [*carry, *ys]

    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in eqn.invars]
    closed = jax.make_jaxpr(unrolled)(*structs)
    _UNROLLED.remember(eqn, closed)
    return closed


_UNROLLED = Memo(256)


def _source_line(eqn: Any) -> str:
    """``file:line (function)`` of the user code that made ``eqn`` ("" for equations
    inside library functions traced as jit: their caller's line is used instead)."""
    return source_info_util.summarize(eqn.source_info)


class _Walker:
    """Walks a jaxpr, choosing signatures: the candidate ``choices`` gives an equation's
    path (whole-program selection), else the best-ranked one for its inputs' layouts
    (eager selection). Records the dataflow as :class:`ProgramNode`s for the search
    (``searched=False``: a walk whose graph is read for its choices alone, e.g. eager
    dispatch's as the search's bound: its nodes hold the chosen candidates, and it ranks
    no more candidates than choosing needs: :func:`.select.signature_for`'s ``ranked``)."""

    def __init__(
        self, mesh: DeviceMesh, cost_model: CostModel, choices: Mapping[str, Candidate], on_unknown: str = "raise",
        executor: Executor | None = None, gathered: bool = True, searched: bool = True,
        unsplit: _Unsplit | None = None, idle: tuple[int, ...] = (), typed: bool = False,
        manual: _Manual | None = None,
    ) -> None:
        self.mesh = mesh
        self.cost_model = cost_model
        self.choices = choices
        self.on_unknown = on_unknown
        self.executor = executor  # runs each equation as walked (apply); None: layouts only
        # eager choices charge a partial kept while a split is gathered (False: the program search's walk, see
        # select.signature_for)
        self.gathered = gathered
        self.searched = searched  # the program nodes hold every candidate (else the chosen ones)
        # (loop paths or None: everywhere, mesh dim): their equations rank first the candidates unsplit over it
        self.unsplit = unsplit
        self.idle = idle  # mesh dims no rule's candidate may split or make partial over (:func:`_idle_mesh_dims`)
        # the jaxpr's values carry JAX's explicit sharding types, which are their layouts (:func:`_typed_trace`)
        self.typed = typed
        self.manual = manual  # walking a partially manual region's body (:meth:`_region_body`)
        self.rows: list[EquationReport] = []
        self.nodes: list[ProgramNode] = []
        self.node_at: dict[str, ProgramNode] = {}  # the nodes by path
        self.calls: list[Any] = []  # the enclosing call equations (their source lines for errors)
        self.loops: dict[str, _LoopCarries] = {}  # the loops walked (not their fixed points' trials), by path
        # the scans of one trip: XLA's WhileLoopSimplifier replaces such a loop by its body (the one-layer masked
        # Llama scan compiles with no while, its body's all-reduces combined with the program's), so its body is no
        # computation of its own for the combiner (:func:`.combine.planned_collectives`); by path, the position of
        # the body's first node
        self.inlined: dict[str, int] = {}
        # the value each result of such a scan is in its body (its carries', its stacks'): what the combiner's
        # dependencies follow (a carry or stack the walk did not move has no row of its own)
        self.returned: dict[ValueId, ValueId | None] = {}
        # per cond output, the values its branches return for it: :attr:`.ProgramGraph.joins`
        self.joins: dict[ValueId, tuple[ValueId, ...]] = {}
        # per scan XLA compiles as a loop, what its body returns (its carries', then its stacks'): (the row moving
        # it, the value it is in the body), the roots of the body's post order (:attr:`.ProgramGraph.results`)
        self.results: dict[str, tuple[tuple[str, ValueId | None], ...]] = {}
        # per scanned operand's slice, as the scan's body reads it, the operand it slices (:attr:`Prediction.sliced`)
        self.sliced: dict[ValueId, ValueId | None] = {}

    def graph(
        self, outputs: Sequence[tuple[TensorSpec, ValueId | None]], inputs: tuple[TensorSpec, ...]
    ) -> ProgramGraph:
        """The walked program's dataflow for the search, ``outputs`` as :meth:`walk` returned
        them: its loops XLA compiles as loops, and the scans of one trip it inlines."""
        loops = tuple((row.path, row.primitive) for row in self.rows
                      if row.primitive in LOOPS and row.path not in self.inlined)
        return ProgramGraph(self.mesh, tuple(self.nodes), tuple(s for _, s in outputs), inputs, loops,
                            tuple(self.inlined.items()), tuple(self.returned.items()), tuple(self.joins.items()),
                            tuple(self.results.items()))

    def _trial(self) -> _Walker:
        """A walker whose rows and nodes are thrown away (for fixed points)."""
        return _Walker(self.mesh, self.cost_model, self.choices, self.on_unknown, gathered=self.gathered,
                       searched=self.searched, unsplit=self.unsplit, idle=self.idle,
                       typed=self.typed, manual=self.manual)

    def walk(
        self, jaxpr: Any, consts: Sequence[TensorSpec], inputs: Sequence[TensorSpec], prefix: str,
        sources: Sequence[ValueId | None],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """The outputs of ``jaxpr`` and the values they are (None: a literal or constant)."""
        env: dict[Any, tuple[TensorSpec, ValueId | None]] = {}
        mesh = self.mesh

        def read(atom: Any, literal: Aval | None) -> tuple[TensorSpec, ValueId | None]:
            return env[atom] if literal is None else (_replicated_spec(literal, mesh), None)

        env.update((v, (c, None)) for v, c in zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, zip(inputs, sources)))
        table = _equations(jaxpr)
        for entry in table.equations:
            if entry.reads:
                ins, srcs = zip(*(read(a, literal) for a, literal in entry.reads))
            else:
                ins, srcs = (), ()
            outs = self._equation(entry, prefix + entry.index, ins, srcs)
            for var, value in zip(entry.outvars, outs):
                if var is not None:
                    env[var] = value
        return [read(v, literal) for v, literal in table.outputs]

    def _closed(
        self, closed: Any, ins: Sequence[TensorSpec], prefix: str, walker: _Walker | None = None,
        sources: Sequence[ValueId | None] | None = None,
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """Walk a called or loop-body jaxpr. A call threads its inputs' ``sources``; a
        body's inputs are fixed by its loop's row (``None``: fixed as given)."""
        jaxpr = getattr(closed, "jaxpr", closed)
        srcs = sources if sources is not None else [None] * len(ins)
        return (walker or self).walk(jaxpr, _const_specs(jaxpr, self.mesh), ins, prefix, srcs)

    def fixed(
        self, op: str, ins: Sequence[TensorSpec], in_layouts: Sequence[Layout], out_avals: Sequence[Aval],
        out_layouts: Sequence[Layout],
    ) -> Signature:
        """The one signature of an op whose layouts are fixed: plans of its inputs to
        ``in_layouts``, outputs ``out_layouts`` (routed as the program search prices them
        when walking its choice: the model's ``collective_overhead``)."""
        return _fixed_signature(
            op, tuple(ins), tuple(in_layouts), tuple(out_avals), tuple(out_layouts), self.mesh, self.cost_model,
            self.cost_model.collective_overhead if self.choices else 0,
        )

    def _node(self, node: ProgramNode) -> None:
        self.nodes.append(node)
        self.node_at[node.path] = node

    def options(self, spec: TensorSpec, source: ValueId | None) -> list[Layout]:
        """The layouts a value may take in the search: the one it has, then every output
        layout its producer's candidates give it (in their ranking order) with no other
        kind of partial than it has (a sum is not a partial max)."""
        layouts = [spec.layout]
        producer = self.node_at.get(source[0]) if source is not None else None
        if producer is not None:
            kinds = set(spec.layout.partial)
            layouts += [
                x for x in (c.out_layouts[source[1]] for c in producer.candidates) if set(x.partial) <= kinds | {None}
            ]
        return list(dict.fromkeys(layouts))

    def choose(
        self, label: str, path: str, spec: TensorSpec, source: ValueId | None, options: Sequence[Layout],
        out_aval: Aval, out_of: Callable[[Layout], Layout], row: bool, stacks: bool = False,
    ) -> Layout:
        """A value a loop passes on (a scanned input's slices, a scanned output's stack)
        whose layout the program search chooses among ``options`` (the first is eager's):
        a node with one candidate per option, needing it and giving ``out_of`` it; a row
        moving ``spec`` to the chosen option if ``row`` (else the loop's row moves it);
        ``stacks``: the node stacks the body's value (:attr:`.ProgramNode.stacks`).
        The chosen option."""
        candidates = _choice_candidates(label, spec, tuple(options), out_aval, out_of, self.mesh, self.cost_model)
        self._node(ProgramNode(path, (spec,), (source,), candidates, stacks))
        chosen = self.choices[path].in_layouts[0] if path in self.choices else options[0]
        if row and chosen != spec.layout:
            signature = self.fixed(label, (spec,), (chosen,), (spec.aval,), (chosen,))
            self.rows.append(EquationReport(path, label, (spec,), signature, (TensorSpec(spec.shape, spec.dtype, chosen),), (source,)))
        return chosen

    def move(
        self, label: str, path: str, spec: TensorSpec, source: ValueId | None, target: Layout, node: bool = True
    ) -> tuple[TensorSpec, ValueId | None]:
        """Move ``spec`` to ``target``: a row if it differs, and (``node``) a program node
        (a single candidate needing ``target``), so that the program search pays for the
        move if it changes the producer. The moved spec and the value it now is."""
        signature = self.fixed(label, (spec,), (target,), (spec.aval,), (target,))
        if node:
            self._node(ProgramNode(path, (spec,), (source,), signature.candidates))
        if spec.layout == target:
            return spec, source
        out = TensorSpec(spec.shape, spec.dtype, target)
        self.rows.append(EquationReport(path, label, (spec,), signature, (out,), (source,)))
        return out, (path, 0)

    def _equation(
        self, entry: _Equation, path: str, ins: tuple[TensorSpec, ...], srcs: tuple[ValueId | None, ...]
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        eqn, out_avals = entry.eqn, entry.out_avals
        name = eqn.primitive.name
        function = registered_function(eqn)
        if function is not None:  # a call of a function with a registered rule: one equation, not walked inside
            signature = (
                forced_signature(function.name, ins, self.choices[path], self.cost_model) if path in self.choices
                else self._ranked(path, self._busy(signature_for(
                    ("function", function.source), (), ins, out_avals, self.cost_model, self.mesh, self.gathered,
                    ranked=self.searched)))
            )
            outs = tuple(TensorSpec.of(a, x) for a, x in zip(out_avals, signature.out_layouts))
            self.rows.append(EquationReport(path, f"{name}[{function.name}]", ins, signature, outs, srcs))
            self._node(ProgramNode(path, ins, srcs, self._candidates(signature)))
            if self.executor is not None:
                self.executor.equation(eqn, signature)
            return [(o, (path, j)) for j, o in enumerate(outs)]
        unrolled = unrolled_scan(eqn) if name == "scan" else None
        if unrolled is not None:
            return self._call(eqn, f"scan[unroll={eqn.params['unroll']}]", unrolled, path, ins, srcs)
        body = called_jaxpr(eqn)
        if body is not None:
            label = f"{name}[{eqn.params['name']}]" if "name" in eqn.params else name
            return self._call(eqn, label, body, path, ins, srcs)
        if name in LOOPS:
            return self._loop(eqn, path, ins, srcs, out_avals)
        region = None  # a shard_map region's own collectives
        if name in CONSTRAINT_SHARDING_PARAMS:
            sharding = eqn.params[CONSTRAINT_SHARDING_PARAMS[name]]
            if _untyped(sharding):
                signature = self._identity(path, ins, out_avals)
            elif name == "reshard":
                signature = self._reshard(sharding, path, ins, out_avals)
            else:
                signature = self._constraint(sharding, path, ins, out_avals)
        elif name in _PASS_THROUGH:
            layouts = [s.layout for s in ins]
            signature = self.fixed(name, ins, layouts, out_avals, layouts)
        elif name in DEBUG_EFFECTS:
            partitioned = eqn.params.get("partitioned", False)
            layouts = [s.layout.without_partial() if partitioned else s.layout.replicated() for s in ins]
            signature = self.fixed(name, ins, layouts, out_avals, ())
        elif name in HOST_CALLBACKS:
            return self._host_callback(entry, path, ins, srcs)
        elif name == "shard_map":
            if self.manual is not None:  # a region inside a partially manual one's body: that region whole
                raise UnsupportedOpError("primitive", name, "a region nested in a partially manual region's body",
                                         "the outer region is taken with its whole in_specs")
            signature, region = self._shard_map(eqn, path, ins, out_avals)
        # a jax.vmap's psum over its own axis names none (positional axes): a reduction, its rule the primitive's
        elif self.manual is not None and name in _MANUAL_PRIMITIVES and named_axes(eqn):
            signature = self._manual_collective(eqn, ins, out_avals)
        else:
            signature = self._rule_signature(entry, path, ins)
        types = self._types(eqn, out_avals) if self.typed else None
        if types is not None:
            signature, made_typed = _typed_candidates(signature, ins, types)
            if made_typed:
                types = None
        outs = tuple(TensorSpec.of(a, layout) for a, layout in zip(out_avals, signature.out_layouts))
        label = signature.op if signature.op.startswith(name) else name  # e.g. 'foo (no rule: replicated)'
        self.rows.append(EquationReport(path, label, ins, signature, outs, srcs, region))
        self._node(ProgramNode(path, ins, srcs, self._candidates(signature), region=region))
        if self.manual is not None:
            self.manual.moved(eqn, path, ins, signature)
        if self.executor is not None:
            self.executor.equation(eqn, signature)
        made: list[tuple[TensorSpec, ValueId | None]] = [(o, (path, j)) for j, o in enumerate(outs)]
        if types is not None:
            return [
                out if target is None else self._out_sharding(eqn, path, j, out, out_avals[j], target)
                for j, (out, target) in enumerate(zip(made, types))
            ]
        target = None if self.typed else self._explicit_out_type(eqn, out_avals)
        return made if target is None else [self._out_sharding(eqn, path, 0, made[0], out_avals[0], target)]

    def _host_callback(
        self, entry: _Equation, path: str, ins: tuple[TensorSpec, ...], srcs: tuple[ValueId | None, ...],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """A :data:`HOST_CALLBACKS` equation: its operands Replicate, its results
        Partial(sum) over every mesh dim (the callback's device holds each, the others
        zeros), each read one then moved to Replicate by a row ``<path>.out<j>``: XLA's
        all-reduce of it over the whole mesh, one collective (:func:`.plan.mesh_all_reduce`),
        not the planner's route. A result nothing reads (dropped, ``_``) is not moved: XLA
        broadcasts none. The executor computes the results Replicate at once."""
        eqn, out_avals = entry.eqn, entry.out_avals
        everywhere = (Layout(self.mesh, ((),) * a.ndim, ("sum",) * self.mesh.ndim) for a in out_avals)
        signature = self.fixed(eqn.primitive.name, ins, [s.layout.replicated() for s in ins], out_avals,
                               tuple(everywhere))
        outs = tuple(TensorSpec.of(a, layout) for a, layout in zip(out_avals, signature.out_layouts))
        self.rows.append(EquationReport(path, eqn.primitive.name, ins, signature, outs, srcs))
        self._node(ProgramNode(path, ins, srcs, self._candidates(signature)))
        if self.executor is not None:
            self.executor.equation(eqn, signature)
        moved = []
        for j, (out, var) in enumerate(zip(outs, entry.outvars)):
            if var is None:
                moved.append((out, (path, j)))
                continue
            plan = mesh_all_reduce(out.shape, out.dtype, out.layout, self.cost_model)
            at, replicated = f"{path}.out{j}", TensorSpec(out.shape, out.dtype, plan.dst)
            candidate = Candidate((plan.dst,), (plan.dst,), (plan,), (), tuple(range(self.mesh.ndim)), (out.aval,))
            signature = Signature("callback result", (out,), (candidate,))
            self._node(ProgramNode(at, (out,), ((path, j),), signature.candidates))
            self.rows.append(EquationReport(at, "callback result", (out,), signature, (replicated,), ((path, j),)))
            moved.append((replicated, (at, 0)))
        return moved

    def _call(
        self, eqn: Any, label: str, closed: Any, path: str, ins: tuple[TensorSpec, ...],
        srcs: tuple[ValueId | None, ...],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """A call of ``closed`` (``eqn``'s inputs are its inputs, its outputs ``eqn``'s):
        a row without a signature, its equations walked at ``path.``. A nested ``jax.jit``'s
        ``in_shardings`` / ``out_shardings`` are sharding constraints (XLA's: a helper
        jitted with ``out_shardings=P("dp", None, None)`` gathers its result over ``tp``)
        on its operands before it and its results after it, rows
        ``<path>.in_sharding<i>`` / ``<path>.out_sharding<j>`` (:meth:`_annotated`)."""
        if not self.typed:
            moved = [
                self._annotated(f"{path}.in_sharding{i}", spec, src, sharding, var)
                if isinstance(sharding, NamedSharding) else (spec, src)
                for i, (spec, src, sharding, var) in enumerate(
                    zip(ins, srcs, eqn.params.get("in_shardings") or (None,) * len(ins), eqn.invars))
            ]
            ins, srcs = tuple(m[0] for m in moved), tuple(m[1] for m in moved)
        slot = len(self.rows)
        self.rows.append(EquationReport(path, label, ins, None, ()))
        self.calls.append(eqn)
        if self.executor is not None:
            self.executor.enter_call(eqn, closed)
        outs = self._closed(closed, ins, path + ".", sources=srcs)
        if self.executor is not None:
            self.executor.exit_call(eqn, closed)
        self.calls.pop()
        self.rows[slot] = EquationReport(path, label, ins, None, tuple(o for o, _ in outs), srcs)
        if self.typed:
            return outs
        return [
            self._annotated(f"{path}.out_sharding{j}", spec, src, sharding, var)
            if isinstance(sharding, NamedSharding) else (spec, src)
            for j, ((spec, src), sharding, var) in enumerate(
                zip(outs, eqn.params.get("out_shardings") or (None,) * len(outs), eqn.outvars))
        ]

    def _annotated(
        self, at: str, spec: TensorSpec, source: ValueId | None, sharding: NamedSharding, var: Any
    ) -> tuple[TensorSpec, ValueId | None]:
        """``spec`` (the value ``source``, jaxpr variable ``var``) moved by a row and node at
        ``at`` to the layout of a sharding constraint to ``sharding`` (:meth:`_constraint`)."""
        signature = self._constraint(sharding, at, (spec,), (spec.aval,))
        moved = TensorSpec.of(spec.aval, signature.out_layouts[0])
        self.rows.append(EquationReport(at, "sharding_constraint", (spec,), signature, (moved,), (source,)))
        self._node(ProgramNode(at, (spec,), (source,), self._candidates(signature)))
        if self.executor is not None and not isinstance(var, core.Literal):
            self.executor.constrain(var, signature)
        return moved, (at, 0)

    def _candidates(self, signature: Signature) -> tuple[Candidate, ...]:
        """An equation's program-node candidates: every one, or the chosen one for a walk
        not searched."""
        return signature.candidates if self.searched else (signature.chosen,)

    def _loop(
        self, eqn: Any, path: str, ins: tuple[TensorSpec, ...], srcs: tuple[ValueId | None, ...],
        out_avals: tuple[Aval, ...],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """A loop or cond: its row (and body rows) are found without the executor (the
        fixed point walks the body several times); the executor then runs it under the
        row's layouts, walking the bodies again with :meth:`body_walker` inside
        ``lax.scan`` / ``while_loop`` / ``switch``."""
        executor, self.executor = self.executor, None
        slot = len(self.rows)  # the loop's own row comes first, its bodies' rows after
        try:
            outs = getattr(self, "_" + eqn.primitive.name)(eqn, path, ins, srcs, out_avals)
        finally:
            self.executor = executor
        if executor is not None:
            # the moves across the bodies' boundaries, by path: the executor makes them along their planned routes
            # (a carry's R,P -> R,R moved whole compiles as an all-reduce of the whole block where the route
            # slices it over another mesh dim first, reduces the slice and all-gathers it)
            routes = {row.path: row.signature.redistributions[0] for row in self.rows[slot + 1:]
                      if row.primitive in _BOUNDARY_MOVES and row.signature is not None}
            hoisted = self._hoisted(path, srcs[1:], slot) if eqn.primitive.name == "cond" and not self.gathered else ()
            executor.loop(self, eqn, path, self.rows[slot].signature, routes, hoisted)
        return outs

    def _hoisted(
        self, path: str, operands: tuple[ValueId | None, ...], slot: int
    ) -> tuple[tuple[int, RedistributePlan], ...]:
        """The moves of the cond at ``path`` (its row at ``slot``, its branches' after) that
        run before it (:func:`.combine.move_computations`: its branches' moves of its
        ``operands``' values, out of any branch of a cond inside too), as (operand index,
        plan), one per operand and layout; each operand holding the moved value: the
        branches read it as an operand of their own."""
        within = move_computations({row.path: row.primitive for row in self.rows[slot:]
                                    if row.primitive in LOOPS and row.path not in self.inlined})
        inside = f"{path}.b"
        hoisted: dict[tuple[int, Layout], RedistributePlan] = {}
        for row in self.rows[slot + 1:]:
            if row.signature is None:
                continue
            for source, plan in zip(row.sources, row.signature.redistributions):
                if source is None or plan.is_noop or source not in operands:
                    continue
                if within(row.path, source)[0].startswith(inside):
                    continue  # run in a branch (of a loop inside it)
                for j, operand in enumerate(operands):
                    if operand == source:
                        hoisted.setdefault((j, plan.dst), plan)
        return tuple((j, plan) for (j, _), plan in hoisted.items())

    def body_walker(self, executor: Executor) -> _Walker:
        """A walker for a loop's bodies under ``executor`` (the same choices; its rows
        and nodes are thrown away: the loop's walk recorded them)."""
        return _Walker(self.mesh, self.cost_model, self.choices, self.on_unknown, executor, gathered=self.gathered,
                       searched=self.searched, unsplit=self.unsplit, idle=self.idle,
                       typed=self.typed, manual=self.manual)

    def walk_body(self, closed: Any, ins: Sequence[TensorSpec], prefix: str) -> list[TensorSpec]:
        """The output layouts of a loop body walked at ``prefix`` on inputs ``ins``."""
        return [spec for spec, _ in self._closed(closed, ins, prefix)]

    def _rule_signature(self, entry: _Equation, path: str, ins: tuple[TensorSpec, ...]) -> Signature:
        eqn, out_avals = entry.eqn, entry.out_avals
        name = eqn.primitive.name
        try:
            definition = primitive_definition(name)
        except UnsupportedOpError:
            if self.on_unknown == "replicate":
                layouts = [Layout(self.mesh, ((),) * len(s.shape)) for s in ins]
                outs = [Layout(self.mesh, ((),) * a.ndim) for a in out_avals]
                return self.fixed(f"{name} (no rule: replicated)", ins, layouts, out_avals, outs)
            lines = [_source_line(e) for e in (eqn, *reversed(self.calls))]
            where = next((line for line in lines if line), "unknown source")
            raise UnsupportedOpError(
                "primitive", name, f"signature inference has no rule for this jaxpr primitive (at {where})",
                "express the computation with supported primitives (placements2jax.inference.primitive_names()), "
                'or pass on_unknown="replicate" to run it replicated',
            ) from None
        return self._primitive_signature(name, entry.params(definition), path, ins, out_avals)

    def _primitive_signature(
        self, name: str, params: Any, path: str, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...]
    ) -> Signature:
        """The signature primitive ``name``'s rule gives ``ins`` (``params``: its frozen
        params), as this walk takes it: the search's choice where it made one, else ranked
        and filtered (idle mesh dims, loops' unsplit dims, batch-partitioned solvers)."""
        if path in self.choices:
            return forced_signature(name, ins, self.choices[path], self.cost_model)
        signature = signature_for(
            ("primitive", name), params, ins, out_avals, self.cost_model, self.mesh, self.gathered,
            ranked=self.searched,
        )
        return self._ranked(path, self._busy(_operand_splits(signature) if name in BATCH_PARTITIONED else signature))

    def _busy(self, signature: Signature) -> Signature:
        """A rule's ``signature`` without the candidates touching :attr:`idle` mesh dims."""
        return _busy(signature, self.idle) if self.idle else signature

    def _ranked(self, path: str, signature: Signature) -> Signature:
        """``signature``, or inside a body of the loops of :attr:`unsplit` (anywhere where
        they are None) its candidates unsplit over that mesh dim first (:func:`_unsplit_first`)."""
        if self.unsplit is None:
            return signature
        loops, mesh_dim = self.unsplit
        if loops is not None and not any(path.startswith(loop + ".") for loop in loops):
            return signature
        return _unsplit_first(signature, mesh_dim)

    # -- control flow ------------------------------------------------------------------------
    # A loop or cond is one row (the report's: every input's move) and one program node: a
    # cond's fixes its branches' joined outputs (one candidate); a loop's chooses its
    # carries among options (:meth:`_LoopCarries.options`, the fixed point's first), needing
    # the initial values and the body's results in them and giving them to the loop's
    # results and to the body's reads of the carry (:func:`_carry_reads`). Everything else
    # threads through: the bodies' equations read the loop's constants (and a cond's
    # operands) from their producers, as a call's do; a scanned input's slices and a
    # scanned output's stack are nodes whose layout the search chooses among their
    # producers' candidates' (:meth:`choose`). Walked again with the search's choices,
    # the loop takes the layouts the search chose instead of recomputing them.

    def _carry_fixed_point(
        self, body: Any, before: Sequence[TensorSpec], carry: Sequence[TensorSpec], after: Sequence[TensorSpec],
        path: str,
    ) -> list[Layout]:
        """The carry layouts of a loop: start from the initial ones, take what the body
        returns, until it returns what it gets; if that does not settle, the initial ones
        (the body's results are then moved back to them every iteration)."""
        layouts = [s.layout for s in carry]
        for _ in range(_FIXED_POINT_ROUNDS):
            specs = [TensorSpec(s.shape, s.dtype, x) for s, x in zip(carry, layouts)]
            outs = self._closed(body, [*before, *specs, *after], path + ".", self._trial())
            new = [o.layout for o, _ in outs[: len(carry)]]
            if new == layouts:
                return layouts
            layouts = new
        return [s.layout for s in carry]

    def _constants(
        self, path: str, consts: Sequence[TensorSpec], srcs: Sequence[ValueId | None]
    ) -> tuple[list[TensorSpec], list[ValueId | None]]:
        """A loop's constants as its bodies read them, and the values they are: as their
        producers give them, but those the choices move (``<path>.const<i>``: the restart
        from replicas over a mesh dim, :func:`_replicated_carries`), each then a program
        node needing the chosen layout (the loop's row makes the move)."""
        specs, sources = list(consts), list(srcs)
        for i, (spec, source) in enumerate(zip(consts, srcs)):
            key = f"{path}.const{i}"
            if key in self.choices:
                target = self.choices[key].in_layouts[0]
                signature = self.fixed("loop constant", (spec,), (target,), (spec.aval,), (target,))
                self._node(ProgramNode(key, (spec,), (source,), signature.candidates))
                specs[i], sources[i] = TensorSpec(spec.shape, spec.dtype, target), (key, 0)
        return specs, sources

    def _carried_back(
        self, label: str, path: str, outs: Sequence[tuple[TensorSpec, ValueId | None]], carry: Sequence[TensorSpec]
    ) -> list[TensorSpec]:
        """The body's results moved back to the carries' layouts: a row each that moves
        (the loop's program node prices these moves: its candidates need the results in
        the carries' layouts)."""
        return [self.move(label, f"{path}.carry{i}", o, s, c.layout, node=False)[0]
                for i, ((o, s), c) in enumerate(zip(outs, carry))]

    def _carry_layouts(self, path: str, n: int, find: Callable[[], Sequence[Layout]]) -> list[Layout]:
        """The ``n`` carry layouts of loop ``path``: as the search chose them, else ``find()``."""
        return list(self.choices[path].in_layouts[:n]) if path in self.choices else list(find())

    def _loop_row(
        self, path: str, label: str, ins: tuple[TensorSpec, ...], in_layouts: Sequence[Layout],
        out_avals: Sequence[Aval],
    ) -> int:
        """Append the loop's row (its input moves); its outputs are filled in later."""
        replicated = [Layout(self.mesh, ((),) * a.ndim) for a in out_avals]
        signature = self.fixed(label, ins, in_layouts, out_avals, replicated)
        self.rows.append(EquationReport(path, label, ins, signature, ()))
        return len(self.rows) - 1

    def _finish_loop_row(
        self, slot: int, srcs: tuple[ValueId | None, ...], outs: Sequence[TensorSpec], fixed: Sequence[int],
        out_sources: Sequence[ValueId | None] = (), returned: Sequence[tuple[TensorSpec, ValueId | None]] = (),
        reads: int = 0, consts: Sequence[TensorSpec] = (),
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """Fill in the loop's row and add its node: the inputs ``fixed`` (by index) to the
        row's layouts, giving the outputs but the last ``len(out_sources)`` (the values
        those are). A loop's carries (``fixed``, with the body's results ``returned``)
        are the search's to choose: the node needs both in one of the carry options
        (:meth:`_LoopCarries.options`) and gives it to the loop's results and to the
        ``reads`` groups of the carry's reads (:func:`_carry_reads`); ``consts``: the
        loop's constants as its bodies read them (:meth:`_constants`)."""
        row = self.rows[slot]
        candidate = dataclasses.replace(row.signature.chosen, out_layouts=tuple(o.layout for o in outs))
        signature = Signature(row.signature.op, row.inputs, (candidate,))
        self.rows[slot] = EquationReport(row.path, row.primitive, row.inputs, signature, tuple(outs), srcs)
        own = outs[: len(outs) - len(out_sources)]
        inits = tuple(row.inputs[i] for i in fixed)
        if returned:
            loop = _LoopCarries(row.primitive, inits, tuple(o for o, _ in returned),
                                tuple(candidate.in_layouts[i] for i in fixed), reads,
                                tuple(tuple(self.options(o, s)) for o, s in returned), tuple(consts))
            self.loops[row.path] = loop
            candidates = _carry_candidates(loop.op, inits + loop.returned, loop.options(), reads, self.cost_model)
            sources = tuple(srcs[i] for i in fixed) + tuple(s for _, s in returned)
            self._node(ProgramNode(row.path, inits + loop.returned, sources, candidates))
        else:
            node = self.fixed(row.primitive, inits, [candidate.in_layouts[i] for i in fixed],
                              [o.aval for o in own], [o.layout for o in own])
            self._node(ProgramNode(row.path, inits, tuple(srcs[i] for i in fixed), node.candidates))
        return [(o, (row.path, j)) for j, o in enumerate(own)] + list(zip(outs[len(own):], out_sources))

    def _scan(
        self, eqn: Any, path: str, ins: tuple[TensorSpec, ...], srcs: tuple[ValueId | None, ...],
        out_avals: tuple[Aval, ...],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """``scan``: scanned inputs keep dim 0 whole (a rank cannot run only its own
        iterations), each iteration sees their slices; the carry's layouts are the
        search's choice, else a fixed point of the body; stacked outputs get an unsplit
        dim 0. The body's rows appear once (as the compiled loop body does), not once per
        iteration (``unroll=k``: k times, :func:`unrolled_scan`). The layouts of the scanned
        inputs and outputs are the search's to choose (:meth:`choose`), a stacked output
        also replicated where the walk saw it partial."""
        body = eqn.params["jaxpr"]
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        if eqn.params["length"] == 1:
            self.inlined[path] = len(self.nodes)
        consts, const_srcs = self._constants(path, ins[:nc], srcs[:nc])
        init, xs = ins[nc:nc + nk], ins[nc + nk:]
        stacked = [
            self.choose("scan xs", f"{path}.xs{i}", x, s, list(dict.fromkeys(map(_unsplit_dim0, self.options(x, s)))),
                        Aval(x.shape[1:], x.dtype), _drop_dim0, row=False)
            for i, (x, s) in enumerate(zip(xs, srcs[nc + nk:]))
        ]
        slices = [TensorSpec(x.shape[1:], x.dtype, _drop_dim0(u)) for x, u in zip(xs, stacked)]
        carry_layouts = self._carry_layouts(
            path, nk, lambda: self._carry_fixed_point(body, consts, init, slices, path)
        )
        slot = self._loop_row(path, "scan", ins, [c.layout for c in consts] + carry_layouts + stacked, out_avals)
        carry = [TensorSpec(s.shape, s.dtype, x) for s, x in zip(init, carry_layouts)]
        slice_sources = [(f"{path}.xs{i}", 0) for i in range(len(xs))]
        self.sliced.update(zip(slice_sources, srcs[nc + nk:]))
        sources = [*const_srcs, *_carry_reads(path, nk, 1), *slice_sources]
        outs = self._closed(body, [*consts, *carry, *slices], path + ".", sources=sources)
        back = self._carried_back("scan carry", path, outs[:nk], carry)
        ys = []
        for i, (a, (o, s)) in enumerate(zip(out_avals[nk:], outs[nk:])):
            # also the value reduced: a value the walk saw partial (the residual stream read from a carry walked
            # partial) is replicated once the search reduces that carry, and stacking it partial then is a free local
            # move that the backward scan pays for, all-reducing its slices each layer (the stacked LM's adamw step:
            # 3,072 B and one collective per layer); no candidate gave the search the replicated stack
            options = list(dict.fromkeys([*self.options(o, s), o.layout.without_partial()]))
            chosen = self.choose(
                "scan ys", f"{path}.ys{i}", o, s, options, a, _stacked, row=True, stacks=True
            )
            ys.append(TensorSpec(a.shape, a.dtype, _stacked(chosen)))
        ys_sources = [(f"{path}.ys{i}", 0) for i in range(len(ys))]
        if path in self.inlined:
            self.returned.update(zip([*((path, j) for j in range(nk)), *ys_sources], (s for _, s in outs)))
        else:
            names = [*(f"{path}.carry{j}" for j in range(nk)), *(f"{path}.ys{i}" for i in range(len(ys)))]
            self.results[path] = tuple(zip(names, (s for _, s in outs)))
        return self._finish_loop_row(slot, srcs, [*back, *ys], range(nc, nc + nk), ys_sources, outs[:nk], 1, consts)

    def _while(
        self, eqn: Any, path: str, ins: tuple[TensorSpec, ...], srcs: tuple[ValueId | None, ...],
        out_avals: tuple[Aval, ...],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """``while``: the carry's layouts are the search's choice, else a fixed point of the
        body; the condition is walked on them and its predicate must be Replicate (every
        rank decides alike)."""
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        consts, const_srcs = self._constants(path, ins[:cn + bn], srcs[:cn + bn])
        cond_consts, body_consts, init = consts[:cn], consts[cn:], ins[cn + bn:]
        carry_layouts = self._carry_layouts(
            path, len(init), lambda: self._carry_fixed_point(p["body_jaxpr"], body_consts, init, (), path + ".body")
        )
        slot = self._loop_row(path, "while", ins, [c.layout for c in consts] + carry_layouts, out_avals)
        carry = [TensorSpec(s.shape, s.dtype, x) for s, x in zip(init, carry_layouts)]
        ((predicate, source),) = self._closed(
            p["cond_jaxpr"], [*cond_consts, *carry], path + ".cond.",
            sources=[*const_srcs[:cn], *_carry_reads(path, len(init), 1)],
        )
        everywhere = Layout(self.mesh, ((),) * predicate.layout.ndim)
        self.move("while predicate", f"{path}.cond.out", predicate, source, everywhere)
        outs = self._closed(
            p["body_jaxpr"], [*body_consts, *carry], path + ".body.",
            sources=[*const_srcs[cn:], *_carry_reads(path, len(init), 2)],
        )
        back = self._carried_back("while carry", path, outs, carry)
        return self._finish_loop_row(slot, srcs, back, range(cn + bn, len(ins)), (), outs, 2, consts)

    def _cond(
        self, eqn: Any, path: str, ins: tuple[TensorSpec, ...], srcs: tuple[ValueId | None, ...],
        out_avals: tuple[Aval, ...],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """``cond`` / ``switch``: the index must be Replicate; every branch is walked on
        the operands; each output takes, among the branches' layouts for it, the one
        cheapest to reach from all branches (ties: the first branch's), and branches
        that produced another layout move to it (a walk given the cond's choice joins
        in its outputs' layouts: :func:`_rejoin_conds`)."""
        index, operands = ins[0], ins[1:]
        index_layout = Layout(self.mesh, ((),) * index.layout.ndim)
        slot = self._loop_row(path, "cond", ins, [index_layout] + [s.layout for s in operands], out_avals)
        branches = [
            self._closed(b, operands, f"{path}.b{k}.", sources=srcs[1:]) for k, b in enumerate(eqn.params["branches"])
        ]
        if path in self.choices:
            joined = list(self.choices[path].out_layouts)
        else:
            joined = []
            for i in range(len(out_avals)):
                options = list(dict.fromkeys(b[i][0].layout for b in branches))

                def total(target: Layout, i: int = i) -> Fraction:
                    outs = (b[i][0] for b in branches)
                    plans = (cached_plan(o.shape, o.dtype, o.layout, target, self.cost_model) for o in outs)
                    return sum((plan.cost for plan in plans), Fraction(0))

                joined.append(min(options, key=total))
        for k, outs in enumerate(branches):
            for i, ((o, s), target) in enumerate(zip(outs, joined)):
                self.move("cond join", f"{path}.b{k}.out{i}", o, s, target)
        for i in range(len(out_avals)):
            self.joins[path, i] = tuple(outs[i][1] for outs in branches if outs[i][1] is not None)
        return self._finish_loop_row(slot, srcs, [TensorSpec(a.shape, a.dtype, x) for a, x in zip(out_avals, joined)], (0,))

    # -- annotations in user code ------------------------------------------------------------

    @cached_property
    def _axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.mesh.axis_names, self.mesh.shape))

    def _check_mesh(self, argument: str, value: Any, jax_mesh: Any) -> None:
        if tuple(jax_mesh.axis_names) != self.mesh.axis_names or tuple(jax_mesh.axis_sizes) != self.mesh.shape:
            raise InferenceError(
                argument, value, f"its mesh is not the inputs' mesh {self.mesh!r}",
                "use a sharding or shard_map on the same mesh (mesh.to_jax())",
            )

    def _shard_map(
        self, eqn: Any, path: str, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...]
    ) -> tuple[Signature, Region]:
        """A ``shard_map`` region and what its body sends (:mod:`.regions`): its ``in_specs``
        / ``out_specs`` are fixed layouts (its body is per-device code, not walked by the
        search). A region manual over some mesh axes alone (``axis_names=``) leaves the
        others to XLA, which partitions its body over them as it partitions any code: its
        operands keep their layouts over those axes, and its results take the layouts its
        body makes there. Its first candidate is that: its operands needed over its manual
        axes as its in_specs say and as they arrive over the others (their partials
        reduced), its body walked on them over those others (:meth:`_region_body`), its
        results as its out_specs say over its manual axes (major: a value's global dim is
        its blocks' over them) and as the body makes them over the others; its second, the
        in_specs and out_specs as whole layouts (Replicate over the others), where the
        search may still take them. The body's own moves over the others (an
        ``all_gather``'s operand gathered there first, as XLA does) are region collectives
        too. Where the whole layouts send no more bytes (their moves and what the body
        sends: the search's objective leaves the body's out, so it would take the first
        wherever its operands arrive so), or where the body holds a nested region, a
        primitive without a rule or a loop's boundary move, the region is the whole
        layouts alone; in a typed trace too (inside ``jax.set_mesh`` of an Explicit mesh
        XLA gathers such a region's operand and result over the other axes at its
        boundary, jax 0.10.2: the row-parallel region below 384 B there, its body's walk
        192, the whole layouts 448). A row-parallel
        ``psum`` region manual over ``tp`` on a batch split over ``dp`` keeps the batch
        split (XLA's 192 B all-reduce of the block, where gathering it over ``dp`` first
        sent 448)."""
        p = eqn.params
        self._check_mesh("shard_map mesh", p["mesh"], p["mesh"])
        in_layouts = tuple(
            Layout.from_partition_spec(self.mesh, spec, s.layout.ndim) for spec, s in zip(p["in_specs"], ins)
        )
        out_layouts = tuple(
            Layout.from_partition_spec(self.mesh, spec, a.ndim) for spec, a in zip(p["out_specs"], out_avals)
        )
        names = self.mesh.axis_names
        manual = frozenset(names.index(a) for a in p.get("newly_manual_axes", names) if a in names)
        whole = self.fixed("shard_map", ins, in_layouts, out_avals, out_layouts)
        auto = [m for m in range(self.mesh.ndim) if m not in manual and self.mesh.shape[m] > 1]
        if not auto or self.typed:
            return whole, region_collectives(eqn, self._axis_sizes)
        chosen = self.choices.get(path)
        if chosen is not None:  # the search's (or a walk's given) choice: its body walked on its layouts
            if chosen.in_layouts == in_layouts:
                return whole, region_collectives(eqn, self._axis_sizes)
            needs = chosen.in_layouts
        else:
            needs = tuple(_with_manual(need, s.layout.without_partial(), manual) for need, s in zip(in_layouts, ins))
        walked = None if needs == in_layouts else self._region_body(eqn, needs, manual)
        if walked is None:
            return whole, region_collectives(eqn, self._axis_sizes)
        made, walk = walked
        outs = tuple(_with_manual(spec, body, manual) for spec, body in zip(out_layouts, made))
        region = region_collectives(eqn, self._axis_sizes, walk.block_bytes, walk.moves)
        kept = self.fixed("shard_map", ins, needs, out_avals, outs)
        if chosen is not None:
            return kept, region
        whole_region = region_collectives(eqn, self._axis_sizes)
        if _sent_bytes(kept, region) >= _sent_bytes(whole, whole_region):
            return whole, whole_region
        return Signature("shard_map", ins, (kept.chosen, whole.chosen)), region

    def _region_body(
        self, eqn: Any, needs: Sequence[Layout], manual: frozenset[int]
    ) -> tuple[tuple[Layout, ...], _Manual] | None:
        """The layouts a partially manual region's body (:meth:`_shard_map`) makes over the
        mesh dims it leaves to XLA, its operands in ``needs`` (``manual``: its manual
        mesh dims, which split its per-device values nowhere), and its walk's record
        (:class:`_Manual`: its collectives' per-device result bytes and its equations'
        operand moves, :func:`.regions.region_collectives`' ``block_bytes`` and ``moves``);
        None where the walk meets a primitive without a rule or a nested region, moves a
        value across a loop's or branch's boundary, or leaves a result over a manual mesh
        dim."""
        body = eqn.params["jaxpr"]
        body = getattr(body, "jaxpr", body)
        specs = [
            TensorSpec.of(_aval(var), _without_mesh_dims(need, manual)) for var, need in zip(body.invars, needs)
        ]
        walker = _Walker(self.mesh, self.cost_model, {}, gathered=self.gathered, searched=False,
                         idle=tuple(sorted(manual.union(self.idle))), manual=_Manual())
        try:
            outs = walker.walk(body, _const_specs(body, self.mesh), specs, "", [None] * len(specs))
        except Placements2JaxError:
            return None
        recorded = walker.manual.paths
        if any(step.communicates for row in walker.rows if row.signature is not None and row.path not in recorded
               for plan in row.signature.redistributions for step in plan.steps):
            return None  # a loop's or branch's boundary move
        made = tuple(spec.layout for spec, _ in outs)
        if any(_touches(layout, manual) for layout in made):
            return None
        return made, walker.manual

    def _manual_collective(self, eqn: Any, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...]) -> Signature:
        """A collective over a region's manual axes (or its ``axis_index``) in the walk of a
        partially manual region's body (:meth:`_region_body`), over the mesh dims XLA
        partitions: each operand as it comes where the collective is linear in it
        (``psum`` of a partial sum is a partial sum), its partials reduced otherwise;
        an ``all_gather``, ``psum_scatter`` or ``all_to_all`` on operands Replicate there:
        XLA gathers them whole over those mesh dims first (a ``psum_scatter`` of a block
        split over ``dp`` by its batch: an all-gather over ``dp``, then the
        reduce-scatter of the whole, measured), a move of the body's (:class:`_Manual`); its
        results laid out as its operands are. Records each result's per-device bytes."""
        name, p = eqn.primitive.name, eqn.params
        dims = any(k in p for k in ("all_gather_dimension", "scatter_dimension", "split_axis"))
        needs, outs = [], []
        for spec, aval in zip(ins, out_avals):
            layout = spec.layout if name in _LINEAR_MANUAL else spec.layout.without_partial()
            if dims:
                layout = layout.replicated()
            needs.append(layout)
            outs.append(layout if layout.ndim == aval.ndim else Layout(self.mesh, ((),) * aval.ndim))
        if not ins:  # axis_index
            outs = [Layout(self.mesh, ((),) * a.ndim) for a in out_avals]
        for var, aval, layout in zip(eqn.outvars, out_avals, outs):
            self.manual.block_bytes[var] = block_bytes(aval.shape, aval.dtype.itemsize, layout.dim_axes,
                                                       self.mesh.shape)
        return self.fixed(name, ins, needs, out_avals, outs)

    def _explicit_out_type(self, eqn: Any, out_avals: tuple[Aval, ...]) -> _Type | None:
        """An equation's explicit ``out_sharding`` (:func:`_explicit_out_sharding`) as a
        :class:`_Type` on the inputs' mesh, or None."""
        sharding = _explicit_out_sharding(eqn)  # None for an equation without one output
        return None if sharding is None else self._type(sharding, out_avals[0].ndim, "out_sharding")

    def _types(self, eqn: Any, out_avals: tuple[Aval, ...]) -> tuple[_Type | None, ...] | None:
        """An equation's outputs' sharding types in a typed trace (:func:`_typed_trace`):
        per output, its type (:meth:`_type`) or None; None where no output has one."""
        types = tuple(
            self._type(getattr(var.aval, "sharding", None), aval.ndim, "sharding type")
            for var, aval in zip(eqn.outvars, out_avals)
        )
        return None if all(t is None for t in types) else types

    def _type(self, sharding: Any, ndim: int, argument: str) -> _Type | None:
        """``sharding`` (a value's type, an ``out_sharding``, a ``reshard``'s target) as a
        :class:`_Type` on the inputs' mesh: what it fixes over its mesh's Explicit axes;
        None where it fixes nothing (no NamedSharding, the empty mesh, no Explicit axis:
        inside ``jax.sharding.auto_axes`` over every axis the layout is XLA's)."""
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
            return None
        self._check_mesh(argument, sharding, sharding.mesh)
        names = self.mesh.axis_names
        over = frozenset(names.index(n) for n, t in zip(sharding.mesh.axis_names, sharding.mesh.axis_types)
                         if t == AxisType.Explicit)
        if not over:
            return None
        return _Type(Layout.from_partition_spec(self.mesh, sharding.spec, ndim), over, len(over) == self.mesh.ndim)

    def _into_type(self, path: str, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...], type_: _Type,
                   op: str) -> Signature:
        """The signature of a move of ``ins[0]`` into ``type_`` (a typed output's row, a
        ``reshard``): the fixed one into its layout where it fixes every mesh dim; else the
        identity's candidates (:meth:`_identity`) holding it, the search free over the
        mesh dims it leaves to XLA (the fixed one where none does)."""
        if not type_.whole:
            identity = self._identity(path, ins, out_avals)
            kept = tuple(c for c in identity.candidates if type_.holds(c.out_layouts[0]))
            if kept:
                return Signature(identity.op, identity.inputs, kept)
        return self.fixed(op, ins, (type_.layout,), out_avals, (type_.layout,))

    def _out_sharding(
        self, eqn: Any, path: str, j: int, made: tuple[TensorSpec, ValueId | None], aval: Aval, target: _Type
    ) -> tuple[TensorSpec, ValueId | None]:
        """An equation's explicit ``out_sharding`` (:meth:`_explicit_out_type`), or the
        sharding type of its output ``j`` in a typed trace where no candidate of its rule
        takes its inputs as they come and makes the types (:func:`_typed_candidates`: JAX
        computes a partial result and reduces it, e.g. a matmul contracting a split dim),
        as the annotation it is: the output moved to ``target`` by a row
        ``<path>.out_sharding`` (``.out_sharding<j>`` for an equation's later outputs)
        with that fixed layout (:meth:`_into_type`: over the Explicit axes alone on a mesh with
        Auto ones), as ``with_sharding_constraint`` is (the equation itself runs under any
        of its candidates, then the move)."""
        out, src = made
        at = f"{path}.out_sharding{j or ''}"
        signature = self._into_type(at, (out,), (aval,), target, "out_sharding")
        moved = TensorSpec.of(aval, signature.out_layouts[0])
        self.rows.append(EquationReport(at, "out_sharding", (out,), signature, (moved,), (src,)))
        self._node(ProgramNode(at, (out,), (src,), self._candidates(signature)))
        if self.executor is not None:
            self.executor.constrain(eqn.outvars[j], signature)
        return moved, (at, 0)

    def _identity(self, path: str, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...]) -> Signature:
        """The signature of an equation that moves nothing (:func:`_untyped`'s reshards):
        the identity's (``copy_p``), every layout passing as it comes."""
        return self._primitive_signature("copy_p", primitive_definition("copy_p").read_params({}), path, ins, out_avals)

    def _reshard(
        self, sharding: NamedSharding, path: str, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...]
    ) -> Signature:
        """A ``reshard`` into its target's type (:meth:`_into_type`): JAX lowers it as a
        constraint on its mesh's Explicit axes alone, the Auto ones left to XLA
        (``lower_with_sharding_in_types``: none at all when every axis is Auto), so on a
        mesh with Auto axes (``jax.sharding.auto_axes`` enters its region by a reshard to
        the mesh with those axes Auto) the identity's candidates agreeing with its spec over
        the Explicit axes, the search free over the others. It was a constraint to the spec
        over every axis:
        ``auto_axes(lambda x, w: jnp.tanh(x @ w), out_sharding=P("dp", None))`` on ``x``
        ``S(0),R`` and ``w`` ``R,S(1)`` gathered both (1,792 B where XLA's 384)."""
        type_ = self._type(sharding, out_avals[0].ndim, "dst_sharding")
        if type_ is None:
            return self._identity(path, ins, out_avals)
        return self._into_type(path, ins, out_avals, type_, "sharding_constraint")

    def _constraint(
        self, sharding: Any, path: str, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...]
    ) -> Signature:
        """A ``with_sharding_constraint``: its layout, fixed. A dim it leaves
        ``PartitionSpec.UNCONSTRAINED`` is XLA's to choose: the identity's candidates
        (:meth:`_identity`) agreeing with it on the other dims, without partials and
        splitting those dims over mesh dims the others do not name, the search free among
        them (the fixed layout with those dims unsplit where none does)."""
        if not isinstance(sharding, NamedSharding):
            raise UnsupportedOpError(
                "sharding", sharding, "with_sharding_constraint is only understood with a NamedSharding",
                "pass NamedSharding(mesh.to_jax(), PartitionSpec(...))",
            )
        self._check_mesh("sharding", sharding, sharding.mesh)
        free = {d for d, entry in enumerate(sharding.spec) if entry is PartitionSpec.UNCONSTRAINED}
        named = PartitionSpec(*(None if d in free else entry for d, entry in enumerate(sharding.spec)))
        target = Layout.from_partition_spec(self.mesh, named, ins[0].layout.ndim)
        if free:
            used = {m for axes in target.dim_axes for m in axes}

            def holds(layout: Layout) -> bool:
                return not layout.has_partial and not layout.is_strided and all(
                    not used.intersection(axes) if d in free else axes == target.dim_axes[d]
                    for d, axes in enumerate(layout.dim_axes))

            identity = self._identity(path, ins, out_avals)
            kept = tuple(c for c in identity.candidates if holds(c.out_layouts[0]))
            if kept:
                return Signature("sharding_constraint", identity.inputs, kept)
        return self.fixed("sharding_constraint", ins, (target,), out_avals, (target,))


@cached(maxsize=1024)
def _fixed_signature(
    op: str, ins: tuple[TensorSpec, ...], in_layouts: tuple[Layout, ...], out_avals: tuple[Aval, ...],
    out_layouts: tuple[Layout, ...], mesh: DeviceMesh, cost_model: CostModel, overhead: Overhead = 0,
) -> Signature:
    """The one signature of an op whose layouts are fixed (cached, as every signature is:
    the program search keys its cache on the signatures' identities); ``overhead``: as
    :func:`.plan.cached_plan`'s."""
    plans = tuple(cached_plan(s.shape, s.dtype, s.layout, t, cost_model, overhead) for s, t in zip(ins, in_layouts))
    candidate = Candidate(in_layouts, out_layouts, plans, (), tuple(range(mesh.ndim)), out_avals)
    return Signature(op, ins, (candidate,))


def _carry_reads(path: str, n: int, group: int) -> list[ValueId]:
    """The values a loop's body (``group`` 1; a while's condition 1, body 2) reads its ``n``
    carries as: outputs of the loop's program node after its ``n`` results, one group
    each, so that the consumers of a carry in one body share its redistributions (one
    all-reduce of a partial carry for all of them) as they share any value's."""
    return [(path, group * n + i) for i in range(n)]


@cached(maxsize=1024)
def _carry_candidates(
    op: str, ins: tuple[TensorSpec, ...], options: tuple[tuple[Layout, ...], ...], reads: int, cost_model: CostModel
) -> tuple[Candidate, ...]:
    """A loop's program node candidates (:meth:`_Walker._finish_loop_row`), one per carry
    option: ``ins`` (the initial values, then the body's results) needed in its layouts,
    which the loop's results and ``reads`` groups of the carry's reads take. Cached: the
    program search keys its cache on the candidates' identities."""
    n = len(options[0])
    avals = tuple(s.aval for s in ins[:n])
    mesh = ins[0].layout.mesh
    return tuple(_node_candidate(ins, option * 2, avals * (1 + reads), option * (1 + reads), mesh, cost_model)
                 for option in options)


@cached(maxsize=1024)
def _choice_candidates(
    op: str, spec: TensorSpec, options: tuple[Layout, ...], out_aval: Aval, out_of: Callable[[Layout], Layout],
    mesh: DeviceMesh, cost_model: CostModel,
) -> tuple[Candidate, ...]:
    """One candidate per option of :meth:`_Walker.choose` (cached: the program search
    keys its cache on the candidates' identities)."""
    return tuple(_node_candidate((spec,), (x,), (out_aval,), (out_of(x),), mesh, cost_model) for x in options)


def _node_candidate(
    ins: tuple[TensorSpec, ...], in_layouts: tuple[Layout, ...], out_avals: tuple[Aval, ...],
    out_layouts: tuple[Layout, ...], mesh: DeviceMesh, cost_model: CostModel,
) -> Candidate:
    """One option of a loop's or a loop value's program node: :func:`_fixed_signature`'s
    candidate, its plans built when read (:class:`.plan.InputPlans`, the same plans): the
    search reads the options' layouts alone, and building every option's plans was ~6%
    of GPT-2's walks."""
    return Candidate(in_layouts, out_layouts, None, (), tuple(range(mesh.ndim)), out_avals, Fraction(0),
                     InputPlans(ins, cost_model))


# -- search="torch": torch's dispatcher's choice, equation by equation ----------------------------
# jaxpr primitives as the named ops torch's dispatch knows (interop.torch_dispatch maps those
# onto aten ops); a primitive missing here takes the eager choice.
_TORCH_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "max": "maximum", "min": "minimum"}
_TORCH_UNARY = {
    "exp": "exp", "log": "log", "tanh": "tanh", "neg": "neg", "sin": "sin", "cos": "cos", "sqrt": "sqrt",
    "rsqrt": "rsqrt", "abs": "abs", "sign": "sign", "logistic": "sigmoid", "erf": "erf",
}
_TORCH_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


def _torch_op(
    primitive: str, params: Mapping[str, Any], ins: Sequence[TensorSpec]
) -> tuple[str, dict[str, Any]] | None:
    """The named op (and its params) torch's dispatch runs for a jaxpr equation, or None
    when torch has no such single op: ``dot_general`` as ``mm`` / ``bmm`` (``matmul``),
    elementwise binary and unary primitives, ``reduce_sum/max/min``, ``transpose`` and
    ``reshape`` (torch's ``view``)."""
    if primitive in _TORCH_BINARY and len(ins) == 2:
        return _TORCH_BINARY[primitive], {}
    if primitive in _TORCH_UNARY and len(ins) == 1:
        return _TORCH_UNARY[primitive], {}
    if primitive in _TORCH_REDUCTIONS:
        return _TORCH_REDUCTIONS[primitive], {"axis": tuple(params["axes"])}
    if primitive == "transpose":
        return "transpose", {"axes": tuple(params["permutation"])}
    if primitive == "reshape" and params.get("dimensions") is None:
        return "reshape", {"shape": tuple(params["new_sizes"])}
    if primitive == "dot_general" and len(ins) == 2:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        ranks = (len(ins[0].shape), len(ins[1].shape))
        if ranks == (2, 2) and (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) == ((1,), (0,), (), ()):
            return "matmul", {}
        if ranks == (3, 3) and (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) == ((2,), (1,), (0,), (0,)):
            return "matmul", {}
    return None


class _TorchWalker(_Walker):
    """The eager walk, asking torch's dispatcher (``infer_signature(..., search="torch")``)
    for every equation :func:`_torch_op` maps; records those choices (path -> candidate) in
    ``picked``. Torch's strided shards (a reshape's ``_StridedShard``, and the ops torch
    runs on one without moving it) are carried as they are."""

    def __init__(self, *args: Any, picked: dict[str, Candidate] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.picked: dict[str, Candidate] = {} if picked is None else picked

    def _trial(self) -> _Walker:
        return _TorchWalker(self.mesh, self.cost_model, self.choices, self.on_unknown, picked=self.picked)

    def _rule_signature(self, entry: _Equation, path: str, ins: tuple[TensorSpec, ...]) -> Signature:
        eqn = entry.eqn
        mapped = _torch_op(eqn.primitive.name, eqn.params, ins)
        if mapped is not None:
            from .select import infer_signature  # the public entry: search="torch" validated there

            op, params = mapped
            try:
                signature = infer_signature(
                    op, list(ins), self.mesh, cost_model=self.cost_model, search="torch", **params
                )
            except (InferenceError, UnsupportedOpError):  # no aten op for these inputs
                pass
            else:
                self.picked[path] = signature.chosen
                return forced_signature(eqn.primitive.name, ins, signature.chosen, self.cost_model)
        self.picked.pop(path, None)
        return super()._rule_signature(entry, path, ins)


def _torch_walk(
    closed: Any, consts: Sequence[TensorSpec], specs: Sequence[TensorSpec], mesh: DeviceMesh, model: CostModel,
    on_unknown: str,
) -> dict[str, Candidate]:
    """``predict(search="torch")``'s choices: torch's candidate per equation it maps."""
    walker = _TorchWalker(mesh, model, {}, on_unknown, typed=_is_typed(closed.jaxpr))
    walker.walk(closed.jaxpr, consts, specs, "", [("in", i) for i in range(len(specs))])
    return dict(walker.picked)
