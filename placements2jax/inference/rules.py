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

Strided inputs (a dim with a split factor from a view, torch's ``_StridedShard``: a fixed
permutation of the dim, then a plain split): a 1-D signature without a joint condition
maps a split dim to the output position-free (each element's result depends on its own
index alone, or a reduction sums over the dim whatever its order), so the same
signature runs on strided data, the factor carried to the output dim
(:func:`strided_factors`): elementwise ops, transpose, reductions, contractions...
Signatures that use a rank's offset along the split dim (the masked lookups and
scatters of ``take`` / ``gather`` / ``scatter``, the masked slice, a ragged dot's own groups) carry the :data:`POSITIONAL` joint
condition, reshape its own (:meth:`_ReshapeCheck.view`); a new rule whose signature
reads positions must mark it so.
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
    "POSITIONAL",
    "PartialKind",
    "SCATTERS",
    "bitcast",
    "broadcast_in_dim",
    "along_axis",
    "concatenate",
    "conv",
    "convert",
    "cumulative",
    "dynamic_update_slice",
    "einsum",
    "elementwise",
    "fft",
    "gather",
    "gather_lookup_axes",
    "linalg",
    "normalization",
    "pad",
    "partial_sigs",
    "ragged_dot",
    "reduction",
    "replicated",
    "reshape",
    "reverse",
    "scatter",
    "scatter_lookup_axes",
    "scatter_windows",
    "slice_full_dims",
    "slices",
    "split",
    "stack",
    "strided_factors",
    "symmetric_product",
    "take",
    "tile",
    "transpose",
    "triangular_solve",
    "tridiagonal_solve",
    "unstack",
    "window",
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


