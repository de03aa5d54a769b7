"""14. Real training programs: predicted vs compiled, rebuilt from tests/models (the table
docs/inference.md section 6 discusses).

Each row is a whole training step as public JAX / Flax / Equinox / optax code writes it
(Megatron or expert-parallel plans on dp=2 x tp=4, the batch of 4 split over ``dp``, the
parameters and optimizer state keeping their layouts). Per row: ``check``'s predicted bytes
per device (bfloat16 collectives at the float32 bytes CPU XLA sends) against XLA's compiled
bytes, the prediction's collectives after XLA's combiner against XLA's compiled ones (by
operand in brackets), and what ``apply(execute="pinned")`` under ``jax.jit`` compiles
(bytes and collectives), under the default cost model: latency-bound since stop 39 (8,192 B
per all-gather and all-to-all, the collectives CPU XLA's combiner never merges, 192 per
all-reduce and reduce-scatter, which it merges: a pod's latency in bytes is tens of KB).
The second table: the same under 192 B per collective of every kind,
``CostModel(collective_overhead=192)`` (the default until stop 38, the search's own
overhead). Both tables also give each plan's communication time on a pod's alpha-beta model
(5 us per collective after XLA's combiner plus its bytes at 50 GB/s) against XLA's. The
third: the programs of tests/models at a realistic width (d_model 512 or 256, sequence 256,
vocabulary 4,096), predicted under both models against XLA's compiled program. Every probe
is kept here, so each figure can be re-measured.

    .venv/bin/python benchmarks/run.py --only real_programs        (~10 min on 2 idle cores)
    .venv/bin/python benchmarks/bench_real_programs.py "moe sort"  (the rows whose names contain it)
    .venv/bin/python benchmarks/bench_real_programs.py "stacked" 192         (under CostModel(collective_overhead=192))
    .venv/bin/python benchmarks/bench_real_programs.py "" unmerged=3072      (3,072 B per all-gather and all-to-all)
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run alone: 8 devices before JAX starts (run.py sets them itself)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the package next to the benchmarks
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/models

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from harness import Config, Section, Table, Target, progress  # noqa: E402
from models import common, eqx_scan, explicit_lm, nnx_scan, shampoo  # noqa: E402
from models.steps import fully_sharded, training_step  # noqa: E402

from placements2jax import DeviceMesh, apply, distribute_pytree, distribute_tensor, init_device_mesh  # noqa: E402
from placements2jax.hlo import parse_collectives  # noqa: E402
from placements2jax.inference import CostModel, check, default_cost_model, use_cost_model  # noqa: E402
from placements2jax.inference.cost import SEARCH_OVERHEAD  # noqa: E402

Program = tuple[Callable[..., Any], tuple[Any, ...], Any]  # fn, args, out_layouts (None: the function's own)


# each model's realistic width (the third table): ~8-16x its tiny widths, as small LMs have
_WIDE: dict[str, dict[str, Any]] = {
    "llama_scan": {"seq": 256, "vocab": 4096, "dim": 512, "hidden": 1408},
    "gemma": {"seq": 256, "vocab": 4096, "dim": 512, "hidden": 1408, "window": 64},
    "moe": {"seq": 256, "vocab": 4096, "dim": 256, "hidden": 512},
    "stacked": {"seq": 256, "vocab": 4096, "dim": 512, "hidden": 1024},
}


class _Step:
    """A program of tests/models/steps.py: ``training_step(model, mesh, optimizer, **config)``;
    :meth:`wide` the same at the model's realistic width."""

    def __init__(self, model: str, optimizer: optax.GradientTransformation | None = None, **config: Any) -> None:
        self.model, self.optimizer, self.config = model, optimizer, config

    def __call__(self, mesh: DeviceMesh) -> Program:
        step = training_step(self.model, mesh, self.optimizer, **self.config)
        return step.program

    def wide(self) -> _Step:
        return _Step(self.model, self.optimizer, **{**self.config, **_WIDE[self.model]})




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


