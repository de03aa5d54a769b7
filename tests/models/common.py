"""Helpers shared by the test models: batches, optimizer, laying out optimizer state, and
the communication of a compiled program."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from placements2jax import DTensor, Layout, distribute_pytree, distribute_tensor, state_layouts
from placements2jax.dtensor import auto_twin_of
from placements2jax.hlo import Collective
from placements2jax.inference.cost import collective_nbytes
from placements2jax.operators import pinned_function


def make_optimizer(learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """What GPT-2 / Llama training scripts use: global-norm clipping, then AdamW."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.1))


def first_adam_slack(got_state: Any, want_state: Any, learning_rate: float = 1e-3, eps: float = 1e-8,
                     b1: float = 0.9) -> list[np.ndarray]:
    """Per parameter (in leaf order), how far Adam's first update, ``lr * g / (|g| + eps)``,
    can move on the gradients' difference the two states' first moments show (``mu = (1 -
    b1) g``): that difference times the update's slope ``lr * eps / (|g| + eps) ** 2`` at the
    smallest ``|g|`` either allows. Nil where ``|g|`` is well above ``eps``; where a gradient
    cancels to ~``eps`` (Llama's w3 at 1e-8) a last-bit difference of its partial sums,
    added in another order than one device adds them, moves the update by ~1% of ``lr``.
    The states' moments are themselves compared to a tolerance."""
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    got, want = (
        next(s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)) for state in (got_state, want_state)
    )
    slack = []
    for a, b in zip(jax.tree.leaves(got.mu, is_leaf=_is_dtensor), jax.tree.leaves(want.mu), strict=True):
        a = np.asarray(a.full_tensor() if _is_dtensor(a) else a, np.float64)
        b = np.asarray(b, np.float64)
        difference = np.abs(a - b) / (1 - b1)
        smallest = np.minimum(np.abs(a), np.abs(b)) / (1 - b1)
        slack.append(learning_rate * eps * difference / (smallest + eps) ** 2)
    return slack


def train_step(
    loss: Any, params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array, cfg: Any,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Any, Any, jax.Array]:
    """A language model's training step as its scripts write it: ``loss(params, tokens,
    targets, cfg=cfg)``'s value and gradients, then ``optimizer``'s update (default
    :func:`make_optimizer`'s clip + adamw); the models bind their own ``loss``."""
    optimizer = optimizer or make_optimizer()
    value, grads = jax.value_and_grad(partial(loss, cfg=cfg))(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def accumulating_optimizer() -> optax.GradientTransformation:
    """Gradient accumulation over 2 steps (``optax.MultiSteps``: a ``lax.cond`` between the
    inner update and accumulating) around clipping and AdamW with a warmup-cosine learning
    rate injected as a hyperparameter (its state holds the current rate)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=10, decay_steps=100)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1)
    return optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), adamw), every_k_schedule=2)


def batch(seed: int, batch_size: int, seq: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and next-token targets, int32 (batch, seq)."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch_size, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def distribute_state(state: Any, params: Any) -> Any:
    """``state`` (from ``optimizer.init`` on plain arrays) as DTensors laid out like the
    DTensor ``params`` (:func:`placements2jax.state_layouts`: Adam's ``mu`` and ``nu``
    take the parameters' layouts, step counts are Replicate)."""
    layouts = state_layouts(state, params)
    flat_layouts = jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, Layout))
    leaves, tree = jax.tree.flatten(state)
    placed = [  # a PRNG key in the state (optax.noisy_sgd's) stays a key, as distribute_pytree leaves keys
        x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else distribute_tensor(np.asarray(x), layout.mesh, layout)
        for x, layout in zip(leaves, flat_layouts)
    ]
    return jax.tree.unflatten(tree, placed)


def communication(collectives: list[Collective]) -> tuple[int, float]:
    """A compiled program's collectives (``parse_collectives`` of its HLO text, or
    ``compiled_collectives``) as (how many, bytes each device sends) on the 8 test devices."""
    return len(collectives), float(sum(collective_nbytes(c, 8) for c in collectives))


