"""Qwen3Config: Qwen3 (dense) hyper-parameters (HF ``model_type`` ``qwen3``), named as in ``config.json``, plus
presets.

The class defaults are Qwen3-8B. The shared fields, validation, HF mapping and cost formulas live in
``nnx_zoo.models.decoder_config.DecoderConfig``; what is Qwen3's own: queries and keys are RMS-normalized per
head before rope (``QK_NORM``), and ``head_dim`` (128) is free of ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from nnx_zoo.models.decoder_config import DecoderConfig

_SMALL: dict[str, Any] = dict(vocab_size=32000, max_position_embeddings=4096, rope_theta=1e6, bos_token_id=None,
                              eos_token_id=None)

# name -> fields over the defaults of Qwen3Config (Qwen3-8B). The real sizes are their published config.json values.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "qwen3-8b": {},
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64),
    # ~5.1M parameters (4.1M of them the tied embedding); head_dim * heads = 2 x hidden_size, as in Qwen3-0.6B.
    "qwen3-tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, **_SMALL),
    # ~22M parameters (16M of them embedding and head): a 6-layer GQA model with its own output head.
    "qwen3-small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=64, **_SMALL),
}


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    """Qwen3 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Qwen3Config.preset("qwen3-0.6b")
    >>> cfg = Qwen3Config.from_hf("/path/to/Qwen3-8B")        # a directory with config.json, or its dict
    >>> cfg.head_dim, cfg.num_key_value_heads
    (128, 8)
    """

    MODEL_TYPE: ClassVar[str] = "qwen3"
    ARCHITECTURE: ClassVar[str] = "Qwen3ForCausalLM"
    QK_NORM: ClassVar[bool] = True
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS
    HF_EXTRAS: ClassVar[dict[str, Any]] = {"use_sliding_window": False, "sliding_window": None,
                                           "attention_dropout": 0.0}

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        sliding = [t for t in d.get("layer_types") or () if t != "full_attention"]
        if d.get("use_sliding_window") or sliding:
            return ["sliding-window attention (use_sliding_window / layer_types 'sliding_attention') is not "
                    "supported; every layer here attends to the whole context"]
        return []
