"""The rule tables of torch and OneFlow (notes sections 1 and 3), case by case, on a 1-D
mesh: the signature chosen for given input placements, and the 1-D signatures listed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from placements2jax import (
    Layout,
    Partial,
    Replicate,
    Shard,
    UnsupportedOpError,
    init_device_mesh,
)
from placements2jax.inference import OneDSig, Signature, infer_signature, predict, rules
from placements2jax.inference.ops import primitive_definition
from placements2jax.inference.signature import Aval
from placements2jax.placements import parse_placement

F32 = jnp.float32
R = Replicate()
P = Partial()


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh((4,), ("x",))


def infer(mesh: Any, op: str, *inputs: tuple[tuple[int, ...], str], dtypes: Any = None, **params: Any) -> Signature:
    layout = Layout.from_device_mesh(mesh)
    dtypes = dtypes or [F32] * len(inputs)
    return infer_signature(op, [(shape, dtype, layout(p)) for (shape, p), dtype in zip(inputs, dtypes)], **params)


def placements(signature: Signature) -> tuple[str, str]:
    """(inputs, outputs) of the chosen signature in short form on the 1-D mesh."""
    ins = ",".join(str(x.placements[0]) for x in signature.in_layouts)
    outs = ",".join(str(x.placements[0]) for x in signature.out_layouts)
    return ins, outs


def one_d(rule: Any, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], **params: Any) -> set[str]:
    avals_in = [Aval(s, np.float32) for s in ins]
    avals_out = [Aval(s, np.float32) for s in outs]
    return {str(s) for s in rule(avals_in, avals_out, **params)}


# -- matmul (torch mm, OneFlow matmul) -------------------------------------------------------


@pytest.mark.parametrize(
    ("left", "right", "out"),
    [("S(0)", "R", "S(0)"), ("R", "S(1)", "S(1)"), ("S(1)", "S(0)", "P"), ("P", "R", "P"), ("R", "P", "P"), ("R", "R", "R")],
)
def test_mm_keeps_each_torch_strategy(mesh: Any, left: str, right: str, out: str) -> None:
    signature = infer(mesh, "matmul", ((8, 12), left), ((12, 16), right))
    assert placements(signature) == (f"{left},{right}", out)
    assert signature.cost == 0 and all(p.is_noop for p in signature.redistributions)


def test_mm_one_d_signatures_are_torchs_list() -> None:
    listed = one_d(rules.einsum, [(8, 12), (12, 16)], [(8, 16)], operands=("mk", "kn"), output="mn")
    assert listed == {
        "S(0),R -> S(0)", "R,S(1) -> S(1)", "S(1),S(0) -> P",
        "P,R -> P", "R,P -> P", "P(avg),R -> P(avg)", "R,P(avg) -> P(avg)",
    }


def test_bmm_batch_dims_split_together(mesh: Any) -> None:
    signature = infer(mesh, "matmul", ((8, 4, 6), "S(0)"), ((8, 6, 2), "S(0)"))
    assert placements(signature) == ("S(0),S(0)", "S(0)")


def test_broadcast_matmul_right_aligns_batch_and_size_one_batch_is_replicate(mesh: Any) -> None:
    signature = infer(mesh, "matmul", ((1, 4, 6), "R"), ((8, 6, 2), "S(0)"))
    assert placements(signature) == ("R,S(0)", "S(0)")
    listed = one_d(rules.einsum, [(1, 4, 6), (8, 6, 2)], [(8, 4, 2)], operands=("amk", "akn"), output="amn")
    assert "R,S(0) -> S(0)" in listed and "S(0),S(0) -> S(0)" not in listed


# -- pointwise --------------------------------------------------------------------------------


def test_add_with_broadcast_splits_the_aligned_dim(mesh: Any) -> None:
    signature = infer(mesh, "add", ((4, 8), "S(1)"), ((8,), "S(0)"))
    assert placements(signature) == ("S(1),S(0)", "S(1)")
    signature = infer(mesh, "add", ((4, 8), "S(0)"), ((8,), "R"))
    assert placements(signature) == ("S(0),R", "S(0)")


def test_add_one_d_list_has_split_per_dim_and_partial_sum() -> None:
    listed = one_d(rules.elementwise, [(4, 8), (8,)], [(4, 8)], partial="linear")
    assert listed == {"S(0),R -> S(0)", "S(1),S(0) -> S(1)", "P,P -> P", "P(avg),P(avg) -> P(avg)"}


def test_partial_plus_partial_stays_partial(mesh: Any) -> None:
    assert placements(infer(mesh, "add", ((4, 8), "P"), ((4, 8), "P"))) == ("P,P", "P")
    assert placements(infer(mesh, "sub", ((4, 8), "P(avg)"), ((4, 8), "P(avg)"))) == ("P(avg),P(avg)", "P(avg)")


def test_partial_plus_replicate_is_not_allowed_directly(mesh: Any) -> None:
    signature = infer(mesh, "add", ((4, 8), "P"), ((4, 8), "R"))
    assert all(not (c.in_layouts[0].has_partial and not c.in_layouts[1].has_partial) for c in signature.candidates)
    # torch's answer: the replicate becomes partial locally (free), the sum stays partial
    assert placements(signature) == ("P,P", "P")
    (step,) = signature.redistributions[1].steps
    assert (step.src, step.dst, step.collective, step.nbytes) == (R, P, "local-partial", 0)


def test_mul_by_replicate_keeps_partial_and_div_only_the_numerator(mesh: Any) -> None:
    assert placements(infer(mesh, "mul", ((4, 8), "P"), ((4, 8), "R"))) == ("P,R", "P")
    assert placements(infer(mesh, "mul", ((4, 8), "R"), ((4, 8), "P"))) == ("R,P", "P")
    assert placements(infer(mesh, "div", ((4, 8), "P"), ((4, 8), "R"))) == ("P,R", "P")
    denominator = infer(mesh, "div", ((4, 8), "R"), ((4, 8), "P"))
    assert not denominator.in_layouts[1].has_partial
    product = infer(mesh, "mul", ((4, 8), "P"), ((4, 8), "P"))
    assert not (product.in_layouts[0].has_partial and product.in_layouts[1].has_partial)


def test_nonlinear_ops_reduce_partials_first(mesh: Any) -> None:
    for op in ("exp", "tanh", "gelu", "square"):
        signature = infer(mesh, op, ((8, 4), "P"))
        assert not signature.in_layouts[0].has_partial, op
        # cheapest reduction: reduce-scatter into a split, not an all-reduce
        assert [s.collective for s in signature.redistributions[0].steps] == ["reduce-scatter"]
        assert placements(signature) == ("S(0)", "S(0)")


def test_max_partials_only_through_max(mesh: Any) -> None:
    assert placements(infer(mesh, "maximum", ((4, 8), "P(max)"), ((4, 8), "P(max)"))) == ("P(max),P(max)", "P(max)")
    assert placements(infer(mesh, "maximum", ((4, 8), "P(max)"), ((4, 8), "R"))) == ("P(max),R", "P(max)")
    assert placements(infer(mesh, "minimum", ((4, 8), "R"), ((4, 8), "P(min)"))) == ("R,P(min)", "P(min)")
    for op in ("add", "mul", "minimum"):
        signature = infer(mesh, op, ((4, 8), "P(max)"), ((4, 8), "R"))
        assert signature.in_layouts[0].partial_op != "max", op
    assert not infer(mesh, "maximum", ((4, 8), "P"), ((4, 8), "R")).in_layouts[0].has_partial
    assert placements(infer(mesh, "neg", ((4, 8), "P(max)"))) == ("P(max)", "P(min)")
    assert placements(infer(mesh, "neg", ((4, 8), "P"))) == ("P", "P")


def test_convert_passes_partials_between_floats_only(mesh: Any) -> None:
    assert placements(infer(mesh, "astype", ((4, 8), "P"), dtype=jnp.bfloat16)) == ("P", "P")
    to_int = infer(mesh, "astype", ((4, 8), "P"), dtype=jnp.int32)
    assert not to_int.in_layouts[0].has_partial
    assert placements(infer(mesh, "astype", ((4, 8), "S(1)"), dtype=jnp.int32)) == ("S(1)", "S(1)")


# -- reductions --------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "partial"), [("sum", "P"), ("mean", "P(avg)"), ("max", "P(max)"), ("min", "P(min)")])
def test_reduction_over_split_axis_gives_partial(mesh: Any, op: str, partial: str) -> None:
    assert placements(infer(mesh, op, ((8, 4), "S(0)"), axis=0)) == ("S(0)", partial)
    assert placements(infer(mesh, op, ((8, 4), "S(0)"))) == ("S(0)", partial)


def test_reduction_kept_dims_are_renumbered(mesh: Any) -> None:
    assert placements(infer(mesh, "sum", ((4, 6, 8), "S(2)"), axis=0)) == ("S(2)", "S(1)")
    assert placements(infer(mesh, "sum", ((4, 6, 8), "S(2)"), axis=(0, 1))) == ("S(2)", "S(0)")
    assert placements(infer(mesh, "sum", ((4, 6, 8), "S(2)"), axis=0, keepdims=True)) == ("S(2)", "S(2)")
    assert placements(infer(mesh, "max", ((4, 6, 8), "S(1)"), axis=(0, 2), keepdims=True)) == ("S(1)", "S(1)")


def test_reduce_sum_lists_partial_to_partial_once() -> None:
    """OneFlow lists P->P once per reduced axis; one entry is enough."""
    listed = rules.reduction([Aval((4, 6, 8), np.float32)], [Aval((6,), np.float32)], axes=(0, 2), kind="sum")
    assert [str(s) for s in listed].count("P -> P") == 1
    assert {str(s) for s in listed} == {"S(0) -> P", "S(1) -> S(0)", "S(2) -> P", "P -> P", "P(avg) -> P(avg)"}


def test_partial_through_reductions(mesh: Any) -> None:
    assert placements(infer(mesh, "sum", ((8, 4), "P"), axis=1)) == ("P", "P")
    assert placements(infer(mesh, "mean", ((8, 4), "P"), axis=1)) == ("P", "P")
    assert placements(infer(mesh, "max", ((8, 4), "P(max)"), axis=1)) == ("P(max)", "P(max)")
    assert not infer(mesh, "max", ((8, 4), "P"), axis=1).in_layouts[0].has_partial
    assert not infer(mesh, "prod", ((8, 4), "S(0)"), axis=0).in_layouts[0].placements[0].is_shard(0)


def test_mean_of_uneven_split_is_not_avg(mesh: Any) -> None:
    """The average of unequal chunks' means is not the mean: no P(avg) for 10 rows on 4."""
    signature = infer(mesh, "mean", ((10, 4), "S(0)"), axis=0)
    assert all(c.out_layouts[0].partial_op != "avg" or c.in_layouts[0].placements[0] != Shard(0) for c in signature.candidates)
    assert placements(infer(mesh, "sum", ((10, 4), "S(0)"), axis=0)) == ("S(0)", "P")


