"""DeepSeekV3Config: presets, validation, HF config.json in both rope layouts, parameter counts vs HF."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
import torch
from flax import nnx
from transformers import DeepseekV2Config as HFConfigV2
from transformers import DeepseekV3Config as HFConfig
from transformers import DeepseekV3ForCausalLM

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.deepseek.config import PRESETS
from nnx_zoo.sharding import abstract_module

NNX_ONLY = ("dtype", "param_dtype", "moe_impl", "moe_capacity_factor", "batch_split_factor", "scan_layers",
            "remat_policy", "seq_aux_loss_alpha")


def hf_fields(c: DeepSeekV3Config) -> dict:
    return {k: v for k, v in dataclasses.asdict(c).items() if k not in NNX_ONLY}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip_through_hf(name):
    config = DeepSeekV3Config.preset(name)
    again = DeepSeekV3Config.from_hf(config.to_hf_dict())
    assert hf_fields(again) == hf_fields(config)
    hf = config.to_hf_dict()
    hf_config = {"deepseek_v3": HFConfig, "deepseek_v2": HFConfigV2}[hf["model_type"]](**hf)  # transformers takes it
    assert (hf_config.n_routed_experts, hf_config.q_lora_rank) == (config.n_routed_experts, config.q_lora_rank)


def test_tiny_is_maxtext_deepseek3_tiny():
    c = DeepSeekV3Config.preset("deepseek3-tiny")
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 4, 32, 16)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert (c.num_hidden_layers, c.first_k_dense_replace, c.intermediate_size) == (61, 3, 64)
    assert (c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok, c.n_shared_experts) == (16, 64, 8, 1)
    assert (c.routed_scaling_factor, c.vocab_size) == (2.5, 129280)
    assert (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (40.0, 4096)


def test_real_model_sizes():
    v3 = DeepSeekV3Config.preset("deepseek3-671b").num_parameters()
    assert 670e9 < v3.total < 672e9 and 37e9 < v3.active < 38e9
    lite = DeepSeekV3Config.preset("deepseek2-lite").num_parameters()
    assert 15.6e9 < lite.total < 15.8e9 and 2.4e9 < lite.active - lite.embedding < 2.5e9  # published: 15.7B, 2.4B
    v2 = DeepSeekV3Config.preset("deepseek2-236b").num_parameters()
    assert 235e9 < v2.total < 237e9 and 21e9 < v2.active < 22e9  # published: 236B, 21B


def test_validation_lists_every_problem():
    with pytest.raises(ValueError) as info:
        DeepSeekV3Config.preset("deepseek3-mini", n_routed_experts=9, topk_group=5, first_k_dense_replace=7,
                                qk_rope_head_dim=5, moe_impl="fast", q_lora_rank=0)
    message = str(info.value)
    for fragment in ("divisible by n_group", "topk_group=5 must be <= n_group=4", "first_k_dense_replace=7",
                     "qk_rope_head_dim must be even", "moe_impl", "q_lora_rank"):
        assert fragment in message
    with pytest.raises(ValueError, match="exceeds the 4 experts"):
        DeepSeekV3Config.preset("deepseek3-mini", num_experts_per_tok=5, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be <= n_routed_experts=8"):
        DeepSeekV3Config.preset("deepseek3-mini", num_experts_per_tok=9)
    with pytest.raises(ValueError, match="at least 2 experts"):
        DeepSeekV3Config.preset("deepseek3-mini", n_group=8, topk_group=8)
    with pytest.raises(ValueError, match="remat_policy"):
        DeepSeekV3Config().with_overrides(remat_policy="sometimes")


def test_from_hf_reads_both_rope_layouts(tmp_path):
    base = DeepSeekV3Config.preset("deepseek3-671b").to_hf_dict()
    legacy = dict(base)  # the hub's layout: rope_scaling + top-level rope_theta
    new = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {**base["rope_scaling"], "rope_theta": 10000.0}
    new["rope_parameters"].pop("type")
    (tmp_path / "config.json").write_text(json.dumps(new))
    from_legacy, from_new = DeepSeekV3Config.from_hf(legacy), DeepSeekV3Config.from_hf(tmp_path)
    assert from_legacy == from_new
    assert from_new.rope_scaling == YarnScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    theta_inside = dict(new, rope_parameters={**new["rope_parameters"], "rope_theta": 50000.0}, rope_theta=1.0)
    assert DeepSeekV3Config.from_hf(theta_inside).rope_theta == 50000.0
    default_rope = dict(new, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    c = DeepSeekV3Config.from_hf(default_rope)
    assert c.rope_scaling is None and c.rope_theta == 20000.0
    assert DeepSeekV3Config.from_hf({**legacy, "num_nextn_predict_layers": 0}).num_nextn_predict_layers == 0
    assert DeepSeekV3Config.from_hf(legacy, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="scoring_func 'softmax' does not match topk_method 'noaux_tc'"):
        DeepSeekV3Config.from_hf({**legacy, "scoring_func": "softmax"})


@pytest.mark.parametrize("overrides", [
    {},
    {"q_lora_rank": None, "attention_bias": True, "tie_word_embeddings": True, "n_shared_experts": 2},
    {"num_hidden_layers": 2, "first_k_dense_replace": 2},
])
def test_num_parameters_match_hf_and_our_model(overrides):
    config = DeepSeekV3Config.preset("deepseek3-mini", vocab_size=512, **overrides)
    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(HFConfig(**config.to_hf_dict()))
    assert config.num_parameters().total == sum(p.numel() for p in hf.parameters())
    abstract = abstract_module(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)))
    ours = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert ours == config.num_parameters(include_mtp=True).total


def test_train_flops_per_token():
    c = DeepSeekV3Config.preset("deepseek3-small")
    counts = c.num_parameters()
    attention = 3 * 1024 * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * c.num_hidden_layers
    assert c.train_flops_per_token(1024) == 6 * (counts.active - counts.embedding) + attention
    tied = c.with_overrides(tie_word_embeddings=True)
    assert tied.train_flops_per_token(1024) == 6 * tied.num_parameters().active + attention
    assert c.train_flops_per_token(2048) > c.train_flops_per_token(1024)


def test_config_json_without_an_mla_or_moe_shape_field_names_it_and_transformers_configs_load(tmp_path):
    full = DeepSeekV3Config.preset("deepseek3-mini").to_hf_dict()
    missing = ("kv_lora_rank", "n_routed_experts")
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k not in missing}))
    with pytest.raises(ValueError, match="missing required field\\(s\\) kv_lora_rank, n_routed_experts:"):
        DeepSeekV3Config.from_hf(tmp_path)
    # A config transformers writes holds every required field.
    assert DeepSeekV3Config.from_hf(HFConfig(**hf_fields(DeepSeekV3Config.preset("deepseek3-mini"))).to_dict())
    with pytest.raises(TypeError, match="'kv_lora_rnk' \\(did you mean 'kv_lora_rank'"):
        DeepSeekV3Config.preset("deepseek3-mini", kv_lora_rnk=8)
    with pytest.raises(ValueError, match="dtype='bf16' is not a dtype; use one of float32, bfloat16"):
        DeepSeekV3Config.preset("deepseek3-mini", dtype="bf16")
