"""3. redistribute vs the same reshard written directly in JAX, warm, for every move of
the catalogue."""

from __future__ import annotations

import jax
import numpy as np
from catalogue import Move, moves
from harness import Comparison, Config, Section, Table, compare, microseconds, progress, within

from placements2jax import DTensor

LIMIT = 1.1


def _check(move: Move, ours: DTensor, direct: jax.Array) -> None:
    """Both sides land the tensor exactly (int32 data, partial sources non-uniform)."""
    expected = move.data()
    assert ours.layout == move.dst_layout, (move.label, ours.layout)
    np.testing.assert_array_equal(np.asarray(ours.full_tensor()), expected, err_msg=move.label)
    theirs = DTensor(direct, move.dst_layout, move.shape)
    np.testing.assert_array_equal(np.asarray(theirs.full_tensor()), expected, err_msg=f"direct JAX {move.label}")


def measure(move: Move, config: Config) -> Comparison:
    dtensor = move.dtensor()
    mesh, placements, direct = move.mesh, move.dst_placements, move.direct_jax
    _check(move, dtensor.redistribute(mesh, placements), direct(dtensor.array))

    def ours() -> jax.Array:
        return jax.block_until_ready(dtensor.redistribute(mesh, placements).array)

    def baseline() -> jax.Array:
        return jax.block_until_ready(direct(dtensor.array))

    return compare(ours, baseline, config)


def run(config: Config) -> Section:
    section = Section(
        "redistribute",
        "3. redistribute vs the same reshard written in JAX",
        """
**ours**: `dtensor.redistribute(mesh, placements)` (placements already parsed, as a program
passes them; the call returns a new DTensor). **baseline**: `f(dtensor.array)` with `f = jax.jit(lambda a:
jax.sharding.reshard(a, target_named_sharding))`, compiled beforehand; same input array, same
target sharding. Both warm (compiled, several calls before timing) and blocked on. Each move
is first checked to land exactly (int32 data; Partial(sum) sources hold x on one rank of
each partial group and 0 elsewhere, so misrouted partials would show) on both sides.
**small** tensors (16 KiB) measure dispatch; **medium** (4 MiB) the data movement. The
first call builds the target layout, checks the move and compiles the program; later calls
find the layout with `resolve_layout` (one dict lookup on the placements as given) and the
program in caches keyed by the interned layouts (a few µs of Python). The program is the same XLA
reshard as the baseline's (benchmark 4 compares their collectives, benchmark 5 their memory).
""",
    )
    sizes = ("small",) if config.quick else ("small", "medium")
    for size in sizes:
        rows = []
        results = []
        for move in moves(size, config.quick):
            progress(f"  redistribute {size} {move.mesh_text} {move.label}")
            result = measure(move, config)
            results.append(result)
            rows.append(
                (
                    move.mesh_text,
                    str(move.shape),
                    move.kind,
                    move.label,
                    microseconds(result.ours_median),
                    microseconds(result.baseline_median),
                    result.ratio_text(),
                )
            )
        section.tables.append(
            Table(
                f"{size} tensors: ours / direct JAX (median of paired ratios, IQR)",
                ("mesh", "shape", "kind", "move", "ours (µs)", "direct JAX (µs)", "ratio"),
                tuple(rows),
            )
        )
        section.targets.append(within(f"{size}: redistribute within {LIMIT}x of direct JAX", results, LIMIT))
    return section
