"""Auto-plan: search the placements of a whole model's parameters (OneFlow's auto-parallel,
Alpa's intra-operator pass, for torch-style placements).

``auto_plan(step_fn, params, *args, mesh=...)`` returns the plan a user would otherwise
write by hand for :func:`~placements2jax.distribute_pytree`: path regex -> placements,
printed in torch form, with its predicted figures and those of the presets beside it:

    plan = auto_plan(train_step, params, opt_state, tokens, targets, mesh=mesh,
                     fixed={"args/1": "S(0),R", "args/2": "S(0),R"},   # the batch on dp
                     presets={"megatron": megatron_plan()})
    print(plan)                                   # rules, bytes per step, memory per device
    params = distribute_pytree(params, mesh, plan)

**What is searched.** Every array leaf of ``params`` (and of ``args``, unless ``fixed=``
pins it) gets one layout; optimizer state follows, as torch's optimizer state follows
DTensor parameters, by :func:`~placements2jax.state_layouts`' rule: a subtree of ``args``
with the parameters' tree structure, each leaf of its parameter's shape (Adam's ``mu`` and
``nu``: the parameter's layout) or that shape with dims dropped or set to 1
(``optax.adafactor``'s factored ``v_row`` and ``v_col``: the splits of the kept dims), is
not searched; other state leaves (step counts) are Replicate. Outputs of
``step_fn`` shaped like ``params`` or like an argument keep that argument's layouts
(updated parameters and state). A leaf's candidates split each mesh axis over one of its
dims (evenly) or none; a leaf scanned over by ``lax.scan`` (stacked layers) keeps its
leading dim whole.

**Objective**: predicted cost per step = the whole-program prediction's communication
(:func:`~placements2jax.inference.predict`, weighted bytes per device, with its
search choosing every intermediate's layout) + compute: every equation's FLOPs (2 M N K
for a matmul, its largest operand's size otherwise; a scan body's times its length)
divided by how many ways its output layout splits the work (mesh dims splitting an
output dim or making it Partial), divided by ``flops_per_byte`` (a device's FLOPs per
byte of interconnect; 1000 is an A100's 312 TFLOP/s over NVLink's 300 GB/s). So
replicating the work never wins for free.

**Memory per device**: parameters + optimizer state + other arguments (their local
shards) + the largest set of intermediates alive at once, walking the predicted program
in order (each value's local bytes under its predicted layout, alive from its equation to
its last use; outputs to the end; a scan body once). It overestimates what XLA's fusion
keeps when XLA partitions the step as predicted (tests/test_autoplan.py states the
tolerance against ``compiled.memory_analysis()``); XLA's own propagation can keep larger
intermediates (docs/autoplan.md). Plans over ``memory_budget`` are rejected.

**Search.** Seeds: replicate, FSDP (:func:`~placements2jax.fully_shard_layouts`'s rule) over
the first mesh axis and over every axis, each preset and each preset fully sharded over
the first axis; the cheapest that fits starts a first-improvement descent: moves that
shard or replicate every leaf over one mesh axis, then paired moves (column/row-parallel
partners of one module, found by shape and the order the step reads them, split together
over one mesh axis Megatron-style, biases following: every group at once, then each
group), then moves of one leaf's placement on one mesh axis, largest leaves first,
until ``max_evaluations`` predictions. With ``score`` naming the executor that will run the
plan (``"xla"``: plain ``jax.jit``, the default; ``"pinned"``: ``apply(..., execute="pinned")``,
the predicted program) the best few plans found and the presets are then compiled for it (two
threads) and the fewest compiled bytes wins: a plan is ranked by the figures of the program
that will run. The step is traced once; each prediction is cached per input layouts; the
search is deterministic (fixed move order, ties keep the earlier plan).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun

from .caches import Memo
from .dtensor import auto_twin_of, is_dtensor
from .errors import ArgumentTypeError, Placements2JaxError, PlanError, ShapeError
from .fsdp import fully_sharded_layout
from .hlo import parse_collectives
from .inference.cost import collective_nbytes
from .inference.cost import CostModelLike
from .inference.jaxpr import Prediction, nested_equations, predict, unrolled_scan
from .inference.signature import TensorSpec
from .inference.table import format_bytes, format_table
from .layout import Layout
from .mesh import DeviceMesh, as_device_mesh
from .operators import pinned_function
from .parallelize import PlanLike, path_of, plan_layouts
from .training import followed_layout, param_followers

__all__ = ["AutoPlan", "CompiledFigures", "PlanFigures", "auto_plan", "compiled_figures", "example_mlp", "plan_figures",
           "planned_inputs"]

DEFAULT_FLOPS_PER_BYTE = 1000.0
DEFAULT_MAX_EVALUATIONS = 24
# the executors a plan's step can be compiled for: plain jax.jit on its shardings (XLA's
# propagation lays out the rest) or the predicted program with every layout pinned (what
# apply(..., execute="pinned") runs); compiled_figures(execute=...) and auto_plan(score=...)
EXECUTIONS = ("xla", "pinned")
SCORES = (*EXECUTIONS, "predict")  # auto_plan ranks its finalists as one executor compiles them, or by prediction
# Scoring needs the partitioned HLO's collectives and the buffer sizes, not fast code: the HLO
# passes (SPMD partitioning, the collective combiners, buffer assignment) run as usual, only
# LLVM's code generation is cheapened (GPT-2 test step on 2x4: same bytes and memory_analysis,
# 19 -> 8 s CPU per compile).
_CHEAP_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
XLA_FINALISTS = 3  # the best searched plans compiled (besides the presets) when score is an executor


@dataclass(frozen=True)
class PlanFigures:
    """A plan's predicted figures per device and per step: communication (``nbytes``
    sent, ``cost`` weighted by the cost model, ``collectives``), compute (``flops`` after
    splitting) and memory (``params``, ``state``, other ``args``, peak ``activations``,
    bytes). ``objective`` is what auto_plan minimizes. ``lowered_nbytes``: the bytes sent
    with the predicted collectives compiled as the mesh's backend compiles them
    (:attr:`~placements2jax.inference.Prediction.lowered_nbytes`: on CPU a reduce-scatter
    is an all-reduce, twice its bytes), what a compile of the predicted program sends
    (None where not computed)."""

    nbytes: float
    cost: float
    collectives: int
    flops: float
    params: int
    state: int
    args: int
    activations: int
    objective: float
    lowered_nbytes: float | None = None

    @property
    def memory(self) -> int:
        """Bytes per device: parameters + optimizer state + arguments + activations."""
        return self.params + self.state + self.args + self.activations


@dataclass(frozen=True)
class CompiledFigures:
    """A plan's step as XLA compiles it, per device: ``nbytes`` sent by the compiled HLO's
    collectives (:func:`~placements2jax.inference.cost.collective_nbytes`), their count, and
    ``memory`` from ``compiled.memory_analysis()`` (arguments + outputs + temporaries -
    aliased buffers)."""

    nbytes: float
    collectives: int
    memory: int


@dataclass(frozen=True)
class AutoPlan(Mapping[str, Layout]):
    """The plan auto_plan chose: a mapping path regex -> Layout of the parameters (so it
    is itself a plan :func:`~placements2jax.distribute_pytree` takes), the layouts of the
    other arguments' array leaves (``args``: path -> Layout), its :class:`PlanFigures`, the
    presets' figures for comparison, the memory budget and the search's effort."""

    mesh: DeviceMesh
    rules: dict[str, Layout]
    args: dict[str, Layout]  # the other arguments' searched or fixed leaves ("args/1": the batch)
    figures: PlanFigures
    presets: dict[str, PlanFigures]
    memory_budget: int | None
    seed: str
    evaluations: int
    seconds: float
    # CPU seconds of the search's predictions (time.thread_time around each predict, which
    # runs on the calling thread: process_time would also count the compiles running beside
    # them in the pool's threads, score="xla" or "pinned")
    predict_seconds: float = 0.0
    fixed: tuple[str, ...] = field(default=())  # paths of the leaves pinned by ``fixed=``
    score: str = "predict"
    # "auto" and the presets as the executor named by score compiles them (score "xla" or "pinned")
    compiled: dict[str, CompiledFigures] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Layout:
        return self.rules[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    @property
    def memory(self) -> int:
        """Bytes per device as checked against ``memory_budget``: the estimate
        (``figures.memory``), or XLA's ``memory_analysis()`` of the compiled plan when that is
        larger (``score`` an executor: its program's; :attr:`memory_source` says which)."""
        return _checked_memory(self.figures, self.compiled.get("auto"))

    @property
    def memory_source(self) -> str:
        """``"XLA"`` when :attr:`memory` is the compiled plan's memory_analysis(), else ``"estimate"``."""
        return "estimate" if self.memory == self.figures.memory else "XLA"

    def torch_form(self) -> dict[str, str]:
        """The rules as a plan literal of text: torch form (``"S(0),R"``), or the alias form
        (``"None,(tp,dp)"``) for a dim split by two mesh dims (str() of a Layout, which
        distribute_pytree parses back)."""
        return {k: str(v) for k, v in self.rules.items()}

    def comparison(self) -> str:
        """A table: this plan and every preset, per device per step."""
        budget = self.memory_budget
        rows = []
        for name, f in [("auto", self.figures), *self.presets.items()]:
            fits = "" if budget is None else ("yes" if _checked_memory(f, self.compiled.get(name)) <= budget else "no")
            row = (name, format_bytes(f.nbytes), f.collectives, f"{f.flops:.3g}", format_bytes(f.memory),
                   format_bytes(f.activations), fits, f"{f.objective:.4g}")
            if self.compiled:
                c = self.compiled.get(name)
                row += ("not compiled", "", "") if c is None else (format_bytes(c.nbytes), c.collectives, format_bytes(c.memory))
            rows.append(row)
        headers = ("plan", "bytes/step", "collectives", "flops", "memory/device", "activations", "fits", "objective")
        if self.compiled:
            by = "XLA" if self.score == "xla" else self.score  # the compiled program: plain jax.jit's or pinned
            headers += (f"{by} bytes/step", f"{by} collectives", f"{by} memory")
        return format_table(headers, rows)

    def __str__(self) -> str:
        rows = [(k, str(v), "fixed" if k in self.fixed else "")
                for k, v in [*self.rules.items(), *self.args.items()]]
        rules = format_table(("path", "placements", ""), rows)
        budget = "none" if self.memory_budget is None else f"{format_bytes(self.memory_budget)} B"
        source = "XLA's memory_analysis(), above the estimate" if self.memory_source == "XLA" else (
            "the estimate, XLA's memory_analysis() no larger" if "auto" in self.compiled else "the estimate")
        return (
            f"auto plan on mesh {self.mesh.axis_names} {tuple(self.mesh.shape)} (memory budget {budget}; "
            f"from seed {self.seed!r}, {self.evaluations} predictions, scored by {self.score})\n"
            f"{rules}\nmemory per device: {format_bytes(self.memory)} B ({source}); "
            f"'fits' checks the larger of the estimate and XLA's figure\n{self.comparison()}"
        )


def _checked_memory(figures: PlanFigures, compiled: CompiledFigures | None) -> int:
    """A plan's memory per device as checked against a budget: the estimate, or XLA's
    memory_analysis() when the plan was compiled and XLA keeps more (the estimate is no bound
    when XLA's propagation lays the intermediates out otherwise than predict: docs/autoplan.md)."""
    return figures.memory if compiled is None else max(figures.memory, compiled.memory)


# -- the problem: leaves, their roles and candidate layouts --------------------------------------


@dataclass(frozen=True)
class _Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stacked: bool  # scanned over: dim 0 stays whole
    first_use: tuple[int, ...] = ()  # where the step first reads it (equation indices, outer first); () unknown


class _Problem:
    """The step's inputs flattened: free leaves (parameters, then searchable argument
    leaves), fixed leaves, optimizer-state leaves following a parameter, other leaves."""

    def __init__(self, step_fn: Callable[..., Any], params: Any, args: tuple[Any, ...], mesh: DeviceMesh,
                 fixed: Mapping[str, Any] | None) -> None:
        self.step_fn, self.mesh = step_fn, mesh
        self.inputs = (params, *args)
        key_leaves, self.tree = jax.tree_util.tree_flatten_with_path(self.inputs, is_leaf=is_dtensor)
        for key_path, leaf in key_leaves:  # before any leaf's shape is read
            _check_leaf(key_path, leaf)
        param_tree = jax.tree.structure(params, is_leaf=is_dtensor)
        param_shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params, is_leaf=is_dtensor)]
        n_params = len(param_shapes)
        # which argument leaves follow which parameter: subtrees of args with the params' structure,
        # each leaf its parameter's shape or a statistic of it (init_optimizer_state's rule)
        self.follows: dict[int, int] = {}
        offset = n_params
        for arg in args:
            followers = param_followers(arg, param_tree, param_shapes)
            self.follows.update({offset + j: k for j, k in enumerate(followers) if k is not None})
            offset += len(followers)
        self.paths: list[str] = []
        self.kinds: list[str] = []  # "param", "state", "arg", "other"
        self.leaves: list[Any] = []
        for i, (key_path, leaf) in enumerate(key_leaves):
            path = path_of(key_path[1:]) if i < n_params else "args/" + path_of(
                (jax.tree_util.SequenceKey(key_path[0].idx - 1), *key_path[1:]))
            self.paths.append(path)
            self.leaves.append(leaf)
            self.kinds.append("param" if i < n_params else "state" if i in self.follows else
                              "arg" if _searchable(leaf) else "other")
        self.n_params = n_params
        self.fixed = self._fixed(fixed)
        self.stacked, self.first_use = self._scan_and_use()
        self.free = [i for i, k in enumerate(self.kinds) if k in ("param", "arg") and i not in self.fixed]
        self.out_match = self._out_match()

    def _out_match(self) -> Any:
        """Per top-level output of ``step_fn`` (or the whole result): the index of the
        input it is shaped like (updated parameters, optimizer state), else None."""
        structs = [_struct_tree(x) for x in self.inputs]
        shapes = self.out_shapes  # traced by _scan_and_use

        def match(out: Any) -> int | None:
            for k, x in enumerate(structs):
                leaves = jax.tree.leaves(x)
                if leaves and jax.tree.structure(out) == jax.tree.structure(x) and all(
                        tuple(a.shape) == tuple(b.shape) for a, b in zip(leaves, jax.tree.leaves(out))):
                    return k
            return None

        whole = match(shapes)
        if whole is not None or not isinstance(shapes, tuple):
            return whole
        return tuple(match(out) for out in shapes)

    def flat_out_layouts(self, inputs: tuple[Any, ...]) -> list[Layout | None]:
        """:meth:`out_layouts` per output leaf of the step (what :attr:`replay` returns)."""
        outs = self.out_shapes if isinstance(self.out_match, tuple) else (self.out_shapes,)
        matches = self.out_match if isinstance(self.out_match, tuple) else (self.out_match,)
        layouts = self.out_layouts(inputs)
        layouts = layouts if isinstance(self.out_match, tuple) else (layouts,)
        flat: list[Layout | None] = []
        for out, k, tree in zip(outs, matches, layouts):
            n = len(jax.tree.leaves(out))
            flat += [None] * n if k is None else jax.tree.leaves(
                tree, is_leaf=lambda x: x is None or isinstance(x, Layout))
        return flat

    def out_layouts(self, inputs: tuple[Any, ...]) -> Any:
        def layouts(k: int | None) -> Any:
            return None if k is None else jax.tree.map(lambda s: s.layout if isinstance(s, TensorSpec) else None,
                                                       inputs[k])

        if isinstance(self.out_match, tuple):
            return tuple(layouts(k) for k in self.out_match)
        return layouts(self.out_match)

    def _fixed(self, fixed: Mapping[str, Any] | None) -> dict[int, Layout]:
        if fixed is None:
            return {}
        if not isinstance(fixed, Mapping):
            raise ArgumentTypeError("fixed", fixed, "expected a mapping path regex -> placements",
                                    'pass e.g. {"args/1": "S(0),R"}')
        out: dict[int, Layout] = {}
        for regex, value in fixed.items():
            if not isinstance(regex, str):
                raise ArgumentTypeError("fixed", regex, "a key must be a path regex", 'write e.g. "args/1"')
            try:
                pattern = re.compile(regex)
            except re.error as error:
                raise PlanError(f"fixed[{regex!r}]", regex, f"not a regular expression ({error})",
                                "fix the regex") from None
            hits = [i for i, p in enumerate(self.paths) if pattern.fullmatch(p) and self.kinds[i] in ("param", "arg")]
            if not hits:
                shown = ", ".join(repr(p) for p, k in zip(self.paths, self.kinds) if k in ("param", "arg"))
                raise PlanError("fixed", regex, f"matches no parameter or argument path (paths: {shown})",
                                "fix the regex: it must match a whole path, e.g. 'wte' or 'args/1'")
            for i in hits:
                try:
                    out[i] = plan_layouts({"x": self.leaves[i]}, self.mesh, {"x": value})["x"]
                except Placements2JaxError as error:
                    raise error.for_argument(f"fixed[{regex!r}]", value) from None
        return out

    def _scan_and_use(self) -> tuple[set[int], dict[int, tuple[int, ...]]]:
        """Input leaves read as a scan's scanned operand (stacked layers), and where each
        input leaf is first read (the order of the forward pass: paired moves' partners)."""
        specs = self.specs({i: _replicated(self.mesh, leaf) for i, leaf in enumerate(self.leaves) if _array(leaf)})
        structs = [jax.ShapeDtypeStruct(s.shape, s.dtype) if isinstance(s, TensorSpec) else s for s in specs]
        # the step traced once: predict and the scoring compiles re-trace this jaxpr
        # (jaxpr_as_fun), not the model, its autodiff and optimizer (GPT-2 4 layers: ~1 s a
        # trace); one replay per step and input types, so predict's cache serves every call
        # planning the same step (plan_figures, auto_plan at two budgets)
        key = (self.step_fn, self.tree, tuple((np.shape(s), str(getattr(s, "dtype", type(s)))) for s in structs))
        self.trace_key = key
        traced = _traces.recall(key)
        if traced is None:
            closed, shapes = jax.make_jaxpr(lambda *flat: self.step_fn(*jax.tree.unflatten(self.tree, flat)),
                                            return_shape=True)(*structs)
            traced = (closed, jaxpr_as_fun(closed), shapes)
            _traces.remember(key, traced)
        closed, self.replay, self.out_shapes = traced
        # one pass through scans and calls: a leaf is stacked when a scan reads it as a scanned
        # operand (after its constants and carries), first used at the first equation not
        # entered (neither scan nor call) reading it
        found: set[int] = set()
        uses: dict[int, tuple[int, ...]] = {}
        for seen in nested_equations(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars)}):
            if seen.eqn.primitive.name == "scan":
                skip = seen.eqn.params["num_consts"] + seen.eqn.params["num_carry"]
                found.update(i for i in seen.reads[skip:] if i is not None)
            if seen.body is None:
                for i in seen.reads:
                    if i is not None:
                        uses.setdefault(i, seen.path)
        return found, uses

    def specs(self, layouts: Mapping[int, Layout]) -> list[Any]:
        """The flat inputs of predict: TensorSpecs for laid-out leaves, others as given."""
        out = []
        for i, leaf in enumerate(self.leaves):
            if i in layouts:
                out.append(TensorSpec(tuple(np.shape(leaf)), _dtype(leaf), layouts[i]))
            else:
                out.append(leaf)
        return out

    def leaf_info(self, i: int) -> _Leaf:
        return _Leaf(self.paths[i], tuple(np.shape(self.leaves[i])), _dtype(self.leaves[i]), i in self.stacked,
                     self.first_use.get(i, ()))

    def layouts_of(self, free: Mapping[int, Layout]) -> dict[int, Layout]:
        """Every laid-out leaf's layout: free and fixed ones, state following its parameter,
        the other searchable leaves Replicate."""
        out = {**free, **self.fixed}
        for i, k in enumerate(self.kinds):
            if k == "state":
                param = self.follows[i]
                out[i] = followed_layout(out[param], np.shape(self.leaves[param]), np.shape(self.leaves[i]))
            elif i not in out and (k != "other" or _array(self.leaves[i])):
                out[i] = _replicated(self.mesh, self.leaves[i])
        return out


