"""DeviceMesh: an n-d array of ranks with named axes, mapped onto a ``jax.sharding.Mesh``.

Rank ``r`` is ``jax.devices()[r]``; ranks are laid out row-major, as in torch and JAX.
Methods that answer "for the calling rank" take ``rank=``; by default the calling rank is
the first rank of the mesh (in ``rank_list`` order) whose device belongs to this process.

Axis types: :meth:`DeviceMesh.to_jax` builds a mesh with ``AxisType.Explicit`` axes by
default, because only explicit axes carry ``PartitionSpec(unreduced=...)`` (the native
form of ``Partial(sum)``) and ``jax.sharding.reshard``. A mesh made from an Auto JAX mesh
(:meth:`DeviceMesh.from_jax`) or with ``axis_types="auto"`` keeps Auto axes: everything
works the same, ``Partial(sum)`` is then carried like the other reduce ops. Plain JAX
model code, which Explicit axes refuse where a sharding is ambiguous (``table[idx]``),
runs on the default mesh through :func:`placements2jax.model_arrays` (the arrays on the
mesh's Auto twin; docs/training.md, Explicit or Auto axes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import weakref
from dataclasses import dataclass
from functools import cached_property, wraps
from typing import Any, Literal, TypeAlias, overload

import jax
import numpy as np
from jax.sharding import AxisType

from .caches import cached
from .errors import ArgumentTypeError, MeshError
from .foreign import convert_mesh

__all__ = ["DeviceMesh", "MeshGroup", "init_device_mesh", "as_device_mesh", "Axis"]

Axis: TypeAlias = str | int
AxisTypeLike: TypeAlias = Literal["explicit", "auto"] | AxisType
Names: TypeAlias = "Sequence[str] | str"

_AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


@dataclass(frozen=True)
class MeshGroup:
    """A communication group: the ranks that vary along ``axis_names`` with the other
    coordinates fixed. Inside ``jax.shard_map`` over ``DeviceMesh.to_jax()``, pass
    ``axis_names`` as the ``axis_name`` of ``jax.lax.psum`` and the other collectives."""

    axis_names: tuple[str, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.axis_names, tuple) or not all(isinstance(n, str) for n in self.axis_names):
            raise ArgumentTypeError("axis_names", self.axis_names, "expected a tuple of axis names", 'pass e.g. ("dp",)')
        if not isinstance(self.ranks, tuple) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in self.ranks
        ):
            raise ArgumentTypeError("ranks", self.ranks, "expected a tuple of int ranks", "pass e.g. (0, 1)")

    @property
    def size(self) -> int:
        return len(self.ranks)


class DeviceMesh:
    """An n-d array of ranks with one unique name per axis (torch's ``DeviceMesh``).

    Two calls build one:

    * ``DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))`` (the RFC's): a 2x2 mesh whose rows
      are named ``dp`` and columns ``tp``;
    * ``DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))`` (torch's): the
      device type (``"cpu"``, ``"cuda"``, ``"tpu"``) must be that of JAX's backend, since
      rank ``r`` is ``jax.devices()[r]``; the ranks may be a nested list, a NumPy array or
      a torch tensor.

    The names are torch's ``mesh_dim_names`` (positional in the first call, the keyword in
    both); the RFC's ``alias_name=`` and JAX's ``axis_names=`` are accepted as the same
    keyword (see the spellings section below). Without names the axes are called ``dim0``,
    ``dim1``, ...

    Meshes are interned, as JAX interns ``jax.sharding.Mesh``: building the same mesh
    twice (same ranks, names and axis types) gives the same object, so equality and
    hashing are by identity.
    """

    _interned: weakref.WeakValueDictionary[tuple[Any, ...], DeviceMesh] = weakref.WeakValueDictionary()

    @overload
    def __new__(
        cls,
        mesh: Any,
        mesh_dim_names: Names | None = None,
        /,
        *,
        axis_types: AxisTypeLike | Sequence[AxisTypeLike] = "explicit",
        alias_name: Names | None = None,
        axis_names: Names | None = None,
    ) -> DeviceMesh: ...

    @overload
    def __new__(
        cls,
        device_type: str,
        mesh: Any,
        /,
        *,
        mesh_dim_names: Names | None = None,
        axis_types: AxisTypeLike | Sequence[AxisTypeLike] = "explicit",
    ) -> DeviceMesh: ...

    def __new__(
        cls,
        first: Any,
        second: Any = None,
        /,
        *,
        mesh_dim_names: Names | None = None,
        axis_types: AxisTypeLike | Sequence[AxisTypeLike] = "explicit",
        alias_name: Names | None = None,
        axis_names: Names | None = None,
    ) -> DeviceMesh:
        if isinstance(first, str):  # torch's DeviceMesh(device_type, mesh, *, mesh_dim_names=...)
            _check_device_type(first)
            if second is None:
                raise MeshError(
                    "mesh",
                    None,
                    "torch's form needs the ranks after the device type",
                    f"pass e.g. DeviceMesh({first!r}, [0, 1])",
                )
            mesh, positional = second, None
        else:
            mesh, positional = first, second
        ranks = _validate_ranks(mesh)
        spellings = {"mesh_dim_names": positional, "mesh_dim_names=": mesh_dim_names, "alias_name": alias_name}
        argument, names = _one_spelling(spellings | {"axis_names": axis_names})
        names = _validate_names(names, ranks.ndim, argument)
        types = _validate_axis_types(axis_types, ranks.ndim)
        key = (ranks.shape, tuple(int(r) for r in ranks.flat), names, types)
        self = cls._interned.get(key)
        if self is None:
            self = object.__new__(cls)
            self._ranks, self._names, self._axis_types = ranks, names, types  # the rank array is read-only
            cls._interned[key] = self
        return self

    def __copy__(self) -> DeviceMesh:
        return self

    def __deepcopy__(self, memo: Any) -> DeviceMesh:
        return self

    def __repr__(self) -> str:
        """The call that builds this mesh: ``DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))``,
        or, for more than 16 ranks numbered 0..N-1 in row-major order,
        ``init_device_mesh((16, 16), mesh_dim_names=('dp', 'tp'))`` (evaluating it gives this mesh)."""
        tail = f"mesh_dim_names={self._names!r}"
        types = tuple(t.name.lower() for t in self._axis_types)
        if set(types) != {"explicit"}:
            tail += f", axis_types={types[0] if len(set(types)) == 1 else types!r}"
        if self._ranks.size > 16 and self.rank_list == tuple(range(self._ranks.size)):
            return f"init_device_mesh({self.shape!r}, {tail})"
        return f"DeviceMesh({self._ranks.tolist()!r}, {tail})"

    def __str__(self) -> str:
        """The mesh's label in reports: ``dp=4 x tp=2`` (axis names and sizes)."""
        return " x ".join(f"{name}={size}" for name, size in zip(self._names, self.shape))

    def __reduce__(self) -> tuple[Any, ...]:
        types = tuple(t.name.lower() for t in self._axis_types)
        return (_rebuild, (self._ranks.tolist(), self._names, types))

    # -- properties ------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._ranks.shape

    @property
    def ndim(self) -> int:
        return self._ranks.ndim

    def size(self, axis: Axis | None = None) -> int:
        """Number of ranks, in the whole mesh or along one axis (torch's ``size(mesh_dim)``)."""
        return self._ranks.size if axis is None else self.shape[self.axis_index(axis)]

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names (JAX's ``Mesh.axis_names``); see also the spellings below."""
        return self._names

    @property
    def axis_types(self) -> tuple[AxisType, ...]:
        return self._axis_types

    @property
    def is_explicit(self) -> bool:
        """True when every axis is ``AxisType.Explicit`` (``unreduced`` is available)."""
        return all(t == AxisType.Explicit for t in self._axis_types)

    @property
    def rank_list(self) -> tuple[int, ...]:
        return tuple(int(r) for r in self._ranks.flat)

    @property
    def mesh(self) -> np.ndarray:
        """The rank array (a read-only view)."""
        return self._ranks

    @cached_property
    def devices(self) -> np.ndarray:
        """The JAX devices, same shape as :attr:`mesh`."""
        all_devices = jax.devices()
        return np.vectorize(lambda r: all_devices[r], otypes=[object])(self._ranks)

    def device(self, rank: int) -> jax.Device:
        self.check_rank(rank)
        return jax.devices()[rank]

    # -- JAX -------------------------------------------------------------------------
    def to_jax(self) -> jax.sharding.Mesh:
        """The ``jax.sharding.Mesh`` with the same names, devices and axis types (cached)."""
        return self._jax_mesh

    @cached_property
    def _jax_mesh(self) -> jax.sharding.Mesh:
        return jax.sharding.Mesh(self.devices, self._names, axis_types=self._axis_types)

    @classmethod
    def from_jax(cls, mesh: jax.sharding.Mesh) -> DeviceMesh:
        """The DeviceMesh of a JAX mesh, keeping its names and axis types."""
        if not isinstance(mesh, jax.sharding.Mesh):
            raise ArgumentTypeError(
                "mesh", mesh, "expected a jax.sharding.Mesh", "pass e.g. jax.make_mesh((4, 2), ('dp', 'tp'))"
            )
        return _from_jax(mesh)

    # -- axes and ranks --------------------------------------------------------------
    def axis_index(self, axis: Axis) -> int:
        """The position of a mesh axis given by name or by (possibly negative) index."""
        if isinstance(axis, str):
            if axis not in self._names:
                raise MeshError(
                    "axis", axis, f"no such mesh axis; the axes are {self._names}", "use one of those names"
                )
            return self._names.index(axis)
        if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
            if not -self.ndim <= axis < self.ndim:
                raise MeshError(
                    "axis",
                    axis,
                    f"out of range for a {self.ndim}-d mesh",
                    f"use an index in [{-self.ndim}, {self.ndim}) or a name from {self._names}",
                )
            return int(axis) % self.ndim
        raise ArgumentTypeError("axis", axis, "expected an axis name or index", f"use one of {self._names}")

    def axis_name(self, axis: Axis) -> str:
        return self._names[self.axis_index(axis)]

    def check_rank(self, rank: Any) -> int:
        """``rank`` as an int, if it is a rank of this mesh (else a MeshError)."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise ArgumentTypeError("rank", rank, "expected an int rank", f"use one of {self.rank_list}")
        if int(rank) not in self.rank_positions:
            raise MeshError("rank", rank, "not a rank of this mesh", f"use one of {self.rank_list}")
        return int(rank)

    @cached_property
    def rank_positions(self) -> dict[int, tuple[int, ...]]:
        """Every rank of the mesh and its coordinate (index along each axis)."""
        return {int(r): tuple(int(i) for i in idx) for idx, r in np.ndenumerate(self._ranks)}

    def calling_rank(self) -> int:
        """The first rank of this mesh whose device belongs to this process."""
        process = jax.process_index()
        devices = jax.devices()
        for rank in self.rank_list:
            if devices[rank].process_index == process:
                return rank
        raise MeshError(
            "mesh",
            self,
            f"no rank of this mesh is on process {process}",
            "pass rank= explicitly, or build the mesh over devices of this process",
        )

    def resolve_rank(self, rank: int | None) -> int:
        """``rank`` checked, or the calling rank for ``None``."""
        return self.calling_rank() if rank is None else self.check_rank(rank)

    def get_coordinate(self, rank: int | None = None) -> tuple[int, ...]:
        """The rank's index along every mesh axis."""
        return self.rank_positions[self.resolve_rank(rank)]

    def get_local_rank(self, axis: Axis, rank: int | None = None) -> int:
        """The rank's coordinate along ``axis`` (torch's ``get_local_rank(mesh_dim)``)."""
        return self.get_coordinate(rank)[self.axis_index(axis)]


    def get_rank_list_along_axis(self, axis: Axis, rank: int | None = None) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axis``, in axis order."""
        return list(self.get_group(axis, rank).ranks)

    def get_group(self, axis: Axis | Sequence[Axis] | None = None, rank: int | None = None) -> MeshGroup:
        """The communication group of ``rank`` along one axis, several axes, or (``None``)
        the whole mesh: the ranks and the axis names for collectives in ``shard_map``."""
        axes = self._axes_tuple(axis)
        sub = self._sub_ranks(axes, self.get_coordinate(rank))
        return MeshGroup(tuple(self._names[a] for a in axes), tuple(int(r) for r in sub.flat))

    def _axes_tuple(self, axis: Axis | Sequence[Axis] | None) -> tuple[int, ...]:
        if axis is None:
            return tuple(range(self.ndim))
        if isinstance(axis, (str, int, np.integer)):
            return (self.axis_index(axis),)
        if not isinstance(axis, Sequence):
            raise ArgumentTypeError(
                "axis", axis, "expected an axis name or index, or a sequence of them", f"use names from {self._names}"
            )
        axes = tuple(self.axis_index(a) for a in axis)
        if len(set(axes)) != len(axes):
            raise MeshError("axis", axis, "an axis is named twice", "name each mesh axis at most once")
        if not axes:
            raise MeshError("axis", axis, "no axis given", "name at least one mesh axis")
        return axes

    def _sub_ranks(self, axes: tuple[int, ...], coordinate: tuple[int, ...]) -> np.ndarray:
        index = tuple(slice(None) if i in axes else c for i, c in enumerate(coordinate))
        kept = [i for i in range(self.ndim) if i in axes]
        return np.transpose(self._ranks[index], [kept.index(a) for a in axes])

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh of the calling rank along one axis name or a tuple of names."""
        return self.submesh(names)

    def submesh(self, names: str | Sequence[str], rank: int | None = None) -> DeviceMesh:
        """The sub-mesh of ``rank`` (default: the calling rank) along the named axes."""
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
            raise ArgumentTypeError(
                "names", names, "a sub-mesh is selected by axis names", f"use names from {self._names}"
            )
        axes = self._axes_tuple(tuple(names))
        sub = self._sub_ranks(axes, self.get_coordinate(rank))
        types = tuple(self._axis_types[a].name.lower() for a in axes)
        return DeviceMesh(sub, tuple(names), axis_types=types)  # type: ignore[arg-type]

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """The 1-D mesh over all ranks in row-major order, named by joining names with "_"."""
        types = {t.name.lower() for t in self._axis_types}
        axis_type = "explicit" if types == {"explicit"} else "auto"
        return DeviceMesh(self._ranks.reshape(-1), (name or "_".join(self._names),), axis_types=axis_type)  # type: ignore[arg-type]

    # -- the MindSpore and torch spellings (public aliases, kept in this one place) --------
    # The constructor takes the names as torch's mesh_dim_names (positional or keyword), the
    # RFC's alias_name= or JAX's axis_names= (one of them; _one_spelling); torch's first
    # argument, the device type, is checked by _check_device_type.
    @property
    def alias_name(self) -> tuple[str, ...]:
        """MindSpore's name for :attr:`axis_names`."""
        return self._names

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """torch's name for :attr:`axis_names`."""
        return self._names

    def get_device_num_along_axis(self, axis: Axis) -> int:
        """MindSpore's name for :meth:`size` of one axis."""
        return self.size(axis)

    def get_rank(self) -> int:
        """torch's ``get_rank()``, "the current global rank".

        torch runs one process per rank, so that is the process's rank. A JAX process
        drives several devices (a single controller drives them all), so here it is the
        rank this process acts as on this mesh: the first rank whose device belongs to
        the process (:meth:`calling_rank`) -- 0 for one process over ranks 0..N-1. As in
        torch, :meth:`get_coordinate` and :meth:`get_local_rank` default to it."""
        return self.calling_rank()

    # get_global_shape (the RFC's DeviceMesh method) needs layouts: placements2jax.layout
    # installs it, so this module does not import the one after it.


def shard_map(f: Callable[..., Any], *, mesh: jax.sharding.Mesh, **kwargs: Any) -> Callable[..., Any]:
    """``jax.shard_map(f, mesh=mesh, **kwargs)`` for the library's own per-rank code, also
    where the caller's context mesh (``jax.set_mesh``) is another one. JAX workaround (jax
    0.10.2): a shard_map over a mesh other than the context's is refused ("The context mesh
    ... should match the mesh passed to shard_map": the operators, apply's ``"ops"`` program
    and a partial's local form failed inside ``jax.set_mesh`` of the DTensors' mesh's Auto
    twin), so there it is traced under ``jax.sharding.use_abstract_mesh`` of its own mesh,
    which JAX allows under ``jax.jit`` too (``set_mesh`` it does not)."""
    mapped = jax.shard_map(f, mesh=mesh, **kwargs)

    @wraps(f)
    def run(*args: Any) -> Any:
        context = jax.sharding.get_abstract_mesh()
        if context.empty or context == mesh.abstract_mesh:
            return mapped(*args)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return mapped(*args)

    return run


def init_device_mesh(
    mesh_shape: Sequence[int] | str,
    alias_name: Sequence[str] | Sequence[int] | None = None,
    *,
    mesh_dim_names: Sequence[str] | None = None,
    axis_types: AxisTypeLike | Sequence[AxisTypeLike] = "explicit",
) -> DeviceMesh:
    """A mesh of ranks ``0..N-1`` in row-major order.

    Also accepts torch's call ``init_device_mesh("cuda", (2, 4), mesh_dim_names=(...))``:
    the device type is taken from JAX's default backend and the string is ignored.
    """
    if isinstance(mesh_shape, str):
        mesh_shape, alias_name = alias_name, None  # type: ignore[assignment]
    if mesh_shape is None or isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence):
        raise ArgumentTypeError("mesh_shape", mesh_shape, "expected a tuple of ints", "pass e.g. (4, 2)")
    if not mesh_shape or not all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0 for n in mesh_shape
    ):
        raise MeshError(
            "mesh_shape", mesh_shape, "a mesh needs at least one axis and every axis size a positive int", "pass e.g. (4, 2)"
        )
    total = int(np.prod(mesh_shape))
    if total > jax.device_count():
        raise MeshError(
            "mesh_shape",
            tuple(mesh_shape),
            f"needs {total} devices, JAX sees {jax.device_count()}",
            "use a smaller mesh, or start JAX with more devices",
        )
    ranks = np.arange(total).reshape(tuple(int(n) for n in mesh_shape))
    return DeviceMesh(ranks, alias_name, mesh_dim_names=mesh_dim_names, axis_types=axis_types)  # type: ignore[arg-type]


