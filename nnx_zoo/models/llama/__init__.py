"""Llama 3.x (HF ``model_type`` ``llama``): config with presets, model, HF key table."""

from nnx_zoo.models.llama.config import Llama3Config
from nnx_zoo.models.llama.model import Llama3

__all__ = ["Llama3", "Llama3Config"]
