"""The communication cost model: bytes each device sends per collective, and per-axis weights.

Pure arithmetic, exact (``Fraction``). A collective on a mesh dim of size ``n`` acts on
*blocks*: ``T`` is the bytes of one device's block of the tensor with that mesh dim
unsplit (for all-gather: the gathered block; for reduce-scatter and all-reduce: the full
partial block; for all-to-all: ``n`` times the block a device holds). Blocks are the
padded ones (``ceil`` of every split), as in the DTensor's padded representation.
Ring algorithms (the bandwidth-optimal ones, as in torch's and NCCL's cost models):

* all-gather ``S -> R``: each device receives the ``n-1`` blocks of size ``T/n`` it lacks
  and sends as much: ``T(n-1)/n``.
* reduce-scatter ``P -> S``: ``n-1`` ring steps, each sending one ``T/n`` chunk: ``T(n-1)/n``.
* all-reduce ``P -> R``: reduce-scatter then all-gather: ``2T(n-1)/n``.
* all-to-all ``S(i) -> S(j)``: a device holds ``T/n`` and keeps one ``n``-th of it, sending
  the rest: ``(T/n)(n-1)/n = T(n-1)/n^2``.
* local slice ``R -> S`` and local partial ``R -> P``: no communication, ``0``.

The cost of a step is its bytes times the weight of its mesh axis (:class:`CostModel`,
default 1 for every axis; make a slow cross-host axis e.g. 4).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real

from ..errors import ArgumentTypeError, InferenceError
from ..mesh import DeviceMesh

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "COLLECTIVES",
    "LOCAL_PARTIAL",
    "LOCAL_SLICE",
    "REDUCE_SCATTER",
    "CostModel",
    "CostModelLike",
    "block_bytes",
    "collective_bytes",
    "default_cost_model",
    "resolve_cost_model",
    "set_default_cost_model",
    "use_cost_model",
]

ALL_GATHER = "all-gather"
ALL_TO_ALL = "all-to-all"
REDUCE_SCATTER = "reduce-scatter"
ALL_REDUCE = "all-reduce"
LOCAL_SLICE = "local-slice"
LOCAL_PARTIAL = "local-partial"
COLLECTIVES = (ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, ALL_REDUCE, LOCAL_SLICE, LOCAL_PARTIAL)

_FACTORS = {
    ALL_GATHER: lambda n: Fraction(n - 1, n),
    REDUCE_SCATTER: lambda n: Fraction(n - 1, n),
    ALL_REDUCE: lambda n: Fraction(2 * (n - 1), n),
    ALL_TO_ALL: lambda n: Fraction(n - 1, n * n),
    LOCAL_SLICE: lambda n: Fraction(0),
    LOCAL_PARTIAL: lambda n: Fraction(0),
}


def collective_bytes(collective: str, block: int | Fraction, n: int) -> Fraction:
    """Bytes each device sends for ``collective`` on a mesh dim of size ``n`` acting on
    blocks of ``block`` bytes (``T`` in the module docstring)."""
    if collective not in _FACTORS:
        raise InferenceError("collective", collective, "unknown collective", f"use one of {COLLECTIVES}")
    if n < 1:
        raise InferenceError("n", n, "a mesh dim has at least one rank", "pass the mesh dim's size")
    return Fraction(block) * _FACTORS[collective](n)


def block_bytes(
    shape: Sequence[int],
    itemsize: int,
    dim_axes: Sequence[Sequence[int]],
    mesh_shape: Sequence[int],
    without: int | None = None,
) -> int:
    """Bytes of one device's padded block: every dim ``ceil(N / pieces)``, where the
    pieces are the sizes of the mesh dims splitting it, leaving out mesh dim ``without``."""
    total = itemsize
    for n, axes in zip(shape, dim_axes):
        pieces = math.prod(mesh_shape[a] for a in axes if a != without)
        total *= -(-n // pieces)
    return total


@dataclass(frozen=True, init=False)
class CostModel:
    """Per-mesh-axis weights of communication: a step's cost is its bytes times the
    weight of its axis. Keys are axis names or mesh dim indices; missing axes weigh 1.

    ``CostModel({"dp": 4})`` says bytes on the (cross-host) ``dp`` axis cost 4 times as
    much as elsewhere. Weights are kept as exact fractions so that ties stay ties.
    """

    axis_weights: tuple[tuple[str | int, Fraction], ...]

    def __init__(self, axis_weights: Mapping[str | int, Real] | None = None) -> None:
        if axis_weights is None:
            axis_weights = {}
        if not isinstance(axis_weights, Mapping):
            raise ArgumentTypeError(
                "axis_weights", axis_weights, "expected a mapping axis -> weight", 'pass e.g. {"dp": 4}'
            )
        items = []
        for axis, weight in axis_weights.items():
            if isinstance(axis, bool) or not isinstance(axis, (str, int)):
                raise ArgumentTypeError(
                    "axis_weights", dict(axis_weights), f"key {axis!r} is not an axis name or index", 'use e.g. "dp"'
                )
            if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight) or weight <= 0:
                raise ArgumentTypeError(
                    "axis_weights", dict(axis_weights), f"weight {weight!r} of {axis!r} is not a positive number",
                    "use positive finite weights (1 = default speed)",
                )
            items.append((axis, Fraction(weight)))
        object.__setattr__(self, "axis_weights", tuple(sorted(items, key=lambda kv: (str(type(kv[0])), kv[0]))))

    def weight(self, mesh: DeviceMesh, mesh_dim: int) -> Fraction:
        """The weight of one mesh dim: by name first, then by index, else 1."""
        table = dict(self.axis_weights)
        name = mesh.axis_names[mesh_dim]
        return table.get(name, table.get(mesh_dim, Fraction(1)))

    def weights(self, mesh: DeviceMesh) -> tuple[Fraction, ...]:
        return tuple(self.weight(mesh, m) for m in range(mesh.ndim))

    def __repr__(self) -> str:
        return f"CostModel({ {k: float(v) for k, v in self.axis_weights}!r})"


CostModelLike = CostModel | Mapping[str | int, Real] | None

_default: list[CostModel] = [CostModel()]


def default_cost_model() -> CostModel:
    """The cost model used when an inference function gets ``cost_model=None``."""
    return _default[0]


def set_default_cost_model(model: CostModelLike) -> CostModel:
    """Set the default cost model (a CostModel or a mapping of weights; None resets it)
    and return the previous one."""
    previous = _default[0]
    _default[0] = CostModel() if model is None else resolve_cost_model(model, "model")
    return previous


@contextmanager
def use_cost_model(model: CostModelLike) -> Iterator[CostModel]:
    """Use ``model`` as the default inside a ``with`` block."""
    previous = set_default_cost_model(model)
    try:
        yield default_cost_model()
    finally:
        set_default_cost_model(previous)


def resolve_cost_model(model: CostModelLike, argument: str = "cost_model") -> CostModel:
    """``None`` -> the default; a mapping -> ``CostModel(mapping)``; a CostModel as is.
    Bad weights are reported as a bad ``argument``."""
    if model is None:
        return default_cost_model()
    if isinstance(model, CostModel):
        return model
    try:
        return CostModel(model)
    except ArgumentTypeError as err:
        raise ArgumentTypeError(argument, model, err.problem, "pass a CostModel or " + err.fix) from None
