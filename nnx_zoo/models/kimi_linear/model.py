"""Kimi Linear: Qwen3-Next's hybrid model (``nnx_zoo.models.qwen3_next``: layers in kinds ``LayerKind("linear" |
"full", moe)``, one stack per kind, ``HybridCache`` for decoding) with Kimi's parts: KDA token mixers in the linear
layers (``nnx_zoo.models.kimi_linear.mixers``), DeepSeek's MLA without rope in the full ones
(``nnx_zoo.models.deepseek.mla``: its rope part gets the identity rotation), plain RMSNorms, and MoE layers routed
by sigmoid scores with a selection bias plus an ungated shared expert (``SparseMoE(router="sigmoid_bias")``),
after a dense first layer.

Decoding keeps, per MLA stack, the normed latent and the shared (unrotated) key head per token in the cache's
``k`` / ``v`` (MLA's absorbed decoding reads them), and per KDA stack the three convolutions' tail and the delta
rule's state.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.attention_mask import AttentionMask
from nnx_zoo.layers.kv_cache import empty_slots
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.sparse_moe import SparseMoEOutput
from nnx_zoo.models.causal_lm import DecoderLayer, _dtypes
from nnx_zoo.models.decoder_config import FULL
from nnx_zoo.models.deepseek.cache import CACHE_NAMES as LATENT_CACHE_NAMES
from nnx_zoo.models.deepseek.mla import MLA
from nnx_zoo.models.kimi_linear import hf
from nnx_zoo.models.kimi_linear.config import KimiLinearConfig
from nnx_zoo.models.kimi_linear.mixers import KimiDeltaAttention
from nnx_zoo.models.moe_causal_lm import MoEDecoderLayer
from nnx_zoo.models.qwen3_next.model import _CONV_NAMES, _STATE_NAMES, HybridCache, Qwen3Next
from nnx_zoo.sharding import shard, use_rules

_BLE = ("activation_batch", "activation_length", "activation_embed")


class _KimiLayer:
    """The shared constructor and decode step of both layer classes: RMSNorms around the kind's token mixer
    (``attn``: KDA or MLA) and the MLP (``_make_mlp``: dense, or the sigmoid-routed MoE block)."""

    def __init__(self, config: KimiLinearConfig, *, kind: Any = FULL, rngs: nnx.Rngs):
        c = config
        init = nnx.initializers.normal(c.initializer_range)
        self.input_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        if kind.attention == "linear":
            self.attn = KimiDeltaAttention(c.hidden_size, heads=c.linear_num_heads, head_dim=c.linear_head_dim,
                                           conv_kernel=c.linear_conv_kernel_dim, norm_eps=c.rms_norm_eps,
                                           chunk_size=c.delta_rule_chunk_size, delta_rule_impl=c.delta_rule_impl,
                                           kernel_init=init, rngs=rngs, **_dtypes(c))
        else:
            self.attn = MLA(c.mla_config(), rngs=rngs)
        self.post_attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.mlp = self._make_mlp(c, init, rngs)  # type: ignore[attr-defined]

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, a: jax.Array, b: jax.Array, start: jax.Array,
               mask: AttentionMask) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``t`` new tokens against this layer's two cache arrays (MLA: latent, key head; KDA: conv tail, state):
        ``(output, a, b)``."""
        attn, a, b = self.attn.decode(self.input_norm(x), cos, sin, a, b, start, mask)[:3]  # type: ignore[attr-defined]
        h = shard(x + attn, _BLE)
        out = self.mlp(self.post_attn_norm(h))  # type: ignore[attr-defined]
        return shard(h + (out.output if isinstance(out, SparseMoEOutput) else out), _BLE), a, b


class KimiDenseLayer(_KimiLayer, DecoderLayer):
    """A layer with the dense SwiGLU (``intermediate_size``)."""


class KimiMoELayer(_KimiLayer, MoEDecoderLayer):
    """A layer with the sparse MoE block (sigmoid + selection bias, a shared expert)."""


class KimiLinear(Qwen3Next):
    """Kimi Linear causal language model (exact against HF ``KimiLinearForCausalLM``).

    >>> config = KimiLinearConfig.preset("kimi-linear-tiny")
    >>> model = KimiLinear.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or KimiLinear(config, rngs=)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                                  # [2, 16, vocab]
    >>> model = KimiLinear.from_pretrained("/path/to/Kimi-Linear-48B-A3B-Instruct", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                              # loadable by transformers
    """

    config_class: ClassVar[type[KimiLinearConfig]] = KimiLinearConfig  # type: ignore[assignment]
    key_table = staticmethod(hf.key_table)
    # KDA's and MLA's projections, the dense layer's SwiGLU (the experts are opt-in, as in the other MoE families).
    lora_targets: ClassVar[str] = (r"(^|/)attn/(q|k|v|o|kv_a|kv_b|q_a|q_b)_proj$|(^|/)mlp/(gate|up|down)$")

    def __init__(self, config: KimiLinearConfig, **kwargs: Any):
        super().__init__(config, **kwargs)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **_dtypes(config))  # w, not Qwen's 1 + w

    def layer_class(self, kind: Any) -> type[nnx.Module]:
        return KimiMoELayer if kind.moe else KimiDenseLayer

    def _layer_rope(self, kind: Any, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """No rope anywhere: MLA's rope part turns by the identity (cos 1, sin 0), KDA reads none."""
        del kind
        shape = (*positions.shape, self.config.qk_rope_head_dim // 2)
        return jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)

    # ---- generation ----
    def init_cache(self, batch: int, max_len: int) -> HybridCache:
        """An empty ``HybridCache`` for ``batch`` rows of up to ``max_len`` tokens: per MLA stack ``k`` the
        normed latent ``[layers, batch, max_len, kv_lora_rank]`` and ``v`` the shared key head ``[..,
        qk_rope_head_dim]``; per KDA stack ``conv [layers, batch, K - 1, heads, 3 d]`` and ``state [layers, batch,
        heads, d, d]`` (float32)."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        k, v, conv, state = {}, {}, {}, {}
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            for name, kind, indices in c.layer_stacks():
                n = len(indices)
                if kind.attention == "linear":
                    tail = (n, batch, c.linear_conv_kernel_dim - 1, c.linear_num_heads, 3 * c.linear_head_dim)
                    conv[name] = shard(jnp.zeros(tail, dtype), _CONV_NAMES)
                    state[name] = shard(jnp.zeros((n, batch, c.linear_num_heads, c.linear_head_dim,
                                                   c.linear_head_dim), jnp.float32), _STATE_NAMES)
                else:
                    k[name] = shard(jnp.zeros((n, batch, max_len, c.kv_lora_rank), dtype), LATENT_CACHE_NAMES)
                    v[name] = shard(jnp.zeros((n, batch, max_len, c.qk_rope_head_dim), dtype), LATENT_CACHE_NAMES)
            return HybridCache(k=k, v=v, conv=conv, state=state, **empty_slots(batch, max_len))
