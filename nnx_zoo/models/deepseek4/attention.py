"""DeepSeek-V4's attention: one shared K = V head over a sliding window, compressed entries, and per-head sinks.

Per token: the query ``q = rms(q_b(norm(q_a(x))))`` (``heads`` of ``head_dim``, normalized per head without a
scale), the shared key-value ``kv = norm(kv_proj(x))`` (one head, read as key and as value), both roped on their
trailing ``qk_rope_head_dim`` dims (pairs in place; the sliding-only layers' rope, or the compressed layers' own
base with YaRN). Query ``t`` attends, in one softmax with a learned logit per head (the sink, a column with no
value), to

- the raw ``kv`` of the ``sliding_window`` tokens ending at ``t`` (its own included), in its document;
- on a CSA layer, the ``index_topk`` compressed entries its indexer scores highest among the visible ones;
- on an HCA layer, every visible compressed entry (``nnx_zoo.models.deepseek4.compressor``).

Keys are values, so the output's rope part carries each key's rotation: the output is rotated back by ``t``'s
angle (``rotate_pairs(out, cos, -sin)``), leaving each key's contribution a function of the relative distance. The
heads then go through the grouped low-rank output projection: ``o_groups`` groups of consecutive heads, each
projected to ``o_lora_rank`` by its own block of ``o_a``, concatenated, then ``o_b`` to the model width.

The attention itself is ``kernel.attend`` (``attention_impl``: the reference ``xla`` builds the scores against
every token and entry; ``blockwise`` goes over blocks of queries, each against its window and its entries only).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.norm import RMSNorm, rms_normalize
from nnx_zoo.layers.rope import rotate_pairs
from nnx_zoo.layers.spec import weight_einsum
from nnx_zoo.models.deepseek4 import kernel
from nnx_zoo.models.deepseek4.compressor import Compressor, Indexer, Windows
from nnx_zoo.models.deepseek4.config import CSA, HCA, SLIDING, DeepSeekV4Config
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLQ = ("activation_batch", "activation_length", "activation_q_lora")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BLD = ("activation_batch", "activation_length", "activation_v4_kv")
_BLGR = ("activation_batch", "activation_length", "activation_heads", None)  # [b, s, groups, o_lora]


class Rope(NamedTuple):
    """A layer type's rope: ``cos``/``sin [b, s, rope / 2]`` at the tokens' positions, and the frequencies and
    cos/sin multiplier that place compressed entries."""

    cos: jax.Array
    sin: jax.Array
    inv_freq: jax.Array
    attention_factor: float


class Context(NamedTuple):
    """What every attention layer of one forward pass shares: the main and compressed ropes, the tokens' mask
    pieces, and the compressed layers' windows (None for a rate no layer uses)."""

    main: Rope
    compress: Rope
    token_mask: jax.Array  # [b or 1, s] bool: real tokens
    segment_ids: jax.Array | None  # [b, s] packed documents
    csa: Windows | None
    hca: Windows | None


class AttentionOutput(NamedTuple):
    """``output [b, s, embed]``; ``indexer_kl [b, s]`` (each query's indexer KL; None unless trained)."""

    output: jax.Array
    indexer_kl: jax.Array | None = None


