"""LoRA fine-tuning of tests/models/llama.py's model as lorax (the JAX LoRA library) writes
it: each adapted weight is replaced in the ONE parameter tree by a ``LoraWeight`` pytree
holding the frozen base ``w`` and the adapters ``lora_a`` (in x r) and ``lora_b`` (r x out,
zero at init: the adapted model starts as the base), and the unchanged model computes
``x @ w + (x @ lora_a) @ lora_b * (alpha / r)`` where it wrote ``x @ w`` (lorax's
``LoraWeight`` is a qax implicit array; here ``__rmatmul__`` does the same for Llama's
matmuls). The adapters sit on wq and wv (PEFT's default ``target_modules`` for Llama).

The frozen / trainable split is lorax's ``wrap_optimizer``: gradients of the whole tree,
then ``optax.multi_transform`` with ``optax.set_to_zero()`` on everything but the
adapters, which take the models' clip + AdamW (common.make_optimizer), its clipping over
the adapters' gradients alone. (The other public form, the gradients taken w.r.t. the
adapters with the base passed as a separate argument, needs no labels but a split tree.)

Measured on dp=2 x tp=4 (tests/test_real_code.py, one layer): the prediction sends 14
collectives after XLA's combiner, 34,224 B per device, against XLA's 26, 54,012 B (0.63x);
the frozen weights' gradients, which ``set_to_zero`` drops, are dead code to both (over dp
only the adapters' gradients and the loss are all-reduced). Cold predict 1.2 s CPU, plain
``jax.jit``'s lower + compile 3.0 s."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from placements2jax import colwise

from . import common, llama

Params = dict[str, Any]


@dataclass(frozen=True)
class Config(llama.Config):
    layers: int = 1  # the test's check and three compiles of the step: ~20 s on one core
    rank: int = 4
    alpha: float = 8.0


@partial(jax.tree_util.register_dataclass, data_fields=["w", "lora_a", "lora_b"], meta_fields=["alpha"])
@dataclass(frozen=True)
class LoraWeight:
    w: jax.Array  # (in, out), frozen
    lora_a: jax.Array  # (in, rank)
    lora_b: jax.Array  # (rank, out)
    alpha: float

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        # jax.Array's @ defers to an operand it does not know: ``x @ LoraWeight`` lands here
        return x @ self.w + (x @ self.lora_a) @ self.lora_b * (self.alpha / self.lora_a.shape[-1])


def init(key: jax.Array, cfg: Config) -> Params:
    """llama's parameters with wq and wv made LoraWeights: A as a dense layer's init, B zero."""
    base_key, adapter_key = jax.random.split(key)
    params = llama.init(base_key, cfg)
    keys = iter(jax.random.split(adapter_key, 2 * cfg.layers))
    for layer in params["layers"]:
        attention = layer["attention"]
        for name in ("wq", "wv"):
            w = attention[name]
            lora_a = jax.random.normal(next(keys), (w.shape[0], cfg.rank), jnp.float32) / jnp.sqrt(w.shape[0])
            attention[name] = LoraWeight(w, lora_a, jnp.zeros((cfg.rank, w.shape[1])), cfg.alpha)
    return params


def labels(params: Params) -> Any:
    """lorax's freeze: "lora" on the adapters, "frozen" on everything else."""
    def label(path: tuple[Any, ...], _: jax.Array) -> str:
        return "lora" if getattr(path[-1], "name", "").startswith("lora_") else "frozen"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer() -> optax.GradientTransformation:
    return optax.multi_transform({"lora": common.make_optimizer(), "frozen": optax.set_to_zero()}, labels)


def train_step(
    params: Params, opt_state: Any, tokens: jax.Array, targets: jax.Array, cfg: Config,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Params, Any, jax.Array]:
    """llama's loss and common's step under :func:`make_optimizer` (unless ``optimizer``)."""
    return common.train_step(llama.loss, params, opt_state, tokens, targets, cfg, optimizer or make_optimizer())


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """llama's Megatron plan, the LoraWeights' base ``w`` as its wq / wv (column-parallel);
    ``lora_b`` split on its output dim like its base, so that ``(x @ lora_a) @ lora_b``
    comes out split on the heads as ``x @ w`` does and adds to it where it is; ``lora_a``
    replicated like its base's input dim (the rank, 4, split over ``tp`` would leave
    ``@ lora_b`` partial: an all-reduce of the activations per adapter)."""
    return {**llama.megatron_plan(tp), r"layers/\d+/attention/w[qv]/(w|lora_b)": colwise(tp)}
