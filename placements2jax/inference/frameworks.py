"""Arguments of functions written for Flax NNX and Equinox: static leaves and in-place updates.

``predict``, ``check`` and ``apply`` trace a function on the arrays of its arguments, as
``jax.jit`` does. Two kinds of argument pytrees hold more than arrays:

- **Static leaves** (Equinox models keep their activation functions and hyperparameters
  in the tree): inside an ``eqx.Module``, a leaf that is not an array (a function, a
  Python number: such an int may be a shape) is static, kept out of the trace and put back
  when the function is called, as ``eqx.filter_jit`` does (results give them back too).
  Outside Equinox modules the ``jax.jit`` rules hold: numbers are traced as weakly typed
  Replicate scalars, other non-array leaves are refused. Static leaves are part of cache
  keys, so they must be hashable.
- **DTensors ``eqx.partition`` emptied**: partitioning a tree of DTensors by a filter
  (``eqx.partition(params, filter_spec)``: trainable and frozen halves passed as two
  arguments) leaves in each half, where the other holds the array, a DTensor around None
  (JAX's pytrees hand the filter the DTensor's array). Such a DTensor is None in the
  trace, as the half of a plain array is, and ``None`` in ``out_layouts``.
- **Graph nodes updated in place** (a Flax NNX model and ``nnx.Optimizer`` passed to a
  step that runs ``optimizer.update(model, grads)``, the form of Flax's ``@nnx.jit``
  examples): the function traced is the step followed by reading every ``nnx.Variable``
  whose value the step replaced; it returns ``(result, {path: new value})``. ``apply``
  writes those values back into the caller's Variables (so the model and optimizer are
  updated in place, as ``nnx.jit`` does); ``predict`` / ``check`` show them as outputs.
  The updates keep the layouts the Variables had (as torch's optimizer state follows its
  DTensor parameters): ``out_layouts`` becomes ``(out_layouts, {path: the Variable's
  DTensor})``; a Variable the step left alone is a ``None`` output (no array).

:func:`bind` returns the function and arguments to trace; it returns ``fn`` and the
arguments themselves (no wrapper, no new cache key) when neither kind is present.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ..caches import register
from ..errors import ArgumentTypeError
from .signature import _is_constant, _own_layout, is_layout_leaf, is_tensor_leaf

_NUMBERS = (bool, int, float, complex)


def _nnx_types() -> tuple[type, type] | None:
    """(nnx.Pytree, nnx.Variable) when Flax NNX is imported (else no argument holds one)."""
    nnx = sys.modules.get("flax.nnx")
    return None if nnx is None else (nnx.Pytree, nnx.Variable)


def _eqx_module() -> type | None:
    equinox = sys.modules.get("equinox")
    return None if equinox is None else equinox.Module


@dataclass(frozen=True)
class Bound:
    """``fn`` as a function of its arguments' traced leaves (the static ones replaced by
    None), returning ``(result, {path: new value})`` of the nnx Variables updated in
    place when ``stateful``. Equal and hashed by value, so caches keyed by function
    (predict's, apply's) recognise it."""

    fn: Callable[..., Any]
    tree: Any  # the structure of all the arguments' leaves
    statics: tuple[tuple[int, Any], ...]  # (leaf index, value)
    stateful: bool

    def __call__(self, *dynamic: Any) -> Any:
        given = iter(jax.tree.leaves(dynamic, is_leaf=is_tensor_leaf))
        statics = dict(self.statics)
        args = jax.tree.unflatten(
            self.tree, [statics[i] if i in statics else next(given) for i in range(self.tree.num_leaves)]
        )
        if not self.stateful:
            return self._traced(self.fn(*args))
        variables = variables_of(args)
        before = [v.get_value() for v in variables.values()]
        out = self._traced(self.fn(*args))
        return out, {
            path: None if v.get_value() is old else v.get_value() for (path, v), old in zip(variables.items(), before)
        }

    def _traced(self, out: Any) -> Any:
        """``out`` with its static leaves (as in the arguments) replaced by None, those
        remembered for :func:`with_static_outputs` (``eqx.filter_jit`` returns them so)."""
        leaves, tree = jax.tree.flatten(out, is_leaf=is_tensor_leaf)
        static = _static_flags(out, leaves)
        if not any(static):
            _static_outputs.pop(self, None)
            return out
        _static_outputs[self] = (tree, tuple((i, leaf) for i, (leaf, s) in enumerate(zip(leaves, static)) if s))
        return jax.tree.unflatten(tree, [None if s else leaf for leaf, s in zip(leaves, static)])


# the static leaves of a Bound's last traced result (cleared with the programs that traced it)
_static_outputs: dict[Bound, tuple[Any, tuple[tuple[int, Any], ...]]] = register({})


def with_static_outputs(fn: Callable[..., Any], result: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """The result of running a :class:`Bound` ``fn``'s traced program (``is_leaf``: its
    tensors) with the static leaves its trace returned put back."""
    stored = _static_outputs.get(fn) if isinstance(fn, Bound) else None
    if stored is None:
        return result
    tree, statics = stored
    given, where = iter(jax.tree.leaves(result, is_leaf=is_leaf)), dict(statics)
    return jax.tree.unflatten(tree, [where[i] if i in where else next(given) for i in range(tree.num_leaves)])


def variables_of(args: Any) -> dict[str, Any]:
    """The nnx Variables of ``args`` by path (``keystr``), in leaf order."""
    types = _nnx_types()
    if types is None:
        return {}
    pairs = jax.tree_util.tree_flatten_with_path(args, is_leaf=lambda x: isinstance(x, types[1]))[0]
    return {jax.tree_util.keystr(path): v for path, v in pairs if isinstance(v, types[1])}


def bind(
    fn: Callable[..., Any], args: tuple[Any, ...], out_layouts: Any, argument: str
) -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    """``(fn, args, out_layouts)`` to trace: a :class:`Bound`, the arguments without their
    static leaves and the out_layouts keeping the updated Variables' layouts when ``args``
    hold static leaves or nnx graph nodes, else ``fn`` unchanged (also when it is bound
    already); DTensors ``eqx.partition`` emptied as None in both (module docstring).
    ``argument`` names the arguments in errors (``args`` / ``inputs``)."""
    if isinstance(fn, Bound):
        return fn, args, out_layouts
    leaves, tree = jax.tree.flatten(args, is_leaf=is_tensor_leaf)
    if any(map(_emptied, leaves)):
        leaves = [None if _emptied(leaf) else leaf for leaf in leaves]
        args = jax.tree.unflatten(tree, leaves)
        leaves, tree = jax.tree.flatten(args, is_leaf=is_tensor_leaf)
    if out_layouts is not None:
        out_layouts = jax.tree.map(lambda x: None if _emptied(x) else x, out_layouts, is_leaf=is_layout_leaf)
    static = _static_flags(args, leaves)
    types = _nnx_types()
    stateful = types is not None and any(
        isinstance(x, types[0]) for x in jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, types[0]))
    )
    if not any(static) and not stateful:
        return fn, args, out_layouts
    statics = tuple((i, leaf) for i, (leaf, s) in enumerate(zip(leaves, static)) if s)
    try:
        hash(statics)
    except TypeError:
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_tensor_leaf)[0]]
        i, leaf = next((i, leaf) for i, leaf in statics if not _hashable(leaf))
        raise ArgumentTypeError(
            f"{argument}{jax.tree_util.keystr(paths[i])}", leaf,
            "is a static leaf (an Equinox module's non-array leaf, kept out of the trace as eqx.filter_jit does) "
            "and not hashable "
            "(programs are cached per static value)",
            "make it hashable, or partition it out (eqx.partition) and close over it",
        ) from None
    dynamic = jax.tree.unflatten(tree, [None if s else leaf for leaf, s in zip(leaves, static)])
    if stateful:
        kept = {path: v.get_value() for path, v in variables_of(args).items()}
        out_layouts = (out_layouts, {path: x if is_layout_leaf(x) else None for path, x in kept.items()})
    return Bound(fn, tree, statics, stateful), tuple(dynamic), out_layouts


def _emptied(leaf: Any) -> bool:
    """A DTensor holding no array: the half of ``eqx.partition(tree, filter_spec)`` that
    filters it out (JAX's pytrees hand the filter a DTensor's array, not the DTensor, so
    that half keeps the DTensor around None). Traced as None, what the half of a plain
    array is: an empty subtree, which ``eqx.combine`` fills from the other half."""
    return getattr(leaf, "array", False) is None and _own_layout(leaf) is not None


def _static_flags(tree: Any, leaves: list[Any]) -> list[bool]:
    """Per leaf of ``tree`` (``leaves``): whether it is static (module docstring)."""
    module = _eqx_module()
    in_module = _in_modules(tree, module) if module is not None else None
    if in_module is None:
        return [False] * len(leaves)
    return [
        inside and (isinstance(leaf, _NUMBERS) or not (is_tensor_leaf(leaf) or _is_constant(leaf)))
        for inside, leaf in zip(in_module, leaves)
    ]


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _in_modules(args: Any, module: type) -> list[bool] | None:
    """Per leaf of ``args``: whether it sits inside an ``eqx.Module`` (None: no module)."""
    pieces = jax.tree.leaves(args, is_leaf=lambda x: is_tensor_leaf(x) or isinstance(x, module))
    if not any(isinstance(p, module) for p in pieces):
        return None
    flags: list[bool] = []
    for piece in pieces:
        inside = isinstance(piece, module)
        flags.extend([inside] * (len(jax.tree.leaves(piece, is_leaf=is_tensor_leaf)) if inside else 1))
    return flags
