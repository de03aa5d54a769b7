"""Training on DTensor pytrees: eager jax.grad equal to the jitted one, optax optimizer
state in each parameter's layout, steps equal to unsharded training, bfloat16 parameters
(NumPy / ml_dtypes input too) with float32 optimizer state."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from models import common, llama, stacked

import placements2jax as p2j
from placements2jax import DTensor, Replicate, Shard, colwise, init_device_mesh, rowwise

MESH = init_device_mesh((4, 2), ("dp", "tp"))
KEY = jax.random.key(0)
BATCH = (Shard(0), Replicate())
PLAN = {r"up/w": colwise("tp"), r"up/b": colwise("tp"), r"down/w": rowwise("tp")}


def _init(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "up": {"w": jax.random.normal(k1, (16, 24)) / 4, "b": jnp.zeros(24)},
        "down": {"w": jax.random.normal(k2, (24, 16)) / 5, "b": jnp.zeros(16)},
    }


def _loss(params, x, y):
    hidden = p2j.apply(jax.nn.gelu, x @ params["up"]["w"] + params["up"]["b"])
    out = (hidden @ params["down"]["w"]).redistribute(placements=BATCH) + params["down"]["b"]
    error = out - y
    return (error * error).mean().to_jax()


def _plain_loss(params, x, y):
    hidden = jax.nn.gelu(x @ params["up"]["w"] + params["up"]["b"])
    out = hidden @ params["down"]["w"] + params["down"]["b"]
    return jnp.mean((out - y) ** 2)


def _data(seed: int = 1):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
    return x, y


def _full(tree):
    return jax.tree.map(lambda d: np.asarray(d.full_tensor()), tree, is_leaf=lambda v: isinstance(v, DTensor))


def test_eager_grad_equals_jitted_grad() -> None:
    params = p2j.init_pytree(_init, KEY, MESH, PLAN)
    x, y = (p2j.distribute_tensor(a, MESH, BATCH) for a in _data())
    eager = jax.grad(_loss)(params, x, y)  # JAX alone: "Length of device assignment 1 ... jax.set_mesh"
    jitted = jax.jit(jax.grad(_loss))(params, x, y)
    for path in ("up", "down"):
        for name in ("w", "b"):
            assert eager[path][name].layout == params[path][name].layout
            np.testing.assert_allclose(
                np.asarray(eager[path][name].full_tensor()), np.asarray(jitted[path][name].full_tensor()), rtol=1e-6
            )
    plain = jax.grad(_plain_loss)(jax.jit(_init)(KEY), *_data())
    np.testing.assert_allclose(_full(eager)["up"]["w"], np.asarray(plain["up"]["w"]), rtol=1e-5, atol=1e-6)
    value = _loss(params, x, y)  # no trace: unchanged
    assert float(value) == pytest.approx(float(_plain_loss(jax.jit(_init)(KEY), *_data())), rel=1e-6)


def test_optax_state_has_the_parameter_layouts_and_steps_match_unsharded() -> None:
    params = p2j.init_pytree(_init, KEY, MESH, PLAN)
    plain = jax.jit(_init)(KEY)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    state, plain_state = optimizer.init(params), optimizer.init(plain)
    mu = state[0].mu
    for path in ("up", "down"):
        for name in ("w", "b"):
            assert isinstance(mu[path][name], DTensor)
            assert mu[path][name].layout == params[path][name].layout
            assert state[0].nu[path][name].layout == params[path][name].layout

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    def plain_step(params, state, x, y):
        loss, grads = jax.value_and_grad(_plain_loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for seed in range(4):
        x, y = _data(seed)
        params, state, loss = step(params, state, *(p2j.distribute_tensor(a, MESH, BATCH) for a in (x, y)))
        plain, plain_state, plain_loss = plain_step(plain, plain_state, x, y)
        assert float(loss) == pytest.approx(float(plain_loss), rel=1e-5)
    assert params["up"]["w"].layout == p2j.plan_layouts(plain, MESH, PLAN)["up"]["w"]
    assert state[0].mu["down"]["w"].placements == (Replicate(), Shard(0))
    np.testing.assert_allclose(_full(params)["down"]["w"], np.asarray(plain["down"]["w"]), rtol=1e-4, atol=1e-6)


def test_bfloat16_parameters_with_float32_optimizer_state() -> None:
    host = {name: np.asarray(v).astype(ml_dtypes.bfloat16) for name, v in jax.jit(_init)(KEY)["up"].items()}
    params = p2j.distribute_pytree(host, MESH, {r"w": colwise("tp"), r"b": colwise("tp")})
    assert params["w"].dtype == jnp.bfloat16
    optimizer = optax.adam(1e-2, mu_dtype=jnp.float32)
    # tree.map reaches the DTensors' physical arrays: a float32 copy keeps every layout.
    state = optimizer.init(jax.tree.map(lambda a: a.astype(jnp.float32), params))
    assert state[0].mu["w"].dtype == jnp.float32 and state[0].mu["w"].layout == params["w"].layout
    x = p2j.distribute_tensor(np.ones((8, 16), ml_dtypes.bfloat16), MESH, BATCH)

    def loss(p, x):
        return (p2j.apply(jax.nn.relu, x @ p["w"] + p["b"]) * 1.0).mean().to_jax().astype(jnp.float32)

    @jax.jit
    def step(params, state, x):
        grads = jax.grad(loss)(params, x)
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, state = optimizer.update(grads32, state)
        params32 = optax.apply_updates(jax.tree.map(lambda a: a.astype(jnp.float32), params), updates)
        return jax.tree.map(lambda a: a.astype(jnp.bfloat16), params32), state

    new, state = step(params, state, x)
    assert new["w"].dtype == jnp.bfloat16 and state[0].nu["w"].dtype == jnp.float32
    assert new["w"].layout == params["w"].layout
    assert not np.array_equal(np.asarray(new["w"].full_tensor()), np.asarray(params["w"].full_tensor()))


# -- unmodified plain-JAX model code: a GPT-style LM (table[idx], jnp.where mask, lax.scan over layers) ----------------

VOCAB, DIM, LAYERS, SEQ = 64, 32, 2, 16


def _gpt_init(key: jax.Array) -> dict:
    k = jax.random.split(key, 4)
    scale = DIM**-0.5
    return {
        "embed": jax.random.normal(k[0], (VOCAB, DIM)) * 0.02,
        "blocks": {
            "qkv": jax.random.normal(k[1], (LAYERS, DIM, 3 * DIM)) * scale,
            "out": jax.random.normal(k[2], (LAYERS, DIM, DIM)) * scale,
            "up": jax.random.normal(k[3], (LAYERS, DIM, 4 * DIM)) * scale,
            "down": jnp.zeros((LAYERS, 4 * DIM, DIM)),
        },
    }


def _gpt_loss(params: dict, tokens: jax.Array) -> jax.Array:
    """Written as public JAX model code is: no sharding annotations at all."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs]
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))

    def block(x, w):
        q, k, v = jnp.split(x @ w["qkv"], 3, axis=-1)
        scores = jnp.where(mask, q @ k.swapaxes(-1, -2) * DIM**-0.5, -1e9)
        x = x + jax.nn.softmax(scores) @ v @ w["out"]
        return x + jax.nn.gelu(x @ w["up"]) @ w["down"], None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    logits = x @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


