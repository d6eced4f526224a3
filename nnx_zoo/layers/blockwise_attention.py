"""Blockwise ("flash") attention in plain JAX: an online softmax over key blocks, any backend.

The scores of one query block against one key block (a ``[q_block, k_block]`` tile per head) are the largest
thing ever built, so memory grows linearly with the sequence, not with its square. The forward keeps, per query
row, the running maximum ``m``, the running sum ``l`` (``total``) of ``exp(score - m)`` and the running weighted
sum of values; each new key block rescales them by ``exp(m_old - m_new)``. The backward (``jax.custom_vjp``) saves only
the output and the log-sum-exp ``lse = m + log(l)`` per row and recomputes each tile's probabilities
``exp(score - lse)``, as FlashAttention-2 does:

    dv  += p^T do                 dp = do v^T
    ds   = p * (dp - rowsum(do * o))
    dq  += ds k * scale           dk += ds^T q * scale

Causal masking skips key blocks that lie wholly after a query block's last row (the loop over key blocks stops
early; its bound may be traced, e.g. a decode step's cache length); a sliding window or a chunk also skips the
blocks wholly before the block's first visible key (the loop starts late), so a window-``w`` layer costs
``O(seq x w)``. Softmax statistics are float32 whatever the input dtype.

Three more terms of the score, all optional: ``softcap`` (``s -> cap * tanh(s / cap)``, Gemma 2's logit
soft-capping; the backward multiplies by ``1 - tanh^2``), and ``sinks`` (one learned logit per query head, an extra
softmax column with no value, GPT-OSS's): the online softmax starts from it (``m = sink``, ``l = 1``), so it only
enlarges the normalizer, and its gradient is ``-sum over rows of exp(sink - lse) * rowsum(do * o)``.

Convention: a query row that sees no key at all (a left-padding query, a padding query of a decode step) gets
output 0 and no gradient. (The einsum reference, ``dot_product_attention``, gives the mean of all values there;
no real token reads those rows.)

This module works on one device's arrays; ``nnx_zoo.layers.attention.attention`` runs it inside ``shard_map``
under a mesh.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512

# Letters in the einsums: b batch, q query position (within a block), k key position (within a block),
# n key/value head, g query head within its key/value head's group, d feature (qk or v width).


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    q_offset: jax.Array | int = 0,
    kv_valid: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    window: int | None = None,
    chunk: int | None = None,
    q_doc_start: jax.Array | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``softmax(q k^T * scale, masked) v`` for grouped queries ``q [b, sq, n, g, d_qk]``, ``k [b, sk, n, d_qk]``,
    ``v [b, sk, n, d_v]`` -> ``[b, sq, n, g, d_v]`` (``v``'s dtype), never building a ``[sq, sk]`` score matrix.

    Query ``i`` sits at key slot ``q_offset + i`` and sees key ``j`` iff ``j <= q_offset + i`` (causal),
    ``kv_valid[b, j]`` (None: all keys valid) and ``q_segment_ids[b, i] == kv_segment_ids[b, j]`` (both None: one
    document). ``block_q`` / ``block_k`` need not divide the lengths (the arrays are padded to whole blocks).

    Local attention (``nnx_zoo.layers.attention_mask``'s rules): ``window`` hides keys at slots ``<= q_slot -
    window``; ``chunk`` hides keys before the start of the query's chunk, the chunks counted from the query's
    document start ``q_doc_start [b, sq]`` (a slot; required with ``chunk``). ``softcap``: scores become ``cap *
    tanh(score / cap)`` (after ``scale``). ``sinks [n, g]`` (float32, grouped like the query heads): one logit per
    query head joining the softmax's normalizer; differentiable.

    >>> out = blockwise_attention(q, k, v, scale=64**-0.5, kv_valid=attention_mask.astype(bool))
    """
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
    b, sq, n, g, _ = q.shape
    sk = k.shape[1]
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[2] != n:
        raise ValueError(f"shapes do not fit: q {q.shape} (grouped [b, sq, n, g, d]), k {k.shape}, v {v.shape}")
    if chunk is not None and q_doc_start is None:
        raise ValueError("chunked attention needs q_doc_start (each query's document start slot)")
    for name, size in (("window", window), ("chunk", chunk)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {size!r}")
    if sinks is not None and sinks.shape != (n, g):
        raise ValueError(f"sinks {sinks.shape} must be [kv heads, group] = {(n, g)} (one per query head)")
    bq, bk = max(1, min(block_q, sq)), max(1, min(block_k, sk))
    masks = (jnp.asarray(q_offset, jnp.int32),
             None if kv_valid is None else kv_valid.astype(bool),
             q_segment_ids, kv_segment_ids, None if chunk is None else q_doc_start.astype(jnp.int32))
    rule = _Rule(float(scale), bq, bk, window, chunk, None if softcap is None else float(softcap))
    return _flash(rule, q, k, v, None if sinks is None else sinks.astype(jnp.float32), masks)


# ------------------------------------------------------------------------------------------------- shared pieces
def _pad_to(x: jax.Array | None, axis: int, multiple: int, value: int | bool = 0) -> jax.Array | None:
    """``x`` padded at the end of ``axis`` to a multiple of ``multiple`` (None stays None)."""
    if x is None or x.shape[axis] % multiple == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, multiple - x.shape[axis] % multiple)
    return jnp.pad(x, pad, constant_values=value)


