"""6. DTensor operators: eager overhead vs jax.numpy on plain arrays, and under jax.jit
the compiled HLO of a DTensor function vs the plain JAX one."""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from catalogue import mesh_of
from harness import Config, Section, Table, Target, compare, microseconds, paired, progress, time_each
from jax.sharding import AxisType, NamedSharding

from placements2jax import DTensor, Replicate, Shard, apply, distribute_tensor, init_device_mesh
from placements2jax.hlo import compiled_collectives, parse_collectives

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import common  # noqa: E402  (the test models, written as public model code)
from models.steps import training_step  # noqa: E402

MESH = (4, 2)
SIZES = {"small": 64, "medium": 512}


def operators_available() -> str | None:
    """None when DTensor operators exist (placements2jax.operators), else why not."""
    try:
        from placements2jax import apply  # noqa: F401
    except ImportError as error:
        return f"placements2jax.apply is not available ({error})"
    if not hasattr(DTensor, "__add__") or not hasattr(DTensor, "sum"):
        return "DTensor has no operators yet"
    return None


def _eager_cases(n: int) -> list[tuple[str, Callable[..., Any], Callable[..., Any], tuple[tuple[tuple[int, ...], str], ...]]]:
    """(name, DTensor function, plain function, operand shapes and placements)."""
    return [
        ("x + y", lambda x, y: x + y, lambda a, b: a + b, (((n, n), "S(0),S(1)"), ((n, n), "S(0),S(1)"))),
        ("x * 2.0", lambda x: x * 2.0, lambda a: a * 2.0, (((n, n), "S(0),S(1)"),)),
        ("x @ w", lambda x, w: x @ w, lambda a, b: a @ b, (((n, n), "S(0),R"), ((n, n), "R,S(1)"))),
        ("x.sum(axis=1)", lambda x: x.sum(axis=1), lambda a: jnp.sum(a, axis=1), (((n, n), "S(0),R"),)),
        ("x.T", lambda x: x.T, lambda a: a.T, (((n, n), "S(0),S(1)"),)),
    ]


def _operands(
    specs: tuple[tuple[tuple[int, ...], str], ...], seed: int
) -> tuple[list[DTensor], list[jax.Array], list[np.ndarray]]:
    """DTensors, their sharded jax.Arrays (``to_jax``) and the host values."""
    mesh = mesh_of(MESH)
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(shape).astype(np.float32) for shape, _ in specs]
    dtensors = [distribute_tensor(v, mesh, text) for v, (_, text) in zip(values, specs)]
    return dtensors, [d.to_jax() for d in dtensors], values


def _measure_eager(size: str, case: Any, config: Config) -> tuple[str, ...]:
    name, ours_fn, plain_fn, specs = case
    n = SIZES[size]
    dtensors, arrays, values = _operands(specs, n)
    result = ours_fn(*dtensors)
    np.testing.assert_allclose(np.asarray(result.full_tensor()), plain_fn(*values), rtol=1e-4, atol=1e-3)

    def ours() -> Any:
        return jax.block_until_ready(ours_fn(*dtensors).array)

    def plain() -> Any:
        return jax.block_until_ready(plain_fn(*arrays))

    c = compare(ours, plain, config)
    return (
        size,
        f"{n}x{n}",
        name,
        ", ".join(text for _, text in specs) + f" -> {result.layout}",
        microseconds(c.ours_median),
        microseconds(c.baseline_median),
        microseconds(c.ours_median - c.baseline_median),
        c.ratio_text(),
    )


def _eager(config: Config, section: Section) -> None:
    rows = []
    for size in ("small",) if config.quick else ("small", "medium"):
        for case in _eager_cases(SIZES[size]):
            progress(f"  operators eager {size} {case[0]}")
            rows.append(_measure_eager(size, case, config))
    differences = [float(row[6]) for row in rows]
    section.notes.append(
        f"Eager, a DTensor operator's median time minus the jax.numpy op's ranges from {min(differences):.0f} to "
        f"{max(differences):.0f} µs per call: the operator's dispatch (a "
        "front-cache lookup keyed by the operands' layout objects, then one cached jitted program per call) "
        "against jax.numpy's own dispatch. There is no target for it; under jax.jit the dispatch disappears "
        "(the table below)."
    )
    section.tables.append(
        Table(
            "Eager: DTensor operator vs the jax.numpy op on the same sharded jax.Arrays (mesh (4,2), float32)",
            ("size", "shape", "op", "placements -> result", "DTensor (µs)", "jax.numpy (µs)", "difference (µs)",
             "ratio"),
            tuple(rows),
        )
    )


# -- jit: the compiled programs --------------------------------------------------------