def test_all_and_any_of_bools_over_a_split_axis_combine_one_bool_per_rank(mesh: Any) -> None:
    """``jnp.all``/``jnp.any`` (``reduce_and``/``reduce_or``) of a split bool array give
    P(min)/P(max), so optax.apply_if_finite's isfinite over split updates all-reduces one
    bool, not the gathered array; on integers they are bitwise and still gather."""
    from placements2jax import apply, distribute_tensor

    def flags(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.all(jnp.isfinite(x)), jnp.any(x > 100.0)

    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    layout = Layout.from_device_mesh(mesh)
    split = layout("S(0)")
    (all_eq, any_eq) = (e for e in predict(flags, (x.shape, F32, split)).equations if e.primitive.startswith("reduce"))
    assert [str(all_eq.outputs[0].layout), str(any_eq.outputs[0].layout)] == ["P(min)", "P(max)"]
    bitwise = predict(lambda n: lax.reduce(n, np.int32(-1), lax.bitwise_and, (0, 1)), ((8, 16), jnp.int32, split))
    assert str(bitwise.equations[0].outputs[0].layout) == "R" and bitwise.nbytes == 8 * 16 * 4 * 3 // 4  # gathered
    for nan_row in (None, 5):  # a NaN on rank 2 alone: every rank must learn it
        if nan_row is not None:
            x[nan_row, 3] = np.nan
        got = apply(flags, distribute_tensor(jnp.asarray(x), mesh, [Shard(0)]), out_layouts=(layout("R"),) * 2)
        assert [str(g.layout) for g in got] == ["R", "R"]
        assert [{bool(v) for v in g.local_shards().values()} for g in got] == [{nan_row is None}, {True}]


@pytest.mark.parametrize("execute", ["xla", "pinned", "ops"])
def test_all_and_any_of_an_uneven_bool_split_ignore_its_pads(execute: str) -> None:
    """9 bools over 8 ranks (blocks of 2, pads on the ranks holding fewer): a rank reduces
    its padded block for P(min)/P(max), so its pads must be neutral: True for ``all``,
    False for ``any`` (bitwise and / or: all bits set / none). Padded with 0, ``all`` of
    nine Trues came out False."""
    from placements2jax import apply, distribute_tensor, init_device_mesh

    mesh8 = init_device_mesh((8,), ("x",))
    for values in (np.ones(9, bool), np.zeros(9, bool), np.arange(9) < 8, np.arange(9) == 8):
        x = distribute_tensor(values, mesh8, "S(0)")
        for reduce, want in ((jnp.all, values.all()), (jnp.any, values.any())):
            got = apply(reduce, x, execute=execute)
            assert bool(np.asarray(got.full_tensor())) == bool(want), (reduce.__name__, values)


@pytest.mark.parametrize("execute", ["auto", "pinned", "ops"])
def test_bitwise_reductions_of_a_split_integer_array(execute: str) -> None:
    """``reduce_and`` / ``reduce_or`` / ``reduce_xor`` of int32 over a split dim (9 over 8
    ranks, padded). XLA's CPU backend cannot compile the integer all-reduce its own
    partitioning makes (plain ``jax.jit`` fails: "UNIMPLEMENTED: Unsupported reduction
    computation"), so ``"auto"`` runs the pinned plan, which gathers the input (inside
    ``jax.set_mesh``, where the pinned program compiles as XLA's, the op-by-op one)."""
    from placements2jax import apply, distribute_tensor, init_device_mesh

    mesh8 = init_device_mesh((8,), ("x",))
    values = np.array([7, 15, 7, 7, 23, 7, 7, 7, 39], np.int32)
    x = distribute_tensor(values, mesh8, "S(0)")
    for reduce, want in (
        (jax.lax.reduce_and, np.bitwise_and.reduce(values)),
        (jax.lax.reduce_or, np.bitwise_or.reduce(values)),
        (jax.lax.reduce_xor, np.bitwise_xor.reduce(values)),
    ):
        got = apply(lambda a, reduce=reduce: reduce(a, (0,)), x, execute=execute)
        assert int(np.asarray(got.full_tensor())) == int(want), reduce.__name__
    if execute == "auto":  # inside set_mesh of the Explicit mesh "pinned" compiles as "xla": "auto" runs "ops"
        with jax.set_mesh(mesh8.to_jax()):
            got = apply(lambda a: jax.lax.reduce_or(a, (0,)), x)
        assert int(np.asarray(got.full_tensor())) == int(np.bitwise_or.reduce(values))


def test_auto_picks_the_pinned_plan_for_a_bitwise_reduction_in_a_sub_jaxpr() -> None:
    """``execute="auto"`` looks into calls and loop bodies (one pass over every equation,
    inference.jaxpr.all_equations): an integer ``reduce_or`` under ``jax.jit`` inside a
    ``lax.scan`` body runs the pinned plan too; a float sum anywhere stays with XLA."""
    from placements2jax import apply, distribute_tensor, init_device_mesh
    from placements2jax.operators import _auto_execute

    def nested(a: jax.Array) -> jax.Array:
        def body(carry: jax.Array, row: jax.Array) -> tuple[jax.Array, None]:
            return carry | jax.jit(lambda r: lax.reduce_or(r, (0,)))(row), None

        return lax.scan(body, np.int32(0), a.reshape(1, -1))[0]

    mesh8 = init_device_mesh((8,), ("x",))
    values = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256], np.int32)
    assert _auto_execute(jax.make_jaxpr(nested)(values).jaxpr, mesh8, False) == "pinned"
    assert _auto_execute(jax.make_jaxpr(nested)(values).jaxpr, mesh8, True) == "ops"
    summed = jax.make_jaxpr(lambda a: jax.jit(jnp.sum)(a))(values.astype(np.float32)).jaxpr
    assert _auto_execute(summed, mesh8, False) == "xla"
    got = apply(nested, distribute_tensor(values, mesh8, "S(0)"))
    assert int(np.asarray(got.full_tensor())) == int(np.bitwise_or.reduce(values))


