"""logical_layouts: Flax logical axis annotations (Linen ``nn.LogicallyPartitioned`` boxes,
NNX ``out_sharding`` metadata, trees of names) and rules as layouts. The annotated test
models (tests/models/linen_lm.py, nnx_lm.py with ``logical=True``) give the Megatron plans
tests/test_frameworks.py writes by hand, and their programs run on them with the values of
plain JAX; each mapping agrees with Flax's own (``nn.logical_to_mesh_axes``,
``nnx.get_partition_spec``) and with JAX's shards."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from models import linen_lm, nnx_lm
from models.common import megatron_batch, plain

from placements2jax import (
    DTensor,
    Layout,
    LayoutError,
    PlanError,
    Replicate,
    Shard,
    StridedShard,
    apply,
    check,
    distribute_tensor,
    init_device_mesh,
    logical_layouts,
    plan_layouts,
    predict,
)

LEARNING_RATE = linen_lm.LEARNING_RATE


def _is_layout(x: Any) -> bool:
    return isinstance(x, Layout)


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def _placed(tree: Any, layouts: Any, mesh: Any) -> Any:
    """``tree``'s arrays as DTensors in ``layouts`` (a tree of the same structure)."""
    return jax.tree.map(lambda x, layout: distribute_tensor(np.asarray(x), mesh, layout), tree, layouts)


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(scope="module")
def boxed() -> Any:
    """The Linen GPT-2's TrainState, its parameters and Adam moments in LogicallyPartitioned boxes."""
    return linen_lm.create(linen_lm.Config(logical=True))


def test_linen_annotations_give_the_megatron_plan(mesh: Any, boxed: Any) -> None:
    """Each box (parameters, Adam's mu and nu) becomes its layout: the tree of nn.unbox(state),
    the layouts megatron_plan gives by regex; the unboxed values are those of the model without
    annotations."""
    layouts = logical_layouts(boxed, mesh, linen_lm.LOGICAL_RULES)
    unboxed = nn.unbox(boxed)
    want = plan_layouts(unboxed, mesh, linen_lm.megatron_plan())
    assert jax.tree.structure(layouts, is_leaf=_is_layout) == jax.tree.structure(want, is_leaf=_is_layout)
    assert jax.tree.leaves(layouts, is_leaf=_is_layout) == jax.tree.leaves(want, is_leaf=_is_layout)
    assert str(layouts.params["blocks"]["attn"]["query"]["kernel"]) == "R,S(2)"  # (layers, embed, heads, kv)
    assert str(layouts.opt_state[0].nu["blocks"]["mlp"]["out"]["kernel"]) == "R,S(1)"  # (layers, mlp, embed)
    assert layouts.step == Layout(mesh, ())  # not boxed: replicated
    for got, want_value in zip(jax.tree.leaves(unboxed), jax.tree.leaves(linen_lm.create(linen_lm.Config()))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want_value))


def test_linen_train_state_step_runs_on_the_logical_plan(mesh: Any, boxed: Any) -> None:
    """The TrainState laid out by logical_layouts: predict and check the adamw step (the
    state's layouts kept, every output agreeing with XLA's), apply it with the values of
    plain jax.jit on the unsharded state."""
    cfg = linen_lm.Config(logical=True)
    state = _placed(nn.unbox(boxed), logical_layouts(boxed, mesh, linen_lm.LOGICAL_RULES), mesh)
    tokens, targets = megatron_batch(cfg, mesh)
    key = jax.random.key(1)
    args, out_layouts = (state, tokens, targets, key), (state, None)
    report = check(linen_lm.train_step, *args, out_layouts=out_layouts)
    assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
    assert predict(linen_lm.train_step, *args, out_layouts=out_layouts) is report.prediction
    new_state, loss = apply(linen_lm.train_step, *args, out_layouts=out_layouts)
    want_state, want_loss = jax.jit(linen_lm.train_step)(nn.unbox(boxed), *plain((tokens, targets)), key)
    np.testing.assert_allclose(float(loss.full_tensor()), float(want_loss), rtol=1e-5)
    got = jax.tree_util.tree_flatten_with_path(new_state, is_leaf=_is_dtensor)[0]
    for (path, g), w, old in zip(got, jax.tree.leaves(want_state), jax.tree.leaves(state, is_leaf=_is_dtensor)):
        where = jax.tree_util.keystr(path)
        assert g.layout == old.layout, where  # the state's layouts kept
        # the key bias's gradient is zero up to rounding (softmax cancels it), which Adam's m / sqrt(v) scales up
        # to a step of up to the learning rate (as tests/test_frameworks.py); other leaves within 1% of a step
        atol = 2 * LEARNING_RATE if "key" in where and "bias" in where else LEARNING_RATE / 100
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=2e-5, atol=atol, err_msg=where)


