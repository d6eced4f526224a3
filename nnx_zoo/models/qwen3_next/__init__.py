"""Qwen3-Next (HF ``model_type`` ``qwen3_next``): config with presets, token mixers (gated attention, the gated
delta net), model, HF key table. The Qwen3.5 models (``nnx_zoo.models.qwen3_5``) are built on it."""

from nnx_zoo.models.qwen3_next.config import Qwen3NextConfig
from nnx_zoo.models.qwen3_next.model import Qwen3Next

__all__ = ["Qwen3Next", "Qwen3NextConfig"]