# the traced steps: (step_fn, input tree, shapes and dtypes) -> (closed jaxpr, its replay, out shapes)
_traces = Memo(8)
# the compiled figures: (trace key, every laid-out leaf's layout) -> CompiledFigures or None (uneven)
_compiles = Memo(64)


def _check_leaf(key_path: Any, leaf: Any) -> None:
    """A leaf of ``(params, *args)`` at ``key_path``: an array, its ShapeDtypeStruct, a
    DTensor, a PRNG key or a number (what the step is traced on), else ArgumentTypeError
    naming it (JAX's own error names a lambda of ours). A class is not a leaf whatever
    attributes it declares: ``np.float32`` has ``shape`` and ``dtype`` descriptors (a
    ``(shape, dtype)`` pair, predict's spec form, put one here: a raw TypeError later)."""
    if isinstance(leaf, (bool, int, float, complex)) or (
            isinstance(getattr(leaf, "shape", None), tuple) and getattr(leaf, "dtype", None) is not None):
        return
    where = "params" if key_path[0].idx == 0 else f"args[{key_path[0].idx - 1}]"
    raise ArgumentTypeError(
        where + jax.tree_util.keystr(tuple(key_path[1:])), leaf,
        "a leaf must be an array, a jax.ShapeDtypeStruct, a DTensor, a PRNG key or a number",
        "bind static values (strings, functions, configs) into step_fn with functools.partial; give a shape "
        "and dtype as jax.ShapeDtypeStruct(shape, dtype)",
    )


