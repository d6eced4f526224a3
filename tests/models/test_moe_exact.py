"""Qwen3-MoE, Mixtral, GLM-4.5 and MiniMax-M2 against transformers (PyTorch, CPU, float32): logits within relative
1e-5 on tiny random checkpoints spanning renormalised and raw top-k weights, top-k 1, 2 and 4, 8 and 16 experts,
dense layers mixed in (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``, GLM-4.5's
``first_k_dense_replace``), for GLM-4.5 partial rotary (0.5 and 0.25), q/k/v biases on and off, q/k norm on and
off, one or two shared experts and group-limited sigmoid + bias routing with ``routed_scaling_factor``, and for
MiniMax-M2 its full-width q/k norm, rope on a quarter of each head (``rotary_dim``) and sigmoid routing with a
selection-only bias, on a left-padded masked batch and an unpadded one. Each case also checks the Switch
load-balancing loss (``aux_loss`` = ``router_aux_loss_coef`` x transformers' ``outputs.aux_loss``, padded and not;
MiniMax-M2's on the softmax of its sigmoid router's logits, as transformers computes it; GLM-4.5 has none in
transformers, nor here) and goes both ways: transformers' ``save_pretrained`` (per-expert keys, what transformers 5
writes) -> our ``from_pretrained``, ours -> transformers. A checkpoint in
transformers-5's fused expert layout loads too (each family; GLM-4.5's top-1 with tied embeddings), every
``moe_impl`` path gives the same logits on it, and LoRA on the routed experts merges into the weights it adapted.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nnx_zoo import AutoModelForCausalLM
from tests.models.dense_reference import MOE_FAMILIES, left_padded_batch, make_hf, rel_err, save_hf

CASES = {
    "qwen3_moe": {
        # 8 experts, top-2 renormalised, layer 0 dense (mlp_only_layers): a dense stack then an MoE stack.
        "e8-top2-norm-dense0": dict(num_hidden_layers=3, mlp_only_layers=[0]),
        # 16 experts, top-4 raw probabilities, every second layer sparse: dense, MoE, dense (three runs).
        "e16-top4-raw-step2": dict(num_hidden_layers=3, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                                   decoder_sparse_step=2),
        # top-1, raw (the weight is the winning probability), tied embeddings.
        "e8-top1-raw-tied": dict(num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=True),
    },
    "mixtral": {
        "e8-top2": dict(),
        "e16-top4": dict(num_local_experts=16, num_experts_per_tok=4),
        "e8-top1-mqa": dict(num_experts_per_tok=1, num_key_value_heads=1),
    },
    "glm4_moe": {
        # Dense layer 0, then 8 experts in 2 groups (1 kept), top-2 renormalised x 2.5, q/k norm, biases, rope 0.5.
        "e8-top2-groups-qknorm": dict(num_hidden_layers=3, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                      use_qk_norm=True),
        # 16 experts in 4 groups (2 kept), top-4 raw, 2 shared, no dense layer, no biases, rope on a quarter.
        "e16-top4-raw-shared2": dict(n_routed_experts=16, num_experts_per_tok=4, norm_topk_prob=False, n_group=4,
                                     topk_group=2, n_shared_experts=2, first_k_dense_replace=0, attention_bias=False,
                                     head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.25}),
    },
    "minimax_m2": {
        # 3 layers of 16 experts top-4 (sigmoid, selection bias, renormalised), rope on 2 of 8 dims (rotary_dim).
        "e16-top4-rotary2": dict(num_hidden_layers=3, num_local_experts=16, num_experts_per_tok=4, rotary_dim=2),
    },
}
# The fused-layout test's settings per family (on top of dense_reference's tiny ones). GLM-4.5's is top-1 with tied
# embeddings, once an exactness case here ("e8-top1-tied", its checkpoint fused): the fused test checks its logits
# under every moe_impl (and LoRA), the other GLM-4.5 cases the export, aux loss and unpadded batch it also had.
FUSED = {"qwen3_moe": dict(num_experts_per_tok=2), "mixtral": dict(num_experts_per_tok=2),
         "glm4_moe": dict(num_experts_per_tok=1, tie_word_embeddings=True), "minimax_m2": dict(num_experts_per_tok=2)}
# LoRA (family-agnostic: one module tree, one lora_targets) runs on one family's fused model: GLM-4.5's, whose
# attention has the most to merge into (q/k/v biases, partial rotary) and which has a dense layer before the MoE ones.
LORA_FAMILY = "glm4_moe"
GLM_FIELDS = ("first_k_dense_replace", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
              "use_qk_norm", "attention_bias", "rope_parameters")
NO_AUX_LOSS = {"glm4_moe"}  # transformers computes no router aux loss for these
TOL = 1e-5


def _hf_outputs(hf, ids: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, float]:
    """transformers' logits and weighted aux loss (``router_aux_loss_coef * outputs.aux_loss``; None without one)."""
    with torch.no_grad():
        out = hf(torch.as_tensor(ids, dtype=torch.long), output_router_logits=True,
                 attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long))
    if getattr(out, "aux_loss", None) is None:
        return out.logits.numpy(), None
    return out.logits.numpy(), hf.config.router_aux_loss_coef * float(out.aux_loss)


