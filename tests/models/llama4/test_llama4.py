"""Llama 4's text model against transformers (PyTorch, CPU, float32, eager attention) on tiny random checkpoints
(``reference.CASES``: Scout's shape, every layer MoE with the L2 q/k norm and Scout's llama3 rope; Maverick's,
dense / MoE alternating with all four layer kinds, top-2, biases, tied embeddings), chunks of 4 slots and
temperature tuning from slot 1, on a batch whose row 0 is left-padded by 3 (so its chunks start off the slot
grid) and on unpadded rows:

- logits and every hidden state within 1e-5 relative, the experts chosen equal;
- HF I/O both ways: transformers' save_pretrained (fused experts) and the multimodal ``Llama4ForConditionalGeneration``
  checkpoint's text model load; transformers reloads our save (``llama4_text``) with the same logits; per-expert keys
  load too;
- cached greedy decoding equals the uncached continuation and transformers' ``generate`` past the chunk (the ring
  of 3 slots wraps);
- turning each distinctive part off moves the logits;
- the presets' parameter counts equal transformers' on the meta device, and the published totals;
- a hub-form config.json resolves the layer schedule as transformers does.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nnx_zoo import AutoConfig, AutoModelForCausalLM, Llama4, Llama4Config, generate
from nnx_zoo.models.llama4.config import SCOUT_ROPE
from tests.models.dense_reference import left_padded_batch, rel_err
from tests.models.llama4.reference import CASES, hf_outputs, make_hf, make_multimodal

TOL = 1e-5
SEQ, PAD = 11, 3


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """case -> (HF model, its checkpoint, our model loaded from it, the batch, our and transformers' outputs)."""
    out = {}
    for seed, case in enumerate(CASES):
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
    assert type(c["model"]) is Llama4
    mask, ours, want = c["mask"], c["ours"], c["want"]
    logits = rel_err(np.asarray(ours.logits), want["logits"], keep=mask)  # padding positions are not compared
    hidden = rel_err(np.asarray(ours.hidden_states), want["hidden"],
                     keep=np.broadcast_to(mask, want["hidden"].shape[:3]))
    real = mask.astype(bool)
    np.testing.assert_array_equal(np.asarray(ours.expert_indices)[:, real], want["experts"][:, real])
    unpadded = c["model"](jnp.asarray(c["ids"][1:]))  # no mask at all
    plain = rel_err(np.asarray(unpadded), hf_outputs(c["hf"], c["ids"][1:], None)["logits"])
    assert logits < TOL and hidden < TOL and plain < TOL, (logits, hidden, plain)
    print(f"{case}: max relative error logits {logits:.2e}, hidden states {hidden:.2e}, unpadded {plain:.2e}")


@pytest.mark.parametrize("case", CASES)
def test_transformers_reloads_our_save(cases, case, tmp_path):
    from transformers import Llama4ForCausalLM

    c = cases[case]
    c["model"].save_pretrained(tmp_path)
    keys = load_file(next(tmp_path.glob("*.safetensors")))
    moe_layer = c["hf"].config.moe_layers[0]
    assert keys[f"model.layers.{moe_layer}.feed_forward.experts.gate_up_proj"].shape == (4, 32, 2 * 16)
    again = Llama4ForCausalLM.from_pretrained(tmp_path).eval()
    again.config._attn_implementation = "eager"
    back = rel_err(hf_outputs(again, c["ids"], c["mask"])["logits"], np.asarray(c["ours"].logits), keep=c["mask"])
    assert back < TOL, back
    for name in ("no_rope_layers", "moe_layers", "layer_types", "attention_chunk_size", "floor_scale", "attn_scale",
                 "use_qk_norm", "num_experts_per_tok", "intermediate_size_mlp", "tie_word_embeddings",
                 "attention_bias"):
        assert getattr(again.config, name) == getattr(c["hf"].config, name), name
    rope = {k: v for k, v in again.config.rope_parameters.items() if k != "type"}  # the legacy key, kept alongside
    assert rope == c["hf"].config.rope_parameters


def test_multimodal_checkpoint_and_per_expert_keys_load(cases, tmp_path):
    """The text model of transformers' ``Llama4ForConditionalGeneration`` checkpoint (``language_model.*`` keys,
    model_type ``llama4``; the vision tower skipped) loads with its language model's logits; so does a checkpoint
    whose experts are stored one ``nn.Linear`` per expert."""
    c = cases["scout"]
    mm = make_multimodal("scout", seed=7)
    mm.save_pretrained(tmp_path / "mm")
    assert json.loads((tmp_path / "mm" / "config.json").read_text())["model_type"] == "llama4"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mm")
    want = hf_outputs(mm.language_model, c["ids"], c["mask"])["logits"]
    assert rel_err(np.asarray(model(jnp.asarray(c["ids"]), jnp.asarray(c["mask"]))), want, keep=c["mask"]) < TOL

    state = {}
    for key, value in c["hf"].state_dict().items():
        if key.endswith("experts.gate_up_proj"):  # [E, embed, 2I] -> per expert [I, embed] gate and up
            inner = value.shape[-1] // 2
            for e in range(value.shape[0]):
                state[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = value[e, :, :inner].T.contiguous()
                state[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = value[e, :, inner:].T.contiguous()
        elif key.endswith("experts.down_proj"):  # [E, I, embed] -> per expert [embed, I]
            for e in range(value.shape[0]):
                state[key.replace("down_proj", f"{e}.down_proj.weight")] = value[e].T.contiguous()
        else:
            state[key] = value.contiguous()
    (tmp_path / "unfused").mkdir()
    save_file(state, tmp_path / "unfused" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "unfused" / "config.json").write_text(json.dumps(c["hf"].config.to_dict()))
    unfused = AutoModelForCausalLM.from_pretrained(tmp_path / "unfused")
    np.testing.assert_array_equal(np.asarray(unfused.chunked_layers.mlp.experts.wi_up[...]),
                                  np.asarray(c["model"].chunked_layers.mlp.experts.wi_up[...]))


def test_cached_greedy_decoding_equals_uncached_and_transformers(tmp_path):
    """Maverick's shape (all four kinds, top-2): a 7-token prompt (row 0 left-padded by 3) and 8 new tokens against
    chunks of 4: each chunked layer's ring of 3 slots wraps several times."""
    from flax import nnx

    hf = make_hf("maverick", seed=3)
    hf.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, mask = left_padded_batch(hf.config.vocab_size, batch=3, seq=7, pad=3, seed=1)
    new = 8
    tokens = np.asarray(generate(model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=new).tokens)
    cache = model.init_cache(3, 16)
    assert {name: cache.k[name].shape[2] for name in cache.k} == {
        "chunked_dense_layers": 3, "chunked_layers": 3, "nope_dense_layers": 16, "nope_layers": 16}

    # No cache: full forwards at the cache's rope positions (real tokens counted); NoPE temperature goes by slot.
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


def _moe_stacks(model: Llama4) -> list:
    return [stack for name, stack in model.layer_stacks().items() if model._kinds_by_stack()[name].moe]


def _without_input_scaling(model: Llama4) -> None:
    for stack in _moe_stacks(model):
        stack.mlp.scale_inputs = False  # the router's weight scales each expert's output instead


def _without_shared_expert(model: Llama4) -> None:
    for stack in _moe_stacks(model):
        stack.mlp.shared_experts.down.kernel[...] = jnp.zeros_like(stack.mlp.shared_experts.down.kernel[...])


def _every_layer_moe(path, out):
    """Maverick's checkpoint with its dense layers (0, 2) made MoE: the MoE block of the layer after each."""
    state = load_file(next(path.glob("*.safetensors")))
    for dense in (0, 2):
        state = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{dense}.feed_forward.")}
        for k, v in list(state.items()):
            if k.startswith(f"model.layers.{dense + 1}.feed_forward."):
                state[k.replace(f"layers.{dense + 1}.", f"layers.{dense}.")] = v.clone()
    out.mkdir()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "moe_layers": None, "interleave_moe_layer_step": 1}))
    return out


