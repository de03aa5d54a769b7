"""The torch checkpoint bridge: a torch.distributed.checkpoint of torch DTensors, written by
torch itself (4 gloo processes on a (2, 2) mesh, uneven shards, bfloat16), loaded into
DTensors with the same placements, and into other placements on another mesh: exact."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import placements2jax as p2j
from placements2jax import AbstractDTensor, CheckpointError, init_device_mesh

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
from _torch_dcp_tree import PLACEMENTS, full_values  # noqa: E402

TORCH_TO_OURS = {"S0": "S(0)", "S1": "S(1)", "R": "R"}


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcp")
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = str(probe.getsockname()[1])
    writer = Path(__file__).with_name("_torch_dcp_writer.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    processes = [subprocess.Popen([sys.executable, str(writer), str(r), "4", port, str(path)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    outputs = [p.communicate(timeout=240) for p in processes]
    assert all(p.returncode == 0 for p in processes), "\n".join(err[-3000:] for _, err in outputs)
    return path


def test_same_placements_exact(torch_checkpoint: Path) -> None:
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    values = full_values()
    target = {"model": {name: AbstractDTensor(v.shape, v.dtype, mesh, ",".join(TORCH_TO_OURS[p] for p in PLACEMENTS[name]))
                        for name, v in values.items()}}
    loaded = p2j.load_torch_checkpoint(torch_checkpoint, target)["model"]
    for name, value in values.items():
        dtensor = loaded[name]
        assert dtensor.dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(dtensor.full_tensor()), value)
        for rank in mesh.rank_list:
            np.testing.assert_array_equal(np.asarray(dtensor.to_local(rank)),
                                          value[dtensor.layout.local_slices(value.shape, rank)])


def test_other_mesh_and_placements_exact(torch_checkpoint: Path) -> None:
    mesh = init_device_mesh((8,), ("x",))
    values = full_values()
    target = {"model.w": AbstractDTensor((13, 7), np.float32, mesh, "S(1)"),
              "model.b": AbstractDTensor((9,), np.float32, mesh, "P(max)")}
    loaded = p2j.load_torch_checkpoint(torch_checkpoint, target)
    np.testing.assert_array_equal(np.asarray(loaded["model.w"].full_tensor()), values["w"])
    np.testing.assert_array_equal(np.asarray(loaded["model.b"].full_tensor()), values["b"])


def test_missing_and_mismatched_names(torch_checkpoint: Path) -> None:
    mesh = init_device_mesh((8,), ("x",))
    with pytest.raises(CheckpointError, match="'model.v'"):
        p2j.load_torch_checkpoint(torch_checkpoint, {"model.v": AbstractDTensor((9,), np.float32, mesh)})
    with pytest.raises(CheckpointError, match="float32\\[9\\], the target float32\\[8\\]"):
        p2j.load_torch_checkpoint(torch_checkpoint, {"model.b": AbstractDTensor((8,), np.float32, mesh)})