def _array(leaf: Any) -> bool:
    """An array (or its ShapeDtypeStruct) of numbers: not a PRNG key, not a Python scalar."""
    if getattr(leaf, "shape", None) is None or getattr(leaf, "dtype", None) is None:
        return False
    return not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _searchable(leaf: Any) -> bool:
    return _array(leaf) and len(leaf.shape) > 0


def _dtype(leaf: Any) -> np.dtype:
    return np.dtype(leaf.dtype)


def _replicated(mesh: DeviceMesh, leaf: Any) -> Layout:
    return Layout(mesh, ((),) * len(np.shape(leaf)))


def _scan_lengths(jaxpr: Any) -> dict[str, int]:
    """The length of every scan by the walker's equation path (an unrolled scan's as the
    walker walks it: a call of a scan of ``length // k`` iterations and the remainder's
    copies, :func:`.inference.jaxpr.unrolled_scan`)."""
    return {".".join(map(str, seen.path)): int(seen.eqn.params["length"])
            for seen in nested_equations(jaxpr, unroll=True)
            if seen.eqn.primitive.name == "scan" and unrolled_scan(seen.eqn) is None}


def _candidates(leaf: _Leaf, layout: Layout) -> list[Layout]:
    """``layout`` with one mesh dim moved: off the leaf (Replicate) or onto another dim
    it splits evenly (appended as the dim's minor axis); a stacked leaf's dim 0 stays whole."""
    mesh = layout.mesh
    out: list[Layout] = []
    for m in range(mesh.ndim):
        base = tuple(tuple(a for a in axes if a != m) for axes in layout.dim_axes)
        options = [base]
        for d in range(len(leaf.shape)):
            if leaf.stacked and d == 0:
                continue
            pieces = math.prod(mesh.shape[a] for a in base[d]) * mesh.shape[m]
            if leaf.shape[d] % pieces == 0:
                options.append(tuple(axes + (m,) if e == d else axes for e, axes in enumerate(base)))
        for dim_axes in options:
            if dim_axes != layout.dim_axes:
                candidate = Layout(mesh, dim_axes)
                if candidate not in out:
                    out.append(candidate)
    return out


