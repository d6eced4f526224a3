"""Family-agnostic NNX building blocks; every Variable carries logical axis names."""

from nnx_zoo.layers.attention import (
    ATTENTION_IMPLS,
    Attention,
    AttentionMask,
    causal_mask,
    choose_attention_impl,
    dot_product_attention,
)
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.kv_cache import KVCache, StackedKVCache
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.lora import LoRAExperts, LoRALinear, LoRAParam, apply_lora, merge_lora
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.moe import RoutedExperts, default_moe_impl
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import (
    ROPE_TYPES,
    LinearScaling,
    Llama3Scaling,
    RopeScaling,
    YarnScaling,
    apply_rope,
    rope_cos_sin,
    rope_frequencies,
    rope_from_hf,
    rope_scaling_from_dict,
    rope_to_hf,
    yarn_mscale,
)
from nnx_zoo.layers.scan import REMAT_POLICIES, batch_split, create_stack, gathered_over_fsdp, run_stack
from nnx_zoo.layers.spec import explicit_spec, gather_weight_fsdp_axes, weight_einsum

__all__ = [
    "ATTENTION_IMPLS",
    "REMAT_POLICIES",
    "ROPE_TYPES",
    "Attention",
    "AttentionMask",
    "Embed",
    "KVCache",
    "Linear",
    "LinearScaling",
    "Llama3Scaling",
    "LoRAExperts",
    "LoRALinear",
    "LoRAParam",
    "RMSNorm",
    "RopeScaling",
    "RoutedExperts",
    "StackedKVCache",
    "SwiGLU",
    "YarnScaling",
    "apply_lora",
    "apply_rope",
    "batch_split",
    "causal_mask",
    "choose_attention_impl",
    "create_stack",
    "default_moe_impl",
    "dot_product_attention",
    "explicit_spec",
    "gather_weight_fsdp_axes",
    "gathered_over_fsdp",
    "merge_lora",
    "rope_cos_sin",
    "rope_frequencies",
    "rope_from_hf",
    "rope_scaling_from_dict",
    "rope_to_hf",
    "run_stack",
    "weight_einsum",
    "yarn_mscale",
]
