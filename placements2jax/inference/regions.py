"""What a ``shard_map`` region's body sends itself (pure).

The prediction takes a region's ``in_specs`` / ``out_specs`` as fixed layouts: the search
chooses nothing inside it. What its per-device code sends (``psum``, ``all_gather``,
``psum_scatter``, ``all_to_all``, ``ppermute``, ``pmax`` / ``pmin``, and their transposes
in a gradient's region) is still the program's communication, which XLA compiles where it
inlines the region (collectives whose ``op_name`` is inside ``shard_map``). It is read here
off the body's jaxpr, one collective per operand, as jax 0.10.2's CPU client compiles it
(measured): ``psum`` / ``pmax`` / ``pmin`` an all-reduce of the per-device block,
``all_gather`` an all-gather, ``psum_scatter`` a reduce-scatter (CPU XLA compiles the one
the code writes, though its partitioner forms none), ``all_to_all`` an all-to-all and
``ppermute`` a collective-permute, each ``bfloat16`` one in ``float32`` on CPU as every
collective there (:meth:`.combine.CombinerRules.widening`). A collective over groups of
one device (a size-1 mesh axis) is compiled too, sending nothing (where a redistribution's
step over one device compiles to nothing).

A region manual over some mesh axes alone (``axis_names=``) leaves the others to XLA,
which splits its body's values over them too: the walker (:mod:`.jaxpr`) walks its body
there and gives each collective's per-device result bytes and the moves XLA makes of an
equation's operands there, each a collective sent before it.

Each collective records the region's collectives its operand depends on, so that XLA's
combiner is modelled on them with the program's (:func:`.combine.planned_collectives`:
two independent ``psum`` over one axis are one all-reduce), and the computation it runs
in: the region's own, inlined into the program's, or a loop's or branch's body inside the
region, a computation of its own (its collectives combine only there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
from jax.extend import core

from ..caches import cached
from ..errors import ArgumentTypeError, InferenceError
from .cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER, result_nbytes
from .ops import CALL_JAXPR_PARAMS

__all__ = ["Region", "RegionCollective", "RegionMove", "named_axes", "region_collectives"]

# primitive -> (the collective XLA compiles, its reduction)
_COLLECTIVES: dict[str, tuple[str, str | None]] = {
    "psum": (ALL_REDUCE, "sum"),
    "psum_invariant": (ALL_REDUCE, "sum"),
    "unreduced_psum": (ALL_REDUCE, "sum"),
    "pmax": (ALL_REDUCE, "max"),
    "pmin": (ALL_REDUCE, "min"),
    "all_gather": (ALL_GATHER, None),
    "all_gather_invariant": (ALL_GATHER, None),
    "reduce_scatter": (REDUCE_SCATTER, "sum"),
    "unreduced_reduce_scatter": (REDUCE_SCATTER, "sum"),
    "all_to_all": (ALL_TO_ALL, None),
    "ppermute": (COLLECTIVE_PERMUTE, None),
}


class RegionCollective(NamedTuple):
    """One collective a region's body sends: its kind as XLA compiles it, the mesh axes of
    its device groups (in mesh order), its reduction, the element type the code sends, the
    bytes of its per-device result, its group size, the region's collectives it depends on
    (a bit set of their indices in :func:`region_collectives`' result), the computation it
    runs in (``""``: the region's, inlined into the program's; else a label of a loop's or
    branch's body inside the region) and the JAX primitive that sends it."""

    kind: str
    axes: tuple[str, ...]
    reduce_op: str | None
    dtype: np.dtype
    result_bytes: int
    group: int
    after: int
    body: str
    primitive: str

    def __str__(self) -> str:
        """The one text form: ``psum: all-reduce(float32, 384 B) over tp``."""
        return f"{self.primitive}: {self.kind}({self.dtype}, {self.result_bytes} B) over {','.join(self.axes)}"

    def nbytes(self, widening: int = 1) -> Fraction:
        """Bytes each device sends, its elements ``widening`` times as wide as written
        (CPU XLA: ``bfloat16`` sent as ``float32``)."""
        return result_nbytes(self.kind, widening * self.result_bytes, self.group)


class RegionMove(NamedTuple):
    """A collective of a move the body of a region manual over some mesh axes makes of an
    operand of one of its equations over the others, where XLA partitions it (a
    ``psum_scatter``'s operand split over ``dp`` gathered first): the operand's index and
    the collective, whose ``after``, ``body`` and ``primitive`` the walk of the body sets
    where it reaches the equation."""

    operand: int
    collective: RegionCollective


class Region(NamedTuple):
    """What a region's body sends: its collectives in program order, and per output of the
    region the collectives it depends on (a bit set: a gradient region's input cotangent
    does not wait for the weight gradients' all-reduces, which XLA's combiner then merges
    with the program's)."""

    collectives: tuple[RegionCollective, ...]
    outputs: tuple[int, ...]


def region_collectives(
    eqn: Any, axis_sizes: Mapping[str, int], block_bytes: Mapping[Any, int] | None = None,
    moves: Mapping[int, Sequence[RegionMove]] | None = None,
) -> Region:
    """What the body of ``shard_map`` equation ``eqn`` sends (module docstring);
    ``axis_sizes``: the mesh's axis name -> size. ``block_bytes``: per result of a body
    collective (its jaxpr variable), the bytes of its per-device block where the region
    leaves some mesh axes to XLA (``shard_map(..., axis_names=)``: XLA splits the body's
    values over the others too); a result not given is whole on every device. ``moves``:
    per body equation (by ``id``), the moves XLA makes of its operands over those other
    axes, each sent before it (its ``primitive``: the equation's, then ``" operand"``)."""
    if getattr(getattr(eqn, "primitive", None), "name", None) != "shard_map":
        raise ArgumentTypeError(
            "eqn", eqn, "not a shard_map equation", "pass an equation of a jaxpr whose primitive is shard_map "
            "(e.g. jax.make_jaxpr(fn)(*args).eqns)",
        )
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    if block_bytes or moves:  # a walk's own sizes: not cached
        return _region(body, dict(axis_sizes), block_bytes, moves)
    return _collectives_of(body, tuple(axis_sizes.items()))


@cached(maxsize=64)
def _collectives_of(body: Any, axis_sizes: tuple[tuple[str, int], ...]) -> Region:
    return _region(body, dict(axis_sizes))


def _region(
    body: Any, sizes: dict[str, int], block_bytes: Mapping[Any, int] | None = None,
    moves: Mapping[int, Sequence[RegionMove]] | None = None,
) -> Region:
    """:func:`region_collectives` of the body's jaxpr ``body``."""
    found: list[RegionCollective] = []
    outputs = _walk(body, [0] * len(body.invars), found, "", sizes, [0], block_bytes, moves)
    return Region(tuple(found), tuple(outputs))


def _walk(
    jaxpr: Any, deps: Sequence[int], found: list[RegionCollective], body: str, sizes: dict[str, int], bodies: list[int],
    block_bytes: Mapping[Any, int] | None = None, moves: Mapping[int, Sequence[RegionMove]] | None = None,
) -> list[int]:
    """Appends to ``found`` the collectives of ``jaxpr`` (run in computation ``body``),
    whose inputs depend on the collectives ``deps`` (bit sets); returns what its outputs
    depend on. ``bodies``: how many loop and branch bodies were labelled so far;
    ``block_bytes``, ``moves``: :func:`region_collectives`'."""
    env: dict[Any, int] = dict(zip(jaxpr.invars, deps))

    def read(var: Any) -> int:
        return 0 if isinstance(var, core.Literal) else env.get(var, 0)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        for move in moves.get(id(eqn), ()) if moves else ():
            found.append(move.collective._replace(after=ins[move.operand], body=body, primitive=f"{name} operand"))
            ins[move.operand] |= 1 << (len(found) - 1)
        if name in _COLLECTIVES and named_axes(eqn):
            outs = _sent(eqn, ins, found, body, sizes, block_bytes)
        else:
            called = _inlined(eqn)
            if called is not None:  # a call (XLA inlines it) or a nested region: the same computation
                outs = _walk(called, ins, found, body, sizes, bodies, block_bytes, moves)
            else:
                every = 0
                for bits in ins:
                    every |= bits
                first = len(found)
                for inner in core.jaxprs_in_params(eqn.params):  # a loop's or a branch's: a computation of its own
                    bodies[0] += 1
                    _walk(inner, [every] * len(inner.invars), found, f"{body}/{bodies[0]}", sizes, bodies, block_bytes,
                          moves)
                every |= (1 << len(found)) - (1 << first)
                outs = [every] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _sent(
    eqn: Any, ins: list[int], found: list[RegionCollective], body: str, sizes: dict[str, int],
    block_bytes: Mapping[Any, int] | None = None,
) -> list[int]:
    """The collectives of one collective equation, one per operand; what each result
    depends on."""
    kind, reduce_op = _COLLECTIVES[eqn.primitive.name]
    named = named_axes(eqn)
    unknown = [a for a in named if a not in sizes]
    if unknown:
        raise InferenceError(
            "axis_sizes", dict(sizes), f"has no axis {unknown[0]!r}, which the region's {eqn.primitive.name} names",
            "pass the size of every axis of the shard_map's mesh",
        )
    axes = tuple(a for a in sizes if a in named)  # in mesh order
    groups = eqn.params.get("axis_index_groups")
    group = len(groups[0]) if groups else math.prod(sizes[a] for a in axes)
    outs = []
    for bits, out in zip(ins, eqn.outvars):
        dtype = np.dtype(out.aval.dtype)
        whole = math.prod(out.aval.shape) * dtype.itemsize
        found.append(RegionCollective(
            kind, axes, reduce_op, dtype, whole if block_bytes is None else block_bytes.get(out, whole), group, bits,
            body, eqn.primitive.name,
        ))
        outs.append(bits | 1 << (len(found) - 1))
    return outs


def named_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes collective ``eqn`` names (a ``jax.vmap``'s over its own axis names
    positional ints alone: a local reduction, no collective)."""
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if isinstance(a, str))


def _inlined(eqn: Any) -> Any | None:
    """The jaxpr of a call whose inputs and outputs are the equation's, or of a nested
    ``shard_map`` (manual over more axes: the same per-device code); else None."""
    name = eqn.primitive.name
    param = "jaxpr" if name == "shard_map" else CALL_JAXPR_PARAMS.get(name)
    if param is None:
        return None
    called = eqn.params[param]
    called = getattr(called, "jaxpr", called)
    if len(called.invars) != len(eqn.invars) or len(called.outvars) != len(eqn.outvars):
        return None
    return called
