"""The bridge registry: foreign meshes and placement sequences reach Layout through it."""

from dataclasses import dataclass

import pytest

from placements2jax import ArgumentTypeError, DeviceMesh, Layout, Shard, as_device_mesh, init_device_mesh
from placements2jax.interop import register_mesh_converter, register_placements_converter


@dataclass(frozen=True)
class OtherMesh:
    """Another library's mesh: a shape and names."""

    shape: tuple[int, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class SplitAll:
    """Another library's placement: split tensor dim 0 over every mesh dim, in mesh order."""


def _mesh(value: object) -> DeviceMesh | None:
    return init_device_mesh(value.shape, value.names) if isinstance(value, OtherMesh) else None


def _placements(mesh: DeviceMesh, placements: object) -> Layout | None:
    if not any(isinstance(p, SplitAll) for p in placements):
        return None
    return Layout.from_device_mesh(mesh)([tuple(mesh.alias_name)])


register_mesh_converter(_mesh)
register_placements_converter(_placements)


def test_foreign_mesh_and_placements_go_through_their_converters() -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    assert as_device_mesh(OtherMesh((4, 2), ("dp", "tp"))) == mesh
    layout = Layout.from_device_mesh(OtherMesh((4, 2), ("dp", "tp")))([SplitAll(), SplitAll()])
    assert layout.alias_map == (("dp", "tp"),)


def test_jax_mesh_converts_and_strangers_are_refused() -> None:
    mesh = init_device_mesh((2, 4), ("a", "b"))
    assert as_device_mesh(mesh.to_jax()) == mesh
    with pytest.raises(ArgumentTypeError, match="device_mesh=.*expected a placements2jax.DeviceMesh"):
        as_device_mesh([[0, 1]])
    with pytest.raises(ArgumentTypeError, match="mixes the alias form into torch-form placements"):
        Layout.from_device_mesh(mesh)([object(), Shard(0)])