def compiled_pinned(prediction: Any, cost_model: Any = None) -> tuple[Any, list[jax.ShapeDtypeStruct]]:
    """``prediction``'s pinned program (:func:`placements2jax.operators.pinned_function`,
    under ``cost_model``) compiled by ``jax.jit`` on its inputs' layouts as plain JAX takes
    them (on their mesh's Auto twin), and those inputs' ShapeDtypeStructs (their shardings
    place the arguments to run it on)."""
    twin = auto_twin_of(prediction.inputs[0].layout.mesh.to_jax())
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(twin, s.layout.partition_spec))
               for s in prediction.inputs]
    return jax.jit(pinned_function(prediction, cost_model)).lower(*structs).compile(), structs


def below_floor(report: Any) -> bool:
    """Predicted bytes below a test's floor are allowed only where XLA legitimately sends more
    (``report``: a :func:`placements2jax.check` report): every collective kind where XLA sends
    more bytes has more XLA operands than predicted collectives (check's note per kind: "XLA
    has N more; XLA sends N B per device more")."""
    return all(c.compiled_bytes <= c.predicted_bytes or c.operands > c.predicted for c in report.collective_checks)


def below_floor_by_own_kinds(report: Any, floor: float) -> bool:
    """Predicted bytes below ``floor`` times XLA's allowed where the difference is XLA's own
    kind of collective: XLA's collective-permutes, the only kind it sends that the prediction
    does not (check's note: "XLA's own choice (N B per device); no predicted counterpart"),
    moving the attention heads where the prediction moves them by all-to-alls (5,120 B
    against 2,304 on the test models' losses; XLA compiling the predicted layouts pinned
    sends the predicted all-to-alls). Set aside with the kinds the prediction alone sends,
    the kinds both send must reach ``floor`` times XLA's bytes."""
    checks = report.collective_checks
    both = [c for c in checks if c.predicted and c.operands]
    xla_only = {c.kind for c in checks if c.operands and not c.predicted}
    return (
        bool(both) and xla_only == {"collective-permute"}
        and sum(c.predicted_bytes for c in both) >= floor * sum(c.compiled_bytes for c in both)
    )


def plain(tree: Any) -> Any:
    """A pytree of DTensors as plain global jax.Arrays (for the unsharded reference), each
    gathered and waited for before the next: XLA's CPU runtime can abort the process when
    many programs with collectives are in flight at once (a clean-clone CI run aborted in
    full_tensor while gathering an adamw step's ~60 parameters and Adam moments at load 6-8)."""
    return jax.tree.map(
        lambda x: jax.block_until_ready(x.full_tensor()) if _is_dtensor(x) else x, tree, is_leaf=_is_dtensor
    )


def megatron_batch(cfg: Any, mesh: Any) -> tuple[Any, Any]:
    """The checked programs' token ids and targets: 4 sequences of ``cfg``'s model (its
    ``seq`` and ``vocab``), split over the first mesh axis (``S(0),R``, dp)."""
    tokens, targets = batch(0, 4, cfg.seq, cfg.vocab)
    return distribute_tensor(tokens, mesh, "S(0),R"), distribute_tensor(targets, mesh, "S(0),R")


def checked_programs(module: Any, cfg: Any, mesh: Any) -> dict[str, tuple[Any, tuple[Any, ...], Any]]:
    """``module``'s (gpt2 / llama) loss, value_and_grad and clip + adamw step on the Megatron
    plan over ``mesh`` as ``(fn, args, out_layouts)`` for predict / check: the batch split
    over dp, the gradients, parameters and optimizer state keeping the parameters' layouts."""
    params = distribute_pytree(module.init(jax.random.key(0), cfg), mesh, module.megatron_plan())
    tokens, targets = megatron_batch(cfg, mesh)
    extra = (jax.random.key(1),) if hasattr(cfg, "dropout") else ()  # GPT-2's dropout key
    loss = partial(module.loss, cfg=cfg)
    state = distribute_state(make_optimizer().init(plain(params)), params)
    return {
        "loss": (loss, (params, tokens, targets, *extra), None),
        "value_and_grad": (jax.value_and_grad(loss), (params, tokens, targets, *extra), (None, params)),
        "adamw step": (partial(module.train_step, cfg=cfg), (params, state, tokens, targets, *extra),
                       (params, state, None)),
    }
