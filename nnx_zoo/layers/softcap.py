"""Logit soft-capping: ``cap * tanh(x / cap)``, which bounds values smoothly to ``(-cap, cap)`` (attention scores
take it through ``attention(..., softcap=)``; an output head's logits through this function)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` in ``x``'s dtype; ``cap=None`` returns ``x`` unchanged.

    >>> soft_cap(jnp.array([0.0, 10.0, 1000.0]), 30.0)
    Array([ 0.      ,  9.641, 30.      ], dtype=float32)
    """
    if cap is None:
        return x
    cap_ = jnp.asarray(cap, x.dtype)
    return jnp.tanh(x / cap_) * cap_
