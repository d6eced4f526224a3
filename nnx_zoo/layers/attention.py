"""Masked softmax attention written with einsums (query and value head widths may differ, as in MLA; key/value
heads may be fewer than query heads, as in GQA), and the grouped-query ``Attention`` module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.kv_cache import write_slots
from nnx_zoo.layers.linear import DEFAULT_INIT, Linear
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import apply_rope
from nnx_zoo.layers.spec import explicit_spec
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_SCORE_NAMES = ("activation_batch", "activation_heads", "activation_length", "activation_kv_length")
_GROUPED_SCORE_NAMES = ("activation_batch", "activation_kv_heads", None, "activation_length", "activation_kv_length")
_GROUPED_Q_NAMES = ("activation_batch", "activation_length", "activation_kv_heads", None, "activation_kv")
_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BLND = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
_BKND = ("activation_batch", "activation_kv_length", "activation_kv_heads", "activation_kv")
_QUERY_SIDE = ("activation_batch", "activation_length")
_KEY_SIDE = ("activation_batch", "activation_kv_length")
_MASK_NAMES = ("activation_batch", None, "activation_length", "activation_kv_length")


def causal_mask(
    seq_len: int, attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Boolean ``[batch or 1, 1, q, k]``: key ``k`` is visible to query ``q`` when ``k <= q``, ``k`` is not
    padding, and both lie in the same segment.

    ``attention_mask`` is the usual ``[batch, k]`` 1/0 padding mask (1 = real token); ``segment_ids [batch, s]``
    number the documents packed into a row, so attention never crosses a document boundary.

    On a mesh the mask is laid out like the attention scores it masks: queries split like
    ``activation_length`` (context parallelism), keys whole (``activation_kv_length``). An input split over
    the sequence (``[activation_batch, activation_length]``) is gathered along it for its key side first: its
    query and key sides cannot both sit on the context axis of one ``[b, 1, q, k]`` array.
    """
    pos = jnp.arange(seq_len)
    mask = (pos[None, :] <= pos[:, None])[None, None]
    if attention_mask is not None:
        mask = mask & shard(attention_mask.astype(bool), _KEY_SIDE)[:, None, None, :]
    if segment_ids is not None:
        query_side = shard(segment_ids, _QUERY_SIDE)[:, None, :, None]
        mask = mask & (query_side == shard(segment_ids, _KEY_SIDE)[:, None, None, :])
    return mask if mask.shape[0] == 1 else shard(mask, _MASK_NAMES)


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float
) -> jax.Array:
    """``softmax(q k^T * scale + mask) v`` for ``q [b, q, h, d_qk]``, ``k [b, k, n, d_qk]``, ``v [b, k, n, d_v]``
    -> ``[b, q, h, d_v]``, with ``mask [b or 1, 1, q, k]`` (True = visible).

    ``n`` key/value heads must divide the ``h`` query heads: query head ``i`` attends with key/value head
    ``i // (h // n)`` (grouped-query attention; ``n == h`` is multi-head, ``n == 1`` multi-query attention).
    Keys and values are never repeated per query head: the queries are viewed as ``[b, q, n, h // n, d]``.
    Masked scores are filled with the dtype's minimum, not -inf, so a fully masked row (a left-pad query) stays
    finite. The softmax is computed in float32.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads == heads:
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, q.dtype)
        probs = _masked_softmax(shard(scores, _SCORE_NAMES), mask, v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    if heads % kv_heads or v.shape[2] != kv_heads:
        raise ValueError(f"key/value heads ({kv_heads}, values {v.shape[2]}) must be equal and divide the "
                         f"query heads ({heads})")
    batch, length = q.shape[:2]
    grouped = (batch, length, kv_heads, heads // kv_heads, q.shape[3])
    # Query head i = kv head i // groups: the kv-head dim is the major half of the split, laid out like heads.
    # Letters: b batch, q query position, k key position, n kv head, g query head within its group, d feature.
    q = jnp.reshape(q, grouped, out_sharding=explicit_spec(_GROUPED_Q_NAMES, grouped))
    scores = jnp.einsum("bqngd,bknd->bngqk", q, k) * jnp.asarray(scale, q.dtype)
    probs = _masked_softmax(shard(scores, _GROUPED_SCORE_NAMES), None if mask is None else mask[:, :, None],
                            v.dtype)
    out = jnp.einsum("bngqk,bknd->bqngd", probs, v)
    merged = (batch, length, heads, v.shape[3])
    return jnp.reshape(out, merged, out_sharding=explicit_spec(_BLHD, merged))


def _masked_softmax(scores: jax.Array, mask: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """Softmax over the last (key) dim in float32, masked keys filled with the scores dtype's minimum."""
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads (MHA, GQA, MQA) and rotate-half rope.

    ``num_kv_heads`` must divide ``num_heads`` (1 is multi-query attention); ``head_dim`` is free of
    ``features / num_heads``. ``use_bias`` adds biases to the q/k/v projections (HF ``attention_bias``; ``o_bias``
    defaults to the same), ``qk_norm`` RMS-normalizes each query and key head over ``head_dim`` before rope
    (HF ``q_norm``/``k_norm``). The softmax scale is ``head_dim ** -0.5`` unless given.

    Weights carry logical names: ``q_proj`` ``("embed", "heads", "kv")``, ``k_proj``/``v_proj``
    ``("embed", "kv_heads", "kv")``, ``o_proj`` ``("heads", "kv", "embed")``. The output comes back in the
    sharding ``x`` arrived with. ``decode`` runs new tokens against a ``KVCache`` layer slice.

    >>> attn = Attention(64, num_heads=8, num_kv_heads=2, head_dim=32, qk_norm=True, rngs=nnx.Rngs(0))
    >>> cos, sin = rope_cos_sin(jnp.arange(10)[None], rope_frequencies(32, 10000.0)[0])
    >>> attn(jnp.ones((2, 10, 64)), cos, sin, causal_mask(10)).shape
    (2, 10, 64)
    """

    def __init__(
        self,
        features: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        use_bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: nnx.initializers.Initializer = DEFAULT_INIT,
        rngs: nnx.Rngs,
    ):
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must be a positive divisor of num_heads ({num_heads})")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (rope rotates pairs), got {head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.q_proj = Linear(features, (num_heads, head_dim), kernel_names=("embed", "heads", "kv"),
                             use_bias=use_bias, **kw)
        self.k_proj = Linear(features, (num_kv_heads, head_dim), kernel_names=("embed", "kv_heads", "kv"),
                             use_bias=use_bias, **kw)
        self.v_proj = Linear(features, (num_kv_heads, head_dim), kernel_names=("embed", "kv_heads", "kv"),
                             use_bias=use_bias, **kw)
        self.o_proj = Linear((num_heads, head_dim), features, kernel_names=("heads", "kv", "embed"),
                             use_bias=use_bias if o_bias is None else o_bias, **kw)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array | None) -> jax.Array:
        """``x [b, s, embed]``, rope ``cos/sin [b or 1, s, head_dim / 2]``, boolean ``mask [b or 1, 1, s, s]``
        (``causal_mask``) -> ``[b, s, embed]``."""
        in_sharding = sharding_of(x)
        q, k, v = self.project(x, cos, sin)
        # Keys and values are gathered over the sequence (context parallelism keeps only queries split).
        out = dot_product_attention(q, shard(k, _BKND), shard(v, _BKND), mask, self.scale)
        return restore_sharding(self.o_proj(shard(out, _BLHD), _BLE), in_sharding)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(q [b, s, heads, head_dim], k, v [b, s, kv_heads, head_dim])``: q/k normed (``qk_norm``), then
        roped (rotate-half)."""
        q, k, v = self.q_proj(x, _BLHD), self.k_proj(x, _BLND), self.v_proj(x, _BLND)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin, interleaved=False), apply_rope(k, cos, sin, interleaved=False), v

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               start: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention for ``t`` new tokens ``x [b, t, embed]`` against one layer's cache.

        The new keys and values are written into ``k_cache``/``v_cache [b, max_len, kv_heads, head_dim]`` at
        slots ``start .. start + t``, ``start`` being the cache's ``length`` before ``KVCache.advance``, which
        gives the rope positions behind ``cos``/``sin`` and ``mask [b, 1, t, max_len]``. Returns
        ``(out [b, t, embed], k_cache, v_cache)``."""
        in_sharding = sharding_of(x)
        q, k, v = self.project(x, cos, sin)
        k_cache, v_cache = write_slots(k_cache, k, start), write_slots(v_cache, v, start)
        out = dot_product_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask, self.scale)
        return restore_sharding(self.o_proj(shard(out, _BLHD), _BLE), in_sharding), k_cache, v_cache