def _slice(x: jax.Array | None, start: jax.Array, size: int, axis: int) -> jax.Array | None:
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


class _Rule(NamedTuple):
    """The static part of a call (hashable: ``custom_vjp``'s non-differentiable argument)."""

    scale: float
    bq: int
    bk: int
    window: int | None
    chunk: int | None
    softcap: float | None


def _chunk_starts(q_pos: jax.Array, doc_start: jax.Array, chunk: int) -> jax.Array:
    """``[b, bq]``: the first slot of each query's chunk (chunks of ``chunk`` slots from its document start)."""
    return q_pos[None, :] - (q_pos[None, :] - doc_start) % chunk


def _visible(rule: _Rule, q_pos: jax.Array, k_pos: jax.Array, k_len: int, kv_valid: jax.Array | None,
             q_seg: jax.Array | None, kv_seg: jax.Array | None, doc_start: jax.Array | None) -> jax.Array:
    """Boolean ``[b or 1, 1, 1, bq, bk]`` (against scores ``[b, n, g, bq, bk]``): which keys of this tile each
    query sees. ``k_pos < k_len`` hides the padding that rounds the keys up to whole blocks."""
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < k_len)[None, :]  # [bq, bk]
    if rule.window is not None:
        seen = seen & (k_pos[None, :] > q_pos[:, None] - rule.window)
    seen = seen[None]
    if rule.chunk is not None:
        seen = seen & (k_pos[None, None, :] >= _chunk_starts(q_pos, doc_start, rule.chunk)[:, :, None])
    if kv_valid is not None:
        seen = seen & kv_valid[:, None, :]
    if q_seg is not None:
        seen = seen & (q_seg[:, :, None] == kv_seg[:, None, :])
    return seen[:, None, None]


