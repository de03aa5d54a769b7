"""What XLA simplifies away before it partitions a program, done to the traced jaxpr
before any walk (:func:`simplified`), where leaving it would charge communication XLA
never sends.

Zero-size values. ``jnp.pad(x, ..., mode="edge")`` pads every axis, the unpadded ones
too: it slices an edge row off ``x``, broadcasts it to a zero-width pad and concatenates
``[pad, x, pad]``. XLA's algebraic simplifier replaces every zero-size result by a
constant, drops zero-size operands of a concatenate (one left: the operand itself) and
then removes the slices only those fed. Walked as traced, the edge slices of a
batch-split ``x`` and the concatenates along split dims were priced as moves: a
Megatron MLP's loss with one edge pad of its embedded tokens predicted 24,714 B in 20
collectives where XLA compiles 25,156 in 6 (18,826 in 6 after). :func:`constants_folded`
makes the same rewrite, in the jaxpr and the jaxprs in its equations' params (calls,
loop bodies, branches), and returns the jaxpr itself when it has no zero-size value to
simplify; the slices it leaves unread go with the dead code.

Conditionals on a constant. XLA's conditional simplifier inlines the branch a ``cond`` /
``switch`` with a constant index takes. ``optax.MultiSteps`` traces its update as
``lax.cond(should_skip_update(...), ...)`` with ``should_skip_update`` returning
``jnp.array(False)`` by default: the cond's index is the literal 0. Walked as a cond, the
branches' outputs were joined and their moves counted as a cond's, where XLA compiles
branch 0 alone: the stacked LM's MultiSteps step predicted 9 collectives after XLA's
combiner where its pinned program compiles 8 (the same bytes). :func:`constants_folded`
rewrites such a cond (a literal index) as a ``closed_call`` of the branch it takes
(its index clamped into range, as ``lax.switch`` does), which every walk enters as a call.
``lax.switch(1, ...)`` clamps its index before the cond (``clamp 0 1 1``) and a bool
predicate may be converted to an int: a scalar ``clamp`` or ``convert_element_type`` of
literals is folded into a literal first (with NumPy: nothing is dispatched).

Dead code. XLA computes only what the program returns (or what has an effect): metrics
that ``value_and_grad(..., has_aux=True)`` computes and the step drops, a residual no
derivative reads. Walked as traced, their moves were charged (an accuracy metric's
argmax over tp-split classes: a dropped-metrics step predicted 73,300 B in 17
collectives where XLA compiles 68,188 in 8; 71,188 in 14 after). :func:`simplified`
removes them with JAX's own dead-code elimination (``pe.dce_jaxpr``, which also prunes
the unused outputs of calls and loops), after the zero-size rewrite (the edge slices it
leaves unread among them). On benchmarks/dump_predictions.py's programs it removes local steps
only (slices of dead residuals: Llama's 2x4 adamw step 114 -> 98 planned steps), the
same bytes and collectives."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax
from jax._src import core, dtypes
from jax._src.interpreters import partial_eval as pe

__all__ = ["simplified", "constants_folded"]


def simplified(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``closed`` as XLA partitions it (module docstring): zero-size values and
    conditionals on a constant simplified (:func:`constants_folded`), then dead code
    removed."""
    closed = constants_folded(closed)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return core.ClosedJaxpr(jaxpr, closed.consts)


