"""Plain-text tables for the inference reports (``__str__`` of signatures, plans, predictions)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction

__all__ = ["format_bytes", "format_table"]


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns separated by `` | ``, with a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def format_bytes(value: Fraction | float) -> str:
    """An exact byte count as an int when whole, else with two decimals."""
    value = Fraction(value)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.2f}"
