"""Count the collectives of eager DTensor code: ``with comm_debug() as comm: ...`` (torch's
``CommDebugMode``, hyper-parallel's comm debug mode).

Inside the context every eager run of a compiled DTensor program is announced (by
:func:`.hlo.running`): ``DTensor.redistribute``, ``full_tensor``, ``to_jax`` (which
reduces partials), the operators (``x @ w``, ``x.sum(dim=0)``) and
:func:`~placements2jax.apply`. The mode reads each
program's collectives from the HLO XLA compiled for those very arguments, so the counts
are what runs, not a prediction; each collective is recorded with the operation that ran
it, the mesh axes its device groups span and the bytes each device sends (the formulas of
:func:`.inference.check.collective_nbytes`).

torch's API is kept where it applies: :meth:`CommDebugMode.get_total_counts`,
:meth:`CommDebugMode.get_comm_counts` (keyed by collective, XLA's names: ``all-gather``,
``all-reduce``, ``reduce-scatter``, ``all-to-all``, ``collective-permute``) and
:meth:`CommDebugMode.generate_comm_debug_tracing_table`; :meth:`CommDebugMode.table` and
:meth:`CommDebugMode.print_table` give the per-operation and per-mesh-axis table with bytes.

Not counted: code inside the caller's ``jax.jit`` (one program: read it with
:func:`~placements2jax.check`), the ``device_put`` transfer of a move between two meshes
(not a collective; the reductions before it are counted), and programs run on plain
``jax.Array`` values.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TextIO

from .errors import ArgumentTypeError
from .hlo import Collective, compiled_collectives, watch_runs
from .inference.check import collective_nbytes
from .inference.table import format_table
from .mesh import DeviceMesh

__all__ = ["CommDebugMode", "CommRecord", "comm_debug"]


@dataclass(frozen=True)
class CommRecord:
    """One collective that ran: the ``operation`` that ran it (``redistribute``,
    ``full_tensor``, an operator's name such as ``matmul``, or ``apply(fn)``), the
    ``collective`` (XLA's opcode), the ``mesh_axes`` it communicates along and the bytes
    each device sends (``nbytes``)."""

    operation: str
    collective: str
    mesh_axes: tuple[str, ...]
    nbytes: Fraction


class CommDebugMode:
    """The context manager :func:`comm_debug` returns; see the module docstring."""

    def __init__(self) -> None:
        self._records: list[CommRecord] = []
        self._programs: dict[tuple[Any, ...], tuple[Collective, ...]] = {}
        self._active = False

    # -- the context -----------------------------------------------------------------------------
    def __enter__(self) -> CommDebugMode:
        if self._active:
            raise ArgumentTypeError(
                "comm_debug", self, "this mode is already counting", "enter a mode once (nest a new comm_debug())"
            )
        self._records.clear()
        self._active = True
        watch_runs(self._ran)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        watch_runs(self._ran, stop=True)
        self._active = False

    def _ran(self, operation: str, jitted: Any, args: tuple[Any, ...], mesh: DeviceMesh) -> None:
        key = (jitted, *((getattr(a, "shape", None), getattr(a, "dtype", None), getattr(a, "sharding", None))
                         for a in args))  # fmt: skip
        collectives = self._programs.get(key)
        if collectives is None:
            ranks = mesh.rank_list  # XLA numbers devices by their position in the mesh
            collectives = tuple(
                Collective(c.op, c.result_shapes, c.dtype, tuple(tuple(ranks[i] for i in g) for g in c.groups))
                for c in compiled_collectives(jitted, *args)
            )
            self._programs[key] = collectives
        for c in collectives:
            nbytes = collective_nbytes(c, mesh.size())
            self._records.append(CommRecord(operation, c.op, c.mesh_axes(mesh), nbytes))

    # -- torch's queries -------------------------------------------------------------------------
    @property
    def records(self) -> tuple[CommRecord, ...]:
        """Every collective that ran, in order."""
        return tuple(self._records)

    def get_total_counts(self) -> int:
        """How many collectives ran (torch's ``get_total_counts``)."""
        return len(self._records)

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives that ran, counted per collective (torch's ``get_comm_counts``, keyed
        by XLA's opcode instead of torch's functional-collective op)."""
        return dict(Counter(r.collective for r in self._records))

    def get_total_bytes(self) -> Fraction:
        """Bytes each device sent, over all collectives."""
        return sum((r.nbytes for r in self._records), Fraction(0))

    def counts(self) -> dict[tuple[str, str, tuple[str, ...]], tuple[int, Fraction]]:
        """(operation, collective, mesh axes) -> (count, bytes each device sent), in the
        order the rows first ran."""
        rows: dict[tuple[str, str, tuple[str, ...]], tuple[int, Fraction]] = {}
        for r in self._records:
            count, nbytes = rows.get((r.operation, r.collective, r.mesh_axes), (0, Fraction(0)))
            rows[(r.operation, r.collective, r.mesh_axes)] = (count + 1, nbytes + r.nbytes)
        return rows

    # -- the table -------------------------------------------------------------------------------
    def table(self) -> str:
        """One row per operation, collective and mesh axes: count and bytes per device; a
        total line last."""
        rows = [
            (operation, collective, ",".join(axes) or "-", str(count), _number(nbytes))
            for (operation, collective, axes), (count, nbytes) in self.counts().items()
        ]
        total = f"total: {self.get_total_counts()} collective(s), {_number(self.get_total_bytes())} B sent per device"
        if not rows:
            return total
        headers = ("operation", "collective", "mesh axes", "count", "bytes/device")
        return format_table(headers, rows) + "\n" + total

    def generate_comm_debug_tracing_table(self, noise_level: int = 0) -> str:
        """torch's name for :meth:`table` (``noise_level`` is accepted and ignored: there
        are no module hooks to be noisy about)."""
        return self.table()

    def print_table(self, file: TextIO | None = None) -> None:
        """Print :meth:`table` (to ``file``, default stdout)."""
        if file is not None and not callable(getattr(file, "write", None)):
            raise ArgumentTypeError("file", file, "expected a text stream", "pass e.g. sys.stderr, or None for stdout")
        print(self.table(), file=file or sys.stdout)

    def __repr__(self) -> str:
        return f"CommDebugMode({self.get_total_counts()} collective(s))"


def comm_debug() -> CommDebugMode:
    """A context that counts the collectives of the eager DTensor code inside it (torch's
    ``CommDebugMode``)::

        with comm_debug() as comm:
            y = (x @ w).redistribute(mesh, "R,R")
        comm.get_comm_counts()   # {'all-reduce': 1, 'all-gather': 1}
        comm.print_table()
    """
    return CommDebugMode()


def _number(value: Fraction) -> str:
    return str(int(value)) if value.denominator == 1 else f"{float(value):.1f}"
