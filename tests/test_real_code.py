"""predict, check and apply on training steps written as public JAX code writes them
(issue 15, "inference on real training code"), Megatron / expert-parallel plans on
dp=2 x tp=4: Llama (GQA + RoPE) under ``lax.scan`` over stacked layers, in bfloat16 with
``jax.nn.dot_product_attention``; a Gemma-2 class decoder (soft-capped attention and
logits, alternating sliding-window layers, GeGLU, tied vocabulary-split embeddings,
label smoothing and a z-loss); a top-2
mixture of experts (one_hot / einsum dispatch, sort / gather / scatter-add dispatch,
MaxText's dropless ``lax.ragged_dot`` with SwiGLU experts, and expert parallelism written
as a ``shard_map`` region with ``lax.all_to_all`` dispatch); the stacked LM of tests/models/stacked.py under optax's gradient accumulation
(``optax.MultiSteps``, a ``lax.cond``), a warmup-cosine schedule through
``optax.inject_hyperparams`` and global-norm clipping; Equinox layers made by
``eqx.filter_vmap`` under ``lax.scan``; Flax NNX layers made by ``nnx.vmap`` under
``nnx.scan`` + ``nnx.remat`` with the stateful ``nnx.Optimizer`` step; the stacked LM
under ten other optax optimizers (adafactor, lamb, sm3, muon, schedule-free adamw ...); a
small CNN (tests/models/cnn.py) with its convs' output channels over tp, flattened into a
strided shard for a replicated dense layer; LoRA fine-tuning of Llama (tests/models/lora.py:
lorax's ``LoraWeight`` adapters on wq and wv in the one parameter tree, the base frozen by
``optax.multi_transform`` with ``optax.set_to_zero``); a CLIP-style two-tower contrastive
step (tests/models/clip.py: a conv-patch ViT and a causal text transformer, the whole
batch's image-text logits, a symmetric cross-entropy); DPO preference tuning of Llama
(tests/models/dpo.py: a policy and a frozen reference under ``stop_gradient``, chosen and
rejected sequences concatenated into one batch, masked per-sequence log-probs); a T5-style
encoder-decoder (tests/models/t5.py: relative position biases looked up from bucketed
distances, cross-attention, a tied head, a z-loss); Llama's
step with its parameters and Adam moments fully sharded over dp on top of the Megatron plan
(ZeRO-3 x tensor parallelism: tests/models/steps.py ``fully_sharded``); and
beside the training steps, sampling from Llama with a key/value cache under
``lax.fori_loop``, alone and after prefilling a prompt (tests/models/decode.py).

Each: check's output layouts agree with XLA's; apply (execute="xla" and "pinned") under
``jax.jit`` computes what plain ``jax.jit`` of the unsharded step computes, keeping the
parameters' and state's layouts; execute="xla" sends no more than plain ``jax.jit`` on
the same shardings. The bytes predicted against XLA's are measured, asserted here only
where a program records them (``Program.communication``): docs/inference.md section 6
tabulates them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from models import common, decode, eqx_scan, explicit_lm, llama, nnx_scan, shampoo
from models.steps import fully_sharded, training_step

from placements2jax import DTensor, apply, distribute_pytree, distribute_tensor, init_device_mesh
from placements2jax.dtensor import auto_twin_of
from placements2jax.hlo import parse_collectives
from placements2jax.inference import CostModel, check, predict
from placements2jax.inference.cost import COMMUNICATING, DEFAULT_COLLECTIVE_OVERHEAD, overhead_of
from placements2jax.inference.frameworks import variables_of


class Program(NamedTuple):
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    out_layouts: Any
    atol: float  # the updated parameters' tolerance against the unsharded step (see _assert_close)
    # measured where given: (collectives predicted after XLA's combiner, XLA's; bytes per device predicted, XLA's)
    communication: tuple[int, int, int, int] | None = None


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


def _dict_step(model: str, mesh: Any, optimizer: optax.GradientTransformation | None = None, **config: Any) -> tuple:
    """tests/models ``model``'s step on its plan: (fn, args, out_layouts) keeping parameters and state."""
    step = training_step(model, mesh, optimizer, **config)
    return step.program


def _fsdp_step(model: str, mesh: Any, **config: Any) -> tuple:
    """``_dict_step``'s step with its parameters and optimizer state fully sharded over dp on top of the plan."""
    step = fully_sharded(training_step(model, mesh, **config))
    return step.program


def _eqx_step(mesh: Any) -> tuple:
    cfg = eqx_scan.Config()
    model = eqx_scan.LM(cfg, jax.random.key(0))
    params = distribute_pytree(model, mesh, eqx_scan.megatron_plan())
    arrays = eqx.filter(params, eqx.is_array)
    state = common.distribute_state(eqx_scan.make_optimizer().init(eqx.filter(model, eqx.is_array)), arrays)
    return eqx_scan.train_step, (params, state, *common.megatron_batch(cfg, mesh)), (params, state, None)


