"""One process of the two-process test (tests/test_multiprocess.py); not collected by pytest.

Usage: ``python tests/_multiprocess_worker.py PROCESS_ID PORT``. Each process owns 4 CPU
devices; together they form 8 global devices (ranks 0-3 on process 0, 4-7 on process 1).
Every check builds DTensors from this process's local shards only (``from_local`` with a
mapping of its own ranks), moves them across the process boundary and compares every own
rank's ``to_local`` and the ``full_tensor`` with NumPy. The last stdout line is
``RESULT <json>`` listing the checks that passed; any failure exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from placements2jax import (  # noqa: E402
    DeviceMesh,
    DTensor,
    Layout,
    MeshError,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    redistribute_collectives,
    resolve_layout,
)

PROCESS = int(sys.argv[1])
X = (np.arange(13 * 6, dtype=np.int32).reshape(13, 6) * 7) % 23 - 11  # 13 rows: uneven over 2, 4 and 8
passed: list[str] = []


def own_ranks(mesh: DeviceMesh) -> list[int]:
    return [r for r in mesh.rank_list if mesh.device(r).process_index == PROCESS]


def blocks(layout: Layout, x: np.ndarray) -> dict[int, np.ndarray]:
    """torch.chunk blocks of this process's ranks (for a layout without Partial)."""
    return {r: x[layout.local_slices(x.shape, r)] for r in own_ranks(layout.mesh)}


def assert_holds(dtensor: DTensor, x: np.ndarray, name: str) -> None:
    """Every own rank's to_local (partial values excepted) and the full tensor equal NumPy's,
    and the physical array gathered from both processes holds the same logical tensor."""
    layout = dtensor.layout
    assert dtensor.shape == x.shape and dtensor.dtype == x.dtype, (name, dtensor)
    if not layout.has_partial:
        for rank, block in blocks(layout, x).items():
            np.testing.assert_array_equal(np.asarray(dtensor.to_local(rank)), block, err_msg=f"{name} rank {rank}")
    assert sorted(dtensor.local_shards()) == sorted(own_ranks(layout.mesh)), name
    full = dtensor.full_tensor()
    assert full.is_fully_replicated and not full.is_fully_addressable, name
    np.testing.assert_array_equal(np.asarray(full), x, err_msg=f"{name} full_tensor")
    np.testing.assert_array_equal(np.asarray(dtensor), x, err_msg=f"{name} __array__")
    if not layout.has_partial and not dtensor.physical.is_padded:
        gathered = multihost_utils.process_allgather(dtensor.to_jax(), tiled=True)
        np.testing.assert_array_equal(gathered, x, err_msg=f"{name} process_allgather")
    passed.append(name)


def foreign_rank_is_refused(dtensor: DTensor) -> None:
    foreign = next(r for r in dtensor.device_mesh.rank_list if r not in own_ranks(dtensor.device_mesh))
    try:
        dtensor.to_local(foreign)
    except MeshError as error:
        assert f"rank={foreign}" in str(error) and "Fix:" in str(error)
    else:
        raise AssertionError("to_local of another process's rank did not raise")
    passed.append("foreign rank refused")


