"""The communication cost model: bytes each device sends per collective, and per-axis weights.

Pure arithmetic, exact (``Fraction``). A collective on a mesh dim of size ``n`` acts on
*blocks*: ``T`` is the bytes of one device's block of the tensor with that mesh dim
unsplit (for all-gather: the gathered block; for reduce-scatter and all-reduce: the full
partial block; for all-to-all: ``n`` times the block a device holds). Blocks are the
padded ones (``ceil`` of every split), as in the DTensor's padded representation.
Ring algorithms (the bandwidth-optimal ones, as in torch's and NCCL's cost models):

* all-gather ``S -> R``: each device receives the ``n-1`` blocks of size ``T/n`` it lacks
  and sends as much: ``T(n-1)/n``. Its ``T`` and kind are :func:`gather_block_bytes`'s: XLA
  gathers ``n`` equal chunks of the held padded block, or, where the gathered dim has at
  most ``n/2`` rows, all-reduces the whole unpadded block (``2T(n-1)/n``). Off a dim split
  by several mesh dims whose gathered blocks are misaligned with the remaining split's,
  XLA first sends rows between devices (collective-permutes, :func:`gather_halo_permutes`).
* reduce-scatter ``P -> S``: ``n-1`` ring steps, each sending one ``T/n`` chunk: ``T(n-1)/n``.
* all-reduce ``P -> R``: reduce-scatter then all-gather: ``2T(n-1)/n``.
* all-to-all ``S(i) -> S(j)``: a device holds ``T/n`` and keeps one ``n``-th of it, sending
  the rest: ``(T/n)(n-1)/n = T(n-1)/n^2``. Its ``T`` is :func:`exchange_block_bytes`: the
  held block's dim ``j`` padded to a multiple of ``n``, as XLA pads an uneven exchange.
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
from typing import Any

from ..caches import cached, hash_once, without_hash
from ..errors import ArgumentTypeError, InferenceError
from ..hlo import Collective
from ..mesh import DeviceMesh
from .calibration import Curve, curve_seconds, measure_alloc_curve, measure_copy_curve, measure_curves

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "COLLECTIVES",
    "COLLECTIVE_PERMUTE",
    "COMMUNICATING",
    "DEFAULT_COLLECTIVE_OVERHEAD",
    "SEARCH_OVERHEAD",
    "UNMERGED_OVERHEAD",
    "LOCAL_PARTIAL",
    "LOCAL_SLICE",
    "REDUCE_SCATTER",
    "CostModel",
    "CostModelLike",
    "Overhead",
    "block_bytes",
    "blocks_misaligned",
    "collective_bytes",
    "collective_factor",
    "collective_nbytes",
    "default_cost_model",
    "exchange_block_bytes",
    "gather_block_bytes",
    "gather_halo_bytes",
    "gather_halo_permutes",
    "halo_permutes",
    "overhead_of",
    "resolve_cost_model",
    "result_nbytes",
    "set_default_cost_model",
    "use_cost_model",
]

ALL_GATHER = "all-gather"
ALL_TO_ALL = "all-to-all"
REDUCE_SCATTER = "reduce-scatter"
ALL_REDUCE = "all-reduce"
LOCAL_SLICE = "local-slice"
LOCAL_PARTIAL = "local-partial"
COLLECTIVE_PERMUTE = "collective-permute"  # compiled only: XLA's point-to-point sends
COLLECTIVES = (ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, ALL_REDUCE, LOCAL_SLICE, LOCAL_PARTIAL)
COMMUNICATING = (ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, ALL_REDUCE)  # the kinds that send data

# The overhead per collective the program search's descents run at (:mod:`.program`: their schedule was measured and
# tuned at it): a latency in bytes, so that a plan with fewer collectives wins unless the other saves more bytes than
# that per extra collective. Measured on the training steps of tests/test_inference_programs.py and test_frameworks.py
# (Megatron dp=2 x tp=4), from 0 to 768: 192 gave the fewest collectives with bytes nearest XLA's on all of them; 768
# trades too many bytes (Equinox's adamw step 1.09 -> 1.33x XLA's bytes). A model charging it for every kind
# (``CostModel(collective_overhead=192)``) takes the search alone; any other continues from its result.
SEARCH_OVERHEAD = 192
# The latency in bytes charged per all-gather and all-to-all by default: the collectives CPU XLA's combiner never
# merges, each paying its own latency.
UNMERGED_OVERHEAD = 8192
# What the program search charges per collective by default, in COMMUNICATING's order: UNMERGED_OVERHEAD per
# all-gather and all-to-all, SEARCH_OVERHEAD per
# reduce-scatter and all-reduce (merged into few collectives by the combiner). On a pod's alpha-beta model (5 us per
# collective after the combiner, 50 GB/s) it gave cheaper plans than 192 everywhere on every program of
# docs/benchmarks.md section 14, at the tests' tiny widths (0.46-1.44x XLA's time where 0.79-1.81x) and at a realistic
# width (d_model 512, sequence 256: the same bytes within 0.04% in 1-5 fewer collectives); with no more collectives
# after XLA's combiner than XLA on 17 of its 25 programs where 192 had 4 (stop 38).
DEFAULT_COLLECTIVE_OVERHEAD: "Overhead" = (UNMERGED_OVERHEAD, UNMERGED_OVERHEAD, SEARCH_OVERHEAD, SEARCH_OVERHEAD)
# Bytes charged per communicating step, as the planner's searches take it: one figure for every kind, or one per kind
# in COMMUNICATING's order (:attr:`CostModel.collective_overhead`)
Overhead = int | tuple[int, int, int, int]

_FACTORS = {
    ALL_GATHER: lambda n: Fraction(n - 1, n),
    REDUCE_SCATTER: lambda n: Fraction(n - 1, n),
    ALL_REDUCE: lambda n: Fraction(2 * (n - 1), n),
    ALL_TO_ALL: lambda n: Fraction(n - 1, n * n),
    LOCAL_SLICE: lambda n: Fraction(0),
    LOCAL_PARTIAL: lambda n: Fraction(0),
}


_ONE = Fraction(1)  # a weight's default, built once (every plan and ranking reads the weights)


def collective_bytes(collective: str, block: int | Fraction, n: int) -> Fraction:
    """Bytes each device sends for ``collective`` on a mesh dim of size ``n`` acting on
    blocks of ``block`` bytes (``T`` in the module docstring)."""
    if collective not in _FACTORS:
        raise InferenceError("collective", collective, "unknown collective", f"use one of {COLLECTIVES}")
    if n < 1:
        raise InferenceError("n", n, "a mesh dim has at least one rank", "pass the mesh dim's size")
    return Fraction(block) * collective_factor(collective, n)


@cached(maxsize=256)
def collective_factor(collective: str, n: int) -> Fraction:
    """:func:`collective_bytes` per byte of block (a known ``collective``, ``n >= 1``);
    cached: the planner's searches and the signature bounds ask it per mesh dim, and
    building the Fraction again was most of their setup."""
    return _FACTORS[collective](n)


def collective_nbytes(collective: Collective, num_devices: int) -> Fraction:
    """Bytes each device sends for one compiled collective (:func:`result_nbytes` of its
    per-device result). Empty replica groups mean all devices."""
    n = collective.group_size if collective.groups else num_devices
    return result_nbytes(collective.op, collective.result_bytes, n)


def result_nbytes(kind: str, result_bytes: int, n: int) -> Fraction:
    """Bytes each device sends for one collective of ``kind`` as XLA compiles it, by the
    formulas of :mod:`.cost` applied to its per-device result ``R`` (``result_bytes``) and
    group size ``n``: all-reduce ``2R(n-1)/n``, all-gather ``R(n-1)/n`` (R: the gathered
    result), reduce-scatter ``R(n-1)`` (the input is ``nR``), all-to-all ``R(n-1)/n`` (R:
    one device's block, all tuple parts), collective-permute ``R``."""
    if kind == COLLECTIVE_PERMUTE:
        return Fraction(result_bytes)
    if kind in (REDUCE_SCATTER, ALL_TO_ALL):
        return collective_bytes(kind, n * result_bytes, n)
    return collective_bytes(kind, result_bytes, n)


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
        # most dims are whole or split once (ranking and the planner compute this for every layout they meet)
        if not axes:
            total *= n
        elif len(axes) == 1:
            total *= n if axes[0] == without else -(-n // mesh_shape[axes[0]])
        else:
            total *= -(-n // math.prod(mesh_shape[a] for a in axes if a != without))
    return total


def exchange_block_bytes(
    shape: Sequence[int], itemsize: int, dim_axes: Sequence[Sequence[int]], mesh_shape: Sequence[int], mesh_dim: int,
) -> tuple[int, ...]:
    """Per tensor dim ``j``, ``T`` of an all-to-all on ``mesh_dim`` moving its split to
    ``j`` (``dim_axes``: the layout before it), as XLA compiles it: ``n`` times the padded
    block a device holds, that block's dim ``j`` padded up to a multiple of ``n``. XLA
    exchanges ``n`` equal chunks of the padded block, padding included, so on an uneven
    split this is more than :func:`block_bytes` without ``mesh_dim`` (equal on even ones):
    a ``(1, 8, 32)`` float32 split over 4 devices on its last dim and moved to its first
    sends ``768`` B per device, not ``192`` (the chunk of a size-1 dim is padded to 4 rows).
    All dims at once: the planner prices every target of a layout's split together."""
    n = mesh_shape[mesh_dim]
    pieces = [-(-size // math.prod(mesh_shape[a] for a in axes)) if axes else size for size, axes in zip(shape, dim_axes)]
    held = n * itemsize * math.prod(pieces)
    return tuple(held // piece * (-(-piece // n) * n) if piece else 0 for piece in pieces)


def gather_block_bytes(
    shape: Sequence[int], itemsize: int, dim_axes: Sequence[Sequence[int]], mesh_shape: Sequence[int], mesh_dim: int,
    dim: int,
) -> tuple[str, int]:
    """The collective XLA compiles to gather ``mesh_dim`` off tensor dim ``dim`` (its
    minor-most split; ``dim_axes``: the layout before), and its ``T``, as XLA's SPMD
    partitioner does it (``PartitionedHlo::ReplicatePartial``). Let ``B`` be the dim's
    size in the group's view (``ceil(N / pieces)``, the other mesh dims splitting it) and
    ``n`` the group's size. Where ``B <= n // 2`` XLA writes each block into zeros
    (dynamic-update-slice) and all-reduces the whole: an all-reduce of ``T`` =
    :func:`block_bytes` without ``mesh_dim`` (a ``(1, 8, 32)`` float32 over 4 devices:
    1,536 B per device, not the 768 of an unpadded all-gather). Otherwise an all-gather
    of ``n`` equal chunks of the held padded block, padding included: ``T`` = ``n`` times
    that block (``(6, 8, 32)`` over 4: blocks of 2 rows, 8 rows gathered, 6,144 B, not
    4,608). Equal to the unpadded all-gather on even splits. Measured on CPU XLA for
    ``N`` 1-13 on 2, 4 and 8 devices and over a sub-mesh axis (tests/test_inference_cost.py)."""
    n = mesh_shape[mesh_dim]
    gathered = block_bytes(shape, itemsize, dim_axes, mesh_shape, without=mesh_dim)
    rows = -(-shape[dim] // math.prod(mesh_shape[a] for a in dim_axes[dim] if a != mesh_dim))
    if rows <= n // 2:
        return ALL_REDUCE, gathered
    return ALL_GATHER, gathered // rows * (-(-rows // n) * n)



def blocks_misaligned(size: int, pieces: int, n: int) -> bool:
    """Does gathering the minor ``n``-way split off a dim of ``size`` split ``pieces`` ways
    (by several mesh dims: ``pieces > n``) leave blocks that do not start where the
    remaining ``pieces / n``-way split's do? Each group gathers ``n`` blocks of
    ``c = ceil(size / pieces)`` rows, its target block is ``d = ceil(size / (pieces / n))``
    rows: misaligned when ``n * c != d`` (``(6, 8, 32)`` split ``(a, b)`` on 2x4: groups of
    4 rows against blocks of 3). XLA's test, in ``TileToPartialReplicateHaloExchange``."""
    if pieces <= n or not size:
        return False
    return n * -(-size // pieces) != -(-size // (pieces // n))


@cached(maxsize=4096)
def halo_permutes(size: int, pieces: int, n: int) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """The collective-permutes XLA's SPMD partitioner sends to realign blocks before
    gathering the minor ``n``-way split off a dim of ``size`` split ``pieces`` ways (see
    :func:`blocks_misaligned`; none when aligned), each as its rows and its (source,
    target) pairs of shards (ordinals along the dim). As
    ``TileToPartialReplicateHaloExchange`` and ``ExchangeHaloCompact`` do it: shard ``i``
    (of ``pieces``, ``c`` rows each) must hold the ``c`` rows from
    ``i*c - (n*c - d) * floor(i / n)`` (a left halo); each piece of them held by another
    shard is sent from there (rows at or past ``size`` are padding, not sent); pieces are
    packed, taking each source's in order of their offset in the target window, into
    permutes of distinct sources and distinct targets, each as many rows as the span of its
    pieces in their sources (a left and a right piece not mixed). ``(6, 8, 32)`` ``(a, b) ->
    a`` on 2x4: one permute of 1 row (shards 3, 4, 5 to 4, 5, 6); ``(9, 8, 32)``: two of 1 row."""
    if not blocks_misaligned(size, pieces, n):
        return ()
    held = -(-size // pieces)
    shift = n * held - -(-size // (pieces // n))  # rows each group's window moves left, per group
    wanted: list[list[tuple[int, int, int, int]]] = [[] for _ in range(pieces)]  # per source: offset, target, span
    for target in range(pieces):
        start = target * held - shift * (target // n)
        row = start
        while row < min(start + held, size):
            first = row % held
            rows = min(held - first, start + held - row)
            if row // held != target:
                wanted[row // held].append((row - start, target, first, first + rows))
            row += rows
    for pieces_of_source in wanted:
        pieces_of_source.sort(key=lambda piece: piece[0])
    taken = [0] * pieces
    permutes = []
    while True:
        pairs: list[tuple[int, int]] = []
        low, high = held, 0
        for source, pieces_of_source in enumerate(wanted):
            if taken[source] == len(pieces_of_source):
                continue
            _, target, first, last = pieces_of_source[taken[source]]
            if pairs and (
                any(target == t for _, t in pairs) or (low > last and high == held and first == 0)
                or (high < first and low == 0 and last == held)
            ):
                continue  # a target already served, or a left piece with a right one: the next permute
            pairs.append((source, target))
            low, high = min(low, first), max(high, last)
            taken[source] += 1
        if not pairs:
            return tuple(permutes)
        permutes.append((high - low, tuple(pairs)))


def gather_halo_permutes(
    shape: Sequence[int], itemsize: int, dim_axes: Sequence[Sequence[int]], mesh_shape: Sequence[int], mesh_dim: int,
    dim: int,
) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The collective-permutes XLA adds before gathering ``mesh_dim`` off tensor dim ``dim``
    (its minor-most split; ``dim_axes``: the layout before) when other mesh dims split that
    dim too and the blocks are misaligned (:func:`halo_permutes`), each as the mesh dims
    its pairs vary along and the bytes each sending device sends (its rows times a row of
    the held padded block). None on a dim split once, or aligned. ``(6, 8, 32)`` float32
    ``(a, b) -> a`` on 2x4: one of 1,024 B over ``(a, b)``, besides the all-gather's
    3,072 (:func:`gather_block_bytes`). Measured on CPU XLA for ``N`` 1-33 on 2x4, 4x2 and
    2x2x2 meshes (tests/test_inference_cost.py)."""
    axes = dim_axes[dim]
    if len(axes) < 2 or not shape[dim]:
        return ()
    sizes = [mesh_shape[a] for a in axes]
    pieces = math.prod(sizes)
    permutes = halo_permutes(shape[dim], pieces, mesh_shape[mesh_dim])
    if not permutes:
        return ()
    row = block_bytes(shape, itemsize, dim_axes, mesh_shape) // -(-shape[dim] // pieces)
    result = []
    for rows, pairs in permutes:
        varying = {
            a for source, target in pairs
            for a, s, t in zip(axes, _place(source, sizes), _place(target, sizes)) if s != t
        }
        result.append((tuple(sorted(varying)), rows * row))
    return tuple(result)


def _place(ordinal: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """A shard's index along each mesh dim splitting a tensor dim (``sizes`` major first)."""
    place = []
    for size in reversed(sizes):
        ordinal, index = divmod(ordinal, size)
        place.append(index)
    return tuple(reversed(place))


def gather_halo_bytes(
    shape: Sequence[int], itemsize: int, dim_axes: Sequence[Sequence[int]], mesh_shape: Sequence[int], mesh_dim: int,
    dim: int,
) -> int:
    """Bytes each device sends at most in :func:`gather_halo_permutes` (0 where none)."""
    return sum(nbytes for _, nbytes in gather_halo_permutes(shape, itemsize, dim_axes, mesh_shape, mesh_dim, dim))

@dataclass(frozen=True, init=False)
class CostModel:
    """Per-mesh-axis weights of communication: a step's cost is its bytes times the
    weight of its axis. Keys are axis names or mesh dim indices; missing axes weigh 1.

    ``CostModel({"dp": 4})`` says bytes on the (cross-host) ``dp`` axis cost 4 times as
    much as elsewhere. Weights are kept as exact fractions so that ties stay ties.

    For choosing redistribute schedules (:mod:`placements2jax.schedules`) a model also
    carries, per axis, a ``latency`` (seconds per collective) and a ``per_byte`` time
    (seconds per byte sent by each device): a collective over several axes costs the
    largest latency plus its bytes times the largest per-byte time of those axes.
    ``copy_per_byte`` prices bytes a schedule copies within a device (packing messages);
    unset, it is the smallest per-byte time of the mesh's axes (right for simulated CPU
    devices, where a collective is a copy between threads; give the device memory's figure
    for a real interconnect).

    ``curves`` (what :meth:`calibrate` measures) make the time size- and kind-aware: per
    axis and collective kind (``"all-gather"``, ``"all-reduce"``, ...), seconds per
    collective against bytes sent per device at a few sizes, interpolated
    (:func:`.calibration.curve_seconds`); a collective over several axes takes the slowest
    axis's figure. ``copy_curve`` does the same for local copies. Where a curve is known it
    replaces ``latency`` + ``per_byte`` (which :meth:`calibrate` also fills, from the
    ``collective-permute`` curve: its smallest size's time and its largest sizes' slope).
    ``alloc_curve`` prices the fresh buffers a program allocates per device (its
    temporaries: on the CPU backend, large ones are mapped and page-faulted by every call).

    ``collective_overhead`` is what the program search (:func:`.jaxpr.predict`, ``check``,
    ``apply``) charges per collective on top of its bytes: a collective costs ``latency +
    bytes x per_byte`` (torch's and Alpa's alpha-beta model), so in bytes its latency is
    ``latency / per_byte``, and a plan with more collectives must save more bytes than that
    per extra collective. Bytes (rounded to whole bytes: the planner's costs are exact
    integers), one figure for every collective or a mapping per planned kind
    (``"all-gather"``, ``"all-to-all"``, ``"reduce-scatter"``, ``"all-reduce"``; kinds not
    given keep the figure ``None`` gives): e.g. ``{"all-gather": 3072, "all-to-all": 3072}``
    prices the collectives CPU XLA's combiner never merges (:mod:`.combine`) dearer than the
    all-reduces it merges. ``None``: ``max(latency) / max(per_byte)`` where both are given
    (the class's rule for a collective over several axes; a model from :meth:`calibrate`
    has both), else :data:`DEFAULT_COLLECTIVE_OVERHEAD` (8,192 B per all-gather and
    all-to-all, which CPU XLA's combiner never merges, :data:`SEARCH_OVERHEAD` = 192 B per
    all-reduce and reduce-scatter, which it merges: measured on CPU programs against a pod's
    alpha-beta time). On a real pod (microsecond latencies, tens of GB/s) a collective's
    latency is tens of KB: plans with fewer collectives.
    """

    axis_weights: tuple[tuple[str | int, Fraction], ...]
    latency: tuple[tuple[str | int, float], ...]
    per_byte: tuple[tuple[str | int, float], ...]
    copy_per_byte: float | None
    curves: tuple[tuple[str | int, tuple[tuple[str, Curve], ...]], ...]
    copy_curve: Curve
    alloc_curve: Curve
    collective_overhead: Overhead

    def __init__(
        self,
        axis_weights: Mapping[str | int, Real] | None = None,
        *,
        latency: Mapping[str | int, Real] | None = None,
        per_byte: Mapping[str | int, Real] | None = None,
        copy_per_byte: Real | None = None,
        curves: Mapping[str | int, Mapping[str, Sequence[tuple[Real, Real]]]] | None = None,
        copy_curve: Sequence[tuple[Real, Real]] | None = None,
        alloc_curve: Sequence[tuple[Real, Real]] | None = None,
        collective_overhead: Real | Mapping[str, Real] | None = None,
    ) -> None:
        object.__setattr__(self, "axis_weights", _axis_table("axis_weights", axis_weights, Fraction))
        object.__setattr__(self, "latency", _axis_table("latency", latency, float))
        object.__setattr__(self, "per_byte", _axis_table("per_byte", per_byte, float))
        copy = None if copy_per_byte is None else dict(_axis_table("copy_per_byte", {0: copy_per_byte}, float))[0]
        object.__setattr__(self, "copy_per_byte", copy)
        object.__setattr__(self, "curves", _curve_table(curves))
        object.__setattr__(self, "copy_curve", () if copy_curve is None else _curve("copy_curve", copy_curve))
        object.__setattr__(self, "alloc_curve", () if alloc_curve is None else _curve("alloc_curve", alloc_curve))
        object.__setattr__(self, "collective_overhead", _overhead(collective_overhead, self.latency, self.per_byte))

    # every plan cache keys on the model: hashing its tables again at each use was ~7,300 hashes of a cold Llama predict
    __hash__ = hash_once()

    def __getstate__(self) -> dict[str, Any]:
        return without_hash(self)

    @classmethod
    def calibrate(cls, mesh: DeviceMesh, repeats: int = 5, *, timer: Any = None) -> CostModel:
        """Measure, per mesh dim and collective kind, the time of one collective at a few
        sizes on the current backend (programs of chains of dependent collectives along
        the dim; medians of paired differences; see :func:`.calibration.measure_curves`),
        the time of a local copy at the same sizes (:func:`.calibration.measure_copy_curve`)
        and of fresh buffers up to 64 MiB per device (:func:`.calibration.measure_alloc_curve`).
        ``timer(kind, axis, nbytes, count)`` replaces the programs' timing (kind ``"copy"``
        for the local copy; tests give fake ones)."""
        curves = measure_curves(mesh, repeats=repeats, timer=timer)
        copy_curve = measure_copy_curve(mesh, repeats=repeats, timer=timer)
        alloc_curve = measure_alloc_curve(mesh, copy_curve, repeats=max(1, (repeats + 1) // 2), timer=timer)
        latency = {axis: table[COLLECTIVE_PERMUTE][0][1] for axis, table in curves.items()}
        per_byte = {axis: _slope(table[COLLECTIVE_PERMUTE]) for axis, table in curves.items()}
        return cls(latency=latency, per_byte=per_byte, copy_per_byte=_slope(copy_curve), curves=curves,
                   copy_curve=copy_curve, alloc_curve=alloc_curve)

    def weight(self, mesh: DeviceMesh, mesh_dim: int) -> Fraction:
        """The weight of one mesh dim: by name first, then by index, else 1."""
        return _lookup(self.axis_weights, mesh, mesh_dim, _ONE)

    def weights(self, mesh: DeviceMesh) -> tuple[Fraction, ...]:
        return tuple(self.weight(mesh, m) for m in range(mesh.ndim))

    def collective_seconds(
        self, mesh: DeviceMesh, mesh_dims: Sequence[int], nbytes: float, kind: str | None = None
    ) -> float:
        """Predicted seconds of one collective (of ``kind``, e.g. ``"all-gather"``; None:
        unknown) over ``mesh_dims`` sending ``nbytes`` per device: the slowest axis's
        curve for that kind (the ``collective-permute`` curve for an unknown kind) where
        curves are known; else the largest latency plus ``nbytes`` times the largest
        per-byte time (axes without a measured figure: latency 0, and their weight as
        per-byte time)."""
        dims = tuple(mesh_dims) or tuple(range(mesh.ndim))
        if self.curves:
            tables = [_lookup(self.curves, mesh, m, None) for m in dims]
            if all(tables):
                return max(curve_seconds(_kind_curve(t, kind), nbytes) for t in tables)  # type: ignore[arg-type]
        latency = max(_lookup(self.latency, mesh, m, 0.0) for m in dims)
        per_byte = max(_lookup(self.per_byte, mesh, m, float(self.weight(mesh, m))) for m in dims)
        return latency + nbytes * per_byte

    def copy_seconds(self, mesh: DeviceMesh, nbytes: float) -> float:
        """Predicted seconds to copy ``nbytes`` within a device (see the class docstring)."""
        if self.copy_curve:
            return curve_seconds(self.copy_curve, nbytes)
        if self.copy_per_byte is not None:
            return nbytes * self.copy_per_byte
        return nbytes * min(
            _lookup(self.per_byte, mesh, m, float(self.weight(mesh, m))) for m in range(mesh.ndim)
        )

    def alloc_seconds(self, nbytes: float) -> float:
        """Predicted seconds of allocating ``nbytes`` of fresh buffers per device (0 without
        an ``alloc_curve``)."""
        return curve_seconds(self.alloc_curve, nbytes) if self.alloc_curve and nbytes else 0.0

    def __repr__(self) -> str:
        parts = [repr({k: float(v) for k, v in self.axis_weights})]
        if self.latency:
            parts.append(f"latency={dict(self.latency)!r}")
        if self.per_byte:
            parts.append(f"per_byte={dict(self.per_byte)!r}")
        if self.copy_per_byte is not None:
            parts.append(f"copy_per_byte={self.copy_per_byte!r}")
        if self.curves:
            parts.append(f"curves={ {axis: dict(table) for axis, table in self.curves}!r}")
        if self.copy_curve:
            parts.append(f"copy_curve={self.copy_curve!r}")
        if self.alloc_curve:
            parts.append(f"alloc_curve={self.alloc_curve!r}")
        overhead = self.collective_overhead
        if overhead != DEFAULT_COLLECTIVE_OVERHEAD:
            shown = overhead if isinstance(overhead, int) else dict(zip(COMMUNICATING, overhead))
            parts.append(f"collective_overhead={shown!r}")
        return f"CostModel({', '.join(parts)})"


def _overhead(
    overhead: Any, latency: tuple[tuple[Any, float], ...], per_byte: tuple[tuple[Any, float], ...]
) -> Overhead:
    """:attr:`CostModel.collective_overhead` validated: whole bytes, one int where every kind
    costs the same (the planner's caches key on it), else one per kind in COMMUNICATING's order."""
    fix = 'pass bytes per collective >= 0, e.g. 3072, or per kind, e.g. {"all-gather": 3072, "all-to-all": 3072}'
    if latency and per_byte:
        measured = round(max(t for _, t in latency) / max(t for _, t in per_byte))
        defaults = dict.fromkeys(COMMUNICATING, measured)
    else:
        defaults = dict(zip(COMMUNICATING, DEFAULT_COLLECTIVE_OVERHEAD))
    if overhead is None:
        overhead = defaults
    table = overhead if isinstance(overhead, Mapping) else dict.fromkeys(COMMUNICATING, overhead)
    for kind, value in table.items():
        if kind not in COMMUNICATING:
            raise InferenceError("collective_overhead", dict(table), f"{kind!r} is not a collective kind", fix)
        if isinstance(value, bool) or not isinstance(value, Real):
            raise ArgumentTypeError("collective_overhead", overhead, f"{value!r} is not a number of bytes", fix)
        if not (math.isfinite(value) and value >= 0):
            raise InferenceError(
                "collective_overhead", overhead, f"{value!r} is not a finite non-negative number of bytes", fix
            )
    figures = tuple(round(table[kind]) if kind in table else defaults[kind] for kind in COMMUNICATING)
    return figures[0] if len(set(figures)) == 1 else figures  # type: ignore[return-value]


def overhead_of(overhead: Overhead, kind: str) -> int:
    """The bytes ``overhead`` charges a collective of ``kind`` (one of COMMUNICATING)."""
    return overhead if isinstance(overhead, int) else overhead[COMMUNICATING.index(kind)]


def _slope(curve: Curve) -> float:
    """Per-byte seconds of a curve's largest messages (its last segment; positive)."""
    (x0, t0), (x1, t1) = curve[-2:] if len(curve) > 1 else ((0.0, 0.0), curve[-1])
    return max((t1 - t0) / (x1 - x0), 1e-15)


def _kind_curve(table: tuple[tuple[str, Curve], ...], kind: str | None) -> Curve:
    curves = dict(table)
    return curves.get(kind or COLLECTIVE_PERMUTE) or curves.get(COLLECTIVE_PERMUTE) or next(iter(curves.values()))


def _curve(argument: str, points: Any) -> Curve:
    """A curve: (bytes, seconds) pairs of non-negative finite numbers, bytes increasing."""
    fix = "pass e.g. [(4096, 2e-5), (4194304, 1e-3)] (bytes sent per device, seconds), bytes increasing"
    try:
        curve = tuple((float(x), float(t)) for x, t in points)
    except (TypeError, ValueError):
        raise ArgumentTypeError(argument, points, "expected (bytes, seconds) pairs", fix) from None
    if not curve or any(not (math.isfinite(v) and v >= 0) for p in curve for v in p) or any(
        b[0] <= a[0] for a, b in zip(curve, curve[1:])
    ):
        raise ArgumentTypeError(argument, points, "expected non-negative (bytes, seconds) pairs, bytes increasing", fix)
    return curve


def _curve_table(curves: Any) -> tuple[tuple[Any, tuple[tuple[str, Curve], ...]], ...]:
    if curves is None:
        return ()
    if not isinstance(curves, Mapping) or not all(isinstance(t, Mapping) for t in curves.values()):
        raise ArgumentTypeError("curves", curves, "expected a mapping axis -> {collective kind: curve}",
                                'pass e.g. {"dp": {"all-gather": [(4096, 2e-5), (4194304, 1e-3)]}}')
    items = []
    for axis, table in curves.items():
        if isinstance(axis, bool) or not isinstance(axis, (str, int)):
            raise ArgumentTypeError("curves", dict(curves), f"key {axis!r} is not an axis name or index",
                                    'use e.g. "dp"')
        items.append((axis, tuple(sorted((str(kind), _curve("curves", points)) for kind, points in table.items()))))
    return tuple(sorted(items, key=lambda kv: (str(type(kv[0])), kv[0])))


def _axis_table(argument: str, table: Mapping[str | int, Real] | None, kind: type) -> tuple[tuple[Any, Any], ...]:
    """A mapping axis -> positive number, validated, as a sorted tuple."""
    if table is None:
        table = {}
    if not isinstance(table, Mapping):
        raise ArgumentTypeError(argument, table, "expected a mapping axis -> number", 'pass e.g. {"dp": 4}')
    items = []
    for axis, value in table.items():
        if isinstance(axis, bool) or not isinstance(axis, (str, int)):
            raise ArgumentTypeError(
                argument, dict(table), f"key {axis!r} is not an axis name or index", 'use e.g. "dp"'
            )
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
            raise ArgumentTypeError(
                argument, dict(table), f"value {value!r} of {axis!r} is not a positive number",
                "use positive finite numbers (weights: 1 = default speed; latency and per_byte: seconds)",
            )
        items.append((axis, kind(value)))
    return tuple(sorted(items, key=lambda kv: (str(type(kv[0])), kv[0])))


def _lookup(table: tuple[tuple[Any, Any], ...], mesh: DeviceMesh, mesh_dim: int, default: Any) -> Any:
    """A per-axis figure: by axis name first, then by mesh dim index, else ``default``."""
    values = dict(table)
    return values.get(mesh.axis_names[mesh_dim], values.get(mesh_dim, default))


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
