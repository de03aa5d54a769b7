"""A small GPT-style language model in Equinox, as the Equinox examples write it.

``eqx.Module`` dataclasses of ``eqx.nn.Linear`` / ``eqx.nn.Embedding`` /
``eqx.nn.LayerNorm`` (which act on one token: the model ``jax.vmap``\\s them), static
configuration in ``eqx.field(static=True)``, non-array leaves left in the tree (an
activation function, a Python float); the training step is ``eqx.filter_value_and_grad``
+ optax AdamW on ``eqx.filter(model, eqx.is_array)``, with ``eqx.apply_updates``.
``eqx.filter_jit`` (and ``apply`` / ``predict`` / ``check``) take the whole model, its
non-array leaves static; ``jax.jit`` takes its arrays (``params, static =
eqx.partition(model, eqx.is_array)``, ``eqx.combine`` inside: :class:`Functional`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from placements2jax import DTensor, colwise, distribute_pytree, rowwise

from .common import megatron_batch


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    heads: int = 4
    layers: int = 2


class Attention(eqx.Module):
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, cfg: Config, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(cfg.dim, 3 * cfg.dim, key=k1)
        self.proj = eqx.nn.Linear(cfg.dim, cfg.dim, key=k2)
        self.heads = cfg.heads

    def __call__(self, x: jax.Array) -> jax.Array:  # (seq, dim)
        t, d = x.shape
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        q, k, v = (y.reshape(t, self.heads, d // self.heads) for y in (q, k, v))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(d // self.heads).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(x.dtype).min), axis=-1)
        return jax.vmap(self.proj)(jnp.einsum("hqk,khd->qhd", weights, v).reshape(t, d))


class MLP(eqx.Module):
    fc: eqx.nn.Linear
    out: eqx.nn.Linear
    activation: Callable[[jax.Array], jax.Array]  # a non-array leaf, as eqx.nn.MLP keeps it

    def __init__(self, cfg: Config, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.fc = eqx.nn.Linear(cfg.dim, 4 * cfg.dim, key=k1)
        self.out = eqx.nn.Linear(4 * cfg.dim, cfg.dim, key=k2)
        self.activation = jax.nn.gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.out)(self.activation(jax.vmap(self.fc)(x)))


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Attention
    ln2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, cfg: Config, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(cfg.dim), eqx.nn.LayerNorm(cfg.dim)
        self.attn, self.mlp = Attention(cfg, k1), MLP(cfg, k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(jax.vmap(self.ln1)(x))
        return x + self.mlp(jax.vmap(self.ln2)(x))


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    init_scale: float  # a Python float leaf (not static): eqx.is_array filters it out

    def __init__(self, cfg: Config, key: jax.Array) -> None:
        keys = jax.random.split(key, cfg.layers + 3)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.dim, key=keys[0])
        self.init_scale = 0.02
        self.pos = self.init_scale * jax.random.normal(keys[1], (cfg.seq, cfg.dim))
        self.blocks = [Block(cfg, k) for k in keys[3:]]
        self.ln_f = eqx.nn.LayerNorm(cfg.dim)
        self.head = eqx.nn.Linear(cfg.dim, cfg.vocab, use_bias=False, key=keys[2])

    def __call__(self, tokens: jax.Array) -> jax.Array:  # (seq,) -> (seq, vocab)
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def loss_fn(model: LM, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


optimizer = optax.adamw(1e-3, weight_decay=0.1)


def train_step(model: LM, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple[LM, Any, jax.Array]:
    """The Equinox examples' step (decorated with ``@eqx.filter_jit`` there)."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


class Functional:
    """The pure functions of the arrays of a model whose non-array part is ``static``
    (``params, static = eqx.partition(model, eqx.is_array)``): hashable, so ``apply`` caches them."""

    def __init__(self, static: Any) -> None:
        self.static = static

    def loss(self, params: LM, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return loss_fn(eqx.combine(params, self.static), tokens, targets)

    def value_and_grad(self, params: LM, tokens: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        return eqx.filter_value_and_grad(self.loss)(params, tokens, targets)


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron-LM's plan over the paths of the model's arrays (``blocks/0/attn/qkv/weight``)
    and of Adam's moments (``0/mu/blocks/...``): eqx.nn.Linear weights are (out, in), so
    column-parallel layers split dim 0 (torch's convention) and row-parallel ones dim 1."""
    prefix = r"(0/(mu|nu)/)?"
    return {
        prefix + r"embed/weight": rowwise(tp),  # (vocab, dim), like torch's nn.Embedding: vocab split
        prefix + r"blocks/\d+/(attn/qkv|mlp/fc)/(weight|bias)": colwise(tp, convention="torch"),
        prefix + r"blocks/\d+/(attn/proj|mlp/out)/weight": rowwise(tp, convention="torch"),
        prefix + r"head/weight": colwise(tp, convention="torch"),  # (vocab, dim): vocab split
    }


def checked_programs(cfg: Config, mesh: Any) -> dict[str, tuple[Any, tuple[Any, ...], Any]]:
    """The loss of the whole model (its activation function and float leaves static, as
    ``eqx.filter_jit`` makes them), the value_and_grad of its arrays and its adamw step, on
    :func:`megatron_plan` over ``mesh``, as ``(fn, args, out_layouts)`` for predict / check
    (as :func:`.common.checked_programs` gives GPT-2's and Llama's): the batch split over
    dp; the gradients, parameters and optimizer state keeping the parameters' layouts."""
    tokens, targets = megatron_batch(cfg, mesh)
    arrays, static = eqx.partition(LM(cfg, jax.random.key(0)), eqx.is_array)
    params = distribute_pytree(arrays, mesh, megatron_plan(), strict=False)
    whole = eqx.combine(params, static, is_leaf=lambda x: isinstance(x, DTensor))
    opt_state = distribute_pytree(optimizer.init(arrays), mesh, megatron_plan(), strict=False)
    return {
        "loss": (loss_fn, (whole, tokens, targets), None),
        "value_and_grad": (Functional(static).value_and_grad, (params, tokens, targets), (None, params)),
        "adamw step": (train_step, (whole, opt_state, tokens, targets), (whole, opt_state, None)),
    }
