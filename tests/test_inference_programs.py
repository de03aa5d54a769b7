"""predict / check on real programs: the new primitive rules simulated per rank, control
flow (scan, while, cond), annotations in user code, pytree inputs and outputs,
out_layouts, and the primitives of the GPT-2 / Llama training steps (tests/models)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend import core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from models import common, gpt2, llama, moe
from models.steps import mlp_loss, training_step
from test_inference_values import assert_output, local_inputs

from placements2jax import (
    DTensor,
    InferenceError,
    Layout,
    apply,
    colwise,
    distribute_pytree,
    distribute_tensor,
    init_device_mesh,
    rowwise,
)
from placements2jax.hlo import compiled_collectives, parse_collectives
from placements2jax.inference import CostModel, check, predict, primitive_names, use_cost_model
from placements2jax.inference.cost import collective_nbytes, default_cost_model
from placements2jax.inference.ops import freeze, primitive_definition
from placements2jax.inference.select import signature_for
from placements2jax.inference.signature import Aval, TensorSpec

F32 = jnp.float32


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


def spec(mesh: Any, shape: tuple[int, ...], placements: Any, dtype: Any = F32) -> tuple[Any, ...]:
    return (shape, dtype, Layout.from_device_mesh(mesh)(placements))


def outs(prediction: Any) -> list[str]:
    return [str(x) for x in prediction.out_layouts]


# -- every candidate of the new primitive rules, simulated per rank ---------------------------------------------


@dataclass
class PrimCase:
    """``fn`` holds one equation of ``primitive`` whose non-literal inputs are ``fn``'s
    arguments in order; it is written shape-polymorphically, so running it on a rank's
    local blocks is the local computation."""

    primitive: str
    fn: Callable[..., Any]
    inputs: Callable[[np.random.Generator], list[np.ndarray]]
    skip: Callable[[Any], bool] = field(default=lambda candidate: False)


def _normal(*shapes: tuple[int, ...]) -> Callable[[np.random.Generator], list[np.ndarray]]:
    return lambda rng: [rng.standard_normal(s).astype(np.float32) for s in shapes]


_BATCHED_GATHER = lax.GatherDimensionNumbers(
    offset_dims=(), collapsed_slice_dims=(2,), start_index_map=(2,), operand_batching_dims=(0, 1),
    start_indices_batching_dims=(0, 1),
)
_ROW_GATHER = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
_BATCHED_SCATTER = lax.ScatterDimensionNumbers(
    update_window_dims=(), inserted_window_dims=(2,), scatter_dims_to_operand_dims=(2,), operand_batching_dims=(0, 1),
    scatter_indices_batching_dims=(0, 1),
)
_ROW_SCATTER = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
# a vmapped table[i] (eqx.nn.Embedding) and its gradient: both dims indexed, nothing collapsed
_VMAPPED_ROW_GATHER = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0, 1))
_VMAPPED_ROW_SCATTER = lax.ScatterDimensionNumbers(
    update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0, 1)
)


def _with_indices(shapes: Sequence[tuple[int, ...]], index_shape: tuple[int, ...], high: int, at: int = 1) -> Any:
    def make(rng: np.random.Generator) -> list[np.ndarray]:
        values: list[np.ndarray] = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        values.insert(at, rng.integers(0, high, index_shape).astype(np.int32))
        return values

    return make


def _spd(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """``shape[0]`` symmetric positive definite (well conditioned) ``shape[1]``-square matrices."""
    a = rng.standard_normal((shape[0], shape[1], shape[1]))
    return (a @ a.transpose(0, 2, 1) + shape[1] * np.eye(shape[1])).astype(np.float32)


def _tridiagonals(rng: np.random.Generator, shape: tuple[int, int]) -> list[np.ndarray]:
    """``dl, d, du`` of ``shape[0]`` diagonally dominant (well conditioned) tridiagonal
    systems of size ``shape[1]`` (``dl[..., 0]`` and ``du[..., -1]`` are not read: 0)."""
    dl, du = rng.standard_normal(shape), rng.standard_normal(shape)
    dl[:, 0], du[:, -1] = 0, 0
    d = np.abs(dl) + np.abs(du) + 1 + rng.random(shape)
    return [x.astype(np.float32) for x in (dl, d, du)]


def _with_group_sizes(shapes: Sequence[tuple[int, ...]], group_sizes: Any) -> Any:
    """Normal float operands of ``shapes``, then ``group_sizes`` (int32) last."""
    return lambda rng: [*_normal(*shapes)(rng), np.asarray(group_sizes, np.int32)]


def _ragged_dims(
    contracting: Any, batch: Any, ragged: int, groups: tuple[int, ...]
) -> lax.RaggedDotDimensionNumbers:
    return lax.RaggedDotDimensionNumbers((contracting, batch), (ragged,), groups)


def _splits_groups(tensor: int, candidate: Any) -> bool:
    """The expert-parallel candidate of a ragged dot: the groups (dim 0 of ``tensor``,
    inputs then output) split, each rank running its own over the rows (a rank's offset):
    checked through the executors by test_operators."""
    layouts = (*candidate.in_layouts, *candidate.out_layouts)
    return bool(layouts[tensor].dim_axes[0])


def _splits_indexed_dim(candidate: Any, dim: int = 0) -> bool:
    """The masked-lookup / masked-scatter / masked-update candidate (table split on the
    looked-up or written ``dim``): checked by the take cases of test_inference_values and
    by apply (test_operators)."""
    return bool(candidate.in_layouts[0].dim_axes[dim])


PRIM_CASES = [
    PrimCase(
        "gather",  # take_along_axis: batching dims and one more indices batch dim
        lambda x, i: lax.gather(x, i, _BATCHED_GATHER, (1, 1, 1), mode="clip"),
        _with_indices([(4, 6, 5)], (4, 6, 3, 1), 5),
        skip=partial(_splits_indexed_dim, dim=2),
    ),
    PrimCase(
        "gather",  # table[ids]: window dim whole, indexed dim
        lambda x, i: lax.gather(x, i, _ROW_GATHER, (1, x.shape[1]), mode="clip"),
        _with_indices([(6, 5)], (3, 1), 6),
        skip=_splits_indexed_dim,
    ),
    PrimCase(
        "gather",  # a vmapped table[i]: the embedding dim indexed but taken whole (its start clamps to 0)
        lambda x, i: lax.gather(x, i, _VMAPPED_ROW_GATHER, (1, x.shape[1]), mode="clip"),
        _with_indices([(6, 5)], (3, 2), 6),
        skip=_splits_indexed_dim,
    ),
    PrimCase(
        "scatter-add",  # its gradient
        lambda x, i, u: lax.scatter_add(x, i, u, _VMAPPED_ROW_SCATTER, mode="clip"),
        _with_indices([(6, 5), (5, 1, 5)], (5, 2), 6),
        skip=_splits_indexed_dim,
    ),
    PrimCase(
        "scatter-add",  # the gradient of take_along_axis
        lambda x, i, u: lax.scatter_add(x, i, u, _BATCHED_SCATTER, mode="clip"),
        _with_indices([(4, 6, 5), (4, 6, 3)], (4, 6, 3, 1), 5),
    ),
    PrimCase(
        "scatter-add",  # the gradient of an embedding lookup (repeated ids)
        lambda x, i, u: lax.scatter_add(x, i, u, _ROW_SCATTER, mode="clip"),
        _with_indices([(6, 5), (5, 5)], (5, 1), 3),
        skip=_splits_indexed_dim,
    ),
    PrimCase(
        "scatter-max",
        lambda x, i, u: lax.scatter_max(x, i, u, _ROW_SCATTER, mode="clip"),
        _with_indices([(6, 5), (5, 5)], (5, 1), 3),
        skip=_splits_indexed_dim,
    ),
    PrimCase(
        "dynamic_update_slice", lambda x, u: lax.dynamic_update_slice(x, u, (1, 0)), _normal((5, 6), (2, 6)),
        skip=_splits_indexed_dim,
    ),
    PrimCase("stack", lambda a, b: jnp.stack([a, b], axis=1), _normal((5, 6), (5, 6))),
    PrimCase("unstack", lambda a: jnp.unstack(a, axis=1), _normal((5, 3, 6))),
    PrimCase("sort", lambda a, b: lax.sort((a, b), dimension=1, num_keys=1), _normal((5, 6), (5, 6))),
    PrimCase("top_k", lambda a: lax.top_k(a, 2), _normal((5, 6))),
    PrimCase(  # a variadic reduce under its own computation: a linear recurrence's (product, sum) pairs
        "reduce",
        lambda a, b: lax.reduce((a, b), (np.float32(1), np.float32(0)), lambda x, y: (x[0] * y[0], x[1] + y[1]), (1,)),
        _normal((5, 6, 3), (5, 6, 3)),
    ),
    PrimCase("rev", lambda a: lax.rev(a, (0,)), _normal((5, 6))),
    PrimCase("tile", lambda a: jnp.tile(a, (1, 3, 1)), _normal((5, 2, 6))),
    PrimCase("bessel_i1e", lax.bessel_i1e, _normal((5, 6))),
    PrimCase("igamma_grad_a", lax.igamma_grad_a, lambda rng: [rng.uniform(0.5, 2.0, (5, 6)).astype(np.float32)] * 2),
    PrimCase(
        "regularized_incomplete_beta",
        lax.betainc,
        lambda rng: [rng.uniform(0.5, 2.0, (5, 6)).astype(np.float32) for _ in range(2)]
        + [rng.uniform(0.0, 1.0, (5, 6)).astype(np.float32)],
    ),
    PrimCase("pad", lambda a: lax.pad(a, np.float32(0), ((1, 2, 0), (0, 0, 0))), _normal((5, 6))),
    PrimCase(
        "conv_general_dilated",
        lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID"),
        _normal((4, 6, 5), (8, 6, 2)),
    ),
    PrimCase(  # grouped: the batch dim splits, no feature dim
        "conv_general_dilated",
        lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID", feature_group_count=2),
        _normal((4, 6, 5), (8, 3, 2)),
    ),
    PrimCase(  # depthwise, two outputs per group (causal padding, as Mamba's conv1d): features split in whole groups
        "conv_general_dilated",
        lambda x, w: lax.conv_general_dilated(x, w, (1,), [(1, 0)], feature_group_count=x.shape[1]),
        _normal((4, 8, 5), (16, 1, 2)),
    ),
    PrimCase(  # the depthwise kernel's gradient (batch_group_count: channels as the lhs batch, the batch contracted)
        "conv_general_dilated",
        lambda x, g: lax.conv_general_dilated(
            x, g, (1,), [(1, 0)], dimension_numbers=lax.ConvDimensionNumbers((2, 0, 1), (2, 0, 1), (1, 2, 0)),
            batch_group_count=x.shape[2]),
        _normal((4, 5, 8), (4, 5, 8)),
    ),
    PrimCase(  # max-pooling (flax's nn.max_pool): the batch and channel dims split, P(max) passes
        "reduce_window_max",
        lambda x: lax.reduce_window(x, -np.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        _normal((4, 4, 6, 3)),
    ),
    PrimCase(  # a padded window over dim 1: dims 0 and 2 split, P(sum) / P(avg) pass
        "reduce_window_sum",
        lambda x: lax.reduce_window(x, np.float32(0), lax.add, (1, 3, 1), (1, 1, 1), ((0, 0), (1, 1), (0, 0))),
        _normal((4, 5, 6)),
    ),
    PrimCase(  # a window of 1 with stride 2 does not split (its output is every other row)
        "reduce_window_min",
        lambda x: lax.reduce_window(x, np.inf, lax.min, (1, 2), (2, 1), "VALID"),
        _normal((6, 5)),
    ),
    PrimCase(  # the generic op (a product: no monoid primitive), its init value a literal
        "reduce_window",
        lambda x: lax.reduce_window(x, np.float32(1), lax.mul, (1, 2, 1), (1, 1, 1), "VALID"),
        _normal((4, 5, 6)),
    ),
    PrimCase(  # max-pooling's gradient: linear in the cotangent (P(sum) with the operand R)
        "select_and_scatter_add",
        lambda g, x: jax.vjp(lambda y: lax.reduce_window(y, -np.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
                             x)[1](g)[0],
        _normal((4, 2, 3, 3), (4, 4, 6, 3)),
    ),
    PrimCase(  # max-pooling's JVP: linear in the tangent
        "select_and_gather_add",
        lambda t, x: jax.jvp(lambda y: lax.reduce_window(y, -np.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
                             (x,), (t,))[1],
        _normal((4, 4, 6, 3), (4, 4, 6, 3)),
    ),
    PrimCase(  # rfft: real to complex, the leading dims split, P(sum) / P(avg) pass
        "fft", lambda x: lax.fft_p.bind(x, fft_type=lax.FftType.RFFT, fft_lengths=(8,)), _normal((4, 6, 8)),
    ),
    PrimCase(  # irfft: complex to real
        "fft",
        lambda z: lax.fft_p.bind(z, fft_type=lax.FftType.IRFFT, fft_lengths=(8,)),
        lambda rng: [(rng.standard_normal((4, 6, 5)) + 1j * rng.standard_normal((4, 6, 5))).astype(np.complex64)],
    ),
    PrimCase(  # a 2-d fft: the last two dims R
        "fft",
        lambda z: lax.fft_p.bind(z, fft_type=lax.FftType.FFT, fft_lengths=(6, 8)),
        lambda rng: [(rng.standard_normal((4, 6, 8)) + 1j * rng.standard_normal((4, 6, 8))).astype(np.complex64)],
    ),
    PrimCase("cholesky", lambda a: lax.linalg.cholesky(a, symmetrize_input=False), lambda rng: [_spd(rng, (4, 5))]),
    PrimCase("eigh", lambda a: lax.linalg.eigh(a, symmetrize_input=False), lambda rng: [_spd(rng, (4, 5))]),
    PrimCase(  # outputs in the primitive's order: singular values, u, vt
        "svd",
        lambda a: (lambda u, s, vt: (s, u, vt))(*lax.linalg.svd(a, full_matrices=False)),
        _normal((4, 6, 5)),
    ),
    PrimCase("qr", lambda a: lax.linalg.qr(a, full_matrices=False), _normal((4, 6, 5))),
    PrimCase("lu", lax.linalg.lu, _normal((4, 5, 5))),
    PrimCase(
        "lu_pivots_to_permutation",
        lambda p: lax.linalg.lu_pivots_to_permutation(p, 6),
        lambda rng: [np.asarray(rng.integers(0, 6, (4, 5)), np.int32).clip(np.arange(5), None)],
    ),
    PrimCase("householder_product", lax.linalg.householder_product, _normal((4, 6, 5), (4, 5))),
    # CPU-only LAPACK calls: eigenvalues and eigenvectors, Schur and Hessenberg forms, the symmetric tridiagonal
    # reduction, and the product by a QR's Householder reflectors
    PrimCase("eig", lax.linalg.eig, _normal((4, 5, 5))),
    PrimCase("schur", lax.linalg.schur, _normal((4, 5, 5))),
    PrimCase("hessenberg", lax.linalg.hessenberg, _normal((4, 5, 5))),
    PrimCase("tridiagonal", lax.linalg.tridiagonal, lambda rng: [_spd(rng, (4, 5))]),
    PrimCase("ormqr", partial(lax.linalg.ormqr, left=True, transpose=False), _normal((4, 6, 5), (4, 5), (4, 6, 3))),
    PrimCase(  # alpha a a^T + beta c: batch dims split; a's contracted dim split with c P(sum) -> P(sum)
        "symmetric_product",
        lambda a, c: lax.linalg.symmetric_product(a, c, alpha=2.0, beta=0.5),
        _normal((4, 6, 5), (4, 6, 6)),
    ),
    PrimCase(  # batch dims split, P(sum) / P(avg) on b pass (XLA gathers split columns: rules.BATCH_PARTITIONED)
        "triangular_solve",
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
        lambda rng: [_spd(rng, (4, 5)), rng.standard_normal((4, 5, 6)).astype(np.float32)],
    ),
    PrimCase(  # right side, transposed
        "triangular_solve",
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, lower=True, transpose_a=True),
        lambda rng: [_spd(rng, (4, 5)), rng.standard_normal((4, 6, 5)).astype(np.float32)],
    ),
    PrimCase(  # batch dims split, the solved dim never; P(sum) / P(avg) on b pass
        "tridiagonal_solve",
        lax.linalg.tridiagonal_solve,
        lambda rng: [*_tridiagonals(rng, (4, 6)), rng.standard_normal((4, 6, 5)).astype(np.float32)],
    ),
    PrimCase("approx_top_k", lambda a: lax.approx_max_k(a, 2), _normal((5, 6))),
    PrimCase("approx_top_k", lambda a: lax.approx_min_k(a, 2, reduction_dimension=0), _normal((5, 6))),
    # lax.ragged_dot (dropless MoE's expert matmuls) and the modes its gradients and vmap give: 7 of 8 rows in
    # groups (the last row in none), an empty group; the ragged and group dims never split (rules.ragged_dot)
    PrimCase(
        "ragged_dot_general", lax.ragged_dot, _with_group_sizes([(8, 6), (3, 6, 4)], [3, 0, 4]),
        skip=partial(_splits_groups, 1),
    ),
    PrimCase(  # the gradient of the rhs: the ragged dim contracted, one output block per group
        "ragged_dot_general",
        lambda x, dy, s: lax.ragged_dot_general(x, dy, s, _ragged_dims(((0,), (0,)), ((), ()), 0, ())),
        _with_group_sizes([(8, 6), (8, 4)], [3, 0, 4]),
        skip=partial(_splits_groups, 3),
    ),
    PrimCase(  # the gradient of the lhs: the rhs's free dim contracted
        "ragged_dot_general",
        lambda dy, w, s: lax.ragged_dot_general(dy, w, s, _ragged_dims(((1,), (2,)), ((), ()), 0, (0,))),
        _with_group_sizes([(8, 4), (3, 6, 4)], [3, 0, 4]),
        skip=partial(_splits_groups, 1),
    ),
    PrimCase(  # vmapped: a batch dim, its own group sizes per batch element
        "ragged_dot_general",
        jax.vmap(lax.ragged_dot),
        _with_group_sizes([(2, 8, 6), (2, 3, 6, 4)], [[3, 0, 4], [1, 6, 1]]),
    ),
    PrimCase(  # an lhs free dim outside the ragged one, its own group sizes (group_sizes' prefix), a free dim inside
        "ragged_dot_general",
        lambda x, w, s: lax.ragged_dot_general(x, w, s, _ragged_dims(((3,), (1,)), ((), ()), 1, (0,))),
        _with_group_sizes([(2, 8, 5, 6), (3, 6, 4)], [[3, 0, 4], [1, 6, 1]]),
    ),
    PrimCase(  # a ragged batch dim
        "ragged_dot_general",
        lambda x, y, s: lax.ragged_dot_general(x, y, s, _ragged_dims(((2,), (1,)), ((0,), (0,)), 0, ())),
        _with_group_sizes([(4, 5, 6), (4, 6, 3)], [1, 2]),
    ),
    PrimCase("complex", lax.complex, _normal((5, 6), (5, 6))),
    PrimCase("imag", lambda z: lax.imag(z), lambda rng: [(rng.standard_normal((5, 6)) + 1j).astype(np.complex64)]),
    PrimCase("bitcast_convert_type", lambda a: lax.bitcast_convert_type(a, jnp.int32), _normal((5, 6))),
    PrimCase("cumsum", lambda a: lax.cumsum(a, axis=1), _normal((5, 6))),
    PrimCase("argmax", lambda a: lax.argmax(a, 0, jnp.int32), _normal((5, 6))),
    PrimCase("clamp", lambda a: lax.clamp(np.float32(-0.5), a, np.float32(0.5)), _normal((5, 6))),
    # reshape with ``dimensions`` (transposed first): each new size from the block's shape, so a rank's call is its
    # block's reshape; JAX's transpose of a depthwise conv reshapes its kernel so (Mamba's conv1d)
    PrimCase(
        "reshape",
        lambda k: lax.reshape(k, (k.shape[0], k.shape[2], 1), dimensions=(0, 2, 1, 3)),
        _normal((4, 1, 8, 1)),
    ),
    PrimCase("reshape", lambda a: lax.reshape(a, (a.size,), dimensions=(1, 0)), _normal((6, 4))),
    PrimCase("reshape", lambda a: lax.reshape(a, (a.shape[1] // 2, 2, a.shape[0]), dimensions=(1, 0)), _normal((4, 6))),
]

MESHES = {"4": ((4,), ("x",)), "2x2": ((2, 2), ("a", "b"))}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("case", PRIM_CASES, ids=[f"{i}-{c.primitive}" for i, c in enumerate(PRIM_CASES)])
def test_every_candidate_of_the_new_rules_means_what_it_says(case: PrimCase, mesh_name: str) -> None:
    mesh = init_device_mesh(*MESHES[mesh_name])
    rng = np.random.default_rng(0)
    args = case.inputs(rng)
    closed = jax.make_jaxpr(case.fn)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == case.primitive]
    position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    values = [np.asarray(a.val) if isinstance(a, core.Literal) else args[position[a]] for a in eqn.invars]
    specs = tuple(TensorSpec(v.shape, v.dtype, Layout(mesh, ((),) * v.ndim)) for v in values)
    out_avals = tuple(Aval(v.aval.shape, v.aval.dtype) for v in eqn.outvars)
    definition = primitive_definition(case.primitive)
    params = freeze({p: eqn.params[p] for p in definition.params})
    signature = signature_for(("primitive", case.primitive), params, specs, out_avals, default_cost_model(), mesh)
    fulls = [np.asarray(x) for x in jax.tree.leaves(case.fn(*args))]
    simulated = 0
    for candidate in signature.candidates:
        if case.skip(candidate):
            continue
        locals_ = [local_inputs(v, layout, rng) for v, layout in zip(values, candidate.in_layouts)]
        per_rank = {}
        for rank in mesh.rank_list:
            local = [blocks[rank] for blocks in locals_]
            fn_args = [local[i] for i, a in enumerate(eqn.invars) if not isinstance(a, core.Literal)]
            per_rank[rank] = [np.asarray(x) for x in jax.tree.leaves(case.fn(*fn_args))]
        for k, (full, layout) in enumerate(zip(fulls, candidate.out_layouts)):
            blocks = {r: v[k] for r, v in per_rank.items()}
            assert_output(full, layout, blocks, f"{case.primitive} {candidate}", tolerance=1e-5)
        simulated += 1
    assert simulated > 1  # some split or partial candidate besides all-Replicate


def test_gather_rules_of_take_along_axis_and_its_gradient(mesh: Any) -> None:
    """Batched gather and scatter-add keep the batch split (no communication), where the
    old rule replicated every batched gather."""

    def loss(logp: jax.Array, targets: jax.Array) -> jax.Array:
        return jnp.take_along_axis(logp, targets[..., None], axis=-1).sum()

    x, t = spec(mesh, (4, 8, 16), "S(0),S(1)"), spec(mesh, (4, 8), "S(0),S(1)", jnp.int32)
    prediction = predict(jax.grad(loss), x, t)
    assert outs(prediction) == ["S(0),S(1)"]
    assert prediction.nbytes == 0


def test_scatter_add_into_a_table_split_on_its_indexed_dim(mesh: Any) -> None:
    """The embedding gradient into a vocabulary-split table (``S(0)`` on tp, ids and
    updates Replicate) stays split: each rank adds, at the id minus its offset, the
    updates whose id falls in its rows; the chunks put together are the whole scatter."""
    table, ids, updates = np.zeros((8, 3), np.float32), np.array([[1], [6], [1], [3]], np.int32), np.arange(12.0)
    updates = updates.reshape(4, 3).astype(np.float32)
    specs = [spec(mesh, (8, 3), "R,S(0)"), spec(mesh, (4, 1), "R,R", jnp.int32), spec(mesh, (4, 3), "R,R")]
    scatter = partial(lax.scatter_add, dimension_numbers=_ROW_SCATTER, mode="clip")
    (eqn,) = jax.make_jaxpr(scatter)(table, ids, updates).jaxpr.eqns
    params = freeze({p: eqn.params[p] for p in primitive_definition("scatter-add").params}, "params")
    avals = (Aval((8, 3), F32),)
    signature = signature_for(("primitive", "scatter-add"), params, tuple(TensorSpec(*s) for s in specs), avals,
                              default_cost_model(), mesh)
    assert str(signature.chosen) == "(R,S(0) ; R,R ; R,R) -> (R,S(0))" and signature.cost == 0
    chunks = []
    for low in range(0, 8, 2):  # tp's four ranks own rows [low, low + 2)
        inside = ((ids[:, 0] >= low) & (ids[:, 0] < low + 2))
        local = np.zeros((2, 3), np.float32)
        np.add.at(local, ids[inside, 0] - low, updates[inside])
        chunks.append(local)
    np.testing.assert_array_equal(np.concatenate(chunks), np.asarray(scatter(table, ids, updates)))


def test_numpy_int_params_from_grad_jaxprs(mesh: Any) -> None:
    """jax.grad of layer norm / dot_product_attention puts np.int64 dims in
    broadcast_in_dim params (the Shard.dim=np.int64(1) crash)."""

    def attention(q: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q, q, q, is_causal=True).sum()

    def norm(x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        return ((x - mean) * lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)).sum()

    assert outs(predict(jax.grad(attention), spec(mesh, (4, 8, 4, 8), "S(0),S(2)"))) == ["S(0),S(2)"]
    assert outs(predict(jax.grad(norm), spec(mesh, (8, 16), "S(0),R")))[0].startswith("S(0),")
    assert freeze((np.int64(1), [np.int32(2)], {"a": np.bool_(True)})) == (1, (2,), (("a", True),))
    assert type(freeze(np.int64(1))) is int


# -- control flow ---------------------------------------------------------------------------------------------


def test_scan_carry_reaches_a_fixed_point(mesh: Any) -> None:
    """The carry starts Replicate; the body makes it S(1) on tp (a column-parallel layer
    per step): the fixed point is S(1), the initial carry is sliced once for free."""

    def layers(x: jax.Array, ws: jax.Array) -> jax.Array:
        return lax.scan(lambda h, w: (jnp.tanh(h * w), None), x, ws)[0]

    prediction = predict(layers, spec(mesh, (8, 16), "S(0),R"), spec(mesh, (3, 8, 16), "R,S(2)"), search="eager")
    assert outs(prediction) == ["S(0),S(1)"]
    assert prediction.nbytes == 0
    scan = next(e for e in prediction.equations if e.primitive == "scan")
    assert [str(x) for x in scan.signature.in_layouts] == ["S(0),S(1)", "R,S(2)"]
    body = [e for e in prediction.equations if e.path.startswith(scan.path + ".")]
    assert {e.primitive for e in body} == {"mul", "tanh"}
    program = predict(layers, spec(mesh, (8, 16), "S(0),R"), spec(mesh, (3, 8, 16), "R,S(2)"))
    assert program.search == "program" and program.out_layouts == prediction.out_layouts
    assert program.nbytes == 0


def test_program_search_through_a_scanned_layer_stack(mesh: Any) -> None:
    """Megatron MLP layers under scan: the row-parallel partial is carried; the program
    search may re-choose the body's equations (the scan row and its carry stay fixed)
    and never costs more than eager dispatch."""

    def stack(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return lax.scan(lambda h, w: (h + jax.nn.gelu(h @ w[0]) @ w[1], None), x, (w1, w2))[0]

    args = spec(mesh, (8, 16), "S(0),R"), spec(mesh, (2, 16, 32), "R,S(2)"), spec(mesh, (2, 32, 16), "R,S(1)")
    eager, program = predict(stack, *args, search="eager"), predict(stack, *args)
    assert program.cost <= eager.cost
    assert outs(program)[0].startswith("S(0)")
    scans = [e for e in program.equations if e.primitive == "scan"]
    assert len(scans) == 1 and len(scans[0].signature.candidates) == 1


def test_scan_gathers_a_split_scanned_dim_and_stacks_outputs(mesh: Any) -> None:
    def cumulative(xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.scan(lambda c, x: (c + x, c * 2), jnp.zeros(xs.shape[1:]), xs)

    prediction = predict(cumulative, spec(mesh, (4, 8), "S(0),S(1)"))
    assert outs(prediction) == ["R,S(0)", "R,S(1)"]
    assert prediction.collectives["all-gather"] == 1  # dim 0 (the scanned one) gathered on dp


def test_scan_carry_that_never_settles_keeps_its_initial_layout(mesh: Any) -> None:
    """A carry alternating between two layouts: the initial layout is kept and the body's
    result moved back to it every iteration."""

    def swap(x: jax.Array) -> jax.Array:
        return lax.fori_loop(0, 4, lambda i, a: a.T, x)

    prediction = predict(swap, spec(mesh, (8, 8), "S(0),R"))
    assert outs(prediction) == ["S(0),R"]
    assert any(e.primitive == "scan carry" for e in prediction.equations)


def test_while_loop(mesh: Any) -> None:
    def grow(x: jax.Array) -> jax.Array:
        return lax.while_loop(lambda a: a.sum() < 100.0, lambda a: a * 2.0, x)

    prediction = predict(grow, spec(mesh, (8, 16), "S(0),S(1)"))
    assert outs(prediction) == ["S(0),S(1)"]
    # the predicate is a sum over the split dims: reduced (once) so every rank decides alike
    cond = [e for e in prediction.equations if ".cond." in e.path]
    assert [e.primitive for e in cond] == ["reduce_sum", "lt"]
    assert cond[-1].outputs[0].layout == Layout(mesh, ((),) * 0)
    assert prediction.collectives["all-reduce"] == 2  # one step per mesh dim


def test_cond_joins_the_branches(mesh: Any) -> None:
    def branchy(p: jax.Array, x: jax.Array) -> jax.Array:
        return lax.cond(p, lambda a: a * 2.0, lambda a: a.T @ a, x)

    # x split over tp (the rows of a.T @ a a partial there, a * 2 split): R,S(0). Split over dp, both branches run
    # replicated from one all-gather of x and nothing is joined (as on a (2,) mesh: tp, split by no input, is idle,
    # jaxpr._idle_mesh_dims; until stop 38 its free slices gave the branches P,R and S(0),R)
    prediction = predict(branchy, np.bool_(True), spec(mesh, (8, 8), "R,S(0)"))
    cond = next(e for e in prediction.equations if e.primitive == "cond")
    branches = [e for e in prediction.equations if e.path.startswith(cond.path + ".b")]
    assert {e.path.split(".")[1] for e in branches} == {"b0", "b1"}
    joins = [e for e in prediction.equations if e.primitive == "cond join"]
    assert len(joins) == 1  # one branch moved to the other's layout
    assert outs(prediction) == [str(joins[0].outputs[0].layout)]


def test_cond_joins_where_its_consumers_read(mesh: Any) -> None:
    """optax.MultiSteps (gradient accumulation: a lax.cond between the inner optimizer's
    step and accumulating) on the Megatron MLP step, its state keeping the parameters'
    layouts: the cond's join, chosen from its branches alone, split the updated moments
    and accumulators over dp (slicing is free there) and gathered them back after it
    (6,080 B, 2.5x XLA's); joined where its consumers read them, XLA's bytes (2,432 B
    planned and a 4 B loss all-reduce) in 8 collectives; its updates joined too, where
    the searched update branch makes them (jaxpr._rejoined), the plan of the step without
    MultiSteps: the batch and the output gradient all-gathered over dp (4 x 256 B) for
    replicated weight gradients, where XLA all-reduces them (2 x 1,024 B), 1,408 B in 6,
    every output agreeing; searched from dp replicas (jaxpr._replicas_restart), 896 B in 3
    (the step's forward and backward run replicated over dp from the gathered batch). The
    cond's index is the literal 0 (MultiSteps' default ``should_skip_update``), and since
    stop 40 the walk inlines its branch 0 as XLA does (inference/simplify.py): no join is
    left, and the step is the plain Megatron MLP step, whose default-model plan is XLA's,
    2,432 B (check: 2,436, XLA's) in 2 all-reduces after the combiner, the pinned
    program's 2 (the same objective as XLA's, 2,820); the 896 B plan is the 192 B model's."""
    optimizer = optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2)

    def step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    rng = np.random.default_rng(0)
    plain = {"up": rng.normal(size=(16, 64)).astype(np.float32), "down": rng.normal(size=(64, 16)).astype(np.float32)}
    params = distribute_pytree(plain, mesh, {"up": colwise("tp"), "down": rowwise("tp")})
    state = common.distribute_state(optimizer.init(plain), params)
    x, y = (distribute_tensor(rng.normal(size=(8, 16)).astype(np.float32), mesh, "S(0),R") for _ in range(2))
    report = check(step, params, state, x, y, out_layouts=(params, state, None))
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    # (896, 896, 2436) with {"all-gather": 2, "all-reduce": 1} until the cond on a literal was inlined (stop 40)
    assert (report.prediction.nbytes, report.predicted_bytes, report.compiled_bytes) == (2432, 2436, 2436)
    assert report.predicted_counts == {"all-reduce": 4} and common.below_floor(report)
    assert len(report.predicted_combined) == len(report.compiled_collectives) == 2
    assert report.objective == (2820, 2820)
    assert not [e for e in report.prediction.equations if e.primitive == "cond"]
    update = next(e for e in report.prediction.equations if e.primitive == "closed_call")
    moments = [str(o.layout) for o in update.outputs[-6:]]  # Adam's mu and nu, the accumulated gradients
    assert moments == ["R,S(0)", "R,S(1)"] * 3  # down, up (row- and column-parallel) each
    pinned = jax.jit(lambda *a: apply(step, *a, out_layouts=(params, state, None), execute="pinned"))
    assert len(compiled_collectives(pinned, params, state, x, y)) == 2
    cheap = predict(step, params, state, x, y, out_layouts=(params, state, None),
                    cost_model=CostModel(collective_overhead=192))
    sent = {kind: n for kind, n in cheap.collectives.items() if not kind.startswith("local")}
    assert (cheap.nbytes, sent) == (896, {"all-gather": 2, "all-reduce": 1})


def test_novograd_updates_the_replicated_embedding_inside_its_cond_replicated(mesh: Any) -> None:
    """tests/models/stacked.py's step updated by ``optax.novograd(1e-3)`` (Megatron dp=2 x
    tp=4): novograd divides each gradient by its norm and updates the first moment inside a
    ``lax.cond`` (its first step starts the moment). The walk joined the embedding's updated
    moment partial over tp (the elementwise update of a partial gradient stays partial),
    ``-lr * mu`` read it so (linear) and the parameter's and the moment's ``out_layouts``
    moves reduced it, an all-reduce and an all-gather each (2 x 10,240 B): 38,262 B, 1.59x
    XLA's, 18 collectives after the combiner. Re-joined at the layout of its reads from
    which reaching them all costs least (``R,R``: ``jaxpr._read_join``), 25,974 B (1.08x),
    the update run split over dp and both tables all-gathered; with the search's look
    upstream of the outputs seeing through the cond (``ProgramGraph.joins``), the
    finishing descent gathers the gradient (scattered from the activation gradient
    all-gathered over dp, as in the adamw step) and the update runs replicated: below XLA's
    bytes legitimately (it all-reduces the table); apply(execute="pinned") compiles the
    predicted 18,020 B (check adds the loss's 10 B reduction), the values jax.jit's. Under
    192 B per collective (the default until stop 38): the latency-bound default's plan is
    test_novograd_under_the_default_counts_its_cond_branch_moves_once."""
    with use_cost_model(CostModel(collective_overhead=192)):
        _novograd_embedding_replicated(mesh)


def _novograd_embedding_replicated(mesh: Any) -> None:
    step = training_step("stacked", mesh, optimizer=optax.novograd(1e-3))
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert (report.predicted_bytes, report.compiled_bytes) == (18030, 24104)
    assert report.predicted_bytes <= 1.1 * report.compiled_bytes and common.below_floor(report)
    assert (len(report.predicted_combined), len(report.compiled_collectives)) == (11, 9)
    gathered = [plan.shape for plan, s in report.prediction.routed_moves() if s.collective == "all-gather"]
    assert gathered == [(4, 8, 1), (4, 8, 32)]  # the token ids and the activation gradient, for the embedding's
    (cond,) = (e for e in report.prediction.equations if e.primitive == "cond" and e.outputs[0].shape == (64, 32))
    assert str(cond.outputs[0].layout) == "R,R"  # the embedding's moment
    pinned = jax.jit(lambda *a: apply(step.fn, *a, out_layouts=step.out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, *step.args)
    assert (sum(collective_nbytes(c, 8) for c in compiled), len(compiled)) == (18020, 11)  # the plan as predicted
    got = jax.tree.leaves(pinned(*step.args), is_leaf=lambda v: isinstance(v, DTensor))
    want = jax.tree.leaves(step.plain_jit()(*step.plain_args()))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_novograd_under_the_default_counts_its_cond_branch_moves_once(mesh: Any) -> None:
    """The same novograd step under the latency-bound default: the plan keeps the
    embedding's (64, 32) gradient partial over dp into novograd's two ``lax.cond`` and
    reduces it inside each branch. Stop 39's prediction routed the four moves as one
    (24,100 B) where the pinned program compiled one all-reduce per branch: 48,676 B in
    13 collectives. A collective computed in a branch is that branch's alone, so the pinned
    program now moves a cond's operands as its branches read them before the cond
    (``operators._Runner._cond``'s ``hoisted``), and the prediction keys such a move's
    route in the cond's computation (``combine.move_computations``): one all-reduce of the
    gradient, 24,100 B in 9 collectives, what the prediction counts. XLA's combiner merges
    that all-reduce with the dp ones before the cond; check counted 24,110 B in 10 after the
    combiner until stop 41, which placed it in the first branch's computation (XLA: 24,104
    in 9); now 9, as XLA's."""
    step = training_step("stacked", mesh, optimizer=optax.novograd(1e-3))
    prediction = predict(step.fn, *step.args, out_layouts=step.out_layouts)
    pinned = jax.jit(lambda *a: apply(step.fn, *a, out_layouts=step.out_layouts, execute="pinned"))
    compiled = compiled_collectives(pinned, *step.args)
    assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.lowered_nbytes
    assert (prediction.lowered_nbytes, len(compiled)) == (24100, 9)
    planned = prediction.planned_collectives()
    (hoisted,) = [i for i, c in enumerate(planned) if c.where == "29.b0.0.0"]
    (merged,) = [g.members for g in prediction.combined() if hoisted in g.members]
    assert planned[hoisted].scope == "" and len(merged) == 2  # with the dp all-reduce before the cond
    assert len(prediction.combined()) == len(compiled)
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert (report.predicted_bytes, report.compiled_bytes) == (24110, 24104)
    assert len(report.predicted_combined) == len(report.compiled_collectives) == 9
    in_branches = [e.path for e in prediction.equations if e.signature is not None and e.sources[:1] == (("23", 0),)
                   and any(not plan.is_noop for plan in e.signature.redistributions)]
    assert in_branches == ["29.b0.0.0", "29.b1.0.0", "32.b0.3", "32.b1.3"]  # the gradient's moves, P,R -> R,R
    assert [c.result_shapes.count((64, 32)) for c in compiled if (64, 32) in c.result_shapes] == [1]  # reduced once
    got = jax.tree.leaves(pinned(*step.args), is_leaf=lambda v: isinstance(v, DTensor))
    want = jax.tree.leaves(step.plain_jit()(*step.plain_args()))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_a_conds_branches_reduce_its_partial_operand_once_before_it(mesh: Any) -> None:
    """Both branches of a cond reduce-scatter its operand, a matmul's partial sum over tp:
    the prediction counts one move (128 B as CPU compiles it, an all-reduce), and the
    pinned program runs it before the cond (a collective computed in a branch is that
    branch's alone: until stop 40 it compiled one per branch, 640 B against 416)."""

    def f(i: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
        return lax.cond(i > 0, lambda y: jnp.sin(y) * 2.0, lambda y: jnp.cos(y) + 1.0, x @ w)

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 8), np.float32)
    args = (np.int32(1), distribute_tensor(x, mesh, "R,S(1)"), distribute_tensor(w, mesh, "R,S(0)"))
    out = Layout.from_device_mesh(mesh)("R,R")
    prediction = predict(f, *args, out_layouts=out)
    moved = {e.path: [str(p.dst) for p in e.signature.redistributions if not p.is_noop]
             for e in prediction.equations if e.signature is not None and e.path.startswith("3.b")}
    assert moved == {"3.b0.0": ["R,S(0)"], "3.b0.1": [], "3.b1.0": ["R,S(0)"], "3.b1.1": []}  # cos and sin read it
    pinned = jax.jit(lambda *a: apply(f, *a, out_layouts=out, execute="pinned"))
    compiled = compiled_collectives(pinned, *args)
    assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.lowered_nbytes == 416
    assert [c.op for c in compiled].count("all-reduce") == 1
    for i in (1, 0):
        got = pinned(np.int32(i), *args[1:]).full_tensor()
        np.testing.assert_allclose(np.asarray(got), np.asarray(f(np.int32(i), x, w)), rtol=1e-5, atol=1e-5)


def test_switch_and_optimization_barrier(mesh: Any) -> None:
    def f(i: jax.Array, x: jax.Array) -> Any:
        y = lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], x)
        return lax.optimization_barrier((x, y))

    prediction = predict(f, np.int32(1), spec(mesh, (8, 16), "S(0),S(1)"))
    assert outs(prediction) == ["S(0),S(1)", "S(0),S(1)"] and prediction.nbytes == 0


