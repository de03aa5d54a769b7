"""Fully sharded data parallelism (ZeRO-3), torch's ``fully_shard`` for parameter pytrees.

:func:`fully_shard` splits every parameter over the data-parallel mesh axis on its
largest dim whose (local) extent that axis divides, on top of whatever the parameter
already has (a tensor-parallel plan on another axis, from :func:`distribute_pytree`'s
presets or ``plan=``). :func:`unshard` is the all-gather before use: each parameter
redistributed to its layout without the data-parallel axis. Written inside the jitted
loss, XLA does the all-gather in the forward pass and, as its transpose, the
reduce-scatter of the gradients in the backward pass (on CPU, XLA forms an all-reduce
and a local slice instead), so ``jax.grad`` returns the gradients already sharded like
the parameters, and the optimizer updates only each rank's shard:

    params = distribute_pytree(params, mesh, {r".*/up/w": colwise("tp"), r".*/down/w": rowwise("tp")})
    params = fully_shard(params, mesh, "dp")        # ZeRO-3 over dp, combined with tp

    def loss_fn(sharded, x, y):
        return loss(model(unshard(sharded, "dp"), x), y)   # all-gather per step, by XLA

    grads = jax.grad(loss_fn)(params, x, y)          # reduce-scattered, laid out as params

**Which dim.** For each tensor dim, its local extent under the existing splits; the dp
axis goes to the largest extent it divides (the first such dim on a tie, as torch's
``Shard(0)``). A dim already split over other axes gets dp as its *minor* axis (alias
form ``("tp", "dp")``, torch's ``_StridedShard`` as FSDP2 uses it with tensor
parallelism), so that gathering dp gives back exactly the tensor-parallel block: one
all-gather, no reordering. Parameters no dim of which dp divides (small biases,
scalars) stay replicated over dp, as ZeRO-3 implementations keep small tensors whole.
"""

from __future__ import annotations

from typing import Any

import jax

from .dtensor import distribute_tensor, is_dtensor
from .errors import ArgumentTypeError, MeshError, PlanError
from .layout import Layout
from .mesh import DeviceMesh, as_device_mesh
from .parallelize import PlanLike, path_of, plan_layouts

__all__ = ["fully_shard", "fully_shard_layouts", "fully_sharded_layout", "unshard"]


def fully_shard_layouts(
    params: Any, mesh: DeviceMesh, axis: str = "dp", *, plan: PlanLike | None = None, strict: bool = True
) -> Any:
    """The pytree of ``params`` with each leaf replaced by its fully sharded
    :class:`Layout` (module docstring). The starting layout of a leaf is its ``plan``
    layout when ``plan`` is given, else its own layout (DTensors on ``mesh``), else
    replicated. Leaves need only ``.shape`` (``jax.eval_shape`` results work)."""
    mesh = as_device_mesh(mesh, "mesh")
    mesh_dim = _mesh_dim(mesh, axis)
    key_leaves, tree = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_dtensor)
    if plan is not None:
        bases = jax.tree_util.tree_leaves(plan_layouts(params, mesh, plan, strict=strict), is_leaf=_is_layout)
    else:
        bases = [_own_layout(mesh, path_of(key), leaf) for key, leaf in key_leaves]
    layouts = [
        fully_sharded_layout(base, tuple(leaf.shape), mesh_dim, path_of(key))
        for (key, leaf), base in zip(key_leaves, bases)
    ]
    return jax.tree_util.tree_unflatten(tree, layouts)


def fully_shard(
    params: Any, mesh: DeviceMesh, axis: str = "dp", *, plan: PlanLike | None = None, strict: bool = True
) -> Any:
    """``params`` with every leaf a DTensor in its :func:`fully_shard_layouts` layout:
    arrays are distributed, DTensors redistributed (by XLA)."""
    mesh = as_device_mesh(mesh, "mesh")
    layouts = fully_shard_layouts(params, mesh, axis, plan=plan, strict=strict)
    return jax.tree_util.tree_map(
        lambda leaf, layout: leaf.redistribute(mesh, layout) if is_dtensor(leaf) else distribute_tensor(
            leaf, mesh, layout), params, layouts, is_leaf=is_dtensor,
    )


