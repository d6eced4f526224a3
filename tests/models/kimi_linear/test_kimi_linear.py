"""Kimi Linear against transformers (PyTorch, CPU, float32, eager attention) on a tiny random checkpoint
(``reference.make_hf``: KDA x3 then MLA, layer 0 dense, MoE after it with 2 expert groups and a selection bias), on
a batch whose row 0 is left-padded by 3:

- logits and every hidden state within 1e-5 relative, the experts chosen equal, an unpadded batch too;
- HF I/O both ways through AutoModelForCausalLM: transformers' save_pretrained loads, transformers reloads our save
  with the same logits and layer schedule;
- cached greedy decoding (MLA's latent cache for full layers, conv tail and delta-rule state for KDA ones, the
  prompt's delta rule in chunks of 4) equals the uncached continuation and transformers' generate;
- turning each distinctive part off moves the logits;
- the presets' parameter counts equal transformers' on the meta device; a hub-form config.json (its
  ``linear_attn_config`` and attribute-map names) reads as transformers reads it;
- KDA keeps its input sharding under Explicit meshes (heads split, or the sequence).

Sharded training, the recipe and LoRA: tests/models/test_dense_sharding.py, tests/recipes/.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM, KimiLinear, KimiLinearConfig, generate
from tests.models.dense_reference import left_padded_batch, rel_err
from tests.models.kimi_linear.reference import hf_outputs, make_hf

TOL = 1e-5
SEQ, PAD, SEED = 11, 3, 0
# One compile for the reference run and every ablation that changes only parameter values (same structure).
_forward = nnx.jit(lambda model, ids, mask: model.forward(ids, mask, with_hidden_states=True, with_routing=True))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The HF model, its checkpoint, our model loaded from it, the batch, our and transformers' outputs."""
    hf = make_hf(seed=SEED)
    path = tmp_path_factory.mktemp("kimi_linear")
    hf.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids, mask = left_padded_batch(hf.config.vocab_size, seq=SEQ, pad=PAD, seed=SEED)
    ours = _forward(model, jnp.asarray(ids), jnp.asarray(mask))
    return dict(hf=hf, path=path, model=model, ids=ids, mask=mask, ours=ours, want=hf_outputs(hf, ids, mask))


def test_logits_hidden_states_and_experts_equal_transformers(case):
    c = case
    assert type(c["model"]) is KimiLinear
    assert [k.attention for k in c["model"].config.layer_kinds()] == ["linear"] * 3 + ["full"]
    mask, ours, want = c["mask"], c["ours"], c["want"]
    logits = rel_err(np.asarray(ours.logits), want["logits"], keep=mask)  # padding positions are not compared
    hidden = rel_err(np.asarray(ours.hidden_states), want["hidden"],
                     keep=np.broadcast_to(mask, want["hidden"].shape[:3]))
    real = mask.astype(bool)
    chosen = np.sort(np.asarray(ours.expert_indices), axis=-1)  # transformers' top-k is unsorted
    np.testing.assert_array_equal(chosen[:, real], want["experts"][:, real])
    unpadded = _forward(c["model"], jnp.asarray(c["ids"]), jnp.ones_like(jnp.asarray(mask))).logits  # no padding
    plain = rel_err(np.asarray(unpadded), hf_outputs(c["hf"], c["ids"], None)["logits"])
    assert logits < TOL and hidden < TOL and plain < TOL, (logits, hidden, plain)
    print(f"max relative error logits {logits:.2e}, hidden states {hidden:.2e}, unpadded {plain:.2e}")


