"""fully_shard (ZeRO-3) combined with tensor parallelism: layouts, collectives, and training
step by step against plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from models.steps import fully_sharded, training_step

from placements2jax import (
    DeviceMesh,
    DTensor,
    Layout,
    apply,
    check,
    colwise,
    distribute_pytree,
    distribute_tensor,
    fully_shard,
    fully_shard_layouts,
    init_device_mesh,
    rowwise,
    unshard,
)
from placements2jax.errors import ArgumentTypeError, MeshError
from placements2jax.hlo import compiled_collectives

TP_PLAN = {r"layers/\d+/up/.*": colwise("tp"), r"layers/\d+/down/.*": rowwise("tp")}
BATCH = "S(0),R"
D, HIDDEN, LAYERS, BATCH_SIZE = 16, 64, 2, 8


@pytest.fixture(scope="module")
def mesh() -> DeviceMesh:
    return init_device_mesh((2, 4), ("dp", "tp"))


def leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, DTensor))


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> dict:
        w = rng.normal(scale=1 / np.sqrt(n_in), size=(n_in, n_out)).astype(np.float32)
        return {"w": w, "b": rng.normal(scale=0.1, size=(n_out,)).astype(np.float32)}

    return {"layers": [{"up": dense(D, HIDDEN), "down": dense(HIDDEN, D)} for _ in range(LAYERS)]}


def forward(params: dict, x):
    """A residual MLP, torch tensor-parallel style on DTensors, plain JAX on arrays."""
    for layer in params["layers"]:
        up, down = layer["up"], layer["down"]
        if isinstance(x, DTensor):
            x = x.redistribute(placements=BATCH)
            hidden = apply(jax.nn.gelu, x @ up["w"] + up["b"])
            x = x + (hidden @ down["w"]).redistribute(placements=BATCH) + down["b"]
        else:
            x = x + jax.nn.gelu(x @ up["w"] + up["b"]) @ down["w"] + down["b"]
    return x


def fsdp_loss(sharded: dict, x, y):
    error = forward(unshard(sharded, "dp"), x) - y  # all-gather over dp before use
    return (error * error).mean().to_jax()


def plain_loss(params: dict, x, y):
    error = forward(params, x) - y
    return (error * error).mean()


def test_layouts_split_the_largest_divisible_dim_minor_to_tp(mesh: DeviceMesh) -> None:
    layouts = fully_shard_layouts(init_params(), mesh, "dp", plan=TP_PLAN)
    layer = layouts["layers"][0]
    assert layer["up"]["w"].alias_map == ("dp", "tp")  # (16, 64): local extents 16 | 64/4: a tie, dim 0
    assert layer["up"]["b"].alias_map == (("tp", "dp"),)  # split by tp already: dp minor (torch's _StridedShard)
    assert layer["down"]["w"].alias_map == (("tp", "dp"), "None")  # (64, 16): 64/4 = 16 on a tie with 16 -> dim 0
    assert layer["down"]["b"].alias_map == ("dp",)
    odd = fully_shard_layouts({"w": np.zeros((3, 5)), "s": np.float32(1)}, mesh, "dp")
    assert odd["w"].alias_map == ("None", "None") and odd["s"].alias_map == ()  # nothing divisible: kept whole


@given(
    st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), min_size=0, max_size=3),
    st.lists(st.sampled_from([None, 0, 1, 2]), min_size=1, max_size=1),
)
def test_fully_shard_layout_properties(shape: list[int], tp_dim: list) -> None:
    """Over random shapes and tensor-parallel splits: dp lands on the largest local extent
    it divides (minor to tp), the layout stays even, and removing dp gives the base back."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    dim = tp_dim[0] if tp_dim[0] is not None and tp_dim[0] < len(shape) and shape[tp_dim[0]] % 4 == 0 else None
    base = Layout(mesh, tuple((1,) if d == dim else () for d in range(len(shape))))
    (layout,) = jax.tree.leaves(fully_shard_layouts([distribute_tensor(np.zeros(shape), mesh, base)], mesh, "dp"),
                                is_leaf=lambda v: isinstance(v, Layout))
    local = [n // (4 if d == dim else 1) for d, n in enumerate(shape)]
    divisible = [d for d in range(len(shape)) if local[d] % 2 == 0]
    if not divisible:
        assert layout == base
        return
    chosen = max(divisible, key=lambda d: (local[d], -d))
    assert layout.dim_axes[chosen] == base.dim_axes[chosen] + (0,)
    assert layout.is_even(tuple(shape))
    assert Layout(mesh, tuple(tuple(a for a in axes if a != 0) for axes in layout.dim_axes)) == base


def test_unshard_gives_back_the_tensor_parallel_layout(mesh: DeviceMesh) -> None:
    tp = distribute_pytree(init_params(), mesh, TP_PLAN)
    sharded = fully_shard(tp, mesh, "dp")
    gathered = unshard(sharded, "dp")
    for a, b in zip(leaves(tp), leaves(gathered)):
        assert a.layout == b.layout
        np.testing.assert_array_equal(np.asarray(a.full_tensor()), np.asarray(b.full_tensor()))
    # a rank holds 1/dp of its tensor-parallel block
    w = sharded["layers"][0]["down"]["w"]
    assert w.to_local(0).shape == (8, 16)
    np.testing.assert_array_equal(np.asarray(w.to_local(4)), init_params()["layers"][0]["down"]["w"][8:16])


def test_training_fsdp_x_tp_equals_plain_jax_step_by_step(mesh: DeviceMesh) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH_SIZE, D)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(D, D)).astype(np.float32))
    host = init_params()
    params = fully_shard(host, mesh, "dp", plan=TP_PLAN)
    xs, ys = distribute_tensor(x, mesh, BATCH), distribute_tensor(y, mesh, BATCH)
    layouts = jax.tree.map(lambda p: p.layout, params, is_leaf=lambda v: isinstance(v, DTensor))
    lr = 0.1

    @jax.jit
    def step(p, a, b):
        loss, grads = jax.value_and_grad(fsdp_loss)(p, a, b)
        return loss, jax.tree.map(lambda w, g: w - lr * g, p, grads), grads

    @jax.jit
    def plain_step(p, a, b):
        loss, grads = jax.value_and_grad(plain_loss)(p, a, b)
        return loss, jax.tree.map(lambda w, g: w - lr * g, p, grads)

    reference = jax.tree.map(jnp.asarray, host)
    losses = []
    for _ in range(4):
        loss, params, grads = step(params, xs, ys)
        ref_loss, reference = plain_step(reference, x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)
        losses.append(float(loss))
        for g, p, layout in zip(leaves(grads), leaves(params), jax.tree.leaves(layouts)):
            assert g.layout == layout and p.layout == layout  # gradients come back sharded like the params
        for p, r in zip(leaves(params), jax.tree.leaves(reference)):
            np.testing.assert_allclose(np.asarray(p.full_tensor()), np.asarray(r), rtol=1e-5, atol=2e-6)
    assert losses[-1] < losses[0]

    kinds = {(c.op, c.group_size) for c in compiled_collectives(step, params, xs, ys)}
    assert ("all-gather", 2) in kinds  # the parameters gathered over dp (groups of 2) before use
    assert any(op in ("reduce-scatter", "all-reduce") and n == 2 for op, n in kinds)  # gradients reduced over dp


