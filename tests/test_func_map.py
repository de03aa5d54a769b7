"""local_map: per-rank code on DTensors' local blocks, against NumPy, plain JAX and torch's own local_map."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import (
    DeviceMesh,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    local_map,
)
from placements2jax.errors import ArgumentTypeError, MeshError, PlacementError, ShapeError

A = np.arange(32.0, dtype=np.float32).reshape(8, 4) - 7
B = np.arange(12.0, dtype=np.float32).reshape(4, 3) / 4
B6 = np.arange(24.0, dtype=np.float32).reshape(4, 6) / 4


@pytest.fixture(scope="module")
def mesh() -> DeviceMesh:
    return init_device_mesh((4, 2), ("dp", "tp"))


def local_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def test_local_matmul_gives_a_partial_sum_per_rank(mesh: DeviceMesh) -> None:
    a = distribute_tensor(A, mesh, "S(0),S(1)")
    b = distribute_tensor(B, mesh, "R,S(0)")
    mm = local_map(local_matmul, out_placements=[Shard(0), Partial()], in_placements=("S(0),S(1)", "R,S(0)"))
    y = mm(a, b)
    assert y.placements == (Shard(0), Partial("sum")) and y.shape == (8, 3)
    assert y.array.sharding.spec.unreduced == frozenset({"tp"})  # JAX's native Partial(sum)
    for rank in mesh.rank_list:
        expected = np.asarray(a.to_local(rank)) @ np.asarray(b.to_local(rank))
        np.testing.assert_allclose(np.asarray(y.to_local(rank)), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y.full_tensor()), A @ B, rtol=1e-6)


def test_hand_written_collective_runs_per_rank(mesh: DeviceMesh) -> None:
    @local_map(out_placements="S(0),R")
    def mm_allreduce(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.psum(x @ w, "tp")

    y = mm_allreduce(distribute_tensor(A, mesh, "S(0),S(1)"), distribute_tensor(B, mesh, "R,S(0)"))
    assert y.placements == (Shard(0), Replicate())
    np.testing.assert_allclose(np.asarray(y.to_local(3)), (A @ B)[2:4], rtol=1e-6)


@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_stacked_partial_outputs(mesh: DeviceMesh, op: str) -> None:
    reduce = {"avg": jnp.mean, "max": jnp.max, "min": jnp.min}[op]
    x = distribute_tensor(A, mesh, "S(0),S(1)")
    y = local_map(lambda b: reduce(b, axis=1, keepdims=True), out_placements=f"S(0),P({op})")(x)
    assert y.placements == (Shard(0), Partial(op)) and y.shape == (8, 1)
    np.testing.assert_allclose(np.asarray(y.full_tensor())[:, 0], np.asarray(reduce(A, axis=1)), rtol=1e-6)
    for rank in mesh.rank_list:
        np.testing.assert_allclose(np.asarray(y.to_local(rank)), reduce(np.asarray(x.to_local(rank)), 1, keepdims=True))


@pytest.mark.parametrize("placements", ["S(0),P", "P(max),S(1)"])
def test_partial_inputs_hand_func_the_partial_values(mesh: DeviceMesh, placements: str) -> None:
    x = distribute_tensor(A, mesh, placements)
    y = local_map(lambda b: b * 2, out_placements=placements, in_placements=(placements,))(x)
    assert y.layout == x.layout
    for rank in mesh.rank_list:
        np.testing.assert_array_equal(np.asarray(y.to_local(rank)), 2 * np.asarray(x.to_local(rank)))
    np.testing.assert_allclose(np.asarray(y.full_tensor()), 2 * A)


def test_gradient_through_a_partial_sum_input(mesh: DeviceMesh) -> None:
    """A Partial(sum) input (JAX unreduced) handed to per-rank code, differentiated."""
    x = distribute_tensor(A, mesh, "S(0),P")
    double = local_map(lambda b: 2 * b, out_placements="S(0),P", in_placements=("S(0),P",))
    grad = jax.jit(jax.grad(lambda v: jnp.sum(double(v).to_jax() ** 2)))(x)
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), 8 * A, rtol=1e-6)


def test_pytree_arguments_and_outputs(mesh: DeviceMesh) -> None:
    """Flattened arguments (None counts), plain arrays passed whole, non-array outputs with None."""
    x = distribute_tensor(A, mesh, "S(0),R")

    def fn(pair, nothing, scale, bias):
        assert nothing is None and scale == 3
        first, second = pair
        return {"y": first * scale + bias, "count": 7, "z": second.sum(keepdims=True)}

    mapped = local_map(
        fn,
        out_placements=(None, "S(0),R", "P,R"),  # flattened dict: count, y, z (sorted keys)
        in_placements=("S(0),R", "S(0),R", None, None, None),
    )
    out = mapped((x, x), None, 3, np.ones(4, np.float32))
    assert out["count"] == 7
    np.testing.assert_allclose(np.asarray(out["y"].full_tensor()), A * 3 + 1)
    assert out["z"].placements == (Partial("sum"), Replicate())
    np.testing.assert_allclose(np.asarray(out["z"].full_tensor()), [[A.sum()]], rtol=1e-6)


def test_placements_forms_and_arrays_on_other_devices(mesh: DeviceMesh) -> None:
    x = distribute_tensor(A, mesh, "S(0),S(1)")
    elsewhere = jax.device_put(jnp.ones(2, jnp.float32), jax.devices()[3])  # committed to one device
    for out in (("dp", "tp"), (Shard(0), Shard(1)), [Shard(0), Shard(1)], "S(0),S(1)", x.layout):
        y = local_map(lambda b, c: b + c, out_placements=out)(x, elsewhere)
        assert y.layout == x.layout
        np.testing.assert_array_equal(np.asarray(y.full_tensor()), A + 1)


def test_repeated_eager_calls_reuse_one_program(mesh: DeviceMesh) -> None:
    traced = []

    def scale(b, factor):
        traced.append(factor)  # runs only while tracing
        return b * factor

    mapped = local_map(scale, out_placements="S(0),S(1)")
    x = distribute_tensor(A, mesh, "S(0),S(1)")
    first = mapped(x, 2.0)
    count = len(traced)
    again = mapped(distribute_tensor(A + 1, mesh, "S(0),S(1)"), 2.0)
    assert len(traced) == count  # same layouts and static arguments: no new trace
    np.testing.assert_array_equal(np.asarray(again.full_tensor()), 2 * (A + 1))
    mapped(x, 3.0)  # another static argument: traced again
    assert len(traced) > count and np.array_equal(np.asarray(first.full_tensor()), 2 * A)


def test_redistribute_inputs(mesh: DeviceMesh) -> None:
    x = distribute_tensor(A, mesh, "S(0),R")
    mapped = local_map(lambda b: b + 1, out_placements="R,S(1)", in_placements=("R,S(1)",), redistribute_inputs=True)
    y = mapped(x)
    assert y.placements == (Replicate(), Shard(1))
    np.testing.assert_array_equal(np.asarray(y.full_tensor()), A + 1)
    with pytest.raises(PlacementError, match="redistribute_inputs=True"):
        local_map(lambda b: b, out_placements="R,S(1)", in_placements=("R,S(1)",))(x)


def test_without_dtensor_arguments_func_is_called(mesh: DeviceMesh) -> None:
    assert local_map(lambda v: v + 1, out_placements="S(0),R", device_mesh=mesh)(1) == 2


def test_under_jit_and_grad_equals_plain_jax(mesh: DeviceMesh) -> None:
    mm = local_map(local_matmul, out_placements="S(0),P", in_placements=("S(0),S(1)", "R,S(0)"))

    def loss(a, b):
        return jnp.sum(jnp.tanh(mm(a, b).to_jax()))

    def plain(a, b):
        return jnp.sum(jnp.tanh(a @ b))

    a, b = distribute_tensor(A, mesh, "S(0),S(1)"), distribute_tensor(B, mesh, "R,S(0)")
    np.testing.assert_allclose(jax.jit(loss)(a, b), plain(A, B), rtol=1e-5)
    ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    pa, pb = jax.grad(plain, argnums=(0, 1))(A, B)
    assert ga.layout == a.layout and gb.layout == b.layout
    np.testing.assert_allclose(np.asarray(ga.full_tensor()), pa, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gb.full_tensor()), pb, rtol=1e-5, atol=1e-6)
    with jax.set_mesh(mesh.to_jax()):  # eager jax.grad on an Explicit mesh needs JAX's mesh context
        eager = jax.grad(loss, argnums=1)(a, b)
    np.testing.assert_allclose(np.asarray(eager.full_tensor()), pb, rtol=1e-5, atol=1e-6)


def test_auto_mesh() -> None:
    mesh = DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"), axis_types="auto")
    y = local_map(local_matmul, out_placements="S(0),P")(
        distribute_tensor(A, mesh, "S(0),S(1)"), distribute_tensor(B, mesh, "R,S(0)")
    )
    np.testing.assert_allclose(np.asarray(y.full_tensor()), A @ B, rtol=1e-6)


@given(
    st.sampled_from(["S(0),S(1)", "S(1),S(0)", "R,S(0)", "S(1),R", "R,R", "(dp,tp),None", "None,(tp,dp)"]),
    st.sampled_from([(8, 8), (16, 8), (8, 16)]),
)
def test_elementwise_round_trip_any_even_layout(placements: str, shape: tuple[int, int]) -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    dt = distribute_tensor(x, mesh, placements)
    y = local_map(lambda b: b * b - 1, out_placements=placements, in_placements=(placements,))(dt)
    assert y.layout == dt.layout
    np.testing.assert_array_equal(np.asarray(y.full_tensor()), x * x - 1)


def test_bad_inputs_are_clear(mesh: DeviceMesh) -> None:
    x = distribute_tensor(A, mesh, "S(0),S(1)")
    w = distribute_tensor(B, mesh, "R,S(0)")
    with pytest.raises(PlacementError, match=r"differs between the ranks of mesh axes \['tp'\]"):
        local_map(local_matmul, out_placements="S(0),R")(x, w)  # a partial sum declared Replicate
    with pytest.raises(ShapeError, match=r"rank 6's block \(1,\) would be padded to \(3,\)"):
        local_map(lambda b: b, out_placements="S(0),R")(distribute_tensor(np.arange(10.0), mesh, "S(0),R"))
    with pytest.raises(PlacementError, match="2 entries for 1 flattened"):
        local_map(lambda b: b, out_placements="S(0),S(1)", in_placements=("S(0),S(1)", None))(x)
    with pytest.raises(PlacementError, match="2 flattened outputs"):
        local_map(lambda b: (b, b), out_placements="S(0),S(1)")(x)
    with pytest.raises(PlacementError, match="not an array"):
        local_map(lambda b: 3, out_placements="S(0),S(1)")(x)
    with pytest.raises(MeshError, match="not on local_map's mesh"):
        local_map(lambda b: b, out_placements="S(0)", device_mesh=init_device_mesh((8,), ("x",)))(x)
    with pytest.raises(ArgumentTypeError, match="keyword argument holds a DTensor"):
        local_map(lambda b, c: b, out_placements="S(0),S(1)")(x, c=x)
    with pytest.raises(ArgumentTypeError, match="expected a function"):
        local_map("matmul", out_placements="S(0),R")


def test_equals_torch_local_map_rank_by_rank(mesh: DeviceMesh) -> None:
    """torch's own local_map, run for each simulated rank (a torch mesh seen from that rank,
    no communication), gives the same placements, global shape and local values."""
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor import distribute_tensor as torch_distribute
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    from placements2jax.interop.torch import to_torch_mesh, to_torch_placements

    cases = [
        ("S(0),S(1)", "R,S(0)", "S(0),P", torch.mm, local_matmul),
        ("S(0),R", "R,S(1)", "S(0),S(1)", torch.mm, local_matmul),
        ("R,S(1)", "R,S(0)", "R,P", torch.mm, local_matmul),
    ]
    for left, right, out, torch_fn, jax_fn in cases:
        a, b = distribute_tensor(A, mesh, left), distribute_tensor(B6, mesh, right)
        ours = local_map(jax_fn, out_placements=out, in_placements=(left, right))(a, b)
        placements = [to_torch_placements(x.layout) for x in (a, b, ours)]
        for rank in mesh.rank_list:
            torch_mesh = to_torch_mesh(mesh, rank=rank)
            ta, tb = (
                torch_distribute(torch.from_numpy(v), torch_mesh, p, src_data_rank=None)
                for v, p in zip((A, B6), placements)
            )
            mapped = torch_local_map(torch_fn, out_placements=list(placements[2]), in_placements=tuple(placements[:2]))
            theirs = mapped(ta, tb)
            assert tuple(theirs.placements) == placements[2] and tuple(theirs.shape) == ours.shape
            np.testing.assert_allclose(np.asarray(ours.to_local(rank)), theirs.to_local().numpy(), rtol=1e-6)


def test_torch_local_map_on_a_fake_process_group_gives_our_placements() -> None:
    """On torch's fake process group (8 ranks, one process) torch's local_map returns the
    placements and global shape ours does."""
    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import numpy as np, torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.tensor import distribute_tensor as tdist
        from torch.distributed.tensor.experimental import local_map as tlocal_map
        from placements2jax import distribute_tensor, init_device_mesh, local_map
        from placements2jax.interop.torch import to_torch_mesh, to_torch_placements
        dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        mesh = init_device_mesh((4, 2), ("dp", "tp"))
        a = distribute_tensor(np.ones((8, 4), np.float32), mesh, "S(0),S(1)")
        b = distribute_tensor(np.ones((4, 3), np.float32), mesh, "R,S(0)")
        ours = local_map(lambda x, w: x @ w, out_placements="S(0),P")(a, b)
        tm = to_torch_mesh(mesh)
        ta = tdist(torch.ones(8, 4), tm, to_torch_placements(a.layout))
        tb = tdist(torch.ones(4, 3), tm, to_torch_placements(b.layout))
        theirs = tlocal_map(torch.mm, out_placements=list(to_torch_placements(ours.layout)))(ta, tb)
        assert tuple(theirs.placements) == to_torch_placements(ours.layout), theirs.placements
        assert tuple(theirs.shape) == ours.shape, (theirs.shape, ours.shape)
        assert theirs.to_local().shape == ours.to_local(5).shape
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
