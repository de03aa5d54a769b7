"""Host callbacks with results (``jax.pure_callback``, ``io_callback``): predicted as XLA
compiles them (operands gathered, a result read all-reduced over the whole mesh from the
callback's device, one read by nothing not), checked against XLA (a result returned as it
is: ``xla kept on one device``), and run by apply once per program run, on an Explicit
mesh on its Auto twin."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from placements2jax import DTensor, InferenceError, UnsupportedOpError, apply, distribute_tensor, init_device_mesh
from placements2jax.inference import check, predict

sys.path.insert(0, str(Path(__file__).parent))
from models.steps import mlp_step, training_step  # noqa: E402

EXECUTES = ("xla", "ops", "pinned", "auto")


@pytest.fixture(scope="module")
def mesh():
    # Auto axes: JAX lowers a program holding a callback only on one mesh (see test_explicit_mesh_...)
    return init_device_mesh((2, 4), ("dp", "tp"), axis_types="auto")


def _twice(calls: list[np.ndarray]) -> Any:
    def host(a: np.ndarray) -> np.ndarray:
        calls.append(np.asarray(a).copy())
        return (2 * np.asarray(a)).astype(np.float32)

    return host


@pytest.mark.parametrize("kind", ["pure", "io", "io ordered"])
def test_callback_gathers_its_operand_and_all_reduces_its_result(mesh: Any, kind: str) -> None:
    """The operand (a partial sum split over dp) is gathered and reduced to R,R; the result
    is Partial(sum) over dp,tp and all-reduced once over all 8 devices, as XLA compiles
    it; check agrees on layouts, counts and bytes; every execute mode calls the host once
    per run with the whole value, and returns plain jax.jit's values."""
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 64
    w = np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8)
    dx, dw = distribute_tensor(x, mesh, "S(0),S(1)"), distribute_tensor(w, mesh, "R,S(0)")
    calls: list[np.ndarray] = []
    host = _twice(calls)

    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        y = a @ b  # S(0),P
        out = jax.ShapeDtypeStruct(y.shape, y.dtype)
        z = jax.pure_callback(host, out, y) if kind == "pure" else io_callback(host, out, y, ordered=kind != "io")
        return jnp.tanh(z)

    prediction = predict(f, dx, dw)
    name = "pure_callback" if kind == "pure" else "io_callback"
    row = next(e for e in prediction.equations if e.primitive == name)
    assert str(row.signature.chosen.in_layouts[0]) == "R,R"
    assert str(row.outputs[0].layout) == "P,P"
    (move,) = [e for e in prediction.equations if e.primitive == "callback result"]
    (step,) = move.signature.redistributions[0].steps
    assert (step.collective, step.axes, step.nbytes) == ("all-reduce", ("dp", "tp"), 2 * 7 * 8 * 8 * 4 / 8)
    report = check(f, dx, dw)
    assert report.agrees, report
    assert report.communication == "equal" and report.predicted_bytes == report.compiled_bytes
    full = x @ w
    expected = np.asarray(jax.jit(f)(x, w))
    np.testing.assert_allclose(expected, np.tanh(2 * full), rtol=1e-5, atol=1e-5)
    for execute in EXECUTES:
        calls.clear()
        out = apply(f, dx, dw, execute=execute)
        np.testing.assert_allclose(np.asarray(out.full_tensor()), expected, rtol=1e-5, atol=1e-6)
        jax.effects_barrier()
        assert len(calls) == 1, execute
        np.testing.assert_allclose(calls[0], full, rtol=1e-5, atol=1e-5)


