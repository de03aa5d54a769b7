"""The registry of converters for other libraries' mesh and placement objects.

Wherever placements2jax accepts a mesh or placements, it also accepts another library's
objects (today: torch's ``DeviceMesh``, ``Shard``, ``Replicate``, ``Partial`` and
``_StridedShard``). The core modules (mesh, layout, dtensor) ask this registry and know no
bridge; the bridges live in :mod:`placements2jax.interop`, which registers each one under
the top-level package of the objects it converts (:func:`register_bridge`). A bridge is
imported the first time one of its library's objects is seen, so that library stays an
optional dependency. This module imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .layout import Layout
    from .mesh import DeviceMesh

__all__ = [
    "register_bridge",
    "register_mesh_converter",
    "register_placements_converter",
    "register_shape_check",
    "convert_mesh",
    "convert_placements",
    "check_placements_for_shape",
    "register_dispatcher",
    "dispatcher",
]

MeshConverter = Callable[[Any], "DeviceMesh | None"]
PlacementsConverter = Callable[["DeviceMesh", Sequence[Any]], "Layout | None"]
ShapeCheck = Callable[[Sequence[Any], "Layout", tuple[int, ...]], None]

# Top-level package of a foreign object's type -> the bridge module that registers its converters.
_bridges: dict[str, str] = {}
_loaded: set[str] = set()
_mesh_converters: list[MeshConverter] = []
_placements_converters: list[PlacementsConverter] = []
_shape_checks: list[ShapeCheck] = []


def register_bridge(package: str, module: str) -> None:
    """Import ``module`` (which registers converters) when an object of ``package`` is seen."""
    _bridges[package] = module


def register_mesh_converter(converter: MeshConverter) -> None:
    """Register ``converter(obj) -> DeviceMesh | None`` (None: not recognised)."""
    _mesh_converters.append(converter)


def register_placements_converter(converter: PlacementsConverter) -> None:
    """Register ``converter(mesh, placements) -> Layout | None`` for whole placement
    sequences (None: not recognised). Whole sequences, because some foreign forms only
    mean something together (torch's repeated ``Shard(d)`` and ``_StridedShard``)."""
    _placements_converters.append(converter)


def register_shape_check(check: ShapeCheck) -> None:
    """Register ``check(placements, layout, shape)``, raising when the foreign placements
    mean something else than ``layout`` for a tensor of ``shape`` (torch's uneven
    ``_StridedShard``)."""
    _shape_checks.append(check)


# Another library's op dispatcher (today torch's sharding propagation), by name: name ->
# the function, and name -> the bridge module that registers it when first asked for.
_dispatchers: dict[str, Callable[..., Any]] = {}
_dispatcher_modules: dict[str, str] = {"torch": "placements2jax.interop.torch_dispatch"}


def register_dispatcher(name: str, choose: Callable[..., Any]) -> None:
    """Register ``choose(op, params, specs, out_avals, mesh) -> (in_layouts, out_layouts)``:
    the layouts another library's dispatcher picks for a named op (``infer_signature(...,
    search=name)``)."""
    _dispatchers[name] = choose


def dispatcher(name: str) -> Callable[..., Any] | None:
    """The dispatcher registered under ``name`` (its bridge imported on first use), or
    None when there is none (or its library is not installed)."""
    if name not in _dispatchers and name in _dispatcher_modules:
        try:
            importlib.import_module(_dispatcher_modules[name])
        except ImportError:
            return None
    return _dispatchers.get(name)


def check_placements_for_shape(placements: Any, layout: Layout, shape: tuple[int, ...]) -> None:
    """Run the registered shape checks when ``placements`` hold foreign objects."""
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        return
    _load_bridges(placements)
    for check in _shape_checks:
        check(placements, layout, shape)


def convert_mesh(value: Any) -> DeviceMesh | None:
    """Our DeviceMesh for a foreign mesh object, or None if no bridge recognises it."""
    _load_bridges((value,))
    return next((m for m in (c(value) for c in _mesh_converters) if m is not None), None)


def convert_placements(mesh: DeviceMesh, placements: Sequence[Any]) -> Layout | None:
    """The layout of a placement sequence holding foreign objects, or None if no bridge
    recognises it."""
    _load_bridges(placements)
    return next((lay for lay in (c(mesh, placements) for c in _placements_converters) if lay is not None), None)


def _load_bridges(values: Sequence[Any]) -> None:
    for value in values:
        package = type(value).__module__.partition(".")[0]
        if package in _bridges and package not in _loaded:
            _loaded.add(package)
            importlib.import_module(_bridges[package])
