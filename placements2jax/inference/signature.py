"""The value types of signature inference: tensors, 1-D signatures, redistribution plans,
candidates and the chosen signature. Pure data, no JAX calls.

Vocabulary (OneFlow's SBP signature, in torch's words): a *1-D signature* of an op says,
for one mesh dim, one placement per input and per output, such that running the op on
every rank's local data gives the outputs' local data. An *N-D candidate* picks one 1-D
signature per mesh dim (the direct product) and so fixes a layout for every input and
output. The *signature* inference chooses is the best-ranked candidate.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from fractions import Fraction
from typing import Any

import jax
import numpy as np

from ..caches import Memo, cached, hash_once, without_hash
from ..errors import ArgumentTypeError, InferenceError, LayoutError, ShapeError
from ..layout import (
    Layout,
    MeshPlacements,
    as_shape,  # the one shape validator of the package
)
from ..mesh import DeviceMesh, as_device_mesh
from ..placements import Partial, Placement, Replicate, Shard, format_placements
from .cost import COMMUNICATING, block_bytes
from .table import format_bytes, format_table

__all__ = [
    "Aval",
    "Candidate",
    "OneDSig",
    "RedistributePlan",
    "RedistributeStep",
    "SharedRoutes",
    "Signature",
    "TensorSpec",
    "FlatInputs",
    "as_tensor_spec",
    "as_tensor_specs",
    "flatten_inputs",
    "constant_layout",
    "constant_layouts",
    "is_layout_leaf",
    "is_tensor_leaf",
    "output_constraints",
    "placement_on",
]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Aval:
    """The global shape and dtype of a logical tensor (no layout)."""

    shape: Shape
    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", as_shape(self.shape, "shape"))
        object.__setattr__(self, "dtype", _as_dtype(self.dtype))

    __hash__ = hash_once()

    def __getstate__(self) -> dict[str, Any]:
        return without_hash(self)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def is_key(self) -> bool:
        """An array of typed PRNG keys (an extended dtype, ``key<fry>``): Replicate only.
        A key is no number: a partial of keys has no sum, and every rank draws its bits
        from the whole key (issue 15: keys are always Replicate), whatever placements a
        shape rule (a slice, a reshape, a scan's slicing) would allow its array."""
        return not isinstance(self.dtype, np.dtype)

    def __str__(self) -> str:
        return f"{self.dtype.name}{list(self.shape)}"


@dataclass(frozen=True)
class TensorSpec:
    """A logical tensor as inference sees it: global shape, dtype and a bound layout.

    DTensors, ``(shape, dtype, layout)`` tuples and any object with ``.shape``,
    ``.dtype`` and ``.layout`` convert to it with :func:`as_tensor_spec`.
    """

    shape: Shape
    dtype: np.dtype
    layout: Layout

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", as_shape(self.shape, "shape"))
        object.__setattr__(self, "dtype", _as_dtype(self.dtype))
        if not isinstance(self.layout, (Layout, MeshPlacements)):
            raise ArgumentTypeError("layout", self.layout, "expected a placements2jax.Layout", "pass Layout(...)")
        layout = self.layout.bind(len(self.shape)) if isinstance(self.layout, MeshPlacements) else self.layout
        if layout.ndim != len(self.shape):
            raise LayoutError(
                "layout", layout, f"is for {layout.ndim} dims but the shape {self.shape} has {len(self.shape)}",
                "pass a layout with one entry per tensor dim",
            )
        if layout.is_strided:  # a strided dim needs an even extent (ShapeError naming the fix)
            layout.check_shape(self.shape, "shape")
        object.__setattr__(self, "layout", layout)

    __hash__ = hash_once()

    def __getstate__(self) -> dict[str, Any]:
        return without_hash(self)

    @classmethod
    def of(cls, aval: Aval, layout: Layout) -> TensorSpec:
        """``TensorSpec(aval.shape, aval.dtype, layout)`` without checking again what
        ``aval`` (a checked shape and dtype) and a plain layout of its rank already are
        (the walker makes one per equation output, each walk); any other layout is checked.
        Those are memoized per (aval, layout) (:data:`_SPECS`): the walks of a predict give
        equal values the same spec, whose hash is then computed once and whose equality in
        a cache key's comparison is identity."""
        if not isinstance(layout, Layout) or layout.is_strided or layout.ndim != len(aval.shape):
            return cls(aval.shape, aval.dtype, layout)
        key = (aval, layout)
        spec = _SPECS.get(key)
        if spec is None:
            spec = object.__new__(cls)
            spec.__dict__.update(shape=aval.shape, dtype=aval.dtype, layout=layout, aval=aval)
            _SPECS.remember(key, spec)
        return spec

    @cached_property
    def aval(self) -> Aval:
        """Its Aval (built once: ranking and the walks read it per op)."""
        return Aval(self.shape, self.dtype)

    @property
    def mesh(self) -> DeviceMesh:
        return self.layout.mesh

    def __str__(self) -> str:
        return f"{self.aval} {str(self.layout)}"


# TensorSpec.of's specs, per (aval, layout)
_SPECS = Memo(65536)


def as_tensor_spec(value: Any, mesh: DeviceMesh | None = None, argument: str = "input") -> TensorSpec:
    """Convert ``(shape, dtype, layout)``, a :class:`TensorSpec`, or any object with
    ``.shape``, ``.dtype`` and a placements2jax ``.layout`` (a DTensor) to a TensorSpec.

    ``layout`` may also be placements (``"S(0),R"``, ``(Shard(0), Replicate())``, alias
    form) when ``mesh`` is given. The layout must be on ``mesh`` when both are given.
    """
    if isinstance(value, TensorSpec):
        spec = value
    else:
        if isinstance(getattr(value, "layout", None), (Layout, MeshPlacements)):
            shape, dtype, layout = value.shape, value.dtype, value.layout
        elif isinstance(value, (tuple, list)) and len(value) == 3:
            shape, dtype, layout = value
        else:
            raise ArgumentTypeError(
                argument,
                value,
                "expected (shape, dtype, layout) or an object with .shape, .dtype and .layout (a DTensor)",
                "pass e.g. ((8, 4), jnp.float32, Layout.from_device_mesh(mesh)('S(0),R'))",
            )
        if not isinstance(layout, (Layout, MeshPlacements)):
            if mesh is None:
                raise ArgumentTypeError(
                    argument, value, "placements without a mesh", "pass a Layout, or pass mesh= as well"
                )
            layout = Layout.from_device_mesh(mesh)(layout)
        try:
            spec = TensorSpec(tuple(shape), dtype, layout)
        except (LayoutError, ArgumentTypeError, ShapeError) as err:
            raise err.for_argument(argument, value) from None
    if mesh is not None and spec.mesh != mesh:
        raise InferenceError(
            argument, spec.layout, f"is on {spec.mesh!r}, not on {mesh!r}", "redistribute it onto the op's mesh first"
        )
    return spec


def as_tensor_specs(
    values: Sequence[Any], mesh: DeviceMesh | None, argument: str = "inputs"
) -> tuple[tuple[TensorSpec, ...], DeviceMesh]:
    """All of an op's inputs as TensorSpecs on their one mesh (or ``mesh``), and that mesh.

    Besides what :func:`as_tensor_spec` takes, constants (Python or NumPy scalars,
    NumPy or JAX arrays without a placements2jax layout) are Replicate on that mesh.
    """
    mesh = None if mesh is None else as_device_mesh(mesh, "mesh")  # the callers' keyword: predict(..., mesh=)
    specs: list[TensorSpec | None] = [
        None if _is_constant(v) else as_tensor_spec(v, mesh, f"{argument}[{i}]") for i, v in enumerate(values)
    ]
    meshes = {s.mesh for s in specs if s is not None} | ({mesh} if mesh is not None else set())
    if len(meshes) > 1:
        raise InferenceError(
            argument, [str(s.mesh) for s in specs if s is not None], "the tensors are on different meshes",
            "redistribute them onto one mesh (cross-mesh ops are not defined)",
        )
    if not meshes:
        raise InferenceError(argument, tuple(values), "no tensor with a layout and no mesh given", "pass mesh=")
    common = meshes.pop()
    result = tuple(
        spec if spec is not None else _constant_spec(value, common) for spec, value in zip(specs, values)
    )
    return result, common


def _is_constant(value: Any) -> bool:
    if isinstance(value, (bool, int, float, complex, np.generic, np.ndarray)):
        return True
    return isinstance(value, jax.Array) and not isinstance(getattr(value, "layout", None), Layout)


def _constant_spec(value: Any, mesh: DeviceMesh) -> TensorSpec:
    """A constant as a tensor: a ``jax.Array`` with a ``NamedSharding`` on ``mesh`` keeps
    its layout, everything else (PRNG keys included) is Replicate."""
    shape = np.shape(value)
    if isinstance(value, jax.Array):
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and _same_mesh(sharding.mesh, mesh):
            return TensorSpec(shape, value.dtype, Layout.from_partition_spec(mesh, sharding.spec, len(shape)))
        return TensorSpec(shape, value.dtype, Layout(mesh, ((),) * len(shape)))
    return TensorSpec(shape, jax.numpy.result_type(value), Layout(mesh, ((),) * len(shape)))


def _same_mesh(jax_mesh: Any, mesh: DeviceMesh) -> bool:
    return (
        tuple(jax_mesh.axis_names) == mesh.axis_names
        and tuple(jax_mesh.axis_sizes) == mesh.shape
        and [d.id for d in jax_mesh.devices.flat] == [d.id for d in mesh.devices.flat]
    )


def _is_spec_tuple(value: Any) -> bool:
    """``(shape, dtype, layout)``: a shape of ints, a dtype (not an array), a layout or placements."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        return False
    shape, dtype, layout = value
    # the shape first: cheap, and it rules out the tuples of arguments flattening meets (a 3-tuple of pytrees)
    if not isinstance(shape, (tuple, list)) or not all(isinstance(n, (int, np.integer)) for n in shape):
        return False
    return isinstance(layout, (Layout, MeshPlacements, str, tuple, list)) and _is_dtype_like(dtype)


def _is_extended(dtype: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except (TypeError, ValueError):
        return False


def _is_dtype_like(value: Any) -> bool:
    if isinstance(value, (np.ndarray, np.generic, jax.Array, bool, int, float, complex)) or value is None:
        return False
    return _numeric_dtype(value) is not None


def is_tensor_leaf(value: Any) -> bool:
    """A leaf of an input pytree: a TensorSpec, a ``(shape, dtype, layout)`` tuple, or
    anything with a placements2jax ``.layout`` (a DTensor, not flattened further)."""
    return isinstance(value, TensorSpec) or _own_layout(value) is not None or _is_spec_tuple(value)


def _own_layout(value: Any) -> Layout | None:
    """``value.layout`` when ``value`` itself has one (a DTensor), not when the attribute is
    reached through ``__getattr__`` delegation: a Flax NNX Variable (an ``nnx.State`` leaf)
    wrapping a DTensor forwards ``.layout`` to it, but is a pytree node whose child is the
    tensor, so that flattening must go on into it (else functions get the bare tensor
    without its Variable)."""
    layout = getattr(value, "layout", None)
    if not isinstance(layout, Layout):
        return None
    if _class_has_layout(type(value)):  # a DTensor: found without inspect (most of a cached predict's time)
        return layout
    try:
        inspect.getattr_static(value, "layout")
    except AttributeError:
        return None
    return layout


@cached(maxsize=256)
def _class_has_layout(cls: type) -> bool:
    """Whether ``cls`` itself defines ``layout`` (a class attribute or property somewhere in
    its MRO: then :func:`inspect.getattr_static` finds it on every instance). Cached per
    class: flattening asks it of every leaf, several times per predict call."""
    return any("layout" in vars(klass) for klass in cls.__mro__)


@dataclass(frozen=True)
class FlatInputs:
    """The leaves of a function's input pytrees as TensorSpecs on one mesh, their
    structure, and which leaves are Python scalars (weakly typed when traced)."""

    specs: tuple[TensorSpec, ...]
    mesh: DeviceMesh
    tree: Any
    weak: tuple[bool, ...]

    def structs(self, typed: bool = False) -> list[jax.ShapeDtypeStruct]:
        """Shape/dtype stand-ins for tracing, one per leaf; ``typed``: each with its layout
        as its sharding type too (``NamedSharding(mesh.to_jax(), partition_spec)``), as
        ``jax.jit`` types its arguments inside ``jax.set_mesh`` of an Explicit mesh."""
        return [
            jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=w, sharding=s.layout.named_sharding if typed else None)
            for s, w in zip(self.specs, self.weak)
        ]

    def call(self, fn: Any) -> Any:
        """``fn`` as a function of the flat leaves (positional arguments rebuilt)."""

        def flat_fn(*leaves: Any) -> Any:
            return fn(*jax.tree.unflatten(self.tree, leaves))

        return flat_fn


def flatten_inputs(inputs: Sequence[Any], mesh: DeviceMesh | None, argument: str = "inputs") -> FlatInputs:
    """The positional arguments ``inputs`` (pytrees) as :class:`FlatInputs`: leaves are
    tensors (:func:`is_tensor_leaf`) or constants (Python / NumPy scalars, NumPy arrays,
    ``jax.Array``s including PRNG keys, typed or raw), see :func:`as_tensor_specs`."""
    pairs, tree = jax.tree_util.tree_flatten_with_path(tuple(inputs), is_leaf=is_tensor_leaf)
    leaves = [leaf for _, leaf in pairs]
    for path, leaf in pairs:
        if hasattr(type(leaf), "checked"):  # a DTensor: its array must be its layout's (DTensor.checked)
            leaf.checked(f"{argument}{jax.tree_util.keystr(path)}")
        elif not (is_tensor_leaf(leaf) or _is_constant(leaf)):
            where = f"{argument}{jax.tree_util.keystr(path)}"
            raise ArgumentTypeError(
                where, leaf, "a leaf must be a tensor (DTensor, (shape, dtype, layout)), an array or a number",
                "pass arrays or DTensors in the pytree; bind static values with functools.partial",
            )
    specs, common = as_tensor_specs(leaves, mesh, argument)
    weak = tuple(isinstance(v, (bool, int, float, complex)) for v in leaves)
    return FlatInputs(specs, common, tree, weak)


def is_layout_leaf(value: Any) -> bool:
    """A leaf of an ``out_layouts`` pytree: None, a Layout, placements (text or a
    sequence of Placements), a TensorSpec or anything with a ``.layout`` (a DTensor)."""
    if value is None or isinstance(value, (Layout, MeshPlacements, str, TensorSpec)):
        return True
    if _own_layout(value) is not None:
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(p, Placement) for p in value)


def constant_layout(entry: Any, mesh: DeviceMesh) -> Any:
    """An ``out_layouts`` leaf, a constant (a ``jax.Array`` without a placements2jax
    layout, a NumPy array, a Python number: an input passed as "keep this input's
    layout", such as the step count ``optimizer.init(params)`` makes a plain array, in
    ``out_layouts=(params, opt_state, None)``) replaced by the layout that input has
    (its ``NamedSharding`` on ``mesh``, else Replicate: :func:`_constant_spec`); any
    other leaf as it is."""
    return _constant_spec(entry, mesh).layout if _is_constant(entry) else entry


def constant_layouts(out_layouts: Any, mesh: DeviceMesh) -> Any:
    """``out_layouts`` with each constant leaf replaced by its layout (:func:`constant_layout`)."""
    if out_layouts is None:
        return None
    return jax.tree.map(lambda entry: constant_layout(entry, mesh), out_layouts, is_leaf=is_layout_leaf)


def output_constraints(value: Any, out_tree: Any, out_avals: Sequence[Aval], mesh: DeviceMesh) -> list[Layout | None]:
    """``out_layouts`` (a pytree prefix of the outputs: per output or subtree a Layout,
    placements, anything with a ``.layout`` such as the DTensor input it should keep
    the layout of, a TensorSpec, or None = free) as one bound layout or None per flat
    output."""
    if value is None:
        return [None] * len(out_avals)
    entries, prefix = jax.tree.flatten(value, is_leaf=is_layout_leaf)
    try:
        subtrees = prefix.flatten_up_to(jax.tree.unflatten(out_tree, range(len(out_avals))))
    except (ValueError, TypeError) as err:
        raise InferenceError(
            "out_layouts", value, f"is not a pytree prefix of the outputs' structure {out_tree} ({err})",
            "give one layout (or None) per output, or per subtree of the outputs",
        ) from None
    result: list[Layout | None] = [None] * len(out_avals)
    for entry, subtree in zip(entries, subtrees):
        for i in jax.tree.leaves(subtree):
            result[i] = _output_layout(entry, out_avals[i], mesh, f"out_layouts[{i}]")
    return result


def _output_layout(entry: Any, aval: Aval, mesh: DeviceMesh, argument: str) -> Layout | None:
    if entry is None:
        return None
    if isinstance(entry, TensorSpec) or isinstance(getattr(entry, "layout", None), Layout):
        entry = entry.layout
    if isinstance(entry, (Layout, MeshPlacements)) and entry.mesh != mesh:
        raise InferenceError(
            argument, entry, f"is on {entry.mesh!r}, not on {mesh!r}", "give a layout on the inputs' mesh"
        )
    return as_tensor_spec((aval.shape, aval.dtype, entry), mesh, argument).layout


def _numeric_dtype(value: Any) -> np.dtype | None:
    """``value`` as a numeric dtype (a typed PRNG key's, key<fry>, as it is), None when it
    is not one. No error built: :func:`_is_dtype_like` asks it of every 3-tuple in an input
    pytree, and an error's message holds the value's repr (a DTensor's reads its values)."""
    if _is_extended(value):
        return value
    try:
        result = np.dtype(value)
    except (TypeError, ValueError):
        return None
    return None if result.kind in "OSUMm" else result


def _as_dtype(dtype: Any) -> np.dtype:
    result = _numeric_dtype(dtype)
    if result is not None:
        return result
    try:
        np.dtype(dtype)
    except TypeError:
        raise ArgumentTypeError("dtype", dtype, "not a dtype", "pass e.g. jnp.float32") from None
    raise ArgumentTypeError("dtype", dtype, "not a numeric dtype", "pass e.g. jnp.float32")


# -- layouts in signature terms ------------------------------------------------------------


def placement_on(layout: Layout, mesh_dim: int) -> Placement:
    """The placement of ``layout`` on one mesh dim (torch's view of that mesh dim)."""
    op = layout.partial[mesh_dim]
    if op:
        return Partial(op)
    dim = layout.mesh_dim_split(mesh_dim)
    return Replicate() if dim is None else Shard(dim)


# -- signatures ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OneDSig:
    """A valid signature of an op on one mesh dim: one placement per input and output.

    ``even`` lists ``(tensor, dim)`` pairs (tensors numbered inputs first, then outputs)
    whose split on this mesh dim is only valid when it is even: every rank's chunk has
    the same size (e.g. ``mean`` giving ``Partial(avg)``, a reshape that moves a split).
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    even: frozenset[tuple[int, int]] = field(default=frozenset())
    # A condition on the whole N-D candidate (e.g. reshape: splits of merged dims must
    # nest alike on both sides): called with the per-tensor (dim_axes, partial) tables and
    # the mesh shape; a candidate using this signature on any mesh dim must satisfy it.
    joint: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "even", frozenset(self.even))

    __hash__ = hash_once()

    def __getstate__(self) -> dict[str, Any]:
        return without_hash(self)

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.inputs + self.outputs

    def __str__(self) -> str:
        return f"{format_placements(self.inputs)} -> {format_placements(self.outputs)}"


@dataclass(frozen=True)
class RedistributeStep:
    """One collective (or local op) on one mesh dim, changing ``before`` into ``after``.

    ``nbytes`` is the number of bytes each device sends (see :mod:`.cost`; a gather's
    includes the halo exchange XLA adds off a misaligned dim split by several mesh dims,
    :func:`.cost.gather_halo_bytes`), ``cost`` is ``nbytes`` times the cost-model weight of
    the mesh axis. ``compiled`` is the collective
    XLA's SPMD partitioner emits for it (every backend's, before the backend's own rules,
    :func:`.combine.lowered_step`): ``collective``, except the gather of a dim of at most
    ``n/2`` rows, which it all-reduces (:func:`.cost.gather_block_bytes`). ``halo``: the
    collective-permutes XLA sends before a gather off a misaligned dim split by several
    mesh dims (:func:`.cost.gather_halo_permutes`), each as its mesh axes and the bytes
    each sending device sends (in ``nbytes`` too). ``over``: the mesh dims of a step over
    several at once, one collective whose device groups span them all (XLA's broadcast
    of a host callback's result: one all-reduce over the whole mesh, :func:`.plan.mesh_all_reduce`;
    ``mesh_dim`` is the first, ``axis`` names them all); ``()``: over ``mesh_dim`` alone.
    """

    mesh_dim: int
    axis: str
    src: Placement
    dst: Placement
    collective: str
    nbytes: Fraction
    cost: Fraction
    before: Layout
    after: Layout
    compiled: str
    # out of repr: the bytes are in nbytes, and equation reports print their steps as they did before halos
    halo: tuple[tuple[tuple[str, ...], int], ...] = field(default=(), repr=False)
    over: tuple[int, ...] = field(default=(), repr=False)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes of the step's device groups."""
        names = self.before.mesh.axis_names
        return tuple(names[m] for m in self.over) if self.over else (self.axis,)

    @property
    def over_one_device(self) -> bool:
        """On a size-1 mesh dim: every placement there holds the whole tensor, so the step
        moves nothing and compiles to nothing. A plan keeps it (its steps chain ``src`` to
        ``dst``); a prediction's steps and collectives leave it out."""
        shape = self.before.mesh.shape
        return all(shape[m] == 1 for m in self.over or (self.mesh_dim,))

    @property
    def communicates(self) -> bool:
        """A collective a compiled program runs: one that sends data (not a local slice or
        a local partial), over more than one device."""
        return self.collective in COMMUNICATING and not self.over_one_device

    def __str__(self) -> str:
        return f"{self.axis}: {self.src}->{self.dst} {self.collective} ({format_bytes(self.nbytes)} B)"


@dataclass(frozen=True)
class RedistributePlan:
    """How one tensor goes from ``src`` to ``dst``: steps on one mesh dim at a time."""

    shape: Shape
    dtype: np.dtype
    src: Layout
    dst: Layout
    steps: tuple[RedistributeStep, ...]

    @property
    def cost(self) -> Fraction:
        return sum((s.cost for s in self.steps), Fraction(0))

    @property
    def nbytes(self) -> Fraction:
        return sum((s.nbytes for s in self.steps), Fraction(0))

    @property
    def is_noop(self) -> bool:
        return not self.steps

    @property
    def collectives(self) -> Counter[str]:
        """How many steps of each kind (local steps included)."""
        return Counter(s.collective for s in self.steps)

    @property
    def passes_uneven(self) -> bool:
        """Whether a layout on the route (``src`` or one after a step) splits a dim of the
        tensor unevenly."""
        return not all(layout.is_even(self.shape) for layout in (self.src, *(step.after for step in self.steps)))

    def routed(self, source: Any) -> Iterator[tuple[Any, RedistributeStep]]:
        """Each step with its route key, moving the value ``source``: the value, ``src`` and
        the layout after each step so far. Moves of one value whose routes begin alike
        have their first steps' keys in common: a compiled program computes those
        collectives once in a computation (:class:`SharedRoutes`)."""
        route: Any = (source, self.src)
        for step in self.steps:
            route = (route, step.after)
            yield route, step

    def __str__(self) -> str:
        head = (
            f"redistribute {Aval(self.shape, self.dtype)}: {str(self.src)} -> {str(self.dst)}, "
            f"{format_bytes(self.nbytes)} B per device, cost {format_bytes(self.cost)}"
        )
        if not self.steps:
            return head + " (nothing to do)"
        rows = [
            (i, s.axis, s.src, s.dst, s.collective, format_bytes(s.nbytes), format_bytes(s.cost), str(s.after))
            for i, s in enumerate(self.steps)
        ]
        return head + "\n" + format_table(("step", "axis", "from", "to", "collective", "bytes", "cost", "layout after"), rows)


class SharedRoutes:
    """The routes a compiled program has run so far, a value's moves sharing them.

    Chosen for the whole program (``shared``), a value moved into several layouts along
    routes that begin alike (:meth:`RedistributePlan.routed`) has those first steps once:
    a compiled program computes the same collective of the same value once (Llama's adamw
    step on a 2x4 mesh: 3,072 B fewer, what its pinned program compiles); eager dispatch
    runs each equation's own, and a literal or constant (no value) shares nothing. A route
    is run in a computation (the program, a loop body, a cond's branch), which a move
    sees with those enclosing it across loop boundaries
    (:func:`.combine.move_computations`): a collective computed in a loop body or a
    cond's branch is not the program's, nor another branch's (stop 39 counted novograd's
    partial gradient reduced in the branches of its two ``lax.cond`` once where its pinned
    program compiled four all-reduces; the pinned program now moves a cond's operands
    before it, as that function keys such a move). The one
    walk behind every count of a prediction's collectives: its steps
    (:meth:`.jaxpr.Prediction.routed_steps`), the combiner's
    (:func:`.combine.planned_collectives`) and :func:`.check.check`'s, whose conversions of
    outputs to XLA's layouts continue the program's routes."""

    def __init__(self, shared: bool) -> None:
        self._shared = shared
        # (computation, route key) run so far -> what its run left (record())
        self._run: dict[tuple[str, Any], Any] = {}

    def steps(
        self, source: Any, plan: RedistributePlan, within: Sequence[str] = ("",)
    ) -> Iterator[tuple[Any, RedistributeStep, bool]]:
        """Each step of ``plan`` moving the value ``source`` (None: a literal or constant)
        in the computation ``within[0]``, seeing the routes run in ``within``
        (:func:`.combine.move_computations`), with its key (the computation it ran in, its
        route's) and whether the program runs it (False: an earlier move of the value ran
        it where this one sees it)."""
        share = self._shared and source is not None
        for route, step in plan.routed(source):
            key = (within[0], route)
            if not share:
                yield key, step, True
                continue
            seen = next((k for k in ((where, route) for where in within) if k in self._run), None)
            if seen is None:
                self._run[key] = None
            yield key if seen is None else seen, step, seen is None

    def record(self, route: Any, left: Any) -> None:
        """Keep what the run of ``route`` left (e.g. the collectives the value depends on
        there), for a later move along it, which runs nothing there (:meth:`left`)."""
        if route in self._run:
            self._run[route] = left

    def left(self, route: Any) -> Any:
        """What the earlier run of ``route`` left (:meth:`record`)."""
        return self._run[route]


class _ByValue:
    """Equality and hashing by ``_fields()``, as a plain frozen dataclass has them, for
    the frozen classes below whose ``__init__`` and lazily built fields are their own."""

    def _fields(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())


@dataclass(frozen=True, init=False, eq=False)
class Candidate(_ByValue):
    """One N-D signature of an op: the layouts of all inputs and outputs, the plans that
    bring the given inputs to them, and the 1-D signature used on each mesh dim (in
    ``nest_order``, the order in which mesh dims split a tensor dim, major first).

    ``pending`` is the look-ahead charge for ranking only: partial mesh dims the outputs
    get that no given input had must be reduced some day, at least by a reduce-scatter
    (see :func:`select.pending_reduction`); ``cost`` is the communication of this op.

    ``plans`` are given, or built on first read by ``planner`` (an object with
    ``plans(layouts)``, ``cost(layouts)`` and ``redistributed(layouts)`` of the input
    layouts, e.g. :class:`.plan.InputPlans`): ranking reads only the cost and which
    inputs move, so the steps of most candidates' plans are never built. Given plans are
    kept as the planner (``dataclasses.replace`` carries them). Equality and hashing are
    by value (the plans included), as for a plain frozen dataclass.
    """

    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout, ...]
    one_d: tuple[OneDSig, ...]
    nest_order: tuple[int, ...]
    out_avals: tuple[Aval, ...]
    pending: Fraction
    planner: Any

    def __init__(
        self,
        in_layouts: tuple[Layout, ...],
        out_layouts: tuple[Layout, ...],
        plans: tuple[RedistributePlan, ...] | None = None,
        one_d: tuple[OneDSig, ...] = (),
        nest_order: tuple[int, ...] = (),
        out_avals: tuple[Aval, ...] = (),
        pending: Fraction = Fraction(0),
        planner: Any = None,
    ) -> None:
        if plans is not None:
            planner = _GivenPlans(tuple(plans))
        elif planner is None:
            raise TypeError("Candidate needs its plans or a planner to build them")
        # one dict update, not a frozen __setattr__ per field (candidates are built by the thousand)
        self.__dict__.update(
            in_layouts=in_layouts, out_layouts=out_layouts, one_d=one_d, nest_order=nest_order, out_avals=out_avals,
            pending=pending, planner=planner,
        )

    @cached_property
    def plans(self) -> tuple[RedistributePlan, ...]:
        return self.planner.plans(self.in_layouts)

    def _fields(self) -> tuple[Any, ...]:
        return (self.in_layouts, self.out_layouts, self.plans, self.one_d, self.nest_order, self.out_avals, self.pending)

    def __repr__(self) -> str:
        return (
            f"Candidate(in_layouts={self.in_layouts!r}, out_layouts={self.out_layouts!r}, plans={self.plans!r}, "
            f"one_d={self.one_d!r}, nest_order={self.nest_order!r}, out_avals={self.out_avals!r}, "
            f"pending={self.pending!r})"
        )

    @cached_property
    def cost(self) -> Fraction:
        return self.planner.cost(self.in_layouts)

    @cached_property
    def redistributed(self) -> tuple[bool, ...]:
        """Per input: does it need any step (local ones included)?"""
        return self.planner.redistributed(self.in_layouts)

    @property
    def out_bytes(self) -> int:
        """Bytes of one device's (padded) output blocks, summed over outputs."""
        return sum(
            block_bytes(a.shape, a.dtype.itemsize, layout.dim_axes, layout.mesh.shape)
            for a, layout in zip(self.out_avals, self.out_layouts)
        )

    @property
    def layout_key(self) -> tuple[Any, ...]:
        """The last tie-break: per tensor (inputs, then outputs) and mesh dim, splits of
        lower tensor dims first, then Replicate, then Partial; then the nest order."""
        return tuple(layout_rank_key(layout) for layout in self.in_layouts + self.out_layouts)

    @property
    def strided(self) -> int:
        """How many of the layouts split a dim out of mesh order (torch writes those with
        ``_StridedShard``): cost ties prefer fewer."""
        return sum(split_out_of_mesh_order(x) for x in self.in_layouts + self.out_layouts)

    @property
    def out_splits(self) -> tuple[tuple[int, ...], ...]:
        """Per output, :func:`split_dims_key`: cost ties prefer, mesh dim by mesh dim, an
        output not split there, then splits of lower tensor dims (torch's order)."""
        return tuple(split_dims_key(layout) for layout in self.out_layouts)

    def rank_key(self) -> tuple[Any, ...]:
        """The selection order (see docs/inference.md): candidates needing no
        redistribution of any input first (OneFlow's order value), then lower cost plus
        pending reductions, then layouts split in mesh order (fewer ``strided``), then
        ``out_splits``, then keeping earlier inputs unchanged, then smaller output blocks,
        then layout_key."""
        return (
            any(self.redistributed), self.cost + self.pending, self.strided, self.out_splits, self.redistributed,
            self.out_bytes, self.layout_key,
        )

    def __str__(self) -> str:
        ins = " ; ".join(str(x) for x in self.in_layouts)
        outs = " ; ".join(str(x) for x in self.out_layouts)
        return f"({ins}) -> ({outs})"


@dataclass(frozen=True)
class _GivenPlans:
    """The planner of a candidate built with its plans: those plans, whatever the layouts."""

    given: tuple[RedistributePlan, ...]

    def plans(self, layouts: Sequence[Layout]) -> tuple[RedistributePlan, ...]:
        return self.given

    def cost(self, layouts: Sequence[Layout]) -> Fraction:
        return sum((p.cost for p in self.given), Fraction(0))

    def redistributed(self, layouts: Sequence[Layout]) -> tuple[bool, ...]:
        return tuple(not p.is_noop for p in self.given)


def layout_rank_key(layout: Layout) -> tuple[Any, ...]:
    """One tensor's part of :attr:`Candidate.layout_key` (memoized per interned layout)."""
    key = _LAYOUT_KEYS.get(layout)
    if key is None:
        placements = []
        for m, op in enumerate(layout.partial):
            dim = layout.mesh_dim_split(m)
            placements.append((2, op) if op else (1, "") if dim is None else (0, dim))
        key = tuple(placements), layout.dim_axes
        _LAYOUT_KEYS.remember(layout, key)
    return key


def split_dims_key(layout: Layout) -> tuple[int, ...]:
    """Per mesh dim, the tensor dim ``layout`` splits there, -1 where it splits none
    (Replicate or Partial): one output's part of :attr:`Candidate.out_splits`, the tie-break
    giving torch's choice where its strategies tie (docs/inference.md, section 10)."""
    key = _SPLIT_DIMS.get(layout)
    if key is None:
        key = tuple(-1 if (d := layout.mesh_dim_split(m)) is None else d for m in range(layout.mesh.ndim))
        _SPLIT_DIMS.remember(layout, key)
    return key


def split_out_of_mesh_order(layout: Layout) -> bool:
    """Does ``layout`` split a dim over mesh dims out of mesh order (one of
    :attr:`Candidate.strided`)?"""
    strided = _STRIDED.get(layout)
    if strided is None:
        strided = any(list(a) != sorted(a) for a in layout.dim_axes)
        _STRIDED.remember(layout, strided)
    return strided


# Per interned layout: its rank key, whether it is strided and its split dims (ranking reads
# them for every candidate; layouts recur across candidates and ops).
_LAYOUT_KEYS = Memo(65536)
_STRIDED = Memo(65536)
_SPLIT_DIMS = Memo(65536)


@dataclass(frozen=True, init=False, eq=False)
class Signature(_ByValue):
    """The result of inference for one op: the chosen candidate and the ranked list.

    ``in_layouts`` are the layouts the inputs must have when the op runs (reached by
    ``redistributions``), ``out_layouts`` the layouts of the outputs.

    ``candidates`` (a tuple, best first) are given, or ranked on first read by ``rank``
    (a function returning them) when ``chosen`` is given: inference finds the best
    candidate that runs on the inputs as given without ranking all the others
    (``candidates[0]`` is then ``chosen``). Equality and hashing are by value (the
    candidates included), as for a plain frozen dataclass.
    """

    op: str
    inputs: tuple[TensorSpec, ...]

    def __init__(
        self,
        op: str,
        inputs: tuple[TensorSpec, ...],
        candidates: Sequence[Candidate] | None = None,
        *,
        chosen: Candidate | None = None,
        rank: Any = None,
    ) -> None:
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "inputs", inputs)
        if candidates is not None:
            self.__dict__["candidates"] = tuple(candidates)
        elif chosen is None or rank is None:
            raise TypeError("Signature needs its candidates, or the chosen one and a function ranking them all")
        object.__setattr__(self, "_chosen", chosen)
        object.__setattr__(self, "_rank", rank)

    @cached_property
    def candidates(self) -> tuple[Candidate, ...]:
        ranked = list(self._rank())
        chosen = self._chosen
        if not ranked or (ranked[0].in_layouts, ranked[0].out_layouts) != (chosen.in_layouts, chosen.out_layouts):
            raise RuntimeError(f"{self.op}: the ranked candidates do not start with the chosen one {chosen}")
        ranked[0] = chosen
        return tuple(ranked)

    @property
    def chosen(self) -> Candidate:
        if self._chosen is not None:
            return self._chosen
        return self.candidates[0]

    def _fields(self) -> tuple[Any, ...]:
        return (self.op, self.inputs, self.candidates)

    def __repr__(self) -> str:
        return f"Signature(op={self.op!r}, inputs={self.inputs!r}, candidates={self.candidates!r})"

    @property
    def in_layouts(self) -> tuple[Layout, ...]:
        return self.chosen.in_layouts

    @property
    def out_layouts(self) -> tuple[Layout, ...]:
        return self.chosen.out_layouts

    @property
    def out_layout(self) -> Layout:
        """The output layout of a single-output op."""
        if len(self.out_layouts) != 1:
            raise InferenceError(
                "op", self.op, f"has {len(self.out_layouts)} outputs", "use out_layouts (a tuple) instead"
            )
        return self.out_layouts[0]

    @property
    def out_avals(self) -> tuple[Aval, ...]:
        return self.chosen.out_avals

    @property
    def redistributions(self) -> tuple[RedistributePlan, ...]:
        return self.chosen.plans

    @property
    def cost(self) -> Fraction:
        return self.chosen.cost

    def table(self, limit: int | None = 8) -> str:
        """The ranked candidates as a table (the first ``limit``; all with None)."""
        shown = self.candidates if limit is None else self.candidates[:limit]
        rows = [
            (
                i,
                " ; ".join(str(x) for x in c.in_layouts),
                " ; ".join(str(x) for x in c.out_layouts),
                " | ".join(str(s) for s in c.one_d),
                "".join("r" if r else "-" for r in c.redistributed),
                format_bytes(c.cost),
                format_bytes(c.pending),
            )
            for i, c in enumerate(shown)
        ]
        headers = ("rank", "inputs", "outputs", "1-D signatures per mesh dim", "redist", "cost", "pending")
        text = format_table(headers, rows)
        if len(shown) < len(self.candidates):
            text += f"\n... {len(self.candidates) - len(shown)} more candidates"
        return text

    def __str__(self) -> str:
        given = " ; ".join(str(s) for s in self.inputs)
        lines = [
            f"{self.op}({given})",
            f"  chosen: {self.chosen}  cost {format_bytes(self.cost)}",
        ]
        for i, plan in enumerate(self.redistributions):
            if plan.steps:
                lines.append(f"  input {i}: " + "; ".join(str(s) for s in plan.steps))
        return "\n".join(lines) + "\n" + self.table()
