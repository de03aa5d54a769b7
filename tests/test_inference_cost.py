"""The cost model: exact bytes per device for each collective, blocks, axis weights."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from placements2jax import ArgumentTypeError, InferenceError, Layout, init_device_mesh, resolve_layout
from placements2jax.hlo import parse_collectives
from placements2jax.inference.check import collective_nbytes
from placements2jax.inference import (
    CostModel,
    default_cost_model,
    plan_redistribute,
    predict,
    set_default_cost_model,
    use_cost_model,
)
from placements2jax.inference.cost import (
    COLLECTIVES,
    COMMUNICATING,
    DEFAULT_COLLECTIVE_OVERHEAD,
    SEARCH_OVERHEAD,
    block_bytes,
    collective_bytes,
    collective_factor,
    blocks_misaligned,
    exchange_block_bytes,
    gather_block_bytes,
    gather_halo_bytes,
    gather_halo_permutes,
    halo_permutes,
    resolve_cost_model,
)
from placements2jax.physical import physical
from placements2jax.placements import parse_placements_or_alias
from placements2jax.schedules import choose, sent_bytes_per_device


@pytest.mark.parametrize(
    ("n", "gather", "scatter", "reduce", "all_to_all"),
    [(2, 512, 512, 1024, 256), (4, 768, 768, 1536, 192), (8, 896, 896, 1792, 112)],
)
def test_ring_formulas_on_a_1024_byte_block(n: int, gather: int, scatter: int, reduce: int, all_to_all: int) -> None:
    assert collective_bytes("all-gather", 1024, n) == gather  # T(n-1)/n
    assert collective_bytes("reduce-scatter", 1024, n) == scatter  # T(n-1)/n
    assert collective_bytes("all-reduce", 1024, n) == reduce  # 2T(n-1)/n
    assert collective_bytes("all-to-all", 1024, n) == all_to_all  # T(n-1)/n^2
    assert collective_bytes("local-slice", 1024, n) == 0
    assert collective_bytes("local-partial", 1024, n) == 0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_collective_factor_is_the_bytes_of_a_one_byte_block(n: int) -> None:
    for kind in COLLECTIVES:
        assert collective_factor(kind, n) == collective_bytes(kind, 1, n)
        assert collective_bytes(kind, 96, n) == 96 * collective_factor(kind, n)
    assert collective_factor("all-to-all", 4) == Fraction(3, 16) and collective_factor("all-reduce", 4) == Fraction(3, 2)


def test_costs_are_exact_fractions() -> None:
    assert collective_bytes("all-gather", 1000, 3) == Fraction(2000, 3)
    assert collective_bytes("all-to-all", 1000, 3) == Fraction(2000, 9)
    assert collective_bytes("all-reduce", 7, 1) == 0


def test_collective_errors() -> None:
    with pytest.raises(InferenceError, match="unknown collective"):
        collective_bytes("broadcast", 8, 2)
    with pytest.raises(InferenceError, match="at least one rank"):
        collective_bytes("all-gather", 8, 0)


def test_block_bytes_are_padded_blocks() -> None:
    # 10 rows over 4 ranks: blocks of ceil(10/4) = 3 rows of 8 float32
    assert block_bytes((10, 8), 4, ((0,), ()), (4,)) == 3 * 8 * 4
    assert block_bytes((10, 8), 4, ((0,), ()), (4,), without=0) == 10 * 8 * 4
    # nested: 10 over (2, 2) -> ceil(10/4) = 3; leaving out the minor axis -> 5
    assert block_bytes((10,), 2, ((0, 1),), (2, 2), without=1) == 5 * 2


def test_an_all_to_all_exchanges_padded_blocks() -> None:
    """T of an all-to-all as XLA compiles it: n times the held (padded) block, its target
    dim padded to a multiple of n; block_bytes without the mesh dim on even splits."""
    # (1, 8, 32) split over 4 on its last dim, moved to its first: each holds (1, 8, 8), padded to (4, 8, 8)
    assert exchange_block_bytes((1, 8, 32), 4, ((), (), (0,)), (4, 2), 0)[0] == 4 * (4 * 8 * 8 * 4)
    assert block_bytes((1, 8, 32), 4, ((), (), (0,)), (4, 2), without=0) == 1 * 8 * 32 * 4  # the unpadded T
    # the size-1 dim split over 4 (every rank holds a padded row), moved to the last dim (split over 2 too)
    assert exchange_block_bytes((1, 8, 32), 4, ((0,), (), (1,)), (4, 2), 0)[2] == 4 * (1 * 8 * 16 * 4)
    # 6 rows over 4 ranks: blocks of 2 rows; the target dim 8 divides
    assert exchange_block_bytes((6, 8, 32), 4, ((0,), (), ()), (4, 2), 0)[1] == 4 * (2 * 8 * 32 * 4)


@given(shape=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)), data=st.data())
def test_exchange_blocks_are_never_below_the_unpadded_ones_and_equal_on_even_splits(shape: Any, data: Any) -> None:
    mesh_shape = (4, 2)
    m, split, target = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    assume(split != target)
    other = data.draw(st.sampled_from([None, 0, 1, 2]))  # where the other mesh dim splits, if anywhere
    dim_axes = tuple(tuple(a for a, d in ((1 - m, other), (m, split)) if d == i) for i in range(3))
    exchanged = exchange_block_bytes(shape, 4, dim_axes, mesh_shape, m)[target]
    unpadded = block_bytes(shape, 4, dim_axes, mesh_shape, without=m)
    assert exchanged >= unpadded
    pieces = [math.prod(mesh_shape[a] for a in axes) for axes in dim_axes]
    pieces[target] *= mesh_shape[m]
    if all(n % p == 0 for n, p in zip(shape, pieces)):
        assert exchanged == unpadded


def test_an_all_gather_is_priced_as_xla_pads_or_all_reduces_it() -> None:
    """T and kind of an all-gather as XLA compiles it: n times the held padded block, or
    an all-reduce of the unpadded block where the gathered dim has at most n/2 rows."""
    one = 8 * 32 * 4  # one float32 row of (N, 8, 32)
    # 6 rows over 4: blocks of 2, 8 rows gathered (6,144 B sent, not 4,608)
    assert gather_block_bytes((6, 8, 32), 4, ((0,), (), ()), (4,), 0, 0) == ("all-gather", 8 * one)
    assert collective_bytes("all-gather", 8 * one, 4) == 6144
    # 1 and 2 rows over 4 (<= 4 // 2): written into zeros and all-reduced whole
    assert gather_block_bytes((1, 8, 32), 4, ((0,), (), ()), (4,), 0, 0) == ("all-reduce", one)
    assert gather_block_bytes((2, 8, 32), 4, ((0,), (), ()), (4,), 0, 0) == ("all-reduce", 2 * one)
    # 3 rows over 4: a padded all-gather of 4 rows
    assert gather_block_bytes((3, 8, 32), 4, ((0,), (), ()), (4,), 0, 0) == ("all-gather", 4 * one)
    # over mesh dim 1 of (2, 4), dim 0 split over both: the group sees ceil(3 / 2) = 2 rows, <= 4 // 2
    assert gather_block_bytes((3, 8, 32), 4, ((0, 1), (), ()), (2, 4), 1, 0) == ("all-reduce", 2 * one)
    # another dim's split stays: (5, 8, 32), dim 1 over 4, dim 0 over 2: blocks of 3 rows of 2 columns, 6 rows gathered
    assert gather_block_bytes((5, 8, 32), 4, ((0,), (1,), ()), (2, 4), 0, 0) == ("all-gather", 6 * 2 * 32 * 4)


@given(shape=st.tuples(st.integers(0, 17), st.integers(1, 9)), data=st.data())
def test_gathers_are_never_below_the_unpadded_ring_and_equal_on_even_splits(shape: Any, data: Any) -> None:
    mesh_shape = data.draw(st.sampled_from([(2, 4), (4, 2), (8, 1), (1, 8)]))
    m = data.draw(st.integers(0, 1))
    inner = data.draw(st.booleans())  # the other mesh dim splits dim 0 too (major), else dim 1
    dim_axes = ((1 - m, m), ()) if inner else ((m,), (1 - m,))
    kind, block = gather_block_bytes(shape, 4, dim_axes, mesh_shape, m, 0)
    n = mesh_shape[m]
    unpadded = block_bytes(shape, 4, dim_axes, mesh_shape, without=m)
    sent = collective_bytes(kind, block, n)
    assert sent >= collective_bytes("all-gather", unpadded, n)
    rows = -(-shape[0] // (mesh_shape[1 - m] if inner else 1))
    if rows and rows % n == 0:  # an even split: the plain ring all-gather
        assert (kind, block) == ("all-gather", unpadded)
    if kind == "all-reduce":
        assert rows <= n // 2 and block == unpadded


def _compiled_gather(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], src: tuple[Any, ...], dst: tuple[Any, ...], consumed: bool = False
) -> Any:
    """The collectives XLA compiles to move a value computed in ``src`` (PartitionSpec
    entries over mesh axes a, b, c) to ``dst``: a replicated input sliced locally, then
    constrained (the uneven layout exists only inside the program: jit refuses it at its
    boundary). ``consumed``: ``dst`` is uneven too, so the moved value is summed inside
    the program (its scalar all-reduce left out), not returned (jit would gather it)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[: math.prod(mesh_shape)]).reshape(mesh_shape), ("a", "b", "c")[: len(mesh_shape)])

    def body(x: Any) -> Any:
        y = jnp.sin(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*src))))
        moved = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, PartitionSpec(*dst)))
        return jnp.cos(moved).sum() if consumed else moved

    arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    compiled = parse_collectives(jax.jit(body).lower(arg).compile().as_text())
    return [c for c in compiled if not (consumed and c.result_shapes == ((),))]


