"""5. Peak temporary memory of each redistribution (XLA's ``memory_analysis``) against
the local shard sizes: no move between two sharded layouts may materialize the full
tensor."""

from __future__ import annotations

import numpy as np
from catalogue import moves
from harness import Config, Section, Table, Target, progress


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.0f}"


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
size or more would mean the full tensor was materialized somewhere.
""",
    )
    rows = []
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
    return section
