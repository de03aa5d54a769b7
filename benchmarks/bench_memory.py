"""5. Peak temporary memory of each redistribution (XLA's ``memory_analysis``) against
the local shard sizes: no move between two sharded layouts may materialize the full
tensor; XLA's reshard and the schedules of the "min_bytes" and default policies side by
side."""

from __future__ import annotations

from typing import Any

import numpy as np
from catalogue import Move, moves
from harness import Config, Section, Table, Target, progress

SCHEDULE_POLICIES = ("min_bytes", "cost")


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.0f}"


def peak_bytes(analysis: Any) -> int:
    """Per device, the most a program holds at once by XLA's ``memory_analysis``: its
    argument, its output and its temporaries (less what the output aliases)."""
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
            - analysis.alias_size_in_bytes)


def _sent(move: Move, policy: str) -> str:
    """Bytes each device sends under ``policy``, as a fraction of the tensor's bytes T."""
    return f"{float(move.schedule(policy).nbytes / (int(np.prod(move.shape)) * move.itemsize)):.3f}"


def schedule_memory(move: Move, policy: str) -> tuple[str, Any]:
    """The name of the schedule ``policy`` runs for ``move`` and its compiled memory analysis."""
    schedule = move.schedule(policy)
    return schedule.name, schedule.jitted.lower(move.argument()).compile().memory_analysis()


def run(config: Config) -> Section:
    section = Section(
        "memory",
        "5. Temporary memory of each redistribution",
        """
From `compiled.memory_analysis()` of the program `DTensor.redistribute` runs (and of the
direct-JAX reshard, for comparison), per device, for every move of the catalogue (medium
shapes, int32, full tensor = 4096 KiB): `argument` = the source's local block, `output` = the
target's, `temp` = XLA's scratch buffers (`temp_size_in_bytes`). A move is **between sharded
layouts** when both local blocks are smaller than the full tensor (a Partial source's block
is full-size: each rank holds a whole partial value); for those, a temp of the full tensor's
size or more would mean the full tensor was materialized somewhere. The second table puts
the schedules side by side (`placements2jax.schedules`: the one `policy="min_bytes"` runs and
the one the default policy runs), each compiled on its own: **peak** = argument + output +
temp - aliased bytes per device; **sent** = bytes each device sends, as a fraction of the
tensor's bytes T (benchmark 4), so memory and communication sit side by side.
""",
    )
    rows = []
    schedule_rows = []
    schedule_flagged = []
    peak_ratios: list[tuple[float, str]] = []
    flagged = []
    sharded_moves = 0
    worst = (0.0, "")
    full_temps = []
    for move in moves("medium", config.quick):
        progress(f"  memory {move.mesh_text} {move.label}")
        full = int(np.prod(move.shape)) * move.itemsize
        ours = move.compiled_ours.memory_analysis()
        direct = move.compiled_direct.memory_analysis()
        sharded = ours.argument_size_in_bytes < full and ours.output_size_in_bytes < full
        sharded_moves += sharded
        materializes = sharded and ours.temp_size_in_bytes >= full
        if materializes:
            flagged.append(f"{move.mesh_text} {move.label}")
        largest_local = max(ours.argument_size_in_bytes, ours.output_size_in_bytes)
        if sharded:
            worst = max(worst, (ours.temp_size_in_bytes / largest_local, f"{move.mesh_text} {move.label}"))
        elif ours.temp_size_in_bytes >= full:
            full_temps.append(f"{move.mesh_text} {move.label}")
        xla_peak = peak_bytes(ours)
        row: list[str] = [move.mesh_text, move.label, _sent(move, "xla"), _kib(xla_peak)]
        for policy in SCHEDULE_POLICIES:
            name, analysis = schedule_memory(move, policy)
            if sharded and analysis.temp_size_in_bytes >= full:
                schedule_flagged.append(f"{move.mesh_text} {move.label} ({policy}: {name})")
            peak_ratios.append((peak_bytes(analysis) / xla_peak, f"{move.mesh_text} {move.label} ({name})"))
            row += [name, _sent(move, policy), _kib(analysis.temp_size_in_bytes), _kib(peak_bytes(analysis))]
        schedule_rows.append(tuple(row))
        rows.append(
            (
                move.mesh_text,
                move.label,
                _kib(ours.argument_size_in_bytes),
                _kib(ours.output_size_in_bytes),
                _kib(ours.temp_size_in_bytes),
                f"{ours.temp_size_in_bytes / largest_local:.2f}",
                _kib(direct.temp_size_in_bytes),
                "yes" if sharded else "no",
                "**FULL TENSOR**" if materializes else "",
            )
        )
    section.tables.append(
        Table(
            "Per-device memory (KiB)",
            ("mesh", "move", "argument", "output", "temp", "temp / larger local block", "direct JAX temp",
             "sharded -> sharded", "flag"),
            tuple(rows),
        )
    )
    section.tables.append(
        Table(
            "Schedules: bytes sent (T per device) beside per-device temp and peak memory (KiB)",
            ("mesh", "move", "XLA reshard sent", "XLA reshard peak", "min_bytes schedule", "min_bytes sent",
             "min_bytes temp", "min_bytes peak", "default schedule", "default sent", "default temp",
             "default peak"),
            tuple(schedule_rows),
        )
    )
    highest = max(peak_ratios)
    section.notes.append(
        f"Schedules against XLA's reshard: peak ratio {min(peak_ratios)[0]:.2f}x-{highest[0]:.2f}x "
        f"(highest: {highest[1]}). A direct schedule's temps are its staging buffers, none of them the "
        "tensor: the source block cut into cells, the packed and the received messages and the target "
        "block; ppermute rounds write every received cell into the target block (plus one spare cell) in "
        "place, all_to_alls gather it from the local and received cells at once (faster on small blocks)"
        + (f"; flagged above: {', '.join(schedule_flagged)}." if schedule_flagged else
           "; none reaches the full tensor's size between sharded layouts.")
    )
    section.notes.append(
        f"Between sharded layouts the largest temp is {worst[0]:.2f}x the larger local block ({worst[1]}): "
        "XLA's all-to-all and collective-permute stage the blocks they send and receive. Temps of the full "
        "tensor's size occur only where one side's block is the full tensor anyway: "
        + (", ".join(full_temps) or "none")
        + " (a Partial source all-reduced before the local slice, since CPU XLA has no reduce-scatter; "
        "an all-gather along a non-leading dim, gathered along dim 0 and transposed into place)."
    )
    section.notes.append(
        "Every temp equals the direct-JAX reshard's: the programs are the same XLA reshards (benchmark 4)."
        if all(r[4] == r[6] for r in rows)
        else "Temps that differ from the direct-JAX reshard's: "
        + ", ".join(f"{r[0]} {r[1]} ({r[4]} vs {r[6]} KiB)" for r in rows if r[4] != r[6])
    )
    section.targets.append(
        Target(
            "no move between sharded layouts materializes the full tensor",
            f"{len(flagged)} of {sharded_moves} such moves" + (f": {', '.join(flagged)}" if flagged else ""),
            "0",
            not flagged,
        )
    )
    section.targets.append(
        Target(
            "no schedule (min_bytes or default policy) materializes the full tensor between sharded layouts",
            f"{len(schedule_flagged)} of {sharded_moves} such moves"
            + (f": {', '.join(schedule_flagged)}" if schedule_flagged else ""),
            "0",
            not schedule_flagged,
        )
    )
    return section
