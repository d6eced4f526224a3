"""The SwiGLU feed-forward block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.linear import DEFAULT_INIT, Linear

_HIDDEN = ("activation_batch", "activation_length", "activation_mlp")
_OUT = ("activation_batch", "activation_length", "activation_embed")


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` with weights named ``("embed", "mlp")`` / ``("mlp", "embed")``.

    >>> mlp = SwiGLU(64, 256, rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((2, 8, 64))).shape
    (2, 8, 64)
    """

    def __init__(
        self,
        features: int,
        hidden: int,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: nnx.initializers.Initializer = DEFAULT_INIT,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.gate = Linear(features, hidden, kernel_names=("embed", "mlp"), **kw)
        self.up = Linear(features, hidden, kernel_names=("embed", "mlp"), **kw)
        self.down = Linear(hidden, features, kernel_names=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(self.gate(x, _HIDDEN)) * self.up(x, _HIDDEN)
        return self.down(hidden, _OUT)
