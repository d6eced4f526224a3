"""DeepSeek-V4's attention kernel: queries over their sliding window of raw keys and their compressed entries,
in one softmax with a per-head sink; keys are values (one shared head).

``attend(q, kv, sinks, token_mask, segment_ids, compressed, ...)``, by ``impl``:

- ``xla``: the reference. Scores ``[b, heads, s, s]`` against every token (masked to the window) and ``[b, heads,
  s, n]`` against every entry (masked to the visible, or on CSA layers the indexer's chosen, ones), one float32
  softmax with the sink column; the indexer's scores ``[b, s, n]`` whole. Memory quadratic in the context.
- ``blockwise``: queries in blocks. A block of ``B`` queries reads only its ``B + window - 1`` raw keys; on an HCA
  layer every entry (``s / rate`` of them, masked per query); on a CSA layer the indexer's scores ``[B, n]`` for
  the block, their top-k, and each query's ``k`` chosen entries gathered ``[B, k, head_dim]``. Each block is
  recomputed in the backward pass (``jax.checkpoint``), so memory is linear in the context.
- ``auto``: ``xla`` while one head's scores (``s * (s + n)``) fit ``XLA_MAX_SCORES``, ``blockwise`` beyond.

Both give the same numbers (top-k ties aside: a ReLU'd indexer score is often exactly 0, and which of several equal
scores ``lax.top_k`` keeps is its own rule, the lower index first, on both paths). Masked scores take the float32
minimum, not -inf: the sink keeps every row's softmax finite.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nnx_zoo.layers.attention import AttentionMask, activation_spec, ambient_mesh, run_per_query_shard
from nnx_zoo.models.deepseek.dsa import index_scores, indexer_kl
from nnx_zoo.sharding import axes_tuple, shard
from nnx_zoo.sharding.plan import compressed_block_rows

XLA_MAX_SCORES = 512 * 512  # as nnx_zoo.layers.attention's CPU threshold
BLOCK = 128  # queries per block of the blockwise path at most (fewer where a block's scratch would pass 64 MiB)
_MIN = float(jnp.finfo(jnp.float32).min)
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_KEYS = ("activation_batch", "activation_kv_length", None)  # keys whole along the sequence on every device
_SCORES = ("activation_batch", "activation_heads", "activation_length", None)
_WHOLE = ("activation_batch", None)


def whole_rows(x: jax.Array) -> jax.Array:
    """``x [b, s]`` whole along the sequence, its rows split as the batch (a mask shared by every row, ``[1, s]``,
    stays whole)."""
    return shard(x, _WHOLE if x.shape[0] > 1 else (None, None))


class IndexerInputs(NamedTuple):
    """A CSA layer's indexer, ready to score: queries ``q [b, s, heads, dim]`` (roped), head weights ``w [b, s,
    heads]`` (float32), its compressed keys ``keys [b, n, dim]``, and how many entries each query keeps."""

    q: jax.Array
    w: jax.Array
    keys: jax.Array
    topk: int


LOSSES = ("off", "dense", "sparse")  # the indexer's training signal (DeepSeek-V3.2's stages)


class Compressed(NamedTuple):
    """A compressed layer's entries ``[b, n, head_dim]`` (keys = values), each one's last token index ``last [b,
    n]`` (-1: empty slot) and document ``segment [b, n]`` (or None), and on a CSA layer its ``indexer``."""

    entries: jax.Array
    last: jax.Array
    segment: jax.Array | None
    indexer: IndexerInputs | None = None

    def visible(self, q_index: jax.Array, q_segment: jax.Array | None) -> jax.Array:
        """``[b, q, n]``: the entries complete at each query (last token at or before it) in its document."""
        out = (self.last >= 0)[:, None, :] & (self.last[:, None, :] <= q_index[None, :, None])
        if self.segment is not None and q_segment is not None:
            out = out & (self.segment[:, None, :] == q_segment[:, :, None])
        return out

    def scores(self, q_index: jax.Array, q_segment: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """CSA: ``(scores [b, q, n], visible [b, q, n])``: the indexer's float32 scores of the queries (the
        indexer inputs' rows) against every entry, and which entries each query sees."""
        ix = self.indexer
        scores = index_scores(ix.q, ix.w, ix.keys)
        # The same layout as the scores (an unpadded batch's visibility is one row for all).
        visible = jnp.broadcast_to(self.visible(q_index, q_segment), scores.shape)
        if ambient_mesh() is not None:
            visible = shard(visible, ("activation_batch", "activation_length", None))
            scores = shard(scores, ("activation_batch", "activation_length", None))
        return scores, visible

    def chosen(self, q_index: jax.Array, q_segment: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """CSA: ``(idx [b, q, k], valid [b, q, k])``, each query's ``k = min(topk, n)`` best visible entries by its
        indexer scores."""
        scores, visible = self.scores(q_index, q_segment)
        _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(self.indexer.topk, scores.shape[-1]))
        return idx, jnp.take_along_axis(visible, idx, axis=-1)


