"""The main job of ``make demo``: a small GPT-style language model, parameters born sharded.

``python -m placements2jax train``:

1. The model (:func:`gpt_init`, :func:`gpt_loss`) is public-style JAX code: an embedding
   lookup ``table[tokens]``, causal attention masked with ``jnp.where``, ``lax.scan`` over
   stacked layers, a tied output projection. No sharding annotation anywhere; the step
   hands it the DTensors' arrays with :func:`placements2jax.model_arrays`.
2. Its parameters are created directly in their layouts by :func:`init_pytree` from a
   torch-style plan, on the library's default (Explicit axes) dp x tp mesh (tensor
   parallel over tp) and, for the FSDP-style variant, with every weight also split over dp.
3. optax ``adamw`` trains it; halfway the parameters and optimizer state are saved
   (:func:`placements2jax.save`), loaded onto a differently shaped mesh and layout
   (:func:`placements2jax.load`), and training continues there.
4. Every loss is compared with the same model trained without sharding; the report gives
   the loss curve, tokens per second, the collectives per step that
   :func:`placements2jax.predict` predicts beside those XLA compiled, and writes a loss
   plot next to the checkpoint.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint import AbstractDTensor, load, save
from .display import communication, communication_table, count_text
from .dtensor import DTensor, distribute_tensor, is_dtensor
from .errors import import_extra
from .factories import init_pytree
from .hlo import Collective, parse_collectives
from .inference import Prediction, predict
from .inference.table import format_table
from .layout import Layout
from .mesh import DeviceMesh, init_device_mesh
from .parallelize import path_of, plan_layouts
from .training import model_arrays

__all__ = ["GPTConfig", "gpt_init", "gpt_loss", "train_gpt"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    seq: int = 32
    batch: int = 16
    steps: int = 12
    learning_rate: float = 3e-3


def gpt_init(key: jax.Array, config: GPTConfig = GPTConfig()) -> dict[str, Any]:
    """The model's parameters (stacked over layers for ``lax.scan``)."""
    k = jax.random.split(key, 5)
    d, scale = config.dim, config.dim**-0.5
    return {
        "embed": jax.random.normal(k[0], (config.vocab, d)) * 0.02,
        "position": jax.random.normal(k[1], (config.seq, d)) * 0.02,
        "blocks": {
            "norm": jnp.ones((config.layers, d)),
            "qkv": jax.random.normal(k[2], (config.layers, d, 3 * d)) * scale,
            "out": jax.random.normal(k[3], (config.layers, d, d)) * scale / math.sqrt(2 * config.layers),
            "up": jax.random.normal(k[4], (config.layers, d, 4 * d)) * scale,
            "down": jnp.zeros((config.layers, 4 * d, d)),
        },
        "final_norm": jnp.ones((d,)),
    }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def gpt_loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Next-token cross entropy of a pre-norm GPT block stack (plain JAX)."""
    import optax

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    x = params["embed"][inputs] + params["position"][:seq]
    mask = jnp.tril(jnp.ones((seq, seq), bool))

    def block(x: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        q, k, v = jnp.split(_norm(x, w["norm"]) @ w["qkv"], 3, axis=-1)
        scores = jnp.where(mask, q @ k.swapaxes(-1, -2) * q.shape[-1] ** -0.5, -1e9)
        x = x + jax.nn.softmax(scores) @ v @ w["out"]
        return x + jax.nn.gelu(_norm(x, w["norm"]) @ w["up"]) @ w["down"], None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    logits = _norm(x, params["final_norm"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# torch-style plans: tensor parallel over tp (colwise qkv / up, rowwise out / down, vocab-split
# embedding), and the FSDP-style variant with every weight's other dim split over dp too.
TP_PLAN = {
    r"embed": "R,S(0)",
    r"blocks/(qkv|up)": "None,None,tp",
    r"blocks/(out|down)": "None,tp,None",
}
FSDP_PLAN = {
    r"embed": "tp,dp",
    r"blocks/(qkv|up)": "None,dp,tp",
    r"blocks/(out|down)": "None,tp,dp",
}


def _loss(params: Any, tokens: Any) -> jax.Array:
    """:func:`gpt_loss`, unmodified, on the DTensors' logical arrays."""
    return gpt_loss(*model_arrays((params, tokens)))