@pytest.mark.parametrize(("mesh_shape", "shape", "src", "dst", "dim_axes", "m", "kind", "nbytes"), [
    ((2,), (3, 8, 32), ("a",), (), ((0,), (), ()), 0, "all-gather", 2048),  # 4 rows gathered, not 3 (1,536)
    ((4,), (6, 8, 32), ("a",), (), ((0,), (), ()), 0, "all-gather", 6144),  # 8 rows, not 6 (4,608)
    ((4,), (1, 8, 32), ("a",), (), ((0,), (), ()), 0, "all-reduce", 1536),  # 1 <= 4 // 2: not 768
    ((4,), (2, 8, 32), ("a",), (), ((0,), (), ()), 0, "all-reduce", 3072),  # 2 <= 4 // 2: not 1,536
    ((8,), (3, 8, 32), ("a",), (), ((0,), (), ()), 0, "all-reduce", 5376),  # 3 <= 8 // 2: not 2,688
    ((8,), (13, 8, 32), ("a",), (), ((0,), (), ()), 0, "all-gather", 14336),  # 16 rows, not 13 (11,648)
    ((2, 4), (5, 8, 32), ("b",), (), ((1,), (), ()), 1, "all-gather", 6144),  # over a sub-mesh axis: 8 rows, not 5
    ((2, 4), (2, 8, 32), ("b",), (), ((1,), (), ()), 1, "all-reduce", 3072),
    ((2, 4), (3, 8, 32), ("a", "b"), (None, "b"), ((0,), (1,), ()), 0, "all-gather", 512),  # b keeps dim 1
])
def test_gathers_compile_as_priced(
    mesh_shape: Any, shape: Any, src: Any, dst: Any, dim_axes: Any, m: int, kind: str, nbytes: int
) -> None:
    """XLA's SPMD partitioner on uneven gathers (``ReplicatePartial``), measured: one
    collective of the kind and bytes :func:`gather_block_bytes` prices."""
    compiled = _compiled_gather(mesh_shape, shape, src, dst)
    priced_kind, block = gather_block_bytes(shape, 4, dim_axes, mesh_shape, m, 0)
    assert [c.op for c in compiled] == [priced_kind] == [kind]
    assert collective_nbytes(compiled[0], math.prod(mesh_shape)) == collective_bytes(kind, block, mesh_shape[m]) == nbytes



