"""register_sharding: user rules for named ops, jaxpr primitives and user functions
(custom_vjp, custom_jvp, jitted, Pallas), used by infer_signature, predict, check and apply."""

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.extend import core
from jax.interpreters import mlir

from placements2jax import (
    DeviceMesh,
    Layout,
    Replicate,
    Shard,
    apply,
    check,
    clear_caches,
    distribute_tensor,
    infer_signature,
    init_device_mesh,
    predict,
    resolve_layout,
    register_sharding,
    unregister_sharding,
)
from placements2jax.errors import ArgumentTypeError, InferenceError, UnsupportedOpError
from placements2jax.inference import plan_redistribute, primitive_names

X = np.arange(64.0, dtype=np.float32).reshape(8, 8) / 16 - 1


@pytest.fixture(scope="module")
def mesh() -> DeviceMesh:
    return init_device_mesh((4, 2), ("dp", "tp"))


@jax.custom_vjp
def scaled_sin(x: jax.Array) -> jax.Array:
    return jnp.sin(x) * 2


def _scaled_sin_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return scaled_sin(x), x


def _scaled_sin_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (2 * g * jnp.cos(x),)


scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


def row_softmax_rule(x):
    """torch's docstring example: shard any dim but the softmax dim (here the last)."""
    return [([Replicate()], [Replicate()])] + [([Shard(d)], [Shard(d)]) for d in range(x.ndim - 1)]


@pytest.fixture
def registered() -> Iterator[list]:
    """Ops registered by a test, unregistered after it (the registry is global)."""
    ops: list = []
    yield ops
    for op in ops:
        unregister_sharding(op)


def _layout(mesh: DeviceMesh, placements: str, ndim: int = 2) -> Layout:
    return resolve_layout(mesh, placements, ndim)


def _spec(mesh: DeviceMesh, placements: str, shape=(8, 8)):
    return (shape, jnp.float32, _layout(mesh, placements))


def test_named_op_override_replaces_the_builtin_rule(mesh: DeviceMesh, registered: list) -> None:
    x = _spec(mesh, "S(1),R")
    assert str(infer_signature("softmax", [x], axis=0).out_layouts[0]) == str(_layout(mesh, "S(1),R"))

    @register_sharding("softmax")
    def replicate_only(x, **params):
        return [([Replicate()], [Replicate()])]

    registered.append("softmax")
    signature = infer_signature("softmax", [x], axis=0)
    assert signature.out_layouts[0] == Layout(mesh, ((), ()))
    unregister_sharding("softmax")
    registered.clear()
    assert infer_signature("softmax", [x], axis=0).out_layouts[0] == _layout(mesh, "S(1),R")


def test_custom_vjp_function_is_one_equation_with_the_rule(mesh: DeviceMesh, registered: list) -> None:
    x = _spec(mesh, "S(0),S(1)")
    walked = predict(lambda a: scaled_sin(a), x)
    assert [e.primitive for e in walked.equations][0] == "custom_vjp_call"
    register_sharding(scaled_sin)(row_softmax_rule)
    registered.append(scaled_sin)
    prediction = predict(lambda a: scaled_sin(a), x)
    assert [e.primitive for e in prediction.equations] == ["custom_vjp_call[scaled_sin]"]
    # the rule splits only dim 0: dim 1's tp split moves onto dim 0 (one all-to-all), not gathered
    assert prediction.outputs[0].layout.dim_axes == ((0, 1), ())
    assert prediction.nbytes > 0


def test_apply_runs_the_registered_function_per_rank(mesh: DeviceMesh, registered: list) -> None:
    register_sharding(scaled_sin)(row_softmax_rule)
    registered.append(scaled_sin)
    dx = distribute_tensor(X[:6], mesh, [Shard(0), Shard(1)])  # uneven over dp
    out = apply(scaled_sin, dx, execute="ops")  # registered functions run per rank op by op
    assert out.layout.dim_axes == ((0, 1), ())
    np.testing.assert_allclose(np.asarray(out.full_tensor()), np.sin(X[:6]) * 2, rtol=1e-6)
    for shard in out.to_jax().addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data)[: len(np.sin(X[:6])[shard.index])],
                                   (np.sin(X[:6]) * 2)[shard.index], rtol=1e-6)
    with jax.set_mesh(mesh.to_jax()):  # eager jax.grad on an Explicit mesh needs JAX's mesh context
        grad = jax.grad(lambda t: apply(scaled_sin, t, execute="ops").full_tensor().sum())(dx)
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), 2 * np.cos(X[:6]), rtol=1e-6)



