"""GPT-2 in pure JAX, as public single-file implementations (nanoGPT ports) write it.

The transformer blocks' parameters are stacked along a leading layer axis and run with
``lax.scan``; dropout draws from a PRNG key split per layer; embeddings are ``table[idx]``;
the loss is cross-entropy with ``take_along_axis``; training is ``value_and_grad`` plus
optax (global-norm clipping, AdamW). ``attention="dpa"`` uses
``jax.nn.dot_product_attention`` instead of the hand-written causal attention.
"""

from __future__ import annotations

import math
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
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1
    attention: str = "manual"  # or "dpa": jax.nn.dot_product_attention


def init(key: jax.Array, cfg: Config) -> Params:
    d, L = cfg.d_model, cfg.layers
    keys = jax.random.split(key, 6)

    def normal(k: jax.Array, shape: tuple[int, ...], std: float = 0.02) -> jax.Array:
        return std * jax.random.normal(k, shape, jnp.float32)

    proj_std = 0.02 / math.sqrt(2 * L)
    return {
        "wte": normal(keys[0], (cfg.vocab, d)),
        "wpe": normal(keys[1], (cfg.seq, d), 0.01),
        "blocks": {
            "ln1": {"scale": jnp.ones((L, d)), "bias": jnp.zeros((L, d))},
            "attn": {
                "c_attn": {"kernel": normal(keys[2], (L, d, 3 * d)), "bias": jnp.zeros((L, 3 * d))},
                "c_proj": {"kernel": normal(keys[3], (L, d, d), proj_std), "bias": jnp.zeros((L, d))},
            },
            "ln2": {"scale": jnp.ones((L, d)), "bias": jnp.zeros((L, d))},
            "mlp": {
                "c_fc": {"kernel": normal(keys[4], (L, d, 4 * d)), "bias": jnp.zeros((L, 4 * d))},
                "c_proj": {"kernel": normal(keys[5], (L, 4 * d, d), proj_std), "bias": jnp.zeros((L, d))},
            },
        },
        "ln_f": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
    }


def layer_norm(x: jax.Array, p: Params, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def dropout(key: jax.Array, x: jax.Array, rate: float, train: bool) -> jax.Array:
    if not train or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def linear(x: jax.Array, p: Params) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def attention(x: jax.Array, p: Params, key: jax.Array, cfg: Config, train: bool) -> jax.Array:
    B, T, C = x.shape
    q, k, v = jnp.split(linear(x, p["c_attn"]), 3, axis=-1)
    q, k, v = (t.reshape(B, T, cfg.heads, C // cfg.heads) for t in (q, k, v))
    if cfg.attention == "dpa":
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:
        att = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(C // cfg.heads)
        mask = jnp.tril(jnp.ones((T, T), dtype=bool))
        att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
        att = jax.nn.softmax(att, axis=-1)
        att = dropout(key, att, cfg.dropout, train)
        y = jnp.einsum("bhts,bshd->bthd", att, v)
    return linear(y.reshape(B, T, C), p["c_proj"])


def mlp(x: jax.Array, p: Params) -> jax.Array:
    return linear(jax.nn.gelu(linear(x, p["c_fc"]), approximate=True), p["c_proj"])


def forward(params: Params, idx: jax.Array, key: jax.Array, cfg: Config, train: bool = True) -> jax.Array:
    """Logits (batch, seq, vocab); the output projection is tied to ``wte``."""
    B, T = idx.shape
    x = params["wte"][idx] + params["wpe"][jnp.arange(T)]
    key, drop_key = jax.random.split(key)
    x = dropout(drop_key, x, cfg.dropout, train)

    def block(x: jax.Array, layer: tuple[Params, jax.Array]) -> tuple[jax.Array, None]:
        p, k = layer
        k_attn, k_resid1, k_resid2 = jax.random.split(k, 3)
        x = x + dropout(k_resid1, attention(layer_norm(x, p["ln1"]), p["attn"], k_attn, cfg, train), cfg.dropout, train)
        x = x + dropout(k_resid2, mlp(layer_norm(x, p["ln2"]), p["mlp"]), cfg.dropout, train)
        return x, None

    x, _ = lax.scan(block, x, (params["blocks"], jax.random.split(key, cfg.layers)))
    x = layer_norm(x, params["ln_f"])
    return x @ params["wte"].T


def loss(params: Params, idx: jax.Array, targets: jax.Array, key: jax.Array, cfg: Config) -> jax.Array:
    logits = forward(params, idx, key, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def train_step(
    params: Params, opt_state: Any, idx: jax.Array, targets: jax.Array, key: jax.Array, cfg: Config,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Params, Any, jax.Array]:
    optimizer = optimizer or make_optimizer()
    value, grads = jax.value_and_grad(partial(loss, cfg=cfg))(params, idx, targets, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron-LM's tensor parallelism on mesh axis ``tp`` (every other axis, e.g. data
    parallel ``dp``, replicates the parameters): attention and MLP input projections
    column-parallel, output projections row-parallel, the vocabulary-parallel embedding.
    Stacked biases are 2-D (layers, out), so they get explicit placements."""
    return {
        r"wte": rowwise(tp),  # (vocab, d): vocab split
        r"blocks/(attn/c_attn|mlp/c_fc)/kernel": colwise(tp),
        r"blocks/(attn/c_attn|mlp/c_fc)/bias": f"None,{tp}",
        r"blocks/(attn|mlp)/c_proj/kernel": rowwise(tp),
    }