GPT_PLAN = {r"embed": "R,S(0)", r"blocks/(qkv|up)": "None,None,tp", r"blocks/(out|down)": "None,tp,None"}


def _on_arrays(loss_fn):
    """The model's loss on the DTensors' logical arrays (p2j.model_arrays): its gradients
    come back as DTensors in the parameters' layouts."""

    def wrapped(params, *args):
        return loss_fn(*p2j.model_arrays((params, *args)))

    return wrapped


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_unmodified_model_code_trains_like_unsharded(axis_types) -> None:
    """On the default (Explicit) mesh and on an Auto mesh alike: table[idx], jnp.where
    masks and lax.scan over layers, unchanged, under jit(value_and_grad) + optax."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"), axis_types=axis_types)
    params = p2j.init_pytree(_gpt_init, KEY, mesh, GPT_PLAN)
    plain = jax.jit(_gpt_init)(KEY)
    optimizer = optax.adamw(1e-2)
    state, plain_state = optimizer.init(params), optimizer.init(plain)

    def make_step(loss_fn):
        @jax.jit
        def step(params, state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        return step

    step, plain_step = make_step(_on_arrays(_gpt_loss)), make_step(_gpt_loss)
    rng = np.random.default_rng(0)
    for _ in range(3):
        tokens = rng.integers(0, VOCAB, (8, SEQ + 1)).astype(np.int32)
        params, state, loss = step(params, state, p2j.distribute_tensor(tokens, mesh, "S(0),R"))
        plain, plain_state, plain_loss = plain_step(plain, plain_state, tokens)
        assert float(loss) == pytest.approx(float(plain_loss), rel=1e-5)
    assert params["embed"].placements == (Replicate(), Shard(0))
    assert params["embed"].device_mesh is mesh and params["embed"].array.sharding.mesh == mesh.to_jax()
    assert state[0].mu["blocks"]["down"].layout == params["blocks"]["down"].layout
    np.testing.assert_allclose(np.asarray(params["embed"].full_tensor()), np.asarray(plain["embed"]), rtol=2e-4, atol=1e-6)


def test_model_arrays_are_the_logical_arrays_on_the_auto_twin() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    value = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    tree = {"w": p2j.distribute_tensor(value, mesh, "S(0),S(1)"), "p": p2j.distribute_tensor(value, mesh, "P,S(0)"),
            "u": p2j.distribute_tensor(value[:7], mesh, "R,S(0)"), "n": 3, "a": jnp.ones(2)}
    arrays = p2j.model_arrays(tree)
    assert arrays["n"] == 3 and arrays["a"] is tree["a"]
    for name, want in (("w", value), ("p", value), ("u", value[:7])):
        np.testing.assert_array_equal(np.asarray(arrays[name]), want)
        assert arrays[name].sharding.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
        assert arrays[name].sharding.mesh.devices.tolist() == mesh.to_jax().devices.tolist()
    assert arrays["w"].sharding.spec == jax.sharding.PartitionSpec("dp", "tp")
    assert arrays["p"].sharding.spec == jax.sharding.PartitionSpec("tp", None)  # the partial sum reduced
    assert arrays["u"].sharding.is_fully_replicated  # uneven: replicated, as to_jax()
    for shard in arrays["w"].addressable_shards:  # each device keeps its own block
        rank = [d.id for d in jax.devices()].index(shard.device.id)
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(tree["w"].to_local(rank)))
    auto = init_device_mesh((2, 4), ("dp", "tp"), axis_types="auto")
    on_auto = p2j.distribute_tensor(value, auto, "S(0),S(1)")
    assert p2j.model_arrays(on_auto).sharding == on_auto.to_jax().sharding


def test_model_arrays_under_eager_and_jitted_grad() -> None:
    """A vocabulary-split lookup (plain JAX) differentiated eagerly and under jit on the
    default mesh: the same gradient, a DTensor in the table's layout, equal to plain JAX."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    table = p2j.randn(64, 8, key=KEY, device_mesh=mesh, placements="R,S(0)")
    ids = np.array([[1, 5, 9], [60, 7, 33]], np.int32)
    sharded_ids = p2j.distribute_tensor(ids, mesh, "S(0),R")

    def model(table, ids):
        return jnp.tanh(table[ids]).sum()

    def loss(t, i):
        return model(*p2j.model_arrays((t, i)))

    eager, jitted = jax.grad(loss)(table, sharded_ids), jax.jit(jax.grad(loss))(table, sharded_ids)
    plain = jax.grad(model)(jax.random.normal(KEY, (64, 8)), ids)
    for grad in (eager, jitted):
        assert isinstance(grad, DTensor) and grad.layout == table.layout
        np.testing.assert_allclose(np.asarray(grad.full_tensor()), np.asarray(plain), rtol=1e-6)


