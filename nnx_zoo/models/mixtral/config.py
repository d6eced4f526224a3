"""MixtralConfig: Mixtral hyper-parameters (HF ``model_type`` ``mixtral``), named as in ``config.json``, plus
presets.

The class defaults are Mixtral-8x7B. Shared fields, validation, HF mapping and cost formulas live in
``nnx_zoo.models.moe_decoder_config``; what is Mixtral's own: Llama's attention, every layer sparse with
``num_local_experts`` experts of width ``intermediate_size``, top-k always renormalised. Sliding-window
attention (``sliding_window`` not null) and router jitter (``router_jitter_noise`` > 0) are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from nnx_zoo.models.decoder_config import cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig

# Mixtral-8x7B, the class defaults (published config.json values, as every preset's sizes).
MIXTRAL_8X7B: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
    bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, router_aux_loss_coef=0.02)
# mixtral-tiny / -small: the dense CPU presets with 8 experts of width 64 / 128, top-2.
_CPU = cpu_presets("mixtral", head_dim=32, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2)
PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {},
    "mixtral-8x22b": dict(vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                          num_attention_heads=48, max_position_embeddings=65536, router_aux_loss_coef=0.001),
    "mixtral-tiny": {**_CPU["mixtral-tiny"], "intermediate_size": 64},
    "mixtral-small": {**_CPU["mixtral-small"], "intermediate_size": 128},
}


@dataclasses.dataclass(frozen=True)
class MixtralConfig(MoEDecoderConfig, model_type="mixtral", architecture="MixtralForCausalLM", qk_norm=False,
                    presets=PRESETS, defaults=MIXTRAL_8X7B,
                    hf_extras={"sliding_window": None, "router_jitter_noise": 0.0, "attention_dropout": 0.0},
                    experts=ExpertFields("num_local_experts", "intermediate_size", True)):  # top-k always renormalised
    """Mixtral hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = MixtralConfig.preset("mixtral-8x7b")
    >>> cfg = MixtralConfig.from_hf("/path/to/Mixtral-8x7B-v0.1")   # a directory with config.json, or its dict
    >>> round(cfg.num_parameters().total / 1e9, 1), round(cfg.num_parameters().active / 1e9, 1)
    (46.7, 12.9)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "mixtral": dict(max_position_embeddings=131072, router_aux_loss_coef=0.001),
    }

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 8  # transformers' MixtralConfig default

    num_local_experts: int = 8

    def is_moe_layer(self, index: int) -> bool:
        return True

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        p = []
        if d.get("sliding_window") is not None:
            p.append(f"sliding_window={d['sliding_window']} is not supported (sliding-window attention); every "
                     "layer here attends to the whole context. Set it to null if your sequences fit the window")
        if d.get("router_jitter_noise"):
            p.append(f"router_jitter_noise={d['router_jitter_noise']} is not supported (multiplicative noise on "
                     "the router input in training); set it to 0.0")
        return p
