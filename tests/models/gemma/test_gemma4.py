"""Gemma 4 (text) against transformers (PyTorch, CPU, float32), on tiny random checkpoints with a 4-token window:
logits, every hidden state and the experts chosen within relative 1e-5 / equal, on a batch with a left-padded row
and unpadded ones, for a ``gemma4_text`` checkpoint with every part at once (per-layer inputs, the last three
layers sharing K/V with double-wide MLPs, the MoE block, global K = V heads, proportional rope) and the text model
of a ``gemma4`` multimodal checkpoint shaped like the 31B (global K = V heads, no per-layer inputs; its config in
transformers' ``per_layer_config`` form); transformers reloads our save with the same logits; cached greedy decoding
past the window (shared layers reading the storing layer's ring) equals the uncached continuation and transformers'
``generate``; turning each of Gemma 4's parts off moves the logits; the presets have transformers' parameter counts
and the published ones."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM, Gemma4, Gemma4Config
from nnx_zoo.models.gemma4 import layers as gemma4_layers
from nnx_zoo.models.gemma4.layers import Gemma4Attention, LayerScalar, SharedKV
from tests.models.gemma.reference import hf_outputs, make_gemma4, rel

TOL = 1e-5
BATCH, SEQ, PAD = 3, 12, 5
S, F = "sliding_attention", "full_attention"
CONFIGS = {
    # Layers 3-5 reuse the K/V of layers 1 (sliding) and 2 (global); per-layer inputs; MoE beside every MLP.
    "text": dict(layer_types=[S, S, F, S, S, F], num_kv_shared_layers=3, use_double_wide_mlp=True,
                 hidden_size_per_layer_input=8, attention_k_eq_v=True, num_global_key_value_heads=1,
                 enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
    # The 31B's shape: global K = V heads, no per-layer inputs, no sharing; the global rope rotates 0.5 of its pairs.
    "multimodal": dict(multimodal=True, num_hidden_layers=5, layer_types=[S, S, F, S, F], attention_k_eq_v=True,
                       num_global_key_value_heads=1, rope_parameters={
                           "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
                           "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                              "rope_theta": 5e5}}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """config name -> (transformers model, checkpoint dir, our model, ids, mask, transformers' outputs, ours)."""
    out = {}
    rng = np.random.default_rng(0)
    for seed, (name, spec) in enumerate(CONFIGS.items()):
        hf = make_gemma4(seed, **spec)
        path = tmp_path_factory.mktemp(f"gemma4-{name}")
        hf.save_pretrained(path)
        if spec.get("multimodal"):
            assert "per_layer_config" in json.loads((path / "config.json").read_text())["text_config"]
            with pytest.warns(UserWarning, match="multimodal checkpoint: loading its text model"):
                ours = AutoModelForCausalLM.from_pretrained(path, attention_impl="xla")
        else:
            ours = AutoModelForCausalLM.from_pretrained(path, attention_impl="xla")
        assert type(ours) is Gemma4
        ids = rng.integers(1, ours.config.vocab_size, (BATCH, SEQ))
        mask = np.ones((BATCH, SEQ), np.int32)
        mask[0, :PAD] = 0
        ref = hf_outputs(hf, ids, mask)
        mine = nnx.jit(lambda m, i, k: m.forward(i, k, with_hidden_states=True, with_routing=True))(
            ours, jnp.asarray(ids), jnp.asarray(mask))
        out[name] = (hf, path, ours, ids, mask, ref, mine)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_every_hidden_state_and_the_experts_chosen(built, name):
    hf, _, ours, _, mask, ref, mine = built[name]
    text = hf.config.get_text_config()
    assert (ours.config.global_head_dim, ours.config.global_kv_heads) == (16, 1 if text.attention_k_eq_v else 2)
    errors = {}
    for what, a, b in [("logits", mine.logits, ref["logits"])] + [
            (f"hidden state {i}", mine.hidden_states[i], ref["hidden"][i]) for i in range(len(ref["hidden"]))]:
        errors[what] = (rel(a[1:], b[1:]), rel(a[:1], b[:1], keep=mask[0]))  # unpadded rows; the padded row
    worst = max(max(e) for e in errors.values())
    print(f"gemma4 {name}: worst relative error {worst:.2e}")
    assert worst < TOL, errors
    if "experts" in ref:
        chosen = np.sort(np.asarray(mine.expert_indices), axis=-1)
        np.testing.assert_array_equal(chosen[:, 1:], ref["experts"][:, 1:])
        np.testing.assert_array_equal(chosen[:, 0, PAD:], ref["experts"][:, 0, PAD:])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_reloads_our_save(built, tmp_path, name):
    import transformers

    _, _, ours, ids, mask, _, mine = built[name]
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "gemma4_text" and saved["global_head_dim"] == 16
    keys = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    if ours.config.enable_moe_block:  # transformers' fused expert layout, no per-expert keys
        assert "model.layers.0.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    if ours.config.num_kv_shared_layers:  # the shared layers store no key/value projections
        assert not any(k.startswith("model.layers.4.self_attn.k_proj") for k in keys)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(again).__name__ == "Gemma4ForCausalLM"
    theirs = hf_outputs(again, ids, mask)["logits"]
    assert rel(theirs[1:], mine.logits[1:]) < TOL and rel(theirs[:1], mine.logits[:1], keep=mask[0]) < TOL
    assert Gemma4Config.from_hf(tmp_path) == ours.config.with_overrides(attention_impl="auto")


@pytest.fixture(scope="module")
def eager(built) -> Gemma4:
    """The text model unscanned, for op-by-op calls (its variants below reuse one set of compiled ops)."""
    return _with_config(built["text"][2], scan_layers=False)


def test_cached_greedy_decoding_past_the_window(built, eager):
    hf, _, ours, ids, _, _, _ = built["text"]
    prompt, new = ids[:, :4], SEQ - 4  # decoding runs past the 4-token window: the 3-slot rings wrap twice
    mask = np.ones(prompt.shape, np.int32)
    mask[0, :2] = 0
    cache = ours.init_cache(BATCH, SEQ)  # the storing layers cache K/V once; the shared stacks hold nothing
    assert sorted(cache.k) == ["sliding_layers", "store_layers", "store_sliding_layers"]
    assert cache.k["store_sliding_layers"].shape[2] == 3 and cache.k["store_layers"].shape[2:] == (SEQ, 1, 16)
    tokens = np.asarray(ours.generate(jnp.asarray(prompt), jnp.asarray(mask), max_new_tokens=new).tokens)
    seq = np.zeros((BATCH, SEQ), prompt.dtype)
    seq[:, :prompt.shape[1]] = prompt
    seq_mask = np.concatenate([mask, np.ones((BATCH, new), np.int32)], axis=1)
    positions = jnp.asarray(np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0))
    for t in range(prompt.shape[1], SEQ):
        logits = eager(jnp.asarray(seq), jnp.asarray(seq_mask), position_ids=positions)
        seq[:, t] = np.asarray(logits)[:, t - 1].argmax(-1)
    np.testing.assert_array_equal(tokens, seq)
    with torch.no_grad():
        theirs = hf.generate(torch.as_tensor(prompt), attention_mask=torch.as_tensor(mask), max_new_tokens=new,
                             do_sample=False, min_new_tokens=new, pad_token_id=0)
    np.testing.assert_array_equal(tokens, theirs.numpy())


