"""The main job of ``make demo``: worked examples on a ("dp", "tp") mesh of 8 devices."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import Layout, PlacementsLike
from .mesh import DeviceMesh
from .placements import Partial, Replicate, Shard

RFC_PLACEMENTS: tuple[PlacementsLike, ...] = (
    (Shard(0), Replicate()),
    (Replicate(), Shard(0)),
    (Shard(0), Shard(1)),
    (Shard(1), Shard(0)),
    (Replicate(), Shard(1)),
    (Replicate(), Replicate()),
    (("dp", "tp"), None),
    (("tp", "dp"), None),
    (Partial(), Shard(0)),
)


def _describe_block(block: Sequence[slice]) -> str:
    return " ".join(
        f"{name}[{s.start}:{s.stop}]" + (" (empty)" if s.start == s.stop else "")
        for name, s in zip(("rows", "cols"), block)
    )


def conversion_table(mesh: DeviceMesh, shape: tuple[int, ...], specs: Sequence[PlacementsLike]) -> str:
    """Text table: for each placement spec, its tensor_map, PartitionSpec and each rank's block."""
    lines = [f"mesh {mesh!r}, logical tensor of shape {shape}", ""]
    for spec in specs:
        layout = Layout.from_device_mesh(mesh)(spec).bind(len(shape))
        torch_form = str(layout)
        lines.append(f"placements {spec!r}")
        lines.append(f"  torch form     {torch_form}")
        lines.append(f"  tensor_map     {layout.tensor_map}   partial {layout.partial}")
        lines.append(f"  alias form     {layout.alias_map}")
        lines.append(f"  PartitionSpec  {layout.partition_spec}")
        for rank in mesh.rank_list:
            block = _describe_block(layout.local_slices(shape, rank))
            marker = "  (partial value)" if layout.has_partial else ""
            lines.append(f"    rank {rank} {mesh.get_coordinate(rank)}: {block}{marker}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    mesh = DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
    print("== The RFC's example: an 8x2 tensor on a 4x2 (dp, tp) mesh ==\n")
    print(conversion_table(mesh, (8, 2), RFC_PLACEMENTS))
    print("== Uneven: 10 rows, torch.chunk rules ==\n")
    print(conversion_table(mesh, (10, 3), [(Shard(0), Replicate()), (("dp", "tp"), None), (Shard(0), Shard(1))]))
