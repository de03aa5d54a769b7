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

    Chains of 1 and 4 dependent ppermutes are timed at 1 KiB and 4 MiB per device (the
    fastest of ``repeats`` samples: other load only adds time); the per-collective time at
    1 KiB is the latency, its growth up to 4 MiB divided by the bytes the per-byte time."""
    jmesh = mesh.to_jax()
    names = jmesh.axis_names
    spec = PartitionSpec(tuple(names))
    sizes = (1 << 10, 1 << 22)  # bytes per device
    latency: dict[Any, float] = {}
    per_byte: dict[Any, float] = {}
    for m, name in enumerate(names):
        n = mesh.shape[m]
        if n == 1:
            continue
        per_collective = []
        for nbytes in sizes:
            x = jax.device_put(np.zeros((mesh.size() * nbytes // 4,), np.float32), NamedSharding(jmesh, spec))
            times = []
            for count in (1, 4):
                f = jax.jit(jax.shard_map(_ring(name, n, count), mesh=jmesh, in_specs=spec, out_specs=spec))
                jax.block_until_ready(f(x))
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    y = x
                    for _ in range(3):
                        y = f(y)
                    jax.block_until_ready(y)
                    samples.append((time.perf_counter() - start) / 3)
                times.append(min(samples))
            per_collective.append(max((times[1] - times[0]) / 3, 1e-9))
        latency[name] = per_collective[0]
        per_byte[name] = max((per_collective[1] - per_collective[0]) / (sizes[1] - sizes[0]), 1e-15)
    return latency, per_byte


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
        jax.block_until_ready(f(x))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            y = x
            for _ in range(3):
                y = f(y)
            jax.block_until_ready(y)
            samples.append((time.perf_counter() - start) / 3)
        seconds.append(min(samples))
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
