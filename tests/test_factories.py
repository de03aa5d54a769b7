"""Parameters born sharded: factory values exactly those of unsharded JAX for every layout
(uneven included), no value of the full shape in the compiled program, init_pytree on
pure JAX, Flax NNX and Equinox models."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import placements2jax as p2j
from placements2jax import (
    DTensor,
    Layout,
    Partial,
    Replicate,
    Shard,
    colwise,
    init_device_mesh,
    rowwise,
    resolve_layout,
)
from placements2jax.factories import born_program
from placements2jax.layout import iter_layouts
from placements2jax.physical import physical

KEY = jax.random.key(7)
MESH = init_device_mesh((4, 2), ("dp", "tp"))
# Even, uneven (prefix padding), uneven nested (interleaved padding) and empty-block shapes.
SHAPES = [(10, 3), (13, 5), (3, 7)]
LAYOUTS = iter_layouts(MESH, 2, partial_ops=("sum", "max"))
PLAIN_LAYOUTS = iter_layouts(MESH, 2)


def _full(kind: str, shape: tuple[int, ...], dtype=jnp.float32) -> np.ndarray:
    return {
        "randn": lambda: jax.random.normal(KEY, shape, dtype),
        "rand": lambda: jax.random.uniform(KEY, shape, dtype),
        "zeros": lambda: jnp.zeros(shape, dtype),
        "ones": lambda: jnp.ones(shape, dtype),
        "empty": lambda: jnp.zeros(shape, dtype),
        "full": lambda: jnp.full(shape, 2.5, dtype),
    }[kind]()


def _make(kind: str, shape: tuple[int, ...], layout: Layout, dtype=jnp.float32) -> DTensor:
    if kind in ("rand", "randn"):
        return getattr(p2j, kind)(*shape, key=KEY, device_mesh=MESH, placements=layout, dtype=dtype)
    if kind == "full":
        return p2j.full(shape, 2.5, device_mesh=MESH, placements=layout, dtype=dtype)
    return getattr(p2j, kind)(shape, device_mesh=MESH, placements=layout, dtype=dtype)


def test_threefry_is_partitionable() -> None:
    assert jax.config.jax_threefry_partitionable


def _blocks(d: DTensor) -> dict:
    return {s.device.id: np.asarray(s.data) for s in d.array.addressable_shards}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_randn_equals_unsharded_jax_for_every_layout(shape: tuple[int, ...]) -> None:
    """Every device's physical block is bit-identical to ``distribute_tensor`` of the
    unsharded ``jax.random.normal(key, shape)`` (padding and partial split included),
    and the logical value is exactly it (Partial(sum) re-adds x / n: float rounding)."""
    want = np.asarray(_full("randn", shape))
    for layout in LAYOUTS if shape == (10, 3) else PLAIN_LAYOUTS:
        d = _make("randn", shape, layout)
        assert d.layout == layout and d.shape == shape
        reference = p2j.distribute_tensor(want, MESH, layout)
        got, expected = _blocks(d), _blocks(reference)
        for device, block in expected.items():
            np.testing.assert_array_equal(got[device], block, err_msg=f"{layout} device {device}")
        full = np.asarray(d.full_tensor())
        if layout.partial_op == "sum":
            np.testing.assert_allclose(full, want, rtol=1e-6, err_msg=str(layout))
        else:
            np.testing.assert_array_equal(full, want, err_msg=str(layout))
    rank = 5
    for layout in LAYOUTS[:12]:
        d = _make("randn", shape, layout)
        if not layout.has_partial:
            np.testing.assert_array_equal(np.asarray(d.to_local(rank)), want[layout.local_slices(shape, rank)])


@pytest.mark.parametrize("kind", ["rand", "zeros", "ones", "empty", "full"])
def test_other_factories_equal_unsharded_jax(kind: str) -> None:
    for shape in [(10, 3)]:
        want = np.asarray(_full(kind, shape))
        for layout in LAYOUTS[::4]:
            d = _make(kind, shape, layout)
            reference = p2j.distribute_tensor(want, MESH, layout)
            got = _blocks(d)
            for device, block in _blocks(reference).items():
                np.testing.assert_array_equal(got[device], block, err_msg=f"{kind} {layout} device {device}")


def test_bfloat16_and_integer_dtypes() -> None:
    layout = Layout.from_device_mesh(MESH)("S(0),S(1)")
    d = _make("randn", (10, 3), layout, jnp.bfloat16)
    assert d.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(d.full_tensor()), np.asarray(_full("randn", (10, 3), jnp.bfloat16)))
    z = p2j.full((5, 4), 3, device_mesh=MESH, placements="S(0),R")
    assert z.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(z.full_tensor()), np.full((5, 4), 3))


def test_torch_style_size_arguments() -> None:
    a = p2j.zeros(4, 6, device_mesh=MESH, placements=[Shard(0), Replicate()])
    b = p2j.zeros((4, 6), device_mesh=MESH, placements=[Shard(0), Replicate()])
    assert a.shape == b.shape == (4, 6)
    assert p2j.ones(3, device_mesh=MESH).placements == (Replicate(), Replicate())


def _full_shape_lines(text: str, shape: tuple[int, ...]) -> list[str]:
    pattern = re.compile(r"\b[a-z]+\d*\[" + ",".join(map(str, shape)) + r"\]")
    return [line.strip() for line in text.splitlines() if pattern.search(line)]


@pytest.mark.parametrize("shape", [(16, 6), (13, 5), (3, 7)], ids=str)
def test_no_value_of_the_full_shape_on_a_device(shape: tuple[int, ...]) -> None:
    """Every layout that splits the tensor: the compiled program has no array of the full
    shape (the random bits, the padding and the output are all per-block)."""
    checked = 0
    for layout in PLAIN_LAYOUTS:
        if all(len(axes) == 0 for axes in layout.dim_axes):
            continue
        program = born_program(lambda k: [jax.random.normal(k, shape)], [layout], [shape])
        text = program.lower(KEY).compile().as_text()
        assert not _full_shape_lines(text, shape), (str(layout), _full_shape_lines(text, shape)[:3])
        checked += 1
    assert checked == len(PLAIN_LAYOUTS) - 1


def test_the_full_shape_check_is_not_vacuous() -> None:
    """A replicated layout does hold the full shape: the HLO check would see it."""
    layout = resolve_layout(MESH, "R,R", 2)
    text = born_program(lambda k: [jax.random.normal(k, (10, 3))], [layout], [(10, 3)]).lower(KEY).compile().as_text()
    assert _full_shape_lines(text, (10, 3))


# -- init_pytree on real model code -----------------------------------------------------------------------------------


def _mlp_init(key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (50, 16)) * 0.02,
        "layers": [
            {"up": {"w": jax.random.normal(k2, (16, 36)) / 4, "b": jnp.zeros(36)},
             "down": {"w": jax.random.normal(k3, (36, 16)) / 6, "b": jnp.zeros(16)}},
        ],
    }


PLAN = {r"embed": rowwise("tp"), r"layers/\d+/up/.*": colwise("tp"), r"layers/\d+/down/.*": rowwise("tp")}


def _assert_tree_equal(placed, plain) -> None:
    flat_p = jax.tree_util.tree_leaves(placed, is_leaf=lambda x: isinstance(x, DTensor))
    flat_q = jax.tree_util.tree_leaves(plain)
    assert len(flat_p) == len(flat_q)
    for d, x in zip(flat_p, flat_q):
        assert isinstance(d, DTensor)
        np.testing.assert_array_equal(np.asarray(d.full_tensor()), np.asarray(x))


def test_init_pytree_pure_jax_uneven_and_values() -> None:
    """Values equal the unsharded init compiled by XLA (jax.jit(init)): eager op-by-op
    execution may round ``normal * 0.02`` differently from the fused program."""
    placed = p2j.init_pytree(_mlp_init, KEY, MESH, PLAN)
    _assert_tree_equal(placed, jax.jit(_mlp_init)(KEY))
    assert placed["layers"][0]["up"]["w"].placements == (Replicate(), Shard(1))
    assert placed["embed"].placements == (Replicate(), Shard(0))
    # 36 columns over tp=2 even, 50 rows over tp even; an uneven plan too:
    fsdp = p2j.init_pytree(_mlp_init, KEY, MESH, {r".*/w": "S(0),S(1)", r"embed": "(dp,tp),None"})
    _assert_tree_equal(fsdp, jax.jit(_mlp_init)(KEY))
    assert fsdp["embed"].physical.is_padded  # 50 rows over 8 ranks


def test_init_pytree_partial_plan() -> None:
    placed = p2j.init_pytree(_mlp_init, KEY, MESH, {r"layers/0/down/b": [Partial(), Replicate()]}, strict=True)
    _assert_tree_equal(placed, jax.jit(_mlp_init)(KEY))
    assert placed["layers"][0]["down"]["b"].placements[0] == Partial()


def test_init_pytree_program_has_no_full_parameter() -> None:
    shapes = jax.eval_shape(_mlp_init, KEY)
    leaves, _ = jax.tree_util.tree_flatten_with_path(shapes)
    layouts = jax.tree_util.tree_leaves(
        p2j.plan_layouts(shapes, MESH, {r".*/w": "S(0),S(1)", r"embed": "(dp,tp),None", r".*/b": "R,S(0)"}),
        is_leaf=lambda x: isinstance(x, Layout),
    )
    program = born_program(lambda k: jax.tree_util.tree_leaves(_mlp_init(k)), layouts, [s.shape for _, s in leaves])
    text = program.lower(KEY).compile().as_text()
    for _, s in leaves:
        assert not _full_shape_lines(text, s.shape), (s.shape, _full_shape_lines(text, s.shape)[:3])


def test_init_pytree_flax_nnx() -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.down = nnx.Linear(32, 16, rngs=rngs)

    def init(key: jax.Array):
        return nnx.to_pure_dict(nnx.state(Block(nnx.Rngs(key)), nnx.Param))

    plan = {r"up/kernel": colwise("tp"), r"up/bias": colwise("tp"), r"down/kernel": rowwise("tp")}
    placed = p2j.init_pytree(init, KEY, MESH, plan, strict=True)
    want = jax.jit(init)(KEY)
    _assert_tree_equal(placed, want)
    assert placed["up"]["kernel"].placements == (Replicate(), Shard(1))
    model = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))  # the placed arrays go back into a module
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda d: d.to_jax(), placed, is_leaf=lambda x: isinstance(x, DTensor)))
    nnx.update(model, state)
    assert model.up.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp")


def test_init_pytree_equinox() -> None:
    eqx = pytest.importorskip("equinox")

    def init(key: jax.Array):
        return eqx.nn.MLP(12, 6, 20, 2, key=key)

    placed = p2j.init_pytree(init, KEY, MESH, {r"layers/0/weight": "R,S(0)", r"layers/2/weight": "S(0),R"})
    want = init(KEY)
    assert placed.activation is want.activation  # non-array leaves kept
    np.testing.assert_array_equal(np.asarray(placed.layers[0].weight.full_tensor()), np.asarray(want.layers[0].weight))
    np.testing.assert_array_equal(np.asarray(placed.layers[2].weight.full_tensor()), np.asarray(want.layers[2].weight))
    assert placed.layers[2].weight.physical.is_padded  # 6 rows over dp=4
