"""CLIP's contrastive training step in pure JAX, as open_clip / big_vision's JAX ports
write it: an image tower (patches embedded by a convolution whose stride is the patch
size, as big_vision's ViT; a learned [CLS] token and positional embedding; a pre-LN
transformer encoder with layer norm and a GELU MLP; the [CLS] token's features
projected) and a text tower (token and positional embeddings, a causal pre-LN
transformer, the end-of-text token's features taken at ``jnp.argmax(tokens)`` and
projected); both embeddings L2-normalized, logits ``img @ txt.T * exp(log_scale)`` over
the whole batch and the symmetric cross-entropy against ``arange(batch)``. ``Config(patches=
"reshape")`` cuts the patches by reshape / transpose and a dense layer instead, as many
public ViTs do (its prediction, 52,738 B in 32 collectives, and why the search misses the
conv's plan there: docs/inference.md section 6, stop 44). With the
batch split over data parallelism the similarities need every replica's embeddings
(what CLIP's all-gather of the features does by hand).

Measured on dp=2 x tp=4 (stop 43, clip + adamw, batch 4; tests/test_real_code.py): check
predicts 45,938 B per device in 16 collectives after XLA's combiner (7 all-gathers, 9
all-reduces; the pinned program compiles exactly those) where plain ``jax.jit`` sends
84,052 B in 116 (0.547x): XLA splits the adamw update of every replicated parameter over
tp and all-gathers the parameter and both moments back, 63 all-gathers (the 17 f32[32]
layer norms, row-parallel biases and [CLS] token, the projections, the positional
embeddings) that CPU XLA's combiner never merges. The prediction gathers activations
over dp where CLIP's code gathers only the two (4, 16) features (2 x 128 B): the patch
embeddings (256 B), both image residuals (4, 5, 32) (1,280 B each), the text tower's
(4, 8, 32) (2,048 B) and the end-of-text positions (8 B). Cold predict 8.7 s of CPU,
plain ``jax.jit``'s compile 8.7 s (load 5-6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

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
    # "conv": big_vision's strided convolution on an HWIO kernel; "reshape": the image cut into patches by reshape /
    # transpose and a dense layer on a (patch * patch * channels, width) kernel, as many public ViTs write it
    patches: str = "conv"

    def __post_init__(self) -> None:
        if self.patches not in ("conv", "reshape"):
            raise ValueError(f"clip.Config: patches={self.patches!r} is neither 'conv' nor 'reshape'")


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 2 * (2 + 6 * cfg.layers) + 3))  # two towers, patch / class / token embeddings
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
    patch_embed = dense(cfg.patch * cfg.patch * cfg.channels, w)
    if cfg.patches == "conv":
        patch_embed["kernel"] = patch_embed["kernel"].reshape(cfg.patch, cfg.patch, cfg.channels, w)  # HWIO
    return {
        "visual": {"patch_embed": patch_embed,
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


def embed_patches(p: Params, images: jax.Array, cfg: Config) -> jax.Array:
    """NHWC ``images`` -> (batch, patches, width): each patch's pixels (row, column, channel
    order, the HWIO kernel's) times the patch embedding, by ``cfg.patches``."""
    B, H, W, C = images.shape
    k = cfg.patch
    if cfg.patches == "conv":
        x = lax.conv_general_dilated(images, p["kernel"], (k, k), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    else:
        patches = images.reshape(B, H // k, k, W // k, k, C).transpose(0, 1, 3, 2, 4, 5).reshape(B, -1, k * k * C)
        x = patches @ p["kernel"]
    return (x + p["bias"]).reshape(B, -1, cfg.width)


def encode_image(p: Params, images: jax.Array, cfg: Config) -> jax.Array:
    """NHWC ``images`` -> (batch, embed_dim)."""
    B = images.shape[0]
    x = embed_patches(p["patch_embed"], images, cfg)
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
    end = rng.integers(1, cfg.seq, cfg.batch)
    tokens[np.arange(cfg.batch), end] = cfg.vocab - 1
    tokens[np.arange(cfg.seq) > end[:, None]] = 0
    return images, tokens


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron tensor parallelism on mesh axis ``tp`` in both towers: q / k / v and the
    MLP's fc column-parallel (heads and hidden units split), out and proj row-parallel;
    the token embedding split on its model dim (as Llama's), the patch embedding on its
    output channels (the same dim of the activations); the norms, positional embeddings,
    projections and logit scale replicated."""
    return {
        r"(visual|text)/layers/\d+/attn/[qkv]/.*": colwise(tp),
        r"(visual|text)/layers/\d+/attn/out/.*": rowwise(tp),
        r"(visual|text)/layers/\d+/mlp/fc/.*": colwise(tp),
        r"(visual|text)/layers/\d+/mlp/proj/.*": rowwise(tp),
        r"text/token_embedding": colwise(tp),
        r"visual/patch_embed/.*": colwise(tp),
    }
