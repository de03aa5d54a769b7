"""Predicting the layouts of a whole JAX function by walking its jaxpr.

``predict(fn, *inputs)`` traces ``fn`` with ``jax.make_jaxpr`` on shape/dtype stand-ins,
then gives every equation the signature inference chooses for its inputs' layouts (the
same cached selection as :func:`infer_signature`, with the primitive's rule), exactly as
eager torch DTensor or OneFlow would dispatch op by op. Call-like equations (``jit`` /
``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``closed_call``) are walked
inside; ``with_sharding_constraint`` and ``reshard`` force their layout (the report shows
the plan to it).
Literals and closed-over constants are Replicate. Unknown primitives (``while``, ``scan``,
``cond``, ``shard_map``...) raise :class:`UnsupportedOpError` naming them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
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
from .select import signature_for
from .signature import (
    Aval,
    Candidate,
    RedistributeStep,
    Signature,
    TensorSpec,
    as_tensor_specs,
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
    ``out_tree`` rebuilds the result's structure.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    equations: tuple[EquationReport, ...]
    out_tree: Any

    @property
    def out_layouts(self) -> tuple[Layout, ...]:
        return tuple(s.layout for s in self.outputs)

    @property
    def steps(self) -> tuple[RedistributeStep, ...]:
        return tuple(step for eqn in self.equations for _, step in eqn.steps)

    @property
    def cost(self) -> Fraction:
        return sum((e.cost for e in self.equations), Fraction(0))

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
            ins = " ; ".join(str(s.layout) for s in eqn.inputs)
            rows.append((eqn.path, "  " * eqn.depth + eqn.primitive, ins, outs, moves, format_bytes(eqn.cost)))
        table = format_table(("eqn", "primitive", "inputs", "outputs", "redistribution", "cost"), rows)
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.collectives.items())) or "none"
        outs = " ; ".join(str(s) for s in self.outputs)
        return (
            f"{table}\noutputs: {outs}\n"
            f"communication: {kinds}; {format_bytes(self.nbytes)} B per device, cost {format_bytes(self.cost)}"
        )


SEARCHES = ("greedy", "refine")
# how a refined equation reduces its partial outputs: into any split, or to Replicate
_REDUCTIONS = ("scatter", "replicate")


def predict(
    fn: Callable[..., Any],
    *inputs: Any,
    mesh: DeviceMesh | None = None,
    cost_model: CostModelLike = None,
    search: str = "greedy",
) -> Prediction:
    """Trace ``fn`` on ``inputs`` (``(shape, dtype, layout)`` tuples or DTensor-like
    objects, one per positional argument) and propagate layouts through every equation.
    Keyword arguments of ``fn`` are not traced: bind them with ``functools.partial``.

    ``search="greedy"`` chooses each equation's signature on its own, as eager DTensor
    dispatch does. ``search="refine"`` then improves the whole program by local search:
    it tries reducing each partial output where it is produced (instead of carrying it
    through linear ops and reducing later, possibly more than once) and keeps every
    change that lowers the total cost, until none does.
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

    def walk(reduced: frozenset[tuple[str, str]]) -> Prediction:
        rows: list[EquationReport] = []
        outputs = _Walker(mesh, model, rows, reduced).walk(closed.jaxpr, consts, specs, "")
        return Prediction(specs, tuple(outputs), tuple(rows), jax.tree.structure(out_shape))

    best = walk(frozenset())
    if search == "refine":
        best = _refine(best, walk)
    return best


def _refine(best: Prediction, walk: Callable[[frozenset[tuple[str, str]]], Prediction]) -> Prediction:
    """Local search: for each equation with a partial output, try reducing it right there
    (scattered, or replicated on the partial mesh dims) and keep what lowers the cost."""
    reduced: frozenset[tuple[str, str]] = frozenset()
    improved = True
    while improved:
        improved = False
        for path in [e.path for e in best.equations]:
            row = next((e for e in best.equations if e.path == path), None)
            if row is None or row.signature is None or any(p == path for p, _ in reduced):
                continue
            if not any(o.layout.has_partial for o in row.outputs):
                continue
            trials = {mode: walk(reduced | {(path, mode)}) for mode in _REDUCTIONS}
            mode = min(_REDUCTIONS, key=lambda m: trials[m].cost)
            if trials[mode].cost < best.cost:
                best, improved, reduced = trials[mode], True, reduced | {(path, mode)}
    return best


