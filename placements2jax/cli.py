"""The command line: ``placements2jax <command>`` (also ``python -m placements2jax``).

Commands: ``explain`` (a layout's tensor_map, PartitionSpec, per-rank blocks and
picture), ``redistribute`` (the planned steps of a move, their collectives and costs,
and the collectives XLA compiled), ``plan`` (auto_plan of a training step given as
``module:function``), ``train`` (the main job of ``make demo``: a GPT-style LM trained sharded) and
``demo`` (the layout demo: a tensor-parallel MLP step by step). Bad arguments print one line on stderr and
exit with code 2. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from .autoplan import SCORES
from .dtensor import distribute_tensor, redistribute_collectives
from .errors import MeshError, PlacementError, Placements2JaxError, PlanError, RedistributeError, ShapeError
from .hlo import Collective
from .physical import physical
from .schedules import choose, default_policy
from .inference import CostModel, plan_redistribute
from .inference.check import collective_nbytes
from .inference.cost import COMMUNICATING
from .inference.table import format_table
from .layout import Layout, resolve_layout
from .mesh import DeviceMesh, init_device_mesh
from .placements import StridedShard, format_alias, format_placements
from .placements import parse_partial as parse_partial_text
from .version import __version__
from .visualize import visualize

__all__ = [
    "build_parser",
    "differences",
    "explain",
    "auto_plan_text",
    "main",
    "parse_axis_weights",
    "parse_dtype",
    "parse_mesh",
    "parse_partial",
    "parse_shape",
    "redistribute",
]

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def parse_mesh(text: str) -> tuple[tuple[str, ...] | None, tuple[int, ...]]:
    """``"dp=4,tp=2"`` -> (("dp", "tp"), (4, 2)); ``"4,2"`` -> (None, (4, 2))."""
    entries = [e.strip() for e in text.split(",")]
    named = [re.fullmatch(r"([A-Za-z_][\w.\-]*)\s*=\s*(\d+)", e) for e in entries]
    if all(named):
        return tuple(m.group(1) for m in named), tuple(int(m.group(2)) for m in named)  # type: ignore[union-attr]
    if all(re.fullmatch(r"\d+", e) for e in entries):
        return None, tuple(int(e) for e in entries)
    raise argparse.ArgumentTypeError(
        f"--mesh {text!r}: not name=size pairs. Fix: write e.g. dp=4,tp=2 (or sizes only: 4,2)"
    )


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,2"`` -> (8, 2)."""
    entries = [e.strip() for e in text.split(",")]
    if not all(re.fullmatch(r"\d+", e) for e in entries):
        raise argparse.ArgumentTypeError(f"--shape {text!r}: not non-negative sizes. Fix: write e.g. 8,2")
    return tuple(int(e) for e in entries)


def parse_partial(text: str) -> dict[str, str]:
    """``"tp"`` or ``"tp=max,cp=max"`` -> {axis: reduce op} (op defaults to sum; the
    syntax of :func:`placements2jax.placements.parse_partial`)."""
    try:
        return dict(parse_partial_text(text))
    except PlacementError as error:
        raise argparse.ArgumentTypeError(f"--partial {text!r}: {error.problem}. Fix: {error.fix}") from None


def parse_dtype(text: str) -> np.dtype:
    """``"float32"``, ``"bfloat16"``, ``"int8"`` ... -> the NumPy (or ml_dtypes) dtype, one
    JAX arrays can hold (not e.g. float128 or str)."""
    try:
        dtype = np.dtype(jnp.dtype(text))
        with warnings.catch_warnings():  # 64-bit types without jax_enable_x64 are JAX's to narrow, not an error
            warnings.simplefilter("ignore")
            jax.eval_shape(lambda: jnp.zeros((), dtype))  # abstract: JAX's backend does not start
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"--dtype {text!r}: not a dtype JAX arrays can hold. Fix: write e.g. float32, bfloat16 or int8"
        ) from None
    return dtype


def parse_axis_weights(text: str) -> dict[str, float]:
    """``"dp=4,tp=1"`` -> {"dp": 4.0, "tp": 1.0} (a :class:`CostModel`'s axis weights)."""
    entries = [re.fullmatch(r"\s*([A-Za-z_][\w.\-]*)\s*=\s*(\d+(?:\.\d*)?|\.\d+)\s*", e) for e in text.split(",")]
    if not all(entries) or any(float(m.group(2)) <= 0 for m in entries):  # type: ignore[union-attr]
        raise argparse.ArgumentTypeError(
            f"--axis-weights {text!r}: not axis=weight pairs with weights > 0. Fix: write e.g. dp=4"
        )
    return {m.group(1): float(m.group(2)) for m in entries}  # type: ignore[union-attr]


