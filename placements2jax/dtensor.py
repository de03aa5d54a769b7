"""DTensor: a logical tensor laid out on a DeviceMesh, carried by one ``jax.Array``.

A DTensor is its :class:`~placements2jax.layout.Layout`, its logical (global) shape and
one physical ``jax.Array`` (see :mod:`.physical` for how padding and partials are
stored). Everything that moves data is an XLA program (:mod:`.programs`); nothing passes
through the host. DTensor is a pytree whose only leaf is the array, so it goes through
``jax.jit``, ``jax.grad`` and ``jax.tree_util`` unchanged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.core import unsafe_am_i_under_a_jit  # JAX has no public test for 'tracing under jit'
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from . import chunking
from .caches import Memo, cached
from .errors import ArgumentTypeError, MeshError, PlacementError, ShapeError
from .foreign import check_placements_for_shape
from .hlo import Collective, compiled_collectives, running
from .layout import Layout, MeshPlacements, PlacementsLike, as_shape, resolve_layout
from .mesh import DeviceMesh, as_device_mesh
from .physical import Physical, physical
from .placements import Placement
from .programs import check_redistribute, program, redistribute_array
from .schedules import Policy, check_policy, default_policy, schedule_program

__all__ = ["DTensor", "distribute_tensor", "redistribute_collectives", "is_dtensor"]


@jax.tree_util.register_pytree_node_class
class DTensor:
    """A logical tensor of ``shape`` laid out on a mesh by ``layout``.

    Build one with :func:`distribute_tensor` (from the full tensor) or
    :meth:`DTensor.from_local` (from each rank's local shard). ``to_local(rank)`` gives
    exactly torch's local tensor of that rank; ``full_tensor()`` the logical tensor.
    """

    __slots__ = ("_array", "_layout", "_shape")

    def __init__(self, array: jax.Array, layout: Layout, shape: Sequence[int]) -> None:
        if not isinstance(array, jax.Array):
            raise ArgumentTypeError(
                "array", array, "expected the physical jax.Array", "build DTensors with distribute_tensor or DTensor.from_local"
            )
        if not isinstance(layout, (Layout, MeshPlacements)):
            raise ArgumentTypeError(
                "layout", layout, "expected a placements2jax.Layout", "pass resolve_layout(mesh, placements, ndim)"
            )
        shape = as_shape(shape, "shape")
        layout = layout.bind(len(shape))
        expected = physical(layout, shape).array_shape
        if tuple(array.shape) != expected:
            raise ShapeError(
                "array",
                array.shape,
                f"the physical array of shape {shape} under {layout} must have shape {expected}",
                "build DTensors with distribute_tensor or DTensor.from_local",
            )
        self._array, self._layout, self._shape = array, layout, shape

    # -- pytree ----------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple[jax.Array], tuple[Layout, tuple[int, ...]]]:
        return (self._array,), (self._layout, self._shape)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Layout, tuple[int, ...]], children: Sequence[Any]) -> DTensor:
        # No validation: transformations put placeholders (None, tangents, batched values) here.
        obj = object.__new__(cls)
        obj._array, (obj._layout, obj._shape) = children[0], aux
        return obj

    @classmethod
    def trusted(cls, array: jax.Array, layout: Layout, shape: tuple[int, ...]) -> DTensor:
        """A DTensor from a program's output, which is exactly ``layout``'s physical array
        for ``shape``: no re-validation (internal fast path of operators and moves)."""
        return cls.tree_unflatten((layout, shape), (array,))

    # -- reading ---------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._layout.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The torch form (see :attr:`Layout.placements`)."""
        return self._layout.placements

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (global) shape."""
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def physical(self) -> Physical:
        return physical(self._layout, self._shape)

    @property
    def array(self) -> jax.Array:
        """The physical array (padded and/or stacked when the layout needs it)."""
        return self._array

    def checked(self, argument: str) -> DTensor:
        """``self`` when its array has the shape its layout gives :attr:`shape`, else a
        :class:`ShapeError` naming ``argument``. A DTensor is a pytree whose leaf is its
        physical array, so a function mapped over DTensors that makes arrays of other
        shapes (a factored optimizer's state, ``optax.adafactor(...).init(params)``;
        ``jax.tree.map(jnp.sum, params)``) rebuilds DTensors whose layout does not describe
        their array. Not refused when rebuilt (JAX's transformations put placeholders
        there, and such trees are still flattened correctly), but wherever a DTensor's
        layout and shape are read as an input's (predict, check, apply); the fix names
        :func:`~placements2jax.init_optimizer_state`, which lays out such a state. A DTensor
        holding None (``eqx.partition``'s other half: JAX's pytrees give its array to the
        filter, not the DTensor) is an :class:`ArgumentTypeError` where it is an operand
        (predict, check and apply take it as None, as the half of a plain array is:
        :func:`.inference.frameworks.bind`)."""
        if self._array is None:
            raise ArgumentTypeError(
                argument, f"DTensor(None) laid out {self._layout}",
                "a DTensor holding no array: a filter mapped into the DTensor (eqx.partition(tree, filter_spec), "
                "jax.tree.map returning None) took its array and left its layout",
                "compute on the halves joined (eqx.combine), or split DTensors whole: "
                "eqx.partition(tree, filter_spec, is_leaf=lambda x: isinstance(x, DTensor))",
            )
        if not (isinstance(getattr(self._array, "shape", None), tuple) and hasattr(self._array, "dtype")):
            raise ArgumentTypeError(
                argument, f"DTensor({self._array!r}) laid out {self._layout}",
                f"a DTensor holding a {type(self._array).__name__} where its array goes: a function mapped over "
                "DTensors (jax.tree.map) returned it",
                "return arrays from the mapped function (e.g. jnp.full_like(x, 2.0)), or map over DTensors whole: "
                "jax.tree.map(f, tree, is_leaf=lambda x: isinstance(x, DTensor))",
            )
        expected = physical(self._layout, self._shape).array_shape
        if tuple(self._array.shape) != expected:
            raise ShapeError(
                argument,
                f"a DTensor of shape {self._shape} laid out {self._layout} holding an array of shape "
                f"{tuple(self._array.shape)}",
                f"its layout needs an array of shape {expected}: a function mapped over DTensors (jax.tree.map, "
                "an optimizer's init) made an array of another shape inside the DTensor",
                "build an optimizer's state with opt_state = init_optimizer_state(optimizer, params) (each leaf "
                "follows its parameter's layout), other such values under apply, which lays every new array out",
            )
        return self

    @property
    def sharding(self) -> jax.sharding.NamedSharding | None:
        """The ``NamedSharding`` of the logical tensor, when one exists: the layout is
        even and has no partial that JAX cannot express (else None)."""
        phys = self.physical
        if phys.is_padded or phys.stacked_axes:
            return None
        return phys.sharding

    def __repr__(self) -> str:
        """``DTensor([0., 1., 2., 3., 4., 5., ...], shape=(8, 4), dtype=float32,
        placements=S(0),R, mesh=...)``: the first values in row-major order (as JAX's and
        torch's reprs show values), then what the tensor is."""
        return (
            f"DTensor({self._preview()}, shape={self._shape}, dtype={self.dtype}, placements={self._layout}, "
            f"mesh={self.device_mesh!r})"
        )

    def _preview(self, count: int = 6) -> str:
        """The first ``count`` logical values, read only from the local shards that hold
        them (one small gather per device, never the whole array); partial values are
        reduced here over their partial group. ``traced`` under jit, ``PRNG keys`` for typed
        keys (``distribute_tensor`` of keys); stops before a value held only
        by another process's devices."""
        if isinstance(self._array, jax.core.Tracer):
            return "traced"
        if is_key_dtype(self.dtype):
            return "PRNG keys"
        if self._layout.is_strided:  # its shards are no blocks: read them from the plain split
            plain = Layout(self.device_mesh, self._layout.dim_axes, self._layout.partial)
            return self.redistribute(placements=plain)._preview(count)
        layout, mesh, shape = self._layout, self.device_mesh, self._shape
        shards = {s.device: s.data for s in self._array.addressable_shards}
        blocks = {r: layout.local_slices(shape, r) for r in mesh.rank_list if mesh.device(r) in shards}
        wanted: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # rank -> (value position, local index)
        shown = 0
        for index in itertools.islice(np.ndindex(shape), count):
            holder = next((r for r, b in blocks.items() if all(s.start <= i < s.stop for s, i in zip(b, index))), None)
            if holder is None:
                break
            group = mesh.get_group(layout.partial_axes, holder).ranks if layout.has_partial else (holder,)
            if any(r not in blocks for r in group):
                break
            for r in group:
                wanted.setdefault(r, []).append((shown, tuple(i - s.start for i, s in zip(index, blocks[r]))))
            shown += 1
        parts: list[list[Any]] = [[] for _ in range(shown)]
        stacked = (0,) * len(self.physical.stacked_axes)
        for r, items in wanted.items():
            local = tuple(np.array([i[d] for _, i in items], dtype=np.int64) for d in range(len(shape)))
            values = np.asarray(shards[mesh.device(r)][stacked + local]).reshape(-1)
            for (position, _), value in zip(items, values):
                parts[position].append(value)
        reduce = {None: lambda v: v[0], "sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[layout.partial_op]
        values = np.array([reduce(np.array(v)) for v in parts], dtype=self.dtype)
        if not shape and shown:
            return np.array2string(values.reshape(()))
        text = np.array2string(values, separator=", ", threshold=count + 1)
        return text if shown == math.prod(shape) else text[:-1] + (", ...]" if shown else "...]")

    # -- local data --------------------------------------------------------------------
    def _require_concrete(self, what: str) -> None:
        if isinstance(self._array, jax.core.Tracer):
            raise ArgumentTypeError(
                "self",
                self,
                f"{what} needs concrete per-device data, but this DTensor is being traced (inside jax.jit)",
                "call it outside jit, or use jax.shard_map for per-rank code",
            )

    def to_local(self, rank: int | None = None) -> jax.Array:
        """torch's local tensor of ``rank`` (default: the calling rank), on its device:
        exact shape (empty shards included) and values (partial values unreduced).

        A block without padding is the device's buffer itself, as torch's ``to_local``
        returns the local tensor without a copy (JAX's indexing by whole slices returns
        the array; donating the DTensor's array deletes it too); a padded or stacked
        block is a copy of its rows."""
        self._require_concrete("to_local")
        mesh = self.device_mesh
        rank = mesh.resolve_rank(rank)
        device = mesh.device(rank)
        shard = next((s for s in self._array.addressable_shards if s.device == device), None)
        if shard is None:
            raise MeshError(
                "rank",
                rank,
                f"its device is on process {device.process_index}, not this one ({jax.process_index()})",
                "call to_local for ranks of this process (DeviceMesh.calling_rank())",
            )
        local_shape = self._layout.local_shape(self._shape, rank)
        index = (0,) * len(self.physical.stacked_axes) + tuple(slice(0, n) for n in local_shape)
        return shard.data[index]

    def local_shards(self) -> dict[int, jax.Array]:
        """``to_local`` of every rank whose device belongs to this process."""
        self._require_concrete("local_shards")
        process = jax.process_index()
        return {
            r: self.to_local(r) for r in self.device_mesh.rank_list if self.device_mesh.device(r).process_index == process
        }

    # -- whole-tensor views ------------------------------------------------------------
    def full_tensor(self) -> jax.Array:
        """The logical tensor (partials reduced, padding removed), replicated on the mesh."""
        return redistribute_array(
            self._array, self._layout, self._layout.replicated(), self._shape, operation="full_tensor"
        )

    def to_jax(self) -> jax.Array:
        """The logical tensor as a ``jax.Array`` of the logical shape.

        Even layouts without Partial: the physical array itself (no copy). Even layouts
        with Partial: the reduced value, sharded like the tensor dims. Uneven layouts:
        JAX cannot shard them, so the result is replicated (same as :meth:`full_tensor`).
        """
        phys = self.physical
        if phys.is_padded:
            return self.full_tensor()
        if self._layout.has_partial:
            reduced = redistribute_array(
                self._array, self._layout, self._layout.without_partial(), self._shape, operation="to_jax"
            )
            return _eager_grad_safe(reduced, self.device_mesh)
        return _eager_grad_safe(self._array, self.device_mesh)

    def __jax_array__(self) -> jax.Array:
        return self.to_jax()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.full_tensor(), dtype=dtype)

    # -- redistribute -----------------------------------------------------------------
    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: PlacementsLike | None = None,
        *,
        policy: Policy | None = None,
    ) -> DTensor:
        """This tensor under other placements (torch or alias form), possibly on another
        mesh. ``policy`` picks the collective schedule within one mesh (``"cost"``, the
        default: least predicted time under the calibrated cost model; ``"min_bytes"``;
        ``"xla"``: XLA's single reshard; or a CostModel); see docs/redistribute.md."""
        policy = default_policy() if policy is None else check_policy(policy)
        key = (self._layout, device_mesh, _frozen(placements), self._shape, self.dtype, policy)
        move = _moves.recall(key)
        if move is not None:
            target, run = move
            return DTensor.trusted(self._run("redistribute", run), target, self._shape)
        mesh = self.device_mesh if device_mesh is None else as_device_mesh(device_mesh)
        if placements is None and mesh is self.device_mesh:
            target = self._layout
        else:
            target = placements_layout(mesh, placements, self._shape)
            check_partial_dtype(target, self.dtype)
        if mesh is not self.device_mesh:
            return self._to_other_mesh(target)
        check_redistribute(self._layout, target, placements)
        src, dst = physical(self._layout, self._shape), physical(target, self._shape)
        run = None if src == dst else schedule_program(src, dst, self.dtype, policy)
        _moves.remember(key, (target, run))
        return DTensor.trusted(self._run("redistribute", run), target, self._shape)

    def _run(self, operation: str, run: Any) -> jax.Array:
        """``run(self._array)`` (announced to comm_debug), or the array itself when there is
        nothing to run."""
        if run is None:
            return self._array
        running(operation, run, (self._array,), self.device_mesh)
        return run(self._array)

    def _to_other_mesh(self, target: Layout) -> DTensor:
        """Reduce on this mesh, transfer with JAX's device_put, re-partial on the target."""
        shape = self._shape
        source_plain, target_plain = self._layout.without_partial(), target.without_partial()
        if math.prod(shape) == 0:
            # Nothing to move (and JAX's copy between device sets fails on empty arrays).
            plain = physical(target_plain, shape)
            array = jax.device_put(np.zeros(plain.array_shape, self.dtype), plain.sharding)
        elif not physical(self._layout, shape).is_padded and not physical(target, shape).is_padded:
            array = redistribute_array(self._array, self._layout, source_plain, shape, operation="redistribute")
            array = jax.device_put(array, physical(target_plain, shape).sharding)
        else:
            replicated = target.replicated()
            array = jax.device_put(self.full_tensor(), physical(replicated, shape).sharding)
            array = redistribute_array(array, replicated, target_plain, shape)
        return DTensor(redistribute_array(array, target_plain, target, shape), target, shape)

    # -- operators: +, -, *, /, @, unary -, sum, mean, max, min, transpose, T and reshape are
    # installed by placements2jax.operators (which comes after DTensor in the data flow).
    __array_ufunc__ = None  # NumPy defers `ndarray <op> DTensor` to the reflected methods

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_local(
        cls,
        local_tensor: Any,
        device_mesh: DeviceMesh,
        placements: PlacementsLike | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        """A DTensor from each rank's local tensor (torch's signature).

        ``local_tensor`` is one array (the same on every rank: SPMD), a sequence of arrays
        in ``device_mesh.rank_list`` order, or a mapping rank -> array (in a multi-process
        run, each process passes its own ranks). Partial placements: the global value is
        the reduction of the local values. The global shape is inferred when the local
        shapes determine it, else pass ``shape=``; local shapes that torch.chunk would
        not give for that shape are an error. Every rank's dtype, rank and shape are always
        checked (torch checks them only with ``run_check``); ``run_check=True`` also does
        what torch's does to the data: on every Replicate mesh dim, the block of the first
        rank along it is used by all ranks (torch broadcasts it), so replicas agree. JAX
        arrays have no strides: ``stride=`` must be the contiguous (row-major) strides of
        the global shape, anything else is refused.
        """
        mesh = as_device_mesh(device_mesh)
        if not isinstance(run_check, (bool, np.bool_)):
            raise ArgumentTypeError("run_check", run_check, "expected a bool", "pass run_check=True or False")
        locals_by_rank = _locals_by_rank(local_tensor, mesh)
        signature = tuple((r, a.shape, a.dtype) for r, a in locals_by_rank.items())
        key = (device_mesh, _frozen(placements), signature)
        # else: validate shape=, exchange shapes, broadcast replicas
        remembered = shape is None and not run_check and jax.process_count() == 1
        entry = _assemblies.recall(key) if remembered else None
        if entry is not None:  # the same mesh, placements and local shapes as before
            layout, global_shape, phys, block, lead = entry
            _check_stride(stride, global_shape)
            return DTensor.trusted(_assemble(locals_by_rank, phys, block, lead), layout, global_shape)
        first = next(iter(locals_by_rank.values()))
        for rank, array in locals_by_rank.items():
            if array.dtype != first.dtype:
                raise ShapeError(
                    "local_tensor",
                    {r: str(a.dtype) for r, a in locals_by_rank.items()},
                    f"rank {rank} has dtype {array.dtype}, another rank {first.dtype}",
                    "give every rank's local tensor the same dtype",
                )
            if array.ndim != first.ndim:
                raise ShapeError(
                    "local_tensor",
                    {r: a.shape for r, a in locals_by_rank.items()},
                    f"rank {rank} has {array.ndim} dims, another rank {first.ndim}",
                    "give every rank's local tensor the same number of dims",
                )
        layout = placements_layout(mesh, placements, first.ndim)
        check_partial_dtype(layout, first.dtype)
        if run_check:
            locals_by_rank = _first_replicas(locals_by_rank, layout)
        local_shapes = _every_rank_shape(mesh, locals_by_rank)
        if shape is None:
            global_shape = _global_shape(layout, local_shapes)
            check_placements_for_shape(placements, layout, global_shape)  # torch's placements mean this shape
        else:
            global_shape = layout.check_shape(shape, "shape")
            check_placements_for_shape(placements, layout, global_shape)
            for rank, got in local_shapes.items():
                want = layout.local_shape(global_shape, rank)
                if got != want:
                    raise ShapeError(
                        "local_tensor",
                        local_shapes,
                        f"rank {rank} holds shape {got}, but torch.chunk gives it {want} of the global "
                        f"shape {global_shape} under {layout}",
                        "pass each rank's torch.chunk block, or the right shape=",
                    )
        _check_stride(stride, global_shape)
        phys = physical(layout, global_shape)
        block = tuple(p // math.prod(layout.pieces(d)) for d, p in enumerate(phys.padded_shape))
        lead = (1,) * len(phys.stacked_axes)
        if remembered:
            _assemblies.remember(key, (layout, global_shape, phys, block, lead))
        return cls(_assemble(locals_by_rank, phys, block, lead), layout, global_shape)


def _first_replicas(locals_by_rank: dict[int, Any], layout: Layout) -> dict[int, Any]:
    """torch's ``run_check`` broadcast: on every Replicate mesh dim, each rank takes the
    block of the rank at coordinate 0 along it (the rank with the same other coordinates)."""
    mesh = layout.mesh
    split = {m for axes in layout.dim_axes for m in axes}
    replicate = [m for m in range(mesh.ndim) if m not in split and layout.partial[m] is None]
    by_coordinate = {mesh.get_coordinate(r): r for r in mesh.rank_list}
    result = {}
    for rank in locals_by_rank:
        source = list(mesh.get_coordinate(rank))
        for m in replicate:
            source[m] = 0
        first = by_coordinate[tuple(source)]
        if first not in locals_by_rank:
            raise MeshError(
                "run_check", True, f"rank {rank}'s replica source, rank {first}, is on another process",
                "make every process pass the same replicas and use run_check=False",
            )
        result[rank] = locals_by_rank[first]
    return result


def _check_stride(stride: Any, shape: tuple[int, ...]) -> None:
    """``stride=`` must be the contiguous strides of ``shape`` (JAX arrays have no others)."""
    if stride is None:
        return
    contiguous = tuple(int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape)))
    if not isinstance(stride, (tuple, list)) or not all(isinstance(n, (int, np.integer)) for n in stride):
        raise ArgumentTypeError("stride", stride, "expected a tuple of ints", f"pass stride={contiguous} or omit it")
    if tuple(int(n) for n in stride) != contiguous:
        raise ShapeError(
            "stride", stride, f"is not the contiguous stride {contiguous} of the global shape {shape}; JAX arrays "
            "have no strides (a transposed or strided view has no JAX counterpart)",
            f"pass stride={contiguous} or omit it; for a transposed tensor pass the transpose's own data and shape",
        )


def _assemble(
    locals_by_rank: Mapping[int, Any], phys: Physical, block: tuple[int, ...], lead: tuple[int, ...]
) -> jax.Array:
    """The physical array from each rank's local tensor: padded to its block, put on its device."""
    devices = jax.devices()  # rank r is device r (mesh.device(r) re-validates r on every call)
    arrays = []
    for rank, local in locals_by_rank.items():
        if local.shape != block:
            widths = [(0, b - n) for b, n in zip(block, local.shape)]
            local = np.pad(local, widths) if isinstance(local, np.ndarray) else jnp.pad(local, widths)
        arrays.append(jax.device_put(local.reshape(lead + block) if lead else local, devices[rank]))
    return jax.make_array_from_single_device_arrays(phys.array_shape, phys.sharding, arrays)


def _global_shape(layout: Layout, local_shapes: Mapping[int, tuple[int, ...]]) -> tuple[int, ...]:
    """The global shape from every rank's local shape, in closed form: torch.chunk's
    nested blocks partition each dim, so its extent is the sum of the extents of the
    ranks whose coordinates differ only on the mesh axes splitting it; then every rank's
    extent is checked against torch.chunk of that total. O(mesh size) per dim, whatever
    the extents (trying candidate lengths would be O(extent))."""
    mesh = layout.mesh
    positions = mesh.rank_positions
    coordinates = {r: positions[r] for r in local_shapes}
    first = next(iter(local_shapes))
    result = []
    for dim, axes in enumerate(layout.dim_axes):
        base = coordinates[first]
        group = [r for r, c in coordinates.items() if all(c[a] == base[a] for a in range(mesh.ndim) if a not in axes)]
        extent = sum(local_shapes[r][dim] for r in group)
        pieces = layout.pieces(dim)
        for rank, shape in local_shapes.items():
            want = chunking.nested_chunk(extent, tuple(zip(pieces, (coordinates[rank][a] for a in axes))))[1]
            if shape[dim] != want:
                extents = {r: s[dim] for r, s in local_shapes.items()}
                raise ShapeError(
                    "local_tensor",
                    local_shapes,
                    f"no global extent of dim {dim} gives local extents {extents} under torch.chunk (the blocks "
                    f"of ranks {group} sum to {extent}, which gives rank {rank} {want}, not {shape[dim]})",
                    "pass each rank's torch.chunk block of the global tensor, or the global shape (shape=...)",
                )
        result.append(extent)
    return tuple(result)


def _every_rank_shape(mesh: DeviceMesh, locals_by_rank: Mapping[int, Any]) -> dict[int, tuple[int, ...]]:
    """The local shape of every rank of ``mesh``. In a multi-process run each process
    knows only its own ranks' tensors, so the processes exchange their shapes (and check
    that dtype and ndim agree, like torch's ``from_local(run_check=True)``): every
    process then infers the same global shape. A collective over the mesh's processes."""
    own = {r: tuple(a.shape) for r, a in locals_by_rank.items()}
    if len({mesh.device(r).process_index for r in mesh.rank_list}) == 1:
        return own
    first = next(iter(locals_by_rank.values()))
    header = _exchange(mesh, {r: np.array([first.ndim, np.dtype(first.dtype).num]) for r in own})
    if len({tuple(row) for row in header.values()}) != 1:
        raise ShapeError(
            "local_tensor",
            {r: tuple(int(v) for v in row) for r, row in header.items()},
            f"the processes' local tensors differ in (ndim, numpy dtype number); this process has "
            f"({first.ndim}, {np.dtype(first.dtype).num}: {first.dtype})",
            "give every rank's local tensor the same dtype and number of dims",
        )
    if first.ndim == 0:
        return {r: () for r in mesh.rank_list}
    return {r: tuple(int(n) for n in row) for r, row in _exchange(mesh, {r: np.array(s) for r, s in own.items()}).items()}


def _exchange(mesh: DeviceMesh, rows: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Each process's rows (one int vector per own rank, all of one length) -> every
    rank's row, by an all-gather over the mesh's devices."""
    flat = _flat_mesh(mesh)
    width = len(next(iter(rows.values())))
    pieces = [jax.device_put(rows[r].astype(np.int32).reshape(1, width), mesh.device(r)) for r in rows]
    sharded = jax.make_array_from_single_device_arrays(
        (mesh.size(), width), NamedSharding(flat, PartitionSpec("ranks")), pieces
    )
    table = np.asarray(_all_gather(flat)(sharded).addressable_data(0))
    return {r: table[i] for i, r in enumerate(mesh.rank_list)}


def _eager_grad_safe(array: jax.Array, mesh: DeviceMesh) -> jax.Array:
    """A scalar traced by an *eager* ``jax.grad`` (a JVP trace outside jit), moved to the
    Auto twin of its mesh (same devices: a relabel of one element).

    JAX 0.10.2 seeds the cotangent of a scalar output with ``full_like``, which reshards
    the 1 to the output's sharding; for an Explicit-mesh sharding that eager reshard needs
    a ``jax.set_mesh`` context ("Length of device assignment 1 is not equal to the size
    of the mesh"). An Auto-mesh scalar has no sharding in its type, so the seed is plain.
    Under jit (and for concrete values) nothing changes: the jaxpr keeps no extra op."""
    if array.ndim or not mesh.is_explicit or mesh.size() == 1:
        return array
    if not isinstance(array, jax.core.Tracer) or unsafe_am_i_under_a_jit():
        return array
    return jax.device_put(array, NamedSharding(auto_twin_of(mesh.to_jax()), PartitionSpec()))


@cached(maxsize=64)
def auto_twin_of(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The mesh's devices and axis names with Auto axes."""
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@cached(maxsize=64)
def _flat_mesh(mesh: DeviceMesh) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(mesh.devices.reshape(-1), ("ranks",), axis_types=(AxisType.Auto,))


@cached(maxsize=64)
def _all_gather(flat: jax.sharding.Mesh) -> Any:
    return jax.jit(lambda x: x, out_shardings=NamedSharding(flat, PartitionSpec()))


def is_dtensor(value: Any) -> bool:
    """``isinstance(value, DTensor)``: the ``is_leaf=`` of tree functions that stop at DTensors."""
    return isinstance(value, DTensor)


def distribute_tensor(
    tensor: Any, device_mesh: DeviceMesh, placements: PlacementsLike | None = None
) -> DTensor:
    """Lay a full (logical) tensor out on ``device_mesh``: NumPy or JAX array in, DTensor
    out. Partial targets follow torch: sum -> each rank holds x / n; avg, max, min -> x.
    ``placements=None`` replicates."""
    array = _as_array(tensor, "tensor")
    shape = tuple(array.shape)
    key = (device_mesh, _frozen(placements), shape, array.dtype)
    placing = _placings.recall(key)
    if placing is not None:  # an even layout seen before: place, and split partials
        layout, sharding, split = placing
        placed = jax.device_put(array, sharding)
        return DTensor.trusted(split(placed) if split else placed, layout, shape)
    layout = placements_layout(device_mesh, placements, shape)
    check_partial_dtype(layout, array.dtype)
    target = physical(layout, shape)
    plain = layout.without_partial()
    if not target.is_padded:  # place, and (for partials) split by a cached program
        source = physical(plain, shape)
        split = None if source == target else program(source, target)
        _placings.remember(key, (layout, source.sharding, split))
        placed = jax.device_put(array, source.sharding)
        return DTensor.trusted(split(placed) if split else placed, layout, shape)
    elif isinstance(array, np.ndarray):
        padded = np.zeros(target.padded_shape, array.dtype)
        if all(target.is_prefix(d) for d in range(array.ndim)):  # pads only at the ends: a copy
            padded[tuple(slice(0, n) for n in shape)] = array
        else:
            padded[np.ix_(*(target.positions(d) for d in range(array.ndim)))] = array
        placed = jax.device_put(padded, physical(plain, shape).sharding)
    else:
        replicated = layout.replicated()
        placed = jax.device_put(array, physical(replicated, shape).sharding)
        placed = redistribute_array(placed, replicated, plain, shape)
    return DTensor(redistribute_array(placed, plain, layout, shape), layout, shape)


# Eager entry points remember what they decided for the arguments as given (hashable ones):
# (source layout, mesh argument, placements, shape, dtype) -> (target layout, program or
# None) for redistribute, (mesh argument, placements, shape, dtype) -> (layout, sharding,
# partial-splitting program or None) for distribute_tensor of even layouts, (mesh argument,
# placements, every rank's local shape and dtype) -> (layout, global shape, physical form,
# block, leading stacked dims) for from_local without shape=. Layouts are
# interned, so these keys hash and compare cheaply; a repeated call skips resolving and
# checking (a few µs of Python between two XLA programs matter on a small host).
_moves = Memo(4096)
_placings = Memo(4096)
_assemblies = Memo(4096)


def _frozen(placements: Any) -> Any:
    return tuple(placements) if isinstance(placements, list) else placements




def placements_layout(device_mesh: Any, placements: PlacementsLike | None, shape: int | tuple[int, ...]) -> Layout:
    """The layout of ``placements`` (None: replicated) for a tensor of ``shape`` (or of
    that many dims): :func:`resolve_layout`, on a mesh whose axes are of one kind."""
    if placements is None:
        mesh = as_device_mesh(device_mesh)
        layout = Layout(mesh, ((),) * (shape if isinstance(shape, int) else len(shape)))
    else:
        layout = resolve_layout(device_mesh, placements, shape)
        mesh = layout.mesh
    if len(set(mesh.axis_types)) > 1:
        # The programs move data with reshard (Explicit axes) or sharding constraints (Auto
        # axes); JAX 0.10.2 has no single call for a mesh mixing both.
        raise MeshError(
            "device_mesh",
            mesh,
            "mixes Explicit and Auto axes; DTensor programs need one kind of axis",
            "build the mesh with axis_types='explicit' (default) or 'auto' for every axis",
        )
    return layout


def _as_array(value: Any, argument: str) -> np.ndarray | jax.Array:
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, DTensor):
        raise ArgumentTypeError(argument, value, "is already a DTensor", "use dtensor.redistribute(...)")
    try:
        array = np.asarray(value)
    except Exception:
        array = np.asarray(None, dtype=object)
    # ml_dtypes' bfloat16 / float8 are NumPy kind "V": numeric all the same.
    if array.dtype == object or (array.dtype.kind not in "biufc" and not jnp.issubdtype(array.dtype, jnp.floating)):
        raise ArgumentTypeError(
            argument, value, "is not a numeric array", "pass a NumPy array, a jax.Array or nested lists of numbers"
        )
    return _canonical(array, argument)


def _canonical(array: np.ndarray, argument: str) -> np.ndarray:
    """``array`` in the dtype JAX holds it in (64-bit types are 32-bit unless
    ``jax_enable_x64``); values that cast would change (integers out of range, finite
    floats becoming inf) are an error instead of silently wrong data."""
    dtype = jax.dtypes.canonicalize_dtype(array.dtype)
    if dtype == array.dtype:
        return array
    with np.errstate(over="ignore"):
        converted = array.astype(dtype)
    if array.dtype.kind in "iu":
        lost = not np.array_equal(converted, array)
    else:
        lost = bool(np.any(np.isfinite(array) & ~np.isfinite(converted)))
    if lost:
        raise ArgumentTypeError(
            argument,
            f"<{array.dtype} array of shape {array.shape}>",
            f"holds values that {dtype} cannot represent, and JAX runs with 32-bit types (jax_enable_x64 is off)",
            "enable 64-bit types (jax.config.update('jax_enable_x64', True) at startup) or scale/cast the values yourself",
        )
    return converted


def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``key<fry>``: an extended dtype, with no
    NumPy form; ``jax.random.key_data`` has one)."""
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def check_partial_dtype(layout: Layout, dtype: Any) -> None:
    """Partial values must be reducible with their op: bools have no sum or average,
    complex numbers no max or min. PRNG keys are Replicate only, as inference takes them
    (:attr:`.inference.signature.Aval.is_key`)."""
    op = layout.partial_op
    if is_key_dtype(dtype):  # np.dtype cannot read it
        if layout != layout.replicated():
            raise PlacementError(
                "placements", str(layout), f"a DTensor of PRNG keys ({dtype}) is Replicate only",
                "replicate the keys (placements=None), or lay out jax.random.key_data(keys) and wrap each rank's "
                "part with jax.random.wrap_key_data",
            )
        return
    kind = np.dtype(dtype).kind
    if (op in ("sum", "avg") and kind == "b") or (op in ("max", "min") and kind == "c"):
        raise PlacementError(
            "placements",
            str(layout),
            f"Partial({op}) of {np.dtype(dtype)} values is not defined",
            "use Partial('max') / Partial('min') for bools (logical or / and), Partial('sum') for complex, "
            "or cast the tensor first",
        )


def _locals_by_rank(local_tensor: Any, mesh: DeviceMesh) -> dict[int, np.ndarray | jax.Array]:
    process = jax.process_index()
    own = [r for r in mesh.rank_list if mesh.device(r).process_index == process]
    if isinstance(local_tensor, Mapping):
        given = {_own_rank(mesh, r, local_tensor): _as_array(a, f"local_tensor[{r}]") for r, a in local_tensor.items()}
        missing = [r for r in own if r not in given]
        foreign = [r for r in given if r not in own]
        if missing or foreign:
            raise MeshError(
                "local_tensor",
                sorted(given),
                f"ranks {missing} of this process are missing" if missing else f"ranks {foreign} are not on this process",
                f"pass exactly this process's ranks {own}",
            )
        return {r: given[r] for r in own}
    if isinstance(local_tensor, (list, tuple)) and local_tensor and all(
        isinstance(a, (np.ndarray, jax.Array)) for a in local_tensor
    ):
        if len(local_tensor) != mesh.size():
            raise ShapeError(
                "local_tensor",
                f"<{len(local_tensor)} arrays>",
                f"a sequence needs one array per rank of the mesh ({mesh.size()}, rank_list order)",
                "pass one array per rank, a mapping rank -> array, or one array for all ranks",
            )
        by_rank = dict(zip(mesh.rank_list, local_tensor))
        return {r: _as_array(by_rank[r], f"local_tensor[{r}]") for r in own}
    array = _as_array(local_tensor, "local_tensor")
    return {r: array for r in own}


def _own_rank(mesh: DeviceMesh, rank: Any, local_tensor: Mapping[Any, Any]) -> int:
    """A key of the ``local_tensor`` mapping as a rank of ``mesh``."""
    try:
        return mesh.check_rank(rank)
    except (ArgumentTypeError, MeshError) as err:
        raise err.for_argument("local_tensor", sorted(map(repr, local_tensor)), problem_prefix=f"key {rank!r}: ") from None


def redistribute_collectives(
    dtensor: DTensor,
    placements: PlacementsLike,
    device_mesh: DeviceMesh | None = None,
    *,
    policy: Policy | None = None,
) -> list[Collective]:
    """The collectives XLA compiles for ``dtensor.redistribute(device_mesh, placements,
    policy=policy)`` on the same mesh (the chosen schedule's), with device groups given as
    ranks."""
    policy = default_policy() if policy is None else check_policy(policy)
    if not isinstance(dtensor, DTensor):
        raise ArgumentTypeError("dtensor", dtensor, "expected a DTensor", "build one with distribute_tensor(...)")
    mesh = dtensor.device_mesh
    if device_mesh is not None and device_mesh != mesh:
        raise MeshError(
            "device_mesh", device_mesh, "collectives are reported for moves within one mesh", "pass None or dtensor.device_mesh"
        )
    target = placements_layout(mesh, placements, dtensor.shape)
    check_partial_dtype(target, dtensor.dtype)
    check_redistribute(dtensor.layout, target, placements)
    src, dst = physical(dtensor.layout, dtensor.shape), physical(target, dtensor.shape)
    if src == dst:
        return []
    ranks = mesh.rank_list  # XLA numbers devices by their position in the mesh
    return [
        Collective(c.op, c.result_shapes, c.dtype, tuple(tuple(ranks[i] for i in g) for g in c.groups))
        for c in compiled_collectives(schedule_program(src, dst, dtensor.dtype, policy), dtensor.array)
    ]