def constants_folded(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``closed`` with its zero-size values and its conditionals on a literal index
    simplified as XLA does (module docstring); ``closed`` itself when there is none."""
    jaxpr = _simplified(closed.jaxpr)
    return closed if jaxpr is closed.jaxpr else core.ClosedJaxpr(jaxpr, closed.consts)


def _empty(atom: Any) -> bool:
    """Whether ``atom`` is a zero-size array of a plain element type (an extended one, a
    PRNG key, cannot be made from a literal zero)."""
    aval = atom.aval
    shape = getattr(aval, "shape", None)
    return bool(shape) and 0 in shape and not dtypes.issubdtype(aval.dtype, dtypes.extended)


def _zeros(outvar: Any, eqn: Any) -> Any:
    """An equation making ``outvar`` (zero-size) from a literal, reading nothing."""
    aval = outvar.aval
    zero = core.Literal(np.zeros((), aval.dtype), core.ShapedArray((), aval.dtype, weak_type=aval.weak_type))
    params = dict(shape=aval.shape, broadcast_dimensions=(), sharding=None)
    return core.new_jaxpr_eqn([zero], [outvar], lax.broadcast_in_dim_p, params, core.no_effects, eqn.source_info)


def _reads_nothing(eqn: Any) -> bool:
    return all(isinstance(v, core.Literal) for v in eqn.invars)


def _literal_of(eqn: Any, invars: list[Any]) -> core.Literal | None:
    """The literal a scalar ``clamp`` or ``convert_element_type`` of literals makes (a
    switch's constant index: module docstring), else None."""
    if (eqn.primitive not in (lax.clamp_p, lax.convert_element_type_p) or eqn.outvars[0].aval.shape != ()
            or not all(isinstance(v, core.Literal) for v in invars)):
        return None
    values = [np.asarray(v.val) for v in invars]
    aval = eqn.outvars[0].aval
    value = np.clip(values[1], values[0], values[2]) if eqn.primitive is lax.clamp_p else values[0]
    return core.Literal(np.asarray(value).astype(aval.dtype), aval)


def _sub_simplified(value: Any) -> Any:
    """A param value with the jaxprs in it simplified (the same object when none changes)."""
    if isinstance(value, core.ClosedJaxpr):
        return constants_folded(value)
    if isinstance(value, core.Jaxpr):
        return _simplified(value)
    if isinstance(value, tuple) and any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
        items = tuple(map(_sub_simplified, value))
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def _simplified(jaxpr: core.Jaxpr) -> core.Jaxpr:
    """``jaxpr`` rewritten (module docstring), or ``jaxpr`` itself when nothing changes."""
    renamed: dict[Any, Any] = {}  # a concatenate's result -> its one operand not empty
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        invars = [renamed.get(v, v) if isinstance(v, core.Var) else v for v in eqn.invars]
        params = {name: _sub_simplified(value) for name, value in eqn.params.items()}
        if any(params[name] is not value for name, value in eqn.params.items()):
            changed = True
        else:
            params = eqn.params
        if (len(eqn.outvars) == 1 and not eqn.effects and _empty(eqn.outvars[0]) and not _reads_nothing(eqn)
                and not isinstance(eqn.outvars[0], core.DropVar)):
            eqns.append(_zeros(eqn.outvars[0], eqn))
            changed = True
            continue
        literal = _literal_of(eqn, invars)
        if literal is not None:
            renamed[eqn.outvars[0]] = literal
            changed = True
            continue
        if eqn.primitive is lax.cond_p and isinstance(invars[0], core.Literal):
            branches = params["branches"]
            taken = branches[int(np.clip(invars[0].val, 0, len(branches) - 1))]
            eqns.append(core.new_jaxpr_eqn(invars[1:], eqn.outvars, core.closed_call_p, dict(call_jaxpr=taken),
                                           eqn.effects, eqn.source_info))
            changed = True
            continue
        if eqn.primitive is lax.concatenate_p:
            kept = [v for v in invars if not _empty(v)]
            if kept and len(kept) < len(invars):
                changed = True
                if len(kept) == 1 and kept[0].aval.shape == eqn.outvars[0].aval.shape:
                    renamed[eqn.outvars[0]] = kept[0]
                    continue
                invars = kept
        if invars != list(eqn.invars) or params is not eqn.params:
            changed = True
            eqn = eqn.replace(invars=invars, params=params)
        eqns.append(eqn)
    if not changed:
        return jaxpr
    outvars = [renamed.get(v, v) if isinstance(v, core.Var) else v for v in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars)
