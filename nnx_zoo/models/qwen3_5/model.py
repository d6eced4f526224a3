"""Qwen3.5's text models: ``Qwen3Next`` (``nnx_zoo.models.qwen3_next``) with the linear layers' projections
separate (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``): ``Qwen35`` (dense) and ``Qwen35MoE``.
They load the text model of a multimodal checkpoint too (``model.language_model.*``, the MTP depth's top-level
``mtp.*`` with it; the vision tower skipped) and save a text-only one."""

from __future__ import annotations

from typing import Any, ClassVar

from nnx_zoo.hf import KeyTable
from nnx_zoo.models.qwen3_5.config import Qwen35Config, Qwen35MoEConfig
from nnx_zoo.models.qwen3_next import hf
from nnx_zoo.models.qwen3_next.model import Qwen3Next

# The multimodal checkpoint's text model under its own prefix, and what is not the text model.
MULTIMODAL_ALIASES = ((r"^model\.language_model\.", "model."),)
MULTIMODAL_IGNORED = (r"^model\.visual\.",)


def key_table(config: Any) -> KeyTable:
    """The HF key table of a Qwen3.5 text model with this config (separate linear-layer projections)."""
    return hf.key_table(config, packed=False, aliases=MULTIMODAL_ALIASES, ignored=MULTIMODAL_IGNORED,
                        source="nnx_zoo/models/qwen3_5/model.py")


class Qwen35(Qwen3Next):
    """Qwen3.5 dense text model (exact against HF ``Qwen3_5ForCausalLM``).

    >>> model = Qwen35.create(Qwen35Config.preset("qwen3.5-tiny"))
    >>> model = Qwen35.from_pretrained("/path/to/Qwen3.5-27B", dtype="bfloat16")   # its text model
    """

    config_class: ClassVar[type[Qwen35Config]] = Qwen35Config  # type: ignore[assignment]
    key_table = staticmethod(key_table)


class Qwen35MoE(Qwen3Next):
    """Qwen3.5 MoE text model (exact against HF ``Qwen3_5MoeForCausalLM``).

    >>> model = Qwen35MoE.create(Qwen35MoEConfig.preset("qwen3.5-moe-tiny"))
    >>> model = Qwen35MoE.from_pretrained("/path/to/Qwen3.5-35B-A3B", dtype="bfloat16")
    """

    config_class: ClassVar[type[Qwen35MoEConfig]] = Qwen35MoEConfig  # type: ignore[assignment]
    key_table = staticmethod(key_table)