# Adam's step m / (sqrt(v) + eps) of a near-zero gradient magnifies the rounding of a sharded sum (the reference
# is unsharded): float32 parameters within a tenth of a step (lr 1e-3; measured up to 5.8e-5, Llama's in float32);
# bfloat16 compute rounds the loss and gradients at 2^-8 (measured up to 2.0e-3 on the parameters). Llama in
# float32 with einsum attention runs the same way (docs/inference.md section 6) but is left out: one 2-layer
# Llama step here costs ~30 s of the CI's time
_F32, _BF16 = 1e-4, 5e-3
PROGRAMS: dict[str, Callable[[Any], Program]] = {
    "llama scan bf16 dot_product_attention": lambda mesh: Program(*_dict_step(
        "llama_scan", mesh, layers=1, attention="dot_product_attention", dtype="bfloat16"), _BF16),
    "gemma soft-capped, sliding window, tied embeddings": lambda mesh: Program(*_dict_step("gemma", mesh), _F32),
    "moe einsum dispatch": lambda mesh: Program(*_dict_step("moe", mesh), _F32),
    "moe sort dispatch": lambda mesh: Program(*_dict_step("moe", mesh, dispatch="sort"), _F32),
    "moe ragged_dot dispatch": lambda mesh: Program(*_dict_step("moe", mesh, dispatch="ragged"), _F32),
    # expert parallelism written as a shard_map region (capacity dispatch, two all_to_alls over tp, pmeans of the
    # routing statistics; its gradient region: the all_to_alls' transposes and the replicated router's and the
    # experts' weight gradients psum'd over dp and tp / dp): 14 collectives, 40,392 B against XLA's 13, 51,246 B
    # (0.79x). The regions' 9 collectives (23,480 B) are predicted from their bodies, XLA's all-to-alls byte for
    # byte; XLA then gathers the activations once where the prediction gathers them twice, and all-reduces the
    # embedding's gradient over tp (12,288 B) where the prediction reduce-scatters the region's input over tp. Before
    # the regions were read (stop 54) it predicted 16,912 B (0.33x)
    "moe expert-parallel shard_map": lambda mesh: Program(
        *_dict_step("moe", mesh, dispatch="shard_map"), _F32, (14, 13, 40_392, 51_246)),
    "stacked MultiSteps schedule": lambda mesh: Program(
        *_dict_step("stacked", mesh, common.accumulating_optimizer()), _F32),
    "eqx scan": lambda mesh: Program(*_eqx_step(mesh), _F32),
    # 14 collectives, 34,224 B against XLA's 26, 54,012 B (0.63x): XLA computes the RMSNorms on the residual stream
    # split over tp as the embedding gives it (an all-reduce of the row sums each, forward and backward) and gathers
    # it for the matmuls (5 all-gathers of the activations, 3,072 B each, to the prediction's 2), and forms the
    # adapters' A gradients split over tp, gathered in 6 all-gathers of 768 B (the prediction's 2)
    "lora llama": lambda mesh: Program(*_dict_step("lora", mesh), _F32, (14, 26, 34_224, 54_012)),
    # 14 collectives, 47,026 B against XLA's 116, 84,052 B (0.56x): XLA splits the adamw update of every replicated
    # parameter over tp and gathers it and both moments back (63 all-gathers, 51 of them the 17 f32[32] norms,
    # row-parallel biases and [CLS] token), which CPU XLA's combiner never merges. Before stop 60's polish
    # (program._polished: three equations re-chosen alone) 16 collectives, 45,938 B: two all-gathers more, the
    # default model's objective after the combiner 105,010 where 89,714
    "clip contrastive two towers": lambda mesh: Program(*_dict_step("clip", mesh), _F32, (14, 116, 47_026, 84_052)),
    # 25 collectives, 160,718 B against XLA's 53, 234,484 B (0.69x; 160,910 before stop 60's polish): XLA all-gathers
    # over tp 19 times to the prediction's 5 and all-reduces over tp in 21 collectives to its 11; the one batch of
    # chosen and rejected sequences (concatenated on the dp-split batch dim) is gathered over dp by the prediction (4
    # all-gathers, 160 B) where XLA permutes it (4 collective-permutes, 32 B)
    "dpo llama policy and reference": lambda mesh: Program(*_dict_step("dpo", mesh), _F32, (25, 53, 160_718, 234_484)),
    # Llama's parameters and Adam moments fully sharded over dp on top of the Megatron plan (one layer: two cost ~39 s
    # here), 28 collectives, 82,900 B against XLA's 56, 151,434 B (0.55x; before stop 60's polish 29, 81,364 B, one
    # all-to-all more, the default model's objective after the combiner 166,932 where 160,276): XLA gathers 9
    # parameters over dp and all-reduces their gradients over dp (one combined all-reduce, then slices), and moves the
    # activations between the batch and the model dim over dp (12 all-to-alls, 12 all-gathers); the prediction gathers
    # over dp only the embedding table, the targets and two activations and keeps the other parameters in place, the
    # batch replicated over dp and the dims FSDP split contracted there (dp as a second tensor-parallel axis: 11
    # all-reduces over dp, mostly of activations), their gradients made in the parameters' layouts (all but one
    # unreduced over dp). At 2 layers (the default): test_fsdp_two_layers_in_the_layer_trend
    # T5's encoder-decoder (relative position biases gathered from bucketed distances, cross-attention, z-loss), 18
    # collectives, 69,834 B against XLA's 57, 103,072 B (0.68x): XLA all-gathers over tp 32 times to the prediction's
    # 4 and all-reduces over tp in 24 collectives to its 13. Its step accumulating 2 microbatches under lax.scan
    # (microbatches=2) predicts ~8x slower (42 s cold where 5 s; XLA compiles either in ~8 s): left out here
    "t5 encoder-decoder, relative position biases": lambda mesh: Program(
        *_dict_step("t5", mesh), _F32, (18, 57, 69_834, 103_072)),
    "llama fsdp x tp": lambda mesh: Program(*_fsdp_step("llama", mesh, layers=1), _F32, (28, 56, 82_900, 151_434)),
}


