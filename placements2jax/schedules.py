"""Collective schedules for redistribute: the candidates for a move and the choice among them.

:mod:`.programs` hands a whole move to XLA as one reshard. XLA's SPMD partitioner sends
more than a move needs in three families (docs/benchmarks.md, benchmark 4): on CPU it
lowers ``Partial -> Shard`` as an all-reduce and a slice, it realigns blocks with a
collective in the source's device order plus a collective-permute of whole blocks, and it
reduces a partial tensor replicated over another mesh dim in every replica group. This
module writes such moves directly with ``jax.shard_map`` collectives and keeps XLA's
reshard as one candidate among several:

* ``xla``: :func:`.programs.convert`, XLA's single reshard (always available).
* ``stepwise``: the planner's route (:func:`.inference.plan.plan_redistribute`), one
  reshard per step (moves without partials on even layouts).
* ``direct``: a :class:`DirectSchedule` in one ``shard_map``:

  1. *reduce* (Partial sources the target does not keep): every mesh dim that is partial, or replicated next to a
     partial, splits a tensor dim afterwards. Replicated ones slice locally (the reduction is
     split across replicas), partial ones are reduced by one ``psum_scatter`` (a real
     reduce-scatter) over all partial mesh dims for ``sum``, or one ``all_to_all`` followed
     by a local reduction for ``avg``/``max``/``min``. Each element's sum ends on exactly
     one device, chosen on a device whose target block holds the element when one exists.
     When the partial mesh dims cannot split the dims the target splits evenly (uneven
     layouts), step 1 is a cell exchange instead (below): every device receives each
     other partial coordinate's contribution to its cells once and combines them (the
     bytes of a reduce-scatter without padding).
  2. *move cells*: the blocks of the intermediate and the target layout cut every tensor
     dim into equal cells (dividing every block edge of both, so uneven padded blocks are
     whole cells, padding last); every device receives exactly the cells its target block
     needs and its own block lacks, each once, and writes each into its block in place. Traffic that is uniform within groups of mesh
     dims (every pair of a group exchanges ``m`` cells) is one ``all_to_all`` over those
     dims (in any device order); otherwise ``ppermute`` rounds, one permutation each.
     A partial the target keeps (same mesh dims, same op) skips step 1: its contributions
     differ along the partial mesh dims, so every cell comes from a holder with the
     receiver's coordinates on them (a plain move within each partial coordinate).

  A direct schedule sends the lower bound of benchmarks/bounds.py on every move it
  accepts when step 1 can put each sum on a receiver. The candidate generator refuses
  (and XLA's reshard is used) targets with new partial mesh dims (local: nothing to
  send) and uneven blocks of more than 64 cells (one dynamic slice per cell).
* ``direct+xla``: step 1 in ``shard_map``, then XLA's reshard to the target (one
  all-gather or all-to-all instead of several rounds).

:func:`choose` picks one by policy: ``"xla"``; ``"min_bytes"`` (fewest bytes, then fewest
collectives); ``"cost"`` (the default: least time under a :class:`CostModel`, by default
:func:`policy_model`: this backend's size-aware calibration, per collective kind, local
copies and fresh buffers, measured once by :meth:`CostModel.calibrate` and stored on
disk; only a schedule sending fewer bytes than XLA's may replace it); or a CostModel.
The choice depends only on the physical representations, the dtype and the policy, so a
move runs the same schedule eagerly and under ``jax.jit``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import chunking
from .caches import cached
from .errors import ArgumentTypeError
from .hlo import Collective, parse_collectives
from .inference.cost import collective_nbytes
from .inference.cost import CostModel, default_cost_model
from .layout import Layout
from .mesh import shard_map
from .physical import Physical
from .programs import REDUCERS, reshard_to, convert, program

__all__ = [
    "POLICIES",
    "DirectSchedule",
    "Schedule",
    "calibration_file",
    "candidates",
    "choose",
    "default_policy",
    "policy_model",
    "recalibrate",
    "redistribute_schedule",
    "schedule_program",
    "set_default_policy",
    "use_policy",
]

POLICIES = ("cost", "min_bytes", "xla")
Policy = str | CostModel

_policy: list[Policy] = ["cost"]


def default_policy() -> Policy:
    """The policy ``redistribute`` uses when given ``policy=None``."""
    return _policy[0]


def set_default_policy(policy: Policy | None) -> Policy:
    """Set the default policy (None resets it to ``"cost"``); returns the previous one."""
    previous = _policy[0]
    _policy[0] = "cost" if policy is None else check_policy(policy)
    return previous


@contextmanager
def use_policy(policy: Policy) -> Iterator[Policy]:
    """Use ``policy`` as the default inside a ``with`` block."""
    previous = set_default_policy(policy)
    try:
        yield _policy[0]
    finally:
        set_default_policy(previous)


def check_policy(policy: Any, argument: str = "policy") -> Policy:
    if isinstance(policy, CostModel) or (isinstance(policy, str) and policy in POLICIES):
        return policy
    raise ArgumentTypeError(
        argument, policy, "is not a redistribute policy", f"pass one of {POLICIES} or a CostModel"
    )


# -- bytes of collectives ---------------------------------------------------------------


def sent_bytes(collective: Collective, num_devices: int) -> Fraction:
    """Average bytes each of ``num_devices`` devices sends for one compiled collective:
    the per-member ring figure of :func:`.inference.cost.collective_nbytes` for each
    member of its groups (collective-permute: the result for each pair between two
    devices), over all devices."""
    if collective.op == "collective-permute":
        pairs = sum(1 for source, target in collective.groups if source != target)
        return Fraction(collective.result_bytes * pairs, num_devices)
    members = sum(len(g) for g in collective.groups) if collective.groups else num_devices
    return collective_nbytes(collective, num_devices) * members / num_devices


def sent_bytes_per_device(collectives: Sequence[Collective], num_devices: int) -> Fraction:
    """Average bytes per device of a sequence of compiled collectives."""
    return sum((sent_bytes(c, num_devices) for c in collectives), Fraction(0))


# -- schedules -------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """One way to run a move: a traceable function from the source's physical array to the
    target's, and what it sends: the compiled collectives (XLA's reshard), the exact
    collectives it is built from (``predicted``: direct schedules, which XLA compiles as
    written) or the planner's priced steps (``planned``: the stepwise route, priced without
    compiling it; its compiled collectives are read on demand). ``known``: collectives it
    sends for certain, known without compiling it (a direct schedule's all; ``direct+xla``:
    its reduction step's), which bound its price from below (:meth:`least_seconds`)."""

    name: str
    src: Physical
    dst: Physical
    dtype: np.dtype
    function: Callable[[jax.Array], jax.Array] = field(compare=False, repr=False)
    predicted: tuple[Collective, ...] | None = field(default=None, compare=False, repr=False)
    planned: tuple[tuple[tuple[int, ...], Fraction], ...] | None = field(default=None, compare=False, repr=False)
    local_bytes: int = field(default=0, compare=False)
    known: tuple[Collective, ...] = field(default=(), compare=False, repr=False)

    @cached_property
    def jitted(self) -> jax.stages.Wrapped:
        if self.name == "xla":
            return program(self.src, self.dst)
        return jax.jit(self.function, out_shardings=self.dst.sharding)

    def argument(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.src.array_shape, self.dtype, sharding=self.src.sharding)

    @cached_property
    def collectives(self) -> tuple[Collective, ...]:
        """The collectives, in mesh positions (predicted for direct schedules, which XLA
        compiles as written; compiled otherwise)."""
        if self.predicted is not None:
            return self.predicted
        return self.compiled_collectives

    @cached_property
    def compiled(self) -> jax.stages.Compiled:
        """The program compiled for the source's array: one compile for its collectives and
        its temporaries (JAX 0.10.2 lowers every ``lower().compile()`` again and mostly
        compiles it again: 989 calls made 768 XLA compiles in one test); the eager call of
        :attr:`jitted` then finds the executable in JAX's cache."""
        return self.jitted.lower(self.argument()).compile()

    @cached_property
    def compiled_collectives(self) -> tuple[Collective, ...]:
        return tuple(parse_collectives(self.compiled.as_text()))

    @cached_property
    def terms(self) -> tuple[tuple[tuple[int, ...], Fraction], ...]:
        """Per collective: its mesh dims and the average bytes each device sends."""
        if self.planned is not None:
            return self.planned
        return self._terms(self.collectives)

    def _terms(self, collectives: Sequence[Collective]) -> tuple[tuple[tuple[int, ...], Fraction], ...]:
        mesh = self.src.layout.mesh
        return tuple((tuple(mesh.axis_index(a) for a in c.mesh_axes(mesh)), sent_bytes(c, mesh.size()))
                     for c in collectives)

    @cached_property
    def nbytes(self) -> Fraction:
        """Average bytes sent per device."""
        return sum((nbytes for _, nbytes in self.terms), Fraction(0))

    def seconds(self, model: CostModel) -> float:
        """Predicted time under ``model``: the collectives (by kind and bytes), the bytes a
        direct schedule copies within each device to pack and unpack messages
        (``CostModel.copy_seconds``; XLA's own copies are part of what the calibration
        measures per collective), and, with an ``alloc_curve``, the program's temporaries
        (``CostModel.alloc_seconds``: the term that decides large moves on CPU)."""
        kinds = (None,) * len(self.terms) if self.planned is not None else tuple(c.op for c in self.collectives)
        sent_and_local = self._seconds(model, kinds, self.terms)
        return sent_and_local + (model.alloc_seconds(self.temp_bytes) if model.alloc_curve else 0.0)

    def least_seconds(self, model: CostModel) -> float:
        """A lower bound of :meth:`seconds`, found without compiling: the :attr:`known`
        collectives and the local copies. Every term of a CostModel is non-negative (it
        validates its curves and tables), so the collectives and temporaries left out can
        only add; for a direct schedule the bound is its price without the temporaries."""
        return self._seconds(model, tuple(c.op for c in self.known), self._terms(self.known))

    @cached_property
    def least_nbytes(self) -> Fraction:
        """A lower bound of :attr:`nbytes` (the :attr:`known` collectives'), found without compiling."""
        return sum((nbytes for _, nbytes in self._terms(self.known)), Fraction(0))

    def _seconds(self, model: CostModel, kinds: Sequence[str | None],
                 terms: Sequence[tuple[tuple[int, ...], Fraction]]) -> float:
        """The collectives' time plus the local copies' (the same sum for :meth:`seconds`
        and :meth:`least_seconds`, so the bound holds in floating point as well)."""
        mesh = self.src.layout.mesh
        sent = sum(model.collective_seconds(mesh, axes, float(nbytes), kind) for kind, (axes, nbytes) in zip(kinds, terms))
        return sent + (model.copy_seconds(mesh, self.local_bytes) if self.local_bytes else 0.0)

    @cached_property
    def temp_bytes(self) -> int:
        """Bytes of temporaries per device of the compiled program (XLA's memory analysis):
        fresh buffers every call allocates."""
        analysis = self.compiled.memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)


