"""placements2jax: PyTorch-DTensor-style placements on JAX.

Data flows one way: DeviceMesh + placements -> Layout (tensor_map) -> jax.sharding.
"""

from .errors import (
    ArgumentTypeError,
    InferenceError,
    LayoutError,
    MeshError,
    PlacementError,
    Placements2JaxError,
    RedistributeError,
    ShapeError,
    UnsupportedOpError,
)
from .dtensor import DTensor, distribute_tensor, redistribute_collectives
from .hlo import Collective
from .layout import Layout
from .mesh import DeviceMesh, MeshGroup, init_device_mesh
from .placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    format_placements,
    parse_placement,
    parse_placements,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "Collective",
    "DTensor",
    "DeviceMesh",
    "InferenceError",
    "Layout",
    "LayoutError",
    "MeshError",
    "MeshGroup",
    "Partial",
    "Placement",
    "PlacementError",
    "Placements2JaxError",
    "RedistributeError",
    "Replicate",
    "Shard",
    "ShapeError",
    "UnsupportedOpError",
    "distribute_tensor",
    "format_placements",
    "init_device_mesh",
    "parse_placement",
    "parse_placements",
    "redistribute_collectives",
]
