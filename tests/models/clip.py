"""CLIP's contrastive training step in pure JAX, as open_clip / big_vision's JAX ports
write it: an image tower (patches cut by ``reshape`` / ``transpose`` and embedded by a
dense layer, a learned [CLS] token and positional embedding, a pre-LN transformer encoder
with layer norm and a GELU MLP, the [CLS] token's features projected) and a text tower
(token and positional embeddings, a causal pre-LN transformer, the end-of-text token's
features taken at ``jnp.argmax(tokens)`` and projected); both embeddings L2-normalized,
logits ``img @ txt.T * exp(log_scale)`` over the whole batch and the symmetric
cross-entropy against ``arange(batch)``. With the batch split over data parallelism the
similarities need every replica's embeddings (what CLIP's all-gather of the features
does by hand)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from placements2jax import colwise, rowwise

from .common import train_step as common_train_step
from .gpt2 import layer_norm, linear

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    image_size: int = 8
    patch: int = 4
    channels: int = 3
    vocab: int = 64  # the highest id is the end-of-text token
    seq: int = 8
    width: int = 32  # both towers'
    heads: int = 4  # tensor parallelism splits the heads: a multiple of tp
    layers: int = 1
    mlp: int = 64
    embed_dim: int = 16  # the shared image-text space
    batch: int = 4


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 64))
    w = cfg.width

    def dense(fan_in: int, fan_out: int) -> Params:
        return {"kernel": jax.random.normal(next(keys), (fan_in, fan_out)) / math.sqrt(fan_in),
                "bias": jnp.zeros((fan_out,))}

    def norm() -> Params:
        return {"scale": jnp.ones((w,)), "bias": jnp.zeros((w,))}

    def tower(tokens: int) -> Params:
        return {
            "positional_embedding": 0.01 * jax.random.normal(next(keys), (tokens, w)),
            "layers": [
                {"ln_1": norm(), "attn": {name: dense(w, w) for name in ("q", "k", "v", "out")},
                 "ln_2": norm(), "mlp": {"fc": dense(w, cfg.mlp), "proj": dense(cfg.mlp, w)}}
                for _ in range(cfg.layers)
            ],
            "ln_final": norm(),
            "projection": jax.random.normal(next(keys), (w, cfg.embed_dim)) / math.sqrt(w),
        }

    patches = (cfg.image_size // cfg.patch) ** 2
    return {
        "visual": {"patch_embed": dense(cfg.patch * cfg.patch * cfg.channels, w),
                   "class_embedding": 0.02 * jax.random.normal(next(keys), (w,)), **tower(patches + 1)},
        "text": {"token_embedding": 0.02 * jax.random.normal(next(keys), (cfg.vocab, w)), **tower(cfg.seq)},
        "log_scale": jnp.asarray(math.log(1 / 0.07), jnp.float32),
    }


def attention(x: jax.Array, p: Params, heads: int, causal: bool) -> jax.Array:
    B, T, C = x.shape
    q, k, v = (linear(x, p[name]).reshape(B, T, heads, C // heads) for name in ("q", "k", "v"))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(C // heads)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((T, T), dtype=bool)), scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
    return linear(out.reshape(B, T, C), p["out"])


def transformer(x: jax.Array, tower: Params, cfg: Config, causal: bool) -> jax.Array:
    """The pre-LN residual blocks, then the final layer norm."""
    x = x + tower["positional_embedding"]
    for layer in tower["layers"]:
        x = x + attention(layer_norm(x, layer["ln_1"]), layer["attn"], cfg.heads, causal)
        x = x + linear(jax.nn.gelu(linear(layer_norm(x, layer["ln_2"]), layer["mlp"]["fc"])), layer["mlp"]["proj"])
    return layer_norm(x, tower["ln_final"])


def encode_image(p: Params, images: jax.Array, cfg: Config) -> jax.Array:
    """NHWC ``images`` -> (batch, embed_dim): non-overlapping patches, flattened and embedded."""
    B, H, W, C = images.shape
    n = cfg.patch
    patches = images.reshape(B, H // n, n, W // n, n, C).transpose(0, 1, 3, 2, 4, 5).reshape(B, -1, n * n * C)
    x = linear(patches, p["patch_embed"])
    x = jnp.concatenate([jnp.broadcast_to(p["class_embedding"], (B, 1, cfg.width)), x], axis=1)
    return transformer(x, p, cfg, causal=False)[:, 0] @ p["projection"]


def encode_text(p: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    """(batch, seq) token ids -> (batch, embed_dim): the features at the end-of-text token
    (the highest id, so ``argmax`` finds it)."""
    x = transformer(p["token_embedding"][tokens], p, cfg, causal=True)
    return x[jnp.arange(x.shape[0]), jnp.argmax(tokens, axis=-1)] @ p["projection"]


def loss(params: Params, images: jax.Array, tokens: jax.Array, cfg: Config) -> jax.Array:
    image_features = encode_image(params["visual"], images, cfg)
    text_features = encode_text(params["text"], tokens, cfg)
    image_features = image_features / jnp.linalg.norm(image_features, axis=-1, keepdims=True)
    text_features = text_features / jnp.linalg.norm(text_features, axis=-1, keepdims=True)
    logits = jnp.exp(params["log_scale"]) * image_features @ text_features.T
    labels = jnp.arange(logits.shape[0])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


train_step = partial(common_train_step, loss)  # (params, opt_state, images, tokens, cfg, optimizer=None)


def batch(seed: int, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """NHWC float32 images and int32 captions: random words, the end-of-text token, zero padding."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((cfg.batch, cfg.image_size, cfg.image_size, cfg.channels)).astype(np.float32)
    tokens = rng.integers(1, cfg.vocab - 1, (cfg.batch, cfg.seq)).astype(np.int32)
    lengths = rng.integers(1, cfg.seq, cfg.batch)
    tokens[np.arange(cfg.batch), lengths] = cfg.vocab - 1
    tokens[np.arange(cfg.seq) > lengths[:, None]] = 0
    return images, tokens


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron tensor parallelism on mesh axis ``tp`` in both towers: q / k / v and the
    MLP's fc column-parallel (heads and hidden units split), out and proj row-parallel;
    the token and patch embeddings split on their model dim (as Llama's); the norms,
    positional embeddings, projections and logit scale replicated."""
    return {
        r"(visual|text)/layers/\d+/attn/[qkv]/.*": colwise(tp),
        r"(visual|text)/layers/\d+/attn/out/.*": rowwise(tp),
        r"(visual|text)/layers/\d+/mlp/fc/.*": colwise(tp),
        r"(visual|text)/layers/\d+/mlp/proj/.*": rowwise(tp),
        r"text/token_embedding": colwise(tp),
        r"visual/patch_embed/.*": colwise(tp),
    }
