"""Tiny random Hugging Face Qwen3-Next / Qwen3.5 text models (PyTorch, CPU, float32, eager attention) for the
families' tests.

``make_hf(case)`` builds transformers' model of one of ``CASES`` with every weight drawn at random (the ``(1 + w)``
norms' weights around 0, the gated norm's around 1, so a misplaced scale shows; ``A_log`` and ``dt_bias`` so decays
and write strengths spread over their range), four layers (linear, linear, linear, full); ``make_multimodal`` the
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` wrapper around such a text model.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
SCALE = 0.15  # other weights: N(0, SCALE)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
# case -> (config class, model class, fields)
CASES = {
    # Layer 0 dense (mlp_only_layers), the rest MoE; top-2 renormalized.
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM,
                   dict(intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=True, **_MOE)),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(intermediate_size=48, tie_word_embeddings=True)),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, dict(_MOE)),
}


def text_config(case: str, **overrides):
    config_cls, _, fields = CASES[case]
    return config_cls(**copy.deepcopy({**TINY, **fields, **overrides}))


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(SCALE * torch.randn_like(p))
    return model.eval()


def make_hf(case: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' text model of ``case`` with ``overrides``, random weights, eval mode, eager attention."""
    config = text_config(case, **overrides)
    config._attn_implementation = "eager"
    return _randomize(CASES[case][1](config), seed)


def make_multimodal(case: str, seed: int = 0) -> torch.nn.Module:
    """The multimodal wrapper around ``case``'s text model (``qwen3_5`` / ``qwen3_5_moe``), a one-block vision tower."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    config_cls, model_cls = {"qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
                             "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)}[case]
    config = config_cls(text_config=text_config(case).to_dict(), vision_config=vision,
                        tie_word_embeddings=text_config(case).tie_word_embeddings)
    config._attn_implementation = "eager"
    return _randomize(model_cls(config), seed)


def hf_outputs(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """transformers' logits, hidden states ``[layers + 1, b, s, embed]`` and each MoE layer's chosen experts
    ``[moe_layers, b, s, k]`` (the top-k of its router logits; none for a dense model)."""
    text = model.config.get_text_config()
    moe = getattr(text, "num_experts", 0) or 0
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True,
                    attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long),
                    **({"output_router_logits": True} if moe else {}))
    experts = None
    if moe:
        k = text.num_experts_per_tok
        experts = np.stack([torch.topk(r, k, dim=-1).indices.reshape(*ids.shape, k).numpy()
                            for r in out.router_logits])
    return {"logits": out.logits.numpy(), "hidden": np.stack([h.numpy() for h in out.hidden_states]),
            "experts": experts}
