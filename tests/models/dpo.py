"""Direct Preference Optimization (DPO) of tests/models/llama.py's model as TRL's
``DPOTrainer`` and its JAX ports write it: a trainable policy and a frozen reference of
the same architecture (its own parameters, a separate argument under
``jax.lax.stop_gradient``), pairs of prompt+chosen and prompt+rejected sequences with a
loss mask over the completions (the shared prompt masked out), run as ONE batch
(TRL's ``concatenated_forward``: chosen and rejected concatenated on the batch dim);
each sequence's log-probability is the sum over its masked positions of
``log_softmax(logits)`` taken at the next token (``take_along_axis``), and the loss
``-log_sigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)))``
averaged over the pairs. The policy alone takes the models' clip + AdamW
(common.make_optimizer). The reference is initialised from another key than the policy
(a policy some steps into tuning), so that the log-ratios are not all zero. Both models
take llama's Megatron plan; the pairs are split over dp.

Measured on dp=2 x tp=4 (stop 43, one layer, 4 pairs of 8 tokens; tests/test_real_code.py):
every output's layout agrees with XLA's; check predicts 160,910 B per device in 25
collectives after XLA's combiner (11 all-gathers, 12 all-reduces, 2 all-to-alls; stop 45's
escape from the replaced descents and keeping pull moves: 161,598 B in 28 before, which the
pinned program compiled exactly)
where plain ``jax.jit`` sends 234,484 B in 53 (0.69x): XLA gathers over tp 19 times (the
prediction 5) and all-reduces over tp in 21 collectives (11). The concatenation of the two dp-split halves is no block split of the
whole: the prediction gathers the sequences and masks over dp (4 all-gathers, 160 B) and
runs the chosen on one dp half, the rejected on the other, where XLA keeps each pair on
its device by 4 collective-permutes (32 B). Cold predict 2.4 s of CPU, plain ``jax.jit``'s
lower + compile 6.8 s (load 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import common, llama

Params = dict[str, Any]

init = llama.init
megatron_plan = llama.megatron_plan  # the policy's and the reference's


@dataclass(frozen=True)
class Config(llama.Config):
    layers: int = 1  # two forwards (policy, reference) and a backward per check and compile
    prompt: int = 3  # the shared prompt's tokens, masked out of the log-probs
    pairs: int = 4  # preference pairs per batch (split over dp)
    beta: float = 0.1


def batch(seed: int, cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """int32 prompt+chosen and prompt+rejected sequences (pairs, seq), the prompt shared,
    and their bool loss masks (True on the completions)."""
    rng = np.random.default_rng(seed)
    chosen, rejected = rng.integers(0, cfg.vocab, (2, cfg.pairs, cfg.seq)).astype(np.int32)
    rejected[:, :cfg.prompt] = chosen[:, :cfg.prompt]
    mask = np.broadcast_to(np.arange(cfg.seq) >= cfg.prompt, (cfg.pairs, cfg.seq))
    return chosen, rejected, mask.copy(), mask.copy()


def sequence_logps(params: Params, tokens: jax.Array, loss_mask: jax.Array, cfg: Config) -> jax.Array:
    """Each sequence's log-probability of its masked tokens, each predicted from those before."""
    logits = llama.forward(params, tokens, cfg)[:, :-1]
    labels, loss_mask = tokens[:, 1:], loss_mask[:, 1:]
    per_token = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(loss_mask, per_token, 0.0), axis=-1)


def dpo_loss(
    policy: Params, reference: Params, chosen: jax.Array, rejected: jax.Array, chosen_mask: jax.Array,
    rejected_mask: jax.Array, cfg: Config,
) -> jax.Array:
    tokens = jnp.concatenate([chosen, rejected])
    loss_mask = jnp.concatenate([chosen_mask, rejected_mask])
    policy_chosen, policy_rejected = jnp.split(sequence_logps(policy, tokens, loss_mask, cfg), 2)
    reference_chosen, reference_rejected = jnp.split(
        sequence_logps(jax.lax.stop_gradient(reference), tokens, loss_mask, cfg), 2)
    logits = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -jnp.mean(jax.nn.log_sigmoid(cfg.beta * logits))


def train_step(
    policy: Params, opt_state: Any, reference: Params, chosen: jax.Array, rejected: jax.Array,
    chosen_mask: jax.Array, rejected_mask: jax.Array, cfg: Config,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Params, Any, jax.Array]:
    """The DPO loss's value and the policy's gradients, then ``optimizer``'s update (default
    common.make_optimizer()'s clip + adamw)."""
    optimizer = optimizer or common.make_optimizer()
    value, grads = jax.value_and_grad(dpo_loss)(
        policy, reference, chosen, rejected, chosen_mask, rejected_mask, cfg)
    updates, opt_state = optimizer.update(grads, opt_state, policy)
    return optax.apply_updates(policy, updates), opt_state, value
