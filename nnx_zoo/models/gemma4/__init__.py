"""Gemma 4, text model (HF ``model_type`` ``gemma4_text``; the text part of ``gemma4``): config with presets,
layers, model, HF key table."""

from nnx_zoo.models.gemma4.config import Gemma4Config
from nnx_zoo.models.gemma4.model import Gemma4

__all__ = ["Gemma4", "Gemma4Config"]
