"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer, and MLA over the keys it selects.

The indexer (transformers' ``DeepseekV32Indexer``) scores query ``t`` against key ``s``, in float32:

    I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s] / sqrt(D))

with ``q = wq_b(q_latent)`` (``index_n_heads`` heads of width ``D = index_head_dim``, read from MLA's normed query
latent), one key head ``k = LayerNorm(wk(x))`` shared by all indexer heads, both rotated on their first
``qk_rope_head_dim`` dims (V3.2: rotate-half rope, while MLA itself rotates interleaved pairs; GLM-5: consecutive
pairs, ``index_rope_interleave``), and per-head weights ``w = weights_proj(x) / sqrt(index_n_heads)`` (a float32
projection). Query ``t`` attends only to the ``index_topk`` visible keys with the highest ``I[t, :]`` (to every
visible key when fewer are visible).

A layer may also attend to the keys an earlier layer's indexer chose and run no indexer itself (GLM-5's "shared"
layers): ``sparse_attention_choosing`` hands its choice ``[b, q, topk]`` on, ``sparse_attention_chosen`` attends to
a given one.

How it is computed (``sparse_attention``): queries go in blocks. For one block the indexer's scores
``[block, keys]`` are built, their top-k taken, and each query's chosen keys gathered from MLA's per-token entries,
the normed latent and the shared rope key (``kv_lora_rank + qk_rope_head_dim`` numbers, 576 in V3.2), never
per-head keys and values. Attention runs in MLA's absorbed (multi-query) form, as ``MLA.decode`` and DeepSeek's own
kernels do: scores ``q_latent . latent + q_rope . k_rope`` with ``q_latent = q_nope`` taken through
``kv_b_proj``'s key half, and the value half applied after the weighted sum of latents. No ``[seq, seq]`` array is
built: per block there are the indexer's ``[block, keys]`` scores and the gathered ``[block, topk, 576]``
entries, both recomputed in the backward pass (``jax.checkpoint``). Under a mesh each device runs its own
queries (split over the sequence by context parallelism) against all keys: latents, rope keys and indexer keys
are gathered over the sequence first (``activation_kv_length``), so a query's top-k spans every shard and needs
no merge.

Training the indexer (the V3.2 report, section 2.1): per query, the KL divergence from the main attention's
distribution (summed over heads, L1-normalized; detached) to the softmax of the indexer's scores. Stage
``dense_warmup``: over all visible keys, with dense attention. Stage ``sparse``: over the selected keys. The
indexer reads detached inputs, so its loss trains the indexer alone, and the language-model loss never reaches
the indexer (its top-k is not differentiable).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.scipy.special import xlogy
from jax.sharding import PartitionSpec

from nnx_zoo.layers.attention import AttentionMask, activation_spec, run_per_query_shard
from nnx_zoo.layers.blockwise_attention import varying_axes
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.norm import LayerNorm
from nnx_zoo.layers.rope import apply_rope
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.sharding import axes_tuple
from nnx_zoo.sharding.plan import SPARSE_MAX_ROWS, sparse_block_rows

_BLQ = ("activation_batch", "activation_length", "activation_q_lora")
_BLID = ("activation_batch", "activation_length", None, None)  # indexer queries [b, s, index heads, width]
_BLI = ("activation_batch", "activation_length", None)  # indexer head weights [b, s, index heads]
_BLD = ("activation_batch", "activation_length", None)  # indexer keys [b, s, width]
_Q_SIDE = ("activation_batch", "activation_length", "activation_heads", None)  # absorbed queries [b, s, h, c]
_K_SIDE = ("activation_batch", "activation_kv_length", None)  # per-token entries [b, keys, c]
_MIN = float(jnp.finfo(jnp.float32).min)
_MAX_BLOCK = SPARSE_MAX_ROWS  # query rows per block at most (tests shrink it)


