"""comm_debug(): the collectives of eager DTensor code, counted per operation and mesh axis
from the compiled programs, with bytes (torch's CommDebugMode API where it applies)."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import textwrap
from fractions import Fraction

import jax
import numpy as np
import pytest

from placements2jax import (
    ArgumentTypeError,
    CommDebugMode,
    apply,
    comm_debug,
    distribute_tensor,
    init_device_mesh,
    redistribute_collectives,
    resolve_layout,
)
from placements2jax.comm_mode import CommRecord
from placements2jax.inference.check import collective_nbytes

MESH = init_device_mesh((4, 2), ("dp", "tp"))
X = np.arange(16, dtype=np.float32).reshape(8, 2)


def test_a_gather_over_dp_is_one_all_gather_of_48_bytes() -> None:
    x = distribute_tensor(X, MESH, "S(0),R")
    with comm_debug() as comm:
        y = x.redistribute(MESH, "R,R")
    np.testing.assert_array_equal(np.asarray(y.to_local(5)), X)
    # each device gathers the f32[8, 2] (64 B) from 4 dp ranks: it sends 64 * 3/4 = 48 B
    assert comm.records == (CommRecord("redistribute", "all-gather", ("dp",), Fraction(48)),)
    assert comm.get_total_counts() == 1 and comm.get_comm_counts() == {"all-gather": 1}
    assert comm.get_total_bytes() == 48


def test_counts_are_what_xla_compiled_for_each_move() -> None:
    """The same collectives as redistribute_collectives for the same moves, per move."""
    moves = [("S(0),R", "R,S(0)"), ("P,R", "R,R"), ("P,S(0)", "S(1),R"), ("R,S(1)", "S(0),R")]
    for src, dst in moves:
        x = distribute_tensor(X, MESH, src)
        expected = redistribute_collectives(x, dst)
        with comm_debug() as comm:
            x.redistribute(MESH, dst)
        assert [(r.collective, r.nbytes) for r in comm.records] == [
            (c.op, collective_nbytes(c, 8)) for c in expected
        ], (src, dst)


def test_partial_sum_reduced_by_full_tensor_and_loops_counted_each_time() -> None:
    x = distribute_tensor(X, MESH, "S(0),R")
    with comm_debug() as comm:
        for _ in range(3):
            total = x.sum(dim=0, keepdim=True)  # Partial(sum) over dp: no communication
            total.full_tensor()  # one all-reduce over dp of f32[1, 2]: 2 * 8 * 3/4 = 12 B
    assert comm.counts() == {("full_tensor", "all-reduce", ("dp",)): (3, Fraction(36))}
    assert comm.get_comm_counts() == {"all-reduce": 3}


def test_operators_and_apply_are_counted_under_their_names() -> None:
    x = distribute_tensor(X, MESH, "S(0),R")
    w = distribute_tensor(np.ones((2, 4), np.float32), MESH, "R,S(0)")
    with comm_debug() as comm:
        (x @ w).full_tensor()
        apply(lambda u: (u * 2).sum(), x).full_tensor()
    operations = [r.operation for r in comm.records]
    assert "matmul" in operations and operations[-1] == "full_tensor"
    assert all(r.mesh_axes for r in comm.records)
    assert comm.get_total_counts() == len(comm.records) >= 3


def test_code_inside_jit_and_outside_the_context_is_not_counted() -> None:
    x = distribute_tensor(X, MESH, "S(0),R")
    with comm_debug() as comm:
        jax.jit(lambda d: d.redistribute(MESH, "R,R").to_jax())(x)
    assert comm.get_total_counts() == 0
    x.redistribute(MESH, "R,R")  # after the context
    assert comm.get_total_counts() == 0
    with comm_debug() as outer, comm_debug() as inner:  # nested modes both count
        x.redistribute(MESH, "R,R")
    assert outer.get_total_counts() == inner.get_total_counts() == 1


def test_the_table() -> None:
    x = distribute_tensor(X, MESH, "S(0),R")
    with comm_debug() as comm:
        x.redistribute(MESH, "R,R")
        x.redistribute(MESH, "R,R")
        distribute_tensor(X, MESH, "P,R").full_tensor()
    assert comm.table() == (
        "operation    | collective | mesh axes | count | bytes/device\n"
        "-------------+------------+-----------+-------+-------------\n"
        "redistribute | all-gather | dp        | 2     | 96\n"
        "full_tensor  | all-reduce | dp        | 1     | 96\n"
        "total: 3 collective(s), 192 B sent per device"
    )
    assert comm.generate_comm_debug_tracing_table() == comm.table()
    stream = io.StringIO()
    comm.print_table(stream)
    assert stream.getvalue() == comm.table() + "\n"
    assert repr(comm) == "CommDebugMode(3 collective(s))"
    assert CommDebugMode().table() == "total: 0 collective(s), 0 B sent per device"


def test_bad_uses() -> None:
    comm = comm_debug()
    with pytest.raises(ArgumentTypeError, match="file="):
        comm.print_table("out.txt")  # type: ignore[arg-type]
    with comm, pytest.raises(ArgumentTypeError, match="already counting"):
        comm.__enter__()


def test_to_jax_of_a_partial_and_a_move_to_another_mesh_count_their_reductions() -> None:
    x = distribute_tensor(X, MESH, "P,S(1)")
    other = init_device_mesh((8,), ("x",))
    with comm_debug() as comm:
        x.to_jax()  # reduces the partial over dp: one all-reduce
        x.redistribute(other, "S(0)")  # the reduction on this mesh, then a device_put
    assert [(r.operation, r.collective, r.mesh_axes) for r in comm.records] == [
        ("to_jax", "all-reduce", ("dp",)),
        ("redistribute", "all-reduce", ("dp",)),
    ]


def test_counts_agree_with_torchs_comm_debug_mode_on_one_axis_moves() -> None:
    """torch's CommDebugMode (fake process group, 8 ranks) counts the same collectives for
    moves along one mesh dim; where torch runs one collective per mesh dim (P,P -> R,R:
    two all-reduces), XLA runs one over both axes, and the counts say so."""
    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import numpy as np, torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.tensor import DTensor as TorchDTensor
        from torch.distributed.tensor.debug import CommDebugMode
        from placements2jax import comm_debug, distribute_tensor, init_device_mesh, resolve_layout
        from placements2jax.interop.torch import to_torch_mesh, to_torch_placements
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
        mesh = init_device_mesh((4, 2), ("dp", "tp"))
        torch_mesh = to_torch_mesh(mesh)
        names = {"all_gather_into_tensor": "all-gather", "all_reduce": "all-reduce"}
        result = {}
        for src, dst in [("S(0),R", "R,R"), ("P,R", "R,R"), ("R,S(1)", "R,R"), ("S(0),P", "S(0),R"), ("P,P", "R,R")]:
            x = distribute_tensor(np.ones((8, 4), np.float32), mesh, src)
            with comm_debug() as ours:
                x.redistribute(mesh, dst)
            local = torch.ones(tuple(x.to_local(3).shape))
            theirs_x = TorchDTensor.from_local(local, torch_mesh, to_torch_placements(x.layout), run_check=False,
                                               shape=torch.Size((8, 4)), stride=(4, 1))
            with CommDebugMode() as theirs:
                theirs_x.redistribute(torch_mesh, to_torch_placements(resolve_layout(mesh, dst, 2)))
            counts = {names[str(op).split(".")[-1]]: n for op, n in theirs.get_comm_counts().items()}
            result[f"{src}->{dst}"] = [ours.get_comm_counts(), counts]
        print(result)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    for move in ("S(0),R->R,R", "P,R->R,R", "R,S(1)->R,R", "S(0),P->S(0),R"):
        ours, theirs = result[move]
        assert ours == theirs and sum(ours.values()) == 1, (move, ours, theirs)
    assert result["P,P->R,R"] == [{"all-reduce": 1}, {"all-reduce": 2}]