def _key_blocks_to_visit(rule: _Rule, q_offset: jax.Array, q_start: jax.Array, nk: int,
                         doc_start: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The key blocks ``[first, stop)`` a query block starting at row ``q_start`` needs: up to the one holding its
    last row's slot (causal), at most all ``nk``; from the one holding its first row's earliest visible slot (a
    window's or a chunk's start; 0 without either)."""
    first_slot = q_offset + q_start
    stop = jnp.clip((first_slot + rule.bq - 1) // rule.bk + 1, 0, nk)
    earliest = jnp.zeros((), jnp.int32)
    if rule.window is not None:
        earliest = jnp.maximum(earliest, first_slot - rule.window + 1)
    if rule.chunk is not None:  # the earliest chunk start of any row (rows of other documents start later)
        starts = _chunk_starts(first_slot + jnp.arange(rule.bq), doc_start, rule.chunk)
        earliest = jnp.maximum(earliest, jnp.min(starts))
    return jnp.clip(earliest // rule.bk, 0, stop), stop


def _varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """``x`` (a fresh loop carry: zeros) typed to vary over the manual mesh axes ``ref`` varies over, so a loop
    inside ``shard_map`` keeps its carry's type (outside ``shard_map``: ``x`` itself)."""
    missing = tuple(a for a in varying_axes(ref) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)  # jax 0.10; later versions name the set ``vma``
    return manual.varying if manual is not None else getattr(jax.typeof(x), "vma", frozenset())


def _scores(q_blk: jax.Array, k_blk: jax.Array, rule: _Rule) -> jax.Array:
    """``[b, n, g, bq, bk]`` float32 scores of one tile (soft-capped with ``rule.softcap``)."""
    s = jnp.einsum("bqngd,bknd->bngqk", q_blk, k_blk, preferred_element_type=jnp.float32)
    s = s * jnp.float32(rule.scale)
    return s if rule.softcap is None else rule.softcap * jnp.tanh(s / rule.softcap)


# ----------------------------------------------------------------------------------------------------- forward
_FAR = 2**30  # the document start given to the padding rows that round queries up to whole blocks


def _padded_inputs(rule: _Rule, q, k, v, masks):
    """The inputs padded to whole blocks: ``(q, k, v, q_seg, kv_valid, kv_seg, doc_start)``."""
    _, kv_valid, q_seg, kv_seg, doc_start = masks
    return (_pad_to(q, 1, rule.bq), _pad_to(k, 1, rule.bk), _pad_to(v, 1, rule.bk), _pad_to(q_seg, 1, rule.bq, -1),
            _pad_to(kv_valid, 1, rule.bk, False), _pad_to(kv_seg, 1, rule.bk, -1),
            _pad_to(doc_start, 1, rule.bq, _FAR))


def _forward(rule: _Rule, q, k, v, sinks, masks):
    """``(out [b, sq, n, g, d_v], lse [b, n, g, sq] float32)``; ``lse`` is +inf on rows that see no key (and
    have no sink)."""
    q_offset = masks[0]
    bq, bk = rule.bq, rule.bk
    b, sq, n, g, _ = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    q_p, k_p, v_p, q_seg_p, kv_valid_p, kv_seg_p, doc_p = _padded_inputs(rule, q, k, v, masks)
    nq, nk = q_p.shape[1] // bq, k_p.shape[1] // bk

    def query_block(i, carry):
        out, lse = carry
        q_start = i * bq
        q_blk = _slice(q_p, q_start, bq, 1)
        q_pos = q_offset + q_start + jnp.arange(bq)
        q_seg_blk, doc_blk = _slice(q_seg_p, q_start, bq, 1), _slice(doc_p, q_start, bq, 1)

        def key_block(j, state):
            m, total, acc = state
            k_start = j * bk
            s = _scores(q_blk, _slice(k_p, k_start, bk, 1), rule)
            seen = _visible(rule, q_pos, k_start + jnp.arange(bk), sk, _slice(kv_valid_p, k_start, bk, 1),
                            q_seg_blk, _slice(kv_seg_p, k_start, bk, 1), doc_blk)
            m_new = jnp.maximum(m, jnp.max(jnp.where(seen, s, -jnp.inf), axis=-1))
            # A row that has seen nothing yet keeps m = -inf; shift it by 0 so no exp(-inf - -inf) = NaN appears.
            shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.where(seen, jnp.exp(s - shift[..., None]), 0.0)
            correction = jnp.exp(m - shift)  # 0 while m = -inf
            total = correction * total + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bngqk,bknd->bngqd", p.astype(v.dtype), _slice(v_p, k_start, bk, 1),
                            preferred_element_type=jnp.float32)
            return m_new, total, correction[..., None] * acc + pv

        if sinks is None:
            m0, total0 = jnp.full((b, n, g, bq), -jnp.inf, jnp.float32), jnp.zeros((b, n, g, bq), jnp.float32)
        else:  # the sink is a key that every row sees, with no value: exp(sink - m) = 1 at m = sink
            m0 = jnp.broadcast_to(sinks[None, :, :, None], (b, n, g, bq))
            total0 = jnp.ones((b, n, g, bq), jnp.float32)
        state = (m0, total0, jnp.zeros((b, n, g, bq, dv), jnp.float32))
        state = tuple(_varying_like(x, q_blk) for x in state)
        first, stop = _key_blocks_to_visit(rule, q_offset, q_start, nk, doc_blk)
        m, total, acc = jax.lax.fori_loop(first, stop, key_block, state)
        seen_any = total > 0
        o_blk = jnp.where(seen_any[..., None], acc / jnp.where(seen_any, total, 1.0)[..., None], 0.0)
        lse_blk = jnp.where(seen_any, m + jnp.log(jnp.where(seen_any, total, 1.0)), jnp.inf)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.einsum("bngqd->bqngd", o_blk).astype(out.dtype),
                                                  q_start, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, lse_blk, q_start, axis=3)
        return out, lse

    out = _varying_like(jnp.zeros((b, nq * bq, n, g, dv), v.dtype), q)
    lse = _varying_like(jnp.zeros((b, n, g, nq * bq), jnp.float32), q)
    out, lse = jax.lax.fori_loop(0, nq, query_block, (out, lse))
    return out[:, :sq], lse[..., :sq]


