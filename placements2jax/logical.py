"""Flax logical axis annotations as layouts: one :class:`Layout` per parameter from its
logical axis names and the logical axis rules.

Flax code names each parameter's dims with *logical* axes and maps them to mesh axes by
rules, e.g. ``(("batch", "dp"), ("mlp", "tp"), ("heads", "tp"), ("embed", None))``:
Linen's ``nn.with_logical_partitioning(init, ("embed", "mlp"))`` (parameters held in
``nn.LogicallyPartitioned`` boxes, as lm1b and MaxText write them), NNX's
``nnx.with_partitioning(init, ("embed", "mlp"))`` (the ``out_sharding`` metadata of an
``nnx.Variable``). :func:`logical_layouts` turns such a tree, the rules and a
:class:`DeviceMesh` into the tree of layouts the library takes (``distribute_tensor``
per leaf, ``predict`` / ``check`` / ``apply``'s ``out_layouts``), as
:func:`~placements2jax.plan_layouts` does for regex plans:

    layouts = logical_layouts(boxed_state, mesh, rules)
    state = jax.tree.map(lambda x, layout: distribute_tensor(x, mesh, layout), nn.unbox(boxed_state), layouts)

**Which names.** Each leaf of ``tree`` is one of

* a Linen box (``nn.LogicallyPartitioned``): its ``names`` are logical, mapped by the
  rules (the box's own ``rules`` when it has them, as its ``unbox`` does); a plain
  ``nn.Partitioned`` box names mesh axes itself. The box becomes its layout, so the
  result has the structure of ``nn.unbox(tree)`` (``nn.get_partition_spec``'s);
* an ``nnx.Variable`` with ``out_sharding`` metadata: the result holds the same Variable
  with its layout as value (``nnx.get_partition_spec``'s structure: the Variables of an
  ``nnx.State``, a model or an ``nnx.Optimizer``, whose moments carry their parameters'
  metadata);
* a non-empty tuple of logical names or a ``PartitionSpec`` of them
  (``nn.get_partition_spec``'s output): a layout of one dim per name (fewer names than the
  array's dims: its trailing dims unsplit, as ``distribute_tensor`` binds a short
  ``PartitionSpec``);
* any other array (a Variable without metadata, the step count): replicated.

A name of ``None`` is an unsplit dim; a name mapped to several mesh axes splits its dim
over each, the first major (the rule's order, as a ``PartitionSpec`` entry and torch's
``shard_order`` list them: ``("dp", "tp")`` on a ``("dp", "tp")`` mesh is torch's
``(Shard(d), Shard(d))``). Uneven extents are allowed, as torch allows them.

**Which rules.** Each framework's own resolution, called, not re-implemented: Linen's
``nn.logical_to_mesh_axes`` for boxes and name tuples (the rules in priority order: a
name takes the first of its rules whose mesh axes no other dim of the array holds yet,
else stays unsplit), NNX's ``nnx.get_partition_spec`` for Variables (a name's rule
looked up, the last of several winning; a name without a rule is itself a mesh axis, as
NNX means it). ``rules=None`` takes the rules set by Flax's ``nn.logical_axis_rules``
context.

**Strictness.** Linen replicates a logical name no rule names, silently; here that is a
:class:`PlanError` (a typo would otherwise replicate a weight), unless ``strict=False``.
Rules naming a mesh axis not in ``mesh``, a name used for two dims of one array (Flax's
own ``ValueError``), rules that are not pairs, and an NNX name that is neither a rule's
nor a mesh axis are errors too.

Flax is an optional dependency (the ``flax`` extra): it is imported when this function
is first called, never when placements2jax is.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import PartitionSpec

from .dtensor import is_dtensor
from .errors import ArgumentTypeError, LayoutError, MeshError, Placements2JaxError, PlanError, import_extra
from .layout import Layout
from .mesh import DeviceMesh, as_device_mesh
from .parallelize import leaf_ndim, path_of

__all__ = ["logical_layouts", "LogicalRules"]

MeshAxes: TypeAlias = "str | tuple[str, ...] | None"
LogicalRules: TypeAlias = "Sequence[tuple[str, MeshAxes]]"

_RULES_EXAMPLE = "(('batch', 'dp'), ('mlp', 'tp'), ('embed', None))"


def logical_layouts(tree: Any, mesh: DeviceMesh, rules: LogicalRules | None = None, *, strict: bool = True) -> Any:
    """The layout of every leaf of ``tree`` from its Flax logical axis names and ``rules``
    on ``mesh`` (module docstring): Linen's ``LogicallyPartitioned`` boxes (a TrainState of
    them too, its optimizer moments boxed alike) replaced by their :class:`Layout`, NNX
    Variables holding theirs, name tuples and ``PartitionSpec``'s of names their layout,
    other arrays replicated. ``rules``: ``(logical name, mesh axes)`` pairs, mesh axes a
    name, a tuple of names or None; None takes Flax's context rules
    (``nn.logical_axis_rules``). ``strict=False`` replicates a Linen name no rule names, as
    Flax does. Leaves need only ``.shape`` (``jax.eval_shape`` of an init works)."""
    mesh = as_device_mesh(mesh, "mesh")
    linen = import_extra("flax.linen", "flax", "mapping logical axis names", argument="rules", value=rules)
    given = linen.get_logical_axis_rules() if rules is None else rules
    checked = _checked_rules(given, mesh, "rules")
    variable = _nnx_variable_type()
    box = linen.Partitioned

    def annotated(x: Any) -> bool:  # a DTensor is a pytree node: a leaf here, replicated as another array
        return isinstance(x, box) or (variable is not None and isinstance(x, variable)) or _is_names(x) or is_dtensor(x)

    key_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=annotated)
    layouts = []
    for key_path, leaf in key_leaves:
        path = path_of(key_path)
        if variable is not None and isinstance(leaf, variable):
            layouts.append(leaf.replace(_variable_layout(leaf, mesh, checked, path)))
        elif isinstance(leaf, box):
            names = _checked_names(leaf.names, path)
            axes: tuple[MeshAxes, ...] = names  # a plain Partitioned box names mesh axes itself
            if isinstance(leaf, linen.LogicallyPartitioned):
                own = checked if leaf.rules is None else _checked_rules(
                    leaf.rules, mesh, f"tree at {path!r} (its rules)")
                axes = _mapped(linen, names, own, mesh, path, strict)
            layouts.append(_layout(mesh, axes, leaf_ndim(leaf.value, path, "tree"), path))
        elif _is_names(leaf):
            axes = _mapped(linen, _checked_names(leaf, path), checked, mesh, path, strict)
            layouts.append(_layout(mesh, axes, len(axes), path))
        else:
            layouts.append(Layout(mesh, ((),) * leaf_ndim(leaf, path, "tree")))
    return jax.tree_util.tree_unflatten(treedef, layouts)


def _nnx_variable_type() -> type | None:
    """``nnx.Variable`` when Flax NNX is imported (else no leaf is one)."""
    nnx = sys.modules.get("flax.nnx")
    return None if nnx is None else nnx.Variable


def _is_names(x: Any) -> bool:
    """A non-empty tuple of logical names (str or None) or a ``PartitionSpec``: one array's
    annotation (an empty tuple is an empty pytree node, as JAX takes it)."""
    return isinstance(x, PartitionSpec) or (
        type(x) is tuple and len(x) > 0 and all(n is None or isinstance(n, str) for n in x)
    )


def _checked_rules(rules: Any, mesh: DeviceMesh, argument: str) -> tuple[tuple[str, MeshAxes], ...]:
    """``rules`` as a tuple of ``(name, mesh axes)`` pairs (lists made tuples, an empty
    tuple None), every mesh axis one of ``mesh``'s."""
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        fix = "pass tuple(rules.items())" if isinstance(rules, Mapping) else f"pass e.g. {_RULES_EXAMPLE}"
        raise ArgumentTypeError(
            argument, rules, "expected a sequence of (logical name, mesh axes) pairs, in priority order", fix
        )
    names = tuple(mesh.axis_names)
    checked = []
    for i, rule in enumerate(rules):
        if isinstance(rule, (str, bytes)) or not isinstance(rule, Sequence) or len(rule) != 2 or not isinstance(
                rule[0], str):
            raise ArgumentTypeError(
                f"{argument}[{i}]", rule, "expected a pair (logical name, mesh axes)",
                "write e.g. ('mlp', 'tp'), ('batch', ('dp', 'tp')) or ('embed', None)",
            )
        logical, axes = rule
        if isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
            axes = tuple(axes) or None
        elif axes is not None and not isinstance(axes, str):
            raise ArgumentTypeError(
                f"{argument}[{i}]", rule, f"the mesh axes {axes!r} are not a name, a tuple of names or None",
                f"map {logical!r} to mesh axes of {names}, or to None to replicate its dims",
            )
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            if axis not in names:
                raise MeshError(
                    f"{argument}[{i}]", rule, f"{axis!r} is not an axis of the mesh {names}",
                    f"map {logical!r} to axes of {names}, or drop the rule",
                )
        if isinstance(axes, tuple) and len(set(axes)) < len(axes):
            raise PlanError(
                f"{argument}[{i}]", rule, "a mesh axis is named twice", "name each mesh axis once"
            )
        checked.append((logical, axes))
    return tuple(checked)


