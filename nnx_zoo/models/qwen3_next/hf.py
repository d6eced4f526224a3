"""Hugging Face ``Qwen3NextForCausalLM`` checkpoints <-> ``Qwen3Next`` (and, with ``packed=False``, the Qwen3.5
models' text layers).

Per layer ``model.layers.{i}.``: the two ``(1 + w)`` norms; a full layer's ``self_attn.{q,k,v,o}_proj`` (``q_proj``
``[heads * 2 * head_dim, embed]``: per head the query's rows, then the gate's) and ``q_norm`` / ``k_norm``; a linear
layer's ``linear_attn.*``: ``in_proj_qkvz`` and ``in_proj_ba`` (packed per query/key head) or ``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``, then ``conv1d.weight [C, 1, K]``, ``dt_bias``, ``A_log``,
``norm.weight`` and ``out_proj``; the MLP as Qwen3-MoE's (router ``mlp.gate``, per-expert or fused experts) plus
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight [1, embed]``, or a dense layer's ``mlp.*_proj``. The
multi-token-prediction weights (``mtp.*``) are skipped, as transformers skips them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nnx_zoo.hf import DENSE, Dense, KeyTable, Row, Stack
from nnx_zoo.models import dense_hf
from nnx_zoo.models.moe_causal_lm import FUSED_EXPERTS, expert_rows
from nnx_zoo.models.moe_decoder_config import MoEDecoderConfig


@dataclasses.dataclass(frozen=True)
class DepthwiseConv:
    """``nn.Conv1d`` depthwise weight ``[C, 1, K]`` <-> our ``ShortConv.weight [C, K]``."""

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (ours[0], 1, ours[1])

    def to_ours(self, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return a[:, 0, :]

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a[:, None, :]


NORM_ROWS = (Row("input_layernorm.weight", "input_norm.scale"),
             Row("post_attention_layernorm.weight", "post_attn_norm.scale"))
FULL_ROWS = (
    Row("self_attn.q_proj.weight", "attn.q_proj.kernel", DENSE),  # [heads * 2 hd, embed] <-> [embed, heads, 2 hd]
    Row("self_attn.k_proj.weight", "attn.k_proj.kernel", DENSE),
    Row("self_attn.v_proj.weight", "attn.v_proj.kernel", DENSE),
    Row("self_attn.o_proj.weight", "attn.o_proj.kernel", Dense(n_in=2)),
    Row("self_attn.q_norm.weight", "attn.q_norm.scale"),
    Row("self_attn.k_norm.weight", "attn.k_norm.scale"),
)
_LINEAR_COMMON = (
    Row("linear_attn.conv1d.weight", "attn.conv.weight", DepthwiseConv()),
    Row("linear_attn.dt_bias", "attn.dt_bias"),
    Row("linear_attn.A_log", "attn.A_log"),
    Row("linear_attn.norm.weight", "attn.norm.scale"),
    Row("linear_attn.out_proj.weight", "attn.out_proj.kernel", Dense(n_in=2)),
)
PACKED_LINEAR_ROWS = (
    Row("linear_attn.in_proj_qkvz.weight", "attn.in_proj_qkvz.kernel", DENSE),  # [hk * (2dk + 2r dv), embed]
    Row("linear_attn.in_proj_ba.weight", "attn.in_proj_ba.kernel", DENSE),  # [hk * 2r, embed]
) + _LINEAR_COMMON
SEPARATE_LINEAR_ROWS = (
    Row("linear_attn.in_proj_qkv.weight", "attn.in_proj_qkv.kernel", DENSE),  # [C, embed]
    Row("linear_attn.in_proj_z.weight", "attn.in_proj_z.kernel", DENSE),  # [hv * dv, embed]
    Row("linear_attn.in_proj_b.weight", "attn.in_proj_b.kernel", DENSE),
    Row("linear_attn.in_proj_a.weight", "attn.in_proj_a.kernel", DENSE),
) + _LINEAR_COMMON
DENSE_MLP_ROWS = tuple(r for r in dense_hf.LAYER_TABLE if r.hf.startswith("mlp."))
MOE_ROWS = expert_rows("mlp", "gate_proj", "up_proj", "down_proj") + (
    Row("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.gate.kernel", DENSE),
    Row("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.up.kernel", DENSE),
    Row("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down.kernel", DENSE),
    Row("mlp.shared_expert_gate.weight", "mlp.shared_gate", DENSE),  # [1, embed] <-> [embed, 1]
)
IGNORED = (r"^mtp\.",)  # the multi-token-prediction layers: no MTP head here (transformers skips them too)


def key_table(config: MoEDecoderConfig, *, packed: bool = True, aliases: tuple[tuple[str, str], ...] = (),
              ignored: tuple[str, ...] = (), source: str = "nnx_zoo/models/qwen3_next/hf.py") -> KeyTable:
    """The HF key table of a model of this line: one ``Stack`` per layer kind (``config.layer_stacks()``), the
    linear layers' projections ``packed`` (Qwen3-Next) or separate (Qwen3.5); ``aliases`` / ``ignored`` for
    another layout of the same checkpoint (a multimodal one's text model)."""
    linear = PACKED_LINEAR_ROWS if packed else SEPARATE_LINEAR_ROWS
    stacks = []
    for name, kind, indices in config.layer_stacks():
        rows = NORM_ROWS + (linear if kind.attention == "linear" else FULL_ROWS)
        if kind.moe:
            stacks.append(Stack(name, "model.layers.{i}.", indices, rows + MOE_ROWS, FUSED_EXPERTS))
        else:
            stacks.append(Stack(name, "model.layers.{i}.", indices, rows + DENSE_MLP_ROWS))
    tied = (r"^lm_head\.weight$",) if config.tie_word_embeddings else ()
    return KeyTable(top=dense_hf.TOP_TABLE, stacks=tuple(stacks), ignored=tied + IGNORED + ignored, aliases=aliases,
                    source=source)