def _fully_sharded(model: str) -> Callable[[DeviceMesh], Program]:
    """``model``'s step with its parameters and optimizer state fully sharded over ``dp`` on
    top of the Megatron plan (tests/models/steps.py :func:`fully_sharded`)."""

    def build(mesh: DeviceMesh) -> Program:
        step = fully_sharded(training_step(model, mesh))
        return step.program

    return build


def _explicit_lm(mesh: DeviceMesh) -> Program:
    """tests/models/explicit_lm.py's clip + adamw step, written for JAX's explicit sharding
    (``out_sharding=`` where an einsum contracts or merges tp-split dims, the embedding
    lookup's ``at[].get(out_sharding=)``): measured inside ``jax.set_mesh`` of the Explicit
    mesh (:attr:`in_set_mesh`), where predict traces it typed and check compiles it, as the
    user's ``jax.jit`` there does."""
    cfg = explicit_lm.Config()
    plain = explicit_lm.init(jax.random.key(0), cfg)
    params = distribute_pytree(plain, mesh, explicit_lm.megatron_plan())
    state = common.distribute_state(common.make_optimizer().init(plain), params)
    batch = [distribute_tensor(a, mesh, "S(0),R") for a in common.batch(0, 4, cfg.seq, cfg.vocab)]
    return partial(explicit_lm.train_step, cfg=cfg), (params, state, *batch), (params, state, None)


_explicit_lm.in_set_mesh = True  # type: ignore[attr-defined]


def _split_shampoo(mesh: DeviceMesh) -> Program:
    step = shampoo.split_statistics(training_step("mlp", mesh, shampoo.shampoo(1e-3)))
    return step.program


BF16 = {"dtype": "bfloat16"}
PROGRAMS: dict[str, Callable[[DeviceMesh], Program]] = {
    "Llama, GQA + RoPE, `lax.scan` over 2 stacked layers, einsum attention, f32, clip + adamw":
        _Step("llama_scan"),
    "the same in bf16, `jax.nn.dot_product_attention(is_causal=True)`":
        _Step("llama_scan", attention="dot_product_attention", **BF16),
    "the same in bf16, einsum attention": _Step("llama_scan", **BF16),
    "the same in bf16, GQA passed to `dot_product_attention` unrepeated":
        _Step("llama_scan", attention="gqa dot_product_attention", **BF16),
    "the same in bf16, 1 layer, `dot_product_attention(mask=causal & ~padding)`":
        _Step("llama_scan", attention="masked dot_product_attention", layers=1, **BF16),
    "Gemma-2 class: soft-capped attention and logits, sliding-window / global layers, GeGLU, tied vocabulary-split "
    "embeddings, label smoothing + z-loss, clip + adamw": _Step("gemma"),
    "MoE top-2 (`lax.top_k`, one_hot / einsum dispatch, experts split over `tp`), clip + adamw": _Step("moe"),
    "MoE top-2, sort dispatch (`argsort`, gathered expert weights, `.at[].add`)": _Step("moe", dispatch="sort"),
    "MoE top-2, dropless `lax.ragged_dot` (sorted rows, SwiGLU experts split on their hidden dim over `tp`)":
        _Step("moe", dispatch="ragged"),
    "MoE top-2, expert parallelism as a `shard_map` region (capacity dispatch, `lax.all_to_all` over `tp`)":
        _Step("moe", dispatch="shard_map"),
    "stacked LM (tests/models/stacked.py), clip + adamw": _Step("stacked"),
    "stacked LM, `optax.MultiSteps(clip + inject_hyperparams(adamw)(warmup_cosine))`":
        _Step("stacked", common.accumulating_optimizer()),
    "stacked LM bf16, remat, 2 microbatches under `lax.scan`":
        _Step("stacked", microbatches=2, remat=True, **BF16),
    "stacked LM, 2 microbatches under `lax.fori_loop`, `optax.lion`":
        _Step("stacked", optax.lion(1e-4), microbatches=2, accumulate="fori_loop"),
    "stacked LM, `optax.apply_if_finite(optax.adam(1e-3), 3)`": _Step("stacked", optax.apply_if_finite(optax.adam(1e-3), 3)),
    "stacked LM, 3 layers, remat, `scan(unroll=2)`": _Step("stacked", layers=3, remat=True, unroll=2),
    "Equinox, `eqx.filter_vmap`-made layers under `lax.scan` (partition / combine), adamw": _eqx_scan,
    "Flax NNX, `nnx.vmap`-made layers under `nnx.scan` + `nnx.remat`, stateful `nnx.Optimizer` step": _nnx_scan,
    # stop 37's probes (docs/inference.md section 6, "Stop 37 probes")
    "Mamba, selective scan by `lax.associative_scan`, depthwise conv, inner channels over `tp`, clip + adamw":
        _Step("mamba"),
    "Mamba-2, chunked SSD (`cumsum` segment sums, 4-operand einsums), heads over `tp`": _Step("mamba2"),
    "DeepSeek-V2 latent attention (low-rank KV, latent RMSNorm, shared decoupled RoPE key), heads over `tp`":
        _Step("mla"),
    "RWKV-4, token shift + WKV recurrence under `lax.scan` over time, channels over `tp`": _Step("rwkv"),
    "Gemma-3 class: qk-norm, local / global layers, sandwich norms": _Step("gemma3"),
    "Megatron MLP, `optax.contrib.muon`": _Step("mlp", optax.contrib.muon(1e-3)),
    "Megatron MLP, Shampoo by `jnp.linalg.eigh` (replicated statistics)": _Step("mlp", shampoo.shampoo(1e-3)),
    "Megatron MLP, Shampoo by `jnp.linalg.eigh` (64 x 64 statistics split by rows over `tp`)": _split_shampoo,
    "LoRA on Llama (lorax's `LoraWeight` on wq / wv, the base frozen by `optax.multi_transform` + `set_to_zero`)":
        _Step("lora"),
    "CLIP-style contrastive step: conv-patch ViT and causal text towers, the whole batch's logits": _Step("clip"),
    "the same, patches by `reshape` / `transpose` and a dense layer": _Step("clip", patches="reshape"),
    "DPO on Llama: policy and `stop_gradient` reference, chosen / rejected concatenated, masked log-probs":
        _Step("dpo"),
    # stop 44's probes
    "Llama, FSDP x TP: parameters and Adam moments `fully_shard`-ed over `dp` on the Megatron plan":
        _fully_sharded("llama"),
    "GPT-2, FSDP x TP (its layers under `lax.scan`)": _fully_sharded("gpt2"),
    # stop 53
    "Llama class written for explicit sharding (`out_sharding=`), in `jax.set_mesh`, clip + adamw": _explicit_lm,
}


