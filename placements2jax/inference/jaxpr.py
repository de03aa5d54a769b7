"""Predicting the layouts of a whole JAX function by walking its jaxpr.

``predict(fn, *inputs)`` traces ``fn`` with ``jax.make_jaxpr`` on shape/dtype stand-ins
and walks it once giving every equation the signature inference chooses for its inputs'
layouts (the same cached selection as :func:`infer_signature`, with the primitive's
rule), as eager torch DTensor would dispatch op by op, recording the dataflow. Unless
``search="eager"``, :mod:`.program` then chooses all signatures for the whole program and
a second walk applies that choice. Call-like equations (``jit`` /
``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``closed_call``) are walked
inside; ``with_sharding_constraint`` and ``reshard`` force their layout (the report shows
the plan to it).
Literals and closed-over constants are Replicate. Unknown primitives (``while``, ``scan``,
``cond``, ``shard_map``...) raise :class:`UnsupportedOpError` naming them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

import jax
from jax.extend import core
from jax.sharding import NamedSharding

from ..errors import InferenceError, Placements2JaxError, UnsupportedOpError
from ..layout import Layout
from ..mesh import DeviceMesh
from .cost import CostModel, CostModelLike, resolve_cost_model
from .ops import freeze, primitive_definition
from .plan import _plan
from .program import ProgramGraph, ProgramNode, ValueId, forced_signature, select_program
from .select import signature_for
from .signature import (
    Aval,
    Candidate,
    RedistributePlan,
    RedistributeStep,
    Signature,
    TensorSpec,
    as_tensor_specs,
    layout_text,
    replicated,
)
from .table import format_bytes, format_table

__all__ = ["EquationReport", "Prediction", "predict"]

# call-like primitives and the param holding the called jaxpr (loops are not calls)
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}
# sharding constraints and the param holding the target sharding
_CONSTRAINTS = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}


@dataclass(frozen=True)
class EquationReport:
    """One equation of the walked jaxpr: its inputs' layouts, the signature chosen (None
    for a call, whose equations follow with a deeper ``path``), its outputs' layouts."""

    path: str
    primitive: str
    inputs: tuple[TensorSpec, ...]
    signature: Signature | None
    outputs: tuple[TensorSpec, ...]
    sources: tuple[ValueId | None, ...] = ()  # the value each input is (None: a literal or constant)

    @property
    def depth(self) -> int:
        return self.path.count(".")

    @property
    def steps(self) -> tuple[tuple[int, RedistributeStep], ...]:
        """(input index, step) for every redistribution step this equation needs."""
        if self.signature is None:
            return ()
        return tuple((i, s) for i, plan in enumerate(self.signature.redistributions) for s in plan.steps)

    @property
    def cost(self) -> Fraction:
        return self.signature.cost if self.signature is not None else Fraction(0)


@dataclass(frozen=True)
class Prediction:
    """The predicted layouts of a function's outputs and the per-equation report.

    ``outputs`` are flat (``jax.tree.leaves`` order of the function's result);
    ``out_tree`` rebuilds the result's structure; ``search`` says how the signatures were
    chosen (see :func:`predict`).
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    equations: tuple[EquationReport, ...]
    out_tree: Any
    search: str = "eager"  # how the signatures were chosen: "eager" or "program"

    @property
    def out_layouts(self) -> tuple[Layout, ...]:
        return tuple(s.layout for s in self.outputs)

    @property
    def redistributions(self) -> tuple[RedistributePlan, ...]:
        """Every planned redistribution. Chosen for the whole program, one per value and
        layout: consumers needing a value in the same layout share it (a compiled program
        computes it once); eager dispatch runs each equation's own."""
        plans, seen = [], set()
        for eqn in self.equations:
            for i, plan in enumerate(eqn.signature.redistributions if eqn.signature is not None else ()):
                source = eqn.sources[i] if i < len(eqn.sources) else None
                if plan.is_noop or (self.search == "program" and source is not None and (source, plan.dst) in seen):
                    continue
                seen.add((source, plan.dst))
                plans.append(plan)
        return tuple(plans)

    @property
    def steps(self) -> tuple[RedistributeStep, ...]:
        return tuple(step for plan in self.redistributions for step in plan.steps)

    @property
    def cost(self) -> Fraction:
        return sum((plan.cost for plan in self.redistributions), Fraction(0))

    @property
    def nbytes(self) -> Fraction:
        return sum((s.nbytes for s in self.steps), Fraction(0))

    @property
    def collectives(self) -> Counter[str]:
        """Steps per kind over the whole function (local ones included)."""
        return Counter(s.collective for s in self.steps)

    def __str__(self) -> str:
        rows = []
        for eqn in self.equations:
            moves = "; ".join(f"in{i} {s}" for i, s in eqn.steps)
            outs = " ; ".join(str(s) for s in eqn.outputs)
            ins = " ; ".join(layout_text(s.layout) for s in eqn.inputs)
            rows.append((eqn.path, "  " * eqn.depth + eqn.primitive, ins, outs, moves, format_bytes(eqn.cost)))
        table = format_table(("eqn", "primitive", "inputs", "outputs", "redistribution", "cost"), rows)
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.collectives.items())) or "none"
        outs = " ; ".join(str(s) for s in self.outputs)
        return (
            f"{table}\noutputs: {outs}\n"
            f"communication: {kinds}; {format_bytes(self.nbytes)} B per device, cost {format_bytes(self.cost)}"
        )


