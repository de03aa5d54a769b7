"""Interning of DeviceMesh and Layout, and clear_caches() (placements2jax/caches.py)."""

from __future__ import annotations

import gc

import numpy as np

import placements2jax
from placements2jax import DeviceMesh, Layout, Shard, clear_caches, distribute_tensor, init_device_mesh, resolve_layout
from placements2jax import caches, layout, operators, physical


def test_meshes_are_interned() -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    assert DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp")) is mesh
    assert DeviceMesh(np.arange(8).reshape(4, 2), mesh_dim_names=("dp", "tp")) is mesh
    assert DeviceMesh.from_jax(mesh.to_jax()) is mesh
    assert init_device_mesh((4, 2), ("dp", "tp"), axis_types="auto") is not mesh
    assert init_device_mesh((4, 2), ("dp", "sp")) is not mesh
    assert hash(mesh) == object.__hash__(mesh)  # identity: hashing never walks the ranks


def test_layouts_are_interned_and_weakly_held() -> None:
    mesh = init_device_mesh((2, 2), ("a", "b"))
    first = Layout(mesh, ((0, 1), ()), (None, None))
    assert Layout.from_device_mesh(mesh)("(a,b),None") is first
    assert Layout.from_device_mesh(mesh)([("a", "b"), None]) is first
    assert hash(first) == object.__hash__(first)
    # a layout no other test (or cache) holds: on a mesh of its own
    alone = DeviceMesh([3, 5], ("held_weakly",))
    key = (alone, ((0,),), (None,))
    made = Layout(alone, ((0,),))
    assert Layout._interned[key] is made
    del made
    gc.collect()
    assert key not in Layout._interned  # nothing holds it: gone


def test_an_equal_bool_or_numpy_entry_is_still_validated() -> None:
    mesh = init_device_mesh((2,), ("a",))
    valid = Layout(mesh, ((0,),))
    for bad in (((False,),), ((np.int64(0),),)):
        try:
            Layout(mesh, bad)
        except placements2jax.LayoutError:
            continue
        raise AssertionError(f"{bad} was accepted because it equals {valid.dim_axes}")


def test_a_new_layout_from_tuples_is_validated_as_one_from_lists() -> None:
    """Tuples of tuples of ints (the planners' tables) skip the conversion, not the checks."""
    mesh = DeviceMesh([[0, 1], [2, 3]], ("fresh_a", "fresh_b"))
    made = Layout(mesh, ((1,), (0,)), (None, None))
    assert made is Layout(mesh, [[1], [0]], [None, None]) and made.dim_axes == ((1,), (0,))
    bad_tables = [
        (((0,), (0,)), (None, None)),  # one mesh dim splitting two tensor dims
        (((0,), (2,)), (None, None)),  # no mesh dim 2
        (((0,), ()), ("sum", None)),  # mesh dim 0 both splits and is partial
        (((0,), ()), (None, "bogus")),  # no such reduce op
        (((0,), ()), (None,)),  # one partial entry per mesh dim
    ]
    for dim_axes, partial in bad_tables:
        try:
            Layout(mesh, dim_axes, partial)
        except (placements2jax.LayoutError, placements2jax.PlacementError):
            continue
        raise AssertionError(f"{dim_axes}, {partial} was accepted")


def test_clear_caches_empties_every_registered_cache() -> None:
    mesh = init_device_mesh((4,), ("x",))
    x = distribute_tensor(np.arange(8, dtype=np.float32), mesh, "S(0)")
    (x + x).redistribute(placements="R")
    assert layout._resolved and operators._dispatched and physical.physical.cache_info().currsize
    assert clear_caches is caches.clear_caches and "clear_caches" in placements2jax.__all__
    clear_caches()
    assert not layout._resolved and not operators._dispatched
    assert physical.physical.cache_info().currsize == 0
    assert operators._named_program.cache_info().currsize == 0
    # and everything still works, cold
    np.testing.assert_array_equal(np.asarray((x + x).full_tensor()), 2 * np.arange(8))
    assert x.layout is resolve_layout(mesh, (Shard(0),), 1)


def test_memo_is_bounded_registered_and_takes_any_key() -> None:
    memo = caches.Memo(2)
    memo.remember(("a",), 1)
    memo.remember(["unhashable"], 2)  # not stored, and no error
    assert memo.recall(("a",)) == 1 and memo.recall(["unhashable"]) is None and len(memo) == 1
    memo.remember(("b",), 2)
    memo.remember(("c",), 3)  # full: emptied first
    assert dict(memo) == {("c",): 3}
    clear_caches()
    assert not memo


def test_local_map_programs_are_cleared() -> None:
    from placements2jax import func_map

    mesh = init_device_mesh((4,), ("x",))
    x = distribute_tensor(np.arange(8, dtype=np.float32), mesh, "S(0)")
    doubled = placements2jax.local_map(lambda a: a * 2, out_placements=[Shard(0)])(x)
    np.testing.assert_array_equal(np.asarray(doubled.full_tensor()), 2 * np.arange(8))
    assert func_map._PROGRAMS
    clear_caches()
    assert not func_map._PROGRAMS


def test_hash_once_hashes_what_the_dataclass_hash_would() -> None:
    """:func:`caches.hash_once` reads the hashed fields from the dataclass (one field, a
    field not compared, a field compared but not hashed) and stores the hash (kept out of
    the pickled state: tests/test_inference_cost.py)."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class One:
        a: int

    @dataclasses.dataclass(frozen=True)
    class Plain:
        a: int
        b: str
        c: object = dataclasses.field(default=None, compare=False)
        d: int = dataclasses.field(default=0, hash=False)

    @dataclasses.dataclass(frozen=True)
    class Once(Plain):
        __hash__ = caches.hash_once()

    @dataclasses.dataclass(frozen=True)
    class OneOnce:
        a: int
        __hash__ = caches.hash_once()

    assert hash(OneOnce(3)) == hash(One(3)) == hash((3,))
    value = Once(1, "x", c=object(), d=5)
    assert hash(value) == hash(Plain(1, "x", d=7)) == hash((1, "x")) and value.__dict__["_hash"] == hash((1, "x"))
