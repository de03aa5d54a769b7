"""One line per reference program: what ``predict`` predicts for it, to compare two trees.

A change meant to make prediction faster must leave every line identical; a change meant to
alter predictions shows here, program by program, what it changed. The programs: the test
models' loss, value_and_grad and adamw step (GPT-2, Llama), the Megatron MLP step, the Flax
NNX and Equinox programs of tests/test_frameworks.py (all on dp=2 x tp=4), the adamw steps
on 4x2 and (8,) meshes (the program search is path-dependent: a change can hold on 2x4 and
not there), Llama's on (8,) with a batch of 8 split as tests/test_autoplan.py splits it, a
4-layer Llama (the layer-block seed) and tests/test_frameworks.py's stateful ``@nnx.jit``
adamw step. Per program: the planner's bytes,
the bytes as CPU XLA compiles the predicted collectives, the collectives before and after
XLA's combiner, and hashes of the output layouts and of every equation's report (its
printed form holds no object addresses, so two runs of one tree print the same lines).
CPU seconds per program go to stderr.

    python benchmarks/dump_predictions.py > before.txt 2> times.txt   (~1 min)
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the package next to the benchmarks
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/models

import jax  # noqa: E402

from flax import nnx  # noqa: E402

from placements2jax import distribute_pytree, distribute_tensor, init_device_mesh, predict  # noqa: E402

jax.config.update("jax_platforms", "cpu")

from models import common, eqx_lm, gpt2, llama, nnx_lm  # noqa: E402
from models.steps import training_step  # noqa: E402


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _line(name: str, fn: Any, args: tuple[Any, ...], out_layouts: Any) -> str:
    start = time.process_time()
    p = predict(fn, *args, out_layouts=out_layouts)
    print(f"{name}: {time.process_time() - start:.2f} s", file=sys.stderr, flush=True)
    outputs = _digest(" ".join(str(layout) for layout in p.out_layouts))
    equations = _digest("\n".join(str(e) for e in p.equations))
    return (f"{name}: nbytes={p.nbytes} lowered={p.lowered_nbytes} coll={sum(p.collectives.values())} "
            f"combined={dict(sorted(p.combined_counts.items()))} outs={outputs} eqs={equations}")


def _programs() -> Any:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    for module, cfg in ((gpt2, gpt2.Config()), (llama, llama.Config())):
        for kind, program in common.checked_programs(module, cfg, mesh).items():
            yield f"2x4 {module.__name__.rsplit('.', 1)[-1]} {kind}", *program
    step = training_step("mlp", mesh)
    yield "2x4 mlp step", *step.program
    for name, module in (("nnx", nnx_lm), ("eqx", eqx_lm)):
        for kind, program in module.checked_programs(module.Config(layers=1), mesh).items():
            yield f"2x4 {name} {kind}", *program
    for shape, names in (((4, 2), ("dp", "tp")), ((8,), ("tp",))):
        other = init_device_mesh(shape, names)
        for model in ("gpt2", "llama"):
            step = training_step(model, other)
            yield f"{'x'.join(map(str, shape))} {model} adamw step", *step.program
    step = training_step("llama", mesh, layers=4)
    yield "2x4 llama4 adamw step", *step.program
    # tests/test_autoplan.py's Llama on (8,): a batch of 8 split over tp (a descent that never gave the kept result
    # on the programs above made this one dearer, stop 24)
    eight = init_device_mesh((8,), ("tp",))
    step = training_step("llama", eight)
    cfg = llama.Config()
    tokens, targets = (distribute_tensor(a, eight, "S(0)") for a in common.batch(0, 8, cfg.seq, cfg.vocab))
    yield "8 llama adamw step batch 8 S(0)", step.fn, (*step.args[:2], tokens, targets), step.out_layouts
    # tests/test_frameworks.py's stateful @nnx.jit adamw step (model and nnx.Optimizer updated in place; a schedule
    # of the descents that kept the 18 programs above made this one dearer, stop 25)
    nnx_cfg = nnx_lm.Config(layers=1)
    model, optimizer = distribute_pytree(nnx_lm.create(nnx_cfg), mesh, nnx_lm.megatron_plan())
    nnx_tokens, nnx_targets = common.megatron_batch(nnx_cfg, mesh)
    yield "2x4 nnx adamw step (nnx.jit)", nnx.jit(nnx_lm.train_step), (model, optimizer, nnx_tokens, nnx_targets), None


def main() -> None:
    for name, fn, args, out_layouts in _programs():
        print(_line(name, fn, args, out_layouts), flush=True)


if __name__ == "__main__":
    main()