# ---------------------------------------------------------------------------------- every part acts in the configs
def _with_config(model: Gemma4, **changes) -> Gemma4:
    """The same weights under a config with ``changes`` (shapes unchanged), built abstractly."""
    config = model.config.with_overrides(**changes)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Gemma4(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def _with_state(model: Gemma4, path_part: str, change, kind=nnx.Variable) -> Gemma4:
    """A copy with every Variable (of ``kind``) whose path contains ``path_part`` replaced by ``change(value)``."""
    graphdef, state = nnx.split(_with_config(model))
    flat = dict(nnx.to_flat_state(state))
    hit = 0
    for key, var in flat.items():
        if path_part in "/".join(map(str, key)) and isinstance(var, kind):
            flat[key] = var.replace(change(var[...]))
            hit += 1
    assert hit, path_part
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _project_without_value_norm(self, x, cos, sin):
    q = self.project_q(x, cos, sin)
    if self.shared:
        return q, None, None
    k = self.k_proj(x)
    v = k if self.v_proj is None else self.v_proj(x)
    return q, gemma4_layers.apply_rope(self.k_norm(k), cos, sin, interleaved=False), v


def _zero_shared_kv(self, x, cos, sin, mask, shared_kv=None, _call=Gemma4Attention.__call__):
    if shared_kv is not None:
        shared_kv = SharedKV(jnp.zeros_like(shared_kv.k), jnp.zeros_like(shared_kv.v))
    return _call(self, x, cos, sin, mask, shared_kv)


PARTS = {
    "sliding window": lambda m: _with_config(m, sliding_window=64),
    "sliding rope base": lambda m: _with_config(m, sliding_rope_theta=m.config.rope_theta),
    "proportional global rope": lambda m: _with_config(m, global_rope_type="default",
                                                       global_partial_rotary_factor=1.0),
    "final logit soft-cap": lambda m: _with_config(m, final_logit_softcapping=None),
    "layer scalars": lambda m: _with_state(m, "layer_scalar", jnp.ones_like, LayerScalar),
    "per-layer input table": lambda m: _with_state(m, "embed_per_layer", jnp.zeros_like),
    "per-layer input gates": lambda m: _with_state(m, "per_layer_gate", jnp.zeros_like),
    "MoE block": lambda m: _with_state(m, "router/per_expert_scale", jnp.zeros_like),
    "query/key norms": lambda m: _with_state(m, "q_norm", jnp.ones_like),
    # changes of code (patched below)
    "value norm": (Gemma4Attention, "project", _project_without_value_norm),
    "shared K/V": (Gemma4Attention, "__call__", _zero_shared_kv),
}


@pytest.mark.parametrize("part", list(PARTS))
def test_turning_each_part_off_moves_the_logits(built, eager, monkeypatch, part):
    _, _, _, ids, mask, _, mine = built["text"]
    change = PARTS[part]
    if isinstance(change, tuple):
        monkeypatch.setattr(*change)
        model = _with_config(eager)
    else:
        model = change(eager)
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))  # the shapes of the continuation's calls
    moved = rel(model(jnp.asarray(ids), jnp.asarray(mask), position_ids=positions)[1:], mine.logits[1:])
    assert moved > 1e-3, f"{part} does not act in the test config ({moved:.1e})"


