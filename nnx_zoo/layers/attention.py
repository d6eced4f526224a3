"""Masked softmax attention written with einsums (query and value head widths may differ, as in MLA)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnx_zoo.sharding import shard

_SCORE_NAMES = ("activation_batch", "activation_heads", "activation_length", "activation_kv_length")


def causal_mask(
    seq_len: int, attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Boolean ``[batch or 1, 1, q, k]``: key ``k`` is visible to query ``q`` when ``k <= q``, ``k`` is not
    padding, and both lie in the same segment.

    ``attention_mask`` is the usual ``[batch, k]`` 1/0 padding mask (1 = real token); ``segment_ids [batch, s]``
    number the documents packed into a row, so attention never crosses a document boundary.
    """
    pos = jnp.arange(seq_len)
    mask = (pos[None, :] <= pos[:, None])[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.astype(bool)[:, None, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return mask


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float
) -> jax.Array:
    """``softmax(q k^T * scale + mask) v`` for ``q, k [b, s, h, d_qk]``, ``v [b, s, h, d_v]`` -> ``[b, s, h, d_v]``.

    Masked scores are filled with the dtype's minimum, not -inf, so a fully masked row (a left-pad query) stays
    finite. The softmax is computed in float32.
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, q.dtype)
    scores = shard(scores, _SCORE_NAMES)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
