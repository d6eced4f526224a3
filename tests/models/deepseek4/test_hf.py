"""DeepSeek-V4's Hugging Face I/O: ``config.json`` in both forms (DeepSeek's hub file and transformers' own) read
as transformers reads it; our save reloads in transformers with the same logits; the release's tensor naming
loads; the MTP layer is read and written; the published sizes' parameter counts."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV4Config as HFConfig
from transformers import DeepseekV4ForCausalLM

from nnx_zoo import AutoModelForCausalLM, DeepSeekV4, DeepSeekV4Config
from nnx_zoo.hf import CheckpointMismatchError
from nnx_zoo.models.deepseek4.config import CSA, HCA, SLIDING
from tests.models.deepseek4.reference import hf_config, hf_outputs, make_hf_model, rel

# DeepSeek-V4-Flash-Base's config.json as published (its hub file: compress_ratios with the MTP layer's last,
# num_hash_layers, legacy rope_scaling for the compressed layers).
FLASH_HUB = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.5,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "scoring_func": "sqrtsoftplus", "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "topk_method": "noaux_tc", "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def _as_transformers_reads(d: dict) -> dict:
    """The fields transformers' config class makes of ``d``, in our names."""
    hf = HFConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type", "torch_dtype")})
    compress = hf.rope_parameters["compress"]
    return dict(layer_types=tuple(hf.layer_types), mlp_layer_types=tuple(hf.mlp_layer_types),
                compress_rate_csa=hf.compress_rates[CSA], compress_rate_hca=hf.compress_rates[HCA],
                rope_theta=hf.rope_parameters["main"]["rope_theta"], compress_rope_theta=compress["rope_theta"],
                qk_rope_head_dim=hf.qk_rope_head_dim, yarn=compress.get("factor"),
                yarn_attention_factor=compress.get("attention_factor"))


def _as_we_read(c: DeepSeekV4Config) -> dict:
    return dict(layer_types=c.layer_types, mlp_layer_types=c.mlp_layer_types, compress_rate_csa=c.compress_rate_csa,
                compress_rate_hca=c.compress_rate_hca, rope_theta=c.rope_theta,
                compress_rope_theta=c.compress_rope_theta, qk_rope_head_dim=c.qk_rope_head_dim,
                yarn=None if c.rope_scaling is None else c.rope_scaling.factor,
                yarn_attention_factor=None if c.rope_scaling is None else c.rope_scaling.attention_factor)


@pytest.mark.parametrize("form", ["hub", "transformers"])
def test_config_json_reads_as_transformers_reads_it(form):
    d = FLASH_HUB if form == "hub" else HFConfig(**{k: v for k, v in FLASH_HUB.items() if k not in (
        "architectures", "model_type", "torch_dtype")}).to_dict()
    ours = DeepSeekV4Config.from_hf(d)
    assert _as_we_read(ours) == _as_transformers_reads(d)
    assert ours == DeepSeekV4Config.preset("deepseek4-flash")  # the preset is the published model
    # What we write, transformers reads back to the same fields, and so do we.
    written = ours.to_hf_dict()
    assert _as_transformers_reads(written) == _as_we_read(ours)
    assert DeepSeekV4Config.from_hf(written) == ours


def test_published_sizes():
    flash, pro = DeepSeekV4Config.preset("deepseek4-flash"), DeepSeekV4Config.preset("deepseek4-pro")
    # DeepSeek publishes 284B / 13B (Flash) and 1.6T / 49B (Pro); "active" there leaves out the input embedding.
    assert round(flash.num_parameters().total / 1e9) == 284
    assert round((flash.num_parameters().active - flash.num_parameters().embedding) / 1e9) == 13
    assert round(pro.num_parameters(include_mtp=True).total / 1e12, 1) == 1.6
    assert round((pro.num_parameters().active - pro.num_parameters().embedding) / 1e9) == 49
    assert flash.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and pro.layer_types[:4] == (HCA, HCA, HCA, CSA)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    hf = make_hf_model(hf_config("parts"), seed=31)
    path = tmp_path_factory.mktemp("v4-hf")
    hf.save_pretrained(path)
    ids = np.random.default_rng(3).integers(0, hf.config.vocab_size, (2, 17))
    return hf, path, ids, hf_outputs(hf, ids)["logits"]