def test_nested_equations_name_paths_as_the_walker_and_tag_inputs_through_bodies(mesh: Any) -> None:
    """inference.jaxpr.nested_equations (autoplan's stacked leaves, first uses and scan
    lengths): inside a ``jax.jit``, a scan with ``unroll=2`` entered as the walker walks it
    (its inner scan's path is a row of predict's report, with the ``length // 2`` trips);
    entered as its body without ``unroll``, where the scanned input keeps its tag."""
    from placements2jax import distribute_tensor
    from placements2jax.inference.jaxpr import nested_equations

    def stacked(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.jit(lambda x, w: lax.scan(lambda h, wi: (jnp.tanh(h * wi), None), x, w, unroll=2)[0])(x, w)

    x, w = jnp.ones((8,)), jnp.ones((5, 8))
    closed = jax.make_jaxpr(stacked)(x, w)
    scans = {".".join(map(str, s.path)): s.eqn.params["length"] for s in nested_equations(closed.jaxpr, unroll=True)
             if s.eqn.primitive.name == "scan" and s.eqn.params["unroll"] == 1}
    rows = {r.path for r in predict(stacked, *(distribute_tensor(a, mesh, "R") for a in (x, w))).equations
            if r.primitive == "scan"}
    assert list(scans.values()) == [2] and set(scans) <= rows
    tags = dict(zip(closed.jaxpr.invars, ("x", "w")))
    read = [(s.path, s.eqn.primitive.name, s.reads) for s in nested_equations(closed.jaxpr, tags) if any(s.reads)]
    assert read[:2] == [((0,), "jit", ("x", "w")), ((0, 0), "scan", ("x", "w"))]
    assert [r for r in read[2:] if r[1] != "mul"] == [] and read[2][0] == (0, 0, 0)


# -- data movement ---------------------------------------------------------------------------


def test_transpose_moves_splits_and_keeps_partials(mesh: Any) -> None:
    assert placements(infer(mesh, "transpose", ((4, 8), "S(0)"))) == ("S(0)", "S(1)")
    assert placements(infer(mesh, "transpose", ((4, 8, 12), "S(2)"), axes=(2, 0, 1))) == ("S(2)", "S(0)")
    assert placements(infer(mesh, "transpose", ((4, 8), "P"))) == ("P", "P")


def test_reshape_signatures_print_their_joint_condition_by_value() -> None:
    """A reshape's 1-D signatures print alike in every run (a prediction's report, the
    reference dumps hash it): their joint condition by its shapes, not its address."""
    sigs = rules.reshape((Aval((2, 3, 4), np.float32),), (Aval((6, 4), np.float32),))
    assert repr(sigs[0].joint) == "_ReshapeCheck((2, 3, 4), (6, 4))"
    assert eval(repr(sigs[0].joint), {"_ReshapeCheck": type(sigs[0].joint)}) == sigs[0].joint


def test_reshape_keeps_only_the_leading_dim_of_a_group(mesh: Any) -> None:
    assert placements(infer(mesh, "reshape", ((8, 6), "S(0)"), shape=(48,))) == ("S(0)", "S(0)")
    assert placements(infer(mesh, "reshape", ((48,), "S(0)"), shape=(8, 6))) == ("S(0)", "S(0)")
    assert placements(infer(mesh, "reshape", ((2, 8, 6), "S(1)"), shape=(2, 48))) == ("S(1)", "S(1)")
    inner = infer(mesh, "reshape", ((8, 6), "S(1)"), shape=(48,))
    assert not inner.in_layouts[0].placements[0].is_shard(1)
    assert placements(infer(mesh, "reshape", ((8, 6), "P"), shape=(48,))) == ("P", "P")
    # every dim of a group may map to every dim of its image; the joint check on the N-D
    # candidate keeps a later dim's split only behind whole splits of the dims before it
    listed = one_d(rules.reshape, [(2, 3, 4)], [(6, 4)])
    partials = [f"{p} -> {p}" for p in ("P", "P(avg)", "P(max)", "P(min)")]
    assert listed == {"S(0) -> S(0)", "S(1) -> S(0)", "S(2) -> S(1)", *partials}


def test_reshape_with_dimensions_reads_its_input_transposed(mesh: Any) -> None:
    """``lax.reshape(x, sizes, dimensions=...)`` (JAX's transpose of a depthwise conv
    reshapes its kernel so) is the transpose into ``dimensions`` then the reshape: its 1-D
    signatures are the plain reshape's of the transposed shape, each input dim named as it
    comes; its joint condition holds the order (and prints it). Checked per rank by
    test_inference_programs' PRIM_CASES and against XLA by Mamba's step (test_real_code)."""
    listed = one_d(rules.reshape, [(4, 1, 64, 1)], [(4, 64, 1)], dimensions=(0, 2, 1, 3))
    assert listed == {"S(0) -> S(0)", "S(2) -> S(1)", *(f"{p} -> {p}" for p in ("P", "P(avg)", "P(max)", "P(min)"))}
    # transposed (4, 6) -> (6, 4): the group (6, 4) -> 24 keeps its leading dim, the input's dim 1
    assert one_d(rules.reshape, [(4, 6)], [(24,)], dimensions=(1, 0)) >= {"S(1) -> S(0)", "S(0) -> S(0)"}
    joint = rules.reshape((Aval((4, 6), np.float32),), (Aval((24,), np.float32),), dimensions=(1, 0))[0].joint
    assert repr(joint) == "_ReshapeCheck((6, 4), (24,), (1, 0))"
    assert eval(repr(joint), {"_ReshapeCheck": type(joint)}) == joint != rules.reshape(
        (Aval((6, 4), np.float32),), (Aval((24,), np.float32),))[0].joint
    kernel = ((4, 1, 64, 1), F32, Layout.from_device_mesh(mesh)("S(2)"))
    prediction = predict(lambda k: lax.reshape(k, (4, 64, 1), dimensions=(0, 2, 1, 3)), kernel)
    assert str(prediction.outputs[0].layout) == "S(1)" and prediction.nbytes == 0


def test_broadcast_to_splits_only_existing_full_dims(mesh: Any) -> None:
    assert placements(infer(mesh, "broadcast_to", ((8,), "S(0)"), shape=(4, 8))) == ("S(0)", "S(1)")
    expanded = infer(mesh, "broadcast_to", ((4, 1), "R"), shape=(4, 8))
    assert placements(expanded) == ("R", "R")
    assert all(not c.out_layouts[0].placements[0].is_shard(1) for c in expanded.candidates)


def test_softmax_splits_every_axis_but_the_softmax_axis(mesh: Any) -> None:
    for op in ("softmax", "log_softmax"):
        assert placements(infer(mesh, op, ((8, 4), "S(0)"), axis=-1)) == ("S(0)", "S(0)")
        moved = infer(mesh, op, ((8, 4), "S(1)"), axis=-1)
        assert placements(moved) == ("S(0)", "S(0)")
        assert [s.collective for s in moved.redistributions[0].steps] == ["all-to-all"]
        assert not infer(mesh, op, ((8, 4), "P"), axis=-1).in_layouts[0].has_partial


def test_layer_norm_splits_batch_axes_only(mesh: Any) -> None:
    signature = infer(mesh, "layer_norm", ((8, 4, 6), "S(1)"), ((6,), "R"), ((6,), "R"))
    assert placements(signature) == ("S(1),R,R", "S(1)")
    assert one_d(rules.normalization, [(8, 4, 6), (6,), (6,)], [(8, 4, 6)], axes=(2,)) == {
        "S(0),R,R -> S(0)", "S(1),R,R -> S(1)"
    }
    normalized = infer(mesh, "layer_norm", ((8, 4, 6), "S(2)"), ((6,), "R"), ((6,), "R"))
    assert not normalized.in_layouts[0].placements[0].is_shard(2)


def test_gather_both_ways(mesh: Any) -> None:
    """OneFlow gather: indices S(i), table B -> S(axis+i); indices B, table S(axis) -> P."""
    dtypes = [F32, jnp.int32]
    by_indices = infer(mesh, "take", ((16, 6), "R"), ((2, 8), "S(1)"), dtypes=dtypes, axis=0)
    assert placements(by_indices) == ("R,S(1)", "S(1)")
    by_table = infer(mesh, "embedding", ((16, 6), "S(0)"), ((8,), "R"), dtypes=dtypes, axis=0)
    assert placements(by_table) == ("S(0),R", "P")
    columns = infer(mesh, "take", ((16, 6), "S(1)"), ((8,), "R"), dtypes=dtypes, axis=0)
    assert placements(columns) == ("S(1),R", "S(1)")
    listed = one_d(rules.take, [(6, 16), (8, 3)], [(6, 8, 3)], axis=1)
    assert {"R,S(0) -> S(1)", "R,S(1) -> S(2)", "S(0),R -> S(0)", "S(1),R -> P"} <= listed


def _only(jaxpr: Any, primitive: str) -> Any:
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == primitive]
    return eqn