def _moved(leaf: _Leaf, layout: Layout, m: int, d: int) -> Layout | None:
    """``layout`` with mesh dim ``m`` moved onto dim ``d`` (its minor axis), None when
    ``d`` would not split evenly."""
    base = tuple(tuple(a for a in axes if a != m) for axes in layout.dim_axes)
    if leaf.shape[d] % (math.prod(layout.mesh.shape[a] for a in base[d]) * layout.mesh.shape[m]):
        return None
    return Layout(layout.mesh, tuple(axes + (m,) if e == d else axes for e, axes in enumerate(base)))


_KERNELS = ("kernel", "weight")  # a linear layer's matrix leaf (Flax, Haiku / torch); its bias is "bias"


@dataclass(frozen=True)
class _Group:
    """Megatron's partners over one hidden dim: ``columns`` (n, k_i) write it (split on
    their last dim), ``row`` (k, n) reads it (split on its first dim); their biases follow
    (a column's split like its last dim, the row's replicated)."""

    columns: tuple[int, ...]
    row: int
    column_biases: tuple[int, ...] = ()
    row_bias: int | None = None


def _pairs(infos: Mapping[int, _Leaf]) -> list[_Group]:
    """Column/row-parallel partners within one module (the linear layers' paths equal but
    for their last part; a ``kernel`` / ``weight`` leaf names its layer by its parent): a
    row leaf ``b`` of matrix shape (k, n) (after a stacked leaf's dim 0) and the column
    leaves ``a`` (n, k') read before it in the step (:attr:`_Leaf.first_use`; unknown: any
    order) with k' a multiple of k (GPT-2's fused c_attn (d, 3d) with c_proj (d, d)) or
    dividing it (Llama's grouped kv heads wk (d, d/2) with wo (d, d)). A row leaf is no
    other's column; a column joins the first row read after it. Biases (``<layer>/bias``)
    follow their kernel."""

    def matrix(leaf: _Leaf) -> tuple[int, ...]:
        return leaf.shape[1:] if leaf.stacked else leaf.shape

    def layer(leaf: _Leaf) -> str:
        parts = leaf.path.split("/")
        return "/".join(parts[:-1] if parts[-1] in _KERNELS else parts)

    def module(leaf: _Leaf) -> str:
        return "/".join(layer(leaf).split("/")[:-1])

    def before(a: _Leaf, b: _Leaf) -> bool:
        return not a.first_use or not b.first_use or a.first_use < b.first_use

    def partners(a: int, b: int) -> bool:
        la, lb = infos[a], infos[b]
        ma, mb = matrix(la), matrix(lb)
        return (a != b and len(ma) == len(mb) == 2 and module(la) == module(lb) and ma[0] == mb[1]
                and (ma[1] % mb[0] == 0 or mb[0] % ma[1] == 0) and before(la, lb))

    order = sorted(infos, key=lambda i: (infos[i].first_use, i))
    rows = [b for b in order if any(partners(a, b) for a in infos)]
    columns: dict[int, list[int]] = {b: [] for b in rows}
    for a in order:
        if a not in columns:
            b = next((b for b in rows if partners(a, b)), None)
            if b is not None:
                columns[b].append(a)
    bias = {leaf.path.rsplit("/", 1)[0]: i for i, leaf in infos.items() if leaf.path.rsplit("/", 1)[-1] == "bias"}

    def bias_of(i: int) -> int | None:
        return bias.get(layer(infos[i])) if infos[i].path.rsplit("/", 1)[-1] in _KERNELS else None

    groups = []
    for b in rows:
        if columns[b]:
            cols = tuple(columns[b])
            groups.append(_Group(cols, b, tuple(c for c in map(bias_of, cols) if c is not None), bias_of(b)))
    return groups


def _paired(infos: Mapping[int, _Leaf], current: Mapping[int, Layout], groups: Sequence[_Group],
            m: int) -> dict[int, Layout] | None:
    """Every group of ``groups`` split Megatron-style over mesh dim ``m``: the columns on
    their last dim, the row on its first, column biases on their last dim (when it
    divides), the row's bias replicated over ``m``; a group whose matrices do not all
    split evenly stays; None when none moves."""
    out, moved = dict(current), False
    for group in groups:
        row = infos[group.row]
        split = {a: _moved(infos[a], current[a], m, len(infos[a].shape) - 1) for a in group.columns}
        split[group.row] = _moved(row, current[group.row], m, 1 if row.stacked else 0)
        if any(layout is None for layout in split.values()):
            continue
        for c in group.column_biases:
            split[c] = _moved(infos[c], current[c], m, len(infos[c].shape) - 1) or current[c]
        if group.row_bias is not None:
            split[group.row_bias] = _replicated_over(current[group.row_bias], m)
        out.update(split)
        moved = True
    return out if moved else None


def _sharded_over(leaf: _Leaf, layout: Layout, m: int) -> Layout:
    """``layout`` split over mesh dim ``m`` too, by FSDP's rule (:mod:`.fsdp`: the largest
    dim it divides, as the dim's minor axis), a stacked leaf's dim 0 excluded (its extent
    given as 0, which FSDP's rule never picks)."""
    shape = (0, *leaf.shape[1:]) if leaf.stacked else leaf.shape
    return fully_sharded_layout(layout, shape, m, leaf.path)


def _replicated_over(layout: Layout, m: int) -> Layout:
    return Layout(layout.mesh, tuple(tuple(a for a in axes if a != m) for axes in layout.dim_axes))


# -- evaluation ----------------------------------------------------------------------------------


