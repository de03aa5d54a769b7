"""Runs the catalogue of tests/test_torch_dispatch.py in its own process (argv[1]: cases
JSON, argv[2]: results JSON): each case through torch 2.13's real DTensor dispatch on the
fake process group of 8 ranks (values meaningless, placements exactly torch's), then
through placements2jax's default and ``search="torch"`` modes on 8 simulated CPU devices.
"""

from __future__ import annotations

import functools
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
from placements2jax.errors import Placements2JaxError  # noqa: E402
from placements2jax.inference import infer_signature  # noqa: E402
from placements2jax.interop.torch import from_torch_placements, to_torch_mesh, to_torch_placements  # noqa: E402
from placements2jax.placements import parse_placements  # noqa: E402

NAMES = {1: ("x",), 2: ("dp", "tp")}
def torch_run(op: str, tensors: list, params: dict):  # noqa: ANN201
    a = tensors[0]
    if op in ("add", "sub", "mul", "div"):
        return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[op](a, tensors[1])
    if op == "matmul":
        return torch.matmul(a, tensors[1])
    if op in ("sum", "mean"):
        return getattr(a, op)(dim=params["axis"], keepdim=params.get("keepdims", False))
    if op in ("max", "min"):
        return getattr(a, "amax" if op == "max" else "amin")(dim=params["axis"], keepdim=params.get("keepdims", False))
    if op == "transpose":
        return a.permute(*params["axes"])
    if op == "reshape":
        return a.reshape(params["shape"])
    return getattr(torch, op)(a)


@functools.cache
def meshes(shape: tuple[int, ...]) -> tuple:
    mesh = init_device_mesh(shape, NAMES[len(shape)])
    return mesh, to_torch_mesh(mesh)


def placements_of(text: str) -> tuple:
    return parse_placements(text)


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    results: list = []
    for case in cases:
        try:
            results.append(run_case(case))
        except Exception as err:  # noqa: BLE001  (reported per case by the test)
            results.append({"error": f"{type(err).__name__}: {err}"})
    json.dump(results, open(sys.argv[2], "w"))


def run_case(case: dict) -> dict:
    mesh_shape = tuple(case["mesh"])
    mesh, torch_mesh = meshes(mesh_shape)
    params = case["params"]
    specs = []
    tensors = []
    for shape, text in case["inputs"]:
        layout = Layout.from_device_mesh(mesh)(placements_of(text)).bind(len(shape))
        specs.append((tuple(shape), jnp.float32, layout))
        local = layout.local_shape(tuple(shape), 0)
        tensors.append(DTensor.from_local(torch.ones(local), torch_mesh, list(to_torch_placements(layout)),
                                          run_check=False, shape=torch.Size(shape),
                                          stride=torch.empty(shape, device="meta").stride()))
    ours = infer_signature(case["op"], specs, **params)
    try:
        out = torch_run(case["op"], tensors, params)
    except RuntimeError as err:  # torch refuses the case (reported by the test)
        return {"torch_error": str(err).splitlines()[0][:120], "default_out": str(ours.out_layouts[0])}
    result = {
        "torch_out": ",".join(str(p) for p in out.placements),
        "default_out": str(ours.out_layouts[0]),
        "default_cost": float(ours.chosen.cost + ours.chosen.pending),
        "torch_out_layout": None,  # a _StridedShard no layout holds
        "torch_cost": None,
    }
    try:
        result["torch_out_layout"] = str(from_torch_placements(mesh, out.placements).bind(len(out.shape)))
    except Placements2JaxError:
        pass
    try:
        mode = infer_signature(case["op"], specs, search="torch", **params)
        result["torch_mode_out"] = str(mode.out_layouts[0])
        result["torch_cost"] = float(mode.chosen.cost + mode.chosen.pending)
    except Placements2JaxError as err:
        result["torch_mode_out"] = type(err).__name__
    return result


if __name__ == "__main__":
    main()
