"""nnx_zoo: a pure Flax-NNX model zoo for large language models."""

from nnx_zoo import sharding
from nnx_zoo.generate import GenerateOutput, generate
from nnx_zoo.layers.lora import LoRAParam, apply_lora, merge_lora
from nnx_zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.models.deepseek4 import DeepSeekV4, DeepSeekV4Config
from nnx_zoo.models.gemma3 import Gemma3, Gemma3Config
from nnx_zoo.models.gemma4 import Gemma4, Gemma4Config
from nnx_zoo.models.glm4_moe import Glm4MoE, Glm4MoEConfig
from nnx_zoo.models.glm5 import Glm5, Glm5Config
from nnx_zoo.models.gpt_oss import GptOss, GptOssConfig
from nnx_zoo.models.kimi_linear import KimiLinear, KimiLinearConfig
from nnx_zoo.models.llama import Llama3, Llama3Config
from nnx_zoo.models.llama4 import Llama4, Llama4Config
from nnx_zoo.models.minimax_m2 import MiniMaxM2, MiniMaxM2Config
from nnx_zoo.models.mistral4 import Mistral4, Mistral4Config
from nnx_zoo.models.mixtral import Mixtral, MixtralConfig
from nnx_zoo.models.qwen3 import Qwen3, Qwen3Config
from nnx_zoo.models.qwen3_5 import Qwen35, Qwen35Config, Qwen35MoE, Qwen35MoEConfig
from nnx_zoo.models.qwen3_moe import Qwen3MoE, Qwen3MoEConfig
from nnx_zoo.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from nnx_zoo.models.registry import AutoConfig, AutoModelForCausalLM

__all__ = [
    "AutoConfig",
    "AutoModelForCausalLM",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "DeepSeekV4",
    "DeepSeekV4Config",
    "Gemma3",
    "Gemma3Config",
    "Gemma4",
    "Gemma4Config",
    "GenerateOutput",
    "Glm4MoE",
    "Glm4MoEConfig",
    "Glm5",
    "Glm5Config",
    "GptOss",
    "GptOssConfig",
    "KimiLinear",
    "KimiLinearConfig",
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
    "Qwen35",
    "Qwen35Config",
    "Qwen35MoE",
    "Qwen35MoEConfig",
    "Qwen3Next",
    "Qwen3NextConfig",
    "apply_lora",
    "generate",
    "merge_lora",
    "sharding",
]
__version__ = "0.1.0"
