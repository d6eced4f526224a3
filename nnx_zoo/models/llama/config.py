"""Llama3Config: Llama 3.x hyper-parameters (HF ``model_type`` ``llama``), named as in ``config.json``, plus presets.

The class defaults are Llama 3.1 8B. The shared fields, validation, HF mapping and cost formulas live in
``nnx_zoo.models.decoder_config.DecoderConfig``; this file holds what is Llama's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from nnx_zoo.layers.rope import Llama3Scaling, RopeScaling
from nnx_zoo.models.decoder_config import DecoderConfig

# Llama 3.1's and 3.2's rope: the llama3 schedule over an original 8192-token context.
LLAMA31_ROPE = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)
LLAMA32_ROPE = Llama3Scaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)


_SMALL: dict[str, Any] = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                              rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 1024))
# name -> fields over the defaults of Llama3Config (Llama 3.1 8B); the real sizes are their published config.json
# values.
PRESETS: dict[str, dict[str, Any]] = {
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        head_dim=64, tie_word_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "llama3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        tie_word_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "llama3.1-8b": {},
    "llama3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "llama3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128),
    # ~4.9M parameters (4.1M of them the tied embedding): the test and quick-recipe size.
    "llama3-tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, **_SMALL),
    # ~21M parameters (16M of them embedding and head): a 6-layer GQA model with its own output head.
    "llama3-small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=32, **_SMALL),
}


@dataclasses.dataclass(frozen=True)
class Llama3Config(DecoderConfig):
    """Llama 3.x hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Llama3Config.preset("llama3.2-1b")
    >>> cfg = Llama3Config.from_hf("/path/to/Llama-3.1-8B")   # a directory with config.json, or its dict
    >>> cfg.num_parameters().total
    8030261248
    """

    MODEL_TYPE: ClassVar[str] = "llama"
    ARCHITECTURE: ClassVar[str] = "LlamaForCausalLM"
    QK_NORM: ClassVar[bool] = False
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS
    HF_EXTRAS: ClassVar[dict[str, Any]] = {"mlp_bias": False, "pretraining_tp": 1, "attention_dropout": 0.0}

    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling = LLAMA31_ROPE
    max_position_embeddings: int = 131072
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        if d.get("mlp_bias"):
            return ["mlp_bias=true is not supported (the SwiGLU projections here have no bias)"]
        return []
