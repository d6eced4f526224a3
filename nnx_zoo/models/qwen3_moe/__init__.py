"""Qwen3-MoE (HF ``model_type`` ``qwen3_moe``): config with presets, model, HF key table."""

from nnx_zoo.models.qwen3_moe.config import Qwen3MoEConfig
from nnx_zoo.models.qwen3_moe.model import Qwen3MoE

__all__ = ["Qwen3MoE", "Qwen3MoEConfig"]
