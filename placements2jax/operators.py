"""DTensor operators: ``+ - * / @``, negation, ``sum mean max min``, ``transpose``,
``reshape``, and :func:`apply` for any JAX function, each run under the signature that
inference chooses (docs/inference.md, section "DTensor operators").

How one op runs, eagerly or inside the caller's ``jax.jit`` / ``jax.grad``:

1. **Signature.** :func:`~placements2jax.inference.infer_signature` (a named op) or
   :func:`~placements2jax.inference.predict` (every equation of ``fn``'s jaxpr) gives the
   layout each input must have and the layouts of the outputs.
2. **Redistribution.** Each input whose layout differs is moved by
   :func:`placements2jax.programs.convert` (XLA collectives, as planned).
3. **Local execution.** The op runs per rank in ``jax.shard_map`` over the mesh, with the
   physical specs of the planned input and output layouts as ``in_specs`` / ``out_specs``
   and the op applied to each rank's local block: this *is* the meaning of a signature
   ("running the op on every rank's local data gives the outputs' local data"), so it is
   exact for every layout the rules allow, partials and uneven splits included. A
   ``Partial(sum)`` output on Explicit axes becomes JAX ``unreduced`` (``pcast``), other
   partials the stacked form of :mod:`.physical`; a ``Partial(sum)`` input carried as
   ``unreduced`` is re-labelled as stacked first (a no-op on the device buffers).
4. **Padding.** Uneven layouts are padded (:mod:`.physical`). Before the op, every padded
   input's pad elements are replaced by the op's neutral element (0, the lowest /
   highest value for ``max`` / ``min``, all bits set for ``reduce_and``: True on bools);
   after it, the outputs' pads are set to 0. So pads
   never reach a sum, a contraction or a gradient (a select passes no cotangent to
   the masked side). Even layouts get no mask.

Everything one call needs is a single ``jax.jit`` program cached per (op, params, input
shapes / dtypes / layouts, cost model), so eager dispatch is a dictionary lookup and one
compiled call; inside an outer ``jax.jit`` the same program is emitted into the caller's.

This module installs the operators and methods on :class:`~placements2jax.dtensor.DTensor`
when it is imported (the package imports it), as JAX installs ``jax.Array``'s methods.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.core import unsafe_am_i_under_a_jit  # JAX has no public test for 'tracing under jit'
from jax.extend import core
from jax.sharding import NamedSharding, PartitionSpec

from .caches import cached, register
from . import chunking
from .dtensor import DTensor, auto_twin_of, is_key_dtype
from .errors import ArgumentTypeError, InferenceError, UnsupportedOpError
from .factories import place
from .hlo import running
from .inference import default_cost_model, infer_signature, predict
from .inference.cost import CostModel, CostModelLike
from .inference.combine import stepped
from .inference.frameworks import Bound, bind, variables_of, with_static_outputs
from .inference.jaxpr import (
    CONSTRAINT_SHARDING_PARAMS, DEBUG_EFFECTS, HOST_CALLBACKS, ON_UNKNOWN, TYPING_REFUSALS, _drop_dim0, _stacked,
    all_equations, execute, is_typing_refusal, trace_context, typing_refusal,
)
from .inference.ops import freeze, op_definition, registered_function
from .inference.plan import FIRST_FIRST
from .inference.rules import SCATTERS, gather_lookup_axes, scatter_lookup_axes, scatter_windows
from .inference.signature import RedistributePlan, TensorSpec, constant_layout, is_layout_leaf
from .inference.simplify import is_arg_reduction_call
from .inference.xla_defects import needs_pinned
from .layout import Layout
from .mesh import DeviceMesh, shard_map
from .physical import Physical, physical
from .programs import convert

__all__ = [
    "EXECUTES", "Program", "apply", "binary", "call", "implicit_replication", "reduce", "reshape", "transpose", "unary",
]

Shape = tuple[int, ...]
# how apply runs a function: per equation as torch dispatches ("ops"), compiled whole by XLA
# ("xla"), compiled whole with every layout the whole-program search chose pinned ("pinned"), or
# "auto": "ops" when fn calls a function with a register_sharding rule, else "xla"
EXECUTES = ("auto", "ops", "xla", "pinned")
_SCALARS = (bool, int, float, complex)
_CONSTANTS = (*_SCALARS, np.generic, np.ndarray, jax.Array)
# Operand keys: ("dtensor", shape, dtype, layout) or ("constant", shape, dtype, weak).
OperandKey = tuple[Any, ...]


# -- operands --------------------------------------------------------------------------------


def _is_operand(value: Any) -> bool:
    """A DTensor, or a constant (Python / NumPy scalar, NumPy or JAX array) that an op
    treats as a Replicate tensor."""
    return isinstance(value, (DTensor, *_CONSTANTS))


def _operand_key(value: Any) -> OperandKey:
    if isinstance(value, DTensor):
        return ("dtensor", value.shape, value.dtype, value.layout)
    if isinstance(value, _SCALARS):
        return _scalar_key(type(value), jax.config.jax_enable_x64)
    weak = bool(getattr(value, "weak_type", False))
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
        return ("constant", value.shape, value.dtype, False)  # a typed PRNG key
    return ("constant", np.shape(value), np.dtype(jnp.result_type(value)), weak)


@cached(maxsize=16)
def _scalar_key(kind: type, x64: bool) -> OperandKey:
    return ("constant", (), np.dtype(jnp.result_type(kind(0))), True)


def _check_operands(values: Sequence[Any], argument: str) -> None:
    for i, value in enumerate(values):
        if not _is_operand(value):
            raise ArgumentTypeError(
                f"{argument}[{i}]",
                value,
                "is neither a DTensor nor a numeric constant",
                "pass DTensors, NumPy / JAX arrays or Python numbers",
            )


_IMPLICIT_REPLICATION: contextvars.ContextVar[bool] = contextvars.ContextVar("implicit_replication", default=False)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """torch's ``implicit_replication()``: inside it, plain arrays (NumPy or JAX arrays of
    any size) mixed with DTensors in DTensor operators (``x * row``, ``row @ x``, ...) are
    Replicate tensors.

    Outside it, as torch's op dispatch, an operator takes only Python numbers and
    one-element arrays besides DTensors; a larger plain array is refused, since whether it
    really is the same on every rank is the caller's claim to make
    (``distribute_tensor(x, mesh)`` makes it explicit, this context makes it for a block
    of code). :func:`apply` is unaffected: like ``jax.jit``, it takes a function's inputs,
    and plain arrays among them (token ids, masks, PRNG keys) are Replicate constants
    whether or not the context is active.
    """
    token = _IMPLICIT_REPLICATION.set(True)
    try:
        yield
    finally:
        _IMPLICIT_REPLICATION.reset(token)


def _check_mixed(values: Sequence[Any]) -> None:
    """torch's rule for plain arrays among DTensor operands (see :func:`implicit_replication`)."""
    for i, value in enumerate(values):
        if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, DTensor) and np.size(value) != 1:
            raise ArgumentTypeError(
                "operands",
                f"<{type(value).__name__} {value.dtype}{list(np.shape(value))}> (operand {i})",
                "a plain array mixed with DTensors (torch refuses a mixed torch.Tensor and DTensor of more than "
                "one element outside implicit_replication())",
                "distribute it (distribute_tensor(x, mesh) replicates it), or run the op inside "
                "`with placements2jax.implicit_replication():`",
            )


def _mesh_of(keys: Sequence[OperandKey], argument: str) -> DeviceMesh:
    meshes = {key[3].mesh for key in keys if key[0] == "dtensor"}
    if len(meshes) != 1:
        raise InferenceError(
            argument,
            [str(m) for m in meshes] or "no DTensor",
            "the DTensors are on different meshes" if meshes else "at least one operand must be a DTensor",
            "redistribute the DTensors onto one mesh"
            if meshes
            else "pass a DTensor (constants are Replicate on its mesh)",
        )
    return meshes.pop()


def _layout_of(key: OperandKey, mesh: DeviceMesh) -> Layout:
    return key[3] if key[0] == "dtensor" else Layout(mesh, ((),) * len(key[1]))


def _arrays(values: Sequence[Any]) -> list[Any]:
    return [v.array if isinstance(v, DTensor) else v for v in values]


def _placed(values: Sequence[Any]) -> list[Any]:
    """``values`` with each DTensor's physical array placed on its mesh (``jax.device_put``,
    host to devices) where it is a host array or one on another set of devices: what a
    function mapped over DTensors leaves in them (a DTensor is a pytree whose leaf is its
    array), e.g. a checkpoint's NumPy values mapped into a DTensor template or an
    optimizer's init of host zeros. Plain ``jax.jit`` would place such an input; apply's
    per-rank programs read arrays as laid out, and JAX refused one ("in_specs passed to
    shard_map: P(None, 'tp') does not match the specs of the input: P(None, None)"). Once
    per call, after :func:`_dispatch` has checked the DTensors (a number or None inside
    one is refused there, not placed)."""
    return [_placed_dtensor(v) if isinstance(v, DTensor) else v for v in values]


def _placed_dtensor(x: DTensor) -> DTensor:
    array = x.array
    if isinstance(array, jax.Array) and (
            isinstance(array, jax.core.Tracer) or len(array.sharding.device_set) == x.device_mesh.size()):
        return x
    return DTensor.trusted(jax.device_put(array, x.physical.sharding), x.layout, x.shape)


# -- programs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Program:
    """One compiled op: ``run(*arrays)`` maps the operands' physical arrays (constants as
    they are) to the outputs' physical arrays, whose layouts and logical shapes are
    ``out_layouts`` / ``out_shapes``; ``out_tree`` gives the result's structure.
    ``plan`` is the Signature (named op) or Prediction (``apply``) that was followed."""

    run: Callable[..., tuple[jax.Array, ...]]
    out_layouts: tuple[Layout, ...]
    out_shapes: tuple[Shape, ...]
    out_tree: Any
    plan: Any

    @cached_property
    def calls_host(self) -> bool:
        """Whether the plan's jaxpr (an ``apply`` program's) calls a host callback with
        results (:data:`HOST_CALLBACKS`): on an Explicit mesh such a program runs on the
        mesh's Auto twin (:func:`_apply_on_twin`)."""
        closed = getattr(self.plan, "jaxpr", None)
        return closed is not None and any(e.primitive.name in HOST_CALLBACKS for e in all_equations(closed.jaxpr))

    def __call__(self, values: Sequence[Any]) -> Any:
        outs = self.run(*_arrays(values))
        leaves = [  # typed PRNG keys (Replicate) come back as keys, as distribute_pytree leaves them
            a if is_key_dtype(a.dtype) else DTensor.trusted(a, layout, shape)
            for a, layout, shape in zip(outs, self.out_layouts, self.out_shapes)
        ]
        return leaves[0] if self.out_tree.num_nodes == 1 else jax.tree.unflatten(self.out_tree, leaves)


# Eager dispatch: one dict lookup per call, keyed by the op, the cost model and each
# operand's (shape, dtype, layout) (Layouts are interned: hashing one is free). A miss goes
# to the program caches below.
_dispatched: dict[tuple[Any, ...], Program] = register({})
_DISPATCH_LIMIT = 4096


def _dispatch(
    tag: tuple[Any, ...], values: Sequence[Any], build: Callable[..., Program],
    where: Callable[[int], str] = "operands[{}]".format,
) -> Program:
    """The program ``build`` makes for ``values``' operand keys, cached per ``tag``, cost
    model and keys. A DTensor's key holds its array's shape too, so that one whose array
    is not its layout's (:meth:`DTensor.checked`, named by ``where`` of its position)
    misses and is refused here rather than run by a program built for another array."""
    if tag[0] == "op" and not _IMPLICIT_REPLICATION.get():
        _check_mixed(values)
    cost_model = default_cost_model()
    try:
        key = (
            tag,
            cost_model,
            *((v.shape, v.dtype, v.layout, v.array.shape) if isinstance(v, DTensor) else _operand_key(v)
              for v in values),
        )
    except AttributeError:  # a DTensor holding None (eqx.partition's other half) has no dtype
        key = None
    if key is None:  # refused by position, outside the except: its error is the user's, not a chained one
        _check_dtensors(values, where)
    program = _dispatched.get(key)
    if program is None:
        _check_dtensors(values, where)
        program = build(tuple(_operand_key(v) for v in values), cost_model)
        if len(_dispatched) >= _DISPATCH_LIMIT:
            _dispatched.clear()
        _dispatched[key] = program
    return program


def _check_dtensors(values: Sequence[Any], where: Callable[[int], str]) -> None:
    for i, v in enumerate(values):
        if isinstance(v, DTensor):
            v.checked(where(i))


def call(op: str, operands: Sequence[Any], **params: Any) -> DTensor:
    """Run named op ``op`` (see ``inference.op_names()``) on DTensors and constants with
    the signature inference chooses; ``params`` are those of the op's JAX function."""
    _check_operands(operands, "operands")
    frozen = freeze(params) if params else ()
    program = _dispatch(("op", op, frozen), operands, partial(_named_program, op, frozen))
    operands = _placed(operands)
    _announce(op, program, operands)
    return program(operands)


def _announce(operation: str, program: Program, values: Sequence[Any]) -> None:
    """Tell comm_debug (if it listens) that ``program`` runs eagerly on ``values``."""
    if program.out_layouts:
        running(operation, program.run, tuple(_arrays(values)), program.out_layouts[0].mesh)


@cached(maxsize=4096)
def _named_program(op: str, params: Any, keys: tuple[OperandKey, ...], cost_model: CostModel) -> Program:
    mesh = _mesh_of(keys, "operands")
    layouts = [_layout_of(k, mesh) for k in keys]
    specs = [(k[1], k[2], layout) for k, layout in zip(keys, layouts)]
    kwargs = dict(params)
    signature = infer_signature(op, specs, mesh, cost_model=cost_model, **kwargs)
    sources = [physical(layout, k[1]) for k, layout in zip(keys, layouts)]
    targets = [physical(layout, k[1]) for k, layout in zip(keys, signature.in_layouts)]
    outs = [physical(layout, a.shape) for layout, a in zip(signature.out_layouts, signature.out_avals)]
    reference = op_definition(op).reference
    if "shape" in kwargs:  # reshape / broadcast_to: each rank builds its own block
        kwargs["shape"] = _block_shape(outs[0])
    local = _local_call(
        lambda *xs: jax.tree.leaves(reference(*xs, **kwargs)), targets, outs, [_fill(op, k[2]) for k in keys]
    )

    def body(*arrays: Any) -> tuple[jax.Array, ...]:
        return local(*(_move(a, s, t) for a, s, t in zip(arrays, sources, targets)))

    out_tree = jax.tree.structure(0 if len(outs) == 1 else (0,) * len(outs))
    return Program(
        jax.jit(body), signature.out_layouts, tuple(a.shape for a in signature.out_avals), out_tree, signature
    )


