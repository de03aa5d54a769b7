"""Megatron-laid adamw training steps of the test models and their arguments, as DTensors
(for ``apply`` and ``predict``) and as the plain ``jax.Array``s ``jax.jit`` takes (the
same blocks on the Auto twin of the mesh: JAX's Explicit typing refuses ``table[idx]``
without an ``out_sharding``), shared by the tests and benchmarks/bench_operators.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from placements2jax import (
    DeviceMesh, DTensor, colwise, distribute_pytree, distribute_tensor, fully_shard, rowwise, state_layouts,
)
from placements2jax.dtensor import auto_twin_of

from . import (
    clip, cnn, common, dpo, gemma, gemma3, gpt2, llama, llama_scan, lora, mamba, mamba2, mla, moe, rwkv, stacked, t5,
)


@dataclass(frozen=True)
class Step:
    """``fn(params, opt_state, *batch)`` -> (params, opt_state, loss); ``args`` its DTensor
    arguments; ``out_layouts`` keeps the parameters' and optimizer state's layouts."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]

    @property
    def out_layouts(self) -> tuple[Any, ...]:
        return (self.args[0], self.args[1], None)

    @property
    def program(self) -> tuple[Callable[..., Any], tuple[Any, ...], tuple[Any, ...]]:
        """``(fn, args, out_layouts)``: what predict, check and apply take."""
        return self.fn, self.args, self.out_layouts

    def plain_args(self) -> tuple[Any, ...]:
        """The arguments as jax.Arrays on the Auto twin (same blocks, same specs)."""
        return jax.tree.map(
            lambda x: jax.device_put(x.to_jax(), _auto(x)) if isinstance(x, DTensor) else x, self.args,
            is_leaf=_is_dtensor,
        )

    def out_shardings(self) -> tuple[Any, ...]:
        """The parameters' and state's shardings (Auto twin), the loss (and a PRNG key in
        the state) free."""
        return (*jax.tree.map(lambda x: _auto(x) if _is_dtensor(x) else None, self.args[:2], is_leaf=_is_dtensor), None)

    def plain_jit(self, fresh: bool = False) -> Any:
        """``jax.jit`` of the step with the parameters and state kept in their shardings
        (``fresh``: of a new function object, so that JAX traces and compiles anew)."""
        return jax.jit((lambda *a: self.fn(*a)) if fresh else self.fn, out_shardings=self.out_shardings())


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def _auto(x: DTensor) -> NamedSharding:
    return NamedSharding(auto_twin_of(x.device_mesh.to_jax()), x.to_jax().sharding.spec)


def mlp_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.nn.gelu(x @ params["up"]) @ params["down"] - y) ** 2)


def mlp_step(
    params: Any, opt_state: Any, x: jax.Array, y: jax.Array, optimizer: optax.GradientTransformation | None = None
) -> tuple[Any, Any, jax.Array]:
    """A Megatron MLP's step (small: for quick runs) under ``optimizer`` (default common.make_optimizer()'s
    clip + adamw)."""
    value, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    updates, opt_state = (optimizer or common.make_optimizer()).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def training_step(
    model: str, mesh: DeviceMesh, optimizer: optax.GradientTransformation | None = None, **config: Any
) -> Step:
    """The adamw step of ``model`` ("gpt2", "llama", "gemma", "stacked", "llama_scan", "moe", "mamba", "mla",
    "rwkv", "gemma3", "mamba2", "lora", "clip" (its batch images and captions), "dpo" (its frozen reference
    after the state, its batch preference pairs and their loss masks) or "t5" (its batch encoder inputs, decoder
    inputs and targets), ``config`` overriding its
    Config; "mlp": :func:`mlp_step`) with the Megatron plan on ``mesh`` (its ``tp`` axis) and a batch of 4 split
    over its ``dp`` axis if it has one (else replicated, "mlp": of 8); ``optimizer``: another update than the
    model's own ``make_optimizer()`` (lora's: adamw on the adapters alone) or else common.make_optimizer()'s clip
    + adamw. "cnn":
    tests/models/cnn.py's step (optax.adamw) on its channel plan, its batch of images."""
    batch_placements = ",".join("S(0)" if name == "dp" else "R" for name in mesh.mesh_dim_names)
    if model == "mlp":
        rng = np.random.default_rng(0)
        plain = {"up": rng.normal(size=(16, 64)).astype(np.float32) / 4,
                 "down": rng.normal(size=(64, 16)).astype(np.float32) / 8}
        params = distribute_pytree(plain, mesh, {"up": colwise("tp"), "down": rowwise("tp")})
        state = common.distribute_state((optimizer or common.make_optimizer()).init(plain), params)
        batch = [
            distribute_tensor(rng.normal(size=(8, 16)).astype(np.float32), mesh, batch_placements) for _ in range(2)
        ]
        return Step(model, partial(mlp_step, optimizer=optimizer) if optimizer else mlp_step, (params, state, *batch))
    if model == "cnn":
        cfg = cnn.Config(**config)
        plain = cnn.init(jax.random.key(0), cfg)
        params = distribute_pytree(plain, mesh, cnn.channel_plan(cfg))
        optimizer = optimizer or cnn.make_optimizer()
        state = common.distribute_state(optimizer.init(plain), params)
        batch = [distribute_tensor(a, mesh, batch_placements) for a in cnn.batch(0, cfg)]
        return Step(model, partial(cnn.train_step, optimizer=optimizer), (params, state, *batch))
    modules = {"gpt2": gpt2, "llama": llama, "gemma": gemma, "stacked": stacked, "llama_scan": llama_scan, "moe": moe,
               "mamba": mamba, "mla": mla, "rwkv": rwkv, "gemma3": gemma3,
               "mamba2": mamba2, "lora": lora, "clip": clip, "dpo": dpo, "t5": t5}
    module = modules[model]
    if module is moe and config.get("dispatch") == "shard_map":  # its region runs on the mesh's Auto twin
        config = {**config, "ep_mesh": auto_twin_of(mesh.to_jax())}
    cfg = module.Config(**config)
    plain = module.init(jax.random.key(0), cfg)
    plan = moe.megatron_plan(cfg.dispatch) if module is moe else module.megatron_plan()
    params = distribute_pytree(plain, mesh, plan)
    optimizer = optimizer or getattr(module, "make_optimizer", common.make_optimizer)()
    state = common.distribute_state(optimizer.init(plain), params)
    reference = (distribute_pytree(module.init(jax.random.key(1), cfg), mesh, plan),) if module is dpo else ()
    arrays = module.batch(0, cfg) if module in (clip, dpo, t5) else common.batch(0, 4, cfg.seq, cfg.vocab)
    batch = [distribute_tensor(a, mesh, batch_placements) for a in arrays]
    extra = (jax.random.key(2),) if model == "gpt2" else ()
    return Step(
        model, partial(module.train_step, cfg=cfg, optimizer=optimizer), (params, state, *reference, *batch, *extra)
    )


def fully_sharded(step: Step, axis: str = "dp") -> Step:
    """``step`` with its parameters fully sharded over mesh axis ``axis`` on top of their
    plan (ZeRO-3 x tensor parallelism: :func:`placements2jax.fully_shard`) and its optimizer
    state laid out like them (:func:`placements2jax.state_layouts`), the batch as it was."""
    params, state, *batch = step.args
    params = fully_shard(params, jax.tree.leaves(params, is_leaf=_is_dtensor)[0].device_mesh, axis)
    state = jax.tree.map(lambda x, layout: x.redistribute(placements=layout), state, state_layouts(state, params),
                         is_leaf=_is_dtensor)
    return replace(step, args=(params, state, *batch))