# --------------------------------------------------------------------------------------- presets and HF configs
# Published sizes (Google's Gemma 4 model card): 31B "30.7B"; 26B A4B "25.2B total, 3.8B active" (to 0.1B). The
# E2B / E4B cards' "5.1B / 8B with embeddings" include their vision and audio encoders, which these text models
# lack, so only transformers' count is checked for them.
PUBLISHED_B = {"gemma4-31b": (30.7, None), "gemma4-26b-a4b": (25.2, 3.8)}


@pytest.mark.parametrize("preset", ["gemma4-e2b", "gemma4-e4b", "gemma4-26b-a4b", "gemma4-31b"])
def test_preset_parameter_counts(preset):
    import transformers

    config = Gemma4Config.preset(preset)
    counts = config.num_parameters()
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config.to_hf_dict()))
    assert counts.total == sum(p.numel() for p in hf.parameters())
    assert [t for t in hf.config.layer_types] == list(config.resolved_layer_types)
    assert hf.config.kv_sharing_modes.count("reuse") == config.num_kv_shared_layers
    if preset in PUBLISHED_B:
        total, active = PUBLISHED_B[preset]
        assert round(counts.total / 1e9, 1) == total
        assert active is None or round(counts.active / 1e9, 1) == active


def test_cpu_presets_and_the_registry():
    for name in ("gemma4-tiny", "gemma4-small"):
        config = AutoConfig.preset(name)
        assert type(config) is Gemma4Config and config.num_parameters().total < 25e6
    assert AutoModelForCausalLM.model_class("gemma4") is AutoModelForCausalLM.model_class("gemma4_text") is Gemma4
    kinds = Gemma4Config.preset("gemma4-e2b").layer_kinds()
    assert [k.kv for k in kinds[13:16]] == ["store", "store", "shared"] and kinds[14].attention == "full"


def test_hf_config_forms_read_as_transformers_reads_them():
    import transformers

    hub = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
           "attention_k_eq_v": True, "hidden_size_per_layer_input": 0, "sliding_window_pattern": 3,
           "num_kv_shared_layers": 2}
    ours = Gemma4Config.from_hf(hub)
    theirs = transformers.AutoConfig.for_model(**hub)
    # No layer_types: transformers takes every sixth layer global whatever sliding_window_pattern says, and the last.
    assert ours.resolved_layer_types == tuple(theirs.layer_types)
    assert [k.kv for k in ours.layer_kinds()] == [
        {None: "own", "store": "store", "reuse": "shared"}[m] for m in theirs.kv_sharing_modes[:6]] + ["shared"] * 2
    assert (ours.global_head_dim, ours.global_kv_heads, ours.hidden_size_per_layer_input) == (32, 1, 0)
    assert (ours.rope_theta, ours.global_partial_rotary_factor, ours.sliding_rope_theta) == (1e6, 0.25, 1e4)
    assert dataclasses.asdict(Gemma4Config.from_hf(ours.to_hf_dict())) == dataclasses.asdict(ours)
    refused = [({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
               ({"num_kv_shared_layers": 8}, "num_kv_shared_layers=8 leaves no layer"),
               ({"enable_moe_block": True}, "enable_moe_block needs a positive integer num_experts"),
               ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
                "global layers' rope type 'yarn'"),
               ({"model_type": "gemma3_text"}, "model_type 'gemma3_text' is not 'gemma4_text'")]
    for change, message in refused:
        with pytest.raises(ValueError, match=message):
            Gemma4Config.from_hf({**hub, **change})
