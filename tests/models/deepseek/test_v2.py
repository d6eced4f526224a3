"""DeepSeek-V2 (``topk_method`` greedy / group_limited_greedy) beyond the logits parity of test_parity.py:
config.json as transformers' DeepseekV2Config writes it, checkpoints both ways through ``AutoModelForCausalLM``,
generation with the MLA cache against transformers' greedy ``generate``, expert parallelism on a mesh, and the
recipe on the V2 tiny preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file
from transformers import DeepseekV2Config as HFConfigV2
from transformers import DeepseekV2ForCausalLM

from nnx_zoo import AutoModelForCausalLM, DeepSeekV3, DeepSeekV3Config, generate
from nnx_zoo.sharding import abstract_module, iter_variables
from tests.models.deepseek.hf_reference import load_recipe, make_hf_model, rel_l2, save_hf
from tests.models.deepseek.test_generate import _forward, _prompts
from tests.models.deepseek.test_mesh_matrix import V2_CASES, V2_ROUTER, Setup, assert_same, run

IDS = np.random.default_rng(2).integers(0, 96, (2, 9)).astype(np.int32)
# group-limited top-2 of 8 in 2 of 4 groups, a single q_proj, V2's routed scaling.
HF_V2 = dict(arch="v2", topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=2,
             q_lora_rank=None, routed_scaling_factor=16.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, DeepseekV2ForCausalLM, np.ndarray]:
    """A transformers-saved random V2 checkpoint, its model, and its logits for ``IDS``."""
    hf = make_hf_model(seed=11, **HF_V2)
    path = save_hf(hf, tmp_path_factory.mktemp("v2"))
    with torch.no_grad():
        logits = hf(torch.as_tensor(IDS)).logits.numpy()
    return path, hf, logits


def test_transformers_configs_read_and_write_back():
    written = HFConfigV2(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=8,
                         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_experts_per_tok=2).to_dict()
    c = DeepSeekV3Config.from_hf(written)  # DeepseekV2Config's defaults: greedy, no groups, no dense layer, ...
    assert (c.topk_method, c.n_group, c.topk_group, c.first_k_dense_replace) == ("greedy", None, None, 0)
    assert (c.n_shared_experts, c.routed_scaling_factor, c.norm_topk_prob, c.num_nextn_predict_layers) == (
        2, 1.0, False, 0)
    assert c.router.selection_bias is False and c.rope_interleave
    back = c.to_hf_dict()
    assert back["model_type"] == "deepseek_v2" and back["architectures"] == ["DeepseekV2ForCausalLM"]
    assert "rope_interleave" not in back and "num_nextn_predict_layers" not in back
    assert DeepSeekV3Config.from_hf(back) == c
    # The hub's V2-Lite config.json (legacy rope layout, keys transformers ignores) reads as the preset.
    lite = DeepSeekV3Config.preset("deepseek2-lite")
    hub = {**lite.to_hf_dict(), "moe_layer_freq": 1, "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1}
    assert DeepSeekV3Config.from_hf(hub) == lite

    with pytest.raises(ValueError) as info:
        DeepSeekV3Config.from_hf({**written, "topk_method": "noaux_tc", "mlp_bias": True, "moe_layer_freq": 2})
    for fragment in ("topk_method 'noaux_tc' is not a deepseek_v2 router", "mlp_bias", "moe_layer_freq=2"):
        assert fragment in str(info.value)
    with pytest.raises(ValueError, match="norm_topk_prob=True is not supported with topk_method='greedy'"):
        DeepSeekV3Config.from_hf({**written, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="n_group must be a positive integer"):
        DeepSeekV3Config.from_hf({**written, "topk_method": "group_limited_greedy"})
    with pytest.raises(ValueError, match="missing required field\\(s\\) kv_lora_rank"):
        DeepSeekV3Config.from_hf({k: v for k, v in written.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="cannot hold \\{'num_nextn_predict_layers': 1\\}"):
        c.with_overrides(num_nextn_predict_layers=1).to_hf_dict()


def test_v2_model_has_no_selection_bias_and_counts_like_transformers():
    config = DeepSeekV3Config.preset("deepseek2-tiny", vocab_size=512, num_hidden_layers=2)
    model = abstract_module(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)))
    assert not [p for p, _ in iter_variables(model) if "bias" in p]
    with torch.device("meta"):
        hf = DeepseekV2ForCausalLM(HFConfigV2(**config.to_hf_dict()))
    assert config.num_parameters().total == sum(p.numel() for p in hf.parameters())
    assert config.num_parameters().total == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_checkpoints_load_and_export_both_ways(checkpoint, tmp_path):
    path, _, hf_logits = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, moe_impl="dense")
    assert isinstance(model, DeepSeekV3) and model.config.topk_method == "group_limited_greedy"
    assert rel_l2(model(jnp.asarray(IDS)), hf_logits) < 1e-5
    out = tmp_path / "export"
    model.save_pretrained(out)
    keys = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert keys == set(load_file(path / "model.safetensors"))  # exactly transformers' key set (no bias keys)
    reloaded = DeepseekV2ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert rel_l2(reloaded(torch.as_tensor(IDS)).logits.numpy(), hf_logits) < 1e-6


def test_greedy_generation_cached_equals_uncached_and_transformers(checkpoint):
    path, hf, _ = checkpoint
    model = DeepSeekV3.from_pretrained(path, moe_impl="gmm")
    batch, prompt, new = 4, 5, 6
    ids, mask = _prompts(batch, prompt, model.config.vocab_size, seed=3)  # row 0 left-padded
    # transformers stops a row at its eos token (2 here) and pads it with 0: so do we.
    out = generate(model, ids, mask, max_new_tokens=new, stop_tokens=(hf.config.eos_token_id,), pad_token_id=0)
    with torch.no_grad():
        expected = hf.generate(torch.tensor(np.asarray(ids)), attention_mask=torch.tensor(np.asarray(mask)),
                               max_new_tokens=new, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected.numpy())
    full_mask = jnp.concatenate([mask, jnp.ones((batch, new), jnp.int32)], axis=1)
    uncached = np.asarray(jnp.argmax(_forward(model, out.tokens, full_mask)[:, prompt - 1:-1], axis=-1))
    generated = np.arange(new)[None] < np.asarray(out.lengths)[:, None]  # tokens before any stop's padding
    np.testing.assert_array_equal(uncached[generated], np.asarray(out.tokens)[:, prompt:][generated])
    assert generated.sum() > batch * new // 2


@pytest.mark.parametrize("case", V2_CASES, ids=lambda c: c.id)
def test_expert_parallel_training_equals_one_device(case):
    """V2's router (``V2_ROUTER``: softmax, top-2 within 2 of 4 groups, routed scaling, no selection bias) on the
    mesh matrix's model: two AdamW steps on a mesh give the single device's losses and gradients.

    The issue asks every MoE family for FSDP 8 and FSDP 4 x EP 2 under ``default``, ``ep-as-cp`` and
    ``shard-exp-on-fsdp``, Auto and Explicit. CI runs the five distinct (mesh, rule set) pairs once each, both
    modes on each mesh (``V2_CI_CASES``; ``NNX_ZOO_FULL_MATRIX=1``: all 12). They count towards the coverage of
    test_mesh_matrix.py's CI plan (``plan()`` picks V3 cases only for the meshes, rule sets and paths they leave;
    the model differs only in its router, and V3's tiny one has a single group, so V2's is the stricter test of
    routing under a mesh); Explicit FSDP 4 x EP 2 under ``ep-as-cp`` splits the experts and the sequence over
    'expert'.
    """
    want = run(Setup(config=V2_ROUTER))
    assert_same(run(Setup.of(case, config=V2_ROUTER)), want, f"V2 router, {case.id}")


def test_recipe_trains_the_v2_tiny_preset(tmp_path):
    recipe = load_recipe()
    run_dir = tmp_path / "run"
    args = ["--model", "deepseek2-tiny", "--model.num_hidden_layers", "1", "--model.first_k_dense_replace", "0",
            "--model.vocab_size", "256", "--batch", "8", "--seq-len", "16", "--steps", "2", "--no-progress",
            "--warmup-steps", "1", "--peak-flops", "1e11", "--run-dir", str(run_dir)]
    assert recipe.main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
