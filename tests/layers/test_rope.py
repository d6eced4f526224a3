"""RoPE against Hugging Face's implementation: every rope type's frequencies and cos/sin scaling (read from both
HF config forms), both rotation layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nnx_zoo.layers.rope import (
    LinearScaling,
    Llama3Scaling,
    YarnScaling,
    apply_rope,
    rope_cos_sin,
    rope_frequencies,
    rope_from_hf,
    rope_to_hf,
    yarn_softmax_multiplier,
)

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


# ---- Llama / Qwen rope types, read from both HF config forms ----

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
ROPE_CASES = {  # name: (rope_theta, rope dict or None)
    "default": (1_000_000.0, None),  # Qwen3
    "linear": (10_000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3": (500_000.0, LLAMA31),  # Llama 3.1
    "llama3-3.2": (500_000.0, dict(LLAMA31, factor=32.0)),  # Llama 3.2
    "yarn": (1_000_000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn-legacy-type": (10_000.0, {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 16.0, "attention_factor": 1.25}),
}


def _reference(config: LlamaConfig) -> tuple[np.ndarray, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config)
    return inv_freq.numpy(), factor


def _llama(**kwargs) -> LlamaConfig:
    return LlamaConfig(**{"hidden_size": 256, "num_attention_heads": 2, "head_dim": 128,
                          "max_position_embeddings": 131072, **kwargs})


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
def test_rope_types_match_transformers_in_both_config_forms(name, form):
    theta, rope = ROPE_CASES[name]
    if form == "rope_parameters":  # transformers 5: one dict holding rope_type and rope_theta
        raw = {"rope_parameters": dict(rope or {"rope_type": "default"}, rope_theta=theta)}
    else:  # hub checkpoints: rope_scaling (None for the default schedule) next to a top-level rope_theta
        raw = {"rope_scaling": None if rope is None else dict(rope), "rope_theta": theta}
    config = _llama(**raw)
    want_freq, want_factor = _reference(config)
    for source in (raw, config.to_dict()):  # the dict as written, and as transformers writes it back
        got_theta, scaling = rope_from_hf(dict(source, max_position_embeddings=131072))
        inv_freq, factor = rope_frequencies(128, got_theta, scaling)
        assert got_theta == theta
        assert type(scaling).__name__ == {"default": "NoneType", "linear": "LinearScaling",
                                          "llama3": "Llama3Scaling", "yarn": "YarnScaling"}[name.split("-")[0]]
        np.testing.assert_allclose(inv_freq, want_freq, rtol=1e-6)
        assert factor == pytest.approx(want_factor, rel=1e-12)
    # What we write (legacy keys) transformers reads back to the same schedule.
    written = _llama(**rope_to_hf(got_theta, scaling))
    np.testing.assert_allclose(_reference(written)[0], want_freq, rtol=1e-6)
    assert rope_from_hf(rope_to_hf(got_theta, scaling)) == (got_theta, scaling)


def test_llama3_scaling_covers_all_three_bands():
    """Llama 3.1's dims 128 / theta 5e5 / 8192 context put frequencies in all three bands: kept, divided by the
    factor, and smoothly interpolated between (so the test above checks each branch)."""
    plain, _ = rope_frequencies(128, 500_000.0)
    scaled, _ = rope_frequencies(128, 500_000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    ratio = plain / scaled
    assert (ratio == 1).sum() > 0 and np.isclose(ratio, 8).sum() > 0
    assert ((ratio > 1.01) & (ratio < 7.99)).sum() > 0
    linear, _ = rope_frequencies(128, 500_000.0, LinearScaling(8.0))
    np.testing.assert_allclose(plain / linear, 8, rtol=1e-6)


def test_rope_reader_precedence_and_defaults():
    # A non-empty rope_scaling wins over rope_parameters; a rope_theta inside the rope dict over the top level.
    theta, scaling = rope_from_hf({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 7.0},
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 5.0},
                                   "rope_theta": 3.0})
    assert (theta, scaling) == (7.0, LinearScaling(2.0))
    assert rope_from_hf({}) == (10000.0, None)
    assert rope_from_hf({"rope_theta": 5e5, "rope_scaling": None}) == (5e5, None)
    # As in transformers: llama3/yarn without original_max_position_embeddings take max_position_embeddings,
    # and a top-level original_max_position_embeddings wins over the rope dict's.
    _, scaling = rope_from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 512})
    assert scaling.original_max_position_embeddings == 512
    ref = _llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=512)
    np.testing.assert_allclose(rope_frequencies(128, 10000.0, scaling)[0], _reference(ref)[0], rtol=1e-6)
    _, scaling = rope_from_hf({"rope_scaling": dict(LLAMA31), "original_max_position_embeddings": 1024})
    assert scaling.original_max_position_embeddings == 1024


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope type 'dynamic' is not supported; supported types are"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, "needs 'low_freq_factor'"),
    ({"rope_type": "linear"}, "linear rope needs 'factor'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial rotary embeddings are not supported"),
])
def test_unsupported_or_incomplete_rope_is_a_clear_error(rope, message):
    with pytest.raises(ValueError, match=message):
        rope_from_hf({"rope_parameters": rope, "max_position_embeddings": 64})
