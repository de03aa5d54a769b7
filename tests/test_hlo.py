"""hlo: collectives read from compiled HLO text."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from placements2jax.hlo import compiled_collectives, parse_collectives

# An 8-way all-to-all as CPU XLA prints it: tuples of more than five arrays carry
# /*index=5*/ comments inside the result type.
EIGHT_WAY_ALL_TO_ALL = (
    "  %all-to-all.1 = (f32[8,1,8]{2,1,0}, f32[8,1,8]{2,1,0}, f32[8,1,8]{2,1,0}, f32[8,1,8]{2,1,0}, "
    "f32[8,1,8]{2,1,0}, /*index=5*/f32[8,1,8]{2,1,0}, f32[8,1,8]{2,1,0}, f32[8,1,8]{2,1,0}) "
    "all-to-all(%a, %b, %c, %d, %e, /*index=5*/%f, %g, %h), channel_id=1, "
    "replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}\n"
)


def test_tuple_results_with_index_comments_are_parsed() -> None:
    (collective,) = parse_collectives(EIGHT_WAY_ALL_TO_ALL)
    assert collective.op == "all-to-all"
    assert collective.result_shapes == ((8, 1, 8),) * 8 and collective.dtype == "f32"
    assert collective.groups == (tuple(range(8)),)
    assert collective.result_bytes == 64 * 8 * 4
    assert collective.op_name == ""  # no metadata
    assert collective.operands == 1  # an all-to-all's tuple holds the pieces of one value


def test_a_combined_collectives_operands_are_its_tuples_arrays() -> None:
    text = ("  %all-reduce = (f32[4,8]{1,0}, f32[2]{0}) all-reduce(%a, %b), channel_id=1, "
            "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add")
    (collective,) = parse_collectives(text)
    assert collective.result_shapes == ((4, 8), (2,)) and collective.operands == 2


def test_a_collective_keeps_the_operation_xla_made_it_for() -> None:
    """The op_name of its metadata, which check reads to say why XLA sent it; not part of
    its identity (two gathers alike are equal whatever made them)."""
    text = (
        '  %all-gather = f32[4,16,8]{1,2,0} all-gather(%bitcast.2), channel_id=1, replica_groups={{0,4},{1,5},{2,6},'
        '{3,7}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/jit(fft)/fft" stack_frame_id=2}'
    )
    (collective,) = parse_collectives(text)
    assert collective.op_name == "jit(f)/jit(fft)/fft" and collective.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert collective == parse_collectives(text.replace("jit(fft)/fft", "dot_general"))[0]


def test_compiled_eight_way_all_to_all_is_found() -> None:
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, PartitionSpec("x", None)))
    move = jax.jit(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, PartitionSpec(None, "x"))))
    (collective,) = compiled_collectives(move, x)
    assert collective.op == "all-to-all" and collective.group_size == 8
    assert collective.result_bytes == 64 * 64 * 4 // 8


def test_mesh_axes_reads_device_ids_as_mesh_positions_not_ranks() -> None:
    """XLA numbers an SPMD program's devices by their position in the mesh. On a mesh whose
    ranks are column-major the all-gather along "a" has groups [[0, 4], [1, 5], ...]: positions
    0 and 4 differ along "a", while ranks 0 and 4 sit in one column (they differ along "b")."""
    from placements2jax.errors import MeshError
    from placements2jax.mesh import DeviceMesh

    mesh = DeviceMesh(np.arange(8).reshape(4, 2).T, ("a", "b"))  # shape (2, 4), rank r at (r % 2, r // 2)
    jmesh = mesh.to_jax()
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(jmesh, PartitionSpec("a", None)))
    gather = jax.jit(lambda a: jax.sharding.reshard(a, NamedSharding(jmesh, PartitionSpec())))
    (collective,) = compiled_collectives(gather, x)
    assert collective.op == "all-gather" and collective.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert collective.mesh_axes(mesh) == ("a",)
    by_rank = {a for g in collective.groups for a in range(2)
               if len({mesh.get_coordinate(r)[a] for r in g}) > 1}
    assert by_rank == {1}  # reading the ids as ranks would name "b": the two readings differ here
    permute = parse_collectives("%cp = f32[4]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}\n")[0]
    assert permute.mesh_axes(mesh) == ("b",)
    everyone = parse_collectives("%ar = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%sum\n")[0]
    assert everyone.mesh_axes(mesh) == ("a", "b")  # empty groups: all devices
    with pytest.raises(MeshError, match="mesh"):
        collective.mesh_axes(DeviceMesh([0, 1], ("x",)))  # groups name devices up to 7