def _xla(src: Physical, dst: Physical, dtype: np.dtype) -> Schedule:
    return Schedule("xla", src, dst, dtype, lambda x: convert(x, src, dst))


def _stepwise(src: Physical, dst: Physical, dtype: np.dtype) -> Schedule | None:
    if src.layout.has_partial or dst.layout.has_partial or src.is_padded or dst.is_padded:
        return None
    from .inference.plan import plan_redistribute  # the planner is pure; imported on use

    plan = plan_redistribute(src.shape, dtype, src.layout, dst.layout)
    layouts = [step.after.bind(len(src.shape)) for step in plan.steps]
    if not all(layout.is_even(src.shape) for layout in layouts):
        return None  # an uneven step between even ends: a reshard cannot pad
    mesh = src.layout.mesh.to_jax()
    shardings = [NamedSharding(mesh, layout.partition_spec) for layout in layouts]
    if len(shardings) < 2:
        return None  # one step: the same reshard as XLA's
    planned = tuple(((step.mesh_dim,), step.nbytes) for step in plan.steps if step.nbytes)

    def stepwise(x: jax.Array) -> jax.Array:
        for sharding in shardings:
            x = reshard_to(x, sharding)
        return x

    return Schedule("stepwise", src, dst, dtype, stepwise, planned=planned)


