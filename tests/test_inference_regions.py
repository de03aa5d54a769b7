"""regions: what a shard_map region's body sends, predicted and checked against XLA."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from placements2jax import ArgumentTypeError, InferenceError, Layout, apply, distribute_tensor, init_device_mesh
from placements2jax.inference import CostModel, check, predict
from placements2jax.inference import program
from placements2jax.inference.cost import resolve_cost_model
from placements2jax.inference.jaxpr import _Walker
from placements2jax.inference.regions import RegionCollective, RegionMove, region_collectives
from placements2jax.inference.signature import as_tensor_specs


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


def auto(mesh: Any) -> jax.sharding.Mesh:
    """The mesh with Auto axes: a shard_map over it takes operands of any sharding type."""
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.ndim)


def spec(mesh: Any, shape: tuple[int, ...], placements: str, dtype: Any = jnp.float32) -> tuple[Any, ...]:
    return (shape, dtype, Layout.from_device_mesh(mesh)(placements))


def every_kind(mesh: Any) -> Any:
    def body(x: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
        y = jax.lax.psum(x @ w, "tp")
        z = jax.lax.all_gather(y, "dp", axis=0, tiled=True)
        m = jax.lax.pmax(y, "tp")
        s = jax.lax.psum_scatter(y, "tp", scatter_dimension=1, tiled=True)
        a = jax.lax.all_to_all(y, "tp", 1, 0, tiled=True)
        p = jax.lax.ppermute(y, "tp", [(i, (i + 1) % 4) for i in range(4)])
        return y + m + p, z, s, a

    return jax.shard_map(body, mesh=auto(mesh), in_specs=(P("dp", "tp"), P("tp", None)),
                         out_specs=(P("dp", "tp"), P(None, "tp"), P("dp", "tp"), P("dp", "tp")), check_vma=False)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_collective_a_region_sends_is_predicted_as_xla_compiles_it(mesh: Any, dtype: Any) -> None:
    """psum, all_gather, pmax, psum_scatter, all_to_all and ppermute in one region, each
    one collective of XLA's (CPU: bfloat16 ones sent in float32), counted with its bytes:
    the prediction's communication is XLA's, collective by collective."""
    fn = every_kind(mesh)
    inputs = (spec(mesh, (8, 16), "S(0),S(1)", dtype), spec(mesh, (16, 8), "R,S(0)", dtype))
    prediction = predict(fn, *inputs)
    sent = prediction.region_collectives
    assert [(c.primitive, c.kind, c.axes, c.reduce_op, c.result_bytes) for c in sent] == [
        (name, kind, axes, op, nbytes * jnp.dtype(dtype).itemsize) for name, kind, axes, op, nbytes in [
            ("psum", "all-reduce", ("tp",), "sum", 32),  # the (4, 8) block, all-reduced over tp's 4
            ("all_gather", "all-gather", ("dp",), None, 64),
            ("pmax", "all-reduce", ("tp",), "max", 32),
            ("reduce_scatter", "reduce-scatter", ("tp",), "sum", 8),
            ("all_to_all", "all-to-all", ("tp",), None, 32),
            ("ppermute", "collective-permute", ("tp",), None, 32),
        ]
    ]
    assert [c.after for c in sent] == [0, 1, 1, 1, 1, 1]  # each after the psum its operand is
    assert prediction.collectives == {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1,
                                      "collective-permute": 1}
    widening = 4 // jnp.dtype(dtype).itemsize
    # all-reduce 2 x 3/4 x 128, all-gather 3/4 x ... as the compiled side's formulas; 832 B in float32
    assert prediction.lowered_nbytes == 832 and prediction.nbytes == 832 / widening
    assert "body psum: all-reduce(" in str(prediction)
    report = check(fn, *inputs)
    assert report.communication == "equal" and report.agrees
    assert report.predicted_bytes == report.compiled_bytes == 832
    (to_all,) = [c for c in report.collective_checks if c.kind == "all-to-all"]
    assert (to_all.predicted, to_all.compiled, to_all.operands) == (1, 1, 1)  # its tuple form is one operand
    assert "XLA has" not in to_all.note and "merged" not in to_all.note


def test_independent_collectives_of_a_region_combine_and_dependent_ones_do_not(mesh: Any) -> None:
    """Two psums over tp of independent values: one all-reduce after XLA's combiner; a
    psum of a psum's result: two."""

    def independent(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jax.lax.psum(x @ w, "tp"), jax.lax.psum(x * 2, "tp")

    def chained(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.psum(jnp.tanh(jax.lax.psum(x @ w, "tp")) @ w.T, "tp")

    inputs = (spec(mesh, (8, 16), "S(0),S(1)"), spec(mesh, (16, 16), "R,S(0)"))
    for body, out_specs, combined in [(independent, (P("dp", None), P("dp", "tp")), 1), (chained, P("dp", "tp"), 2)]:
        fn = jax.shard_map(body, mesh=auto(mesh), in_specs=(P("dp", "tp"), P("tp", None)), out_specs=out_specs,
                           check_vma=False)
        report = check(fn, *inputs)
        assert len(report.prediction.region_collectives) == 2
        assert report.predicted_combined_counts == report.compiled_counts == {"all-reduce": combined}
        assert report.communication == "equal"


def test_a_loop_inside_a_region_is_a_computation_of_its_own(mesh: Any) -> None:
    """A psum in a scan's body inside the region and a pmax after the loop: the body's
    all-reduce is its loop's (no combining across), counted once as XLA compiles it."""

    def looped(x: jax.Array, w: jax.Array) -> jax.Array:
        def step(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return jax.lax.psum(c @ w, "tp") * 0.1 + c, None

        c, _ = jax.lax.scan(step, x, None, length=3)
        return jax.lax.psum(c, "dp")

    fn = jax.shard_map(looped, mesh=auto(mesh), in_specs=(P("dp", None), P()), out_specs=P(), check_vma=False)
    inputs = (spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 16), "R,R"))
    sent = predict(fn, *inputs).region_collectives
    assert [(c.axes, c.body) for c in sent] == [(("tp",), "/1"), (("dp",), "")]
    assert sent[1].after == 1  # the loop's results depend on what its body sends
    report = check(fn, *inputs)
    assert report.predicted_combined_counts == report.compiled_counts == {"all-reduce": 2}
    assert report.communication == "equal"


def test_a_collective_over_one_device_is_compiled_and_sends_nothing() -> None:
    """A psum over a size-1 mesh axis: CPU XLA compiles an all-reduce over groups of one
    device (where a redistribution's step over one device compiles to nothing), 0 B."""
    mesh = init_device_mesh((8, 1), ("dp", "tp"))
    fn = jax.shard_map(lambda x: jax.lax.psum(x, "tp"), mesh=auto(mesh), in_specs=P("dp"), out_specs=P("dp"),
                       check_vma=False)
    inputs = (spec(mesh, (8, 4), "S(0),R"),)
    (sent,) = predict(fn, *inputs).region_collectives
    assert (sent.axes, sent.group, sent.nbytes()) == (("tp",), 1, 0)
    report = check(fn, *inputs)
    assert report.predicted_combined_counts == report.compiled_counts == {"all-reduce": 1}
    assert report.communication == "equal"


def test_region_collectives_reads_a_shard_map_equation(mesh: Any) -> None:
    """The function itself on a traced equation: the calls inside the body are walked
    (a jitted helper's psum), the result cached per body."""
    helper = jax.jit(lambda v: jax.lax.psum(v, ("dp", "tp")))
    fn = jax.shard_map(lambda x: helper(x) * 2, mesh=auto(mesh), in_specs=P("dp", "tp"), out_specs=P(),
                       check_vma=False)
    (eqn,) = jax.make_jaxpr(fn)(jnp.ones((8, 8))).jaxpr.eqns
    sizes = {"dp": 2, "tp": 4}
    region = region_collectives(eqn, sizes)
    (sent,) = region.collectives
    assert region.outputs == (1,)  # the region's output waits for its psum
    assert (sent.kind, sent.axes, sent.group, sent.result_bytes, sent.nbytes()) == (
        "all-reduce", ("dp", "tp"), 8, 32, 56)  # the (4, 2) float32 block: 2 x 7/8 x 32 B
    assert region_collectives(eqn, sizes) is region_collectives(eqn, sizes)


def test_region_collectives_refuses_other_equations_and_unknown_axes(mesh: Any) -> None:
    fn = jax.shard_map(lambda x: jax.lax.psum(x, "tp"), mesh=auto(mesh), in_specs=P("dp", "tp"), out_specs=P("dp"),
                       check_vma=False)
    (eqn,) = jax.make_jaxpr(fn)(jnp.ones((8, 8))).jaxpr.eqns
    (add,) = jax.make_jaxpr(lambda x: x + 1)(jnp.ones(3)).jaxpr.eqns
    with pytest.raises(ArgumentTypeError, match="eqn=.*not a shard_map equation.*Fix: pass an equation"):
        region_collectives(add, {"dp": 2, "tp": 4})
    with pytest.raises(InferenceError, match="axis_sizes=.*has no axis 'tp'.*Fix: pass the size of every axis"):
        region_collectives(eqn, {"dp": 2})


def test_each_output_of_a_region_waits_only_for_what_its_value_depends_on(mesh: Any) -> None:
    """A region returning a psum over dp and a value computed without one: a sum over dp
    of the second, outside, is independent of the region's psum, and XLA's combiner
    merges the two all-reduces into one (with every output after every collective of its
    region the model counted two)."""
    region = jax.shard_map(lambda x, w: (jax.lax.psum(w * 2, "dp"), x * 3), mesh=auto(mesh),
                           in_specs=(P("dp", "tp"), P()), out_specs=(P(), P("dp", "tp")), check_vma=False)

    def fn(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        summed, scaled = region(x, w)
        return summed, jnp.tanh(jnp.sum(scaled, axis=0))

    inputs = (spec(mesh, (8, 16), "S(0),S(1)"), spec(mesh, (16,), "R,R"))
    report = check(fn, *inputs, out_layouts=(None, Layout.from_device_mesh(mesh)("R,S(0)")))
    assert report.prediction.equations[0].region.outputs == (1, 0)
    assert report.predicted_combined_counts == report.compiled_counts == {"all-reduce": 1}
    (combined,) = report.predicted_combined
    assert len(combined.members) == 2 and report.communication == "equal"


def test_a_regions_collectives_are_weighted_by_their_mesh_axes(mesh: Any) -> None:
    """Prediction.cost weighs each region collective by its slowest mesh axis, as a
    schedule's collectives: a psum over dp at dp's weight 10."""
    fn = jax.shard_map(lambda x: jax.lax.psum(x, "dp"), mesh=auto(mesh), in_specs=P("dp", "tp"),
                       out_specs=P(None, "tp"), check_vma=False)
    inputs = (spec(mesh, (8, 16), "S(0),S(1)"),)
    prediction = predict(fn, *inputs, cost_model=CostModel(axis_weights={"dp": 10}))
    assert prediction.nbytes == 64  # the (4, 4) float32 block, all-reduced over dp's 2: 2 x 1/2 x 64 B
    assert prediction.cost == 640


def test_the_program_search_counts_a_regions_collectives(mesh: Any) -> None:
    """The search's grouping of a choice (what its tie-breaks count after XLA's combiner)
    holds the region's collectives as the prediction's count does: the EP-style region's
    two all-to-alls and its psum, beside the program's moves."""

    def local(x: jax.Array, w: jax.Array) -> jax.Array:
        sent = jax.lax.all_to_all(x @ w, "tp", 0, 1, tiled=True)
        return jax.lax.all_to_all(jnp.tanh(sent), "tp", 1, 0, tiled=True) + jax.lax.psum(x.sum(), "tp")

    region = jax.shard_map(local, mesh=auto(mesh), in_specs=(P("dp", "tp"), P()), out_specs=P("dp", "tp"),
                           check_vma=False)
    inputs = (spec(mesh, (8, 16), "S(0),S(1)"), spec(mesh, (4, 4), "R,R"))
    specs, _ = as_tensor_specs(inputs, None)
    closed = jax.make_jaxpr(lambda x, w: jnp.tanh(region(x, w)))(
        *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in specs))
    walker = _Walker(mesh, resolve_cost_model(None), {})
    graph = walker.graph(walker.walk(closed.jaxpr, [], specs, "", [("in", i) for i in range(len(specs))]), specs)
    (node,) = [n for n in graph.nodes if n.region is not None]
    assert [c.kind for c in node.region.collectives] == ["all-to-all", "all-to-all", "all-reduce"]
    search = program._Search(graph, resolve_cost_model(None), (None,))
    planned, grouped = search.combined({n.path: 0 for n in graph.nodes})
    assert [c.kind for c in planned if c.where == node.path] == ["all-to-all", "all-to-all", "all-reduce"]
    prediction = predict(lambda x, w: jnp.tanh(region(x, w)), *inputs, search="eager")
    assert Counter(c.kind for c in grouped) == prediction.combined_counts


# -- regions manual over some mesh axes alone (axis_names=): the others are XLA's ----------------------------


def manual_over_tp(mesh: Any, body: Any, in_specs: Any, out_specs: Any, check_vma: bool = False) -> Any:
    return jax.shard_map(body, mesh=auto(mesh), in_specs=in_specs, out_specs=out_specs, axis_names={"tp"},
                         check_vma=check_vma)


def row_parallel(mesh: Any, check_vma: bool = False) -> Any:
    region = manual_over_tp(mesh, lambda x, w: jax.lax.psum(x @ w, "tp"), (P(None, "tp"), P("tp", None)), P(),
                            check_vma)
    return lambda x, w: jnp.tanh(region(x, w))


@pytest.mark.parametrize("shape, nbytes", [((8, 16), 192), ((6, 16), 144)], ids=["even", "uneven"])
def test_a_region_manual_over_tp_keeps_its_operands_split_over_dp(mesh: Any, shape: Any, nbytes: int) -> None:
    """A row-parallel psum region manual over tp alone on a batch split over dp: XLA
    partitions its body over dp, so the batch stays split and the psum all-reduces the
    block (2 x 3/4 x 128 B). The walker read its in_specs as whole layouts, Replicate over
    dp, and gathered the batch first (448 B where XLA sends 192); with 6 rows the blocks
    are 3 rows (144 B)."""
    inputs = (spec(mesh, shape, "S(0),S(1)"), spec(mesh, (16, 8), "R,S(0)"))
    fn = row_parallel(mesh)
    prediction = predict(fn, *inputs)
    (row,) = [e for e in prediction.equations if e.primitive == "shard_map"]
    assert [str(x) for x in row.signature.in_layouts] == ["S(0),S(1)", "R,S(0)"]
    assert [str(o.layout) for o in row.outputs] == ["S(0),R"]
    (sent,) = row.region.collectives
    assert sent.result_bytes == shape[0] // 2 * 8 * 4 and not any(p.steps for p in row.signature.redistributions)
    report = check(fn, *inputs)
    assert report.predicted_bytes == report.compiled_bytes == nbytes
    assert report.communication == "equal" and report.agrees


def test_a_partially_manual_gradient_region_leaves_its_weight_gradient_partial_over_dp(mesh: Any) -> None:
    """The region's transpose contracts the dp-split batch: its weight gradient is partial
    over dp, reduced after the region (with check_vma, XLA's two all-reduces, 320 B; without
    it the transpose psums over tp too, 512 B in three, predicted alike). apply makes the
    region's partial result in every executor ("pinned" bound it per rank and failed)."""
    for check_vma, nbytes in ((True, 320), (False, 512)):
        fn = jax.grad(lambda x, w: (row_parallel(mesh, check_vma)(x, w) ** 2).sum(), argnums=(0, 1))  # noqa: B023
        inputs = (spec(mesh, (8, 16), "S(0),S(1)"), spec(mesh, (16, 8), "R,S(0)"))
        regions = [e for e in predict(fn, *inputs).equations if e.primitive == "shard_map"]
        assert [str(o.layout) for o in regions[-1].outputs] == ["S(0),S(1)", "P,S(0)"]
        report = check(fn, *inputs)
        assert report.predicted_bytes == report.compiled_bytes == nbytes and report.communication == "equal"
        rng = np.random.default_rng(0)
        x, w = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)
        want = jax.jit(fn)(x, w)
        for execute in ("ops", "xla", "pinned"):
            got = apply(fn, distribute_tensor(x, mesh, "S(0),S(1)"), distribute_tensor(w, mesh, "R,S(0)"),
                        execute=execute)
            for g, v in zip(got, want):
                np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(v), rtol=1e-5, atol=1e-5)


