"""Training plain JAX model code on DTensor pytrees.

:func:`model_arrays` hands unmodified model code (``table[idx]``, ``jnp.where`` masks,
``lax.scan`` over layers) the logical arrays of a pytree of DTensors, on any mesh;
:func:`mixed_precision` wraps an optax optimizer so that low-precision (bfloat16)
parameters are trained through float32 master weights kept in the optimizer state.
Both map over the DTensors' physical arrays, so every layout is kept.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .dtensor import DTensor, auto_twin_of, is_dtensor
from .errors import ArgumentTypeError, MissingDependencyError

__all__ = ["model_arrays", "mixed_precision", "MixedPrecisionState"]


def model_arrays(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its logical ``jax.Array`` (``to_jax()``),
    typed for plain JAX model code: on an Explicit mesh (the default) the array is moved
    to the mesh's Auto twin (same devices, names and ``PartitionSpec``: a relabel, no data
    moves), so that XLA propagates shardings through the model as for any unannotated
    JAX code. Other leaves are returned as they are.

    Why: on Explicit axes the sharding is part of every array's type and JAX decides it
    op by op at trace time; it refuses operations whose output sharding is ambiguous,
    e.g. ``table[idx]`` on a vocabulary-split table ("use ``.at[...].get(out_sharding=)``").
    Auto axes leave the choice to XLA's propagation (docs/training.md, Explicit or Auto
    axes). Under ``jax.grad`` the move is transposed back: gradients come out as DTensors
    in the parameters' own (Explicit) layouts.
    """
    return jax.tree.map(_model_array, tree, is_leaf=is_dtensor)


def _model_array(leaf: Any) -> Any:
    if not isinstance(leaf, DTensor):
        return leaf
    array = leaf.to_jax()
    mesh = leaf.device_mesh
    if not mesh.is_explicit:
        return array
    sharding = jax.typeof(array).sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh.axis_types != mesh.to_jax().axis_types:
        return array  # already on the Auto twin (an eager-grad scalar) or not on the mesh
    return jax.device_put(array, NamedSharding(auto_twin_of(mesh.to_jax()), sharding.spec))


class MixedPrecisionState(NamedTuple):
    """The state of :func:`mixed_precision`: the master weights (the parameters in the
    master dtype, same layouts) and the wrapped optimizer's state, built on them."""

    master: Any
    inner: Any


def mixed_precision(optimizer: Any, master_dtype: Any = jnp.float32) -> Any:
    """An optax ``GradientTransformation``: ``optimizer`` run in ``master_dtype`` on master
    weights kept in the state, for parameters stored in a lower precision (bfloat16).

    ``init(params)`` copies the parameters to ``master_dtype`` (the master weights) and
    initializes ``optimizer`` on them, so its moments are ``master_dtype`` too. Each
    ``update(grads, state, params)`` casts the gradients up, applies ``optimizer``'s
    update to the master weights, and returns the updates that take ``params`` to the
    new master weights rounded to the parameters' dtype: after ``optax.apply_updates``
    the parameters are exactly ``new_master.astype(params.dtype)``, and small updates
    accumulate in the master weights instead of rounding away. The step code is the
    usual optax one. On DTensor pytrees every cast maps over the physical arrays, so
    master weights and moments have their parameter's layout (padding stays zero).
    """
    optax = _optax()
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ArgumentTypeError(
            "optimizer", optimizer, "expected an optax GradientTransformation", "pass e.g. optax.adamw(1e-3)"
        )
    try:
        dtype = jnp.dtype(master_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ArgumentTypeError(
            "master_dtype", master_dtype, "expected a floating dtype", "pass e.g. jnp.float32"
        )

    def upcast(tree: Any) -> Any:
        return jax.tree.map(lambda a: a.astype(dtype), tree)

    def init(params: Any) -> MixedPrecisionState:
        master = upcast(params)
        return MixedPrecisionState(master, optimizer.init(master))

    def update(grads: Any, state: MixedPrecisionState, params: Any = None) -> tuple[Any, MixedPrecisionState]:
        if params is None:
            raise ArgumentTypeError(
                "params", params, "mixed_precision needs the parameters to compute their updates",
                "call optimizer.update(grads, state, params)",
            )
        updates, inner = optimizer.update(upcast(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # Two bfloat16 values differ exactly in float32 unless their exponents are far apart,
        # so apply_updates (params + steps in float32, cast back) lands exactly on the rounding.
        steps = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(dtype) - p.astype(dtype), master, params)
        return steps, MixedPrecisionState(master, inner)

    return optax.GradientTransformation(init, update)


def _optax() -> Any:
    try:
        import optax
    except ImportError:  # pragma: no cover - the train extra
        raise MissingDependencyError(
            "optimizer", "optax", "mixed_precision wraps an optax optimizer", "pip install 'placements2jax[train]'"
        ) from None
    return optax

