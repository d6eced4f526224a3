"""Qwen3, dense (HF ``model_type`` ``qwen3``): config with presets, model, HF key table."""

from nnx_zoo.models.qwen3.config import Qwen3Config
from nnx_zoo.models.qwen3.model import Qwen3

__all__ = ["Qwen3", "Qwen3Config"]
