"""check: predictions against XLA's compiled shardings and collectives."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from models.block import block
from models.common import compiled_pinned

from placements2jax import (
    ArgumentTypeError, DTensor, InferenceError, Layout, Partial, Replicate, Shard, apply, distribute_tensor,
    init_device_mesh,
)
from placements2jax.hlo import parse_collectives
from placements2jax.inference import CostModel, check
from placements2jax.inference.check import collective_nbytes
from placements2jax.operators import EXECUTES
from placements2jax.schedules import default_policy, redistribute_schedule, use_policy

F32 = jnp.float32
B, T, D = 4, 8, 16


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh((2, 4), ("dp", "tp"))


def spec(mesh: Any, shape: tuple[int, ...], placements: Any) -> tuple[Any, ...]:
    return (shape, F32, Layout.from_device_mesh(mesh)(placements))




def block_inputs(mesh: Any, tensor_parallel: bool) -> list[tuple[Any, ...]]:
    column, row = ("R,S(1)", "R,S(0)") if tensor_parallel else ("R,R", "R,R")
    return [
        spec(mesh, (B, T, D), "S(0),R"),
        *(spec(mesh, (D, D), column) for _ in range(3)),
        spec(mesh, (D, D), row),
        spec(mesh, (D, 4 * D), column),
        spec(mesh, (4 * D, D), row),
        *(spec(mesh, (D,), "R,R") for _ in range(4)),
    ]


def test_megatron_mlp_agrees_after_xla_reduces_the_partial(mesh: Any) -> None:
    def mlp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return jax.nn.gelu(x @ w1) @ w2

    report = check(mlp, spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(1)"), spec(mesh, (32, 16), "R,S(0)"))
    (out,) = report.outputs
    assert (str(out.predicted), str(out.compiled), out.verdict) == ("S(0),P", "S(0),R", "xla reduced partial")
    assert "all-reduce" in out.note
    assert report.communication == "equal" and report.compiled_counts == {"all-reduce": 1}
    assert report.predicted_bytes == report.compiled_bytes == Fraction(2 * 4 * 16 * 4 * 3, 4)


def _grouped_conv_loss(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.lax.conv_general_dilated(
        x, w, (1,), [(2, 0)], dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=4)
    return jnp.sum(out ** 2)


def test_check_notes_the_outputs_of_a_batch_grouped_conv(mesh: Any) -> None:
    """A grouped conv's weight gradient (a batch-grouped conv, which XLA with JAX 0.10.2
    all-reduces over all 8 devices of dp=2 x tp=4) is noted as possibly wrong in XLA's
    program, and so is the SGD update computed from it; the loss and the input gradient
    (feature-grouped) are not, and on a 1-D mesh nothing is."""

    def step(x: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
        loss, (dx, dw) = jax.value_and_grad(_grouped_conv_loss, argnums=(0, 1))(x, w)
        return loss, dx, w - 0.1 * dw

    for shape, names, batch, wanted in (((2, 4), ("dp", "tp"), "S(0),R", [2]), ((8,), ("dp",), "S(0)", [])):
        on = init_device_mesh(shape, names)
        weight = "R,R" if len(shape) == 2 else "R"
        report = check(step, spec(on, (8, 12, 16), batch), spec(on, (3, 4, 16), weight))
        noted = [o.index for o in report.outputs if "XLA's compiled values may be wrong" in o.note]
        assert noted == wanted, report


def _lookup_loss(table: jax.Array, ids: jax.Array, w: jax.Array) -> jax.Array:
    return (table[ids] * w).sum()


@pytest.mark.parametrize("placements", ["R,S(0)", "S(0),R"])
@pytest.mark.parametrize(
    "fn",
    [
        jax.grad(_lookup_loss),
        jax.grad(lambda t, i, w: (jax.vmap(lambda k: t[k])(i[0]) * w[0]).sum()),  # eqx.nn.Embedding's lookup
        lambda t, i, u: t.at[i].add(u),
        lambda t, i, u: t.at[i].set(u),
        lambda t, i, u: t.at[i].max(u),
    ],
    ids=["grad", "vmapped grad", "add", "set", "max"],
)
def test_check_embedding_gradients_into_a_vocabulary_split_table(mesh: Any, fn: Any, placements: str) -> None:
    """Scatters into a vocabulary-split table (ids and updates Replicate) are predicted
    as XLA compiles them: each rank updates its own rows (the masked scatter, of every
    kind), nothing is sent and the table keeps its layout."""
    table, ids = spec(mesh, (12, 6), placements), ((2, 5), jnp.int32, Layout.from_device_mesh(mesh)("R,R"))
    report = check(fn, table, ids, spec(mesh, (2, 5, 6), "R,R"), out_layouts=table[2])
    assert [(str(o.predicted), o.verdict) for o in report.outputs] == [(placements, "equal")]
    assert report.communication == "equal" and report.predicted_bytes == report.compiled_bytes == 0


def test_transformer_block_tensor_parallel(mesh: Any) -> None:
    """Eager (op by op) prediction: the output agrees after XLA's eager reduction; the
    communication differs and the report says why (partials carried through the
    decomposed layer norm are reduced twice). The whole-program prediction reduces the
    attention output once, as XLA does: the same collectives and bytes."""
    eager = check(block, *block_inputs(mesh, tensor_parallel=True), search="eager")
    (out,) = eager.outputs
    assert (str(out.predicted), str(out.compiled), out.verdict) == ("S(0),P", "S(0),R", "xla reduced partial")
    assert out.note and [s.collective for s in out.conversion.steps] == ["all-reduce"]
    assert eager.compiled_counts == {"all-reduce": 2}  # after the attention and after the MLP
    assert eager.communication == "differs" and "eager" in eager.communication_note
    assert eager.predicted_bytes > eager.compiled_bytes
    text = str(eager)
    assert "verdict" in text and "collective | predicted | XLA | XLA operands" in text and "why: " in text

    program = check(block, *block_inputs(mesh, tensor_parallel=True))
    assert program.prediction.cost < eager.prediction.cost
    assert [o.verdict for o in program.outputs] == ["xla reduced partial"]
    assert program.communication == "equal" and program.predicted_bytes == program.compiled_bytes == 3072
    assert program.predicted_counts == program.compiled_counts == {"all-reduce": 2}


def test_transformer_block_data_parallel_needs_no_communication(mesh: Any) -> None:
    report = check(block, *block_inputs(mesh, tensor_parallel=False))
    (out,) = report.outputs
    assert out.verdict == "equal" and str(out.predicted) == "S(0),R"
    assert report.agrees and not report.compiled_collectives and report.prediction.cost == 0


def test_partial_sum_inputs_compile_on_the_explicit_mesh(mesh: Any) -> None:
    report = check(jnp.add, spec(mesh, (8, 16), "S(0),P"), spec(mesh, (8, 16), "S(0),P"))
    assert report.mode == "explicit" and report.agrees
    assert str(report.outputs[0].compiled) == "S(0),P"


# Functions linear in a Partial(sum) input with operands not partial (a literal, a NumPy
# scalar, a Replicate DTensor) or with two partial inputs (a difference), and the NumPy
# value of each on the logical values.
_LINEAR_IN_PARTIAL = {
    "a * 2": (lambda a, b, y: a * 2, lambda a, b, y: a * 2),
    "2 * a": (lambda a, b, y: 2 * a, lambda a, b, y: 2 * a),
    "a * np.float32(2)": (lambda a, b, y: a * np.float32(2), lambda a, b, y: a * np.float32(2)),
    "a / 2": (lambda a, b, y: a / 2, lambda a, b, y: a / 2),
    "-a": (lambda a, b, y: -a, lambda a, b, y: -a),
    "a * y": (lambda a, b, y: a * y, lambda a, b, y: a * y),
    "a - b": (lambda a, b, y: a - b, lambda a, b, y: a - b),
}


@pytest.mark.parametrize("name", list(_LINEAR_IN_PARTIAL))
def test_ops_linear_in_a_partial_sum_input_compile_and_run(mesh: Any, name: str) -> None:
    """JAX's typing of unreduced values (jax 0.10.2) refused ``x * 2`` (the literal is not
    ``reduced``), ``-x``, ``x / 2`` and ``x - y`` (no unreduced rule) for a Partial(sum)
    input: check compiles them as XLA partitions them, the partial kept, nothing sent; and
    every route that runs them (apply in each execute mode, the DTensor operators, under
    jax.jit) gives the partial's sum through fn, per device and in full."""
    fn, want = _LINEAR_IN_PARTIAL[name]
    rng = np.random.default_rng(0)
    a_locals = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(8)]
    b_locals = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(8)]
    y_full = rng.standard_normal((8, 16)).astype(np.float32)
    placements = [Shard(0), Partial()]
    a = DTensor.from_local(a_locals, mesh, placements)
    b = DTensor.from_local(b_locals, mesh, Layout.from_device_mesh(mesh)(("dp", None), partial={"tp": "sum"}))
    y = distribute_tensor(y_full, mesh, [Replicate(), Replicate()])

    def logical(locals_: list[np.ndarray]) -> np.ndarray:  # rows of dp block d: the sum of its tp ranks' blocks
        return np.concatenate([np.sum(locals_[4 * d:4 * d + 4], axis=0) for d in range(2)])

    expected = want(logical(a_locals), logical(b_locals), y_full)

    report = check(lambda a, b, y: fn(a, b, y), a, b, y)
    assert report.mode == "explicit" and report.agrees and not report.compiled_collectives
    assert [(str(o.predicted), str(o.compiled), o.verdict) for o in report.outputs] == [("S(0),P", "S(0),P", "equal")]
    runs = {f"apply {execute}": lambda execute=execute: apply(fn, a, b, y, execute=execute) for execute in EXECUTES}
    runs["operators"] = lambda: fn(a, b, y)
    runs["jax.jit(operators)"] = lambda: jax.jit(fn)(a, b, y)
    runs["jax.jit(apply)"] = lambda: jax.jit(lambda a, b, y: apply(fn, a, b, y))(a, b, y)
    for route, run in runs.items():
        out = run()
        assert str(out.layout) == "S(0),P", route
        np.testing.assert_allclose(np.asarray(out.full_tensor()), expected, rtol=1e-6, atol=1e-6, err_msg=route)
        for d in range(2):  # each dp row's tp ranks hold partial values summing to its rows
            block = np.sum([np.asarray(out.to_local(4 * d + t)) for t in range(4)], axis=0)
            np.testing.assert_allclose(block, expected[4 * d:4 * d + 4], rtol=1e-5, atol=1e-5, err_msg=route)
        if route in ("apply ops", "operators"):  # op by op: each rank applies fn to its own partial block
            for r in range(8):
                local = want(a_locals[r], b_locals[r], y_full[4 * (r // 4):4 * (r // 4) + 4])
                np.testing.assert_allclose(np.asarray(out.to_local(r)), local, rtol=1e-6, err_msg=f"{route} rank {r}")


def test_values_made_without_a_sharding_compile_on_the_mesh_with_partial_inputs(mesh: Any) -> None:
    """With a Partial(sum) input, check lowers on the Explicit mesh under jax.set_mesh:
    the gradient of ``(a * 2).sum()`` (2 everywhere, made from a literal) and a constant
    output were kept on one device or refused ("Length of device assignment 1")."""
    partial = spec(mesh, (8, 16), "S(0),P")
    for fn in (jax.grad(lambda a: (a * 2).sum()), lambda a: (jnp.ones((8, 16)), a * 2)):
        report = check(fn, partial)
        assert report.agrees and not report.compiled_collectives
        assert [o.verdict for o in report.outputs] == ["equal"] * len(report.outputs)
    a = DTensor.from_local([np.full((4, 16), r, np.float32) for r in range(8)], mesh, [Shard(0), Partial()])
    grad = apply(jax.grad(lambda a: (a * 2).sum()), a)
    np.testing.assert_array_equal(np.asarray(grad.full_tensor()), np.full((8, 16), 2, np.float32))


def test_ops_not_linear_in_a_partial_sum_input_are_refused_by_check(mesh: Any) -> None:
    """A product of two partials (bilinear) or exp of one: the prediction reduces first, XLA
    on the Explicit mesh refuses the unreduced operand; check says so with our error."""
    partial = spec(mesh, (8, 16), "S(0),P")
    for fn in (lambda a: a * a, jnp.exp):
        with pytest.raises(InferenceError, match=r"could not compile fn.*reduce Partial inputs first"):
            check(fn, partial)


def test_the_report_names_the_schedule_redistribute_runs_for_each_move(mesh: Any) -> None:
    """Every redistribution the report lists (the prediction's and the conversions of
    outputs to XLA's layouts) names the schedule DTensor.redistribute runs under the
    policy (the current default unless given), with its compiled collectives and bytes."""
    # The MLP's partial output: the report converts it to XLA's reduced layout (row out.0).
    def mlp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return jax.nn.gelu(x @ w1) @ w2

    inputs = spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(1)"), spec(mesh, (32, 16), "R,S(0)")
    report = check(mlp, *inputs)
    assert report.policy == default_policy() == "cost"
    ((where, plan),) = report.redistributions
    assert (where, str(plan.src), str(plan.dst)) == ("out.0", "S(0),P", "S(0),R")
    (schedule,) = report.schedules
    assert schedule == redistribute_schedule(plan.shape, plan.dtype, plan.src, plan.dst, "cost")
    text = str(report)
    assert "redistributions, as DTensor.redistribute runs them (policy cost)" in text
    row = next(line for line in text.splitlines() if line.startswith("out.0 "))
    assert f"| {schedule.name} " in row and "all-reduce(f32[4, 16])" in row and f"| {schedule.nbytes}" in row

    # A move the program makes (out_layouts from Partial(sum) to Shard): min_bytes runs the
    # direct reduce-scatter, "xla" XLA's reshard (an all-reduce on CPU), at half the bytes.
    partial, target = spec(mesh, (8, 16), "S(0),P"), Layout.from_device_mesh(mesh)("S(0),S(1)").bind(2)
    by_policy = {}
    for policy in ("min_bytes", "xla"):
        report = check(lambda x: x, partial, out_layouts=target, policy=policy)
        ((where, plan),) = report.redistributions
        assert where == "program" and (str(plan.src), str(plan.dst)) == ("S(0),P", "S(0),S(1)")
        (by_policy[policy],) = report.schedules
        assert f"(policy {policy})" in str(report) and f"| {by_policy[policy].name} " in str(report)
    assert by_policy["min_bytes"].name == "direct" and [c.op for c in by_policy["min_bytes"].collectives] == [
        "reduce-scatter"
    ]
    assert [c.op for c in by_policy["xla"].collectives] == ["all-reduce"]
    assert by_policy["min_bytes"].nbytes * 2 == by_policy["xla"].nbytes
    with use_policy("min_bytes"):
        assert check(lambda x: x, partial, out_layouts=target).schedules[0].name == "direct"
    with pytest.raises(ArgumentTypeError, match="policy="):
        check(lambda x: x, partial, policy="fastest")


def test_uncompilable_inputs_say_why(mesh: Any) -> None:
    with pytest.raises(InferenceError, match=r"Partial\(max\)"):
        check(jnp.exp, spec(mesh, (8, 16), "S(0),P(max)"))
    with pytest.raises(InferenceError, match="uneven"):
        check(jnp.exp, spec(mesh, (8, 10), "S(0),S(1)"))
    with pytest.raises(InferenceError, match="could not compile"):
        check(jnp.matmul, spec(mesh, (8, 16), "S(0),P"), spec(mesh, (16, 16), "R,R"))
    auto = init_device_mesh((2, 4), ("dp", "tp"), axis_types="auto")
    with pytest.raises(InferenceError, match="Explicit"):
        check(jnp.exp, spec(auto, (8, 16), "S(0),P"))


def test_bytes_of_compiled_collectives_in_all_replica_group_notations() -> None:
    text = """
  %all-reduce = f32[1,8,16]{2,1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %all-gather = f32[4,16]{1,0} all-gather(%p), channel_id=2, replica_groups=[4,2]<=[2,2,2]T(2,1,0), dimensions={0}
  %all-to-all.1 = (f32[1,2,4]{2,1,0}, f32[1,2,4]{2,1,0}, f32[1,2,4]{2,1,0}, f32[1,2,4]{2,1,0}) all-to-all(%a, %b, %c, %d), \
channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}
  ROOT %all-reduce.2 = f32[4]{0} all-reduce(%w), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4], \
device_ids=([4,2]T(1,0)) {'axis_0'}, to_apply=%region
  %reduce-scatter = bf16[2,8]{1,0} reduce-scatter(%y), replica_groups={}, dimensions={0}
  %collective-permute = f32[2,16]{1,0} collective-permute(%param), source_target_pairs={{0,1},{1,0}}
  %fusion = f32[4]{0} fusion(%all-reduce), kind=kLoop
"""
    found = parse_collectives(text)
    assert [(c.op, c.group_size if c.groups else 8, collective_nbytes(c, 8)) for c in found] == [
        ("all-reduce", 2, 512),  # 2 * 512 B * 1/2
        ("all-gather", 2, 128),  # 256 B * 1/2
        ("all-to-all", 4, 96),  # block 128 B * 3/4
        ("all-reduce", 2, 16),
        ("reduce-scatter", 8, 32 * 7),  # result 32 B, input 8 x 32 B
        ("collective-permute", 2, 128),
    ]


def test_collective_checks_name_a_reduce_scatter_compiled_as_an_all_reduce(mesh: Any) -> None:
    """A row-parallel MLP whose output must be split: the predicted reduce-scatter is an
    all-reduce (and a slice) in CPU XLA; the per-kind comparison says so and counts it at
    twice its bytes, which is then exactly what XLA moves."""

    def mlp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return jax.nn.gelu(x @ w1) @ w2

    inputs = (spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(1)"), spec(mesh, (32, 16), "R,S(0)"))
    report = check(mlp, *inputs, out_layouts=Layout.from_device_mesh(mesh)("S(0),S(1)"))
    assert report.prediction.collectives == {"reduce-scatter": 1}
    (kind,) = report.collective_checks
    assert (kind.kind, kind.predicted, kind.compiled, kind.operands, kind.lowered) == ("all-reduce", 1, 1, 1, 1)
    assert kind.predicted_bytes == kind.compiled_bytes == Fraction(2 * 8 * 16 * 4 * 3, 2 * 4)
    assert "compiled as all-reduces" in kind.note and "reduce-scatter(s) compiled" in str(report)
    assert "XLA legitimately sends 192 B per device more than they would" in kind.note  # the reduce-scatter's 192 B
    # the prediction's own figure of the same: its bytes as the backend compiles its steps
    assert report.prediction.nbytes == Fraction(8 * 16 * 4 * 3, 2 * 4)  # the planner's reduce-scatter
    assert report.prediction.lowered_nbytes == report.predicted_bytes == report.compiled_bytes


def test_collective_checks_name_the_gathers_of_xlas_fft_partitioning(mesh: Any) -> None:
    """A spectral mixing of a batch-split input (FNet's, along the sequence): XLA gathers
    each FFT's operand whole (jax 0.10.2, CPU), though only the batch is split; the
    prediction computes each FFT where it is, no collective. The per-kind comparison
    says which of XLA's gathers its FFT partitioning made (each collective's op_name),
    where it said only "XLA's own choice"."""

    def mix(x: jax.Array) -> jax.Array:
        return jnp.fft.irfft(jnp.fft.rfft(x, axis=1) * 0.5, n=8, axis=1)

    report = check(mix, spec(mesh, (4, 8, 16), "S(0),R"))
    assert report.prediction.collectives == {} and [out.verdict for out in report.outputs] == ["equal"]
    (kind,) = report.collective_checks
    assert (kind.kind, kind.predicted, kind.compiled) == ("all-gather", 0, 2)
    assert kind.compiled_bytes == 2304  # the two gathers: all of XLA's bytes
    assert kind.note.startswith("2 of XLA's (2304 B per device) are its partitioning of an FFT")
    assert all(c.op_name.endswith("/fft") for c in report.compiled_collectives)


def test_the_collectives_of_shard_map_regions_are_predicted(mesh: Any) -> None:
    """A row-parallel matmul written as a shard_map region (each tp rank's partial product,
    psum over tp), and its gradient: the prediction takes the region's in_specs and
    out_specs as fixed layouts and counts what its body sends (read off the body: the
    psum, and in the gradient its transpose's all-reduce), as XLA compiles it; the
    per-kind note names both sides' region collectives (XLA's by their op_name)."""
    auto = jax.sharding.Mesh(mesh.devices, mesh.alias_name, axis_types=(AxisType.Auto,) * 2)

    def region(x: jax.Array, w: jax.Array) -> jax.Array:
        summed = jax.shard_map(lambda xs, ws: jax.lax.psum(xs @ ws, "tp"), mesh=auto,
                               in_specs=(P("dp", None, "tp"), P("tp", None)), out_specs=P("dp"))
        return jnp.tanh(summed(x, w))

    inputs = (spec(mesh, (4, 8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(0)"))
    forward = check(region, *inputs)
    (kind,) = forward.collective_checks
    assert (kind.kind, kind.predicted, kind.compiled) == ("all-reduce", 1, 1)
    # (2, 8, 32) float32 all-reduced over tp's 4: 2 x 3/4 x 2,048 B
    assert kind.predicted_bytes == kind.compiled_bytes == forward.prediction.nbytes == 3072
    assert kind.note.startswith("1 of XLA's (3072 B per device) hold fn's own collectives inside shard_map regions")
    assert "1 of the prediction's (3072 B)" in kind.note
    assert forward.communication == "equal" and forward.agrees
    grad = check(lambda x, w: jax.grad(lambda w: region(x, w).sum())(w), *inputs)
    (kind,) = [c for c in grad.collective_checks if c.kind == "all-reduce"]
    assert "2 of XLA's" in kind.note and "inside shard_map regions" in kind.note
    assert grad.predicted_bytes == grad.compiled_bytes
    assert grad.predicted_combined_counts == grad.compiled_counts


def test_communication_is_equal_only_with_the_same_bytes(mesh: Any) -> None:
    """A bfloat16 Megatron MLP's mean: the prediction keeps the row-parallel partial sum
    through the cast to float32 and the mean and all-reduces the scalar (10 B per device
    over tp and dp), XLA all-reduces the bfloat16 activations over tp (1,540 B): two
    all-reduces on each side, which counts alone called ``equal``."""

    def loss(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return (jax.nn.gelu(x @ w1) @ w2).astype(jnp.float32).mean()

    layout = Layout.from_device_mesh(mesh)
    inputs = (((4, 8, 16), jnp.bfloat16, layout("S(0),R")), ((16, 32), jnp.bfloat16, layout("R,S(1)")),
              ((32, 16), jnp.bfloat16, layout("R,S(0)")))
    report = check(loss, *inputs)
    assert report.predicted_combined_counts == report.compiled_counts == {"all-reduce": 2}
    assert (report.predicted_bytes, report.compiled_bytes) == (10, 1540)
    assert report.communication == "differs" and not report.agrees
    assert report.communication_note.startswith("XLA moves more bytes than predicted in other collectives")


def test_a_bfloat16_collective_counts_the_float32_one_cpu_xla_sends(mesh: Any) -> None:
    """CPU XLA runs a bfloat16 collective in float32 (converted before, back after): the
    same row-parallel MLP in bfloat16 (its reduce-scatter an all-reduce, as above) sends
    what the float32 one sends, and the prediction counts it so
    (a float16 one stays: CPU XLA reduces float16)."""

    def mlp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return jax.nn.gelu(x @ w1) @ w2

    out = Layout.from_device_mesh(mesh)("S(0),S(1)")
    reports = {}
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        inputs = (spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(1)"), spec(mesh, (32, 16), "R,S(0)"))
        inputs = tuple((shape, dtype, layout) for shape, _, layout in inputs)
        reports[dtype] = check(mlp, *inputs, out_layouts=out)
    f32, bf16, f16 = (reports[d] for d in (jnp.float32, jnp.bfloat16, jnp.float16))
    assert bf16.prediction.nbytes == f16.prediction.nbytes == f32.prediction.nbytes / 2  # the planner's bytes
    assert bf16.predicted_bytes == bf16.compiled_bytes == bf16.prediction.lowered_nbytes == f32.compiled_bytes
    assert f16.predicted_bytes == f16.compiled_bytes == f32.compiled_bytes / 2
    (kind,) = bf16.collective_checks
    assert "1 predicted collective(s) of bfloat16 values, which cpu XLA sends in float32" in kind.note


def test_xla_reduces_a_partial_on_two_mesh_axes_one_axis_at_a_time(mesh: Any) -> None:
    """A sum over a dp- and a tp-split dim (a value partial on both mesh axes) reduced
    to Replicate: XLA compiles two all-reduces of the whole block, over tp then over dp
    (320 B per device), not one over all 8 devices (the folded 224 B), even with nothing
    between them. So the planner has no several-axis all-reduce step (issue 15: adding
    one cut GPT-2's adamw step to 1.04x XLA's bytes but predicted 10 all-reduces over
    dp,tp that XLA never compiles). Its plan is a reduce-scatter over tp, an all-reduce
    over dp and an all-gather over tp, one collective more than XLA's: 224 B by the
    planner, as the dp-first route it took before stop 39 (a reduce-scatter over dp, an
    all-reduce over tp, an all-gather over dp); since stop 39 the planner breaks that tie
    last mesh dim first (tp before dp, as XLA reduces), and CPU XLA compiles the tp
    reduce-scatter of the whole block as an all-reduce: 320 B, XLA's bytes (288 B dp
    first)."""
    L = Layout.from_device_mesh(mesh)
    report = check(lambda x: x.sum((0, 1)), spec(mesh, (8, 4, 32), "S(0),S(1)"), out_layouts=L("R,R"))
    assert [o.verdict for o in report.outputs] == ["equal"]
    compiled = [(c.op, c.mesh_axes(mesh)) for c in report.compiled_collectives]
    assert compiled == [("all-reduce", ("tp",)), ("all-reduce", ("dp",))]
    assert report.compiled_bytes == 2 * 128 * 3 / 4 + 2 * 128 / 2
    assert report.prediction.collectives == {"reduce-scatter": 1, "all-reduce": 1, "all-gather": 1}
    assert [(c.kind, c.axes) for c in report.predicted_combined] == [
        ("all-reduce", ("tp",)), ("all-reduce", ("dp",)), ("all-gather", ("tp",))]
    assert report.predicted_bytes == 2 * 128 * 3 / 4 + 2 * 32 / 2 + 32 * 3 == report.compiled_bytes


def test_collective_checks_count_the_operands_of_combined_collectives(mesh: Any) -> None:
    """Two weight gradients reduced over dp: XLA's combiner sends them in one all-reduce
    of two operands; the comparison counts operands and says it combined them."""

    def grads(x: jax.Array, w1: jax.Array, w2: jax.Array) -> Any:
        return jax.grad(lambda w1, w2: jnp.tanh(x @ w1).sum() + jnp.tanh(x @ w2).sum(), argnums=(0, 1))(w1, w2)

    replicated = Layout.from_device_mesh(mesh)("R,R")
    report = check(grads, spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,R"), spec(mesh, (16, 32), "R,R"),
                   out_layouts=(replicated, replicated))
    reduce = {c.kind: c for c in report.collective_checks}["all-reduce"]
    assert (reduce.compiled, reduce.operands) == (1, 2) and report.compiled_operand_counts["all-reduce"] == 2
    assert "combiner merged 2 operands into 1" in reduce.note


def test_collective_checks_count_the_gathers_a_gpu_combiner_would_merge(mesh: Any) -> None:
    """Two independent tp-split vectors sorted: each is all-gathered over tp, two
    all-gathers predicted and compiled on CPU, which combines none; GPU XLA's combiner
    would send them as one, and the kind's note says so."""
    report = check(lambda a, b: (jnp.sort(a), jnp.sort(b)), spec(mesh, (16,), "R,S(0)"), spec(mesh, (16,), "R,S(0)"))
    gathers = {c.kind: c for c in report.collective_checks}["all-gather"]
    assert (gathers.predicted, gathers.compiled) == (2, 2) == (report.predicted_combined_counts["all-gather"], 2)
    assert len(report.prediction.combined("gpu", ())) == 1
    assert gathers.note == (
        "cpu XLA combines no all-gathers: GPU XLA's combiner would merge independent ones over the same mesh axes, "
        "1 fewer"
    )


def test_the_note_says_where_the_plans_part_when_every_output_agrees(mesh: Any) -> None:
    """The two-axis sum above: its output agrees, XLA sends the same bytes in one
    collective fewer (more bytes before stop 39's tp-first tie order). The note does not
    send the reader to the outputs (they agree): it says the bytes match in other
    collectives, that the prediction has more collectives than XLA (issue 15's "never
    more", counted after XLA's combiner) and which kinds and mesh axes differ: the
    all-gather over tp (its reduce-scatter over tp, compiled as an all-reduce on CPU, and
    its all-reduce over dp are XLA's two)."""
    L = Layout.from_device_mesh(mesh)
    report = check(lambda x: x.sum((0, 1)), spec(mesh, (8, 4, 32), "S(0),S(1)"), out_layouts=L("R,R"))
    assert [o.verdict for o in report.outputs] == ["equal"] and report.communication == "same bytes"
    assert (len(report.predicted_combined), len(report.compiled_collectives)) == (3, 2)
    note = report.communication_note
    assert "see the outputs" not in note and note.startswith("same bytes per device in other collectives")
    assert "the prediction has more collectives (3 after XLA's combiner) than XLA (2)" in note
    assert note.endswith("where they differ: all-gather over tp 1 vs 0")
    assert note in str(report)


def test_the_objective_is_priced_by_the_model_the_prediction_was_made_with(mesh: Any) -> None:
    """``CheckReport.objective`` charges each collective the overhead of the cost model
    given to ``check`` (before stop 40 the prediction kept its model only under a
    redistribute policy, so the objective was always priced by the default's): the sum
    over both mesh dims, 3 collectives after XLA's combiner against XLA's 2."""
    L = Layout.from_device_mesh(mesh)
    args = (lambda x: x.sum((0, 1)), spec(mesh, (8, 4, 32), "S(0),S(1)"))
    reports = {o: check(*args, out_layouts=L("R,R"), cost_model=CostModel(collective_overhead=o)) for o in (0, 192, 1000)}
    for overhead, report in reports.items():
        assert report.prediction.cost_model == CostModel(collective_overhead=overhead)
        ours, theirs = report.objective
        assert ours == report.predicted_bytes + overhead * len(report.predicted_combined)
        assert theirs == report.compiled_bytes + overhead * len(report.compiled_collectives)
    default = check(*args, out_layouts=L("R,R"))
    assert default.prediction.cost_model == CostModel()


def test_a_free_outputs_note_names_the_layout_the_search_charged_its_move_to(mesh: Any) -> None:
    """A free output is charged its move to eager dispatch's layout, its partials reduced
    (program.py's objective): where the prediction keeps another layout than XLA's, the
    note says which. A row-parallel ``tanh(x @ w)`` (``x`` ``S(0),S(1)``, ``w`` replicated)
    is reduce-scattered before the tanh, eager dispatch's choice, and returned
    ``(dp,tp),None`` where XLA gathers ``x`` over tp and returns ``S(0),R``; a matmul's
    weight gradient on 2 x 2 x 2 is computed on the weight sliced over ``c``, its move to
    ``R,R,R`` (eager's reduced, XLA's) paid: 1,792 B where XLA sends 3,072."""
    report = check(lambda x, w: jnp.tanh(x @ w), spec(mesh, (8, 16), "S(0),S(1)"), spec(mesh, (16, 32), "R,R"))
    (out,) = report.outputs
    assert (str(out.predicted), str(out.compiled), out.verdict) == ("(dp,tp),None", "S(0),R", "differs")
    assert out.note.endswith("; the search charged this free output its move to the layout its caller takes it in "
                             "((dp,tp),None: eager dispatch's, its partials reduced, or the layout of the inputs it "
                             "updates), not to XLA's")
    assert report.predicted_bytes > report.compiled_bytes
    cube = init_device_mesh((2, 2, 2), ("a", "b", "c"))
    gradient = check(lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w),
                     spec(cube, (16, 32), "R,R,R"), spec(cube, (8, 16), "S(0),S(0),R"))
    (out,) = gradient.outputs
    # since stop 38 ``c``, split by no input, is idle (jaxpr._idle_mesh_dims): the weight is no longer sliced over
    # it and the gradient was XLA's R,R at 192 B per collective (1,152 B in the program; before: R,R,S(1), 1,792 B,
    # the note "kept its own layout as cheaper with it"). The latency-bound default (stop 39) keeps eager dispatch's
    # partials over a and b (no collective in the program; check converts them to XLA's R,R: its 3,072 B)
    assert (str(out.predicted), str(out.compiled), out.verdict) == ("P,P,R", "R,R,R", "xla reduced partial")
    assert gradient.predicted_bytes <= gradient.compiled_bytes == 3072
    eager = check(lambda x, w: jnp.tanh(x @ w), spec(mesh, (8, 16), "S(0),S(1)"), spec(mesh, (16, 32), "R,R"),
                  search="eager")
    assert eager.prediction.callers == () and "the search charged" not in eager.outputs[0].note


def test_an_output_converted_along_a_route_the_program_moved_it_runs_the_shared_step_once(mesh: Any) -> None:
    """The row-parallel MLP's partial output y is returned and also consumed by a
    column-parallel matmul, which needs it reduced: an all-reduce over tp inside the
    program. XLA returns y reduced, so the conversion of the predicted Partial output to
    XLA's layout begins with the same all-reduce of the same value, which the compiled
    program runs once: the predicted counts and bytes (per operand and after XLA's
    combiner) are XLA's, one all-reduce of y's 4x16 block over 4 devices (384 B)."""

    def f(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = jax.nn.gelu(x @ w1) @ w2
        return y, y @ w3

    inputs = (spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(1)"), spec(mesh, (32, 16), "R,S(0)"),
              spec(mesh, (16, 32), "R,S(1)"))
    report = check(f, *inputs)
    assert [(str(o.predicted), str(o.compiled), o.verdict) for o in report.outputs] == [
        ("S(0),P", "S(0),R", "xla reduced partial"), ("S(0),S(1)", "S(0),S(1)", "equal"),
    ]
    (inside,) = report.prediction.redistributions
    conversion = report.outputs[0].conversion
    assert (str(inside.src), str(inside.dst)) == (str(conversion.src), str(conversion.dst)) == ("S(0),P", "S(0),R")
    assert report.prediction.collectives == {"all-reduce": 1}
    assert report.predicted_collectives == [("all-reduce", Fraction(2 * 4 * 16 * 4 * 3, 4))]
    assert report.predicted_counts == report.predicted_combined_counts == report.compiled_counts == {"all-reduce": 1}
    (combined,) = report.predicted_combined
    assert combined.members == (0,) and combined.result_bytes == 4 * 16 * 4  # the one all-reduce of y's block
    assert report.predicted_bytes == report.compiled_bytes == 384
    (kind,) = report.collective_checks
    assert (kind.kind, kind.predicted, kind.compiled, kind.operands, kind.note) == ("all-reduce", 1, 1, 1, "")
    assert report.communication == "equal"
    # eager dispatch runs each move's own: the program's all-reduce and the conversion's
    eager = check(f, *inputs, search="eager")
    assert eager.predicted_counts == {"all-reduce": 2} and eager.predicted_bytes == 2 * 384


def _clipped_sgd_step(params: dict[str, jax.Array], x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A Megatron MLP's step: its loss (a sum over the dp-split batch of the tp-reduced
    rows: partial over dp and tp), its gradients (partial over dp) scaled by their global
    norm (partial over tp, made after their dp all-reduces)."""
    def loss(p: dict[str, jax.Array]) -> jax.Array:
        return jnp.sum(jax.nn.gelu(x @ p["up"]) @ p["down"])

    value, grads = jax.value_and_grad(loss)(params)
    norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))
    scale = 0.1 / jnp.maximum(norm, 1.0)
    return value, jax.tree.map(lambda p, g: p - scale * g, params, grads)


def test_a_loss_partial_over_dp_and_tp_is_reduced_dp_first_where_its_tp_all_reduce_joins_the_norms(
    mesh: Any,
) -> None:
    """The loss, partial over dp and tp, is a free output XLA reduces inside the program.
    Reduced last mesh dim first (XLA's order for one constraint, the planner's default),
    its dp all-reduce joins the gradients' dp group and its tp one, made before that
    group, cannot join the gradient norm's tp all-reduce, made after it: 3 collectives
    after the combiner (Gemma-2's 15 where XLA compiles 14, docs/benchmarks.md section
    14). The prediction reduces it dp first (``Prediction.reduction_orders``): its tp
    all-reduce joins the norm's, 2 collectives; check converts it so, and the pinned
    program reduces it so (its intermediate layout pinned), compiling the predicted
    collectives and bytes, with the values plain JAX computes."""
    L = Layout.from_device_mesh(mesh)
    layouts = {"up": L("R,S(1)"), "down": L("R,S(0)")}
    params = {"up": ((16, 64), F32, layouts["up"]), "down": ((64, 16), F32, layouts["down"])}
    report = check(_clipped_sgd_step, params, spec(mesh, (8, 16), "S(0),R"))
    loss = report.outputs[0]
    assert (str(loss.predicted), str(loss.compiled), loss.verdict) == ("P,P", "R,R", "xla reduced partial")
    assert report.prediction.reduction_orders == ("first first", None, None)
    assert [(s.axis, s.collective) for s in loss.conversion.steps] == [("dp", "all-reduce"), ("tp", "all-reduce")]
    assert [(c.kind, c.axes, len(c.members)) for c in report.predicted_combined] == [
        ("all-reduce", ("dp",), 3), ("all-reduce", ("tp",), 2)]
    assert sum(report.predicted_combined_counts.values()) <= sum(report.compiled_counts.values()) == 3

    compiled, structs = compiled_pinned(report.prediction)
    collectives = parse_collectives(compiled.as_text())
    assert len(collectives) == 2
    assert sum(collective_nbytes(c, mesh.size()) for c in collectives) == report.predicted_bytes

    rng = np.random.default_rng(0)
    plain = {"up": rng.normal(size=(16, 64)).astype(np.float32) / 4, "down": rng.normal(size=(64, 16)).astype(np.float32) / 8}
    x = rng.normal(size=(8, 16)).astype(np.float32)
    leaves = jax.tree.leaves((plain, x))
    arrays = [jax.device_put(a, struct.sharding) for a, struct in zip(leaves, structs)]
    value, new = _clipped_sgd_step({k: jnp.asarray(v) for k, v in plain.items()}, jnp.asarray(x))
    got = compiled(*arrays)
    np.testing.assert_allclose(got[0], value, rtol=1e-5)
    np.testing.assert_allclose(got[1], new["down"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], new["up"], rtol=1e-5, atol=1e-6)
