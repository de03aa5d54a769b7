"""placements2jax: PyTorch-DTensor-style placements on JAX.

Data flows one way: DeviceMesh + placements -> Layout (tensor_map) -> jax.sharding.
"""

from .errors import (
    ArgumentTypeError,
    InferenceError,
    LayoutError,
    MeshError,
    MissingDependencyError,
    PlacementError,
    PlanError,
    Placements2JaxError,
    RedistributeError,
    ShapeError,
    UnsupportedOpError,
)
from .caches import clear_caches
from . import interop  # registers the bridges to other libraries' objects (the core never imports it)
from .dtensor import DTensor, distribute_tensor, redistribute_collectives
from .hlo import Collective
from .inference import (
    CostModel,
    Signature,
    check,
    infer_signature,
    plan_redistribute,
    predict,
    set_default_cost_model,
    use_cost_model,
)
from .layout import Layout
from .mesh import DeviceMesh, MeshGroup, as_device_mesh, init_device_mesh
from .operators import apply
from .parallelize import (
    ParallelStyle,
    colwise,
    distribute_pytree,
    layouts_of,
    plan_layouts,
    replicate,
    rowwise,
    sequence,
)
from .placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    format_alias,
    format_placements,
    parse_alias,
    parse_placement,
    parse_placements,
)
from .visualize import plot, print_layout, visualize

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "Collective",
    "CostModel",
    "DTensor",
    "DeviceMesh",
    "InferenceError",
    "Layout",
    "LayoutError",
    "MeshError",
    "MeshGroup",
    "MissingDependencyError",
    "ParallelStyle",
    "Partial",
    "Placement",
    "PlacementError",
    "Placements2JaxError",
    "PlanError",
    "RedistributeError",
    "Replicate",
    "ShapeError",
    "Shard",
    "Signature",
    "UnsupportedOpError",
    "apply",
    "as_device_mesh",
    "check",
    "clear_caches",
    "colwise",
    "distribute_pytree",
    "distribute_tensor",
    "format_alias",
    "format_placements",
    "infer_signature",
    "init_device_mesh",
    "layouts_of",
    "parse_alias",
    "parse_placement",
    "parse_placements",
    "plan_layouts",
    "plan_redistribute",
    "plot",
    "predict",
    "print_layout",
    "redistribute_collectives",
    "replicate",
    "rowwise",
    "sequence",
    "set_default_cost_model",
    "use_cost_model",
    "visualize",
]