def _bytes(nbytes: float) -> str:
    return f"{nbytes:,.0f}" if nbytes == int(nbytes) else f"{nbytes:,.1f}"


# quick mode (the suite's smoke test): one small row
_QUICK = "stacked LM, 2 microbatches under `lax.fori_loop`, `optax.lion`"
HEADERS = ("program", "predicted B", "XLA B", "ratio", "collectives predicted / XLA (XLA's operands)",
           "pinned B (collectives)", "outputs agree", "pod time / XLA's")
# a pod's alpha-beta model (docs/inference.md section 4: 5 us and 50 GB/s, 250 KB per collective): the time of a
# plan's communication, each collective after XLA's combiner its latency plus its bytes
POD_LATENCY_US, POD_BYTES_PER_US = 5.0, 50e3


def pod_time(collectives: int, nbytes: float) -> float:
    """Microseconds of communication on the pod model: latency per collective plus bytes."""
    return collectives * POD_LATENCY_US + nbytes / POD_BYTES_PER_US


class Row:
    """One program's figures: check's prediction against XLA's compiled program, and what
    ``apply(execute="pinned")`` compiles under ``jax.jit``."""

    def __init__(
        self, name: str, mesh: DeviceMesh, cost_model: CostModel | None = None,
        build: Callable[[DeviceMesh], Program] | None = None, pinned: bool = True,
    ) -> None:
        """``cost_model``: the default model of check and apply while measuring (None: the
        library's default); ``build``: the program (None: ``PROGRAMS[name]``); ``pinned``:
        also compile ``apply(execute="pinned")``."""
        with use_cost_model(cost_model or default_cost_model()):
            self._measure(name, mesh, build or PROGRAMS[name], pinned)

    def _measure(self, name: str, mesh: DeviceMesh, build: Callable[[DeviceMesh], Program], pinned: bool) -> None:
        # a program written for explicit sharding is measured inside jax.set_mesh of its mesh, as its jax.jit runs
        with jax.set_mesh(mesh.to_jax()) if getattr(build, "in_set_mesh", False) else contextlib.nullcontext():
            fn, args, out_layouts = build(mesh)
            report = check(fn, *args, out_layouts=out_layouts)
            self.name = name
            self.agree = all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
            self.predicted, self.compiled = float(report.predicted_bytes), float(report.compiled_bytes)
            self.collectives = len(report.predicted_combined)
            self.compiled_collectives = len(report.compiled_collectives)
            self.operands = sum(report.compiled_operand_counts.values())
            # XLA sends more legitimately (CPU's all-reduce for a reduce-scatter) where check says so per collective
            self.explained = common.below_floor(report)
            self.pod_ratio = (pod_time(self.collectives, self.predicted)
                              / pod_time(self.compiled_collectives, self.compiled))
            if not pinned:
                return
            # the parameters returned too: a stateful step's updated Variables are its arguments' (nnx)
            pinned = eqx.filter_jit(lambda *a: (apply(fn, *a, out_layouts=out_layouts, execute="pinned"), a[:2]))
            self.pinned_collectives, self.pinned = common.communication(
                parse_collectives(pinned.lower(*args).compile().compiled.as_text()))
            # pinned's bytes are check's (bfloat16 at the float32 bytes CPU XLA sends, a reduce-scatter as its
            # all-reduce)
            self.realized = self.predicted < self.compiled and self.pinned <= 1.1 * self.predicted

    @property
    def bytes_verdict(self) -> str:
        """Blank within 0.9-1.1x of XLA's bytes, else why the ratio is allowed (or MISS)."""
        if 0.9 <= self.predicted / self.compiled <= 1.1:
            return ""
        return " (explained)" if self.explained else " (realized)" if self.realized else " (MISS)"

    def cells(self) -> tuple[str, ...]:
        return (
            self.name, _bytes(self.predicted), _bytes(self.compiled), f"{self.predicted / self.compiled:.2f}",
            f"{self.collectives} / {self.compiled_collectives} ({self.operands})",
            f"{_bytes(self.pinned)} ({self.pinned_collectives})", "yes" if self.agree else "NO",
            f"{self.pod_ratio:.2f}",
        )


