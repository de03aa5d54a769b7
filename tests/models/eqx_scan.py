"""An Equinox language model with stacked layers, as Equinox's "scan over layers" tip
writes it: the blocks made by ``eqx.filter_vmap`` of their constructor over split keys,
run under ``lax.scan`` on their arrays (``eqx.partition`` / ``eqx.combine`` with the
static rest); the step ``eqx.filter_value_and_grad`` + optax AdamW."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import optax
from jax import lax


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    hidden: int = 64
    layers: int = 2


class Block(eqx.Module):
    norm: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, cfg: Config, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.RMSNorm(cfg.dim)
        self.up = eqx.nn.Linear(cfg.dim, cfg.hidden, key=k1)
        self.down = eqx.nn.Linear(cfg.hidden, cfg.dim, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:  # one token (dim,)
        return x + self.down(jax.nn.silu(self.up(self.norm(x))))


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # every array with a leading layer dim
    head: eqx.nn.Linear

    def __init__(self, cfg: Config, key: jax.Array) -> None:
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.dim, key=k_embed)
        self.blocks = eqx.filter_vmap(lambda k: Block(cfg, k))(jax.random.split(k_blocks, cfg.layers))
        self.head = eqx.nn.Linear(cfg.dim, cfg.vocab, use_bias=False, key=k_head)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # one sequence (seq,)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x: jax.Array, layer: Any) -> tuple[jax.Array, None]:
            return jax.vmap(eqx.combine(layer, static))(x), None

        x, _ = lax.scan(step, jax.vmap(self.embed)(tokens), dynamic)
        return jax.vmap(self.head)(x)


def loss(model: LM, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-3, weight_decay=0.1)


def train_step(model: LM, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple[LM, Any, jax.Array]:
    value, grads = eqx.filter_value_and_grad(loss)(model, tokens, targets)
    updates, opt_state = make_optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def megatron_plan() -> dict[str, Any]:
    """On a (dp, tp) mesh, over the paths of the model and of Adam's moments (which mirror
    it): eqx.nn.Linear weights are (layer, out, in) as torch's, so ``up`` (and its bias)
    splits its out features (dim 1), ``down`` its in features (dim 2), the head its vocab
    (dim 0)."""
    return {
        r"blocks/up/(weight|bias)$": "R,S(1)",
        r"blocks/down/weight$": "R,S(2)",
        r"head/weight$": "R,S(0)",
    }

