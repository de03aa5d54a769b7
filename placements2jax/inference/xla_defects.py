"""Equations XLA (JAX 0.10.2, CPU) partitions wrongly or cannot compile, told from the
jaxpr and the mesh alone: ``apply(execute="auto")`` runs the predicted plan
(``"pinned"``) for a program holding one, and ``check`` notes the outputs a wrong one
reaches (docs/inference.md, apply's execute modes).

* **Integer bitwise reductions** (:func:`is_bitwise_integer_reduction`): XLA's CPU
  backend cannot compile the all-reduce its own partitioning makes of an integer
  ``reduce_and`` / ``reduce_or`` / ``reduce_xor`` over a split dim ("UNIMPLEMENTED:
  Unsupported reduction computation"; plain ``jax.jit`` of the same function fails too);
  the search gathers such an input instead.
* **Batch-grouped convolutions** (:func:`is_miscompiled_conv`): a
  ``conv_general_dilated`` with ``batch_group_count > 1`` (what JAX's transpose makes of
  a grouped or depthwise conv's weight gradient, ``feature_group_count > 1``) whose two
  operands have their grouped dim (the forward's batch) split over some but not all of
  the mesh axes of size > 1 comes out multiplied by the product of the other axes'
  sizes: XLA sums the per-device partial results over the whole mesh
  (``replica_groups={{0,...,7}}`` on 2 x 4) where only the batch's axes hold different
  partial sums. Which axes XLA's propagation splits the operands over is XLA's choice,
  not the prediction's, so the test is the mesh's: two or more axes of size > 1 (on a
  1-D mesh, or one whose other axes have size 1, it is right). The forward conv and the
  input gradient (``feature_group_count > 1``) are right; so is a dense conv's weight
  gradient.
* **Single-row updates past the end** (:func:`is_single_row_update`): a
  ``dynamic_update_slice`` writing one row of a longer dim (a key/value cache's decoding
  step) whose start is past the dim's end writes nothing where XLA partitions the operand
  along that dim (JAX clamps the start: the last row is written; a float32 ``(1, 8)``
  split 4 ways, start 8, 9 or 20: every row left as it was, plain ``jax.jit`` on those
  shardings alike; starts within the dim, before it, and windows of 2 or more rows are
  right). Which dims XLA splits is its choice, so the test is the equation's and the
  mesh's: such a window on a mesh with an axis of size > 1; ``"pinned"`` and ``"ops"``
  run the masked update per rank, clamping as JAX does.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.extend import core

from ..mesh import DeviceMesh
from .jaxpr import all_equations

__all__ = ["miscompiled_outputs", "needs_pinned"]

BITWISE_REDUCTIONS = frozenset({"reduce_and", "reduce_or", "reduce_xor"})


def is_bitwise_integer_reduction(eqn: Any) -> bool:
    """Whether ``eqn`` reduces integers bitwise (module docstring: XLA's CPU backend cannot
    compile its own partitioning of one over a split dim)."""
    return eqn.primitive.name in BITWISE_REDUCTIONS and bool(jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer))


def is_miscompiled_conv(eqn: Any, mesh: DeviceMesh) -> bool:
    """Whether ``eqn`` is a batch-grouped convolution on a ``mesh`` of two or more axes of
    size > 1, which XLA may all-reduce over the whole mesh (module docstring)."""
    return (eqn.primitive.name == "conv_general_dilated" and eqn.params["batch_group_count"] > 1
            and sum(size > 1 for size in mesh.shape) > 1)


def is_single_row_update(eqn: Any, mesh: DeviceMesh) -> bool:
    """Whether ``eqn`` writes one row of a longer dim (``dynamic_update_slice``) on a
    ``mesh`` with an axis of size > 1, which XLA drops where the start is past the end
    (module docstring)."""
    if eqn.primitive.name != "dynamic_update_slice" or max(mesh.shape) == 1:
        return False
    operand, update = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    return any(u == 1 < n for n, u in zip(operand, update))


def needs_pinned(jaxpr: Any, mesh: DeviceMesh) -> bool:
    """Whether ``jaxpr`` (or a jaxpr in its equations' params) has an equation XLA
    cannot compile or partitions wrongly on ``mesh`` (module docstring)."""
    return any(
        is_bitwise_integer_reduction(eqn) or is_miscompiled_conv(eqn, mesh) or is_single_row_update(eqn, mesh)
        for eqn in all_equations(jaxpr)
    )


def miscompiled_outputs(jaxpr: Any, mesh: DeviceMesh) -> set[int]:
    """The indices of ``jaxpr``'s outputs computed from a batch-grouped convolution XLA
    may get wrong on ``mesh`` (:func:`is_miscompiled_conv`): those of an equation that is
    one or holds one in a sub-jaxpr (all of its outputs), and of the equations reading
    them, transitively."""
    reached: set[Any] = set()
    for eqn in jaxpr.eqns:
        inner = (e for sub in core.jaxprs_in_params(eqn.params) for e in all_equations(sub))
        if (is_miscompiled_conv(eqn, mesh) or any(is_miscompiled_conv(e, mesh) for e in inner)
                or any(not isinstance(v, core.Literal) and v in reached for v in eqn.invars)):
            reached.update(eqn.outvars)
    return {i for i, v in enumerate(jaxpr.outvars) if not isinstance(v, core.Literal) and v in reached}