def normalized_hlo(text: str) -> list[str]:
    """The compiled HLO module's computations with names, metadata and source locations
    removed (identifiers renumbered in order of appearance), one instruction per line."""
    lines = [line.strip() for line in text.splitlines()]
    body = "\n".join(line for line in lines if line.startswith(("%", "ROOT ", "ENTRY ", "}")))
    body = re.sub(r",?\s*metadata=\{[^}]*\}", "", body)
    body = re.sub(r",?\s*frontend_attributes=\{[^}]*\}", "", body)
    body = re.sub(r",\s*channel_id=\d+", "", body)  # numbered in emission order
    body = re.sub(r"[\w.\-]+: (?=\w+\[|\()", "", body)  # parameter names in computation headers
    names: dict[str, str] = {}

    def rename(match: re.Match[str]) -> str:
        return names.setdefault(match.group(0), f"%v{len(names)}")

    return [_explicit_groups(line) for line in re.sub(r"%[\w.\-]+", rename, body).splitlines()]


_REPLICA_GROUPS = re.compile(
    r"replica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))?\s*\{[^}]*\}"
    r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{(?:\{[\d,]*\},?)*\})"
)


def _explicit_groups(line: str) -> str:
    """Replica groups in one notation (XLA prints the same groups as lists, iota or mesh
    axes depending on how the program was built)."""
    collectives = parse_collectives(line) if "replica_groups=" in line else []
    if len(collectives) != 1:
        return line
    groups = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in sorted(collectives[0].groups)) + "}"
    return _REPLICA_GROUPS.sub(lambda _: f"replica_groups={groups}", line)


def _jit_cases(n: int) -> list[tuple[str, Callable[..., Any], Callable[..., Any], tuple[tuple[tuple[int, ...], str], ...]]]:
    """(name, DTensor function, plain function, operands); the DTensor function ends in a
    layout without Partial, which the plain function gets as ``out_shardings``."""
    reduce_rows = (Shard(0), Replicate())

    def mlp(x: Any, w1: Any, w2: Any) -> Any:
        from placements2jax import apply

        return (apply(jax.nn.gelu, x @ w1) @ w2).redistribute(placements=reduce_rows)

    def norm(x: Any, y: Any) -> Any:
        return ((x * y + x) * 0.5).sum(axis=1).redistribute(placements=reduce_rows)

    return [
        ("elementwise: (x * y + x) * 0.5", lambda x, y: (x * y + x) * 0.5, lambda a, b: (a * b + a) * 0.5,
         (((n, n), "S(0),S(1)"), ((n, n), "S(0),S(1)"))),
        ("row sums: ((x * y + x) * 0.5).sum(1), reduced", norm, lambda a, b: jnp.sum((a * b + a) * 0.5, axis=1),
         (((n, n), "S(0),S(1)"), ((n, n), "S(0),S(1)"))),
        ("MLP: gelu(x @ w1) @ w2, reduced", mlp, lambda a, b, c: jax.nn.gelu(a @ b) @ c,
         (((n, n), "S(0),R"), ((n, 2 * n), "R,S(1)"), ((2 * n, n), "R,S(0)"))),
        ("transpose + matmul: x.T @ y", lambda x, y: x.T @ y, lambda a, b: a.T @ b,
         (((n, n), "S(1),R"), ((n, n), "R,S(1)"))),
        ("add needing a redistribution: x + y", lambda x, y: x + y, lambda a, b: a + b,
         (((n, n), "S(0),S(1)"), ((n, n), "S(1),S(0)"))),
        ("matmul needing redistributions: x @ w", lambda x, w: x @ w, lambda a, b: a @ b,
         (((n, n), "S(0),S(1)"), ((n, n), "S(0),R"))),
    ]


def _auto_sharding(array: jax.Array) -> NamedSharding:
    mesh = array.sharding.mesh
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return NamedSharding(auto, array.sharding.spec)


def _jit(config: Config, section: Section) -> None:
    n = SIZES["small"]
    rows = []
    identical = 0
    cases = _jit_cases(n)
    if config.quick:
        cases = cases[::2]
    for name, ours_fn, plain_fn, specs in cases:
        progress(f"  operators jit {name}")
        dtensors, arrays, values = _operands(specs, 7)
        plain_args = [jax.device_put(a, _auto_sharding(a)) for a in arrays]
        eager = ours_fn(*dtensors)
        assert not eager.layout.has_partial, (name, eager.layout)
        out_sharding = NamedSharding(plain_args[0].sharding.mesh, eager.layout.partition_spec)
        ours_text = jax.jit(ours_fn).lower(*dtensors).compile().as_text()
        plain_text = jax.jit(plain_fn, out_shardings=out_sharding).lower(*plain_args).compile().as_text()
        ours_lines, plain_lines = normalized_hlo(ours_text), normalized_hlo(plain_text)
        same = ours_lines == plain_lines
        identical += same
        diff = ""
        if not same:
            changed = [
                line for line in difflib.unified_diff(plain_lines, ours_lines, lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))
            ]
            diff = f"{len(changed)} lines differ, e.g. `{changed[0][:120]}`" if changed else ""
        jitted = np.asarray(jax.jit(ours_fn)(*dtensors).full_tensor())
        np.testing.assert_allclose(jitted, np.asarray(plain_fn(*values)), rtol=1e-4, atol=1e-3)
        rows.append(
            (name, ", ".join(t for _, t in specs) + f" -> {eager.layout}", len(ours_lines), len(plain_lines),
             "identical" if same else "differs", diff)
        )
    section.tables.append(
        Table(
            f"Under jax.jit: optimized HLO of the DTensor function vs the plain JAX function ({n}x{n}, mesh (4,2))",
            ("function", "input placements", "DTensor HLO lines", "plain HLO lines", "verdict", "difference"),
            tuple(rows),
        )
    )
    section.targets.append(
        Target("jitted DTensor functions compile to the plain JAX program", f"{identical} of {len(cases)} identical",
               "all identical", identical == len(cases))
    )


