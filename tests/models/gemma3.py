"""A Gemma-3 class decoder in pure JAX, as public ports write it (tests/models/gemma.py's
Gemma-2 with what Gemma 3 changed): RMSNorm on each head's queries and keys (qk-norm,
over head_dim, in place of the attention logits' soft cap), local sliding-window layers
and global layers in a fixed pattern (``global_every``: every n-th layer global; Gemma 3
has 5 local to 1 global), rotary embeddings with a base per kind (10k local, 1M global),
sandwich norms (before and after attention and the feed-forward), no final soft cap.
Megatron's plan is gemma.py's (heads and GeGLU hidden units over ``tp``, tied
vocabulary-split embeddings); the qk-norm weights replicated."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .common import train_step as common_train_step
from .gemma import megatron_plan, rms_norm

__all__ = ["Config", "init", "loss", "megatron_plan", "train_step"]

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    dim: int = 64
    heads: int = 8
    kv_heads: int = 4  # a multiple of tp
    layers: int = 2
    global_every: int = 2  # layer i is global when (i + 1) % global_every == 0
    hidden: int = 128
    window: int = 4
    local_base: float = 10_000.0
    global_base: float = 1_000_000.0


def init(key: jax.Array, cfg: Config) -> Params:
    head_dim = cfg.dim // cfg.heads
    keys = iter(jax.random.split(key, 1 + 6 * cfg.layers))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])

    layers = [
        {
            "pre_attn_norm": jnp.zeros((cfg.dim,)), "post_attn_norm": jnp.zeros((cfg.dim,)),
            "q": dense((cfg.dim, cfg.heads * head_dim)),
            "kv": dense((2, cfg.dim, cfg.kv_heads * head_dim)),
            "q_norm": jnp.zeros((head_dim,)), "k_norm": jnp.zeros((head_dim,)),
            "o": dense((cfg.heads * head_dim, cfg.dim)),
            "pre_ffw_norm": jnp.zeros((cfg.dim,)), "post_ffw_norm": jnp.zeros((cfg.dim,)),
            "gate": dense((cfg.dim, cfg.hidden)),
            "up": dense((cfg.dim, cfg.hidden)),
            "down": dense((cfg.hidden, cfg.dim)),
        }
        for _ in range(cfg.layers)
    ]
    return {"embedder": jax.random.normal(next(keys), (cfg.vocab, cfg.dim)) * 0.02, "layers": layers,
            "final_norm": jnp.zeros((cfg.dim,))}


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    half = x.shape[-1] // 2
    timescale = base ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None] / timescale
    sin, cos = jnp.sin(angles)[:, None], jnp.cos(angles)[:, None]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(x: jax.Array, p: Params, local: bool, cfg: Config) -> jax.Array:
    B, T, _ = x.shape
    head_dim = cfg.dim // cfg.heads
    positions = jnp.arange(T)
    base = cfg.local_base if local else cfg.global_base
    q = rms_norm((x @ p["q"]).reshape(B, T, cfg.heads, head_dim), p["q_norm"])
    k, v = jnp.einsum("btd,sdk->sbtk", x, p["kv"]).reshape(2, B, T, cfg.kv_heads, head_dim)
    q, k = rope(q, positions, base), rope(rms_norm(k, p["k_norm"]), positions, base)
    q = q.reshape(B, T, cfg.kv_heads, cfg.heads // cfg.kv_heads, head_dim) * head_dim**-0.5
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k)
    mask = positions[:, None] >= positions[None, :]
    if local:
        mask = mask & (positions[:, None] - positions[None, :] < cfg.window)
    probs = jax.nn.softmax(jnp.where(mask, logits, -2.3819763e38), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, cfg.heads * head_dim)
    return out @ p["o"]


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["embedder"][tokens] * jnp.sqrt(jnp.float32(cfg.dim))
    for i, p in enumerate(params["layers"]):
        local = (i + 1) % cfg.global_every != 0
        x = x + rms_norm(attention(rms_norm(x, p["pre_attn_norm"]), p, local, cfg), p["post_attn_norm"])
        h = rms_norm(x, p["pre_ffw_norm"])
        h = (jax.nn.gelu(h @ p["gate"], approximate=True) * (h @ p["up"])) @ p["down"]
        x = x + rms_norm(h, p["post_ffw_norm"])
    logits = rms_norm(x, params["final_norm"]) @ params["embedder"].T
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)