def _positive_int(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: write a positive integer, e.g. 6")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="placements2jax", description="PyTorch-DTensor-style placements on JAX shardings.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_explain(commands)
    _add_redistribute(commands)
    _add_plan(commands)
    demo_parser = commands.add_parser(
        "demo",
        help="the layout demo: placements table, then a tensor-parallel MLP with DTensor operators",
        description="A placements table, then a tensor-parallel MLP trained on a (dp, tp) mesh of all devices "
        "(8 simulated CPU devices without accelerators): losses vs plain JAX, predicted vs compiled layouts, "
        "collectives per step. See docs/training.md.",
    )
    commands.add_parser(
        "train",
        help="the main job (make demo): a GPT-style LM born sharded, trained, checkpointed, resumed on another mesh",
        description="A real training run (placements2jax.train_demo): tensor parallel, then FSDP-style after a "
        "checkpoint reloaded onto another mesh, every loss compared with unsharded training, collectives per step "
        "predicted vs compiled. See docs/training.md.",
    )
    demo_parser.add_argument("--steps", type=_positive_int, default=None, help="training steps (default 6)")
    return parser


def _add_mesh_and_shape(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--mesh", required=required, type=parse_mesh, help="mesh axes as name=size, e.g. dp=4,tp=2")
    parser.add_argument("--shape", required=required, type=parse_shape, help="the logical tensor shape, e.g. 8,2")


def _add_explain(commands: Any) -> None:
    explain_parser = commands.add_parser(
        "explain",
        help="a layout's tensor_map, PartitionSpec, per-rank blocks and picture",
        description="Explain how a tensor lies on a mesh under torch-form or alias-form placements.",
        epilog="examples:\n"
        '  placements2jax explain --mesh dp=4,tp=2 --shape 8,2 --placements "S(0),R"\n'
        '  placements2jax explain --mesh dp=4,tp=2 --shape 10,3 --placements "(tp,dp),None" --json\n'
        '  placements2jax explain --mesh dp=2,tp=4 --shape 8 --placements "tp" --partial dp=max\n'
        "  placements2jax explain --checkpoint ckpt/   (each saved leaf's shape, dtype, mesh and placements)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_mesh_and_shape(explain_parser, required=False)
    explain_parser.add_argument(
        "--checkpoint", help="a checkpoint directory written by placements2jax.save: list its leaves' layouts"
    )
    explain_parser.add_argument("--step", type=int, default=None, help="with --checkpoint: the step (default: latest)")
    explain_parser.add_argument(
        "--placements",
        help='torch form, one per mesh dim ("S(0),R", "P(max),S(1)") or alias form, one per tensor dim '
        '("(dp,tp),None", "tp,dp")',
    )
    explain_parser.add_argument(
        "--partial", type=parse_partial, help="alias form only: partial mesh axes, e.g. tp or tp=max"
    )
    explain_parser.add_argument("--json", action="store_true", help="machine-readable output")
    colors = explain_parser.add_mutually_exclusive_group()
    colors.add_argument("--color", dest="color", action="store_true", default=None, help="colour the picture")
    colors.add_argument("--no-color", dest="color", action="store_false", help="plain picture")


def _add_redistribute(commands: Any) -> None:
    parser = commands.add_parser(
        "redistribute",
        help="a move between two layouts: planned steps, their collectives and costs, and what XLA compiled",
        description="Plan the move of a tensor from one layout to another on a mesh (one mesh dim per step, "
        "cheapest under the cost model) and compile it: the planned steps with their collectives, bytes and "
        "costs, then the collectives XLA compiled for DTensor.redistribute.",
        epilog="examples:\n"
        '  placements2jax redistribute --mesh dp=4,tp=2 --shape 8,2 --from "S(0),R" --to "R,S(0)"\n'
        '  placements2jax redistribute --mesh dp=2,tp=4 --shape 10,3 --from "P,S(0)" --to "S(1),R" --json\n'
        '  placements2jax redistribute --mesh dp=4,tp=2 --shape 16 --from "(dp,tp)" --to "(tp,dp)"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_mesh_and_shape(parser)
    for side in ("from", "to"):
        parser.add_argument(
            f"--{side}",
            dest=f"{side}_placements",
            required=True,
            help=f'the {"source" if side == "from" else "target"} placements: torch form ("S(0),R", "P,S(1)") or '
            'alias form ("(dp,tp),None")',
        )
        parser.add_argument(
            f"--{side}-partial",
            type=parse_partial,
            help=f"alias form only: partial mesh axes of the {side} layout, e.g. tp or tp=max",
        )
    parser.add_argument("--dtype", type=parse_dtype, default=np.dtype(np.float32), help="element type (float32)")
    parser.add_argument(
        "--axis-weights",
        type=parse_axis_weights,
        help="cost per byte on each mesh axis (default 1), e.g. dp=4 for a slower cross-host dp axis",
    )
    parser.add_argument(
        "--policy",
        choices=("cost", "min_bytes", "xla"),
        default=None,
        help="how redistribute chooses its collective schedule (default: cost, calibrated on this backend)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_plan(commands: Any) -> None:
    parser = commands.add_parser(
        "plan",
        help="search the placements of a training step's parameters (auto_plan)",
        description="auto_plan of a training step: MODEL is module:function, a function of no arguments "
        "returning (step_fn, params, *args) (arrays or jax.ShapeDtypeStructs). Prints the chosen plan (path -> "
        "placements) and its predicted bytes per step and memory per device beside FSDP's and the presets'. "
        "See docs/autoplan.md.",
        epilog="examples:\n"
        "  placements2jax plan placements2jax.autoplan:example_mlp --mesh dp=2,tp=4 --fixed args/1=S(0),R "
        "--fixed args/2=S(0),R\n"
        "  placements2jax plan mymodel:problem --mesh dp=2,tp=4 --memory-budget 2000000 "
        "--preset megatron=mymodel:megatron_plan --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", type=parse_target, help="module:function returning (step_fn, params, *args)")
    parser.add_argument("--mesh", required=True, type=parse_mesh, help="mesh axes as name=size, e.g. dp=2,tp=4")
    parser.add_argument("--memory-budget", type=_positive_int, default=None, help="bytes per device (default: none)")
    parser.add_argument(
        "--fixed", type=parse_pinned, action="append", default=None,
        help="pin a leaf: PATH=PLACEMENTS, e.g. args/1=S(0),R (repeatable)",
    )
    parser.add_argument(
        "--preset", type=parse_preset, action="append", default=None,
        help="a plan to compare with and start from: NAME=module:function returning the plan (repeatable)",
    )
    parser.add_argument("--max-evaluations", type=_positive_int, default=24, help="predictions at most (24)")
    parser.add_argument(
        "--score", choices=SCORES, default="xla",
        help="the executor that will run the plan: xla (plain jax.jit, default) or pinned (apply(..., "
             "execute='pinned')): compile the best plans and the presets for it, keep the fewest compiled bytes; "
             "predict: prediction only",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def parse_target(text: str) -> str:
    """``"package.module:function"``, checked for its form (imported when the command runs)."""
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", text):
        raise argparse.ArgumentTypeError(
            f"model {text!r}: not module:function. Fix: write e.g. placements2jax.autoplan:example_mlp"
        )
    return text


def parse_pinned(text: str) -> tuple[str, str]:
    """``"args/1=S(0),R"`` -> ("args/1", "S(0),R")."""
    path, sep, placements = text.partition("=")
    if not sep or not path.strip() or not placements.strip():
        raise argparse.ArgumentTypeError(f"--fixed {text!r}: not PATH=PLACEMENTS. Fix: write e.g. args/1=S(0),R")
    return path.strip(), placements.strip()


def parse_preset(text: str) -> tuple[str, str]:
    """``"megatron=mymodel:megatron_plan"`` -> ("megatron", "mymodel:megatron_plan")."""
    name, sep, target = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(
            f"--preset {text!r}: not NAME=module:function. Fix: write e.g. megatron=mymodel:megatron_plan"
        )
    return name.strip(), parse_target(target.strip())


def _load_target(text: str, argument: str) -> Any:
    import importlib

    module_name, _, attribute = text.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise PlanError(argument, text, f"cannot import {module_name!r} ({error})",
                        "put the module on PYTHONPATH, or run from its directory") from None
    target = getattr(module, attribute, None)
    if not callable(target):
        raise PlanError(argument, text, f"module {module_name!r} has no function {attribute!r}",
                        f"name a function of {module_name} returning what the command needs")
    return target


def auto_plan_text(
    model: str, mesh: DeviceMesh, *, memory_budget: int | None = None, fixed: Sequence[tuple[str, str]] | None = None,
    presets: Sequence[tuple[str, str]] | None = None, max_evaluations: int = 24, as_json: bool = False,
    score: str = "xla",
) -> str:
    """``placements2jax plan``: :func:`~placements2jax.auto_plan` of the step ``model``
    (``module:function`` returning ``(step_fn, params, *args)``) on ``mesh``."""
    from .autoplan import auto_plan

    problem = _load_target(model, "model")()
    if not isinstance(problem, (tuple, list)) or len(problem) < 2 or not callable(problem[0]):
        raise PlanError("model", model, "its function must return (step_fn, params, *args)",
                        "return e.g. (train_step, params, opt_state, tokens, targets)")
    plans = {name: _load_target(target, f"--preset {name}")() for name, target in presets or ()}
    chosen = auto_plan(problem[0], *problem[1:], mesh=mesh, memory_budget=memory_budget,
                       fixed=dict(fixed) if fixed else None, presets=plans, max_evaluations=max_evaluations,
                       score=score)
    if not as_json:
        return str(chosen)
    figures = {"auto": chosen.figures, **chosen.presets}
    return _json({
        "mesh": _mesh_summary(mesh),
        "plan": chosen.torch_form(),
        "args": {k: str(v) for k, v in chosen.args.items()},
        "fixed": list(chosen.fixed),
        "memory_budget": chosen.memory_budget,
        "memory": chosen.memory,  # checked against the budget: the larger of the estimate and XLA's
        "memory_source": chosen.memory_source,
        "evaluations": chosen.evaluations,
        "figures": {name: {**dataclasses.asdict(f), "memory": f.memory} for name, f in figures.items()},
        "score": chosen.score,
        "compiled": {name: dataclasses.asdict(c) for name, c in chosen.compiled.items()},
    })


def _start_mesh(
    mesh: tuple[tuple[str, ...] | None, tuple[int, ...]], start_jax: Callable[[int], None] | None
) -> DeviceMesh:
    """The ``--mesh`` argument's mesh, after ``start_jax`` (enough simulated devices for it)."""
    names, sizes = mesh
    if start_jax is not None:
        start_jax(max(8, math.prod(sizes)))
    try:
        return init_device_mesh(sizes, names)
    except MeshError as error:  # named as the user wrote it, not as init_device_mesh's arguments
        written = ",".join(f"{n}={s}" for n, s in zip(names, sizes)) if names else ",".join(map(str, sizes))
        raise error.for_argument("--mesh", written) from None


def main(argv: Sequence[str] | None = None, *, start_jax: Callable[[int], None] | None = None) -> int:
    """Run a command; returns the exit code. ``start_jax(device_count)`` runs after the
    arguments are parsed and before JAX starts (``__main__`` simulates CPU devices)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "explain" and args.checkpoint is not None:
            print(explain_checkpoint(args.checkpoint, step=args.step, as_json=args.json))
        elif args.command == "explain":
            missing = [f"--{n}" for n in ("mesh", "shape", "placements") if getattr(args, n) is None]
            if missing:
                parser.error(f"the following arguments are required: {', '.join(missing)} (or --checkpoint PATH)")
            print(
                explain(
                    _start_mesh(args.mesh, start_jax),
                    args.shape,
                    args.placements,
                    partial=args.partial,
                    as_json=args.json,
                    color=args.color,
                )
            )
        elif args.command == "redistribute":
            print(
                redistribute(
                    _start_mesh(args.mesh, start_jax),
                    args.shape,
                    args.from_placements,
                    args.to_placements,
                    dtype=args.dtype,
                    from_partial=args.from_partial,
                    to_partial=args.to_partial,
                    axis_weights=args.axis_weights,
                    policy=args.policy,
                    as_json=args.json,
                )
            )
        elif args.command == "plan":
            mesh = _start_mesh(args.mesh, start_jax)
            print(auto_plan_text(args.model, mesh, memory_budget=args.memory_budget, fixed=args.fixed,
                                 presets=args.preset, max_evaluations=args.max_evaluations, as_json=args.json,
                                 score=args.score))
        elif args.command == "train":
            if start_jax is not None:
                start_jax(8)
            from .train_demo import main as train_main

            train_main()
        elif args.command == "demo":
            if start_jax is not None:
                start_jax(8)
            from .demo import main as demo_main

            demo_main(steps=args.steps)
    except Placements2JaxError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def explain_checkpoint(path: str, *, step: int | None = None, as_json: bool = False) -> str:
    """Each leaf of a checkpoint (placements2jax.save): shape, dtype, the mesh it was
    saved from and its placements (torch form, else the alias form)."""
    from .checkpoint import read_metadata

    metadata = read_metadata(path, step)
    if as_json:
        return _json(metadata)
    rows = []
    for name, record in sorted(metadata["leaves"].items()):
        if record["kind"] == "dtensor":
            mesh = record["mesh"]
            ranks = np.array(mesh["ranks"]).reshape(mesh["shape"])
            mesh_text = str(DeviceMesh(ranks, mesh_dim_names=tuple(mesh["axis_names"])))
            if mesh["ranks"] != list(range(len(mesh["ranks"]))):
                mesh_text += f" ranks {mesh['ranks']}"
            rows.append((name, str(tuple(record["shape"])), record["dtype"], mesh_text,
                         record["placements"] or "-", record["layout"]))  # "-": written before StridedShard
        elif record["kind"] == "array":
            rows.append((name, str(tuple(record["shape"])), record["dtype"], "-", "(array)", "-"))
        elif record["kind"] == "keys":
            rows.append((name, str(tuple(record["shape"])), record["dtype"], "-", f"(PRNG keys, {record['impl']})", "-"))
        else:
            rows.append((name, "()", record["type"], "-", f"(number {record['value']})", "-"))
    headers = ("leaf", "shape", "dtype", "mesh", "placements", "layout")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [f"checkpoint {path} step {metadata['step']}: {len(rows)} leaves"]
    lines.append(" | ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def explain(
    mesh: DeviceMesh,
    shape: Sequence[int],
    placements: Any,
    *,
    partial: dict[str, str] | None = None,
    as_json: bool = False,
    color: bool | None = None,
) -> str:
    """The ``explain`` report of ``placements`` (torch or alias form) on ``mesh`` for a
    tensor of ``shape``: text, or JSON with ``as_json``."""
    shape = tuple(shape)
    layout = resolve_layout(mesh, placements, len(shape), partial=partial)
    report = _report(layout, shape)
    if as_json:
        return _json(report)
    return _text(layout, shape, report, color)


def _report(layout: Layout, shape: tuple[int, ...]) -> dict[str, Any]:
    mesh = layout.mesh
    return {
        "mesh": _mesh_summary(mesh),
        "shape": list(shape),
        **_layout_summary(layout),
        "even": layout.is_even(shape),
        "physical_shape": list(layout.physical_shape(shape)),
        "ranks": [
            {
                "rank": rank,
                "coordinate": list(mesh.get_coordinate(rank)),
                "local_shape": list(local_shape),
                "offset": list(offset),
            }
            for rank in mesh.rank_list
            for local_shape, offset in [layout.local_shape_and_offset(shape, rank)]
        ],
    }


def _json(value: Any, indent: str = "") -> str:
    """JSON with one line per object member and per object in a list, lists inline."""
    inner = indent + "  "
    if isinstance(value, dict):
        members = [f"{inner}{json.dumps(k)}: {_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(members) + f"\n{indent}}}"
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(inner + json.dumps(v) for v in value) + f"\n{indent}]"
    return json.dumps(value)


_NO_FACTOR = "none (a split factor from a view: only the placements say it)"


def _strided_note(layout: Layout, even: bool) -> str:
    """Where a StridedShard's blocks are not torch's: on uneven shapes ours nest torch.chunk
    in split order, torch's ``_StridedShard`` cuts other blocks (interop's
    ``check_torch_equivalent`` compares them rank by rank)."""
    if even or not any(isinstance(p, StridedShard) for p in layout.placements):
        return ""
    return "   (uneven: ours nest torch.chunk in split order, torch's _StridedShard cuts other blocks)"


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _text(layout: Layout, shape: tuple[int, ...], report: dict[str, Any], color: bool | None) -> str:
    mesh = layout.mesh
    even = "yes" if report["even"] else f"no (padded physical shape {tuple(report['physical_shape'])})"
    lines = [
        f"mesh           {mesh}, ranks {mesh.mesh.tolist()}",
        f"tensor shape   {shape}",
        f"placements     {report['placements']}{_strided_note(layout, report['even'])}",
        f"alias form     {report['alias'] or _NO_FACTOR}",
        f"tensor_map     {layout.tensor_map if not layout.is_strided else _NO_FACTOR}   partial {layout.partial}",
        f"PartitionSpec  {layout.partition_spec if not layout.is_strided else _NO_FACTOR}",
        f"even           {even}",
        "",
    ]
    rows = [("rank", "coordinate", "local shape", "offset", "block")]
    for entry in report["ranks"]:
        block = ", ".join(f"{o}:{o + n}" for n, o in zip(entry["local_shape"], entry["offset"]))
        empty = " (empty)" if not math.prod(entry["local_shape"]) else ""
        rows.append(
            (
                str(entry["rank"]),
                str(tuple(entry["coordinate"])),
                str(tuple(entry["local_shape"])),
                str(tuple(entry["offset"])),
                f"[{block}]{empty}" if not layout.is_strided else "strided (no block)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    if layout.is_strided:
        lines.append("(no picture: a strided shard's elements are no block of the tensor)")
        return "\n".join(lines)
    try:
        lines.append(visualize(layout, shape, color=color))
    except ShapeError:
        lines.append(f"(no picture: pictures show 1-D and 2-D tensors, this one is {len(shape)}-D)")
    return "\n".join(lines)


def redistribute(
    mesh: DeviceMesh,
    shape: Sequence[int],
    src: Any,
    dst: Any,
    *,
    dtype: Any = np.float32,
    from_partial: dict[str, str] | None = None,
    to_partial: dict[str, str] | None = None,
    axis_weights: dict[str, float] | None = None,
    policy: str | None = None,
    as_json: bool = False,
) -> str:
    """The ``redistribute`` report: the planned steps of moving a ``shape``/``dtype``
    tensor from placements ``src`` to ``dst`` on ``mesh`` (:func:`plan_redistribute`),
    their collectives, bytes and costs, then the schedule ``DTensor.redistribute`` runs
    under ``policy`` and the collectives XLA compiled for it
    (:func:`redistribute_collectives`). Text, or JSON."""
    shape = tuple(shape)
    dtype = np.dtype(dtype)
    unknown = sorted(set(axis_weights or ()) - set(mesh.axis_names))
    if unknown:
        raise MeshError(
            "--axis-weights",
            ",".join(f"{a}={w:g}" for a, w in axis_weights.items()),  # type: ignore[union-attr]
            f"mesh {mesh} has no axis {', '.join(map(repr, unknown))}",
            f"weigh its axes {', '.join(mesh.axis_names)}, e.g. {mesh.axis_names[0]}=4",
        )
    source = resolve_layout(mesh, src, len(shape), partial=from_partial)
    target = resolve_layout(mesh, dst, len(shape), partial=to_partial)
    plan = plan_redistribute(shape, dtype, source, target, CostModel(axis_weights) if axis_weights else None)
    dtensor = distribute_tensor(jnp.zeros(shape, dtype), mesh, source)
    try:
        compiled = redistribute_collectives(dtensor, target, policy=policy)
    except RedistributeError as error:
        raise error.for_argument("--to", dst) from None
    schedule = choose(physical(source, shape), physical(target, shape), dtype, policy).name if compiled else "none"
    report = {
        "mesh": _mesh_summary(mesh),
        "shape": list(shape),
        "dtype": dtype.name,
        "from": _layout_summary(source),
        "to": _layout_summary(target),
        "plan": {
            "steps": [
                {
                    "mesh_dim": step.mesh_dim,
                    "axis": step.axis,
                    "from": str(step.src),
                    "to": str(step.dst),
                    "collective": step.collective,
                    "bytes": _number(step.nbytes),
                    "cost": _number(step.cost),
                    "layout_after": str(step.after),
                }
                for step in plan.steps
            ],
            "bytes": _number(plan.nbytes),
            "cost": _number(plan.cost),
        },
        "compiled": {
            "schedule": schedule,
            "policy": effective if isinstance(effective := policy or default_policy(), str) else repr(effective),
            "collectives": [
                {
                    "op": c.op,
                    "mesh_axes": list(c.mesh_axes(mesh)),
                    "dtype": c.dtype,
                    "result_shapes": [list(s) for s in c.result_shapes],
                    "results": c.results_text,
                    "groups": [list(g) for g in c.groups],
                    "bytes": _number(collective_nbytes(c, mesh.size())),
                }
                for c in compiled
            ],
            "bytes": _number(sum((collective_nbytes(c, mesh.size()) for c in compiled), Fraction(0))),
        },
    }
    report["differences"] = differences(report, _hlo_dtype(dtensor.dtype), jax.default_backend())
    if as_json:
        return _json(report)
    return _redistribute_text(mesh, report)


_SCHEDULES = {
    "xla": "XLA's own single reshard of the whole move, not the planned steps",
    "direct": "one shard_map program sending each device the cells it lacks, not the planned steps",
    "direct+xla": "partials reduced in shard_map, then XLA's reshard, not the planned steps",
}


def differences(report: dict[str, Any], dtype: str, backend: str) -> list[str]:
    """Why the compiled collectives of a ``redistribute`` report differ from its plan, one
    sentence per difference, found by matching the planned steps against the collectives
    read from the compiled HLO (same op on the same mesh axis): the schedule that runs, a
    reduce-scatter the backend ran as an all-reduce, a dtype the backend widens, planned
    steps XLA fused or replaced, and the bytes each side sends. ``dtype`` is the tensor's
    HLO element type (``f32``, ``bf16``), ``backend`` JAX's platform name."""
    plan, compiled = report["plan"], report["compiled"]
    sizes = report["mesh"]["shape"]  # a step over one device (a size-1 mesh dim) compiles to nothing
    planned = [s for s in plan["steps"] if s["collective"] in COMMUNICATING and sizes[s["mesh_dim"]] > 1]
    ran = list(enumerate(compiled["collectives"]))
    if not planned and not ran:
        return []

    def step_text(s: dict[str, Any]) -> str:
        return f"{s['collective']} on {s['axis']} ({s['bytes']} B)"

    def ran_text(entry: tuple[int, dict[str, Any]]) -> str:
        i, c = entry
        return f"#{i} {c['op']} on {','.join(c['mesh_axes']) or '-'} ({c['bytes']} B)"

    notes = []
    unmatched = []
    for step in planned:
        twin = next((e for e in ran if e[1]["op"] == step["collective"] and e[1]["mesh_axes"] == [step["axis"]]), None)
        if twin is None:
            unmatched.append(step)
        else:
            ran.remove(twin)
    if not any(c["op"] == "reduce-scatter" for c in compiled["collectives"]):
        for step in [s for s in unmatched if s["collective"] == "reduce-scatter"]:
            reduce = next((e for e in ran if e[1]["op"] == "all-reduce" and step["axis"] in e[1]["mesh_axes"]), None)
            if reduce is not None:
                notes.append(
                    f"planned {step_text(step)} runs as {ran_text(reduce)}: XLA on {backend} compiled no "
                    "reduce-scatter, so every device reduces the whole block and keeps its slice"
                )
                unmatched.remove(step)
                ran.remove(reduce)
    widened = sorted({c["dtype"] for c in compiled["collectives"]} - {dtype})
    if widened:
        notes.append(
            f"the tensor is {dtype} but XLA on {backend} communicates {', '.join(widened)} "
            f"(it computes {dtype} in {', '.join(widened)} here), so the compiled bytes are of the wider type"
        )
    who = "XLA" if compiled["schedule"] in ("xla", "stepwise") else f"schedule {compiled['schedule']}"
    if unmatched and ran:
        replaced = ", ".join(map(step_text, unmatched))
        notes.append(f"{who} replaced planned {replaced} by {', '.join(map(ran_text, ran))}")
    elif unmatched:
        notes.append(f"no compiled collective does planned {', '.join(map(step_text, unmatched))}: {who} fused "
                     "it with the other steps")  # fmt: skip
    elif ran:
        notes.append(f"{', '.join(map(ran_text, ran))} has no planned twin: {who}'s own way of making the move")
    if plan["bytes"] != compiled["bytes"]:
        notes.append(f"so each device sends {compiled['bytes']} B compiled vs {plan['bytes']} B planned")
    if notes and compiled["schedule"] in _SCHEDULES:
        notes.insert(0, f"what runs is schedule {compiled['schedule']} (policy {compiled['policy']}): "
                        f"{_SCHEDULES[compiled['schedule']]}")  # fmt: skip
    return notes


def _hlo_dtype(dtype: Any) -> str:
    """HLO's name of an element type: ``f32``, ``bf16``, ``s8``, ``pred``."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "pred"
    if dtype.name == "bfloat16":
        return "bf16"
    kind = {"f": "f", "i": "s", "u": "u", "c": "c"}.get(dtype.kind)
    return f"{kind}{dtype.itemsize * 8}" if kind else dtype.name


def _mesh_summary(mesh: DeviceMesh) -> dict[str, Any]:
    return {"axis_names": list(mesh.axis_names), "shape": list(mesh.shape), "ranks": mesh.mesh.tolist()}


def _layout_summary(layout: Layout) -> dict[str, Any]:
    if layout.is_strided:  # a split factor from a view: no alias form, tensor_map or PartitionSpec has one
        return {"text": str(layout), "placements": format_placements(layout.placements), "alias": None,
                "tensor_map": None, "partial": list(layout.partial), "partition_spec": None}
    spec = layout.partition_spec
    return {
        "text": str(layout),
        "placements": format_placements(layout.placements),
        "alias": format_alias(layout.alias_map),
        "tensor_map": _jsonable(layout.tensor_map),
        "partial": list(layout.partial),
        "partition_spec": {
            "entries": [_jsonable(e) for e in spec.partitions],
            "unreduced": sorted(getattr(spec, "unreduced", ())),
        },
    }


def _number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def _redistribute_text(mesh: DeviceMesh, report: dict[str, Any]) -> str:
    dims = ", ".join(str(n) for n in report["shape"])

    def side(summary: dict[str, Any]) -> str:
        spec = summary["partition_spec"]
        entries = ", ".join(
            "None" if e is None else repr(e if isinstance(e, str) else tuple(e)) for e in spec["entries"]
        )
        unreduced = f", unreduced={set(spec['unreduced'])}" if spec["unreduced"] else ""
        return f"{summary['text']}   alias {summary['alias']}   PartitionSpec P({entries}{unreduced})"

    plan, compiled = report["plan"], report["compiled"]
    steps = [
        (i, s["axis"], s["from"], s["to"], s["collective"], s["bytes"], s["cost"], s["layout_after"])
        for i, s in enumerate(plan["steps"])
    ]
    collectives = [
        (i, c["op"], ",".join(c["mesh_axes"]) or "-",
         c["results"], _groups_text(c["op"], c["groups"]), c["bytes"])
        for i, c in enumerate(compiled["collectives"])
    ]  # fmt: skip
    lines = [
        f"mesh     {mesh}, ranks {mesh.mesh.tolist()}",
        f"tensor   {report['dtype']}[{dims}]",
        f"from     {side(report['from'])}",
        f"to       {side(report['to'])}",
        "",
        f"planned by placements2jax (its cost model's route, before XLA): {len(steps)} step(s), "
        f"{plan['bytes']} B sent per device, cost {plan['cost']}",
    ]
    if steps:
        headers = ("step", "mesh axis", "from", "to", "collective", "bytes/device", "cost", "layout after")
        lines.append(format_table(headers, steps))
    lines += [
        "",
        f"compiled by XLA (what runs, read from the compiled HLO): {len(collectives)} collective(s), "
        f"{compiled['bytes']} B sent per device (schedule {compiled['schedule']}, policy {compiled['policy']})",
    ]
    if collectives:
        headers = ("#", "collective", "mesh axes", "result per device", "groups (ranks)", "bytes/device")
        lines.append(format_table(headers, collectives))
    if report["differences"]:
        lines += ["", "why they differ:", *(f"  - {note}" for note in report["differences"])]
    elif collectives:
        lines += ["", "compiled = planned: the same collectives on the same mesh axes, the same bytes"]
    return "\n".join(lines)


def _groups_text(op: str, groups: list[list[int]]) -> str:
    if op == "collective-permute":
        return " ".join(f"{a}->{b}" for a, b in groups if a != b)
    return " ".join("[" + ",".join(str(r) for r in g) + "]" for g in groups)
