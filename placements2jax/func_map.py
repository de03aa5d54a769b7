"""``local_map``: run per-rank code on the local blocks of DTensors, as torch's
``torch.distributed.tensor.experimental.local_map`` (2.13) does.

``local_map(func, out_placements, in_placements)`` returns a function that takes
DTensors (and anything else), hands ``func`` every rank's local block of each DTensor
argument, and wraps ``func``'s local results into DTensors with ``out_placements``. It
is built on ``jax.shard_map`` over the mesh, so ``func`` is ordinary per-rank JAX code:
a hand-written collective (``jax.lax.psum(x, "tp")``, the mesh's axis names), a Pallas
kernel, anything ``shard_map`` accepts. It runs eagerly, inside ``jax.jit`` and under
``jax.grad``.

Arguments follow torch's rules exactly:

* ``args`` are flattened as a pytree (``None`` counts as a leaf, as in torch's pytree);
  ``in_placements``, when given, has one entry per flattened argument: placements for a
  DTensor argument, ``None`` for anything that is not an array. A DTensor whose layout
  differs is an error unless ``redistribute_inputs=True`` (then XLA moves it first).
  Plain arrays are passed whole to every rank (replicated), as torch passes a plain
  tensor; other values (Python numbers, strings...) are passed as they are.
* ``out_placements`` is one placements value when ``func``'s flattened output has one
  leaf, else a tuple with one entry per flattened output leaf (``None`` for an output
  that is not an array; an array output with ``None`` is replicated). Every rank's
  block must have the same shape (shard_map's rule), so a ``Shard(d)`` output over
  ``n`` ranks has ``n`` times the local extent, as torch's ``from_local`` infers it.
* ``Partial(op)`` outputs are the natural result of a local contraction: each rank's
  block is its partial value. ``Partial(sum)`` becomes JAX's ``unreduced`` on Explicit
  meshes, ``avg``/``max``/``min`` the stacked form (docs/semantics.md). Partial inputs
  hand ``func`` the rank's partial value, as torch's ``to_local`` does.
* With no DTensor argument, ``func`` is simply called and its result returned (torch
  does the same).

``func`` is traced when a call brings a new combination of argument layouts, shapes,
dtypes and static (non-array) values; the jitted program is then reused, so repeated
eager calls cost one compiled call (as jitted code, ``func``'s Python side effects run
only while tracing).

Differences from torch, each because JAX can do better or cannot do the same:

* **Gradients.** JAX differentiates through ``shard_map`` exactly: the gradient of a
  Replicate input used by per-rank code is summed over the ranks that used it (torch
  needs the ``in_grad_placements`` hint for that). ``in_grad_placements`` is accepted
  for torch's signature and checked for its length, and otherwise not needed.
* **Replicate outputs are checked.** JAX tracks which mesh axes a per-rank value varies
  over; an output declared ``Replicate`` on an axis it varies over (a partial sum that
  was not all-reduced, say) is an error instead of torch's unchecked ``from_local``.
* **Uneven inputs are refused.** ``shard_map`` gives every rank a block of one shape,
  while torch.chunk gives uneven layouts blocks of several shapes; the error names the
  argument and a rank whose block would be padded. Handing ``func`` the padded blocks
  of the physical representation is not sound for arbitrary per-rank code: ``func``
  would see pad elements and the padded shape (a sum or a matmul over the padded dim
  would still be right with zero pads, but a mean, a max of negative values, a softmax,
  ``x.shape`` or a Pallas kernel's grid would not), and its outputs' pads would have to
  be known to be pads. Operators and :func:`~placements2jax.operators.apply` do run
  uneven layouts, because there each op's neutral element fills the pads.
* ``kwargs`` are passed to ``func`` unchanged, as torch does; DTensors there are refused
  (torch would hand ``func`` the DTensor itself, which per-rank JAX code cannot use).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .dtensor import DTensor
from .caches import Memo
from .errors import ArgumentTypeError, MeshError, PlacementError, ShapeError
from .layout import Layout, MeshPlacements, PlacementsLike, resolve_layout
from .mesh import DeviceMesh, as_device_mesh, shard_map
from .operators import block_spec, relabel, vary
from .physical import Physical, physical
from .placements import Placement

__all__ = ["local_map"]

PlacementType = "PlacementsLike | Layout | None"


def local_map(
    func: Callable[..., Any] | None = None,
    out_placements: Any = None,
    in_placements: Sequence[Any] | None = None,
    in_grad_placements: Sequence[Any] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Callable[..., Any]:
    """``func`` applied to every rank's local blocks of its DTensor arguments, its local
    results wrapped into DTensors with ``out_placements`` (torch's ``local_map``; the
    rules are in the module docstring). Without ``func``, a decorator."""
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    if not callable(func):
        raise ArgumentTypeError("func", func, "expected a function of local arrays", "pass e.g. lambda x, w: x @ w")
    if not isinstance(redistribute_inputs, bool):
        raise ArgumentTypeError("redistribute_inputs", redistribute_inputs, "expected a bool", "pass True or False")
    for name, value in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if value is not None and (isinstance(value, str) or not isinstance(value, Sequence)):
            raise ArgumentTypeError(
                name,
                value,
                "expected one entry per flattened argument (a tuple)",
                f"pass e.g. {name}=((Shard(0),), None)",
            )
    mesh = None if device_mesh is None else as_device_mesh(device_mesh)

    @functools.wraps(func)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        return _call(func, out_placements, in_placements, in_grad_placements, mesh, redistribute_inputs, args, kwargs)

    return mapped


def _is_leaf(value: Any) -> bool:
    return value is None or isinstance(value, DTensor)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def _call(
    func: Callable[..., Any],
    out_placements: Any,
    in_placements: Sequence[Any] | None,
    in_grad_placements: Sequence[Any] | None,
    mesh: DeviceMesh | None,
    redistribute_inputs: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    flat, tree = jax.tree_util.tree_flatten(args, is_leaf=_is_leaf)
    for name, value in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if value is not None and len(value) != len(flat):
            raise PlacementError(
                name,
                value,
                f"has {len(value)} entries for {len(flat)} flattened arguments (None counts as one)",
                "give one entry per flattened argument: placements for a DTensor, None for a non-array",
            )
    if any(isinstance(v, DTensor) for v in jax.tree_util.tree_leaves(kwargs, is_leaf=_is_leaf)):
        raise ArgumentTypeError(
            "kwargs",
            sorted(kwargs),
            "a keyword argument holds a DTensor; local_map converts positional arguments only (as torch)",
            "pass DTensors positionally",
        )
    dtensors = [i for i, v in enumerate(flat) if isinstance(v, DTensor)]
    if not dtensors:
        return func(*args, **kwargs)
    if mesh is None:
        mesh = flat[dtensors[0]].device_mesh
    flat = list(flat)
    for i, value in enumerate(flat):
        spec = None if in_placements is None else in_placements[i]
        if isinstance(value, DTensor):
            flat[i] = _prepared(value, i, spec, in_placements is not None, mesh, redistribute_inputs)
        elif spec is not None and not _is_array(value):
            raise PlacementError(
                f"in_placements[{i}]", spec, f"argument {i} is {type(value).__name__}, not an array", "pass None for it"
            )
    passed = [i for i, v in enumerate(flat) if isinstance(v, DTensor) or _is_array(v)]
    jax_mesh = mesh.to_jax()
    arrays = [flat[i].array if isinstance(flat[i], DTensor) else _replicated(flat[i], jax_mesh) for i in passed]
    key = _program_key(func, out_placements, mesh, tree, flat, kwargs)
    program = _PROGRAMS.recall(key)  # an unhashable static argument: no reuse for this call
    if program is None:
        program = _program(func, out_placements, mesh, tree, flat, passed, arrays, kwargs)
        _PROGRAMS.remember(key, program)
    run, leaves, out_tree, outs = program
    computed, physicals = iter(run(*arrays)), iter(outs)
    result = []
    for leaf in leaves:
        if leaf is _OUTPUT:
            phys = next(physicals)
            result.append(DTensor(next(computed), phys.layout, phys.shape))
        else:
            result.append(leaf)
    return jax.tree_util.tree_unflatten(out_tree, result)


Program = tuple[Callable[..., Any], list[Any], Any, list[Physical]]
_OUTPUT = object()  # stands for an array output among func's flattened outputs

# Eager calls of the same function on the same layouts reuse one jitted program (tracing
# func, probing its outputs and compiling take hundreds of ms); the key holds func itself
# and every static argument, so an entry is reused only for an identical call.
_PROGRAMS = Memo(256)


def _program_key(
    func: Callable[..., Any], out_placements: Any, mesh: DeviceMesh, tree: Any, flat: Sequence[Any], kwargs: Any
) -> Any:
    def leaf_key(value: Any) -> Any:
        if isinstance(value, DTensor):
            return ("dtensor", value.layout, value.shape, value.dtype)
        if _is_array(value):
            return ("array", tuple(value.shape), np.dtype(value.dtype), isinstance(value, jax.core.Tracer))
        return ("static", type(value), value)

    kwargs_key = tuple(sorted((k, type(v), v) for k, v in kwargs.items()))
    return (func, _freeze(out_placements), mesh, tree, tuple(leaf_key(v) for v in flat), kwargs_key)


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _program(
    func: Callable[..., Any],
    out_placements: Any,
    mesh: DeviceMesh,
    tree: Any,
    flat: Sequence[Any],
    passed: Sequence[int],
    arrays: Sequence[Any],
    kwargs: dict[str, Any],
) -> Program:
    """The jitted program of the arrays in ``passed`` (DTensors' physical arrays, plain
    arrays replicated), func's flattened outputs (``_OUTPUT`` for each array) and their
    tree, and the array outputs' physical layouts."""
    ins: dict[int, Physical] = {i: flat[i].physical for i in passed if isinstance(flat[i], DTensor)}
    in_specs = tuple(block_spec(ins[i]) if i in ins else PartitionSpec() for i in passed)
    jax_mesh = mesh.to_jax()

    def relabelled(values: Sequence[Any]) -> list[Any]:
        return [relabel(ins[i])(v) if i in ins and ins[i].unreduced_axes else v for i, v in zip(passed, values)]

    def local_args(blocks: Sequence[jax.Array]) -> tuple[Any, ...]:
        given = dict(zip(passed, blocks))
        values = [
            _unstack(given[i], ins[i]) if i in ins else given[i] if i in given else v for i, v in enumerate(flat)
        ]
        return jax.tree_util.tree_unflatten(tree, values)

    found: dict[str, Any] = {}

    def probe(*blocks: jax.Array) -> list[jax.Array]:
        leaves, out_tree = jax.tree_util.tree_flatten(func(*local_args(blocks), **kwargs), is_leaf=lambda v: v is None)
        found["tree"], found["leaves"] = out_tree, leaves
        return [v for v in leaves if _is_array(v)]

    shapes = jax.eval_shape(
        lambda *values: shard_map(
            probe, mesh=jax_mesh, in_specs=in_specs, out_specs=PartitionSpec(), check_vma=False
        )(*relabelled(values)),
        *arrays,
    )
    leaves, out_tree = found["leaves"], found["tree"]
    specs = _out_specs(out_placements, leaves)
    outs: list[Physical] = []
    shape_of = iter(shapes)
    for k, (leaf, spec) in enumerate(zip(leaves, specs)):
        if not _is_array(leaf):
            if spec is not None:
                raise PlacementError(
                    _out_name(k, len(leaves)), spec, f"output {k} is {type(leaf).__name__}, not an array", "pass None"
                )
            continue
        local = tuple(next(shape_of).shape)
        layout = _out_layout(mesh, spec, len(local), k, len(leaves))
        shape = tuple(n * int(np.prod(layout.pieces(d), dtype=np.int64)) for d, n in enumerate(local))
        outs.append(physical(layout, shape))

    def body(*blocks: jax.Array) -> list[jax.Array]:
        results = jax.tree_util.tree_leaves(func(*local_args(blocks), **kwargs), is_leaf=lambda v: v is None)
        arrays_out = [v for v in results if _is_array(v)]
        return [_packed(y, phys, k) for k, (y, phys) in enumerate(zip(arrays_out, outs))]

    mapped = shard_map(body, mesh=jax_mesh, in_specs=in_specs, out_specs=[p.spec for p in outs])
    run = jax.jit(lambda *values: mapped(*relabelled(values)))
    return run, [_OUTPUT if _is_array(v) else v for v in leaves], out_tree, outs


