"""Strided shards (issue 16): a Layout dim with a split factor from a view, torch's
``_StridedShard(dim, split_factor=f)`` whose factor comes from no mesh dim (``8x16 S(1)``
flattened to ``128`` is ``_StridedShard(0, 8)`` on an 8-wide mesh).

Asserted against torch's own ``_StridedShard`` (its local tensors and its local shapes
and offsets) and NumPy: per-device shards, round trips through ``.placements`` /
``distribute_tensor`` / ``redistribute`` / text, moves to and from every other layout on
(8,) and (4, 2), and that XLA compiles the flatten into the strided layout with no
collective."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from placements2jax import (
    Layout,
    LayoutError,
    Replicate,
    Shard,
    ShapeError,
    StridedShard,
    distribute_tensor,
    init_device_mesh,
    resolve_layout,
)
from placements2jax.physical import physical

torch = pytest.importorskip("torch")
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from placements2jax.interop.torch import from_torch_placements, to_torch_placements  # noqa: E402


@pytest.fixture(scope="module")
def mesh1():
    return init_device_mesh((8,), ("x",))


@pytest.fixture(scope="module")
def mesh2():
    return init_device_mesh((4, 2), ("dp", "tp"))


def _torch_locals(value: np.ndarray, placements: list, mesh) -> dict[int, np.ndarray]:
    """Every rank's local tensor under torch placements (torch's own _split_tensor)."""
    result = {}
    for rank in mesh.rank_list:
        local = torch.from_numpy(value)
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, (torch.distributed.tensor.Shard, _StridedShard)):
                pieces = p._split_tensor(local, mesh.shape[mesh_dim], with_padding=False)[0]
                local = pieces[mesh.get_coordinate(rank)[mesh_dim]]
        result[rank] = local.numpy()
    return result


def _shards(d, mesh) -> dict[int, np.ndarray]:
    by_device = {s.device: np.asarray(s.data) for s in d.array.addressable_shards}
    return {r: by_device[mesh.device(r)] for r in mesh.rank_list}


CASES = [  # (mesh fixture, shape, torch placements)
    ("mesh1", (128,), [_StridedShard(0, split_factor=8)]),
    ("mesh1", (32, 16), [_StridedShard(0, split_factor=4)]),
    ("mesh1", (4, 64), [_StridedShard(1, split_factor=2)]),
    ("mesh2", (32, 16), [_StridedShard(0, split_factor=4), torch.distributed.tensor.Replicate()]),
    ("mesh2", (32, 16), [_StridedShard(0, split_factor=2), torch.distributed.tensor.Shard(1)]),
    ("mesh2", (8, 32), [torch.distributed.tensor.Shard(0), _StridedShard(1, split_factor=4)]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_shards_are_torch_s_local_tensors(case: int, request) -> None:
    name, shape, placements = CASES[case]
    mesh = request.getfixturevalue(name)
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    d = distribute_tensor(value, mesh, placements)
    assert d.layout.is_strided
    expected = _torch_locals(value, placements, mesh)
    shards = _shards(d, mesh)
    for rank in mesh.rank_list:
        np.testing.assert_array_equal(shards[rank], expected[rank])
        theirs = _compute_local_shape_and_global_offset(shape, mesh.shape, list(mesh.get_coordinate(rank)), placements)
        assert d.layout.local_shape_and_offset(shape, rank) == (tuple(theirs[0]), tuple(theirs[1]))
    np.testing.assert_array_equal(np.asarray(d.full_tensor()), value)
    # round trips: torch placements, ours, text, pickling
    assert list(to_torch_placements(d.layout)) == placements
    assert from_torch_placements(mesh, placements).bind(len(shape)) is d.layout
    assert resolve_layout(mesh, d.placements, len(shape)) is d.layout
    assert resolve_layout(mesh, str(d.layout), len(shape)) is d.layout
    assert pickle.loads(pickle.dumps(d.layout)) is d.layout
    assert distribute_tensor(value, mesh, d.placements).layout is d.layout


@pytest.mark.parametrize("name", ["mesh1", "mesh2"])
def test_redistribute_to_and_from_every_layout(name: str, request) -> None:
    mesh = request.getfixturevalue(name)
    shape = (32, 16)
    value = np.arange(512, dtype=np.float32).reshape(shape)
    strided = [c for c in CASES if c[0] == name and c[1] == shape]
    others = [x for x in _layouts(mesh, 2)]
    for _, _, placements in strided:
        d = distribute_tensor(value, mesh, placements)
        for target in others:
            moved = d.redistribute(mesh, target.placements)
            assert moved.layout is target
            np.testing.assert_array_equal(np.asarray(moved.full_tensor()), value)
            back = moved.redistribute(mesh, d.placements)
            assert back.layout is d.layout
            for rank, shard in _shards(back, mesh).items():
                np.testing.assert_array_equal(shard, _shards(d, mesh)[rank])


def _layouts(mesh, ndim: int) -> list[Layout]:
    """Every layout without partials of an ``ndim``-d tensor (a few per mesh)."""
    from placements2jax.layout import iter_layouts

    return [x for x in iter_layouts(mesh, ndim)][:: 1 if mesh.ndim == 1 else 3]


def test_a_partial_strided_layout_reduces_right(mesh2) -> None:
    value = np.arange(512, dtype=np.float32).reshape(32, 16)
    layout = Layout(mesh2, ((0,), ()), ("sum", None)[::-1], split_factors=(4, 1))
    assert str(layout) == "_S(0, 4),P"
    d = distribute_tensor(value, mesh2, layout.placements)
    np.testing.assert_allclose(np.asarray(d.full_tensor()), value)
    np.testing.assert_allclose(np.asarray(d.redistribute(mesh2, "S(1),R").full_tensor()), value)


def test_xla_flattens_into_the_strided_layout_without_collectives(mesh1) -> None:
    """The flatten torch keeps strided is a reshape/transpose/reshape of the physical array
    that XLA compiles to no collective, and its shards are the strided layout's."""
    value = np.arange(128, dtype=np.float32).reshape(8, 16)
    x = distribute_tensor(value, mesh1, [Shard(1)])
    layout = resolve_layout(mesh1, [StridedShard(0, split_factor=8)], 1)
    target = physical(layout, (128,))

    def flatten(a):
        return a.reshape(8, 8, 2).transpose(1, 0, 2).reshape(128)

    jax_mesh = mesh1.to_jax()
    run = jax.jit(lambda a: jax.sharding.auto_axes(flatten, out_sharding=target.sharding)(a)
                  if jax_mesh.are_all_axes_explicit else flatten(a), out_shardings=target.sharding)
    hlo = run.lower(x.array).compile().as_text()
    assert not any(c in hlo for c in ("all-to-all", "all-gather", "collective-permute", "all-reduce"))
    y = distribute_tensor(value.reshape(128), mesh1, layout.placements)
    out = run(x.array)
    for s, t in zip(out.addressable_shards, y.array.addressable_shards):
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(t.data))
    assert isinstance(target.sharding, NamedSharding) and target.sharding.spec == PartitionSpec("x")


