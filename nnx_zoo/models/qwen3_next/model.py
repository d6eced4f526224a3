"""Qwen3-Next: the dense core with sparse MoE MLPs (``nnx_zoo.models.moe_causal_lm``), its layers in kinds
``LayerKind("linear" | "full", moe)``, one stack per kind (``linear_layers`` and ``layers`` when every layer is
MoE), run in model order as one scan of four-layer steps (three linear layers and a full one).

What is this line's own: the token mixers (``nnx_zoo.models.qwen3_next.mixers``: the gated delta net of linear
layers, gated attention with partial rope in full ones), ``(1 + w)`` RMSNorms, and the MoE block's shared expert
gated per token (``SparseMoE(shared_gate=True)``). Decoding keeps ``HybridCache``: keys and values for full
layers, the convolution's tail and the delta rule's state for linear ones. Qwen3.5 (``nnx_zoo.models.qwen3_5``) is
this model with separate linear-layer projections.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.attention_mask import AttentionMask
from nnx_zoo.layers.kv_cache import KV_CACHE_NAMES, advance_cache, empty_slots
from nnx_zoo.layers.scan import Segment, run_stack
from nnx_zoo.models.causal_lm import DecoderLayer, _dtypes
from nnx_zoo.models.decoder_config import FULL
from nnx_zoo.models.moe_causal_lm import MoECausalLM, MoEDecoderLayer
from nnx_zoo.models.qwen3_next import hf
from nnx_zoo.models.qwen3_next.config import Qwen3NextConfig
from nnx_zoo.models.qwen3_next.mixers import GatedAttention, GatedDeltaNet, centred_norm
from nnx_zoo.sharding import shard, use_rules

# [layers, batch, K - 1, hk, 2 dk + r dv]: per query/key head, as the convolution runs
_CONV_NAMES = ("activation_stack", "cache_batch", None, "cache_kv_heads", None)
_STATE_NAMES = ("activation_stack", "cache_batch", "cache_kv_heads", None, None)  # [layers, batch, hv, dk, dv]


class _HybridLayer:
    """The shared constructor of both layer classes: ``(1 + w)`` norms around the kind's token mixer (``attn``)
    and the MLP (``_make_mlp``: dense, or the gated-shared-expert MoE block)."""

    def __init__(self, config: Qwen3NextConfig, *, kind: Any = FULL, rngs: nnx.Rngs):
        c = config
        init = nnx.initializers.normal(c.initializer_range)
        self.input_norm = centred_norm(c.hidden_size, c.rms_norm_eps, **_dtypes(c))
        if kind.attention == "linear":
            self.attn = GatedDeltaNet(
                c.hidden_size, key_heads=c.linear_num_key_heads, value_heads=c.linear_num_value_heads,
                key_dim=c.linear_key_head_dim, value_dim=c.linear_value_head_dim,
                conv_kernel=c.linear_conv_kernel_dim, packed=c.PACKED_PROJECTIONS, norm_eps=c.rms_norm_eps,
                chunk_size=c.delta_rule_chunk_size, delta_rule_impl=c.delta_rule_impl, kernel_init=init,
                rngs=rngs, **_dtypes(c))
        else:
            self.attn = GatedAttention(
                c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                head_dim=c.head_dim, norm_eps=c.rms_norm_eps, attention_impl=c.attention_impl, kernel_init=init,
                rngs=rngs, **_dtypes(c))
        self.post_attn_norm = centred_norm(c.hidden_size, c.rms_norm_eps, **_dtypes(c))
        self.mlp = self._make_mlp(c, init, rngs)  # type: ignore[attr-defined]


class HybridDenseLayer(_HybridLayer, DecoderLayer):
    """A layer with the dense SwiGLU (``intermediate_size``)."""


class HybridMoELayer(_HybridLayer, MoEDecoderLayer):
    """A layer with the sparse MoE block (softmax top-k, a sigmoid-gated shared expert)."""


class HybridCache(NamedTuple):
    """The decoding cache of a model with full and linear layers: per full stack ``k``, ``v [layers, batch,
    max_len, kv_heads, head_dim]``; per linear stack ``conv [layers, batch, K - 1, hk, C / hk]`` (the
    convolution's last inputs, per query/key head) and ``state [layers, batch, hv, dk, dv]`` (float32, the delta
    rule's state); the slot bookkeeping (``valid``, ``next_position``, ``length``) is ``KVCache``'s. A linear
    layer's memory does not grow with the context.

    >>> cache = model.init_cache(batch=2, max_len=64)
    >>> cache.conv["linear_layers"].shape, cache.state["linear_layers"].shape
    """

    k: dict[str, jax.Array]
    v: dict[str, jax.Array]
    conv: dict[str, jax.Array]
    state: dict[str, jax.Array]
    valid: jax.Array
    next_position: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def advance(self, token_mask: jax.Array) -> tuple[jax.Array, AttentionMask, HybridCache]:
        """As ``KVCache.advance``: ``(positions, mask over the max_len slots, cache)``."""
        return advance_cache(self, token_mask)


class Qwen3Next(MoECausalLM):
    """Qwen3-Next causal language model (exact against HF ``Qwen3NextForCausalLM``; no MTP head).

    >>> config = Qwen3NextConfig.preset("qwen3-next-tiny")
    >>> model = Qwen3Next.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or Qwen3Next(config, rngs=)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                                # [2, 16, vocab]
    >>> model = Qwen3Next.from_pretrained("/path/to/Qwen3-Next-80B-A3B-Instruct", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                            # loadable by transformers
    """

    config_class: ClassVar[type[Qwen3NextConfig]] = Qwen3NextConfig
    key_table = staticmethod(hf.key_table)
    # Full layers' q/k/v/o, linear layers' input and output projections, the dense layers' SwiGLU (the experts
    # are opt-in, as in the other MoE families).
    lora_targets: ClassVar[str] = (r"(^|/)attn/(q|k|v|o)_proj$|(^|/)attn/(in_proj_\w+|out_proj)$"
                                   r"|(^|/)mlp/(gate|up|down)$")

    def __init__(self, config: Qwen3NextConfig, **kwargs: Any):
        super().__init__(config, **kwargs)
        self.norm = centred_norm(config.hidden_size, config.rms_norm_eps, **_dtypes(config))

    def layer_class(self, kind: Any) -> type[nnx.Module]:
        return HybridMoELayer if kind.moe else HybridDenseLayer

    # ---- generation ----
    def init_cache(self, batch: int, max_len: int) -> HybridCache:
        """An empty ``HybridCache`` for ``batch`` rows of up to ``max_len`` tokens."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        k, v, conv, state = {}, {}, {}, {}
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            for name, kind, indices in c.layer_stacks():
                n = len(indices)
                if kind.attention == "linear":
                    hk = c.linear_num_key_heads
                    tail = (n, batch, c.linear_conv_kernel_dim - 1, hk, c.linear_conv_dim // hk)
                    conv[name] = shard(jnp.zeros(tail, dtype), _CONV_NAMES)
                    state[name] = shard(jnp.zeros((n, batch, c.linear_num_value_heads, c.linear_key_head_dim,
                                                   c.linear_value_head_dim), jnp.float32), _STATE_NAMES)
                else:
                    shape = (n, batch, max_len, c.num_key_value_heads, c.head_dim)
                    k[name] = shard(jnp.zeros(shape, dtype), KV_CACHE_NAMES)
                    v[name] = shard(jnp.zeros(shape, dtype), KV_CACHE_NAMES)
            return HybridCache(k=k, v=v, conv=conv, state=state, **empty_slots(batch, max_len))

    def _extend(self, input_ids: jax.Array, token_mask: jax.Array, cache: HybridCache
                ) -> tuple[jax.Array, HybridCache]:
        """``t`` new tokens through every layer: full layers attend to the cache and write their keys and values,
        linear layers continue their convolution tail and delta-rule state."""
        start = cache.length
        positions, mask, cache = cache.advance(token_mask)
        kinds = self._kinds_by_stack()
        ropes = {name: self._layer_rope(kind, positions) for name, kind in kinds.items()}
        # Per stack the two arrays its layers carry: keys and values, or the conv tail and the state.
        pairs = {name: (cache.conv[name], cache.state[name]) if kind.attention == "linear"
                 else (cache.k[name], cache.v[name]) for name, kind in kinds.items()}

        def segment_body(segment: Segment) -> Any:
            def body(group: nnx.List, carry: Any, repeat: jax.Array) -> tuple[Any, None]:
                h, pairs = carry
                for name, layer, first in zip(segment.pattern, group, segment.starts):
                    index = first + repeat
                    a, b = (jax.lax.dynamic_index_in_dim(x, index, keepdims=False) for x in pairs[name])
                    h, a, b = layer.decode(h, *ropes[name], a, b, start, mask)
                    pairs = {**pairs, name: tuple(jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), index, 0)
                                                  for x, y in zip(pairs[name], (a, b)))}
                return (h, pairs), None
            return body

        carry = (self.embed(input_ids), pairs)
        for segment in self.layer_segments():
            carry, _ = run_stack(segment.group, segment_body(segment), carry, jnp.arange(segment.repeats),
                                 scan=self.config.scan_layers)
        h, pairs = carry
        logits = shard(self._logits(self.norm(h)), ("activation_batch", "activation_length", None))
        linear = {name for name, kind in kinds.items() if kind.attention == "linear"}
        return logits, cache._replace(
            k={n: p[0] for n, p in pairs.items() if n not in linear}, v={n: p[1] for n, p in pairs.items()
                                                                         if n not in linear},
            conv={n: pairs[n][0] for n in linear}, state={n: pairs[n][1] for n in linear})
