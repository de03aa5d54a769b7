"""Checkpoints of DTensor pytrees that reshard on load, on tensorstore (zarr v3).

``save(path, tree, step=s)`` writes ``path/<s>/``: one zarr array per leaf holding its
*logical* tensor (partials reduced, no padding), plus ``metadata.json`` recording each
leaf's shape, dtype, mesh and placements (torch form and alias form). ``load(path,
target)`` reads the latest complete step (or ``step=``) into the layouts ``target`` gives
(DTensors, or :class:`AbstractDTensor` leaves), on any mesh: another shape, another device
count, other placements. Values are exact: bytes are copied, never recomputed.

**Each process touches only its devices' data.** Saving, a process writes the torch.chunk
blocks of its own ranks (one writer per replicated block, chosen by the lowest rank); the
zarr chunk grid divides every block boundary, so two processes never write one chunk.
Loading, a process reads exactly the blocks its ranks hold under the target layout and
assembles them on its devices (``DTensor.from_local``); Partial targets are then split by
XLA on the devices (no traffic).

**Atomic steps.** A step is written into ``path/<s>.partial-<token>/`` and renamed to
``path/<s>/`` once every leaf and the metadata are on disk (by process 0, after all
processes finished writing). A save killed midway leaves a ``.partial-`` directory that
``load`` ignores: the previous steps stay complete and loadable.

**Non-DTensor leaves** (e.g. optax's step ``count``): an array is stored whole, written
once, by process 0 (every process's view of a replicated array is the same value; an array
split over processes is first gathered by :func:`jax.experimental.multihost_utils.process_allgather`,
a collective every process joins), and read by every process. It loads with the sharding of
its target: a ``jax.Array`` or ``jax.ShapeDtypeStruct`` target with a sharding over a mesh
(possibly spanning processes) gets that sharding, each process placing only its own
devices' pieces; a single-device or NumPy target gives an uncommitted array, as
``jnp.asarray`` does. Python numbers go in the metadata.

**PRNG keys** (typed, ``jax.random.key``: optax.noisy_sgd's state, a Flax NNX model's
``Rngs``; keys as ``distribute_pytree`` and ``apply`` leave them, or a Replicate DTensor of keys) have no
NumPy form: a key leaf is stored as its ``jax.random.key_data`` (unsigned integers, one
trailing dim more) with its implementation's name, and loads as keys again
(``jax.random.wrap_key_data`` of the data each process placed on its own devices) into a
key target (keys, a DTensor of keys, or a ``jax.ShapeDtypeStruct`` of a key dtype), in the
target's form and sharding.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .dtensor import DTensor, is_key_dtype
from .errors import ArgumentTypeError, CheckpointError, Placements2JaxError, import_extra
from .layout import Layout, PlacementsLike, as_shape
from .mesh import DeviceMesh, as_device_mesh
from .parallelize import path_of
from .placements import format_placements
from .programs import redistribute_array

__all__ = ["AbstractDTensor", "save", "load", "read_metadata", "latest_step"]

FORMAT = "placements2jax-checkpoint"
VERSION = 1
_STEP = re.compile(r"\d+")


@dataclass(frozen=True)
class AbstractDTensor:
    """A load target without data: the logical ``shape``, the ``dtype`` and where it goes
    (``placements`` on ``device_mesh``, torch or alias form; None replicates)."""

    shape: tuple[int, ...]
    dtype: Any
    device_mesh: DeviceMesh
    placements: PlacementsLike | None = None

    def __post_init__(self) -> None:
        """Shape, dtype and mesh checked as written (the placements when loading, where
        the error names the target's path)."""
        object.__setattr__(self, "shape", as_shape(self.shape, "shape"))
        try:
            np.dtype(jnp.dtype(self.dtype))
        except (TypeError, ValueError):
            raise ArgumentTypeError("dtype", self.dtype, "not a dtype", "pass e.g. jnp.float32") from None
        object.__setattr__(self, "device_mesh", as_device_mesh(self.device_mesh))

    def layout(self) -> Layout:
        from .dtensor import placements_layout

        return placements_layout(as_device_mesh(self.device_mesh), self.placements, len(self.shape))


def _tensorstore() -> Any:
    return import_extra("tensorstore", "train", "checkpointing")


def _root(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError("path", path, "expected a directory path", "pass e.g. 'checkpoints/run1'")
    return Path(path)


def _is_leaf(value: Any) -> bool:
    return isinstance(value, (DTensor, AbstractDTensor))


def _leaves(tree: Any, argument: str) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    leaves = [(path_of(key_path), leaf) for key_path, leaf in flat]
    seen: set[str] = set()
    for path, _ in leaves:
        if path in seen:
            raise ArgumentTypeError(argument, path, "two leaves render to the same path", "use distinct pytree keys")
        seen.add(path)
    return leaves


def _directory_name(path: str) -> str:
    """A leaf path as one directory name (kept readable, made unambiguous)."""
    return re.sub(r"[^A-Za-z0-9_.-]", lambda m: f"%{ord(m.group()):02X}", path) or "%root"


def _mesh_record(mesh: DeviceMesh) -> dict[str, Any]:
    jax_mesh = mesh.to_jax()
    return {"shape": list(mesh.shape), "axis_names": list(jax_mesh.axis_names), "ranks": [int(r) for r in mesh.rank_list]}


def _chunk_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The zarr chunk extent per dim: the gcd of every block's offset and length, so no
    chunk straddles two ranks' blocks (concurrent writers never share a chunk)."""
    chunks = []
    for dim, size in enumerate(shape):
        g = 0
        for rank in layout.mesh.rank_list:
            offset, length = layout.global_offset(shape, rank)[dim], layout.local_shape(shape, rank)[dim]
            if length:
                g = math.gcd(g, math.gcd(offset, length))
        chunks.append(max(1, g or size))
    return tuple(chunks)


def _open(directory: Path, *, create: bool = False, shape: Sequence[int] = (), dtype: Any = None,
          chunks: Sequence[int] = ()) -> Any:
    ts = _tensorstore()
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(directory)}}
    if not create:
        return ts.open(spec, open=True).result()
    kwargs: dict[str, Any] = {"dtype": ts.dtype(np.dtype(dtype).name), "shape": list(shape)}
    if shape:
        kwargs["chunk_layout"] = ts.ChunkLayout(write_chunk_shape=list(chunks))
    return ts.open(spec, create=True, **kwargs).result()


