"""GPT-OSS beyond the shared MoE tests (``test_moe_exact``: logits, aux loss, both export directions, every
``moe_impl``; ``test_dense_generate``: cached greedy decoding past the window against transformers' ``generate``):

- every hidden state and the experts chosen equal transformers' on a left-padded batch (4 layers alternating a
  window of 4 with full attention, YaRN, the SwiGLU clamp at 1 so it bites, every weight random: sinks and
  biases included);
- turning each distinctive part off moves the logits: sinks, the window, the attention biases, YaRN, the expert
  biases, the clamp, alpha, the up projection's +1, the router bias;
- a synthetic MXFP4 checkpoint (the release's format: ``*_blocks`` ``U8`` + ``*_scales`` UE8M0 per 32 values)
  reads as a hand-written numpy dequantization of it, to the logits transformers computes from it;
- the presets count what transformers builds for them and what OpenAI published; the release's config.json reads
  as the preset, as transformers reads it.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

from nnx_zoo import AutoModelForCausalLM, GptOssConfig
from nnx_zoo.hf import CheckpointMismatchError
from nnx_zoo.layers.mlp import Glu
from tests.models.dense_reference import left_padded_batch, make_hf, rel_err, save_hf

TOL = 1e-5
# 4 layers (sliding, full, sliding, full), window 4 of the batch's 10 tokens, YaRN x4 over 16 positions; expert
# width 32 so that MXFP4's 32-value groups tile both expert matrices.
HF_CONFIG = dict(num_hidden_layers=4, intermediate_size=32, rope_parameters=dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
    beta_slow=1.0, truncate=False))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = make_hf("gpt_oss", seed=7, **HF_CONFIG)
    path = save_hf(hf, tmp_path_factory.mktemp("gpt_oss") / "hf")
    ids, mask = left_padded_batch(hf.config.vocab_size, seed=7)
    model = AutoModelForCausalLM.from_pretrained(path)
    forward = nnx.jit(lambda m, i, k: m(i, k))
    return hf, path, ids, mask, model, forward, np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))


def test_hidden_states_and_expert_choices_equal_transformers(setup):
    hf, _, ids, mask, model, _, _ = setup
    out = model.forward(jnp.asarray(ids), jnp.asarray(mask), with_hidden_states=True, with_routing=True)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                 output_hidden_states=True, output_router_logits=True)
    assert len(ref.hidden_states) == out.hidden_states.shape[0] == 5
    errors = [rel_err(np.asarray(ours), theirs.numpy(), keep=mask) for ours, theirs in
              zip(out.hidden_states, ref.hidden_states)]
    assert max(errors) < TOL, errors
    assert rel_err(np.asarray(out.logits), ref.logits.numpy(), keep=mask) < TOL
    k = hf.config.num_experts_per_tok
    for layer, logits in enumerate(ref.router_logits):  # [tokens, E] per layer, the router bias included
        theirs = torch.topk(logits, k, dim=-1).indices.numpy().reshape(*ids.shape, k)
        ours = np.asarray(out.expert_indices[layer])
        np.testing.assert_array_equal(np.sort(ours, -1)[mask == 1], np.sort(theirs, -1)[mask == 1])


def _set(value: float, *names: str):
    """A variant that sets the Variables ``names`` (paths under each layer stack) to ``value``."""
    def apply(model):
        for stack in (model.sliding_layers, model.layers):
            for name in names:
                var = stack
                for part in name.split("."):
                    var = getattr(var, part)
                var[...] = jnp.full_like(var[...], value)
        return model
    return apply


def _no_up_offset(model):
    for stack in (model.sliding_layers, model.layers):
        act = stack.mlp.experts.act
        stack.mlp.experts.act = Glu(act.limit, act.alpha, 0.0)
    return model


# part -> (config overrides, change to the loaded model): each turns one part of GPT-OSS off.
PARTS = {
    "sinks": ({}, _set(-1e30, "attn.sinks")),  # a sink logit of -inf takes no probability: no sink
    "window": ({"sliding_window": None}, None),
    "attention biases": ({}, _set(0.0, *(f"attn.{p}_proj.bias" for p in "qkvo"))),
    "yarn": ({"rope_scaling": None}, None),
    "expert biases": ({}, _set(0.0, "mlp.experts.wi_gate_bias", "mlp.experts.wi_up_bias", "mlp.experts.wo_bias")),
    "clamp": ({"swiglu_limit": None}, None),
    "alpha": ({"swiglu_alpha": 1.0}, None),
    "up + 1": ({}, _no_up_offset),
    "router bias": ({}, _set(0.0, "mlp.router_bias")),
}


@pytest.mark.parametrize("part", PARTS)
def test_each_part_turned_off_moves_the_logits(setup, part):
    _, path, ids, mask, _, forward, base = setup
    overrides, change = PARTS[part]
    model = AutoModelForCausalLM.from_pretrained(path, **overrides)
    if change is not None:
        model = change(model)
    moved = rel_err(np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask))), base, keep=mask)
    print(f"{part}: logits moved by {moved:.2e}")
    assert moved > 1e-3, (part, moved)


# ---------------------------------------------------------------- MXFP4
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An expert tensor ``[E, in, out]`` as the release stores it: ``blocks [E, out, in / 32, 16]`` (two E2M1
    codes a byte, the even input in the low nibble), ``scales [E, out, in / 32]`` (UE8M0: ``2^(byte - 127)``, the
    smallest power of two bringing the group's largest magnitude within 6)."""
    groups = np.swapaxes(w.astype(np.float64), -1, -2).reshape(*w.shape[:-2], w.shape[-1], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1, keepdims=True), 1e-30) / 6.0)).astype(np.int64)
    codes = np.abs(groups[..., None] / 2.0 ** exponent[..., None] - E2M1).argmin(-1)
    return (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8), (exponent[..., 0] + 127).astype(np.uint8)


