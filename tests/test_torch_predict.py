"""``predict(..., search="torch")``: torch 2.13's dispatcher's choice for every equation,
op by op (issue 16), compared with torch's real DTensor dispatch of the same small MLPs on
the fake process group (tests/_torch_predict_worker.py, one process: the values are
meaningless, the placements exactly torch's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

from placements2jax import InferenceError, Layout, apply, distribute_tensor, init_device_mesh  # noqa: E402
from placements2jax.inference import check, predict  # noqa: E402


@pytest.fixture(scope="module")
def results() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "results.json"
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
        worker = Path(__file__).with_name("_torch_predict_worker.py")
        subprocess.run([sys.executable, str(worker), str(dst)], check=True, env=env, timeout=600)
        return json.loads(dst.read_text())


@pytest.mark.parametrize("model", ["partial_mlp", "bias_mlp"])
def test_torch_search_gives_torch_s_layouts_op_by_op(results: dict, model: str) -> None:
    assert results[model]["torch_mode"] == results[model]["torch"]


def test_eager_reduces_a_kept_partial_as_torch_does(results: dict) -> None:
    # (x @ w1) * g with x S(1), w1 S(0), g S(0): torch reduce-scatters the partial product
    # into g's S(0), and so does eager now that a partial kept while another input gives up
    # its split is charged its owed reduction (before, a tie for the op alone: eager carried
    # the partial into the next matmul and reduced it before tanh, on a larger tensor, 4032 B).
    partial = results["partial_mlp"]
    assert partial["torch"][1] == "S(0)"
    assert (partial["torch_mode_bytes"], partial["eager_bytes"]) == (3584, 3584)


def _mlp(x, w1, g, w2):  # noqa: ANN001, ANN202
    return jnp.tanh(((x @ w1) * g) @ w2).sum(axis=0)


def test_check_follows_the_torch_choices() -> None:
    """check(search="torch") runs the prediction's torch choices (execute re-walks with them)."""
    mesh = init_device_mesh((8,), ("x",))
    L = Layout.from_device_mesh(mesh)
    specs = [((16, 32), jnp.float32, L("S(1)").bind(2)), ((32, 64), jnp.float32, L("S(0)").bind(2)),
             ((16, 64), jnp.float32, L("S(0)").bind(2)), ((64, 8), jnp.float32, L("R").bind(2))]
    prediction = predict(_mlp, *specs, search="torch")
    assert prediction.search == "torch"
    assert [str(r.outputs[0].layout) for r in prediction.equations] == ["P", "S(0)", "S(0)", "S(0)", "P"]
    assert dict(prediction.choices)  # the torch choices are recorded for execute/check
    report = check(_mlp, *specs, search="torch")
    assert report.prediction.out_layouts == prediction.out_layouts
    assert np.isfinite(float(report.prediction.nbytes))


def test_unknown_search_names_torch() -> None:
    with pytest.raises(InferenceError, match="'torch'"):
        predict(_mlp, ((2,), jnp.float32, "R"), search="torhc")


def test_a_reshape_torch_keeps_strided_is_carried() -> None:
    """Torch keeps ``8x16 S(1) -> 128`` as ``_StridedShard(0, 8)`` and runs ``exp`` on it
    where it lies: the torch walk carries both choices (no bytes); so does the eager walk
    (the strided pass-through: it unstrided for ``exp`` before, 56 B)."""
    mesh = init_device_mesh((8,), ("x",))
    value = np.linspace(-1, 1, 128, dtype=np.float32).reshape(8, 16)
    x = distribute_tensor(value, mesh, "S(1)")
    prediction = predict(lambda a: jnp.exp(a.reshape(128)), x, search="torch")
    eager = predict(lambda a: jnp.exp(a.reshape(128)), x, search="eager")
    assert [str(r.outputs[0].layout) for r in prediction.equations] == ["_S(0, 8)", "_S(0, 8)"]
    assert set(dict(prediction.choices)) == {"0", "1"} and prediction.nbytes == 0
    assert [str(r.outputs[0].layout) for r in eager.equations] == ["_S(0, 8)", "_S(0, 8)"] and eager.nbytes == 0
    out = apply(lambda a: jnp.exp(a.reshape(128)), x, execute="ops")
    np.testing.assert_allclose(np.asarray(out.full_tensor()), np.exp(value.reshape(128)), rtol=1e-6)
