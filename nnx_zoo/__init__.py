"""nnx_zoo: a pure Flax-NNX model zoo for large language models."""

from nnx_zoo import sharding
from nnx_zoo.generate import GenerateOutput, generate
from nnx_zoo.layers.lora import LoRAParam, apply_lora, merge_lora
from nnx_zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config

__all__ = [
    "DeepSeekV3",
    "DeepSeekV3Config",
    "GenerateOutput",
    "LoRAParam",
    "apply_lora",
    "generate",
    "merge_lora",
    "sharding",
]
__version__ = "0.1.0"
