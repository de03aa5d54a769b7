"""The op registries: named ops (for ``infer_signature`` and DTensor operators) and jaxpr
primitives (for ``predict``), each mapped onto a rule family of :mod:`.rules`.

A named op has a *reference*: the JAX function it denotes, called as
``reference(*arrays, **params)`` (e.g. ``"sum"`` is ``jnp.sum(x, axis=..., keepdims=...)``).
Inference uses it only through ``jax.eval_shape`` to learn the output shapes; an
integrator runs it to compute the op. A primitive lists the equation params its rule reads.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import api_util  # fun_sourceinfo: the "name at file:line" JAX records in a traced jaxpr's debug info
from jax.extend import core

from ..caches import clear_caches
from ..errors import ArgumentTypeError, InferenceError, UnsupportedOpError
from ..placements import Placement, Shard, parse_placement
from . import rules
from .rules import PartialKind
from .signature import Aval, OneDSig

__all__ = [
    "ELEMENTWISE_PRIMITIVES",
    "FunctionDef",
    "OpDef",
    "PrimitiveDef",
    "einsum_letters",
    "freeze",
    "function_definition",
    "layer_norm",
    "op_definition",
    "op_names",
    "out_shapes",
    "primitive_definition",
    "primitive_names",
    "register_sharding",
    "registered_function",
    "unregister_sharding",
]

Rule = Callable[..., list[OneDSig]]


@dataclass(frozen=True)
class OpDef:
    """A named op: ``reference(*arrays, **params)`` computes it with JAX, ``rule(ins,
    outs, **params)`` lists its 1-D signatures from avals and the same params."""

    name: str
    reference: Callable[..., Any]
    rule: Rule


@dataclass(frozen=True)
class PrimitiveDef:
    """A jaxpr primitive: ``rule(ins, outs, **{p: eqn.params[p] for p in params})``
    (``params=None``: every equation param with a hashable value, as user rules get)."""

    name: str
    params: tuple[str, ...] | None
    rule: Rule

    def read_params(self, params: Mapping[str, Any]) -> Any:
        """The frozen equation params the rule reads (the cache key of its signature)."""
        if self.params is not None:
            return freeze({p: params[p] for p in self.params}, f"{self.name} params")
        readable = {}
        for key, value in params.items():
            try:
                readable[key] = freeze(value, f"{self.name} params")
            except ArgumentTypeError:
                continue
        return freeze(readable)


_OPS: dict[str, OpDef] = {}
_PRIMITIVES: dict[str, PrimitiveDef] = {}


def op_definition(name: str) -> OpDef:
    """The named op ``name`` (raises :class:`UnsupportedOpError` naming it)."""
    if not isinstance(name, str):
        raise ArgumentTypeError("op", name, "expected an op name", f"use one of {op_names()}")
    if name in _USER_OPS:
        return _USER_OPS[name]
    if name not in _OPS:
        raise UnsupportedOpError(
            "op", name, "signature inference has no rule for this op",
            f"use one of {', '.join(op_names())}, or predict(fn, ...) for any JAX function",
        )
    return _OPS[name]


def op_names() -> tuple[str, ...]:
    """The named ops ``infer_signature`` knows (``"matmul"``, ``"sum"``, ...), sorted."""
    return tuple(sorted(_OPS))


def primitive_definition(name: str) -> PrimitiveDef:
    """The rule of jaxpr primitive ``name``, a registered one first (raises
    :class:`UnsupportedOpError` naming it)."""
    if name in _USER_PRIMITIVES:
        return _USER_PRIMITIVES[name]
    if name not in _PRIMITIVES:
        raise UnsupportedOpError(
            "primitive", name, "signature inference has no rule for this jaxpr primitive",
            "express the computation with supported primitives (see placements2jax.inference.primitive_names())",
        )
    return _PRIMITIVES[name]


def primitive_names() -> tuple[str, ...]:
    """The jaxpr primitives ``predict`` has rules for (registered ones included), sorted."""
    return tuple(sorted(set(_PRIMITIVES) | set(_USER_PRIMITIVES)))


def freeze(value: Any, argument: str = "params") -> Any:
    """A hashable, normalized copy of an op parameter: lists become tuples, dicts sorted
    item tuples, NumPy integers and bools Python ones (jaxprs of ``jax.grad`` carry
    ``np.int64`` dims, e.g. in ``broadcast_dimensions``), named tuples (dimension
    numbers) keep their type with normalized fields."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if type(value) in (list, tuple):
        return tuple(freeze(v, argument) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuples are read by field name
        return type(value)(*(freeze(v, argument) for v in value))
    if isinstance(value, Mapping):
        return tuple(sorted((k, freeze(v, argument)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        raise ArgumentTypeError(
            argument, value, "op parameters must be hashable (inference results are cached)",
            "pass tuples, ints, strings or dtypes",
        ) from None
    return value


# -- helpers ---------------------------------------------------------------------------------


def _axes(value: int | Sequence[int] | None, ndim: int, argument: str = "axis") -> tuple[int, ...]:
    if value is None:
        return tuple(range(ndim))
    values = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    result = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -ndim <= v < max(ndim, 1):
            raise InferenceError(argument, value, f"not an axis of a {ndim}-d tensor", f"use axes in [{-ndim}, {ndim})")
        result.append(int(v) % max(ndim, 1))
    return tuple(sorted(set(result)))


def einsum_letters(subscripts: str, ndims: Sequence[int]) -> tuple[tuple[str, ...], str]:
    """Parse einsum ``subscripts`` (with ``...`` and implicit output) for operands of the
    given ranks into one letter string per operand and the output's letters."""
    if not isinstance(subscripts, str):
        raise ArgumentTypeError("subscripts", subscripts, "expected an einsum string", 'pass e.g. "ij,jk->ik"')
    text = subscripts.replace(" ", "")
    lhs, arrow, out = text.partition("->")
    parts = lhs.split(",")
    if len(parts) != len(ndims):
        raise InferenceError(
            "subscripts", subscripts, f"{len(parts)} operands in the subscripts, {len(ndims)} given",
            "give one subscript per operand",
        )
    spare = [c for c in string.ascii_letters if c not in text]
    ellipsis_rank = max((n - len(p.replace("...", "")) for p, n in zip(parts, ndims) if "..." in p), default=0)
    broadcast = "".join(spare[:ellipsis_rank])
    operands = []
    for part, n in zip(parts, ndims):
        letters = part.replace("...", broadcast[ellipsis_rank - (n - len(part.replace("...", ""))):]) if "..." in part else part
        if len(letters) != n or not all(c in string.ascii_letters or c in broadcast for c in letters):
            raise InferenceError(
                "subscripts", subscripts, f"subscript {part!r} does not fit an operand of rank {n}",
                "give one letter per operand dim",
            )
        operands.append(letters)
    if arrow:
        output = out.replace("...", broadcast)
    else:
        counts = {c: "".join(operands).count(c) for c in "".join(operands)}
        output = broadcast + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in broadcast))
    return tuple(operands), output


def _matmul_letters(a: Aval, b: Aval) -> tuple[tuple[str, str], str]:
    if a.ndim == 0 or b.ndim == 0:
        raise InferenceError("inputs", (str(a), str(b)), "matmul needs operands of rank >= 1", "use mul for scalars")
    batch = max(a.ndim, b.ndim, 2) - 2
    letters = string.ascii_lowercase[:batch]
    left = letters[batch - max(a.ndim - 2, 0):] + ("mk" if a.ndim >= 2 else "k")
    right = letters[batch - max(b.ndim - 2, 0):] + ("kn" if b.ndim >= 2 else "k")
    output = letters + ("m" if a.ndim >= 2 else "") + ("n" if b.ndim >= 2 else "")
    return (left, right), output


def _dot_general_letters(
    lhs: Aval, rhs: Aval, dimension_numbers: Any
) -> tuple[tuple[str, str], str]:
    (lc, rc), (lb, rb) = dimension_numbers
    pool = iter(string.ascii_letters)
    left = [next(pool) for _ in range(lhs.ndim)]
    right = [""] * rhs.ndim
    for l_dim, r_dim in zip(lc, rc):
        right[r_dim] = left[l_dim]
    for l_dim, r_dim in zip(lb, rb):
        right[r_dim] = left[l_dim]
    right = [c or next(pool) for c in right]
    free_left = [left[d] for d in range(lhs.ndim) if d not in lc and d not in lb]
    free_right = [right[d] for d in range(rhs.ndim) if d not in rc and d not in rb]
    output = "".join(left[d] for d in lb) + "".join(free_left) + "".join(free_right)
    return ("".join(left), "".join(right)), output


def _ragged_dot_letters(
    lhs: Aval, rhs: Aval, group_sizes: Aval, dimension_numbers: Any
) -> tuple[tuple[str, str, str], str, str]:
    """Index letters of ``ragged_dot_general``'s ``lhs``, ``rhs``, ``group_sizes`` and
    output, and the letters of its lhs ragged dim and group dim (see
    :func:`.rules.ragged_dot`). The dot's letters are ``dot_general``'s; the group
    dim is the rhs group dim when the ragged dim is an lhs free dim (absent from the
    output), else a letter of its own (the output's leading dim when the ragged dim is
    contracted). ``group_sizes`` is ``[prefix..., g]`` or ``[g]`` (broadcast over the
    prefix): the prefix is the lhs batch dims, then the lhs free dims (contracted dims
    when the ragged dim is contracted) before the ragged dim, as JAX's shape rule says
    (``jax._src.lax.lax._ragged_dot_prefix_dims``); a ragged batch dim's prefix is the
    batch dims before it."""
    (lc, _), (lb, _) = dimension_numbers.dot_dimension_numbers
    (ragged,) = dimension_numbers.lhs_ragged_dimensions
    (left, right), output = _dot_general_letters(lhs, rhs, dimension_numbers.dot_dimension_numbers)
    free = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    if ragged in free:
        (group_dim,) = dimension_numbers.rhs_group_dimensions
        group = right[group_dim]
        output = output.replace(group, "")
        prefix = [*lb, *free[: free.index(ragged)]]
    else:
        group = next(c for c in string.ascii_letters if c not in left + right)
        contracted = ragged in lc
        output = group + output if contracted else output
        prefix = [*lb, *lc[: list(lc).index(ragged)]] if contracted else list(lb[: list(lb).index(ragged)])
    sizes = "".join(left[d] for d in prefix) + group if group_sizes.ndim > 1 else group
    return (left, right, sizes), output, left[ragged] + group


def layer_norm(
    x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None, *, axis: Any = -1, eps: float = 1e-5
) -> jax.Array:
    """Layer norm over ``axis`` (trailing dims), times ``weight`` plus ``bias``."""
    axes = _axes(axis, x.ndim)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) * lax.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


# -- named ops -------------------------------------------------------------------------------


def _register(names: str | Sequence[str], reference: Callable[..., Any], rule: Rule) -> None:
    for name in (names,) if isinstance(names, str) else names:
        _OPS[name] = OpDef(name, reference, rule)


def _elementwise_rule(kind: PartialKind) -> Rule:
    def rule(ins: Sequence[Aval], outs: Sequence[Aval], **_: Any) -> list[OneDSig]:
        return rules.elementwise(ins, outs, partial=kind)

    return rule


_ELEMENTWISE: dict[PartialKind, dict[str, Callable[..., Any]]] = {
    "linear": {"add": jnp.add, "sub": jnp.subtract, "subtract": jnp.subtract},
    "product": {"mul": jnp.multiply, "multiply": jnp.multiply},
    "numerator": {"div": jnp.divide, "divide": jnp.divide, "true_divide": jnp.true_divide},
    "max": {"maximum": jnp.maximum},
    "min": {"minimum": jnp.minimum},
    "none": {
        "pow": jnp.power, "power": jnp.power, "equal": jnp.equal, "not_equal": jnp.not_equal, "less": jnp.less,
        "less_equal": jnp.less_equal, "greater": jnp.greater, "greater_equal": jnp.greater_equal,
        "exp": jnp.exp, "log": jnp.log, "tanh": jnp.tanh, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt, "abs": jnp.abs,
        "square": jnp.square, "sigmoid": jax.nn.sigmoid, "relu": jax.nn.relu, "gelu": jax.nn.gelu,
        "silu": jax.nn.silu, "sin": jnp.sin, "cos": jnp.cos, "erf": jax.scipy.special.erf, "log1p": jnp.log1p,
        "expm1": jnp.expm1, "sign": jnp.sign, "reciprocal": jnp.reciprocal, "floor": jnp.floor, "ceil": jnp.ceil,
    },
    "negate": {"neg": jnp.negative, "negative": jnp.negative},
    "identity": {"copy": jnp.copy},
    "select": {"where": jnp.where},
}
for _kind, _table in _ELEMENTWISE.items():
    for _name, _fn in _table.items():
        _register(_name, _fn, _elementwise_rule(_kind))
_register("add_n", lambda *xs: sum(xs[1:], xs[0]), _elementwise_rule("linear"))


def _astype(x: jax.Array, dtype: Any) -> jax.Array:
    return x.astype(dtype)


_register(("astype", "convert_element_type"), _astype, lambda ins, outs, **p: rules.convert(ins, outs))


def _matmul(ins: Sequence[Aval], outs: Sequence[Aval]) -> list[OneDSig]:
    operands, output = _matmul_letters(ins[0], ins[1])
    return rules.einsum(ins, outs, operands=operands, output=output)


def _einsum_reference(*operands: jax.Array, subscripts: str) -> jax.Array:
    return jnp.einsum(subscripts, *operands)


def _einsum(ins: Sequence[Aval], outs: Sequence[Aval], *, subscripts: str, **_: Any) -> list[OneDSig]:
    operands, output = einsum_letters(subscripts, [a.ndim for a in ins])
    return rules.einsum(ins, outs, operands=operands, output=output)


def _dot_general(ins: Sequence[Aval], outs: Sequence[Aval], *, dimension_numbers: Any, **_: Any) -> list[OneDSig]:
    operands, output = _dot_general_letters(ins[0], ins[1], dimension_numbers)
    return rules.einsum(ins, outs, operands=operands, output=output)


_register("matmul", jnp.matmul, lambda ins, outs, **p: _matmul(ins, outs))
_register("einsum", _einsum_reference, _einsum)
_register("dot_general", lax.dot_general, _dot_general)


def _reduction_op(kind: str) -> Rule:
    def rule(ins: Sequence[Aval], outs: Sequence[Aval], *, axis: Any = None, **_: Any) -> list[OneDSig]:
        return rules.reduction(ins, outs, axes=_axes(axis, ins[0].ndim), kind=kind)

    return rule


for _name, _fn, _kind in (
    ("sum", jnp.sum, "sum"),
    ("mean", jnp.mean, "mean"),
    ("max", jnp.max, "max"),
    ("min", jnp.min, "min"),
    ("prod", jnp.prod, "prod"),
    ("argmax", jnp.argmax, "arg"),
    ("argmin", jnp.argmin, "arg"),
):
    _register(_name, _fn, _reduction_op(_kind))


def _transpose(ins: Sequence[Aval], outs: Sequence[Aval], *, axes: Any = None, **_: Any) -> list[OneDSig]:
    ndim = ins[0].ndim
    permutation = tuple(range(ndim))[::-1] if axes is None else tuple(int(a) % ndim for a in axes)
    return rules.transpose(ins, outs, permutation=permutation)


_register("transpose", jnp.transpose, _transpose)
_register("reshape", jnp.reshape, lambda ins, outs, **p: rules.reshape(ins, outs))
_register(
    "broadcast_to",
    jnp.broadcast_to,
    lambda ins, outs, **p: rules.broadcast_in_dim(
        ins, outs, broadcast_dimensions=tuple(range(outs[0].ndim - ins[0].ndim, outs[0].ndim))
    ),
)


def _normalization(ins: Sequence[Aval], outs: Sequence[Aval], *, axis: Any = -1, **_: Any) -> list[OneDSig]:
    return rules.normalization(ins, outs, axes=_axes(axis, ins[0].ndim))


_register("softmax", jax.nn.softmax, _normalization)
_register("log_softmax", jax.nn.log_softmax, _normalization)
_register("layer_norm", layer_norm, _normalization)


def _take_reference(a: jax.Array, indices: jax.Array, *, axis: int = 0, mode: str | None = None) -> jax.Array:
    return jnp.take(a, indices, axis=axis, mode=mode)


def _take(ins: Sequence[Aval], outs: Sequence[Aval], *, axis: int | None = 0, **_: Any) -> list[OneDSig]:
    if axis is None:  # jnp.take of the flattened table: Replicate only
        return []
    return rules.take(ins, outs, axis=_axes(axis, ins[0].ndim)[0])


_register(("take", "embedding"), _take_reference, _take)


def _concatenate_reference(*arrays: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.concatenate(arrays, axis=axis)


def _concatenate(ins: Sequence[Aval], outs: Sequence[Aval], *, axis: int | None = 0, **_: Any) -> list[OneDSig]:
    if axis is None:  # concatenation of the flattened inputs: Replicate only
        return []
    return rules.concatenate(ins, outs, dimension=_axes(axis, ins[0].ndim)[0])


_register("concatenate", _concatenate_reference, _concatenate)


# -- output shapes of named ops without tracing -------------------------------------------------

Shapes = tuple[tuple[int, ...], ...]
_FLOATS = frozenset(np.dtype(t) for t in ("float32", "float16", jnp.bfloat16))
_NUMBERS = _FLOATS | {np.dtype("int32")}


def out_shapes(name: str, params: Mapping[str, Any], in_avals: Sequence[Aval]) -> tuple[Aval, ...] | None:
    """The output avals of named op ``name`` computed from shapes alone, as
    ``jax.eval_shape`` of its reference gives them (half of a cold ``infer_signature`` on
    a 1-D mesh is that tracing), or None where this does not know them exactly: ops
    without a rule here, inputs of different or other dtypes (JAX's type promotion, e.g.
    a sum of int8 in int32), 64-bit mode, unusual params or shapes (then ``eval_shape``
    says what is wrong)."""
    rule = _SHAPE_RULES.get(name)
    if rule is None or jax.config.jax_enable_x64 or not in_avals:
        return None
    fn, dtypes, keys = rule
    dtype = in_avals[0].dtype
    others = in_avals[1:] if name != "take" else ()
    if dtype not in dtypes or any(a.dtype != dtype for a in others) or set(params) - keys:
        return None
    if name == "take" and (len(in_avals) != 2 or in_avals[1].dtype != np.int32):
        return None
    try:
        shapes = fn([a.shape for a in in_avals], **params)
    except (TypeError, ValueError):
        return None
    return None if shapes is None else tuple(Aval(shape, dtype) for shape in shapes)


def _axes_or_none(axis: Any, ndim: int) -> tuple[int, ...] | None:
    """``axis`` (None, an int or ints) as distinct non-negative axes, or None if unusual."""
    values = tuple(range(ndim)) if axis is None else (axis,) if type(axis) is int else axis
    if type(values) is not tuple or any(type(v) is not int or not -ndim <= v < ndim for v in values):
        return None
    result = tuple(v % ndim for v in values)
    return result if len(set(result)) == len(result) else None


def _broadcast_shape(shapes: list[tuple[int, ...]]) -> Shapes | None:
    return (tuple(np.broadcast_shapes(*shapes)),) if len(shapes) == 2 else None


def _matmul_shape(shapes: list[tuple[int, ...]]) -> Shapes | None:
    if len(shapes) != 2 or min(len(shapes[0]), len(shapes[1])) < 2 or shapes[0][-1] != shapes[1][-2]:
        return None
    batch = tuple(np.broadcast_shapes(shapes[0][:-2], shapes[1][:-2]))
    return (batch + (shapes[0][-2], shapes[1][-1]),)


def _einsum_shape(shapes: list[tuple[int, ...]], *, subscripts: str) -> Shapes | None:
    if type(subscripts) is not str or subscripts.count("->") != 1:
        return None
    inputs, output = subscripts.replace(" ", "").split("->")
    operands = inputs.split(",")
    letters = set(string.ascii_letters)
    if len(operands) != len(shapes) or not set(inputs.replace(",", "") + output) <= letters:
        return None
    sizes: dict[str, int] = {}
    for operand, shape in zip(operands, shapes):
        if len(operand) != len(shape) or len(set(operand)) != len(operand):
            return None
        for letter, size in zip(operand, shape):
            if sizes.setdefault(letter, size) != size:
                return None  # broadcasting of size-1 dims: eval_shape knows
    if len(set(output)) != len(output) or not set(output) <= set(sizes):
        return None
    return (tuple(sizes[letter] for letter in output),)


def _reduction_shape(shapes: list[tuple[int, ...]], *, axis: Any = None, keepdims: bool = False) -> Shapes | None:
    axes = _axes_or_none(axis, len(shapes[0])) if len(shapes) == 1 and type(keepdims) is bool else None
    if axes is None:
        return None
    return (tuple(1 if d in axes else n for d, n in enumerate(shapes[0]) if keepdims or d not in axes),)


def _transpose_shape(shapes: list[tuple[int, ...]], *, axes: Any = None) -> Shapes | None:
    ndim = len(shapes[0])
    order = tuple(range(ndim))[::-1] if axes is None else _axes_or_none(axes, ndim)
    if len(shapes) != 1 or order is None or len(order) != ndim:
        return None
    return (tuple(shapes[0][a] for a in order),)


def _reshape_shape(shapes: list[tuple[int, ...]], *, shape: Any) -> Shapes | None:
    target = (shape,) if type(shape) is int else shape
    if len(shapes) != 1 or type(target) is not tuple or any(type(n) is not int or n < -1 for n in target):
        return None
    size, known = int(np.prod(shapes[0], dtype=np.int64)), int(np.prod([n for n in target if n != -1], dtype=np.int64))
    if target.count(-1) > 1 or (target.count(-1) == 1 and (known == 0 or size % known)):
        return None
    result = tuple(size // known if n == -1 else n for n in target)
    return (result,) if int(np.prod(result, dtype=np.int64)) == size else None


def _same_shape(shapes: list[tuple[int, ...]], *, axis: Any = -1) -> Shapes | None:
    return (shapes[0],) if len(shapes) == 1 and _axes_or_none(axis, len(shapes[0])) else None


def _layer_norm_shape(shapes: list[tuple[int, ...]], *, axis: Any = -1, eps: float = 1e-5) -> Shapes | None:
    if not 1 <= len(shapes) <= 3 or not _axes_or_none(axis, len(shapes[0])):
        return None
    return (tuple(np.broadcast_shapes(*shapes)),)


def _take_shape(shapes: list[tuple[int, ...]], *, axis: Any = 0, mode: Any = None) -> Shapes | None:
    axes = _axes_or_none(axis, len(shapes[0])) if len(shapes) == 2 and type(axis) is int and mode is None else None
    if not axes:
        return None
    return (shapes[0][:axes[0]] + shapes[1] + shapes[0][axes[0] + 1:],)


# op -> (shapes from input shapes and params, input dtypes it knows, params it knows)
_SHAPE_RULES: dict[str, tuple[Callable[..., Shapes | None], frozenset[np.dtype], frozenset[str]]] = {
    **{name: (_broadcast_shape, _NUMBERS, frozenset()) for name in ("add", "sub", "subtract", "mul", "multiply")},
    "matmul": (_matmul_shape, _NUMBERS, frozenset()),
    "einsum": (_einsum_shape, _NUMBERS, frozenset({"subscripts"})),
    "sum": (_reduction_shape, _NUMBERS, frozenset({"axis", "keepdims"})),
    "mean": (_reduction_shape, _FLOATS, frozenset({"axis", "keepdims"})),
    "transpose": (_transpose_shape, _NUMBERS, frozenset({"axes"})),
    "reshape": (_reshape_shape, _NUMBERS, frozenset({"shape"})),
    **{name: (_same_shape, _FLOATS, frozenset({"axis"})) for name in ("softmax", "log_softmax")},
    "layer_norm": (_layer_norm_shape, _FLOATS, frozenset({"axis", "eps"})),
    "take": (_take_shape, _NUMBERS, frozenset({"axis", "mode"})),
}


# -- jaxpr primitives ------------------------------------------------------------------------


def _primitive(names: str | Sequence[str], rule: Rule, params: Sequence[str] = ()) -> None:
    for name in (names,) if isinstance(names, str) else names:
        _PRIMITIVES[name] = PrimitiveDef(name, tuple(params), rule)


_PRIMITIVE_KINDS: dict[PartialKind, tuple[str, ...]] = {
    "linear": ("add", "sub", "add_any", "complex"),
    "product": ("mul",),
    "numerator": ("div",),
    "max": ("max",),
    "min": ("min",),
    "negate": ("neg",),
    "identity": ("copy", "copy_p", "reduce_precision", "stop_gradient", "real", "imag", "name"),
    "select": ("select_n",),
    "none": (
        "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cbrt", "ceil", "cos", "cosh", "erf", "erf_inv",
        "erfc", "exp", "exp2", "expm1", "floor", "integer_pow", "is_finite", "lgamma", "digamma", "log",
        "log1p", "logistic", "not", "population_count", "clz", "round", "rsqrt", "sign", "sin", "sinh", "sqrt",
        "square", "tan", "tanh", "conj", "atan2", "pow", "rem", "and", "or", "xor", "eq", "ne", "lt", "le", "gt",
        "ge", "nextafter", "shift_left", "shift_right_arithmetic", "shift_right_logical", "clamp",
        "igamma", "igammac", "polygamma", "zeta", "mulhi", "igamma_grad_a", "regularized_incomplete_beta",
        "bessel_i0e", "bessel_i1e", "eq_to", "le_to", "lt_to",
    ),
}
for _kind, _names in _PRIMITIVE_KINDS.items():
    _primitive(_names, _elementwise_rule(_kind))

_primitive("convert_element_type", lambda ins, outs: rules.convert(ins, outs))
# the primitives computing each element of their output from the same element of their operands (broadcast
# scalars aside): an output of an operand's shape is laid out as that operand by XLA's propagation
ELEMENTWISE_PRIMITIVES = frozenset((*(n for names in _PRIMITIVE_KINDS.values() for n in names), "convert_element_type"))
_primitive("dot_general", _dot_general, ("dimension_numbers",))


def _ragged_dot_general(
    ins: Sequence[Aval], outs: Sequence[Aval], *, ragged_dot_dimension_numbers: Any
) -> list[OneDSig]:
    operands, output, groups = _ragged_dot_letters(ins[0], ins[1], ins[2], ragged_dot_dimension_numbers)
    return rules.ragged_dot(ins, outs, operands=operands, output=output, groups=groups)


_primitive("ragged_dot_general", _ragged_dot_general, ("ragged_dot_dimension_numbers",))
for _name, _kind in (
    ("reduce_sum", "sum"),
    ("reduce_max", "max"),
    ("reduce_min", "min"),
    ("reduce_prod", "prod"),
    ("reduce_xor", "other"),
    ("argmax", "arg"),
    ("argmin", "arg"),
):
    _primitive(_name, lambda ins, outs, *, axes, _kind=_kind: rules.reduction(ins, outs, axes=axes, kind=_kind), ("axes",))


def _positional_collective(
    ins: Sequence[Aval], outs: Sequence[Aval], *, axes: Sequence[Any], axis_index_groups: Any, kind: str, name: str
) -> list[OneDSig]:
    """A ``psum`` / ``pmax`` / ``pmin`` over a ``jax.vmap``'s own axis (``axis_name=``):
    JAX's batching rule leaves it with positional (int) ``axes``, a reduction of those
    dims of its one batched operand (``rules.reduction``). Over named axes it is a
    ``shard_map`` body's collective, which the walk of a region reads (:mod:`.regions`)."""
    if any(not isinstance(a, int) for a in axes) or axis_index_groups is not None or len(ins) != 1:
        raise UnsupportedOpError(
            "primitive", name, f"over axes {tuple(axes)} (groups {axis_index_groups}, {len(ins)} operands) outside a "
            "shard_map region: only a vmap's reduction of one operand over its own axis has a rule",
            "write the collective inside jax.shard_map (whose regions predict reads), or reduce with jnp.sum / "
            "jnp.max / jnp.min",
        )
    return rules.reduction(ins, outs, axes=axes, kind=kind)


for _name, _kind in (("psum", "sum"), ("pmax", "max"), ("pmin", "min")):
    _primitive(
        _name,
        lambda ins, outs, *, axes, axis_index_groups, _kind=_kind, _name=_name: _positional_collective(
            ins, outs, axes=axes, axis_index_groups=axis_index_groups, kind=_kind, name=_name),
        ("axes", "axis_index_groups"),
    )
_primitive(
    "reduce", lambda ins, outs, *, dimensions: rules.custom_reduction(ins, outs, dimensions=dimensions), ("dimensions",)
)
# On bools, all is min and any is max (False < True), so a split reduced dim gives
# P(min)/P(max) and the ranks combine one bool each (optax.apply_if_finite's isfinite over
# every update) instead of gathering the operand; on integers they are bitwise, no partial.
for _name, _bool_kind in (("reduce_and", "min"), ("reduce_or", "max")):
    _primitive(
        _name,
        lambda ins, outs, *, axes, _bool_kind=_bool_kind: rules.reduction(
            ins, outs, axes=axes, kind=_bool_kind if ins[0].dtype == jnp.bool_ else "other"
        ),
        ("axes",),
    )
_primitive("transpose", lambda ins, outs, *, permutation: rules.transpose(ins, outs, permutation=permutation), ("permutation",))
_primitive(
    "reshape",
    lambda ins, outs, *, dimensions: rules.reshape(ins, outs, dimensions=dimensions),
    ("dimensions",),
)
_primitive("squeeze", lambda ins, outs: rules.reshape(ins, outs))
_primitive(
    "broadcast_in_dim",
    lambda ins, outs, *, broadcast_dimensions: rules.broadcast_in_dim(ins, outs, broadcast_dimensions=broadcast_dimensions),
    ("broadcast_dimensions",),
)
_primitive("concatenate", lambda ins, outs, *, dimension: rules.concatenate(ins, outs, dimension=dimension), ("dimension",))
_primitive("split", lambda ins, outs, *, axis: rules.split(ins, outs, axis=axis), ("axis",))
_primitive(
    "gather",
    lambda ins, outs, *, dimension_numbers, slice_sizes: rules.gather(
        ins, outs, dimension_numbers=dimension_numbers, slice_sizes=slice_sizes
    ),
    ("dimension_numbers", "slice_sizes"),
)
for _name in rules.SCATTERS:
    _primitive(
        _name,
        lambda ins, outs, *, dimension_numbers, _name=_name: rules.scatter(
            ins, outs, dimension_numbers=dimension_numbers, kind=_name
        ),
        ("dimension_numbers",),
    )
_primitive(("slice", "dynamic_slice"), lambda ins, outs: rules.slices(ins, outs))
_primitive("dynamic_update_slice", lambda ins, outs: rules.dynamic_update_slice(ins, outs))
_primitive("stack", lambda ins, outs, *, axis: rules.stack(ins, outs, axis=axis), ("axis",))
_primitive("unstack", lambda ins, outs, *, axis: rules.unstack(ins, outs, axis=axis), ("axis",))
_primitive("rev", lambda ins, outs, *, dimensions: rules.reverse(ins, outs, dimensions=dimensions), ("dimensions",))
_primitive("tile", lambda ins, outs, *, reps: rules.tile(ins, outs, reps=reps), ("reps",))
_primitive("sort", lambda ins, outs, *, dimension: rules.along_axis(ins, outs, axis=dimension), ("dimension",))
_primitive("top_k", lambda ins, outs, *, axis: rules.along_axis(ins, outs, axis=axis), ("axis",))
_primitive("bitcast_convert_type", lambda ins, outs: rules.bitcast(ins, outs))
_primitive(
    "conv_general_dilated",
    lambda ins, outs, *, dimension_numbers, feature_group_count, batch_group_count: rules.conv(
        ins, outs, dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
    ),
    ("dimension_numbers", "feature_group_count", "batch_group_count"),
)
_primitive("pad", lambda ins, outs, *, padding_config: rules.pad(ins, outs, padding_config=padding_config), ("padding_config",))
for _name, _kind in (("cumsum", "sum"), ("cummax", "max"), ("cummin", "min"), ("cumprod", "prod"), ("cumlogsumexp", "other")):
    _primitive(_name, lambda ins, outs, *, axis, _kind=_kind: rules.cumulative(ins, outs, axis=axis, kind=_kind), ("axis",))
_WINDOW = ("window_dimensions", "window_strides", "padding")
_DILATED_WINDOW = (*_WINDOW, "base_dilation")  # a window dilation splits nothing more: a split dim's window is one
for _name, _partials, _params in (
    ("reduce_window_sum", rules.LINEAR_OPS, _DILATED_WINDOW),
    ("reduce_window_max", ("max",), _DILATED_WINDOW),
    ("reduce_window_min", ("min",), _DILATED_WINDOW),
    ("reduce_window", (), _DILATED_WINDOW),
    ("select_and_gather_add", rules.LINEAR_OPS, _DILATED_WINDOW),
    ("select_and_scatter_add", rules.LINEAR_OPS, _WINDOW),
):
    _primitive(
        _name,
        lambda ins, outs, *, window_dimensions, window_strides, padding, base_dilation=None, _partials=_partials: (
            rules.window(ins, outs, window_dimensions=window_dimensions, window_strides=window_strides,
                         padding=padding, base_dilation=base_dilation, partials=_partials)
        ),
        _params,
    )
_primitive("fft", lambda ins, outs, *, fft_lengths: rules.fft(ins, outs, fft_lengths=fft_lengths), ("fft_lengths",))
_primitive(
    (
        "cholesky", "eigh", "svd", "qr", "householder_product", "lu", "eig", "schur", "hessenberg", "tridiagonal", "ormqr",
        "cholesky_update",
    ),
    lambda ins, outs: rules.linalg(ins, outs),
)
_primitive("symmetric_product", lambda ins, outs: rules.symmetric_product(ins, outs))
_primitive("lu_pivots_to_permutation", lambda ins, outs: rules.linalg(ins, outs, core_dims=1))
_primitive("triangular_solve", lambda ins, outs: rules.triangular_solve(ins, outs))
_primitive("tridiagonal_solve", lambda ins, outs: rules.tridiagonal_solve(ins, outs))
_primitive(
    "approx_top_k",
    lambda ins, outs, *, reduction_dimension: rules.along_axis(ins, outs, axis=reduction_dimension % ins[0].ndim),
    ("reduction_dimension",),
)
# values made from nothing, and PRNG keys and bits: Replicate (every rank draws the same
# bits; a split consumer slices them for free); ``platform_index`` (``lax.platform_dependent``'s
# branch index) is a scalar made from nothing; ``empty2`` / ``empty`` are uninitialized buffers
# (JAX's ``empty_like``: under ``jax.grad``, each ``lax.cond`` / ``switch`` branch returns one in
# place of the residuals only the other branches save)
_primitive(
    (
        "iota", "rng_uniform", "rng_bit_generator", "random_seed", "random_bits", "random_split", "random_fold_in",
        "random_wrap", "random_unwrap", "random_clone", "threefry2x32", "platform_index", "empty", "empty2",
    ),
    rules.replicated,
)
# ``jax.random.gamma`` / ``beta`` / ``dirichlet``'s draw (mixup's mixing weights): its key split per element of
# the whole shape
_primitive("random_gamma", rules.replicated)


# -- user sharding rules (torch's register_sharding) ----------------------------------------

UserRule = Callable[..., Sequence[Any]]
# call-like primitives and the param holding the called jaxpr (loops are not calls): the one table of
# them; the walk enters every one, check inlines those but remat's (:data:`REMAT_CALLS`), and a
# registered function is recognized by the calls of it among them (:data:`_FUNCTION_CALLS`)
CALL_JAXPR_PARAMS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}
REMAT_CALLS = ("remat2", "checkpoint")
# the equations a registered function can be: calls of it (their called jaxpr's source is the
# function's) and Pallas calls of it as the kernel
_FUNCTION_CALLS = {name: CALL_JAXPR_PARAMS[name] for name in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call")}
_KERNEL_CALLS = {"pallas_call": "jaxpr"}


@dataclass(frozen=True)
class FunctionDef:
    """A user function with a registered rule: ``rule(*avals)`` lists its 1-D signatures;
    ``function`` runs it on one rank's blocks (``apply``); ``source`` identifies its
    equations (``"name at file:line"``, as JAX's debug info of the called jaxpr says)."""

    name: str
    source: str
    function: Callable[..., Any]
    rule: Rule


_USER_OPS: dict[str, OpDef] = {}
_USER_PRIMITIVES: dict[str, PrimitiveDef] = {}
_USER_FUNCTIONS: dict[str, FunctionDef] = {}


def register_sharding(op: Any) -> Callable[[UserRule], UserRule]:
    """Register a sharding rule for ``op`` (torch's ``register_sharding``): a decorator
    of ``rule``, returned unchanged. ``op`` is one of, or a list of:

    * a named op of :func:`infer_signature` and the DTensor operators (``"softmax"``);
    * a jaxpr primitive (``jax.lax.exp_p``, a ``jax.extend.core.Primitive`` of your own),
      used by ``predict``, ``check`` and ``apply`` for its equations;
    * a function: a ``jax.custom_vjp`` / ``jax.custom_jvp`` function, or a function you
      call through ``jax.jit`` (its equation is ``jit[name=...]``), or a Pallas kernel
      (its equation is ``pallas_call``; ``apply`` needs the jitted wrapper instead).
      Its calls become one equation with this rule instead of being walked inside.

    ``rule(*avals, **params)`` gets one :class:`Aval` (``.shape``, ``.dtype``, ``.ndim``)
    per tensor input (a function's array arguments in order, a primitive's operands) and
    the op's params (a named op's keywords, a primitive's equation params; none for a
    function), and returns the acceptable strategies on one mesh dim: a sequence of
    ``(output placements, input placements)`` pairs, one placement (or ``"S(0)"`` text)
    per output and per input. Selection expands them over the mesh and ranks them by cost
    as the built-in rules' (all-Replicate is always a candidate). A registered rule
    overrides the built-in one; :func:`unregister_sharding` removes it. Registering
    empties the package's caches (:func:`placements2jax.clear_caches`), whose entries may
    hold the old rule; ``clear_caches()`` itself keeps the registrations.
    """
    ops = list(op) if isinstance(op, list) else [op]
    if not ops:
        raise ArgumentTypeError("op", op, "an empty list of ops", "pass an op, a primitive or a function")
    targets = [_rule_target(o) for o in ops]

    def decorate(rule: UserRule) -> UserRule:
        if not callable(rule):
            raise ArgumentTypeError(
                "rule", rule, "not callable", "decorate a function returning [(out_placements, in_placements), ...]"
            )
        for kind, key, value in targets:
            if kind == "op":
                _USER_OPS[key] = OpDef(key, _OPS[key].reference, _user_rule(rule, key))
            elif kind == "primitive":
                _USER_PRIMITIVES[key] = PrimitiveDef(key, None, _user_rule(rule, key))
            else:
                name = getattr(value, "__name__", key)
                _USER_FUNCTIONS[key] = FunctionDef(name, key, value, _user_rule(rule, name))
        clear_caches()
        return rule

    return decorate


def unregister_sharding(op: Any) -> None:
    """Remove the rule :func:`register_sharding` gave ``op`` (or each op of a list): the
    built-in rule (if any) applies again. Raises :class:`UnsupportedOpError` if none was given."""
    for kind, key, value in [_rule_target(o) for o in (list(op) if isinstance(op, list) else [op])]:
        registry = {"op": _USER_OPS, "primitive": _USER_PRIMITIVES, "function": _USER_FUNCTIONS}[kind]
        if key not in registry:
            raise UnsupportedOpError(
                "op", value, "has no rule registered with register_sharding", "register one before removing it"
            )
        del registry[key]
    clear_caches()


def has_user_rule(kind: str, name: str) -> bool:
    """Does ``register_sharding`` give the rule of ``name`` (``kind``: "op", "primitive"
    or "function", as selection's rule keys say)? Nothing is assumed about a user's rule
    (e.g. that its signatures run on strided data)."""
    return kind == "function" or name in (_USER_OPS if kind == "op" else _USER_PRIMITIVES)


def function_definition(source: str) -> FunctionDef:
    """The registered function whose equations ``source`` (``"name at file:line"``) identifies."""
    return _USER_FUNCTIONS[source]


def registered_function(eqn: Any) -> FunctionDef | None:
    """The registered function ``eqn`` calls (a call of it or a Pallas call of it as the
    kernel), else None."""
    if not _USER_FUNCTIONS:
        return None
    param = _FUNCTION_CALLS.get(eqn.primitive.name) or _KERNEL_CALLS.get(eqn.primitive.name)
    if param is None:
        return None
    jaxpr = eqn.params.get(param)
    info = getattr(getattr(jaxpr, "jaxpr", jaxpr), "debug_info", None)
    return _USER_FUNCTIONS.get(getattr(info, "func_src_info", None) or "")


def _rule_target(op: Any) -> tuple[str, str, Any]:
    """("op" | "primitive" | "function", registry key, op) for a register_sharding target."""
    if isinstance(op, str):
        if op not in _OPS:
            raise UnsupportedOpError(
                "op", op, "is not a named op (a name registers a rule of infer_signature's named ops)",
                f"use one of {', '.join(op_names())}, or pass the primitive (e.g. jax.lax.exp_p) or your function",
            )
        return "op", op, op
    if isinstance(op, core.Primitive):
        return "primitive", op.name, op
    function = _unwrap(op)
    if callable(function) and hasattr(function, "__code__"):
        return "function", api_util.fun_sourceinfo(function), op
    raise ArgumentTypeError(
        "op", op, "expected a named op, a jaxpr primitive or a function",
        'pass e.g. "softmax", jax.lax.exp_p, or a jax.custom_vjp / jitted function',
    )


def _unwrap(op: Any) -> Any:
    """The Python function behind a custom_vjp / custom_jvp / jit wrapper."""
    for _ in range(8):
        inner = getattr(op, "fun", None) or getattr(op, "__wrapped__", None)
        if inner is None or inner is op:
            return op
        op = inner
    return op


def _user_rule(rule: UserRule, name: str) -> Rule:
    """A user rule as a built-in one: avals in, checked :class:`OneDSig` s out."""

    def one_d(ins: Sequence[Aval], outs: Sequence[Aval], **params: Any) -> list[OneDSig]:
        strategies = rule(*ins, **params)
        if not isinstance(strategies, (list, tuple)):
            raise InferenceError(
                "rule", strategies, f"the rule of {name} returned no sequence of strategies",
                "return a list of (output placements, input placements) pairs",
            )
        return [_strategy(s, ins, outs, name) for s in strategies]

    return one_d


def _strategy(strategy: Any, ins: Sequence[Aval], outs: Sequence[Aval], name: str) -> OneDSig:
    if not isinstance(strategy, (list, tuple)) or len(strategy) != 2:
        raise InferenceError(
            "rule", strategy, f"a strategy of {name} is not an (output placements, input placements) pair",
            "return e.g. ([Shard(0)], [Shard(0), Replicate()])",
        )
    out_placements, in_placements = (_placement_list(p, name) for p in strategy)
    for label, placements, avals in (("output", out_placements, outs), ("input", in_placements, ins)):
        if len(placements) != len(avals):
            raise InferenceError(
                "rule", strategy, f"{len(placements)} {label} placements for {name}'s {len(avals)} {label}s",
                f"give one placement per {label}",
            )
        for placement, aval in zip(placements, avals):
            if isinstance(placement, Shard) and not -aval.ndim <= placement.dim < aval.ndim:
                raise InferenceError(
                    "rule", strategy, f"{placement} is not a dim of {name}'s {label} {aval}",
                    f"shard a dim in [0, {aval.ndim})",
                )
    return OneDSig(
        tuple(_normalized(p, a) for p, a in zip(in_placements, ins)),
        tuple(_normalized(p, a) for p, a in zip(out_placements, outs)),
    )


def _placement_list(value: Any, name: str) -> tuple[Placement, ...]:
    values = [value] if isinstance(value, (Placement, str)) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(p, (Placement, str)) for p in values):
        raise InferenceError(
            "rule", value, f"the rule of {name} gave placements of unexpected type",
            "give a list of Shard / Replicate / Partial (or their text, e.g. 'S(0)')",
        )
    return tuple(parse_placement(p) if isinstance(p, str) else p for p in values)


def _normalized(placement: Placement, aval: Aval) -> Placement:
    return Shard(placement.dim % aval.ndim) if isinstance(placement, Shard) else placement
