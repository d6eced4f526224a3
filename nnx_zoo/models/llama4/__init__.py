"""Llama 4's text model (HF ``model_type`` ``llama4_text``; the text model of a ``llama4`` checkpoint): config with
presets, model, HF key table."""

from nnx_zoo.models.llama4.config import Llama4Config
from nnx_zoo.models.llama4.model import Llama4

__all__ = ["Llama4", "Llama4Config"]
