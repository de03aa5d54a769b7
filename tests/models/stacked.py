"""A decoder LM as scan-over-layers training code writes it (MaxText / levanter style), not
tuned to this library: the layers' weights stacked on a leading dim and run under
``lax.scan`` (optionally rematerialized with ``jax.checkpoint``), a replicated embedding
table looked up with ``table[idx]``, RMSNorm computed in float32, a SiLU MLP, a
vocab-parallel head, cross-entropy with ``take_along_axis``; compute in float32 or
bfloat16 with float32 parameters; gradients optionally accumulated over microbatches
under ``lax.scan``, ``lax.fori_loop`` or ``lax.while_loop``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from placements2jax import colwise, rowwise

from .common import make_optimizer

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    hidden: int = 64
    layers: int = 2
    remat: bool = False  # jax.checkpoint around each layer
    dtype: str = "float32"  # compute dtype ("bfloat16": mixed precision, float32 parameters)
    microbatches: int = 1  # > 1: gradients accumulated under lax.scan
    accumulate: str = "scan"  # or "fori_loop" / "while_loop", indexing the microbatches
    unroll: int = 1  # the layer scan's unroll
    norm_eps: float = 1e-5


def init(key: jax.Array, cfg: Config) -> Params:
    k_emb, k_up, k_down, k_head = jax.random.split(key, 4)
    return {
        "embedding": jax.random.normal(k_emb, (cfg.vocab, cfg.dim), jnp.float32),
        "layers": {
            "norm": jnp.ones((cfg.layers, cfg.dim)),
            "up": jax.random.normal(k_up, (cfg.layers, cfg.dim, cfg.hidden)) / cfg.dim ** 0.5,
            "down": jax.random.normal(k_down, (cfg.layers, cfg.hidden, cfg.dim)) / cfg.hidden ** 0.5,
        },
        "head": jax.random.normal(k_head, (cfg.dim, cfg.vocab)) / cfg.dim ** 0.5,
    }


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


def layer(x: jax.Array, p: Params, cfg: Config) -> tuple[jax.Array, None]:
    h = rms_norm(x, p["norm"], cfg.norm_eps)
    h = jax.nn.silu(h @ p["up"].astype(x.dtype)) @ p["down"].astype(x.dtype)
    return x + h, None


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["embedding"][tokens].astype(cfg.dtype)
    body = partial(layer, cfg=cfg)
    x, _ = lax.scan(jax.checkpoint(body) if cfg.remat else body, x, params["layers"], unroll=cfg.unroll)
    logits = (x @ params["head"].astype(x.dtype)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def grads_and_loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> tuple[Params, jax.Array]:
    """The mean loss and its gradients, accumulated over ``cfg.microbatches``."""
    value_and_grad = jax.value_and_grad(partial(loss, cfg=cfg))
    if cfg.microbatches == 1:
        value, grads = value_and_grad(params, tokens, targets)
        return grads, value

    def accumulate(acc: Params, batch: tuple[jax.Array, jax.Array]) -> tuple[Params, jax.Array]:
        value, grads = value_and_grad(params, *batch)
        return jax.tree.map(jnp.add, acc, grads), value

    split = lambda a: a.reshape(cfg.microbatches, -1, *a.shape[1:])  # noqa: E731
    zeros = jax.tree.map(jnp.zeros_like, params)
    if cfg.accumulate in ("fori_loop", "while_loop"):
        def step(i: jax.Array, carry: tuple[Params, jax.Array]) -> tuple[Params, jax.Array]:
            acc, total = carry
            acc, value = accumulate(acc, (split(tokens)[i], split(targets)[i]))
            return acc, total + value

        start = (zeros, jnp.zeros((), jnp.float32))
        if cfg.accumulate == "fori_loop":  # a static trip count: JAX runs it as a scan
            grads, total = lax.fori_loop(0, cfg.microbatches, step, start)
        else:
            _, grads, total = lax.while_loop(
                lambda c: c[0] < cfg.microbatches, lambda c: (c[0] + 1, *step(c[0], c[1:])), (0, *start)
            )
        return jax.tree.map(lambda g: g / cfg.microbatches, grads), total / cfg.microbatches
    grads, values = lax.scan(accumulate, zeros, (split(tokens), split(targets)))
    return jax.tree.map(lambda g: g / cfg.microbatches, grads), values.mean()


def train_step(
    params: Params, opt_state: Any, tokens: jax.Array, targets: jax.Array, cfg: Config,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Params, Any, jax.Array]:
    optimizer = optimizer or make_optimizer()
    grads, value = grads_and_loss(params, tokens, targets, cfg)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron tensor parallelism on mesh axis ``tp`` for the stacked weights (dim 0 is
    the layer): ``up`` column-parallel, ``down`` row-parallel, the head vocab-parallel; the
    embedding table and the norms replicated (unmatched: as scan-over-layers code often
    leaves them)."""
    return {r"layers/up": colwise(tp), r"layers/down": rowwise(tp), r"head": colwise(tp)}
