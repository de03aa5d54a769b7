"""2. distribute_tensor vs jax.device_put on even shapes, and the cost of uneven shapes."""

from __future__ import annotations

import math
import statistics

import jax
import numpy as np
from catalogue import mesh_of, mesh_text
from harness import Comparison, Config, Section, Table, microseconds, paired, progress, time_each, within

from placements2jax import distribute_tensor, resolve_layout
from placements2jax.placements import parse_placements_or_alias

LIMIT = 1.1
# (mesh, placements); every one also measured on an uneven shape of about as many elements.
CASES = (
    ((8,), "S(0)"),
    ((8,), "R"),
    ((4, 2), "S(0),S(1)"),
    ((4, 2), "(a,b),None"),
    ((2, 2, 2), "S(0),S(1),R"),
)
EVEN = {"small": (64, 64), "medium": (1024, 1024)}
UNEVEN = {"small": (63, 65), "medium": (1023, 1025)}


def _measure(size: str, case: tuple[tuple[int, ...], str], config: Config) -> tuple[tuple[str, ...], Comparison]:
    mesh_shape, text = case
    mesh = mesh_of(mesh_shape)
    placements = parse_placements_or_alias(text)
    even, uneven = EVEN[size], UNEVEN[size]
    x = np.arange(math.prod(even), dtype=np.float32).reshape(even)
    y = np.arange(math.prod(uneven), dtype=np.float32).reshape(uneven)
    sharding = resolve_layout(mesh, placements, 2).named_sharding
    np.testing.assert_array_equal(np.asarray(distribute_tensor(y, mesh, placements).full_tensor()), y)

    def baseline() -> jax.Array:
        return jax.block_until_ready(jax.device_put(x, sharding))

    def ours() -> jax.Array:
        return jax.block_until_ready(distribute_tensor(x, mesh, placements).array)

    def ours_uneven() -> jax.Array:
        return jax.block_until_ready(distribute_tensor(y, mesh, placements).array)

    base_t, ours_t, uneven_t = time_each((baseline, ours, ours_uneven), config)
    even_r = paired(ours_t, base_t)
    per_element = math.prod(even) / math.prod(uneven)
    uneven_r = paired([u * per_element for u in uneven_t], ours_t)
    row = (
        mesh_text(mesh_shape),
        text,
        f"{even} / {uneven}",
        microseconds(even_r.baseline_median),
        microseconds(even_r.ours_median),
        even_r.ratio_text(),
        microseconds(statistics.median(uneven_t)),
        uneven_r.ratio_text(),
    )
    return row, even_r


def run(config: Config) -> Section:
    section = Section(
        "distribute",
        "2. distribute_tensor vs jax.device_put",
        """
A host NumPy array (float32) is laid out on the mesh. **baseline**: `jax.device_put(x,
NamedSharding(mesh, spec))` with the sharding built beforehand; **ours**:
`distribute_tensor(x, mesh, placements)` (placements parsed beforehand). Both blocked on.
**uneven**: a shape of about the same number of elements whose dims do not divide
(`(63, 65)` for `(64, 64)`, `(1023, 1025)` for `(1024, 1024)`): JAX cannot shard it, ours
builds the padded physical array on the host first (docs/semantics.md); the column
compares it with `distribute_tensor` of the even shape, per element (the ratio of the times
is scaled by the element counts).
""",
    )
    sizes = ("small",) if config.quick else ("small", "medium")
    cases = CASES[:2] if config.quick else CASES
    for size in sizes:
        rows = []
        even_results = []
        for case in cases:
            progress(f"  distribute {size} {case[0]} {case[1]}")
            row, even_r = _measure(size, case, config)
            rows.append(row)
            even_results.append(even_r)
        section.tables.append(
            Table(
                f"{size} tensors",
                ("mesh", "placements", "even / uneven shape", "device_put (µs)", "ours even (µs)",
                 "ours / device_put (even)", "ours uneven (µs)", "uneven / even (per element)"),
                tuple(rows),
            )
        )
        section.targets.append(
            within(f"{size}: distribute_tensor within {LIMIT}x of device_put (even shapes)", even_results, LIMIT)
        )
    return section