def picked(idx: jax.Array, valid: jax.Array, n: int) -> jax.Array:
    """``[..., n]`` bool: the entries ``idx [..., k]`` picks where ``valid``."""
    return jnp.sum(jax.nn.one_hot(idx, n, dtype=jnp.int32) * valid[..., None].astype(jnp.int32), axis=-2) > 0


def window_mask(q_index: jax.Array, k_index: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None,
                window: int) -> jax.Array:
    """``[b or 1, q, k]``: key ``k`` is one of the ``window`` tokens ending at query ``q`` (itself included), real,
    and in the query's document. ``q_index [q]`` / ``k_index [k]`` are token indices (keys may lie outside the
    sequence: such indices are never visible)."""
    seq = token_mask.shape[1]
    diff = q_index[:, None] - k_index[None, :]
    inside = (k_index >= 0) & (k_index < seq)
    mask = ((diff >= 0) & (diff < window) & inside[None, :])[None]
    k_safe = jnp.clip(k_index, 0, seq - 1)
    mask = mask & jnp.take(token_mask, k_safe, axis=1)[:, None, :]
    if segment_ids is not None:
        q_seg = jnp.take(segment_ids, jnp.clip(q_index, 0, seq - 1), axis=1)
        mask = mask & (q_seg[:, :, None] == jnp.take(segment_ids, k_safe, axis=1)[:, None, :])
    return mask


