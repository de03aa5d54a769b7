"""Language models written the way public pure-JAX model code is written (tiny configs),
for running inference, ``apply`` and ``check`` on real training code.

* :mod:`.gpt2`: GPT-2 (nanoGPT-style): stacked blocks under ``lax.scan``, PRNG key
  splitting for dropout, ``table[idx]`` embeddings, layer norm, causal attention (by hand
  or ``jax.nn.dot_product_attention``), cross-entropy with ``take_along_axis``.
* :mod:`.llama`: Llama: RMSNorm, complex rotary embeddings, SwiGLU, grouped-query attention.
* :mod:`.stacked`: scan-over-layers code (MaxText / levanter style): stacked weights under
  ``lax.scan`` (optionally rematerialized), a replicated embedding, bfloat16 compute,
  gradient accumulation over microbatches.

Each has ``Config``, ``init``, ``loss``, ``make_optimizer``, ``train_step`` and
``megatron_plan`` (for :func:`placements2jax.distribute_pytree` on a (dp, tp) mesh);
:mod:`.common` lays out optimizer state like its parameters.
"""