def test_transformers_reloads_our_save_with_the_same_logits(case, tmp_path):
    hf, path, ids, want = case
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, DeepSeekV4)
    assert rel(model(jnp.asarray(ids)), want) < 1e-5
    model.save_pretrained(tmp_path)
    reloaded = DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert rel(reloaded(torch.as_tensor(ids)).logits.numpy(), want) < 1e-6
    assert sorted(load_file(tmp_path / "model-00001-of-00001.safetensors")) == sorted(
        load_file(path / "model.safetensors"))  # the same keys transformers writes


def test_the_release_naming_and_hub_config_load(case, tmp_path):
    """transformers' save renamed to DeepSeek's own keys, with a hub-style config.json, plus an MTP layer: both
    libraries read it, to the same logits; our save writes the MTP layer back in the release's naming."""
    hf, path, ids, want = case
    tensors = load_file(path / "model.safetensors")
    renamed = {}
    for key, value in tensors.items():
        key = key.removeprefix("model.")
        key = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
               "hc_head.hc_scale": "hc_head_scale"}.get(key, key)
        renamed[key] = value
    # An MTP layer: a sliding-window block with a top-k MoE (the main model's layer 1 supplies same-shaped tensors).
    mtp = {f"mtp.0.{k.removeprefix('layers.1.')}": v for k, v in renamed.items()
           if k.startswith("layers.1.") and ".compressor." not in k and ".indexer." not in k}
    rng = np.random.default_rng(0)
    width = hf.config.hidden_size
    for name, shape in (("enorm.weight", (width,)), ("hnorm.weight", (width,)), ("norm.weight", (width,)),
                        ("e_proj.weight", (width, width)), ("h_proj.weight", (width, width)),
                        ("hc_head_fn", tensors["model.hc_head.hc_fn"].shape), ("hc_head_base", (hf.config.hc_mult,)),
                        ("hc_head_scale", (1,))):
        mtp[f"mtp.0.{name}"] = rng.normal(size=shape).astype(np.float32) * 0.3
    save_file({**renamed, **mtp}, str(tmp_path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    # The hub's legacy keys (compress_ratios itself only names rates 4 and 128 to transformers: the published
    # FLASH_HUB test reads it).
    for key in ("mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor"):
        config.pop(key)
    config.update(num_hash_layers=1,
                  qk_rope_head_dim=8, compress_rate_csa=2, compress_rate_hca=4, num_nextn_predict_layers=1,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                                "beta_slow": 1})
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = DeepSeekV4.from_pretrained(tmp_path)
    assert ours.mtp_layers is not None and rel(ours(jnp.asarray(ids)), want) < 1e-5
    theirs = DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()  # transformers skips the MTP layer
    with torch.no_grad():
        assert rel(theirs(torch.as_tensor(ids)).logits.numpy(), want) < 1e-6
    out = tmp_path / "again"
    ours.save_pretrained(out)
    written = load_file(out / "model-00001-of-00001.safetensors")
    for key, value in mtp.items():
        np.testing.assert_array_equal(written[key], value)
    mtp_out = ours.forward(jnp.asarray(ids), with_mtp=True)
    again = DeepSeekV4.from_pretrained(out).forward(jnp.asarray(ids), with_mtp=True)
    np.testing.assert_array_equal(np.asarray(again.mtp_logits), np.asarray(mtp_out.mtp_logits))


def test_a_checkpoint_of_another_schedule_is_refused_naming_the_tensors(case, tmp_path):
    _, path, _, _ = case
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = [SLIDING, SLIDING, HCA]  # layer 1 is a CSA layer in the files
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.1\.attn\.indexer"):
        DeepSeekV4.from_pretrained(tmp_path)