def _replicated(value: Any, jax_mesh: jax.sharding.Mesh) -> Any:
    """A plain array argument, whole on every device of the mesh (a concrete array may
    sit on other devices, which shard_map refuses; a traced one is placed by the caller's jit)."""
    if isinstance(value, jax.core.Tracer):
        return value
    return jax.device_put(value, NamedSharding(jax_mesh, PartitionSpec()))


def _prepared(
    value: DTensor, index: int, spec: Any, checked: bool, mesh: DeviceMesh, redistribute_inputs: bool
) -> DTensor:
    """The DTensor argument ``index`` in its required layout, checked even."""
    if value.device_mesh != mesh:
        raise MeshError(
            f"args (flattened argument {index})",
            value,
            f"lives on {value.device_mesh!r}, not on local_map's mesh {mesh!r}",
            "redistribute it to that mesh first, or pass device_mesh=None",
        )
    if checked:
        if spec is None:
            raise PlacementError(
                f"in_placements[{index}]",
                None,
                f"argument {index} is a DTensor ({value.layout})",
                "give its placements",
            )
        target = resolve_layout(mesh, spec, value.ndim)
        if target != value.layout:
            if not redistribute_inputs:
                raise PlacementError(
                    f"in_placements[{index}]",
                    spec,
                    f"argument {index} is laid out as {value.layout}, not {target}",
                    "redistribute it first, or pass redistribute_inputs=True to local_map",
                )
            value = value.redistribute(placements=spec)
    if value.physical.is_padded:
        block = value.physical.padded_shape
        block = tuple(n // int(np.prod(value.layout.pieces(d), dtype=np.int64)) for d, n in enumerate(block))
        rank, local = next(
            (r, s) for r, s in value.layout.all_local_shapes(value.shape).items() if s != block
        )
        raise ShapeError(
            f"args (flattened argument {index})",
            value,
            f"is uneven: rank {rank}'s block {local} would be padded to {block} (jax.shard_map gives every rank "
            f"a block of one shape, and func would see the pad elements)",
            "redistribute it to placements whose split dims divide evenly, or pad the tensor to a divisible shape",
        )
    return value


def _unstack(block: jax.Array, phys: Physical) -> jax.Array:
    """A rank's block without the leading size-1 dims of stacked / relabelled partials."""
    count = len(phys.stacked_axes) + len(phys.unreduced_axes)
    return block.reshape(block.shape[count:]) if count else block


def _is_placements_value(value: Any) -> bool:
    """A single placements value (not a tuple of per-output ones)."""
    return isinstance(value, (str, Layout, MeshPlacements)) or (
        isinstance(value, Sequence) and any(_is_placement(p) for p in value)
    )


def _is_placement(value: Any) -> bool:
    return isinstance(value, Placement) or type(value).__module__.startswith("torch.distributed")


def _out_specs(out_placements: Any, leaves: Sequence[Any]) -> tuple[Any, ...]:
    """One placements entry per flattened output. As torch, a tuple has one entry per
    output; a list, a string, a Layout or a tuple of placement objects is one output's
    placements, and so is a tuple whose length cannot be per-output (one output: an
    alias-form tuple such as ``("dp", None)``)."""
    if isinstance(out_placements, tuple) and not _is_placements_value(out_placements) and (
        len(out_placements) == len(leaves) or len(leaves) != 1
    ):
        if len(out_placements) != len(leaves):
            raise PlacementError(
                "out_placements",
                out_placements,
                f"has {len(out_placements)} entries for {len(leaves)} flattened outputs of func",
                "give one placements entry per flattened output (None for a non-array output)",
            )
        return out_placements
    if len(leaves) != 1:
        raise PlacementError(
            "out_placements",
            out_placements,
            f"is one placements value, but func returns {len(leaves)} flattened outputs",
            "pass a tuple with one placements entry per flattened output",
        )
    return (out_placements,)


def _out_name(k: int, count: int) -> str:
    return "out_placements" if count == 1 else f"out_placements[{k}]"


def _out_layout(mesh: DeviceMesh, spec: Any, ndim: int, k: int, count: int) -> Layout:
    if spec is None:
        return Layout(mesh, ((),) * ndim)
    try:
        return resolve_layout(mesh, spec, ndim)
    except (PlacementError, ArgumentTypeError) as error:
        raise type(error)(_out_name(k, count), spec, f"output {k}: {error.problem}", error.fix) from None


def _packed(y: jax.Array, phys: Physical, k: int) -> jax.Array:
    """Rank's local result ``y`` as its block of ``phys``'s physical array."""
    layout, names = phys.layout, phys.mesh_names
    allowed = {names[a] for axes in layout.dim_axes for a in axes} | {names[a] for a in layout.partial_axes}
    varying = set(jax.typeof(y).mat.varying)
    if varying - allowed:
        axes = sorted(varying - allowed)
        raise PlacementError(
            "out_placements",
            str(layout),
            f"output {k} differs between the ranks of mesh axes {axes} (it depends on data split over them), "
            f"but its placements say Replicate there",
            f"reduce it in func (jax.lax.psum(y, {axes[0]!r})) or declare Partial('sum') / Shard on {axes[0]!r}",
        )
    y = vary(y, frozenset(allowed))
    y = y.reshape((1,) * len(phys.stacked_axes) + y.shape)
    if phys.unreduced_axes:
        y = jax.lax.pcast(y, tuple(names[a] for a in layout.partial_axes), to="unreduced")
    return y