def _checked_names(names: Any, path: str) -> tuple[str | None, ...]:
    """An array's logical names (a tuple of str or None, each name once)."""
    argument = f"tree at {path!r}"
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or not all(
            n is None or isinstance(n, str) for n in names):
        raise ArgumentTypeError(
            argument, names, "expected logical axis names: one name (or None) per dim",
            "annotate e.g. ('embed', 'mlp'), with None for a dim no rule splits",
        )
    names = tuple(names)
    for dim, name in enumerate(names):
        if name is not None and name in names[:dim]:
            raise LayoutError(
                argument, names, f"the logical name {name!r} names dims {names.index(name)} and {dim}",
                "give each dim its own logical name (Flax refuses a name used twice in one array too)",
            )
    return names


def _mapped(
    linen: Any, names: tuple[str | None, ...], rules: tuple[tuple[str, MeshAxes], ...], mesh: DeviceMesh, path: str,
    strict: bool,
) -> tuple[MeshAxes, ...]:
    """Linen's mapping of ``names`` under ``rules`` (``nn.logical_to_mesh_axes``), a name
    no rule names refused when ``strict``."""
    known = {logical for logical, _ in rules}
    unknown = [n for n in names if n is not None and n not in known]
    if strict and unknown:
        raise PlanError(
            "rules", unknown[0], f"no rule names the logical axis {unknown[0]!r} (of {path!r}: {names})",
            f"add a rule ({unknown[0]!r}, None) to replicate its dim or ({unknown[0]!r}, {mesh.axis_names[-1]!r}) to "
            "split it, or pass strict=False to replicate names without a rule, as Flax does",
        )
    return tuple(linen.logical_to_mesh_axes(names, rules))


