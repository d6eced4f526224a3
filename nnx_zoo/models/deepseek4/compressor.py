"""DeepSeek-V4's compressed entries: windows of tokens pooled into one key each, and the lightning indexer.

A compressed layer pools each window of ``rate`` consecutive tokens of a document into one entry (an extra key
that is also its value): ``entry = norm(sum_i softmax_i(gate_i + ape_i) * kv_i)``, the softmax over the window's
slots per channel, with ``kv`` and ``gate`` projections of the layer input and a learned bias per slot (``ape``).
CSA (``overlap=True``) pools two series: an entry also reads the previous window's tokens through the first half
of the projections, so it spans ``2 * rate`` tokens with stride ``rate``. The entry is roped (pairs in place) at
its window's first position with the compressed layers' rope, and becomes visible to a query once its window is
complete: from the window's last token on.

Windows belong to documents: they start at each document's first real token (the left padding and the packed
documents before it do not count), so a left-padded or packed row computes what the same sequence alone does.
transformers' reference aligns windows to index 0 of the padded row instead and pools padding into them; the two
agree exactly on unpadded batches (the tests compare left-padded rows with transformers run on each row alone).
Real tokens of a document must sit at consecutive indices (left or right padding, packing: all do).

The indexer (CSA only) scores queries against its own, narrower entries (``index_head_dim``, same windows) with
``sum_h w_h * relu(q_h . k / sqrt(dim))`` (``nnx_zoo.models.deepseek.dsa.index_scores``, DeepSeek-V3.2's formula)
and each query keeps its ``index_topk`` best visible entries.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.linear import DEFAULT_INIT, Linear
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import rope_cos_sin, rotate_pairs
from nnx_zoo.models.deepseek4.kernel import IndexerInputs, whole_rows
from nnx_zoo.sharding import shard

_BL = ("activation_batch", "activation_length")
_BKC = ("activation_batch", "activation_kv_length", None)  # per-token projections, whole along the sequence
_ENTRIES = ("activation_batch", None, None)  # [b, entries, width]: keys, whole on every device


class Windows(NamedTuple):
    """Where a layer's compressed entries sit, per row (``n = seq // rate`` slots, the most a row can hold).

    ``last [b, n]`` int32: the index of each entry's last token (it becomes visible there), -1 for an empty slot.
    ``position [b, n]``: the rope position of each entry (its window's first token's). ``previous [b, n]`` bool:
    the window before it lies in the same document (CSA pools it too). ``segment [b, n]``: its document (None
    without packed documents).
    """

    last: jax.Array
    position: jax.Array
    previous: jax.Array
    segment: jax.Array | None

    @property
    def valid(self) -> jax.Array:
        return self.last >= 0


def windows(rate: int, token_mask: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> Windows:
    """The ``Windows`` of ``rate`` tokens for a batch: ``token_mask [b or 1, s]`` (True = real token),
    ``positions [b or 1, s]`` (rope positions), ``segment_ids [b, s]`` (packed documents) or None.

    A token's rank in its document counts the real tokens of the document before it; a window closes at each
    rank ``rate - 1, 2 rate - 1, ...``. The closing tokens are written, in order, into the row's ``seq // rate``
    slots (no document can close more).
    """
    batch = max(token_mask.shape[0], positions.shape[0], 1 if segment_ids is None else segment_ids.shape[0])
    seq = token_mask.shape[1]
    # Whole along the sequence (a window may straddle context-parallel shards), one row at a time (vmap: the
    # batch dim stays where the rules put it, with no collective).
    real = whole_rows(jnp.broadcast_to(token_mask, (batch, seq)).astype(jnp.int32))
    positions = whole_rows(jnp.broadcast_to(positions, (batch, seq)))
    segments = None if segment_ids is None else whole_rows(segment_ids)

    def row(real: jax.Array, positions: jax.Array, segments: jax.Array | None) -> Windows:
        count = jnp.cumsum(real)  # real tokens up to and including each index
        if segments is None:
            before = jnp.zeros_like(count)
        else:  # the count just before each document's first index, carried forward through the document
            starts = jnp.concatenate([jnp.ones((1,), bool), segments[1:] != segments[:-1]])
            before = jax.lax.cummax(jnp.where(starts, count - real, 0))
        rank = count - before - 1
        closes = (real > 0) & (rank % rate == rate - 1)
        slots = seq // rate
        slot = jnp.where(closes, jnp.cumsum(closes) - 1, slots)  # out of range: dropped
        last = jnp.full((slots,), -1, jnp.int32).at[slot].set(jnp.arange(seq, dtype=jnp.int32), mode="drop")
        safe = jnp.maximum(last, rate - 1)
        position = positions[safe - rate + 1]
        previous = (last >= 0) & (rank[safe] >= 2 * rate - 1)
        return Windows(last, position, previous, None if segments is None else segments[safe])

    return jax.vmap(row)(real, positions, segments)


class Compressor(nnx.Module):
    """Pools windows of ``rate`` tokens into entries of ``width`` (``overlap``: CSA's two series, each entry
    spanning its window and the one before). Parameters: ``kv_proj`` and ``gate_proj [embed, (1 + overlap) *
    width]``, ``ape [rate, (1 + overlap) * width]`` (float32), ``norm`` (RMSNorm of the entry).

    >>> comp = Compressor(64, width=32, rate=4, overlap=True, eps=1e-6, rngs=nnx.Rngs(0))
    """

    def __init__(self, features: int, *, width: int, rate: int, overlap: bool, eps: float, names: tuple[str, str],
                 dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype = jnp.float32,
                 kernel_init: nnx.initializers.Initializer = DEFAULT_INIT, rngs: nnx.Rngs):
        self.width, self.rate, self.overlap = width, rate, overlap
        out = (2 if overlap else 1) * width
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.kv_proj = Linear(features, out, kernel_names=names, **kw)
        self.gate_proj = Linear(features, out, kernel_names=names, **kw)
        self.ape = nnx.Param(jnp.zeros((rate, out), jnp.float32), out_sharding=(None, names[1]), eager_sharding=False)
        self.norm = RMSNorm(width, eps=eps, dtype=dtype, param_dtype=param_dtype)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(kv, gate)`` of each token ``[b, s, (1 + overlap) * width]`` (what a decoding cache keeps of the
        tokens of an incomplete window), whole along the sequence."""
        return shard(self.kv_proj(x, _BKC), _BKC), shard(self.gate_proj(x, _BKC), _BKC)

    def pool(self, kv: jax.Array, gate: jax.Array, prev_kv: jax.Array | None, prev_gate: jax.Array | None,
             previous: jax.Array | None, position: jax.Array, inv_freq: jax.Array, attention_factor: float
             ) -> jax.Array:
        """Entries ``[..., width]`` from windows of projections ``kv``/``gate [..., rate, (1 + overlap) * width]``
        (and with ``overlap`` the windows before them, ``prev_kv``/``prev_gate``, used where ``previous``),
        roped at ``position [...]`` (each window's first token's)."""
        width, ape = self.width, self.ape[...]
        gate = gate.astype(jnp.float32) + ape
        if self.overlap:  # slots [0, rate): the previous window's first series; [rate, 2 rate): this one's second
            prev_gate = jnp.where(previous[..., None, None], prev_gate.astype(jnp.float32)[..., :width]
                                  + ape[:, :width], -jnp.inf)
            kv = jnp.concatenate([prev_kv[..., :width], kv[..., width:]], axis=-2)
            gate = jnp.concatenate([prev_gate, gate[..., width:]], axis=-2)
        weights = jax.nn.softmax(gate, axis=-2).astype(kv.dtype)  # over the window's slots, per channel
        entries = self.norm(jnp.sum(kv * weights, axis=-2))
        cos, sin = rope_cos_sin(position, inv_freq, attention_factor)
        return rotate_pairs(entries, cos, sin)

    def __call__(self, x: jax.Array, where: Windows, inv_freq: jax.Array, attention_factor: float) -> jax.Array:
        """The entries ``[b, n, width]`` of ``x [b, s, embed]`` at ``where``, roped at their positions (``inv_freq``
        of the compressed layers' rope). Empty slots hold finite values that no query sees."""
        kv, gate = self.project(x)
        rate = self.rate
        batch = (x.shape[0], where.last.shape[1])  # windows of an unpadded batch are one row for all
        first = whole_rows(jnp.broadcast_to(jnp.maximum(where.last, rate - 1) - rate + 1, batch))
        previous, position = (whole_rows(jnp.broadcast_to(a, batch)) for a in (where.previous, where.position))
        slots = first[:, :, None] + jnp.arange(rate)  # [b, n, rate] token indices of each window

        def gather(a: jax.Array, index: jax.Array) -> jax.Array:  # [b, s, c] at [b, n, rate] -> [b, n, rate, c]
            return jax.vmap(lambda rows, at: rows[jnp.clip(at, 0)])(a, index)

        prev_kv = prev_gate = None
        if self.overlap:
            prev_kv, prev_gate = gather(kv, slots - rate), gather(gate, slots - rate)
        entries = self.pool(gather(kv, slots), gather(gate, slots), prev_kv, prev_gate, previous, position, inv_freq,
                            attention_factor)
        return shard(entries, _ENTRIES)