# ---------------------------------------------------------------------------------------------------- backward
def _backward(rule: _Rule, residuals, d_out):
    q, k, v, sinks, masks, out, lse = residuals
    q_offset = masks[0]
    bq, bk = rule.bq, rule.bk
    sq, sk = q.shape[1], k.shape[1]
    # rowsum(do * o): the softmax's Jacobian term, one number per query row, [b, n, g, sq].
    delta = jnp.einsum("bqngd,bqngd->bngq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    q_p, k_p, v_p, q_seg_p, kv_valid_p, kv_seg_p, doc_p = _padded_inputs(rule, q, k, v, masks)
    do_p = _pad_to(d_out.astype(v.dtype), 1, bq)  # padded rows: do = 0, no gradient
    lse_p, delta_p = _pad_to(lse, 3, bq), _pad_to(delta, 3, bq)
    nq, nk = q_p.shape[1] // bq, k_p.shape[1] // bk

    def query_block(i, carry):
        dq, dk, dv = carry
        q_start = i * bq
        q_blk, do_blk = _slice(q_p, q_start, bq, 1), _slice(do_p, q_start, bq, 1)
        lse_blk, delta_blk = _slice(lse_p, q_start, bq, 3), _slice(delta_p, q_start, bq, 3)
        q_pos = q_offset + q_start + jnp.arange(bq)
        q_seg_blk, doc_blk = _slice(q_seg_p, q_start, bq, 1), _slice(doc_p, q_start, bq, 1)
        # Rows that saw no key have lse = +inf: exp(s - inf) = 0, so they add nothing.
        finite_lse = jnp.where(jnp.isinf(lse_blk), 0.0, lse_blk)

        def key_block(j, state):
            dq_blk, dk, dv = state
            k_start = j * bk
            k_blk, v_blk = _slice(k_p, k_start, bk, 1), _slice(v_p, k_start, bk, 1)
            s = _scores(q_blk, k_blk, rule)
            seen = _visible(rule, q_pos, k_start + jnp.arange(bk), sk, _slice(kv_valid_p, k_start, bk, 1),
                            q_seg_blk, _slice(kv_seg_p, k_start, bk, 1), doc_blk)
            seen = seen & jnp.isfinite(lse_blk)[..., None]
            p = jnp.where(seen, jnp.exp(s - finite_lse[..., None]), 0.0)  # [b, n, g, bq, bk]
            dv_blk = jnp.einsum("bngqk,bqngd->bknd", p.astype(v.dtype), do_blk, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqngd,bknd->bngqk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_blk[..., None])
            if rule.softcap is not None:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2, and s is the capped score
                ds = ds * (1.0 - jnp.square(s / rule.softcap))
            ds = ds * jnp.float32(rule.scale)
            dq_blk = dq_blk + jnp.einsum("bngqk,bknd->bqngd", ds.astype(k.dtype), k_blk,
                                         preferred_element_type=jnp.float32)
            dk_blk = jnp.einsum("bngqk,bqngd->bknd", ds.astype(q.dtype), q_blk, preferred_element_type=jnp.float32)
            dk = jax.lax.dynamic_update_slice_in_dim(dk, _slice(dk, k_start, bk, 1) + dk_blk, k_start, axis=1)
            dv = jax.lax.dynamic_update_slice_in_dim(dv, _slice(dv, k_start, bk, 1) + dv_blk, k_start, axis=1)
            return dq_blk, dk, dv

        dq_blk = _varying_like(jnp.zeros(q_blk.shape, jnp.float32), q_blk)
        first, stop = _key_blocks_to_visit(rule, q_offset, q_start, nk, doc_blk)
        dq_blk, dk, dv = jax.lax.fori_loop(first, stop, key_block, (dq_blk, dk, dv))
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_blk, q_start, axis=1)
        return dq, dk, dv

    zeros = tuple(_varying_like(jnp.zeros(x.shape, jnp.float32), q) for x in (q_p, k_p, v_p))
    dq, dk, dv = jax.lax.fori_loop(0, nq, query_block, zeros)
    d_sinks = None
    if sinks is not None:  # d lse / d sink = exp(sink - lse), the sink's probability; d loss / d lse = -delta
        p_sink = jnp.exp(sinks[None, :, :, None] - jnp.where(jnp.isinf(lse), jnp.inf, lse))
        d_sinks = -jnp.einsum("bngq,bngq->ng", p_sink, delta)
    mask_cotangents = jax.tree.map(lambda _: None, masks)  # integer/boolean inputs: no cotangent
    return (dq[:, :sq].astype(q.dtype), dk[:, :sk].astype(k.dtype), dv[:, :sk].astype(v.dtype), d_sinks,
            mask_cotangents)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(rule: _Rule, q, k, v, sinks, masks):
    return _forward(rule, q, k, v, sinks, masks)[0]


def _flash_fwd(rule: _Rule, q, k, v, sinks, masks):
    out, lse = _forward(rule, q, k, v, sinks, masks)
    return out, (q, k, v, sinks, masks, out, lse)


_flash.defvjp(_flash_fwd, _backward)
