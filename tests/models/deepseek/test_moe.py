"""The MoE block against HF's DeepseekV3MoE on many tokens: group-limited routing with a selection bias, the
weights, shared experts, both compute paths."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3Config as HFConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from nnx_zoo import DeepSeekV3Config
from nnx_zoo.models.deepseek import DeepSeekMoE
from tests.models.deepseek.hf_reference import BASE, rel_l2

ROUTINGS = {
    "groups4-top2groups-top3": dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    "groups2-top1group-top4-unnormalized": dict(n_group=2, topk_group=1, num_experts_per_tok=4, norm_topk_prob=False),
    "ungrouped-top2-scale1": dict(n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.0,
                                  n_shared_experts=2),
}


def _copy_hf_weights(ours: DeepSeekMoE, hf: DeepseekV3MoE, inner: int) -> None:
    def t(x: torch.Tensor) -> jnp.ndarray:
        return jnp.asarray(x.detach().numpy())

    ours.router[...] = t(hf.gate.weight).T
    ours.e_score_correction_bias[...] = t(hf.gate.e_score_correction_bias)
    gate_up = t(hf.experts.gate_up_proj)  # [E, 2I, H] (transformers-5 fused layout)
    ours.experts.wi_gate[...] = gate_up[:, :inner].transpose(0, 2, 1)
    ours.experts.wi_up[...] = gate_up[:, inner:].transpose(0, 2, 1)
    ours.experts.wo[...] = t(hf.experts.down_proj).transpose(0, 2, 1)
    for name in ("gate", "up", "down"):
        getattr(ours.shared_experts, name).kernel[...] = t(getattr(hf.shared_experts, f"{name}_proj").weight).T


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_moe_block_matches_hf(routing):
    kwargs = {**BASE, **ROUTINGS[routing]}
    torch.manual_seed(0)
    hf = DeepseekV3MoE(HFConfig(**kwargs)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn_like(p))
        hf.gate.e_score_correction_bias.copy_(0.2 * torch.rand_like(hf.gate.e_score_correction_bias))
    chosen = {}
    hf.gate.register_forward_hook(lambda _m, _i, out: chosen.__setitem__("idx", out[2].numpy()))
    x = torch.randn(4, 128, kwargs["hidden_size"])
    with torch.no_grad():
        ref = hf(x).numpy()

    for impl in ("dense", "gmm"):
        config = DeepSeekV3Config.from_hf({**kwargs, "num_nextn_predict_layers": 0}, moe_impl=impl)
        ours = DeepSeekMoE(config, rngs=nnx.Rngs(0))
        _copy_hf_weights(ours, hf, kwargs["moe_intermediate_size"])
        out, idx, _, _ = nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(x.numpy()))
        assert rel_l2(out, ref) < 1e-5, impl
        np.testing.assert_array_equal(np.sort(np.asarray(idx).reshape(-1, idx.shape[-1]), -1),
                                      np.sort(chosen["idx"], -1))
