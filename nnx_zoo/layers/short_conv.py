"""The short causal depthwise convolution that linear-attention layers (Gated DeltaNet, KDA) run over their q/k/v
projections before the recurrence: ``y_t = act(sum_j w[:, j] * x_{t - (K-1) + j})`` per channel, kernel ``K`` (4).

Within documents only: a tap that would reach into another document (packed ``segment_ids``) or into padding
(``token_mask``, as transformers zeroes padding positions before its convolution) reads 0. Decoding carries the
last ``K - 1`` inputs (``tail``) in the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.sharding import shard

ACTIVATIONS = {"silu": jax.nn.silu, "identity": lambda x: x}


def causal_conv1d(x: jax.Array, weight: jax.Array, *, activation: str = "silu", tail: jax.Array | None = None,
                  segment_ids: jax.Array | None = None, token_mask: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """``(y [b, s, c], new tail [b, K-1, c])`` for ``x [b, s, c]`` and a depthwise ``weight [c, K]``.

    ``tail [b, K-1, c]``: the inputs before ``x`` (a decoding cache's; None: zeros, the start of a sequence).
    ``segment_ids [b, s]``: a tap never reads another document (the tail counts as the first token's document);
    ``token_mask [b, s]``: padding inputs read as 0.

    >>> y, tail = causal_conv1d(x, w)                       # a prompt
    >>> y1, tail = causal_conv1d(x_next, w, tail=tail)      # one more token
    """
    b, s, c = x.shape
    taps = weight.shape[1]
    if weight.shape[0] != c:
        raise ValueError(f"weight {weight.shape} must be [channels={c}, kernel]")
    if token_mask is not None:
        x = jnp.where(token_mask.astype(bool)[:, :, None], x, 0)
    before = jnp.zeros((b, taps - 1, c), x.dtype) if tail is None else tail.astype(x.dtype)
    padded = jnp.concatenate([before, x], axis=1)  # [b, K-1+s, c]
    seg = None
    if segment_ids is not None:  # the tail belongs to the first token's document
        seg = jnp.concatenate([jnp.repeat(segment_ids[:, :1], taps - 1, axis=1), segment_ids], axis=1)
    y = jnp.zeros((b, s, c), jnp.float32)
    for j in range(taps):  # tap j reads the input K-1-j steps back
        window = jax.lax.slice_in_dim(padded, j, j + s, axis=1).astype(jnp.float32)
        if seg is not None:
            window = jnp.where((jax.lax.slice_in_dim(seg, j, j + s, axis=1) == segment_ids)[:, :, None], window, 0.0)
        y = y + window * weight[:, j].astype(jnp.float32)
    new_tail = jax.lax.slice_in_dim(padded, s, s + taps - 1, axis=1) if taps > 1 else padded[:, :0]
    return ACTIVATIONS[activation](y).astype(x.dtype), new_tail


class ShortConv(nnx.Module):
    """A depthwise causal convolution over ``channels`` with kernel ``kernel`` and no bias (``causal_conv1d``).

    ``weight [channels, kernel]`` carries the logical names ``names`` (HF stores it ``[channels, 1, kernel]``).

    >>> conv = ShortConv(96, 4, rngs=nnx.Rngs(0))
    >>> y, tail = conv(jnp.ones((2, 10, 96)))
    >>> y.shape, tail.shape
    ((2, 10, 96), (2, 3, 96))
    """

    def __init__(self, channels: int, kernel: int = 4, *, activation: str = "silu",
                 names: tuple[str | None, str | None] = (None, None), dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        bound = 1.0 / kernel**0.5  # PyTorch's Conv1d default (fan_in = kernel for a depthwise filter)
        init = jax.random.uniform(rngs.params(), (channels, kernel), param_dtype, -bound, bound)
        self.weight = nnx.Param(init, out_sharding=names, eager_sharding=False)
        self.activation, self.dtype, self.names = activation, dtype, names

    def __call__(self, x: jax.Array, *, tail: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        y, tail = causal_conv1d(x.astype(self.dtype), self.weight[...].astype(self.dtype),
                                activation=self.activation, tail=tail, segment_ids=segment_ids,
                                token_mask=token_mask)
        return shard(y, ("activation_batch", "activation_length", self.names[0])), tail