def candidates(src: Physical, dst: Physical, dtype: Any) -> tuple[Schedule, ...]:
    """Every schedule for the move from ``src`` to ``dst`` (same mesh), XLA's first."""
    dtype = np.dtype(dtype)
    return _candidates(src, dst, dtype)


@cached(maxsize=2048)
def _candidates(src: Physical, dst: Physical, dtype: np.dtype) -> tuple[Schedule, ...]:
    result = [_xla(src, dst, dtype)]
    if src.layout.is_strided or dst.layout.is_strided:  # a permuted dim: XLA's program undoes it
        return tuple(result)
    direct = DirectSchedule.build(src, dst)
    if direct is not None:
        predicted = direct.collectives(dtype)
        result.append(Schedule("direct", src, dst, dtype, direct.function, predicted,
                               local_bytes=direct.local_bytes(dtype.itemsize), known=predicted))
        if direct.cells is not None and direct.reduced_layout is not None:
            reduced = direct.reduce_only()
            def reduce_then_reshard(x: jax.Array) -> jax.Array:
                return convert(reduced.function(x), reduced.dst, dst)  # re-pads an uneven target

            result.append(Schedule("direct+xla", src, dst, dtype, reduce_then_reshard,
                                   local_bytes=reduced.local_bytes(dtype.itemsize), known=reduced.collectives(dtype)))
    stepwise = _stepwise(src, dst, dtype)
    if stepwise is not None:
        result.append(stepwise)
    return tuple(result)


def choose(src: Physical, dst: Physical, dtype: Any, policy: Policy | None = None) -> Schedule:
    """The schedule ``policy`` (default: :func:`default_policy`) picks for the move."""
    policy = default_policy() if policy is None else check_policy(policy)
    dtype = np.dtype(dtype)
    if isinstance(policy, str) and policy == "cost":
        options = candidates(src, dst, dtype)
        if len(options) == 1:
            return options[0]  # XLA's reshard is the only schedule: no calibration needed to choose it
        policy = _cost_model(src.layout.mesh)
    return _choose(src, dst, dtype, policy)


@cached(maxsize=4096)
def _choose(src: Physical, dst: Physical, dtype: np.dtype, policy: Policy) -> Schedule:
    options = candidates(src, dst, dtype)
    if policy == "xla" or len(options) == 1:
        return options[0]
    if policy == "min_bytes":
        return min(options, key=lambda s: (s.nbytes, len(s.terms)))
    xla = options[0]
    # The planner's route is a chain of XLA reshards, each writing its whole result: on
    # the CPU backend it was slower than the single reshard on every measured move, also
    # where it sends fewer bytes (docs/benchmarks.md, benchmark 4), and the per-collective
    # model cannot see those writes. It competes only on bytes (min_bytes).
    # Only a schedule sending fewer bytes than XLA's reshard may replace it: with as many
    # bytes, the direct schedules were slower on every measured move and size (1.25-4.5x:
    # their cell exchanges copy more within each device than XLA's all-gathers,
    # docs/benchmarks.md, benchmark 3), and fewer collectives alone is a latency gain the
    # calibration cannot resolve from the noise.
    # Within the model's resolution prefer XLA's reshard: it is the program plain JAX runs.
    limit = xla.seconds(policy) * _MARGIN  # type: ignore[arg-type]
    # Pricing a schedule compiles it (its temporaries, XLA's collectives): a schedule whose
    # lower bound already reaches the limit can never be chosen (if it were the fastest,
    # XLA's would be taken), so it is dropped uncompiled, which leaves the choice as it
    # was. Compiling a direct schedule cost 5x XLA's reshard, and the bound drops most of
    # them on small tensors (249 of 259 direct schedules among the 1-2-d layout pairs of
    # a 5x3 tensor on a 2x2 mesh).
    options = tuple(s for s in options if s is xla or (
        s.name != "stepwise" and s.least_nbytes < xla.nbytes and s.least_seconds(policy) < limit  # type: ignore[arg-type]
        and s.nbytes < xla.nbytes))
    best = min(options, key=lambda s: (s.seconds(policy), s.nbytes))  # type: ignore[arg-type]
    return xla if best.seconds(policy) >= limit else best  # type: ignore[arg-type]


_MARGIN = 0.8
_MAX_CELLS = 64  # cells per block of an uneven move (one dynamic slice per cell and message slot)


def redistribute_schedule(
    shape: Sequence[int], dtype: Any, src: Layout, dst: Layout, policy: Policy | None = None
) -> Schedule:
    """The schedule ``redistribute`` runs to move a ``shape``/``dtype`` tensor from layout
    ``src`` to ``dst`` (bound layouts on one mesh): for inference's predicted costs, which
    should price the same collectives (``Schedule.terms``: mesh dims and bytes per
    collective; ``Schedule.seconds(model)``)."""
    from .physical import physical

    shape = tuple(shape)
    return choose(physical(src, shape), physical(dst, shape), dtype, policy)


def schedule_program(src: Physical, dst: Physical, dtype: Any, policy: Policy | None = None) -> jax.stages.Wrapped:
    """The cached jitted program of the chosen schedule."""
    return choose(src, dst, dtype, policy).jitted


def schedule_function(src: Physical, dst: Physical, dtype: Any, policy: Policy | None = None) -> Callable:
    """The traceable function of the chosen schedule (for use inside the caller's jit)."""
    return choose(src, dst, dtype, policy).function


# -- calibration -----------------------------------------------------------------------


def policy_model(mesh: Any) -> CostModel:
    """The CostModel the ``"cost"`` policy prices moves on ``mesh`` with: the default cost
    model when it has latency terms or curves, else the backend's calibration (measured
    once per machine and device count, stored on disk, see :func:`calibration_file`: a
    1-d mesh of all devices, whose curves apply to every mesh dim)."""
    from .mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ArgumentTypeError("mesh", mesh, "expected a DeviceMesh", "pass e.g. init_device_mesh((4, 2), ('a', 'b'))")
    return _cost_model(mesh)