def _assert_close(got: Any, want: Any, atol: float) -> None:
    """Every leaf of ``got`` (DTensors, eqx's static leaves) against ``want`` (plain)."""
    got_leaves, want_leaves = jax.tree.leaves(got, is_leaf=_is_dtensor), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if not _is_dtensor(g):
            assert g is w or g == w
            continue
        g, w = np.asarray(g.full_tensor(), np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=atol if g.ndim else max(atol, 1e-5))


def _one_device(tree: Any) -> Any:
    """The unsharded reference's arguments as fresh arrays on the default device, off the
    Explicit mesh ``full_tensor`` leaves them on: JAX 0.10 has no Explicit sharding rule
    for ``ragged_dot_general`` (it asks for an ``out_sharding``), which plain user code
    on one device never meets (a ``jax.device_put`` of the global array to one device
    still met it: its values go through the host). PRNG keys, which have no NumPy form,
    are kept as they are (GPT-2's dropout key, the sampling loop's)."""
    def fresh(x: Any) -> Any:
        if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        return jax.device_put(np.asarray(x))

    return jax.tree.map(fresh, tree)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_predict_check_apply(mesh: Any, name: str) -> None:
    """check agrees with XLA on every output's layout; apply (xla, pinned) computes the
    unsharded step's values in the predicted layouts (the parameters' and state's kept);
    execute="xla" sends no more than plain jax.jit of the step on the same shardings."""
    fn, args, out_layouts, atol, communication = PROGRAMS[name](mesh)
    report = check(fn, *args, out_layouts=out_layouts)
    assert report.outputs and all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs), report
    predicted = (len(report.predicted_combined), len(report.compiled_collectives))
    assert communication in (None, (*predicted, report.predicted_bytes, report.compiled_bytes)), report
    prediction = predict(fn, *args, out_layouts=out_layouts)
    assert prediction is report.prediction
    params_and_state = jax.tree.leaves(jax.tree.map(lambda x: x.layout, args[:2], is_leaf=_is_dtensor))
    assert list(prediction.out_layouts[:len(params_and_state)]) == params_and_state

    want = jax.block_until_ready(eqx.filter_jit(fn)(*_one_device(common.plain(args))))
    plain_count, plain_bytes = len(report.compiled_collectives), float(report.compiled_bytes)
    for execute in ("xla", "pinned"):
        ours = eqx.filter_jit(lambda *a, e=execute: apply(fn, *a, out_layouts=out_layouts, execute=e))
        compiled = ours.lower(*args).compile()
        count, nbytes = common.communication(parse_collectives(compiled.compiled.as_text()))
        if execute == "xla":
            assert count <= plain_count and nbytes <= plain_bytes, (count, plain_count, nbytes, plain_bytes)
        elif communication:  # the predicted collectives, less the loss's reduction to XLA's layout check counts
            assert count == predicted[0] and nbytes <= report.predicted_bytes, (count, nbytes, report)
        got = compiled(*args)
        dtensors = [x for x in jax.tree.leaves(got, is_leaf=_is_dtensor) if _is_dtensor(x)]
        jax.block_until_ready([x.to_jax() for x in dtensors])
        if execute == "pinned":
            assert [x.layout for x in dtensors] == list(prediction.out_layouts)
        _assert_close(got, want, atol)


def _on_auto_twin(x: DTensor) -> jax.Array:
    return jax.device_put(x.to_jax(), NamedSharding(auto_twin_of(x.device_mesh.to_jax()), x.to_jax().sharding.spec))


def test_nnx_scan_stateful_step(mesh: Any) -> None:
    """The ``@nnx.jit`` step of an LM whose layers nnx.vmap made and nnx.scan + nnx.remat
    run: check agrees with XLA on every updated Variable's layout (kept as it was);
    apply under jax.jit (xla and pinned) sends what it compiles, execute="xla" no more
    than plain jax.jit; eager apply writes into the caller's Variables the values of
    plain ``nnx.jit`` on the same shardings."""
    step = nnx.jit(nnx_scan.train_step)
    cfg = nnx_scan.Config()
    model, optimizer = distribute_pytree(nnx_scan.create(cfg), mesh, nnx_scan.megatron_plan())
    tokens, targets = common.megatron_batch(cfg, mesh)
    plain_model, plain_optimizer = jax.tree.map(_on_auto_twin, (model, optimizer), is_leaf=_is_dtensor)
    before = {path: v.get_value() for path, v in variables_of((model, optimizer)).items()}
    assert str(before["[0].blocks.up.kernel"].layout) == "R,S(2)"  # (layer, in, out): out split

    report = check(step, model, optimizer, tokens, targets)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs), report
    _, updated = jax.tree.unflatten(report.prediction.out_tree, report.prediction.out_layouts)
    assert updated.keys() == before.keys() and all(updated[p] == x.layout for p, x in before.items())
    for execute in ("xla", "pinned"):
        def jitted(*a: Any, e: str = execute) -> Any:
            return apply(step, *a, execute=e), a[:2]

        count, nbytes = common.communication(
            parse_collectives(jax.jit(jitted).lower(model, optimizer, tokens, targets).compile().as_text()))
        if execute == "xla":
            assert count <= len(report.compiled_collectives) and nbytes <= float(report.compiled_bytes)

    loss = apply(step, model, optimizer, tokens, targets)
    want = step(plain_model, plain_optimizer, _on_auto_twin(tokens), _on_auto_twin(targets))
    np.testing.assert_allclose(float(loss.full_tensor()), float(want), rtol=1e-6)
    plain = variables_of((plain_model, plain_optimizer))
    for path, v in variables_of((model, optimizer)).items():
        got = v.get_value()
        assert got is not before[path] and got.layout == before[path].layout, path
        np.testing.assert_allclose(np.asarray(got.full_tensor()), np.asarray(plain[path].get_value()),
                                   rtol=2e-5, atol=_F32, err_msg=path)


