"""The steps torch's own DTensor planner takes for a redistribution, priced with our
cost formulas.

Torch's planner (``torch.distributed.tensor._redistribute._gen_transform_infos``) runs
in this process on a *fake* process group of 8 ranks (no data moves; torch is asked
only for its plan). Each step changes one mesh dim; it is priced by the ring formulas
of docs/inference.md section 4 on the block the tensor has just before the step.
Torch 2.13 merges consecutive same-kind collectives into one only on meshes that were
flattened beforehand; the benchmark meshes are not, so every step is its own collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from bounds import step_bytes

from placements2jax import Layout
from placements2jax.inference.cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, LOCAL_PARTIAL, LOCAL_SLICE, REDUCE_SCATTER


@dataclass(frozen=True)
class TorchStep:
    mesh_dim: int
    source: str
    target: str
    collective: str
    nbytes: Fraction


_STATE: dict[str, Any] = {}


def available() -> str | None:
    """None when torch's planner can be asked, else why not."""
    try:
        _fake_world()
    except (ImportError, AttributeError, RuntimeError, ValueError) as error:  # no torch, or another version
        return f"{type(error).__name__}: {error}"
    return None


def _fake_world() -> None:
    if _STATE:
        return
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    _STATE["torch"] = torch


def _kind(source: Any, target: Any) -> str:
    shard_like = lambda p: p.is_shard() or type(p).__name__ == "_StridedShard"
    if source.is_partial():
        return ALL_REDUCE if target.is_replicate() else REDUCE_SCATTER if shard_like(target) else LOCAL_PARTIAL
    if shard_like(source):
        return ALL_GATHER if target.is_replicate() else ALL_TO_ALL
    return LOCAL_SLICE if shard_like(target) else LOCAL_PARTIAL


def torch_steps(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> list[TorchStep]:
    """Torch's steps from ``src`` to ``dst`` for an int32/float32 tensor of ``shape``."""
    _fake_world()
    torch = _STATE["torch"]
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from placements2jax.interop.torch import from_torch_placements, to_torch_mesh, to_torch_placements

    mesh = src.mesh
    torch_mesh = to_torch_mesh(mesh)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    meta = TensorMeta(torch.Size(shape), tuple(strides), torch.float32)
    source = to_torch_placements(src, shape)
    target = to_torch_placements(dst, shape)
    infos = _gen_transform_infos(
        DTensorSpec(torch_mesh, source, tensor_meta=meta), DTensorSpec(torch_mesh, target, tensor_meta=meta)
    )
    steps = []
    current = list(source)
    for info in infos:
        before = from_torch_placements(mesh, current, shape)
        old, new = info.src_dst_placements
        kind = _kind(old, new)
        steps.append(TorchStep(info.mesh_dim, str(old), str(new), kind, step_bytes(kind, before, info.mesh_dim, shape, itemsize)))
        current[info.mesh_dim] = new
    return steps
