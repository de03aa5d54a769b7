"""A small GPT-style language model in Flax NNX, as the Flax NNX examples write it.

``nnx.Module`` subclasses holding ``nnx.Linear`` / ``nnx.Embed`` / ``nnx.LayerNorm``
layers (blocks in an ``nnx.List``); the loss is optax's integer-label cross-entropy;
training is the stateful step of Flax's examples (decorated with ``@nnx.jit`` there):
``nnx.value_and_grad`` and ``nnx.Optimizer.update(model, grads)`` (optax AdamW) updating
the model and optimizer in place. The loss and its gradient also run functionally, as
Flax's performance guide writes them (:class:`Functional`: ``nnx.merge`` of a state).
With ``Config(logical=True)`` the embedding and linear layers' initializers are wrapped by
``nnx.with_partitioning`` (logical axis names in each Variable's ``out_sharding``
metadata; not sharded at creation: ``eager_sharding=False``), and :data:`LOGICAL_RULES`
map the names onto the Megatron plan's layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.nn.linear import default_bias_init, default_embed_init, default_kernel_init
from flax.typing import Initializer

from placements2jax import colwise, distribute_pytree, rowwise

from .common import megatron_batch


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    heads: int = 4
    layers: int = 2
    logical: bool = False  # Variables annotated with logical axis names (nnx.with_partitioning)

    def init(self, init: Initializer, *names: str | None) -> Initializer:
        """``init``, its Variable's dims named ``names`` when :attr:`logical`."""
        return nnx.with_partitioning(init, names, eager_sharding=False) if self.logical else init


# The logical axis names of Config(logical=True) onto :func:`megatron_plan`'s layouts
LOGICAL_RULES = (("vocab", "tp"), ("embed", None), ("mlp", "tp"))


def _linear(
    cfg: Config, d_in: int, d_out: int, names: tuple[str, str], *, rngs: nnx.Rngs, use_bias: bool = True
) -> nnx.Linear:
    """An nnx.Linear with Flax's default initializers, named ``names`` (kernel) and ``names[1]`` (bias)."""
    return nnx.Linear(
        d_in, d_out, use_bias=use_bias, kernel_init=cfg.init(default_kernel_init, *names),
        bias_init=cfg.init(default_bias_init, names[1]), rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.heads = cfg.heads
        self.qkv = _linear(cfg, cfg.dim, 3 * cfg.dim, ("embed", "mlp"), rngs=rngs)
        self.proj = _linear(cfg, cfg.dim, cfg.dim, ("mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads) for y in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(x.dtype).min), axis=-1)
        return self.proj(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.fc = _linear(cfg, cfg.dim, 4 * cfg.dim, ("embed", "mlp"), rngs=rngs)
        self.out = _linear(cfg, 4 * cfg.dim, cfg.dim, ("mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.gelu(self.fc(x)))


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LM(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(
            cfg.vocab, cfg.dim, embedding_init=cfg.init(default_embed_init, "vocab", "embed"), rngs=rngs
        )
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.seq, cfg.dim)))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.head = _linear(cfg, cfg.dim, cfg.vocab, ("embed", "vocab"), use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model: LM, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(model: LM, optimizer: nnx.Optimizer, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """The stateful step of the Flax NNX examples (decorated with ``@nnx.jit`` there)."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets)
    optimizer.update(model, grads)
    return loss


def create(cfg: Config, seed: int = 0) -> tuple[LM, nnx.Optimizer]:
    model = LM(cfg, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)


class Functional:
    """The pure functions of ``graphdef`` (from ``nnx.split(model)``) on states: hashable,
    so ``apply`` caches them."""

    def __init__(self, graphdef: Any) -> None:
        self.graphdef = graphdef

    def loss(self, state: nnx.State, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return loss_fn(nnx.merge(self.graphdef, state), tokens, targets)

    def value_and_grad(self, state: nnx.State, tokens: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(self.loss)(state, tokens, targets)


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron-LM's plan over the paths of ``nnx.split(model)`` (``blocks/0/attn/qkv/kernel/value``)
    and of the pair ``(model, optimizer)`` (the model under ``0/``, Adam's moments under
    ``1/opt_state/0/mu/`` and ``.../nu/``): nnx.Linear kernels are (in, out), so the
    column-parallel layers split dim 1 (and their bias), the row-parallel ones dim 0."""
    prefix = r"(0/|1/opt_state/0/(mu|nu)/)?"
    return {
        prefix + r"embed/embedding/value": rowwise(tp),  # (vocab, dim): vocab split
        prefix + r"blocks/\d+/(attn/qkv|mlp/fc)/(kernel|bias)/value": colwise(tp),
        prefix + r"blocks/\d+/(attn/proj|mlp/out)/kernel/value": rowwise(tp),
        prefix + r"head/kernel/value": colwise(tp),  # (dim, vocab): vocab split
    }


def checked_programs(cfg: Config, mesh: Any) -> dict[str, tuple[Any, tuple[Any, ...], Any]]:
    """The functional loss and value_and_grad of a model of ``cfg`` on :func:`megatron_plan`
    over ``mesh`` as ``(fn, args, out_layouts)`` for predict / check (as
    :func:`.common.checked_programs` gives GPT-2's and Llama's): the batch split over dp,
    the gradients keeping the parameters' layouts."""
    tokens, targets = megatron_batch(cfg, mesh)
    graphdef, state = nnx.split(create(cfg)[0])
    params = distribute_pytree(state, mesh, megatron_plan())
    functional = Functional(graphdef)
    return {
        "loss": (functional.loss, (params, tokens, targets), None),
        "value_and_grad": (functional.value_and_grad, (params, tokens, targets), (None, params)),
    }
