"""13. Optimizer state following its parameters: ``init_optimizer_state`` against
``apply(optimizer.init, params)`` (state bytes per device, the training step's compiled
communication and time)."""

from __future__ import annotations

import sys
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from harness import Config, Section, Table, Target, compare, microseconds, progress

from placements2jax import DTensor, apply, init_device_mesh, init_optimizer_state
from placements2jax.hlo import parse_collectives

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import common  # noqa: E402  (the test models, written as public model code)
from models.steps import training_step  # noqa: E402

GPT2 = {"d_model": 256, "vocab": 512, "layers": 2}


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def per_device_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s DTensors that one device holds (the largest over devices)."""
    held: Counter = Counter()
    for leaf in jax.tree.leaves(tree, is_leaf=_is_dtensor):
        for shard in leaf.to_jax().addressable_shards:
            held[shard.device] += shard.data.nbytes
    return max(held.values())


def _scalar_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s 0-d leaves (step counts), which every device holds whole."""
    return sum(leaf.dtype.itemsize for leaf in jax.tree.leaves(tree, is_leaf=_is_dtensor) if leaf.ndim == 0)


def _values(tree: Any) -> list[np.ndarray]:
    """Every DTensor leaf's logical value on the host (the model's layouts are even: its
    ``to_jax()`` is the array itself, fetched without compiling a gather per leaf)."""
    return [np.asarray(leaf.to_jax()) for leaf in jax.tree.leaves(tree, is_leaf=_is_dtensor)]


def run(config: Config) -> Section:
    section = Section(
        "optimizer",
        "13. Optimizer state following its parameters",
        f"""
tests/models' GPT-2 (d_model {GPT2["d_model"]}, vocab {GPT2["vocab"]}, {GPT2["layers"]} layers under
`lax.scan`, batch 4 x 8 split over dp) on dp=2 x tp=4 with the Megatron plan, with two optax
optimizers: clip + AdamW (`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))`,
what its training script uses) and `optax.adafactor` (factored row and column statistics).
**ours**: `init_optimizer_state(optimizer, params)` (every state leaf follows its parameter:
docs/training.md, Optimizers); **baseline**: `apply(optimizer.init, params)`, which leaves
the new arrays' layouts to XLA (it makes them Replicate). **state**: the bytes of the state
one device holds. **step**: the training step `apply(train_step, params, state, ...,
out_layouts=(params, state, None))` under `jax.jit` (each state kept in its own layouts),
its compiled collectives (by XLA operand) and the bytes each device sends; step time:
paired ratio ours / baseline. Both steps give the same loss, parameters and state. Quick
mode: tests/models' Megatron MLP step (clip + AdamW) instead, which compiles in a fraction
of the time.
""",
    )
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    if config.quick:
        optimizers = {"clip + adamw": (common.make_optimizer(), training_step("mlp", mesh))}
    else:  # d_model 256: adafactor's default min_dim_size_to_factor (128) factors the weights
        optimizers = {name: (optimizer, training_step("gpt2", mesh, optimizer, **GPT2)) for name, optimizer in (
            ("clip + adamw", common.make_optimizer()), ("adafactor", optax.adafactor(1e-3)))}
    rows, no_worse, states = [], [], {}
    for name, (optimizer, program) in optimizers.items():
        params, batch = program.args[0], program.args[2:]
        figures, outputs, runs = {}, {}, {}
        for side, init in (("ours", init_optimizer_state), ("baseline", lambda o, p: apply(o.init, p))):
            progress(f"  optimizer {name}: {side}")
            state = init(optimizer, params)
            jitted = jax.jit(partial(apply, program.fn, out_layouts=(params, state, None)))
            compiled = jitted.lower(params, state, *batch).compile()
            figures[side] = (per_device_bytes(state), *common.communication(parse_collectives(compiled.as_text())))
            outputs[side] = compiled(params, state, *batch)
            runs[side] = partial(compiled, params, state, *batch)
            states[(name, side)] = state
        for got, want in zip(_values(outputs["ours"]), _values(outputs["baseline"])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)  # the same step either way
        progress(f"  optimizer {name}: time")
        timing = compare(lambda: jax.block_until_ready(runs["ours"]()),
                         lambda: jax.block_until_ready(runs["baseline"]()), config)
        (ours_state, ours_n, ours_sent), (base_state, base_n, base_sent) = figures["ours"], figures["baseline"]
        rows.append((
            name, f"{ours_state:,} / {base_state:,} ({base_state / ours_state:.2f}x less)",
            f"{ours_n} / {base_n}", f"{ours_sent:,.0f} / {base_sent:,.0f} ({base_sent / ours_sent:.2f}x less)",
            microseconds(timing.ours_median), microseconds(timing.baseline_median), timing.ratio_text(),
        ))
        no_worse.append(ours_state <= base_state and ours_sent <= base_sent)
    section.tables.append(Table(
        "Per device, ours / baseline",
        ("optimizer", "state bytes", "step collectives", "step bytes sent", "ours step µs", "baseline step µs",
         "step time ours / baseline"),
        tuple(rows),
    ))
    param_bytes = per_device_bytes(optimizers["clip + adamw"][1].args[0])
    adamw = states[("clip + adamw", "ours")]
    moments = 2 * param_bytes + _scalar_bytes(adamw)
    section.targets.append(Target(
        "clip + adamw: the state per device is the moments of the device's parameter blocks",
        f"{per_device_bytes(adamw):,} B ({param_bytes:,} B of parameters)",
        "2 x parameters + step count",
        per_device_bytes(adamw) == moments,
    ))
    section.targets.append(Target(
        "init_optimizer_state's state and step bytes against apply(optimizer.init)'s",
        "; ".join(f"{name}: {rows[i][1]} state, {rows[i][3]} sent" for i, name in enumerate(optimizers)),
        "<= baseline",
        all(no_worse),
    ))
    section.notes.append(
        "apply(optimizer.init, params) makes the new arrays Replicate (XLA's choice for arrays built from "
        "nothing), so a tp-split weight's moments cost tp times its memory, and the step, which keeps each "
        "state in its layouts, brings every tp-split gradient to its replicated moments. Adafactor's factored "
        "statistics are small (a row and a column per weight), so its state differs in the unfactored leaves "
        "(biases, norms) and in the statistics that keep a split."
    )
    return section
