"""nnx_zoo: a pure Flax-NNX model zoo for large language models."""

from nnx_zoo import sharding
from nnx_zoo.generate import GenerateOutput, generate
from nnx_zoo.layers.lora import LoRAParam, apply_lora, merge_lora
from nnx_zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.models.deepseek4 import DeepSeekV4, DeepSeekV4Config
from nnx_zoo.models.glm4_moe import Glm4MoE, Glm4MoEConfig
from nnx_zoo.models.glm5 import Glm5, Glm5Config
from nnx_zoo.models.llama import Llama3, Llama3Config
from nnx_zoo.models.llama4 import Llama4, Llama4Config
from nnx_zoo.models.minimax_m2 import MiniMaxM2, MiniMaxM2Config
from nnx_zoo.models.mistral4 import Mistral4, Mistral4Config
from nnx_zoo.models.mixtral import Mixtral, MixtralConfig
from nnx_zoo.models.qwen3 import Qwen3, Qwen3Config
from nnx_zoo.models.qwen3_moe import Qwen3MoE, Qwen3MoEConfig
from nnx_zoo.models.registry import AutoConfig, AutoModelForCausalLM

__all__ = [
    "AutoConfig",
    "AutoModelForCausalLM",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "DeepSeekV4",
    "DeepSeekV4Config",
    "GenerateOutput",
    "Glm4MoE",
    "Glm4MoEConfig",
    "Glm5",
    "Glm5Config",
    "Llama3",
    "Llama3Config",
    "Llama4",
    "Llama4Config",
    "LoRAParam",
    "MiniMaxM2",
    "MiniMaxM2Config",
    "Mistral4",
    "Mistral4Config",
    "Mixtral",
    "MixtralConfig",
    "Qwen3",
    "Qwen3Config",
    "Qwen3MoE",
    "Qwen3MoEConfig",
    "apply_lora",
    "generate",
    "merge_lora",
    "sharding",
]
__version__ = "0.1.0"
