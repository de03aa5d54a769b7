"""Signature inference: predict the layouts of op outputs, choose the cheapest signature,
and check predictions against what XLA compiles (OneFlow's SBP signature inference,
with torch's placements). See docs/inference.md.

Works on Layouts and shapes/dtypes only: inputs are ``(shape, dtype, layout)`` tuples or
any object with ``.shape``, ``.dtype`` and ``.layout`` (a DTensor).
"""

from .check import CheckReport, check
from .cost import CostModel, default_cost_model, set_default_cost_model, use_cost_model
from .jaxpr import Prediction, predict
from .ops import op_names, primitive_names, register_sharding, unregister_sharding
from .plan import plan_redistribute
from .select import infer_signature
from .signature import (
    Aval,
    Candidate,
    OneDSig,
    RedistributePlan,
    RedistributeStep,
    Signature,
    TensorSpec,
)

__all__ = [
    "Aval",
    "Candidate",
    "CheckReport",
    "CostModel",
    "OneDSig",
    "Prediction",
    "RedistributePlan",
    "RedistributeStep",
    "Signature",
    "TensorSpec",
    "check",
    "default_cost_model",
    "infer_signature",
    "op_names",
    "plan_redistribute",
    "predict",
    "primitive_names",
    "register_sharding",
    "set_default_cost_model",
    "unregister_sharding",
    "use_cost_model",
]
