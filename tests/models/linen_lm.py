"""A small GPT-2 class decoder in Flax Linen, as Flax's lm1b / wmt examples write it.

``nn.Module`` dataclasses with ``@nn.compact`` methods: ``nn.Embed`` (the output tied to it
by ``embed.attend``), a learned position embedding (``self.param``), ``nn.LayerNorm``,
``nn.Dense`` with ``kernel_init``, ``nn.MultiHeadDotProductAttention`` under lm1b's mask
(``nn.make_causal_mask`` combined with ``nn.make_attention_mask`` of the non-padding
tokens, id 0 padding), the inputs shifted right (lm1b's ``shift_right``: ``jnp.pad`` and
``lax.dynamic_slice_in_dim``), ``nn.Dropout`` drawing from the ``dropout`` rng that
``model.apply(..., rngs={"dropout": key})`` passes in; the blocks stacked by ``nn.scan``
(parameters on a leading layer dim, the ``params`` and ``dropout`` rngs split per layer)
over ``nn.remat``. With ``Config(logical=True)`` every initializer but the layer norms' is
wrapped by ``nn.with_logical_partitioning`` (lm1b's and MaxText's annotations: parameters
in ``nn.LogicallyPartitioned`` boxes, the scan adding the ``"layers"`` axis), and
:data:`LOGICAL_RULES` map the names onto the Megatron plan's layouts. The loss is optax's
integer-label cross-entropy weighted by the non-padding targets, as lm1b weights it.
Training is ``flax.training.train_state.TrainState`` (a pytree of ``step``, ``params`` and
``opt_state``; ``apply_fn`` and ``tx`` static fields) with optax AdamW: ``jax.grad`` of
the loss, then ``state.apply_gradients(grads=grads)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.typing import Initializer
from jax import lax
from flax.training import train_state

from placements2jax import colwise, distribute_pytree, rowwise

from .common import megatron_batch

LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1
    dtype: str = "float32"  # the layers' compute dtype ("bfloat16": mixed precision, float32 parameters)
    logical: bool = False  # parameters annotated with logical axis names (nn.with_logical_partitioning)

    def init(self, init: Initializer, *names: str | None) -> Initializer:
        """``init``, its parameter's dims named ``names`` when :attr:`logical`."""
        return nn.with_logical_partitioning(init, names) if self.logical else init


_KERNEL_INIT = nn.initializers.normal(stddev=0.02)
_ZEROS = nn.initializers.zeros_init()

# The logical axis names of Config(logical=True) onto :func:`megatron_plan`'s layouts: the
# vocabulary, the attention heads and the MLP's hidden features split over tp
LOGICAL_RULES = (
    ("layers", None), ("length", None), ("vocab", "tp"), ("embed", None), ("heads", "tp"), ("kv", None), ("mlp", "tp"),
)


def shift_right(x: jax.Array, axis: int = 1) -> jax.Array:
    """lm1b's input shift: a 0 (padding) first, the last token dropped."""
    pad_widths = [(0, 0)] * x.ndim
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


class MlpBlock(nn.Module):
    cfg: Config
    deterministic: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        y = nn.Dense(4 * cfg.dim, dtype=cfg.dtype, kernel_init=cfg.init(_KERNEL_INIT, "embed", "mlp"),
                     bias_init=cfg.init(_ZEROS, "mlp"), name="fc")(x)
        y = nn.Dense(cfg.dim, dtype=cfg.dtype, kernel_init=cfg.init(_KERNEL_INIT, "mlp", "embed"),
                     bias_init=cfg.init(_ZEROS, "embed"), name="out")(nn.gelu(y))
        return nn.Dropout(rate=self.cfg.dropout)(y, deterministic=self.deterministic)


class Block(nn.Module):
    """One pre-norm decoder block, in ``nn.scan``'s form: ``(carry, x) -> (carry, y)``."""

    cfg: Config
    deterministic: bool

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        y = nn.MultiHeadDotProductAttention(
            num_heads=cfg.heads, dtype=cfg.dtype, kernel_init=cfg.init(_KERNEL_INIT, "embed", "heads", "kv"),
            bias_init=cfg.init(_ZEROS, "heads", "kv"), out_kernel_init=cfg.init(_KERNEL_INIT, "heads", "kv", "embed"),
            out_bias_init=cfg.init(_ZEROS, "embed"),
            dropout_rate=self.cfg.dropout, deterministic=self.deterministic, name="attn",
        )(nn.LayerNorm(dtype=self.cfg.dtype, name="ln1")(x), mask=mask)
        x = x + nn.Dropout(rate=self.cfg.dropout)(y, deterministic=self.deterministic)
        x = x + MlpBlock(self.cfg, self.deterministic, name="mlp")(nn.LayerNorm(dtype=self.cfg.dtype, name="ln2")(x))
        return x, None


