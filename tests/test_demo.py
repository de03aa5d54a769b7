"""The layout demo (`placements2jax demo`): tensor-parallel training with torch-style placements."""

import jax
import numpy as np
import pytest

from placements2jax import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    demo,
    distribute_tensor,
    init_device_mesh,
    resolve_layout,
)
from placements2jax.parallelize import path_of

R, S = Replicate(), Shard


@pytest.fixture(scope="module")
def run() -> tuple[demo.TrainingReport, str]:
    printed: list[str] = []
    report = demo.main(steps=4, print_fn=printed.append)
    return report, "\n".join(printed)


def test_mesh_is_dp2_tp4_over_all_devices(run) -> None:
    report, _ = run
    assert report.mesh == init_device_mesh((2, 4), ("dp", "tp"))
    assert [d.id for d in report.mesh.devices.flat] == [d.id for d in jax.devices()]


def test_plan_places_column_then_row_parallel_linears(run) -> None:
    report, _ = run
    expected = {"up/w": (R, S(1)), "up/b": (R, S(0)), "down/w": (R, S(0)), "down/b": (R, R)}
    for path, (shape, layout) in report.layouts.items():
        assert layout.placements == expected[path.split("/", 2)[2]], path
    assert report.layouts["layers/0/up/w"] == ((32, 128), resolve_layout(report.mesh, (R, S(1)), 2))


def test_loss_goes_down_and_equals_plain_jax(run) -> None:
    report, _ = run
    assert report.loss_decreased
    assert all(b < a for a, b in zip(report.losses, report.losses[1:]))
    np.testing.assert_allclose(report.losses, report.reference_losses, rtol=1e-5)
    assert report.max_param_difference < 1e-5


def test_trained_shards_are_the_blocks_of_the_plain_jax_parameters(run) -> None:
    report, _ = run
    reference = {path_of(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(report.reference_params)[0]}
    trained = jax.tree_util.tree_flatten_with_path(report.params, is_leaf=lambda x: isinstance(x, DTensor))[0]
    for key_path, dtensor in trained:
        path = path_of(key_path)
        for rank in report.mesh.rank_list:
            block = reference[path][dtensor.layout.local_slices(dtensor.shape, rank)]
            np.testing.assert_allclose(np.asarray(dtensor.to_local(rank)), block, atol=1e-5, err_msg=f"{path} {rank}")


def test_compiled_step_keeps_every_planned_layout(run) -> None:
    report, _ = run
    assert report.layouts_kept
    for path, (_, layout) in report.layouts.items():
        assert report.compiled_param_layouts[path] == layout


def test_predicted_layouts_are_xlas_after_the_data_parallel_reduction(run) -> None:
    """check(): every output's predicted layout is XLA's once the gradient's partial sum
    over dp (the batch is split over dp) is reduced; nothing else differs."""
    report, _ = run
    assert report.output_names == ("loss", *report.layouts)
    for name, out in zip(report.output_names, report.check.outputs):
        assert out.verdict == "xla reduced partial", (name, out.note)
        assert out.predicted.partial == ("sum", None)
        planned = report.layouts[name][1] if name != "loss" else resolve_layout(report.mesh, (R, R), 0)
        assert out.compiled == planned, name


def test_collectives_per_step(run) -> None:
    """Megatron's pattern: one all-reduce over tp per row-parallel output (2 layers) and
    one per column-parallel input gradient (layer 1; layer 0's input is data), plus the
    data-parallel gradient all-reduce over dp, which XLA combines into one."""
    report, _ = run
    compiled = [(c.op, c.mesh_axes(report.mesh)) for c in report.collectives]
    assert sorted(compiled) == [("all-reduce", ("dp",))] + [("all-reduce", ("tp",))] * 3
    communication = report.communication
    assert set(communication) == {("all-reduce", "dp"), ("all-reduce", "tp")}
    predicted_count, predicted_bytes, compiled_count, compiled_bytes = communication[("all-reduce", "tp")]
    assert (predicted_count, compiled_count) == (3, 3)
    # each moves a (16, 32) float32 block per device: 2 * 2048 * (4-1)/4 bytes
    assert predicted_bytes == compiled_bytes == 3 * 3072
    assert communication[("all-reduce", "dp")][0] == 1 + len(report.layouts)  # the loss and each gradient
    assert report.communication_agrees


def test_printed_report(run) -> None:
    _, text = run
    assert text.index("tensor_map") < text.index("tensor-parallel training")
    assert "P,S(0)       | (0, -1) +partial sum | tp,None      | P('tp', None, unreduced={'dp'})" in text
    # a dim split by two mesh axes prints in the alias form (which parses back), never S(0),S(0)
    assert "(dp,tp),None | ((1, 0), -1)         | (dp,tp),None | P(('dp', 'tp'), None)" in text
    assert "(tp,dp),None | ((0, 1), -1)         | (tp,dp),None | P(('tp', 'dp'), None)" in text
    for line in [
        "2 residual MLP blocks x + down(gelu(up(x))) on mesh dp=2 x tp=4 (8 cpu devices)",
        "  layers/\\d+/up/.*       colwise(tp)",
        "layers/0/up/w   | (32, 128) | R,S(1)     | P(None, 'tp') | (32, 32)",
        "loss went down",
        "XLA compiled every updated parameter in its planned layout",
        "collectives per training step: predicted vs compiled (bytes per device agree",
        "all-reduce | tp        | 3         | 9216         | 3        | 9216",
    ]:
        assert line in text, line


def test_the_forward_runs_torch_tensor_parallelism_on_dtensors(run) -> None:
    """Eagerly, op by op: colwise output S(0),S(1), rowwise output the partial sum S(0),P
    (what the report prints), all-reduced to S(0),R; values as plain JAX."""
    report, _ = run
    mesh = report.mesh
    x = distribute_tensor(np.random.default_rng(3).normal(size=(16, 32)).astype(np.float32), mesh, demo.BATCH)
    layer = report.params["layers"][0]
    hidden = x @ layer["up"]["w"] + layer["up"]["b"]
    assert hidden.placements == (S(0), S(1))
    partial_sum = hidden @ layer["down"]["w"]
    assert partial_sum.placements == demo.PARTIAL_SUM == (S(0), Partial())
    assert partial_sum.redistribute(placements=demo.BATCH).placements == demo.BATCH
    one_block = {"layers": [layer]}
    plain = jax.tree.map(lambda d: np.asarray(d.full_tensor()), one_block, is_leaf=lambda v: isinstance(v, DTensor))
    np.testing.assert_allclose(
        np.asarray(demo.forward(one_block, x).full_tensor()),
        np.asarray(demo.forward(plain, np.asarray(x.full_tensor()))),
        rtol=1e-5,
        atol=1e-5,
    )


def test_demo_mesh_adapts_to_the_device_count() -> None:
    devices = jax.devices()
    assert demo.demo_mesh(devices[:4]).shape == (1, 4)
    assert demo.demo_mesh(devices[:6]).shape == (3, 2)
    assert demo.demo_mesh(devices[:1]).shape == (1, 1)
