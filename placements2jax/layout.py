"""Layout: the tensor_map model of how a tensor lies on a DeviceMesh.

This is MindSpore hyper-parallel's internal "JAX-style" layout. A bound layout records,
for each tensor dimension, the mesh axes that split it (major to minor), and for each
mesh dimension whether it holds partial values and with which reduce op.

Three views of the same layout:

* torch form: one placement per mesh dim, e.g. ``(Shard(0), Replicate())``;
* tensor_map: one entry per tensor dim, ``-1`` (not split), an int counting mesh axes
  from the right, or a tuple of such ints; plus the partial side table per mesh dim;
* alias form: one entry per tensor dim, an axis name, a tuple of names, or ``"None"``.

Building a Layout (docs/architecture.md, "Building a Layout"):

* :func:`resolve_layout` ``(mesh, placements, shape_or_ndim)`` -- the one resolver from
  placements as a user gives them (torch or alias form, values or text, another
  library's objects, a Layout);
* ``Layout.from_device_mesh(mesh)(placements)`` -- the RFC's form of the same: calling
  the empty record with placements records them. Torch-form placements do not say how
  many dims the tensor has, so they give a :class:`MeshPlacements`, bound by
  ``.bind(ndim)`` / ``.placement_to_tensor_map(ndim)``; the alias form gives a Layout;
* :meth:`Layout.from_tensor_map` and :meth:`Layout.from_partition_spec` -- MindSpore's
  and JAX's tables, the inverses of the :attr:`~Layout.tensor_map` and
  :attr:`~Layout.partition_spec` views;
* ``Layout(mesh, dim_axes, partial)`` -- the validated, interned constructor every route
  above ends in (for code that computes layouts; ``Layout(mesh, ((),) * ndim)`` is the
  replicated one).

``Layout.from_placements``, ``Layout.from_shard_order`` and ``Layout.replicated_on`` are
deprecated spellings of these.

Local shapes and offsets follow torch's ``_compute_local_shape_and_global_offset``
(torch.chunk, nested over mesh axes), computed by pure functions in :mod:`.chunking`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
import weakref
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, TypeAlias

from jax.sharding import NamedSharding, PartitionSpec

from . import chunking
from .caches import Memo
from .errors import ArgumentTypeError, LayoutError, MeshError, PlacementError, ShapeError
from .foreign import check_placements_for_shape, convert_placements
from .mesh import DeviceMesh, as_device_mesh
from .placements import (
    REDUCE_OPS,
    Partial,
    Placement,
    ReduceOp,
    Replicate,
    Shard,
    StridedShard,
    format_alias,
    format_partial,
    parse_layout_text,
)

__all__ = ["Layout", "MeshPlacements", "resolve_layout", "as_shape", "PlacementsLike", "TensorMap", "AliasEntry", "ShardOrder"]

AliasEntry: TypeAlias = str | None | tuple[str, ...]
PlacementsLike: TypeAlias = "Sequence[Placement] | Sequence[AliasEntry] | str"
TensorMap: TypeAlias = tuple[int | tuple[int, ...], ...]
PartialLike: TypeAlias = "Mapping[str | int, str] | Sequence[str | None] | None"

ShardOrder: TypeAlias = tuple[tuple[int, tuple[int, ...]], ...]


class _OnMesh:
    """What :class:`MeshPlacements` and :class:`Layout` share: their mesh, by both names."""

    __slots__ = ("_mesh",)

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """torch's name for :attr:`mesh` (the one alias spelling a layout keeps)."""
        return self._mesh

    def __call__(
        self,
        placements: PlacementsLike,
        *,
        partial: PartialLike = None,
        shard_order: Mapping[int, Sequence[int]] | None = None,
    ) -> Layout | MeshPlacements:
        """Record placements (the RFC's call), in torch form (one per mesh dim) or alias
        form (one per tensor dim; ``partial=`` then names the partial mesh axes and their
        reduce ops); text in either form is parsed, another library's placement objects
        (torch's ``Shard``, ``_StridedShard`` ...) are converted by their bridge. Returns a
        :class:`Layout` for the alias form, a :class:`MeshPlacements` (unbound until the
        tensor rank is known) for the torch form.

        A repeated ``Shard(d)`` (values or text, ``"S(0),S(0)"``) means what torch's does:
        dim ``d`` split by those mesh dims in mesh order, each mesh dim splitting the
        previous one's ``torch.chunk`` pieces (the alias form ``(("dp", "tp"), None)``).
        ``shard_order`` is torch's ``DTensorSpec.shard_order``: the mesh dims of a
        repeated ``Shard(d)`` split in the order ``shard_order[d]`` lists them (major to
        minor; mesh order for dims it omits)."""
        return _from_placements(self._mesh, placements, partial, shard_order)

    def bind(self, ndim: int) -> Layout:
        """The Layout for a tensor of ``ndim`` dims (each subclass says how)."""
        raise NotImplementedError

    def placement_to_tensor_map(self, ndim: int) -> TensorMap:
        """The tensor_map for a tensor of ``ndim`` dims (MindSpore's convention)."""
        return self.bind(ndim).tensor_map


