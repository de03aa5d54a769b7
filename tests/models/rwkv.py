"""An RWKV-4-style LM in pure JAX, as public ports write it: token shift (the previous
token's activation, ``jnp.pad`` of ``x[:, :-1]``, mixed with the current one per channel),
time mixing through the WKV recurrence run step by step under ``lax.scan`` over time in
its numerically stable form (a running maximum exponent ``pp`` beside the numerator and
denominator sums, a per-channel decay ``exp(w)`` and current-token bonus ``u``), the
receptance gate ``sigmoid(r)``; channel mixing with a squared-ReLU key and a receptance
gate; LayerNorm. Tensor parallelism splits the attention channels over ``tp`` (the
recurrence is per channel): key, value and receptance column-parallel, the decay, bonus
and their output row-parallel; the channel mix's hidden units likewise."""

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
    seq: int = 8
    dim: int = 32
    hidden: int = 64
    layers: int = 1


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 2 + 7 * cfg.layers))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])

    mix = jnp.linspace(0.2, 0.8, cfg.dim)
    layers = [
        {
            "ln1": {"scale": jnp.ones((cfg.dim,)), "bias": jnp.zeros((cfg.dim,))},
            "ln2": {"scale": jnp.ones((cfg.dim,)), "bias": jnp.zeros((cfg.dim,))},
            "att": {
                "mix_k": mix, "mix_v": mix[::-1], "mix_r": jnp.full((cfg.dim,), 0.5),
                "time_decay": jnp.linspace(-3.0, 1.0, cfg.dim), "time_first": jnp.full((cfg.dim,), 0.3),
                "key": dense((cfg.dim, cfg.dim)), "value": dense((cfg.dim, cfg.dim)),
                "receptance": dense((cfg.dim, cfg.dim)), "output": dense((cfg.dim, cfg.dim)),
            },
            "ffn": {
                "mix_k": mix, "mix_r": mix[::-1],
                "key": dense((cfg.dim, cfg.hidden)), "receptance": dense((cfg.dim, cfg.dim)),
                "value": dense((cfg.hidden, cfg.dim)),
            },
        }
        for _ in range(cfg.layers)
    ]
    return {"emb": jax.random.normal(next(keys), (cfg.vocab, cfg.dim)) * 0.1, "layers": layers,
            "ln_out": {"scale": jnp.ones((cfg.dim,)), "bias": jnp.zeros((cfg.dim,))},
            "head": dense((cfg.dim, cfg.vocab))}


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """The time mix's channels over ``tp`` (key, value, receptance and the per-channel decay
    and bonus column-parallel, output row-parallel), the channel mix's hidden units (key
    column-, value row-parallel; its receptance replicated), the head vocab-parallel."""
    return {
        r"layers/\d+/att/(key|value|receptance|time_decay|time_first)": colwise(tp),
        r"layers/\d+/att/output": rowwise(tp),
        r"layers/\d+/ffn/key": colwise(tp),
        r"layers/\d+/ffn/value": rowwise(tp),
        r"head": colwise(tp),
    }


def layer_norm(x: jax.Array, p: Params) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def token_shift(x: jax.Array) -> jax.Array:
    """Each position's previous token (zeros before the first): (batch, seq, dim)."""
    return jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))


def wkv(w: jax.Array, u: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """RWKV-4's weighted key-value recurrence over time: k, v (batch, seq, channels); w the
    log decay (its decay ``exp(-exp(w))``), u the current token's bonus (channels)."""

    def step(carry: tuple[jax.Array, jax.Array, jax.Array], kv: tuple[jax.Array, jax.Array]) -> tuple[Any, jax.Array]:
        aa, bb, pp = carry
        kt, vt = kv
        ww = u + kt
        p = jnp.maximum(pp, ww)
        e1, e2 = jnp.exp(pp - p), jnp.exp(ww - p)
        out = (e1 * aa + e2 * vt) / (e1 * bb + e2)
        ww = pp - jnp.exp(w)
        p = jnp.maximum(ww, kt)
        e1, e2 = jnp.exp(ww - p), jnp.exp(kt - p)
        return (e1 * aa + e2 * vt, e1 * bb + e2, p), out

    zeros = jnp.zeros_like(k[:, 0])
    _, out = lax.scan(step, (zeros, zeros, zeros - 1e38), (k.swapaxes(0, 1), v.swapaxes(0, 1)))
    return out.swapaxes(0, 1)


def time_mix(x: jax.Array, p: Params) -> jax.Array:
    xx = token_shift(x)
    k = (x * p["mix_k"] + xx * (1 - p["mix_k"])) @ p["key"]
    v = (x * p["mix_v"] + xx * (1 - p["mix_v"])) @ p["value"]
    r = jax.nn.sigmoid((x * p["mix_r"] + xx * (1 - p["mix_r"])) @ p["receptance"])
    return (r * wkv(p["time_decay"], p["time_first"], k, v)) @ p["output"]


def channel_mix(x: jax.Array, p: Params) -> jax.Array:
    xx = token_shift(x)
    k = jnp.square(jax.nn.relu((x * p["mix_k"] + xx * (1 - p["mix_k"])) @ p["key"]))
    r = jax.nn.sigmoid((x * p["mix_r"] + xx * (1 - p["mix_r"])) @ p["receptance"])
    return r * (k @ p["value"])


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["emb"][tokens]
    for p in params["layers"]:
        x = x + time_mix(layer_norm(x, p["ln1"]), p["att"])
        x = x + channel_mix(layer_norm(x, p["ln2"]), p["ffn"])
    logits = layer_norm(x, params["ln_out"]) @ params["head"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)