def _cost_model(mesh: Any) -> CostModel:
    model = default_cost_model()
    if model.latency or model.curves:
        return model
    return _calibrated_model(mesh.devices.flat[0].platform, jax.device_count(), mesh.ndim)


@cached(maxsize=16)
def _calibrated_model(platform: str, device_count: int, ndim: int) -> CostModel:
    """One CostModel object per mesh rank (built once: every eager redistribute looks it up,
    and building one per call cost ~170 µs of dispatch)."""
    base = _calibrated(platform, device_count)
    dims = range(ndim)
    curves = dict(dict(base.curves)[_RANKS])
    latency, per_byte = dict(base.latency)[_RANKS], dict(base.per_byte)[_RANKS]
    return CostModel(latency={m: latency for m in dims}, per_byte={m: per_byte for m in dims},
                     copy_per_byte=base.copy_per_byte, curves={m: curves for m in dims}, copy_curve=base.copy_curve,
                     alloc_curve=base.alloc_curve)


_RANKS = "ranks"
_CALIBRATION_VERSION = 6  # bump when what calibrate measures changes: stored figures are then re-measured


def calibration_file(platform: str, device_count: int) -> Path | None:
    """Where the backend's calibration is stored between processes:
    ``$PLACEMENTS2JAX_CACHE_DIR`` (default ``~/.cache/placements2jax``), one file per
    platform, device count and JAX version; None when ``PLACEMENTS2JAX_CACHE_DIR`` is set
    empty (measure in every process). Delete the file (or call :func:`recalibrate`) to
    measure again, e.g. after the machine's load changed."""
    root = os.environ.get("PLACEMENTS2JAX_CACHE_DIR")
    if root == "":
        return None
    directory = Path(root) if root else Path.home() / ".cache" / "placements2jax"
    return directory / f"calibration-{platform}-{device_count}-jax{jax.__version__}-v{_CALIBRATION_VERSION}.json"


@cached(maxsize=4)
def _calibrated(platform: str, device_count: int) -> CostModel:
    """The calibration of a 1-d mesh of all devices: read from :func:`calibration_file`
    when stored (the same figures in every process, however loaded the machine is when a
    process starts), else measured and stored."""
    path = calibration_file(platform, device_count)
    if path is not None and path.exists():
        try:
            return _model_from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, ArgumentTypeError):
            pass  # unreadable or from another version of the format: measure again
    from .mesh import init_device_mesh

    model = CostModel.calibrate(init_device_mesh((device_count,), (_RANKS,)))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(_model_to_json(model), indent=1))
            temporary.replace(path)  # atomic: concurrent processes read a whole file
        except OSError:
            pass  # a read-only home: the calibration stays in this process
    return model


def recalibrate() -> CostModel:
    """Measure the backend's calibration again (replacing the stored one) and use it in
    this process; returns the 1-d model of all devices."""
    platform, count = jax.devices()[0].platform, jax.device_count()
    path = calibration_file(platform, count)
    if path is not None:
        path.unlink(missing_ok=True)
    _calibrated.cache_clear()
    _calibrated_model.cache_clear()
    _choose.cache_clear()
    return _calibrated(platform, count)


def _model_to_json(model: CostModel) -> dict[str, Any]:
    return {"latency": dict(model.latency)[_RANKS], "per_byte": dict(model.per_byte)[_RANKS],
            "copy_per_byte": model.copy_per_byte, "copy_curve": [list(p) for p in model.copy_curve],
            "alloc_curve": [list(p) for p in model.alloc_curve],
            "curves": {kind: [list(p) for p in curve] for kind, curve in dict(model.curves)[_RANKS]}}


def _model_from_json(data: dict[str, Any]) -> CostModel:
    return CostModel(latency={_RANKS: data["latency"]}, per_byte={_RANKS: data["per_byte"]},
                     copy_per_byte=data["copy_per_byte"], copy_curve=[tuple(p) for p in data["copy_curve"]],
                     alloc_curve=[tuple(p) for p in data["alloc_curve"]],
                     curves={_RANKS: {kind: [tuple(p) for p in curve] for kind, curve in data["curves"].items()}})


# -- direct schedules --------------------------------------------------------------------


def _digits(index: int, radices: Sequence[int]) -> list[int]:
    """Mixed-radix digits of ``index``, major first."""
    out = []
    for r in reversed(radices):
        out.append(index % r)
        index //= r
    return out[::-1]


def _block_index(dim_axes: tuple[int, ...], coord: Sequence[int], mesh_shape: Sequence[int]) -> int:
    index = 0
    for a in dim_axes:
        index = index * mesh_shape[a] + coord[a]
    return index


@dataclass(frozen=True)
class _Exchange:
    """One collective of the cell step: an all_to_all over mesh dims ``axes`` carrying
    ``m`` cells per pair, or a ppermute round of ``m`` cells over ``pairs``."""

    kind: str  # "all_to_all" or "ppermute"
    axes: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]
    m: int
    send: np.ndarray  # [device, slot]: local source cell sent in each slot


@dataclass(frozen=True)
class _Cells:
    """Step 2 of a direct schedule: cells from layout ``before`` to layout ``after``."""

    counts: tuple[int, ...]  # cells per tensor dim (whole tensor)
    cell: tuple[int, ...]  # elements per cell per dim
    before: tuple[int, ...]  # local cells per dim in the source block
    after: tuple[int, ...]  # local cells per dim in the target block
    exchanges: tuple[_Exchange, ...]
    local: np.ndarray  # [device, target cell]: the local cell it starts from (any, when received)
    placed: tuple[np.ndarray, ...]  # per exchange, [device, slot]: target cell of each received cell
    #   (the spare cell past the target block for a slot the device does not use)
    padding: np.ndarray | None = None  # [device, target cell]: padding (zeros) of an uneven target block

    @property
    def pooled(self) -> bool:
        """Assembled by one gather from local and received cells (all exchanges all_to_all)."""
        return bool(self.exchanges) and all(ex.kind == "all_to_all" for ex in self.exchanges)


