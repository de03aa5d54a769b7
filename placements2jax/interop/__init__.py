"""Bridges from other libraries' mesh and placement objects to ours.

Each bridge is a module of this package that registers its converters with
:mod:`placements2jax.foreign` when imported; this module only tells the registry which
bridge handles which library (imported on first sight of that library's objects), so
importing it costs nothing and the libraries stay optional. Today: torch
(:mod:`placements2jax.interop.torch`). The core never imports this package; the package's
``__init__`` does, so the bridges are known as soon as placements2jax is imported.
"""

from __future__ import annotations

from ..foreign import (
    register_bridge,
    register_mesh_converter,
    register_placements_converter,
    register_shape_check,
)

__all__ = ["register_bridge", "register_mesh_converter", "register_placements_converter", "register_shape_check"]

register_bridge("torch", "placements2jax.interop.torch")
