"""Multi-head Latent Attention (MLA), DeepSeek-V2/V3's attention.

Queries: ``x -> q_a (q_lora) -> RMSNorm -> q_b -> [heads, nope | rope]`` (or one ``q_proj`` when
``q_lora_rank`` is None). Keys and values: ``x -> kv_a -> [latent (kv_lora) | k_rope]``; the latent is
RMS-normed and expanded by ``kv_b`` into per-head ``[k_nope | v]``; ``k_rope`` is a single head shared by all
heads. Rope touches only the rope parts. Softmax scale ``qk_head_dim ** -0.5``, times YaRN's ``mscale ** 2``.

Decoding (``MLA.decode``) caches only the normed latent and the roped ``k_rope`` per token and never expands
keys or values per head: ``kv_b``'s key half is absorbed into the queries and its value half applied after the
attention-weighted sum of latents.

With ``index_topk > 0`` (DeepSeek-V3.2) the layer has a lightning indexer, and each query attends only to the
``index_topk`` keys it scores highest (``nnx_zoo.models.deepseek.dsa``), in the same absorbed form. While the
sequence (or the cache) holds no more than ``index_topk`` keys every key is chosen, and the dense path runs. A
layer built with ``indexer=False`` under an indexed config (GLM-5's "shared" layers) attends to the keys an earlier
layer chose (``topk_indices``), and a layer with an indexer hands its choice on when the config has such layers.

``query_scale [batch, seq]`` (optional) multiplies each query (its nope and rope parts, after rope), as
transformers' Mistral 4 scales queries by position (``config.query_scale``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.attention import AttentionMask, attention, dense_mask
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import apply_rope, yarn_softmax_multiplier
from nnx_zoo.layers.spec import weight_einsum
from nnx_zoo.models.deepseek.cache import write as cache_write
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.models.deepseek.dsa import (
    LightningIndexer,
    sparse_attention,
    sparse_attention_choosing,
    sparse_attention_chosen,
)
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLQ = ("activation_batch", "activation_length", "activation_q_lora")
_BLKV = ("activation_batch", "activation_length", "activation_kv_lora")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BKHD = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")
_BLH_KV_LORA = ("activation_batch", "activation_length", "activation_heads", "activation_kv_lora")
_LATENT_NORM_EPS = 1e-6  # HF's q_a / kv_a norms use the RMSNorm default, not rms_norm_eps


class MLA(nnx.Module):
    """Multi-head Latent Attention. Call with ``x [batch, seq, embed]``, rope ``cos/sin [batch, seq, rope/2]``
    and a ``mask`` (``causal_mask``); ``decode`` runs new tokens against a cache. ``config.attention_impl``
    picks the kernel of the full forward (``nnx_zoo.layers.attention.attention``; query/key width 192, value 128
    in V3); ``decode`` keeps the absorbed einsum form (its scores are one row per new token: linear in the cache).

    >>> attn = MLA(DeepSeekV3Config.preset("deepseek3-mini"), rngs=nnx.Rngs(0))
    """

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs, indexer: bool | None = None):
        """``indexer``: whether the layer has a lightning indexer (default: whenever ``index_topk > 0``); False
        under ``index_topk > 0`` makes a layer that reuses an earlier layer's top-k."""
        c = config
        self.config = c
        heads = c.num_attention_heads
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype),
                  kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs)
        norm_kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, (heads, c.qk_head_dim), kernel_names=("embed", "heads", "kv"), **kw)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, kernel_names=("embed", "q_lora"),
                                   use_bias=c.attention_bias, **kw)
            self.q_a_norm = RMSNorm(c.q_lora_rank, eps=_LATENT_NORM_EPS, **norm_kw)
            self.q_b_proj = Linear(c.q_lora_rank, (heads, c.qk_head_dim), kernel_names=("q_lora", "heads", "kv"),
                                   **kw)
        self.kv_a_proj = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, kernel_names=("embed", "kv_lora"),
                                use_bias=c.attention_bias, **kw)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, eps=_LATENT_NORM_EPS, **norm_kw)
        self.kv_b_proj = Linear(c.kv_lora_rank, (heads, c.qk_nope_head_dim + c.v_head_dim),
                                kernel_names=("kv_lora", "heads", "kv"), **kw)
        self.o_proj = Linear((heads, c.v_head_dim), c.hidden_size, kernel_names=("heads", "kv", "embed"),
                             use_bias=c.attention_bias, **kw)
        self.scale = c.qk_head_dim**-0.5 * yarn_softmax_multiplier(c.rope_scaling)
        has_indexer = bool(c.index_topk) if indexer is None else indexer
        self.indexer = LightningIndexer(c, rngs=rngs) if has_indexer else None
        # Without its own indexer under an indexed config, the layer attends to an earlier layer's choice.
        self.reuses_topk = bool(c.index_topk) and not has_indexer

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 mask: AttentionMask | jax.Array | None) -> jax.Array:
        return self.attend(x, cos, sin, mask)[0]

    def attend(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | jax.Array | None, *,
               query_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """``(output [b, s, embed], indexer_kl [b, s] or None)``: the KL is each query's indexer loss, computed
        when ``config.indexer_training`` trains the indexer (``dense_warmup``: over all visible keys, attention
        dense; ``sparse``: over the selected keys)."""
        return self.attend_indexed(x, cos, sin, mask, query_scale=query_scale)[:2]

    def attend_indexed(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | jax.Array | None,
                       *, query_scale: jax.Array | None = None, topk_indices: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """``attend`` plus the top-k: ``(output, indexer_kl, topk_indices [b, s, index_topk] or None)``. While
        attention is sparse, a layer that reuses an earlier layer's top-k needs it (``topk_indices``) and returns
        it; one with an indexer returns its own choice when the config has layers reusing it
        (``config.shares_topk``); otherwise None."""
        c = self.config
        in_sharding = sharding_of(x)
        q_nope, q_rope, q_latent = self._queries(x, cos, sin, query_scale)
        latent, k_rope = self.compress(x, cos, sin)
        stage = c.indexer_training
        kl = chosen = None
        if c.sparse_attention_keys(x.shape[1]):
            if self.reuses_topk:
                context = self._reused(q_nope, q_rope, latent, k_rope, mask, topk_indices)
                chosen = topk_indices
            else:
                loss = "sparse" if stage == "sparse" else "off"
                context, kl, chosen = self._sparse(x, q_nope, q_rope, q_latent, latent, k_rope, cos, sin, mask, loss,
                                                   keep_chosen=c.shares_topk)
            out = self._values(context)
        else:
            out = self._dense(q_nope, q_rope, latent, k_rope, mask)
            if self.indexer is not None and stage != "off":  # every key is chosen: the KL over all of them
                _, kl, _ = self._sparse(x, q_nope, q_rope, q_latent, latent, k_rope, cos, sin, mask, "dense")
        return restore_sharding(self.o_proj(out, _BLE), in_sharding), kl, chosen

    def _dense(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
               mask: AttentionMask | jax.Array | None) -> jax.Array:
        """Attention over every visible key, keys and values expanded per head; ``[b, s, heads, v]``."""
        c = self.config
        kv = self.kv_b_proj(latent, _BLHD)
        k_nope, v = jnp.split(kv, [c.qk_nope_head_dim], axis=-1)

        k_rope = shard(jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:-1] + k_rope.shape[-1:]), _BLHD)
        q = shard(jnp.concatenate([q_nope, q_rope], axis=-1), _BLHD)
        # Keys and values are gathered over the sequence (context parallelism keeps only queries split).
        k = shard(jnp.concatenate([k_nope, k_rope], axis=-1), _BKHD)
        v = shard(v, _BKHD)
        return shard(attention(q, k, v, mask, self.scale, c.attention_impl), _BLHD)

    def _sparse(self, x: jax.Array, q_nope: jax.Array, q_rope: jax.Array, q_latent: jax.Array, latent: jax.Array,
                k_rope: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | jax.Array | None,
                loss: str, index_k: jax.Array | None = None, keep_chosen: bool = False
                ) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
        """DSA over the per-token entries ``latent``, ``k_rope`` (and the indexer's keys: ``index_k``, or those
        of ``x``): ``(context [b, s, heads, kv_lora], kl, chosen)`` (``dsa.sparse_attention``; ``loss`` its
        mode; ``keep_chosen``: the chosen keys ``[b, s, index_topk]``, else None)."""
        index_q, index_w = self.indexer.queries(x, q_latent, cos, sin)
        if index_k is None:
            index_k = self.indexer.keys(x, cos, sin)
        _check_mask(mask)
        absorbed = self._absorbed(q_nope)
        args = (absorbed, q_rope, index_q, index_w, latent, k_rope, index_k, mask)
        kw = dict(topk=self.config.index_topk, scale=self.scale, loss=loss)
        if keep_chosen:
            return sparse_attention_choosing(*args, **kw)
        return (*sparse_attention(*args, **kw), None)

    def _reused(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                mask: AttentionMask | jax.Array | None, topk_indices: jax.Array | None) -> jax.Array:
        """Attention over the keys an earlier layer chose (``topk_indices [b, s, topk]``): ``[b, s, heads,
        kv_lora]``."""
        if topk_indices is None:
            raise ValueError("this layer reuses an earlier layer's top-k keys (it has no indexer): pass that "
                             "layer's topk_indices")
        _check_mask(mask)
        return sparse_attention_chosen(self._absorbed(q_nope), q_rope, topk_indices, latent, k_rope, mask,
                                       scale=self.scale)

    def _absorbed(self, q_nope: jax.Array) -> jax.Array:
        """``q_nope`` taken through ``kv_b_proj``'s key half: ``[b, s, heads, kv_lora]``."""
        w_k = jnp.split(self._kv_b_kernel(), [self.config.qk_nope_head_dim], axis=-1)[0]
        return weight_einsum("bthn,chn->bthc", q_nope, w_k.astype(q_nope.dtype), _BLH_KV_LORA)

    def _values(self, context: jax.Array) -> jax.Array:
        """``kv_b_proj``'s value half on an attention-weighted sum of latents: ``[b, s, heads, v]``."""
        w_v = jnp.split(self._kv_b_kernel(), [self.config.qk_nope_head_dim], axis=-1)[1]
        return shard(weight_einsum("bthc,chv->bthv", context, w_v.astype(context.dtype), _BLHD), _BLHD)

    def _queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array, query_scale: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """``(q_nope [b, s, heads, nope], q_rope [b, s, heads, rope], q_latent [b, s, q_lora] or None)``, rope
        applied, both times ``query_scale [b, s]`` when given; ``q_latent`` is the normed query latent (None
        without query compression)."""
        c = self.config
        if c.q_lora_rank is None:
            q, q_latent = self.q_proj(x, _BLHD), None
        else:
            q_latent = self.q_a_norm(self.q_a_proj(x, _BLQ))
            q = self.q_b_proj(q_latent, _BLHD)
        q_nope, q_rope = jnp.split(q, [c.qk_nope_head_dim], axis=-1)
        q_rope = apply_rope(q_rope, cos, sin, interleaved=c.rope_interleave)
        if query_scale is not None:  # after rope, as transformers scales the roped queries
            scale = query_scale[:, :, None, None].astype(q.dtype)
            q_nope, q_rope = q_nope * scale, q_rope * scale
        return q_nope, q_rope, q_latent

    def compress(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What a decoding cache keeps per token: ``(kv_a_norm(latent) [b, s, kv_lora], k_rope [b, s, rope])``,
        the shared rope key with rope applied."""
        c = self.config
        latent, k_rope = jnp.split(self.kv_a_proj(x, _BLKV), [c.kv_lora_rank], axis=-1)
        k_rope = apply_rope(k_rope[:, :, None, :], cos, sin, interleaved=c.rope_interleave)[:, :, 0, :]
        return self.kv_a_norm(latent), k_rope

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, latent_cache: jax.Array, rope_cache: jax.Array,
               start: jax.Array, mask: AttentionMask | jax.Array, index_cache: jax.Array | None = None, *,
               query_scale: jax.Array | None = None, topk_indices: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
        """Attention for ``t`` new tokens ``x [b, t, embed]`` against a cache, in the absorbed form.

        The new tokens' ``compress`` output is written into ``latent_cache [b, max_len, kv_lora]`` and
        ``rope_cache [b, max_len, rope]`` at slots ``start .. start + t``; ``mask`` (``cache.advance``'s) says
        which slots each new token sees. Keys are never expanded per head: ``q_nope`` is taken through the key
        half of ``kv_b_proj`` (``q_nope . (W_k latent) = (W_k^T q_nope) . latent``), scores are taken against
        the cached latent, and the value half is applied after the attention-weighted sum of latents. With an
        indexer, ``index_cache [b, max_len, index_head_dim]`` keeps its keys beside them, and while the cache has
        more than ``index_topk`` slots each new token attends only to its top ``index_topk`` visible slots
        (``dsa.sparse_attention``); a layer reusing an earlier layer's top-k attends to ``topk_indices``
        (its ``index_cache`` slice is left as it is). Returns ``(out [b, t, embed], latent_cache, rope_cache,
        index_cache, topk_indices)`` (``index_cache`` None without an indexer; ``topk_indices`` as
        ``attend_indexed``'s, over the cache's slots).
        """
        c = self.config
        in_sharding = sharding_of(x)
        q_nope, q_rope, q_latent = self._queries(x, cos, sin, query_scale)
        latent, k_rope = self.compress(x, cos, sin)
        latent_cache = cache_write(latent_cache, latent, start)
        rope_cache = cache_write(rope_cache, k_rope, start)
        if self.indexer is not None:
            index_cache = cache_write(index_cache, self.indexer.keys(x, cos, sin).astype(index_cache.dtype), start)
        chosen = None
        if c.index_topk and c.index_topk < latent_cache.shape[1] and self.reuses_topk:
            context, chosen = self._reused(q_nope, q_rope, latent_cache, rope_cache, mask, topk_indices), topk_indices
        elif self.indexer is not None and c.index_topk < latent_cache.shape[1]:
            context, _, chosen = self._sparse(x, q_nope, q_rope, q_latent, latent_cache, rope_cache, cos, sin, mask,
                                              "off", index_k=index_cache, keep_chosen=c.shares_topk)
        else:
            q_latent = self._absorbed(q_nope)
            scores = (jnp.einsum("bthc,bsc->bhts", q_latent, latent_cache.astype(q_latent.dtype))
                      + jnp.einsum("bthr,bsr->bhts", q_rope, rope_cache.astype(q_rope.dtype)))
            visible = dense_mask(mask, scores.shape[2], scores.shape[3])  # [b, 1, t, max_len]
            scores = jnp.where(visible, scores * jnp.asarray(self.scale, scores.dtype), jnp.finfo(scores.dtype).min)
            probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q_latent.dtype)
            context = jnp.einsum("bhts,bsc->bthc", probs, latent_cache.astype(probs.dtype))
        out = self._values(context)
        return (restore_sharding(self.o_proj(out, _BLE), in_sharding), latent_cache, rope_cache, index_cache,
                chosen)

    def _kv_b_kernel(self) -> jax.Array:
        """``kv_b_proj``'s effective kernel ``[kv_lora, heads, nope + v]``. A plain ``Linear`` gives its kernel;
        any other linear module (one carrying adapters, say) is applied to the identity, so the absorbed form
        sees exactly the map the full forward applies."""
        if type(self.kv_b_proj) is Linear and self.kv_b_proj.bias is None:
            return self.kv_b_proj.kernel[...].astype(self.kv_b_proj.dtype)
        eye = jnp.eye(self.config.kv_lora_rank, dtype=jnp.dtype(self.config.dtype))
        return self.kv_b_proj(eye)


def _check_mask(mask: AttentionMask | jax.Array | None) -> None:
    if not isinstance(mask, AttentionMask):
        raise ValueError("DeepSeek-V3.2's sparse attention needs an AttentionMask (causal_mask), not a dense mask "
                         "array")
