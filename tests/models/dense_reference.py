"""Tiny random Hugging Face Llama / Qwen3 (and Qwen3-MoE / Mixtral / GLM-4.5 / MiniMax-M2: ``MOE_FAMILIES``) checkpoints
(PyTorch, CPU, float32) for the families' tests on the dense core.

``make_hf(family, **config)`` builds transformers' own model with every weight drawn at random (norm scales
around 1, so a transposed or misplaced scale shows; a router's selection bias, a buffer, random too); ``save_hf``
writes it with transformers' ``save_pretrained``, optionally rewriting ``config.json``'s rope into the hub's legacy
form (``rope_scaling`` + top-level ``rope_theta``), so both forms are read.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from nnx_zoo import Glm4MoE, Llama3, MiniMaxM2, Mixtral, Qwen3, Qwen3MoE

# family -> (our class, HF config class, HF model class)
FAMILIES = {
    "llama": (Llama3, LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3, Qwen3Config, Qwen3ForCausalLM),
}
# The MoE families on the dense core, and the expert settings ``make_hf`` gives them unless overridden.
MOE_FAMILIES = {
    "qwen3_moe": (Qwen3MoE, Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "mixtral": (Mixtral, MixtralConfig, MixtralForCausalLM),
    "glm4_moe": (Glm4MoE, Glm4MoeConfig, Glm4MoeForCausalLM),
    "minimax_m2": (MiniMaxM2, MiniMaxM2Config, MiniMaxM2ForCausalLM),
}
MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    # Layer 0 dense, then 8 experts top-2 + 1 shared; biased q/k/v, rope on half of each head.
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                     attention_bias=True),
    # Every layer 8 experts top-2 (sigmoid + selection bias), width 16; rope on half of each head (the hub's key).
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, rotary_dim=4),
}
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_hf(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' model of ``family`` on the ``TINY`` config with ``overrides``, random weights, eval mode."""
    _, config_cls, model_cls = {**FAMILIES, **MOE_FAMILIES}[family]
    torch.manual_seed(seed)
    # A deep copy: transformers' configs write into the rope dict they are given (GLM-4.5's its partial rotary).
    config = copy.deepcopy({**TINY, **MOE_DEFAULTS.get(family, {}), **overrides})
    model = model_cls(config_cls(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def save_hf(model: torch.nn.Module, directory: Path, *, legacy_rope: bool = False) -> Path:
    """``model.save_pretrained(directory)``; with ``legacy_rope``, config.json carries ``rope_scaling`` and a
    top-level ``rope_theta`` instead of transformers-5 ``rope_parameters``."""
    model.save_pretrained(directory)
    if legacy_rope:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        rope = dict(config.pop("rope_parameters"))
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
        path.write_text(json.dumps(config))
    return directory


def hf_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long),
                    attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long))
    return out.logits.numpy()


def rel_err(ours: np.ndarray, ref: np.ndarray, keep: np.ndarray | None = None) -> float:
    """max |ours - ref| / max |ref| over the positions ``keep`` marks (all when None)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if keep is not None:
        ours, ref = ours[keep.astype(bool)], ref[keep.astype(bool)]
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def left_padded_batch(vocab: int, batch: int = 3, seq: int = 10, pad: int = 4, seed: int = 0
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Random ids and a mask whose row 0 is left-padded by ``pad`` tokens (ids 0 there)."""
    ids = np.random.default_rng(seed).integers(1, vocab, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[0, :pad], ids[0, :pad] = 0, 0
    return ids, mask