def _numpy_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The reading of an MXFP4 tensor, written out: ``[E, out, G, 16]`` bytes and ``[E, out, G]`` scales ->
    ``[E, in, out]`` (input ``32 g + 2 j`` is byte ``j``'s low nibble, ``32 g + 2 j + 1`` its high one)."""
    values = np.stack([E2M1[blocks & 0xF], E2M1[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = values * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)


def test_mxfp4_checkpoint_reads_as_numpy_dequantizes_it(setup, tmp_path):
    from transformers import AutoModelForCausalLM as HFAuto
    from transformers import Mxfp4Config

    hf, _, ids, mask, _, forward, _ = setup
    state, want = {}, {}
    for key, value in hf.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize_mxfp4(value.numpy())
            state[key + "_blocks"], state[key + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            want[key] = _numpy_dequantize(blocks, scales)
        else:
            state[key] = value.contiguous()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = {**hf.config.to_dict(), "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (tmp_path / "config.json").write_text(json.dumps(config))

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, stack in model.layer_stacks().items():
        for j, i in enumerate(dict((n, idx) for n, _, idx in model.config.layer_stacks())[name]):
            gate_up, down = (want[f"model.layers.{i}.mlp.experts.{p}"] for p in ("gate_up_proj", "down_proj"))
            np.testing.assert_array_equal(np.asarray(stack.mlp.experts.wi_gate[j]), gate_up[..., 0::2])
            np.testing.assert_array_equal(np.asarray(stack.mlp.experts.wi_up[j]), gate_up[..., 1::2])
            np.testing.assert_array_equal(np.asarray(stack.mlp.experts.wo[j]), down)
    # transformers reads the same file (dequantizing it, as it does on a CPU) to the same logits
    theirs = HFAuto.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    with torch.no_grad():
        ref = theirs.eval()(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits
    assert rel_err(np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask))), ref.numpy(), keep=mask) < TOL

    # A file of MXFP4 blocks whose config.json does not say so is refused, saying what it lacks.
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(CheckpointMismatchError, match='quant_method "mxfp4"'):
        AutoModelForCausalLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------- presets and config.json
# OpenAI's published counts (model card): total and active parameters, active without the input embedding.
PUBLISHED = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_count_what_transformers_builds_and_what_was_published(preset):
    from transformers import GptOssConfig as HFConfig
    from transformers import GptOssForCausalLM

    config = GptOssConfig.preset(preset)
    counts = config.num_parameters()
    with torch.device("meta"):
        theirs = GptOssForCausalLM(HFConfig(**config.to_hf_dict()))
    assert counts.total == sum(p.numel() for p in theirs.parameters())
    total, active = PUBLISHED[preset]
    assert round(counts.total / 1e7) == round(total / 1e7) and round((counts.active - counts.embedding) / 1e7) == \
        round(active / 1e7), counts
    # Training FLOPs count a sliding layer's attention over its window (128 keys), not half the sequence.
    full = config.with_overrides(sliding_window=None)
    per_key = 12 * config.num_attention_heads * config.head_dim
    saved = config.num_hidden_layers // 2 * per_key * (4096 / 2 - (128 * 129 / 2 + (4096 - 128) * 128) / 4096)
    assert full.train_flops_per_token(4096) - config.train_flops_per_token(4096) == pytest.approx(saved)
    assert config.train_flops_per_token(128) == full.train_flops_per_token(128)  # the window covers it all


# The release's gpt-oss-20b config.json (its model-defining keys; 120b differs in num_hidden_layers=36 and
# num_local_experts=128): legacy rope_scaling, MXFP4 quantization_config, keys transformers does not read.
HUB_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "use_cache": True, "vocab_size": 201088,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def test_the_release_config_reads_as_the_preset_and_as_transformers_reads_it():
    from transformers import GptOssConfig as HFConfig

    ours = GptOssConfig.from_hf(HUB_20B)
    assert ours == GptOssConfig.preset("gpt-oss-20b") and ours.layer_types is None  # the default alternation
    theirs = HFConfig(**HUB_20B)
    # Without a rope block, layer types or kv heads: transformers' defaults (YaRN x32, alternating, 8).
    bare = {k: v for k, v in HUB_20B.items() if k not in ("rope_scaling", "rope_theta", "layer_types",
                                                         "num_key_value_heads", "head_dim")}
    for mine, hub in ((ours, theirs), (GptOssConfig.from_hf(bare), HFConfig(**bare))):
        rope = {k: v for k, v in mine.to_hf_dict()["rope_scaling"].items() if k != "type"}
        assert rope == {k: v for k, v in hub.rope_parameters.items() if k != "rope_theta"}
        assert mine.rope_theta == hub.rope_parameters["rope_theta"]
        assert list(mine.attention_types) == hub.layer_types
        for name in ("num_key_value_heads", "head_dim", "swiglu_alpha", "swiglu_limit", "sliding_window"):
            assert getattr(mine, name) == getattr(hub, name), name
    # The default rope is written as such: a null rope block would read back (here and in transformers) as YaRN.
    plain = GptOssConfig.preset("gpt-oss-tiny", rope_scaling=None).to_hf_dict()
    assert GptOssConfig.from_hf(plain).rope_scaling is None
    assert HFConfig(**plain).rope_parameters["rope_type"] == "default"
    with pytest.raises(ValueError, match="head_dim is null"):
        GptOssConfig.from_hf({**HUB_20B, "head_dim": None})
    with pytest.raises(ValueError, match="layer_types"):
        GptOssConfig.preset("gpt-oss-tiny", layer_types=["chunked_attention"] * 4)