def test_sequential_vmap_calls_the_host_per_row(mesh: Any) -> None:
    """``vmap_method="sequential"``: a scan of the callback, one call per row (8), the
    result's all-reduce inside the loop: check equal; every mode calls it 8 times."""
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    dx = distribute_tensor(x, mesh, "S(0),S(1)")
    calls: list[np.ndarray] = []
    host = _twice(calls)
    f = jax.vmap(lambda r: jax.pure_callback(host, jax.ShapeDtypeStruct(r.shape, r.dtype), r, vmap_method="sequential"))
    report = check(f, dx)
    assert [o.verdict for o in report.outputs] == ["equal"] and report.communication == "equal"
    for execute in EXECUTES:
        calls.clear()
        np.testing.assert_allclose(np.asarray(apply(f, dx, execute=execute).full_tensor()), 2 * x)
        jax.effects_barrier()
        assert len(calls) == 8, execute


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_training_step_with_host_metric_and_loss_logging(axis_types: str) -> None:
    """A Megatron MLP adamw step that logs its loss with an ordered io_callback and scales
    its update by a NumPy function of the loss (pure_callback): predicted = XLA's layouts,
    the callbacks' collectives and bytes = those XLA adds for them; apply (every mode) = plain jax.jit in the predicted layouts, one log per
    step. On the default Explicit mesh apply runs it on the mesh's Auto twin.
    """
    logged: list[float] = []

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        new, opt_state, loss = mlp_step(params, opt_state, x, y)
        io_callback(lambda v: logged.append(float(v)), None, loss, ordered=True)
        scale = jax.pure_callback(lambda v: np.float32(1 / (1 + np.log1p(v))), jax.ShapeDtypeStruct((), loss.dtype), loss)
        return jax.tree.map(lambda p, q: p + scale * (q - p), params, new), opt_state, loss

    mesh = init_device_mesh((2, 4), ("dp", "tp"), axis_types=axis_types)
    args = training_step("mlp", mesh).args
    report, quiet = check(step, *args), check(mlp_step, *args)
    assert all(o.verdict == "equal" for o in report.outputs), report

    def counts(r: Any) -> dict[tuple[str, tuple[str, ...]], tuple[int, int]]:
        return {(c.kind, c.axes): (c.combined, c.compiled) for c in r.axis_checks}

    # the callbacks add what XLA adds to the step without them: the scale's all-reduce over all 8 devices (a
    # float32 scalar, 2 * 7/8 * 4 = 7 B), the logged loss (already Replicate) nothing. (The step without them
    # differs from XLA on its own on this mesh, in dp all-gathers against all-reduces.)
    added = {k: (v[0] - counts(quiet).get(k, (0, 0))[0], v[1] - counts(quiet).get(k, (0, 0))[1])
             for k, v in counts(report).items()}
    assert {k: v for k, v in added.items() if v != (0, 0)} == {("all-reduce", ("dp", "tp")): (1, 1)}
    assert report.predicted_bytes - quiet.predicted_bytes == report.compiled_bytes - quiet.compiled_bytes == 7
    rows = [e.primitive for e in report.prediction.equations]
    assert rows.count("io_callback") == 1 and rows.count("pure_callback") == 1 and rows.count("callback result") == 1
    leaves, tree = jax.tree.flatten(args, is_leaf=lambda a: isinstance(a, DTensor))
    plain = [np.asarray(a.full_tensor()) if isinstance(a, DTensor) else a for a in leaves]
    logged.clear()
    expected = jax.tree.leaves(jax.jit(step)(*jax.tree.unflatten(tree, plain)))
    jax.effects_barrier()
    assert len(logged) == 1
    for execute in EXECUTES:
        logged.clear()
        result = apply(step, *args, execute=execute)
        leaves = jax.tree.leaves(result, is_leaf=lambda a: isinstance(a, DTensor))
        predicted = predict(step, *args, search="eager") if execute == "ops" else report.prediction
        assert [a.layout for a in leaves] == [s.layout for s in predicted.outputs], execute
        for got, want in zip(leaves, expected, strict=True):
            np.testing.assert_allclose(np.asarray(got.full_tensor()), np.asarray(want), rtol=2e-5, atol=1e-6)
        jax.effects_barrier()
        assert len(logged) == 1 and logged[0] == pytest.approx(float(expected[-1]), rel=1e-5), execute


