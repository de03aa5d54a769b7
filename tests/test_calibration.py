"""inference.calibration and the calibrated cost model: fitting and pricing, with fake timers
(nothing here times a program, except one tiny smoke run of the real programs)."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import resolve_layout, schedules
from placements2jax.inference import calibration
from placements2jax.inference.calibration import KINDS, curve_seconds, fit_curve, measure_curves, pool_latency
from placements2jax.inference.cost import CostModel
from placements2jax.mesh import DeviceMesh
from placements2jax.physical import physical
from placements2jax.schedules import choose

# A fake backend: per kind, seconds = latency + bytes sent * per_byte; a program of ``count``
# collectives also pays a launch cost; fresh buffers beyond 32 MiB cost 10 ns a byte.
LATENCY = 300e-6  # a rendezvous of 8 device threads on a loaded 2-core machine
LAUNCH = 300e-6
PER_BYTE = {"all-gather": 1e-9, "all-reduce": 2e-9, "reduce-scatter": 1e-9, "all-to-all": 4e-9,
            "collective-permute": 1e-9, "copy": 0.5e-9}


def fake_timer(outlier_every: int = 0):
    calls = [0]

    def timer(kind: str, axis: str, nbytes: int, count: int) -> float:
        calls[0] += 1
        if outlier_every and calls[0] % outlier_every == 0:
            return 1.0  # another process stole the cores for a second
        if kind == "fresh":
            return LAUNCH + nbytes * PER_BYTE["copy"] + max(nbytes - (32 << 20), 0) * 10e-9
        n = {"a": 4, "b": 2}.get(axis, 8)  # the axes of the tests' meshes
        sent = calibration.sent_per_device(kind, nbytes, n) if kind != "copy" else nbytes
        return LAUNCH + count * (LATENCY + sent * PER_BYTE[kind])

    return timer


@pytest.fixture(scope="module")
def mesh() -> DeviceMesh:
    return DeviceMesh(np.arange(8).reshape(4, 2), ("a", "b"))


def test_fit_curve_takes_medians_and_is_non_decreasing() -> None:
    curve = fit_curve([(1000.0, [3.0, 1.0, 2.0]), (10.0, [5.0, 5.0, 4.0]), (100.0, [0.5, 9.0, 0.6])])
    assert [x for x, _ in curve] == [10.0, 100.0, 1000.0]  # sorted by bytes
    assert curve[0][1] == 5.0  # the median, not the outliers
    assert all(b[1] >= a[1] for a, b in zip(curve, curve[1:]))  # a larger message never takes less time


def test_curve_seconds_interpolates_and_extrapolates_monotonically() -> None:
    curve = ((1000.0, 1e-4), (10_000.0, 2e-4), (100_000.0, 1.1e-3))
    assert curve_seconds(curve, 10.0) == 1e-4  # latency below the first point
    assert curve_seconds(curve, 10_000.0) == pytest.approx(2e-4)
    assert curve_seconds(curve, 55_000.0) == pytest.approx(6.5e-4)
    # past the last point: the last segment's per-byte time (1e-8 s per byte)
    assert curve_seconds(curve, 1_100_000.0) == pytest.approx(1.1e-3 + 1e6 * 1e-8)
    grid = np.geomspace(1, 1e9, 200)
    values = [curve_seconds(curve, float(x)) for x in grid]
    assert all(b >= a for a, b in zip(values, values[1:]))


@given(st.lists(st.tuples(st.integers(1, 1 << 30), st.lists(st.floats(0, 10), min_size=1, max_size=5)),
                min_size=1, max_size=6))
def test_any_fitted_curve_prices_more_bytes_no_cheaper(points) -> None:
    curve = fit_curve(points)
    assert [x for x, _ in curve] == sorted({float(x) for x, _ in points})
    sizes = sorted({0.0, *(x for x, _ in curve), *(x * 1.5 for x, _ in curve), 1e12})
    values = [curve_seconds(curve, x) for x in sizes]
    assert all(v > 0 for v in values) and all(b >= a for a, b in zip(values, values[1:]))


def test_measure_curves_recovers_latency_and_bandwidth_per_kind(mesh) -> None:
    curves = measure_curves(mesh, repeats=3, timer=fake_timer())
    assert curves.keys() == {"a", "b"} and all(table.keys() == set(KINDS) for table in curves.values())
    n = {"a": 4, "b": 2}
    for axis, table in curves.items():
        for kind, curve in table.items():
            # the launch cost cancels; each point is one collective's time at its size (the
            # smallest size's: the kinds' median, one latency per axis)
            for x, seconds in curve[1:]:
                assert seconds == pytest.approx(LATENCY + x * PER_BYTE[kind], rel=1e-6)
            firsts = [LATENCY + c[0][0] * PER_BYTE[k] for k, c in table.items()]
            assert curve[0][1] == pytest.approx(statistics.median(firsts), rel=1e-6)
            assert curve[-1][0] == calibration.sent_per_device(kind, calibration.SIZES[-1], n[axis])
    # the kinds' bandwidths differ: 64 MiB by all-to-all costs four times a permute's bytes
    big = 64 << 20
    table = curves["a"]
    assert curve_seconds(table["all-to-all"], big) > 3 * curve_seconds(table["collective-permute"], big)


def test_measure_curves_is_robust_to_outliers_and_pools_latency(mesh) -> None:
    clean = measure_curves(mesh, repeats=5, timer=fake_timer())
    noisy = measure_curves(mesh, repeats=5, timer=fake_timer(outlier_every=7))
    for axis in clean:
        for kind in KINDS:
            for (x0, t0), (x1, t1) in zip(clean[axis][kind], noisy[axis][kind]):
                assert x0 == x1 and t1 == pytest.approx(t0, rel=1e-6)
    # one latency per axis: every kind's smallest-size time is the same
    assert len({curve[0][1] for curve in noisy["a"].values()}) == 1
    pooled = pool_latency({"x": ((1.0, 1.0), (2.0, 1.5)), "y": ((1.0, 3.0), (2.0, 4.0)), "z": ((1.0, 2.0), (2.0, 2.0))})
    assert {c[0][1] for c in pooled.values()} == {2.0} and pooled["x"][1][1] == 2.0  # lifted to the latency


def test_a_mesh_dim_of_size_one_is_not_measured() -> None:
    mesh = DeviceMesh(np.arange(8).reshape(8, 1), ("a", "b"))
    assert measure_curves(mesh, repeats=1, timer=fake_timer()).keys() == {"a"}


def test_calibrate_with_a_fake_timer_builds_a_size_aware_model(mesh) -> None:
    model = CostModel.calibrate(mesh, repeats=3, timer=fake_timer())
    assert dict(model.latency).keys() == {"a", "b"} == dict(model.per_byte).keys()
    assert dict(model.latency)["a"] == model.collective_seconds(mesh, (0,), 0.0, "all-gather")  # pooled
    assert dict(model.per_byte)["a"] == pytest.approx(PER_BYTE["collective-permute"])
    sizes = [0.0, 1e3, 1e5, 1e7, 1e9]
    for kind in (*KINDS, None):
        seconds = [model.collective_seconds(mesh, (0,), x, kind) for x in sizes]
        assert all(b >= a for a, b in zip(seconds, seconds[1:])) and seconds[0] > 0
    # kind-aware: an all-to-all's byte costs more than a permute's
    assert model.collective_seconds(mesh, (0,), 1e8, "all-to-all") > model.collective_seconds(mesh, (0,), 1e8)
    # copies: no latency, the measured per-byte time
    assert model.copy_seconds(mesh, 0) == 0 and model.copy_seconds(mesh, 1e8) == pytest.approx(1e8 * 0.5e-9, rel=0.01)
    # fresh buffers: free up to 16 MiB, then what the fake charges beyond 32 MiB
    assert model.alloc_seconds(1 << 20) == pytest.approx(0, abs=1e-6)
    assert model.alloc_seconds(64 << 20) == pytest.approx((32 << 20) * 10e-9, rel=0.01)
    assert model.alloc_seconds(128 << 20) > model.alloc_seconds(64 << 20)
    rebuilt = eval(repr(model), {"CostModel": CostModel})  # noqa: S307 - the repr is the constructor call
    assert rebuilt == model


def test_the_calibrated_model_keeps_xla_for_small_moves_and_takes_the_reduce_scatter_for_large() -> None:
    """P -> S(0) on (8,): one all-reduce (XLA) or one reduce-scatter (direct). Small, both are
    a latency: XLA's reshard stays. Large (64 MiB), XLA's program keeps the whole partial tensor
    as a temporary, which the fake backend charges like the CPU one: the reduce-scatter wins."""
    mesh = DeviceMesh(list(range(8)), ("x",))
    model = CostModel.calibrate(mesh, repeats=1, timer=fake_timer())
    small, large = (64, 64), (4096, 4096)
    picks = {}
    for shape in (small, large):
        src = physical(resolve_layout(mesh, "P", 2), shape)
        dst = physical(resolve_layout(mesh, "S(0)", 2), shape)
        picks[shape] = choose(src, dst, np.int32, model).name
    assert picks == {small: "xla", large: "direct"}


def test_no_schedule_with_as_many_bytes_replaces_xla(mesh) -> None:
    """S(0),S(1) -> R,R: the direct all-to-all sends XLA's bytes in one collective instead of
    two; even a model where latency is everything keeps XLA's reshard."""
    src = physical(resolve_layout(mesh, "S(0),S(1)", 2), (64, 64))
    dst = physical(resolve_layout(mesh, "R,R", 2), (64, 64))
    latency_bound = CostModel(latency={"a": 1.0, "b": 1.0}, per_byte={"a": 1e-12, "b": 1e-12})
    assert choose(src, dst, np.int32, "min_bytes").nbytes == choose(src, dst, np.int32, "xla").nbytes
    assert choose(src, dst, np.int32, latency_bound).name == "xla"