@pytest.mark.parametrize(("mesh_shape", "shape", "src", "dst", "dim_axes", "m", "kinds", "nbytes"), [
    # 6 rows over (a, b) of 2x4 to a: groups gather 4 rows, blocks of a are 3: row 3 goes to shard 4 first (1,024 B)
    ((2, 4), (6, 8, 32), (("a", "b"),), ("a",), ((0, 1), (), ()), 1, ["all-gather"], 3072 + 1024),
    ((2, 4), (9, 8, 32), (("a", "b"),), ("a",), ((0, 1), (), ()), 1, ["all-gather"], 6144 + 2 * 1024),  # two permutes
    ((2, 4), (17, 8, 32), (("a", "b"),), ("a",), ((0, 1), (), ()), 1, ["all-gather"], 9216 + 3072),  # one of 3 rows
    ((2, 4), (2, 8, 32), (("a", "b"),), ("a",), ((0, 1), (), ()), 1, ["all-reduce"], 1536 + 1024),  # short: all-reduced
    ((2, 4), (1, 8, 32), (("a", "b"),), ("a",), ((0, 1), (), ()), 1, ["all-reduce"], 1536),  # misaligned, nothing to send
    ((2, 4), (7, 8, 32), (("a", "b"),), ("a",), ((0, 1), (), ()), 1, ["all-gather"], 3072),  # 4 rows = ceil(7 / 2): aligned
    ((2, 4), (9, 8, 32), (("b", "a"),), ("b",), ((1, 0), (), ()), 0, ["all-gather"], 2048 + 2048),  # a minor of b
    ((2, 4), (6, 8, 32), (("b", "a"),), ("b",), ((1, 0), (), ()), 0, ["all-gather"], 1024),  # 2 x 1 = ceil(6 / 4)
    ((2, 2, 2), (9, 8, 32), (("a", "b", "c"),), (("a", "b"),), ((0, 1, 2), (), ()), 2, ["all-gather"], 2048 + 2048),
    # another mesh dim splits another dim: a row of the held block is 8 x 16
    ((2, 2, 2), (6, 8, 32), (("a", "b"), None, "c"), ("a", None, "c"), ((0, 1), (), (2,)), 1, ["all-gather"], 1024 + 512),
])
def test_gathers_off_a_dim_split_by_several_mesh_dims_compile_as_priced(
    mesh_shape: Any, shape: Any, src: Any, dst: Any, dim_axes: Any, m: int, kinds: list[str], nbytes: int
) -> None:
    """XLA's SPMD partitioner gathering the minor split off a dim split by several mesh
    dims (``TileToPartialReplicateHaloExchange``), measured: where the gathered groups'
    blocks do not start where the remaining split's do, collective-permutes of the rows
    and pairs :func:`halo_permutes` says first, over the mesh axes and bytes
    :func:`gather_halo_permutes` says, then the gather :func:`gather_block_bytes` prices."""
    compiled = _compiled_gather(mesh_shape, shape, src, dst, consumed=True)
    kind, block = gather_block_bytes(shape, 4, dim_axes, mesh_shape, m, 0)
    halo = gather_halo_bytes(shape, 4, dim_axes, mesh_shape, m, 0)
    permutes = [c for c in compiled if c.op == "collective-permute"]
    assert [c.op for c in compiled if c.op != "collective-permute"] == [kind] == kinds
    pieces = math.prod(mesh_shape[a] for a in dim_axes[0])
    predicted = halo_permutes(shape[0], pieces, mesh_shape[m])
    # each permute: its rows and device pairs (a pair of shards along dim 0 for each place on the other mesh dims)
    devices = np.arange(math.prod(mesh_shape)).reshape(mesh_shape).transpose(
        *dim_axes[0], *(a for a in range(len(mesh_shape)) if a not in dim_axes[0])
    ).reshape(pieces, -1)
    assert sorted((c.result_shapes[0][0], sorted(c.groups)) for c in permutes) == sorted(
        (rows, sorted((int(devices[s, k]), int(devices[t, k])) for s, t in pairs for k in range(devices.shape[1])))
        for rows, pairs in predicted
    )
    mesh = init_device_mesh(mesh_shape, ("a", "b", "c")[: len(mesh_shape)])
    assert sorted((c.mesh_axes(mesh), collective_nbytes(c, mesh.size())) for c in permutes) == sorted(
        (tuple(mesh.axis_names[a] for a in axes), nbytes)
        for axes, nbytes in gather_halo_permutes(shape, 4, dim_axes, mesh_shape, m, 0)
    )
    assert sum(collective_nbytes(c, mesh.size()) for c in permutes) == halo
    sent = sum(collective_nbytes(c, mesh.size()) for c in compiled)
    assert sent == collective_bytes(kind, block, mesh_shape[m]) + halo == nbytes


