"""The family registry: HF ``model_type`` -> (config class, model class), and presets of every family by name.

``AutoModelForCausalLM.from_pretrained(dir)`` reads ``config.json``'s ``model_type`` and hands the directory to
that family's ``from_pretrained``; ``AutoConfig.preset(name)`` finds a preset in whichever family defines it. A
new family adds one line to ``MODEL_TYPES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from nnx_zoo.hf.config_io import config_json_path, read_json_object
from nnx_zoo.hf.errors import CheckpointFormatError
from nnx_zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.models.deepseek4 import DeepSeekV4, DeepSeekV4Config
from nnx_zoo.models.gemma3 import Gemma3, Gemma3Config
from nnx_zoo.models.gemma4 import Gemma4, Gemma4Config
from nnx_zoo.models.glm4_moe import Glm4MoE, Glm4MoEConfig
from nnx_zoo.models.glm5 import Glm5, Glm5Config
from nnx_zoo.models.gpt_oss import GptOss, GptOssConfig
from nnx_zoo.models.kimi_linear import KimiLinear, KimiLinearConfig
from nnx_zoo.models.llama import Llama3, Llama3Config
from nnx_zoo.models.llama4 import Llama4, Llama4Config
from nnx_zoo.models.minimax_m2 import MiniMaxM2, MiniMaxM2Config
from nnx_zoo.models.mistral4 import Mistral4, Mistral4Config
from nnx_zoo.models.mixtral import Mixtral, MixtralConfig
from nnx_zoo.models.qwen3 import Qwen3, Qwen3Config
from nnx_zoo.models.qwen3_5 import Qwen35, Qwen35Config, Qwen35MoE, Qwen35MoEConfig
from nnx_zoo.models.qwen3_moe import Qwen3MoE, Qwen3MoEConfig
from nnx_zoo.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from nnx_zoo.sharding.rules import Rules

# HF model_type -> (config class, model class).
MODEL_TYPES: dict[str, tuple[type, type]] = {
    "deepseek_v3": (DeepSeekV3Config, DeepSeekV3),
    "deepseek_v2": (DeepSeekV3Config, DeepSeekV3),
    "deepseek_v32": (DeepSeekV3Config, DeepSeekV3),  # DeepSeek-V3.2: V3 plus the lightning indexer
    "kimi_k2": (DeepSeekV3Config, DeepSeekV3),  # Moonshot's Kimi K2: DeepSeek-V3's architecture (exported as V3)
    "deepseek_v4": (DeepSeekV4Config, DeepSeekV4),
    "llama": (Llama3Config, Llama3),
    "llama4_text": (Llama4Config, Llama4),
    "llama4": (Llama4Config, Llama4),  # the multimodal checkpoint: its text model (exported as llama4_text)
    "qwen3": (Qwen3Config, Qwen3),
    "qwen3_moe": (Qwen3MoEConfig, Qwen3MoE),
    "qwen3_next": (Qwen3NextConfig, Qwen3Next),
    "kimi_linear": (KimiLinearConfig, KimiLinear),  # Kimi Linear: KDA linear layers, MLA without rope, sigmoid MoE
    "qwen3_5_text": (Qwen35Config, Qwen35),
    "qwen3_5": (Qwen35Config, Qwen35),  # the multimodal checkpoint: its text model (exported as qwen3_5_text)
    "qwen3_5_moe_text": (Qwen35MoEConfig, Qwen35MoE),
    "qwen3_5_moe": (Qwen35MoEConfig, Qwen35MoE),  # likewise (exported as qwen3_5_moe_text)
    "mixtral": (MixtralConfig, Mixtral),
    "glm4_moe": (Glm4MoEConfig, Glm4MoE),
    "glm_moe_dsa": (Glm5Config, Glm5),  # GLM-5: DeepSeek-V3.2's parts, its indexer rope, cross-layer top-k reuse
    "mistral4": (Mistral4Config, Mistral4),  # Mistral 4: DeepSeek-V3's parts, its router and query scale
    "minimax_m2": (MiniMaxM2Config, MiniMaxM2),
    "gpt_oss": (GptOssConfig, GptOss),  # GPT-OSS: sliding/full layers with sinks, biased router and experts, MXFP4
    "gemma3_text": (Gemma3Config, Gemma3),
    "gemma3": (Gemma3Config, Gemma3),  # Gemma 3's image-text checkpoints: their text model (language_model)
    "gemma4_text": (Gemma4Config, Gemma4),
    "gemma4": (Gemma4Config, Gemma4),  # Gemma 4's multimodal checkpoints: their text model (language_model)
}


def _families() -> dict[type, type]:
    """Config class -> model class, one entry per family."""
    return {config_cls: model_cls for config_cls, model_cls in MODEL_TYPES.values()}


def _presets_of(config_cls: type) -> dict[str, Any]:
    return config_cls.PRESETS


def preset_names() -> dict[str, list[str]]:
    """Model class name -> its preset names, for every family."""
    return {model_cls.__name__: sorted(_presets_of(config_cls)) for config_cls, model_cls in _families().items()}


def _model_type(path: str | Path) -> tuple[str, Path]:
    config_path = config_json_path(path)
    model_type = read_json_object(config_path, "model config").get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointFormatError(f"{config_path}: model_type {model_type!r} is not supported; supported model "
                                    f"types are {sorted(MODEL_TYPES)}")
    return model_type, config_path


class AutoConfig:
    """Configs of any family: by preset name, or from an HF ``config.json`` by its ``model_type``.

    >>> AutoConfig.preset("qwen3-0.6b")            # a Qwen3Config
    >>> AutoConfig.preset("deepseek3-mini", num_hidden_layers=2)
    >>> AutoConfig.from_hf("/path/to/checkpoint")  # the family's config class, chosen by model_type
    """

    @staticmethod
    def preset(name: str, **overrides: Any) -> Any:
        """The preset ``name`` of whichever family defines it (``preset_names()`` lists them all)."""
        for config_cls in _families():
            if name in _presets_of(config_cls):
                return config_cls.preset(name, **overrides)
        listing = "; ".join(f"{family}: {', '.join(names)}" for family, names in preset_names().items())
        raise ValueError(f"unknown preset {name!r}; presets are {listing}")

    @staticmethod
    def from_hf(path_or_dict: str | Path | dict[str, Any], **overrides: Any) -> Any:
        """The config of an HF checkpoint directory (or its ``config.json``, or that file's dict)."""
        if isinstance(path_or_dict, dict):
            model_type = path_or_dict.get("model_type")
            if model_type not in MODEL_TYPES:
                raise ValueError(f"model_type {model_type!r} is not supported; supported model types are "
                                 f"{sorted(MODEL_TYPES)}")
            return MODEL_TYPES[model_type][0].from_hf(path_or_dict, **overrides)
        model_type, _ = _model_type(path_or_dict)
        return MODEL_TYPES[model_type][0].from_hf(path_or_dict, **overrides)


class AutoModelForCausalLM:
    """Any supported family's causal LM, chosen by ``config.json``'s ``model_type`` or by the config's class.

    >>> model = AutoModelForCausalLM.from_pretrained("/path/to/Qwen3-0.6B", mesh=make_mesh({"fsdp": 8}))
    >>> model = AutoModelForCausalLM.create(AutoConfig.preset("llama3-tiny"), seed=0)
    """

    @staticmethod
    def model_class(config_or_model_type: Any) -> type:
        """The model class of a config instance or an HF ``model_type``."""
        if isinstance(config_or_model_type, str):
            if config_or_model_type not in MODEL_TYPES:
                raise ValueError(f"model_type {config_or_model_type!r} is not supported; supported model types "
                                 f"are {sorted(MODEL_TYPES)}")
            return MODEL_TYPES[config_or_model_type][1]
        families = _families()
        if type(config_or_model_type) not in families:
            raise TypeError(f"{type(config_or_model_type).__name__} is not a model config; configs are "
                            f"{sorted(c.__name__ for c in families)}")
        return families[type(config_or_model_type)]

    @staticmethod
    def from_pretrained(path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                        dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> Any:
        """Load an HF checkpoint directory with the family its ``config.json`` ``model_type`` names (an
        unsupported one is a ``nnx_zoo.hf.CheckpointFormatError`` listing the supported types)."""
        model_type, _ = _model_type(path)
        return MODEL_TYPES[model_type][1].from_pretrained(path, mesh=mesh, rules=rules, dtype=dtype,
                                                          allow_partial=allow_partial, **config_overrides)

    @staticmethod
    def create(config: Any, *, mesh: Mesh | None = None, rules: Rules | str = "default", seed: int = 0,
               allow_partial: bool = False) -> Any:
        """A randomly initialized model of ``config``'s family (``Cls.create``)."""
        return AutoModelForCausalLM.model_class(config).create(config, mesh=mesh, rules=rules, seed=seed,
                                                               allow_partial=allow_partial)
