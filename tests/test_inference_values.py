"""The meaning of every signature, checked numerically without a DTensor.

For each op of a catalogue and each mesh, *every* candidate signature inference lists
(not only the chosen one) is simulated: the full inputs are cut per rank with
``layout.local_slices`` (partial inputs get a random decomposition whose reduction is the
input), the op runs locally per rank in NumPy, and the local outputs, reduced over the
output's partial mesh dims, must equal the slices of the full NumPy result that the
predicted output layout gives each rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import ArgumentTypeError, Layout, init_device_mesh
from placements2jax.chunking import chunk_1d
from placements2jax.inference import (
    RedistributeStep,
    infer_signature,
    plan_redistribute,
)
from placements2jax.inference.signature import Candidate
from placements2jax.layout import iter_layouts

F32 = np.float32


@dataclass(frozen=True)
class Ctx:
    """What a rank knows besides its local inputs."""

    in_offsets: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]


@dataclass
class Case:
    op: str
    shapes: Sequence[tuple[int, ...]]
    reference: Callable[..., Any]
    params: dict[str, Any] = field(default_factory=dict)
    local: Callable[..., Any] | None = None  # local(ctx, *locals) when it differs from reference
    dtypes: Sequence[Any] | None = None
    inputs: Callable[[np.random.Generator], list[np.ndarray]] | None = None


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True, initial=-np.inf))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    mean = x.mean(axis=axis, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axis, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def _masked_take(ctx: Ctx, table: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    """A rank's lookup: rows of its table chunk, zeros for rows another rank owns."""
    low, size = ctx.in_offsets[0][axis], table.shape[axis]
    inside = (indices >= low) & (indices < low + size)
    local = np.take(table, np.clip(indices - low, 0, max(size - 1, 0)), axis=axis) if size else None
    shape = table.shape[:axis] + indices.shape + table.shape[axis + 1 :]
    if local is None:
        return np.zeros(shape)
    mask = inside.reshape((1,) * axis + indices.shape + (1,) * (table.ndim - axis - 1))
    return np.where(mask, local, 0.0)


def _reshape_local(ctx: Ctx, x: np.ndarray, shape: Any = None) -> np.ndarray:
    return x.reshape(ctx.out_shapes[0])


def _broadcast_local(ctx: Ctx, x: np.ndarray, shape: Any = None) -> np.ndarray:
    return np.broadcast_to(x, ctx.out_shapes[0])


def _einsum(subscripts: str) -> Callable[..., np.ndarray]:
    return lambda *xs, subscripts=None: np.einsum(subscripts or "", *xs)


