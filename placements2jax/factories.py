"""Parameters born sharded: torch's DTensor factory functions and a model's own init.

``zeros``, ``ones``, ``full``, ``empty``, ``rand`` and ``randn`` follow
``torch.distributed.tensor`` (size first, ``device_mesh=`` and ``placements=`` keywords;
``rand`` / ``randn`` take a JAX ``key=`` instead of torch's global generator), and
:func:`init_pytree` runs a model's own init function (pure JAX, Flax NNX, Equinox) so that
every parameter comes out in the layout a plan gives it, as torch's meta-device init
followed by ``distribute_module`` does.

**No full tensor.** Each call is one ``jax.jit`` whose values are constrained to their
layout's sharding where they are made, so XLA's SPMD partitioner computes on each device
only its block (the tests read the compiled HLO: no value of the full shape on a device).
Random values come from JAX's counter-based threefry, which XLA partitions when
``jax_threefry_partitionable`` is on (JAX's default since 0.5): each device hashes only
the counters of its own elements, so the values are exactly those of the unsharded
``jax.random.normal(key, shape)``, for every layout (torch needs its offset-based RNG
tracker for this). With the flag off the values are the same but each device computes
them all.

**Why an Auto mesh inside.** On an Explicit mesh a value made without a sharding is
replicated and ``reshard`` is a hard boundary: XLA would compute the whole tensor on every
device and then slice it. The program therefore runs on an Auto-axis twin of the mesh
(same devices and names), where ``with_sharding_constraint`` propagates back into the
generator, also for uneven extents (XLA pads its tiles internally); the padded physical
blocks are then relabelled with the Explicit sharding without a copy.

**Partial placements.** The DTensor's logical value is the requested one, as for
:func:`~placements2jax.distribute_tensor` (sum: each rank holds ``x / n``). torch's
factories instead fill every rank's local tensor, so a torch ``Partial(sum)`` ``ones`` is
``n`` everywhere; here it is ``1``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import chunking
from .caches import cached
from .dtensor import DTensor, check_partial_dtype, placements_layout, auto_twin_of
from .errors import ArgumentTypeError, Placements2JaxError
from .layout import Layout, PlacementsLike, as_shape
from .mesh import DeviceMesh, as_device_mesh
from .parallelize import PlanLike, at_path, path_of, plan_layouts
from .physical import Physical, physical
from .programs import redistribute_array

__all__ = ["zeros", "ones", "full", "empty", "rand", "randn", "init_pytree"]


def zeros(
    *size: int | Sequence[int],
    device_mesh: DeviceMesh,
    placements: PlacementsLike | None = None,
    dtype: Any = jnp.float32,
) -> DTensor:
    """A DTensor of zeros of shape ``size`` laid out by ``placements`` (torch's
    ``torch.distributed.tensor.zeros``); ``placements=None`` replicates."""
    return _factory("zeros", size, device_mesh, placements, dtype, None, 0)


def ones(
    *size: int | Sequence[int],
    device_mesh: DeviceMesh,
    placements: PlacementsLike | None = None,
    dtype: Any = jnp.float32,
) -> DTensor:
    """A DTensor of ones (torch's ``torch.distributed.tensor.ones``)."""
    return _factory("ones", size, device_mesh, placements, dtype, None, 1)


def empty(
    *size: int | Sequence[int],
    device_mesh: DeviceMesh,
    placements: PlacementsLike | None = None,
    dtype: Any = jnp.float32,
) -> DTensor:
    """torch's ``torch.distributed.tensor.empty``. XLA has no uninitialised buffers, so
    this is :func:`zeros` (the values are defined: zero)."""
    return _factory("empty", size, device_mesh, placements, dtype, None, 0)


def full(
    size: int | Sequence[int],
    fill_value: Any,
    *,
    device_mesh: DeviceMesh,
    placements: PlacementsLike | None = None,
    dtype: Any = None,
) -> DTensor:
    """A DTensor filled with ``fill_value`` (torch's ``torch.distributed.tensor.full``);
    ``dtype=None`` takes JAX's dtype of ``fill_value``."""
    if isinstance(fill_value, DTensor) or np.ndim(fill_value) != 0 or not isinstance(
        np.asarray(fill_value).dtype.type(0), (np.number, np.bool_)
    ):
        raise ArgumentTypeError("fill_value", fill_value, "expected a number", "pass e.g. 0.5")
    return _factory("full", (size,), device_mesh, placements, dtype, None, fill_value)


def rand(
    *size: int | Sequence[int],
    key: jax.Array,
    device_mesh: DeviceMesh,
    placements: PlacementsLike | None = None,
    dtype: Any = jnp.float32,
) -> DTensor:
    """Uniform values in [0, 1), exactly ``jax.random.uniform(key, size, dtype)`` (torch's
    ``torch.distributed.tensor.rand`` with a JAX key instead of the global generator)."""
    return _factory("rand", size, device_mesh, placements, dtype, key, None)


def randn(
    *size: int | Sequence[int],
    key: jax.Array,
    device_mesh: DeviceMesh,
    placements: PlacementsLike | None = None,
    dtype: Any = jnp.float32,
) -> DTensor:
    """Standard normal values, exactly ``jax.random.normal(key, size, dtype)`` (torch's
    ``torch.distributed.tensor.randn``)."""
    return _factory("randn", size, device_mesh, placements, dtype, key, None)


_MAKERS: dict[str, Callable[[Any, tuple[int, ...], Any, Any], jax.Array]] = {
    "zeros": lambda key, shape, dtype, fill: jnp.zeros(shape, dtype),
    "ones": lambda key, shape, dtype, fill: jnp.ones(shape, dtype),
    "empty": lambda key, shape, dtype, fill: jnp.zeros(shape, dtype),
    "full": lambda key, shape, dtype, fill: jnp.full(shape, fill, dtype),
    "rand": lambda key, shape, dtype, fill: jax.random.uniform(key, shape, dtype),
    "randn": lambda key, shape, dtype, fill: jax.random.normal(key, shape, dtype),
}


def _factory(
    kind: str, size: tuple[Any, ...], device_mesh: Any, placements: Any, dtype: Any, key: Any, fill: Any
) -> DTensor:
    shape = _size(size)
    mesh = as_device_mesh(device_mesh)
    dtype = _dtype(dtype, fill)
    if kind in ("rand", "randn"):
        key = _key(key)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ArgumentTypeError("dtype", dtype, f"{kind} makes floating-point values", "pass e.g. jnp.float32")
    layout = placements_layout(mesh, placements, len(shape))
    check_partial_dtype(layout, dtype)
    program = _factory_program(kind, shape, dtype, layout, fill)
    (leaf,) = _wrap(program(key), [layout], [shape])
    return leaf


@cached(maxsize=512)
def _factory_program(kind: str, shape: tuple[int, ...], dtype: np.dtype, layout: Layout, fill: Any) -> Any:
    maker = _MAKERS[kind]
    return born_program(lambda k: [maker(k, shape, dtype, fill)], [layout], [shape])


def _size(size: tuple[Any, ...]) -> tuple[int, ...]:
    """torch accepts ``zeros(2, 3)`` and ``zeros((2, 3))``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    return as_shape(size, "size")


def _dtype(dtype: Any, fill: Any) -> np.dtype:
    if dtype is None:
        return jnp.asarray(fill).dtype
    try:
        result = jax.dtypes.canonicalize_dtype(np.dtype(dtype))
        jax.eval_shape(lambda: jnp.zeros((), result))  # NumPy's float128 or a void type: JAX holds neither
    except TypeError:
        raise ArgumentTypeError(
            "dtype", dtype, "not a dtype JAX arrays can hold", "pass e.g. jnp.float32 or jnp.bfloat16"
        ) from None
    if result.kind not in "biufcV" and result != jnp.bfloat16:
        raise ArgumentTypeError("dtype", dtype, "not a numeric dtype", "pass e.g. jnp.float32 or jnp.bfloat16")
    return result


def _key(key: Any) -> jax.Array:
    if isinstance(key, jax.Array) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (key.dtype == jnp.uint32 and key.shape == (2,))
    ):
        return key
    raise ArgumentTypeError(
        "key", key, "expected a JAX random key", "pass key=jax.random.key(0) (or a split of your training key)"
    )


def _auto_twin(mesh: DeviceMesh) -> jax.sharding.Mesh:
    """The mesh's devices and axis names with Auto axes (module docstring)."""
    return auto_twin_of(mesh.to_jax())


def _plain_sharding(plain: Physical) -> NamedSharding:
    return NamedSharding(_auto_twin(plain.layout.mesh), PartitionSpec(*plain.dim_entries))


def place(x: jax.Array, layout: Layout, shape: tuple[int, ...]) -> jax.Array:
    """Inside the program: the logical value ``x`` constrained to ``layout``'s splits
    (no partial) on the Auto twin, then padded to the physical blocks.

    A dim whose padding sits at the end of the blocks (one split, or nested splits whose
    torch.chunk blocks are XLA's tiles) is padded in place. A nested uneven split
    (e.g. 6 over ``(tp, dp)``: torch chunks each tp half again, XLA would tile the
    whole dim) is laid out level by level: XLA tiles the dim over its major axis (the
    torch.chunk blocks of that level), and each device then gathers its minor blocks from
    the major block it already holds, so no device holds more than one major block.
    """
    plain = physical(layout.without_partial(), shape)
    mesh = _auto_twin(plain.layout.mesh)
    names = mesh.axis_names
    nested = [d for d in range(len(shape)) if not plain.is_prefix(d)]
    entries = list(plain.dim_entries)
    for d in nested:
        entries[d] = names[layout.dim_axes[d][0]]
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*entries)))
    for d in nested:
        x = _nested_blocks(x, d, layout, shape, entries, mesh)
        entries[d] = plain.dim_entries[d]
    padded = [d for d in range(len(shape)) if d not in nested and plain.padded_shape[d] != shape[d]]
    if padded:
        x = jnp.pad(x, [(0, plain.padded_shape[d] - shape[d] if d in padded else 0) for d in range(len(shape))])
    return jax.lax.with_sharding_constraint(x, _plain_sharding(plain))


