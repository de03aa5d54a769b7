"""regions: what a shard_map region's body sends, predicted and checked against XLA."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from placements2jax import ArgumentTypeError, InferenceError, Layout, init_device_mesh
from placements2jax.inference import CostModel, check, predict
from placements2jax.inference import program
from placements2jax.inference.cost import resolve_cost_model
from placements2jax.inference.jaxpr import _Walker
from placements2jax.inference.regions import region_collectives
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
