"""Inference on strided layouts (issue 16): split factors from a view (torch's
``_StridedShard``) through the planner, the search, the reshape rule, the operators and
predict / apply.

Asserted: reshapes that move no data are free and give torch's strided layout (or the
multi-axis split the data already has); other ops take plain inputs, the planner
unstriding first, with the bytes the executed program sends; values against NumPy and
per-device shards (a free reshape leaves every device's buffer as it was)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placements2jax import Layout, LayoutError, Replicate, Shard, apply, distribute_tensor, init_device_mesh
from placements2jax.hlo import compiled_collectives
from placements2jax.inference import infer_signature, plan_redistribute, predict
from placements2jax.inference.cost import collective_nbytes
from placements2jax.inference.plan import layout_state, plan_cost
from placements2jax.inference.program import _state
from placements2jax.layout import iter_layouts
from placements2jax.physical import physical
from placements2jax.programs import program, strided_route


@pytest.fixture(scope="module")
def mesh1():
    return init_device_mesh((8,), ("x",))


@pytest.fixture(scope="module")
def mesh2():
    return init_device_mesh((4, 2), ("dp", "tp"))


def _shards(d, mesh) -> dict[int, np.ndarray]:
    by_device = {s.device: np.asarray(s.data) for s in d.array.addressable_shards}
    return {r: by_device[mesh.device(r)] for r in mesh.rank_list}


VIEWS = [  # (mesh, shape, layout text or (dim_axes, split), new shape, the free output layout's text)
    ("mesh1", (8, 16), "S(1)", (128,), "_S(0, 8)"),
    ("mesh1", (4, 8, 16), "S(1)", (32, 16), "_S(0, 4)"),
    ("mesh2", (4, 8, 16), "S(1),R", (32, 16), "_S(0, 4),R"),
    ("mesh2", (4, 8, 16), "S(0),S(1)", (32, 16), "(dp,tp),None"),
    ("mesh2", (32, 16), (((0, 1), ()), None), (4, 8, 16), "S(0),S(1)"),
    ("mesh1", (128,), (((0,),), (8,)), (8, 16), "S(1)"),
    ("mesh1", (128,), (((0,),), (8,)), (2, 64), "_S(1, 4)"),
    ("mesh2", (32, 16), (((0,), ()), (4, 1)), (4, 8, 16), "S(1),R"),
]


def _layout(mesh, spec, ndim: int) -> Layout:
    if isinstance(spec, str):
        return Layout.from_device_mesh(mesh)(spec).bind(ndim)
    dim_axes, split = spec
    return Layout(mesh, dim_axes, None, split)


@pytest.mark.parametrize("case", range(len(VIEWS)))
def test_a_reshape_that_moves_no_data_is_free(case: int, request) -> None:
    name, shape, spec, new, expected = VIEWS[case]
    mesh = request.getfixturevalue(name)
    layout = _layout(mesh, spec, len(shape))
    signature = infer_signature("reshape", [(shape, jnp.float32, layout)], mesh, shape=new)
    assert signature.chosen.cost == 0 and not any(signature.chosen.redistributed)
    assert str(signature.out_layout) == expected
    # the inverse split (or merge) is free too and gives the input's layout back
    back = infer_signature("reshape", [(new, jnp.float32, signature.out_layout)], mesh, shape=shape)
    assert back.chosen.cost == 0 and back.out_layout is layout


def test_a_reshape_with_no_layout_for_the_data_moves_it(mesh1, mesh2) -> None:
    """A strided split over several mesh dims has no Layout (one mesh dim per strided
    dim), nor has ``8x16 S(1) -> 16x8``: the data moves (planner's cost)."""
    both = Layout(mesh2, ((0,), (1,)), None, (4, 1))  # _S(0, 4),S(1) merged: dp strided, tp inside
    signature = infer_signature("reshape", [((32, 16), jnp.float32, both)], mesh2, shape=(512,))
    assert signature.chosen.cost > 0
    s1 = Layout.from_device_mesh(mesh1)("S(1)").bind(2)
    assert infer_signature("reshape", [((8, 16), jnp.float32, s1)], mesh1, shape=(16, 8)).chosen.cost > 0
    # a later dim of a merged group split over both mesh dims would be a strided split over
    # several mesh dims: never produced (the data moves; every candidate is a Layout)...
    inner = Layout(mesh2, ((), (0, 1), ()))
    merged = infer_signature("reshape", [((4, 8, 16), jnp.float32, inner)], mesh2, shape=(32, 16))
    assert merged.chosen.cost > 0 and all(not c.out_layouts[0].is_strided for c in merged.candidates)
    # ... and refused by name when asked for
    with pytest.raises(LayoutError, match=r"split_factors=\(4, 1\): dim 0 has split factor 4 but is split by 2 mesh "
                       r"dims\. Fix: give a split factor only to a dim split by exactly one mesh dim"):
        Layout(mesh2, ((0, 1), ()), None, (4, 1))


def test_the_search_and_the_planner_tell_strided_layouts_apart(mesh1) -> None:
    strided = Layout(mesh1, ((0,),), None, (8,))
    plain = Layout(mesh1, ((0,),))
    assert _state(strided) == layout_state(strided) == (((0,),), (None,), (8,))
    assert _state(plain) == (((0,),), (None,))
    # unstriding is one all-to-all over x (the plain S(0)'s bytes: 128 floats, 8 ranks)
    cost, steps = plan_cost((128,), np.dtype(np.float32), _state(strided), _state(plain), (8,), (1,))
    assert (cost, steps) == (56, 1)
    plan = plan_redistribute((128,), jnp.float32, strided, plain)
    assert [str(s) for s in plan.steps] == ["x: _S(0, 8)->S(0) all-to-all (56 B)"]
    assert plan.steps[0].before is strided and plan.steps[0].after is plain
    # an all-gather of a strided dim costs a plain one's bytes (a local reorder after it)
    gathered = plan_redistribute((128,), jnp.float32, strided, plain.replicated())
    assert gathered.nbytes == plan_redistribute((128,), jnp.float32, plain, plain.replicated()).nbytes == 448


def _compiled_bytes(src: Layout, dst: Layout, shape) -> float:
    phys = physical(src, shape)
    x = distribute_tensor(np.zeros(shape, np.float32), src.mesh, src).array  # partials: JAX's unreduced
    return sum(collective_nbytes(c, 8) for c in compiled_collectives(program(phys, physical(dst, shape)), x))


def test_the_planner_prices_what_the_program_sends(mesh1, mesh2) -> None:
    """On (8,) every move to and from a strided layout sends the planner's bytes; on (4, 2)
    the strided steps do (the plain middle of a route is XLA's reshard, priced as any)."""
    shape = (128, 16)
    strided = [Layout(mesh1, ((0,), ()), None, (8, 1)), Layout(mesh1, ((0,), ()), None, (2, 1))]
    for s in strided:
        for d in iter_layouts(mesh1, 2) + strided:
            for a, b in ((s, d), (d, s)):
                if a is not b:
                    assert _compiled_bytes(a, b, shape) == plan_redistribute(shape, jnp.float32, a, b).nbytes, (a, b)
    shape = (32, 16)
    strided = [Layout(mesh2, ((0,), ()), None, (4, 1)), Layout(mesh2, ((1,), (0,)), None, (2, 4))]
    for s in strided:
        for d in iter_layouts(mesh2, 2)[::4] + strided[1:]:
            for a, b in ((s, d), (d, s)):
                if a is b:
                    continue
                _, first, last, _ = strided_route(a, b)
                planned = plan_redistribute(shape, jnp.float32, a, b).nbytes
                middle = 0 if first is last else plan_redistribute(shape, jnp.float32, first, last).nbytes
                compiled_middle = 0 if first is last else _compiled_bytes(first, last, shape)
                assert _compiled_bytes(a, b, shape) - compiled_middle == planned - middle, (a, b)


def test_strided_and_partial_moves_send_the_planner_s_bytes(mesh2) -> None:
    """A strided layout with a partial mesh dim (``_S(0, 4),P``: JAX's ``unreduced`` on
    tp) goes by the planner's route too (it went through XLA's own program: 2,624 B
    compiled where 896 B were priced for ``_S(0, 4),P -> S(0),R``): its strided steps
    send the planner's bytes, the plain middle is priced as any plain move; values kept."""
    shape = (32, 16)
    value = np.arange(512, dtype=np.float32).reshape(shape)
    sp = Layout(mesh2, ((0,), ()), (None, "sum"), (4, 1))
    plain_p = Layout(mesh2, ((0,), ()), (None, "sum"))
    # unstriding keeps the partial: one all-to-all over dp, exactly the planner's bytes
    assert _compiled_bytes(sp, plain_p, shape) == plan_redistribute(shape, jnp.float32, sp, plain_p).nbytes == 384
    strided = [sp, Layout(mesh2, ((1,), ()), ("sum", None), (4, 1))]
    for s in strided:
        for d in iter_layouts(mesh2, 2)[::6] + [x for x in strided if x is not s]:
            for a, b in ((s, d), (d, s)):
                _, first, last, _ = strided_route(a, b)
                planned = plan_redistribute(shape, jnp.float32, a, b).nbytes
                middle = 0 if first is last else plan_redistribute(shape, jnp.float32, first, last).nbytes
                compiled_middle = 0 if first is last else _compiled_bytes(first, last, shape)
                assert _compiled_bytes(a, b, shape) - compiled_middle == planned - middle, (a, b)
    for a, b in ((sp, Layout(mesh2, ((0,), ()))), (Layout(mesh2, ((), ())), sp), (sp, Layout(mesh2, ((1,), ()), None, (4, 1)))):
        moved = distribute_tensor(value, mesh2, a).redistribute(mesh2, b)
        assert moved.layout is b
        np.testing.assert_array_equal(np.asarray(moved.full_tensor()), value)


def test_a_strided_dtensor_through_the_operators(mesh1, mesh2) -> None:
    value = np.arange(128, dtype=np.float32).reshape(8, 16)
    x = distribute_tensor(value, mesh1, [Shard(1)])
    y = x.reshape(128)
    assert str(y.layout) == "_S(0, 8)"
    before, after = _shards(x, mesh1), _shards(y, mesh1)
    for rank in mesh1.rank_list:  # free: every device keeps its buffer (flattened)
        np.testing.assert_array_equal(after[rank], before[rank].reshape(16))
    np.testing.assert_array_equal(np.asarray(y.full_tensor()), value.reshape(128))
    flat = value.reshape(128)
    np.testing.assert_array_equal(np.asarray((y + 1).full_tensor()), flat + 1)
    np.testing.assert_array_equal(np.asarray((y * y).reshape(2, 64).sum(0).full_tensor()), (flat * flat).reshape(2, 64).sum(0))
    np.testing.assert_array_equal(np.asarray(y.sum().full_tensor()), flat.sum())
    np.testing.assert_array_equal(np.asarray(y.max().full_tensor()), flat.max())
    back = y.reshape(8, 16)
    assert back.layout is x.layout
    for rank, shard in _shards(back, mesh1).items():
        np.testing.assert_array_equal(shard, before[rank])
    cube = np.arange(512, dtype=np.float32).reshape(4, 8, 16)
    x3 = distribute_tensor(cube, mesh2, [Shard(1), Replicate()])
    y3 = x3.reshape(32, 16)
    assert str(y3.layout) == "_S(0, 4),R"
    w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)
    out = y3 @ distribute_tensor(w, mesh2, [Replicate(), Shard(1)])
    # float32 sums of 16 products up to 511 in magnitude: the order of the additions (XLA's
    # blocking, which varies with the machine's threads) moves a result by up to ~16 ulps of
    # the largest product, far more than 1e-6 of a result that cancels to ~5
    exact = cube.reshape(32, 16).astype(np.float64) @ w.astype(np.float64)
    rounding = 16 * np.finfo(np.float32).eps * np.abs(cube).max() * np.abs(w).max()
    np.testing.assert_allclose(np.asarray(out.full_tensor()), exact, rtol=0, atol=rounding)
    np.testing.assert_array_equal(np.asarray(y3.T.full_tensor()), cube.reshape(32, 16).T)