def test_bad_strided_layouts_are_refused(mesh1, mesh2) -> None:
    with pytest.raises(ShapeError, match="divisible by 16"):
        distribute_tensor(np.zeros(120, np.float32), mesh1, [_StridedShard(0, split_factor=2)])
    with pytest.raises(LayoutError, match="exactly one mesh dim"):
        Layout(mesh2, ((0, 1), ()), None, split_factors=(2, 1))
    with pytest.raises(LayoutError, match="2 factors for a 1-d layout"):
        Layout(mesh1, ((0,),), None, split_factors=(2, 1))
    with pytest.raises(LayoutError, match="not one block"):
        resolve_layout(mesh1, "_S(0, 2)", 1).local_slices((16,), 0)
    with pytest.raises(LayoutError, match="no sharding for a strided shard"):
        resolve_layout(mesh1, "_S(0, 2)", 1).named_sharding
    assert Layout(mesh1, ((0,),), None, split_factors=(1,)) is resolve_layout(mesh1, [Shard(0)], 1)
    assert Layout(mesh1, ((),), None, split_factors=(1,)) is resolve_layout(mesh1, [Replicate()], 1)


def test_a_strided_dtensor_reads_and_runs_ops(mesh1) -> None:
    value = np.arange(128, dtype=np.float32)
    d = distribute_tensor(value, mesh1, "_S(0, 8)")
    assert repr(d).startswith("DTensor([0., 1., 2., 3., 4., 5., ...], shape=(128,)")
    np.testing.assert_array_equal(np.asarray(d.to_local()), value.reshape(8, 8, 2)[:, 0].reshape(16))
    np.testing.assert_array_equal(np.asarray(d.to_jax()), value)
    assert d.sharding is None  # no NamedSharding says a strided shard
    # Inference carries the split factor (the planner unstrides it first): NumPy's values.
    np.testing.assert_array_equal(np.asarray((d + d).full_tensor()), 2 * value)
    plain = d.redistribute(mesh1, [Shard(0)])
    np.testing.assert_array_equal(np.asarray((plain + plain).full_tensor()), 2 * value)


@st.composite
def _strided_cases(draw):  # noqa: ANN001, ANN202
    """A mesh, a 2-d shape, torch placements with one view split factor, a plain target."""
    name = draw(st.sampled_from(["mesh1", "mesh2"]))
    mesh_shape = (8,) if name == "mesh1" else (4, 2)
    dim = draw(st.integers(0, 1))
    factor = draw(st.sampled_from([2, 3, 4]))
    strided_on = draw(st.integers(0, len(mesh_shape) - 1))
    shape = [draw(st.sampled_from([2, 3, 4])) for _ in range(2)]
    shape[dim] = factor * mesh_shape[strided_on] * draw(st.integers(1, 2))
    placements: list = [torch.distributed.tensor.Replicate()] * len(mesh_shape)
    placements[strided_on] = _StridedShard(dim, split_factor=factor)
    if len(mesh_shape) == 2 and draw(st.booleans()) and shape[1 - dim] % mesh_shape[1 - strided_on] == 0:
        placements[1 - strided_on] = torch.distributed.tensor.Shard(1 - dim)
    target = draw(st.sampled_from(["R", "S(0)", "S(1)"] if name == "mesh1" else ["R,R", "S(0),R", "R,S(1)", "S(1),S(0)"]))
    return name, tuple(shape), placements, target


@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_strided_cases())
def test_property_strided_shards_match_torch_and_move_exactly(case, request) -> None:  # noqa: ANN001
    name, shape, placements, target = case
    mesh = request.getfixturevalue(name)
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    d = distribute_tensor(value, mesh, placements)
    expected = _torch_locals(value, placements, mesh)
    for rank, shard in _shards(d, mesh).items():
        np.testing.assert_array_equal(shard, expected[rank])
    moved = d.redistribute(mesh, target)
    np.testing.assert_array_equal(np.asarray(moved.full_tensor()), value)
    for rank, shard in _shards(moved.redistribute(mesh, placements), mesh).items():
        np.testing.assert_array_equal(shard, expected[rank])