def test_explicit_default_mesh_needs_an_out_sharding_for_table_lookups() -> None:
    """The default mesh stays Explicit (Partial(sum) carried natively as ``unreduced``,
    every move an exact ``reshard``); JAX then asks model code given the Explicit-typed
    arrays themselves (``to_jax()``) to say the sharding of an ambiguous gather, which is
    why model code gets ``model_arrays`` (docs/training.md, Explicit or Auto axes)."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    params = p2j.init_pytree(_gpt_init, KEY, mesh, GPT_PLAN)
    tokens = p2j.distribute_tensor(np.zeros((8, SEQ + 1), np.int32), mesh, "S(0),R")
    with pytest.raises(Exception, match="out_sharding"):
        arrays = jax.tree.map(lambda d: d.to_jax(), (params, tokens), is_leaf=lambda v: isinstance(v, DTensor))
        jax.jit(_gpt_loss)(*arrays)


# -- mixed precision: bfloat16 parameters, float32 master weights and moments (p2j.mixed_precision) ---------------


def _bf16_loss(params, x, y):
    return _loss(params, x, y).astype(jnp.float32)


def _plain_bf16_loss(params, x, y):
    return _plain_loss(params, x, y).astype(jnp.float32)


def test_mixed_precision_trains_bfloat16_parameters_like_plain_jax() -> None:
    optimizer = p2j.mixed_precision(optax.adamw(3e-3, weight_decay=0.1))
    bf16 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)  # noqa: E731
    params, plain = bf16(p2j.init_pytree(_init, KEY, MESH, PLAN)), bf16(jax.jit(_init)(KEY))
    state, plain_state = optimizer.init(params), optimizer.init(plain)
    for path in ("up", "down"):
        for name in ("w", "b"):
            assert params[path][name].dtype == jnp.bfloat16
            for tensor in (state.master[path][name], state.inner[0].mu[path][name], state.inner[0].nu[path][name]):
                assert tensor.dtype == jnp.float32 and tensor.layout == params[path][name].layout

    def make_step(loss_fn):
        @jax.jit
        def step(params, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        return step

    step, plain_step = make_step(_bf16_loss), make_step(_plain_bf16_loss)
    for seed in range(4):
        x, y = (a.astype(ml_dtypes.bfloat16) for a in _data(seed))
        params, state, loss = step(params, state, *(p2j.distribute_tensor(a, MESH, BATCH) for a in (x, y)))
        plain, plain_state, plain_loss = plain_step(plain, plain_state, x, y)
        assert float(loss) == pytest.approx(float(plain_loss), rel=2e-2)
        # the parameters are exactly the master weights rounded, in their layouts
        for path in ("up", "down"):
            for name in ("w", "b"):
                p, master = params[path][name], state.master[path][name]
                assert p.dtype == jnp.bfloat16 and p.layout == master.layout == state.inner[0].nu[path][name].layout
                np.testing.assert_array_equal(np.asarray(p.full_tensor()),
                                              np.asarray(master.full_tensor().astype(jnp.bfloat16)))
    np.testing.assert_allclose(np.asarray(state.master["up"]["w"].full_tensor()),
                               np.asarray(plain_state.master["up"]["w"]), rtol=5e-2, atol=2e-3)


def test_mixed_precision_keeps_updates_smaller_than_a_bfloat16_step() -> None:
    """An update below half a bfloat16 ulp rounds away on bfloat16 weights; the float32
    master weights accumulate it until the parameter moves."""
    params = {"w": p2j.distribute_tensor(np.ones((4, 8), ml_dtypes.bfloat16), MESH, "R,S(1)")}
    optimizer = p2j.mixed_precision(optax.sgd(1e-3))
    state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    for _ in range(6):
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.asarray(state.master["w"].full_tensor()), 1 - 6e-3, rtol=1e-6)
    assert float(params["w"].full_tensor()[0, 0]) == float(jnp.bfloat16(1 - 6e-3))  # 0.9921875, not 1.0
    assert params["w"].layout == state.master["w"].layout


def _plain_step(params, state, x, y, optimizer):
    loss, grads = jax.value_and_grad(_plain_loss)(params, x, y)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def test_init_state_passed_back_as_out_layouts_to_predict_check_and_apply() -> None:
    """The usual optax pattern on DTensor parameters, ``state = optimizer.init(params)``
    (Adam's moments DTensors in their parameters' layouts, the step count a plain
    ``jax.Array``), passed back whole as ``out_layouts=(params, state, None)``: the count
    keeps its own layout (Replicate); predict is cached (the key hashable); apply's step
    equals the unsharded one with the parameters and moments in their layouts."""
    from functools import partial

    optimizer = optax.adamw(1e-2)
    params = p2j.init_pytree(_init, KEY, MESH, PLAN)
    state = optimizer.init(params)
    assert isinstance(state[0].count, jax.Array) and not isinstance(state[0].count, DTensor)
    x, y = (p2j.distribute_tensor(a, MESH, BATCH) for a in _data())
    step = partial(_plain_step, optimizer=optimizer)
    arrays = p2j.model_arrays  # plain model code on the DTensors' logical arrays
    fn = lambda p, s, a, b: step(p, s, arrays(a), arrays(b))  # noqa: E731
    out_layouts = (params, state, None)
    prediction = p2j.predict(fn, params, state, x, y, out_layouts=out_layouts)
    assert p2j.predict(fn, params, state, x, y, out_layouts=out_layouts) is prediction
    count = prediction.out_layouts_tree[1][0].count
    assert count.placements == (Replicate(), Replicate())
    assert prediction.out_layouts_tree[1][0].mu["up"]["w"] == params["up"]["w"].layout
    report = p2j.check(fn, params, state, x, y, out_layouts=out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    new_params, new_state, loss = jax.jit(lambda *a: p2j.apply(fn, *a, out_layouts=out_layouts))(params, state, x, y)
    plain = jax.jit(_init)(KEY)
    want_params, want_state, want_loss = step(plain, optimizer.init(plain), *_data())
    assert float(loss.full_tensor() if isinstance(loss, DTensor) else loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert new_params["down"]["w"].layout == params["down"]["w"].layout
    assert new_state[0].nu["up"]["w"].layout == params["up"]["w"].layout
    np.testing.assert_allclose(_full(new_params)["up"]["w"], np.asarray(want_params["up"]["w"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_full(new_state[0].mu)["down"]["w"], np.asarray(want_state[0].mu["down"]["w"]),
                               rtol=1e-5, atol=1e-7)


def test_a_dtensor_whose_array_another_shape_is_refused_naming_its_path() -> None:
    """``optax.adafactor(...).init(params)`` maps ``jnp.zeros`` of other shapes over the
    DTensors' arrays (its factored row and column statistics), leaving DTensors whose
    layout does not describe their array: predict and apply refuse them at that path
    (DTensor.checked), not run a program built for another array; the state built under
    apply is laid out and trains."""
    optimizer = optax.adafactor(1e-2)
    params = p2j.init_pytree(_init, KEY, MESH, PLAN)
    broken = optimizer.init(params)
    step = lambda p, s: optimizer.update(p, s, p)  # noqa: E731
    with pytest.raises(p2j.ShapeError, match=r"inputs\[1\]\[0\]\.v_row\['down'\]\['b'\]=.*"
                       r"init_optimizer_state\(optimizer, params\)"):
        p2j.predict(step, params, broken)
    with pytest.raises(p2j.ShapeError, match=r"args\[1\]\[0\]\.v_row\['down'\]\['b'\]="):
        p2j.apply(step, params, broken)
    state = p2j.apply(optimizer.init, params)
    assert all(isinstance(leaf, DTensor) and leaf.array.shape == leaf.physical.array_shape
               for leaf in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, DTensor)))
    updates, _ = p2j.apply(step, params, state)
    plain = jax.jit(_init)(KEY)
    want, _ = optimizer.update(plain, optimizer.init(plain), plain)
    np.testing.assert_allclose(_full(updates)["up"]["w"], np.asarray(want["up"]["w"]), rtol=1e-5, atol=1e-7)


# -- optimizer state following its parameters: init_optimizer_state ---------------------------------------------------

STATE_PLAN = {**PLAN, r"odd": "S(0),S(1)"}  # odd: (10, 7) split unevenly over both mesh axes (padded)


def _state_init(key: jax.Array) -> dict:
    return {**_init(key), "odd": jax.random.normal(jax.random.fold_in(key, 7), (10, 7))}


def _state_loss(params, x, y):
    return _plain_loss(params, x, y) + 0.05 * jnp.mean(jnp.cos(params["odd"]))


def _state_step(optimizer):
    """An optax step of plain JAX code: the loss, its gradients, the update."""

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_state_loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


# Per optimizer: the placements of the state leaves that are not Replicate (keystr path -> torch form), on
# MESH (dp=4, tp=2): up/w (16, 24) R,S(1); up/b (24,) R,S(0); down/w (24, 16) R,S(0); down/b R; odd (10, 7) S(0),S(1).
_MOMENTS = {"['up']['w']": "R,S(1)", "['up']['b']": "R,S(0)", "['down']['w']": "R,S(0)", "['odd']": "S(0),S(1)"}
_STATE_CASES = {
    "adam": (lambda: optax.adam(1e-2), {f"[0].{m}{k}": v for m in ("mu", "nu") for k, v in _MOMENTS.items()}),
    # factored (every 2-d parameter): v_row drops the larger dim, v_col the other; 1-d ones keep v
    "adafactor": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4), {
        "[0].v_col['up']['w']": "R,S(0)", "[0].v_col['down']['w']": "R,S(0)", "[0].v['up']['b']": "R,S(0)",
        "[0].v_row['odd']": "R,S(0)", "[0].v_col['odd']": "S(0),R"}),
    "adafactor unfactored": (lambda: optax.adafactor(1e-2, factored=False),
                             {f"[0].v{k}": v for k, v in _MOMENTS.items()}),
    "novograd": (lambda: optax.novograd(1e-2), {f"[0].mu{k}": v for k, v in _MOMENTS.items()}),
    "zero_nans adam": (lambda: optax.chain(optax.zero_nans(), optax.adam(1e-2)),
                       {f"[1][0].{m}{k}": v for m in ("mu", "nu") for k, v in _MOMENTS.items()}),
    "mixed_precision adamw": (lambda: p2j.mixed_precision(optax.adamw(1e-2)),
                              {f"{m}{k}": v for m in (".master", ".inner[0].mu", ".inner[0].nu")
                               for k, v in _MOMENTS.items()}),
    "noisy_sgd (a PRNG key)": (lambda: optax.noisy_sgd(1e-2, key=jax.random.key(5)), {}),
}


def _assert_state(state, plain_state, expected: dict[str, str] | None = None, rtol: float = 0.0,
                  atol: float = 0.0) -> None:
    """Every leaf of ``state`` is a DTensor with the value of ``plain_state``'s leaf (equal,
    or within the tolerances), a typed PRNG key a key with the same key data; with
    ``expected`` (keystr path -> placements of the leaves that are not Replicate, every one
    of them found), each in that layout, each device holding its block only."""
    pairs = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, DTensor))[0]
    assert len(pairs) == len(jax.tree.leaves(plain_state))
    seen = set()
    for (path, leaf), want in zip(pairs, jax.tree.leaves(plain_state)):
        where = jax.tree_util.keystr(path)
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert not isinstance(leaf, DTensor) and leaf.dtype == want.dtype, where
            np.testing.assert_array_equal(jax.random.key_data(leaf), jax.random.key_data(want), err_msg=where)
            continue
        assert isinstance(leaf, DTensor), where
        assert leaf.shape == want.shape and leaf.dtype == want.dtype, where
        np.testing.assert_allclose(np.asarray(leaf.full_tensor()), np.asarray(want), rtol=rtol, atol=atol,
                                   err_msg=where)
        if expected is None:
            continue
        placements = expected.get(where, ",".join("R" * leaf.device_mesh.ndim))
        seen.add(where) if where in expected else None
        assert leaf.layout == p2j.resolve_layout(leaf.device_mesh, placements, leaf.ndim), (where, leaf.placements)
        mesh_shape = leaf.device_mesh.shape
        block = tuple(n // math.prod(mesh_shape[a] for a in axes)  # each device's block, padded where uneven
                      for n, axes in zip(leaf.physical.padded_shape, leaf.layout.dim_axes))
        assert {shard.data.shape for shard in leaf.array.addressable_shards} == {block}, where
        for rank in (0, 3, 7):
            assert leaf.to_local(rank).shape == leaf.layout.local_shape(leaf.shape, rank), where
    assert expected is None or seen == set(expected)


@pytest.mark.parametrize("name", list(_STATE_CASES))
def test_init_optimizer_state_follows_the_parameters_and_trains_like_plain_optax(name: str) -> None:
    """Every state leaf is a DTensor: of its parameter's shape in the parameter's layout,
    a factored statistic (the parameter's shape with a dim dropped) keeping the kept dim's
    split, others (counts, norms, flags, (1,) placeholders) Replicate; values equal plain
    optax's init on unsharded arrays, each device holds its block only, and steps run under
    apply with out_layouts=(params, state, None) keep every layout and match plain JAX.
    The init runs no collective."""
    make, expected = _STATE_CASES[name]
    optimizer = make()
    params = p2j.init_pytree(_state_init, KEY, MESH, STATE_PLAN)
    plain = jax.jit(_state_init)(KEY)
    with p2j.CommDebugMode() as comm:  # XLA makes every leaf on its devices: nothing gathered or moved
        state = p2j.init_optimizer_state(optimizer, params)
    assert comm.get_total_counts() == 0
    plain_state = optimizer.init(plain)
    _assert_state(state, plain_state, expected)

    step = _state_step(optimizer)
    out_layouts = (params, state, None)
    run = jax.jit(lambda *a: p2j.apply(step, *a, out_layouts=out_layouts))
    plain_step = jax.jit(step)
    def layouts_of(state: object) -> list[object]:  # of the DTensor leaves (a PRNG key changes each step)
        return [x.layout for x in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, DTensor)) if isinstance(x, DTensor)]

    layouts = layouts_of(state)
    for seed in range(3):
        x, y = _data(seed)
        params, state, loss = run(params, state, *(p2j.distribute_tensor(a, MESH, BATCH) for a in (x, y)))
        plain, plain_state, plain_loss = plain_step(plain, plain_state, x, y)
        assert float(loss.full_tensor()) == pytest.approx(float(plain_loss), rel=1e-5)
    assert layouts_of(state) == layouts
    _assert_state(state, plain_state, rtol=1e-4, atol=1e-6)
    for key in ("up", "down"):
        assert params[key]["w"].layout == p2j.plan_layouts(plain, MESH, STATE_PLAN)[key]["w"]
        np.testing.assert_allclose(np.asarray(params[key]["w"].full_tensor()), np.asarray(plain[key]["w"]),
                                   rtol=1e-4, atol=1e-6)


# On MESH (dp=4, tp=2), per real model (tests/models, Megatron plan) and optimizer: the placements of the state
# leaves that are not Replicate. The stacked LM's clip + adamw moments take their parameters' layouts (stacked
# weights: dim 0 the layer). Adafactor (min_dim_size_to_factor=8) factors each weight of shape (..., m, n) into
# v_row (..., m) and v_col (..., n), dropping its larger last dim for v_row, its other one for v_col; each keeps
# the split of its kept dim: the stacked LM's (2, 32, 64) up and (2, 64, 32) down split their 64 over tp, so
# their v_col do; Llama's (64, 32) wk / wv split their 32 (v_row), w1 / w3 (64, 128) and w2 (128, 64) their 128
# (v_col); a square weight (Llama's (64, 64) wq, wo, embedding and output) reads either way: Replicate statistics.
_STACKED_MOMENTS = {"['head']": "R,S(1)", "['layers']['down']": "R,S(1)", "['layers']['up']": "R,S(2)"}
_LLAMA_LAYER = {"['attention']['wk']": ("v_row", "R,S(0)"), "['attention']['wv']": ("v_row", "R,S(0)"),
                "['feed_forward']['w1']": ("v_col", "R,S(0)"), "['feed_forward']['w3']": ("v_col", "R,S(0)"),
                "['feed_forward']['w2']": ("v_col", "R,S(0)")}
_REAL_CASES = {
    "stacked clip + adamw": (stacked, common.make_optimizer, {
        f"[1][0].{m}{k}": v for m in ("mu", "nu") for k, v in _STACKED_MOMENTS.items()}),
    "stacked adafactor": (stacked, lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8), {
        "[0].v_col['head']": "R,S(0)", "[0].v_col['layers']['down']": "R,S(1)",
        "[0].v_col['layers']['up']": "R,S(1)"}),
    "llama adafactor": (llama, lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8), {
        f"[0].{stat}['layers'][{i}]{k}": v for i in range(2) for k, (stat, v) in _LLAMA_LAYER.items()}),
}


@pytest.mark.parametrize("name", list(_REAL_CASES))
def test_init_optimizer_state_on_real_models(name: str) -> None:
    """init_optimizer_state on tests/models' scan-over-layers stacked LM (clip + adamw and
    adafactor) and Llama (adafactor): the state's layouts follow the parameters (stacked
    weights and factored statistics included), its values equal plain optax's init; two
    training steps run under apply keep every layout and match plain JAX's steps (loss,
    parameters, state). Not GPT-2 with adafactor: its attention key bias's gradient is
    zero up to rounding and adafactor normalizes it by its second moment, so rounding noise
    moves that bias by whole updates (sharded and plain differ there by 3e-5)."""
    module, make, expected = _REAL_CASES[name]
    optimizer = make()
    cfg = module.Config()
    plain = module.init(jax.random.key(0), cfg)
    params = p2j.distribute_pytree(plain, MESH, module.megatron_plan())
    state, plain_state = p2j.init_optimizer_state(optimizer, params), optimizer.init(plain)
    _assert_state(state, plain_state, expected)

    step = partial(module.train_step, cfg=cfg, optimizer=optimizer)
    run = jax.jit(lambda *a: p2j.apply(step, *a, out_layouts=(params, state, None)))
    plain_step = jax.jit(step)
    layouts = p2j.layouts_of((params, state))
    for seed in range(2):
        batch = common.batch(seed, 4, cfg.seq, cfg.vocab)
        params, state, loss = run(params, state, *(p2j.distribute_tensor(a, MESH, BATCH) for a in batch))
        plain, plain_state, plain_loss = plain_step(plain, plain_state, *batch)
        assert float(loss.full_tensor()) == pytest.approx(float(plain_loss), rel=1e-5)
    assert p2j.layouts_of((params, state)) == layouts
    _assert_state(state, plain_state, rtol=1e-4, atol=1e-6)
    _assert_state(params, plain, rtol=1e-4, atol=1e-6)


def test_state_layouts_keep_the_splits_of_kept_dims_and_agree_on_ambiguous_ones() -> None:
    """The rule on shapes alone: a square parameter's (8,) statistic could keep either dim,
    so its split is kept only where both readings agree (Replicate); keepdims-style
    (8, 1) and (1, 8) keep dim 0's and dim 1's split; a Partial parameter's moments are
    Replicate on that mesh dim; optax.sm3's per-dim accumulators (a list per parameter)
    follow theirs, as do multi_transform's and masked's states (MaskedNode where a
    parameter is not theirs); a state built by optimizer.init on the DTensors (Adam's,
    same shapes) gets the layouts init_optimizer_state gives."""
    square = p2j.distribute_tensor(np.ones((8, 8), np.float32), MESH, "S(0),S(1)")
    partial = p2j.distribute_tensor(np.ones((8, 6), np.float32), MESH, [p2j.Partial(), Shard(1)])
    params = {"square": square, "partial": partial}
    state = {"stats": {"square": jnp.zeros(8), "partial": jnp.zeros((8, 6))},
             "keepdims": {"square": (jnp.zeros((8, 1)), jnp.zeros((1, 8))), "partial": jnp.zeros((1, 6))},
             "count": jnp.zeros((), jnp.int32)}
    got = jax.tree.map(str, p2j.state_layouts(state, params), is_leaf=lambda v: isinstance(v, p2j.Layout))
    rendered = lambda text, ndim: str(p2j.resolve_layout(MESH, text, ndim))  # noqa: E731
    assert got == {"stats": {"square": rendered("R,R", 1), "partial": rendered("R,S(1)", 2)},
                   "keepdims": {"square": (rendered("S(0),R", 2), rendered("R,S(1)", 2)), "partial": rendered("R,S(1)", 2)},
                   "count": rendered("R,R", 0)}

    params = p2j.init_pytree(_init, KEY, MESH, PLAN)
    sm3 = p2j.init_optimizer_state(optax.sm3(1e-2), params)
    assert [a.placements for a in sm3[0].mu["up"]["w"]] == [(Replicate(), Replicate()), (Replicate(), Shard(0))]
    assert [a.placements for a in sm3[0].mu["down"]["w"]] == [(Replicate(), Shard(0)), (Replicate(), Replicate())]
    # optax.multi_transform / optax.masked leave MaskedNode (no leaves) where a parameter is not theirs
    labels = {"up": {"w": "adam", "b": "factored"}, "down": {"w": "factored", "b": "adam"}}
    multi = optax.multi_transform({"adam": optax.adam(1e-2), "factored": optax.masked(
        optax.adafactor(1e-2, min_dim_size_to_factor=4), {"up": {"w": False, "b": True}, "down": {"w": True, "b": True}})},
        labels)
    layouts = p2j.state_layouts(jax.eval_shape(multi.init, jax.jit(_init)(KEY)), params).inner_states
    assert layouts["adam"].inner_state[0].mu["up"]["w"] == params["up"]["w"].layout
    assert isinstance(layouts["adam"].inner_state[0].mu["down"]["w"], optax.MaskedNode)
    factored = layouts["factored"].inner_state.inner_state[0]
    assert factored.v_col["down"]["w"] == p2j.resolve_layout(MESH, "R,S(0)", 1)
    assert factored.v["up"]["b"] == params["up"]["b"].layout
    adam = optax.adam(1e-2)
    eager = jax.tree.leaves(p2j.state_layouts(adam.init(params), params), is_leaf=lambda v: isinstance(v, p2j.Layout))
    built = p2j.init_optimizer_state(adam, params)
    assert eager == [leaf.layout for leaf in jax.tree.leaves(built, is_leaf=lambda v: isinstance(v, DTensor))]


def test_a_plain_jitted_step_runs_the_update_of_a_factored_state_under_apply() -> None:
    """In a plain ``jax.jit`` step (model code on p2j.model_arrays, optax.apply_updates on
    the DTensors), the update alone runs under apply: it sees the logical arrays, where
    optax's own tree.map of gradients with state leaves of other shapes fails on the
    DTensors' pytree metadata. Losses, parameters and state match plain JAX; layouts kept."""
    optimizer = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    params = p2j.init_pytree(_state_init, KEY, MESH, STATE_PLAN)
    plain = jax.jit(_state_init)(KEY)
    state, plain_state = p2j.init_optimizer_state(optimizer, params), optimizer.init(plain)
    layouts = p2j.layouts_of(state)

    def loss(params, x, y):
        return _state_loss(*p2j.model_arrays((params, x, y)))

    @jax.jit
    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        with pytest.raises(ValueError, match="pytree structure"):
            optimizer.update(grads, state, params)
        updates, state = p2j.apply(optimizer.update, grads, state, params, out_layouts=(params, state))
        return optax.apply_updates(params, updates), state, value

    plain_step = jax.jit(_state_step(optimizer))
    for seed in range(3):
        x, y = _data(seed)
        params, state, value = step(params, state, *(p2j.distribute_tensor(a, MESH, BATCH) for a in (x, y)))
        plain, plain_state, plain_value = plain_step(plain, plain_state, x, y)
        assert float(value) == pytest.approx(float(plain_value), rel=1e-5)
    assert p2j.layouts_of(state) == layouts
    np.testing.assert_allclose(np.asarray(params["odd"].full_tensor()), np.asarray(plain["odd"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state[0].v_col["up"]["w"].full_tensor()),
                               np.asarray(plain_state[0].v_col["up"]["w"]), rtol=1e-4, atol=1e-7)