SEARCHES = ("program", "eager")


def predict(
    fn: Callable[..., Any],
    *inputs: Any,
    mesh: DeviceMesh | None = None,
    cost_model: CostModelLike = None,
    search: str = "program",
) -> Prediction:
    """Trace ``fn`` on ``inputs`` (``(shape, dtype, layout)`` tuples or DTensor-like
    objects, one per positional argument) and propagate layouts through every equation.
    Keyword arguments of ``fn`` are not traced: bind them with ``functools.partial``.

    ``search="program"`` (the default) chooses every equation's signature together, to
    minimize the communication of the whole program (:mod:`.program`: OneFlow's graph-mode
    SBP inference, Alpa's intra-operator pass). ``search="eager"`` chooses each equation's
    signature on its own given its inputs' layouts, as torch's eager DTensor dispatch
    does op by op.
    """
    if not callable(fn):
        raise InferenceError("fn", fn, "not callable", "pass a function of the input tensors")
    if search not in SEARCHES:
        raise InferenceError("search", search, "unknown search", f"use one of {SEARCHES}")
    specs, mesh = as_tensor_specs(inputs, mesh)
    model = resolve_cost_model(cost_model)
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
            *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in specs)
        )
    except Placements2JaxError:
        raise
    except (TypeError, ValueError) as err:
        raise InferenceError(
            "fn", fn, f"tracing it on inputs {[str(s.aval) for s in specs]} failed ({type(err).__name__}: {err})",
            "make fn accept tensors of these shapes and dtypes (e.g. matching matmul dims)",
        ) from None
    consts = _const_specs(closed.jaxpr, mesh)
    out_tree = jax.tree.structure(out_shape)

    def walk(choices: Mapping[str, Candidate]) -> tuple[Prediction, ProgramGraph]:
        walker = _Walker(mesh, model, choices)
        outputs = walker.walk(closed.jaxpr, consts, specs, "", [("in", i) for i in range(len(specs))])
        prediction = Prediction(specs, tuple(o for o, _ in outputs), tuple(walker.rows), out_tree, search)
        return prediction, ProgramGraph(mesh, tuple(walker.nodes), tuple(s for _, s in outputs), specs)

    eager, graph = walk({})
    if search == "eager":
        return eager
    choices = select_program(graph, model)
    return walk(choices)[0] if choices else eager


def _const_specs(jaxpr: Any, mesh: DeviceMesh) -> list[TensorSpec]:
    return [_replicated_spec(v.aval, mesh) for v in jaxpr.constvars]


def _replicated_spec(aval: Any, mesh: DeviceMesh) -> TensorSpec:
    return TensorSpec(aval.shape, aval.dtype, replicated(mesh, len(aval.shape)))


