"""``AttentionMask``: which keys each query of an attention call sees, without a ``[q, k]`` array.

Kernels read its parts (a causal offset, key validity, segment ids) tile by tile; the einsum path asks for the
dense boolean array (``.dense``). ``causal_mask`` builds the mask of a forward pass; a decoding cache's
``advance`` builds a decode step's (``nnx_zoo.layers.kv_cache``).

Local attention is a per-layer rule on top of the mask (the mask describes the batch, the rule the layer), given
to ``dense`` and to the kernels as ``window`` / ``chunk``:

- ``window=w``: query slot ``i`` sees key slots ``j > i - w`` (itself and the ``w - 1`` before it; transformers'
  ``sliding_window``). Within a document slots and positions advance together, so this is the same window in
  positions, with left padding, packed documents or a cache offset alike.
- ``chunk=c``: the slots of each document are cut into chunks of ``c`` from its first real token, and a query sees
  the keys of its own chunk (Llama 4's ``attention_chunk_size``; transformers counts from the row's first real
  token). ``doc_starts`` gives each query's document start.
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
    # [batch, q]: the slot of each query's document's first real token, where the slots do not say it (a decode
    # step over a window cache that no longer holds it); None: found from kv_valid and segment_ids.
    doc_start: jax.Array | None = None

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

    def doc_starts(self, q_len: int) -> jax.Array:
        """``[batch or 1, q_len]`` int32: the slot of the first real token of each query's document (the row's
        first real token without segments; a query that is padding gets a slot at or before its own)."""
        if self.doc_start is not None:
            return self.doc_start.astype(jnp.int32)
        if self.kv_valid is None and self.segment_ids is None:
            return jnp.zeros((1, q_len), jnp.int32)
        # Whole along the sequence (the key side's layout): the shifts below compare neighbouring slots.
        valid = None if self.kv_valid is None else shard(self.kv_valid, _KEY_SIDE)
        seg = None if self.segment_ids is None else shard(self.segment_ids, _KEY_SIDE)
        k_len = (valid if valid is not None else seg).shape[1]
        slots = jnp.arange(k_len, dtype=jnp.int32)
        # A document starts at a real slot whose predecessor is padding, another document, or nothing.
        real = jnp.ones((1, k_len), bool) if valid is None else valid.astype(bool)
        before_real = jnp.pad(real[:, :-1], ((0, 0), (1, 0)))
        starts = real & ~before_real
        if seg is not None:
            starts = starts | (real & (seg != jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)))
        per_slot = jax.lax.cummax(jnp.where(starts, slots, 0), axis=1)
        if self.static_start and q_len == k_len:
            return per_slot
        return jax.lax.dynamic_slice_in_dim(per_slot, self.q_offset, q_len, axis=1)

    def dense(self, q_len: int, k_len: int, *, window: int | None = None, chunk: int | None = None) -> jax.Array:
        """Boolean ``[batch or 1, 1, q_len, k_len]`` (True = visible), for the einsum path; ``window`` / ``chunk``
        add a layer's local rule (see the module docstring).

        On a mesh it is laid out like the attention scores it masks: queries split like ``activation_length``
        (context parallelism), keys whole (``activation_kv_length``). Inputs split over the sequence are gathered
        along it for their key side first: the query and key sides cannot both sit on the context axis of one
        ``[b, 1, q, k]`` array.
        """
        q_slots = self.q_offset + jnp.arange(q_len)
        k_slots = jnp.arange(k_len)
        mask = k_slots[None, :] <= q_slots[:, None]
        if window is not None:
            mask = mask & (k_slots[None, :] > q_slots[:, None] - window)
        mask = mask[None, None]
        if chunk is not None:
            starts = q_slots[None, :] - (q_slots[None, :] - self.doc_starts(q_len)) % chunk  # [b or 1, q]
            if starts.shape[0] > 1:  # one row for the whole batch (no padding, no segments) stays as it is
                starts = shard(starts, _QUERY_SIDE)
            mask = mask & (k_slots[None, None, None, :] >= starts[:, None, :, None])
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