def _local_bytes(spec: TensorSpec) -> int:
    """The bytes of one device's block (the largest, padded as the physical array is)."""
    layout = spec.layout
    shape = layout.physical_shape(spec.shape) if spec.shape else ()
    pieces = [math.prod(layout.pieces(d)) for d in range(len(shape))]
    return int(math.prod(n // k for n, k in zip(shape, pieces))) * spec.dtype.itemsize


def _split(spec: TensorSpec) -> int:
    layout = spec.layout
    dims = {m for axes in layout.dim_axes for m in axes} | set(layout.partial_axes)
    return math.prod(layout.mesh.shape[m] for m in dims)


def _flops(primitive: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> float:
    sizes = [math.prod(s.shape) for s in (*inputs, *outputs)]
    if primitive == "dot_general" and len(inputs) == 2 and outputs:
        return 2.0 * math.sqrt(float(sizes[0]) * sizes[1] * sizes[2])  # 2 B M N K
    return float(max(sizes, default=0))


def _compute_and_activations(prediction: Prediction, lengths: Mapping[str, int]) -> tuple[float, int]:
    """(FLOPs per device after splitting, peak bytes of intermediates alive at once)."""
    rows = [r for r in prediction.equations if r.signature is not None or r.primitive in ("scan", "while", "cond")]
    flops = 0.0
    last_use: dict[Any, int] = {}
    for position, row in enumerate(rows):
        for source in row.sources:
            if source is not None:
                last_use[source] = position
        if row.signature is None or not row.outputs:
            continue
        times = 1
        parts = row.path.split(".")
        for k in range(1, len(parts)):
            times *= lengths.get(".".join(parts[:k]), 1)
        flops += times * _flops(row.primitive, row.inputs, row.outputs) / _split(row.outputs[0])
    alive, peak = 0, 0
    dying: dict[int, int] = {}
    end = len(rows)
    for position, row in enumerate(rows):
        for j, spec in enumerate(row.outputs):
            nbytes = _local_bytes(spec)
            alive += nbytes
            dying[last_use.get((row.path, j), end)] = dying.get(last_use.get((row.path, j), end), 0) + nbytes
        peak = max(peak, alive)
        alive -= dying.pop(position, 0)
    return flops, peak


class _Evaluator:
    def __init__(self, problem: _Problem, cost_model: CostModelLike, flops_per_byte: float,
                 execute: str = "xla") -> None:
        self.problem = problem
        self.cost_model = cost_model
        self.flops_per_byte = flops_per_byte
        self.execute = execute  # the executor :meth:`compile` compiles for (EXECUTIONS)
        self.count = 0
        self.predict_seconds = 0.0  # thread CPU time of the predictions (AutoPlan.predict_seconds)
        self.memo: dict[tuple[Any, ...], PlanFigures] = {}
        self.plans: dict[tuple[Any, ...], dict[int, Layout]] = {}  # in evaluation order
        self.compiled: dict[tuple[Any, ...], CompiledFigures | None] = {}
        self.pending: dict[tuple[Any, ...], Future[CompiledFigures | None]] = {}
        self.pool: ThreadPoolExecutor | None = None  # set by auto_plan when score is an executor
        self.lengths: dict[str, int] | None = None

    def __call__(self, free: Mapping[int, Layout]) -> PlanFigures:
        key = tuple(free[i] for i in self.problem.free)
        known = self.memo.get(key)
        if known is not None:
            return known
        problem = self.problem
        layouts = problem.layouts_of(free)
        flat = problem.specs(layouts)
        started = time.thread_time()
        prediction = _prediction(problem, layouts, self.cost_model)
        self.predict_seconds += time.thread_time() - started
        self.count += 1
        if self.lengths is None:
            self.lengths = _scan_lengths(prediction.jaxpr.jaxpr)
        flops, activations = _compute_and_activations(prediction, self.lengths)
        memory = {"param": 0, "state": 0, "arg": 0}
        for i, spec in enumerate(flat):
            if isinstance(spec, TensorSpec):
                memory[problem.kinds[i] if problem.kinds[i] in memory else "arg"] += _local_bytes(spec)
        cost = float(prediction.cost)
        figures = PlanFigures(
            nbytes=float(prediction.nbytes), cost=cost, collectives=sum(prediction.collectives.values()),
            flops=flops, params=memory["param"], state=memory["state"], args=memory["arg"],
            activations=activations, objective=cost + flops / self.flops_per_byte,
            lowered_nbytes=float(prediction.lowered_nbytes),
        )
        self.memo[key] = figures
        self.plans[key] = dict(free)
        return figures

    def key(self, free: Mapping[int, Layout]) -> tuple[Any, ...]:
        return tuple(free[i] for i in self.problem.free)

    def compile(self, free: Mapping[int, Layout]) -> CompiledFigures | None:
        """The step compiled by XLA on the plan's shardings for :attr:`execute` (plain jax.jit,
        Auto mesh axes, outputs shaped like an input keeping its layouts, as check compiles
        it; or the predicted program pinned): its collectives' bytes and its
        memory_analysis(). None when a leaf's layout is uneven (XLA needs evenly divisible
        shards; the DTensor pads them instead). Waits for :meth:`start_compile`'s compilation
        of the plan, if any."""
        key = self.key(free)
        if key not in self.compiled:
            pending = self.pending.pop(key, None)
            self.compiled[key] = pending.result() if pending is not None else _compile(
                self.problem, free, self.execute, self.cost_model)
        return self.compiled[key]

    def start_compile(self, free: Mapping[int, Layout]) -> None:
        """Compile the plan in the background (XLA releases the GIL while it compiles: the
        search's predictions go on meanwhile on the other core); :meth:`compile` collects it.
        A pinned compile's prediction is the one the search made of the plan on the calling
        thread, a hit of predict's cache here (every plan compiled was evaluated first; made
        again in the pool's thread only if the cache was emptied meanwhile)."""
        key = self.key(free)
        if self.pool is not None and key not in self.compiled and key not in self.pending:
            self.pending[key] = self.pool.submit(_compile, self.problem, dict(free), self.execute,
                                                 self.cost_model)

    def static_memory(self, free: Mapping[int, Layout]) -> int:
        """Parameters + state + arguments (no prediction needed)."""
        layouts = self.problem.layouts_of(free)
        return sum(_local_bytes(s) for s in self.problem.specs(layouts) if isinstance(s, TensorSpec))


def _compile(problem: _Problem, free: Mapping[int, Layout], execute: str = "xla",
             cost_model: CostModelLike = None) -> CompiledFigures | None:
    """:meth:`_Evaluator.compile`'s work (thread-safe: reads ``problem`` only), cached per
    traced step, layouts and execution (``_compiles``: plan_figures' and repeated auto_plan
    calls' compiles of one plan are one). ``execute``: :data:`EXECUTIONS`."""
    layouts = problem.layouts_of(free)
    if not all(layout.is_even(tuple(np.shape(problem.leaves[i]))) for i, layout in layouts.items()):
        return None
    key = (problem.trace_key, tuple(sorted(layouts.items())), execute, cost_model if execute == "pinned" else None)
    known = _compiles.recall(key)
    if known is None:
        known = _compiled_figures(problem, layouts, execute, cost_model)
        _compiles.remember(key, known)
    return known


def _prediction(problem: _Problem, layouts: Mapping[int, Layout], cost_model: CostModelLike) -> Prediction:
    """The whole-program prediction of the step on ``layouts`` (every laid-out leaf's), as
    the search predicts it (predict caches it per input layouts)."""
    flat = problem.specs(layouts)
    out_layouts = problem.flat_out_layouts(jax.tree.unflatten(problem.tree, flat))
    return predict(problem.replay, *flat, cost_model=cost_model, out_layouts=out_layouts)


def _compiled_figures(problem: _Problem, layouts: Mapping[int, Layout], execute: str,
                      cost_model: CostModelLike) -> CompiledFigures:
    """The step compiled on the plan's shardings: as plain ``jax.jit`` compiles it
    (``"xla"``: XLA's propagation lays out the intermediates), or the predicted program with
    every layout pinned (``"pinned"``: what ``apply(..., execute="pinned")`` runs,
    :func:`~placements2jax.operators.pinned_function`)."""
    mesh = auto_twin_of(problem.mesh.to_jax())

    def struct(i: int, leaf: Any) -> Any:
        if i not in layouts:
            return leaf
        sharding = jax.sharding.NamedSharding(mesh, layouts[i].partition_spec)
        return jax.ShapeDtypeStruct(tuple(np.shape(leaf)), _dtype(leaf), sharding=sharding)

    flat = [struct(i, leaf) for i, leaf in enumerate(problem.leaves)]
    out_layouts = problem.flat_out_layouts(jax.tree.unflatten(problem.tree, problem.specs(layouts)))
    out_shardings = [None if layout is None else jax.sharding.NamedSharding(mesh, layout.partition_spec)
                     for layout in out_layouts]
    step = problem.replay if execute == "xla" else pinned_function(_prediction(problem, layouts, cost_model), cost_model)
    compiled = jax.jit(step, out_shardings=out_shardings).lower(*flat).compile(compiler_options=_CHEAP_CODEGEN)
    collectives = parse_collectives(compiled.as_text())
    stats = compiled.memory_analysis()
    memory = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
              - stats.alias_size_in_bytes)
    return CompiledFigures(nbytes=float(sum(collective_nbytes(c, problem.mesh.size()) for c in collectives)),
                           collectives=len(collectives), memory=int(memory))


def _struct_tree(x: Any) -> Any:
    def struct(leaf: Any) -> Any:
        if isinstance(leaf, TensorSpec) or is_dtensor(leaf):
            return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
        return leaf

    return jax.tree.map(struct, x, is_leaf=is_dtensor)


# -- the search ----------------------------------------------------------------------------------


def plan_figures(
    step_fn: Callable[..., Any], params: Any, *args: Any, mesh: DeviceMesh, plan: PlanLike,
    fixed: Mapping[str, Any] | None = None, cost_model: CostModelLike = None,
    flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
) -> PlanFigures:
    """The :class:`PlanFigures` of ``step_fn`` with ``params`` laid out by ``plan`` (a
    :func:`distribute_pytree` plan), optimizer state following, ``fixed`` leaves pinned
    (see :func:`auto_plan`)."""
    mesh = as_device_mesh(mesh, "mesh")
    problem = _Problem(_check_fn(step_fn), params, args, mesh, fixed)
    evaluator = _Evaluator(problem, cost_model, _check_ratio(flops_per_byte))
    return evaluator(_from_plan(problem, plan))


def compiled_figures(
    step_fn: Callable[..., Any], params: Any, *args: Any, mesh: DeviceMesh, plan: PlanLike,
    fixed: Mapping[str, Any] | None = None, execute: str = "xla", cost_model: CostModelLike = None,
) -> CompiledFigures | None:
    """The :class:`CompiledFigures` of ``step_fn`` with ``params`` laid out by ``plan``
    (optimizer state following, ``fixed`` leaves pinned, an AutoPlan's ``args`` layouts
    kept); None when a leaf would be split unevenly (XLA compiles only even shards).

    ``execute="xla"`` (default): plain ``jax.jit`` on the plan's input and output
    shardings, XLA's propagation laying out the rest, as ``auto_plan(..., score="xla")``
    (the default) compiles its finalists (and cached with them: an auto_plan call after it reuses the
    compile); ``max(plan_figures(...).memory, compiled_figures(...).memory)`` is the plan's
    memory as auto_plan checks it against a budget. ``execute="pinned"``: the predicted
    program (``cost_model``'s prediction, as :func:`plan_figures` makes it) with every
    layout pinned, as ``apply(..., execute="pinned")`` runs the step: the program whose
    bytes the prediction states, as ``auto_plan(..., score="pinned")`` compiles its finalists."""
    mesh = as_device_mesh(mesh, "mesh")
    if not isinstance(execute, str) or execute not in EXECUTIONS:
        raise ArgumentTypeError("execute", execute, f"expected one of {', '.join(map(repr, EXECUTIONS))}",
                                'pass execute="xla" (plain jax.jit) or execute="pinned" (the predicted program)')
    problem = _Problem(_check_fn(step_fn), params, args, mesh, _with_plan_args(plan, fixed))
    return _compile(problem, _from_plan(problem, plan), execute, cost_model)


def planned_inputs(
    step_fn: Callable[..., Any], params: Any, *args: Any, mesh: DeviceMesh, plan: PlanLike,
    fixed: Mapping[str, Any] | None = None,
) -> tuple[tuple[Any, ...], Any]:
    """``((params, *args), out_layouts)`` as :func:`~placements2jax.predict` and
    :func:`~placements2jax.check` take them for ``plan`` (an AutoPlan or any plan): array
    leaves as TensorSpecs in their layouts (optimizer state following, ``fixed`` pinned,
    an AutoPlan's ``args`` layouts kept), outputs shaped like an input keeping its layouts."""
    mesh = as_device_mesh(mesh, "mesh")
    problem = _Problem(_check_fn(step_fn), params, args, mesh, _with_plan_args(plan, fixed))
    inputs = jax.tree.unflatten(problem.tree, problem.specs(problem.layouts_of(_from_plan(problem, plan))))
    return inputs, problem.out_layouts(inputs)


def _with_plan_args(plan: PlanLike, fixed: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``fixed`` with an AutoPlan's argument layouts (``plan.args``) pinned too (``fixed`` wins)."""
    if not isinstance(plan, AutoPlan):
        return fixed
    return {**{re.escape(k): v for k, v in plan.args.items()}, **(fixed or {})}


def _from_plan(problem: _Problem, plan: PlanLike) -> dict[int, Layout]:
    params = jax.tree.unflatten(jax.tree.structure(problem.inputs[0]), problem.leaves[:problem.n_params])
    layouts = jax.tree.leaves(plan_layouts(params, problem.mesh, plan, strict=False),
                              is_leaf=lambda x: isinstance(x, Layout))
    return {i: layouts[i] if i < problem.n_params else _replicated(problem.mesh, problem.leaves[i])
            for i in problem.free}


def auto_plan(
    step_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    mesh: DeviceMesh,
    memory_budget: int | None = None,
    fixed: Mapping[str, Any] | None = None,
    presets: Mapping[str, PlanLike] | None = None,
    cost_model: CostModelLike = None,
    flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
    score: str = "xla",
) -> AutoPlan:
    """Search the placements of every parameter of ``step_fn(params, *args)`` (module
    docstring) minimizing predicted cost per step under ``memory_budget`` (bytes per
    device, None: unbounded).

    ``params`` and ``args`` are pytrees of arrays or ``jax.ShapeDtypeStruct``s (from
    ``jax.eval_shape``: nothing is computed), PRNG keys and scalars. ``fixed`` pins leaves:
    path regex -> placements, parameter paths as in plans (``"wte"``), argument leaves as
    ``"args/<k>/..."`` (``k`` counts ``args`` from 0, e.g. ``{"args/1": "S(0),R"}`` for
    a batch split over the first mesh axis). ``presets``: name -> plan, shown beside the
    result and used as seeds (FSDP over the first mesh axis is always added as
    ``"fsdp"``). ``max_evaluations`` bounds the number of predictions.

    ``score``: the executor that will run the plan, whose compiled figures rank the
    finalists: the step is compiled on the best few plans the search found
    (:data:`XLA_FINALISTS`, by predicted objective, among those that fit) and on the presets,
    and the one compiled to the fewest bytes sent per device is returned (ties: the lower
    predicted objective; :func:`_compiled_choice`). ``"xla"`` (default): compiled as plain
    ``jax.jit`` on the plan's shardings (XLA's propagation lays out the intermediates), as
    ``apply(..., execute="xla")`` and a jitted step run it; ``"pinned"``: the predicted
    program with every layout pinned, as ``apply(..., execute="pinned")`` runs it (its bytes
    are the prediction's, as the backend compiles the collectives). :data:`EXECUTIONS`, as
    :func:`compiled_figures`' ``execute`` names them. ``"predict"`` returns the search's best
    by prediction alone, compiling nothing.
    """
    start = time.perf_counter()
    mesh = as_device_mesh(mesh, "mesh")
    step_fn = _check_fn(step_fn)
    flops_per_byte = _check_ratio(flops_per_byte)
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(
            memory_budget, (int, float, np.integer)) or memory_budget <= 0):
        raise ArgumentTypeError("memory_budget", memory_budget, "expected a positive number of bytes per device",
                                "pass e.g. memory_budget=2**30, or None for no limit")
    if isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int) or max_evaluations < 1:
        raise ArgumentTypeError("max_evaluations", max_evaluations, "expected a positive int", "pass e.g. 24")
    if not isinstance(score, str) or score not in SCORES:
        raise ArgumentTypeError("score", score, f"expected one of {', '.join(map(repr, SCORES))}",
                                'pass the executor that will run the plan: score="xla" (plain jax.jit, the '
                                'default) or score="pinned" (apply(..., execute="pinned")), or score="predict" '
                                '(compile nothing)')
    if presets is not None and (not isinstance(presets, Mapping) or not all(isinstance(k, str) for k in presets)):
        raise ArgumentTypeError("presets", presets, "expected a mapping name (a string) -> plan",
                                'pass e.g. {"megatron": {"wte": rowwise("tp")}}')
    problem = _Problem(step_fn, params, args, mesh, fixed)
    if score in EXECUTIONS:
        _check_even_fixed(problem, score)
    # score="predict" compiles nothing (no pool, no finalists): its evaluator's executor is never used
    evaluator = _Evaluator(problem, cost_model, flops_per_byte, score if score in EXECUTIONS else "xla")
    if score in EXECUTIONS:  # two compiles at a time, or one beside the search's predictions
        evaluator.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="auto_plan-compile")
    try:
        return _search(evaluator, start, memory_budget, presets, max_evaluations, score)
    finally:
        if evaluator.pool is not None:
            evaluator.pool.shutdown(wait=True, cancel_futures=True)


