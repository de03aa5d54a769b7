"""Display helpers shared by the command line (:mod:`.cli`) and the demos (:mod:`.demo`,
:mod:`.train_demo`).

Values print themselves (``str()`` of a placement, Layout, DeviceMesh or Collective is
their one text form); this module holds what relates several values for a report, so
that the CLI and the demos show the same thing without importing each other: the mesh
axes of a compiled collective, and the predicted-vs-compiled collectives of a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fractions import Fraction

from .hlo import Collective
from .inference.check import collective_nbytes
from .inference.signature import RedistributeStep
from .inference.table import format_bytes, format_table
from .mesh import DeviceMesh

__all__ = ["communication", "communication_table", "count_text"]

# (collective, mesh axes) -> (predicted count, predicted bytes per device, compiled count, compiled bytes per device)
Communication = dict[tuple[str, str], tuple[int, Fraction, int, Fraction]]


def communication(
    mesh: DeviceMesh, predicted: Iterable[RedistributeStep], compiled: Iterable[Collective]
) -> Communication:
    """Per (collective, mesh axes), sorted: the predicted steps' count and bytes per
    device (local slices, local partials and steps over one device, which move nothing,
    left out), then the compiled collectives' count and bytes per device."""
    table: dict[tuple[str, str], list] = {}
    for step in predicted:
        if step.communicates:
            entry = table.setdefault((step.collective, step.axis), [0, Fraction(0), 0, Fraction(0)])
            entry[0] += 1
            entry[1] += step.nbytes
    for collective in compiled:
        axes = ",".join(collective.mesh_axes(mesh)) or "-"
        entry = table.setdefault((collective.op, axes), [0, Fraction(0), 0, Fraction(0)])
        entry[2] += 1
        entry[3] += collective_nbytes(collective, mesh.size())
    return {key: tuple(value) for key, value in sorted(table.items())}  # type: ignore[misc]


def communication_table(rows: Communication) -> str:
    """The table of :func:`communication`, with a total row."""
    body = [(kind, axes, pc, format_bytes(pb), cc, format_bytes(cb)) for (kind, axes), (pc, pb, cc, cb) in rows.items()]
    totals = [sum(v[i] for v in rows.values()) for i in range(4)]
    body.append(("total", "", totals[0], format_bytes(totals[1]), totals[2], format_bytes(totals[3])))
    headers = ("collective", "mesh axes", "predicted", "bytes/device", "compiled", "bytes/device")
    return format_table(headers, body)


def count_text(counts: Mapping[str, int]) -> str:
    """``"12 all-reduce, 4 all-to-all"`` (kinds in name order), or ``"none"``."""
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()) if n) or "none"
