"""Collective schedules for redistribute (placements2jax.schedules): every candidate is exact
and never sends fewer bytes than the lower bound; the policies choose as documented."""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import (
    CostModel,
    DeviceMesh,
    DTensor,
    Layout,
    distribute_tensor,
    init_device_mesh,
    redistribute_collectives,
    resolve_layout,
)
from placements2jax.errors import ArgumentTypeError
from placements2jax.layout import iter_layouts
from placements2jax.physical import physical
from placements2jax.programs import check_redistribute
from placements2jax.schedules import (
    DirectSchedule,
    candidates,
    choose,
    _MARGIN,
    default_policy,
    policy_model,
    redistribute_schedule,
    sent_bytes_per_device,
    use_policy,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bounds import lower_bound_bytes  # noqa: E402  (the bound is independent of the schedules)

MESHES = {(8,): ("x",), (4, 2): ("a", "b"), (2, 4): ("a", "b"), (2, 2, 2): ("a", "b", "c")}
OPS = ("sum", "avg", "max", "min")
LATENCY_BOUND = CostModel(latency={0: 1.0, 1: 1.0, 2: 1.0}, per_byte={0: 1e-12, 1: 1e-12, 2: 1e-12})
BANDWIDTH_BOUND = CostModel(latency={0: 1e-12, 1: 1e-12, 2: 1e-12}, per_byte={0: 1.0, 1: 1.0, 2: 1.0}, copy_per_byte=1e-6)


def _mesh(shape: tuple[int, ...]):
    return init_device_mesh(shape, MESHES[shape])


def _partial_source(layout: Layout, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[DTensor, np.ndarray]:
    """A DTensor of ``layout`` whose partial contributions differ per partial coordinate
    (random int32), and its logical value computed in NumPy."""
    mesh = layout.mesh
    partial = layout.partial_axes
    contributions = {}
    locals_ = {}
    for rank in mesh.rank_list:
        coord = mesh.get_coordinate(rank)
        key = tuple(coord[a] for a in partial)
        if key not in contributions:
            contributions[key] = rng.integers(-1000, 1000, size=shape, dtype=np.int32)
        locals_[rank] = contributions[key][layout.local_slices(shape, rank)]
    values = np.stack(list(contributions.values()))
    op = layout.partial_op
    if op is None:
        expected = values[0]
    elif op == "sum":
        expected = values.sum(axis=0, dtype=np.int32)
    elif op == "avg":
        expected = np.floor_divide(values.sum(axis=0, dtype=np.int64), len(values)).astype(np.int32)
    else:
        expected = getattr(values, op)(axis=0)
    return DTensor.from_local(locals_, mesh, layout, shape=shape), expected


@st.composite
def moves(draw: st.DrawFn) -> tuple[Layout, Layout, tuple[int, ...], int]:
    mesh_shape = draw(st.sampled_from(sorted(MESHES)))
    mesh = _mesh(mesh_shape)
    ndim = draw(st.integers(1, 3 if len(mesh_shape) < 3 else 2))
    shape = tuple(draw(st.sampled_from((8, 16, 4, 12, 6))) for _ in range(ndim))
    op = draw(st.sampled_from(OPS))
    sources = iter_layouts(mesh, ndim, partial_ops=(op,))
    src = draw(st.sampled_from(sources))
    targets = [t for t in iter_layouts(mesh, ndim, partial_ops=(op,)) if not t.has_partial or t.partial == src.partial]
    dst = draw(st.sampled_from(targets))
    seed = draw(st.integers(0, 2**16))
    return src, dst, shape, seed


def _check_move(src: Layout, dst: Layout, shape: tuple[int, ...], seed: int) -> list[str]:
    check_redistribute(src, dst)
    dt, expected = _partial_source(src, shape, np.random.default_rng(seed))
    a, b = physical(src, shape), physical(dst, shape)
    if a == b:
        return []
    bound = lower_bound_bytes(src, dst, shape, 4)
    names = []
    for schedule in candidates(a, b, np.int32):
        names.append(schedule.name)
        out = DTensor(schedule.jitted(dt.array), dst, shape)
        if dst.has_partial:
            np.testing.assert_array_equal(np.asarray(out.full_tensor()), expected, err_msg=schedule.name)
        else:
            for rank in dst.mesh.rank_list:
                np.testing.assert_array_equal(
                    np.asarray(out.to_local(rank)), expected[dst.local_slices(shape, rank)],
                    err_msg=f"{schedule.name} rank {rank}: {src} -> {dst} {shape}",
                )
        compiled = sent_bytes_per_device(schedule.compiled_collectives, dst.mesh.size())
        assert compiled >= bound, (schedule.name, str(src), str(dst), shape, compiled, bound)
        # The bounds choose() prunes with hold (direct+xla: its reduction step is compiled as written).
        assert schedule.least_nbytes <= schedule.nbytes, (schedule.name, str(src), str(dst), shape)
        for model in (policy_model(dst.mesh), BANDWIDTH_BOUND):
            assert schedule.least_seconds(model) <= schedule.seconds(model), (schedule.name, str(src), str(dst), shape)
        if schedule.name == "direct":
            assert compiled == schedule.nbytes, (str(src), str(dst), shape)  # the prediction is what XLA compiles
    return names


@given(moves())
def test_every_schedule_is_exact_and_never_below_the_bound(move: tuple[Layout, Layout, tuple[int, ...], int]) -> None:
    _check_move(*move)


@pytest.mark.parametrize(
    "mesh_shape, src, dst",
    [
        ((8,), "P", "S(0)"),
        ((4, 2), "P,R", "R,R"),
        ((4, 2), "P,R", "S(0),R"),
        ((4, 2), "S(0),S(1)", "S(1),S(0)"),
        ((4, 2), "S(0),R", "R,S(0)"),
        ((4, 2), "(a,b),None", "None,(b,a)"),
        ((2, 2, 2), "(a,b),c,None", "c,(a,b),None"),
        ((2, 2, 2), "P,S(0),R", "S(1),S(0),R"),
    ],
)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_direct_schedules_reach_the_bound(mesh_shape: tuple[int, ...], src: str, dst: str, op: str) -> None:
    """The moves where XLA sends more than the bound (docs/benchmarks.md, benchmark 4):
    the direct schedule sends exactly the bound, for sum and max partials alike."""
    mesh = _mesh(mesh_shape)
    shape = (16, 16) if len(mesh_shape) < 3 else (8, 8, 8)
    source = resolve_layout(mesh, src.replace("P", f"P({op})") if "P" in src else src, len(shape))
    target = resolve_layout(mesh, dst, len(shape))
    names = _check_move(source, target, shape, 0)
    assert "direct" in names
    schedule = choose(physical(source, shape), physical(target, shape), np.int32, "min_bytes")
    assert schedule is redistribute_schedule(shape, np.int32, source, target, "min_bytes")
    assert schedule.name.startswith("direct")
    assert schedule.nbytes == lower_bound_bytes(source, target, shape, 4)


@pytest.mark.parametrize(
    "mesh_shape, src, dst, shape, xla_ratio",
    [
        ((8,), "S(0)", "R", (10, 4), 1.6),
        ((8,), "S(0)", "S(1)", (10, 12), 2.24),
        ((4, 2), "S(0),R", "R,S(0)", (10,), 1.5),
        ((4, 2), "(a,b),None", "None,(b,a)", (10, 6), 16),
        ((2, 2, 2), "S(0),S(1),S(2)", "S(2),S(1),S(0)", (3, 5, 6), 1.6),
        ((4, 2), "P(max),S(0)", "P(max),S(1)", (5, 10), 1),
        ((8,), "P", "S(0)", (10, 8), 2),
        ((8,), "P(avg)", "S(0)", (10,), 4),
        ((4, 2), "P(min),P(min)", "S(0),S(1)", (6, 5), 2.8),
        ((2, 2, 2), "P,S(0),R", "S(1),S(0),R", (3, 5), 2.6),
    ],
)
def test_uneven_moves_reach_the_bound(
    mesh_shape: tuple[int, ...], src: str, dst: str, shape: tuple[int, ...], xla_ratio: float
) -> None:
    """Uneven (padded) blocks are cut into cells dividing every block boundary: the direct
    schedule is exact (padding zeroed) and sends the bound, where XLA's reshard of the
    padded arrays sends up to 16x of it. Partial sources reduced into uneven blocks
    (sum, integer avg, min) get each other coordinate's contribution to every cell once."""
    mesh = _mesh(mesh_shape)
    source, target = (resolve_layout(mesh, p, len(shape)) for p in (src, dst))
    assert not (source.is_even(shape) and target.is_even(shape))
    assert "direct" in _check_move(source, target, shape, 5)
    bound = lower_bound_bytes(source, target, shape, 4)
    schedule = choose(physical(source, shape), physical(target, shape), np.int32, "min_bytes")
    assert schedule.name == "direct" and schedule.nbytes == bound
    xla = choose(physical(source, shape), physical(target, shape), np.int32, "xla")
    assert xla.nbytes >= bound * Fraction(str(xla_ratio))
    array = _partial_source(source, shape, np.random.default_rng(0))[0].array
    # The physical arrays agree, padding included (XLA's reshard pads with zeros).
    np.testing.assert_array_equal(np.asarray(schedule.jitted(array)), np.asarray(xla.jitted(array)))


def test_refused_moves_use_xla() -> None:
    """An uneven dim cut into more than 64 cells per block, new partial dims in the target
    (alone or next to reduced ones): only XLA's reshard is a candidate
    (docs/redistribute.md says why)."""
    mesh = _mesh((4, 2))

    def move(src: str, dst: str, shape: tuple[int, ...]) -> tuple[Any, Any]:
        return tuple(physical(resolve_layout(mesh, p, len(shape)), shape) for p in (src, dst))

    for src, dst in (move("S(0),R", "R,S(0)", (1001,)), move("P,R", "S(0),R", (1001,)),
                     move("R,S(0)", "P,S(0)", (8, 8)), move("P,R", "R,P", (8, 8))):
        assert DirectSchedule.build(src, dst) is None
        assert [s.name for s in candidates(src, dst, np.int32)] == ["xla"]


@pytest.mark.parametrize("ranks", [8, 1])
def test_a_partial_scalar_is_reduced_by_xla(ranks: int) -> None:
    """A 0-d Partial has no dim to reduce-scatter on: no direct schedule, XLA's all-reduce,
    exact (hypothesis found the 1-device case crashing the direct schedule's builder)."""
    mesh = init_device_mesh((ranks,), ("x",))
    src, dst = resolve_layout(mesh, "P", 0), resolve_layout(mesh, "R", 0)
    assert DirectSchedule.build(physical(src, ()), physical(dst, ())) is None
    dtensor, value = _partial_source(src, (), np.random.default_rng(0))
    np.testing.assert_array_equal(np.asarray(dtensor.redistribute(mesh, dst).full_tensor()), value)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_kept_partials_move_within_their_coordinate(op: str) -> None:
    """A partial kept by the move (same mesh dims, same op) moves like a plain tensor among
    the devices of each coordinate on its mesh dims: the direct schedule is exact and sends
    the bound, where XLA's reshard sends 5/3 of it for (b,c),None -> None,(c,b) with
    Partial on a, on (2,2,2)."""
    mesh = _mesh((2, 2, 2))
    shape = (8, 8)
    src = Layout(mesh, ((1, 2), ()), (op, None, None))
    dst = Layout(mesh, ((), (2, 1)), (op, None, None))
    assert "direct" in _check_move(src, dst, shape, 3)
    by_name = {s.name: s for s in candidates(physical(src, shape), physical(dst, shape), np.int32)}
    bound = lower_bound_bytes(src, dst, shape, 4)
    assert by_name["direct"].nbytes == bound and by_name["xla"].nbytes == bound * 5 / 3
    assert choose(physical(src, shape), physical(dst, shape), np.int32, "min_bytes").name == "direct"


def test_policies_and_visibility() -> None:
    mesh = _mesh((8,))
    x = np.arange(64, dtype=np.int32).reshape(8, 8)
    dt = distribute_tensor(x, mesh, "P")
    assert [c.op for c in redistribute_collectives(dt, "S(0)", policy="xla")] == ["all-reduce"]
    assert [c.op for c in redistribute_collectives(dt, "S(0)", policy="min_bytes")] == ["reduce-scatter"]
    with use_policy("min_bytes"):
        assert default_policy() == "min_bytes"
        assert [c.op for c in redistribute_collectives(dt, "S(0)")] == ["reduce-scatter"]
    assert default_policy() == "cost"
    for policy in ("xla", "min_bytes", "cost", CostModel(latency={"x": 1e-3}, per_byte={"x": 1e-9})):
        eager = dt.redistribute(mesh, "S(0)", policy=policy)
        jitted = jax.jit(lambda d, policy=policy: d.redistribute(mesh, "S(0)", policy=policy))(dt)
        np.testing.assert_array_equal(np.asarray(eager.full_tensor()), x)
        np.testing.assert_array_equal(np.asarray(jitted.full_tensor()), x)
        for rank in mesh.rank_list:
            np.testing.assert_array_equal(np.asarray(eager.to_local(rank)), x[rank : rank + 1])


def test_the_cost_policy_weighs_latency_against_bytes() -> None:
    """A latency-bound model keeps XLA's one all-reduce for P,R -> S(0),R on (4,2); a
    bandwidth-bound one takes the direct schedule that sends 0.5 T instead of 1.5 T."""
    mesh = _mesh((4, 2))
    src = physical(resolve_layout(mesh, "P,R", 2), (64, 64))
    dst = physical(resolve_layout(mesh, "S(0),R", 2), (64, 64))
    latency_bound = CostModel(latency={"a": 1.0, "b": 1.0}, per_byte={"a": 1e-12, "b": 1e-12})
    bandwidth_bound = CostModel(latency={"a": 1e-12, "b": 1e-12}, per_byte={"a": 1.0, "b": 1.0}, copy_per_byte=1e-6)
    assert choose(src, dst, np.int32, latency_bound).name == "xla"
    chosen = choose(src, dst, np.int32, bandwidth_bound)
    assert chosen.name.startswith("direct") and chosen.nbytes == math.prod((64, 64)) * 4 // 2  # 0.5 T


def test_the_cost_policy_compiles_only_schedules_that_can_win() -> None:
    """A schedule whose lower bound (its known collectives and local copies) reaches XLA's
    price times the margin is dropped uncompiled, and the choice is the one pricing every
    schedule gives: under a latency-bound model neither direct schedule is compiled."""
    mesh = _mesh((4, 2))
    # Shapes no other test uses: the cached candidates are compiled here first.
    moves = [("P,R", "S(0),R", (64, 10)), ("P(max),R", "R,S(0)", (8, 10)), ("P,S(1)", "S(0),R", (8, 10)),
             ("P,R", "S(1),S(0)", (8, 10))]
    for source, target, shape in moves:
        src, dst = physical(resolve_layout(mesh, source, 2), shape), physical(resolve_layout(mesh, target, 2), shape)
        options = candidates(src, dst, np.int32)
        assert [s.name for s in options[1:]] and not any("compiled" in vars(s) for s in options[1:])
        for model in (LATENCY_BOUND, BANDWIDTH_BOUND, policy_model(mesh)):
            chosen = choose(src, dst, np.int32, model)
            if model is LATENCY_BOUND and source != "P,S(1)":
                assert chosen.name == "xla" and not any("compiled" in vars(s) for s in options[1:]), (source, target)
            # Pricing every schedule (the rule without the bound):
            xla = options[0]
            fewer = [s for s in options if s is xla or (s.name != "stepwise" and s.nbytes < xla.nbytes)]
            best = min(fewer, key=lambda s: (s.seconds(model), s.nbytes))
            assert chosen is (xla if best.seconds(model) >= xla.seconds(model) * _MARGIN else best), (source, target)
        assert choose(src, dst, np.int32, BANDWIDTH_BOUND).name.startswith("direct")


def test_schedule_terms_on_a_permuted_mesh_are_the_compiled_axes() -> None:
    """On a mesh whose ranks are column-major, a direct schedule's predicted collectives (mesh
    positions) and XLA's compiled ones are read along the same mesh axes, and those are the
    axes the move communicates on: the reduction of P,R -> S(0),R runs over "a"."""
    mesh = DeviceMesh(np.arange(8).reshape(2, 4).T, ("a", "b"))  # rank r at (r % 4, r // 4)
    src = physical(resolve_layout(mesh, "P,R", 2), (64, 64))
    dst = physical(resolve_layout(mesh, "S(0),R", 2), (64, 64))
    direct = choose(src, dst, np.int32, "min_bytes")
    assert direct.name.startswith("direct")
    predicted = [c.mesh_axes(mesh) for c in direct.collectives]
    assert predicted == [c.mesh_axes(mesh) for c in direct.compiled_collectives]
    assert predicted[0] == ("a",) and direct.terms[0][0] == (0,)
    xla = choose(src, dst, np.int32, "xla")
    assert [c.mesh_axes(mesh) for c in xla.collectives] == [("a",)]
    x = np.arange(64 * 64, dtype=np.int32).reshape(64, 64)
    for policy in ("min_bytes", "xla"):
        moved = distribute_tensor(x, mesh, "P,R").redistribute(mesh, "S(0),R", policy=policy)
        np.testing.assert_array_equal(np.asarray(moved.full_tensor()), x)


def test_bad_policy() -> None:
    mesh = _mesh((8,))
    dt = distribute_tensor(np.ones((8, 8), np.float32), mesh, "S(0)")
    with pytest.raises(ArgumentTypeError, match="policy="):
        dt.redistribute(mesh, "R", policy="fastest")
