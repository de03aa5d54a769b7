"""The layout demo (``placements2jax demo``): torch-style tensor parallelism, trained by JAX.
(``make demo`` runs the GPT training run of :mod:`.train_demo`; this one shows the
placements algebra and a DTensor-operator MLP step by step.)

1. A short table: how torch placements become a tensor_map and a ``PartitionSpec``.
2. A residual MLP whose parameters are placed by a plan (``colwise`` up-projections,
   ``rowwise`` down-projections, as torch's ``ColwiseParallel`` / ``RowwiseParallel``)
   on a ("dp", "tp") mesh and whose forward is written with DTensor operators, trained
   for a few SGD steps by one jitted forward + backward + update; every loss is
   compared with the same code run on plain arrays on one device.
3. The layouts predicted by :func:`placements2jax.check` for that step against the ones
   XLA compiled, and the collectives per step, predicted and compiled.

The mesh is built from ``jax.devices()`` (8 devices give dp=2 x tp=4), so the same code
runs on simulated CPU devices and on a GPU/TPU host. See docs/training.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .display import communication, communication_table
from .dtensor import DTensor, distribute_tensor, is_dtensor
from .hlo import Collective, parse_collectives
from .inference import CheckReport, check
from .inference.check import collective_nbytes
from .inference.table import format_bytes, format_table
from .layout import Layout, PlacementsLike, resolve_layout
from .mesh import DeviceMesh
from .operators import apply
from .parallelize import colwise, distribute_pytree, path_of, rowwise
from .placements import Partial, Replicate, Shard, format_alias, format_placements

__all__ = [
    "PLAN",
    "RFC_PLACEMENTS",
    "TrainingConfig",
    "TrainingReport",
    "demo_mesh",
    "main",
    "placements_table",
    "train",
]

RFC_PLACEMENTS: tuple[PlacementsLike, ...] = (
    (Shard(0), Replicate()),
    (Replicate(), Shard(0)),
    (Shard(0), Shard(1)),
    (Shard(1), Shard(0)),
    (Replicate(), Shard(1)),
    (Replicate(), Replicate()),
    (("dp", "tp"), None),
    (("tp", "dp"), None),
    (Partial(), Shard(0)),
)

# The parallelization plan of the MLP: regexes over parameter paths (whole-path match).
PLAN = {r"layers/\d+/up/.*": colwise("tp"), r"layers/\d+/down/.*": rowwise("tp")}

# Activations, torch form on ("dp", "tp"): the batch is split over dp (data parallel);
# the down-projection's output is a partial sum over tp until it is all-reduced.
BATCH = (Shard(0), Replicate())
PARTIAL_SUM = (Shard(0), Partial())


def placements_table(mesh: DeviceMesh, shape: tuple[int, ...], specs: Sequence[PlacementsLike]) -> str:
    """One row per placement spec: torch form, tensor_map, alias form, PartitionSpec and
    the block rank 0 and the last rank hold."""
    last = mesh.rank_list[-1]
    rows = []
    for spec in specs:
        layout = resolve_layout(mesh, spec, len(shape))
        blocks = [_block(layout.local_slices(shape, rank)) for rank in (0, last)]
        rows.append(
            (
                str(layout),
                _tensor_map(layout),
                format_alias(layout.alias_map),
                str(layout.partition_spec),
                *blocks,
            )
        )
    headers = ("placements", "tensor_map", "alias form", "PartitionSpec", "rank 0 holds", f"rank {last} holds")
    return format_table(headers, rows)


def _tensor_map(layout: Layout) -> str:
    ops = [op for op in layout.partial if op]
    return str(layout.tensor_map) + (f" +partial {ops[0]}" if ops else "")


def _block(block: Sequence[slice]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in block) + "]"


# -- the model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingConfig:
    """The demo's model and run: ``layers`` residual MLP blocks ``x + down(gelu(up(x)))``
    of width ``d_model`` and hidden width ``hidden_per_tp`` times the tp size, on a batch
    of ``batch_per_dp`` times the dp size, trained by ``steps`` SGD steps."""

    layers: int = 2
    d_model: int = 32
    hidden_per_tp: int = 32
    batch_per_dp: int = 16
    steps: int = 6
    learning_rate: float = 0.1
    seed: int = 0


def demo_mesh(devices: Sequence[jax.Device] | None = None) -> DeviceMesh:
    """A ("dp", "tp") mesh over all devices: tp = gcd(count, 4), dp = count / tp
    (8 devices: 2 x 4)."""
    count = len(devices if devices is not None else jax.devices())
    tp = math.gcd(count, 4)
    return DeviceMesh(np.arange(count).reshape(count // tp, tp), ("dp", "tp"))


def init_params(config: TrainingConfig, tp: int) -> dict[str, Any]:
    """Random parameters, weights ``(in, out)`` as JAX stores them."""
    rng = np.random.default_rng(config.seed)
    d, hidden = config.d_model, config.hidden_per_tp * tp

    def dense(n_in: int, n_out: int) -> dict[str, np.ndarray]:
        w = rng.normal(scale=1 / math.sqrt(n_in), size=(n_in, n_out)).astype(np.float32)
        return {"w": w, "b": np.zeros(n_out, np.float32)}

    return {"layers": [{"up": dense(d, hidden), "down": dense(hidden, d)} for _ in range(config.layers)]}


def make_batch(config: TrainingConfig, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of a fixed random teacher ``y = sin(2 x A)``."""
    rng = np.random.default_rng(config.seed + 1)
    x = rng.normal(size=(config.batch_per_dp * dp, config.d_model)).astype(np.float32)
    teacher = rng.normal(scale=1 / math.sqrt(config.d_model), size=(config.d_model, config.d_model))
    return x, np.sin(2 * x @ teacher).astype(np.float32)


