"""Kimi Linear (HF ``model_type`` ``kimi_linear``): config with presets, the KDA token mixer, model, HF key
table."""

from nnx_zoo.models.kimi_linear.config import KimiLinearConfig
from nnx_zoo.models.kimi_linear.model import KimiLinear

__all__ = ["KimiLinear", "KimiLinearConfig"]
