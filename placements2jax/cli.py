"""The command line: ``placements2jax <command>`` (also ``python -m placements2jax``).

Commands: ``explain`` (a layout's tensor_map, PartitionSpec, per-rank blocks and
picture) and ``demo`` (the worked examples). Bad arguments print one line on stderr and
exit with code 2. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .errors import LayoutError, Placements2JaxError, ShapeError
from .layout import Layout
from .mesh import DeviceMesh, init_device_mesh
from .placements import REDUCE_OPS, format_alias, format_placements
from .visualize import visualize

__all__ = ["main", "build_parser", "parse_mesh", "parse_shape", "parse_partial", "explain"]

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
    """``"tp"`` or ``"tp=max,cp=max"`` -> {axis: reduce op} (op defaults to sum)."""
    result = {}
    for entry in (e.strip() for e in text.split(",")):
        match = re.fullmatch(r"([A-Za-z_][\w.\-]*)(?:\s*=\s*(\w+))?", entry)
        if not match or (match.group(2) or "sum") not in REDUCE_OPS:
            raise argparse.ArgumentTypeError(
                f"--partial {text!r}: not axis or axis=op pairs. Fix: write e.g. tp or tp=max "
                f"(op one of {', '.join(REDUCE_OPS)})"
            )
        result[match.group(1)] = match.group(2) or "sum"
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="placements2jax", description="PyTorch-DTensor-style placements on JAX shardings.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_explain(commands)
    # The "redistribute" command (planned steps, collectives, costs) is added here.
    commands.add_parser("demo", help="worked examples on 8 (simulated) devices", description="Worked examples.")
    return parser


def _add_explain(commands: Any) -> None:
    explain_parser = commands.add_parser(
        "explain",
        help="a layout's tensor_map, PartitionSpec, per-rank blocks and picture",
        description="Explain how a tensor lies on a mesh under torch-form or alias-form placements.",
        epilog="examples:\n"
        '  placements2jax explain --mesh dp=4,tp=2 --shape 8,2 --placements "S(0),R"\n'
        '  placements2jax explain --mesh dp=4,tp=2 --shape 10,3 --placements "(tp,dp),None" --json\n'
        '  placements2jax explain --mesh dp=2,tp=4 --shape 8 --placements "tp" --partial dp=max',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain_parser.add_argument("--mesh", required=True, type=parse_mesh, help="mesh axes as name=size, e.g. dp=4,tp=2")
    explain_parser.add_argument("--shape", required=True, type=parse_shape, help="the logical tensor shape, e.g. 8,2")
    explain_parser.add_argument(
        "--placements",
        required=True,
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


def main(argv: Sequence[str] | None = None, *, start_jax: Callable[[int], None] | None = None) -> int:
    """Run a command; returns the exit code. ``start_jax(device_count)`` runs after the
    arguments are parsed and before JAX starts (``__main__`` simulates CPU devices)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "explain":
            names, sizes = args.mesh
            if start_jax is not None:
                start_jax(max(8, math.prod(sizes)))
            print(
                explain(
                    init_device_mesh(sizes, names),
                    args.shape,
                    args.placements,
                    partial=args.partial,
                    as_json=args.json,
                    color=args.color,
                )
            )
        elif args.command == "demo":
            if start_jax is not None:
                start_jax(8)
            from .demo import main as demo_main

            demo_main()
    except Placements2JaxError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


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
    layout = Layout.from_placements(mesh, placements, partial=partial).bind(len(shape))
    report = _report(layout, shape)
    if as_json:
        return _json(report)
    return _text(layout, shape, report, color)


def _report(layout: Layout, shape: tuple[int, ...]) -> dict[str, Any]:
    mesh = layout.mesh
    spec = layout.partition_spec
    return {
        "mesh": {"axis_names": list(mesh.alias_name), "shape": list(mesh.shape), "ranks": mesh.mesh.tolist()},
        "shape": list(shape),
        "placements": _torch_form(layout),
        "alias": format_alias(layout.alias_map),
        "tensor_map": _jsonable(layout.tensor_map),
        "partial": list(layout.partial),
        "partition_spec": {
            "entries": [_jsonable(e) for e in spec.partitions],
            "unreduced": sorted(getattr(spec, "unreduced", ())),
        },
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


def _torch_form(layout: Layout) -> str | None:
    try:
        return format_placements(layout.placements)
    except LayoutError:
        return None


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _text(layout: Layout, shape: tuple[int, ...], report: dict[str, Any], color: bool | None) -> str:
    mesh = layout.mesh
    axes = " x ".join(f"{n}={s}" for n, s in zip(mesh.alias_name, mesh.shape))
    even = "yes" if report["even"] else f"no (padded physical shape {tuple(report['physical_shape'])})"
    lines = [
        f"mesh           {axes}, ranks {mesh.mesh.tolist()}",
        f"tensor shape   {shape}",
        f"placements     {report['placements'] or '(none: torch needs _StridedShard for this split order)'}",
        f"alias form     {report['alias']}",
        f"tensor_map     {layout.tensor_map}   partial {layout.partial}",
        f"PartitionSpec  {layout.partition_spec}",
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
                f"[{block}]{empty}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    try:
        lines.append(visualize(layout, shape, color=color))
    except ShapeError:
        lines.append(f"(no picture: pictures show 1-D and 2-D tensors, this one is {len(shape)}-D)")
    return "\n".join(lines)
