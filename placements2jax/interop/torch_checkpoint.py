"""Load a ``torch.distributed.checkpoint`` (DCP) of torch DTensors into DTensors.

The bridge for moving a torch-trained sharded model to JAX. A DCP checkpoint directory
holds ``.metadata`` (every tensor's global size, dtype and saved chunks: offset and size)
and ``.distcp`` files with each chunk serialised by ``torch.save``. :func:`load_torch_checkpoint`
reads it with torch's own ``FileSystemReader`` metadata and, for every rank of this
process under the target layout, loads only the saved chunks that overlap the rank's
torch.chunk block and copies the overlap: no process reads a whole tensor unless its
devices hold it. Values are the bytes torch wrote (exact, bfloat16 included).

The checkpoint does not record placements (DCP stores chunks); the target says where
each tensor goes: a DTensor or :class:`~placements2jax.checkpoint.AbstractDTensor` per
fully qualified name (``{"layers.0.w": ...}`` or the nested ``{"layers": {"0": {"w": ...}}}``,
whose path joined by ``.`` is the name), with the torch placements or any others.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..checkpoint import AbstractDTensor, describe_leaf
from ..dtensor import DTensor
from ..errors import ArgumentTypeError, CheckpointError, Placements2JaxError, import_extra
from ..programs import redistribute_array

__all__ = ["load_torch_checkpoint"]


def _torch() -> Any:
    torch = import_extra("torch", "torch", "reading a torch.distributed.checkpoint")
    return torch, import_extra("torch.distributed.checkpoint", "torch", "reading a torch.distributed.checkpoint")


def _fqn(key_path: Any) -> str:
    return jax.tree_util.keystr(tuple(key_path), simple=True, separator=".")


def _numpy(tensor: Any) -> np.ndarray:
    torch, _ = _torch()
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _numpy_dtype(torch_dtype: Any) -> np.dtype:
    torch, _ = _torch()
    return _numpy(torch.empty(0, dtype=torch_dtype)).dtype


def load_torch_checkpoint(path: str | os.PathLike[str], target: Any) -> Any:
    """``target``'s pytree with every DTensor / AbstractDTensor leaf loaded from the torch
    DCP checkpoint directory ``path`` (by fully qualified name) into that leaf's layout.
    A name missing from the checkpoint, or another shape or dtype, is a
    :class:`CheckpointError` naming it."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError("path", path, "expected a directory path", "pass the checkpoint_id given to dcp.save")
    torch, dcp = _torch()
    root = Path(path)
    try:
        metadata = dcp.FileSystemReader(str(root)).read_metadata()
    except Exception as error:  # noqa: BLE001 - torch raises plain exceptions of several kinds
        raise CheckpointError(
            "path", str(root), f"not a readable torch.distributed.checkpoint ({type(error).__name__}: {error})",
            "pass the directory given to torch.distributed.checkpoint.save(checkpoint_id=...)",
        ) from None
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Any]]] = {}
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata.get(index.fqn)
        if entry is None or not hasattr(entry, "chunks"):
            continue
        sizes = next(c.sizes for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
        chunks.setdefault(index.fqn, []).append((tuple(index.offset), tuple(sizes), info))
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda v: isinstance(v, (DTensor, AbstractDTensor))
    )
    values = []
    for key_path, leaf in flat:
        name = _fqn(key_path)
        if not isinstance(leaf, (DTensor, AbstractDTensor)):
            raise ArgumentTypeError(
                f"target at {name!r}", leaf, "expected a DTensor or AbstractDTensor", "say where each tensor goes"
            )
        entry = metadata.state_dict_metadata.get(name)
        if entry is None or not hasattr(entry, "size"):
            have = ", ".join(sorted(k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size"))[:8])
            raise CheckpointError(
                f"target at {name!r}", describe_leaf(leaf), f"the torch checkpoint has no tensor {name!r} (it has: {have})",
                "name the target's leaves by the state dict's fully qualified names",
            )
        shape, dtype = tuple(entry.size), _numpy_dtype(entry.properties.dtype)
        if tuple(leaf.shape) != shape or np.dtype(leaf.dtype) != dtype:
            raise CheckpointError(
                f"target at {name!r}", describe_leaf(leaf),
                f"the torch checkpoint's {name!r} is {dtype}{list(shape)}, the target {np.dtype(leaf.dtype)}{list(leaf.shape)}",
                "load into a target of the saved shape and dtype",
            )
        layout = leaf.layout if isinstance(leaf, DTensor) else leaf.layout()
        values.append(_load(root, name, chunks.get(name, []), layout, shape, dtype))
    return jax.tree_util.tree_unflatten(treedef, values)


def _load(root: Path, name: str, saved: list[Any], layout: Any, shape: tuple[int, ...], dtype: np.dtype) -> DTensor:
    torch, _ = _torch()
    plain = layout.without_partial()
    mesh = plain.mesh
    process = jax.process_index()
    loaded: dict[tuple[int, ...], np.ndarray] = {}

    def chunk(offset: tuple[int, ...], info: Any) -> np.ndarray:
        if offset not in loaded:
            if info.transform_descriptors:
                raise CheckpointError(
                    "path", str(root), f"{name!r} is stored with transforms {list(info.transform_descriptors)}",
                    "save without compression or other storage transforms",
                )
            with open(root / info.relative_path, "rb") as stream:
                stream.seek(info.offset)
                data = stream.read(info.length)
            loaded[offset] = _numpy(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
        return loaded[offset]

    blocks = {}
    for rank in mesh.rank_list:
        if mesh.device(rank).process_index != process:
            continue
        region = plain.local_slices(shape, rank)
        block = np.zeros(tuple(s.stop - s.start for s in region), dtype)
        for offset, sizes, info in saved:
            lo = [max(s.start, o) for s, o in zip(region, offset)]
            hi = [min(s.stop, o + n) for s, o, n in zip(region, offset, sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            source = chunk(offset, info)[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))]
            block[tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, region))] = source
        blocks[rank] = block
    try:
        result = DTensor.from_local(blocks, mesh, plain, shape=shape)
    except Placements2JaxError as error:
        raise type(error)(f"target at {name!r}", error.value, error.problem, error.fix) from None
    if not layout.has_partial:
        return result
    return DTensor(redistribute_array(result.array, plain, layout, shape), layout, shape)