def as_device_mesh(mesh: Any, argument: str = "device_mesh") -> DeviceMesh:
    """``mesh`` itself if it is a :class:`DeviceMesh`; the DeviceMesh of a
    ``jax.sharding.Mesh`` or of another library's mesh (e.g. torch's ``DeviceMesh``,
    through :mod:`placements2jax.interop`); else :class:`ArgumentTypeError`."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return DeviceMesh.from_jax(mesh)
    converted = convert_mesh(mesh)
    if converted is None:
        raise ArgumentTypeError(
            argument, mesh, "expected a placements2jax.DeviceMesh", "build one with init_device_mesh(...)"
        )
    return converted


@cached(maxsize=256)
def _from_jax(mesh: jax.sharding.Mesh) -> DeviceMesh:
    index = {d: i for i, d in enumerate(jax.devices())}
    ranks = np.vectorize(lambda d: index[d], otypes=[np.int64])(mesh.devices)
    types = tuple(t.name.lower() for t in mesh.axis_types)
    return DeviceMesh(ranks, tuple(mesh.axis_names), axis_types=types)  # type: ignore[arg-type]


def _rebuild(ranks: list[Any], names: tuple[str, ...], types: tuple[str, ...]) -> DeviceMesh:
    return DeviceMesh(ranks, names, axis_types=types)  # type: ignore[arg-type]


def _validate_ranks(mesh: Any) -> np.ndarray:
    if isinstance(mesh, DeviceMesh):
        mesh = mesh.mesh
    try:
        ranks = np.asarray(mesh)
    except (ValueError, TypeError) as err:
        raise MeshError("mesh", mesh, f"not a rectangular array of ranks ({err})", "pass e.g. [[0, 1], [2, 3]]") from None
    if ranks.dtype == object or ranks.dtype.kind not in "iu":
        if ranks.dtype.kind == "f" and ranks.size and np.all(ranks == np.round(ranks)):
            ranks = ranks.astype(np.int64)
        else:
            raise MeshError("mesh", mesh, "ranks must be ints in a rectangular array", "pass e.g. [[0, 1], [2, 3]]")
    if ranks.ndim == 0 or ranks.size == 0:
        raise MeshError("mesh", mesh, "a mesh needs at least one axis and one rank", "pass e.g. [0, 1, 2, 3]")
    ranks = ranks.astype(np.int64)
    flat = ranks.reshape(-1)
    if len(set(flat.tolist())) != flat.size:
        seen: set[int] = set()
        duplicate = next(r for r in flat.tolist() if r in seen or seen.add(r))  # type: ignore[func-returns-value]
        raise MeshError("mesh", mesh, f"rank {duplicate} appears more than once", "list every rank once")
    count = jax.device_count()
    bad = [r for r in flat.tolist() if not 0 <= r < count]
    if bad:
        raise MeshError(
            "mesh",
            mesh,
            f"rank {bad[0]} does not exist: JAX sees {count} devices (ranks 0..{count - 1})",
            "use ranks below jax.device_count(), or start JAX with more devices",
        )
    ranks.setflags(write=False)
    return ranks


_TORCH_DEVICE_TYPES = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}  # torch's name -> JAX's backend


def _check_device_type(device_type: str) -> None:
    """torch's device type must name JAX's backend (rank r is jax.devices()[r])."""
    backend = jax.default_backend()
    torch_name = {"gpu": "cuda"}.get(backend, backend)
    expected = _TORCH_DEVICE_TYPES.get(device_type.lower())
    if expected is None:
        raise MeshError(
            "device_type",
            device_type,
            f"not a device type ({', '.join(repr(t) for t in _TORCH_DEVICE_TYPES)})",
            f"pass {torch_name!r}, the device type of jax.devices()",
        )
    if expected != backend:
        raise MeshError(
            "device_type",
            device_type,
            f"JAX runs on {backend!r} devices here, and rank r is jax.devices()[r]",
            f"pass {torch_name!r}, or start JAX on {device_type!r} devices",
        )


def _one_spelling(given: Mapping[str, Any]) -> tuple[str, Any]:
    """The axis names and the argument that gave them, from the spellings the constructor
    takes (keys: the argument's name, ``"mesh_dim_names"`` for the positional one first),
    refusing two that differ."""
    spelled = [(k, v) for k, v in given.items() if v is not None]
    if not spelled:
        return "mesh_dim_names", None
    (first, names), *others = spelled
    for other, value in others:
        if _as_name_tuple(value) != _as_name_tuple(names):
            raise MeshError(
                other.rstrip("="),
                value,
                f"differs from the names given {'positionally' if first == 'mesh_dim_names' else 'as ' + first}, "
                f"{names!r}",
                "give the axis names once",
            )
    return first.rstrip("="), names


def _as_name_tuple(names: Any) -> Any:
    return (names,) if isinstance(names, str) else tuple(names) if isinstance(names, Sequence) else names


def _validate_names(names: Sequence[str] | str | None, ndim: int, argument: str) -> tuple[str, ...]:
    if names is None:
        return tuple(f"dim{i}" for i in range(ndim))
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, Sequence):
        raise ArgumentTypeError(argument, names, "expected a tuple of axis names", 'pass e.g. ("dp", "tp")')
    names = tuple(names)
    for name in names:
        if not isinstance(name, str):
            raise ArgumentTypeError(argument, names, f"axis name {name!r} is not a string", 'pass e.g. ("dp", "tp")')
        if not name or name == "None":
            raise MeshError(
                argument, names, f"{name!r} cannot name a mesh axis (\"None\" means unsharded)", "choose another name"
            )
    if len(names) != ndim:
        raise MeshError(
            argument, names, f"{len(names)} names for a {ndim}-d mesh", f"give exactly {ndim} names, one per mesh axis"
        )
    if len(set(names)) != len(names):
        raise MeshError(argument, names, "axis names must be unique", "give every mesh axis its own name")
    return names


def _validate_axis_types(axis_types: Any, ndim: int) -> tuple[AxisType, ...]:
    if isinstance(axis_types, (str, AxisType)):
        axis_types = (axis_types,) * ndim
    if not isinstance(axis_types, Sequence) or len(axis_types) != ndim:
        raise MeshError(
            "axis_types", axis_types, f"need one axis type per mesh axis ({ndim})", 'pass "explicit" or "auto"'
        )
    result = []
    for t in axis_types:
        if isinstance(t, AxisType) and t in (AxisType.Explicit, AxisType.Auto):
            result.append(t)
        elif isinstance(t, str) and t.lower() in _AXIS_TYPES:
            result.append(_AXIS_TYPES[t.lower()])
        else:
            raise MeshError("axis_types", axis_types, f"unsupported axis type {t!r}", 'use "explicit" or "auto"')
    return tuple(result)
