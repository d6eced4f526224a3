"""Hugging Face ``MiniMaxM2ForCausalLM`` checkpoints <-> ``MiniMaxM2``: Qwen3's attention rows (``q_norm`` /
``k_norm`` here span the whole projection: ``[num_heads * head_dim]``, ``[num_kv_heads * head_dim]``), the sparse
MLP as Mixtral's (``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``: what the hub
files hold and transformers 5 writes) plus ``block_sparse_moe.e_score_correction_bias``; transformers-5's fused
in-memory layout (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.e_score_correction_bias``)
is read too. FP8 hub weights (``weight_scale_inv`` per 128 x 128 block) are dequantized by the shared loader."""

from __future__ import annotations

import dataclasses

from nnx_zoo.hf import KeyTable, Row
from nnx_zoo.models.minimax_m2.config import MiniMaxM2Config
from nnx_zoo.models.moe_causal_lm import FUSED_EXPERTS, expert_rows, moe_key_table
from nnx_zoo.models.qwen3 import hf as qwen3_hf

ATTENTION_ROWS = tuple(r for r in qwen3_hf.LAYER_TABLE if not r.hf.startswith("mlp."))
MOE_ROWS = expert_rows("block_sparse_moe", "w1", "w3", "w2") + (
    Row("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias"),)


def key_table(config: MiniMaxM2Config) -> KeyTable:
    """The HF key table of a MiniMax-M2 model with this config."""
    table = moe_key_table(config, attention_rows=ATTENTION_ROWS, moe_rows=MOE_ROWS, fused=FUSED_EXPERTS,
                          source="nnx_zoo/models/minimax_m2/hf.py")
    # The fused layout names the bias on the block as mlp.* (transformers' rename of block_sparse_moe).
    alias = (r"^(model\.layers\.\d+)\.mlp\.e_score_correction_bias$", r"\1.block_sparse_moe.e_score_correction_bias")
    return dataclasses.replace(table, aliases=table.aliases + (alias,))