@pytest.mark.parametrize("execute", ["ops", "xla"])
def test_predict_and_apply_carry_a_strided_value(mesh2, execute: str) -> None:
    cube = np.arange(512, dtype=np.float32).reshape(4, 8, 16)
    x = distribute_tensor(cube, mesh2, [Shard(1), Replicate()])

    def f(a):
        return jnp.tanh(a.reshape(32, 16) * 0.01).reshape(4, 8, 16).sum(-1)

    prediction = predict(f, x)
    # the reshape keeps the rows strided (free), the elementwise ops run on them in place
    # (as torch runs them on its _StridedShard), the reshape back is free: nothing moves
    # (384 B before the strided pass-through: one all-to-all over dp unstrided the rows)
    assert prediction.cost == 0 and not prediction.collectives
    out = apply(f, x, execute=execute)
    np.testing.assert_allclose(np.asarray(out.full_tensor()), np.tanh(cube * 0.01).sum(-1), rtol=1e-5)
    strided = x.reshape(32, 16)
    out = apply(lambda a: (a * 2).sum(0), strided, execute=execute)
    np.testing.assert_allclose(np.asarray(out.full_tensor()), (cube.reshape(32, 16) * 2).sum(0), rtol=1e-6)


@st.composite
def _merges(draw):  # noqa: ANN202
    """A 3-d shape, a layout of it (maybe strided), and a merge of two adjacent dims (or all)."""
    name = draw(st.sampled_from(["mesh1", "mesh2"]))
    sizes = (8,) if name == "mesh1" else (4, 2)
    shape = [draw(st.sampled_from([1, 2, 4, 8])) * sizes[0] for _ in range(3)]
    shape[draw(st.integers(0, 2))] = draw(st.sampled_from([1, 2, 3, 4]))
    dims = [draw(st.integers(0, 2)) for _ in sizes]
    merge = draw(st.sampled_from([(0, 1), (1, 2), (0, 1, 2)]))
    return name, tuple(shape), dims, merge


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_merges())
def test_property_reshape_merges_of_strided_layouts_give_numpy_s_values(case, request) -> None:  # noqa: ANN001
    name, shape, dims, merge = case
    mesh = request.getfixturevalue(name)
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    placements = [Shard(d) if shape[d] % mesh.shape[m] == 0 else Replicate() for m, d in enumerate(dims)]
    x = distribute_tensor(value, mesh, placements)
    merged = shape[: merge[0]] + (int(np.prod([shape[d] for d in merge])),) + shape[merge[-1] + 1 :]
    y = x.reshape(merged)
    np.testing.assert_array_equal(np.asarray(y.full_tensor()), value.reshape(merged))
    signature = infer_signature("reshape", [x], shape=merged)
    if signature.chosen.cost == 0:  # nothing moved: every device holds its buffer, reshaped
        before = _shards(x, mesh)
        for rank, shard in _shards(y, mesh).items():
            np.testing.assert_array_equal(shard.reshape(-1), before[rank].reshape(-1))
    # a strided (or any) result split back and merged again: NumPy's values, no move
    z = (y + 1).reshape(shape)
    np.testing.assert_array_equal(np.asarray(z.full_tensor()), value + 1)
    again = y.reshape(shape).reshape(merged)
    assert again.layout is y.layout
    np.testing.assert_array_equal(np.asarray(again.full_tensor()), value.reshape(merged))