@pytest.mark.parametrize(("family", "case"), [(f, c) for f, cases in CASES.items() for c in cases])
def test_logits_aux_loss_and_round_trips(tmp_path, family, case):
    seed = list(CASES[family]).index(case)
    hf = make_hf(family, seed=seed, **CASES[family][case])
    aux = {} if family in NO_AUX_LOSS else {"output_router_logits": True}
    model = AutoModelForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), **aux)
    assert type(model) is MOE_FAMILIES[family][0]
    ids, mask = left_padded_batch(hf.config.vocab_size, seed=seed)

    out = model.forward(jnp.asarray(ids), jnp.asarray(mask))
    want_logits, want_aux = _hf_outputs(hf, ids, mask)
    padded = rel_err(np.asarray(out.logits), want_logits, keep=mask)  # padding positions are not compared
    plain_out = model.forward(jnp.asarray(ids[1:]))
    plain_logits, plain_aux = _hf_outputs(hf, ids[1:], None)
    plain = rel_err(np.asarray(plain_out.logits), plain_logits)
    assert padded < TOL and plain < TOL, (padded, plain)
    if family in NO_AUX_LOSS:
        assert out.aux_loss is plain_out.aux_loss is want_aux is plain_aux is None
    else:
        np.testing.assert_allclose([float(out.aux_loss), float(plain_out.aux_loss)], [want_aux, plain_aux],
                                   rtol=1e-5)

    model.save_pretrained(tmp_path / "ours")
    again = MOE_FAMILIES[family][2].from_pretrained(tmp_path / "ours").eval()
    back = rel_err(_hf_outputs(again, ids, mask)[0], np.asarray(out.logits), keep=mask)
    assert back < TOL, back
    for name in ("num_experts_per_tok", "num_local_experts", "norm_topk_prob", "mlp_only_layers",
                 "decoder_sparse_step", "tie_word_embeddings") + GLM_FIELDS * (family == "glm4_moe") + (
                     "rotary_dim", "rope_parameters") * (family == "minimax_m2"):
        assert getattr(again.config, name, None) == getattr(hf.config, name, None), name
    print(f"{family}/{case}: max relative error masked {padded:.2e}, unmasked {plain:.2e}, exported {back:.2e}")


def _save_fused(hf, directory):
    """transformers' in-memory state dict (fused experts ``mlp.experts.gate_up_proj`` / ``down_proj``) written as a
    checkpoint, with its config.json."""
    state = {k: v.contiguous().clone() for k, v in hf.state_dict().items()}  # a tied head: its own copy
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # the fused layout, in memory
    directory.mkdir()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf.config.to_dict()))
    return directory


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fused_expert_layout_loads_and_every_moe_impl_agrees(tmp_path, family):
    """transformers-5's in-memory (fused) state dict written as a checkpoint loads to the same logits as the
    per-expert one; ``moe_impl`` ``dense``, ``gmm`` and ``ep`` (no mesh: its local path) agree with transformers;
    LoRA on the routed experts merges (``LORA_FAMILY``)."""
    hf = make_hf(family, seed=5, **FUSED[family])
    fused = _save_fused(hf, tmp_path / "fused")
    ids, mask = left_padded_batch(hf.config.vocab_size, seed=2)
    want = _hf_outputs(hf, ids, mask)[0]
    for impl in ("dense", "gmm", "ep"):
        model = AutoModelForCausalLM.from_pretrained(fused, moe_impl=impl)
        err = rel_err(np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))), want, keep=mask)
        assert err < TOL, (impl, err)
    if family == LORA_FAMILY:
        _lora_on_experts_merges(model, jnp.asarray(ids))