class _Walker:
    """Walks a jaxpr, choosing signatures: the candidate ``choices`` gives an equation's
    path (whole-program selection), else the best-ranked one for its inputs' layouts
    (eager selection). Records the dataflow as :class:`ProgramNode`s for the search."""

    def __init__(self, mesh: DeviceMesh, cost_model: CostModel, choices: Mapping[str, Candidate]) -> None:
        self.mesh = mesh
        self.cost_model = cost_model
        self.choices = choices
        self.rows: list[EquationReport] = []
        self.nodes: list[ProgramNode] = []

    def walk(
        self, jaxpr: Any, consts: Sequence[TensorSpec], inputs: Sequence[TensorSpec], prefix: str,
        sources: Sequence[ValueId | None],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        """The outputs of ``jaxpr`` and the values they are (None: a literal or constant)."""
        env: dict[Any, tuple[TensorSpec, ValueId | None]] = {}

        def read(atom: Any) -> tuple[TensorSpec, ValueId | None]:
            if isinstance(atom, core.Literal):
                return _replicated_spec(atom.aval, self.mesh), None
            return env[atom]

        env.update((v, (c, None)) for v, c in zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, zip(inputs, sources)))
        for index, eqn in enumerate(jaxpr.eqns):
            path = f"{prefix}{index}"
            ins, srcs = zip(*(read(a) for a in eqn.invars)) if eqn.invars else ((), ())
            out_avals = tuple(Aval(v.aval.shape, v.aval.dtype) for v in eqn.outvars)
            outs = self._equation(eqn, path, tuple(ins), tuple(srcs), out_avals)
            for var, value in zip(eqn.outvars, outs):
                if not isinstance(var, core.DropVar):
                    env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def _equation(
        self, eqn: Any, path: str, ins: tuple[TensorSpec, ...], srcs: tuple[ValueId | None, ...],
        out_avals: tuple[Aval, ...],
    ) -> list[tuple[TensorSpec, ValueId | None]]:
        name = eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params[_CALLS[name]]
            label = f"{name}[{eqn.params['name']}]" if "name" in eqn.params else name
            slot = len(self.rows)
            self.rows.append(EquationReport(path, label, ins, None, ()))
            jaxpr = getattr(inner, "jaxpr", inner)
            consts = _const_specs(jaxpr, self.mesh)
            outs = self.walk(jaxpr, consts, ins, path + ".", srcs)
            self.rows[slot] = EquationReport(path, label, ins, None, tuple(o for o, _ in outs))
            return outs
        if name in _CONSTRAINTS:
            signature = self._constraint(eqn.params[_CONSTRAINTS[name]], ins[0], out_avals[0])
        elif path in self.choices:
            signature = forced_signature(name, ins, self.choices[path], self.cost_model)
        else:
            definition = primitive_definition(name)
            params = freeze({p: eqn.params[p] for p in definition.params}, f"{name} params")
            signature = signature_for(("primitive", name), params, ins, out_avals, self.cost_model, self.mesh)
        outs = tuple(TensorSpec(a.shape, a.dtype, layout) for a, layout in zip(out_avals, signature.out_layouts))
        self.rows.append(EquationReport(path, name, ins, signature, outs, srcs))
        self.nodes.append(ProgramNode(path, ins, srcs, signature.candidates))
        return [(o, (path, j)) for j, o in enumerate(outs)]

    def _constraint(self, sharding: Any, spec: TensorSpec, out: Aval) -> Signature:
        if not isinstance(sharding, NamedSharding):
            raise UnsupportedOpError(
                "sharding", sharding, "with_sharding_constraint is only understood with a NamedSharding",
                "pass NamedSharding(mesh.to_jax(), PartitionSpec(...))",
            )
        if tuple(sharding.mesh.axis_names) != self.mesh.alias_name or tuple(sharding.mesh.axis_sizes) != self.mesh.shape:
            raise InferenceError(
                "sharding", sharding, f"its mesh is not the inputs' mesh {self.mesh!r}",
                "constrain with a sharding on the same mesh (mesh.to_jax())",
            )
        target = Layout.from_partition_spec(self.mesh, sharding.spec, spec.layout.ndim)
        return _forced_layout(spec, target, out, self.cost_model)


@lru_cache(maxsize=1024)
def _forced_layout(spec: TensorSpec, target: Layout, out: Aval, cost_model: CostModel) -> Signature:
    """The one signature of a sharding constraint (cached, as every signature is)."""
    plan = _plan(spec.shape, spec.dtype, spec.layout, target, cost_model)
    order = tuple(range(target.mesh.ndim))
    return Signature("sharding_constraint", (spec,), (Candidate((target,), (target,), (plan,), (), order, (out,)),))
