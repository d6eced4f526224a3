"""Llama3Config: the presets hold the published sizes (parameter counts equal transformers' LlamaForCausalLM built
from our config.json on the meta device, and the published totals), the llama3 rope of 3.1 / 3.2, and Llama's
own HF refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nnx_zoo import Llama3Config
from nnx_zoo.layers.rope import Llama3Scaling

PUBLISHED = {  # total parameters of the released checkpoints
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", sorted(Llama3Config.PRESETS))
def test_preset_counts_equal_transformers(name):
    config = Llama3Config.preset(name)
    with torch.device("meta"):
        theirs = LlamaForCausalLM(LlamaConfig.from_dict(config.to_hf_dict()))
    assert config.num_parameters().total == sum(p.numel() for p in theirs.parameters())
    if name in PUBLISHED:
        assert config.num_parameters().total == PUBLISHED[name]
        assert (config.vocab_size, config.num_key_value_heads, config.rope_theta) == (128256, 8, 500000.0)
        assert config.rope_scaling == Llama3Scaling(32.0 if "3.2" in name else 8.0, 1.0, 4.0, 8192)
        assert config.tie_word_embeddings == ("3.2" in name)


def test_llama_hf_refusals():
    base = Llama3Config.preset("llama3-tiny").to_hf_dict()
    with pytest.raises(ValueError, match="mlp_bias"):
        Llama3Config.from_hf({**base, "mlp_bias": True})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        Llama3Config.from_hf({**base, "hidden_act": "gelu"})
