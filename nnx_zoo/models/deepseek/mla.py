"""Multi-head Latent Attention (MLA), DeepSeek-V2/V3's attention.

Queries: ``x -> q_a (q_lora) -> RMSNorm -> q_b -> [heads, nope | rope]`` (or one ``q_proj`` when
``q_lora_rank`` is None). Keys and values: ``x -> kv_a -> [latent (kv_lora) | k_rope]``; the latent is
RMS-normed and expanded by ``kv_b`` into per-head ``[k_nope | v]``; ``k_rope`` is a single head shared by all
heads. Rope touches only the rope parts. Softmax scale ``qk_head_dim ** -0.5``, times YaRN's ``mscale ** 2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.attention import dot_product_attention
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import apply_rope, yarn_softmax_multiplier
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLQ = ("activation_batch", "activation_length", "activation_q_lora")
_BLKV = ("activation_batch", "activation_length", "activation_kv_lora")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BKHD = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")
_LATENT_NORM_EPS = 1e-6  # HF's q_a / kv_a norms use the RMSNorm default, not rms_norm_eps


class MLA(nnx.Module):
    """Multi-head Latent Attention. Call with ``x [batch, seq, embed]``, rope ``cos/sin [batch, seq, rope/2]``
    and a boolean ``mask [batch or 1, 1, seq, seq]``.

    >>> attn = MLA(DeepSeekV3Config.preset("deepseek3-mini"), rngs=nnx.Rngs(0))
    """

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs):
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

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array | None) -> jax.Array:
        c = self.config
        in_sharding = sharding_of(x)
        if c.q_lora_rank is None:
            q = self.q_proj(x, _BLHD)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x, _BLQ)), _BLHD)
        q_nope, q_rope = jnp.split(q, [c.qk_nope_head_dim], axis=-1)

        latent, k_rope = jnp.split(self.kv_a_proj(x, _BLKV), [c.kv_lora_rank], axis=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent), _BLHD)
        k_nope, v = jnp.split(kv, [c.qk_nope_head_dim], axis=-1)

        q_rope = apply_rope(q_rope, cos, sin, interleaved=c.rope_interleave)
        k_rope = apply_rope(k_rope[:, :, None, :], cos, sin, interleaved=c.rope_interleave)
        k_rope = shard(jnp.broadcast_to(k_rope, k_nope.shape[:-1] + k_rope.shape[-1:]), _BLHD)
        q = shard(jnp.concatenate([q_nope, q_rope], axis=-1), _BLHD)
        # Keys and values are gathered over the sequence (context parallelism keeps only queries split).
        k = shard(jnp.concatenate([k_nope, k_rope], axis=-1), _BKHD)
        v = shard(v, _BKHD)

        out = shard(dot_product_attention(q, k, v, mask, self.scale), _BLHD)
        return restore_sharding(self.o_proj(out, _BLE), in_sharding)