def _avals(variables: Any) -> list[Aval]:
    return [Aval(v.aval.shape, v.aval.dtype) for v in variables]


def test_vmapped_row_lookup_is_a_masked_lookup(mesh: Any) -> None:
    """eqx.nn.Embedding's ``weight[i]`` under vmap is a gather of start_index_map (0, 1),
    slice (1, dim), nothing collapsed (the dim's start clamps to 0): the same masked
    lookup as ``table[ids]`` (table S(0) -> P), and its gradient the masked scatter; the
    embedding dim, indexed but taken whole, may be split too. A point gather looks up
    both of its axes; several rows, or rows at points of two axes: no looked-up axis."""
    table, ids = jax.ShapeDtypeStruct((16, 6), F32), jax.ShapeDtypeStruct((8,), jnp.int32)

    def lookup(t: jax.Array, i: jax.Array) -> jax.Array:
        return jax.vmap(lambda k: t[k])(i)

    gather = _only(jax.make_jaxpr(lookup)(table, ids).jaxpr, "gather")
    dn, sizes = gather.params["dimension_numbers"], gather.params["slice_sizes"]
    assert (dn.start_index_map, dn.collapsed_slice_dims, sizes) == ((0, 1), (), (1, 6))
    assert rules.gather_lookup_axes(dn, sizes, (16, 6)) == (0,)
    listed = {str(s) for s in rules.gather(_avals(gather.invars), _avals(gather.outvars), dimension_numbers=dn,
                                           slice_sizes=sizes)}
    assert {"S(0),R -> P", "S(1),R -> S(2)", "R,S(0) -> S(0)"} <= listed
    scatter = _only(jax.make_jaxpr(jax.grad(lambda t, i: lookup(t, i).sum()))(table, ids).jaxpr, "scatter-add")
    sdn = scatter.params["dimension_numbers"]
    assert rules.scatter_lookup_axes(sdn, (16, 6), scatter.invars[2].aval.shape) == (0,)
    listed = {str(s) for s in rules.scatter(_avals(scatter.invars), _avals(scatter.outvars), dimension_numbers=sdn,
                                            kind="scatter-add")}
    assert {"S(0),R,R -> S(0)", "S(1),R,S(2) -> S(1)"} <= listed
    layout = Layout.from_device_mesh(mesh)
    inputs = (((16, 6), F32, layout("S(0)")), ((8,), jnp.int32, layout("R")))
    forward = predict(lookup, *inputs, out_layouts=layout("P"))
    gradient = predict(jax.grad(lambda t, i: lookup(t, i).sum()), *inputs, out_layouts=layout("S(0)"))
    assert forward.nbytes == gradient.nbytes == 0  # the table is not gathered, its gradient not sliced
    point = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
    rows = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,))
    assert rules.gather_lookup_axes(point, (1, 1), (16, 6)) == (0, 1)  # x[rows, cols]: a point on both
    assert rules.gather_lookup_axes(rows, (2, 6), (16, 6)) == ()
    rows_at_points = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
    assert rules.gather_lookup_axes(rows_at_points, (1, 1, 6), (4, 8, 6)) == ()  # CLIP's x[arange(B), argmax]