def _indices(shape: tuple[int, ...], high: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.integers(0, high, size=shape)


def _take_inputs(table: tuple[int, ...], indices: tuple[int, ...], axis: int) -> Callable[..., list[np.ndarray]]:
    return lambda rng: [rng.standard_normal(table), rng.integers(0, table[axis], size=indices)]


def _where_inputs(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal((4, 6)) > 0, rng.standard_normal((4, 6)), rng.standard_normal((4, 6))]


def _reduce(fn: Callable[..., np.ndarray], initial: float | None = None) -> Callable[..., np.ndarray]:
    def run(x: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
        axis = tuple(axis) if isinstance(axis, (list, tuple)) else axis
        extra = {} if initial is None else {"initial": initial}
        return fn(x, axis=axis, keepdims=keepdims, **extra)

    return run


CASES = [
    Case("add", [(4, 6), (4, 6)], np.add),
    Case("add", [(4, 6), (6,)], np.add),
    Case("sub", [(4, 1), (1, 6)], np.subtract),
    Case("mul", [(4, 6), (4, 6)], np.multiply),
    Case("mul", [(4, 6), ()], np.multiply),
    Case("div", [(4, 6), (4, 1)], np.divide),
    Case("maximum", [(4, 6), (4, 6)], np.maximum),
    Case("minimum", [(4, 6), (6,)], np.minimum),
    Case("neg", [(4, 6)], np.negative),
    Case("exp", [(4, 6)], np.exp),
    Case("tanh", [(5, 7)], np.tanh),
    Case("add_n", [(4, 6), (4, 6), (4, 6)], lambda *xs: sum(xs)),
    Case("where", [(4, 6), (4, 6), (4, 6)], np.where, inputs=_where_inputs, dtypes=[bool, F32, F32]),
    Case("astype", [(4, 6)], lambda x, dtype: x.astype(np.float64), {"dtype": np.float16}),
    Case("matmul", [(4, 6), (6, 8)], np.matmul),
    Case("matmul", [(5, 6), (6, 7)], np.matmul),
    Case("matmul", [(2, 4, 6), (2, 6, 8)], np.matmul),
    Case("matmul", [(2, 4, 6), (6, 8)], np.matmul),
    Case("matmul", [(1, 4, 6), (4, 6, 2)], np.matmul),
    Case("matmul", [(6,), (6, 8)], np.matmul),
    Case("einsum", [(2, 4, 6), (2, 6, 4)], _einsum("bij,bjk->bik"), {"subscripts": "bij,bjk->bik"}),
    Case("einsum", [(4, 6), (4, 6)], _einsum("ij,ij->i"), {"subscripts": "ij,ij->i"}),
    Case("einsum", [(4, 6)], _einsum("ij->j"), {"subscripts": "ij->j"}),
    Case(
        "dot_general",
        [(2, 4, 6), (2, 8, 6)],
        lambda a, b, dimension_numbers: np.einsum("bij,bkj->bik", a, b),
        {"dimension_numbers": (((2,), (2,)), ((0,), (0,)))},
    ),
    Case("sum", [(4, 6)], _reduce(np.sum), {"axis": 0}),
    Case("sum", [(5, 6)], _reduce(np.sum), {"axis": 0}),
    Case("sum", [(4, 6, 2)], _reduce(np.sum), {"axis": (0, 2), "keepdims": True}),
    Case("sum", [(4, 6)], _reduce(np.sum)),
    Case("mean", [(4, 6)], _reduce(np.mean), {"axis": 1}),
    Case("mean", [(6, 4)], _reduce(np.mean), {"axis": 0, "keepdims": True}),
    Case("mean", [(5, 4)], _reduce(np.mean), {"axis": 0}),
    Case("max", [(4, 6)], _reduce(np.max, -np.inf), {"axis": 1}),
    Case("min", [(4, 6, 2)], _reduce(np.min, np.inf), {"axis": (0, 1)}),
    Case("argmax", [(4, 6)], lambda x, axis: np.argmax(x, axis=axis), {"axis": 1}),
    Case("prod", [(4, 6)], _reduce(np.prod), {"axis": 0}),
    Case("transpose", [(2, 4, 6)], np.transpose, {"axes": (1, 2, 0)}),
    Case("transpose", [(4, 6)], np.transpose),
    Case("reshape", [(4, 6)], np.reshape, {"shape": (24,)}, local=_reshape_local),
    Case("reshape", [(4, 6)], np.reshape, {"shape": (2, 2, 6)}, local=_reshape_local),
    Case("reshape", [(2, 4, 6)], np.reshape, {"shape": (8, 6)}, local=_reshape_local),
    Case("reshape", [(4, 6)], np.reshape, {"shape": (6, 4)}, local=_reshape_local),
    Case("reshape", [(1, 8)], np.reshape, {"shape": (8,)}, local=_reshape_local),
    Case("reshape", [(6, 4)], np.reshape, {"shape": (3, 2, 4)}, local=_reshape_local),
    Case("broadcast_to", [(6,)], np.broadcast_to, {"shape": (4, 6)}, local=_broadcast_local),
    Case("broadcast_to", [(4, 1)], np.broadcast_to, {"shape": (2, 4, 6)}, local=_broadcast_local),
    Case("softmax", [(4, 6)], _softmax, {"axis": -1}),
    Case("log_softmax", [(4, 6)], lambda x, axis: np.log(_softmax(x, axis)), {"axis": 0}),
    Case("layer_norm", [(4, 6), (6,), (6,)], _layer_norm),
    Case("take", [(8, 6), (4,)], np.take, {"axis": 0}, local=_masked_take, inputs=_take_inputs((8, 6), (4,), 0),
         dtypes=[F32, np.int32]),
    Case("take", [(6, 8), (2, 3)], np.take, {"axis": 1}, local=_masked_take, inputs=_take_inputs((6, 8), (2, 3), 1),
         dtypes=[F32, np.int32]),
    Case("concatenate", [(4, 6), (4, 6)], lambda *xs, axis: np.concatenate(xs, axis=axis), {"axis": 1}),
]

MESHES = {
    "4": ((4,), ("x",)),
    "2x2": ((2, 2), ("a", "b")),
}


def _parts(x: np.ndarray, op: str, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` arrays whose reduction with ``op`` is ``x`` (a random decomposition)."""
    if op in ("sum", "avg"):
        parts = [rng.standard_normal(x.shape).astype(x.dtype) for _ in range(count - 1)]
        total = x if op == "sum" else count * x
        return parts + [total - sum(parts, np.zeros(x.shape, x.dtype))]
    owner = rng.integers(count, size=x.shape)
    sign = -1.0 if op == "max" else 1.0
    return [np.where(owner == k, x, x + sign * (0.5 + np.abs(rng.standard_normal(x.shape)))) for k in range(count)]


def local_inputs(x: np.ndarray, layout: Layout, rng: np.random.Generator) -> dict[int, np.ndarray]:
    mesh, dims = layout.mesh, layout.partial_axes
    sizes = [mesh.shape[m] for m in dims]
    parts = _parts(x, layout.partial_op, math.prod(sizes), rng) if dims else [x]
    result = {}
    for rank in mesh.rank_list:
        coordinate = mesh.get_coordinate(rank)
        k = int(np.ravel_multi_index([coordinate[m] for m in dims], sizes)) if dims else 0
        result[rank] = parts[k][layout.local_slices(x.shape, rank)]
    return result


_REDUCE = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


def assert_output(
    full: np.ndarray, layout: Layout, local: dict[int, np.ndarray], context: str, tolerance: float = 1e-9
) -> None:
    """Every rank's block of ``full`` under ``layout`` (partial groups reduced) equals ``local``."""
    mesh, dims = layout.mesh, layout.partial_axes
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in mesh.rank_list:
        coordinate = mesh.get_coordinate(rank)
        groups.setdefault(tuple(c for m, c in enumerate(coordinate) if m not in dims), []).append(rank)
    for ranks in groups.values():
        values = np.stack([np.asarray(local[r]).astype(np.complex128 if np.iscomplexobj(full) else np.float64)
                           for r in ranks])
        reduced = _REDUCE[layout.partial_op](values, axis=0) if dims else values
        for i, rank in enumerate(ranks):
            expected = full[layout.local_slices(full.shape, rank)]
            got = reduced if dims else reduced[i]
            assert got.shape == expected.shape, f"{context}: rank {rank} local shape {got.shape} != {expected.shape}"
            np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=f"{context}: rank {rank}")


def simulate(case: Case, candidate: Candidate, values: list[np.ndarray], rng: np.random.Generator) -> None:
    """Run ``case`` per rank under ``candidate`` and compare with the full result."""
    context = f"{case.op}{list(case.shapes)} {candidate}"
    full = case.reference(*values, **case.params)
    fulls = list(full) if isinstance(full, tuple) else [np.asarray(full)]
    locals_ = [local_inputs(x, layout, rng) for x, layout in zip(values, candidate.in_layouts)]
    mesh = candidate.in_layouts[0].mesh if candidate.in_layouts else candidate.out_layouts[0].mesh
    outputs: dict[int, np.ndarray] = {}
    for rank in mesh.rank_list:
        args = [blocks[rank] for blocks in locals_]
        if case.local is None:
            outputs[rank] = case.reference(*args, **case.params)
        else:
            ctx = Ctx(
                tuple(layout.global_offset(x.shape, rank) for x, layout in zip(values, candidate.in_layouts)),
                tuple(layout.local_shape(f.shape, rank) for f, layout in zip(fulls, candidate.out_layouts)),
            )
            outputs[rank] = case.local(ctx, *args, **case.params)
    assert_output(fulls[0], candidate.out_layouts[0], outputs, context)


def _specs(case: Case, layouts: Sequence[Layout]) -> list[tuple[tuple[int, ...], Any, Layout]]:
    dtypes = case.dtypes or [F32] * len(case.shapes)
    return [(shape, dtype, layout) for shape, dtype, layout in zip(case.shapes, dtypes, layouts)]


def _values(case: Case, rng: np.random.Generator) -> list[np.ndarray]:
    return case.inputs(rng) if case.inputs else [rng.standard_normal(s) for s in case.shapes]


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{'x'.join(map(str, c.shapes))}-{c.params}")
def test_every_candidate_means_what_it_says(case: Case, mesh_name: str) -> None:
    mesh = init_device_mesh(*MESHES[mesh_name])
    replicate = Layout.from_device_mesh(mesh)("R" if mesh.ndim == 1 else "R,R")
    layouts = [Layout(mesh, ((),) * len(s)) for s in case.shapes] if mesh.ndim > 1 else [replicate.bind(len(s)) for s in case.shapes]
    signature = infer_signature(case.op, _specs(case, layouts), **case.params)
    assert len(signature.candidates) >= 1
    rng = np.random.default_rng(0)
    values = _values(case, rng)
    for candidate in signature.candidates:
        simulate(case, candidate, values, rng)


def test_candidates_in_nest_order_other_than_mesh_order_are_valid() -> None:
    mesh = init_device_mesh((2, 2), ("a", "b"))
    layout = Layout.from_device_mesh(mesh)((("b", "a"), None))
    case = Case("matmul", [(8, 6), (6, 4)], np.matmul)
    signature = infer_signature("matmul", _specs(case, [layout, Layout(mesh, ((), ()))]))
    orders = {c.nest_order for c in signature.candidates}
    assert orders == {(0, 1), (1, 0)}
    assert signature.in_layouts[0] == layout  # kept as it is: no redistribution
    assert signature.out_layouts[0] == Layout.from_device_mesh(mesh)((("b", "a"), None))
    rng = np.random.default_rng(1)
    values = _values(case, rng)
    for candidate in signature.candidates:
        simulate(case, candidate, values, rng)


def test_three_d_mesh_matmul_and_sum() -> None:
    mesh = init_device_mesh((2, 2, 2), ("a", "b", "c"))
    rng = np.random.default_rng(2)
    for case in (Case("matmul", [(2, 4, 6), (2, 6, 4)], np.matmul), Case("sum", [(4, 6, 2)], _reduce(np.sum), {"axis": 1})):
        layouts = [Layout(mesh, ((),) * len(s)) for s in case.shapes]
        signature = infer_signature(case.op, _specs(case, layouts), **case.params)
        values = _values(case, rng)
        for candidate in signature.candidates:
            simulate(case, candidate, values, rng)


def test_infer_signature_takes_pytrees_of_operands() -> None:
    """A dict / NamedTuple of operands is its leaves in jax.tree order (the same signature
    as the list); a lone tensor is still refused."""
    from typing import NamedTuple

    import jax.numpy as jnp

    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    x = ((8, 16), jnp.float32, Layout.from_device_mesh(mesh)("S(0),R"))
    w = ((16, 32), jnp.float32, Layout.from_device_mesh(mesh)("R,S(1)"))

    class Pair(NamedTuple):
        x: Any
        w: Any

    flat = infer_signature("matmul", [x, w])
    for tree in ({"a": x, "b": w}, Pair(x, w), (x, [w])):
        assert infer_signature("matmul", tree) == flat
    assert str(flat.out_layouts[0]) == "S(0),S(1)"
    with pytest.raises(ArgumentTypeError, match="inputs"):
        infer_signature("neg", x)


@given(
    dims=st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=3),
    split=st.integers(0, 2),
    data=st.data(),
)
def test_reshape_candidates_hold_for_random_factorizations(dims: list[int], split: int, data: Any) -> None:
    """Any regrouping of the same elements: merge or split neighbouring dims."""
    total = math.prod(dims)
    factors = [n for n in range(2, total + 1) if total % n == 0]
    head = data.draw(st.sampled_from(factors)) if factors else 1
    target = (head, total // head) if split % 2 else (total,)
    mesh = init_device_mesh(*MESHES["2x2"])
    case = Case("reshape", [tuple(dims)], np.reshape, {"shape": target}, local=_reshape_local)
    signature = infer_signature("reshape", _specs(case, [Layout(mesh, ((),) * len(dims))]), shape=target)
    rng = np.random.default_rng(3)
    values = _values(case, rng)
    for candidate in signature.candidates:
        simulate(case, candidate, values, rng)


@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    data=st.data(),
)
def test_reduction_candidates_hold_for_random_axes(shape: list[int], data: Any) -> None:
    axes = tuple(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)))
    keepdims = data.draw(st.booleans())
    op = data.draw(st.sampled_from(["sum", "mean", "max", "min"]))
    fn = {"sum": _reduce(np.sum), "mean": _reduce(np.mean), "max": _reduce(np.max, -np.inf), "min": _reduce(np.min, np.inf)}[op]
    mesh = init_device_mesh(*MESHES["2x2"])
    case = Case(op, [tuple(shape)], fn, {"axis": axes, "keepdims": keepdims})
    signature = infer_signature(op, _specs(case, [Layout(mesh, ((),) * len(shape))]), axis=axes, keepdims=keepdims)
    rng = np.random.default_rng(4)
    values = _values(case, rng)
    for candidate in signature.candidates:
        if op == "mean" and any(0 in v.shape for v in values):
            continue
        simulate(case, candidate, values, rng)


@given(
    left=st.lists(st.sampled_from([1, 2, 4]), min_size=0, max_size=3),
    right=st.lists(st.sampled_from([1, 2, 4]), min_size=0, max_size=3),
    op=st.sampled_from(["add", "mul", "maximum", "div"]),
)
def test_broadcasting_binary_candidates_hold(left: list[int], right: list[int], op: str) -> None:
    try:
        np.broadcast_shapes(tuple(left), tuple(right))
    except ValueError:
        return
    fn = {"add": np.add, "mul": np.multiply, "maximum": np.maximum, "div": np.divide}[op]
    mesh = init_device_mesh(*MESHES["2x2"])
    case = Case(op, [tuple(left), tuple(right)], fn)
    layouts = [Layout(mesh, ((),) * len(s)) for s in case.shapes]
    signature = infer_signature(op, _specs(case, layouts))
    rng = np.random.default_rng(5)
    values = [rng.standard_normal(s) + (3.0 if op == "div" else 0.0) for s in case.shapes]
    for candidate in signature.candidates:
        simulate(case, candidate, values, rng)


# -- redistribution plans ----------------------------------------------------------------------


def _chunk(x: np.ndarray, axis: int, pieces: int, index: int) -> np.ndarray:
    start, length = chunk_1d(x.shape[axis], pieces, index)
    return np.take(x, np.arange(start, start + length), axis=axis)


def _run_step(step: RedistributeStep, blocks: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """What each rank holds after one step, computed only from its group's blocks."""
    mesh, m = step.before.mesh, step.mesh_dim
    n = mesh.shape[m]
    source, target = step.before.mesh_dim_split(m), step.after.mesh_dim_split(m)
    result = {}
    for rank in mesh.rank_list:
        group = [blocks[g] for g in mesh.get_group(m, rank=rank).ranks]
        index = mesh.get_coordinate(rank)[m]
        if step.collective == "all-gather":
            result[rank] = np.concatenate(group, axis=source)
        elif step.collective == "all-to-all":
            result[rank] = np.concatenate([_chunk(b, target, n, index) for b in group], axis=source)
        elif step.collective in ("all-reduce", "reduce-scatter"):
            reduced = _REDUCE[step.before.partial[m]](np.stack(group), axis=0)
            result[rank] = reduced if target is None else _chunk(reduced, target, n, index)
        elif step.collective == "local-slice":
            result[rank] = _chunk(blocks[rank], target, n, index)
        else:  # local-partial: torch's _partition_value for sum, the value itself otherwise
            result[rank] = blocks[rank] / n if step.after.partial[m] == "sum" else blocks[rank]
    return result


PLAN_MESHES = [
    init_device_mesh((2, 2), ("a", "b")), init_device_mesh((2, 3), ("a", "b")),
    init_device_mesh((2, 1, 2), ("a", "t", "b")),  # a size-1 mesh dim: planned around the search
]
PLAN_LAYOUTS = {id(m): iter_layouts(m, 2, partial_ops=("sum", "avg", "max")) for m in PLAN_MESHES}


@given(mesh=st.sampled_from(PLAN_MESHES), data=st.data(), shape=st.sampled_from([(6, 4), (5, 7), (12, 6)]))
def test_every_plan_moves_the_right_data(mesh: Any, data: Any, shape: tuple[int, int]) -> None:
    """Simulate each step of a plan as its collective (each rank sees only its group's
    blocks) and compare the result with the destination layout's blocks."""
    layouts = PLAN_LAYOUTS[id(mesh)]
    src, dst = data.draw(st.sampled_from(layouts)), data.draw(st.sampled_from(layouts))
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape)
    blocks = local_inputs(x, src, rng)
    plan = plan_redistribute(shape, F32, src, dst)
    for step in plan.steps:
        blocks = _run_step(step, blocks)
    assert_output(x, dst, blocks, str(plan))


def test_flattening_take_and_concatenate_are_replicate_only() -> None:
    mesh = init_device_mesh(*MESHES["4"])
    layout = Layout.from_device_mesh(mesh)
    take = infer_signature("take", [((8, 4), F32, layout("S(0)")), ((4,), np.int32, layout("R"))], axis=None)
    joined = infer_signature("concatenate", [((8, 4), F32, layout("S(0)")), ((8, 4), F32, layout("S(0)"))], axis=None)
    for signature in (take, joined):
        assert all(not a for c in signature.candidates for x in c.in_layouts + c.out_layouts for a in x.dim_axes)
        assert all(not x.has_partial for c in signature.candidates for x in c.out_layouts)