def _move(x: Any, src: Physical, dst: Physical) -> Any:
    return x if src == dst else convert(jnp.asarray(x), src, dst)


# -- the dunder and method entry points ------------------------------------------------------


def binary(op: str, left: Any, right: Any) -> DTensor | Any:
    """``left <op> right`` for the Python operators; NotImplemented for other types."""
    if not (_is_operand(left) and _is_operand(right)):
        return NotImplemented
    return call(op, (left, right))


def unary(op: str, x: DTensor) -> DTensor:
    return call(op, (x,))


def reduce(
    op: str,
    x: DTensor,
    axis: int | Sequence[int] | None = None,
    keepdims: bool | None = None,
    *,
    dim: int | Sequence[int] | None = None,
    keepdim: bool | None = None,
) -> DTensor:
    """``x.sum / mean / max / min(axis, keepdims)`` (NumPy's arguments), or torch's
    ``dim=`` / ``keepdim=`` in their place (one name of each pair, not both). Unlike torch,
    ``max(dim=)`` / ``min(dim=)`` return the values only, as NumPy and JAX do (no indices)."""
    axis, axis_name = _one_name("axis", axis, "dim", dim)
    keepdims, keep_name = _one_name("keepdims", keepdims, "keepdim", keepdim)
    keepdims = False if keepdims is None else keepdims
    if not isinstance(keepdims, (bool, np.bool_)):
        raise ArgumentTypeError(keep_name, keepdims, "expected a bool", f"pass {keep_name}=True or False")
    if axis is not None and not isinstance(axis, (int, np.integer)):
        if isinstance(axis, (str, bytes)) or not isinstance(axis, Sequence) or not all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axis
        ):
            raise ArgumentTypeError(
                axis_name, axis, "expected None, an int or a sequence of ints", f"pass e.g. {axis_name}=0 or (0, 1)"
            )
        axis = tuple(axis)
    return call(op, (x,), axis=axis, keepdims=bool(keepdims))


def arg_reduce(
    op: str,
    x: DTensor,
    axis: int | None = None,
    keepdims: bool | None = None,
    *,
    dim: int | None = None,
    keepdim: bool | None = None,
) -> DTensor:
    """``x.argmax / argmin(axis, keepdims)`` (NumPy's arguments, or torch's ``dim=`` /
    ``keepdim=``): the index of the first extreme along one dim (None: of the flattened
    values). Run as eager dispatch runs the op, as torch does: a split reduced dim is
    moved off first (an index is not a partial value); in a function given to ``apply``
    or ``predict`` it is two reductions instead, which keep the split
    (:mod:`.inference.simplify`)."""
    axis, axis_name = _one_name("axis", axis, "dim", dim)
    if axis is not None and (isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer))):
        raise ArgumentTypeError(
            axis_name, axis, f"expected None or one dim (an int): {op} has no several-dim form",
            f"pass e.g. {axis_name}=-1, or reshape the dims together first",
        )
    return reduce(op, x, axis, keepdims, keepdim=keepdim)


def _one_name(numpy_name: str, numpy_value: Any, torch_name: str, torch_value: Any) -> tuple[Any, str]:
    """The value given under NumPy's or torch's name of one argument, and that name."""
    if numpy_value is not None and torch_value is not None:
        raise ArgumentTypeError(
            torch_name,
            torch_value,
            f"given together with {numpy_name}={numpy_value!r}, which means the same",
            f"pass only one of {numpy_name}= (NumPy) and {torch_name}= (torch)",
        )
    return (numpy_value, numpy_name) if torch_value is None else (torch_value, torch_name)


def transpose(x: DTensor, axes: Sequence[Any]) -> DTensor:
    """``x.transpose(*axes)``: no axes reverses the dims; one tuple or the axes one by one."""
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    return call("transpose", (x,), axes=tuple(axes) if axes else None)


def reshape(x: DTensor, shape: Sequence[Any]) -> DTensor:
    """``x.reshape(*shape)``: one tuple or the sizes one by one (``-1`` allowed)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return call("reshape", (x,), shape=tuple(shape))


def _install_methods(cls: type) -> None:
    """Install the Python operators and the NumPy-style methods on ``cls`` (DTensor), as
    ``jax/_src/numpy/array_methods.py`` installs jax.Array's: the DTensor module knows
    nothing of operators, which need signature inference (later in the data flow)."""

    def binary_pair(op: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        def forward(self: DTensor, other: Any) -> DTensor | Any:
            return binary(op, self, other)

        def reflected(self: DTensor, other: Any) -> DTensor | Any:
            return binary(op, other, self)

        return forward, reflected

    pairs = (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"), ("matmul", "matmul"), ("pow", "pow"))
    for name, op in pairs:
        forward, reflected = binary_pair(op)
        setattr(cls, f"__{name}__", forward)
        setattr(cls, f"__r{name}__", reflected)
    # ordering comparisons, elementwise as torch's and jax.Array's (``0 < x`` is ``x > 0``: no reflected forms);
    # not == / !=, which keep DTensors comparable and hashable by identity
    for name, op in (("lt", "less"), ("le", "less_equal"), ("gt", "greater"), ("ge", "greater_equal")):
        setattr(cls, f"__{name}__", binary_pair(op)[0])

    def reduction(op: str, doc: str, run: Callable[..., DTensor] = reduce) -> Callable[..., DTensor]:
        def method(
            self: DTensor,
            axis: int | Sequence[int] | None = None,
            keepdims: bool | None = None,
            *,
            dim: int | Sequence[int] | None = None,
            keepdim: bool | None = None,
        ) -> DTensor:
            return run(op, self, axis, keepdims, dim=dim, keepdim=keepdim)

        method.__name__, method.__doc__ = op, doc
        return method

    def neg(self: DTensor) -> DTensor:
        return unary("neg", self)

    def absolute(self: DTensor) -> DTensor:
        return unary("abs", self)

    def astype(self: DTensor, dtype: Any) -> DTensor:
        """The values cast to ``dtype`` (jax.Array's ``astype``, torch's ``.to(dtype)``): splits
        pass, a partial passes where the cast is linear up to rounding (between floats, ints
        to floats: :func:`.inference.rules.convert`), as torch's ``_to_copy`` keeps it."""
        return call("astype", (self,), dtype=dtype)

    def transpose_method(self: DTensor, *axes: Any) -> DTensor:
        """Permute the dims (``x.transpose()`` reverses them, like NumPy)."""
        return transpose(self, axes)

    def reshape_method(self: DTensor, *shape: Any) -> DTensor:
        """The same elements in ``shape`` (one tuple or the sizes; ``-1`` allowed)."""
        return reshape(self, shape)

    cls.__neg__ = neg  # type: ignore[attr-defined]
    cls.__abs__ = absolute  # type: ignore[attr-defined]
    cls.astype = astype  # type: ignore[attr-defined]
    cls.sum = reduction("sum", "Sum over ``axis`` (NumPy's arguments); a sharded reduced axis gives Partial(sum).")  # type: ignore[attr-defined]
    cls.mean = reduction("mean", "Mean over ``axis``; an evenly sharded reduced axis gives Partial(avg).")  # type: ignore[attr-defined]
    cls.max = reduction("max", "Maximum over ``axis``; a sharded reduced axis gives Partial(max).")  # type: ignore[attr-defined]
    cls.min = reduction("min", "Minimum over ``axis``; a sharded reduced axis gives Partial(min).")  # type: ignore[attr-defined]
    cls.argmax = reduction("argmax", "Index of the first maximum along ``axis`` (torch's ``dim=``): :func:`arg_reduce`.", arg_reduce)  # type: ignore[attr-defined]
    cls.argmin = reduction("argmin", "Index of the first minimum along ``axis`` (torch's ``dim=``): :func:`arg_reduce`.", arg_reduce)  # type: ignore[attr-defined]
    cls.transpose = transpose_method  # type: ignore[attr-defined]
    cls.T = property(lambda self: transpose(self, ()), doc="The dims reversed.")  # type: ignore[attr-defined]
    cls.reshape = reshape_method  # type: ignore[attr-defined]


_install_methods(DTensor)


# -- apply -----------------------------------------------------------------------------------


