"""The hybrid families' delta-rule settings (``delta_rule_impl``, ``delta_rule_chunk_size``): checked when the config
is built, kept out of ``config.json`` (nnx_zoo's own, like ``attention_impl``) and given again on load, reached by
the recipe's ``--model.<field>``, and passed to the kernel by every linear layer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import nnx_zoo.models.qwen3_next.mixers as mixers
from nnx_zoo import AutoConfig, AutoModelForCausalLM

PRESETS = ["qwen3-next-tiny", "qwen3.5-tiny", "kimi-linear-tiny"]
SETTINGS = dict(delta_rule_impl="chunked", delta_rule_chunk_size=16)


@pytest.mark.parametrize("preset", PRESETS)
def test_bad_settings_are_refused_with_the_field_named(preset):
    with pytest.raises(ValueError, match=r"delta_rule_impl must be one of \('auto', 'chunked', 'recurrent'\), got "
                                         r"'flash'"):
        AutoConfig.preset(preset, delta_rule_impl="flash")
    for bad in (0, -64, 1.5, True):
        with pytest.raises(ValueError, match="delta_rule_chunk_size must be a positive integer"):
            AutoConfig.preset(preset, delta_rule_chunk_size=bad)


@pytest.mark.parametrize("preset", PRESETS)
def test_settings_reach_the_kernel_and_survive_save_and_load(preset, tmp_path, monkeypatch):
    config = AutoConfig.preset(preset, num_hidden_layers=2, vocab_size=64, **SETTINGS)
    assert not set(SETTINGS) & set(config.to_hf_dict())  # not HF keys: config.json stays transformers'
    again = type(config).from_hf(config.to_hf_dict(), **SETTINGS)
    assert again.to_hf_dict() == config.to_hf_dict() and _settings(again) == _settings(config)
    assert _settings(type(config).from_hf(config.to_hf_dict())) == ("auto", 64)  # absent: the defaults

    model = AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0))
    calls = []
    real = mixers.gated_delta_rule

    def spy(*args, impl, chunk_size, **kwargs):
        calls.append((impl, chunk_size))
        return real(*args, impl=impl, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(mixers, "gated_delta_rule", spy)
    jax.eval_shape(lambda ids: model(ids), jax.ShapeDtypeStruct((1, 40), jnp.int32))
    assert calls and set(calls) == {("chunked", 16)}

    model.save_pretrained(tmp_path)
    assert not set(SETTINGS) & set(json.loads((tmp_path / "config.json").read_text()))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, **SETTINGS)
    assert loaded.config.to_hf_dict() == config.to_hf_dict() and _settings(loaded.config) == _settings(config)


def _settings(config) -> tuple[str, int]:
    return config.delta_rule_impl, config.delta_rule_chunk_size


def test_the_recipe_sets_them_with_model_fields():
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("pretrain", root / "recipes" / "pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    argv = ["--model", "qwen3.5-tiny", "--model.delta_rule_impl", "recurrent", "--model.delta_rule_chunk_size", "32"]
    source = recipe.model_source(argv)
    args, unknown = recipe.build_parser(source.config_cls).parse_known_args(argv)
    config = source.config(recipe.model_overrides(args))
    assert not unknown and (config.delta_rule_impl, config.delta_rule_chunk_size) == ("recurrent", 32)
