"""The torch bridge: torch's DeviceMesh and placements to ours and back (extra ``torch``).

Importing this module registers its converters with :mod:`placements2jax.interop`, which
happens by itself the first time a torch object reaches a placements2jax function, so
``Layout.from_device_mesh(mesh)([torch Shard(0), torch Shard(0)])`` and
``distribute_tensor(x, torch_mesh, ...)`` just work when torch is installed.

Placements: torch ``Shard(d)``, ``Replicate()``, ``Partial(op)`` (op sum, avg, max or min)
map one to one. Torch allows one tensor dim to be sharded by several mesh dims (repeated
``Shard(d)``, split in mesh order) and encodes another split order with ``_StridedShard``
(``split_factor`` = the product of the sizes of the mesh dims that split the dim earlier
but stand later in the mesh); both become a layout with that shard order, i.e. the alias
form with the axes of the dim in split order (``_StridedShard`` = the reversed order).
Size-1 mesh dims split nothing, so torch cannot say (and it does not matter) where they
stand in a split order: they come back in mesh order.

Known difference: for a dim split out of mesh order, torch's ``_StridedShard`` encoding
and the nested torch.chunk split in that order (ours, and torch's own ``shard_order``)
agree whenever the dim divides evenly, but can differ for some uneven extents (7 rows on a
(3, 2) mesh split "tp" first: torch puts row 6 on rank (2, 0), the nested rule on (2, 1);
torch even gives non-contiguous shards there). Pass ``global_shape=`` to
:func:`from_torch_placements` / :func:`to_torch_placements`, or call
:func:`check_torch_equivalent`, to have that checked against torch itself.

Meshes: a torch ``DeviceMesh``'s mesh tensor gives the ranks (rank r is
``jax.devices()[r]``) and ``mesh_dim_names`` the axis names. :func:`to_torch_mesh` builds
a torch mesh without any process group when none is initialized (torch's private
``_init_backend=False, _rank=...``): enough for shapes, coordinates and
``distribute_tensor(..., src_data_rank=None)``, not for collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import import_extra

import_extra("torch", "torch", "the torch bridge")  # a missing torch named with its extra, not a bare ImportError

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement as TorchPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import ArgumentTypeError, LayoutError, PlacementError
from ..layout import Layout, MeshPlacements, split_order_from_factors, view_factors
from ..mesh import DeviceMesh, as_device_mesh
from ..placements import REDUCE_OPS, Partial, Placement, Replicate, Shard, StridedShard
from ..foreign import register_mesh_converter, register_placements_converter, register_shape_check

__all__ = [
    "from_torch_mesh",
    "to_torch_mesh",
    "from_torch_placement",
    "from_torch_placements",
    "to_torch_placements",
    "check_torch_equivalent",
]


# -- meshes ----------------------------------------------------------------------------


def from_torch_mesh(torch_mesh: TorchDeviceMesh) -> DeviceMesh:
    """Our DeviceMesh with the ranks and axis names of a torch ``DeviceMesh``."""
    if not isinstance(torch_mesh, TorchDeviceMesh):
        raise ArgumentTypeError(
            "torch_mesh", torch_mesh, "expected a torch.distributed.device_mesh.DeviceMesh", "pass a torch DeviceMesh"
        )
    return DeviceMesh(torch_mesh.mesh.tolist(), torch_mesh.mesh_dim_names)


def to_torch_mesh(mesh: DeviceMesh, device_type: str = "cpu", *, rank: int | None = None) -> TorchDeviceMesh:
    """A torch ``DeviceMesh`` with the ranks and axis names of ``mesh``.

    With an initialized default process group the mesh is an ordinary torch mesh of that
    group. Without one (a single JAX process), it is a mesh seen from ``rank`` (default:
    the mesh's calling rank) that creates no process groups: coordinates, shapes and
    ``distribute_tensor(..., src_data_rank=None)`` work, collectives do not.
    """
    mesh = as_device_mesh(mesh, "mesh")
    ranks = torch.tensor(mesh.mesh.tolist(), dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        return TorchDeviceMesh(device_type, ranks, mesh_dim_names=mesh.axis_names)
    seen_from = mesh.calling_rank() if rank is None else mesh.check_rank(rank)
    return TorchDeviceMesh(device_type, ranks, mesh_dim_names=mesh.axis_names, _init_backend=False, _rank=seen_from)


# -- placements ------------------------------------------------------------------------


def from_torch_placement(placement: Any) -> Placement:
    """Our placement for one torch ``Shard``, ``Replicate`` or ``Partial`` (a
    ``_StridedShard`` only means something next to the others: see
    :func:`from_torch_placements`)."""
    if isinstance(placement, Placement):
        return placement
    if type(placement) is TorchShard:
        return Shard(placement.dim)
    if type(placement) is TorchReplicate:
        return Replicate()
    if type(placement) is TorchPartial:
        if placement.reduce_op not in REDUCE_OPS:
            raise PlacementError(
                "placement",
                placement,
                f"torch's Partial({placement.reduce_op!r}) has no counterpart; supported: {', '.join(REDUCE_OPS)}",
                "reduce it in torch first, or use Partial('sum'|'avg'|'max'|'min')",
            )
        return Partial(placement.reduce_op)
    raise PlacementError(
        "placement",
        placement,
        f"torch placement type {type(placement).__name__} is not supported",
        "use torch's Shard, Replicate, Partial or _StridedShard",
    )


def from_torch_placements(
    mesh: DeviceMesh | TorchDeviceMesh, placements: Sequence[Any], global_shape: Sequence[int] | None = None
) -> Layout:
    """The (unbound) layout of torch placements on ``mesh`` (ours or torch's), keeping
    torch's split order for dims sharded by several mesh dims. With ``global_shape``, the
    result is bound and checked to give every rank exactly torch's shard."""
    mesh = as_device_mesh(mesh, "mesh")
    placements = tuple(placements)
    strided = tuple(
        StridedShard(p.dim, split_factor=p.split_factor) if isinstance(p, _StridedShard) else from_torch_placement(p)
        for p in placements
    )
    # A _StridedShard alone on its dim with a factor from a view (a reshape) stays one (the
    # layout's split factor); the others say a split order (shard_order).
    plain, views = view_factors(strided)
    ours = tuple(p if isinstance(p, StridedShard) and p.dim in views else Shard(p.dim) if isinstance(p, Shard) else p
                 for p in strided)
    # Without a _StridedShard the split order is mesh order, which binding gives (with
    # negative dims normalized first, as torch does: Shard(0) and Shard(-2) are a repeated
    # Shard of a 2-d tensor).
    order = _shard_order(mesh, plain) if any(isinstance(p, StridedShard) for p in plain) else None
    layout = Layout.from_device_mesh(mesh)(ours, shard_order=order)
    if global_shape is None:
        return layout
    bound = layout.bind(len(global_shape))
    check_torch_equivalent(bound, global_shape)
    return bound


def to_torch_placements(layout: Layout, global_shape: Sequence[int] | None = None) -> tuple[TorchPlacement, ...]:
    """Torch placements saying what ``layout`` says: repeated ``Shard(d)`` for a dim split
    by several mesh dims in mesh order, ``_StridedShard`` for other orders (torch's
    ``DTensorSpec._convert_shard_order_to_StridedShard`` rule). With ``global_shape``,
    checks that torch gives every rank the same shard (see the module docstring)."""
    if not isinstance(layout, (Layout, MeshPlacements)):
        raise ArgumentTypeError(
            "layout",
            layout,
            "expected a placements2jax.Layout",
            "build one with resolve_layout(mesh, placements, ndim)",
        )
    result = tuple(_to_torch_placement(p) for p in layout.placements)  # ours carry torch's split factors
    if global_shape is not None:
        check_torch_equivalent(layout.bind(len(global_shape)), global_shape)
    return result


def _to_torch_placement(placement: Placement) -> TorchPlacement:
    if isinstance(placement, StridedShard):
        return _StridedShard(placement.dim, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return TorchShard(placement.dim)
    return TorchPartial(placement.reduce_op) if isinstance(placement, Partial) else TorchReplicate()


def check_torch_equivalent(layout: Layout, global_shape: Sequence[int]) -> None:
    """Raise :class:`LayoutError` unless torch's placements for ``layout`` give every rank
    the shard ``layout`` gives it, for a tensor of ``global_shape``.

    Asks torch's own ``_compute_local_shape_and_global_offset``. Equal local shapes and
    first offsets on every rank mean equal shards: our shards are contiguous blocks that
    tile each dim, so a differing (even non-contiguous) torch shard would change some
    rank's size or first offset."""
    layout = layout.bind(len(global_shape))
    shape = tuple(int(n) for n in global_shape)
    torch_placements = to_torch_placements(layout)
    mesh = layout.mesh
    for rank in mesh.rank_list:
        ours = layout.local_shape_and_offset(shape, rank)
        theirs = _compute_local_shape_and_global_offset(
            shape, mesh.shape, list(mesh.get_coordinate(rank)), torch_placements
        )
        if tuple(ours) != tuple(theirs):
            raise LayoutError(
                "global_shape",
                shape,
                f"torch's {list(torch_placements)} give rank {rank} the shard of shape {theirs[0]} at offset "
                f"{theirs[1]}, the layout {layout.alias_map} (torch.chunk nested in split order) shape {ours[0]} at "
                f"offset {ours[1]}: torch's _StridedShard differs from that split order for this uneven shape",
                "make the dims split out of mesh order divisible by their number of pieces, or split them in "
                "mesh order",
            )


def _shard_order(mesh: DeviceMesh, placements: Sequence[Any]) -> dict[int, tuple[int, ...]]:
    """Per tensor dim, its mesh dims in split order, decoded from ``_StridedShard`` split
    factors (:func:`placements2jax.layout.split_order_from_factors`)."""
    if len(placements) != mesh.ndim:
        return {}  # the shard_order= call refuses the placements with a clear message
    return dict(split_order_from_factors(mesh, placements))


def _convert_mesh(value: Any) -> DeviceMesh | None:
    return from_torch_mesh(value) if isinstance(value, TorchDeviceMesh) else None


def _convert_placements(mesh: DeviceMesh, placements: Sequence[Any]) -> Layout | None:
    if not any(isinstance(p, TorchPlacement) for p in placements):
        return None
    return from_torch_placements(mesh, placements)


def _check_shape(placements: Sequence[Any], layout: Layout, shape: tuple[int, ...]) -> None:
    if any(isinstance(p, _StridedShard) for p in placements):
        check_torch_equivalent(layout, shape)  # a view's split factor too (torch's first offset)


register_mesh_converter(_convert_mesh)
register_placements_converter(_convert_placements)
register_shape_check(_check_shape)
