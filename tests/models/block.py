"""A pre-norm transformer block (attention + MLP + layer norms), written as public
pure-JAX model code is: the inference tests lay it out with the Megatron plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HEADS = 4


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * g + b


def block(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, wo: jax.Array, w1: jax.Array, w2: jax.Array,
          g1: jax.Array, b1: jax.Array, g2: jax.Array, b2: jax.Array) -> jax.Array:
    """Attention with ``HEADS`` heads (split by tp under the Megatron plan), then the MLP."""
    batch, tokens, width = x.shape
    h = layer_norm(x, g1, b1)
    q, k, v = ((h @ w).reshape(batch, tokens, HEADS, width // HEADS) for w in (wq, wk, wv))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(width // HEADS)
    attention = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v).reshape(batch, tokens, width)
    x = x + attention @ wo
    return x + jax.nn.gelu(layer_norm(x, g2, b2) @ w1) @ w2