def test_apply_defaults_to_ops_for_a_registered_function(mesh: DeviceMesh, registered: list) -> None:
    """execute="auto" (the default) runs fn op by op when it calls a registered function,
    found inside a nested jit too: the rule's layout, and eager grad inside jax.set_mesh."""
    register_sharding(scaled_sin)(row_softmax_rule)
    registered.append(scaled_sin)
    dx = distribute_tensor(X[:6], mesh, [Shard(0), Shard(1)])  # uneven over dp
    nested = jax.jit(lambda t: scaled_sin(t) + 1)
    out = apply(nested, dx)
    assert out.layout == apply(nested, dx, execute="ops").layout
    assert out.layout.dim_axes == ((0, 1), ())
    np.testing.assert_allclose(np.asarray(out.full_tensor()), np.sin(X[:6]) * 2 + 1, rtol=1e-6)
    with jax.set_mesh(mesh.to_jax()):
        grad = jax.grad(lambda t: apply(scaled_sin, t).full_tensor().sum())(dx)
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), 2 * np.cos(X[:6]), rtol=1e-6)

def test_cost_ranking_picks_the_cheapest_strategy(mesh: DeviceMesh, registered: list) -> None:
    @jax.jit
    def double(a):
        return a * 2

    @register_sharding(double)
    def any_split(a):
        return [([Shard(0)], [Shard(0)]), ([Shard(1)], [Shard(1)])]

    registered.append(double)
    for placements in ("S(0),R", "S(1),R", "R,S(0)", "S(0),S(1)"):
        prediction = predict(double, _spec(mesh, placements), search="eager")
        assert prediction.outputs[0].layout == _layout(mesh, placements)
        assert prediction.nbytes == 0
    out = apply(double, distribute_tensor(X, mesh, [Shard(1), Replicate()]), execute="ops")
    assert out.placements == (Shard(1), Replicate())
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), X * 2)


def _triple_primitive() -> core.Primitive:
    """A primitive of the user's own (no built-in rule): x * 3."""
    triple = core.Primitive("triple_rows")
    triple.def_impl(lambda x: x * 3)
    triple.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(triple, mlir.lower_fun(lambda x: x * 3, multiple_results=False))
    return triple


TRIPLE = _triple_primitive()


def test_primitive_rule_for_a_primitive_without_one(mesh: DeviceMesh, registered: list) -> None:
    x = _spec(mesh, "S(1),S(0)")
    with pytest.raises(UnsupportedOpError, match="triple_rows"):
        predict(TRIPLE.bind, x)
    register_sharding(TRIPLE)(lambda x, **params: [([Shard(0)], [Shard(0)]), ([Shard(1)], [Shard(1)])])
    registered.append(TRIPLE)
    assert "triple_rows" in primitive_names()
    prediction = predict(TRIPLE.bind, x, search="eager")
    assert prediction.outputs[0].layout == x[2] and prediction.nbytes == 0
    dx = distribute_tensor(X[:, :7], mesh, [Shard(1), Shard(0)])  # uneven over dp
    out = apply(TRIPLE.bind, dx, execute="ops")
    assert out.placements == (Shard(1), Shard(0))
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), X[:, :7] * 3)


def test_primitive_rule_overrides_the_builtin_one(mesh: DeviceMesh, registered: list) -> None:
    x = _spec(mesh, "S(1),R")
    assert predict(jnp.cbrt, x).outputs[0].layout == x[2]
    register_sharding(jax.lax.cbrt_p)(lambda x, **params: [([Shard(0)], [Shard(0)])])
    registered.append(jax.lax.cbrt_p)
    assert predict(jnp.cbrt, x).outputs[0].layout.dim_axes[1] == ()
    out = apply(jnp.cbrt, distribute_tensor(X, mesh, [Shard(0), Replicate()]), execute="ops")
    assert out.placements == (Shard(0), Replicate())
    np.testing.assert_allclose(np.asarray(out.full_tensor()), np.cbrt(X), rtol=1e-6)


def test_pallas_kernel_and_its_jitted_wrapper(mesh: DeviceMesh, registered: list) -> None:
    def double_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    @jax.jit
    def pallas_double(x):
        return pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    x = _spec(mesh, "S(0),R")
    with pytest.raises(UnsupportedOpError, match="pallas_call"):
        predict(pallas_double, x)
    register_sharding(double_kernel)(lambda x: [([Shard(0)], [Shard(0)])])
    registered.append(double_kernel)
    assert [e.primitive for e in predict(pallas_double, x).equations][-1] == "pallas_call[double_kernel]"
    register_sharding(pallas_double)(lambda x: [([Shard(0)], [Shard(0)])])
    registered.append(pallas_double)
    assert [e.primitive for e in predict(pallas_double, x).equations] == ["jit[pallas_double]"]
    out = apply(pallas_double, distribute_tensor(X, mesh, [Shard(0), Replicate()]), execute="ops")
    assert out.placements == (Shard(0), Replicate())
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), X * 2)


