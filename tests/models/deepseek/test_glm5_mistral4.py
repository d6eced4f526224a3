"""GLM-5 (``glm_moe_dsa``) and Mistral 4 (``mistral4``), the families built on DeepSeek's parts, against
transformers' ``GlmMoeDsaForCausalLM`` / ``Mistral4ForCausalLM`` (CPU, float32).

Exact: logits and every hidden state within 1e-5 relative, each MoE layer's experts equal, on a left-padded batch
and an unpadded one; GLM-5 with every kind of layer (dense / MoE, with an indexer / reusing the previous one's
top-k, runs of one and of two shared layers), its indexer choosing 5 of up to 12 keys; Mistral 4 with its YaRN and
its query scale spanning several steps, its group-limited softmax router, rope pairs and halves. Each distinctive
part moves the logits when turned off, so the configs exercise it. Export reloads in transformers with the same
logits and the family's own config keys; cached greedy decoding equals the uncached continuation and transformers'
``generate``. The presets validate, round-trip through transformers' config classes and count the published sizes.
"""

from __future__ import annotations

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import GlmMoeDsaConfig as HFGlm5Config
from transformers import GlmMoeDsaForCausalLM, Mistral4ForCausalLM
from transformers import Mistral4Config as HFMistral4Config

from nnx_zoo import AutoModelForCausalLM, Glm5, Glm5Config, Mistral4, Mistral4Config, generate
from tests.models.deepseek.hf_reference import MISTRAL4_ROPE, YARN, case_builder, hf_outputs, padded_inputs, rel_l2
from tests.models.deepseek.test_parity import forward

BATCH, SEQ = 2, 12
CASES = {
    # 4 layers: dense + indexer, dense reusing it, MoE + indexer, MoE reusing it (each kind of stack); 5 of up to 12
    # keys; row 0 left-padded by 3; YaRN.
    "glm5-every-stack-padded-yarn": dict(hf=dict(arch="glm5", index_topk=5, rope_scaling=YARN), padded=True),
    # transformers' schedule (index_topk_freq 3, offset 1: full, shared, shared, full), every layer MoE (a run of two
    # shared layers, the second reusing what the first reused), routed scaling 1.5; the hub's legacy rope layout.
    "glm5-schedule-all-moe-legacy": dict(hf=dict(
        arch="glm5", index_topk=4, indexer_types=None, index_topk_freq=3, index_skip_topk_offset=1,
        mlp_layer_types=None, first_k_dense_replace=0, routed_scaling_factor=1.5), legacy_rope=True),
    # q_lora, rope pairs, one dense layer, top-3 of 8 in the 2 of 4 groups whose two best scores sum highest,
    # renormalised x 2.5; YaRN 4 over 4 positions and the query scale (0.1); row 0 left-padded.
    "mistral4-yarn-qscale-padded": dict(hf=dict(arch="mistral4"), padded=True),
    # a single q_proj, rope halves, top-2 of 8 in 1 of 2 groups, raw weights x 2, no dense layer, beta 0.3 over 3.
    "mistral4-noqlora-halves": dict(hf=dict(
        arch="mistral4", q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, routed_scaling_factor=2.0,
        n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0,
        rope_parameters={**MISTRAL4_ROPE, "factor": 8.0, "original_max_position_embeddings": 3,
                         "llama_4_scaling_beta": 0.3})),
}
CLASSES = {"glm5": (Glm5, GlmMoeDsaForCausalLM), "mistral4": (Mistral4, Mistral4ForCausalLM)}


