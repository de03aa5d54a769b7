"""Sampling from Llama (tests/models/llama.py) with a key/value cache, as public JAX
generation code writes it: a ``lax.fori_loop`` over the new tokens carrying the cache
(one (batch, max_len, kv_heads, head_dim) key and value buffer per layer, written at the
step's position with ``lax.dynamic_update_slice``), the last token, the PRNG key and the
tokens sampled so far (``.at[:, i].set``); one token per step through the layers, its
rotary angle read at the position, attention masked past it, then temperature sampling
with ``jax.random.categorical``. Laid out as training lays Llama out (the Megatron plan),
the cache split over ``dp`` by batch and over ``tp`` by kv head, the tokens over ``dp``.
:func:`complete` prefills a prompt first (the whole prompt through the layers at once, its
keys and values written into the cache), takes its next token greedily, then samples."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from placements2jax import DeviceMesh, distribute_pytree, distribute_tensor

from . import llama

Cache = list[tuple[jax.Array, jax.Array]]  # per layer, (keys, values)

BATCH, MAX_LEN, STEPS = 4, 16, 6


def _projected(
    x: jax.Array, p: llama.Params, freqs_cis: jax.Array, cfg: llama.Config
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values (batch, length, heads or kv_heads, head_dim) of ``x``
    (batch, length, dim), the queries and keys rotated by ``freqs_cis``."""
    batch, length, _ = x.shape
    head_dim = cfg.dim // cfg.heads
    q = llama.apply_rotary_emb((x @ p["wq"]).reshape(batch, length, cfg.heads, head_dim), freqs_cis)
    k = llama.apply_rotary_emb((x @ p["wk"]).reshape(batch, length, cfg.kv_heads, head_dim), freqs_cis)
    v = (x @ p["wv"]).reshape(batch, length, cfg.kv_heads, head_dim)
    return q, k, v


def _attended(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array, cfg: llama.Config) -> jax.Array:
    """Grouped-query attention of ``q`` over ``keys`` and ``values`` (their kv heads
    repeated), the scores masked where ``visible`` (broadcast to (batch, heads, queries,
    keys)) is False: (batch, queries, dim)."""
    repeats = cfg.heads // cfg.kv_heads
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(keys, repeats, axis=2)) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(visible, scores, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), jnp.repeat(values, repeats, axis=2))
    return out.reshape(*q.shape[:2], -1)


def decode_step(
    params: llama.Params, cache: Cache, token: jax.Array, pos: jax.Array, cfg: llama.Config
) -> tuple[jax.Array, Cache]:
    """The next token's logits (batch, vocab) after ``token`` (batch,) at position ``pos``,
    and the cache with its keys and values written there."""
    head_dim = cfg.dim // cfg.heads
    h = params["tok_embeddings"][token][:, None, :]
    freqs_cis = llama.precompute_freqs_cis(head_dim, cache[0][0].shape[1], cfg.rope_theta)
    freqs = jax.lax.dynamic_index_in_dim(freqs_cis, pos, keepdims=False)
    written = []
    for layer, (keys, values) in zip(params["layers"], cache):
        x = llama.rms_norm(h, layer["attention_norm"], cfg.norm_eps)
        p = layer["attention"]
        q, k, v = _projected(x, p, freqs[None], cfg)
        keys = jax.lax.dynamic_update_slice(keys, k, (0, pos, 0, 0))
        values = jax.lax.dynamic_update_slice(values, v, (0, pos, 0, 0))
        visible = (jnp.arange(keys.shape[1]) <= pos)[None, None, None, :]
        h = h + _attended(q, keys, values, visible, cfg) @ p["wo"]
        h = h + llama.feed_forward(llama.rms_norm(h, layer["ffn_norm"], cfg.norm_eps), layer["feed_forward"])
        written.append((keys, values))
    return (llama.rms_norm(h, params["norm"], cfg.norm_eps) @ params["output"])[:, 0], written