def _nested_blocks(
    x: jax.Array, d: int, layout: Layout, shape: tuple[int, ...], entries: list[Any], mesh: jax.sharding.Mesh
) -> jax.Array:
    """Dim ``d`` of ``x`` (tiled over its major axis) to its padded physical blocks."""
    axes = layout.dim_axes[d]
    pieces = layout.pieces(d)
    major, rest = pieces[0], math.prod(pieces[1:])
    size = shape[d]
    major_block = -(-size // major)
    block = chunking.block_size(size, pieces)
    table = _nested_table(size, pieces)  # (major, rest * block) indices into a major block (+1: zero)
    widths = [(0, 0)] * x.ndim
    widths[d] = (0, major * major_block - size)
    x = jnp.pad(x, widths)
    x = x.reshape(x.shape[:d] + (major, major_block) + x.shape[d + 1 :])
    names = mesh.axis_names
    split = [*entries[:d], names[axes[0]], None, *entries[d + 1 :]]
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*split)))
    widths = [(0, 0)] * x.ndim
    widths[d + 1] = (0, 1)  # index major_block reads a zero: the padding
    x = jnp.pad(x, widths)
    x = jax.vmap(lambda row, index: jnp.take(row, index, axis=d), in_axes=(d, 0), out_axes=d)(x, jnp.asarray(table))
    minor = tuple(names[a] for a in axes[1:])
    split[d + 1] = minor[0] if len(minor) == 1 else minor
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*split)))
    return x.reshape(x.shape[:d] + (major * rest * block,) + x.shape[d + 2 :])