def apply(
    fn: Callable[..., Any], *args: Any, out_layouts: Any = None, execute: str = "auto", on_unknown: str = "raise",
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` on DTensors; the result has ``fn``'s structure with a
    DTensor per array (typed PRNG keys, Replicate, as keys), laid out as
    :func:`~placements2jax.inference.predict` says.

    ``execute="auto"`` (the default) is ``"ops"`` when ``fn``'s jaxpr (sub-jaxprs of
    ``scan``, ``cond``, ``pjit``, custom derivatives included) calls a function with a
    :func:`~placements2jax.register_sharding` rule, so that it runs on each rank's blocks
    under its rule as torch runs it; ``"pinned"`` when it has an equation XLA cannot
    compile or partitions wrongly (an integer bitwise reduction; a grouped conv's weight
    gradient on a mesh of two or more axes of size > 1; a one-row dynamic update slice,
    which XLA drops past the end of a split dim, :mod:`.inference.xla_defects`),
    ``"ops"`` for those inside ``jax.set_mesh`` of an Explicit mesh (where ``"pinned"``
    compiles as ``"xla"``); otherwise ``"xla"``. The choice is made once per
    function and input specs from one trace of ``fn`` (cached with the program;
    registering a rule clears it); only the chosen program is predicted.

    ``execute="xla"``: the output layouts come from the whole-program
    search (``predict(search="program")``, ``out_layouts`` honoured) and XLA compiles
    ``fn`` once on the inputs' logical arrays constrained to the inputs' and those output
    layouts, so it sends what plain ``jax.jit`` with these shardings sends (inputs'
    partials are reduced first; a Partial output is made locally from its value), or
    less: ``fn``'s argmax / argmin are computed as predict computes them, a max / min
    and a min of positions, two all-reduces of the result over a split dim where XLA
    gathers (value, index) pairs (:mod:`.inference.simplify`).
    ``execute="ops"`` (torch's eager DTensor dispatch): each equation of ``fn``'s jaxpr
    runs under the signature predict chooses op by op (``search="eager"``, its planned
    redistributions included) as its own per-rank program, walked by predict's walker
    (loops run per iteration under their rows' layouts); intermediates and outputs get
    torch's op-by-op placements (outputs may be Partial as torch's are).
    ``execute="pinned"``: the program the whole-program search predicts
    (``predict(search="program")``), compiled whole: every equation is bound on the
    logical arrays with its inputs and outputs pinned to the layouts the search chose
    (``with_sharding_constraint``), except that an equation with a Partial input or
    output runs per rank as ``"ops"`` runs it, its partial sums kept as planned (XLA's
    Auto mode has no partial value); layouts no NamedSharding expresses (strided, nested
    uneven splits) are left to XLA (:class:`_Pinned`). XLA then sends what ``predict``
    says (GPT-2 / Llama loss, value_and_grad and adamw steps on dp=2 x tp=4: 0.97-1.02x
    the predicted bytes, docs/inference.md), often less than plain ``jax.jit`` (Llama
    value_and_grad 125.5 against 199.6 KB per device). Inside ``jax.set_mesh`` of an
    Explicit mesh it compiles as ``"xla"``.

    Why ``"auto"`` runs ``"xla"`` unless a registered rule must be honoured: ``apply`` runs
    whole functions (a layer, a loss, a training step), where a user of ``jax.jit`` expects
    what ``jax.jit`` compiles and a user of torch DTensor gets op-by-op semantics from the
    DTensor operators themselves (``x @ w``, ``x.sum()``). Measured on the test GPT-2 /
    Llama (dp=2 x tp=4, Megatron plan): a whole adamw step under ``jax.jit`` compiles to
    the collectives and bytes of plain ``jax.jit`` (GPT-2 23 collectives; op by op 83
    where ``jax.jit`` had 14) at 0.97-1.05x its step time,
    and eagerly one program is compiled instead of one per equation (minutes on a
    training step with ``"ops"``); the loss alone runs in 14 / 6 ms warm against 20 / 9 ms
    with ``"ops"``. Values are the same either way; pass ``execute="ops"`` for torch's
    placements of every intermediate and output. Functions with a ``register_sharding``
    rule run on each rank's blocks under that rule with ``"ops"`` (the ``"auto"`` choice
    for them); with ``"xla"`` XLA partitions them as in plain ``jax.jit``.

    ``args`` are pytrees (dicts, lists, NamedTuples, dataclasses, registered classes) of
    DTensors and constants (arrays, numbers, PRNG keys: Replicate tensors); ``kwargs``
    are static (bound with ``functools.partial``, part of the cache key, so hashable).
    ``out_layouts`` (a pytree prefix of the result: layouts, placements, DTensors and
    constants whose layout as an input an output keeps, or None) is enforced: those
    outputs are redistributed to it.
    ``on_unknown="replicate"``: a primitive without an inference rule runs on its inputs
    gathered to Replicate, its outputs Replicate (``predict``'s fallback; the default
    ``"raise"`` names the primitive and the line of ``fn`` that made it).
    Host callbacks (``jax.pure_callback``, ``io_callback``, ``jax.debug.print`` /
    ``callback``) run as under ``jax.jit`` in every execute mode: once per run, on the
    logical values, their results Replicate. On an Explicit mesh, JAX (0.10.2) lowers no
    program holding ``pure_callback`` / ``io_callback`` whose shardings span two meshes, as
    apply's do (the mesh and its Auto twin): such an ``fn`` (known from its trace, before
    it runs) runs on the twin, its operands and results moved between the meshes without
    communication; under an outer ``jax.jit`` that is refused (an UnsupportedOpError).
    Like ``jax.jit``, the trace of ``fn`` is cached per function object and input
    shapes / dtypes / layouts: values ``fn`` closes over are read once. The prediction is
    ``predict``'s of ``fn`` on these arguments, so ``apply`` after ``predict`` or
    ``check`` (same ``out_layouts``) reuses it. Flax NNX states (``nnx.split``) and
    Equinox modules are pytrees like any other. An ``eqx.Module``'s non-array leaves (its
    activation function, Python numbers) are static, as ``eqx.filter_jit`` makes them
    (hashable, part of the cache key; results give them back). A Flax
    NNX model and optimizer passed to a step that updates them in place (``@nnx.jit``'s
    ``optimizer.update(model, grads)``) are updated in place here too: their Variables
    get the new DTensors, in the layouts they had (:mod:`.inference.frameworks`).
    """
    if not callable(fn):
        raise ArgumentTypeError("fn", fn, "not callable", "pass a function of arrays, e.g. jax.nn.gelu")
    try:
        hash(fn)
    except TypeError:
        raise ArgumentTypeError(
            "fn", fn, "is not hashable (programs are cached per function)",
            "pass a function (wrap a callable object, e.g. eqx.filter_value_and_grad(f), in a def)",
        ) from None
    name = getattr(fn, "__name__", type(fn).__name__)
    user_args = args
    fn, args, out_layouts = bind(fn, args, out_layouts, "args")  # Equinox statics, nnx in-place updates
    leaves, in_tree = jax.tree.flatten(args, is_leaf=_is_dtensor)
    if not all(map(_is_operand, leaves)):
        pairs = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_dtensor)[0]
        path, leaf = next((path, leaf) for path, leaf in pairs if not _is_operand(leaf))
        raise ArgumentTypeError(
            f"args{jax.tree_util.keystr(path)}", leaf, "is neither a DTensor nor a numeric constant",
            "pass pytrees of DTensors, NumPy / JAX arrays or Python numbers; bind static values as keywords",
        )
    frozen = tuple(sorted((name, freeze(value, name)) for name, value in kwargs.items()))  # errors name the keyword
    first = next((leaf for leaf in leaves if isinstance(leaf, DTensor)), None)
    targets = _out_layouts_key(out_layouts, None if first is None else first.device_mesh)
    if execute not in EXECUTES:
        raise InferenceError("execute", execute, "unknown execution", f"use one of {EXECUTES}")
    if on_unknown not in ON_UNKNOWN:
        raise InferenceError("on_unknown", on_unknown, "unknown fallback", f"use one of {ON_UNKNOWN}")
    options = ApplyOptions(on_unknown, trace_context())  # fn traced under jax.set_mesh is another program
    if execute in ("xla", "pinned") and first is not None and _another_explicit_context(
            options.context, first.device_mesh):
        raise InferenceError(
            "execute", execute, f"runs fn on its operands' logical values inside jax.set_mesh of {options.context}, a "
            f"mesh with Explicit axes other than the DTensors' {first.device_mesh}: JAX refuses fn's primitives on values "
            "of one mesh inside another's context (jax 0.10.2: 'context mesh ... should match the aval mesh')",
            "pass execute='ops' (or 'auto'), which runs each op on the DTensors' own mesh, or call apply outside that "
            "jax.set_mesh (or inside jax.set_mesh(mesh.to_jax()) of the DTensors' mesh)",
        )
    tag = ("apply", fn, frozen, in_tree, targets, execute, options)
    build = _BUILDERS[execute]
    program = _dispatch(tag, leaves, partial(build, fn, frozen, in_tree, targets, options), partial(_leaf_path, args))
    leaves = _placed(leaves)
    if first is not None and first.device_mesh.is_explicit and program.calls_host:
        run = partial(_apply_on_twin, name, execute, fn, frozen, in_tree, targets, options, leaves,
                      partial(_leaf_path, args))
    else:
        _announce(f"apply({name})", program, leaves)
        run = partial(program, leaves)
    try:
        result = run()
    except jax.errors.JaxRuntimeError as err:  # eager only: under an outer jit XLA raises at its compile instead
        if execute != "xla" or "UNIMPLEMENTED" not in str(err):
            raise
        raise UnsupportedOpError(
            "execute", "xla", f"XLA cannot compile its own partitioning of this program: {str(err).splitlines()[0]}",
            "use execute='pinned' (or 'auto'), which runs the predicted plan",
        ) from None
    except TYPING_REFUSALS as err:  # XLA's executors trace fn's equations on values JAX types inside set_mesh
        if not is_typing_refusal(err):
            raise
        raise typing_refusal(name, err, traced=True) from None
    if isinstance(fn, Bound) and fn.stateful:  # write the updated nnx Variables back, as nnx.jit does
        result, updates = result
        variables = variables_of(user_args)
        for path, value in updates.items():
            if value is not None:
                variables[path].set_value(value)
    return with_static_outputs(fn, result, _is_dtensor)


def _apply_on_twin(
    name: str, execute: str, fn: Callable[..., Any], frozen: Any, in_tree: Any, targets: Any, options: ApplyOptions,
    leaves: Sequence[Any], where: Callable[[int], str],
) -> Any:
    """apply's program run on the Auto twin of the operands' Explicit mesh, for an ``fn``
    calling a host callback with results. JAX workaround (jax 0.10.2): a program holding
    ``pure_callback`` / ``io_callback`` (primitives that "require devices") lowers only
    when every sharding in it is on one mesh, and apply's program on an Explicit mesh
    computes ``fn`` on the Auto twin (so that XLA propagates shardings): JAX refuses to
    lower it ("mesh should be the same across the entire program"). apply decides this
    before running (:attr:`Program.calls_host`), reading no JAX error. The operands are put
    on the twin (the same devices and blocks: no communication), the program is built and
    run there and the results are put back on the Explicit mesh. Inside ``jax.set_mesh``
    of the Explicit mesh the program is built and run under ``set_mesh`` of the twin: under
    the Explicit context its Auto sharding constraints would be assertions
    ("with_sharding_constraint acts as an assert when all axes of mesh are of type
    Explicit") and its ``shard_map`` s on the twin refused ("The context mesh ... should
    match the mesh passed to shard_map"). Under an outer ``jax.jit`` the operands and the twin program are one
    program on two meshes, which JAX cannot lower: refused here with our error."""
    if unsafe_am_i_under_a_jit():
        raise UnsupportedOpError(
            "fn", name, "calls pure_callback / io_callback and is applied under jax.jit to DTensors on an Explicit "
            "mesh: JAX lowers a program holding a host callback on one mesh only, and apply computes fn on the "
            "mesh's Auto twin, which the outer jit's program would join to the Explicit mesh",
            "call apply outside jax.jit (apply compiles fn itself), or build the mesh with axis_types='auto'",
        )
    partials = [x for x in leaves if isinstance(x, DTensor) and x.layout.has_partial]
    if partials:
        raise UnsupportedOpError(
            "args", str(partials[0].layout), "a Partial operand of a function calling pure_callback / io_callback "
            "cannot be run on an Explicit mesh (JAX lowers such a program on one mesh: apply moves it to the mesh's "
            "Auto twin, where a partial sum has another physical form)",
            "reduce it first (redistribute to Replicate or Shard), or build the mesh with axis_types='auto'",
        )
    mesh = next(x.device_mesh for x in leaves if isinstance(x, DTensor))
    twins = [
        DTensor.trusted(jax.device_put(x.array, physical(_twin(x.layout), x.shape).sharding), _twin(x.layout), x.shape)
        if isinstance(x, DTensor) else x for x in leaves
    ]
    if targets is not None:
        targets = (targets[0], tuple(_twin(x) if isinstance(x, Layout) else x for x in targets[1]))
    context = jax.set_mesh(auto_twin_of(mesh.to_jax())) if not trace_context().empty else contextlib.nullcontext()
    with context:
        options = options._replace(context=trace_context())
        tag = ("apply", fn, frozen, in_tree, targets, execute, options)
        build = _BUILDERS[execute]
        program = _dispatch(tag, twins, partial(build, fn, frozen, in_tree, targets, options), where)
        _announce(f"apply({name})", program, twins)
        result = program(twins)

    def back(x: Any) -> Any:
        if not isinstance(x, DTensor):
            return x
        factors = x.layout.split_factors if x.layout.is_strided else None
        layout = Layout(mesh, x.layout.dim_axes, x.layout.partial, factors)
        phys = physical(layout, x.shape)
        array = _from_stacked(x.array, phys) if layout.has_partial else jax.device_put(x.array, phys.sharding)
        return DTensor.trusted(array, layout, x.shape)

    return jax.tree.map(back, result, is_leaf=_is_dtensor)


def _is_dtensor(value: Any) -> bool:
    return isinstance(value, DTensor)


def _leaf_path(args: Any, i: int) -> str:
    """The path of ``args``' ``i``-th leaf (DTensors as leaves), as errors name it: ``args[1]['mu']``."""
    path = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_dtensor)[0][i][0]
    return f"args{jax.tree_util.keystr(path)}"


def _out_layouts_key(out_layouts: Any, mesh: DeviceMesh | None) -> Any:
    """``out_layouts`` as a hashable (structure, leaves) pair: DTensors replaced by their
    layouts and, given the operands' ``mesh``, plain arrays passed back by theirs
    (:func:`.constant_layout`: keep the layout they came in with)."""
    if out_layouts is None:
        return None
    leaves, tree = jax.tree.flatten(out_layouts, is_leaf=is_layout_leaf)
    leaves = [
        x.layout if isinstance(x, DTensor) else tuple(x) if isinstance(x, list)
        else x if mesh is None else constant_layout(x, mesh)
        for x in leaves
    ]
    try:
        hash(tuple(leaves))
    except TypeError:
        raise ArgumentTypeError(
            "out_layouts", out_layouts, "expected layouts, placements, DTensors, arrays or None in a pytree",
            "pass e.g. out_layouts=(params, None) or a Layout per output",
        ) from None
    return tree, tuple(leaves)


def _predicted(
    fn: Callable[..., Any], kwargs: Any, in_tree: Any, targets: Any, keys: tuple[OperandKey, ...],
    cost_model: CostModel, search: str, options: ApplyOptions,
) -> tuple[Callable[..., Any], DeviceMesh, list[Layout], Any]:
    """apply's ``fn`` on flat operands, its mesh, input layouts and ``predict`` of it."""
    mesh = _mesh_of(keys, "args")
    f = partial(fn, **dict(kwargs)) if kwargs else fn

    def flat_fn(*leaves: Any) -> Any:
        return f(*jax.tree.unflatten(in_tree, leaves))

    layouts = [_layout_of(k, mesh) for k in keys]
    out_layouts = None if targets is None else jax.tree.unflatten(*targets)
    # predicted on fn itself and the arguments' structure (TensorSpecs for the leaves), not on flat_fn: the same
    # key as predict / check of fn on these DTensors, so apply after either reuses its Prediction (and jaxpr)
    specs = jax.tree.unflatten(in_tree, [TensorSpec(k[1], k[2], layout) for k, layout in zip(keys, layouts)])
    prediction = predict(f, *specs, mesh=mesh, cost_model=cost_model, search=search, out_layouts=out_layouts,
                         on_unknown=options.on_unknown)
    return flat_fn, mesh, layouts, prediction


class ApplyOptions(NamedTuple):
    """apply's options of a program, part of its cache key."""

    on_unknown: str  # predict's fallback at a primitive without a rule
    context: Any  # the mesh context fn is traced in (:func:`.inference.jaxpr.trace_context`)


@cached(maxsize=1024)
def _apply_program(
    fn: Callable[..., Any], kwargs: Any, in_tree: Any, targets: Any, options: ApplyOptions,
    keys: tuple[OperandKey, ...], cost_model: CostModel,
) -> Program:
    # op by op, as torch's DTensor dispatch (outputs stay Partial as torch's do)
    _, mesh, layouts, prediction = _predicted(fn, kwargs, in_tree, targets, keys, cost_model, "eager", options)
    sources = [physical(layout, k[1]) for k, layout in zip(keys, layouts)]
    finals = [physical(spec.layout, spec.shape) for spec in prediction.outputs]
    closed = prediction.jaxpr

    def body(*arrays: Any) -> tuple[jax.Array, ...]:
        executor = _Executor(mesh)
        executor.bind_closed(closed, [_Value(a if k[0] == "dtensor" else _constant_on_twin(a, mesh), s)
                                      for a, s, k in zip(arrays, sources, keys)])
        execute(prediction, executor, cost_model)
        outs = [executor.read(v) for v in closed.jaxpr.outvars]
        return tuple(jnp.asarray(_move(v.array, v.phys, final)) for v, final in zip(outs, finals))

    out_shapes = tuple(s.shape for s in prediction.outputs)
    return Program(jax.jit(body), prediction.out_layouts, out_shapes, prediction.out_tree, prediction)


@cached(maxsize=1024)
def _xla_program(
    fn: Callable[..., Any], kwargs: Any, in_tree: Any, targets: Any, options: ApplyOptions,
    keys: tuple[OperandKey, ...], cost_model: CostModel,
) -> Program:
    """``apply(execute="xla")``: ``fn`` on the inputs' logical values, the outputs placed
    in the layouts the whole-program search predicts; XLA does the layout work."""
    flat_fn, mesh, layouts, prediction = _predicted(fn, kwargs, in_tree, targets, keys, cost_model, "program", options)
    sources = [physical(layout, k[1]) if k[0] == "dtensor" else None for k, layout in zip(keys, layouts)]
    # argmax / argmin as their reductions, as predicted (:mod:`.inference.simplify`): the predicted program run on the
    # same leaves (as "pinned" runs it), not fn traced again
    if any(map(is_arg_reduction_call, all_equations(prediction.jaxpr.jaxpr))):
        flat_fn = core.jaxpr_as_fun(prediction.jaxpr)

    def body(*arrays: Any) -> tuple[jax.Array, ...]:
        logical = [_constant_on_twin(a, mesh) if s is None else _to_logical(a, s) for a, s in zip(arrays, sources)]
        outs = jax.tree.leaves(flat_fn(*logical))
        return tuple(_from_logical(y, spec.layout, spec.shape) for y, spec in zip(outs, prediction.outputs))

    out_shapes = tuple(s.shape for s in prediction.outputs)
    return Program(jax.jit(body), prediction.out_layouts, out_shapes, prediction.out_tree, prediction)


@cached(maxsize=1024)
def _pinned_program(
    fn: Callable[..., Any], kwargs: Any, in_tree: Any, targets: Any, options: ApplyOptions,
    keys: tuple[OperandKey, ...], cost_model: CostModel,
) -> Program:
    """``apply(execute="pinned")``: the whole-program search's prediction run on the
    inputs' logical values by :class:`_Pinned` (every equation's layouts pinned, XLA
    partitioning the one program), the outputs placed as in ``"xla"``."""
    _, mesh, layouts, prediction = _predicted(fn, kwargs, in_tree, targets, keys, cost_model, "program", options)
    sources = [physical(layout, k[1]) for k, layout in zip(keys, layouts)]

    def body(*arrays: Any) -> tuple[jax.Array, ...]:
        logical = [_to_logical(a, s) if k[0] == "dtensor" else _constant_on_twin(a, mesh)
                   for a, s, k in zip(arrays, sources, keys)]
        if any(isinstance(x, jax.Array) and jax.typeof(x).sharding.mesh.explicit_axes for x in logical):
            # inside jax.set_mesh of an Explicit mesh the values keep their Explicit types, where
            # with_sharding_constraint only asserts: XLA compiles fn whole instead ("xla")
            return _xla_program(fn, kwargs, in_tree, targets, options, keys, cost_model).run(*arrays)
        # inputs' partials are reduced first (as "xla" does): a value is Partial only as a stacked array
        inputs = [_Value(x, physical(s.layout.without_partial(), s.shape)) for x, s in zip(logical, sources)]
        executor, outs = _run_pinned(prediction, inputs, cost_model)
        outs = [executor.moved(v, spec.layout, plan)
                for v, spec, plan in zip(outs, prediction.outputs, _output_plans(prediction, False))]
        return tuple(
            _from_stacked(v.array, v.phys) if v.phys.layout.has_partial else _from_logical(v.array, v.phys.layout, v.phys.shape)
            for v in outs
        )

    out_shapes = tuple(s.shape for s in prediction.outputs)
    return Program(jax.jit(body), prediction.out_layouts, out_shapes, prediction.out_tree, prediction)


def pinned_function(prediction: Any, cost_model: CostModelLike = None) -> Callable[..., list[jax.Array]]:
    """The program of ``prediction`` (a whole-program :func:`predict` on inputs without
    Partial) as a function of its inputs' logical arrays, every layout pinned as
    ``apply(execute="pinned")`` pins them (:class:`_Pinned`): jit it on the inputs'
    shardings to compile the program the prediction prices, without DTensors
    (:func:`~placements2jax.autoplan.compiled_figures`). Like ``jaxpr_as_fun`` of its
    jaxpr it returns the list of outputs, logical arrays (a Partial one reduced)."""

    def run(*arrays: Any) -> list[jax.Array]:
        inputs = [_Value(a, physical(s.layout, s.shape)) for a, s in zip(arrays, prediction.inputs)]
        executor, outs = _run_pinned(prediction, inputs, cost_model)
        return [executor.moved(v, spec.layout.without_partial(), plan).array
                for v, spec, plan in zip(outs, prediction.outputs, _output_plans(prediction, True))]

    return run


def _output_plans(prediction: Any, without_partial: bool) -> list[RedistributePlan | None]:
    """Per output of ``prediction``, the planned move to its ``out_layouts`` where the
    pinned program takes its steps one by one: where the route passes an uneven layout.
    There XLA's reshard in one picks its own order and pads differently from the planned
    route (:func:`.inference.cost.gather_block_bytes`): ``(9, 8, 32)`` ``S(0) -> R`` on 8
    devices, planned as an all-to-all to the even dim 1 and its gather (9,856 B), compiled
    in one as a padded all-gather (14,336 B); ``(6, 8, 32)`` ``S(0),S(1) -> R,R`` on 4x2
    gathered ``b`` first (7,168 B against 6,144). Else None: one constraint, XLA's own
    route, which compiles the planned bytes on even layouts and can combine their
    collectives with others (pinning every output step kept XLA from combining a tp
    all-reduce of GPT-2's value_and_grad with another: 22 collectives against 21
    predicted; XLA reduces a Partial over several mesh dims there last mesh dim first,
    as :func:`.inference.combine.planned_collectives` counts it). None too where the plan
    ends Partial and the caller's move, made ``without_partial``, does not (which plans
    are stepped: :func:`.inference.combine.stepped`, as the prediction counts them).
    Stepped too: an output with no move of its own, made ``without_partial`` by the
    reduction the prediction orders first mesh dim first against XLA's own order
    (:attr:`.inference.jaxpr.Prediction.reduction_orders`), its intermediate layout
    pinned."""
    plans = {e.path: e.signature.redistributions[0] for e in prediction.equations if e.primitive == "out_layouts"}
    chosen = [plans.get(f"out.{i}") for i in range(len(prediction.outputs))]
    moves = [plan if plan is not None and stepped(plan) and not (without_partial and plan.dst.has_partial)
             else None for plan in chosen]
    if not without_partial:
        return moves
    return [move if plan is not None else reduction if order == FIRST_FIRST else None
            for plan, move, order, reduction in zip(
                chosen, moves, prediction.reduction_orders, prediction.output_reductions)]


def _run_pinned(prediction: Any, inputs: Sequence[_Value], cost_model: CostModelLike) -> tuple[_Pinned, list[_Value]]:
    """``prediction``'s program on ``inputs`` (its jaxpr's inputs) run by :class:`_Pinned`:
    the executor (its moves shared with the caller's moves of the outputs) and the
    outputs' values in the layouts they are computed in."""
    closed = prediction.jaxpr
    executor = _Pinned(prediction.inputs[0].layout.mesh)
    executor.bind_closed(closed, inputs)
    execute(prediction, executor, cost_model)
    return executor, [executor.read(v) for v in closed.jaxpr.outvars]


@cached(maxsize=1024)
def _auto_program(
    fn: Callable[..., Any], kwargs: Any, in_tree: Any, targets: Any, options: ApplyOptions,
    keys: tuple[OperandKey, ...], cost_model: CostModel,
) -> Program:
    """``apply(execute="auto")``: the ``"ops"`` program when ``fn`` calls a registered
    function, the ``"pinned"`` one (``"ops"`` inside ``jax.set_mesh`` of an Explicit mesh)
    when it has an equation XLA cannot compile or partitions wrongly (JAX 0.10.2
    workarounds, :mod:`.inference.xla_defects`: an integer bitwise reduction over a split
    dim fails to compile on CPU, "UNIMPLEMENTED: Unsupported reduction computation"; a
    grouped conv's weight gradient on a mesh of two or more axes of size > 1 is
    all-reduced over the whole mesh, multiplied by the other axes' sizes), else the
    ``"xla"`` one (:func:`_auto_execute`). One trace of ``fn`` tells which, so that only
    the chosen program is predicted (the whole-program search is not run for an ``"ops"``
    one)."""
    f = partial(fn, **dict(kwargs)) if kwargs else fn
    structs = [jax.ShapeDtypeStruct(k[1], k[2]) for k in keys]
    try:
        closed = jax.make_jaxpr(lambda *leaves: f(*jax.tree.unflatten(in_tree, leaves)))(*structs)
    except (TypeError, ValueError):  # predict reports why, as a clear InferenceError
        closed = None
    meshes = [k[3].mesh for k in keys if k[0] == "dtensor"]  # none or several: predict says why
    chosen = "xla" if closed is None or not meshes else "ops" if _another_explicit_context(
        options.context, meshes[0]) else _auto_execute(closed.jaxpr, meshes[0], bool(options.context.explicit_axes))
    program = {"ops": _apply_program, "pinned": _pinned_program, "xla": _xla_program}[chosen]
    return program(fn, kwargs, in_tree, targets, options, keys, cost_model)


# apply's program builders by execute mode
_BUILDERS = {"auto": _auto_program, "xla": _xla_program, "ops": _apply_program, "pinned": _pinned_program}


def _another_explicit_context(context: Any, mesh: DeviceMesh) -> bool:
    """Whether ``context`` (``jax.set_mesh``'s abstract mesh) has Explicit axes and is not
    ``mesh`` (nor its twin: other axis names or sizes). JAX refuses there a primitive on
    values of ``mesh`` (jax 0.10.2: "context mesh ... should match the aval mesh"), which
    the "xla" and "pinned" programs bind on the operands' logical values; "ops" runs each
    op on ``mesh`` (:func:`.mesh.shard_map`)."""
    return bool(context.explicit_axes) and (tuple(context.axis_names), tuple(context.axis_sizes)) != (
        mesh.axis_names, mesh.shape)


def _auto_execute(jaxpr: Any, mesh: DeviceMesh, explicit: bool) -> str:
    """The executor ``execute="auto"`` picks for ``jaxpr`` on ``mesh`` (see
    :func:`_auto_program`), from its equations and its sub-jaxprs': "ops" if one calls a
    registered function, else, if one is an equation XLA cannot compile or partitions
    wrongly there (:func:`.inference.xla_defects.needs_pinned`), "pinned", or "ops" when
    ``fn`` is traced inside ``jax.set_mesh`` of a mesh with Explicit axes (``explicit``),
    where the pinned program compiles as "xla" (:func:`_pinned_program`); else "xla"."""
    if any(registered_function(eqn) is not None for eqn in all_equations(jaxpr)):
        return "ops"
    if needs_pinned(jaxpr, mesh):
        return "ops" if explicit else "pinned"
    return "xla"


def _to_logical(x: jax.Array, phys: Physical) -> jax.Array:
    """A DTensor's physical array as its logical value sharded like its tensor dims, on
    the Auto twin of an Explicit mesh (so XLA propagates shardings through ``fn``)."""
    layout, shape = phys.layout, phys.shape
    plain = physical(_logical_splits(layout), shape)
    x = _move(x, phys, plain)  # reduce partials, unstride (what plain jit's logical input is)
    sharding = NamedSharding(auto_twin_of(layout.mesh.to_jax()), PartitionSpec(*plain.dim_entries))
    if layout.mesh.is_explicit:
        x = _explicit_to_auto(x, sharding, NamedSharding(layout.mesh.to_jax(), PartitionSpec(*plain.dim_entries)))
    else:
        x = lax.with_sharding_constraint(x, sharding)
    if plain.is_padded:
        x = _unpad(x, plain, sharding)
    return x


def _constant_on_twin(x: Any, mesh: DeviceMesh) -> Any:
    """A constant operand (not a DTensor) as the program computes on it: a ``jax.Array``
    committed to the operands' Explicit mesh (``jax.device_put`` there by the caller, or a
    PRNG key returned by an earlier ``apply``) is typed on that mesh, and ``fn`` mixing it
    with the DTensors' values (typed on the Auto twin, :func:`_to_logical`) was refused by
    JAX ("Mesh for all inputs should be equal"): it is constrained to the twin in its own
    spec, as they are (no communication). Other constants are as they are."""
    if not isinstance(x, jax.Array) or not mesh.is_explicit:
        return x
    typed = jax.typeof(x).sharding
    if not typed.mesh.explicit_axes or tuple(typed.mesh.axis_names) != tuple(mesh.to_jax().axis_names):
        return x
    spec = PartitionSpec(*typed.spec)
    auto = NamedSharding(auto_twin_of(mesh.to_jax()), spec)
    if jnp.issubdtype(x.dtype, jnp.inexact):  # a differentiable value: its cotangent goes back to its Explicit type
        return _explicit_to_auto(x, auto, NamedSharding(mesh.to_jax(), spec))
    return lax.with_sharding_constraint(x, auto)


def _unpad(x: jax.Array, plain: Physical, sharding: NamedSharding) -> jax.Array:
    """The logical elements of a padded array, constrained to ``sharding``: the first
    ``shape`` ones, after taking each nested uneven dim's logical positions (its padding
    sits between blocks: 10 rows over ``(a, b)`` = 4 x 2 are chunked 2,1,2,1,2,1,1,0).

    Inside ``jax.set_mesh`` of an Explicit mesh (eager ``jax.grad``) ``x`` keeps its
    Explicit type (the constraint to the Auto twin does not retype it there), and JAX
    refuses to slice a split dim unevenly (``slicing on sharded dims where out dim (6) is
    not divisible by mesh axes (4)``): the slice runs under ``jax.sharding.auto_axes``,
    the uneven dims' axes dropped from its Explicit result (a constraint there would be
    an assertion)."""
    shape = plain.shape

    def logical(v: jax.Array) -> jax.Array:
        for d in range(len(shape)):
            if not plain.is_prefix(d):
                v = jnp.take(v, plain.positions(d), axis=d)
        return lax.slice(v, (0,) * len(shape), shape)

    typed = jax.typeof(x).sharding
    if not typed.mesh.explicit_axes:
        return lax.with_sharding_constraint(logical(x), sharding)
    spec = [
        None if entry is None or size % math.prod(typed.mesh.shape[a] for a in _names(entry)) else entry
        for entry, size in zip(tuple(typed.spec) + (None,) * len(shape), shape)
    ]
    return jax.sharding.auto_axes(logical, axes=typed.mesh.explicit_axes, out_sharding=PartitionSpec(*spec))(x)


def _names(entry: Any) -> tuple[str, ...]:
    """A PartitionSpec entry's mesh axis names."""
    return (entry,) if isinstance(entry, str) else tuple(entry)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _explicit_to_auto(x: jax.Array, auto: NamedSharding, explicit: NamedSharding) -> jax.Array:
    """``x`` (typed with the Explicit sharding ``explicit``) constrained to its Auto twin
    ``auto``. A custom derivative: outside ``jax.set_mesh`` (plain ``jax.jit(jax.grad(
    ...))``) JAX transposes the constraint into an Auto-typed cotangent where the input's
    Explicit type is expected (``Expected cotangent type float32[8@dp,32@tp] but got
    float32[8,32]``); the cotangent is resharded back to ``explicit``."""
    return lax.with_sharding_constraint(x, auto)


def _explicit_to_auto_fwd(x: jax.Array, auto: NamedSharding, explicit: NamedSharding) -> tuple[jax.Array, None]:
    return _explicit_to_auto(x, auto, explicit), None


def _explicit_to_auto_bwd(auto: NamedSharding, explicit: NamedSharding, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (ct if ct.dtype == jax.dtypes.float0 else jax.sharding.reshard(ct, explicit),)


_explicit_to_auto.defvjp(_explicit_to_auto_fwd, _explicit_to_auto_bwd)


def _from_logical(y: jax.Array, layout: Layout, shape: Shape) -> jax.Array:
    """A logical output value as the physical array of ``layout`` (a partial made
    locally from the value, without communication). Explicit-typed (inside
    ``jax.set_mesh``, see :func:`_unpad`), it is placed under ``auto_axes``."""
    plain = physical(_logical_splits(layout), shape)
    y = jnp.asarray(y)
    explicit = jax.typeof(y).sharding.mesh.explicit_axes
    if explicit:
        y = jax.sharding.auto_axes(partial(place, layout=layout, shape=shape), axes=explicit,
                                   out_sharding=plain.sharding)(y)
    else:
        y = place(y, layout, shape)
    if layout.mesh.is_explicit:
        y = jax.sharding.reshard(y, plain.sharding)
    return _move(y, plain, physical(layout, shape))


def _logical_splits(layout: Layout) -> Layout:
    """``layout``'s splits as a sharding of the logical value: no partial, no split factor.
    XLA has no strided sharding, so a strided input is unstrided before ``fn`` (an
    all-to-all the op-by-op ``"ops"`` program does not need) and a strided output strided
    after it."""
    return Layout(layout.mesh, layout.dim_axes)


@dataclass(frozen=True)
class _Value:
    """A jaxpr variable's value while executing: a physical array (or a concrete
    constant, kept as is so it stays a literal in the local programs) and its layout."""

    array: Any
    phys: Physical


# the planned moves across a loop's or cond's bodies' boundaries, by their rows' paths (the walker's, see
# placements2jax.inference.jaxpr.Executor)
_Routes = Mapping[str, RedistributePlan]


class _Runner:
    """What both of apply's executors share: runs each equation as predict's walker visits
    it (the walker's executor hook, :class:`~placements2jax.inference.jaxpr.Executor`),
    under the signature the walker chose for it: values are kept per jaxpr variable; loops
    run as ``lax.scan`` / ``lax.while_loop`` / ``lax.switch`` whose bodies the walker walks
    again inside. A subclass says how a value moves to a layout (:meth:`moved`), how one
    equation computes (:meth:`compute`), how a loop carries a value (:meth:`looped`, read
    back by :meth:`crossing`) and how many leading stack dims an array a loop carries has
    (:meth:`stack_dims`)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.values: dict[Any, _Value] = {}
        # (id of a cond branch's operand's array, layout) -> (that array, kept alive so the id stays its own; the
        # operand moved before the cond, as the branch receives it): :meth:`hoist`
        self.hoisted: dict[tuple[int, Layout], tuple[Any, _Value]] = {}

    def replicated(self, value: Any, aval: Any) -> _Value:
        shape = tuple(aval.shape)
        return _Value(value, physical(Layout(self.mesh, ((),) * len(shape)), shape))

    def read(self, atom: Any) -> _Value:
        if isinstance(atom, core.Literal):
            return self.replicated(np.asarray(atom.val, atom.aval.dtype), atom.aval)
        return self.values[atom]

    def bind(self, variables: Sequence[Any], values: Sequence[_Value]) -> None:
        for var, value in zip(variables, values, strict=True):
            if not isinstance(var, core.DropVar):
                self.values[var] = value

    def bind_closed(self, closed: Any, inputs: Sequence[_Value]) -> None:
        """Bind a (closed) jaxpr's constants (Replicate) and inputs."""
        jaxpr = getattr(closed, "jaxpr", closed)
        consts = getattr(closed, "consts", ())
        self.bind(jaxpr.constvars, [self.replicated(c, v.aval) for v, c in zip(jaxpr.constvars, consts)])
        self.bind(jaxpr.invars, inputs)

    def moved(self, value: _Value, layout: Layout, plan: RedistributePlan | None = None) -> _Value:
        """``value`` in ``layout``; ``plan``: the signature's route to it, if known. A cond
        branch's operand moved before the cond is the branch's operand holding it
        (:meth:`hoist`)."""
        hoisted = self.hoisted.get((id(value.array), layout))
        if hoisted is not None:
            return hoisted[1]
        return self.redistributed(value, layout, plan)

    def hoist(self, value: _Value, moved: _Value) -> None:
        """Within a cond's branch: ``value`` (an operand) moved is ``moved`` (another)."""
        self.hoisted[id(value.array), moved.phys.layout] = (value.array, moved)

    def redistributed(self, value: _Value, layout: Layout, plan: RedistributePlan | None = None) -> _Value:
        """``value`` moved to ``layout`` (:meth:`moved`)."""
        raise NotImplementedError

    def compute(self, eqn: Any, signature: Any, ins: Sequence[_Value]) -> list[_Value]:
        raise NotImplementedError

    def stack_dims(self, phys: Physical) -> int:
        raise NotImplementedError

    def looped(self, value: _Value) -> jax.Array:
        """The array a loop or branch carries for ``value`` (:meth:`crossing` reads it back)."""
        return jnp.asarray(value.array)

    def crossing(self, array: Any, phys: Physical) -> _Value:
        """A value crossing a loop's or branch's boundary, laid out as ``phys``: as the body
        receives it (a carry, a branch's operand, one iteration's slice of a scanned
        input) or as the loop returns it (a result, a scan's stacked output)."""
        return _Value(array, phys)

    # -- the walker's hooks --------------------------------------------------------------------

    def enter_call(self, eqn: Any, closed: Any) -> None:
        self.bind_closed(closed, [self.read(a) for a in eqn.invars])

    def exit_call(self, eqn: Any, closed: Any) -> None:
        self.bind(eqn.outvars, [self.read(v) for v in getattr(closed, "jaxpr", closed).outvars])

    def equation(self, eqn: Any, signature: Any) -> None:
        ins = [self.read(a) for a in eqn.invars]
        if eqn.primitive.name in CONSTRAINT_SHARDING_PARAMS:
            outs = [self.moved(ins[0], signature.out_layouts[0])]
        else:
            outs = self.compute(eqn, signature, ins)
        self.bind(eqn.outvars, outs)

    def constrain(self, var: Any, signature: Any) -> None:
        """``var`` (an equation's output) moved to the fixed layout of ``signature``: its
        explicit ``out_sharding``, the walker's row after the equation."""
        if not isinstance(var, core.DropVar):
            self.values[var] = self.moved(self.values[var], signature.out_layouts[0], signature.redistributions[0])

    def loop(
        self, walker: Any, eqn: Any, path: str, signature: Any, routes: _Routes,
        hoisted: Sequence[tuple[int, RedistributePlan]] = (),
    ) -> None:
        """``routes``: the planned moves across the bodies' boundaries (:data:`_Routes`);
        ``hoisted``: a cond's, the moves of its operands (by index) its branches make,
        run before it (:meth:`_cond`)."""
        ins = [self.moved(self.read(a), layout, plan)
               for a, layout, plan in zip(eqn.invars, signature.in_layouts, signature.redistributions, strict=True)]
        if eqn.primitive.name == "cond":
            outs = self._cond(walker.body_walker(self), eqn, path, signature, ins, routes, hoisted)
        else:
            run = self._scan if eqn.primitive.name == "scan" else self._while
            outs = run(walker.body_walker(self), eqn, path, signature, ins, routes)
        self.bind(eqn.outvars, [self.crossing(v.array, v.phys) for v in outs])

    # -- control flow: the bodies run per iteration under the loop row's layouts --------------

    def _run_body(self, walker: Any, closed: Any, ins: Sequence[_Value], prefix: str) -> list[_Value]:
        jaxpr = getattr(closed, "jaxpr", closed)
        self.bind_closed(closed, ins)
        specs = [TensorSpec(tuple(var.aval.shape), var.aval.dtype, v.phys.layout) for var, v in zip(jaxpr.invars, ins)]
        walker.walk_body(closed, specs, prefix)
        return [self.read(v) for v in jaxpr.outvars]

    def _carried(
        self, values: Sequence[_Value], like: Sequence[_Value], routes: _Routes, paths: Sequence[str]
    ) -> list[jax.Array]:
        """Loop-carried arrays: ``values`` moved to the layouts of ``like`` (the carry's),
        along the routes of the rows at ``paths``."""
        return [self.looped(self.moved(v, c.phys.layout, routes.get(at)))
                for v, c, at in zip(values, like, paths, strict=True)]

    def _scan(
        self, walker: Any, eqn: Any, path: str, signature: Any, ins: list[_Value], routes: _Routes
    ) -> list[_Value]:
        """Scanned inputs have dim 0 unsplit (the row's layouts); a slice's physical array
        is the scanned array's slice along its first tensor dim (after stacked dims). Each
        iteration's outputs are moved to the layouts of the row's stacked outputs inside
        the body, as the prediction counts them (a move of the stack after the loop sends
        the loop's length times their bytes: GPT-2's pinned value_and_grad 1.34x the
        predicted bytes when the search chose stacks in other layouts than the body's)."""
        p = eqn.params
        nc, nk = p["num_consts"], p["num_carry"]
        consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        slices = [physical(_drop_dim0(x.phys.layout), x.phys.shape[1:]) for x in xs]
        ys_layouts = [_drop_dim0(y) for y in signature.out_layouts[nk:]]
        ys_phys: list[Physical] = []
        carries = [f"{path}.carry{i}" for i in range(nk)]

        def step(carry: list[jax.Array], x: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
            values = [*consts, *(self.crossing(a, c.phys) for a, c in zip(carry, init)), *map(self.crossing, x, slices)]
            outs = self._run_body(walker, p["jaxpr"], values, path + ".")
            ys = [self.moved(o, layout, routes.get(f"{path}.ys{i}"))
                  for i, (o, layout) in enumerate(zip(outs[nk:], ys_layouts, strict=True))]
            ys_phys[:] = [y.phys for y in ys]
            return self._carried(outs[:nk], init, routes, carries), [self.looped(y) for y in ys]

        carry0 = [self.looped(v) for v in init]
        xs0 = [jnp.moveaxis(self.looped(x), self.stack_dims(x.phys), 0) for x in xs]
        carry, ys = lax.scan(step, carry0, xs0, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        stacked = [physical(_stacked(y.layout), (p["length"], *y.shape)) for y in ys_phys]
        ys = [jnp.moveaxis(y, 0, self.stack_dims(s)) for y, s in zip(ys, stacked)]
        return [*(_Value(a, c.phys) for a, c in zip(carry, init)), *map(_Value, ys, stacked)]

    def _while(
        self, walker: Any, eqn: Any, path: str, signature: Any, ins: list[_Value], routes: _Routes
    ) -> list[_Value]:
        """The predicate is moved to Replicate (every rank decides alike). A batched one
        (``jax.vmap`` of a ``while_loop`` whose condition reads the mapped values, as
        ``jax.scipy.special.expi`` is written: a predicate per element of the carries'
        leading dims) runs as JAX lowers it: the loop steps while any element's holds, and
        each element of a carry takes the body's value only where its own held, selected
        on the carries gathered (this path's moves beyond the prediction's)."""
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        batched = bool(p["cond_jaxpr"].out_avals[0].shape)

        def carried(arrays: list[jax.Array]) -> list[_Value]:
            return [self.crossing(a, c.phys) for a, c in zip(arrays, init)]

        def predicate(carry: list[jax.Array]) -> jax.Array:
            (value,) = self._run_body(walker, p["cond_jaxpr"], [*cond_consts, *carried(carry)], path + ".cond.")
            everywhere = Layout(self.mesh, ((),) * len(value.phys.shape))
            return jnp.asarray(self.moved(value, everywhere, routes.get(f"{path}.cond.out")).array)

        def cond(carry: list[jax.Array]) -> jax.Array:
            return jnp.any(predicate(carry)) if batched else predicate(carry)

        def body(carry: list[jax.Array]) -> list[jax.Array]:
            outs = self._run_body(walker, p["body_jaxpr"], [*body_consts, *carried(carry)], path + ".body.")
            stepped = self._carried(outs, init, routes, [f"{path}.carry{i}" for i in range(len(init))])
            if not batched:
                return stepped
            held = predicate(carry)
            return [self._where(held, new, old, c.phys) for new, old, c in zip(stepped, carry, init)]

        carry = lax.while_loop(cond, body, [self.looped(v) for v in init])
        return [_Value(a, c.phys) for a, c in zip(carry, init)]

    def _where(self, held: jax.Array, new: jax.Array, old: jax.Array, phys: Physical) -> jax.Array:
        """A batched while's carry (arrays the loop carries, under ``phys``): ``new`` where
        ``held`` (a Replicate predicate over its leading dims), else ``old``, in ``phys``'s
        layout."""
        everywhere = physical(Layout(self.mesh, ((),) * len(phys.shape)), phys.shape)
        new_full, old_full = (jnp.asarray(self.moved(self.crossing(a, phys), everywhere.layout).array)
                              for a in (new, old))
        chosen = jnp.where(lax.broadcast_in_dim(held, phys.shape, tuple(range(held.ndim))), new_full, old_full)
        return self.looped(self.moved(_Value(chosen, everywhere), phys.layout))

    def _cond(
        self, walker: Any, eqn: Any, path: str, signature: Any, ins: list[_Value], routes: _Routes,
        hoisted: Sequence[tuple[int, RedistributePlan]],
    ) -> list[_Value]:
        """Every branch's outputs are moved to the joined layouts (the row's). The
        ``hoisted`` moves of the operands run before the cond, their results operands too,
        which a branch's move of its operand then is: a collective computed in a branch is
        that branch's alone (XLA computes none of them once for all), and the prediction
        counts one move of an operand where its branches read it so
        (:func:`.inference.combine.move_computations`)."""
        index, operands = ins[0], ins[1:]
        outs = [physical(layout, tuple(v.aval.shape)) for layout, v in zip(signature.out_layouts, eqn.outvars)]
        like = [_Value(None, o) for o in outs]
        moved = [self.moved(operands[j], plan.dst, plan) for j, plan in hoisted]

        def branch(k: int, closed: Any) -> Callable[..., list[jax.Array]]:
            def run(*arrays: jax.Array) -> list[jax.Array]:
                values = [self.crossing(a, v.phys) for a, v in zip(arrays, operands)]
                outer = dict(self.hoisted)  # the branch's operands are its trace's alone
                try:
                    for (j, _), a, m in zip(hoisted, arrays[len(operands):], moved, strict=True):
                        self.hoist(values[j], self.crossing(a, m.phys))
                    outs = self._run_body(walker, closed, values, f"{path}.b{k}.")
                    return self._carried(outs, like, routes, [f"{path}.b{k}.out{i}" for i in range(len(like))])
                finally:
                    self.hoisted = outer

            return run

        branches = [branch(k, b) for k, b in enumerate(eqn.params["branches"])]
        arrays = lax.switch(
            jnp.asarray(index.array), branches, *(self.looped(v) for v in (*operands, *moved))
        )
        return [_Value(a, o) for a, o in zip(arrays, outs)]


class _Executor(_Runner):
    """``apply(execute="ops")``: values are physical arrays; each equation runs on every
    rank's local blocks in its own ``jax.shard_map`` (:func:`_local_call`), its inputs
    first moved to the signature's layouts (:func:`.programs.convert`)."""

    def redistributed(self, value: _Value, layout: Layout, plan: RedistributePlan | None = None) -> _Value:
        target = physical(layout, value.phys.shape)
        return _Value(_move(value.array, value.phys, target), target)

    def stack_dims(self, phys: Physical) -> int:
        return _stack_count(phys)

    def looped(self, value: _Value) -> jax.Array:
        """A Partial(sum) on Explicit axes (JAX ``unreduced``) carried as its stacked
        blocks (:func:`relabel`, no communication): a scan slices and stacks what it
        carries, and JAX (0.10.2) has no ``unreduced`` rule for ``dynamic_slice`` (a
        linear recurrence over partial sums raised its NotImplementedError)."""
        array = jnp.asarray(value.array)
        return relabel(value.phys)(array) if value.phys.unreduced_axes else array

    def crossing(self, array: Any, phys: Physical) -> _Value:
        return _Value(_unstack(phys)(array) if phys.unreduced_axes else array, phys)

    def compute(self, eqn: Any, signature: Any, ins: Sequence[_Value]) -> list[_Value]:
        name = eqn.primitive.name
        targets = [physical(layout, v.phys.shape) for layout, v in zip(signature.in_layouts, ins)]
        outs = [physical(layout, tuple(v.aval.shape)) for layout, v in zip(signature.out_layouts, eqn.outvars)]
        if name == "device_put":  # its results are its operands (a pass-through: jax.jit keeps their layouts too);
            # bound per rank in a shard_map of ours, its NamedSharding's axes were refused (not Manual there)
            return [self.moved(v, t.layout) for v, t in zip(ins, targets)]
        if name in DEBUG_EFFECTS or name in HOST_CALLBACKS or name == "shard_map":  # as jax.jit runs them
            if name != "shard_map":  # a host callback's results Replicate
                outs = [physical(Layout(self.mesh, ((),) * v.aval.ndim), tuple(v.aval.shape)) for v in eqn.outvars]
            args = [_to_logical(self.moved(v, t.layout).array, t) for v, t in zip(ins, targets)]
            return [_Value(_from_logical(y, p.layout, p.shape), p) for y, p in zip(_bound_logically(eqn, args), outs)]
        return [_Value(a, p) for a, p in zip(_run_local(eqn, ins, targets, outs), outs)]


def _bound_logically(eqn: Any, args: Sequence[Any]) -> list[Any]:
    """An equation apply runs as ``jax.jit`` runs it, bound on its operands' logical values
    rather than on every rank's blocks. A host callback (:data:`DEBUG_EFFECTS`,
    :data:`HOST_CALLBACKS`): XLA runs it once per program run, on one device (or once per
    shard: ``partitioned=True``), not once per rank as a shard_map of ours would, and
    replicates its results (the prediction's Replicate); its ``sharding`` (a callback's
    SingleDeviceSharding, the device it runs on) is kept: it names no mesh. A ``shard_map``
    region (the user's own per-rank code): its operands in its in_specs' layouts (its
    signature's), its results in its out_specs'; bound again inside a shard_map of ours
    (the same axis names), JAX refused it: the operands vary over every mesh axis there,
    where the body's casts expect its in_specs' axes ("pvary is a invariant->variant
    collective"), and a body over some axes alone (``axis_names=``) is typed on another
    mesh than ours ("context mesh ... should match the aval mesh")."""
    params = _unsharded_params(eqn) if eqn.primitive.name in DEBUG_EFFECTS else eqn.params
    out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _unsharded_params(eqn: Any) -> dict[str, Any]:
    """``eqn``'s parameters without its ``sharding`` / ``out_sharding`` (the traced code's
    Explicit types, which do not apply where apply runs it)."""
    return {k: (None if k in ("sharding", "out_sharding") else v) for k, v in eqn.params.items()}


# a jax.vmap's psum / pmax / pmin over its own axis (positional axes; the walk reaches no other outside a shard_map
# region, which runs as jax.jit runs it): its reduction, run on a rank's block as that reduction is (bound in a
# shard_map of ours, JAX refused it as a collective over axes the block does not vary over)
_VMAP_REDUCTIONS = {"psum": lax.reduce_sum_p, "pmax": lax.reduce_max_p, "pmin": lax.reduce_min_p}


def _run_local(eqn: Any, ins: Sequence[_Value], targets: Sequence[Physical], outs: Sequence[Physical]) -> list[Any]:
    """Equation ``eqn`` on every rank's local blocks (:func:`_local_call`): the physical
    arrays of its inputs (``ins``, moved to ``targets`` first) -> those of its outputs
    (laid out as ``outs``)."""
    primitive, params = _VMAP_REDUCTIONS.get(eqn.primitive.name, eqn.primitive), _unsharded_params(eqn)
    if primitive is not eqn.primitive:
        params = {"axes": tuple(params["axes"]), "out_sharding": None}
    name = primitive.name
    masked = _masked_axes(name, params, targets)
    sliced = _masked_slice_dims(name, targets, outs)
    updated = _masked_update_dims(name, targets)
    groups = _split_groups(name, params, targets, outs)
    local_params = _local_params(name, params, targets, outs)
    function = registered_function(eqn)
    if function is not None:
        compute = partial(_call_registered, function, eqn)
    elif masked is not None:
        run_masked = _masked_gather if name == "gather" else _masked_scatter
        compute = partial(run_masked, primitive, local_params, targets[0], masked)
    elif sliced:
        compute = partial(_masked_slice if name == "slice" else _masked_dynamic_slice, primitive, params,
                          local_params, targets[0], sliced)
    elif updated:
        compute = partial(_masked_update_slice, targets[0], updated)
    elif groups is not None:
        compute = partial(_own_groups, primitive, local_params, *groups)
    else:
        compute = partial(_bind, primitive, local_params)
    constants = {
        i: v.array for i, (v, t) in enumerate(zip(ins, targets)) if v.phys == t and not isinstance(v.array, jax.Array)
    }
    fills = [_fill(name, jnp.result_type(v.array)) for v in ins]
    local = _local_call(compute, targets, outs, fills, constants, check_vma=function is None)
    arrays = [_move(v.array, v.phys, t) for i, (v, t) in enumerate(zip(ins, targets)) if i not in constants]
    return list(local(*arrays))


# primitives the pinned program runs on every rank's blocks (as "ops" does) even without a partial. fft: XLA's CPU
# backend fails at run time on its SPMD partitioning of an FFT whose split operand comes from a fused op
# (jnp.fft.irfft(2 * jnp.fft.rfft(x)) on x split over a leading dim: "RET_CHECK failure (fft_thunk.cc:168)
# LayoutUtil::IsMonotonicWithDim0Major", plain jax.jit on those shardings alike; jax 0.10.2); a rank's FFT in a
# shard_map region runs
_PER_RANK = frozenset({"fft"})


def _pinned_per_rank(eqn: Any, signature: Any) -> bool:
    """Whether the pinned program runs ``eqn`` on every rank's blocks (as "ops" does) in
    ``signature``'s layouts: a primitive of :data:`_PER_RANK`, an equation with a Partial
    input or output (XLA's Auto mode has none; a shard_map region makes its own), or a
    dynamic update slice writing part of a split dim (the masked update: XLA drops a
    one-row window past the end of a dim it splits, :mod:`.inference.xla_defects`)."""
    name = eqn.primitive.name
    if name in _PER_RANK:
        return True
    if name != "shard_map" and any(layout.has_partial for layout in (*signature.in_layouts, *signature.out_layouts)):
        return True
    return name == "dynamic_update_slice" and bool(_masked_update_dims(name, [
        physical(layout, tuple(v.aval.shape)) for layout, v in zip(signature.in_layouts, eqn.invars)
    ]))


class _Pinned(_Runner):
    """``apply(execute="pinned")``: one ``jax.jit`` program that XLA partitions, every
    layout the prediction chose pinned. A value that is not Partial is its logical
    (global) array, pinned (``with_sharding_constraint``) to its layout where it is
    produced and to the layout each equation consumes it in; an equation on such values
    alone is its primitive bound on them. XLA's Auto mode has no partial value (it
    reduces a partial sum where it is made), so an equation with a Partial input or
    output (or of a primitive XLA mispartitions, :data:`_PER_RANK`) runs on every
    rank's blocks as ``"ops"`` runs it (:func:`_run_local`), on the
    Auto twin of the mesh, where a Partial value is its stacked physical array
    (:mod:`.physical`): partial sums are added up as planned and reduced where the
    prediction reduces them. A value's ``phys`` is its predicted layout (on the mesh);
    its array is the stacked physical one exactly when that layout is Partial. A value
    is moved to a layout once, its consumers in that layout sharing the move, and its
    moves whose routes begin alike share those first steps (as the prediction counts
    them: :attr:`.inference.jaxpr.Prediction.steps`), within a computation and those it
    sees (a loop body the moves before the loop; a cond's branches their operands moved
    before the cond, :meth:`_cond`)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__(mesh)
        # (id of a value's array, layout or the layouts of a route so far) -> (that array, kept alive so the id
        # stays its own; the moved value)
        self.moves: dict[tuple[int, Any], tuple[Any, _Value]] = {}

    def redistributed(self, value: _Value, layout: Layout, plan: RedistributePlan | None = None) -> _Value:
        """``value`` in ``layout``, through the layout after each step of ``plan`` (the
        signature's, if given), each pinned, so that XLA takes the planned route (e.g. a
        local slice on one mesh dim before an all-to-all on another, or a partial sum
        reduce-scattered before an all-gather, which XLA would otherwise run on the
        unsliced array)."""
        if layout == value.phys.layout:
            return value
        key = (id(value.array), layout)
        if key not in self.moves:
            route = [step.after for step in plan.steps] if plan is not None and plan.src == value.phys.layout else []
            if not route or route[-1] != layout:
                route.append(layout)
            # each step's result is kept by the route so far: moves whose routes begin alike share those
            # first steps, as the prediction counts them (:attr:`.inference.jaxpr.Prediction.steps`)
            moved, so_far = value, ()
            for after in route:
                so_far = (*so_far, after)
                step_key = (id(value.array), so_far)
                if step_key not in self.moves:
                    self.moves[step_key] = (value.array, self._moved(moved, after))
                moved = self.moves[step_key][1]
            self.moves[key] = (value.array, moved)
        return self.moves[key][1]

    def _run_body(self, walker: Any, closed: Any, ins: Sequence[_Value], prefix: str) -> list[_Value]:
        """A loop body's moves stay in its trace: an outer value moved inside the body is
        the body's tracer, which the code after the loop must not reuse."""
        outer = dict(self.moves)
        try:
            return super()._run_body(walker, closed, ins, prefix)
        finally:
            self.moves = outer

    def _moved(self, value: _Value, layout: Layout) -> _Value:
        """One move (a planned step, or a whole move without a plan)."""
        target = physical(layout, value.phys.shape)
        if layout == value.phys.layout:
            return value
        have, need = value.phys.layout.has_partial, layout.has_partial
        if not have and not need:
            return _Value(_pin(value.array, layout), target)
        if not have:  # a logical value made Partial locally
            return _Value(_from_logical(value.array, _twin(layout), target.shape), target)
        moved = _move(value.array, _twin_physical(value.phys), _twin_physical(target))
        return _Value(moved if need else _to_logical(moved, _twin_physical(target)), target)

    def stack_dims(self, phys: Physical) -> int:
        return len(phys.layout.partial_axes)

    def crossing(self, array: Any, phys: Physical) -> _Value:
        """Pinned where the body receives it and where the loop returns it. A scanned
        slice: a move the body makes of it is then a move of the slice (XLA otherwise
        moves the whole scanned array inside the loop, every iteration). A carry (or a
        branch's operand): XLA otherwise chooses the loop's carried sharding itself, the
        constraint on the carry the body returns being only a move before it; GPT-2 (4
        layers, Megatron on a (8,) mesh) had its backward scan's Replicate carry of
        (8, 8, 32) f32 carried split on dim 0, the body's first consumer and the code
        after the loop each all-gathering it again (+2 x 7,168 B against the prediction).
        A loop's result: otherwise only its consumers' layouts are pinned, and XLA may
        serve one reading it in the loop's layout from another's move; the gradient of
        tests/test_inference_carry.py's ``residual_scan`` on a (8,) mesh moved the
        backward scan's S(0) result to S(1) for one matmul and that copy back to S(0) for
        the other (one all-to-all more: 7,392 B compiled against 7,280 predicted)."""
        return _Value(array if phys.layout.has_partial else _pin(array, phys.layout), phys)

    def compute(self, eqn: Any, signature: Any, ins: Sequence[_Value]) -> list[_Value]:
        shapes = [tuple(v.aval.shape) for v in eqn.outvars]
        if eqn.primitive.name in HOST_CALLBACKS:
            # bound once on the gathered logical operands, its results Replicate at once (the prediction's Partial
            # results are moved to Replicate right after: XLA's all-reduce of them), not per rank
            args = [self.moved(v, layout, plan).array
                    for v, layout, plan in zip(ins, signature.in_layouts, signature.redistributions)]
            outs = [Layout(self.mesh, ((),) * len(shape)) for shape in shapes]
            return [_Value(_pin(y, layout), physical(layout, shape))
                    for y, layout, shape in zip(_bound_logically(eqn, args), outs, shapes, strict=True)]
        if _pinned_per_rank(eqn, signature):
            args = [self.moved(v, layout, plan)
                    for v, layout, plan in zip(ins, signature.in_layouts, signature.redistributions)]
            locals_ = [_Value(self._physical(v), _twin_physical(v.phys)) for v in args]
            outs = [physical(layout, shape) for layout, shape in zip(signature.out_layouts, shapes)]
            ys = _run_local(eqn, locals_, [v.phys for v in locals_], [_twin_physical(o) for o in outs])
            return [_Value(y if o.layout.has_partial else _to_logical(y, _twin_physical(o)), o) for y, o in zip(ys, outs)]
        # the arrays live on the Auto twin of the mesh: an Explicit out_sharding of the traced code does not apply
        params = _unsharded_params(eqn)
        args = [self.moved(v, layout, plan).array
                for v, layout, plan in zip(ins, signature.in_layouts, signature.redistributions)]
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
        outs = out if eqn.primitive.multiple_results else [out]
        # a shard_map region's result partial over the mesh axes it leaves to XLA (its body's partial sum there,
        # :meth:`.inference.jaxpr._Walker._shard_map`): bound, it is the sum, made Partial locally
        return [self._moved(_Value(_pin(y, layout.without_partial()), physical(layout.without_partial(), shape)), layout)
                for y, layout, shape in zip(outs, signature.out_layouts, shapes, strict=True)]

    @staticmethod
    def _physical(value: _Value) -> Any:
        """The physical array (Auto twin) of a value: a logical one placed (padded)."""
        if value.phys.layout.has_partial or not isinstance(value.array, jax.Array):
            return value.array
        return _from_logical(value.array, _twin(value.phys.layout), value.phys.shape)


def _from_stacked(x: jax.Array, phys: Physical) -> jax.Array:
    """The array of ``phys`` (a Partial layout on the mesh) from the stacked array of its
    twin (:func:`_twin`), without communication: the same blocks, typed on the mesh; a
    Partial(sum) on Explicit axes then relabelled ``unreduced`` (:func:`_unstack`)."""
    if phys.layout.mesh.is_explicit:
        x = jax.sharding.reshard(x, NamedSharding(phys.layout.mesh.to_jax(), block_spec(phys)))
    return _unstack(phys)(x) if phys.unreduced_axes else x


@cached(maxsize=1024)
def _unstack(phys: Physical) -> Callable[[jax.Array], jax.Array]:
    """Stacked dims (one per partial mesh axis, :func:`block_spec`) -> ``unreduced``: each
    device's slice of the stack is its partial sum (the inverse of :func:`relabel`)."""
    count = len(phys.unreduced_axes)
    names = tuple(phys.mesh_names[a] for a in phys.unreduced_axes)
    return jax.jit(shard_map(
        lambda b: lax.pcast(b.reshape(b.shape[count:]), names, to="unreduced"),
        mesh=phys.layout.mesh.to_jax(), in_specs=(block_spec(phys),), out_specs=phys.spec,
    ))


@cached(maxsize=64)
def _twin_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return DeviceMesh.from_jax(auto_twin_of(mesh.to_jax()))


@cached(maxsize=4096)
def _twin(layout: Layout) -> Layout:
    """``layout`` on the Auto twin of its mesh (its Partial(sum) stacked, not ``unreduced``)."""
    return Layout(_twin_mesh(layout.mesh), layout.dim_axes, layout.partial,
                  layout.split_factors if layout.is_strided else None)


def _twin_physical(phys: Physical) -> Physical:
    return physical(_twin(phys.layout), phys.shape)


def _pin(x: Any, layout: Layout) -> Any:
    """``x`` constrained to ``layout``'s sharding on the Auto twin of its mesh, where one
    expresses it; a concrete constant (the same everywhere: no move) is left as it is."""
    if not isinstance(x, jax.Array):
        return x
    sharding = _pinned_sharding(layout, tuple(x.shape))
    return x if sharding is None else lax.with_sharding_constraint(x, sharding)


@cached(maxsize=4096)
def _pinned_sharding(layout: Layout, shape: Shape) -> NamedSharding | None:
    """The NamedSharding (Auto twin of the mesh) whose shards of a logical array of
    ``shape`` are ``layout``'s, or None when there is none: a Partial (Auto mode has no
    partial value; pinning its splits alone would force the reduction the prediction
    defers), a strided split (its blocks are permuted), or an uneven dim whose torch.chunk
    blocks are not XLA's (XLA tiles a dim split ``k`` ways, nested axes flattened
    major-first, in blocks of ``ceil(N / k)``; torch chunks nested axes one after the
    other, e.g. 10 rows over 4 x 2 as 2,1,2,1,2,1,1,0)."""
    if layout.has_partial or layout.is_strided:
        return None
    phys = physical(layout, shape)
    for d, n in enumerate(shape):
        pieces = math.prod(layout.pieces(d))
        if pieces > 1 and not chunking.is_even(n, layout.pieces(d)):
            block = -(-n // pieces)
            offsets, lengths = _chunk_tables(phys, d)
            xla = np.minimum(np.arange(pieces) * block, n)
            if not np.array_equal(lengths, np.minimum(block, n - xla)) or not np.array_equal(offsets[lengths > 0], xla[lengths > 0]):
                return None
    return NamedSharding(auto_twin_of(layout.mesh.to_jax()), PartitionSpec(*phys.dim_entries))


def _call_registered(function: Any, eqn: Any, *args: Any) -> list[jax.Array]:
    """Run a function with a registered rule on one rank's blocks (as torch runs a custom
    op on local tensors): its array arguments are the equation's operands."""
    if eqn.primitive.name == "pallas_call" or eqn.params.get("num_consts", 0):
        raise UnsupportedOpError(
            "fn", function.name, "apply runs a registered function by calling it on each rank's blocks, and this "
            "equation is a Pallas kernel or closes over traced values",
            "register (and call) a jax.jit wrapper of the kernel taking every array as an argument",
        )
    outs = jax.tree.leaves(function.function(*args))
    if len(outs) != len(eqn.outvars):
        raise InferenceError(
            "fn", function.name, f"returned {len(outs)} arrays on local blocks, {len(eqn.outvars)} when traced",
            "return the same structure for every input shape",
        )
    return outs


def _bind(primitive: Any, params: dict[str, Any], *args: Any) -> list[jax.Array]:
    """Bind a primitive on local blocks, first making every operand vary over the same
    mesh axes (the jnp wrappers do this; a bare ``bind`` does not)."""
    arrays = [jnp.asarray(a) for a in args]
    vma = frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))
    arrays = [vary(a, vma) for a in arrays]
    out = primitive.bind(*arrays, **params)
    return list(out) if primitive.multiple_results else [out]


def _local_params(
    name: str, params: dict[str, Any], ins: Sequence[Physical], outs: Sequence[Physical]
) -> dict[str, Any]:
    """The equation params for one rank's blocks: shape-valued params of split dims
    become block extents (the rules only split dims these ops keep whole)."""
    if name == "reshape":
        return {**params, "new_sizes": _block_shape(outs[0])}
    if name == "broadcast_in_dim":
        return {**params, "shape": _block_shape(outs[0])}
    if name == "slice":  # a split dim is kept whole (its block; the masked slice picks its window's rows after)
        split = [bool(ins[0].layout.dim_axes[d]) for d in range(len(ins[0].shape))]
        block = _block_shape(ins[0])
        strides = params["strides"] or (1,) * len(split)
        return {
            **params,
            "start_indices": tuple(0 if s else i for s, i in zip(split, params["start_indices"])),
            "limit_indices": tuple(b if s else i for s, b, i in zip(split, block, params["limit_indices"])),
            "strides": tuple(1 if s else n for s, n in zip(split, strides)),
        }
    if name == "dynamic_slice":  # a split dim is kept whole (its block; the masked slice picks its window's rows after)
        block = _block_shape(ins[0])
        return {
            **params,
            "slice_sizes": tuple(
                block[d] if ins[0].layout.dim_axes[d] else n for d, n in enumerate(params["slice_sizes"])
            ),
        }
    if name == "gather":
        block = _block_shape(ins[0])
        axes = ins[0].layout.dim_axes
        sizes = tuple(block[j] if axes[j] and n == ins[0].shape[j] else n for j, n in enumerate(params["slice_sizes"]))
        return {**params, "slice_sizes": sizes}
    if name == "conv_general_dilated":  # grouped dims split only one element per group: a rank's groups are its own
        for count, grouped in (("feature_group_count", 1), ("batch_group_count", 0)):
            dim = params["dimension_numbers"].lhs_spec[grouped]
            if params[count] > 1 and ins[0].layout.dim_axes[dim]:
                return {**params, count: _block_shape(ins[0])[dim]}
    return params


def _masked_slice_dims(name: str, ins: Sequence[Physical], outs: Sequence[Physical]) -> tuple[int, ...]:
    """The dims a static or dynamic slice reads split and returns partial (the rules'
    masked slice, the only slice signature giving up a split dim)."""
    if name not in ("slice", "dynamic_slice"):
        return ()
    return tuple(d for d in range(len(ins[0].shape)) if ins[0].layout.dim_axes[d] and not outs[0].layout.dim_axes[d])


def _masked_slice(
    primitive: Any, params: dict[str, Any], local_params: dict[str, Any], table: Physical, dims: tuple[int, ...],
    operand: jax.Array,
) -> list[jax.Array]:
    """The masked slice: the rank's block sliced on the other dims, then on each of
    ``dims`` the window's rows the block holds (at their index minus the rank's offset),
    zeros for the rows other ranks hold (the output is P(sum) over the mesh axes
    splitting ``dims``)."""
    (out,) = _bind(primitive, local_params, operand)
    strides = params["strides"] or (1,) * out.ndim
    for d in dims:
        start, stop, stride = params["start_indices"][d], params["limit_indices"][d], strides[d]
        out = _window_held(out, table, d, np.arange(start, stop, stride, dtype=np.int32))
    return [out]


def _window_held(block: jax.Array, table: Physical, dim: int, rows: Any) -> jax.Array:
    """A rank's ``block`` (whole on ``dim``) at the global ``rows`` of ``dim``: those the
    rank holds, zeros for the others (a masked slice's window)."""
    local, owned = _rank_rows(table, dim, rows)
    picked = jnp.take(block, jnp.clip(local, 0, block.shape[dim] - 1), axis=dim)
    shape = [1] * block.ndim
    shape[dim] = owned.shape[0]
    return jnp.where(owned.reshape(shape), picked, jnp.zeros((), block.dtype))


def _masked_update_dims(name: str, ins: Sequence[Physical]) -> tuple[int, ...]:
    """The dims a dynamic update slice writes in part on a split operand (the rules'
    masked update: the update whole there)."""
    if name != "dynamic_update_slice":
        return ()
    operand, update = ins[0], ins[1]
    return tuple(
        d for d in range(len(operand.shape)) if operand.layout.dim_axes[d] and update.shape[d] != operand.shape[d]
    )


def _masked_update_slice(
    table: Physical, dims: tuple[int, ...], operand: jax.Array, update: jax.Array, *starts: jax.Array
) -> list[jax.Array]:
    """The masked update: on each of ``dims`` the start clamped as
    ``lax.dynamic_update_slice`` clamps it on the whole dim, the update's rows taken at
    the rank's rows (its offset plus their index) and written where the window holds
    them; the other dims updated as the primitive updates a block (their start as it
    is: whole or split with the update, where it clamps to 0)."""
    mask = None
    local_starts = list(starts)
    for d in dims:
        extent, size = table.shape[d], update.shape[d]
        start = jnp.clip(starts[d], 0, extent - size)
        index = jnp.arange(operand.shape[d], dtype=start.dtype)
        rows = _rank_chunk(table, d, 0).astype(start.dtype) + index
        # a rank's padding rows (past its chunk's length) stay as they are
        inside = (rows >= start) & (rows < start + size) & (index < _rank_chunk(table, d, 1).astype(start.dtype))
        update = jnp.take(update, jnp.clip(rows - start, 0, size - 1), axis=d)
        shape = [1] * operand.ndim
        shape[d] = operand.shape[d]
        inside = inside.reshape(shape)
        mask = inside if mask is None else mask & inside
        local_starts[d] = jnp.zeros((), start.dtype)
    written = lax.dynamic_update_slice(operand, update, local_starts)
    return [jnp.where(mask, written, operand)]


def _masked_dynamic_slice(
    primitive: Any, params: dict[str, Any], local_params: dict[str, Any], table: Physical, dims: tuple[int, ...],
    operand: jax.Array, *starts: jax.Array,
) -> list[jax.Array]:
    """The masked slice of a dynamic slice: the rank's block sliced on the other dims and
    taken whole on ``dims``; on each of those, the start clamped as ``lax.dynamic_slice``
    clamps it on the whole dim, then the window's rows the block holds (at their index
    minus the rank's offset), zeros for the rows other ranks hold."""
    local_starts = [jnp.zeros((), s.dtype) if d in dims else s for d, s in enumerate(starts)]
    (out,) = _bind(primitive, local_params, operand, *local_starts)
    for d in dims:
        size = params["slice_sizes"][d]
        start = jnp.clip(starts[d], 0, table.shape[d] - size)
        out = _window_held(out, table, d, start + jnp.arange(size, dtype=start.dtype))
    return [out]


class _Masked(NamedTuple):
    """Where a masked gather / scatter reads a rank's offsets: its table axes split on
    the rank (``axes``), every indexed axis (``index_map``, the indices' last dim in
    order) and the window's extent on each table dim (``windows``)."""

    axes: tuple[int, ...]
    index_map: tuple[int, ...]
    windows: tuple[int, ...]


def _masked_axes(name: str, params: dict[str, Any], ins: Sequence[Physical]) -> _Masked | None:
    """The looked-up table axes of a gather / scatter (the equation's own params, before
    :func:`_local_params`) whose table (operand) is split along some of them: the
    masked-lookup / masked-scatter signatures of the rules (no other signature splits
    those axes)."""
    dn = params.get("dimension_numbers")
    if name == "gather":
        axes = gather_lookup_axes(dn, params["slice_sizes"], ins[0].shape)
        index_map, windows = dn.start_index_map, params["slice_sizes"]
    elif name in SCATTERS:  # every kind runs masked: a rank drops the updates of rows it does not own (not
        # made neutral), so overwrite, add, sub, mul, min and max all leave other ranks' rows alone
        axes = scatter_lookup_axes(dn, ins[0].shape, ins[2].shape)
        index_map, windows = dn.scatter_dims_to_operand_dims, scatter_windows(dn, ins[0].shape, ins[2].shape)
    else:
        return None
    split = tuple(a for a in axes if ins[0].layout.dim_axes[a])
    return _Masked(split, tuple(index_map), tuple(windows)) if split else None


def _split_groups(
    name: str, params: dict[str, Any], ins: Sequence[Physical], outs: Sequence[Physical]
) -> tuple[Physical, int] | None:
    """A ragged dot split over its groups (the rule's expert-parallel signature, the
    only one splitting the group dim): the tensor holding the group dim (the rhs when
    the ragged dim is free, the output when contracted) and that dim; else None."""
    if name != "ragged_dot_general":
        return None
    dn = params["ragged_dot_dimension_numbers"]
    (lhs_contracting, _), _ = dn.dot_dimension_numbers
    if dn.rhs_group_dimensions:
        holder, dim = ins[1], int(dn.rhs_group_dimensions[0])
    elif dn.lhs_ragged_dimensions[0] in lhs_contracting:
        holder, dim = outs[0], 0
    else:
        return None
    return (holder, dim) if holder.layout.dim_axes[dim] else None


def _own_groups(
    primitive: Any, params: dict[str, Any], holder: Physical, dim: int,
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
) -> list[jax.Array]:
    """The masked ragged dot: this rank's groups (its block of ``holder``'s group dim
    ``dim``) over the lhs rows, every row outside them zeroed and counted into the
    rank's first group (rows before: the earlier groups') or last (rows after), so
    every row lies in a local group (no backend's reading of rows outside every group
    is relied on) and only the rank's own rows contribute. Uneven splits: the pad
    groups past the last have no rows."""
    (ragged,) = params["ragged_dot_dimension_numbers"].lhs_ragged_dimensions
    count = _block_shape(holder)[dim]
    first = _rank_chunk(holder, dim, 0).astype(group_sizes.dtype)
    index = lax.iota(group_sizes.dtype, group_sizes.shape[0])
    before = jnp.sum(jnp.where(index < first, group_sizes, 0))
    padded = jnp.concatenate([group_sizes, jnp.zeros((count,), group_sizes.dtype)])
    own = lax.dynamic_slice_in_dim(padded, first, count)
    after = before + jnp.sum(own)
    rows = lax.broadcasted_iota(group_sizes.dtype, lhs.shape, int(ragged))
    lhs = jnp.where((rows >= before) & (rows < after), lhs, jnp.zeros((), lhs.dtype))
    own = own.at[0].add(before).at[-1].add(lhs.shape[ragged] - after)
    return _bind(primitive, params, lhs, rhs, own)


def _local_rows(table: Physical, masked: _Masked, indices: jax.Array, clamp: bool) -> tuple[jax.Array, jax.Array]:
    """Global start indices of a gather / scatter into ``table`` (split along the
    ``masked.axes``, indexed dims one row or taken whole) as this rank's: on each of those
    axes the index minus the rank's offset where the rank owns the row or point (its
    coordinates on all of them fall in its blocks), else the block's extent (out of
    bounds: a FILL_OR_DROP scatter drops its update; a gather's row is masked); and where
    it owns it. ``clamp``: first clamp every start index so its window fits, as XLA does
    (gathers, clip-mode scatters); otherwise an out-of-range index belongs to no rank."""
    if clamp:
        bounds = np.array([table.shape[d] - masked.windows[d] for d in masked.index_map])
        indices = jnp.clip(indices, 0, bounds.astype(indices.dtype))
    columns = [masked.index_map.index(axis) for axis in masked.axes]
    local, held = zip(*(_rank_rows(table, a, indices[..., c]) for c, a in zip(columns, masked.axes)))
    owned = functools.reduce(operator.and_, held)
    block = _block_shape(table)
    for c, row, a in zip(columns, local, masked.axes):
        indices = indices.at[..., c].set(jnp.where(owned, row, np.asarray(block[a], indices.dtype)))
    return indices, owned


def _local_params_of_rows(params: dict[str, Any], mode: lax.GatherScatterMode) -> dict[str, Any]:
    """Params of the local gather / scatter on rank-local indices (:func:`_local_rows`):
    ``mode`` for their out-of-bounds non-owned rows, and no promise of sorted or unique
    indices (every non-owned index is the same out-of-bounds one)."""
    return {**params, "mode": mode, "indices_are_sorted": False, "unique_indices": False}


def _masked_gather(
    primitive: Any, params: dict[str, Any], table: Physical, masked: _Masked, operand: jax.Array, indices: jax.Array
) -> list[jax.Array]:
    """The masked lookup: each rank gathers the rows (points) it owns, 0 elsewhere (the
    output is P(sum) over the mesh axes splitting the ``masked.axes``). In fill mode an
    index no rank owns gives the fill value once, on the first rank along those axes."""
    dn, mode = params["dimension_numbers"], lax.GatherScatterMode.from_any(params["mode"])
    fill = mode == lax.GatherScatterMode.FILL_OR_DROP
    local, owned = _local_rows(table, masked, indices, clamp=not fill)
    # non-owned rows are masked below: clip-gathered (a promise of in-bounds indices no
    # longer holds), or filled in fill mode (the fill value of the first rank's strays)
    local_mode = mode if fill else lax.GatherScatterMode.CLIP
    (out,) = _bind(primitive, _local_params_of_rows(params, local_mode), operand, local)
    if fill:
        rows = [indices[..., masked.index_map.index(a)] for a in masked.axes]
        stray = functools.reduce(operator.or_, [(r < 0) | (r >= table.shape[a]) for r, a in zip(rows, masked.axes)])
        first = functools.reduce(operator.and_, [_flat_index(table, a) == 0 for a in masked.axes])
        owned = owned | (stray & first)
    mask = jnp.expand_dims(owned, tuple(dn.offset_dims))
    return [jnp.where(mask, out, jnp.zeros((), out.dtype))]


def _masked_scatter(
    primitive: Any,
    params: dict[str, Any],
    table: Physical,
    masked: _Masked,
    operand: jax.Array,
    indices: jax.Array,
    updates: jax.Array,
) -> list[jax.Array]:
    """The masked scatter: each rank applies the updates of the rows (points) it owns at
    the index minus its offsets and drops the others (XLA drops out-of-range updates
    unless the mode is clip)."""
    clamp = lax.GatherScatterMode.from_any(params["mode"]) == lax.GatherScatterMode.CLIP
    local, _ = _local_rows(table, masked, indices, clamp=clamp)
    return _bind(primitive, _local_params_of_rows(params, lax.GatherScatterMode.FILL_OR_DROP), operand, local, updates)


# -- local execution in shard_map ------------------------------------------------------------


def _block_shape(phys: Physical) -> Shape:
    """One rank's (padded) block of the tensor dims."""
    return tuple(n // chunking.padded_size(1, phys.layout.pieces(d)) for d, n in enumerate(phys.padded_shape))


def _local_call(
    compute: Callable[..., Sequence[jax.Array]],
    ins: Sequence[Physical],
    outs: Sequence[Physical],
    fills: Sequence[Any],
    constants: dict[int, Any] | None = None,
    check_vma: bool = True,
) -> Callable[..., tuple[jax.Array, ...]]:
    """A traceable function of the non-constant inputs' physical arrays (laid out as
    ``ins``) that runs ``compute`` on every rank's local blocks in ``jax.shard_map`` and
    returns the outputs' physical arrays (laid out as ``outs``). ``constants`` (input
    position -> concrete Replicate value) are closed over instead of passed.
    ``check_vma=False`` for user code that JAX's varying-axes check rejects (a Pallas
    call in interpret mode binds its body on unvarying values, JAX 0.10)."""
    constants = constants or {}
    passed = [i for i in range(len(ins)) if i not in constants]
    mesh = (ins[passed[0]] if passed else outs[0]).layout.mesh.to_jax()

    def local(*blocks: jax.Array) -> tuple[jax.Array, ...]:
        given = dict(zip(passed, blocks))
        masks: dict[Physical, jax.Array] = {}
        xs = [constants[i] if i in constants else _unpack(given[i], ins[i], fills[i], masks) for i in range(len(ins))]
        ys = list(compute(*xs))
        return tuple(_pack(y, p, masks) for y, p in zip(ys, outs, strict=True))

    run = shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(block_spec(ins[i]) for i in passed),
        out_specs=tuple(p.spec for p in outs),
        check_vma=check_vma,
    )

    def call_local(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        return run(*(relabel(ins[i])(a) if ins[i].unreduced_axes else a for i, a in zip(passed, arrays)))

    return call_local


def _stack_count(phys: Physical) -> int:
    return len(phys.stacked_axes) + len(phys.unreduced_axes)


def block_spec(phys: Physical) -> PartitionSpec:
    """The spec each input is read with: unreduced axes as stacked dims (see relabel)."""
    if not phys.unreduced_axes:
        return phys.spec
    return PartitionSpec(*(phys.mesh_names[a] for a in phys.unreduced_axes), *phys.dim_entries)


def _unpack(block: jax.Array, phys: Physical, fill: Any, masks: dict[Physical, jax.Array]) -> jax.Array:
    block = lax.reshape(block, block.shape[_stack_count(phys) :])
    mask = _valid(phys, masks) if phys.is_padded else None
    if mask is None:  # even (a strided dim is even: its block is reordered, not padded)
        return block
    return lax.select(mask, block, lax.full_like(block, fill))


def _pack(y: jax.Array, phys: Physical, masks: dict[Physical, jax.Array]) -> jax.Array:
    expected = _block_shape(phys)
    if tuple(y.shape) != expected:
        raise UnsupportedOpError(
            "op",
            phys.layout,
            f"its local result has shape {tuple(y.shape)}, but the block of {phys.shape} is {expected}",
            "this op has shape parameters that cannot be computed per rank; redistribute its inputs to Replicate",
        )
    mask = _valid(phys, masks) if phys.is_padded else None
    if mask is not None:
        y = lax.select(mask, y, lax.full_like(y, 0))
    names = phys.mesh_names
    split = {names[a] for axes in phys.layout.dim_axes for a in axes}
    partial_axes = tuple(names[a] for a in phys.layout.partial_axes)
    y = vary(y, frozenset(split) | frozenset(partial_axes))
    y = y.reshape((1,) * len(phys.stacked_axes) + y.shape)
    if phys.unreduced_axes:
        y = jax.lax.pcast(y, partial_axes, to="unreduced")
    return y


def vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    missing = tuple(sorted(axes - jax.typeof(x).mat.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@cached(maxsize=1024)
def relabel(phys: Physical) -> Callable[[jax.Array], jax.Array]:
    """``unreduced`` array -> the same device buffers read as stacked dims (one per
    partial axis). JAX has no unreduced -> varying cast, so this is a manual no-op
    shard_map; its transpose takes each rank's cotangent slot as the ``reduced``
    cotangent JAX expects for an unreduced value (all slots are equal: a consumer of a
    Partial(sum) is linear in it)."""
    mesh = phys.layout.mesh.to_jax()
    count = len(phys.unreduced_axes)
    names = frozenset(phys.mesh_names[a] for a in phys.unreduced_axes)
    stacked = block_spec(phys)
    to_stack = shard_map(
        lambda b: b.reshape((1,) * count + b.shape),
        mesh=mesh,
        in_specs=(phys.spec,),
        out_specs=stacked,
        check_vma=False,
    )
    from_stack = shard_map(
        lambda c: c.reshape(c.shape[count:]),
        mesh=mesh,
        in_specs=(stacked,),
        out_specs=PartitionSpec(*phys.dim_entries, reduced=names),
        check_vma=False,
    )

    @jax.custom_vjp
    def relabel(x: jax.Array) -> jax.Array:
        return to_stack(x)

    relabel.defvjp(lambda x: (to_stack(x), None), lambda _, ct: (from_stack(ct),))
    return relabel


# -- padding masks ---------------------------------------------------------------------------


@cached(maxsize=4096)
def _chunk_tables(phys: Physical, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Offset and length of every rank's chunk of ``dim``, indexed by the row-major
    coordinate over the mesh axes splitting it (major first)."""
    sizes = [phys.layout.mesh.shape[a] for a in phys.layout.dim_axes[dim]]
    chunks = [
        chunking.nested_chunk(phys.shape[dim], tuple(zip(sizes, index)))
        for index in itertools.product(*(range(n) for n in sizes))
    ]
    return np.array([c[0] for c in chunks], np.int32), np.array([c[1] for c in chunks], np.int32)


def _flat_index(phys: Physical, dim: int) -> jax.Array:
    """This rank's row-major coordinate over the mesh axes splitting ``dim``."""
    index = None
    for a in phys.layout.dim_axes[dim]:
        coordinate = lax.axis_index(phys.mesh_names[a])
        index = (
            coordinate if index is None else lax.add(lax.mul(index, np.int32(phys.layout.mesh.shape[a])), coordinate)
        )
    return index


def _rank_rows(phys: Physical, dim: int, rows: Any) -> tuple[jax.Array, jax.Array]:
    """Global ``rows`` of ``dim`` as this rank's block reads them (minus its chunk's
    offset), and where the rank holds them (within its chunk's length)."""
    local = rows - _rank_chunk(phys, dim, 0).astype(rows.dtype)
    return local, (local >= 0) & (local < _rank_chunk(phys, dim, 1).astype(rows.dtype))


def _rank_chunk(phys: Physical, dim: int, which: int) -> jax.Array:
    """This rank's chunk offset (``which=0``) or length (1) along ``dim``."""
    table = _chunk_tables(phys, dim)[which]
    return lax.dynamic_index_in_dim(table, _flat_index(phys, dim), keepdims=False)


def _valid(phys: Physical, masks: dict[Physical, jax.Array]) -> jax.Array:
    """True at this rank's logical elements of its block (data sits at the block start);
    built once per physical representation in a local program (``masks``)."""
    if phys not in masks:
        block = _block_shape(phys)
        mask = None
        for d in range(len(block)):
            if chunking.is_even(phys.shape[d], phys.layout.pieces(d)):
                continue
            inside = lax.lt(lax.broadcasted_iota(np.int32, block, d), _rank_chunk(phys, d, 1))
            mask = inside if mask is None else lax.bitwise_and(mask, inside)
        masks[phys] = mask
    return masks[phys]


_LOWEST_FIRST = {"max": True, "reduce_max": True, "min": False, "reduce_min": False}
_ALL_BITS = {"reduce_and": -1, "reduce_or": 0}  # bitwise and / or: all bits set / none (True / False on bools)


def _fill(op: str, dtype: Any) -> Any:
    """The neutral element pads take before ``op``: lowest (max), highest (min), all bits
    set (and: ``jnp.all`` of bools reduced over a split dim, whose pads must be True),
    else 0."""
    if op in _ALL_BITS:
        return np.array(_ALL_BITS[op]).astype(dtype)[()]
    if op not in _LOWEST_FIRST:
        return 0
    dtype = np.dtype(dtype)
    lowest = _LOWEST_FIRST[op]
    if dtype == np.bool_:
        return not lowest
    if jnp.issubdtype(dtype, jnp.inexact):
        return -np.inf if lowest else np.inf
    info = jnp.iinfo(dtype)
    return info.min if lowest else info.max
