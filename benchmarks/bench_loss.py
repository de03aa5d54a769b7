"""8. Vocabulary-parallel cross-entropy against gathering the logits first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bounds import sent_bytes_per_device
from harness import Config, Section, Table, Target, compare, microseconds, progress

from placements2jax import distribute_tensor, init_device_mesh, vocab_parallel_cross_entropy
from placements2jax.hlo import compiled_collectives

VOCAB = 32768


def _gathered_loss(logits, labels):
    """The baseline: all-gather the vocabulary (redistribute to Replicate over tp), then optax."""
    full = logits.redistribute(placements="S(0),R").to_jax()
    return optax.softmax_cross_entropy_with_integer_labels(full, labels.to_jax()).mean()


def _parallel_loss(logits, labels):
    return vocab_parallel_cross_entropy(logits, labels).to_jax()


def run(config: Config) -> Section:
    tokens = 64 if config.quick else 512
    section = Section(
        "loss",
        "8. Vocabulary-parallel cross-entropy vs gathering the logits",
        f"""
Logits of {tokens} tokens x vocabulary {VOCAB} (float32) on mesh dp=2 x tp=4, laid out
`S(0),S(1)` (tokens over dp, vocabulary over tp, as a column-parallel output projection
leaves them); labels `S(0),R`. **Gather first**: `redistribute` the logits to `S(0),R`
(an all-gather of the vocabulary over tp), then `optax.softmax_cross_entropy_with_integer_labels`
and the mean. **Ours**: `vocab_parallel_cross_entropy`, which all-reduces per-token scalars only
(the max, then the sum of exponentials and the target logit). Both jitted, forward alone and
forward + backward (`jax.value_and_grad`). Bytes are the average bytes each device sends in
the compiled program's collectives (all-gather `R(n-1)/n`, all-reduce `2R(n-1)/n`,
`benchmarks/bounds.py`).
""",
    )
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    rng = np.random.default_rng(0)
    logits = distribute_tensor(rng.normal(size=(tokens, VOCAB)).astype(np.float32), mesh, "S(0),S(1)")
    labels = distribute_tensor(rng.integers(0, VOCAB, size=(tokens,)).astype(np.int32), mesh, "S(0),R")
    rows, figures = [], {}
    for step, wrap in (("forward", lambda f: f), ("forward + backward", jax.value_and_grad)):
        progress(f"  loss {step}")
        ours, gathered = jax.jit(wrap(_parallel_loss)), jax.jit(wrap(_gathered_loss))
        value_ours, value_gathered = ours(logits, labels), gathered(logits, labels)
        loss_ours, loss_gathered = (v[0] if isinstance(v, tuple) else v for v in (value_ours, value_gathered))
        np.testing.assert_allclose(float(loss_ours), float(loss_gathered), rtol=1e-5)
        sent_ours = sent_bytes_per_device(compiled_collectives(ours, logits, labels), mesh.size())
        sent_gathered = sent_bytes_per_device(compiled_collectives(gathered, logits, labels), mesh.size())
        timing = compare(lambda: jax.block_until_ready(ours(logits, labels)),
                         lambda: jax.block_until_ready(gathered(logits, labels)), config)
        figures[step] = (sent_ours, sent_gathered, timing)
        rows.append((
            step, f"{float(sent_ours):.0f}", f"{float(sent_gathered):.0f}", f"{float(sent_gathered / sent_ours):.0f}",
            microseconds(timing.ours_median), microseconds(timing.baseline_median), timing.ratio_text(),
        ))
    section.tables.append(Table(
        "Bytes sent per device and time, ours vs gather first",
        ("step", "ours bytes", "gather-first bytes", "bytes ratio", "ours µs", "gather-first µs",
         "time ours / gather"),
        tuple(rows),
    ))
    sent_ours, sent_gathered, timing = figures["forward"]
    section.targets.append(Target(
        "the forward sends at least vocab/8 times fewer bytes than gathering",
        f"{float(sent_gathered / sent_ours):.0f}x fewer (vocab / 8 = {VOCAB // 8})",
        f">= {VOCAB // 8}x",
        sent_gathered / sent_ours >= VOCAB // 8,
    ))
    section.notes.append(
        "Gathering sends each device's (tokens/dp) x (vocab/tp) block to the 3 other tp ranks: "
        "(3/4) x tokens/dp x vocab x 4 bytes. Ours sends one all-reduce of 1 and one of 2 floats per local "
        "token over tp (ring: 2 x 3/4 per value), plus a scalar all-reduce over dp for the mean: "
        "the ratio is about vocab / 6 (the ring all-reduce sends every value twice, an all-gather once)."
    )
    return section
