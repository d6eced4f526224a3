"""Qwen3.5's text models (HF ``model_type`` ``qwen3_5_text`` and ``qwen3_5_moe_text``; the ``text_config`` of a
multimodal ``qwen3_5`` / ``qwen3_5_moe`` checkpoint): ``Qwen3NextConfig`` with separate linear-layer projections.

``Qwen35Config`` (dense; defaults Qwen3.5-9B): every layer a SwiGLU of ``intermediate_size``, no expert fields.
``Qwen35MoEConfig`` (defaults Qwen3.5-35B-A3B): every layer MoE (``num_experts`` of ``moe_intermediate_size``,
top-``num_experts_per_tok`` always renormalized, a gated shared expert), no dense width. Both read the multimodal
rope's ``mrope_section`` / ``mrope_interleaved`` as the plain rope it is for text positions (every section at the
same position), and the multimodal file's top-level ``tie_word_embeddings``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.models.decoder_config import cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields
from nnx_zoo.models.qwen3_next.config import Qwen3NextConfig

_MOE_FIELDS = frozenset({"num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                         "decoder_sparse_step", "mlp_only_layers", "num_experts_per_tok", "router_aux_loss_coef",
                         "output_router_logits"})
_LINEAR = dict(full_attention_interval=2, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
_COMMON = dict(vocab_size=248320, rms_norm_eps=1e-6, rope_theta=10000000.0, partial_rotary_factor=0.25,
               max_position_embeddings=262144, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, bos_token_id=None, eos_token_id=248044)

# Qwen3.5-9B, the dense class defaults.
QWEN35_9B: dict[str, Any] = dict(
    _COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, linear_num_value_heads=32, num_experts=0, num_experts_per_tok=1, tie_word_embeddings=False)
DENSE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-9b": {"mtp_num_hidden_layers": 1},  # each release carries one MTP layer
    "qwen3.5-27b": dict(mtp_num_hidden_layers=1, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24,
                        linear_num_value_heads=48),
    **cpu_presets("qwen3.5", head_dim=64, rope_theta=1e6, partial_rotary_factor=0.25, **_LINEAR),
}
# Qwen3.5-35B-A3B, the MoE class defaults.
QWEN35_35B_A3B: dict[str, Any] = dict(
    _COMMON, hidden_size=2048, intermediate_size=512, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False)
_CPU_MOE = cpu_presets("qwen3.5-moe", head_dim=64, rope_theta=1e6, partial_rotary_factor=0.25, num_experts=8,
                       num_experts_per_tok=2, **_LINEAR)
MOE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-35b-a3b": {"mtp_num_hidden_layers": 1},
    "qwen3.5-397b-a17b": dict(mtp_num_hidden_layers=1, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                              num_experts=512,
                              num_experts_per_tok=10, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                              linear_num_value_heads=64),
    "qwen3.5-moe-tiny": {**_CPU_MOE["qwen3.5-moe-tiny"], "moe_intermediate_size": 64,
                         "shared_expert_intermediate_size": 64},
    "qwen3.5-moe-small": {**_CPU_MOE["qwen3.5-moe-small"], "moe_intermediate_size": 128,
                          "shared_expert_intermediate_size": 128},
}


class _Qwen35Mixin:
    """What both Qwen3.5 configs read differently from Qwen3-Next: the multimodal file's text model."""

    MULTIMODAL_TYPE: ClassVar[str] = ""

    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        return (cls.MODEL_TYPE, cls.MULTIMODAL_TYPE)  # type: ignore[attr-defined]

    @classmethod
    def _text_model(cls, d: dict[str, Any]) -> dict[str, Any]:
        if d.get("model_type") != cls.MULTIMODAL_TYPE:
            return d
        text = {**(d.get("text_config") or {}), "model_type": cls.MODEL_TYPE}  # type: ignore[attr-defined]
        if "tie_word_embeddings" in d:  # the multimodal model ties (or not) by its own flag
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        return text

    @classmethod
    def _with_required(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        return super()._with_required(cls._text_model(d), overrides)  # type: ignore[misc]

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Any:
        return super()._from_hf_dict(cls._text_model(d), overrides)  # type: ignore[misc]


@dataclasses.dataclass(frozen=True)
class Qwen35Config(_Qwen35Mixin, Qwen3NextConfig, model_type="qwen3_5_text", architecture="Qwen3_5ForCausalLM",
                   presets=DENSE_PRESETS, defaults=QWEN35_9B):
    """Qwen3.5 dense text-model hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Qwen35Config.preset("qwen3.5-27b")
    >>> cfg = Qwen35Config.from_hf("/path/to/Qwen3.5-27B")      # qwen3_5 or qwen3_5_text config.json
    >>> round(cfg.num_parameters().total / 1e9, 1)
    26.9
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen3_5_text": dict(eos_token_id=None, max_position_embeddings=32768, rope_theta=10000.0),
    }

    MULTIMODAL_TYPE: ClassVar[str] = "qwen3_5"
    PACKED_PROJECTIONS: ClassVar[bool] = False
    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 4
    HF_OMITTED: ClassVar[frozenset[str]] = Qwen3NextConfig.HF_OMITTED | _MOE_FIELDS

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Qwen35Config:
        d = {k: v for k, v in cls._text_model(d).items() if k not in _MOE_FIELDS}  # no experts, whatever it says
        return super()._from_hf_dict({**d, "num_experts": 0, "num_experts_per_tok": 1}, overrides)


@dataclasses.dataclass(frozen=True)
class Qwen35MoEConfig(_Qwen35Mixin, Qwen3NextConfig, model_type="qwen3_5_moe_text",
                      architecture="Qwen3_5MoeForCausalLM", presets=MOE_PRESETS, defaults=QWEN35_35B_A3B,
                      experts=ExpertFields("num_experts", "moe_intermediate_size", True)):
    """Qwen3.5 MoE text-model hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Qwen35MoEConfig.preset("qwen3.5-35b-a3b")
    >>> round(cfg.num_parameters().total / 1e9, 1), round(cfg.num_parameters().active / 1e9, 1)
    (34.7, 3.5)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen3_5_moe_text": dict(eos_token_id=None, max_position_embeddings=32768, rope_theta=10000.0),
    }

    MULTIMODAL_TYPE: ClassVar[str] = "qwen3_5_moe"
    PACKED_PROJECTIONS: ClassVar[bool] = False
    REQUIRED_HF_FIELDS: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads")
    HF_OMITTED: ClassVar[frozenset[str]] = Qwen3NextConfig.HF_OMITTED | {
        "intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Qwen35MoEConfig:
        # Every layer is MoE and renormalizes; the dense width is unused (kept at the expert width).
        d = {k: v for k, v in cls._text_model(d).items()
             if k not in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers")}
        return super()._from_hf_dict({**d, "norm_topk_prob": True,
                                      "intermediate_size": d.get("moe_intermediate_size", cls.moe_intermediate_size)},
                                     overrides)