def test_take_along_axis_is_a_masked_lookup(mesh: Any) -> None:
    """``take_along_axis`` is a gather with batching dims (operand dims 0, 1 paired with
    the indices'), one row looked up along the last dim: the masked lookup (operand
    S(2), indices R -> P) besides the batching pairs; predicted without moving the
    log-probabilities (an all-to-all to the batch split before stop 30's lookup)."""
    logp, ids = jax.ShapeDtypeStruct((4, 8, 64), F32), jax.ShapeDtypeStruct((4, 8, 1), jnp.int32)

    def pick(x: jax.Array, i: jax.Array) -> jax.Array:
        return jnp.take_along_axis(x, i, axis=-1)

    gather = _only(jax.make_jaxpr(pick)(logp, ids).jaxpr.eqns[-1].params["jaxpr"].jaxpr, "gather")
    dn, sizes = gather.params["dimension_numbers"], gather.params["slice_sizes"]
    assert (dn.operand_batching_dims, dn.start_index_map, sizes) == ((0, 1), (2,), (1, 1, 1))
    assert rules.gather_lookup_axes(dn, sizes, (4, 8, 64)) == (2,)
    listed = {str(s) for s in rules.gather(_avals(gather.invars), _avals(gather.outvars), dimension_numbers=dn,
                                           slice_sizes=sizes)}
    assert {"S(2),R -> P", "S(0),S(0) -> S(0)", "S(1),S(1) -> S(1)"} <= listed
    layout = Layout.from_device_mesh(mesh)
    looked_up = predict(pick, ((4, 8, 64), F32, layout("S(2)")), ((4, 8, 1), jnp.int32, layout("R")),
                        out_layouts=layout("P"))
    assert looked_up.nbytes == 0


