"""DeepSeek-V3 (and the V2 shapes the same code covers): config, MLA, MoE, model, HF import/export."""

from nnx_zoo.models.deepseek.cache import MLACache
from nnx_zoo.models.deepseek.config import PRESETS, DeepSeekV3Config, ParameterCount
from nnx_zoo.models.deepseek.mla import MLA
from nnx_zoo.models.deepseek.model import DecoderLayer, DeepSeekV3, DeepSeekV3Output, MTPHead
from nnx_zoo.models.deepseek.moe import DeepSeekMoE, RouterBias, route

__all__ = [
    "MLA",
    "MLACache",
    "PRESETS",
    "DecoderLayer",
    "DeepSeekMoE",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "DeepSeekV3Output",
    "MTPHead",
    "ParameterCount",
    "RouterBias",
    "route",
]