def test_a_partially_manual_region_gathers_inside_where_xla_does(mesh: Any) -> None:
    """An all_gather over tp in a body whose matmul keeps the batch split over dp: XLA
    gathers the matmul's block over dp first (an all_gather is partitioned on operands
    Replicate over the other axes), then over tp: 224 B, predicted as the region's move of
    that operand (``all_gather operand``) and its all-gather, where the whole layouts
    gathered the input over dp (448 B)."""
    region = manual_over_tp(mesh, lambda x, w: jax.lax.all_gather(x @ w, "tp", axis=1, tiled=True),
                            (P(), P(None, "tp")), P())
    fn = lambda x, w: region(x, w).sum(1)  # noqa: E731
    inputs = (spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 8), "R,S(1)"))
    prediction = predict(fn, *inputs)
    assert [(c.primitive, c.kind, c.axes, c.result_bytes) for c in prediction.region_collectives] == [
        ("all_gather operand", "all-gather", ("dp",), 64), ("all_gather", "all-gather", ("tp",), 256)]
    assert prediction.region_collectives[1].after == 1  # the all_gather waits for its operand's move
    report = check(fn, *inputs)
    assert report.predicted_bytes == report.compiled_bytes == 224


def test_a_partially_manual_region_is_whole_where_that_sends_less(mesh: Any) -> None:
    """Expert parallelism manual over tp with the batch left to XLA: kept split over dp, the
    dispatched (4, 16, 8) tokens are gathered over dp before the all_to_all (1,024 B, as
    XLA does); gathering the (16, 8) input first sends 256 B, and the region takes its
    whole layouts (what it takes, the search is not shown: the body's moves are not in its
    objective)."""

    def body(h: jax.Array, g: jax.Array, w: jax.Array) -> jax.Array:
        dispatch = jax.nn.one_hot(jnp.argmax(h @ g, -1), 4, dtype=h.dtype)
        per = jax.lax.all_to_all(jnp.einsum("te,td->etd", dispatch, h), "tp", 0, 0, tiled=True)
        y = jax.lax.all_to_all(jnp.einsum("etd,edf->etf", per, w), "tp", 0, 0, tiled=True)
        return jnp.einsum("te,etf->tf", dispatch, y)

    region = manual_over_tp(mesh, body, (P(), P(), P("tp")), P())
    inputs = (spec(mesh, (16, 8), "S(0),R"), spec(mesh, (8, 4), "R,R"), spec(mesh, (4, 8, 8), "R,S(0)"))
    prediction = predict(lambda *a: region(*a).sum(), *inputs)
    (row,) = [e for e in prediction.equations if e.primitive == "shard_map"]
    assert str(row.signature.in_layouts[0]) == "R,R" and row.signature.redistributions[0].nbytes == 256
    assert [c.kind for c in row.region.collectives] == ["all-to-all", "all-to-all"]


