"""The real training run (`placements2jax train`, part of `make demo`): a GPT-style LM born
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
    meta = p2j.read_metadata(report.checkpoint)
    assert meta["step"] == 2
    assert meta["leaves"]["params/embed"]["placements"] == "R,S(0)"
    assert meta["leaves"]["params/blocks/qkv"]["mesh"]["shape"] == [2, 4]
    assert first.collectives and second.collectives.get("all-gather")  # FSDP gathers its weights


def test_table_and_plot(report) -> None:
    text = report.table()
    assert "tokens/s" in text and "FSDP-style, resumed" in text and "max |loss - unsharded loss|" in text
    assert report.plot is not None and report.plot.stat().st_size > 1000
