"""A Llama-style language model written for JAX's explicit sharding ("sharding in types"),
as JAX's explicit-sharding guide writes model code: run inside ``jax.set_mesh`` of a mesh
with Explicit axes ``dp`` and ``tp``, each op whose result JAX's typing cannot decide (a
matmul contracting a tp-split dim, a reshape merging split heads, the embedding lookup)
names its result's sharding with ``out_sharding=``: the Megatron plan written into the
code instead of left to XLA's propagation. RMSNorm, causal multi-head attention, SwiGLU,
an untied output head split over the vocabulary, a Python loop over the layers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from placements2jax import colwise, rowwise

from .common import train_step as common_train_step
from .llama import rms_norm

Params = dict[str, Any]

BATCH = P("dp", None, None)  # activations: the batch over dp, replicated over tp


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    heads: int = 4
    layers: int = 2
    hidden: int = 64
    norm_eps: float = 1e-5


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 2 + 7 * cfg.layers))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[0])

    layers = [
        {
            "attention_norm": jnp.ones((cfg.dim,)),
            "wq": dense((cfg.dim, cfg.dim)), "wk": dense((cfg.dim, cfg.dim)), "wv": dense((cfg.dim, cfg.dim)),
            "wo": dense((cfg.dim, cfg.dim)),
            "ffn_norm": jnp.ones((cfg.dim,)),
            "w1": dense((cfg.dim, cfg.hidden)), "w3": dense((cfg.dim, cfg.hidden)), "w2": dense((cfg.hidden, cfg.dim)),
        }
        for _ in range(cfg.layers)
    ]
    return {
        "embedding": jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32),
        "layers": layers,
        "norm": jnp.ones((cfg.dim,)),
        "output": dense((cfg.dim, cfg.vocab)),
    }


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """The layouts the annotations assume: wq/wk/wv, w1/w3 and the output head
    column-parallel, wo and w2 row-parallel, the embedding replicated."""
    return {
        r"layers/\d+/w[qkv13]": colwise(tp),
        r"layers/\d+/w[o2]": rowwise(tp),
        r"output": colwise(tp),
    }


def attention(x: jax.Array, p: Params, cfg: Config) -> jax.Array:
    B, T, _ = x.shape
    head_dim = cfg.dim // cfg.heads
    heads = P("dp", None, "tp", None)

    def project(w: jax.Array) -> jax.Array:
        flat = jnp.einsum("btd,de->bte", x, w, out_sharding=P("dp", None, "tp"))
        return flat.reshape(B, T, cfg.heads, head_dim, out_sharding=heads)

    q, k, v = project(p["wq"]), project(p["wk"]), project(p["wv"])
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, cfg.dim, out_sharding=P("dp", None, "tp"))
    return jnp.einsum("bte,ed->btd", out, p["wo"], out_sharding=BATCH)


def feed_forward(x: jax.Array, p: Params) -> jax.Array:
    up = partial(jnp.einsum, "btd,dh->bth", out_sharding=P("dp", None, "tp"))
    return jnp.einsum("bth,hd->btd", jax.nn.silu(up(x, p["w1"])) * up(x, p["w3"]), p["w2"], out_sharding=BATCH)


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    h = params["embedding"].at[tokens].get(out_sharding=BATCH)
    for layer in params["layers"]:
        h = h + attention(rms_norm(h, layer["attention_norm"], cfg.norm_eps), layer, cfg)
        h = h + feed_forward(rms_norm(h, layer["ffn_norm"], cfg.norm_eps), layer)
    logits = jnp.einsum("btd,dv->btv", rms_norm(h, params["norm"], cfg.norm_eps), params["output"],
                        out_sharding=P("dp", None, "tp"))
    logp = jax.nn.log_softmax(logits, axis=-1)
    labels = jax.sharding.reshard(jax.nn.one_hot(targets, cfg.vocab, dtype=logp.dtype), P("dp", None, "tp"))
    return -jnp.mean(jnp.sum(logp * labels, axis=-1))


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)