def save(path: str | os.PathLike[str], tree: Any, *, step: int = 0) -> Path:
    """Write ``tree`` (DTensors, arrays, numbers) as step ``step`` of the checkpoint
    directory ``path``; returns the step's directory. Collective over processes: every
    process calls it with its view of the same tree."""
    _check_step(step)
    root = _root(path)
    leaves = _leaves(tree, "tree")
    final = root / str(int(step))
    token = _shared_token()
    staging = root / f"{int(step)}.partial-{token}"
    process = jax.process_index()
    records: dict[str, Any] = {}
    for name, leaf in leaves:
        directory = staging / "leaves" / _directory_name(name)
        if _is_key(leaf):
            records[name] = _save_keys(directory, leaf)
        elif isinstance(leaf, DTensor):
            records[name] = _save_dtensor(directory, leaf)
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            value = _write_whole(directory, _host_value(leaf))
            records[name] = {"kind": "array", "shape": list(value.shape), "dtype": value.dtype.name}
        elif isinstance(leaf, (bool, int, float)):
            records[name] = {"kind": "number", "value": leaf, "type": type(leaf).__name__}
        elif leaf is None:
            continue
        else:
            raise ArgumentTypeError(
                f"tree at {name!r}", leaf, "not a DTensor, an array or a number", "keep only arrays in the saved pytree"
            )
    _barrier("placements2jax-checkpoint-written")
    if process == 0:
        (staging / "metadata.json").write_text(
            json.dumps({"format": FORMAT, "version": VERSION, "step": int(step), "leaves": records}, indent=1)
        )
        if final.exists():  # re-saving a step: the old copy goes only once the new one is complete
            old = root / f"{int(step)}.replaced-{token}"
            final.rename(old)
            staging.rename(final)
            shutil.rmtree(old)
        else:
            staging.rename(final)
    _barrier("placements2jax-checkpoint-committed")
    return final


