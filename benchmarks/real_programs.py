"""The real-programs table of docs/inference.md section 6, rebuilt from tests/models.

Each row is a whole training step as public JAX / Flax / Equinox / optax code writes it
(Megatron or expert-parallel plans on dp=2 x tp=4, the batch of 4 split over ``dp``, the
parameters and optimizer state keeping their layouts). Per row: ``check``'s predicted bytes
per device (bfloat16 collectives at the float32 bytes CPU XLA sends) against XLA's compiled
bytes, the prediction's collectives after XLA's combiner against XLA's compiled ones (by
operand in brackets), and what ``apply(execute="pinned")`` under ``jax.jit`` compiles
(bytes and collectives). A table row printed here is the only source of a figure in that
table: every probe is kept, so each figure can be re-measured.

    python benchmarks/real_programs.py > table.md      (~5 min on 2 idle cores)
    python benchmarks/real_programs.py "moe sort"     (the rows whose names contain it)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the package next to the benchmarks
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/models

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_platforms", "cpu")

from models import common, eqx_scan, nnx_scan  # noqa: E402
from models.steps import training_step  # noqa: E402

from placements2jax import DeviceMesh, apply, distribute_pytree, init_device_mesh  # noqa: E402
from placements2jax.hlo import parse_collectives  # noqa: E402
from placements2jax.inference import check  # noqa: E402
from placements2jax.inference.check import collective_nbytes  # noqa: E402

Program = tuple[Callable[..., Any], tuple[Any, ...], Any]  # fn, args, out_layouts (None: the function's own)


def _step(model: str, optimizer: optax.GradientTransformation | None = None, **config: Any) -> Callable[..., Program]:
    def build(mesh: DeviceMesh) -> Program:
        step = training_step(model, mesh, optimizer, **config)
        return step.fn, step.args, step.out_layouts

    return build


def _eqx_scan(mesh: DeviceMesh) -> Program:
    cfg = eqx_scan.Config()
    model = eqx_scan.LM(cfg, jax.random.key(0))
    params = distribute_pytree(model, mesh, eqx_scan.megatron_plan())
    state = common.distribute_state(
        eqx_scan.make_optimizer().init(eqx.filter(model, eqx.is_array)), eqx.filter(params, eqx.is_array)
    )
    return eqx_scan.train_step, (params, state, *common.megatron_batch(cfg, mesh)), (params, state, None)


def _nnx_scan(mesh: DeviceMesh) -> Program:
    """The stateful ``@nnx.jit`` step: it returns the loss and updates its Variables in place
    (apply's out_layouts are the function's outputs only; the Variables keep their layouts)."""
    cfg = nnx_scan.Config()
    model, optimizer = distribute_pytree(nnx_scan.create(cfg), mesh, nnx_scan.megatron_plan())
    return nnx.jit(nnx_scan.train_step), (model, optimizer, *common.megatron_batch(cfg, mesh)), None


BF16 = {"dtype": "bfloat16"}
PROGRAMS: dict[str, Callable[[DeviceMesh], Program]] = {
    "Llama, GQA + RoPE, `lax.scan` over 2 stacked layers, einsum attention, f32, clip + adamw":
        _step("llama_scan"),
    "the same in bf16, `jax.nn.dot_product_attention(is_causal=True)`":
        _step("llama_scan", attention="dot_product_attention", **BF16),
    "the same in bf16, einsum attention": _step("llama_scan", **BF16),
    "the same in bf16, GQA passed to `dot_product_attention` unrepeated":
        _step("llama_scan", attention="gqa dot_product_attention", **BF16),
    "the same in bf16, 1 layer, `dot_product_attention(mask=causal & ~padding)`":
        _step("llama_scan", attention="masked dot_product_attention", layers=1, **BF16),
    "MoE top-2 (`lax.top_k`, one_hot / einsum dispatch, experts split over `tp`), clip + adamw": _step("moe"),
    "MoE top-2, sort dispatch (`argsort`, gathered expert weights, `.at[].add`)": _step("moe", dispatch="sort"),
    "stacked LM (tests/models/stacked.py), clip + adamw": _step("stacked"),
    "stacked LM, `optax.MultiSteps(clip + inject_hyperparams(adamw)(warmup_cosine))`":
        _step("stacked", common.accumulating_optimizer()),
    "stacked LM bf16, remat, 2 microbatches under `lax.scan`":
        _step("stacked", microbatches=2, remat=True, **BF16),
    "stacked LM, 2 microbatches under `lax.fori_loop`, `optax.lion`":
        _step("stacked", optax.lion(1e-4), microbatches=2, accumulate="fori_loop"),
    "stacked LM, `optax.apply_if_finite(optax.adam(1e-3), 3)`": _step("stacked", optax.apply_if_finite(optax.adam(1e-3), 3)),
    "stacked LM, 3 layers, remat, `scan(unroll=2)`": _step("stacked", layers=3, remat=True, unroll=2),
    "Equinox, `eqx.filter_vmap`-made layers under `lax.scan` (partition / combine), adamw": _eqx_scan,
    "Flax NNX, `nnx.vmap`-made layers under `nnx.scan` + `nnx.remat`, stateful `nnx.Optimizer` step": _nnx_scan,
}


def _compiled_communication(compiled: Any) -> tuple[int, float]:
    collectives = parse_collectives(compiled.as_text())
    return len(collectives), float(sum(collective_nbytes(c, 8) for c in collectives))


def _bytes(nbytes: float) -> str:
    return f"{nbytes:,.0f}" if nbytes == int(nbytes) else f"{nbytes:,.1f}"


def measure(name: str, mesh: DeviceMesh) -> tuple[str, ...]:
    fn, args, out_layouts = PROGRAMS[name](mesh)
    report = check(fn, *args, out_layouts=out_layouts)
    agree = all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    predicted, compiled = float(report.predicted_bytes), float(report.compiled_bytes)
    # the parameters returned too: a stateful step's updated Variables are its arguments' (nnx)
    pinned = eqx.filter_jit(lambda *a: (apply(fn, *a, out_layouts=out_layouts, execute="pinned"), a[:2]))
    count, nbytes = _compiled_communication(pinned.lower(*args).compile().compiled)
    return (
        name, _bytes(predicted), _bytes(compiled), f"{predicted / compiled:.2f}",
        f"{len(report.predicted_combined)} / {len(report.compiled_collectives)}"
        f" ({sum(report.compiled_operand_counts.values())})",
        f"{_bytes(nbytes)} ({count})", "yes" if agree else "NO",
    )


def main(selected: str = "") -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    print("| program | predicted B | XLA B | ratio | collectives predicted / XLA (XLA's operands) "
          "| pinned B (collectives) | outputs agree |")
    print("|---|---|---|---|---|---|---|")
    for name in PROGRAMS:
        if selected in name:
            start = time.process_time()
            print("| " + " | ".join(measure(name, mesh)) + " |", flush=True)
            print(f"{name}: {time.process_time() - start:.1f} CPU s", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
