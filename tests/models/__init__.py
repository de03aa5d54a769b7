"""Language models written the way public pure-JAX model code is written (tiny configs),
for running inference, ``apply`` and ``check`` on real training code.

* :mod:`.gpt2`: GPT-2 (nanoGPT-style): stacked blocks under ``lax.scan``, PRNG key
  splitting for dropout, ``table[idx]`` embeddings, layer norm, causal attention (by hand
  or ``jax.nn.dot_product_attention``), cross-entropy with ``take_along_axis``.
* :mod:`.llama`: Llama: RMSNorm, complex rotary embeddings, SwiGLU, grouped-query attention.
* :mod:`.stacked`: scan-over-layers code (MaxText / levanter style): stacked weights under
  ``lax.scan`` (optionally rematerialized), a replicated embedding, bfloat16 compute,
  gradient accumulation over microbatches.
* :mod:`.llama_scan`: Llama (GQA + RoPE on real halves) under ``lax.scan`` over stacked
  layers, einsum or ``jax.nn.dot_product_attention``, float32 or bfloat16 compute.
* :mod:`.moe`: a top-2 mixture of experts (``lax.top_k`` router), one_hot / einsum or
  sort / gather / scatter-add dispatch, the experts split over tp.
* :mod:`.nnx_scan` (Flax NNX: ``nnx.vmap``-made layers under ``nnx.scan`` + ``nnx.remat``,
  the stateful ``nnx.Optimizer`` step) and :mod:`.eqx_scan` (Equinox: ``eqx.filter_vmap``-made
  layers under ``lax.scan`` via ``eqx.partition`` / ``combine``): their own module and
  optimizer objects, as nnx_lm / eqx_lm.
* :mod:`.decode`: sampling from :mod:`.llama` with a key/value cache under ``lax.fori_loop``
  (``dynamic_update_slice`` writes, ``jax.random.categorical``): generation, not training.

The pure-JAX ones have ``Config``, ``init``, ``loss``, ``make_optimizer``, ``train_step`` and
``megatron_plan`` (for :func:`placements2jax.distribute_pytree` on a (dp, tp) mesh);
:mod:`.common` lays out optimizer state like its parameters.
"""
