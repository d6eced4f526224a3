"""KimiLinearConfig: Kimi Linear hyper-parameters (HF ``model_type`` ``kimi_linear``), named as transformers'
``KimiLinearConfig`` names them, plus presets.

The class defaults are Kimi-Linear-48B-A3B. Shared fields, validation and HF mapping live in
``nnx_zoo.models.moe_decoder_config``; what is this model's own, as transformers resolves it:

- The layer schedule: ``layer_types`` (``linear_attention`` / ``full_attention`` per layer). The hub files give it
  as ``linear_attn_config`` (``full_attn_layers`` / ``kda_layers``, numbered from 1, beside the linear layers'
  ``num_heads``, ``head_dim`` and ``short_conv_kernel_size``); with neither, every fourth layer from layer 4 (from
  0) is full, as transformers' default. A linear layer is Kimi Delta Attention (KDA: the gated delta rule with a
  decay per key channel, ``linear_num_heads`` heads of ``linear_head_dim``, after short convolutions of
  ``linear_conv_kernel_dim`` taps); a full layer is MLA (DeepSeek's latent attention) with no rope at all: its
  ``qk_rope_head_dim`` part is a shared key head like DeepSeek's, only never rotated.
- ``mlp_layer_types`` (``dense`` / ``sparse``; absent: the first ``first_k_dense_replace`` layers dense). MoE layers
  have ``num_experts`` routed experts of width ``moe_intermediate_size``, routed by sigmoid scores with a selection
  bias (group-limited to ``topk_group`` of ``num_expert_group`` groups), weights renormalised when
  ``moe_renormalize`` and always scaled by ``routed_scaling_factor``, plus ``num_shared_experts`` shared ones.
- transformers' aliases of the hub names (``num_local_experts``, ``n_group``, ``norm_topk_prob``,
  ``num_experts_per_token``, ``n_shared_experts``, ``model_max_length``) are read too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.layers.delta_rule import DEFAULT_CHUNK, delta_rule_problems
from nnx_zoo.models.decoder_config import LayerKind, ParameterCount, cpu_presets
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig
from nnx_zoo.models.qwen3_next.config import LAYER_TYPES

MLP_TYPES = ("dense", "sparse")
# transformers' attribute_map, reversed: the config.json names it also reads -> our fields.
_HF_ALIASES = {"model_max_length": "max_position_embeddings", "n_group": "num_expert_group",
               "norm_topk_prob": "moe_renormalize", "num_local_experts": "num_experts",
               "num_experts_per_token": "num_experts_per_tok", "n_shared_experts": "num_shared_experts"}

# Kimi-Linear-48B-A3B, the class defaults (published config.json values): 27 layers, full MLA at layers 4, 8, ...,
# 24 and 27 (numbered from 1), KDA elsewhere; layer 1 dense.
_FULL_48B = (4, 8, 12, 16, 20, 24, 27)
KIMI_LINEAR_48B_A3B: dict[str, Any] = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=27, num_attention_heads=32,
    num_key_value_heads=32, rms_norm_eps=1e-5, max_position_embeddings=1048576, bos_token_id=163584,
    eos_token_id=163586, num_experts_per_tok=8)
# The CPU presets: KDA and MLA alternating in the tiny one (so two layers hold both kinds), KDA x3, MLA, KDA, MLA
# in the small one (with query compression); layer 0 dense, 8 experts of
# width 64 / 128 (top-2 of 2 groups, one kept) and a shared one as wide, linear heads of width 32, an untied head.
_CPU = cpu_presets("kimi-linear", head_dim=16, num_experts=8, num_experts_per_tok=2, num_expert_group=2,
                   topk_group=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                   linear_head_dim=32, first_k_dense_replace=1, pad_token_id=None)
PRESETS: dict[str, dict[str, Any]] = {
    "kimi-linear-48b-a3b": dict(layer_types=tuple("full_attention" if i + 1 in _FULL_48B else "linear_attention"
                                                  for i in range(27))),
    "kimi-linear-tiny": {**_CPU["kimi-linear-tiny"], "tie_word_embeddings": False, "num_key_value_heads": 4,
                         "moe_intermediate_size": 64, "linear_num_heads": 4,
                         "layer_types": ("linear_attention", "full_attention") * 2},
    "kimi-linear-small": {**_CPU["kimi-linear-small"], "num_key_value_heads": 8, "moe_intermediate_size": 128,
                          "linear_num_heads": 8, "q_lora_rank": 64,
                          "layer_types": ("linear_attention",) * 3 + ("full_attention", "linear_attention",
                                                                       "full_attention")},
}


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(MoEDecoderConfig, model_type="kimi_linear", architecture="KimiLinearForCausalLM",
                       presets=PRESETS, defaults=KIMI_LINEAR_48B_A3B, hf_extras={"attention_dropout": 0.0},
                       experts=ExpertFields("num_experts", "moe_intermediate_size", "moe_renormalize")):
    """Kimi Linear hyper-parameters (transformers' ``KimiLinearConfig`` names) and nnx_zoo run options.

    >>> cfg = KimiLinearConfig.preset("kimi-linear-48b-a3b")
    >>> [k.attention for k in cfg.layer_kinds()[:4]]
    ['linear', 'linear', 'linear', 'full']
    >>> round(cfg.num_parameters().total / 1e9, 2), round(cfg.num_parameters().active / 1e9, 2)
    (49.12, 3.48)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"kimi_linear": dict(num_key_value_heads=32)}

    # head_dim is MLA's rope width in transformers' config (it sets it so); ours follows qk_rope_head_dim.
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = True
    # Fields transformers' config class does not have (left out of config.json).
    HF_OMITTED: ClassVar[frozenset[str]] = frozenset({"first_k_dense_replace", "partial_rotary_factor"})
    NNX_ONLY: ClassVar[frozenset[str]] = MoEDecoderConfig.NNX_ONLY | {"delta_rule_impl", "delta_rule_chunk_size"}

    num_experts: int = 256
    moe_intermediate_size: int = 1024
    moe_renormalize: bool = True
    num_shared_experts: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.446
    first_k_dense_replace: int = 1  # read when mlp_layer_types is None (transformers' kwarg of the same name)
    mlp_layer_types: tuple[str, ...] | None = None
    layer_types: tuple[str, ...] | None = None
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    pad_token_id: int | None = 163839  # transformers' default (an id of the published vocabulary)
    # ---- nnx_zoo only ----
    delta_rule_impl: str = "auto"  # the KDA layers' kernel: 'auto' | 'chunked' | 'recurrent' (gated_delta_rule)
    delta_rule_chunk_size: int = DEFAULT_CHUNK  # tokens per chunk of the chunked scan

    def __post_init__(self) -> None:
        for name in ("layer_types", "mlp_layer_types"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)  # as transformers sets it (unused: no rope)
        super().__post_init__()

    # ---- the layer schedule ----
    def attention_types(self) -> tuple[str, ...]:
        """Per layer: ``"linear"`` (KDA) or ``"full"`` (MLA)."""
        if self.layer_types is not None:
            return tuple(LAYER_TYPES[t] for t in self.layer_types[: self.num_hidden_layers])
        return tuple("full" if i and i % 4 == 0 else "linear" for i in range(self.num_hidden_layers))

    def is_moe_layer(self, index: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[index] == "sparse"
        return index >= self.first_k_dense_replace

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(LayerKind(a, self.is_moe_layer(i)) for i, a in enumerate(self.attention_types()))

    def attention_options(self, kind: Any) -> dict[str, Any]:
        """No local-attention options: MLA layers see the whole context, KDA ones are no attention at all."""
        return {}

    @property
    def router_kind(self) -> str:
        return "sigmoid_bias"

    @property
    def router_options(self) -> dict[str, Any]:
        return dict(n_group=self.num_expert_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor)

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_width(self) -> int:
        """A KDA layer's query (key, value) width: ``linear_num_heads * linear_head_dim``."""
        return self.linear_num_heads * self.linear_head_dim

    def mla_config(self) -> DeepSeekV3Config:
        """The ``DeepSeekV3Config`` that DeepSeek's ``MLA`` reads for this model's full layers: the same attention
        shape, no rope scaling, no indexer (its MoE fields are placeholders MLA never reads)."""
        return DeepSeekV3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size, num_hidden_layers=1, first_k_dense_replace=1,
            num_attention_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, n_routed_experts=0, n_group=None,
            topk_group=None, num_nextn_predict_layers=0, rope_scaling=None, rope_interleave=False,
            rms_norm_eps=self.rms_norm_eps, initializer_range=self.initializer_range, dtype=self.dtype,
            param_dtype=self.param_dtype, attention_impl=self.attention_impl)

    def linear_attention_shapes(self) -> dict[str, Any]:
        """A KDA layer's sizes for the memory plan (``nnx_zoo.sharding.plan_linear.LinearShapes``)."""
        h, d, width = self.linear_num_heads, self.linear_head_dim, self.linear_width
        return dict(key_heads=h, value_heads=h, key_dim=d, value_dim=d, conv_channels=3 * width,
                    chunk=self.delta_rule_chunk_size, per_channel_decay=True,
                    projections=5 * width + 2 * d + h)  # q, k, v; f_a, f_b; g_a, g_b; b

    def _problems(self) -> list[str]:
        p = super()._problems()
        if p:
            return p
        for name in ("linear_conv_kernel_dim", "linear_head_dim", "linear_num_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                p.append(f"{name} must be a positive integer, got {value!r}")
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_TYPES)):
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) < self.num_hidden_layers:
                p.append(f"{name} has {len(value)} entries for {self.num_hidden_layers} layers")
            bad = sorted(set(value) - set(allowed))
            if bad:
                p.append(f"{name} {bad} are not this model's; use {sorted(allowed)}")
        if self.attention_bias:
            p.append("attention_bias=True is not supported (the released checkpoints have no attention biases)")
        if self.tie_word_embeddings:
            p.append("tie_word_embeddings=True is not supported: transformers' Kimi Linear never ties its output head "
                     "to the embedding")
        if self.output_router_logits:
            p.append("output_router_logits=True: transformers computes no auxiliary loss for Kimi Linear; balance the "
                     "experts with the routing bias instead (the recipe's --routing-bias-rate)")
        if self.num_key_value_heads != self.num_attention_heads:
            p.append(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                     f"{self.num_attention_heads}: MLA expands keys and values for every head (transformers' eager "
                     "attention fails otherwise)")
        p += delta_rule_problems(self.delta_rule_chunk_size)
        if p or not self.num_moe_layers:
            return p
        experts, groups, kept = self.num_experts, self.num_expert_group, self.topk_group
        if not (isinstance(groups, int) and groups > 0 and experts % groups == 0 and experts // groups >= 2):
            p.append(f"num_expert_group={groups!r} must divide num_experts={experts} into groups of at least 2 "
                     "experts (a group scores as the sum of its best two)")
        elif not (isinstance(kept, int) and 0 < kept <= groups):
            p.append(f"topk_group must be in 1..num_expert_group={groups}, got {kept!r}")
        elif self.num_experts_per_tok > kept * experts // groups:
            p.append(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {kept * experts // groups} experts "
                     f"of the topk_group={kept} kept groups")
        return p

    # ---- Hugging Face config.json ----
    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> KimiLinearConfig:
        d = {**d, "output_router_logits": False}  # transformers only records router logits with it (no loss)
        for alias, name in _HF_ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        linear = d.get("linear_attn_config") or {}
        for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                          ("short_conv_kernel_size", "linear_conv_kernel_dim")):
            if key in linear:
                d[name] = linear[key]
        if d.get("layer_types") is None and "full_attn_layers" in linear and "kda_layers" in linear:
            types: list[str | None] = [None] * d["num_hidden_layers"]
            for i in linear["full_attn_layers"]:
                types[i - 1] = "full_attention"  # numbered from 1 in the hub files
            for i in linear["kda_layers"]:
                types[i - 1] = "linear_attention"
            d["layer_types"] = types
        d.pop("head_dim", None)  # transformers' head_dim is the rope width: ours follows qk_rope_head_dim
        return super()._from_hf_dict(d, overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        kinds = self.layer_kinds()
        d["layer_types"] = [{"linear": "linear_attention", "full": "full_attention"}[k.attention] for k in kinds]
        d["mlp_layer_types"] = ["sparse" if k.moe else "dense" for k in kinds]
        d["linear_attn_config"] = {
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k.attention == "full"],
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k.attention == "linear"],
            "num_heads": self.linear_num_heads, "head_dim": self.linear_head_dim,
            "short_conv_kernel_size": self.linear_conv_kernel_dim}
        d["n_group"] = d.pop("num_expert_group")  # transformers' name (the hub's num_expert_group is its alias)
        return {k: v for k, v in d.items() if k not in self.HF_OMITTED and not k.startswith("rope_")}  # no rope

    # ---- sizes and cost ----
    def _kda_params(self) -> int:
        h, heads, dk, width = self.hidden_size, self.linear_num_heads, self.linear_head_dim, self.linear_width
        projections = 3 * h * width + h * heads + 2 * (h * dk + dk * width)  # q, k, v; beta; f_a/f_b, g_a/g_b
        return projections + 3 * width * self.linear_conv_kernel_dim + width + heads + dk + width * h

    def _mla_params(self) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        q = h * heads * self.qk_head_dim if self.q_lora_rank is None else (
            h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim)
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank + \
            self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """Parameter counts (no MTP head: ``include_mtp`` is accepted and ignored). ``active`` counts the router,
        ``num_experts_per_tok`` routed experts and the shared experts of each MoE layer (the selection bias is a
        buffer, not a parameter, as in transformers)."""
        del include_mtp
        h, v = self.hidden_size, self.vocab_size
        total = active = v * h + (0 if self.tie_word_embeddings else v * h) + h
        experts, k, width = self.num_routed_experts, self.num_experts_per_tok, self.expert_intermediate_size
        for kind in self.layer_kinds():
            mixer = (self._kda_params() if kind.attention == "linear" else self._mla_params()) + 2 * h
            if kind.moe:
                shared = 3 * h * self.shared_expert_intermediate_size + h * experts  # + the router
                total += mixer + shared + 3 * experts * h * width
                active += mixer + shared + 3 * k * h * width
            else:
                total += mixer + 3 * h * self.intermediate_size
                active += mixer + 3 * h * self.intermediate_size
        return ParameterCount(total=total, active=active, embedding=v * h)

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """``6 * (active matmul parameters)`` plus, per MLA layer, causal attention over ``seq_len`` (query/key
        width ``qk_head_dim``, value width ``v_head_dim``), and per KDA layer the delta rule's state reads and
        writes: about ``3 * 2 * 2 * heads * d_k * d_v`` per token (forward and backward)."""
        counts = self.num_parameters(include_mtp=include_mtp)
        matmul = counts.active - (0 if self.tie_word_embeddings else counts.embedding)
        kinds = [k.attention for k in self.layer_kinds()]
        attention = 3 * seq_len * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)
        state = 12 * self.linear_num_heads * self.linear_head_dim ** 2
        return float(6 * matmul + attention * kinds.count("full") + state * kinds.count("linear"))