def test_eqx_scan_under_a_count_first_model_has_xlas_collectives(mesh: Any) -> None:
    """The Equinox scan step under the latency-bound model of docs/inference.md section 6
    (8,192 B per all-gather and all-to-all, the collectives CPU XLA's combiner never merges):
    its backward layer scan carries the activation gradient reduced over ``tp`` (all-reduced
    before the loop, as XLA does, where it was carried partial and all-reduced at each
    body's start and for the embedding's gradient after the loop): the norm's weight and
    bias gradients are all-reduced over ``tp`` with the carry at the body's end, one
    all-reduce, and the down projection's bias gradient, formed from the carry, is partial
    over ``dp`` only: 24,778 B in 8 collectives after XLA's combiner -> 24,586 B in 7, XLA's
    count (24,292 B; program.py's keeping cascades, ``_Search.keeps``)."""
    fn, args, out_layouts = _eqx_step(mesh)
    model = CostModel(collective_overhead={"all-gather": 8192, "all-to-all": 8192})
    report = check(fn, *args, out_layouts=out_layouts, cost_model=model)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs), report
    assert len(report.predicted_combined) <= len(report.compiled_collectives) == 7
    assert report.predicted_bytes <= 24_586


def test_fsdp_two_layers_in_the_layer_trend(mesh: Any) -> None:
    """Llama's FSDP x TP adamw step (PROGRAMS' "llama fsdp x tp") at two layers predicts no
    more bytes and collectives after XLA's combiner than the mean of one and three layers
    (81,354 B in 29 / 199,258 B in 58): 120,170 B in 43 (XLA's 268,120 in 90). The search
    had ended at 155,562 B in 69 (520,820 by the default model's objective where one / three
    layers cost 166,932 / 314,404), in the planner's result's basin, which moves the
    residual stream between the batch and the model dim over dp in every layer; the escape
    descent from the compiled descent it replaced leaves it (program.py's ``_escaped``,
    docs/inference.md section 6). Predict only (~8 s): check and apply at two layers cost
    ~40 s."""
    fn, args, out_layouts = _fsdp_step("llama", mesh, layers=2)
    prediction = predict(fn, *args, out_layouts=out_layouts)
    assert 2 * prediction.lowered_nbytes <= 81_354 + 199_258, prediction.lowered_nbytes
    assert 2 * sum(prediction.combined_counts.values()) <= 29 + 58, prediction.combined_counts


def test_gpt2_fsdp_backward_scan_reads_the_norm_scales_gathered(mesh: Any) -> None:
    """GPT-2's step (layers under ``lax.scan``) with its parameters fully sharded over dp
    on Megatron's plan: the forward layer scan gathers each layer's LayerNorm scales over
    dp (``f32[32]``, 128 B) and stacks them gathered for the backward scan, which then
    gathers none again (program.py's keeping pull moves, ``_common_descent``): 44 -> 42
    collectives after XLA's combiner, 21 -> 19 all-gathers over dp (XLA's 62 and 11),
    59,882 -> 59,754 B as compiled; 300,340 -> 283,828 by the latency-bound objective
    with the outputs' conversions (docs/inference.md section 6)."""
    fn, args, out_layouts = _fsdp_step("gpt2", mesh)
    prediction = predict(fn, *args, out_layouts=out_layouts)
    (forward, _), (backward, _) = prediction.loops
    gathers = [c for c in prediction.planned_collectives() if c.kind == "all-gather" and c.axes == ("dp",)]
    assert [c.result_bytes for c in gathers if c.scope == forward].count(128) == 7  # the scales and biases, per layer
    assert not [c for c in gathers if c.scope == backward and c.result_bytes == 128]
    combined = prediction.combined()
    assert sum(c.kind == "all-gather" and c.axes == ("dp",) for c in combined) <= 19
    assert len(combined) <= 42 and prediction.lowered_nbytes <= 59_754