def _without_partial_outputs(signature: Signature, mode: str) -> Signature:
    """The signature re-ranked so that its best candidate without partial outputs comes
    first: any such candidate (``scatter``), or one that also splits nothing on the mesh
    dims where the chosen outputs were partial (``replicate``)."""
    was_partial = {m for x in signature.out_layouts for m in x.partial_axes}

    def fits(candidate: Candidate) -> bool:
        outs = candidate.out_layouts
        if any(x.has_partial for x in outs):
            return False
        return mode == "scatter" or not any(m in axes for x in outs for axes in x.dim_axes for m in was_partial)

    forced = next(c for c in signature.candidates if fits(c))
    rest = tuple(c for c in signature.candidates if c is not forced)
    return Signature(signature.op, signature.inputs, (forced,) + rest)


def _const_specs(jaxpr: Any, mesh: DeviceMesh) -> list[TensorSpec]:
    return [_replicated_spec(v.aval, mesh) for v in jaxpr.constvars]


def _replicated_spec(aval: Any, mesh: DeviceMesh) -> TensorSpec:
    return TensorSpec(aval.shape, aval.dtype, Layout.replicated_on(mesh, len(aval.shape)))


class _Walker:
    """Walks a jaxpr, choosing signatures; an equation listed in ``reduced`` as
    ``(path, mode)`` reduces its partial outputs (see :func:`_without_partial_outputs`)."""

    def __init__(
        self,
        mesh: DeviceMesh,
        cost_model: CostModel,
        rows: list[EquationReport],
        reduced: frozenset[tuple[str, str]],
    ) -> None:
        self.mesh = mesh
        self.cost_model = cost_model
        self.rows = rows
        self.reduced = dict(reduced)

    def walk(self, jaxpr: Any, consts: Sequence[TensorSpec], inputs: Sequence[TensorSpec], prefix: str) -> list[TensorSpec]:
        env: dict[Any, TensorSpec] = {}

        def read(atom: Any) -> TensorSpec:
            if isinstance(atom, core.Literal):
                return _replicated_spec(atom.aval, self.mesh)
            return env[atom]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, inputs))
        for index, eqn in enumerate(jaxpr.eqns):
            path = f"{prefix}{index}"
            ins = tuple(read(a) for a in eqn.invars)
            out_avals = tuple(Aval(v.aval.shape, v.aval.dtype) for v in eqn.outvars)
            outs = self._equation(eqn, path, ins, out_avals)
            for var, spec in zip(eqn.outvars, outs):
                if not isinstance(var, core.DropVar):
                    env[var] = spec
        return [read(v) for v in jaxpr.outvars]

    def _equation(
        self, eqn: Any, path: str, ins: tuple[TensorSpec, ...], out_avals: tuple[Aval, ...]
    ) -> tuple[TensorSpec, ...]:
        name = eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params[_CALLS[name]]
            label = f"{name}[{eqn.params['name']}]" if "name" in eqn.params else name
            slot = len(self.rows)
            self.rows.append(EquationReport(path, label, ins, None, ()))
            jaxpr = getattr(inner, "jaxpr", inner)
            consts = _const_specs(jaxpr, self.mesh)
            outs = tuple(self.walk(jaxpr, consts, ins, path + "."))
            self.rows[slot] = EquationReport(path, label, ins, None, outs)
            return outs
        if name in _CONSTRAINTS:
            signature = self._constraint(eqn.params[_CONSTRAINTS[name]], ins[0], out_avals[0])
        else:
            definition = primitive_definition(name)
            params = freeze({p: eqn.params[p] for p in definition.params}, f"{name} params")
            signature = signature_for(("primitive", name), params, ins, out_avals, self.cost_model, self.mesh)
            if path in self.reduced:
                signature = _without_partial_outputs(signature, self.reduced[path])
        outs = tuple(TensorSpec(a.shape, a.dtype, layout) for a, layout in zip(out_avals, signature.out_layouts))
        self.rows.append(EquationReport(path, name, ins, signature, outs))
        return outs

    def _constraint(self, sharding: Any, spec: TensorSpec, out: Aval) -> Signature:
        if not isinstance(sharding, NamedSharding):
            raise UnsupportedOpError(
                "sharding", sharding, "with_sharding_constraint is only understood with a NamedSharding",
                "pass NamedSharding(mesh.to_jax(), PartitionSpec(...))",
            )
        if tuple(sharding.mesh.axis_names) != self.mesh.axis_names or tuple(sharding.mesh.axis_sizes) != self.mesh.shape:
            raise InferenceError(
                "sharding", sharding, f"its mesh is not the inputs' mesh {self.mesh!r}",
                "constrain with a sharding on the same mesh (mesh.to_jax())",
            )
        target = Layout.from_partition_spec(self.mesh, sharding.spec, spec.layout.ndim)
        plan = _plan(spec.shape, spec.dtype, spec.layout, target, self.cost_model)
        order = tuple(range(self.mesh.ndim))
        return Signature("sharding_constraint", (spec,), (Candidate((target,), (target,), (plan,), (), order, (out,)),))