def test_check_reports_predicted_and_compiled_collectives_of_the_step(mesh: DeviceMesh) -> None:
    """check() of the step written on plain arrays, the all-gathers as sharding constraints."""
    params = fully_shard(init_params(), mesh, "dp", plan=TP_PLAN)
    flat, tree = jax.tree.flatten(params, is_leaf=lambda v: isinstance(v, DTensor))
    auto = DeviceMesh(mesh.mesh, mesh.to_jax().axis_names, axis_types="auto")
    gathered = [unshard(p, "dp").layout for p in flat]

    def pin(value, layout):
        sharding = jax.sharding.NamedSharding(auto.to_jax(), layout.partition_spec)
        return jax.lax.with_sharding_constraint(value, sharding)

    def step(*args):
        arrays, x, y = args[:-2], args[-2], args[-1]

        def loss(ws):
            used = [pin(w, layout) for w, layout in zip(ws, gathered)]
            return plain_loss(jax.tree.unflatten(tree, used), x, y)

        value, grads = jax.value_and_grad(loss)(list(arrays))
        return (value, *(w - 0.1 * g for w, g in zip(arrays, grads)))

    x = distribute_tensor(np.ones((BATCH_SIZE, D), np.float32), mesh, BATCH)
    report = check(step, *flat, x, x, mesh=mesh)
    assert report.compiled_counts["all-gather"] >= 1
    assert report.predicted_counts["all-gather"] >= 1
    assert report.compiled_bytes > 0 and report.predicted_bytes > 0
    assert "all-gather" in str(report)


def test_a_training_step_fully_sharded_on_its_megatron_plan(mesh: DeviceMesh) -> None:
    """tests/models/steps.py's ``fully_sharded`` (test_real_code's FSDP x TP Llama step) on
    the Megatron MLP's step: every parameter split over dp on top of its Megatron layout,
    which unshard gives back, and Adam's moments laid out as the parameters."""
    tp = training_step("mlp", mesh)
    params, state = fully_sharded(tp).args[:2]
    sharded = leaves(params)
    assert all(any(0 in axes for axes in p.layout.dim_axes) for p in sharded)
    assert [unshard(p, "dp").layout for p in sharded] == [p.layout for p in leaves(tp.args[0])]
    for moments in (optax.tree_utils.tree_get(state, "mu"), optax.tree_utils.tree_get(state, "nu")):
        assert [m.layout for m in leaves(moments)] == [p.layout for p in sharded]


def test_bad_inputs(mesh: DeviceMesh) -> None:
    with pytest.raises(MeshError, match="not an axis of the mesh"):
        fully_shard({"w": np.zeros((4, 4))}, mesh, "pp")
    with pytest.raises(ArgumentTypeError, match="expected a mesh axis name"):
        unshard({"w": np.zeros(2)}, 0)
    with pytest.raises(ArgumentTypeError, match="must be an array"):
        fully_shard({"w": "text"}, mesh, "dp")
