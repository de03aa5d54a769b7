"""3. redistribute vs the same reshard written directly in JAX, warm, for every move of
the catalogue: the default (calibrated cost) policy and the "min_bytes" policy side by
side with XLA's reshard, with the bytes each sends."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from catalogue import Move, moves
from harness import Comparison, Config, Section, Table, Target, microseconds, paired, progress, time_each, within

from placements2jax import DTensor
from placements2jax.schedules import default_policy

LIMIT = 1.1
POLICIES = ("cost", "min_bytes")


def _check(move: Move, ours: DTensor, direct: jax.Array) -> None:
    """Both sides land the tensor exactly (int32 data, partial sources non-uniform)."""
    expected = move.data()
    assert ours.layout == move.dst_layout, (move.label, ours.layout)
    np.testing.assert_array_equal(np.asarray(ours.full_tensor()), expected, err_msg=move.label)
    theirs = DTensor(direct, move.dst_layout, move.shape)
    np.testing.assert_array_equal(np.asarray(theirs.full_tensor()), expected, err_msg=f"direct JAX {move.label}")


def measure(move: Move, config: Config) -> tuple[Comparison, Comparison]:
    """(default policy / direct JAX, min_bytes policy / direct JAX), timed together."""
    dtensor = move.dtensor()
    mesh, placements, direct = move.mesh, move.dst_placements, move.direct_jax
    for policy in POLICIES:
        _check(move, dtensor.redistribute(mesh, placements, policy=policy), direct(dtensor.array))

    def ours() -> jax.Array:
        return jax.block_until_ready(dtensor.redistribute(mesh, placements).array)

    def min_bytes() -> jax.Array:
        return jax.block_until_ready(dtensor.redistribute(mesh, placements, policy="min_bytes").array)

    def baseline() -> jax.Array:
        return jax.block_until_ready(direct(dtensor.array))

    ours_t, min_t, base_t = time_each((ours, min_bytes, baseline), config)
    return paired(ours_t, base_t), paired(min_t, base_t)


def _schedule_text(move: Move, policy: str) -> str:
    schedule = move.schedule(policy)
    xla = move.schedule("xla")
    ops = ", ".join(c.op for c in schedule.collectives) or "none"
    nbytes = "" if schedule.nbytes == xla.nbytes else f"; {float(schedule.nbytes / xla.nbytes):.2f}x XLA's bytes"
    return f"{schedule.name} ({ops}{nbytes})"


def run(config: Config) -> Section:
    section = Section(
        "redistribute",
        "3. redistribute vs the same reshard written in JAX",
        """
**ours**: `dtensor.redistribute(mesh, placements)` with the default policy (`"cost"`: the
schedule of least predicted time under the cost model calibrated on this backend,
`placements2jax.schedules`); **min_bytes**: the same call with `policy="min_bytes"` (the
schedule sending the fewest bytes). **baseline**: `f(dtensor.array)` with `f =
jax.jit(lambda a: jax.sharding.reshard(a, target_named_sharding))`, compiled beforehand;
same input array, same target sharding. The three are timed in one interleaved loop, warm
and blocked on; ratios are to the baseline. Each move is first checked to land exactly
(int32 data; Partial(sum) sources hold x on one rank of each partial group and 0
elsewhere, so misrouted partials would show) under both policies and the baseline.
**small** tensors (16 KiB) measure dispatch (a warm call finds the layout with `resolve_layout`
and the program in caches keyed by the interned layouts: a few µs of Python); **medium** (4 MiB) and **large** (64 MiB)
the data movement. Large tensors are timed only on the moves where the default policy runs
another schedule than XLA's reshard (elsewhere it runs the same XLA program as the
baseline, as the small and medium tables show; timing min_bytes on all 64 MiB moves takes
too long for `make bench`). The schedule column gives the chosen schedule, its collectives and
its bytes against XLA's reshard (benchmark 4 has the bytes against the lower bound).
""",
    )
    assert default_policy() == "cost", "benchmark 3 measures the default policy"
    sizes = ("small",) if config.quick else ("small", "medium", "large")
    for size in sizes:
        rows = []
        results: list[Comparison] = []
        faster: list[tuple[Move, Comparison]] = []
        selected = moves(size, config.quick)
        run_config = config
        if size == "large":
            selected = tuple(m for m in selected if m.schedule("cost").name != "xla")
            run_config = replace(config, repeats=min(config.repeats, 7), warmup=1)
        for move in selected:
            progress(f"  redistribute {size} {move.mesh_text} {move.label}")
            ours, min_bytes = measure(move, run_config)
            results.append(ours)
            if move.schedule("cost").nbytes < move.schedule("xla").nbytes:
                faster.append((move, ours))
            rows.append(
                (
                    move.mesh_text,
                    str(move.shape),
                    move.label,
                    _schedule_text(move, "cost"),
                    microseconds(ours.ours_median),
                    microseconds(ours.baseline_median),
                    ours.ratio_text(),
                    _schedule_text(move, "min_bytes"),
                    min_bytes.ratio_text(),
                )
            )
        section.tables.append(
            Table(
                f"{size} tensors: ours / direct JAX (median of paired ratios, IQR)",
                ("mesh", "shape", "move", "schedule (default policy)", "ours (µs)", "direct JAX (µs)", "ratio",
                 "schedule (min_bytes)", "min_bytes ratio"),
                tuple(rows),
            )
        )
        section.targets.append(within(f"{size}: default policy within {LIMIT}x of direct JAX", results, LIMIT))
        if faster:
            wins = [m for m, c in faster if c.spread[1] < 1]
            section.targets.append(
                Target(
                    f"{size}: default policy faster where it sends fewer bytes",
                    f"{len(wins)} of {len(faster)} moves faster (upper quartile < 1): "
                    + "; ".join(f"{m.mesh_text} {m.label} {c.ratio:.2f}x" for m, c in faster),
                    "all",
                    len(wins) == len(faster),
                )
            )
    return section
