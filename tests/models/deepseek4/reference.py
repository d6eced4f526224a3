"""Tiny DeepSeek-V4 models of transformers' ``DeepseekV4ForCausalLM`` with every weight and buffer random (sinks,
compressor biases, hyper-connection bases and scales, selection biases and hash tables included, which
transformers initializes to zeros or constants), so that each of V4's parts acts; and their outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DeepseekV4Config as HFConfig
from transformers import DeepseekV4ForCausalLM

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH, TOPK = "hash_moe", "moe"
# Layer schedules like V4-Flash's (sliding-only layers, then CSA / HCA alternating) and V4-Pro's (HCA first).
SCHEDULES = {
    "flash": dict(layer_types=[SLIDING, SLIDING, CSA, HCA, CSA], mlp_layer_types=[HASH, HASH, TOPK, TOPK, TOPK]),
    "pro": dict(layer_types=[HCA, HCA, CSA, HCA], mlp_layer_types=[HASH, HASH, HASH, TOPK]),
    # One layer of each attention type: the smallest model where every part acts (the parts-off test).
    "parts": dict(layer_types=[SLIDING, CSA, HCA], mlp_layer_types=[HASH, TOPK, TOPK]),
}
# A window of 5 tokens, CSA entries every 2 tokens of which the indexer keeps 3, HCA entries every 4, 3 streams,
# YaRN on the compressed layers' rope, a clamp the experts' pre-activations reach.
TINY = dict(vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4, head_dim=16,
            q_lora_rank=12, partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=6,
            compress_rates={CSA: 2, HCA: 4}, hc_mult=3, sliding_window=5, o_groups=2, o_lora_rank=8, index_n_heads=8,
            index_head_dim=8, index_topk=3, swiglu_limit=1.0, max_position_embeddings=64, num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32, "beta_slow": 1})


def hf_config(schedule: str, **overrides: Any) -> HFConfig:
    layers = SCHEDULES[schedule]
    return HFConfig(num_hidden_layers=len(layers["layer_types"]), **layers, **{**TINY, **overrides})


def make_hf_model(config: HFConfig, seed: int) -> DeepseekV4ForCausalLM:
    """transformers' model with every parameter and buffer drawn at random (float32, eval mode)."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval().float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim < 2 else 0.3))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # distinct experts per token
                b.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:b.shape[1]]
                                     for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return model


def hf_outputs(model: DeepseekV4ForCausalLM, ids: np.ndarray) -> dict[str, Any]:
    """Logits, hidden states (each layer's input streams, then the final normed state) and each layer's chosen
    experts (sorted, ``[layers, batch, seq, k]``) of transformers' model on ``ids [batch, seq]``."""
    chosen: list[np.ndarray] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: chosen.append(out[2].numpy()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(ids), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    batch, seq = ids.shape
    experts = np.stack([np.sort(c.reshape(batch, seq, -1), axis=-1) for c in chosen])
    return dict(logits=out.logits.numpy(), hidden=[h.numpy() for h in out.hidden_states], experts=experts)


def save_hf(model: DeepseekV4ForCausalLM, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference relative to the largest magnitude of ``b``."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) / np.max(np.abs(b)))
