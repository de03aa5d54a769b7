"""A DeepSeek-V2-style decoder in pure JAX, as its public ports write it: multi-head latent
attention (the keys and values compressed into a low-rank latent: a down projection,
RMSNorm on the latent, up projections to per-head keys without position and values; a
decoupled rotary key of its own dims shared by every head, broadcast to the heads and
concatenated with theirs; queries split the same way into a no-position part and a rotary
part), rotary embeddings on interleaved pairs (the complex view of DeepSeek's reference:
``reshape(..., d / 2, 2)``), a SwiGLU feed-forward, a vocab-parallel head. Megatron's
plan splits the heads over ``tp``: the query and the latent's up projections
column-parallel, the output projection row-parallel; the down projection to the latent
and its norm replicated (as DeepSeek's tensor parallelism leaves them)."""

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


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    dim: int = 64
    heads: int = 8
    latent: int = 32  # kv_lora_rank
    nope: int = 8  # qk_nope_head_dim
    rope: int = 4  # qk_rope_head_dim (the decoupled key's dims, shared by the heads)
    value: int = 8  # v_head_dim
    hidden: int = 128
    layers: int = 1


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 2 + 7 * cfg.layers))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])

    layers = [
        {
            "attn_norm": jnp.ones((cfg.dim,)),
            "wq": dense((cfg.dim, cfg.heads * (cfg.nope + cfg.rope))),
            "wkv_a": dense((cfg.dim, cfg.latent + cfg.rope)),
            "kv_norm": jnp.ones((cfg.latent,)),
            "wkv_b": dense((cfg.latent, cfg.heads * (cfg.nope + cfg.value))),
            "wo": dense((cfg.heads * cfg.value, cfg.dim)),
            "ffn_norm": jnp.ones((cfg.dim,)),
            "w1": dense((cfg.dim, cfg.hidden)),
            "w3": dense((cfg.dim, cfg.hidden)),
            "w2": dense((cfg.hidden, cfg.dim)),
        }
        for _ in range(cfg.layers)
    ]
    return {"embed": jax.random.normal(next(keys), (cfg.vocab, cfg.dim)) * 0.02, "layers": layers,
            "norm": jnp.ones((cfg.dim,)), "head": dense((cfg.dim, cfg.vocab))}


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """The heads over ``tp`` (wq, wkv_b column-parallel, wo row-parallel), the SwiGLU's
    hidden units too, the head vocab-parallel; wkv_a, the norms and the embedding replicated."""
    return {
        r"layers/\d+/(wq|wkv_b|w1|w3)": colwise(tp),
        r"layers/\d+/(wo|w2)": rowwise(tp),
        r"head": colwise(tp),
    }


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * weight


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary embedding on interleaved pairs (x[..., 2i], x[..., 2i + 1]) as complex numbers:
    x (batch, seq, heads, d)."""
    d = x.shape[-1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions[:, None] * freqs  # (seq, d / 2)
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    pairs = x.reshape(*x.shape[:-1], d // 2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    return jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1).reshape(x.shape)


def attention(x: jax.Array, p: Params, cfg: Config) -> jax.Array:
    B, T, _ = x.shape
    positions = jnp.arange(T, dtype=jnp.float32)
    q = (x @ p["wq"]).reshape(B, T, cfg.heads, cfg.nope + cfg.rope)
    q_nope, q_pe = jnp.split(q, [cfg.nope], axis=-1)
    q = jnp.concatenate([q_nope, rope(q_pe, positions)], axis=-1)
    kv, k_pe = jnp.split(x @ p["wkv_a"], [cfg.latent], axis=-1)
    k_pe = rope(k_pe[:, :, None, :], positions)  # (B, T, 1, rope): one rotary key for every head
    kv = (rms_norm(kv, p["kv_norm"]) @ p["wkv_b"]).reshape(B, T, cfg.heads, cfg.nope + cfg.value)
    k_nope, v = jnp.split(kv, [cfg.nope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (B, T, cfg.heads, cfg.rope))], axis=-1)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * (cfg.nope + cfg.rope) ** -0.5
    causal = jnp.tril(jnp.ones((T, T), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, cfg.heads * cfg.value)
    return out @ p["wo"]


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["embed"][tokens]
    for p in params["layers"]:
        x = x + attention(rms_norm(x, p["attn_norm"]), p, cfg)
        h = rms_norm(x, p["ffn_norm"])
        x = x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
    logits = rms_norm(x, params["norm"]) @ params["head"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)