def _explicit_case() -> tuple[Any, np.ndarray, DTensor, list[np.ndarray], Any]:
    """An Explicit (2, 4) mesh, x, x split over both dims, the host's calls and a function
    returning the callback's result (used) and a sum of its operand."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    calls: list[np.ndarray] = []
    host = _twice(calls)

    def f(a: jax.Array) -> tuple[jax.Array, jax.Array]:
        z = jax.pure_callback(host, jax.ShapeDtypeStruct(a.shape, a.dtype), a)
        return z + 1, a.sum(0)

    return mesh, x, distribute_tensor(x, mesh, "S(0),S(1)"), calls, f


@pytest.mark.parametrize("context", ["eager", "set_mesh"])
def test_explicit_mesh_runs_on_its_auto_twin(context: str) -> None:
    """On an Explicit mesh (the default) JAX 0.10.2 refuses to lower apply's program with a
    callback (its operands on the mesh, fn computed on the Auto twin): apply, seeing that
    before it runs (no JAX error read), runs it on the twin, the results back on the
    Explicit mesh, in every execute mode, eagerly and inside ``jax.set_mesh`` of the mesh."""
    mesh, x, dx, calls, f = _explicit_case()
    for execute in EXECUTES:
        calls.clear()
        with jax.set_mesh(mesh.to_jax()) if context == "set_mesh" else contextlib.nullcontext():
            z, s = apply(f, dx, execute=execute)
        assert z.device_mesh == mesh and s.device_mesh == mesh
        assert z.array.sharding.mesh == s.array.sharding.mesh == mesh.to_jax()
        np.testing.assert_allclose(np.asarray(z.full_tensor()), 2 * x + 1)
        np.testing.assert_allclose(np.asarray(s.full_tensor()), x.sum(0))
        jax.effects_barrier()
        assert len(calls) == 1, execute


def test_explicit_mesh_refusals() -> None:
    """What the Auto twin cannot run is our error, raised before JAX's: a Partial operand
    (its twin form differs), and apply under an outer ``jax.jit`` (the jit's program would
    span the mesh and its twin), in every execute mode."""
    mesh, x, dx, _, f = _explicit_case()
    for execute in EXECUTES:
        with pytest.raises(UnsupportedOpError, match="under jax.jit") as info:
            jax.jit(lambda d, execute=execute: apply(f, d, execute=execute))(dx)
        assert "outside jax.jit" in str(info.value) and "axis_types='auto'" in str(info.value)
    partial_sum = apply(jnp.matmul, dx, distribute_tensor(x, mesh, "R,S(0)"), execute="ops")  # S(0),P
    assert str(partial_sum.layout) == "S(0),P"
    with pytest.raises(UnsupportedOpError, match="Partial operand") as info:
        apply(f, partial_sum, execute="xla")
    assert "redistribute" in str(info.value) and "axis_types='auto'" in str(info.value)


@pytest.mark.parametrize("kind", ["pure", "io", "pure on device 3"])
def test_result_returned_as_it_is(mesh: Any, kind: str) -> None:
    """A callback's result returned without being read: XLA, left free, keeps it on the
    callback's device (``{maximal device=0}`` / ``=3``, the other devices zeros) and
    broadcasts nothing. The prediction makes it Replicate by the callback result's
    all-reduce over dp,tp, as apply does; check names the difference (``xla kept on one
    device``) and compares the program compiling it Replicate: the predicted all-gathers
    (224 B) and all-reduce (448 B). Every execute mode returns R,R, every device's block
    the whole value, the host called once."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    dx = distribute_tensor(x, mesh, "S(0),S(1)")
    calls: list[np.ndarray] = []
    host = _twice(calls)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[3]) if kind.endswith("3") else None

    def f(a: jax.Array) -> jax.Array:
        out = jax.ShapeDtypeStruct(a.shape, a.dtype)
        return io_callback(host, out, a) if kind == "io" else jax.pure_callback(host, out, a, sharding=device)

    structs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh.to_jax(), jax.P("dp", "tp")))
    assert str(jax.jit(f).lower(structs).compile().output_shardings).startswith(
        f"GSPMDSharding({{maximal device={3 if device else 0}}}")
    report = check(f, dx)
    (out,) = report.outputs
    assert (str(out.predicted), out.compiled, out.verdict) == ("R,R", None, "xla kept on one device")
    assert f"maximal device={3 if device else 0}" in out.note and "one device" in str(report)
    assert report.communication == "equal" and report.predicted_bytes == report.compiled_bytes == 224 + 448
    assert [e.primitive for e in report.prediction.equations].count("callback result") == 1
    for execute in EXECUTES:
        calls.clear()
        z = apply(f, dx, execute=execute)
        assert str(z.layout) == "R,R", execute
        for shard in z.array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), 2 * x)
        jax.effects_barrier()
        assert len(calls) == 1, execute