def test_the_real_programs_run() -> None:
    """One tiny measurement of each program kind on two devices (no figure is asserted
    beyond its sign: timing belongs to the benchmarks)."""
    pair = DeviceMesh([0, 1], ("x",))
    curves = measure_curves(pair, repeats=1, sizes=(4096,), kinds=KINDS)
    assert curves.keys() == {"x"} and curves["x"].keys() == set(KINDS)
    assert all(len(curve) == 1 and curve[0][1] > 0 for curve in curves["x"].values())
    copy = calibration.measure_copy_curve(pair, repeats=1, sizes=(4096,))
    alloc = calibration.measure_alloc_curve(pair, copy, repeats=1, sizes=(4096, 8192))
    assert copy[0] == alloc[0] == (0.0, 0.0) and len(copy) == 2 and len(alloc) == 2


def test_the_calibration_is_stored_and_read_back(tmp_path, monkeypatch) -> None:
    calls = []
    original = CostModel.calibrate.__func__

    def fake_calibrate(cls, mesh, repeats=5, *, timer=None):
        calls.append(mesh)
        return original(cls, mesh, repeats=1, timer=fake_timer())

    monkeypatch.setattr(CostModel, "calibrate", classmethod(fake_calibrate))
    monkeypatch.setenv("PLACEMENTS2JAX_CACHE_DIR", str(tmp_path))
    schedules._calibrated.cache_clear()
    try:
        first = schedules._calibrated("cpu", 8)
        path = schedules.calibration_file("cpu", 8)
        assert path is not None and path.parent == tmp_path and path.exists() and len(calls) == 1
        schedules._calibrated.cache_clear()
        assert schedules._calibrated("cpu", 8) == first and len(calls) == 1  # read back, not measured
        path.write_text("{not json")
        schedules._calibrated.cache_clear()
        assert schedules._calibrated("cpu", 8) == first and len(calls) == 2  # unreadable: measured again
        assert json.loads(path.read_text())["curves"].keys() == set(KINDS)
        monkeypatch.setenv("PLACEMENTS2JAX_CACHE_DIR", "")
        assert schedules.calibration_file("cpu", 8) is None
    finally:
        schedules._calibrated.cache_clear()
        schedules._calibrated_model.cache_clear()
    assert math.isfinite(first.alloc_seconds(1 << 30))


def test_a_move_with_one_schedule_is_chosen_without_calibrating(monkeypatch) -> None:
    """The first redistribute of a process on a machine with no stored calibration must
    not pay for measuring one (15-36 s here) when XLA's reshard is the only schedule."""
    calls = []
    monkeypatch.setattr(CostModel, "calibrate", classmethod(lambda cls, *a, **k: calls.append(a)))
    monkeypatch.setattr(schedules, "_cost_model", lambda mesh: calls.append(mesh))
    mesh = DeviceMesh("cpu", np.arange(8).reshape(4, 2), mesh_dim_names=("a", "b"))
    src = physical(resolve_layout(mesh, "S(0),R", 2), (8, 8))
    dst = physical(resolve_layout(mesh, "_S(0, 2),R", 2), (8, 8))  # strided: only XLA's program
    assert len(schedules.candidates(src, dst, np.float32)) == 1
    assert choose(src, dst, np.float32, "cost").name == "xla"
    assert calls == []
