"""The real training run (`placements2jax train`, the main job of `make demo`): a GPT-style LM born
sharded, trained with adamw, checkpointed and resumed on another mesh and layout, every
loss equal to unsharded training."""

from __future__ import annotations

import numpy as np
import pytest

import placements2jax as p2j
from placements2jax.train_demo import GPTConfig, train_gpt


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return train_gpt(GPTConfig(steps=4, layers=1, dim=32, seq=16, batch=8), str(tmp_path_factory.mktemp("run")),
                     progress=False)


def test_losses_continue_exactly_across_the_resume(report) -> None:
    assert [len(p.losses) for p in report.phases] == [2, 2]
    np.testing.assert_allclose(report.losses, report.reference, rtol=1e-5)
    assert report.losses[-1] < report.losses[0]


def test_resumed_on_another_mesh_and_layout(report) -> None:
    first, second = report.phases
    assert first.mesh.shape == (2, 4) and second.mesh.shape == (4, 2)
    assert first.mesh.is_explicit and second.mesh.is_explicit  # the library's default meshes
    meta = p2j.read_metadata(report.checkpoint)
    assert meta["step"] == 2
    assert meta["leaves"]["params/embed"]["placements"] == "R,S(0)"
    assert meta["leaves"]["params/blocks/qkv"]["mesh"]["shape"] == [2, 4]
    assert meta["leaves"]["state/0/count"]["kind"] == "array"  # optax's count, stored once
    assert str(second.layouts["blocks/qkv"][1]) == "S(1),S(2)" and str(first.layouts["embed"][1]) == "R,S(0)"


def test_collectives_per_step_predicted_beside_compiled(report) -> None:
    """Both sides are real: the prediction of the step on plain arrays (its outputs in the
    step's layouts) and the collectives of the compiled step that ran, per kind and axis."""
    first, second = report.phases
    for phase in report.phases:
        assert phase.prediction is not None and phase.compiled
        rows = phase.communication
        assert sum(r[0] for r in rows.values()) == sum(
            1 for s in phase.prediction.steps if s.nbytes or s.collective not in ("local-slice", "local-partial"))
        assert sum(r[2] for r in rows.values()) == len(phase.compiled)
        assert sum(phase.compiled_counts.values()) == len(phase.compiled)
        combined = phase.combined_counts  # XLA's combiner modelled: it merges collectives, never adds one
        assert combined == dict(phase.prediction.combined_counts)
        lowered = {k: n for k, n in phase.predicted_counts.items() if k != "reduce-scatter"}
        lowered["all-reduce"] = lowered.get("all-reduce", 0) + phase.predicted_counts.get("reduce-scatter", 0)
        assert all(combined.get(kind, 0) <= n for kind, n in lowered.items() if n)
        assert sum(combined.values()) <= sum(phase.predicted_counts.values())
    # FSDP gathers its weights
    assert second.compiled_counts.get("all-gather") and second.predicted_counts.get("all-gather")
    assert first.communication[("all-reduce", "tp")][2] >= 1  # the row-parallel partial sums


def test_table_and_plot(report) -> None:
    text = report.table()
    for expected in ("tokens/s", "FSDP-style, resumed", "max |loss - unsharded loss|",
                     "collectives per step: predicted", "predicted after XLA's combiner", "compiled",
                     "blocks/qkv  | (1, 32, 96)  | R,S(2)      | S(1),S(2)", "total"):
        assert expected in text, expected
    assert text.count("collective         | mesh axes | predicted | bytes/device | compiled | bytes/device") == 2
    assert report.plot is not None and report.plot.stat().st_size > 1000
