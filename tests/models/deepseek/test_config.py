"""DeepSeekV3Config: presets, validation, HF config.json in both rope layouts, parameter counts vs HF; the
transformers architectures it reads and writes (DeepSeek-V3, V2, V3.2 with its indexer; Kimi K2 read as V3)."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
import torch
from flax import nnx
from transformers import AutoConfig as HFAutoConfig
from transformers import DeepseekV2Config as HFConfigV2
from transformers import DeepseekV3Config as HFConfig
from transformers import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
from transformers import DeepseekV32Config as HFConfigV32

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.deepseek.config import PRESETS
from nnx_zoo.sharding import abstract_module

NNX_ONLY = ("dtype", "param_dtype", "moe_impl", "moe_capacity_factor", "batch_split_factor", "scan_layers",
            "remat_policy", "seq_aux_loss_alpha")
HF_CONFIGS = {"deepseek_v3": HFConfig, "deepseek_v2": HFConfigV2, "deepseek_v32": HFConfigV32}


def hf_fields(c: DeepSeekV3Config) -> dict:
    return {k: v for k, v in dataclasses.asdict(c).items() if k not in NNX_ONLY}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip_through_hf(name):
    config = DeepSeekV3Config.preset(name)
    again = DeepSeekV3Config.from_hf(config.to_hf_dict())
    assert hf_fields(again) == hf_fields(config)
    hf = config.to_hf_dict()
    hf_config = HF_CONFIGS[hf["model_type"]](**hf)  # transformers takes it
    assert (hf_config.n_routed_experts, hf_config.q_lora_rank) == (config.n_routed_experts, config.q_lora_rank)
    assert getattr(hf_config, "index_topk", 0) == config.index_topk  # V3 / V2 have none and write none
    assert config.index_topk or not [k for k in hf if k.startswith("index_")]


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


# name -> (total, active) as counted here and by transformers' DeepseekV32ForCausalLM / DeepseekV3ForCausalLM on the
# meta device (checked once; test_num_parameters_match_hf_and_our_model checks the formula on small shapes), and
# the published total it is within 1.5% of.
BIG_PRESETS = {
    # V3 + 61 indexers of 1536*64*128 + 7168*(128+64) + 2*128; DeepSeek's model card: 685B, counting the MTP
    # layer and its copies of embedding and head (include_mtp adds the layer, not the copies: 2 * 129280 * 7168)
    "deepseek3.2-671b": (671_877_929_216, 38_403_807_488, 685e9),
    "kimi-k2-1t": (1_026_408_209_408, 32_861_477_888, 1.04e12),  # Moonshot's tech report: 1.04T, 32.6B active
}


@pytest.mark.parametrize("name", sorted(BIG_PRESETS))
def test_big_preset_sizes(name):
    total, active, published = BIG_PRESETS[name]
    config = DeepSeekV3Config.preset(name)
    counts = config.num_parameters()
    assert (counts.total, counts.active) == (total, active)
    with_mtp = config.num_parameters(include_mtp=True).total
    copies = 2 * config.vocab_size * config.hidden_size * config.num_nextn_predict_layers
    assert abs(with_mtp + copies - published) / published < 0.015
    v3 = DeepSeekV3Config.preset("deepseek3-671b").num_parameters()
    if config.index_topk:  # V3's shape plus 0.85B of indexers, which are active too
        assert total - v3.total == active - v3.active == 61 * (1536 * 64 * 128 + 7168 * (128 + 64) + 2 * 128)
    else:
        assert abs(active - 32.6e9) / 32.6e9 < 0.01


# A small DeepseekV32Config (transformers' own class): 4 layers, an indexer of 2 heads x 8 keeping 4 keys.
V32_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                 num_attention_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, index_topk=4,
                 index_n_heads=2, index_head_dim=8)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 5e4, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("layout, dense_layers", [
    (dict(first_k_dense_replace=1), 1),
    # transformers' spelling of the dense layers wins over first_k_dense_replace (3 by default in this dict)
    (dict(mlp_layer_types=["dense", "dense", "sparse", "sparse"]), 2),
    (dict(first_k_dense_replace=0, rope_parameters=YARN), 0),
], ids=["first_k_dense_replace", "mlp_layer_types", "yarn"])
def test_deepseek_v32_config_from_transformers_and_back(layout, dense_layers):
    hf = HFConfigV32(**V32_SHAPE, **layout).to_dict()
    config = DeepSeekV3Config.from_hf(hf)
    assert {k: getattr(config, k) for k in V32_SHAPE} == V32_SHAPE
    assert (config.first_k_dense_replace, config.hf_model_type, config.topk_method) == (
        dense_layers, "deepseek_v32", "noaux_tc")
    assert config.rope_interleave and config.num_nextn_predict_layers == 0  # transformers' V3.2 has no MTP field
    assert config.rope_scaling == (YarnScaling(4.0, 64, 32.0, 1.0, 1.0, 1.0) if "rope_parameters" in layout else None)
    out = config.to_hf_dict()
    assert (out["model_type"], out["architectures"]) == ("deepseek_v32", ["DeepseekV32ForCausalLM"])
    back = HFAutoConfig.for_model("deepseek_v32", **{k: v for k, v in out.items() if k != "model_type"})
    assert type(back) is HFConfigV32 and {k: getattr(back, k) for k in V32_SHAPE} == V32_SHAPE
    assert back.mlp_layer_types == hf["mlp_layer_types"]
    assert {k: back.rope_parameters[k] for k in ("rope_type", "rope_theta")} == {
        k: hf["rope_parameters"][k] for k in ("rope_type", "rope_theta")}
    assert DeepSeekV3Config.from_hf(out) == config
    with torch.device("meta"):  # the indexer's parameters are counted as transformers has them
        assert sum(p.numel() for p in DeepseekV32ForCausalLM(back).parameters()) == config.num_parameters().total


def test_deepseek_v32_dense_layers_must_come_first():
    interleaved = HFConfigV32(**V32_SHAPE, mlp_layer_types=["dense", "sparse", "dense", "sparse"]).to_dict()
    with pytest.raises(ValueError, match="mlp_layer_types .* is not supported .*dense layers first"):
        DeepSeekV3Config.from_hf(interleaved)


# moonshotai/Kimi-K2-Instruct's config.json (July 2025), the fields that shape the model, as MaxText's
# configs/models/kimi-k2-1t.yml copies them, plus what every DeepSeek-V3-architecture config.json carries.
KIMI_K2_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "num_nextn_predict_layers": 0, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 50000.0,
    "max_position_embeddings": 131072, "rope_scaling": {"type": "yarn", "factor": 32.0,
    "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
    "mscale_all_dim": 1.0}, "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 163584,
    "eos_token_id": 163585, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


def test_kimi_k2_config_json_reads_as_the_preset_and_exports_as_deepseek_v3():
    config = DeepSeekV3Config.from_hf(KIMI_K2_CONFIG_JSON)
    assert config == DeepSeekV3Config.preset("kimi-k2-1t") and config.hf_model_type == "deepseek_v3"
    out = config.to_hf_dict()  # transformers has no kimi_k2: its DeepSeek-V3 loads Kimi K2
    assert (out["model_type"], out["architectures"]) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    hf = HFConfig(**out)
    assert (hf.n_routed_experts, hf.n_group, hf.routed_scaling_factor, hf.rope_parameters["rope_theta"],
            hf.rope_parameters["factor"], hf.rope_parameters["beta_fast"]) == (384, 1, 2.827, 50000.0, 32.0, 1.0)
    with pytest.raises(ValueError, match="'greedy' is not a deepseek_v3 router"):  # read as V3, routed as V3
        DeepSeekV3Config.from_hf({**KIMI_K2_CONFIG_JSON, "topk_method": "greedy", "scoring_func": "softmax"})


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
