"""Read the collectives out of a compiled XLA program's HLO text."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .errors import ArgumentTypeError, MeshError

if TYPE_CHECKING:
    from .mesh import DeviceMesh

__all__ = ["Collective", "parse_collectives", "compiled_collectives", "COLLECTIVE_OPS", "watch_runs", "running"]

COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_INSTRUCTION = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\((?P<rest>.*)$",
    re.MULTILINE,
)
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_ARRAY_TYPE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\(\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?\s*\{(?P<group>[^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>(?:\{\d+,\d+\},?)*)\}")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclass(frozen=True)
class Collective:
    """One collective in compiled HLO: its opcode, result arrays and device groups, and
    ``op_name``: the JAX operation XLA made it for (its metadata, e.g.
    ``jit(step)/jit(fft)/fft``; "" where none; not part of its identity)."""

    op: str
    result_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    groups: tuple[tuple[int, ...], ...]
    op_name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ArgumentTypeError("op", self.op, "not a collective opcode", f"use one of {COLLECTIVE_OPS}")
        for argument, value in (("result_shapes", self.result_shapes), ("groups", self.groups)):
            if not isinstance(value, tuple) or not all(
                isinstance(t, tuple) and all(isinstance(n, int) and not isinstance(n, bool) for n in t) for t in value
            ):
                raise ArgumentTypeError(argument, value, "expected a tuple of tuples of ints", "pass e.g. ((4, 2),)")
        if not isinstance(self.op_name, str):
            raise ArgumentTypeError("op_name", self.op_name, "expected a string", "pass e.g. 'jit(f)/dot_general'")

    @property
    def result_bytes(self) -> int:
        """Bytes of the per-device result (all arrays of a tuple result)."""
        width = _DTYPE_BYTES.get(self.dtype, 4)
        return sum(math.prod(s) for s in self.result_shapes) * width

    @property
    def operands(self) -> int:
        """The values it moves: one per array of a tuple result (a combined collective's
        operands), but one for an all-to-all, whose tuple form (CPU XLA's) holds the pieces
        each device exchanges of one value."""
        return 1 if self.op == "all-to-all" else len(self.result_shapes)

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    @property
    def results_text(self) -> str:
        """The per-device result arrays, e.g. ``f32[4, 2]`` (space-separated for a tuple)."""
        return " ".join(f"{self.dtype}{list(s)}" for s in self.result_shapes)

    def __str__(self) -> str:
        """The one text form of a collective: ``all-gather(f32[8, 2]) groups=[[0, 1], [2, 3]]``."""
        return f"{self.op}({self.results_text}) groups={[list(g) for g in self.groups]}"

    def mesh_axes(self, mesh: DeviceMesh) -> tuple[str, ...]:
        """The axes of ``mesh`` this collective communicates along: those on which the
        devices of one of its groups (or source-target pairs) differ, in mesh order.

        Device ids in compiled HLO are *positions* in the mesh (XLA numbers an SPMD
        program's partitions by their place in its device assignment, which for a program
        over a mesh is ``mesh.devices.flat``), not ranks: on a mesh whose ranks are not in
        row-major order, ``DeviceMesh([[0, 2], [1, 3]])``, a group ``[0, 2]`` varies along
        the first axis although ranks 0 and 2 share a row. Empty groups mean all devices
        (a collective-permute without pairs sends nothing)."""
        if not hasattr(mesh, "axis_names") or not hasattr(mesh, "get_coordinate"):
            raise ArgumentTypeError("mesh", mesh, "expected a DeviceMesh", "pass the DeviceMesh the program ran on")
        shape = tuple(mesh.shape)
        size = math.prod(shape)
        groups = self.groups or (() if self.op == "collective-permute" else (tuple(range(size)),))
        varying: set[int] = set()
        for group in groups:
            if len(group) < 2:
                continue
            if max(group) >= size:
                raise MeshError("mesh", mesh, f"has {size} devices, but the collective's groups name device "
                                f"{max(group)}", "pass the mesh the program was compiled for")
            coordinates = np.unravel_index(np.asarray(group), shape)
            varying.update(a for a in range(len(shape)) if len(set(coordinates[a].tolist())) > 1)
        return tuple(mesh.axis_names[a] for a in sorted(varying))


def _groups(rest: str) -> tuple[tuple[int, ...], ...]:
    if match := _GROUPS_LIST.search(rest):
        return tuple(
            tuple(int(v) for v in g.split(",") if v) for g in re.findall(r"\{([\d,]*)\}", match["groups"])
        )
    if match := _GROUPS_IOTA.search(rest):
        shape = [int(v) for v in match["shape"].split(",")]
        dims = [int(v) for v in match["dims"].split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match["perm"]:
            ids = ids.transpose([int(v) for v in match["perm"].split(",")])
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(shape))
    if match := _GROUPS_MESH.search(rest):
        return _mesh_groups(match)
    if match := _PAIRS.search(rest):
        return tuple(tuple(int(v) for v in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", match["pairs"]))
    return ()


def _mesh_groups(match: re.Match[str]) -> tuple[tuple[int, ...], ...]:
    """Groups in XLA's mesh notation: ``mesh['a'=2,'b'=4], device_ids=([2,2,2]T(0,2,1))
    {'b':(2)2}`` groups devices varying along the listed axes or sub-axes
    (``(pre)size``: the ``size`` factor after the first ``pre`` of that axis)."""
    axes = [(name, int(n)) for name, n in re.findall(r"'([^']+)'=(\d+)", match["axes"])]
    total = math.prod(n for _, n in axes)
    ids = np.arange(total)
    if match["dims"]:
        dims = [int(v) for v in match["dims"].split(",")]
        ids = ids.reshape(dims)
        if match["perm"]:
            ids = ids.transpose([int(v) for v in match["perm"].split(",")])
    referenced = dict(
        (name, (int(pre), int(size)) if size else None)
        for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", match["group"])
    )
    factors: list[int] = []
    grouped: list[int] = []
    for name, n in axes:
        sub = referenced.get(name, False)
        if sub is None:
            grouped.append(len(factors))
            factors.append(n)
        elif sub:
            pre, size = sub
            factors += [pre, size, n // (pre * size)]
            grouped.append(len(factors) - 2)
        else:
            factors.append(n)
    others = [i for i in range(len(factors)) if i not in grouped]
    ids = ids.reshape(factors).transpose(others + grouped)
    size = math.prod(factors[i] for i in grouped)
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(-1, size))


def parse_collectives(hlo_text: str) -> list[Collective]:
    """The collectives of an HLO module's text, in program order (``-start`` halves of
    async pairs count once, ``-done`` halves not at all)."""
    result = []
    # Tuples of more than five arrays carry /*index=5*/ comments, whose "=" would end the type.
    hlo_text = _COMMENT.sub("", hlo_text)
    for match in _INSTRUCTION.finditer(hlo_text):
        arrays = _ARRAY_TYPE.findall(match["type"])
        if match["start"] and match["op"] in ("all-gather", "collective-permute", "all-reduce") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2 :]  # async start returns (operands, results)
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
        dtype = arrays[0][0] if arrays else "f32"
        op_name = _OP_NAME.search(match["rest"])
        result.append(Collective(match["op"], shapes, dtype, _groups(match["rest"]), op_name["name"] if op_name else ""))
    return result


def compiled_collectives(jitted: Any, *args: Any) -> list[Collective]:
    """The collectives XLA compiled for ``jitted(*args)`` (a ``jax.jit`` function)."""
    return parse_collectives(jitted.lower(*args).compile().as_text())


# -- eager runs, watched by comm_debug ------------------------------------------------------------
# The DTensor entry points that run a compiled program eagerly (redistribute, full_tensor, the
# operators, apply) announce it here; :mod:`placements2jax.comm_debug` reads the collectives of
# the announced programs. This module knows no later one: watchers register themselves.

Watcher = Callable[[str, Any, tuple[Any, ...], Any], None]
_watchers: list[Watcher] = []


def watch_runs(watcher: Watcher | None, *, stop: bool = False) -> None:
    """Add ``watcher`` (``stop=False``) or remove it: it is called as ``watcher(operation,
    jitted, args, mesh)`` before each eager run announced through :func:`running`."""
    if stop:
        _watchers.remove(watcher)  # type: ignore[arg-type]
    else:
        _watchers.append(watcher)  # type: ignore[arg-type]


def running(operation: str, jitted: Any, args: tuple[Any, ...], mesh: Any) -> None:
    """Eager code is about to run ``jitted(*args)`` for ``operation`` on ``mesh`` (a
    DeviceMesh); the watchers hear of it. Runs traced inside the caller's ``jax.jit`` are
    not announced (they are part of the caller's program); without watchers this is free."""
    if _watchers and not any(isinstance(a, jax.core.Tracer) for a in args):
        for watcher in tuple(_watchers):
            watcher(operation, jitted, args, mesh)

