"""RoPE against Hugging Face's implementation: YaRN frequencies and cos/sin scaling, both rotation layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from nnx_zoo.layers.rope import YarnScaling, apply_rope, rope_cos_sin, rope_frequencies, yarn_softmax_multiplier

SCALINGS = [
    None,
    {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.707,
     "mscale_all_dim": 0.707},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_frequencies_and_scales_match_hf(scaling):
    config = DeepseekV3Config(qk_rope_head_dim=64, rope_theta=10000.0, rope_scaling=scaling,
                              max_position_embeddings=163840)
    ours = None if scaling is None else YarnScaling.from_dict(scaling)
    inv_freq, factor = rope_frequencies(64, 10000.0, ours)
    if scaling is None:
        ref_freq, ref_factor = hf.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(config)
    else:
        ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    np.testing.assert_allclose(inv_freq, ref_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    assert 128**-0.5 * yarn_softmax_multiplier(ours) == pytest.approx(
        hf.yarn_apply_mscale(config.rope_parameters, 128**-0.5), rel=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_matches_hf(interleaved):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 7, 3, 16)).astype(np.float32)  # [batch, seq, heads, dim]
    inv_freq, factor = rope_frequencies(16, 500.0, YarnScaling(factor=4.0, original_max_position_embeddings=8))
    positions = np.arange(7)[None].repeat(2, 0)
    cos, sin = rope_cos_sin(positions, inv_freq, factor)
    ours = np.asarray(apply_rope(q, cos, sin, interleaved=interleaved))
    cos_t = torch.as_tensor(np.concatenate([np.asarray(cos)] * 2, -1))
    sin_t = torch.as_tensor(np.concatenate([np.asarray(sin)] * 2, -1))
    q_t = torch.as_tensor(q).transpose(1, 2)  # HF: [batch, heads, seq, dim]
    rotate = hf.apply_rotary_pos_emb_interleave if interleaved else hf.apply_rotary_pos_emb
    ref, _ = rotate(q_t, q_t, cos_t, sin_t)
    np.testing.assert_allclose(ours, ref.transpose(1, 2).numpy(), rtol=1e-6, atol=1e-6)