class LightningIndexer(nnx.Module):
    """DeepSeek-V3.2's lightning indexer for one MLA layer: ``queries`` and ``keys``, scored by ``index_scores``.

    >>> config = DeepSeekV3Config.preset("deepseek3-mini", index_topk=8, index_n_heads=4, index_head_dim=32)
    >>> indexer = LightningIndexer(config, rngs=nnx.Rngs(0))
    """

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs):
        c = config
        dtypes = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
        init = nnx.initializers.normal(c.initializer_range)
        self.heads, self.dim = c.index_n_heads, c.index_head_dim
        self.interleaved = c.index_rope_interleave  # rope on the first qk_rope_head_dim dims: pairs or halves
        self.wq_b = Linear(c.q_lora_rank, (c.index_n_heads, c.index_head_dim), kernel_names=(
            "q_lora", "index_heads", "index_kv"), kernel_init=init, rngs=rngs, **dtypes)
        self.wk = Linear(c.hidden_size, c.index_head_dim, kernel_names=("embed", "index_kv"), kernel_init=init,
                         rngs=rngs, **dtypes)
        self.k_norm = LayerNorm(c.index_head_dim, eps=1e-6, **dtypes)  # named 'norm': no weight decay, replicated
        # float32 whatever the model's dtype, as transformers keeps it (_keep_in_fp32_modules)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, kernel_names=("embed", "index_heads"),
                                   kernel_init=init, rngs=rngs, dtype=jnp.float32, param_dtype=jnp.float32)

    def queries(self, x: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """``(q [b, s, heads, dim], w [b, s, heads] float32)`` for ``x [b, s, embed]`` and MLA's normed query
        latent ``q_latent [b, s, q_lora]``; both inputs are detached (the indexer trains on its own loss only)."""
        x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
        q = apply_rope(self.wq_b(q_latent, _BLID), cos, sin, interleaved=self.interleaved)
        w = self.weights_proj(x.astype(jnp.float32), _BLI) * (self.heads ** -0.5)
        return q, w

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """The indexer's key of each token ``[b, s, dim]`` (one head for all; what a decoding cache keeps)."""
        k = self.k_norm(self.wk(jax.lax.stop_gradient(x), _BLD))
        return apply_rope(k[:, :, None, :], cos, sin, interleaved=self.interleaved)[:, :, 0, :]


def index_scores(q: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
    """The indexer's float32 scores ``[b, queries, keys]`` for ``q [b, queries, heads, dim]``, ``w [b, queries,
    heads]`` and ``k [b, keys, dim]`` (every query against the same keys), or ``k [b, queries, keys, dim]`` (each
    query against its own): ``sum_j w_j * relu(q_j . k / sqrt(dim))`` (transformers' order of operations)."""
    equation = "bqhd,bkd->bqhk" if k.ndim == 3 else "bqhd,bqkd->bqhk"
    scores = jnp.einsum(equation, q.astype(jnp.float32), k.astype(jnp.float32))
    scores = jax.nn.relu(scores * jnp.float32(q.shape[-1] ** -0.5))
    return jnp.einsum("bqh,bqhk->bqk", w.astype(jnp.float32), scores)


def sparse_attention(q_latent: jax.Array, q_rope: jax.Array, index_q: jax.Array, index_w: jax.Array,
                     latent: jax.Array, k_rope: jax.Array, index_k: jax.Array, mask: AttentionMask, *,
                     topk: int, scale: float, loss: str = "off") -> tuple[jax.Array | None, jax.Array | None]:
    """DSA in MLA's absorbed form: ``(context [b, q, heads, kv_lora], indexer_kl [b, q] or None)``.

    Queries: ``q_latent [b, q, heads, kv_lora]`` (``q_nope`` through ``kv_b_proj``'s key half), ``q_rope [b, q,
    heads, rope]``, the indexer's ``index_q [b, q, index_heads, dim]`` and ``index_w [b, q, index_heads]``. Keys,
    one entry per token: ``latent [b, k, kv_lora]``, ``k_rope [b, k, rope]``, ``index_k [b, k, dim]``. ``mask``
    says which keys each query sees (causal, padding, segments; a decode step's cache slots). Each query attends
    to its ``topk`` visible keys with the highest indexer scores; the context is the attention-weighted sum of
    their latents (``kv_b_proj``'s value half and ``o_proj`` follow).

    ``loss``: ``"off"`` (no KL), ``"sparse"`` (context and the KL over the selected keys) or ``"dense"`` (no
    context, None; the KL over all visible keys against dense attention, for the indexer's warm-up).
    """
    context, kl, _ = _run(q_latent, q_rope, index_q, index_w, latent, k_rope, index_k, mask, topk=topk, scale=scale,
                          loss=loss, keep_chosen=False)
    return context, kl


def sparse_attention_choosing(q_latent: jax.Array, q_rope: jax.Array, index_q: jax.Array, index_w: jax.Array,
                              latent: jax.Array, k_rope: jax.Array, index_k: jax.Array, mask: AttentionMask, *,
                              topk: int, scale: float, loss: str = "off"
                              ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """``sparse_attention`` (``loss`` ``"off"`` or ``"sparse"``) that also returns each query's chosen keys:
    ``(context, kl, chosen [b, q, min(topk, keys)] int32)``, for later layers that reuse the choice
    (``sparse_attention_chosen``). Slots a query cannot see fill up its choice when fewer are visible; they stay
    masked wherever the choice is used."""
    if loss == "dense":
        raise ValueError("loss='dense' attends to every key: it chooses none to hand on")
    return _run(q_latent, q_rope, index_q, index_w, latent, k_rope, index_k, mask, topk=topk, scale=scale,
                loss=loss, keep_chosen=True)


def sparse_attention_chosen(q_latent: jax.Array, q_rope: jax.Array, chosen: jax.Array, latent: jax.Array,
                            k_rope: jax.Array, mask: AttentionMask, *, scale: float) -> jax.Array:
    """MLA's absorbed attention of each query over the keys ``chosen [b, q, topk]`` (an earlier layer's choice,
    ``sparse_attention_choosing``), the visible ones among them: ``context [b, q, heads, kv_lora]``. No indexer
    runs; the inputs are ``sparse_attention``'s."""
    q_spec = activation_spec(_Q_SIDE, q_latent.shape)
    chosen_spec = PartitionSpec(q_spec[0], q_spec[1], None)
    kernel = functools.partial(_local_chosen, scale=scale)
    return _per_query_shard(
        kernel, queries=[(q_latent, q_spec), (q_rope, q_spec), (chosen, chosen_spec)],
        keys=[(k, activation_spec(_K_SIDE, k.shape)) for k in (latent, k_rope)], mask=mask, out_specs=q_spec)


def _per_query_shard(kernel: Any, *, queries: list[tuple[jax.Array, PartitionSpec]],
                     keys: list[tuple[jax.Array, PartitionSpec]], mask: AttentionMask, out_specs: Any,
                     **kwargs: Any) -> Any:
    """``run_per_query_shard``, but inside an enclosing ``shard_map`` (a pipeline stage's, over ``stage``: the
    queries vary over its axes) the kernel runs once on the stage's arrays, partitioned by XLA over the other
    axes (``head_axes``, the psum over head shards, then empty: the heads are whole there), as the gated delta
    rule does: jax 0.10.2 gives a nested checked ``shard_map``'s residuals the outer axes too, which Shardy's
    verifier rejects in the backward."""
    if varying_axes(queries[0][0]):
        arrays = [a for a, _ in (*queries, *keys)]
        masks = (mask.kv_valid, mask.query_segment_ids(arrays[0].shape[1]), mask.segment_ids)
        whole = {**kwargs, "head_axes": ()} if "head_axes" in kwargs else kwargs
        return kernel(*arrays, jnp.asarray(mask.q_offset, jnp.int32), *masks, **whole)
    return run_per_query_shard(kernel, queries=queries, keys=keys, mask=mask, out_specs=out_specs, **kwargs)


def _run(q_latent, q_rope, index_q, index_w, latent, k_rope, index_k, mask, *, topk, scale, loss, keep_chosen):
    if loss not in ("off", "sparse", "dense"):
        raise ValueError(f"loss must be 'off', 'sparse' or 'dense', got {loss!r}")
    kernel = functools.partial(_local, topk=min(topk, latent.shape[1]), scale=scale, mode=loss, keep=keep_chosen)
    q_spec = activation_spec(_Q_SIDE, q_latent.shape)
    row_spec = PartitionSpec(q_spec[0], q_spec[1])  # [b, q]: the KL
    # The indexer's queries and head weights: every indexer head on every device (the top-k needs their sum).
    index_q_spec, index_w_spec = PartitionSpec(*row_spec, None, None), PartitionSpec(*row_spec, None)
    return _per_query_shard(
        kernel,
        queries=[(q_latent, q_spec), (q_rope, q_spec), (index_q, index_q_spec), (index_w, index_w_spec)],
        keys=[(k, activation_spec(_K_SIDE, k.shape)) for k in (latent, k_rope, index_k)],
        mask=mask,
        out_specs=(None if loss == "dense" else q_spec, None if loss == "off" else row_spec,
                   PartitionSpec(*row_spec, None) if keep_chosen else None),
        head_axes=axes_tuple(q_spec[2]),  # the KL sums attention over all heads: psum over the axes splitting them
    )


def _block_size(q_len: int, k_len: int, topk: int, heads: int, index_heads: int, width: int) -> int:
    """Query rows per block: the memory plan's rule (``sparse_block_rows``: its scratch stays under 64 MiB)."""
    return sparse_block_rows(q_len, k_len, topk, heads, index_heads, width, max_rows=_MAX_BLOCK)


def _over_blocks(block_fn, block, queries, q_offset, q_seg):
    """``block_fn((*query blocks, positions, q_seg block))`` mapped over blocks of ``block`` query rows (the last
    one padded), its outputs ``[b, q, ...]`` (None stays None) merged back."""
    b, q_len = queries[0].shape[:2]
    blocks = -(-q_len // block)
    pad = blocks * block - q_len

    def split(a):  # [b, q, ...] -> [blocks, b, block, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(a.shape[0], blocks, block, *a.shape[2:]), 1, 0)

    positions = (q_offset + jnp.arange(blocks * block, dtype=jnp.int32)).reshape(blocks, block)
    xs = (*(split(a) for a in queries), positions, None if q_seg is None else split(q_seg))
    outputs = jax.lax.map(block_fn, xs)

    def merge(a):  # [blocks, b, block, ...] -> [b, q, ...]
        if a is None:
            return None
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape(b, blocks * block, *a.shape[3:])[:, :q_len]

    return tuple(merge(a) for a in outputs)


def _local(q_latent, q_rope, index_q, index_w, latent, k_rope, index_k, q_offset, kv_valid, q_seg, kv_seg, *,
           topk, scale, mode, keep, head_axes):
    """``sparse_attention`` on one device's arrays: a map over query blocks, each recomputed in the backward."""
    q_len, heads, width = q_latent.shape[1:]
    block = _block_size(q_len, latent.shape[1], topk, heads, index_q.shape[2], width + k_rope.shape[-1])

    # Recomputed in the backward pass, but for the chosen keys (small integers): the indexer's scores over all keys
    # are not needed again (the sparse KL's gradient goes through the chosen keys' scores alone).
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names("dsa_chosen"))
    def one_block(x):
        qa, qr, iq, iw, q_pos, q_seg_block = x
        visible = _visible(q_pos, latent.shape[1], kv_valid, q_seg_block, kv_seg)
        context, kl, chosen = _attend_block(qa, qr, iq, iw, latent, k_rope, index_k, visible, topk=topk,
                                            scale=scale, mode=mode, head_axes=head_axes)
        return context, kl, chosen if keep else None

    context, kl, chosen = _over_blocks(one_block, block, (q_latent, q_rope, index_q, index_w), q_offset, q_seg)
    if chosen is not None and head_axes:  # the same on every head shard (the indexer is whole on each): one value
        chosen = jax.lax.pmax(chosen, head_axes)
    return context, kl, chosen


def _local_chosen(q_latent, q_rope, chosen, latent, k_rope, q_offset, kv_valid, q_seg, kv_seg, *, scale):
    """``sparse_attention_chosen`` on one device's arrays, in blocks of query rows recomputed in the backward."""
    q_len, heads, width = q_latent.shape[1:]
    block = _block_size(q_len, latent.shape[1], chosen.shape[-1], heads, 0, width + k_rope.shape[-1])

    @jax.checkpoint
    def one_block(x):
        qa, qr, rows, q_pos, q_seg_block = x
        visible = _visible(q_pos, latent.shape[1], kv_valid, q_seg_block, kv_seg)
        return (_attend_chosen(qa, qr, rows, latent, k_rope, visible, scale),)

    return _over_blocks(one_block, block, (q_latent, q_rope, chosen), q_offset, q_seg)[0]


def _visible(q_pos, k_len, kv_valid, q_seg, kv_seg):
    """``[b or 1, block, keys]`` bool: query at slot ``q_pos`` sees key ``j`` (causal, valid, same segment)."""
    visible = (jnp.arange(k_len)[None, :] <= q_pos[:, None])[None]
    if kv_valid is not None:
        visible = visible & kv_valid.astype(bool)[:, None, :]
    if q_seg is not None:
        visible = visible & (q_seg[:, :, None] == kv_seg[:, None, :])
    return visible


def _gather(table, rows):
    """Per batch row: ``table [b, keys, d]`` at ``rows [b, block, topk]`` -> ``[b, block, topk, d]``."""
    return jax.vmap(lambda t, r: t[r])(table, rows)


def _attend_chosen(qa, qr, chosen, latent, k_rope, visible, scale, index=None):
    """Attention of a block of queries over their ``chosen`` keys: ``(context, probs, seen)``'s context alone
    unless ``index`` (the block's indexer scores) asks for the rest."""
    chosen_latent = _gather(latent.astype(qa.dtype), chosen)  # [b, block, topk, kv_lora]
    chosen_rope = _gather(k_rope.astype(qr.dtype), chosen)
    seen = jnp.take_along_axis(jnp.broadcast_to(visible, chosen.shape[:2] + visible.shape[-1:]), chosen, axis=-1)
    scores = (jnp.einsum("bqhc,bqkc->bqhk", qa, chosen_latent)
              + jnp.einsum("bqhr,bqkr->bqhk", qr, chosen_rope))
    probs = _softmax(scores, seen[:, :, None, :], scale)
    context = jnp.einsum("bqhk,bqkc->bqhc", probs.astype(qa.dtype), chosen_latent)
    return context if index is None else (context, probs, seen)


def _attend_block(qa, qr, iq, iw, latent, k_rope, index_k, visible, *, topk, scale, mode, head_axes):
    """One block of queries: ``(context [b, block, heads, kv_lora] or None, kl [b, block] or None, chosen [b,
    block, topk] or None)``."""
    index = jnp.where(visible, index_scores(iq, iw, index_k), _MIN)  # [b, block, keys]
    if mode == "dense":  # warm-up: the KL over every visible key, against dense attention
        scores = (jnp.einsum("bqhc,bkc->bqhk", qa, latent.astype(qa.dtype))
                  + jnp.einsum("bqhr,bkr->bqhk", qr, k_rope.astype(qr.dtype)))
        probs = _softmax(scores, visible[:, :, None, :], scale)
        return None, indexer_kl(probs, index, jnp.broadcast_to(visible, index.shape), head_axes), None
    chosen = checkpoint_name(jax.lax.top_k(jax.lax.stop_gradient(index), topk)[1], "dsa_chosen")  # [b, block, k]
    context, probs, seen = _attend_chosen(qa, qr, chosen, latent, k_rope, visible, scale, index=index)
    kl = None
    if mode == "sparse":  # the chosen keys' scores again, from their gathered keys: the KL's gradient path
        chosen_index = index_scores(iq, iw, _gather(index_k, chosen))
        kl = indexer_kl(probs, jnp.where(seen, chosen_index, _MIN), seen, head_axes)
    return context, kl, chosen


def _softmax(scores, visible, scale):
    """Float32 softmax over the keys, hidden keys filled with the minimum (a row with none stays finite)."""
    scores = scores.astype(jnp.float32) * jnp.float32(scale)
    return jax.nn.softmax(jnp.where(visible, scores, _MIN), axis=-1)


def indexer_kl(probs, index, visible, head_axes=()):
    """Per query ``KL(p || softmax(index))`` over the visible keys ``[b, block]``: ``p`` is the attention
    distribution summed over heads (all devices' heads) and L1-normalized, detached."""
    p = jnp.sum(jax.lax.stop_gradient(probs), axis=2)
    if head_axes:
        p = jax.lax.psum(p, head_axes)
    p = jnp.where(visible, p, 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    log_q = jax.nn.log_softmax(jnp.where(visible, index, _MIN), axis=-1)
    kl = jnp.sum(xlogy(p, p) - jnp.where(visible, p * log_q, 0.0), axis=-1)
    # Every head shard holds the same KL (the indexer is not split over heads), but typed as varying over the
    # head axes: their mean makes it one value, and its gradient reaches each shard's indexer once in total.
    return jax.lax.pmean(kl, head_axes) if head_axes else kl


def mean_over_real_queries(kl: jax.Array, token_mask: jax.Array) -> jax.Array:
    """Per-query KL ``[b, q]`` -> each sequence's mean over its real queries ``[b]`` (0 for none)."""
    valid = jnp.broadcast_to(token_mask, kl.shape).astype(jnp.float32)
    return jnp.sum(kl * valid, axis=-1) / jnp.maximum(jnp.sum(valid, axis=-1), 1.0)


__all__ = ["LightningIndexer", "index_scores", "indexer_kl", "mean_over_real_queries", "sparse_attention",
           "sparse_attention_chosen", "sparse_attention_choosing"]
