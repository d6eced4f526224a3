"""DeepSeek-V3 (and the V2 shapes the same code covers): config, MLA, MoE, model, HF import/export."""

from nnx_zoo.models.deepseek import axes  # noqa: F401  (declares DeepSeek's logical names before any module uses them)
from nnx_zoo.models.deepseek.cache import MLACache
from nnx_zoo.models.deepseek.config import PRESETS, DeepSeekV3Config, ParameterCount
from nnx_zoo.models.deepseek.mla import MLA
from nnx_zoo.models.deepseek.model import DecoderLayer, DeepSeekV3, LayerOutput, MTPHead
from nnx_zoo.models.deepseek.moe import DeepSeekMoE, MoEOutput, RouterBias, route

__all__ = [
    "MLA",
    "MLACache",
    "PRESETS",
    "DecoderLayer",
    "DeepSeekMoE",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "LayerOutput",
    "MTPHead",
    "MoEOutput",
    "ParameterCount",
    "RouterBias",
    "route",
]