def _family(name: str) -> str:
    return CASES[name]["hf"]["arch"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case name -> (checkpoint dir, HF model, HF outputs, ids, mask); each HF model built and run once."""
    return case_builder(CASES, tmp_path_factory, batch=BATCH, seq=SEQ, first_seed=20)


def _real(mask: np.ndarray | None) -> np.ndarray:
    """The positions compared: real tokens (a left-pad query of sparse attention sees no key; transformers averages
    every value there, we the chosen ones), all of them for dense attention."""
    return np.ones((BATCH, SEQ), bool) if mask is None else mask.astype(bool)


def _logits_error(model, ids, mask, ref) -> float:
    out = forward(model, jnp.asarray(ids), None if mask is None else jnp.asarray(mask))
    real = _real(mask)
    return rel_l2(np.asarray(out.logits)[real], ref["logits"][real])


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(built, name):
    path, _, ref, ids, mask = built(name)
    model = AutoModelForCausalLM.from_pretrained(path, moe_impl="dense")
    assert type(model) is CLASSES[_family(name)][0]
    out = forward(model, jnp.asarray(ids), None if mask is None else jnp.asarray(mask))
    real = _real(mask)
    errors = [rel_l2(np.asarray(out.logits)[real], ref["logits"][real])]
    assert len(out.hidden_states) == len(ref["hidden_states"])
    for a, b in zip(out.hidden_states, ref["hidden_states"]):
        errors.append(rel_l2(np.asarray(a)[real], b[real]))
    assert max(errors) < 1e-5, errors
    assert len(ref["experts"]) == out.expert_indices.shape[0] > 0
    for layer, (a, b) in enumerate(zip(np.asarray(out.expert_indices), ref["experts"], strict=True)):
        np.testing.assert_array_equal(np.sort(a, -1)[real], np.sort(b.reshape(a.shape), -1)[real], f"layer {layer}")
    print(f"{name}: logits {errors[0]:.1e}, hidden states max {max(errors[1:]):.1e} (relative L2)")


@pytest.mark.parametrize("name", ["glm5-every-stack-padded-yarn", "mistral4-yarn-qscale-padded"])
def test_each_distinctive_part_moves_the_logits(built, name):
    """Turned off one at a time, each part the family adds to DeepSeek's gives other logits than transformers'
    (which the loaded model matches: ``test_matches_transformers``): the configs exercise every part."""
    path, hf, ref, ids, mask = built(name)
    if _family(name) == "glm5":
        # The indexer's rope as V3.2's (halves) and no routed scaling, in our model.
        for off in (dict(index_rope_interleave=False), dict(routed_scaling_factor=1.0)):
            err = _logits_error(AutoModelForCausalLM.from_pretrained(path, moe_impl="dense", **off), ids, mask, ref)
            assert err > 1e-3, (off, err)
        # No reuse: transformers' shared layers given their own indexer (the previous full layer's weights), so each
        # chooses from its own input.
        variant = copy.deepcopy(hf)
        for i, layer in enumerate(variant.model.layers):
            if layer.self_attn.indexer is None:
                layer.self_attn.indexer = copy.deepcopy(variant.model.layers[i - 1].self_attn.indexer)
                layer.self_attn.indexer.layer_idx = i  # its own slot in the cache's indexer keys
        dense_too = hf_outputs(variant, ids, mask)["logits"]
        real = _real(mask)
        assert rel_l2(dense_too[real], ref["logits"][real]) > 1e-3
    else:
        # No YaRN (default rope on the rope dims, the query scale's period kept), and no query scale.
        for off in (dict(rope_scaling=None, original_max_position_embeddings=4), dict(llama_4_scaling_beta=0.0)):
            err = _logits_error(AutoModelForCausalLM.from_pretrained(path, moe_impl="dense", **off), ids, mask, ref)
            assert err > 1e-3, (off, err)


@pytest.mark.parametrize("name", ["glm5-schedule-all-moe-legacy", "mistral4-noqlora-halves"])
def test_export_reloads_in_transformers(built, tmp_path, name):
    path, hf, ref, ids, mask = built(name)
    model_cls, hf_cls = CLASSES[_family(name)]
    model_cls.from_pretrained(path, moe_impl="gmm").save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    # Experts as transformers reads them: per expert for GLM-5 (its key mapping fuses them), fused for Mistral 4.
    keys = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    fused = {k for k in keys if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    per_expert = {k for k in keys if ".mlp.experts.0." in k}
    assert (bool(fused), bool(per_expert)) == ((True, False) if _family(name) == "mistral4" else (False, True))
    reloaded = hf_cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reloaded(torch.as_tensor(ids)).logits.numpy()
    assert rel_l2(logits, ref["logits"]) < 1e-5
    keys = {"glm5": ("indexer_types", "mlp_layer_types", "index_topk", "routed_scaling_factor", "n_routed_experts"),
            "mistral4": ("rope_interleave", "q_lora_rank", "n_group", "topk_group", "norm_topk_prob")}[_family(name)]
    for key in keys:
        assert getattr(reloaded.config, key) == getattr(hf.config, key), key
    if _family(name) == "mistral4":
        for key in ("llama_4_scaling_beta", "original_max_position_embeddings", "factor", "rope_type"):
            assert reloaded.config.rope_parameters[key] == hf.config.rope_parameters[key], key


@pytest.mark.parametrize("name", ["glm5-every-stack-padded-yarn", "mistral4-yarn-qscale-padded"])
def test_cached_greedy_equals_uncached_and_transformers(built, name):
    """GLM-5: the cache (15 slots) holds more keys than the top-k (5), so decoding is sparse and the shared layers
    reuse the chosen slots; Mistral 4: positions up to 14 span four steps of the query scale."""
    path, hf, _, _, _ = built(name)
    model = CLASSES[_family(name)][0].from_pretrained(path, moe_impl="dense")
    prompt, new = 7, 8
    ids, mask = padded_inputs(BATCH, prompt, hf.config.vocab_size, True)
    out = generate(model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=new)
    # The uncached argmax continuation, by teacher forcing at the positions generate gives the tokens.
    tokens = np.asarray(out.tokens)
    full_mask = np.concatenate([mask, np.ones((BATCH, new), np.int32)], axis=1)
    positions = np.maximum(np.cumsum(full_mask, axis=1) - 1, 0)
    logits = np.asarray(model.forward(jnp.asarray(tokens), jnp.asarray(full_mask),
                                      position_ids=jnp.asarray(positions)).logits)
    np.testing.assert_array_equal(logits[:, prompt - 1:-1].argmax(-1), tokens[:, prompt:])
    with torch.no_grad():
        expected = hf.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=new,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
    np.testing.assert_array_equal(tokens[:, prompt:], expected.numpy()[:, prompt:])


# ---------------------------------------------------------------------------------------------------------------
# Configs: presets, transformers' config classes, sizes.

PRESETS = [(Glm5Config, name) for name in Glm5Config.PRESETS] + [(Mistral4Config, n) for n in Mistral4Config.PRESETS]
HF_CONFIGS = {"glm_moe_dsa": HFGlm5Config, "mistral4": HFMistral4Config}


@pytest.mark.parametrize("cls, name", PRESETS, ids=[n for _, n in PRESETS])
def test_presets_validate_and_round_trip_through_transformers(cls, name):
    config = cls.preset(name)
    hf = HF_CONFIGS[config.hf_model_type](**copy.deepcopy(config.to_hf_dict()))
    assert cls.from_hf(config.to_hf_dict()) == config
    # transformers' own dict of it (its key layout: rope_parameters, indexer_types and mlp_layer_types written out)
    # reads back as the same config.
    assert cls.from_hf(hf.to_dict()) == config
    if cls is Glm5Config:
        assert hf.indexer_types == list(config.layer_indexer_types())
        assert hf.mlp_layer_types == list(config.layer_mlp_types())
    else:
        assert hf.rope_parameters["llama_4_scaling_beta"] == config.llama_4_scaling_beta
        assert hf.rope_parameters["original_max_position_embeddings"] == config.query_scale_period


def test_published_sizes():
    glm = Glm5Config.preset("glm5-744b")
    counts = glm.num_parameters()
    assert (counts.total, counts.active) == (743_911_199_232, 41_784_709_632)
    assert abs(counts.total - 744e9) / 744e9 < 0.005  # the GLM-5 report: 744B total, 40B active
    assert abs(counts.active - 2 * counts.embedding - 40e9) / 40e9 < 0.01  # active less embedding and head
    assert abs(glm.num_parameters(include_mtp=True).total - 754e9) / 754e9 < 0.005  # the hub's 754B: with MTP
    mistral = Mistral4Config.preset("mistral-small-4-119b").num_parameters()
    assert (mistral.total, mistral.active) == (118_972_826_624, 6_632_588_288)
    assert abs(mistral.total - 119e9) / 119e9 < 0.005  # Mistral's model card: 119B, 6.5B active
    assert abs(mistral.active - 6.5e9) / 6.5e9 < 0.025


@pytest.mark.parametrize("cls, name", [(Glm5Config, "glm5-tiny"), (Mistral4Config, "mistral4-tiny")])
def test_num_parameters_match_transformers(cls, name):
    config = cls.preset(name, vocab_size=256)
    with torch.device("meta"):
        hf = (GlmMoeDsaForCausalLM if cls is Glm5Config else Mistral4ForCausalLM)(
            HF_CONFIGS[config.hf_model_type](**copy.deepcopy(config.to_hf_dict())))
    assert config.num_parameters().total == sum(p.numel() for p in hf.parameters())


def test_layer_kinds_and_refusals():
    tiny = Glm5Config.preset("glm5-tiny")
    assert tiny.layer_indexer_types() == ("full", "shared", "full", "shared")
    assert tiny.layer_stacks() == {"dense_layers": (0,), "prefix_moe_layers": (), "moe_layers": (2,),
                                   "shared_topk_dense_layers": (), "shared_topk_moe_layers": (1, 3)}
    # Pipelined (GPipe): the MoE layers 1, 2, 3 in model order; chunks must start with a layer that chooses.
    assert tiny.pipelined_kinds() == ("shared_topk_moe_layers", "moe_layers", "shared_topk_moe_layers")
    # transformers' pattern string, and its written-out schedule read back as the schedule
    assert Glm5Config.from_hf({**tiny.to_hf_dict(), "indexer_types": None, "index_topk_pattern": "FSSF"}
                              ).indexer_types == ("full", "shared", "shared", "full")
    assert Glm5Config.from_hf(tiny.to_hf_dict()).indexer_types is None
    with pytest.raises(ValueError, match="layer 0 cannot reuse"):
        tiny.with_overrides(indexer_types=("shared", "full", "full", "full"))
    with pytest.raises(ValueError, match="indexer_types must be None or 4"):
        tiny.with_overrides(indexer_types=("full", "partial", "full", "full"))
    with pytest.raises(ValueError, match="index_topk must be a positive integer"):
        tiny.with_overrides(index_topk=0)
    mistral = Mistral4Config.preset("mistral4-tiny")
    with pytest.raises(ValueError, match="differs from rope_scaling's 64"):
        mistral.with_overrides(original_max_position_embeddings=32)
    with pytest.raises(ValueError, match="needs a period"):
        mistral.with_overrides(rope_scaling=None)
    hf = mistral.to_hf_dict()
    hf["rope_parameters"] = {k: v for k, v in hf["rope_parameters"].items() if k != "llama_4_scaling_beta"}
    with pytest.raises(ValueError, match="no llama_4_scaling_beta"):
        Mistral4Config.from_hf(hf)
    no_yarn = mistral.with_overrides(rope_scaling=None, original_max_position_embeddings=64)
    with pytest.raises(ValueError, match="rope type 'default' is not supported for Mistral 4"):
        no_yarn.to_hf_dict()