def _variable_layout(variable: Any, mesh: DeviceMesh, rules: tuple[tuple[str, MeshAxes], ...], path: str) -> Layout:
    """An ``nnx.Variable``'s layout: its ``out_sharding`` names through NNX's own
    resolution (``nnx.get_partition_spec`` under ``rules`` set as Flax's context rules,
    composed with the Variable's ``sharding_rules``), replicated without metadata."""
    ndim = leaf_ndim(variable.get_value(), path, "tree")
    names = variable.get_metadata().get("out_sharding")
    if not names:
        return Layout(mesh, ((),) * ndim)
    _checked_names(names, path)
    own = variable.get_metadata().get("sharding_rules")
    if own:
        _checked_rules(own, mesh, f"tree at {path!r} (its sharding_rules)")
    from flax import nnx
    from flax.core.spmd import logical_axis_rules

    try:
        with logical_axis_rules(rules):
            spec = nnx.get_partition_spec(variable).get_value()
    except ValueError as error:  # flax.core.spmd.composite_rules: the two rule sets disagree
        raise PlanError(
            f"tree at {path!r} (its sharding_rules)", own, str(error).rstrip("."),
            "make the Variable's sharding_rules agree with rules (or drop them)",
        ) from None
    for name, axes in zip(names, spec):
        for axis in (axes,) if isinstance(axes, str) else ():
            if axis not in mesh.axis_names:
                raise PlanError(
                    "rules", name, f"no rule names the logical axis {name!r} (of {path!r}: {tuple(names)}) and it is "
                    f"not an axis of the mesh {tuple(mesh.axis_names)}",
                    f"add a rule ({name!r}, None) to replicate its dim or ({name!r}, {mesh.axis_names[-1]!r}) to "
                    "split it",
                )
    return _layout(mesh, tuple(spec), ndim, path)


def _layout(mesh: DeviceMesh, axes: tuple[MeshAxes, ...], ndim: int, path: str) -> Layout:
    """The layout splitting each dim over its mesh axes (major first)."""
    if len(axes) > ndim:
        raise LayoutError(
            f"tree at {path!r}", axes, f"{len(axes)} logical names for an array of {ndim} dims",
            f"give at most one name per dim ({ndim})",
        )
    try:
        return Layout.from_partition_spec(mesh, PartitionSpec(*axes), ndim)
    except Placements2JaxError as error:  # NNX's rules map two names to one mesh axis
        raise error.for_argument(f"tree at {path!r}", axes) from None
