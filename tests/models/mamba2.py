"""A Mamba-2-style LM in pure JAX, its state-space duality (SSD) computed in chunks as the
paper's minimal reference (``ssd_minimal_discrete``) writes it: a scalar decay per head,
``jnp.cumsum`` of the log decays and their segment sums (``cumsum[..., :, None] -
cumsum[..., None, :]`` masked below the diagonal with ``-inf``), the intra-chunk outputs
as one 4-operand einsum, chunk states decayed to the chunk's end, an inter-chunk
recurrence over the chunk states (segment sums of the chunks' totals, ``jnp.pad``-ed
with the zero initial state), the readout of the carried states; causal depthwise convs,
softplus step sizes, a gated RMSNorm, a vocab-parallel head. Tensor parallelism as
Mamba-2's: the heads (and their inner channels) over ``tp``, B and C (one group)
computed whole on every device (their projection replicated)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from placements2jax import Replicate, Shard, colwise, rowwise

from .common import train_step as common_train_step
from .mamba import causal_conv, rms_norm

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 8
    head_dim: int = 8  # inner = heads * head_dim
    state: int = 8
    conv: int = 4
    chunk: int = 4
    layers: int = 1


def init(key: jax.Array, cfg: Config) -> Params:
    keys = iter(jax.random.split(key, 2 + 6 * cfg.layers))
    inner = cfg.heads * cfg.head_dim

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])

    layers = [
        {
            "norm": jnp.ones((cfg.dim,)),
            "in_proj": dense((cfg.dim, 2, inner)),  # x and the gate z
            "bc_proj": dense((cfg.dim, 2 * cfg.state)),
            "dt_proj": dense((cfg.dim, cfg.heads)),
            "conv_x": dense((cfg.conv, inner)),
            "conv_bc": dense((cfg.conv, 2 * cfg.state)),
            "dt_bias": jnp.full((cfg.heads,), -2.0),
            "A_log": jnp.log(jnp.linspace(1.0, 8.0, cfg.heads)),
            "D": jnp.ones((cfg.heads,)),
            "gate_norm": jnp.ones((inner,)),
            "out_proj": dense((inner, cfg.dim)),
        }
        for _ in range(cfg.layers)
    ]
    return {"embedding": jax.random.normal(next(keys), (cfg.vocab, cfg.dim)) * 0.02, "layers": layers,
            "norm_f": jnp.ones((cfg.dim,)), "head": dense((cfg.dim, cfg.vocab))}


def megatron_plan(tp: str = "tp") -> dict[str, Any]:
    """Mamba-2's tensor parallelism: the heads over ``tp`` (in_proj's and the x conv's
    channels, dt's, A's, D's and the gated norm's heads split, out_proj row-parallel),
    B and C's projection and conv replicated, the head vocab-parallel."""
    return {
        r"layers/\d+/in_proj": [Replicate(), Shard(2)],
        r"layers/\d+/(dt_proj|conv_x|dt_bias|A_log|D|gate_norm)": colwise(tp),
        r"layers/\d+/out_proj": rowwise(tp),
        r"head": colwise(tp),
    }


def segsum(x: jax.Array) -> jax.Array:
    """``out[..., i, j] = sum(x[..., j + 1:i + 1])`` for ``j <= i``, else ``-inf``."""
    t = x.shape[-1]
    cumsum = jnp.cumsum(x, axis=-1)
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), cumsum[..., :, None] - cumsum[..., None, :], -jnp.inf)


def ssd(x: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array, chunk: int) -> jax.Array:
    """The SSD's outputs: x (batch, seq, heads, head_dim), a the log decays (batch, seq,
    heads), b, c (batch, seq, state) shared by the heads."""
    batch, seq, heads, head_dim = x.shape
    chunks = seq // chunk
    x = x.reshape(batch, chunks, chunk, heads, head_dim)
    b, c = (m.reshape(batch, chunks, chunk, -1) for m in (b, c))
    a = a.reshape(batch, chunks, chunk, heads).transpose(0, 3, 1, 2)  # (batch, heads, chunks, chunk)
    a_cumsum = jnp.cumsum(a, axis=-1)
    y_diag = jnp.einsum("bcln,bcsn,bhcls,bcshp->bclhp", c, b, jnp.exp(segsum(a)), x)
    decay_states = jnp.exp(a_cumsum[..., -1:] - a_cumsum)
    states = jnp.einsum("bcln,bhcl,bclhp->bchpn", b, decay_states, x)
    states = jnp.concatenate([jnp.zeros_like(states[:, :1]), states], axis=1)
    decay_chunk = jnp.exp(segsum(jnp.pad(a_cumsum[..., -1], ((0, 0), (0, 0), (1, 0)))))
    states = jnp.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    y_off = jnp.einsum("bcln,bchpn,bhcl->bclhp", c, states, jnp.exp(a_cumsum))
    return (y_diag + y_off).reshape(batch, seq, heads, head_dim)


def mixer(x: jax.Array, p: Params, cfg: Config) -> jax.Array:
    B, T, _ = x.shape
    xz = jnp.einsum("bld,dsi->bsli", x, p["in_proj"])
    u, z = jax.nn.silu(causal_conv(xz[:, 0], p["conv_x"], 0.0)), xz[:, 1]
    bc = jax.nn.silu(causal_conv(x @ p["bc_proj"], p["conv_bc"], 0.0))
    b, c = jnp.split(bc, 2, axis=-1)
    dt = jax.nn.softplus(x @ p["dt_proj"] + p["dt_bias"])  # (B, T, heads)
    u = u.reshape(B, T, cfg.heads, cfg.head_dim)
    y = ssd(u * dt[..., None], -jnp.exp(p["A_log"]) * dt, b, c, cfg.chunk) + u * p["D"][:, None]
    y = y.reshape(B, T, -1)
    return rms_norm(y * jax.nn.silu(z), p["gate_norm"]) @ p["out_proj"]


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["embedding"][tokens]
    for p in params["layers"]:
        x = x + mixer(rms_norm(x, p["norm"]), p, cfg)
    logits = rms_norm(x, params["norm_f"]) @ params["head"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)
