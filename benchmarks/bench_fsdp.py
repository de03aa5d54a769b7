"""10. FSDP (fully_shard) vs replicated data parallelism vs plain JAX: one training step."""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
from bounds import sent_bytes_per_device
from harness import Config, Section, Table, Target, compare, microseconds, progress
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from placements2jax import distribute_pytree, distribute_tensor, fully_shard, init_device_mesh, unshard
from placements2jax.dtensor import DTensor
from placements2jax.hlo import parse_collectives

LEARNING_RATE = 0.1


def _params(d: int, hidden: int, layers: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "layers": [
            {
                "up": rng.normal(scale=d ** -0.5, size=(d, hidden)).astype(np.float32),
                "down": rng.normal(scale=hidden ** -0.5, size=(hidden, d)).astype(np.float32),
            }
            for _ in range(layers)
        ]
    }


def _forward(params: dict, x):
    for layer in params["layers"]:
        x = x + jax.nn.gelu(x @ layer["up"]) @ layer["down"]
    return x


def _plain_loss(params: dict, x, y):
    error = _forward(params, x) - y
    return (error * error).mean()


def _dtensor_loss(params: dict, x, y):
    """The same model on DTensors (the loss as a JAX scalar for jax.grad)."""
    return _plain_loss(jax.tree.map(DTensor.to_jax, params, is_leaf=_is_dtensor), x.to_jax(), y.to_jax())


def _fsdp_loss(sharded: dict, x, y):
    return _dtensor_loss(unshard(sharded, "dp"), x, y)  # all-gather over dp before use (FSDP2's pre-forward)


def _is_dtensor(value) -> bool:
    return isinstance(value, DTensor)


def _sgd(loss):
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    return jax.jit(step)


def _param_bytes(params) -> int:
    """Bytes of parameters each device holds (the largest over devices)."""
    per_device: Counter = Counter()
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values())


def _kinds(collectives) -> str:
    counts = Counter(c.op for c in collectives)
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items())) or "none"


def run(config: Config) -> Section:
    d, hidden, layers, batch = (32, 128, 2, 16) if config.quick else (512, 2048, 4, 256)
    section = Section(
        "fsdp",
        "10. FSDP (fully_shard) vs replicated data parallelism vs plain JAX",
        f"""
One SGD training step (`jax.value_and_grad` of a mean-squared loss, then `p - lr * g`, jitted)
of a residual MLP of {layers} layers `x + gelu(x @ up) @ down`, `up` ({d}, {hidden}) and `down`
({hidden}, {d}) in float32, batch {batch} split over dp = 8 devices. **FSDP (ours)**:
`fully_shard(params, mesh, "dp")` (every weight split over dp on its largest dim) and
`unshard(params, "dp")` in the loss, so XLA all-gathers the weights before use and reduces
the gradients onto the shards. **Replicated dp (ours)**: `distribute_pytree` with no plan
(weights replicated, gradients all-reduced). **Plain JAX**: the same step on `jax.Array`s
with `NamedSharding`s on an Auto-axes mesh, weights sharded on dim 0 (FSDP-style, XLA's
propagation decides the collectives) or replicated (dp). Bytes are what each device sends
in the compiled step's collectives (`benchmarks/bounds.py`); parameter bytes are the largest
per device.
""",
    )
    mesh = init_device_mesh((8,), ("dp",))
    auto = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    params = _params(d, hidden, layers)
    rng = np.random.default_rng(1)
    x_np = rng.normal(size=(batch, d)).astype(np.float32)
    y_np = rng.normal(size=(batch, d)).astype(np.float32)
    x, y = (distribute_tensor(a, mesh, "S(0)") for a in (x_np, y_np))
    x_auto, y_auto = (jax.device_put(a, NamedSharding(auto, P("dp"))) for a in (x_np, y_np))
    variants = {
        "FSDP (ours, fully_shard)": (_sgd(_fsdp_loss), fully_shard(params, mesh, "dp"), (x, y)),
        "replicated dp (ours)": (_sgd(_dtensor_loss), distribute_pytree(params, mesh, {}), (x, y)),
        "FSDP (plain JAX)": (
            _sgd(_plain_loss), jax.device_put(params, NamedSharding(auto, P("dp"))), (x_auto, y_auto)
        ),
        "replicated dp (plain JAX)": (
            _sgd(_plain_loss), jax.device_put(params, NamedSharding(auto, P())), (x_auto, y_auto)
        ),
    }
    measured = {}
    losses = []
    compiled = {}
    for name, (step, p, (a, b)) in variants.items():
        progress(f"  fsdp {name}")
        compiled[name] = step.lower(p, a, b).compile()  # compiled once: timed and read for its collectives
        value, _ = compiled[name](p, a, b)
        losses.append(float(value))
        collectives = parse_collectives(compiled[name].as_text())
        measured[name] = (
            _param_bytes(jax.tree.leaves(p)), sent_bytes_per_device(collectives, mesh.size()), _kinds(collectives)
        )
    np.testing.assert_allclose(losses, losses[0], rtol=1e-5)  # the same step, four ways
    pairs = (
        ("FSDP (ours, fully_shard)", "FSDP (plain JAX)"),
        ("replicated dp (ours)", "replicated dp (plain JAX)"),
        ("FSDP (ours, fully_shard)", "replicated dp (ours)"),
    )
    timings = {}
    for ours, baseline in pairs:
        progress(f"  fsdp time {ours} vs {baseline}")
        (_, p1, (a1, b1)), (_, p2, (a2, b2)) = variants[ours], variants[baseline]
        s1, s2 = compiled[ours], compiled[baseline]
        timings[(ours, baseline)] = compare(
            lambda: jax.block_until_ready(s1(p1, a1, b1)), lambda: jax.block_until_ready(s2(p2, a2, b2)), config
        )
    rows = tuple(
        (name, f"{params_bytes}", f"{float(sent):.0f}", kinds) for name, (params_bytes, sent, kinds) in measured.items()
    )
    section.tables.append(Table(
        "Per step and device: parameter bytes held, bytes sent, compiled collectives",
        ("variant", "parameter bytes", "bytes sent", "collectives"),
        rows,
    ))
    section.tables.append(Table(
        "Step time, side by side",
        ("ours", "baseline", "ours µs", "baseline µs", "time ours / baseline"),
        tuple(
            (o, b, microseconds(t.ours_median), microseconds(t.baseline_median), t.ratio_text())
            for (o, b), t in timings.items()
        ),
    ))
    fsdp_bytes = measured["FSDP (ours, fully_shard)"][0]
    dp_bytes = measured["replicated dp (ours)"][0]
    section.targets.append(Target(
        "fully_shard holds 1/dp of the parameters per device",
        f"{fsdp_bytes} of {dp_bytes} bytes ({dp_bytes / fsdp_bytes:.0f}x fewer)",
        "8x fewer",
        dp_bytes == 8 * fsdp_bytes,
    ))
    section.notes.append(
        "FSDP trades memory for communication: each step all-gathers every weight (forward; XLA may keep "
        "the gathered copy for the backward pass) and reduces the gradients onto the shards, so it sends "
        "more bytes than replicated data parallelism, which all-reduces the gradients only. On CPU, XLA "
        "forms the gradient reduce-scatter as an all-reduce and a local slice (fsdp.py's docstring)."
    )
    return section
