"""placements2jax: PyTorch-DTensor-style placements on JAX.

Data flows one way: DeviceMesh + placements -> Layout (tensor_map) -> jax.sharding.
"""

from .errors import (
    ArgumentTypeError,
    CheckpointError,
    IndexingError,
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
from .fsdp import fully_shard, fully_shard_layouts, fully_sharded_layout, unshard
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
    register_sharding,
    set_default_cost_model,
    unregister_sharding,
    use_cost_model,
)
from .interop.torch_checkpoint import load_torch_checkpoint
from .layout import Layout, resolve_layout
from .logical import logical_layouts
from .comm_mode import CommDebugMode, comm_debug
from .loss import cross_entropy, loss_parallel, vocab_parallel_cross_entropy
from .mesh import DeviceMesh, MeshGroup, as_device_mesh, init_device_mesh
from .operators import apply, implicit_replication
from . import indexing  # installs DTensor.__getitem__ (after the operators it runs on)
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
    StridedShard,
    format_alias,
    format_placements,
    parse_alias,
    parse_placement,
    parse_placements,
)
from .training import init_optimizer_state, mixed_precision, model_arrays, state_layouts
from .autoplan import auto_plan, compiled_figures, plan_figures
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
    "IndexingError",
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
    "StridedShard",
    "Signature",
    "UnsupportedOpError",
    "apply",
    "auto_plan",
    "as_device_mesh",
    "check",
    "clear_caches",
    "colwise",
    "comm_debug",
    "compiled_figures",
    "cross_entropy",
    "distribute_pytree",
    "distribute_tensor",
    "empty",
    "full",
    "format_alias",
    "format_placements",
    "fully_shard",
    "fully_shard_layouts",
    "fully_sharded_layout",
    "infer_signature",
    "implicit_replication",
    "init_pytree",
    "init_device_mesh",
    "init_optimizer_state",
    "latest_step",
    "layouts_of",
    "local_map",
    "logical_layouts",
    "mixed_precision",
    "model_arrays",
    "load",
    "load_torch_checkpoint",
    "loss_parallel",
    "ones",
    "parse_alias",
    "parse_placement",
    "parse_placements",
    "plan_figures",
    "plan_layouts",
    "plan_redistribute",
    "plot",
    "predict",
    "print_layout",
    "rand",
    "read_metadata",
    "register_sharding",
    "randn",
    "redistribute_collectives",
    "replicate",
    "resolve_layout",
    "rowwise",
    "save",
    "sequence",
    "set_default_cost_model",
    "state_layouts",
    "unregister_sharding",
    "unshard",
    "use_cost_model",
    "visualize",
    "vocab_parallel_cross_entropy",
    "zeros",
]
