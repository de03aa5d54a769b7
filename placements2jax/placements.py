"""Torch-style placements: how a logical tensor lies along one mesh dimension.

A sequence of placements has one entry per mesh dimension (torch's mesh-dim-major view).
Each placement is a small immutable value: equal by value, hashable, with an exact repr.
A short text form (``S(0)``, ``R``, ``P``, ``P(max)``) is used in tables, notebooks and
the command line; :func:`parse_placements` and :func:`format_placements` convert both ways.

The text grammar of a whole layout (what ``str(layout)`` prints and every text input
accepts) is defined here, in one place: the torch form ``"S(0),R,P(max)"``, or the alias
form ``"(dp,tp),None"`` optionally followed by its partial mesh axes,
``"(dp,tp),None; partial cp=max"`` (see :func:`parse_layout_text`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeAlias

from .errors import ArgumentTypeError, PlacementError

__all__ = [
    "Placement",
    "Shard",
    "StridedShard",
    "Replicate",
    "Partial",
    "ReduceOp",
    "REDUCE_OPS",
    "parse_placement",
    "parse_placements",
    "format_placements",
    "parse_alias",
    "format_alias",
    "parse_placements_or_alias",
    "parse_partial",
    "format_partial",
    "parse_layout_text",
]

ReduceOp: TypeAlias = Literal["sum", "avg", "max", "min"]
REDUCE_OPS: tuple[ReduceOp, ...] = ("sum", "avg", "max", "min")


class Placement:
    """Base class of :class:`Shard`, :class:`Replicate` and :class:`Partial`."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The tensor is split along tensor dimension ``dim`` over the ranks of this mesh dim.

    Splitting follows ``torch.chunk``: with ``n`` ranks and extent ``N``, each rank gets
    ``ceil(N / n)`` elements in rank order, the last ones fewer or none. A negative ``dim``
    counts from the end and is normalized once the tensor rank is known.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ArgumentTypeError(
                "Shard.dim", self.dim, "the tensor dimension must be an int", "pass e.g. Shard(0)"
            )

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard(Shard):
    """Torch's ``_StridedShard``: tensor dim ``dim`` is split over this mesh dim as part of
    a split by several mesh dims *out of mesh order*. ``split_factor`` is the product of
    the sizes of the mesh dims that split the dim before (major to) this one but stand
    later in the mesh; repeated plain ``Shard(dim)`` splits in mesh order. This is what
    :attr:`Layout.placements` returns for such layouts, as torch 2.13 does, and what every
    torch-form input accepts back as a value. ``str()`` is torch's ``_S(0, 2)``; placement
    text does not parse it (the text of such a layout is its alias form, ``(tp,dp),None``).
    """

    split_factor: int = 1

    def __post_init__(self) -> None:
        Shard.__post_init__(self)
        if isinstance(self.split_factor, bool) or not isinstance(self.split_factor, int) or self.split_factor < 1:
            raise ArgumentTypeError(
                "StridedShard.split_factor", self.split_factor, "must be a positive int",
                "pass e.g. StridedShard(0, split_factor=2)",
            )

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of this mesh dim holds the whole tensor (along this mesh dim)."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Each rank of this mesh dim holds a partial value of full shape; the logical tensor
    is the reduction of the ranks' values with ``reduce_op`` (``sum``, ``avg``, ``max`` or
    ``min``). ``avg`` is the sum divided by the number of ranks of the mesh dim.
    """

    reduce_op: ReduceOp = "sum"
    _short: ClassVar[dict[str, str]] = {"sum": "P"}

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise PlacementError(
                "Partial.reduce_op",
                self.reduce_op,
                f"unknown reduce op; supported: {', '.join(REDUCE_OPS)}",
                "use Partial('sum'), Partial('avg'), Partial('max') or Partial('min')",
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def __str__(self) -> str:
        return self._short.get(self.reduce_op, f"P({self.reduce_op})")


_TOKEN = re.compile(r"\s*(?:S\(\s*(-?\d+)\s*\)|R|P(?:\(\s*(\w+)\s*\))?)\s*", re.IGNORECASE)
_STRIDED_TOKEN = re.compile(r"\s*_S\(\s*(-?\d+)\s*,\s*(\d+)\s*\)\s*", re.IGNORECASE)
_ITEM_SEPARATOR = re.compile(r",(?![^()]*\))")  # a comma outside parentheses


def parse_placement(text: str) -> Placement:
    """Parse one short form: ``S(0)``, ``S(-1)``, ``R``, ``P``, ``P(sum)``, ``P(max)`` ...,
    or ``_S(0, 8)`` (:class:`StridedShard`, as its ``str`` writes it)."""
    if not isinstance(text, str):
        raise ArgumentTypeError("placement", text, "expected a string", 'pass e.g. "S(0)"')
    strided = _STRIDED_TOKEN.fullmatch(text)
    if strided is not None:
        if int(strided.group(2)) < 1:
            raise PlacementError("placement", text, "a split factor must be positive", 'write e.g. "_S(0, 2)"')
        return StridedShard(int(strided.group(1)), split_factor=int(strided.group(2)))
    match = _TOKEN.fullmatch(text)
    if match is None:
        raise PlacementError(
            "placement",
            text,
            "not a placement in short form",
            'write S(<dim>), R, P or P(<sum|avg|max|min>), e.g. "S(0)"',
        )
    shard_dim, reduce_op = match.groups()
    stripped = text.strip().upper()
    if shard_dim is not None:
        return Shard(int(shard_dim))
    if stripped == "R":
        return Replicate()
    return Partial((reduce_op or "sum").lower())  # type: ignore[arg-type]


def parse_placements(text: str) -> tuple[Placement, ...]:
    """Parse a comma-separated list such as ``"S(0),R"`` or ``"P(max), S(1)"``."""
    if not isinstance(text, str):
        raise ArgumentTypeError("placements", text, "expected a string", 'pass e.g. "S(0),R"')
    # Only _S(d, f) contains a comma, inside its parentheses.
    tokens = _ITEM_SEPARATOR.split(text)
    if any(not token.strip() for token in tokens):
        raise PlacementError(
            "placements", text, "not a comma-separated list of placements", 'write e.g. "S(0),R"'
        )
    return tuple(parse_placement(token) for token in tokens)


def format_placements(placements: Sequence[Placement]) -> str:
    """The short form of a sequence of placements, e.g. ``"S(0),R"``."""
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence) or not all(
        isinstance(p, (Shard, Replicate, Partial)) for p in placements
    ):
        raise ArgumentTypeError(
            "placements", placements, "expected a sequence of Shard/Replicate/Partial", "pass e.g. (Shard(0), Replicate())"
        )
    return ",".join(str(p) for p in placements)


_ALIAS_ENTRY = re.compile(r"\s*(?:\(([^()]*)\)|([^,()]*?))\s*(?:,|$)")


def parse_alias(text: str) -> tuple[str | tuple[str, ...], ...]:
    """Parse the alias form's text syntax: one entry per tensor dim, comma-separated; an
    entry is a mesh axis name, ``None`` (not split), or ``(name,name,...)`` for a dim split
    by several axes, major to minor. ``"(dp,tp),None"`` -> ``(("dp", "tp"), "None")``."""
    if not isinstance(text, str):
        raise ArgumentTypeError("placements", text, "expected a string", 'pass e.g. "(dp,tp),None"')
    entries: list[str | tuple[str, ...]] = []
    position = 0
    while position < len(text):
        match = _ALIAS_ENTRY.match(text, position)
        group, name = match.groups() if match else (None, None)
        names = [n.strip() for n in group.split(",")] if group is not None else [name or ""]
        if match is None or match.end() == position or not all(re.fullmatch(r"[A-Za-z_][\w.\-]*", n) for n in names):
            raise PlacementError(
                "placements",
                text,
                "not the alias form: entries are axis names, None, or (name,name) groups, comma-separated",
                'write e.g. "(dp,tp),None" or "dp,None"',
            )
        entries.append(tuple(names) if group is not None else names[0])
        position = match.end()
    if not entries or text.rstrip().endswith(","):
        raise PlacementError("placements", text, "no entry, or an empty last entry", 'write e.g. "(dp,tp),None"')
    return tuple(entries)


def format_alias(entries: Sequence[str | None | Sequence[str]]) -> str:
    """The text syntax of an alias form (see :func:`parse_alias`), e.g. ``"(dp,tp),None"``."""
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not all(
        e is None or isinstance(e, str) or (isinstance(e, Sequence) and all(isinstance(n, str) for n in e))
        for e in entries
    ):
        raise ArgumentTypeError(
            "entries", entries, "expected one axis name, None or tuple of names per tensor dim", 'pass e.g. (("dp", "tp"), None)'
        )
    return ",".join(
        "None" if e is None else e if isinstance(e, str) else f"({','.join(e)})" for e in entries
    )


_AXIS_NAME = r"[A-Za-z_][\w.\-]*"


def parse_partial(text: str) -> dict[str, ReduceOp]:
    """The partial mesh axes of the alias form's text: ``"tp"`` or ``"tp=max,cp=max"``
    -> ``{axis: reduce op}`` (the op defaults to sum)."""
    if not isinstance(text, str):
        raise ArgumentTypeError("partial", text, "expected a string", 'pass e.g. "tp=max"')
    result: dict[str, ReduceOp] = {}
    for entry in (e.strip() for e in text.split(",")):
        match = re.fullmatch(rf"({_AXIS_NAME})(?:\s*=\s*(\w+))?", entry)
        if not match or (match.group(2) or "sum") not in REDUCE_OPS:
            raise PlacementError(
                "partial",
                text,
                "not axis or axis=op pairs",
                f"write e.g. tp or tp=max (op one of {', '.join(REDUCE_OPS)})",
            )
        result[match.group(1)] = (match.group(2) or "sum")  # type: ignore[assignment]
    return result


def format_partial(partial: dict[str, ReduceOp]) -> str:
    """The text of partial mesh axes (see :func:`parse_partial`), ops always written."""
    return ",".join(f"{axis}={op}" for axis, op in partial.items())


def parse_layout_text(
    text: str,
) -> tuple[tuple[Placement, ...] | tuple[str | tuple[str, ...], ...], dict[str, ReduceOp] | None]:
    """The text of a layout, as ``str(layout)`` prints it: torch-form or alias-form
    placements (:func:`parse_placements_or_alias`), the alias form optionally followed by
    ``"; partial <axis>=<op>,..."``. Returns the entries and the partial axes (or None)."""
    if not isinstance(text, str):
        raise ArgumentTypeError("placements", text, "expected a string", 'pass e.g. "S(0),R"')
    head, separator, tail = text.partition(";")
    if not separator:
        return parse_placements_or_alias(text), None
    match = re.fullmatch(r"\s*partial\s+(.*?)\s*", tail)
    if match is None:
        raise PlacementError(
            "placements", text, "the text after ';' is not a partial clause", 'write e.g. "(dp,tp),None; partial cp=max"'
        )
    entries = parse_alias(head)
    try:
        partial = parse_partial(match.group(1))
    except PlacementError as err:
        raise err.for_argument("placements", text) from None
    return entries, partial


def parse_placements_or_alias(text: str) -> tuple[Placement, ...] | tuple[str | tuple[str, ...], ...]:
    """The torch form (``"S(0),R"``) when every entry is a placement, else the alias form
    (``"(dp,tp),None"``, see :func:`parse_alias`). A mesh axis named ``R`` or ``P``
    therefore reads as a placement: name such axes otherwise."""
    try:
        return parse_placements(text)
    except PlacementError as torch_form_error:
        try:
            return parse_alias(text)
        except PlacementError:
            # Report the form the text was closer to: any S(..)/P(..) means the torch form.
            if re.search(r"[SP]\s*\(\s*-?\w*\s*(?:,\s*\w*\s*)?\)", text):
                raise torch_form_error from None
            raise
