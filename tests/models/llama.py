"""Llama in pure JAX, as public ports of the reference implementation write it: RMSNorm,
rotary embeddings as complex numbers (``freqs_cis``, the pairs built with ``jnp.stack``),
SwiGLU feed-forward, grouped-query attention (fewer key/value heads, repeated), a Python
loop over a list of layers, untied output head."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from placements2jax import colwise, rowwise

from .common import train_step as common_train_step

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 64
    heads: int = 8
    kv_heads: int = 4  # tensor parallelism splits kv heads too: a multiple of tp
    layers: int = 2
    hidden: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def init(key: jax.Array, cfg: Config) -> Params:
    head_dim = cfg.dim // cfg.heads
    keys = iter(jax.random.split(key, 2 + 7 * cfg.layers))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[0])

    layers = [
        {
            "attention_norm": jnp.ones((cfg.dim,)),
            "attention": {
                "wq": dense((cfg.dim, cfg.heads * head_dim)),
                "wk": dense((cfg.dim, cfg.kv_heads * head_dim)),
                "wv": dense((cfg.dim, cfg.kv_heads * head_dim)),
                "wo": dense((cfg.heads * head_dim, cfg.dim)),
            },
            "ffn_norm": jnp.ones((cfg.dim,)),
            "feed_forward": {
                "w1": dense((cfg.dim, cfg.hidden)),
                "w3": dense((cfg.dim, cfg.hidden)),
                "w2": dense((cfg.hidden, cfg.dim)),
            },
        }
        for _ in range(cfg.layers)
    ]
    return {
        "tok_embeddings": jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32),
        "layers": layers,
        "norm": jnp.ones((cfg.dim,)),
        "output": dense((cfg.dim, cfg.vocab)),
    }


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def precompute_freqs_cis(head_dim: int, seq: int, theta: float) -> jax.Array:
    freqs = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(seq, dtype=jnp.float32), freqs)
    return jnp.exp(1j * angles)  # complex64 (seq, head_dim // 2)


def apply_rotary_emb(x: jax.Array, freqs_cis: jax.Array) -> jax.Array:
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    xc = jax.lax.complex(pairs[..., 0], pairs[..., 1])
    rotated = xc * freqs_cis[None, :, None, :]
    out = jnp.stack([jnp.real(rotated), jnp.imag(rotated)], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def attention(x: jax.Array, p: Params, freqs_cis: jax.Array, cfg: Config) -> jax.Array:
    B, T, _ = x.shape
    head_dim = cfg.dim // cfg.heads
    q = (x @ p["wq"]).reshape(B, T, cfg.heads, head_dim)
    k = (x @ p["wk"]).reshape(B, T, cfg.kv_heads, head_dim)
    v = (x @ p["wv"]).reshape(B, T, cfg.kv_heads, head_dim)
    q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
    repeats = cfg.heads // cfg.kv_heads
    k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, -1)
    return out @ p["wo"]


def feed_forward(x: jax.Array, p: Params) -> jax.Array:
    return (jax.nn.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]


def forward(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    T = tokens.shape[1]
    h = params["tok_embeddings"][tokens]
    freqs_cis = precompute_freqs_cis(cfg.dim // cfg.heads, T, cfg.rope_theta)
    for layer in params["layers"]:
        h = h + attention(rms_norm(h, layer["attention_norm"], cfg.norm_eps), layer["attention"], freqs_cis, cfg)
        h = h + feed_forward(rms_norm(h, layer["ffn_norm"], cfg.norm_eps), layer["feed_forward"])
    return rms_norm(h, params["norm"], cfg.norm_eps) @ params["output"]


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    logits = forward(params, tokens, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron tensor parallelism on mesh axis ``tp``: wq/wk/wv and w1/w3 column-parallel
    (heads / hidden units split), wo and w2 row-parallel, embedding split on its model
    dim (as Llama's ParallelEmbedding), output head column-parallel (vocab split)."""
    return {
        r"tok_embeddings": colwise(tp),
        r"layers/\d+/attention/w[qkv]": colwise(tp),
        r"layers/\d+/attention/wo": rowwise(tp),
        r"layers/\d+/feed_forward/w[13]": colwise(tp),
        r"layers/\d+/feed_forward/w2": rowwise(tp),
        r"output": colwise(tp),
    }
