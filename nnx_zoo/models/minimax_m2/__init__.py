"""MiniMax-M2 (HF ``model_type`` ``minimax_m2``): config with presets, model, HF key table."""

from nnx_zoo.models.minimax_m2.config import MiniMaxM2Config
from nnx_zoo.models.minimax_m2.model import MiniMaxM2

__all__ = ["MiniMaxM2", "MiniMaxM2Config"]