def test_kv_cache_sampling_loop(mesh: Any) -> None:
    """Sampling with a key/value cache (tests/models/decode.py: a ``fori_loop`` over the
    new tokens carrying Llama's cache, ``dynamic_update_slice`` writes, categorical
    sampling), the cache's layouts kept, the sampled tokens free. The walk carries the
    token as its body's argmax returns it, split over ``tp`` by batch (the logits' cheapest
    move alone), and the search ended there in 21 collectives after XLA's combiner where
    XLA compiles 16; the restart from the carries as given (the token split over ``dp``)
    ends in 7 (jaxpr.py's ``_given_carries``), and with the sampled tokens then carried as
    its body returns them, split over ``dp`` (``_carried_as_returned``), in 6 (3,840 B).
    Since categorical's argmax is called as its two reductions (inference/simplify.py,
    stop 51), the vocabulary-split logits are no longer gathered for it: 3,480 B in 7
    (one all-gather of 512 B became the max's and the first index's all-reduces of the
    token, 8 B each; 12,824 by the search's objective where 20,992). check agrees with
    XLA on every output's layout (the sampled tokens ``S(0),R``); apply under jit (xla,
    pinned) samples plain jit's tokens, the cache as plain jit fills it, in its
    layouts."""
    cfg = llama.Config()
    args = decode.sampling_args(mesh, cfg)
    fn = partial(decode.generate, cfg=cfg)
    out_layouts = (None, args[1])
    report = check(fn, *args, out_layouts=out_layouts)
    assert all(o.verdict == "equal" for o in report.outputs), report
    assert len(report.predicted_combined) <= 7 < len(report.compiled_collectives) == 16, report
    assert report.predicted_bytes <= 3_480 < report.compiled_bytes, report
    cache_layouts = [x.layout for x in jax.tree.leaves(args[1], is_leaf=_is_dtensor)]
    assert list(report.prediction.out_layouts[1:]) == cache_layouts

    want = jax.jit(fn)(*_one_device(common.plain(args)))
    for execute in ("xla", "pinned"):
        sampled, cache = eqx.filter_jit(lambda *a, e=execute: apply(fn, *a, out_layouts=out_layouts, execute=e))(*args)
        np.testing.assert_array_equal(np.asarray(sampled.full_tensor()), np.asarray(want[0]))
        assert [x.layout for x in jax.tree.leaves(cache, is_leaf=_is_dtensor)] == cache_layouts
        _assert_close(cache, want[1], _F32)


def test_context_parallel_sampling_writes_the_cache_where_it_lies(mesh: Any) -> None:
    """The sampling loop of :func:`test_kv_cache_sampling_loop` with the cache split over
    its sequence on ``tp`` (context-parallel decoding: each rank holds a quarter of every
    sequence's keys and values). Each step's keys are written where the cache lies, the
    ranks holding the position writing them (the masked dynamic update), and attention
    reduces its softmax's statistics over ``tp``: 6,936 B in 19 collectives after XLA's
    combiner, where the cache was moved to a heads split and back every step before (9,624
    B, 8 all-to-alls); XLA compiles 8,940 in 24. Every output as XLA lays it out; the
    pinned program and "auto" (which runs it: a one-row update XLA drops past the end of
    a split dim, inference/xla_defects.py) sample plain jit's tokens and fill its cache."""
    cfg = llama.Config()
    params, cache, last, key = decode.sampling_args(mesh, cfg)
    cache = [tuple(distribute_tensor(np.asarray(c.full_tensor()), mesh, "S(0),S(1)") for c in layer) for layer in cache]
    args = (params, cache, last, key)
    fn = partial(decode.generate, cfg=cfg)
    out_layouts = (None, cache)
    report = check(fn, *args, out_layouts=out_layouts)
    assert all(o.verdict == "equal" for o in report.outputs), report
    assert report.predicted_bytes <= 6_936 < report.compiled_bytes, report
    assert len(report.predicted_combined) <= 19 < len(report.compiled_collectives), report
    assert not any(step.collective == "all-to-all" for step in report.prediction.steps), report  # the cache stays

    want = jax.jit(fn)(*_one_device(common.plain(args)))
    cache_layouts = [x.layout for x in jax.tree.leaves(cache, is_leaf=_is_dtensor)]
    for execute in ("pinned", "auto"):
        sampled, written = eqx.filter_jit(lambda *a, e=execute: apply(fn, *a, out_layouts=out_layouts, execute=e))(*args)
        np.testing.assert_array_equal(np.asarray(sampled.full_tensor()), np.asarray(want[0]))
        assert [x.layout for x in jax.tree.leaves(written, is_leaf=_is_dtensor)] == cache_layouts
        _assert_close(written, want[1], _F32)


def test_prefill_then_sampling(mesh: Any) -> None:
    """A prompt prefilled, its next token taken by argmax, then sampled from with the
    key/value cache (tests/models/decode.py ``complete``): the prompt split over ``dp`` by
    batch, the cache's layouts kept, the sampled tokens free. The prefill's argmax reads
    logits split over ``dp`` by batch and over ``tp`` by vocabulary; its cheapest input move
    puts the batch over ``tp`` (4 rows on 4 devices), and the loop then carried the token
    and the sampled tokens so: they came back ``R,S(0)`` where XLA keeps the batch over
    ``dp`` (``S(0),R``), and check said so (stop 45: 23 collectives after XLA's combiner,
    26,212 B, where XLA compiles 32, 33,480 B; by the search's objective 126,628 against
    XLA's program's 151,624). With the argmaxes called as their two reductions
    (inference/simplify.py, stop 51) no logits move for them: the batch stays over ``dp``
    and every output agrees with XLA's layout (16 collectives, 22,776 B; the objective
    49,848). Asserted: every output as XLA lays it out, the prediction cheaper than XLA's
    program by the objective and in collectives, the pinned program no dearer than plain
    jit, both executions sampling plain jit's tokens and filling its cache."""
    cfg = llama.Config()
    args = decode.completion_args(mesh, cfg)
    fn = partial(decode.complete, cfg=cfg)
    out_layouts = (None, args[1])
    report = check(fn, *args, out_layouts=out_layouts)
    assert all(o.verdict == "equal" for o in report.outputs), report
    assert report.objective[0] < report.objective[1], report
    assert len(report.predicted_combined) < len(report.compiled_collectives), report
    cache_layouts = [x.layout for x in jax.tree.leaves(args[1], is_leaf=_is_dtensor)]
    assert list(report.prediction.out_layouts[1:]) == cache_layouts

    want = jax.jit(fn)(*_one_device(common.plain(args)))
    for execute in ("xla", "pinned"):
        ours = eqx.filter_jit(lambda *a, e=execute: apply(fn, *a, out_layouts=out_layouts, execute=e))
        compiled = ours.lower(*args).compile()
        if execute == "pinned":
            count, nbytes = common.communication(parse_collectives(compiled.compiled.as_text()))
            assert count <= len(report.compiled_collectives) and nbytes <= report.compiled_bytes, (count, nbytes)
        sampled, cache = compiled(*args)
        np.testing.assert_array_equal(np.asarray(sampled.full_tensor()), np.asarray(want[0]))
        assert [x.layout for x in jax.tree.leaves(cache, is_leaf=_is_dtensor)] == cache_layouts
        _assert_close(cache, want[1], _F32)


