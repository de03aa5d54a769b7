"""A Flax NNX language model whose layers are made by ``nnx.vmap`` and run by ``nnx.scan``
over ``nnx.remat``, as Flax's "scan over layers" guide writes it: one Block's Variables
stacked on a leading dim (``nnx.split_rngs`` splitting its Rngs per layer), the step
the stateful one of Flax's examples (``nnx.value_and_grad``, ``nnx.Optimizer.update``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import optax
from flax import nnx

from placements2jax import colwise, rowwise


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    hidden: int = 64
    layers: int = 2


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(cfg.dim, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, cfg.hidden, rngs=rngs)
        self.down = nnx.Linear(cfg.hidden, cfg.dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(nnx.silu(self.up(self.norm(x))))


class LM(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.blocks = create_blocks(rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.head(forward(self.embed(tokens), self.blocks))


def loss_fn(model: LM, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


def train_step(model: LM, optimizer: nnx.Optimizer, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """The stateful step of the Flax NNX examples (decorated with ``@nnx.jit`` there)."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets)
    optimizer.update(model, grads)
    return loss


def create(cfg: Config, seed: int = 0) -> tuple[LM, nnx.Optimizer]:
    model = LM(cfg, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron's plan over the pair ``(model, optimizer)`` (the model under ``0/``, Adam's
    moments under ``1/opt_state/0/(mu|nu)/``): the stacked kernels are (layer, in, out), so
    ``up`` (and its bias) is column-parallel, ``down`` row-parallel, the head vocab-parallel."""
    prefix = r"(0/|1/opt_state/0/(mu|nu)/)"
    return {
        prefix + r"blocks/up/(kernel|bias)/value": colwise(tp),
        prefix + r"blocks/down/kernel/value": rowwise(tp),
        prefix + r"head/kernel/value": colwise(tp),
    }