def _search(evaluator: _Evaluator, start: float, memory_budget: int | float | None,
            presets: Mapping[str, PlanLike] | None, max_evaluations: int, score: str) -> AutoPlan:
    """auto_plan's seeds, descent and scoring (module docstring)."""
    problem, mesh = evaluator.problem, evaluator.problem.mesh
    infos = {i: problem.leaf_info(i) for i in problem.free}

    def fits(figures: PlanFigures) -> bool:
        return memory_budget is None or figures.memory <= memory_budget

    replicated = {i: _replicated(mesh, problem.leaves[i]) for i in problem.free}

    def sharded(base: Mapping[int, Layout], axes: Sequence[int]) -> dict[int, Layout]:
        out = dict(base)
        for m in axes:
            out = {i: _sharded_over(infos[i], layout, m) for i, layout in out.items()}
        return out

    seeds: dict[str, dict[int, Layout]] = {"replicate": replicated, "fsdp": sharded(replicated, [0])}
    if mesh.ndim > 1:
        seeds["fsdp (every axis)"] = sharded(replicated, range(mesh.ndim))
    for name, plan in (presets or {}).items():
        try:
            seeds[name] = _from_plan(problem, plan)
        except Placements2JaxError as error:  # named as written: presets['mine']['w'], not plan['w']
            if not error.argument.startswith("plan"):
                raise
            raise error.for_argument(f"presets[{name!r}]{error.argument[len('plan'):]}", error.value) from None
        seeds[f"{name} + fsdp"] = sharded(seeds[name], [0])
    shown_seeds = {"fsdp", *(presets or {})}
    figures: dict[str, PlanFigures] = {}
    for name in sorted(shown_seeds):
        figures[name] = evaluator(seeds[name])
        if fits(figures[name]):  # compiled whatever the search finds (score an executor): start now
            evaluator.start_compile(seeds[name])
    # budget-aware: a seed whose parameters, state and arguments alone exceed the budget
    # cannot fit and is predicted only when shown (or when nothing fits, for the error)
    figures.update({name: evaluator(layouts) for name, layouts in seeds.items() if name not in figures and (
        memory_budget is None or evaluator.static_memory(layouts) <= memory_budget)})
    figures = {name: figures[name] for name in seeds if name in figures}  # seed order: ties keep the earlier
    feasible = [name for name in figures if fits(figures[name])]
    if not feasible:
        figures = {name: evaluator(layouts) for name, layouts in seeds.items()}
        smallest = min(figures.values(), key=lambda f: f.memory)
        raise PlanError(
            "memory_budget", memory_budget,
            f"no plan fits: the smallest found (every leaf split over every mesh axis it divides) needs "
            f"{smallest.memory} bytes per device ({smallest.params} parameters, {smallest.state} optimizer state, "
            f"{smallest.args} arguments, {smallest.activations} activations)",
            f"raise memory_budget to at least {smallest.memory}, use a larger mesh, or a smaller batch",
        )
    seed = min(feasible, key=lambda name: figures[name].objective)
    current, best = dict(seeds[seed]), figures[seed]

    pairs = _pairs(infos)

    def moves() -> Iterator[dict[int, Layout]]:
        for m in range(mesh.ndim):
            yield sharded(current, [m])
            yield {i: _replicated_over(layout, m) for i, layout in current.items()}
        for m in reversed(range(mesh.ndim)):  # tensor parallelism is usually on the last axis
            every = _paired(infos, current, pairs, m)
            if every is not None:
                yield every
            for pair in pairs:
                one = _paired(infos, current, [pair], m)
                if one is not None:
                    yield one
        by_size = sorted(problem.free, key=lambda i: (-math.prod(infos[i].shape) * infos[i].dtype.itemsize, i))
        for i in by_size:
            for layout in _candidates(infos[i], current[i]):
                yield {**current, i: layout}

    improved = True
    while improved and evaluator.count < max_evaluations:
        improved = False
        for trial in moves():
            if evaluator.count >= max_evaluations:
                break
            key = tuple(trial[i] for i in problem.free)
            if key == tuple(current[i] for i in problem.free):
                continue
            if memory_budget is not None and evaluator.static_memory(trial) > memory_budget:
                continue
            result = evaluator(trial)
            if fits(result) and result.objective < best.objective:
                current, best, improved = trial, result, True
    compiled: dict[str, CompiledFigures] = {}
    if score in EXECUTIONS:
        current, best, compiled = _compiled_choice(evaluator, seeds, figures, presets or {}, memory_budget)
    layouts = problem.layouts_of(current)
    rules = {re.escape(problem.paths[i]): layouts[i] for i in range(problem.n_params)}
    arg_layouts = {problem.paths[i]: layouts[i] for i, kind in enumerate(problem.kinds) if kind == "arg"}
    shown = {"fsdp": figures["fsdp"], **{name: figures[name] for name in (presets or {})}}
    return AutoPlan(
        mesh=mesh, rules=rules, args=arg_layouts, figures=best, presets=shown,
        memory_budget=None if memory_budget is None else int(memory_budget), seed=seed,
        evaluations=evaluator.count, seconds=time.perf_counter() - start, predict_seconds=evaluator.predict_seconds,
        fixed=tuple(re.escape(problem.paths[i]) if i < problem.n_params else problem.paths[i]
                    for i in sorted(problem.fixed)),
        score=score, compiled=compiled,
    )


