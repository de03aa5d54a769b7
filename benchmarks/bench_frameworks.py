"""12. Flax NNX, Equinox and Flax Linen training code: predict / check and apply against plain JAX.

The test models tests/models/nnx_lm.py, eqx_lm.py and linen_lm.py (written as those
libraries' examples write them) on dp=2 x tp=4 with the Megatron plan: the loss,
value_and_grad and the AdamW step (Flax NNX: the stateful ``@nnx.jit`` step updating the
model and ``nnx.Optimizer`` in place; Equinox: ``train_step`` on the whole model, its
activation function and float leaves static; Flax Linen: two blocks under ``nn.scan`` +
``nn.remat``, dropout from a ``dropout`` rng, the ``TrainState`` step). Per program:
``check``'s predicted / XLA-compiled bytes per device and collectives; ``apply`` under
``jax.jit`` (``eqx.filter_jit`` for Equinox) against plain JAX of the same function on the
same input and output shardings: compiled collectives, bytes and the paired step-time
ratio."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from flax import nnx
from harness import Comparison, Config, Section, Table, Target, microseconds, paired, progress, time_each, within
from jax.sharding import NamedSharding

from placements2jax import DTensor, apply, distribute_pytree, init_device_mesh
from placements2jax.dtensor import auto_twin_of
from placements2jax.hlo import parse_collectives
from placements2jax.inference import check

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import common, eqx_lm, linen_lm, nnx_lm  # noqa: E402  (the test models, written as public model code)

nnx_train_step = nnx.jit(nnx_lm.train_step)  # decorated as Flax's examples decorate it


@dataclass(frozen=True)
class Program:
    """``fn(*args)`` (DTensor arguments); ``out_layouts`` as apply takes it; ``stateful``: an
    nnx step updating its model / optimizer arguments in place (run as ``(loss, (model, optimizer))``
    under jit)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    out_layouts: Any = None
    stateful: bool = False
    loss: int = 0  # the loss's index among the result's leaves


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def _plain(x: Any) -> Any:
    """A DTensor as plain JAX takes it: the same blocks on the Auto twin of its mesh."""
    if not _is_dtensor(x):
        return x
    return jax.device_put(x.to_jax(), NamedSharding(auto_twin_of(x.device_mesh.to_jax()), x.to_jax().sharding.spec))


def _programs(quick: bool) -> list[Program]:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    cfg = nnx_lm.Config(layers=1)
    functional = nnx_lm.checked_programs(cfg, mesh)
    programs = [Program("nnx loss", *functional["loss"])]
    if quick:
        return programs
    tokens, targets = functional["loss"][1][1:]
    model, optimizer = distribute_pytree(nnx_lm.create(cfg), mesh, nnx_lm.megatron_plan())
    eqx_programs = eqx_lm.checked_programs(eqx_lm.Config(layers=1), mesh)
    linen_programs = linen_lm.checked_programs(linen_lm.Config(), mesh)  # 2 layers: a loop, as XLA compiles it
    return programs + [
        Program("nnx value_and_grad", *functional["value_and_grad"]),
        Program("nnx adamw step (@nnx.jit, in place)", nnx_train_step, (model, optimizer, tokens, targets),
                stateful=True),
        Program("eqx loss (whole model)", *eqx_programs["loss"]),
        Program("eqx value_and_grad", *eqx_programs["value_and_grad"]),
        Program("eqx adamw step (whole model)", *eqx_programs["adamw step"], loss=-1),
        Program("linen loss (nn.scan, 2 layers)", *linen_programs["loss"]),
        Program("linen value_and_grad", *linen_programs["value_and_grad"]),
        Program("linen adamw step (TrainState)", *linen_programs["adamw step"], loss=-1),
    ]


def _constrained(fn: Callable[..., Any], shardings: Any) -> Callable[..., Any]:
    """``fn`` with its outputs constrained to ``shardings`` (a prefix; None: free)."""
    if shardings is None:
        return fn

    def constrain(x: Any, sharding: Any) -> Any:
        return x if sharding is None else jax.tree.map(lambda y: jax.lax.with_sharding_constraint(y, sharding), x)

    def run(*args: Any) -> Any:
        return jax.tree.map(lambda s, x: constrain(x, s), shardings, fn(*args), is_leaf=lambda x: x is None)

    return run


def _sharding_of(x: Any) -> Any:
    return _plain(x).sharding if _is_dtensor(x) else None


