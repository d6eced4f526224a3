"""MiniMaxM2Config: MiniMax-M2 hyper-parameters (HF ``model_type`` ``minimax_m2``), named as in ``config.json``,
plus presets.

The class defaults are MiniMax-M2 (230B total, 10B active). Shared fields, validation, HF mapping and cost formulas
live in ``nnx_zoo.models.moe_decoder_config``; what is MiniMax-M2's own: the q/k RMSNorm runs over the whole
projection (one statistic and scale over all ``num_attention_heads * head_dim`` query dims, and all
``num_key_value_heads * head_dim`` key dims) before the split into heads; rope on each head's first ``rotary_dim``
dims (the hub files' ``rotary_dim``, read as transformers does: ``partial_rotary_factor = rotary_dim / head_dim``);
every layer sparse, ``num_local_experts`` experts of width ``intermediate_size``, no shared expert; routing by
sigmoid scores with a selection-only bias (``e_score_correction_bias`` picks the experts, the unbiased scores weigh
them, renormalised; no group limit, no scaling). With ``output_router_logits`` the aux loss is transformers': the
Switch loss on the softmax of the router logits (not on the sigmoid scores that route).

Hub files carry keys transformers ignores (``use_qk_norm``, ``qk_norm_type``, ``scoring_func``,
``use_routing_bias``, ``shared_intermediate_size``, the MTP ones: the published checkpoints ship no MTP tensor);
one that asks for another architecture than the one transformers builds is refused, naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.models.decoder_config import cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig

# MiniMax-M2, the class defaults (the published config.json values). bos/eos: transformers' MiniMaxM2Config
# defaults (the hub file has none).
MINIMAX_M2: dict[str, Any] = dict(
    vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=5000000.0, max_position_embeddings=196608,
    partial_rotary_factor=0.5, bos_token_id=200034, eos_token_id=200020, num_experts_per_tok=8,
    router_aux_loss_coef=0.001)
# minimax-m2-tiny / -small: the dense CPU presets, every layer 8 experts (width 64 / 128) top-2, rope on half.
_CPU = cpu_presets("minimax-m2", head_dim=32, rope_theta=1e6, partial_rotary_factor=0.5, num_local_experts=8,
                   num_experts_per_tok=2)
PRESETS: dict[str, dict[str, Any]] = {
    "minimax-m2": {},
    "minimax-m2-tiny": {**_CPU["minimax-m2-tiny"], "intermediate_size": 64},
    "minimax-m2-small": {**_CPU["minimax-m2-small"], "intermediate_size": 128},
}
# Hub keys transformers ignores, with the only values that describe the model it builds.
_FIXED = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
          "shared_intermediate_size": 0}


@dataclasses.dataclass(frozen=True)
class MiniMaxM2Config(MoEDecoderConfig, model_type="minimax_m2", architecture="MiniMaxM2ForCausalLM", qk_norm=True,
                      presets=PRESETS, defaults=MINIMAX_M2,
                      hf_extras={**_FIXED, "attention_dropout": 0.0, "router_jitter_noise": 0.0},
                      experts=ExpertFields("num_local_experts", "intermediate_size", True)):  # always renormalised
    """MiniMax-M2 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = MiniMaxM2Config.preset("minimax-m2")
    >>> cfg = MiniMaxM2Config.from_hf("/path/to/MiniMax-M2")      # a directory with config.json, or its dict
    >>> cfg.rotary_dim, round(cfg.num_parameters().total / 1e9, 1), round(cfg.num_parameters().active / 1e9, 1)
    (64, 228.7, 11.0)
    """

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 8  # transformers' MiniMaxM2Config defaults
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = 128
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False  # its config class refuses "head_dim": null
    PARTIAL_ROTARY: ClassVar[bool] = True
    QK_NORM_FULL_WIDTH: ClassVar[bool] = True

    num_local_experts: int = 256

    def is_moe_layer(self, index: int) -> bool:
        return True

    @property
    def router_kind(self) -> str:
        return "sigmoid_bias"

    @property
    def router_options(self) -> dict[str, Any]:
        # One group of all experts: no group limit. The Switch loss is transformers' softmax one.
        return dict(balance_softmax=True)

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> MiniMaxM2Config:
        # transformers: partial_rotary_factor (rope dict, then top level) wins, else rotary_dim / head_dim, else 1.
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in d:
            rotary_dim = d.get("rotary_dim")
            head_dim = d.get("head_dim") or cls.HF_HEAD_DIM_IF_ABSENT
            d = {**d, "partial_rotary_factor": 1.0 if rotary_dim is None else rotary_dim / head_dim}
        return super()._from_hf_dict(d, overrides)

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        p = [f"{key}={d[key]!r} describes another model than transformers' MiniMax-M2 (which it ignores); expected "
             f"{value!r}" for key, value in _FIXED.items() if key in d and d[key] != value]
        if d.get("router_jitter_noise"):
            p.append(f"router_jitter_noise={d['router_jitter_noise']} is not supported (multiplicative noise on "
                     "the router input in training); set it to 0.0")
        return p

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d["rotary_dim"] = self.rotary_dim  # what the hub files and other runtimes read
        return d
