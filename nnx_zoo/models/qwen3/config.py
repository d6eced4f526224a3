"""Qwen3Config: Qwen3 (dense) hyper-parameters (HF ``model_type`` ``qwen3``), named as in ``config.json``, plus
presets.

The class defaults are Qwen3-8B. The shared fields, validation, HF mapping and cost formulas live in
``nnx_zoo.models.decoder_config``; what is Qwen3's own: queries and keys are RMS-normalized per head before
rope (``qk_norm``), and ``head_dim`` (128) is free of ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from nnx_zoo.models.decoder_config import DecoderConfig, cpu_presets

# Qwen3-8B, the class defaults (published config.json values, as every preset's sizes).
QWEN3_8B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    bos_token_id=151643, eos_token_id=151645)
# name -> fields over the defaults (Qwen3-8B).
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
    # qwen3-tiny (~5.1M parameters) and qwen3-small (~22M): head_dim * heads = 2 x hidden_size, as in Qwen3-0.6B.
    **cpu_presets("qwen3", head_dim=64, rope_theta=1e6),
}


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DecoderConfig, model_type="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True,
                  presets=PRESETS, defaults=QWEN3_8B,
                  hf_extras={"use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0}):
    """Qwen3 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Qwen3Config.preset("qwen3-0.6b")
    >>> cfg = Qwen3Config.from_hf("/path/to/Qwen3-8B")        # a directory with config.json, or its dict
    >>> cfg.head_dim, cfg.num_key_value_heads
    (128, 8)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen3": dict(bos_token_id=None, eos_token_id=None, max_position_embeddings=32768, rope_theta=10000.0),
    }

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 32  # transformers' Qwen3Config default
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = 128  # its default too; it refuses "head_dim": null
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        sliding = [t for t in d.get("layer_types") or () if t != "full_attention"]
        if d.get("use_sliding_window") or sliding:
            return ["sliding-window attention (use_sliding_window / layer_types 'sliding_attention') is not "
                    "supported; every layer here attends to the whole context"]
        return []
