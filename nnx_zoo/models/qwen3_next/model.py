"""Qwen3-Next: the dense core with sparse MoE MLPs (``nnx_zoo.models.moe_causal_lm``), its layers in kinds
``LayerKind("linear" | "full", moe)``, one stack per kind (``linear_layers`` and ``layers`` when every layer is
MoE), run in model order as one scan of four-layer steps (three linear layers and a full one).

What is this line's own: the token mixers (``nnx_zoo.models.qwen3_next.mixers``: the gated delta net of linear
layers, gated attention with partial rope in full ones), ``(1 + w)`` RMSNorms, and the MoE block's shared expert
gated per token (``SparseMoE(shared_gate=True)``). Decoding keeps ``HybridCache``: keys and values for full
layers, the convolution's tail and the delta rule's state for linear ones. Qwen3.5 (``nnx_zoo.models.qwen3_5``) is
this model with separate linear-layer projections.

Multi-token prediction (``config.mtp_num_hidden_layers``, the releases' ``mtp.*``): ``MTPBlock`` after the main
model, run by ``forward(..., with_mtp=True)`` only (training; decoding never runs it). It is DeepSeek-V3's scheme
(``nnx_zoo.models.deepseek.model.MTPHead``: the next token's normed embedding, then the normed final hidden state,
concatenated and projected) with this model's ``(1 + w)`` norms and its own full-attention decoder layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.hf import SafetensorsCheckpoint
from nnx_zoo.layers.attention import causal_mask, token_mask_of
from nnx_zoo.layers.attention_mask import AttentionMask
from nnx_zoo.layers.kv_cache import KV_CACHE_NAMES, advance_cache, empty_slots
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.pipeline import resolve_schedule, stage_count
from nnx_zoo.layers.scan import Segment, create_stack, run_stack
from nnx_zoo.models.causal_lm import CausalLMOutput, DecoderLayer, _dtypes, shifted_by_depth
from nnx_zoo.models.decoder_config import FULL
from nnx_zoo.models.deepseek.axes import MTP_EMBED, MTP_LAYERS
from nnx_zoo.models.moe_causal_lm import MoECausalLM, MoEDecoderLayer, _batch_split_layer
from nnx_zoo.models.qwen3_next import hf
from nnx_zoo.models.qwen3_next.config import Qwen3NextConfig
from nnx_zoo.models.qwen3_next.mixers import GatedAttention, GatedDeltaNet, centred_norm
from nnx_zoo.sharding import shard, use_rules
from nnx_zoo.sharding.rules import Rules

# [layers, batch, K - 1, hk, 2 dk + r dv]: per query/key head, as the convolution runs
_CONV_NAMES = ("activation_stack", "cache_batch", None, "cache_kv_heads", None)
_BLE = ("activation_batch", "activation_length", "activation_embed")
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


class MTPBlock(nnx.Module):
    """The multi-token-prediction depth (HF ``mtp.*``): ``norm(layers(fc([embed_norm(e) | hidden_norm(h)])))``,
    ``e`` the next token's embedding, ``h`` the main model's final (normed) hidden state; ``layers`` are
    ``mtp_num_hidden_layers`` full-attention decoder layers of the model's own kind, stacked on the MTP heads' axis
    (``mtp_layers``: whole on every pipeline stage). Its output goes through the model's head: at position ``i``
    it predicts token ``i + 2``.

    >>> config = Qwen3NextConfig.preset("qwen3-next-tiny", mtp_num_hidden_layers=1)
    >>> block = MTPBlock(config, rngs=nnx.Rngs(0))
    >>> block.fc.kernel.shape, block.layers.attn.q_proj.kernel.shape[0]
    ((256, 128), 1)
    """

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs):
        c = config
        h, dtypes = c.hidden_size, _dtypes(c)
        self.embed_norm = centred_norm(h, c.rms_norm_eps, **dtypes)
        self.hidden_norm = centred_norm(h, c.rms_norm_eps, **dtypes)
        self.fc = Linear(2 * h, h, kernel_names=(MTP_EMBED, "embed"),
                         kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs, **dtypes)
        kind = c.mtp_layer_kind()
        layer_class = HybridMoELayer if kind.moe else HybridDenseLayer
        # Stacked on the MTP heads' axis, never on 'stage': the depth runs after the pipeline, on every stage.
        self.layers = create_stack(lambda r: layer_class(c, kind=kind, rngs=r), c.mtp_num_hidden_layers, rngs,
                                   MTP_LAYERS)
        self.norm = centred_norm(h, c.rms_norm_eps, **dtypes)

    def __call__(self, token_embeddings: jax.Array, final_hidden: jax.Array, cos: jax.Array, sin: jax.Array,
                 mask: AttentionMask | None, *, config: Qwen3NextConfig) -> jax.Array:
        """The normed hidden state ``[batch, seq, embed]`` (the head's input); ``token_embeddings`` of the ids
        shifted left by one, ``mask`` the causal mask of their padding."""
        joined = jnp.concatenate([self.embed_norm(token_embeddings), self.hidden_norm(final_hidden)], axis=-1)
        token_mask = token_mask_of(mask, joined.shape[1])

        def body(layer: nnx.Module, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
            if not isinstance(layer, MoEDecoderLayer):
                return layer(h, cos, sin, mask), None
            if config.batch_split_factor > 1:  # as the main MoE layers split the batch
                factor = config.batch_split_factor
                return _batch_split_layer(layer, h, cos, sin, mask, token_mask, False, factor)[0], None
            return layer(h, cos, sin, mask, token_mask=token_mask)[0], None

        h, _ = run_stack(self.layers, body, shard(self.fc(joined, _BLE), _BLE), scan=config.scan_layers,
                         remat_policy=config.remat_policy)
        return self.norm(h)


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
    """Qwen3-Next causal language model (exact against HF ``Qwen3NextForCausalLM``), with the releases' MTP depth
    when ``config.mtp_num_hidden_layers`` (``forward(..., with_mtp=True)``; transformers has none).

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

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs, **kwargs: Any):
        super().__init__(config, rngs=rngs, **kwargs)
        self.norm = centred_norm(config.hidden_size, config.rms_norm_eps, **_dtypes(config))
        # (A family built on this model whose config has no MTP field, Kimi Linear, has none.)
        self.mtp = MTPBlock(config, rngs=rngs) if getattr(config, "mtp_num_hidden_layers", 0) else None

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                        dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> Any:
        """``CausalLM.from_pretrained``; the MTP depth is built as ``config.json`` says (``mtp_num_hidden_layers``)
        when the files hold ``mtp.*`` weights, and left out when they hold none (transformers' ``save_pretrained``
        drops them), as DeepSeek-V3 builds only the MTP heads its files hold. ``mtp_num_hidden_layers=0`` skips
        the files' MTP weights; ``mtp_num_hidden_layers=1`` for files without them is a ``CheckpointMismatchError``
        naming the missing keys."""
        has_field = "mtp_num_hidden_layers" in cls.config_class.__dataclass_fields__
        if has_field and "mtp_num_hidden_layers" not in config_overrides:
            with SafetensorsCheckpoint(Path(path)) as ckpt:
                if not any(key.startswith("mtp.") for key in ckpt.entries):
                    config_overrides = {**config_overrides, "mtp_num_hidden_layers": 0}
        return super().from_pretrained(path, mesh=mesh, rules=rules, dtype=dtype, allow_partial=allow_partial,
                                       **config_overrides)

    def forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None,
                with_hidden_states: bool = False, with_mtp: bool = False, with_expert_load: bool = False,
                with_routing: bool = False, with_logits: bool = True, pipeline_microbatches: int = 1,
                pipeline_schedule: str = "gpipe", pipeline_virtual_stages: int | None = None,
                loss_targets: tuple[jax.Array, jax.Array] | None = None) -> CausalLMOutput:
        """``MoECausalLM.forward``, and with ``with_mtp`` the MTP depth's ``mtp_hidden`` / ``mtp_logits`` ``[1,
        batch, seq, ...]`` (position ``i`` predicts token ``i + 2``). The MTP layers read the ids shifted left by
        one (padded with 0; position ``i`` is padding when token ``i`` or ``i + 1`` is) at the main tokens' rope
        positions (vLLM's; a shift
        of every position leaves attention unchanged), attend within the documents of ``segment_ids``, and add
        nothing to ``aux_loss``, ``expert_load`` or ``expert_indices`` (the main layers' only).

        Pipelined (a ``stage`` mesh axis): the MTP depth runs after the GPipe pipeline, whole on every stage (its
        weights) and on each stage's share of the batch (``outside_pipeline``), as DeepSeek-V3's MTP heads do;
        with the schedules that run the loss inside the pipeline (1F1B, interleaved) it is not supported yet (a
        clear error)."""
        pipeline = dict(pipeline_microbatches=pipeline_microbatches, pipeline_schedule=pipeline_schedule,
                        pipeline_virtual_stages=pipeline_virtual_stages, loss_targets=loss_targets)
        kwargs = dict(segment_ids=segment_ids, position_ids=position_ids, with_hidden_states=with_hidden_states,
                      with_expert_load=with_expert_load, with_routing=with_routing, **pipeline)
        if not with_mtp:
            return super().forward(input_ids, attention_mask, with_logits=with_logits, **kwargs)
        if self.mtp is None:
            raise ValueError(f"with_mtp=True but this {type(self).__name__} has no MTP heads (multi-token "
                             "prediction; mtp_num_hidden_layers=0 where its config has the field); build it with "
                             "mtp_num_hidden_layers=1, as the Qwen3-Next / Qwen3.5 releases have")
        with self._parameter_mesh():
            pipelined = stage_count() > 1
        if pipelined and resolve_schedule(pipeline_schedule, pipeline_virtual_stages).loss_inside:
            raise ValueError(f"pipeline_schedule={pipeline_schedule!r} with the MTP depth (with_mtp=True) is not "
                             f"supported yet for {type(self).__name__}: those schedules run the loss inside the "
                             "pipeline, and the MTP depth does not run there. Use pipeline_schedule='gpipe' "
                             "(--pipeline-schedule gpipe), or train without MTP (--mtp-weight 0)")
        out = super().forward(input_ids, attention_mask, with_logits=False, **kwargs)
        with use_rules(self.rules, allow_partial=self.allow_partial), self._parameter_mesh():
            # Pipelined: after the pipeline, the batch split over 'stage' as the head's (each stage its share).
            rules = self._outside_pipeline_rules(input_ids.shape[0]) if pipelined else self.rules
        with use_rules(rules, allow_partial=self.allow_partial), self._parameter_mesh():
            c, seq_len = self.config, input_ids.shape[1]
            ids, masks = shifted_by_depth(input_ids, attention_mask, 1)
            positions = jnp.arange(seq_len)[None, :] if position_ids is None else position_ids
            # A position is real for the MTP when both its inputs are: its own token (the hidden state) and the next.
            mask = causal_mask(seq_len, None if masks is None else masks[0] * masks[1], segment_ids)
            hidden = self.mtp(self.embed(ids[1]), out.final_hidden, *self._layer_rope(c.mtp_layer_kind(), positions),
                              mask, config=c)[None]
            logits = mtp_logits = None
            if with_logits:  # the main and MTP hidden states share one head matmul (one weight gradient)
                both = self._logits(jnp.concatenate([out.final_hidden[None], hidden]))
                logits, mtp_logits = both[0], both[1:]
        return out._replace(logits=logits, mtp_logits=mtp_logits, mtp_hidden=hidden)

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
