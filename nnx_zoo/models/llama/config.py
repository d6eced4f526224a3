"""Llama3Config: Llama 3.x hyper-parameters (HF ``model_type`` ``llama``), named as in ``config.json``, plus presets.

The class defaults are Llama 3.1 8B. The shared fields, validation, HF mapping, cost formulas and CPU presets live
in ``nnx_zoo.models.decoder_config``; this file holds what is Llama's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from nnx_zoo.layers.rope import Llama3Scaling
from nnx_zoo.models.decoder_config import DecoderConfig, cpu_presets

# Llama 3.1's and 3.2's rope: the llama3 schedule over an original 8192-token context.
LLAMA31_ROPE = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)
LLAMA32_ROPE = Llama3Scaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)


# Llama 3.1 8B, the class defaults (published config.json values, as every preset's sizes).
LLAMA31_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE,
    max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001)
# name -> fields over the defaults (Llama 3.1 8B).
PRESETS: dict[str, dict[str, Any]] = {
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        head_dim=64, tie_word_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "llama3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        tie_word_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "llama3.1-8b": {},
    "llama3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "llama3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128),
    # llama3-tiny (~4.9M parameters) and llama3-small (~21M): the test and quick-recipe sizes.
    **cpu_presets("llama3", head_dim=32, rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 1024)),
}


@dataclasses.dataclass(frozen=True)
class Llama3Config(DecoderConfig, model_type="llama", architecture="LlamaForCausalLM", qk_norm=False,
                   presets=PRESETS, defaults=LLAMA31_8B,
                   hf_extras={"mlp_bias": False, "pretraining_tp": 1, "attention_dropout": 0.0}):
    """Llama 3.x hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Llama3Config.preset("llama3.2-1b")
    >>> cfg = Llama3Config.from_hf("/path/to/Llama-3.1-8B")   # a directory with config.json, or its dict
    >>> cfg.num_parameters().total
    8030261248
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "llama": dict(bos_token_id=1, eos_token_id=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_theta=10000.0),
    }

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        if d.get("mlp_bias"):
            return ["mlp_bias=true is not supported (the SwiGLU projections here have no bias)"]
        return []
