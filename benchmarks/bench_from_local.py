"""9. DTensor.from_local (global shape inferred) vs jax.make_array_from_single_device_arrays."""

from __future__ import annotations

import jax
import numpy as np
from catalogue import mesh_of
from harness import Config, Section, Table, microseconds, time_each, paired, progress, within

from placements2jax import DTensor, resolve_layout

LIMIT = 1.2
ROWS = (1024, 8192, 65536, 524288)  # rows per rank (float32, 4 columns)
COLUMNS = 4


def _measure(rows: int, config: Config) -> tuple[tuple[str, ...], object]:
    mesh = mesh_of((8,))
    sharding = resolve_layout(mesh, "S(0)", 2).named_sharding
    rng = np.random.default_rng(rows)
    pieces = [rng.normal(size=(rows, COLUMNS)).astype(np.float32) for _ in mesh.rank_list]
    devices = [mesh.device(r) for r in mesh.rank_list]
    shape = (rows * len(pieces), COLUMNS)
    got = DTensor.from_local(pieces, mesh, "S(0)")
    assert got.shape == shape
    np.testing.assert_array_equal(np.asarray(got.to_local(3)), pieces[3])

    def baseline() -> jax.Array:
        arrays = [jax.device_put(p, d) for p, d in zip(pieces, devices)]
        return jax.block_until_ready(jax.make_array_from_single_device_arrays(shape, sharding, arrays))

    def ours() -> jax.Array:
        return jax.block_until_ready(DTensor.from_local(pieces, mesh, "S(0)").array)

    ours_t, base_t = time_each((ours, baseline), config)
    result = paired(ours_t, base_t)
    row = (f"{rows:,}", str(shape), microseconds(result.baseline_median), microseconds(result.ours_median),
           result.ratio_text())
    return row, result


def run(config: Config) -> Section:
    section = Section(
        "from_local",
        "9. from_local vs make_array_from_single_device_arrays",
        """
Eight host NumPy pieces of `(rows, 4)` float32, one per rank of an `(8,)` mesh, become one
array sharded on dim 0. **baseline**: `jax.device_put` of each piece to its device, then
`jax.make_array_from_single_device_arrays` with the `NamedSharding` built beforehand;
**ours**: `DTensor.from_local(pieces, mesh, "S(0)")` without `shape=`, so the global shape
is inferred (in closed form: the sum of the blocks along the split axes, then every rank
checked against torch.chunk of it; O(mesh size), independent of the extents).
""",
    )
    rows_list = (ROWS[0], ROWS[2]) if config.quick else ROWS
    rows_out, results = [], []
    for rows in rows_list:
        progress(f"  from_local {rows} rows per rank")
        row, result = _measure(rows, config)
        rows_out.append(row)
        results.append(result)
    section.tables.append(
        Table("S(0) on 8 ranks", ("rows per rank", "global shape", "baseline (µs)", "ours (µs)", "ours / baseline"),
              tuple(rows_out))
    )
    section.targets.append(within(f"from_local within {LIMIT}x of make_array_from_single_device_arrays", results, LIMIT))
    return section
