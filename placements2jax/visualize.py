"""Pictures of layouts: which ranks hold which block of a 1-D or 2-D logical tensor.

:func:`visualize` returns a terminal picture as a string (:func:`print_layout` prints
it); :func:`plot` draws the same with matplotlib (extra ``plot``), for notebooks and docs.
Both take a :class:`~placements2jax.layout.Layout` plus a shape, or anything with
``.layout`` and ``.shape`` (a DTensor), on meshes of any rank. Blocks are torch.chunk's
exact blocks (:meth:`Layout.local_slices`), so uneven and empty blocks show as they are;
a Partial layout marks every block with its reduce op (each rank listed there holds a
partial value of the block, reduced over the partial mesh dims).

Colours need ``rich`` (terminal) or ``matplotlib`` (plots); plain text needs nothing.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from . import chunking
from .errors import ArgumentTypeError, MissingDependencyError, ShapeError, import_extra
from .layout import Layout, MeshPlacements, as_shape

__all__ = ["visualize", "print_layout", "plot", "layout_blocks", "format_ranks", "Block"]

# Background colours of the terminal cells (rich style names), one per distinct rank set.
_CELL_STYLES = (
    "black on bright_cyan",
    "black on bright_yellow",
    "black on bright_green",
    "black on bright_magenta",
    "white on blue",
    "white on red",
    "black on cyan",
    "black on yellow",
    "white on green",
    "white on magenta",
)


@dataclass(frozen=True)
class Block:
    """One block of the logical tensor: its index ranges per dim and the ranks holding it."""

    slices: tuple[slice, ...]
    ranks: tuple[int, ...]

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per dim (hashable, unlike slices before Python 3.12)."""
        return tuple((s.start, s.stop) for s in self.slices)


def layout_blocks(item: Any, shape: Sequence[int] | None = None) -> tuple[Layout, tuple[int, ...], list[Block]]:
    """The bound layout, the shape, and the non-empty blocks in row-major order."""
    layout, shape = _layout_and_shape(item, shape)
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for rank in layout.mesh.rank_list:
        block = Block(layout.local_slices(shape, rank), (rank,))
        if all(stop > start for start, stop in block.bounds):
            holders.setdefault(block.bounds, []).append(rank)
    return (
        layout,
        shape,
        [
            Block(tuple(slice(*bounds) for bounds in key), tuple(sorted(ranks)))
            for key, ranks in sorted(holders.items())
        ],
    )


def visualize(item: Any, shape: Sequence[int] | None = None, *, color: bool | None = None) -> str:
    """The picture of ``item`` (a Layout with ``shape``, or a DTensor) as a string.

    Each cell is one block, labelled with the ranks holding it and its index ranges on
    the borders; notes below say what is uneven, empty or partial. ``color=None`` colours
    the cells (ANSI, with ``rich``) when rich is installed and stdout is a terminal.
    """
    layout, shape, blocks = layout_blocks(item, shape)
    lines = [_header(layout, shape), *_grid(layout, shape, blocks), *_notes(layout, shape, blocks)]
    if not _use_color(color):
        return "\n".join("".join(text for text, _ in line) for line in lines)
    return _render_rich(lines)


def print_layout(
    item: Any, shape: Sequence[int] | None = None, *, color: bool | None = None, file: TextIO | None = None
) -> None:
    """Print :func:`visualize`'s picture (to ``file``, default stdout)."""
    if file is not None and not callable(getattr(file, "write", None)):
        raise ArgumentTypeError("file", file, "expected a text stream", "pass e.g. sys.stderr or an open file")
    print(visualize(item, shape, color=color), file=file or sys.stdout)


# -- text picture ------------------------------------------------------------------------

_Segment = tuple[str, "str | None"]  # text and rich style (None: unstyled)


def _layout_and_shape(item: Any, shape: Sequence[int] | None) -> tuple[Layout, tuple[int, ...]]:
    if isinstance(item, (Layout, MeshPlacements)):
        if shape is None:
            raise ArgumentTypeError(
                "shape",
                shape,
                "a Layout does not know the tensor's shape",
                "pass shape=, e.g. visualize(layout, (8, 2))",
            )
        layout = item
    elif hasattr(item, "layout") and hasattr(item, "shape"):
        layout, shape = item.layout, item.shape if shape is None else shape
    else:
        raise ArgumentTypeError(
            "item", item, "expected a Layout or a DTensor", "pass Layout.from_device_mesh(mesh)(placements) and a shape"
        )
    shape = as_shape(shape, "shape")
    if len(shape) not in (1, 2):
        raise ShapeError(
            "shape",
            shape,
            f"pictures show 1-D or 2-D tensors, not {len(shape)}-D",
            "visualize a 1-D or 2-D tensor",
        )
    return layout.bind(len(shape)), shape


def _header(layout: Layout, shape: tuple[int, ...]) -> list[_Segment]:
    mesh = layout.mesh
    text = f"{layout} on mesh {mesh}, tensor {shape}"
    if list(mesh.rank_list) != list(range(mesh.size())):
        text += f", ranks {mesh.mesh.tolist()}"
    return [(text, None)]