def test_a_loop_inside_a_partially_manual_region(mesh: Any) -> None:
    """A scan of psums inside a region manual over tp: the carry stays split over dp, as
    XLA keeps it (96 B; its gradient 256 B in three all-reduces), values as jit's."""

    def body(x: jax.Array, w: jax.Array) -> jax.Array:
        def step(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return jnp.tanh(jax.lax.psum(c @ w, "tp") + c), None

        return jax.lax.scan(step, x, None, length=2)[0]

    region = manual_over_tp(mesh, body, (P(None, "tp"), P("tp", None)), P(None, "tp"))
    inputs = (spec(mesh, (8, 16), "S(0),S(1)"), spec(mesh, (16, 4), "R,S(0)"))
    grad = jax.grad(lambda x, w: region(x, w).sum(), argnums=(0, 1))
    for fn, nbytes in ((region, 96), (grad, 256)):
        report = check(fn, *inputs)
        assert report.predicted_bytes == report.compiled_bytes == nbytes and report.communication == "equal"


def test_region_collectives_takes_the_block_bytes_and_moves_of_a_partitioned_body(mesh: Any) -> None:
    """``block_bytes`` sizes a collective's result by its per-device block; ``moves`` adds
    the collectives of an operand's move before its equation, which the equation's
    collectives then wait for."""
    region = manual_over_tp(mesh, lambda x: jax.lax.psum(x * 2, "tp"), P(None, "tp"), P())
    (eqn,) = jax.make_jaxpr(region)(jnp.ones((8, 8))).jaxpr.eqns
    mul, psum = eqn.params["jaxpr"].eqns
    moved = RegionMove(0, RegionCollective("all-gather", ("dp",), None, np.dtype(np.float32), 32, 2, 0, "", ""))
    got = region_collectives(eqn, {"dp": 2, "tp": 4}, {psum.outvars[0]: 16}, {id(mul): (moved,)})
    assert [(c.primitive, c.result_bytes, c.after) for c in got.collectives] == [
        ("mul operand", 32, 0), ("psum", 16, 1)]
    assert got.outputs == (3,)


def test_a_megatron_mlp_step_with_a_partially_manual_row_parallel_region(mesh: Any) -> None:
    """A training step as code written with ``axis_names`` does it: the column-parallel
    matmul left to XLA, the row-parallel one a region manual over tp with its psum, the
    batch split over dp by XLA. The prediction's bytes and collectives are XLA's (1,412 B:
    the region's psum of the block and the weight gradients' all-reduce over dp after it;
    the region's in_specs read as whole layouts gathered the batch over dp first)."""
    region = manual_over_tp(mesh, lambda h, w: jax.lax.psum(h @ w, "tp"), (P(None, "tp"), P("tp", None)), P(),
                            check_vma=True)

    def step(x: jax.Array, w1: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        def loss(w1: jax.Array, w2: jax.Array) -> jax.Array:
            return (region(jax.nn.gelu(x @ w1), w2) ** 2).mean()

        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
        return value, w1 - 0.1 * g1, w2 - 0.1 * g2

    inputs = (spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(1)"), spec(mesh, (32, 16), "R,S(0)"))
    report = check(step, *inputs)
    assert report.predicted_bytes == report.compiled_bytes == 1412 and report.communication == "equal"
    assert report.predicted_combined_counts == report.compiled_counts == {"all-reduce": 2}


def _region_in_scan(mesh: Any) -> Any:
    region = jax.shard_map(lambda a, b: jax.lax.psum(a @ b, "tp"), mesh=auto(mesh),
                           in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp", None))

    def fn(x: jax.Array, ws: jax.Array) -> jax.Array:
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(region(h, w)), None), x, ws)
        return h.sum()

    return fn


def _ring_in_fori(mesh: Any) -> Any:
    def local(a: jax.Array) -> jax.Array:
        def step(i: Any, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            acc, block = carry
            block = jax.lax.ppermute(block, "tp", [(j, (j + 1) % 4) for j in range(4)])
            return acc + block, block

        return jax.lax.fori_loop(0, 3, step, (a, a))[0]

    return jax.shard_map(local, mesh=auto(mesh), in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))


def _remat_region_grad(mesh: Any) -> Any:
    region = jax.checkpoint(jax.shard_map(lambda a, b: jax.lax.psum(a @ b, "tp"), mesh=auto(mesh),
                                          in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp", None)))
    return jax.value_and_grad(lambda x, w: jnp.sum(jnp.tanh(region(x, w)) ** 2), argnums=1)


@pytest.mark.parametrize("program, shapes", [
    (_region_in_scan, (((8, 16), "S(0),S(1)"), ((3, 16, 16), "R,S(1)"))),
    (lambda mesh: jax.grad(_region_in_scan(mesh), argnums=1), (((8, 16), "S(0),S(1)"), ((3, 16, 16), "R,S(1)"))),
    (_ring_in_fori, (((8, 16), "S(0),S(1)"),)),
    (_remat_region_grad, (((8, 16), "S(0),S(1)"), ((16, 16), "R,S(0)"))),
], ids=["region in scan", "its gradient", "ring ppermute in fori_loop", "checkpointed region's gradient"])
def test_regions_inside_loops_and_remat_are_predicted_as_xla_compiles_them(mesh: Any, program: Any,
                                                                          shapes: Any) -> None:
    """A region a scan body calls (and its gradient), a ring of ppermutes in a fori_loop
    inside a region, a checkpointed region's gradient: the region collectives in their
    loops' bodies, bytes and collectives after XLA's combiner as compiled; apply's three
    executors give jax.jit's values."""
    fn = program(mesh)
    inputs = [spec(mesh, shape, placements) for shape, placements in shapes]
    report = check(fn, *inputs)
    assert report.communication == "equal" and report.predicted_bytes == report.compiled_bytes > 0
    assert report.predicted_combined_counts == report.compiled_counts
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=shape).astype(np.float32) for shape, _ in shapes]
    want = jax.tree.leaves(jax.jit(fn)(*arrays))
    for execute in ("ops", "xla", "pinned"):
        got = jax.tree.leaves(apply(fn, *(distribute_tensor(a, mesh, p) for a, (_, p) in zip(arrays, shapes)),
                                    execute=execute), is_leaf=lambda x: hasattr(x, "full_tensor"))
        for g, v in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(v), rtol=1e-4, atol=1e-4)