def test_ragged_dot_and_its_gradients_never_split_the_rows() -> None:
    """``lax.ragged_dot`` (m, k) x (g, k, n) with group sizes (g): n splits the output, k
    (both operands) gives P; the rows m are never split (a rank's rows would be read from
    the first group's start); the groups g split on the rhs give P, each rank running its
    own groups over the rows (POSITIONAL: a rank's offset). Its gradients: the rhs's
    contracts the ragged m into one (k, n) block per group, k and n split it, and so do
    the groups (a rank computes its own groups' blocks); the lhs's contracts n. Linear in
    lhs and rhs, never partial in the integer group sizes. The numbers:
    test_inference_programs' PRIM_CASES simulate every candidate per rank, test_operators
    runs the expert-parallel ones through the executors."""
    shapes = (((16, 8), F32), ((4, 8, 12), F32), ((4,), jnp.int32))
    loss = jax.value_and_grad(lambda a, b, s: lax.ragged_dot(a, b, s).sum(), argnums=(0, 1))
    closed = jax.make_jaxpr(loss)(*(jax.ShapeDtypeStruct(*s) for s in shapes))
    definition = primitive_definition("ragged_dot_general")
    listed = [
        {str(s) for s in definition.rule(_avals(e.invars), _avals(e.outvars), **dict(definition.read_params(e.params)))}
        for e in closed.jaxpr.eqns if e.primitive.name == "ragged_dot_general"
    ]
    partials = {"P,R,R -> P", "P(avg),R,R -> P(avg)", "R,P,R -> P", "R,P(avg),R -> P(avg)"}
    forward, rhs_gradient, lhs_gradient = listed
    assert forward == {"S(1),S(1),R -> P", "R,S(2),R -> S(1)", "R,S(0),R -> P"} | partials
    # (m, k) x (m, n) -> (g, k, n)
    assert rhs_gradient == {"S(1),R,R -> S(1)", "R,S(1),R -> S(2)", "R,R,R -> S(0)"} | partials
    # (m, n) x (g, k, n) -> (m, k)
    assert lhs_gradient == {"S(1),S(2),R -> P", "R,S(1),R -> S(1)", "R,S(0),R -> P"} | partials


def test_concatenate_splits_other_dims(mesh: Any) -> None:
    assert placements(infer(mesh, "concatenate", ((8, 4), "S(0)"), ((8, 4), "S(0)"), axis=1)) == ("S(0),S(0)", "S(0)")
    assert placements(infer(mesh, "concatenate", ((8, 4), "P"), ((8, 4), "P"), axis=0)) == ("P,P", "P")
    across = infer(mesh, "concatenate", ((8, 4), "S(1)"), ((8, 4), "S(1)"), axis=1)
    assert not across.in_layouts[0].placements[0].is_shard(1)


# -- OneFlow's worked example and where we do better -----------------------------------------


