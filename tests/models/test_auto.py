"""The family registry and the dense families' bad input: ``AutoModelForCausalLM`` picks the class from
``config.json``'s ``model_type`` (DeepSeek-V3/V2, Llama, Qwen3), ``AutoConfig.preset`` reaches every family's
presets, and each misuse is a clear error: an unsupported ``model_type`` (the supported ones listed), one family's
loader on another's checkpoint (the right class named), key/value heads that do not divide the heads, an untied
checkpoint without ``lm_head.weight`` (a tied one loads, with or without a stored head), malformed inputs."""

from __future__ import annotations

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from nnx_zoo import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepSeekV3,
    DeepSeekV3Config,
    DeepSeekV4Config,
    Gemma3Config,
    Gemma4Config,
    Glm4MoEConfig,
    Glm5Config,
    GptOssConfig,
    KimiLinearConfig,
    Llama3,
    Llama3Config,
    Llama4Config,
    MiniMaxM2Config,
    Mistral4Config,
    MixtralConfig,
    Qwen3,
    Qwen3Config,
    Qwen3MoEConfig,
    Qwen3NextConfig,
    Qwen35Config,
    Qwen35MoEConfig,
)
from nnx_zoo.hf import CheckpointFormatError, CheckpointMismatchError
from nnx_zoo.layers.rope import LinearScaling, Llama3Scaling
from nnx_zoo.models.registry import MODEL_TYPES, preset_names
from tests.models.dense_reference import hf_logits, left_padded_batch, make_hf, rel_err, save_hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory, HF model): untied Llama, tied Qwen3."""
    llama = make_hf("llama", seed=0)
    qwen3 = make_hf("qwen3", seed=1, tie_word_embeddings=True)
    return {"llama": (save_hf(llama, tmp_path_factory.mktemp("llama")), llama),
            "qwen3": (save_hf(qwen3, tmp_path_factory.mktemp("qwen3")), qwen3)}


def test_auto_picks_the_family(checkpoints, tmp_path):
    for family, cls in (("llama", Llama3), ("qwen3", Qwen3)):
        directory, _ = checkpoints[family]
        assert type(AutoModelForCausalLM.from_pretrained(directory)) is cls
        assert type(AutoConfig.from_hf(directory)) is cls.config_class
    from tests.models.deepseek.hf_reference import make_hf_model
    from tests.models.deepseek.hf_reference import save_hf as save_deepseek

    directory = save_deepseek(make_hf_model(seed=0), tmp_path / "deepseek")
    assert type(AutoModelForCausalLM.from_pretrained(directory, moe_impl="dense")) is DeepSeekV3
    assert MODEL_TYPES["deepseek_v2"][1] is DeepSeekV3


@pytest.mark.parametrize("model_type, preset", [("deepseek_v32", "deepseek3.2-tiny"), ("kimi_k2", "kimi-k2-1t")])
def test_deepseek_v32_and_kimi_k2_configs_are_deepseek_ones(tmp_path, model_type, preset):
    """DeepSeek-V3.2 and Moonshot's Kimi K2 (DeepSeek-V3's architecture under model_type kimi_k2) route to DeepSeekV3,
    from a dict and from a directory."""
    config = DeepSeekV3Config.preset(preset)
    d = {**config.to_hf_dict(), "model_type": model_type}  # a Kimi K2 config.json is V3's with another model_type
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert AutoConfig.from_hf(d) == AutoConfig.from_hf(tmp_path) == config
    assert MODEL_TYPES[model_type] == (DeepSeekV3Config, DeepSeekV3)
    assert AutoModelForCausalLM.model_class(model_type) is DeepSeekV3


def test_unsupported_model_type_lists_the_supported_ones(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(CheckpointFormatError) as info:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(info.value)
    assert "'mistral' is not supported" in message and str(tmp_path / "config.json") in message
    assert all(repr(t) in message for t in ("deepseek_v3", "deepseek_v2", "llama", "qwen3"))
    with pytest.raises(ValueError, match="'mistral' is not supported"):
        AutoConfig.from_hf({**config, "model_type": "mistral"})


def test_one_family_on_another_families_checkpoint(checkpoints):
    with pytest.raises(CheckpointFormatError) as info:
        Qwen3.from_pretrained(checkpoints["llama"][0])
    assert "model_type 'llama' is not 'qwen3'" in str(info.value) and "Llama3.from_pretrained" in str(info.value)
    with pytest.raises(CheckpointFormatError, match="model_type 'qwen3' is not 'llama'.*Qwen3.from_pretrained"):
        Llama3.from_pretrained(checkpoints["qwen3"][0])
    with pytest.raises(TypeError, match="Llama3 needs a Llama3Config, got Qwen3Config"):
        Llama3.create(Qwen3Config.preset("qwen3-tiny"))


def test_presets_of_every_family():
    names = preset_names()
    assert set(names) == {"DeepSeekV3", "DeepSeekV4", "Llama3", "Qwen3", "Qwen3MoE", "Mixtral", "Glm4MoE", "Glm5",
                          "Mistral4", "Llama4", "MiniMaxM2", "GptOss", "Gemma3", "Gemma4", "Qwen3Next", "Qwen35",
                          "Qwen35MoE", "KimiLinear"}
    for family, cls in (("DeepSeekV3", DeepSeekV3Config), ("DeepSeekV4", DeepSeekV4Config), ("Llama3", Llama3Config),
                        ("Qwen3", Qwen3Config),
                        ("Qwen3MoE", Qwen3MoEConfig), ("Mixtral", MixtralConfig), ("Glm4MoE", Glm4MoEConfig),
                        ("Glm5", Glm5Config), ("Mistral4", Mistral4Config),
                        ("Llama4", Llama4Config), ("MiniMaxM2", MiniMaxM2Config), ("GptOss", GptOssConfig),
                        ("Gemma3", Gemma3Config), ("Gemma4", Gemma4Config), ("Qwen3Next", Qwen3NextConfig),
                        ("Qwen35", Qwen35Config), ("Qwen35MoE", Qwen35MoEConfig), ("KimiLinear", KimiLinearConfig)):
        for name in names[family]:
            assert type(AutoConfig.preset(name)) is cls, name
    assert AutoConfig.preset("qwen3-0.6b", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown preset 'llama-7b'.*Llama3: .*llama3.1-8b"):
        AutoConfig.preset("llama-7b")
    config = AutoConfig.preset("qwen3-tiny", num_hidden_layers=1, vocab_size=64)
    model = nnx.eval_shape(lambda: AutoModelForCausalLM.create(config))  # shapes only: cheap
    assert type(model) is Qwen3 and nnx.eval_shape(lambda m: m(jnp.zeros((1, 4), jnp.int32)), model).shape == (
        1, 4, 64)
    assert AutoModelForCausalLM.model_class("llama") is Llama3
    assert AutoModelForCausalLM.model_class("glm_moe_dsa").__name__ == "Glm5"
    assert AutoModelForCausalLM.model_class("mistral4").__name__ == "Mistral4"
    assert AutoModelForCausalLM.model_class("llama4_text") is AutoModelForCausalLM.model_class("llama4")
    assert AutoModelForCausalLM.model_class("qwen3_5") is AutoModelForCausalLM.model_class("qwen3_5_text")
    assert AutoModelForCausalLM.model_class("qwen3_5_moe") is AutoModelForCausalLM.model_class("qwen3_5_moe_text")
    assert AutoModelForCausalLM.model_class("qwen3_next").__name__ == "Qwen3Next"
    assert AutoModelForCausalLM.model_class("kimi_linear").__name__ == "KimiLinear"


def test_config_validation():
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide num_attention_heads=4"):
        Llama3Config.preset("llama3-tiny", num_key_value_heads=3)
    with pytest.raises(ValueError) as info:  # every problem in one error
        Qwen3Config.preset("qwen3-tiny", head_dim=7, hidden_size=0, remat_policy="some")
    assert all(s in str(info.value) for s in ("head_dim must be even", "hidden_size must be a positive", "remat"))
    with pytest.raises(ValueError, match="not a dtype"):
        Llama3Config(dtype="float99")
    with pytest.raises(ValueError, match="dtype='bf16' is not a dtype; use one of float32, bfloat16"):
        Qwen3Config.preset("qwen3-tiny", dtype="bf16")
    with pytest.raises(ValueError, match="param_dtype='int8' is not a supported .* use one of float32, bfloat16"):
        Llama3Config.preset("llama3-tiny", param_dtype="int8")
    assert Llama3Config.preset("llama3-tiny", head_dim=None).head_dim == 128 // 4


def test_hf_config_round_trip_and_rope_forms():
    for name in ("llama3.2-1b", "llama3-small", "qwen3-0.6b", "qwen3-tiny"):
        config = AutoConfig.preset(name)
        assert type(config).from_hf(config.to_hf_dict()) == config
    shape = {k: v for k, v in Llama3Config.preset("llama3-tiny").to_hf_dict().items()
             if k in (*Llama3Config.REQUIRED_HF_FIELDS, "num_key_value_heads")}
    legacy = {**shape, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    modern = {**shape, "model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 1e6}}
    assert (Llama3Config.from_hf(legacy).rope_theta, Llama3Config.from_hf(legacy).rope_scaling) == (
        5e5, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    assert (Llama3Config.from_hf(modern).rope_theta, Llama3Config.from_hf(modern).rope_scaling) == (
        1e6, LinearScaling(2.0))
    with pytest.raises(TypeError, match="unknown Qwen3Config fields"):
        Qwen3Config.from_hf({"model_type": "qwen3"}, hidden_sise=8)


def test_cost_formulas():
    config = AutoConfig.preset("llama3.1-8b")
    counts = config.num_parameters()
    assert counts.active == counts.total and counts.embedding == 128256 * 4096
    attention = 3 * 2048 * 32 * 2 * 128 * 32  # per token: causal scores + mixing, forward and backward
    assert config.train_flops_per_token(2048) == 6 * (counts.total - counts.embedding) + attention


def test_untied_checkpoint_needs_lm_head_and_tied_one_may_store_it(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]  # untied
    tensors = load_file(directory / "model.safetensors")
    del tensors["lm_head.weight"]
    (tmp_path / "untied").mkdir()
    save_file(tensors, str(tmp_path / "untied" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "untied" / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointMismatchError) as info:
        Llama3.from_pretrained(tmp_path / "untied")
    assert info.value.missing == ["lm_head.weight"] and not info.value.unexpected

    directory, hf = checkpoints["qwen3"]  # tied: no head stored by transformers; a stored copy is skipped
    tensors = load_file(directory / "model.safetensors")
    assert "lm_head.weight" not in tensors
    (tmp_path / "tied").mkdir()
    save_file({**tensors, "lm_head.weight": np.zeros_like(tensors["model.embed_tokens.weight"])},
              str(tmp_path / "tied" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "tied" / "config.json").write_text((directory / "config.json").read_text())
    ids, mask = left_padded_batch(hf.config.vocab_size)
    for source in (directory, tmp_path / "tied"):
        model = Qwen3.from_pretrained(source)
        assert model.lm_head is None
        assert rel_err(np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))), hf_logits(hf, ids, mask), mask) < 1e-5


def test_bad_inputs(checkpoints):
    model = Llama3.from_pretrained(checkpoints["llama"][0])
    with pytest.raises(ValueError, match="input_ids must be integer token ids"):
        model(jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="input_ids must be integer token ids"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match=r"attention_mask \(2, 3\) must have input_ids' shape \(2, 4\)"):
        model(jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="does not fit a cache of 3 slots"):
        model.prefill(jnp.zeros((1, 4), jnp.int32), None, model.init_cache(1, 3))


def test_misspelt_overrides_name_the_close_fields():
    # Presets, copies and checkpoints alike: the bad name and what it probably meant, not a raw dataclass error.
    calls = [lambda: AutoConfig.preset("qwen3-tiny", vocab_sizee=64),
             lambda: Llama3Config.preset("llama3-tiny").with_overrides(vocab_sizee=64),
             lambda: Qwen3Config.from_hf(Qwen3Config.preset("qwen3-tiny").to_hf_dict(), vocab_sizee=64),
             lambda: DeepSeekV3Config.preset("deepseek3-tiny", vocab_sizee=64)]
    for call in calls:
        with pytest.raises(TypeError, match=r"unknown \w+Config fields: 'vocab_sizee' \(did you mean 'vocab_size'"):
            call()


@pytest.mark.parametrize("cls, preset", [(Llama3Config, "llama3-tiny"), (Qwen3Config, "qwen3-tiny"),
                                         (DeepSeekV3Config, "deepseek3-tiny")])
def test_config_json_without_a_shape_field_names_it(tmp_path, cls, preset):
    full = cls.preset(preset).to_hf_dict()
    for missing in ("hidden_size", "num_hidden_layers"):
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != missing}))
        for read in (lambda: cls.from_hf(tmp_path), lambda: AutoConfig.from_hf(tmp_path)):
            with pytest.raises(CheckpointFormatError, match=f"missing required field\\(s\\) {missing}:"):
                read()
        # An override supplies it; the dict form is refused the same way.
        assert getattr(cls.from_hf(tmp_path, **{missing: full[missing]}), missing) == full[missing]
        with pytest.raises(ValueError, match=f"missing required field\\(s\\) {missing}"):
            cls.from_hf({k: v for k, v in full.items() if k != missing})


@pytest.mark.parametrize("preset", ["llama3-tiny", "qwen3-tiny", "qwen3-moe-tiny", "mixtral-tiny", "glm4.5-tiny",
                                    "llama4-tiny", "minimax-m2-tiny", "gpt-oss-tiny", "qwen3.5-tiny"])
def test_config_json_without_kv_heads_reads_as_transformers_reads_it(preset):
    # Each transformers config class fills an absent num_key_value_heads its own way (LlamaConfig: the attention
    # heads; the others: a class default), so a file that leaves it out must not take our preset's value.
    import transformers

    full = AutoConfig.preset(preset, num_attention_heads=64, num_key_value_heads=2, head_dim=8).to_hf_dict()
    without = {k: v for k, v in full.items() if k != "num_key_value_heads"}
    theirs = transformers.AutoConfig.for_model(**without).num_key_value_heads
    ours = AutoConfig.from_hf(without)
    assert ours.num_key_value_heads == theirs != 2


def test_partial_rotary_is_refused_where_transformers_does_not_implement_it(tmp_path):
    # transformers' Llama (Qwen3, Mixtral, ...) ropes whole heads: it ignores partial_rotary_factor or, with llama3
    # rope scaling, fails on it. Such a file must not quietly rope half of each head here; GLM-4.5 does rope half.
    d = {**AutoConfig.preset("llama3-tiny").to_hf_dict(), "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointFormatError, match="ropes whole heads"):
        AutoConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match="ropes whole heads"):
        AutoConfig.preset("qwen3-tiny", partial_rotary_factor=0.5)
    assert AutoConfig.from_hf({**d, "partial_rotary_factor": 1.0}).partial_rotary_factor == 1.0
    assert AutoConfig.preset("glm4.5-tiny").partial_rotary_factor == 0.5


# One preset per family: the dense-core ones take hidden_size // num_attention_heads = 96 // 4 = 24 (neither 128 nor
# the presets' 32 or 64), but where transformers' config class defaults it (Qwen3, MiniMax-M2, Llama 4 when absent:
# 128); DeepSeek's (V3, V2, V3.2, GLM-5, Mistral 4) have no head_dim of their own.
HEAD_DIM_PRESETS = ["llama3-tiny", "qwen3-tiny", "qwen3-moe-tiny", "mixtral-tiny", "glm4.5-tiny", "deepseek3-mini",
                    "deepseek2-tiny", "deepseek3.2-tiny", "glm5-tiny", "mistral4-tiny", "deepseek4-tiny",
                    "llama4-tiny", "minimax-m2-tiny", "gpt-oss-tiny"]


@pytest.mark.parametrize("head_dim", ["absent", "null"])
@pytest.mark.parametrize("preset", HEAD_DIM_PRESETS)
def test_config_json_without_head_dim_reads_as_transformers_reads_it(preset, head_dim):
    """A config.json whose head_dim is null or absent means what transformers makes of it: the head width its own
    model is built with from the same dict (on the meta device), hidden_size // num_attention_heads or its config
    class's default. Where transformers cannot build the model (Qwen3's, DeepSeek-V3.2's and GLM-5's config classes
    refuse null; Qwen3-MoE's and GLM-4.5's attention and Mistral 4's rope fail on it) the file is refused here,
    naming head_dim.
    Otherwise DeepSeek's families ignore the key, as transformers does (their heads are qk_nope + qk_rope wide)."""
    import torch
    import transformers

    config = AutoConfig.preset(preset, vocab_size=64, num_hidden_layers=1)
    full = config.to_hf_dict()
    deepseek = isinstance(config, DeepSeekV3Config)
    if isinstance(config, DeepSeekV4Config):  # absent: transformers' default head width, 512; null: refused
        full.update(head_dim=512, qk_rope_head_dim=64, partial_rotary_factor=0.125, num_attention_heads=4,
                    index_head_dim=64)
        full["rope_parameters"]["main"]["partial_rotary_factor"] = 0.125
        full["rope_parameters"]["compress"]["partial_rotary_factor"] = 0.125
    elif not deepseek:
        full.update(hidden_size=96, num_attention_heads=4, num_key_value_heads=2)
    d = {k: v for k, v in full.items() if k != "head_dim"}
    if head_dim == "null":
        d["head_dim"] = None
    try:
        with torch.device("meta"):
            hf = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**copy.deepcopy(d)))
    except Exception:  # transformers cannot build it (its config class or its attention refuses the value)
        hf = None
    if hf is None:
        assert head_dim == "null" and preset in ("qwen3-tiny", "qwen3-moe-tiny", "glm4.5-tiny", "deepseek3.2-tiny",
                                                 "glm5-tiny", "mistral4-tiny", "deepseek4-tiny", "llama4-tiny",
                                                 "minimax-m2-tiny", "gpt-oss-tiny")
        with pytest.raises(ValueError, match="head_dim is null: transformers' .* cannot build that model"):
            AutoConfig.from_hf(d)
        if not deepseek:  # an override supplies it
            width = 512 if isinstance(config, DeepSeekV4Config) else 24
            assert AutoConfig.from_hf(d, head_dim=width).head_dim == width
        return
    ours = AutoConfig.from_hf(d)
    attn = hf.layers[0].self_attn
    if isinstance(config, DeepSeekV4Config):
        assert ours.head_dim == attn.q_b_proj.weight.shape[0] // 4 == 512 and ours == AutoConfig.from_hf(full)
    elif deepseek:
        assert ours == AutoConfig.from_hf(full)
        q = attn.q_b_proj if config.q_lora_rank else attn.q_proj
        assert q.weight.shape[0] == ours.num_attention_heads * ours.qk_head_dim
    else:
        # Qwen3's and MiniMax-M2's config classes default an absent head_dim to 128, and so does Llama 4's;
        # GPT-OSS's to 64; the others take hidden_size // heads.
        default = preset in ("qwen3-tiny", "minimax-m2-tiny") or (preset == "llama4-tiny" and head_dim == "absent")
        width = 64 if preset == "gpt-oss-tiny" else 128 if default else 24
        assert ours.head_dim == attn.q_proj.weight.shape[0] // 4 == width


def test_a_mixtral_config_that_transformers_saved_loads(tmp_path):
    """transformers 5's MixtralConfig writes "head_dim": null; at 96 / 4 heads that is 24, not Mixtral-8x7B's 128."""
    import transformers

    transformers.MixtralConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                               num_hidden_layers=1, vocab_size=64).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] is None
    assert AutoConfig.from_hf(tmp_path).head_dim == 24