# optax's other optimizers on the stacked LM (clip + adamw is the models' own): each adds its own update
# primitives (factored moments, trust ratios, per-leaf norms, Newton-Schulz iterations, sign updates, conds)
_OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adafactor": lambda: optax.adafactor(1e-3),
    "lamb": lambda: optax.lamb(1e-3),
    "sm3": lambda: optax.sm3(1e-3),
    "sgd nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adan": lambda: optax.adan(1e-3),
    "masked weight decay": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    ),
    "zero_nans + adam": lambda: optax.chain(optax.zero_nans(), optax.adam(1e-3)),
    "schedule-free adamw": lambda: optax.contrib.schedule_free_adamw(1e-3),
    "muon": lambda: optax.contrib.muon(1e-3),
    "noisy sgd (a PRNG key in the state)": lambda: optax.noisy_sgd(1e-3, key=jax.random.key(0)),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_optax_optimizers_predict_check_and_apply(mesh: Any, name: str) -> None:
    """Every output's layout agrees with XLA's (or XLA reduced a partial), the prediction
    sends at most 1.1x XLA's bytes (measured on dp=2 x tp=4 at stop 34: 0.75-0.76x, muon
    0.55x), and apply computes plain jax.jit's step in the state's layouts."""
    step = training_step("stacked", mesh, optimizer=_OPTIMIZERS[name]())
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert report.predicted_bytes <= 1.1 * report.compiled_bytes
    got = apply(step.fn, *step.args, out_layouts=step.out_layouts)
    want = step.plain_jit()(*step.plain_args())
    for g, w in zip(jax.tree.leaves(got, is_leaf=_is_dtensor), jax.tree.leaves(want), strict=True):
        value = g.full_tensor() if isinstance(g, DTensor) else g
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value, w = jax.random.key_data(value), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(value), np.asarray(w), rtol=2e-4, atol=1e-5)
    kept = jax.tree.leaves(got[:2], is_leaf=_is_dtensor)  # the layouts kept, a key (noisy sgd's) a key
    assert [getattr(x, "layout", x.dtype) for x in kept] == [
        getattr(x, "layout", x.dtype) for x in jax.tree.leaves(step.args[:2], is_leaf=_is_dtensor)]


@pytest.mark.parametrize("channels", [(16,), (8, 16)])
def test_a_cnn_with_channel_split_convs(mesh: Any, channels: tuple[int, ...]) -> None:
    """tests/models/cnn.py's adamw step, the batch over dp, the convs' output channels over
    tp, the dense layer replicated: the flatten of the channel-split activations is a
    strided shard (``S(0),_S(1, 16)``). Every output's layout agrees with XLA's; the
    prediction sends at most 1.1x XLA's bytes and is no dearer than XLA's program by the
    search's objective (bytes plus the default overhead per collective after XLA's
    combiner, by kind: 8,192 B per all-gather, 192 per all-reduce); where it has more
    collectives than XLA's, check's note says it is cheaper by that objective. One conv:
    XLA's plan, 13,804 B in 2 collectives, one all-gather (the activations gathered over
    tp, the dense gradient all-reduced over dp within the one dp all-reduce): 22,188 by the
    objective. Stop 39's search stayed at the 192 B search's plan, 7,780 B in 4, 3 of them
    all-gathers (the activations and the logits' gradient gathered over dp too, for a
    replicated dense gradient): 32,548 by the latency-bound default's objective; stop 40's
    strict common value moves (program._taken_as_made: the activations' strided split
    gathered over tp alone, then the logits' gradient taken as it comes, cascading with
    the kept look-ahead, program._Search._greedy_kept) reach XLA's plan. Two convs: 22,236
    in 4, 2 all-gathers, against XLA's 39,324 in 5, 3 (39,004 against 64,284 by the
    objective; stop 39: 16,064 in 6, 4 all-gathers, 49,216; stop 35: 18,330 in 9).
    apply under jax.jit compiles the predicted collectives (execute="pinned") and plain
    jax.jit's (execute="xla"), and computes its values in the state's layouts."""
    step = training_step("cnn", mesh, channels=channels)
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert report.outputs and all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs), report
    predicted, compiled = (sum(counts.values()) for counts in (report.predicted_combined_counts, report.compiled_counts))
    assert report.predicted_bytes <= 1.1 * report.compiled_bytes
    ours, xlas = (nbytes + sum(overhead_of(DEFAULT_COLLECTIVE_OVERHEAD, kind) * n
                               for kind, n in counts.items() if kind in COMMUNICATING)
                  for nbytes, counts in ((report.predicted_bytes, report.predicted_combined_counts),
                                         (report.compiled_bytes, report.compiled_counts)))
    assert ours <= xlas, (ours, xlas)
    assert report.objective == (ours, xlas)
    # more collectives than XLA's for fewer bytes: check's note says the prediction is cheaper by the objective; one
    # conv: XLA's own plan (no note)
    note = report.communication_note
    assert ("cheaper by the search's objective" in note) == (predicted > compiled), note
    assert (note == "") == (channels == (16,)), note
    figures = {(16,): (13804, 2, 13804, 2), (8, 16): (22236, 4, 39324, 5)}[channels]
    assert (report.predicted_bytes, predicted, report.compiled_bytes, compiled) == figures
    plain = step.plain_jit().lower(*step.plain_args()).compile()
    ours, pinned = (
        jax.jit(lambda *a, ex=ex: apply(step.fn, *a, out_layouts=step.out_layouts, execute=ex)).lower(*step.args).compile()
        for ex in ("xla", "pinned")
    )
    assert common.communication(parse_collectives(ours.as_text())) == common.communication(
        parse_collectives(plain.as_text())) == (compiled, float(report.compiled_bytes))
    assert common.communication(parse_collectives(pinned.as_text()))[0] == predicted
    want = plain(*step.plain_args())
    for got in (ours(*step.args), pinned(*step.args)):
        for g, w in zip(jax.tree.leaves(got, is_leaf=_is_dtensor), jax.tree.leaves(want), strict=True):
            value = g.full_tensor() if isinstance(g, DTensor) else g
            np.testing.assert_allclose(np.asarray(value), np.asarray(w), rtol=1e-6, atol=1e-7)
        kept = jax.tree.leaves(got[:2], is_leaf=_is_dtensor)
        assert [x.layout for x in kept] == [x.layout for x in jax.tree.leaves(step.args[:2], is_leaf=_is_dtensor)]