# part -> (case, config overrides, model surgery, checkpoint rewrite): the model with that part off.
ABLATIONS = {
    "chunking": ("scout", dict(attention_chunk_size=None, layer_types=None), None, None),
    "temperature_tuning": ("scout", dict(attn_temperature_tuning=False), None, None),
    "l2_qk_norm": ("scout", dict(use_qk_norm=False), None, None),
    "router_input_scaling": ("maverick", {}, _without_input_scaling, None),
    "shared_expert": ("scout", {}, _without_shared_expert, None),
    "interleave": ("maverick", {}, None, _every_layer_moe),
}


@pytest.mark.parametrize("part", ABLATIONS)
def test_turning_each_part_off_moves_the_logits(cases, part, tmp_path):
    case, overrides, surgery, rewrite = ABLATIONS[part]
    c = cases[case]
    path = c["path"] if rewrite is None else rewrite(c["path"], tmp_path / "ablated")
    model = AutoModelForCausalLM.from_pretrained(path, **overrides)
    if surgery is not None:
        surgery(model)
    moved = rel_err(np.asarray(model(jnp.asarray(c["ids"]), jnp.asarray(c["mask"]))), np.asarray(c["ours"].logits),
                    keep=c["mask"])
    assert moved > 1e-2, (part, moved)