def format_ranks(ranks: Sequence[int]) -> str:
    """``0-3,6``: runs of three or more consecutive ranks shortened."""
    parts: list[str] = []
    start = prev = None
    for r in list(ranks) + [None]:  # type: ignore[list-item]
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev - start >= 2 else ",".join(map(str, range(start, prev + 1))))
        start = prev = r
    return ",".join(parts)


def _grid(layout: Layout, shape: tuple[int, ...], blocks: list[Block]) -> list[list[_Segment]]:
    if not blocks:
        return [[("(no elements: every block is empty)", None)]]
    op = layout.partial_op
    label = {b.bounds: (f"P({op}) " if op else "") + format_ranks(b.ranks) for b in blocks}
    style = _styles(blocks)
    ranges = [sorted({bounds[d] for bounds in label}) for d in range(len(shape))]
    rows, cols = ranges if len(shape) == 2 else ([(0, 1)], ranges[0])

    def cell(r: tuple[int, int], c: tuple[int, int]) -> tuple[tuple[int, int], ...]:
        return (r, c) if len(shape) == 2 else (c,)

    row_names = [f"{start}:{stop}" for start, stop in rows] if len(shape) == 2 else [""]
    margin = max(len(n) for n in row_names) + (1 if len(shape) == 2 else 0)
    col_names = [f"{start}:{stop}" for start, stop in cols]
    widths = [max(len(name), *(len(label[cell(r, c)]) for r in rows)) + 2 for c, name in zip(cols, col_names)]
    lines: list[list[_Segment]] = [
        [((" " * (margin + 1) + "".join(name.center(w) + " " for name, w in zip(col_names, widths))).rstrip(), None)]
    ]

    def border(left: str, mid: str, right: str) -> list[_Segment]:
        return [(" " * margin + left + mid.join("─" * w for w in widths) + right, None)]

    lines.append(border("┌", "┬", "┐"))
    for i, (r, name) in enumerate(zip(rows, row_names)):
        line: list[_Segment] = [(name.rjust(margin - 1) + " " if margin else "", None), ("│", None)]
        for c, w in zip(cols, widths):
            key = cell(r, c)
            line += [(label[key].center(w), style[key]), ("│", None)]
        lines.append(line)
        lines.append(border("├", "┼", "┤") if i < len(rows) - 1 else border("└", "┴", "┘"))
    return lines


def _replicated_axes(layout: Layout) -> list[str]:
    """The mesh axes that neither split a tensor dim nor hold a partial: every block is
    copied along them."""
    splitting = {a for axes in layout.dim_axes for a in axes}
    return [
        name
        for a, name in enumerate(layout.mesh.axis_names)
        if a not in splitting and layout.partial[a] is None and layout.mesh.shape[a] > 1
    ]


def _styles(blocks: list[Block]) -> dict[tuple[tuple[int, int], ...], str]:
    palette: dict[tuple[int, ...], str] = {}
    for b in blocks:
        palette.setdefault(b.ranks, _CELL_STYLES[len(palette) % len(_CELL_STYLES)])
    return {b.bounds: palette[b.ranks] for b in blocks}


def _notes(layout: Layout, shape: tuple[int, ...], blocks: list[Block]) -> list[list[_Segment]]:
    notes = []
    for dim, n in enumerate(shape):
        pieces = layout.pieces(dim)
        if not chunking.is_even(n, pieces):
            sizes = [
                chunking.nested_chunk(n, tuple(zip(pieces, index)))[1]
                for index in itertools.product(*(range(p) for p in pieces))
            ]
            notes.append(f"uneven: dim {dim} ({n}) split {'x'.join(map(str, pieces))} ways into blocks of {sizes}")
    holding = {r for b in blocks for r in b.ranks}
    empty = [r for r in layout.mesh.rank_list if r not in holding]
    if empty:
        notes.append(
            f"empty: rank{'s' if len(empty) > 1 else ''} {format_ranks(sorted(empty))} hold{'' if len(empty) > 1 else 's'} no elements"
        )
    if layout.has_partial:
        names = [layout.mesh.axis_names[a] for a in layout.partial_axes]
        notes.append(
            f"partial: ranks hold P({layout.partial_op}) values; the tensor is their {layout.partial_op} over mesh "
            f"dim{'s' if len(names) > 1 else ''} {', '.join(names)}"
        )
    return [[(note, None)] for note in notes]


def _use_color(color: bool | None) -> bool:
    if color is None:
        return _rich_available() and sys.stdout.isatty()
    if not isinstance(color, bool):
        raise ArgumentTypeError("color", color, "expected True, False or None", "pass color=True, False or None (auto)")
    if color and not _rich_available():
        raise MissingDependencyError(
            "color", color, "coloured pictures need rich, which is not installed",
            "pip install 'placements2jax[rich]', or color=False",
        )
    return bool(color)


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _render_rich(lines: list[list[_Segment]]) -> str:
    from rich.console import Console
    from rich.text import Text

    console = Console(force_terminal=True, color_system="standard", width=10_000, soft_wrap=True)
    with console.capture() as capture:
        for line in lines:
            console.print(Text.assemble(*((text, style or "") for text, style in line)))
    return capture.get().rstrip("\n")


