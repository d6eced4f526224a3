"""Cached greedy decoding of Llama 3, Qwen3 and the MoE families on the same core (Qwen3-MoE, Mixtral):
``nnx_zoo.generate`` equals the no-cache argmax continuation (teacher-forced full forwards at the cache's rope
positions) and transformers' greedy ``generate`` on the same checkpoint, on a batch whose row 0 is left-padded;
the cache holds ``2 * kv_heads * head_dim`` values per token per layer."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_zoo import AutoModelForCausalLM, generate
from tests.models.dense_reference import FAMILIES, MOE_FAMILIES, left_padded_batch, make_hf, save_hf

NEW = 6


@pytest.mark.parametrize("family", list(FAMILIES) + list(MOE_FAMILIES))
def test_greedy_generation_matches_no_cache_and_transformers(tmp_path, family):
    mixed = {"mlp_only_layers": [0]} if family == "qwen3_moe" else {}  # a dense layer, then an MoE one
    hf = make_hf(family, seed=3, num_key_value_heads=1, head_dim=16, **mixed)
    model = AutoModelForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"))
    ids, mask = left_padded_batch(hf.config.vocab_size, batch=4, seq=7, pad=3, seed=1)

    out = generate(model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=NEW)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens[:, : ids.shape[1]], ids)
    np.testing.assert_array_equal(np.asarray(out.lengths), NEW)

    # No cache: full forwards over the prompt plus the tokens so far, at positions that count real tokens. Causal
    # attention lets one fixed length serve every step (the slots not yet generated cannot affect earlier ones).
    forward = nnx.jit(lambda m, s, k, p: m(s, k, position_ids=p))
    seq = np.concatenate([ids, np.zeros((4, NEW), np.int32)], 1)
    seq_mask = np.concatenate([mask, np.ones((4, NEW), np.int32)], 1)
    positions = jnp.asarray(np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0))
    for step in range(NEW):
        last = ids.shape[1] + step - 1
        logits = forward(model, jnp.asarray(seq), jnp.asarray(seq_mask), positions)
        seq[:, last + 1] = np.asarray(jnp.argmax(logits[:, last], axis=-1))
    np.testing.assert_array_equal(tokens, seq)

    with torch.no_grad():
        theirs = hf.generate(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    np.testing.assert_array_equal(tokens, theirs.numpy())

    cache = model.init_cache(4, 16)
    assert cache.bytes_per_token_per_layer() == 2 * 1 * 16 * 4  # k and v, one kv head of 16 float32 values