def softmax_with_sink(parts: list[jax.Array], sinks: jax.Array) -> list[jax.Array]:
    """One float32 softmax over the concatenated key dims of ``parts`` (each ``[b, h, q, k_i]``, masked scores at
    the float32 minimum) and a sink column ``sinks [h]``; the probabilities of each part (the sink's dropped)."""
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (*parts[0].shape[:3], 1))
    # One layout for every part (heads and queries as the rules split them, keys whole): concatenable.
    logits = jnp.concatenate([shard(p.astype(jnp.float32), _SCORES) for p in [*parts, sink]], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    out, start = [], 0
    for p in parts:
        out.append(probs[..., start:start + p.shape[-1]])
        start += p.shape[-1]
    return out


def _segment_of(segment_ids: jax.Array | None, q_index: jax.Array) -> jax.Array | None:
    if segment_ids is None:
        return None
    return jnp.take(segment_ids, jnp.clip(q_index, 0, segment_ids.shape[1] - 1), axis=1)


def _kl(entry_probs: jax.Array, index: jax.Array, seen: jax.Array, head_axes: tuple[str, ...] = ()) -> jax.Array:
    """Per query ``KL(p || softmax(index))`` over the ``seen`` entries: ``p`` the attention's probabilities on them
    (``entry_probs [b, h, q, k]``) summed over heads (all devices' heads: ``head_axes``), L1-normalized, detached
    (``dsa.indexer_kl``)."""
    return indexer_kl(jnp.moveaxis(entry_probs, 1, 2), jnp.where(seen, index, _MIN), seen, head_axes)


def reference(q: jax.Array, kv: jax.Array, sinks: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None,
              compressed: Compressed | None, *, window: int, scale: float, loss: str = "off"
              ) -> tuple[jax.Array, jax.Array | None]:
    """The ``xla`` path: ``q [b, s, h, d]``, ``kv [b, s, d]`` (keys = values), ``sinks [h]`` -> ``([b, s, h, d],
    the CSA indexer's per-query KL [b, s] or None)``."""
    seq = q.shape[1]
    index = jnp.arange(seq)
    kv, token_mask = shard(kv, _KEYS), whole_rows(token_mask)
    segment_ids = None if segment_ids is None else whole_rows(segment_ids)
    scores = jnp.einsum("bshd,btd->bhst", q, kv) * jnp.asarray(scale, q.dtype)
    parts = [jnp.where(window_mask(index, index, token_mask, segment_ids, window)[:, None], scores, _MIN)]
    values = [kv]
    index_scores_ = seen = None
    if compressed is not None:
        n = compressed.entries.shape[1]
        if compressed.indexer is None:
            seen = compressed.visible(index, segment_ids)
        else:
            index_scores_, seen = compressed.scores(index, segment_ids)
            if loss != "dense":  # the indexer's top-k; its dense warm-up attends to every visible entry
                _, idx = jax.lax.top_k(jnp.where(seen, index_scores_, -jnp.inf), min(compressed.indexer.topk, n))
                seen = picked(idx, jnp.take_along_axis(seen, idx, axis=-1), n)
        entry_scores = jnp.einsum("bshd,bnd->bhsn", q, compressed.entries) * jnp.asarray(scale, q.dtype)
        parts.append(jnp.where(seen[:, None], entry_scores, _MIN))
        values.append(compressed.entries)
    probs = softmax_with_sink(parts, sinks)
    out = sum(jnp.einsum("bhsk,bkd->bshd", p.astype(v.dtype), v) for p, v in zip(probs, values, strict=True))
    kl = None if loss == "off" or index_scores_ is None else _kl(probs[1], index_scores_, seen)
    return shard(out, _BLHD), kl


def blockwise(q: jax.Array, kv: jax.Array, sinks: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None,
              compressed: Compressed | None, *, window: int, scale: float, loss: str = "off",
              block: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """The ``blockwise`` path (arguments and result as ``reference``): ``lax.map`` over blocks of ``block``
    queries (``BLOCK``), each under ``jax.checkpoint``. On a mesh each device runs its own queries (split over the
    batch, the sequence and the heads as the rules say) against every key and entry of its rows
    (``run_per_query_shard``): a window's keys may live on the previous sequence shard."""
    mesh = ambient_mesh()
    ix = None if compressed is None else compressed.indexer
    kwargs = dict(window=window, scale=scale, loss=loss, block=block, has_compressed=compressed is not None,
                  has_segments=compressed is not None and compressed.segment is not None, has_indexer=ix is not None,
                  topk=0 if ix is None else ix.topk)
    kv = shard(kv, _KEYS)
    queries = [q, sinks] + ([ix.q, ix.w] if ix is not None else [])
    keys = [kv] + ([compressed.entries, compressed.last] if compressed is not None else [])
    keys += [compressed.segment] if kwargs["has_segments"] else []
    keys += [ix.keys] if ix is not None else []
    mask = AttentionMask(0, token_mask, segment_ids)
    if mesh is None:
        out, kl = _blockwise_local(*queries, *keys, jnp.zeros((), jnp.int32), token_mask,
                                   segment_ids, segment_ids, head_axes=(), **kwargs)
        return shard(out, _BLHD), (kl if loss != "off" and ix is not None else None)
    q_spec = activation_spec(_BLHD, q.shape)
    head_axes = axes_tuple(q_spec[2])
    specs = [q_spec, P(q_spec[2])]
    if ix is not None:
        specs += [activation_spec(_BLHD[:2] + (None, None), ix.q.shape),
                  activation_spec(_BLHD[:2] + (None,), ix.w.shape)]
    key_specs = [activation_spec(_KEYS, a.shape) if a.ndim == 3 else activation_spec(_WHOLE, a.shape) for a in keys]
    kl_spec = P(*q_spec[:2]) if loss != "off" and ix is not None else None
    out, kl = run_per_query_shard(functools.partial(_blockwise_local, head_axes=head_axes, **kwargs),
                                  queries=list(zip(queries, specs, strict=True)),
                                  keys=list(zip(keys, key_specs, strict=True)), mask=mask,
                                  out_specs=(q_spec, kl_spec))
    return shard(out, _BLHD), kl


def _blockwise_local(*args: jax.Array, window: int, scale: float, loss: str, block: int | None,
                     has_compressed: bool, has_segments: bool, has_indexer: bool, topk: int,
                     head_axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array | None]:
    """``blockwise`` on one device's queries (``run_per_query_shard``'s argument order: queries, keys, the first
    query's index ``q_offset``, the keys' validity and the queries' and keys' documents), keys whole."""
    args = list(args)
    q, sinks = args.pop(0), args.pop(0)
    ix_q, ix_w = (args.pop(0), args.pop(0)) if has_indexer else (None, None)
    kv = args.pop(0)
    entries, last = (args.pop(0), args.pop(0)) if has_compressed else (None, None)
    entry_segment = args.pop(0) if has_segments else None
    index_keys = args.pop(0) if has_indexer else None
    q_offset, token_mask, _, segment_ids = args
    token_mask = jnp.ones((1, kv.shape[1]), bool) if token_mask is None else token_mask
    compressed = None
    if has_compressed:
        indexer = IndexerInputs(ix_q, ix_w, index_keys, topk) if has_indexer else None
        compressed = Compressed(entries, last, entry_segment, indexer)
    b, seq, h, d = q.shape
    block = block or compressed_block_rows(
        seq, window, 0 if entries is None else entries.shape[1], topk, h,
        0 if ix_q is None else ix_q.shape[2], d, max_rows=BLOCK)
    block = min(block, seq)
    pad = -seq % block
    blocks = (seq + pad) // block
    halo = window - 1
    kv_padded = jnp.pad(kv, ((0, 0), (halo, pad), (0, 0)))  # index i of the sequence at i + halo
    q_padded = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    ix = None if compressed is None else compressed.indexer
    index_padded = None if ix is None else (jnp.pad(ix.q, ((0, 0), (0, pad), (0, 0), (0, 0))),
                                            jnp.pad(ix.w, ((0, 0), (0, pad), (0, 0))))

    @jax.checkpoint
    def one_block(start: jax.Array) -> tuple[jax.Array, jax.Array]:
        qb = jax.lax.dynamic_slice_in_dim(q_padded, start, block, axis=1)
        first = q_offset + start  # the block's first query, as an index of the whole sequence
        keys = jax.lax.dynamic_slice_in_dim(kv_padded, first, block + halo, axis=1)
        q_index = first + jnp.arange(block)
        k_index = first - halo + jnp.arange(block + halo)
        visible = window_mask(q_index, k_index, token_mask, segment_ids, window)[:, None]
        scores = jnp.einsum("bshd,btd->bhst", qb, keys) * jnp.asarray(scale, q.dtype)
        parts = [jnp.where(visible, scores, _MIN)]
        q_segment = _segment_of(segment_ids, q_index)
        kl = jnp.zeros((b, block), jnp.float32)
        if compressed is not None and (ix is None or loss == "dense"):  # every entry, masked per query
            entries, equation = compressed.entries, "bshd,bnd->bhsn"
            if ix is None:
                seen = compressed.visible(q_index, q_segment)
            else:
                block_ix = ix._replace(q=jax.lax.dynamic_slice_in_dim(index_padded[0], start, block, axis=1),
                                       w=jax.lax.dynamic_slice_in_dim(index_padded[1], start, block, axis=1))
                index, seen = compressed._replace(indexer=block_ix).scores(q_index, q_segment)
        elif compressed is not None:  # CSA: each query's chosen entries, gathered
            block_ix = ix._replace(q=jax.lax.dynamic_slice_in_dim(index_padded[0], start, block, axis=1),
                                   w=jax.lax.dynamic_slice_in_dim(index_padded[1], start, block, axis=1))
            block_compressed = compressed._replace(indexer=block_ix)
            index_all, visible_all = block_compressed.scores(q_index, q_segment)
            _, idx = jax.lax.top_k(jnp.where(visible_all, index_all, -jnp.inf), min(ix.topk, index_all.shape[-1]))
            seen = jnp.take_along_axis(visible_all, idx, axis=-1)
            index = jnp.take_along_axis(index_all, idx, axis=-1)
            entries, equation = jax.vmap(lambda e, i: e[i])(compressed.entries, idx), "bshd,bskd->bhsk"
        if compressed is not None:
            entry_scores = jnp.einsum(equation, qb, entries) * jnp.asarray(scale, q.dtype)
            parts.append(jnp.where(seen[:, None], entry_scores, _MIN))
        probs = softmax_with_sink(parts, sinks)
        out = jnp.einsum("bhst,btd->bshd", probs[0].astype(keys.dtype), keys)
        if compressed is not None:
            values = "bhsn,bnd->bshd" if equation == "bshd,bnd->bhsn" else "bhsk,bskd->bshd"
            out = out + jnp.einsum(values, probs[1].astype(q.dtype), entries)
            if loss != "off" and ix is not None:
                kl = _kl(probs[1], index, seen, head_axes)
        return out, kl

    out, kl = jax.lax.map(one_block, jnp.arange(blocks) * block)  # [blocks, b, block, ...]
    out = jnp.moveaxis(out, 0, 1).reshape(b, blocks * block, h, d)[:, :seq]
    kl = jnp.moveaxis(kl, 0, 1).reshape(b, blocks * block)[:, :seq]
    return out, (None if loss == "off" or ix is None else kl)


def attend(q: jax.Array, kv: jax.Array, sinks: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None,
           compressed: Compressed | None, *, window: int, scale: float, impl: str = "auto", loss: str = "off"
           ) -> tuple[jax.Array, jax.Array | None]:
    """V4's attention by ``impl`` (``xla``, ``blockwise`` or ``auto``; see the module docstring): ``(out [b, s, h,
    d], kl)``. ``loss`` (``LOSSES``) trains a CSA layer's indexer: ``dense`` attends to every visible entry and
    gives each query's KL from the attention's distribution over them to the indexer's (its warm-up); ``sparse``
    attends to the chosen entries and gives the KL over those; ``off`` (and any layer without an indexer) gives
    None."""
    seq = q.shape[1]
    n = 0 if compressed is None else compressed.entries.shape[1]
    if impl == "auto":
        impl = "xla" if seq * (seq + n) <= XLA_MAX_SCORES else "blockwise"
    if impl == "xla":
        return reference(q, kv, sinks, token_mask, segment_ids, compressed, window=window, scale=scale, loss=loss)
    if impl == "blockwise":
        return blockwise(q, kv, sinks, token_mask, segment_ids, compressed, window=window, scale=scale, loss=loss)
    raise ValueError(f"unknown DeepSeek-V4 attention_impl {impl!r}; choose 'auto', 'xla' or 'blockwise'")