def _steps(config: Config, section: Section) -> None:
    """apply(step, execute="xla") under jax.jit vs plain jax.jit of the step, on the same
    input and output shardings: collectives, bytes per device, step time."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    models = ("mlp",) if config.quick else ("mlp", "gpt2", "llama")
    steps = [training_step(model, mesh) for model in models]
    rows, met = [], True
    for step in steps:
        progress(f"  operators apply({step.name} adamw step)")
        plain_jit, plain_args = step.plain_jit(), step.plain_args()
        ours = jax.jit(lambda *a, step=step: apply(step.fn, *a, out_layouts=step.out_layouts, execute="xla"))
        n_ours, b_ours = common.communication(compiled_collectives(ours, *step.args))
        n_plain, b_plain = common.communication(compiled_collectives(plain_jit, *plain_args))
        loss, expected = float(ours(*step.args)[2].full_tensor()), float(plain_jit(*plain_args)[2])
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
        times = time_each(
            (lambda: jax.block_until_ready(ours(*step.args)), lambda: jax.block_until_ready(plain_jit(*plain_args))),
            config,
        )
        timing = paired(times[0], times[1])
        met = met and n_ours <= n_plain and b_ours <= b_plain and timing.ratio <= 1.1
        per_op = "not compiled (minutes: one program per equation)"
        if step.name == "mlp":  # execute="ops": one shard_map program per equation
            by_ops = jax.jit(lambda *a, step=step: apply(step.fn, *a, out_layouts=step.out_layouts, execute="ops"))
            n_ops, b_ops = common.communication(compiled_collectives(by_ops, *step.args))
            per_op = f"{n_ops} collectives, {b_ops:.0f} B"
        rows.append((f"{step.name} adamw step", f"{n_ours} / {n_plain}", f"{b_ours:.0f} / {b_plain:.0f}",
                     microseconds(timing.ours_median), microseconds(timing.baseline_median), timing.ratio_text(),
                     per_op))
    section.tables.append(
        Table(
            "apply(train_step, execute=\"xla\") under jax.jit vs plain jax.jit (mesh dp=2 x tp=4, Megatron plan, "
            "parameters and optimizer state keep their layouts)",
            ("step", "collectives apply / jit", "bytes per device apply / jit", "apply (µs)", "jit (µs)",
             "time apply / jit", "apply(execute=\"ops\") for comparison"),
            tuple(rows),
        )
    )
    section.targets.append(
        Target("apply of a training step under jax.jit: no more collectives or bytes than jax.jit, time <= 1.1x",
               "; ".join(f"{r[0]}: {r[1]} collectives, {r[2]} B, {r[5]}" for r in rows), "<= jit, 1.1x", met)
    )


def run(config: Config) -> Section:
    section = Section(
        "operators",
        "6. DTensor operators: eager overhead and compiled programs",
        """
**Eager**: a DTensor operator (`+`, `*`, `@`, `.sum`, `.T`: signature inference, cached
program, local op per rank) vs the same `jax.numpy` op on the DTensors' own `jax.Array`s
(`to_jax()`: the same sharded data on the Explicit mesh, so JAX's sharding-in-types rules
place the result). Both blocked on; results checked equal first. **jit**: the DTensor
function under `jax.jit` (inputs DTensors) and the plain function under `jax.jit` on the
same shardings (Auto axes, `out_shardings` = the DTensor result's), both compiled by XLA;
the optimized HLO texts are compared with names, metadata and source locations removed
(identifiers renumbered in order of appearance). **Training steps**: a whole optax
adamw step of the test models (tests/models: GPT-2 scanning over its blocks, Llama) laid
out with the Megatron plan, run by `apply(step, ..., out_layouts=(params, state, None))`
(`execute="xla"`, what the default `"auto"` picks for them) under `jax.jit` against plain `jax.jit(step, out_shardings=...)` on the
same shardings (Auto axes): compiled collectives, bytes per device, paired step times
(quick mode: a Megatron MLP's adamw step only).
""",
    )
    missing = operators_available()
    if missing:
        section.notes.append(f"Not available: {missing}. This benchmark runs once they exist.")
        section.targets.append(Target("jitted DTensor functions compile to the plain JAX program", missing,
                                      "all identical", None))
        return section
    _eager(config, section)
    _jit(config, section)
    _steps(config, section)
    return section
