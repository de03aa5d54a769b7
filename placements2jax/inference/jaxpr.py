"""Predicting the layouts of a whole JAX function by walking its jaxpr.

``predict(fn, *inputs)`` traces ``fn`` with ``jax.make_jaxpr`` on shape/dtype stand-ins,
then gives every equation the signature inference chooses for its inputs' layouts (the
same cached selection as :func:`infer_signature`, with the primitive's rule), exactly as
eager torch DTensor or OneFlow would dispatch op by op. Call-like equations (``jit`` /
``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``closed_call``) are walked
inside; ``with_sharding_constraint`` forces its layout (the report shows the plan to it).
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

from ..errors import InferenceError, UnsupportedOpError
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
    as_tensor_spec,
    common_mesh,
    layout_text,
    replicated,
)
from .table import format_bytes, format_table

__all__ = ["predict", "Prediction", "EquationReport"]

_CALL_PARAMS = ("jaxpr", "call_jaxpr")
_CONSTRAINTS = ("sharding_constraint",)


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
            ins = " ; ".join(layout_text(s.layout) for s in eqn.inputs)
            rows.append((eqn.path, "  " * eqn.depth + eqn.primitive, ins, outs, moves, format_bytes(eqn.cost)))
        table = format_table(("eqn", "primitive", "inputs", "outputs", "redistribution", "cost"), rows)
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.collectives.items())) or "none"
        outs = " ; ".join(str(s) for s in self.outputs)
        return (
            f"{table}\noutputs: {outs}\n"
            f"communication: {kinds}; {format_bytes(self.nbytes)} B per device, cost {format_bytes(self.cost)}"
        )


def predict(
    fn: Callable[..., Any], *inputs: Any, mesh: DeviceMesh | None = None, cost_model: CostModelLike = None
) -> Prediction:
    """Trace ``fn`` on ``inputs`` (``(shape, dtype, layout)`` tuples or DTensor-like
    objects, one per positional argument) and propagate layouts through every equation.
    Keyword arguments of ``fn`` are not traced: bind them with ``functools.partial``."""
    if not callable(fn):
        raise InferenceError("fn", fn, "not callable", "pass a function of the input tensors")
    specs = tuple(as_tensor_spec(x, mesh, f"inputs[{i}]") for i, x in enumerate(inputs))
    mesh = common_mesh(specs, mesh)
    model = resolve_cost_model(cost_model)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
        *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in specs)
    )
    rows: list[EquationReport] = []
    outputs = _Walker(mesh, model, rows).walk(closed.jaxpr, _const_specs(closed.jaxpr, mesh), specs, "")
    return Prediction(specs, tuple(outputs), tuple(rows), jax.tree.structure(out_shape))


def _const_specs(jaxpr: Any, mesh: DeviceMesh) -> list[TensorSpec]:
    return [_replicated_spec(v.aval, mesh) for v in jaxpr.constvars]


def _replicated_spec(aval: Any, mesh: DeviceMesh) -> TensorSpec:
    return TensorSpec(aval.shape, aval.dtype, replicated(mesh, len(aval.shape)))


class _Walker:
    def __init__(self, mesh: DeviceMesh, cost_model: CostModel, rows: list[EquationReport]) -> None:
        self.mesh = mesh
        self.cost_model = cost_model
        self.rows = rows

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
        inner = next((eqn.params[p] for p in _CALL_PARAMS if p in eqn.params), None)
        if inner is not None:
            label = f"{name}[{eqn.params['name']}]" if "name" in eqn.params else name
            slot = len(self.rows)
            self.rows.append(EquationReport(path, label, ins, None, ()))
            jaxpr = getattr(inner, "jaxpr", inner)
            consts = _const_specs(jaxpr, self.mesh)
            outs = tuple(self.walk(jaxpr, consts, ins, path + "."))
            self.rows[slot] = EquationReport(path, label, ins, None, outs)
            return outs
        if name in _CONSTRAINTS:
            signature = self._constraint(eqn, ins[0], out_avals[0])
        else:
            definition = primitive_definition(name)
            params = freeze({p: eqn.params[p] for p in definition.params}, f"{name} params")
            signature = signature_for(("primitive", name), params, ins, out_avals, self.cost_model)
        outs = tuple(TensorSpec(a.shape, a.dtype, layout) for a, layout in zip(out_avals, signature.out_layouts))
        self.rows.append(EquationReport(path, name, ins, signature, outs))
        return outs

    def _constraint(self, eqn: Any, spec: TensorSpec, out: Aval) -> Signature:
        sharding = eqn.params.get("sharding")
        if not isinstance(sharding, NamedSharding):
            raise UnsupportedOpError(
                "sharding", sharding, "with_sharding_constraint is only understood with a NamedSharding",
                "pass NamedSharding(mesh.to_jax(), PartitionSpec(...))",
            )
        if tuple(sharding.mesh.axis_names) != self.mesh.alias_name or tuple(sharding.mesh.devices.shape) != self.mesh.shape:
            raise InferenceError(
                "sharding", sharding, f"its mesh is not the inputs' mesh {self.mesh!r}",
                "constrain with a sharding on the same mesh (mesh.to_jax())",
            )
        target = Layout.from_partition_spec(self.mesh, sharding.spec, spec.layout.ndim)
        plan = _plan(spec.shape, spec.dtype, spec.layout, target, self.cost_model)
        order = tuple(range(self.mesh.ndim))
        return Signature("sharding_constraint", (spec,), (Candidate((target,), (target,), (plan,), (), order, (out,)),))
