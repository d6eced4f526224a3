"""The token mixers of Qwen3-Next and Qwen3.5: ``GatedAttention`` (full layers) and ``GatedDeltaNet`` (linear
layers). Both take ``(x, cos, sin, mask)`` and decode as ``decode(x, cos, sin, cache_a, cache_b, start, mask)``, so a
decoder layer holds either as its ``attn``: the attention's caches are keys and values, the delta net's the
convolution's tail and the delta rule's state.

Letters in the shapes: b batch, s sequence, hk query/key heads, hv value heads (``r = hv // hk`` per query/key
head), dk / dv their widths, C the convolution's channels ``2 * hk * dk + hv * dv``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.attention import Attention, AttentionMask
from nnx_zoo.layers.delta_rule import DEFAULT_CHUNK, gated_delta_rule
from nnx_zoo.layers.linear import DEFAULT_INIT, Linear
from nnx_zoo.layers.norm import GatedRMSNorm, RMSNorm, l2_normalize
from nnx_zoo.layers.rope import apply_rope
from nnx_zoo.layers.short_conv import ShortConv
from nnx_zoo.layers.spec import explicit_spec
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BLND = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
_BKND = ("activation_batch", "activation_kv_length", "activation_kv_heads", "activation_kv")
_BLH_ = ("activation_batch", "activation_length", "activation_heads", None)
_BL_ = ("activation_batch", "activation_length", None)
_BLH = ("activation_batch", "activation_length", "activation_heads")


def centred_norm(dim: int, eps: float, **dtypes: Any) -> RMSNorm:
    """The ``(1 + w)`` RMSNorm of these models (weights stored centred on 0, scale applied in float32)."""
    return RMSNorm(dim, eps=eps, offset=1.0, scale_in_float32=True, **dtypes)


class GatedAttention(Attention):
    """``Attention`` whose output is gated per channel by a sigmoid of a second query-shaped projection:
    ``o_proj(attend(q, k, v) * sigmoid(gate))``. ``q_proj`` holds both, per head ``[embed, heads, 2 * head_dim]``
    (the query's ``head_dim`` columns, then the gate's: the checkpoints' layout), so heads split over devices
    keep their gate. Queries and keys are normed per head (``(1 + w)`` norms) and roped on their first
    ``cos.shape[-1] * 2`` dims.

    >>> attn = GatedAttention(64, num_heads=4, num_kv_heads=2, head_dim=16, rngs=nnx.Rngs(0))
    >>> cos, sin = rope_cos_sin(jnp.arange(10)[None], rope_frequencies(4, 1e4)[0])   # rope on 4 of 16 dims
    >>> attn(jnp.ones((2, 10, 64)), cos, sin, causal_mask(10)).shape
    (2, 10, 64)
    """

    def __init__(self, features: int, *, num_heads: int, head_dim: int, norm_eps: float = 1e-6,
                 kernel_init: nnx.initializers.Initializer, rngs: nnx.Rngs, **kwargs: Any):
        super().__init__(features, num_heads=num_heads, head_dim=head_dim, norm_eps=norm_eps, qk_norm=False,
                         kernel_init=kernel_init, rngs=rngs, **kwargs)
        dtypes = dict(dtype=kwargs.get("dtype", jnp.float32), param_dtype=kwargs.get("param_dtype", jnp.float32))
        self.q_proj = Linear(features, (num_heads, 2 * head_dim), kernel_names=("embed", "heads", "kv"),
                             kernel_init=kernel_init, rngs=rngs, **dtypes)
        self.q_norm = nnx.data(centred_norm(head_dim, norm_eps, **dtypes))
        self.k_norm = nnx.data(centred_norm(head_dim, norm_eps, **dtypes))

    def _project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, ...]:
        """``(q, k, v, gate)``: q, gate ``[b, s, heads, head_dim]``, k, v ``[b, s, kv_heads, head_dim]``."""
        q, gate = jnp.split(self.q_proj(x, _BLHD), 2, axis=-1)
        k, v = self.k_proj(x, _BLND), self.v_proj(x, _BLND)
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin, interleaved=False), apply_rope(k, cos, sin, interleaved=False), v, gate

    def _out(self, out: jax.Array, gate: jax.Array) -> jax.Array:
        gated = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return self.o_proj(shard(gated, _BLHD), _BLE)

    def __call__(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None,
                 mask: AttentionMask | jax.Array | None) -> jax.Array:
        in_sharding = sharding_of(x)
        q, k, v, gate = self._project(x, cos, sin)
        out = self.attend(q, shard(k, _BKND), shard(v, _BKND), mask)
        return restore_sharding(self._out(out, gate), in_sharding)

    def decode(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None, k_cache: jax.Array,
               v_cache: jax.Array, start: jax.Array, mask: AttentionMask | jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        in_sharding = sharding_of(x)
        q, k, v, gate = self._project(x, cos, sin)
        out, k_cache, v_cache = self.attend_cached(q, k, v, k_cache, v_cache, start, mask)
        return restore_sharding(self._out(out, gate), in_sharding), k_cache, v_cache


class DeltaRuleMixer(nnx.Module):
    """A linear-attention token mixer run by the gated delta rule: the shape ``__call__`` and ``decode`` share
    around a subclass's ``_mix(x, token_mask, segment_ids, tail, state) -> (out, conv tail, delta-rule state)``
    (the projections, the short convolution continuing ``tail``, the delta rule continuing ``state``; None: empty).
    Qwen3-Next's ``GatedDeltaNet`` and Kimi Linear's KDA are two of them. Its ``delta_rule_impl`` and
    ``chunk_size`` (the config's ``delta_rule_impl`` / ``delta_rule_chunk_size``) reach the kernel in one place,
    ``_delta_rule``."""

    delta_rule_impl: str = "auto"
    chunk_size: int = DEFAULT_CHUNK

    def _delta_rule(self, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                    **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        """``gated_delta_rule`` with this mixer's kernel and chunk size."""
        return gated_delta_rule(q, k, v, g, beta, impl=self.delta_rule_impl, chunk_size=self.chunk_size, **kwargs)

    def _mix(self, x: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None, tail: jax.Array | None,
             state: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        raise NotImplementedError(f"{type(self).__name__} must define _mix")

    def __call__(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None,
                 mask: AttentionMask | None) -> jax.Array:
        """``x [b, s, embed]`` -> same shape; ``cos``/``sin`` unused (no rope), ``mask`` (``causal_mask``'s) gives
        the padding and the documents."""
        del cos, sin
        s = x.shape[1]
        token_mask = jnp.ones((1, s), bool) if mask is None else mask.query_valid(s)
        token_mask = jnp.broadcast_to(token_mask, x.shape[:2])
        segments = None if mask is None else mask.query_segment_ids(s)
        return self._mix(x, token_mask, segments, None, None)[0]

    def decode(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None, tail: jax.Array, state: jax.Array,
               start: jax.Array, mask: AttentionMask) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``t`` new tokens after the cached conv ``tail [b, K-1, ...]`` and delta-rule ``state [b, h, dk, dv]``:
        ``(out, tail, state)``. ``mask`` (the cache's, ``q_offset = start``) says which new tokens are padding."""
        del cos, sin, start
        token_mask = jnp.broadcast_to(mask.query_valid(x.shape[1]), x.shape[:2])
        out, tail, new_state = self._mix(x, token_mask, None, tail.astype(x.dtype), state)
        return out, tail.astype(x.dtype), new_state.astype(state.dtype)


class GatedDeltaNet(DeltaRuleMixer):
    """A linear-attention layer: projections, a causal convolution over queries, keys and values
    (``ShortConv``, SiLU), L2-normalized queries and keys, the gated delta rule (``gated_delta_rule``: write
    strength ``beta = sigmoid(b)``, log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` per value head), an
    output RMSNorm gated by ``silu(z)`` (``GatedRMSNorm``) and the output projection.

    ``packed=True`` (Qwen3-Next): ``in_proj_qkvz [embed, hk, 2 dk + 2 r dv]`` and ``in_proj_ba [embed, hk, 2 r]``,
    each query/key head's q, k, its r value heads' v and z (and b, a) side by side; ``packed=False`` (Qwen3.5):
    ``in_proj_qkv [embed, hk, 2 dk + r dv]`` (the checkpoint's all queries, all keys, all values regrouped per
    query/key head), ``in_proj_z [embed, hv, dv]``, ``in_proj_b`` and ``in_proj_a [embed, hv]``. Either way the
    convolution runs per query/key head on ``[b, s, hk, 2 dk + r dv]`` (its query, key and values), so every
    activation and weight but ``out_proj``'s input width splits by heads under tensor parallelism.

    >>> net = GatedDeltaNet(64, key_heads=2, value_heads=4, key_dim=16, value_dim=16, conv_kernel=4, packed=True,
    ...                     rngs=nnx.Rngs(0))
    >>> net(jnp.ones((2, 10, 64)), None, None, causal_mask(10)).shape
    (2, 10, 64)
    """

    def __init__(self, features: int, *, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 conv_kernel: int, packed: bool, norm_eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK,
                 delta_rule_impl: str = "auto", dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype = jnp.float32,
                 kernel_init: nnx.initializers.Initializer = DEFAULT_INIT, rngs: nnx.Rngs):
        hk, hv, dk, dv = key_heads, value_heads, key_dim, value_dim
        if hv % hk:
            raise ValueError(f"key heads ({hk}) must divide value heads ({hv})")
        r = hv // hk
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = hk, hv, dk, dv
        self.packed, self.chunk_size, self.delta_rule_impl, self.dtype = packed, chunk_size, delta_rule_impl, dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        w = 2 * dk + r * dv  # a query/key head's conv channels: its query, its key, its r value heads' values
        if packed:
            self.in_proj_qkvz = Linear(features, (hk, w + r * dv), kernel_names=("embed", "heads", None), **kw)
            self.in_proj_ba = Linear(features, (hk, 2 * r), kernel_names=("embed", "heads", None), **kw)
        else:  # stored per query/key head too (the checkpoint's [C, embed] regrouped on load), so TP splits it
            self.in_proj_qkv = Linear(features, (hk, w), kernel_names=("embed", "heads", None), **kw)
            self.in_proj_z = Linear(features, (hv, dv), kernel_names=("embed", "heads", "kv"), **kw)
            self.in_proj_b = Linear(features, hv, kernel_names=("embed", "heads"), **kw)
            self.in_proj_a = Linear(features, hv, kernel_names=("embed", "heads"), **kw)
        self.conv = ShortConv((hk, w), conv_kernel, names=("heads", None, None),
                              channel_names=("activation_heads", None), dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((hv,), param_dtype), out_sharding=("heads",), eager_sharding=False)
        # A in [1, 16) at init (transformers draws it from [0.01, 16)): decay rates spread over the heads.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), param_dtype, 1.0, 16.0)),
                               out_sharding=("heads",), eager_sharding=False)
        self.norm = GatedRMSNorm(dv, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.out_proj = Linear((hv, dv), features, kernel_names=("heads", "kv", "embed"), **kw)

    def _inputs(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(qkv [b, s, hk, 2 dk + r dv], z [b, s, hv, dv], b, a [b, s, hv])`` from the projections, every one
        split by heads."""
        hk, dk, dv = self.key_heads, self.key_dim, self.value_dim
        r = self.value_heads // hk
        if not self.packed:
            return (self.in_proj_qkv(x, _BLH_), self.in_proj_z(x, _BLHD), self.in_proj_b(x, _BLH),
                    self.in_proj_a(x, _BLH))
        qkvz = self.in_proj_qkvz(x, _BLH_)  # [b, s, hk, 2 dk + 2 r dv]
        ba = self.in_proj_ba(x, _BLH_)  # [b, s, hk, 2 r]
        w = 2 * dk + r * dv
        return qkvz[..., :w], self._value_heads(qkvz[..., w:], dv), self._value_heads(ba[..., :r]), \
            self._value_heads(ba[..., r:])

    def _value_heads(self, a: jax.Array, width: int | None = None) -> jax.Array:
        """``[b, s, hk, r * width]`` -> ``[b, s, hv, width]`` (or ``[b, s, hk, r]`` -> ``[b, s, hv]``): query/key
        head ``i``'s ``r`` value heads are ``i r .. i r + r - 1``, so a split over heads stays on its devices."""
        shape = (*a.shape[:2], self.value_heads) + (() if width is None else (width,))
        names = _BLHD if width is not None else _BLH
        return shard(jnp.reshape(a, shape, out_sharding=explicit_spec(names, shape)), names)

    def _mix(self, x: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None, tail: jax.Array | None,
             state: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(out [b, s, embed], conv tail, delta-rule state)`` continuing ``tail`` / ``state`` (None: empty)."""
        in_sharding = sharding_of(x)
        dk, dv = self.key_dim, self.value_dim
        x = jnp.where(token_mask[:, :, None], x, 0).astype(x.dtype)  # padding reads as 0, as transformers zeroes it
        qkv, z, beta_in, a = self._inputs(x)
        qkv, tail = self.conv(qkv, tail=tail, segment_ids=segment_ids, token_mask=token_mask)  # [b, s, hk, w]
        q = l2_normalize(qkv[..., :dk], 1e-6)
        k = l2_normalize(qkv[..., dk:2 * dk], 1e-6)
        v = self._value_heads(qkv[..., 2 * dk:], dv)
        beta = jax.nn.sigmoid(beta_in.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        out, state = self._delta_rule(q, k, v, g, beta, scale=dk**-0.5, initial_state=state,
                                      segment_ids=segment_ids, token_mask=token_mask)
        out = self.norm(out, z)  # [b, s, hv, dv]
        return restore_sharding(self.out_proj(shard(out.astype(self.dtype), _BLHD), _BLE), in_sharding), tail, state