def test_transformers_reloads_our_save(case, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM as HFAuto

    c = case
    c["model"].save_pretrained(tmp_path)
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "np") as f:
        keys = set(f.keys())
    # The hub layout: separate q/k/v filters, per-expert w1/w2/w3, the dense layer under mlp.
    assert {"model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.block_sparse_moe.experts.7.w2.weight",
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"} <= keys
    again = HFAuto.from_pretrained(tmp_path).eval()
    assert type(again) is type(c["hf"])
    again.config._attn_implementation = "eager"
    back = rel_err(hf_outputs(again, c["ids"], c["mask"])["logits"], np.asarray(c["ours"].logits), keep=c["mask"])
    assert back < TOL, back
    for name in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                 "num_local_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                 "kv_lora_rank", "qk_rope_head_dim", "tie_word_embeddings"):
        assert getattr(again.config, name) == getattr(c["hf"].config, name), name


def test_cached_greedy_decoding_equals_uncached_and_transformers(case):
    """An 11-token prompt (row 0 left-padded by 3) and 6 new tokens, through the cache, through full forwards, and
    through transformers' generate. The KDA layers run chunks of 4, so the prompt's delta rule is the chunked form
    across chunk boundaries (3 chunks, the last one padded) before the recurrent decoding steps continue its
    state."""
    c = case
    ids, mask, hf = c["ids"], c["mask"], c["hf"]
    model = AutoModelForCausalLM.from_pretrained(c["path"])
    for stack in _stacks(model, "linear"):
        stack.attn.chunk_size = 4
    new = 6
    tokens = np.asarray(generate(model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=new).tokens)
    cache = model.init_cache(3, 16)
    assert set(cache.conv) == set(cache.state) == {"linear_layers", "linear_dense_layers"} and set(cache.k) == {
        "layers"}
    assert cache.state["linear_layers"].shape == (2, 3, 2, 8, 8)
    assert cache.conv["linear_layers"].shape == (2, 3, 3, 2, 24)  # per head its queries', keys', values' tails
    assert cache.k["layers"].shape == (1, 3, 16, 16) and cache.v["layers"].shape == (1, 3, 16, 4)  # latent, key head
    forward = nnx.jit(lambda m, s, k: m(s, k))
    seq = np.concatenate([ids, np.zeros((3, new), np.int32)], 1)
    seq_mask = np.concatenate([mask, np.ones((3, new), np.int32)], 1)
    for step in range(new):
        last = ids.shape[1] + step - 1
        logits = forward(model, jnp.asarray(seq), jnp.asarray(seq_mask))
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


def _per_head_decay(model):
    """Each head's channels decay alike (``f_b`` rows and ``dt_bias`` averaged over the head's channels): Gated
    DeltaNet's scalar decay per head instead of KDA's per channel."""
    for stack in _stacks(model, "linear"):
        for w in (stack.attn.f_b_proj.kernel, stack.attn.dt_bias):
            w[...] = jnp.broadcast_to(jnp.mean(w[...], axis=-1, keepdims=True), w[...].shape)


def _no_short_conv(model):
    for stack in _stacks(model, "linear"):
        for conv in (stack.attn.q_conv, stack.attn.k_conv, stack.attn.v_conv):
            conv.weight[...] = jnp.zeros_like(conv.weight[...]).at[..., -1].set(1.0)  # only its own token


def _no_output_gate(model):
    for stack in _stacks(model, "linear"):  # sigmoid(0): the same half for every token and channel
        stack.attn.g_b_proj.kernel[...] = jnp.zeros_like(stack.attn.g_b_proj.kernel[...])


def _no_selection_bias(model):
    for stack in _stacks(model, moe=True):
        stack.mlp.e_score_correction_bias[...] = jnp.zeros_like(stack.mlp.e_score_correction_bias[...])


def _no_shared_expert(model):
    for stack in _stacks(model, moe=True):
        stack.mlp.shared_experts.down.kernel[...] = jnp.zeros_like(stack.mlp.shared_experts.down.kernel[...])


# part -> (config overrides, parameter surgery): the model with that part off.
ABLATIONS = {
    "per_channel_decay": ({}, _per_head_decay),
    "short_conv": ({}, _no_short_conv),
    "output_gate": ({}, _no_output_gate),
    "selection_bias": ({}, _no_selection_bias),
    "shared_expert": ({}, _no_shared_expert),
    "routed_scaling": (dict(routed_scaling_factor=1.0), None),
    "no_rope_in_mla": ({}, None),  # below: MLA's rope part rotated by position, as DeepSeek's
}


@pytest.mark.parametrize("part", ABLATIONS)
def test_turning_each_part_off_moves_the_logits(case, part, monkeypatch):
    overrides, surgery = ABLATIONS[part]
    c = case
    model = AutoModelForCausalLM.from_pretrained(c["path"], **overrides)
    ids, mask = jnp.asarray(c["ids"]), jnp.asarray(c["mask"])
    if part == "no_rope_in_mla":  # a method patched: run it outside the shared compile, which would not see it
        monkeypatch.setattr(KimiLinear, "_layer_rope", lambda self, kind, positions: self._rope(positions))
        out = model.forward(ids, mask, with_routing=True)
    else:
        if surgery is not None:
            surgery(model)
        out = _forward(model, ids, mask)
    moved = rel_err(np.asarray(out.logits), np.asarray(c["ours"].logits), keep=c["mask"])
    if part == "selection_bias":  # the bias only chooses: it must change some choice
        assert (np.asarray(out.expert_indices) != np.asarray(c["ours"].expert_indices)).any()
    assert moved > 1e-2, (part, moved)


def test_presets_count_transformers_parameters():
    """Each preset counts what transformers builds (meta device, exact); the published one is ~49B."""
    from transformers import KimiLinearConfig as HFConfig
    from transformers import KimiLinearForCausalLM

    for name, billions in (("kimi-linear-48b-a3b", 49.12), ("kimi-linear-tiny", None), ("kimi-linear-small", None)):
        config = AutoConfig.preset(name)
        assert type(config) is KimiLinearConfig
        with torch.device("meta"):
            theirs = KimiLinearForCausalLM(HFConfig(**config.to_hf_dict()))
        assert config.num_parameters().total == sum(p.numel() for p in theirs.parameters()), name
        assert [k.attention + "_attention" for k in config.layer_kinds()] == theirs.config.layer_types, name
        if billions is not None:
            assert round(config.num_parameters().total / 1e9, 2) == billions, name


def test_hub_config_json_reads_as_transformers_does():
    """The published config.json's form (``linear_attn_config`` with 1-based layer lists, attribute-map names, no
    layer_types) reads as the preset and as transformers resolves it; without the layer lists, the default
    schedule is transformers'."""
    from transformers import KimiLinearConfig as HFConfig

    preset = KimiLinearConfig.preset("kimi-linear-48b-a3b")
    hub = {k: v for k, v in preset.to_hf_dict().items() if k not in ("layer_types", "mlp_layer_types", "n_group",
                                                                      "num_experts_per_tok", "num_shared_experts",
                                                                      "max_position_embeddings", "moe_renormalize")}
    hub.update(num_expert_group=1, num_experts_per_token=8, num_shared_experts=1, model_max_length=1048576,
               moe_renormalize=True, first_k_dense_replace=1)
    assert hub["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]
    ours, theirs = AutoConfig.from_hf(hub), HFConfig(**hub)
    assert ours == preset
    assert [k.attention + "_attention" for k in ours.layer_kinds()] == theirs.layer_types
    assert ["sparse" if k.moe else "dense" for k in ours.layer_kinds()] == theirs.mlp_layer_types
    assert ours.num_experts_per_tok == theirs.num_experts_per_tok == 8
    lists = {**hub, "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}}
    assert [k.attention + "_attention" for k in AutoConfig.from_hf(lists).layer_kinds()] == HFConfig(
        **lists).layer_types


@pytest.mark.parametrize("mixer", ["kda", "gated_deltanet"])
@pytest.mark.parametrize(("sizes", "rules"), [({"fsdp": 2, "tensor": 2}, "default"),
                                              ({"fsdp": 2, "expert": 2}, "ep-as-cp")])
def test_kda_keeps_its_input_sharding_under_an_explicit_mesh(sizes, rules, mixer):
    """Heads split over 'tensor', or the sequence over 'expert' (ep-as-cp): KDA's output (and Qwen's Gated
    DeltaNet's) comes back laid out as its input arrived, the rule set's layout or replicated (traced abstractly:
    the layouts are types under Explicit axes, nothing is compiled)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnx_zoo.models.kimi_linear.mixers import KimiDeltaAttention
    from nnx_zoo.models.qwen3_next.mixers import GatedDeltaNet
    from nnx_zoo.sharding import get_rules, logical_to_mesh_axes, make_mesh, use_rules

    mesh = make_mesh(sizes, shard_mode="explicit", devices=jax.devices()[:4])
    kda = (KimiDeltaAttention(32, heads=2, head_dim=8, conv_kernel=4, rngs=nnx.Rngs(0)) if mixer == "kda" else
           GatedDeltaNet(32, key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_kernel=4, packed=False,
                         rngs=nnx.Rngs(0)))
    spec = logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), get_rules(rules), mesh)
    assert (spec[1] == "expert") == (rules == "ep-as-cp")
    with jax.set_mesh(mesh), use_rules(rules):
        for in_spec in (spec, P(None, None, None)):
            x = jax.ShapeDtypeStruct((4, 8, 32), jnp.float32, sharding=NamedSharding(mesh, in_spec))
            out = nnx.eval_shape(lambda m, x: m(x, None, None, None), kda, x)
            assert out.sharding.spec == in_spec, (in_spec, out.sharding)
