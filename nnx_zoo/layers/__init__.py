"""Family-agnostic NNX building blocks; every Variable carries logical axis names."""

from nnx_zoo.layers.attention import causal_mask, dot_product_attention
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.lora import LoRAExperts, LoRALinear, LoRAParam, apply_lora, merge_lora
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.moe import RoutedExperts, default_moe_impl
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import YarnScaling, apply_rope, rope_cos_sin, rope_frequencies, yarn_mscale
from nnx_zoo.layers.scan import REMAT_POLICIES, batch_split, create_stack, run_stack
from nnx_zoo.layers.spec import explicit_spec, weight_einsum

__all__ = [
    "REMAT_POLICIES",
    "Embed",
    "Linear",
    "LoRAExperts",
    "LoRALinear",
    "LoRAParam",
    "RMSNorm",
    "RoutedExperts",
    "SwiGLU",
    "YarnScaling",
    "apply_lora",
    "apply_rope",
    "batch_split",
    "causal_mask",
    "create_stack",
    "default_moe_impl",
    "dot_product_attention",
    "explicit_spec",
    "merge_lora",
    "rope_cos_sin",
    "rope_frequencies",
    "run_stack",
    "weight_einsum",
    "yarn_mscale",
]
