"""A Gemma-2 class decoder in pure JAX, as public ports write it: embeddings tied with the
output head and scaled by sqrt(dim), RMSNorm with a zero-centred ``(1 + weight)`` gain,
rotary embeddings by halves (``jnp.split`` / ``concatenate``), grouped-query attention
with the grouped heads as an einsum axis, attention logits soft-capped by ``tanh``,
local (sliding-window) and global layers alternating, a GeGLU feed-forward (tanh GELU),
final logits soft-capped, a label-smoothed cross-entropy (``optax.smooth_labels``) with
a z-loss on the log-partition."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from placements2jax import Replicate, Shard, colwise, rowwise

from .common import train_step as common_train_step

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    dim: int = 64
    heads: int = 8
    kv_heads: int = 4  # tensor parallelism splits kv heads too: a multiple of tp
    layers: int = 2
    hidden: int = 128
    window: int = 4  # the local layers' sliding window
    attn_softcap: float = 50.0
    final_softcap: float = 30.0
    label_smoothing: float = 0.1
    z_loss: float = 1e-4


def init(key: jax.Array, cfg: Config) -> Params:
    head_dim = cfg.dim // cfg.heads
    keys = iter(jax.random.split(key, 1 + 6 * cfg.layers))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])

    layers = [
        {
            "pre_attn_norm": jnp.zeros((cfg.dim,)),
            "q": dense((cfg.dim, cfg.heads * head_dim)),
            "kv": dense((2, cfg.dim, cfg.kv_heads * head_dim)),
            "o": dense((cfg.heads * head_dim, cfg.dim)),
            "pre_ffw_norm": jnp.zeros((cfg.dim,)),
            "gate": dense((cfg.dim, cfg.hidden)),
            "up": dense((cfg.dim, cfg.hidden)),
            "down": dense((cfg.hidden, cfg.dim)),
        }
        for _ in range(cfg.layers)
    ]
    return {"embedder": jax.random.normal(next(keys), (cfg.vocab, cfg.dim)) * 0.02, "layers": layers,
            "final_norm": jnp.zeros((cfg.dim,))}


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron tensor parallelism on mesh axis ``tp``: q, the stacked kv and the GeGLU's
    gate / up column-parallel (heads and hidden units split), o and down row-parallel, the
    tied embedding split by vocabulary rows (the head then vocabulary-parallel)."""
    return {
        r"embedder": [Replicate(), Shard(0)],
        r"layers/\d+/q": colwise(tp),
        r"layers/\d+/kv": [Replicate(), Shard(2)],
        r"layers/\d+/o": rowwise(tp),
        r"layers/\d+/(gate|up)": colwise(tp),
        r"layers/\d+/down": rowwise(tp),
    }


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * (1 + weight)


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    timescale = 10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None] / timescale  # (seq, half)
    sin, cos = jnp.sin(angles)[:, None], jnp.cos(angles)[:, None]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(x: jax.Array, p: Params, window: int | None, cfg: Config) -> jax.Array:
    B, T, _ = x.shape
    head_dim = cfg.dim // cfg.heads
    positions = jnp.arange(T)
    q = rope((x @ p["q"]).reshape(B, T, cfg.heads, head_dim), positions)
    k, v = jnp.einsum("btd,sdk->sbtk", x, p["kv"]).reshape(2, B, T, cfg.kv_heads, head_dim)
    k = rope(k, positions)
    q = q.reshape(B, T, cfg.kv_heads, cfg.heads // cfg.kv_heads, head_dim) * head_dim**-0.5
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k)
    logits = jnp.tanh(logits / cfg.attn_softcap) * cfg.attn_softcap
    mask = positions[:, None] >= positions[None, :]
    if window is not None:
        mask = mask & (positions[:, None] - positions[None, :] < window)
    logits = jnp.where(mask, logits, -2.3819763e38)  # Gemma's large negative, not -inf
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, cfg.heads * head_dim)
    return out @ p["o"]


def forward(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    x = params["embedder"][tokens] * jnp.sqrt(jnp.float32(cfg.dim))
    for i, p in enumerate(params["layers"]):
        window = cfg.window if i % 2 == 0 else None  # local, then global
        x = x + attention(rms_norm(x, p["pre_attn_norm"]), p, window, cfg)
        h = rms_norm(x, p["pre_ffw_norm"])
        x = x + (jax.nn.gelu(h @ p["gate"], approximate=True) * (h @ p["up"])) @ p["down"]
    logits = rms_norm(x, params["final_norm"]) @ params["embedder"].T
    return jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    logits = forward(params, tokens, cfg)
    labels = optax.smooth_labels(jax.nn.one_hot(targets, cfg.vocab), cfg.label_smoothing)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(optax.softmax_cross_entropy(logits, labels)) + cfg.z_loss * jnp.mean(log_z**2)


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)
