"""Display helpers shared by the command line (:mod:`.cli`) and the demo (:mod:`.demo`).

Values print themselves (``str()`` of a placement, Layout, DeviceMesh or Collective is
their one text form); this module holds what relates several values for a report, so
that the CLI and the demo show the same thing without importing each other.
"""

from __future__ import annotations

from .hlo import Collective
from .mesh import DeviceMesh

__all__ = ["collective_axes"]


def collective_axes(mesh: DeviceMesh, collective: Collective) -> tuple[str, ...]:
    """The mesh axes a compiled collective communicates along: those on which the ranks
    of one of its groups (or source-target pairs) differ, in mesh order."""
    varying: set[int] = set()
    for group in collective.groups:
        coordinates = [mesh.get_coordinate(rank) for rank in group]
        varying.update(a for a in range(mesh.ndim) if len({c[a] for c in coordinates}) > 1)
    return tuple(mesh.axis_names[a] for a in sorted(varying))