def test_check_compares_the_rule_with_xla(mesh: DeviceMesh, registered: list) -> None:
    register_sharding(scaled_sin)(row_softmax_rule)
    registered.append(scaled_sin)
    report = check(lambda a: scaled_sin(a) + 1, _spec(mesh, "S(1),R"))
    assert "custom_vjp_call[scaled_sin]" in [e.primitive for e in report.prediction.equations]
    # dp's split of dim 1 moved to dim 0; tp, split by no input, splits nothing (jaxpr._idle_mesh_dims; until
    # stop 38 it split dim 0 too, a free slice XLA never makes)
    assert report.prediction.outputs[0].layout.dim_axes[0] == (0,)
    assert report.prediction.nbytes > 0  # the rule's: dim 1's split moves to dim 0 (XLA would keep it)


def test_registration_clears_caches_and_clear_caches_keeps_it(mesh: DeviceMesh, registered: list) -> None:
    x = _spec(mesh, "S(0),S(1)")
    before = predict(scaled_sin, x)
    register_sharding(scaled_sin)(row_softmax_rule)
    registered.append(scaled_sin)
    clear_caches()
    after = predict(scaled_sin, x)
    assert before.outputs[0].layout.dim_axes == ((0,), (1,))
    assert after.outputs[0].layout.dim_axes == ((0, 1), ())


def test_bad_rules_are_named(mesh: DeviceMesh, registered: list) -> None:
    x = _spec(mesh, "S(0),R")
    with pytest.raises(UnsupportedOpError, match="not a named op"):
        register_sharding("no_such_op")
    with pytest.raises(ArgumentTypeError, match="expected a named op"):
        register_sharding(3)
    with pytest.raises(UnsupportedOpError, match="no rule registered"):
        unregister_sharding(scaled_sin)
    register_sharding(scaled_sin)(lambda x: [([Shard(0), Shard(0)], [Shard(0)])])
    registered.append(scaled_sin)
    with pytest.raises(InferenceError, match="2 output placements for scaled_sin's 1 outputs"):
        predict(scaled_sin, x)
    register_sharding(scaled_sin)(lambda x: [([Shard(2)], [Shard(2)])])
    with pytest.raises(InferenceError, match="S\\(2\\) is not a dim"):
        predict(scaled_sin, x)
    register_sharding(scaled_sin)(lambda x: [(["S(1)"], [Shard(1)])])  # text placements are accepted
    assert predict(scaled_sin, x).outputs[0].layout.dim_axes[0] == ()


TORCH_SOFTMAX = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor.experimental import register_sharding
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))

@register_sharding(torch.ops.aten._softmax.default)
def rule(x, dim, half_to_float):  # torch's docstring example
    softmax_dim = dim if dim >= 0 else dim + x.ndim
    return [([Replicate()], [Replicate(), None, None])] + [
        ([Shard(d)], [Shard(d), None, None]) for d in range(x.ndim) if d != softmax_dim
    ]

for placements in ([Shard(0), Shard(1)], [Shard(0), Replicate()], [Shard(1), Replicate()], [Replicate(), Shard(0)]):
    x = DTensor.from_local(torch.randn(2, 4), mesh, placements, run_check=False)
    print(",".join("R" if p.is_replicate() else f"S({p.dim})" for p in torch.softmax(x, dim=1).placements))
"""


def test_torch_register_sharding_choices_cost_no_less_than_ours(mesh: DeviceMesh, registered: list) -> None:
    """torch's docstring rule on a fake process group: where torch's choice keeps the input
    layout, ours is the same; elsewhere ours moves no more bytes than torch's choice would."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TORCH_SOFTMAX], capture_output=True, text=True, check=True)
    torch_outputs = done.stdout.split()

    @jax.jit
    def softmax(t):
        return jax.nn.softmax(t, axis=1)

    register_sharding(softmax)(row_softmax_rule)
    registered.append(softmax)
    for given, theirs in zip(("S(0),S(1)", "S(0),R", "S(1),R", "R,S(0)"), torch_outputs, strict=True):
        x = _spec(mesh, given)
        prediction = predict(softmax, x, search="eager")
        torch_layout = _layout(mesh, theirs)
        torch_bytes = plan_redistribute(x[0], x[1], x[2], torch_layout).nbytes
        assert prediction.nbytes <= torch_bytes, (given, theirs, str(prediction.outputs[0].layout))
        if torch_bytes == 0:
            assert prediction.outputs[0].layout == torch_layout
