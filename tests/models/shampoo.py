"""A Shampoo-style optimizer as research code writes it on optax's interface: per 2-D
parameter, exponential moving averages of the Kronecker factors ``L = G G^T`` and
``R = G^T G`` of its gradient, their inverse fourth roots from ``jnp.linalg.eigh``
(``Q diag((w + eps)^(-1/4)) Q^T``, recomputed every step) preconditioning the gradient
on both sides, ``L^(-1/4) G R^(-1/4)``, grafted onto Adam's per-element step norm
(the preconditioned direction rescaled to the norm of Adam's update). Parameters of
other ranks take Adam's update alone."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from placements2jax import DTensor, distribute_tensor


class ShampooState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any
    left: Any  # per parameter (m, m) for an (m, n) matrix, else None
    right: Any  # (n, n), else None


def inverse_fourth_root(statistic: jax.Array, eps: float) -> jax.Array:
    """``(statistic + eps I)^(-1/4)`` of a symmetric positive semi-definite matrix by its
    eigendecomposition (eigenvalues clipped at 0 against rounding)."""
    w, q = jnp.linalg.eigh(statistic)
    return (q * (jnp.maximum(w, 0.0) + eps) ** -0.25) @ q.T


def shampoo(learning_rate: float, b1: float = 0.9, b2: float = 0.999, beta: float = 0.95,
            eps: float = 1e-8, root_eps: float = 1e-6) -> optax.GradientTransformation:
    def init(params: Any) -> ShampooState:
        def factor(p: jax.Array, side: int) -> jax.Array | None:
            return jnp.zeros((p.shape[side],) * 2, p.dtype) if p.ndim == 2 else None

        return ShampooState(
            jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
            jax.tree.map(lambda p: factor(p, 0), params), jax.tree.map(lambda p: factor(p, 1), params),
        )

    def update(grads: Any, state: ShampooState, params: Any = None) -> tuple[Any, ShampooState]:
        del params
        count = state.count + 1
        mu = optax.tree.update_moment(grads, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2)
        mu_hat, nu_hat = optax.tree.bias_correction(mu, b1, count), optax.tree.bias_correction(nu, b2, count)
        adam = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        is_none = lambda x: x is None  # noqa: E731
        left = jax.tree.map(lambda s, g: None if s is None else beta * s + (1 - beta) * g @ g.T,
                            state.left, grads, is_leaf=is_none)
        right = jax.tree.map(lambda s, g: None if s is None else beta * s + (1 - beta) * g.T @ g,
                             state.right, grads, is_leaf=is_none)

        def direction(a: jax.Array, m: jax.Array, lhs: jax.Array | None, rhs: jax.Array | None) -> jax.Array:
            if lhs is None:
                return -learning_rate * a
            d = inverse_fourth_root(lhs, root_eps) @ m @ inverse_fourth_root(rhs, root_eps)
            return -learning_rate * d * (jnp.linalg.norm(a) / (jnp.linalg.norm(d) + eps))

        updates = jax.tree.map(direction, adam, mu_hat, left, right, is_leaf=is_none)
        return updates, ShampooState(count, mu, nu, left, right)

    return optax.GradientTransformation(init, update)


def split_statistics(step: Any) -> Any:
    """``step`` (a models.steps.Step of the Megatron MLP under :func:`shampoo`) with the
    larger Kronecker factors (up's right, down's left: 64 x 64) split by rows over ``tp``,
    as a sharded optimizer keeps them."""
    params, state, *batch = step.args

    def rows(x: DTensor) -> DTensor:
        return distribute_tensor(np.asarray(x.full_tensor()), x.device_mesh, "R,S(0)")

    state = state._replace(left={**state.left, "down": rows(state.left["down"])},
                           right={**state.right, "up": rows(state.right["up"])})
    return replace(step, args=(params, state, *batch))