PASS_THROUGH = [  # (mesh, input layout, op, params, other input (shape, layout text) or None, output layout's text)
    ("mesh1", "_S(0, 8)", "exp", {}, None, "_S(0, 8)"),
    ("mesh1", "_S(0, 8)", "neg", {}, None, "_S(0, 8)"),
    ("mesh1", "_S(0, 8)", "add", {}, "same", "_S(0, 8)"),
    ("mesh1", "_S(0, 8)", "mul", {}, ((128,), "R"), "_S(0, 8)"),
    ("mesh1", "_S(0, 8)", "sum", {"axis": 0}, None, "P"),
    ("mesh1", "_S(0, 4)", "transpose", {"axes": (1, 0)}, None, "_S(1, 4)"),
    ("mesh1", "_S(0, 4)", "sum", {"axis": 1}, None, "_S(0, 4)"),
    ("mesh1", "_S(0, 4)", "max", {"axis": 0}, None, "P(max)"),
    ("mesh1", "_S(0, 4)", "add", {}, ((16,), "R"), "_S(0, 4)"),
    ("mesh1", "_S(0, 4)", "matmul", {}, ((16, 8), "R"), "_S(0, 4)"),
    ("mesh2", "_S(0, 4),R", "tanh", {}, None, "_S(0, 4),R"),
    ("mesh2", "_S(0, 4),S(1)", "mul", {}, "same", "_S(0, 4),S(1)"),
    ("mesh2", "_S(0, 4),R", "add", {}, ((32, 16), "R,S(1)"), "_S(0, 4),S(1)"),
    ("mesh2", "_S(0, 4),S(1)", "transpose", {"axes": (1, 0)}, None, "_S(1, 4),S(0)"),
    ("mesh2", "_S(0, 4),S(1)", "sum", {"axis": 1}, None, "_S(0, 4),P"),
    ("mesh2", "_S(0, 4),R", "mean", {"axis": 0}, None, "P(avg),R"),
]


