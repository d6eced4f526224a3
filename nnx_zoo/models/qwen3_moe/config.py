"""Qwen3MoEConfig: Qwen3-MoE hyper-parameters (HF ``model_type`` ``qwen3_moe``), named as in ``config.json``,
plus presets.

The class defaults are Qwen3-30B-A3B. Shared fields, validation, HF mapping and cost formulas live in
``nnx_zoo.models.moe_decoder_config``; what is Qwen3-MoE's own: Qwen3's attention (per-head q/k RMSNorm, free
``head_dim``), ``num_experts`` experts of width ``moe_intermediate_size``, renormalised top-k only with
``norm_topk_prob``, and which layers are sparse: layer ``i`` is MoE unless ``i in mlp_only_layers``, when
``(i + 1) % decoder_sparse_step == 0`` (dense layers use ``intermediate_size``). No shared experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.models.decoder_config import cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig

# Qwen3-30B-A3B, the class defaults (published config.json values, as every preset's sizes).
QWEN3_30B_A3B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    bos_token_id=151643, eos_token_id=151645, num_experts_per_tok=8, router_aux_loss_coef=0.001)
# qwen3-moe-tiny / -small: the dense CPU presets with 8 experts of width 64 / 128, top-2, renormalised.
_CPU = cpu_presets("qwen3-moe", head_dim=64, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                   norm_topk_prob=True)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-moe-30b-a3b": {},
    "qwen3-moe-235b-a22b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                num_attention_heads=64, moe_intermediate_size=1536),
    "qwen3-moe-tiny": {**_CPU["qwen3-moe-tiny"], "moe_intermediate_size": 64},
    "qwen3-moe-small": {**_CPU["qwen3-moe-small"], "moe_intermediate_size": 128},
}


@dataclasses.dataclass(frozen=True)
class Qwen3MoEConfig(MoEDecoderConfig, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                     presets=PRESETS, defaults=QWEN3_30B_A3B,
                     hf_extras={"use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0},
                     experts=ExpertFields("num_experts", "moe_intermediate_size", "norm_topk_prob")):
    """Qwen3-MoE hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Qwen3MoEConfig.preset("qwen3-moe-30b-a3b")
    >>> cfg = Qwen3MoEConfig.from_hf("/path/to/Qwen3-30B-A3B")     # a directory with config.json, or its dict
    >>> cfg.num_experts, cfg.num_experts_per_tok, round(cfg.num_parameters().active / 1e9, 1)
    (128, 8, 3.3)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen3_moe": dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=32768, rope_theta=10000.0),
    }

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 4  # transformers' Qwen3MoeConfig default
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False  # its attention fails on "head_dim": null (absent: hidden / heads)

    num_experts: int = 128
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] | None = ()  # None (as transformers allows): no layer

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))  # JSON gives a list
        super().__post_init__()

    def is_moe_layer(self, index: int) -> bool:
        return (index not in self.mlp_only_layers and self.num_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)

    def _problems(self) -> list[str]:
        if not (isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step > 0):
            return [f"decoder_sparse_step must be a positive integer, got {self.decoder_sparse_step!r}"]
        return super()._problems()

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Qwen3MoEConfig:
        # transformers 5 writes the expert count as num_local_experts (hub files: num_experts; it reads both), and
        # a file without norm_topk_prob means transformers' default, False.
        d = {"norm_topk_prob": False, **d}
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        return super()._from_hf_dict(d, overrides)

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        sliding = [t for t in d.get("layer_types") or () if t != "full_attention"]
        if d.get("use_sliding_window") or sliding:
            return ["sliding-window attention (use_sliding_window / layer_types 'sliding_attention') is not "
                    "supported; every layer here attends to the whole context"]
        return []