def unshard(params: Any, axis: str = "dp") -> Any:
    """Every DTensor of ``params`` without its split over mesh axis ``axis`` (the
    all-gather before use; inside ``jax.grad`` its transpose reduce-scatters the
    gradients). Other leaves are returned as they are."""
    if not isinstance(axis, str):
        raise ArgumentTypeError("axis", axis, "expected a mesh axis name", 'pass e.g. "dp"')

    def gathered(leaf: Any) -> Any:
        if not is_dtensor(leaf):
            return leaf
        mesh_dim = _mesh_dim(leaf.device_mesh, axis)
        layout = leaf.layout
        if layout.mesh_dim_split(mesh_dim) is None:
            return leaf
        target = Layout(layout.mesh, tuple(tuple(a for a in axes if a != mesh_dim) for axes in layout.dim_axes),
                        layout.partial)
        return leaf.redistribute(placements=target)

    return jax.tree_util.tree_map(gathered, params, is_leaf=is_dtensor)


def _is_layout(value: Any) -> bool:
    return isinstance(value, Layout)


def _mesh_dim(mesh: DeviceMesh, axis: Any) -> int:
    if not isinstance(axis, str):
        raise ArgumentTypeError("axis", axis, "expected a mesh axis name", 'pass e.g. "dp"')
    names = mesh.to_jax().axis_names
    if axis not in names:
        raise MeshError("axis", axis, f"not an axis of the mesh {names}", f"use one of {', '.join(names)}")
    return names.index(axis)


def _own_layout(mesh: DeviceMesh, path: str, leaf: Any) -> Layout:
    shape = getattr(leaf, "shape", None)
    if shape is None:
        raise ArgumentTypeError(
            f"params at {path!r}", leaf, "a leaf must be an array (or have .shape)", "keep only arrays in the pytree"
        )
    if is_dtensor(leaf):
        if leaf.device_mesh != mesh:
            raise MeshError(
                f"params at {path!r}", leaf, "is a DTensor on another mesh", "redistribute it to this mesh first"
            )
        return leaf.layout
    return Layout(mesh, ((),) * len(shape))


def fully_sharded_layout(base: Layout, shape: tuple[int, ...], mesh_dim: int | str, path: str = "leaf") -> Layout:
    """FSDP's rule for one leaf (module docstring, "Which dim"): ``base`` (the leaf's
    layout) with mesh dim ``mesh_dim`` (an index or an axis name) added as the minor split
    of the dim of ``shape`` with the largest local extent it divides; ``base`` itself when
    already split over that mesh dim or when no dim divides (a dim of extent 0 is never
    picked). ``path`` names the leaf in errors. This is what :func:`fully_shard_layouts`
    does per leaf, and :func:`~placements2jax.auto_plan`'s FSDP seeds and moves."""
    if not isinstance(base, Layout):
        raise ArgumentTypeError("base", base, "expected a Layout", "pass e.g. resolve_layout(mesh, 'R,R', 2)")
    if not isinstance(shape, (tuple, list)) or len(shape) != base.ndim or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ArgumentTypeError("shape", shape, f"expected {base.ndim} non-negative ints (the leaf's shape)",
                                "pass the leaf's .shape")
    names = tuple(base.mesh.axis_names)
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise MeshError("mesh_dim", mesh_dim, f"not an axis of the mesh {names}", f"use one of {', '.join(names)}")
        mesh_dim = names.index(mesh_dim)
    elif isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not 0 <= mesh_dim < base.mesh.ndim:
        raise ArgumentTypeError("mesh_dim", mesh_dim, f"expected a mesh dim index in [0, {base.mesh.ndim}) or an "
                                "axis name", f"pass one of {', '.join(names)}")
    if base.partial[mesh_dim] is not None:
        raise PlanError(
            f"params at {path!r}", str(base), "is Partial over the data-parallel axis",
            "reduce it (redistribute that mesh dim to Replicate) before fully sharding",
        )
    if base.mesh_dim_split(mesh_dim) is not None:
        return base  # already split over the axis
    size = base.mesh.shape[mesh_dim]
    best = None
    for d, axes in enumerate(base.dim_axes):
        pieces = 1
        for a in axes:
            pieces *= base.mesh.shape[a]
        if shape[d] % (pieces * size) == 0 and shape[d] > 0 and (best is None or shape[d] // pieces > best[1]):
            best = (d, shape[d] // pieces)
    if best is None:
        return base
    dim_axes = tuple(axes + (mesh_dim,) if d == best[0] else axes for d, axes in enumerate(base.dim_axes))
    return Layout(base.mesh, dim_axes, base.partial)
