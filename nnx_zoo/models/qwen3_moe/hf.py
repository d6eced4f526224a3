"""Hugging Face ``Qwen3MoeForCausalLM`` checkpoints <-> ``Qwen3MoE``: Qwen3's attention rows, the sparse MLP as
``mlp.gate.weight`` (router) and ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what transformers 5 writes), or
transformers-5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (read too); dense layers as Qwen3's."""

from __future__ import annotations

from nnx_zoo.hf import KeyTable
from nnx_zoo.models.moe_causal_lm import FUSED_EXPERTS, expert_rows, moe_key_table
from nnx_zoo.models.moe_decoder_config import MoEDecoderConfig
from nnx_zoo.models.qwen3 import hf as qwen3_hf

ATTENTION_ROWS = tuple(r for r in qwen3_hf.LAYER_TABLE if not r.hf.startswith("mlp."))
MOE_ROWS = expert_rows("mlp", "gate_proj", "up_proj", "down_proj")


def key_table(config: MoEDecoderConfig) -> KeyTable:
    """The HF key table of a Qwen3-MoE model with this config."""
    return moe_key_table(config, attention_rows=ATTENTION_ROWS, moe_rows=MOE_ROWS, fused=FUSED_EXPERTS,
                         source="nnx_zoo/models/qwen3_moe/hf.py")
