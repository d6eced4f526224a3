"""A tiny random Hugging Face Kimi Linear model (PyTorch, CPU, float32, eager attention) for the family's tests.

``make_hf()`` builds transformers' ``KimiLinearForCausalLM`` with every weight drawn at random (the RMSNorms' and
the gated output norm's weights around 1, ``A_log`` / ``dt_bias`` so decays spread over their range, the router's
selection bias large enough to change choices), four layers: KDA, KDA, KDA, MLA; layer 0 dense, the rest MoE.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            n_group=2, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True, rms_norm_eps=1e-5,
            max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3], "num_heads": 2,
                                                    "head_dim": 8, "short_conv_kernel_size": 4})
SCALE = 0.15  # other weights: N(0, SCALE)


def make_hf(seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' Kimi Linear with ``overrides``, random weights, eval mode, eager attention."""
    config = KimiLinearConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = KimiLinearForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(SCALE * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def hf_outputs(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """transformers' logits, hidden states ``[layers + 1, b, s, embed]`` and each MoE layer's chosen experts
    ``[moe_layers, b, s, k]`` (recomputed from its router logits with the router's own rule)."""
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True, output_router_logits=True,
                    attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long))
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    experts = []
    for router, logits in zip(routers, out.router_logits):
        scores = logits.sigmoid() + router.e_score_correction_bias
        groups = scores.view(-1, router.num_group, router.num_experts // router.num_group).topk(2, -1)[0].sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(router.topk_group, -1)[1], 1)
        keep = keep.repeat_interleave(router.num_experts // router.num_group, -1).bool()
        idx = scores.masked_fill(~keep, float("-inf")).topk(router.top_k, -1)[1]
        experts.append(idx.sort(-1).values.reshape(*ids.shape, -1).numpy())
    return {"logits": out.logits.numpy(), "hidden": np.stack([h.numpy() for h in out.hidden_states]),
            "experts": np.stack(experts)}