def overhead_model(spec: str) -> CostModel:
    """The cost model of a command line's overhead: ``"3072"`` (bytes per collective) or
    ``"unmerged=3072"`` (per all-gather and all-to-all, the kinds CPU XLA's combiner never
    merges; the others at the default)."""
    kinds, _, figure = spec.rpartition("=")
    if kinds not in ("", "unmerged"):
        raise SystemExit(f"overhead {spec!r}: expected bytes (3072) or unmerged=bytes (unmerged=3072)")
    return CostModel(collective_overhead={"all-gather": float(figure), "all-to-all": float(figure)} if kinds
                     else float(figure))


# The second table's model: every collective the search's own overhead (cost.SEARCH_OVERHEAD), the default until
# stop 38; the default since is latency-bound (cost.DEFAULT_COLLECTIVE_OVERHEAD)
UNIFORM = str(SEARCH_OVERHEAD)
UNIFORM_TEXT = f"{SEARCH_OVERHEAD} B per collective of every kind (the default until stop 38)"


def run(config: Config) -> Section:
    section = Section("real_programs", "14. Real training programs: predicted vs compiled", __doc__.split("\n\n")[1])
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    names = (_QUICK,) if config.quick else tuple(PROGRAMS)
    rows = []
    for name in names:
        progress(f"  real program: {name}")
        rows.append(Row(name, mesh))
    section.tables.append(Table(
        "check on whole training steps of tests/models (dp=2 x tp=4; bytes per device; collectives after XLA's "
        "combiner)", HEADERS, tuple(row.cells() for row in rows),
    ))
    model = overhead_model(UNIFORM)
    counted = []
    for name in names:
        progress(f"  real program, {UNIFORM}: {name}")
        counted.append(Row(name, mesh, model))
    fewer = sum(row.agree and row.collectives <= row.compiled_collectives and row.predicted <= 1.1 * row.compiled
                for row in counted)
    section.tables.append(Table(
        f"the same under {UNIFORM_TEXT}: outputs agree, no more collectives than XLA and at most 1.1x its bytes on "
        f"{fewer} of {len(counted)} programs", HEADERS, tuple(row.cells() for row in counted),
    ))
    if not config.quick:
        section.tables.append(_wide_table(mesh, model))
    section.targets.append(Target(
        "every output's predicted layout agrees with XLA's compiled one (or XLA reduced a partial)",
        f"{sum(row.agree for row in rows)} of {len(rows)} programs", "all", all(row.agree for row in rows),
    ))
    section.targets.append(Target(
        "predicted bytes within 0.9-1.1x of XLA's; below, only where XLA legitimately sends more (check says so per "
        "collective) or the predicted plan is realized: apply(execute=\"pinned\") compiles within 1.1x of it",
        "; ".join(f"{row.predicted / row.compiled:.2f}{row.bytes_verdict}" for row in rows),
        "0.9-1.1x, or below and explained or realized", all(row.bytes_verdict != " (MISS)" for row in rows),
    ))
    # beside each count target, the same of the plan as XLA compiles it pinned (where the combiner model and XLA's
    # combiner group the plan's collectives differently, docs/inference.md section 6)
    pinned = sum(row.pinned_collectives <= row.compiled_collectives for row in rows)
    section.targets.append(Target(
        "never more collectives than XLA (the prediction counted as XLA's combiner merges it)",
        f"{sum(row.collectives <= row.compiled_collectives for row in rows)} of {len(rows)} programs (the plan as "
        f"apply(execute=\"pinned\") compiles it: {pinned}); "
        + "; ".join(f"{row.collectives} / {row.compiled_collectives}" for row in rows),
        "all", all(row.collectives <= row.compiled_collectives for row in rows),
    ))
    return section


