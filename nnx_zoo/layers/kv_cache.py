"""A fixed-size key/value decoding cache for grouped-query attention (``Attention.decode``).

It keeps the protocol of every family's cache that ``nnx_zoo.generate``
drives through a model's ``init_cache`` / ``prefill`` / ``decode_step``: a fixed number of slots (``max_len``),
so one compiled decode step serves every token; slots written left to right, the same slot for every row; a
left-padded prompt leaves its padding slots marked invalid, so they are never attended to, and each row's rope
positions count only its real tokens.

A layer with a sliding window or chunks needs only its last ``window - 1`` (or ``chunk - 1``) slots: its keys and
values live in a ring of that many slots (``ring_slots``), slot ``s`` at ring index ``s % ring``, so its memory
does not grow with the context. ``ring_keys`` reads a ring in slot order with the new tokens after it, and
``ring_mask`` the step's mask over them; ``write_ring`` stores the new tokens in place. The bookkeeping (``valid``,
``next_position``, ``length``) stays per slot of the whole cache, a few bytes per token.
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from nnx_zoo.layers.attention_mask import AttentionMask
from nnx_zoo.sharding import shard

# Logical names: the cache is laid out like the keys and values it holds (batch split like activation_batch,
# key/value heads like the k/v projections' outputs).
LAYER_KV_CACHE_NAMES = ("cache_batch", "cache_length", "cache_kv_heads", "cache_kv")
KV_CACHE_NAMES = ("activation_stack", *LAYER_KV_CACHE_NAMES)
_SLOT_NAMES = ("cache_batch", "cache_length")


class KVCache(NamedTuple):
    """A fixed-size key/value cache for every layer (a pytree of arrays; pass it through ``jax.jit`` and loops).

    ``k``, ``v [layers, batch, max_len, kv_heads, head_dim]``: each token's key (rope applied) and value.
    ``valid [batch, max_len]``: the slot holds a real token (written, not padding). ``next_position [batch]``:
    the rope position of the row's next token (its number of real tokens so far). ``length`` (scalar): slots
    written so far. A model's ``_extend`` calls ``advance`` once, then each layer's ``Attention.decode`` on its
    slice ``k[i], v[i]`` with ``start = length`` before the advance:

    >>> cache = KVCache.zeros(num_layers=2, batch=2, max_len=64, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
    >>> start = cache.length
    >>> positions, mask, cache = cache.advance(attention_mask)  # then cos/sin from positions
    >>> out, k0, v0 = attn.decode(x, cos, sin, cache.k[0], cache.v[0], start, mask)
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    next_position: jax.Array
    length: jax.Array

    @classmethod
    def zeros(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
              dtype: jnp.dtype) -> KVCache:
        """An empty cache, laid out on the ambient mesh (``jax.set_mesh``) by its logical names."""
        slots = empty_slots(batch, max_len)
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(k=shard(jnp.zeros(shape, dtype), KV_CACHE_NAMES), v=shard(jnp.zeros(shape, dtype), KV_CACHE_NAMES),
                   **slots)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def bytes_per_token_per_layer(self) -> int:
        """Bytes the key and value arrays hold per cached token per layer (``valid`` not counted)."""
        layers, batch, max_len = self.k.shape[:3]
        return (self.k.nbytes + self.v.nbytes) // (layers * batch * max_len)

    def advance(self, token_mask: jax.Array) -> tuple[jax.Array, jax.Array, KVCache]:
        """Book ``t`` new tokens per row (``token_mask [batch, t]``, 1 = real token, 0 = padding) into the next
        ``t`` slots: ``(positions [batch, t], AttentionMask over the max_len slots, cache)`` (see
        ``advance_slots``). The keys and values are written per layer by ``Attention.decode``."""
        return advance_cache(self, token_mask)


_Cache = TypeVar("_Cache")  # a cache NamedTuple with the slot fields


def empty_slots(batch: int, max_len: int) -> dict[str, jax.Array]:
    """The slot bookkeeping of an empty fixed-size cache (``valid``, ``next_position``, ``length``; see
    ``KVCache``), laid out on the ambient mesh; a cache's ``zeros`` adds its own per-token arrays:

    >>> cache = KVCache(k=k, v=v, **empty_slots(batch=2, max_len=64))
    """
    for name, value in (("batch", batch), ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"a cache needs a positive integer {name}, got {value!r}")
    return dict(valid=shard(jnp.zeros((batch, max_len), bool), _SLOT_NAMES),
                next_position=shard(jnp.zeros((batch,), jnp.int32), _SLOT_NAMES[:1]),
                length=jnp.zeros((), jnp.int32))


def advance_cache(cache: _Cache, token_mask: jax.Array) -> tuple[jax.Array, AttentionMask, _Cache]:
    """``cache.advance`` of any cache NamedTuple with the slot fields ``valid``, ``next_position`` and ``length``:
    ``(positions, mask, cache)`` with the bookkeeping moved on by ``advance_slots``."""
    positions, mask, valid, next_position, length = advance_slots(
        cache.valid, cache.next_position, cache.length, token_mask)
    return positions, mask, cache._replace(valid=valid, next_position=next_position, length=length)


def advance_slots(valid: jax.Array, next_position: jax.Array, length: jax.Array, token_mask: jax.Array
                  ) -> tuple[jax.Array, AttentionMask, jax.Array, jax.Array, jax.Array]:
    """The slot bookkeeping of a fixed-size cache for ``t`` new tokens per row (``token_mask [batch, t]``).

    Returns ``(positions, mask, valid, next_position, length)``: the rope position of each new token (padding
    gets 0; it is never attended to), which slots each new token may attend to (an ``AttentionMask`` with
    ``q_offset = length``, the new tokens' first slot, and ``kv_valid`` the valid slots: real tokens in earlier
    slots or its own), and the bookkeeping moved on by ``t`` slots.
    """
    token_mask = shard(token_mask.astype(bool), _SLOT_NAMES)
    t = token_mask.shape[1]
    positions = next_position[:, None] + jnp.cumsum(token_mask, axis=1, dtype=jnp.int32) - 1
    positions = jnp.where(token_mask, positions, 0)
    valid = jax.lax.dynamic_update_slice(valid, token_mask, (0, length))
    # A row's tokens are contiguous from its first real one, so its document starts at slot - position.
    doc_start = length + jnp.arange(t, dtype=jnp.int32) - positions
    mask = AttentionMask(q_offset=length, kv_valid=valid, doc_start=doc_start)
    next_position = next_position + jnp.sum(token_mask, axis=1, dtype=jnp.int32)
    return positions, mask, valid, next_position, length + t


def write_slots(layer_cache: jax.Array, new: jax.Array, start: jax.Array,
                names: tuple[str | None, ...] = LAYER_KV_CACHE_NAMES) -> jax.Array:
    """``layer_cache [batch, max_len, ...]`` with ``new [batch, t, ...]`` written at slots ``start .. start + t``,
    laid out by ``names`` (default: a GQA cache's ``[batch, max_len, kv_heads, head_dim]``; another cache passes
    the names of its own feature dims)."""
    new = shard(new.astype(layer_cache.dtype), names)
    return jax.lax.dynamic_update_slice(layer_cache, new, (0, start) + (0,) * (layer_cache.ndim - 2))


def ring_slots(max_len: int, window: int | None, chunk: int | None) -> int:
    """Slots a layer's cache needs: ``window - 1`` past keys for a window (the new tokens come on top), ``chunk -
    1`` for a chunk, all ``max_len`` for a full layer (or when the ring would be no smaller)."""
    sizes = [max_len] + [n - 1 for n in (window, chunk) if n is not None]
    return max(1, min(sizes))


def ring_keys(ring: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """``[batch, ring + t, ...]``: a ring's keys (or values) in slot order, slots ``start - ring .. start - 1``
    (those before 0 never written), then the ``t`` new ones at ``start ..``; laid out like the ring."""
    size = ring.shape[1]
    twice = jnp.concatenate([ring, ring], axis=1)
    ordered = jax.lax.dynamic_slice_in_dim(twice, start % size, size, axis=1)  # ring index (start + j) % size
    return jnp.concatenate([ordered, new.astype(ring.dtype)], axis=1)


def ring_mask(mask: AttentionMask, size: int, start: jax.Array, t: int) -> AttentionMask:
    """A decode step's ``mask`` (over every slot of the cache) for keys read by ``ring_keys``: key ``j`` is slot
    ``start - size + j``; the queries keep their slots relative to it (``q_offset = size``)."""
    valid = jnp.pad(mask.kv_valid, ((0, 0), (size, 0)))  # slots before 0: never written
    valid = jax.lax.dynamic_slice_in_dim(valid, start, size + t, axis=1)
    return AttentionMask(q_offset=size, kv_valid=valid, doc_start=mask.doc_starts(t) - (start - size))


def write_ring(ring: jax.Array, new: jax.Array, start: jax.Array,
               names: tuple[str | None, ...] = LAYER_KV_CACHE_NAMES) -> jax.Array:
    """``ring [batch, size, ...]`` with ``new [batch, t, ...]`` (slots ``start .. start + t - 1``) written at ring
    indices ``slot % size``; of more than ``size`` new tokens only the last ``size`` stay."""
    size, t = ring.shape[1], new.shape[1]
    kept = min(t, size)
    new = shard(new[:, t - kept:].astype(ring.dtype), names)
    if kept == 1:
        return jax.lax.dynamic_update_slice(ring, new, (0, (start + t - 1) % size) + (0,) * (ring.ndim - 2))
    index = (start + t - kept + jnp.arange(kept)) % size
    return ring.at[:, index].set(new)


class StackedKVCache(NamedTuple):
    """The decoding cache of a model whose layers come in stacks of kinds (full attention, sliding window,
    chunked; ``nnx_zoo.models.causal_lm``): per stack name, ``k``, ``v [layers, batch, slots, kv_heads,
    head_dim]``, with ``slots`` the whole ``max_len`` for full-attention stacks and a ring (``ring_slots``) for
    window and chunk ones; the slot bookkeeping (``valid [batch, max_len]``, ``next_position``, ``length``) is
    ``KVCache``'s, shared by every stack.

    >>> cache = StackedKVCache.zeros({"layers": (4, 64, 2, 16), "sliding_layers": (20, 127, 2, 16)},
    ...                              batch=2, max_len=8192, dtype=jnp.bfloat16)
    >>> positions, mask, cache = cache.advance(token_mask)
    """

    k: dict[str, jax.Array]
    v: dict[str, jax.Array]
    valid: jax.Array
    next_position: jax.Array
    length: jax.Array

    @classmethod
    def zeros(cls, stacks: dict[str, tuple[int, int, int, int]], *, batch: int, max_len: int,
              dtype: jnp.dtype) -> StackedKVCache:
        """An empty cache: ``stacks`` maps each stack's name to ``(layers, slots, kv_heads, head_dim)``; laid
        out on the ambient mesh by the cache's logical names."""
        slots = empty_slots(batch, max_len)
        arrays = {name: (layers, batch, size, heads, dim) for name, (layers, size, heads, dim) in stacks.items()}
        return cls(k={n: shard(jnp.zeros(s, dtype), KV_CACHE_NAMES) for n, s in arrays.items()},
                   v={n: shard(jnp.zeros(s, dtype), KV_CACHE_NAMES) for n, s in arrays.items()}, **slots)

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def bytes_per_token_per_layer(self) -> int:
        """Bytes the key and value arrays of the full-attention layers hold per cached token per layer (rings
        hold a fixed number of tokens whatever the context: ``nbytes`` counts everything)."""
        full = [n for n, k in self.k.items() if k.shape[2] == self.max_len]
        if not full:
            return 0
        layers = sum(self.k[n].shape[0] for n in full)
        batch = self.valid.shape[0]
        return sum(self.k[n].nbytes + self.v[n].nbytes for n in full) // (layers * batch * self.max_len)

    def nbytes(self) -> int:
        """Bytes of every stack's keys and values."""
        return sum(a.nbytes for a in (*self.k.values(), *self.v.values()))

    def advance(self, token_mask: jax.Array) -> tuple[jax.Array, AttentionMask, StackedKVCache]:
        """As ``KVCache.advance``: ``(positions, mask over the max_len slots, cache)``."""
        return advance_cache(self, token_mask)