@pytest.mark.parametrize("branching", ["switch", "cond"])
def test_gradient_through_branches_saving_other_residuals(mesh: Any, branching: str) -> None:
    """``jax.grad`` of a ``lax.switch`` / ``cond`` whose branches save different residuals
    (here inside a ``lax.scan`` over layer kinds, as models alternating layer types write it):
    each branch returns JAX's uninitialized buffers (``empty2``) for the residuals only the
    others save, values made from nothing (Replicate). predict's outputs keep the weights'
    layouts, check agrees with XLA, and apply under ``jax.jit`` computes what plain
    ``jax.jit`` does."""

    def loss(w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        def layer(h: jax.Array, kind: jax.Array) -> tuple[jax.Array, None]:
            mlp = lambda h: h + jax.nn.gelu(h @ w["up"]) @ w["down"]  # noqa: E731
            gate = lambda h: h * jnp.tanh(h @ w["gate"])  # noqa: E731
            if branching == "switch":
                return lax.switch(kind, [mlp, gate, jnp.sin], h), None
            return lax.cond(kind > 0, gate, mlp, h), None

        h, _ = lax.scan(layer, x, jnp.array([0, 1, 2, 0]))
        return jnp.mean(h ** 2)

    def step(w: dict[str, jax.Array], x: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
        value, grads = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value

    rng = np.random.default_rng(0)
    plain = {"up": rng.standard_normal((16, 32)), "down": rng.standard_normal((32, 16)),
             "gate": rng.standard_normal((16, 16))}
    plain = {k: (v / 8).astype(np.float32) for k, v in plain.items()}
    x = rng.standard_normal((8, 16)).astype(np.float32)
    params = distribute_pytree(plain, mesh, {"up": colwise("tp"), "down": rowwise("tp")})
    args = (params, distribute_tensor(x, mesh, "S(0),R"))
    prediction = predict(step, *args, out_layouts=(params, None))
    assert any(e.primitive == "empty2" and str(e.outputs[0].layout) == "R,R" for e in prediction.equations)
    layouts = jax.tree.map(lambda p: p.layout, params, is_leaf=lambda v: isinstance(v, DTensor))
    assert prediction.out_layouts_tree[0] == layouts
    report = check(step, *args, out_layouts=(params, None))
    assert {o.verdict for o in report.outputs} <= {"equal", "xla reduced partial"}
    new, value = jax.jit(lambda *a: apply(step, *a, out_layouts=(params, None)))(*args)
    want_new, want_value = jax.jit(step)(plain, x)
    for k in plain:
        np.testing.assert_allclose(np.asarray(new[k].full_tensor()), np.asarray(want_new[k]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(value.full_tensor()), np.asarray(want_value), rtol=1e-5)


def test_empty_is_made_replicated(mesh: Any) -> None:
    """``lax.empty``: an uninitialized buffer made from nothing, Replicate (only its layout
    is defined: its values are not)."""
    prediction = predict(lambda x: (x, lax.empty((8, 16), F32)), spec(mesh, (8, 16), "S(0),R"))
    assert outs(prediction) == ["S(0),R", "R,R"] and prediction.nbytes == 0


def test_searchsorted_histogram_and_a_beta_draw_compute_what_jax_does(mesh: Any) -> None:
    """``jnp.searchsorted`` compares with ``le_to`` / ``lt_to`` (total-order comparisons:
    split values stay split), ``jnp.histogram`` then scatter-adds the counts, and ``jax.random.beta``
    draws through ``random_gamma``, which splits its key per element of the whole shape (so
    it runs replicated: a rank drawing for its block alone would draw other values, as
    mixup draws its mixing weights). apply under ``jax.jit`` computes what plain
    ``jax.jit`` does on every output."""

    def f(x: jax.Array, edges: jax.Array, key: jax.Array) -> tuple[jax.Array, ...]:
        weights = jax.random.beta(key, 0.4, 0.4, x.shape)
        mixed = weights * x + (1 - weights) * x[::-1]
        counts, _ = jnp.histogram(mixed, bins=5, range=(-3.0, 3.0))
        return jnp.searchsorted(edges, x), counts, mixed

    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    edges = np.linspace(-2, 2, 9).astype(np.float32)
    args = (distribute_tensor(x, mesh, "S(0),S(1)"), distribute_tensor(edges, mesh, "R,R"), jax.random.key(3))
    alone = predict(jnp.searchsorted, *args[1::-1])
    assert outs(alone) == ["S(0),S(1)"] and alone.nbytes == 0
    assert any(e.primitive == "le_to" for e in alone.equations)
    prediction = predict(f, *args)
    assert any(e.primitive == "lt_to" for e in prediction.equations)  # the histogram's searchsorted(side="right")
    assert any(e.primitive == "random_gamma" and str(e.outputs[0].layout) == "R,R" for e in prediction.equations)
    got = jax.jit(lambda *a: apply(f, *a))(*args)
    want = jax.jit(f)(x, edges, jax.random.key(3))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=1e-6)


def test_sharding_annotations_are_fixed_layouts(mesh: Any) -> None:
    auto = jax.sharding.Mesh(mesh.devices, mesh.alias_name, axis_types=(AxisType.Auto,) * 2)

    def annotated(x: jax.Array) -> jax.Array:
        y = lax.with_sharding_constraint(x * 2.0, NamedSharding(auto, P(None, "tp")))
        return jax.shard_map(lambda a: a + 1.0, mesh=auto, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))(y)

    prediction = predict(annotated, spec(mesh, (8, 16), "S(0),R"))
    assert outs(prediction) == ["S(0),S(1)"]
    rows = {e.primitive: e for e in prediction.equations}
    assert str(rows["sharding_constraint"].outputs[0].layout) == "R,S(1)"
    assert [str(x) for x in rows["shard_map"].signature.in_layouts] == ["S(0),S(1)"]


def _megatron_operands(mesh: Any) -> tuple[list[np.ndarray], list[DTensor]]:
    """An activation split over dp and a Megatron MLP's weights (column-, row-parallel)."""
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=shape).astype(np.float32) for shape in ((4, 8, 16), (16, 32), (32, 16))]
    return arrays, [distribute_tensor(a, mesh, p) for a, p in zip(arrays, ("S(0),R", "R,S(1)", "R,S(0)"))]


