"""vocab_parallel_cross_entropy: exact against the unsharded loss (optax, torch) and its gradient,
with only per-token scalars crossing the mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from placements2jax import (
    DeviceMesh,
    cross_entropy,
    distribute_tensor,
    init_device_mesh,
    loss_parallel,
    vocab_parallel_cross_entropy,
)
from placements2jax.errors import ArgumentTypeError, PlacementError, ShapeError
from placements2jax.hlo import compiled_collectives

RNG = np.random.default_rng(0)
LOGITS = (RNG.normal(size=(4, 6, 64)) * 6).astype(np.float32)
LABELS = RNG.integers(0, 64, size=(4, 6)).astype(np.int32)
LABELS[0, 0] = LABELS[3, 5] = -100  # ignored tokens


@pytest.fixture(scope="module")
def mesh() -> DeviceMesh:
    return init_device_mesh((2, 4), ("dp", "tp"))


def reference(logits: jax.Array, labels: jax.Array, reduction: str = "mean") -> jax.Array:
    valid = labels != -100
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    losses = jnp.where(valid, losses, 0.0)
    if reduction == "none":
        return losses
    return losses.sum() / valid.sum() if reduction == "mean" else losses.sum()


@pytest.mark.parametrize("placements", ["S(0),S(2)", "None,None,(dp,tp)", "S(1),S(0)"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_the_unsharded_loss(mesh: DeviceMesh, placements: str, reduction: str) -> None:
    logits = distribute_tensor(LOGITS, mesh, placements)
    loss = vocab_parallel_cross_entropy(logits, LABELS, reduction=reduction)
    expected = reference(LOGITS, LABELS, reduction)
    np.testing.assert_allclose(np.asarray(loss.full_tensor()), expected, rtol=2e-6, atol=2e-6)
    if reduction == "none":
        assert loss.layout.dim_axes == logits.layout.dim_axes[:-1]  # laid out like the token dims
    else:
        assert loss.shape == () and not loss.layout.has_partial


def test_gradient_is_exact_under_jit(mesh: DeviceMesh) -> None:
    logits = distribute_tensor(LOGITS, mesh, "S(0),S(2)")
    labels = distribute_tensor(LABELS, mesh, "S(1),R")  # relaid out like the token dims inside
    value, grad = jax.jit(jax.value_and_grad(lambda x: vocab_parallel_cross_entropy(x, labels).to_jax()))(logits)
    ref_value, ref_grad = jax.value_and_grad(reference)(LOGITS, LABELS)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert grad.layout == logits.layout
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), ref_grad, atol=1e-7)


def test_equals_torch_cross_entropy() -> None:
    torch = pytest.importorskip("torch")
    mesh = init_device_mesh((8,), ("tp",))
    logits = torch.tensor(LOGITS.reshape(-1, 64), requires_grad=True)
    labels = torch.tensor(LABELS.reshape(-1), dtype=torch.long)
    theirs = torch.nn.functional.cross_entropy(logits, labels)  # ignore_index=-100, mean
    theirs.backward()
    ours = jax.jit(jax.value_and_grad(lambda x: vocab_parallel_cross_entropy(x, LABELS.reshape(-1)).to_jax()))
    value, grad = ours(distribute_tensor(LOGITS.reshape(-1, 64), mesh, "S(1)"))
    np.testing.assert_allclose(value, theirs.item(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), logits.grad.numpy(), atol=1e-7)


@pytest.mark.parametrize(("vocab", "placements"), [(50257, "S(0),S(1)"), (5, "R,S(1)"), (50, "None,tp")])
def test_uneven_vocabulary(mesh: DeviceMesh, vocab: int, placements: str) -> None:
    """A vocabulary that the mesh does not divide (GPT-2's 50257 on tp=4): exact, and the
    gradient has the logits' layout and shape."""
    logits = (RNG.normal(size=(8, vocab)) * 4).astype(np.float32)
    labels = RNG.integers(0, vocab, size=(8,)).astype(np.int32)
    labels[1] = -100
    sharded = distribute_tensor(logits, mesh, placements)
    assert sharded.physical.is_padded
    value, grad = jax.jit(jax.value_and_grad(lambda x: vocab_parallel_cross_entropy(x, labels).to_jax()))(sharded)
    ref_value, ref_grad = jax.value_and_grad(reference)(logits, labels)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert grad.layout == sharded.layout and grad.shape == sharded.shape
    np.testing.assert_allclose(np.asarray(grad.full_tensor()), ref_grad, atol=1e-7)
    none = vocab_parallel_cross_entropy(sharded, labels, reduction="none")
    np.testing.assert_allclose(np.asarray(none.full_tensor()), reference(logits, labels, "none"), rtol=1e-6)


def test_large_logits_stay_finite(mesh: DeviceMesh) -> None:
    big = LOGITS * 1000  # exp would overflow without the max shift
    loss = vocab_parallel_cross_entropy(distribute_tensor(big, mesh, "S(0),S(2)"), LABELS)
    np.testing.assert_allclose(np.asarray(loss.full_tensor()), reference(big, LABELS), rtol=1e-6)


def test_only_per_token_scalars_cross_the_mesh(mesh: DeviceMesh) -> None:
    logits = distribute_tensor(LOGITS, mesh, "S(0),S(2)")
    step = jax.jit(jax.grad(lambda x: vocab_parallel_cross_entropy(x, LABELS).to_jax()))
    collectives = compiled_collectives(step, logits)
    assert {c.op for c in collectives} == {"all-reduce"}
    tokens_per_rank = 2 * 6
    assert max(c.result_bytes for c in collectives) <= 2 * tokens_per_rank * 4  # never a logits block (12 x 16)


def test_bad_inputs(mesh: DeviceMesh) -> None:
    logits = distribute_tensor(LOGITS, mesh, "S(0),S(2)")
    with pytest.raises(ArgumentTypeError, match="optax"):
        vocab_parallel_cross_entropy(LOGITS, LABELS)
    with pytest.raises(ShapeError, match=r"has shape \(4,\)"):
        vocab_parallel_cross_entropy(logits, LABELS[:, 0])
    with pytest.raises(ArgumentTypeError, match="integer class indices"):
        vocab_parallel_cross_entropy(logits, LABELS.astype(np.float32))
    with pytest.raises(ArgumentTypeError, match="unknown reduction"):
        vocab_parallel_cross_entropy(logits, LABELS, reduction="avg")
    with pytest.raises(PlacementError, match="partial values"):
        vocab_parallel_cross_entropy(distribute_tensor(LOGITS, mesh, "P,S(2)"), LABELS)
    with pytest.raises(ShapeError, match="rank 3's block"):
        vocab_parallel_cross_entropy(distribute_tensor(LOGITS, mesh, "R,S(1)"), LABELS)  # 6 tokens over 4: refused
    with pytest.raises(ShapeError, match="would be padded"):  # nested uneven split: pads inside the vocabulary
        nested = distribute_tensor(np.ones((8, 61), np.float32), mesh, "None,(dp,tp)")
        vocab_parallel_cross_entropy(nested, np.zeros(8, np.int32))


def test_language_model_with_fsdp_tp_and_vocab_parallel_loss_trains_like_plain_jax(mesh: DeviceMesh) -> None:
    """The 2-D recipe end to end: an MLP block and a column-parallel LM head (tp), the
    parameters fully sharded over dp, the loss on vocabulary-split logits; three SGD steps
    against the same model in plain JAX with optax's loss."""
    from placements2jax import DTensor, apply, colwise, fully_shard, rowwise, unshard

    d, hidden, vocab, batch, seq = 16, 32, 1000, 4, 6
    rng = np.random.default_rng(3)
    host = {
        "up": rng.normal(scale=d**-0.5, size=(d, hidden)).astype(np.float32),
        "down": rng.normal(scale=hidden**-0.5, size=(hidden, d)).astype(np.float32),
        "head": rng.normal(scale=d**-0.5, size=(d, vocab)).astype(np.float32),
    }
    x = rng.normal(size=(batch, seq, d)).astype(np.float32)
    labels = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    plan = {"up": colwise("tp"), "down": rowwise("tp"), "head": colwise("tp")}
    params = fully_shard(host, mesh, "dp", plan=plan)

    def forward(p, h):
        if isinstance(h, DTensor):
            up = apply(jax.nn.gelu, h @ p["up"])
            h = h + (up @ p["down"]).redistribute(placements="S(0),R")
        else:
            h = h + jax.nn.gelu(h @ p["up"]) @ p["down"]
        return h @ p["head"]

    def sharded_loss(p, h):
        logits = forward(unshard(p, "dp"), h)  # (batch, seq, vocab) laid out S(0),S(2)
        return vocab_parallel_cross_entropy(logits, labels).to_jax()

    def plain_loss(p, h):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, h), labels).mean()

    def sgd(loss_fn):
        def step(p, h):
            value, grads = jax.value_and_grad(loss_fn)(p, h)
            return value, jax.tree.map(lambda w, g: w - 0.5 * g, p, grads)

        return jax.jit(step)

    xs = distribute_tensor(x, mesh, "S(0),R")
    sharded_step, plain_step = sgd(sharded_loss), sgd(plain_loss)
    reference = jax.tree.map(jnp.asarray, host)
    losses = []
    for _ in range(3):
        value, params = sharded_step(params, xs)
        ref_value, reference = plain_step(reference, x)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    for name in host:
        np.testing.assert_allclose(np.asarray(params[name].full_tensor()), reference[name], rtol=1e-4, atol=1e-5)