def _compiled_choice(evaluator: _Evaluator, seeds: Mapping[str, dict[int, Layout]],
                     figures: Mapping[str, PlanFigures], presets: Mapping[str, Any], memory_budget: int | float | None,
                     ) -> tuple[dict[int, Layout], PlanFigures, dict[str, CompiledFigures]]:
    """The plan the executor that will run it (``evaluator.execute``: auto_plan's ``score``,
    one of :data:`EXECUTIONS`) compiles to the fewest bytes (ties: the lower predicted
    objective), among the search's best :data:`XLA_FINALISTS` plans by predicted objective
    that fit, besides the shown seeds (FSDP, the presets), and the shown seeds that fit; with
    the compiled figures of the chosen plan ("auto") and of every shown seed that fits.

    Every finalist is compiled, and ranked by its compiled figures alone: the prediction is the
    pinned program's figures, not those of XLA's propagation, so under ``score="xla"`` no plan is
    preferred, or left uncompiled, by its prediction (with the whole-program replicas' restart,
    s30-restart, Megatron's MLP layouts are predicted at 7,174 B, what their pinned program
    compiles to, where plain jax.jit compiles them to 35,856 B: a rule preferring plans predicted
    no dearer than every preset returned them over the searched plan jax.jit compiles to 11,282 B).

    A compiled plan fits when the larger of its estimate and XLA's memory_analysis() is within
    the budget (:func:`_checked_memory`); when XLA needs more than the budget for every
    finalist, the next plans by objective are compiled, two at a time, up to
    :data:`XLA_FINALISTS` more, before giving up with a PlanError."""

    def fits(memory: int) -> bool:
        return memory_budget is None or memory <= memory_budget

    memo, plans = evaluator.memo, evaluator.plans
    shown = ["fsdp", *presets]
    seeded = list(dict.fromkeys(evaluator.key(seeds[name]) for name in shown if fits(figures[name].memory)))
    ranked = [k for k in sorted((k for k, f in memo.items() if fits(f.memory)), key=lambda k: memo[k].objective)
              if k not in seeded]  # stable: evaluation order on ties
    finalists = [*ranked[:XLA_FINALISTS], *seeded]
    rest = ranked[XLA_FINALISTS:2 * XLA_FINALISTS]
    for k in finalists:
        evaluator.start_compile(plans[k])

    def compiled_fit(keys: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return [k for k in keys if evaluator.compile(plans[k]) is not None
                and fits(_checked_memory(memo[k], evaluator.compile(plans[k])))]

    scored = compiled_fit(finalists)
    while not scored and any(evaluator.compile(plans[k]) is not None for k in finalists) and rest:
        batch, rest = rest[:2], rest[2:]
        for k in batch:
            evaluator.start_compile(plans[k])
        finalists += batch
        scored = compiled_fit(batch)
    if not scored:
        # when no finalist compiles (uneven shards everywhere) the search's best by prediction stays
        unscored = [k for k in finalists if evaluator.compile(plans[k]) is None]
        if not unscored:
            smallest = min(finalists, key=lambda k: _checked_memory(memo[k], evaluator.compile(plans[k])))
            compiled_memory = evaluator.compile(plans[smallest]).memory
            raise PlanError(
                "memory_budget", memory_budget,
                f"no plan fits as XLA compiles it: every plan compiled (the best {len(finalists)} that fit by the "
                f"estimate) needs more; the smallest: {compiled_memory} bytes per device by memory_analysis() "
                f"(estimate {memo[smallest].memory})",
                f"raise memory_budget to at least {compiled_memory}, use a larger mesh, or a smaller batch",
            )
        scored = sorted(unscored, key=lambda k: memo[k].objective)[:1]
    chosen = min(scored, key=lambda k: (_nbytes(evaluator.compile(plans[k])), memo[k].objective))
    everything = {"auto": evaluator.compile(plans[chosen]),
                  **{name: evaluator.compile(seeds[name]) for name in shown if fits(figures[name].memory)}}
    compiled = {name: c for name, c in everything.items() if c is not None}
    return dict(plans[chosen]), memo[chosen], compiled


def _nbytes(compiled: CompiledFigures | None) -> float:
    return math.inf if compiled is None else compiled.nbytes


def _check_even_fixed(problem: _Problem, score: str) -> None:
    """A score compiling the plans ("xla", "pinned") refuses a pinned leaf split unevenly (a
    batch of 4 over 8 devices): every plan would hold it, and XLA compiles only even shards,
    so no plan could be scored.
    (The search itself only proposes even splits; an uneven preset is shown, not compiled.)"""
    for i, layout in sorted(problem.fixed.items()):
        shape = tuple(np.shape(problem.leaves[i]))
        if not layout.is_even(shape):
            raise ShapeError(
                f"fixed[{problem.paths[i]!r}]", str(layout),
                f"splits the leaf of shape {shape} unevenly over the mesh {tuple(problem.mesh.shape)}: XLA compiles "
                f"only even shards, so score={score!r} could compile no plan",
                "make the split dim divisible by the mesh dims splitting it (e.g. a batch of 8 over 8 devices), or "
                "pass score='predict' (predicted figures only: DTensors pad uneven shards)",
            )


def _check_fn(step_fn: Any) -> Callable[..., Any]:
    if not callable(step_fn):
        raise ArgumentTypeError("step_fn", step_fn, "not callable", "pass the training step function")
    return step_fn


def _check_ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ArgumentTypeError("flops_per_byte", value, "expected a positive finite number",
                                "pass e.g. 1000.0 (a device's FLOP/s over its link's bytes/s)")
    return float(value)


def _mlp_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
    import optax

    def loss(p: Any) -> jax.Array:
        return jax.numpy.mean((jax.nn.gelu(x @ p["up"]) @ p["down"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optax.adamw(1e-3).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def example_mlp(dim: int = 64, hidden: int = 256, batch: int = 16) -> tuple[Any, ...]:
    """A small problem for the docs and ``placements2jax plan
    placements2jax.autoplan:example_mlp``: ``(step_fn, params, opt_state, x, y)``, an MLP's
    adamw step with its arguments as ``jax.ShapeDtypeStruct``s (nothing allocated)."""
    import optax

    f32 = np.float32
    params = {"up": jax.ShapeDtypeStruct((dim, hidden), f32), "down": jax.ShapeDtypeStruct((hidden, dim), f32)}
    state = jax.eval_shape(optax.adamw(1e-3).init, params)
    batch_struct = jax.ShapeDtypeStruct((batch, dim), f32)
    return _mlp_step, params, state, batch_struct, batch_struct
