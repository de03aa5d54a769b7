"""Vocabulary-parallel cross-entropy: torch's ``loss_parallel`` for JAX.

A language model's logits ``(..., vocab)`` are usually produced by a column-parallel
output projection, split over the vocabulary on the tensor-parallel axis
(``Shard(-1)``). Gathering them to compute the loss moves ``tokens x vocab`` values per
device; :func:`vocab_parallel_cross_entropy` never gathers them. Each rank computes, per
token, the maximum of its vocabulary slice, then

1. one all-reduce (max) of one value per token: the global maximum ``m``;
2. one all-reduce (sum) of two values per token: ``sum(exp(logit - m))`` over the
   rank's slice, and the target's logit (held by the one rank whose slice contains the
   label, 0 elsewhere);

and the loss is ``m + log(sum) - target``, exact (the usual max-shifted log-sum-exp).
Only per-token scalars cross the network, ``3 x tokens`` values instead of
``tokens x vocab``. The gradient, by JAX's autodiff of the same per-rank code, is
``softmax - one_hot`` on each rank's own slice: no collective over the vocabulary in the
backward pass.

torch spells this ``with loss_parallel(): F.cross_entropy(logits_dtensor, labels)``: the
context changes what ``F.cross_entropy`` dispatches to. JAX has no dispatch on its loss
functions (``optax.softmax_cross_entropy_with_integer_labels`` is plain code), so the
JAX spellings are a function taking the DTensor, ``vocab_parallel_cross_entropy(logits,
labels)`` with torch's ``reduction`` and ``ignore_index``, and torch's pair:
:func:`cross_entropy` (``F.cross_entropy`` for DTensor logits) which inside
:func:`loss_parallel` takes the vocabulary-parallel path and outside it gathers the
vocabulary dim first, as torch's DTensor dispatch does outside the context. Built on
:func:`~placements2jax.func_map.local_map`; it runs eagerly, inside ``jax.jit`` and under
``jax.grad``.

**Uneven vocabularies** (GPT-2's 50257 on tp=4) are supported: torch.chunk leaves every
pad column of the padded representation after the last real one, so the loss runs on
the padded array with the pad columns masked out (gradient 0 there). Token dims must
split evenly, and so must a vocabulary split over several mesh axes at once (nested
uneven splits put pads between real columns); those are refused with a ShapeError.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from .dtensor import DTensor, distribute_tensor
from .errors import ArgumentTypeError, PlacementError, ShapeError
from .func_map import local_map
from .layout import Layout

__all__ = ["cross_entropy", "loss_parallel", "vocab_parallel_cross_entropy"]

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum", "none")


def vocab_parallel_cross_entropy(
    logits: DTensor, labels: Any, *, reduction: Reduction = "mean", ignore_index: int = -100
) -> DTensor:
    """Cross-entropy of ``logits`` (a DTensor ``(..., vocab)``, the vocabulary split over
    any mesh axes, e.g. ``Shard(-1)`` over ``tp``; the other dims split as you like)
    against integer ``labels`` of shape ``logits.shape[:-1]`` (an array or a DTensor),
    without gathering the logits (module docstring).

    ``reduction="mean"`` (torch's default: the mean over tokens whose label is not
    ``ignore_index``) and ``"sum"`` give a replicated scalar DTensor (``.to_jax()`` is the
    scalar to differentiate); ``"none"`` the per-token losses, laid out like the logits'
    leading dims (0 at ignored tokens). Computed in at least float32.
    """
    if not isinstance(logits, DTensor):
        raise ArgumentTypeError(
            "logits",
            logits,
            "expected a DTensor with the vocabulary (last) dim split",
            "distribute the logits (e.g. [Replicate(), Shard(-1)]), or use "
            "optax.softmax_cross_entropy_with_integer_labels for a plain array",
        )
    if reduction not in REDUCTIONS:
        raise ArgumentTypeError("reduction", reduction, "unknown reduction", "use 'mean', 'sum' or 'none' (torch's)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise ArgumentTypeError("ignore_index", ignore_index, "expected an int", "pass e.g. -100 (torch's default)")
    if logits.ndim < 1:
        raise ShapeError("logits", logits, "has no vocabulary dim", "pass logits of shape (..., vocab)")
    layout = logits.layout
    if layout.has_partial:
        raise PlacementError(
            "logits",
            str(layout),
            "holds partial values; the loss needs the logits themselves",
            "redistribute the Partial mesh dims to Replicate first",
        )
    mesh = logits.device_mesh
    token_layout = Layout(mesh, layout.dim_axes[:-1])
    labels = _labels(labels, logits, token_layout)
    vocab = logits.shape[-1]
    logits = _padded_vocab(logits)
    jax_mesh = mesh.to_jax()
    names = jax_mesh.axis_names
    vocab_axes = tuple(names[a] for a in layout.dim_axes[-1])
    token_axes = tuple(names[a] for axes in layout.dim_axes[:-1] for a in axes)
    sizes = tuple(jax_mesh.shape[n] for n in vocab_axes)
    per_rank = _per_rank(vocab_axes, sizes, token_axes, reduction, int(ignore_index), vocab, logits.shape[-1])
    out = token_layout if reduction == "none" else None
    try:
        return local_map(per_rank, out_placements=out, in_placements=(layout, token_layout))(logits, labels)
    except ShapeError as error:  # uneven logits: say so about the argument the caller passed
        raise ShapeError("logits", logits, error.problem, error.fix) from None


_LOSS_PARALLEL: contextvars.ContextVar[bool] = contextvars.ContextVar("loss_parallel", default=False)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """torch's ``loss_parallel()``: inside it, :func:`cross_entropy` of logits whose
    vocabulary (last) dim is split runs :func:`vocab_parallel_cross_entropy` (no gather of
    the logits); outside it, :func:`cross_entropy` gathers the vocabulary dim first. The
    context is read when the loss is traced (e.g. inside the function ``jax.jit`` traces)."""
    token = _LOSS_PARALLEL.set(True)
    try:
        yield
    finally:
        _LOSS_PARALLEL.reset(token)


def cross_entropy(
    logits: DTensor, labels: Any, *, reduction: Reduction = "mean", ignore_index: int = -100
) -> DTensor:
    """torch's ``F.cross_entropy(logits, labels)`` for DTensor logits ``(..., vocab)`` and
    integer labels, with torch's ``reduction`` and ``ignore_index``. Inside
    :func:`loss_parallel`: :func:`vocab_parallel_cross_entropy`. Outside: the vocabulary
    dim is all-gathered over its mesh axes (the other dims keep their splits), then the
    same computation runs on whole rows; the values are the same either way."""
    if isinstance(logits, DTensor) and not _LOSS_PARALLEL.get() and logits.ndim and logits.layout.dim_axes[-1]:
        layout = logits.layout
        logits = logits.redistribute(placements=Layout(layout.mesh, layout.dim_axes[:-1] + ((),), layout.partial))
    return vocab_parallel_cross_entropy(logits, labels, reduction=reduction, ignore_index=ignore_index)


@lru_cache(maxsize=256)
def _per_rank(
    vocab_axes: tuple[str, ...],
    sizes: tuple[int, ...],
    token_axes: tuple[str, ...],
    reduction: Reduction,
    ignore_index: int,
    vocab: int,
    padded: int,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The per-rank loss of a rank's logits block and labels (one function per
    configuration, so that local_map reuses its compiled program across eager calls)."""

    def per_rank(block: jax.Array, label: jax.Array) -> jax.Array:
        x = block.astype(jnp.promote_types(block.dtype, jnp.float32))
        width = x.shape[-1]
        slot = 0
        for name, size in zip(vocab_axes, sizes):  # this rank's slice of the vocabulary, major axis first
            slot = slot * size + jax.lax.axis_index(name)
        local = label.astype(jnp.int32) - slot * width
        if padded != vocab:  # uneven vocabulary: the pad columns take no part
            column = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
            x = jnp.where(column < vocab - slot * width, x, -jnp.inf)
        mine = (local >= 0) & (local < width)
        picked = jnp.take_along_axis(x, jnp.clip(local, 0, width - 1)[..., None], axis=-1)[..., 0]
        shift = jax.lax.stop_gradient(x.max(axis=-1))
        if vocab_axes:
            shift = jax.lax.pmax(shift, vocab_axes)
        both = jnp.stack([jnp.exp(x - shift[..., None]).sum(axis=-1), jnp.where(mine, picked, 0.0)])
        if vocab_axes:
            both = jax.lax.psum(both, vocab_axes)
        valid = label != ignore_index
        loss = jnp.where(valid, shift + jnp.log(both[0]) - both[1], 0.0)
        if reduction == "none":
            return loss
        total, count = loss.sum(), valid.sum(dtype=jnp.int32)
        if token_axes:
            total, count = jax.lax.psum((total, count), token_axes)
        return total / count if reduction == "mean" else total

    return per_rank