def _lora_on_experts_merges(model, ids) -> None:
    """LoRA with the routed experts (``EXPERTS_PATTERN``): adapters with non-zero ``B`` change the logits, and
    ``merge_lora`` folds them in with the same logits."""
    import jax
    from flax import nnx

    from nnx_zoo import apply_lora, merge_lora
    from nnx_zoo.layers.lora import EXPERTS_PATTERN, LoRAParam

    base = np.asarray(model(ids))
    paths = apply_lora(model, pattern=model.lora_targets + "|" + EXPERTS_PATTERN, rank=4)
    assert "layers/mlp/experts" in paths and "layers/attn/q_proj" in paths
    adapters = nnx.state(model, LoRAParam)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    nnx.update(model, jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), adapters))
    adapted = np.asarray(model(ids))
    assert rel_err(adapted, base) > 1e-3
    assert merge_lora(model) == len(paths)
    assert rel_err(np.asarray(model(ids)), adapted) < TOL


def test_refused_settings_are_named(tmp_path):
    from nnx_zoo import MixtralConfig, Qwen3MoEConfig
    from nnx_zoo.hf import CheckpointFormatError

    base = MixtralConfig.preset("mixtral-tiny").to_hf_dict()
    for key, value, words in (("sliding_window", 4096, "sliding_window=4096 is not supported"),
                              ("router_jitter_noise", 0.01, "router_jitter_noise=0.01 is not supported")):
        with pytest.raises(ValueError, match=words):
            MixtralConfig.from_hf({**base, key: value})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**Qwen3MoEConfig.preset("qwen3-moe-tiny").to_hf_dict(), "use_sliding_window": True}))
    with pytest.raises(CheckpointFormatError, match="sliding-window attention"):
        Qwen3MoEConfig.from_hf(path)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..8"):
        Qwen3MoEConfig.preset("qwen3-moe-tiny", num_experts_per_tok=9)
    # GLM-4.5: transformers computes no aux loss for it, so asking for one is refused; its MTP layers on disk
    # (model.layers.{num_hidden_layers}.*) are skipped on load, as transformers skips them.
    from nnx_zoo import Glm4MoE, Glm4MoEConfig

    with pytest.raises(ValueError, match="no auxiliary loss for GLM-4.5"):
        Glm4MoEConfig.preset("glm4.5-tiny", output_router_logits=True)
    skipped = Glm4MoE.key_table(Glm4MoEConfig.preset("glm4.5-air")).skipped()
    assert skipped.search("model.layers.46.eh_proj.weight") and not skipped.search("model.layers.45.mlp.gate.weight")
    # A family's expert map (class keyword experts=) must name fields it has: a misspelt one fails at class creation.
    from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig

    with pytest.raises(TypeError, match="names no field 'num_expert'"):
        class Misspelt(MoEDecoderConfig, experts=ExpertFields("num_expert", "intermediate_size", True)):
            pass



def test_batch_split_gives_transformers_logits_and_aux_loss(tmp_path):
    """``batch_split_factor=2``: each MoE layer runs on two micro-batches (rows 0, 2 and 1, 3) with its weights
    gathered once; the logits and the pooled Switch loss are transformers', as without the split."""
    hf = make_hf("qwen3_moe", seed=3, num_hidden_layers=3, mlp_only_layers=[0])
    path = save_hf(hf, tmp_path / "hf")
    ids, mask = left_padded_batch(hf.config.vocab_size, batch=4, seed=4)
    want, want_aux = _hf_outputs(hf, ids, mask)
    for impl in ("dense", "gmm"):
        model = AutoModelForCausalLM.from_pretrained(path, batch_split_factor=2, output_router_logits=True,
                                                     moe_impl=impl)
        out = model.forward(jnp.asarray(ids), jnp.asarray(mask))
        assert rel_err(np.asarray(out.logits), want, keep=mask) < TOL, impl
        np.testing.assert_allclose(float(out.aux_loss), want_aux, rtol=1e-5)
