"""DeepSeek-V3's decoding cache: per layer and token, MLA's normed latent and the shared rope key.

MLA's keys and values are both expanded from one latent by ``kv_b_proj``, and its rope key is one head shared
by all heads, so the cache keeps only ``kv_lora_rank + qk_rope_head_dim`` values per token per layer (576 for
DeepSeek-V3, against ``2 * 128 heads * 192`` for full per-head keys and values). Decoding attends to the latent
directly (the absorbed form, ``MLA.decode``).

The cache has a fixed number of slots (``max_len``), so one compiled decode step serves every token. Slots are
written left to right, the same slot for every row; a left-padded prompt leaves its padding slots marked
invalid, so they are never attended to, and each row's rope positions count only its real tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nnx_zoo.layers.kv_cache import advance_cache, empty_slots, write_slots
from nnx_zoo.sharding import shard

# Logical names: the cache is laid out like the activations it replaces (batch split like activation_batch).
LAYER_CACHE_NAMES = ("cache_batch", "cache_length", "cache_kv")
CACHE_NAMES = ("activation_stack", *LAYER_CACHE_NAMES)


class MLACache(NamedTuple):
    """A fixed-size MLA decoding cache (a pytree of arrays; pass it through ``jax.jit`` and loops freely).

    ``latent [layers, batch, max_len, kv_lora_rank]``: ``kv_a_norm`` of each token's latent (what ``kv_b_proj``
    expands into keys and values). ``k_rope [layers, batch, max_len, qk_rope_head_dim]``: the shared rope key,
    rope already applied. ``valid [batch, max_len]``: the slot holds a real token (written, not padding).
    ``next_position [batch]``: the rope position of the row's next token (its number of real tokens so far).
    ``length`` (scalar): slots written so far. ``index_k [layers, batch, max_len, index_head_dim]``: DeepSeek-V3.2's
    lightning-indexer keys, rope applied (None without an indexer).

    >>> cache = model.init_cache(batch=2, max_len=64)
    >>> logits, cache = model.prefill(prompt_ids, attention_mask, cache)
    >>> logits, cache = model.decode_step(next_tokens, cache)
    """

    latent: jax.Array
    k_rope: jax.Array
    valid: jax.Array
    next_position: jax.Array
    length: jax.Array
    index_k: jax.Array | None = None

    @classmethod
    def zeros(cls, *, num_layers: int, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int,
              dtype: jnp.dtype, index_dim: int = 0) -> MLACache:
        """An empty cache, laid out on the ambient mesh (``jax.set_mesh``) by its logical names; ``index_dim > 0``
        adds the indexer's keys."""
        slots = empty_slots(batch, max_len)

        def zeros(width: int) -> jax.Array:
            return shard(jnp.zeros((num_layers, batch, max_len, width), dtype), CACHE_NAMES)

        return cls(latent=zeros(kv_lora_rank), k_rope=zeros(rope_dim), **slots,
                   index_k=zeros(index_dim) if index_dim else None)

    @property
    def max_len(self) -> int:
        return self.latent.shape[2]

    def bytes_per_token_per_layer(self) -> int:
        """Bytes the latent, rope-key (and indexer-key) arrays hold per cached token per layer (the ``valid``
        flags, one byte per token for all layers together, are not counted)."""
        layers, batch, max_len = self.latent.shape[:3]
        index = 0 if self.index_k is None else self.index_k.nbytes
        return (self.latent.nbytes + self.k_rope.nbytes + index) // (layers * batch * max_len)

    def advance(self, token_mask: jax.Array) -> tuple[jax.Array, jax.Array, MLACache]:
        """Book ``t`` new tokens per row (``token_mask [batch, t]``, 1 = real token, 0 = padding) into the next
        ``t`` slots: ``(positions [batch, t], attention mask [batch, 1, t, max_len], cache)`` (the shared slot
        bookkeeping, ``nnx_zoo.layers.kv_cache.advance_slots``). The latent and rope key are written per layer by
        ``MLA.decode`` (``write``)."""
        return advance_cache(self, token_mask)


def write(layer_cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """``layer_cache [batch, max_len, d]`` with ``new [batch, t, d]`` written at slots ``start .. start + t``."""
    return write_slots(layer_cache, new, start, LAYER_CACHE_NAMES)
