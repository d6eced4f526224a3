"""A linear layer over any number of input and output dims, with logical axis names on its weights."""

from __future__ import annotations

import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.spec import weight_einsum
from nnx_zoo.sharding import shard

Initializer = nnx.initializers.Initializer
DEFAULT_INIT: Initializer = nnx.initializers.normal(0.02)  # HF's initializer_range default


def _as_tuple(features: int | Sequence[int]) -> tuple[int, ...]:
    return (int(features),) if isinstance(features, int) else tuple(int(f) for f in features)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` contracting the trailing ``in_features`` dims of ``x``.

    The kernel has shape ``(*in_features, *out_features)`` so head dims can stay separate (a query projection
    is ``Linear(embed, (heads, head_dim), kernel_names=("embed", "heads", "kv"))``). ``out_names`` on a call
    names the output activation's dims, which lays it out on the ambient mesh (and is required under an
    Explicit mesh whenever the contraction is sharded).

    >>> proj = Linear(64, (4, 16), kernel_names=("embed", "heads", "kv"), rngs=nnx.Rngs(0))
    >>> proj(jnp.ones((2, 8, 64))).shape
    (2, 8, 4, 16)
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        kernel_names: Sequence[str | None],
        use_bias: bool = False,
        bias_names: Sequence[str | None] | None = None,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: Initializer = DEFAULT_INIT,
        rngs: nnx.Rngs,
    ):
        self.in_features = _as_tuple(in_features)
        self.out_features = _as_tuple(out_features)
        shape = self.in_features + self.out_features
        if len(kernel_names) != len(shape):
            raise ValueError(f"kernel of shape {shape} needs {len(shape)} logical names, got {tuple(kernel_names)}")
        self.dtype = dtype
        self.kernel_names = tuple(kernel_names)  # the resolver's names, also for weight_einsum under Auto meshes
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), shape, param_dtype), out_sharding=tuple(kernel_names), eager_sharding=False
        )
        if use_bias:
            # Biases are replicated by default: adding a vector sharded on an axis the activation also uses fails
            # under Explicit meshes, and biases are tiny.
            names = tuple(bias_names) if bias_names is not None else ("bias",) + (None,) * (len(self.out_features) - 1)
            self.bias = nnx.Param(
                jnp.zeros(self.out_features, param_dtype), out_sharding=names, eager_sharding=False
            )
        else:
            self.bias = None

    def __call__(self, x: jax.Array, out_names: Sequence[str | None] | None = None) -> jax.Array:
        n_in, n_out = len(self.in_features), len(self.out_features)
        if x.shape[x.ndim - n_in :] != self.in_features:
            raise ValueError(f"Linear expects trailing dims {self.in_features}, got input of shape {x.shape}")
        letters = string.ascii_lowercase
        ins, outs = letters[:n_in], letters[n_in : n_in + n_out]
        lead = letters[n_in + n_out : n_in + n_out + x.ndim - n_in]
        equation = f"{lead}{ins},{ins}{outs}->{lead}{outs}"
        x, kernel = x.astype(self.dtype), self.kernel[...].astype(self.dtype)
        if out_names is None:
            return self._add_bias(jnp.einsum(equation, x, kernel))
        return shard(self._add_bias(weight_einsum(equation, x, kernel, out_names, weight_names=self.kernel_names)),
                     out_names)

    def _add_bias(self, y: jax.Array) -> jax.Array:
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)
