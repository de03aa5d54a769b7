"""Llama under ``lax.scan`` over stacked layers, as MaxText-style JAX code writes it: the
layers' weights stacked on a leading dim, RMSNorm, rotary embeddings on real
(cos, sin) halves, grouped-query attention (fewer key/value heads, ``jnp.repeat``ed),
SwiGLU, an untied head; the attention either written out (einsum, causal ``jnp.where``)
or ``jax.nn.dot_product_attention``: ``is_causal=True``, with a boolean mask (causal and
the batch's padding tokens, id 0), or given the key/value heads unrepeated (its own
grouped-query attention); compute in float32 or bfloat16 with float32 parameters."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from placements2jax import colwise, rowwise

from .common import train_step as common_train_step

Params = dict[str, Any]


# jax.nn.dot_product_attention given the repeated heads with is_causal=True, the same with a causal-and-padding
# mask, or the key/value heads unrepeated (it groups the query heads itself)
ATTENTIONS = ("dot_product_attention", "masked dot_product_attention", "gqa dot_product_attention")


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 64
    heads: int = 8
    kv_heads: int = 4  # a multiple of tp: tensor parallelism splits the key/value heads too
    layers: int = 2
    hidden: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention: str = "einsum"  # or one of jax.nn.dot_product_attention's ATTENTIONS
    dtype: str = "float32"  # compute dtype ("bfloat16": mixed precision, float32 parameters)


def init(key: jax.Array, cfg: Config) -> Params:
    head_dim = cfg.dim // cfg.heads
    keys = iter(jax.random.split(key, 9))

    def dense(*shape: int) -> jax.Array:
        return jax.random.normal(next(keys), (cfg.layers, *shape), jnp.float32) / shape[0] ** 0.5

    return {
        "embedding": jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32),
        "layers": {
            "attention_norm": jnp.ones((cfg.layers, cfg.dim)),
            "wq": dense(cfg.dim, cfg.heads * head_dim),
            "wk": dense(cfg.dim, cfg.kv_heads * head_dim),
            "wv": dense(cfg.dim, cfg.kv_heads * head_dim),
            "wo": dense(cfg.heads * head_dim, cfg.dim),
            "ffn_norm": jnp.ones((cfg.layers, cfg.dim)),
            "w1": dense(cfg.dim, cfg.hidden),
            "w3": dense(cfg.dim, cfg.hidden),
            "w2": dense(cfg.hidden, cfg.dim),
        },
        "norm": jnp.ones((cfg.dim,)),
        "output": jax.random.normal(next(keys), (cfg.dim, cfg.vocab), jnp.float32) / cfg.dim ** 0.5,
    }


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of ``x`` (batch, seq, heads, head_dim) on its two halves."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]  # (seq, head_dim / 2)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return rotated.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, padding: jax.Array, cfg: Config) -> jax.Array:
    """Causal attention of (batch, seq, heads, head_dim) queries on as many key/value heads
    (as few with "gqa dot_product_attention"); ``padding`` (batch, seq) is True at the
    tokens the masked attention ignores."""
    if cfg.attention in ("dot_product_attention", "gqa dot_product_attention"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    if cfg.attention == "masked dot_product_attention":
        causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool))
        return jax.nn.dot_product_attention(q, k, v, mask=causal[None, None] & ~padding[:, None, None, :])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min).astype(jnp.float32), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)


def layer(x: jax.Array, p: Params, padding: jax.Array, cfg: Config) -> tuple[jax.Array, None]:
    b, t, _ = x.shape
    head_dim = cfg.dim // cfg.heads
    w = jax.tree.map(lambda a: a.astype(x.dtype), p)
    h = rms_norm(x, p["attention_norm"], cfg.norm_eps)
    q = rope((h @ w["wq"]).reshape(b, t, -1, head_dim), cfg.rope_theta)
    k = rope((h @ w["wk"]).reshape(b, t, -1, head_dim), cfg.rope_theta)
    v = (h @ w["wv"]).reshape(b, t, -1, head_dim)
    if cfg.attention != "gqa dot_product_attention":
        repeats = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    x = x + attend(q, k, v, padding, cfg).reshape(b, t, -1) @ w["wo"]
    h = rms_norm(x, p["ffn_norm"], cfg.norm_eps)
    return x + (jax.nn.silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"], None


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["embedding"][tokens].astype(cfg.dtype)
    x, _ = lax.scan(partial(layer, padding=tokens == 0, cfg=cfg), x, params["layers"])
    x = rms_norm(x, params["norm"], cfg.norm_eps)
    logits = (x @ params["output"].astype(x.dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron tensor parallelism of the stacked weights (dim 0 the layer): q, k, v, w1, w3
    column-parallel (heads split), wo and w2 row-parallel, the head vocab-parallel; the
    embedding and norms replicated."""
    return {r"layers/(wq|wk|wv|w1|w3)": colwise(tp), r"layers/(wo|w2)": rowwise(tp), r"output": colwise(tp)}