def test_oneflow_add_example_split0_plus_split1_gives_split0() -> None:
    mesh = init_device_mesh((2,), ("x",))
    signature = infer(mesh, "add", ((2, 4), "S(0)"), ((2, 4), "S(1)"))
    assert placements(signature) == ("S(0),S(0)", "S(0)")
    assert signature.redistributions[0].is_noop
    (step,) = signature.redistributions[1].steps
    assert (step.src, step.dst, step.collective, step.nbytes) == (Shard(1), Shard(0), "all-to-all", 8)


def test_split_plus_broadcast_stays_split(mesh: Any) -> None:
    """OneFlow answers broadcast here (and asks whether split would move less): it does."""
    signature = infer(mesh, "add", ((8, 4), "S(0)"), ((8, 4), "R"))
    assert placements(signature) == ("S(0),S(0)", "S(0)")
    assert signature.cost == 0
    assert [s.collective for s in signature.redistributions[1].steps] == ["local-slice"]


def test_all_replicate_is_always_a_candidate(mesh: Any) -> None:
    for op, inputs, params in [
        ("exp", [((8, 4), "S(0)")], {}),
        ("matmul", [((8, 4), "S(1)"), ((4, 2), "S(0)")], {}),
        ("sum", [((8, 4), "P")], {"axis": 0}),
    ]:
        signature = infer(mesh, op, *inputs, **params)
        assert any(all(not x.has_partial and all(not a for a in x.dim_axes) for x in c.in_layouts + c.out_layouts)
                   for c in signature.candidates)


def test_unknown_op_names_the_op(mesh: Any) -> None:
    with pytest.raises(UnsupportedOpError, match="fft"):
        infer(mesh, "fft", ((8,), "S(0)"))


def test_one_d_signature_text() -> None:
    sig = OneDSig((Shard(1), parse_placement("S(0)")), (P,))
    assert str(sig) == "S(1),S(0) -> P"
    assert sig.placements == (Shard(1), Shard(0), P)


# -- issue 16: reshapes of dims split over several mesh dims move no data ----------------------


@pytest.mark.parametrize(
    ("shape", "layout", "new", "expected"),
    [
        ((4, 8, 16), "S(0),S(1)", (32, 16), "(dp,tp),None"),  # merge: dp splits dim 0 whole
        ((32, 16), (("dp", "tp"), None), (4, 8, 16), "S(0),S(1)"),  # and back
        ((8, 4, 16), (("dp", "tp"), None, None), (32, 16), "(dp,tp),None"),  # split dim leading its group
        ((2, 4, 2, 16), "S(1),S(2)", (2, 8, 16), "None,(dp,tp),None"),
        ((64,), (("tp", "dp"),), (8, 8), "(tp,dp),None"),  # out of mesh order too
        ((64,), (("dp", "tp"),), (2, 32), None),  # dp (4) cannot split the 2 rows whole: moved
    ],
)
def test_reshape_of_multi_axis_splits_is_free(shape: Any, layout: Any, new: Any, expected: str) -> None:
    """Merging or splitting dims split over several mesh dims needs no data moved when the
    splits nest alike (each dim before the last split one is split whole); values per rank
    are checked through DTensor.reshape."""
    from placements2jax import distribute_tensor

    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    spec = (shape, jnp.float32, Layout.from_device_mesh(mesh)(layout))
    signature = infer_signature("reshape", [spec], shape=new)
    if expected is None:
        assert signature.chosen.cost > 0
        return
    assert signature.chosen.cost == 0 and str(signature.out_layouts[0]) == expected
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    y = distribute_tensor(x, mesh, layout).reshape(*new)
    assert str(y.layout) == expected
    for rank in range(8):
        np.testing.assert_array_equal(np.asarray(y.to_local(rank)), x.reshape(new)[y.layout.local_slices(new, rank)])


def test_reshape_of_an_inner_dim_alone_is_a_free_strided_shard() -> None:
    """``8x16 S(1) -> 128`` and ``4x8x16 S(1),R -> 32x16``: torch keeps a _StridedShard
    (each rank holds a strided set of rows), and so does the view candidate, at no cost;
    the inverse split gives the plain layout back, also free."""
    mesh = init_device_mesh((8,), ("x",))
    signature = infer_signature("reshape", [((8, 16), jnp.float32, Layout.from_device_mesh(mesh)("S(1)"))], shape=(128,))
    assert signature.chosen.cost == 0 and str(signature.out_layout) == "_S(0, 8)"
    back = infer_signature("reshape", [((128,), jnp.float32, signature.out_layout)], shape=(8, 16))
    assert back.chosen.cost == 0 and str(back.out_layout) == "S(1)"
    mesh2 = init_device_mesh((4, 2), ("dp", "tp"))
    signature = infer_signature(
        "reshape", [((4, 8, 16), jnp.float32, Layout.from_device_mesh(mesh2)("S(1),R"))], shape=(32, 16)
    )
    assert signature.chosen.cost == 0 and str(signature.out_layout) == "_S(0, 4),R"


# -- windows, FFTs, decompositions ------------------------------------------------------------