@pytest.mark.parametrize(("mesh_shape", "shape", "src", "dst", "ops", "nbytes"), [
    # aligned (4 rows per group of 2 rows each, 8 / 2 = 4): the exchange compiles as priced
    ((4, 2), (13, 8, 32), (("a", "b"), None), ("a", "b"), ["all-to-all"], 1024),
    # misaligned, the target dim unsplit: XLA replicates the dim over all 8 devices (a padded all-gather of 16 rows)
    ((4, 2), (9, 8, 32), (("a", "b"), None), ("a", "b"), ["all-gather"], 14336),
    ((2, 4), (6, 8, 32), (("a", "b"), None), ("a", "b"), ["all-gather"], 7168),
    # misaligned, the target dim split by c: the all-to-all and a halo exchange of a row
    ((2, 2, 2), (6, 8, 32), (("a", "b"), "c"), ("a", ("c", "b")), ["all-to-all", "collective-permute"], 512 + 256),
])
def test_exchanges_off_a_misaligned_dim_split_by_several_mesh_dims_are_not_one_collective(
    mesh_shape: Any, shape: Any, src: Any, dst: Any, ops: list[str], nbytes: int
) -> None:
    """What XLA compiles for an all-to-all moving the minor split off a dim split by several
    mesh dims: where the blocks are misaligned (:func:`blocks_misaligned`), not the priced
    all-to-all but a replication of the dim or an added halo exchange, by cases the planner
    does not model: it offers no such step (tests/test_inference_plan.py)."""
    compiled = _compiled_gather(mesh_shape, shape, src, dst, consumed=True)
    assert sorted(c.op for c in compiled) == sorted(ops)
    assert sum(collective_nbytes(c, math.prod(mesh_shape)) for c in compiled) == nbytes
    sizes = dict(zip("abc", mesh_shape))
    pieces = math.prod(sizes[a] for a in src[0])
    assert blocks_misaligned(shape[0], pieces, sizes[src[0][-1]]) == (ops != ["all-to-all"])


