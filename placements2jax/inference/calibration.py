"""Measuring the cost model's time curves on the current backend.

Kept apart from :mod:`.cost` (a pure model) because measuring runs programs; the model's
:meth:`~.cost.CostModel.calibrate` builds itself from what this module measures.

A collective's time is not one latency plus one per-byte figure at every size: on the
simulated CPU devices a small collective is a thread rendezvous (latency), a large one a
copy through memory whose per-byte time grows once the buffers leave the caches, and the
collectives differ (XLA's CPU all-reduce moves several times the bytes of a ring per
byte counted). So each kind of collective is timed at a few sizes and priced by a
*curve*: seconds per collective against the bytes each device sends, interpolated
linearly between the measured points (see :func:`fit_curve`).

Measuring is split from fitting so that the fit is testable without timing anything:
:func:`measure_curves` takes a ``timer(kind, axis, nbytes, count) -> seconds`` (by default
:func:`time_chain`, which runs a program of ``count`` dependent collectives) and fits what
it returns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["KINDS", "SIZES", "Curve", "fit_curve", "curve_seconds", "measure_curves", "measure_copy_curve",
           "measure_alloc_curve", "pool_latency", "sent_per_device"]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
SIZES = (1 << 12, 1 << 18, 1 << 22)  # operand bytes per device: 4 KiB, 256 KiB, 4 MiB
ALLOC_SIZES = (1 << 12, 1 << 24, 1 << 26)  # fresh bytes per device: 4 KiB, 16 MiB, 64 MiB

Curve = tuple[tuple[float, float], ...]  # (bytes sent per device, seconds), bytes increasing
Timer = Callable[[str, str, int, int], float]  # (kind, axis, operand bytes, collectives) -> seconds per call


def sent_per_device(kind: str, nbytes: int, n: int) -> float:
    """Bytes each device sends for one ``kind`` collective over ``n`` devices on an operand of
    ``nbytes`` per device (ring figures, as :mod:`.cost`): all-gather ``B(n-1)``, all-reduce
    ``2B(n-1)/n``, reduce-scatter ``B(n-1)/n``, all-to-all ``B(n-1)/n``, permute ``B``."""
    if kind == "all-gather":
        return float(nbytes * (n - 1))
    if kind == "all-reduce":
        return 2.0 * nbytes * (n - 1) / n
    if kind in ("reduce-scatter", "all-to-all"):
        return float(nbytes) * (n - 1) / n
    return float(nbytes)


def fit_curve(points: Sequence[tuple[float, Sequence[float]]]) -> Curve:
    """The curve through measured points: per size (bytes sent), the median of its samples
    of seconds per collective, made non-decreasing in bytes (a larger message never takes
    less time: a lower figure at a larger size is noise, lifted to its predecessor's).
    Sizes are sorted; every figure is at least 1 ns."""
    ordered = sorted((float(x), max(statistics.median(samples), 1e-9)) for x, samples in points)
    curve: list[tuple[float, float]] = []
    for x, seconds in ordered:
        if curve and x == curve[-1][0]:
            continue
        curve.append((x, max(seconds, curve[-1][1]) if curve else seconds))
    return tuple(curve)


def curve_seconds(curve: Curve, nbytes: float) -> float:
    """Seconds of one collective sending ``nbytes`` per device under ``curve``: the first
    point's time below it (latency dominates there), linear interpolation between points,
    and past the last point the last segment's per-byte time (the bandwidth of the largest
    messages; the average per-byte time of the whole curve if that segment is flat)."""
    if not curve:
        return 0.0
    if nbytes <= curve[0][0] or len(curve) == 1:
        return curve[0][1] if nbytes <= curve[0][0] else curve[0][1] * nbytes / curve[0][0]
    for (x0, t0), (x1, t1) in zip(curve, curve[1:]):
        if nbytes <= x1:  # (clamped: rounding must not lift a point above the next)
            return min(t1, max(t0, t0 + (t1 - t0) * (nbytes - x0) / (x1 - x0)))
    (x0, t0), (x1, t1) = curve[-2], curve[-1]
    slope = (t1 - t0) / (x1 - x0)
    if slope <= 0:
        slope = (t1 - curve[0][1]) / (x1 - curve[0][0]) if t1 > curve[0][1] else t1 / x1
    return t1 + slope * (nbytes - x1)


def measure_curves(
    mesh: Any, *, repeats: int = 5, sizes: Sequence[int] = SIZES, timer: Timer | None = None,
    kinds: Sequence[str] = KINDS,
) -> dict[str, dict[str, Curve]]:
    """Per mesh dim of ``mesh`` (by name, dims of size 1 left out) and per collective kind,
    the curve of seconds per collective against bytes sent per device.

    At each operand size, ``repeats`` pairs of programs (a chain of ``count`` dependent
    collectives and a chain of one; longer chains for smaller sizes, :func:`_chain`) are
    timed back to back; each pair's difference over the difference in collectives is one
    sample (the launch cost cancels, and load that slows both programs of a pair mostly
    cancels too), and the curve takes their median (:func:`fit_curve`)."""
    timer = timer or time_chain_on(mesh)
    result: dict[str, dict[str, Curve]] = {}
    for m, name in enumerate(mesh.axis_names):
        n = mesh.shape[m]
        if n == 1:
            continue
        result[name] = {}
        for kind in kinds:
            points = []
            for nbytes in sizes:
                count = _chain(nbytes)
                samples = [(timer(kind, name, nbytes, count) - timer(kind, name, nbytes, 1)) / (count - 1)
                           for _ in range(repeats)]
                points.append((sent_per_device(kind, nbytes, n), samples))
            result[name][kind] = fit_curve(points)
        result[name] = pool_latency(result[name])
    return result


def pool_latency(curves: dict[str, Curve]) -> dict[str, Curve]:
    """The curves with one latency: every kind's smallest-size time replaced by the median
    of them all (later points lifted to it if below). At the smallest size the kinds differ
    by less than the noise of a loaded machine (a rendezvous each), and a latency drawn high
    by chance would decide between schedules of small tensors on noise alone."""
    if not curves:
        return curves
    latency = statistics.median(curve[0][1] for curve in curves.values())
    return {kind: tuple((x, max(t, latency) if i else latency) for i, (x, t) in enumerate(curve))
            for kind, curve in curves.items()}


def _chain(nbytes: int) -> int:
    """Collectives in the long chain at ``nbytes``: 9 below 64 KiB (a small collective's
    time is near the noise), 5 below 1 MiB, else 2 (each already takes milliseconds)."""
    return 9 if nbytes < 1 << 16 else 5 if nbytes < 1 << 20 else 3


def measure_copy_curve(
    mesh: Any, *, repeats: int = 5, sizes: Sequence[int] = SIZES, timer: Timer | None = None
) -> Curve:
    """Seconds a device takes to copy ``nbytes`` of its block locally (in contiguous parts,
    as a schedule packs cells into messages and writes received cells in place), with
    every device of ``mesh`` copying at once as in a schedule: the curve through
    ``(0, 0)`` and, at each size, the median chain difference (as :func:`measure_curves`,
    kind ``"copy"``: a loop of copies, which XLA cannot fuse into one)."""
    timer = timer or time_chain_on(mesh)
    axis = mesh.axis_names[0]
    points = []
    for nbytes in sizes:
        count = _chain(nbytes)
        points.append((float(nbytes), [(timer("copy", axis, nbytes, count) - timer("copy", axis, nbytes, 1))
                                       / (count - 1) for _ in range(repeats)]))
    return ((0.0, 0.0),) + fit_curve(points)


def measure_alloc_curve(
    mesh: Any, copy_curve: Curve, *, repeats: int = 3, sizes: Sequence[int] = ALLOC_SIZES,
    timer: Timer | None = None,
) -> Curve:
    """Seconds a program takes to allocate ``nbytes`` of fresh buffers per device (its
    output and temporaries), with every device of ``mesh`` allocating at once.

    On the CPU backend this is what large moves cost most: buffers beyond the allocator's
    reuse threshold (32 MiB in glibc) are mapped fresh by every call and every page faults
    when first written, so a program's time grows with its temporaries rather than with the
    bytes it sends (docs/redistribute.md). One copy into a fresh output is timed per size
    (kind ``"fresh"``, one call each), ``repeats`` times in rounds over the sizes; a
    size's figure is the median of its time minus the smallest size's in the same round,
    less the copy itself (``copy_curve``). The curve goes through ``(0, 0)``."""
    timer = timer or time_chain_on(mesh)
    axis = mesh.axis_names[0]
    base = min(sizes)
    rounds = [{nbytes: timer("fresh", axis, nbytes, 1) for nbytes in sorted(sizes)} for _ in range(repeats)]
    points = [(float(nbytes), [r[nbytes] - r[base] - curve_seconds(copy_curve, nbytes) for r in rounds])
              for nbytes in sorted(sizes) if nbytes != base]
    return ((0.0, 0.0),) + fit_curve(points)


# -- timing programs ------------------------------------------------------------------


def time_chain_on(mesh: Any) -> Timer:
    """:func:`time_chain` on ``mesh``: one program per kind, axis and size, compiled once,
    whose number of collectives is an argument (a loop: one compile serves every chain)."""
    programs: dict[tuple[str, str, int], tuple[Callable[..., jax.Array], jax.Array]] = {}

    def timer(kind: str, axis: str, nbytes: int, count: int) -> float:
        key = (kind, axis, nbytes)
        if key not in programs:
            programs[key] = _chain_program(mesh, kind, axis, nbytes)
        f, x = programs[key]
        return time_chain(lambda x: f(x, np.int32(count)), x)

    return timer


def time_chain(f: Callable[[jax.Array], jax.Array], x: jax.Array) -> float:
    """Seconds of one call of ``f(x)`` (compiled and warmed when first timed), blocked on."""
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    return time.perf_counter() - start


def _placed(mesh: Any, nbytes: int) -> tuple[Any, PartitionSpec, jax.Array]:
    jmesh = mesh.to_jax()
    spec = PartitionSpec(tuple(jmesh.axis_names))
    x = jax.device_put(np.zeros((mesh.size() * nbytes // 4,), np.float32), NamedSharding(jmesh, spec))
    return jmesh, spec, x


def _chain_program(mesh: Any, kind: str, axis: str, nbytes: int) -> tuple[Callable[..., jax.Array], jax.Array]:
    """``f(x, count)``: ``count`` dependent ``kind`` collectives along ``axis``, compiled and warmed."""
    jmesh, spec, x = _placed(mesh, nbytes)
    n = mesh.shape[mesh.axis_names.index(axis)]
    step = _STEPS[kind]

    def body(x: jax.Array, count: jax.Array) -> jax.Array:
        if kind == "fresh":  # one copy into the output, no loop state: one fresh buffer
            return step(x, axis, n, 0)
        return jax.lax.fori_loop(0, count, lambda i, x: step(x, axis, n, i) + 1, x)

    f = jax.jit(jax.shard_map(body, mesh=jmesh, in_specs=(spec, PartitionSpec()), out_specs=spec, check_vma=False))
    jax.block_until_ready(f(x, np.int32(1)))  # compile and warm
    return f, x


def _block_copy(x: jax.Array) -> jax.Array:
    """The block rotated by one sixteenth: two contiguous copies of its parts, as a
    schedule moves cells (slices and in-place updates; a real copy: a rotation cannot
    alias its input)."""
    k = x.shape[0] // 16
    return jnp.concatenate([x[k:], x[:k]])


# One collective of each kind on a device's operand (1-d, ``nbytes``), keeping its shape so
# that collectives chain: the all-gather's result is cut back to one block (step i's: XLA
# cannot drop the rest), the reduce-scatter's tiled back.
_STEPS: dict[str, Callable[[jax.Array, str, int, int], jax.Array]] = {
    "all-gather": lambda x, a, n, i: jax.lax.dynamic_index_in_dim(
        jax.lax.all_gather(x, a, tiled=True).reshape(n, -1), i % n, keepdims=False),
    "all-reduce": lambda x, a, n, i: jax.lax.psum(x, a),
    "reduce-scatter": lambda x, a, n, i: jnp.tile(jax.lax.psum_scatter(x, a, tiled=True), n),
    "all-to-all": lambda x, a, n, i: jax.lax.all_to_all(x.reshape(n, -1), a, 0, 0, tiled=True).reshape(-1),
    "collective-permute": lambda x, a, n, i: jax.lax.ppermute(x, a, perm=[(j, (j + 1) % n) for j in range(n)]),
    "copy": lambda x, a, n, i: _block_copy(x),
    "fresh": lambda x, a, n, i: _block_copy(x),  # see _chain_program
}
