"""Qwen3NextConfig: Qwen3-Next hyper-parameters (HF ``model_type`` ``qwen3_next``), named as in ``config.json``,
plus presets; the base of the Qwen3.5 configs (``nnx_zoo.models.qwen3_5``).

The class defaults are Qwen3-Next-80B-A3B. Shared fields, validation and HF mapping live in
``nnx_zoo.models.moe_decoder_config``; what is this line's own, as transformers' ``Qwen3NextConfig`` resolves it:

- The layer schedule: ``layer_types`` (``linear_attention`` / ``full_attention`` per layer; None: every
  ``full_attention_interval``-th layer full, the rest linear). A linear layer is a gated delta rule
  (``linear_num_key_heads`` query/key heads of ``linear_key_head_dim``, ``linear_num_value_heads`` value heads of
  ``linear_value_head_dim``) after a causal convolution of ``linear_conv_kernel_dim`` taps; a full layer is
  attention with a sigmoid output gate, per-head q/k norms and rope on the first ``partial_rotary_factor`` of each
  head (0.25 when the file says nothing, transformers' default).
- Every RMSNorm but the delta rule's output norm scales by ``1 + w`` (weights stored centred on 0).
- MoE layers as Qwen3-MoE's (``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob``,
  ``decoder_sparse_step``, ``mlp_only_layers``) plus a shared expert of width ``shared_expert_intermediate_size``
  whose output a per-token sigmoid gate scales.
- Multi-token prediction (``mtp_num_hidden_layers``, 1 in the releases; 0, the default: none): one MTP depth whose
  ``mtp_num_hidden_layers`` full-attention layers (MoE as ``is_moe_layer(j)`` of their index ``j``, as vLLM builds
  them) read ``fc([norm(embedding of the next token) | norm(final hidden state)])`` and predict the token two
  ahead through the shared head (``nnx_zoo.models.qwen3_next.model.MTPBlock``). transformers has no MTP (it skips
  the ``mtp.*`` weights); the parameter counts leave it out unless ``include_mtp``, as the published counts do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.layers.delta_rule import DEFAULT_CHUNK, delta_rule_problems
from nnx_zoo.models.decoder_config import LayerKind, ParameterCount, cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig

LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}

# Qwen3-Next-80B-A3B, the class defaults (published config.json values).
QWEN3_NEXT_80B_A3B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000000.0, partial_rotary_factor=0.25,
    max_position_embeddings=262144, bos_token_id=151643, eos_token_id=151645, num_experts_per_tok=10,
    router_aux_loss_coef=0.001)
# The CPU presets: the dense ones with linear and full layers alternating (so two layers hold both kinds), linear
# heads of width 32 (2 query/key heads, 4 value heads), 8 experts of width 64 / 128, top-2, a shared expert as wide.
_CPU = cpu_presets("qwen3-next", head_dim=64, rope_theta=1e6, partial_rotary_factor=0.25, full_attention_interval=2,
                   num_experts=8,
                   num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": {"mtp_num_hidden_layers": 1},  # the release's one MTP layer
    "qwen3-next-tiny": {**_CPU["qwen3-next-tiny"], "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},
    "qwen3-next-small": {**_CPU["qwen3-next-small"], "moe_intermediate_size": 128,
                         "shared_expert_intermediate_size": 128},
}


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(MoEDecoderConfig, model_type="qwen3_next", architecture="Qwen3NextForCausalLM", qk_norm=True,
                      presets=PRESETS, defaults=QWEN3_NEXT_80B_A3B, hf_extras={"attention_dropout": 0.0},
                      experts=ExpertFields("num_experts", "moe_intermediate_size", "norm_topk_prob")):
    """Qwen3-Next hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Qwen3NextConfig.preset("qwen3-next-80b-a3b")
    >>> [k.attention for k in cfg.layer_kinds()[:4]]
    ['linear', 'linear', 'linear', 'full']
    >>> round(cfg.num_parameters().total / 1e9, 1), round(cfg.num_parameters().active / 1e9, 1)
    (79.7, 3.9)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen3_next": dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=32768, rope_theta=10000.0,
            norm_topk_prob=True),
    }

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 2  # transformers' Qwen3NextConfig default
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = 256  # its default
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False
    PARTIAL_ROTARY: ClassVar[bool] = True
    ATTENTION_OUTPUT_GATE: ClassVar[bool] = True  # full layers gate their output by a sigmoid (read by the plan)
    # Whether the linear layers' input projections are packed per query/key head (Qwen3-Next's in_proj_qkvz and
    # in_proj_ba) or separate (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
    PACKED_PROJECTIONS: ClassVar[bool] = True
    # Fields transformers' config class for this model_type does not have (left out of config.json).
    HF_OMITTED: ClassVar[frozenset[str]] = frozenset({"full_attention_interval"})
    NNX_ONLY: ClassVar[frozenset[str]] = MoEDecoderConfig.NNX_ONLY | {"delta_rule_impl", "delta_rule_chunk_size"}

    num_experts: int = 512
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512  # type: ignore[assignment]
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] | None = ()
    layer_types: tuple[str, ...] | None = None
    full_attention_interval: int = 4  # read when layer_types is None (transformers' kwarg of the same name)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mtp_num_hidden_layers: int = 0  # decoder layers of the multi-token-prediction depth (HF mtp.layers.*); 0: no MTP
    # ---- nnx_zoo only ----
    delta_rule_impl: str = "auto"  # the linear layers' kernel: 'auto' | 'chunked' | 'recurrent' (gated_delta_rule)
    delta_rule_chunk_size: int = DEFAULT_CHUNK  # tokens per chunk of the chunked scan

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()

    # ---- the layer schedule ----
    def attention_types(self) -> tuple[str, ...]:
        """Per layer: ``"linear"`` or ``"full"``."""
        if self.layer_types is not None:
            return tuple(LAYER_TYPES[t] for t in self.layer_types[: self.num_hidden_layers])
        return tuple("full" if (i + 1) % self.full_attention_interval == 0 else "linear"
                     for i in range(self.num_hidden_layers))

    def is_moe_layer(self, index: int) -> bool:
        return (index not in self.mlp_only_layers and self.num_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(LayerKind(a, self.is_moe_layer(i)) for i, a in enumerate(self.attention_types()))

    def attention_options(self, kind: Any) -> dict[str, Any]:
        """No local-attention options: full layers see the whole context, linear ones are no attention at all."""
        return {}

    @property
    def router_options(self) -> dict[str, Any]:
        return {"shared_gate": True}  # the shared expert's output scaled by a per-token sigmoid gate

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's convolution: queries, keys and values side by side."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def linear_attention_shapes(self) -> dict[str, Any]:
        """A linear layer's sizes for the memory plan (``nnx_zoo.sharding.plan_linear.LinearShapes``)."""
        hv, dv = self.linear_num_value_heads, self.linear_value_head_dim
        return dict(key_heads=self.linear_num_key_heads, value_heads=hv, key_dim=self.linear_key_head_dim,
                    value_dim=dv, conv_channels=self.linear_conv_dim, chunk=self.delta_rule_chunk_size,
                    projections=self.linear_conv_dim + hv * dv + 2 * hv)  # q, k, v; the output gate z; b, a

    def _problems(self) -> list[str]:
        p = super()._problems()
        if p:
            return p
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "decoder_sparse_step", "full_attention_interval"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                p.append(f"{name} must be a positive integer, got {value!r}")
        if p:
            return p
        if self.linear_num_value_heads % self.linear_num_key_heads:
            p.append(f"linear_num_key_heads={self.linear_num_key_heads} must divide linear_num_value_heads="
                     f"{self.linear_num_value_heads} (each query/key head serves a group of value heads)")
        if self.layer_types is not None:
            if len(self.layer_types) < self.num_hidden_layers:
                p.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                p.append(f"layer_types {bad} are not this model's; use {sorted(LAYER_TYPES)}")
        n = self.mtp_num_hidden_layers
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            p.append(f"mtp_num_hidden_layers must be a non-negative integer, got {n!r}")
        elif len({self.is_moe_layer(j) for j in range(n)}) > 1:
            p.append(f"the {n} MTP layers would mix dense and MoE MLPs (is_moe_layer of their indices 0..{n - 1}: "
                     "mlp_only_layers / decoder_sparse_step); only MTP layers of one kind are supported")
        if self.attention_bias:
            p.append("attention_bias=True is not supported (the released checkpoints have no attention biases)")
        if self.num_experts and not self.shared_expert_intermediate_size:
            p.append("shared_expert_intermediate_size must be positive (every MoE layer has a gated shared expert)")
        return p + delta_rule_problems(self.delta_rule_chunk_size)

    # ---- Hugging Face config.json ----
    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Qwen3NextConfig:
        d = {"norm_topk_prob": False, **d} if cls.EXPERT_FIELDS.renormalize_topk == "norm_topk_prob" else dict(d)
        if d.get("mtp_use_dedicated_embeddings") and d.get("mtp_num_hidden_layers"):
            raise ValueError("mtp_use_dedicated_embeddings=true (an MTP depth with its own embedding table) is not "
                             "supported: the releases share the model's; load with mtp_num_hidden_layers=0 to skip "
                             "the MTP weights")
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rope, Mapping):  # the multimodal rope's sections: the same rope for text-only positions
            key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
            d[key] = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
        return super()._from_hf_dict(d, overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d["layer_types"] = [{"linear": "linear_attention", "full": "full_attention"}[a]
                            for a in self.attention_types()]
        d["partial_rotary_factor"] = self.partial_rotary_factor  # its default is not 1 here: always written
        return {k: v for k, v in d.items() if k not in self.HF_OMITTED}

    @property
    def mtp_depth(self) -> int:
        """``FamilyConfig.mtp_depth``: one depth (its ``mtp_num_hidden_layers`` layers run in turn), or none."""
        return 1 if self.mtp_num_hidden_layers else 0

    def mtp_layer_kind(self) -> LayerKind:
        """The kind of every MTP layer: full attention, MoE as ``is_moe_layer(0)`` (vLLM numbers them from 0)."""
        return LayerKind("full", self.is_moe_layer(0))

    # ---- sizes and cost ----
    def _linear_params(self) -> int:
        h, hk, hv = self.hidden_size, self.linear_num_key_heads, self.linear_num_value_heads
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        projections = h * (2 * hk * dk + 2 * hv * dv) + h * 2 * hv  # q, k, v, z and b, a
        return projections + self.linear_conv_dim * self.linear_conv_kernel_dim + 2 * hv + dv + hv * dv * h

    def _full_params(self) -> int:
        h, heads, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        return h * heads * 2 * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q + gate, k, v, o, q/k norms

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """Parameter counts, the MTP depth's only with ``include_mtp`` (its norms, ``fc`` and layers; the embedding
        and head are shared). ``active`` counts the router, ``num_experts_per_tok`` routed experts and the gated
        shared expert of each MoE layer."""
        h, v = self.hidden_size, self.vocab_size
        total = active = v * h + (0 if self.tie_word_embeddings else v * h) + h
        experts, k, width = self.num_routed_experts, self.num_experts_per_tok, self.expert_intermediate_size
        kinds = list(self.layer_kinds())
        if include_mtp and self.mtp_num_hidden_layers:
            total += 3 * h + 2 * h * h  # its three norms and fc
            active += 3 * h + 2 * h * h
            kinds += [self.mtp_layer_kind()] * self.mtp_num_hidden_layers
        for kind in kinds:
            mixer = (self._linear_params() if kind.attention == "linear" else self._full_params()) + 2 * h
            if kind.moe:
                shared = 3 * h * self.shared_expert_intermediate_size + h + h * experts  # + its gate, the router
                total += mixer + shared + 3 * experts * h * width
                active += mixer + shared + 3 * k * h * width
            else:
                total += mixer + 3 * h * self.intermediate_size
                active += mixer + 3 * h * self.intermediate_size
        return ParameterCount(total=total, active=active, embedding=v * h)

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """``6 * (active matmul parameters)`` plus, per full layer, causal attention over ``seq_len`` (as
        ``DecoderConfig``'s), and per linear layer the delta rule's state reads and writes: about ``3 * 2 * 2 *
        heads * d_k * d_v`` per token (forward and backward), independent of the sequence. ``include_mtp``: the MTP
        depth's parameters and full layers too (not its pass through the shared head, as DeepSeek-V3's count)."""
        counts = self.num_parameters(include_mtp=include_mtp)
        matmul = counts.active - (0 if self.tie_word_embeddings else counts.embedding)
        kinds = [k.attention for k in self.layer_kinds()]
        kinds += ["full"] * (self.mtp_num_hidden_layers if include_mtp else 0)
        attention = 3 * seq_len * self.num_attention_heads * 2 * self.head_dim * kinds.count("full")
        state = 12 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return float(6 * matmul + attention + state * kinds.count("linear"))