class TransformerLM(nn.Module):
    cfg: Config
    deterministic: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.dim, dtype=cfg.dtype, embedding_init=cfg.init(_KERNEL_INIT, "vocab", "embed"),
                         name="embed")
        pos = self.param("pos_embedding", cfg.init(nn.initializers.normal(stddev=0.01), "length", "embed"),
                         (cfg.seq, cfg.dim))
        mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0), nn.make_causal_mask(tokens))
        x = embed(shift_right(tokens)) + pos[: tokens.shape[1]]
        x = nn.Dropout(rate=cfg.dropout)(x, deterministic=self.deterministic).astype(cfg.dtype)
        blocks = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
            in_axes=nn.broadcast, length=cfg.layers, metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = blocks(cfg, self.deterministic, name="blocks")(x, mask)
        logits = embed.attend(nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x))  # tied output: x @ embedding.T
        return logits.astype(jnp.float32)


def loss_fn(params: Any, apply_fn: Any, tokens: jax.Array, targets: jax.Array, key: jax.Array) -> jax.Array:
    logits = apply_fn({"params": params}, tokens, rngs={"dropout": key})
    weights = (targets > 0).astype(logits.dtype)  # lm1b's: padding (id 0) does not count
    return (optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights).sum() / weights.sum()


def train_step(
    state: train_state.TrainState, tokens: jax.Array, targets: jax.Array, key: jax.Array
) -> tuple[train_state.TrainState, jax.Array]:
    """The Flax examples' step (``jax.jit``-ed there): the loss's gradient, then
    ``state.apply_gradients`` (optax's update and ``step + 1``)."""
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, tokens, targets, key)
    return state.apply_gradients(grads=grads), loss


def create(cfg: Config, seed: int = 0) -> train_state.TrainState:
    model = TransformerLM(cfg)
    tokens = jnp.zeros((1, cfg.seq), jnp.int32)
    params = model.init({"params": jax.random.key(seed), "dropout": jax.random.key(seed + 1)}, tokens)["params"]
    return train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adamw(LEARNING_RATE, weight_decay=0.1)
    )


class Functional:
    """The loss and its value_and_grad of the parameters of ``apply_fn``'s model: hashable
    (one per model), so ``apply`` caches them."""

    def __init__(self, apply_fn: Any) -> None:
        self.apply_fn = apply_fn

    def loss(self, params: Any, tokens: jax.Array, targets: jax.Array, key: jax.Array) -> jax.Array:
        return loss_fn(params, self.apply_fn, tokens, targets, key)

    def value_and_grad(self, params: Any, tokens: jax.Array, targets: jax.Array, key: jax.Array) -> tuple[Any, Any]:
        return jax.value_and_grad(self.loss)(params, tokens, targets, key)


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Megatron-LM's plan over the paths of a TrainState (``params/blocks/attn/query/kernel``;
    Adam's moments under ``opt_state/0/mu/`` and ``.../nu/``) or of its params alone. The
    scanned blocks' parameters have a leading layer dim: the attention's query / key / value
    kernels ``(layer, dim, heads, head_dim)`` and biases ``(layer, heads, head_dim)`` split
    the heads, its output kernel ``(layer, heads, head_dim, dim)`` too; the MLP's ``fc``
    (and its bias ``(layer, out)``) is column-parallel, ``out`` row-parallel; the tied
    embedding ``(vocab, dim)`` splits the vocabulary (the logits come out vocab-split)."""
    prefix = r"(params/|opt_state/0/(mu|nu)/)?"
    blocks = prefix + r"blocks/"
    return {
        prefix + r"embed/embedding": rowwise(tp),
        blocks + r"attn/(query|key|value)/kernel": f"None,None,{tp},None",
        blocks + r"attn/(query|key|value)/bias": f"None,{tp},None",
        blocks + r"attn/out/kernel": f"None,{tp},None,None",
        blocks + r"mlp/fc/kernel": colwise(tp),
        blocks + r"mlp/fc/bias": f"None,{tp}",
        blocks + r"mlp/out/kernel": rowwise(tp),
    }


def checked_programs(cfg: Config, mesh: Any) -> dict[str, tuple[Any, tuple[Any, ...], Any]]:
    """The loss, value_and_grad and the TrainState step of a model of ``cfg`` on
    :func:`megatron_plan` over ``mesh`` as ``(fn, args, out_layouts)`` for predict / check:
    the batch split over dp, a replicated dropout key; the gradients keep the parameters'
    layouts, the step the whole state's."""
    tokens, targets = megatron_batch(cfg, mesh)
    key = jax.random.key(1)
    state = distribute_pytree(create(cfg), mesh, megatron_plan())
    functional = Functional(state.apply_fn)
    return {
        "loss": (functional.loss, (state.params, tokens, targets, key), None),
        "value_and_grad": (functional.value_and_grad, (state.params, tokens, targets, key), (None, state.params)),
        "adamw step": (train_step, (state, tokens, targets, key), (state, None)),
    }
