"""Gemma 3, text model (HF ``model_type`` ``gemma3_text``; the text part of ``gemma3``): config with presets,
model, HF key table."""

from nnx_zoo.models.gemma3.config import Gemma3Config
from nnx_zoo.models.gemma3.model import Gemma3

__all__ = ["Gemma3", "Gemma3Config"]
