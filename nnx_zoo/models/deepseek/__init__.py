"""DeepSeek-V3 and DeepSeek-V2 / V2-Lite (one model; ``topk_method`` picks the router): config, MLA, MoE, model,
HF import/export."""

from nnx_zoo.models.deepseek import axes  # noqa: F401  (declares DeepSeek's logical names before any module uses them)
from nnx_zoo.models.deepseek.cache import MLACache
from nnx_zoo.models.deepseek.config import PRESETS, ROUTERS, DeepSeekV3Config, ParameterCount, Router
from nnx_zoo.models.deepseek.mla import MLA
from nnx_zoo.models.deepseek.model import DecoderLayer, DeepSeekV3, LayerOutput, MTPHead
from nnx_zoo.models.deepseek.moe import DeepSeekMoE, MoEOutput, RouterBias, route, router_scores

__all__ = [
    "MLA",
    "MLACache",
    "PRESETS",
    "ROUTERS",
    "DecoderLayer",
    "DeepSeekMoE",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "LayerOutput",
    "MTPHead",
    "MoEOutput",
    "ParameterCount",
    "Router",
    "RouterBias",
    "route",
    "router_scores",
]
