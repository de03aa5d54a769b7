"""The exceptions placements2jax raises for bad input.

Every error names the argument, the value it got and how to fix it, so that a user
never has to read an XLA traceback to learn what was wrong with a mesh or placements.
Each concrete class is also a ``ValueError``, ``TypeError`` or ``IndexError``, so generic handlers work.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = [
    "Placements2JaxError",
    "ArgumentTypeError",
    "MeshError",
    "PlacementError",
    "LayoutError",
    "ShapeError",
    "RedistributeError",
    "InferenceError",
    "UnsupportedOpError",
    "IndexingError",
    "MissingDependencyError",
    "PlanError",
    "CheckpointError",
    "import_extra",
]


class Placements2JaxError(Exception):
    """Base class of every error raised by placements2jax for bad input."""

    def __init__(self, argument: str, value: Any, problem: str, fix: str) -> None:
        self.argument = argument
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{argument}={_short_repr(value)}: {problem}. Fix: {fix}")

    def for_argument(
        self, argument: str, value: Any, *, problem_prefix: str = "", fix_prefix: str = "", kind: type | None = None
    ) -> Placements2JaxError:
        """The same error reported for another argument (the one the user passed), e.g. a
        mesh's bad-axis error as a bad ``partial=``: ``raise err.for_argument(...) from None``.
        ``kind`` replaces the error class (default: the same class)."""
        return (kind or type(self))(argument, value, problem_prefix + self.problem, fix_prefix + self.fix)


class ArgumentTypeError(Placements2JaxError, TypeError):
    """An argument has the wrong type (e.g. a string where a placement was expected)."""


class MeshError(Placements2JaxError, ValueError):
    """A device mesh, mesh axis name or rank is invalid."""


class PlacementError(Placements2JaxError, ValueError):
    """A placement or a sequence of placements is invalid for the mesh."""


class LayoutError(Placements2JaxError, ValueError):
    """A layout (tensor_map, alias form, PartitionSpec) is invalid or inconsistent."""


class ShapeError(Placements2JaxError, ValueError):
    """A local or global shape is inconsistent with the layout."""


class RedistributeError(Placements2JaxError, ValueError):
    """A redistribution between two layouts is not allowed."""


class InferenceError(Placements2JaxError, ValueError):
    """Signature inference found no valid signature or got inconsistent inputs."""


class UnsupportedOpError(InferenceError):
    """Signature inference has no rule for this operation."""


class IndexingError(Placements2JaxError, IndexError):
    """A DTensor index is out of bounds or of a kind indexing does not support."""


class PlanError(Placements2JaxError, ValueError):
    """A parallelization plan (regex rules over parameter paths, or Flax logical axis
    rules) is invalid, ambiguous or incomplete."""


class CheckpointError(Placements2JaxError, ValueError):
    """A checkpoint is missing, incomplete, or does not match the load target (a leaf
    missing, another shape or dtype)."""


class MissingDependencyError(Placements2JaxError, ImportError):
    """An optional dependency (an extra such as ``torch``, ``plot`` or ``rich``) is not installed."""


def import_extra(
    module: str, extra: str, needed_for: str, *, argument: str | None = None, value: Any = None
) -> ModuleType:
    """``module`` imported, or a :class:`MissingDependencyError` naming the extra that
    installs it (``pip install 'placements2jax[extra]'``). ``needed_for`` says what
    needs it ("plotting"); ``argument``/``value`` name what the user asked for (default:
    the module itself)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise MissingDependencyError(
            argument or "import",
            top if argument is None else value,
            f"{needed_for} needs {top}, which is not installed",
            f"pip install 'placements2jax[{extra}]'",
        ) from None


def _short_repr(value: Any, limit: int = 200) -> str:
    text = _value_text(value)
    if "\n" in text:  # a pretty-printed repr (an Equinox module's): one line, as the CLI prints a message
        text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value_text(value: Any) -> str:
    """``repr(value)``, except that a layout shows as the text a user writes for it
    (``'S(0),R'``, its ``str()``) rather than as the constructor call of its repr, also
    inside tuples and lists, and a NumPy or JAX array of one or more dims as its dtype and
    shape (its repr spans lines: the message is one line, as the CLI prints it). (Duck-typed
    by class: this module imports nothing of ours.)"""
    kind = type(value)
    if kind.__module__ == "placements2jax.layout" and kind.__name__ in ("Layout", "MeshPlacements"):
        return repr(str(value))
    if kind.__module__.split(".")[0] in ("numpy", "jax", "jaxlib") and getattr(value, "ndim", 0) > 0:
        return f"<{value.dtype} array of shape {tuple(value.shape)}>"
    if kind in (tuple, list):
        items = ", ".join(_value_text(v) for v in value)
        return f"({items}{',' if len(value) == 1 else ''})" if kind is tuple else f"[{items}]"
    return repr(value)