# Stop 37's probes (docs/inference.md section 6, "Stop 37 probes"): new families of public training code, each
# with what it adds (scan primitives, latent projections, eigendecompositions) and the bytes and collectives
# (after XLA's combiner) check measured against XLA's on dp=2 x tp=4. check's count includes the free loss's
# P(dp),P(tp) reduced to XLA's layout, last mesh dim first as XLA compiles it (s38-combine). Under the latency-bound
# default (stop 39: 8,192 B per all-gather and all-to-all, 192 per all-reduce and reduce-scatter) every row has
# fewer collectives than at 192 B per collective, for more bytes on all but Gemma-3's (the same bytes; at 192 B:
# ratio, collectives): Mamba 0.93, 13 / 9; Mamba-2 0.79, 14 / 10; DeepSeek 0.87, 13 / 9; RWKV 0.83, 15 / 10;
# Gemma-3 0.81, 16 / 14; muon 0.59, 11 / 13; Shampoo 0.09, 16 / 17; Shampoo split 0.47, 19 / 15. Stop 39's planner
# reduces a value partial over several mesh dims last mesh dim first (tp before dp, a tie order among equally cheap
# plans): one collective fewer after XLA's combiner on five rows, the same bytes (Mamba 11 -> 10, Mamba-2 11 -> 10,
# DeepSeek 10 -> 9, RWKV 10 -> 9, Gemma-3 15 -> 14). Stop 49's rule for a reshape with ``dimensions`` (the kernel
# transposed in the depthwise conv's input gradient): Mamba 1.02 -> 1.00, 10 -> 9; Mamba-2 0.88 -> 0.87, 10 -> 9
class Probe(NamedTuple):
    step: Callable[[Any], Any]  # mesh -> models.steps.Step
    ratio: float  # predicted bytes / XLA's, measured
    collectives: tuple[int, int]  # predicted after the combiner, XLA's