class GroupedOutput(nnx.Module):
    """The grouped low-rank output projection: heads in ``groups`` blocks, each ``[heads / groups, head_dim] ->
    rank`` by its own ``o_a`` block, then ``o_b [groups, rank] -> embed``.

    ``o_a.kernel [groups, heads / groups, head_dim, rank]``, ``o_b.kernel [groups, rank, embed]``."""

    def __init__(self, heads: int, head_dim: int, groups: int, rank: int, features: int, *, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, kernel_init: nnx.initializers.Initializer, rngs: nnx.Rngs):
        self.groups, self.dtype = groups, dtype
        self.o_a = nnx.Param(kernel_init(rngs.params(), (groups, heads // groups, head_dim, rank), param_dtype),
                             out_sharding=("o_groups", None, "kv", "o_lora"), eager_sharding=False)
        self.o_b = Linear((groups, rank), features, kernel_names=("o_groups", "o_lora", "embed"), dtype=dtype,
                          param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)

    def __call__(self, out: jax.Array) -> jax.Array:
        b, s, heads, d = out.shape
        grouped = out.reshape(b, s, self.groups, heads // self.groups, d).astype(self.dtype)
        low = weight_einsum("bsgkd,gkdr->bsgr", grouped, self.o_a[...].astype(self.dtype), _BLGR,
                            weight_names=("o_groups", None, "kv", "o_lora"))
        return self.o_b(shard(low, _BLGR), _BLE)


class V4Attention(nnx.Module):
    """One DeepSeek-V4 attention layer of ``layer_type`` (sliding only, CSA or HCA): ``attn(x, ctx)``.

    >>> config = DeepSeekV4Config.preset("deepseek4-tiny")
    >>> attn = V4Attention(config, CSA, rngs=nnx.Rngs(0))
    """

    def __init__(self, config: DeepSeekV4Config, layer_type: str, *, rngs: nnx.Rngs):
        c = config
        self.config, self.layer_type = c, layer_type
        dtypes = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
        init = nnx.initializers.normal(c.initializer_range)
        kw = dict(kernel_init=init, rngs=rngs, **dtypes)
        heads, d = c.num_attention_heads, c.head_dim
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, kernel_names=("embed", "q_lora"), **kw)
        self.q_a_norm = RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps, **dtypes)
        self.q_b_proj = Linear(c.q_lora_rank, (heads, d), kernel_names=("q_lora", "heads", "kv"), **kw)
        self.kv_proj = Linear(c.hidden_size, d, kernel_names=("embed", "v4_kv"), **kw)
        self.kv_norm = RMSNorm(d, eps=c.rms_norm_eps, **dtypes)
        self.output = GroupedOutput(heads, d, c.o_groups, c.o_lora_rank, c.hidden_size, kernel_init=init, rngs=rngs,
                                    **dtypes)
        self.sinks = nnx.Param(jnp.zeros((heads,), jnp.float32), out_sharding=("heads",), eager_sharding=False)
        rate = c.compress_rate(layer_type)
        self.compressor = None if layer_type == SLIDING else Compressor(
            c.hidden_size, width=d, rate=rate, overlap=layer_type == CSA, eps=c.rms_norm_eps, names=("embed", "v4_kv"),
            **kw)
        self.indexer = Indexer(c, rngs=rngs) if layer_type == CSA else None
        self.scale = d ** -0.5

    def queries(self, x: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
        """``(q [b, s, heads, head_dim] roped, q_latent [b, s, q_lora])`` (the latent feeds the indexer)."""
        q_latent = self.q_a_norm(self.q_a_proj(x, _BLQ))
        q = rms_normalize(self.q_b_proj(q_latent, _BLHD), self.config.rms_norm_eps)
        return rotate_pairs(q, rope.cos, rope.sin), q_latent

    def keys(self, x: jax.Array, rope: Rope) -> jax.Array:
        """The shared key-value of each token ``[b, s, head_dim]``, roped (what a decoding cache keeps)."""
        return rotate_pairs(self.kv_norm(self.kv_proj(x, _BLD)), rope.cos, rope.sin)

    def __call__(self, x: jax.Array, ctx: Context) -> AttentionOutput:
        c = self.config
        in_sharding = sharding_of(x)
        rope = ctx.main if self.layer_type == SLIDING else ctx.compress
        q, q_latent = self.queries(x, rope)
        kv = self.keys(x, rope)
        compressed = None
        if self.compressor is not None:
            where = ctx.csa if self.layer_type == CSA else ctx.hca
            entries = self.compressor(x, where, rope.inv_freq, rope.attention_factor)
            indexer = None if self.indexer is None else self.indexer.inputs(
                x, q_latent, where, rope.cos, rope.sin, rope.inv_freq, rope.attention_factor)
            compressed = kernel.Compressed(entries, where.last, where.segment, indexer)
        loss = {"off": "off", "dense_warmup": "dense", "sparse": "sparse"}[c.indexer_training]
        out, kl = kernel.attend(q, kv, self.sinks[...], ctx.token_mask, ctx.segment_ids, compressed,
                                window=c.sliding_window, scale=self.scale, impl=c.attention_impl, loss=loss)
        return AttentionOutput(restore_sharding(self.output(shard(self.unrotate(out, rope), _BLHD)), in_sharding),
                               kl)

    @staticmethod
    def unrotate(out: jax.Array, rope: Rope) -> jax.Array:
        """The attention output's rope part rotated back by the query's angle (keys are values, so each carries its
        own rotation): what remains depends on the distance between query and key."""
        return rotate_pairs(out, rope.cos, -rope.sin)


__all__ = ["CSA", "HCA", "SLIDING", "AttentionOutput", "Context", "GroupedOutput", "Rope", "V4Attention"]
