"""Torch's own choice for a named op: ``infer_signature(..., search="torch")`` (extra ``torch``).

Asks torch 2.13's DTensor sharding propagation (``ShardingPropagator.propagate_op_sharding``,
what ``DTensor.__torch_dispatch__`` runs before every op) which input and output placements
torch's dispatcher picks for the op on the given layouts: torch's strategies, its
``redistribute_cost`` (latency plus bandwidth per mesh dim), its zero-cost-first rule and
its tie-break (the first strategy of least cost), exactly, because it is torch's code. The
mesh is a torch ``DeviceMesh`` built without a process group (:func:`to_torch_mesh`), the
tensors are ``DTensorSpec`` with tensor metadata only: nothing is allocated or sent.

Named ops map onto the aten ops torch's dispatch sees: ``add sub mul div maximum minimum``
(``.Tensor`` / ``.default``), unary ops by their aten name, ``matmul`` of two 2-D (``mm``)
or two 3-D (``bmm``) operands (torch decomposes ``matmul`` into these), ``sum mean`` (``dim``
overloads), ``max min`` (``amax amin``), ``transpose`` (``permute``), ``reshape`` (``view``).
A view torch keeps as a ``_StridedShard`` (``view`` of ``4x8x16`` ``S(1)`` to ``32x16``:
``_StridedShard(0, split_factor=4)``) is a :class:`Layout` with that split factor
(:attr:`Layout.split_factors`); a torch choice no Layout can hold raises
:class:`InferenceError` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema

from ..errors import InferenceError, Placements2JaxError, UnsupportedOpError
from ..foreign import register_dispatcher
from ..layout import Layout
from ..mesh import DeviceMesh
from .torch import from_torch_placements, to_torch_mesh, to_torch_placements

__all__ = ["torch_choice", "aten_schema"]

aten = torch.ops.aten
_BINARY = {"add": aten.add.Tensor, "sub": aten.sub.Tensor, "subtract": aten.sub.Tensor, "mul": aten.mul.Tensor,
           "multiply": aten.mul.Tensor, "div": aten.div.Tensor, "divide": aten.div.Tensor,
           "true_divide": aten.div.Tensor, "maximum": aten.maximum.default, "minimum": aten.minimum.default}
_UNARY_ALIASES = {"negative": "neg"}
_REDUCTIONS = {"sum": aten.sum.dim_IntList, "mean": aten.mean.dim, "max": aten.amax.default, "min": aten.amin.default}


def _torch_dtype(dtype: Any) -> torch.dtype:
    return getattr(torch, np.dtype(dtype).name)


def _spec(torch_mesh: Any, shape: Sequence[int], dtype: Any, layout: Layout) -> DTensorSpec:
    meta = torch.empty(tuple(shape), dtype=_torch_dtype(dtype), device="meta")
    meta_data = TensorMeta(meta.shape, meta.stride(), meta.dtype)
    return DTensorSpec(torch_mesh, to_torch_placements(layout), tensor_meta=meta_data)


def aten_schema(op: str, params: dict[str, Any], args: Sequence[DTensorSpec], out_shape: tuple[int, ...]) -> OpSchema:
    """The ``OpSchema`` torch's dispatch builds for named op ``op`` on ``args``."""
    ndim = len(args[0].tensor_meta.shape)
    if op in _BINARY and len(args) == 2:
        return OpSchema(_BINARY[op], tuple(args), {})
    if op == "matmul" and len(args) == 2:
        ranks = tuple(len(a.tensor_meta.shape) for a in args)
        if ranks in ((2, 2), (3, 3)):
            return OpSchema(aten.mm.default if ranks == (2, 2) else aten.bmm.default, tuple(args), {})
    if op in _REDUCTIONS:
        axis = params.get("axis")
        dims = list(range(ndim)) if axis is None else [a % ndim for a in ((axis,) if isinstance(axis, int) else axis)]
        return OpSchema(_REDUCTIONS[op], (args[0], dims, bool(params.get("keepdims", False))), {})
    if op == "transpose":
        axes = params.get("axes")
        perm = list(reversed(range(ndim))) if axes is None else list(axes)
        return OpSchema(aten.permute.default, (args[0], perm), {})
    if op == "reshape":
        return OpSchema(aten.view.default, (args[0], list(out_shape)), {})
    name = _UNARY_ALIASES.get(op, op)
    overload = getattr(getattr(aten, name, None), "default", None)
    if len(args) == 1 and overload is not None and not params:
        return OpSchema(overload, (args[0],), {})
    raise UnsupportedOpError(
        "op", op, "search='torch' maps no aten op for it with these inputs",
        "use add/sub/mul/div/maximum/minimum, unary ops, matmul of 2-D or 3-D operands, sum/mean/max/min, "
        "transpose or reshape, or the default search",
    )


def torch_choice(
    op: str, params: dict[str, Any], specs: Sequence[Any], out_avals: Sequence[Any], mesh: DeviceMesh
) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
    """The input and output layouts torch 2.13's dispatcher picks for ``op`` on ``specs``
    (TensorSpecs on ``mesh``) — see the module docstring."""
    torch_mesh = to_torch_mesh(mesh)
    args = [_spec(torch_mesh, s.shape, s.dtype, s.layout) for s in specs]
    propagator = DTensor._op_dispatcher.sharding_propagator
    schema = aten_schema(op, params, args, tuple(out_avals[0].shape))
    # As torch's dispatch does: the op's runtime schema info makes the non-tensor args
    # (dims, shapes) part of the schema's hash, so the propagator's cache tells them apart.
    info = propagator.op_to_schema_info.get(schema.op) or propagator.op_to_schema_info_for_single_dim_strategy.get(
        schema.op
    )
    schema = OpSchema(schema.op, schema.args_schema, schema.kwargs_schema, schema_info=info)
    sharding = propagator.propagate_op_sharding(schema)
    wanted = sharding.redistribute_schema.args_spec if sharding.redistribute_schema is not None else args
    outs = sharding.output_spec if isinstance(sharding.output_spec, tuple) else (sharding.output_spec,)
    try:
        ins = tuple(from_torch_placements(mesh, w.placements).bind(len(s.shape)) for w, s in zip(wanted, specs))
        return ins, tuple(from_torch_placements(mesh, o.placements).bind(a.ndim) for o, a in zip(outs, out_avals))
    except Placements2JaxError:
        raise InferenceError(
            "search", "torch", f"torch's choice for {op} ({[str(o) for o in outs]}) has a _StridedShard no Layout "
            "can hold (a split factor no mesh dim gives)", "use the default search, which moves that split",
        ) from None


register_dispatcher("torch", torch_choice)