class Indexer(nnx.Module):
    """DeepSeek-V4's lightning indexer on a CSA layer: its own ``compressor`` (entries of ``index_head_dim``),
    queries ``q_b_proj`` from the attention's normed query latent, head weights ``weights_proj`` from the layer
    input; ``inputs`` hands them to the kernel, which scores and picks each query's top entries.

    >>> indexer = Indexer(DeepSeekV4Config.preset("deepseek4-tiny"), rngs=nnx.Rngs(0))
    """

    def __init__(self, config, *, rngs: nnx.Rngs):
        c = config
        dtypes = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
        init = nnx.initializers.normal(c.initializer_range)
        self.heads, self.topk = c.index_n_heads, c.index_topk
        self.compressor = Compressor(c.hidden_size, width=c.index_head_dim, rate=c.compress_rate_csa, overlap=True,
                                     eps=c.rms_norm_eps, names=("embed", "index_kv"), kernel_init=init, rngs=rngs,
                                     **dtypes)
        self.q_b_proj = Linear(c.q_lora_rank, (c.index_n_heads, c.index_head_dim),
                               kernel_names=("q_lora", "index_heads", "index_kv"), kernel_init=init, rngs=rngs,
                               **dtypes)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, kernel_names=("embed", "index_heads"),
                                   kernel_init=init, rngs=rngs, **dtypes)

    def inputs(self, x: jax.Array, q_latent: jax.Array, where: Windows | None, rope_cos: jax.Array,
               rope_sin: jax.Array, inv_freq: jax.Array, attention_factor: float, keys: jax.Array | None = None
               ) -> IndexerInputs:
        """What the kernel scores with: the queries (roped at the tokens' compressed-layer rope ``rope_cos`` /
        ``rope_sin``), their head weights, and this indexer's own entries at ``where`` (or ``keys``, a decoding
        cache's). Its inputs are detached: the indexer trains on its own loss only (its top-k is not
        differentiable, so the language-model loss never reaches it)."""
        x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
        q = rotate_pairs(self.q_b_proj(q_latent, _BL + (None, None)), rope_cos, rope_sin)
        w = self.weights_proj(x, _BL + (None,)).astype(jnp.float32) * self.heads ** -0.5
        if keys is None:
            keys = self.compressor(x, where, inv_freq, attention_factor)
        return IndexerInputs(q, w, keys, self.topk)
