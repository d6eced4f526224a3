"""RMSNorm, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """``scale * x / sqrt(mean(x**2) + eps)``; the statistics are float32 whatever the input dtype.

    The normalized value is cast back to the input dtype before the scale multiplies it (as Hugging Face does),
    and the result is returned in ``dtype``.

    >>> norm = RMSNorm(64, rngs=nnx.Rngs(0))
    >>> norm(jnp.ones((2, 8, 64))).shape
    (2, 8, 64)
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs  # ones-initialized; accepted so every layer is built the same way
        self.eps = float(eps)
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * normed.astype(x.dtype).astype(self.dtype)
