"""Runs small MLPs through torch 2.13's real DTensor dispatch on the fake process group
of 8 ranks (values meaningless, placements exactly torch's) and through
``predict(..., search="torch")`` on 8 simulated CPU devices, in its own process (argv[1]:
results JSON): per model, torch's output placements op by op and the prediction's output
layouts of the equations torch's dispatch sees (tests/test_torch_predict.py compares them).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from placements2jax import Layout, init_device_mesh  # noqa: E402
from placements2jax.inference import predict  # noqa: E402
from placements2jax.interop.torch import from_torch_placements, to_torch_mesh, to_torch_placements  # noqa: E402

# The equations torch's dispatch sees as ops (broadcast_in_dim is part of torch's add).
SEEN = ("dot_general", "mul", "add", "tanh", "reduce_sum")


def jax_partial_mlp(x, w1, g, w2):  # noqa: ANN001, ANN201
    return jnp.tanh(((x @ w1) * g) @ w2).sum(axis=0)


def torch_partial_mlp(x, w1, g, w2):  # noqa: ANN001, ANN201
    h = x @ w1
    m = h * g
    y = m @ w2
    t = torch.tanh(y)
    return [h, m, y, t, t.sum(dim=0)]


def jax_bias_mlp(x, w1, b1, w2):  # noqa: ANN001, ANN201
    return jnp.tanh(x @ w1 + b1) @ w2


def torch_bias_mlp(x, w1, b1, w2):  # noqa: ANN001, ANN201
    h = x @ w1
    a = h + b1
    t = torch.tanh(a)
    return [h, a, t, t @ w2]


MODELS = {
    "partial_mlp": ((8,), ("x",), jax_partial_mlp, torch_partial_mlp,
                    [((16, 32), "S(1)"), ((32, 64), "S(0)"), ((16, 64), "S(0)"), ((64, 8), "R")]),
    "bias_mlp": ((4, 2), ("dp", "tp"), jax_bias_mlp, torch_bias_mlp,
                 [((16, 32), "S(0),R"), ((32, 64), "R,S(1)"), ((64,), "R,S(0)"), ((64, 8), "R,S(0)")]),
}


def run(name: str) -> dict:
    mesh_shape, names, jax_fn, torch_fn, inputs = MODELS[name]
    mesh = init_device_mesh(mesh_shape, names)
    torch_mesh = to_torch_mesh(mesh)
    specs, tensors = [], []
    for shape, text in inputs:
        layout = Layout.from_device_mesh(mesh)(text).bind(len(shape))
        specs.append((shape, jnp.float32, layout))
        tensors.append(DTensor.from_local(
            torch.ones(layout.local_shape(shape, 0)), torch_mesh, list(to_torch_placements(layout)),
            run_check=False, shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride(),
        ))
    torch_outs = [str(from_torch_placements(mesh, t.placements).bind(t.ndim)) for t in torch_fn(*tensors)]
    prediction = predict(jax_fn, *specs, search="torch")
    ours = [str(r.outputs[0].layout) for r in prediction.equations if r.primitive in SEEN]
    eager = predict(jax_fn, *specs, search="eager")
    return {"torch": torch_outs, "torch_mode": ours, "torch_mode_bytes": float(prediction.nbytes),
            "eager_bytes": float(eager.nbytes)}


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    json.dump({name: run(name) for name in MODELS}, open(sys.argv[1], "w"))


if __name__ == "__main__":
    main()