@dataclass(frozen=True)
class DirectSchedule:
    """A move written with shard_map collectives (see the module docstring)."""

    src: Physical
    dst: Physical
    reduced_layout: Layout | None  # the layout after step 1 (None: no step 1)
    appended: tuple[tuple[int, ...], ...]  # per tensor dim, the mesh dims step 1 adds (major first)
    cells: _Cells | None  # step 2 (None: the reduced layout is the target)
    reduce_cells: _Cells | None = None  # step 1 as a cell exchange combining contributions (uneven layouts)

    @classmethod
    def build(cls, src: Physical, dst: Physical) -> DirectSchedule | None:
        """The direct schedule of a move, or None when it is refused (see module docstring)."""
        layout, target = src.layout, dst.layout
        if math.prod(src.shape) == 0 or layout.mesh != target.mesh:
            return None
        kept = target.has_partial and target.partial == layout.partial
        if target.has_partial and not kept:
            return None  # new partial dims: local, nothing to send (XLA sends nothing either)
        appended: tuple[tuple[int, ...], ...] = ((),) * len(src.shape)
        middle = layout if kept or not layout.has_partial else None
        if middle is None:
            # Step 1 is one reduce-scatter over even blocks when every partial mesh dim can
            # split the dim the target splits it on; otherwise (uneven layouts) a cell
            # exchange sends each device the other coordinates' contributions to its cells
            # (a reduce-scatter's bytes without padding) and combines them.
            plan = None if src.is_padded else _reduction_plan(src, dst)
            if plan is None or not plan[0].is_even(src.shape) or not _where_wanted(plan[1], dst.layout):
                plan = _reduction_plan(src, dst, even=False)
                if plan is None:
                    return None  # a 0-d tensor has no dim to scatter its reduction on: XLA's all-reduce
                middle, appended = plan
                reduce_cells = _cell_plan(layout, middle, src.shape, reduce=layout.partial_axes)
                if reduce_cells is None:
                    return None
                cells = _cell_plan(middle, target, src.shape) if middle.dim_axes != target.dim_axes else None
                if middle.dim_axes != target.dim_axes and cells is None:
                    return None
                return cls(src, dst, middle, appended, cells, reduce_cells)
            middle, appended = plan
        cells = None
        if middle.dim_axes != target.dim_axes:
            # Kept partial dims: each contribution moves among the devices of its own
            # coordinate on them, like a plain tensor.
            cells = _cell_plan(middle, target, src.shape, layout.partial_axes if kept else ())
            if cells is None:
                return None
        return cls(src, dst, middle if layout.has_partial and not kept else None, appended, cells)

    def reduce_only(self) -> DirectSchedule:
        """Step 1 alone, ending in the reduced layout."""
        from .physical import physical

        return DirectSchedule(self.src, physical(self.reduced_layout, self.src.shape), self.reduced_layout,
                              self.appended, None, self.reduce_cells)

    # -- what it sends -------------------------------------------------------------------
    def collectives(self, dtype: np.dtype) -> tuple[Collective, ...]:
        """The collectives, as XLA compiles them (devices numbered by mesh position)."""
        mesh = self.src.layout.mesh
        dtype = _hlo_dtype(dtype)
        result = []
        if self.reduce_cells is not None:
            result += _cell_collectives(self.reduce_cells, mesh.shape, dtype)
        elif self.reduced_layout is not None and self.src.layout.partial_axes:
            partial = self.src.layout.partial_axes
            k = math.prod(mesh.shape[a] for a in partial)
            block = _local_shape(self.reduced_layout, self.src.shape)
            groups = _groups(mesh.shape, partial)
            if self.src.layout.partial_op == "sum":
                result.append(Collective("reduce-scatter", (block,), dtype, groups))
            else:
                result.append(Collective("all-to-all", ((k, *block),), dtype, groups))
        if self.cells is not None:
            result += _cell_collectives(self.cells, mesh.shape, dtype)
        return tuple(result)

    def local_bytes(self, itemsize: int) -> int:
        """Bytes each device copies locally besides the collectives: step 1 rearranges the
        source block when it slices replicas or moves the partial factors; step 2 reads
        the source block into cells, packs every message, starts the target block from the
        local cells, writes every received cell into it and lays the block out."""
        total = 0
        if self.reduce_cells is not None:
            total += _cell_copies(self.reduce_cells, itemsize)
        elif self.reduced_layout is not None:
            block = math.prod(_local_shape(self.src.layout, self.src.shape)) * itemsize
            replicas = any(a not in self.src.layout.partial_axes for axes in self.appended for a in axes)
            total += block if replicas or len(self.appended) > 1 and any(self.appended[1:]) else 0
        if self.cells is not None:
            total += _cell_copies(self.cells, itemsize)
        return total

    # -- the program ---------------------------------------------------------------------
    @property
    def function(self) -> Callable[[jax.Array], jax.Array]:
        src, dst = self.src, self.dst
        mesh = src.layout.mesh.to_jax()
        body = self._body
        mapped = shard_map(body, mesh=mesh, in_specs=src.spec, out_specs=dst.spec, check_vma=False)
        return mapped

    def _body(self, x: jax.Array) -> jax.Array:
        mesh = self.src.layout.mesh
        names = mesh.axis_names
        shape = self.src.shape
        layout = self.src.layout
        index = _device_index(names, mesh.shape)
        if self.reduce_cells is not None:
            k = math.prod(mesh.shape[a] for a in layout.partial_axes)
            x = _run_cells(x.reshape(_local_shape(layout, shape)), self.reduce_cells, index, names,
                           layout.partial_op, k)
        elif self.reduced_layout is not None:
            x = self._reduce(x.reshape(_local_shape(layout, shape)))
        elif layout.has_partial:  # kept partials: drop their stack dims (size 1 on each device)
            x = x.reshape(_local_shape(layout, shape))
        if self.cells is None:
            return x.reshape((1,) * len(self.dst.stacked_axes) + _local_shape(self.dst.layout, shape))
        block = _run_cells(x, self.cells, index, names)
        return block.reshape((1,) * len(self.dst.stacked_axes) + _local_shape(self.dst.layout, shape))

    def _reduce(self, x: jax.Array) -> jax.Array:
        layout = self.src.layout
        mesh = layout.mesh
        names = mesh.axis_names
        partial = layout.partial_axes
        factors: list[int] = []
        position: dict[int, int] = {}
        rest: list[int] = []
        for d, axes in enumerate(self.appended):
            size = x.shape[d]
            for a in axes:
                position[a] = len(factors)
                factors.append(mesh.shape[a])
                size //= mesh.shape[a]
            rest.append(size)
            factors.append(size)
        x = x.reshape(factors)
        for a in sorted(position, key=lambda a: -position[a]):
            if a not in partial:  # a replica: keep only this device's share of the reduction
                x = jax.lax.dynamic_index_in_dim(x, jax.lax.axis_index(names[a]), position[a], keepdims=True)
        lead = [position[a] for a in partial]
        x = jnp.moveaxis(x, lead, list(range(len(lead))))
        k = math.prod(mesh.shape[a] for a in partial)
        x = x.reshape((k, *x.shape[len(lead):]))
        group = tuple(names[a] for a in partial)
        if layout.partial_op == "sum":
            x = jax.lax.psum_scatter(x, group, scatter_dimension=0, tiled=True)
        else:
            x = jax.lax.all_to_all(x, group, 0, 0, tiled=True)
            x = REDUCERS[layout.partial_op](x, axis=(0,))  # type: ignore[index,operator]
        return x.reshape(rest)


