"""A small image classifier as public JAX code writes it: NHWC images, 3x3
``lax.conv_general_dilated`` layers (one per ``Config.channels``) with a bias and ReLU, a 2x2 max-pool
(``lax.reduce_window``), the flatten ``x.reshape(x.shape[0], -1)`` and a dense classifier,
softmax cross-entropy, an optax adamw step. Its plan splits the batch over ``dp`` and the
conv kernels' output channels (and biases) over ``tp``; the dense layer is replicated, so
the flatten merges channel-split activations into a strided shard (docs/inference.md
section 10)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

Params = dict[str, Any]
_DIMS = ("NHWC", "HWIO", "NHWC")


@dataclass(frozen=True)
class Config:
    size: int = 8  # image height and width
    in_channels: int = 3
    channels: tuple[int, ...] = (8, 16)  # the convs' output channels
    classes: int = 10
    batch: int = 8


def init(key: jax.Array, cfg: Config) -> Params:
    keys = jax.random.split(key, len(cfg.channels) + 1)
    params: Params = {}
    fan_in = cfg.in_channels
    for n, (k, c) in enumerate(zip(keys, cfg.channels), 1):
        params[f"conv{n}"] = jax.random.normal(k, (3, 3, fan_in, c)) / (9 * fan_in) ** 0.5
        params[f"bias{n}"] = jnp.zeros(c)
        fan_in = c
    flat = (cfg.size // 2) ** 2 * fan_in
    params["dense"] = jax.random.normal(keys[-1], (flat, cfg.classes)) / flat ** 0.5
    params["dense_bias"] = jnp.zeros(cfg.classes)
    return params


def forward(params: Params, images: jax.Array) -> jax.Array:
    """Logits (batch, classes) of NHWC ``images``."""
    h = images
    for n in range(1, len(params) // 2):
        h = lax.conv_general_dilated(h, params[f"conv{n}"], (1, 1), "SAME", dimension_numbers=_DIMS)
        h = jax.nn.relu(h + params[f"bias{n}"])
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return h.reshape(h.shape[0], -1) @ params["dense"] + params["dense_bias"]


def loss(params: Params, images: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, images), labels).mean()


def make_optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-3)


def train_step(
    params: Params, opt_state: Any, images: jax.Array, labels: jax.Array,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Params, Any, jax.Array]:
    value, grads = jax.value_and_grad(loss)(params, images, labels)
    updates, opt_state = (optimizer or make_optimizer()).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def batch(seed: int, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """NHWC float32 images and int32 labels."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((cfg.batch, cfg.size, cfg.size, cfg.in_channels)).astype(np.float32)
    return images, rng.integers(0, cfg.classes, cfg.batch).astype(np.int32)


def channel_plan(cfg: Config) -> dict[str, str]:
    """On a (dp, tp) mesh: the conv kernels' output channels and their biases over tp,
    the dense layer replicated."""
    plan = {"dense": "R,R", "dense_bias": "R,R"}
    for n in range(1, len(cfg.channels) + 1):
        plan |= {f"conv{n}": "R,S(3)", f"bias{n}": "R,S(0)"}
    return plan
