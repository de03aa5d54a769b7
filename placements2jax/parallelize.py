"""Parallelization plans: lay out a whole parameter pytree from regex rules.

A *plan* maps regular expressions over parameter paths to placements, as Keras'
``LayoutMap`` and torch's ``parallelize_module(module, mesh, parallelize_plan)`` do:

    plan = {
        r"layers/\\d+/up/.*": colwise("tp"),
        r"layers/\\d+/down/.*": rowwise("tp"),
        r"embed": "R,S(1)",
    }
    params = distribute_pytree(params, mesh, plan)

**Paths.** A leaf's path is its ``jax.tree_util`` key path rendered by
``jax.tree_util.keystr(path, simple=True, separator="/")``: dict keys (``str(key)``),
attribute names (dataclasses, namedtuples, registered classes) and sequence indices,
joined by ``/``; e.g. ``{"layers": [{"w1": a}]}`` gives ``"layers/0/w1"``. A rule
matches a path when its regex matches the **whole** path (``re.fullmatch``): ``"w1"``
matches only a top-level ``w1``, not ``layers/0/w1`` nor ``w10`` (Keras uses
``re.search``, where ``"w1"`` would match all three).

**Rules.** A leaf matched by no rule is replicated; a leaf matched by two rules is a
:class:`PlanError` naming the path and both rules; a rule that matches no leaf is a
:class:`PlanError` too (a typo would otherwise silently replicate), unless
``strict=False``. A rule's value is one of

* a preset (:class:`ParallelStyle`): ``colwise(axis)``, ``rowwise(axis)``,
  ``sequence(axis)``, ``replicate()``, or its name as a string: ``"colwise(tp)"``,
  ``"rowwise"`` (a 1-D mesh needs no axis), ``"replicate"``;
* placements in torch form (``(Replicate(), Shard(1))``, ``"R,S(1)"``) or alias form
  (``(None, "tp")``, ``"None,tp"``), a :class:`~placements2jax.layout.Layout`, or torch's
  placement objects;
* ``None``: replicate.

**Presets** (torch's ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` and
replication) say where a parameter is split on one mesh axis, by its number of dims:
leaves of 2 or more dims are weights, 1-D leaves are biases. JAX stores a linear
layer's weight as ``(in, out)`` (``y = x @ w``, flax ``Dense.kernel``), torch as
``(out, in)`` (``y = x @ w.T``); ``convention=`` picks which (default ``"jax"``):

| preset | weight, JAX ``(.., in, out)`` | weight, torch ``(.., out, in)`` | bias | activations in -> out |
|---|---|---|---|---|
| colwise | ``Shard(-1)`` (out features) | ``Shard(-2)`` (out features) | ``Shard(0)`` | ``R -> S(-1)`` |
| rowwise | ``Shard(-2)`` (in features) | ``Shard(-1)`` (in features) | ``R`` | ``S(-1) -> R`` (all-reduce) |
| sequence | ``R`` | ``R`` | ``R`` | ``S(seq) -> S(seq)`` |
| replicate | ``R`` | ``R`` | ``R`` | ``R -> R`` |

Dims count from the end, so a stacked weight ``(layers, in, out)`` is split like a
single one; a stacked bias ``(layers, out)`` has 2 dims and would be taken for a weight:
give such leaves explicit placements. An embedding table ``(vocab, dim)`` is an
``(in, out)`` weight: rowwise splits the vocabulary, colwise the embedding dim, as in
torch (torch's ``nn.Embedding.weight`` is ``(vocab, dim)`` too, so it takes
``convention="jax"`` even among torch-convention linear weights). Every mesh axis
other than the preset's is ``Replicate`` (data parallelism over ``dp`` replicates the
parameters). ``sequence`` replicates parameters (torch's
``SequenceParallel`` replicates the norm layers it is applied to) and splits
activations on ``sequence_dim`` (default 1: ``(batch, seq, hidden)``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import jax

from .dtensor import DTensor, distribute_tensor, is_dtensor
from .errors import ArgumentTypeError, Placements2JaxError, PlanError
from .layout import Layout, PlacementsLike, resolve_layout
from .mesh import DeviceMesh, as_device_mesh
from .placements import Placement, Replicate, Shard

__all__ = [
    "ParallelStyle",
    "PlanLike",
    "colwise",
    "distribute_pytree",
    "layouts_of",
    "path_of",
    "plan_layouts",
    "replicate",
    "rowwise",
    "sequence",
]

StyleKind: TypeAlias = Literal["colwise", "rowwise", "sequence", "replicate"]
Convention: TypeAlias = Literal["jax", "torch"]
Role: TypeAlias = Literal["param", "input", "output"]
RuleValue: TypeAlias = "ParallelStyle | PlacementsLike | Layout | None"
PlanLike: TypeAlias = "Mapping[str, RuleValue] | Sequence[tuple[str, RuleValue]]"

STYLE_KINDS: tuple[StyleKind, ...] = ("colwise", "rowwise", "sequence", "replicate")
CONVENTIONS: tuple[Convention, ...] = ("jax", "torch")
ROLES: tuple[Role, ...] = ("param", "input", "output")
_STYLE_TEXT = re.compile(r"\s*(colwise|rowwise|sequence|replicate)\s*(?:\(\s*([A-Za-z_][\w.\-]*)?\s*\))?\s*")


@dataclass(frozen=True)
class ParallelStyle:
    """A torch parallel style on one mesh axis: where a linear layer's weight, its bias
    and its input / output activations are split (table in the module docstring).

    ``axis`` None means the mesh's only axis (a 1-D mesh, as torch applies its styles to
    a 1-D tensor-parallel mesh). Build one with :func:`colwise`, :func:`rowwise`,
    :func:`sequence` or :func:`replicate`.
    """

    kind: StyleKind
    axis: str | None = None
    convention: Convention = "jax"
    sequence_dim: int = 1

    def __post_init__(self) -> None:
        if self.kind not in STYLE_KINDS:
            raise PlanError("kind", self.kind, "not a parallel style", f"use one of {', '.join(STYLE_KINDS)}")
        if self.axis is not None and not isinstance(self.axis, str):
            raise ArgumentTypeError("axis", self.axis, "expected a mesh axis name", 'pass e.g. "tp"')
        if self.convention not in CONVENTIONS:
            raise PlanError(
                "convention",
                self.convention,
                "unknown weight convention",
                '"jax" for (in, out) weights (y = x @ w), "torch" for (out, in) weights (y = x @ w.T)',
            )
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int):
            raise ArgumentTypeError("sequence_dim", self.sequence_dim, "expected an int", "pass e.g. 1")

    def __str__(self) -> str:
        return f"{self.kind}({self.axis or ''})"

    def placement(self, ndim: int, role: Role = "param") -> Placement:
        """The placement on the style's axis of a parameter (``role="param"``) or an
        activation (``"input"``, ``"output"``: torch's default ``input_layouts`` /
        ``output_layouts``) of ``ndim`` dims."""
        if role not in ROLES:
            raise PlanError("role", role, "unknown role", f"use one of {', '.join(ROLES)}")
        if self.kind == "replicate" or (self.kind == "sequence" and role == "param"):
            return Replicate()
        if self.kind == "sequence":
            return Shard(_dim(self.sequence_dim, ndim, self, "sequence_dim"))
        if role != "param":
            split_role = "output" if self.kind == "colwise" else "input"  # R -> S(-1) / S(-1) -> R
            return Shard(_dim(-1, ndim, self, "ndim")) if role == split_role else Replicate()
        if ndim == 1:
            return Shard(0) if self.kind == "colwise" else Replicate()
        out_dim, in_dim = (-1, -2) if self.convention == "jax" else (-2, -1)
        return Shard(_dim(out_dim if self.kind == "colwise" else in_dim, ndim, self, "ndim"))

    def layout(self, mesh: DeviceMesh, ndim: int, role: Role = "param") -> Layout:
        """The bound layout on ``mesh``: :meth:`placement` on the style's axis,
        Replicate on every other mesh dim."""
        mesh = as_device_mesh(mesh, "mesh")
        placement = self.placement(ndim, role)
        target = self._mesh_dim(mesh) if placement.is_shard() else None
        placements = tuple(placement if m == target else Replicate() for m in range(mesh.ndim))
        return resolve_layout(mesh, placements, ndim)

    def _mesh_dim(self, mesh: DeviceMesh) -> int:
        if self.axis is None:
            if mesh.ndim != 1:
                raise PlanError(
                    "axis",
                    None,
                    f"{self.kind}() names no mesh axis, and the mesh {mesh.axis_names} has {mesh.ndim}",
                    f'name the axis, e.g. {self.kind}("{mesh.axis_names[-1]}")',
                )
            return 0
        return mesh.axis_index(self.axis)


def _dim(dim: int, ndim: int, style: ParallelStyle, argument: str) -> int:
    if not -ndim <= dim < ndim:
        raise PlanError(
            argument,
            ndim if argument == "ndim" else dim,
            f"{style} splits dim {dim}, which a {ndim}-d tensor does not have",
            "apply the style to tensors with that dim, or give explicit placements",
        )
    return dim % ndim


def colwise(axis: str | None = None, *, convention: Convention = "jax") -> ParallelStyle:
    """torch's ``ColwiseParallel`` on mesh axis ``axis``: the weight's output features and
    the bias are split; the output activation is ``Shard(-1)``."""
    return ParallelStyle("colwise", axis, convention)


def rowwise(axis: str | None = None, *, convention: Convention = "jax") -> ParallelStyle:
    """torch's ``RowwiseParallel`` on mesh axis ``axis``: the weight's input features are
    split, the bias replicated; the input activation is ``Shard(-1)``, the output
    ``Replicate`` (the partial sums are all-reduced)."""
    return ParallelStyle("rowwise", axis, convention)


def sequence(axis: str | None = None, *, sequence_dim: int = 1) -> ParallelStyle:
    """torch's ``SequenceParallel`` on mesh axis ``axis``: parameters replicated,
    activations split on ``sequence_dim``."""
    return ParallelStyle("sequence", axis, sequence_dim=sequence_dim)


def replicate() -> ParallelStyle:
    """Every parameter and activation replicated (what unmatched leaves get)."""
    return ParallelStyle("replicate")


def path_of(key_path: Sequence[Any]) -> str:
    """The text a plan's regexes match: ``jax.tree_util.keystr(key_path, simple=True,
    separator="/")``, e.g. ``"layers/0/w1"``."""
    return jax.tree_util.keystr(tuple(key_path), simple=True, separator="/")


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    value: ParallelStyle | Layout


def _compile_plan(plan: PlanLike, mesh: DeviceMesh) -> tuple[_Rule, ...]:
    if isinstance(plan, Mapping):
        items = list(plan.items())
    elif (
        isinstance(plan, Sequence)
        and not isinstance(plan, str)
        and all(isinstance(item, tuple) and len(item) == 2 for item in plan)
    ):
        items = list(plan)
    else:
        raise ArgumentTypeError(
            "plan", plan, "expected a mapping regex -> placements", 'pass e.g. {"layers/\\\\d+/up/.*": colwise("tp")}'
        )
    rules = []
    for regex, value in items:
        if not isinstance(regex, str):
            raise ArgumentTypeError("plan", regex, "a rule's key must be a regex string", 'write e.g. "layers/.*/w1"')
        try:
            pattern = re.compile(regex)
        except re.error as error:
            raise PlanError(f"plan[{regex!r}]", regex, f"not a regular expression ({error})", "fix the regex") from None
        rules.append(_Rule(pattern, _rule_value(regex, value, mesh)))
    return tuple(rules)


def _rule_value(regex: str, value: Any, mesh: DeviceMesh) -> ParallelStyle | Layout:
    if isinstance(value, ParallelStyle):
        return value
    if value is None:
        return replicate()
    if isinstance(value, str) and (match := _STYLE_TEXT.fullmatch(value)):
        return ParallelStyle(match.group(1), match.group(2))  # type: ignore[arg-type]
    try:
        return Layout.from_device_mesh(mesh)(value)
    except Placements2JaxError as error:
        raise error.for_argument(f"plan[{regex!r}]", value) from None


def plan_layouts(params: Any, mesh: DeviceMesh, plan: PlanLike, *, strict: bool = True) -> Any:
    """The pytree of ``params`` with each leaf replaced by its bound :class:`Layout`
    under ``plan`` (module docstring). Leaves need only ``.shape`` (arrays,
    ``jax.ShapeDtypeStruct`` from ``jax.eval_shape``, DTensors), so a model can be
    planned before its parameters exist."""
    _flat, tree, layouts = _planned_leaves(params, as_device_mesh(mesh, "mesh"), plan, strict)
    return jax.tree_util.tree_unflatten(tree, layouts)


def distribute_pytree(params: Any, mesh: DeviceMesh, plan: PlanLike, *, strict: bool = True) -> Any:
    """``params`` with every leaf a :class:`DTensor` laid out by ``plan`` (see the module
    docstring); unmatched leaves replicated. Leaves that already are DTensors on ``mesh``
    are redistributed (by XLA) to their planned layout. PRNG key arrays (typed keys, such
    as a Flax NNX ``Rngs`` state's) stay as they are: ``predict`` and ``apply`` take them
    as Replicate constants; a plan that splits one is a :class:`PlanError`."""
    mesh = as_device_mesh(mesh, "mesh")
    flat, tree, layouts = _planned_leaves(params, mesh, plan, strict)
    placed = []
    for (path, leaf), layout in zip(flat, layouts):
        if _is_key_array(leaf):
            if layout != layout.replicated():
                raise PlanError(
                    "plan", str(layout), f"splits the PRNG key array at {path!r}",
                    "leave PRNG keys unmatched (they stay Replicate jax.Arrays)",
                )
            placed.append(leaf)
            continue
        try:
            placed.append(
                leaf.redistribute(mesh, layout) if isinstance(leaf, DTensor) else distribute_tensor(leaf, mesh, layout)
            )
        except Placements2JaxError as error:
            raise at_path(error, path) from None
    return jax.tree_util.tree_unflatten(tree, placed)


def _is_key_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)


def _planned_leaves(
    params: Any, mesh: DeviceMesh, plan: PlanLike, strict: bool
) -> tuple[list[tuple[str, Any]], Any, list[Layout]]:
    """(path, leaf) pairs, the tree structure and each leaf's layout under ``plan``."""
    rules = _compile_plan(plan, mesh)
    key_leaves, tree = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_dtensor)
    flat = [(path_of(key_path), leaf) for key_path, leaf in key_leaves]
    used: set[int] = set()
    layouts = []
    for path, leaf in flat:
        matches = [i for i, rule in enumerate(rules) if rule.pattern.fullmatch(path)]
        if len(matches) > 1:
            first, second = (rules[i].pattern.pattern for i in matches[:2])
            raise PlanError(
                "plan",
                [rules[i].pattern.pattern for i in matches],
                f"the path {path!r} is matched by two rules, {first!r} and {second!r}",
                "make the regexes exclusive (each is matched against the whole path)",
            )
        used.update(matches)
        value = rules[matches[0]].value if matches else replicate()
        ndim = leaf_ndim(leaf, path)
        try:
            layouts.append(value.layout(mesh, ndim) if isinstance(value, ParallelStyle) else value.bind(ndim))
        except Placements2JaxError as error:
            raise at_path(error, path) from None
    unused = [rule.pattern.pattern for i, rule in enumerate(rules) if i not in used]
    if strict and unused:
        shown = ", ".join(repr(p) for p, _ in flat[:8]) + (", ..." if len(flat) > 8 else "")
        raise PlanError(
            "plan",
            unused,
            f"rule {unused[0]!r} matches no parameter path (paths: {shown})",
            "fix the regex (it must match a whole path such as 'layers/0/w1'), or pass strict=False",
        )
    return flat, tree, layouts


def at_path(error: Placements2JaxError, path: str) -> Placements2JaxError:
    """The same error, its argument naming the pytree path it happened at."""
    return error.for_argument(f"{error.argument} (at {path!r})", error.value)


def leaf_ndim(leaf: Any, path: str, argument: str = "params") -> int:
    """A pytree leaf's number of dims: an array's (anything with ``.shape``), 0 for a Python
    number; the error for anything else names ``argument`` at ``path``."""
    shape = getattr(leaf, "shape", None)
    if shape is not None:
        return len(shape)
    if isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool):
        return 0
    raise ArgumentTypeError(
        f"{argument} at {path!r}", leaf, "a leaf must be an array (or have .shape)", "keep only arrays in the pytree"
    )


def layouts_of(tree: Any) -> Any:
    """The pytree with each DTensor replaced by its :class:`Layout` (other leaves kept)."""
    return jax.tree_util.tree_map(lambda x: x.layout if is_dtensor(x) else x, tree, is_leaf=is_dtensor)