def _strided_input(mesh, text: str, ndim: int):  # noqa: ANN202
    shape = (128,) if ndim == 1 else (32, 16)
    layout = Layout.from_device_mesh(mesh)(text).bind(ndim)
    value = np.linspace(-1, 3, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return shape, layout, value


@pytest.mark.parametrize("case", range(len(PASS_THROUGH)))
def test_strided_inputs_pass_through_elementwise_transpose_and_reductions(case: int, request) -> None:
    """Torch runs elementwise ops, transpose and reductions on a _StridedShard in place:
    so does the default mode now (free; a replicated co-operand sliced locally), and
    the values (full and per device) are NumPy's through apply's both programs."""
    name, text, op, params, other, expected = PASS_THROUGH[case]
    mesh = request.getfixturevalue(name)
    ndim = 1 if mesh.ndim == 1 and text == "_S(0, 8)" else 2
    shape, layout, value = _strided_input(mesh, text, ndim)
    specs = [(shape, jnp.float32, layout)]
    values = [value]
    if other is not None:
        oshape, olayout = (shape, layout) if other == "same" else (other[0], other[1])
        olayout = olayout if isinstance(olayout, Layout) else Layout.from_device_mesh(mesh)(olayout).bind(len(oshape))
        specs.append((oshape, jnp.float32, olayout))
        values.append(np.linspace(0.5, 1.5, int(np.prod(oshape)), dtype=np.float32).reshape(oshape))
    signature = infer_signature(op, specs, mesh, **params)
    assert str(signature.out_layout) == expected and signature.chosen.cost == 0, (signature.out_layout, signature.chosen)
    assert all(x is s[2] for x, s in zip(signature.in_layouts, specs)) or other is not None
    fn = {
        "exp": jnp.exp, "neg": jnp.negative, "tanh": jnp.tanh, "add": jnp.add, "mul": jnp.multiply,
        "matmul": jnp.matmul, "transpose": lambda a: jnp.transpose(a, params.get("axes")),
        "sum": lambda a: a.sum(params["axis"]), "max": lambda a: a.max(params["axis"]),
        "mean": lambda a: a.mean(params["axis"]),
    }[op]
    expected_value = np.asarray(fn(*map(jnp.asarray, values)))
    tensors = [distribute_tensor(v, mesh, s[2]) for v, s in zip(values, specs)]
    # predict's whole-program search: the strided inputs cost nothing more than plain ones
    # (mean's division makes it reduce-scatter the partial sum either way)
    plain = [distribute_tensor(v, mesh, Layout(mesh, s[2].dim_axes, s[2].partial)) for v, s in zip(values, specs)]
    assert predict(fn, *tensors).cost == predict(fn, *plain).cost
    for execute in ("ops", "xla"):
        out = apply(fn, *tensors, execute=execute)
        np.testing.assert_allclose(np.asarray(out.full_tensor()), expected_value, rtol=1e-5, atol=1e-6)
        if out.layout.is_strided and not out.layout.has_partial:  # the output's shards: the op on every block
            assert out.layout is signature.out_layout
            reference = distribute_tensor(expected_value, mesh, out.layout)
            for rank, shard in _shards(out, mesh).items():
                np.testing.assert_allclose(shard, _shards(reference, mesh)[rank], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("execute", ["ops", "xla"])
def test_scans_keep_split_factors(mesh1, execute: str) -> None:
    """A scan over strided rows slices and stacks them with their split factors (the
    scan's helpers dropped them: a strided ``ys`` was recorded plain). A body making a
    strided value (a free reshape) stacks it strided; scanning a strided ``xs`` runs the
    body on its slices in place: nothing moves, NumPy's values."""
    cube = np.linspace(-1, 1, 512, dtype=np.float32).reshape(4, 8, 16)
    x = distribute_tensor(cube, mesh1, [Shard(2)])

    def made(a):
        return jax.lax.scan(lambda c, row: (c + row.sum(), jnp.exp(row.reshape(128))), jnp.float32(0), a)

    prediction = predict(made, x)
    assert prediction.cost == 0 and str(prediction.out_layouts[1]) == "_S(1, 8)", prediction.out_layouts
    carry, ys = apply(made, x, execute=execute)
    np.testing.assert_allclose(np.asarray(ys.full_tensor()), np.exp(cube.reshape(4, 128)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(carry.full_tensor()), cube.sum(), rtol=1e-4, atol=1e-4)
    strided = x.reshape(4, 128)
    assert str(strided.layout) == "_S(1, 8)"

    def scanned(a):
        return jax.lax.scan(lambda c, row: (c * 2, jnp.tanh(row) * c), jnp.ones(128, jnp.float32), a)[1]

    prediction = predict(scanned, strided)
    assert prediction.cost == 0 and prediction.out_layouts[0] is strided.layout
    out = apply(scanned, strided, execute=execute)
    expected = np.tanh(cube.reshape(4, 128)) * (2.0 ** np.arange(4))[:, None]
    np.testing.assert_allclose(np.asarray(out.full_tensor()), expected, rtol=1e-6)
    if execute == "ops":  # every device's block: the op on its own strided block
        reference = distribute_tensor(expected, mesh1, strided.layout)
        for rank, shard in _shards(out, mesh1).items():
            np.testing.assert_allclose(shard, _shards(reference, mesh1)[rank], rtol=1e-6)


@pytest.mark.parametrize("execute", ["ops", "xla"])
def test_a_strided_value_near_fixed_outputs_is_gathered_once(execute: str) -> None:
    """A strided value (a free flatten of a split minor dim, ``_S(0, 64)`` over tp on
    dp=2 x tp=4) read by two updates whose outputs must come back Replicate (a parameter
    and its moment): the finishing descent gathers it once for both (7,680 B, one
    all-gather), where each update ran strided and its output was all-gathered at the end
    (15,360 B in 2 before strided values were gathered: ``_Search.value_moves``' gathers
    took plain splits only). NumPy's values in the outputs' layouts."""
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    rng = np.random.default_rng(0)
    w_np, mu_np = (rng.standard_normal((256, 10)).astype(np.float32) for _ in range(2))
    x_np = rng.standard_normal((64, 4, 10)).astype(np.float32)
    w, mu = (distribute_tensor(a, mesh, "R,R") for a in (w_np, mu_np))
    x = distribute_tensor(x_np, mesh, "R,S(1)")

    def update(w, mu, x):
        g = jnp.tanh(x.reshape(256, 10))
        return w - 0.1 * g, 0.9 * mu + g

    prediction = predict(update, w, mu, x, out_layouts=(w, mu))
    assert str(prediction.equations[0].outputs[0].layout) == "R,_S(0, 64)"
    assert (prediction.nbytes, dict(prediction.combined_counts)) == (256 * 10 * 4 * 3 // 4, {"all-gather": 1})
    new_w, new_mu = apply(update, w, mu, x, out_layouts=(w, mu), execute=execute)
    g = np.tanh(x_np.reshape(256, 10))
    assert new_w.layout == w.layout and new_mu.layout == mu.layout
    np.testing.assert_allclose(np.asarray(new_w.full_tensor()), w_np - np.float32(0.1) * g, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new_mu.full_tensor()), np.float32(0.9) * mu_np + g, rtol=1e-6, atol=1e-6)
