"""DeepSeekV3 against Hugging Face transformers' DeepseekV3ForCausalLM, and with V2 routers against
DeepseekV2ForCausalLM (CPU, float32).

Each case builds a random tiny HF model, saves it with ``save_pretrained``, loads it with our
``from_pretrained`` and compares logits (relative L2 < 1e-5), every hidden state HF exposes, and every MoE
layer's chosen experts (as sets: both sides pick top-k unsorted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3
from tests.models.deepseek.hf_reference import YARN, case_builder, rel_l2

YARN_NO_MSCALE = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 16,
                  "beta_slow": 2}
V2_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
           "mscale": 0.707, "mscale_all_dim": 0.707}  # V2's own mscales (softmax scale * mscale ** 2)

CASES = {
    # q_lora set, YaRN in the hub's legacy config layout, interleaved rope, group-limited routing with a random
    # selection bias, attention biases.
    "qlora-yarn-legacy-interleaved": dict(hf=dict(rope_scaling=YARN, attention_bias=True), legacy_rope=True),
    # no q_lora (a single q_proj), YaRN via transformers-5 rope_parameters, rotate-half rope, unnormalized weights.
    "noqlora-yarn-ropeparams-halfrot": dict(hf=dict(q_lora_rank=None, rope_scaling=YARN, rope_interleave=False,
                                                    norm_topk_prob=False)),
    # dense only (first_k_dense_replace == num_hidden_layers), default rope.
    "dense-only": dict(hf=dict(num_hidden_layers=2, first_k_dense_replace=2)),
    # a left-padded batch with an attention mask; tied embeddings; YaRN without mscale keys (0.1 ln f + 1 on
    # cos/sin and no softmax correction); two shared experts; one group of two.
    "left-padded-tied": dict(hf=dict(tie_word_embeddings=True, rope_scaling=YARN_NO_MSCALE, n_shared_experts=2,
                                     n_group=2, topk_group=1, num_hidden_layers=3, first_k_dense_replace=0),
                             padded=True),
    # no group limit (n_group = topk_group = 1), top-2, rotate-half rope, no shared-expert scaling quirks.
    "ungrouped-top2": dict(hf=dict(n_group=1, topk_group=1, num_experts_per_tok=2, rope_interleave=False,
                                   routed_scaling_factor=1.0, q_lora_rank=12)),
    # DeepSeek-V2 (transformers' DeepseekV2ForCausalLM; checkpoints as its save_pretrained writes them): softmax
    # routing, no selection bias, weights never renormalised.
    # V2-Lite-like: greedy top-1 of 8, a single q_proj, V2's YaRN in the hub's legacy layout, one dense layer.
    "v2-greedy-noqlora-top1-e8": dict(hf=dict(arch="v2", topk_method="greedy", q_lora_rank=None,
                                              num_experts_per_tok=1, rope_scaling=V2_YARN), legacy_rope=True),
    # V2-like: group-limited (group score = its best expert) top-2 of 16 in 2 of 4 groups, q_lora, V2's scaling
    # factor 16, two shared experts, attention biases, no dense layer; a left-padded batch.
    "v2-grouped-qlora-top2-e16-padded": dict(hf=dict(
        arch="v2", topk_method="group_limited_greedy", n_routed_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=16.0,
        attention_bias=True), padded=True),
    # group-limited top-4 of 16 in 3 of 8 groups (of 2), two dense layers of four.
    "v2-grouped-top4-e16-dense2": dict(hf=dict(
        arch="v2", topk_method="group_limited_greedy", n_routed_experts=16, n_group=8, topk_group=3,
        num_experts_per_tok=4, num_hidden_layers=4, first_k_dense_replace=2, q_lora_rank=12)),
}

BATCH, SEQ = 2, 9


@nnx.jit
def forward(model: DeepSeekV3, ids: jax.Array, mask: jax.Array | None):
    return model.forward(ids, mask, with_hidden_states=True, with_routing=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case name -> (checkpoint dir, HF model, HF outputs, ids, mask); each HF model is built and run once."""
    return case_builder(CASES, tmp_path_factory, batch=BATCH, seq=SEQ)


def assert_matches_hf(out, ref: dict, mask: np.ndarray | None) -> None:
    assert rel_l2(out.logits, ref["logits"]) < 1e-5
    hidden = ref["hidden_states"]  # (embeddings, outputs of layers 0..L-2, final normed)
    ours = list(out.hidden_states)  # the same layout
    assert len(ours) == len(hidden)
    for i, (a, b) in enumerate(zip(ours, hidden)):
        assert rel_l2(a, b) < 1e-5, f"hidden state {i}"
    experts = ref["experts"]
    if not experts:
        assert out.expert_indices is None
        return
    real = np.ones(out.logits.shape[:2], bool) if mask is None else mask.astype(bool)
    assert out.expert_indices.shape[0] == len(experts)
    for layer, (a, b) in enumerate(zip(np.asarray(out.expert_indices), experts)):
        a = np.sort(a.reshape(-1, a.shape[-1]), axis=-1)[real.reshape(-1)]
        b = np.sort(b, axis=-1)[real.reshape(-1)]
        np.testing.assert_array_equal(a, b, err_msg=f"experts of MoE layer {layer}")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_hf(built, name):
    path, _, ref, ids, mask = built(name)
    model = DeepSeekV3.from_pretrained(path, moe_impl="dense")
    out = forward(model, jnp.asarray(ids), None if mask is None else jnp.asarray(mask))
    assert_matches_hf(out, ref, mask)


@pytest.mark.parametrize("name", ["qlora-yarn-legacy-interleaved", "v2-grouped-top4-e16-dense2"])
def test_gmm_equals_dense_and_hf(built, name):
    path, _, ref, ids, mask = built(name)
    dense = forward(DeepSeekV3.from_pretrained(path, moe_impl="dense"), jnp.asarray(ids), None)
    gmm = forward(DeepSeekV3.from_pretrained(path, moe_impl="gmm"), jnp.asarray(ids), None)
    np.testing.assert_array_equal(np.asarray(gmm.expert_indices), np.asarray(dense.expert_indices))
    np.testing.assert_allclose(np.asarray(gmm.logits), np.asarray(dense.logits), rtol=1e-5, atol=1e-5)
    assert_matches_hf(gmm, ref, None)


def test_scanned_equals_unscanned(built):
    path, _, ref, ids, mask = built("left-padded-tied")
    args = (jnp.asarray(ids), jnp.asarray(mask))
    scanned = forward(DeepSeekV3.from_pretrained(path, moe_impl="gmm", scan_layers=True), *args)
    unrolled = forward(DeepSeekV3.from_pretrained(path, moe_impl="gmm", scan_layers=False), *args)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert_matches_hf(unrolled, ref, mask)