def test_window_ops_split_only_dims_of_one_element_windows() -> None:
    """Max-pooling NHWC (2x2 windows, stride 2): the batch and channel dims split, the
    pooled dims do not (no halo exchange); a stride or padding on a one-element window
    keeps its dim whole too. Partials: max through max, sum / avg through sum."""
    pool = dict(window_dimensions=(1, 2, 2, 1), window_strides=(1, 2, 2, 1), padding=((0, 0),) * 4,
                base_dilation=(1,) * 4)
    assert one_d(rules.window, [(8, 6, 6, 4)], [(8, 3, 3, 4)], **pool, partials=("max",)) == {
        "S(0) -> S(0)", "S(3) -> S(3)", "P(max) -> P(max)"}
    strided = dict(window_dimensions=(1, 1, 3), window_strides=(2, 1, 1), padding=((0, 0), (1, 0), (1, 1)),
                   base_dilation=(1, 1, 1))
    assert one_d(rules.window, [(8, 6, 6)], [(4, 7, 6)], **strided, partials=rules.LINEAR_OPS) == {
        "P -> P", "P(avg) -> P(avg)"}
    # max-pooling's gradient (cotangent, operand): linear in the cotangent alone
    assert one_d(rules.window, [(8, 3, 3, 4), (8, 6, 6, 4)], [(8, 6, 6, 4)], **pool, partials=("sum",)) == {
        "S(0),S(0) -> S(0)", "S(3),S(3) -> S(3)", "P,R -> P"}


def test_fft_linalg_and_triangular_solve_split_their_batch() -> None:
    assert one_d(rules.fft, [(4, 6, 8)], [(4, 6, 5)], fft_lengths=(8,)) == {
        "S(0) -> S(0)", "S(1) -> S(1)", "P -> P", "P(avg) -> P(avg)"}
    assert one_d(rules.fft, [(4, 6, 8)], [(4, 6, 8)], fft_lengths=(6, 8)) == {"S(0) -> S(0)", "P -> P",
                                                                             "P(avg) -> P(avg)"}
    # svd: singular values, u, vt keep the batch; nothing else splits, no partial passes
    assert one_d(rules.linalg, [(3, 2, 6, 5)], [(3, 2, 5), (3, 2, 6, 5), (3, 2, 5, 5)]) == {
        "S(0) -> S(0),S(0),S(0)", "S(1) -> S(1),S(1),S(1)"}
    assert one_d(rules.linalg, [(3, 4)], [(3, 6)], core_dims=1) == {"S(0) -> S(0)"}  # pivots -> permutation
    # tridiagonal: the reduced matrix, its diagonal, off-diagonal and reflectors' taus keep the batch
    assert one_d(rules.linalg, [(3, 5, 5)], [(3, 5, 5), (3, 5), (3, 4), (3, 4)]) == {"S(0) -> S(0),S(0),S(0),S(0)"}
    # b's right-hand sides are independent solves, but XLA gathers them (rules.BATCH_PARTITIONED): no split
    for b in ((3, 5, 7), (3, 7, 5)):  # left_side (b's columns solved apart) or not (its rows)
        assert one_d(rules.triangular_solve, [(3, 5, 5), b], [b]) == {"S(0),S(0) -> S(0)", "R,P -> P", "R,P(avg) -> P(avg)"}


def test_a_slice_masks_a_dim_it_takes_at_most_half_of() -> None:
    """``slices``: dims kept whole may be split (as ``slice_full_dims``); a dim sliced to
    at most half its extent may be split too, its result ``P(sum)`` (the masked slice,
    POSITIONAL); a dim sliced to more than half is not (gathering the operand sends less
    than reducing the result). A dynamic slice has the same, its start indices ``R``."""
    x = Aval((4, 16, 8), F32)
    listed = {str(s) for s in rules.slices([x], [Aval((4, 1, 5), F32)])}
    assert {"S(0) -> S(0)", "S(1) -> P"} <= listed and "S(2) -> P" not in listed
    (masked,) = [s for s in rules.slices([x], [Aval((4, 1, 5), F32)]) if str(s) == "S(1) -> P"]
    assert masked.joint is rules.POSITIONAL
    dynamic = {str(s): s for s in primitive_definition("dynamic_slice").rule(
        [x, Aval((), jnp.int32), Aval((), jnp.int32), Aval((), jnp.int32)], [Aval((4, 1, 8), F32)])}
    assert {"S(0),R,R,R -> S(0)", "S(2),R,R,R -> S(2)", "S(1),R,R,R -> P"} <= set(dynamic)
    assert dynamic["S(1),R,R,R -> P"].joint is rules.POSITIONAL


def test_a_bitcast_splits_the_dims_before_the_bytes_of_an_element() -> None:
    """``bitcast``: of one width, elementwise (no partial: bits are not linear); to a
    narrower dtype the new trailing dim (one element's bytes) is never split, the dims
    before it are; back to the wider dtype the same."""
    assert one_d(rules.bitcast, [(8, 32)], [(8, 32)]) == {"S(0) -> S(0)", "S(1) -> S(1)"}
    narrowed = [Aval((8, 32, 4), jnp.uint8)]
    assert {str(s) for s in rules.bitcast([Aval((8, 32), F32)], narrowed)} == {"S(0) -> S(0)", "S(1) -> S(1)"}
    assert {str(s) for s in rules.bitcast(narrowed, [Aval((8, 32), F32)])} == {"S(0) -> S(0)", "S(1) -> S(1)"}


def test_a_dynamic_update_masks_a_split_dim_it_writes_in_part() -> None:
    """``dynamic_update_slice``: a dim the update covers whole splits both; one it covers
    in part splits the operand alone, the update whole there (the masked update,
    POSITIONAL); partials of both pass."""
    ins = [Aval((2, 16, 4, 8), F32), Aval((2, 1, 4, 8), F32)] + [Aval((), jnp.int32)] * 4
    sigs = {str(s): s for s in rules.dynamic_update_slice(ins, [ins[0]])}
    assert {"S(0),S(0),R,R,R,R -> S(0)", "S(1),R,R,R,R,R -> S(1)", "P,P,R,R,R,R -> P"} <= set(sigs)
    assert sigs["S(1),R,R,R,R,R -> S(1)"].joint is rules.POSITIONAL
    assert sigs["S(0),S(0),R,R,R,R -> S(0)"].joint is None
