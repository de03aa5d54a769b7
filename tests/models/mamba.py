"""A Mamba-style selective state-space LM in pure JAX, as public ports (mamba-minimal,
mamba.py's JAX port) write it: an input projection to the SSM branch and its gate, a
causal depthwise conv1d (``lax.conv_general_dilated`` with one group per channel), the
input-dependent step size, B and C (``x_proj`` then ``dt_proj`` + softplus), the
discretized recurrence ``h_t = exp(dt A) h_{t-1} + dt B x_t`` computed in parallel with
``jax.lax.associative_scan`` (its strided slices ``x[::2]``, ``x[1::2]``, interleaving
pads and concatenates), the readout ``C h_t + D x``, gated by ``silu(z)``. Tensor
parallelism splits the inner channels over ``tp`` (the recurrence is per channel):
in_proj, the conv, dt_proj, A, D column-parallel, x_proj and out_proj row-parallel."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from placements2jax import Replicate, Shard, colwise, rowwise

from .common import train_step as common_train_step

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    inner: int = 64  # expand 2
    state: int = 8
    conv: int = 4
    dt_rank: int = 4
    layers: int = 1


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 2 + 5 * cfg.layers))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])

    a = jnp.broadcast_to(jnp.arange(1, cfg.state + 1, dtype=jnp.float32), (cfg.inner, cfg.state))
    layers = [
        {
            "norm": jnp.ones((cfg.dim,)),
            "in_proj": dense((cfg.dim, 2, cfg.inner)),  # the SSM branch and its gate
            "conv_weight": dense((cfg.conv, cfg.inner)),
            "conv_bias": jnp.zeros((cfg.inner,)),
            "x_proj": dense((cfg.inner, cfg.dt_rank + 2 * cfg.state)),
            "dt_proj": dense((cfg.dt_rank, cfg.inner)),
            "dt_bias": jnp.full((cfg.inner,), -2.0),
            "A_log": jnp.log(a),
            "D": jnp.ones((cfg.inner,)),
            "out_proj": dense((cfg.inner, cfg.dim)),
        }
        for _ in range(cfg.layers)
    ]
    return {"embedding": jax.random.normal(next(keys), (cfg.vocab, cfg.dim)) * 0.02, "layers": layers,
            "norm_f": jnp.ones((cfg.dim,)), "head": dense((cfg.dim, cfg.vocab))}


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """The inner channels over ``tp``: in_proj's, the conv's, dt_proj's, A's and D's
    channels split, x_proj and out_proj contract them (row-parallel), the head
    vocab-parallel; the embedding and norms replicated."""
    return {
        r"layers/\d+/in_proj": [Replicate(), Shard(2)],
        r"layers/\d+/(conv_weight|conv_bias|dt_proj|dt_bias|D)": colwise(tp),
        r"layers/\d+/A_log": [Replicate(), Shard(0)],
        r"layers/\d+/(x_proj|out_proj)": rowwise(tp),
        r"head": colwise(tp),
    }


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * weight


def causal_conv(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """Depthwise causal conv1d over time: (batch, seq, channels), ``weight`` (width, channels)."""
    width, channels = weight.shape
    out = lax.conv_general_dilated(
        x, weight[:, None, :], window_strides=(1,), padding=[(width - 1, 0)],
        dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=channels,
    )
    return out + bias


def selective_scan(u: jax.Array, delta: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
                   d: jax.Array) -> jax.Array:
    """``y_t = C_t h_t + D u_t``, ``h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t``: u, delta
    (batch, seq, inner), a (inner, state), b, c (batch, seq, state)."""
    decay = jnp.exp(delta[..., None] * a)  # (batch, seq, inner, state)
    drive = (delta * u)[..., None] * b[:, :, None, :]

    def combine(left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        a_l, b_l = left
        a_r, b_r = right
        return a_l * a_r, a_r * b_l + b_r

    _, h = lax.associative_scan(combine, (decay, drive), axis=1)
    return jnp.einsum("bldn,bln->bld", h, c) + u * d


def mixer(x: jax.Array, p: Params, cfg: Config) -> jax.Array:
    xz = jnp.einsum("bld,dsi->bsli", x, p["in_proj"])
    u, z = xz[:, 0], xz[:, 1]
    u = jax.nn.silu(causal_conv(u, p["conv_weight"], p["conv_bias"]))
    dt, b, c = jnp.split(u @ p["x_proj"], [cfg.dt_rank, cfg.dt_rank + cfg.state], axis=-1)
    delta = jax.nn.softplus(dt @ p["dt_proj"] + p["dt_bias"])
    y = selective_scan(u, delta, -jnp.exp(p["A_log"]), b, c, p["D"])
    return (y * jax.nn.silu(z)) @ p["out_proj"]


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["embedding"][tokens]
    for p in params["layers"]:
        x = x + mixer(rms_norm(x, p["norm"]), p, cfg)
    logits = rms_norm(x, params["norm_f"]) @ params["head"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)
