"""XLA programs that move a DTensor's physical array from one layout to another.

:func:`convert` is a traceable function (it runs inside the caller's ``jax.jit`` as well
as eagerly) built from three steps, each left to XLA to implement with collectives:

1. reduce the partial mesh dims that the target does not keep (``reshard`` of an
   ``unreduced`` array, or a reduction over stack dims: an all-reduce);
2. move the tensor dims to the target's sharding (``reshard``: all-gather, all-to-all,
   local slice ...), re-padding dims whose torch.chunk blocks change (uneven layouts);
3. create the target's new partial mesh dims (Replicate -> Partial: local, no traffic).

:func:`program` caches one ``jax.jit`` per (source, target) physical representation, so
each redistribution is compiled once per shape and dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .caches import cached
from .errors import RedistributeError
from .hlo import running
from .layout import Layout
from .mesh import shard_map
from .physical import Physical, physical

__all__ = ["convert", "program", "check_redistribute", "strided_route", "strided_route_tables"]

# One step of a strided route: (tensor dim, mesh dim, collective), see strided_route.
StridedStep = tuple[int, int, str]

def _sum(x: jax.Array, axis: tuple[int, ...]) -> jax.Array:
    """Sum over stack dims in the tensor's dtype (JAX would widen small integers)."""
    return jnp.sum(x, axis=axis, dtype=x.dtype)


def _average(x: jax.Array, axis: tuple[int, ...]) -> jax.Array:
    """Mean over stack dims, keeping the dtype (integers: exact floor of sum / n)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.mean(x, axis=axis)
    n = math.prod(x.shape[a] for a in axis)
    # The plain sum overflows (n copies of a large value); with x = q*n + r, 0 <= r < n,
    # floor(sum / n) = sum(q) + floor(sum(r) / n): only additions wrap, and the result fits.
    remainders = jnp.sum(x % n, axis=axis, dtype=jnp.int32) // n
    return _sum(x // n, axis) + remainders.astype(x.dtype)


REDUCERS = {"sum": _sum, "avg": _average, "max": jnp.max, "min": jnp.min}


def check_redistribute(src: Layout, dst: Layout, written: Any = None) -> None:
    """Refuse what torch refuses: Shard -> Partial and Partial(a) -> Partial(b) on a mesh dim.
    ``written``: the placements as the user wrote them, which the error names (default ``dst``)."""
    names = src.mesh.axis_names
    written = dst if written is None else written
    for mesh_dim, (src_op, dst_op) in enumerate(zip(src.partial, dst.partial)):
        if dst_op is None:
            continue
        split = src.mesh_dim_split(mesh_dim)
        if split is not None:
            raise RedistributeError(
                "placements",
                written,
                f"mesh dim {names[mesh_dim]!r} goes from Shard({split}) to Partial({dst_op}); a shard is "
                "not a partial value (torch refuses this move too)",
                f"redistribute mesh dim {names[mesh_dim]!r} to Replicate first, then to Partial",
            )
        if src_op is not None and src_op != dst_op:
            raise RedistributeError(
                "placements",
                written,
                f"mesh dim {names[mesh_dim]!r} goes from Partial({src_op}) to Partial({dst_op}); the values "
                "cannot be re-interpreted (torch refuses this move too)",
                f"redistribute mesh dim {names[mesh_dim]!r} to Replicate first, then to Partial({dst_op})",
            )


def reshard_to(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    if sharding.mesh.are_all_axes_explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _split_axes(phys: Physical) -> frozenset[int]:
    """The mesh dims that split some tensor dim."""
    return frozenset(a for axes in phys.layout.dim_axes for a in axes)


def _stack_names(src: Physical, axes: Sequence[int]) -> tuple[str, ...]:
    return tuple(src.mesh_names[a] for a in axes)


def strided_route(src: Layout, dst: Layout) -> tuple[tuple[StridedStep, ...], Layout, Layout, tuple[StridedStep, ...]]:
    """How a move touching strided dims (split factors from a view) goes: ``src`` ->
    ``first`` by the ``before`` steps, ``first`` -> ``last`` as any other move (their
    strided dims, if any, are the same on both), ``last`` -> ``dst`` by the ``after`` steps.
    See :func:`strided_route_tables`, which says how on the layouts' tables."""
    before, (first_axes, first_split), (last_axes, last_split), after = strided_route_tables(
        src.mesh.shape, (src.dim_axes, src.split_factors), (dst.dim_axes, dst.split_factors)
    )
    first = Layout(src.mesh, first_axes, src.partial, first_split)
    last = Layout(dst.mesh, last_axes, dst.partial, last_split)
    return before, first, last, after