def _is_key(leaf: Any) -> bool:
    """A typed PRNG key array (or a DTensor or ``jax.ShapeDtypeStruct`` of one)."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and is_key_dtype(dtype)


def _write_whole(directory: Path, value: np.ndarray) -> np.ndarray:
    """``value`` stored whole, one chunk, written once (by process 0; save's barrier makes
    every process wait for it)."""
    if jax.process_index() == 0:
        store = _open(directory, create=True, shape=value.shape, dtype=value.dtype, chunks=value.shape or ())
        store.write(value).result()
    return value


def _save_keys(directory: Path, leaf: Any) -> dict[str, Any]:
    """A key leaf as its key data, stored whole like an array leaf (keys are Replicate)."""
    keys = leaf.to_jax() if isinstance(leaf, DTensor) else leaf
    _write_whole(directory, _host_value(jax.random.key_data(keys)))
    return {"kind": "keys", "shape": list(keys.shape), "dtype": str(keys.dtype), "impl": str(jax.random.key_impl(keys))}


def _host_value(leaf: Any) -> np.ndarray:
    """The whole value of a non-DTensor array leaf on this process's host. An array whose
    devices span processes is read from this process's own copy when it is replicated,
    else gathered by a collective (every process saves the same tree, so all join it)."""
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf)
    if leaf.is_fully_addressable:
        return np.asarray(jax.device_get(leaf))
    if leaf.is_fully_replicated:
        return np.asarray(leaf.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))


def _blocks_layout(layout: Layout) -> Layout:
    """The layout whose ranks hold torch.chunk blocks of the logical tensor, as the store's
    chunks are written and read: the same splits, without partials or split factors (a
    strided shard's elements are no block)."""
    return Layout(layout.mesh, layout.dim_axes) if layout.is_strided else layout.without_partial()


def _save_dtensor(directory: Path, leaf: DTensor) -> dict[str, Any]:
    layout, shape = leaf.layout, leaf.shape
    plain = _blocks_layout(layout)
    value = leaf if plain is layout else DTensor(
        redistribute_array(leaf.array, layout, plain, shape), plain, shape
    )  # partial sums reduced, strided dims unstrided, by XLA on the devices
    chunks = _chunk_shape(plain, shape)
    store = _open(directory, create=True, shape=shape, dtype=leaf.dtype, chunks=chunks) if jax.process_index() == 0 \
        else None
    _barrier("placements2jax-checkpoint-created")
    if store is None:
        store = _open(directory)
    writers: dict[tuple[Any, ...], int] = {}
    for rank in plain.mesh.rank_list:
        writers.setdefault(tuple((s.start, s.stop) for s in plain.local_slices(shape, rank)), rank)
    process = jax.process_index()
    futures = []
    for block, rank in writers.items():
        if plain.mesh.device(rank).process_index != process or any(stop == start for start, stop in block):
            continue
        data = np.asarray(value.to_local(rank))
        futures.append(store[tuple(slice(a, b) for a, b in block)].write(data))
    for future in futures:
        future.result()
    return {
        "kind": "dtensor",
        "shape": list(shape),
        "dtype": np.dtype(leaf.dtype).name,
        "mesh": _mesh_record(layout.mesh),
        "placements": format_placements(layout.placements),
        "layout": str(layout),
        # the alias form has no split factor: none for a strided layout (its placements say it)
        "alias": None if layout.is_strided else [list(e) if isinstance(e, tuple) else e for e in layout.alias_map],
        "partial": list(layout.partial),
    }


def _shared_token() -> str:
    """One random token for every process of this save (process 0's, broadcast)."""
    token = uuid.uuid4().hex[:12]
    if jax.process_count() == 1:
        return token
    from jax.experimental import multihost_utils

    raw = np.frombuffer(token.encode(), dtype=np.uint8)
    shared = multihost_utils.broadcast_one_to_all(raw)
    return bytes(np.asarray(shared, np.uint8)).decode()


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def latest_step(path: str | os.PathLike[str]) -> int | None:
    """The largest complete step saved under ``path`` (None when there is none)."""
    root = _root(path)
    if not root.is_dir():
        return None
    steps = [int(p.name) for p in root.iterdir() if _STEP.fullmatch(p.name) and (p / "metadata.json").is_file()]
    return max(steps) if steps else None


def read_metadata(path: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The metadata of step ``step`` (default: the latest complete one) of ``path``:
    ``{"step": ..., "leaves": {path: {"shape", "dtype", "mesh", "placements", ...}}}``."""
    directory = _step_directory(path, step)
    try:
        metadata = json.loads((directory / "metadata.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError("path", str(directory), f"unreadable metadata.json ({error})", "pass a complete checkpoint") \
            from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError("path", str(directory), "not a placements2jax checkpoint", "pass a directory save() wrote")
    return metadata


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ArgumentTypeError("step", step, "expected a non-negative int", "pass e.g. step=100")


def _step_directory(path: str | os.PathLike[str], step: int | None) -> Path:
    root = _root(path)
    if step is not None:
        _check_step(step)
    else:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(
                "path", str(root), "holds no complete checkpoint step", "pass the directory given to save()"
            )
    directory = root / str(int(step))
    if not (directory / "metadata.json").is_file():
        have = latest_step(root)
        raise CheckpointError(
            "step", step, f"no complete step {step} in {root}", f"pass an existing step (latest: {have})"
        )
    return directory


def load(path: str | os.PathLike[str], target: Any, *, step: int | None = None) -> Any:
    """The saved tree in the layouts of ``target``: each DTensor leaf of ``target`` (or
    :class:`AbstractDTensor`) gives the mesh and placements to load into (any mesh, any
    placements); array leaves (``jax.Array``, NumPy, or ``jax.ShapeDtypeStruct``) load as
    arrays with the target's mesh sharding, number leaves as numbers. A leaf missing
    from the checkpoint, or saved with another shape or dtype, is a
    :class:`CheckpointError` naming it."""
    metadata = read_metadata(path, step)
    directory = _step_directory(path, metadata["step"])
    records = metadata["leaves"]
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_leaf)
    values = []
    for key_path, leaf in flat:
        name = path_of(key_path)
        record = records.get(name)
        if record is None:
            if leaf is None:
                values.append(None)
                continue
            shown = ", ".join(sorted(records)[:8]) + (", ..." if len(records) > 8 else "")
            raise CheckpointError(
                f"target at {name!r}", describe_leaf(leaf), f"the checkpoint has no leaf {name!r} (it has: {shown})",
                "load with a target of the saved tree's structure, or save that leaf",
            )
        values.append(_load_leaf(directory / "leaves" / _directory_name(name), name, record, leaf))
    return jax.tree_util.tree_unflatten(treedef, values)


def describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, DTensor):
        return f"DTensor(shape={leaf.shape}, dtype={leaf.dtype}, placements={leaf.layout})"
    return repr(leaf)


def _load_leaf(directory: Path, name: str, record: dict[str, Any], leaf: Any) -> Any:
    if record["kind"] == "number":
        return record["value"]
    if record["kind"] == "keys" or _is_key(leaf):
        return _load_keys(directory, name, record, leaf)
    saved_shape, saved_dtype = tuple(record["shape"]), np.dtype(jnp.dtype(record["dtype"]))
    if isinstance(leaf, (DTensor, AbstractDTensor)):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        layout = leaf.layout if isinstance(leaf, DTensor) else _target_layout(leaf, name)
    elif isinstance(leaf, jax.ShapeDtypeStruct):
        shape, dtype, layout = tuple(leaf.shape), np.dtype(leaf.dtype), None
    else:
        value = np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
        shape, dtype, layout = tuple(value.shape), np.dtype(value.dtype), None
    if shape != saved_shape:
        raise CheckpointError(
            f"target at {name!r}", describe_leaf(leaf), f"the checkpoint's {name!r} has shape {saved_shape}, the target {shape}",
            "load into a target of the saved shape (resharding changes placements, not shapes)",
        )
    if dtype != saved_dtype:
        raise CheckpointError(
            f"target at {name!r}", describe_leaf(leaf), f"the checkpoint's {name!r} has dtype {saved_dtype}, the target {dtype}",
            "load with the saved dtype, then cast (tree.map(lambda a: a.astype(...)))",
        )
    try:
        store = _open(directory)
        if layout is None:
            return _placed(store.read().result(), getattr(leaf, "sharding", None))
        arrays = _read_blocks(store, _blocks_layout(layout), shape)
    except Exception as error:  # noqa: BLE001 - tensorstore raises ValueError subclasses of its own
        raise _unreadable(name, directory, error) from None
    plain = _blocks_layout(layout)
    loaded = DTensor.from_local(arrays, plain.mesh, plain, shape=shape)
    if plain is layout:
        return loaded
    return DTensor(redistribute_array(loaded.array, plain, layout, shape), layout, shape)


def _unreadable(name: str, directory: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"target at {name!r}", str(directory), f"the leaf's data cannot be read ({type(error).__name__}: {error})",
        "the checkpoint is corrupt or incomplete: load another step",
    )


def _load_keys(directory: Path, name: str, record: dict[str, Any], leaf: Any) -> Any:
    """A saved key leaf as keys in the form of its key target (:func:`_save_keys`)."""
    saved = (tuple(record["shape"]), record["dtype"]) if record["kind"] == "keys" else None
    target = (tuple(leaf.shape), str(leaf.dtype)) if _is_key(leaf) else None
    if saved != target:
        what = "PRNG keys" if saved is None else f"{saved[1]} keys of shape {saved[0]}"
        raise CheckpointError(
            f"target at {name!r}", describe_leaf(leaf),
            f"the checkpoint's {name!r} is {'not PRNG keys' if saved is None else what}, the target "
            f"{'is not' if target is None else f'{target[1]} keys of shape {target[0]}'}",
            "load PRNG keys into a key target (the keys, a DTensor of keys or jax.ShapeDtypeStruct(shape, key.dtype)) "
            "and other leaves into targets of their own dtype",
        )
    try:
        data = _open(directory).read().result()
    except Exception as error:  # noqa: BLE001 - tensorstore raises ValueError subclasses of its own
        raise _unreadable(name, directory, error) from None
    # placed as key data (a NumPy array each process places on its own devices, as _placed does: JAX's
    # device_put takes no jax.Array of keys to devices of other processes), then wrapped on the devices
    if isinstance(leaf, DTensor):  # Replicate: its physical array is the keys on every device of its mesh
        sharding = jax.sharding.NamedSharding(leaf.device_mesh.to_jax(), jax.sharding.PartitionSpec())
    else:
        sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jax.random.wrap_key_data(jnp.asarray(data), impl=record["impl"])
    data_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, None))
    keys = jax.random.wrap_key_data(_placed(data, data_sharding), impl=record["impl"])
    return DTensor.trusted(keys, leaf.layout, tuple(leaf.shape)) if isinstance(leaf, DTensor) else keys


def _placed(value: np.ndarray, sharding: Any) -> jax.Array:
    """A non-DTensor leaf read whole (by every process), with its target's sharding when
    that is a mesh sharding (each process places its own devices' pieces), else
    uncommitted like ``jnp.asarray``."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jnp.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _target_layout(leaf: AbstractDTensor, name: str) -> Layout:
    try:
        return leaf.layout()
    except Placements2JaxError as error:
        raise type(error)(f"target at {name!r}", error.value, error.problem, error.fix) from None


def _read_blocks(store: Any, plain: Layout, shape: tuple[int, ...]) -> dict[int, np.ndarray]:
    """The torch.chunk block of every rank of this process (each distinct block read once)."""
    mesh = plain.mesh
    process = jax.process_index()
    reads: dict[tuple[tuple[int, int], ...], Any] = {}
    keys = {}
    for rank in mesh.rank_list:
        if mesh.device(rank).process_index != process:
            continue
        slices = plain.local_slices(shape, rank)
        key = tuple((s.start, s.stop) for s in slices)
        if key not in reads:
            reads[key] = store[slices].read()
        keys[rank] = key
    return {rank: np.asarray(reads[key].result()) for rank, key in keys.items()}
