"""Sharding rules: the valid 1-D signatures of each op family (pure; shapes in, lists out).

A rule gets the avals of the op's inputs and outputs plus family parameters and returns
the 1-D signatures (:class:`OneDSig`) under which running the op on every rank's local
data gives the outputs' local data. All-Replicate is not listed: selection always adds it.

Partial inputs (the "partial kinds" of elementwise ops, see ``partial_sigs``): a
Partial(sum) or Partial(avg) input passes unchanged only through ops linear in it (add
and sub of two partials, mul by a Replicate, div of a partial by a Replicate, matmul /
einsum with Replicate co-operands, sum and mean reductions, and pure data movement:
transpose, reshape, broadcast, slice, concatenate, convert between float types, gather
from a partial table). Partial(max)/Partial(min) pass only through max/min (elementwise
with a Replicate or another partial of the same op, reduce max/min) and data movement;
neg swaps max and min. Every other op needs its partial inputs reduced first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import jax.numpy as jnp
import numpy as np

from ..placements import REDUCE_OPS, Partial, Placement, ReduceOp, Replicate, Shard
from .signature import Aval, OneDSig

__all__ = [
    "PartialKind",
    "broadcast_in_dim",
    "concatenate",
    "convert",
    "cumulative",
    "einsum",
    "elementwise",
    "gather",
    "normalization",
    "nullary",
    "pad",
    "partial_sigs",
    "reduction",
    "reshape",
    "slice_full_dims",
    "split",
    "take",
    "transpose",
]

Avals: TypeAlias = Sequence[Aval]
PartialKind: TypeAlias = Literal["none", "linear", "product", "numerator", "max", "min", "negate", "identity", "select"]

R = Replicate()
LINEAR_OPS: tuple[ReduceOp, ...] = ("sum", "avg")
_NEGATED: dict[ReduceOp, ReduceOp] = {"sum": "sum", "avg": "avg", "max": "min", "min": "max"}
_REDUCTION_PARTIAL: dict[str, ReduceOp] = {"sum": "sum", "mean": "avg", "max": "max", "min": "min"}
_PARTIALS_THROUGH_REDUCTION: dict[str, tuple[ReduceOp, ...]] = {
    "sum": LINEAR_OPS,
    "mean": LINEAR_OPS,
    "max": ("max",),
    "min": ("min",),
}


def partial_sigs(kind: PartialKind, n_inputs: int, n_outputs: int = 1) -> list[OneDSig]:
    """The Partial 1-D signatures of an elementwise op of the given partial kind.

    * ``linear`` (add, sub): all inputs ``P(op)`` -> ``P(op)`` for op in sum, avg.
    * ``product`` (mul): one input ``P(op)``, the others ``R`` -> ``P(op)``, op in sum, avg.
    * ``numerator`` (div): the first input ``P(op)``, the others ``R`` -> ``P(op)``.
    * ``max`` / ``min`` (elementwise maximum / minimum): any non-empty set of inputs
      ``P(max)`` (resp. min), the others ``R`` -> ``P(max)``.
    * ``negate`` (neg): ``P(sum)->P(sum)``, ``P(avg)->P(avg)``, ``P(max)->P(min)``, ``P(min)->P(max)``.
    * ``identity`` (copy, data movement of one input): ``P(op) -> P(op)`` for every op.
    * ``select`` (select_n, where): predicate ``R``, all cases ``P(op)`` -> ``P(op)``.
    """
    def same(op: ReduceOp, inputs: Sequence[Placement]) -> OneDSig:
        return OneDSig(tuple(inputs), (Partial(op),) * n_outputs)

    if kind == "none":
        return []
    if kind == "linear":
        return [same(op, [Partial(op)] * n_inputs) for op in LINEAR_OPS]
    if kind in ("product", "numerator"):
        positions = range(n_inputs) if kind == "product" else range(1)
        return [same(op, [Partial(op) if j == i else R for j in range(n_inputs)]) for i in positions for op in LINEAR_OPS]
    if kind in ("max", "min"):
        sigs = []
        for mask in itertools.product((True, False), repeat=n_inputs):
            if any(mask):
                sigs.append(same(kind, [Partial(kind) if m else R for m in mask]))
        return sigs
    if kind == "negate":
        return [OneDSig((Partial(op),), (Partial(_NEGATED[op]),) * n_outputs) for op in REDUCE_OPS]
    if kind == "identity":
        return [same(op, [Partial(op)] + [R] * (n_inputs - 1)) for op in REDUCE_OPS]
    if kind == "select":
        return [same(op, [R] + [Partial(op)] * (n_inputs - 1)) for op in REDUCE_OPS]
    raise ValueError(f"unknown partial kind {kind!r}")


def elementwise(ins: Avals, outs: Avals, *, partial: PartialKind = "none") -> list[OneDSig]:
    """NumPy-broadcasting elementwise ops: for every output dim ``j``, ``S(j)`` on the
    output and on every input whose aligned dim has the full extent; inputs broadcast
    along ``j`` (size 1 or missing) are ``R``. Plus the partial kind's signatures."""
    out = outs[0]
    sigs = []
    for j, size in enumerate(out.shape):
        placements: list[Placement] = []
        for a in ins:
            d = j - (out.ndim - a.ndim)
            placements.append(Shard(d) if d >= 0 and a.shape[d] == size else R)
        sigs.append(OneDSig(tuple(placements), (Shard(j),) * len(outs)))
    return sigs + partial_sigs(partial, len(ins), len(outs))


