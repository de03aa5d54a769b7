"""placements2jax: PyTorch-DTensor-style placements on JAX.

Data flows one way: DeviceMesh + placements -> Layout (tensor_map) -> jax.sharding.
"""

from .errors import (
    ArgumentTypeError,
    CheckpointError,
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
from .fsdp import fully_shard, fully_shard_layouts, unshard
from .func_map import local_map
from .checkpoint import AbstractDTensor, latest_step, load, read_metadata, save
from .factories import empty, full, init_pytree, ones, rand, randn, zeros
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
from .interop.torch_checkpoint import load_torch_checkpoint
from .layout import Layout
from .comm_mode import CommDebugMode, comm_debug
from .loss import vocab_parallel_cross_entropy
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

from .version import __version__

__all__ = [
    "AbstractDTensor",
    "ArgumentTypeError",
    "CheckpointError",
    "Collective",
    "CommDebugMode",
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
    "comm_debug",
    "distribute_pytree",
    "distribute_tensor",
    "empty",
    "full",
    "format_alias",
    "format_placements",
    "fully_shard",
    "fully_shard_layouts",
    "infer_signature",
    "init_pytree",
    "init_device_mesh",
    "latest_step",
    "layouts_of",
    "local_map",
    "load",
    "load_torch_checkpoint",
    "ones",
    "parse_alias",
    "parse_placement",
    "parse_placements",
    "plan_layouts",
    "plan_redistribute",
    "plot",
    "predict",
    "print_layout",
    "rand",
    "read_metadata",
    "randn",
    "redistribute_collectives",
    "replicate",
    "rowwise",
    "save",
    "sequence",
    "set_default_cost_model",
    "unshard",
    "use_cost_model",
    "visualize",
    "vocab_parallel_cross_entropy",
    "zeros",
]