def _pick(cells: jax.Array, table: np.ndarray, index: jax.Array) -> jax.Array:
    """``cells[table[index]]``: one dynamic slice per picked cell (a copy each; XLA's CPU
    gather with a per-device index vector is several times slower)."""
    rows = jnp.asarray(table)[index]
    if all(np.array_equal(table[0], row) for row in table):  # the same cells on every device
        return cells[np.asarray(table[0])] if len(table[0]) != len(cells) or np.any(table[0] != np.arange(len(cells))) \
            else cells
    return jnp.stack([jax.lax.dynamic_index_in_dim(cells, rows[j], keepdims=False) for j in range(table.shape[1])])


def _run_cells(x: jax.Array, c: _Cells, index: jax.Array, names: Sequence[str], op: str | None = None,
               k: int = 1) -> jax.Array:
    """A device's block after the cell exchange ``c``: its own cells, and each received
    cell written in place (``op`` None) or combined with the cell there by the partial's
    ``op`` over ``k`` contributions (a reduction step). The block (plus a spare cell)
    starts from the local cells, so no pool of all received cells is staged."""
    cells = _to_cells(x, c.before, c.cell)
    if op is None and c.pooled:
        # All exchanges are all_to_alls: one gather from the local and received cells is
        # faster on small blocks than a write per cell (1.3-1.5x at 16 KiB), and stages
        # no more than the all_to_all's own buffers.
        received = [_exchange(_pick(cells, ex.send, index), ex, names) for ex in c.exchanges]
        block = _pick(jnp.concatenate([cells, *received], axis=0), _pool_table(c), index)
        return _from_cells(_zero_padding(block, c, index), c.after, c.cell)
    start = _zero_padding(_pick(cells, c.local, index), c, index)
    exact_avg = op == "avg" and not jnp.issubdtype(x.dtype, jnp.inexact)
    spare = jnp.zeros((1, *c.cell), x.dtype)
    # Integer avg is floor(sum / k) without overflow (as programs.REDUCERS): sum the
    # quotients and the remainders by k apart.
    block = jnp.concatenate([start // k if exact_avg else start, spare])
    rest = jnp.concatenate([start % k, spare]) if exact_avg else None
    for ex, placed in zip(c.exchanges, c.placed):
        received = _exchange(_pick(cells, ex.send, index), ex, names)
        slots = jnp.asarray(placed)[index]
        for j in range(placed.shape[1]):
            value = received[j]
            if op is not None:
                here = jax.lax.dynamic_index_in_dim(block, slots[j], 0, keepdims=False)
                if exact_avg:
                    there = jax.lax.dynamic_index_in_dim(rest, slots[j], 0, keepdims=False)
                    rest = jax.lax.dynamic_update_index_in_dim(rest, there + value % k, slots[j], 0)
                    value = here + value // k
                else:
                    value = _COMBINE[op](here, value)
            block = jax.lax.dynamic_update_index_in_dim(block, value, slots[j], 0)
    if exact_avg:
        block = block + rest // k
    elif op == "avg":
        block = block / jnp.asarray(k, x.dtype)
    return _from_cells(block[:-1], c.after, c.cell)


def _exchange(send: jax.Array, ex: _Exchange, names: Sequence[str]) -> jax.Array:
    if ex.kind == "all_to_all":
        return jax.lax.all_to_all(send, tuple(names[a] for a in ex.axes), 0, 0, tiled=True)
    return jax.lax.ppermute(send, tuple(names), perm=list(ex.pairs))


def _zero_padding(block: jax.Array, c: _Cells, index: jax.Array) -> jax.Array:
    if c.padding is None:
        return block
    pad = jnp.asarray(c.padding)[index].reshape((-1,) + (1,) * len(c.cell))
    return jnp.where(pad, jnp.zeros((), block.dtype), block)


def _pool_table(c: _Cells) -> np.ndarray:
    """[device, target cell]: its index among the local cells followed by every exchange's
    received cells."""
    table = c.local.copy()
    offset = math.prod(c.before)
    for placed in c.placed:
        for p, row in enumerate(placed):
            for j, t in enumerate(row):
                if t < table.shape[1]:
                    table[p, t] = offset + j
        offset += placed.shape[1]
    return table


_COMBINE = {"sum": jnp.add, "avg": jnp.add, "max": jnp.maximum, "min": jnp.minimum}


def _cell_collectives(c: _Cells, mesh_shape: tuple[int, ...], dtype: str) -> list[Collective]:
    result = []
    for ex in c.exchanges:
        if ex.kind == "all_to_all":
            n = math.prod(mesh_shape[a] for a in ex.axes)
            result.append(Collective("all-to-all", ((n * ex.m, *c.cell),), dtype, _groups(mesh_shape, ex.axes)))
        else:
            result.append(Collective("collective-permute", ((ex.m, *c.cell),), dtype, ex.pairs))
    return result


def _cell_copies(c: _Cells, itemsize: int) -> int:
    """Bytes a cell exchange copies per device: the block cut into cells, the packed and
    the received messages, the target block started and laid out."""
    sent = sum(ex.send.shape[1] for ex in c.exchanges)
    pool = math.prod(c.before) + sent if c.pooled else 0  # the concatenated pool
    return math.prod(c.cell) * itemsize * (math.prod(c.before) + 2 * sent + 2 * math.prod(c.after) + pool)


def _where_wanted(appended: tuple[tuple[int, ...], ...], target: Layout) -> bool:
    """Step 1 put every mesh dim the target splits on the dim the target splits it on."""
    return all(target.mesh_dim_split(a) in (None, d) for d, axes in enumerate(appended) for a in axes)


def _hlo_dtype(dtype: np.dtype) -> str:
    """XLA's name of a dtype (bf16, f32, s32, pred ...)."""
    if dtype.kind == "b":
        return "pred"
    if dtype.name == "bfloat16":
        return "bf16"
    return {"f": "f", "i": "s", "u": "u", "c": "c"}[dtype.kind] + str(dtype.itemsize * 8)


def _local_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Every device's (padded) block."""
    return tuple(chunking.block_size(n, layout.pieces(d)) for d, n in enumerate(shape))


def _groups(mesh_shape: tuple[int, ...], axes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Device groups varying along ``axes`` (mesh positions, group members in mesh order)."""
    ids = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    others = [a for a in range(len(mesh_shape)) if a not in axes]
    ids = ids.transpose(others + sorted(axes)).reshape(-1, math.prod(mesh_shape[a] for a in axes))
    return tuple(tuple(int(v) for v in row) for row in ids)


def _device_index(names: Sequence[str], mesh_shape: Sequence[int]) -> jax.Array:
    index = jnp.int32(0)
    for name, n in zip(names, mesh_shape):
        index = index * n + jax.lax.axis_index(name)
    return index


def _to_cells(x: jax.Array, grid: Sequence[int], cell: Sequence[int]) -> jax.Array:
    r = len(grid)
    x = x.reshape([v for pair in zip(grid, cell) for v in pair])
    x = x.transpose([2 * i for i in range(r)] + [2 * i + 1 for i in range(r)])
    return x.reshape((math.prod(grid), *cell))


def _from_cells(x: jax.Array, grid: Sequence[int], cell: Sequence[int]) -> jax.Array:
    r = len(grid)
    x = x.reshape((*grid, *cell))
    x = x.transpose([i // 2 + (r if i % 2 else 0) for i in range(2 * r)])
    return x.reshape([g * c for g, c in zip(grid, cell)])


def _reduction_plan(
    src: Physical, dst: Physical, even: bool = True
) -> tuple[Layout, tuple[tuple[int, ...], ...]] | None:
    """Step 1's layout: the source's splits plus every partial mesh dim and every mesh dim
    replicated in the source, each appended to the tensor dim the target splits with it
    (else to the dim with the largest divisible block)."""
    layout, target = src.layout, dst.layout
    mesh = layout.mesh
    shape = src.shape
    new = [m for m in range(mesh.ndim) if layout.mesh_dim_split(m) is None]
    blocks = list(_local_shape(layout, shape))
    appended: list[list[int]] = [[] for _ in shape]
    # Axes the target splits first, in the target's order on each dim, then the others.
    ordered = [a for axes in target.dim_axes for a in axes if a in new]
    ordered += [a for a in new if a not in ordered]
    for a in ordered:
        n = mesh.shape[a]
        wanted = target.mesh_dim_split(a)
        options = ([wanted] if wanted is not None else []) + sorted(range(len(shape)), key=lambda d: -blocks[d])
        dim = next((d for d in options if blocks[d] % n == 0 or not even), None)
        if dim is None:
            return None
        appended[dim].append(a)
        blocks[dim] = -(-blocks[dim] // n)
    dim_axes = tuple(tuple(axes) + tuple(extra) for axes, extra in zip(layout.dim_axes, appended))
    return Layout(mesh, dim_axes), tuple(tuple(a) for a in appended)


def _cell_plan(
    before: Layout, after: Layout, shape: tuple[int, ...], fixed: Sequence[int] = (), reduce: Sequence[int] = ()
) -> _Cells | None:
    """Step 2: the cells, who sends which to whom, and the collectives. A device receives
    each cell only from a holder with its own coordinates on the mesh dims ``fixed``
    (kept partial dims: the contributions differ along them). With ``reduce`` (partial
    mesh dims reduced by this exchange; every device holds its own contribution to its
    target cells), it receives each cell once from every other coordinate on them."""
    mesh_shape = before.mesh.shape
    ndev = math.prod(mesh_shape)
    coords = [tuple(int(v) for v in np.unravel_index(p, mesh_shape)) for p in range(ndev)]
    # Each device's torch.chunk block (offset, length) per tensor dim, in both layouts.
    ranges = {
        layout: [[chunking.nested_chunk(n, tuple((mesh_shape[a], c[a]) for a in layout.dim_axes[d]))
                  for d, n in enumerate(shape)] for c in coords]
        for layout in (before, after)
    }
    counts, cell, grid_before, grid_after = [], [], [], []
    for d, n in enumerate(shape):
        # A cell divides every block boundary of both layouts and both (padded) block sizes,
        # so every block is whole cells, its elements first, its padding after.
        b1, b2 = chunking.block_size(n, before.pieces(d)), chunking.block_size(n, after.pieces(d))
        g = math.gcd(n, b1, b2, *(v for layout in (before, after) for r in ranges[layout] for v in r[d]))
        counts.append(n // g)
        cell.append(g)
        grid_before.append(b1 // g)
        grid_after.append(b2 // g)
    if max(math.prod(grid_before), math.prod(grid_after)) > _MAX_CELLS and not (
        before.is_even(shape) and after.is_even(shape)
    ):
        return None  # uneven blocks cut into too many cells: one slice per cell would not pay

    def starts(layout: Layout) -> tuple[list[list[int]], list[list[int]]]:
        """Per device, its block's first cell and number of cells (without padding)."""
        return ([[r[d][0] // cell[d] for d in range(len(shape))] for r in ranges[layout]],
                [[r[d][1] // cell[d] for d in range(len(shape))] for r in ranges[layout]])

    starts_before, lengths_before = starts(before)
    starts_after, lengths_after = starts(after)
    messages: dict[tuple[int, int], list[tuple[int, int]]] = {}
    need: list[list[tuple[int, int, int]]] = []  # per device: (target cell, holder, holder's cell)
    padding = np.zeros((ndev, math.prod(grid_after)), bool)  # target cells past the device's elements
    for p in range(ndev):
        rows = []
        for t in range(math.prod(grid_after)):
            local = _digits(t, grid_after)
            if any(v >= n for v, n in zip(local, lengths_after[p])):
                padding[p, t] = True
                continue
            cell_at = [s + v for s, v in zip(starts_after[p], local)]
            holders = []
            for q in range(ndev):
                offset = [v - s for v, s in zip(cell_at, starts_before[q])]
                if all(0 <= o < n for o, n in zip(offset, lengths_before[q])) and all(
                    coords[q][a] == coords[p][a] for a in fixed
                ):
                    holders.append((q, int(np.ravel_multi_index(offset, grid_before))))
            if reduce:
                rows.append((t, p, next(i for q, i in holders if q == p)))
                others: dict[tuple[int, ...], list[tuple[int, int]]] = {}
                for q, i in holders:
                    key = tuple(coords[q][a] for a in reduce)
                    if key != tuple(coords[p][a] for a in reduce):
                        others.setdefault(key, []).append((q, i))
                for options in others.values():
                    q, i = min(options, key=lambda h: _distance(coords[h[0]], coords[p], mesh_shape))
                    messages.setdefault((q, p), []).append((i, t))
                    rows.append((t, q, i))
                continue
            if any(q == p for q, _ in holders):
                rows.append((t, p, next(i for q, i in holders if q == p)))
                continue
            q, i = min(holders, key=lambda h: _distance(coords[h[0]], coords[p], mesh_shape))
            messages.setdefault((q, p), []).append((i, t))
            rows.append((t, q, i))
        need.append(rows)
    exchanges = _exchanges(messages, coords, mesh_shape, ndev)
    # Every received cell is written in place into the target block (its spare cell, past
    # the end, takes the slots a device does not use: its own slot of an all_to_all).
    n_after = math.prod(grid_after)
    local = np.zeros((ndev, n_after), np.int32)
    wanted: dict[tuple[int, int, int], int] = {}  # (receiver, sender, sender's cell) -> target cell
    for p, rows in enumerate(need):
        for t, q, i in rows:
            if q == p:
                local[p, t] = i
            else:
                wanted[(p, q, i)] = t
    placed = []
    for ex in exchanges:
        table = np.full((ndev, ex.send.shape[1]), n_after, np.int32)
        if ex.kind == "all_to_all":
            for group in _groups(mesh_shape, ex.axes):
                for p in group:
                    for s, q in enumerate(group):
                        for j in range(ex.m):
                            if q != p:
                                table[p, s * ex.m + j] = wanted[(p, q, int(ex.send[q, group.index(p) * ex.m + j]))]
        else:
            for q, p in ex.pairs:
                for j in range(ex.m):
                    table[p, j] = wanted[(p, q, int(ex.send[q, j]))]
        placed.append(table)
    return _Cells(tuple(counts), tuple(cell), tuple(grid_before), tuple(grid_after), exchanges, local, tuple(placed),
                  padding if padding.any() else None)


def _distance(q: tuple[int, ...], p: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Any, ...]:
    """Holder preference: fewest differing mesh coordinates, then the smallest cyclic shifts
    (symmetric choices give uniform traffic, which one all_to_all carries)."""
    return (sum(a != b for a, b in zip(q, p)), tuple((a - b) % n for a, b, n in zip(q, p, mesh_shape)))


def _exchanges(
    messages: dict[tuple[int, int], list[tuple[int, int]]],
    coords: list[tuple[int, ...]],
    mesh_shape: tuple[int, ...],
    ndev: int,
) -> tuple[_Exchange, ...]:
    if not messages:
        return ()
    axes = tuple(a for a in range(len(mesh_shape)) if any(coords[q][a] != coords[p][a] for q, p in messages))
    m = len(next(iter(messages.values())))
    groups = _groups(mesh_shape, axes)
    uniform = all(
        len(messages.get((q, p), ())) == m for group in groups for q in group for p in group if q != p
    ) and sum(len(g) * (len(g) - 1) for g in groups) == len(messages)
    if uniform:
        n = len(groups[0])
        send = np.zeros((ndev, n * m), np.int32)
        for group in groups:
            for q in group:
                for s, p in enumerate(group):
                    if p != q:
                        send[q, s * m : (s + 1) * m] = [i for i, _ in messages[(q, p)]]
        return (_Exchange("all_to_all", axes, (), m, send),)
    # ppermute rounds: pairs of equal size, each round a partial permutation.
    rounds: list[tuple[int, list[tuple[int, int]]]] = []
    for (q, p), cells in sorted(messages.items()):
        size = len(cells)
        for r in rounds:
            if r[0] == size and all(q != a and p != b for a, b in r[1]):
                r[1].append((q, p))
                break
        else:
            rounds.append((size, [(q, p)]))
    result = []
    for size, pairs in rounds:
        send = np.zeros((ndev, size), np.int32)
        for q, p in pairs:
            send[q] = [i for i, _ in messages[(q, p)]]
        result.append(_Exchange("ppermute", tuple(sorted({a for q, p in pairs for a in range(len(mesh_shape))
                                                           if coords[q][a] != coords[p][a]})),
                                tuple(pairs), size, send))
    return tuple(result)
