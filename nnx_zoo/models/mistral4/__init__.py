"""Mistral 4 (HF ``model_type`` ``mistral4``): DeepSeek-V3's parts with Mistral 4's router and query scale; config
with presets and model (the HF key table is DeepSeek's)."""

from nnx_zoo.models.mistral4.config import Mistral4Config
from nnx_zoo.models.mistral4.model import Mistral4

__all__ = ["Mistral4", "Mistral4Config"]
