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
same bytes and collectives.

Arg-reductions, as placements2jax partitions them (not XLA's simplification: a rewrite
that sends less than XLA's partitioning of the same primitive; the torch walk,
``predict(search="torch")``, keeps the primitive, as torch's argmax gathers a split
reduced dim). ``argmax`` / ``argmin`` over a dim split by some mesh dims: XLA reduces each
shard to its (value, index) pairs and all-gathers both over those mesh dims ((n - 1)
blocks of the output per array and device), and no rule can split a reduced dim whose
result is an index, so the search moved the whole input instead (an accuracy metric or
greedy token over tp-split logits (4, 64, 1,024): an all-to-all of the logits, 98,688 B
per device, where XLA sends 3,072). :func:`simplified` (``arg_reductions=True``) calls
in each one's place the same index computed from reductions the rules split: the
extreme ``m = max(x, d)`` (``min``), then the first position holding it, ``min(where(x
== m or x != x, iota, size), d)``: exactly the primitive's result (its first occurrence,
the first NaN where there is one, as XLA's ``max`` propagates NaN; -0.0 and 0.0 tie as
its comparator ties them; booleans and integers too), two all-reduces of the output's
block over a split dim (``P(max)``, then ``P(min)``: 2 (n - 1) / n blocks each, 1,536 B
there, half XLA's over 4 devices, the same over 2), none where the dim is not split.
``apply`` runs the rewritten program in every execute mode (``"xla"`` evaluates the
predicted jaxpr where it holds such a call, :func:`is_arg_reduction_call`), so what it
compiles is what was predicted; plain
``jax.jit`` of the function compiles XLA's gathers, and ``check`` reports its extra bytes
as "differs". Complex operands (no order) are left."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax._src import core, dtypes
from jax._src.interpreters import partial_eval as pe
from jax.sharding import NamedSharding

from ..caches import cached

__all__ = ["simplified", "constants_folded", "is_arg_reduction_call"]


def simplified(closed: core.ClosedJaxpr, arg_reductions: bool = False) -> core.ClosedJaxpr:
    """``closed`` as XLA partitions it (module docstring): zero-size values and
    conditionals on a constant simplified (:func:`constants_folded`), then dead code
    removed; ``arg_reductions``: every ``argmax`` / ``argmin`` then a call of its
    reductions (module docstring), where the rules split the reduced dim."""
    closed = constants_folded(closed)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    if arg_reductions:
        jaxpr = _arg_reductions_called(jaxpr)
    return core.ClosedJaxpr(jaxpr, closed.consts)


def constants_folded(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``closed`` with its zero-size values and its conditionals on a literal index
    simplified as XLA does (module docstring); ``closed`` itself when there is none."""
    return _in_params(closed, _simplified)


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


def _in_params(value: Any, rewrite: Callable[[core.Jaxpr], core.Jaxpr]) -> Any:
    """A param value (or a closed jaxpr) with ``rewrite`` applied to the jaxprs in it (the
    same object when none changes)."""
    if isinstance(value, core.ClosedJaxpr):
        jaxpr = rewrite(value.jaxpr)
        return value if jaxpr is value.jaxpr else core.ClosedJaxpr(jaxpr, value.consts)
    if isinstance(value, core.Jaxpr):
        return rewrite(value)
    if isinstance(value, tuple) and any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
        items = tuple(_in_params(v, rewrite) for v in value)
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def _simplified(jaxpr: core.Jaxpr) -> core.Jaxpr:
    """``jaxpr`` rewritten (module docstring), or ``jaxpr`` itself when nothing changes."""
    renamed: dict[Any, Any] = {}  # a concatenate's result -> its one operand not empty
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        invars = [renamed.get(v, v) if isinstance(v, core.Var) else v for v in eqn.invars]
        params = {name: _in_params(value, _simplified) for name, value in eqn.params.items()}
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


# the calls :func:`_first_extreme_jaxpr` made (weakly: those the programs holding them still read)
_ARG_REDUCTION_CALLS: weakref.WeakSet[core.ClosedJaxpr] = weakref.WeakSet()


def is_arg_reduction_call(eqn: Any) -> bool:
    """Whether ``eqn`` is an ``argmax`` / ``argmin`` called as its two reductions (module
    docstring)."""
    return eqn.primitive is core.closed_call_p and eqn.params["call_jaxpr"] in _ARG_REDUCTION_CALLS


def _arg_reductions_called(jaxpr: core.Jaxpr) -> core.Jaxpr:
    """``jaxpr`` with every ``argmax`` / ``argmin`` of a real operand, nested ones too, a
    call of :func:`_first_extreme` (module docstring), or ``jaxpr`` itself when it has none."""
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        params = {name: _in_params(value, _arg_reductions_called) for name, value in eqn.params.items()}
        if any(params[name] is not value for name, value in eqn.params.items()):
            eqn, changed = eqn.replace(params=params), True
        operand = eqn.invars[0].aval if eqn.invars else None
        if eqn.primitive in (lax.argmax_p, lax.argmin_p) and not dtypes.issubdtype(operand.dtype, np.complexfloating):
            (axis,) = eqn.params["axes"]
            sharding = getattr(operand, "sharding", None)
            call = _first_extreme_jaxpr(operand.shape, operand.dtype, operand.weak_type, axis,
                                        eqn.params["index_dtype"], eqn.primitive is lax.argmax_p,
                                        None if sharding is None or sharding.mesh.empty else sharding)
            eqn, changed = core.new_jaxpr_eqn(eqn.invars, eqn.outvars, core.closed_call_p, dict(call_jaxpr=call),
                                              eqn.effects, eqn.source_info), True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


@cached(maxsize=256)
def _first_extreme_jaxpr(
    shape: tuple[int, ...], dtype: np.dtype, weak_type: bool, axis: int, index_dtype: np.dtype, largest: bool,
    sharding: NamedSharding | None = None,
) -> core.ClosedJaxpr:
    """:func:`_first_extreme` traced for one operand (a pure function of these: cached,
    every walk of a program reads the same jaxpr); ``sharding``: its type in a program
    traced typed (inside ``jax.set_mesh`` of an Explicit mesh), which the call's values
    take (else JAX's typing refuses the call run there: its positions replicated where
    the operand is split)."""
    operand = jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type, sharding=sharding)
    call = jax.make_jaxpr(lambda x: _first_extreme(x, axis, index_dtype, largest))(operand)
    _ARG_REDUCTION_CALLS.add(call)
    return call


def _first_extreme(x: jax.Array, axis: int, index_dtype: np.dtype, largest: bool) -> jax.Array:
    """``lax.argmax(x, axis, index_dtype)`` (``largest``, else ``argmin``) as two
    reductions (module docstring): the extreme, then the first position holding it."""
    extreme = (lax.reduce_max if largest else lax.reduce_min)(x, (axis,))
    kept = tuple(d for d in range(x.ndim) if d != axis)
    sharding = jax.typeof(x).sharding
    sharding = None if sharding.mesh.empty else sharding  # the operand's type, which the positions take too
    hit = x == lax.broadcast_in_dim(extreme, x.shape, kept, out_sharding=sharding)
    if dtypes.issubdtype(x.dtype, np.inexact):
        hit = hit | (x != x)  # a NaN: the extreme is NaN (max and min propagate it), its first position taken
    positions = lax.broadcasted_iota(index_dtype, x.shape, axis, out_sharding=sharding)
    return lax.reduce_min(lax.select(hit, positions, lax.full_like(positions, x.shape[axis])), (axis,))
