"""A T5-style encoder-decoder in pure JAX, as public ports of T5 / T5X write it: RMS layer
norm without bias, relative position biases looked up per attention from bucketed
distances (``log`` of the distance, cast to an index, clamped; bidirectional in the
encoder, causal in the decoder), decoder self- and cross-attention, a ReLU feed-forward,
the shared embedding as the output head (scaled by ``d_model ** -0.5``), the loss as
``optax.softmax_cross_entropy_with_integer_labels`` plus a z-loss on the log-partition.
Gradients are accumulated over ``cfg.microbatches`` under ``lax.scan`` (its carry: the
loss and every parameter's gradient), as T5X and MaxText step through microbatches."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from placements2jax import colwise, rowwise

from .common import make_optimizer

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    d_model: int = 32
    heads: int = 4
    d_ff: int = 64
    buckets: int = 8
    max_distance: int = 16
    layers: int = 1  # encoder and decoder layers each
    batch: int = 4
    microbatches: int = 1  # > 1: gradients accumulated under lax.scan
    z_loss: float = 1e-4


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 3 + 16 * cfg.layers))

    def dense(rows: int, cols: int) -> jax.Array:
        return jax.random.normal(next(keys), (rows, cols), jnp.float32) / math.sqrt(rows)

    def attention() -> Params:
        return {name: dense(cfg.d_model, cfg.d_model) for name in ("q", "k", "v", "o")}

    def mlp() -> Params:
        return {"wi": dense(cfg.d_model, cfg.d_ff), "wo": dense(cfg.d_ff, cfg.d_model)}

    ones = lambda: jnp.ones((cfg.d_model,))  # noqa: E731
    return {
        "shared": jax.random.normal(next(keys), (cfg.vocab, cfg.d_model), jnp.float32),
        "encoder": {
            "relative_bias": jax.random.normal(next(keys), (cfg.buckets, cfg.heads)) * 0.1,
            "layers": [{"attention_norm": ones(), "attention": attention(), "mlp_norm": ones(), "mlp": mlp()}
                       for _ in range(cfg.layers)],
            "final_norm": ones(),
        },
        "decoder": {
            "relative_bias": jax.random.normal(next(keys), (cfg.buckets, cfg.heads)) * 0.1,
            "layers": [{"self_norm": ones(), "self_attention": attention(), "cross_norm": ones(),
                        "cross_attention": attention(), "mlp_norm": ones(), "mlp": mlp()}
                       for _ in range(cfg.layers)],
            "final_norm": ones(),
        },
    }


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * weight


def relative_bucket(relative: jax.Array, bidirectional: bool, cfg: Config) -> jax.Array:
    """T5's bucket of each (key - query) distance: exact up to half the buckets, then
    logarithmic up to ``max_distance``."""
    buckets, offset = cfg.buckets, 0
    if bidirectional:
        buckets //= 2
        offset = (relative > 0).astype(jnp.int32) * buckets
        distance = jnp.abs(relative)
    else:
        distance = -jnp.minimum(relative, 0)
    exact = buckets // 2
    logarithmic = exact + (
        jnp.log(distance.astype(jnp.float32) / exact + 1e-6) / math.log(cfg.max_distance / exact) * (buckets - exact)
    ).astype(jnp.int32)
    return offset + jnp.where(distance < exact, distance, jnp.minimum(logarithmic, buckets - 1))


def position_bias(table: jax.Array, length: int, bidirectional: bool, cfg: Config) -> jax.Array:
    positions = jnp.arange(length)
    bucket = relative_bucket(positions[None, :] - positions[:, None], bidirectional, cfg)
    return table[bucket].transpose(2, 0, 1)[None]  # (1, heads, queries, keys)


def attention(p: Params, x: jax.Array, kv: jax.Array, bias: jax.Array | None, cfg: Config,
              mask: jax.Array | None = None) -> jax.Array:
    B, T, _ = x.shape
    q = (x @ p["q"]).reshape(B, T, cfg.heads, -1)
    k = (kv @ p["k"]).reshape(B, kv.shape[1], cfg.heads, -1)
    v = (kv @ p["v"]).reshape(B, kv.shape[1], cfg.heads, -1)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # T5 folds the 1/sqrt(d) scale into the initialization
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = jnp.where(mask, scores, -1e9)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, -1) @ p["o"]


def mlp(p: Params, x: jax.Array) -> jax.Array:
    return jax.nn.relu(x @ p["wi"]) @ p["wo"]


def encode(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    p = params["encoder"]
    x = params["shared"][tokens]
    bias = position_bias(p["relative_bias"], tokens.shape[1], True, cfg)
    for layer in p["layers"]:
        h = rms_norm(x, layer["attention_norm"])
        x = x + attention(layer["attention"], h, h, bias, cfg)
        x = x + mlp(layer["mlp"], rms_norm(x, layer["mlp_norm"]))
    return rms_norm(x, p["final_norm"])


def decode(params: Params, encoded: jax.Array, tokens: jax.Array, cfg: Config) -> jax.Array:
    p = params["decoder"]
    T = tokens.shape[1]
    y = params["shared"][tokens]
    bias = position_bias(p["relative_bias"], T, False, cfg)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    for layer in p["layers"]:
        h = rms_norm(y, layer["self_norm"])
        y = y + attention(layer["self_attention"], h, h, bias, cfg, causal)
        y = y + attention(layer["cross_attention"], rms_norm(y, layer["cross_norm"]), encoded, None, cfg)
        y = y + mlp(layer["mlp"], rms_norm(y, layer["mlp_norm"]))
    return rms_norm(y, p["final_norm"]) @ params["shared"].T * cfg.d_model**-0.5  # the tied head


def loss(params: Params, inputs: jax.Array, decoder_inputs: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    logits = decode(params, encode(params, inputs, cfg), decoder_inputs, cfg)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.mean(cross_entropy + cfg.z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2)


def train_step(
    params: Params, opt_state: Any, inputs: jax.Array, decoder_inputs: jax.Array, targets: jax.Array, cfg: Config,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Params, Any, jax.Array]:
    """The mean loss and its gradients over ``cfg.microbatches`` (each a slice of the batch's
    rows, taken with ``dynamic_slice_in_dim`` by the scan's index), then the update."""
    optimizer = optimizer or make_optimizer()
    grad_fn = jax.value_and_grad(loss)
    if cfg.microbatches == 1:
        value, grads = grad_fn(params, inputs, decoder_inputs, targets, cfg)
    else:
        rows = inputs.shape[0] // cfg.microbatches

        def accumulate(carry: tuple[jax.Array, Params], i: jax.Array) -> tuple[tuple[jax.Array, Params], None]:
            part = lambda a: jax.lax.dynamic_slice_in_dim(a, i * rows, rows)  # noqa: E731
            value, grads = grad_fn(params, part(inputs), part(decoder_inputs), part(targets), cfg)
            return jax.tree.map(jnp.add, carry, (value, grads)), None

        zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(accumulate, zeros, jnp.arange(cfg.microbatches))
        value, grads = value / cfg.microbatches, jax.tree.map(lambda g: g / cfg.microbatches, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def batch(seed: int, cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int32 (batch, seq) encoder inputs, decoder inputs (the targets shifted right after a
    start token 0) and targets."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(1, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    targets = rng.integers(1, cfg.vocab, (cfg.batch, cfg.seq)).astype(np.int32)
    decoder_inputs = np.concatenate([np.zeros((cfg.batch, 1), np.int32), targets[:, :-1]], axis=1)
    return inputs, decoder_inputs, targets


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron tensor parallelism on mesh axis ``tp``: every attention's q / k / v
    column-parallel and o row-parallel (heads split), wi column-parallel and wo row-parallel,
    the relative bias tables split over heads as the attentions are, the shared embedding
    split on its model dim."""
    return {
        r"shared": colwise(tp),
        r".*/relative_bias": colwise(tp),
        r".*/(attention|self_attention|cross_attention)/[qkv]": colwise(tp),
        r".*/(attention|self_attention|cross_attention)/o": rowwise(tp),
        r".*/mlp/wi": colwise(tp),
        r".*/mlp/wo": rowwise(tp),
    }
