"""hlo: collectives read from compiled HLO text."""

from __future__ import annotations

import jax
import numpy as np
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


def test_compiled_eight_way_all_to_all_is_found() -> None:
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, PartitionSpec("x", None)))
    move = jax.jit(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, PartitionSpec(None, "x"))))
    (collective,) = compiled_collectives(move, x)
    assert collective.op == "all-to-all" and collective.group_size == 8
    assert collective.result_bytes == 64 * 64 * 4 // 8
