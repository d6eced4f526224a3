"""Mixtral (HF ``model_type`` ``mixtral``): config with presets, model, HF key table."""

from nnx_zoo.models.mixtral.config import MixtralConfig
from nnx_zoo.models.mixtral.model import Mixtral

__all__ = ["Mixtral", "MixtralConfig"]