def _padded_vocab(logits: DTensor) -> DTensor:
    """Logits whose vocabulary dim alone is uneven, as the DTensor of their physical
    array: torch.chunk puts every pad column after the last real one (the padded
    representation, docs/semantics.md), so the same array is an even tensor of the padded
    vocabulary whose extra columns the loss masks. The gradient reaches ``logits``'s own
    array (0 at the pads)."""
    phys = logits.physical
    padded = phys.padded_shape
    if padded == logits.shape or padded[:-1] != logits.shape[:-1] or not phys.is_prefix(logits.ndim - 1):
        return logits  # even, or uneven elsewhere: local_map refuses the latter clearly
    return DTensor(logits.array, logits.layout, padded)


def _labels(labels: Any, logits: DTensor, token_layout: Layout) -> DTensor:
    """``labels`` as a DTensor laid out like the logits' token dims."""
    want = logits.shape[:-1]
    shape = tuple(getattr(labels, "shape", ()))
    if shape != want:
        raise ShapeError(
            "labels", labels if isinstance(labels, DTensor) else f"<array of shape {shape}>",
            f"has shape {shape}, the logits {logits.shape} need {want}", "pass one label per token",
        )
    dtype = np.dtype(labels.dtype)
    if dtype.kind not in "iu":
        raise ArgumentTypeError(
            "labels", f"<{dtype} array>", "labels must be integer class indices", "cast them, e.g. labels.astype(int)"
        )
    if isinstance(labels, DTensor):
        return labels.redistribute(logits.device_mesh, token_layout)
    return distribute_tensor(labels, logits.device_mesh, token_layout)