class MeshPlacements(_OnMesh):
    """Torch-form placements recorded on a mesh, not yet bound to a tensor rank.

    The RFC's ``Layout.from_device_mesh(mesh)`` is an empty one; calling it with
    placements records them. Torch-form placements do not say how many dims the tensor
    has, so this value answers what needs no rank (:attr:`placements`, :attr:`partial`,
    :attr:`shard_order`) and :meth:`bind` / :meth:`placement_to_tensor_map` give the
    :class:`Layout` of an ``ndim``-d tensor. Immutable; equal by value.
    """

    __slots__ = ("_placements", "_shard_order", "__weakref__")

    def __init__(
        self, mesh: DeviceMesh, placements: tuple[Placement, ...], shard_order: ShardOrder | None = None
    ) -> None:
        self._mesh = mesh
        self._placements = placements
        self._shard_order = shard_order  # None: mesh order (a repeated Shard(d) splits in mesh order)

    def bind(self, ndim: int) -> Layout:
        """The layout of these placements for a tensor of ``ndim`` dims (negative Shard
        dims normalized)."""
        return _bind(self, ndim)

    def global_shape_from_local(
        self,
        local_shape: Sequence[int] | Mapping[int, Sequence[int]],
        rank: int | None = None,
        *,
        assume_even: bool = False,
    ) -> tuple[int, ...]:
        """:meth:`Layout.global_shape_from_local`, bound to the rank of the local shapes."""
        some = next(iter(local_shape.values()), ()) if isinstance(local_shape, Mapping) else local_shape
        ndim = len(as_shape(some, "local_shape"))
        return self.bind(ndim).global_shape_from_local(local_shape, rank, assume_even=assume_even)

    def __getattr__(self, name: str) -> Any:
        # What only a bound Layout answers (tensor_map, local shapes ...): say how to bind.
        if not name.startswith("_") and hasattr(Layout, name):
            raise LayoutError(
                "layout",
                self,
                f"torch-form placements do not say how many dims the tensor has, so they have no {name}",
                "call layout.bind(ndim) (or placement_to_tensor_map(ndim)) first",
            )
        raise AttributeError(name)

    @property
    def is_bound(self) -> bool:
        return False

    @property
    def placements(self) -> tuple[Placement, ...]:
        """As given, with torch's split factors (:class:`StridedShard`) for a dim whose
        ``shard_order`` is not mesh order."""
        if not self._shard_order:
            return self._placements
        return _with_split_factors(self._mesh, self._placements, self._shard_order)

    @property
    def partial(self) -> tuple[ReduceOp | None, ...]:
        """The reduce op per mesh dim (None: not partial), as MindSpore's ``partial``: one
        entry per mesh dim, also for the empty record of ``from_device_mesh``."""
        if not self._placements:
            return (None,) * self._mesh.ndim
        return tuple(p.reduce_op if isinstance(p, Partial) else None for p in self._placements)

    @property
    def partition_spec(self) -> PartitionSpec:
        """The ``PartitionSpec``, when the placements fix it without the tensor rank (no
        negative Shard dim): JAX reads missing trailing entries as unsplit dims."""
        dims = [p.dim for p in self._placements if isinstance(p, Shard)]
        if any(d < 0 for d in dims):
            raise LayoutError(
                "layout",
                self,
                "a negative Shard dim counts from the end of a tensor whose rank is not known yet",
                "call layout.bind(ndim) first",
            )
        return self.bind(max(dims, default=-1) + 1).partition_spec

    @property
    def shard_order(self) -> ShardOrder:
        """Torch's ``DTensorSpec.shard_order``: ``(tensor dim, mesh dims major to minor)``
        for every sharded tensor dim as written."""
        return _shard_order_of(self._placements, self._shard_order)

    def _key(self) -> tuple[Any, ...]:
        return (self._mesh, self._placements, self.shard_order)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshPlacements) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:
        return (MeshPlacements, (self._mesh, self._placements, self._shard_order))

    def __repr__(self) -> str:
        if any(len(axes) > 1 for _, axes in self.shard_order):
            order = dict(self.shard_order)
            return f"Layout.from_device_mesh({self._mesh!r})({self._placements!r}, shard_order={order!r})"
        return f"Layout.from_device_mesh({self._mesh!r})({self._placements!r})"

    def __str__(self) -> str:
        """The torch form's text, ``S(0),R`` (see :meth:`Layout.__str__`)."""
        return ",".join(str(p) for p in self._placements)


