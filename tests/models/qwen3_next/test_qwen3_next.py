"""Qwen3-Next and Qwen3.5 (dense, MoE) text models against transformers (PyTorch, CPU, float32, eager attention) on
tiny random checkpoints (``reference.CASES``: four layers, linear x3 then full; Qwen3-Next with a dense layer 0 and
MoE layers after it, Qwen3.5 dense with tied embeddings, Qwen3.5 MoE), on a batch whose row 0 is left-padded by 3:

- logits and every hidden state within 1e-5 relative, the experts chosen equal, unpadded rows too;
- HF I/O both ways through AutoModelForCausalLM: transformers' save_pretrained loads, transformers reloads our save
  with the same logits; the multimodal Qwen3.5 checkpoints' text model loads (vision tower and MTP skipped);
- cached greedy decoding (KV for full layers, conv tail and delta-rule state for linear ones) equals the uncached
  continuation and transformers' generate;
- turning each distinctive part off moves the logits;
- the presets' parameter counts equal transformers' on the meta device; hub-form config.json files read as
  transformers reads them.

The random weights are drawn small (``reference.SCALE``): with large ones some draws make a convolution output
nearly 0 before its L2 normalization, which then amplifies float32 rounding (both implementations drift from a
float64 run by ~1e-5 there); each case's seed is one where the reference is well conditioned.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM, Qwen3Next, Qwen35, Qwen35MoE, generate
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.models.qwen3_5 import Qwen35Config, Qwen35MoEConfig
from nnx_zoo.models.qwen3_next import Qwen3NextConfig
from nnx_zoo.models.qwen3_next.mixers import _BLE, GatedAttention
from tests.models.dense_reference import left_padded_batch, rel_err
from tests.models.qwen3_next.reference import CASES, hf_outputs, make_hf, make_multimodal

TOL = 1e-5
SEQ, PAD = 11, 3
SEEDS = {"qwen3_next": 0, "qwen3_5": 2, "qwen3_5_moe": 1}
CLASSES = {"qwen3_next": Qwen3Next, "qwen3_5": Qwen35, "qwen3_5_moe": Qwen35MoE}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """case -> (HF model, its checkpoint, our model loaded from it, the batch, our and transformers' outputs)."""
    out = {}
    for case in CASES:
        seed = SEEDS[case]
        hf = make_hf(case, seed=seed)
        path = tmp_path_factory.mktemp(case)
        hf.save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        ids, mask = left_padded_batch(hf.config.vocab_size, seq=SEQ, pad=PAD, seed=seed)
        ours = model.forward(jnp.asarray(ids), jnp.asarray(mask), with_hidden_states=True, with_routing=True)
        out[case] = dict(hf=hf, path=path, model=model, ids=ids, mask=mask, ours=ours, want=hf_outputs(hf, ids, mask))
    return out


@pytest.mark.parametrize("case", CASES)
def test_logits_hidden_states_and_experts_equal_transformers(cases, case):
    c = cases[case]
    assert type(c["model"]) is CLASSES[case]
    mask, ours, want = c["mask"], c["ours"], c["want"]
    logits = rel_err(np.asarray(ours.logits), want["logits"], keep=mask)  # padding positions are not compared
    hidden = rel_err(np.asarray(ours.hidden_states), want["hidden"],
                     keep=np.broadcast_to(mask, want["hidden"].shape[:3]))
    if want["experts"] is not None:
        real = mask.astype(bool)
        np.testing.assert_array_equal(np.asarray(ours.expert_indices)[:, real], want["experts"][:, real])
    else:
        assert ours.expert_indices is None
    unpadded = c["model"](jnp.asarray(c["ids"][1:]))  # no mask at all
    plain = rel_err(np.asarray(unpadded), hf_outputs(c["hf"], c["ids"][1:], None)["logits"])
    assert logits < TOL and hidden < TOL and plain < TOL, (logits, hidden, plain)
    print(f"{case}: max relative error logits {logits:.2e}, hidden states {hidden:.2e}, unpadded {plain:.2e}")


@pytest.mark.parametrize("case", CASES)
def test_transformers_reloads_our_save(cases, case, tmp_path):
    from transformers import AutoModelForCausalLM as HFAuto

    c = cases[case]
    c["model"].save_pretrained(tmp_path)
    again = HFAuto.from_pretrained(tmp_path).eval()
    assert type(again) is type(c["hf"])
    again.config._attn_implementation = "eager"
    back = rel_err(hf_outputs(again, c["ids"], c["mask"])["logits"], np.asarray(c["ours"].logits), keep=c["mask"])
    assert back < TOL, back
    for name in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_conv_kernel_dim", "head_dim", "tie_word_embeddings"):
        assert getattr(again.config, name) == getattr(c["hf"].config, name), name
    assert again.config.rope_parameters["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_checkpoint_text_model_loads(cases, case, tmp_path):
    """transformers' ``Qwen3_5(Moe)ForConditionalGeneration`` checkpoint (``model.language_model.*``, the vision
    tower under ``model.visual.*``, model_type ``qwen3_5`` / ``qwen3_5_moe``) loads as its language model, whose
    logits it gives; an ``mtp.*`` key (as the hub files carry) is skipped."""
    from safetensors.torch import load_file, save_file

    c = cases[case]
    mm = make_multimodal(case, seed=5)
    mm.save_pretrained(tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    state = load_file(shard)
    assert any(k.startswith("model.language_model.layers.") for k in state)
    save_file({**state, "mtp.fc.weight": torch.zeros(2, 2)}, shard, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model) is CLASSES[case]
    with torch.no_grad():
        want = mm(input_ids=torch.as_tensor(c["ids"], dtype=torch.long),
                  attention_mask=torch.as_tensor(c["mask"])).logits.numpy()
    assert rel_err(np.asarray(model(jnp.asarray(c["ids"]), jnp.asarray(c["mask"]))), want, keep=c["mask"]) < TOL


def test_cached_greedy_decoding_equals_uncached_and_transformers(cases):
    """Qwen3-Next's case (linear and full, dense and MoE layers): a 11-token prompt (row 0 left-padded by 3) and 6
    new tokens, through the cache, through full forwards, and through transformers' generate."""
    c = cases["qwen3_next"]
    model, ids, mask, hf = c["model"], c["ids"], c["mask"], c["hf"]
    new = 6
    tokens = np.asarray(generate(model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=new).tokens)
    cache = model.init_cache(3, 16)
    assert set(cache.conv) == set(cache.state) == {"linear_layers", "linear_dense_layers"} and set(cache.k) == {
        "layers"}
    assert cache.state["linear_layers"].shape == (2, 3, 4, 8, 8)
    assert cache.conv["linear_layers"].shape == (2, 3, 3, 2, 32)
    forward = nnx.jit(lambda m, s, k, p: m(s, k, position_ids=p))
    seq = np.concatenate([ids, np.zeros((3, new), np.int32)], 1)
    seq_mask = np.concatenate([mask, np.ones((3, new), np.int32)], 1)
    positions = jnp.asarray(np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0))
    for step in range(new):
        last = ids.shape[1] + step - 1
        logits = forward(model, jnp.asarray(seq), jnp.asarray(seq_mask), positions)
        seq[:, last + 1] = np.asarray(jnp.argmax(logits[:, last], axis=-1))
    np.testing.assert_array_equal(tokens, seq)
    with torch.no_grad():
        theirs = hf.generate(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    np.testing.assert_array_equal(tokens, theirs.numpy())


def _stacks(model, attention=None, moe=None):
    kinds = model._kinds_by_stack()
    return [s for n, s in model.layer_stacks().items()
            if (attention is None or kinds[n].attention == attention) and (moe is None or kinds[n].moe == moe)]


def _no_output_gate(model, monkeypatch):
    monkeypatch.setattr(GatedAttention, "_out", lambda self, out, gate: self.o_proj(out, _BLE))


def _plain_norms(model, monkeypatch):
    for _, module in nnx.iter_graph(model):
        if isinstance(module, RMSNorm) and module.offset:
            module.offset = 0.0  # scale by w, not 1 + w


class _Identity(nnx.Module):
    def __call__(self, x):
        return x


def _no_qk_norm(model, monkeypatch):
    for stack in _stacks(model, "full"):
        stack.attn.q_norm, stack.attn.k_norm = nnx.data(_Identity()), nnx.data(_Identity())


def _ungated_shared_expert(model, monkeypatch):
    for stack in _stacks(model, moe=True):
        stack.mlp.shared_gate = None


def _flat_projection(model, monkeypatch):
    """The packed per-head in_proj_qkvz read as if flat (all queries, all keys, ...): the layout matters."""
    for stack in _stacks(model, "linear"):
        kernel = stack.attn.in_proj_qkvz.kernel
        layers, embed, heads, width = kernel.shape
        kernel[...] = kernel[...].reshape(layers, embed, width, heads).transpose(0, 1, 3, 2)


def _no_decay(model, monkeypatch):
    for stack in _stacks(model, "linear"):
        stack.attn.A_log[...] = jnp.full_like(stack.attn.A_log[...], -30.0)  # g = -exp(A_log) * ... ~ 0


# part -> (case, config overrides, model surgery): the model with that part off.
ABLATIONS = {
    "output_gate": ("qwen3_5", {}, _no_output_gate),
    "centred_norms": ("qwen3_next", {}, _plain_norms),
    "qk_norm": ("qwen3_5_moe", {}, _no_qk_norm),
    "partial_rope": ("qwen3_5", dict(partial_rotary_factor=1.0), None),
    "shared_expert_gate": ("qwen3_next", {}, _ungated_shared_expert),
    "packed_projection": ("qwen3_next", {}, _flat_projection),
    "delta_rule_decay": ("qwen3_5_moe", {}, _no_decay),
}


@pytest.mark.parametrize("part", ABLATIONS)
def test_turning_each_part_off_moves_the_logits(cases, part, monkeypatch):
    case, overrides, surgery = ABLATIONS[part]
    c = cases[case]
    model = AutoModelForCausalLM.from_pretrained(c["path"], **overrides)
    if surgery is not None:
        surgery(model, monkeypatch)
    moved = rel_err(np.asarray(model(jnp.asarray(c["ids"]), jnp.asarray(c["mask"]))), np.asarray(c["ours"].logits),
                    keep=c["mask"])
    assert moved > 1e-2, (part, moved)


def test_presets_count_transformers_parameters():
    """Each published preset counts what transformers builds for its text model (meta device, exact): without the
    release's MTP depth, which transformers does not build (the published sizes leave it out too); with
    ``include_mtp`` the count adds exactly the Variables of our MTP block for that config (built abstractly)."""
    import jax
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3NextForCausalLM,
    )
    from transformers import Qwen3NextConfig as HFConfig

    from nnx_zoo.models.qwen3_next.model import MTPBlock

    cases = [("qwen3-next-80b-a3b", HFConfig, Qwen3NextForCausalLM, 79.67),
             ("qwen3.5-9b", Qwen3_5TextConfig, Qwen3_5ForCausalLM, 8.95),
             ("qwen3.5-27b", Qwen3_5TextConfig, Qwen3_5ForCausalLM, 26.9),
             ("qwen3.5-35b-a3b", Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, 34.66),
             ("qwen3.5-397b-a17b", Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, 396.35)]
    for name, config_cls, model_cls, billions in cases:
        config = AutoConfig.preset(name)
        with torch.device("meta"):
            theirs = model_cls(config_cls(**config.to_hf_dict()))
        counts = config.num_parameters()
        assert counts.total == sum(p.numel() for p in theirs.parameters()), name
        assert round(counts.total / 1e9, 2) == billions, name
        assert config.mtp_num_hidden_layers == 1, name  # each release carries one MTP layer
        block = nnx.eval_shape(lambda c=config: MTPBlock(c, rngs=nnx.Rngs(0)))
        assert config.num_parameters(include_mtp=True).total - counts.total == sum(
            x.size for x in jax.tree.leaves(nnx.state(block, nnx.Param))), name
    for name, cls in (("qwen3-next-tiny", Qwen3NextConfig), ("qwen3.5-small", Qwen35Config),
                      ("qwen3.5-moe-tiny", Qwen35MoEConfig)):
        assert type(AutoConfig.preset(name)) is cls


def test_hub_config_json_reads_as_transformers_does():
    """A multimodal hub config.json (text_config with the mrope sections, top-level tie_word_embeddings) and a
    Qwen3-Next one without layer_types (full_attention_interval) resolve as transformers resolves them."""
    from transformers import Qwen3_5Config
    from transformers import Qwen3NextConfig as HFConfig

    text = {k: v for k, v in Qwen35Config.preset("qwen3.5-9b").to_hf_dict().items()
            if k not in ("layer_types", "architectures")}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    text.pop("rope_theta", None)
    d = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    ours = AutoConfig.from_hf(d)
    theirs = Qwen3_5Config(**json.loads(json.dumps(d))).text_config
    assert type(ours) is Qwen35Config and ours.tie_word_embeddings and ours.rope_theta == 1e7
    assert [k.attention + "_attention" for k in ours.layer_kinds()] == theirs.layer_types
    assert ours.partial_rotary_factor == 0.25 and ours.num_experts == 0
    nxt = {k: v for k, v in Qwen3NextConfig.preset("qwen3-next-80b-a3b").to_hf_dict().items() if k != "layer_types"}
    nxt.pop("partial_rotary_factor")  # transformers' default then: 0.25
    ours = AutoConfig.from_hf({**nxt, "full_attention_interval": 3})
    theirs = HFConfig(**{**nxt, "full_attention_interval": 3})
    assert [k.attention + "_attention" for k in ours.layer_kinds()] == theirs.layer_types
    assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.25
    assert ours.mtp_num_hidden_layers == 1  # the release's MTP depth, read from the file
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings=true .* not supported"):
        AutoConfig.from_hf({**nxt, "mtp_use_dedicated_embeddings": True})