def einsum(ins: Avals, outs: Avals, *, operands: Sequence[str], output: str) -> list[OneDSig]:
    """Einsum-like contractions (matmul, bmm, dot_general, einsum) given one index letter
    per operand dim. Per letter: operands with it at full extent are split on it, the
    others (broadcast: size 1 or absent) are ``R``; the output is split on it if it keeps
    the letter (batch and free dims), else ``P(sum)`` (contracted dims). A letter repeated
    within one operand (a diagonal) is never split. Multilinear: one operand ``P(op)``
    with all others ``R`` gives ``P(op)`` for op in sum, avg."""
    sizes: dict[str, int] = {}
    for aval, letters in zip(ins, operands):
        for letter, n in zip(letters, aval.shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    sigs = []
    for letter, full in sizes.items():
        if any(letters.count(letter) > 1 for letters in (*operands, output)):
            continue
        placements = tuple(
            Shard(letters.index(letter)) if letter in letters and aval.shape[letters.index(letter)] == full else R
            for aval, letters in zip(ins, operands)
        )
        result: Placement = Shard(output.index(letter)) if letter in output else Partial("sum")
        sigs.append(OneDSig(placements, (result,)))
    for i in range(len(ins)):
        for op in LINEAR_OPS:
            sigs.append(OneDSig(tuple(Partial(op) if j == i else R for j in range(len(ins))), (Partial(op),)))
    return sigs


def reduction(ins: Avals, outs: Avals, *, axes: Sequence[int], kind: str) -> list[OneDSig]:
    """Reductions over ``axes`` (with or without kept dims: the output rank says which).

    A kept dim ``S(d)`` becomes ``S(d')`` (renumbered unless keepdims). A reduced dim
    ``S(d)`` gives a partial output: sum -> ``P(sum)``, mean -> ``P(avg)`` (only for even
    splits: the average of unequal chunks' means is not the mean), max -> ``P(max)``,
    min -> ``P(min)``; other kinds (prod, argmax, any...) cannot split a reduced dim.
    Partial inputs: sum and mean pass ``P(sum)``/``P(avg)``, max ``P(max)``, min ``P(min)``.
    """
    x, out = ins[0], outs[0]
    keepdims = out.ndim == x.ndim
    kept = [d for d in range(x.ndim) if d not in axes]
    sigs = []
    for d in range(x.ndim):
        if d in axes:
            if kind in _REDUCTION_PARTIAL:
                even = {(0, d)} if kind == "mean" else set()
                sigs.append(OneDSig((Shard(d),), (Partial(_REDUCTION_PARTIAL[kind]),) * len(outs), frozenset(even)))
        else:
            sigs.append(OneDSig((Shard(d),), (Shard(d if keepdims else kept.index(d)),) * len(outs)))
    for op in _PARTIALS_THROUGH_REDUCTION.get(kind, ()):
        sigs.append(OneDSig((Partial(op),), (Partial(op),) * len(outs)))
    return sigs


def transpose(ins: Avals, outs: Avals, *, permutation: Sequence[int]) -> list[OneDSig]:
    """Output dim ``i`` is input dim ``permutation[i]``: ``S(perm[i]) -> S(i)``; partials pass."""
    sigs = [OneDSig((Shard(p),), (Shard(i),)) for i, p in enumerate(permutation)]
    return sigs + partial_sigs("identity", 1)


def reshape(ins: Avals, outs: Avals) -> list[OneDSig]:
    """Reshape (and squeeze) from the shapes alone. A split of input dim ``d`` stays a
    split of output dim ``e`` when both start at the same flat offset (the products of
    the dims before them are equal), so each chunk is one contiguous range of every
    leading block in both shapes: ``d`` is the leading (non-1) dim of its merged/split
    group and ``e`` that of its group. If the two extents differ (a merge or a split)
    the chunk ranges coincide only for even splits, which the signature requires."""
    a, b = ins[0].shape, outs[0].shape
    sigs = []
    for d, n in enumerate(a):
        if n <= 1:
            continue
        before = math.prod(a[:d])
        for e, m in enumerate(b):
            if m > 1 and math.prod(b[:e]) == before:
                even = frozenset() if n == m else frozenset({(0, d), (1, e)})
                sigs.append(OneDSig((Shard(d),), (Shard(e),), even))
                break
    return sigs + partial_sigs("identity", 1)


def broadcast_in_dim(ins: Avals, outs: Avals, *, broadcast_dimensions: Sequence[int]) -> list[OneDSig]:
    """Input dim ``d`` becomes output dim ``broadcast_dimensions[d]``: a split passes when
    the dim is not expanded from size 1; partials pass (broadcasting is data movement)."""
    x, out = ins[0], outs[0]
    extra = (R,) * (len(ins) - 1)
    sigs = [
        OneDSig((Shard(d),) + extra, (Shard(j),))
        for d, j in enumerate(broadcast_dimensions)
        if x.shape[d] == out.shape[j]
    ]
    return sigs + partial_sigs("identity", len(ins))


def normalization(ins: Avals, outs: Avals, *, axes: Sequence[int]) -> list[OneDSig]:
    """softmax, log_softmax, layer norm over ``axes`` of the first input: ``S(d)`` for
    every other dim; the other inputs (layer norm's weight and bias, shaped like the
    normalized dims) are ``R``. No partial passes (the ops are not linear)."""
    x = ins[0]
    rest = (R,) * (len(ins) - 1)
    return [OneDSig((Shard(d),) + rest, (Shard(d),) * len(outs)) for d in range(x.ndim) if d not in axes]


def take(ins: Avals, outs: Avals, *, axis: int) -> list[OneDSig]:
    """``take(table, indices, axis)``, e.g. an embedding lookup (OneFlow's gather rules):
    indices ``S(i)``, table ``R`` -> ``S(axis+i)``; table ``S(j)`` (j != axis), indices
    ``R`` -> the output dim of ``j``; table ``S(axis)``, indices ``R`` -> ``P(sum)`` with a
    masked local lookup (rows another rank owns give zeros; exact for in-range indices);
    table ``P(op)``, indices ``R`` -> ``P(op)``."""
    table, indices = ins[0], ins[1]
    sigs = [OneDSig((R, Shard(i)), (Shard(axis + i),)) for i in range(indices.ndim)]
    for j in range(table.ndim):
        result: Placement = Partial("sum") if j == axis else Shard(j if j < axis else j - 1 + indices.ndim)
        sigs.append(OneDSig((Shard(j), R), (result,)))
    return sigs + partial_sigs("identity", 2)


def gather(ins: Avals, outs: Avals, *, dimension_numbers: Any, slice_sizes: Sequence[int]) -> list[OneDSig]:
    """The ``gather`` primitive in the form ``jnp.take`` / ``table[indices]`` produce
    (one collapsed operand dim, full slices elsewhere, a trailing index vector of size 1):
    the :func:`take` rules mapped onto the output's batch and offset dims. Other gathers
    get no split signature (all-Replicate only)."""
    operand, indices, out = ins[0], ins[1], outs[0]
    dn = dimension_numbers
    if (
        getattr(dn, "operand_batching_dims", ())
        or len(dn.start_index_map) != 1
        or tuple(dn.collapsed_slice_dims) != tuple(dn.start_index_map)
        or indices.ndim == 0
        or indices.shape[-1] != 1
    ):
        return []
    axis = dn.start_index_map[0]
    if any(size != (1 if j == axis else operand.shape[j]) for j, size in enumerate(slice_sizes)):
        return []
    batch_out = [j for j in range(out.ndim) if j not in dn.offset_dims]
    offset_out = dict(zip([j for j in range(operand.ndim) if j != axis], dn.offset_dims))
    sigs = [OneDSig((R, Shard(i)), (Shard(batch_out[i]),)) for i in range(indices.ndim - 1)]
    for j in range(operand.ndim):
        result: Placement = Partial("sum") if j == axis else Shard(offset_out[j])
        sigs.append(OneDSig((Shard(j), R), (result,)))
    return sigs + partial_sigs("identity", 2)


def concatenate(ins: Avals, outs: Avals, *, dimension: int) -> list[OneDSig]:
    """Every input ``S(d)`` for ``d`` != the concatenated dim -> ``S(d)``; all inputs
    ``P(op)`` -> ``P(op)``."""
    n = len(ins)
    sigs = [OneDSig((Shard(d),) * n, (Shard(d),)) for d in range(outs[0].ndim) if d != dimension]
    return sigs + [OneDSig((Partial(op),) * n, (Partial(op),)) for op in REDUCE_OPS]


def split(ins: Avals, outs: Avals, *, axis: int) -> list[OneDSig]:
    """Splitting along ``axis``: ``S(d)`` for other dims and partials pass to every output."""
    n = len(outs)
    sigs = [OneDSig((Shard(d),), (Shard(d),) * n) for d in range(ins[0].ndim) if d != axis]
    return sigs + partial_sigs("identity", 1, n)


def convert(ins: Avals, outs: Avals) -> list[OneDSig]:
    """convert_element_type / astype: every split passes; partials pass between float
    types, from integers to floats, and between integers that cast safely (where the
    conversion is linear and monotone up to rounding), not e.g. from floats to ints."""
    sigs = elementwise(ins, outs)
    src, dst = ins[0].dtype, outs[0].dtype
    floating = jnp.issubdtype(dst, jnp.inexact) and (jnp.issubdtype(src, jnp.inexact) or jnp.issubdtype(src, jnp.integer))
    integral = jnp.issubdtype(src, jnp.integer) and jnp.issubdtype(dst, jnp.integer) and np.can_cast(src, dst, "safe")
    return sigs + (partial_sigs("identity", 1) if floating or integral else [])


def cumulative(ins: Avals, outs: Avals, *, axis: int, kind: str) -> list[OneDSig]:
    """cumsum / cummax / cummin / cumprod along ``axis``: other dims split; cumsum passes
    ``P(sum)``/``P(avg)``, cummax ``P(max)``, cummin ``P(min)``."""
    sigs = [OneDSig((Shard(d),), (Shard(d),)) for d in range(ins[0].ndim) if d != axis]
    return sigs + [OneDSig((Partial(op),), (Partial(op),)) for op in _PARTIALS_THROUGH_REDUCTION.get(kind, ())]


def slice_full_dims(ins: Avals, outs: Avals) -> list[OneDSig]:
    """Static or dynamic slices: dims kept whole (same extent in and out) may be split;
    extra inputs (start indices) are ``R``; partials of the operand pass."""
    x, out = ins[0], outs[0]
    rest = (R,) * (len(ins) - 1)
    sigs = [OneDSig((Shard(d),) + rest, (Shard(d),)) for d in range(x.ndim) if x.shape[d] == out.shape[d]]
    return sigs + partial_sigs("identity", len(ins))


def pad(ins: Avals, outs: Avals, *, padding_config: Sequence[Sequence[int]]) -> list[OneDSig]:
    """Padding: unpadded dims may be split (the padding value is ``R``); no partial
    passes (each rank would add the padding value)."""
    return [
        OneDSig((Shard(d), R), (Shard(d),))
        for d, config in enumerate(padding_config)
        if tuple(config) == (0, 0, 0)
    ]


def nullary(ins: Avals, outs: Avals) -> list[OneDSig]:
    """Ops creating values from nothing (iota, constants): Replicate only."""
    return []