def forward(params: Any, x: Any, batch: NamedSharding | None = None) -> Any:
    """The residual MLP, written once for three uses.

    On DTensors it is torch-style tensor parallelism: the operators run each op under
    the signature inference chooses; the up-projection (``ColwiseParallel``) gives
    ``S(0),S(1)``, the down-projection (``RowwiseParallel``) a partial sum ``S(0),P``
    that is redistributed (all-reduced) to the batch layout ``S(0),R``; each block's
    input is pinned to ``S(0),R`` too (``ColwiseParallel``'s ``input_layouts``: in the
    backward pass, where the input gradient, a partial sum over tp, is all-reduced).
    On plain arrays with ``batch`` (a ``NamedSharding`` of the batch layout) the same
    points are sharding constraints (what :func:`placements2jax.check` predicts); on
    plain arrays without, it is single-device JAX (the reference).
    """
    for layer in params["layers"]:
        up, down = layer["up"], layer["down"]
        x = _to_batch(x, batch)
        hidden = _gelu(x @ up["w"] + up["b"])
        x = x + _to_batch(hidden @ down["w"], batch) + down["b"]
    return x


def _to_batch(value: Any, batch: NamedSharding | None) -> Any:
    if isinstance(value, DTensor):
        return value.redistribute(placements=BATCH)
    return value if batch is None else jax.lax.with_sharding_constraint(value, batch)


def _gelu(value: Any) -> Any:
    return apply(jax.nn.gelu, value) if isinstance(value, DTensor) else jax.nn.gelu(value)


def loss_fn(params: Any, x: Any, y: Any, batch: NamedSharding | None = None) -> jax.Array:
    """Mean squared error, a scalar ``jax.Array`` (a DTensor loss, ``Partial(avg)`` over
    dp since the batch is split over dp, is reduced by ``to_jax``)."""
    error = forward(params, x, batch) - y
    loss = (error * error).mean()
    return loss.to_jax() if isinstance(loss, DTensor) else loss