def _wide_table(mesh: DeviceMesh, model: CostModel) -> Table:
    """The programs of tests/models at their realistic width (:data:`_WIDE`), predicted
    by default and under 192 B per collective against XLA's compiled program."""
    rows = []
    for name, build in PROGRAMS.items():
        if not isinstance(build, _Step) or build.model not in _WIDE:
            continue
        progress(f"  real program, realistic width: {name}")
        wide = build.wide()
        default, counted = Row(name, mesh, build=wide, pinned=False), Row(name, mesh, model, wide, pinned=False)
        rows.append((
            name, "d_model {dim}, seq {seq}, vocab {vocab:,}".format(**_WIDE[build.model]),
            _bytes(default.compiled), f"{default.predicted / default.compiled:.2f}",
            f"{counted.predicted / counted.compiled:.2f}",
            f"{default.collectives} / {counted.collectives} / {default.compiled_collectives}",
            f"{default.pod_ratio:.2f}", f"{counted.pod_ratio:.2f}",
            "yes" if default.agree and counted.agree else "NO",
        ))
    return Table(
        "at a realistic width: the programs of tests/models with d_model 512 (the MoE's 256), sequence 256 and "
        f"vocabulary 4,096 (dp=2 x tp=4), predicted by default (latency-bound) and under {UNIFORM_TEXT}; "
        "bytes per device; collectives after XLA's combiner; pod time: 5 us per collective plus bytes at 50 GB/s, "
        "against XLA's program's",
        ("program", "width", "XLA B", "predicted / XLA B, default", "predicted / XLA B, 192 B",
         "collectives default / 192 B / XLA", "pod time / XLA's, default", "pod time / XLA's, 192 B",
         "outputs agree"),
        tuple(rows),
    )


def main(selected: str = "", overhead: str = "") -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    model = overhead_model(overhead) if overhead else None
    print("| " + " | ".join(HEADERS) + " |")
    print("|" + "|".join("---" for _ in HEADERS) + "|")
    for name in PROGRAMS:
        if selected in name:
            print("| " + " | ".join(Row(name, mesh, model).cells()) + " |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
