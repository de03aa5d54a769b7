"""Measuring the cost model's latency and per-byte terms on the current backend.

Kept apart from :mod:`.cost` (a pure model) because measuring runs programs; the model's
:meth:`~.cost.CostModel.calibrate` builds itself from what this module measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["measure", "measure_copy"]


def measure(mesh: Any, *, repeats: int = 5) -> tuple[dict[Any, float], dict[Any, float]]:
    """Per mesh dim of ``mesh`` (by name), the latency (seconds per collective) and the
    time per byte of a ``ppermute`` ring along that dim on the current backend.

    Programs of chains of dependent ppermutes are timed (the fastest of ``repeats``
    samples: other load only adds time). The latency is what a chain of 16 adds to a chain
    of 1 at 1 KiB per device, per collective; the per-byte time is what a chain of 4 at
    4 MiB adds to the same chain at 1 KiB, per collective and byte. Each figure is a
    difference of two programs with the same launch cost, made of many collectives so
    that it stands well above the noise of a loaded machine (with chains of 1 and 4 the
    latency came out near zero there, and small moves were priced by their bytes alone)."""
    jmesh = mesh.to_jax()
    names = jmesh.axis_names
    spec = PartitionSpec(tuple(names))
    small, large = 1 << 10, 1 << 22  # bytes per device
    latency: dict[Any, float] = {}
    per_byte: dict[Any, float] = {}
    for m, name in enumerate(names):
        n = mesh.shape[m]
        if n == 1:
            continue
        seconds = {}
        for nbytes, count in ((small, 1), (small, 16), (small, 4), (large, 4)):
            x = jax.device_put(np.zeros((mesh.size() * nbytes // 4,), np.float32), NamedSharding(jmesh, spec))
            f = jax.jit(jax.shard_map(_ring(name, n, count), mesh=jmesh, in_specs=spec, out_specs=spec))
            seconds[nbytes, count] = _fastest(f, x, repeats)
        latency[name] = max((seconds[small, 16] - seconds[small, 1]) / 15, 1e-9)
        per_byte[name] = max((seconds[large, 4] - seconds[small, 4]) / (4 * (large - small)), 1e-15)
    return latency, per_byte


def _fastest(f: Callable[[jax.Array], jax.Array], x: jax.Array, repeats: int) -> float:
    """Seconds per call of ``f`` (compiled and warmed first): the fastest of ``repeats``
    samples of 3 calls."""
    jax.block_until_ready(f(x))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        y = x
        for _ in range(3):
            y = f(y)
        jax.block_until_ready(y)
        samples.append((time.perf_counter() - start) / 3)
    return min(samples)


def measure_copy(mesh: Any, *, repeats: int = 5) -> float:
    """Seconds per byte a device takes to copy its block locally (reading and writing it
    in another order, as a schedule packs cells into messages), with every device of
    ``mesh`` copying at once as they do in a schedule.

    One transposing copy of 1 KiB and of 4 MiB per device is timed (the fastest of
    ``repeats`` samples); the growth in time over the growth in bytes is the per-byte
    time (the fixed cost of launching a program cancels out)."""
    jmesh = mesh.to_jax()
    spec = PartitionSpec(tuple(jmesh.axis_names))
    sizes = (1 << 10, 1 << 22)  # bytes per device
    seconds = []
    for nbytes in sizes:
        x = jax.device_put(np.zeros((mesh.size() * nbytes // 4,), np.float32), NamedSharding(jmesh, spec))
        f = jax.jit(jax.shard_map(_transpose_copy, mesh=jmesh, in_specs=spec, out_specs=spec))
        seconds.append(_fastest(f, x, repeats))
    return max((seconds[1] - seconds[0]) / (sizes[1] - sizes[0]), 1e-15)


def _transpose_copy(x: jax.Array) -> jax.Array:
    """The block read in column order and written in row order (a real copy: a transpose
    cannot alias its input)."""
    rows = 16
    return x.reshape(rows, -1).T.reshape(-1)


def _ring(name: str, n: int, count: int) -> Callable[[jax.Array], jax.Array]:
    """``count`` dependent ppermutes around the ring of mesh dim ``name``."""

    def body(x: jax.Array) -> jax.Array:
        for _ in range(count):
            x = jax.lax.ppermute(x, name, perm=[(i, (i + 1) % n) for i in range(n)]) + 1
        return x

    return body