Splits = tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]  # (dim_axes, split_factors)


def strided_route_tables(
    mesh_shape: tuple[int, ...], src: Splits, dst: Splits
) -> tuple[tuple[StridedStep, ...], Splits, Splits, tuple[StridedStep, ...]]:
    """:func:`strided_route` on ``(dim_axes, split_factors)`` tables (the planner's states).

    A strided dim ``d`` of ``src`` on mesh dim ``m`` that ``dst`` does not keep as it is:
    *unstride* (an all-to-all over ``m`` into the plain ``S(d)``) when ``m`` splits some
    dim in ``dst`` and the factor is a multiple of ``m``'s size (the all-to-all is then
    balanced); else an all-gather over ``m`` (a local reorder after it: the bytes of a
    plain all-gather). A strided dim of ``dst`` that ``first`` lacks: when ``m`` splits
    some dim in ``first`` (factor a multiple of the size), the plain ``S(d)`` on ``m`` and
    the inverse all-to-all; else from ``d`` unsplit over ``m``, a local slice of each
    rank's chunk of every group (free). The planner (:mod:`.inference.plan`) prices
    exactly these steps."""
    (src_axes, src_split), (dst_axes, dst_split) = src, dst
    before: list[StridedStep] = []
    axes, factors = list(src_axes), list(src_split)
    for d, f in enumerate(src_split):
        if f == 1 or (dst_split[d] == f and dst_axes[d] == src_axes[d]):
            continue
        (m,) = src_axes[d]
        factors[d] = 1
        if f % mesh_shape[m] == 0 and any(m in a for a in dst_axes):
            before.append((d, m, "all-to-all"))
        else:
            before.append((d, m, "all-gather"))
            axes[d] = ()
    first = (tuple(axes), tuple(factors))
    after: list[StridedStep] = []
    axes, factors = list(dst_axes), list(dst_split)
    for d, f in enumerate(dst_split):
        if f == 1 or (first[1][d] == f and first[0][d] == dst_axes[d]):
            continue
        (m,) = dst_axes[d]
        factors[d] = 1
        if f % mesh_shape[m] == 0 and any(m in a for a in first[0]):
            after.append((d, m, "all-to-all"))
        else:
            after.append((d, m, "local-slice"))
            axes[d] = ()
    return tuple(before), first, (tuple(axes), tuple(factors)), tuple(after)