@cached(maxsize=256)
def _nested_table(size: int, pieces: tuple[int, ...]) -> np.ndarray:
    major_block = -(-size // pieces[0])
    block = chunking.block_size(size, pieces)
    minor = pieces[1:]
    table = np.full((pieces[0], math.prod(minor) * block), major_block, np.int32)
    for i in range(pieces[0]):
        _, length = chunking.chunk_1d(size, pieces[0], i)
        for j, indices in enumerate(itertools.product(*(range(p) for p in minor))):
            offset, count = chunking.nested_chunk(length, tuple(zip(minor, indices)))
            table[i, j * block : j * block + count] = offset + np.arange(count)
    return table


def born_program(
    make: Callable[[Any], Sequence[jax.Array]], layouts: Sequence[Layout], shapes: Sequence[tuple[int, ...]]
) -> jax.stages.Wrapped:
    """The jitted program (argument: the key) whose outputs are the physical blocks,
    without partials, of ``make(key)``'s leaves under ``layouts``. Exposed for reading
    the compiled HLO (the tests check it holds no value of a full shape)."""
    shardings = [_plain_sharding(physical(lay.without_partial(), s)) for lay, s in zip(layouts, shapes)]

    def body(key: Any) -> list[jax.Array]:
        return [place(x, lay, s) for x, lay, s in zip(make(key), layouts, shapes)]

    return jax.jit(body, out_shardings=shardings)


def _wrap(outputs: Sequence[jax.Array], layouts: Sequence[Layout], shapes: Sequence[tuple[int, ...]]) -> list[DTensor]:
    """DTensors from :func:`born_program`'s outputs."""
    result = []
    for array, layout, shape in zip(outputs, layouts, shapes):
        plain = layout.without_partial()
        target = physical(plain, shape).sharding
        if target != array.sharding:  # an Explicit mesh: the same blocks under its sharding (no copy)
            array = jax.make_array_from_single_device_arrays(
                array.shape, target, [s.data for s in array.addressable_shards]
            )
        if layout.has_partial:
            array = redistribute_array(array, plain, layout, shape)  # local: scale / stack, no traffic
        result.append(DTensor(array, layout, shape))
    return result


def init_pytree(
    init_fn: Callable[[jax.Array], Any], key: jax.Array, mesh: DeviceMesh, plan: PlanLike, *, strict: bool = True
) -> Any:
    """``init_fn(key)``'s pytree with every array leaf a DTensor laid out by ``plan``
    (see :mod:`placements2jax.parallelize`), each created directly in its layout.

    ``init_fn`` is the model's own init, traced once by ``jax.eval_shape`` (nothing is
    allocated) and then run in one ``jax.jit`` whose outputs carry the planned shardings,
    so no device ever holds a whole parameter. Random values are exactly those of the
    unsharded ``jax.jit(init_fn)(key)`` (eager op-by-op execution may round fused
    arithmetic such as ``normal * 0.02`` differently).

    Flax NNX: ``lambda k: nnx.to_pure_dict(nnx.state(Model(rngs=nnx.Rngs(k))))`` (paths
    such as ``up/kernel``). Equinox: ``lambda k: Model(k)``; non-array leaves such as
    activation functions are kept as they are.
    """
    if not callable(init_fn):
        raise ArgumentTypeError("init_fn", init_fn, "expected a function key -> pytree", "pass e.g. model.init")
    key = _key(key)
    mesh = as_device_mesh(mesh, "mesh")
    captured: dict[str, Any] = {}

    def arrays_of(k: Any) -> list[jax.Array]:
        tree = init_fn(k)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        positions = [i for i, (_, leaf) in enumerate(leaves) if isinstance(leaf, jax.Array)]
        captured.update(treedef=treedef, leaves=leaves, positions=positions)
        return [leaves[i][1] for i in positions]

    try:
        shapes = jax.eval_shape(arrays_of, key)
    except Placements2JaxError:
        raise
    except Exception as error:  # the user's init failed: say so, with its own message
        raise ArgumentTypeError(
            "init_fn", init_fn, f"tracing it with jax.eval_shape failed ({type(error).__name__}: {error})",
            "make init_fn a pure function of the key that returns a pytree of arrays",
        ) from None
    leaves, positions = captured["leaves"], captured["positions"]
    named = {path_of(leaves[i][0]): jax.ShapeDtypeStruct(s.shape, s.dtype) for i, s in zip(positions, shapes)}
    layouts_by_path = plan_layouts(named, mesh, plan, strict=strict)
    layouts = [layouts_by_path[path_of(leaves[i][0])] for i in positions]
    for (path, aval), layout in zip(named.items(), layouts):
        try:
            check_partial_dtype(layout, aval.dtype)
        except Placements2JaxError as error:
            raise at_path(error, path) from None
    sizes = [tuple(s.shape) for s in shapes]
    placed = _wrap(born_program(arrays_of, layouts, sizes)(key), layouts, sizes)
    values = [leaf for _, leaf in leaves]
    for i, dtensor in zip(positions, placed):
        values[i] = dtensor
    return jax.tree_util.tree_unflatten(captured["treedef"], values)