def _measure(program: Program, config: Config) -> tuple[tuple[Any, ...], bool, Comparison]:
    fn, args = program.fn, program.args
    report = check(fn, *args, out_layouts=program.out_layouts)
    agree = sum(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    predicted = sum(report.predicted_counts.values())
    compiled = sum(report.compiled_operand_counts.values())
    plain_args = jax.tree.map(_plain, args, is_leaf=_is_dtensor)
    if program.stateful:  # the updated model / optimizer copies are the jitted function's outputs
        def ours_fn(*a: Any) -> Any:
            return apply(fn, *a), a[:2]

        def plain_fn(*a: Any) -> Any:
            return fn(*a), a[:2]

        shardings = (None, jax.tree.map(_sharding_of, args[:2], is_leaf=_is_dtensor))
    else:
        def ours_fn(*a: Any) -> Any:
            return apply(fn, *a, out_layouts=program.out_layouts)

        plain_fn = fn
        shardings = jax.tree.map(_sharding_of, program.out_layouts, is_leaf=_is_dtensor)
    ours = eqx.filter_jit(ours_fn)
    plain = eqx.filter_jit(_constrained(plain_fn, shardings))
    n_ours, b_ours = common.communication(parse_collectives(ours.lower(*args).compile().compiled.as_text()))
    n_plain, b_plain = common.communication(parse_collectives(plain.lower(*plain_args).compile().compiled.as_text()))
    loss = jax.tree.leaves(ours(*args), is_leaf=_is_dtensor)[program.loss]
    want = jax.tree.leaves(plain(*plain_args))[program.loss]
    np.testing.assert_allclose(float(loss.full_tensor()), float(want), rtol=1e-5)
    times = time_each(
        (lambda: jax.block_until_ready(ours(*args)), lambda: jax.block_until_ready(plain(*plain_args))), config
    )
    timing = paired(times[0], times[1])
    row = (
        program.name, f"{agree} of {len(report.outputs)}",
        f"{float(report.predicted_bytes) / 1e3:.1f} / {float(report.compiled_bytes) / 1e3:.1f} KB "
        f"({float(report.predicted_bytes / report.compiled_bytes):.2f})",
        f"{predicted} / {compiled}", f"{n_ours} / {n_plain}", f"{b_ours:.0f} / {b_plain:.0f}",
        microseconds(timing.ours_median), microseconds(timing.baseline_median), timing.ratio_text(),
    )
    return row, n_ours <= n_plain and b_ours <= b_plain, timing


def run(config: Config) -> Section:
    section = Section(
        "frameworks",
        "12. Flax NNX, Equinox and Flax Linen training code",
        """
The test models in Flax NNX, Equinox and Flax Linen (tests/models/nnx_lm.py, eqx_lm.py:
one block; linen_lm.py: two blocks under `nn.scan` + `nn.remat`, the Flax examples'
`TrainState` step; dim 32, batch 4 x 8 split over dp) on dp=2 x tp=4 with the Megatron plan. **check**: the
outputs whose predicted placements agree with XLA's (or XLA reduced a partial), predicted /
XLA-compiled bytes per device and collectives (XLA's counted by operand). **apply vs plain
JAX**: `apply(fn, ...)` under `eqx.filter_jit` (= `jax.jit`, non-array leaves static)
against plain `eqx.filter_jit(fn)` on the same input shardings with the outputs constrained
as `out_layouts` (the Flax step: its updated model and optimizer, kept in their layouts;
the plain side runs the same `@nnx.jit` step; Linen's step: its TrainState kept in its
layouts): compiled collectives and bytes per device,
and the paired step times (quick mode: the NNX loss only).
""",
    )
    rows, comm_met, timings = [], True, []
    for program in _programs(config.quick):
        progress(f"  frameworks {program.name}")
        row, comm, timing = _measure(program, config)
        rows.append(row)
        comm_met = comm_met and comm
        timings.append(timing)
    section.tables.append(
        Table(
            "check and apply on Flax NNX / Equinox / Flax Linen programs (dp=2 x tp=4, Megatron plan)",
            ("program", "outputs agreeing with XLA", "predicted / XLA bytes", "predicted / XLA collectives",
             "collectives apply / jit", "bytes apply / jit", "apply (µs)", "jit (µs)", "time apply / jit"),
            tuple(rows),
        )
    )
    section.targets.append(
        Target("apply under jit of NNX / Equinox / Linen programs: no more collectives or bytes than plain jit",
               "; ".join(f"{r[0]}: {r[4]} collectives, {r[5]} B" for r in rows), "<= jit", comm_met)
    )
    section.targets.append(within("apply under jit of NNX / Equinox / Linen programs: step time", timings, 1.1))
    return section
