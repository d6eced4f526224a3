"""Manifold-constrained hyper-connections (mHC): the residual stream widened to ``n`` streams.

A model with hyper-connections carries ``h [batch, seq, n, embed]`` between blocks instead of one residual. Each
block (attention or MLP) reads one collapse of the streams and writes its output back into all of them, while
the streams mix through an ``n x n`` matrix:

    collapsed = sum_j pre_j * h_j                        (the block's input)
    h'_k      = post_k * block(collapsed) + sum_j comb_jk * h_j

``pre``, ``post`` and ``comb`` are computed per token from the streams themselves, in float32: the streams are
flattened, RMS-normalized without a scale, and projected by ``fn`` to ``2n + n^2`` numbers, which
``sigmoid(w * scale + base)`` turns into ``pre`` (+ eps) and ``post`` (times 2), and a softmax into ``comb``,
then made doubly stochastic by Sinkhorn-Knopp (rows and columns alternately normalized), so mixing never grows the
residual. ``HyperHead`` is the last collapse, before the final norm. DeepSeek-V4 uses them (``hc_mult`` streams,
``hc_sinkhorn_iters``, ``hc_eps``); the formulas follow transformers' ``DeepseekV4HyperConnection``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.linear import DEFAULT_INIT
from nnx_zoo.layers.spec import weight_einsum
from nnx_zoo.sharding import shard

STREAMS = ("activation_batch", "activation_length", "activation_hc", "activation_embed")
_MIX = ("activation_batch", "activation_length", None)


def sinkhorn(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """``comb [..., n, n]`` (positive) made doubly stochastic: columns normalized first, then ``iters - 1`` rounds
    of rows then columns, each sum offset by ``eps`` (transformers' order)."""
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


def _mixes(h: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """The per-token mixing logits ``[batch, seq, mix]`` of streams ``h [batch, seq, n, embed]``: the flattened
    streams, RMS-normalized without a scale, times ``fn [n, embed, mix]``, in float32 (the streams and the width
    contracted together, never flattened: the width may be split over devices)."""
    hf = h.astype(jnp.float32)
    normed = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=(-2, -1), keepdims=True) + norm_eps)
    return shard(weight_einsum("bsnd,ndm->bsm", normed, fn, _MIX, weight_names=("hc_streams", "embed", "hc_mix")),
                 _MIX)


def collapse(h: jax.Array, pre: jax.Array) -> jax.Array:
    """``sum_j pre_j * h_j``: streams ``h [batch, seq, n, embed]`` weighted by ``pre [batch, seq, n]`` (float32)
    into one ``[batch, seq, embed]``, in ``h``'s dtype."""
    out = jnp.einsum("bsn,bsnd->bsd", pre, h.astype(jnp.float32))
    return shard(out.astype(h.dtype), ("activation_batch", "activation_length", "activation_embed"))


class HyperConnection(nnx.Module):
    """One block's hyper-connection: ``collapsed, post, comb = hc(h)``, then ``hc.expand(h, out, post, comb)``.

    ``h [batch, seq, streams, embed]`` -> ``collapsed [batch, seq, embed]`` (the block's input), ``post [batch,
    seq, streams]`` and ``comb [batch, seq, streams, streams]`` (float32). Parameters, float32 whatever
    ``param_dtype`` (transformers keeps them in float32 too): ``fn [streams, embed, 2n + n^2]`` (HF's ``fn``
    transposed), ``base [2n + n^2]``, ``scale [3]``.

    >>> hc = HyperConnection(64, streams=4, rngs=nnx.Rngs(0))
    >>> h = jnp.ones((2, 8, 4, 64))
    >>> x, post, comb = hc(h)
    >>> hc.expand(h, block(x), post, comb).shape
    (2, 8, 4, 64)
    """

    def __init__(self, features: int, *, streams: int, sinkhorn_iters: int = 20, eps: float = 1e-6,
                 norm_eps: float = 1e-6, kernel_init: nnx.initializers.Initializer = DEFAULT_INIT, rngs: nnx.Rngs):
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = streams, sinkhorn_iters, float(eps), norm_eps
        mix = (2 + streams) * streams
        self.fn = nnx.Param(kernel_init(rngs.params(), (streams, features, mix), jnp.float32),
                            out_sharding=("hc_streams", "embed", "hc_mix"), eager_sharding=False)
        self.base = nnx.Param(jnp.zeros((mix,), jnp.float32), out_sharding=("hc_mix",), eager_sharding=False)
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32), out_sharding=(None,), eager_sharding=False)

    def __call__(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        n = self.streams
        mixes = _mixes(h, self.fn[...], self.norm_eps)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + self.eps
        post = 2 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
        logits = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mixes.shape[:-1], n, n)
        comb = sinkhorn(jax.nn.softmax(logits, axis=-1) + self.eps, self.sinkhorn_iters, self.eps)
        return collapse(h, pre), post, comb

    @staticmethod
    def expand(h: jax.Array, out: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """The streams after a block: ``h'_k = post_k * out + sum_j comb_jk * h_j`` for ``h [batch, seq, n,
        embed]`` and the block's ``out [batch, seq, embed]``, mixed in ``h``'s dtype."""
        dtype = h.dtype
        mixed = jnp.einsum("bsjk,bsjd->bskd", comb.astype(dtype), h)
        return shard(post.astype(dtype)[..., None] * out.astype(dtype)[:, :, None, :] + mixed, STREAMS)


class HyperHead(nnx.Module):
    """The final collapse of the streams into one hidden state, before the model's last norm:
    ``pre = sigmoid(mixes * scale + base) + eps``, ``out = sum_j pre_j h_j``. Parameters (float32): ``fn
    [streams, embed, streams]``, ``base [streams]``, ``scale [1]``.

    >>> HyperHead(64, streams=4, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 4, 64))).shape
    (2, 8, 64)
    """

    def __init__(self, features: int, *, streams: int, eps: float = 1e-6, norm_eps: float = 1e-6,
                 kernel_init: nnx.initializers.Initializer = DEFAULT_INIT, rngs: nnx.Rngs):
        self.eps, self.norm_eps = float(eps), norm_eps
        self.fn = nnx.Param(kernel_init(rngs.params(), (streams, features, streams), jnp.float32),
                            out_sharding=("hc_streams", "embed", "hc_mix"), eager_sharding=False)
        self.base = nnx.Param(jnp.zeros((streams,), jnp.float32), out_sharding=("hc_mix",), eager_sharding=False)
        self.scale = nnx.Param(jnp.ones((1,), jnp.float32), out_sharding=(None,), eager_sharding=False)

    def __call__(self, h: jax.Array) -> jax.Array:
        mixes = _mixes(h, self.fn[...], self.norm_eps)
        pre = jax.nn.sigmoid(mixes * self.scale[...][0] + self.base[...]) + self.eps
        return collapse(h, pre)


def widen(x: jax.Array, streams: int) -> jax.Array:
    """``x [batch, seq, embed]`` copied into ``streams`` residual streams ``[batch, seq, streams, embed]``."""
    return shard(jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], streams, x.shape[-1])), STREAMS)