def _assert_applied_as_jit(f: Callable[..., Any], arrays: Sequence[np.ndarray], args: Sequence[Any]) -> None:
    """apply of ``f`` on ``args`` in every executor gives jax.jit's value on ``arrays``."""
    want = jax.jit(f)(*arrays)
    for execute in ("ops", "xla", "pinned"):
        got = apply(f, *args, execute=execute)
        np.testing.assert_allclose(np.asarray(got.full_tensor()), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("constraint", [
    P(P.UNCONSTRAINED, None, "tp"),  # the batch's dim free: its dp split kept, as XLA keeps it
    P(P.UNCONSTRAINED, P.UNCONSTRAINED, None),  # the features unsplit, the others free
])
def test_unconstrained_dims_of_a_sharding_constraint_are_left_to_the_search(mesh: Any, constraint: Any) -> None:
    """``PartitionSpec.UNCONSTRAINED`` leaves a dim to XLA: the constraint fixes the named
    dims alone (it raised our ArgumentTypeError, "alias entry UNCONSTRAINED is not an axis
    name"), the others free over the mesh dims those do not name. Treated as None the
    first would gather the batch over dp (XLA sends 1,536 B: the row-parallel matmul's
    all-reduce alone)."""
    auto = jax.sharding.Mesh(mesh.devices, mesh.alias_name, axis_types=(AxisType.Auto,) * 2)

    def f(x: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
        return lax.with_sharding_constraint(jax.nn.gelu(x @ w), NamedSharding(auto, constraint)) @ w2

    arrays, args = _megatron_operands(mesh)
    (row,) = [e for e in predict(f, *args).equations if e.primitive == "sharding_constraint"]
    layout = row.outputs[0].layout
    assert not layout.has_partial and layout.dim_axes[0] == (0,)  # dp's split of the batch kept
    assert layout.dim_axes[2] == ((1,) if constraint[2] == "tp" else ())
    if constraint[1] is None:
        report = check(f, *args)
        assert report.predicted_bytes == report.compiled_bytes == 1536 and report.communication == "equal"
    _assert_applied_as_jit(f, arrays, args)


def test_a_nested_jits_shardings_are_sharding_constraints(mesh: Any) -> None:
    """A helper jitted with ``out_shardings`` (and ``in_shardings``) inside the function:
    XLA constrains its results (and operands) as with_sharding_constraint does, so the
    gelu's result is gathered over tp (1,536 B, XLA's first collective) before the
    row-parallel matmul; the walk ignored them (1,536 B in all: the matmul's all-reduce).
    After the gather the prediction moves the weight by an all-to-all and gathers the
    output (2,688 B) where XLA all-reduces it (3,072)."""
    auto = jax.sharding.Mesh(mesh.devices, mesh.alias_name, axis_types=(AxisType.Auto,) * 2)
    gathered = NamedSharding(auto, P("dp", None, None))
    helper = jax.jit(jax.nn.gelu, in_shardings=NamedSharding(auto, P("dp", None, "tp")), out_shardings=gathered)

    def f(x: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
        return helper(x @ w) @ w2

    arrays, args = _megatron_operands(mesh)
    out = Layout.from_device_mesh(mesh)("S(0),R")
    prediction = predict(f, *args, out_layouts=out)
    rows = {e.path.rsplit(".", 1)[-1]: e for e in prediction.equations if e.primitive == "sharding_constraint"}
    assert sorted(rows) == ["in_sharding0", "out_sharding0"]
    assert str(rows["out_sharding0"].outputs[0].layout) == "S(0),R"
    (step,) = rows["out_sharding0"].signature.redistributions[0].steps
    assert (step.collective, step.axis, step.nbytes) == ("all-gather", "tp", 1536)
    report = check(f, *args, out_layouts=out)
    assert (report.predicted_bytes, report.compiled_bytes) == (2688, 3072)
    gather = report.compiled_collectives[0]
    assert gather.op == "all-gather" and "jit(gelu)" in gather.op_name
    _assert_applied_as_jit(f, arrays, args)


def test_a_device_put_inside_the_function_passes_its_value_through(mesh: Any) -> None:
    """``jax.device_put(h, NamedSharding(...))`` inside traced code: CPU XLA compiles no move
    for it (the matmul's all-reduce alone, 1,536 B), as the prediction's pass-through; the
    "ops" executor bound it per rank in a shard_map of its own, where JAX refused its
    sharding's axes (a raw ValueError: "should be of type Manual")."""
    auto = jax.sharding.Mesh(mesh.devices, mesh.alias_name, axis_types=(AxisType.Auto,) * 2)

    def f(x: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
        return jax.device_put(jax.nn.gelu(x @ w), NamedSharding(auto, P("dp", None, None))) @ w2

    arrays, args = _megatron_operands(mesh)
    report = check(f, *args)
    assert report.predicted_bytes == report.compiled_bytes == 1536 and report.communication == "equal"
    _assert_applied_as_jit(f, arrays, args)


def test_a_vmaps_collectives_over_its_own_axis_are_reductions(mesh: Any) -> None:
    """``jax.vmap(..., axis_name="b")`` with ``pmean`` / ``pmax`` over that axis (per-example
    code normalizing by the batch, as a BatchNorm under vmap does): JAX's batching rule
    leaves ``psum`` / ``pmax`` with positional axes, reductions of the batched dim (no rule
    before: UnsupportedOpError). The batch split over dp: partial sums and maxima reduced
    over dp, XLA's 32 B."""

    def f(x: jax.Array) -> jax.Array:
        return jax.vmap(lambda r: (r - lax.pmean(r, "b")) / lax.pmax(jnp.abs(r), "b"), axis_name="b")(x)

    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    arg = distribute_tensor(x, mesh, "S(0),S(1)")
    rows = [e for e in predict(f, arg).equations if e.primitive in ("psum", "pmax")]
    assert [str(e.outputs[0].layout) for e in rows] == ["P,S(0)", "P(max),S(0)"]
    report = check(f, arg)
    assert report.predicted_bytes == report.compiled_bytes == 32 and report.communication == "equal"
    for execute in ("ops", "xla", "pinned"):
        np.testing.assert_allclose(np.asarray(apply(f, arg, execute=execute).full_tensor()), np.asarray(jax.jit(f)(x)),
                                   rtol=1e-5, atol=1e-6)


def _psum_region(auto: Any, x: Any, w: Any) -> Any:
    """A Megatron row-parallel matmul written as a shard_map region: each tp rank's partial
    product of its slice of the features, summed over tp."""
    region = jax.shard_map(lambda xs, ws: lax.psum(xs @ ws, "tp"), mesh=auto,
                           in_specs=(P("dp", None, "tp"), P("tp", None)), out_specs=P("dp"))
    return jnp.tanh(region(x, w))


def _tp_region(auto: Any, x: Any, w: Any) -> Any:
    """A region manual over tp alone (``axis_names``; dp stays XLA's), reading its rank."""
    region = jax.shard_map(lambda xs: xs * 2.0 + lax.axis_index("tp"), mesh=auto, in_specs=P(None, None, "tp"),
                           out_specs=P(None, None, "tp"), axis_names={"tp"})
    return region(x).sum(-1) + w.sum()


def _region_grad(auto: Any, x: Any, w: Any) -> Any:
    return jax.grad(lambda w: _psum_region(auto, x, w).sum())(w)


@pytest.mark.parametrize("execute", ["xla", "ops", "pinned"])
@pytest.mark.parametrize("region", [_psum_region, _tp_region, _region_grad], ids=["psum", "axis_names", "grad"])
def test_apply_runs_shard_map_regions(mesh: Any, execute: str, region: Callable[..., Any]) -> None:
    """apply runs a user's shard_map region in every executor; "ops" ran it per rank inside
    a shard_map of its own, binding the region's primitive again: a raw KeyError
    ('subfuns'), then JAX refused the body's varying-axes casts and, manual over some axes
    alone, its mesh. Now it runs as JAX runs it, on the logical values in the region's
    in_specs."""
    auto = jax.sharding.Mesh(mesh.devices, mesh.alias_name, axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 16)).astype(np.float32)
    w = rng.normal(size=(16, 32)).astype(np.float32)
    f = partial(region, auto)
    got = apply(f, distribute_tensor(x, mesh, "S(0),R"), distribute_tensor(w, mesh, "R,S(0)"), execute=execute)
    np.testing.assert_allclose(np.asarray(got.full_tensor()), np.asarray(jax.jit(f)(x, w)), rtol=1e-5, atol=1e-5)


# -- inputs and outputs ---------------------------------------------------------------------------------------


class Batch(NamedTuple):
    tokens: Any
    scale: Any


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    w: Any
    b: Any


def test_pytree_inputs_of_every_kind(mesh: Any) -> None:
    auto = jax.sharding.Mesh(mesh.devices, mesh.alias_name)
    x = distribute_tensor(np.ones((8, 16), np.float32), mesh, "S(0),R")
    sharded = jax.device_put(np.ones((16, 32), np.float32), NamedSharding(auto, P(None, "tp")))

    def f(batch: Batch, weights: Weights, extra: dict[str, Any], key: jax.Array, raw: jax.Array) -> dict[str, Any]:
        noise = jax.random.normal(key, (8, 32)) + jax.random.uniform(raw, (8, 32))
        h = batch.tokens @ weights.w + weights.b * batch.scale
        return {"h": h + noise, "n": extra["n"] * 2, "list": [h.sum(), extra["c"]]}

    inputs = (
        Batch(x, 0.5),
        Weights(sharded, np.zeros(32, np.float32)),
        {"n": np.arange(4.0), "c": 3},
        jax.random.key(0),
        jax.random.PRNGKey(1),
    )
    prediction = predict(f, *inputs)
    assert prediction.in_tree == jax.tree.structure(inputs, is_leaf=lambda v: isinstance(v, type(x)))
    layouts = jax.tree.map(str, prediction.out_layouts_tree)
    assert layouts == {"h": "S(0),S(1)", "n": "R,R", "list": ["P,P", "R,R"]}
    (key_spec,) = [s for s in prediction.inputs if str(s.dtype) == "key<fry>"]
    assert key_spec.shape == () and key_spec.layout == Layout(mesh, ((),) * 0)
    assert prediction.inputs[-1].shape == (2,) and prediction.inputs[-1].dtype == np.uint32  # a raw key
    report = check(f, *inputs)
    assert report.outputs[0].verdict == "equal"


def test_out_layouts_keep_the_inputs_layouts(mesh: Any) -> None:
    params = {
        "w": distribute_tensor(np.ones((16, 32), np.float32), mesh, "R,S(1)"),
        "b": distribute_tensor(np.ones((32,), np.float32), mesh, "R,S(0)"),
    }
    x = distribute_tensor(np.ones((8, 16), np.float32), mesh, "S(0),R")

    def step(p: dict[str, Any], x: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        loss, g = jax.value_and_grad(lambda p: jnp.tanh(x @ p["w"] + p["b"]).sum())(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    kept = predict(step, params, x, out_layouts=(params, None))
    # at 192 B per collective (the default until stop 39) the common descent (program._commoned) found the loss
    # reduced over dp with the parameters' gradients: 256 B in one all-gather where the loss left partial cost 544 B
    # in two all-reduces (one after the combiner). The latency-bound default (8,192 B per all-gather, 192 per
    # all-reduce) takes XLA's plan, the loss left partial: 544 B, as check counts it XLA's 554 B in its 2 collectives
    assert jax.tree.map(str, kept.out_layouts_tree) == ({"b": "R,S(0)", "w": "R,S(1)"}, "P,P")
    assert (kept.nbytes, sum(kept.combined_counts.values())) == (544, 1)
    assert kept.combined_counts == {"all-reduce": 1}
    report = check(step, params, x, out_layouts=(params, None))
    assert (report.predicted_bytes, len(report.predicted_combined)) == (report.compiled_bytes, 2) == (554, 2)
    # free, at 192 B w's update was searched from dp replicas (jaxpr._replicas_restart): 256 B in 2 collectives where
    # it was split over dp, 256 B in 5, and the loss came back reduced over dp. Under the latency-bound default the
    # gradients' partials are left pending, as eager dispatch leaves them (no collective in the program; check
    # counts their conversions to XLA's layouts: XLA's 554 B in 2)
    free = predict(step, params, x)
    assert jax.tree.map(str, free.out_layouts_tree) == ({"b": "P,S(0)", "w": "P,S(1)"}, "P,P")
    assert (free.nbytes, sum(free.collectives.values()), sum(free.combined_counts.values())) == (0, 4, 0)
    assert kept.constrained == (True, True, False)
    assert predict(step, params, x, out_layouts=("R,R", "R,R")).out_layouts[-1] == Layout(mesh, ((),) * 0)
    with pytest.raises(InferenceError, match="out_layouts"):
        predict(step, params, x, out_layouts=(params, None, None))


def test_a_failed_trace_lists_a_few_inputs(mesh: Any) -> None:
    """A training step has hundreds of inputs: the message lists the first 8 by shape and
    dtype and counts the rest (JAX's own error says which operation failed)."""
    params = {f"w{i:02d}": spec(mesh, (8, i + 1), "S(0),R") for i in range(20)}
    with pytest.raises(InferenceError, match=r"its 20 inputs \[float32\[8, 1\], .* 12 more\] failed") as info:
        predict(lambda p: p["w00"] @ p["w01"], params)
    assert "float32[8, 9]" not in str(info.value) and "dot_general" in str(info.value)


def test_bad_pytree_leaf_is_named(mesh: Any) -> None:
    with pytest.raises(TypeError, match=r"inputs\[0\]\['f'\]"):
        predict(lambda d: d["x"], {"x": spec(mesh, (8,), "S(0),R"), "f": "text"})
    with pytest.raises(InferenceError, match="on_unknown"):
        predict(jnp.sin, spec(mesh, (8,), "S(0),R"), on_unknown="skip")


# -- the real training steps ----------------------------------------------------------------------------------


def _primitives(jaxpr: Any, found: set[str]) -> set[str]:
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, core.Jaxpr):
                    _primitives(inner, found)
    return found


def _training_programs() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    programs = {}
    for name, module, cfg in (
        ("gpt2", gpt2, gpt2.Config()),
        ("gpt2-dpa", gpt2, gpt2.Config(attention="dpa")),
        ("llama", llama, llama.Config()),
        ("moe-ragged", moe, moe.Config(dispatch="ragged")),
    ):
        params = jax.eval_shape(partial(module.init, cfg=cfg), jax.random.key(0))
        state = jax.eval_shape(common.make_optimizer().init, params)
        tokens = jax.ShapeDtypeStruct((4, cfg.seq), jnp.int32)
        extra = (jax.ShapeDtypeStruct((), jax.random.key(0).dtype),) if module is gpt2 else ()
        programs[name] = (partial(module.train_step, cfg=cfg), (params, state, tokens, tokens, *extra))
    return programs


# primitives handled by the walker itself, not by a rule
_WALKED = {"jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "custom_linear_solve", "remat2",
           "checkpoint", "scan", "while", "cond", "sharding_constraint", "reshard", "optimization_barrier",
           "device_put", "shard_map", "debug_print", "debug_callback"}


def test_every_primitive_of_the_training_steps_has_a_rule() -> None:
    """Forward, backward and adamw update of GPT-2 (both attentions), Llama and the
    dropless ``lax.ragged_dot`` MoE: a new
    primitive in a future JAX (or model) without a rule fails here."""
    known = set(primitive_names()) | _WALKED
    for name, (fn, args) in _training_programs().items():
        found = _primitives(jax.make_jaxpr(fn)(*args).jaxpr, set())
        assert found - known == set(), f"{name}: no rule for {sorted(found - known)}"


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_train_step_keeps_parameter_and_state_layouts(mesh: Any, model: str) -> None:
    """The whole adamw step on the Megatron plan (dp=2 x tp=4): with out_layouts saying
    that updated parameters and optimizer state keep their layouts, every one of them
    does, and the loss is a scalar."""
    module, cfg = (gpt2, gpt2.Config()) if model == "gpt2" else (llama, llama.Config())
    params = distribute_pytree(module.init(jax.random.key(0), cfg), mesh, module.megatron_plan())
    state = common.distribute_state(common.make_optimizer().init(common.plain(params)), params)
    tokens = distribute_tensor(np.zeros((4, cfg.seq), np.int32), mesh, "S(0),R")
    extra = (jax.random.key(1),) if module is gpt2 else ()
    prediction = predict(partial(module.train_step, cfg=cfg), params, state, tokens, tokens, *extra,
                         out_layouts=(params, state, None))
    new_params, new_state, loss = prediction.out_layouts_tree
    assert new_params == jax.tree.map(lambda p: p.layout, params, is_leaf=lambda v: hasattr(v, "layout"))
    assert new_state == jax.tree.map(lambda p: p.layout, state, is_leaf=lambda v: hasattr(v, "layout"))
    assert loss.ndim == 0 and not any(loss.dim_axes)


def test_forward_loss_checks_against_xla(mesh: Any) -> None:
    cfg = gpt2.Config()
    params = distribute_pytree(gpt2.init(jax.random.key(0), cfg), mesh, gpt2.megatron_plan())
    idx, targets = common.megatron_batch(cfg, mesh)
    report = check(partial(gpt2.loss, cfg=cfg), params, idx, targets, jax.random.key(1))
    assert [o.verdict for o in report.outputs] in (["equal"], ["xla reduced partial"])


# -- apply on pytrees -----------------------------------------------------------------------------------------


def _sgd_step(p: dict[str, Any], x: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    loss, grads = jax.value_and_grad(lambda p: jnp.tanh(x @ p["w"] + p["b"]).sum())(p)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss


def test_docs_out_layouts_example() -> None:
    """docs/inference.md section 6: the step's parameters keep their layouts."""
    mesh = init_device_mesh((2,), ("x",))
    params = {"w": distribute_tensor(np.ones((16, 32), np.float32), mesh, "R"),
              "b": distribute_tensor(np.zeros(32, np.float32), mesh, "S(0)")}
    x = distribute_tensor(np.ones((8, 16), np.float32), mesh, "S(0)")
    kept = predict(_sgd_step, params, x, out_layouts=(params, None))
    # at 192 B per collective (the default until stop 39), searched from replicas over x (jaxpr._replicas_restart):
    # the loss reduced in the program, 320 B in 2 all-gathers (3 collectives with b's local slice) where 832 B in 5
    # kept it partial. The latency-bound default (8,192 B per all-gather, 192 per all-reduce and reduce-scatter)
    # takes eager dispatch's plan, which is XLA's: b all-gathered for the forward, b's gradient reduce-scattered and
    # w's all-reduced (2,176 B in an all-gather and an all-reduce after the combiner; check: XLA's 2,244 B in its 2),
    # x split and the loss partial
    assert jax.tree.map(str, kept.out_layouts_tree) == ({"b": "S(0)", "w": "R"}, "P")
    assert (kept.nbytes, sum(kept.collectives.values())) == (2176, 5)
    assert kept.combined_counts == {"all-gather": 1, "all-reduce": 1}
    report = check(_sgd_step, params, x, out_layouts=(params, None))
    assert (report.predicted_bytes, len(report.predicted_combined)) == (report.compiled_bytes, 2) == (2244, 2)
    # free outputs: eager dispatch leaves the gradient's partial pending; the program search charges a free output
    # its move to eager dispatch's layout, its partials reduced (w: R, b: S(0)), and gathers x as when they are kept
    # (320 B): w comes back R, its parameter's layout and XLA's (while a free output owed only its partials'
    # reduce-scatter, the search reduce-scattered w's gradient into the update and returned w split, S(1)); b comes
    # back R, its slice to S(0) free (a tie by the objective; XLA returns S(0))
    eager = predict(_sgd_step, params, x, search="eager")
    assert jax.tree.map(str, eager.out_layouts_tree) == ({"b": "S(0)", "w": "P"}, "P")
    free = predict(_sgd_step, params, x)
    assert jax.tree.map(str, free.out_layouts_tree) == ({"b": "R", "w": "R"}, "R")
    assert (free.nbytes, sum(free.collectives.values())) == (320, 2)
    # eager dispatch moves the partial gradient to R at the end; at 192 B per collective the program search planned
    # for the fixed output instead (no final move but b's local slice, computed on the replicas) and owed no more.
    # Under the latency-bound default it keeps eager dispatch's plan (above), that final all-reduce of w's gradient
    eager_kept = predict(_sgd_step, params, x, out_layouts=(params, None), search="eager")
    assert eager_kept.equations[-1].primitive == "out_layouts" and eager_kept.collectives["all-reduce"] == 1
    assert eager_kept.out_layouts[:-1] == kept.out_layouts[:-1]
    final = [s.collective for e in kept.equations if e.primitive == "out_layouts"
             for plan in e.signature.chosen.plans for s in plan.steps]
    assert final == ["all-reduce"] and kept.cost <= eager_kept.cost


def test_predict_is_cached_per_function_input_specs_and_options(mesh: Any) -> None:
    """A repeated predict (same function object, specs, options) is the same Prediction,
    as jax.jit reuses a trace; another search, other out_layouts, other specs or a
    cleared cache predict anew."""
    from placements2jax import clear_caches

    params = {"w": distribute_tensor(np.ones((16, 32), np.float32), mesh, "R,S(1)"),
              "b": distribute_tensor(np.zeros(32, np.float32), mesh, "R,S(0)")}
    x = distribute_tensor(np.ones((8, 16), np.float32), mesh, "S(0),R")
    first = predict(_sgd_step, params, x, out_layouts=(params, None))
    assert predict(_sgd_step, params, x, out_layouts=(params, None)) is first
    assert predict(_sgd_step, params, x) is not first
    assert predict(_sgd_step, params, x, out_layouts=(params, None), search="eager") is not first
    moved = distribute_tensor(np.ones((8, 16), np.float32), mesh, "R,S(1)")
    assert predict(_sgd_step, params, moved, out_layouts=(params, None)) is not first
    clear_caches()
    again = predict(_sgd_step, params, x, out_layouts=(params, None))
    assert again is not first and again == first


def test_apply_on_pytrees_enforces_out_layouts(mesh: Any) -> None:
    rng = np.random.default_rng(0)
    plain = {"w": rng.standard_normal((16, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)}
    xs = rng.standard_normal((8, 16)).astype(np.float32)
    params = {"w": distribute_tensor(plain["w"], mesh, "R,S(1)"), "b": distribute_tensor(plain["b"], mesh, "R,S(0)")}
    x = distribute_tensor(xs, mesh, "S(0),R")
    new, loss = apply(_sgd_step, params, x, out_layouts=(params, None))
    assert {k: v.layout for k, v in new.items()} == {k: v.layout for k, v in params.items()}
    expected, expected_loss = _sgd_step(plain, xs)
    for k in plain:
        np.testing.assert_allclose(np.asarray(new[k].full_tensor()), expected[k], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(loss.full_tensor()), expected_loss, rtol=1e-5)


def test_apply_takes_prng_keys_and_named_tuples(mesh: Any) -> None:
    xs = np.arange(128, dtype=np.float32).reshape(8, 16)
    x = distribute_tensor(xs, mesh, "S(0),S(1)")

    def noisy(batch: Batch, key: jax.Array, raw: jax.Array) -> jax.Array:
        return batch.tokens * batch.scale + jax.random.normal(key, (8, 16)) + jax.random.uniform(raw, (8, 16))

    key, raw = jax.random.key(3), jax.random.PRNGKey(4)
    result = apply(noisy, Batch(x, 2.0), key, raw)
    assert result.layout == x.layout
    np.testing.assert_allclose(np.asarray(result.full_tensor()), noisy(Batch(xs, 2.0), key, raw), rtol=1e-5, atol=1e-6)


def test_bfloat16_mixed_precision_keeps_partials_through_casts(mesh: Any) -> None:
    """A row-parallel matmul in bfloat16: its partial sum passes the cast back to float32
    (a float-to-float conversion is linear up to rounding) and is reduced once."""

    def mlp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        h = jax.nn.gelu(x.astype(jnp.bfloat16) @ w1.astype(jnp.bfloat16))
        return (h @ w2.astype(jnp.bfloat16)).astype(F32)

    x, w1, w2 = spec(mesh, (8, 16), "S(0),R"), spec(mesh, (16, 32), "R,S(1)"), spec(mesh, (32, 16), "R,S(0)")
    eager = predict(mlp, x, w1, w2, search="eager")
    assert outs(eager) == ["S(0),P"]
    # the program search counts what a free output still owes: it reduce-scatters it
    assert not predict(mlp, x, w1, w2).outputs[0].layout.has_partial
    grads = predict(jax.grad(lambda *a: mlp(*a).sum(), argnums=(1, 2)), x, w1, w2)
    assert all(o.dtype == np.float32 for o in grads.outputs)
    converts = [e for e in grads.equations if e.primitive == "convert_element_type"]
    assert any(e.inputs[0].dtype == jnp.bfloat16 for e in converts)


def test_the_search_prices_bfloat16_collectives_as_cpu_xla_sends_them(mesh: Any) -> None:
    """CPU XLA sends a collective of bfloat16 values in float32 (combine.CombinerRules.widening,
    what check counts), and the search prices it so: a row-parallel bfloat16 partial, cast
    to float32 and sliced to 12 of its 16 columns before a non-linear op, is reduced after
    the slice, a (4, 12) float32 block (288 B per device as compiled), not as the bfloat16
    (4, 16) block before the cast (192 B by the planner, but 384 as CPU XLA sends it: the
    search's choice before it priced the widening, and XLA's own plan)."""

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        y = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(F32)
        return jnp.tanh(y[:, :12])

    x, w = spec(mesh, (8, 32), "S(0),S(1)"), spec(mesh, (32, 16), "R,S(0)")
    prediction = predict(f, x, w)
    moved = [(e.primitive, plan.shape, plan.dtype) for e in prediction.equations if e.signature is not None
             for plan in e.signature.redistributions if not plan.is_noop]
    assert moved == [("tanh", (8, 12), np.float32)], moved
    assert prediction.lowered_nbytes == 288
    report = check(f, x, w)
    (reduced,) = (c for c in report.collective_checks if c.kind == "all-reduce")
    assert (reduced.predicted_bytes, reduced.compiled_bytes) == (288, 384)


def test_apply_runs_the_llama_loss_like_plain_jax(mesh: Any) -> None:
    """apply, equation by equation under the predicted signatures, on the Megatron-laid
    Llama (one layer): the loss equals plain JAX's. (The whole adamw step under apply
    also matches, to 4e-5, and keeps every layout with out_layouts=(params, state,
    None), but compiling its ~1200 per-equation programs takes minutes here.)"""
    cfg = llama.Config(layers=1)
    plain = llama.init(jax.random.key(0), cfg)
    params = distribute_pytree(plain, mesh, llama.megatron_plan())
    tokens, targets = common.batch(0, 4, cfg.seq, cfg.vocab)
    args = (distribute_tensor(tokens, mesh, "S(0),R"), distribute_tensor(targets, mesh, "S(0),R"))
    loss = apply(partial(llama.loss, cfg=cfg), params, *args, execute="ops")  # the default "xla": test_models
    np.testing.assert_allclose(np.asarray(loss.full_tensor()), llama.loss(plain, tokens, targets, cfg), rtol=1e-5)


# -- whole training programs against XLA: the ratios reached (issue 15's targets) ------------------------------

# (model, function) -> (upper bound of predicted / compiled bytes per device, extra predicted collectives allowed
# over XLA's compiled operands). The issue's target is 0.9-1.1x and no extra collective; met by Llama's loss
# and value_and_grad (bytes); the others pin the improvement reached (before the loop search: GPT-2 1.80 /
# 3.22 / 9.55, Llama 1.02 / 1.24 / 1.79; before the search's value moves: GPT-2 1.80 / 1.38 / 2.44 with 18 /
# 68 / 90 collectives, Llama 1.02 / 1.24 / 1.79 with 19 / 102 / 182; measured now 1.80 / 1.10 / 2.07 with 18 /
# 62 / 82 and 1.02 / 0.99 / 1.41 with 19 / 100 / 165, against XLA's 14 / 51 / 58 and 18 / 65 / 96 operands).
# Since a loop body's consumers of a carry share its redistributions (one all-reduce of GPT-2's partial residual
# stream at the top of each layer, where each layer norm reduce-scattered and all-gathered it): GPT-2 0.85 / 0.96 /
# 1.99 with 12 / 53 / 77; value moves also descended from the best result's start: adamw 1.75 with 71. GPT-2's
# loss now predicts less than XLA sends: the same all-reduces per mesh axis (6 on tp, 1 on dp), but 5 all-to-alls
# of attention heads where XLA sends 7 collective-permutes; its floor is 0.85 (0.9 elsewhere), and its
# collectives must not exceed XLA's (extra -2: 12 against 14).
# Since the search chooses loop carries (the forward scan carries GPT-2's residual stream reduced): GPT-2 adamw
# 1.75 -> 1.13 with 71 -> 65 operands (combined 47 -> 42 against XLA's 23).
# Since the search prices moves as the backend compiles them (CPU XLA's reduce-scatter is an all-reduce, so a
# reduce-scatter + all-gather costs more than the all-reduce XLA sends) and ends with a reducing descent: Llama
# 1.02 / 0.99 / 1.41 with 19 / 100 / 165 -> 0.78 / 0.69 / 1.07 with 12 / 66 / 115 (GPT-2 as before). Llama's loss
# and value_and_grad now predict less than XLA sends: XLA all-reduces a row-parallel partial and slices it, then
# all-gathers it back (5 all-gathers where the prediction all-reduces once); below the floor only so
# (:func:`common.below_floor`).
# Since value moves are also tried without cascading (a bias gradient sums its activation gradient as the matmuls
# take it, all-reduced over tp, and is then dp-partial only, as XLA does): GPT-2 value_and_grad / adamw 0.90 / 1.02
# with 47 / 60 -> 0.83 / 0.98 with 46 / 55 (combined 32 / 36 -> 31 / 35), Llama value_and_grad 65 -> 63 (49 -> 47).
# Since cost ties order the outputs' splits as torch lists its strategies (issue 16): Llama adamw step 1.036 -> 0.96
# with 111 -> 102 operands (combined 95 -> 86; XLA 96 operands, 48 compiled).
# Since the search charges each collective a fixed overhead in bytes and routes its moves with it (cost.py's
# DEFAULT_COLLECTIVE_OVERHEAD: fewer collectives unless the bytes saved exceed it; bias gradients all-reduced per mesh axis instead of
# reduce-scattered, all-reduced and all-gathered): GPT-2 value_and_grad / adamw 0.83 / 0.98 with 46 / 55 -> 0.96 /
# 0.93 with 42 / 43 (now within 0.9-1.1x XLA's bytes and below XLA's collectives; combined 31 / 35 -> 28 / 22),
# Llama value_and_grad / adamw 0.686 / 1.04 with 63 / 111 -> 0.690 / 1.02 with 56 / 105 (combined 47 / 95 -> 38 /
# 89). Both together: Llama adamw 0.96 with 98 operands (combined 82; XLA 96 operands, 48 compiled).
# Since the finishing descent also offers each equation the candidate cheapest for its inputs with an input free
# where another consumer already needs it so (program.py's shared_needs: Llama's weight gradients read the
# normed activation as the forward matmuls gathered it, partial over dp, instead of gathering it over dp and
# moving the parameter and both Adam moments to the transposed split and back): Llama value_and_grad / adamw
# 0.690 / 0.96 with 56 / 98 -> 0.629 / 0.760 with 47 / 68 (combined 38 / 82 -> 28 / 50); GPT-2 unchanged.
# Since the descent without pull moves breaks cost ties by the fewest inputs moved (program.py's tie_moved): Llama
# adamw 0.760 with 68 -> 0.679 with 53 (combined 50 -> 31; all-gathers 29 -> 14 against XLA's 24, all-to-alls
# 7 -> 2 against none); the others unchanged.
# Since the search re-chooses a scan's stacked outputs looking ahead to their consumers (program.py's
# _greedy_stack): GPT-2 value_and_grad 0.964 -> 0.930 with 42 operands (combined 6 more than XLA's -> 1 fewer);
# the others unchanged.
# Since take_along_axis has the masked-lookup candidate (stop 30: the log-probabilities looked up where they are
# split on the vocabulary, not moved to the sequence split by an all-to-all over tp first): every row one operand and
# one combined collective fewer; GPT-2 loss / value_and_grad / adamw 0.854 / 0.936 / 0.930 -> 0.801 / 0.919 / 0.913,
# Llama 0.781 / 0.629 / 0.664 -> 0.762 / 0.625 / 0.660. GPT-2's loss is then 0.80x XLA's bytes, below its floor,
# with as many all-reduces (7, XLA's 90 B more: it all-reduces the label's logits, the prediction their sum): what
# is left is XLA's own choice, 7 collective-permutes of the attention heads (5,120 B) where the prediction moves
# them by 4 all-to-alls (2,304 B), as XLA does compiling the predicted layouts pinned (apply(execute="pinned"):
# 11,712 B in 9 collectives, the predicted bytes); set aside, the all-reduces are 0.99x XLA's
# (common.below_floor_by_own_kinds).
# Since the default cost model is latency-bound (stop 39: 8,192 B per all-gather and all-to-all, 192 per all-reduce and
# reduce-scatter) the value_and_grad and adamw rows trade bytes for collectives (the loss rows unchanged): GPT-2 0.913
# / 0.912 with 40 / 41 operands -> 1.016 / 1.015 with 36 / 37 (combined 19 / 21 -> 15 / 17; its 8 all-to-alls gone for
# 4 all-gathers), Llama 0.594 / 0.618 with 42 / 46 -> 0.699 / 0.712 with 38 / 43 (combined 23 / 25 -> 13 / 17: 11 / 10
# all-gathers -> 1 / 2).
# Since a compiled all-to-all counts one operand (stop 54, Collective.operands: CPU XLA's tuple form holds the pieces
# of one value, which counted as 4 operands on tp's 4, "XLA has 3 more"): XLA's 4 all-to-alls over tp in GPT-2's
# value_and_grad and adamw step are 12 operands fewer, the predictions unchanged: -15 / -21 -> -3 / -9.
_REACHED = {
    ("gpt2", "loss"): (0.81, -3),
    ("gpt2", "value_and_grad"): (1.02, -3),
    ("gpt2", "adamw step"): (1.02, -9),
    ("llama", "loss"): (0.77, -7),
    ("llama", "value_and_grad"): (0.70, -27),
    ("llama", "adamw step"): (0.72, -53),
}
_FLOOR = {("gpt2", "loss"): 0.85}


# (model, function) -> extra predicted collectives allowed over XLA's compiled collectives once the
# prediction's are combined as XLA's combiner does (inference/combine.py; the issue's "never more collectives
# than XLA" is 0). Before modelling the combiner the comparison was per operand only (above).
# Llama value_and_grad went 44 -> 49 when the value moves landed: they cut its bytes 1.24x -> 0.99x XLA's and its
# operands 102 -> 100, but trade all-reduces (which CPU XLA combines) for all-gathers (which it does not).
# GPT-2 adamw step -3 -> -2 at stop 37, the same plan: the combiner modelled one group at a time in XLA's post
# order counts its all-reduces 13, as its pinned program compiles them (groups formed side by side merged into a
# cycle no program has: 12). Under the latency-bound default (stop 39; above): GPT-2 value_and_grad / adamw -2 / -2 ->
# -7 / -6, Llama -10 / -19 (-14 / -23 when measured at 192 B at stop 39) -> -24 / -31.
_COMBINED_REACHED = {
    ("gpt2", "loss"): -3,
    ("gpt2", "value_and_grad"): -7,
    ("gpt2", "adamw step"): -6,
    ("llama", "loss"): -7,
    ("llama", "value_and_grad"): -24,
    ("llama", "adamw step"): -31,
}


@pytest.mark.parametrize(("model", "mode"), sorted(_REACHED))
def test_training_programs_predict_xlas_bytes(mesh: Any, model: str, mode: str) -> None:
    """check on the loss, value_and_grad and adamw step of GPT-2 and Llama (Megatron plan,
    dp=2 x tp=4): every output's layout agrees with XLA's, the predicted bytes per device
    are at least 0.9x XLA's (``_FLOOR``; less only where XLA has more collectives, :func:`common.below_floor`, or
    by its collective-permutes, :func:`common.below_floor_by_own_kinds`) and at most the ratio reached, and the
    predicted collectives
    exceed XLA's (counted by operand) by at most the number reached."""
    module, cfg = (gpt2, gpt2.Config()) if model == "gpt2" else (llama, llama.Config())
    fn, args, out_layouts = common.checked_programs(module, cfg, mesh)[mode]
    report = check(fn, *args, out_layouts=out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    ratio = float(report.predicted_bytes / report.compiled_bytes)
    bound, extra = _REACHED[model, mode]
    floor = _FLOOR.get((model, mode), 0.9)
    assert floor <= ratio or common.below_floor(report) or common.below_floor_by_own_kinds(report, floor), (
        ratio, report.collective_checks
    )
    assert ratio <= bound, ratio
    assert sum(report.predicted_counts.values()) <= sum(report.compiled_operand_counts.values()) + extra
    combined = report.predicted_combined_counts
    assert all(combined[kind] <= n for kind, n in report.predicted_counts.items())
    assert sum(combined.values()) <= sum(report.compiled_counts.values()) + _COMBINED_REACHED[model, mode]
    # the collectives check counts per operand are those its combiner merges (one walk: signature.SharedRoutes)
    assert report.predicted_counts == Counter(c.kind for c in report.predicted_combined for _ in c.members)


# dtype -> (upper bound of predicted / compiled bytes, extra collectives allowed over XLA's compiled ones after its
# combiner) of the stacked scan-over-layers LM's adamw step (tests/models/stacked.py, Megatron dp=2 x tp=4, its
# embedding table replicated). Before the finishing descent's value moves gathered split values: 1.41x with 19
# against XLA's 9 (float32), 1.02x with 19 (bfloat16, counting its collectives at their bfloat16 bytes where CPU XLA
# sends them in float32). Now both below XLA's bytes, legitimately (common.below_floor): the embedding's gradient is
# scattered from the activation gradient all-gathered over dp (2,048 B and the token ids' 64) where XLA all-reduces
# the table (8,192 B), in one more collective each: XLA's combiner merges that all-reduce with the head's gradient's.
# float32 0.91x in 13 until the backward scan read the layers' saved inputs replicated (the forward stacked them
# partial, for free, and each layer's backward all-reduced them over tp: 3,072 B and one collective): now as bfloat16.
# 3 more than XLA's until the clip's norm summed every gradient's squares replicated over dp (program's
# _one_reduced: three of them were summed on a free dp slice, a 4 B all-reduce over dp more); now the two
# all-gathers above alone. (0.78, 2) at 192 B per collective (the default until stop 39: 18,000 B, 0.75x, in 11);
# the latency-bound default takes XLA's plan for the embedding's gradient (the table all-reduced, no all-gather): 24,080
# B (1.00x XLA's 24,086) in 8 all-reduces after the combiner, one fewer than XLA's 9.
_STACKED_REACHED = {"float32": (1.0, -1), "bfloat16": (1.0, -1)}


@pytest.mark.parametrize("dtype", sorted(_STACKED_REACHED))
def test_stacked_layers_step_updates_its_replicated_embedding_replicated(mesh: Any, dtype: str) -> None:
    """check on the adamw step of scan-over-layers code (stacked weights under lax.scan, a
    replicated embedding table, float32 or bfloat16 compute): the embedding's gradient is
    reduced once (all-reduced, XLA's plan, under the latency-bound default; scattered from
    the gathered activation gradient at 192 B per collective) and its clip and adamw update
    run replicated, so neither the table nor its two Adam moments is all-gathered at the
    end (three float32 (64, 32) tables, 4,096 B each over dp, before); the backward scan
    reduces none of the layers' saved inputs; the clip's norm is all-reduced over tp alone;
    the bytes within the reached ratio, the collectives as reached."""
    step = training_step("stacked", mesh, dtype=dtype)
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    gathered = [plan.shape for plan, s in report.prediction.routed_moves() if s.collective == "all-gather"]
    # none (at 192 B per collective the activation gradient and the token ids, for the embedding's gradient)
    assert (64, 32) not in gathered and gathered == [], gathered
    # the backward scan reads the layers' saved inputs as the forward scan stacked them, replicated: none reduced in
    # its body (float32 all-reduced them over tp, 3,072 B and a collective per layer, when the forward stacked its
    # replicated residual stream partial, for free: a stacked output had no replicated candidate)
    reduced = [e.path for e in report.prediction.equations if e.signature is not None
               for src, plan in zip(e.sources, e.signature.redistributions)
               if src is not None and ".xs" in src[0] and plan.src.has_partial and not plan.is_noop]
    assert not reduced, reduced
    # no scalar reduced over dp in the program but the loss: the clip's global norm sums every gradient's squares
    # replicated over dp. The loss is all-reduced over dp and tp, returned R,R as XLA returns it (at 192 B per
    # collective it stayed partial, an output; under the latency-bound default its all-reduce joins the gradients')
    scalars = [s.axis for plan, s in report.prediction.routed_moves() if plan.shape == ()]
    assert "tp" in scalars and scalars.count("dp") == 1, scalars
    # R,R until the planner reduced a partial over several mesh dims tp first (stop 39): the loss is now reduced over dp
    # and returned partial over tp (verdict "xla reduced partial")
    assert str(report.prediction.out_layouts[-1]) == "R,P"
    ratio = float(report.predicted_bytes / report.compiled_bytes)
    bound, extra = _STACKED_REACHED[dtype]
    assert 0.9 <= ratio or common.below_floor(report), (ratio, report.collective_checks)
    assert ratio <= bound, ratio
    assert len(report.predicted_combined) <= len(report.compiled_collectives) + extra


def test_stacked_layers_step_under_a_count_first_model_has_xlas_collectives(mesh: Any) -> None:
    """The stacked LM's adamw step (above) under a cost model charging 8,192 B per
    all-gather and all-to-all (the collectives CPU XLA's combiner never merges; the others
    at the default 192): XLA's plan for the embedding's gradient, the table all-reduced
    over dp in the head's gradient's all-reduce (8,192 B) instead of the activation
    gradient and the token ids all-gathered (2,112 B, two collectives more after the
    combiner): 18,768 B in 11 collectives after the combiner -> 24,848 B (1.03x XLA's
    24,086) in 9, XLA's count, every output XLA's layout; with the masked lookup of
    ``take_along_axis`` (stop 30: no all-to-all of the log-probabilities) 24,080 B in 8,
    one fewer than XLA; ``apply(execute="pinned")`` under the model (``use_cost_model``)
    computes the unsharded step's values in those 8 collectives (Adam's tolerance:
    tests/test_real_code.py's)."""
    step = training_step("stacked", mesh)
    model = CostModel(collective_overhead={"all-gather": 8192, "all-to-all": 8192})
    report = check(step.fn, *step.args, out_layouts=step.out_layouts, cost_model=model)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert len(report.predicted_combined) <= len(report.compiled_collectives) == 9
    assert report.predicted_bytes <= 1.1 * report.compiled_bytes
    gathered = [plan.shape for plan, s in report.prediction.routed_moves() if s.collective == "all-gather"]
    assert not gathered, gathered
    with use_cost_model(model):
        pinned = jax.jit(lambda *a: apply(step.fn, *a, out_layouts=step.out_layouts, execute="pinned"))
        assert len(parse_collectives(pinned.lower(*step.args).compile().as_text())) == 8
        got = jax.tree.leaves(pinned(*step.args), is_leaf=lambda x: isinstance(x, DTensor))
    want = jax.tree.leaves(jax.jit(step.fn)(*common.plain(step.args)))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=2e-5, atol=1e-4)


def test_multisteps_under_a_count_first_model_has_xlas_collectives(mesh: Any) -> None:
    """The stacked LM's step under ``optax.MultiSteps`` (a ``lax.cond``) and the count-first
    model above: its backward layer scan carried the activation gradient partial over
    ``tp`` and all-reduced it at each body's start, so the norm weight's gradient, formed
    after that and reduced over ``tp`` too, went in an all-reduce of its own. Carried
    reduced (the initial value all-reduced before the loop where the embedding's gradient
    all-reduced it after, the body's result at its end: the same bytes, a tie for the
    objective), both reductions are at the body's end in one all-reduce: 24,080 B in 10
    collectives after XLA's combiner -> 9, XLA's count (program.py's
    ``_Search.regrouped``: moves no dearer by the objective that lower the count after the
    combiner)."""
    step = training_step("stacked", mesh, common.accumulating_optimizer())
    model = CostModel(collective_overhead={"all-gather": 8192, "all-to-all": 8192})
    report = check(step.fn, *step.args, out_layouts=step.out_layouts, cost_model=model)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert len(report.predicted_combined) <= len(report.compiled_collectives) == 9
    assert report.predicted_bytes <= 24_080


def test_multisteps_at_192_bytes_counts_the_loss_reduction_as_xla_compiles_it(mesh: Any) -> None:
    """The same MultiSteps step under 192 B per collective. Check converts the free loss,
    left partial over both mesh dims, to XLA's replicated one after the program; reduced
    tp then dp (XLA's order for one constraint, the planner's default) it counted 12
    collectives after the combiner (18,000 B) where the program itself compiles 11
    (17,990 B): its dp all-reduce joins the gradients' dp group, which the gradient norm's
    tp all-reduce depends on, so that one and the loss's tp all-reduce would form a cycle
    and stay apart. The prediction reduces it dp first (``Prediction.reduction_orders``,
    stop 41): its tp all-reduce joins the last tp group, 11, and the pinned program
    reducing it so (its intermediate layout pinned) compiles exactly those groups. The
    same plan with the loss fixed replicated by ``out_layouts`` is a fixed output's move,
    not reordered: reduced tp then dp as XLA compiles one constraint, it compiles to
    exactly the 12 predicted groups."""
    step = training_step("stacked", mesh, common.accumulating_optimizer())
    model = CostModel(collective_overhead=192)
    report = check(step.fn, *step.args, out_layouts=step.out_layouts, cost_model=model)
    assert (report.predicted_bytes, len(report.predicted_combined)) == (18000, 11)
    conversions = [(str(plan.src), str(plan.dst)) for where, plan in report.redistributions if where != "program"]
    assert conversions == [("P,P", "R,R")]  # the loss
    (loss,) = [o for o in report.outputs if str(o.predicted) == "P,P"]
    assert [(s.axis, s.collective) for s in loss.conversion.steps] == [("dp", "all-reduce"), ("tp", "all-reduce")]
    assert [o for o in report.prediction.reduction_orders if o is not None] == ["first first"]

    program, structs = common.compiled_pinned(report.prediction, model)
    collectives = parse_collectives(program.as_text())
    assert sorted(len(g.members) for g in report.predicted_combined) == sorted(len(c.result_shapes) for c in collectives)
    assert sum(collective_nbytes(c, 8) for c in collectives) == report.predicted_bytes
    leaves = jax.tree.leaves(step.args, is_leaf=lambda v: isinstance(v, DTensor))
    arrays = [jax.device_put(np.asarray(v.full_tensor() if isinstance(v, DTensor) else v), struct.sharding)
              for v, struct in zip(leaves, structs, strict=True)]
    want = jax.tree.leaves(step.plain_jit()(*step.plain_args()))
    for g, w in zip(program(*arrays), want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)

    outs = (*step.out_layouts[:-1], Layout.from_device_mesh(mesh)("R,R"))
    with use_cost_model(model):
        prediction = predict(step.fn, *step.args, out_layouts=outs)
        pinned = jax.jit(lambda *a: apply(step.fn, *a, out_layouts=outs, execute="pinned"))
        compiled = compiled_collectives(pinned, *step.args)
    planned = prediction.planned_collectives()
    assert [(planned[i].kind, planned[i].axes) for i in range(-2, 0)] == [("all-reduce", ("tp",)),
                                                                         ("all-reduce", ("dp",))]
    combined = prediction.combined()
    assert sorted(len(g.members) for g in combined) == sorted(len(c.result_shapes) for c in compiled)
    assert len(combined) == len(compiled) == 12
    assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.lowered_nbytes == 18000
    (loss,) = [g for g in combined if len(planned) - 1 in g.members]  # the loss's dp all-reduce: with a gradient's
    assert len(loss.members) == 2 and [len(g.members) for g in combined if len(planned) - 2 in g.members] == [1]
    got = jax.tree.leaves(pinned(*step.args), is_leaf=lambda v: isinstance(v, DTensor))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_llama_scan_under_a_count_first_model_has_xlas_collectives(mesh: Any) -> None:
    """The bfloat16 two-layer Llama scan (tests/models/llama_scan.py, einsum attention) under
    the count-first model above. With the masked lookup of ``take_along_axis`` the search at
    that model ends at 122,256 by its objective (93,264 B in 26 planned collectives, 13 after
    XLA's combiner); the descent from the default model's choice reaches 112,912 in 27 (one
    more 192 B all-reduce), which "no more planned collectives" refused: kept by the
    objective alone (program.py's ``_continued``), 91,728 B in 11 after the combiner, XLA's
    count (107,604 B); then the logits moved to the sequence split for all four consumers
    at once (``_Search.value_moves``' ``common``): 112,336, the search's figure before the
    masked lookup, 91,536 B in 10 after the combiner, one fewer than XLA. Since stop 37 the
    same plan (90,192 B) counts 11 after the combiner, XLA's count and what its pinned
    program compiles: groups formed side by side had merged into a cycle (the combiner now
    forms one at a time in XLA's post order, :func:`.combine.combine`). Since the planner
    reduces a value partial over several mesh dims last mesh dim first (tp before dp, stop
    39) 10 after the combiner, one fewer than XLA's 11."""
    step = training_step("llama_scan", mesh, dtype="bfloat16")
    model = CostModel(collective_overhead={"all-gather": 8192, "all-to-all": 8192})
    report = check(step.fn, *step.args, out_layouts=step.out_layouts, cost_model=model)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert len(report.compiled_collectives) == 11
    # 11 (XLA's count) until the planner reduced a partial over several mesh dims tp first (stop 39)
    assert len(report.predicted_combined) == 10
    assert report.predicted_bytes <= 91_536


def test_a_size_one_mesh_dim_predicts_what_the_mesh_without_it_does() -> None:
    """Code written for multi-host meshes run with ``dp=1``: on a (1, 8) mesh a program is
    predicted as on (8,) (the same bytes, the same placements on the 8-device dim), in
    about the same time (the size-1 dim multiplies neither candidates nor planner states)."""

    def step(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ w1)
        return jnp.sum((h @ w2) ** 2, axis=0)

    flat, wide = init_device_mesh((8,), ("tp",)), init_device_mesh((1, 8), ("dp", "tp"))
    shapes = [(16, 32), (32, 64), (64, 32)]
    flat_p = predict(step, *(spec(flat, s, p) for s, p in zip(shapes, ["S(0)", "S(1)", "S(0)"])))
    wide_p = predict(step, *(spec(wide, s, p) for s, p in zip(shapes, ["R,S(0)", "R,S(1)", "R,S(0)"])))
    assert wide_p.nbytes == flat_p.nbytes > 0
    assert wide_p.collectives == flat_p.collectives
    assert [str(x).split(",", 1)[1] for x in wide_p.out_layouts] == outs(flat_p)


def _moves(prediction: Any) -> list[tuple[Any, ...]]:
    """A prediction's steps, collective for collective (the mesh axis named, not numbered)."""
    return [(s.axis, s.collective, s.src, s.dst, s.nbytes) for s in prediction.steps]


@pytest.mark.parametrize(
    ("shape", "names", "placements", "squeezed"),
    [
        ((1, 8), ("dp", "tp"), ["S(0),R", "S(0),S(1)", "S(1),S(0)"], ["R", "S(1)", "S(0)"]),
        ((2, 1, 4), ("dp", "pp", "tp"), ["S(0),S(1),R", "R,S(0),S(1)", "R,S(1),S(0)"], ["S(0),R", "R,S(1)", "R,S(0)"]),
    ],
)
def test_no_collective_over_one_device(
    shape: tuple[int, ...], names: tuple[str, ...], placements: list[str], squeezed: list[str]
) -> None:
    """A step on a size-1 mesh dim (gathering a split there, reducing a partial there)
    moves nothing and compiles to nothing: the plans keep it (their steps chain), but the
    prediction's steps, collectives and combined collectives leave it out, as check does,
    and match the mesh without that dim's collective for collective; so do XLA's
    compilations of the step (its own plan) and of the predicted program pinned, which
    compiles the predicted collectives and bytes. On (2,1,4) (and (2,4)) the prediction
    (``jaxpr._replicas_restart``'s) gathers ``h`` over ``dp`` first and all-reduces the
    loss over ``tp`` alone, 3,590 B in 2 all-gathers and 1 all-reduce; XLA all-reduces
    ``h @ w2`` over ``tp`` and the loss over ``dp``, 5,124 B in 2 and 2, on both meshes:
    the prediction has no more collectives than XLA's, not the same ones (before the
    restart 3,594 B in 2 and 2, as many as XLA's). Where a value's moves kept
    the ``pp`` partial through a gather and others dropped it, the pinned program gathered
    two arrays apart (``cached_plan`` gives such a partial up first: stop 30 found it on
    the whole-program restart's plan, 4,102 B in 4 pinned against 3,590 B predicted)."""

    def step(x: jax.Array, w1: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = jax.nn.gelu(x @ w1)
        return jnp.sum(h @ w2), h

    mesh = init_device_mesh(shape, names)
    flat = init_device_mesh(tuple(n for n in shape if n > 1), tuple(a for a, n in zip(names, shape) if n > 1))
    shapes = [(16, 32), (32, 64), (64, 32)]
    args = [spec(mesh, s, p) for s, p in zip(shapes, placements)]
    flat_args = [spec(flat, s, p) for s, p in zip(shapes, squeezed)]
    replicated, flat_replicated = ((",".join(["R"] * m.ndim),) * 2 for m in (mesh, flat))
    prediction = predict(step, *args, out_layouts=replicated)
    flat_p = predict(step, *flat_args, out_layouts=flat_replicated)
    planned = [s for plan in prediction.redistributions for s in plan.steps]
    assert any(s.over_one_device and s.collective in ("all-gather", "all-reduce") for s in planned)  # there to drop
    assert not any(s.over_one_device for s in prediction.steps)
    assert not any(s.over_one_device for e in prediction.equations for _, s in e.steps)
    assert _moves(prediction) == _moves(flat_p) and prediction.nbytes == flat_p.nbytes > 0
    assert prediction.collectives == flat_p.collectives
    assert prediction.combined_counts == flat_p.combined_counts
    report = check(step, *args, out_layouts=replicated)
    flat_report = check(step, *flat_args, out_layouts=flat_replicated)
    assert report.predicted_counts == prediction.combined_counts
    assert report.predicted_collectives == flat_report.predicted_collectives
    assert [(c.op, c.result_shapes, c.groups) for c in report.compiled_collectives] == [
        (c.op, c.result_shapes, c.groups) for c in flat_report.compiled_collectives
    ]
    assert sum(report.predicted_counts.values()) <= sum(report.compiled_counts.values())
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for m, given in ((mesh, placements), (flat, squeezed)):
        tensors = [distribute_tensor(v, m, p) for v, p in zip(values, given)]
        pinned = jax.jit(lambda *a, m=m: apply(step, *a, out_layouts=(",".join(["R"] * m.ndim),) * 2, execute="pinned"))
        compiled = compiled_collectives(pinned, *tensors)
        assert Counter(c.op for c in compiled) == prediction.combined_counts
        assert sum(collective_nbytes(c, 8) for c in compiled) == prediction.nbytes


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_training_step_with_dp_1_predicts_what_tp_alone_does(model: str) -> None:
    """GPT-2's and Llama's adamw steps on a (1, 8) mesh (dp=1, the batch split over it)
    predict what they predict on (8,) (the batch replicated), collective for collective.
    The program search saw a partial over the size-1 ``dp`` as one to reduce and a
    collective to count: GPT-2 predicted 69,671 B against 59,367 B on (8,), Llama 166,439 B
    against 167,783 B, in other collectives."""
    flat = training_step(model, init_device_mesh((8,), ("tp",)))
    wide = training_step(model, init_device_mesh((1, 8), ("dp", "tp")))
    flat_p = predict(flat.fn, *flat.args, out_layouts=flat.out_layouts)
    wide_p = predict(wide.fn, *wide.args, out_layouts=wide.out_layouts)
    assert _moves(wide_p) == _moves(flat_p) and wide_p.nbytes == flat_p.nbytes > 0
    assert wide_p.collectives == flat_p.collectives
    assert wide_p.combined_counts == flat_p.combined_counts
    assert [str(x).split(",", 1)[1] for x in wide_p.out_layouts] == outs(flat_p)


def test_dropless_moe_runs_its_ragged_dots_where_the_experts_are_split(mesh: Any) -> None:
    """MaxText's dropless MoE (tests/models/moe.py, ``dispatch="ragged"``: top-2 rows
    sorted by expert, ``lax.ragged_dot`` SwiGLU experts split on their hidden dim over tp)
    in an adamw step: its 9 ragged dots (w1, w3, w2 forward; w2's lhs and rhs gradients,
    w1's and w3's) move nothing: w1 / w3 column-parallel (``R,S(2)`` -> rows ``R,S(1)``),
    w2 row-parallel (-> ``R,P``), the rhs gradients (the ragged rows contracted) split
    as their weights; the token rows stay whole (sorted over every token: a rank's block
    of rows would start in the wrong group). Every ragged dot run on each rank's blocks
    (execute="ops") gives plain jax.jit's step. check and the xla / pinned executors:
    test_real_code; 17,696 B as XLA compiles the prediction against 67,916 B it
    compiles itself (0.26x; 23,520 before the expert-parallel signature, which no ragged
    dot here chooses, moved the search's path). Under the latency-bound default cost model
    (stop 39: 8,192 B per all-gather and all-to-all) the ragged dots alike, 23,696 B in 10
    collectives after the combiner where 17,542 in 11 at 192 B per collective."""
    step = training_step("moe", mesh, dispatch="ragged")
    prediction = predict(step.fn, *step.args, out_layouts=step.out_layouts)
    rows = [row for row in prediction.equations if row.primitive == "ragged_dot_general"]
    assert len(rows) == 9 and all(row.cost == 0 for row in rows)
    assert [str(row.outputs[0].layout) for row in rows] == [
        "R,S(1)", "R,S(1)", "R,P", "R,S(1)", "R,S(1)", "R,S(2)", "R,P", "R,S(2)", "R,P"
    ]
    assert prediction.lowered_nbytes <= 23_696  # 17,696 at 192 B per collective
    assert sum(prediction.combined_counts.values()) <= 10
    want = step.plain_jit()(*step.plain_args())
    got = apply(step.fn, *step.args, out_layouts=step.out_layouts, execute="ops")
    def leaves(tree: Any) -> list[Any]:
        return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, DTensor))

    for new, old, plain in zip(leaves(got[:2]), leaves(step.args[:2]), leaves(want[:2]), strict=True):
        assert new.layout == old.layout
        np.testing.assert_allclose(np.asarray(new.full_tensor()), np.asarray(plain), rtol=2e-5, atol=1e-5)
    assert float(got[2].full_tensor()) == pytest.approx(float(want[2]), rel=1e-5)


def _conv_block(p: dict[str, Any], x: jax.Array) -> jax.Array:
    """A Mamba-style mixer's convolution path: in-projections, a causal depthwise conv1d
    over the sequence (one filter per channel), SiLU, gated out-projection."""
    xs, z = x @ p["in"], x @ p["gate"]
    xs = lax.conv_general_dilated(xs, p["conv"], (1,), [(3, 0)], dimension_numbers=("NWC", "WIO", "NWC"),
                                  feature_group_count=xs.shape[-1])
    return x + (jax.nn.silu(xs) * jax.nn.silu(z)) @ p["out"]


def test_depthwise_conv_keeps_tensor_parallel_channels(mesh: Any) -> None:
    """Depthwise convolutions split their channels in whole groups (and the batch): the
    conv path of a Mamba-style block with its channels split over tp (column-parallel
    in-projections, the conv's filters split alike, a row-parallel out-projection) runs
    its forward conv, its input gradient and its kernel's gradient (``batch_group_count``)
    without communication, where grouped convolutions used to split nothing (the loss of
    a Mamba-style block with an associative scan: 25,098 -> 15,370 B, 0.79x XLA's; its
    adamw step 68,868 -> 39,428 B, 0.75x); predicts XLA's bytes and collectives; and
    every executor's adamw step equals plain jax.jit's (ranks run their own groups)."""
    d, e = 16, 32
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    plain = {"in": jax.random.normal(k1, (d, e)) / 4, "gate": jax.random.normal(k4, (d, e)) / 4,
             "conv": jax.random.normal(k2, (4, 1, e)) / 2, "out": jax.random.normal(k3, (e, d)) / 6}
    plan = {"in": colwise("tp"), "gate": colwise("tp"), "conv": "R,S(2)", "out": rowwise("tp")}
    params = distribute_pytree(plain, mesh, plan)
    x_full = np.random.default_rng(0).standard_normal((4, 8, d)).astype(np.float32)
    x = distribute_tensor(x_full, mesh, "S(0),R")
    optimizer = optax.adamw(1e-2)
    state = optimizer.init(params)

    def step(p: Any, s: Any, x: jax.Array) -> Any:
        value, grads = jax.value_and_grad(lambda p: jnp.mean(_conv_block(p, x) ** 2))(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    out_layouts = (params, state, None)
    prediction = predict(step, params, state, x, out_layouts=out_layouts)
    convs = [row for row in prediction.equations if row.primitive == "conv_general_dilated"]
    assert len(convs) == 3 and all(row.cost == 0 for row in convs)
    # forward, the kernel's gradient (the batch contracted: partial over dp), the input's gradient
    assert [str(row.outputs[0].layout) for row in convs] == ["S(0),S(2)", "P,S(2)", "S(0),S(2)"]
    report = check(step, params, state, x, out_layouts=out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    # XLA's 3,204 B in its 2 all-reduces (the gradients' reductions): the input gradient's kernel, transposed by a
    # reshape with ``dimensions`` ((4, 1, 32, 1) -> (4, 32, 1)), keeps its split (before that reshape had a rule: 3,588
    # B, 384 of them gathering the kernel, R,S(2) -> R,R, for the input gradient to slice)
    assert (report.predicted_bytes, len(report.predicted_combined)) == (report.compiled_bytes, 2) == (3204, 2)
    want_params, _, want_loss = jax.jit(step)(plain, optimizer.init(plain), x_full)
    for execute in ("xla", "pinned", "ops"):
        run = partial(apply, step, out_layouts=out_layouts, execute=execute)
        new_params, _, loss = run(params, state, x) if execute == "ops" else jax.jit(run)(params, state, x)
        assert float(loss.full_tensor()) == pytest.approx(float(want_loss), rel=1e-5), execute
        for name in plain:
            assert new_params[name].layout == params[name].layout
            np.testing.assert_allclose(np.asarray(new_params[name].full_tensor()), np.asarray(want_params[name]),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{execute} {name}")


# -- pooling, FFT convolutions, second-order preconditioners, approximate top-k on dp=2 x tp=4 -----------------


def _max_pool(x: jax.Array) -> jax.Array:
    """``flax.linen.max_pool(x, (2, 2), (2, 2))`` on NHWC, as it calls lax."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _avg_pool(x: jax.Array) -> jax.Array:
    """``flax.linen.avg_pool(x, (3, 3), padding="SAME")``: a padded window sum over 9."""
    return lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9


def _fft_conv(x: jax.Array, k: jax.Array) -> jax.Array:
    """A long convolution over the last dim by FFT (Hyena / H3 / S4's), one filter per channel."""
    n = 2 * x.shape[-1]
    return jnp.fft.irfft(jnp.fft.rfft(x, n=n) * jnp.fft.rfft(k, n=n), n=n)[..., : x.shape[-1]]


def _preconditioners(g: jax.Array) -> tuple[jax.Array, ...]:
    """Shampoo's inverse fourth root (eigh), Cholesky whitening (cholesky, solve_triangular),
    singular values, QR and LU of a batch of gradient blocks (values unique up to signs)."""
    stats = g @ jnp.swapaxes(g, -1, -2) + 1e-3 * jnp.eye(g.shape[-2])
    w, v = jnp.linalg.eigh(stats)
    root = (v * w[..., None, :] ** -0.25) @ jnp.swapaxes(v, -1, -2)
    white = jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(stats), g, lower=True)
    q, r = jnp.linalg.qr(g)
    return root @ g, white, jnp.linalg.svd(g, compute_uv=False), q @ r, lax.linalg.lu(stats)[0]


def _spd_blocks(rng: np.random.Generator) -> np.ndarray:
    return _spd(rng, (8, 4))


def _spd_8x8(rng: np.random.Generator) -> np.ndarray:
    return _spd(rng, (8, 8))


def _normal_8x8(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((8, 8, 8)).astype(np.float32)


def _tridiagonal(d: jax.Array, b: jax.Array) -> jax.Array:
    """``lax.linalg.tridiagonal_solve`` of systems with 0.5 off the diagonal ``d`` (a
    spline's or an implicit step's matrix; diagonally dominant for ``d > 1``)."""
    off = jnp.full_like(d, 0.5)
    return lax.linalg.tridiagonal_solve(off.at[..., 0].set(0), d, off.at[..., -1].set(0), b)


_Maker = Callable[[np.random.Generator], np.ndarray]
# name: (fn, [(input maker, placements on dp x tp)])
_WINDOW_PROGRAMS: dict[str, tuple[Callable[..., Any], list[tuple[_Maker, str]]]] = {
    "max_pool value_and_grad": (jax.value_and_grad(lambda x: jnp.sum(_max_pool(x) ** 2)),
                                [(lambda rng: rng.standard_normal((4, 8, 8, 8)), "S(0),S(3)")]),
    "avg_pool value_and_grad": (jax.value_and_grad(lambda x: jnp.sum(_avg_pool(x) ** 2)),
                                [(lambda rng: rng.standard_normal((4, 8, 8, 8)), "S(0),S(3)")]),
    "max_pool of a P(max)": (_max_pool, [(lambda rng: rng.standard_normal((4, 8, 8, 8)), "P(max),S(3)")]),
    "avg_pool of a P(sum)": (_avg_pool, [(lambda rng: rng.standard_normal((4, 8, 8, 8)), "P,S(0)")]),
    "fft conv value_and_grad": (
        jax.value_and_grad(lambda x, k: jnp.sum(_fft_conv(x, k) ** 2), argnums=(0, 1)),
        [(lambda rng: rng.standard_normal((4, 8, 16)), "S(0),S(1)"),
         (lambda rng: rng.standard_normal((8, 16)), "R,S(0)")],
    ),
    "irfft(rfft) of a P(sum)": (lambda x: jnp.fft.irfft(jnp.fft.rfft(x)),
                                [(lambda rng: rng.standard_normal((4, 8, 16)), "P,S(1)")]),
    "preconditioners": (_preconditioners, [(lambda rng: rng.standard_normal((8, 6, 6)), "R,S(0)")]),
    "solve_triangular of a P(sum)": (
        lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True),
        [(_spd_blocks, "S(0),R"), (lambda rng: rng.standard_normal((8, 4, 8)), "S(0),P")],
    ),
    "approx_max_k": (lambda x: lax.approx_max_k(x, 2), [(lambda rng: rng.standard_normal((8, 32)), "S(0),R")]),
    "tridiagonal_solve value_and_grad": (
        jax.value_and_grad(lambda d, b: jnp.sum(_tridiagonal(d, b) ** 2), argnums=(0, 1)),
        [(lambda rng: 2 + rng.random((8, 6)), "S(0),R"), (lambda rng: rng.standard_normal((8, 6, 16)), "S(0),R")],
    ),
    "tridiagonal_solve of split columns and a P(sum)": (
        lambda d, b, c: (_tridiagonal(d, b), _tridiagonal(d, c)),
        [(lambda rng: 2 + rng.random((8, 6)), "R,R"), (lambda rng: rng.standard_normal((8, 6, 16)), "R,S(2)"),
         (lambda rng: rng.standard_normal((8, 6, 16)), "S(0),P")],
    ),
    "solve, inv and solve's gradient": (  # custom_linear_solve, walked as its LU solve
        lambda a, b: (jnp.linalg.solve(a, b), jnp.linalg.inv(a),
                      jax.grad(lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2), argnums=(0, 1))(a, b)),
        [(_spd_blocks, "R,S(0)"), (lambda rng: rng.standard_normal((8, 4, 3)), "R,S(0)")],
    ),
}
# XLA's CPU backend fails to run its own SPMD partitioning of an FFT of a product of FFTs split over a dim the
# transform keeps (plain jax.jit on dp,tp-sharded inputs too: "RET_CHECK failure (fft_thunk.cc:168)
# LayoutUtil::IsMonotonicWithDim0Major"); the pinned program runs FFTs per rank (operators._PER_RANK), as "ops" does
_XLA_FAILS = {"fft conv value_and_grad"}


@pytest.mark.parametrize("name", sorted(_WINDOW_PROGRAMS))
def test_pooling_fft_linalg_and_approx_top_k_run_as_plain_jax(mesh: Any, name: str) -> None:
    """Every executor of apply on dp=2 x tp=4 gives plain jax.jit's values, for split,
    replicated and partial inputs: the batch and channels stay split through pooling and
    its gradient, the batch through FFTs and decompositions, partials pass where the op
    is linear (or max through max-pooling)."""
    fn, makers = _WINDOW_PROGRAMS[name]
    rng = np.random.default_rng(0)
    values = [np.asarray(make(rng), np.float32) for make, _ in makers]
    tensors = [distribute_tensor(v, mesh, p) for v, (_, p) in zip(values, makers)]
    want = jax.tree.leaves(jax.jit(fn)(*values))
    for execute in ("pinned", "ops") if name in _XLA_FAILS else ("xla", "pinned", "ops"):
        got = jax.tree.leaves(apply(fn, *tensors, execute=execute), is_leaf=lambda v: isinstance(v, DTensor))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=2e-4, atol=2e-4,
                                       err_msg=f"{name} {execute}")


def test_pooling_fft_linalg_and_approx_top_k_check_against_xla(mesh: Any) -> None:
    """``check`` on the programs above without partial inputs (XLA has no sharding for
    them): every output's layout is XLA's, or XLA reduced a partial the prediction left
    (the losses), or (the FFT convolution's filter gradient) a free output the
    prediction reduce-scatters where XLA all-reduces; the prediction never sends more.
    Measured: the pooling gradients 10 B (the losses' all-reduce) as XLA; the
    preconditioners, approx_max_k, and ``jnp.linalg.solve`` / ``inv`` with solve's
    gradient (custom_linear_solve, walked as its LU solve) nothing, as XLA; tridiagonal_solve's
    gradient on the batch split 4 B (the loss's all-reduce over dp) as XLA; the FFT
    convolution's gradient 346 B against XLA's 16,650 B (which all-gathers the FFTs'
    inputs ten times)."""
    figures = {}
    for name, (fn, makers) in _WINDOW_PROGRAMS.items():
        if any("P" in placements for _, placements in makers):
            continue
        rng = np.random.default_rng(0)
        tensors = [distribute_tensor(np.asarray(make(rng), np.float32), mesh, p) for make, p in makers]
        report = check(fn, *tensors)
        verdicts = [o.verdict for o in report.outputs]
        if name == "fft conv value_and_grad":  # the loss, x's gradient, the filter's (reduce-scattered over dp)
            assert verdicts == ["xla reduced partial", "equal", "differs"]
        else:
            assert set(verdicts) <= {"equal", "xla reduced partial"}, (name, verdicts)
        figures[name] = (report.predicted_bytes, report.compiled_bytes)
    assert figures == {
        "max_pool value_and_grad": (10, 10), "avg_pool value_and_grad": (10, 10),
        "fft conv value_and_grad": (346, 16650), "preconditioners": (0, 0), "approx_max_k": (0, 0),
        "solve, inv and solve's gradient": (0, 0), "tridiagonal_solve value_and_grad": (4, 4),
    }


@pytest.mark.parametrize(("diagonal", "rhs", "nbytes"), [
    ("R,R", "R,S(2)", 2304), ("S(0),R", "S(0),S(2)", 1152), ("R,R", "S(2),R", 1536),
])
def test_tridiagonal_solve_gathers_split_columns_as_xla(mesh: Any, diagonal: str, rhs: str, nbytes: int) -> None:
    """``tridiagonal_solve`` with the right-hand sides' columns split: XLA partitions the
    solver's custom call over its batch dims only, so it all-gathers the columns (over tp
    or dp: 2,304 / 1,536 B; 1,152 with the batch split over dp, which it keeps) and
    solves them on every device. The prediction does the same, not the cheaper all-to-all
    to a batch split XLA never makes (:data:`.rules.BATCH_PARTITIONED`): check equal on
    the layout and the bytes; every execute mode gives plain jit's values in the
    predicted layout."""
    rng = np.random.default_rng(0)
    d, b = (2 + rng.random((8, 6))).astype(np.float32), rng.standard_normal((8, 6, 16)).astype(np.float32)
    dd, db = distribute_tensor(d, mesh, diagonal), distribute_tensor(b, mesh, rhs)
    report = check(_tridiagonal, dd, db)
    (out,) = report.outputs
    assert (str(out.predicted), out.verdict) == (diagonal, "equal"), report
    assert report.communication == "equal" and report.predicted_bytes == report.compiled_bytes == nbytes
    assert report.compiled_counts == {"all-gather": 1}
    want = np.asarray(jax.jit(_tridiagonal)(d, b))
    for execute in ("xla", "ops", "pinned", "auto"):
        got = apply(_tridiagonal, dd, db, execute=execute)
        assert str(got.layout) == diagonal, execute
        np.testing.assert_allclose(np.asarray(got.full_tensor()), want, rtol=1e-5, atol=1e-6, err_msg=execute)


def _lu_check(a: jax.Array) -> tuple[jax.Array, ...]:
    lu, _, permutation = lax.linalg.lu(a)
    return lu, permutation


def _householder_q(a: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """NumPy's product of the Householder reflectors ``I - tau v v^T`` stored below the
    diagonal of each matrix of ``a`` (LAPACK's ``geqrf`` form), one per ``taus`` entry."""
    m = a.shape[-2]
    q = np.broadcast_to(np.eye(m), (*a.shape[:-2], m, m)).copy()
    for i in range(taus.shape[-1]):
        v = np.concatenate([np.zeros((*a.shape[:-2], i)), np.ones((*a.shape[:-2], 1)), a[..., i + 1 :, i]], axis=-1)
        q = q - (q @ v[..., :, None]) * (taus[..., i, None, None] * v[..., None, :])
    return q


def _tridiagonal_matrix(d: np.ndarray, e: np.ndarray) -> np.ndarray:
    """The symmetric tridiagonal matrices of diagonals ``d`` and off-diagonals ``e``."""
    n = np.arange(d.shape[-1])
    t = np.zeros((*d.shape, d.shape[-1]))
    t[..., n, n] = d
    t[..., n[:-1], n[1:]] = t[..., n[1:], n[:-1]] = e
    return t


def _hessenberg_facts(ins: list[np.ndarray], outs: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``q h q^T = a`` with ``h`` upper Hessenberg: ``q`` is 1 then the reflectors stored
    below the subdiagonal (rows 1.., one per ``taus`` entry)."""
    packed, taus = outs
    q = np.zeros_like(packed)
    q[:, 0, 0] = 1
    q[:, 1:, 1:] = _householder_q(packed[:, 1:, :-1], taus)
    return [q @ np.triu(packed, -1) @ q.transpose(0, 2, 1)], [ins[0]]


# name: (fn, inputs' makers (the first and the 3-d ones split as the test says, the others R,R),
#        what fn's outputs must satisfy as (facts of the outputs, NumPy's values of them))
_LinalgFacts = Callable[[list[np.ndarray], list[np.ndarray]], tuple[list[np.ndarray], list[np.ndarray]]]
_LINALG: dict[str, tuple[Callable[..., Any], list[_Maker], _LinalgFacts]] = {
    "cholesky": (lambda a: lax.linalg.cholesky(a, symmetrize_input=False), [_spd_8x8],
                 lambda ins, outs: (outs, [np.linalg.cholesky(ins[0])])),
    "eigh": (lambda a: lax.linalg.eigh(a, symmetrize_input=False), [_spd_8x8],  # a v = v w
             lambda ins, outs: ([outs[0] * outs[1][:, None, :], outs[1]], [ins[0] @ outs[0], np.linalg.eigvalsh(ins[0])])),
    "svd": (lambda a: lax.linalg.svd(a, full_matrices=False), [_normal_8x8],  # u s vt = a
            lambda ins, outs: ([outs[1], (outs[0] * outs[1][:, None, :]) @ outs[2]],
                               [np.linalg.svd(ins[0], compute_uv=False), ins[0]])),
    "qr": (lambda a: lax.linalg.qr(a, full_matrices=False), [_normal_8x8],  # q r = a, r upper
           lambda ins, outs: ([outs[1], outs[0] @ outs[1]], [np.triu(outs[1]), ins[0]])),
    "lu": (_lu_check, [_normal_8x8],  # l u = the rows of a permuted
           lambda ins, outs: ([(np.tril(outs[0], -1) + np.eye(8)) @ np.triu(outs[0])],
                              [np.take_along_axis(ins[0], outs[1][:, :, None].astype(int), axis=1)])),
    "triangular_solve": (lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
                         [_spd_8x8, _normal_8x8], lambda ins, outs: (outs, [np.linalg.solve(np.tril(ins[0]), ins[1])])),
    "triangular_solve right": (
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, lower=True),
        [_spd_8x8, _normal_8x8],
        lambda ins, outs: ([outs[0] @ np.tril(ins[0])], [ins[1]]),  # x a = b
    ),
    "eig": (lambda a: lax.linalg.eig(a, compute_left_eigenvectors=False), [_normal_8x8],  # a v = v w
            lambda ins, outs: ([outs[1] * outs[0][:, None, :], np.sort(outs[0])],
                               [ins[0] @ outs[1], np.sort(np.linalg.eigvals(ins[0]))])),
    "schur": (lax.linalg.schur, [_normal_8x8],  # z t z^T = a, t quasi-upper-triangular
              lambda ins, outs: ([outs[1] @ outs[0] @ outs[1].transpose(0, 2, 1), np.tril(outs[0], -2)],
                                 [ins[0], np.zeros_like(ins[0])])),
    "hessenberg": (lax.linalg.hessenberg, [_normal_8x8], _hessenberg_facts),
    "tridiagonal": (lax.linalg.tridiagonal, [_spd_8x8],  # the same eigenvalues
                    lambda ins, outs: ([np.linalg.eigvalsh(_tridiagonal_matrix(outs[1], outs[2]))],
                                       [np.linalg.eigvalsh(ins[0])])),
    "ormqr": (lambda a, taus, c: lax.linalg.ormqr(a, taus, c, left=True, transpose=False),
              [_normal_8x8, lambda rng: rng.random((8, 8)).astype(np.float32), _normal_8x8],
              lambda ins, outs: (outs, [_householder_q(ins[0], ins[1]) @ ins[2]])),
}


@pytest.mark.parametrize("name", sorted(_LINALG))
@pytest.mark.parametrize("placements", ["R,S(1)", "S(1),R", "S(0),S(2)"])
def test_linalg_gathers_split_matrix_dims_as_xla(mesh: Any, name: str, placements: str) -> None:
    """The LAPACK calls (cholesky, eigh, svd, qr, lu, triangular_solve, and the CPU-only
    eig, schur, hessenberg, tridiagonal, ormqr) of (8, 8, 8) matrices with a matrix dim
    split (over tp, over dp, or over tp with the batch over dp): XLA partitions the
    solver over its batch dims only, so it all-gathers the split matrix dims (1,536 /
    1,024 / 768 B per split operand) and keeps the batch split; the prediction does the
    same (:data:`.rules.BATCH_PARTITIONED`), not an all-to-all to a batch split XLA never
    makes (before: every case ``differs``, 1,984-4,000 B priced against XLA's 1,536; eig
    to ormqr had no rule): check equal on every output, its bytes and collectives; every
    execute mode gives values NumPy agrees with, in the predicted layout."""
    fn, makers, facts = _LINALG[name]
    rng = np.random.default_rng(0)
    values = [make(rng) for make in makers]
    tensors = [distribute_tensor(v, mesh, placements if v.ndim == 3 else "R,R") for v in values]
    split = sum(v.ndim == 3 for v in values)
    report = check(fn, *tensors)
    assert [o.verdict for o in report.outputs] == ["equal"] * len(report.outputs), report
    per_operand = {"R,S(1)": 1536, "S(1),R": 1024, "S(0),S(2)": 768}[placements]
    assert report.predicted_bytes == report.compiled_bytes == per_operand * split
    assert report.predicted_counts == report.compiled_counts == {"all-gather": split}
    kept = "S(0),R" if placements.startswith("S(0)") else "R,R"
    ins = [v.astype(np.float64) for v in values]
    for execute in ("xla", "ops", "pinned"):
        results = jax.tree.leaves(apply(fn, *tensors, execute=execute), is_leaf=lambda v: isinstance(v, DTensor))
        assert [str(o.layout) for o in results] == [kept] * len(results), execute
        outs = [np.asarray(o.full_tensor()).astype(np.complex128 if o.dtype.kind == "c" else np.float64)
                for o in results]
        got, want = facts(ins, outs)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"{name} {execute}")


# jnp.linalg's symmetrizing decompositions: fn, what its outputs must satisfy as (facts of them, NumPy's values)
_SYMMETRIZED: dict[str, tuple[Callable[..., Any], _LinalgFacts]] = {
    "cholesky": (jnp.linalg.cholesky, lambda ins, outs: ([outs[0] @ np.swapaxes(outs[0], -1, -2)], ins)),  # l l^T = a
    "eigh": (jnp.linalg.eigh, lambda ins, outs: ([outs[1] * outs[0][..., None, :], outs[0]],  # a v = v w
                                                  [ins[0] @ outs[1], np.linalg.eigvalsh(ins[0])])),
    "eigvalsh": (jnp.linalg.eigvalsh, lambda ins, outs: (outs, [np.linalg.eigvalsh(ins[0])])),
}


@pytest.mark.parametrize("name", sorted(_SYMMETRIZED))
@pytest.mark.parametrize(("shape", "placements", "nbytes"), [
    ((4, 16, 16), "R,S(1)", (3840, 3840)), ((4, 16, 16), "R,S(2)", (3840, 3840)),
    ((4, 16, 16), "S(1),R", (2048, 3072)), ((16, 16), "S(1),R", (512, 768)), ((16, 16), "R,S(0)", (960, 960)),
])
def test_symmetrized_decompositions_split_no_idle_mesh_dim(
    mesh: Any, name: str, shape: tuple[int, ...], placements: str, nbytes: tuple[int, int],
) -> None:
    """``jnp.linalg.cholesky`` / ``eigh`` / ``eigvalsh`` symmetrize first, ``(a + a.mT) /
    2``, outside the LAPACK call. With only a matrix dim split, over one mesh dim, the
    other is split by no input, and XLA's propagation, which spreads only the shardings it
    is given, splits nothing over it: it all-to-alls the transpose over the split's mesh
    dim and gathers the sum for the solver, the results Replicate. The prediction
    splits nothing over such an idle mesh dim either (jaxpr._idle_mesh_dims); before,
    the sum was sliced over it on its batch dim for free, halving the all-to-all and the
    gather, and the results came out split there: check said ``differs`` (S(0),R where
    XLA's R,R, 3,968 B as converted against XLA's 3,840 for (4, 16, 16) R,S(1)). Over dp
    the prediction gathers the input once, first (2,048 / 512 B, where XLA all-to-alls
    and gathers: 3,072 / 768), and apply(execute="pinned") compiles that plan; every
    execute mode gives values NumPy agrees with, in the predicted layout."""
    fn, facts = _SYMMETRIZED[name]
    a = _spd(np.random.default_rng(0), (int(np.prod(shape[:-2])), shape[-1])).reshape(shape)
    tensor = distribute_tensor(a, mesh, placements)
    report = check(fn, tensor)
    assert [(str(o.predicted), o.verdict) for o in report.outputs] == [("R,R", "equal")] * len(report.outputs), report
    assert (report.predicted_bytes, report.compiled_bytes) == nbytes
    idle = next(m for m, p in enumerate(placements.split(",")) if p == "R")
    assert all(x.layout.mesh_dim_split(idle) is None for e in predict(fn, tensor).equations
               for x in (*e.inputs, *e.outputs))
    pinned = jax.jit(lambda x: apply(fn, x, execute="pinned"))
    assert sum(collective_nbytes(c, 8) for c in compiled_collectives(pinned, tensor)) == nbytes[0]
    for execute in ("xla", "ops", "pinned"):
        results = jax.tree.leaves(apply(fn, tensor, execute=execute), is_leaf=lambda v: isinstance(v, DTensor))
        assert [str(o.layout) for o in results] == ["R,R"] * len(results), execute
        got, want = facts([a.astype(np.float64)], [np.asarray(o.full_tensor()).astype(np.float64) for o in results])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3, err_msg=f"{name} {execute}")


def _symmetric_product(a: jax.Array, c: jax.Array) -> jax.Array:
    return lax.linalg.symmetric_product(a, c, alpha=2.0, beta=0.5)


@pytest.mark.parametrize(
    "placements, verdict, bytes_",
    [
        (("R,R", "R,R"), "equal", (0, 0)),
        (("R,S(0)", "R,S(0)"), "equal", (0, 0)),  # the batch split over tp
        (("R,S(0)", "R,R"), "equal", (0, 0)),  # c sliced to a's batch split, for free
        (("S(0),S(0)", "S(0),S(0)"), "equal", (0, 0)),  # the batch split over dp and tp
        # a's contracted dim split: XLA all-reduces the product (3,072 B), the search moves the split to the batch
        # (an all-to-all and the output gathered back, 2,304 B: fewer bytes in more collectives; no longer also
        # sliced over dp, which no input splits over: 2,176 B until stop 38)
        (("R,S(2)", "R,R"), "differs", (2304, 3072)),
        # c's rows split: XLA computes each rank's rows of a a^T, nothing sent; no 1-D signature says it (a's rows are
        # both sides of the product): the search moves c's split to the batch (640 B sliced over dp too until stop 38)
        (("R,R", "R,S(1)"), "differs", (768, 0)),
    ],
)
def test_symmetric_product_splits_its_batch_and_contraction(
    mesh: Any, placements: tuple[str, str], verdict: str, bytes_: tuple[int, int]
) -> None:
    """``lax.linalg.symmetric_product`` (``alpha a a^T + beta c``; UnsupportedOpError until
    stop 37): CPU XLA lowers it as a batched matmul and an add, so batch splits stay, as
    predicted (check equal, nothing sent); a split matrix dim XLA partitions as a matmul
    (rules.symmetric_product's docstring), where the prediction differs as measured here.
    Every execute mode gives NumPy's values in the predicted layout."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 8, 16)).astype(np.float32)
    c = rng.standard_normal((8, 8, 8)).astype(np.float32)
    c = c + c.transpose(0, 2, 1)
    tensors = [distribute_tensor(v, mesh, p) for v, p in zip((a, c), placements)]
    report = check(_symmetric_product, *tensors)
    assert [o.verdict for o in report.outputs] == [verdict], report
    assert (report.predicted_bytes, report.compiled_bytes) == bytes_
    want = 2 * a.astype(np.float64) @ a.transpose(0, 2, 1) + 0.5 * c
    for execute in ("xla", "ops", "pinned"):
        out = apply(_symmetric_product, *tensors, execute=execute)
        assert out.layout == report.outputs[0].predicted, execute
        np.testing.assert_allclose(np.asarray(out.full_tensor()), want, rtol=1e-5, atol=1e-4, err_msg=execute)


@pytest.mark.parametrize("placements", [("R,R", "R,R"), ("R,S(0)", "R,R"), ("R,S(1)", "R,S(0)"), ("S(0),S(1)", "R,R")])
def test_cholesky_update_runs_replicated(mesh: Any, placements: tuple[str, str]) -> None:
    """``lax.linalg.cholesky_update`` (a rank-1 update of an (n, n) Cholesky factor;
    UnsupportedOpError until stop 37) has no batch dims and its Givens rotations read
    ``r[k, k]`` and ``w[k]`` at every step: Replicate only, a split input gathered first
    (check equal when nothing is split; XLA keeps a split with an all-reduce and
    collective-permutes per step: 20-43 collectives, 322-880 B, where the prediction
    gathers, 192-224 B). Every execute mode gives NumPy's factor of ``a + w w^T``."""
    rng = np.random.default_rng(0)
    m = rng.standard_normal((8, 8))
    a = m @ m.T + 8 * np.eye(8)
    w = rng.standard_normal(8)
    r = distribute_tensor(np.linalg.cholesky(a).T.astype(np.float32), mesh, placements[0])
    v = distribute_tensor(w.astype(np.float32), mesh, placements[1])
    report = check(lax.linalg.cholesky_update, r, v)
    assert str(report.outputs[0].predicted) == "R,R"
    if placements == ("R,R", "R,R"):
        assert report.outputs[0].verdict == "equal" and not report.compiled_collectives
    else:
        assert set(report.predicted_counts) == {"all-gather"} and report.predicted_bytes < report.compiled_bytes
    want = np.linalg.cholesky(a + np.outer(w, w)).T
    for execute in ("xla", "ops", "pinned"):
        out = apply(lax.linalg.cholesky_update, r, v, execute=execute)
        assert str(out.layout) == "R,R", execute
        np.testing.assert_allclose(np.asarray(out.full_tensor()), want, rtol=1e-5, atol=1e-5, err_msg=execute)


def _cnn_loss(p: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    """conv 3x3 (NHWC) + bias + relu, 2x2 max-pool, flatten, dense, cross-entropy."""
    h = lax.conv_general_dilated(x, p["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = _max_pool(jax.nn.relu(h + p["bias"]))
    logits = h.reshape(h.shape[0], -1) @ p["dense"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1))


def test_a_cnn_train_step_split_over_the_batch(mesh: Any) -> None:
    """A small CNN's adamw step, the batch split over dp, the parameters replicated:
    the convolution, the max-pool and its gradient (select_and_scatter_add) keep the
    batch split; the only collective is the gradients' all-reduce over dp, 12,036 B as
    XLA's own (predicted 12,032 B before the check's output reduction); every executor
    gives plain jax.jit's step. A batch of 32: of 8, gathering the batch and the dense
    layer's input (3,088 B) costs less than the all-reduce, and the search finds that
    plan, as it does on a (2,) mesh, since tp (split by no input: idle,
    jaxpr._idle_mesh_dims) no longer offers free slices (until stop 38 they kept it at
    XLA's all-reduce)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    plain = {"conv": jax.random.normal(k1, (3, 3, 3, 16)) / 5, "bias": jnp.zeros(16),
             "dense": jax.random.normal(k2, (4 * 4 * 16, 10)) / 16}
    params = distribute_pytree(plain, mesh, {"conv": "R,R", "bias": "R,R", "dense": "R,R"})
    optimizer = optax.adamw(1e-2)
    state = optimizer.init(params)
    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal((32, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int32)
    x, y = distribute_tensor(xs, mesh, "S(0),R"), distribute_tensor(ys, mesh, "S(0),R")

    def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(_cnn_loss)(p, x, y)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    out_layouts = (params, state, None)
    prediction = predict(step, params, state, x, y, out_layouts=out_layouts)
    pools = [row for row in prediction.equations if row.primitive in ("reduce_window_max", "select_and_scatter_add")]
    assert [str(row.outputs[0].layout) for row in pools] == ["S(0),R", "S(0),R"] and all(r.cost == 0 for r in pools)
    assert (prediction.nbytes, dict(prediction.combined_counts)) == (12032, {"all-reduce": 1})
    report = check(step, params, state, x, y, out_layouts=out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert (report.predicted_bytes, report.compiled_bytes) == (12036, 12036)
    assert report.predicted_combined_counts == report.compiled_counts == Counter({"all-reduce": 1})
    want_params, _, want_loss = jax.jit(step)(plain, optimizer.init(plain), xs, ys)
    for execute in ("xla", "pinned", "ops"):
        run = partial(apply, step, out_layouts=out_layouts, execute=execute)
        new_params, _, loss = run(params, state, x, y) if execute == "ops" else jax.jit(run)(params, state, x, y)
        assert float(loss.full_tensor()) == pytest.approx(float(want_loss), rel=1e-5), execute
        for name in plain:
            assert new_params[name].layout == params[name].layout
            np.testing.assert_allclose(np.asarray(new_params[name].full_tensor()), np.asarray(want_params[name]),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{execute} {name}")


def test_pinned_runs_ffts_of_an_uneven_split_per_rank(mesh: Any) -> None:
    """``irfft(rfft(x))`` of a batch split unevenly (3 over dp, 5 over tp): plain jax.jit
    on those shardings runs, the pinned plan (pads, then the FFT on the padded array) hit
    XLA's CPU FFT layout check ("RET_CHECK failure (fft_thunk.cc:168)") until FFTs ran per
    rank in it (operators._PER_RANK); every executor now gives jax.jit's values."""
    x = np.random.default_rng(1).standard_normal((3, 5, 16)).astype(np.float32)

    def fn(a: jax.Array) -> jax.Array:
        return jnp.fft.irfft(jnp.fft.rfft(a))

    tensor = distribute_tensor(x, mesh, "S(0),S(1)")
    for execute in ("xla", "pinned", "ops"):
        got = apply(fn, tensor, execute=execute)
        assert str(got.layout) == "S(0),S(1)"
        np.testing.assert_allclose(np.asarray(got.full_tensor()), np.asarray(jax.jit(fn)(x)), rtol=1e-5, atol=1e-5)