def _update(loss_fn: Callable[..., jax.Array], optimizer: Any) -> Callable[..., tuple[Any, Any, jax.Array]]:
    """One training step: value_and_grad + the optax update (jit it to run it)."""
    import optax

    def step(params: Any, state: Any, tokens: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


@dataclass
class Phase:
    name: str
    mesh: DeviceMesh
    plan: dict[str, str]
    steps: range
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    layouts: dict[str, tuple[tuple[int, ...], Layout]] = field(default_factory=dict)
    prediction: Prediction | None = None
    compiled: tuple[Collective, ...] = ()

    @property
    def communication(self) -> dict[tuple[str, str], tuple[int, Any, int, Any]]:
        """Per (collective, mesh axes): predicted and compiled count and bytes per device."""
        predicted = self.prediction.steps if self.prediction is not None else ()
        return communication(self.mesh, predicted, self.compiled)

    @property
    def predicted_counts(self) -> dict[str, int]:
        """Predicted collectives per kind (all mesh axes)."""
        return self._counts(0)

    @property
    def combined_counts(self) -> dict[str, int]:
        """Predicted collectives per kind once XLA's combiner on this platform merges the
        independent ones (:meth:`Prediction.combined`): the count comparable with
        :attr:`compiled_counts` (on CPU a reduce-scatter counts as the all-reduce XLA
        compiles for it)."""
        return dict(self.prediction.combined_counts) if self.prediction is not None else {}

    @property
    def compiled_counts(self) -> dict[str, int]:
        """Compiled collectives per kind (all mesh axes)."""
        return self._counts(2)

    def _counts(self, column: int) -> dict[str, int]:
        result: dict[str, int] = {}
        for (kind, _), row in self.communication.items():
            result[kind] = result.get(kind, 0) + row[column]
        return result


@dataclass
class TrainReport:
    config: GPTConfig
    phases: list[Phase]
    reference: list[float]
    checkpoint: Path
    plot: Path | None

    @property
    def losses(self) -> list[float]:
        return [loss for phase in self.phases for loss in phase.losses]

    @property
    def max_difference(self) -> float:
        return max(abs(a - b) for a, b in zip(self.losses, self.reference))

    def table(self) -> str:
        """The report: the parameters' layouts per phase, then per phase its losses,
        speed and collectives per step (predicted beside compiled), then each phase's
        collectives by kind and mesh axis."""
        c = self.config
        first = self.phases[0]
        layouts = [
            (path, str(shape), *(str(p.layouts[path][1]) for p in self.phases),
             *(str(p.layouts[path][1].local_shape(shape, 0)) for p in self.phases))
            for path, (shape, _) in first.layouts.items()
        ]  # fmt: skip
        meshes = [str(p.mesh) for p in self.phases]
        header = (
            f"GPT-style LM: vocab {c.vocab}, dim {c.dim}, {c.layers} layers (lax.scan), seq {c.seq}, batch {c.batch}; "
            "plain JAX model code on the DTensors' arrays (model_arrays), default Explicit-axes meshes\n"
            + format_table(("parameter", "shape", *meshes, *(f"rank 0 local ({m})" for m in meshes)), layouts)
        )
        tokens = c.batch * c.seq
        rows = []
        for p in self.phases:
            per_second = tokens * len(p.steps) / p.seconds if p.seconds else float("nan")
            rows.append((p.name, str(p.mesh), f"{p.steps.start}-{p.steps.stop - 1}", f"{p.losses[0]:.4f}",
                         f"{p.losses[-1]:.4f}", f"{per_second:,.0f}", count_text(p.predicted_counts),
                         count_text(p.combined_counts), count_text(p.compiled_counts)))
        summary = format_table(
            ("phase", "mesh", "steps", "first loss", "last loss", "tokens/s", "collectives per step: predicted",
             "predicted after XLA's combiner", "compiled"),
            rows,
        )
        details = "\n\n".join(
            f"{p.name} ({p.mesh}): collectives per step, predicted (placements2jax.predict, whole-program search) "
            f"vs compiled (XLA)\n" + communication_table(p.communication)
            for p in self.phases
        )
        return "\n".join([
            header, "", summary,
            f"max |loss - unsharded loss| over {len(self.reference)} steps: {self.max_difference:.2e}",
            f"checkpoint: {self.checkpoint}" + (f"; loss plot: {self.plot}" if self.plot else ""),
            "", details,
            "The prediction chooses every layout of the step in one whole-program search with its own cost model;"
            " XLA's propagation plans the whole step (and on CPU lowers a reduce-scatter as an all-reduce): where"
            " they differ, both are shown as they are. 'Predicted' counts one collective per redistribution step;"
            " 'predicted after XLA's combiner' merges the independent ones of one kind on the same mesh axes as "
            "XLA's combiner passes would (a model of XLA's rules, applied to the predicted program, not read from"
            " the compiled one).",
        ])


def _on_mesh(tree: Any, mesh: DeviceMesh) -> Any:
    """Non-DTensor arrays (optax's count) replicated on the mesh, as the compiled step
    returns them: the step's inputs then keep one sharding from step to step."""
    replicated = jax.sharding.NamedSharding(mesh.to_jax(), jax.sharding.PartitionSpec())
    return jax.tree.map(lambda v: v if isinstance(v, DTensor) else jax.device_put(v, replicated), tree,
                        is_leaf=is_dtensor)


def _free_outputs(state: Any) -> Any:
    """``out_layouts`` for the optimizer state: DTensors keep their layout, the rest free."""
    return jax.tree.map(lambda v: v if isinstance(v, DTensor) else None, state, is_leaf=is_dtensor)


def train_gpt(config: GPTConfig = GPTConfig(), directory: str | None = None, progress: bool = True) -> TrainReport:
    """The run the module docstring describes; returns its report."""
    optax = import_extra("optax", "train", "the training run")

    root = Path(directory or tempfile.mkdtemp(prefix="placements2jax-train-"))
    half = config.steps // 2
    phases = [
        Phase("tensor parallel", init_device_mesh((2, 4), ("dp", "tp")), TP_PLAN, range(0, half)),
        Phase("FSDP-style, resumed", init_device_mesh((4, 2), ("dp", "tp")), FSDP_PLAN, range(half, config.steps)),
    ]
    optimizer = optax.adamw(config.learning_rate, weight_decay=0.01)
    rng = np.random.default_rng(0)
    batches = [_sequences(rng, config) for _ in range(config.steps)]
    key = jax.random.key(0)
    shapes = jax.eval_shape(lambda k: gpt_init(k, config), key)

    plain_step = jax.jit(_update(gpt_loss, optimizer))
    plain = jax.jit(lambda k: gpt_init(k, config))(key)
    plain_state = optimizer.init(plain)
    reference = []
    for tokens in batches:
        plain, plain_state, loss = plain_step(plain, plain_state, tokens)
        reference.append(float(loss))

    step = jax.jit(_update(_loss, optimizer))
    bar = _progress(progress, config.steps)
    for index, phase in enumerate(phases):
        layouts = plan_layouts(shapes, phase.mesh, phase.plan)
        flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
        phase.layouts = {path_of(k): (s.shape, lay) for (k, s), lay in zip(flat, jax.tree.leaves(layouts))}
        if index == 0:
            params = init_pytree(lambda k: gpt_init(k, config), key, phase.mesh, phase.plan)
            state = optimizer.init(params)
        else:  # resume: load the checkpoint onto this phase's mesh and plan
            params_target = jax.tree.map(
                lambda s, lay: AbstractDTensor(s.shape, s.dtype, phase.mesh, lay), shapes, layouts,
                is_leaf=lambda v: isinstance(v, jax.ShapeDtypeStruct),
            )
            state_target = _abstract_state(optimizer.init(load_shapes(params_target)), phase.mesh)
            restored = load(root, {"params": params_target, "state": state_target})
            params, state = restored["params"], restored["state"]
        state = _on_mesh(state, phase.mesh)
        tokens = [distribute_tensor(batches[i], phase.mesh, "S(0),R") for i in phase.steps]
        # Predicted on the same step written on plain arrays, its outputs in the layouts the
        # compiled step keeps (parameters and optimizer state as they came in, loss replicated).
        phase.prediction = predict(_update(gpt_loss, optimizer), params, state, tokens[0], mesh=phase.mesh,
                                   out_layouts=(params, _free_outputs(state), "R,R"))
        compiled = step.lower(params, state, tokens[0]).compile()  # compiled once, outside the timing
        phase.compiled = tuple(parse_collectives(compiled.as_text()))
        for i, batch in zip(phase.steps, tokens):
            began = time.perf_counter()
            params, state, loss = compiled(params, state, batch)
            phase.losses.append(float(loss))
            phase.seconds += time.perf_counter() - began
            bar(i, float(loss), reference[i])
        if index == 0:
            save(root, {"params": params, "state": state}, step=phase.steps.stop)
    bar(None, 0.0, 0.0)
    report = TrainReport(config, phases, reference, root, None)
    report.plot = _plot(report, root / "loss.png")
    return report


def _sequences(rng: np.random.Generator, config: GPTConfig) -> np.ndarray:
    """A learnable language: each token is ``(3 * previous + 1) mod vocab`` after a random start."""
    tokens = np.empty((config.batch, config.seq + 1), np.int32)
    tokens[:, 0] = rng.integers(0, config.vocab, config.batch)
    for t in range(1, config.seq + 1):
        tokens[:, t] = (3 * tokens[:, t - 1] + 1) % config.vocab
    return tokens


def load_shapes(target: Any) -> Any:
    """DTensors of zeros in ``target``'s layouts (optax.init needs arrays to mirror)."""
    from .factories import zeros

    return jax.tree.map(
        lambda a: zeros(a.shape, device_mesh=a.device_mesh, placements=a.placements, dtype=a.dtype),
        target, is_leaf=lambda v: isinstance(v, AbstractDTensor),
    )


def _abstract_state(state: Any, mesh: DeviceMesh) -> Any:
    """Load targets for an optimizer state: its DTensors' shapes and layouts, its other
    arrays (optax's count) replicated on ``mesh``."""
    replicated = jax.sharding.NamedSharding(mesh.to_jax(), jax.sharding.PartitionSpec())
    return jax.tree.map(
        lambda d: AbstractDTensor(d.shape, d.dtype, d.device_mesh, d.layout) if isinstance(d, DTensor)
        else jax.ShapeDtypeStruct(np.shape(d), jnp.result_type(d), sharding=replicated),
        state, is_leaf=is_dtensor,
    )


def _progress(enabled: bool, total: int) -> Callable[[int | None, float, float], None]:
    if not enabled:
        return lambda i, loss, ref: None
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover - the rich extra
        return lambda i, loss, ref: None
    progress = Progress(transient=False)
    task = progress.add_task("training", total=total)
    progress.start()

    def update(i: int | None, loss: float, ref: float) -> None:
        if i is None:
            progress.stop()
            return
        progress.update(task, advance=1, description=f"step {i:2d} loss {loss:.4f} (unsharded {ref:.4f})")

    return update


def _plot(report: TrainReport, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the plot extra
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(report.reference, "k--", label="unsharded")
    for phase in report.phases:
        ax.plot(list(phase.steps), phase.losses, "o-", label=phase.name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(print_fn: Callable[[str], None] = print) -> TrainReport:
    """Train (with a progress bar) and print the report."""
    report = train_gpt()
    print_fn(report.table())
    return report
