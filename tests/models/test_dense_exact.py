"""Llama 3 and Qwen3 against transformers (PyTorch, CPU, float32): logits within relative 1e-5 over tiny random
checkpoints spanning GQA ratios (4:2, 4:1 = MQA, 4:4 = MHA), tied and untied embeddings, every rope type
(default, linear, llama3, yarn; read from ``rope_parameters`` and from the legacy ``rope_scaling``), ``head_dim``
unequal to ``hidden / heads``, attention biases, and a left-padded masked batch. Each checkpoint goes both ways:
transformers' ``save_pretrained`` -> our ``from_pretrained``, and ours -> transformers' ``from_pretrained``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo import AutoModelForCausalLM
from tests.models.dense_reference import FAMILIES, hf_logits, left_padded_batch, make_hf, rel_err, save_hf

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    # GQA 2 query heads per kv head, untied head, default rope.
    "gqa-untied-default": dict(hf=dict(), legacy_rope=False),
    # MQA (1 kv head), tied embeddings, linear rope read from the legacy rope_scaling, q/k/v/o biases.
    "mqa-tied-linear-bias": dict(hf=dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True,
                                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                          "factor": 4.0}), legacy_rope=True),
    # MHA, head_dim 16 != 32 / 4, the llama3 schedule.
    "mha-headdim-llama3": dict(hf=dict(num_key_value_heads=4, head_dim=16, rope_parameters=LLAMA3_ROPE),
                               legacy_rope=False),
    # YaRN from the legacy form, GQA, tied.
    "gqa-tied-yarn": dict(hf=dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
        legacy_rope=True),
}
TOL = 1e-5
ERRORS: dict[str, float] = {}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_round_trips(tmp_path, family, case):
    spec = CASES[case]
    seed = sorted(CASES).index(case)
    hf = make_hf(family, seed=seed, **spec["hf"])
    model = AutoModelForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf", legacy_rope=spec["legacy_rope"]))
    assert type(model) is FAMILIES[family][0]
    ids, mask = left_padded_batch(hf.config.vocab_size, seed=seed)

    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert ours.shape == (*ids.shape, hf.config.vocab_size)
    padded = rel_err(ours, hf_logits(hf, ids, mask), keep=mask)  # padding positions are not compared
    plain = rel_err(np.asarray(model(jnp.asarray(ids[1:]))), hf_logits(hf, ids[1:]))
    assert padded < TOL and plain < TOL, (padded, plain)

    model.save_pretrained(tmp_path / "ours")
    again = FAMILIES[family][2].from_pretrained(tmp_path / "ours").eval()
    back = rel_err(hf_logits(again, ids, mask), ours, keep=mask)
    assert back < TOL, back
    assert again.config.tie_word_embeddings == hf.config.tie_word_embeddings
    print(f"{family}/{case}: max relative error masked {padded:.2e}, unmasked {plain:.2e}, exported {back:.2e}")


def test_tied_embedding_gradient_equals_torch_autograd(tmp_path):
    """A tied table gets both gradients, the lookup's and the output head's: d/dE of ``sum(logits * R)`` (R a
    numpy-drawn cotangent) equals torch autograd's on transformers' tied Qwen3, within relative 1e-5 (float32),
    through ``model(ids)`` and through the trainer's path (``forward(with_logits=False)`` then
    ``output_head()``)."""
    import torch
    from flax import nnx

    hf = make_hf("qwen3", seed=11, tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    model = AutoModelForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"))
    assert model.lm_head is None
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf.config.vocab_size, (2, 6)).astype(np.int32)
    cotangent = rng.normal(size=(2, 6, hf.config.vocab_size)).astype(np.float32)

    hf.zero_grad()
    logits = hf(torch.as_tensor(ids, dtype=torch.long)).logits
    (logits * torch.as_tensor(cotangent)).sum().backward()
    expected = hf.model.embed_tokens.weight.grad.numpy()

    @nnx.jit
    def grads(model, ids, cotangent):
        def through_call(m):
            return jnp.sum(m(ids) * cotangent)

        def through_head(m):
            return jnp.sum(m.output_head()(m.forward(ids, with_logits=False).final_hidden) * cotangent)

        return [nnx.grad(f)(model).embed.embedding[...] for f in (through_call, through_head)]

    for path, ours in zip(("model(ids)", "output_head"), grads(model, jnp.asarray(ids), jnp.asarray(cotangent))):
        assert rel_err(np.asarray(ours), expected) < TOL, path
