"""Training plain JAX model code on DTensor pytrees.

:func:`model_arrays` hands unmodified model code (``table[idx]``, ``jnp.where`` masks,
``lax.scan`` over layers) the logical arrays of a pytree of DTensors, on any mesh;
:func:`mixed_precision` wraps an optax optimizer so that low-precision (bfloat16)
parameters are trained through float32 master weights kept in the optimizer state.
Both map over the DTensors' physical arrays, so every layout is kept.

:func:`init_optimizer_state` builds any optax optimizer's state on DTensor parameters
with each state leaf following its parameter, as torch's optimizer state follows DTensor
parameters; :func:`state_layouts` gives those layouts for a state built elsewhere. Which
leaves follow which parameter (:func:`param_followers`: the leaves of a subtree with the
parameters' tree structure, each of its parameter's shape or a statistic of it) and their
layouts (:func:`followed_layout`) are the rule :func:`~placements2jax.auto_plan` applies too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from .dtensor import DTensor, auto_twin_of, is_dtensor
from .errors import ArgumentTypeError, import_extra
from .layout import Layout
from .operators import apply

__all__ = [
    "model_arrays",
    "mixed_precision",
    "MixedPrecisionState",
    "init_optimizer_state",
    "state_layouts",
]


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
    optax = _optax("mixed_precision")
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


def init_optimizer_state(optimizer: Any, params: Any) -> Any:
    """``optimizer.init(params)`` for any optax optimizer on a pytree of DTensor
    parameters, every state leaf a DTensor (a typed PRNG key a key: optax.noisy_sgd's)
    laid out as :func:`state_layouts` says: a
    leaf of its parameter's shape has the parameter's layout (Adam's ``mu`` and ``nu``), a
    leaf of the parameter's shape with dims dropped or set to 1 keeps the splits of the
    kept dims (``optax.adafactor``'s factored row and column statistics), other leaves
    (step counts, ``optax.novograd``'s per-parameter norms, ``optax.zero_nans``' flags)
    are Replicate.

    The init runs under :func:`~placements2jax.apply` with these ``out_layouts``: XLA
    compiles it once and makes each array in its layout on the devices (no host
    round trip, no gather). The state then serves a step run under ``apply`` with
    ``out_layouts=(params, state, None)``, which keeps every layout (in a plain
    ``jax.jit`` step: ``apply(optimizer.update, grads, state, params,
    out_layouts=(params, state))``). ``optimizer.update`` on the DTensors themselves works
    only for state of the parameters' shapes: JAX's ``tree.map`` of a gradient with a
    state leaf of another shape fails on the DTensors' pytree metadata (shape, layout).

    Why not ``optimizer.init(params)``: optax maps over a DTensor's physical array, which
    keeps the layout of same-shaped state but puts arrays of other shapes into DTensors
    whose layout does not describe them (refused by ``DTensor.checked``); and
    ``apply(optimizer.init, params)`` alone lets XLA lay out the new arrays, which it
    makes Replicate (a tp-split weight's moments then cost tp times the memory).
    The state's shapes come from ``jax.eval_shape`` of the init on the parameters'
    logical shapes: on the DTensors themselves it would map over their physical
    (padded) arrays.
    """
    optax = _optax("init_optimizer_state")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ArgumentTypeError(
            "optimizer", optimizer, "expected an optax GradientTransformation", "pass e.g. optax.adamw(1e-3)"
        )
    shapes = jax.eval_shape(
        optimizer.init,
        jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), _dtensor_params(params), is_leaf=is_dtensor),
    )
    return apply(optimizer.init, params, out_layouts=state_layouts(shapes, params))


def state_layouts(state: Any, params: Any) -> Any:
    """The pytree of ``state`` (an optimizer's state, or its ``jax.eval_shape``) with each
    leaf replaced by the :class:`Layout` it takes following the DTensor ``params``; for
    ``out_layouts`` of :func:`~placements2jax.apply` / ``predict`` (the init of a state
    built by hand) or to distribute a state built on plain arrays leaf by leaf.

    The leaves of every subtree of ``state`` of which ``params``' tree structure is a
    prefix follow the parameter at their position when each has its parameter's shape or
    that shape with dims dropped or set to 1 (:func:`param_followers`). A follower of its
    parameter's shape takes the parameter's layout; one whose shape is the parameter's
    with dims dropped or set to 1 keeps the mesh axes of each kept dim of the same size
    (a dim split where a dropped one was, or set to 1, is Replicate); when the shapes
    leave the kept dims ambiguous (``(256,)`` from ``(256, 256)``: row or column
    statistics), a dim keeps its axes only where every reading agrees
    (:func:`followed_layout`). Partial becomes Replicate (a state leaf is a value per
    element, not a sum of pieces). Other leaves are Replicate on the parameters' mesh.
    ``auto_plan`` lays out the optimizer state it is given by the same rule.
    """
    leaves = _dtensor_params(params)
    param_leaves, param_tree = jax.tree.flatten(leaves, is_leaf=is_dtensor)
    mesh = param_leaves[0].device_mesh
    pairs, state_tree = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_dtensor)
    shapes = [_state_shape(path, leaf) for path, leaf in pairs]
    layouts = []
    for shape, follows in zip(shapes, param_followers(state, param_tree, [p.shape for p in param_leaves])):
        if follows is None:
            layouts.append(Layout(mesh, ((),) * len(shape)))
        else:
            param = param_leaves[follows]
            layouts.append(followed_layout(param.layout, param.shape, shape))
    return jax.tree_util.tree_unflatten(state_tree, layouts)


def param_followers(tree: Any, param_tree: Any, param_shapes: Sequence[Sequence[int]]) -> list[int | None]:
    """Per leaf of ``tree`` (DTensors as leaves): the index of the parameter it follows
    (among the leaves of ``param_tree``, a tree structure with DTensors as leaves, whose
    shapes are ``param_shapes``), else None. The leaves of a subtree of ``tree`` of which
    ``param_tree`` is a prefix follow the parameter at their position when each is shaped
    like its parameter or like a statistic of it (:func:`_readings`: the parameter's
    shape with dims dropped or set to 1): Adam's ``mu`` leaf by leaf, ``optax.adafactor``'s
    ``v_row`` / ``v_col`` / ``v``, ``optax.sm3``'s list of accumulators per parameter all of
    them. The outermost such subtree counts. The shapes keep an argument that merely has
    the parameters' tree structure (when the parameters are one array: any leaf) from
    following them unless it could be a statistic."""

    def visit(x: Any) -> list[int | None]:
        try:
            per_param = param_tree.flatten_up_to(x)
        except (ValueError, TypeError):
            per_param = None
        if per_param is not None:
            followers = [(k, leaf) for k, sub in enumerate(per_param) for leaf in jax.tree.leaves(sub, is_leaf=is_dtensor)]
            if all(_readings(param_shapes[k], np.shape(leaf)) for k, leaf in followers):
                return [k for k, _ in followers]
        if is_dtensor(x):
            return [None]
        children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
        if len(children) == 1 and children[0] is x:
            return [None]
        return [k for child in children for k in visit(child)]

    return visit(tree)


def _readings(param_shape: Sequence[int], shape: Sequence[int]) -> list[tuple[int, ...]]:
    """The ways ``shape`` reads as ``param_shape`` with dims dropped or set to 1: per
    reading, the parameter's dim each of ``shape``'s dims keeps (a dim of size 1 may stand
    for any). Empty: not a statistic of the parameter. ``param_shape`` itself reads as
    every dim kept (among others, where some of its dims are 1)."""
    param_shape, shape = tuple(param_shape), tuple(shape)
    return [kept for kept in itertools.combinations(range(len(param_shape)), len(shape))
            if all(size in (param_shape[d], 1) for size, d in zip(shape, kept))]


def followed_layout(layout: Layout, param_shape: Sequence[int], shape: Sequence[int]) -> Layout:
    """The layout of a state array of ``shape`` following a parameter of ``param_shape``
    laid out ``layout`` (the rule of :func:`state_layouts`, which auto_plan's search
    applies to the optimizer state too): the parameter's layout without Partial for its
    shape; for a statistic (:func:`_readings`), each dim keeps the mesh axes of the
    parameter's dim it keeps where every reading agrees, else Replicate. ``shape`` is one
    of these (:func:`param_followers` picks such leaves)."""
    param_shape, shape = tuple(param_shape), tuple(shape)
    if shape == param_shape:
        return layout.without_partial()
    readings = {
        tuple((layout.dim_axes[d], layout.split_factors[d]) if size == param_shape[d] else ((), 1)
              for size, d in zip(shape, kept))
        for kept in _readings(param_shape, shape)
    }
    dims = [dim.pop() if len(dim) == 1 else ((), 1) for dim in map(set, zip(*readings))]
    return Layout(layout.mesh, tuple(axes for axes, _ in dims), None, tuple(f for _, f in dims))


def _dtensor_params(params: Any) -> Any:
    """``params`` when every leaf is a DTensor (and there is one), else ArgumentTypeError
    naming the first other leaf."""
    pairs = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_dtensor)[0]
    for path, leaf in pairs:
        if not isinstance(leaf, DTensor):
            raise ArgumentTypeError(
                f"params{jax.tree_util.keystr(path)}", leaf, "expected a DTensor (the state follows the "
                "parameters' layouts)", "distribute the parameters first, e.g. with distribute_pytree(params, mesh, plan)",
            )
    if not pairs:
        raise ArgumentTypeError(
            "params", params, "has no DTensor leaf (the state follows the parameters' layouts)",
            "pass the model's pytree of DTensor parameters",
        )
    return params


def _state_shape(path: Any, leaf: Any) -> tuple[int, ...]:
    """The logical shape of a state leaf (an array, its ShapeDtypeStruct, a DTensor whose
    array its layout describes), else ArgumentTypeError naming it."""
    where = f"state{jax.tree_util.keystr(path)}"
    if isinstance(leaf, DTensor):
        return leaf.checked(where).shape
    shape = getattr(leaf, "shape", None)
    if shape is None or getattr(leaf, "dtype", None) is None:
        raise ArgumentTypeError(
            where, leaf, "a state leaf must be an array, a jax.ShapeDtypeStruct or a DTensor",
            "pass the optimizer's state or its jax.eval_shape(optimizer.init, params)",
        )
    return tuple(shape)


def _optax(needed_for: str) -> Any:
    return import_extra("optax", "train", needed_for, argument="optimizer", value="optax")