@pytest.mark.parametrize("where", ["top", "nested jit"])
def test_unread_result_is_not_broadcast(mesh: Any, where: str) -> None:
    """An io_callback run for its effect, its result read by nothing (dropped at the top,
    unused in a nested jit): XLA broadcasts nothing, and neither does the prediction (no
    ``callback result`` row): check agrees, 224 B of all-gathers each; every mode calls
    the host once and returns plain jit's values."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    dx = distribute_tensor(x, mesh, "S(0),S(1)")
    calls: list[np.ndarray] = []
    host = _twice(calls)

    def effect(a: jax.Array) -> jax.Array:
        io_callback(host, jax.ShapeDtypeStruct(a.shape, a.dtype), a)
        return a * 2

    f = effect if where == "top" else (lambda a: jax.jit(effect)(a) + 1)
    report = check(f, dx)
    assert report.agrees, report
    assert report.predicted_bytes == report.compiled_bytes == 224
    assert "callback result" not in [e.primitive for e in report.prediction.equations]
    for execute in EXECUTES:
        calls.clear()
        got = apply(f, dx, execute=execute)
        np.testing.assert_array_equal(np.asarray(got.full_tensor()), 2 * x + (where != "top"))
        jax.effects_barrier()
        assert len(calls) == 1, execute
        np.testing.assert_array_equal(calls[0], x)


def test_check_refuses_a_callback_of_a_partial_input() -> None:
    """check compiles Partial inputs unreduced on the Explicit mesh, where XLA aborts the
    process compiling a host callback of an unreduced value (jax 0.10.2): refused with our
    error instead, for pure_callback, io_callback and jax.debug.callback. Reduced first
    in fn (``jax.sharding.reshard``), or a callback of another input, it compiles: the
    operand's reduction over tp and gather over dp (320 B), then the result's all-reduce
    (448 B; XLA keeps a result returned as it is on its device: the named verdict)."""
    mesh, x, dx, calls, _ = _explicit_case()
    partial_sum = apply(jnp.matmul, dx, distribute_tensor(x, mesh, "R,S(0)"), execute="ops")  # S(0),P
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    host = _twice(calls)
    refused = {
        "pure_callback": lambda a: jax.pure_callback(host, out, a),
        "io_callback": lambda a: (io_callback(host, out, a), a * 2)[1],
        "debug_callback": lambda a: (jax.debug.callback(host, a), a * 2)[1],
    }
    for name, f in refused.items():
        with pytest.raises(InferenceError, match=f"Partial input to {name}: XLA aborts the process") as info:
            check(f, partial_sum)
        assert info.value.argument == "inputs" and "reshard" in str(info.value)

    def reduced(a: jax.Array) -> jax.Array:
        return jax.pure_callback(host, out, jax.sharding.reshard(a, jax.P("dp", None)))

    with jax.set_mesh(mesh.to_jax()):
        report = check(reduced, partial_sum)
    assert [o.verdict for o in report.outputs] == ["xla kept on one device"]
    assert report.communication == "equal" and report.predicted_bytes == report.compiled_bytes == 320 + 448
    other = check(lambda a, b: (jax.pure_callback(host, out, b), a), partial_sum, distribute_tensor(x, mesh, "S(0),R"))
    assert [o.verdict for o in other.outputs] == ["equal", "equal"] and other.communication == "equal"