def test_nnx_annotations_give_the_megatron_plan_and_run(mesh: Any) -> None:
    """NNX Variables with out_sharding metadata (the model's and nnx.Optimizer's moments,
    which copy it) give megatron_plan's layouts, each held in its Variable; the functional
    value_and_grad on the state laid out so has plain jax.jit's values."""
    cfg = nnx_lm.Config(layers=1, logical=True)
    model, optimizer = nnx_lm.create(cfg)
    layouts = logical_layouts((model, optimizer), mesh, nnx_lm.LOGICAL_RULES)
    want = plan_layouts(nnx_lm.create(nnx_lm.Config(layers=1)), mesh, nnx_lm.megatron_plan())
    assert jax.tree.leaves(layouts) == jax.tree.leaves(want)
    assert isinstance(layouts[0].blocks[0].mlp.fc.kernel, nnx.Param)
    assert str(layouts[1].opt_state[0].mu["head"]["kernel"].get_value()) == "R,S(1)"  # (embed, vocab)

    graphdef, state = nnx.split(model)
    placed = _placed(state, logical_layouts(state, mesh, nnx_lm.LOGICAL_RULES), mesh)
    tokens, targets = megatron_batch(cfg, mesh)
    functional = nnx_lm.Functional(graphdef)
    loss, grads = apply(functional.value_and_grad, placed, tokens, targets, out_layouts=(None, placed))
    want_loss, want_grads = jax.jit(functional.value_and_grad)(state, *plain((tokens, targets)))
    np.testing.assert_allclose(float(loss.full_tensor()), float(want_loss), rtol=1e-6)
    for g, w, p in zip(jax.tree.leaves(grads, is_leaf=_is_dtensor), jax.tree.leaves(want_grads),
                       jax.tree.leaves(placed, is_leaf=_is_dtensor)):
        assert g.layout == p.layout
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=2e-5, atol=2e-6)


RULES = (("batch", "dp"), ("embed", "dp"), ("embed", "tp"), ("mlp", "tp"), ("heads", ("dp", "tp")), ("kv", None))


@pytest.mark.parametrize(
    "names",
    [("batch", "embed"), ("embed", "mlp"), ("mlp", "embed"), ("heads", "kv"), ("kv", None), (None, "batch", "embed"),
     ("heads", "mlp")],
)
def test_linen_rules_are_flax_own(mesh: Any, names: tuple[Any, ...]) -> None:
    """Names map as nn.logical_to_mesh_axes maps them: rules by priority, a name taking its
    next rule when the first's mesh axes are held ('embed' after 'batch': tp), several mesh
    axes on one dim, None unsplit."""
    layout = logical_layouts({"w": names}, mesh, RULES)["w"]
    assert layout == Layout.from_partition_spec(mesh, nn.logical_to_mesh_axes(names, RULES), len(names))


def test_an_empty_tuple_stays_an_empty_node(mesh: Any) -> None:
    """As JAX takes it (an optimizer's empty state): the result keeps the tree's structure."""
    tree = {"w": ("embed", "mlp"), "empty": (), "x": np.zeros((2, 3))}
    layouts = logical_layouts(tree, mesh, RULES)
    assert layouts["empty"] == () and layouts["x"] == Layout(mesh, ((), ())) and str(layouts["w"]) == "S(0),S(1)"


def test_several_mesh_axes_split_a_dim_major_first(mesh: Any) -> None:
    """A name mapped to ("dp", "tp") is torch's (Shard(0), Shard(0)) and JAX's P(("dp", "tp"));
    ("tp", "dp"), tp major, torch's _StridedShard: each device holds the block JAX gives it."""
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    for axes, placements in ((("dp", "tp"), (Shard(0), Shard(0))), (("tp", "dp"), (StridedShard(0, 4), Shard(0)))):
        layout = logical_layouts({"w": ("rows", "cols")}, mesh, (("rows", axes), ("cols", None)))["w"]
        assert layout.placements == placements
        ours = distribute_tensor(x, mesh, layout)
        theirs = jax.device_put(x, NamedSharding(mesh.to_jax(), PartitionSpec(axes, None)))
        blocks = {shard.device: np.asarray(shard.data) for shard in theirs.addressable_shards}
        for shard in ours.to_jax().addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), blocks[shard.device])