def test_presets_count_transformers_parameters_and_the_published_totals():
    """Scout and Maverick count what transformers builds for their text model (meta device, exact). Meta's totals
    (Scout 17B active of 109B, Maverick 17B of 400B) include the vision tower and projector (0.87B): the text models
    are 107.8B and 400.7B, 17.2B active."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    for name, total, active in (("llama4-scout", 107.77, 17.17), ("llama4-maverick", 400.71, 17.18)):
        config = Llama4Config.preset(name)
        with torch.device("meta"):
            theirs = Llama4ForCausalLM(Llama4TextConfig(**config.to_hf_dict()))
        counts = config.num_parameters()
        assert counts.total == sum(p.numel() for p in theirs.parameters()), name
        assert (round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)) == (total, active), name
    maverick = Llama4Config.preset("llama4-maverick")
    assert [k.moe for k in maverick.layer_kinds()[:4]] == [False, True, False, True] and not maverick.use_qk_norm
    for name in ("llama4-tiny", "llama4-small"):
        assert type(AutoConfig.preset(name)) is Llama4Config
        assert {k for k in AutoConfig.preset(name).layer_kinds()} == {
            ("chunked", False, True), ("chunked", True, True), ("full", True, False)}


def test_hub_config_json_resolves_the_schedule_as_transformers_does():
    """A multimodal hub config.json (Scout's text_config: legacy rope_scaling, attn_temperature_tuning 4, resolved
    lists left out) and a text-only one with another schedule read as transformers reads them; unsupported settings
    are refused, named."""
    from transformers import Llama4TextConfig

    text = {k: v for k, v in Llama4Config.preset("llama4-scout").to_hf_dict().items()
            if k not in ("moe_layers", "no_rope_layers", "layer_types")}
    for d in ({"model_type": "llama4", "text_config": {**text, "attn_temperature_tuning": 4},
               "vision_config": {"model_type": "llama4_vision_model"}},
              {**text, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 3, "attention_chunk_size": None}):
        ours = AutoConfig.from_hf(d)
        fields = {k: v for k, v in (d.get("text_config") or d).items() if k != "model_type"}
        # transformers 5's strict config refuses the hub's 4 (its model only asks whether it is set): True for it.
        theirs = Llama4TextConfig(**{**fields, "attn_temperature_tuning": bool(fields["attn_temperature_tuning"])})
        assert [i for i in range(48) if ours.is_moe_layer(i)] == theirs.moe_layers
        assert [int(k.rope) for k in ours.layer_kinds()] == theirs.no_rope_layers
        assert [k.attention + "_attention" for k in ours.layer_kinds()] == theirs.layer_types
        assert ours.attn_temperature_tuning is True and ours.rope_scaling == SCOUT_ROPE
    with pytest.raises(ValueError, match="no auxiliary loss for Llama 4"):
        Llama4Config.preset("llama4-tiny", output_router_logits=True)
    with pytest.raises(ValueError, match=r"layers \[3\] are NoPE .* with chunked attention"):
        Llama4Config.preset("llama4-tiny", layer_types=["chunked_attention"] * 4)
