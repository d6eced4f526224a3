"""DeepSeek-V4 (HF ``model_type`` ``deepseek_v4``): compressed sparse attention, hyper-connections, hash routing."""

from nnx_zoo.models.deepseek4 import axes  # noqa: F401  (declares V4's logical names before any module uses them)
from nnx_zoo.models.deepseek4.config import PRESETS, DeepSeekV4Config
from nnx_zoo.models.deepseek4.model import DecoderLayer, DeepSeekV4, MTPHead

__all__ = ["PRESETS", "DecoderLayer", "DeepSeekV4", "DeepSeekV4Config", "MTPHead"]
