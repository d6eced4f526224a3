"""Qwen3Config: the presets hold the published sizes (parameter counts equal transformers' Qwen3ForCausalLM built
from our config.json on the meta device; non-embedding counts as on the model cards), and Qwen3's own HF
refusals (sliding-window attention)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config as HFQwen3Config
from transformers import Qwen3ForCausalLM

from nnx_zoo import Qwen3Config

NON_EMBEDDING_BILLIONS = {"qwen3-0.6b": 0.44, "qwen3-1.7b": 1.4, "qwen3-4b": 3.6, "qwen3-8b": 6.95,
                          "qwen3-14b": 13.2, "qwen3-32b": 31.2}  # the model cards' figures


@pytest.mark.parametrize("name", sorted(Qwen3Config.PRESETS))
def test_preset_counts_equal_transformers(name):
    config = Qwen3Config.preset(name)
    with torch.device("meta"):
        theirs = Qwen3ForCausalLM(HFQwen3Config.from_dict(config.to_hf_dict()))
    counts = config.num_parameters()
    assert counts.total == sum(p.numel() for p in theirs.parameters())
    if name in NON_EMBEDDING_BILLIONS:
        tables = 1 if config.tie_word_embeddings else 2
        non_embedding = (counts.total - tables * counts.embedding) / 1e9
        card = NON_EMBEDDING_BILLIONS[name]
        assert round(non_embedding, len(str(card).split(".")[1])) == card  # to the card's precision
        assert (config.vocab_size, config.head_dim, config.num_key_value_heads, config.rope_theta) == (
            151936, 128, 8, 1e6)
        assert config.tie_word_embeddings == (name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"))


def test_sliding_window_is_refused():
    base = Qwen3Config.preset("qwen3-tiny").to_hf_dict()
    for bad in ({"use_sliding_window": True, "sliding_window": 8},
                {"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]}):
        with pytest.raises(ValueError, match="sliding-window attention"):
            Qwen3Config.from_hf({**base, **bad})
    assert Qwen3Config.from_hf({**base, "layer_types": ["full_attention"] * 4}) == Qwen3Config.preset("qwen3-tiny")
