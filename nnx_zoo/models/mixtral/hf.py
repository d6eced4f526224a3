"""Hugging Face ``MixtralForCausalLM`` checkpoints <-> ``Mixtral``: Llama's attention rows, the sparse MLP as
``block_sparse_moe.gate.weight`` (router) and ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate / up /
down, what transformers 5 writes), or transformers-5's fused in-memory layout ``mlp.gate.weight``,
``mlp.experts.gate_up_proj`` / ``down_proj`` (read too)."""

from __future__ import annotations

from nnx_zoo.hf import KeyTable
from nnx_zoo.models import dense_hf
from nnx_zoo.models.moe_causal_lm import FUSED_EXPERTS, expert_rows, moe_key_table
from nnx_zoo.models.moe_decoder_config import MoEDecoderConfig

ATTENTION_ROWS = tuple(r for r in dense_hf.LAYER_TABLE if not r.hf.startswith("mlp."))
MOE_ROWS = expert_rows("block_sparse_moe", "w1", "w3", "w2")


def key_table(config: MoEDecoderConfig) -> KeyTable:
    """The HF key table of a Mixtral model with this config."""
    return moe_key_table(config, attention_rows=ATTENTION_ROWS, moe_rows=MOE_ROWS, fused=FUSED_EXPERTS,
                         source="nnx_zoo/models/mixtral/hf.py")