class Layout(_OnMesh):
    """How a tensor of a given rank lies on a :class:`DeviceMesh` (see the module docstring).

    ``Layout(mesh, dim_axes, partial)``: per tensor dim, the mesh dims (indices from the
    left) that split it, major first; per mesh dim, ``None`` or a Partial reduce op.
    ``split_factors`` (optional, one int per tensor dim, 1 = none) is torch's
    ``_StridedShard`` split factor coming from a view, not from a mesh dim: a dim of extent
    ``N`` with factor ``f`` is ``f`` groups of ``N / f`` and its one mesh dim splits every
    group alike, so each rank holds the same chunk of every group (what ``8x16 S(1)``
    flattened to ``128`` is, for free). Even extents only; the array stores each rank's
    elements as its block (:mod:`.physical`). Layouts are interned, as JAX interns its meshes and PartitionSpecs: building the same
    layout twice gives the same object, so equality and hashing are by identity (cheap).
    """

    __slots__ = ("_dim_axes", "_partial", "_split", "__dict__", "__weakref__")

    _interned: weakref.WeakValueDictionary[tuple[Any, ...], Layout] = weakref.WeakValueDictionary()

    def __new__(
        cls,
        mesh: DeviceMesh,
        dim_axes: Sequence[Sequence[int]],
        partial: Sequence[ReduceOp | None] | None = None,
        split_factors: Sequence[int] | None = None,
    ) -> Layout:
        if split_factors is not None:
            return _strided_layout(cls, mesh, dim_axes, partial, split_factors)
        if type(dim_axes) is tuple and type(partial) is tuple:
            # Fast path for the planners' tables (tuples of tuples of ints): an interned
            # layout is returned without converting or validating its tables again.
            try:
                exact = _exact_ints(dim_axes)
                layout = cls._interned.get((mesh, dim_axes, partial)) if exact else None
            except TypeError:  # not a table of sequences, or unhashable: the slow path reports it
                exact, layout = False, None
            if layout is not None:
                return layout
            if exact and isinstance(mesh, DeviceMesh) and all(type(axes) is tuple for axes in dim_axes):
                # a new layout from such tables: validated, not converted (the conversion's
                # abstract-class checks were half of building one)
                _validate_bound(mesh, dim_axes, partial)
                return cls._new((mesh, dim_axes, partial))
        mesh = as_device_mesh(mesh)
        dim_axes = _as_tuples("dim_axes", dim_axes, "((0,), ())")
        partial = _as_tuples("partial", (partial,), "(None, 'sum')")[0] if partial is not None else (None,) * mesh.ndim
        key = (mesh, dim_axes, partial)
        layout = cls._interned.get(key)
        if layout is None or not _exact_ints(dim_axes):
            _validate_bound(mesh, dim_axes, partial)
            layout = cls._interned.get(key)
        return cls._new(key) if layout is None else layout

    @classmethod
    def _new(cls, key: tuple[DeviceMesh, tuple[tuple[int, ...], ...], tuple[Any, ...]]) -> Layout:
        """The interned layout of a validated ``(mesh, dim_axes, partial)`` not interned yet."""
        layout = object.__new__(cls)
        layout._mesh, layout._dim_axes, layout._partial = key
        layout._split = ()
        cls._interned[key] = layout
        return layout

    def __reduce__(self) -> tuple[Any, ...]:
        # Unpickling goes through the constructor, so it interns too.
        if self._split:
            return (Layout, (self._mesh, self._dim_axes, self._partial, self._split))
        return (Layout, (self._mesh, self._dim_axes, self._partial))

    def __copy__(self) -> Layout:
        return self

    def __deepcopy__(self, memo: Any) -> Layout:
        return self

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh) -> MeshPlacements:
        """An empty placement record on ``mesh`` (ours, or a torch/JAX mesh, converted);
        call it with placements to record them (the RFC's interface)."""
        return MeshPlacements(as_device_mesh(mesh), ())

    @classmethod
    def from_placements(
        cls, mesh: DeviceMesh, placements: PlacementsLike, *, partial: PartialLike = None
    ) -> Layout | MeshPlacements:
        """Deprecated: ``Layout.from_device_mesh(mesh)(placements)`` (the RFC's form), or
        :func:`resolve_layout` when the tensor's shape or rank is known."""
        _deprecated("Layout.from_placements(mesh, placements)", "Layout.from_device_mesh(mesh)(placements)")
        return _from_placements(as_device_mesh(mesh), placements, partial, None)

    @classmethod
    def from_shard_order(
        cls, mesh: DeviceMesh, placements: Sequence[Placement], shard_order: Mapping[int, Sequence[int]] | None = None
    ) -> MeshPlacements:
        """Deprecated: ``Layout.from_device_mesh(mesh)(placements, shard_order=...)``."""
        _deprecated(
            "Layout.from_shard_order(mesh, placements, order)",
            "Layout.from_device_mesh(mesh)(placements, shard_order=order)",
        )
        return _from_placements(as_device_mesh(mesh), placements, None, shard_order or {})  # type: ignore[return-value]

    @classmethod
    def from_tensor_map(cls, mesh: DeviceMesh, tensor_map: Sequence[Any], partial: PartialLike = None) -> Layout:
        """A layout from a tensor_map (mesh axes counted from the right) and an optional
        partial side table."""
        mesh = as_device_mesh(mesh)
        if not isinstance(tensor_map, Sequence) or isinstance(tensor_map, str):
            raise ArgumentTypeError("tensor_map", tensor_map, "expected a tuple", "pass e.g. (1, -1)")
        dim_axes = []
        for entry in tensor_map:
            values = entry if isinstance(entry, (tuple, list)) else (entry,)
            axes = []
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < mesh.ndim:
                    raise LayoutError(
                        "tensor_map",
                        tuple(tensor_map),
                        f"entry {v!r} is not -1 or a mesh axis counted from the right (0..{mesh.ndim - 1})",
                        "use -1 for an unsplit dim, k for mesh axis ndim-1-k",
                    )
                if v == -1:
                    if len(values) > 1:
                        raise LayoutError(
                            "tensor_map", tuple(tensor_map), "-1 inside a tuple", "use -1 alone for an unsplit dim"
                        )
                    continue
                axes.append(mesh.ndim - 1 - v)
            dim_axes.append(tuple(axes))
        return cls(mesh, dim_axes, _partial_table(mesh, partial))

    @classmethod
    def from_partition_spec(cls, mesh: DeviceMesh, spec: PartitionSpec, ndim: int | None = None) -> Layout:
        """A layout from a ``PartitionSpec`` (``unreduced`` axes become Partial(sum));
        ``ndim`` pads a short spec with unsplit dims."""
        if not isinstance(spec, PartitionSpec):
            raise ArgumentTypeError("spec", spec, "expected a jax.sharding.PartitionSpec", "pass e.g. P('dp', None)")
        entries: list[Any] = list(spec.partitions)
        if ndim is not None:
            if isinstance(ndim, bool) or not isinstance(ndim, int):
                raise ArgumentTypeError("ndim", ndim, "expected an int", "pass the tensor's number of dims, or None")
            if ndim < len(entries):
                raise LayoutError("ndim", ndim, f"shorter than the spec {spec}", f"pass ndim >= {len(entries)}")
            entries += [None] * (ndim - len(entries))
        partial = {axis: "sum" for axis in getattr(spec, "unreduced", ())}
        return _alias_form(as_device_mesh(mesh), tuple(entries), partial or None)

    def bind(self, ndim: int) -> Layout:
        """This layout for a tensor of ``ndim`` dims (a Layout is bound; :meth:`MeshPlacements.bind`
        is where binding happens). Fewer alias entries than dims leave the trailing dims
        unsplit, as a ``PartitionSpec`` does (the RFC's ``from_local(x, dp_mesh, ("dp",))``)."""
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0:
            raise ArgumentTypeError("ndim", ndim, "expected a non-negative int", "pass the tensor's number of dims")
        if len(self._dim_axes) > ndim:
            raise LayoutError(
                "placements",
                self.alias_map if not self._split else str(self),
                f"the alias form has {len(self._dim_axes)} entries but the tensor has {ndim} dims",
                f"give at most one entry per tensor dim ({ndim})",
            )
        if len(self._dim_axes) < ndim:
            extra = ndim - len(self._dim_axes)
            split = self._split + (1,) * extra if self._split else None
            return Layout(self._mesh, self._dim_axes + ((),) * extra, self._partial, split)
        return self

    # -- text ------------------------------------------------------------------------
    def __repr__(self) -> str:
        if self._split:
            return f"Layout({self._mesh!r}, {self._dim_axes!r}, {self._partial!r}, split_factors={self._split!r})"
        head = f"Layout.from_device_mesh({self._mesh!r})"
        partial = {self._mesh.axis_names[i]: op for i, op in enumerate(self._partial) if op}
        tail = f", partial={partial!r}" if partial else ""
        return f"{head}({self.alias_map!r}{tail})"

    def __str__(self) -> str:
        """The one text form of a layout, which :func:`resolve_layout` parses back: the
        torch form (``S(0),R,P(max)``) when every tensor dim is split by at most one mesh
        axis, else the alias form with its partial axes (``(c,b),None; partial a=max``)."""
        if self._split or all(len(axes) <= 1 for axes in self._dim_axes):
            # (A strided layout is written in torch form even with a dim split by several
            # mesh dims, which then has no text that parses back: the alias form has no
            # split factors.)
            return ",".join(str(p) for p in self.placements)
        partial = {self._mesh.axis_names[m]: op for m, op in enumerate(self._partial) if op}
        return format_alias(self.alias_map) + (f"; partial {format_partial(partial)}" if partial else "")

    # -- related layouts -------------------------------------------------------------
    @classmethod
    def replicated_on(cls, mesh: DeviceMesh, ndim: int) -> Layout:
        """Deprecated: ``Layout(mesh, ((),) * ndim)``, or ``layout.replicated()``."""
        _deprecated("Layout.replicated_on(mesh, ndim)", "Layout(mesh, ((),) * ndim) or layout.replicated()")
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0:
            raise ArgumentTypeError("ndim", ndim, "expected a non-negative int", "pass the tensor's number of dims")
        return cls(mesh, ((),) * ndim)

    def replicated(self) -> Layout:
        """The all-Replicate layout on the same mesh and tensor rank."""
        return Layout(self._mesh, ((),) * self.ndim)

    def without_partial(self) -> Layout:
        """The same splits with every partial mesh dim turned into Replicate."""
        return self if not self.has_partial else Layout(self._mesh, self._dim_axes, None, self._split or None)

    # -- basic properties -------------------------------------------------------------
    @property
    def is_bound(self) -> bool:
        """Always True (see :class:`MeshPlacements` for placements not yet bound)."""
        return True

    @property
    def ndim(self) -> int:
        return len(self._dim_axes)

    @property
    def dim_axes(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor dim, the mesh dims (indices from the left) that split it, major first."""
        return self._dim_axes

    @property
    def partial(self) -> tuple[ReduceOp | None, ...]:
        """The partial side table: per mesh dim, ``None`` or the reduce op."""
        return self._partial

    @property
    def split_factors(self) -> tuple[int, ...]:
        """Per tensor dim, torch's ``_StridedShard`` split factor from a view (1: none;
        see the class docstring)."""
        return self._split or (1,) * len(self._dim_axes)

    @property
    def is_strided(self) -> bool:
        """True when some dim has a split factor from a view (:attr:`split_factors`)."""
        return bool(self._split)

    @property
    def partial_op(self) -> ReduceOp | None:
        """The (single) reduce op of the partial mesh dims, or None."""
        return next((op for op in self._partial if op), None)

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(i for i, op in enumerate(self._partial) if op)

    @property
    def has_partial(self) -> bool:
        return any(self._partial)

    def mesh_dim_split(self, mesh_dim: int) -> int | None:
        """The tensor dim split by ``mesh_dim``, or None."""
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not 0 <= mesh_dim < self._mesh.ndim:
            raise MeshError(
                "mesh_dim", mesh_dim, f"not a mesh dim of a {self._mesh.ndim}-d mesh", f"use 0..{self._mesh.ndim - 1}"
            )
        return next((d for d, axes in enumerate(self._dim_axes) if mesh_dim in axes), None)

    def pieces(self, dim: int) -> tuple[int, ...]:
        """Mesh axis sizes splitting tensor dim ``dim``, major to minor."""
        axes = self._dim_axes
        if isinstance(dim, bool) or not isinstance(dim, int) or not -len(axes) <= dim < len(axes):
            raise ShapeError("dim", dim, f"not a dim of a {len(axes)}-d tensor", f"use a dim in [{-len(axes)}, {len(axes)})")
        return tuple(self._mesh.shape[a] for a in axes[dim])

    # -- the three views ---------------------------------------------------------------
    @cached_property
    def placements(self) -> tuple[Placement, ...]:
        """The torch form, exactly as torch 2.13's ``DTensor.placements``: one placement
        per mesh dim; a dim split by several mesh dims in mesh order is a repeated
        ``Shard(d)``, in another order :class:`StridedShard` (torch's ``_StridedShard``)
        with torch's split factors. Every torch-form input accepts it back."""
        unsplit = tuple(Partial(op) if op else Replicate() for op in self._partial)
        placements = _with_split_factors(self._mesh, unsplit, self.shard_order)
        if self._split:
            placements = tuple(
                StridedShard(p.dim, split_factor=self._split[p.dim])
                if isinstance(p, Shard) and self._split[p.dim] > 1 else p
                for p in placements
            )
        return placements

    @property
    def shard_order(self) -> ShardOrder:
        """Torch's ``DTensorSpec.shard_order``: ``(tensor dim, mesh dims major to minor)``
        for every sharded tensor dim, in dim order."""
        return tuple((d, axes) for d, axes in enumerate(self._dim_axes) if axes)

    def _refuse_split_factors(self, view: str, owner: str) -> None:
        """A strided layout (split factors from a view) has no ``view``: refuse it rather
        than give the plain split's table, which is other data on every rank."""
        if self._split:
            dim = next(d for d, f in enumerate(self._split) if f > 1)
            raise LayoutError(
                "layout", self,
                f"{owner} has no split factor, and dim {dim} is {self.placements[self._dim_axes[dim][0]]} "
                "(torch's _StridedShard from a view: each rank holds a strided set of elements)",
                f"redistribute to a layout without split factors first (x.redistribute(mesh, ...)) to get its {view}; "
                ".placements and str() carry the factor",
            )

    @property
    def tensor_map(self) -> TensorMap:
        """MindSpore's table: per tensor dim ``-1`` (not split), a mesh axis counted from the
        right, or a tuple of them (a strided layout has none: :class:`LayoutError`)."""
        self._refuse_split_factors("tensor_map", "MindSpore's tensor_map")
        last = self._mesh.ndim - 1
        return tuple(
            -1 if not axes else last - axes[0] if len(axes) == 1 else tuple(last - a for a in axes)
            for axes in self._dim_axes
        )

    @property
    def alias_map(self) -> tuple[str | tuple[str, ...], ...]:
        """The alias view, e.g. ``("dp", "None")`` or ``(("dp", "tp"), "None")`` (a strided
        layout has none: :class:`LayoutError`)."""
        self._refuse_split_factors("alias_map", "the alias form")
        return tuple(
            "None" if not axes else self._names(axes)[0] if len(axes) == 1 else self._names(axes)
            for axes in self._dim_axes
        )

    def _names(self, axes: Sequence[int]) -> tuple[str, ...]:
        return tuple(self._mesh.axis_names[a] for a in axes)

    @cached_property
    def partition_spec(self) -> PartitionSpec:
        """The ``PartitionSpec``: a name or tuple of names per dim, Partial(sum) axes in
        ``unreduced``. Avg/max/min partial axes appear nowhere (JAX has no form for them).
        A strided layout has none (:class:`LayoutError`)."""
        self._refuse_split_factors("partition_spec", "JAX's PartitionSpec")
        entries = [
            None if not axes else self._names(axes)[0] if len(axes) == 1 else self._names(axes)
            for axes in self._dim_axes
        ]
        unreduced = frozenset(self._names([i for i, op in enumerate(self._partial) if op == "sum"]))
        return PartitionSpec(*entries, unreduced=unreduced) if unreduced else PartitionSpec(*entries)

    @property
    def jax_expressible(self) -> bool:
        """True when a ``NamedSharding`` says all of this layout: no avg/max/min partial,
        and Partial(sum) only on explicit mesh axes."""
        ops = {op for op in self._partial if op}
        return not self._split and (not ops or (ops == {"sum"} and self._mesh.is_explicit))

    @cached_property
    def named_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh.to_jax(), partition_spec)``."""
        if self._split:
            raise LayoutError(
                "layout", self, "JAX has no sharding for a strided shard (a split factor from a view)",
                "use a DTensor, which carries it, or redistribute to a layout without split factors",
            )
        if not self.jax_expressible:
            raise LayoutError(
                "layout",
                self,
                f"JAX has no sharding for Partial({self.partial_op}) on "
                f"{'auto' if self.partial_op == 'sum' else 'any'} mesh axes",
                "use a DTensor, which carries it, or reduce it first (redistribute to Replicate)",
            )
        return NamedSharding(self._mesh.to_jax(), self.partition_spec)

    # -- local shapes and offsets (pure) -------------------------------------------------
    def check_shape(self, global_shape: Sequence[int], argument: str = "global_shape") -> tuple[int, ...]:
        """``global_shape`` as a tuple of ints, checked to have this layout's number of dims."""
        shape = as_shape(global_shape, argument)
        if len(shape) != self.ndim:
            raise ShapeError(
                argument, shape, f"{len(shape)} dims, but the layout is for {self.ndim} dims", "pass a matching shape"
            )
        for d, factor in enumerate(self._split):
            pieces = factor * math.prod(self.pieces(d))
            if factor > 1 and shape[d] % pieces:
                raise ShapeError(
                    argument, shape, f"dim {d} ({shape[d]}) has split factor {factor} and {pieces // factor} pieces: "
                    f"a strided shard needs an extent divisible by {pieces}",
                    "use an even extent, or a layout without split factors",
                )
        return shape

    def _splits(self, dim: int, coordinate: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple((self._mesh.shape[a], coordinate[a]) for a in self._dim_axes[dim])

    def local_shape_and_offset(
        self, global_shape: Sequence[int], rank: int | None = None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """torch's local shape and global offset of ``rank`` (default: calling rank)."""
        shape = self.check_shape(global_shape)
        coordinate = self._mesh.get_coordinate(rank)
        # A strided dim (even, see check_shape): the rank's chunk of group 0, and as many
        # elements again in every other group; torch's offset is its first element's.
        factors = self.split_factors
        blocks = [
            chunking.nested_chunk(n // factors[d], self._splits(d, coordinate)) for d, n in enumerate(shape)
        ]
        return tuple(b[1] * factors[d] for d, b in enumerate(blocks)), tuple(b[0] for b in blocks)

    def local_shape(self, global_shape: Sequence[int], rank: int | None = None) -> tuple[int, ...]:
        return self.local_shape_and_offset(global_shape, rank)[0]

    def global_offset(self, global_shape: Sequence[int], rank: int | None = None) -> tuple[int, ...]:
        return self.local_shape_and_offset(global_shape, rank)[1]

    def local_slices(self, global_shape: Sequence[int], rank: int | None = None) -> tuple[slice, ...]:
        """The index of ``rank``'s local block in the logical tensor (a strided shard's
        elements are no block: :class:`LayoutError`)."""
        if self.is_strided:
            raise LayoutError(
                "layout", self, "a strided shard's local elements are not one block of the logical tensor",
                "redistribute to a layout without split factors first",
            )
        shape, offset = self.local_shape_and_offset(global_shape, rank)
        return tuple(slice(o, o + n) for n, o in zip(shape, offset))

    def is_even(self, global_shape: Sequence[int]) -> bool:
        """True when every rank's block is full, so JAX can shard the logical shape as is."""
        shape = self.check_shape(global_shape)
        return all(chunking.is_even(n, self.pieces(d)) for d, n in enumerate(shape))

    def physical_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """The padded shape in which every rank's block is full (see :mod:`.chunking`)."""
        shape = self.check_shape(global_shape)
        return tuple(chunking.padded_size(n, self.pieces(d)) for d, n in enumerate(shape))

    def global_shape_from_local(
        self,
        local_shape: Sequence[int] | Mapping[int, Sequence[int]],
        rank: int | None = None,
        *,
        assume_even: bool = False,
    ) -> tuple[int, ...]:
        """The global shape consistent with local shapes under torch.chunk.

        ``local_shape`` is one rank's shape (``rank``, default the calling rank) or a mapping
        rank -> shape. Raises :class:`ShapeError` when no global shape fits, or when several
        do and ``assume_even`` (torch's assumption ``global = local * pieces``) is off.
        """
        known = (
            {self._mesh.check_rank(r): as_shape(s, "local_shape") for r, s in local_shape.items()}
            if isinstance(local_shape, Mapping)
            else {self._mesh.resolve_rank(rank): as_shape(local_shape, "local_shape")}
        )
        if not known:
            raise ShapeError("local_shape", local_shape, "no rank's local shape given", "pass e.g. {0: (2, 4)}")
        ndim = self.ndim
        for r, s in known.items():
            if len(s) != ndim:
                raise ShapeError(
                    "local_shape", s, f"rank {r}'s shape has {len(s)} dims, the layout {ndim}", "pass matching shapes"
                )
        result = []
        coordinates = {r: self._mesh.get_coordinate(r) for r in known}
        for dim in range(ndim):
            pieces = self.pieces(dim)
            total = math.prod(pieces)
            extents = {r: s[dim] for r, s in known.items()}
            factor = self.split_factors[dim]
            if factor > 1:
                # A strided dim is even (check_shape): every rank holds extent / pieces.
                candidates = sorted({e * total for e in extents.values()}) if len(set(extents.values())) == 1 else []
                candidates = [n for n in candidates if n % (factor * total) == 0]
            elif total == 1:
                # An unsplit dim has its global extent on every rank: all must agree.
                candidates = sorted(set(extents.values())) if len(set(extents.values())) == 1 else []
            else:
                bound = (max(extents.values()) + 1) * total * total + total
                candidates = [
                    n
                    for n in range(bound + 1)
                    if all(chunking.nested_chunk(n, self._splits(dim, coordinates[r]))[1] == e for r, e in extents.items())
                ]
            if assume_even and len(candidates) > 1:
                even = {e * total for e in extents.values()}
                candidates = [n for n in candidates if n in even]
            if len(candidates) != 1:
                problem = (
                    f"no global extent of dim {dim} gives local extents {extents} under torch.chunk"
                    if not candidates
                    else f"global extents {candidates[:6]}{'...' if len(candidates) > 6 else ''} of dim {dim} "
                    f"all give local extents {extents}"
                )
                raise ShapeError(
                    "local_shape",
                    local_shape,
                    problem,
                    "pass the global shape (shape=...), the local shapes of more ranks, or assume_even=True",
                )
            result.append(candidates[0])
        return tuple(result)

    def all_local_shapes(self, global_shape: Sequence[int]) -> dict[int, tuple[int, ...]]:
        return {r: self.local_shape(global_shape, r) for r in self._mesh.rank_list}


def _get_global_shape(
    self: DeviceMesh,
    local_shape: Sequence[int] | Mapping[int, Sequence[int]],
    placements: PlacementsLike,
    rank: int | None = None,
    *,
    assume_even: bool = False,
) -> tuple[int, ...]:
    """The global shape whose torch.chunk layout gives ``local_shape`` on ``rank``.

    ``local_shape`` is the shape on ``rank`` (default: the calling rank) or a mapping
    rank -> local shape. Exact for uneven shards; when several global shapes give the
    same local shapes (rank 0 holds 2 rows for 5..8 rows over 4 ranks), raises
    :class:`ShapeError` unless ``assume_even=True`` picks torch's ``local * pieces``.
    (The RFC's ``DeviceMesh.get_global_shape``; :meth:`Layout.global_shape_from_local`.)
    """
    layout = _from_placements(self, placements, None, None)
    return layout.global_shape_from_local(local_shape, rank, assume_even=assume_even)


DeviceMesh.get_global_shape = _get_global_shape  # type: ignore[attr-defined]


# -- the one way from placements as given to a bound Layout --------------------------------

# (mesh, placements, partial, ndim or shape) as given -> Layout; hashable arguments only.
# Placement values, strings and meshes compare by value, and nothing that compares equal
# to a valid argument is invalid (Shard(True) cannot be built), so a hit is always right.
_resolved = Memo(8192)


def resolve_layout(
    mesh: Any,
    placements: Any,
    shape: int | Sequence[int],
    *,
    partial: PartialLike = None,
    shard_order: Mapping[int, Sequence[int]] | None = None,
) -> Layout:
    """The :class:`Layout` of ``placements`` (torch or alias form, as values or text,
    another library's objects, or a Layout / MeshPlacements) on ``mesh`` for a tensor of
    ``shape`` (or of ``shape`` dims, given an int): parse, convert foreign objects (once,
    here), validate, bind. Given a shape, foreign placements are also checked to mean the
    same for that shape (torch's uneven ``_StridedShard``). A repeated call costs one dict
    lookup."""
    frozen = tuple(placements) if isinstance(placements, list) else placements
    order = tuple(shard_order.items()) if isinstance(shard_order, Mapping) else shard_order
    key = (mesh, frozen, partial, shape if isinstance(shape, int) else tuple(shape), order)
    try:
        return _resolved[key]
    except KeyError:
        pass
    except TypeError:  # unhashable arguments (a partial dict, nested lists): not cached
        key = None
    ndim = shape if isinstance(shape, int) else len(as_shape(shape, "shape"))
    layout = _from_placements(as_device_mesh(mesh, "mesh"), placements, partial, shard_order).bind(ndim)
    if not isinstance(shape, int):
        check_placements_for_shape(placements, layout, tuple(shape))
    if key is not None:
        _resolved.remember(key, layout)
    return layout


# -- helpers -----------------------------------------------------------------------------


def _from_placements(
    mesh: DeviceMesh, placements: Any, partial: PartialLike, shard_order: Mapping[int, Sequence[int]] | None
) -> Layout | MeshPlacements:
    """Placements as given -> a Layout (alias form) or MeshPlacements (torch form): the
    parsing, conversion and validation every public route shares (the RFC's call,
    :func:`resolve_layout`). A layout given as placements is returned as is (it must be on
    ``mesh``)."""
    if isinstance(placements, (Layout, MeshPlacements)):
        if placements.mesh is not mesh:
            raise LayoutError(
                "placements", placements, "this layout is on another mesh", "rebuild it on the target mesh"
            )
        if shard_order is not None:
            raise PlacementError(
                "shard_order", shard_order, "a layout states its split order itself", "drop shard_order="
            )
        return placements
    original = placements
    if isinstance(placements, str):
        placements, text_partial = parse_layout_text(placements)
        if text_partial is not None:
            if partial is not None:
                raise PlacementError(
                    "partial", partial, "the placements text names its partial axes itself", "drop partial="
                )
            partial = text_partial
    if not isinstance(placements, Sequence):
        raise ArgumentTypeError(
            "placements",
            placements,
            "expected a sequence of placements or alias entries",
            "pass e.g. (Shard(0), Replicate()) or (('dp', 'tp'), None)",
        )
    if any(not isinstance(p, (Placement, str, tuple, list)) and p is not None for p in placements):
        foreign = convert_placements(mesh, placements)
        if foreign is not None:
            if partial is not None or shard_order is not None:
                argument, value = ("partial", partial) if partial is not None else ("shard_order", shard_order)
                raise PlacementError(
                    argument, value, "another library's placements state this themselves", f"drop {argument}="
                )
            return foreign
    if placements and any(isinstance(p, Placement) for p in placements):
        if partial is not None:
            raise PlacementError(
                "partial", partial, "the torch form states partials itself", "use Partial(op) in the placements"
            )
        placements = tuple(placements)
        _check_torch_form(mesh, placements, original)
        order = None if shard_order is None else _validate_shard_order(mesh, placements, shard_order)
        return MeshPlacements(mesh, placements, order)
    if shard_order is not None:
        raise PlacementError(
            "shard_order",
            shard_order,
            "the alias form states each dim's split order itself (mesh axes major to minor)",
            "drop shard_order=, or give torch-form placements",
        )
    return _alias_form(mesh, tuple(placements), partial)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed; use {new} (see docs/architecture.md, 'Building a Layout')",
        DeprecationWarning,
        stacklevel=3,
    )


def _check_torch_form(mesh: DeviceMesh, placements: tuple[Any, ...], original: Any) -> None:
    """Validate torch-form placements (all that can be checked without the tensor rank).
    A repeated ``Shard(d)``, as values or text, means what torch's does: dim ``d`` split by
    those mesh dims in mesh order, each splitting the previous one's chunks."""
    for p in placements:
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise ArgumentTypeError(
                "placements",
                original,
                f"{p!r} mixes the alias form into torch-form placements",
                "use one form: all Shard/Replicate/Partial, or all axis names",
            )
    if len(placements) != mesh.ndim:
        raise PlacementError(
            "placements",
            original,
            f"{len(placements)} placements for a {mesh.ndim}-d mesh {mesh.axis_names}",
            f"give exactly one placement per mesh dim ({mesh.ndim})",
        )
    _check_partial_ops(placements, original)


def _alias_form(mesh: DeviceMesh, entries: tuple[Any, ...], partial: PartialLike) -> Layout:
    dim_axes = [_alias_entry_axes(mesh, entry, entries) for entry in entries]
    return Layout(mesh, dim_axes, _partial_table(mesh, partial))


def _bind(placements: MeshPlacements, ndim: int) -> Layout:
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0:
        raise ArgumentTypeError("ndim", ndim, "expected a non-negative int", "pass the tensor's number of dims")
    dim_axes, partial, split = _torch_form_to_tables(placements.mesh, placements._placements, ndim, placements._shard_order)
    # tuples of tuples: the constructor validates them without converting them
    return Layout(placements.mesh, tuple(tuple(axes) for axes in dim_axes), partial, split)


def _with_split_factors(mesh: DeviceMesh, placements: Sequence[Placement], shard_order: ShardOrder) -> tuple[Placement, ...]:
    """``placements`` with every split of ``shard_order`` written as torch writes it
    (``DTensorSpec._convert_shard_order_to_StridedShard``): mesh dim m splitting dim d gets
    ``Shard(d)``, or ``StridedShard(d, k)`` when the mesh dims splitting d before m but
    standing after m in the mesh multiply to k > 1."""
    result = list(placements)
    for dim, axes in shard_order:
        if len(axes) == 1 and isinstance(result[axes[0]], StridedShard):
            continue  # a split factor from a view (view_factors), kept as given
        for position, mesh_dim in enumerate(axes):
            factor = math.prod(mesh.shape[m] for m in axes[:position] if m > mesh_dim)
            result[mesh_dim] = Shard(dim) if factor == 1 else StridedShard(dim, split_factor=factor)
    return tuple(result)


def split_order_from_factors(mesh: DeviceMesh, placements: Sequence[Any]) -> ShardOrder:
    """Per sharded tensor dim, its mesh dims in split order (major first), decoded from the
    split factors of torch-form placements right to left (torch's
    ``DTensorSpec._maybe_convert_StridedShard_to_shard_order``): a placement with
    ``split_factor`` k goes where the mesh dims before it in the order multiply to k;
    plain ``Shard`` has k = 1, so repeated ``Shard(d)`` is mesh order. Accepts ours and
    torch's placement objects (anything with ``.dim``, ``.split_factor`` optional)."""
    order: dict[int, list[int]] = {}
    for mesh_dim in reversed(range(len(placements))):
        placement = placements[mesh_dim]
        if not hasattr(placement, "dim") or not callable(getattr(placement, "is_shard", None)):
            continue
        mesh_dims = order.setdefault(placement.dim, [])
        wanted = getattr(placement, "split_factor", 1)
        earlier = 1
        for position in range(len(mesh_dims) + 1):
            if earlier == wanted:
                mesh_dims.insert(position, mesh_dim)
                break
            if position < len(mesh_dims):
                earlier *= mesh.shape[mesh_dims[position]]
        else:
            raise PlacementError(
                "placements",
                tuple(placements),
                f"{placement!r} on mesh dim {mesh_dim}: split factor {wanted} is no product of the sizes of the "
                f"mesh dims splitting tensor dim {placement.dim} after it",
                "use the split factors Layout.placements (torch's DTensorSpec) gives, or the alias form",
            )
    return tuple((dim, tuple(order[dim])) for dim in sorted(order))


def _exact_ints(dim_axes: tuple[tuple[Any, ...], ...]) -> bool:
    """True when every entry is a plain int (not a bool or NumPy int that equals one)."""
    return all(type(a) is int for axes in dim_axes for a in axes)


def _shard_order_of(placements: Sequence[Placement], explicit: ShardOrder | None) -> ShardOrder:
    """Per sharded dim (as written), its mesh dims: the explicit order, else mesh order."""
    given = dict(explicit or ())
    dims = sorted({p.dim for p in placements if isinstance(p, Shard)})
    return tuple(
        (d, given.get(d, tuple(i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d)))
        for d in dims
    )


def _validate_shard_order(
    mesh: DeviceMesh, placements: Sequence[Placement], shard_order: Mapping[int, Sequence[int]]
) -> ShardOrder:
    if not isinstance(shard_order, Mapping):
        raise ArgumentTypeError(
            "shard_order", shard_order, "expected a mapping tensor dim -> mesh dims", "pass e.g. {0: (1, 0)}"
        )
    order = {}
    for dim, axes in shard_order.items():
        expected = sorted(i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim)
        if isinstance(axes, str) or not isinstance(axes, Sequence):
            raise ArgumentTypeError(
                "shard_order", dict(shard_order), f"entry {dim!r}: {axes!r} is not a sequence of mesh dims", "pass e.g. {0: (1, 0)}"
            )
        axes = tuple(_axis_of(mesh, a, "shard_order", dict(shard_order)) for a in axes)
        if sorted(axes) != expected:
            raise PlacementError(
                "shard_order",
                dict(shard_order),
                f"tensor dim {dim} is sharded by mesh dims {expected} in the placements, not {list(axes)}",
                "list exactly the mesh dims whose placement is Shard(dim), in split order",
            )
        order[dim] = axes
    return _shard_order_of(placements, tuple(order.items()))


def as_shape(shape: Any, argument: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (the package's one shape validator),
    reporting a bad one as a bad ``argument``."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise ArgumentTypeError(argument, shape, "expected a tuple of ints", "pass e.g. (8, 2)")
    for n in shape:
        if isinstance(n, bool) or not hasattr(n, "__index__") or int(n) < 0:
            raise ShapeError(argument, tuple(shape), f"{n!r} is not a non-negative int", "pass e.g. (8, 2)")
    return tuple(int(n) for n in shape)


def _check_partial_ops(placements: Sequence[Placement], original: Any, argument: str = "placements") -> None:
    ops = sorted({p.reduce_op for p in placements if isinstance(p, Partial)})
    if len(ops) > 1:
        raise PlacementError(
            argument,
            original,
            f"mixes Partial reduce ops {ops}; a tensor is the reduction of its partials with one op",
            "reduce all but one kind first (redistribute those mesh dims to Replicate)",
        )


def _torch_form_to_tables(
    mesh: DeviceMesh, placements: Sequence[Placement], ndim: int, shard_order: ShardOrder | None
) -> tuple[list[tuple[int, ...]], tuple[ReduceOp | None, ...], list[int] | None]:
    """Per tensor dim its mesh dims (major first), the partial table and the split factors
    (None: none) of torch-form placements bound to ``ndim`` dims. Without a shard order,
    negative Shard dims are normalized first, as torch's ``distribute_tensor``,
    ``from_local`` and ``redistribute`` do, so ``Shard(1)`` and ``Shard(-1)`` of a 2-d
    tensor are a repeated ``Shard(1)``. A shard order names dims as written, so there a
    dim written both ways is refused: its two entries do not say which split is major."""
    if shard_order is None:
        plain = _plain_tables(placements, ndim)
        if plain is not None:
            return plain
    for p in placements:
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            raise PlacementError(
                "placements",
                tuple(placements),
                f"{p!r} is out of range for a {ndim}-d tensor",
                f"use a Shard dim in [{-ndim}, {ndim})",
            )
    if shard_order is None:
        placements = [dataclasses.replace(p, dim=p.dim % ndim) if isinstance(p, Shard) else p for p in placements]
    split: list[int] | None = None
    placements, views = view_factors(placements)
    if views:
        split = [1] * ndim
        for dim, factor in views.items():
            split[dim % ndim] = factor
    if shard_order is None:
        shard_order = split_order_from_factors(mesh, placements)
    dim_axes: list[tuple[int, ...]] = [() for _ in range(ndim)]
    for dim, axes in _shard_order_of(placements, shard_order):
        if dim_axes[dim % ndim]:
            raise PlacementError(
                "placements",
                tuple(placements),
                f"Shard({dim}) and Shard({dim % ndim - ndim if dim >= 0 else dim % ndim}) are the same dim of a "
                f"{ndim}-d tensor, which the split order (shard_order=, or StridedShard split factors) names apart",
                "write every Shard dim one way (all non-negative)",
            )
        dim_axes[dim % ndim] = axes
    partial = tuple(p.reduce_op if isinstance(p, Partial) else None for p in placements)
    return dim_axes, partial, split


def _plain_tables(
    placements: Sequence[Placement], ndim: int
) -> tuple[list[tuple[int, ...]], tuple[ReduceOp | None, ...], None] | None:
    """:func:`_torch_form_to_tables` of placements that are all plain ``Shard`` (of a dim
    written in ``[0, ndim)``), ``Replicate`` or ``Partial``, without a shard order: each
    dim split in mesh order (what :func:`split_order_from_factors` decodes from split
    factors of 1), no split factors. None for any other placements (the general path
    decodes them and reports what is wrong). Binding an input's placements was ~0.2 ms of
    every cold ``infer_signature``, half of it the general path's checks and decoding."""
    dim_axes: list[tuple[int, ...]] = [()] * ndim
    partial = []
    for mesh_dim, p in enumerate(placements):
        kind = type(p)
        if kind is Shard:
            if not 0 <= p.dim < ndim:
                return None
            dim_axes[p.dim] += (mesh_dim,)
            partial.append(None)
        elif kind is Replicate:
            partial.append(None)
        elif kind is Partial:
            partial.append(p.reduce_op)
        else:
            return None
    return dim_axes, tuple(partial), None


def view_factors(placements: Sequence[Placement]) -> tuple[tuple[Placement, ...], dict[int, int]]:
    """Split factors from a view: a ``StridedShard(d, f)`` with ``f > 1`` on the only mesh
    dim sharding ``d`` (no other mesh dim's order can explain it) becomes ``Shard(d)`` and
    a split factor ``f`` of dim ``d``."""
    shards: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            shards.setdefault(p.dim, []).append(mesh_dim)
    views = {}
    result = list(placements)
    for dim, mesh_dims in shards.items():
        p = placements[mesh_dims[0]]
        if len(mesh_dims) == 1 and isinstance(p, StridedShard) and p.split_factor > 1:
            views[dim] = p.split_factor
            result[mesh_dims[0]] = Shard(dim)
    return tuple(result), views


def _strided_layout(
    cls: type[Layout], mesh: Any, dim_axes: Any, partial: Any, split_factors: Any
) -> Layout:
    """``Layout(mesh, dim_axes, partial, split_factors)``: validated, interned by all four
    (without a factor above 1, the layout without split factors)."""
    plain = cls(mesh, dim_axes, partial)
    if isinstance(split_factors, (str, bytes)) or not isinstance(split_factors, Sequence) or any(
        isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in split_factors
    ):
        raise ArgumentTypeError(
            "split_factors", split_factors, "expected one positive int per tensor dim", "pass e.g. (8, 1)"
        )
    split = tuple(int(f) for f in split_factors)
    if len(split) != plain.ndim:
        raise LayoutError(
            "split_factors", split, f"{len(split)} factors for a {plain.ndim}-d layout", "give one per tensor dim"
        )
    if all(f == 1 for f in split):
        return plain
    for dim, factor in enumerate(split):
        if factor > 1 and len(plain.dim_axes[dim]) != 1:
            raise LayoutError(
                "split_factors", split,
                f"dim {dim} has split factor {factor} but is split by {len(plain.dim_axes[dim])} mesh dims",
                "give a split factor only to a dim split by exactly one mesh dim",
            )
    key = (plain.mesh, plain.dim_axes, plain.partial, split)
    layout = cls._interned.get(key)
    if layout is None:
        layout = object.__new__(cls)
        layout._mesh, layout._dim_axes, layout._partial, layout._split = key
        cls._interned[key] = layout
    return layout


def _alias_entry_axes(mesh: DeviceMesh, entry: Any, entries: tuple[Any, ...]) -> tuple[int, ...]:
    if entry is None or entry == "None":
        return ()
    names = (entry,) if isinstance(entry, str) else entry
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) for n in names):
        raise ArgumentTypeError(
            "placements",
            entries,
            f"alias entry {entry!r} is not an axis name, a tuple of names or None",
            f"use names from {mesh.axis_names}, e.g. (('dp', 'tp'), None)",
        )
    axes = []
    for name in names:
        if name not in mesh.axis_names:
            raise LayoutError(
                "placements", entries, f"unknown mesh axis {name!r}", f"use names from {mesh.axis_names} or 'None'"
            )
        axes.append(mesh.axis_names.index(name))
    return tuple(axes)


def _partial_table(mesh: DeviceMesh, partial: PartialLike) -> tuple[ReduceOp | None, ...]:
    if partial is None:
        return (None,) * mesh.ndim
    if isinstance(partial, Mapping):
        table: list[Any] = [None] * mesh.ndim
        for axis, op in partial.items():
            table[_axis_of(mesh, axis, "partial", partial)] = op
    elif isinstance(partial, Sequence) and not isinstance(partial, str) and len(partial) == mesh.ndim:
        table = list(partial)
    else:
        raise ArgumentTypeError(
            "partial",
            partial,
            f"expected a mapping axis -> reduce op or one entry per mesh dim ({mesh.ndim})",
            "pass e.g. {'tp': 'sum'}",
        )
    _check_partial_table(table, partial)
    return tuple(table)


def _check_partial_table(table: Sequence[Any], value: Any) -> None:
    for op in table:
        if op is not None and op not in REDUCE_OPS:
            raise PlacementError("partial", value, f"unknown reduce op {op!r}", f"use one of {REDUCE_OPS} or None")
    _check_partial_ops([Partial(op) for op in table if op], value, "partial")


def _as_tuples(argument: str, value: Any, example: str) -> tuple[tuple[Any, ...], ...]:
    """A sequence of sequences as a tuple of tuples (the Layout constructor's tables)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or any(
        isinstance(v, (str, bytes)) or not isinstance(v, Sequence) for v in value
    ):
        raise ArgumentTypeError(argument, value, "expected a sequence of sequences", f"pass e.g. {example}")
    return tuple(tuple(v) for v in value)


def _axis_of(mesh: DeviceMesh, axis: Any, argument: str, value: Any) -> int:
    """``mesh.axis_index(axis)``, reporting a bad axis as a bad ``argument``."""
    try:
        return mesh.axis_index(axis)
    except (MeshError, ArgumentTypeError) as err:
        raise err.for_argument(argument, value, problem_prefix=f"axis={axis!r}: ") from None


def _validate_bound(mesh: DeviceMesh, dim_axes: tuple[tuple[int, ...], ...], partial: tuple[Any, ...]) -> None:
    if len(partial) != mesh.ndim:
        raise LayoutError("partial", partial, f"needs one entry per mesh dim ({mesh.ndim})", "pad with None")
    _check_partial_table(partial, partial)
    used: dict[int, int] = {}
    for dim, axes in enumerate(dim_axes):
        for a in axes:
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < mesh.ndim:
                raise LayoutError(
                    "dim_axes",
                    dim_axes,
                    f"tensor dim {dim} names {a!r}, not a mesh dim of a {mesh.ndim}-d mesh",
                    f"list mesh dims 0..{mesh.ndim - 1} per tensor dim, e.g. ((0,), ())",
                )
            if a in used:
                name = mesh.axis_names[a]
                raise LayoutError(
                    "placements",
                    tuple(tuple(mesh.axis_names[x] for x in ax) or "None" for ax in dim_axes),
                    f"mesh axis {name!r} splits tensor dims {used[a]} and {dim}; one axis can split one dim only",
                    f"use {name!r} on a single tensor dim",
                )
            used[a] = dim
    for a, op in enumerate(partial):
        if op and a in used:
            raise LayoutError(
                "partial",
                partial,
                f"mesh axis {mesh.axis_names[a]!r} both splits tensor dim {used[a]} and is Partial({op})",
                "a mesh dim is either Shard, Replicate or Partial",
            )


def iter_layouts(mesh: DeviceMesh, ndim: int, *, partial_ops: Sequence[ReduceOp] = ()) -> list[Layout]:
    """Every bound layout of an ``ndim``-d tensor on ``mesh``: each mesh axis unused, or
    splitting one tensor dim (all orders of axes on a dim), or Partial with one of
    ``partial_ops`` (one op per layout). For exhaustive tests and benchmarks."""
    choices: list[Any] = [None, *range(ndim), *(("P",) if partial_ops else ())]
    layouts: list[Layout] = []
    for assignment in itertools.product(choices, repeat=mesh.ndim):
        groups: list[list[int]] = [[] for _ in range(ndim)]
        for axis, choice in enumerate(assignment):
            if isinstance(choice, int):
                groups[choice].append(axis)
        orders = [list(itertools.permutations(g)) for g in groups]
        ops = partial_ops if "P" in assignment else (None,)
        for dim_axes in itertools.product(*orders):
            for op in ops:
                table = tuple(op if c == "P" else None for c in assignment)
                layouts.append(Layout(mesh, dim_axes, table))
    return layouts