PROBES: dict[str, Probe] = {
    "mamba associative_scan": Probe(lambda mesh: training_step("mamba", mesh), 1.00, (9, 9)),
    "mamba2 chunked ssd": Probe(lambda mesh: training_step("mamba2", mesh), 0.87, (9, 10)),
    "deepseek latent attention": Probe(lambda mesh: training_step("mla", mesh), 0.93, (9, 9)),
    "rwkv wkv scan": Probe(lambda mesh: training_step("rwkv", mesh), 0.96, (9, 10)),
    "gemma3 qk-norm local/global": Probe(lambda mesh: training_step("gemma3", mesh), 0.81, (14, 14)),
    "mlp muon": Probe(lambda mesh: training_step("mlp", mesh, optax.contrib.muon(1e-3)), 0.68, (5, 13)),
    "mlp shampoo eigh": Probe(lambda mesh: training_step("mlp", mesh, shampoo.shampoo(1e-3)), 0.17, (9, 17)),
    "mlp shampoo eigh, split statistics": Probe(
        lambda mesh: shampoo.split_statistics(training_step("mlp", mesh, shampoo.shampoo(1e-3))), 0.54, (14, 15)),
}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_families(mesh: Any, name: str) -> None:
    """Each output's layout agrees with XLA's; the bytes and collectives (after XLA's
    combiner) are the measured ratios to XLA's (the default's plans: XLA's count on Mamba,
    DeepSeek and Gemma-3, fewer on the others; Mamba at 1.003x XLA's bytes, 144 B dearer by
    the objective than XLA's program, which computes its conv's weight gradient wrongly, all
    the others below XLA's bytes; until the transposing reshape of the depthwise conv's
    kernel had a rule, Mamba gathered that kernel for 1.02x in one collective more, Mamba-2
    0.88x in 10); apply
    (execute="pinned") under jax.jit compiles the predicted plan (its bytes within 1.1x of
    the prediction), keeps the parameters' and state's layouts and computes what jax.jit of
    the step computes on one device. Not execute="xla": for the Mamba-2 step XLA's own
    program is wrong (docs/inference.md, "Stop 37 probes": a depthwise conv's weight
    gradient with the batch split over dp and the weight replicated comes out multiplied by
    the tp size; execute="auto" runs the pinned plan there, and check notes those outputs),
    and the other rows' xla paths are test_predict_check_apply's."""
    probe = PROBES[name]
    step = probe.step(mesh)
    report = check(step.fn, *step.args, out_layouts=step.out_layouts)
    assert report.outputs and all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs), report
    assert report.predicted_bytes / report.compiled_bytes == pytest.approx(probe.ratio, abs=0.006)
    assert (len(report.predicted_combined), len(report.compiled_collectives)) == probe.collectives
    noted = [o.index for o in report.outputs if "XLA's compiled values may be wrong" in o.note]
    assert bool(noted) == name.startswith("mamba")  # a depthwise conv's weight gradient (inference.xla_defects)
    pinned = eqx.filter_jit(
        lambda *a: apply(step.fn, *a, out_layouts=step.out_layouts, execute="pinned")).lower(*step.args).compile()
    count, nbytes = common.communication(parse_collectives(pinned.compiled.as_text()))
    assert nbytes <= 1.1 * float(report.predicted_bytes)
    got = pinned(*step.args)
    kept = jax.tree.leaves(got[:2], is_leaf=_is_dtensor)
    assert [x.layout for x in kept] == [x.layout for x in jax.tree.leaves(step.args[:2], is_leaf=_is_dtensor)]
    want = jax.jit(step.fn)(*_one_device(common.plain(step.args)))
    _assert_close(got, want, _F32)


def test_a_model_written_for_explicit_sharding(mesh: Any) -> None:
    """tests/models/explicit_lm.py's clip + adamw step, run inside ``jax.set_mesh`` of the
    Explicit mesh as its code asks (``out_sharding=`` on the einsums that contract or merge
    tp-split dims and on the embedding lookup, a ``reshard`` of the one-hot labels):
    predict traces it typed, as ``jax.jit`` there does, and every value takes its type: an
    equation whose rule makes its type from its operands as they come runs so (no row),
    the others (a matmul contracting a tp-split dim, a reduction over a split dim) are
    moved to it by a fixed row (79 ``<path>.out_sharding`` rows); every output agrees with
    what ``jax.jit`` compiles in that context (check compiles there; the loss too, typed
    replicated, where the untyped trace returned it partial), and apply's executors under
    jax.jit compute jax.jit's step in the parameters' and state's layouts. Measured: 71,838
    B in 15 collectives after XLA's combiner where XLA's 77,918 in 13; by the objective
    90,718 against XLA's plan's 80,414: JAX writes the lookup
    ``at[tokens].get(out_sharding=)`` in an ``auto_axes`` region, free over the mesh, and
    the search places its transpose's scatter-add into the replicated table by gathering
    the tokens and the embedding's cotangent over dp (two all-gathers, 2,112 B) where XLA
    scatters per dp rank and all-reduces the table's gradient in its dp group (8,192 B).
    The untyped trace (stop 49) predicted 71,664 B in 15, by the objective 90,544, in 1.06
    s CPU cold; typed, ~0.4 s (its equations' candidates are those making their types)."""
    cfg = explicit_lm.Config()
    plain = explicit_lm.init(jax.random.key(0), cfg)
    params = distribute_pytree(plain, mesh, explicit_lm.megatron_plan())
    optimizer = common.make_optimizer()
    state = common.distribute_state(optimizer.init(plain), params)
    batch = [distribute_tensor(a, mesh, "S(0),R") for a in common.batch(0, 4, cfg.seq, cfg.vocab)]
    fn, args, out_layouts = partial(explicit_lm.train_step, cfg=cfg), (params, state, *batch), (params, state, None)
    with jax.set_mesh(mesh.to_jax()):
        want = jax.jit(fn)(*jax.tree.map(lambda x: x.to_jax(), args, is_leaf=_is_dtensor))
        report = check(fn, *args, out_layouts=out_layouts)
        assert sum(e.path.endswith(".out_sharding") for e in report.prediction.equations) == 79
        assert [o.verdict for o in report.outputs] == ["equal"] * len(report.outputs)
        assert (report.predicted_bytes, len(report.predicted_combined)) == (71838, 15)
        assert (report.compiled_bytes, len(report.compiled_collectives)) == (77918, 13)
        assert report.objective == (90718, 80414)
        for execute in ("xla", "ops", "pinned"):
            got = jax.jit(partial(apply, fn, out_layouts=out_layouts, execute=execute))(*args)
            _assert_close(got, want, _F32)
            kept = jax.tree.leaves(got[:2], is_leaf=_is_dtensor)
            assert [x.layout for x in kept] == [x.layout for x in jax.tree.leaves(args[:2], is_leaf=_is_dtensor)]