# -- matplotlib ------------------------------------------------------------------------------


def plot(
    items: Any, shape: Sequence[int] | None = None, *, titles: Sequence[str] | None = None, ncols: int | None = None
) -> Any:
    """A matplotlib Figure with one panel per layout (or DTensor) in ``items``: the
    tensor's elements as cells, each block in one colour per set of ranks holding it
    (replicas share the block: it is not split among them) and labelled with those
    ranks, its row / column ranges on the borders, hatched and marked ``P(op)`` when
    partial, and the terminal picture's notes (uneven, empty, partial) plus the
    replicated mesh axes under the panel."""
    plt = import_extra("matplotlib.pyplot", "plot", "plotting", argument="plot", value=items)
    from matplotlib.patches import Rectangle

    items = list(items) if isinstance(items, (list, tuple)) else [items]
    if not items:
        raise ArgumentTypeError("items", items, "nothing to plot", "pass a Layout (with shape=) or a DTensor, or a list of them")
    if titles is not None and (isinstance(titles, str) or len(titles) != len(items)):
        raise ArgumentTypeError("titles", titles, f"expected one title per panel ({len(items)})", "pass a list of strings, or None")
    if ncols is not None and (isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1):
        raise ArgumentTypeError("ncols", ncols, "expected a positive int", "pass e.g. ncols=3, or None")
    panels = [layout_blocks(item, shape) for item in items]
    ncols = ncols or min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    figure, axes = plt.subplots(nrows, ncols, figsize=(2.8 * ncols, 3.8 * nrows), squeeze=False)
    colors = plt.get_cmap("tab20")
    for index, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if index >= len(panels):
            continue
        layout, panel_shape, blocks = panels[index]
        height, width = (panel_shape[0], panel_shape[1]) if len(panel_shape) == 2 else (1, panel_shape[0])
        palette: dict[tuple[int, ...], int] = {}  # one colour per set of ranks holding a block, as in the terminal
        for block in blocks:
            rows, cols = block.slices if len(panel_shape) == 2 else (slice(0, 1), block.slices[0])
            # The whole block in one colour: the ranks holding it hold copies (replicas), not pieces.
            ax.add_patch(
                Rectangle(
                    (cols.start, rows.start),
                    cols.stop - cols.start,
                    rows.stop - rows.start,
                    facecolor=colors(palette.setdefault(block.ranks, len(palette)) % 20),
                    edgecolor="black",
                    linewidth=1.5,
                    hatch="//" if layout.has_partial else None,
                )
            )
            ranks = "\n".join(textwrap.wrap(format_ranks(block.ranks).replace(",", ", "), 11)).replace(", ", ",")
            text = (f"P({layout.partial_op})\n" if layout.has_partial else "") + ranks
            ax.text(
                (cols.start + cols.stop) / 2,
                (rows.start + rows.stop) / 2,
                text,
                ha="center",
                va="center",
                fontsize=9,
                zorder=3,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.85, "linewidth": 0},
            )
        # Thin lines between elements, under the labels.
        for r in range(1, height):
            ax.plot([0, width], [r, r], color="white", linewidth=0.6, alpha=0.7, zorder=2)
        for c in range(1, width):
            ax.plot([c, c], [0, height], color="white", linewidth=0.6, alpha=0.7, zorder=2)
        # The blocks' index ranges on the borders, as the terminal picture labels them.
        bounds = [b.bounds for b in blocks]
        for start, stop in sorted({b[-1] for b in bounds}):
            ax.text((start + stop) / 2, -0.15, f"{start}:{stop}", ha="center", va="bottom", fontsize=7)
        if len(panel_shape) == 2:
            for start, stop in sorted({b[0] for b in bounds}):
                ax.text(-0.15, (start + stop) / 2, f"{start}:{stop}", ha="right", va="center", fontsize=7)
        ax.set_xlim(-0.05, width + 0.05)
        ax.set_ylim(height + 0.05, -0.05)
        title = titles[index] if titles else str(layout)
        holding = {r for b in blocks for r in b.ranks}
        empty = [r for r in layout.mesh.rank_list if r not in holding]
        ax.set_title(title + (f"\n(empty: {format_ranks(empty)})" if empty else ""), fontsize=10, pad=14)
        notes = ["".join(text for text, _ in line) for line in _notes(layout, panel_shape, blocks)]
        replicas = _replicated_axes(layout)
        if replicas and blocks:
            notes.append(f"replicated over {', '.join(replicas)}: each block held by {len(blocks[0].ranks)} ranks")
        if notes:
            ax.text(0.5, -0.04, "\n".join(textwrap.fill(n, 40) for n in notes), transform=ax.transAxes,
                    ha="center", va="top", fontsize=7)  # fmt: skip
    figure.tight_layout()
    return figure