def sgd_step(
    params: Any, x: Any, y: Any, *, learning_rate: float, batch: NamedSharding | None = None
) -> tuple[jax.Array, Any]:
    """(loss, updated params). For a pytree of DTensors the gradients are DTensors with
    the parameters' layouts, and the update maps over their arrays."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, batch)
    return loss, jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)


# -- the run and its report ------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingReport:
    """What :func:`train` measured (see the module docstring); ``params`` are the trained
    DTensors, ``reference_params`` the arrays trained by plain JAX on one device."""

    mesh: DeviceMesh
    config: TrainingConfig
    layouts: dict[str, tuple[tuple[int, ...], Layout]]
    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    max_param_difference: float
    compiled_param_layouts: dict[str, Layout]
    check: CheckReport
    output_names: tuple[str, ...]
    collectives: tuple[Collective, ...]
    params: Any
    reference_params: Any

    @property
    def loss_decreased(self) -> bool:
        return self.losses[-1] < self.losses[0]

    @property
    def max_loss_difference(self) -> float:
        return max(abs(a - b) for a, b in zip(self.losses, self.reference_losses))

    @property
    def layouts_kept(self) -> bool:
        """The compiled step returns every parameter in its planned layout."""
        return all(self.compiled_param_layouts[p] == layout for p, (_, layout) in self.layouts.items())

    def __str__(self) -> str:
        sections = (self._model_section(), self._loss_section(), self._check_section(), self._collectives_section())
        return "\n\n".join(sections)

    def _model_section(self) -> str:
        mesh, config = self.mesh, self.config
        device = mesh.devices.flat[0]
        plan = "\n".join(f"  {regex:<22} {style}" for regex, style in PLAN.items())
        rows = [
            (path, str(shape), str(layout), str(layout.partition_spec),
             str(layout.local_shape(shape, 0)))
            for path, (shape, layout) in self.layouts.items()
        ]  # fmt: skip
        return (
            f"{config.layers} residual MLP blocks x + down(gelu(up(x))) on mesh {mesh} "
            f"({mesh.size()} {device.platform} devices)\n"
            f"plan (regex on the parameter path -> placements; unmatched leaves replicated):\n{plan}\n"
            + format_table(("parameter", "shape", "placements", "PartitionSpec", "rank 0 local"), rows)
            + "\nforward, torch style on DTensors: x @ up.w + up.b -> "
            f"{format_placements((Shard(0), colwise('tp').placement(2, 'output')))} (colwise, no communication); "
            f"gelu by apply; hidden @ down.w -> {format_placements(PARTIAL_SUM)} (rowwise partial sum); "
            f".redistribute({format_placements(BATCH)}) -> all-reduce over tp"
        )

    def _loss_section(self) -> str:
        rows = [
            (step, f"{loss:.6f}", f"{ref:.6f}", f"{abs(loss - ref):.1e}")
            for step, (loss, ref) in enumerate(zip(self.losses, self.reference_losses))
        ]
        verdict = "went down" if self.loss_decreased else "did NOT go down"
        kept = (
            "XLA compiled every updated parameter in its planned layout"
            if self.layouts_kept
            else "XLA COMPILED SOME PARAMETERS IN ANOTHER LAYOUT"
        )
        return (
            f"training: one jitted forward + backward + SGD step on the DTensors (learning rate "
            f"{self.config.learning_rate}); alongside, the same code on plain arrays on one device\n"
            + format_table(("step", "loss (sharded)", "loss (plain JAX)", "|difference|"), rows)
            + f"\nloss {verdict}: {self.losses[0]:.4f} -> {self.losses[-1]:.4f}; "
            f"largest parameter difference after training {self.max_param_difference:.1e}; {kept}"
        )

    @property
    def communication(self) -> dict[tuple[str, str], tuple[int, Fraction, int, Fraction]]:
        """Per (collective, mesh axes): predicted count and bytes per device (the
        prediction's steps and its outputs' conversions to XLA's layouts), then the
        count and bytes per device of the compiled step that ran."""
        predicted = list(self.check.prediction.steps)
        for out in self.check.outputs:
            predicted += out.conversion.steps if out.conversion is not None else ()
        return communication(self.mesh, predicted, self.collectives)

    @property
    def communication_agrees(self) -> bool:
        """Predicted and compiled bytes per device agree for every collective kind and mesh axis."""
        return all(pb == cb for _, pb, _, cb in self.communication.values())

    def _check_section(self) -> str:
        rows = [
            (
                name,
                str(out.aval),
                str(out.predicted),
                str(out.compiled) if out.compiled else "?",
                out.verdict,
            )
            for name, out in zip(self.output_names, self.check.outputs)
        ]
        return (
            "predicted vs compiled layouts of the step's outputs: placements2jax.check of the same step on plain "
            "arrays, the all-reduce points as sharding constraints (op-by-op inference, as eager torch DTensor "
            "dispatches, vs what XLA compiled)\n"
            + format_table(("output", "aval", "predicted", "XLA", "verdict"), rows)
            + "\nxla reduced partial: the prediction keeps the partial sum over dp of the loss and the gradients "
            "(the batch is split over dp) as torch would; XLA all-reduces it inside the step"
        )

    def _collectives_section(self) -> str:
        rows = [
            (i, c.op, ",".join(c.mesh_axes(self.mesh)) or "-",
             c.results_text,
             format_bytes(collective_nbytes(c, self.mesh.size())))
            for i, c in enumerate(self.collectives)
        ]  # fmt: skip
        verdict = "agree" if self.communication_agrees else "DIFFER"
        return (
            f"collectives per training step: predicted vs compiled (bytes per device {verdict}; XLA combines the "
            "gradients' all-reduces into one)\n"
            + communication_table(self.communication)
            + "\n\nthe compiled DTensor step's collectives, from its HLO:\n"
            + format_table(("#", "collective", "mesh axes", "result per device", "bytes/device"), rows)
        )


def train(mesh: DeviceMesh | None = None, config: TrainingConfig = TrainingConfig()) -> TrainingReport:
    """Place, train and check the demo model (module docstring)."""
    mesh = demo_mesh() if mesh is None else mesh
    dp, tp = (mesh.size(a) for a in ("dp", "tp"))
    host_params = init_params(config, tp)
    host_x, host_y = make_batch(config, dp)

    params = distribute_pytree(host_params, mesh, PLAN)
    x, y = (distribute_tensor(a, mesh, BATCH) for a in (host_x, host_y))
    step = jax.jit(partial(sgd_step, learning_rate=config.learning_rate))
    compiled = step.lower(params, x, y).compile()

    reference_device = mesh.devices.flat[0]
    ref_params, ref_x, ref_y = jax.device_put((host_params, host_x, host_y), reference_device)
    ref_step = jax.jit(partial(sgd_step, learning_rate=config.learning_rate))

    losses, reference_losses = [], []
    for _ in range(config.steps):
        loss, params = compiled(params, x, y)
        ref_loss, ref_params = ref_step(ref_params, ref_x, ref_y)
        losses.append(float(loss))
        reference_losses.append(float(ref_loss))

    flat_params = _flat_with_paths(params)
    flat_reference = _flat_with_paths(ref_params)
    difference = max(
        float(np.max(np.abs(np.asarray(p.full_tensor()) - np.asarray(flat_reference[path]))))
        for path, p in flat_params.items()
    )
    out_shardings = jax.tree.leaves(compiled.output_shardings)[1:]  # after the loss
    compiled_layouts = {
        path: Layout.from_partition_spec(mesh, sharding.spec, p.ndim)
        for (path, p), sharding in zip(flat_params.items(), out_shardings)
    }
    report, names = _check_step(mesh, params, x, y, config)
    return TrainingReport(
        mesh=mesh,
        config=config,
        layouts={path: (p.shape, p.layout) for path, p in flat_params.items()},
        losses=tuple(losses),
        reference_losses=tuple(reference_losses),
        max_param_difference=difference,
        compiled_param_layouts=compiled_layouts,
        check=report,
        output_names=names,
        collectives=tuple(parse_collectives(compiled.as_text())),
        params=params,
        reference_params=ref_params,
    )


def _flat_with_paths(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_dtensor)[0]
    return {path_of(key_path): leaf for key_path, leaf in leaves}


def _check_step(
    mesh: DeviceMesh, params: Any, x: DTensor, y: DTensor, config: TrainingConfig
) -> tuple[CheckReport, tuple[str, ...]]:
    """``check`` of the SGD step on the DTensors' layouts, and the names of its outputs
    (the loss, then the parameter paths). ``check`` compiles on an Auto-axes copy of the
    mesh, so the step pins its activations with Auto-axes shardings."""
    leaves, tree = jax.tree.flatten(params, is_leaf=is_dtensor)
    auto = DeviceMesh(mesh.mesh, mesh.axis_names, axis_types="auto")
    batch = resolve_layout(auto, BATCH, 2).named_sharding
    step = partial(sgd_step, learning_rate=config.learning_rate, batch=batch)

    def step_of_leaves(*args: jax.Array) -> tuple[jax.Array, ...]:
        loss, new = step(jax.tree.unflatten(tree, args[:-2]), *args[-2:])
        return (loss, *jax.tree.leaves(new))

    # op by op, as torch dispatches: updated parameters keep their layouts, which a
    # whole-program search of free outputs does not know (it may leave them split)
    report = check(step_of_leaves, *leaves, x, y, mesh=mesh, search="eager")
    return report, ("loss", *_flat_with_paths(params))


def main(steps: int | None = None, print_fn: Callable[[str], None] = print) -> TrainingReport:
    """Print the placements table and the training report; returns the report."""
    devices = jax.devices()
    table_mesh = DeviceMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp")) if len(devices) >= 8 else demo_mesh()
    print_fn(f"== torch placements -> tensor_map -> PartitionSpec: an 8x2 tensor on mesh {table_mesh} ==\n")
    print_fn(placements_table(table_mesh, (8, 2), RFC_PLACEMENTS))
    config = TrainingConfig() if steps is None else TrainingConfig(steps=steps)
    print_fn("\n== tensor-parallel training with torch-style placements ==\n")
    report = train(demo_mesh(devices), config)
    print_fn(str(report))
    return report
