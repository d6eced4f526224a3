"""Qwen3.5's text models (HF ``model_type`` ``qwen3_5_text`` / ``qwen3_5_moe_text``, and the text model of a
``qwen3_5`` / ``qwen3_5_moe`` checkpoint): configs with presets, models (on Qwen3-Next's)."""

from nnx_zoo.models.qwen3_5.config import Qwen35Config, Qwen35MoEConfig
from nnx_zoo.models.qwen3_5.model import Qwen35, Qwen35MoE

__all__ = ["Qwen35", "Qwen35Config", "Qwen35MoE", "Qwen35MoEConfig"]
