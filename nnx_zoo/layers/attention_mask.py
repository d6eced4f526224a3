"""``AttentionMask``: which keys each query of an attention call sees, without a ``[q, k]`` array.

Kernels read its parts (a causal offset, key validity, segment ids) tile by tile; the einsum path asks for the
dense boolean array (``.dense``). ``causal_mask`` builds the mask of a forward pass; a decoding cache's
``advance`` builds a decode step's (``nnx_zoo.layers.kv_cache``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nnx_zoo.sharding import shard

_QUERY_SIDE = ("activation_batch", "activation_length")
_KEY_SIDE = ("activation_batch", "activation_kv_length")
_MASK_NAMES = ("activation_batch", None, "activation_length", "activation_kv_length")


class AttentionMask(NamedTuple):
    """Which keys each query sees, without a ``[q, k]`` array (a pytree: pass it through ``jit`` and scans).

    Query ``i`` sits at key slot ``q_offset + i`` and sees key slot ``j`` iff
    ``j <= q_offset + i`` (causal), ``kv_valid[b, j]`` (padding and unwritten cache slots are False; None: all
    valid) and ``segment_ids[b, q_offset + i] == segment_ids[b, j]`` (packed documents; None: one document).
    ``q_offset`` is 0 for a forward pass over a whole sequence and the cache length for a decode step (traced).

    >>> mask = AttentionMask.causal(8, attention_mask=pad_mask)       # == causal_mask(8, pad_mask)
    >>> mask.dense(8, 8).shape                                        # the einsum path's boolean mask
    (2, 1, 8, 8)
    >>> AttentionMask(q_offset=cache_length, kv_valid=cache_valid)    # a decode step's
    """

    q_offset: jax.Array | int = 0
    kv_valid: jax.Array | None = None
    segment_ids: jax.Array | None = None

    @classmethod
    def causal(cls, seq_len: int, attention_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> AttentionMask:
        """The mask of a forward pass over ``seq_len`` tokens: ``attention_mask [batch, seq]`` (1 = token, 0 =
        padding) and ``segment_ids [batch, seq]`` (packed documents) as in ``causal_mask``."""
        for name, a in (("attention_mask", attention_mask), ("segment_ids", segment_ids)):
            if a is not None and (a.ndim != 2 or a.shape[1] != seq_len):
                raise ValueError(f"{name} {tuple(a.shape)} must be [batch, seq={seq_len}]")
        return cls(0, None if attention_mask is None else attention_mask.astype(bool), segment_ids)

    @property
    def static_start(self) -> bool:
        """True when queries start at slot 0 (a whole-sequence forward), known while tracing."""
        return isinstance(self.q_offset, int) and self.q_offset == 0

    def query_segment_ids(self, q_len: int) -> jax.Array | None:
        """``[batch, q_len]``: each query's segment (``segment_ids`` at its slot), or None."""
        if self.segment_ids is None:
            return None
        if self.static_start and q_len == self.segment_ids.shape[1]:
            return self.segment_ids
        return jax.lax.dynamic_slice_in_dim(self.segment_ids, self.q_offset, q_len, axis=1)

    def query_valid(self, q_len: int) -> jax.Array:
        """``[batch or 1, q_len]`` bool: the query is itself a real token (its own slot is valid)."""
        if self.kv_valid is None:
            return jnp.ones((1, q_len), bool)
        if self.static_start and q_len == self.kv_valid.shape[1]:
            return shard(self.kv_valid, _QUERY_SIDE)
        return jax.lax.dynamic_slice_in_dim(self.kv_valid, self.q_offset, q_len, axis=1)

    def dense(self, q_len: int, k_len: int) -> jax.Array:
        """Boolean ``[batch or 1, 1, q_len, k_len]`` (True = visible), for the einsum path.

        On a mesh it is laid out like the attention scores it masks: queries split like ``activation_length``
        (context parallelism), keys whole (``activation_kv_length``). Inputs split over the sequence are gathered
        along it for their key side first: the query and key sides cannot both sit on the context axis of one
        ``[b, 1, q, k]`` array.
        """
        q_slots = self.q_offset + jnp.arange(q_len)
        mask = (jnp.arange(k_len)[None, :] <= q_slots[:, None])[None, None]
        if self.kv_valid is not None:
            mask = mask & shard(self.kv_valid.astype(bool), _KEY_SIDE)[:, None, None, :]
        if self.segment_ids is not None:
            query_side = shard(self.query_segment_ids(q_len), _QUERY_SIDE)[:, None, :, None]
            mask = mask & (query_side == shard(self.segment_ids, _KEY_SIDE)[:, None, None, :])
        return mask if mask.shape[0] == 1 else shard(mask, _MASK_NAMES)


def causal_mask(
    seq_len: int, attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> AttentionMask:
    """The ``AttentionMask`` of a forward pass: key ``k`` is visible to query ``q`` when ``k <= q``, ``k`` is not
    padding, and both lie in the same segment.

    ``attention_mask`` is the usual ``[batch, k]`` 1/0 padding mask (1 = real token); ``segment_ids [batch, s]``
    number the documents packed into a row, so attention never crosses a document boundary. ``.dense(q, k)``
    gives the boolean ``[batch or 1, 1, q, k]`` array.
    """
    return AttentionMask.causal(seq_len, attention_mask, segment_ids)