def main() -> None:
    jax.distributed.initialize(
        coordinator_address=f"localhost:{sys.argv[2]}", num_processes=2, process_id=PROCESS, initialization_timeout=60
    )
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    line = init_device_mesh((8,), ("x",))
    grid = init_device_mesh((2, 4), ("dp", "tp"))  # dp crosses the process boundary, tp does not
    across = DeviceMesh([[0, 4], [1, 5], [2, 6], [3, 7]], ("a", "b"))  # b crosses it
    shuffled = DeviceMesh([[5, 2, 7, 0], [3, 6, 1, 4]], ("p", "q"))  # both axes cross it
    auto = init_device_mesh((2, 4), ("dp", "tp"), axis_types="auto")

    assert line.calling_rank() == 4 * PROCESS and grid.get_coordinate() == (PROCESS, 0)
    assert grid["tp"].rank_list == tuple(range(4 * PROCESS, 4 * PROCESS + 4))
    passed.append("calling rank")

    # Shard(0) -> Replicate, Shard(0) -> Shard(1), and back: 13 rows over 8 ranks (uneven, empty shards).
    s0 = resolve_layout(line, "S(0)", 2)
    dt = DTensor.from_local(blocks(s0, X), line, "S(0)")
    assert_holds(dt, X, "from_local S(0) uneven")
    assert_holds(dt.redistribute(placements="R"), X, "S(0) -> R")
    s1 = dt.redistribute(placements="S(1)")
    assert_holds(s1, X, "S(0) -> S(1)")
    assert_holds(s1.redistribute(placements="S(0)"), X, "S(1) -> S(0)")
    assert_holds(jax.jit(lambda d: d.redistribute(placements=[Shard(1)]))(dt), X, "S(0) -> S(1) under jit")
    assert [c.op for c in redistribute_collectives(dt, "R")] == ["all-gather"]
    passed.append("collectives of S(0) -> R")
    foreign_rank_is_refused(dt)
    assert_holds(dt.redistribute(grid, "S(1),S(0)"), X, "S(0) on (8,) -> S(1),S(0) on (2, 4)")
    assert_holds(dt.redistribute(shuffled, "S(0),R"), X, "S(0) on (8,) -> S(0),R on a shuffled mesh")

    # Partial(sum) over the process boundary -> Shard: dp coordinate 0 holds x - d, coordinate 1 holds d.
    layout = resolve_layout(grid, [Partial(), Shard(1)], 2)
    delta = (np.arange(X.size, dtype=np.int32).reshape(X.shape) % 5) * 3
    plain = resolve_layout(grid, [Replicate(), Shard(1)], 2)
    partial_locals = {
        r: block - delta[plain.local_slices(X.shape, r)]
        if grid.get_coordinate(r)[0] == 0
        else delta[plain.local_slices(X.shape, r)]
        for r, block in blocks(plain, X).items()
    }
    dtp = DTensor.from_local(partial_locals, grid, [Partial(), Shard(1)])
    assert dtp.layout == layout
    for rank, local in partial_locals.items():
        np.testing.assert_array_equal(np.asarray(dtp.to_local(rank)), local)
    assert_holds(dtp, X, "from_local P,S(1)")
    assert_holds(dtp.redistribute(placements=[Shard(0), Shard(1)]), X, "P,S(1) -> S(0),S(1)")
    assert_holds(dtp.redistribute(placements=[Replicate(), Shard(0)]), X, "P,S(1) -> R,S(0)")

    # Partial(max) and Partial(avg) (stacked representation) over the process boundary.
    mask = (np.arange(X.size).reshape(X.shape) % 3) == 0
    replicated = {r: X for r in own_ranks(grid)}
    maxima = {r: np.where(mask == (grid.get_coordinate(r)[0] == 0), x, x - 9) for r, x in replicated.items()}
    dtm = DTensor.from_local(maxima, grid, [Partial("max"), Replicate()])
    assert_holds(dtm.redistribute(placements=[Shard(0), Replicate()]), X, "P(max),R -> S(0),R")
    averages = {r: x.astype(np.float32) + (4 if grid.get_coordinate(r)[0] == 0 else -4) for r, x in replicated.items()}
    dta = DTensor.from_local(averages, grid, [Partial("avg"), Replicate()])
    assert_holds(dta.redistribute(placements=[Replicate(), Shard(0)]), X.astype(np.float32), "P(avg),R -> R,S(0)")

    # Auto axes: Partial(sum) is stacked there.
    auto_locals = {r: X if auto.get_coordinate(r)[0] == 0 else np.zeros_like(X) for r in own_ranks(auto)}
    dt_auto = DTensor.from_local(auto_locals, auto, [Partial(), Replicate()])
    assert_holds(dt_auto.redistribute(placements=[Shard(1), Shard(0)]), X, "auto mesh P,R -> S(1),S(0)")

    # Alias form with a dim split by both axes of meshes whose axes cross the boundary.
    for mesh, names in ((across, ("a", "b")), (shuffled, ("q", "p"))):
        nested = Layout.from_device_mesh(mesh)((names, None))
        dtn = DTensor.from_local(blocks(nested, X), mesh, (names, None))
        assert_holds(dtn, X, f"from_local {names} on {mesh.rank_list}")
        assert_holds(dtn.redistribute(placements=(names[1], names[0])), X, f"{names} -> split both dims")
        assert_holds(dtn.redistribute(placements=(None, names)), X, f"{names} -> dim 1 by both axes")

    # distribute_tensor from the same host data in both processes, then a dim swap.
    both = distribute_tensor(X, grid, "S(0),S(1)")
    assert_holds(both, X, "distribute_tensor S(0),S(1)")
    assert_holds(both.redistribute(placements="S(1),S(0)"), X, "S(0),S(1) -> S(1),S(0)")
    even = distribute_tensor(X[:8], line, "S(0)")
    assert_holds(even.redistribute(placements="S(1)"), X[:8], "even S(0) -> S(1)")

    print("RESULT " + json.dumps({"process": PROCESS, "passed": passed}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