def generate(
    params: llama.Params, cache: Cache, last: jax.Array, key: jax.Array, cfg: llama.Config,
    steps: int = STEPS, temperature: float = 0.8, start: int = 0,
) -> tuple[jax.Array, Cache]:
    """``steps`` tokens (batch, steps) sampled after ``last`` (batch,), the cache filled
    from position ``start``, and the cache."""

    def body(i: jax.Array, carry: tuple[Cache, jax.Array, jax.Array, jax.Array]) -> tuple:
        cache, token, key, sampled = carry
        logits, cache = decode_step(params, cache, token, start + i, cfg)
        key, sub = jax.random.split(key)
        token = jax.random.categorical(sub, logits / temperature, axis=-1).astype(jnp.int32)
        return cache, token, key, sampled.at[:, i].set(token)

    sampled = jnp.zeros((last.shape[0], steps), jnp.int32)
    cache, _, _, sampled = jax.lax.fori_loop(0, steps, body, (cache, last, key, sampled))
    return sampled, cache


def prefill(params: llama.Params, cache: Cache, prompt: jax.Array, cfg: llama.Config) -> tuple[jax.Array, Cache]:
    """The prompt (batch, length) through the layers at once, causally masked: the last
    position's logits (batch, vocab) and the cache with the prompt's keys and values
    written from position 0."""
    length = prompt.shape[1]
    h = params["tok_embeddings"][prompt]
    freqs_cis = llama.precompute_freqs_cis(cfg.dim // cfg.heads, length, cfg.rope_theta)
    causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
    written = []
    for layer, (keys, values) in zip(params["layers"], cache):
        x = llama.rms_norm(h, layer["attention_norm"], cfg.norm_eps)
        p = layer["attention"]
        q, k, v = _projected(x, p, freqs_cis, cfg)
        written.append((jax.lax.dynamic_update_slice(keys, k, (0, 0, 0, 0)),
                        jax.lax.dynamic_update_slice(values, v, (0, 0, 0, 0))))
        h = h + _attended(q, k, v, causal, cfg) @ p["wo"]
        h = h + llama.feed_forward(llama.rms_norm(h, layer["ffn_norm"], cfg.norm_eps), layer["feed_forward"])
    return llama.rms_norm(h[:, -1], params["norm"], cfg.norm_eps) @ params["output"], written


def complete(
    params: llama.Params, cache: Cache, prompt: jax.Array, key: jax.Array, cfg: llama.Config, steps: int = STEPS,
) -> tuple[jax.Array, Cache]:
    """The prompt prefilled (:func:`prefill`), its next token taken greedily (argmax), then
    ``steps`` tokens sampled after it (:func:`generate` from the prompt's length): the
    sampled tokens (batch, steps) and the cache."""
    logits, cache = prefill(params, cache, prompt, cfg)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return generate(params, cache, first, key, cfg, steps, start=prompt.shape[1])


def empty_cache(cfg: llama.Config, batch: int = BATCH, max_len: int = MAX_LEN) -> Cache:
    shape = (batch, max_len, cfg.kv_heads, cfg.dim // cfg.heads)
    return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(cfg.layers)]


def completion_args(mesh: DeviceMesh, cfg: llama.Config, length: int = 6) -> tuple[Any, ...]:
    """(params, cache, prompt, key) as :func:`sampling_args`' with a prompt (batch,
    ``length``) split over ``dp`` by batch in the last tokens' place."""
    params, cache, _, key = sampling_args(mesh, cfg)
    prompt = np.arange(BATCH * length, dtype=np.int32).reshape(BATCH, length) * 7 % cfg.vocab
    return params, cache, distribute_tensor(prompt, mesh, "S(0),R"), key


def sampling_args(mesh: DeviceMesh, cfg: llama.Config) -> tuple[Any, ...]:
    """(params, cache, last tokens, key) on ``mesh`` (its ``dp`` and ``tp`` axes): the
    Megatron plan, the cache split over ``dp`` by batch and ``tp`` by kv head, the last
    tokens over ``dp``."""
    params = distribute_pytree(llama.init(jax.random.key(0), cfg), mesh, llama.megatron_plan())
    cache = [tuple(distribute_tensor(c, mesh, "S(0),S(2)") for c in layer) for layer in empty_cache(cfg)]
    last = distribute_tensor(np.arange(BATCH, dtype=np.int32), mesh, "S(0),R")
    return params, cache, last, jax.random.key(1)
