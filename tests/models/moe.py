"""A mixture-of-experts language model as Mixtral / Switch-style JAX code writes it: an
embedding, one pre-norm attention-free MoE block (a softmax router, ``lax.top_k`` top-2
experts, their weights renormalized, dispatch and combine by ``jax.nn.one_hot`` and
einsums over every expert, a load-balancing auxiliary loss), a head; the experts'
stacked weights split over the tensor-parallel axis (expert parallelism). ``dispatch=
"sort"`` routes as dropless MoE code does instead: the (token, expert) pairs sorted by
expert (``jnp.argsort``), each pair's token and expert weights gathered, the results
scatter-added back to their tokens (``.at[].add``). ``dispatch="ragged"`` is MaxText's
dropless sparse-matmul MoE (megablox-style): the (token, expert) rows sorted by expert,
``group_sizes = jnp.bincount(...)``, SwiGLU experts ``w1`` / ``w3`` / ``w2`` computed by
``lax.ragged_dot`` (one matmul per expert over its rows), unsorted and combined by the
routing weights; their hidden dim split over tp (Megatron's column / row split).
``dispatch="shard_map"`` is expert parallelism as shard_map code writes it (the Switch
Transformer's capacity-based dispatch, GShard's all-to-alls): the tokens split over every
mesh axis, each device routes its own into per-expert slots of a fixed capacity, sends
each expert's slots to the device holding it (``lax.all_to_all`` over tp), runs its
experts and sends the results back; the load-balancing statistics are ``lax.pmean``-ed
over the mesh (``Config.ep_mesh``: the mesh with Auto axes the region runs on)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from placements2jax import colwise

from .common import train_step as common_train_step

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    hidden: int = 64
    experts: int = 4
    top_k: int = 2
    aux_weight: float = 0.01
    dispatch: str = "einsum"  # or "sort", "ragged", "shard_map"
    ep_mesh: Any = None  # dispatch="shard_map": the jax Mesh (Auto axes dp, tp) of its region
    capacity_factor: float = 2.0


def init(key: jax.Array, cfg: Config) -> Params:
    k_emb, k_router, k_in, k_out, k_head = jax.random.split(key, 5)
    w_in = jax.random.normal(k_in, (cfg.experts, cfg.dim, cfg.hidden)) / cfg.dim ** 0.5
    w_out = jax.random.normal(k_out, (cfg.experts, cfg.hidden, cfg.dim)) / cfg.hidden ** 0.5
    if cfg.dispatch == "ragged":
        gate = jax.random.normal(jax.random.fold_in(key, 5), w_in.shape) / cfg.dim ** 0.5
        experts = {"w1": gate, "w3": w_in, "w2": w_out}
    else:
        experts = {"w_in": w_in, "w_out": w_out}
    return {
        "embedding": jax.random.normal(k_emb, (cfg.vocab, cfg.dim), jnp.float32),
        "norm": jnp.ones((cfg.dim,)),
        "router": jax.random.normal(k_router, (cfg.dim, cfg.experts)) / cfg.dim ** 0.5,
        **experts,
        "head": jax.random.normal(k_head, (cfg.dim, cfg.vocab)) / cfg.dim ** 0.5,
    }


def moe(x: jax.Array, params: Params, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """The experts' mixture of ``x`` (batch, seq, dim) and the load-balancing loss."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)  # (batch, seq, experts)
    top_probs, top_experts = lax.top_k(probs, cfg.top_k)
    top_probs = top_probs / top_probs.sum(axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(top_experts, cfg.experts, dtype=x.dtype)  # (batch, seq, top_k, experts)
    combine = jnp.einsum("bsk,bske->bse", top_probs, chosen)
    hidden = jax.nn.silu(jnp.einsum("bsd,edh->bseh", x, params["w_in"]))
    out = jnp.einsum("bseh,ehd,bse->bsd", hidden, params["w_out"], combine)
    routed = chosen.sum(axis=2).mean(axis=(0, 1)) / cfg.top_k  # the fraction of tokens each expert gets
    aux = cfg.experts * jnp.sum(routed * probs.mean(axis=(0, 1)))
    return out, aux


def sorted_moe(x: jax.Array, params: Params, cfg: Config) -> jax.Array:
    """:func:`moe`'s mixture routed token by token: the (token, expert) pairs sorted by
    expert, computed with their own expert's weights, added back to their tokens."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(tokens @ params["router"], axis=-1)
    top_probs, top_experts = lax.top_k(probs, cfg.top_k)
    top_probs = top_probs / top_probs.sum(axis=-1, keepdims=True)
    order = jnp.argsort(top_experts.reshape(-1))
    token_of = jnp.repeat(jnp.arange(tokens.shape[0]), cfg.top_k)[order]
    expert_of = top_experts.reshape(-1)[order]
    hidden = jax.nn.silu(jnp.einsum("td,tdh->th", tokens[token_of], params["w_in"][expert_of]))
    out = jnp.einsum("th,thd->td", hidden, params["w_out"][expert_of]) * top_probs.reshape(-1)[order][:, None]
    return jnp.zeros_like(tokens).at[token_of].add(out).reshape(x.shape)


def ragged_moe(x: jax.Array, params: Params, cfg: Config) -> jax.Array:
    """The dropless mixture as MaxText's sparse-matmul MoE writes it: each token's top-k
    (token, expert) rows sorted by expert, ``group_sizes`` rows per expert, SwiGLU
    experts by ``lax.ragged_dot`` (no capacity, no padding), the rows unsorted and
    combined by the renormalized routing weights."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(tokens @ params["router"], axis=-1)
    top_probs, top_experts = lax.top_k(probs, cfg.top_k)
    top_probs = top_probs / top_probs.sum(axis=-1, keepdims=True)
    flat = top_experts.reshape(-1)
    order = jnp.argsort(flat)
    rows = tokens[order // cfg.top_k]  # (tokens * top_k, dim), sorted by expert
    group_sizes = jnp.bincount(flat, length=cfg.experts)
    gate = lax.ragged_dot(rows, params["w1"], group_sizes)
    up = lax.ragged_dot(rows, params["w3"], group_sizes)
    out = lax.ragged_dot(jax.nn.silu(gate) * up, params["w2"], group_sizes)
    out = out[jnp.argsort(order)].reshape(tokens.shape[0], cfg.top_k, -1)
    return jnp.einsum("tkd,tk->td", out, top_probs).reshape(x.shape)


def expert_parallel_moe(x: jax.Array, params: Params, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """:func:`moe`'s mixture with the experts split over tp, as a shard_map region: each
    device's tokens (batch over dp, sequence over tp) dispatched into ``capacity`` slots
    per expert (first come first served, the overflow dropped), all-to-all'd to the
    experts' devices and back, combined by the routing weights; the auxiliary loss from
    the mesh-wide means."""

    def local(x: jax.Array, router: jax.Array, w_in: jax.Array, w_out: jax.Array) -> tuple[jax.Array, jax.Array]:
        tokens = x.reshape(-1, x.shape[-1])
        probs = jax.nn.softmax(tokens @ router, axis=-1)
        top_probs, top_experts = lax.top_k(probs, cfg.top_k)
        top_probs = top_probs / top_probs.sum(axis=-1, keepdims=True)
        capacity = int(cfg.capacity_factor * tokens.shape[0] * cfg.top_k / cfg.experts)
        chosen = jax.nn.one_hot(top_experts, cfg.experts, dtype=x.dtype).reshape(-1, cfg.experts)
        position = jnp.cumsum(chosen, axis=0) * chosen - 1  # each (token, k) pair's slot in its expert's
        slots = jax.nn.one_hot(position.astype(jnp.int32), capacity, dtype=x.dtype)
        slots = slots.reshape(tokens.shape[0], cfg.top_k, cfg.experts, capacity)
        dispatch = slots.sum(axis=1)  # (tokens, experts, capacity)
        combine = jnp.einsum("tkec,tk->tec", slots, top_probs)
        sent = jnp.einsum("tec,td->ecd", dispatch, tokens)
        arrived = lax.all_to_all(sent, "tp", 0, 1, tiled=True)  # (local experts, tp * capacity, dim)
        hidden = jax.nn.silu(jnp.einsum("ecd,edh->ech", arrived, w_in))
        done = lax.all_to_all(jnp.einsum("ech,ehd->ecd", hidden, w_out), "tp", 1, 0, tiled=True)
        mixed = jnp.einsum("tec,ecd->td", combine, done).reshape(x.shape)
        routed = lax.pmean(chosen.mean(axis=0), ("dp", "tp")) / cfg.top_k
        aux = cfg.experts * jnp.sum(routed * lax.pmean(probs.mean(axis=0), ("dp", "tp")))
        return mixed, aux

    region = jax.shard_map(local, mesh=cfg.ep_mesh, in_specs=(P("dp", "tp"), P(), P("tp"), P("tp")),
                           out_specs=(P("dp", "tp"), P()))
    return region(x, params["router"], params["w_in"], params["w_out"])


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * weight


def loss(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    x = params["embedding"][tokens]
    if cfg.dispatch == "sort":
        mixed, aux = sorted_moe(rms_norm(x, params["norm"]), params, cfg), 0.0
    elif cfg.dispatch == "shard_map":
        mixed, aux = expert_parallel_moe(rms_norm(x, params["norm"]), params, cfg)
    elif cfg.dispatch == "ragged":
        mixed, aux = ragged_moe(rms_norm(x, params["norm"]), params, cfg), 0.0
    else:
        mixed, aux = moe(rms_norm(x, params["norm"]), params, cfg)
    logits = (x + mixed) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean() + cfg.aux_weight * aux


train_step = partial(common_train_step, loss)  # (params, opt_state, tokens, targets, cfg, optimizer=None)


def megatron_plan(dispatch: str = "einsum") -> dict[str, Any]:
    """On a (dp, tp) mesh: the experts split over tp (their leading dim; ``"ragged"``
    dispatch: their hidden dim, ``w1`` / ``w3`` by columns and ``w2`` by rows, as
    Megatron splits an MLP), the head vocab-parallel; the embedding, norm and router
    replicated."""
    if dispatch == "ragged":
        return {r"w1|w3": "R,S(2)", r"w2": "R,S(1)", r"head": colwise("tp")}
    return {r"w_in|w_out": "R,S(0)", r"head": colwise("tp")}