def _strided_steps(x: jax.Array, phys: Physical, steps: Sequence[StridedStep], undo: bool) -> tuple[jax.Array, Physical]:
    """Run the ``before`` steps of :func:`strided_route` (``undo=False``: from strided
    dims) or the ``after`` steps (``undo=True``: into strided dims, ``phys`` is the target)
    on each rank's block in ``jax.shard_map``; returns the array and its representation."""
    layout = phys.layout
    dim_axes, factors = list(layout.dim_axes), list(layout.split_factors)
    for d, _, kind in steps:
        factors[d] = 1
        if kind != "all-to-all":
            dim_axes[d] = ()
    other = physical(Layout(layout.mesh, dim_axes, layout.partial, factors), phys.shape)
    src, dst = (other, phys) if undo else (phys, other)
    lead = len(phys.stacked_axes)
    names = phys.mesh_names

    def local(block: jax.Array) -> jax.Array:
        for d, m, kind in steps:
            axis, name, p = lead + d, names[m], phys.layout.mesh.shape[m]
            f = phys.layout.split_factors[d]
            shape = block.shape
            if kind == "all-to-all":
                # the dim viewed as (f, p * c): strided is its split on the second factor,
                # plain on the first (p divides f): one balanced all-to-all between them
                n = shape[axis]
                grid = block.reshape(shape[:axis] + (f, n // f) + shape[axis + 1:]) if not undo else (
                    block.reshape(shape[:axis] + (f // p, n * p // f) + shape[axis + 1:])
                )
                split, concat = (axis, axis + 1) if not undo else (axis + 1, axis)
                moved = jax.lax.all_to_all(grid, name, split, concat, tiled=True)
                block = moved.reshape(shape)
            elif not undo:  # all-gather, then the logical order (groups of p chunks)
                whole = jax.lax.all_gather(block, name, axis=axis, tiled=True)
                c = shape[axis] // f
                view = whole.reshape(shape[:axis] + (p, f, c) + shape[axis + 1:])
                block = jnp.swapaxes(view, axis, axis + 1).reshape(whole.shape)
            else:  # local slice of this rank's chunk of every group
                c = shape[axis] // (f * p)
                view = block.reshape(shape[:axis] + (f, p, c) + shape[axis + 1:])
                mine = jax.lax.dynamic_index_in_dim(view, jax.lax.axis_index(name), axis + 1, keepdims=False)
                block = mine.reshape(shape[:axis] + (f * c,) + shape[axis + 1:])
        return block

    mesh = phys.layout.mesh.to_jax()
    run = shard_map(local, mesh=mesh, in_specs=src.spec, out_specs=dst.spec, check_vma=False)
    return run(x), (dst if not undo else phys)


def convert(x: jax.Array, src: Physical, dst: Physical) -> jax.Array:
    """The physical array of ``dst`` holding the same logical tensor as ``x`` (of ``src``)."""
    if src.layout.is_strided or dst.layout.is_strided:
        before, first, last, after = strided_route(src.layout, dst.layout)
        if before or after:
            if before:
                x, src = _strided_steps(x, src, before, undo=False)
            mid = physical(last, dst.shape)
            x = convert(x, src, mid) if src != mid else x
            if after:
                x, _ = _strided_steps(x, dst, after, undo=True)
            return x
    layout, target = src.layout, dst.layout
    op = layout.partial_op
    repad = [d for d in range(len(src.shape)) if (
        src.layout.pieces(d) != target.pieces(d) or layout.split_factors[d] != target.split_factors[d]
    ) and not (src.is_prefix(d) and dst.is_prefix(d) and src.padded_shape[d] == dst.padded_shape[d])]
    # A partial whose reduce op changes (P(sum) -> P(avg) for a linear op's inputs) is new too:
    # the source's partial is reduced first, and nothing of it is kept.
    same_op = op == target.partial_op
    new_partial = tuple(a for a in target.partial_axes if layout.partial[a] != target.partial[a])

    # Step 1: reduce partial dims; keep those the target keeps where the representation allows.
    if src.unreduced_axes:
        kept = tuple(a for a in src.unreduced_axes if a in dst.unreduced_axes)
        if not new_partial and not repad and (not kept or _split_axes(src) == _split_axes(dst)):
            return reshard_to(x, dst.sharding)  # XLA reduces what goes, e.g. a reduce-scatter
        # Unreduced values cannot follow a dim to other mesh axes: JAX 0.10.2's reshard
        # routes them to the wrong devices, and there is no unreduced -> varying cast to
        # move them by hand. Reduce them all; step 3 splits them again. (Moves among the
        # same mesh axes, e.g. P,S(0) -> P,S(1), are right: checked for every pair of
        # layouts on 1-3-d meshes, 2-d and 3-d tensors.)
        kept_stack: tuple[int, ...] = ()
        x = reshard_to(x, src.reduced_sharding)
    elif src.stacked_axes:
        kept_stack = tuple(a for a in src.stacked_axes if a in dst.stacked_axes) if same_op else ()
        reduce_positions = tuple(i for i, a in enumerate(src.stacked_axes) if a not in kept_stack)
        if reduce_positions:
            x = REDUCERS[op](x, axis=reduce_positions)  # type: ignore[index]
    else:
        kept_stack = ()

    # Step 2: tensor dims to the target's splits (and padding), kept stack dims in front.
    lead = len(kept_stack)
    mesh = target.mesh.to_jax()
    sharding = NamedSharding(mesh, PartitionSpec(*_stack_names(src, kept_stack), *dst.dim_entries))
    if repad:
        body = lambda y: _repad(y, src, dst, repad, lead)  # noqa: E731
        x = jax.sharding.auto_axes(body, out_sharding=sharding)(x) if mesh.are_all_axes_explicit else (
            jax.lax.with_sharding_constraint(body(x), sharding)
        )
    else:
        x = reshard_to(x, sharding)

    # Step 3: new partial dims (and, for unreduced, all the target's partial dims).
    if dst.unreduced_axes:
        return _to_unreduced(x, dst)
    if dst.stacked_axes:
        return _to_stacked(x, dst, kept_stack)
    return x


def _repad(x: jax.Array, src: Physical, dst: Physical, dims: Sequence[int], lead: int) -> jax.Array:
    for d in dims:
        axis, size = lead + d, src.shape[d]
        if src.is_prefix(d):
            x = jax.lax.slice_in_dim(x, 0, size, axis=axis)
        else:
            x = jnp.take(x, src.positions(d), axis=axis)
        if dst.is_prefix(d):
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, dst.padded_shape[d] - size)
            x = jnp.pad(x, widths)
        else:
            shape = list(x.shape)
            shape[axis] = dst.padded_shape[d]
            index = (slice(None),) * axis + (dst.positions(d),)
            x = jnp.zeros(shape, x.dtype).at[index].set(x)
    return x


def _to_unreduced(x: jax.Array, dst: Physical) -> jax.Array:
    names = _stack_names(dst, dst.unreduced_axes)
    sizes = [dst.layout.mesh.shape[a] for a in dst.unreduced_axes]
    mesh = dst.layout.mesh.to_jax()
    if jnp.issubdtype(x.dtype, jnp.inexact):
        scale = jnp.full(sizes, 1 / math.prod(sizes), x.dtype)
    else:
        # Integers cannot be split as x / n: the rank at coordinate 0 of the new axes keeps
        # x and the others hold 0, so the sum stays exact.
        scale = jnp.zeros(sizes, x.dtype).at[(0,) * len(sizes)].set(1)
    scale = reshard_to(scale, NamedSharding(mesh, PartitionSpec(*names)))

    def local(block: jax.Array, factor: jax.Array) -> jax.Array:
        return jax.lax.pcast(block, names, to="varying") * factor.reshape(())

    return shard_map(
        local, mesh=mesh, in_specs=(PartitionSpec(*dst.dim_entries), PartitionSpec(*names)), out_specs=dst.spec
    )(x, scale)


def _to_stacked(x: jax.Array, dst: Physical, kept: tuple[int, ...]) -> jax.Array:
    new = tuple(a for a in dst.stacked_axes if a not in kept)
    if not new:
        return reshard_to(x, dst.sharding)
    count = int(np.prod([dst.layout.mesh.shape[a] for a in new]))
    if dst.layout.partial_op == "sum":
        if jnp.issubdtype(x.dtype, jnp.inexact):
            x = x / count
        else:
            x = _integer_stack(x, dst, kept)
            return reshard_to(x, dst.sharding)
    positions = tuple(i for i, a in enumerate(dst.stacked_axes) if a in new)
    x = jnp.expand_dims(x, positions)
    x = jnp.broadcast_to(x, dst.array_shape)
    return reshard_to(x, dst.sharding)


def _integer_stack(x: jax.Array, dst: Physical, kept: tuple[int, ...]) -> jax.Array:
    """Integer Partial(sum) stack: x at coordinate 0 of every new axis, zeros elsewhere."""
    positions = tuple(i for i, a in enumerate(dst.stacked_axes) if a not in kept)
    x = jnp.expand_dims(x, positions)
    pads = [(0, 0)] * x.ndim
    for i in positions:
        pads[i] = (0, dst.array_shape[i] - 1)
    return jnp.pad(x, pads)


@cached(maxsize=2048)
def program(src: Physical, dst: Physical) -> jax.stages.Wrapped:
    """The cached jitted program taking ``src``'s array to ``dst``'s array."""
    return jax.jit(lambda x: convert(x, src, dst), out_shardings=dst.sharding)


def redistribute_array(
    x: jax.Array, src_layout: Layout, dst_layout: Layout, shape: tuple[int, ...], *, operation: str | None = None
) -> jax.Array:
    """Run (or, under tracing, emit) the program from ``src_layout`` to ``dst_layout``;
    an eager run is announced to comm_debug as ``operation`` (when given)."""
    src, dst = physical(src_layout, shape), physical(dst_layout, shape)
    if src == dst:
        return x
    run = program(src, dst)
    if operation is not None:
        running(operation, run, (x,), src_layout.mesh)
    return run(x)
