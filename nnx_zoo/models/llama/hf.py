"""Hugging Face ``LlamaForCausalLM`` checkpoints <-> ``Llama3``: the dense core's key table
(``nnx_zoo.models.dense_hf``), which is Llama's layout."""

from __future__ import annotations

from nnx_zoo.hf import KeyTable
from nnx_zoo.models import dense_hf
from nnx_zoo.models.decoder_config import DecoderConfig
from nnx_zoo.models.dense_hf import FLAT, LAYER_TABLE, TOP_TABLE

__all__ = ["FLAT", "LAYER_TABLE", "TOP_TABLE", "key_table"]


def key_table(config: DecoderConfig) -> KeyTable:
    """The HF key table of a Llama model with this config."""
    return dense_hf.key_table(config, source="nnx_zoo/models/llama/hf.py")
