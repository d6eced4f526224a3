"""Glm4MoEConfig: GLM-4.5 hyper-parameters (HF ``model_type`` ``glm4_moe``), named as in ``config.json``, plus
presets.

The class defaults are GLM-4.5-Air. Shared fields, validation, HF mapping and cost formulas live in
``nnx_zoo.models.moe_decoder_config``; what is GLM-4.5's own: partial rotary (``partial_rotary_factor``, 0.5 when
the file has none, as transformers defaults it), q/k/v biases without an ``o_proj`` one, per-head q/k RMSNorm when
``use_qk_norm``, layers ``< first_k_dense_replace`` dense, the others ``n_routed_experts`` experts of width
``moe_intermediate_size`` plus ``n_shared_experts`` shared ones, routed by sigmoid scores + a selection bias within
the ``topk_group`` best of ``n_group`` groups (``nnx_zoo.layers.routers``). The checkpoint's
multi-token-prediction layers (HF ``num_nextn_predict_layers``, here ``mtp_layers_on_disk``: not a field of that
name, which would tell the trainer and ``--plan`` there are MTP heads to run) are skipped on load, as transformers
skips them (its ``Glm4MoeForCausalLM`` never runs them), and the count is written back. transformers computes no
auxiliary loss for GLM-4.5, so ``output_router_logits`` has nothing to turn on: balance with the routing bias
(``update_routing_bias``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.models.decoder_config import cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig

# GLM-4.5-Air (106B total, 12B active), the class defaults (published config.json values, as every preset's).
GLM45_AIR: dict[str, Any] = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072,
    attention_bias=True, partial_rotary_factor=0.5, eos_token_id=(151329, 151336, 151338), num_experts_per_tok=8)
# glm4.5-tiny / -small: the dense CPU presets, layer 0 dense, then 8 experts (width 64 / 128) top-2 + 1 shared.
_CPU = cpu_presets("glm4.5", head_dim=32, rope_theta=1e6, attention_bias=True, partial_rotary_factor=0.5,
                   n_routed_experts=8, num_experts_per_tok=2, mtp_layers_on_disk=0)
PRESETS: dict[str, dict[str, Any]] = {
    "glm4.5-air": {},
    "glm4.5": dict(hidden_size=5120, intermediate_size=12288, num_hidden_layers=92, n_routed_experts=160,
                   moe_intermediate_size=1536, first_k_dense_replace=3, routed_scaling_factor=2.5, use_qk_norm=True),
    "glm4.5-tiny": {**_CPU["glm4.5-tiny"], "moe_intermediate_size": 64},
    "glm4.5-small": {**_CPU["glm4.5-small"], "moe_intermediate_size": 128},
}


@dataclasses.dataclass(frozen=True)
class Glm4MoEConfig(MoEDecoderConfig, model_type="glm4_moe", architecture="Glm4MoeForCausalLM", qk_norm=False,
                    o_bias=False, presets=PRESETS, defaults=GLM45_AIR, hf_extras={"attention_dropout": 0.0},
                    experts=ExpertFields("n_routed_experts", "moe_intermediate_size", "norm_topk_prob")):
    """GLM-4.5 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Glm4MoEConfig.preset("glm4.5-air")
    >>> cfg = Glm4MoEConfig.from_hf("/path/to/GLM-4.5-Air")      # a directory with config.json, or its dict
    >>> cfg.rotary_dim, round(cfg.num_parameters().total / 1e9, 1), round(cfg.num_parameters().active / 1e9, 1)
    (64, 106.9, 13.4)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"glm4_moe": dict(eos_token_id=None, rope_theta=10000.0)}

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 8  # transformers' Glm4MoeConfig default
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False  # its attention fails on "head_dim": null (absent: hidden / heads)
    PARTIAL_ROTARY: ClassVar[bool] = True

    n_routed_experts: int = 128
    moe_intermediate_size: int = 1408
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    mtp_layers_on_disk: int = 1  # HF num_nextn_predict_layers: model.layers.{num_hidden_layers + j}.*, skipped

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace and self.n_routed_experts > 0

    @property
    def qk_norm(self) -> bool:
        return self.use_qk_norm

    @property
    def router_kind(self) -> str:
        return "sigmoid_bias"

    @property
    def router_options(self) -> dict[str, Any]:
        return dict(n_group=self.n_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor)

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def _problems(self) -> list[str]:
        p = super()._problems()
        if p or not self.num_moe_layers:
            return p
        experts, groups, kept = self.n_routed_experts, self.n_group, self.topk_group
        if not (isinstance(groups, int) and groups > 0 and experts % groups == 0 and experts // groups >= 2):
            p.append(f"n_group={groups!r} must divide n_routed_experts={experts} into groups of at least 2 experts "
                     "(a group scores as the sum of its best two)")
        elif not (isinstance(kept, int) and 0 < kept <= groups):
            p.append(f"topk_group must be in 1..n_group={groups}, got {kept!r}")
        elif self.num_experts_per_tok > kept * experts // groups:
            p.append(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {kept * experts // groups} experts "
                     f"of the topk_group={kept} kept groups")
        if self.output_router_logits:
            p.append("output_router_logits=True: transformers computes no auxiliary loss for GLM-4.5; balance the "
                     "experts with the routing bias instead (the recipe's --routing-bias-rate)")
        return p

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Glm4MoEConfig:
        # A file's silence means transformers' defaults where they differ from GLM-4.5-Air's (no attention bias);
        # output_router_logits only records logits there (no loss), so it is not read.
        d = {"attention_bias": False, **d, "output_router_logits": False}
        d["mtp_layers_on_disk"] = d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 1))
        return super()._from_hf_dict(d, overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d["num_nextn_predict_layers"] = d.pop("mtp_layers_on_disk")
        return d