def test_uneven_extents_split_as_torch_chunks(mesh: Any) -> None:
    """A vocabulary of 50 over tp=4: torch.chunk's 13, 13, 13, 11 rows."""
    x = np.random.default_rng(0).normal(size=(50, 8)).astype(np.float32)
    layout = logical_layouts({"embedding": ("vocab", "embed")}, mesh, (("vocab", "tp"), ("embed", None)))["embedding"]
    placed = distribute_tensor(x, mesh, layout)
    assert [layout.local_shape(x.shape, rank)[0] for rank in range(4)] == [13, 13, 13, 11]
    np.testing.assert_array_equal(np.asarray(placed.full_tensor()), x)
    np.testing.assert_array_equal(np.asarray(placed.to_local(3)), x[39:])


def test_unknown_names_replicate_only_when_not_strict(mesh: Any) -> None:
    """Flax replicates a name no rule names; strict=False does too (strict is the default)."""
    with pytest.raises(PlanError, match="no rule names the logical axis 'other'"):
        logical_layouts({"w": ("kv", "other")}, mesh, RULES)
    assert logical_layouts({"w": ("kv", "other")}, mesh, RULES, strict=False)["w"].placements == (
        Replicate(), Replicate())
    assert logical_layouts({"w": ("mlp", "other")}, mesh, RULES, strict=False)["w"].placements == (
        Replicate(), Shard(0))


def test_context_rules_box_rules_and_partition_specs(mesh: Any, boxed: Any) -> None:
    """rules=None takes nn.logical_axis_rules' rules; a box's own rules win, as its unbox;
    a plain nn.Partitioned box names mesh axes; nn.get_partition_spec's PartitionSpecs of
    names map like the boxes (their rank the spec's)."""
    with nn.logical_axis_rules(linen_lm.LOGICAL_RULES):
        from_context = logical_layouts(boxed, mesh)
    assert from_context == logical_layouts(boxed, mesh, linen_lm.LOGICAL_RULES)
    w = jax.ShapeDtypeStruct((4, 8), np.float32)
    own = nn.LogicallyPartitioned(w, ("a", "b"), rules=(("a", "tp"), ("b", None)))
    assert str(logical_layouts({"w": own}, mesh, (("a", None), ("b", "tp")))["w"]) == "R,S(0)"
    assert str(logical_layouts({"w": nn.Partitioned(w, (None, "dp"))}, mesh, ())["w"]) == "S(1),R"
    specs = nn.get_partition_spec(boxed)
    by_spec = logical_layouts(specs.params, mesh, linen_lm.LOGICAL_RULES)
    by_box = logical_layouts(boxed.params, mesh, linen_lm.LOGICAL_RULES)
    assert by_spec["blocks"]["mlp"]["fc"]["kernel"] == by_box["blocks"]["mlp"]["fc"]["kernel"]
    assert by_spec["ln_f"]["scale"] == Layout(mesh, ())  # not boxed: PartitionSpec(), no dims


def test_nnx_names_without_a_rule_are_mesh_axes(mesh: Any) -> None:
    """NNX's own resolution: a name is looked up in the rules (the last of several wins),
    one without a rule is a mesh axis itself, as nnx.get_partition_spec gives it."""
    with nnx.use_eager_sharding(False):
        linear = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "tp")),
                            rngs=nnx.Rngs(0))
    state = nnx.state(linear)
    layouts = logical_layouts(state, mesh, (("embed", "tp"), ("embed", "dp")))
    assert str(layouts["kernel"].get_value()) == "S(0),S(1)" and str(layouts["bias"].get_value()) == "R,R"
    with pytest.raises(LayoutError, match="tree at 'kernel'"):  # NNX does not check that both dims get tp
        logical_layouts(state, mesh, (("embed", "tp"),))


def test_flax_is_imported_only_when_called() -> None:
    code = "import sys, placements2jax; assert not any(m.startswith('flax') for m in sys.modules), 'flax imported'"
    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": ":".join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