def test_halo_permutes_as_xla_packs_them() -> None:
    """Each halo collective-permute, as measured (the test above): 6 rows over 8 regrouped
    by 4, one permute of a row (shards 3, 4, 5 send a row to 4, 5, 6: over a and b, 1,024
    B); 9 rows, two (shard 3 sends to 4 and 5: two permutes); 17 rows, one of 3 rows
    (blocks of 3, the window moves by 3); 1 row: misaligned, but the rows moved are padding."""
    assert halo_permutes(6, 8, 4) == ((1, ((3, 4), (4, 5), (5, 6))),)
    assert gather_halo_permutes((6, 8, 32), 4, ((0, 1), (), ()), (2, 4), 1, 0) == (((0, 1), 1024),)
    assert halo_permutes(9, 8, 4) == ((1, ((2, 4), (3, 5))), (1, ((3, 4), (4, 5))))
    assert [rows for rows, _ in halo_permutes(17, 8, 4)] == [3]
    assert blocks_misaligned(1, 8, 4) and halo_permutes(1, 8, 4) == ()
    assert not blocks_misaligned(7, 8, 4) and halo_permutes(7, 8, 4) == ()
    assert not blocks_misaligned(6, 4, 4)  # split once: nothing to realign
    assert gather_halo_bytes((6, 8, 32), 4, ((1,), (), ()), (2, 4), 1, 0) == 0


