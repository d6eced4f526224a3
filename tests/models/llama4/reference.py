"""Tiny random Hugging Face Llama 4 text models (PyTorch, CPU, float32, eager attention) for the family's tests.

``make_hf(case)`` builds transformers' ``Llama4ForCausalLM`` on one of ``CASES`` (tiny shapes, chunks of 4 slots and
temperature tuning from slot 1 on, so both matter within a few tokens) with every weight drawn at random (norm
scales around 1, so a misplaced scale shows); ``make_multimodal`` builds the ``Llama4ForConditionalGeneration``
wrapper around such a text model (with a tiny vision tower) for the multimodal checkpoint's layout.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration, Llama4TextConfig

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
            num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=4, floor_scale=2, attn_scale=0.1,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CASES = {
    # Scout's shape: every layer MoE, NoPE every fourth (layer 3), the L2 q/k norm, Scout's llama3 rope (both band
    # factors 1), top-1.
    "scout": dict(interleave_moe_layer_step=1, use_qk_norm=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                   "original_max_position_embeddings": 16}),
    # Maverick's shape and all four layer kinds: dense / MoE alternating, layers 2-3 NoPE (a dense and an MoE one),
    # no q/k norm; top-2 (each chosen expert's input scaled by its own score), biases, the llama3 rope with a medium
    # band, tied embeddings.
    "maverick": dict(interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 0], use_qk_norm=False,
                     num_experts_per_tok=2, attention_bias=True, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16}),
}


def text_config(case: str, **overrides) -> Llama4TextConfig:
    return Llama4TextConfig(**copy.deepcopy({**TINY, **CASES[case], **overrides}))


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def make_hf(case: str, seed: int = 0, **overrides) -> Llama4ForCausalLM:
    """transformers' Llama 4 text model of ``case`` with ``overrides``, random weights, eval mode, eager attention."""
    config = text_config(case, **overrides)
    config._attn_implementation = "eager"
    return _randomize(Llama4ForCausalLM(config), seed)


def make_multimodal(case: str, seed: int = 0) -> Llama4ForConditionalGeneration:
    """The multimodal wrapper around ``case``'s text model, with a one-layer vision tower (random weights)."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
    config = Llama4Config(text_config=text_config(case).to_dict(), vision_config=vision)
    config._attn_implementation = "eager"
    return _randomize(Llama4ForConditionalGeneration(config), seed)


def hf_outputs(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """transformers' logits, hidden states ``[layers + 1, b, s, embed]`` and each MoE layer's chosen experts
    ``[moe_layers, b, s, k]`` (the top-k of its router logits)."""
    k = model.config.get_text_config().num_experts_per_tok
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True, output_router_logits=True,
                    attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long))
    experts = [torch.topk(r, k, dim=-1).indices.reshape(*ids.shape, k).numpy() for r in out.router_logits]
    return {"logits": out.logits.numpy(), "hidden": np.stack([h.numpy() for h in out.hidden_states]),
            "experts": np.stack(experts)}
