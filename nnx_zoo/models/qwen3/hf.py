"""Hugging Face ``Qwen3ForCausalLM`` checkpoints <-> ``Qwen3``: Llama's key table plus the per-head query and key
norms (``self_attn.q_norm`` / ``k_norm``, one ``[head_dim]`` scale each)."""

from __future__ import annotations

from nnx_zoo.hf import KeyTable, Row
from nnx_zoo.models import dense_hf
from nnx_zoo.models.decoder_config import DecoderConfig

LAYER_TABLE = dense_hf.LAYER_TABLE + (
    Row("self_attn.q_norm.weight", "attn.q_norm.scale"),
    Row("self_attn.k_norm.weight", "attn.k_norm.scale"),
)


def key_table(config: DecoderConfig) -> KeyTable:
    """The HF key table of a Qwen3 model with this config."""
    return dense_hf.key_table(config, LAYER_TABLE, source="nnx_zoo/models/qwen3/hf.py")