def test_loss_parallel_context_picks_the_vocabulary_parallel_path(mesh: DeviceMesh) -> None:
    """torch's pair: cross_entropy gathers the vocabulary outside loss_parallel(), not inside;
    same values and gradients either way."""
    logits = distribute_tensor(LOGITS, mesh, "S(0),S(2)")

    def loss(x):
        return cross_entropy(x, LABELS).to_jax()

    with loss_parallel():
        inside = jax.jit(jax.grad(loss))  # traced (and its collectives compiled) inside the context
        inside_collectives = compiled_collectives(inside, logits)
        inside_value = jax.jit(loss)(logits)
    outside = jax.jit(jax.grad(loss))
    outside_collectives = compiled_collectives(outside, logits)
    assert {c.op for c in inside_collectives} == {"all-reduce"}
    assert "all-gather" in {c.op for c in outside_collectives}
    np.testing.assert_allclose(inside_value, reference(LOGITS, LABELS), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(loss)(logits), reference(LOGITS, LABELS), rtol=1e-6)
    with loss_parallel():
        grad_inside = np.asarray(inside(logits).full_tensor())
    np.testing.assert_allclose(grad_inside, np.asarray(outside(logits).full_tensor()), rtol=1e-5, atol=1e-7)
    expected = jax.grad(lambda z: reference(z, LABELS))(LOGITS)
    np.testing.assert_allclose(grad_inside, expected, rtol=1e-5, atol=1e-7)
    for reduction in ("sum", "none"):
        with loss_parallel():
            got = cross_entropy(logits, LABELS, reduction=reduction)
        np.testing.assert_allclose(np.asarray(got.full_tensor()), reference(LOGITS, LABELS, reduction), rtol=1e-5)


def test_cross_entropy_equals_torch_inside_and_outside_loss_parallel(mesh: DeviceMesh) -> None:
    torch = pytest.importorskip("torch")
    theirs = torch.nn.functional.cross_entropy(
        torch.tensor(LOGITS.reshape(-1, 64)), torch.tensor(LABELS.reshape(-1), dtype=torch.long)
    )
    logits = distribute_tensor(LOGITS, mesh, "R,S(2)")
    with loss_parallel():
        np.testing.assert_allclose(float(cross_entropy(logits, LABELS).to_jax()), float(theirs), rtol=1e-6)
    np.testing.assert_allclose(float(cross_entropy(logits, LABELS).to_jax()), float(theirs), rtol=1e-6)
    with pytest.raises(ArgumentTypeError, match="logits"):
        cross_entropy(LOGITS, LABELS)