def einsum(
    ins: Avals, outs: Avals, *, operands: Sequence[str], output: str, unsplit: str = "", linear: int | None = None
) -> list[OneDSig]:
    """Einsum-like contractions (matmul, bmm, dot_general, einsum) given one index letter
    per operand dim. Per letter: operands with it at full extent are split on it, the
    others (broadcast: size 1 or absent) are ``R``; the output is split on it if it keeps
    the letter (batch and free dims), else ``P(sum)`` (contracted dims). A letter repeated
    within one operand (a diagonal) is never split, nor one of ``unsplit``. Multilinear in
    the first ``linear`` operands (default: all): one of them ``P(op)`` with all others
    ``R`` gives ``P(op)`` for op in sum, avg."""
    sizes: dict[str, int] = {}
    for aval, letters in zip(ins, operands):
        for letter, n in zip(letters, aval.shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    sigs = []
    for letter, full in sizes.items():
        if letter in unsplit or any(letters.count(letter) > 1 for letters in (*operands, output)):
            continue
        placements = tuple(
            Shard(letters.index(letter)) if letter in letters and aval.shape[letters.index(letter)] == full else R
            for aval, letters in zip(ins, operands)
        )
        result: Placement = Shard(output.index(letter)) if letter in output else Partial("sum")
        sigs.append(OneDSig(placements, (result,)))
    for i in range(len(ins) if linear is None else linear):
        for op in LINEAR_OPS:
            sigs.append(OneDSig(tuple(Partial(op) if j == i else R for j in range(len(ins))), (Partial(op),)))
    return sigs


def ragged_dot(ins: Avals, outs: Avals, *, operands: Sequence[str], output: str, groups: str) -> list[OneDSig]:
    """``ragged_dot_general(lhs, rhs, group_sizes)`` (``lax.ragged_dot``, dropless MoE's
    expert matmuls, and its gradients) given one index letter per dim of the three
    operands and of the output, as :func:`einsum`; ``groups`` holds the lhs ragged dim's
    letter and the group dim's (``group_sizes``' last dim; the rhs group dim in the
    forward mode, the output's leading dim when the ragged dim is contracted).
    ``group_sizes`` counts the rows of each group along the ragged dim, from its start:
    a rank holding a block of the ragged dim would read its rows as belonging to other
    groups, so the ragged dim is never split. Every other letter is a dot's: a free dim
    (lhs or rhs) -> the output split alike, a batch dim split on both (and on
    ``group_sizes``' matching prefix dim, whose groups belong to it alone), a contracted
    non-ragged dim -> ``P(sum)`` (each group's rows summed over a block of it, the
    blocks' sums added). The op is linear in ``lhs`` and in ``rhs`` (rows outside every
    group give zeros, and sums or averages of zeros are zeros): one of them ``P(op)``,
    the other ``R`` -> ``P(op)``; ``group_sizes`` (integers) is never partial.

    The group dim (expert parallelism) splits only with ``group_sizes`` one-dimensional
    (whole on every rank) and the ragged dim free (the rhs holds the groups: the
    forward, the lhs's gradient) or contracted (the output holds them: the rhs's
    gradient): the tensor holding it ``S``, the others ``R`` -> ``P(sum)`` (free: each
    row is its group's alone, other ranks' rows give zeros) or the output ``S(0)``
    (contracted). A rank runs its own groups: its rows start after the earlier groups'
    (the masked ragged dot of the executors, :data:`POSITIONAL`: it reads the rank's
    offset into the groups)."""
    sigs = einsum(ins, outs, operands=operands, output=output, unsplit=groups, linear=2)
    group = groups[1]
    holders = [i for i, letters in enumerate(operands[:2]) if group in letters]
    if ins[2].ndim == 1 and (holders or group in output):
        placements = tuple(Shard(operands[i].index(group)) if i in holders else R for i in range(3))
        result: Placement = Shard(output.index(group)) if group in output else Partial("sum")
        sigs.append(OneDSig(placements, (result,), joint=POSITIONAL))
    return sigs


def reduction(ins: Avals, outs: Avals, *, axes: Sequence[int], kind: str) -> list[OneDSig]:
    """Reductions over ``axes`` (with or without kept dims: the output rank says which).

    A kept dim ``S(d)`` becomes ``S(d')`` (renumbered unless keepdims). A reduced dim
    ``S(d)`` gives a partial output: sum -> ``P(sum)``, mean -> ``P(avg)`` (only for even
    splits: the average of unequal chunks' means is not the mean), max -> ``P(max)``,
    min -> ``P(min)`` (``jnp.all``/``jnp.any`` of bools come as min/max); other kinds (prod,
    argmax, bitwise and/or of integers...) cannot split a reduced dim.
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


def custom_reduction(ins: Avals, outs: Avals, *, dimensions: Sequence[int]) -> list[OneDSig]:
    """``lax.reduce`` of ``n`` operands with their ``n`` scalar initial values under a
    computation of its own (a variadic ``reduce``: e.g. the product and sum of a linear
    recurrence's pairs at once): a kept dim split alike on every operand stays split
    (renumbered); a reduced dim cannot be split and no partial passes (the computation is
    arbitrary); the initial values are Replicate scalars."""
    count, x = len(outs), ins[0]
    kept = [d for d in range(x.ndim) if d not in dimensions]
    return [OneDSig((Shard(d),) * count + (R,) * count, (Shard(kept.index(d)),) * count) for d in kept]


def transpose(ins: Avals, outs: Avals, *, permutation: Sequence[int]) -> list[OneDSig]:
    """Output dim ``i`` is input dim ``permutation[i]``: ``S(perm[i]) -> S(i)``; partials pass."""
    sigs = [OneDSig((Shard(p),), (Shard(i),)) for i, p in enumerate(permutation)]
    return sigs + partial_sigs("identity", 1)


def reshape(ins: Avals, outs: Avals, *, dimensions: Sequence[int] | None = None) -> list[OneDSig]:
    """Reshape (and squeeze) from the shapes alone; ``dimensions`` (the jaxpr's ``reshape``
    param: the input's dims transposed into that order first, as JAX's transpose of a
    grouped conv emits) reads the input permuted so. The dims fall into groups (the fewest
    consecutive input and output dims with equal products). Within a group, a split of
    input dim ``d`` stays a split of output dim ``e`` of the same group when the splits
    of the group, read as one sequence of mesh dims over its flat extent (dim by dim,
    major first), are the same on both sides and nest into contiguous chunks: every dim
    before the last split one is split whole (one element per rank). So a split of the
    leading dim of a group passes (uneven only if it keeps its extent), and merging or
    splitting dims already split over several mesh dims (``4x8x16 S(0),S(1) -> 32x16`` on
    4 x 2, ``32x16 (dp,tp),None -> 4x8x16``) moves no data. A split of a later dim of a
    merged group alone (``8x16 S(1) -> 128``) is torch's strided shard: the joint
    condition has a :meth:`~_ReshapeCheck.view` giving it (and every other layout the
    data already has, strided inputs included) at no cost, which selection adds as a
    candidate for the given input. Partials pass."""
    shape = tuple(ins[0].shape)
    order = tuple(range(len(shape))) if dimensions is None else tuple(int(d) for d in dimensions)
    check = _ReshapeCheck(
        tuple(shape[d] for d in order), tuple(outs[0].shape), None if dimensions is None else order
    )
    sigs = [
        OneDSig((Shard(order[d]),), (Shard(e),), joint=check)
        for group_in, group_out in check.groups
        for d in group_in
        for e in group_out
    ]
    return sigs + partial_sigs("identity", 1)


class _ReshapeCheck:
    """The joint condition of :func:`reshape` on an N-D candidate's tables (see there):
    ``a`` the input's shape as reshaped (its dims in ``order``: None, as they come)."""

    def __init__(self, a: tuple[int, ...], b: tuple[int, ...], order: tuple[int, ...] | None = None) -> None:
        self.a, self.b, self.order = a, b, order
        self.groups = _reshape_groups(a, b)

    def __eq__(self, other: object) -> bool:  # the same shapes, the same condition (a cache key)
        return isinstance(other, _ReshapeCheck) and (self.a, self.b, self.order) == (other.a, other.b, other.order)

    def __hash__(self) -> int:
        return hash((self.a, self.b, self.order))

    def __repr__(self) -> str:  # by value, as it compares (the default's address made reports differ run to run)
        order = "" if self.order is None else f", {self.order}"
        return f"_ReshapeCheck({self.a}, {self.b}{order})"

    def _ordered(self, per_dim: Sequence[Any]) -> Sequence[Any]:
        """The input's per-dim entries in the order it is reshaped in."""
        return per_dim if self.order is None else [per_dim[d] for d in self.order]

    def view(
        self, dim_axes: Sequence[tuple[int, ...]], split: Sequence[int], mesh_shape: tuple[int, ...]
    ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]] | None:
        """The output's ``(dim_axes, split_factors)`` holding on every rank exactly the
        elements the input (``dim_axes``, ``split`` factors) holds, or None when there is
        none (the data must move). Per group, the input's splits read as digits of its flat
        extent, major first (an unsplit extent, or a mesh dim's coordinate; a strided dim is
        ``f`` unsplit groups, its mesh dim, the chunk); cut at the output dims' extents
        (an unsplit digit may be cut, a mesh dim's may not), each output dim's digits must
        be a layout's: unsplit, mesh dims then one unsplit chunk (a plain split, major
        first), or one unsplit extent ``f``, one mesh dim and a chunk (split factor ``f``).
        Even splits only."""
        a, b = self.a, self.b
        dim_axes, split = self._ordered(dim_axes), self._ordered(split)
        if math.prod(a) == 0 or any(n == 1 and dim_axes[d] for d, n in enumerate(a)):
            return None
        out_axes: list[tuple[int, ...]] = [()] * len(b)
        out_split = [1] * len(b)
        for group_in, group_out in self.groups:
            digits: list[tuple[int, int | None]] = []
            for d in group_in:
                axes, f = dim_axes[d], split[d]
                pieces = math.prod(mesh_shape[m] for m in axes)
                if a[d] % (f * pieces):
                    return None
                digits += [(f, None)] + [(mesh_shape[m], m) for m in axes] + [(a[d] // (f * pieces), None)]
            for position, e in enumerate(group_out):
                need, mine = b[e], []
                while digits and (need > 1 or digits[0][0] == 1):
                    size, m = digits[0]
                    if need % size == 0:
                        mine.append(digits.pop(0))
                        need //= size
                    elif m is None and size % need == 0:
                        mine.append((need, None))
                        digits[0] = (size // need, None)
                        need = 1
                    else:
                        return None
                if position == len(group_out) - 1:
                    mine += digits
                dim = _view_dim(mine)
                if dim is None:
                    return None
                out_axes[e], out_split[e] = dim
        return tuple(out_axes), tuple(out_split)

    def __call__(self, tables: Sequence[Any], mesh_shape: tuple[int, ...]) -> bool:
        (in_axes, _), (out_axes, _) = tables[0], tables[1]
        in_axes = self._ordered(in_axes)
        for group_in, group_out in self.groups:
            in_seq = [m for d in group_in for m in in_axes[d]]
            if in_seq != [m for e in group_out for m in out_axes[e]]:
                return False
            if not in_seq:
                continue
            same = len(group_in) == len(group_out) == 1 and self.a[group_in[0]] == self.b[group_out[0]]
            for shape, axes, group in ((self.a, in_axes, group_in), (self.b, out_axes, group_out)):
                if not _nests(shape, axes, group, mesh_shape, even=not same):
                    return False
        return True


def _view_dim(digits: Sequence[tuple[int, int | None]]) -> tuple[tuple[int, ...], int] | None:
    """One dim's ``(mesh dims, split factor)`` from its digits (see :meth:`_ReshapeCheck.view`)."""
    digits = [(size, m) for size, m in digits if m is not None or size > 1]
    split = [i for i, (_, m) in enumerate(digits) if m is not None]
    if not split:
        return (), 1
    first, last = split[0], split[-1]
    if last - first + 1 != len(split):
        return None  # an unsplit digit between mesh dims
    factor = math.prod(size for size, _ in digits[:first])
    if factor > 1 and len(split) > 1:
        return None  # a strided shard over several mesh dims: no layout holds it
    return tuple(digits[i][1] for i in split), factor  # type: ignore[misc]


def _reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The non-1 dims of ``a`` and ``b`` in groups of equal products (empty for empty shapes)."""
    if math.prod(a) == 0:
        return []
    groups, i, j = [], 0, 0
    big_a = [d for d in range(len(a)) if a[d] > 1]
    big_b = [e for e in range(len(b)) if b[e] > 1]
    while i < len(big_a) and j < len(big_b):
        group_a, group_b = [big_a[i]], [big_b[j]]
        pa, pb = a[big_a[i]], b[big_b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                group_a.append(big_a[i])
                pa *= a[big_a[i]]
                i += 1
            else:
                group_b.append(big_b[j])
                pb *= b[big_b[j]]
                j += 1
        groups.append((tuple(group_a), tuple(group_b)))
    return groups


def _nests(shape: tuple[int, ...], axes: Sequence[tuple[int, ...]], group: tuple[int, ...],
           mesh_shape: tuple[int, ...], *, even: bool) -> bool:
    """The group's splits chunk its flat extent contiguously: every dim before the last
    split one is split whole; with ``even``, the last one's split divides it."""
    split = [d for d in group if axes[d]]
    last = split[-1]
    for d in group[: group.index(last)]:
        if math.prod(mesh_shape[m] for m in axes[d]) != shape[d]:
            return False
    return not even or shape[last] % math.prod(mesh_shape[m] for m in axes[last]) == 0


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
        sigs.append(OneDSig((Shard(j), R), (result,), joint=POSITIONAL if j == axis else None))
    return sigs + partial_sigs("identity", 2)


def gather(ins: Avals, outs: Avals, *, dimension_numbers: Any, slice_sizes: Sequence[int]) -> list[OneDSig]:
    """XLA's ``gather`` (``table[ids]``, ``jnp.take``, ``take_along_axis``...). Operand dims
    are indexed (``start_index_map``), batching (paired with an indices dim) or window
    dims; the indices' dims but the last (the index vector) are batch dims.

    * an indices batch dim ``S(i)`` -> its output dim; the operand ``S(b)`` if ``i`` is
      paired with operand batching dim ``b``, else ``R``;
    * an operand window dim taken whole, ``S(j)`` (indices ``R``) -> its output offset
      dim (if ``j`` is indexed, its start clamps to 0 or falls out of bounds alike on
      the whole dim and on a block);
    * a looked-up dim ``S(axis)`` of a row or point lookup (:func:`gather_lookup_axes`),
      indices ``R`` -> ``P(sum)``: the masked local lookup (rows another rank owns give
      zeros; a point ``x[rows, cols]`` on a table split on both dims is the rank's own
      where it owns both coordinates);
    * operand ``P(op)``, indices ``R`` -> ``P(op)`` (a gather moves data).
    """
    operand, indices, out = ins[0], ins[1], outs[0]
    dn = dimension_numbers
    operand_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    indices_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    batch_out = [j for j in range(out.ndim) if j not in dn.offset_dims]
    paired = dict(zip(indices_batching, operand_batching))
    sigs = []
    for i in range(indices.ndim - 1):
        operand_placement = Shard(paired[i]) if i in paired else R
        sigs.append(OneDSig((operand_placement, Shard(i)), (Shard(batch_out[i]),)))
    window = [j for j in range(operand.ndim) if j not in dn.collapsed_slice_dims and j not in operand_batching]
    offset_out = dict(zip(window, dn.offset_dims))
    for j in window:
        if slice_sizes[j] == operand.shape[j]:
            sigs.append(OneDSig((Shard(j), R), (Shard(offset_out[j]),)))
    for axis in gather_lookup_axes(dn, slice_sizes, operand.shape):
        sigs.append(OneDSig((Shard(axis), R), (Partial("sum"),), joint=POSITIONAL))
    return sigs + partial_sigs("identity", 2)


def gather_lookup_axes(dimension_numbers: Any, slice_sizes: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """The table axes a gather looks rows or points up along (:func:`_looked_up_axes`).
    Batching dims (``take_along_axis``: ``operand_batching_dims`` paired with indices
    dims) are not indexed: each rank's block pairs its batch rows with the indices' alike
    (the batching signature splits both, or neither), so the masked lookup runs on them."""
    return _looked_up_axes(dimension_numbers.start_index_map, slice_sizes, shape)


def scatter_windows(dimension_numbers: Any, shape: Sequence[int], updates_shape: Sequence[int]) -> list[int]:
    """The extent of a scatter's window on each operand dim: 1 if inserted (or a
    batching dim), else the extent of its update window dim (a gather's ``slice_sizes``)."""
    dn = dimension_numbers
    excluded = (*dn.inserted_window_dims, *getattr(dn, "operand_batching_dims", ()))
    windows = [1] * len(shape)
    for j, u in zip([j for j in range(len(shape)) if j not in excluded], dn.update_window_dims):
        windows[j] = updates_shape[u]
    return windows


def scatter_lookup_axes(dimension_numbers: Any, shape: Sequence[int], updates_shape: Sequence[int]) -> tuple[int, ...]:
    """The table axes a scatter writes rows or points along (:func:`_looked_up_axes`;
    none with batching dims)."""
    dn = dimension_numbers
    if getattr(dn, "operand_batching_dims", ()):
        return ()
    return _looked_up_axes(dn.scatter_dims_to_operand_dims, scatter_windows(dn, shape, updates_shape), shape)


def _looked_up_axes(index_map: Sequence[int], windows: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """The looked-up axes of a row or point lookup (or its scatter) without batching
    dims, where every indexed axis is one row or taken whole (a whole one's start clamps
    to 0 or falls out of bounds, on a block as on the whole axis): the one axis of more
    than one row looked up one row at a time (else the first one-row axis); in a point
    lookup (every axis indexed, one row each) every axis of more than one row, each of
    which may be split (a rank owns the points whose coordinates all fall in its blocks).
    The forms JAX emits: ``table[ids]`` (one indexed axis, collapsed), a vmapped
    ``table[i]`` (``eqx.nn.Embedding``: ``start_index_map=(0, 1)``, slice ``(1, dim)``,
    nothing collapsed) and a point ``x[rows, cols]`` / ``x.at[rows, cols].set(v)`` (a
    repetition penalty on logits split over batch and vocabulary).

    Rows of several indexed axes with whole window dims (CLIP's ``x[arange(B),
    argmax(tokens)]``, ``(B, T, D)`` rows at two coordinates) are not masked: the
    candidates are as exact there, but they lead the program search into a dearer basin
    on tests/models/clip.py's step (45,938 -> 47,826 B, 16 -> 23 collectives; measured)."""
    one_row = [a for a in index_map if windows[a] == 1]
    if any(windows[d] != shape[d] for d in index_map if d not in one_row):
        return ()
    several = tuple(a for a in one_row if shape[a] > 1)
    if len(several) > 1:
        return several if len(set(index_map)) == len(shape) else ()
    return several or tuple(one_row[:1])


# the scatter primitives (jaxpr names) the scatter rule serves
SCATTERS = ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max")
_SCATTER_PARTIALS: dict[str, tuple[ReduceOp, ...]] = {
    "scatter-add": LINEAR_OPS, "scatter-sub": LINEAR_OPS, "scatter-max": ("max",), "scatter-min": ("min",),
}


def scatter(ins: Avals, outs: Avals, *, dimension_numbers: Any, kind: str) -> list[OneDSig]:
    """XLA's ``scatter`` family (operand, indices, updates -> operand-shaped result), e.g.
    ``scatter-add``, the transpose of a gather (gradients of embeddings and of
    ``take_along_axis``). Update dims are window dims (``update_window_dims``, matching
    the operand's window dims in order) or scatter dims (matching the indices' batch dims).

    * an operand window dim whose update extent is the operand's: operand and updates
      split on it, indices ``R`` (an indexed one's start clamps to 0 or drops the update,
      on a block as on the whole dim);
    * a batching pair: operand ``S(b)``, indices ``S(i)``, updates on the scatter dim of
      ``i`` -> ``S(b)``;
    * scatter-add / -sub only (linear in operand and updates): an unpaired indices batch dim
      ``S(i)`` with updates split alike and operand ``P(sum)`` -> ``P(sum)``: each rank
      adds its own updates (data-parallel embedding gradients);
    * partial operand and updates, indices ``R``: ``P(sum/avg)`` through scatter-add,
      ``P(max)`` / ``P(min)`` through scatter-max / scatter-min;
    * every kind, into a looked-up dim ``S(axis)`` of a row or point scatter
      (:func:`scatter_lookup_axes`; an embedding table split on its vocabulary, logits
      split on batch and vocabulary under ``.at[rows, ids].set``), indices and updates
      ``R`` -> ``S(axis)``: the masked local scatter (each rank applies the updates whose
      index falls in its blocks, at the index minus its offsets, and drops the others, so
      other ranks' rows are untouched whatever the combiner; for scatter-add the
      transpose of gather's masked lookup).
    """
    operand, indices, updates = ins[0], ins[1], ins[2]
    kind = kind.replace("_", "-")  # jaxprs spell scatter-add, scatter-max...
    dn = dimension_numbers
    operand_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    indices_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    scatter_update_dims = [u for u in range(updates.ndim) if u not in dn.update_window_dims]
    window = [j for j in range(operand.ndim) if j not in dn.inserted_window_dims and j not in operand_batching]
    sigs = []
    for j, u in zip(window, dn.update_window_dims):
        if updates.shape[u] == operand.shape[j]:
            sigs.append(OneDSig((Shard(j), R, Shard(u)), (Shard(j),)))
    paired = dict(zip(indices_batching, operand_batching))
    for i, u in zip(range(indices.ndim - 1), scatter_update_dims):
        if i in paired:
            sigs.append(OneDSig((Shard(paired[i]), Shard(i), Shard(u)), (Shard(paired[i]),)))
        elif kind in ("scatter-add", "scatter-sub"):
            sigs.append(OneDSig((Partial("sum"), Shard(i), Shard(u)), (Partial("sum"),)))
    for op in _SCATTER_PARTIALS.get(kind, ()):
        sigs.append(OneDSig((Partial(op), R, Partial(op)), (Partial(op),)))
    for axis in scatter_lookup_axes(dn, operand.shape, updates.shape):
        sigs.append(OneDSig((Shard(axis), R, R), (Shard(axis),), joint=POSITIONAL))
    return sigs


def dynamic_update_slice(ins: Avals, outs: Avals) -> list[OneDSig]:
    """``dynamic_update_slice(operand, update, *starts)``: dims the update covers whole
    may be split on both (starts ``R``); a dim it covers in part may be split on the
    operand, the update whole there: the masked update (each rank writes the window's
    rows its block holds, at their index minus its offset, POSITIONAL; a KV cache split
    over its sequence written at a decoding step's position, where the cache was moved to
    another split before). Every position comes from exactly one of operand and update,
    so any partial of both passes."""
    operand, update = ins[0], ins[1]
    starts = (R,) * (len(ins) - 2)
    sigs = [
        OneDSig((Shard(d), Shard(d)) + starts, (Shard(d),))
        if update.shape[d] == operand.shape[d]
        else OneDSig((Shard(d), R) + starts, (Shard(d),), joint=POSITIONAL)
        for d in range(operand.ndim)
    ]
    return sigs + [OneDSig((Partial(op), Partial(op)) + starts, (Partial(op),)) for op in REDUCE_OPS]


def stack(ins: Avals, outs: Avals, *, axis: int) -> list[OneDSig]:
    """Stacking equal-shaped inputs along a new output dim ``axis``: every input ``S(d)``
    -> ``S(d)`` (``S(d+1)`` past ``axis``); all inputs ``P(op)`` -> ``P(op)``."""
    n = len(ins)
    sigs = [OneDSig((Shard(d),) * n, (Shard(d if d < axis else d + 1),)) for d in range(ins[0].ndim)]
    return sigs + [OneDSig((Partial(op),) * n, (Partial(op),)) for op in REDUCE_OPS]


def unstack(ins: Avals, outs: Avals, *, axis: int) -> list[OneDSig]:
    """The inverse of :func:`stack`: input ``S(d)`` (``d != axis``) -> every output
    ``S(d)`` (``S(d-1)`` past ``axis``); partials pass to every output."""
    n = len(outs)
    sigs = [OneDSig((Shard(d),), (Shard(d if d < axis else d - 1),) * n) for d in range(ins[0].ndim) if d != axis]
    return sigs + partial_sigs("identity", 1, n)


def along_axis(ins: Avals, outs: Avals, *, axis: int) -> list[OneDSig]:
    """Ops that mix values along one dim and keep the others (sort with its co-sorted
    operands, top_k, cumulative ops without a partial kind): every other dim may be split,
    on all inputs and outputs alike; no partial passes."""
    return [
        OneDSig((Shard(d),) * len(ins), (Shard(d),) * len(outs)) for d in range(ins[0].ndim) if d != axis
    ]


def reverse(ins: Avals, outs: Avals, *, dimensions: Sequence[int]) -> list[OneDSig]:
    """``rev``: dims not reversed may be split; partials pass (data movement)."""
    sigs = [OneDSig((Shard(d),), (Shard(d),)) for d in range(ins[0].ndim) if d not in dimensions]
    return sigs + partial_sigs("identity", 1)


def tile(ins: Avals, outs: Avals, *, reps: Sequence[int]) -> list[OneDSig]:
    """``tile`` (``jnp.tile``): dims copied once may be split; a dim copied several times is
    not (a rank's tiled chunk is no chunk of the tiled dim); partials pass (data movement)."""
    sigs = [OneDSig((Shard(d),), (Shard(d),)) for d in range(ins[0].ndim) if reps[d] == 1]
    return sigs + partial_sigs("identity", 1)


def conv(
    ins: Avals, outs: Avals, *, dimension_numbers: Any, feature_group_count: int, batch_group_count: int
) -> list[OneDSig]:
    """``conv_general_dilated``: the lhs batch dim -> the output batch dim (kernel ``R``;
    not under ``batch_group_count``, which groups it); one operand ``P(sum/avg)``, the
    other ``R`` -> the same partial (bilinear). Ungrouped: the kernel's output-feature dim
    -> the output feature dim (lhs ``R``); lhs input features with the kernel's input
    features -> ``P(sum)`` (a contraction). Depthwise (``feature_group_count`` = the lhs
    features: one input feature per group, Mamba's and ConvNeXt's convolutions): the lhs
    feature dim with the kernel's output-feature dim -> the output feature dim, even
    splits only (a rank then holds whole groups, and runs them as its own
    ``feature_group_count``: the executors' local params). Grouped by ``batch_group_count``
    (a depthwise kernel's gradient, JAX's transpose of the above): lhs input features with
    the kernel's input features -> ``P(sum)``; where each group is one lhs batch element,
    the lhs batch dim with the kernel's output-feature dim -> the output feature dim, even
    splits only, as above. Other groupings split no feature dim (a group would straddle
    ranks)."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    sigs = [OneDSig((Partial(op), R), (Partial(op),)) for op in LINEAR_OPS]
    sigs += [OneDSig((R, Partial(op)), (Partial(op),)) for op in LINEAR_OPS]
    if batch_group_count == 1:
        sigs.append(OneDSig((Shard(lhs_spec[0]), R), (Shard(out_spec[0]),)))
    if feature_group_count == 1 and batch_group_count == 1:
        return sigs + [
            OneDSig((R, Shard(rhs_spec[0])), (Shard(out_spec[1]),)),
            OneDSig((Shard(lhs_spec[1]), Shard(rhs_spec[1])), (Partial("sum"),)),
        ]
    if batch_group_count == 1 and ins[0].shape[lhs_spec[1]] == feature_group_count:
        even = frozenset({(0, lhs_spec[1]), (1, rhs_spec[0]), (2, out_spec[1])})
        sigs.append(OneDSig((Shard(lhs_spec[1]), Shard(rhs_spec[0])), (Shard(out_spec[1]),), even=even))
    if feature_group_count == 1 and batch_group_count != 1:
        sigs.append(OneDSig((Shard(lhs_spec[1]), Shard(rhs_spec[1])), (Partial("sum"),)))
        if ins[0].shape[lhs_spec[0]] == batch_group_count:
            even = frozenset({(0, lhs_spec[0]), (1, rhs_spec[0]), (2, out_spec[1])})
            sigs.append(OneDSig((Shard(lhs_spec[0]), Shard(rhs_spec[0])), (Shard(out_spec[1]),), even=even))
    return sigs


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


def bitcast(ins: Avals, outs: Avals) -> list[OneDSig]:
    """bitcast_convert_type: each element's bits read as another dtype. Of the same width,
    elementwise; to a narrower dtype it adds a trailing dim (``f32[8, 32] -> u8[8, 32, 4]``),
    to a wider one it takes the trailing dim away: the dims before it split as they are, the
    trailing dim never (it is one element's bytes). No partial passes (bits are not linear)."""
    return [OneDSig((Shard(d),), (Shard(d),)) for d in range(min(ins[0].ndim, outs[0].ndim))]


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


def slices(ins: Avals, outs: Avals) -> list[OneDSig]:
    """A static or dynamic slice (``x[:, -1]``, ``x[0, :4]``, ``lax.dynamic_slice_in_dim(x,
    i, 1, axis=1)``): :func:`slice_full_dims`, and a dim sliced to at most half its extent
    ``S(d)`` -> ``P(sum)`` (start indices ``R``): the masked slice (each rank keeps the
    rows of the window its block holds, zeros for the others), whose reduction sends
    2 (n - 1) / n of the small result where gathering the operand sends (n - 1) / n of
    the operand (the last token's hidden state of a sequence-split activation, a corner of
    a split matrix, a position read from a sequence-split cache: the operand gathered
    whole before)."""
    x, out = ins[0], outs[0]
    starts = (R,) * (len(ins) - 1)
    masked = [
        OneDSig((Shard(d),) + starts, (Partial("sum"),), joint=POSITIONAL)
        for d in range(x.ndim)
        if out.shape[d] <= x.shape[d] // 2
    ]
    return slice_full_dims(ins, outs) + masked


def pad(ins: Avals, outs: Avals, *, padding_config: Sequence[Sequence[int]]) -> list[OneDSig]:
    """Padding: unpadded dims may be split (the padding value is ``R``). Padding is
    linear in (operand, padding value) jointly: both ``P(sum)`` (``P(avg)``) ->
    ``P(sum)`` (``P(avg)``), the padding value's partial made for free (``R -> P``)."""
    sigs = [
        OneDSig((Shard(d), R), (Shard(d),))
        for d, config in enumerate(padding_config)
        if tuple(config) == (0, 0, 0)
    ]
    return sigs + [OneDSig((Partial(op), Partial(op)), (Partial(op),)) for op in LINEAR_OPS]


def window(
    ins: Avals,
    outs: Avals,
    *,
    window_dimensions: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[Sequence[int]],
    base_dilation: Sequence[int] | None = None,
    partials: Sequence[ReduceOp] = (),
) -> list[OneDSig]:
    """Windowed ops: ``reduce_window_sum / _max / _min`` and the generic ``reduce_window``
    (pooling: ``nn.max_pool``, ``nn.avg_pool``), max-pooling's derivatives
    ``select_and_scatter_add(source, operand)`` (its gradient) and
    ``select_and_gather_add(tangents, operand)`` (its JVP). A dim whose window is one
    element, stride 1, unpadded and not base-dilated (a window dilation of a one-element
    window is moot) maps each element to the same position of every array: it splits on
    every array input and output alike; scalar inputs (the generic op's init values) are
    ``R``. Every other dim is ``R``: a split one would need its neighbours' rows (a halo
    exchange, which no signature here makes). ``partials``: the ops the first input's
    partial may be, the others ``R`` (``reduce_window_sum`` and the two derivatives are
    linear in it: sum, avg; ``reduce_window_max`` / ``_min`` pass ``P(max)`` /
    ``P(min)``: a max of the ranks' window maxima is the window's max)."""
    sigs = []
    for d, (size, stride, pads) in enumerate(zip(window_dimensions, window_strides, padding)):
        if size == 1 and stride == 1 and tuple(pads) == (0, 0) and (base_dilation is None or base_dilation[d] == 1):
            sigs.append(OneDSig(tuple(Shard(d) if a.ndim else R for a in ins), (Shard(d),) * len(outs)))
    rest = (R,) * (len(ins) - 1)
    return sigs + [OneDSig((Partial(op),) + rest, (Partial(op),) * len(outs)) for op in partials]


def fft(ins: Avals, outs: Avals, *, fft_lengths: Sequence[int]) -> list[OneDSig]:
    """``fft`` (``jnp.fft.fft / ifft / rfft / irfft`` and their n-d forms): the transformed
    dims (the last ``len(fft_lengths)``) are ``R`` (each output element reads all of
    them); the leading dims are a batch, split freely. Every FFT type is linear over the
    reals (``rfft``: real to complex; ``irfft``: complex to real, also where it drops the
    imaginary part of the DC and Nyquist terms), so ``P(sum)`` / ``P(avg)`` pass, the
    output's partial of its own dtype."""
    batch = ins[0].ndim - len(fft_lengths)
    return [OneDSig((Shard(d),), (Shard(d),)) for d in range(batch)] + partial_sigs("linear", 1)


def linalg(ins: Avals, outs: Avals, *, core_dims: int = 2) -> list[OneDSig]:
    """Batched decompositions (``cholesky``, ``eigh``, ``svd``, ``qr``,
    ``householder_product``, ``lu``, ``lu_pivots_to_permutation``, and the CPU-only
    ``eig``, ``schur``, ``hessenberg``, ``tridiagonal``, ``ormqr``): the first input's
    last ``core_dims`` dims (the matrix; the pivots' one dim) are ``R``; a leading batch
    dim with the same extent on every input and output (eigenvalues, singular values,
    pivots and permutations keep the batch) splits on all of them alike, each rank
    decomposing its own matrices. No partial passes (none is linear). ``cholesky_update``
    (a rank-1 update of an ``(n, n)`` factor by an ``(n,)`` vector) has no batch dims:
    Replicate only (its Givens rotations read, at step ``k``, ``r[k, k]`` and ``w[k]``
    wherever the other elements of row ``k`` are, so no split runs per rank)."""
    batch = ins[0].ndim - core_dims
    arrays = (*ins, *outs)
    return [
        OneDSig((Shard(d),) * len(ins), (Shard(d),) * len(outs))
        for d in range(batch)
        if all(a.ndim > d and a.shape[d] == ins[0].shape[d] for a in arrays)
    ]


def symmetric_product(ins: Avals, outs: Avals) -> list[OneDSig]:
    """``symmetric_product(a, c)`` (``lax.linalg.symmetric_product``): ``alpha a a^T +
    beta c`` of ``a`` ``(..., m, n)`` and ``c`` ``(..., m, m)``. Batch dims split on
    ``a``, ``c`` and the output alike; the ``n`` dim contracted (``a``'s last) splits with
    ``c`` ``P(sum)`` -> ``P(sum)`` (every rank adds ``alpha a_i a_i^T + beta c_i``, whose sum
    is the product: ``c`` ``R`` becomes ``P(sum)`` for free). ``m`` never splits (``a``'s
    rows are both sides of the product), nor does a partial ``a`` pass (the product is
    quadratic in it). CPU XLA lowers it as a batched matmul and an add, not a solver call,
    and partitions it so (a split ``n``: the output all-reduced)."""
    a = ins[0]
    batch = [OneDSig((Shard(d), Shard(d)), (Shard(d),)) for d in range(a.ndim - 2)]
    return [*batch, OneDSig((Shard(a.ndim - 1), Partial("sum")), (Partial("sum"),))]


def triangular_solve(ins: Avals, outs: Avals) -> list[OneDSig]:
    """``triangular_solve(a, b)`` (``solve_triangular``, ``jnp.linalg.solve``'s LU
    substitutions, Cholesky's gradient): batch dims as :func:`linalg`; the solution is
    linear in ``b``: ``a`` ``R``, ``b`` ``P(sum)`` / ``P(avg)`` -> the same partial.
    ``b``'s right-hand sides (its columns, ``left_side``: ``op(a) x = b``; its rows,
    ``x op(a) = b``) are independent solves, yet no signature splits them: XLA
    partitions the solver (a custom call, ``lapack_strsm_ffi`` on CPU, marked
    ``num_batch_dims``) over its batch dims only and gathers split right-hand sides
    first (jax 0.10.2's HLO on dp=2 x tp=4, ``b`` ``(8, 8, 8)`` ``R,S(2)``: an all-gather
    over tp, 1,536 B, the solution ``R,R``), as :data:`BATCH_PARTITIONED` says."""
    return linalg(ins, outs) + [OneDSig((R, Partial(op)), (Partial(op),)) for op in LINEAR_OPS]


# primitives XLA compiles to a solver's custom call (LAPACK on CPU: ``lapack_spotrf_ffi``, ``_ssyevd``, ``_sgesdd``,
# ``_sgeqrf`` / ``_sorgqr``, ``_sgetrf``, ``_strsm``, ``_sgtsv``, ``_sgeev``, ``_sgees``, ``_sgehrd``, ``_ssytrd``,
# ``_sormqr``, marked ``num_batch_dims``; the pivots' permutation a loop) whose partitioner keeps the splits the operands' batch dims have and gathers every other split first,
# splitting no dim that no operand splits (jax 0.10.2's HLO on dp=2 x tp=4: ``tridiagonal_solve`` of ``b`` R,S(2)
# all-gathers b over tp, 2,304 B, and solves every system on every device, where an all-to-all to the batch dim would
# cost 288 B; ``cholesky`` / ``eigh`` / ``svd`` / ``qr`` / ``lu`` of an (8, 8, 8) matrix R,S(1) all-gather it, 1,536 B,
# where the search chose an all-to-all to a batch split and gathered the outputs back: 1,984-4,000 B as check priced
# it). The walker offers such an equation only the candidates whose input layouts split a dim over a mesh dim where
# an operand already does (and are partial where one is): XLA's choice. (``jnp.linalg.cholesky`` / ``eigh`` first
# symmetrize the matrix, ``(a + a.mT) / 2``, outside the solver: with only a matrix dim split, over one mesh dim, XLA
# all-to-alls the transpose and gathers the sum, as the prediction does since no candidate splits over a mesh dim no
# input uses, ``jaxpr._idle_mesh_dims``; with both matrix dims split, the search still moves a split to the batch dim
# in that sum, where XLA gathers both operands.)
BATCH_PARTITIONED = (
    "cholesky", "eigh", "svd", "qr", "householder_product", "lu", "lu_pivots_to_permutation", "triangular_solve",
    "tridiagonal_solve", "eig", "schur", "hessenberg", "tridiagonal", "ormqr",
)


def tridiagonal_solve(ins: Avals, outs: Avals) -> list[OneDSig]:
    """``tridiagonal_solve(dl, d, du, b)`` (``lax.linalg.tridiagonal_solve``: splines,
    implicit solvers, and its own gradient): the three diagonals ``(..., m)``, ``b`` and
    the solution ``(..., m, n)``. Batch dims as :func:`linalg` (each rank solves its own
    systems); the solved dim ``m`` is ``R`` (the Thomas recurrence runs along it); the
    solution is linear in ``b``: the diagonals ``R``, ``b`` ``P(sum)`` / ``P(avg)`` -> the
    same partial. ``b``'s ``n`` right-hand sides are independent solves, yet no signature
    splits them: XLA partitions the solver (a custom call, ``lapack_sgtsv_ffi`` on CPU,
    marked ``num_batch_dims``) over its batch dims only and gathers split columns first
    (jax 0.10.2's HLO on dp=2 x tp=4: an all-gather of ``b`` over the columns' mesh axes,
    the solution Replicate there), so every execute mode gathers them as XLA does."""
    b = ins[3]
    batch = [OneDSig((Shard(d),) * 4, (Shard(d),)) for d in range(b.ndim - 2)
             if all(a.shape[d] == b.shape[d] for a in (*ins, *outs))]
    return [*batch, *(OneDSig((R, R, R, Partial(op)), (Partial(op),)) for op in LINEAR_OPS)]


def replicated(ins: Avals, outs: Avals) -> list[OneDSig]:
    """Replicate only: ops creating values from nothing (iota, constants), and ops whose
    values no split or partial of theirs gives (``random_gamma`` splits its key once per
    element of the whole shape, so a rank drawing for its block alone draws other values)."""
    return []


class _Positional:
    """The joint condition of a 1-D signature using a rank's offset along a split dim (a
    masked lookup or scatter): always met, but such a signature never runs on strided
    data (:func:`strided_factors`)."""

    def __call__(self, tables: Sequence[Any], mesh_shape: tuple[int, ...]) -> bool:
        return True

    def __repr__(self) -> str:
        return "POSITIONAL"


POSITIONAL = _Positional()


def strided_factors(
    combo: Sequence[OneDSig],
    given: Sequence[tuple[Sequence[tuple[int, ...]], Sequence[int]]],
    dim_axes: Sequence[Sequence[tuple[int, ...]]],
    shapes: Sequence[tuple[int, ...]],
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[int, ...], ...] | None:
    """The split factors (per tensor, inputs then outputs) running the N-D candidate of
    1-D signatures ``combo`` (one per mesh dim; ``dim_axes``: per tensor its candidate
    layout's) on strided inputs in place: per mesh dim, the factor of the inputs given
    (``given``: per input its ``(dim_axes, split_factors)``) split there alone with a
    factor on the dim the signature splits; every tensor the signature splits on that
    mesh dim gets it (the same permutation of the dim on every input and output, see the
    module docstring). None when no such factor applies, or the candidate cannot carry it
    (inputs with different factors, a signature with a joint condition, a dim split by
    several mesh dims or not in whole groups)."""
    split = [[1] * len(shape) for shape in shapes]
    carried = False
    for m, sig in enumerate(combo):
        factors = {
            given[i][1][p.dim]
            for i, p in enumerate(sig.inputs)
            if isinstance(p, Shard) and tuple(given[i][0][p.dim]) == (m,) and given[i][1][p.dim] > 1
        }
        if not factors:
            continue
        if len(factors) > 1 or sig.joint is not None:
            return None
        f = factors.pop()
        for t, p in enumerate(sig.placements):
            if isinstance(p, Shard):
                if tuple(dim_axes[t][p.dim]) != (m,) or shapes[t][p.dim] % (f * mesh_shape[m]):
                    return None
                split[t][p.dim] = f
        carried = True
    return tuple(map(tuple, split)) if carried else None