@given(size=st.integers(0, 80), data=st.data())
def test_halo_permutes_deliver_every_row_a_block_lacks(size: int, data: Any) -> None:
    """Each device of the gathering group must first hold the rows of its window in the
    realigned split (``c`` rows from ``i*c - (n*c - d) * floor(i / n)``): the permutes send
    at least the most any device lacks and at most a block each, and none on even splits."""
    n = data.draw(st.sampled_from([2, 3, 4]))
    pieces = n * data.draw(st.sampled_from([2, 3, 4]))
    permutes = halo_permutes(size, pieces, n)
    if size % pieces == 0:
        assert not blocks_misaligned(size, pieces, n) and permutes == ()
    held = -(-size // pieces)
    shift = n * held - -(-size // (pieces // n))
    lacking = [
        sum(1 for row in range(i * held - shift * (i // n), (i + 1) * held - shift * (i // n)) if row < size and row // held != i)
        for i in range(pieces)
    ]
    received = [0] * pieces
    for rows, pairs in permutes:
        assert 0 < rows <= held
        sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
        assert len(set(sources)) == len(sources) and len(set(targets)) == len(targets)
        assert all(s != t for s, t in pairs)
        for t in targets:
            received[t] += rows
    assert all(got >= lack for got, lack in zip(received, lacking))
    assert (permutes == ()) == (max(lacking, default=0) == 0)

def test_cost_model_weights_by_name_then_index() -> None:
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    model = CostModel({"dp": 4, 1: 0.5})
    assert model.weights(mesh) == (4, Fraction(1, 2))
    assert CostModel().weights(mesh) == (1, 1)
    assert CostModel({"dp": 4}) == CostModel({"dp": 4.0}) and hash(CostModel({"dp": 4})) == hash(CostModel({"dp": 4.0}))
    assert repr(CostModel({"dp": 4})) == "CostModel({'dp': 4.0})"


def test_cost_model_hash_is_the_dataclass_hash_cached_and_not_pickled() -> None:
    """The hash is computed once (plan caches key on the model by the thousand), is the
    plain frozen dataclass's (its fields' tuple), and a pickled model is hashed afresh where
    it is loaded (axis names are strings, hashed differently in another process)."""
    import dataclasses
    import pickle

    model = CostModel({"dp": 4}, latency={"tp": 1e-6}, curves={"tp": {"all-gather": [(8, 1e-6), (1024, 2e-6)]}})
    fields = tuple(getattr(model, f.name) for f in dataclasses.fields(model))
    assert hash(model) == hash(fields) == hash(model) and "_hash" in model.__dict__
    loaded = pickle.loads(pickle.dumps(model))
    assert "_hash" not in loaded.__dict__
    assert loaded == model and hash(loaded) == hash(model)
    assert model != CostModel({"dp": 4}, latency={"tp": 1e-6})  # equality still by every field


def test_collective_overhead_is_a_validated_field_of_the_model() -> None:
    """The bytes the program search charges per collective: by default latency-bound, one
    figure per kind in COMMUNICATING's order (8,192 B per all-gather and all-to-all, which
    CPU XLA's combiner never merges; SEARCH_OVERHEAD = 192 per reduce-scatter and all-reduce,
    which it merges), so CostModel(collective_overhead=192) is no longer the default model
    (it is the search's own overhead); one int where every kind costs the same, else one
    figure per kind, kinds not given keeping the default's figure; whole bytes; derived as
    max(latency) / max(per_byte) for every kind where both are given (torch's and Alpa's
    alpha-beta model: a latency in bytes)."""
    assert CostModel().collective_overhead == DEFAULT_COLLECTIVE_OVERHEAD == (8192, 8192, 192, 192)
    assert SEARCH_OVERHEAD == 192 and COMMUNICATING == ("all-gather", "all-to-all", "reduce-scatter", "all-reduce")
    latency_bound = CostModel(collective_overhead={"all-gather": 8192, "all-to-all": 8192.0})
    assert latency_bound == CostModel() and hash(latency_bound) == hash(CostModel())
    assert CostModel(collective_overhead=192) != CostModel()
    assert CostModel(collective_overhead=192).collective_overhead == 192
    assert hash(CostModel(collective_overhead=192.0)) == hash(CostModel(collective_overhead=192))
    assert CostModel(collective_overhead=3072.4) == CostModel(collective_overhead=3072) != CostModel()
    assert CostModel(collective_overhead=3072).collective_overhead == 3072
    assert CostModel(collective_overhead=dict.fromkeys(("all-gather", "all-to-all", "reduce-scatter", "all-reduce"), 8)
                     ).collective_overhead == 8
    unmerged = CostModel(collective_overhead={"all-gather": 3072, "all-to-all": 3072})
    assert unmerged.collective_overhead == (3072, 3072, 192, 192)  # all-gather, all-to-all, reduce-scatter, all-reduce
    assert hash(unmerged) == hash(CostModel(collective_overhead={"all-to-all": 3072.0, "all-gather": 3072}))
    # a kind not given keeps the default's figure for it
    assert CostModel(collective_overhead={"all-reduce": 0}).collective_overhead == (8192, 8192, 192, 0)
    assert repr(CostModel()) == repr(latency_bound) == "CostModel({})"
    assert repr(CostModel(collective_overhead=192)) == "CostModel({}, collective_overhead=192)"
    assert repr(CostModel(collective_overhead=3072)) == "CostModel({}, collective_overhead=3072)"
    assert repr(unmerged) == ("CostModel({}, collective_overhead={'all-gather': 3072, 'all-to-all': 3072, "
                              "'reduce-scatter': 192, 'all-reduce': 192})")
    # a pod's interconnect: 5 us per collective, 50 GB/s (tens of KB per collective, every kind)
    pod = CostModel(latency={"dp": 5e-6, "tp": 2e-6}, per_byte={"dp": 2e-11, "tp": 1e-11})
    assert pod.collective_overhead == 250_000
    assert CostModel(latency={"dp": 5e-6}).collective_overhead == DEFAULT_COLLECTIVE_OVERHEAD  # per_byte unknown
    assert CostModel(latency={"dp": 5e-6}, per_byte={"dp": 2e-11}, collective_overhead=0).collective_overhead == 0


@pytest.mark.parametrize("overhead", [-1, float("nan"), float("inf"), {"all-gather": -3}, {"gather": 1}])
def test_bad_collective_overheads_are_value_errors(overhead: object) -> None:
    with pytest.raises(InferenceError, match="collective_overhead") as raised:
        CostModel(collective_overhead=overhead)  # type: ignore[arg-type]
    assert isinstance(raised.value, ValueError) and "Fix:" in str(raised.value)


@pytest.mark.parametrize("weights", [{"dp": -1}, {"dp": float("nan")}, {"dp": True}, {"dp": "fast"}, {1.5: 2}, [("dp", 2)]])
def test_bad_weights_are_argument_errors(weights: object) -> None:
    with pytest.raises(ArgumentTypeError):
        CostModel(weights)  # type: ignore[arg-type]


def test_default_cost_model_can_be_set_and_scoped() -> None:
    assert default_cost_model() == CostModel()
    with use_cost_model({"dp": 3}) as model:
        assert model == CostModel({"dp": 3}) == default_cost_model() == resolve_cost_model(None)
    assert default_cost_model() == CostModel()
    previous = set_default_cost_model(CostModel({"tp": 2}))
    try:
        assert default_cost_model() == CostModel({"tp": 2})
    finally:
        set_default_cost_model(previous)
    assert resolve_cost_model({"x": 2}) == CostModel({"x": 2})


# -- pricing moves by the schedules redistribute runs (predict(policy=)) ------------------------------------

# (mesh shape, tensor shape, source, target): every family of the redistribute catalogue, Partial sources
# (sum and avg), a Partial target, an uneven (padded) source, and moves where the schedules send less than XLA.
PRICED_MOVES = [
    ((8,), (16, 16), "S(0)", "R"),
    ((8,), (16, 16), "S(0)", "S(1)"),
    ((8,), (16, 16), "P", "S(0)"),
    ((8,), (16, 16), "P", "S(1)"),
    ((8,), (16, 16), "P(avg)", "R"),
    ((8,), (16, 16), "R", "P"),
    ((8,), (10, 4), "S(0)", "R"),
    ((4, 2), (16, 16), "S(0),S(1)", "S(1),S(0)"),
    ((4, 2), (16, 16), "S(0),R", "R,S(0)"),
    ((4, 2), (16, 16), "P,R", "S(0),R"),
    ((4, 2), (16, 16), "P,S(0)", "P,S(1)"),
    ((4, 2), (16, 16), "(a,b),None", "None,(b,a)"),
    ((2, 2, 2), (8, 8, 8), "P,P,P", "S(0),S(1),S(2)"),
    ((2, 2, 2), (8, 8, 8), "(a,b,c),None,None", "None,None,(c,b,a)"),
]
_MESH_AXES = {(8,): ("x",), (4, 2): ("a", "b"), (2, 2, 2): ("a", "b", "c")}


@pytest.mark.parametrize(("mesh_shape", "shape", "src", "dst"), PRICED_MOVES)
def test_predict_prices_moves_by_the_schedule_the_policy_runs(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], src: str, dst: str
) -> None:
    """predict(policy=P) prices a move (an identity function with ``out_layouts``) by the
    schedule ``redistribute(policy=P)`` runs: its bytes and collectives equal those read
    from that schedule's compiled HLO. predict(policy=None) keeps the planner's price of
    XLA's reshard (what check compares with a plain jit program)."""
    mesh = init_device_mesh(mesh_shape, _MESH_AXES[mesh_shape])
    source, target = (resolve_layout(mesh, parse_placements_or_alias(t), len(shape)) for t in (src, dst))
    spec = (shape, np.int32, source)
    plain = predict(lambda x: x, spec, out_layouts=target)
    assert plain.policy is None and plain.schedules == ()
    assert plain.nbytes == plan_redistribute(shape, np.int32, source, target).nbytes
    for policy in ("xla", "min_bytes", "cost"):
        prediction = predict(lambda x: x, spec, out_layouts=target, policy=policy)
        schedule = choose(physical(source, shape), physical(target, shape), np.int32, policy)
        compiled = parse_collectives(schedule.jitted.lower(schedule.argument()).compile().as_text())
        assert [s.name for s in prediction.schedules] == [schedule.name]
        assert prediction.nbytes == sent_bytes_per_device(compiled, mesh.size()), (policy, schedule.name)
        assert prediction.collectives == Counter(c.op for c in compiled)
        assert prediction.cost == prediction.nbytes  # every axis weighs 1
        assert f"schedules under policy {policy!r}: {schedule.name}" in str(prediction)


def test_predict_weighs_schedule_bytes_by_the_axis_weights() -> None:
    """Under a policy, ``cost`` weighs each collective's bytes by the largest weight of its
    mesh dims: an all-gather over ``a`` on (4,2) costs 3x its bytes with ``{"a": 3}``."""
    mesh = init_device_mesh((4, 2), ("a", "b"))
    source, target = (resolve_layout(mesh, p, 2) for p in ("S(0),R", "R,R"))
    prediction = predict(lambda x: x, ((16, 16), np.float32, source), out_layouts=target, policy="xla",
                         cost_model={"a": 3})
    assert prediction.nbytes == 16 * 16 * 4 * Fraction(3, 4)
    assert prediction.cost == 3 * prediction.nbytes


def test_predict_refuses_a_bad_policy() -> None:
    mesh = init_device_mesh((8,), ("x",))
    layout = resolve_layout(mesh, "S(0)", 1)
    with pytest.raises(ArgumentTypeError, match="policy="):
        predict(lambda x: x, ((8,), np.float32, layout), policy="fastest")
