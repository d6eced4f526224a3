"""Hugging Face ``Glm4MoeForCausalLM`` checkpoints <-> ``Glm4MoE``: Llama's attention rows (q/k/v biases) plus
optional q/k norms; MoE layers as ``mlp.gate.weight`` (router), ``mlp.gate.e_score_correction_bias`` (selection
bias), ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what transformers 5 writes) or transformers-5's fused
``mlp.experts.gate_up_proj`` / ``down_proj`` (read too), and ``mlp.shared_experts.*``; dense layers as Llama's.
The MTP layers (``model.layers.{num_hidden_layers + j}.*``) are skipped on load and not written, as in
transformers."""

from __future__ import annotations

import dataclasses

from nnx_zoo.hf import DENSE, KeyTable, Row
from nnx_zoo.models.glm4_moe.config import Glm4MoEConfig
from nnx_zoo.models.moe_causal_lm import FUSED_EXPERTS, expert_rows, moe_key_table
from nnx_zoo.models.qwen3 import hf as qwen3_hf

ATTENTION_ROWS = tuple(r for r in qwen3_hf.LAYER_TABLE if not r.hf.startswith("mlp."))
MOE_ROWS = expert_rows("mlp", "gate_proj", "up_proj", "down_proj") + (
    Row("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
    Row("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.gate.kernel", DENSE),
    Row("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up.kernel", DENSE),
    Row("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.down.kernel", DENSE),
)


def key_table(config: Glm4MoEConfig) -> KeyTable:
    """The HF key table of a GLM-4.5 model with this config."""
    table = moe_key_table(config, attention_rows=ATTENTION_ROWS, moe_rows=MOE_ROWS, fused=FUSED_EXPERTS,
                          source="nnx_zoo/models/glm4_moe/hf.py")
    mtp = [str(config.num_hidden_layers + j) for j in range(config.mtp_layers_on_disk)]
    return dataclasses.replace(table, ignored=table.ignored + ((rf"^model\.layers\.({'|'.join(mtp)})\.",)
                                                               if mtp else ()))
